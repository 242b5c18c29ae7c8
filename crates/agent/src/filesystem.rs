//! The `filesystem.Filesystem` service, and the `EntryInfo` of a path.
//!
//! Every operation runs with the calling user's credentials (see [`crate::as_user`]): the kernel
//! checks each path as it would for that user's own process, and what is created is theirs.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cordon_envd::connect::{Code, ConnectError};
use cordon_envd::filesystem::{
    CreateWatcherRequest, CreateWatcherResponse, EntryInfo, FileType, GetWatcherEventsRequest,
    GetWatcherEventsResponse, ListDirRequest, ListDirResponse, MakeDirRequest, MakeDirResponse, MoveRequest,
    MoveResponse, RemoveRequest, RemoveResponse, RemoveWatcherRequest, RemoveWatcherResponse, StatRequest,
    StatResponse, WatchDirRequest,
};
use cordon_envd::Timestamp;
use hyper::body::Incoming;
use hyper::{Request, Response};

use crate::body::Body;
use crate::rpc::{self, CallCtx};
use crate::users::{resolve_path, User, UserDb};
use crate::{watch, xattr, Agent};

/// `ListDir` refuses to build responses with more entries than this.
const MAX_LIST_ENTRIES: usize = 100_000;

const METHODS: &[&str] = &[
    "Stat",
    "MakeDir",
    "Move",
    "ListDir",
    "Remove",
    "WatchDir",
    "CreateWatcher",
    "GetWatcherEvents",
    "RemoveWatcher",
];

pub(crate) fn is_method(m: &str) -> bool {
    METHODS.contains(&m)
}

pub(crate) async fn dispatch(agent: Arc<Agent>, method: &str, req: Request<Incoming>) -> Response<Body> {
    match method {
        "Stat" => rpc::unary(req, |m, ctx| async move { stat(&agent, m, &ctx) }).await,
        "MakeDir" => rpc::unary(req, |m, ctx| async move { make_dir(&agent, m, &ctx) }).await,
        "Move" => rpc::unary(req, |m, ctx| async move { move_entry(&agent, m, &ctx) }).await,
        "ListDir" => rpc::unary(req, |m, ctx| async move { list_dir(&agent, m, &ctx) }).await,
        "Remove" => rpc::unary(req, |m, ctx| async move { remove(&agent, m, &ctx) }).await,
        "WatchDir" => {
            rpc::server_stream(req, |m: WatchDirRequest, ctx, tx| async move {
                let (user, path) = resolve(&agent, &ctx, &m.path)?;
                let w = watch::Watch::open(path, &m, agent.config.root.clone(), user)?;
                tokio::spawn(watch::stream(w, tx, ctx.keepalive, ctx.timeout));
                Ok(())
            })
            .await
        }
        "CreateWatcher" => rpc::unary(req, |m, ctx| async move { create_watcher(&agent, m, &ctx) }).await,
        "GetWatcherEvents" => {
            rpc::unary(req, |m: GetWatcherEventsRequest, _| async move {
                Ok(GetWatcherEventsResponse { events: agent.watchers.take_events(&m.watcher_id)? })
            })
            .await
        }
        "RemoveWatcher" => {
            rpc::unary(req, |m: RemoveWatcherRequest, _| async move {
                agent.watchers.remove(&m.watcher_id)?;
                Ok(RemoveWatcherResponse {})
            })
            .await
        }
        _ => rpc::unary_error(&ConnectError::new(Code::Unimplemented, format!("unknown method {method}"))),
    }
}

fn resolve(agent: &Agent, ctx: &CallCtx, path: &str) -> Result<(User, PathBuf), ConnectError> {
    let user = agent.user(ctx)?;
    if path.contains('\0') {
        return Err(ConnectError::invalid_argument("path must not contain NUL bytes"));
    }
    let p = resolve_path(path, &user.home);
    Ok((user, p))
}

fn io_error(what: &str, path: &Path, e: io::Error) -> ConnectError {
    match e.kind() {
        io::ErrorKind::NotFound => ConnectError::not_found(format!("path '{}' does not exist", path.display())),
        io::ErrorKind::PermissionDenied => {
            ConnectError::new(Code::PermissionDenied, format!("{what} '{}': {e}", path.display()))
        }
        _ => ConnectError::internal(format!("{what} '{}': {e}", path.display())),
    }
}

