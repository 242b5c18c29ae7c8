//! Jails the VMM process the way Firecracker's jailer does, applied between fork and exec:
//! it joins its own cgroups, gets new mount, network, IPC, UTS and cgroup namespaces (and is PID
//! 1 of a PID namespace of its own, see [`spawn_in_new_pid_namespace`]), sees a
//! root made of only what it needs (its binary's libraries read-only, the kernel, initramfs
//! and disks of this VM, /dev/null, /dev/urandom and, under KVM, /dev/kvm), then drops to an
//! unprivileged uid of its own with no capabilities and no_new_privs, and dies with the thread
//! that started it. QEMU's own `-sandbox on` seccomp filter comes on top.
//!
//! Everything the child does is prepared here before the fork (paths as C strings, open
//! descriptors), so the code between fork and exec only makes system calls.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};

/// A bind mount into the jail.
struct Bind {
    src: CString,
    dst: CString,
    writable: bool,
}

/// The jail of one VMM process.
pub struct Plan {
    root: CString,
    /// Directories to create under the root, parents first.
    dirs: Vec<CString>,
    /// Files to create as mount points for file binds.
    files: Vec<CString>,
    /// (target, link path) symlinks, for merged-/usr hosts.
    links: Vec<(CString, CString)>,
    binds: Vec<Bind>,
    uid: u32,
    groups: Vec<libc::gid_t>,
    cgroup_procs: Vec<RawFd>,
    /// (descriptor now, number it must have in the VMM).
    fds: Vec<(RawFd, RawFd)>,
    /// The VMM outlives its maker (see [`Plan::keep`]).
    keep: bool,
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).expect("paths have no NUL")
}

impl Plan {
    /// An empty jail rooted at `root` (an empty directory), for uid `uid`.
    pub fn new(root: &Path, uid: u32) -> Plan {
        Plan {
            root: c(root),
            dirs: Vec::new(),
            files: Vec::new(),
            links: Vec::new(),
            binds: Vec::new(),
            uid,
            groups: Vec::new(),
            cgroup_procs: Vec::new(),
            fds: Vec::new(),
            keep: false,
        }
    }

    /// A VMM that outlives the process that starts it (a server's restart): no parent-death
    /// signal, and a session of its own, so that a terminal's Ctrl-C meant for its maker does
    /// not reach it. Its end is then its cgroup's kill.
    pub fn keep(&mut self, keep: bool) {
        self.keep = keep;
    }

    fn inside(&self, p: &Path) -> PathBuf {
        Path::new(std::ffi::OsStr::from_bytes(self.root.as_bytes())).join(p.strip_prefix("/").unwrap_or(p))
    }

    fn mkdirs(&mut self, inner: &Path) {
        let mut acc = PathBuf::from("/");
        for comp in inner.components().skip(1) {
            acc.push(comp);
            let d = c(&self.inside(&acc));
            if !self.dirs.contains(&d) {
                self.dirs.push(d);
            }
        }
    }

    /// Makes host path `src` visible at `dst` in the jail (read-only unless `writable`).
    pub fn bind(&mut self, src: &Path, dst: &Path, writable: bool) {
        if src.is_dir() {
            self.mkdirs(dst);
        } else {
            if let Some(parent) = dst.parent() {
                self.mkdirs(parent);
            }
            self.files.push(c(&self.inside(dst)));
        }
        self.binds.push(Bind { src: c(src), dst: c(&self.inside(dst)), writable });
    }

    /// What a dynamically linked binary needs: /usr read-only, and /lib, /lib64, /bin as the
    /// host has them (symlinks into /usr on merged-/usr systems, else read-only binds).
    pub fn system_dirs(&mut self) {
        self.bind(Path::new("/usr"), Path::new("/usr"), false);
        for d in ["/lib", "/lib64", "/lib32", "/bin", "/sbin"] {
            let p = Path::new(d);
            match std::fs::read_link(p) {
                Ok(target) => self.links.push((c(&target), c(&self.inside(p)))),
                Err(_) if p.is_dir() => self.bind(p, p, false),
                Err(_) => {}
            }
        }
        if Path::new("/etc/ld.so.cache").is_file() {
            self.bind(Path::new("/etc/ld.so.cache"), Path::new("/etc/ld.so.cache"), false);
        }
    }

    pub fn group(&mut self, gid: libc::gid_t) {
        self.groups.push(gid);
    }

    /// The process writes itself into these `cgroup.procs` files (opened now) first.
    pub fn cgroups(&mut self, procs: &[PathBuf]) -> io::Result<Vec<std::fs::File>> {
        let mut files = Vec::new();
        for p in procs {
            let f = std::fs::OpenOptions::new().write(true).open(p)?;
            self.cgroup_procs.push(std::os::fd::AsRawFd::as_raw_fd(&f));
            files.push(f);
        }
        Ok(files)
    }

