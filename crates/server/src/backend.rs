//! What actually makes sandboxes: one [`Backend`] per isolation tier, behind one interface that
//! both front ends use (`cordon run` and `cordon serve`).
//!
//! [`JailBackend`] is the `ns` tier. A tier is added as a crate that makes sandboxes plus an
//! adapter here implementing [`Backend`] and [`Instance`], and an arm in [`Tiers::open`]. Tests
//! plug in their own backends.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cordon_spec::{Limits, NetworkPolicy, Tier};

pub use cordon_jail::audit::Denial;
pub use cordon_net::Blocked;

/// What a sandbox is created with, checked by the front end that asks.
#[derive(Debug, Clone)]
pub struct CreateSpec {
    pub id: String,
    /// The tier that must run it; [`Tiers`] dispatches on it, a single backend ignores it.
    pub tier: Tier,
    pub template: String,
    /// The sandbox's environment, applied over the image's own, in order (later wins).
    pub env_vars: Vec<(String, String)>,
    pub limits: Limits,
    /// The user commands run as when a request names none.
    pub default_user: String,
    /// Default working directory of commands; `None` means the user's home.
    pub workdir: Option<String>,
    /// Allow ptrace and process_vm_* inside (debuggers, profilers).
    pub allow_ptrace: bool,
    /// Record the syscalls the filter denies (see [`Instance::denials`]); costs a thread.
    pub audit: bool,
    /// Egress allowlist; the default (empty) policy means loopback only, no interface at all.
    pub network: NetworkPolicy,
}

impl CreateSpec {
    /// A spec with the defaults of the API: the `user` user, default limits, no extras.
    pub fn new(id: String, tier: Tier, template: String, limits: Limits) -> CreateSpec {
        CreateSpec {
            id,
            tier,
            template,
            env_vars: Vec::new(),
            limits,
            default_user: "user".into(),
            workdir: None,
            allow_ptrace: false,
            audit: false,
            network: NetworkPolicy::default(),
        }
    }
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
    /// The host cannot run the requested tier (missing tool or kernel feature); never a fallback.
    #[error("{0}")]
    Unavailable(String),
    /// Everything else: the host failed.
    #[error("{0}")]
    Failed(String),
}

/// A live sandbox as the front ends see it. Only `socket_path`, `death_fd`, `memory_current` and
/// `destroy` are required; the rest have defaults for backends that cannot tell.
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
    /// Kills every process of the sandbox now, without waiting; `destroy` still has to follow.
    fn kill(&self) {}
    /// How many times the memory cap killed a process.
    fn oom_kills(&self) -> u64 {
        0
    }
    /// Highest memory use seen, in bytes (0 when unknown).
    fn peak_memory(&self) -> u64 {
        0
    }
    /// How much Landlock the kernel enforced (`full`, `partial`, `none`), where the tier uses it.
    fn landlock(&self) -> Option<String> {
        None
    }
    /// The syscalls the host's filter denied, when created with `audit` and the tier has one.
    fn denials(&self) -> Vec<Denial> {
        Vec::new()
    }
    /// The network attempts the egress policy blocked (destination, name, reason, count).
    fn blocked(&self) -> Vec<Blocked> {
        Vec::new()
    }
    /// Replaces the egress policy of a running sandbox; it applies to new connections.
    fn set_network(&self, _policy: NetworkPolicy) -> Result<(), String> {
        Err("this sandbox was created without a network policy, or its tier cannot change one".into())
    }
    /// The service the sandbox's image starts in every sandbox (see [`crate::start`]).
    fn start_command(&self) -> Option<&cordon_image::StartCommand> {
        None
    }
    /// How many times slower than the host the sandbox runs code (an emulated CPU): waits on
    /// work inside it, like its start command's readiness, are stretched by this.
    fn slowdown(&self) -> u32 {
        1
    }
    /// Kills it and removes every trace. Blocking.
    fn destroy(&mut self) -> Result<(), String>;
}

/// Creates sandboxes. `create` blocks; the registry calls it on a blocking thread.
pub trait Backend: Send + Sync {
    fn create(&self, spec: &CreateSpec) -> Result<Box<dyn Instance>, BackendError>;
}

/// Build progress of an image built on first use, into the server's log.
struct LogProgress<'a>(&'a str);

impl cordon_image::Progress for LogProgress<'_> {
    fn stage(&mut self, index: usize, total: usize, name: &str) {
        tracing::info!(image = self.0, "building: step {}/{total}: {name}", index + 1);
    }

    fn line(&mut self, text: &str) {
        tracing::debug!(image = self.0, "build: {text}");
    }
}

