//! The `gvisor` tier: the same sandbox as the `ns` tier (same image, overlay root, caps, no
//! network, agent as init) run by gVisor's `runsc`, whose user-space kernel answers the
//! sandbox's syscalls so that few of them reach the host's.
//!
//! How one sandbox is made ([`Gvisor::create`]):
//! - a directory `<state>/gvisor/run/<id>` in the run ledger (`cordon_host::ledger`): a lock
//!   held for the sandbox's life and a record of its cgroups, written before anything is
//!   started, so a crashed cordon's sandboxes are reaped by the next [`Gvisor::open`];
//! - cgroups (`cordon_host::Cgroup`) holding runsc and everything it starts, so that the caps
//!   cover gVisor's own processes and one `cgroup.kill` ends all of it;
//! - runsc is started in a mount and a network namespace of its own, made just before it runs:
//!   the mount namespace holds the sandbox's root (the image's read-only tree under a writable
//!   tmpfs layer capped at the disk size), the network namespace has nothing but a down
//!   loopback. Both die with runsc's last process, so they cannot leak. With an egress policy
//!   the network namespace is made first, with the forwarder's TUN device in it ([`netns`]);
//!   it too lives only as long as runsc and the host's descriptors of it;
//! - the OCI bundle ([`bundle`]) names the cordon binary, bind-mounted read-only, as init;
//! - runsc's state (`--root`) lives in the sandbox's directory, removed at teardown;
//! - the agent reaches the host over its stdio pipes, multiplexed by `cordon-channel`, and the
//!   host serves the usual agent socket in the sandbox's directory from it.

mod adopt;
pub mod backend;
pub mod bundle;
pub mod diagnose;
mod holder;
mod launch;
pub mod netns;
pub mod runsc;
mod trust;

use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cordon_host::{ledger, Cgroup, Layout, Ledger};
use cordon_sandbox::host_sandbox::HostSandbox;
use cordon_spec::Limits;

pub use holder::main as link_holder_main;
pub use runsc::Runsc;

/// Memory the host allows a gvisor sandbox on top of its cap: gVisor's kernel (the sentry), its
/// file proxy (the gofer) and runsc itself live in the sandbox's cgroup and are charged to it.
pub const MEMORY_OVERHEAD: u64 = 64 << 20;
/// Host tasks per sandbox task, and on top. Inside, gVisor enforces the pids cap itself (per
/// user, as RLIMIT_NPROC). On the host a sandbox task costs ptrace stub and tracer threads (about
/// 9-13 measured here under ptrace) and the sentry, gofer and runsc start with about 60: the host
/// limit is only a backstop, and reaching it ends the whole sandbox, never the host.
pub const PIDS_PER_TASK: u32 = 24;
pub const PIDS_OVERHEAD: u32 = 256;
/// How long a new sandbox's agent may take to answer.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Errors of the gvisor tier. Each says what failed and, where there is one, the fix.
#[derive(Debug, thiserror::Error)]
pub enum GvisorError {
    /// The host cannot run this tier (no runsc, no cgroups).
    #[error("the gvisor tier cannot run here: {0}")]
    Unavailable(String),
    /// An operation on the host failed.
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    /// The sandbox could not be started; the message says why (runsc's own words included).
    #[error("{0}")]
    Setup(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> GvisorError {
    let what = what.into();
    move |source| GvisorError::Io { what, source }
}

/// What to create.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    pub id: String,
    /// The image's layer trees, bottom first (read-only; never written).
    pub layers: Vec<PathBuf>,
    pub limits: Limits,
    /// The agent's configuration (see `cordon_agent::encode_config`): sent as the first bytes
    /// of the link, before the channel starts, never in the environment.
    pub agent_config: Vec<u8>,
    /// Egress: a TUN interface whose descriptor the caller takes with [`Sandbox::take_tun`]
    /// and serves; without it the sandbox has gVisor's loopback only.
    pub tun: bool,
    /// Start from a sandbox saved by [`Sandbox::checkpoint`] into this directory, with every
    /// process and its memory, instead of a fresh agent.
    pub restore: Option<PathBuf>,
    /// Volumes bound in (host directories the host has mounted).
    pub volumes: Vec<cordon_spec::VolumeMount>,
    /// The host's egress CA, added to the image's trust (bound over its bundle).
    pub egress_ca: Option<String>,
    /// The user commands run as when they name none (the agent's), for the isolation report.
    pub default_user: String,
    /// Left running when this process exits, for the next owner to adopt with
    /// [`Gvisor::adopt`] (`SandboxSpec::keep`).
    pub keep: bool,
}

/// The tier on this host: runsc, the platform, the state directory.
pub struct Gvisor {
    ledger: Ledger,
    runsc: Runsc,
    platform: String,
    layout: Layout,
    agent: PathBuf,
}

impl Gvisor {
    /// Finds runsc, opens (creating) `<state>/gvisor/run`, and reaps whatever a crashed cordon
    /// left there. `exe` is the cordon binary, bind-mounted into each sandbox as its agent.
    pub fn open(state_dir: &Path, exe: &Path) -> Result<Gvisor, GvisorError> {
        let dir = state_dir.join("gvisor");
        let ledger = Ledger::open(dir.join("run"), "gvisor sandbox").map_err(io_err("open the run directory"))?;
        let runsc = Runsc::locate_cached(&dir.join("runsc.json"))?;
        let platform = runsc::platform(&runsc, &dir.join("platform"))?;
        let layout = Layout::detect();
        let missing = layout.missing();
        if !missing.is_empty() {
            return Err(GvisorError::Unavailable(format!("cgroup controllers missing: {}", missing.join(", "))));
        }
        if layout.unified.is_none() {
            return Err(GvisorError::Unavailable("no cgroup2 hierarchy (its cgroup.kill ends a sandbox at once)".into()));
        }
        // The agent is a path runsc's file proxy opens: the real file, not /proc/self/exe.
        let agent = fs::canonicalize(exe).map_err(io_err(format!("resolve {}", exe.display())))?;
        let gv = Gvisor { ledger, runsc, platform, layout, agent };
        gv.reap_orphans();
        Ok(gv)
    }

