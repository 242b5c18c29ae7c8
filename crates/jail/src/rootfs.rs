//! The sandbox's root filesystem, assembled inside its own mount namespace.
//!
//! Order matters and follows what nsjail and bwrap do: make every inherited mount private (so
//! nothing propagates back to the host), build the new root on a staging tmpfs, mount the
//! kernel filesystems inside it, then `pivot_root` and detach the whole host tree. After that the
//! sandbox has no path to any host file.

use crate::sys;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{symlink, DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// What the new root is made of.
pub struct RootPlan<'a> {
    /// Host directory used as the mount point of the staging tmpfs (empty on the host side).
    pub staging: &'a Path,
    /// `staging` is already the writable layer's tmpfs (mounted by the host, sized and owned
    /// for this sandbox, kept after it): nothing to mount there.
    pub premounted: bool,
    /// Detached, idmapped, read-only clones of the image's layer trees, bottom first.
    pub image: Vec<OwnedFd>,
    /// Detached, idmapped trees of the volumes and the paths inside where they go.
    pub volumes: Vec<(OwnedFd, String)>,
    /// Size of the one tmpfs that holds the writable layer, `/tmp` and `/dev/shm` together.
    pub disk_bytes: u64,
    pub hostname: &'a str,
    /// Point the sandbox's resolver at the egress gateway (it has a TUN interface).
    pub nameservers: bool,
    /// The host's egress CA, to add to the image's trust.
    pub egress_ca: Option<&'a str>,
}

/// PTYs one sandbox may hold at once. PTYs of every devpts instance but the host's come from one
/// host-wide count (`kernel.pty.max` less `kernel.pty.reserve`, 3072 by default), so each
/// sandbox's instance has its own maximum: enough terminals for any session, far from the pool.
const PTYS_MAX: u32 = 64;
/// Subdirectories of the writable layer's tmpfs bound at `/tmp` and `/dev/shm`.
const SHARED_TMP: &str = "tmp";
const SHARED_SHM: &str = "shm";
/// Subdirectory of the writable layer's tmpfs holding the synthesized /proc files.
const PROC_VIEW: &str = "proc";

/// Device nodes bound in from the host's `/dev`: the harmless set every container runtime
/// provides. A user namespace cannot mknod, and these carry no host state.
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

fn mkdir(p: &Path, mode: u32) -> io::Result<()> {
    match fs::DirBuilder::new().mode(mode).create(p) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            Err(io::Error::new(e.kind(), format!("mkdir {}: {e}", p.display())))
        }
        _ => Ok(()),
    }
}

/// The mount-namespace calls rootfs assembly makes: the kernel's in the jailer ([`Kernel`]), a
/// recorder in the unit tests (as youki's `Syscall` trait), so the order and arguments of every
/// mount are checked without root.
pub trait MountOps {
    fn make_private_recursive(&self, target: &str) -> io::Result<()>;
    fn mount(&self, src: &str, target: &Path, fstype: &str, flags: libc::c_ulong, data: Option<&str>) -> io::Result<()>;
    fn bind(&self, src: &Path, target: &Path) -> io::Result<()>;
    /// A bind, then a remount of it with `flags`.
    fn bind_with(&self, src: &Path, target: &Path, flags: libc::c_ulong) -> io::Result<()>;
    fn move_mount_to(&self, tree: &OwnedFd, target: &Path) -> io::Result<()>;
    /// Attaches a volume's tree at `target` below `root`, making the missing directories.
    fn attach_volume(&self, tree: &OwnedFd, root: &Path, target: &str) -> io::Result<()>;
    fn chdir(&self, dir: &Path) -> io::Result<()>;
    fn sethostname(&self, name: &str) -> io::Result<()>;
    /// `pivot_root` into the working directory and detach the old root.
    fn pivot_to_cwd(&self) -> io::Result<()>;
    /// Where the tree staged at `staged` is seen once pivoted into: `/` for the kernel.
    fn root_after_pivot(&self, staged: &Path) -> PathBuf;
}

