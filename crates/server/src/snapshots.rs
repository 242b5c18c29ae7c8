//! Snapshots: a running sandbox's files as a template that `Sandbox.create(snapshot_id)`
//! starts. The source is frozen for as long as its writable layer takes to become a layer, then
//! goes on with its id; the snapshot is an image over its template's layers and that one
//! (`snap-<templateID>-<ms>`), which every sandbox started from it shares copy-on-write.
//!
//! The list is `<state>/snapshots.json`, replaced by one rename per change. Names are E2B's:
//! an unnamed snapshot is `<templateID>:default`; a named one `<name>:<tag>` (tag `default`
//! unless given), and naming a new snapshot with a name in use gives that template a new build.
//!
//! On a tier that saves a running sandbox to disk (the vm tier) a snapshot keeps its processes
//! and memory too: the source's state is saved in `<state>/snapshots/<templateID>-<ms>.mem`,
//! the source goes on, and each sandbox started from the snapshot is restored from that state
//! (its processes running) with its own id, hostname, seed and clock, on the source's tier and
//! with its limits.

use std::fs;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use hyper::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{ApiError, ServerError};
use crate::registry::Sandboxes;
use crate::saved::{unix_ms, SNAPSHOT_PREFIX};

/// One snapshot template.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    pub template_id: String,
    /// The name it was given (without a tag), if any.
    pub name: Option<String>,
    pub tag: String,
    pub image: String,
    pub sandbox_id: String,
    pub created_unix_ms: u64,
    /// A snapshot with memory: its saved state's directory in `<state>/snapshots`; `image` is
    /// then its source's image, not its own.
    #[serde(default)]
    pub memory: Option<String>,
    /// The tier and limits (cpus, memory MB, disk MB) a snapshot with memory must be restored
    /// with.
    #[serde(default)]
    pub restore_as: Option<(cordon_spec::Tier, u32, u64, u64)>,
}

/// What a create from a snapshot starts from.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub image: String,
    /// The saved state to restore, and the tier and limits to restore it with.
    pub memory: Option<(PathBuf, (cordon_spec::Tier, u32, u64, u64))>,
}

impl Snapshot {
    pub fn snapshot_id(&self) -> String {
        format!("{}:{}", self.name.as_deref().unwrap_or(&self.template_id), self.tag)
    }

    fn to_json(&self) -> Value {
        json!({"snapshotID": self.snapshot_id(), "names": self.name.iter().collect::<Vec<_>>()})
    }

    /// Whether `reference` (`name`, `name:tag`, `templateID`, `templateID:tag`) names it.
    fn answers_to(&self, reference: &str) -> bool {
        let (base, tag) = match reference.rsplit_once(':') {
            Some((b, t)) => (b, Some(t)),
            None => (reference, None),
        };
        (base == self.template_id || self.name.as_deref() == Some(base)) && tag.is_none_or(|t| t == self.tag)
    }
}

/// The snapshot list.
pub struct Snapshots {
    path: PathBuf,
    /// Where snapshots' saved memory lives.
    dir: PathBuf,
    list: Mutex<Vec<Snapshot>>,
}

impl Snapshots {
    pub fn open(state_dir: &std::path::Path) -> Result<Snapshots, ServerError> {
        let path = state_dir.join("snapshots.json");
        let list = match fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| ServerError::Config(format!("{} cannot be read ({e}): move it away to start without its snapshots", path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(ServerError::Io { what: format!("read {}", path.display()), source: e }),
        };
        let dir = state_dir.join("snapshots");
        fs::create_dir_all(&dir).map_err(|e| ServerError::Io { what: format!("create {}", dir.display()), source: e })?;
        let list: Vec<Snapshot> = list;
        // Saved memory no snapshot names: a snapshot cut short by a stop of the server.
        for entry in fs::read_dir(&dir).map_err(|e| ServerError::Io { what: format!("list {}", dir.display()), source: e })?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !list.iter().any(|s| s.memory.as_deref() == Some(name.as_str())) {
                tracing::info!(dir = %entry.path().display(), "deleting a saved memory no snapshot names");
                let _ = fs::remove_dir_all(entry.path());
            }
        }
        Ok(Snapshots { path, dir, list: Mutex::new(list) })
    }

