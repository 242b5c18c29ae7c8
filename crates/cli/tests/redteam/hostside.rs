//! What a sandbox can make cordon's host-side parts do for it: the syscall audit trail under a
//! flood of denied calls (`cordon run` and `cordon serve`), and the gateway's DNS asked for
//! record types that would carry data out to whoever sees an allowed zone's queries. Each attack
//! is measured where the harm would be: cordon's own RSS and CPU from /proc, the audit answer's
//! size, the test internet's DNS query log.

use crate::common;
use crate::common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::process::Stdio;
use std::time::{Duration, Instant};

#[path = "../egress/testnet.rs"]
mod testnet;

/// How long the flood runs inside the sandbox.
const FLOOD_SECS: f64 = 8.0;
/// Growth of cordon's peak RSS over its baseline that the flood may cause.
const RSS_ALLOWANCE: u64 = 16 << 20;
/// Share of one core cordon may spend while the sandbox floods (over the flood's wall time).
const CPU_ALLOWANCE: f64 = 0.10;
/// The largest audit answer a flood may produce.
const AUDIT_ALLOWANCE: usize = 64 << 10;

/// Eight processes of four threads each calling syscall numbers the filter denies (each number
/// new, so an unbounded trail grows an entry per call), for FLOOD_SECS; the host takes its
/// baseline while the sandbox sleeps after "ready". Ends with "done CALLS NOT_EPERM CPU_SECONDS"
/// (the CPU of every process of the flood).
const FLOOD: &str = r#"
import ctypes, os, resource, sys, threading, time
l = ctypes.CDLL(None, use_errno=True)
print("ready", flush=True)
time.sleep(2)
stop = time.time() + float(sys.argv[1])
def flood(base, out, k):
    nr, n, b = base, 0, 0
    while time.time() < stop:
        for _ in range(50):
            if l.syscall(nr) != -1 or ctypes.get_errno() != 1:
                b += 1
            nr += 1
        n += 50
    out[k] = (n, b)
pipes = []
for p in range(8):
    r, w = os.pipe()
    if os.fork() == 0:
        out = [(0, 0)] * 4
        ts = [threading.Thread(target=flood, args=(1000 + (p * 4 + k) * 10_000_000, out, k)) for k in range(4)]
        for t in ts: t.start()
        for t in ts: t.join()
        os.write(w, ("%d %d" % (sum(x[0] for x in out), sum(x[1] for x in out))).encode())
        os._exit(0)
    os.close(w); pipes.append(r)
calls = bad = 0
for r in pipes:
    n, b = map(int, os.read(r, 100).split())
    calls += n; bad += b
while True:
    try: os.wait()
    except ChildProcessError: break
ru, rc = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print("done", calls, bad, ru.ru_utime + ru.ru_stime + rc.ru_utime + rc.ru_stime, flush=True)
"#;

/// Resident and peak resident bytes of a host process.
fn rss(pid: u32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = |key: &str| -> u64 {
        let state = s.lines().find(|l| l.starts_with("State:")).unwrap_or("State: gone");
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("cordon (pid {pid}) has no {key} any more: it ended early ({state})"))
            * 1024
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

/// Resets the peak resident size (VmHWM) of a host process to its current size.
fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap_or_else(|e| panic!("reset cordon's peak RSS (pid {pid}): {e}"));
}

