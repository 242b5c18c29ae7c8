//! Host-wide kernel budgets a sandbox must not drain for everyone (issue 27, items 3 and 4).
//!
//! Each attack holds as much of one budget as the kernel gives a sandbox (inotify instances,
//! AIO events, PTYs, POSIX message-queue bytes; as the sandbox's user and as its root), and
//! while it holds them the test measures, in its own process on the host, what the host and a
//! second live sandbox still get: the same as they got before the attack began (a baseline the
//! test takes itself). The TCP attack fills loopback connections in a `--memory 64M` sandbox
//! and compares the host-wide TCP memory of `/proc/net/sockstat` with its baseline.

use crate::common;
use crate::common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Stdio};

crate::per_tier!(
    inotify_instances_held_by_one_sandbox_leave_the_host_and_others_theirs,
    aio_events_held_by_one_sandbox_leave_the_host_and_others_theirs,
    ptys_held_by_one_sandbox_leave_the_host_and_others_theirs,
    message_queue_bytes_held_by_one_sandbox_leave_the_host_and_others_theirs,
    loopback_tcp_buffers_stay_within_the_sandboxs_memory_cap,
);

/// What every script starts with: ctypes for the raw calls.
const PRELUDE: &str = "import ctypes, json, os, sys, socket, time\nl = ctypes.CDLL(None, use_errno=True)\n";

/// A sandbox that took what it could of a budget and holds it until released.
struct Held {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    /// The script's report: `held` (how much it got) and `errno` (why it stopped, 0 at its cap).
    report: Value,
}

impl Held {
    /// Runs `script` (which takes the budget, prints one JSON line and then waits for a line on
    /// stdin) and waits for its report.
    fn start(t: Tier, flags: &[&str], script: &str) -> Held {
        ensure_base();
        let mut child = cordon()
            .arg("run")
            .arg("--json")
            .args(t.flags(flags))
            .args(["--", "python3", "-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn cordon");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let report: Value = serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("attacker's report {line:?}: {e}"));
        Held { child, out, report }
    }

    fn held(&self) -> u64 {
        self.report["held"].as_u64().unwrap_or_else(|| panic!("no count in {}", self.report))
    }

    /// Lets the script exit; returns the run's JSON record.
    fn release(mut self) -> Value {
        self.child.stdin.take().unwrap().write_all(b"\n").unwrap();
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.out, &mut rest).unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the attacker's sandbox failed: {status} {rest}");
        let record: Value = serde_json::from_str(rest.trim().lines().last().unwrap_or("")).unwrap_or(Value::Null);
        assert_clean(record["sandbox_id"].as_str().unwrap_or(""));
        record
    }
}

/// One line of JSON printed by a short-lived sandbox's script.
fn probe_in_sandbox(t: Tier, script: &str) -> Value {
    let r = run(&t.flags(&[]), &["python3", "-c", script]);
    assert_eq!(r.code, 0, "probe sandbox failed: {r:?}");
    serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("probe's report {:?}: {e}", r.stdout))
}

/// The attack's shape for one budget: fill it from one sandbox, as each of its users, and check
/// that the host's and a second sandbox's share did not change while the first one held its own.
fn exhaust_and_compare(t: Tier, fill: &str, second: &str, host: impl Fn() -> Value) -> Vec<u64> {
    let mut held = Vec::new();
    for user in [&[][..], &["--user", "root"][..]] {
        let (host_before, second_before) = (host(), probe_in_sandbox(t, second));
        let a = Held::start(t, user, fill);
        eprintln!("{} {user:?}: the attacker holds {}", t.as_str(), a.report);
        let (host_during, second_during) = (host(), probe_in_sandbox(t, second));
        held.push(a.held());
        a.release();
        assert_eq!(host_during, host_before, "{user:?}: the host lost its share while a sandbox held the budget");
        assert_eq!(second_during, second_before, "{user:?}: a second sandbox lost its share while another held the budget");
    }
    held
}

