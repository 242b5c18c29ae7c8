//! Distinct host uid ranges for concurrent sandboxes.
//!
//! Slot `n` owns uids `UID_BASE + n*65536 ..`. A slot is taken by holding an flock on
//! `slots/<n>`; the kernel drops the lock when its holder dies, and orphaned sandboxes are
//! reaped before any new slot is handed out, so two live sandboxes never share a range. A free
//! lock is taken only once no process on the host runs under its range (a scan of every
//! process's uids); a slot whose sandbox this process itself saw emptied stays locked by it and
//! is reused without that scan (`Slot::release_emptied`).
//!
//! The lock files are host-wide ([`HOST_DIR`], on the `/run` tmpfs, which a reboot clears with
//! the locks), not per state dir: uid ranges are a host resource, and two cordons with different
//! state dirs used to hand the same range to two live sandboxes (sharing every per-user kernel
//! budget and the ownership of every file either makes).

use crate::sys;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

const CAPACITY: u32 = 16_000;

/// Where every cordon on the host takes its slots.
pub const HOST_DIR: &str = "/run/cordon/slots";

pub struct Slots {
    dir: PathBuf,
    /// Where the next scan for a free slot starts: a slot just freed is the last one tried
    /// again, and a scan does not reopen every held slot's file from 0.
    cursor: AtomicU32,
    /// Slots whose sandbox this process saw emptied (every process in its cgroup gone), still
    /// locked by this process: taken again without scanning the host's processes, since no
    /// other cordon can have used them meanwhile.
    emptied: Arc<Mutex<Vec<(u32, fs::File)>>>,
}

/// A held slot; dropping it frees the range.
pub struct Slot {
    pub index: u32,
    file: Option<fs::File>,
    emptied: Arc<Mutex<Vec<(u32, fs::File)>>>,
}

impl Slot {
    /// Keeps the slot locked for this process's next sandbox, once the caller has seen every
    /// process of the sandbox that ran in it end (its cgroup empty): the next [`Slots::acquire`]
    /// takes it without looking for orphans in its range. Plain drop frees the lock instead.
    pub fn release_emptied(mut self) {
        if let Some(file) = self.file.take() {
            self.emptied.lock().unwrap_or_else(|p| p.into_inner()).push((self.index, file));
        }
    }
}

impl Slots {
    pub fn open(dir: &Path) -> io::Result<Slots> {
        fs::create_dir_all(dir)?;
        Ok(Slots { dir: dir.to_path_buf(), cursor: AtomicU32::new(0), emptied: Arc::default() })
    }

    /// The host-wide slots ([`HOST_DIR`]); `fallback` (under the state dir) only on a host
    /// without a writable `/run`, with a warning that ranges are then per state dir.
    pub fn open_host(fallback: &Path) -> io::Result<Slots> {
        Slots::open(Path::new(HOST_DIR)).or_else(|e| {
            tracing::warn!("{HOST_DIR}: {e}; uid ranges are taken per state dir ({}) instead", fallback.display());
            Slots::open(fallback)
        })
    }

    pub fn capacity(&self) -> u32 {
        CAPACITY
    }

    pub fn acquire(&self) -> Option<Slot> {
        if let Some((index, file)) = self.emptied.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Some(Slot { index, file: Some(file), emptied: self.emptied.clone() });
        }
        let start = self.cursor.load(Ordering::Relaxed) % CAPACITY;
        for index in (start..CAPACITY).chain(0..start) {
            let Ok(file) = fs::OpenOptions::new().create(true).truncate(false).write(true).open(self.dir.join(index.to_string())) else {
                continue;
            };
            if sys::flock_exclusive_nb(&file).unwrap_or(false) {
                // A free lock whose range a process still runs in: an orphan of a cordon that
                // died, not yet reaped (by the next cordon of its own state dir). Never share it.
                if range_in_use(index) {
                    continue;
                }
                self.cursor.store(index + 1, Ordering::Relaxed);
                return Some(Slot { index, file: Some(file), emptied: self.emptied.clone() });
            }
        }
        None
    }
}

impl Slots {
    /// Takes slot `index` back for a sandbox that still runs in its range, adopted from an
    /// owner that is gone: its lock, which that owner's death freed. Refused while another
    /// process holds it.
    pub fn claim(&self, index: u32) -> io::Result<Slot> {
        if index >= CAPACITY {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("uid slot {index} is out of range")));
        }
        let file = fs::OpenOptions::new().create(true).truncate(false).write(true).open(self.dir.join(index.to_string()))?;
        if !sys::flock_exclusive_nb(&file)? {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, format!("uid slot {index} is held by another process")));
        }
        Ok(Slot { index, file: Some(file), emptied: self.emptied.clone() })
    }
}

/// Whether any process on the host has a uid (real, effective, saved or filesystem) in slot
/// `index`'s range.
fn range_in_use(index: u32) -> bool {
    let lo = crate::UID_BASE + index * crate::UID_COUNT;
    let hi = lo + crate::UID_COUNT;
    let Ok(procs) = fs::read_dir("/proc") else { return false };
    procs.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit())).any(|e| {
        fs::read_to_string(e.path().join("status")).is_ok_and(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .is_some_and(|l| l.split_whitespace().skip(1).filter_map(|u| u.parse::<u32>().ok()).any(|u| (lo..hi).contains(&u)))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_slots_are_distinct_and_freed_on_drop() {
        let dir = std::env::temp_dir().join(format!("cordon-slots-{}", std::process::id()));
        let slots = Slots::open(&dir).unwrap();
        let a = slots.acquire().unwrap();
        let b = slots.acquire().unwrap();
        assert_ne!(a.index, b.index);
        let ai = a.index;
        drop(a);
        // The freed slot's lock can be taken again (whether acquire() hands it out also depends
        // on the host's processes, which other tests' sandboxes change meanwhile).
        let again = fs::OpenOptions::new().write(true).open(dir.join(ai.to_string())).unwrap();
        assert!(sys::flock_exclusive_nb(&again).unwrap());
        drop((b, again));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_emptied_slot_stays_locked_for_this_process_and_is_taken_first() {
        let dir = std::env::temp_dir().join(format!("cordon-slots-emptied-{}", std::process::id()));
        let slots = Slots::open(&dir).unwrap();
        let a = slots.acquire().unwrap();
        let ai = a.index;
        a.release_emptied();
        // Still locked: no other holder can take it meanwhile.
        let other = fs::OpenOptions::new().write(true).open(dir.join(ai.to_string())).unwrap();
        assert!(!sys::flock_exclusive_nb(&other).unwrap());
        let again = slots.acquire().unwrap();
        assert_eq!(again.index, ai);
        // A plain drop frees it for everyone.
        drop(again);
        assert!(sys::flock_exclusive_nb(&other).unwrap());
        drop(other);
        fs::remove_dir_all(&dir).unwrap();
    }
}