/// CPU seconds (user + system, every thread) of a host process.
fn cpu(pid: u32) -> f64 {
    common::stat_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// What one flood cost the cordon process `pid`.
#[derive(Debug)]
struct Cost {
    rss_base: u64,
    hwm: u64,
    cpu: f64,
    wall: f64,
    calls: u64,
    not_eperm: u64,
    sandbox_cpu: f64,
}

impl Cost {
    fn check(&self, what: &str) {
        eprintln!(
            "{what}: {} denied calls in {:.1}s, sandbox CPU {:.2}s, cordon CPU {:.2}s ({:.1}% of a core), cordon RSS {} MiB -> peak {} MiB",
            self.calls,
            self.wall,
            self.sandbox_cpu,
            self.cpu,
            100.0 * self.cpu / self.wall,
            self.rss_base >> 20,
            self.hwm >> 20
        );
        assert!(self.calls > 1000, "{what}: the flood barely ran: {self:?}");
        // What bounds cordon's CPU whatever a denial costs on this host: denials are answered
        // no faster than the supervisor's pace (a quarter over it allowed for timing).
        let paced = cordon_jail::audit::BURST + cordon_jail::audit::RATE * self.wall * 1.25;
        assert!(
            self.calls as f64 <= paced,
            "{what}: {} denials answered in {:.1}s, more than the pace allows ({paced:.0}): {self:?}",
            self.calls,
            self.wall
        );
        assert_eq!(self.not_eperm, 0, "{what}: every denied call must still fail with EPERM: {self:?}");
        assert!(
            self.hwm <= self.rss_base + RSS_ALLOWANCE,
            "{what}: cordon grew from {} to a peak of {} MiB under the flood (allowance {} MiB): {self:?}",
            self.rss_base >> 20,
            self.hwm >> 20,
            RSS_ALLOWANCE >> 20
        );
        self.check_cpu(what);
    }

    /// cordon's CPU over the flood stays within CPU_ALLOWANCE of a core.
    fn check_cpu(&self, what: &str) {
        assert!(
            self.cpu <= CPU_ALLOWANCE * self.wall,
            "{what}: cordon spent {:.2}s of CPU in {:.1}s of flood (allowance {:.0}% of a core): {self:?}",
            self.cpu,
            self.wall,
            CPU_ALLOWANCE * 100.0
        );
    }
}

/// Follows the flood's stdout lines: baseline of `pid` after "ready", the cost at "done".
fn measure(pid: u32, lines: &mut impl Iterator<Item = String>) -> Cost {
    let ready = lines.find(|l| l == "ready").expect("the flood never started");
    drop(ready);
    // The sandbox sleeps 2 s after "ready"; let cordon settle, then take the baseline.
    std::thread::sleep(Duration::from_millis(1000));
    // The peak from here on is the flood's: what the start cost (a vm tier's first VM of a kind
    // saves its template snapshot in this process) is not.
    reset_peak(pid);
    let (rss_base, _) = rss(pid);
    let (cpu0, t0) = (cpu(pid), Instant::now());
    let done = lines.find(|l| l.starts_with("done ")).expect("the flood never finished");
    let (cpu1, wall) = (cpu(pid), t0.elapsed().as_secs_f64());
    let (_, hwm) = rss(pid);
    let f: Vec<&str> = done.split_whitespace().collect();
    Cost { rss_base, hwm, cpu: cpu1 - cpu0, wall, calls: f[1].parse().unwrap(), not_eperm: f[2].parse().unwrap(), sandbox_cpu: f[3].parse().unwrap() }
}

/// The audit's entries: each kind counted, bounded in number, together counting every call.
fn check_entries(denied: &[Value], calls: u64, what: &str) {
    let total: u64 = denied.iter().map(|d| d["count"].as_u64().unwrap()).sum();
    assert!(total >= calls, "{what}: the audit counted {total} denials of the {calls} the sandbox made");
    assert!(denied.iter().all(|d| d["pids"].as_array().unwrap().len() <= 16), "{what}: unbounded pid samples");
}

#[test]
fn a_flood_of_denied_syscalls_costs_cordon_run_bounded_memory_and_cpu() {
    crate::require_root!();
    ensure_base();
    let mut child = cordon()
        .args(["run", "--json", "--audit", "--", "python3", "-c", FLOOD, &FLOOD_SECS.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stderr = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        s
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines().map(Result::unwrap);
    let cost = measure(pid, &mut lines);
    let rest: Vec<String> = lines.collect();
    child.wait().unwrap();
    let stderr = err.join().unwrap();
    let record = rest.last().expect("no JSON record");
    let rec: Value = serde_json::from_str(record).unwrap();
    let denied = rec["denied_syscalls"].as_array().unwrap();
    eprintln!("cordon run: audit record {} bytes, {} entries; --audit printed {} bytes", record.len(), denied.len(), stderr.len());
    cost.check("cordon run");
    assert!(record.len() <= AUDIT_ALLOWANCE, "the audit record is {} bytes (allowance {AUDIT_ALLOWANCE})", record.len());
    assert!(stderr.len() <= AUDIT_ALLOWANCE, "--audit printed {} bytes (allowance {AUDIT_ALLOWANCE})", stderr.len());
    check_entries(denied, cost.calls, "cordon run");
    assert_clean(rec["sandbox_id"].as_str().unwrap());
}

/// A free loopback port for `cordon serve`.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One HTTP/1.1 request to the server on loopback; returns status and body.
fn http(port: u16, method: &str, path: &str, key: &str, body: &str) -> (u16, String) {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out);
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunk(rest) } else { rest.to_string() };
    (status, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// Kills `cordon serve` when the test ends, however it ends.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling the child this test started.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

#[test]
fn a_flood_of_denied_syscalls_costs_cordon_serve_bounded_memory_and_cpu() {
    crate::require_root!();
    ensure_base();
    let (port, key) = (free_port(), format!("e2b_{}", "7".repeat(40)));
    let server = Server(
        cordon()
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--api-key", &key])
            // Its sandboxes end with it, as the tests expect of a stopped server.
            .env("CORDON_SHUTDOWN", "destroy")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = server.0.id();
    assert!(
        wait_until(Duration::from_secs(20), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()),
        "cordon serve did not start listening"
    );
    let (status, body) = http(port, "POST", "/sandboxes", &key, r#"{"templateID":"base","timeout":120}"#);
    assert_eq!(status, 201, "{body}");
    let id = serde_json::from_str::<Value>(&body).unwrap()["sandboxID"].as_str().unwrap().to_string();
    let socket = state_dir().join("run").join(&id).join("agent.sock");

    // The flood runs through envd like any command; its stdout comes back over the socket.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let runner = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let client = cordon_envd::EnvdClient::new(socket);
            let req = cordon_envd::process::StartRequest {
                process: Some(cordon_envd::process::ProcessConfig {
                    cmd: "python3".into(),
                    args: vec!["-c".into(), FLOOD.into(), FLOOD_SECS.to_string()],
                    ..Default::default()
                }),
                ..Default::default()
            };
            let mut stream = client.start(req, Some("user"), None).await.unwrap();
            let mut buf = String::new();
            while let Some(ev) = stream.next().await {
                if let cordon_envd::process::ProcessEvent::Data(cordon_envd::process::DataEvent::Stdout(d)) = ev.unwrap() {
                    buf.push_str(&String::from_utf8_lossy(&d));
                    while let Some((line, rest)) = buf.split_once('\n') {
                        let _ = tx.send(line.to_string());
                        buf = rest.to_string();
                    }
                }
            }
        });
    });
    let cost = measure(pid, &mut rx.iter());
    runner.join().unwrap();

    let (status, audit) = http(port, "GET", &format!("/sandboxes/{id}/audit"), &key, "");
    assert_eq!(status, 200, "{audit}");
    let (_, hwm_after_audit) = rss(pid);
    let a: Value = serde_json::from_str(&audit).unwrap();
    let denied = a["deniedSyscalls"].as_array().unwrap();
    eprintln!("cordon serve: audit answer {} bytes, {} entries; peak RSS after it {} MiB", audit.len(), denied.len(), hwm_after_audit >> 20);
    cost.check("cordon serve");
    assert!(audit.len() <= AUDIT_ALLOWANCE, "the audit answer is {} bytes (allowance {AUDIT_ALLOWANCE})", audit.len());
    assert!(
        hwm_after_audit <= cost.rss_base + RSS_ALLOWANCE,
        "answering the audit took cordon serve to a peak of {} MiB from {} MiB",
        hwm_after_audit >> 20,
        cost.rss_base >> 20
    );
    check_entries(denied, cost.calls, "cordon serve");

    let (status, body) = http(port, "DELETE", &format!("/sandboxes/{id}"), &key, "");
    assert_eq!(status, 204, "{body}");
    let (rss_after, _) = rss(pid);
    assert!(rss_after <= cost.rss_base + RSS_ALLOWANCE, "cordon serve holds {} MiB after the sandbox is gone (baseline {} MiB)", rss_after >> 20, cost.rss_base >> 20);
    assert_clean(&id);
    drop(server);
}

// DNS under an allowed wildcard: only the types programs need reach upstream.


/// Asks the gateway for NAME with query type TYPE over PROTO; prints "TYPE rcode R answers N".
const PY_QTYPE: &str = r#"
import socket, struct, sys
name, qtype, proto = sys.argv[1], int(sys.argv[2]), sys.argv[3]
q = struct.pack('!HHHHHH', 0x4242, 0x0100, 1, 0, 0, 0)
q += b''.join(bytes([len(l)]) + l.encode() for l in name.split('.')) + b'\0' + struct.pack('!HH', qtype, 1)
try:
    if proto == 'udp':
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)
        s.sendto(q, ('10.0.2.1', 53)); a = s.recv(4096)
    else:
        s = socket.create_connection(('10.0.2.1', 53), timeout=5)
        s.sendall(struct.pack('!H', len(q)) + q); n = struct.unpack('!H', s.recv(2))[0]; a = s.recv(n)
    print(qtype, proto, 'rcode', a[3] & 15, 'answers', struct.unpack('!H', a[6:8])[0])
