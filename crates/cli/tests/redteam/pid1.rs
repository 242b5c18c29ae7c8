//! PID 1 of a sandbox (the agent) as a target, and what it is handed at create.
//!
//! - Sandbox root (one passwordless `sudo` away, or `--user root`) writes code into PID 1 through
//!   `/proc/1/mem` that opens PID 1's controlling terminal, prints on it and turns its echo off.
//!   `cordon run` runs under a real pseudo-terminal that the test holds, and the test checks that
//!   terminal afterwards: nothing printed, echo still on, and on the host PID 1 has no terminal and
//!   no descriptor of it.
//! - `/proc/1/exe` of the agent names no path of the host.
//! - Bad input at create is refused at the door with the allowed range; the agent's config no
//!   longer travels in one environment string, so large (allowed) variables work.
//! - With ptrace off, one command cannot read another's memory through `/proc/<pid>/mem`.

use crate::common;
use crate::common::*;
use serde_json::Value;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

crate::per_tier!(
    sandbox_root_can_neither_write_pid1_nor_reach_the_operator_terminal,
    pid1_exe_names_nothing_of_the_host,
    large_variables_reach_commands_and_bad_input_is_refused_at_the_door,
);

crate::tier_tests!(ns_only, Ns, one_command_cannot_read_another_commands_memory_without_ptrace);

/// Marker the injected code prints on PID 1's terminal.
const MARK: &str = "PID1-WAS-HERE";

/// Run as sandbox root: reports PID 1's terminal and whether its memory opens; when it does,
/// writes code at PID 1's next instruction that opens /dev/tty (PID 1's controlling terminal),
/// prints MARK on it, turns echo off (TCSETS) and exits.
const INJECT: &str = r#"
import json, os, struct, sys, time
res = {}
st = open("/proc/1/stat").read()
res["tty_nr"] = int(st.rsplit(")", 1)[1].split()[4])
try:
    fd = os.open("/proc/1/mem", os.O_RDWR)
except OSError as e:
    res["mem"] = e.errno
else:
    res["mem"] = 0
    pc = None
    for _ in range(200):
        f = open("/proc/1/syscall").read().split()
        if f[0] != "running":
            pc = int(f[-1], 16)
            break
        time.sleep(0.01)
    res["pc"] = pc
    if pc is not None:
        data = pc + 0x200
        path, msg, tio = data, data + 0x20, data + 0x60
        m = b"\r\nMARK\r\n".replace(b"MARK", sys.argv[1].encode())
        # termios: iflag ICRNL|IXON, oflag OPOST|ONLCR, cflag B38400|CS8|CREAD, lflag ISIG|ICANON
        # (no ECHO), line 0, cc zeroed.
        t = struct.pack("<IIIIB19s", 0o2400, 0o5, 0o277, 0o3, 0, b"\x03\x1c\x7f\x15\x04\x00\x01")
        q = lambda v: struct.pack("<Q", v)
        code = (b"\xb8\x02\x00\x00\x00" + b"\x48\xbf" + q(path) + b"\xbe\x02\x00\x00\x00" + b"\x31\xd2\x0f\x05"
                + b"\x49\x89\xc4"
                + b"\xb8\x01\x00\x00\x00" + b"\x4c\x89\xe7" + b"\x48\xbe" + q(msg) + b"\xba" + struct.pack("<I", len(m)) + b"\x0f\x05"
                + b"\xb8\x10\x00\x00\x00" + b"\x4c\x89\xe7" + b"\xbe\x02\x54\x00\x00" + b"\x48\xba" + q(tio) + b"\x0f\x05"
                + b"\xb8\xe7\x00\x00\x00\x31\xff\x0f\x05")
        os.pwrite(fd, b"/dev/tty\0", path)
        os.pwrite(fd, m, msg)
        os.pwrite(fd, t, tio)
        os.pwrite(fd, code, pc)
        res["injected"] = True
