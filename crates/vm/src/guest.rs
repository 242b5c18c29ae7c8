//! The guest init: PID 1 of the VM, run from the initramfs as `/init` (the cordon binary).
//!
//! In a fixed order: mount /dev, /proc, /sys; load the kit's modules (finit_module, dependency
//! order, parameters from the kernel command line as modprobe would pass them); find the two
//! disks and the agent port by the names the host gave them; overlay the writable disk on the
//! read-only image disk; read the sandbox's config from the port; move into the new root;
//! set the hostname; then serve the envd agent on the port, multiplexed by `cordon-channel`.
//! Anything failing is printed on the console (the host shows it) and the VM powers off.

use crate::link_handshake;
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Serial numbers of the disks and the name of the agent port (the host sets them).
pub const ROOT_SERIAL: &str = "cordon-root";
pub const RW_SERIAL: &str = "cordon-rw";
pub const PORT_NAME: &str = "cordon.agent";
/// With `cordon.probe=1` on the command line the init only says it is up and powers off: the
/// KVM boot probe and the boot-time anchor of the bench.
pub const PROBE_ARG: &str = "cordon.probe=1";
pub const PROBE_OK: &str = "cordon-init: up";
/// With `cordon.debug` on the command line the init prints when each step is done (seconds
/// since the guest kernel started) on the console.
pub const DEBUG_ARG: &str = "cordon.debug";

static DEBUG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn step(name: &str) {
    if DEBUG.load(std::sync::atomic::Ordering::Relaxed) {
        let up = fs::read_to_string("/proc/uptime").unwrap_or_default();
        eprintln!("cordon-init: {name} at {}s", up.split_whitespace().next().unwrap_or("?"));
    }
}

/// Whether this process is the guest init: PID 1, started as `/init`.
pub fn is_guest_init() -> bool {
    std::process::id() == 1 && std::env::args_os().next().is_some_and(|a| a == "/init")
}

pub fn main() -> ! {
    if let Err(e) = init() {
        eprintln!("cordon-init: {e}");
    }
    power_off()
}

fn power_off() -> ! {
    // SAFETY: sync and reboot take no pointers. PID 1 may not exit (that would panic the
    // kernel); powering off ends the VMM process instead.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn errno(what: impl std::fmt::Display) -> String {
    format!("{what}: {}", io::Error::last_os_error())
}

fn cstr(s: &str) -> CString {
    CString::new(s).expect("no NUL in paths")
}

fn mount(src: &str, target: &str, fstype: &str, flags: libc::c_ulong, data: &str) -> Result<(), String> {
    let (s, t, f, d) = (cstr(src), cstr(target), cstr(fstype), cstr(data));
    tracing::debug!(src, target, fstype, data, "mount");
    // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
    let r = unsafe { libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), flags, d.as_ptr().cast()) };
    if r != 0 {
        return Err(errno(format!("mount {fstype} {src} on {target}")));
    }
    Ok(())
}

