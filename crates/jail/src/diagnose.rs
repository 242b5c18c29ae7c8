//! What the ns tier needs of the host beyond what every tier needs, checked for real where a
//! cheap probe exists (`cordon doctor`): user and other namespaces, the filesystems the root is
//! made of, a kernel with idmapped overlay layers, seccomp and Landlock.

use std::fs;

use cordon_sandbox::diagnosis::{Diagnosis, Finding};
use cordon_sandbox::Host;

/// The tier's checks, and whether it opens.
pub fn diagnose(host: &Host) -> Diagnosis {
    let mut out = vec![kernel()];
    out.extend(user_namespaces());
    out.push(namespaces());
    out.extend(filesystems());
    out.push(seccomp());
    out.push(landlock());
    out.push(cordon_sandbox::diagnosis::pause(&cordon_host::Layout::detect(), crate::backend::CAPABILITIES.keep_writable));
    out.push(criu());
    Diagnosis::from_checks(out, || crate::backend::open(host).map(|_| None).map_err(|e| e.to_string()))
}

fn read(p: &str) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn kernel() -> Finding {
    let (maj, min) = cordon_host::sys::kernel_version();
    let kv = format!("{maj}.{min}");
    if (maj, min) >= (5, 19) {
        Finding::ok("kernel", format!("{kv} (idmapped overlay layers need 5.19+)"))
    } else {
        Finding::missing("kernel", format!("{kv} is older than 5.19"), "upgrade the host kernel to 5.19 or newer")
    }
}

fn user_namespaces() -> Vec<Finding> {
    let mut out = Vec::new();
    let max_userns: u64 = read("/proc/sys/user/max_user_namespaces").and_then(|s| s.parse().ok()).unwrap_or(0);
    out.push(match (max_userns, probe_unshare(libc::CLONE_NEWUSER)) {
        (0, _) => Finding::missing("user namespaces", "user.max_user_namespaces = 0", "sysctl -w user.max_user_namespaces=65536"),
        (_, false) => Finding::missing(
            "user namespaces",
            "unshare(CLONE_NEWUSER) failed",
            "enable CONFIG_USER_NS; check `sysctl kernel.unprivileged_userns_clone`",
        ),
        _ => Finding::ok("user namespaces", format!("work (max {max_userns})")),
    });
    if let Some(v) = read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") {
        out.push(if v == "1" {
            Finding::warn(
                "apparmor userns",
                "AppArmor restricts unprivileged user namespaces (fine as root; rootless use would fail)",
                "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile allowing userns for cordon",
            )
        } else {
            Finding::ok("apparmor userns", "not restricted")
        });
    }
    if read("/proc/sys/kernel/unprivileged_userns_clone").as_deref() == Some("0") {
        out.push(Finding::warn("userns sysctl", "kernel.unprivileged_userns_clone = 0 (fine as root)", "sysctl -w kernel.unprivileged_userns_clone=1"));
    }
    out
}

fn namespaces() -> Finding {
    let all = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWCGROUP;
    if probe_unshare(all) {
        Finding::ok("namespaces", "mount, pid, net, ipc, uts, cgroup")
    } else {
        Finding::missing("namespaces", "unshare of mount/pid/net/ipc/uts/cgroup failed", "run as root on a kernel with CONFIG_NAMESPACES")
    }
}

fn filesystems() -> Vec<Finding> {
    let known = read("/proc/filesystems").unwrap_or_default();
    [("overlay", "overlayfs", "overlayfs (writable layer over the image)"), ("tmpfs", "tmpfs/devpts", "tmpfs"), ("devpts", "tmpfs/devpts", "devpts")]
        .into_iter()
        .map(|(fs_name, name, what)| {
            if known.split_whitespace().any(|f| f == fs_name) {
                Finding::ok(name, what)
            } else {
                Finding::missing("filesystem", format!("{fs_name} not available"), format!("modprobe {fs_name}"))
            }
        })
        .collect()
}

fn seccomp() -> Finding {
    match read("/proc/self/status").filter(|s| s.lines().any(|l| l.starts_with("Seccomp:"))) {
        Some(_) => Finding::ok("seccomp", "filter mode available"),
        None => Finding::missing("seccomp", "kernel without CONFIG_SECCOMP_FILTER", "use a kernel with seccomp filters"),
    }
}

fn landlock() -> Finding {
    const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
    // SAFETY: with a NULL attr and size 0 this syscall only reports the ABI version.
    let abi = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, LANDLOCK_CREATE_RULESET_VERSION) };
    if abi > 0 {
        Finding::ok("landlock", format!("ABI {abi}"))
    } else {
        Finding::warn("landlock", "not enabled", "boot with lsm=...,landlock (CONFIG_SECURITY_LANDLOCK)")
    }
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

/// Whether CRIU could write an ns sandbox to disk here. It only informs: ns pauses with memory
/// freeze in place either way, and the finding says which applies and why.
fn criu() -> Finding {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let Some(path) = ["/usr/sbin/criu", "/sbin/criu", "/usr/bin/criu"].into_iter().find(|p| std::path::Path::new(p).is_file()) else {
        return Finding::ok("criu", "not installed: ns pauses with memory freeze in place, in memory");
    };
    let version = Command::new(path).arg("--version").output().ok().map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim_start_matches("Version:").trim().to_string()).unwrap_or_default();
    let version = format!("criu {version}");
    let child = Command::new(path).arg("check").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn();
    let verdict = match child {
        Err(e) => Err(e.to_string()),
        Ok(mut c) => {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match c.try_wait() {
                    Ok(Some(st)) => {
                        let mut err = String::new();
                        if let Some(mut e) = c.stderr.take() {
                            use std::io::Read;
                            let _ = e.read_to_string(&mut err);
                        }
                        let first = err.lines().find(|l| l.contains("Error")).unwrap_or("").to_string();
                        break if st.success() { Ok(()) } else { Err(first.split("): ").last().unwrap_or(&first).trim().to_string()) };
                    }
                    Ok(None) if Instant::now() > deadline => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break Err("no answer within 10 s".into());
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                    Err(e) => break Err(e.to_string()),
                }
            }
        }
    };
    match verdict {
        Ok(()) => Finding::ok("criu", format!("{version} passes `criu check`, but cordon does not write ns sandboxes to disk with it yet: ns pauses with memory freeze in place")),
        Err(why) => Finding::ok("criu", format!("{version}: `criu check` fails on this kernel ({why}): ns pauses with memory freeze in place, in memory")),
    }
}
