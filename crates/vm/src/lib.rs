//! The `vm` tier: each sandbox is a microVM with its own guest kernel.
//!
//! - [`kit`]: a Debian kernel from the apt registry, unpacked to an uncompressed vmlinux (PVH
//!   boot), its virtio/overlay modules, and an initramfs whose `/init` is the cordon binary;
//! - [`disk`]: the image as a read-only ext4 disk shared by all its VMs, and a per-VM
//!   writable layer whose size is the disk cap;
//! - [`vmm`]: the VMM behind a trait (QEMU `-M microvm` here), [`accel`]: KVM only when a
//!   guest really boots under it, TCG otherwise;
//! - [`jailer`]: the VMM process in its own namespaces, cgroup and uid, seeing only its files;
//! - [`snapshot`]: VMs start from a saved, booted template of their kind (made on first use);
//! - [`guest`]: the guest init, which overlays the disks, switches root and serves the same
//!   envd agent as every tier over a virtio-serial port, multiplexed by `cordon-channel`. The
//!   host side serves that link as a Unix socket, so clients of the agent do not change.
//!
//! Each VM is recorded under `<state>/vm/run/<id>` with an flock held by its owner; the VMM
//! dies with its owner (parent-death signal), and the next [`VmTier::open`] removes what is
//! left (cgroup, writable layer, socket). A VM made with [`VmConfig::keep`] outlives its owner
//! instead: a holder process serves its links ([`holder`]) and the next owner adopts it
//! ([`VmTier::adopt`]).

pub mod accel;
mod adopt;
pub mod backend;
pub mod diagnose;
pub mod disk;
pub mod guest;
mod initramfs;
pub mod jailer;
pub mod guest_kit;
pub mod holder;
mod modules;
pub mod link_handshake;
mod qmp;
pub mod shares;
pub mod snapshot;
pub mod vmlinux;
pub mod vmm;

pub use accel::Verdict;
pub use guest_kit::Kit;
pub use vmm::{Accel, Qemu, Vmm};

use cordon_image::Progress;
use cordon_host::{ledger, Cgroup, Layout, Ledger};
use cordon_spec::Limits;
use std::collections::VecDeque;
use std::fs;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Errors of the vm tier; each says what failed and what to do.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The host cannot run the tier (no VMM, no cgroups).
    #[error("the vm tier cannot run here: {0}")]
    Unsupported(String),
    /// The guest kit could not be built.
    #[error("guest kit: {0}")]
    Kit(String),
    /// A disk could not be made.
    #[error("vm disk: {0}")]
    Disk(String),
    /// The request is out of range.
    #[error("{0}")]
    BadRequest(String),
    /// The guest did not come up.
    #[error("the VM did not boot: {0}")]
    Boot(String),
    /// An operation on the host failed.
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> VmError {
    let what = what.into();
    move |source| VmError::Io { what, source }
}

/// Smallest guest: the kernel, the initramfs (the cordon binary) and a Python need this much.
pub const MIN_MEMORY_MIB: u64 = 128;
/// Host memory the VMM process needs beyond the guest's RAM (its code, device state and the
/// bounded TCG translation cache), added to the cgroup's limit.
const VMM_OVERHEAD_MIB: u64 = 192;
/// How long a guest may take from VMM start to a serving agent.
const BOOT_DEADLINE: Duration = Duration::from_secs(90);
/// How long a guest may take to park its link once asked (an emulated CPU is slow).
const PARK_DEADLINE: Duration = Duration::from_secs(30);
/// Set to 1 to see the guest's console (kernel messages, init steps) on stderr.
pub const ENV_DEBUG: &str = "CORDON_VM_DEBUG";

fn debug_console() -> bool {
    std::env::var_os(ENV_DEBUG).is_some_and(|v| v == "1")
}

/// Bytes of console output kept for error messages.
const CONSOLE_KEEP: usize = 16 * 1024;

/// What to create.
#[derive(Debug, Clone)]
pub struct VmConfig {
    pub id: String,
    pub limits: Limits,
    pub agent: cordon_agent::AgentConfig,
    /// Volumes, shared over virtio-fs (see [`shares`]).
    pub volumes: Vec<cordon_spec::VolumeMount>,
    /// A network interface, for a sandbox with an egress policy: its frames reach the host on
    /// [`Vm::take_net_link`].
    pub network: Option<link_handshake::GuestNetwork>,
    /// Left running when this process exits, for the next owner to adopt with
    /// [`VmTier::adopt`] (`SandboxSpec::keep`): no parent-death signal, and a holder process
    /// serves the links instead of a thread of this one.
    pub keep: bool,
}

/// The kit, acceleration and disk one image's VMs boot from.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub kit: Kit,
    pub accel: Verdict,
    pub root_disk: PathBuf,
}

/// The tier on this host: its VMM, state directories and cgroup layout.
pub struct VmTier {
    vm_dir: PathBuf,
    ledger: Ledger,
    slots: cordon_host::Slots,
    layout: Layout,
    exe: PathBuf,
    vmm: Box<dyn Vmm>,
}

impl VmTier {
    /// Finds the VMM (a clear error when there is none: never a fallback to another tier),
    /// opens `<state>/vm` and reaps what a crashed cordon left. `exe` is the cordon binary,
    /// which becomes the guest's init.
    pub fn open(state_dir: &Path, exe: PathBuf) -> Result<VmTier, VmError> {
        let vmm = Box::new(Qemu::find()?);
        let layout = Layout::detect();
        let missing = layout.missing();
        if !missing.is_empty() {
            return Err(VmError::Unsupported(format!("cgroup controllers missing: {}", missing.join(", "))));
        }
        let vm_dir = state_dir.join("vm");
        let ledger = Ledger::open(vm_dir.join("run"), "VM").map_err(io_err("open the run directory"))?;
        let slots = cordon_host::Slots::open_host(&state_dir.join("slots")).map_err(io_err("open slot directory"))?;
        let tier = VmTier { vm_dir, ledger, slots, layout, exe, vmm };
        tier.reap_orphans();
        Ok(tier)
    }

    pub fn vmm(&self) -> &dyn Vmm {
        &*self.vmm
    }

    pub fn vm_dir(&self) -> &Path {
        &self.vm_dir
    }

    /// Builds (once) the kit, chooses the accelerator and makes (once) the image's disk.
    pub fn prepare(&self, image: &str, layers: &[std::path::PathBuf], progress: &mut dyn Progress) -> Result<Prepared, VmError> {
        let kit = guest_kit::ensure(&self.vm_dir, &self.exe, progress)?;
        let accel = accel::choose(&self.vm_dir, &*self.vmm, &kit)?;
        let root_disk = disk::root_disk(&self.vm_dir, image, layers, progress)?;
        Ok(Prepared { kit, accel, root_disk })
    }

