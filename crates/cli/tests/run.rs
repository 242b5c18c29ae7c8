//! `cordon run` as a user sees it: exit codes, streams, flags, teardown in every way a run can
//! end, and clear errors for bad input. The tier-dependent tests run on each tier (`ns::*`,
//! `gvisor::*`, and those that hold in a guest also `vm::*`).

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

per_tier!(
    prints_and_exits_with_the_command_status,
    default_user_is_user_with_sudo_and_root_is_allowed,
    env_and_workdir_flags,
    stdin_passes_through,
    output_streams_live,
    copy_puts_files_in_before_start,
    background_processes_do_not_outlive_the_run,
    ctrl_c_tears_everything_down,
    a_killed_cordon_is_reaped_by_the_next_one,
);

on_vm!(
    prints_and_exits_with_the_command_status,
    default_user_is_user_with_sudo_and_root_is_allowed,
    env_and_workdir_flags,
    stdin_passes_through,
    output_streams_live,
    copy_puts_files_in_before_start,
    background_processes_do_not_outlive_the_run,
);

fn prints_and_exits_with_the_command_status(t: Tier) {
    let r = run(&t.flags(&[]), &["python3", "-c", "print(6*7)"]);
    assert_eq!((r.code, r.stdout.as_str()), (0, "42\n"), "{r:?}");
    assert_eq!(r.reason(), "exit");
    let r = sh(&t.flags(&[]), "echo out; echo err >&2; exit 7");
    assert_eq!(r.code, 7);
    assert_eq!(r.stdout, "out\n");
    assert!(r.stderr.contains("err"));
    assert_clean(r.id());
}

fn default_user_is_user_with_sudo_and_root_is_allowed(t: Tier) {
    let r = sh(&t.flags(&[]), "id -un; id -u; pwd; echo $HOME; sudo -n id -u");
    match t {
        Tier::Ns | Tier::Vm => assert_eq!(r.stdout, "user\n1000\n/home/user\n/home/user\n0\n", "{r:?}"),
        // runsc sets no_new_privs on every process: setuid programs cannot raise privileges.
        Tier::Gvisor => {
            assert_eq!(r.stdout, "user\n1000\n/home/user\n/home/user\n", "{r:?}");
            assert!(r.stderr.contains("no new privileges"), "{r:?}");
        }
    }
    let r = sh(&t.flags(&["--user", "root"]), "id -u");
    assert_eq!(r.stdout, "0\n");
    let r = sh(&t.flags(&["--user", "nobody-here"]), "id -u");
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("no such user"), "{r:?}");
}

fn env_and_workdir_flags(t: Tier) {
    let r = sh(&t.flags(&["--env", "FOO=bar baz", "-e", "N=1", "--workdir", "/tmp"]), "echo \"$FOO/$N\"; pwd");
    assert_eq!(r.stdout, "bar baz/1\n/tmp\n", "{r:?}");
}

fn stdin_passes_through(t: Tier) {
    let r = run_with_stdin(&t.flags(&[]), &["python3", "-c", "import sys; d=sys.stdin.read(); print(len(d), d.upper())"], b"hello\nworld");
    assert_eq!(r.stdout, "11 HELLO\nWORLD\n", "{r:?}");
}

fn output_streams_live(t: Tier) {
    ensure_base();
    let mut child = cordon()
        .arg("run")
        .args(t.flags(&["--", "bash", "-c", "echo first; sleep 3; echo second"]))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "first");
    // Timed from the first line, not from the start (a guest boots first): buffered output
    // would bring both lines together at the end.
    let first = Instant::now();
    assert_eq!(lines.next().unwrap().unwrap(), "second");
    assert!(first.elapsed() > Duration::from_millis(2000), "the first line came only {:?} before the second", first.elapsed());
    assert!(child.wait().unwrap().success());
}

