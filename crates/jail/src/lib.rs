//! The `ns` tier: a sandbox made of Linux namespaces, an idmapped overlay root, cgroups and
//! nothing of the host.
//!
//! [`Jail`] owns the state directory. [`Jail::create`] plans a sandbox (id, uid range, cgroups),
//! records the plan in the run ledger (`cordon_host::ledger`) before touching the kernel (so a
//! crash at any point leaves something the next start can reap), then runs the [`jailer`] which builds the namespaces and
//! execs `cordon-agent` as the sandbox's PID 1. [`Sandbox`] is the live handle; dropping it
//! tears everything down. [`backend`] is the tier as a `cordon_sandbox::Backend`; cgroups, uid
//! slots and the TUN device come from `cordon-host`, shared with the other tiers.

mod adopt;
pub mod audit;
pub mod backend;
mod caps;
pub mod diagnose;
pub mod jailer;
pub mod landlock;
mod procview;
mod rootfs;
mod seccomp;
mod sys;

pub use cordon_host::{cgroup, ledger, slots, tun, Cgroup, Layout, Ledger, Slot, Slots, UID_BASE, UID_COUNT};
/// Brings up `lo` in the caller's network namespace (the vm tier's guest init uses it too).
pub use seccomp::programs as seccomp_programs;
pub use sys::{loopback_up, send_fd_with};

use cordon_sandbox::host_sandbox::HostSandbox;
use cordon_spec::Limits;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Errors of the ns tier. Each message says what failed and, where there is one, the fix.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// An operation on the host failed.
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    /// The sandbox could not be built; the message comes from the step that failed.
    #[error("{0}")]
    Setup(String),
    /// Every uid range is taken by a live sandbox.
    #[error("no free uid range: {0} sandboxes are running; stop some or raise the limit")]
    NoSlot(u32),
    /// The host lacks something the tier needs.
    #[error("the ns tier cannot run here: {0}")]
    Unsupported(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> JailError {
    let what = what.into();
    move |source| JailError::Io { what, source }
}

/// What to create.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    pub id: String,
    /// The image's layer trees, bottom first (read-only; never written), stacked as the
    /// overlay's lower layers.
    pub layers: Vec<PathBuf>,
    pub limits: Limits,
    /// The agent's configuration, as it reads it from its descriptor `CORDON_AGENT_CONFIG_FD`
    /// (see `cordon_agent::encode_config`); the jail hands it over as is.
    pub agent_config: Vec<u8>,
    /// Allow ptrace and process_vm_* inside (debuggers, profilers); off by default.
    pub allow_ptrace: bool,
    /// Record every denied syscall (see [`audit`]).
    pub audit: bool,
    /// Egress: a TUN interface whose descriptor the caller takes with [`Sandbox::take_tun`]
    /// and serves (see [`tun`]); without it the sandbox has loopback only.
    pub tun: bool,
    /// TCP ports Landlock lets the sandbox connect to, as a second layer under the netns;
    /// `None` leaves TCP to the netns alone (see `landlock`).
    pub connect_ports: Option<Vec<(u16, u16)>>,
    /// Keep the writable layer: instead of a tmpfs private to the sandbox's mount namespace, a
    /// tmpfs (of the same size cap) mounted at this host path, which outlives the sandbox. An
    /// image build reads the overlay's upper directory (`<path>/upper`) from it once the sandbox
    /// is gone and then calls [`release_writable`]. The path must not exist yet.
    pub writable: Option<PathBuf>,
    /// Keep the writable layer in the sandbox's run directory, where the host can read it
    /// while the sandbox lives (see [`Sandbox::writable_upper`]) and which goes with the
    /// sandbox, however its owner ends. Ignored when `writable` is given.
    pub keep_writable: bool,
    /// Volumes bound in, each idmapped for the sandbox's uid range.
    pub volumes: Vec<cordon_spec::VolumeMount>,
    /// The host's egress CA, which the sandbox trusts (`SandboxSpec::egress_ca`).
    pub egress_ca: Option<String>,
    /// The user commands run as when they name none (the agent's), for the isolation report.
    pub default_user: String,
    /// Left running when this process exits, for the next owner to adopt with [`Jail::adopt`]
    /// (`SandboxSpec::keep`).
    pub keep: bool,
}

