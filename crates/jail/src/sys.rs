//! Thin, checked wrappers over the raw syscalls the jail needs and libc does not wrap.
//!
//! Each wrapper turns `-1` into an `io::Error` carrying errno and logs the step at `debug`, so a
//! failed setup names the exact call that failed.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub use cordon_host::sys::{check, loopback_up, pidfd_open, pidfd_wait, send_fd_with};

// From <linux/mount.h>; libc does not export these yet.
pub const OPEN_TREE_CLONE: libc::c_uint = 1;
pub const OPEN_TREE_CLOEXEC: libc::c_uint = libc::O_CLOEXEC as libc::c_uint;
pub const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
pub const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

pub fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("path {} contains NUL", p.display())))
}

/// `clone(2)` without a new stack: the child continues here like after `fork`, in the namespaces
/// named by `flags`. Returns 0 in the child.
///
/// # Safety
/// The caller must be single-threaded: the child is a copy of the calling thread only, and any
/// lock another thread held would stay locked forever in it.
pub unsafe fn clone_fork(flags: libc::c_int) -> io::Result<libc::pid_t> {
    // SAFETY: a NULL stack makes the kernel reuse the caller's stack copy-on-write, exactly as
    // fork does; the caller guarantees single-threadedness (see above).
    let r = unsafe {
        libc::syscall(libc::SYS_clone, (flags | libc::SIGCHLD) as libc::c_ulong, 0usize, 0usize, 0usize, 0usize)
    };
    check(r, "clone").map(|p| p as libc::pid_t)
}