except Exception as e:
    print(qtype, proto, 'failed', type(e).__name__)
"#;

fn dns_types_that_carry_data_never_reach_the_allowed_zones_server(tier: Tier) {
    use testnet::*;
    let inet = internet();
    let _shared = QUIET.read().unwrap_or_else(|e| e.into_inner());
    let tag = format!("x{}", std::process::id());
    // TXT, NULL, MX, ANY, PTR, SRV, CAA and a private-use type: each a way to carry bytes in a
    // name out and bytes back in an answer. A (1) and AAAA (28) must still be asked.
    let carriers = [16u16, 10, 15, 255, 12, 33, 257, 65280];
    let mut script = String::from("cat > /tmp/q.py <<'EOF'\n");
    script.push_str(PY_QTYPE);
    script.push_str("EOF\n");
    for t in carriers.iter().chain(&[1, 28]) {
        for proto in ["udp", "tcp"] {
            script.push_str(&format!("python3 /tmp/q.py {tag}-t{t}-{proto}.wild.test {t} {proto}\n"));
        }
    }
    let mark = inet.mark();
    let mut flags = tier.flags(&["--dns-upstream", DNS, "--timeout", "90s", "--allow-net", "*.wild.test"]);
    flags.push("--audit");
    let r = sh(&flags, &script);
    std::thread::sleep(Duration::from_millis(300));
    let seen = inet.since(&mark);
    assert_eq!(r.code, 0, "{r:?}");
    for proto in ["udp", "tcp"] {
        // The control: an address question under the wildcard is asked upstream (NXDOMAIN there).
        for t in [1, 28] {
            assert!(seen.contains(&format!("dns {tag}-t{t}-{proto}.wild.test type={t}")), "the A/AAAA control never reached the zone's server ({proto}): {seen}");
        }
        for t in carriers {
            let q = format!("{tag}-t{t}-{proto}.wild.test");
            assert!(!seen.contains(&q), "a type-{t} question over {proto} reached the zone's server: {seen}");
            assert!(r.stdout.contains(&format!("{t} {proto} rcode 0 answers 0")), "type {t} over {proto} gets an empty NOERROR here: {r:?}");
            let blocked = r.record["blocked_connections"].as_array().cloned().unwrap_or_default();
            assert!(
                blocked.iter().any(|b| b["proto"] == "dns" && b["name"] == q.as_str() && b["reason"].as_str().unwrap_or("").contains("never forwarded")),
                "the refusal of type {t} over {proto} is not in the audit: {blocked:?}"
            );
        }
    }
    assert_clean(r.id());
}

