//! The volume API's file operations (E2B's `/volumecontent/{id}/...`), run as host root on the
//! root of a volume's mounted filesystem, whose contents untrusted sandboxes write.
//!
//! The threat: a sandbox plants symlinks (absolute, relative, `..`-laden), fifos, sockets, deep
//! trees, and swaps entries while a request runs, to make a root process read, write, chown or
//! delete host files, block forever, or exhaust its stack or fds. So:
//! - every path is resolved by the kernel with `openat2(RESOLVE_IN_ROOT | NO_MAGICLINKS |
//!   NO_XDEV)` from the volume root's fd: a symlink resolves as if the volume root were `/`, and
//!   neither `..`, `/proc/*/fd` links nor a mount inside the volume leads out of it;
//! - a change is made on an fd (fchown, fchmod) or by a single name relative to a directory fd
//!   (mkdirat, unlinkat, renameat2), never by a path the kernel would re-resolve;
//! - the last component is not followed for stat, chown, chmod and remove (a symlink is the
//!   link itself), and a tree walk opens each level by one name with `RESOLVE_NO_SYMLINKS`;
//! - special files are never opened for reading, and every open is `O_NONBLOCK`, so a fifo or a
//!   lease cannot hang a request;
//! - walks keep at most [`MAX_DEPTH`] directory fds and loop instead of recursing, and a
//!   listing stops at [`MAX_LIST_ENTRIES`].

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustix::fs::{
    chownat, fchmod, fchown, fcntl_setfl, mkdirat, openat2, readlinkat, renameat_with, statx, unlinkat, AtFlags, Dir,
    FileType, Gid, Mode, OFlags, RenameFlags, ResolveFlags, Statx, StatxFlags, StatxTimestamp, Uid,
};
use rustix::io::Errno;

/// Most entries one listing returns; more is [`ContentError::TooLarge`].
pub const MAX_LIST_ENTRIES: usize = 100_000;
/// Most directory levels a listing or removal holds open at once.
pub const MAX_DEPTH: usize = 64;

/// Resolution of a request's path: inside the volume, whatever its symlinks say.
const IN_ROOT: ResolveFlags = ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS).union(ResolveFlags::NO_XDEV);
/// Resolution of one name in a walk: no symlink at all, nothing above or beside the directory.
const ONE_NAME: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Directory,
    Symlink,
    /// A fifo, socket or device.
    Unknown,
}

impl Kind {
    pub fn as_str(&self) -> &'static str {
        match self {
            Kind::File => "file",
            Kind::Directory => "directory",
            Kind::Symlink => "symlink",
            Kind::Unknown => "unknown",
        }
    }

    fn of(st: &Statx) -> Kind {
        match FileType::from_raw_mode(u32::from(st.stx_mode)) {
            FileType::RegularFile => Kind::File,
            FileType::Directory => Kind::Directory,
            FileType::Symlink => Kind::Symlink,
            _ => Kind::Unknown,
        }
    }
}

/// One file as the API shows it.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub kind: Kind,
    /// Normalized and absolute within the volume, e.g. `/a/b`.
    pub path: String,
    pub size: u64,
    /// Permission bits only (`st_mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
    /// A symlink's target text, as stored (never resolved).
    pub target: Option<String>,
}