    /// Deletes what snapshot `s` kept: its saved memory, or its image and the layers only it
    /// named.
    async fn drop_kept(&self, saved: &crate::saved::Saved, s: &Snapshot) {
        match &s.memory {
            Some(m) => {
                let dir = self.dir.join(m);
                let _ = tokio::task::spawn_blocking(move || fs::remove_dir_all(dir)).await;
            }
            None => saved.drop_image(&s.image).await,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Snapshot>> {
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The snapshot `reference` names, if one does.
    pub fn find(&self, reference: &str) -> Option<Snapshot> {
        self.lock().iter().find(|s| s.answers_to(reference)).cloned()
    }

    /// Records a snapshot copied from another node of a cluster (its image is in the store
    /// already), unless one of the same template and tag is here.
    pub fn add_copy(&self, snap: Snapshot) -> Result<(), ApiError> {
        let mut list = self.lock();
        if list.iter().any(|s| s.template_id == snap.template_id && s.tag == snap.tag) {
            return Ok(());
        }
        let mut next = list.clone();
        next.push(snap);
        self.save(&next)?;
        *list = next;
        Ok(())
    }

    /// What a create may name each snapshot by: its template id and its `name:tag`.
    pub fn references(&self) -> Vec<String> {
        self.lock().iter().flat_map(|s| [s.template_id.clone(), s.snapshot_id()]).collect()
    }

    /// The images every snapshot names.
    pub fn images(&self) -> Vec<String> {
        self.lock().iter().map(|s| s.image.clone()).collect()
    }

    /// What the snapshot `reference` names starts from, if one does.
    pub fn resolve(&self, reference: &str) -> Option<Resolved> {
        self.lock().iter().find(|s| s.answers_to(reference)).map(|s| Resolved {
            image: s.image.clone(),
            memory: s.memory.as_ref().zip(s.restore_as).map(|(m, r)| (self.dir.join(m), r)),
        })
    }

    fn save(&self, list: &[Snapshot]) -> Result<(), ApiError> {
        let tmp = self.path.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec_pretty(list).expect("snapshots serialize"))?;
            f.sync_all()?;
            fs::rename(&tmp, &self.path)
        };
        write().map_err(|e| ApiError::internal(format!("cannot write {}: {e}", self.path.display())))
    }
}

/// A snapshot name as E2B takes it: `[namespace/]alias[:tag]`, of letters, digits, `-`, `_`
/// and `.`. Returns the name without its tag, and the tag.
fn parse_name(name: &str) -> Result<(String, String), ApiError> {
    let bad = |why: &str| ApiError::bad_request(format!("snapshot name {name:?} is not valid: {why}"));
    let (base, tag) = match name.rsplit_once(':') {
        Some((b, t)) => (b, t),
        None => (name, "default"),
    };
    let ok = |s: &str| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !ok(tag) {
        return Err(bad("a tag is letters, digits, '-', '_' and '.'"));
    }
    let parts: Vec<&str> = base.split('/').collect();
    if parts.len() > 2 || !parts.iter().all(|p| ok(p)) {
        return Err(bad("use [namespace/]name[:tag] of letters, digits, '-', '_' and '.'"));
    }
    Ok((base.to_string(), tag.to_string()))
}

/// `POST /sandboxes/{id}/snapshots`.
pub async fn create(sandboxes: &Arc<Sandboxes>, id: &str, name: Option<&str>, memory: Option<bool>) -> Result<Value, ApiError> {
    let saved = sandboxes.saved.as_ref().ok_or_else(|| ApiError::new(StatusCode::NOT_IMPLEMENTED, "this server keeps no state: it cannot take snapshots").no_retry())?;
    let named = name.filter(|n| !n.is_empty()).map(parse_name).transpose()?;
    let paused = || ApiError::new(StatusCode::CONFLICT, format!("sandbox '{id}' cannot be snapshotted while in 'paused' state")).no_retry();
    let caps = match sandboxes.get(id) {
        Some(e) => sandboxes.capabilities(e.tier),
        None if saved.get(id).is_some() => return Err(paused()),
        None => return Err(ApiError::not_found(format!("sandbox {id} not found"))),
    };
    let with_memory = caps.checkpoint && !caps.keep_writable;
    if memory == Some(true) && !with_memory {
        return Err(ApiError::bad_request(
            "snapshots keep a sandbox's files, not its memory, on this sandbox's tier: send memory=false or leave it out",
        ));
    }
    if memory == Some(false) && with_memory {
        return Err(ApiError::bad_request("snapshots of this sandbox's tier keep its memory with its files: send memory=true or leave it out"));
    }
    let now = SystemTime::now();
    let existing = named.as_ref().and_then(|(n, _)| saved.snapshots.lock().iter().find(|s| s.name.as_deref() == Some(n.as_str())).map(|s| s.template_id.clone()));
    let template_id = existing.unwrap_or_else(|| {
        let mut t = cordon_sandbox::new_id();
        t.replace_range(0..1, "s");
        t
    });
    let (name, tag) = match named {
        Some((n, t)) => (Some(n), t),
        None => (None, "default".to_string()),
    };
    let snap = if with_memory {
        let (e, kept) = saved.checkpoint_running(sandboxes, id, paused).await?;
        let dir = format!("{template_id}-{}.mem", unix_ms(now));
        kept.persist(&saved.snapshots.dir.join(&dir)).map_err(|err| ApiError::internal(format!("cannot keep the snapshot's memory: {err}")))?;
        Snapshot {
            template_id,
            name,
            tag,
            image: e.image.clone(),
            sandbox_id: id.to_string(),
            created_unix_ms: unix_ms(now),
            memory: Some(dir),
            restore_as: Some((e.tier, e.cpu_count, e.memory_mb, e.disk_mb)),
        }
    } else {
        let (_, meta) = saved.capture_running(sandboxes, id, "snapshot", paused).await?;
        let image = format!("{SNAPSHOT_PREFIX}{template_id}-{}", unix_ms(now));
        saved.commit(&image, meta).await?;
        Snapshot { template_id, name, tag, image, sandbox_id: id.to_string(), created_unix_ms: unix_ms(now), memory: None, restore_as: None }
    };
    let replaced = {
        let mut list = saved.snapshots.lock();
        let mut next = list.clone();
        let old: Vec<Snapshot> = next.iter().filter(|s| s.template_id == snap.template_id && s.tag == snap.tag).cloned().collect();
        next.retain(|s| !(s.template_id == snap.template_id && s.tag == snap.tag));
        next.push(snap.clone());
        saved.snapshots.save(&next).map(|()| {
            *list = next;
            old
        })
    };
    let replaced = match replaced {
        Ok(r) => r,
        Err(err) => {
            saved.snapshots.drop_kept(saved, &snap).await;
            return Err(err);
        }
    };
    for old in replaced {
        saved.snapshots.drop_kept(saved, &old).await;
    }
    tracing::info!(sandbox_id = %id, snapshot = %snap.snapshot_id(), image = %snap.image, "snapshot taken");
    Ok(snap.to_json())
}

/// `GET /snapshots`: newest first, filtered by `sandboxID` and `name`, paged by `limit` and
/// `nextToken`. Returns the page and the next token.
pub fn list(sandboxes: &Sandboxes, sandbox: Option<&str>, name: Option<&str>, limit: usize, after: Option<&str>) -> (Vec<Value>, Option<String>) {
    let Some(saved) = &sandboxes.saved else { return (Vec::new(), None) };
    let mut items: Vec<Snapshot> = saved.snapshots.lock().clone();
    items.retain(|s| sandbox.is_none_or(|id| s.sandbox_id == id) && name.is_none_or(|n| s.answers_to(n) || s.name.as_deref().is_some_and(|m| m.ends_with(&format!("/{n}")))));
    items.sort_by(|a, b| (b.created_unix_ms, &b.template_id, &b.tag).cmp(&(a.created_unix_ms, &a.template_id, &a.tag)));
    if let Some(after) = after {
        match items.iter().position(|s| s.snapshot_id() == after) {
            Some(i) => {
                items.drain(..=i);
            }
            None => items.clear(),
        }
    }
    let more = items.len() > limit;
    items.truncate(limit);
    let next = more.then(|| items.last().map(Snapshot::snapshot_id)).flatten();
    (items.iter().map(Snapshot::to_json).collect(), next)
}

/// `DELETE /templates/{id}` of a snapshot: `Some(true)` once deleted, `None` when `reference`
/// names no snapshot (it may name a template).
pub async fn delete(sandboxes: &Sandboxes, reference: &str) -> Result<Option<()>, ApiError> {
    let Some(saved) = &sandboxes.saved else { return Ok(None) };
    // E2B ignores the tag here: the whole snapshot template goes.
    let base = reference.rsplit_once(':').map_or(reference, |(b, _)| b);
    let gone: Vec<Snapshot> = {
        let mut list = saved.snapshots.lock();
        let (gone, keep): (Vec<Snapshot>, Vec<Snapshot>) = list.iter().cloned().partition(|s| s.template_id == base || s.name.as_deref() == Some(base));
        if gone.is_empty() {
            return Ok(None);
        }
        saved.snapshots.save(&keep)?;
        *list = keep;
        gone
    };
    for s in gone {
        // Sandboxes started from it run on images of their own over the same layers, or on
        // their own copies of its saved memory.
        saved.snapshots.drop_kept(saved, &s).await;
        tracing::info!(snapshot = %s.snapshot_id(), "snapshot deleted");
    }
    Ok(Some(()))
}
