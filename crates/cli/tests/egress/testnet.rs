//! A private "internet" for the egress tests: a network namespace reached from the host over a
//! veth, with TEST-NET addresses, running HTTP, HTTPS, DNS and a UDP sink, plus a package index
//! (pypi.test, wheels on files.pypi.test) and a git host (git.test) served as static files
//! (servers.py). One per test binary, made on first use, removed at exit; a lock file keeps two
//! test binaries (or the bench) from using the addresses at once, and leftovers of a dead run
//! are removed first.
//!
//! HTTPS verifies against a CA made for the run ("cordon test CA", `test_ca_pem()`): its one
//! server certificate names every name in the zone except `badcert.test` (BADCERT), which the
//! same server answers, so a verifying client fails there on the name. Every host answers
//! `/echo` (the request as JSON, also logged as "echo {json}": `Internet::echoes`) and
//! `/redirect?to=URL` (a 302), over HTTP and HTTPS; see servers.py.
#![allow(dead_code)]

use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

pub const HOST_V4: &str = "198.51.100.1";
pub const WEB_V4: &str = "198.51.100.10";
pub const OTHER_V4: &str = "198.51.100.11";
pub const WILD_V4: &str = "198.51.100.12";
pub const NET2_V4: &str = "203.0.113.10";
pub const WEB_V6: &str = "2001:db8:100::10";
pub const DNS: &str = "198.51.100.10:53";
/// In the zone and served by the HTTPS server, but not named by its certificate.
pub const BADCERT: &str = "badcert.test";

pub struct Internet {
    pub ns: String,
    pub dir: PathBuf,
    pub host_if: String,
    pub ns_if: String,
}

struct Cleanup {
    ns: String,
    dir: PathBuf,
    child: Child,
}

static CLEANUP: Mutex<Option<Cleanup>> = Mutex::new(None);
static NET: OnceLock<Internet> = OnceLock::new();
/// Tests that count packets take this for writing; every other test for reading.
pub static QUIET: RwLock<()> = RwLock::new(());

