//! Warm pools (`cordon serve --pool TEMPLATE[:TIER]=N`): sandboxes started ahead of the creates
//! that take them, so that a create is a hand-over instead of a start.
//!
//! - A pooled sandbox is started exactly as a create naming only its template would start it
//!   (the server's default limits and network, no env, no volumes), with its template's start
//!   command up, under an id of its own that no one has seen: when a create takes it, that id
//!   becomes the sandbox's id, so nothing of it has to be renamed (hostname, cgroups, run
//!   directory).
//! - A create matches a pool by template and tier, the pool's disk size (a writable layer's
//!   size is fixed when it is made), whether it has a network at all (a sandbox made
//!   without one has no interface to open), and on a tier that cannot change a running
//!   sandbox's caps (vm: a guest's memory is fixed at boot) the pool's memory and CPUs.
//!   Everything else is given at the hand-over: the memory and CPU caps are written to its
//!   cgroups, the network policy replaces the default one, the create's `envVars` go to the
//!   agent's `/init`; the tokens, metadata, deadline and lifecycle are the server's own. A create that matches no pool, or whose hand-over fails
//!   (its pooled sandbox is destroyed then), starts a sandbox of its own as without a pool.
//! - A pooled sandbox is used once: taken, it is an ordinary sandbox, destroyed at its end.
//!   Pooled sandboxes share nothing with each other or with the creates before them.
//! - Each pool refills in the background, one start at a time, while the pooled sandboxes'
//!   memory in use stays under `--pool-memory`; a failing start backs off (1 s doubling to a
//!   minute) and is logged. A pooled sandbox that died, or has waited [`MAX_AGE`], is replaced.
//! - Pooled sandboxes do not count against `--max-sandboxes` until taken; the server's
//!   shutdown destroys them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cordon_sandbox::Sandbox;
use cordon_spec::Tier;
use serde_json::{json, Value};

use crate::registry::{destroy_instance, NewSandbox};
use crate::App;

/// How long a pooled sandbox waits before it is replaced by a fresh one. Its backend's
/// backstop is extended by this much, so that a sandbox taken at any age may still live the
/// longest timeout the API grants.
pub const MAX_AGE: Duration = Duration::from_secs(12 * 3600);

/// How often a full pool looks for pooled sandboxes that died or aged.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// One `--pool` flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    pub template: String,
    pub tier: Tier,
    pub size: usize,
}

/// Why a `--pool` value is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolConfigError {
    #[error("--pool {0:?}: use TEMPLATE[:TIER]=N, e.g. base=4 or code-interpreter-v1:gvisor=2")]
    Shape(String),
    #[error("--pool {given:?}: {reason}")]
    Invalid { given: String, reason: String },
}

impl std::str::FromStr for PoolConfig {
    type Err = PoolConfigError;

    fn from_str(s: &str) -> Result<PoolConfig, PoolConfigError> {
        let invalid = |reason: String| PoolConfigError::Invalid { given: s.to_string(), reason };
        let (name, size) = s.rsplit_once('=').ok_or_else(|| PoolConfigError::Shape(s.to_string()))?;
        let size: usize = size.trim().parse().map_err(|_| invalid(format!("'{size}' is not a number of sandboxes")))?;
        if size == 0 || size > 1000 {
            return Err(invalid(format!("a pool holds 1 to 1000 sandboxes, not {size}")));
        }
        // A tier is the last `:`-part when it names one; otherwise the colon is a template tag.
        let (template, tier) = match name.rsplit_once(':') {
            Some((t, tier)) if tier.parse::<Tier>().is_ok() => (t, tier.parse::<Tier>().expect("checked")),
            _ => (name, Tier::Ns),
        };
        if template.is_empty() {
            return Err(PoolConfigError::Shape(s.to_string()));
        }
        // A store image's name, or a built template's `name:tag` (resolved when the pool fills).
        let (base, tag) = template.split_once(':').unwrap_or((template, "x"));
        let tag_ok = !tag.is_empty() && tag.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if cordon_image::validate_name(base).is_err() || !tag_ok {
            return Err(invalid(format!("'{template}' is not a valid template name")));
        }
        Ok(PoolConfig { template: template.to_string(), tier, size })
    }
}

/// A pooled sandbox waiting for a create: started as its pool's shape, under `id`.
struct Waiting {
    id: String,
    instance: Box<dyn Sandbox>,
    /// Its start command's output since it started (see [`crate::sandbox_logs`]).
    logs: Arc<crate::sandbox_logs::SandboxLogs>,
    since: Instant,
}