// The egress forwarder under a destination that never reads and a DNS flood with a slow
// upstream: what it holds for the sandbox must stay bounded.

crate::per_tier!(
    dns_types_that_carry_data_never_reach_the_allowed_zones_server,
    connections_to_a_host_that_never_reads_hold_bounded_forwarder_memory,
    a_dns_flood_with_a_silent_upstream_holds_bounded_forwarder_memory,
    a_udp_flood_at_blocked_ports_stays_off_the_operators_terminal_and_within_budget,
    the_forwarders_cpu_for_a_sandbox_counts_against_its_cpus,
);

// In a microVM the same floods leave the guest's kernel as virtio-net frames that cordon reads
// from a socket pair, and guest root may write any frame it likes. The CPU cases are left to ns
// and gvisor: a guest under TCG at a tenth of a core spends the flood's window booting.
crate::on_vm!(
    dns_types_that_carry_data_never_reach_the_allowed_zones_server,
    connections_to_a_host_that_never_reads_hold_bounded_forwarder_memory,
    a_dns_flood_with_a_silent_upstream_holds_bounded_forwarder_memory,
    a_guest_writing_raw_frames_holds_bounded_forwarder_memory_and_its_malformed_frames_are_counted,
);

/// Growth of cordon's peak RSS over its baseline that an egress flood may cause.
const NET_RSS_ALLOWANCE: u64 = 16 << 20;

