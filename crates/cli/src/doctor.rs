//! `cordon doctor`: every kernel feature and tool cordon relies on, checked for real where a
//! cheap probe exists, each with the exact fix when it is missing. What every tier needs
//! (privileges, cgroups, the TUN device, the image builder) is checked here; each tier of the
//! table checks the rest itself (`TierEntry::diagnose`) and gives its own verdict, printed as
//! one closing line per tier.

use crate::state::State;
use anyhow::Result;
use cordon_sandbox::diagnosis::{Finding, Status};
use std::fs;
use std::path::Path;

fn read(p: &str) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// What every tier needs of the host.
fn host_checks(state: &State) -> Vec<Finding> {
    let mut out = Vec::new();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    out.push(if root {
        Finding::ok("privileges", "running as root")
    } else {
        Finding::missing("privileges", "not root: sandboxes need cgroups and idmapped mounts", "run cordon as root (sudo cordon ...)")
    });
    out.extend(cgroup_checks());
    out.push(match read("/sys/kernel/security/lsm") {
        Some(l) => Finding::ok("LSMs", l),
        None => Finding::ok("LSMs", "securityfs not mounted; list unknown"),
    });
    out.push(if Path::new("/dev/net/tun").exists() {
        Finding::ok("tun", "/dev/net/tun (egress with --allow-net)")
    } else {
        Finding::warn("tun", "no /dev/net/tun: sandboxes with --allow-net cannot be created", "modprobe tun")
    });
    out.push(match cordon_host::sys::which("mmdebstrap") {
        Some(p) => Finding::ok("mmdebstrap", p.display().to_string()),
        None => Finding::warn(
            "mmdebstrap",
            "not installed (needed to build images; installed automatically when cordon runs as root)",
            "apt-get install mmdebstrap",
        ),
    });
    out.push(match (cordon_host::sys::which("mkfs.ext4"), Path::new("/dev/loop-control").exists()) {
        (Some(_), true) => Finding::ok(
            "volumes",
            if Path::new(cordon_vm::shares::VIRTIOFSD).is_file() {
                "mkfs.ext4, loop devices; virtiofsd for the vm tier"
            } else {
                "mkfs.ext4, loop devices (no virtiofsd: VMs cannot mount volumes; apt-get install qemu-system-common)"
            },
        ),
        (None, _) => Finding::warn("volumes", "mkfs.ext4 is missing: volumes cannot be created", "apt-get install e2fsprogs"),
        (_, false) => Finding::warn("volumes", "no /dev/loop-control: volumes cannot be mounted", "modprobe loop"),
    });
    let ca = state.dir().join("egress-ca/ca.pem");
    let made = if ca.exists() { format!("egress CA {}", ca.display()) } else { "egress CA made on first use".to_string() };
    out.push(match cordon_net::intercept::host_trust_count() {
        0 => Finding::warn("injection", format!("{made}; the host's trust store is empty: hosts of --inject / network.rules cannot be verified"), "apt-get install ca-certificates, or give --upstream-ca FILE"),
        n => Finding::ok("injection", format!("{made}; upstream hosts verified against the host's {n} CA certificates")),
    });
    let images = state.images().ok().and_then(|s| s.list().ok()).unwrap_or_default();
    out.push(if images.iter().any(|i| i.name == "base") {
        Finding::ok("image base", format!("in {}", state.dir().display()))
    } else {
        Finding::warn("image base", "not built yet (it is built on first `cordon run`)", "cordon image build base")
    });
    out
}

fn cgroup_checks() -> Vec<Finding> {
    let mut out = Vec::new();
    let layout = cordon_host::Layout::detect();
    let gone = layout.missing();
    out.push(if gone.is_empty() {
        Finding::ok("cgroups", layout.describe())
    } else {
        Finding::missing(
            "cgroups",
            format!("{}; missing controllers: {}", layout.describe(), gone.join(", ")),
            "on v2: echo '+memory +pids +cpu' > /sys/fs/cgroup/cgroup.subtree_control; on v1: mount the memory, pids and cpu hierarchies",
        )
    });
    let has_kill = layout.unified.as_ref().is_some_and(|u| u.join("cgroup.kill").exists() || cordon_host::sys::kernel_version() >= (5, 14));
    out.push(if has_kill {
        Finding::ok("cgroup.kill", "one-write teardown of a whole sandbox")
    } else {
        Finding::warn("cgroup.kill", "no unified hierarchy: teardown kills pid by pid", "mount cgroup2 (e.g. at /sys/fs/cgroup/unified)")
    });
    if layout.v1.iter().any(|(c, _)| c == "memory") && !Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists() {
        out.push(Finding::warn("swap accounting", "memory.memsw not available: swap cannot be capped", "boot with swapaccount=1, or disable swap"));
    }
    if let Some(f) = attach_check(&layout) {
        out.push(f);
    }
    out
}