/// `clone3`'s arguments up to `cgroup` (`CLONE_ARGS_SIZE_VER2`, Linux 5.7).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// `CLONE_INTO_CGROUP` (include/uapi/linux/sched.h).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// A fork whose child is born in the cgroup v2 group `dir` (`clone3` with `CLONE_INTO_CGROUP`),
/// instead of moving there afterwards. Returns 0 in the child.
///
/// # Safety
/// As [`clone_fork`]: the caller must be single-threaded.
pub unsafe fn fork_into_cgroup(dir: &Path) -> io::Result<libc::pid_t> {
    let d = cpath(dir)?;
    // SAFETY: a valid NUL-terminated path; the descriptor is closed below in both processes.
    let fd = unsafe { libc::open(d.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    check(fd as _, &format!("open {}", dir.display()))?;
    let mut args = CloneArgs { flags: CLONE_INTO_CGROUP, exit_signal: libc::SIGCHLD as u64, cgroup: fd as u64, ..Default::default() };
    // SAFETY: `args` is a valid clone_args of the size passed; no stack is given, so the child
    // continues on a copy-on-write copy of this one, as after fork (the caller is
    // single-threaded, see above).
    let r = unsafe { libc::syscall(libc::SYS_clone3, &mut args as *mut CloneArgs, std::mem::size_of::<CloneArgs>()) };
    // SAFETY: closing the descriptor opened above, in whichever process this is.
    unsafe { libc::close(fd) };
    check(r, "clone3 into the sandbox's cgroup").map(|p| p as libc::pid_t)
}

pub fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: unshare takes only an integer and affects the calling thread's namespaces.
    check(unsafe { libc::unshare(flags) } as _, "unshare").map(drop)
}

pub fn mount(src: &str, target: &Path, fstype: &str, flags: libc::c_ulong, data: Option<&str>) -> io::Result<()> {
    let src_c = CString::new(src).unwrap_or_default();
    let fstype_c = CString::new(fstype).unwrap_or_default();
    let target_c = cpath(target)?;
    let data_c = data.map(|d| CString::new(d).unwrap_or_default());
    // SAFETY: every pointer is a valid NUL-terminated string that lives across the call.
    let r = unsafe {
        libc::mount(
            src_c.as_ptr(),
            target_c.as_ptr(),
            fstype_c.as_ptr(),
            flags,
            data_c.as_ref().map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    check(r as _, &format!("mount {fstype} {src} on {}", target.display())).map(drop)
}

pub fn bind(src: &Path, target: &Path) -> io::Result<()> {
    let s = cpath(src)?;
    let t = cpath(target)?;
    // SAFETY: valid strings; MS_BIND ignores the fstype and data arguments.
    let r = unsafe { libc::mount(s.as_ptr(), t.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()) };
    check(r as _, &format!("bind {} on {}", src.display(), target.display())).map(drop)
}

/// Binds `src` on `target`, then remounts the bind with `flags` (a bind mount takes its
/// nosuid/nodev/noexec/rdonly flags only on a remount).
pub fn bind_with(src: &Path, target: &Path, flags: libc::c_ulong) -> io::Result<()> {
    bind(src, target)?;
    let t = cpath(target)?;
    // SAFETY: valid string; a remount of a bind takes only the target and the flags.
    let r = unsafe {
        libc::mount(std::ptr::null(), t.as_ptr(), std::ptr::null(), libc::MS_BIND | libc::MS_REMOUNT | flags, std::ptr::null())
    };
    check(r as _, &format!("remount {} with flags {flags:#x}", target.display())).map(drop)
}

pub fn make_private_recursive(target: &str) -> io::Result<()> {
    let t = CString::new(target).unwrap_or_default();
    // SAFETY: changing propagation needs only the target path.
    let r = unsafe {
        libc::mount(std::ptr::null(), t.as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null())
    };
    check(r as _, "make / private").map(drop)
}

/// A detached, recursive clone of the tree at `path`.
pub fn open_tree_clone(path: &Path) -> io::Result<OwnedFd> {
    let p = cpath(path)?;
    // SAFETY: open_tree reads the path string and returns a new fd we take ownership of.
    let r = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            p.as_ptr(),
            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | libc::AT_RECURSIVE as libc::c_uint,
        )
    };
    let fd = check(r, &format!("open_tree {}", path.display()))?;
    // SAFETY: the kernel just returned this fd to us and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Applies mount attributes to every mount of a detached tree; with `userns` it becomes an
/// idmapped mount that shows file owners through that namespace's uid/gid maps.
pub fn mount_setattr(tree: &OwnedFd, attr_set: u64, userns: Option<&OwnedFd>) -> io::Result<()> {
    let attr = MountAttr {
        attr_set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.map_or(0, |u| u.as_raw_fd() as u64),
    };
    let empty = c"";
    // SAFETY: `attr` is a properly laid out struct mount_attr that outlives the call, and its
    // size is passed so the kernel reads exactly it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            (libc::AT_EMPTY_PATH | libc::AT_RECURSIVE) as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    check(r, "mount_setattr").map(drop)
}

pub fn move_mount_to(tree: &OwnedFd, target: &Path) -> io::Result<()> {
    let t = cpath(target)?;
    move_mount(tree, libc::AT_FDCWD, &t, 0, &format!("move_mount to {}", target.display()))
}

/// Attaches a detached tree on the directory open at `target` (not a path: one opened
/// component by component, see `rootfs::dir_beneath`).
pub fn move_mount_to_fd(tree: &OwnedFd, target: &OwnedFd) -> io::Result<()> {
    const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
    move_mount(tree, target.as_raw_fd(), c"", MOVE_MOUNT_T_EMPTY_PATH, "move_mount to a volume path")
}

/// `move_mount` of the detached `tree` to `to` relative to `to_dir`, with `to_flags` added.
fn move_mount(tree: &OwnedFd, to_dir: RawFd, to: &CStr, to_flags: libc::c_uint, what: &str) -> io::Result<()> {
    let empty = c"";
    // SAFETY: a detached tree fd, a directory fd (or AT_FDCWD) and path strings that live
    // across the call.
    let r = unsafe { libc::syscall(libc::SYS_move_mount, tree.as_raw_fd(), empty.as_ptr(), to_dir, to.as_ptr(), MOVE_MOUNT_F_EMPTY_PATH | to_flags) };
    check(r, what).map(drop)
}

/// Lazily unmounts whatever is mounted at `target`.
pub fn umount_detach(target: &Path) -> io::Result<()> {
    let t = cpath(target)?;
    // SAFETY: `t` is a valid NUL-terminated path that lives across the call.
    let r = unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `pivot_root(".", ".")` then detach the old root, which is stacked on top of the new one.
pub fn pivot_to_cwd() -> io::Result<()> {
    let dot = c".";
    // SAFETY: both arguments are the static string ".".
    check(unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) }, "pivot_root")?;
    // SAFETY: as above; MNT_DETACH lazily unmounts the old root stacked on ".".
    check(unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) } as _, "detach old root")?;
    let root = c"/";
    // SAFETY: static path.
    check(unsafe { libc::chdir(root.as_ptr()) } as _, "chdir /").map(drop)
}

