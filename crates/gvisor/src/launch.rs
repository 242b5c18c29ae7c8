//! Starting `runsc run` in namespaces of its own, and serving the agent's link to the host.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

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
    /// A sandbox saved by [`crate::Sandbox`]'s checkpoint: its writable layer is copied back
    /// into the new tmpfs and runsc restores its kernel from the saved image instead of
    /// starting the bundle's init.
    pub restore: Option<&'a Path>,
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

/// Where a saved sandbox keeps what the writable layer's tmpfs held (`upper`, `tmp`, `shm`),
/// and runsc's checkpoint image, under the directory it was saved to.
pub const SAVED_DISK: &str = "disk";
pub const SAVED_IMAGE: &str = "image";

/// The host's `cp`, which copies a saved writable layer with everything an overlay's upper
/// directory holds (owners, modes, times, xattrs, whiteout devices, hard links, holes).
pub fn cp() -> Result<PathBuf, GvisorError> {
    ["/usr/bin/cp", "/bin/cp"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| GvisorError::Unavailable("no cp in /usr/bin or /bin (coreutils) to save a sandbox's files with".into()))
}

/// Starts `runsc run` (or `runsc restore`) with the agent's stdio on two pipes. In the child,
/// before runsc runs: join the sandbox's cgroups, unshare a mount namespace and mount the root
/// there (with a saved writable layer copied back first), and enter the sandbox's network
/// namespace (a new empty one when it has no egress policy).
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
    // A restore copies the saved layer into the new tmpfs with `cp -a`, run from the child
    // (fork, exec, wait: syscalls only) because the tmpfs exists only in its mount namespace.
    let copy_back: Option<(Vec<CString>, CString)> = match plan.restore {
        Some(saved) => {
            let cp = cstr(&cp()?)?;
            let mut argv = vec![cp.clone(), CString::new("-a").expect("no NUL"), CString::new("--").expect("no NUL")];
            for part in ["upper", SHARED_TMP, SHARED_SHM] {
                argv.push(cstr(&saved.join(SAVED_DISK).join(part))?);
            }
            argv.push(disk.clone());
            Some((argv, cp))
        }
        None => None,
    };
    let copy_argv: Vec<*const libc::c_char> = match &copy_back {
        Some((argv, _)) => argv.iter().map(|a| a.as_ptr()).chain(std::iter::once(std::ptr::null())).collect(),
        None => Vec::new(),
    };
    let copy_path = copy_back.as_ref().map(|(_, cp)| cp.as_ptr());
    let copy_env: [*const libc::c_char; 1] = [std::ptr::null()];
    // Raw pointers are not Send; the closure below runs in the forked child only.
    let (copy_argv_addr, copy_env_addr) = (copy_argv.as_ptr() as usize, copy_env.as_ptr() as usize);
    let copy_path_addr = copy_path.map(|p| p as usize);

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
        .args(match plan.restore {
            Some(saved) => vec!["restore".to_string(), format!("--image-path={}", saved.join(SAVED_IMAGE).display())],
            None => vec!["run".to_string()],
        })
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
            match copy_path_addr {
                Some(path) => run_and_wait(path as *const libc::c_char, copy_argv_addr as *const *const libc::c_char, copy_env_addr as *const *const libc::c_char)?,
                None => {
                    check(libc::mkdir(upper.as_ptr(), 0o755))?;
                    for d in &shared {
                        check(libc::mkdir(d.as_ptr(), 0o1777))?;
                        // mkdir applies the umask: sticky and world-writable, as /tmp and /dev/shm are.
                        check(libc::chmod(d.as_ptr(), 0o1777))?;
                    }
                }
            }
            check(libc::mkdir(work.as_ptr(), 0o700))?;
            check(libc::chdir(dir.as_ptr()))?;
            check(libc::mount(root_source.as_ptr(), rootfs.as_ptr(), overlay.as_ptr(), 0, ovl_opts.as_ptr().cast()))?;
            check(libc::chdir(root.as_ptr()))?;
            Ok(())
        });
    }
    tracing::debug!(id = plan.id, platform = plan.platform, restore = plan.restore.is_some(), "spawning runsc");
    let child = cmd.spawn().map_err(|e| match plan.restore {
        // EIO is `run_and_wait`'s word for a failed copy.
        Some(saved) if e.raw_os_error() == Some(libc::EIO) => {
            GvisorError::Setup(format!("copy the saved sandbox's files back from {}: cp failed", saved.join(SAVED_DISK).display()))
        }
        _ => GvisorError::Setup(format!("start {} in the sandbox's namespaces: {e}", plan.runsc.display())),
    })?;
    // Kept alive until the child has exec'd (spawn returns after that).
    drop((copy_argv, copy_back));
    let pidfd = cordon_host::sys::pidfd_open(child.id() as i32).map_err(crate::io_err("pidfd_open runsc"))?;
    Ok(Launched { child, pidfd, from_agent: from_agent_r, to_agent: to_agent_w })
}

