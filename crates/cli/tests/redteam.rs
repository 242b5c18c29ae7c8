//! The red-team suite: escape attempts from inside real sandboxes, as root of the sandbox and as
//! its user, each checked to have failed the way the policy says, with the host untouched. The
//! attacks that do not depend on how a tier is built run on each tier (`ns::*`, `gvisor::*`,
//! and those that hold in a guest `vm::*`); the host checks are the same for all, and where
//! gVisor's own kernel answers a call the `ns` filter denies, the expectation says so
//! ([`GVISOR_KERNEL_HANDLES`]).

mod common;
#[path = "redteam/budgets.rs"] mod budgets;
#[path = "redteam/hostside.rs"] mod hostside;
#[path = "redteam/pid1.rs"] mod pid1;
#[path = "redteam/fsview.rs"] mod fsview;

use common::*;
use serde_json::Value;

per_tier!(
    root_inside_cannot_reach_the_kernel_surface_the_policy_denies,
    the_unprivileged_user_is_held_by_the_same_policy,
    sudo_still_works_under_the_filters,
    kill_everything_as_sandbox_root_only_kills_the_sandbox,
    ordinary_work_still_runs_under_every_control,
);

// In a guest, root is the guest kernel's root and the kernel surface is the guest's: the
// probe's attacks succeed there (see `guest_kernel_answers`), and what must hold is that none
// of them reaches the host, its processes included.
on_vm!(
    kill_everything_as_sandbox_root_only_kills_the_sandbox,
    root_inside_cannot_reach_the_kernel_surface_the_policy_denies,
    ordinary_work_still_runs_under_every_control,
);

/// Calls the ns filter denies that gVisor implements inside its own kernel: they succeed in the
/// sandbox and act only on gVisor's state (its namespaces, its netstack, its log), never on the
/// host's kernel. Every other denied call must fail under gVisor too.
const GVISOR_KERNEL_HANDLES: &[&str] =
    &["io_uring_setup", "unshare_user", "unshare_mount", "unshare_net", "ptrace_traceme", "syslog", "inet_raw", "inet6_raw", "af_packet", "af_netlink_uevent"];

const PROBE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/probes/attacks.py");

const EPERM: i64 = 1;
const EACCES: i64 = 13;
const EROFS: i64 = 30;
const ENOSYS: i64 = 38;
const EPROTONOSUPPORT: i64 = 93;
const EAFNOSUPPORT: i64 = 97;

/// Syscalls the filter denies; most of them would succeed, or fail differently, without it.
const DENIED: &[&str] = &[
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "open_by_handle_at", "name_to_handle_at", "mount", "umount2", "fsopen", "fsconfig",
    "fsmount", "fspick", "open_tree", "move_mount", "mount_setattr", "pivot_root", "unshare_user",
    "unshare_mount", "unshare_net", "setns", "clone_newuser", "ptrace_traceme", "process_vm_readv",
    "process_vm_writev", "kcmp", "pidfd_getfd", "acct", "swapon", "swapoff", "syslog", "quotactl",
    "lookup_dcookie", "iopl", "ioperm", "clock_settime", "settimeofday", "adjtimex", "clock_adjtime",
    "reboot", "personality_read_implies_exec", "personality_addr_no_randomize", "fanotify_init",
    "modify_ldt", "tiocsti", "tioclinux", "inet_raw", "inet6_raw",
];

fn probe(t: Tier, flags: &[&str]) -> (Value, Value) {
    let copy = format!("{PROBE}:/tmp/attacks.py");
    let mut all = t.flags(&["--copy", &copy]);
    all.extend_from_slice(flags);
    let r = run(&all, &["python3", "/tmp/attacks.py"]);
    assert_eq!(r.code, 0, "probe failed: {r:?}");
    // One JSON line of results, preceded by the chroot probe's line when it could chroot at all.
    let (mut res, mut chroot) = (Value::Null, Value::Null);
    for line in r.stdout.lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("bad probe line {line:?}: {e}"));
        if v.get("chroot_escape_root").is_some() {
            chroot = v;
        } else {
            res = v;
        }
    }
    assert_clean(r.id());
    (res, chroot)
}

fn errno(res: &Value, name: &str) -> i64 {
    res[name].as_i64().unwrap_or_else(|| panic!("probe has no result for {name}: {res}"))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap()
}

