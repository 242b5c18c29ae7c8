//! The `ns` tier: a sandbox made of Linux namespaces, an idmapped overlay root, cgroups and
//! nothing of the host.
//!
//! [`Jail`] owns the state directory. [`Jail::create`] plans a sandbox (id, uid range, cgroups),
//! records the plan on disk before touching the kernel (so a crash at any point leaves
//! something the next start can reap), then runs the [`jailer`] which builds the namespaces and
//! execs `cordon-agent` as the sandbox's PID 1. [`Sandbox`] is the live handle; dropping it
//! tears everything down. [`backend`] is the tier as a `cordon_sandbox::Backend`; cgroups, uid
//! slots and the TUN device come from `cordon-host`, shared with the other tiers.

pub mod audit;
pub mod backend;
mod caps;
pub mod jailer;
mod landlock;
mod procview;
mod rootfs;
mod seccomp;
mod sys;

pub use cordon_host::{cgroup, slots, tun, Cgroup, Layout, Slot, Slots, UID_BASE, UID_COUNT};
/// Brings up `lo` in the caller's network namespace (the vm tier's guest init uses it too).
pub use seccomp::programs as seccomp_programs;
pub use sys::{loopback_up, send_fd_with};

use cordon_spec::Limits;
use serde::{Deserialize, Serialize};
use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
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
    /// The image's root tree (read-only; never written).
    pub rootfs: PathBuf,
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
}

/// What is on disk about a sandbox, enough to reap it after a crash.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    id: String,
    slot: u32,
    cgroup: Cgroup,
    pid: Option<i32>,
}

/// The state directory and the cgroup layout of this host.
pub struct Jail {
    run_dir: PathBuf,
    slots: slots::Slots,
    layout: Layout,
    exe: PathBuf,
}

