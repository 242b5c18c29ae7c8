//! The reaper of a long-lived cordon (`serve`, `mcp`): cordon is a child subreaper, so that a
//! sandbox's init, whose jailer exits, stays its child; so does every other process of a
//! sandbox whose parent exits first (runsc starts helpers that exit during a sandbox's start,
//! and its sandbox and gofer outlive `runsc run`). Such an orphan is nobody's to wait for, and
//! as a zombie it holds one of the host's pids for as long as cordon runs: a server that made
//! thousands of sandboxes would run the host out of pids.
//!
//! A zombie child seen in two scans a period apart is reaped here. Children that cordon waits
//! for itself (a `Command`'s, a sandbox's init through its pidfd) are waited for as soon as
//! they exit, well within the period; the tiers also reap what they know of at teardown
//! ([`crate::sys::reap_all`]), so this is the net under them, not the main way.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

/// Children whose owner waits for them itself, however long they stay zombies (a `Child`
/// kept for a sandbox's whole life): never reaped here, or their owner would wait for (or
/// signal) a pid that may belong to another process by then.
static CLAIMED: Mutex<Option<HashSet<libc::pid_t>>> = Mutex::new(None);

/// Marks `pid`, a child of ours, as waited for by its owner (see [`CLAIMED`]).
pub fn claim(pid: u32) {
    CLAIMED.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(HashSet::new).insert(pid as libc::pid_t);
}

/// Its owner has waited for it.
pub fn release(pid: u32) {
    if let Some(set) = CLAIMED.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        set.remove(&(pid as libc::pid_t));
    }
}

fn claimed(pid: libc::pid_t) -> bool {
    CLAIMED.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|s| s.contains(&pid))
}

/// How often children are scanned: a zombie is reaped one to two periods after it exits.
const PERIOD: Duration = Duration::from_secs(5);

/// Starts the reaper thread for the rest of the process's life.
pub fn start() {
    let spawned = std::thread::Builder::new().name("orphan-reaper".into()).spawn(|| {
        let mut seen = HashSet::new();
        loop {
            std::thread::sleep(PERIOD);
            seen = reap_stale(zombie_children(), &seen);
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the orphan reaper: {e}");
    }
}

/// Reaps the zombie children of this scan (`now`) that were zombies in the scan before
/// (`seen`) too; returns the others, to be reaped next time if still there.
fn reap_stale(now: HashSet<libc::pid_t>, seen: &HashSet<libc::pid_t>) -> HashSet<libc::pid_t> {
    let mut reaped = 0;
    for pid in now.intersection(seen).filter(|p| !claimed(**p)) {
        // SAFETY: waitpid on one pid (a zombie child of ours) with a null status pointer.
        if unsafe { libc::waitpid(*pid, std::ptr::null_mut(), libc::WNOHANG) } == *pid {
            reaped += 1;
        }
    }
    if reaped > 0 {
        tracing::debug!(reaped, "orphaned sandbox processes reaped");
    }
    now.difference(seen).copied().collect()
}

/// This process's children (of any of its threads) that are zombies.
fn zombie_children() -> HashSet<libc::pid_t> {
    let mut out = HashSet::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return out };
    for t in tasks.flatten() {
        let Ok(children) = std::fs::read_to_string(t.path().join("children")) else { continue };
        for pid in children.split_whitespace().filter_map(|p| p.parse::<libc::pid_t>().ok()) {
            if state(pid) == Some('Z') {
                out.insert(pid);
            }
        }
    }
    out
}

/// The state letter of `/proc/<pid>/stat` (after the command name, which may hold spaces).
fn state(pid: libc::pid_t) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_orphaned_zombie_is_reaped_on_its_second_sighting_only() {
        // A child that exits at once and that nothing waits for: a zombie of this process.
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as libc::pid_t;
        std::mem::forget(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while state(pid) != Some('Z') {
            assert!(std::time::Instant::now() < deadline, "the child never exited");
            std::thread::sleep(Duration::from_millis(5));
        }
        // Only this child: other tests of this process have children of their own.
        let scan = || zombie_children().into_iter().filter(|p| *p == pid).collect::<HashSet<_>>();
        // First sighting: left alone (its owner might be about to wait for it).
        let first = reap_stale(scan(), &HashSet::new());
        assert!(first.contains(&pid));
        assert_eq!(state(pid), Some('Z'));
        // A claimed child is its owner's to wait for.
        claim(pid as u32);
        reap_stale(scan(), &first);
        assert_eq!(state(pid), Some('Z'));
        release(pid as u32);
        // Second sighting, unclaimed: reaped, and the pid is gone from the host.
        reap_stale(scan(), &first);
        assert_eq!(state(pid), None);
    }
}