extern "C" fn cleanup_at_exit() {
    if let Ok(mut g) = CLEANUP.lock() {
        if let Some(mut c) = g.take() {
            let _ = c.child.kill();
            let _ = c.child.wait();
            let _ = Command::new("ip").args(["netns", "del", &c.ns]).status();
            let _ = fs::remove_dir_all(&c.dir);
        }
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

fn zone() -> serde_json::Value {
    serde_json::json!({
        "allowed.test": [WEB_V4, WEB_V6],
        "other.test": [OTHER_V4],
        "wild.test": [WILD_V4],
        "a.wild.test": [WILD_V4],
        "b.wild.test": [WILD_V4],
        "loop.test": ["127.0.0.1"],
        "private.test": ["10.0.0.5"],
        "meta.test": ["169.254.169.254"],
        "self.test": [HOST_V4],
        "net2.test": [NET2_V4],
        "pypi.test": [WEB_V4],
        "files.pypi.test": [OTHER_V4],
        "git.test": [WEB_V4],
        "api.test": [WEB_V4],
        "a.api.test": [WEB_V4],
        "b.a.api.test": [WEB_V4],
        "other-api.test": [OTHER_V4],
        BADCERT: [WEB_V4],
    })
}

/// The run's CA (`dir`/ca.pem, its key ca-key.pem) and the HTTPS server's certificate signed by
/// it (cert.pem, key.pem) for every name in the zone but BADCERT. Both valid for two days,
/// with the extensions strict verifiers (webpki, Python 3.13) require.
fn make_certs(dir: &Path) {
    let mut sans: Vec<String> = zone().as_object().unwrap().keys().filter(|n| *n != BADCERT).map(|n| format!("DNS:{n}")).collect();
    sans.extend(["DNS:*.wild.test".to_string(), "DNS:*.pypi.test".to_string()]);
    let cnf = format!(
        "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = cordon test CA\n\
         [ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\nsubjectKeyIdentifier = hash\n\
         [leaf]\nbasicConstraints = critical,CA:FALSE\nkeyUsage = critical,digitalSignature\nextendedKeyUsage = serverAuth\n\
         subjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid:always\nsubjectAltName = {}\n",
        sans.join(",")
    );
    fs::write(dir.join("openssl.cnf"), cnf).unwrap();
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl").args(args).current_dir(dir).output().expect("run openssl (scripts/install-deps installs it)");
        assert!(out.status.success(), "openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let serial = format!("0x{:x}{:08x}", std::process::id(), now.subsec_nanos());
    openssl(&[&["req", "-x509", "-config", "openssl.cnf", "-extensions", "ca", "-days", "2", "-subj", "/CN=cordon test CA"][..], &ec, &["-keyout", "ca-key.pem", "-out", "ca.pem"]].concat());
    openssl(&[&["req", "-new", "-config", "openssl.cnf", "-subj", "/CN=allowed.test"][..], &ec, &["-keyout", "key.pem", "-out", "leaf.csr"]].concat());
    openssl(&[
        "x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-set_serial", &serial, "-days", "2", "-extfile", "openssl.cnf", "-extensions", "leaf", "-out",
        "cert.pem",
    ]);
}

/// The test CA's certificate (PEM), the only root the test internet's HTTPS server chains to
/// (sets the test internet up if it is not yet).
pub fn test_ca_pem() -> PathBuf {
    internet().ca_pem()
}

const TEST_ADDRS: [&str; 6] = [HOST_V4, WEB_V4, OTHER_V4, WILD_V4, NET2_V4, WEB_V6];

/// The device `ip route get` names for an address ("" when it has no route).
fn route_dev(addr: &str) -> String {
    let out = Command::new("ip").args(["route", "get", addr]).output().expect("ip route get");
    let route = String::from_utf8_lossy(&out.stdout);
    let mut words = route.split_whitespace();
    while let Some(w) = words.next() {
        if w == "dev" {
            return words.next().unwrap_or("").to_string();
        }
    }
    String::new()
}

/// The addresses the host reaches for its resolver and the package registries the suite
/// installs from, each with the device it routes through now.
fn host_services() -> Vec<(String, String, String)> {
    let mut found = Vec::new();
    let resolv = fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    for l in resolv.lines() {
        if let Some(a) = l.strip_prefix("nameserver") {
            found.push(("the resolver".to_string(), a.trim().to_string()));
        }
    }
    for name in ["deb.debian.org", "pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "index.crates.io"] {
        if let Ok(o) = Command::new("getent").args(["ahostsv4", name]).output() {
            if let Some(a) = String::from_utf8_lossy(&o.stdout).split_whitespace().next() {
                found.push((name.to_string(), a.to_string()));
            }
        }
    }
    found
        .into_iter()
        .map(|(name, addr)| {
            let dev = route_dev(&addr);
            (name, addr, dev)
        })
        .collect()
}

/// The shared test internet, set up on first use.
/// A python TCP server for the test internet, on OTHER_V4:`port`, that reads and discards
/// everything as fast as it can; it prints "listening" once bound.
pub fn drain_server(port: u16) -> String {
    format!(
        r#"
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('{OTHER_V4}', {port})); s.listen(64)
print('listening', flush=True)
def drain(c):
    while c.recv(1 << 20):
        pass
while True:
    c, _ = s.accept(); threading.Thread(target=drain, args=(c,), daemon=True).start()
"#
    )
}

pub fn internet() -> &'static Internet {
    NET.get_or_init(setup)
}

fn setup() -> Internet {
    // Held until the process exits: one user of these addresses at a time.
    let lock = fs::File::create("/run/cordon-test-internet.lock").expect("create lock file");
    // SAFETY: flock on a file we just opened.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0, "lock the test internet");
    std::mem::forget(lock);
    // Whatever a previous, killed run left is unused now that we hold the lock.
    let list = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    for line in String::from_utf8_lossy(&list.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if name.starts_with("cordon-inet-") {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }

    let pid = std::process::id();
    let ns = format!("cordon-inet-{pid}");
    let (host_if, ns_if) = (format!("ci{pid}h"), format!("ci{pid}n"));
    let dir = std::env::temp_dir().join(format!("cordon-inet-{pid}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();

    // The host may reach real services on TEST-NET addresses (a package mirror behind a proxy
    // address, say): the host side claims only the exact addresses the tests use, never a whole
    // range, and the routes to the hosts the suite itself needs must be the same afterwards.
    let needed = host_services();
    for (name, addr, _) in &needed {
        assert!(!TEST_ADDRS.contains(&addr.as_str()), "{name} resolves to {addr}, a test internet address: pick other test addresses");
    }

    ip(&["netns", "add", &ns]);
    ip(&["link", "add", &host_if, "type", "veth", "peer", "name", &ns_if]);
    ip(&["link", "set", &ns_if, "netns", &ns]);
    ip(&["addr", "add", &format!("{HOST_V4}/32"), "dev", &host_if]);
    ip(&["-6", "addr", "add", "2001:db8:100::1/128", "dev", &host_if, "nodad"]);
    ip(&["link", "set", &host_if, "up"]);
    for a in [WEB_V4, OTHER_V4, WILD_V4] {
        ip(&["route", "add", &format!("{a}/32"), "dev", &host_if]);
    }
    ip(&["route", "add", &format!("{NET2_V4}/32"), "via", WEB_V4, "dev", &host_if]);
    ip(&["-6", "route", "add", &format!("{WEB_V6}/128"), "dev", &host_if]);
    for a in [WEB_V4, OTHER_V4, WILD_V4] {
        ip(&["-n", &ns, "addr", "add", &format!("{a}/24"), "dev", &ns_if]);
    }
    ip(&["-n", &ns, "addr", "add", &format!("{NET2_V4}/32"), "dev", &ns_if]);
    ip(&["-n", &ns, "-6", "addr", "add", &format!("{WEB_V6}/64"), "dev", &ns_if, "nodad"]);
    ip(&["-n", &ns, "link", "set", "lo", "up"]);
    ip(&["-n", &ns, "link", "set", &ns_if, "up"]);
    // Every test address must route into this namespace's veth, never out of the host's own
    // interfaces: checked with `ip route get` before any test uses it.
    for a in [WEB_V4, OTHER_V4, WILD_V4, NET2_V4, WEB_V6] {
        let out = Command::new("ip").args(["route", "get", a]).output().expect("ip route get");
        let route = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && route.contains(&format!("dev {host_if}")), "test address {a} does not route into the test internet: {route}");
    }
    for (name, addr, dev) in &needed {
        assert_eq!(&route_dev(addr), dev, "the test internet changed the host's route to {name} ({addr})");
    }

    make_certs(&dir);
    fs::write(dir.join("zone.json"), zone().to_string()).unwrap();
    fs::write(dir.join("log"), "").unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/egress/servers.py");
    let child = Command::new("ip")
        .args(["netns", "exec", &ns, "/usr/bin/python3"])
        .arg(&script)
        .arg(&dir)
        .arg(&ns_if)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(dir.join("stderr")).unwrap())
        .spawn()
        .expect("start the test servers");
    *CLEANUP.lock().unwrap() = Some(Cleanup { ns: ns.clone(), dir: dir.clone(), child });
    // SAFETY: registering a plain extern "C" function with no captured state.
    unsafe { libc::atexit(cleanup_at_exit) };
    let t = Instant::now();
    while !dir.join("ready").exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "test servers did not start: {}", fs::read_to_string(dir.join("stderr")).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(50));
    }
    Internet { ns, dir, host_if, ns_if }
}

