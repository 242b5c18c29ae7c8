//! What the sandbox's file view lets it learn or take beyond what it should: host files pulled
//! in by `--copy` through a symlink swapped in on the host, host facts in `/proc`, and more
//! memory-backed storage than `--disk` says.

use crate::common;
use crate::common::*;
use crate::{per_tier, require_root};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

per_tier!(proc_shows_no_host_facts, disk_is_one_budget_for_the_root_tmp_and_shm);

/// A scratch directory on the host, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("cordon-fsview-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const BAITS: usize = 20;
const COPY_RUNS: usize = 15;

/// A host process swaps files of a tree being copied in for symlinks to a root-only host file,
/// as fast as it can, while `--copy` runs again and again: the secret must never arrive, the
/// tree's own files, directories and symlinks must (symlinks as symlinks), and the secret on the
/// host stays as it was.
#[test]
fn copy_never_follows_a_symlink_swapped_in_on_the_host() {
    require_root!();
    use std::os::unix::fs::{symlink, PermissionsExt};
    let scratch = Scratch::new("copy");
    let (tree, stage, secret) = (scratch.0.join("tree"), scratch.0.join("stage"), scratch.0.join("secret"));
    for d in [tree.join("sub"), tree.join("empty"), stage.clone()] {
        std::fs::create_dir_all(d).unwrap();
    }
    let marker = format!("FSVIEW-SECRET-{}-{}", std::process::id(), file_digest(Path::new("/proc/self/stat")));
    std::fs::write(&secret, &marker).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(tree.join("a.txt"), "hello\n").unwrap();
    std::fs::write(tree.join("sub/b.txt"), "nested\n").unwrap();
    symlink("../a.txt", tree.join("sub/link")).unwrap();
    for i in 0..BAITS {
        std::fs::write(tree.join(format!("bait{i:02}")), "decoy\n").unwrap();
    }

    // The flipper: each bait is, in turn, a symlink to the secret and a plain file again, each
    // swap one atomic rename (so the name always exists).
    let stop = Arc::new(AtomicBool::new(false));
    let flips = Arc::new(AtomicU64::new(0));
    let flipper = {
        let (stop, flips, tree, stage, secret) = (stop.clone(), flips.clone(), tree.clone(), stage.clone(), secret.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for i in 0..BAITS {
                    let (l, f, bait) = (stage.join(format!("l{i}")), stage.join(format!("f{i}")), tree.join(format!("bait{i:02}")));
                    let _ = symlink(&secret, &l);
                    let _ = std::fs::rename(&l, &bait);
                    let _ = std::fs::write(&f, "decoy\n");
                    let _ = std::fs::rename(&f, &bait);
                    flips.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };

    let copy = format!("{}:/home/user/t", tree.display());
    let script = r#"
        cd /home/user/t
        echo "leaked=$(grep -rl FSVIEW-SECRET . | wc -l)"
        echo "link=$(readlink sub/link) via=$(cat sub/link) nested=$(cat sub/b.txt)"
        echo "empty=$(test -d empty && echo yes)"
        echo "bait_files=$(find . -maxdepth 1 -name 'bait*' -type f | wc -l) bait_links=$(find . -maxdepth 1 -name 'bait*' -type l | wc -l)"
    "#;
    let (mut leaks, mut ok, mut gave_up, mut as_links) = (0, 0, 0, 0);
    for _ in 0..COPY_RUNS {
        let r = sh(&["--copy", &copy], script);
        if r.code != 0 {
            // The only acceptable failure: an entry that never held still long enough.
            assert!(r.stderr.contains("kept changing"), "copy run failed otherwise: {r:?}");
            gave_up += 1;
            continue;
        }
        let field = |k: &str| r.stdout.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}="))).unwrap_or("").to_string();
        if field("leaked") != "0" || r.stdout.contains(&marker) {
            leaks += 1;
        }
        assert_eq!(field("link"), "../a.txt", "a symlink in the tree must arrive as that symlink: {r:?}");
        assert_eq!(field("via"), "hello", "{r:?}");
        assert_eq!(field("nested"), "nested", "{r:?}");
        assert_eq!(field("empty"), "yes", "an empty directory of the tree must arrive: {r:?}");
        let (files, links): (usize, usize) = (field("bait_files").parse().unwrap(), field("bait_links").parse().unwrap());
        assert_eq!(files + links, BAITS, "every bait arrives as a file or a symlink: {r:?}");
        as_links += links;
        ok += 1;
        assert_clean(r.id());
    }
    stop.store(true, Ordering::Relaxed);
    flipper.join().unwrap();
    eprintln!(
        "{COPY_RUNS} copies under {} flips: {leaks} brought the secret in, {ok} completed, {gave_up} gave up; {as_links} baits arrived as symlinks",
        flips.load(Ordering::Relaxed)
    );
    assert_eq!(leaks, 0, "a --copy brought a root-only host file into the sandbox through a swapped-in symlink");
    assert!(ok >= COPY_RUNS / 2, "most copies under the flipper must complete ({ok} of {COPY_RUNS})");
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), marker, "the host secret changed");
    assert_eq!(std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777, 0o600);
}