/// The image `template` names in `store`, or a message listing the known ones. A built-in
/// recipe that is not built yet (say `code-interpreter-v1`) is built now, as `cordon run` does:
/// creates of it wait for the build (minutes, once), and a build that outlives its client's
/// request still finishes.
fn image_of(store: &cordon_image::Store, template: &str) -> Result<cordon_image::Image, BackendError> {
    match store.get(template) {
        Ok(img) if !store.is_stale(&img) => Ok(img),
        Ok(_) | Err(cordon_image::ImageError::NotFound { .. }) if cordon_image::recipes().contains(&template) => {
            tracing::info!(image = template, "template not built yet, or built from an older recipe: building it");
            let started = std::time::Instant::now();
            let img = store
                .build(template, &Default::default(), &mut LogProgress(template))
                .map_err(|e| BackendError::Failed(format!("building the image of template '{template}': {e}")))?;
            tracing::info!(image = template, secs = started.elapsed().as_secs(), size = img.meta.size_bytes, "image built");
            Ok(img)
        }
        // Only a recipe's image can be stale.
        Ok(img) => Ok(img),
        Err(cordon_image::ImageError::NotFound { .. }) => {
            let known: Vec<String> = store.list().unwrap_or_default().into_iter().map(|i| i.name).collect();
            Err(BackendError::UnknownTemplate(format!(
                "template '{}' not found; available templates: {} (build one with `cordon image build` or `cordon image import`)",
                template,
                if known.is_empty() { "none".to_string() } else { known.join(", ") }
            )))
        }
        Err(e) => Err(BackendError::UnknownTemplate(format!("template '{template}': {e}"))),
    }
}

/// The checks every front end made already, again where the backends take the spec: limits a
/// cgroup accepts and variables every command can be started with.
fn check_spec(spec: &CreateSpec) -> Result<(), BackendError> {
    let bad = |e: cordon_spec::SpecError| BackendError::BadRequest(format!("{}: {}", e.field, e.reason));
    spec.limits.validate().map_err(bad)?;
    cordon_spec::validate_env_vars(spec.env_vars.iter().map(|(k, v)| (k.as_str(), v.as_str()))).map_err(bad)
}

/// The agent's configuration for `spec`: the image's environment, then the spec's.
fn agent_config(spec: &CreateSpec, image: &cordon_image::Image, envd_version: Option<&str>) -> cordon_agent::AgentConfig {
    let mut env = image.meta.env.clone();
    for (k, v) in &spec.env_vars {
        env.retain(|(ek, _)| ek != k);
        env.push((k.clone(), v.clone()));
    }
    cordon_agent::AgentConfig {
        sandbox_id: spec.id.clone(),
        default_user: spec.default_user.clone(),
        workdir: spec.workdir.clone(),
        env,
        root: PathBuf::from("/"),
        envd_version: envd_version.map(str::to_string),
        isolate_commands: false,
    }
}

/// Everything a tier's backend may need to open: the state directory and the image store.
#[derive(Clone)]
pub struct Host {
    /// cordon's state directory (`/var/lib/cordon`).
    pub state_dir: PathBuf,
    /// The cordon binary, re-run as jailer or used as the sandbox's agent.
    pub exe: PathBuf,
    /// The envd version the agent reports (`None`: the agent's own default).
    pub envd_version: Option<String>,
    /// Where the egress forwarder resolves allowed names (`None`: the host's resolv.conf).
    pub dns_upstream: Option<std::net::SocketAddr>,
}

/// Every tier, each opened on first use, dispatching on [`CreateSpec::tier`]. A tier the host
/// cannot run is refused with the reason; it never falls back to another.
pub struct Tiers {
    host: Host,
    opened: Mutex<BTreeMap<&'static str, Arc<dyn Backend>>>,
}

impl Tiers {
    pub fn new(host: Host) -> Arc<Tiers> {
        Arc::new(Tiers { host, opened: Mutex::new(BTreeMap::new()) })
    }

    /// The backend of `tier`, opening it (and reaping what a crashed cordon left of it) on
    /// first use.
    pub fn backend(&self, tier: Tier) -> Result<Arc<dyn Backend>, BackendError> {
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = opened.get(tier.as_str()) {
            return Ok(b.clone());
        }
        let b = Self::open(&self.host, tier)?;
        opened.insert(tier.as_str(), b.clone());
        Ok(b)
    }

