//! The volume store: `<state>/volumes/<id>/` holds a volume's record (`volume.json`), its
//! filesystem image (`fs.ext4`), the lock file its leases hold (`lock`) and the mount point the
//! host mounts the image on (`mnt/`).
//!
//! Why an ext4 image per volume rather than a quota'd directory: the cap is the filesystem's own
//! size, so a full volume is ENOSPC inside whatever the host's filesystem is (project quotas need
//! a host filesystem mounted with them), a volume is one file to delete, and the images are
//! sparse, so an empty 10 GiB volume costs a few MiB. Only the host's kernel ever writes the
//! image's blocks (sandboxes write files through the mounted filesystem, never the image), so
//! the host never mounts a filesystem image that a sandbox could have crafted.

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use rustix::fs::{flock, FlockOperation};
use serde::{Deserialize, Serialize};

use crate::VolumeError;

/// The smallest cap: below this ext4's own metadata is most of the volume.
pub const MIN_SIZE: u64 = 16 << 20;
/// The largest cap ext4 with 4 KiB blocks and default features takes without surprises.
pub const MAX_SIZE: u64 = 16 << 40;
/// Owner of a new volume's root directory: the images' default user, so that a sandbox's
/// commands can write at the mount path without sudo.
const ROOT_OWNER: (u32, u32) = (1000, 1000);
const RECORD: &str = "volume.json";
const IMAGE: &str = "fs.ext4";
const LOCK: &str = "lock";
const MOUNT_LOCK: &str = "mount.lock";
const MNT: &str = "mnt";

/// A volume as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeInfo {
    /// A UUID, as E2B's volume ids are.
    pub id: String,
    pub name: String,
    pub size_bytes: u64,
    pub created_unix_ms: u64,
}

/// The store of every volume under one state directory.
#[derive(Debug, Clone)]
pub struct Volumes {
    dir: PathBuf,
}

/// A volume held in use: while a lease lives the volume cannot be deleted, by this process or
/// any other. Dropping it (a sandbox ends, a request completes) releases it.
#[derive(Debug)]
pub struct Lease {
    info: VolumeInfo,
    root: PathBuf,
    _lock: OwnedFd,
}

impl Lease {
    pub fn info(&self) -> &VolumeInfo {
        &self.info
    }

    /// The host directory where the volume's filesystem is mounted (nosuid, nodev).
    pub fn root(&self) -> &Path {
        &self.root
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> VolumeError + 'a {
    move |source| VolumeError::Io { op, path: path.to_path_buf(), source }
}

/// `^[a-zA-Z0-9_-]+$`, as E2B's API checks it, and at most 128 bytes.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 128 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A UUID in its canonical 8-4-4-4-12 lowercase hex form.
pub fn valid_id(id: &str) -> bool {
    id.len() == 36
        && id.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        })
}

fn new_uuid() -> Result<String, VolumeError> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| VolumeError::Io { op: "draw a volume id", path: PathBuf::new(), source: io::Error::other(e.to_string()) })?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32]))
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn open_lock(path: &Path) -> Result<OwnedFd, VolumeError> {
    let f = fs::OpenOptions::new().read(true).write(true).create(true).mode(0o600).custom_flags(libc::O_CLOEXEC).open(path).map_err(io_err("open the lock", path))?;
    Ok(f.into())
}

/// Runs `cmd`; its stderr's last line is the error.
fn run(cmd: &mut Command, what: &'static str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    Err(format!("{what}: {}", err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("failed").trim()))
}

/// The device mounted at `dir`, from this process's mount table.
fn mount_source(dir: &Path) -> Option<String> {
    let table = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = dir.to_str()?;
    table.lines().rev().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        (left.split(' ').nth(4)? == want).then(|| right.split(' ').nth(1).map(str::to_string)).flatten()
    })
}

/// Whether `dir` is the root of a mount (not a plain directory on its parent's filesystem).
fn is_mount_root(dir: &Path) -> Result<bool, VolumeError> {
    let st = rustix::fs::statx(rustix::fs::CWD, dir, rustix::fs::AtFlags::SYMLINK_NOFOLLOW, rustix::fs::StatxFlags::BASIC_STATS)
        .map_err(|e| VolumeError::Io { op: "stat the mount point", path: dir.to_path_buf(), source: e.into() })?;
    Ok(st.stx_attributes_mask.contains(rustix::fs::StatxAttributes::MOUNT_ROOT) && st.stx_attributes.contains(rustix::fs::StatxAttributes::MOUNT_ROOT))
}