fn init() -> Result<(), String> {
    let t0 = Instant::now();
    mount("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755")?;
    mount("proc", "/proc", "proc", libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC, "")?;
    mount("sysfs", "/sys", "sysfs", libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC, "")?;
    let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
    if cmdline.split_whitespace().any(|a| a == PROBE_ARG) {
        println!("{PROBE_OK}");
        return Ok(());
    }
    DEBUG.store(cmdline.split_whitespace().any(|a| a == DEBUG_ARG), std::sync::atomic::Ordering::Relaxed);
    step("init started");
    load_modules(&cmdline)?;
    step("modules loaded");

    let deadline = Instant::now() + Duration::from_secs(30);
    let root_dev = wait_for(deadline, || disk_by_serial(ROOT_SERIAL), "the image disk")?;
    let rw_dev = wait_for(deadline, || disk_by_serial(RW_SERIAL), "the writable disk")?;
    let port = wait_for(deadline, || port_by_name(PORT_NAME), "the agent port")?;

    for d in ["/mnt/lower", "/mnt/rw", "/mnt/root"] {
        fs::create_dir_all(d).map_err(|e| format!("create {d}: {e}"))?;
    }
    mount(&root_dev, "/mnt/lower", "ext4", libc::MS_RDONLY | libc::MS_NODEV, "")?;
    mount(&rw_dev, "/mnt/rw", "ext4", libc::MS_NODEV, "discard")?;
    for d in ["/mnt/rw/upper", "/mnt/rw/work"] {
        fs::create_dir_all(d).map_err(|e| format!("create {d}: {e}"))?;
    }
    mount("overlay", "/mnt/root", "overlay", 0, "lowerdir=/mnt/lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work")?;

    step("root mounted");
    let link = open_port(&port)?;
    let (cfg, now) = link_handshake::receive(&link).map_err(|e| format!("read the sandbox config from {port}: {e}"))?;
    // The guest has no clock of its own (no RTC), and a restored one holds its snapshot's.
    set_clock(now)?;
    reseed(&cfg.seed)?;
    step("config, clock and seed received");

    // Into the new root: the initramfs (rootfs) cannot be pivoted away, so move the new root
    // over it and chroot, as switch_root does. /dev, /proc and /sys move along.
    for (from, to) in [("/dev", "/mnt/root/dev"), ("/proc", "/mnt/root/proc"), ("/sys", "/mnt/root/sys")] {
        fs::create_dir_all(to).map_err(|e| format!("create {to}: {e}"))?;
        mount(from, to, "", libc::MS_MOVE, "")?;
    }
    std::env::set_current_dir("/mnt/root").map_err(|e| format!("chdir /mnt/root: {e}"))?;
    mount(".", "/", "", libc::MS_MOVE, "")?;
    let dot = cstr(".");
    // SAFETY: valid NUL-terminated path.
    if unsafe { libc::chroot(dot.as_ptr()) } != 0 {
        return Err(errno("chroot"));
    }
    std::env::set_current_dir("/").map_err(|e| format!("chdir /: {e}"))?;
    for d in ["/dev/pts", "/dev/shm", "/run", "/tmp"] {
        let _ = fs::create_dir_all(d);
    }
    mount("devpts", "/dev/pts", "devpts", libc::MS_NOSUID | libc::MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5")?;
    mount("shm", "/dev/shm", "tmpfs", libc::MS_NOSUID | libc::MS_NODEV, "mode=1777")?;
    mount("run", "/run", "tmpfs", libc::MS_NOSUID | libc::MS_NODEV, "mode=0755")?;
    let _ = fs::remove_file("/dev/ptmx");
    let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    // SAFETY: chmod of a fixed path; /tmp on the overlay must be world-writable and sticky.
    unsafe { libc::chmod(c"/tmp".as_ptr(), 0o1777) };

    mount_volumes(&cfg.volumes)?;

    // Loopback must work with or without a network: servers inside are reached through it
    // (the agent's port forwarding connects to 127.0.0.1).
    cordon_host::sys::loopback_up().map_err(|e| format!("bring up lo: {e}"))?;
    if let Some(net) = &cfg.network {
        network_up(net)?;
    }
    set_hostname(&cfg.hostname)?;
    // The agent is the guest's PID 1 from here on, which the guest's OOM killer never picks; an
    // oom_score_adj here would be inherited by every command and shield them instead.
    tracing::debug!(elapsed = ?t0.elapsed(), "guest init ready");
    step("serving the agent");

    // As on the other tiers, nothing of the guest may open the agent's memory through /proc
    // without CAP_SYS_PTRACE (which guest root does hold: the guest kernel is the boundary).
    cordon_agent::make_undumpable().map_err(|e| format!("make the agent non-dumpable: {e}"))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| format!("runtime: {e}"))?;
    rt.block_on(async move {
        let agent = cordon_agent::LinkAgent::start(cfg.agent)?;
        let mut hostname = cfg.hostname;
        loop {
            let session = cordon_channel::FdLink::duplex(link.try_clone()?)?;
            if agent.serve(session).await? == cordon_agent::LinkEnd::Closed {
                return Ok(());
            }
            // Parked: the VM may be saved now and restored later, or several times over (a
            // fork). Each wake brings the time and a seed, and a fork's hostname.
            let port = link.try_clone()?;
            let (woken, now) = tokio::task::spawn_blocking(move || link_handshake::park(&port)).await.map_err(std::io::Error::other)??;
            set_clock(now).map_err(std::io::Error::other)?;
            reseed(&woken.seed).map_err(std::io::Error::other)?;
            if woken.hostname != hostname {
                set_hostname(&woken.hostname).map_err(std::io::Error::other)?;
                hostname = woken.hostname;
            }
            // A fork gets a MAC of its own on the interface it inherited.
            if let Some(net) = &woken.network {
                cordon_host::tun::set_mac(net.mac).map_err(std::io::Error::other)?;
            }
        }
    })
    .map_err(|e: std::io::Error| format!("agent: {e}"))
}