impl Jail {
    /// Opens (creating) `<state>/run` and `<state>/slots`, and reaps whatever a previous,
    /// crashed instance left behind. `exe` is the cordon binary, re-run as the jailer.
    pub fn open(state_dir: &Path, exe: PathBuf) -> Result<Jail, JailError> {
        let run_dir = state_dir.join("run");
        fs::create_dir_all(&run_dir).map_err(io_err(format!("create {}", run_dir.display())))?;
        let slots = slots::Slots::open(&state_dir.join("slots")).map_err(io_err("open slot directory"))?;
        let layout = Layout::detect();
        let missing = layout.missing();
        if !missing.is_empty() {
            return Err(JailError::Unsupported(format!(
                "cgroup controllers missing: {} (mount them, or on cgroup v2 enable them in cgroup.subtree_control)",
                missing.join(", ")
            )));
        }
        let jail = Jail { run_dir, slots, layout, exe };
        jail.reap_orphans();
        Ok(jail)
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Kills and removes every sandbox whose owning process is gone. Returns how many.
    pub fn reap_orphans(&self) -> usize {
        let Ok(entries) = fs::read_dir(&self.run_dir) else { return 0 };
        let mut reaped = 0;
        for e in entries.flatten() {
            let dir = e.path();
            let Ok(lock) = fs::File::open(dir.join("lock")) else {
                // A directory without a lock is a create that died before it made one.
                let _ = fs::remove_dir_all(&dir);
                continue;
            };
            if !sys::flock_exclusive_nb(&lock).unwrap_or(false) {
                continue; // its owner is alive
            }
            if let Ok(rec) = fs::read(dir.join("record.json"))
                .map_err(drop)
                .and_then(|b| serde_json::from_slice::<Record>(&b).map_err(drop))
            {
                tracing::info!(id = %rec.id, "reaping sandbox left by a dead cordon process");
                rec.cgroup.kill_and_wait(Duration::from_secs(5));
                let _ = rec.cgroup.remove();
            }
            let _ = fs::remove_dir_all(&dir);
            reaped += 1;
        }
        reaped
    }

    /// Creates a running sandbox whose agent is listening on [`Sandbox::socket_path`].
    pub fn create(&self, cfg: &SandboxConfig) -> Result<Sandbox, JailError> {
        cfg.limits.validate().map_err(|e| JailError::Setup(e.to_string()))?;
        let dir = self.run_dir.join(&cfg.id);
        fs::create_dir(&dir).map_err(io_err(format!("create {}", dir.display())))?;
        let lock = match fs::File::create(dir.join("lock")) {
            Ok(l) => l,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(io_err("create lock")(e));
            }
        };
        // Held for the sandbox's life: a free lock means a dead owner (see reap_orphans).
        let _ = sys::flock_exclusive_nb(&lock);

        let mut sb = Sandbox {
            id: cfg.id.clone(),
            dir,
            socket: PathBuf::new(),
            cgroup: Cgroup::plan(&self.layout, &cfg.id),
            slot: None,
            pidfd: None,
            pid: 0,
            _lock: lock,
            torn_down: false,
            landlock: String::new(),
            audit: None,
            tun: None,
        };
        // From here on, dropping `sb` on any error undoes every step taken so far.
        let slot = self.slots.acquire().ok_or(JailError::NoSlot(self.slots.capacity()))?;
        let slot_index = slot.index;
        sb.slot = Some(slot);
        sb.socket = sb.dir.join("agent.sock");
        let staging = sb.dir.join("root");
        fs::create_dir(&staging).map_err(io_err("create staging dir"))?;
        sb.write_record()?;
        sb.cgroup.create(&cfg.limits).map_err(io_err("create cgroups"))?;

        let jcfg = jailer::JailerConfig {
            id: cfg.id.clone(),
            rootfs: cfg.rootfs.clone(),
            staging,
            socket: sb.socket.clone(),
            uid_base: UID_BASE + slot_index * UID_COUNT,
            uid_count: UID_COUNT,
            cgroup_procs: sb.cgroup.procs_files(),
            disk_bytes: cfg.limits.disk_bytes,
            nofile: cfg.limits.nofile,
            agent_config: cfg.agent_config.clone(),
            agent_config_len: cfg.agent_config.len(),
            allow_ptrace: cfg.allow_ptrace,
            audit: cfg.audit,
            tun: cfg.tun,
            connect_ports: cfg.connect_ports.clone(),
        };
        let (reply, taken) = jailer::spawn(&self.exe, &jcfg).map_err(io_err("run jailer"))?;
        sb.tun = taken.tun;
        if let Some(l) = taken.listener {
            sb.audit = Some(audit::supervise(l, &cfg.id).map_err(io_err("start audit thread"))?);
        }
        match reply {
            jailer::JailerReply::Failed { error } => Err(JailError::Setup(error)),
            jailer::JailerReply::Ready { pid, phases, landlock, .. } => {
                tracing::debug!(id = %cfg.id, ?phases, %landlock, "jailer done (µs since jailer start)");
                sb.landlock = landlock;
                sb.pid = pid;
                sb.pidfd = Some(sys::pidfd_open(pid).map_err(io_err("pidfd_open sandbox init"))?);
                sb.write_record()?;
                Ok(sb)
            }
        }
    }
}

/// A live sandbox. Dropping it kills everything in it and removes every trace.
pub struct Sandbox {
    id: String,
    dir: PathBuf,
    socket: PathBuf,
    cgroup: Cgroup,
    slot: Option<slots::Slot>,
    pidfd: Option<OwnedFd>,
    pid: i32,
    _lock: fs::File,
    torn_down: bool,
    landlock: String,
    audit: Option<audit::Trail>,
    tun: Option<OwnedFd>,
}

impl Sandbox {
    /// The host end of the sandbox's TUN interface, once; `None` without an egress policy.
    pub fn take_tun(&mut self) -> Option<OwnedFd> {
        self.tun.take()
    }