print(json.dumps(res), flush=True)
time.sleep(2)
"#;

/// A pseudo-terminal pair: the test holds the master as the operator's side.
fn openpty() -> (OwnedFd, OwnedFd) {
    // SAFETY: plain syscalls on descriptors this function owns; each result is checked.
    unsafe {
        let m = libc::open(c"/dev/ptmx".as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        assert!(m >= 0, "open /dev/ptmx: {}", std::io::Error::last_os_error());
        let mut unlock: libc::c_int = 0;
        assert_eq!(libc::ioctl(m, libc::TIOCSPTLCK, &mut unlock), 0);
        let s = libc::ioctl(m, libc::TIOCGPTPEER, libc::O_RDWR | libc::O_NOCTTY);
        assert!(s >= 0, "TIOCGPTPEER: {}", std::io::Error::last_os_error());
        (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s))
    }
}

fn termios_of(fd: &OwnedFd) -> libc::termios {
    // SAFETY: tcgetattr fills the zeroed struct for a terminal descriptor.
    unsafe {
        let mut t: libc::termios = std::mem::zeroed();
        assert_eq!(libc::tcgetattr(fd.as_raw_fd(), &mut t), 0, "tcgetattr");
        t
    }
}

fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(s.rsplit_once(") ")?.1.split_whitespace().map(String::from).collect())
}

/// Host pids of the processes that are PID 1 of a pid namespace below `ancestor`.
fn namespace_inits_below(ancestor: u32) -> Vec<u32> {
    let parent = |p: u32| stat_fields(p).and_then(|f| f.get(1)?.parse::<u32>().ok());
    host_processes()
        .into_iter()
        .filter(|&p| {
            let status = std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
            let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:")).unwrap_or("");
            let ids: Vec<&str> = nspid.split_whitespace().collect();
            if ids.len() < 2 || ids.last() != Some(&"1") {
                return false;
            }
            let mut cur = p;
            for _ in 0..16 {
                match parent(cur) {
                    Some(pp) if pp == ancestor => return true,
                    Some(pp) if pp > 1 => cur = pp,
                    _ => return false,
                }
            }
            false
        })
        .collect()
}

