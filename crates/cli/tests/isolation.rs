//! Attacks from inside a real sandbox: each test tries an escape or a peek at the host and
//! checks both that it failed and that the host is untouched. Every test runs on each tier
//! (`ns::*`, `gvisor::*`), those that hold in a guest also as `vm::*`; where a tier answers
//! differently the expectation says so.

mod common;

use common::*;
use std::io::BufRead;
use std::net::TcpListener;
use std::time::Duration;

per_tier!(
    host_secrets_are_neither_readable_nor_findable,
    nothing_of_the_host_is_mounted_and_no_host_env_leaks,
    writes_to_root_vanish_after_the_run,
    the_image_cannot_be_modified_from_inside,
    no_network_to_the_internet_or_the_hosts_loopback,
    sandbox_processes_run_as_unprivileged_host_uids,
    concurrent_sandboxes_cannot_see_each_other,
);

on_vm!(
    host_secrets_are_neither_readable_nor_findable,
    nothing_of_the_host_is_mounted_and_no_host_env_leaks,
    writes_to_root_vanish_after_the_run,
    the_image_cannot_be_modified_from_inside,
    the_image_disk_cannot_be_modified_from_a_guest,
    no_network_to_the_internet_or_the_hosts_loopback,
);

/// Host processes in the cgroups of sandbox `id`, with their real uid and command line.
fn sandbox_host_processes(id: &str) -> Vec<(u32, u32, String)> {
    host_processes()
        .into_iter()
        .filter(|p| std::fs::read_to_string(format!("/proc/{p}/cgroup")).is_ok_and(|c| c.contains(&format!("/cordon/{id}"))))
        .filter_map(|p| {
            let status = std::fs::read_to_string(format!("/proc/{p}/status")).ok()?;
            let uid = status.lines().find(|l| l.starts_with("Uid:"))?.split_whitespace().nth(1)?.parse().ok()?;
            let cmd = String::from_utf8_lossy(&std::fs::read(format!("/proc/{p}/cmdline")).ok()?).replace('\0', " ");
            Some((p, uid, cmd))
        })
        .collect()
}

fn host_secrets_are_neither_readable_nor_findable(tier: Tier) {
    let t = token();
    let secret = format!("s3cret-{t}");
    let paths = [format!("/root/cordon-secret-{t}"), format!("/etc/cordon-secret-{t}"), format!("/home/cordon-secret-{t}")];
    for p in &paths {
        std::fs::write(p, &secret).unwrap();
    }
    let script = format!(
        "for p in {}; do cat $p 2>/dev/null && echo LEAK; done; \
         find / -xdev -name 'cordon-secret-{t}*' 2>/dev/null; \
         grep -rs '{secret}' /etc /root /home /tmp /var 2>/dev/null; echo done",
        paths.join(" ")
    );
    let r = sh(&tier.flags(&["--user", "root"]), &script);
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.trim_end().ends_with("done"), "{r:?}");
    assert!(!r.stdout.contains("LEAK") && !r.stdout.contains(&secret) && !r.stdout.contains("cordon-secret"), "{r:?}");
    assert_clean(r.id());
}

