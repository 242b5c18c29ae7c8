//! COPY as a layer: the copied files written as a layer tar, placed where the image's own
//! symlinks put them, with every parent directory carried over as the image has it.
//!
//! overlayfs takes a directory's owner and mode from the topmost layer that has it, so a layer
//! that merely passes through `/home/user` on its way to a file must repeat that directory as
//! it is below; otherwise the copy would hand `/home/user` to root. And a parent that is a
//! symlink in the image (`/bin` to `usr/bin` on a merged-usr system) is followed, never
//! replaced by a directory.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::merged::Merged;

/// Who owns the copied files (`--chown`), or keeps the sources' modes (`--chmod` absent).
#[derive(Debug, Clone, Copy, Default)]
pub struct Attrs {
    pub uid: u32,
    pub gid: u32,
    pub mode: Option<u32>,
}

/// Resolves `--chown=USER[:GROUP]` (names or numbers) against the image's `/etc/passwd` and
/// `/etc/group`; a user alone also gives its primary group.
pub fn owner(view: &Merged, spec: &str) -> Result<(u32, u32), String> {
    let (user, group) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let passwd = read_db(view, "/etc/passwd");
    let (uid, primary) = match user.parse::<u32>() {
        Ok(n) => (n, passwd.iter().find(|f| f.get(2).and_then(|s| s.parse().ok()) == Some(n)).and_then(|f| f.get(3)?.parse().ok()).unwrap_or(n)),
        Err(_) => {
            let f = passwd.iter().find(|f| f.first().map(String::as_str) == Some(user)).ok_or_else(|| format!("user '{user}' is not in the image's /etc/passwd"))?;
            let num = |i: usize| f.get(i).and_then(|s| s.parse::<u32>().ok()).ok_or_else(|| format!("the image's /etc/passwd entry of '{user}' is malformed"));
            (num(2)?, num(3)?)
        }
    };
    let gid = match group {
        None => primary,
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => read_db(view, "/etc/group")
                .iter()
                .find(|f| f.first().map(String::as_str) == Some(g))
                .and_then(|f| f.get(2)?.parse().ok())
                .ok_or_else(|| format!("group '{g}' is not in the image's /etc/group"))?,
        },
    };
    Ok((uid, gid))
}

/// The colon-separated records of an image file such as /etc/passwd (empty when absent).
fn read_db(view: &Merged, path: &str) -> Vec<Vec<String>> {
    let Ok(host) = view.host_path(path) else { return Vec::new() };
    let Ok(file) = fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(host) else { return Vec::new() };
    let mut text = String::new();
    if file.take(4 << 20).read_to_string(&mut text).is_err() {
        return Vec::new();
    }
    text.lines().filter(|l| !l.starts_with('#')).map(|l| l.split(':').map(str::to_string).collect()).collect()
}

/// A digest of the sources' names (below `root`, the context or a view, whose own path changes
/// from build to build), modes and contents: the COPY step's input in its cache key.
pub fn digest_sources(root: &Path, srcs: &[PathBuf]) -> io::Result<String> {
    let mut h = Sha256::new();
    for s in srcs {
        h.update(s.strip_prefix(root).unwrap_or(s).as_os_str().as_encoded_bytes());
        hash_tree(&mut h, s, Path::new(""))?;
    }
    Ok(format!("{:x}", h.finalize()))
}

fn hash_tree(h: &mut Sha256, path: &Path, rel: &Path) -> io::Result<()> {
    let m = fs::symlink_metadata(path)?;
    h.update(rel.as_os_str().as_encoded_bytes());
    h.update(m.mode().to_le_bytes());
    if m.file_type().is_symlink() {
        h.update(fs::read_link(path)?.as_os_str().as_encoded_bytes());
    } else if m.is_file() {
        h.update(m.len().to_le_bytes());
        io::copy(&mut fs::File::open(path)?, &mut HashWrite(h))?;
    } else if m.is_dir() {
        let mut names: Vec<_> = fs::read_dir(path)?.map(|e| e.map(|e| e.file_name())).collect::<io::Result<_>>()?;
        names.sort();
        for n in names {
            hash_tree(h, &path.join(&n), &rel.join(&n))?;
        }
    }
    Ok(())
}

struct HashWrite<'a>(&'a mut Sha256);