/// One pool: its flag, the create it stands in for, and its waiting sandboxes.
struct Pool {
    config: PoolConfig,
    /// The create a pooled sandbox is started as, once the filler has resolved the template to
    /// its store image (a built template's name names its build's image).
    shape: OnceLock<NewSandbox>,
    ready: Mutex<VecDeque<Waiting>>,
    starting: AtomicUsize,
    /// Creates taken from the pool, and creates that matched it while it was empty.
    taken: AtomicUsize,
    missed: AtomicUsize,
    /// Wakes the filler: one was taken, or the server is closing.
    wanted: tokio::sync::Notify,
}

impl Pool {
    fn ready(&self) -> std::sync::MutexGuard<'_, VecDeque<Waiting>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes of memory its waiting sandboxes use now.
    fn memory(&self) -> u64 {
        self.ready().iter().filter_map(|w| w.instance.memory_current()).sum()
    }

    /// Whether `req` can be handed one of this pool's sandboxes: `resizable` says whether the
    /// tier can rewrite a running sandbox's caps (otherwise they must be the pool's own).
    fn matches(&self, req: &NewSandbox, resizable: bool) -> bool {
        self.shape.get().is_some_and(|s| {
            s.tier == req.tier
                && s.image == req.image
                && s.disk_mb == req.disk_mb
                && s.network.is_enabled() == req.network.is_enabled()
                && (resizable || (s.memory_mb, s.cpu_count) == (req.memory_mb, req.cpu_count))
        })
    }
}

/// One pool's figures at one moment (`GET /pools`, `/metrics`).
pub struct PoolCounts {
    pub template: String,
    pub tier: Tier,
    pub size: usize,
    pub ready: usize,
    pub starting: usize,
    /// Creates given one of its sandboxes, and creates that matched it while it was empty.
    pub taken: usize,
    pub missed: usize,
    /// Bytes its waiting sandboxes use.
    pub memory: u64,
}

/// Every pool of the server, and their memory budget.
pub struct Pools {
    pools: Vec<Pool>,
    /// Bytes the waiting sandboxes may use together (`--pool-memory`).
    budget: u64,
    closed: AtomicBool,
}

/// Whether a create may be given a pooled sandbox at all: a new sandbox on a template's image,
/// not one restored, on a kept disk, on an image of its own, or with volumes.
pub fn may_take(req: &NewSandbox) -> bool {
    req.restore.is_none() && req.disk_from.is_none() && req.own_image.is_none() && req.volume_mounts.is_empty()
}

impl Pools {
    /// The pools of `configs` within `budget` bytes, filled in the background from now on.
    pub fn start(app: &Arc<App>, configs: Vec<PoolConfig>, budget: u64) -> Arc<Pools> {
        let pools = Arc::new(Pools {
            pools: configs
                .into_iter()
                .map(|config| Pool {
                    config,
                    shape: OnceLock::new(),
                    ready: Mutex::new(VecDeque::new()),
                    starting: AtomicUsize::new(0),
                    taken: AtomicUsize::new(0),
                    missed: AtomicUsize::new(0),
                    wanted: tokio::sync::Notify::new(),
                })
                .collect(),
            budget,
            closed: AtomicBool::new(false),
        });
        if app.sandboxes.pools.set(pools.clone()).is_err() {
            tracing::warn!("the server's pools were already made: these are not used");
            return pools;
        }
        for i in 0..pools.pools.len() {
            tokio::spawn(fill(app.clone(), pools.clone(), i));
        }
        pools
    }

