//! What the server keeps of sandboxes on disk: sandboxes paused to their files, and the images
//! of their files that snapshots and forks start from.
//!
//! A sandbox's files become an image of the store: its template's layers and one layer made
//! from its writable layer (taken while it is frozen, so it is consistent), shared
//! copy-on-write by every sandbox started from it. A paused sandbox is its record,
//! `<state>/paused/<id>.json`, and its image `paused-<id>-<ms>`; the record appears by one
//! rename once the image is complete, so a server killed during a pause leaves either a paused
//! sandbox or nothing: an image of this kind that no record names is deleted at the next
//! start, with the layers only it named. Images made for one sandbox alone (a fork's, a resumed
//! one's, one started from a snapshot) are deleted when that sandbox ends.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::StatusCode;
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ServerError};
use crate::pause::Lifecycle;
use crate::registry::{LiveSandbox, NewSandbox};

/// How long a paused sandbox is kept unless told otherwise (E2B: 30 days).
pub const DEFAULT_PAUSED_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Prefixes of the images made here; each name is `<prefix><sandbox or snapshot id>-<ms>`.
pub const PAUSED_PREFIX: &str = "paused-";
/// A fork's, a resumed sandbox's or a snapshot's sandbox's own image.
pub const OWN_PREFIX: &str = "own-";
/// A snapshot's image (see [`crate::snapshots`]).
pub const SNAPSHOT_PREFIX: &str = "snap-";

/// A sandbox paused to its files: everything a resume needs to start it again as itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub tier: cordon_spec::Tier,
    pub template: String,
    /// The image of its files.
    pub image: String,
    pub token: String,
    pub traffic_token: String,
    pub public_traffic: bool,
    pub mask_host: Option<String>,
    pub network: cordon_spec::NetworkPolicy,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub lifecycle: Lifecycle,
    pub envd_version: String,
    pub started_unix_ms: u64,
    pub paused_unix_ms: u64,
    /// Paused with its memory: the directory (in `<state>/paused`) its running state was saved
    /// to, restored by a resume. `image` is then its template's, not its own.
    #[serde(default)]
    pub memory: Option<String>,
    /// Paused to its files on a tier that keeps its whole disk (`Sandbox::keep_disk`): the
    /// directory (in `<state>/paused`) the disk was kept in, which a resume boots afresh on.
    /// `image` is then its template's, as with `memory`.
    #[serde(default)]
    pub disk: Option<String>,
    /// Its volumes, mounted again where they were at a resume.
    #[serde(default, rename = "volumeMounts")]
    pub volume_mounts: Vec<crate::volumes::MountRequest>,
    /// `image` is the sandbox's own (it ran on one: resumed from its files, a snapshot's, a
    /// fork's), to be deleted with it, not its template's.
    #[serde(default)]
    pub owns_image: bool,
    /// Saved by a stopping server rather than paused by its user: the next server resumes it
    /// at its start, to run until this deadline (unix ms) as it would have.
    #[serde(default)]
    pub resume_at_start: Option<u64>,
}

impl Record {
    /// The create that starts it again, for `timeout`.
    pub fn new_sandbox(&self, timeout: Duration) -> NewSandbox {
        NewSandbox {
            tier: self.tier,
            template: self.template.clone(),
            image: self.image.clone(),
            own_image: self.owns().then(|| self.image.clone()),
            lifecycle: self.lifecycle,
            timeout,
            metadata: self.metadata.clone(),
            env_vars: self.env_vars.clone(),
            cpu_count: self.cpu_count,
            memory_mb: self.memory_mb,
            disk_mb: self.disk_mb,
            network: self.network.clone(),
            traffic: crate::traffic::Traffic { public: self.public_traffic, mask_host: self.mask_host.clone() },
            restore: None,
            disk_from: None,
            volume_mounts: self.volume_mounts.clone(),
        }
    }

    /// Whether `image` goes with this sandbox: always for a pause to its files (the image is
    /// made by the pause), and for the other pauses when it ran on an image of its own.
    pub fn owns(&self) -> bool {
        self.owns_image || (self.memory.is_none() && self.disk.is_none())
    }