/// A helper process in the test internet's namespace, killed when dropped. The helpers listen
/// on fixed ports and the floods that use them measure cordon's CPU, so one runs at a time.
struct InNet {
    child: std::process::Child,
    _alone: std::sync::MutexGuard<'static, ()>,
}

static ONE_HELPER: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Drop for InNet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a python script inside the test internet and waits for its first stdout line.
fn in_net(script: &str) -> InNet {
    let alone = ONE_HELPER.lock().unwrap_or_else(|e| e.into_inner());
    let ns = &testnet::internet().ns;
    let mut c = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "python3", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(c.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "listening", "helper in the test internet did not start");
    InNet { child: c, _alone: alone }
}

/// A TCP server on OTHER_V4:9001 that accepts and never reads.
const SINK: &str = r#"
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('198.51.100.11', 9001)); s.listen(64)
print('listening', flush=True)
held = []
while True:
    c, _ = s.accept(); held.append(c)
"#;

/// A DNS "server" on OTHER_V4:5300 that takes every datagram and never answers.
const SILENT_DNS: &str = r#"
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(('198.51.100.11', 5300))
print('listening', flush=True)
while True:
    s.recv(65536)
"#;

/// What every egress flood runs: `run(k)` (the flood's own body, one per thread and indexed
/// by `k`, counting what it sent in `sent[k]`) in eight threads for the seconds given as the
/// first argument, after "ready" and two seconds for the host's baseline; it ends with
/// "done SENT 0 CPU_SECONDS".
fn eight_threads(run: &str) -> String {
    format!(
        r#"import resource, socket, struct, sys, threading, time
print("ready", flush=True)
time.sleep(2)
stop, sent = time.time() + float(sys.argv[1]), [0] * 8
{run}
ts = [threading.Thread(target=run, args=(k,)) for k in range(8)]
for t in ts: t.start()
for t in ts: t.join()
ru = resource.getrusage(resource.RUSAGE_SELF)
print("done", sum(sent), 0, ru.ru_utime + ru.ru_stime, flush=True)
"#
    )
}