    /// Opens the backend of one tier: the single place that maps a tier to its implementation.
    pub fn open(host: &Host, tier: Tier) -> Result<Arc<dyn Backend>, BackendError> {
        let store = cordon_image::Store::open(&host.state_dir).map_err(|e| BackendError::Failed(e.to_string()))?;
        match tier {
            Tier::Ns => {
                let jail = cordon_jail::Jail::open(&host.state_dir, host.exe.clone())
                    .map_err(|e| BackendError::Unavailable(e.to_string()))?;
                Ok(JailBackend::new(jail, store, host.envd_version.clone(), host.dns_upstream))
            }
            Tier::Gvisor => {
                let gv = cordon_gvisor::Gvisor::open(&host.state_dir, &host.exe)
                    .map_err(|e| BackendError::Unavailable(e.to_string()))?;
                Ok(GvisorBackend::new(gv, store, host.envd_version.clone(), host.dns_upstream))
            }
            Tier::Vm => {
                let tier = cordon_vm::VmTier::open(&host.state_dir, host.exe.clone())
                    .map_err(|e| BackendError::Unavailable(e.to_string()))?;
                Ok(VmBackend::new(tier, store, host.envd_version.clone()))
            }
        }
    }
}

impl Backend for Tiers {
    fn create(&self, spec: &CreateSpec) -> Result<Box<dyn Instance>, BackendError> {
        self.backend(spec.tier)?.create(spec)
    }
}

/// The `ns` tier: images from the store, sandboxes from the jail.
pub struct JailBackend {
    jail: cordon_jail::Jail,
    store: cordon_image::Store,
    envd_version: Option<String>,
    dns_upstream: Option<std::net::SocketAddr>,
}

impl JailBackend {
    /// `jail` must come from `Jail::open`, which has already reaped what a crashed cordon left.
    pub fn new(
        jail: cordon_jail::Jail,
        store: cordon_image::Store,
        envd_version: Option<String>,
        dns_upstream: Option<std::net::SocketAddr>,
    ) -> Arc<JailBackend> {
        Arc::new(JailBackend { jail, store, envd_version, dns_upstream })
    }
}

struct JailInstance(cordon_jail::Sandbox, Option<cordon_net::Egress>, Option<cordon_image::StartCommand>);

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

    fn kill(&self) {
        self.0.kill()
    }

    fn oom_kills(&self) -> u64 {
        self.0.oom_kills()
    }

    fn peak_memory(&self) -> u64 {
        self.0.peak_memory()
    }

    fn landlock(&self) -> Option<String> {
        Some(self.0.landlock().to_string())
    }

    fn denials(&self) -> Vec<Denial> {
        self.0.denials()
    }

    fn blocked(&self) -> Vec<Blocked> {
        blocked_of(&self.1)
    }

    fn set_network(&self, policy: NetworkPolicy) -> Result<(), String> {
        set_network_of(&self.1, policy)
    }

    fn start_command(&self) -> Option<&cordon_image::StartCommand> {
        self.2.as_ref()
    }

    fn destroy(&mut self) -> Result<(), String> {
        // The forwarder goes first: nothing is dialled for a sandbox being torn down.
        self.1.take();
        self.0.destroy().map_err(|e| e.to_string())
    }
}

/// Serves a new sandbox's TUN device (if it has one) with the egress forwarder, on the caller's
/// runtime: the server's, or `run`'s.
fn start_egress(
    tun: Option<OwnedFd>,
    policy: &NetworkPolicy,
    dns_upstream: Option<std::net::SocketAddr>,
) -> Result<Option<cordon_net::Egress>, BackendError> {
    let Some(tun) = tun else { return Ok(None) };
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(BackendError::Failed("the egress forwarder needs a tokio runtime".into()));
    }
    let cfg = cordon_net::EgressConfig {
        gateways: vec![cordon_jail::tun::GATEWAY_V4.into(), cordon_jail::tun::GATEWAY_V6.into()],
        dns_upstream,
        mtu: cordon_jail::tun::MTU,
    };
    cordon_net::Egress::start(tun, policy.clone(), cfg)
        .map(Some)
        .map_err(|e| BackendError::Failed(format!("start the sandbox's egress forwarder: {e}")))
}

fn blocked_of(egress: &Option<cordon_net::Egress>) -> Vec<Blocked> {
    egress.as_ref().map(|e| e.blocked()).unwrap_or_default()
}

