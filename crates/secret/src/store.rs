//! The store: `<state>/secrets/<id>.json`, one record per secret (its value, name, metadata,
//! version and times), in a directory of mode 0700 owned by the server's user (root), each file
//! of mode 0600.
//!
//! A record is written whole to a temporary file made with mode 0600 from the start (there is
//! no moment where it is readable by anyone else), synced, renamed over the old one and the
//! directory synced: a crash leaves either the old record or the new one, never half of one.
//! Every file operation goes through the directory's descriptor, opened once without
//! following symlinks, so a path swapped underneath the store cannot redirect a write.
//!
//! Every record is also held in memory, loaded at open and written through on every change:
//! [`SecretStore::value`] (what the egress forwarder asks on each request that names a secret)
//! is a map lookup under a read lock, never a file read. The memory is this process's view:
//! another process changing the same directory is seen at the next open.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use rustix::fs::{AtFlags, Mode, OFlags};
use serde::{Deserialize, Serialize};

use crate::SecretError;

/// How many secrets one store holds; a create past it is refused (E2B answers 409 then too).
pub const MAX_SECRETS: usize = 1000;
/// Longest name, in bytes (names are ASCII).
pub const MAX_NAME_LEN: usize = 128;
/// Largest value: secrets are API keys, tokens and certificates, and every value is held in
/// memory for the egress forwarder.
pub const MAX_VALUE_LEN: usize = 64 << 10;
/// E2B's metadata limits: entries, bytes of a key, bytes of a value, bytes of keys and values
/// together.
pub const MAX_METADATA_ENTRIES: usize = 32;
pub const MAX_METADATA_KEY: usize = 128;
pub const MAX_METADATA_VALUE: usize = 1024;
pub const MAX_METADATA_TOTAL: usize = 8192;
/// Most secrets on one page of [`SecretStore::page`].
pub const MAX_PAGE: usize = 100;
/// What every secret ID starts with; no name may start with it (in any case), so that an
/// argument that may be either is never ambiguous.
pub const ID_PREFIX: &str = "sec_";

const DIR: &str = "secrets";
const SUFFIX: &str = ".json";
const TMP_SUFFIX: &str = ".tmp";
/// A record larger than this is not one the store wrote: it is skipped at load.
const MAX_RECORD: u64 = 1 << 20;

/// A secret's metadata: string keys to string values.
pub type Metadata = BTreeMap<String, String>;

/// A secret as the API shows it: everything but its value, which no read returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretInfo {
    /// `sec_` and 32 hex digits.
    pub id: String,
    /// The canonical (lowercased) name.
    pub name: String,
    /// 1 for a new secret, one more after each update.
    pub current_version: u64,
    pub metadata: Metadata,
    /// RFC 3339, UTC, with microseconds.
    pub created_at: String,
    pub updated_at: String,
}

/// One page of [`SecretStore::page`]; `next_token` is there when more secrets follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretPage {
    pub items: Vec<SecretInfo>,
    pub next_token: Option<String>,
}

/// A secret on disk and in memory.
#[derive(Clone, Serialize, Deserialize)]
struct Record {
    id: String,
    name: String,
    value: String,
    #[serde(default)]
    metadata: Metadata,
    current_version: u64,
    created_at: String,
    updated_at: String,
    /// `created_at` in microseconds since the epoch: the list order.
    #[serde(skip)]
    created_us: u64,
}

impl fmt::Debug for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Record")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("value", &"<redacted>")
            .field("metadata", &self.metadata)
            .field("current_version", &self.current_version)
            .field("created_at", &self.created_at)
            .field("updated_at", &self.updated_at)
            .finish()
    }
}

impl Record {
    fn info(&self) -> SecretInfo {
        SecretInfo {
            id: self.id.clone(),
            name: self.name.clone(),
            current_version: self.current_version,
            metadata: self.metadata.clone(),
            created_at: self.created_at.clone(),
            updated_at: self.updated_at.clone(),
        }
    }

    fn sort_key(&self) -> (u64, &str) {
        (self.created_us, &self.id)
    }
}

#[derive(Default)]
struct Index {
    by_id: HashMap<String, Record>,
    /// Canonical name to id.
    by_name: HashMap<String, String>,
    /// The latest creation time handed out, so that creation times are strictly increasing
    /// and the list order is the creation order even within one clock tick.
    last_created_us: u64,
}