/// Runs `cordon run <flags> -- <cmd>` with a fresh pseudo-terminal as its controlling terminal
/// and stdio, as an operator's shell would. Returns what appeared on the terminal, the
/// terminal's settings afterwards, the exit code, and what `during` returned (called with
/// cordon's pid once `ready` appeared on the terminal).
fn run_on_a_terminal<T>(
    flags: &[&str],
    cmd: &[&str],
    ready: &str,
    during: impl FnOnce(u32) -> T,
) -> (String, libc::termios, libc::termios, i32, Option<T>) {
    ensure_base();
    let (master, slave) = openpty();
    let before = termios_of(&slave);
    assert!(before.c_lflag & libc::ECHO != 0, "a fresh terminal echoes");
    let mut c = cordon();
    c.arg("run").args(flags).arg("--").args(cmd);
    let (i, o, e) = (slave.try_clone().unwrap(), slave.try_clone().unwrap(), slave.try_clone().unwrap());
    c.stdin(Stdio::from(i)).stdout(Stdio::from(o)).stderr(Stdio::from(e));
    // SAFETY: setsid and TIOCSCTTY are async-signal-safe; they make the pty the controlling
    // terminal of a new session led by cordon, as a login shell's job would have.
    unsafe {
        c.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = c.spawn().expect("spawn cordon");
    let pid = child.id();
    // The operator's side: read everything, until the last holder of the slave is gone (EIO).
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let reader_fd = master.try_clone().unwrap();
    let reader = std::thread::spawn(move || {
        let mut f = std::fs::File::from(reader_fd);
        let mut buf = [0u8; 4096];
        while let Ok(n) = f.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let mut result = None;
    let mut during = Some(during);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(chunk) = rx.recv_timeout(Duration::from_millis(50)) {
            seen.extend_from_slice(&chunk);
        }
        if during.is_some() && String::from_utf8_lossy(&seen).contains(ready) {
            result = Some((during.take().unwrap())(pid));
        }
        if let Some(status) = child.try_wait().unwrap() {
            // Whatever is still buffered on the terminal.
            std::thread::sleep(Duration::from_millis(100));
            while let Ok(chunk) = rx.try_recv() {
                seen.extend_from_slice(&chunk);
            }
            let after = termios_of(&slave);
            drop(slave);
            drop(master);
            drop(reader);
            return (String::from_utf8_lossy(&seen).into_owned(), before, after, status.code().unwrap_or(-1), result);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("cordon run did not end within 60 s; terminal so far: {}", String::from_utf8_lossy(&seen));
        }
    }
}

/// What a host-side look at PID 1 found while the attack ran (ns tier: PID 1 is a host process).
#[derive(Debug)]
struct Pid1OnHost {
    pid: u32,
    tty_nr: u64,
    fds: Vec<String>,
}

fn look_at_pid1(cordon_pid: u32) -> Option<Pid1OnHost> {
    let pid = *namespace_inits_below(cordon_pid).first()?;
    let tty_nr = stat_fields(pid)?.get(4)?.parse().ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.flatten().filter_map(|e| std::fs::read_link(e.path()).ok()).map(|p| p.display().to_string()).collect())
        .unwrap_or_default();
    Some(Pid1OnHost { pid, tty_nr, fds })
}

fn sandbox_root_can_neither_write_pid1_nor_reach_the_operator_terminal(t: Tier) {
    let flags = t.flags(&["--user", "root", "--timeout", "40s"]);
    let (screen, before, after, code, host) =
        run_on_a_terminal(&flags, &["python3", "-c", INJECT, MARK], "\"tty_nr\"", look_at_pid1);
    eprintln!("terminal: {screen:?}\nexit {code}, host view of PID 1: {host:?}");
    // The harm, measured where it would be: the operator's terminal.
    assert!(!screen.contains(MARK), "code injected into PID 1 printed on the operator's terminal: {screen:?}");
    assert_eq!(after.c_lflag, before.c_lflag, "the operator's terminal modes changed (echo was {})", after.c_lflag & libc::ECHO != 0);
    assert!(after.c_lflag & libc::ECHO != 0, "echo is off on the operator's terminal");

    let line = screen.lines().find(|l| l.contains("\"tty_nr\"")).unwrap_or_else(|| panic!("no report on the terminal: {screen:?}"));
    let res: Value = serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("bad report {line:?}: {e}"));

    // The ways in: PID 1 holds no terminal, and its memory does not open for sandbox root.
    assert_eq!(res["tty_nr"], 0, "PID 1 has a controlling terminal inside: {res}");
    let mem = res["mem"].as_i64().unwrap();
    assert!(mem == libc::EACCES as i64 || mem == libc::EPERM as i64, "sandbox root opened /proc/1/mem read-write: {res}");
    assert!(res.get("injected").is_none(), "code was written into PID 1: {res}");
    assert_eq!(code, 0, "the sandbox's command did not end normally: {screen:?}");

    if t == Tier::Ns {
        // On the host PID 1 is a process of its own: no terminal, no descriptor of one.
        let host = host.flatten().expect("PID 1 of the sandbox seen on the host while the attack ran");
        assert_eq!(host.tty_nr, 0, "PID 1 (host pid {}) has the operator's terminal {:#x}", host.pid, host.tty_nr);
        assert!(
            !host.fds.iter().any(|f| f.starts_with("/dev/pts/") || f == "/dev/tty" || f.starts_with("/dev/tty")),
            "PID 1 holds a terminal descriptor: {:?}",
            host.fds
        );
    }
}