fn set_network_of(egress: &Option<cordon_net::Egress>, policy: NetworkPolicy) -> Result<(), String> {
    match egress {
        Some(e) => {
            e.update_policy(policy);
            Ok(())
        }
        None => Err("this sandbox was created without network access; create it with a policy to change one".into()),
    }
}

/// Ports for Landlock's TCP connect rules: only when every allow rule names ports (see the
/// jail's landlock module for why), and not absurdly many of them.
fn landlock_ports(policy: &NetworkPolicy) -> Option<Vec<(u16, u16)>> {
    if !policy.is_enabled() {
        return None;
    }
    let ports = policy.allowed_ports()?;
    let total: u32 = ports.iter().map(|(lo, hi)| u32::from(hi - lo) + 1).sum();
    (total <= 1024).then_some(ports)
}

/// Tiers without the egress forwarder refuse a policy rather than run with less than was asked.
/// Front ends call it before anything is built; the backends check again.
pub fn check_network_tier(tier: Tier, network: &NetworkPolicy) -> Result<(), BackendError> {
    if tier == Tier::Vm && network.is_enabled() {
        return Err(BackendError::BadRequest(format!(
            "network allowlists are enforced on the ns and gvisor tiers only so far; the {tier} tier runs with no network: drop the network rules or use another tier"
        )));
    }
    Ok(())
}

fn refuse_network(spec: &CreateSpec) -> Result<(), BackendError> {
    check_network_tier(spec.tier, &spec.network)
}

impl Backend for JailBackend {
    fn create(&self, spec: &CreateSpec) -> Result<Box<dyn Instance>, BackendError> {
        let image = image_of(&self.store, &spec.template)?;
        check_spec(spec)?;
        let mut agent_cfg = agent_config(spec, &image, self.envd_version.as_deref());
        // With ptrace off, no command may open another's memory through /proc either.
        agent_cfg.isolate_commands = !spec.allow_ptrace;
        let cfg = cordon_jail::SandboxConfig {
            id: spec.id.clone(),
            rootfs: image.rootfs.clone(),
            limits: spec.limits.clone(),
            agent_config: cordon_agent::encode_config(&agent_cfg),
            allow_ptrace: spec.allow_ptrace,
            audit: spec.audit,
            tun: spec.network.is_enabled(),
            connect_ports: landlock_ports(&spec.network),
        };
        let mut sb = self.jail.create(&cfg).map_err(|e| BackendError::Failed(e.to_string()))?;
        let egress = start_egress(sb.take_tun(), &spec.network, self.dns_upstream)?;
        Ok(Box::new(JailInstance(sb, egress, image.meta.start.clone())))
    }
}

/// The `gvisor` tier: images from the store, sandboxes run by runsc.
pub struct GvisorBackend {
    gv: cordon_gvisor::Gvisor,
    store: cordon_image::Store,
    envd_version: Option<String>,
    dns_upstream: Option<std::net::SocketAddr>,
}

impl GvisorBackend {
    /// `gv` must come from `Gvisor::open`, which has already reaped what a crashed cordon left.
    pub fn new(
        gv: cordon_gvisor::Gvisor,
        store: cordon_image::Store,
        envd_version: Option<String>,
        dns_upstream: Option<std::net::SocketAddr>,
    ) -> Arc<GvisorBackend> {
        Arc::new(GvisorBackend { gv, store, envd_version, dns_upstream })
    }
}

struct GvisorInstance(cordon_gvisor::Sandbox, Option<cordon_net::Egress>, Option<cordon_image::StartCommand>);

impl Instance for GvisorInstance {
    fn socket_path(&self) -> &Path {
        self.0.socket_path()
    }

