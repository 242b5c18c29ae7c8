//! Starting `runsc run` in namespaces of its own, and serving the agent's link to the host.

use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::GvisorError;

/// Everything `spawn` needs, resolved before the fork.
pub struct Plan<'a> {
    pub runsc: &'a Path,
    pub platform: &'a str,
    pub id: &'a str,
    /// The sandbox's directory: bundle, runsc state, log.
    pub dir: &'a Path,
    /// The image's read-only layer trees, bottom first.
    pub image: &'a [PathBuf],
    /// Mount point of the sandbox's root (empty on the host).
    pub rootfs: &'a Path,
    /// Mount point of the writable layer's tmpfs (empty on the host).
    pub disk: &'a Path,
    pub disk_bytes: u64,
    pub cgroup_procs: Vec<PathBuf>,
    /// A network namespace to run runsc in, with host networking (see `netns`); without one,
    /// runsc gets a new, empty namespace and no network at all.
    pub netns: Option<std::os::fd::RawFd>,
}

pub struct Launched {
    pub child: std::process::Child,
    pub pidfd: OwnedFd,
    /// The host's ends of the agent's stdio: read what the agent writes, write what it reads.
    pub from_agent: OwnedFd,
    pub to_agent: OwnedFd,
}

fn cstr(p: &Path) -> Result<CString, GvisorError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| GvisorError::Setup(format!("path {} contains NUL", p.display())))
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into `fds`.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned here alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Subdirectories of the writable layer's tmpfs that the bundle binds at /tmp and /dev/shm, so
/// that `--disk` caps the root, /tmp and /dev/shm together.
pub const SHARED_TMP: &str = "tmp";
pub const SHARED_SHM: &str = "shm";