impl Write for HashWrite<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.update(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes the COPY of `srcs` (host paths) to `dest` (absolute, inside the image) into `b`.
/// Docker's rules: a directory source copies its contents; with several sources or a `dest`
/// ending in `/` (or naming a directory of the image), each source goes into `dest`; else the
/// one file source becomes `dest`.
pub fn write(view: &Merged, b: &mut tar::Builder<impl Write>, srcs: &[PathBuf], dest: &str, attrs: Attrs) -> Result<(), String> {
    let resolved = view.resolve(dest).map_err(|e| format!("cannot resolve {dest} in the image: {e}"))?;
    let dest_is_dir = dest.ends_with('/') || srcs.len() > 1 || view.root().join(&resolved).is_dir() || srcs.iter().any(|s| s.is_dir());
    let mut parents = Parents { view, written: Vec::new(), owner: (attrs.uid, attrs.gid) };
    for src in srcs {
        let m = fs::symlink_metadata(src).map_err(|e| format!("cannot read {}: {e}", src.display()))?;
        let target = if m.is_dir() {
            resolved.clone()
        } else if dest_is_dir {
            resolved.join(src.file_name().unwrap_or_default())
        } else {
            resolved.clone()
        };
        let top = if m.is_dir() { Some(target.as_path()) } else { target.parent() };
        if let Some(dir) = top {
            parents.write(b, dir).map_err(|e| format!("cannot write the copy: {e}"))?;
        }
        if m.is_dir() {
            copy_children(b, src, &target, attrs).map_err(|e| format!("cannot copy {}: {e}", src.display()))?;
        } else {
            copy_one(b, src, &target, &m, attrs).map_err(|e| format!("cannot copy {}: {e}", src.display()))?;
        }
    }
    Ok(())
}

/// The parent directories written so far, each once.
struct Parents<'a> {
    view: &'a Merged,
    written: Vec<PathBuf>,
    /// Who owns the directories the copy creates (the `--chown` owner, as BuildKit does).
    owner: (u32, u32),
}

impl Parents<'_> {
    /// Writes `dir` (symlink-free, relative to the image root) and its ancestors: as the image
    /// has them, or as new 0755 directories of the copy's owner.
    fn write(&mut self, b: &mut tar::Builder<impl Write>, dir: &Path) -> io::Result<()> {
        let mut cur = PathBuf::new();
        for c in dir.components() {
            cur.push(c);
            if self.written.contains(&cur) {
                continue;
            }
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Directory);
            h.set_size(0);
            match fs::symlink_metadata(self.view.root().join(&cur)) {
                Ok(m) if m.is_dir() => {
                    h.set_mode(m.mode() & 0o7777);
                    h.set_uid(m.uid().into());
                    h.set_gid(m.gid().into());
                    h.set_mtime(m.mtime().max(0) as u64);
                }
                _ => {
                    h.set_mode(0o755);
                    h.set_uid(self.owner.0.into());
                    h.set_gid(self.owner.1.into());
                    h.set_mtime(now());
                }
            }
            b.append_data(&mut h, &cur, io::empty())?;
            self.written.push(cur.clone());
        }
        Ok(())
    }
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn copy_children(b: &mut tar::Builder<impl Write>, dir: &Path, target: &Path, attrs: Attrs) -> io::Result<()> {
    let mut names: Vec<_> = fs::read_dir(dir)?.map(|e| e.map(|e| e.file_name())).collect::<io::Result<_>>()?;
    names.sort();
    for n in names {
        let p = dir.join(&n);
        let m = fs::symlink_metadata(&p)?;
        copy_one(b, &p, &target.join(&n), &m, attrs)?;
    }
    Ok(())
}

fn copy_one(b: &mut tar::Builder<impl Write>, src: &Path, target: &Path, m: &fs::Metadata, attrs: Attrs) -> io::Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_uid(attrs.uid.into());
    h.set_gid(attrs.gid.into());
    h.set_mtime(m.mtime().max(0) as u64);
    h.set_mode(attrs.mode.unwrap_or(m.mode() & 0o7777));
    h.set_size(0);
    let ft = m.file_type();
    if ft.is_dir() {
        h.set_entry_type(tar::EntryType::Directory);
        if attrs.mode.is_none() {
            h.set_mode(m.mode() & 0o7777);
        }
        b.append_data(&mut h, target, io::empty())?;
        copy_children(b, src, target, attrs)
    } else if ft.is_symlink() {
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_mode(0o777);
        b.append_link(&mut h, target, fs::read_link(src)?)
    } else if ft.is_file() {
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(m.len());
        let f = fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(src)?;
        b.append_data(&mut h, target, f.take(m.len()))
    } else {
        // Sockets, FIFOs and devices are not copied (Docker refuses some and the layer store
        // would drop the rest).
        Ok(())
    }
}

/// The directories of `path` (absolute, inside the image) that do not exist yet, as a layer
/// (WORKDIR makes its directory as `mkdir -p` would, owned by `uid:gid`); `false` when the
/// directory is already there.
pub fn mkdir_p(view: &Merged, b: &mut tar::Builder<impl Write>, path: &str, uid: u32, gid: u32) -> Result<bool, String> {
    let resolved = view.resolve(path).map_err(|e| format!("cannot resolve {path} in the image: {e}"))?;
    if view.root().join(&resolved).is_dir() {
        return Ok(false);
    }
    let mut existing = PathBuf::new();
    let mut parents = Parents { view, written: Vec::new(), owner: (uid, gid) };
    for c in resolved.components() {
        let next = existing.join(c);
        if !view.root().join(&next).is_dir() {
            break;
        }
        existing = next;
    }
    parents.write(b, &existing).map_err(|e| e.to_string())?;
    let mut cur = existing.clone();
    for c in resolved.strip_prefix(&existing).unwrap_or(&resolved).components() {
        cur.push(c);
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_size(0);
        h.set_mode(0o755);
        h.set_uid(uid.into());
        h.set_gid(gid.into());
        h.set_mtime(now());
        b.append_data(&mut h, &cur, io::empty()).map_err(|e| e.to_string())?;
    }
    Ok(true)
}
