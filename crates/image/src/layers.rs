//! The layer store: every layer of every OCI image, unpacked once, under
//! `<state>/layers/sha256/<hex of its diff_id>/` (`diff/` the tree, `layer.json` what it is).
//!
//! Layers are keyed by their diff_id (the digest of the uncompressed tar, which the image config
//! lists), so an image pulled gzip-compressed, one pulled zstd-compressed and one imported from
//! `docker save` (uncompressed) share the same directory. A layer is unpacked into
//! `.tmp-<hex>-<pid>-<n>` and appears by one rename once both digests matched, so a layer
//! directory is always complete; a temporary directory of a process that is gone is swept by
//! the next operation.
//!
//! Unpacking is confined to the layer's directory: paths with `..` or a leading `/` are
//! refused, writes through symlinks and hard links whose target lies outside are refused
//! (tar's `unpack_in`, plus our own beneath-only walk for whiteouts), device nodes and FIFOs
//! are dropped (sandboxes get their own /dev), set-uid/set-gid bits are cleared (inert under
//! the sandbox's no_new_privs anyway, and a layer on the host must never hold a set-uid root
//! binary), and xattrs are not unpacked (overlayfs reads its own `trusted.overlay.*` /
//! `user.overlay.*` xattrs from the layers, so a layer must not be able to set them). The store
//! directory is 0700: the trees hold files owned by the sandbox's root-to-be, not by anyone on
//! the host.
//!
//! OCI whiteouts become overlayfs whiteouts here: `.wh.NAME` a 0/0 character device at `NAME`,
//! `.wh..wh..opq` the opaque xattr on its directory (both the `trusted.` form, which a host
//! overlay reads, and the `user.` form, which an overlay mounted in a user namespace with
//! `userxattr` reads).

use std::collections::HashSet;
use std::fs;
use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};

use crate::digest::{Digest, HashReader};
use crate::fsutil;
use crate::import::{clip, unpack_error};
use crate::Progress;

const TMP_PREFIX: &str = ".tmp-";
const INFO_FILE: &str = "layer.json";
const DIFF_DIR: &str = "diff";
const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

/// What the store records of a layer.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct LayerInfo {
    /// Digest of the uncompressed tar: the layer's key.
    pub diff_id: String,
    /// Digest of the blob it was unpacked from (compressed as it was pulled), if known.
    #[serde(default)]
    pub digest: Option<String>,
    /// Disk usage of the unpacked tree.
    pub size_bytes: u64,
}

/// A layer unpacked and verified but not yet in place (see [`LayerStore::install`]).
pub(crate) struct Pending {
    tmp: Option<PathBuf>,
    dest: PathBuf,
    pub(crate) info: LayerInfo,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            if let Err(e) = fsutil::remove_tree(&tmp) {
                tracing::warn!(path = %tmp.display(), error = %e, "cannot delete an unpacked layer that was not installed");
            }
        }
    }
}

/// What a layer blob must turn out to be.
pub(crate) struct Expect<'a> {
    /// Digest of the blob as read (compressed), when the manifest gives one.
    pub digest: Option<&'a Digest>,
    /// Digest of the uncompressed tar, from the image config.
    pub diff_id: &'a Digest,
}

/// The layer directories of one state directory.
#[derive(Debug, Clone)]
pub(crate) struct LayerStore {
    /// `<state>/layers`, holding the lock and `sha256/`.
    root: PathBuf,
}

/// A shared or exclusive hold on the whole layer store: imports and pulls hold it shared from
/// their first layer until their image is in place, prune holds it exclusive, so prune never
/// removes a layer that an image being made is about to reference.
pub(crate) struct StoreLock {
    _file: fs::File,
}