/// What a program inside reads from /proc, next to what the host's /proc says.
const PROC_PROBE: &str = r#"
import json, os, subprocess
def read(p):
    try:
        with open(p, 'rb') as f:
            return f.read().decode('latin-1')
    except OSError as e:
        return 'ERR:%d' % e.errno
def pressure():
    try:
        return {n: read('/proc/pressure/' + n) for n in os.listdir('/proc/pressure')}
    except OSError as e:
        return 'ERR:%d' % e.errno
def works(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode
    except Exception as e:
        return str(e)
out = {
    'cmdline': read('/proc/cmdline'),
    'config_gz': len(read('/proc/config.gz')) if not read('/proc/config.gz').startswith('ERR') else read('/proc/config.gz'),
    'boot_id': read('/proc/sys/kernel/random/boot_id'),
    'boot_id_child': subprocess.run(['cat', '/proc/sys/kernel/random/boot_id'], capture_output=True, text=True).stdout,
    'loadavg': read('/proc/loadavg'),
    'pressure': pressure(),
    'diskstats': read('/proc/diskstats'),
    'partitions': read('/proc/partitions'),
    'net_unix': read('/proc/net/unix'),
    'cpu_count': os.cpu_count(),
    'ps': works(['ps', 'aux']),
    'top': works(['top', '-bn1']),
    'free': works(['free', '-m']),
    'uptime': works(['uptime']),
}
import time; time.sleep(1.1)
out['boot_id_later'] = read('/proc/sys/kernel/random/boot_id')
print(json.dumps(out))
"#;

fn host(p: &str) -> String {
    String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned()
}

fn proc_view(t: Tier) -> (Value, String) {
    let r = run(&t.flags(&[]), &["python3", "-c", PROC_PROBE]);
    assert_eq!(r.code, 0, "{r:?}");
    let v: Value = serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("bad probe output {r:?}: {e}"));
    assert_clean(r.id());
    (v, r.id().to_string())
}