/// The host's virtio-fs shares at their paths. The shares' devices probe while the modules
/// load, so each is given a few seconds to appear.
fn mount_volumes(volumes: &[link_handshake::GuestVolume]) -> Result<(), String> {
    for v in volumes {
        fs::create_dir_all(&v.target).map_err(|e| format!("create the volume path {}: {e}", v.target))?;
        let flags = libc::MS_NOSUID | libc::MS_NODEV | if v.read_only { libc::MS_RDONLY } else { 0 };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match mount(&v.tag, &v.target, "virtiofs", flags, "") {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("volume {} not ready yet: {e}", v.tag);
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(e),
            }
        }
    }
    if !volumes.is_empty() {
        step("volumes mounted");
    }
    Ok(())
}

/// The interface, addressed and routed as on every tier, and the gateway as resolver. Its
/// driver probed while the modules loaded; a restored guest has had it since its snapshot.
fn network_up(net: &link_handshake::GuestNetwork) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    wait_for(deadline, || Path::new("/sys/class/net/eth0").exists().then(String::new), "the network interface")?;
    cordon_host::tun::address(Some(net.mac)).map_err(|e| format!("set up eth0: {e}"))?;
    // The image's resolver (or a link to one) is replaced in the writable layer, as the other
    // tiers do.
    let _ = fs::remove_file("/etc/resolv.conf");
    fs::write("/etc/resolv.conf", cordon_host::tun::resolv_conf()).map_err(|e| format!("write /etc/resolv.conf: {e}"))?;
    if let Some(ca) = &net.egress_ca {
        use cordon_host::trust::{bundle, BUNDLE, CA_FILE};
        let image = fs::read(BUNDLE).ok();
        for (path, data) in [(BUNDLE, bundle(image.as_deref(), ca)), (CA_FILE, ca.as_bytes().to_vec())] {
            if let Some(dir) = Path::new(path).parent() {
                fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
            }
            let _ = fs::remove_file(path);
            fs::write(path, data).map_err(|e| format!("write {path}: {e}"))?;
        }
    }
    step("network up");
    Ok(())
}

fn set_hostname(name: &str) -> Result<(), String> {
    let host = name.as_bytes();
    // SAFETY: pointer and length of a live byte slice.
    if unsafe { libc::sethostname(host.as_ptr().cast(), host.len()) } != 0 {
        return Err(errno("sethostname"));
    }
    // As in the other tiers, the hostname resolves (sudo and many tools look it up); the write
    // lands in the writable layer. Images without the file are left alone.
    if let Ok(mut f) = fs::OpenOptions::new().append(true).open("/etc/hosts") {
        use std::io::Write;
        let _ = writeln!(f, "127.0.1.1\t{name}");
    }
    Ok(())
}

fn set_clock(now: std::time::SystemTime) -> Result<(), String> {
    let d = now.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let ts = libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos() as libc::c_long };
    // SAFETY: a valid timespec for the duration of the call.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(errno("set the clock"));
    }
    Ok(())
}