/// Starts `runsc run` with the agent's stdio on two pipes. In the child, before runsc runs: join
/// the sandbox's cgroups, unshare a mount namespace and mount the root there, and enter the
/// sandbox's network namespace (a new empty one when it has no egress policy).
pub fn spawn(plan: &Plan) -> Result<Launched, GvisorError> {
    // Everything the child uses is allocated here: between fork and exec only syscalls run.
    let procs: Vec<CString> = plan.cgroup_procs.iter().map(|p| cstr(p)).collect::<Result<_, _>>()?;
    let root = CString::new("/").expect("no NUL");
    let tmpfs = CString::new("tmpfs").expect("no NUL");
    let overlay = CString::new("overlay").expect("no NUL");
    let rw_source = CString::new("cordon-rw").expect("no NUL");
    let root_source = CString::new("cordon-root").expect("no NUL");
    let disk = cstr(plan.disk)?;
    let rootfs = cstr(plan.rootfs)?;
    let upper = cstr(&plan.disk.join("upper"))?;
    let work = cstr(&plan.disk.join("work"))?;
    let shared = [cstr(&plan.disk.join(SHARED_TMP))?, cstr(&plan.disk.join(SHARED_SHM))?];
    let disk_opts = CString::new(format!("size={},mode=0755", plan.disk_bytes)).expect("no NUL");
    // The layers by short names relative to the sandbox's directory (`l/0` ..), which the
    // child makes its working directory for the mount: the kernel reads the options from one
    // page, which the layer store's full paths fill at about 35 layers (Docker's overlay2
    // driver shortens them the same way).
    let links = plan.dir.join("l");
    std::fs::create_dir_all(&links).map_err(crate::io_err("create the layer links"))?;
    for (i, layer) in plan.image.iter().enumerate() {
        let link = links.join(i.to_string());
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(layer, &link).map_err(crate::io_err("link a layer"))?;
    }
    let ovl_opts = cstr(Path::new(&format!(
        "lowerdir={},upperdir={},workdir={}",
        // overlayfs lists lower layers top first.
        (0..plan.image.len()).rev().map(|i| format!("l/{i}")).collect::<Vec<_>>().join(":"),
        plan.disk.join("upper").display(),
        plan.disk.join("work").display()
    )))?;
    let dir = cstr(plan.dir)?;

    let (to_agent_r, to_agent_w) = pipe().map_err(crate::io_err("create pipe"))?;
    let (from_agent_r, from_agent_w) = pipe().map_err(crate::io_err("create pipe"))?;
    let log = std::fs::File::create(plan.dir.join("runsc.log")).map_err(crate::io_err("create runsc.log"))?;

    let netns = plan.netns;
    let mut cmd = Command::new(plan.runsc);
    cmd.arg(format!("--root={}", plan.dir.join("runsc").display()))
        .arg(format!("--platform={}", plan.platform))
        // Without a policy: gVisor's own loopback only. With one: the sockets of the namespace
        // cordon made, whose only way out is the forwarder's TUN device (see `netns`).
        .arg(if netns.is_some() { "--network=host" } else { "--network=none" })
        // cordon made the cgroups and runsc is already in them.
        .arg("--ignore-cgroups")
        // The root is cordon's overlay, with its disk cap: no second overlay inside gVisor.
        .arg("--overlay2=none")
        .arg("run")
        .arg(format!("--bundle={}", plan.dir.display()))
        .arg(plan.id)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::from(to_agent_r))
        .stdout(Stdio::from(from_agent_w))
        .stderr(Stdio::from(log));
    // SAFETY: the closure only makes syscalls on data prepared above (no allocation, no locks),
    // which is what is allowed between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for p in &procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                check(fd)?;
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if n != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            match netns {
                Some(fd) => {
                    check(libc::unshare(libc::CLONE_NEWNS))?;
                    check(libc::setns(fd, libc::CLONE_NEWNET))?;
                }
                None => check(libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWNET))?,
            }
            // Nothing mounted from here on propagates to the host.
            check(libc::mount(std::ptr::null(), root.as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()))?;
            check(libc::mount(
                rw_source.as_ptr(),
                disk.as_ptr(),
                tmpfs.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME,
                disk_opts.as_ptr().cast(),
            ))?;
            check(libc::mkdir(upper.as_ptr(), 0o755))?;
            check(libc::mkdir(work.as_ptr(), 0o700))?;
            for d in &shared {
                check(libc::mkdir(d.as_ptr(), 0o1777))?;
                // mkdir applies the umask: sticky and world-writable, as /tmp and /dev/shm are.
                check(libc::chmod(d.as_ptr(), 0o1777))?;
            }
            check(libc::chdir(dir.as_ptr()))?;
            check(libc::mount(root_source.as_ptr(), rootfs.as_ptr(), overlay.as_ptr(), 0, ovl_opts.as_ptr().cast()))?;
            check(libc::chdir(root.as_ptr()))?;
            Ok(())
        });
    }
    tracing::debug!(id = plan.id, platform = plan.platform, "spawning runsc run");
    let child = cmd.spawn().map_err(|e| {
        GvisorError::Setup(format!("start {} in the sandbox's namespaces: {e}", plan.runsc.display()))
    })?;
    let pidfd = cordon_host::sys::pidfd_open(child.id() as i32).map_err(crate::io_err("pidfd_open runsc"))?;
    Ok(Launched { child, pidfd, from_agent: from_agent_r, to_agent: to_agent_w })
}

/// The thread serving the agent's socket from its link.
pub struct LinkThread {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LinkThread {
    /// Stops serving and waits for the thread (live connections are dropped).
    pub fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves `listener` over the agent's pipes on a thread of its own (one small runtime per
/// sandbox: the link must keep moving whatever the caller's runtime does).
/// `config` goes out first, before the channel: the agent reads it from its stdin (the far end
/// of `to_agent`) and only then starts serving.
pub fn serve_link(
    from_agent: OwnedFd,
    to_agent: OwnedFd,
    listener: std::os::unix::net::UnixListener,
    config: Vec<u8>,
) -> Result<LinkThread, GvisorError> {
    listener.set_nonblocking(true).map_err(crate::io_err("agent socket"))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("gvisor-link".into())
        .spawn(move || {
            use std::io::Write;
            let mut to = std::fs::File::from(to_agent);
            if let Err(e) = to.write_all(&config) {
                tracing::debug!("sending the agent its configuration: {e}");
                return;
            }
            let to_agent = OwnedFd::from(to);
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_io().build() else { return };
            rt.block_on(async move {
                let (link, listener) = match (cordon_channel::FdLink::new(from_agent, to_agent), tokio::net::UnixListener::from_std(listener)) {
                    (Ok(l), Ok(s)) => (l, s),
                    _ => return,
                };
                tokio::select! {
                    r = cordon_channel::serve_unix(link, listener) => tracing::debug!("agent link ended: {r:?}"),
                    _ = stopped => {}
                }
            });
        })
        .map_err(crate::io_err("start the link thread"))?;
    Ok(LinkThread { stop: Some(stop), thread: Some(thread) })
}
