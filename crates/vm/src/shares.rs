//! Volumes in a VM: each is served to the guest over virtio-fs by its own `virtiofsd`
//! (QEMU's, shipped with qemu-system-common), which the VMM reaches through a vhost-user socket
//! bound into its jail.
//!
//! Why virtio-fs and not a second disk: the host keeps the volume's filesystem mounted and
//! shares it at the file level, so other sandboxes (any tier) and the content API can use the
//! volume while a VM has it, and the host never mounts an image that a guest kernel wrote block
//! by block. The daemon runs in the VM's cgroups (its memory and pids count against the VM, and
//! die with it), sandboxed by itself (mount, pid and net namespaces, pivoted into the volume,
//! seccomp); a read-only volume is a read-only bind in a mount namespace of its own, so guest
//! root cannot write through it whatever it remounts inside.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::{io_err, jailer, link_handshake, vmm, VmError};

/// QEMU's virtio-fs daemon.
pub const VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";
/// The descriptor the daemon finds its listening socket on.
const LISTEN_FD: RawFd = 3;

/// The shares of one VM, their daemons killed with it (by its cgroup, and here).
#[derive(Default)]
pub struct Shares {
    daemons: Vec<Child>,
}

impl Shares {
    /// Starts a daemon per volume, each listening on a socket in `run_dir` that the VMM (host
    /// uid `uid`) reaches in its jail; adds the sockets to `plan` and the devices to `spec`,
    /// as [`guest_volumes`] names them for the guest.
    pub fn start(
        volumes: &[cordon_spec::VolumeMount],
        run_dir: &Path,
        uid: u32,
        cgroup_procs: &[PathBuf],
        plan: &mut jailer::Plan,
        spec: &mut vmm::BootSpec,
    ) -> Result<Shares, VmError> {
        let mut shares = Shares::default();
        if volumes.is_empty() {
            return Ok(shares);
        }
        if !Path::new(VIRTIOFSD).is_file() {
            return Err(VmError::Unsupported(format!("{VIRTIOFSD} is missing: install qemu-system-common (scripts/install-deps) to mount volumes in VMs")));
        }
        for ((i, v), g) in volumes.iter().enumerate().zip(guest_volumes(volumes)) {
            let socket = run_dir.join(format!("vfs{i}.sock"));
            let listener = std::os::unix::net::UnixListener::bind(&socket).map_err(io_err(format!("bind {}", socket.display())))?;
            std::os::unix::fs::chown(&socket, Some(uid), Some(uid)).map_err(io_err("hand the share's socket to the VMM"))?;
            let inside = PathBuf::from(format!("/vm/vfs{i}.sock"));
            plan.bind(&socket, &inside, true);
            spec.shares.push((inside, g.tag));
            let log = std::fs::File::create(run_dir.join(format!("vfs{i}.log"))).map_err(io_err("create the share's log"))?;
            shares.daemons.push(spawn(v, listener.into(), cgroup_procs, log)?);
        }
        Ok(shares)
    }

    /// Kills and reaps every daemon. Each forks once into a PID namespace of its own; killed
    /// together, that child may outlive its parent for a moment and be handed to cordon (a
    /// child subreaper), which must reap it too or keep a zombie per share.
    pub fn stop(&mut self) {
        for mut d in self.daemons.drain(..) {
            let pid = d.id();
            let inner: Vec<i32> = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect();
            for p in &inner {
                // SAFETY: signalling a pid read from our own child's children list.
                unsafe { libc::kill(*p, libc::SIGKILL) };
            }
            let _ = d.kill();
            let _ = d.wait();
            cordon_host::orphans::release(pid);
            for p in inner {
                // Reaped by its parent already (ECHILD), or ours now: either way not a zombie.
                // SAFETY: waitpid on a specific pid with a null status pointer.
                unsafe { libc::waitpid(p, std::ptr::null_mut(), 0) };
            }
        }
    }
}

impl Drop for Shares {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What the guest mounts: share `i` is tagged `cordon-vol<i>`.
pub fn guest_volumes(volumes: &[cordon_spec::VolumeMount]) -> Vec<link_handshake::GuestVolume> {
    volumes.iter().enumerate().map(|(i, v)| link_handshake::GuestVolume { tag: format!("cordon-vol{i}"), target: v.target.clone(), read_only: v.read_only }).collect()
}

fn cstr(p: &Path) -> Result<CString, VmError> {
    CString::new(p.as_os_str().as_encoded_bytes()).map_err(|_| VmError::BadRequest(format!("path {} contains NUL", p.display())))
}

/// One daemon for `v`, on `listener`, in the VM's cgroups.
fn spawn(v: &cordon_spec::VolumeMount, listener: OwnedFd, cgroup_procs: &[PathBuf], log: std::fs::File) -> Result<Child, VmError> {
    let procs: Vec<std::fs::File> = cgroup_procs
        .iter()
        .map(|p| std::fs::OpenOptions::new().write(true).open(p))
        .collect::<io::Result<_>>()
        .map_err(io_err("open the VM's cgroups"))?;
    let source = cstr(&v.source)?;
    let read_only = v.read_only;
    let mut cmd = Command::new(VIRTIOFSD);
    cmd.arg(format!("--fd={LISTEN_FD}"))
        .arg("-o")
        .arg(format!("source={}", v.source.display()))
        // No caching in the guest: another sandbox, or the content API, may change the same
        // files at any time, and each must see the others' writes.
        .args(["-o", "cache=none", "-o", "sandbox=namespace", "-o", "no_xattr", "-o", "no_posix_lock", "-o", "no_flock", "--rlimit-nofile=65536", "-o", "log_level=warn"])
        // No device nodes (and no file capabilities) made by guest root on the volume.
        .args(["-o", "modcaps=-mknod:-setfcap"])
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    let (listen_raw, proc_fds): (RawFd, Vec<RawFd>) = (listener.as_raw_fd(), procs.iter().map(|f| f.as_raw_fd()).collect());
    // SAFETY: the closure makes only system calls on descriptors and strings prepared before
    // the fork (no allocation, no locks), which is what is safe between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let ok = |r: libc::c_int| if r < 0 { Err(io::Error::last_os_error()) } else { Ok(()) };
            for fd in &proc_fds {
                ok(libc::write(*fd, b"0\n".as_ptr().cast(), 2) as libc::c_int)?;
            }
            if listen_raw == LISTEN_FD {
                ok(libc::fcntl(LISTEN_FD, libc::F_SETFD, 0))?;
            } else {
                ok(libc::dup2(listen_raw, LISTEN_FD))?;
            }
            if read_only {
                // A read-only view of the volume in a mount namespace of the daemon's own: no
                // write from the guest reaches the volume, and nothing changes on the host.
                ok(libc::unshare(libc::CLONE_NEWNS))?;
                ok(libc::mount(c"none".as_ptr(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()))?;
                ok(libc::mount(source.as_ptr(), source.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()))?;
                let flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
                ok(libc::mount(std::ptr::null(), source.as_ptr(), std::ptr::null(), flags, std::ptr::null()))?;
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(io_err(format!("start {VIRTIOFSD}")))?;
    cordon_host::orphans::claim(child.id());
    drop(listener);
    drop(procs);
    Ok(child)
}