/// The real calls, in the jailer's fresh mount namespace.
pub struct Kernel;

impl MountOps for Kernel {
    fn make_private_recursive(&self, target: &str) -> io::Result<()> {
        sys::make_private_recursive(target)
    }
    fn mount(&self, src: &str, target: &Path, fstype: &str, flags: libc::c_ulong, data: Option<&str>) -> io::Result<()> {
        sys::mount(src, target, fstype, flags, data)
    }
    fn bind(&self, src: &Path, target: &Path) -> io::Result<()> {
        sys::bind(src, target)
    }
    fn bind_with(&self, src: &Path, target: &Path, flags: libc::c_ulong) -> io::Result<()> {
        sys::bind_with(src, target, flags)
    }
    fn move_mount_to(&self, tree: &OwnedFd, target: &Path) -> io::Result<()> {
        sys::move_mount_to(tree, target)
    }
    fn attach_volume(&self, tree: &OwnedFd, root: &Path, target: &str) -> io::Result<()> {
        sys::move_mount_to_fd(tree, &dir_beneath(root, target)?)
    }
    fn chdir(&self, dir: &Path) -> io::Result<()> {
        sys::chdir(dir)
    }
    fn sethostname(&self, name: &str) -> io::Result<()> {
        sys::sethostname(name)
    }
    fn pivot_to_cwd(&self) -> io::Result<()> {
        sys::pivot_to_cwd()
    }
    fn root_after_pivot(&self, _staged: &Path) -> PathBuf {
        PathBuf::from("/")
    }
}

const NOSUID_NODEV_NOEXEC: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

/// Builds the root and pivots into it. Runs as root of the sandbox's user namespace.
pub fn enter(plan: RootPlan<'_>, ops: &dyn MountOps) -> io::Result<()> {
    ops.make_private_recursive("/")?;
    let st = plan.staging;
    let root = stage_layers(ops, st, plan.image, plan.disk_bytes, plan.premounted)?;
    mount_proc(ops, st, &root)?;
    mount_dev(ops, st, &root)?;
    ops.bind_with(&st.join(SHARED_TMP), &root.join("tmp"), libc::MS_NOSUID | libc::MS_NODEV)?;

    ops.sethostname(plan.hostname)?;
    // The overlay root is the working directory (see `stage_layers`).
    ops.pivot_to_cwd()?;
    // Only now, with no path left to a host file, are the image's files written: an image's
    // /etc/hosts may be a symlink to anywhere.
    let root = ops.root_after_pivot(&root);
    // Volumes go on after the pivot too: their paths are the image's (or, for a fork or a
    // resume, a sandbox's own files), so no component of them may resolve to the host.
    for (tree, target) in &plan.volumes {
        ops.attach_volume(tree, &root, target)?;
    }
    name_host(&root, plan.hostname);
    if plan.nameservers {
        point_resolver_at_gateway(&root)?;
    }
    if let Some(ca) = plan.egress_ca {
        trust_egress_ca(&root, ca)?;
    }
    Ok(())
}

/// The directory `target` below `root`, made where missing (root-owned, 0755) and opened one
/// component at a time without following a symlink: a path the sandbox's files could have
/// turned into a link (a fork's, a resume's) fails instead of moving the volume elsewhere.
fn dir_beneath(root: &Path, target: &str) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let how = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    let mut cur: OwnedFd = rustix::fs::open(root, flags, Mode::empty())?;
    for name in target.split('/').filter(|c| !c.is_empty()) {
        match rustix::fs::mkdirat(&cur, name, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(io::Error::new(io::Error::from(e).kind(), format!("volume path {target}: mkdir {name}: {e}"))),
        }
        cur = rustix::fs::openat2(&cur, name, flags, Mode::empty(), how).map_err(|e| match e {
            rustix::io::Errno::LOOP | rustix::io::Errno::XDEV | rustix::io::Errno::NOTDIR => {
                io::Error::other(format!("volume path {target}: {name} is a symlink or not a directory in the sandbox's files"))
            }
            e => io::Error::new(io::Error::from(e).kind(), format!("volume path {target}: open {name}: {e}")),
        })?;
    }
    Ok(cur)
}

