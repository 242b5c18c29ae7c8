//! `cordon doctor`: every kernel feature and tool cordon relies on, checked for real where a
//! cheap probe exists, each with the exact fix when it is missing.

use crate::state::State;
use anyhow::Result;
use std::fs;
use std::path::Path;

#[derive(PartialEq, Eq, Clone, Copy)]
enum Status {
    Ok,
    Warn,
    Missing,
}

struct Check {
    name: &'static str,
    status: Status,
    detail: String,
    fix: Option<String>,
}

fn ok(name: &'static str, detail: impl Into<String>) -> Check {
    Check { name, status: Status::Ok, detail: detail.into(), fix: None }
}

fn missing(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check { name, status: Status::Missing, detail: detail.into(), fix: Some(fix.into()) }
}

fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check { name, status: Status::Warn, detail: detail.into(), fix: Some(fix.into()) }
}

fn read(p: &str) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn which(bin: &str) -> Option<String> {
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    path.split(':').map(|d| Path::new(d).join(bin)).find(|p| p.is_file()).map(|p| p.display().to_string())
}

/// Forks a child that tries `unshare(flags)`; true if it worked.
fn probe_unshare(flags: libc::c_int) -> bool {
    // SAFETY: the child only calls unshare and _exit, both async-signal-safe.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            libc::_exit(if libc::unshare(flags) == 0 { 0 } else { 1 });
        }
        if pid < 0 {
            return false;
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
    }
}

fn landlock_abi() -> Option<i64> {
    const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
    // SAFETY: with a NULL attr and size 0 this syscall only reports the ABI version.
    let r = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, LANDLOCK_CREATE_RULESET_VERSION) };
    (r > 0).then_some(r)
}