impl LayerStore {
    pub(crate) fn open(state_dir: &Path) -> Result<LayerStore, crate::ImageError> {
        let root = state_dir.join("layers");
        let dir = root.join("sha256");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| crate::ImageError::io(format!("cannot create {}", dir.display()), e))?;
        // The mode above only applies to directories it creates; one made by an older cordon
        // (or by hand) is closed here too.
        let _ = fs::set_permissions(&root, fs::Permissions::from_mode(0o700));
        Ok(LayerStore { root })
    }

    fn dir(&self) -> PathBuf {
        self.root.join("sha256")
    }

    /// `<state>/layers`.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// The unpacked tree of layer `diff_id`.
    pub(crate) fn diff_path(&self, diff_id: &Digest) -> PathBuf {
        self.dir().join(diff_id.hex()).join(DIFF_DIR)
    }

    pub(crate) fn has(&self, diff_id: &Digest) -> bool {
        self.info(diff_id).is_some()
    }

    pub(crate) fn info(&self, diff_id: &Digest) -> Option<LayerInfo> {
        let text = fs::read_to_string(self.dir().join(diff_id.hex()).join(INFO_FILE)).ok()?;
        serde_json::from_str(&text).ok()
    }

    pub(crate) fn lock(&self, exclusive: bool) -> Result<StoreLock, crate::ImageError> {
        let path = self.root.join(".lock");
        let err = |e| crate::ImageError::io(format!("cannot lock {}", path.display()), e);
        let file = fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(err)?;
        let op = if exclusive { rustix::fs::FlockOperation::LockExclusive } else { rustix::fs::FlockOperation::LockShared };
        loop {
            match rustix::fs::flock(&file, op) {
                Ok(()) => return Ok(StoreLock { _file: file }),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(err(e.into())),
            }
        }
    }

    /// Deletes temporary directories whose process is gone (a pull killed mid-layer).
    pub(crate) fn sweep(&self) {
        let Ok(rd) = fs::read_dir(self.dir()) else { return };
        for entry in rd.flatten() {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(TMP_PREFIX)) else { continue };
            let pid = rest.split('-').nth(1).and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|p| p != std::process::id() && Path::new(&format!("/proc/{p}")).exists()) {
                continue;
            }
            if pid == Some(std::process::id()) {
                continue;
            }
            tracing::info!(path = %entry.path().display(), "removing an interrupted layer unpack");
            let _ = fsutil::remove_tree(&entry.path());
        }
    }

    /// Unpacks the layer blob `input` (gzip, zstd or plain tar, told apart by its first bytes)
    /// and makes it layer `expect.diff_id`, verifying both digests over every byte. On any
    /// error nothing is left behind.
    #[cfg(test)]
    pub(crate) fn unpack(&self, input: impl Read, expect: &Expect<'_>, progress: &mut dyn Progress) -> Result<LayerInfo, String> {
        let pending = self.unpack_pending(input, expect, progress)?;
        let info = pending.info.clone();
        self.install(vec![pending])?;
        Ok(info)
    }

    /// [`LayerStore::unpack`] up to the point where the layer would appear: the caller
    /// [`install`](LayerStore::install)s all of an image's layers once every one verified.
    /// Dropped uninstalled, it is deleted.
    pub(crate) fn unpack_pending(&self, input: impl Read, expect: &Expect<'_>, progress: &mut dyn Progress) -> Result<Pending, String> {
        self.unpack_checked(input, expect.digest, Some(expect.diff_id), progress)
    }

    /// Unpacks a layer tar made here (an image build's step) whose diff_id is what it turns
    /// out to be: the same confined unpack as a pulled layer's, since a build step's files are
    /// as untrusted as a registry's.
    pub(crate) fn unpack_new(&self, input: impl Read, progress: &mut dyn Progress) -> Result<Pending, String> {
        self.unpack_checked(input, None, None, progress)
    }

    fn unpack_checked(&self, input: impl Read, digest: Option<&Digest>, diff_id: Option<&Digest>, progress: &mut dyn Progress) -> Result<Pending, String> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let hex = diff_id.map_or("new", |d| d.hex());
        let tmp = self.dir().join(format!("{TMP_PREFIX}{hex}-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
        match self.unpack_into(&tmp, input, digest, diff_id, progress) {
            Ok(info) => {
                let dest = self.dir().join(info.diff_id.trim_start_matches("sha256:"));
                Ok(Pending { tmp: Some(tmp), dest, info })
            }
            Err(e) => {
                if let Err(e) = fsutil::remove_tree(&tmp) {
                    tracing::warn!(path = %tmp.display(), error = %e, "cannot delete a failed layer unpack");
                }
                Err(e)
            }
        }
    }

    /// Makes unpacked layers appear, each by one rename. A layer that another process completed
    /// meanwhile is kept and ours discarded.
    ///
    /// Their contents are not forced to disk first: that flush (a `syncfs` of every dirty page
    /// of the filesystem, the layer's hundreds of MiB and whatever else is being written) was
    /// most of a pull's time, and neither Docker's overlay2 nor containerd's overlay snapshotter
    /// pays it. A killed pull still leaves no partial layer; a power loss right after one may.
    pub(crate) fn install(&self, pending: Vec<Pending>) -> Result<(), String> {
        for mut p in pending {
            let tmp = p.tmp.take().expect("not installed yet");
            match fs::rename(&tmp, &p.dest) {
                Ok(()) => {}
                // Someone else finished the same layer first: theirs is as good.
                Err(e) if p.dest.join(INFO_FILE).exists() => {
                    tracing::debug!(layer = %p.info.diff_id, error = %e, "layer appeared meanwhile; keeping that one");
                    let _ = fsutil::remove_tree(&tmp);
                }
                Err(e) => {
                    let _ = fsutil::remove_tree(&tmp);
                    return Err(format!("cannot move layer {} into place: {e}", p.info.diff_id));
                }
            }
        }
        let _ = fsutil::sync_dir(&self.dir());
        Ok(())
    }

    /// Fills `tmp` (the caller deletes it on error).
    fn unpack_into(&self, tmp: &Path, input: impl Read, want_digest: Option<&Digest>, want_diff_id: Option<&Digest>, progress: &mut dyn Progress) -> Result<LayerInfo, String> {
        let diff = tmp.join(DIFF_DIR);
        for d in [tmp, &diff] {
            fs::DirBuilder::new().mode(0o755).create(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        }
        let mut blob = HashReader::new(input);
        let diff_id_seen = {
            let mut buffered = BufReader::with_capacity(1 << 16, &mut blob);
            let magic = buffered.fill_buf().map_err(|e| read_error(&e))?.to_vec();
            let decoded: Box<dyn Read + '_> = if magic.starts_with(&[0x1f, 0x8b]) {
                Box::new(flate2::bufread::MultiGzDecoder::new(buffered))
            } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
                Box::new(zstd::stream::read::Decoder::with_buffer(buffered).map_err(|e| read_error(&e))?)
            } else {
                Box::new(buffered)
            };
            let mut tar_stream = HashReader::new(decoded);
            unpack_layer(&mut tar_stream, &diff, progress)?;
            tar_stream.drain().map_err(|e| read_error(&e))?;
            tar_stream.finish()
        };
        blob.drain().map_err(|e| read_error(&e))?;
        let digest_seen = blob.finish();
        if let Some(want) = want_digest {
            if &digest_seen != want {
                return Err(format!("layer {} does not match its digest: expected {want}, got {digest_seen} (the blob is corrupt or was tampered with)", want.short()));
            }
        }
        if let Some(want) = want_diff_id {
            if &diff_id_seen != want {
                return Err(format!(
                    "layer {} does not match the image config's diff_id: expected {want}, got {diff_id_seen} (the image is corrupt or was tampered with)",
                    want.short(),
                ));
            }
        }
        let info = LayerInfo {
            diff_id: diff_id_seen.to_string(),
            digest: want_digest.map(|d| d.to_string()),
            size_bytes: fsutil::tree_size(&diff).unwrap_or(0),
        };
        let json = serde_json::to_vec_pretty(&info).expect("LayerInfo serializes");
        fs::write(tmp.join(INFO_FILE), json).map_err(|e| format!("cannot write {}: {e}", tmp.join(INFO_FILE).display()))?;
        Ok(info)
    }

    /// Every complete layer in the store.
    pub(crate) fn all(&self) -> Vec<Digest> {
        let Ok(rd) = fs::read_dir(self.dir()) else { return Vec::new() };
        let mut out: Vec<Digest> = rd
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| Digest::parse(&format!("sha256:{n}")).ok()))
            .filter(|d| self.has(d))
            .collect();
        out.sort();
        out
    }

    /// Removes every layer not in `keep`; returns how many and the bytes freed. The caller holds
    /// the store's exclusive lock.
    pub(crate) fn remove_except(&self, keep: &HashSet<Digest>) -> Result<(usize, u64), crate::ImageError> {
        let mut removed = (0, 0);
        for d in self.all() {
            if keep.contains(&d) {
                continue;
            }
            let size = self.info(&d).map(|i| i.size_bytes).unwrap_or(0);
            let dir = self.dir().join(d.hex());
            // Renamed away first, so a layer is never seen half-deleted.
            let trash = self.dir().join(format!("{TMP_PREFIX}{}-{}-rm", d.hex(), std::process::id()));
            fs::rename(&dir, &trash).map_err(|e| crate::ImageError::io(format!("cannot remove {}", dir.display()), e))?;
            fsutil::remove_tree(&trash).map_err(|e| crate::ImageError::io(format!("cannot delete {}", trash.display()), e))?;
            removed.0 += 1;
            removed.1 += size;
        }
        Ok(removed)
    }
}

