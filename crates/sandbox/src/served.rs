//! How a long-running front end (`cordon serve`, `cordon mcp`) makes a sandbox on request: its
//! API sizes one in MiB and whole cores, and the blocking create must not hold the runtime.

use std::sync::Arc;

use cordon_spec::Limits;

use crate::{Backend, Error, Sandbox, SandboxSpec};

/// The limits of a sandbox sized by a front end's API. The front end ends the sandbox by its own
/// clock (a TTL, a session), so the backend gets only [`crate::SERVER_BACKSTOP`].
pub fn limits(memory_mb: u64, cpus: u32, disk_mb: u64) -> Limits {
    Limits {
        memory_bytes: memory_mb << 20,
        cpus: cpus as f64,
        disk_bytes: disk_mb << 20,
        timeout: crate::SERVER_BACKSTOP,
        ..Default::default()
    }
}

/// [`Backend::create`] on a blocking thread: a tier's create forks, mounts and waits, and the
/// runtime's workers keep serving other requests meanwhile. The outer error says the create
/// panicked (the message is ready to show); the inner one is the backend's answer, left for the
/// front end to map.
pub async fn create(backend: Arc<dyn Backend>, spec: &SandboxSpec) -> Result<Result<Box<dyn Sandbox>, Error>, String> {
    let spec = spec.clone();
    tokio::task::spawn_blocking(move || backend.create(&spec)).await.map_err(|e| format!("sandbox creation panicked: {e}"))
}