/// Eight connections to the sink, each sending as fast as it may for SECS.
const PUSH: &str = r#"def run(k):
    c = socket.create_connection(('198.51.100.11', 9001), timeout=3)
    chunk = b'x' * 65536
    while time.time() < stop:
        try:
            sent[k] += c.send(chunk)
        except socket.timeout:
            pass
"#;

/// DNS questions for allowed (long) names, from eight sockets, as fast as python sends them.
const DNS_FLOOD: &str = r#"def run(k):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    i = 0
    while time.time() < stop:
        name = 'q%d-%d-%s.%s.%s.wild.test' % (k, i, 'a' * 50, 'b' * 60, 'c' * 60)
        q = struct.pack('!HHHHHH', i & 0xffff, 0x0100, 1, 0, 0, 0)
        q += b''.join(bytes([len(l)]) + l.encode() for l in name.split('.')) + b'\0' + struct.pack('!HH', 1, 1)
        s.sendto(q, ('10.0.2.1', 53)); i += 1
    sent[k] = i
"#;

/// Datagrams to ports nothing serves (the gateway's 9999, the test internet's 5300+ that no rule
/// opens), from eight sockets, as fast as python sends them.
const UDP_FLOOD: &str = r#"def run(k):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    i = 0
    while time.time() < stop:
        for dst in (('10.0.2.1', 9999), ('198.51.100.11', 5300 + k)):
            try:
                s.sendto(b'x' * 64, dst); i += 1
            except OSError:
                pass
    sent[k] = i
"#;

/// Lines `cordon run` may print on stderr whatever the sandbox does (it prints none of its own
/// for a clean run; a few for the host's own conditions).
const STDERR_ALLOWANCE: usize = 4;

