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
use std::os::unix::fs::{symlink, DirBuilderExt, PermissionsExt};
use std::path::Path;

/// What the new root is made of.
pub struct RootPlan<'a> {
    /// Host directory used as the mount point of the staging tmpfs (empty on the host side).
    pub staging: &'a Path,
    /// Detached, idmapped, read-only clone of the image tree.
    pub image: OwnedFd,
    /// Size of the one tmpfs that holds the writable layer, `/tmp` and `/dev/shm` together.
    pub disk_bytes: u64,
    pub hostname: &'a str,
    /// Point the sandbox's resolver at the egress gateway (it has a TUN interface).
    pub nameservers: bool,
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

/// Builds the root and pivots into it. Runs as root of the sandbox's user namespace.
pub fn enter(plan: RootPlan<'_>) -> io::Result<()> {
    sys::make_private_recursive("/")?;

    let st = plan.staging;
    let disk = plan.disk_bytes;
    // One size-capped tmpfs, private to this mount namespace, holds everything the sandbox can
    // write: the overlay's upper and work dirs, `/tmp` and `/dev/shm` (bound from subdirectories
    // of it), so `--disk` is one budget for all three, as the flag says. It holds no host disk,
    // reaches ENOSPC at the cap, and disappears with the namespace even if no teardown code ever
    // runs.
    sys::mount("cordon-rw", st, "tmpfs", libc::MS_NOATIME, Some(&format!("size={disk},mode=0755")))?;
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
    sys::move_mount_to(&plan.image, &lower)?;
    drop(plan.image);
    // Relative layer paths (resolved against the staging dir) keep host paths out of the
    // sandbox's /proc/mounts.
    sys::chdir(st)?;
    sys::mount(
        "cordon-root",
        Path::new("root"),
        "overlay",
        libc::MS_NOATIME,
        Some("lowerdir=lower,upperdir=upper,workdir=work,userxattr"),
    )?;

    sys::chdir(&root)?;
    let here = Path::new(".");
    for d in ["proc", "dev", "sys", "tmp"] {
        mkdir(&here.join(d), 0o755)?;
    }
    let nosuid_nodev_noexec = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    sys::mount("proc", Path::new("proc"), "proc", nosuid_nodev_noexec, None)?;
    zero_nested_namespace_counts()?;
    mask_proc()?;
    crate::procview::bind_over_proc(&st.join(PROC_VIEW))?;

    sys::mount("cordon-dev", Path::new("dev"), "tmpfs", libc::MS_NOSUID | libc::MS_NOEXEC, Some("mode=0755,size=64k,nr_inodes=64"))?;
    for dev in DEVICES {
        let target = Path::new("dev").join(dev);
        fs::File::create(&target).map_err(|e| io::Error::new(e.kind(), format!("create {}: {e}", target.display())))?;
        sys::bind(&Path::new("/dev").join(dev), &target)?;
    }
    mkdir(Path::new("dev/pts"), 0o755)?;
    sys::mount(
        "devpts",
        Path::new("dev/pts"),
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(&format!("newinstance,ptmxmode=0666,mode=0620,max={PTYS_MAX}")),
    )?;
    mkdir(Path::new("dev/shm"), 0o1777)?;
    sys::bind_with(&st.join(SHARED_SHM), Path::new("dev/shm"), nosuid_nodev_noexec)?;
    for (link, target) in [
        ("dev/ptmx", "pts/ptmx"),
        ("dev/fd", "/proc/self/fd"),
        ("dev/stdin", "/proc/self/fd/0"),
        ("dev/stdout", "/proc/self/fd/1"),
        ("dev/stderr", "/proc/self/fd/2"),
    ] {
        symlink(target, link).map_err(|e| io::Error::new(e.kind(), format!("symlink {link}: {e}")))?;
    }
    sys::bind_with(&st.join(SHARED_TMP), Path::new("tmp"), libc::MS_NOSUID | libc::MS_NODEV)?;

    sys::sethostname(plan.hostname)?;
    sys::pivot_to_cwd()?;
    name_host(plan.hostname);
    if plan.nameservers {
        point_resolver_at_gateway()?;
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

fn zero_nested_namespace_counts() -> io::Result<()> {
    for name in ZERO_IN_USER_NS {
        let p = Path::new("proc/sys/user").join(name);
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
/// Host-wide knobs that stay readable but not writable.
const READ_ONLY: [&str; 5] = ["bus", "fs", "irq", "sys", "sysrq-trigger"];

/// Masks the parts of the fresh /proc (relative to the new root's directory) that describe or
/// control the host rather than the sandbox.
fn mask_proc() -> io::Result<()> {
    let proc = Path::new("proc");
    for f in MASKED_FILES {
        let p = proc.join(f);
        if p.exists() {
            sys::bind(Path::new("/dev/null"), &p)?;
        }
    }
    for d in MASKED_DIRS {
        let p = proc.join(d);
        if p.is_dir() {
            sys::mount("cordon-masked", &p, "tmpfs", libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC, Some("size=0,mode=0555"))?;
        }
    }
    for r in READ_ONLY {
        let p = proc.join(r);
        if p.exists() {
            sys::bind(&p, &p)?;
            sys::mount(
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
fn name_host(hostname: &str) {
    use std::io::Write;
    if let Ok(mut f) = fs::OpenOptions::new().append(true).open("/etc/hosts") {
        let _ = writeln!(f, "127.0.1.1\t{hostname}");
    }
}

/// Replaces the image's /etc/resolv.conf (in the writable layer) with the gateway, where the
/// forwarder answers. A symlink (systemd-resolved images) is replaced, not followed.
fn point_resolver_at_gateway() -> io::Result<()> {
    let path = Path::new("/etc/resolv.conf");
    let _ = fs::remove_file(path);
    fs::write(path, crate::tun::resolv_conf()).map_err(|e| io::Error::new(e.kind(), format!("write /etc/resolv.conf: {e}")))
}