    /// Kills and removes every VM whose owning process is gone. Returns how many.
    pub fn reap_orphans(&self) -> usize {
        let reaped = self.ledger.reap();
        // Snapshots whose template died unfinished (`.<template id>`, see `snapshot_for`).
        if let Ok(entries) = fs::read_dir(self.vm_dir.join("snapshots")) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                // Past any boot's deadline: a template being made right now is never touched.
                let old = e.metadata().and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().unwrap_or_default() > 2 * BOOT_DEADLINE);
                if let Some(id) = name.strip_prefix('.') {
                    if old && !self.ledger.dir().join(id).exists() {
                        let _ = fs::remove_dir_all(e.path());
                    }
                }
            }
        }
        reaped
    }

    /// Starts a VM and returns once its agent answers on [`Vm::socket_path`]: restored from
    /// the snapshot of its kind (made first if there is none yet), or booted cold when
    /// snapshots are off or cannot be made here.
    pub fn create(&self, cfg: &VmConfig, prep: &Prepared) -> Result<Vm, VmError> {
        cfg.limits.validate().map_err(|e| VmError::BadRequest(e.to_string()))?;
        let memory_mib = cfg.limits.memory_bytes >> 20;
        if memory_mib < MIN_MEMORY_MIB {
            return Err(VmError::BadRequest(format!("the vm tier needs a memory cap of at least {MIN_MEMORY_MIB}M (the guest kernel and agent live in it)")));
        }
        // A snapshot's machine has no virtio-fs devices (and shared memory of its own): a VM
        // with volumes boots with them.
        if !snapshot::enabled() || !self.vmm.snapshots() || !cfg.volumes.is_empty() {
            return self.boot(cfg, prep, Start::Cold);
        }
        match self.snapshot_for(cfg, prep) {
            Ok(snap) => self.boot(cfg, prep, Start::Restore(snap)),
            Err(e) => {
                tracing::warn!("no snapshot for this VM ({e}); booting it cold");
                self.boot(cfg, prep, Start::Cold)
            }
        }
    }

    /// The snapshot VMs like `cfg`'s start from, made now if it does not exist yet.
    fn snapshot_for(&self, cfg: &VmConfig, prep: &Prepared) -> Result<snapshot::Snapshot, VmError> {
        let dir = self.vm_dir.join("snapshots");
        fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
        let spec = boot_spec(cfg, prep);
        let host_files = [prep.kit.vmlinux.as_path(), prep.kit.initramfs.as_path(), prep.root_disk.as_path()];
        let snap = snapshot::of(&dir, &*self.vmm, &spec, &host_files, cfg.limits.disk_bytes).map_err(io_err("name the snapshot"))?;
        if snap.exists() {
            snap.touch();
            return Ok(snap);
        }
        let _lock = snapshot::lock(&snap).map_err(io_err("lock the snapshot"))?;
        if snap.exists() {
            return Ok(snap); // another cordon made it meanwhile
        }
        let t = Instant::now();
        let template_id = format!("{}-template", cfg.id);
        let tmp = dir.join(format!(".{template_id}"));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).map_err(io_err(format!("create {}", tmp.display())))?;
        let made = (|| {
            use std::os::unix::fs::OpenOptionsExt;
            let state = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(tmp.join("state"))
                .map_err(io_err("create the snapshot's state file"))?;
            let template = VmConfig { id: template_id.clone(), keep: false, ..cfg.clone() };
            let mut vm = self.boot(&template, prep, Start::Template)?;
            let qmp = vm.qmp()?;
            qmp.migrate_to(&state, Duration::from_secs(120)).map_err(io_err("save the template's state"))?;
            // The guest is stopped now: its writable layer holds what its memory expects.
            disk::copy_sparse(&vm.entry.dir().join("rw.ext4"), &tmp.join("rw.ext4")).map_err(io_err("keep the template's writable layer"))?;
            drop(vm);
            snapshot::publish(&tmp, &snap).map_err(io_err("store the snapshot"))
        })();
        if made.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        made?;
        snapshot::prune(&dir);
        tracing::info!(snapshot = %snap.dir.display(), elapsed = ?t.elapsed(), "made a VM snapshot");
        Ok(snap)
    }

    /// Starts a VM from what [`Vm::save`] wrote in `dir`, with its processes and memory: the
    /// same VM again (a resume), or another one (a fork: `cfg` gives it its own id, hence its
    /// hostname, and it gets its own seed and clock). `dir` is only read, so a failed start
    /// loses nothing and one saved VM can start many.
    pub fn restore(&self, cfg: &VmConfig, prep: &Prepared, dir: &Path) -> Result<Vm, VmError> {
        cfg.limits.validate().map_err(|e| VmError::BadRequest(e.to_string()))?;
        let saved = Saved { dir: dir.to_path_buf() };
        let want = saved.key_file();
        let have = fs::read_to_string(&want).map_err(io_err(format!("read {}", want.display())))?;
        if have.trim() != self.boot_key(cfg, prep)? {
            return Err(VmError::BadRequest(
                "this saved VM was made with other VM settings or another guest kit, QEMU or image disk than this host has now: it cannot be restored; kill it".into(),
            ));
        }
        self.boot(cfg, prep, Start::Resume(saved))
    }

    /// Boots a VM afresh on the writable disk [`Vm::keep_disk`] kept in `dir` (a resume of a
    /// files-only pause): its files, a new boot. `dir` is only read.
    pub fn create_on(&self, cfg: &VmConfig, prep: &Prepared, dir: &Path) -> Result<Vm, VmError> {
        cfg.limits.validate().map_err(|e| VmError::BadRequest(e.to_string()))?;
        let kept = dir.join(KEPT_DISK);
        let size = fs::metadata(&kept).map_err(io_err(format!("read {}", kept.display())))?.len();
        if size != cfg.limits.disk_bytes {
            return Err(VmError::BadRequest(format!(
                "the kept disk is {size} bytes and this sandbox's disk cap {} bytes: resume it with the disk size it was paused with",
                cfg.limits.disk_bytes
            )));
        }
        self.boot(cfg, prep, Start::ColdOn(dir.to_path_buf()))
    }

    /// What a saved VM must match to be restored: its VMM arguments and host files, as a
    /// snapshot's name is made.
    fn boot_key(&self, cfg: &VmConfig, prep: &Prepared) -> Result<String, VmError> {
        let host_files = [prep.kit.vmlinux.as_path(), prep.kit.initramfs.as_path(), prep.root_disk.as_path()];
        snapshot::key(&*self.vmm, &boot_spec(cfg, prep), &host_files, cfg.limits.disk_bytes).map_err(io_err("name the VM's settings"))
    }

    /// Starts one VM: its run directory, uid range and cgroups, its writable layer, the jailed
    /// VMM (cold, restored or as a template), then waits until it is ready.
    fn boot(&self, cfg: &VmConfig, prep: &Prepared, start: Start) -> Result<Vm, VmError> {
        let (mut vm, uid) = self.begin(cfg, prep)?;
        // From here on, dropping `vm` on any error undoes every step taken so far.
        let t = Instant::now();
        let rw = vm.entry.dir().join("rw.ext4");
        match &start {
            Start::Restore(snap) => {
                disk::copy_sparse(&snap.rw(), &rw).map_err(io_err("copy the snapshot's writable layer"))?;
                disk::hand_to(&rw, uid)?;
            }
            Start::Resume(saved) => {
                disk::copy_sparse(&saved.rw(), &rw).map_err(io_err("copy the saved VM's writable layer"))?;
                disk::hand_to(&rw, uid)?;
            }
            Start::ColdOn(kept) => {
                disk::copy_sparse(&kept.join(KEPT_DISK), &rw).map_err(io_err("copy the kept writable disk"))?;
                disk::hand_to(&rw, uid)?;
            }
            Start::Cold | Start::Template => disk::writable_layer(&rw, cfg.limits.disk_bytes, uid)?,
        }
        tracing::debug!(elapsed = ?t.elapsed(), "writable layer made");

        // The agent link: one end for the VMM (its virtio-serial chardev), one for us.
        let (host_end, vmm_end) = std::os::unix::net::UnixStream::pair().map_err(io_err("socketpair"))?;
        let listener = std::os::unix::net::UnixListener::bind(&vm.socket).map_err(io_err("bind agent socket"))?;
        listener.set_nonblocking(true).map_err(io_err("agent socket"))?;

        // A template is saved and killed by its maker: never kept.
        let keep = cfg.keep && !matches!(start, Start::Template);
        let mut plan = self.jail_plan(&vm, prep, &rw, uid)?;
        plan.keep(keep);
        let cgroup_files = plan.cgroups(&vm.cgroup.join_files()).map_err(io_err("open cgroup.procs"))?;
        plan.pass_fd(vmm_end.as_raw_fd(), CHANNEL_FD);
        let mut spec = boot_spec(cfg, prep);
        vm.shares = shares::Shares::start(&cfg.volumes, vm.entry.dir(), uid, &vm.cgroup.join_files(), &mut plan, &mut spec)?;
        // Descriptors the VMM gets for this start, kept open until it has them.
        let mut passed: Vec<OwnedFd> = Vec::new();
        // Every VM has a monitor, the host's only: a template's state is saved through it, and
        // a sandbox's when it is paused or forked. Nothing of the guest reaches it.
        let (monitor, monitor_vmm) = std::os::unix::net::UnixStream::pair().map_err(io_err("socketpair"))?;
        plan.pass_fd(monitor_vmm.as_raw_fd(), MONITOR_FD);
        spec.monitor_fd = Some(MONITOR_FD);
        passed.push(monitor_vmm.into());
        vm.monitor = Some(monitor);
        if spec.net_fd.is_some() {
            let (host, vmm_net) = net_link()?;
            plan.pass_fd(vmm_net.as_raw_fd(), NET_FD);
            passed.push(vmm_net);
            vm.net = Some(host);
        }
        let handshake = start_handshake(cfg, start, &mut plan, &mut spec, &mut passed)?;
        let handshake_kind = match handshake {
            Handshake::Template => HandshakeKind::Template,
            Handshake::Resumed(_) => HandshakeKind::Resumed,
            _ => HandshakeKind::Agent,
        };
        let (cmd, con_r) = self.vmm_command(&spec, plan)?;
        tracing::debug!(id = %cfg.id, args = ?self.vmm.args(&spec), "starting VMM");

        // The VMM is started by the VM's own thread, which then serves the agent link: the
        // parent-death signal ties the VMM's life to that thread, hence to this handle. A kept
        // VM's thread only reaps the VMM; its holder serves the link.
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let console = vm.console.clone();
        let (served, held) = if keep {
            (None, Some((host_end, listener)))
        } else {
            let (link, control) = LinkControls::pair(host_end, listener, guest_config(cfg)?);
            vm.link = Some(LinkControl::Thread(Box::new(control)));
            (Some((link, handshake.clone(), ready_tx)), None)
        };
        let thread = std::thread::Builder::new()
            .name(format!("vm-{}", cfg.id))
            .spawn(move || vm_thread(cmd, tx, served, con_r, console))
            .map_err(io_err("start VM thread"))?;
        vm.thread = Some(thread);
        let started = rx.recv().map_err(|_| VmError::Boot("the VM thread ended early".into()))?;
        let pid = started.map_err(io_err(format!("start {}", self.vmm.binary().display())))?;
        drop(vmm_end);
        drop(passed);
        drop(cgroup_files);
        vm.pid = pid;
        vm.pidfd = Some(cordon_host::sys::pidfd_open(pid).map_err(io_err("pidfd_open VMM"))?);
        if let Some((host_end, listener)) = held {
            let monitor = vm.monitor.as_ref().ok_or_else(|| VmError::Boot("this VM has no monitor".into()))?.try_clone().map_err(io_err("dup the monitor"))?;
            let net = vm.net.as_ref().map(|n| n.try_clone()).transpose().map_err(io_err("dup the network link"))?;
            let ends = holder::Ends { agent_link: host_end, agent_listener: listener, monitor, net };
            let (child, control) = holder::spawn(&self.exe, vm.entry.dir(), &vm.socket, ends, &handshake, &vm.cgroup.join_files())?;
            cordon_host::orphans::claim(child.id());
            vm.holder = Some(child);
            vm.link = Some(LinkControl::Holder(control));
            // Before the record says `keep`: an adopter finds both or neither.
            adopt::Facts::of(&vm).write(vm.entry.dir()).map_err(io_err("write the VM's facts"))?;
        }
        vm.write_record()?;
        // A template is done booting when its guest asks for the config. A resumed guest's
        // agent is the one that parked: answering its wake (it took the config and the time)
        // shows it runs again; the sandbox's first health check is the caller's (the server
        // makes one before it serves any sandbox), and a second one here cost a round trip on
        // every resume.
        let awaited = match handshake_kind {
            HandshakeKind::Template => Some("the template guest did not ask for its config"),
            HandshakeKind::Resumed => Some("the resumed guest did not answer its wake"),
            HandshakeKind::Agent => None,
        };
        match (awaited, vm.link.as_mut()) {
            (Some(what), Some(LinkControl::Holder(c))) => c.ready().map_err(|e| VmError::Boot(format!("{what}: {e}; console: {}", vm.console_tail())))?,
            (Some(what), _) => match ready_rx.recv_timeout(BOOT_DEADLINE) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(VmError::Boot(format!("{what}: {e}; console: {}", vm.console_tail()))),
                Err(_) => return Err(VmError::Boot(format!("{what}; console: {}", vm.console_tail()))),
            },
            (None, _) => vm.wait_ready(BOOT_DEADLINE)?,
        }
        tracing::debug!(id = %cfg.id, elapsed = ?t.elapsed(), "VM ready");
        Ok(vm)
    }

    /// The VM's handle with its run directory (in the ledger), uid range and cgroups; the
    /// returned uid is the first of its range, the VMM's.
    fn begin(&self, cfg: &VmConfig, prep: &Prepared) -> Result<(Vm, u32), VmError> {
        let memory_mib = cfg.limits.memory_bytes >> 20;
        // The socket, the writable layer and the console are the host's business only (0700).
        // The lock is held for the VM's life: a free lock means a dead owner (see `reap_orphans`).
        let entry = self.ledger.begin(&cfg.id, 0o700).map_err(io_err("make the VM's run directory"))?;
        let mut vm = Vm {
            id: cfg.id.clone(),
            socket: entry.dir().join("agent.sock"),
            entry,
            cgroup: Cgroup::plan(&self.layout, &cfg.id),
            slot: None,
            pid: 0,
            pidfd: None,
            thread: None,
            monitor: None,
            qmp: None,
            link: None,
            key: self.boot_key(cfg, prep)?,
            console: Arc::new(Mutex::new(VecDeque::new())),
            accel: prep.accel.accel,
            guest_kernel: prep.kit.kernel_version.clone(),
            vmm_binary: self.vmm.binary().to_path_buf(),
            shares: Default::default(),
            net: None,
            net_mac: cfg.network.as_ref().map(|n| n.mac),
            torn_down: false,
            parked: false,
            oom_seen: Default::default(),
            holder: None,
        };
        let slot = self.slots.acquire().ok_or_else(|| VmError::BadRequest("no free uid range for the VMM".into()))?;
        let uid = cordon_host::UID_BASE + slot.index * cordon_host::UID_COUNT;
        vm.slot = Some(slot);
        vm.write_record()?;
        let vmm_limits = Limits {
            memory_bytes: (memory_mib + VMM_OVERHEAD_MIB) << 20,
            pids: 256,
            ..cfg.limits.clone()
        };
        vm.cgroup.create(&vmm_limits).map_err(io_err("create cgroups"))?;
        Ok((vm, uid))
    }

    /// The VMM's jail: it sees its libraries, the boot files and this VM's disks only.
    fn jail_plan(&self, vm: &Vm, prep: &Prepared, rw: &Path, uid: u32) -> Result<jailer::Plan, VmError> {
        let jail_root = vm.entry.dir().join("jail");
        fs::create_dir(&jail_root).map_err(io_err("create jail dir"))?;
        let mut plan = jailer::Plan::new(&jail_root, uid);
        plan.system_dirs();
        let bin = self.vmm.binary();
        if !bin.starts_with("/usr") {
            plan.bind(bin, bin, false);
        }
        for dev in ["/dev/null", "/dev/urandom"] {
            plan.bind(Path::new(dev), Path::new(dev), true);
        }
        if prep.accel.accel == Accel::Kvm {
            plan.bind(Path::new("/dev/kvm"), Path::new("/dev/kvm"), true);
            if let Ok(m) = fs::metadata("/dev/kvm") {
                plan.group(std::os::unix::fs::MetadataExt::gid(&m));
            }
        }
        plan.bind(&prep.kit.vmlinux, Path::new("/vm/vmlinux"), false);
        plan.bind(&prep.kit.initramfs, Path::new("/vm/initramfs"), false);
        plan.bind(&prep.root_disk, Path::new("/vm/root.ext4"), false);
        plan.bind(rw, Path::new("/vm/rw.ext4"), true);
        Ok(plan)
    }

    /// The VMM's command line in its jail, its console on a pipe whose read end is returned.
    fn vmm_command(&self, spec: &vmm::BootSpec, plan: jailer::Plan) -> Result<(std::process::Command, OwnedFd), VmError> {
        let mut cmd = std::process::Command::new(self.vmm.binary());
        cmd.args(self.vmm.args(spec)).env_clear().current_dir("/");
        let (con_r, con_w) = pipe().map_err(io_err("pipe"))?;
        cmd.stdin(std::process::Stdio::null()).stdout(con_w.try_clone().map_err(io_err("pipe"))?).stderr(con_w);
        plan.apply(&mut cmd);
        Ok((cmd, con_r))
    }
}