fn errno() -> i64 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0) as i64
}

fn read_sysctl(name: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/sys/{name}")).unwrap().split_whitespace().next().unwrap().parse().unwrap()
}

/// inotify instances are counted per user up the user-namespace chain, to the namespace's
/// creator on the host: a sandbox must count against its own host uid, never host root's.
fn inotify_instances_held_by_one_sandbox_leave_the_host_and_others_theirs(t: Tier) {
    let fill = format!(
        "{PRELUDE}fds, err = [], 0\n\
         while len(fds) < 1024:\n    fd = l.inotify_init1(0)\n    if fd < 0:\n        err = ctypes.get_errno(); break\n    fds.append(fd)\n\
         print(json.dumps({{'held': len(fds), 'errno': err}}), flush=True)\nsys.stdin.readline()\n"
    );
    let second = format!(
        "{PRELUDE}r = [l.inotify_init1(0) for _ in range(8)]\nprint(json.dumps({{'ok': sum(x >= 0 for x in r)}}))\n"
    );
    let host = || {
        // SAFETY: inotify_init1 takes flags only; each descriptor is closed right after.
        let fds: Vec<i32> = (0..8).map(|_| unsafe { libc::inotify_init1(libc::IN_CLOEXEC) }).collect();
        let e = errno();
        let ok = fds.iter().filter(|f| **f >= 0).count();
        for fd in fds.into_iter().filter(|f| *f >= 0) {
            // SAFETY: closing a descriptor this closure opened.
            unsafe { libc::close(fd) };
        }
        serde_json::json!({ "ok": ok, "errno": if ok == 8 { 0 } else { e } })
    };
    let held = exhaust_and_compare(t, &fill, &second, host);
    if t == Tier::Ns {
        // The sandbox still got a working share: the host's per-user limit, as its own.
        let max = read_sysctl("fs/inotify/max_user_instances");
        assert!(held.iter().all(|h| *h >= max / 2 && *h <= max), "held {held:?} of {max}");
    }
}

const IO_SETUP: i64 = 206;
const IO_DESTROY: i64 = 207;

/// `fs.aio-max-nr` is one counter for the whole host: native AIO must not be the ns tier's to
/// take (ENOSYS, as on a kernel without it), and gVisor's own AIO must not reach the host's.
fn aio_events_held_by_one_sandbox_leave_the_host_and_others_theirs(t: Tier) {
    let fill = format!(
        "{PRELUDE}ctxs, err = [], 0\n\
         while len(ctxs) < 64:\n    c = ctypes.c_ulong(0)\n    if l.syscall({IO_SETUP}, 1024, ctypes.byref(c)) < 0:\n        err = ctypes.get_errno(); break\n    ctxs.append(c)\n\
         print(json.dumps({{'held': len(ctxs), 'errno': err}}), flush=True)\nsys.stdin.readline()\n"
    );
    let second = format!(
        "{PRELUDE}c = ctypes.c_ulong(0)\nr = l.syscall({IO_SETUP}, 128, ctypes.byref(c))\nprint(json.dumps({{'r': r, 'errno': ctypes.get_errno() if r < 0 else 0}}))\n"
    );
    let aio_nr = read_sysctl("fs/aio-nr");
    let max = read_sysctl("fs/aio-max-nr");
    let host = || {
        let mut ctx: libc::c_ulong = 0;
        // SAFETY: io_setup writes the new context id into `ctx`, which outlives the call.
        let r = unsafe { libc::syscall(IO_SETUP, 128, &mut ctx as *mut libc::c_ulong) };
        let e = if r < 0 { errno() } else { 0 };
        if r == 0 {
            // SAFETY: destroying the context just created.
            unsafe { libc::syscall(IO_DESTROY, ctx) };
        }
        // The host-wide count, rounded to an eighth of the maximum: other host activity may
        // move it a little, one sandbox draining it moves it across the whole range.
        serde_json::json!({ "r": r, "errno": e, "aio_nr_eighths": read_sysctl("fs/aio-nr") * 8 / max })
    };
    assert!(aio_nr < max / 8, "the host already uses {aio_nr} of {max} AIO events: cannot measure");
    let held = exhaust_and_compare(t, &fill, &second, host);
    if t == Tier::Ns {
        assert_eq!(held, [0, 0], "native AIO must answer ENOSYS on the ns tier");
    }
}

