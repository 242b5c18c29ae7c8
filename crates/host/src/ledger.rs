//! The run ledger: what is on disk about each live sandbox of a tier, enough to reap it after
//! a crash of the cordon process that owned it.
//!
//! Each sandbox has a directory `<run>/<id>` holding a `lock` file, which its owner holds locked
//! for the sandbox's whole life, and a `record.json` (id, cgroup, pid). A lock anyone can take
//! means a dead owner: [`Ledger::reap`] then kills the record's cgroup and removes the directory.
//! The tier keeps its own per-sandbox files (sockets, disks, bundles) in the same directory, so
//! removing it leaves nothing behind.
//!
//! A sandbox made to outlive its owner (`keep` in its record: a server's, which the next
//! server on the same state directory adopts) is not reaped while its init runs; the adopter
//! takes its lock back with [`Ledger::adopt`] and reaps the kept ones it does not adopt with
//! [`Ledger::reap_kept`].
//!
//! A directory being created right now may not have its lock or its record yet; only one older
//! than [`CREATE_GRACE`] without them is the leftover of a create that died, so two cordon
//! processes sharing a state directory never reap each other's sandboxes mid-create.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cgroup::Cgroup;
use crate::sys;

/// How long a sandbox directory may lack its lock or record before it counts as abandoned.
pub const CREATE_GRACE: Duration = Duration::from_secs(30);

/// How long a reap waits for a dead owner's processes to go.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// What is on disk about one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub cgroup: Cgroup,
    /// The host pid of the sandbox's first process, once there is one.
    #[serde(default)]
    pub pid: Option<i32>,
    /// The uid-range slot it holds, where the tier uses one (informational: a slot's own lock
    /// frees it when its holder dies).
    #[serde(default)]
    pub slot: Option<u32>,
    /// Left running when its owner exits, for the next owner to adopt.
    #[serde(default)]
    pub keep: bool,
}

impl Record {
    /// Whether its first process still runs in its groups (a pid alone could have been reused).
    pub fn init_alive(&self) -> bool {
        self.pid.is_some_and(|p| self.cgroup.holds(p))
    }
}

/// One tier's `run` directory.
#[derive(Debug)]
pub struct Ledger {
    dir: PathBuf,
    /// What a reap log line calls one entry ("sandbox", "gvisor sandbox", "VM").
    kind: &'static str,
}

/// One live sandbox's directory, its lock held until this is dropped.
#[derive(Debug)]
pub struct Entry {
    dir: PathBuf,
    _lock: File,
}