/// Runs a program to completion from a forked child before its exec: fork, execve, waitpid,
/// nothing that allocates or locks.
///
/// # Safety
/// `path`, `argv` and `envp` must point at NUL-terminated strings and NULL-terminated arrays
/// that live until this returns.
unsafe fn run_and_wait(path: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> io::Result<()> {
    // SAFETY: the caller is a single-threaded child after fork; the grandchild only execs.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: pointers valid per this function's contract.
        unsafe {
            libc::execve(path, argv, envp);
            libc::_exit(127);
        }
    }
    let mut status = 0;
    loop {
        // SAFETY: waits for the child just forked.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return Err(io::Error::last_os_error());
        }
    }
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Ok(())
    } else {
        // Reported by spawn (no allocation here: EIO stands for "the copy failed").
        Err(io::Error::from_raw_os_error(libc::EIO))
    }
}

/// The thread serving the agent's socket from its link, and the means to park the agent.
pub struct LinkThread {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Set before the agent is asked to park: the session's end is then a park.
    parking: Arc<AtomicBool>,
    parked: mpsc::Receiver<io::Result<()>>,
    /// A send wakes a parked agent; dropping it ends the thread instead.
    wake: Option<mpsc::SyncSender<()>>,
}

/// How long an agent may take to park once asked.
const PARK_DEADLINE: Duration = Duration::from_secs(10);

impl LinkThread {
    /// Asks the agent to park its link (see `cordon_agent::park`) through `socket` and waits
    /// until it has: its processes go on, nothing reaches it until [`LinkThread::wake`].
    pub fn park(&self, socket: &Path) -> Result<(), GvisorError> {
        use std::io::Write;
        self.parking.store(true, Ordering::SeqCst);
        let asked = std::os::unix::net::UnixStream::connect(socket).and_then(|mut s| s.write_all(cordon_agent::PARK_REQUEST).map(|()| s));
        let said = match asked {
            Ok(_conn) => self.parked.recv_timeout(PARK_DEADLINE + Duration::from_secs(1)).unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into())),
            Err(e) => Err(e),
        };
        said.map_err(|e| {
            self.parking.store(false, Ordering::SeqCst);
            GvisorError::Setup(format!("the agent did not park its link: {e}"))
        })
    }

    /// Lets a parked agent serve again.
    pub fn wake(&self) -> Result<(), GvisorError> {
        self.parking.store(false, Ordering::SeqCst);
        self.wake.as_ref().and_then(|w| w.send(()).ok()).ok_or_else(|| GvisorError::Setup("the sandbox's link is gone".into()))
    }

    /// Stops serving and waits for the thread (live connections are dropped).
    pub fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        // A thread waiting to wake a parked agent hears that it never will.
        self.wake = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What goes first on the link, before the channel.
pub enum Opening {
    /// A new agent: its configuration, which it reads from its stdin before it serves.
    Config(Vec<u8>),
    /// A restored agent, parked when it was saved: the resume marker.
    Resume,
}

