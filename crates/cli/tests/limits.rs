//! Hard caps: each test pushes a real sandbox past one and checks the named outcome, the exit
//! code, and that the host did not pay for it.

mod common;

use common::*;
use std::time::{Duration, Instant};

#[test]
fn memory_bomb_ends_with_137_and_reason_oom() {
    require_root!();
    let r = run(&["--memory", "64M"], &["python3", "-c", "a = []\nwhile True: a.append(bytearray(8 << 20))"]);
    assert_eq!(r.code, 137, "{r:?}");
    assert_eq!(r.reason(), "oom", "{r:?}");
    assert!(r.stderr.contains("out of memory (limit 64 MiB)"), "{r:?}");
    let peak = r.record["peak_memory_bytes"].as_u64().unwrap();
    assert!(peak <= 64 << 20 && peak > 32 << 20, "peak {peak}");
    assert_clean(r.id());
}

#[test]
fn fork_bomb_is_contained_and_the_host_stays_responsive() {
    require_root!();
    let child = std::thread::spawn(|| sh(&["--pids", "64", "--timeout", "6s"], ":(){ :|:& };: ; sleep 5; echo survived"));
    std::thread::sleep(Duration::from_secs(2));
    // While the bomb runs, the host can still start processes quickly.
    let t = Instant::now();
    for _ in 0..20 {
        assert!(std::process::Command::new("true").status().unwrap().success());
    }
    assert!(t.elapsed() < Duration::from_secs(5), "host spawning took {:?}", t.elapsed());
    let r = child.join().unwrap();
    assert!(r.code == 0 || r.code == 124, "{r:?}");
    assert_clean(r.id());
}

#[test]
fn pids_cap_is_enforced() {
    require_root!();
    let r = sh(&["--pids", "32"], "for i in $(seq 100); do sleep 10 & done 2>/dev/null; jobs -p | wc -l");
    let n: u32 = r.stdout.trim().lines().last().unwrap_or("0").trim().parse().unwrap_or(999);
    assert!(n < 32, "started {n} processes under a cap of 32: {r:?}");
    assert_clean(r.id());
}

#[test]
fn filling_the_disk_gives_enospc_and_host_disk_is_untouched() {
    require_root!();
    let before = free_bytes(&state_dir());
    let r = sh(&["--disk", "32M", "--memory", "256M"], "dd if=/dev/zero of=/home/user/fill bs=1M count=100; echo rc=$?; df -k / | tail -1");
    let after = free_bytes(&state_dir());
    assert!(r.stderr.contains("No space left on device") || r.stdout.contains("No space left"), "{r:?}");
    assert!(r.stdout.contains("rc=1"), "{r:?}");
    // Other processes on the host may write meanwhile; the sandbox's 32 MiB must not show.
    assert!(before.saturating_sub(after) < 16 << 20, "host free space dropped by {}", before - after);
    assert_clean(r.id());
}

#[test]
fn tmp_is_a_capped_tmpfs() {
    require_root!();
    let r = sh(&["--disk", "16M"], "df -k /tmp | tail -1; head -c 40M /dev/zero > /tmp/x; echo rc=$?");
    assert!(r.stdout.contains("tmpfs") || r.stdout.contains("tmp"), "{r:?}");
    assert!(r.stdout.contains("rc=1"), "{r:?}");
}

#[test]
fn wall_clock_timeout_kills_within_a_second() {
    require_root!();
    ensure_base();
    let t = Instant::now();
    let r = run(&["--timeout", "2s"], &["sleep", "100"]);
    let took = t.elapsed();
    assert_eq!(r.code, 124, "{r:?}");
    assert_eq!(r.reason(), "timeout");
    assert!(r.stderr.contains("timed out"), "{r:?}");
    assert!(took < Duration::from_secs(4), "took {took:?}");
    assert_clean(r.id());
}

#[test]
fn cpu_quota_limits_a_busy_loop() {
    require_root!();
    // Two busy threads for 2 s of wall time under half a core: CPU time must be far below 4 s.
    let script = r#"
import threading, time, os
def spin(end):
    while time.time() < end: pass
end = time.time() + 2
ts = [threading.Thread(target=spin, args=(end,)) for _ in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
print(sum(os.times()[:2]))
"#;
    let r = run(&["--cpus", "0.5"], &["python3", "-c", script]);
    assert_eq!(r.code, 0, "{r:?}");
    let cpu: f64 = r.stdout.trim().parse().unwrap();
    assert!(cpu < 1.6, "used {cpu}s of CPU in 2s under --cpus 0.5");
    assert!(cpu > 0.3, "used only {cpu}s: the loop did not run");
}