fn nothing_of_the_host_is_mounted_and_no_host_env_leaks(tier: Tier) {
    let r = cordon()
        .env("CORDON_TEST_LEAK", "leaked-value")
        .arg("run")
        .args(tier.flags(&["--user", "root", "--", "bash", "-c", "cat /proc/mounts; echo ===; env; echo ===; ls /sys | wc -l"]))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{out}");
    let mut parts = out.split("===\n");
    let mounts = parts.next().unwrap();
    let env = parts.next().unwrap();
    let sys_entries = parts.next().unwrap();
    for line in mounts.lines() {
        let fstype = line.split_whitespace().nth(2).unwrap_or("");
        // Under gVisor the root and the read-only agent binary are served by its file proxy
        // (9p); the host's overlay and the binary stay outside the sandbox's kernel.
        let allowed: &[&str] = match tier {
            Tier::Ns => &["overlay", "proc", "tmpfs", "devpts", "devtmpfs"],
            Tier::Gvisor => &["9p", "proc", "tmpfs", "devpts"],
            // The guest's own kernel: its devtmpfs and sysfs show the guest's devices, never
            // the host's; the root is an overlay of the guest's disks.
            Tier::Vm => &["overlay", "proc", "tmpfs", "devpts", "devtmpfs", "sysfs"],
        };
        if fstype == "9p" {
            let target = line.split_whitespace().nth(1).unwrap();
            // /tmp and /dev/shm are directories of the sandbox's own writable layer (its
            // private tmpfs), bound there so that `--disk` is one budget.
            assert!(["/", "/tmp", "/dev/shm", cordon_gvisor::bundle::AGENT_PATH].contains(&target), "unexpected 9p mount: {line}");
            assert!(["/", "/tmp", "/dev/shm"].contains(&target) || line.split_whitespace().nth(3).is_some_and(|o| o.split(',').any(|o| o == "ro")), "agent binary writable: {line}");
        }
        assert!(allowed.contains(&fstype), "unexpected mount inside: {line}");
        if fstype == "devtmpfs" && tier != Tier::Vm {
            // Host device nodes appear only as the harmless set in /dev, or as /dev/null masking
            // a /proc file.
            let target = line.split_whitespace().nth(1).unwrap();
            let ok_dev = target.strip_prefix("/dev/").is_some_and(|d| ["null", "zero", "full", "random", "urandom", "tty"].contains(&d));
            let masked_proc = target.starts_with("/proc/");
            assert!(ok_dev || masked_proc, "host device bound: {line}");
        }
    }
    assert!(!env.contains("CORDON_TEST_LEAK") && !env.contains("leaked-value"), "host env leaked:\n{env}");
    assert!(!env.contains("CORDON_AGENT"), "agent config leaked into the command env:\n{env}");
    if tier != Tier::Vm {
        assert_eq!(sys_entries.trim(), "0", "host /sys is visible");
    }
}

fn writes_to_root_vanish_after_the_run(tier: Tier) {
    let t = token();
    // `test -e` rather than ls: this runsc refuses the statx flags of coreutils' ls (EINVAL).
    let r = sh(&tier.flags(&["--user", "root"]), &format!("echo x > /marker-{t} && echo x > /etc/marker-{t} && test -e /marker-{t}"));
    assert_eq!(r.code, 0, "{r:?}");
    let image = state_dir().join("images/base/rootfs");
    assert!(!image.join(format!("marker-{t}")).exists(), "the write reached the image");
    let r2 = sh(&tier.flags(&["--user", "root"]), &format!("test ! -e /marker-{t} && test ! -e /etc/marker-{t}"));
    assert_eq!(r2.code, 0, "a write survived into the next sandbox: {r2:?}");
    assert_clean(r.id());
    assert_clean(r2.id());
}

fn the_image_cannot_be_modified_from_inside(tier: Tier) {
    // Even root of the sandbox writes only to its own layer; the shared image stays as it was.
    let before = std::fs::read(state_dir().join("images/base/rootfs/etc/passwd")).unwrap();
    let r = sh(&tier.flags(&["--user", "root"]), "echo 'evil::0:0::/:/bin/sh' >> /etc/passwd && rm -rf /usr/bin/python3* && echo ok");
    assert_eq!(r.code, 0, "{r:?}");
    let after = std::fs::read(state_dir().join("images/base/rootfs/etc/passwd")).unwrap();
    assert_eq!(before, after);
    assert!(state_dir().join("images/base/rootfs/usr/bin/python3").exists());
}