    /// Passes descriptor `fd` to the VMM as number `target`.
    pub fn pass_fd(&mut self, fd: RawFd, target: RawFd) {
        self.fds.push((fd, target));
    }

    /// Installs the jail on `cmd`: it runs in the child after fork, before exec.
    pub fn apply(self, cmd: &mut std::process::Command) {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure only makes system calls on data prepared before the fork (no
        // allocation, no locks), which is what is safe between fork and exec.
        unsafe {
            cmd.pre_exec(move || self.enter());
        }
    }

    fn enter(&self) -> io::Result<()> {
        let err = io::Error::last_os_error;
        let ok = |r: libc::c_int| if r < 0 { Err(err()) } else { Ok(()) };
        // SAFETY: (whole block) plain system calls on valid NUL-terminated strings and open
        // descriptors owned by this (child) process.
        unsafe {
            for &fd in &self.cgroup_procs {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(err());
                }
            }
            ok(libc::unshare(
                libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWCGROUP,
            ))?;
            let null = std::ptr::null::<libc::c_char>();
            ok(libc::mount(null, c"/".as_ptr(), null, libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()))?;
            ok(libc::mount(
                c"tmpfs".as_ptr(),
                self.root.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID,
                c"size=64k,mode=0755".as_ptr().cast(),
            ))?;
            for d in &self.dirs {
                if libc::mkdir(d.as_ptr(), 0o755) < 0 && *libc::__errno_location() != libc::EEXIST {
                    return Err(err());
                }
            }
            for f in &self.files {
                let fd = libc::open(f.as_ptr(), libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC, 0o644);
                if fd < 0 {
                    return Err(err());
                }
                libc::close(fd);
            }
            for (target, link) in &self.links {
                ok(libc::symlink(target.as_ptr(), link.as_ptr()))?;
            }
            for b in &self.binds {
                ok(libc::mount(b.src.as_ptr(), b.dst.as_ptr(), null, libc::MS_BIND | libc::MS_REC, std::ptr::null()))?;
                let mut flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID;
                if !b.writable {
                    flags |= libc::MS_RDONLY;
                }
                ok(libc::mount(null, b.dst.as_ptr(), null, flags, std::ptr::null()))?;
            }
            ok(libc::chdir(self.root.as_ptr()))?;
            ok(libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int)?;
            ok(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            ok(libc::chdir(c"/".as_ptr()))?;
            ok(libc::mount(null, c"/".as_ptr(), null, libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID, std::ptr::null()))?;
            for &(fd, target) in &self.fds {
                if fd == target {
                    ok(libc::fcntl(fd, libc::F_SETFD, 0))?;
                } else {
                    // dup2 clears close-on-exec on the new number.
                    ok(libc::dup2(fd, target))?;
                }
            }
            ok(libc::setgroups(self.groups.len(), self.groups.as_ptr()))?;
            ok(libc::setresgid(self.uid, self.uid, self.uid))?;
            ok(libc::setresuid(self.uid, self.uid, self.uid))?;
            ok(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
            if self.keep {
                ok(libc::setsid())?;
            } else {
                // After the uid change, which would clear it: the VMM dies with the thread that
                // owns the VM, so a crash of cordon never leaves a VM running.
                ok(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0))?;
            }
        }
        Ok(())
    }
}

use std::os::unix::ffi::OsStrExt;

/// Starts `cmd` as PID 1 of a new PID namespace, from the calling thread (whose death the
/// jail's parent-death signal then follows). Only this thread's children are affected, and
/// only for this one start: the thread returns to its own namespace for children right after,
/// because the kernel refuses to create threads while the two differ.
pub fn spawn_in_new_pid_namespace(cmd: &mut std::process::Command) -> io::Result<std::process::Child> {
    use std::os::fd::AsRawFd;
    let own = std::fs::File::open("/proc/thread-self/ns/pid")?;
    // SAFETY: unshare with a flag only; it changes where this thread's children are created.
    if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
        return Err(io::Error::other(format!("a PID namespace for the VMM: {}", io::Error::last_os_error())));
    }
    let child = cmd.spawn();
    // SAFETY: setns on an open namespace descriptor; back to the namespace this thread is in.
    if unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWPID) } != 0 {
        let e = io::Error::last_os_error();
        if let Ok(mut c) = child {
            let _ = c.kill();
            let _ = c.wait();
        }
        return Err(io::Error::other(format!("return from the VMM's PID namespace: {e}")));
    }
    child
}