/// Unmounts and removes a writable layer kept with [`SandboxConfig::writable`].
pub fn release_writable(path: &Path) -> io::Result<()> {
    match sys::umount_detach(path) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) || e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    match fs::remove_dir(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The state directory and the cgroup layout of this host.
pub struct Jail {
    ledger: Ledger,
    slots: slots::Slots,
    layout: Layout,
    exe: PathBuf,
}

impl Jail {
    /// Opens (creating) `<state>/run` and `<state>/slots`, and reaps whatever a previous,
    /// crashed instance left behind. `exe` is the cordon binary, re-run as the jailer.
    pub fn open(state_dir: &Path, exe: PathBuf) -> Result<Jail, JailError> {
        let ledger = Ledger::open(state_dir.join("run"), "sandbox").map_err(io_err("open the run directory"))?;
        let slots = slots::Slots::open_host(&state_dir.join("slots")).map_err(io_err("open slot directory"))?;
        let layout = Layout::detect();
        let missing = layout.missing();
        if !missing.is_empty() {
            return Err(JailError::Unsupported(format!(
                "cgroup controllers missing: {} (mount them, or on cgroup v2 enable them in cgroup.subtree_control)",
                missing.join(", ")
            )));
        }
        let jail = Jail { ledger, slots, layout, exe };
        jail.reap_orphans();
        Ok(jail)
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Kills and removes every sandbox whose owning process is gone. Returns how many.
    pub fn reap_orphans(&self) -> usize {
        self.ledger.reap()
    }

    /// Creates a running sandbox whose agent is listening on [`Sandbox::socket_path`].
    pub fn create(&self, cfg: &SandboxConfig) -> Result<Sandbox, JailError> {
        cfg.limits.validate().map_err(|e| JailError::Setup(e.to_string()))?;
        // Held for the sandbox's life: a free lock means a dead owner (see `reap_orphans`).
        let entry = self.ledger.begin(&cfg.id, 0o777).map_err(io_err("make the sandbox's run directory"))?;

        let mut sb = Sandbox {
            id: cfg.id.clone(),
            entry,
            socket: PathBuf::new(),
            cgroup: Cgroup::plan(&self.layout, &cfg.id),
            slot: None,
            pidfd: None,
            pid: 0,
            torn_down: false,
            landlock: None,
            audit: None,
            tun: None,
            kept_writable: None,
            keeps_writable: false,
            allow_ptrace: cfg.allow_ptrace,
            notifies: cfg.audit,
            connect_ports: cfg.connect_ports.clone(),
            default_user: cfg.default_user.clone(),
            keep: cfg.keep,
        };
        // From here on, dropping `sb` on any error undoes every step taken so far.
        let slot = self.slots.acquire().ok_or(JailError::NoSlot(self.slots.capacity()))?;
        let slot_index = slot.index;
        sb.slot = Some(slot);
        sb.socket = sb.entry.dir().join("agent.sock");
        let uid_base = UID_BASE + slot_index * UID_COUNT;
        let in_entry = (cfg.writable.is_none() && cfg.keep_writable).then(|| sb.entry.kept_writable());
        let staging = match cfg.writable.as_ref().or(in_entry.as_ref()) {
            None => {
                let staging = sb.entry.dir().join("root");
                fs::create_dir(&staging).map_err(io_err("create staging dir"))?;
                staging
            }
            Some(w) => {
                fs::create_dir(w).map_err(io_err(format!("create the writable layer's directory {}", w.display())))?;
                // Owned by the sandbox's root, so that it can make the overlay's directories.
                let opts = format!("size={},mode=0755,uid={uid_base},gid={uid_base}", cfg.limits.disk_bytes);
                if let Err(e) = sys::mount("cordon-rw", w, "tmpfs", libc::MS_NOATIME | libc::MS_NOSUID | libc::MS_NODEV, Some(&opts)) {
                    let _ = fs::remove_dir(w);
                    return Err(io_err("mount the writable layer")(e));
                }
                // One in the run directory goes with the entry; another is the caller's once
                // the create succeeds.
                match in_entry {
                    Some(_) => sb.keeps_writable = true,
                    None => sb.kept_writable = Some(w.clone()),
                }
                w.clone()
            }
        };
        sb.write_record()?;
        cordon_sandbox::trace::mark("ns: run directory, writable layer and record");
        sb.cgroup.create(&cfg.limits).map_err(io_err("create cgroups"))?;
        cordon_sandbox::trace::mark("ns: cgroups made");

        let jcfg = jailer::JailerConfig {
            id: cfg.id.clone(),
            layers: cfg.layers.clone(),
            staging,
            socket: sb.socket.clone(),
            premounted: cfg.writable.is_some() || sb.keeps_writable,
            uid_base,
            uid_count: UID_COUNT,
            cgroup_unified: sb.cgroup.unified_dir().map(Path::to_path_buf),
            cgroup_v1_tasks: sb.cgroup.v1_tasks_files(),
            disk_bytes: cfg.limits.disk_bytes,
            nofile: cfg.limits.nofile,
            agent_config: cfg.agent_config.clone(),
            agent_config_len: cfg.agent_config.len(),
            allow_ptrace: cfg.allow_ptrace,
            audit: cfg.audit,
            tun: cfg.tun,
            connect_ports: cfg.connect_ports.clone(),
            volumes: cfg.volumes.clone(),
            egress_ca: cfg.egress_ca.clone(),
        };
        let (reply, taken) = jailer::spawn(&self.exe, &jcfg).map_err(io_err("run jailer"))?;
        cordon_sandbox::trace::mark("ns: jailer answered (its exec included)");
        sb.tun = taken.tun;
        if let Some(l) = taken.listener {
            sb.audit = Some(audit::supervise(l, &cfg.id).map_err(io_err("start audit thread"))?);
        }
        match reply {
            jailer::JailerReply::Failed { error } => Err(JailError::Setup(error)),
            jailer::JailerReply::Ready { pid, phases, landlock, .. } => {
                tracing::debug!(id = %cfg.id, ?phases, ?landlock, "jailer done (µs since jailer start)");
                if cordon_sandbox::trace::enabled() {
                    let steps: Vec<String> = phases.iter().map(|(name, us)| format!("{name} {:.2}", *us as f64 / 1e3)).collect();
                    cordon_sandbox::trace::note(format!("the jailer, in ms from its own start: {}", steps.join(", ")));
                }
                sb.landlock = landlock;
                sb.pid = pid;
                sb.pidfd = Some(sys::pidfd_open(pid).map_err(io_err("pidfd_open sandbox init"))?);
                if sb.keep {
                    // Before the record says `keep`: an adopter finds both or neither.
                    adopt::Facts::of(&sb, cfg.tun).write(sb.entry.dir()).map_err(io_err("write the sandbox's facts"))?;
                }
                sb.write_record()?;
                // From here on the caller owns the kept writable layer.
                sb.kept_writable = None;
                Ok(sb)
            }
        }
    }
}

/// A live sandbox. Dropping it kills everything in it and removes every trace.
pub struct Sandbox {
    id: String,
    /// The run directory (socket, staging root, record), locked while the sandbox lives.
    entry: ledger::Entry,
    socket: PathBuf,
    cgroup: Cgroup,
    slot: Option<slots::Slot>,
    pidfd: Option<OwnedFd>,
    pid: i32,
    torn_down: bool,
    landlock: Option<landlock::Enforced>,
    audit: Option<audit::Trail>,
    tun: Option<OwnedFd>,
    /// A kept writable layer mounted by a `create` that has not succeeded yet: released if
    /// the create fails (see [`SandboxConfig::writable`]).
    kept_writable: Option<PathBuf>,
    /// The writable layer is a host mount in the run directory ([`SandboxConfig::keep_writable`]).
    keeps_writable: bool,
    /// The filter's and Landlock's settings, for the isolation report.
    allow_ptrace: bool,
    /// The filter hands denied syscalls to a listener (built for the audit). It stays so for
    /// the sandbox's life, even once the listener is gone with an earlier owner.
    notifies: bool,
    connect_ports: Option<Vec<(u16, u16)>>,
    /// The user commands run as when they name none, for the isolation report.
    default_user: String,
    /// Left running when this process exits (see [`SandboxConfig::keep`]).
    keep: bool,
}

impl Sandbox {
    /// The overlay's upper directory (the sandbox's own files), when the host keeps the
    /// writable layer: readable from the host while the sandbox lives, consistent while it is
    /// frozen. Owners are host uids, shifted by [`Sandbox::uid_base`].
    pub fn writable_upper(&self) -> Option<PathBuf> {
        self.keeps_writable.then(|| self.entry.kept_writable().join("upper"))
    }

    /// The host end of the sandbox's TUN interface, once; `None` without an egress policy.
    pub fn take_tun(&mut self) -> Option<OwnedFd> {
        self.tun.take()
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Host pid of the sandbox's init (the agent).
    pub fn host_pid(&self) -> i32 {
        self.pid
    }

    /// First host uid of this sandbox's range: sandbox uid N is host uid `uid_base() + N`.
    pub fn uid_base(&self) -> u32 {
        UID_BASE + self.slot.as_ref().map_or(0, |s| s.index) * UID_COUNT
    }

    fn write_record(&self) -> Result<(), JailError> {
        let rec = ledger::Record {
            id: self.id.clone(),
            cgroup: self.cgroup.clone(),
            pid: (self.pid > 0).then_some(self.pid),
            slot: self.slot.as_ref().map(|s| s.index),
            // Kept only once it runs: a create that dies half way is reaped as ever.
            keep: self.keep && self.pid > 0,
        };
        self.entry.write(&rec).map_err(io_err("write record"))
    }
}

/// What the sandbox crate's [`HostBacked`](cordon_sandbox::host_sandbox::HostBacked) needs of a
/// live ns sandbox.
impl HostSandbox for Sandbox {
    type Error = JailError;

    /// A pidfd of the init; it becomes readable when the sandbox dies.
    fn death_fd(&self) -> Option<OwnedFd> {
        self.pidfd.as_ref().and_then(|fd| fd.try_clone().ok())
    }

    /// The agent's socket, reachable only from the host.
    fn socket_path(&self) -> &Path {
        &self.socket
    }

    fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// Kills every process of the sandbox now. Killing the init of a pid namespace makes the
    /// kernel kill all of it; the cgroup kill catches anything else in the groups.
    fn kill(&self) {
        if let Some(fd) = &self.pidfd {
            let _ = sys::pidfd_kill(fd);
        }
        self.cgroup.kill();
    }

    /// Bytes used and total of the writable layer, read through the init's view of its root.
    fn disk_usage(&self) -> Option<(u64, u64)> {
        if self.pid <= 0 {
            return None;
        }
        cordon_host::sys::disk_usage(Path::new(&format!("/proc/{}/root/", self.pid)))
    }

    /// Kills the sandbox and removes its processes, cgroups and files. Idempotent.
    fn destroy(&mut self) -> Result<(), JailError> {
        if self.torn_down {
            return Ok(());
        }
        self.torn_down = true;
        self.kill();
        if let Some(fd) = &self.pidfd {
            // The init of a pid namespace exits only after the kernel has killed and reaped
            // every other process in it, so once it is reaped the sandbox is empty. It is our
            // child when we are a subreaper (the usual case): wait for it without polling.
            let _ = sys::pidfd_wait(fd, true);
        }
        let emptied = self.cgroup.kill_and_wait(Duration::from_secs(5));
        let removed = self.cgroup.remove();
        self.entry.remove();
        if let Some(w) = self.kept_writable.take() {
            if let Err(e) = release_writable(&w) {
                tracing::warn!(path = %w.display(), error = %e, "cannot release a writable layer");
            }
        }
        // Emptied: every process that ran under its uids is gone, so its range is ours to reuse
        // at once (see `Slot::release_emptied`).
        match self.slot.take() {
            Some(slot) if emptied => slot.release_emptied(),
            other => drop(other),
        }
        if !emptied {
            return Err(JailError::Setup(format!("sandbox {} did not die within 5 s", self.id)));
        }
        removed.map_err(io_err("remove cgroups"))
    }

    /// The syscalls the filter denied so far, when the sandbox was created with `audit`.
    fn denials(&self) -> Vec<cordon_sandbox::Denial> {
        self.audit.as_ref().map(|a| a.denials()).unwrap_or_default()
    }

    /// How much Landlock the kernel enforced (`unknown` if the init never said).
    fn landlock(&self) -> Option<String> {
        Some(self.landlock.map_or("unknown", landlock::Enforced::as_str).to_string())
    }

    /// Measured on the host from the init's `/proc` entries, except the default user's
    /// capabilities and the filter's digest, which are what this tier sets (the probe checks
    /// them from inside).
    fn tier_facts(&self) -> cordon_sandbox::report::TierFacts {
        use cordon_host::proc_facts as pf;
        use cordon_sandbox::report::{Runtime, Seccomp, TierFacts, UserCaps};
        let release = fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|r| r.trim().to_string());
        let runtime = Runtime { version: release.clone(), kernel: release.map(|r| format!("{r} (the host's, shared)")), ..Default::default() };
        let mut f = TierFacts { runtime, ..Default::default() };
        let pid = self.pid;
        let mut fact = |field: &'static str, r: io::Result<()>| {
            if let Err(e) = r {
                f.unknown.insert(field, format!("cannot read it from the host: {e}"));
            }
        };
        let mut namespaces = None;
        fact("namespaces", pf::namespaces(pid).map(|n| namespaces = Some(n)));
        let (mut uid, mut gid) = (None, None);
        fact("idMaps", pf::id_map(pid, "uid_map").and_then(|u| pf::id_map(pid, "gid_map").map(|g| (uid, gid) = (Some(u), Some(g)))));
        let mut pid1 = None;
        fact("capabilities.pid1", pf::Creds::read(pid).map(|c| pid1 = Some(c)));
        let mut mounts = None;
        fact("mounts", pf::mounts(pid).map(|m| mounts = Some(m)));
        f.namespaces = namespaces;
        (f.uid_map, f.gid_map) = (uid, gid);
        f.pid1 = pid1;
        f.mounts = mounts;
        f.default_user = (!self.default_user.is_empty()).then(|| UserCaps::of(&self.default_user, caps::command_bounding()));
        if f.default_user.is_none() {
            f.unknown.insert("capabilities.defaultUser", "the sandbox was made without an agent configuration".into());
        }
        let sha = |b: &[u8]| -> String {
            use sha2::Digest;
            sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
        };
        f.seccomp = Some(Seccomp {
            sha256: sha(&seccomp::program(self.allow_ptrace, self.notifies)),
            policy: "crates/jail/seccomp/sandbox.json (built in)".into(),
            policy_sha256: sha(seccomp::POLICY.as_bytes()),
            notified: match (self.notifies, self.audit.is_some()) {
                (true, true) => "every syscall the allowlist denies: the host records it and answers EPERM".into(),
                // The kernel answers for a listener that is gone (see `adopt`).
                (true, false) => "every syscall the allowlist denies, to a listener that was an earlier server's: they fail with ENOSYS, unrecorded".into(),
                (false, _) => "none: denied syscalls fail with EPERM at once".into(),
            },
        });
        f.landlock = self.landlock.map(|l| cordon_sandbox::report::Landlock {
            enforced: l.as_str().to_string(),
            abi: landlock::kernel_abi(),
            rules: landlock::rules(self.connect_ports.as_deref()),
        });
        f.masked_proc = Some(rootfs::masked_proc());
        f
    }

    fn writable_layer(&self) -> Option<cordon_sandbox::WritableLayer> {
        Some(cordon_sandbox::WritableLayer { upper: self.writable_upper()?, uid_base: self.uid_base() })
    }

    fn leave_running(self) {
        Sandbox::leave_running(self)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            tracing::warn!("teardown of {}: {e}", self.id);
        }
    }
}

/// Makes the calling process the reaper of orphaned descendants, so that a sandbox init
/// becomes our child when its jailer exits and can be reaped by pidfd.
pub fn become_subreaper() {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}