/// Reads the host facts the issue lists from inside and compares them with the host's own: none
/// may show, each sandbox has a boot_id of its own that stays put for its life, and the tools
/// that read /proc still work.
fn proc_shows_no_host_facts(t: Tier) {
    let (a, id) = proc_view(t);
    let (b, _) = proc_view(t);
    let s = |v: &Value, k: &str| v[k].as_str().unwrap_or_else(|| panic!("no {k} in {v}")).to_string();

    let host_cmdline = host("/proc/cmdline");
    assert!(!host_cmdline.trim().is_empty(), "precondition: the host has a kernel command line");
    assert!(!s(&a, "cmdline").contains(host_cmdline.trim()), "the host's kernel command line shows: {}", s(&a, "cmdline"));
    for word in host_cmdline.split_whitespace().filter(|w| w.contains('=') && !w.starts_with("BOOT_IMAGE")) {
        assert!(!s(&a, "cmdline").contains(word), "host boot argument {word} shows: {}", s(&a, "cmdline"));
    }
    if Path::new("/proc/config.gz").exists() {
        assert!(
            a["config_gz"] == 0 || a["config_gz"].as_str().is_some_and(|e| e.starts_with("ERR")),
            "the host kernel's config shows: {} bytes",
            a["config_gz"]
        );
    }

    let host_boot = host("/proc/sys/kernel/random/boot_id");
    let boot = s(&a, "boot_id");
    // gVisor's procfs has no boot_id at all (ENOENT): nothing of the host's shows there either.
    if t == Tier::Gvisor && boot.starts_with("ERR") {
        eprintln!("gvisor: no boot_id in its /proc ({boot})");
    } else {
        assert_eq!(boot.trim().len(), 36, "boot_id has the kernel's format: {boot:?}");
        assert_ne!(boot.trim(), host_boot.trim(), "the host's boot_id shows");
        assert_ne!(boot.trim(), s(&b, "boot_id").trim(), "two sandboxes share a boot_id");
        assert_eq!(boot, s(&a, "boot_id_later"), "a sandbox's boot_id changed during its life");
        assert_eq!(boot, s(&a, "boot_id_child"), "another process of the sandbox sees another boot_id");
    }

    // The host is busy (builds, other sandboxes): its load shows unless it is masked.
    let load: Vec<String> = s(&a, "loadavg").split_whitespace().take(3).map(String::from).collect();
    eprintln!("{t:?}: host loadavg {}, sandbox's {}", host("/proc/loadavg").trim(), s(&a, "loadavg").trim());
    assert_eq!(load, ["0.00", "0.00", "0.00"], "the host's load average shows: {}", s(&a, "loadavg"));

    match &a["pressure"] {
        Value::Object(m) => assert!(m.values().all(|v| v.as_str().is_some_and(|s| s.is_empty() || s.starts_with("ERR"))), "host PSI shows: {m:?}"),
        Value::String(e) => assert!(e.starts_with("ERR"), "{e}"),
        other => panic!("pressure: {other}"),
    }
    for (k, path) in [("diskstats", "/proc/diskstats"), ("partitions", "/proc/partitions")] {
        let inside = s(&a, k);
        let host_view = host(path);
        for dev in host_view.lines().filter_map(|l| l.split_whitespace().nth(if k == "diskstats" { 2 } else { 3 })).filter(|d| *d != "name") {
            assert!(!inside.split_whitespace().any(|w| w == dev), "host block device {dev} shows in {k}: {inside}");
        }
    }

    let net_unix = s(&a, "net_unix");
    let state = state_dir().display().to_string();
    assert!(!net_unix.contains(&state) && !net_unix.contains(&id), "a host socket path shows in /proc/net/unix:\n{net_unix}");
    assert!(!net_unix.lines().skip(1).any(|l| l.split_whitespace().nth(7).is_some_and(|p| p.starts_with('/'))), "a socket path shows:\n{net_unix}");

    assert!(a["cpu_count"].as_u64().is_some_and(|n| n >= 1), "os.cpu_count(): {}", a["cpu_count"]);
    for tool in ["ps", "top", "free", "uptime"] {
        assert_eq!(a[tool], 0, "{tool} fails inside: {a}");
    }
}

/// Fills `/tmp`, `/dev/shm` and the root's writable layer together, round robin, until each
/// gives ENOSPC: together they hold at most `--disk` (plus a stated allowance), and the run
/// ends by ENOSPC, not by the memory cap.
const FILL: &str = r#"
import errno, json, os
paths = ['/tmp/fill', '/dev/shm/fill', '/home/user/fill']
fds = {p: os.open(p, os.O_WRONLY | os.O_CREAT, 0o600) for p in paths}
written = {p: 0 for p in paths}
ended = {}
chunk = b'x' * (1 << 20)
while len(ended) < len(paths):
    for p in paths:
        if p in ended:
            continue
        try:
            n = os.write(fds[p], chunk)
            written[p] += n
        except OSError as e:
            ended[p] = e.errno
print(json.dumps({'written': written, 'ended': ended, 'total': sum(written.values())}))
"#;

const DISK_MIB: u64 = 48;
/// What the three may hold beyond `--disk`: a partial last write per file and tmpfs rounding.
const ALLOWANCE_MIB: u64 = 2;

fn disk_is_one_budget_for_the_root_tmp_and_shm(t: Tier) {
    let disk = format!("{DISK_MIB}M");
    // Memory for three times the disk and more: if the cap were split three ways, all of it
    // would fit before any OOM.
    let r = run(&t.flags(&["--disk", &disk, "--memory", "512M"]), &["python3", "-c", FILL]);
    assert_eq!(r.code, 0, "the fill did not end by itself: {r:?}");
    assert_ne!(r.reason(), "oom", "{r:?}");
    let v: Value = serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("bad output {r:?}: {e}"));
    let total = v["total"].as_u64().unwrap();
    eprintln!("{t:?}: --disk {disk}: {v}");
    for p in ["/tmp/fill", "/dev/shm/fill", "/home/user/fill"] {
        assert_eq!(v["ended"][p], 28, "{p} did not end with ENOSPC: {v}");
    }
    assert!(
        total <= (DISK_MIB + ALLOWANCE_MIB) << 20,
        "/tmp, /dev/shm and the root held {} MiB together with --disk {disk} (allowance {ALLOWANCE_MIB} MiB): {v}",
        total >> 20
    );
    // The budget is there to use: most of it is writable.
    assert!(total >= (DISK_MIB * 3 / 4) << 20, "only {} MiB writable with --disk {disk}: {v}", total >> 20);
    assert_clean(r.id());
}