pub fn chdir(p: &Path) -> io::Result<()> {
    let c = cpath(p)?;
    // SAFETY: valid path string.
    check(unsafe { libc::chdir(c.as_ptr()) } as _, &format!("chdir {}", p.display())).map(drop)
}

pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: pointer and length describe `name`'s bytes.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } as _, "sethostname").map(drop)
}

pub fn become_root() -> io::Result<()> {
    // SAFETY: plain integer syscalls on the calling process's credentials.
    unsafe {
        check(libc::setgroups(0, std::ptr::null()) as _, "setgroups")?;
        check(libc::setresgid(0, 0, 0) as _, "setresgid")?;
        check(libc::setresuid(0, 0, 0) as _, "setresuid")?;
    }
    Ok(())
}

/// Sets the effective (and so the filesystem) uid and gid to `id`, keeping the real and saved
/// ones: a host-root caller leaves root's privileges unused and can take them back with
/// `set_effective_ids(0)`, which an unprivileged real id could not.
pub fn set_effective_ids(id: u32) -> io::Result<()> {
    let keep = u32::MAX; // -1: leave that id as it is
    // SAFETY: plain integer syscalls on the calling process's credentials. Leaving root, the
    // gid goes first (changing it needs root); coming back, the uid does.
    unsafe {
        if id == 0 {
            check(libc::setresuid(keep, 0, keep) as _, "setresuid back to root")?;
            check(libc::setresgid(keep, 0, keep) as _, "setresgid back to root")?;
        } else {
            check(libc::setresgid(keep, id, keep) as _, "setresgid")?;
            check(libc::setresuid(keep, id, keep) as _, "setresuid")?;
        }
    }
    Ok(())
}

/// Starts a new session (with no controlling terminal) led by the caller.
pub fn setsid() -> io::Result<()> {
    // SAFETY: no arguments; fails only when the caller already leads a process group.
    check(unsafe { libc::setsid() } as _, "setsid").map(drop)
}

/// A close-on-exec memfd holding `data`, positioned at its start and sealed against every
/// change: the reader gets exactly these bytes and nobody can alter them afterwards.
pub fn sealed_memfd(name: &str, data: &[u8]) -> io::Result<OwnedFd> {
    use std::io::{Seek, Write};
    let n = CString::new(name).map_err(|_| io::Error::other("NUL in memfd name"))?;
    // SAFETY: a valid name string; the returned fd is new and ours.
    let fd = check(unsafe { libc::memfd_create(n.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) } as _, "memfd_create")?;
    // SAFETY: the kernel just returned this fd to us and nobody else owns it.
    let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
    f.write_all(data)?;
    f.rewind()?;
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl with integer arguments on our own fd.
    check(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) } as _, "seal memfd")?;
    Ok(f.into())
}

pub fn setrlimit(res: libc::__rlimit_resource_t, soft: u64, hard: u64) -> io::Result<()> {
    let lim = libc::rlimit { rlim_cur: soft, rlim_max: hard };
    // SAFETY: `lim` is a valid rlimit for the duration of the call.
    check(unsafe { libc::setrlimit(res, &lim) } as _, "setrlimit").map(drop)
}

pub fn dup2(from: RawFd, to: RawFd) -> io::Result<()> {
    // SAFETY: dup2 on integers; `to` is replaced atomically.
    check(unsafe { libc::dup2(from, to) } as _, "dup2").map(drop)
}