/// What the guest and the host say first for this kind of start, with the descriptors the VMM
/// needs for it (a snapshot's state, a template's monitor) added to `plan` and kept in `passed`.
fn start_handshake(cfg: &VmConfig, start: Start, plan: &mut jailer::Plan, spec: &mut vmm::BootSpec, passed: &mut Vec<OwnedFd>) -> Result<Handshake, VmError> {
    Ok(match start {
        Start::Cold | Start::ColdOn(_) => Handshake::Fresh(guest_config(cfg)?),
        Start::Restore(snap) => {
            tracing::debug!(id = %cfg.id, snapshot = %snap.dir.display(), "restoring the VM from a snapshot");
            let state = fs::File::open(snap.state()).map_err(io_err("open the snapshot's state"))?;
            plan.pass_fd(state.as_raw_fd(), STATE_FD);
            spec.incoming_fd = Some(STATE_FD);
            passed.push(state.into());
            Handshake::Restored(guest_config(cfg)?)
        }
        Start::Resume(saved) => {
            tracing::debug!(id = %cfg.id, saved = %saved.dir.display(), "restoring a saved VM");
            let state = fs::File::open(saved.state()).map_err(io_err("open the saved VM's state"))?;
            plan.pass_fd(state.as_raw_fd(), STATE_FD);
            spec.incoming_fd = Some(STATE_FD);
            passed.push(state.into());
            Handshake::Resumed(guest_config(cfg)?)
        }
        Start::Template => Handshake::Template,
    })
}