/// Runs `script` in a sandbox with `flags` and measures what its flood cost `cordon run`: its
/// RSS, and what reached the operator's terminal (cordon's stderr). Returns the cost and the
/// run's JSON record.
fn egress_flood(tier: Tier, flags: &[&str], script: &str, what: &str) -> (Cost, Value) {
    ensure_base();
    let _shared = testnet::QUIET.read().unwrap_or_else(|e| e.into_inner());
    // A guest's kernel and agent live in its memory cap: the vm tier's smallest is 128M.
    let memory = if matches!(tier, Tier::Vm) { "192M" } else { "64M" };
    let mut all = tier.flags(&["--json", "--timeout", "60s", "--memory", memory]);
    all.extend_from_slice(flags);
    let mut child = cordon()
        .arg("run")
        .args(&all)
        .args(["--", "python3", "-c", script, "10"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stderr = child.stderr.take().unwrap();
    let err_lines = std::thread::spawn(move || BufReader::new(stderr).lines().map_while(Result::ok).collect::<Vec<String>>());
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines().map(Result::unwrap);
    let cost = measure(pid, &mut lines);
    let rest: Vec<String> = lines.collect();
    child.wait().unwrap();
    let err_lines = err_lines.join().unwrap();
    for l in err_lines.iter().take(10) {
        eprintln!("cordon stderr: {l}");
    }
    assert!(
        err_lines.len() <= STDERR_ALLOWANCE,
        "{what} ({}): the sandbox's packets put {} lines on the operator's terminal",
        tier.as_str(),
        err_lines.len()
    );
    eprintln!(
        "{what} ({}): {} units in {:.1}s, sandbox CPU {:.2}s, cordon CPU {:.2}s, cordon RSS {} MiB -> peak {} MiB",
        tier.as_str(),
        cost.calls,
        cost.wall,
        cost.sandbox_cpu,
        cost.cpu,
        cost.rss_base >> 20,
        cost.hwm >> 20
    );
    assert!(cost.calls > 0, "{what}: the flood sent nothing: {cost:?}");
    assert!(
        cost.hwm <= cost.rss_base + NET_RSS_ALLOWANCE,
        "{what} ({}): cordon grew from {} MiB to a peak of {} MiB (allowance {} MiB): {cost:?}",
        tier.as_str(),
        cost.rss_base >> 20,
        cost.hwm >> 20,
        NET_RSS_ALLOWANCE >> 20
    );
    let rec: Value = serde_json::from_str(rest.last().expect("no JSON record")).unwrap();
    assert_clean(rec["sandbox_id"].as_str().unwrap());
    (cost, rec)
}

fn connections_to_a_host_that_never_reads_hold_bounded_forwarder_memory(tier: Tier) {
    let _sink = in_net(SINK);
    let dns = testnet::DNS;
    egress_flood(tier, &["--dns-upstream", dns, "--allow-net", "198.51.100.11:9001"], &eight_threads(PUSH), "8 connections to a sink that never reads");
}

fn a_dns_flood_with_a_silent_upstream_holds_bounded_forwarder_memory(tier: Tier) {
    let _silent = in_net(SILENT_DNS);
    egress_flood(tier, &["--dns-upstream", "198.51.100.11:5300", "--allow-net", "*.wild.test"], &eight_threads(DNS_FLOOD), "a DNS flood with a silent upstream");
}

/// Every datagram is dropped by the forwarder (only DNS to the gateway is UDP it serves). Each
/// used to print a warning of the forwarder's TCP/IP stack on `cordon run`'s stderr, a line per
/// packet on the operator's terminal; and under `--cpus 0.05` the forwarder's CPU for the flood
/// must stay within the budget cordon's other host-side parts have (CPU_ALLOWANCE of a core).
fn a_udp_flood_at_blocked_ports_stays_off_the_operators_terminal_and_within_budget(tier: Tier) {
    let what = "a UDP flood at blocked ports";
    egress_flood(tier, &["--dns-upstream", testnet::DNS, "--cpus", "0.05", "--allow-net", "198.51.100.11:9001"], &eight_threads(UDP_FLOOD), what)
        .0
        .check_cpu(&format!("{what} ({})", tier.as_str()));
}

/// The CPU quota of the sandbox in the test below.
const CHARGED_CPUS: f64 = 0.1;

/// Eight connections pushing to a destination that reads everything: each segment costs the
/// forwarder's user-space stack more than it costs the sandbox to send it (measured: cordon
/// spent more CPU than the sandbox did), so a forwarder outside the sandbox's caps gave it
/// more than `--cpus`. Its CPU must count against them: what the sandbox's processes spent on
/// the host (its cgroup's count for the whole run, startup included) and what cordon spent
/// over the flood stay together within the quota over the flood's wall time (a quarter over
/// it, and a quarter of a second, allowed for the scheduler's accounting periods).
fn the_forwarders_cpu_for_a_sandbox_counts_against_its_cpus(tier: Tier) {
    let _drain = in_net(&testnet::drain_server(9002));
    let what = "8 connections pushing to a destination that reads everything";
    let cpus = CHARGED_CPUS.to_string();
    let script = eight_threads(&PUSH.replace("9001", "9002"));
    let (cost, rec) = egress_flood(tier, &["--dns-upstream", testnet::DNS, "--cpus", &cpus, "--allow-net", "198.51.100.11:9002"], &script, what);
    let sandbox = rec["cpu_time_ms"].as_f64().expect("the record has the sandbox's CPU time") / 1000.0;
    let quota = CHARGED_CPUS * cost.wall;
    assert!(
        cost.cpu + sandbox <= quota * 1.25 + 0.25,
        "{what} ({}): the sandbox spent {sandbox:.2}s and cordon {:.2}s of CPU in {:.1}s under --cpus {cpus} (quota {quota:.2}s): {cost:?}",
        tier.as_str(),
        cost.cpu,
        cost.wall
    );
}

/// Guest root's raw frames on `eth0`, from eight AF_PACKET sockets: garbage under an IPv4
/// ethertype, a SYN to a new blocked port every time (each a new audit key), an ARP request for
/// a new address (each answered by the host's Ethernet layer), and frames of an ethertype the
/// link does not carry.
const FRAME_FLOOD: &str = r#"mac = bytes.fromhex(open('/sys/class/net/eth0/address').read().strip().replace(':', ''))
gw = bytes.fromhex('02c0d0000001')
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); probe.connect(('10.0.2.1', 53))
me = socket.inet_aton(probe.getsockname()[0])
def csum(b):
    if len(b) % 2: b += b'\0'
    t = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    while t >> 16: t = (t & 0xffff) + (t >> 16)
    return ~t & 0xffff
def syn(port, k):
    dst = socket.inet_aton('198.51.100.11')
    tcp = struct.pack('!HHIIBBHHH', 40000 + k, port, 1, 0, 5 << 4, 2, 65535, 0, 0)
    tcp = tcp[:16] + struct.pack('!H', csum(me + dst + struct.pack('!BBH', 0, 6, len(tcp)) + tcp)) + tcp[18:]
    ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0, me, dst)
    return gw + mac + b'\x08\x00' + ip[:10] + struct.pack('!H', csum(ip)) + ip[12:] + tcp