    /// The syscalls the filter denied so far, when the sandbox was created with `audit`.
    pub fn denials(&self) -> Vec<audit::Denial> {
        self.audit.as_ref().map(|a| a.denials()).unwrap_or_default()
    }

    /// How much Landlock the kernel enforced: `full`, `partial` or `none`.
    pub fn landlock(&self) -> &str {
        &self.landlock
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The agent's socket, reachable only from the host.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// Host pid of the sandbox's init (the agent).
    pub fn host_pid(&self) -> i32 {
        self.pid
    }

    /// First host uid of this sandbox's range: sandbox uid N is host uid `uid_base() + N`.
    pub fn uid_base(&self) -> u32 {
        UID_BASE + self.slot.as_ref().map_or(0, |s| s.index) * UID_COUNT
    }

    /// A pidfd of the init; it becomes readable when the sandbox dies.
    pub fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(|f| f.as_fd())
    }

    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// Kills every process of the sandbox now. Killing the init of a pid namespace makes the
    /// kernel kill all of it; the cgroup kill catches anything else in the groups.
    pub fn kill(&self) {
        if let Some(fd) = &self.pidfd {
            let _ = sys::pidfd_kill(fd);
        }
        self.cgroup.kill();
    }

    /// Whether the init has exited.
    pub fn has_exited(&self) -> bool {
        let Some(fd) = &self.pidfd else { return true };
        let mut p = libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(fd), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        unsafe { libc::poll(&mut p, 1, 0) > 0 }
    }

    /// Bytes used and total of the writable layer, read through the init's view of its root.
    pub fn disk_usage(&self) -> (u64, u64) {
        let Ok(path) = std::ffi::CString::new(format!("/proc/{}/root/", self.pid)) else { return (0, 0) };
        // SAFETY: zeroed statvfs is a valid output buffer.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid path and output pointer.
        if self.pid <= 0 || unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
            return (0, 0);
        }
        let total = st.f_blocks * st.f_frsize;
        (total - st.f_bfree * st.f_frsize, total)
    }

    pub fn oom_kills(&self) -> u64 {
        self.cgroup.oom_kills()
    }

    pub fn peak_memory(&self) -> u64 {
        self.cgroup.peak_memory()
    }

    fn write_record(&self) -> Result<(), JailError> {
        let rec = Record {
            id: self.id.clone(),
            slot: self.slot.as_ref().map_or(0, |s| s.index),
            cgroup: self.cgroup.clone(),
            pid: (self.pid > 0).then_some(self.pid),
        };
        let tmp = self.dir.join("record.json.tmp");
        fs::write(&tmp, serde_json::to_vec(&rec).expect("record serialises")).map_err(io_err("write record"))?;
        fs::rename(&tmp, self.dir.join("record.json")).map_err(io_err("write record"))
    }

    /// Kills the sandbox and removes its processes, cgroups and files. Idempotent.
    pub fn destroy(&mut self) -> Result<(), JailError> {
        if self.torn_down {
            return Ok(());
        }
        self.torn_down = true;
        self.kill();
        if let Some(fd) = &self.pidfd {
            // The init of a pid namespace exits only after the kernel has killed and reaped
            // every other process in it, so once it is reaped the sandbox is empty. It is our
            // child when we are a subreaper (the usual case): wait for it without polling.
            let _ = sys::pidfd_reap(fd, true);
        }
        let emptied = self.cgroup.kill_and_wait(Duration::from_secs(5));
        let removed = self.cgroup.remove();
        let _ = fs::remove_dir_all(&self.dir);
        self.slot.take();
        if !emptied {
            return Err(JailError::Setup(format!("sandbox {} did not die within 5 s", self.id)));
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

/// Makes the calling process the reaper of orphaned descendants, so that a sandbox init
/// becomes our child when its jailer exits and can be reaped by pidfd.
pub fn become_subreaper() {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}