/// How long moving a process into a cgroup takes here: every sandbox start pays it once per
/// hierarchy it joins. Without `favordynmods` the kernel waits for an RCU grace period on
/// each move (measured at 7-16 ms on a 6.18 kernel, against 0.1-0.2 ms with it).
fn attach_check(layout: &cordon_host::Layout) -> Option<Finding> {
    let parent = layout.v1.iter().find(|(c, _)| c == "pids").map(|(_, p)| p.clone()).or_else(|| layout.unified.clone())?;
    let dir = parent.join(format!("cordon-doctor-{}", std::process::id()));
    std::fs::create_dir(&dir).ok()?;
    let mut times = Vec::new();
    for _ in 0..3 {
        let Ok(mut child) = std::process::Command::new("sleep").arg("5").spawn() else { break };
        let t = std::time::Instant::now();
        let moved = std::fs::write(dir.join("cgroup.procs"), child.id().to_string());
        times.push(t.elapsed());
        let _ = child.kill();
        let _ = child.wait();
        if moved.is_err() {
            break;
        }
        // Apart, as sandbox starts are: back-to-back moves share one grace period.
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let _ = std::fs::remove_dir(&dir);
    times.sort();
    let median = *times.get(times.len() / 2)?;
    let ms = median.as_secs_f64() * 1000.0;
    Some(if ms < 2.0 {
        Finding::ok("cgroup moves", format!("{ms:.1} ms per process moved into a sandbox's cgroup"))
    } else {
        Finding::warn(
            "cgroup moves",
            format!("{ms:.1} ms per process moved into a sandbox's cgroup, paid by every gvisor and vm start (the kernel waits for an RCU grace period; ns sandboxes are born in theirs)"),
            "mount -o remount,favordynmods on the cgroup hierarchies (kernel 6.0+; host-wide: cheaper moves, slightly dearer fork and exit)",
        )
    })
}

fn print(f: &Finding) {
    let tag = match f.status {
        Status::Ok => "ok     ",
        Status::Warn => "warn   ",
        Status::Missing => "MISSING",
    };
    println!("{tag} {:<18} {}", f.name, f.detail);
    if let (Some(fix), true) = (&f.fix, f.status != Status::Ok) {
        println!("        {:<18} fix: {fix}", "");
    }
}

pub fn main(state: &State) -> Result<u8> {
    // The tiers' probes keep their scratch files and choices in the state directory; without
    // it (not root) they report why they cannot open.
    let _ = state.ensure();
    let host = state.host(None);
    let shared = host_checks(state);
    let host_ok = !shared.iter().any(|f| f.status == Status::Missing);
    let mut findings = shared;
    let mut verdicts = Vec::new();
    for entry in &crate::tiers::TABLE {
        let d = (entry.diagnose)(&host);
        findings.extend(d.findings);
        // A tier cannot run where what every tier needs is missing, whatever it says itself.
        verdicts.push((entry.tier, if host_ok { d.verdict } else { Err("see MISSING above".into()) }));
    }
    findings.iter().for_each(print);
    println!();
    for (tier, verdict) in verdicts {
        let name = tier.as_str();
        match verdict {
            Ok(None) => println!("tier {name:<8}available"),
            Ok(Some(summary)) => println!("tier {name:<8}available: {summary}"),
            Err(reason) => println!("tier {name:<8}NOT available: {reason}"),
        }
    }
    let missing = findings.iter().filter(|f| f.status == Status::Missing).count();
    Ok(if missing == 0 { 0 } else { 1 })
}
