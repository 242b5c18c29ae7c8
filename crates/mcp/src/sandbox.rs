//! The sandboxes this server owns: one per MCP session, made lazily through a [`Backend`], and
//! all of them in one [`Pool`] so that shutdown can destroy whatever is still alive.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cordon_sandbox::lifecycle::READY_TIMEOUT;
use cordon_sandbox::{served, Backend, Sandbox, SandboxSpec};

use crate::config::Config;

/// A live sandbox as a session sees it: enough to talk to its agent.
#[derive(Debug, Clone)]
pub struct Live {
    pub id: String,
    pub socket: PathBuf,
}

impl Live {
    pub fn client(&self) -> cordon_envd::EnvdClient {
        cordon_envd::EnvdClient::new(self.socket.clone())
    }
}

/// Every live sandbox of this server, by id. The instances live only here.
pub struct Pool {
    backend: Arc<dyn Backend>,
    config: Config,
    live: Mutex<HashMap<String, Box<dyn Sandbox>>>,
    /// Teardowns under way (taken out of `live`, not yet finished): shutdown waits for them.
    tearing_down: std::sync::atomic::AtomicUsize,
}

/// Counts a teardown as under way for as long as it lives.
struct Teardown<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Teardown<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Pool {
    pub fn new(backend: Arc<dyn Backend>, config: Config) -> Arc<Pool> {
        Arc::new(Pool { backend, config, live: Mutex::new(HashMap::new()), tearing_down: Default::default() })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Box<dyn Sandbox>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a sandbox out of the pool for teardown; counted until the guard drops.
    fn take(&self, id: &str) -> Option<(Box<dyn Sandbox>, Teardown<'_>)> {
        let mut live = self.live();
        let instance = live.remove(id)?;
        self.tearing_down.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Some((instance, Teardown(&self.tearing_down)))
    }

    /// How many sandboxes are alive.
    pub fn len(&self) -> usize {
        self.live().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Creates a sandbox with the operator's settings and returns once its agent answers.
    pub async fn create(&self) -> Result<Live, String> {
        let c = &self.config;
        let spec = SandboxSpec {
            id: cordon_sandbox::new_id(),
            tier: c.tier,
            image: c.image.clone(),
            // Each call has its own timeout; the sandbox lives as long as the session.
            limits: served::limits(c.memory_mb, c.cpus, c.disk_mb),
            network: c.network.clone(),
            volumes: c.volumes.clone(),
            egress_ca: c.egress_ca.clone(),
            ..Default::default()
        };
        let started = Instant::now();
        let instance = served::create(self.backend.clone(), &spec)
            .await?
            .map_err(|e| match e {
                cordon_sandbox::Error::UnknownTemplate(m) | cordon_sandbox::Error::BadRequest(m) | cordon_sandbox::Error::Unavailable(m) => m,
                e => format!("cannot create the sandbox: {e}"),
            })?;
        let live = Live { id: spec.id.clone(), socket: instance.socket_path().to_path_buf() };
        self.live().insert(spec.id.clone(), instance);
        if let Err(e) = live.client().wait_healthy(READY_TIMEOUT).await {
            self.destroy(&live.id).await;
            return Err(format!("the sandbox's agent did not start: {e}"));
        }
        tracing::info!(sandbox_id = %live.id, image = %c.image, ms = started.elapsed().as_millis() as u64, "sandbox created");
        Ok(live)
    }

    /// The OOM kill count of a sandbox (`None` once it is gone or when it cannot be read).
    pub fn oom_kills(&self, id: &str) -> Option<u64> {
        self.live().get(id).and_then(|i| i.oom_kills())
    }

    /// Whether the sandbox's init is still alive, as far as the backend can tell.
    pub fn is_dead(&self, id: &str) -> bool {
        self.live().get(id).is_some_and(|i| i.is_dead())
    }

    /// Destroys one sandbox, waiting for its teardown.
    pub async fn destroy(&self, id: &str) {
        let Some((instance, _teardown)) = self.take(id) else { return };
        let id = id.to_string();
        match tokio::task::spawn_blocking(move || destroy_instance(&id, instance)).await {
            Ok(()) => {}
            Err(e) => tracing::warn!("teardown panicked: {e}"),
        }
    }

    /// Destroys one sandbox from synchronous code (a session's `Drop`), before returning.
    pub fn destroy_now(&self, id: &str) {
        let Some((instance, _teardown)) = self.take(id) else { return };
        let id = id.to_string();
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| destroy_instance(&id, instance))
            }
            _ => destroy_instance(&id, instance),
        }
    }

    /// Destroys every sandbox (shutdown).
    pub async fn destroy_all(&self) {
        let all: Vec<(String, Box<dyn Sandbox>)> = self.live().drain().collect();
        let n = all.len();
        let tasks: Vec<_> =
            all.into_iter().map(|(id, i)| tokio::task::spawn_blocking(move || destroy_instance(&id, i))).collect();
        for t in tasks {
            let _ = t.await;
        }
        // Sessions that ended just now may still be tearing theirs down on other threads.
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.tearing_down.load(std::sync::atomic::Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if n > 0 {
            tracing::info!(count = n, "all sandboxes destroyed");
        }
    }
}

fn destroy_instance(id: &str, mut instance: Box<dyn Sandbox>) {
    match instance.destroy() {
        Ok(()) => tracing::info!(sandbox_id = %id, "sandbox destroyed"),
        Err(e) => tracing::warn!(sandbox_id = %id, "{e}"),
    }
}

/// One MCP session's claim on a sandbox: none until the first tool call needs one; dropped with
/// the session, which destroys the sandbox.
pub struct SessionSandbox {
    pool: Arc<Pool>,
    current: Mutex<Option<Live>>,
    /// Serialises creation, so that concurrent first calls share one sandbox.
    creating: tokio::sync::Mutex<()>,
}

impl SessionSandbox {
    pub fn new(pool: Arc<Pool>) -> SessionSandbox {
        SessionSandbox { pool, current: Mutex::new(None), creating: tokio::sync::Mutex::new(()) }
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Option<Live>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session's sandbox, created now if it has none; `true` when it was just created.
    pub async fn get(&self) -> Result<(Live, bool), String> {
        if let Some(l) = self.current().clone() {
            return Ok((l, false));
        }
        let _g = self.creating.lock().await;
        if let Some(l) = self.current().clone() {
            return Ok((l, false));
        }
        let live = self.pool.create().await?;
        *self.current() = Some(live.clone());
        Ok((live, true))
    }

    /// Throws the sandbox away (if there is one); the next call gets a fresh one. Returns the id
    /// of the one destroyed.
    pub async fn reset(&self) -> Option<String> {
        let _g = self.creating.lock().await;
        let old = self.current().take()?;
        self.pool.destroy(&old.id).await;
        Some(old.id)
    }

    /// Forgets `id` if it is still the session's sandbox, destroying what is left of it (used
    /// when it died under a call).
    pub async fn discard(&self, id: &str) {
        let mine = {
            let mut cur = self.current();
            if cur.as_ref().is_some_and(|l| l.id == id) {
                cur.take()
            } else {
                None
            }
        };
        if mine.is_some() {
            self.pool.destroy(id).await;
        }
    }
}

impl Drop for SessionSandbox {
    fn drop(&mut self) {
        if let Some(live) = self.current().take() {
            self.pool.destroy_now(&live.id);
        }
    }
}