/// The vm tier's copy of the image, the ext4 disk every guest of it shares: unchanged, byte for
/// byte, by a guest whose root rewrites /etc/passwd and deletes python.
fn the_image_disk_cannot_be_modified_from_a_guest(tier: Tier) {
    let disks = || -> Vec<(u64, std::path::PathBuf)> {
        let mut v: Vec<_> = std::fs::read_dir(state_dir().join("vm/disks"))
            .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("base-"))).collect())
            .unwrap_or_default();
        v.sort();
        v.into_iter().map(|p| (file_digest(&p), p)).collect()
    };
    // The first guest of the image makes its disk.
    assert_eq!(sh(&tier.flags(&[]), "true").code, 0);
    let before = disks();
    assert!(!before.is_empty(), "no disk of the base image under {}", state_dir().join("vm/disks").display());
    let r = sh(&tier.flags(&["--user", "root"]), "echo 'evil::0:0::/:/bin/sh' >> /etc/passwd && rm -rf /usr/bin/python3* && sync && echo ok");
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(disks(), before, "the shared image disk changed");
    assert_clean(r.id());
}

fn no_network_to_the_internet_or_the_hosts_loopback(tier: Tier) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let script = format!(
        r#"
import socket
for host, port in [("1.1.1.1", 53), ("1.1.1.1", 443), ("127.0.0.1", {port}), ("10.0.2.2", 80)]:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        print("CONNECTED", host, port)
    except OSError as e:
        print("blocked", host, port, e.errno)
try:
    socket.getaddrinfo("pypi.org", 443)
    print("RESOLVED")
except OSError:
    print("no dns")
print(open("/proc/net/dev").read())
"#
    );
    let r = run(&tier.flags(&[]), &["python3", "-c", &script]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(!r.stdout.contains("CONNECTED") && !r.stdout.contains("RESOLVED"), "{r:?}");
    assert_eq!(r.stdout.matches("blocked").count(), 4, "{r:?}");
    let ifaces: Vec<&str> = r.stdout.lines().filter(|l| l.contains(':') && l.contains("  ")).collect();
    assert!(ifaces.iter().all(|l| l.trim_start().starts_with("lo:")), "interfaces other than lo: {ifaces:?}");
    assert!(listener.accept().is_err(), "the host listener got a connection from the sandbox");
    assert_clean(r.id());
}

