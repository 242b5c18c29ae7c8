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
/// was rebuilt: the key is the tree's inode and mtime).
pub fn root_disk(vm_dir: &Path, image: &str, rootfs: &Path, progress: &mut dyn Progress) -> Result<PathBuf, VmError> {
    let m = fs::metadata(rootfs).map_err(|e| VmError::Disk(format!("image {image}: {}: {e}", rootfs.display())))?;
    let dir = vm_dir.join("disks");
    let path = dir.join(format!("{image}-{:x}-{:x}.ext4", m.ino(), m.mtime()));
    if path.is_file() {
        return Ok(path);
    }
    progress.stage(0, 1, &format!("make the disk of image {image}"));
    fs::create_dir_all(&dir).map_err(|e| VmError::Disk(format!("create {}: {e}", dir.display())))?;
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
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).map_err(|e| VmError::Disk(format!("chown {}: {e}", path.display())))?;
    // The guest's files: readable by its VMM alone.
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(|e| VmError::Disk(format!("chmod {}: {e}", path.display())))?;
    Ok(())
}
