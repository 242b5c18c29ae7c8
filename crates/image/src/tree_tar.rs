//! A directory tree written as an OCI layer tar: a one-tree image adopted as the bottom layer of
//! a build, or the upper directory of a build step's overlay turned into the step's layer.
//!
//! The tar is deterministic (entries sorted by name, mtimes and numeric owners kept, no
//! user/group names, no xattrs), so the same tree always has the same diff_id and a step that
//! produced the same files is the same layer. Nothing is followed: symlinks are written as
//! links, files are opened with `O_NOFOLLOW`, so a tree a sandbox wrote cannot make the writer
//! read a host file. Sockets and FIFOs are left out, as are device nodes other than overlay
//! whiteouts (what the layer store would drop anyway).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// What the tree is.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TreeKind {
    /// A tree of its own (an image's rootfs): written as it is.
    Plain,
    /// An overlay's upper directory written by a sandbox whose uid 0 is host uid `uid_base`:
    /// owners are shifted back into the sandbox's range, 0/0 character devices become
    /// `.wh.NAME` and opaque directories get a `.wh..wh..opq`.
    Upper { uid_base: u32 },
}

/// Sandbox ids beyond this are no one's (the range a sandbox maps is 65536 ids).
const RANGE: u32 = 65536;
const NOBODY: u32 = 65534;

/// Writes `root`'s contents (not `root` itself) to `out` as a tar. Returns the number of
/// entries written.
pub(crate) fn write(root: &Path, kind: TreeKind, out: impl Write) -> io::Result<u64> {
    let mut b = tar::Builder::new(out);
    b.mode(tar::HeaderMode::Complete);
    b.follow_symlinks(false);
    let mut w = Writer { kind, links: HashMap::new(), entries: 0 };
    w.dir(&mut b, root, Path::new(""))?;
    b.into_inner()?.flush()?;
    Ok(w.entries)
}

struct Writer {
    kind: TreeKind,
    /// (dev, ino) of every multiply-linked file written so far, and its name: later names are
    /// hard links to it.
    links: HashMap<(u64, u64), PathBuf>,
    entries: u64,
}

impl Writer {
    fn owner(&self, id: u32) -> u64 {
        match self.kind {
            TreeKind::Plain => id.into(),
            TreeKind::Upper { uid_base } => match id.checked_sub(uid_base) {
                Some(n) if n < RANGE => n.into(),
                _ => NOBODY.into(),
            },
        }
    }

    fn header(&self, meta: &fs::Metadata, kind: tar::EntryType) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(meta.mode() & 0o7777);
        h.set_uid(self.owner(meta.uid()));
        h.set_gid(self.owner(meta.gid()));
        h.set_mtime(meta.mtime().max(0) as u64);
        h.set_size(0);
        h
    }

    fn dir(&mut self, b: &mut tar::Builder<impl Write>, dir: &Path, rel: &Path) -> io::Result<()> {
        let mut names: Vec<_> = fs::read_dir(dir)?.map(|e| e.map(|e| e.file_name())).collect::<io::Result<_>>()?;
        names.sort();
        for name in names {
            self.entry(b, &dir.join(&name), &rel.join(&name))?;
        }
        Ok(())
    }

    fn entry(&mut self, b: &mut tar::Builder<impl Write>, path: &Path, rel: &Path) -> io::Result<()> {
        let meta = fs::symlink_metadata(path)?;
        let ft = meta.file_type();
        if ft.is_dir() {
            let mut h = self.header(&meta, tar::EntryType::Directory);
            b.append_data(&mut h, rel, io::empty())?;
            self.entries += 1;
            if matches!(self.kind, TreeKind::Upper { .. }) && is_opaque(path) {
                let mut h = self.header(&meta, tar::EntryType::Regular);
                h.set_mode(0o644);
                b.append_data(&mut h, rel.join(".wh..wh..opq"), io::empty())?;
                self.entries += 1;
            }
            return self.dir(b, path, rel);
        }
        if ft.is_symlink() {
            let target = fs::read_link(path)?;
            let mut h = self.header(&meta, tar::EntryType::Symlink);
            b.append_link(&mut h, rel, &target)?;
            self.entries += 1;
            return Ok(());
        }
        if ft.is_char_device() && meta.rdev() == 0 {
            if let TreeKind::Upper { .. } = self.kind {
                let name = rel.file_name().unwrap_or(OsStr::new(""));
                let mut wh = OsStr::new(".wh.").to_os_string();
                wh.push(name);
                let mut h = self.header(&meta, tar::EntryType::Regular);
                h.set_mode(0o644);
                b.append_data(&mut h, rel.with_file_name(wh), io::empty())?;
                self.entries += 1;
            }
            return Ok(());
        }
        if !ft.is_file() {
            return Ok(());
        }
        if meta.nlink() > 1 {
            let key = (meta.dev(), meta.ino());
            if let Some(first) = self.links.get(&key) {
                let mut h = self.header(&meta, tar::EntryType::Link);
                b.append_link(&mut h, rel, first)?;
                self.entries += 1;
                return Ok(());
            }
            self.links.insert(key, rel.to_owned());
        }
        let file = fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
        let mut h = self.header(&meta, tar::EntryType::Regular);
        h.set_size(meta.len());
        // A file that changes size while it is read would make a broken tar; nothing writes a
        // build step's tree once its sandbox is gone, and an image's tree is never written.
        b.append_data(&mut h, rel, io::Read::take(file, meta.len()))?;
        self.entries += 1;
        Ok(())
    }
}

/// Whether an upper directory hides everything below it in the lower layers.
fn is_opaque(dir: &Path) -> bool {
    ["user.overlay.opaque", "trusted.overlay.opaque"].iter().any(|name| {
        let mut buf = [0u8; 4];
        matches!(rustix::fs::lgetxattr(dir, *name, &mut buf), Ok(n) if buf[..n] == *b"y")
    })
}

/// Whether `dir` has no entries (an upper directory of a step that changed nothing).
pub(crate) fn is_empty(dir: &Path) -> io::Result<bool> {
    Ok(fs::read_dir(dir)?.next().is_none())
}