fn kernel_version() -> (u32, u32) {
    let rel = read("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut it = rel.split(|c: char| !c.is_ascii_digit()).filter_map(|p| p.parse::<u32>().ok());
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

fn checks(state: &State) -> Vec<Check> {
    let mut out = Vec::new();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    out.push(if root {
        ok("privileges", "running as root")
    } else {
        missing("privileges", "not root: the ns tier creates cgroups and idmapped mounts", "run cordon as root (sudo cordon ...)")
    });

    let (maj, min) = kernel_version();
    let kv = format!("{maj}.{min}");
    out.push(if (maj, min) >= (5, 19) {
        ok("kernel", format!("{kv} (idmapped overlay layers need 5.19+)"))
    } else {
        missing("kernel", format!("{kv} is older than 5.19"), "upgrade the host kernel to 5.19 or newer")
    });

    let max_userns: u64 = read("/proc/sys/user/max_user_namespaces").and_then(|s| s.parse().ok()).unwrap_or(0);
    let userns_works = probe_unshare(libc::CLONE_NEWUSER);
    out.push(match (max_userns, userns_works) {
        (0, _) => missing("user namespaces", "user.max_user_namespaces = 0", "sysctl -w user.max_user_namespaces=65536"),
        (_, false) => missing("user namespaces", "unshare(CLONE_NEWUSER) failed", "enable CONFIG_USER_NS; check `sysctl kernel.unprivileged_userns_clone`"),
        _ => ok("user namespaces", format!("work (max {max_userns})")),
    });
    if let Some(v) = read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") {
        out.push(if v == "1" {
            warn(
                "apparmor userns",
                "AppArmor restricts unprivileged user namespaces (fine as root; rootless use would fail)",
                "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile allowing userns for cordon",
            )
        } else {
            ok("apparmor userns", "not restricted")
        });
    }
    if let Some(v) = read("/proc/sys/kernel/unprivileged_userns_clone") {
        if v == "0" {
            out.push(warn("userns sysctl", "kernel.unprivileged_userns_clone = 0 (fine as root)", "sysctl -w kernel.unprivileged_userns_clone=1"));
        }
    }
    let all_ns = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWCGROUP;
    out.push(if probe_unshare(all_ns) {
        ok("namespaces", "mount, pid, net, ipc, uts, cgroup")
    } else {
        missing("namespaces", "unshare of mount/pid/net/ipc/uts/cgroup failed", "run as root on a kernel with CONFIG_NAMESPACES")
    });

    let filesystems = read("/proc/filesystems").unwrap_or_default();
    for (fs_name, what) in [("overlay", "overlayfs (writable layer over the image)"), ("tmpfs", "tmpfs"), ("devpts", "devpts")] {
        out.push(if filesystems.split_whitespace().any(|f| f == fs_name) {
            ok(if fs_name == "overlay" { "overlayfs" } else { "tmpfs/devpts" }, what)
        } else {
            missing("filesystem", format!("{fs_name} not available"), format!("modprobe {fs_name}"))
        });
    }

    let layout = cordon_jail::Layout::detect();
    let gone = layout.missing();
    out.push(if gone.is_empty() {
        ok("cgroups", layout.describe())
    } else {
        missing(
            "cgroups",
            format!("{}; missing controllers: {}", layout.describe(), gone.join(", ")),
            "on v2: echo '+memory +pids +cpu' > /sys/fs/cgroup/cgroup.subtree_control; on v1: mount the memory, pids and cpu hierarchies",
        )
    });
    let has_kill = layout.unified.as_ref().is_some_and(|u| u.join("cgroup.kill").exists() || kernel_version() >= (5, 14));
    out.push(if has_kill {
        ok("cgroup.kill", "one-write teardown of a whole sandbox")
    } else {
        warn("cgroup.kill", "no unified hierarchy: teardown kills pid by pid", "mount cgroup2 (e.g. at /sys/fs/cgroup/unified)")
    });
    if layout.v1.iter().any(|(c, _)| c == "memory") && !Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists() {
        out.push(warn("swap accounting", "memory.memsw not available: swap cannot be capped", "boot with swapaccount=1, or disable swap"));
    }

    let seccomp = read("/proc/self/status")
        .and_then(|s| s.lines().find(|l| l.starts_with("Seccomp:")).map(String::from));
    out.push(match seccomp {
        Some(_) => ok("seccomp", "filter mode available"),
        None => missing("seccomp", "kernel without CONFIG_SECCOMP_FILTER", "use a kernel with seccomp filters"),
    });
    out.push(match landlock_abi() {
        Some(abi) => ok("landlock", format!("ABI {abi}")),
        None => warn("landlock", "not enabled", "boot with lsm=...,landlock (CONFIG_SECURITY_LANDLOCK)"),
    });
    out.push(match read("/sys/kernel/security/lsm") {
        Some(l) => ok("LSMs", l),
        None => ok("LSMs", "securityfs not mounted; list unknown"),
    });

    out.push(if Path::new("/dev/net/tun").exists() {
        ok("tun", "/dev/net/tun (egress with --allow-net)")
    } else {
        warn("tun", "no /dev/net/tun: sandboxes with --allow-net cannot be created", "modprobe tun")
    });
    out.push(match which("mmdebstrap") {
        Some(p) => ok("mmdebstrap", p),
        None => warn("mmdebstrap", "not installed (needed to build images; installed automatically when cordon runs as root)", "apt-get install mmdebstrap"),
    });
    out.push(runsc_check(state));
    out.extend(vm_checks(state));

    let images = state.images().ok().and_then(|s| s.list().ok()).unwrap_or_default();
    out.push(if images.iter().any(|i| i.name == "base") {
        ok("image base", format!("in {}", state.dir().display()))
    } else {
        warn("image base", "not built yet (it is built on first `cordon run`)", "cordon image build base")
    });
    out
}

/// runsc, its version, and the platform the gvisor tier will use. `ptrace` always works where
/// runsc does; `systrap` and `kvm` are chosen only when this runsc knows them and a probe with a
/// deadline runs a sandbox on them (kvm hangs on some hosts). The choice is recorded for `run`.
fn runsc_check(state: &State) -> Check {
    use cordon_gvisor::runsc;
    let rs = match cordon_gvisor::Runsc::locate() {
        Ok(r) => r,
        Err(e) => return warn("runsc", e.to_string(), "scripts/install-deps (apt-get install runsc), or set CORDON_RUNSC"),
    };
    let scratch = state.dir().join("gvisor");
    let _ = std::fs::create_dir_all(&scratch);
    let deadline = std::time::Duration::from_secs(3);
    let mut notes = Vec::new();
    let mut chosen = None;
    for p in ["systrap", "kvm", "ptrace"] {
        if p == "kvm" && !Path::new("/dev/kvm").exists() {
            notes.push("kvm: no /dev/kvm".to_string());
            continue;
        }
        match rs.probe(p, &scratch, deadline) {
            Ok(t) if chosen.is_none() => {
                chosen = Some(p);
                notes.push(format!("{p}: works ({} ms)", t.as_millis()));
            }
            Ok(t) => notes.push(format!("{p}: works ({} ms)", t.as_millis())),
            Err(e) => notes.push(format!("{p}: {e}")),
        }
    }
    let detail = format!("{} ({})", rs.path.display(), rs.version);
    match chosen {
        Some(p) => {
            let _ = runsc::record_platform(&rs, &scratch.join("platform"), p);
            ok("runsc", format!("{detail}, platform {p}; {}", notes.join("; ")))
        }
        None => warn("runsc", format!("{detail}: no platform runs a sandbox; {}", notes.join("; ")), "check `runsc --platform=ptrace do true` by hand"),
    }
}

/// The vm tier: its VMM, the tools that build its kit and disks, the cached kit, and whether it
/// runs under KVM or TCG (a real boot decides, not the presence of /dev/kvm). Opening the tier
/// also reaps VMs a crashed cordon left.
fn vm_checks(state: &State) -> Vec<Check> {
    let mut out = Vec::new();
    out.push(match which("mkfs.ext4") {
        Some(p) => ok("mkfs.ext4", p),
        None => warn("mkfs.ext4", "not installed (the vm tier makes its disks with it)", "apt-get install e2fsprogs"),
    });
    let tier = match state.vm() {
        Ok(t) => t,
        Err(e) => {
            out.push(warn("vm tier", e.to_string(), "apt-get install qemu-system-x86 (scripts/install-deps), or set CORDON_QEMU"));
            return out;
        }
    };
    out.push(ok("vmm", format!("{} ({})", tier.vmm().binary().display(), tier.vmm().name())));
    let kdir = tier.vm_dir().join("kernel");
    let Some(kernel) = cordon_vm::guest_kit::current_kernel(&kdir) else {
        out.push(ok("vm tier", "guest kit not built yet (built on the first `cordon run --tier vm`); KVM or TCG is decided then"));
        return out;
    };
    out.push(ok("guest kernel", format!("{kernel} in {}", kdir.display())));
    // The probe needs the kit (initramfs); building it is cheap once the kernel is cached.
    let accel = cordon_vm::guest_kit::ensure(tier.vm_dir(), Path::new("/proc/self/exe"), &mut cordon_image::NoProgress)
        .and_then(|kit| cordon_vm::accel::choose(tier.vm_dir(), tier.vmm(), &kit));
    out.push(match accel {
        Ok(v) => ok("vm tier", format!("{} ({})", v.accel.as_str(), v.reason)),
        Err(e) => warn("vm tier", e.to_string(), "see the message"),
    });
    out
}

pub fn main(state: &State) -> Result<u8> {
    let checks = checks(state);
    let mut bad = 0;
    for c in &checks {
        let tag = match c.status {
            Status::Ok => "ok     ",
            Status::Warn => "warn   ",
            Status::Missing => "MISSING",
        };
        println!("{tag} {:<18} {}", c.name, c.detail);
        if let Some(f) = &c.fix {
            if c.status != Status::Ok {
                println!("        {:<18} fix: {f}", "");
            }
        }
        if c.status == Status::Missing {
            bad += 1;
        }
    }
    println!();
    let ns_ok = !checks.iter().any(|c| c.status == Status::Missing);
    println!("tier ns      {}", if ns_ok { "available" } else { "NOT available (see MISSING above)" });
    let gvisor = checks.iter().find(|c| c.name == "runsc").is_some_and(|c| c.status == Status::Ok);
    println!(
        "tier gvisor  {}",
        match (ns_ok, gvisor) {
            (true, true) => "available",
            (false, _) => "NOT available (see MISSING above: it needs the same cgroups and privileges)",
            (true, false) => "NOT available (see runsc above)",
        }
    );
    match checks.iter().find(|c| c.name == "vm tier") {
        Some(c) if c.status == Status::Ok => println!("tier vm      available: {}", c.detail),
        Some(c) => println!("tier vm      NOT available: {}", c.detail),
        None => println!("tier vm      NOT available"),
    }
    Ok(if bad == 0 { 0 } else { 1 })
}
