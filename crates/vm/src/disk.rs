//! Disks: the image as a read-only ext4 disk, cached per image and shared by every VM of it,
//! and each VM's writable layer.
//!
//! The writable layer is a sparse raw file on the host, sized by the disk cap and formatted
//! ext4 without a journal (the layer dies with the VM, so crash consistency buys nothing).
//! Chosen over a tmpfs in the guest because guest RAM is the memory cap: a tmpfs there would
//! make disk and memory compete, and `--disk 4G --memory 512M` impossible. Chosen over a qcow2
//! overlay because the overlay is made by overlayfs in the guest already and a raw file needs
//! no qemu-img; the host file only takes the blocks the guest writes (discard gives them back).

use crate::VmError;
use cordon_image::Progress;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn mkfs(args: &[&str], what: &str) -> Result<(), VmError> {
    let out = Command::new("mkfs.ext4")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| VmError::Unsupported(format!("cannot run mkfs.ext4 ({e}): install e2fsprogs (scripts/install-deps)")))?;
    if !out.status.success() {
        return Err(VmError::Disk(format!("{what}: mkfs.ext4 failed: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(())
}

/// Bytes and inodes a tree needs (allocated blocks, so sparse files count what they hold).
fn tree_usage(root: &Path) -> (u64, u64) {
    let (mut bytes, mut inodes) = (0u64, 0u64);
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let Ok(m) = e.path().symlink_metadata() else { continue };
            inodes += 1;
            bytes += m.blocks() * 512;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    (bytes, inodes)
}

/// The read-only disk of `image`, made from its tree on first use (and again when the image
/// was rebuilt: the key is the tree's inode and mtime, or for a layered image the digest of its
/// layer list, whose directories are named by content).
pub fn root_disk(vm_dir: &Path, image: &str, layers: &[PathBuf], progress: &mut dyn Progress) -> Result<PathBuf, VmError> {
    let dir = vm_dir.join("disks");
    let key = match layers {
        [rootfs] => {
            let m = fs::metadata(rootfs).map_err(|e| VmError::Disk(format!("image {image}: {}: {e}", rootfs.display())))?;
            format!("{:x}-{:x}", m.ino(), m.mtime())
        }
        _ => {
            use sha2::Digest as _;
            let mut h = sha2::Sha256::new();
            for l in layers {
                h.update(l.as_os_str().as_encoded_bytes());
                h.update([0]);
            }
            format!("{:x}", h.finalize())[..16].to_string()
        }
    };
    let path = dir.join(format!("{image}-{key}.ext4"));
    if path.is_file() {
        return Ok(path);
    }
    fs::create_dir_all(&dir).map_err(|e| VmError::Disk(format!("create {}: {e}", dir.display())))?;
    // One maker at a time, and a disk once made is never replaced: a VM restored from a template
    // snapshot reopens the disk by path with the template's page cache of it in its memory, so a
    // second, differently laid out copy renamed over the first (two first VMs of an image racing
    // here) corrupts the guest's view of its root ("EXT4-fs error ... checksumming directory").
    let lock_path = dir.join(format!(".{image}.lock"));
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| VmError::Disk(format!("open {}: {e}", lock_path.display())))?;
    cordon_host::sys::flock_exclusive(&lock).map_err(|e| VmError::Disk(format!("lock {}: {e}", lock_path.display())))?;
    if path.is_file() {
        return Ok(path);
    }
    progress.stage(0, 1, &format!("make the disk of image {image}"));
    // A layered image is made into one tree first: its layers as a read-only overlay.
    let merged = match layers {
        [_] => None,
        _ => Some(Merged::mount(&dir, layers).map_err(|e| VmError::Disk(format!("image {image}: mount its layers: {e}")))?),
    };
    let rootfs: &Path = merged.as_ref().map_or(layers[0].as_path(), |m| m.path.as_path());
    let (bytes, inodes) = tree_usage(rootfs);
    // ext4 metadata, directories and block rounding: a fifth more, plus room for small images.
    let size_mib = (bytes + bytes / 5) / (1 << 20) + 64;
    let tmp = dir.join(format!(".{image}.{}.ext4", std::process::id()));
    let _ = fs::remove_file(&tmp);
    let size = format!("{size_mib}M");
    let inodes = (inodes + inodes / 5 + 1024).to_string();
    let r = mkfs(
        &["-q", "-F", "-L", "cordon-root", "-m", "0", "-N", &inodes, "-O", "^has_journal", "-E", "root_owner=0:0", "-d"]
            .iter()
            .copied()
            .chain([rootfs.to_str().unwrap_or_default(), tmp.to_str().unwrap_or_default(), size.as_str()])
            .collect::<Vec<_>>(),
        &format!("image {image}"),
    );
    if let Err(e) = r {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, &path).map_err(|e| VmError::Disk(format!("install {}: {e}", path.display())))?;
    // Disks of older builds of this image are no longer reachable; VMs using them hold them open.
    if let Ok(rd) = fs::read_dir(&dir) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(&format!("{image}-")) && e.path() != path {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    tracing::debug!(image, disk = %path.display(), size_mib, "image disk made");
    Ok(path)
}

/// An image's layers as one read-only overlay on the host, for mkfs to copy; unmounted on drop.
struct Merged {
    path: PathBuf,
}

impl Merged {
    fn mount(dir: &Path, layers: &[PathBuf]) -> std::io::Result<Merged> {
        use std::ffi::CString;
        let path = dir.join(format!(".merge-{}", std::process::id()));
        let _ = fs::create_dir(&path);
        // overlayfs lists lower layers top first; two or more lower layers and no upper make a
        // read-only overlay.
        let lower: Vec<String> = layers.iter().rev().map(|p| p.display().to_string()).collect();
        let opts = CString::new(format!("lowerdir={}", lower.join(":"))).map_err(std::io::Error::other)?;
        let target = CString::new(path.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
        let (src, fstype) = (c"cordon-image", c"overlay");
        // SAFETY: every pointer is a NUL-terminated string that outlives the call.
        let rc = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), fstype.as_ptr(), libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOSUID, opts.as_ptr().cast()) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            let _ = fs::remove_dir(&path);
            return Err(e);
        }
        Ok(Merged { path })
    }
}

impl Drop for Merged {
    fn drop(&mut self) {
        if let Ok(c) = std::ffi::CString::new(self.path.as_os_str().as_encoded_bytes()) {
            // SAFETY: `c` is a NUL-terminated path that outlives the call.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = fs::remove_dir(&self.path);
    }
}

/// Makes the writable layer of one VM: a sparse file of `bytes`, ext4, owned by `uid`.
pub fn writable_layer(path: &Path, bytes: u64, uid: u32) -> Result<(), VmError> {
    let f = fs::File::create(path).map_err(|e| VmError::Disk(format!("create {}: {e}", path.display())))?;
    f.set_len(bytes).map_err(|e| VmError::Disk(format!("size {}: {e}", path.display())))?;
    drop(f);
    mkfs(
        &[
            "-q",
            "-F",
            "-L",
            "cordon-rw",
            "-m",
            "0",
            "-O",
            "^has_journal",
            "-E",
            "lazy_itable_init=1,nodiscard,root_owner=0:0",
            path.to_str().unwrap_or_default(),
        ],
        "writable layer",
    )?;
    hand_to(path, uid)
}

/// Gives a writable layer to the VMM that runs as `uid`, and to nobody else.
pub fn hand_to(path: &Path, uid: u32) -> Result<(), VmError> {
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).map_err(|e| VmError::Disk(format!("chown {}: {e}", path.display())))?;
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(|e| VmError::Disk(format!("chmod {}: {e}", path.display())))?;
    Ok(())
}

/// Copies a sparse file without filling its holes: a clone where the filesystem shares blocks
/// (btrfs, XFS), else only its data ranges. A writable layer is a mostly empty multi-GiB file.
pub fn copy_sparse(src: &Path, dst: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let s = fs::File::open(src)?;
    let len = s.metadata()?.len();
    let d = std::os::unix::fs::OpenOptionsExt::mode(fs::OpenOptions::new().write(true).create_new(true), 0o600).open(dst)?;
    // SAFETY: FICLONE with two open descriptors; it fails cleanly where unsupported.
    if unsafe { libc::ioctl(d.as_raw_fd(), libc::FICLONE, s.as_raw_fd()) } == 0 {
        return Ok(());
    }
    d.set_len(len)?;
    let mut off: i64 = 0;
    while (off as u64) < len {
        // SAFETY: lseek on an open descriptor.
        let data = unsafe { libc::lseek(s.as_raw_fd(), off, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole is left
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(s.as_raw_fd(), data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let (mut from, mut to) = (data, data);
        while from < hole {
            // SAFETY: copy_file_range between open descriptors with valid offset pointers.
            let n = unsafe {
                libc::copy_file_range(s.as_raw_fd(), &mut from, d.as_raw_fd(), &mut to, (hole - from) as usize, 0)
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if n == 0 {
                break;
            }
        }
        off = hole;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_sparse_copy_has_the_same_bytes_and_no_more_blocks() {
        let dir = std::env::temp_dir().join(format!("cordon-sparse-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (src, dst) = (dir.join("src"), dir.join("dst"));
        let mut f = std::fs::File::create(&src).unwrap();
        f.set_len(256 << 20).unwrap();
        for off in [0u64, 100 << 20, (256 << 20) - 4096] {
            f.seek(SeekFrom::Start(off)).unwrap();
            f.write_all(&[0xa5; 4096]).unwrap();
        }
        drop(f);
        super::copy_sparse(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        let (s, d) = (std::fs::metadata(&src).unwrap(), std::fs::metadata(&dst).unwrap());
        assert_eq!(d.len(), s.len());
        assert!(d.blocks() <= s.blocks() + 64, "copy takes {} blocks, original {}", d.blocks(), s.blocks());
        assert!(super::copy_sparse(&src, &dst).is_err(), "an existing destination is never overwritten");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