impl Internet {
    /// Everything the servers logged so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// The test CA's certificate (PEM): see `test_ca_pem`.
    pub fn ca_pem(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The `/echo` requests the servers saw after `mark` (all of them for ""), oldest first,
    /// each the JSON the client got back.
    pub fn echoes(&self, mark: &str) -> Vec<serde_json::Value> {
        let log = if mark.is_empty() { self.log() } else { self.since(mark) };
        log.lines().filter_map(|l| l.strip_prefix("echo ")).map(|j| serde_json::from_str(j).expect("an echo log line is JSON")).collect()
    }

    /// The value of the module in the test index's package (random per run, so only an install
    /// from this index can print it).
    pub fn pkg_value(&self) -> String {
        fs::read_to_string(self.dir.join("www/pkg-value")).unwrap()
    }

    /// A marker written into the log, to look only at what came after it.
    pub fn mark(&self) -> String {
        let m = format!("mark {}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
        let mut f = fs::OpenOptions::new().append(true).open(self.dir.join("log")).unwrap();
        writeln!(f, "{m}").unwrap();
        m
    }

    /// The log after `mark`.
    pub fn since(&self, mark: &str) -> String {
        let log = self.log();
        log.split_once(mark).map(|(_, after)| after.to_string()).unwrap_or(log)
    }

    /// Starts or stops logging every IP packet that arrives in the test internet.
    pub fn capture(&self, on: bool) {
        let flag = self.dir.join("capture");
        if on {
            fs::write(flag, "").unwrap();
        } else {
            let _ = fs::remove_file(flag);
        }
    }

    /// Packets the host sent into the test internet (the host end's transmit count): any
    /// packet of a sandbox that left the host would be among them.
    pub fn packets_in(&self) -> u64 {
        let tx = format!("/sys/class/net/{}/statistics/tx_packets", self.host_if);
        fs::read_to_string(tx).unwrap().trim().parse().unwrap()
    }
}