    /// A pooled sandbox for `req`, given `req`'s caps, network and environment, as (its id,
    /// (its instance, its start command's log)); `None` when no pool matches or holds one, or the hand-over failed (the
    /// create then starts its own).
    pub async fn take(&self, req: &NewSandbox, resizable: bool) -> Option<(String, (Box<dyn Sandbox>, Arc<crate::sandbox_logs::SandboxLogs>))> {
        if self.closed.load(Ordering::SeqCst) {
            return None;
        }
        let pool = self.pools.iter().find(|p| p.matches(req, resizable))?;
        loop {
            let Some(w) = pool.ready().pop_front() else {
                pool.missed.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            pool.wanted.notify_one();
            if w.instance.is_dead() {
                tracing::info!(sandbox_id = %w.id, template = %pool.config.template, "a pooled sandbox had died: destroyed");
                destroy_instance(&w.id, w.instance).await;
                continue;
            }
            let Waiting { id, instance, logs, .. } = w;
            let shape = pool.shape.get().expect("a pool that matched has its shape");
            return match hand_over(instance, shape, req).await {
                Ok(instance) => {
                    pool.taken.fetch_add(1, Ordering::Relaxed);
                    Some((id, (instance, logs)))
                }
                Err((instance, why)) => {
                    tracing::warn!(sandbox_id = %id, template = %pool.config.template, "a pooled sandbox could not be handed over ({why}): destroyed, the create starts its own");
                    destroy_instance(&id, instance).await;
                    None
                }
            };
        }
    }

    /// Each pool's figures now, in flag order.
    pub fn counts(&self) -> Vec<PoolCounts> {
        self.pools
            .iter()
            .map(|p| {
                // Its own statement: the guard of `ready()` must be gone before `memory()`
                // takes the same lock.
                let ready = p.ready().len();
                PoolCounts {
                    template: p.config.template.clone(),
                    tier: p.config.tier,
                    size: p.config.size,
                    ready,
                    starting: p.starting.load(Ordering::Relaxed),
                    taken: p.taken.load(Ordering::Relaxed),
                    missed: p.missed.load(Ordering::Relaxed),
                    memory: p.memory(),
                }
            })
            .collect()
    }

    /// Each pool as `template:tier=size`.
    pub fn describe(&self) -> Vec<String> {
        self.pools.iter().map(|p| format!("{}:{}={}", p.config.template, p.config.tier, p.config.size)).collect()
    }

    /// The pools as `GET /pools` shows them.
    pub fn json(&self) -> Value {
        let list: Vec<Value> = self
            .counts()
            .into_iter()
            .map(|p| {
                json!({
                    "templateID": p.template,
                    "tier": p.tier.as_str(),
                    "size": p.size,
                    "ready": p.ready,
                    "starting": p.starting,
                    "taken": p.taken,
                    "missed": p.missed,
                    "memoryBytes": p.memory,
                })
            })
            .collect();
        json!({ "memoryBudgetBytes": self.budget, "pools": list })
    }

    /// Bytes of memory the waiting sandboxes of every pool use now.
    fn memory_in_use(&self) -> u64 {
        self.pools.iter().map(Pool::memory).sum()
    }

    /// Stops every refill and destroys the waiting sandboxes (the server's shutdown).
    pub async fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        for p in &self.pools {
            p.wanted.notify_one();
            let waiting: Vec<Waiting> = p.ready().drain(..).collect();
            for w in waiting {
                destroy_instance(&w.id, w.instance).await;
            }
        }
    }
}

/// Gives a pooled sandbox, started as `shape`, the caps, network and environment `req` asks
/// for. On an error the instance comes back with the reason, to be destroyed: it may be half
/// given.
async fn hand_over(instance: Box<dyn Sandbox>, shape: &NewSandbox, req: &NewSandbox) -> Result<Box<dyn Sandbox>, (Box<dyn Sandbox>, String)> {
    if (req.memory_mb, req.cpu_count) != (shape.memory_mb, shape.cpu_count) {
        let limits = cordon_sandbox::served::limits(req.memory_mb, req.cpu_count, req.disk_mb);
        if let Err(e) = instance.set_limits(&limits) {
            return Err((instance, e.to_string()));
        }
    }
    if req.network.is_enabled() {
        if let Err(e) = instance.set_network(req.network.clone()) {
            return Err((instance, e.to_string()));
        }
    }
    if !req.env_vars.is_empty() {
        let client = cordon_envd::EnvdClient::new(instance.socket_path().to_path_buf());
        if let Err(e) = client.init(&req.env_vars).await {
            return Err((instance, format!("the agent's /init: {e}")));
        }
    }
    Ok(instance)
}