    fn death_fd(&self) -> Option<OwnedFd> {
        self.0.pidfd().and_then(|fd| fd.try_clone().ok())
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

    fn kill(&self) {
        self.0.kill()
    }

    fn oom_kills(&self) -> u64 {
        self.0.cgroup().oom_kills()
    }

    fn peak_memory(&self) -> u64 {
        self.0.cgroup().peak_memory()
    }

    fn blocked(&self) -> Vec<Blocked> {
        blocked_of(&self.1)
    }

    fn set_network(&self, policy: NetworkPolicy) -> Result<(), String> {
        set_network_of(&self.1, policy)
    }

    fn start_command(&self) -> Option<&cordon_image::StartCommand> {
        self.2.as_ref()
    }

    fn destroy(&mut self) -> Result<(), String> {
        // The forwarder goes first: nothing is dialled for a sandbox being torn down.
        self.1.take();
        self.0.destroy().map_err(|e| e.to_string())
    }
}

impl Backend for GvisorBackend {
    fn create(&self, spec: &CreateSpec) -> Result<Box<dyn Instance>, BackendError> {
        refuse_network(spec)?;
        let image = image_of(&self.store, &spec.template)?;
        check_spec(spec)?;
        if spec.allow_ptrace {
            // gVisor implements ptrace in its own kernel: nothing to open up on the host.
            tracing::debug!(id = %spec.id, "allow_ptrace has no effect under gVisor");
        }
        let agent_cfg = agent_config(spec, &image, self.envd_version.as_deref());
        let cfg = cordon_gvisor::SandboxConfig {
            id: spec.id.clone(),
            rootfs: image.rootfs.clone(),
            limits: spec.limits.clone(),
            agent_config: cordon_agent::encode_config(&agent_cfg),
            tun: spec.network.is_enabled(),
        };
        let mut sb = self.gv.create(&cfg).map_err(|e| BackendError::Failed(e.to_string()))?;
        let egress = start_egress(sb.take_tun(), &spec.network, self.dns_upstream)?;
        Ok(Box::new(GvisorInstance(sb, egress, image.meta.start.clone())))
    }
}

/// The `vm` tier: images from the store, each sandbox a microVM with its own kernel.
pub struct VmBackend {
    tier: cordon_vm::VmTier,
    store: cordon_image::Store,
    envd_version: Option<String>,
}

impl VmBackend {
    /// `tier` must come from `VmTier::open`, which has already reaped what a crashed cordon left.
    pub fn new(tier: cordon_vm::VmTier, store: cordon_image::Store, envd_version: Option<String>) -> Arc<VmBackend> {
        Arc::new(VmBackend { tier, store, envd_version })
    }
}

struct VmInstance(cordon_vm::Vm, Option<cordon_image::StartCommand>);

impl Instance for VmInstance {
    fn socket_path(&self) -> &Path {
        self.0.socket_path()
    }

    fn death_fd(&self) -> Option<OwnedFd> {
        self.0.pidfd().and_then(|fd| fd.try_clone_to_owned().ok())
    }

    fn memory_current(&self) -> u64 {
        self.0.memory_current()
    }

    fn cpu_usage_usec(&self) -> u64 {
        self.0.cgroup().cpu_usage_usec()
    }

    fn kill(&self) {
        self.0.kill()
    }

    fn oom_kills(&self) -> u64 {
        self.0.oom_kills()
    }

    fn peak_memory(&self) -> u64 {
        self.0.peak_memory()
    }

    fn start_command(&self) -> Option<&cordon_image::StartCommand> {
        self.1.as_ref()
    }

    fn slowdown(&self) -> u32 {
        self.0.accel().slowdown()
    }

    fn destroy(&mut self) -> Result<(), String> {
        self.0.destroy().map_err(|e| e.to_string())
    }
}

impl Backend for VmBackend {
    fn create(&self, spec: &CreateSpec) -> Result<Box<dyn Instance>, BackendError> {
        refuse_network(spec)?;
        let image = image_of(&self.store, &spec.template)?;
        check_spec(spec)?;
        let vm_err = |e: cordon_vm::VmError| match e {
            cordon_vm::VmError::BadRequest(m) => BackendError::BadRequest(m),
            cordon_vm::VmError::Unsupported(m) => BackendError::Unavailable(m),
            e => BackendError::Failed(e.to_string()),
        };
        // Cached after the first VM of an image: the kit, the KVM/TCG verdict and the disk.
        let prep = self.tier.prepare(&image.name, &image.rootfs, &mut cordon_image::NoProgress).map_err(vm_err)?;
        let cfg = cordon_vm::VmConfig {
            id: spec.id.clone(),
            limits: spec.limits.clone(),
            agent: agent_config(spec, &image, self.envd_version.as_deref()),
        };
        let vm = self.tier.create(&cfg, &prep).map_err(vm_err)?;
        Ok(Box::new(VmInstance(vm, image.meta.start.clone())))
    }
}

/// How long a sandbox of the server may live at most, as far as its backend knows: the server
/// ends it earlier by its TTL; this is only a backstop beyond the longest TTL the API grants.
pub const SERVER_BACKSTOP: Duration = Duration::from_secs(crate::registry::MAX_TIMEOUT_SECS + 3600);