    pub fn started_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.started_unix_ms)
    }

    pub fn paused_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.paused_unix_ms)
    }

    /// The directory in `<state>/paused` it keeps: its saved memory or its kept disk.
    pub fn kept_dir_name(&self) -> Option<&str> {
        self.memory.as_deref().or(self.disk.as_deref())
    }

    /// How it was paused, as the API says it.
    pub fn mode(&self) -> crate::pause::PauseMode {
        if self.memory.is_some() {
            crate::pause::PauseMode::Full
        } else {
            crate::pause::PauseMode::Filesystem
        }
    }
}

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The kept state: paused sandboxes' records, and the store their images live in.
pub struct Saved {
    store: cordon_image::Store,
    dir: PathBuf,
    paused_ttl: Duration,
    /// Most bytes the layers made from sandboxes (pauses, snapshots, forks) may take.
    budget: Option<u64>,
    records: Mutex<HashMap<String, Arc<Record>>>,
    pub snapshots: crate::snapshots::Snapshots,
    /// The volume service, where the server has one.
    pub volumes: Option<Arc<crate::volumes::VolumeApi>>,
    /// The volumes each paused sandbox holds in use, so that none is deleted under it.
    holds: Mutex<HashMap<String, Vec<cordon_volume::Lease>>>,
}