fn read_error(e: &io::Error) -> String {
    format!("cannot read the layer: {}", clip(&e.to_string()))
}

/// Unpacks one layer tar into `diff`, turning OCI whiteouts into overlay ones.
fn unpack_layer(input: &mut dyn Read, diff: &Path, progress: &mut dyn Progress) -> Result<(), String> {
    let mut archive = tar::Archive::new(input);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    archive.set_preserve_ownerships(fsutil::is_root());
    archive.set_unpack_xattrs(false);
    archive.set_mask(0o6000);
    let root: OwnedFd = fs::File::open(diff).map_err(|e| format!("cannot open {}: {e}", diff.display()))?.into();

    let mut dirs = Vec::new();
    let mut opaque = Vec::new();
    let entries = archive.entries().map_err(|e| format!("the layer is not a tar archive: {}", clip(&e.to_string())))?;
    for (count, entry) in entries.enumerate() {
        let mut entry = entry.map_err(|e| {
            if count == 0 {
                format!("the layer is not a valid tar archive ({})", clip(&e.to_string()))
            } else {
                format!("the layer is damaged after {count} entries ({}): it is truncated or corrupt", clip(&e.to_string()))
            }
        })?;
        let raw = entry.path_bytes().into_owned();
        let shown = clip(&String::from_utf8_lossy(&raw));
        let rel = confined_path(&raw).ok_or_else(|| format!("layer entry '{shown}' has a path outside the layer ('..' or absolute): the image is malformed or malicious"))?;
        let kind = entry.header().entry_type();
        if let Some(name) = rel.file_name().and_then(|n| n.to_str()) {
            if name == OPAQUE {
                opaque.push(rel.parent().unwrap_or(Path::new("")).to_path_buf());
                continue;
            }
            if let Some(hidden) = name.strip_prefix(WHITEOUT) {
                if hidden.is_empty() || hidden == "." || hidden == ".." {
                    return Err(format!("layer entry '{shown}' is a malformed whiteout"));
                }
                let parent = rel.parent().unwrap_or(Path::new(""));
                whiteout(&root, parent, hidden).map_err(|e| format!("cannot apply whiteout '{shown}': {e}"))?;
                continue;
            }
        }
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            continue;
        }
        if kind.is_dir() {
            dirs.push(entry);
            continue;
        }
        progress.line(&shown);
        let inside = entry.unpack_in(diff).map_err(|e| unpack_error(&shown, &e))?;
        if !inside {
            return Err(format!("layer entry '{shown}' would be written outside the layer: the image is malformed or malicious"));
        }
    }
    // Deepest first, after their contents, so a read-only mode cannot block its own entries.
    dirs.sort_by(|a, b| b.path_bytes().cmp(&a.path_bytes()));
    for mut dir in dirs {
        let shown = clip(&String::from_utf8_lossy(&dir.path_bytes()));
        if !dir.unpack_in(diff).map_err(|e| unpack_error(&shown, &e))? {
            return Err(format!("layer entry '{shown}' would be written outside the layer: the image is malformed or malicious"));
        }
    }
    for d in opaque {
        mark_opaque(&root, &d).map_err(|e| format!("cannot mark '{}' opaque: {e}", d.display()))?;
    }
    Ok(())
}