impl Index {
    /// The secret `key` names: an ID (`sec_…`) or a name, in any case.
    fn resolve(&self, key: &str) -> Option<&Record> {
        let key = key.to_ascii_lowercase();
        if key.starts_with(ID_PREFIX) {
            self.by_id.get(&key)
        } else {
            self.by_name.get(&key).and_then(|id| self.by_id.get(id))
        }
    }

    fn insert(&mut self, rec: Record) {
        self.last_created_us = self.last_created_us.max(rec.created_us);
        self.by_name.insert(rec.name.clone(), rec.id.clone());
        self.by_id.insert(rec.id.clone(), rec);
    }

    fn sorted(&self) -> Vec<&Record> {
        let mut all: Vec<&Record> = self.by_id.values().collect();
        all.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
        all
    }
}

/// The secrets of one state directory. Share it behind an `Arc`: every method takes `&self`.
pub struct SecretStore {
    path: PathBuf,
    /// The store's directory, opened once; every file is reached through it.
    dir: OwnedFd,
    index: RwLock<Index>,
    /// Held across a change (check, write, sync, rename, update of the index), so that two
    /// creates of one name cannot both pass the check; readers wait only for the index update.
    writer: Mutex<()>,
}

impl fmt::Debug for SecretStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretStore").field("path", &self.path).field("secrets", &self.read().by_id.len()).finish_non_exhaustive()
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> SecretError + 'a {
    move |source| SecretError::Io { op, path: path.to_path_buf(), source }
}

fn errno<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(rustix::io::Errno) -> SecretError + 'a {
    move |e| SecretError::Io { op, path: path.to_path_buf(), source: e.into() }
}

/// The canonical form of a name (lowercased), or why it cannot be one: 1 to 128 of
/// `[a-zA-Z0-9_-]`, not starting with `sec_` in any case.
pub fn canonical_name(name: &str) -> Result<String, SecretError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(SecretError::InvalidName(name.to_string()));
    }
    let canonical = name.to_ascii_lowercase();
    if canonical.starts_with(ID_PREFIX) {
        return Err(SecretError::ReservedName(name.to_string()));
    }
    Ok(canonical)
}

/// `sec_` and 32 lowercase hex digits.
pub fn valid_id(id: &str) -> bool {
    id.strip_prefix(ID_PREFIX).is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

/// Refuses metadata beyond E2B's limits.
pub fn check_metadata(metadata: &Metadata) -> Result<(), SecretError> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(SecretError::MetadataEntries { count: metadata.len(), max: MAX_METADATA_ENTRIES });
    }
    let mut total = 0;
    for (k, v) in metadata {
        if k.len() > MAX_METADATA_KEY {
            return Err(SecretError::MetadataKey { len: k.len(), max: MAX_METADATA_KEY });
        }
        if v.len() > MAX_METADATA_VALUE {
            return Err(SecretError::MetadataValue { key: k.clone(), len: v.len(), max: MAX_METADATA_VALUE });
        }
        total += k.len() + v.len();
    }
    if total > MAX_METADATA_TOTAL {
        return Err(SecretError::MetadataTotal { total, max: MAX_METADATA_TOTAL });
    }
    Ok(())
}

fn check_value(value: &str) -> Result<(), SecretError> {
    if value.len() > MAX_VALUE_LEN {
        return Err(SecretError::ValueTooLarge { len: value.len(), max: MAX_VALUE_LEN });
    }
    Ok(())
}

