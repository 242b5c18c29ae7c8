//! Starting VMs from a snapshot of a booted guest, as E2B does with Firecracker.
//!
//! A template VM boots cold with exactly the arguments a sandbox's VM would get and stops at
//! the point where the guest init asks for its config (`R`, see [`crate::link_handshake`]): its
//! kernel is up, its modules are loaded, its disks are mounted. The VMM then writes the
//! machine's state into a file (QMP `migrate` to a descriptor), and its writable layer is kept
//! next to it. A sandbox's VM then starts its VMM with `-incoming` on that file and a copy of
//! that layer, and the guest carries on from the config: it receives its identity, the time
//! and a fresh seed for its RNG as a cold guest does.
//!
//! A snapshot belongs to one set of VMM arguments (memory, vCPUs, accelerator, kernel command
//! line) and one set of files (VMM binary, kernel, initramfs, image disk, the size of the
//! writable layer), and its name is a digest of all of them: a sandbox whose caps differ gets
//! its own, and any change of kit, image or QEMU makes a new one. The first VM of a kind pays
//! for the template (one cold boot and about a second more); later ones restore.
//!
//! What VMs of one snapshot share: the guest kernel's address layout (KASLR is decided at
//! boot) and `boot_id`. Their RNG is reseeded from the host, their clock set, their hostname
//! their own. `CORDON_VM_SNAPSHOTS=0` boots every VM cold.
//!
//! At most [`KEEP`] snapshots are kept, the most recently used ones, so that hosts whose VMM
//! arguments drift (a TSC frequency read from a scaling CPU) do not fill their disk.

use crate::vmm::{BootSpec, Vmm};
use sha2::{Digest, Sha256};
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub const ENV_SNAPSHOTS: &str = "CORDON_VM_SNAPSHOTS";
/// Snapshots kept (each is about the guest's touched RAM, some 90 MB for a 512 MiB guest).
pub const KEEP: usize = 8;

pub fn enabled() -> bool {
    std::env::var_os(ENV_SNAPSHOTS).is_none_or(|v| v != "0")
}

/// A saved, booted guest: the machine state and the writable layer it was saved with.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub dir: PathBuf,
}

impl Snapshot {
    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    pub fn rw(&self) -> PathBuf {
        self.dir.join("rw.ext4")
    }

    pub fn exists(&self) -> bool {
        self.state().is_file() && self.rw().is_file()
    }

    /// Marks it used now, for [`prune`].
    pub fn touch(&self) {
        if let Ok(d) = fs::File::open(&self.dir) {
            let _ = d.set_modified(std::time::SystemTime::now());
        }
    }
}

/// Removes all but the [`KEEP`] most recently used snapshots.
pub fn prune(snapshots: &Path) {
    let Ok(entries) = fs::read_dir(snapshots) else { return };
    let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.') && e.path().is_dir())
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    for (_, d) in dirs.into_iter().skip(KEEP) {
        tracing::debug!(snapshot = %d.display(), "removing a snapshot not used lately");
        let _ = fs::remove_dir_all(&d);
        let _ = fs::remove_file(d.with_extension("lock"));
    }
}

/// The snapshot for VMs booted by `vmm` with `spec` (as the VMM sees it) from these host files.
pub fn of(snapshots: &Path, vmm: &dyn Vmm, spec: &BootSpec, host_files: &[&Path], rw_bytes: u64) -> io::Result<Snapshot> {
    Ok(Snapshot { dir: snapshots.join(key(vmm, spec, host_files, rw_bytes)?) })
}

/// What a saved VM state belongs to: the VMM's arguments, its binary and the host files it
/// boots from (by inode, size and time), and the writable layer's size.
pub fn key(vmm: &dyn Vmm, spec: &BootSpec, host_files: &[&Path], rw_bytes: u64) -> io::Result<String> {
    let mut h = Sha256::new();
    for a in vmm.args(spec) {
        h.update(a.as_bytes());
        h.update([0]);
    }
    for f in std::iter::once(vmm.binary()).chain(host_files.iter().copied()) {
        let m = fs::metadata(f)?;
        h.update(format!("{}\0{}\0{}\0{}\0", f.display(), m.ino(), m.len(), m.mtime_nsec() + m.mtime() * 1_000_000_000).as_bytes());
    }
    h.update(rw_bytes.to_le_bytes());
    Ok(h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect())
}

/// Holds the snapshot's build lock: two cordon processes that need the same snapshot build it
/// once.
pub struct BuildLock {
    _file: fs::File,
}

pub fn lock(snap: &Snapshot) -> io::Result<BuildLock> {
    let path = snap.dir.with_extension("lock");
    let f = fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path)?;
    // Blocks until the other builder is done.
    cordon_host::sys::flock_exclusive(&f)?;
    Ok(BuildLock { _file: f })
}

/// Moves a finished template (`tmp` holds `state` and `rw.ext4`) into place.
pub fn publish(tmp: &Path, snap: &Snapshot) -> io::Result<()> {
    match fs::rename(tmp, &snap.dir) {
        Ok(()) => Ok(()),
        Err(_) if snap.exists() => fs::remove_dir_all(tmp),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    #[test]
    fn prune_keeps_the_most_recently_used_and_unfinished_ones() {
        let root = std::env::temp_dir().join(format!("cordon-snap-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join(".template-in-progress")).unwrap();
        let now = SystemTime::now();
        for i in 0..KEEP + 3 {
            let d = root.join(format!("s{i:02}"));
            fs::create_dir(&d).unwrap();
            // s00 is the most recently used.
            fs::File::open(&d).unwrap().set_modified(now - Duration::from_secs(60 * i as u64)).unwrap();
        }
        prune(&root);
        let mut left: Vec<String> = fs::read_dir(&root).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        let mut want: Vec<String> = (0..KEEP).map(|i| format!("s{i:02}")).collect();
        want.insert(0, ".template-in-progress".into());
        assert_eq!(left, want);
        fs::remove_dir_all(&root).unwrap();
    }
}