/// Marks every fd from `first` upward close-on-exec, so nothing of the host leaks into the
/// sandbox through an inherited descriptor.
pub fn cloexec_from(first: libc::c_uint) -> io::Result<()> {
    // SAFETY: integer arguments only.
    check(
        unsafe { libc::syscall(libc::SYS_close_range, first, libc::c_uint::MAX, libc::CLOSE_RANGE_CLOEXEC) },
        "close_range",
    )
    .map(drop)
}

/// `execveat(fd, "", argv, envp, AT_EMPTY_PATH)`: runs the program open at `fd`, which lives
/// outside the sandbox's root, without it ever being mounted inside.
pub fn execveat_fd(fd: RawFd, argv: &[CString], envp: &[CString]) -> io::Error {
    let mut a: Vec<*const libc::c_char> = argv.iter().map(|s| s.as_ptr()).collect();
    a.push(std::ptr::null());
    let mut e: Vec<*const libc::c_char> = envp.iter().map(|s| s.as_ptr()).collect();
    e.push(std::ptr::null());
    let empty: &CStr = c"";
    // SAFETY: argv/envp are NULL-terminated arrays of valid strings kept alive by the caller;
    // on success this call does not return.
    unsafe { libc::syscall(libc::SYS_execveat, fd, empty.as_ptr(), a.as_ptr(), e.as_ptr(), libc::AT_EMPTY_PATH) };
    io::Error::last_os_error()
}

pub fn pidfd_kill(pidfd: &OwnedFd) -> io::Result<()> {
    // SAFETY: a valid pidfd and a signal number; no siginfo.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, 0usize, 0u32) };
    match check(r, "pidfd_send_signal") {
        Ok(_) => Ok(()),
        // Already dead: the goal is reached.
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Sends one fd and a byte over a Unix socket.
pub fn send_fd(sock: &OwnedFd, fd: &OwnedFd) -> io::Result<()> {
    send_fd_with(sock.as_fd(), fd.as_fd(), &[1u8])
}

/// Receives one message, with the fd it carries if any; an empty message means EOF.
pub fn recv_msg(sock: &OwnedFd) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut data = vec![0u8; 4096];
    let mut iov = libc::iovec { iov_base: data.as_mut_ptr().cast(), iov_len: data.len() };
    // SAFETY: pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: zeroed msghdr pointing at buffers that outlive recvmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: msg is initialised; MSG_CMSG_CLOEXEC keeps the fd from leaking through exec.
    let n = check(unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) } as _, "recvmsg")?;
    data.truncate(n as usize);
    // SAFETY: the kernel filled the control buffer; the header is checked before the data.
    let fd = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() || (*c).cmsg_type != libc::SCM_RIGHTS {
            None
        } else {
            Some(OwnedFd::from_raw_fd(std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const RawFd)))
        }
    };
    // A message carrying an fd has only send_fd's marker byte as data: report the fd alone.
    Ok((if fd.is_some() { Vec::new() } else { data }, fd))
}

/// Duplicates fd `target` of the process behind `pidfd` into this process.
pub fn pidfd_getfd(pidfd: &OwnedFd, target: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: integer arguments; the returned fd is new and ours.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0u32) };
    let fd = check(r, "pidfd_getfd")?;
    // SAFETY: fresh fd from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Receives one fd sent by [`send_fd`]; `Ok(None)` on EOF.
pub fn recv_fd(sock: &OwnedFd) -> io::Result<Option<OwnedFd>> {
    match recv_msg(sock)? {
        (_, Some(fd)) => Ok(Some(fd)),
        (data, None) if data.is_empty() => Ok(None),
        (_, None) => Err(io::Error::new(io::ErrorKind::InvalidData, "expected an fd")),
    }
}

pub fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    check(
        // SAFETY: fds is a 2-element output array.
        unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) } as _,
        "socketpair",
    )?;
    // SAFETY: both fds are fresh from the kernel.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