fn new_id() -> Result<String, SecretError> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(SecretError::Random)?;
    Ok(format!("{ID_PREFIX}{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>()))
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The inverse of [`civil_from_days`].
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = y - i64::from(m <= 2);
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from(if m > 2 { m - 3 } else { m + 9 });
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ`: RFC 3339 in UTC with a fixed six-digit fraction, which every
/// SDK's parser reads and which sorts as text in time order.
pub(crate) fn format_rfc3339(us: u64) -> String {
    let secs = us / 1_000_000;
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let s = secs % 86_400;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z", s / 3600, s / 60 % 60, s % 60, us % 1_000_000)
}

/// The inverse of [`format_rfc3339`]; `None` for any other form.
pub(crate) fn parse_rfc3339(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 27 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' || b[16] != b':' || b[19] != b'.' || b[26] != b'Z' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<u64> { s.get(r.clone()).filter(|t| t.bytes().all(|c| c.is_ascii_digit()))?.parse().ok() };
    let (y, mo, d, h, mi, se, frac) = (num(0..4)?, num(5..7)?, num(8..10)?, num(11..13)?, num(14..16)?, num(17..19)?, num(20..26)?);
    if y < 1970 || !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 59 {
        return None;
    }
    let days = u64::try_from(days_from_civil(y as i64, mo as u32, d as u32)).ok()?;
    Some((((days * 24 + h) * 60 + mi) * 60 + se) * 1_000_000 + frac)
}

/// An opaque page token: where the previous page ended, `<created µs>.<id>`.
fn page_token(rec: &Record) -> String {
    format!("{}.{}", rec.created_us, rec.id)
}

fn parse_token(t: &str) -> Result<(u64, String), SecretError> {
    let (us, id) = t.split_once('.').ok_or(SecretError::InvalidToken)?;
    let us = us.parse::<u64>().map_err(|_| SecretError::InvalidToken)?;
    if !valid_id(id) {
        return Err(SecretError::InvalidToken);
    }
    Ok((us, id.to_string()))
}

impl SecretStore {
    /// The store under `state_dir` (`<state_dir>/secrets/`, made with mode 0700 if missing),
    /// with every record loaded. An existing directory with a wider mode is narrowed to 0700;
    /// one owned by another user is refused. A record that cannot be read is skipped with a
    /// warning: one damaged file does not take the others down.
    pub fn open(state_dir: &Path) -> Result<SecretStore, SecretError> {
        let path = state_dir.join(DIR);
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(&path)
            .map_err(|e| match e.kind() {
                io::ErrorKind::AlreadyExists => SecretError::NotADirectory { path: path.clone() },
                _ => SecretError::Io { op: "create the secret store", path: path.clone(), source: e },
            })?;
        let dir = rustix::fs::open(&path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty()).map_err(|e| match e {
            rustix::io::Errno::NOTDIR | rustix::io::Errno::LOOP => SecretError::NotADirectory { path: path.clone() },
            e => SecretError::Io { op: "open the secret store", path: path.clone(), source: e.into() },
        })?;
        let st = rustix::fs::fstat(&dir).map_err(errno("stat the secret store", &path))?;
        let euid = rustix::process::geteuid().as_raw();
        if st.st_uid != euid {
            return Err(SecretError::ForeignOwner { path, uid: st.st_uid, euid });
        }
        if st.st_mode & 0o7777 != 0o700 {
            tracing::warn!(path = %path.display(), mode = format!("{:o}", st.st_mode & 0o7777), "narrowing the secret store's mode to 0700");
            rustix::fs::fchmod(&dir, Mode::from_raw_mode(0o700)).map_err(errno("set the mode of the secret store", &path))?;
        }
        let store = SecretStore { path, dir, index: RwLock::new(Index::default()), writer: Mutex::new(()) };
        let index = store.load(euid)?;
        *store.write() = index;
        Ok(store)
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.path
    }

    /// How many secrets the store holds.
    pub fn len(&self) -> usize {
        self.read().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    // The locks guard plain maps that no panic leaves half-changed (every change is one
    // insert or remove after the disk write), so a poisoned lock is still consistent.
    fn read(&self) -> RwLockReadGuard<'_, Index> {
        self.index.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Index> {
        self.index.write().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_writer(&self) -> MutexGuard<'_, ()> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn load(&self, euid: u32) -> Result<Index, SecretError> {
        let mut index = Index::default();
        let mut records = Vec::new();
        let dir = rustix::fs::Dir::read_from(&self.dir).map_err(errno("list the secret store", &self.path))?;
        for entry in dir {
            let entry = entry.map_err(errno("list the secret store", &self.path))?;
            let Ok(name) = entry.file_name().to_str() else { continue };
            if name.starts_with('.') && name.ends_with(TMP_SUFFIX) {
                // A write that a crash interrupted before its rename: the record it would
                // have replaced (if any) is still whole.
                let _ = rustix::fs::unlinkat(&self.dir, name, AtFlags::empty());
                continue;
            }
            let Some(id) = name.strip_suffix(SUFFIX).filter(|id| valid_id(id)) else { continue };
            match self.read_record(name, id, euid) {
                Ok(rec) => records.push(rec),
                Err(why) => tracing::warn!(file = %self.path.join(name).display(), "skipping a secret record: {why}"),
            }
        }
        records.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
        for rec in records {
            if let Some(first) = index.by_name.get(&rec.name) {
                tracing::warn!(secret = %rec.id, name = %rec.name, kept = %first, "skipping a secret whose name an older secret has");
                continue;
            }
            index.insert(rec);
        }
        Ok(index)
    }

    /// One record, checked as a create would check it. The reason it is refused never
    /// quotes the file's content, which holds a value.
    fn read_record(&self, file: &str, id: &str, euid: u32) -> Result<Record, String> {
        let fd = rustix::fs::openat(&self.dir, file, OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK, Mode::empty()).map_err(|e| format!("cannot open it: {e}"))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| format!("cannot stat it: {e}"))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err("it is not a regular file".into());
        }
        if st.st_uid != euid {
            return Err(format!("it is owned by uid {}, not {euid}", st.st_uid));
        }
        if st.st_mode & 0o7777 != 0o600 {
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600)).map_err(|e| format!("cannot narrow its mode to 0600: {e}"))?;
        }
        let mut bytes = Vec::new();
        File::from(fd).take(MAX_RECORD + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read it: {e}"))?;
        if bytes.len() as u64 > MAX_RECORD {
            return Err(format!("it is larger than {MAX_RECORD} bytes"));
        }
        // serde_json's message may quote a piece of the input: only its kind and place are said.
        let mut rec: Record = serde_json::from_slice(&bytes).map_err(|e| format!("it is not a valid record ({:?} error at line {} column {})", e.classify(), e.line(), e.column()))?;
        if rec.id != id {
            return Err("its id is not its file's name".into());
        }
        if canonical_name(&rec.name).ok().as_deref() != Some(rec.name.as_str()) {
            return Err(format!("its name '{}' is not a valid canonical name", rec.name));
        }
        check_metadata(&rec.metadata).map_err(|e| e.to_string())?;
        check_value(&rec.value).map_err(|e| e.to_string())?;
        if rec.current_version == 0 {
            return Err("its version is 0".into());
        }
        rec.created_us = parse_rfc3339(&rec.created_at).ok_or("its created_at is not a time this store writes")?;
        parse_rfc3339(&rec.updated_at).ok_or("its updated_at is not a time this store writes")?;
        Ok(rec)
    }

    /// Writes `rec` to `<id>.json`: a new 0600 file, synced, renamed into place, the
    /// directory synced.
    fn write_record(&self, rec: &Record) -> Result<(), SecretError> {
        let file = format!("{}{SUFFIX}", rec.id);
        let tmp = format!(".{file}{TMP_SUFFIX}");
        let path = self.path.join(&file);
        let bytes = serde_json::to_vec_pretty(rec).map_err(|e| SecretError::Io { op: "encode the secret record", path: path.clone(), source: e.into() })?;
        let _ = rustix::fs::unlinkat(&self.dir, tmp.as_str(), AtFlags::empty());
        let written = (|| {
            // The mode is given to the create itself, so the file is never readable by others;
            // the fchmod only undoes a umask that took the owner's bits.
            let fd = rustix::fs::openat(&self.dir, tmp.as_str(), OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::from_raw_mode(0o600))
                .map_err(errno("create the secret record", &path))?;
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600)).map_err(errno("set the mode of the secret record", &path))?;
            let mut f = File::from(fd);
            f.write_all(&bytes).map_err(io_err("write the secret record", &path))?;
            f.sync_all().map_err(io_err("sync the secret record", &path))?;
            rustix::fs::renameat(&self.dir, tmp.as_str(), &self.dir, file.as_str()).map_err(errno("rename the secret record into place", &path))
        })();
        if let Err(e) = written {
            let _ = rustix::fs::unlinkat(&self.dir, tmp.as_str(), AtFlags::empty());
            return Err(e);
        }
        self.sync_dir()
    }

    fn sync_dir(&self) -> Result<(), SecretError> {
        rustix::fs::fsync(self.dir.as_fd()).map_err(errno("sync the secret store", &self.path))
    }

    /// A new secret, version 1. Refused when the name is invalid or taken (in any case), the
    /// value or the metadata too large, or the store full.
    pub fn create(&self, name: &str, value: &str, metadata: Metadata) -> Result<SecretInfo, SecretError> {
        let name = canonical_name(name)?;
        check_value(value)?;
        check_metadata(&metadata)?;
        let _w = self.lock_writer();
        let last = {
            let index = self.read();
            if index.by_name.contains_key(&name) {
                return Err(SecretError::NameTaken(name));
            }
            if index.by_id.len() >= MAX_SECRETS {
                return Err(SecretError::LimitReached { max: MAX_SECRETS });
            }
            index.last_created_us
        };
        let mut id = new_id()?;
        while self.read().by_id.contains_key(&id) {
            id = new_id()?;
        }
        let created_us = now_us().max(last + 1);
        let at = format_rfc3339(created_us);
        let rec = Record { id, name, value: value.to_string(), metadata, current_version: 1, created_at: at.clone(), updated_at: at, created_us };
        self.write_record(&rec)?;
        let info = rec.info();
        self.write().insert(rec);
        Ok(info)
    }

    /// A new value for the secret `key` (an ID or a name, in any case): its version goes up by
    /// one. `metadata` replaces the old metadata; `None` keeps it.
    pub fn update(&self, key: &str, value: &str, metadata: Option<Metadata>) -> Result<SecretInfo, SecretError> {
        check_value(value)?;
        if let Some(m) = &metadata {
            check_metadata(m)?;
        }
        let _w = self.lock_writer();
        let mut rec = self.read().resolve(key).cloned().ok_or_else(|| SecretError::NotFound(key.to_string()))?;
        rec.value = value.to_string();
        if let Some(m) = metadata {
            rec.metadata = m;
        }
        rec.current_version += 1;
        rec.updated_at = format_rfc3339(now_us().max(rec.created_us));
        self.write_record(&rec)?;
        let info = rec.info();
        self.write().insert(rec);
        Ok(info)
    }

    /// The secret `key` names (an ID or a name, in any case), without its value.
    pub fn get(&self, key: &str) -> Result<SecretInfo, SecretError> {
        self.read().resolve(key).map(Record::info).ok_or_else(|| SecretError::NotFound(key.to_string()))
    }

    /// Every secret, oldest first.
    pub fn list(&self) -> Vec<SecretInfo> {
        self.read().sorted().into_iter().map(Record::info).collect()
    }

    /// At most `limit` (1 to [`MAX_PAGE`]) secrets, oldest first, after the place `token` (the
    /// `next_token` of the page before) marks; the first page without one.
    pub fn page(&self, limit: usize, token: Option<&str>) -> Result<SecretPage, SecretError> {
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(SecretError::InvalidLimit { limit, max: MAX_PAGE });
        }
        let after = token.map(parse_token).transpose()?;
        let index = self.read();
        let mut rest = index.sorted().into_iter().filter(|r| after.as_ref().is_none_or(|(us, id)| r.sort_key() > (*us, id.as_str()))).peekable();
        let mut items = Vec::new();
        let mut last = None;
        while items.len() < limit {
            let Some(r) = rest.next() else { break };
            items.push(r.info());
            last = Some(r);
        }
        let next_token = if rest.peek().is_some() { last.map(page_token) } else { None };
        Ok(SecretPage { items, next_token })
    }

    /// Deletes the secret `key` names (an ID or a name, in any case).
    pub fn delete(&self, key: &str) -> Result<(), SecretError> {
        let _w = self.lock_writer();
        let id = self.read().resolve(key).map(|r| r.id.clone()).ok_or_else(|| SecretError::NotFound(key.to_string()))?;
        let file = format!("{id}{SUFFIX}");
        match rustix::fs::unlinkat(&self.dir, file.as_str(), AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(SecretError::Io { op: "delete the secret record", path: self.path.join(file), source: e.into() }),
        }
        let mut index = self.write();
        if let Some(rec) = index.by_id.remove(&id) {
            index.by_name.remove(&rec.name);
        }
        drop(index);
        self.sync_dir()
    }

    /// The value of the secret named `name` (in any case), from memory: what the egress
    /// forwarder substitutes for `${e2b.secrets.<name>}` on each request.
    pub fn value(&self, name: &str) -> Option<String> {
        let index = self.read();
        let id = match index.by_name.get(name) {
            Some(id) => id,
            None if name.bytes().any(|b| b.is_ascii_uppercase()) => index.by_name.get(&name.to_ascii_lowercase())?,
            None => return None,
        };
        index.by_id.get(id).map(|r| r.value.clone())
    }
}