impl Saved {
    /// Opens `<state>/paused` and the snapshot list, and deletes what a server killed half-way
    /// through a pause or a fork left behind.
    pub fn open(store: cordon_image::Store, state_dir: &std::path::Path, paused_ttl: Duration, budget: Option<u64>, volumes: Option<Arc<crate::volumes::VolumeApi>>) -> Result<Saved, ServerError> {
        let dir = state_dir.join("paused");
        let io = |what: String| move |source| ServerError::Io { what, source };
        fs::create_dir_all(&dir).map_err(io(format!("create {}", dir.display())))?;
        let mut records = HashMap::new();
        for entry in fs::read_dir(&dir).map_err(io(format!("list {}", dir.display())))?.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                continue; // a saved memory, kept if a record names it (below)
            }
            let Some(id) = name.strip_suffix(".json") else {
                // A record being written when the server died.
                let _ = fs::remove_file(&path);
                continue;
            };
            let parsed = fs::read(&path).ok().and_then(|b| serde_json::from_slice::<Record>(&b).ok());
            match parsed {
                Some(r)
                    if r.id == id
                        && crate::routes::valid_id(id)
                        && store.get(&r.image).is_ok()
                        && r.memory.as_ref().is_none_or(|m| valid_kept_dir(m, id, MEMORY_SUFFIX) && dir.join(m).is_dir())
                        && r.disk.as_ref().is_none_or(|d| valid_kept_dir(d, id, DISK_SUFFIX) && dir.join(d).is_dir()) =>
                {
                    records.insert(r.id.clone(), Arc::new(r));
                }
                _ => {
                    tracing::warn!(path = %path.display(), "deleting a paused sandbox's record that cannot be resumed (unreadable, or its image is gone)");
                    let _ = fs::remove_file(&path);
                }
            }
        }
        let snapshots = crate::snapshots::Snapshots::open(state_dir)?;
        let saved = Saved { store, dir, paused_ttl, budget, records: Mutex::new(records), snapshots, volumes, holds: Mutex::new(HashMap::new()) };
        saved.sweep_unnamed_saves();
        saved.sweep_orphans();
        for r in saved.all() {
            saved.hold(&r);
        }
        Ok(saved)
    }

    pub fn store(&self) -> &cordon_image::Store {
        &self.store
    }

    pub fn paused_ttl(&self) -> Duration {
        self.paused_ttl
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Record>>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Images of this server's making that nothing names: no sandbox survives a restart, so
    /// every sandbox's own image is one, and so is a paused image without its record.
    /// Deletes memory or disks saved by a pause whose record was never written (a server killed
    /// half-way). Run again once the sandboxes a killed server left are adopted or ended: a
    /// save it started may have gone on writing until then.
    pub(crate) fn sweep_unnamed_saves(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.path().is_dir() && !self.lock().values().any(|r| r.kept_dir_name() == Some(name.as_str())) {
                tracing::info!(dir = %entry.path().display(), "deleting a saved memory no paused sandbox names (left by a server that stopped half-way)");
                let _ = fs::remove_dir_all(entry.path());
            }
        }
    }

    fn sweep_orphans(&self) {
        let Ok(images) = self.store.list() else { return };
        let named: Vec<String> = self.lock().values().map(|r| r.image.clone()).chain(self.snapshots.images()).collect();
        for img in images {
            let ours = [PAUSED_PREFIX, OWN_PREFIX, SNAPSHOT_PREFIX].iter().any(|p| img.name.starts_with(p));
            if ours && !named.contains(&img.name) {
                tracing::info!(image = %img.name, "deleting an image no paused sandbox or snapshot names (left by a server that stopped half-way)");
                self.drop_image_now(&img.name);
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Record>> {
        self.lock().get(id).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Record>> {
        self.lock().values().cloned().collect()
    }

    /// Takes a record out of the list (not off the disk) while its sandbox resumes.
    pub fn take(&self, id: &str) -> Option<Arc<Record>> {
        self.lock().remove(id)
    }

    /// Puts back a record whose resume failed.
    pub fn put_back(&self, r: Arc<Record>) {
        self.lock().insert(r.id.clone(), r);
    }

    /// Holds a paused sandbox's volumes in use until its record is forgotten. A volume that
    /// is gone is said, and its resume will say so again.
    fn hold(&self, r: &Record) {
        let Some(api) = &self.volumes else { return };
        let mut leases = Vec::new();
        for m in &r.volume_mounts {
            match api.store.lease_by_name(&m.name) {
                Ok(l) => leases.push(l),
                Err(e) => tracing::warn!(sandbox_id = %r.id, volume = %m.name, "a paused sandbox's volume cannot be held: {e}"),
            }
        }
        self.holds.lock().unwrap_or_else(|p| p.into_inner()).insert(r.id.clone(), leases);
    }

    /// Deletes a resumed sandbox's record (its image is now the sandbox's own).
    pub fn forget(&self, id: &str) {
        self.holds.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
        let _ = fs::remove_file(self.dir.join(format!("{id}.json")));
    }

    /// Where a record's saved memory is.
    pub fn memory_dir(&self, r: &Record) -> Option<PathBuf> {
        r.memory.as_ref().map(|m| self.dir.join(m))
    }

    /// Where a record's kept disk is.
    pub fn disk_dir(&self, r: &Record) -> Option<PathBuf> {
        r.disk.as_ref().map(|d| self.dir.join(d))
    }

    /// Where whatever a record keeps in a directory of its own is (memory or disk).
    fn kept_dir(&self, r: &Record) -> Option<PathBuf> {
        r.kept_dir_name().map(|m| self.dir.join(m))
    }

    /// Deletes what a paused sandbox kept (its record is taken already): its saved memory or
    /// disk, and its own image with the layers only it named.
    async fn drop_kept(&self, r: &Record) {
        if let Some(dir) = self.kept_dir(r) {
            let _ = tokio::task::spawn_blocking(move || fs::remove_dir_all(dir)).await;
        }
        if r.owns() {
            self.drop_image(&r.image).await;
        }
    }

    /// Whether a paused sandbox's record names `image` (which then outlives the live sandbox
    /// that ran on it).
    pub fn names_image(&self, image: &str) -> bool {
        self.lock().values().any(|r| r.image == image)
    }

    /// Deletes a resumed sandbox's record, and its saved memory (the sandbox runs on a copy).
    /// The delete runs after the answer: the directory is first renamed to a name no record can
    /// have (so a next pause of the same sandbox writes afresh, and a server that dies meanwhile
    /// deletes it at its next start, as any directory no record names).
    pub async fn forget_resumed(&self, r: &Record) {
        self.forget(&r.id);
        if let Some(dir) = self.kept_dir(r) {
            let gone = self.dir.join(format!(".gone-{}-{}", r.id, unix_ms(SystemTime::now())));
            let doomed = match fs::rename(&dir, &gone) {
                Ok(()) => gone,
                Err(_) => dir,
            };
            tokio::task::spawn_blocking(move || fs::remove_dir_all(doomed));
        }
    }

    /// Deletes a paused sandbox: its record, and its saved memory or its image and the layers
    /// only it named.
    pub async fn delete(&self, id: &str) -> bool {
        let Some(r) = self.take(id) else { return false };
        self.forget(id);
        self.drop_kept(&r).await;
        tracing::info!(sandbox_id = %id, "paused sandbox deleted");
        true
    }

    /// Deletes paused sandboxes older than the TTL.
    pub fn expire(&self, now: SystemTime) {
        let old: Vec<String> = self.lock().values().filter(|r| r.paused_at() + self.paused_ttl <= now).map(|r| r.id.clone()).collect();
        for id in old {
            if let Some(r) = self.take(&id) {
                self.forget(&id);
                tracing::info!(sandbox_id = %id, "paused sandbox deleted: paused for longer than --paused-ttl");
                if let Some(dir) = self.kept_dir(&r) {
                    let _ = fs::remove_dir_all(dir);
                }
                if r.owns() {
                    self.drop_image_now(&r.image);
                }
            }
        }
    }

    /// Deletes image `name` and the layers only it named, on a blocking thread.
    pub async fn drop_image(&self, name: &str) {
        let (store, name) = (self.store.clone(), name.to_string());
        let _ = tokio::task::spawn_blocking(move || drop_image(&store, &name)).await;
    }

    fn drop_image_now(&self, name: &str) {
        drop_image(&self.store, name)
    }

    /// Bytes the layers made from sandboxes take now: the top layer of every image made here.
    fn used(&self) -> u64 {
        let Ok(images) = self.store.list() else { return 0 };
        let mut tops: Vec<String> = images
            .iter()
            .filter(|i| [PAUSED_PREFIX, OWN_PREFIX, SNAPSHOT_PREFIX].iter().any(|p| i.name.starts_with(p)))
            .filter_map(|i| i.meta.layers.last().cloned())
            .collect();
        tops.sort();
        tops.dedup();
        let memory: u64 = self.lock().values().filter_map(|r| self.memory_dir(r)).map(|d| disk_bytes(&d)).sum();
        tops.iter().filter_map(|l| self.store.layer_size(l)).sum::<u64>() + memory
    }

    /// Refuses a pause, snapshot or fork that would take the kept state past `--state-budget`.
    pub fn check_budget(&self, more: u64) -> Result<(), ApiError> {
        let Some(budget) = self.budget else { return Ok(()) };
        let used = self.used();
        if used + more > budget {
            return Err(ApiError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                format!(
                    "the server's state budget is spent: {} MiB of {} MiB are used by paused sandboxes and snapshots and this needs about {} MiB more; kill paused sandboxes or delete snapshots, or start the server with a larger --state-budget",
                    used >> 20,
                    budget >> 20,
                    more.div_ceil(1 << 20)
                ),
            )
            .no_retry());
        }
        Ok(())
    }

    /// The image metadata of a frozen sandbox's files: its image's layers and one of its own
    /// (made now; no image names it yet).
    pub async fn capture(&self, e: &Arc<LiveSandbox>, source: String) -> Result<cordon_image::ImageMeta, ApiError> {
        let (store, e) = (self.store.clone(), e.clone());
        tokio::task::spawn_blocking(move || capture_meta(&store, &e, source)).await.map_err(|e| ApiError::internal(e.to_string()))?
    }

    /// Running sandbox `id`, for a snapshot or a fork: unknown is a 404, paused is `paused`.
    fn running(&self, sandboxes: &crate::registry::Sandboxes, id: &str, paused: &impl Fn() -> ApiError) -> Result<Arc<LiveSandbox>, ApiError> {
        if self.get(id).is_some() {
            return Err(paused());
        }
        sandboxes.get(id).ok_or_else(|| ApiError::not_found(format!("sandbox {id} not found")))
    }

    /// Whether `e` is still sandbox `id`, running, now that its turn has come: it may have been
    /// killed, paused or paused to disk while this waited.
    fn still_running(&self, sandboxes: &crate::registry::Sandboxes, id: &str, e: &Arc<LiveSandbox>, paused: &impl Fn() -> ApiError) -> Result<(), ApiError> {
        if !sandboxes.get(id).is_some_and(|now| Arc::ptr_eq(&now, e)) {
            return Err(if self.get(id).is_some() { paused() } else { ApiError::not_found(format!("sandbox {id} not found")) });
        }
        if e.frozen_at().is_some() {
            return Err(paused());
        }
        Ok(())
    }

    /// The files of running sandbox `id`, for a snapshot or a fork (`what`): frozen for as long
    /// as the capture takes, then thawed, whatever the capture did. A sandbox that is unknown,
    /// paused (`paused`), on a tier that keeps no files, or past the budget is refused.
    pub async fn capture_running(&self, sandboxes: &crate::registry::Sandboxes, id: &str, what: &str, paused: impl Fn() -> ApiError) -> Result<(Arc<LiveSandbox>, cordon_image::ImageMeta), ApiError> {
        let e = self.running(sandboxes, id, &paused)?;
        let _turn = e.transition.lock().await;
        self.still_running(sandboxes, id, &e, &paused)?;
        if !e.with_instance(false, |i| i.writable_layer().is_some()) {
            return Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, format!("the {} tier cannot keep a sandbox's files yet: no {what} of it", e.tier)).no_retry());
        }
        self.check_budget(e.disk_usage().map_or(0, |(used, _)| used))?;
        crate::pause::freeze(&e, true).await?;
        let meta = self.capture(&e, format!("{what} of sandbox {id}")).await;
        crate::pause::freeze(&e, false).await?;
        Ok((e.clone(), meta?))
    }

    /// The running state of sandbox `id`, processes and memory, saved for a fork on a tier
    /// that saves it to disk; the sandbox goes on where it was. Refused as
    /// [`Saved::capture_running`] refuses.
    pub async fn checkpoint_running(&self, sandboxes: &crate::registry::Sandboxes, id: &str, paused: impl Fn() -> ApiError) -> Result<(Arc<LiveSandbox>, KeptMemory), ApiError> {
        let e = self.running(sandboxes, id, &paused)?;
        let _turn = e.transition.lock().await;
        self.still_running(sandboxes, id, &e, &paused)?;
        let not_found = || ApiError::not_found(format!("sandbox {id} not found"));
        if !e.checkpointable().await {
            return Err(unsaveable(&e));
        }
        self.check_budget(e.memory_current().unwrap_or(0))?;
        // Named like no record's memory: the next start deletes it if this server dies first.
        let kept = KeptMemory { dir: self.dir.join(format!(".fork-{id}-{}.mem", unix_ms(SystemTime::now()))) };
        let mut instance = e.take_instance().ok_or_else(not_found)?;
        let at = kept.dir.clone();
        let (instance, done) = tokio::task::spawn_blocking(move || {
            let r = instance.checkpoint(&at, true);
            (instance, r)
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
        e.put_instance(instance);
        done.map_err(|err| ApiError::internal(format!("cannot save the sandbox's memory: {err}")))?;
        Ok((e.clone(), kept))
    }

    /// Names `meta` as image `name` (over layers already in the store).
    pub async fn commit(&self, name: &str, meta: cordon_image::ImageMeta) -> Result<(), ApiError> {
        let (store, name) = (self.store.clone(), name.to_string());
        tokio::task::spawn_blocking(move || {
            store.commit(&name, meta, &mut cordon_image::NoProgress).map(drop).map_err(|err| ApiError::internal(format!("cannot name image {name}: {err}")))
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
    }

    /// An image of its own for a new sandbox, over the layers of `image`.
    pub async fn own_copy(&self, image: &str, name: &str) -> Result<(), ApiError> {
        let (store, image) = (self.store.clone(), image.to_string());
        let meta = tokio::task::spawn_blocking(move || -> Result<cordon_image::ImageMeta, ApiError> {
            let base = store.get(&image).map_err(|err| ApiError::not_found(err.to_string()))?;
            let mut meta = base.meta.clone();
            if meta.layers.is_empty() {
                meta.layers = store.layer_ids(&base, &mut cordon_image::NoProgress).map_err(|err| ApiError::internal(err.to_string()))?;
            }
            meta.recipe = None;
            Ok(meta)
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
        self.commit(name, meta).await
    }

    /// Pauses a running sandbox with its memory, on a tier that saves it to disk
    /// ([`cordon_sandbox::Capabilities::checkpoint`]): its running state goes to
    /// `<state>/paused/<id>.mem`, then its record is written. The sandbox is left stopped, to be
    /// destroyed; on an error it runs on and nothing is kept.
    pub async fn pause_with_memory(&self, e: &Arc<LiveSandbox>) -> Result<Arc<Record>, ApiError> {
        self.pause_into(e, MEMORY_SUFFIX, |i, at| i.checkpoint(at, false), "save the sandbox with its memory", |r, name| r.memory = Some(name)).await
    }

    /// Pauses a running sandbox to its files on a tier that keeps its whole disk
    /// ([`cordon_sandbox::Capabilities::keep_disk`]): the disk goes to `<state>/paused/<id>.disk`,
    /// then the record is written. Left stopped, or running on after an error, as above.
    pub async fn pause_keeping_disk(&self, e: &Arc<LiveSandbox>) -> Result<Arc<Record>, ApiError> {
        self.pause_into(e, DISK_SUFFIX, |i, at| i.keep_disk(at), "keep the sandbox's disk", |r, name| r.disk = Some(name)).await
    }

    /// The shape of both pauses above: the tier writes `<state>/paused/<id><suffix>` with
    /// `keep` (on a blocking thread, the instance taken out meanwhile), then the record that
    /// names it (`name_it`) appears by one rename. Nothing is kept on an error.
    async fn pause_into(
        &self,
        e: &Arc<LiveSandbox>,
        suffix: &str,
        keep: fn(&mut dyn cordon_sandbox::Sandbox, &std::path::Path) -> Result<(), cordon_sandbox::Error>,
        what: &str,
        name_it: fn(&mut Record, String),
    ) -> Result<Arc<Record>, ApiError> {
        let now = SystemTime::now();
        let name = format!("{}{suffix}", e.id);
        let dir = self.dir.join(&name);
        let _ = fs::remove_dir_all(&dir);
        let mut instance = e.take_instance().ok_or_else(|| ApiError::not_found(format!("sandbox {} not found", e.id)))?;
        let at = dir.clone();
        let (instance, kept) = tokio::task::spawn_blocking(move || {
            let r = keep(instance.as_mut(), &at);
            (instance, r)
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
        e.put_instance(instance);
        kept.map_err(|err| ApiError::internal(format!("cannot {what}: {err}")))?;
        let mut record = record_of(e, e.image.clone(), now);
        record.owns_image = e.own_image.is_some();
        name_it(&mut record, name);
        if let Err(err) = self.write_record(&record) {
            let _ = fs::remove_dir_all(&dir);
            return Err(err);
        }
        self.hold(&record);
        let record = Arc::new(record);
        self.lock().insert(record.id.clone(), record.clone());
        Ok(record)
    }

    /// Marks a sandbox just paused with its memory as saved by a stopping server (see
    /// [`Record::resume_at_start`]), or clears that (`None`).
    pub fn set_resume_at_start(&self, id: &str, end_unix_ms: Option<u64>) -> Result<(), ApiError> {
        let Some(r) = self.get(id) else { return Err(ApiError::not_found(format!("sandbox {id} not found"))) };
        let mut r = (*r).clone();
        r.resume_at_start = end_unix_ms;
        self.write_record(&r)?;
        self.lock().insert(r.id.clone(), Arc::new(r));
        Ok(())
    }

    /// Writes a record by one rename, so that it is whole or absent.
    fn write_record(&self, record: &Record) -> Result<(), ApiError> {
        let path = self.dir.join(format!("{}.json", record.id));
        let tmp = self.dir.join(format!(".{}.tmp", record.id));
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec_pretty(record).expect("a record serializes"))?;
            f.sync_all()?;
            fs::rename(&tmp, &path)
        };
        write().map_err(|err| {
            let _ = fs::remove_file(&tmp);
            ApiError::internal(format!("cannot write the paused sandbox's record {}: {err}", path.display()))
        })
    }

    /// Pauses a frozen sandbox to its files: its image, then its record. Returns the record.
    pub async fn pause_to_disk(&self, e: &Arc<LiveSandbox>) -> Result<Arc<Record>, ApiError> {
        let now = SystemTime::now();
        let image = format!("{PAUSED_PREFIX}{}-{}", e.id, unix_ms(now));
        let record = record_of(e, image.clone(), now);
        let meta = self.capture(e, format!("pause of sandbox {}", e.id)).await?;
        self.commit(&image, meta).await?;
        if let Err(err) = self.write_record(&record) {
            self.drop_image(&image).await;
            return Err(err);
        }
        self.hold(&record);
        let record = Arc::new(record);
        self.lock().insert(record.id.clone(), record.clone());
        Ok(record)
    }
}

/// Why a sandbox of a tier that saves memory cannot have its memory saved.
pub(crate) fn unsaveable(e: &LiveSandbox) -> ApiError {
    let why = if e.volume_mounts.is_empty() { "this sandbox's memory cannot be saved" } else { "a VM with volumes cannot be saved with its memory (its virtio-fs shares cannot be migrated)" };
    ApiError::new(StatusCode::CONFLICT, format!("sandbox '{}': {why}: pause it with memory=false (its files), or create it without volumes", e.id)).no_retry()
}

/// A running sandbox's state saved for forks, deleted when dropped.
pub struct KeptMemory {
    pub dir: PathBuf,
}

impl KeptMemory {
    /// Moves it to `to` for good (a snapshot's): no longer deleted when dropped.
    pub fn persist(mut self, to: &std::path::Path) -> std::io::Result<()> {
        fs::rename(&self.dir, to)?;
        self.dir = PathBuf::new();
        Ok(())
    }
}

impl Drop for KeptMemory {
    fn drop(&mut self) {
        if !self.dir.as_os_str().is_empty() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// The names of the directories a paused sandbox keeps: `<id>.mem` (memory), `<id>.disk`.
const MEMORY_SUFFIX: &str = ".mem";
const DISK_SUFFIX: &str = ".disk";

/// A kept directory's name: `<id><suffix>`, nothing else (it is joined to a path).
fn valid_kept_dir(name: &str, id: &str, suffix: &str) -> bool {
    name.strip_suffix(suffix) == Some(id)
}

/// Bytes a directory's files take on disk (sparse files count what they hold).
fn disk_bytes(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::read_dir(dir).map_or(0, |es| es.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.blocks() * 512).sum())
}

/// The record of sandbox `e` paused now, its files in `image`.
fn record_of(e: &LiveSandbox, image: String, now: SystemTime) -> Record {
    Record {
        id: e.id.clone(),
        tier: e.tier,
        template: e.template.clone(),
        image,
        token: e.token.clone(),
        traffic_token: e.traffic_token.clone(),
        public_traffic: e.traffic.public,
        mask_host: e.traffic.mask_host.clone(),
        network: e.network(),
        metadata: e.metadata.clone(),
        env_vars: e.env_vars.clone(),
        cpu_count: e.cpu_count,
        memory_mb: e.memory_mb,
        disk_mb: e.disk_mb,
        lifecycle: e.lifecycle,
        envd_version: e.envd_version.clone(),
        started_unix_ms: unix_ms(e.started_at),
        paused_unix_ms: unix_ms(now),
        memory: None,
        disk: None,
        volume_mounts: e.volume_mounts.clone(),
        owns_image: false,
        resume_at_start: None,
    }
}

/// The image metadata of a frozen sandbox's files. Blocking.
fn capture_meta(store: &cordon_image::Store, e: &LiveSandbox, source: String) -> Result<cordon_image::ImageMeta, ApiError> {
    let fail = |what: &str, err: &dyn std::fmt::Display| ApiError::internal(format!("cannot keep the sandbox's files: {what}: {err}"));
    let layer = e.with_instance(None, |i| i.writable_layer()).ok_or_else(|| ApiError::internal("the sandbox's files are not readable from the host"))?;
    // Held from the layer's making to the image naming it, so no prune takes it meanwhile.
    let _hold = store.hold_layers().map_err(|err| fail("hold the layer store", &err))?;
    let base = store.get(&e.image).map_err(|err| fail("read its image", &err))?;
    let mut layers = store.layer_ids(&base, &mut cordon_image::NoProgress).map_err(|err| fail("its image's layers", &err))?;
    layers.extend(store.layer_from_upper(&layer.upper, layer.uid_base).map_err(|err| fail("make a layer of them", &err))?);
    let mut meta = base.meta.clone();
    meta.layers = layers;
    meta.source = source;
    meta.recipe = None;
    meta.created_unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    Ok(meta)
}

/// Deletes image `name` and the layers only it named.
fn drop_image(store: &cordon_image::Store, name: &str) {
    let layers = store.get(name).map(|i| i.meta.layers).unwrap_or_default();
    match store.remove(name) {
        Ok(()) => {}
        Err(cordon_image::ImageError::NotFound { .. }) => return,
        Err(e) => {
            tracing::warn!(image = %name, error = %e, "cannot delete a sandbox's image");
            return;
        }
    }
    if let Err(e) = store.remove_unnamed(&layers) {
        tracing::warn!(image = %name, error = %e, "cannot delete a sandbox image's layers");
    }
}