/// Go's `os.FileMode.String()` of a raw `st_mode`, which envd reports as `permissions`.
pub(crate) fn mode_string(mode: u32) -> String {
    let fmt = mode & libc::S_IFMT;
    let mut s = String::with_capacity(12);
    // Go's type letters, in its order "dalTLDpSugct?"; a, l and T never come from stat.
    if fmt == libc::S_IFDIR {
        s.push('d');
    }
    if fmt == libc::S_IFLNK {
        s.push('L');
    }
    if fmt == libc::S_IFBLK || fmt == libc::S_IFCHR {
        s.push('D');
    }
    if fmt == libc::S_IFIFO {
        s.push('p');
    }
    if fmt == libc::S_IFSOCK {
        s.push('S');
    }
    if mode & libc::S_ISUID != 0 {
        s.push('u');
    }
    if mode & libc::S_ISGID != 0 {
        s.push('g');
    }
    if fmt == libc::S_IFCHR {
        s.push('c');
    }
    if mode & libc::S_ISVTX != 0 {
        s.push('t');
    }
    if s.is_empty() {
        s.push('-');
    }
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

fn file_type(ft: fs::FileType) -> FileType {
    if ft.is_file() {
        FileType::File
    } else if ft.is_dir() {
        FileType::Directory
    } else {
        FileType::Unspecified
    }
}

/// Describes `path` without following a final symlink (the link's target supplies `type` and
/// `mode`, as in current envd; `is_symlink` marks the link itself).
pub(crate) fn entry_info(path: &Path, db: &UserDb) -> io::Result<EntryInfo> {
    let md = fs::symlink_metadata(path)?;
    let is_symlink = md.file_type().is_symlink();
    let (ftype, mode, symlink_target) = if is_symlink {
        let resolved = fs::canonicalize(path).ok();
        let target_md = resolved.as_ref().and_then(|t| fs::metadata(t).ok());
        let target = resolved.unwrap_or_else(|| path.to_path_buf()).to_string_lossy().into_owned();
        match target_md {
            Some(t) => (file_type(t.file_type()), t.mode() & 0o777, Some(target)),
            // A dangling link still shows up as a link for clients that ignore `is_symlink`.
            None => (FileType::Symlink, 0, Some(target)),
        }
    } else {
        (file_type(md.file_type()), md.mode() & 0o777, None)
    };
    let name = path
        .file_name()
        .map_or_else(|| "/".to_string(), |n| n.to_string_lossy().into_owned());
    Ok(EntryInfo {
        name,
        file_type: ftype,
        path: path.to_string_lossy().into_owned(),
        size: md.size() as i64,
        mode,
        permissions: mode_string(md.mode()),
        owner: db.user_name(md.uid()).map_or_else(|| md.uid().to_string(), str::to_string),
        group: db.group_name(md.gid()).map_or_else(|| md.gid().to_string(), str::to_string),
        modified_time: Some(Timestamp { seconds: md.mtime(), nanos: md.mtime_nsec() as i32 }),
        symlink_target,
        metadata: if is_symlink { Default::default() } else { xattr::read(path) },
        is_symlink,
    })
}

/// Creates `dir` and any missing parents (with the caller's credentials, so they are its).
pub(crate) fn create_dirs(dir: &Path) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(p) = cur {
        match fs::symlink_metadata(p) {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                missing.push(p);
                cur = p.parent();
            }
            Err(e) => return Err(e),
        }
    }
    for d in missing.into_iter().rev() {
        match fs::create_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Runs `f` with `user`'s credentials; a refused switch is an internal error.
fn as_user<T>(user: &User, f: impl FnOnce() -> Result<T, ConnectError>) -> Result<T, ConnectError> {
    crate::as_user::as_user(user, f).unwrap_or_else(|e| Err(ConnectError::internal(e.to_string())))
}

fn stat(agent: &Agent, req: StatRequest, ctx: &CallCtx) -> Result<StatResponse, ConnectError> {
    let (user, path) = resolve(agent, ctx, &req.path)?;
    let db = agent.users();
    let entry = as_user(&user, || entry_info(&path, &db).map_err(|e| io_error("error getting file info", &path, e)))?;
    Ok(StatResponse { entry: Some(entry) })
}

fn make_dir(agent: &Agent, req: MakeDirRequest, ctx: &CallCtx) -> Result<MakeDirResponse, ConnectError> {
    let (user, path) = resolve(agent, ctx, &req.path)?;
    let db = agent.users();
    let entry = as_user(&user, || {
        match fs::metadata(&path) {
            Ok(m) if m.is_dir() => {
                return Err(ConnectError::new(
                    Code::AlreadyExists,
                    format!("directory '{}' already exists", path.display()),
                ))
            }
            Ok(_) => {
                return Err(ConnectError::invalid_argument(format!(
                    "path '{}' already exists but is not a directory",
                    path.display()
                )))
            }
            Err(_) => {}
        }
        create_dirs(&path).map_err(|e| match e.kind() {
            // A file in the way of a parent.
            io::ErrorKind::NotADirectory | io::ErrorKind::AlreadyExists => {
                ConnectError::invalid_argument(format!("cannot create directory '{}': {e}", path.display()))
            }
            _ => io_error("error creating directory", &path, e),
        })?;
        entry_info(&path, &db).map_err(|e| io_error("error getting file info", &path, e))
    })?;
    Ok(MakeDirResponse { entry: Some(entry) })
}

fn move_entry(agent: &Agent, req: MoveRequest, ctx: &CallCtx) -> Result<MoveResponse, ConnectError> {
    let (user, source) = resolve(agent, ctx, &req.source)?;
    let (_, dest) = resolve(agent, ctx, &req.destination)?;
    let db = agent.users();
    let entry = as_user(&user, || {
        fs::symlink_metadata(&source).map_err(|e| io_error("error getting file info", &source, e))?;
        if let Some(parent) = dest.parent() {
            create_dirs(parent).map_err(|e| io_error("error creating parent directory", parent, e))?;
        }
        fs::rename(&source, &dest).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => ConnectError::not_found(format!("path '{}' does not exist", source.display())),
            io::ErrorKind::PermissionDenied => ConnectError::new(
                Code::PermissionDenied,
                format!("error moving '{}' to '{}': {e}", source.display(), dest.display()),
            ),
            _ => ConnectError::internal(format!(
                "error moving '{}' to '{}': {e}",
                source.display(),
                dest.display()
            )),
        })?;
        entry_info(&dest, &db).map_err(|e| io_error("error getting file info", &dest, e))
    })?;
    Ok(MoveResponse { entry: Some(entry) })
}