impl Volumes {
    /// The store under `state_dir`, made (0700) if missing.
    pub fn open(state_dir: &Path) -> Result<Volumes, VolumeError> {
        let dir = state_dir.join("volumes");
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(io_err("create the volume store", &dir))?;
        Ok(Volumes { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Held while a create or a delete looks names up and changes the store, so that two
    /// creates of one name (from two processes) cannot both succeed.
    fn store_lock(&self) -> Result<OwnedFd, VolumeError> {
        let path = self.dir.join(".lock");
        let fd = open_lock(&path)?;
        flock(&fd, FlockOperation::LockExclusive).map_err(|e| VolumeError::Io { op: "lock the volume store", path, source: e.into() })?;
        Ok(fd)
    }

    /// Every volume, by name. A record that cannot be read is skipped with a warning: one
    /// damaged volume does not hide the others.
    pub fn list(&self) -> Result<Vec<VolumeInfo>, VolumeError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_err("list the volume store", &self.dir))? {
            let Ok(entry) = entry else { continue };
            let name = entry.file_name();
            let Some(id) = name.to_str().filter(|n| valid_id(n)) else { continue };
            match self.read_record(id) {
                Ok(info) => out.push(info),
                Err(e) => tracing::warn!(volume = id, error = %e, "skipping a volume whose record cannot be read"),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn read_record(&self, id: &str) -> Result<VolumeInfo, VolumeError> {
        let path = self.dir.join(id).join(RECORD);
        let text = match fs::read(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(VolumeError::NotFound(id.to_string())),
            r => r.map_err(io_err("read the volume record", &path))?,
        };
        serde_json::from_slice(&text).map_err(|e| VolumeError::Damaged { name: id.to_string(), detail: format!("its record {} is not valid: {e}", path.display()) })
    }

    /// The volume with this id.
    pub fn get(&self, id: &str) -> Result<VolumeInfo, VolumeError> {
        if !valid_id(id) {
            return Err(VolumeError::InvalidId(id.to_string()));
        }
        self.read_record(id)
    }

    /// The volume with this name.
    pub fn by_name(&self, name: &str) -> Result<VolumeInfo, VolumeError> {
        self.list()?.into_iter().find(|v| v.name == name).ok_or_else(|| VolumeError::NameNotFound(name.to_string()))
    }

    /// A new, empty volume of at most `size` bytes. Made in a staging directory and renamed
    /// into place complete, so a failure (or a crash) leaves no half-made volume.
    pub fn create(&self, name: &str, size: u64) -> Result<VolumeInfo, VolumeError> {
        if !valid_name(name) {
            return Err(VolumeError::InvalidName(name.to_string()));
        }
        if !(MIN_SIZE..=MAX_SIZE).contains(&size) {
            return Err(VolumeError::InvalidSize(size));
        }
        let _store = self.store_lock()?;
        if self.list()?.iter().any(|v| v.name == name) {
            return Err(VolumeError::NameTaken(name.to_string()));
        }
        let free = rustix::fs::statvfs(&self.dir).map(|s| s.f_bavail * s.f_frsize).unwrap_or(u64::MAX);
        if size > free {
            return Err(VolumeError::NoRoom { size, free });
        }
        let info = VolumeInfo { id: new_uuid()?, name: name.to_string(), size_bytes: size, created_unix_ms: now_ms() };
        let staging = self.dir.join(format!(".new-{}", info.id));
        let made = self.make(&staging, &info);
        if let Err(e) = made.and_then(|()| fs::rename(&staging, self.dir.join(&info.id)).map_err(io_err("move the new volume into place", &staging))) {
            let _ = rustix::mount::unmount(staging.join(MNT), rustix::mount::UnmountFlags::DETACH);
            let _ = fs::remove_dir_all(&staging);
            return Err(e);
        }
        tracing::info!(id = %info.id, name, size, "volume created");
        Ok(info)
    }

    fn make(&self, dir: &Path, info: &VolumeInfo) -> Result<(), VolumeError> {
        fs::DirBuilder::new().mode(0o700).create(dir).map_err(io_err("create the volume directory", dir))?;
        let image = dir.join(IMAGE);
        let f = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&image).map_err(io_err("create the volume image", &image))?;
        f.set_len(info.size_bytes).map_err(io_err("size the volume image", &image))?;
        drop(f);
        // No reserved blocks (the whole cap is the sandbox's), remount read-only on an error
        // rather than go on writing a damaged filesystem, and the inode tables left to the
        // kernel to initialise lazily so that a create takes milliseconds at any size.
        let root_owner = format!("root_owner={}:{},lazy_itable_init=1,lazy_journal_init=1,nodiscard", ROOT_OWNER.0, ROOT_OWNER.1);
        run(
            Command::new("mkfs.ext4").args(["-q", "-F", "-m", "0", "-e", "remount-ro", "-L", "cordon-volume", "-E", &root_owner]).arg(&image),
            "mkfs.ext4",
        )
        .map_err(|detail| VolumeError::Mkfs { name: info.name.clone(), detail })?;
        fs::DirBuilder::new().mode(0o700).create(dir.join(MNT)).map_err(io_err("create the mount point", dir))?;
        // `lost+found` is e2fsck's; a user's volume starts empty (e2fsck makes it again when it
        // needs it).
        let mnt = dir.join(MNT);
        self.mount_image(&image, &mnt, &info.name)?;
        let cleared = fs::remove_dir(mnt.join("lost+found")).map_err(io_err("remove lost+found", &mnt));
        let _ = rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::empty());
        cleared?;
        open_lock(&dir.join(LOCK))?;
        let record = serde_json::to_vec_pretty(info).expect("a volume record serializes");
        fs::write(dir.join(RECORD), record).map_err(io_err("write the volume record", dir))?;
        Ok(())
    }

    fn mount_image(&self, image: &Path, mnt: &Path, name: &str) -> Result<(), VolumeError> {
        run(Command::new("mount").args(["-t", "ext4", "-o", "loop,nosuid,nodev,noatime"]).arg(image).arg(mnt), "mount")
            .map_err(|detail| VolumeError::Damaged { name: name.to_string(), detail: format!("its image {} does not mount ({detail}); check it with `e2fsck -f {}` or delete the volume", image.display(), image.display()) })?;
        // Direct I/O from the loop device to its image: the volume's pages are cached once (by
        // its own filesystem), not a second time as the image file's, and measured here that is
        // also the faster way (bench/run's volume rows). Where the host's filesystem cannot, the
        // loop device stays buffered.
        if let Some(dev) = mount_source(mnt) {
            if let Err(e) = run(Command::new("losetup").arg("--direct-io=on").arg(&dev), "losetup --direct-io=on") {
                tracing::debug!(volume = name, "{e}; the volume's loop device stays buffered");
            }
        }
        Ok(())
    }

    /// Holds the volume with this id in use and mounts it on the host if it is not yet.
    pub fn lease(&self, id: &str) -> Result<Lease, VolumeError> {
        let info = self.get(id)?;
        let dir = self.dir.join(&info.id);
        let lock = open_lock(&dir.join(LOCK))?;
        // Shared with every other user; a delete holds it exclusively for as long as it takes
        // to check and remove.
        flock(&lock, FlockOperation::LockShared).map_err(|e| VolumeError::Io { op: "lock the volume", path: dir.clone(), source: e.into() })?;
        // A delete that got in first removed the record.
        let info = self.get(id)?;
        let root = dir.join(MNT);
        let mount_lock = open_lock(&dir.join(MOUNT_LOCK))?;
        flock(&mount_lock, FlockOperation::LockExclusive).map_err(|e| VolumeError::Io { op: "lock the volume's mount", path: dir.clone(), source: e.into() })?;
        if !is_mount_root(&root)? {
            self.mount_image(&dir.join(IMAGE), &root, &info.name)?;
            tracing::debug!(id, name = %info.name, "volume mounted");
        }
        Ok(Lease { info, root, _lock: lock })
    }

    /// Like [`Volumes::lease`], by name.
    pub fn lease_by_name(&self, name: &str) -> Result<Lease, VolumeError> {
        let info = self.by_name(name)?;
        self.lease(&info.id)
    }

    /// Deletes a volume no one holds: its files and image are gone. A volume in use (by a
    /// sandbox, running or paused, or a request) is refused.
    pub fn delete(&self, id: &str) -> Result<VolumeInfo, VolumeError> {
        let info = self.get(id)?;
        let _store = self.store_lock()?;
        let dir = self.dir.join(&info.id);
        let lock = open_lock(&dir.join(LOCK))?;
        match flock(&lock, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => return Err(VolumeError::InUse(info.name)),
            Err(e) => return Err(VolumeError::Io { op: "lock the volume", path: dir, source: e.into() }),
        }
        // The record goes first: from here on the volume does not exist for anyone, and a
        // crash below leaves only files that `reap` finds.
        let doomed = self.dir.join(format!(".deleted-{}", info.id));
        fs::rename(&dir, &doomed).map_err(io_err("move the volume out of the store", &dir))?;
        drop(lock);
        self.remove_doomed(&doomed);
        tracing::info!(id = %info.id, name = %info.name, "volume deleted");
        Ok(info)
    }

    fn remove_doomed(&self, doomed: &Path) {
        let mnt = doomed.join(MNT);
        if is_mount_root(&mnt).unwrap_or(false) {
            // Nothing holds it (the exclusive lock said so); a lazy unmount still lets a
            // straggling reader finish rather than fail the delete.
            if let Err(e) = rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::DETACH) {
                tracing::warn!(path = %mnt.display(), error = %e, "unmount a deleted volume");
                return;
            }
        }
        if let Err(e) = fs::remove_dir_all(doomed) {
            tracing::warn!(path = %doomed.display(), error = %e, "remove a deleted volume");
        }
    }

    /// Removes what an interrupted create or delete left (staging and deleted directories).
    pub fn reap(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".new-") || name.starts_with(".deleted-") {
                self.remove_doomed(&entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids_are_checked_as_e2b_does() {
        assert!(valid_name("data_1-x"));
        for bad in ["", "a b", "a/b", "..", "é", &"x".repeat(129)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
        let id = new_uuid().unwrap();
        assert!(valid_id(&id), "{id}");
        assert_eq!(&id[14..15], "4");
        for bad in ["", "not-a-uuid", &id.to_uppercase(), &id[1..], &format!("{}/", &id[..35])] {
            assert!(!valid_id(bad), "{bad:?}");
        }
    }

    /// A store in a temporary state dir; the tests that mount need root (CI runs as root).
    fn scratch(name: &str) -> Option<(PathBuf, Volumes)> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: mounting a volume needs root");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("cordon-volstore-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let v = Volumes::open(&dir).unwrap();
        Some((dir, v))
    }

    fn cleanup(dir: &Path, v: &Volumes) {
        for info in v.list().unwrap() {
            let _ = v.delete(&info.id);
        }
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn a_leased_volume_cannot_be_deleted_and_a_released_one_goes_whole() {
        let Some((dir, v)) = scratch("lease") else { return };
        let info = v.create("data", MIN_SIZE).unwrap();
        assert!(matches!(v.create("data", MIN_SIZE), Err(VolumeError::NameTaken(_))));
        let image = dir.join("volumes").join(&info.id).join(IMAGE);
        // Sparse: a new volume takes a small part of its cap on the host's disk.
        let on_disk = std::os::unix::fs::MetadataExt::blocks(&fs::metadata(&image).unwrap()) * 512;
        assert!(on_disk < info.size_bytes / 2, "{on_disk} of {}", info.size_bytes);
        let lease = v.lease_by_name("data").unwrap();
        assert!(is_mount_root(lease.root()).unwrap());
        fs::write(lease.root().join("f"), "x").unwrap();
        // A second holder (another sandbox) shares it; a delete is refused while either holds.
        let second = v.lease(&info.id).unwrap();
        assert!(matches!(v.delete(&info.id), Err(VolumeError::InUse(_))));
        drop(lease);
        assert!(matches!(v.delete(&info.id), Err(VolumeError::InUse(_))));
        assert_eq!(fs::read_to_string(second.root().join("f")).unwrap(), "x");
        drop(second);
        v.delete(&info.id).unwrap();
        assert!(matches!(v.get(&info.id), Err(VolumeError::NotFound(_))));
        assert!(!dir.join("volumes").join(&info.id).exists());
        assert!(fs::read_dir(dir.join("volumes")).unwrap().flatten().all(|e| e.file_name().to_string_lossy().starts_with(".")));
        cleanup(&dir, &v);
    }

    #[test]
    fn a_failed_create_leaves_no_half_made_volume() {
        let Some((dir, v)) = scratch("failed") else { return };
        assert!(matches!(v.create("bad name", MIN_SIZE), Err(VolumeError::InvalidName(_))));
        assert!(matches!(v.create("tiny", 1 << 20), Err(VolumeError::InvalidSize(_))));
        assert!(matches!(v.create("huge", MAX_SIZE), Err(VolumeError::NoRoom { .. })), "16 TiB does not fit here");
        // An interrupted create's staging directory is reaped.
        fs::create_dir(dir.join("volumes/.new-0")).unwrap();
        v.reap();
        assert!(v.list().unwrap().is_empty());
        assert_eq!(fs::read_dir(dir.join("volumes")).unwrap().flatten().filter(|e| e.file_name() != ".lock").count(), 0);
        cleanup(&dir, &v);
    }
}