impl Ledger {
    /// Opens (creating) the run directory `dir`.
    pub fn open(dir: PathBuf, kind: &'static str) -> io::Result<Ledger> {
        fs::create_dir_all(&dir).map_err(|e| io::Error::new(e.kind(), format!("create {}: {e}", dir.display())))?;
        Ok(Ledger { dir, kind })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Makes sandbox `id`'s directory (with `mode`) and takes its lock. A directory of that name
    /// already existing is an error (ids are unique; a stale one is the reaper's to remove).
    pub fn begin(&self, id: &str, mode: u32) -> io::Result<Entry> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = self.dir.join(id);
        fs::DirBuilder::new()
            .mode(mode)
            .create(&dir)
            .map_err(|e| io::Error::new(e.kind(), format!("create {}: {e}", dir.display())))?;
        let locked = File::create(dir.join("lock")).and_then(|lock| {
            // A reaper in another process may hold the lock for a moment (it then sees a young
            // directory without a record and leaves it): wait for it rather than fail.
            sys::flock_exclusive(&lock)?;
            Ok(lock)
        });
        match locked {
            Ok(lock) => Ok(Entry { dir, _lock: lock }),
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                Err(io::Error::new(e.kind(), format!("lock {}: {e}", dir.display())))
            }
        }
    }

    /// Kills and removes every sandbox whose owner is gone, except those kept for the next
    /// owner whose init still runs. Returns how many.
    pub fn reap(&self) -> usize {
        let Ok(entries) = fs::read_dir(&self.dir) else { return 0 };
        entries.flatten().filter(|e| self.reap_one(&e.path(), young(e), false)).count()
    }

    /// Kills and removes every sandbox whose owner is gone, the kept ones included: what an
    /// adopter did not take back. Returns how many.
    pub fn reap_kept(&self) -> usize {
        let Ok(entries) = fs::read_dir(&self.dir) else { return 0 };
        entries.flatten().filter(|e| self.reap_one(&e.path(), young(e), true)).count()
    }

    /// Whether sandbox `id` has a directory here (a live sandbox, or one not reaped yet).
    pub fn has(&self, id: &str) -> bool {
        !id.is_empty() && !id.contains('/') && self.dir.join(id).exists()
    }

    /// The records of the sandboxes kept for a next owner whose owner is gone and whose init
    /// still runs: what [`Ledger::adopt`] can take back.
    pub fn kept(&self) -> Vec<Record> {
        let Ok(entries) = fs::read_dir(&self.dir) else { return Vec::new() };
        entries
            .flatten()
            .filter_map(|e| {
                let lock = File::open(e.path().join("lock")).ok()?;
                // Taken and let go at once: only a free lock says the owner is gone.
                if !sys::flock_exclusive_nb(&lock).unwrap_or(false) {
                    return None;
                }
                read_record(&e.path()).filter(|r| r.keep && r.init_alive())
            })
            .collect()
    }

    /// Takes back the entry of sandbox `id`, kept by an owner that is gone: its lock, held
    /// from now on, and its record. Refused when another process holds it, when it was not
    /// kept, or when its init is gone.
    pub fn adopt(&self, id: &str) -> io::Result<(Entry, Record)> {
        let dir = self.dir.join(id);
        let lock = File::open(dir.join("lock")).map_err(|e| io::Error::new(e.kind(), format!("open {}/lock: {e}", dir.display())))?;
        if !sys::flock_exclusive_nb(&lock)? {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, format!("{} {id} is owned by a running cordon process", self.kind)));
        }
        let rec = read_record(&dir).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("{} {id} has no readable record", self.kind)))?;
        if !rec.keep || !rec.init_alive() {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} {id} was not kept running", self.kind)));
        }
        Ok((Entry { dir, _lock: lock }, rec))
    }

    /// Reaps one directory if its owner is dead (and, unless `kept_too`, it was not kept for
    /// the next owner with its init running); true when it was removed.
    fn reap_one(&self, dir: &Path, young: bool, kept_too: bool) -> bool {
        let Ok(lock) = File::open(dir.join("lock")) else {
            if !young {
                let _ = fs::remove_dir_all(dir);
            }
            return false;
        };
        if !sys::flock_exclusive_nb(&lock).unwrap_or(false) {
            return false; // its owner is alive
        }
        match read_record(dir) {
            Some(rec) if rec.keep && !kept_too && rec.init_alive() => return false,
            Some(rec) => {
                tracing::info!(id = %rec.id, "reaping {} left by a dead cordon process", self.kind);
                // A v1 freezer holds even killed tasks until they are thawed.
                if rec.cgroup.is_frozen() {
                    let _ = rec.cgroup.freeze(false);
                }
                rec.cgroup.kill_and_wait(KILL_WAIT);
                let _ = rec.cgroup.remove();
            }
            None if young => return false,
            None => {}
        }
        remove_entry_dir(dir);
        true
    }
}

impl Entry {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `rec`, atomically: a reaper sees the old record or the new one, never half.
    pub fn write(&self, rec: &Record) -> io::Result<()> {
        let tmp = self.dir.join("record.json.tmp");
        let bytes = serde_json::to_vec(rec).map_err(io::Error::other)?;
        fs::write(&tmp, bytes)?;
        fs::rename(&tmp, self.dir.join("record.json"))
    }

    /// Removes the directory and everything in it (the lock stays held until drop, so no reaper
    /// races the removal).
    pub fn remove(&self) {
        remove_entry_dir(&self.dir);
    }

    /// Where a sandbox whose writable layer the host keeps mounts it (see [`KEPT_WRITABLE`]).
    pub fn kept_writable(&self) -> PathBuf {
        self.dir.join(KEPT_WRITABLE)
    }
}

/// Writes a tier's own facts of a kept sandbox (what an adopter needs that the record does not
/// hold) as `name` in its directory `dir`, atomically. Written before the record says `keep`,
/// so that an adopter finds both or neither.
pub fn write_facts<T: Serialize>(dir: &Path, name: &str, facts: &T) -> io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    fs::write(&tmp, serde_json::to_vec(facts).map_err(io::Error::other)?)?;
    fs::rename(&tmp, dir.join(name))
}