/// Mounts the writable layer's tmpfs on `st`, the image under it and the overlay of both at
/// `st/root`, and makes that the working directory. Returns the overlay's path.
fn stage_layers(ops: &dyn MountOps, st: &Path, image: Vec<OwnedFd>, disk: u64, premounted: bool) -> io::Result<PathBuf> {
    // One size-capped tmpfs, private to this mount namespace, holds everything the sandbox can
    // write: the overlay's upper and work dirs, `/tmp` and `/dev/shm` (bound from subdirectories
    // of it), so `--disk` is one budget for all three, as the flag says. It holds no host disk,
    // reaches ENOSPC at the cap, and disappears with the namespace even if no teardown code ever
    // runs.
    if !premounted {
        ops.mount("cordon-rw", st, "tmpfs", libc::MS_NOATIME, Some(&format!("size={disk},mode=0755")))?;
    }
    let (upper, work, lower, root) = (st.join("upper"), st.join("work"), st.join("lower"), st.join("root"));
    for d in [&upper, &work, &lower, &root] {
        mkdir(d, 0o755)?;
    }
    for d in [st.join(SHARED_TMP), st.join(SHARED_SHM), st.join(PROC_VIEW)] {
        mkdir(&d, 0o755)?;
    }
    // mkdir applies the umask; the sticky, world-writable mode is set explicitly.
    for d in [SHARED_TMP, SHARED_SHM] {
        fs::set_permissions(st.join(d), fs::Permissions::from_mode(0o1777))?;
    }
    crate::procview::write_files(&st.join(PROC_VIEW))?;
    // One layer is mounted at `lower` itself; several at `lower/0` (bottom) .. `lower/N-1`.
    let lowerdir = if image.len() == 1 {
        ops.move_mount_to(&image[0], &lower)?;
        "lower".to_string()
    } else {
        let mut names = Vec::with_capacity(image.len());
        for (i, tree) in image.iter().enumerate() {
            let at = lower.join(i.to_string());
            mkdir(&at, 0o755)?;
            ops.move_mount_to(tree, &at)?;
            names.push(format!("lower/{i}"));
        }
        // overlayfs lists lower layers top first.
        names.reverse();
        names.join(":")
    };
    drop(image);
    // Relative layer paths (resolved against the staging dir) keep host paths out of the
    // sandbox's /proc/mounts.
    ops.chdir(st)?;
    ops.mount("cordon-root", Path::new("root"), "overlay", libc::MS_NOATIME, Some(&format!("lowerdir={lowerdir},upperdir=upper,workdir=work,userxattr")))?;
    ops.chdir(&root)?;
    for d in ["proc", "dev", "sys", "tmp"] {
        mkdir(&root.join(d), 0o755)?;
    }
    Ok(root)
}

/// A fresh /proc with the host's knobs masked and the host-describing files replaced.
fn mount_proc(ops: &dyn MountOps, st: &Path, root: &Path) -> io::Result<()> {
    ops.mount("proc", &root.join("proc"), "proc", NOSUID_NODEV_NOEXEC, None)?;
    zero_nested_namespace_counts(root)?;
    mask_proc(ops, root)?;
    crate::procview::bind_over_proc(ops, &st.join(PROC_VIEW), root)
}