/// The writable disk [`Vm::keep_disk`] keeps, in its directory.
const KEPT_DISK: &str = "rw.ext4";

/// Descriptor numbers inside the VMM: the agent link, the snapshot's state, the monitor, the
/// network link.
const CHANNEL_FD: i32 = 3;
const STATE_FD: i32 = 4;
const MONITOR_FD: i32 = 5;
const NET_FD: i32 = 6;

/// Socket buffer of each end of the network link: room for about sixteen frames of the link's
/// MTU (64 KiB) in flight each way (the default, about 200 KiB, holds three).
const NET_BUFFER: libc::c_int = 1 << 20;

/// The network link's two ends, (host, VMM): a Unix datagram socket pair, one Ethernet frame
/// per datagram.
fn net_link() -> Result<(OwnedFd, OwnedFd), VmError> {
    let (a, b) = std::os::unix::net::UnixDatagram::pair().map_err(io_err("socketpair for the VM's network"))?;
    for s in [&a, &b] {
        for opt in [libc::SO_SNDBUFFORCE, libc::SO_RCVBUFFORCE] {
            // SAFETY: setsockopt with an int option value on a socket we own. The FORCE
            // variants pass the host's wmem_max/rmem_max (cordon runs as root); a failure
            // leaves the default, which only slows the link.
            unsafe {
                libc::setsockopt(s.as_raw_fd(), libc::SOL_SOCKET, opt, (&NET_BUFFER as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as libc::socklen_t)
            };
        }
    }
    Ok((a.into(), b.into()))
}

/// How a VM starts.
enum Start {
    /// From the kernel up.
    Cold,
    /// From a snapshot.
    Restore(snapshot::Snapshot),
    /// From a saved running VM ([`Vm::save`]), whose guest waits, parked, to be woken.
    Resume(Saved),
    /// From the kernel up, on a writable disk kept by [`Vm::keep_disk`].
    ColdOn(PathBuf),
    /// As a template: boots cold, and its state is saved through its monitor once the guest
    /// asks for its config.
    Template,
}

/// How [`VmTier::boot`] knows a VM is up: its template guest asked for the config, a resumed
/// guest answered its wake, or the agent answered a health check.
enum HandshakeKind {
    Template,
    Resumed,
    Agent,
}

/// What the VM thread says to the guest before the agent link begins.
#[derive(Clone)]
enum Handshake {
    Fresh(link_handshake::GuestConfig),
    /// The guest asked for its config before its snapshot was taken.
    Restored(link_handshake::GuestConfig),
    /// The guest was parked when it was saved.
    Resumed(link_handshake::GuestConfig),
    Template,
}

fn guest_config(cfg: &VmConfig) -> Result<link_handshake::GuestConfig, VmError> {
    let mut seed = vec![0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| VmError::Io { what: "seed for the guest".into(), source: io::Error::other(e) })?;
    Ok(link_handshake::GuestConfig {
        hostname: cfg.id.clone(),
        agent: cfg.agent.clone(),
        seed,
        volumes: shares::guest_volumes(&cfg.volumes),
        network: cfg.network.clone(),
    })
}

/// The boot as the VMM sees it inside its jail. Nothing in it names one VM, so VMs with the
/// same caps get the same arguments, which is what lets them share a snapshot.
fn boot_spec(cfg: &VmConfig, prep: &Prepared) -> vmm::BootSpec {
    vmm::BootSpec {
        kernel: "/vm/vmlinux".into(),
        initramfs: "/vm/initramfs".into(),
        cmdline: if debug_console() {
            format!("console=ttyS0 panic=-1 rdinit=/init {}", guest::DEBUG_ARG)
        } else {
            "console=ttyS0 quiet panic=-1 rdinit=/init".into()
        },
        memory_mib: cfg.limits.memory_bytes >> 20,
        vcpus: (cfg.limits.cpus.ceil() as u32).max(1),
        accel: prep.accel.accel,
        root_disk: Some("/vm/root.ext4".into()),
        rw_disk: Some("/vm/rw.ext4".into()),
        channel_fd: Some(CHANNEL_FD),
        incoming_fd: None,
        monitor_fd: None,
        net_fd: cfg.network.is_some().then_some(NET_FD),
        shares: Vec::new(),
    }
}

/// The host end of a VM's agent link, as the VM's thread serves it.
struct VmLink {
    host_end: std::os::unix::net::UnixStream,
    listener: std::os::unix::net::UnixListener,
    /// Set by [`Vm::park`] before it asks the agent to park: the link's end is then a park.
    parking: Arc<std::sync::atomic::AtomicBool>,
    /// Whether the guest parked (its marker read).
    parked: std::sync::mpsc::SyncSender<io::Result<()>>,
    /// What to tell a parked guest: wake with this config, or nothing (the VM ends).
    wake: std::sync::mpsc::Receiver<link_handshake::GuestConfig>,
}

/// What serves a VM's agent link: a thread of this process, or a holder process (a VM that
/// outlives its maker).
enum LinkControl {
    // Boxed: the thread's channels are several times the holder's connection.
    Thread(Box<LinkControls>),
    Holder(holder::Control),
}

/// The controlling side of [`VmLink`], held by whoever runs [`serve_agent`]'s caller: this
/// process's handle, or the holder process.
struct LinkControls {
    parking: Arc<std::sync::atomic::AtomicBool>,
    parked: std::sync::mpsc::Receiver<io::Result<()>>,
    wake: std::sync::mpsc::SyncSender<link_handshake::GuestConfig>,
    /// This VM's config, sent again (with a fresh seed) when it is woken in place.
    guest: link_handshake::GuestConfig,
}

impl LinkControls {
    /// The two sides of a VM's agent link on `host_end`, its socket served from `listener`:
    /// what [`serve_agent`] serves, and its controls.
    fn pair(host_end: std::os::unix::net::UnixStream, listener: std::os::unix::net::UnixListener, guest: link_handshake::GuestConfig) -> (VmLink, LinkControls) {
        let (parked_tx, parked_rx) = std::sync::mpsc::sync_channel(1);
        let (wake_tx, wake_rx) = std::sync::mpsc::sync_channel(1);
        let parking = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let link = VmLink { host_end, listener, parking: parking.clone(), parked: parked_tx, wake: wake_rx };
        (link, LinkControls { parking, parked: parked_rx, wake: wake_tx, guest })
    }

    /// Asks the agent (on its socket, `socket`) to park its link and waits until it has.
    fn park(&self, socket: &Path) -> io::Result<()> {
        use std::io::Write;
        self.parking.store(true, std::sync::atomic::Ordering::SeqCst);
        let asked = std::os::unix::net::UnixStream::connect(socket).and_then(|mut s| s.write_all(cordon_agent::PARK_REQUEST).map(|()| s));
        let said = match asked {
            Ok(_conn) => self.parked.recv_timeout(PARK_DEADLINE + Duration::from_secs(5)).unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into())),
            Err(e) => Err(e),
        };
        if said.is_err() {
            self.parking.store(false, std::sync::atomic::Ordering::SeqCst);
        }
        said
    }

    /// Lets the parked guest serve again, with this VM's config and a fresh seed.
    fn wake(&self) -> io::Result<()> {
        let mut cfg = self.guest.clone();
        getrandom::fill(&mut cfg.seed).map_err(|e| io::Error::other(format!("seed for the guest: {e}")))?;
        self.parking.store(false, std::sync::atomic::Ordering::SeqCst);
        self.wake.send(cfg).map_err(|_| io::Error::other("the VM's link is gone"))
    }
}