/// PTYs come from one host-wide count (`kernel.pty.max`, less the host's reserve): each
/// sandbox's devpts instance must have its own maximum.
fn ptys_held_by_one_sandbox_leave_the_host_and_others_theirs(t: Tier) {
    let fill = "import json, os, sys\nfds, err = [], 0\n\
                while len(fds) < 4000:\n    try:\n        fds.append(os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY))\n    except OSError as e:\n        err = e.errno; break\n\
                print(json.dumps({'held': len(fds), 'errno': err}), flush=True)\nsys.stdin.readline()\n";
    let second = "import json, os\nok = 0\nfor _ in range(8):\n    try:\n        os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY); ok += 1\n    except OSError:\n        pass\nprint(json.dumps({'ok': ok}))\n";
    let host = || {
        let files: Vec<_> = (0..8).map(|_| std::fs::OpenOptions::new().read(true).write(true).open("/dev/ptmx")).collect();
        serde_json::json!({ "ok": files.iter().filter(|f| f.is_ok()).count() })
    };
    let held = exhaust_and_compare(t, fill, second, host);
    if t == Tier::Ns {
        assert!(held.iter().all(|h| *h > 8 && *h <= 256), "held {held:?} PTYs");
    }
}

/// POSIX message-queue bytes (RLIMIT_MSGQUEUE) are counted per user up the user-namespace chain,
/// like inotify: a sandbox's queues must count against its own host uid. On the ns tier Landlock
/// refuses to open a queue (the mqueue filesystem is outside the sandbox's root: EACCES), but
/// the kernel has created it, and charged its bytes, by then: each EACCES is a queue held.
fn message_queue_bytes_held_by_one_sandbox_leave_the_host_and_others_theirs(t: Tier) {
    let attr = "class A(ctypes.Structure):\n    _fields_ = [('f', ctypes.c_long), ('maxmsg', ctypes.c_long), ('msgsize', ctypes.c_long), ('cur', ctypes.c_long), ('pad', ctypes.c_long * 4)]\n\
                a = A(0, 10, 8192, 0)\n";
    let fill = format!(
        "{PRELUDE}{attr}qs, err = [], 0\n\
         while len(qs) < 64:\n    q = l.mq_open(('/cordon-%d' % len(qs)).encode(), 0o102, 0o600, ctypes.byref(a))\n    if q < 0 and ctypes.get_errno() != 13:\n        err = ctypes.get_errno(); break\n    qs.append(q)\n\
         print(json.dumps({{'held': len(qs), 'errno': err}}), flush=True)\nsys.stdin.readline()\n"
    );
    let second = format!(
        "{PRELUDE}{attr}q = l.mq_open(b'/probe', 0o102, 0o600, ctypes.byref(a))\nprint(json.dumps({{'ok': q >= 0, 'errno': 0 if q >= 0 else ctypes.get_errno()}}))\n"
    );
    let host = || {
        let name = std::ffi::CString::new(format!("/cordon-budgets-{}", token())).unwrap();
        // SAFETY: a zeroed mq_attr is valid; then the sizes are set.
        let mut attr: libc::mq_attr = unsafe { std::mem::zeroed() };
        attr.mq_maxmsg = 10;
        attr.mq_msgsize = 8192;
        // SAFETY: a valid name and attribute struct; the queue is closed and unlinked right after.
        let q = unsafe { libc::mq_open(name.as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o600 as libc::mode_t, &attr as *const libc::mq_attr) };
        let e = if q < 0 { errno() } else { 0 };
        if q >= 0 {
            // SAFETY: closing and unlinking the queue just made.
            unsafe {
                libc::mq_close(q);
                libc::mq_unlink(name.as_ptr());
            }
        }
        serde_json::json!({ "ok": q >= 0, "errno": e })
    };
    let held = exhaust_and_compare(t, &fill, &second, host);
    if t == Tier::Ns {
        assert!(held.iter().all(|h| *h >= 5), "the sandbox got no working share of message queues: {held:?}");
    }
}