/// `_IOW('R', 0x03, int[2])` and `_IO('R', 0x07)` from <linux/random.h>.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// Mixes the host's seed into the kernel's entropy pool, credited, and makes the kernel reseed
/// its generator from the pool at once: after a restore every VM of a snapshot would otherwise
/// draw from the same generator state until its next scheduled reseed.
fn reseed(seed: &[u8]) -> Result<(), String> {
    if seed.is_empty() {
        return Ok(());
    }
    let f = fs::OpenOptions::new().write(true).open("/dev/urandom").map_err(|e| format!("open /dev/urandom: {e}"))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + seed.len());
    info.extend_from_slice(&((seed.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(seed.len() as i32).to_ne_bytes());
    info.extend_from_slice(seed);
    // SAFETY: `info` is a rand_pool_info whose buf_size matches the bytes that follow it.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) } != 0 {
        return Err(errno("add the host's seed to the entropy pool"));
    }
    // SAFETY: an ioctl without argument on an open descriptor.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG) } != 0 {
        return Err(errno("reseed the kernel RNG"));
    }
    Ok(())
}

/// Loads the kit's modules in the order the host computed. Parameters for a module on the
/// kernel command line (`name.param=value`) are the kernel's to apply only for built-in code;
/// for modules, modprobe passes them, so this does too.
fn load_modules(cmdline: &str) -> Result<(), String> {
    let order = fs::read_to_string("/lib/modules/order").unwrap_or_default();
    // Without a PCI bus (microvm boots with `pci=off`) the PCI transport has nothing to drive;
    // the kit carries it for VMMs that use it.
    let no_pci = cmdline.split_whitespace().any(|a| a == "pci=off");
    for name in order.lines().filter(|l| !l.is_empty() && (!no_pci || !l.starts_with("virtio_pci"))) {
        let path = format!("/lib/modules/{name}.ko");
        let params: Vec<&str> = cmdline
            .split_whitespace()
            .filter_map(|a| a.split_once('.').filter(|(m, _)| m.replace('-', "_") == *name).map(|(_, p)| p))
            .collect();
        let params = cstr(&params.join(" "));
        let f = fs::File::open(&path).map_err(|e| format!("open {path}: {e}"))?;
        // SAFETY: finit_module with an open module file and a NUL-terminated parameter string.
        let r = unsafe { libc::syscall(libc::SYS_finit_module, f.as_raw_fd(), params.as_ptr(), 0) };
        if r != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
            return Err(errno(format!("load module {name}")));
        }
        tracing::debug!(name, "module loaded");
        // The initramfs lives in RAM: give the module's copy back.
        drop(f);
        let _ = fs::remove_file(&path);
    }
    Ok(())
}

fn wait_for(deadline: Instant, mut find: impl FnMut() -> Option<String>, what: &str) -> Result<String, String> {
    loop {
        if let Some(v) = find() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(format!("{what} did not appear within 30 s (is the VMM giving the guest its devices?)"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn disk_by_serial(serial: &str) -> Option<String> {
    for e in fs::read_dir("/sys/block").ok()?.flatten() {
        let s = fs::read_to_string(e.path().join("serial")).unwrap_or_default();
        if s.trim() == serial {
            return Some(format!("/dev/{}", e.file_name().to_string_lossy()));
        }
    }
    None
}

fn port_by_name(name: &str) -> Option<String> {
    for e in fs::read_dir("/sys/class/virtio-ports").ok()?.flatten() {
        let s = fs::read_to_string(e.path().join("name")).unwrap_or_default();
        if s.trim() == name {
            let dev = PathBuf::from("/dev").join(e.file_name());
            return Path::new(&dev).exists().then(|| dev.to_string_lossy().into_owned());
        }
    }
    None
}

fn open_port(path: &str) -> Result<OwnedFd, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("open {path}: {e}"))?;
    Ok(f.into())
}