fn copy_puts_files_in_before_start(t: Tier) {
    let tok = token();
    let dir = std::env::temp_dir().join(format!("cordon-copy-{tok}"));
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("a.txt"), "alpha").unwrap();
    std::fs::write(dir.join("sub/b.txt"), "beta").unwrap();
    let file = dir.join("a.txt");
    // This runsc (Debian's 2022 build) refuses statx with AT_NO_AUTOMOUNT (EINVAL), which
    // coreutils' stat and ls -l use; find reads ownership with fstatat.
    let owner = match t {
        Tier::Ns | Tier::Vm => "stat -c %U one.txt",
        Tier::Gvisor => "find one.txt -printf '%u\\n'",
    };
    let (one, tree) = (format!("{}:/home/user/one.txt", file.display()), format!("{}:/home/user/tree", dir.display()));
    let r = sh(&t.flags(&["--copy", &one, "--copy", &tree]), &format!("cat one.txt; echo; cat tree/a.txt tree/sub/b.txt; echo; {owner}"));
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(r.stdout, "alpha\nalphabeta\nuser\n", "{r:?}");
}

fn background_processes_do_not_outlive_the_run(t: Tier) {
    let marker = format!("{}.{}", 300 + (std::process::id() % 100), 9);
    let r = sh(&t.flags(&[]), &format!("(sleep {marker} &) ; nohup sleep {marker} >/dev/null 2>&1 & echo started"));
    assert_eq!(r.code, 0, "{r:?}");
    assert!(host_processes_with(&format!("sleep {marker}")).is_empty(), "background process survived");
    assert_clean(r.id());
}