/// A /dev of its own: the harmless devices, a private devpts, /dev/shm on the writable layer.
fn mount_dev(ops: &dyn MountOps, st: &Path, root: &Path) -> io::Result<()> {
    let dev = root.join("dev");
    ops.mount("cordon-dev", &dev, "tmpfs", libc::MS_NOSUID | libc::MS_NOEXEC, Some("mode=0755,size=64k,nr_inodes=64"))?;
    for name in DEVICES {
        let target = dev.join(name);
        fs::File::create(&target).map_err(|e| io::Error::new(e.kind(), format!("create {}: {e}", target.display())))?;
        ops.bind(&Path::new("/dev").join(name), &target)?;
    }
    mkdir(&dev.join("pts"), 0o755)?;
    ops.mount(
        "devpts",
        &dev.join("pts"),
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(&format!("newinstance,ptmxmode=0666,mode=0620,max={PTYS_MAX}")),
    )?;
    mkdir(&dev.join("shm"), 0o1777)?;
    ops.bind_with(&st.join(SHARED_SHM), &dev.join("shm"), NOSUID_NODEV_NOEXEC)?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        symlink(target, dev.join(link)).map_err(|e| io::Error::new(e.kind(), format!("symlink dev/{link}: {e}")))?;
    }
    Ok(())
}

/// Counts of the sandbox's own user namespace (`/proc/sys/user`, which shows the namespace of
/// whoever reads it) set to zero while its root still holds CAP_SYS_RESOURCE there: the filter
/// already denies new namespaces and fanotify, and with these the kernel refuses them as well.
/// What the sandbox's users may hold of the per-user budgets (inotify, message queues) is bounded
/// one level up, by the host's limits for the host uid that created the namespace (see the
/// jailer), and needs no entry here.
const ZERO_IN_USER_NS: [&str; 10] = [
    "max_user_namespaces",
    "max_mnt_namespaces",
    "max_pid_namespaces",
    "max_net_namespaces",
    "max_ipc_namespaces",
    "max_uts_namespaces",
    "max_cgroup_namespaces",
    "max_time_namespaces",
    "max_fanotify_groups",
    "max_fanotify_marks",
];

fn zero_nested_namespace_counts(root: &Path) -> io::Result<()> {
    for name in ZERO_IN_USER_NS {
        let p = root.join("proc/sys/user").join(name);
        // Older kernels lack some of these (time namespaces, fanotify's counts).
        if p.exists() {
            fs::write(&p, "0").map_err(|e| io::Error::new(e.kind(), format!("write 0 to /proc/sys/user/{name}: {e}")))?;
        }
    }
    Ok(())
}

/// Files of /proc that expose host kernel state, hidden behind /dev/null (Docker's list).
/// `config.gz`, `diskstats` and `partitions` describe the host's build and block devices, which
/// nothing in a sandbox has (see `procview`).
const MASKED_FILES: [&str; 9] =
    ["kcore", "keys", "latency_stats", "timer_list", "timer_stats", "sched_debug", "config.gz", "diskstats", "partitions"];
/// Directories of /proc covered by an empty read-only tmpfs. `pressure` holds the host's PSI
/// figures; without them the sandbox looks like a kernel built without PSI.
const MASKED_DIRS: [&str; 4] = ["acpi", "asound", "scsi", "pressure"];
/// The /proc paths a sandbox sees masked (empty) or synthesized instead of the host's, for the
/// isolation report.
pub fn masked_proc() -> Vec<String> {
    let mut v: Vec<String> = MASKED_FILES.iter().chain(MASKED_DIRS.iter()).map(|p| format!("/proc/{p}")).collect();
    v.extend(crate::procview::synthesized().map(|p| format!("/{p}")));
    v.sort();
    v
}

/// Host-wide knobs that stay readable but not writable.
const READ_ONLY: [&str; 5] = ["bus", "fs", "irq", "sys", "sysrq-trigger"];