/// Keeps pool `i` full while the server runs.
async fn fill(app: Arc<App>, pools: Arc<Pools>, i: usize) {
    let pool = &pools.pools[i];
    let closed = || pools.closed.load(Ordering::SeqCst);
    let template = pool.config.template.clone();
    let image = app.templates.as_ref().and_then(|t| t.resolve(&template)).unwrap_or_else(|| template.clone());
    let mut backoff = Backoff::default();
    // A recipe's image not built yet is built first, as for a create that names it.
    if let Some(builds) = &app.builds {
        while let Err(e) = builds.ready(&app.images, &image).await {
            tracing::warn!(template = %template, "pool: the template is not ready: {}; retrying in {:?}", e.message, backoff.delay);
            if backoff.wait(pool, closed).await {
                return;
            }
        }
    }
    let network = match app.network_default.policy(&[], &[], None) {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(template = %template, "pool: no default network policy ({}): the pool stays empty", e.reason);
            return;
        }
    };
    if let Err(e) = app.sandboxes.check_network(pool.config.tier, &network) {
        tracing::warn!(template = %template, "pool: {e}: the pool stays empty");
        return;
    }
    let shape = NewSandbox {
        tier: pool.config.tier,
        template: template.clone(),
        image,
        own_image: None,
        lifecycle: Default::default(),
        timeout: Duration::ZERO,
        metadata: Default::default(),
        env_vars: Default::default(),
        cpu_count: crate::api::DEFAULT_CPUS,
        memory_mb: crate::api::DEFAULT_MEMORY_MB,
        disk_mb: crate::api::DEFAULT_DISK_MB,
        network,
        traffic: Default::default(),
        restore: None,
        disk_from: None,
        volume_mounts: Vec::new(),
    };
    let shape = pool.shape.get_or_init(|| shape).clone();
    tracing::info!(template = %template, tier = %pool.config.tier, size = pool.config.size, "pool filling");
    loop {
        if closed() {
            return;
        }
        replace_stale(pool).await;
        let want = pool.ready().len() + pool.starting.load(Ordering::SeqCst) < pool.config.size;
        if want && pools.memory_in_use() < pools.budget {
            pool.starting.fetch_add(1, Ordering::SeqCst);
            let mut spec = app.sandboxes.spec_for(&shape, cordon_sandbox::new_id());
            spec.limits.timeout += MAX_AGE;
            let started = app.sandboxes.start(&spec, &template).await;
            pool.starting.fetch_sub(1, Ordering::SeqCst);
            match started {
                Ok((instance, _)) if closed() => destroy_instance(&spec.id, instance).await,
                Ok((instance, logs)) => {
                    backoff = Backoff::default();
                    pool.ready().push_back(Waiting { id: spec.id, instance, logs, since: Instant::now() });
                }
                Err(e) => {
                    tracing::warn!(template = %template, "pool: a start failed: {}; retrying in {:?}", e.message, backoff.delay);
                    if backoff.wait(pool, closed).await {
                        return;
                    }
                }
            }
            continue;
        }
        if want && pool.ready().is_empty() && pool.starting.load(Ordering::SeqCst) == 0 {
            tracing::debug!(template = %template, budget = pools.budget, "pool: the memory budget is used up");
        }
        tokio::select! {
            _ = pool.wanted.notified() => {}
            _ = tokio::time::sleep(CHECK_EVERY) => {}
        }
    }
}

/// Destroys the waiting sandboxes that died or waited [`MAX_AGE`]; the filler replaces them.
async fn replace_stale(pool: &Pool) {
    let stale: Vec<Waiting> = {
        let mut ready = pool.ready();
        let (stale, keep): (Vec<Waiting>, Vec<Waiting>) = ready.drain(..).partition(|w| w.instance.is_dead() || w.since.elapsed() >= MAX_AGE);
        ready.extend(keep);
        stale
    };
    for w in stale {
        tracing::info!(sandbox_id = %w.id, template = %pool.config.template, "pool: a waiting sandbox died or aged: replaced");
        destroy_instance(&w.id, w.instance).await;
    }
}

/// The wait after a failed start: 1 s, doubling to a minute.
struct Backoff {
    delay: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff { delay: Duration::from_secs(1) }
    }
}

impl Backoff {
    /// Waits the delay (or until the server closes: then true) and doubles it.
    async fn wait(&mut self, pool: &Pool, closed: impl Fn() -> bool) -> bool {
        let until = tokio::time::Instant::now() + self.delay;
        self.delay = (self.delay * 2).min(Duration::from_secs(60));
        loop {
            if closed() {
                return true;
            }
            tokio::select! {
                _ = pool.wanted.notified() => {}
                _ = tokio::time::sleep_until(until) => return closed(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{PoolConfig, PoolConfigError};
    use cordon_spec::Tier;

    #[test]
    fn pool_flags_parse_with_and_without_a_tier() {
        let p: PoolConfig = "base=4".parse().unwrap();
        assert_eq!(p, PoolConfig { template: "base".into(), tier: Tier::Ns, size: 4 });
        let p: PoolConfig = "code-interpreter-v1:gvisor=2".parse().unwrap();
        assert_eq!((p.template.as_str(), p.tier, p.size), ("code-interpreter-v1", Tier::Gvisor, 2));
        // A tag is not a tier.
        let p: PoolConfig = "mine:v2=1".parse().unwrap();
        assert_eq!((p.template.as_str(), p.tier), ("mine:v2", Tier::Ns));
        let p: PoolConfig = "mine:v2:vm=3".parse().unwrap();
        assert_eq!((p.template.as_str(), p.tier, p.size), ("mine:v2", Tier::Vm, 3));
    }

    #[test]
    fn bad_pool_flags_say_what_to_write() {
        assert!(matches!("base".parse::<PoolConfig>(), Err(PoolConfigError::Shape(_))));
        assert!(matches!("=3".parse::<PoolConfig>(), Err(PoolConfigError::Shape(_))));
        for bad in ["base=0", "base=x", "base=1001", "Bad Name=2"] {
            let e = bad.parse::<PoolConfig>().unwrap_err();
            assert!(matches!(e, PoolConfigError::Invalid { .. }), "{bad}: {e}");
            assert!(e.to_string().starts_with("--pool "), "{e}");
        }
    }
}