/// The VM's own thread: starts the VMM (whose parent-death signal follows this thread), keeps
/// its console, serves the agent link when `served` gives it, and reaps the VMM.
fn vm_thread(
    mut cmd: std::process::Command,
    tx: std::sync::mpsc::SyncSender<io::Result<i32>>,
    served: Option<(VmLink, Handshake, std::sync::mpsc::SyncSender<io::Result<()>>)>,
    console_r: OwnedFd,
    console: Arc<Mutex<VecDeque<u8>>>,
) {
    let mut child = match jailer::spawn_in_new_pid_namespace(&mut cmd) {
        Ok(c) => c,
        Err(e) => {
            let _ = tx.send(Err(e));
            return;
        }
    };
    drop(cmd); // closes our copies of the console pipe's write end
    // Reaped here, however long after it exits (a saved VM's VMM waits for its teardown).
    cordon_host::orphans::claim(child.id());
    let _ = tx.send(Ok(child.id() as i32));
    let reader = std::thread::spawn(move || {
        let mut f = fs::File::from(console_r);
        let mut buf = [0u8; 4096];
        while let Ok(n) = f.read(&mut buf) {
            if n == 0 {
                break;
            }
            if debug_console() {
                use std::io::Write;
                let _ = std::io::stderr().write_all(&buf[..n]);
            }
            let mut c = console.lock().unwrap_or_else(|p| p.into_inner());
            c.extend(&buf[..n]);
            let excess = c.len().saturating_sub(CONSOLE_KEEP);
            c.drain(..excess);
        }
    });
    match served {
        Some((link, handshake, ready)) => serve_agent(link, handshake, ready, &mut || {
            // The host saves a template now and then kills it; the link stays open till then.
            let _ = child.wait();
        }),
        // A holder serves the link: this thread only waits for the VMM's end.
        None => {
            let _ = child.wait();
        }
    }
    // The link ends when the VMM exits (or is killed): reap it here, its parent thread.
    let _ = child.kill();
    let _ = child.wait();
    cordon_host::orphans::release(child.id());
    let _ = reader.join();
}

