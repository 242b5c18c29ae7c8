//! Filesystem helpers: locking, atomic replacement, safe tree removal and
//! size accounting.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// True when running with effective uid 0.
pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// An exclusive flock held until drop (closing the descriptor releases it).
#[derive(Debug)]
pub(crate) struct FileLock {
    _file: File,
}

/// Outcome of a non-blocking lock attempt.
pub(crate) enum TryLock {
    Acquired(FileLock),
    Busy(File),
}

fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: the descriptor belongs to `file`, which outlives the call;
        // flock does not touch memory.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}

/// Tries to take an exclusive lock on `path` (created if missing) without
/// waiting.
pub(crate) fn try_lock(path: &Path) -> io::Result<TryLock> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(()) => Ok(TryLock::Acquired(FileLock { _file: file })),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(TryLock::Busy(file)),
        Err(e) => Err(e),
    }
}

/// Waits for the lock on a file returned by [`try_lock`] as busy.
pub(crate) fn lock_blocking(file: File) -> io::Result<FileLock> {
    flock(&file, libc::LOCK_EX)?;
    Ok(FileLock { _file: file })
}

/// Atomically swaps two existing paths (renameat2 RENAME_EXCHANGE), so that
/// a replaced image is never missing, not even for an instant.
pub(crate) fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    let ca = cstring(a)?;
    let cb = cstring(b)?;
    // SAFETY: both pointers are valid NUL-terminated strings that outlive
    // the call; the flags value is a plain integer. The raw syscall is used
    // because not every libc exposes a renameat2 wrapper.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Flushes the filesystem holding `path` to disk, so that a renamed-in image
/// is complete on disk before its name becomes visible.
pub(crate) fn syncfs(path: &Path) -> io::Result<()> {
    let dir = File::open(path)?;
    // SAFETY: the descriptor belongs to `dir`, which outlives the call.
    let rc = unsafe { libc::syncfs(dir.as_raw_fd()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// fsyncs a directory so a rename inside it is durable.
pub(crate) fn sync_dir(path: &Path) -> io::Result<()> {
    File::open(path)?.sync_all()
}

/// Decodes the octal escapes (`\040` etc.) the kernel uses in mountinfo.
fn unescape_mountinfo(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let oct = &bytes[i + 1..i + 4];
            if oct.iter().all(|b| (b'0'..=b'7').contains(b)) {
                let v = (oct[0] - b'0') as u32 * 64
                    + (oct[1] - b'0') as u32 * 8
                    + (oct[2] - b'0') as u32;
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    PathBuf::from(std::ffi::OsStr::from_bytes(&out))
}

/// Lazily unmounts everything mounted at or below `dir`.
///
/// mmdebstrap mounts /proc, /sys and device nodes into the tree it builds;
/// if it was killed those mounts stay behind, and deleting through them
/// would reach host filesystems.
pub(crate) fn unmount_under(dir: &Path) {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mountinfo)
        .filter(|p| p.starts_with(dir))
        .collect();
    // Deepest first so parents are not busy.
    points.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    points.dedup();
    for p in points {
        let Ok(c) = cstring(&p) else { continue };
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        if rc != 0 {
            tracing::warn!(path = %p.display(), error = %io::Error::last_os_error(), "cannot unmount leftover mount");
        } else {
            tracing::debug!(path = %p.display(), "unmounted leftover mount");
        }
    }
}

/// Deletes a directory tree without following symlinks and without crossing
/// into other filesystems (a mount point below `path` is an error, never a
/// reason to delete the mounted filesystem's contents).
pub(crate) fn remove_tree(path: &Path) -> io::Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        return fs::remove_file(path);
    }
    unmount_under(path);
    remove_contents(path, meta.dev(), meta.mode())?;
    fs::remove_dir(path)
}

fn remove_contents(dir: &Path, dev: u64, mode: u32) -> io::Result<()> {
    // Unpacked images may contain read-only directories; without owner
    // write/search permission a non-root caller could not empty them.
    if mode & 0o700 != 0o700 {
        let _ = fs::set_permissions(dir, fs::Permissions::from_mode((mode | 0o700) & 0o7777));
    }
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let p = entry.path();
        let m = fs::symlink_metadata(&p)?;
        if m.is_dir() {
            if m.dev() != dev {
                return Err(io::Error::other(format!(
                    "refusing to delete {}: it is a mount point (unmount it first)",
                    p.display()
                )));
            }
            remove_contents(&p, dev, m.mode())?;
            fs::remove_dir(&p)?;
        } else {
            fs::remove_file(&p)?;
        }
    }
    Ok(())
}

/// Disk usage of a tree: allocated blocks of every inode, counted once per
/// hard-linked inode, symlinks not followed, other filesystems not entered.
pub(crate) fn tree_size(root: &Path) -> io::Result<u64> {
    let meta = fs::symlink_metadata(root)?;
    let dev = meta.dev();
    let mut seen = HashSet::new();
    let mut total = meta.blocks() * 512;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let m = entry.metadata()?; // DirEntry::metadata does not follow symlinks
            if m.dev() != dev {
                continue;
            }
            if m.nlink() > 1 && !m.is_dir() && !seen.insert((m.dev(), m.ino())) {
                continue;
            }
            // st_blocks is what the data really occupies (sparse files,
            // compression); fall back to the length where a filesystem
            // reports no blocks at all.
            let used = m.blocks() * 512;
            total += if used == 0 && m.is_file() {
                m.len()
            } else {
                used
            };
            if m.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    Ok(total)
}

/// Reads `rel` below `root` refusing to follow a symlink at any component,
/// so a crafted image cannot make the store read host files.
pub(crate) fn read_inside(root: &Path, rel: &str) -> io::Result<Vec<u8>> {
    let mut path = root.to_path_buf();
    let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty()).collect();
    for (i, part) in parts.iter().enumerate() {
        path.push(part);
        let m = fs::symlink_metadata(&path)?;
        if m.file_type().is_symlink() {
            return Err(io::Error::other(format!("{} is a symlink", path.display())));
        }
        if i + 1 < parts.len() && !m.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} is not a directory", path.display()),
            ));
        }
    }
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    let mut buf = Vec::new();
    io::Read::read_to_end(&mut io::Read::take(&mut f, 16 << 20), &mut buf)?;
    Ok(buf)
}

/// Creates the directories every sandbox mounts over, leaving existing
/// entries (including symlinks) alone.
pub(crate) fn ensure_mount_dirs(rootfs: &Path) -> io::Result<()> {
    for (dir, mode) in [
        ("proc", 0o555),
        ("dev", 0o755),
        ("sys", 0o555),
        ("tmp", 0o1777),
    ] {
        let p = rootfs.join(dir);
        match fs::symlink_metadata(&p) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir(&p)?;
                // Explicit chmod because create_dir is subject to the umask.
                fs::set_permissions(&p, fs::Permissions::from_mode(mode))?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(unescape_mountinfo("/a\\040b"), PathBuf::from("/a b"));
        assert_eq!(unescape_mountinfo("/plain"), PathBuf::from("/plain"));
        assert_eq!(unescape_mountinfo("/end\\"), PathBuf::from("/end\\"));
        assert_eq!(unescape_mountinfo("/x\\134y"), PathBuf::from("/x\\y"));
    }
}
