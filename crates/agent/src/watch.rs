//! Directory watches on inotify: the `WatchDir` stream and the polled watchers of
//! `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`.

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cordon_envd::connect::{Code, ConnectError};
use cordon_envd::filesystem::{EventType, FilesystemEvent, WatchDirRequest, WatchDirResponse, WatchStartEvent};
use cordon_envd::process::KeepAlive;
use tokio::time::Instant;

use crate::fdio::Fd;
use crate::filesystem::entry_info;
use crate::rpc::{Heartbeat, StreamTx};
use crate::users::{User, UserDb};

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_MOVE_SELF;
/// A recursive watch stops adding subdirectories beyond this many.
const MAX_WATCHES: usize = 8192;
/// Events a polled watcher keeps between polls; older ones are dropped first.
const MAX_BUFFERED: usize = 10_000;
/// Enough for many events; each is 16 bytes plus a name of at most 256.
const READ_BUF: usize = 64 << 10;

/// Filesystems a watch is refused on unless `allow_network_mounts` is set (inotify does not
/// see changes made by other machines there).
const NETWORK_FS: &[i64] = &[0x6969, 0xFF53_4D42, 0x517B, 0xFE53_4D42, 0x6573_5546];

fn is_network_mount(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else { return false };
    // SAFETY: statfs writes into the zeroed struct we pass; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return false;
    }
    NETWORK_FS.contains(&(st.f_type as i64))
}

/// One inotify instance watching a directory (and, if recursive, its subdirectories).
pub(crate) struct Watch {
    fd: Fd,
    /// Watch descriptor to the directory's path relative to the root ("" for the root).
    dirs: HashMap<i32, String>,
    root: PathBuf,
    root_wd: i32,
    recursive: bool,
    include_entry: bool,
    users_root: PathBuf,
    /// Whose credentials new subdirectories are watched and entries described with.
    user: User,
    buf: Vec<u8>,
    /// The root watch is gone; the events read with that news have been handed out.
    ended: bool,
}

impl Watch {
    /// Starts watching `path` for `user`: the directory, and every subdirectory a recursive
    /// watch adds now or later, is opened with that user's credentials (see
    /// [`crate::as_user`]), so a watch sees no directory the user could not list. `users_root`
    /// is where owner names are looked up for entries.
    pub fn open(path: PathBuf, req: &WatchDirRequest, users_root: PathBuf, user: User) -> Result<Watch, ConnectError> {
        let as_user = user.clone();
        crate::as_user::as_user(&as_user, move || Watch::open_as_user(path, req, users_root, user))
            .unwrap_or_else(|e| Err(ConnectError::internal(e.to_string())))
    }

