//! The sandboxes: who they are, their tokens, their deadlines, and the only code that asks
//! the backend to create or destroy one. A sandbox is live (running, or paused with its memory:
//! frozen in place) or saved (paused to its files only, on disk: see [`crate::saved`]).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use hyper::StatusCode;

use cordon_sandbox::lifecycle::READY_TIMEOUT;
use cordon_sandbox::{served, Backend, Sandbox, SandboxSpec};

use crate::auth;
use crate::error::ApiError;
use crate::server_metrics::{EndReason, ServerMetrics, Source};

/// Longest TTL a create, connect or set_timeout may ask for (E2B's own cap is 24 h).
pub use cordon_sandbox::MAX_TIMEOUT_SECS;

/// Most requests in flight to one sandbox at once (streams included): one sandbox cannot
/// take all of the server's connections and memory.
pub const MAX_STREAMS_PER_SANDBOX: usize = 512;

/// One live sandbox.
pub struct LiveSandbox {
    pub id: String,
    pub tier: cordon_spec::Tier,
    pub template: String,
    pub token: String,
    /// The `trafficAccessToken`: opens the [`LiveSandbox::token_ports`] (see [`crate::port_token`]),
    /// not envd.
    pub traffic_token: String,
    /// Ports other than envd's that take only requests with a token: the image's start command's
    /// port, when it declares so.
    pub token_ports: Vec<u16>,
    /// Who may reach its other ports, and the Host they are given (see [`crate::traffic`]).
    pub traffic: crate::traffic::Traffic,
    /// The egress policy in force (the create's, then each update's), as GET reports it.
    pub(crate) network: Mutex<cordon_spec::NetworkPolicy>,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// The store image it runs on: the template's, or an image of its own (a resumed or forked
    /// sandbox's files; see `own_image`).
    pub image: String,
    /// An image made for this sandbox alone, deleted (with the layers only it names) once the
    /// sandbox is gone.
    pub own_image: Option<String>,
    /// What happens at its deadline, and whether traffic wakes it (E2B's `lifecycle`).
    pub lifecycle: crate::pause::Lifecycle,
    /// When it was paused in place (frozen), while it is.
    pub(crate) frozen: Mutex<Option<SystemTime>>,
    /// Held by every change of state (pause, resume, snapshot, fork, kill), so they happen one
    /// at a time per sandbox.
    pub transition: tokio::sync::Mutex<()>,
    pub started_at: SystemTime,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub envd_version: String,
    pub socket: PathBuf,
    /// Permits for requests in flight, see [`MAX_STREAMS_PER_SANDBOX`].
    pub streams: Arc<tokio::sync::Semaphore>,
    /// Its readings so far (see [`crate::metrics`]).
    pub metrics: crate::metrics::History,
    /// What its template's start command printed (see [`crate::sandbox_logs`]).
    pub logs: Arc<crate::sandbox_logs::SandboxLogs>,
    pub(crate) end_at: Mutex<SystemTime>,
    pub(crate) instance: Mutex<Option<Box<dyn Sandbox>>>,
    /// Its `volumeMounts`, as info shows them.
    pub volume_mounts: Vec<crate::volumes::MountRequest>,
    /// Its volumes held in use, released when it is destroyed.
    pub(crate) volume_leases: Mutex<Vec<cordon_volume::Lease>>,
}