/// Host-wide TCP memory in bytes (`TCP: ... mem N`, in pages, in /proc/net/sockstat: global
/// across network namespaces).
fn host_tcp_mem() -> u64 {
    let s = std::fs::read_to_string("/proc/net/sockstat").unwrap();
    let line = s.lines().find(|l| l.starts_with("TCP:")).unwrap();
    let mut it = line.split_whitespace();
    while let Some(w) = it.next() {
        if w == "mem" {
            return it.next().unwrap().parse::<u64>().unwrap() * 4096;
        }
    }
    panic!("no TCP mem in {line}");
}

/// A `--memory 64M` sandbox opens loopback connections whose reader never reads and fills
/// them: the kernel memory those buffers hold must be charged to the sandbox and stop at its
/// cap, however much the host-wide TCP budget could still give.
fn loopback_tcp_buffers_stay_within_the_sandboxs_memory_cap(t: Tier) {
    const CAP: u64 = 64 << 20;
    // Other work on the host may open or close connections while the test runs.
    const ALLOWANCE: u64 = 32 << 20;
    // gVisor's cgroup holds its own kernel too (`--memory` plus 64 MiB, see the gvisor crate).
    let cap = if t == Tier::Gvisor { CAP + (64 << 20) } else { CAP };
    // 64 connections of up to a few MiB each: without a bound several times the cap, yet well
    // below the host's TCP pressure threshold (tcp_mem), so the attack harms nobody when it
    // succeeds.
    let fill = format!(
        "{PRELUDE}srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(128)\n\
         pairs, err, sent = [], 0, 0\n\
         for _ in range(64):\n    c = socket.socket()\n    try:\n        c.connect(srv.getsockname()); s, _ = srv.accept()\n    except OSError as e:\n        err = e.errno; break\n    c.setblocking(False); pairs.append((c, s))\n\
         buf = b'x' * 65536\nend = time.time() + 30\nmore = True\n\
         while more and time.time() < end:\n    more = False\n    for c, _ in pairs:\n        try:\n            sent += c.send(buf); more = True\n        except BlockingIOError:\n            pass\n        except OSError as e:\n            err = e.errno\n\
         time.sleep(1)\n\
         print(json.dumps({{'held': len(pairs), 'sent': sent, 'errno': err}}), flush=True)\nsys.stdin.readline()\n"
    );
    // gVisor's own netstack would keep the buffers inside its memory; with an egress policy
    // its sockets are the host kernel's (runsc's host networking), which is the case to bound.
    let flags: &[&str] = if t == Tier::Gvisor { &["--memory", "64M", "--allow-net", "203.0.113.7:9"] } else { &["--memory", "64M"] };
    let before = host_tcp_mem();
    let a = Held::start(t, flags, &fill);
    let during = host_tcp_mem();
    let sent = a.report["sent"].as_u64().unwrap();
    eprintln!("{}: {} connections, {} MiB written; host TCP memory {} -> {} MiB", t.as_str(), a.held(), sent >> 20, before >> 20, during >> 20);
    let record = a.release();
    assert_eq!(record["reason"].as_str().unwrap_or(""), "exit", "{record}");
    let grew = during.saturating_sub(before);
    assert!(
        grew <= cap + ALLOWANCE,
        "host TCP memory grew by {} MiB while the sandbox's cap is {} MiB (+{} MiB allowance)",
        grew >> 20,
        cap >> 20,
        ALLOWANCE >> 20
    );
}