/// Masks the parts of the fresh /proc (under the new root `root`) that describe or control the
/// host rather than the sandbox.
fn mask_proc(ops: &dyn MountOps, root: &Path) -> io::Result<()> {
    let proc = root.join("proc");
    for f in MASKED_FILES {
        let p = proc.join(f);
        if p.exists() {
            ops.bind(Path::new("/dev/null"), &p)?;
        }
    }
    for d in MASKED_DIRS {
        let p = proc.join(d);
        if p.is_dir() {
            ops.mount("cordon-masked", &p, "tmpfs", libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC, Some("size=0,mode=0555"))?;
        }
    }
    for r in READ_ONLY {
        let p = proc.join(r);
        if p.exists() {
            ops.bind(&p, &p)?;
            ops.mount(
                "",
                &p,
                "",
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                None,
            )?;
        }
    }
    Ok(())
}

/// Makes the sandbox's hostname resolve (sudo and many tools look it up) by adding it to the
/// sandbox's own /etc/hosts, a write that lands in the writable layer. Images without the file
/// are left alone.
fn name_host(root: &Path, hostname: &str) {
    use std::io::Write;
    if let Ok(mut f) = fs::OpenOptions::new().append(true).open(root.join("etc/hosts")) {
        let _ = writeln!(f, "127.0.1.1\t{hostname}");
    }
}

/// Replaces the image's /etc/resolv.conf (in the writable layer) with the gateway, where the
/// forwarder answers. A symlink (systemd-resolved images) is replaced, not followed.
fn point_resolver_at_gateway(root: &Path) -> io::Result<()> {
    let path = root.join("etc/resolv.conf");
    let _ = fs::remove_file(&path);
    fs::write(&path, crate::tun::resolv_conf()).map_err(|e| io::Error::new(e.kind(), format!("write /etc/resolv.conf: {e}")))
}