fn pid1_exe_names_nothing_of_the_host(t: Tier) {
    let host_exe = std::fs::canonicalize(env!("CARGO_BIN_EXE_cordon")).unwrap();
    let host_dir = host_exe.parent().unwrap().display().to_string();
    let r = run(
        &t.flags(&["--user", "root"]),
        &["python3", "-c", "import os\ntry: print(os.readlink('/proc/1/exe'))\nexcept OSError as e: print('errno', e.errno)\nprint(open('/proc/self/stat').read().split()[0])"],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let seen = r.stdout.lines().next().unwrap_or("").to_string();
    eprintln!("/proc/1/exe inside: {seen:?}");
    assert!(!seen.contains(&host_dir) && !seen.contains("cordon-before"), "/proc/1/exe names the host's {}: {seen:?}", host_exe.display());
    assert_clean(r.id());
    if t == Tier::Ns {
        // What the kernel itself says on the host, where the link is always readable.
        let (_, _, _, _, link) = run_on_a_terminal(&t.flags(&[]), &["sh", "-c", "echo up; sleep 2"], "up", |pid| {
            namespace_inits_below(pid).first().and_then(|p| std::fs::read_link(format!("/proc/{p}/exe")).ok())
        });
        let link = link.flatten().expect("PID 1 seen on the host");
        assert_eq!(link, std::path::PathBuf::from("/"), "PID 1's exe on the host names {}", link.display());
    }
}

fn large_variables_reach_commands_and_bad_input_is_refused_at_the_door(t: Tier) {
    // A pids value no cgroup takes: refused with the range, exit 2, one line.
    let r = run(&t.flags(&["--pids", "4294967295"]), &["true"]);
    assert_eq!(r.code, 2, "--pids 4294967295: {r:?}");
    assert!(r.stderr.contains("between 8 and 65536"), "no range in the error: {}", r.stderr);
    assert_eq!(r.stderr.trim().lines().count(), 1, "not one line: {}", r.stderr);

    // One variable longer than execve takes cannot even reach the CLI (its own argv has the
    // same bound); the API refuses it below.

    // Six variables of 100 KB each: each fits execve, together they are far more than one
    // environment string holds, so they reach commands only if the config does not travel in one.
    let vars: Vec<String> = (0..6).map(|i| format!("V{i}={}", char::from(b'a' + i as u8).to_string().repeat(100 << 10))).collect();
    let mut flags = t.flags(&[]);
    for v in &vars {
        flags.push("-e");
        flags.push(v);
    }
    let r = run(&flags, &["python3", "-c", "import os\nprint(sum(len(os.environ['V%d' % i]) for i in range(6)))"]);
    assert_eq!(r.code, 0, "six 100 KB variables: {:?}", (r.code, &r.stderr, r.reason()));
    assert_eq!(r.stdout.trim(), (6 * (100 << 10)).to_string());
    assert_clean(r.id());

    api_refuses_bad_variables(t);
}

/// `cordon serve` on a loopback port of its own, stopped on drop.
struct Serve(std::process::Child, u16);

impl Drop for Serve {
    fn drop(&mut self) {
        // SAFETY: SIGTERM to our own child, then reap it.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn serve(key: &str) -> Serve {
    ensure_base();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = cordon()
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--api-key", key])
        // Its sandboxes end with it, as the tests expect of a stopped server.
        .env("CORDON_SHUTDOWN", "destroy")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn cordon serve");
    assert!(
        wait_until(Duration::from_secs(20), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()),
        "cordon serve did not listen"
    );
    Serve(child, port)
}

/// One HTTP/1.1 request; returns the status and the body.
fn http(port: u16, method: &str, path: &str, key: &str, body: &str) -> (u16, String) {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nX-API-KEY: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

fn api_refuses_bad_variables(t: Tier) {
    let key = format!("k{}", token());
    let srv = serve(&key);
    let create = |env: Value| {
        let body = serde_json::json!({"templateID": "base", "tier": t.as_str(), "timeout": 30, "envVars": env}).to_string();
        http(srv.1, "POST", "/sandboxes", &key, &body)
    };
    let kill_if_made = |body: &str| {
        if let Some(id) = serde_json::from_str::<Value>(body).ok().and_then(|v| v["sandboxID"].as_str().map(String::from)) {
            http(srv.1, "DELETE", &format!("/sandboxes/{id}"), &key, "");
        }
    };
    let (status, body) = create(serde_json::json!({"A\u{0}B": "1"}));
    kill_if_made(&body);
    assert_eq!(status, 400, "an envVars key with a NUL: {status} {body}");
    assert!(body.contains("envVars"), "{body}");
    let (status, body) = create(serde_json::json!({"BIG": "x".repeat(200 << 10)}));
    kill_if_made(&body);
    assert_eq!(status, 400, "a 200 KB envVars value: {status} {body}");
    assert!(body.contains("131072"), "{body}");
}

/// Sandbox-wide with ptrace off: a second command, as the same user and as root, tries to read
/// the memory of a process a first command left running, which holds a secret.
fn one_command_cannot_read_another_commands_memory_without_ptrace(t: Tier) {
    let _ = t;
    // Written for the MCP front end, where each call is its own command of the agent.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut child = tokio::process::Command::from(cordon())
            .args(["mcp"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn cordon mcp");
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take().unwrap();
        use rmcp::ServiceExt;
        let client = ().serve((stdout, stdin)).await.expect("MCP handshake");
        let call = |cmd: String| {
            let client = &client;
            async move {
                let args = serde_json::json!({"command": cmd}).as_object().unwrap().clone();
                let r = client
                    .call_tool(rmcp::model::CallToolRequestParams::new("run_command".to_string()).with_arguments(args))
                    .await
                    .expect("run_command");
                r.structured_content.clone().unwrap_or(Value::Null)
            }
        };
        let holder = "setsid -f python3 -c \"import os,time; s=('SECRET'+'-'*3+'4242').encode()*100; open('/tmp/holder','w').write(str(os.getpid())); time.sleep(120)\" </dev/null >/dev/null 2>&1; sleep 0.5; cat /tmp/holder";
        let first = call(holder.to_string()).await;
        eprintln!("holder: {first}");
        let pid: u32 = first["stdout"].as_str().unwrap_or("").trim().parse().expect("holder pid");
        let reader = format!(
            "python3 -c \"\nimport os,re\npid={pid}\ntry:\n  m=open('/proc/%d/mem'%pid,'rb')\n  for l in open('/proc/%d/maps'%pid):\n    a,b=[int(x,16) for x in l.split()[0].split('-')]\n    if 'rw' not in l.split()[1]: continue\n    try:\n      m.seek(a); d=m.read(b-a)\n    except OSError: continue\n    if b'SECRET---4242' in d: print('LEAKED'); break\n  else: print('notfound')\nexcept OSError as e: print('errno', e.errno)\n\""
        );
        let as_user = call(reader.clone()).await;
        let as_root = call(format!("sudo {reader}")).await;
        // Ordinary work over other commands' processes still runs: ps sees the holder.
        let ps = call(format!("ps -o pid=,comm= -p {pid}")).await;
        client.cancel().await.ok();
        let _ = child.wait().await;
        eprintln!("as user: {as_user}\nas root: {as_root}\nps: {ps}");
        for (who, r) in [("the same user", &as_user), ("sandbox root", &as_root)] {
            let out = r["stdout"].as_str().unwrap_or("");
            assert!(!out.contains("LEAKED"), "{who} read another command's memory: {r}");
            assert!(out.contains("errno 13") || out.contains("errno 1"), "{who}: the open was not refused: {r}");
        }
        assert!(ps["stdout"].as_str().unwrap_or("").contains("python3"), "ps no longer sees other commands: {ps}");
    });
}
