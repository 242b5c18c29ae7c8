//! What actually makes sandboxes. [`JailBackend`] is the `ns` tier; tests plug in their own.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// What a sandbox is created with, checked by the API layer.
#[derive(Debug, Clone)]
pub struct CreateSpec {
    pub id: String,
    pub template: String,
    pub env_vars: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
}

/// Why a backend could not create a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The template names no image in the store.
    #[error("{0}")]
    UnknownTemplate(String),
    /// The requested resources are out of range.
    #[error("{0}")]
    BadRequest(String),
    /// Everything else: the host failed.
    #[error("{0}")]
    Failed(String),
}

/// A live sandbox as the registry sees it.
pub trait Instance: Send {
    /// The agent's socket.
    fn socket_path(&self) -> &Path;
    /// A pidfd that becomes readable when the sandbox dies, if the backend has one.
    fn death_fd(&self) -> Option<OwnedFd>;
    /// Memory in use now, in bytes.
    fn memory_current(&self) -> u64;
    /// CPU time used so far, in microseconds.
    fn cpu_usage_usec(&self) -> u64 {
        0
    }
    /// Bytes used and total of the writable layer.
    fn disk_usage(&self) -> (u64, u64) {
        (0, 0)
    }
    /// How many times the kernel's OOM killer has struck in it so far.
    fn oom_kills(&self) -> u64 {
        0
    }
    /// Kills it and removes every trace. Blocking.
    fn destroy(&mut self) -> Result<(), String>;
}

/// Creates sandboxes. `create` blocks; the registry calls it on a blocking thread.
pub trait Backend: Send + Sync {
    fn create(&self, spec: &CreateSpec) -> Result<Box<dyn Instance>, BackendError>;
}

/// The `ns` tier: images from the store, sandboxes from the jail.
pub struct JailBackend {
    jail: cordon_jail::Jail,
    store: cordon_image::Store,
    envd_version: String,
}

impl JailBackend {
    /// `jail` must come from `Jail::open`, which has already reaped what a crashed server left.
    pub fn new(jail: cordon_jail::Jail, store: cordon_image::Store, envd_version: String) -> Arc<JailBackend> {
        Arc::new(JailBackend { jail, store, envd_version })
    }
}

struct JailInstance(cordon_jail::Sandbox);

impl Instance for JailInstance {
    fn socket_path(&self) -> &Path {
        self.0.socket_path()
    }

    fn death_fd(&self) -> Option<OwnedFd> {
        self.0.pidfd().and_then(|fd| fd.try_clone_to_owned().ok())
    }

    fn memory_current(&self) -> u64 {
        self.0.cgroup().memory_current()
    }

    fn cpu_usage_usec(&self) -> u64 {
        self.0.cgroup().cpu_usage_usec()
    }

    fn disk_usage(&self) -> (u64, u64) {
        self.0.disk_usage()
    }

    fn oom_kills(&self) -> u64 {
        self.0.oom_kills()
    }

    fn destroy(&mut self) -> Result<(), String> {
        self.0.destroy().map_err(|e| e.to_string())
    }
}

/// A sandbox lives as long as the server says; the jail's own wall clock is only a backstop
/// beyond the longest TTL the API grants.
const JAIL_BACKSTOP: Duration = Duration::from_secs(crate::registry::MAX_TIMEOUT_SECS + 3600);

impl Backend for JailBackend {
    fn create(&self, spec: &CreateSpec) -> Result<Box<dyn Instance>, BackendError> {
        let image = match self.store.get(&spec.template) {
            Ok(img) => img,
            Err(cordon_image::ImageError::NotFound { .. }) => {
                let known: Vec<String> = self.store.list().unwrap_or_default().into_iter().map(|i| i.name).collect();
                return Err(BackendError::UnknownTemplate(format!(
                    "template '{}' not found; available templates: {} (build one with `cordon image build` or `cordon image import`)",
                    spec.template,
                    if known.is_empty() { "none".to_string() } else { known.join(", ") }
                )));
            }
            Err(e) => return Err(BackendError::UnknownTemplate(format!("template '{}': {e}", spec.template))),
        };
        let limits = cordon_spec::Limits {
            memory_bytes: spec.memory_mb << 20,
            cpus: spec.cpu_count as f64,
            disk_bytes: spec.disk_mb << 20,
            timeout: JAIL_BACKSTOP,
            ..Default::default()
        };
        limits.validate().map_err(|e| BackendError::BadRequest(format!("{}: {}", e.field, e.reason)))?;
        let mut env = image.meta.env.clone();
        for (k, v) in &spec.env_vars {
            env.retain(|(ek, _)| ek != k);
            env.push((k.clone(), v.clone()));
        }
        let agent_cfg = cordon_agent::AgentConfig {
            sandbox_id: spec.id.clone(),
            default_user: "user".into(),
            workdir: None,
            env,
            root: PathBuf::from("/"),
            envd_version: Some(self.envd_version.clone()),
        };
        let cfg = cordon_jail::SandboxConfig {
            id: spec.id.clone(),
            rootfs: image.rootfs.clone(),
            limits,
            agent_env: vec![(
                cordon_agent::ENV_CONFIG.into(),
                serde_json::to_string(&agent_cfg).map_err(|e| BackendError::Failed(e.to_string()))?,
            )],
            allow_ptrace: false,
            // The denied-syscall audit costs a thread per sandbox; `cordon run --audit` is the tool for it.
            audit: false,
        };
        let sb = self.jail.create(&cfg).map_err(|e| BackendError::Failed(e.to_string()))?;
        Ok(Box::new(JailInstance(sb)))
    }
}