/// Reads what [`write_facts`] wrote.
pub fn read_facts<T: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> io::Result<T> {
    let path = dir.join(name);
    let bytes = fs::read(&path)?;
    serde_json::from_slice(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))
}

/// The directory in an entry where a writable layer the host can read is mounted (a tmpfs
/// that the sandbox's overlay writes to); it is unmounted before the entry goes, however the
/// owner ended.
pub const KEPT_WRITABLE: &str = "rw";

fn remove_entry_dir(dir: &Path) {
    if let Err(e) = sys::umount_detach(&dir.join(KEPT_WRITABLE)) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot unmount a kept writable layer");
    }
    let _ = fs::remove_dir_all(dir);
}

fn read_record(dir: &Path) -> Option<Record> {
    let bytes = fs::read(dir.join("record.json")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

fn young(e: &fs::DirEntry) -> bool {
    e.metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age < CREATE_GRACE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::Layout;

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cordon-ledger-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn record(ledger: &Ledger, id: &str) -> Record {
        // A plan under an empty layout names no groups: reaping it kills nothing on the host.
        let layout = Layout::detect_at(&ledger.dir.join("no-cgroups"));
        Record { id: id.into(), cgroup: Cgroup::plan(&layout, id), pid: None, slot: Some(3), keep: false }
    }

    #[test]
    fn a_live_entry_is_kept_and_a_dead_one_reaped() {
        let root = temp("live");
        let ledger = Ledger::open(root.join("run"), "sandbox").unwrap();
        let live = ledger.begin("live", 0o700).unwrap();
        live.write(&record(&ledger, "live")).unwrap();
        let dead = ledger.begin("dead", 0o700).unwrap();
        dead.write(&record(&ledger, "dead")).unwrap();
        drop(dead); // its owner "dies": the lock is free

        assert_eq!(ledger.reap(), 1);
        assert!(live.dir().join("record.json").exists(), "a held entry must survive a reap");
        assert!(!ledger.dir().join("dead").exists(), "a free entry must be removed");
        let rec = read_record(live.dir()).unwrap();
        assert_eq!((rec.id.as_str(), rec.slot), ("live", Some(3)));
        drop(live);
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn a_young_directory_without_lock_or_record_is_left_for_its_creator() {
        let root = temp("young");
        let ledger = Ledger::open(root.join("run"), "sandbox").unwrap();
        // Mid-create: a directory with no lock yet, and one locked by nobody with no record yet.
        fs::create_dir(ledger.dir().join("no-lock")).unwrap();
        fs::create_dir(ledger.dir().join("no-record")).unwrap();
        File::create(ledger.dir().join("no-record/lock")).unwrap();
        assert_eq!(ledger.reap(), 0);
        assert!(ledger.dir().join("no-lock").exists() && ledger.dir().join("no-record").exists());

        // The same, past the grace: leftovers of creates that died.
        assert!(!ledger.reap_one(&ledger.dir().join("no-lock"), false, false));
        assert!(ledger.reap_one(&ledger.dir().join("no-record"), false, false));
        assert!(!ledger.dir().join("no-lock").exists() && !ledger.dir().join("no-record").exists());
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn begin_refuses_an_existing_id_and_leaves_it_alone() {
        let root = temp("dup");
        let ledger = Ledger::open(root.join("run"), "sandbox").unwrap();
        let first = ledger.begin("x", 0o700).unwrap();
        first.write(&record(&ledger, "x")).unwrap();
        assert!(ledger.begin("x", 0o700).is_err());
        assert!(first.dir().join("record.json").exists(), "a failed begin must not remove another's entry");
        first.remove();
        assert!(!ledger.dir().join("x").exists());
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn records_of_older_layouts_still_read() {
        // gvisor and vm records had no slot; the ns tier's had a bare number.
        let root = temp("old");
        let ledger = Ledger::open(root.join("run"), "sandbox").unwrap();
        let e = ledger.begin("old", 0o700).unwrap();
        let mut v = serde_json::to_value(record(&ledger, "old")).unwrap();
        v.as_object_mut().unwrap().remove("slot");
        fs::write(e.dir().join("record.json"), v.to_string()).unwrap();
        assert_eq!(read_record(e.dir()).unwrap().slot, None);
        let _ = fs::remove_dir_all(&root);
    }
}