/// The entry's path relative to the layer root, or `None` when it would leave it.
fn confined_path(raw: &[u8]) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let p = Path::new(std::ffi::OsStr::from_bytes(raw));
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            // A leading '/' is how some tools write every path ("/etc/passwd"): meant relative.
            Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Opens directory `rel` below `root`, creating missing components (0755), never following a
/// symlink and never leaving `root`.
fn open_beneath(root: &OwnedFd, rel: &Path) -> io::Result<OwnedFd> {
    let how = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    let flags = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
    let mut cur = rustix::fs::openat2(root, ".", flags, Mode::empty(), how)?;
    for c in rel.components() {
        let Component::Normal(name) = c else { continue };
        match rustix::fs::mkdirat(&cur, name, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        cur = rustix::fs::openat2(&cur, name, flags, Mode::empty(), how)?;
    }
    Ok(cur)
}

/// An overlay whiteout for `name` in `parent`: a 0/0 character device.
fn whiteout(root: &OwnedFd, parent: &Path, name: &str) -> io::Result<()> {
    let dir = open_beneath(root, parent)?;
    // Whatever this layer itself put there is replaced (files, or an empty directory).
    match rustix::fs::unlinkat(&dir, name, rustix::fs::AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => {}
        Err(rustix::io::Errno::ISDIR) => {
            let _ = rustix::fs::unlinkat(&dir, name, rustix::fs::AtFlags::REMOVEDIR);
        }
        Err(e) => return Err(e.into()),
    }
    rustix::fs::mknodat(&dir, name, rustix::fs::FileType::CharacterDevice, Mode::empty(), rustix::fs::makedev(0, 0))?;
    Ok(())
}

/// Marks directory `rel` opaque for both kinds of overlay mount.
fn mark_opaque(root: &OwnedFd, rel: &Path) -> io::Result<()> {
    let dir = open_beneath(root, rel)?;
    for name in ["trusted.overlay.opaque", "user.overlay.opaque"] {
        rustix::fs::fsetxattr(dir.as_fd(), name, b"y", rustix::fs::XattrFlags::empty())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NoProgress;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cordon-layers-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    /// A tar built entry by entry, headers written by hand where the tar crate's builder
    /// refuses what an attacker would send (`..`, absolute names).
    struct Tar(Vec<u8>);

    impl Tar {
        fn new() -> Self {
            Tar(Vec::new())
        }
        fn entry(mut self, path: &[u8], kind: tar::EntryType, mode: u32, link: Option<&[u8]>, data: &[u8]) -> Self {
            let mut h = tar::Header::new_old();
            {
                let raw = h.as_old_mut();
                raw.name[..path.len()].copy_from_slice(path);
                if let Some(l) = link {
                    raw.linkname[..l.len()].copy_from_slice(l);
                }
            }
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_size(data.len() as u64);
            h.set_mtime(1);
            h.set_uid(0);
            h.set_gid(0);
            h.set_cksum();
            self.0.extend_from_slice(h.as_bytes());
            self.0.extend_from_slice(data);
            let pad = (512 - data.len() % 512) % 512;
            self.0.extend(std::iter::repeat_n(0u8, pad));
            self
        }
        fn file(self, path: &str, data: &[u8]) -> Self {
            self.entry(path.as_bytes(), tar::EntryType::Regular, 0o644, None, data)
        }
        fn dir(self, path: &str) -> Self {
            self.entry(path.as_bytes(), tar::EntryType::Directory, 0o755, None, b"")
        }
        fn done(mut self) -> Vec<u8> {
            self.0.extend(std::iter::repeat_n(0u8, 1024));
            self.0
        }
    }

    fn unpack(store: &LayerStore, tar: &[u8]) -> Result<PathBuf, String> {
        let diff_id = crate::digest::of_bytes(tar);
        store.unpack(tar, &Expect { digest: None, diff_id: &diff_id }, &mut NoProgress)?;
        Ok(store.diff_path(&diff_id))
    }

    fn leftovers(store: &LayerStore) -> Vec<String> {
        fs::read_dir(store.dir()).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn whiteouts_become_overlay_whiteouts() {
        let state = tmpdir("wh");
        let store = LayerStore::open(&state).unwrap();
        let tar = Tar::new().dir("etc/").file("etc/.wh.motd", b"").dir("opt/").file("opt/.wh..wh..opq", b"").file("opt/new", b"n").file("gone/.wh.x", b"").done();
        let diff = unpack(&store, &tar).unwrap();
        let m = fs::symlink_metadata(diff.join("etc/motd")).unwrap();
        assert!(m.file_type().is_char_device() && m.rdev() == 0, "{m:?}");
        assert!(!diff.join("etc/.wh.motd").exists());
        // A whiteout in a directory the layer does not list still lands (its parent is made).
        assert!(fs::symlink_metadata(diff.join("gone/x")).unwrap().file_type().is_char_device());
        if fsutil::is_root() {
            assert_eq!(xattr(&diff.join("opt"), "trusted.overlay.opaque"), Some(b"y".to_vec()));
        }
        assert_eq!(xattr(&diff.join("opt"), "user.overlay.opaque"), Some(b"y".to_vec()));
        assert!(!diff.join("opt/.wh..wh..opq").exists());
        assert_eq!(fs::read(diff.join("opt/new")).unwrap(), b"n");
        assert_eq!(fs::metadata(state.join("layers")).unwrap().permissions().mode() & 0o777, 0o700);
        fs::remove_dir_all(&state).unwrap();
    }

    fn xattr(p: &Path, name: &str) -> Option<Vec<u8>> {
        let mut buf = [0u8; 16];
        let n = rustix::fs::lgetxattr(p, name, &mut buf).ok()?;
        Some(buf[..n].to_vec())
    }

    #[test]
    fn escapes_are_refused_and_leave_nothing() {
        let state = tmpdir("esc");
        let store = LayerStore::open(&state).unwrap();
        let outside = state.join("outside");
        fs::create_dir_all(&outside).unwrap();
        let sym = |t: &[u8]| Tar::new().entry(b"evil", tar::EntryType::Symlink, 0o777, Some(t), b"");
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("dotdot", Tar::new().file("../../outside/dotdot", b"x").done()),
            ("dotdot-whiteout", Tar::new().file("a/../../.wh.outside", b"").done()),
            // A symlink to a directory outside, then a file written through it.
            ("symlink-dir", sym(outside.to_str().unwrap().as_bytes()).file("evil/through-symlink", b"x").done()),
            ("symlink-rel", sym(b"../../../../../../../..").file("evil/tmp/through-rel", b"x").done()),
            // A whiteout through the same symlink.
            ("symlink-whiteout", sym(outside.to_str().unwrap().as_bytes()).file("evil/.wh.victim", b"").done()),
            ("hardlink-out", Tar::new().entry(b"hl", tar::EntryType::Link, 0o644, Some(b"../../outside/target"), b"").done()),
            ("hardlink-abs", Tar::new().entry(b"hl", tar::EntryType::Link, 0o644, Some(b"/etc/passwd"), b"").done()),
        ];
        fs::write(outside.join("victim"), b"keep").unwrap();
        fs::write(outside.join("target"), b"keep").unwrap();
        for (name, tar) in cases {
            let before = fs::read_dir(&outside).unwrap().count();
            let r = unpack(&store, &tar);
            assert!(r.is_err(), "{name}: unpacked {r:?}");
            let msg = r.unwrap_err();
            assert!(!msg.contains('\n'), "{name}: {msg}");
            assert_eq!(fs::read_dir(&outside).unwrap().count(), before, "{name}: wrote outside");
            assert_eq!(fs::read(outside.join("victim")).unwrap(), b"keep", "{name}");
            assert!(leftovers(&store).is_empty(), "{name}: left {:?}", leftovers(&store));
        }
        assert!(!Path::new("/tmp/through-rel").exists());
        fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn absolute_names_stay_inside_and_specials_are_dropped() {
        let state = tmpdir("abs");
        let store = LayerStore::open(&state).unwrap();
        let tar = Tar::new()
            .file("/abs-file", b"a")
            .entry(b"suid", tar::EntryType::Regular, 0o4755, None, b"#!")
            .entry(b"sgid", tar::EntryType::Regular, 0o2755, None, b"#!")
            .entry(b"dev-null", tar::EntryType::Char, 0o666, None, b"")
            .entry(b"disk", tar::EntryType::Block, 0o666, None, b"")
            .entry(b"fifo", tar::EntryType::Fifo, 0o666, None, b"")
            .done();
        let diff = unpack(&store, &tar).unwrap();
        assert_eq!(fs::read(diff.join("abs-file")).unwrap(), b"a");
        assert!(!Path::new("/abs-file").exists());
        assert_eq!(fs::metadata(diff.join("suid")).unwrap().mode() & 0o7777, 0o755);
        assert_eq!(fs::metadata(diff.join("sgid")).unwrap().mode() & 0o7777, 0o755);
        for n in ["dev-null", "disk", "fifo"] {
            assert!(fs::symlink_metadata(diff.join(n)).is_err(), "{n} was created");
        }
        fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn digests_are_checked_and_a_mismatch_keeps_nothing() {
        let state = tmpdir("dig");
        let store = LayerStore::open(&state).unwrap();
        let tar = Tar::new().file("f", b"data").done();
        let right = crate::digest::of_bytes(&tar);
        let wrong = crate::digest::of_bytes(b"other");
        let e = store.unpack(&tar[..], &Expect { digest: None, diff_id: &wrong }, &mut NoProgress).unwrap_err();
        assert!(e.contains("diff_id"), "{e}");
        let e = store.unpack(&tar[..], &Expect { digest: Some(&wrong), diff_id: &right }, &mut NoProgress).unwrap_err();
        assert!(e.contains("does not match its digest"), "{e}");
        // Truncated.
        let e = store.unpack(&tar[..700], &Expect { digest: None, diff_id: &right }, &mut NoProgress).unwrap_err();
        assert!(!e.is_empty());
        assert!(leftovers(&store).is_empty(), "{:?}", leftovers(&store));
        assert!(!store.has(&right));

        // gzip and zstd of the same tar give the same layer.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        io::Write::write_all(&mut gz, &tar).unwrap();
        let gz = gz.finish().unwrap();
        let gz_digest = crate::digest::of_bytes(&gz);
        store.unpack(&gz[..], &Expect { digest: Some(&gz_digest), diff_id: &right }, &mut NoProgress).unwrap();
        assert_eq!(fs::read(store.diff_path(&right).join("f")).unwrap(), b"data");
        let zst = zstd::encode_all(&tar[..], 3).unwrap();
        let zst_digest = crate::digest::of_bytes(&zst);
        store.unpack(&zst[..], &Expect { digest: Some(&zst_digest), diff_id: &right }, &mut NoProgress).unwrap();
        assert_eq!(store.all(), vec![right.clone()]);

        let (n, _) = store.remove_except(&HashSet::new()).unwrap();
        assert_eq!(n, 1);
        assert!(store.all().is_empty() && leftovers(&store).is_empty());
        fs::remove_dir_all(&state).unwrap();
    }
}