    fn open_as_user(path: PathBuf, req: &WatchDirRequest, users_root: PathBuf, user: User) -> Result<Watch, ConnectError> {
        let md = fs::metadata(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => ConnectError::not_found(format!("path '{}' does not exist", path.display())),
            io::ErrorKind::PermissionDenied => {
                ConnectError::new(Code::PermissionDenied, format!("cannot watch '{}': {e}", path.display()))
            }
            _ => ConnectError::internal(format!("error getting file info of '{}': {e}", path.display())),
        })?;
        if !md.is_dir() {
            return Err(ConnectError::invalid_argument(format!("path '{}' is not a directory", path.display())));
        }
        if !req.allow_network_mounts && is_network_mount(&path) {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("path '{}' is on a network mount; set allow_network_mounts to watch it", path.display()),
            ));
        }
        // SAFETY: inotify_init1 takes flags only and returns a new descriptor or -1.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return Err(ConnectError::internal(format!("inotify: {}", io::Error::last_os_error())));
        }
        // SAFETY: raw is a descriptor we just created and own exclusively.
        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
        let fd = Fd::new(owned).map_err(|e| ConnectError::internal(format!("inotify: {e}")))?;
        let mut w = Watch {
            fd,
            dirs: HashMap::new(),
            root: path.clone(),
            root_wd: -1,
            recursive: req.recursive,
            include_entry: req.include_entry,
            users_root,
            user,
            buf: vec![0u8; READ_BUF],
            ended: false,
        };
        w.root_wd = w.add(&path, String::new(), false).map_err(|e| {
            let what = format!("cannot watch '{}': {e}", path.display());
            match e.kind() {
                io::ErrorKind::PermissionDenied => ConnectError::new(Code::PermissionDenied, what),
                _ => ConnectError::internal(what),
            }
        })?;
        if w.recursive {
            w.add_tree(&path, "");
        }
        Ok(w)
    }

    fn add(&mut self, abs: &Path, rel: String, nofollow: bool) -> io::Result<i32> {
        let c = CString::new(abs.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let mut mask = MASK | libc::IN_ONLYDIR;
        if nofollow {
            mask |= libc::IN_DONT_FOLLOW;
        }
        // SAFETY: a valid inotify descriptor and a NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.fd.raw(), c.as_ptr(), mask) };
        if wd < 0 {
            return Err(io::Error::last_os_error());
        }
        self.dirs.insert(wd, rel);
        Ok(wd)
    }

    /// Watches the subdirectories below `abs` (best effort: vanished or unreadable ones are skipped).
    fn add_tree(&mut self, abs: &Path, rel: &str) {
        let Ok(rd) = fs::read_dir(abs) else { return };
        for e in rd.flatten() {
            if self.dirs.len() >= MAX_WATCHES {
                return;
            }
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = e.file_name().to_string_lossy().into_owned();
            let child_rel = join_rel(rel, &name);
            let child_abs = abs.join(e.file_name());
            if self.add(&child_abs, child_rel.clone(), true).is_ok() {
                self.add_tree(&child_abs, &child_rel);
            }
        }
    }

    /// Waits for the next batch of events; `None` once the watched directory is gone.
    pub async fn next_events(&mut self) -> io::Result<Option<Vec<FilesystemEvent>>> {
        loop {
            if self.ended {
                return Ok(None);
            }
            let mut buf = std::mem::take(&mut self.buf);
            let r = self.fd.read(&mut buf).await;
            let out = match r {
                // New subdirectories are watched, and entries described, as the user.
                Ok(n) => {
                    let user = self.user.clone();
                    crate::as_user::as_user(&user, || self.parse(&buf[..n]))
                }
                Err(e) => Err(e),
            };
            self.buf = buf;
            let (events, ended) = out?;
            self.ended = ended;
            if !events.is_empty() {
                return Ok(Some(events));
            }
        }
    }

    /// Turns raw inotify records into events; the flag says the root watch went away.
    fn parse(&mut self, mut data: &[u8]) -> (Vec<FilesystemEvent>, bool) {
        let mut out = Vec::new();
        let mut ended = false;
        let mut db: Option<UserDb> = None;
        while data.len() >= 16 {
            let wd = i32::from_ne_bytes([data[0], data[1], data[2], data[3]]);
            let mask = u32::from_ne_bytes([data[4], data[5], data[6], data[7]]);
            let len = u32::from_ne_bytes([data[12], data[13], data[14], data[15]]) as usize;
            let Some(name_bytes) = data.get(16..16 + len) else { break };
            let name_end = name_bytes.iter().position(|b| *b == 0).unwrap_or(name_bytes.len());
            let name = String::from_utf8_lossy(&name_bytes[..name_end]).into_owned();
            data = &data[16 + len..];

            if mask & libc::IN_IGNORED != 0 {
                self.dirs.remove(&wd);
                if wd == self.root_wd {
                    ended = true;
                }
                continue;
            }
            if mask & libc::IN_MOVE_SELF != 0 {
                // A moved subdirectory would keep reporting under its old name; its new
                // location (if still below the root) gets a fresh watch from IN_MOVED_TO.
                if wd != self.root_wd {
                    // SAFETY: removing a watch descriptor of our own inotify instance.
                    unsafe { libc::inotify_rm_watch(self.fd.raw(), wd) };
                }
                continue;
            }
            if mask & libc::IN_Q_OVERFLOW != 0 || name.is_empty() {
                continue;
            }
            let Some(dir_rel) = self.dirs.get(&wd).cloned() else { continue };
            let rel = join_rel(&dir_rel, &name);
            let event_type = if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                EventType::Create
            } else if mask & libc::IN_MODIFY != 0 {
                EventType::Write
            } else if mask & libc::IN_DELETE != 0 {
                EventType::Remove
            } else if mask & libc::IN_MOVED_FROM != 0 {
                EventType::Rename
            } else if mask & libc::IN_ATTRIB != 0 {
                EventType::Chmod
            } else {
                continue;
            };
            let abs = self.root.join(&rel);
            if event_type == EventType::Create
                && mask & libc::IN_ISDIR != 0
                && self.recursive
                && self.dirs.len() < MAX_WATCHES
                && self.add(&abs, rel.clone(), true).is_ok()
            {
                self.add_tree(&abs, &rel);
            }
            let entry = if self.include_entry && matches!(event_type, EventType::Create | EventType::Write | EventType::Chmod)
            {
                let db = db.get_or_insert_with(|| UserDb::load(&self.users_root));
                entry_info(&abs, db).ok()
            } else {
                None
            };
            out.push(FilesystemEvent { name: rel, event_type, entry });
        }
        (out, ended)
    }
}