def arp(n):
    return b'\xff' * 6 + mac + b'\x08\x06' + bytes([0, 1, 8, 0, 6, 4, 0, 1]) + mac + me + b'\0' * 6 + struct.pack('!I', 0xc6336400 + n % 256)
bad = gw + mac + b'\x08\x00' + b'\0' * 46
other = gw + mac + b'\x88\xb5' + b'\0' * 1500
def run(k):
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); s.bind(('eth0', 0))
    i = 0
    while time.time() < stop:
        for f in (bad, syn(1 + (i * 8 + k) % 65535, k), arp(i), other):
            try:
                s.send(f); i += 1
            except OSError:
                pass
    sent[k] = i
"#;

/// Guest root owns the guest's kernel and may write any frame to its network device: what
/// cordon does with each must cost it bounded memory and print nothing on the operator's
/// terminal; a frame that does not parse is dropped and counted in the audit, and the forged
/// SYNs are refused and recorded like any other attempt, within the audit's bound.
fn a_guest_writing_raw_frames_holds_bounded_forwarder_memory_and_its_malformed_frames_are_counted(tier: Tier) {
    let what = "raw frames from guest root";
    let (cost, rec) = egress_flood(
        tier,
        &["--user", "root", "--dns-upstream", testnet::DNS, "--allow-net", "198.51.100.11:9001"],
        &eight_threads(FRAME_FLOOD),
        what,
    );
    let blocked = rec["blocked_connections"].as_array().cloned().unwrap_or_default();
    let malformed: u64 = blocked
        .iter()
        .filter(|b| b["proto"] == "ethernet" && b["reason"].as_str().unwrap_or("").starts_with("malformed frame"))
        .map(|b| b["count"].as_u64().unwrap_or(0))
        .sum();
    let syns = blocked.iter().filter(|b| b["proto"] == "tcp" && b["destination"].as_str().unwrap_or("").starts_with("198.51.100.11:")).count();
    eprintln!("{what}: {} frames sent, {malformed} malformed counted, {syns} refused SYN destinations, {} audit entries", cost.calls, blocked.len());
    assert!(malformed > 0, "{what}: no malformed frame was counted: {blocked:?}");
    assert!(malformed <= cost.calls, "{what}: more malformed frames counted than sent");
    assert!(syns > 0, "{what}: the forged SYNs were not refused and recorded");
    assert!(blocked.len() <= 4096 + 8, "{what}: the audit grew past its bound: {} entries", blocked.len());
}