impl LiveSandbox {
    pub fn end_at(&self) -> SystemTime {
        *self.end_at.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_end_at(&self, t: SystemTime) {
        *self.end_at.lock().unwrap_or_else(|p| p.into_inner()) = t;
    }

    /// When it was paused in place, if it is paused now.
    pub fn frozen_at(&self) -> Option<SystemTime> {
        *self.frozen.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_frozen(&self, at: Option<SystemTime>) {
        *self.frozen.lock().unwrap_or_else(|p| p.into_inner()) = at;
    }

    /// Whether it still has its instance (not destroyed yet).
    pub fn is_live(&self) -> bool {
        self.with_instance(false, |_| true)
    }

    /// Takes the instance out for a long blocking operation (a checkpoint), so that nothing
    /// waits on its lock meanwhile; readings answer `None` until [`LiveSandbox::put_instance`].
    pub(crate) fn take_instance(&self) -> Option<Box<dyn Sandbox>> {
        self.instance.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    pub(crate) fn put_instance(&self, i: Box<dyn Sandbox>) {
        *self.instance.lock().unwrap_or_else(|p| p.into_inner()) = Some(i);
    }

    /// `f` of the live instance, or `default` once it has been destroyed.
    pub fn with_instance<T>(&self, default: T, f: impl FnOnce(&dyn Sandbox) -> T) -> T {
        self.instance.lock().unwrap_or_else(|p| p.into_inner()).as_deref().map_or(default, f)
    }

    /// Whether its tier can save it to disk now, asked on a blocking thread: a tier may ask the
    /// sandbox itself (gvisor asks its agent whether runsc can save what runs).
    pub async fn checkpointable(self: &Arc<Self>) -> bool {
        let e = self.clone();
        tokio::task::spawn_blocking(move || e.with_instance(false, |i| i.checkpointable())).await.unwrap_or(false)
    }

    pub fn memory_current(&self) -> Option<u64> {
        self.with_instance(None, |i| i.memory_current())
    }

    pub fn cpu_usage_usec(&self) -> Option<u64> {
        self.with_instance(None, |i| i.cpu_usage_usec())
    }

    pub fn disk_usage(&self) -> Option<(u64, u64)> {
        self.with_instance(None, |i| i.disk_usage())
    }

    /// The syscalls its filter denied so far.
    pub fn denials(&self) -> Vec<cordon_sandbox::Denial> {
        self.with_instance(Vec::new(), |i| i.denials())
    }

    /// Connections its egress let out and attempts it refused so far.
    pub fn flow_counts(&self) -> Option<cordon_sandbox::FlowCounts> {
        self.with_instance(None, |i| i.flow_counts())
    }

    /// Processes the OOM killer ended in it so far, where the host can count them.
    pub fn oom_kills(&self) -> Option<u64> {
        self.with_instance(None, |i| i.oom_kills())
    }

    /// The network attempts its egress policy blocked so far.
    pub fn blocked(&self) -> Vec<cordon_sandbox::Blocked> {
        self.with_instance(Vec::new(), |i| i.blocked())
    }

    /// The headers its egress rules injected so far, per host and header name.
    pub fn injected(&self) -> Vec<cordon_sandbox::Injected> {
        self.with_instance(Vec::new(), |i| i.injected())
    }

    /// Replaces its egress policy (new connections only).
    pub fn set_network(&self, policy: cordon_spec::NetworkPolicy) -> Result<(), cordon_sandbox::Error> {
        self.with_instance(Err(cordon_sandbox::Error::Unavailable("the sandbox is gone".into())), |i| i.set_network(policy.clone()))?;
        *self.network.lock().unwrap_or_else(|p| p.into_inner()) = policy;
        Ok(())
    }

    /// The egress policy in force.
    pub fn network(&self) -> cordon_spec::NetworkPolicy {
        self.network.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// What a create asks for, before it has an id.
#[derive(Clone)]
pub struct NewSandbox {
    pub tier: cordon_spec::Tier,
    /// The template as the API shows it (`templateID`).
    pub template: String,
    /// The store image to run: the template's, or a saved sandbox's or a snapshot's.
    pub image: String,
    /// An image of this sandbox alone, deleted once it is gone (see [`LiveSandbox::own_image`]).
    pub own_image: Option<String>,
    pub lifecycle: crate::pause::Lifecycle,
    pub timeout: Duration,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub network: cordon_spec::NetworkPolicy,
    /// `allowPublicTraffic` and `maskRequestHost` (see [`crate::traffic`]).
    pub traffic: crate::traffic::Traffic,
    /// Start from a sandbox saved with its memory (see `SandboxSpec::restore`).
    pub restore: Option<PathBuf>,
    /// Start afresh on a disk kept by a files-only pause (see `SandboxSpec::disk_from`).
    pub disk_from: Option<PathBuf>,
    /// Volumes to mount (`volumeMounts`), by name.
    pub volume_mounts: Vec<crate::volumes::MountRequest>,
}

/// Who a sandbox is: new ones get fresh ids and tokens, a resumed one keeps its own.
pub struct Identity {
    pub id: String,
    pub token: String,
    pub traffic_token: String,
    /// A new sandbox, which may take a pooled sandbox's id; false for one that must keep its
    /// id (a resume).
    pub new: bool,
}

impl Identity {
    /// A new sandbox's: a fresh id (naming `node`, on a cluster node) and fresh tokens.
    fn fresh(node: &str) -> Identity {
        let id = cordon_cluster::ids::with_node(cordon_sandbox::new_id(), node);
        Identity { id, token: cordon_cluster::ids::with_node(auth::new_access_token(), node), traffic_token: auth::new_access_token(), new: true }
    }
}

/// The registry.
pub struct Sandboxes {
    pub(crate) backend: Arc<dyn Backend>,
    live: RwLock<HashMap<String, Arc<LiveSandbox>>>,
    /// Sandboxes paused to their files (and the disk they are kept on), when the server keeps
    /// state: `None` in servers without an image store of their own (tests).
    pub(crate) saved: Option<crate::saved::Saved>,
    /// Creates under way, counted against the limit so that a burst cannot overshoot it.
    pending: AtomicUsize,
    max: usize,
    envd_version: String,
    /// The egress CA networked sandboxes trust, when the server can inject headers.
    egress_ca: std::sync::OnceLock<String>,
    /// The warm pools (`--pool`), once the server has made them.
    pub(crate) pools: std::sync::OnceLock<Arc<crate::pool::Pools>>,
    /// What `GET /metrics` reports.
    pub stats: ServerMetrics,
    /// Set once a draining shutdown began: creates are refused from then on.
    draining: std::sync::atomic::AtomicBool,
    /// Where sandboxes that outlive this server are recorded for the next one, once set (see
    /// [`crate::adoption`]).
    pub(crate) live_dir: std::sync::OnceLock<PathBuf>,    /// This node's name in a cluster, which every new sandbox's id carries (see
    /// [`cordon_cluster::ids`]); unset on a standalone server.
    node: std::sync::OnceLock<String>,
}

/// A slot under the concurrency limit, held while a create runs.
struct Reservation<'a>(&'a AtomicUsize);

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Sandboxes {
    pub fn new(backend: Arc<dyn Backend>, max: usize, envd_version: String) -> Arc<Sandboxes> {
        Sandboxes::with_saved(backend, max, envd_version, None)
    }

    /// A registry that can pause sandboxes to disk and snapshot them, through `saved`.
    pub fn with_saved(backend: Arc<dyn Backend>, max: usize, envd_version: String, saved: Option<crate::saved::Saved>) -> Arc<Sandboxes> {
        Arc::new(Sandboxes { backend, live: RwLock::new(HashMap::new()), saved, pending: AtomicUsize::new(0), max, envd_version, egress_ca: std::sync::OnceLock::new(), pools: std::sync::OnceLock::new(), stats: ServerMetrics::default(), draining: Default::default(), live_dir: std::sync::OnceLock::new(), node: std::sync::OnceLock::new() })
    }

    /// Makes every networked sandbox trust the egress CA (its certificate, PEM), so that
    /// header injection rules can be given at create or later.
    pub fn trust_egress_ca(&self, pem: String) {
        let _ = self.egress_ca.set(pem);
    }

    /// The egress CA's certificate, when the server can inject headers.
    pub fn egress_ca(&self) -> Option<&str> {
        self.egress_ca.get().map(String::as_str)
    }

    /// What sandboxes of `tier` can do here.
    pub fn capabilities(&self, tier: cordon_spec::Tier) -> cordon_sandbox::Capabilities {
        self.backend.capabilities(tier)
    }

    /// Refuses a network policy the tier cannot enforce, before anything is built.
    pub fn check_network(&self, tier: cordon_spec::Tier, network: &cordon_spec::NetworkPolicy) -> Result<(), cordon_sandbox::Error> {
        self.backend.capabilities(tier).check_network(tier, network)
    }

    /// Makes every new sandbox's id name this cluster node.
    pub fn set_node(&self, name: &str) {
        let _ = self.node.set(name.to_string());
    }

    /// A new sandbox's identity: fresh id and tokens.
    pub fn fresh_identity(&self) -> Identity {
        Identity::fresh(self.node.get().map_or("", String::as_str))
    }

    pub fn envd_version(&self) -> &str {
        &self.envd_version
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<LiveSandbox>>> {
        self.live.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<LiveSandbox>>> {
        self.live.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<Arc<LiveSandbox>> {
        self.read().get(id).cloned()
    }

    pub(crate) fn take(&self, id: &str) -> Option<Arc<LiveSandbox>> {
        self.unlist(id, None)
    }

    /// Takes `id` out of the list and keeps its record for the next server, which adopts it.
    pub(crate) fn forget(&self, id: &str) -> Option<Arc<LiveSandbox>> {
        self.stats.retired.retire(|| self.write().remove(id))
    }

    /// Takes `id` out of the list (only if it is still `this`, when given), its totals moving
    /// to the metrics' retired ones in the same step.
    fn unlist(&self, id: &str, this: Option<&Arc<LiveSandbox>>) -> Option<Arc<LiveSandbox>> {
        let gone = self.stats.retired.retire(|| {
            let mut list = self.write();
            if this.is_some_and(|this| !list.get(id).is_some_and(|now| Arc::ptr_eq(now, this))) {
                return None;
            }
            list.remove(id)
        });
        if gone.is_some() {
            self.unpersist(id);
        }
        gone
    }

    pub fn by_token(&self, token: &str) -> Option<Arc<LiveSandbox>> {
        self.read().values().find(|e| auth::ct_eq(&e.token, token)).cloned()
    }

    pub fn all(&self) -> Vec<Arc<LiveSandbox>> {
        self.read().values().cloned().collect()
    }

    /// The concurrency limit (`--max-sandboxes`).
    pub fn max(&self) -> usize {
        self.max
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Live sandboxes and the creates under way: what a node tells the cluster it holds.
    pub fn len_with_creates(&self) -> usize {
        self.len() + self.pending.load(Ordering::SeqCst)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn reserve(&self) -> Result<Reservation<'_>, ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down (--shutdown drain): it takes no new sandboxes; create on another server").no_retry());
        }
        let pending = self.pending.fetch_add(1, Ordering::SeqCst) + 1;
        let r = Reservation(&self.pending);
        if self.len() + pending > self.max {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the limit of {} concurrent sandboxes is reached: kill one, or start the server with a higher --max-sandboxes", self.max),
            )
            .no_retry());
        }
        Ok(r)
    }

    /// The volumes of a create's `volumeMounts`, each held and mounted on the host.
    pub(crate) async fn lease_volumes(&self, mounts: &[crate::volumes::MountRequest], tier: cordon_spec::Tier) -> Result<Vec<(cordon_spec::VolumeMount, cordon_volume::Lease)>, ApiError> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        let api = self.volumes().ok_or_else(|| ApiError::bad_request("invalid mounts: this server keeps no volumes"))?.clone();
        let (mounts, can) = (mounts.to_vec(), self.backend.capabilities(tier).volumes);
        tokio::task::spawn_blocking(move || api.resolve(&mounts, can, tier)).await.map_err(|e| ApiError::internal(e.to_string()))?
    }

    /// The volume service, where the server keeps state.
    pub fn volumes(&self) -> Option<&Arc<crate::volumes::VolumeApi>> {
        self.saved.as_ref().and_then(|s| s.volumes.as_ref())
    }

    /// Creates a sandbox and returns once its agent answers.
    pub async fn create(self: &Arc<Self>, req: NewSandbox) -> Result<Arc<LiveSandbox>, ApiError> {
        self.create_as(req, self.fresh_identity()).await
    }

    /// The spec of `req`'s sandbox as `id` (its volumes are added once they are held).
    pub(crate) fn spec_for(&self, req: &NewSandbox, id: String) -> SandboxSpec {
        // Where the server keeps state and the tier can, every sandbox's files stay readable
        // from the host, so that it can be snapshotted, forked or paused to disk.
        let keep_writable = self.saved.is_some() && self.backend.capabilities(req.tier).keep_writable;
        SandboxSpec {
            id,
            tier: req.tier,
            image: req.image.clone(),
            limits: served::limits(req.memory_mb, req.cpu_count, req.disk_mb),
            env: req.env_vars.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            network: req.network.clone(),
            // The audit trail is served by `GET /sandboxes/{id}/audit`; it costs an idle thread.
            audit: true,
            keep_writable,
            restore: req.restore.clone(),
            disk_from: req.disk_from.clone(),
            // Every networked sandbox trusts it: rules may come with a later network update.
            egress_ca: self.egress_ca().filter(|_| req.network.is_enabled()).map(str::to_string),
            keep: self.keeps(req.tier),
            ..Default::default()
        }
    }

    /// Starts `spec`'s sandbox and returns once its agent answers and its template's start
    /// command is up (not for a sandbox restored with its memory: its service runs already),
    /// with the log that command's output goes to. On an error nothing of it is left.
    pub(crate) async fn start(&self, spec: &SandboxSpec, template: &str) -> Result<(Box<dyn Sandbox>, Arc<crate::sandbox_logs::SandboxLogs>), ApiError> {
        let instance = served::create(self.backend.clone(), spec)
            .await
            .map_err(ApiError::internal)?
            .map_err(|e| {
                tracing::info!(sandbox_id = %spec.id, template = %spec.image, "sandbox create refused: {e}");
                use cordon_sandbox::Error;
                match e {
                    Error::UnknownTemplate(m) => ApiError::not_found(m),
                    Error::BadRequest(m) | Error::Unavailable(m) => ApiError::bad_request(m),
                    e @ Error::NoNetwork => ApiError::bad_request(e.to_string()),
                    e @ Error::Failed { .. } => ApiError::internal(format!("cannot create the sandbox: {e}")),
                }
            })?;
        let socket = instance.socket_path().to_path_buf();
        if let Err(e) = cordon_envd::EnvdClient::new(socket.clone()).wait_healthy(READY_TIMEOUT).await {
            destroy_instance(&spec.id, instance).await;
            return Err(ApiError::internal(format!("the sandbox's agent did not start: {e}")));
        }
        let logs = Arc::new(crate::sandbox_logs::SandboxLogs::default());
        if let Some(start) = instance.start_command().filter(|_| spec.restore.is_none()).cloned() {
            if let Err(e) = crate::start_command::run(&socket, &start, instance.slowdown(), &logs).await {
                destroy_instance(&spec.id, instance).await;
                tracing::warn!(sandbox_id = %spec.id, template, "start command failed: {e}");
                return Err(ApiError::internal(format!("template '{template}': {e}")));
            }
        }
        Ok((instance, logs))
    }

    /// Creates a sandbox that is `who` (a new one, or a saved one resumed) and returns once its
    /// agent answers. A new one is taken from a warm pool where one matches (see
    /// [`crate::pool`]); its id is then the pooled sandbox's own.
    pub async fn create_as(self: &Arc<Self>, req: NewSandbox, who: Identity) -> Result<Arc<LiveSandbox>, ApiError> {
        let tier = req.tier;
        let made = self.create_listed(req, who).await;
        if let Err(e) = &made {
            self.stats.create_failed(tier, e.status);
        }
        made
    }

    async fn create_listed(self: &Arc<Self>, req: NewSandbox, mut who: Identity) -> Result<Arc<LiveSandbox>, ApiError> {
        let _slot = self.reserve()?;
        let started = Instant::now();
        let pooled = match self.pools.get() {
            Some(pools) if who.new && crate::pool::may_take(&req) => pools.take(&req, self.capabilities(req.tier).set_limits).await,
            _ => None,
        };
        let source = match (&pooled, who.new && req.restore.is_none() && req.disk_from.is_none() && req.own_image.is_none()) {
            (Some(_), _) => Source::Pool,
            (None, true) => Source::Cold,
            (None, false) => Source::Restore,
        };
        let ((instance, logs), leases) = match pooled {
            Some((id, started)) => {
                who.id = id;
                (started, Vec::new())
            }
            None => {
                let mut spec = self.spec_for(&req, who.id.clone());
                let leases = self.lease_volumes(&req.volume_mounts, req.tier).await?;
                spec.volumes = leases.iter().map(|(m, _)| m.clone()).collect();
                let leases: Vec<cordon_volume::Lease> = leases.into_iter().map(|(_, l)| l).collect();
                (self.start(&spec, &req.template).await?, leases)
            }
        };
        let socket = instance.socket_path().to_path_buf();
        let death = instance.death_fd();
        let start_command = instance.start_command().cloned();
        let entry = Arc::new(LiveSandbox {
            id: who.id,
            tier: req.tier,
            template: req.template,
            token: who.token,
            traffic_token: who.traffic_token,
            token_ports: start_command
                .iter()
                .filter(|s| s.needs_token)
                .filter_map(|s| s.ready_port)
                .filter(|p| *p != crate::ENVD_PORT)
                .collect(),
            traffic: req.traffic,
            network: Mutex::new(req.network),
            metadata: req.metadata,
            env_vars: req.env_vars,
            image: req.image,
            own_image: req.own_image,
            lifecycle: req.lifecycle,
            frozen: Mutex::new(None),
            transition: tokio::sync::Mutex::new(()),
            started_at: SystemTime::now(),
            cpu_count: req.cpu_count,
            memory_mb: req.memory_mb,
            disk_mb: req.disk_mb,
            envd_version: self.envd_version.clone(),
            socket: socket.clone(),
            streams: Arc::new(tokio::sync::Semaphore::new(MAX_STREAMS_PER_SANDBOX)),
            metrics: Default::default(),
            logs,
            end_at: Mutex::new(SystemTime::now() + req.timeout),
            instance: Mutex::new(Some(instance)),
            volume_mounts: req.volume_mounts,
            volume_leases: Mutex::new(leases),
        });
        self.enlist(&entry, death);
        self.stats.created(entry.tier, &entry.template, source, started.elapsed());
        tracing::info!(
            sandbox_id = %entry.id, template = %entry.template, timeout_s = req.timeout.as_secs(),
            cpus = entry.cpu_count, memory_mb = entry.memory_mb, ms = started.elapsed().as_millis() as u64,
            "sandbox created"
        );
        Ok(entry)
    }

    /// Lists `entry`, records it for the next server where it outlives this one, and watches
    /// its readings and its death (`death`, the tier's pidfd).
    pub(crate) fn enlist(self: &Arc<Self>, entry: &Arc<LiveSandbox>, death: Option<std::os::fd::OwnedFd>) {
        self.write().insert(entry.id.clone(), entry.clone());
        self.persist(entry);
        spawn_metrics(entry);
        if let Some(fd) = death {
            // A sandbox that dies by itself (OOM of its init, a kill from outside) leaves the
            // registry at once.
            // Only this entry: after a pause to disk and a quick resume, a new sandbox of the
            // same id may be listed by the time this one's old process is reaped.
            let (sandboxes, this) = (Arc::downgrade(self), Arc::downgrade(entry));
            tokio::spawn(async move {
                if cordon_sandbox::lifecycle::died(fd).await {
                    if let (Some(s), Some(this)) = (sandboxes.upgrade(), this.upgrade()) {
                        // After whatever transition is under way: a pause to disk ends the
                        // sandbox's processes itself, and then takes the entry.
                        let _turn = this.transition.lock().await;
                        // The OOM killer having acted in it says why, where the host counts.
                        let why = if this.oom_kills().unwrap_or(0) > 0 { EndReason::Oom } else { EndReason::Exited };
                        s.remove_this(&this, why).await;
                    }
                }
            });
        }
    }

    /// Sets the deadline to `now + timeout`. A paused sandbox has no deadline to set (E2B
    /// answers 404 there too).
    pub fn set_timeout(&self, id: &str, timeout: Duration) -> Option<Arc<LiveSandbox>> {
        let e = self.get(id).filter(|e| e.frozen_at().is_none())?;
        e.set_end_at(SystemTime::now() + timeout);
        self.persist(&e);
        tracing::info!(sandbox_id = %id, timeout_s = timeout.as_secs(), "sandbox timeout set");
        Some(e)
    }

    /// Moves the deadline to `now + timeout` if that is later (connect never shortens a life).
    pub fn extend(&self, id: &str, timeout: Duration) -> Option<Arc<LiveSandbox>> {
        let e = self.get(id)?;
        let want = SystemTime::now() + timeout;
        if want > e.end_at() {
            e.set_end_at(want);
            self.persist(&e);
        }
        tracing::info!(sandbox_id = %id, "sandbox connected");
        Some(e)
    }

    /// Takes a sandbox out of service at once (the data plane answers 502 from now on), then
    /// destroys it: `entry` if it is still the one listed under its id. False when it was not.
    pub async fn remove_this(&self, entry: &Arc<LiveSandbox>, reason: EndReason) -> bool {
        let Some(entry) = self.unlist(&entry.id, Some(entry)) else { return false };
        self.end(&entry, reason).await;
        true
    }

    /// Takes the sandbox `id` out of service and destroys it. False when it was not live.
    pub async fn remove(&self, id: &str, reason: EndReason) -> bool {
        let Some(entry) = self.unlist(id, None) else { return false };
        self.end(&entry, reason).await;
        true
    }

    async fn end(&self, entry: &Arc<LiveSandbox>, reason: EndReason) {
        self.destroy(entry).await;
        self.stats.ended(entry.tier, reason);
        tracing::info!(sandbox_id = %entry.id, reason = %reason, "sandbox destroyed");
    }

    /// Ends a sandbox at its deadline: paused if its lifecycle says so (and the tier can),
    /// destroyed otherwise; and deletes sandboxes paused for longer than the server keeps them.
    pub async fn expire_due(self: &Arc<Self>) {
        let now = SystemTime::now();
        let due: Vec<Arc<LiveSandbox>> = self.read().values().filter(|e| e.frozen_at().is_none() && e.end_at() <= now).cloned().collect();
        for e in due {
            if e.lifecycle.auto_pause {
                let this = self.clone();
                let memory = e.lifecycle.auto_pause_memory;
                // A pause to disk takes a while: the sweep goes on meanwhile.
                tokio::spawn(async move {
                    match crate::pause::pause(&this, &e.id, memory, true).await {
                        Ok(()) => tracing::info!(sandbox_id = %e.id, "sandbox paused at its timeout"),
                        Err(err) if err.status == StatusCode::CONFLICT => {}
                        Err(err) => {
                            tracing::warn!(sandbox_id = %e.id, "auto-pause failed, the sandbox is killed instead: {}", err.message);
                            this.remove(&e.id, EndReason::PauseFailed).await;
                        }
                    }
                });
            } else {
                self.remove(&e.id, EndReason::Timeout).await;
            }
        }
        let ttl = self.saved.as_ref().map_or(crate::saved::DEFAULT_PAUSED_TTL, |s| s.paused_ttl());
        let stale: Vec<String> = self.read().values().filter(|e| e.frozen_at().is_some_and(|t| t + ttl <= now)).map(|e| e.id.clone()).collect();
        for id in stale {
            self.remove(&id, EndReason::PausedTtl).await;
        }
        if let Some(saved) = &self.saved {
            saved.expire(now);
        }
    }

    /// Destroys a sandbox taken out of the registry, and the image only it used.
    pub(crate) async fn destroy(&self, entry: &Arc<LiveSandbox>) {
        destroy(entry).await;
        // Not an image a paused sandbox's record took over (a pause with memory or of the disk
        // of a sandbox that ran on its own image): it goes with that record.
        if let (Some(image), Some(saved)) = (&entry.own_image, &self.saved) {
            if !saved.names_image(image) {
                saved.drop_image(image).await;
            }
        }
    }

    /// Refuses creates from now on and destroys the pools' waiting sandboxes: the first step of
    /// a draining shutdown, whose live sandboxes go on until they end or its grace passes.
    pub async fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        if let Some(pools) = self.pools.get() {
            pools.close().await;
        }
    }

    /// Destroys everything (shutdown).
    pub async fn destroy_all(&self) {
        if let Some(pools) = self.pools.get() {
            pools.close().await;
        }
        // A sandbox paused with its memory would die with the server: where its files can be
        // kept, it stays paused (to its files) across the restart instead.
        if let Some(saved) = &self.saved {
            let frozen: Vec<Arc<LiveSandbox>> = self.read().values().filter(|e| e.frozen_at().is_some()).cloned().collect();
            for e in frozen {
                if !e.with_instance(false, |i| i.writable_layer().is_some()) {
                    continue;
                }
                match saved.pause_to_disk(&e).await {
                    Ok(_) => {
                        if let Some(gone) = self.take(&e.id) {
                            self.destroy(&gone).await;
                        }
                        tracing::info!(sandbox_id = %e.id, "paused sandbox kept to its files across the shutdown");
                    }
                    Err(err) => tracing::warn!(sandbox_id = %e.id, "cannot keep a paused sandbox across the shutdown: {}", err.message),
                }
            }
        }
        let ids: Vec<String> = self.read().keys().cloned().collect();
        let n = ids.len();
        let tasks: Vec<_> = ids.into_iter().map(|id| async move { self.remove(&id, EndReason::Shutdown).await }).collect();
        for t in tasks {
            t.await;
        }
        if n > 0 {
            tracing::info!(count = n, "all sandboxes destroyed");
        }
    }
}

/// Reads `entry` every [`crate::metrics::INTERVAL`] from now until it is destroyed.
fn spawn_metrics(entry: &Arc<LiveSandbox>) {
    let weak = Arc::downgrade(entry);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(crate::metrics::INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(e) = weak.upgrade() else { return };
            // Out for a checkpoint, or destroyed (then the last reference goes soon).
            if e.is_live() {
                e.metrics.record(crate::metrics::read(&e));
            }
        }
    });
}

pub(crate) async fn destroy(entry: &Arc<LiveSandbox>) {
    // Its volumes are free once it is gone (not while something may still hold the entry).
    let _leases = std::mem::take(&mut *entry.volume_leases.lock().unwrap_or_else(|p| p.into_inner()));
    let instance = entry.instance.lock().unwrap_or_else(|p| p.into_inner()).take();
    let Some(instance) = instance else { return };
    destroy_instance(&entry.id, instance).await;
}

/// Destroys an instance on a blocking thread, logging what goes wrong.
pub(crate) async fn destroy_instance(id: &str, mut instance: Box<dyn Sandbox>) {
    let id = id.to_string();
    let result = tokio::task::spawn_blocking(move || instance.destroy()).await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(sandbox_id = %id, "{e}"),
        Err(e) => tracing::warn!(sandbox_id = %id, "teardown panicked: {e}"),
    }
}