fn join_rel(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// Writes a `WatchDir` stream: `start`, then events and keepalives, until the deadline, the
/// directory's removal, or the client leaving.
pub(crate) async fn stream(mut w: Watch, tx: StreamTx, keepalive: Duration, timeout: Option<Duration>) {
    if tx.send(&WatchDirResponse::Start(WatchStartEvent {})).await.is_err() {
        return;
    }
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut beat = Heartbeat::new(keepalive, deadline);
    loop {
        tokio::select! {
            r = w.next_events() => match r {
                Ok(Some(events)) => {
                    for e in events {
                        if tx.send(&WatchDirResponse::Filesystem(e)).await.is_err() {
                            return;
                        }
                    }
                    beat.sent();
                }
                Ok(None) => {
                    tx.finish(None).await;
                    return;
                }
                Err(e) => {
                    tx.finish(Some(ConnectError::internal(format!("watch failed: {e}")))).await;
                    return;
                }
            },
            idle = beat.idle(&tx) => {
                if beat.answer(idle, &tx, &WatchDirResponse::Keepalive(KeepAlive {})).await.is_break() {
                    return;
                }
            }
        }
    }
}

#[derive(Default)]
struct Buffer {
    events: VecDeque<FilesystemEvent>,
    error: Option<String>,
}

struct Watcher {
    buffer: Arc<Mutex<Buffer>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The polled watchers of one agent.
#[derive(Default)]
pub(crate) struct Watchers {
    map: Mutex<HashMap<String, Watcher>>,
}

fn random_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut raw = [0u8; 20];
    // SAFETY: getrandom writes at most raw.len() bytes into raw.
    let n = unsafe { libc::getrandom(raw.as_mut_ptr().cast(), raw.len(), 0) };
    if n != raw.len() as isize {
        // Uniqueness is all that matters here; fall back to the clock.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        for (i, b) in raw.iter_mut().enumerate() {
            *b = (t >> ((i % 16) * 8)) as u8 ^ (i as u8).wrapping_mul(31);
        }
    }
    let mut id = String::from("w");
    id.extend(raw.iter().map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char));
    id
}

impl Watchers {
    /// Starts collecting events of `w`; returns the watcher id.
    pub fn add(&self, mut w: Watch) -> String {
        let buffer = Arc::new(Mutex::new(Buffer::default()));
        let sink = buffer.clone();
        let task = tokio::spawn(async move {
            loop {
                match w.next_events().await {
                    Ok(Some(events)) => {
                        let mut b = lock(&sink);
                        for e in events {
                            if b.events.len() >= MAX_BUFFERED {
                                b.events.pop_front();
                            }
                            b.events.push_back(e);
                        }
                    }
                    Ok(None) => return,
                    Err(e) => {
                        lock(&sink).error = Some(e.to_string());
                        return;
                    }
                }
            }
        });
        let id = random_id();
        lock(&self.map).insert(id.clone(), Watcher { buffer, task });
        id
    }

    /// The events since the last call.
    pub fn take_events(&self, id: &str) -> Result<Vec<FilesystemEvent>, ConnectError> {
        let map = lock(&self.map);
        let w = map.get(id).ok_or_else(|| ConnectError::not_found(format!("watcher with id {id} not found")))?;
        let mut b = lock(&w.buffer);
        let events: Vec<FilesystemEvent> = b.events.drain(..).collect();
        if events.is_empty() {
            if let Some(e) = b.error.take() {
                return Err(ConnectError::internal(format!("watcher {id} failed: {e}")));
            }
        }
        Ok(events)
    }

    /// Stops and forgets a watcher.
    pub fn remove(&self, id: &str) -> Result<(), ConnectError> {
        lock(&self.map)
            .remove(id)
            .map(drop)
            .ok_or_else(|| ConnectError::not_found(format!("watcher with id {id} not found")))
    }
}