    pub fn runsc(&self) -> &Runsc {
        &self.runsc
    }

    /// The platform sandboxes run on (`ptrace`, `systrap` or `kvm`).
    pub fn platform(&self) -> &str {
        &self.platform
    }

    /// Kills and removes every sandbox whose owning process is gone. Returns how many.
    pub fn reap_orphans(&self) -> usize {
        self.ledger.reap()
    }

    /// Creates a running sandbox whose agent answers on [`Sandbox::socket_path`].
    pub fn create(&self, cfg: &SandboxConfig) -> Result<Sandbox, GvisorError> {
        cfg.limits.validate().map_err(|e| GvisorError::Setup(e.to_string()))?;
        let started = Instant::now();
        // Held for the sandbox's life: a free lock means a dead owner (see `reap_orphans`).
        let entry = self.ledger.begin(&cfg.id, 0o777).map_err(io_err("make the sandbox's run directory"))?;
        let mut sb = Sandbox {
            id: cfg.id.clone(),
            socket: entry.dir().join("agent.sock"),
            entry,
            cgroup: Cgroup::plan(&self.layout, &cfg.id),
            child: None,
            pid: None,
            pidfd: None,
            link: None,
            holder: None,
            tun: None,
            networked: cfg.tun,
            runsc: self.runsc.path.clone(),
            key: self.key(&cfg.layers),
            held: Vec::new(),
            torn_down: false,
            default_user: cfg.default_user.clone(),
            keep: cfg.keep,
        };
        if let Some(saved) = &cfg.restore {
            if cfg.tun {
                return Err(GvisorError::Setup("a saved gvisor sandbox has no network policy: restore it without one".into()));
            }
            let kept = fs::read_to_string(saved.join(SAVED_KEY)).map_err(io_err(format!("read {}", saved.join(SAVED_KEY).display())))?;
            if kept != sb.key {
                return Err(GvisorError::Setup(format!(
                    "the saved sandbox in {} was made by another runsc, platform or image ({}); this host has {}: it cannot be restored here",
                    saved.display(),
                    kept.lines().next().unwrap_or("?"),
                    self.runsc.version
                )));
            }
        }
        // From here on, dropping `sb` on any error undoes every step taken so far.
        sb.write_record()?;
        sb.cgroup.create(&host_limits(&cfg.limits)).map_err(io_err("create cgroups"))?;

        let rootfs = sb.entry.dir().join("rootfs");
        let disk = sb.entry.dir().join("disk");
        for d in [&rootfs, &disk] {
            fs::create_dir(d).map_err(io_err(format!("create {}", d.display())))?;
        }
        let netns = if cfg.tun { Some(netns::with_tun()?) } else { None };
        let resolv = sb.entry.dir().join("resolv.conf");
        if netns.is_some() {
            fs::write(&resolv, cordon_host::tun::resolv_conf()).map_err(io_err("write resolv.conf"))?;
        }
        // The image's CA bundle with the egress CA, and the CA alone, bound read-only over
        // their places (see `cordon_host::trust`).
        let (bundle_file, ca_file) = (sb.entry.dir().join("trust-bundle.crt"), sb.entry.dir().join("egress-ca.crt"));
        if let Some(ca) = &cfg.egress_ca {
            let image = trust::image_bundle(&cfg.layers);
            fs::write(&bundle_file, cordon_host::trust::bundle(image.as_deref(), ca)).map_err(io_err("write the sandbox's CA bundle"))?;
            fs::write(&ca_file, ca).map_err(io_err("write the egress CA"))?;
        }
        // The configuration comes first on the link's stdin (see `launch::serve_link`).
        let agent_env = [
            (String::from("CORDON_AGENT_LINK"), String::from("stdio")),
            (String::from("CORDON_AGENT_CONFIG_FD"), String::from("0")),
        ];
        bundle::Bundle {
            id: &cfg.id,
            rootfs: &rootfs,
            agent: &self.agent,
            agent_env: &agent_env,
            disk: &disk,
            nofile: cfg.limits.nofile,
            nproc: cfg.limits.pids as u64,
            resolv_conf: netns.as_ref().map(|_| resolv.as_path()),
            volumes: &cfg.volumes,
            trust: cfg.egress_ca.as_ref().map(|_| (bundle_file.as_path(), ca_file.as_path())),
        }
        .write(sb.entry.dir())?;

        let plan = launch::Plan {
            runsc: &self.runsc.path,
            platform: &self.platform,
            id: &cfg.id,
            dir: sb.entry.dir(),
            image: &cfg.layers,
            rootfs: &rootfs,
            disk: &disk,
            disk_bytes: cfg.limits.disk_bytes,
            cgroup_procs: sb.cgroup.join_files(),
            netns: netns.as_ref().map(|n| n.ns.as_raw_fd()),
            restore: cfg.restore.as_deref(),
        };
        let launched = launch::spawn(&plan)?;
        // runsc holds the namespace now; the host keeps only the TUN device.
        sb.tun = netns.map(|n| n.tun);
        sb.pidfd = Some(launched.pidfd);
        // Waited for at teardown, which may come long after a checkpoint ended it.
        cordon_host::orphans::claim(launched.child.id());
        sb.pid = Some(launched.child.id());
        sb.child = Some(launched.child);
        let opening = match cfg.restore {
            Some(_) => launch::Opening::Resume,
            None => launch::Opening::Config(cfg.agent_config.clone()),
        };
        // A sandbox that outlives this process has its link served by a holder process of its
        // own; any other (a one-shot run's, a build's) by a thread here, which costs no exec.
        sb.link = Some(if sb.keep {
            let (holder, control) = holder::spawn(&self.agent, sb.entry.dir(), &sb.socket, launched.from_agent, launched.to_agent, opening, &sb.cgroup.join_files())?;
            cordon_host::orphans::claim(holder.id());
            sb.holder = Some(holder);
            Link::Holder(control)
        } else {
            let listener = std::os::unix::net::UnixListener::bind(&sb.socket).map_err(io_err("bind the agent socket"))?;
            Link::Thread(launch::serve_link(launched.from_agent, launched.to_agent, listener, opening)?)
        });
        if sb.keep {
            // Before the record says `keep`: an adopter finds both or neither.
            adopt::Facts::of(&sb).write(sb.entry.dir()).map_err(io_err("write the sandbox's facts"))?;
        }
        sb.write_record()?;
        sb.wait_ready()?;
        // gVisor restores the hostname its kernel had: a copy restored under another id (a
        // fork) is renamed, by an exec with the one capability that takes.
        if let Some(saved) = &cfg.restore {
            if fs::read_to_string(saved.join(SAVED_ID)).is_ok_and(|id| id != cfg.id) {
                sb.runsc_in(&["exec", "--cap", "CAP_SYS_ADMIN"], &[bundle::AGENT_PATH, "--rename", &cfg.id])?;
            }
        }
        // runsc's own processes (its sandbox and gofer) outlive the `runsc run` that started
        // them and fall to cordon when they exit, whether killed or ended by a checkpoint.
        sb.held = sb.cgroup.pidfds();
        tracing::debug!(id = %cfg.id, elapsed = ?started.elapsed(), platform = %self.platform, "gvisor sandbox ready");
        Ok(sb)
    }
}

/// What a saved sandbox must be restored with: the runsc that saved it, its platform and its
/// image's layers (gVisor reopens the sandbox's files by path).
const SAVED_KEY: &str = "key";
/// The saved sandbox's id: a restore under another id (a fork) renames the sandbox.
const SAVED_ID: &str = "id";

impl Gvisor {
    fn key(&self, layers: &[PathBuf]) -> String {
        let mut key = format!("{}\nplatform {}\n", self.runsc.version, self.platform);
        for l in layers {
            key.push_str(&format!("layer {}\n", l.display()));
        }
        key
    }
}

/// What serves a sandbox's agent link: a thread of this process, or, for a sandbox that
/// outlives it, a holder process this one controls (see [`holder`]).
enum Link {
    Thread(launch::LinkThread),
    Holder(holder::Control),
}

impl Link {
    fn park(&mut self, socket: &Path) -> Result<(), GvisorError> {
        match self {
            Link::Thread(t) => t.park(socket),
            Link::Holder(c) => c.park(),
        }
    }