/// Ownership and mode to set; `None` keeps (or, on create, defaults) each.
#[derive(Debug, Clone, Copy, Default)]
pub struct Meta {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum ContentError {
    #[error("{0}: no such file or directory")]
    NotFound(String),
    #[error("{0} already exists")]
    Exists(String),
    #[error("{0} is a directory")]
    IsDirectory(String),
    #[error("{0}: not a directory (it or one of its parents is something else)")]
    NotDirectory(String),
    #[error("{0} is not a regular file (a fifo, socket or device): only regular files can be read")]
    NotRegular(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("{0}: no space left on the volume: delete files or use a larger volume")]
    NoSpace(String),
    #[error("too large: {0}")]
    TooLarge(String),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
}

fn err(op: &'static str, path: &str, e: Errno) -> ContentError {
    let path = path.to_owned();
    match e {
        // EXDEV: NO_XDEV met a mount point inside the volume, which is not part of it.
        Errno::NOENT | Errno::XDEV => ContentError::NotFound(path),
        Errno::EXIST => ContentError::Exists(path),
        Errno::NOTDIR => ContentError::NotDirectory(path),
        Errno::ISDIR => ContentError::IsDirectory(path),
        Errno::NOSPC | Errno::DQUOT => ContentError::NoSpace(path),
        Errno::LOOP => ContentError::Invalid(format!("{path}: too many levels of symbolic links")),
        Errno::NAMETOOLONG => ContentError::Invalid(format!("{path}: path too long")),
        _ => ContentError::Io { op, path, source: e.into() },
    }
}

/// `"a//b/./c/../d"` -> `"/a/b/d"`; `..` never climbs above `/`.
pub fn normalize(path: &str) -> Result<String, ContentError> {
    if path.is_empty() {
        return Err(ContentError::Invalid("empty path".into()));
    }
    if path.contains('\0') {
        return Err(ContentError::Invalid("path contains a NUL byte".into()));
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            _ if part.len() > 255 => {
                return Err(ContentError::Invalid(format!(
                    "path component '{}...' is longer than 255 bytes",
                    part.chars().take(32).collect::<String>()
                )))
            }
            _ => parts.push(part),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// `"/a/b"` -> `("/a", "b")`; `"/"` -> `("/", "")`.
fn split(norm: &str) -> (&str, &str) {
    match norm.rfind('/') {
        Some(0) | None => ("/", norm.trim_start_matches('/')),
        Some(i) => (&norm[..i], &norm[i + 1..]),
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

fn check_meta(meta: &Meta) -> Result<(), ContentError> {
    if let Some(mode) = meta.mode.filter(|m| *m > 0o7777) {
        return Err(ContentError::Invalid(format!("mode {mode:#o} is out of range: use 0 to 0o7777")));
    }
    // -1 means "leave unchanged" to chown(2), never an owner.
    if meta.uid == Some(u32::MAX) || meta.gid == Some(u32::MAX) {
        return Err(ContentError::Invalid("uid and gid must be below 4294967295".into()));
    }
    Ok(())
}

fn time(t: &StatxTimestamp) -> SystemTime {
    let secs = match u64::try_from(t.tv_sec) {
        Ok(s) => UNIX_EPOCH.checked_add(Duration::from_secs(s)),
        Err(_) => UNIX_EPOCH.checked_sub(Duration::from_secs(t.tv_sec.unsigned_abs())),
    };
    secs.and_then(|s| s.checked_add(Duration::from_nanos(u64::from(t.tv_nsec)))).unwrap_or(UNIX_EPOCH)
}

fn entry(name: &str, path: String, st: &Statx, target: Option<String>) -> Entry {
    Entry {
        name: name.to_owned(),
        kind: Kind::of(st),
        path,
        size: st.stx_size,
        mode: u32::from(st.stx_mode) & 0o7777,
        uid: st.stx_uid,
        gid: st.stx_gid,
        atime: time(&st.stx_atime),
        mtime: time(&st.stx_mtime),
        ctime: time(&st.stx_ctime),
        target,
    }
}

fn fstatx(fd: impl AsFd, norm: &str) -> Result<Statx, ContentError> {
    let flags = AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW;
    statx(fd, c"", flags, StatxFlags::BASIC_STATS).map_err(|e| err("stat", norm, e))
}

/// The text of the symlink `name` in `dir` (`""`: `dir` is an `O_PATH` fd of the link itself).
fn link_target(dir: impl AsFd, name: &CStr, st: &Statx) -> Option<String> {
    let text = (Kind::of(st) == Kind::Symlink).then(|| readlinkat(dir, name, Vec::new()).ok())??;
    Some(text.to_string_lossy().into_owned())
}

/// The stat of what `fd` is (a symlink itself if it is an `O_PATH|O_NOFOLLOW` fd of one).
fn stat_fd(fd: impl AsFd, norm: &str) -> Result<Entry, ContentError> {
    let st = fstatx(&fd, norm)?;
    Ok(entry(split(norm).1, norm.to_owned(), &st, link_target(&fd, c"", &st)))
}

fn same_file(a: &Statx, b: &Statx) -> bool {
    (a.stx_dev_major, a.stx_dev_minor, a.stx_ino) == (b.stx_dev_major, b.stx_dev_minor, b.stx_ino)
}

/// A volume's root directory, the only place every operation starts from.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
}

impl Root {
    /// Opens the volume root (a host path the server chose, so following it is fine).
    pub fn open(dir: &Path) -> Result<Root, ContentError> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let fd = rustix::fs::open(dir, flags, Mode::empty())
            .map_err(|e| err("open volume root", &dir.to_string_lossy(), e))?;
        Ok(Root { fd })
    }

    /// Opens a normalized path inside the volume.
    fn resolve(&self, norm: &str, flags: OFlags) -> Result<OwnedFd, ContentError> {
        let rel = match norm.trim_start_matches('/') {
            "" => ".",
            rel => rel,
        };
        // EAGAIN: a rename elsewhere raced with a `..` in the resolution; the kernel asks to retry.
        let mut tries = 0;
        loop {
            match openat2(&self.fd, rel, flags | OFlags::CLOEXEC, Mode::empty(), IN_ROOT) {
                Err(Errno::AGAIN) if tries < 16 => tries += 1,
                r => return r.map_err(|e| err("open", norm, e)),
            }
        }
    }

    fn parent_of(&self, norm: &str) -> Result<OwnedFd, ContentError> {
        let (parent, _) = split(norm);
        self.resolve(parent, OFlags::PATH | OFlags::DIRECTORY)
    }

    /// The path itself, a symlink not followed; `/` is the root directory (name `""`).
    pub fn stat(&self, path: &str) -> Result<Entry, ContentError> {
        let norm = normalize(path)?;
        let fd = self.resolve(&norm, OFlags::PATH | OFlags::NOFOLLOW)?;
        stat_fd(&fd, &norm)
    }

    /// A directory's entries to `depth` levels (0 counts as 1), sorted by path. `path` itself
    /// may be a symlink (followed inside the volume); below it only real subdirectories are
    /// entered, never a symlink to one, which is listed as a symlink.
    pub fn list(&self, path: &str, depth: u32) -> Result<Vec<Entry>, ContentError> {
        let norm = normalize(path)?;
        let depth = usize::try_from(depth.max(1)).unwrap_or(usize::MAX);
        let top = self.resolve(&norm, OFlags::RDONLY | OFlags::DIRECTORY)?;
        let mut out = Vec::new();
        let dir = Dir::new(top).map_err(|e| err("list", &norm, e))?;
        let mut stack: Vec<(Dir, String)> = vec![(dir, norm)];
        while !stack.is_empty() {
            let level = stack.len();
            let Some((dir, dir_path)) = stack.last_mut() else { break };
            let item = match dir.read() {
                None => {
                    stack.pop();
                    continue;
                }
                Some(item) => item.map_err(|e| err("list", dir_path, e))?,
            };
            let cname = item.file_name();
            if cname == c"." || cname == c".." {
                continue;
            }
            let dfd = dir.fd().map_err(|e| err("list", dir_path, e))?;
            let name = cname.to_string_lossy().into_owned();
            let path = join(dir_path, &name);
            let st = match statx(dfd, cname, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::BASIC_STATS) {
                Ok(st) => st,
                Err(Errno::NOENT) => continue, // removed since the directory was read
                Err(e) => return Err(err("stat", &path, e)),
            };
            let kind = Kind::of(&st);
            let target = link_target(dfd, cname, &st);
            let mut child = None;
            if kind == Kind::Directory && level < depth {
                if level >= MAX_DEPTH {
                    return Err(ContentError::TooLarge(format!(
                        "{path} is more than {MAX_DEPTH} levels below the listed directory: list it directly or use a smaller depth"
                    )));
                }
                let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                // A swap for a symlink since the stat is ELOOP: list it, never enter it.
                match openat2(dfd, cname, flags, Mode::empty(), ONE_NAME) {
                    Ok(fd) => child = Some(Dir::new(fd).map_err(|e| err("list", &path, e))?),
                    Err(Errno::LOOP | Errno::NOTDIR | Errno::NOENT | Errno::XDEV) => {}
                    Err(e) => return Err(err("list", &path, e)),
                }
            }
            out.push(entry(&name, path.clone(), &st, target));
            if out.len() > MAX_LIST_ENTRIES {
                return Err(ContentError::TooLarge(format!(
                    "more than {MAX_LIST_ENTRIES} entries: list a subdirectory or use a smaller depth"
                )));
            }
            if let Some(child) = child {
                stack.push((child, path));
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// `mkdir`, or with `force` `mkdir -p`; each directory it creates gets `meta` (defaults
    /// uid 0, gid 0, mode 0o755). An existing directory at `path` is returned as it is.
    pub fn make_dir(&self, path: &str, meta: Meta, force: bool) -> Result<Entry, ContentError> {
        check_meta(&meta)?;
        let norm = normalize(path)?;
        if norm == "/" {
            return if force { self.stat("/") } else { Err(ContentError::Exists(norm)) };
        }
        if !force {
            let parent = self.parent_of(&norm)?;
            let fd = make_one(&parent, split(&norm).1, &norm, &meta)?;
            return stat_fd(&fd, &norm);
        }
        let mut cur = self.resolve("/", OFlags::PATH | OFlags::DIRECTORY)?;
        let mut prefix = String::new();
        let parts: Vec<&str> = norm[1..].split('/').collect();
        for (i, part) in parts.iter().enumerate() {
            prefix.push('/');
            prefix.push_str(part);
            let last = i + 1 == parts.len();
            // Existing components are followed as mkdir -p does, inside the root.
            cur = match self.resolve(&prefix, OFlags::PATH | OFlags::DIRECTORY) {
                Ok(fd) => fd,
                Err(ContentError::NotFound(_)) => match make_one(&cur, part, &prefix, &meta) {
                    Ok(fd) => fd,
                    // A racing mkdir made it (fine), or a dangling symlink holds the name.
                    Err(ContentError::Exists(_)) => {
                        self.resolve(&prefix, OFlags::PATH | OFlags::DIRECTORY).map_err(|e| match e {
                            ContentError::NotFound(p) => ContentError::Exists(p),
                            e => e,
                        })?
                    }
                    Err(e) => return Err(e),
                },
                Err(ContentError::NotDirectory(_)) if last => return Err(ContentError::Exists(norm)),
                Err(ContentError::NotDirectory(_)) => return Err(ContentError::NotDirectory(prefix)),
                Err(e) => return Err(e),
            };
        }
        stat_fd(&cur, &norm)
    }

    /// A regular file's contents, the path's symlinks followed inside the volume. Never opens
    /// a fifo, socket or device.
    pub fn open_read(&self, path: &str) -> Result<(File, Entry), ContentError> {
        let norm = normalize(path)?;
        let check = |st: &Statx| match Kind::of(st) {
            Kind::File => Ok(()),
            Kind::Directory => Err(ContentError::IsDirectory(norm.clone())),
            _ => Err(ContentError::NotRegular(norm.clone())),
        };
        // Look before opening: an open of a device runs its driver, even if read never follows.
        let probe = self.resolve(&norm, OFlags::PATH)?;
        check(&fstatx(&probe, &norm)?)?;
        // O_NONBLOCK: if the file was swapped for a fifo meanwhile, or a lease is held on it,
        // the open returns instead of waiting for a writer or the lease break.
        let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY;
        let fd = self.resolve(&norm, flags).map_err(|e| match e {
            ContentError::Io { source, .. } if source.raw_os_error() == Some(libc::ENXIO) => {
                ContentError::NotRegular(norm.clone())
            }
            e => e,
        })?;
        let st = fstatx(&fd, &norm)?;
        check(&st)?;
        fcntl_setfl(&fd, OFlags::empty()).map_err(|e| err("open", &norm, e))?;
        let entry = entry(split(&norm).1, norm.clone(), &st, None);
        Ok((File::from(fd), entry))
    }

    /// Starts writing `path`; the data goes to a temporary file beside it until
    /// [`NewFile::commit`].
    pub fn create_file(&self, path: &str, meta: Meta, force: bool) -> Result<NewFile, ContentError> {
        check_meta(&meta)?;
        let norm = normalize(path)?;
        if norm == "/" {
            return Err(ContentError::IsDirectory(norm));
        }
        let parent = self.parent_of(&norm)?;
        let name = split(&norm).1.to_owned();
        match statx(&parent, name.as_str(), AtFlags::SYMLINK_NOFOLLOW, StatxFlags::TYPE) {
            Ok(st) if Kind::of(&st) == Kind::Directory => return Err(ContentError::IsDirectory(norm)),
            Ok(_) if !force => return Err(ContentError::Exists(norm)),
            Ok(_) | Err(Errno::NOENT) => {}
            Err(e) => return Err(err("stat", &norm, e)),
        }
        // The temp name keeps a hint of the final one, within the 255-byte name limit.
        let mut cut = name.len().min(200);
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut tries = 0;
        loop {
            let mut random = [0u8; 8];
            getrandom::fill(&mut random).map_err(|e| ContentError::Io {
                op: "create",
                path: norm.clone(),
                source: io::Error::other(e.to_string()),
            })?;
            let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
            let temp = format!(".{}.cordon-{hex}", &name[..cut]);
            // O_EXCL never follows or reuses what a sandbox planted under the same name.
            let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            match openat2(&parent, temp.as_str(), flags, Mode::from_raw_mode(0o600), ONE_NAME) {
                Ok(fd) => {
                    let (uid, gid, mode) = (meta.uid.unwrap_or(0), meta.gid.unwrap_or(0), meta.mode.unwrap_or(0o644));
                    return Ok(NewFile {
                        parent,
                        temp,
                        name,
                        path: norm,
                        file: File::from(fd),
                        uid,
                        gid,
                        mode,
                        force,
                        done: false,
                    });
                }
                Err(Errno::EXIST) if tries < 4 => tries += 1,
                Err(e) => return Err(err("create", &norm, e)),
            }
        }
    }

    /// Changes owner and mode of the path itself (a symlink is not followed; it has no mode).
    pub fn set_meta(&self, path: &str, meta: Meta) -> Result<Entry, ContentError> {
        check_meta(&meta)?;
        let norm = normalize(path)?;
        let handle = self.resolve(&norm, OFlags::PATH | OFlags::NOFOLLOW)?;
        let st = fstatx(&handle, &norm)?;
        // fchmod needs a real fd, which O_PATH is not. Opened before any change, so a refusal
        // changes nothing.
        let mut open = None;
        if meta.mode.is_some() {
            let flags = match FileType::from_raw_mode(u32::from(st.stx_mode)) {
                FileType::Symlink => {
                    return Err(ContentError::Invalid(format!("{norm}: a symlink has no mode of its own")))
                }
                FileType::Directory => OFlags::RDONLY | OFlags::DIRECTORY,
                // A fifo opened for reading with O_NONBLOCK does not wait for a writer.
                FileType::RegularFile | FileType::Fifo => OFlags::RDONLY | OFlags::NONBLOCK,
                _ => {
                    return Err(ContentError::Invalid(format!(
                        "{norm}: the mode of a socket or device cannot be changed"
                    )))
                }
            };
            let fd = self.resolve(&norm, flags | OFlags::NOFOLLOW | OFlags::NOCTTY)?;
            if !same_file(&st, &fstatx(&fd, &norm)?) {
                let source = io::Error::other("it was replaced during the request; try again");
                return Err(ContentError::Io { op: "chmod", path: norm, source });
            }
            open = Some(fd);
        }
        if meta.uid.is_some() || meta.gid.is_some() {
            let (uid, gid) = (meta.uid.map(Uid::from_raw), meta.gid.map(Gid::from_raw));
            // AT_EMPTY_PATH on the O_PATH fd: the object itself, even a symlink, never its target.
            chownat(&handle, c"", uid, gid, AtFlags::EMPTY_PATH).map_err(|e| err("chown", &norm, e))?;
        }
        if let (Some(fd), Some(mode)) = (&open, meta.mode) {
            fchmod(fd, Mode::from_raw_mode(mode)).map_err(|e| err("chmod", &norm, e))?;
        }
        stat_fd(&handle, &norm)
    }

    /// Removes a file, symlink (itself) or directory tree. `/` is NotFound, as E2B answers it.
    pub fn remove(&self, path: &str) -> Result<(), ContentError> {
        let norm = normalize(path)?;
        if norm == "/" {
            return Err(ContentError::NotFound(norm));
        }
        let parent = self.parent_of(&norm)?;
        let name =
            CString::new(split(&norm).1).map_err(|_| ContentError::Invalid("path contains a NUL byte".into()))?;
        remove_tree(&parent, &name, &norm)
    }
}

/// mkdirat then fix owner and mode on an fd: the umask cannot interfere, and a swap of the
/// new directory for a symlink makes the open fail rather than chown its target.
fn make_one(parent: &OwnedFd, name: &str, path: &str, meta: &Meta) -> Result<OwnedFd, ContentError> {
    mkdirat(parent, name, Mode::from_raw_mode(0o700)).map_err(|e| err("mkdir", path, e))?;
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = openat2(parent, name, flags, Mode::empty(), ONE_NAME).map_err(|e| err("mkdir", path, e))?;
    let (uid, gid) = (Uid::from_raw(meta.uid.unwrap_or(0)), Gid::from_raw(meta.gid.unwrap_or(0)));
    fchown(&fd, Some(uid), Some(gid)).map_err(|e| err("chown", path, e))?;
    fchmod(&fd, Mode::from_raw_mode(meta.mode.unwrap_or(0o755))).map_err(|e| err("chmod", path, e))?;
    Ok(fd)
}

/// One directory being emptied: its entries, its name in the level above, and its path.
struct Level {
    dir: Dir,
    name: CString,
    path: String,
    rewinds: u8,
}

/// Removes `name` in `parent`, depth first with an explicit stack of at most [`MAX_DEPTH`]
/// directory fds, each opened by one name with no symlink followed.
fn remove_tree(parent: &OwnedFd, name: &CStr, path: &str) -> Result<(), ContentError> {
    let mut stack: Vec<Level> = Vec::new();
    let mut next = Some((name.to_owned(), path.to_owned()));
    // A sandbox flipping a name between a directory and a symlink must not keep us looping.
    let mut swaps = 0u32;
    loop {
        if let Some((name, path)) = next.take() {
            let dfd = match stack.last() {
                Some(level) => level.dir.fd().map_err(|e| err("remove", &level.path, e))?,
                None => parent.as_fd(),
            };
            // unlink first: a symlink, file or fifo goes by its name alone (EISDIR: a directory).
            match unlinkat(dfd, name.as_c_str(), AtFlags::empty()) {
                Ok(()) => {}
                Err(Errno::NOENT) if !stack.is_empty() => {}
                Err(Errno::ISDIR) => {
                    if stack.len() >= MAX_DEPTH {
                        return Err(ContentError::TooLarge(format!(
                            "{path} is more than {MAX_DEPTH} levels below the removed directory: remove its deeper parts first"
                        )));
                    }
                    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                    match openat2(dfd, name.as_c_str(), flags, Mode::empty(), ONE_NAME) {
                        Ok(fd) => {
                            let dir = Dir::new(fd).map_err(|e| err("remove", &path, e))?;
                            stack.push(Level { dir, name, path, rewinds: 0 });
                        }
                        // Swapped for a symlink or file since the unlink: unlink that instead.
                        Err(Errno::LOOP | Errno::NOTDIR) if swaps < 16 => {
                            swaps += 1;
                            next = Some((name, path));
                        }
                        Err(Errno::NOENT) if !stack.is_empty() => {}
                        Err(e) => return Err(err("remove", &path, e)),
                    }
                }
                Err(e) => return Err(err("remove", &path, e)),
            }
            continue;
        }
        let Some(level) = stack.last_mut() else { return Ok(()) };
        match level.dir.read() {
            Some(Ok(item)) => {
                let name = item.file_name();
                if name != c"." && name != c".." {
                    next = Some((name.to_owned(), join(&level.path, &name.to_string_lossy())));
                }
            }
            Some(Err(e)) => return Err(err("remove", &level.path, e)),
            None => {
                let Some(mut done) = stack.pop() else { return Ok(()) };
                let dfd = match stack.last() {
                    Some(level) => level.dir.fd().map_err(|e| err("remove", &level.path, e))?,
                    None => parent.as_fd(),
                };
                match unlinkat(dfd, done.name.as_c_str(), AtFlags::REMOVEDIR) {
                    Ok(()) | Err(Errno::NOENT) => {}
                    // A sandbox wrote into it meanwhile: go over it again, a bounded number of times.
                    Err(Errno::NOTEMPTY) if done.rewinds < 3 => {
                        done.rewinds += 1;
                        done.dir.rewind();
                        stack.push(done);
                    }
                    Err(e) => return Err(err("remove", &done.path, e)),
                }
            }
        }
    }
}

/// A file being written: a temporary file beside its final name until [`NewFile::commit`].
#[derive(Debug)]
pub struct NewFile {
    parent: OwnedFd,
    temp: String,
    name: String,
    path: String,
    file: File,
    uid: u32,
    gid: u32,
    mode: u32,
    force: bool,
    done: bool,
}

impl NewFile {
    pub fn write_all(&mut self, data: &[u8]) -> Result<(), ContentError> {
        self.file.write_all(data).map_err(|source| match source.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => ContentError::NoSpace(self.path.clone()),
            _ => ContentError::Io { op: "write", path: self.path.clone(), source },
        })
    }

    /// Sets owner and mode on the fd, then renames the file onto its name: with `force`
    /// replacing a file or symlink there (rename never follows it), without it refusing
    /// anything created there meanwhile. No fsync: too slow for the API, and ext4 orders a
    /// replace-by-rename's data before the rename anyway.
    pub fn commit(mut self) -> Result<Entry, ContentError> {
        let (uid, gid) = (Uid::from_raw(self.uid), Gid::from_raw(self.gid));
        fchown(&self.file, Some(uid), Some(gid)).map_err(|e| err("chown", &self.path, e))?;
        // After the chown, which clears setuid and setgid bits.
        fchmod(&self.file, Mode::from_raw_mode(self.mode)).map_err(|e| err("chmod", &self.path, e))?;
        let flags = if self.force { RenameFlags::empty() } else { RenameFlags::NOREPLACE };
        renameat_with(&self.parent, self.temp.as_str(), &self.parent, self.name.as_str(), flags)
            .map_err(|e| err("rename", &self.path, e))?;
        self.done = true;
        stat_fd(&self.file, &self.path)
    }
}

impl Drop for NewFile {
    fn drop(&mut self) {
        if !self.done {
            let _ = unlinkat(&self.parent, self.temp.as_str(), AtFlags::empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::io::Read;
    use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
    use std::path::PathBuf;
    use std::sync::mpsc;

    /// A volume root `vol` beside a host directory `out` holding a secret the volume must never
    /// reach: `<base>/vol` and `<base>/out/secret`, `<base>/out/sub/file`.
    struct Fx {
        base: PathBuf,
        vol: PathBuf,
        out: PathBuf,
        root: Root,
    }

    impl Fx {
        /// None when not root: the operations chown to uid 0 by default, which needs root.
        fn new() -> Option<Fx> {
            // SAFETY: geteuid has no preconditions and cannot fail.
            if unsafe { libc::geteuid() } != 0 {
                eprintln!("skipped: the content tests need root");
                return None;
            }
            let mut random = [0u8; 8];
            getrandom::fill(&mut random).expect("random");
            let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
            let base = std::env::temp_dir().join(format!("cordon-content-{hex}"));
            let (vol, out) = (base.join("vol"), base.join("out"));
            fs::create_dir_all(&vol).expect("mkdir vol");
            fs::create_dir_all(out.join("sub")).expect("mkdir out");
            fs::write(out.join("secret"), "host secret").expect("write secret");
            fs::set_permissions(out.join("secret"), fs::Permissions::from_mode(0o600)).expect("chmod");
            fs::write(out.join("sub/file"), "host file").expect("write file");
            let root = Root::open(&vol).expect("open root");
            Some(Fx { base, vol, out, root })
        }

        /// Every path, content, mode and owner under `out`, to compare before and after attacks.
        fn outside(&self) -> Vec<(PathBuf, Vec<u8>, u32, u32, u32)> {
            let mut all = Vec::new();
            let mut todo = vec![self.out.clone()];
            while let Some(p) = todo.pop() {
                let md = fs::symlink_metadata(&p).expect("lstat outside");
                let data = if md.is_file() { fs::read(&p).expect("read outside") } else { Vec::new() };
                if md.is_dir() {
                    todo.extend(fs::read_dir(&p).expect("readdir").map(|e| e.expect("entry").path()));
                }
                all.push((p, data, md.mode(), md.uid(), md.gid()));
            }
            all.sort();
            all
        }

        fn write(&self, path: &str, data: &str, meta: Meta, force: bool) -> Result<Entry, ContentError> {
            let mut f = self.root.create_file(path, meta, force)?;
            f.write_all(data.as_bytes())?;
            f.commit()
        }

        fn read(&self, path: &str) -> Result<String, ContentError> {
            let (mut f, _) = self.root.open_read(path)?;
            let mut s = String::new();
            f.read_to_string(&mut s).expect("read");
            Ok(s)
        }
    }

    impl Drop for Fx {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.base);
        }
    }

    /// A result's error variant, "ok" for success: short asserts that show what came instead.
    fn e<T>(r: Result<T, ContentError>) -> &'static str {
        match r {
            Ok(_) => "ok",
            Err(ContentError::NotFound(_)) => "NotFound",
            Err(ContentError::Exists(_)) => "Exists",
            Err(ContentError::IsDirectory(_)) => "IsDirectory",
            Err(ContentError::NotDirectory(_)) => "NotDirectory",
            Err(ContentError::NotRegular(_)) => "NotRegular",
            Err(ContentError::Invalid(_)) => "Invalid",
            Err(ContentError::NoSpace(_)) => "NoSpace",
            Err(ContentError::TooLarge(_)) => "TooLarge",
            Err(ContentError::Io { .. }) => "Io",
        }
    }

    fn only_mode(mode: u32) -> Meta {
        Meta { mode: Some(mode), ..Meta::default() }
    }

    fn meta(uid: u32, gid: u32, mode: u32) -> Meta {
        Meta { uid: Some(uid), gid: Some(gid), mode: Some(mode) }
    }

    #[test]
    fn normalize_paths() {
        assert_eq!(normalize("a//b/./c/../d").unwrap(), "/a/b/d");
        assert_eq!(normalize("/").unwrap(), "/");
        assert_eq!(normalize(".").unwrap(), "/");
        assert_eq!(normalize("/a/b/").unwrap(), "/a/b");
        assert_eq!(normalize("../../etc/passwd").unwrap(), "/etc/passwd");
        assert_eq!(normalize("/a/../../..").unwrap(), "/");
        assert_eq!(normalize(&"x".repeat(255)).unwrap(), format!("/{}", "x".repeat(255)));
        assert_eq!(e(normalize("")), "Invalid");
        assert_eq!(e(normalize("a\0b")), "Invalid");
        assert_eq!(e(normalize(&format!("a/{}", "x".repeat(256)))), "Invalid");
    }

    #[test]
    fn symlinks_never_reach_outside() {
        let Some(fx) = Fx::new() else { return };
        let before = fx.outside();
        let host_secret = fx.out.join("secret");
        let climb = format!("../../../../../../../..{}", host_secret.display());
        symlink(&host_secret, fx.vol.join("abs")).unwrap();
        symlink("../out/secret", fx.vol.join("rel")).unwrap();
        symlink(&climb, fx.vol.join("climb")).unwrap();
        symlink(&fx.out, fx.vol.join("absdir")).unwrap();
        symlink("../out", fx.vol.join("reldir")).unwrap();
        fs::create_dir(fx.vol.join("d")).unwrap();
        symlink("../../out", fx.vol.join("d/up")).unwrap();
        // On a real volume (its own filesystem) a sandbox cannot hard-link a host file; here it
        // can, which at least shows that remove takes the name and not the file.
        fs::hard_link(&host_secret, fx.vol.join("hard")).unwrap();

        for link in ["/abs", "/rel", "/climb"] {
            assert_eq!(e(fx.root.open_read(link)), "NotFound", "{link}");
            let st = fx.root.stat(link).unwrap();
            assert_eq!(st.kind, Kind::Symlink);
            assert!(st.target.is_some());
            assert_eq!(e(fx.root.set_meta(link, only_mode(0o777))), "Invalid");
            // chown of the link itself, not of the host file it names.
            assert_eq!(fx.root.set_meta(link, Meta { uid: Some(4242), ..Meta::default() }).unwrap().uid, 4242);
        }
        assert_eq!(fx.root.stat("/abs").unwrap().target.as_deref(), Some(host_secret.to_str().unwrap()));
        for dir in ["/absdir", "/reldir", "/d/up"] {
            let inside = |p: &str| format!("{dir}/{p}");
            for p in ["secret", "sub/file"] {
                assert_eq!(e(fx.root.open_read(&inside(p))), "NotFound", "{dir}");
                assert_eq!(e(fx.root.stat(&inside(p))), "NotFound", "{dir}");
                assert_eq!(e(fx.root.set_meta(&inside(p), meta(4242, 4242, 0o777))), "NotFound");
                assert_eq!(e(fx.root.remove(&inside(p))), "NotFound", "{dir}");
                assert_eq!(e(fx.write(&inside(p), "pwned", Meta::default(), true)), "NotFound");
            }
            assert_eq!(e(fx.root.list(dir, 2)), "NotFound", "{dir}");
            assert_eq!(e(fx.root.list(&inside("sub"), 1)), "NotFound", "{dir}");
            assert_eq!(e(fx.write(&inside("new"), "x", Meta::default(), false)), "NotFound");
            assert_eq!(e(fx.root.make_dir(&inside("new"), Meta::default(), false)), "NotFound");
            assert!(fx.root.make_dir(&inside("new/deeper"), Meta::default(), true).is_err(), "{dir}");
            assert_eq!(fx.root.stat(dir).unwrap().kind, Kind::Symlink);
        }
        // Replacing a symlink with force replaces the link, never writes through it.
        assert_eq!(fx.write("/abs", "mine", Meta::default(), true).unwrap().kind, Kind::File);
        assert_eq!(fx.read("/abs").unwrap(), "mine");
        for p in ["/rel", "/climb", "/absdir", "/reldir", "/d", "/hard"] {
            fx.root.remove(p).unwrap();
        }
        assert_eq!(fx.outside(), before, "a host file outside the volume changed");
        assert_eq!(fs::read_to_string(&host_secret).unwrap(), "host secret");
    }

    #[test]
    fn symlinks_resolve_inside_the_volume() {
        let Some(fx) = Fx::new() else { return };
        let host_secret = fx.out.join("secret");
        let own = fx.vol.join(host_secret.strip_prefix("/").unwrap());
        fs::create_dir_all(own.parent().unwrap()).unwrap();
        fs::write(&own, "volume's own").unwrap();
        fs::create_dir_all(fx.vol.join("out")).unwrap();
        fs::write(fx.vol.join("out/secret"), "volume's out").unwrap();
        symlink(&host_secret, fx.vol.join("abs")).unwrap();
        symlink(format!("../../../..{}", host_secret.display()), fx.vol.join("climb")).unwrap();
        symlink("../out/secret", fx.vol.join("rel")).unwrap();
        symlink("/", fx.vol.join("slash")).unwrap();
        assert_eq!(fx.read("/abs").unwrap(), "volume's own");
        assert_eq!(fx.read("/climb").unwrap(), "volume's own");
        assert_eq!(fx.read("/rel").unwrap(), "volume's out");
        assert_eq!(fx.read("/slash/slash/out/secret").unwrap(), "volume's out");
        assert_eq!(fx.read("/../../out/secret").unwrap(), "volume's out");
        let names: Vec<String> = fx.root.list("/slash/out", 1).unwrap().into_iter().map(|x| x.path).collect();
        assert_eq!(names, ["/slash/out/secret"]);
    }

    #[test]
    fn special_files_never_block() {
        let Some(fx) = Fx::new() else { return };
        rustix::fs::mknodat(rustix::fs::CWD, fx.vol.join("fifo"), FileType::Fifo, Mode::from_raw_mode(0o644), 0)
            .unwrap();
        let _socket = std::os::unix::net::UnixListener::bind(fx.vol.join("sock")).unwrap();
        symlink("fifo", fx.vol.join("to-fifo")).unwrap();
        let (tx, rx) = mpsc::channel();
        let vol = fx.vol.clone();
        std::thread::spawn(move || {
            let root = Root::open(&vol).unwrap();
            let reads = ["/fifo", "/to-fifo", "/sock"].map(|p| root.open_read(p).map(|_| ()));
            let chmod = root.set_meta("/fifo", only_mode(0o600));
            let _ = tx.send((reads, chmod, root.stat("/fifo"), root.remove("/fifo")));
        });
        let (reads, chmod, stat, removed) =
            rx.recv_timeout(Duration::from_secs(3)).expect("an operation on a fifo blocked");
        for r in reads {
            assert_eq!(e(r), "NotRegular");
        }
        assert_eq!(chmod.unwrap().mode, 0o600);
        assert_eq!(stat.unwrap().kind, Kind::Unknown);
        removed.unwrap();
        assert_eq!(e(fx.root.open_read("/")), "IsDirectory");
        assert_eq!(e(fx.root.set_meta("/sock", meta(0, 0, 0o600))), "Invalid");
    }

    #[test]
    fn deep_trees_are_bounded() {
        let Some(fx) = Fx::new() else { return };
        let at = |k: usize| format!("/deep{}", "/d".repeat(k));
        fs::create_dir_all(fx.vol.join(&at(200)[1..])).unwrap();
        fs::write(fx.vol.join(&at(200)[1..]).join("f"), "x").unwrap();
        assert_eq!(e(fx.root.list("/deep", 1000)), "TooLarge");
        assert_eq!(fx.root.list("/deep", 10).unwrap().len(), 10);
        assert_eq!(e(fx.root.remove("/deep")), "TooLarge");
        assert!(fx.root.stat(&at(200)).is_ok(), "a refused remove still took the bottom");
        // The way out the error names: remove the deeper parts first.
        for k in [150, 90, 30] {
            fx.root.remove(&at(k)).unwrap();
        }
        fx.root.remove("/deep").unwrap();
        assert_eq!(e(fx.root.stat("/deep")), "NotFound");
    }

    #[test]
    fn write_commit_and_meta() {
        let Some(fx) = Fx::new() else { return };
        let en = fx.write("/f", "one", Meta::default(), false).unwrap();
        assert_eq!(
            (en.kind, en.size, en.mode, en.uid, en.gid, en.name.as_str(), en.path.as_str()),
            (Kind::File, 3, 0o644, 0, 0, "f", "/f")
        );
        assert_eq!(e(fx.write("/f", "two", Meta::default(), false)), "Exists");
        let en = fx.write("/f", "three", meta(1234, 5678, 0o4750), true).unwrap();
        assert_eq!((en.size, en.mode, en.uid, en.gid), (5, 0o4750, 1234, 5678));
        assert_eq!(fx.read("/f").unwrap(), "three");
        // The umask does not narrow an explicit mode.
        assert_eq!(fx.write("/g", "", meta(0, 0, 0o777), false).unwrap().mode, 0o777);
        // A racing create wins over a non-forced commit.
        let mut a = fx.root.create_file("/race", Meta::default(), false).unwrap();
        a.write_all(b"a").unwrap();
        fx.write("/race", "b", Meta::default(), false).unwrap();
        assert_eq!(e(a.commit()), "Exists");
        assert_eq!(fx.read("/race").unwrap(), "b");
        drop(fx.root.create_file("/dropped", Meta::default(), false).unwrap());
        let names: Vec<String> = fx.root.list("/", 1).unwrap().into_iter().map(|x| x.name).collect();
        assert_eq!(names, ["f", "g", "race"], "a temporary file was left behind");

        fs::create_dir(fx.vol.join("dir")).unwrap();
        assert_eq!(e(fx.root.create_file("/dir", Meta::default(), true)), "IsDirectory");
        assert_eq!(e(fx.root.create_file("/nope/f", Meta::default(), true)), "NotFound");
        assert_eq!(e(fx.root.create_file("/f/x", Meta::default(), true)), "NotDirectory");
        assert_eq!(e(fx.root.create_file("/x", only_mode(0o10000), true)), "Invalid");

        let en = fx.root.set_meta("/f", meta(7, 8, 0o600)).unwrap();
        assert_eq!((en.mode, en.uid, en.gid), (0o600, 7, 8));
        let en = fx.root.set_meta("/dir", Meta { gid: Some(9), ..Meta::default() }).unwrap();
        assert_eq!((en.kind, en.gid, en.uid), (Kind::Directory, 9, 0));
        assert_eq!(fx.root.set_meta("/dir", only_mode(0o1777)).unwrap().mode, 0o1777);
        assert_eq!(e(fx.root.set_meta("/f", only_mode(0o17777))), "Invalid");
        assert_eq!(e(fx.root.set_meta("/none", meta(0, 0, 0o600))), "NotFound");
        assert_eq!(fx.root.stat("/").unwrap().name, "");
    }

    #[test]
    fn make_dir_list_remove() {
        let Some(fx) = Fx::new() else { return };
        let en = fx.root.make_dir("/m", Meta::default(), false).unwrap();
        assert_eq!((en.kind, en.mode, en.uid, en.gid), (Kind::Directory, 0o755, 0, 0));
        assert_eq!(e(fx.root.make_dir("/m", Meta::default(), false)), "Exists");
        assert!(fx.root.make_dir("/m", Meta::default(), true).is_ok());
        assert_eq!(e(fx.root.make_dir("/m/x/y", Meta::default(), false)), "NotFound");
        let en = fx.root.make_dir("/m/x/y", meta(42, 43, 0o777), true).unwrap();
        assert_eq!((en.path.as_str(), en.mode, en.uid, en.gid), ("/m/x/y", 0o777, 42, 43));
        let x = fx.root.stat("/m/x").unwrap();
        assert_eq!((x.mode, x.uid), (0o777, 42));
        assert_eq!(fx.root.stat("/m").unwrap().uid, 0, "an existing directory was changed");
        fx.write("/m/file", "f", Meta::default(), false).unwrap();
        assert_eq!(e(fx.root.make_dir("/m/file", Meta::default(), true)), "Exists");
        assert_eq!(e(fx.root.make_dir("/m/file/sub", Meta::default(), true)), "NotDirectory");

        symlink("x", fx.vol.join("m/s")).unwrap();
        let paths = |depth| -> Vec<String> { fx.root.list("/m", depth).unwrap().into_iter().map(|x| x.path).collect() };
        assert_eq!(paths(0), ["/m/file", "/m/s", "/m/x"]);
        assert_eq!(paths(1), ["/m/file", "/m/s", "/m/x"]);
        // The symlinked directory is listed, never entered.
        assert_eq!(paths(2), ["/m/file", "/m/s", "/m/x", "/m/x/y"]);
        let s = fx.root.list("/m", 1).unwrap().into_iter().find(|x| x.name == "s").unwrap();
        assert_eq!((s.kind, s.target.as_deref()), (Kind::Symlink, Some("x")));
        assert_eq!(e(fx.root.list("/m/file", 1)), "NotDirectory");

        assert_eq!(e(fx.root.remove("/")), "NotFound");
        assert_eq!(e(fx.root.remove("/m/none")), "NotFound");
        assert_eq!(e(fx.root.remove("/m/file/x")), "NotDirectory");
        fx.root.remove("/m/s").unwrap();
        assert!(fx.root.stat("/m/x/y").is_ok(), "removing a symlink touched its target");
        fx.root.remove("/m").unwrap();
        assert!(fx.root.list("/", 1).unwrap().is_empty());
    }
}
