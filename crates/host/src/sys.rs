//! Checked wrappers over the host syscalls every tier needs (pidfds, locks, the loopback
//! interface, passing descriptors). The ns tier's jailer has more of its own in `cordon-jail`.
//!
//! Each wrapper turns `-1` into an `io::Error` carrying errno and logs the step at `debug`, so a
//! failed setup names the exact call that failed.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// `ret` as a result: a negative return is the errno, named after `what`.
pub fn check(ret: libc::c_long, what: &str) -> io::Result<libc::c_long> {
    if ret < 0 {
        let e = io::Error::last_os_error();
        tracing::debug!("{what}: {e}");
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    } else {
        tracing::debug!("{what}: ok");
        Ok(ret)
    }
}

/// A pidfd for `pid`: it becomes readable when the process exits.
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: integer arguments; the returned fd is new and ours.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = check(r, "pidfd_open")?;
    // SAFETY: fresh fd from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// What waiting on a pidfd found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// It had exited, and is reaped now.
    Reaped,
    /// Our child, still running (only without blocking).
    Running,
    /// Not our child: another process reaps it, or it has been reaped already.
    NotOurs,
}

/// Waits for the process behind `pidfd`, blocking when `block` is set, and reaps it if it is
/// our child. A pidfd names one process for good, so a reused pid is never waited for.
pub fn pidfd_wait(pidfd: &OwnedFd, block: bool) -> io::Result<Waited> {
    const P_PIDFD: libc::idtype_t = 3;
    // SAFETY: zeroed siginfo is a valid output buffer for waitid.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let flags = libc::WEXITED | if block { 0 } else { libc::WNOHANG };
    loop {
        // SAFETY: valid pidfd and output pointer.
        let r = unsafe { libc::waitid(P_PIDFD, pidfd.as_raw_fd() as libc::id_t, &mut info, flags) };
        if r == 0 {
            // SAFETY: reading si_pid of a siginfo filled by waitid; 0 when it has not exited.
            return Ok(if block || unsafe { info.si_pid() } != 0 { Waited::Reaped } else { Waited::Running });
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::ECHILD) => return Ok(Waited::NotOurs),
            _ => return Err(e),
        }
    }
}

/// Reaps whichever of these processes are cordon's children once they have exited, waiting
/// up to `deadline` for them to. A sandbox's processes whose parent exits before them (runsc's)
/// are re-parented to cordon, a child subreaper, and would otherwise stay zombies as long as
/// cordon runs, each holding a pid of the host's. Held by pidfds taken while they lived, so a
/// reused pid is never waited for.
pub fn reap_all(held: &[(libc::pid_t, OwnedFd)], deadline: std::time::Duration) {
    let until = std::time::Instant::now() + deadline;
    for (pid, fd) in held {
        // Not ours yet may mean its parent has not exited yet: it is ours once it has.
        while !matches!(pidfd_wait(fd, false), Ok(Waited::Reaped)) && std::fs::metadata(format!("/proc/{pid}")).is_ok() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// Takes an exclusive lock without waiting: false when another process holds it.
pub fn flock_exclusive_nb(fd: &impl AsRawFd) -> io::Result<bool> {
    // SAFETY: flock on a valid fd.
    let r = unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Takes an exclusive lock, waiting for a holder to let go.
pub fn flock_exclusive(fd: &impl AsRawFd) -> io::Result<()> {
    loop {
        // SAFETY: flock on a valid fd.
        if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Brings the loopback interface of the current network namespace up.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: a plain socket used only for the interface ioctls below, closed by OwnedFd.
    let s = check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) } as _, "socket")?;
    // SAFETY: fresh fd from the kernel.
    let sock = unsafe { OwnedFd::from_raw_fd(s as RawFd) };
    // SAFETY: zeroed ifreq is valid; the name is copied in with its NUL terminator in range.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, b) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *b as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS fills ifr_ifru.ifru_flags of a valid ifreq.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } as _, "SIOCGIFFLAGS lo")?;
    // SAFETY: the flags union member was just written by the kernel.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: as above, now setting the flags.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } as _, "SIOCSIFFLAGS lo").map(drop)
}

/// Sends `data` in one message with `fd` attached (for protocols such as QMP's `getfd`, where
/// the descriptor rides on a command).
pub fn send_fd_with(sock: BorrowedFd<'_>, fd: BorrowedFd<'_>, data: &[u8]) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut _, iov_len: data.len() };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: zeroed msghdr, then every pointer set to buffers that outlive sendmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer is CMSG_SPACE bytes, large enough for one fd's cmsghdr.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd.as_raw_fd());
    }
    // SAFETY: msg is fully initialised above.
    let sent = check(unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, 0) } as _, "sendmsg fd")?;
    if sent as usize != data.len() {
        return Err(io::Error::other("sendmsg with a descriptor: short write"));
    }
    Ok(())
}

/// The running kernel's major and minor version, `(0, 0)` when it cannot be read.
pub fn kernel_version() -> (u32, u32) {
    let rel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut it = rel.split(|c: char| !c.is_ascii_digit()).filter_map(|p| p.parse::<u32>().ok());
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// Bytes used and total of the filesystem holding `path`; `None` when it cannot be read (the
/// process whose view the path goes through is gone).
pub fn disk_usage(path: &std::path::Path) -> Option<(u64, u64)> {
    let c = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str())).ok()?;
    // SAFETY: zeroed statvfs is a valid output buffer.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and output pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let total = st.f_blocks * st.f_frsize;
    Some((total - st.f_bfree * st.f_frsize, total))
}

/// Where `bin` is on `PATH` (the usual system directories when `PATH` is unset), if anywhere.
pub fn which(bin: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    path.split(':').map(|d| std::path::Path::new(d).join(bin)).find(|p| p.is_file())
}

/// Lazily unmounts whatever is mounted at `target`; nothing mounted there (or no such path) is
/// not an error.
pub fn umount_detach(target: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let t = std::ffi::CString::new(target.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `t` is a valid NUL-terminated path that lives across the call.
    let r = unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EINVAL | libc::ENOENT) => Ok(()),
            _ => Err(e),
        };
    }
    Ok(())
}

/// Makes this process undumpable: no core dump of it is ever written, and no process but root
/// may ptrace it or read its memory through /proc. For a process holding secrets' values
/// (`cordon serve`, `cordon run --secret`). Children get their own setting again at exec.
pub fn forbid_core_dumps() -> io::Result<()> {
    // SAFETY: PR_SET_DUMPABLE takes one integer argument and touches no memory of ours.
    let r = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong) };
    check(r as libc::c_long, "prctl(PR_SET_DUMPABLE, 0)").map(drop)
}