    fn wake(&mut self) -> Result<(), GvisorError> {
        match self {
            Link::Thread(t) => t.wake(),
            Link::Holder(c) => c.wake(),
        }
    }

    fn stop(self) {
        match self {
            Link::Thread(t) => t.stop(),
            Link::Holder(c) => c.stop(),
        }
    }
}

/// A live gvisor sandbox. Dropping it kills everything in it and removes every trace.
pub struct Sandbox {
    id: String,
    /// The run directory (bundle, runsc state, socket, record), locked while the sandbox lives.
    entry: ledger::Entry,
    socket: PathBuf,
    cgroup: Cgroup,
    child: Option<std::process::Child>,
    /// Host pid of `runsc run` (whose child this process may not be: an adopted sandbox's).
    pid: Option<u32>,
    pidfd: Option<OwnedFd>,
    /// What serves the agent's link.
    link: Option<Link>,
    /// That process, when this one started it.
    holder: Option<std::process::Child>,
    tun: Option<OwnedFd>,
    /// Made with an egress policy: runsc runs with host networking, which it cannot save.
    networked: bool,
    runsc: PathBuf,
    /// What a saved copy must be restored with (see [`SAVED_KEY`]).
    key: String,
    /// Its runsc processes, held to be reaped at the end (see `cordon_host::sys::reap_all`).
    held: Vec<(libc::pid_t, OwnedFd)>,
    torn_down: bool,
    /// The user commands run as when they name none, for the isolation report.
    default_user: String,
    /// Left running when this process exits (see [`SandboxConfig::keep`]).
    keep: bool,
}

impl Sandbox {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The TUN device of a sandbox created with `tun`, once, for the egress forwarder.
    pub fn take_tun(&mut self) -> Option<OwnedFd> {
        self.tun.take()
    }

