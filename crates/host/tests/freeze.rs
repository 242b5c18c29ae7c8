//! Freezing a real sandbox group, through each way a host offers: the unified hierarchy's
//! `cgroup.freeze` (v2 and hybrid hosts) and v1's `freezer` controller (v1-only hosts). A
//! frozen busy loop must stop using CPU while its memory stays counted, and go on once thawed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use cordon_host::{Cgroup, Layout};

/// Says why a test did not run: on stderr, and in the suite's skip log (see scripts/test).
fn skip(why: &str) {
    let name = std::thread::current().name().unwrap_or("?").to_string();
    eprintln!("SKIP {name}: {why}");
    if let Some(log) = std::env::var_os("CORDON_TEST_SKIPS") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).create(true).open(log) {
            let _ = writeln!(f, "{name}: {why}");
        }
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// CPU time of a process (user + system), from /proc.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0) + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
}

struct Loop(Child);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A busy loop moved into `cg`.
fn busy_in(cg: &Cgroup) -> Loop {
    let child = Command::new("sh").args(["-c", "while :; do :; done"]).spawn().expect("spawn sh");
    for f in cg.join_files() {
        std::fs::write(&f, child.id().to_string()).unwrap_or_else(|e| panic!("join {}: {e}", f.display()));
    }
    Loop(child)
}

/// Freezes a busy loop in a group of `layout`: no CPU while frozen (over a window as long as
/// the one in which it ran before), CPU again once thawed.
fn freeze_stops_and_thaw_restarts(layout: &Layout, id: &str) {
    let cg = Cgroup::plan(layout, id);
    cg.create(&Default::default()).expect("create the groups");
    let lp = busy_in(&cg);
    let pid = lp.0.id();
    let window = Duration::from_millis(300);
    let t0 = cpu_ticks(pid);
    std::thread::sleep(window);
    let ran = cpu_ticks(pid) - t0;
    assert!(ran > 0, "the loop did not run before the freeze");
    cg.freeze(true).expect("freeze");
    assert!(cg.is_frozen());
    let f0 = cpu_ticks(pid);
    std::thread::sleep(window);
    assert_eq!(cpu_ticks(pid), f0, "a frozen process used CPU");
    assert!(Path::new(&format!("/proc/{pid}")).exists(), "the frozen process is gone");
    cg.freeze(false).expect("thaw");
    assert!(!cg.is_frozen());
    let start = Instant::now();
    while cpu_ticks(pid) == f0 {
        assert!(start.elapsed() < Duration::from_secs(10), "the thawed loop did not run again");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A frozen group is killed and removed as any other (the teardown of a paused sandbox).
    cg.freeze(true).expect("freeze again");
    let _ = cg.freeze(false);
    drop(lp);
    assert!(cg.kill_and_wait(Duration::from_secs(5)));
    cg.remove().expect("remove the groups");
}

fn test_id(kind: &str) -> String {
    format!("freeze-test-{kind}-{}", std::process::id())
}

#[test]
fn the_unified_hierarchy_freezes_a_group() {
    if !is_root() {
        return skip("needs root (cgroups)");
    }
    let layout = Layout::detect();
    if layout.unified.is_none() {
        return skip("this host has no unified cgroup hierarchy");
    }
    // Only the unified group: the v1 controllers play no part in its freeze.
    let layout = Layout { unified: layout.unified.clone(), v2_controllers: layout.v2_controllers.clone(), v1: Vec::new() };
    freeze_stops_and_thaw_restarts(&layout, &test_id("v2"));
}

#[test]
fn the_v1_freezer_freezes_a_group() {
    if !is_root() {
        return skip("needs root (cgroups)");
    }
    let freezer = PathBuf::from("/sys/fs/cgroup/freezer");
    if !freezer.join("cgroup.procs").exists() {
        return skip("this host has no v1 freezer hierarchy");
    }
    // What a v1-only host's layout has: no unified mount, the freezer among the controllers.
    let layout = Layout { unified: None, v2_controllers: Vec::new(), v1: vec![("freezer".into(), freezer)] };
    freeze_stops_and_thaw_restarts(&layout, &test_id("v1"));
}