fn ctrl_c_tears_everything_down(t: Tier) {
    ensure_base();
    let marker = format!("{}.{}", 400 + (std::process::id() % 100), 1);
    let script = format!("sleep {marker} & echo ready; sleep {marker}");
    let mut child = cordon()
        .args(["run", "--json"])
        .args(t.flags(&["--", "bash", "-c", &script]))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    match t {
        Tier::Ns => assert!(wait_until(Duration::from_secs(20), || host_processes_with(&format!("sleep {marker}")).len() >= 2)),
        // gVisor's and a guest's processes are not host processes: the sandbox says when its
        // sleeps run.
        Tier::Gvisor | Tier::Vm => {
            let mut line = String::new();
            stdout.read_line(&mut line).unwrap();
            assert_eq!(line, "ready\n");
        }
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let rec: serde_json::Value = serde_json::from_str(rest.trim().lines().last().unwrap()).unwrap();
    assert_eq!(rec["reason"], "interrupted");
    assert!(host_processes_with(&format!("sleep {marker}")).is_empty());
    assert_clean(rec["sandbox_id"].as_str().unwrap());
}

fn a_killed_cordon_is_reaped_by_the_next_one(t: Tier) {
    ensure_base();
    if t == Tier::Gvisor {
        return a_killed_cordon_is_reaped_by_the_next_one_gvisor();
    }
    let marker = format!("{}.{}", 500 + (std::process::id() % 100), 5);
    let mut child = cordon()
        .args(["run", "--", "bash", "-c", &format!("sleep {marker}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(20), || !host_processes_with(&format!("sleep {marker}")).is_empty()));
    child.kill().unwrap(); // SIGKILL: no teardown code runs
    child.wait().unwrap();
    // Read in a loop: a process caught mid-exec briefly shows an empty command line.
    let mut orphan = Vec::new();
    wait_until(Duration::from_secs(5), || {
        orphan = host_processes_with(&format!("sleep {marker}"));
        !orphan.is_empty()
    });
    assert!(!orphan.is_empty(), "expected the orphaned sandbox to still be running");
    let cg = std::fs::read_to_string(format!("/proc/{}/cgroup", orphan[0].0)).unwrap();
    let id = cg
        .lines()
        .find_map(|l| l.split("/cordon/").nth(1))
        .map(|s| s.trim().to_string())
        .expect("the orphan is in a cordon cgroup");
    // The next invocation reaps it.
    let r = run(&[], &["true"]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        wait_until(Duration::from_secs(5), || host_processes_with(&format!("sleep {marker}")).is_empty()),
        "orphan not reaped"
    );
    assert_clean(&id);
}

/// The same under gVisor, whose processes are not host processes: the sandbox is found by the
/// cgroup of the runsc the killed cordon started, and its state must outlive the kill.
fn a_killed_cordon_is_reaped_by_the_next_one_gvisor() {
    let t = Tier::Gvisor;
    let mut child = cordon()
        .arg("run")
        .args(t.flags(&["--", "bash", "-c", "echo ready; sleep 300"]))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    let (_, id) = gvisor_sandbox_of(child.id());
    child.kill().unwrap(); // SIGKILL: no teardown code runs
    child.wait().unwrap();
    assert!(state_dir().join("gvisor/run").join(&id).exists(), "the killed run left no state to reap");
    let r = run(&t.flags(&[]), &["true"]);
    assert_eq!(r.code, 0, "{r:?}");
    assert_clean(&id);
}

#[test]
fn cordon_trace_prints_each_phase_in_order_and_only_when_asked() {
    let r = run_with_env(&[], &["true"], &[("CORDON_TRACE", "1")]);
    assert_eq!(r.code, 0, "{r:?}");
    let lines: Vec<&str> = r.stderr.lines().filter(|l| l.starts_with("cordon: trace ")).collect();
    let phases = [
        "flags, image and tier checked",
        "ns: run directory, writable layer and record",
        "ns: cgroups made",
        "ns: jailer answered (its exec included)",
        "sandbox created",
        "command ran through the agent",
        "stats read",
        "sandbox destroyed",
    ];
    assert_eq!(lines.len(), phases.len(), "{}", r.stderr);
    let (mut last, mut steps) = (0.0, 0.0);
    for (line, phase) in lines.iter().zip(phases) {
        assert!(line.ends_with(phase), "{line:?} should name {phase:?}");
        let f: Vec<&str> = line.split_whitespace().collect();
        let (at, step): (f64, f64) = (f[2].parse().unwrap(), f[4].parse().unwrap());
        assert!(at >= last, "phases out of order: {}", r.stderr);
        last = at;
        steps += step;
    }
    // Each step is the time since the one before, so the steps add up to the last mark.
    assert!((steps - last).abs() < 0.05 * phases.len() as f64, "{}", r.stderr);
    // The jailer's own steps, on its clock, come after the table.
    let jailer = r.stderr.lines().find(|l| l.starts_with("cordon: trace: the jailer")).unwrap_or_else(|| panic!("{}", r.stderr));
    assert!(jailer.contains("cgroups joined") && jailer.contains("agent exec'd"), "{jailer}");
    let plain = run(&[], &["true"]);
    assert_eq!(plain.code, 0, "{plain:?}");
    assert!(!plain.stderr.contains("cordon: trace"), "{}", plain.stderr);
}

#[test]
fn bad_input_gets_one_line_and_exit_2() {
    require_root!();
    let cases: &[&[&str]] = &[
        &["run", "--image", "no-such-image", "--", "true"],
        &["run", "--memory", "12XB", "--", "true"],
        &["run"],
        &["run", "--tier", "vm", "--memory", "64M", "--", "true"],
        &["run", "--tier", "warp", "--", "true"],
        &["run", "--cpus", "lots", "--", "true"],
        &["run", "--env", "NOEQUALS", "--", "true"],
        &["run", "--timeout", "soon", "--", "true"],
        &["run", "--workdir", "relative", "--", "true"],
        &["run", "--copy", "/no/such/file:/x", "--", "true"],
        &["image", "rm", "no-such-image"],
        &["image", "build", "no-such-recipe"],
    ];
    for args in cases {
        let out = cordon().args(*args).stdin(Stdio::null()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: not one line:\n{err}");
        assert!(err.starts_with("cordon: "), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A state dir sandbox users cannot pass through (`mktemp -d` makes 0700 ones) is refused up
/// front with the fix, instead of every sandbox failing on a raw mount error; nothing is made in it.
#[test]
fn a_state_dir_sandboxes_cannot_enter_is_refused_with_the_fix() {
    require_root!();
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("cordon-state-0700-{}", std::process::id()));
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let out = cordon().env("CORDON_HOME", &dir).args(["run", "--", "true"]).stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line:\n{err}");
    assert!(err.contains("chmod o+x") && err.contains("700"), "{err}");
    assert!(left.is_empty(), "the refused state dir was written to: {left:?}");
}

/// Two cordons with different state dirs, one sandbox each, at the same time: each sandbox gets
/// its own host uid range (the slot locks are host-wide), read from the sandbox's own uid_map.
#[test]
fn sandboxes_of_two_state_dirs_get_distinct_host_uid_ranges() {
    require_root!();
    ensure_base();
    use std::os::unix::fs::PermissionsExt;
    let alt = std::env::temp_dir().join(format!("cordon-state-alt-{}", std::process::id()));
    std::fs::create_dir_all(alt.join("images")).unwrap();
    std::fs::set_permissions(&alt, std::fs::Permissions::from_mode(0o711)).unwrap();
    // The second state dir uses the first one's `base` (read-only) instead of building its own.
    std::os::unix::fs::symlink(state_dir().join("images/base"), alt.join("images/base")).unwrap();
    let script = "cat /proc/self/uid_map; sleep 30";
    let spawn = |home: &std::path::Path| {
        cordon()
            .env("CORDON_HOME", home)
            .args(["run", "--", "sh", "-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first_line = |c: &mut std::process::Child| {
        let mut line = String::new();
        BufReader::new(c.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
        line.split_whitespace().nth(1).unwrap_or("").to_string()
    };
    let mut a = spawn(&state_dir());
    let ra = first_line(&mut a);
    let mut b = spawn(&alt);
    let rb = first_line(&mut b);
    for c in [&mut a, &mut b] {
        // SIGTERM: cordon run tears its sandbox down (a SIGKILL would leave it to be reaped).
        // SAFETY: kill with the pid of our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let _ = c.wait();
    }
    let _ = std::fs::remove_dir_all(&alt);
    assert!(!ra.is_empty() && !rb.is_empty(), "no uid_map read: {ra:?} {rb:?}");
    assert_ne!(ra, rb, "two live sandboxes of two state dirs share host uid range {ra}");
}

#[test]
fn a_missing_runsc_is_one_clear_line_and_no_fallback() {
    require_root!();
    ensure_base();
    let out = cordon()
        .env("CORDON_RUNSC", "/nonexistent/runsc")
        .args(["run", "--json", "--tier", "gvisor", "--", "true"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line:\n{err}");
    assert!(err.contains("CORDON_RUNSC=/nonexistent/runsc does not exist"), "{err}");
    // Nothing ran: no sandbox record on stdout, in particular not one from the ns tier.
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn image_commands() {
    require_root!();
    ensure_base();
    let ls = cordon().args(["image", "ls"]).output().unwrap();
    assert!(String::from_utf8_lossy(&ls.stdout).lines().any(|l| l.starts_with("base ")));
    // A second build is a cache hit: the same tree stays (the same inode), nothing is rebuilt.
    use std::os::unix::fs::MetadataExt;
    let tree = state_dir().join("images/base/rootfs");
    let ino = std::fs::metadata(&tree).unwrap().ino();
    let b = cordon().args(["image", "build", "base"]).output().unwrap();
    assert!(b.status.success());
    assert!(String::from_utf8_lossy(&b.stderr).contains("already built"));
    assert_eq!(std::fs::metadata(&tree).unwrap().ino(), ino, "the cached image was rebuilt");
}

#[test]
fn import_a_rootfs_tarball_and_run_it() {
    require_root!();
    let t = token();
    // A tiny rootfs made of the host's own dash and its libraries.
    let root = std::env::temp_dir().join(format!("cordon-mini-{t}"));
    for d in ["bin", "etc", "tmp"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let dash = "/bin/dash";
    std::fs::copy(dash, root.join("bin/sh")).unwrap();
    let ldd = std::process::Command::new("ldd").arg(dash).output().unwrap();
    for lib in String::from_utf8_lossy(&ldd.stdout).split_whitespace().filter(|w| w.starts_with('/')) {
        let dest = root.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(lib, dest).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/:/bin/sh\n").unwrap();
    std::fs::write(root.join("etc/message"), format!("hello-{t}\n")).unwrap();
    let tarball = std::env::temp_dir().join(format!("cordon-mini-{t}.tar"));
    assert!(std::process::Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&tarball).arg(".").status().unwrap().success());
    let name = format!("mini-{t}");
    let imp = cordon().args(["image", "import", &name]).arg(&tarball).output().unwrap();
    assert!(imp.status.success(), "{}", String::from_utf8_lossy(&imp.stderr));
    let out = cordon()
        .args(["run", "--image", &name, "--user", "root", "--", "/bin/sh", "-c", "read m < /etc/message; echo $m"])
        .output()
        .unwrap();
    let rm = cordon().args(["image", "rm", &name]).output().unwrap();
    let _ = std::fs::remove_dir_all(&root);
    let _ = std::fs::remove_file(&tarball);
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("hello-{t}\n"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(rm.status.success());
    assert!(!state_dir().join("images").join(&name).exists());
}

#[test]
fn doctor_reports_every_feature() {
    let out = cordon().arg("doctor").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for item in ["user namespaces", "overlayfs", "cgroups", "seccomp", "landlock", "kvm", "runsc", "qemu", "tier ns", "tier gvisor", "volumes", "injection"] {
        assert!(text.contains(item), "doctor does not mention {item}:\n{text}");
    }
    if is_root() {
        assert!(out.status.success(), "doctor found something missing on a CI machine:\n{text}");
        assert!(text.contains("tier ns      available"), "{text}");
        // The cost of a cgroup move, measured (root makes a cgroup for it).
        assert!(text.contains("ms per process moved into a sandbox's cgroup"), "{text}");
        // Which pause applies here: this kind of host freezes sandboxes in place.
        assert!(text.contains("pause") && text.contains("frozen in place"), "doctor does not say how sandboxes pause:\n{text}");
        if Tier::Gvisor.unavailable().is_none() {
            assert!(text.contains("tier gvisor  available"), "{text}");
            assert!(text.contains("platform "), "doctor names no gvisor platform:\n{text}");
        }
    }
}

/// The lines of doctor's closing tier summary.
fn tier_lines(text: &str) -> Vec<String> {
    text.lines().filter(|l| l.starts_with("tier ")).map(str::to_string).collect()
}

#[test]
fn doctor_prints_each_tier_once() {
    if !is_root() {
        return skip("doctor tier lines: needs root");
    }
    let out = cordon().arg("doctor").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let lines = tier_lines(&text);
    let names: Vec<&str> = lines.iter().map(|l| l.split_whitespace().nth(1).unwrap_or("")).collect();
    assert_eq!(names, ["ns", "gvisor", "vm"], "one line per tier, in order:\n{text}");
    assert_eq!(lines[0], "tier ns      available", "{text}");
    if Tier::Gvisor.unavailable().is_none() {
        assert_eq!(lines[1], "tier gvisor  available", "{text}");
    }
    if Tier::Vm.unavailable().is_none() {
        assert!(lines[2].starts_with("tier vm      available: "), "{text}");
    }

    // Without its VMM the vm tier is named once, unavailable, with the reason.
    let out = cordon().arg("doctor").env("CORDON_QEMU", "/nonexistent").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let vm: Vec<String> = tier_lines(&text).into_iter().filter(|l| l.starts_with("tier vm")).collect();
    assert_eq!(vm.len(), 1, "{text}");
    let reason = vm[0].strip_prefix("tier vm      NOT available: ").unwrap_or_else(|| panic!("vm not reported unavailable:\n{text}"));
    assert!(reason.contains("/nonexistent"), "the reason names the missing VMM: {reason}");
    assert_eq!(tier_lines(&text).len(), 3, "{text}");
}

/// A reader that goes away before the JSON record (`cordon run --json ... | head -c0`) loses
/// the record, and cordon still ends with the command's status instead of a panic.
#[test]
fn a_closed_stdout_loses_the_record_without_a_panic() {
    require_root!();
    ensure_base();
    let mut child = cordon().args(["run", "--json", "--", "true"]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
}