    /// Host pid of `runsc run`.
    pub fn host_pid(&self) -> Option<u32> {
        self.pid
    }

    fn write_record(&self) -> Result<(), GvisorError> {
        let pid = self.host_pid().map(|p| p as i32);
        // Kept only once its link is served: a create that dies half way is reaped as ever.
        let keep = self.keep && self.link.is_some();
        let rec = ledger::Record { id: self.id.clone(), cgroup: self.cgroup.clone(), pid, slot: None, keep };
        self.entry.write(&rec).map_err(io_err("write record"))
    }

    /// runsc's own last words, for error messages.
    fn runsc_log(&self) -> String {
        let text = fs::read_to_string(self.entry.dir().join("runsc.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(3)..].join(" / ")
    }

    /// Whether [`Sandbox::checkpoint`] can save it: not with host networking (an egress
    /// policy), whose sockets are the host's and cannot be written to a file, nor while a
    /// process waits on a TCP socket through epoll, which this runsc cannot save (its
    /// checkpoint then ends the sandbox): the agent looks (see `cordon-agent`'s `saveable`).
    pub fn checkpointable(&self) -> bool {
        if self.networked || self.link.is_none() {
            return false;
        }
        match saveable(&self.socket, SAVEABLE_DEADLINE) {
            Ok(None) => true,
            Ok(Some(why)) => {
                tracing::info!(id = %self.id, "runsc cannot save this sandbox now ({why}): it is paused in place");
                false
            }
            Err(e) => {
                tracing::info!(id = %self.id, "the agent did not say whether the sandbox can be saved ({e}): it is paused in place");
                false
            }
        }
    }

    /// Runs `runsc <args> <id>` on this sandbox's runsc state, in its network namespace: runsc
    /// reaches the sandbox through an abstract socket, which only that namespace sees.
    fn runsc_cmd(&self, args: &[&str]) -> Result<(), GvisorError> {
        self.runsc_in(args, &[])
    }

    /// `runsc <args> <id> <after>`, as [`Sandbox::runsc_cmd`].
    fn runsc_in(&self, args: &[&str], after: &[&str]) -> Result<(), GvisorError> {
        use std::os::unix::process::CommandExt;
        let pid = self.host_pid().ok_or_else(|| GvisorError::Setup("the sandbox is not running".into()))?;
        let netns = fs::File::open(format!("/proc/{pid}/ns/net")).map_err(io_err("open the sandbox's network namespace"))?;
        let ns = netns.as_raw_fd();
        let mut cmd = std::process::Command::new(&self.runsc);
        cmd.arg(format!("--root={}", self.entry.dir().join("runsc").display())).args(args).arg(&self.id).args(after).stdin(std::process::Stdio::null());
        // SAFETY: one syscall on a descriptor opened above, between fork and exec.
        unsafe {
            cmd.pre_exec(move || if libc::setns(ns, libc::CLONE_NEWNET) == 0 { Ok(()) } else { Err(io::Error::last_os_error()) });
        }
        let out = cmd.output().map_err(io_err(format!("run {}", self.runsc.display())))?;
        drop(netns);
        if out.status.success() {
            return Ok(());
        }
        let said = String::from_utf8_lossy(&out.stderr);
        tracing::debug!(id = %self.id, stderr = %said, "runsc {} failed", args[0]);
        Err(GvisorError::Setup(format!("runsc {}: {}", args[0], runsc_reason(&said))))
    }

    /// Saves the running sandbox, every process and its memory, into `dir` (made here, 0700)
    /// for a [`SandboxConfig::restore`]: the agent parks its link, runsc writes its kernel's
    /// state and ends the sandbox, and the writable layer (root, /tmp, /dev/shm) is then copied
    /// out of the sandbox's mount namespace, held open for this, exactly as the saved kernel
    /// last saw it. Before the save, an error leaves the sandbox running and nothing in `dir`;
    /// after it (the copy failed) the sandbox has ended, and the error says so.
    pub fn checkpoint(&mut self, dir: &Path) -> Result<(), GvisorError> {
        if self.networked {
            return Err(GvisorError::Setup("a gvisor sandbox with a network policy runs on the host's sockets, which runsc cannot save".into()));
        }
        let pid = self.host_pid().ok_or_else(|| GvisorError::Setup("the sandbox is not running".into()))?;
        let cp = launch::cp()?;
        // The tmpfs lives as long as its mount namespace, which this keeps past runsc's exit.
        let mnt = fs::File::open(format!("/proc/{pid}/ns/mnt")).map_err(io_err("open the sandbox's mount namespace"))?;
        let used = self.disk_usage().map_or(0, |(used, _)| used);
        let free = cordon_host::sys::disk_usage(dir.parent().unwrap_or(dir)).map_or(u64::MAX, |(used, total)| total.saturating_sub(used));
        if used >= free {
            return Err(GvisorError::Setup(format!("the sandbox's files take {used} bytes and {} has {free} free: free some space", dir.display())));
        }
        std::os::unix::fs::DirBuilderExt::mode(&mut fs::DirBuilder::new(), 0o700).create(dir).map_err(io_err(format!("create {}", dir.display())))?;
        let t = Instant::now();
        let link = self.link.as_mut().ok_or_else(|| GvisorError::Setup("this sandbox has no agent link to park".into()))?;
        if let Err(e) = link.park(&self.socket) {
            let _ = fs::remove_dir_all(dir);
            return Err(e);
        }
        tracing::debug!(id = %self.id, elapsed = ?t.elapsed(), "agent parked");
        let image = dir.join(launch::SAVED_IMAGE);
        let checkpointed = fs::create_dir(&image)
            .map_err(io_err("create the saved image's directory"))
            .and_then(|()| self.runsc_cmd(&["checkpoint", &format!("--image-path={}", image.display())]));
        if let Err(e) = checkpointed {
            let _ = fs::remove_dir_all(dir);
            if let Some(link) = self.link.as_mut() {
                let _ = link.wake();
            }
            return Err(e);
        }
        tracing::debug!(id = %self.id, elapsed = ?t.elapsed(), "runsc checkpointed");
        let copied = (|| {
            let disk = dir.join(launch::SAVED_DISK);
            fs::create_dir(&disk).map_err(io_err("create the saved disk's directory"))?;
            let live = self.entry.dir().join("disk");
            let ns = mnt.as_raw_fd();
            let mut cmd = std::process::Command::new(&cp);
            cmd.arg("-a").arg("--").args(["upper", launch::SHARED_TMP, launch::SHARED_SHM].map(|p| live.join(p))).arg(&disk).stdin(std::process::Stdio::null());
            // SAFETY: one syscall on a descriptor opened above, between fork and exec (the child
            // is single-threaded, as entering a mount namespace requires).
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::setns(ns, libc::CLONE_NEWNS) == 0 {
                        Ok(())
                    } else {
                        Err(io::Error::last_os_error())
                    }
                });
            }
            let out = cmd.output().map_err(io_err("copy the writable layer"))?;
            if !out.status.success() {
                return Err(GvisorError::Setup(format!("copy the writable layer: {}", String::from_utf8_lossy(&out.stderr).trim())));
            }
            fs::write(dir.join(SAVED_ID), &self.id).map_err(io_err("write the saved sandbox's id"))?;
            fs::write(dir.join(SAVED_KEY), &self.key).map_err(io_err("write the saved sandbox's key"))
        })();
        drop(mnt);
        match copied {
            Ok(()) => {
                tracing::debug!(id = %self.id, elapsed = ?t.elapsed(), "gvisor sandbox saved");
                Ok(())
            }
            Err(e) => {
                let _ = fs::remove_dir_all(dir);
                Err(GvisorError::Setup(format!("the sandbox was saved but its files could not be kept, and it has ended: {e}")))
            }
        }
    }