/// Serves a VM's agent link until it ends for good: the handshake of each start (the first,
/// then one per wake), one multiplexed session after it, and the park that ends a session.
/// `ready` hears how a resumed or template guest's handshake went; `hold` keeps a template's
/// link open until its VMM is killed. Run by the VM's thread or by its holder process.
fn serve_agent(link: VmLink, handshake: Handshake, ready: std::sync::mpsc::SyncSender<io::Result<()>>, hold: &mut dyn FnMut()) {
    let VmLink { mut host_end, listener, parking, parked, wake } = link;
    let mut handshake = handshake;
    loop {
        // The exchange before the agent link: it ends with an error if the VMM dies (EOF).
        let _ = host_end.set_nonblocking(false);
        let _ = host_end.set_read_timeout(Some(BOOT_DEADLINE));
        let said = match handshake {
            Handshake::Fresh(cfg) => link_handshake::await_ready(&mut host_end).and_then(|()| link_handshake::send(&mut host_end, &cfg)),
            Handshake::Restored(cfg) => link_handshake::send(&mut host_end, &cfg),
            Handshake::Resumed(cfg) => {
                let r = link_handshake::resume(&mut host_end, &cfg);
                // The start waits for this (a later wake of the same VM is waited for through
                // `Vm::wake`: nobody reads it then, hence `try_send`).
                let _ = ready.try_send(r.as_ref().map(|_| ()).map_err(|e| io::Error::new(e.kind(), e.to_string())));
                r
            }
            Handshake::Template => {
                let r = link_handshake::await_ready(&mut host_end);
                let failed = r.is_err();
                let _ = ready.send(r);
                if !failed {
                    hold();
                }
                Err(io::Error::other("a template serves no agent"))
            }
        };
        let served = said.and_then(|()| serve_link(&host_end, &listener));
        if let Err(e) = served {
            tracing::debug!("agent link ended: {e}");
            break;
        }
        if !parking.load(std::sync::atomic::Ordering::SeqCst) {
            break;
        }
        // The agent closed its end of the multiplexer because it was asked to park.
        let _ = host_end.set_nonblocking(false);
        let _ = host_end.set_read_timeout(Some(PARK_DEADLINE));
        let r = link_handshake::await_parked(&mut host_end);
        let ok = r.is_ok();
        let _ = parked.send(r);
        if !ok {
            break;
        }
        match wake.recv() {
            Ok(cfg) => handshake = Handshake::Resumed(cfg),
            Err(_) => break,
        }
    }
}

/// Serves one session of the agent link: the sandbox's socket, one stream per connection,
/// until the agent closes the link (it parked) or it breaks.
fn serve_link(host_end: &std::os::unix::net::UnixStream, listener: &std::os::unix::net::UnixListener) -> io::Result<()> {
    let (end, listener) = (host_end.try_clone()?, listener.try_clone()?);
    end.set_read_timeout(None)?;
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async move {
        end.set_nonblocking(true)?;
        let link = cordon_channel::FdLink::duplex(OwnedFd::from(end))?;
        let listener = tokio::net::UnixListener::from_std(listener)?;
        cordon_channel::serve_unix(link, &listener).await
    })
}

/// A live VM. Dropping it kills the VMM and removes every trace.
pub struct Vm {
    id: String,
    /// The run directory (socket, writable layer, jail root, record), locked while the VM lives.
    entry: ledger::Entry,
    socket: PathBuf,
    cgroup: Cgroup,
    slot: Option<cordon_host::Slot>,
    pid: i32,
    pidfd: Option<OwnedFd>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The host end of the VMM's monitor, until the first command connects [`Vm::qmp`].
    monitor: Option<std::os::unix::net::UnixStream>,
    qmp: Option<qmp::Qmp>,
    link: Option<LinkControl>,
    /// What a saved copy of this VM must match to be restored ([`VmTier::restore`]).
    key: String,
    console: Arc<Mutex<VecDeque<u8>>>,
    accel: Accel,
    /// The guest kernel's release and the VMM's binary, for the isolation report.
    guest_kernel: String,
    vmm_binary: PathBuf,
    /// The daemons serving its volumes.
    shares: shares::Shares,
    /// The host end of its network link, until [`Vm::take_net_link`].
    net: Option<OwnedFd>,
    /// Its network interface's MAC, if it has one (a saved copy must be restored with one, and a
    /// resume keeps the MAC).
    net_mac: Option<[u8; 6]>,
    torn_down: bool,
    /// Its agent parked for a save, or its CPUs stopped for a disk copy (and not woken since):
    /// the guest answers nothing.
    parked: bool,
    /// The guest's OOM kill count as last read, for while it cannot answer.
    oom_seen: std::sync::atomic::AtomicU64,
    /// The link holder, when this process started it.
    holder: Option<std::process::Child>,
}

/// A running VM saved to a directory by [`Vm::save`]: its machine state (`state`, guest
/// memory and devices), its writable layer (`rw.ext4`) and what it must be restored with
/// (`key`).
#[derive(Debug, Clone)]
pub struct Saved {
    pub dir: PathBuf,
}

impl Saved {
    fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    fn rw(&self) -> PathBuf {
        self.dir.join("rw.ext4")
    }

    fn key_file(&self) -> PathBuf {
        self.dir.join("key")
    }

    /// Present when the saved VM had a network interface: its sandbox id and its MAC.
    fn net_marker(&self) -> PathBuf {
        self.dir.join("net")
    }

    /// Whether the VM saved in `dir` had a network interface: its restore must have one too,
    /// whatever its policy became meanwhile (an interface is part of the machine's state).
    pub fn had_network(dir: &Path) -> bool {
        Saved { dir: dir.to_path_buf() }.net_marker().exists()
    }

    /// The MAC of the VM saved in `dir` when it was sandbox `id`'s: a resume keeps its MAC, as
    /// the same machine does, while a fork or a sandbox of a snapshot gets its own.
    pub fn resumed_mac(dir: &Path, id: &str) -> Option<[u8; 6]> {
        let marker = fs::read_to_string(Saved { dir: dir.to_path_buf() }.net_marker()).ok()?;
        let (saved_id, mac) = marker.trim().split_once(' ')?;
        if saved_id != id {
            return None;
        }
        let bytes: Vec<u8> = mac.split(':').map(|b| u8::from_str_radix(b, 16)).collect::<Result<_, _>>().ok()?;
        bytes.try_into().ok()
    }
}

impl Vm {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The agent's socket (host side of the multiplexed link).
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The host end of the VM's network link (Ethernet frames on a Unix datagram socket), for
    /// the forwarder; `None` without an interface or once taken.
    pub fn take_net_link(&mut self) -> Option<OwnedFd> {
        self.net.take()
    }