fn root_inside_cannot_reach_the_kernel_surface_the_policy_denies(t: Tier) {
    let host_name = hostname();
    let exe_hash = file_digest(&cordon_bin());
    let before = std::time::SystemTime::now();
    let core_pattern = std::fs::read("/proc/sys/kernel/core_pattern").unwrap();
    let (res, chroot) = probe(t, &["--user", "root"]);
    match t {
        Tier::Gvisor => return gvisor_kernel_answers(&res, &chroot, &host_name, exe_hash, before),
        Tier::Vm => return guest_kernel_answers(&res, &chroot, &host_name, exe_hash, before, &core_pattern),
        Tier::Ns => {}
    }

    for name in DENIED {
        assert_eq!(errno(&res, name), EPERM, "{name} was not denied with EPERM: {res}");
    }
    assert_eq!(errno(&res, "clone3"), ENOSYS, "clone3 must answer ENOSYS so libc falls back to clone");
    for fam in ["af_packet", "af_key", "af_alg", "af_vsock"] {
        assert_eq!(errno(&res, fam), EAFNOSUPPORT, "{fam}: {res}");
    }
    for nl in ["af_netlink_audit", "af_netlink_uevent"] {
        assert_eq!(errno(&res, nl), EPROTONOSUPPORT, "{nl}: {res}");
    }
    for ok in ["af_netlink_route", "inet_tcp", "unix"] {
        assert_eq!(errno(&res, ok), 0, "{ok} should work: {res}");
    }

    // Host-wide knobs in /proc are read-only, and host kernel state is masked.
    assert_eq!(errno(&res, "write_proc_sys_hostname"), EROFS);
    assert_eq!(errno(&res, "write_core_pattern"), EROFS);
    assert!(errno(&res, "read_kcore") <= 0, "/proc/kcore readable: {res}");
    assert_eq!(errno(&res, "read_keys"), 0, "/proc/keys not masked: {res}");
    assert_eq!(errno(&res, "read_timer_list"), 0, "/proc/timer_list not masked: {res}");
    // The agent binary (the host's cordon) cannot be overwritten through /proc/1/exe.
    assert_eq!(errno(&res, "overwrite_agent_exe"), EACCES, "{res}");
    // A block device node, even if root could make one, gives no access.
    assert!(errno(&res, "read_block_device") < 0, "{res}");

    // Dangerous capabilities are gone from the bounding set.
    let bnd = res["cap_bnd"].as_u64().unwrap();
    for (cap, name) in [(21, "SYS_ADMIN"), (12, "NET_ADMIN"), (19, "SYS_PTRACE"), (16, "SYS_MODULE"), (17, "SYS_RAWIO"), (13, "NET_RAW"), (25, "SYS_TIME"), (22, "SYS_BOOT")] {
        assert_eq!(bnd & (1 << cap), 0, "CAP_{name} left in the bounding set");
    }
    assert_eq!(res["seccomp_mode"], 2, "no seccomp filter");

    // The chroot trick ends in the sandbox's own root: nothing of the host is there.
    let root: Vec<&str> = chroot["chroot_escape_root"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(root.contains(&"usr") && !root.contains(&"work"), "chroot escape reached {root:?}");

    // And the host did not notice any of it.
    assert_eq!(hostname(), host_name, "host hostname changed");
    host_untouched(&host_name, exe_hash, before);
}

fn host_untouched(host_name: &str, exe_hash: u64, before: std::time::SystemTime) {
    assert_eq!(hostname(), host_name, "host hostname changed");
    assert_eq!(file_digest(&cordon_bin()), exe_hash, "the cordon binary changed");
    let now = std::time::SystemTime::now();
    assert!(now >= before && now.duration_since(before).unwrap().as_secs() < 120, "host clock moved");
}

/// The same attacks under gVisor: what its kernel implements succeeds inside (see
/// [`GVISOR_KERNEL_HANDLES`]); everything else fails, most of it as ENOSYS or EPERM from gVisor's
/// kernel; and the host is untouched exactly as under the ns tier.
fn gvisor_kernel_answers(res: &Value, chroot: &Value, host_name: &str, exe_hash: u64, before: std::time::SystemTime) {
    for name in DENIED {
        if !GVISOR_KERNEL_HANDLES.contains(name) {
            assert_ne!(errno(res, name), 0, "{name} succeeded under gVisor: {res}");
        }
    }
    // Module loading, kexec, reboot, clock and swap: none exists in gVisor's kernel for root.
    for name in ["kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "settimeofday", "clock_settime", "swapon", "acct", "iopl", "ioperm"] {
        assert!([EPERM, ENOSYS].contains(&errno(res, name)), "{name}: {res}");
    }
    assert_eq!(errno(res, "clone3"), ENOSYS, "clone3 must answer ENOSYS so libc falls back to clone");
    for fam in ["af_key", "af_alg", "af_vsock"] {
        assert_eq!(errno(res, fam), EAFNOSUPPORT, "{fam}: {res}");
    }
    for ok in ["af_netlink_route", "inet_tcp", "unix"] {
        assert_eq!(errno(res, ok), 0, "{ok} should work: {res}");
    }
    // gVisor's /proc refuses host-wide knobs and has no kcore, keys or timer list at all.
    assert_ne!(errno(res, "write_proc_sys_hostname"), 0);
    assert_ne!(errno(res, "write_core_pattern"), 0);
    for f in ["read_kcore", "read_keys", "read_timer_list"] {
        assert!(errno(res, f) <= 0, "{f}: {res}");
    }
    assert_eq!(errno(res, "overwrite_agent_exe"), EACCES, "{res}");
    assert!(errno(res, "read_block_device") < 0, "{res}");
    let root: Vec<&str> = chroot["chroot_escape_root"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(root.contains(&"usr") && !root.contains(&"work"), "chroot escape reached {root:?}");
    host_untouched(host_name, exe_hash, before);
}

/// The same attacks as root of a guest: the guest kernel is the boundary, so much of what the
/// ns filter denies succeeds, on the guest kernel only. What the host sees is the point: its
/// hostname, clock, core_pattern and the cordon binary are as they were, though guest root
/// set the guest's hostname and core_pattern, wrote to its sysrq-trigger, used the keyring,
/// io_uring, userfaultfd, raw and packet sockets, made namespaces and climbed out of a chroot.
fn guest_kernel_answers(res: &Value, chroot: &Value, host_name: &str, exe_hash: u64, before: std::time::SystemTime, core_pattern: &[u8]) {
    // Proof that the attacks ran with the guest kernel's full privilege, not against a filter.
    for done in [
        "write_proc_sys_hostname", "write_core_pattern", "write_sysrq_trigger", "keyctl", "io_uring_setup", "userfaultfd",
        "inet_raw", "af_packet", "unshare_user", "unshare_mount", "unshare_net",
    ] {
        assert_eq!(errno(res, done), 0, "{done} failed as guest root: {res}");
    }
    assert_ne!(res["cap_bnd"].as_u64().unwrap() & (1 << 21), 0, "guest root lacks CAP_SYS_ADMIN: {res}");
    // The chroot trick reaches the guest's root, which is the image, never the host's.
    let root: Vec<&str> = chroot["chroot_escape_root"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(root.contains(&"usr") && !root.contains(&"work"), "chroot escape reached {root:?}");
    assert_eq!(std::fs::read("/proc/sys/kernel/core_pattern").unwrap(), core_pattern, "the host's core_pattern changed");
    host_untouched(host_name, exe_hash, before);
}

fn the_unprivileged_user_is_held_by_the_same_policy(t: Tier) {
    let (res, _) = probe(t, &[]);
    for name in ["io_uring_setup", "keyctl", "add_key", "unshare_user", "clone_newuser", "name_to_handle_at", "ptrace_traceme", "adjtimex", "personality_read_implies_exec"] {
        match t {
            Tier::Ns => assert_eq!(errno(&res, name), EPERM, "{name} as user: {res}"),
            Tier::Gvisor if GVISOR_KERNEL_HANDLES.contains(&name) => {}
            Tier::Gvisor => assert_ne!(errno(&res, name), 0, "{name} as user: {res}"),
            Tier::Vm => unreachable!("the probe's expectations are the host filter's: not run on the vm tier"),
        }
    }
    assert_eq!(errno(&res, "af_alg"), EAFNOSUPPORT);
}

#[test]
fn ptrace_is_opt_in() {
    require_root!();
    let (res, _) = probe(Tier::Ns, &["--allow-ptrace"]);
    assert_eq!(errno(&res, "ptrace_traceme"), 0, "{res}");
    assert_eq!(errno(&res, "process_vm_readv"), 0, "{res}");
    // Everything else stays denied.
    assert_eq!(errno(&res, "io_uring_setup"), EPERM);
    assert_eq!(errno(&res, "unshare_user"), EPERM);
}

#[test]
fn landlock_is_enforced_and_reported() {
    require_root!();
    let r = run(&[], &["true"]);
    assert_eq!(r.code, 0);
    // Asked of the kernel itself: /sys/kernel/security (securityfs) is often not mounted.
    // SAFETY: LANDLOCK_CREATE_RULESET_VERSION (1) with a null attr and size 0 only returns the ABI.
    let abi = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32) };
    if abi < 1 {
        common::skip("Landlock is not an active LSM on this kernel");
        return;
    }
    assert_eq!(r.record["landlock"], "full", "{r:?}");
}

fn sudo_still_works_under_the_filters(t: Tier) {
    let r = sh(&t.flags(&[]), "sudo -n id -u && sudo -n sh -c 'echo ok > /root/x && cat /root/x'");
    if t == Tier::Gvisor {
        // runsc sets no_new_privs on every process, so sudo cannot become root: the sandbox's
        // root is reached with --user root instead.
        assert_ne!(r.code, 0, "{r:?}");
        assert!(r.stderr.contains("no new privileges"), "{r:?}");
        let r = sh(&t.flags(&["--user", "root"]), "id -u && echo ok > /root/x && cat /root/x");
        assert_eq!(r.stdout, "0\nok\n", "{r:?}");
        return;
    }
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(r.stdout, "0\nok\n");
    assert!(r.stderr.is_empty(), "sudo complained: {}", r.stderr);
}

/// A host marker file and a host marker process, checked after an attack.
struct HostMarkers {
    file: std::path::PathBuf,
    content: String,
    process: std::process::Child,
}

impl HostMarkers {
    fn plant() -> HostMarkers {
        let t = token();
        let file = std::path::PathBuf::from(format!("/root/cordon-marker-{t}"));
        std::fs::write(&file, &t).unwrap();
        let process = std::process::Command::new("sleep").arg("600").spawn().unwrap();
        HostMarkers { file, content: t, process }
    }

    fn assert_intact(mut self) {
        assert_eq!(std::fs::read_to_string(&self.file).unwrap(), self.content, "host marker file changed");
        assert!(self.process.try_wait().unwrap().is_none(), "host marker process died");
        let _ = self.process.kill();
        let _ = self.process.wait();
        let _ = std::fs::remove_file(&self.file);
    }
}

fn kill_everything_as_sandbox_root_only_kills_the_sandbox(t: Tier) {
    let m = HostMarkers::plant();
    let host_pid = m.process.id();
    let r = sh(&t.flags(&["--user", "root"]), &format!("sleep 30 & kill -9 {host_pid} 2>/dev/null; echo kill_host=$?; kill -9 -1; echo after=$?"));
    assert!(r.stdout.contains("kill_host=1"), "{r:?}");
    assert!(r.stdout.contains("after=0"), "kill -1 should succeed inside (on the sandbox's own processes): {r:?}");
    m.assert_intact();
    assert_clean(r.id());
}

#[test]
fn setuid_escalation_stays_an_unprivileged_host_uid() {
    require_root!();
    let marker = format!("{}.{}", 600 + (std::process::id() % 100), 3);
    let mut child = cordon()
        .args(["run", "--", "bash", "-c", &format!("sudo -n sleep {marker}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    ensure_base();
    let seen = wait_until(std::time::Duration::from_secs(20), || !host_sleeps(&marker).is_empty());
    let procs = host_processes_with(&format!("sleep {marker}"));
    let _ = child.kill();
    let _ = child.wait();
    assert!(seen, "sudo'd process not seen");
    for (pid, uid) in procs {
        assert!(uid >= 1_000_000_000, "process {pid} escalated to host uid {uid}");
    }
}

#[test]
fn the_user_cannot_ptrace_the_agent_even_with_ptrace_allowed() {
    require_root!();
    let script = "import ctypes; l=ctypes.CDLL(None, use_errno=True); r=l.ptrace(16, 1, 0, 0); print(r, ctypes.get_errno())";
    let r = run(&["--allow-ptrace"], &["python3", "-c", script]);
    assert_eq!(r.stdout.trim(), "-1 1", "PTRACE_ATTACH to PID 1: {r:?}");
}

#[test]
fn cgroup_release_agent_and_host_paths_are_out_of_reach() {
    require_root!();
    let m = HostMarkers::plant();
    let marker_name = m.file.file_name().unwrap().to_string_lossy().into_owned();
    let r = sh(
        &["--user", "root", "--env", &format!("M={marker_name}")],
        "mkdir -p /tmp/cg; mount -t cgroup -o memory cgroup /tmp/cg 2>/dev/null; echo mount=$?; \
         ls /sys/fs/cgroup 2>/dev/null | wc -l; \
         ls -d /proc/1/root/../../.. /proc/self/root/../..; \
         ln -s / /tmp/up; ls /tmp/up/../../../ | tr '\\n' ' '; echo; \
         find / -xdev -name \"$M\" 2>/dev/null | wc -l; \
         setsid sleep 100 & (sleep 100 &) ; nohup sleep 100 >/dev/null 2>&1 & echo spawned",
    );
    assert!(r.stdout.contains("mount=32"), "cgroup mount inside must fail: {r:?}");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines[1].trim(), "0", "cgroupfs visible: {r:?}");
    assert!(!r.stdout.contains("work ") && r.stdout.contains("usr"), "{r:?}");
    assert_eq!(lines[lines.len() - 2].trim(), "0", "host marker findable: {r:?}");
    m.assert_intact();
    assert_clean(r.id());
}

fn ordinary_work_still_runs_under_every_control(t: Tier) {
    let script = r#"
set -e
cd /tmp
mkdir -p pkg/hello && echo 'def hi(): return "hi from wheel"' > pkg/hello/__init__.py
printf 'from setuptools import setup\nsetup(name="hello", version="1.0", packages=["hello"])\n' > pkg/setup.py
pip wheel -q --no-build-isolation --no-index -w wheels ./pkg 2>/dev/null
pip install -q --user --no-index wheels/hello-1.0-*.whl 2>/dev/null
python3 -c 'import hello; print(hello.hi())'
git init -q repo && cd repo && git config user.email a@b && git config user.name a
echo x > f && git add f && git commit -qm init && git log --oneline | wc -l
python3 -c '
import multiprocessing as mp, threading
def sq(x): return x * x
with mp.Pool(4) as p: print(sum(p.map(sq, range(100))))
out = []
ts = [threading.Thread(target=out.append, args=(i,)) for i in range(16)]
[t.start() for t in ts]; [t.join() for t in ts]; print(len(out))
'
python3 -m venv /tmp/venv && /tmp/venv/bin/python -c 'import sys; print(sys.prefix)'
if command -v gcc >/dev/null; then echo 'int main(){return 7;}' > t.c && gcc t.c -o t && ./t; echo gcc=$?; else echo "gcc not in image: skipped"; fi
"#;
    let r = sh(&t.flags(&[]), script);
    assert_eq!(r.code, 0, "{r:?}");
    let want = ["hi from wheel", "1", "328350", "16", "/tmp/venv"];
    for (line, w) in r.stdout.lines().zip(want) {
        assert_eq!(line, w, "{r:?}");
    }
}

/// Runs the static probe inside a sandbox and returns its report.
fn probe_report(flags: &[&str]) -> (Value, String) {
    let copy = format!("{}:/tmp/cordon-probe", env!("CARGO_BIN_EXE_cordon-probe"));
    let mut all = vec!["--copy", &copy];
    all.extend_from_slice(flags);
    // Files arrive without their mode bits, so the probe is made executable first.
    let r = sh(&all, "chmod +x /tmp/cordon-probe && /tmp/cordon-probe");
    assert_eq!(r.code, 0, "{r:?}");
    let report: Value = serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", r.stdout));
    (report, r.id().to_string())
}

#[test]
fn the_probe_sees_exactly_the_sandbox_it_should() {
    require_root!();
    let (p, id) = probe_report(&[]);
    let uid_map: Vec<u64> = p["uid_map"].as_str().unwrap().split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!(uid_map[0], 0);
    assert!(uid_map[1] >= 1_000_000_000 && uid_map[1] % 65_536 == 1_000_000_000 % 65_536, "{p}");
    assert_eq!(uid_map[2], 65_536);
    assert_eq!(p["gid_map"], p["uid_map"]);
    assert!(p["uid"].as_str().unwrap().starts_with("1000"), "{p}");
    assert_eq!(p["cap_eff"], "0000000000000000", "the user has capabilities: {p}");
    assert_eq!(p["cap_amb"], "0000000000000000");
    let bnd = u64::from_str_radix(p["cap_bnd"].as_str().unwrap(), 16).unwrap();
    assert_eq!(bnd & (1 << 21), 0, "CAP_SYS_ADMIN in the bounding set");
    assert_eq!(p["seccomp"], "2");
    assert_eq!(p["seccomp_filters"], "1", "one program: the allowlist with its errno overrides folded in");
    assert_eq!(p["no_new_privs"], "0", "no_new_privs is deliberately off (sudo)");
    assert!(p["landlock_abi"].as_i64().unwrap() >= 1, "{p}");
    assert_eq!(p["hostname"], id.as_str());
    assert_eq!(p["interfaces"], serde_json::json!(["lo"]));
    let pids: Vec<&str> = p["pids"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    // PID 1 is the agent: the cordon binary (its comm is the file name it was exec'd from).
    assert_eq!(pids[0], "1:cordon", "{pids:?}");
    assert!(pids[1..].iter().all(|p| p.ends_with(":bash") || p.ends_with(":cordon-probe")), "{pids:?}");
    for m in p["mounts"].as_array().unwrap() {
        let fstype = m.as_str().unwrap().split(' ').nth(1).unwrap();
        assert!(["overlay", "proc", "tmpfs", "devpts", "devtmpfs"].contains(&fstype), "unexpected mount {m}");
    }
}

#[test]
fn the_probe_as_root_has_only_the_documented_capabilities() {
    require_root!();
    let (p, _) = probe_report(&["--user", "root"]);
    let eff = u64::from_str_radix(p["cap_eff"].as_str().unwrap(), 16).unwrap();
    let documented: u64 = [0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 27, 29, 31].iter().map(|c| 1u64 << c).sum();
    assert_eq!(eff, documented, "root's capabilities differ from the documented set: {eff:x} vs {documented:x}");
}

/// A call the ns filter denies (io_uring_setup, EPERM there) is implemented by gVisor's own
/// kernel: it succeeds inside, and while the sandbox holds the ring, no host process of the
/// sandbox holds an io_uring: the host kernel never saw the call.
#[test]
fn gvisor_kernel_handles_io_uring_without_the_host() {
    require_root!();
    if let Some(why) = Tier::Gvisor.unavailable() {
        common::skip(&why);
        return;
    }
    ensure_base();
    let script = "import ctypes, sys, time\n\
                  l = ctypes.CDLL(None, use_errno=True)\n\
                  buf = ctypes.create_string_buffer(4096)\n\
                  fd = l.syscall(425, 4, ctypes.addressof(buf))\n\
                  print(fd, ctypes.get_errno(), flush=True)\n\
                  sys.stdin.readline()\n";
    let mut child = cordon()
        .args(["run", "--json", "--tier", "gvisor", "--", "python3", "-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let fd: i64 = line.split_whitespace().next().unwrap().parse().unwrap();
    assert!(fd >= 0, "io_uring_setup failed inside gVisor: {line}");
    // The ring is open inside now. Look at every host process of this sandbox's cgroup.
    let (_, id) = gvisor_sandbox_of(child.id());
    let mut host_fds = 0;
    for p in host_processes() {
        if !std::fs::read_to_string(format!("/proc/{p}/cgroup")).is_ok_and(|c| c.contains(&format!("/cordon/{id}"))) {
            continue;
        }
        for fd in std::fs::read_dir(format!("/proc/{p}/fd")).into_iter().flatten().flatten() {
            host_fds += 1;
            let target = std::fs::read_link(fd.path()).unwrap_or_default();
            assert!(!target.to_string_lossy().contains("io_uring"), "host process {p} holds an io_uring: {}", target.display());
        }
    }
    assert!(host_fds > 0, "saw no host descriptors of the sandbox at all");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"\n").unwrap();
    let status = child.wait().unwrap();
    assert!(status.success());
    assert_clean(&id);
}

#[test]
fn denied_syscalls_are_recorded_per_sandbox() {
    require_root!();
    let script = "import ctypes; l=ctypes.CDLL(None, use_errno=True)\n\
                  r=[l.syscall(425, 1, 0) for _ in range(3)] + [l.syscall(321, 0, 0, 0)]\n\
                  print(r, ctypes.get_errno())";
    let out = cordon()
        .args(["run", "--json", "--audit", "--", "python3", "-c", script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some("[-1, -1, -1, -1] 1"), "the calls must still fail with EPERM: {stdout}");
    let rec: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    let denied = rec["denied_syscalls"].as_array().unwrap();
    assert_eq!(denied[0]["syscall"], "io_uring_setup", "{rec}");
    assert_eq!(denied[0]["count"], 3);
    assert_eq!(denied[1]["syscall"], "bpf");
    assert_eq!(denied[1]["count"], 1);
    assert!(stderr.contains("cordon: audit: denied io_uring_setup x3"), "{stderr}");
    // A clean run records nothing.
    let r = run(&[], &["true"]);
    assert_eq!(r.record["denied_syscalls"], serde_json::json!([]), "{r:?}");
}