    /// Waits until the agent answers `/health` through the link, or fails with runsc's reason.
    fn wait_ready(&mut self) -> Result<(), GvisorError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(true) = health(&self.socket, deadline.saturating_duration_since(Instant::now())) {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(GvisorError::Setup(format!(
                        "runsc exited ({status}) before the agent answered: {}",
                        self.runsc_log()
                    )));
                }
            }
            if Instant::now() >= deadline {
                return Err(GvisorError::Setup(format!(
                    "the agent did not answer within {READY_TIMEOUT:?}: {}",
                    self.runsc_log()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

}

/// What the sandbox crate's [`HostBacked`](cordon_sandbox::host_sandbox::HostBacked) needs of a
/// live gvisor sandbox.
impl HostSandbox for Sandbox {
    type Error = GvisorError;

    /// A pidfd of `runsc run`; it becomes readable when the sandbox dies.
    fn death_fd(&self) -> Option<OwnedFd> {
        self.pidfd.as_ref().and_then(|fd| fd.try_clone().ok())
    }

    /// The agent's socket, served by the host from the sandbox's link.
    fn socket_path(&self) -> &Path {
        &self.socket
    }

    fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    fn set_limits(&self, limits: &cordon_spec::Limits) -> std::io::Result<()> {
        self.cgroup.set_limits(&host_limits(limits))
    }

    /// gVisor's kernel holds the sandbox's credentials, mounts and filters; the host sees only
    /// runsc's own processes.
    fn tier_facts(&self) -> cordon_sandbox::report::TierFacts {
        let mut lines = self.key.lines();
        let version = lines.next().map(str::to_string);
        let platform = lines.next().and_then(|l| l.strip_prefix("platform ")).map(str::to_string);
        let runtime = cordon_sandbox::report::Runtime { version, platform, kernel: Some("gVisor's (the sentry)".into()), accelerator: None };
        let mut f = cordon_sandbox::report::TierFacts::opaque(runtime, "gVisor's kernel holds it, out of the host's sight: `cordon probe` reports it from inside");
        // What the bundle gives every process: its capabilities (runsc's kernel applies them),
        // checked from inside by the probe.
        if !self.default_user.is_empty() {
            f.default_user = Some(cordon_sandbox::report::UserCaps::of(&self.default_user, bundle::bounding()));
            f.unknown.remove("capabilities.defaultUser");
        }
        f
    }

    /// Kills every process of the sandbox now: runsc, its gofer and gVisor's kernel.
    fn kill(&self) {
        self.cgroup.kill();
    }

    /// The overlay's upper directory, through runsc's mount namespace (where the writable
    /// layer's tmpfs is mounted). runsc runs as root without a user namespace, so its files'
    /// owners are the sandbox's own uids.
    fn writable_layer(&self) -> Option<cordon_sandbox::WritableLayer> {
        let pid = self.host_pid()?;
        let upper = PathBuf::from(format!("/proc/{pid}/root{}", self.entry.dir().join("disk/upper").display()));
        upper.is_dir().then_some(cordon_sandbox::WritableLayer { upper, uid_base: 0 })
    }

    /// Bytes used and total of the writable layer, through runsc's mount namespace.
    fn disk_usage(&self) -> Option<(u64, u64)> {
        let pid = self.host_pid()?;
        cordon_host::sys::disk_usage(Path::new(&format!("/proc/{pid}/root{}", self.entry.dir().join("disk").display())))
    }

    fn checkpointable(&self) -> bool {
        Sandbox::checkpointable(self)
    }

    fn leave_running(self) {
        Sandbox::leave_running(self)
    }

    /// Saves it for a pause; a running copy (a fork's source) is not kept on this tier: its
    /// forks and snapshots take its files.
    fn checkpoint(&mut self, dir: &Path, keep_running: bool) -> Result<(), cordon_sandbox::Error> {
        if keep_running {
            return Err(cordon_sandbox::Error::Unavailable("the gvisor tier saves a sandbox's memory only to pause it".into()));
        }
        Sandbox::checkpoint(self, dir).map_err(|e| cordon_sandbox::Error::failed("save the gvisor sandbox", e))
    }

    /// Kills the sandbox and removes its processes, cgroups and files. Idempotent.
    fn destroy(&mut self) -> Result<(), GvisorError> {
        if self.torn_down {
            return Ok(());
        }
        self.torn_down = true;
        let mut held = std::mem::take(&mut self.held);
        held.extend(self.cgroup.pidfds());
        self.kill();
        // Waited for before anything reaps by pidfd: a pid reaped elsewhere could be reused.
        for mut child in [self.child.take(), self.holder.take()].into_iter().flatten() {
            let _ = child.kill();
            let _ = child.wait();
            cordon_host::orphans::release(child.id());
        }
        let emptied = self.cgroup.kill_and_wait(Duration::from_secs(5));
        cordon_host::sys::reap_all(&held, Duration::from_millis(500));
        let removed = self.cgroup.remove();
        // Killed with the group already (it is in it): the stop finds it gone.
        if let Some(link) = self.link.take() {
            link.stop();
        }
        self.entry.remove();
        if !emptied {
            return Err(GvisorError::Setup(format!("sandbox {} did not die within 5 s", self.id)));
        }
        removed.map_err(io_err("remove cgroups"))
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            tracing::warn!("teardown of {}: {e}", self.id);
        }
    }
}

/// One `GET /health` over the socket: true on 204.
fn health(socket: &Path, timeout: Duration) -> io::Result<bool> {
    Ok(ask_agent(socket, "/health", timeout.max(Duration::from_millis(10)))?.starts_with("HTTP/1.1 204"))
}

/// How long the agent has to say whether its sandbox can be saved.
/// The caps of a sandbox's cgroups: its own, plus what runsc, the gofer and gVisor's kernel
/// take of them.
fn host_limits(limits: &cordon_spec::Limits) -> cordon_spec::Limits {
    let mut host = limits.clone();
    host.memory_bytes += MEMORY_OVERHEAD;
    host.pids = host.pids.saturating_mul(PIDS_PER_TASK).saturating_add(PIDS_OVERHEAD);
    host
}

const SAVEABLE_DEADLINE: Duration = Duration::from_secs(5);

/// Asks the agent whether runsc can save the sandbox now: `None` when it can, else the agent's
/// reason (a 409 and its text).
fn saveable(socket: &Path, timeout: Duration) -> io::Result<Option<String>> {
    let answer = ask_agent(socket, cordon_agent::SAVEABLE_PATH, timeout)?;
    if answer.starts_with("HTTP/1.1 204") {
        return Ok(None);
    }
    match (answer.starts_with("HTTP/1.1 409"), answer.split_once("\r\n\r\n")) {
        (true, Some((_, body))) => Ok(Some(body.trim().chars().take(200).collect())),
        _ => Err(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected answer: {}", answer.lines().next().unwrap_or("")))),
    }
}

/// The agent's whole answer to `GET path` on its socket, asked before any multiplexed client
/// exists (a plain HTTP/1.1 exchange the agent closes). Its answers to these are a status line,
/// a few headers and at most a line of text.
fn ask_agent(socket: &Path, path: &str, timeout: Duration) -> io::Result<String> {
    let mut s = std::os::unix::net::UnixStream::connect(socket)?;
    s.set_read_timeout(Some(timeout))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")?;
    let mut answer = Vec::new();
    s.take(64 << 10).read_to_end(&mut answer)?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// The line of a failed runsc's stderr that says why: a Go panic's message (its last lines are
/// a stack trace), else the last line.
fn runsc_reason(stderr: &str) -> String {
    let mut lines = stderr.lines().map(str::trim).filter(|l| !l.is_empty());
    let line = lines.clone().find(|l| l.starts_with("panic:") || l.starts_with("fatal error:") || l.contains(" failed: ")).or_else(|| lines.next_back()).unwrap_or("failed");
    // A save error names the object it failed on with the object's whole state: keep what
    // comes before and after that dump.
    match (line.find('{'), line.rfind("}: ")) {
        (Some(open), Some(close)) if close > open => format!("{}{{...}}: {}", &line[..open], line[close + 3..].trim_end_matches(':')),
        _ => line.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::runsc_reason;

    #[test]
    fn a_failed_save_is_told_without_its_object_dump_or_stack() {
        let stderr = "checkpoint failed: checkpointing container \"c1\": encoding error at object tcp.endpoint{A:b{C:1}, D:2}: endpoint still has waiters upon save:\n\
            goroutine 608 [running]:\n\
            panic({0xe7f040, 0x1235dd8})\n\
            \tgvisor.dev/gvisor/pkg/urpc/urpc.go:451 +0x79\n";
        assert_eq!(
            runsc_reason(stderr),
            "checkpoint failed: checkpointing container \"c1\": encoding error at object tcp.endpoint{...}: endpoint still has waiters upon save"
        );
        assert_eq!(runsc_reason("\nsome warning\ncontainer not running\n"), "container not running");
        assert_eq!(runsc_reason(""), "failed");
    }
}