    /// Host pid of the VMM.
    pub fn vmm_pid(&self) -> i32 {
        self.pid
    }

    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// The isolation report's runtime: the VMM's version (its `--version`'s first line), the
    /// accelerator, the guest kernel.
    pub fn runtime(&self) -> cordon_sandbox::report::Runtime {
        let version = std::process::Command::new(&self.vmm_binary)
            .arg("--version")
            .stdin(std::process::Stdio::null())
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).lines().next().map(str::to_string));
        cordon_sandbox::report::Runtime {
            version,
            accelerator: Some(self.accel.as_str().to_string()),
            kernel: Some(format!("{} (the guest's own)", self.guest_kernel)),
            platform: None,
        }
    }

    /// A pidfd of the VMM; readable once it has exited.
    pub fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(|f| std::os::fd::AsFd::as_fd(f))
    }

    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// The last lines the guest and the VMM printed (for error messages).
    pub fn console_tail(&self) -> String {
        let c = self.console.lock().unwrap_or_else(|p| p.into_inner());
        let text = String::from_utf8_lossy(&c.iter().copied().collect::<Vec<u8>>()).into_owned();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }

    pub fn has_exited(&self) -> bool {
        let Some(fd) = &self.pidfd else { return true };
        let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        unsafe { libc::poll(&mut p, 1, 0) > 0 }
    }

    /// The VMM's monitor (connected on first use: QMP greets once per connection).
    fn qmp(&mut self) -> Result<&mut qmp::Qmp, VmError> {
        if self.qmp.is_none() {
            let sock = self.monitor.take().ok_or_else(|| VmError::Boot("this VM has no monitor".into()))?;
            self.qmp = Some(qmp::Qmp::connect(sock, Duration::from_secs(30)).map_err(io_err("talk to the VMM's monitor"))?);
        }
        Ok(self.qmp.as_mut().expect("just set"))
    }

    /// Saves the running VM, processes and memory, into `dir` (created; it must not exist):
    /// the guest parks its agent link, the VMM writes the machine's state (QEMU migration to a
    /// file) and the writable layer is copied while the guest is stopped. With `keep_running`
    /// the guest then goes on where it was (a fork's source) with a fresh seed and clock; else
    /// it stays stopped and the VM is to be destroyed (a pause). On any error `dir` is removed
    /// and the VM goes on running.
    pub fn save(&mut self, dir: &Path, keep_running: bool) -> Result<Saved, VmError> {
        let saved = Saved { dir: dir.to_path_buf() };
        // The guest's memory is the sandbox's business only.
        std::os::unix::fs::DirBuilderExt::mode(&mut fs::DirBuilder::new(), 0o700).create(dir).map_err(io_err(format!("create {}", dir.display())))?;
        let t = Instant::now();
        self.park()?;
        self.parked = true;
        tracing::debug!(id = %self.id, elapsed = ?t.elapsed(), "guest parked");
        let written = (|| {
            use std::os::unix::fs::OpenOptionsExt;
            let state = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(saved.state()).map_err(io_err("create the state file"))?;
            self.qmp()?.migrate_to(&state, Duration::from_secs(300)).map_err(io_err("save the VM's state"))?;
            state.sync_all().map_err(io_err("write the state file"))?;
            tracing::debug!(id = %self.id, elapsed = ?t.elapsed(), "VM state saved");
            // The guest is stopped: its writable layer holds what its memory expects.
            disk::copy_sparse(&self.entry.dir().join("rw.ext4"), &saved.rw()).map_err(io_err("keep the VM's writable layer"))?;
            if let Some(mac) = self.net_mac {
                let mac = mac.map(|b| format!("{b:02x}")).join(":");
                fs::write(saved.net_marker(), format!("{} {mac}\n", self.id)).map_err(io_err("mark the saved VM's network interface"))?;
            }
            fs::write(saved.key_file(), &self.key).map_err(io_err("write the saved VM's key"))
        })();
        if written.is_err() {
            let _ = fs::remove_dir_all(dir);
        }
        if written.is_err() || keep_running {
            self.wake()?;
        }
        written.map(|()| saved)
    }

    /// Keeps the VM's writable disk whole in `dir` (made here, 0700) for [`VmTier::create_on`]:
    /// the guest flushes its filesystems (`sync` through the agent), the VMM stops its CPUs,
    /// and the disk image is copied, sparse. The host never mounts it: the guest's kernel is
    /// the only one that reads what the guest wrote. The VM is left stopped, to be destroyed;
    /// on any error `dir` is removed and the VM goes on running.
    pub fn keep_disk(&mut self, dir: &Path) -> Result<(), VmError> {
        std::os::unix::fs::DirBuilderExt::mode(&mut fs::DirBuilder::new(), 0o700).create(dir).map_err(io_err(format!("create {}", dir.display())))?;
        let t = Instant::now();
        let mut stopped = false;
        let kept = (|| {
            self.guest_sync()?;
            self.qmp()?.execute("stop", serde_json::json!({})).map_err(io_err("stop the VM"))?;
            stopped = true;
            self.parked = true;
            disk::copy_sparse(&self.entry.dir().join("rw.ext4"), &dir.join(KEPT_DISK)).map_err(io_err("keep the VM's writable disk"))
        })();
        match &kept {
            Ok(()) => tracing::debug!(id = %self.id, elapsed = ?t.elapsed(), "VM disk kept"),
            Err(_) => {
                let _ = fs::remove_dir_all(dir);
                if stopped {
                    let _ = self.qmp().and_then(|q| q.execute("cont", serde_json::json!({})).map_err(io_err("let the VM run again")));
                    self.parked = false;
                }
            }
        }
        kept
    }

    /// Runs `sync` in the guest as root, through the agent, and waits for it.
    fn guest_sync(&self) -> Result<(), VmError> {
        let deadline = Duration::from_secs(60) * self.accel.slowdown().max(1);
        let ran = self.ask_agent(move |client| async move {
            let req = cordon_envd::process::StartRequest {
                process: Some(cordon_envd::process::ProcessConfig { cmd: "/bin/sync".into(), args: Vec::new(), envs: Default::default(), cwd: None }),
                pty: None,
                tag: None,
                stdin: Some(false),
            };
            let run = async {
                let stream = client.start(req, Some("root"), None).await.map_err(|e| e.to_string())?;
                stream.collect().await.map_err(|e| e.to_string())
            };
            match tokio::time::timeout(deadline, run).await {
                Ok(Ok(out)) if out.end.as_ref().is_some_and(|e| e.exited && e.exit_code == 0) => Ok(()),
                Ok(Ok(out)) => Err(format!("sync did not succeed: {}", String::from_utf8_lossy(&out.stderr).trim())),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(format!("no answer within {deadline:?}")),
            }
        });
        ran.ok_or_else(|| VmError::Boot("the guest sync thread failed".into()))?.map_err(|e| VmError::Boot(format!("flush the guest's files: {e}")))
    }

    /// One exchange with the guest's agent, `f` given a client on its socket: on a thread and a
    /// runtime of its own, so that it can be called from async code and from plain threads
    /// alike. `None` when the thread or its runtime failed.
    fn ask_agent<T, F, Fut>(&self, f: F) -> Option<T>
    where
        T: Send + 'static,
        F: FnOnce(cordon_envd::EnvdClient) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        let socket = self.socket.clone();
        let ran = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            Some(rt.block_on(f(cordon_envd::EnvdClient::new(socket))))
        });
        ran.join().ok().flatten()
    }

    /// Asks the agent to park its link and waits until it has.
    fn park(&mut self) -> Result<(), VmError> {
        match self.link.as_mut() {
            Some(LinkControl::Thread(t)) => t.park(&self.socket).map_err(|e| VmError::Boot(format!("the guest did not park its link: {e}"))),
            Some(LinkControl::Holder(c)) => c.park(),
            None => Err(VmError::Boot("this VM has no agent link to park".into())),
        }
    }

    /// Lets a parked guest go on (after a save, or a failed one), with a fresh seed.
    fn wake(&mut self) -> Result<(), VmError> {
        self.parked = false;
        let status = self.qmp()?.execute("query-status", serde_json::json!({})).map_err(io_err("ask the VMM"))?;
        if status["running"] != serde_json::json!(true) {
            self.qmp()?.execute("cont", serde_json::json!({})).map_err(io_err("let the VM run again"))?;
        }
        match self.link.as_mut() {
            Some(LinkControl::Thread(t)) => t.wake().map_err(|e| VmError::Boot(e.to_string()))?,
            Some(LinkControl::Holder(c)) => c.wake()?,
            None => return Err(VmError::Boot("this VM has no agent link".into())),
        }
        self.wait_ready(BOOT_DEADLINE)
    }

    /// Kills the VMM now (the whole guest with it).
    pub fn kill(&self) {
        if let Some(fd) = &self.pidfd {
            // SAFETY: pidfd_send_signal on a pidfd we own, no siginfo.
            unsafe { libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), libc::SIGKILL, std::ptr::null::<u8>(), 0) };
        }
        self.cgroup.kill();
    }

    /// How many processes the guest kernel's OOM killer has killed, as the guest reports it
    /// (`oom_kill` in its /proc/vmstat, read through the agent). `None` when the guest is gone
    /// or does not answer. A guest parked for a save cannot answer: the count last read stands
    /// (asking would wait out the timeout, and a pause's teardown asks).
    pub fn oom_kills(&self) -> Option<u64> {
        use std::sync::atomic::Ordering;
        if self.parked {
            return Some(self.oom_seen.load(Ordering::Relaxed));
        }
        if self.has_exited() {
            return None;
        }
        let read = self
            .ask_agent(|client| async move {
                let b = tokio::time::timeout(Duration::from_secs(5), client.download_file("/proc/vmstat", Some("root"))).await.ok()?.ok()?;
                Some(parse_vmstat_oom(&String::from_utf8_lossy(&b)))
            })
            .flatten();
        if let Some(n) = read {
            self.oom_seen.store(n, Ordering::Relaxed);
        }
        read
    }

    /// Highest memory use of the VMM process (guest RAM it touched, plus its own), in bytes.
    pub fn peak_memory(&self) -> Option<u64> {
        self.cgroup.peak_memory()
    }

    pub fn memory_current(&self) -> Option<u64> {
        self.cgroup.memory_current()
    }

    fn wait_ready(&self, deadline: Duration) -> Result<(), VmError> {
        let socket = self.socket.clone();
        let pidfd = self.pidfd.as_ref().map(|f| f.try_clone()).transpose().map_err(io_err("dup pidfd"))?;
        let r = std::thread::spawn(move || -> Result<(), String> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
            rt.block_on(async move {
                let client = cordon_envd::EnvdClient::new(socket);
                let exited = async {
                    match pidfd {
                        Some(fd) => {
                            // SAFETY: the AsyncFd owns this duplicate of the pidfd outright, so it
                            // stays open and names the same process for the AsyncFd's life.
                            let afd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) };
                            if let Ok(afd) = afd {
                                let _ = afd.readable().await;
                            }
                        }
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    r = client.health() => r.map_err(|e| format!("the agent did not answer: {e}")),
                    _ = exited => Err("the VMM exited".to_string()),
                    _ = tokio::time::sleep(deadline) => Err(format!("no agent within {} s", deadline.as_secs())),
                }
            })
        })
        .join()
        .unwrap_or_else(|_| Err("readiness check panicked".into()));
        r.map_err(|e| {
            let tail = self.console_tail();
            VmError::Boot(if tail.is_empty() { e } else { format!("{e}; console: {tail}") })
        })
    }

    fn write_record(&self) -> Result<(), VmError> {
        let (pid, slot) = ((self.pid > 0).then_some(self.pid), self.slot.as_ref().map(|s| s.index));
        // Kept only once a holder serves its link: a create that dies half way is reaped as ever.
        let keep = matches!(self.link, Some(LinkControl::Holder(_)));
        let rec = ledger::Record { id: self.id.clone(), cgroup: self.cgroup.clone(), pid, slot, keep };
        self.entry.write(&rec).map_err(io_err("write record"))
    }

    /// Lets go of a VM whose holder serves its links without ending it: its locks are freed
    /// for the next owner, which adopts it ([`VmTier::adopt`]). Any other is destroyed, as a
    /// drop would.
    pub fn leave_running(mut self) {
        if matches!(self.link, Some(LinkControl::Holder(_))) && !self.torn_down {
            self.torn_down = true;
            // The holder is not waited for: it outlives this process.
            self.holder.take();
        }
    }

    /// Kills the VMM and removes its cgroups, disk layer, socket and record. Idempotent.
    pub fn destroy(&mut self) -> Result<(), VmError> {
        if self.torn_down {
            return Ok(());
        }
        self.torn_down = true;
        self.shares.stop();
        self.kill();
        // Waited for before anything reaps by pidfd: a pid reaped elsewhere could be reused.
        if let Some(mut h) = self.holder.take() {
            let _ = h.kill();
            let _ = h.wait();
            cordon_host::orphans::release(h.id());
        }
        // A thread waiting to wake a parked guest hears that it never will; an adopted VM's
        // holder (in the VM's groups, killed with them) is told to stop as well.
        if let Some(LinkControl::Holder(c)) = self.link.take() {
            c.stop();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let emptied = self.cgroup.kill_and_wait(Duration::from_secs(5));
        let removed = self.cgroup.remove();
        self.entry.remove();
        self.slot.take();
        if !emptied {
            return Err(VmError::Boot(format!("the VMM of {} did not die within 5 s", self.id)));
        }
        removed.map_err(io_err("remove cgroups"))
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            tracing::warn!("teardown of {}: {e}", self.id);
        }
    }
}

fn parse_vmstat_oom(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

#[cfg(test)]
mod tests {
    #[test]
    fn vmstat_oom_counter() {
        assert_eq!(super::parse_vmstat_oom("pgfault 5\noom_kill 2\nfoo 1\n"), 2);
        assert_eq!(super::parse_vmstat_oom("pgfault 5\n"), 0);
    }
}