fn walk(dir: &Path, levels: u32, db: &UserDb, out: &mut Vec<EntryInfo>) -> Result<(), ConnectError> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        // Deeper levels are best effort: an unreadable subdirectory is just not descended into.
        Err(_) => return Ok(()),
    };
    let mut names: Vec<_> = rd.filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
    names.sort();
    for name in names {
        let p = dir.join(&name);
        let Ok(e) = entry_info(&p, db) else { continue };
        let descend = e.file_type == FileType::Directory && !e.is_symlink && levels > 1;
        out.push(e);
        if out.len() > MAX_LIST_ENTRIES {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("more than {MAX_LIST_ENTRIES} entries; list with a smaller depth"),
            ));
        }
        if descend {
            walk(&p, levels - 1, db, out)?;
        }
    }
    Ok(())
}

fn list_dir(agent: &Agent, req: ListDirRequest, ctx: &CallCtx) -> Result<ListDirResponse, ConnectError> {
    let (user, path) = resolve(agent, ctx, &req.path)?;
    let db = agent.users();
    let entries = as_user(&user, || {
        let md = fs::metadata(&path).map_err(|e| io_error("error getting file info", &path, e))?;
        if !md.is_dir() {
            return Err(ConnectError::invalid_argument(format!("path '{}' is not a directory", path.display())));
        }
        // The listing itself must be readable; only deeper levels are best effort.
        fs::read_dir(&path).map_err(|e| io_error("error reading directory", &path, e))?;
        let mut entries = Vec::new();
        walk(&path, req.depth.max(1), &db, &mut entries)?;
        Ok(entries)
    })?;
    Ok(ListDirResponse { entries })
}

fn remove(agent: &Agent, req: RemoveRequest, ctx: &CallCtx) -> Result<RemoveResponse, ConnectError> {
    let (user, path) = resolve(agent, ctx, &req.path)?;
    as_user(&user, || {
        let md = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(RemoveResponse {}),
            Err(e) => return Err(io_error("error getting file info", &path, e)),
        };
        let r = if md.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
        match r {
            Ok(()) => Ok(RemoveResponse {}),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(RemoveResponse {}),
            Err(e) => Err(io_error("error removing", &path, e)),
        }
    })
}

fn create_watcher(agent: &Agent, req: CreateWatcherRequest, ctx: &CallCtx) -> Result<CreateWatcherResponse, ConnectError> {
    let (user, path) = resolve(agent, ctx, &req.path)?;
    let w = watch::Watch::open(path, &req, agent.config.root.clone(), user)?;
    let watcher_id = agent.watchers.add(w);
    Ok(CreateWatcherResponse { watcher_id })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_strings_match_go() {
        assert_eq!(mode_string(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(mode_string(libc::S_IFDIR | 0o755), "drwxr-xr-x");
        assert_eq!(mode_string(libc::S_IFLNK | 0o777), "Lrwxrwxrwx");
        assert_eq!(mode_string(libc::S_IFDIR | libc::S_ISVTX | 0o777), "dtrwxrwxrwx");
        assert_eq!(mode_string(libc::S_IFREG | libc::S_ISUID | 0o755), "urwxr-xr-x");
        assert_eq!(mode_string(libc::S_IFCHR | 0o666), "Dcrw-rw-rw-");
        assert_eq!(mode_string(libc::S_IFIFO | 0o600), "prw-------");
    }
}