fn sandbox_processes_run_as_unprivileged_host_uids(tier: Tier) {
    if tier == Tier::Gvisor {
        return sandbox_code_runs_as_nobody_under_gvisor();
    }
    let marker = format!("{}.{}", 100 + (std::process::id() % 100), 7);
    let mut child = cordon()
        .args(["run", "--user", "root", "--", "bash", "-c", &format!("sleep {marker} & sleep {marker}; wait")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    ensure_base();
    let found = wait_until(Duration::from_secs(20), || host_processes_with(&format!("sleep {marker}")).len() >= 2);
    let procs = host_processes_with(&format!("sleep {marker}"));
    let _ = child.kill();
    let _ = child.wait();
    assert!(found, "sandbox processes not seen on the host");
    for (pid, uid) in procs {
        assert!(uid >= 1_000_000_000, "process {pid} of sandbox root runs as host uid {uid}");
    }
}

/// Under gVisor, sandbox code (even sandbox root's) runs only inside gVisor's kernel, the
/// `runsc-sandbox` process and its ptrace stubs, all host `nobody` in runsc's own user
/// namespace; only runsc itself, its file proxy (the gofer) and cordon's own holder of the
/// agent's link (`cordon __gvisor-link`, which runs no sandbox code: it relays the link's bytes,
/// as the server's thread did before it) are host root.
fn sandbox_code_runs_as_nobody_under_gvisor() {
    ensure_base();
    let mut child = cordon()
        .args(["run", "--json", "--tier", "gvisor", "--user", "root", "--", "bash", "-c", "echo ready; sleep 30 & sleep 30; wait"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    let (runsc, id) = gvisor_sandbox_of(child.id());
    let procs = sandbox_host_processes(&id);
    let _ = child.kill();
    let _ = child.wait();
    let r = run(&Tier::Gvisor.flags(&[]), &["true"]); // reaps the killed run
    assert_eq!(r.code, 0, "{r:?}");
    assert!(procs.iter().any(|(_, _, c)| c.starts_with("runsc-sandbox")), "no sentry among {procs:?}");
    assert!(procs.len() >= 4, "expected runsc, gofer, sentry and stubs: {procs:?}");
    for (pid, uid, cmd) in &procs {
        let trusted = cmd.starts_with("runsc-gofer") || *pid == runsc || cmd.split(' ').nth(1) == Some("__gvisor-link");
        assert!(trusted || *uid == 65534, "process {pid} ({cmd}) of the sandbox runs as host uid {uid}");
        assert!(!cmd.contains("sleep"), "sandbox code visible as a host process: {cmd}");
    }
    assert_clean(&id);
}

fn concurrent_sandboxes_cannot_see_each_other(tier: Tier) {
    if tier == Tier::Gvisor {
        return concurrent_gvisor_sandboxes_cannot_see_each_other();
    }
    let t = token();
    let marker = format!("{}.{}", 200 + (std::process::id() % 100), 3);
    let mut a = cordon()
        .args(["run", "--", "bash", "-c", &format!("echo {t} > /tmp/mark-{t}; echo {t} > /home/user/mark-{t}; exec sleep {marker}")])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    ensure_base();
    // Wait for A's `sleep` itself (its bash execs into it: until then the cmdline is bash's).
    let mut found = None;
    wait_until(Duration::from_secs(20), || {
        found = host_sleeps(&marker).into_iter().next();
        found.is_some()
    });
    let (a_pid, a_uid) = found.expect("sandbox A's process not seen on the host");
    // The token reaches B only through its environment, so B's own command line (visible to
    // its ps) never contains the names searched for.
    let r = sh(
        &tier.flags(&["--user", "root", "--env", &format!("T={t}")]),
        &format!("ps -eo pid,args; echo ===; cat /proc/{a_pid}/cmdline 2>&1; find / -xdev -name \"mark-$T\" 2>/dev/null; kill -9 {a_pid} 2>&1; echo end"),
    );
    let a_alive = host_processes_with(&format!("sleep {marker}")).iter().any(|(p, _)| *p == a_pid);
    let _ = a.kill();
    let _ = a.wait();
    assert_eq!(r.code, 0, "{r:?}");
    assert!(!r.stdout.contains(&format!("sleep {marker}")), "B sees A's process: {r:?}");
    assert!(!r.stdout.contains(&format!("mark-{t}")), "B sees A's files: {r:?}");
    assert!(a_alive, "B could kill A's process");
    // Distinct uid ranges: B's root is not A's user.
    let b_procs_uid_base = a_uid - 1000;
    assert_ne!(b_procs_uid_base, 0);
}

/// Under gVisor each sandbox has a kernel of its own: B sees none of A's processes or files, and
/// cannot signal A even by A's host pids.
fn concurrent_gvisor_sandboxes_cannot_see_each_other() {
    ensure_base();
    let t = token();
    let mut a = cordon()
        .args(["run", "--tier", "gvisor", "--", "bash", "-c", &format!("echo {t} > /tmp/mark-{t}; echo {t} > /home/user/mark-{t}; echo ready; exec sleep 77.{}", std::process::id() % 100)])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(a.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    let a_host_pids: Vec<String> = host_processes()
        .into_iter()
        .filter(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.contains("runsc")))
        .map(|p| p.to_string())
        .collect();
    let r = sh(
        &Tier::Gvisor.flags(&["--user", "root", "--env", &format!("T={t}")]),
        &format!(
            "ps -eo pid,args; echo ===; find / -xdev -name \"mark-$T\" 2>/dev/null; for p in {}; do kill -9 $p 2>/dev/null; done; echo end",
            a_host_pids.join(" ")
        ),
    );
    let a_alive = a.try_wait().unwrap().is_none();
    let _ = a.kill();
    let _ = a.wait();
    assert_eq!(r.code, 0, "{r:?}");
    assert!(!r.stdout.contains("sleep 77"), "B sees A's process: {r:?}");
    assert!(!r.stdout.contains(&format!("mark-{t}")), "B sees A's files: {r:?}");
    assert!(a_alive, "B could kill A");
    // Reap the killed A.
    assert_eq!(run(&Tier::Gvisor.flags(&[]), &["true"]).code, 0);
}