/// Serves `listener` over the agent's pipes on a thread of its own (one small runtime per
/// sandbox: the link must keep moving whatever the caller's runtime does), one multiplexer
/// session at a time: a session that ends because the agent was asked to park is followed by
/// the agent's parked marker, and then, once woken, by the next session.
pub fn serve_link(from_agent: OwnedFd, to_agent: OwnedFd, listener: std::os::unix::net::UnixListener, opening: Opening) -> Result<LinkThread, GvisorError> {
    listener.set_nonblocking(true).map_err(crate::io_err("agent socket"))?;
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let parking = Arc::new(AtomicBool::new(false));
    let (parked_tx, parked) = mpsc::sync_channel(1);
    let (wake, wake_rx) = mpsc::sync_channel::<()>(1);
    let is_parking = parking.clone();
    let thread = std::thread::Builder::new()
        .name("gvisor-link".into())
        .spawn(move || {
            let first = match opening {
                Opening::Config(c) => c,
                Opening::Resume => cordon_agent::RESUME.to_vec(),
            };
            if let Err(e) = write_all_blocking(&to_agent, &first) {
                tracing::debug!("opening the agent's link: {e}");
                return;
            }
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_io().build() else { return };
            let Ok(listener) = rt.block_on(async { tokio::net::UnixListener::from_std(listener) }) else { return };
            loop {
                let ended = rt.block_on(async {
                    let link = match (from_agent.try_clone(), to_agent.try_clone()) {
                        (Ok(r), Ok(w)) => cordon_channel::FdLink::new(r, w)?,
                        (Err(e), _) | (_, Err(e)) => return Err(e),
                    };
                    tokio::select! {
                        r = cordon_channel::serve_unix(link, &listener) => r.map(|()| true),
                        _ = &mut stopped => Ok(false),
                    }
                });
                match ended {
                    Ok(true) if is_parking.load(Ordering::SeqCst) => {}
                    Ok(true) | Ok(false) => return,
                    Err(e) => {
                        tracing::debug!("agent link ended: {e}");
                        return;
                    }
                }
                let r = await_parked_within(&from_agent, PARK_DEADLINE);
                let ok = r.is_ok();
                let _ = parked_tx.send(r);
                if !ok || wake_rx.recv().is_err() {
                    return;
                }
                if let Err(e) = write_all_blocking(&to_agent, cordon_agent::RESUME) {
                    tracing::debug!("waking the agent: {e}");
                    return;
                }
            }
        })
        .map_err(crate::io_err("start the link thread"))?;
    Ok(LinkThread { stop: Some(stop), thread: Some(thread), parking, parked, wake: Some(wake) })
}

/// Writes all of `buf` to a pipe that a session's multiplexer may have made non-blocking.
fn write_all_blocking(fd: &OwnedFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        wait_for(fd, libc::POLLOUT, Duration::from_secs(10))?;
        // SAFETY: a valid buffer of the given length and an open descriptor.
        let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) {
                continue;
            }
            return Err(e);
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// Waits until `fd` is ready for `events`, or fails after `timeout`.
fn wait_for(fd: &OwnedFd, events: libc::c_short, timeout: Duration) -> io::Result<()> {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    match unsafe { libc::poll(&mut p, 1, timeout.as_millis().min(i32::MAX as u128) as i32) } {
        0 => Err(io::ErrorKind::TimedOut.into()),
        n if n < 0 => Err(io::Error::last_os_error()),
        _ => Ok(()),
    }
}

/// The frames a parking agent still sends, up to its marker, read within `deadline`.
fn await_parked_within(fd: &OwnedFd, deadline: Duration) -> io::Result<()> {
    struct Patient<'a> {
        fd: &'a OwnedFd,
        until: std::time::Instant,
    }
    impl io::Read for Patient<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            loop {
                wait_for(self.fd, libc::POLLIN, self.until.saturating_duration_since(std::time::Instant::now()))?;
                // SAFETY: a valid buffer of the given length and an open descriptor.
                let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n >= 0 {
                    return Ok(n as usize);
                }
                let e = io::Error::last_os_error();
                if !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) {
                    return Err(e);
                }
            }
        }
    }
    cordon_agent::await_parked(&mut Patient { fd, until: std::time::Instant::now() + deadline })
}