/// Adds the egress CA to the image's trust, in the writable layer (`cordon_host::trust`).
/// Symlinks are replaced, not followed: what the image's files say never moves a write (this
/// runs as the sandbox's root in its own namespaces, before the sandbox starts, in any case).
fn trust_egress_ca(root: &Path, ca: &str) -> io::Result<()> {
    use cordon_host::trust::{bundle, BUNDLE, CA_FILE};
    let err = |what: &str| {
        let what = what.to_string();
        move |e: io::Error| io::Error::new(e.kind(), format!("{what}: {e}"))
    };
    let open_nofollow = |p: &Path| fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(p);
    for (inside, data) in [(BUNDLE, None), (CA_FILE, Some(ca.as_bytes().to_vec()))] {
        let path = root.join(inside.trim_start_matches('/'));
        let parent = path.parent().expect("an absolute path has a parent");
        for dir in parent.ancestors().take_while(|d| d.starts_with(root) && *d != root) {
            if fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(io::Error::other(format!("{} is a symlink in the image: cannot add the egress CA to its trust", dir.display())));
            }
        }
        fs::create_dir_all(parent).map_err(err(&format!("create {}", parent.display())))?;
        let data = match data {
            Some(d) => d,
            None => {
                let image = open_nofollow(&path).ok().and_then(|mut f| {
                    let mut v = Vec::new();
                    std::io::Read::read_to_end(&mut f, &mut v).ok().map(|_| v)
                });
                bundle(image.as_deref(), ca)
            }
        };
        let _ = fs::remove_file(&path);
        fs::write(&path, data).map_err(err(&format!("write {inside}")))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).map_err(err(&format!("chmod {inside}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Rootfs assembly through a recording [`MountOps`]: every mount's order, target and options,
    //! and every file the assembly writes, checked in a temporary tree without root.

    use super::*;
    use std::cell::RefCell;

    /// Records each call as one line; fails the call whose line starts with `fail_on`.
    #[derive(Default)]
    struct Recorder {
        calls: RefCell<Vec<String>>,
        fail_on: Option<&'static str>,
    }

    impl Recorder {
        fn note(&self, line: String) -> io::Result<()> {
            let fail = self.fail_on.is_some_and(|f| line.starts_with(f));
            self.calls.borrow_mut().push(line);
            if fail {
                Err(io::Error::from_raw_os_error(libc::EPERM))
            } else {
                Ok(())
            }
        }
        fn calls(&self) -> Vec<String> {
            self.calls.borrow().clone()
        }
    }

    impl MountOps for Recorder {
        fn make_private_recursive(&self, target: &str) -> io::Result<()> {
            self.note(format!("private {target}"))
        }
        fn mount(&self, src: &str, target: &Path, fstype: &str, flags: libc::c_ulong, data: Option<&str>) -> io::Result<()> {
            self.note(format!("mount {fstype} {src} {} {flags:#x} {}", target.display(), data.unwrap_or("-")))
        }
        fn bind(&self, src: &Path, target: &Path) -> io::Result<()> {
            self.note(format!("bind {} {}", src.display(), target.display()))
        }
        fn bind_with(&self, src: &Path, target: &Path, flags: libc::c_ulong) -> io::Result<()> {
            self.note(format!("bind_with {} {} {flags:#x}", src.display(), target.display()))
        }
        fn attach_volume(&self, _tree: &OwnedFd, root: &Path, target: &str) -> io::Result<()> {
            self.note(format!("volume {} {target}", root.display()))
        }
        fn move_mount_to(&self, _tree: &OwnedFd, target: &Path) -> io::Result<()> {
            self.note(format!("move_mount {}", target.display()))
        }
        fn chdir(&self, dir: &Path) -> io::Result<()> {
            self.note(format!("chdir {}", dir.display()))
        }
        fn sethostname(&self, name: &str) -> io::Result<()> {
            self.note(format!("sethostname {name}"))
        }
        fn pivot_to_cwd(&self) -> io::Result<()> {
            self.note("pivot".into())
        }
        fn root_after_pivot(&self, staged: &Path) -> PathBuf {
            staged.to_path_buf()
        }
    }

    /// A staging directory whose `root` already holds what the image and a kernel's /proc would
    /// show there (nothing is really mounted).
    fn staging(name: &str) -> PathBuf {
        let st = std::env::temp_dir().join(format!("cordon-rootfs-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&st);
        let root = st.join("root");
        for d in ["proc/pressure", "proc/sys/user", "proc/sys/kernel/random", "etc", "run"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        for f in ["proc/kcore", "proc/cmdline", "proc/sys/kernel/random/boot_id", "proc/sys/user/max_user_namespaces"] {
            fs::write(root.join(f), "host\n").unwrap();
        }
        fs::write(root.join("etc/hosts"), "127.0.0.1\tlocalhost\n").unwrap();
        fs::write(root.join("run/stub-resolv.conf"), "nameserver 127.0.0.53\n").unwrap();
        symlink("../run/stub-resolv.conf", root.join("etc/resolv.conf")).unwrap();
        st
    }

    fn plan<'a>(st: &'a Path, nameservers: bool) -> RootPlan<'a> {
        RootPlan { staging: st, premounted: false, image: vec![fs::File::open(st).unwrap().into()], volumes: Vec::new(), disk_bytes: 1 << 20, hostname: "sb-test", nameservers, egress_ca: None }
    }

    fn position(calls: &[String], prefix: &str) -> usize {
        calls.iter().position(|c| c.starts_with(prefix)).unwrap_or_else(|| panic!("no call `{prefix}…` in {calls:#?}"))
    }

    #[test]
    fn volumes_are_attached_after_the_pivot() {
        let st = staging("volumes");
        let ops = Recorder::default();
        let tree: OwnedFd = fs::File::open(&st).unwrap().into();
        enter(RootPlan { volumes: vec![(tree, "/data/set".into())], ..plan(&st, false) }, &ops).unwrap();
        let calls = ops.calls();
        assert!(position(&calls, "pivot") < position(&calls, "volume "), "{calls:#?}");
        let _ = fs::remove_dir_all(&st);
    }

    #[test]
    fn a_volume_path_through_a_symlink_is_refused_and_makes_nothing_outside() {
        let st = staging("volume-symlink");
        let (root, outside) = (st.join("root"), st.join("outside"));
        fs::create_dir_all(&outside).unwrap();
        symlink(&outside, root.join("data")).unwrap();
        symlink("../../outside", root.join("rel")).unwrap();
        for target in ["/data/x", "/rel/x"] {
            let e = dir_beneath(&root, target).unwrap_err();
            assert!(e.to_string().contains("is a symlink"), "{target}: {e}");
        }
        assert_eq!(fs::read_dir(&outside).unwrap().count(), 0, "a directory was made outside the root");
        dir_beneath(&root, "/home/user/work").unwrap();
        assert!(root.join("home/user/work").is_dir());
        let _ = fs::remove_dir_all(&st);
    }

    #[test]
    fn a_premounted_writable_layer_is_used_as_it_is() {
        let st = staging("premounted");
        let ops = Recorder::default();
        enter(RootPlan { premounted: true, ..plan(&st, false) }, &ops).unwrap();
        let calls = ops.calls();
        assert!(!calls.iter().any(|c| c.starts_with("mount tmpfs cordon-rw")), "{calls:#?}");
        // The overlay's upper directory is on it, where the build reads it afterwards.
        position(&calls, "mount overlay cordon-root root");
        assert!(st.join("upper").is_dir());
        let _ = fs::remove_dir_all(&st);
    }

    #[test]
    fn mounts_come_in_the_order_that_keeps_the_host_out() {
        let st = staging("order");
        let root = st.join("root");
        let ops = Recorder::default();
        enter(plan(&st, true), &ops).unwrap();
        let calls = ops.calls();
        let (s, r) = (st.display(), root.display());

        // Nothing propagates back to the host, and that comes before any mount.
        assert_eq!(calls[0], "private /");
        let steps = [
            format!("mount tmpfs cordon-rw {s} {:#x} size=1048576,mode=0755", libc::MS_NOATIME),
            format!("move_mount {s}/lower"),
            format!("chdir {s}"),
            // Relative layer paths: no host path in the sandbox's /proc/mounts.
            format!("mount overlay cordon-root root {:#x} lowerdir=lower,upperdir=upper,workdir=work,userxattr", libc::MS_NOATIME),
            format!("chdir {r}"),
            format!("mount proc proc {r}/proc"),
            format!("bind /dev/null {r}/proc/kcore"),
            format!("mount tmpfs cordon-masked {r}/proc/pressure"),
            format!("bind {r}/proc/sys {r}/proc/sys"),
            format!("mount   {r}/proc/sys"),
            format!("bind_with {s}/proc/cmdline {r}/proc/cmdline"),
            format!("bind_with {s}/proc/boot_id {r}/proc/sys/kernel/random/boot_id"),
            format!("mount tmpfs cordon-dev {r}/dev"),
            format!("bind /dev/null {r}/dev/null"),
            format!("mount devpts devpts {r}/dev/pts {:#x} newinstance,ptmxmode=0666,mode=0620,max={PTYS_MAX}", libc::MS_NOSUID | libc::MS_NOEXEC),
            format!("bind_with {s}/shm {r}/dev/shm"),
            format!("bind_with {s}/tmp {r}/tmp"),
            "sethostname sb-test".to_string(),
            "pivot".to_string(),
        ];
        let at: Vec<usize> = steps.iter().map(|p| position(&calls, p)).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "steps out of order: {at:?} in {calls:#?}");
        assert_eq!(calls.last().map(String::as_str), Some("pivot"), "nothing may be mounted after the pivot");
        // The pivot is into the overlay: the last directory entered is the new root.
        assert_eq!(calls.iter().rfind(|c| c.starts_with("chdir")), Some(&format!("chdir {r}")));
        // Every mount lands inside the staging tree; only the propagation change touches "/".
        for c in calls.iter().filter(|c| c.starts_with("mount") || c.starts_with("bind")) {
            let target = c.split(' ').nth(if c.starts_with("mount") { 3 } else { 2 }).unwrap();
            assert!(target == "root" || target.starts_with(&*s.to_string()), "mount outside the staging tree: {c}");
        }
        // Read-only remounts of the host's knobs keep nosuid/nodev/noexec.
        let ro = position(&calls, &format!("mount   {r}/proc/sys"));
        let want = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | NOSUID_NODEV_NOEXEC;
        assert!(calls[ro].contains(&format!("{want:#x}")), "{}", calls[ro]);
        let _ = fs::remove_dir_all(&st);
    }

    #[test]
    fn the_writable_layer_and_the_new_root_get_their_files() {
        let st = staging("files");
        let root = st.join("root");
        enter(plan(&st, true), &Recorder::default()).unwrap();

        // /tmp and /dev/shm come from one tmpfs: sticky, world-writable subdirectories of it.
        for d in [SHARED_TMP, SHARED_SHM] {
            let mode = fs::metadata(st.join(d)).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o1777, "{d}");
        }
        // The synthesized /proc files: no host boot arguments, a boot_id of the sandbox's own.
        let cmdline = fs::read_to_string(st.join(PROC_VIEW).join("cmdline")).unwrap();
        assert!(cmdline.starts_with("BOOT_IMAGE=/vmlinuz-") && cmdline.ends_with(" quiet\n"), "{cmdline:?}");
        let boot_id = fs::read_to_string(st.join(PROC_VIEW).join("boot_id")).unwrap();
        assert_eq!(boot_id.trim().len(), 36, "{boot_id:?}");
        // Nested namespaces are refused by the kernel too.
        assert_eq!(fs::read_to_string(root.join("proc/sys/user/max_user_namespaces")).unwrap(), "0");
        // The device placeholders and the links every program expects.
        for dev in DEVICES {
            assert!(root.join("dev").join(dev).is_file(), "{dev}");
        }
        assert_eq!(fs::read_link(root.join("dev/ptmx")).unwrap(), Path::new("pts/ptmx"));
        assert_eq!(fs::read_link(root.join("dev/fd")).unwrap(), Path::new("/proc/self/fd"));
        // The hostname resolves, and the resolver points at the gateway: the image's symlink
        // is replaced, not followed, and what it pointed at is untouched.
        let hosts = fs::read_to_string(root.join("etc/hosts")).unwrap();
        assert!(hosts.ends_with("127.0.1.1\tsb-test\n"), "{hosts:?}");
        let resolv = root.join("etc/resolv.conf");
        assert!(!fs::symlink_metadata(&resolv).unwrap().file_type().is_symlink());
        assert_eq!(fs::read_to_string(&resolv).unwrap(), crate::tun::resolv_conf());
        assert_eq!(fs::read_to_string(root.join("run/stub-resolv.conf")).unwrap(), "nameserver 127.0.0.53\n");
        let _ = fs::remove_dir_all(&st);
    }

    #[test]
    fn without_egress_the_image_resolver_stays() {
        let st = staging("noegress");
        enter(plan(&st, false), &Recorder::default()).unwrap();
        assert!(fs::symlink_metadata(st.join("root/etc/resolv.conf")).unwrap().file_type().is_symlink());
        let _ = fs::remove_dir_all(&st);
    }

    #[test]
    fn a_failed_mount_stops_assembly_before_the_pivot() {
        let st = staging("fail");
        let ops = Recorder { fail_on: Some("mount devpts"), ..Default::default() };
        let err = enter(plan(&st, true), &ops).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
        let calls = ops.calls();
        assert!(calls.last().unwrap().starts_with("mount devpts"), "{calls:#?}");
        assert!(!calls.iter().any(|c| c == "pivot" || c.starts_with("sethostname")), "{calls:#?}");
        // Nothing was written into the image's files before the failure.
        assert_eq!(fs::read_to_string(st.join("root/etc/hosts")).unwrap(), "127.0.0.1\tlocalhost\n");
        let _ = fs::remove_dir_all(&st);
    }
}
