//! Template builds through the API: what the SDKs' `Template.build`, `build_in_background`,
//! `exists`, `get_build_status` and the tag calls speak (E2B's "v2 build system", wire notes
//! in `e2b-state-and-templates.md` section 5).
//!
//! This module keeps the record of templates (names, builds, tags) and the files the SDK
//! uploads, and answers the endpoints; the build itself is the binary's [`Builder`] (the
//! Dockerfile path's executor and step cache), run on a blocking thread. A template's build
//! becomes a store image named `tpl-<templateID>-<build>`; a create of `name`, `name:tag` or the
//! template ID resolves to the image of the latest ready build (or the tagged one).
//!
//! The record lives in `<state>/templates/db.json` (replaced by rename on every change), the
//! uploads in `<state>/templates/files/<templateID>/<hash>`, written by a PUT to a URL this
//! server signs (HMAC-SHA256 over template, hash and expiry with a key of its own, kept in
//! `<state>/templates/upload-key`), since the SDK uploads without its API key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hmac::{Hmac, Mac};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::Sha256;

use crate::error::{json_response, ApiError};
use crate::{query, Body};

/// How long an upload URL stays valid.
const UPLOAD_URL_SECS: u64 = 3600;
/// The largest archive of one COPY step.
const MAX_UPLOAD: u64 = 8 << 30;
/// The path prefix of upload URLs (answered without an API key: the signature is the key).
pub const UPLOAD_PREFIX: &str = "/_cordon/template-files/";

pub use cordon_spec::TemplateStep as Step;

/// What the binary's builder gets: everything resolved.
#[derive(Debug, Clone)]
pub struct BuildJob {
    /// The store image to make.
    pub image: String,
    /// `fromImage` as sent (`e2bdev/base`, `base`, `python:3.12`), when the build starts from
    /// an image; the builder resolves it against the store and the configured registry.
    pub from_image: Option<String>,
    /// `fromTemplate`, resolved to its image here.
    pub from_template_image: Option<String>,
    pub steps: Vec<Step>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    pub force: bool,
    /// Where the step's uploads are, by hash.
    pub files: PathBuf,
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u64>,
    /// `fromImageRegistry` of type `registry`: the user and password to pull `fromImage` with.
    pub registry_auth: Option<(String, String)>,
}

/// Where a build failed, as E2B names it: `base`, `1`.., `finalize`.
#[derive(Debug, Clone)]
pub struct BuildFailure {
    pub step: String,
    pub message: String,
}

/// Runs a build to its end (blocking), passing each log line with its step to `log`.
pub trait Builder: Send + Sync {
    fn build(&self, job: &BuildJob, log: &mut dyn FnMut(Option<&str>, &str)) -> Result<(), BuildFailure>;
}

#[derive(Serialize, Deserialize, Default)]
struct Db {
    templates: BTreeMap<String, TemplateRec>,
}

#[derive(Serialize, Deserialize, Default, Clone)]
struct TemplateRec {
    names: Vec<String>,
    builds: Vec<BuildRec>,
    /// Tag -> build id.
    #[serde(default)]
    tags: BTreeMap<String, TagRec>,
    #[serde(default)]
    cpu_count: Option<u32>,
    #[serde(default)]
    memory_mb: Option<u64>,
}

#[derive(Serialize, Deserialize, Clone)]
struct TagRec {
    build: String,
    created: String,
}

#[derive(Serialize, Deserialize, Clone)]
struct BuildRec {
    id: String,
    /// `waiting` (requested), `building`, `ready`, `error`.
    status: String,
    image: String,
    created: String,
    /// Tags it takes once ready.
    #[serde(default)]
    tags: Vec<String>,
    #[serde(default)]
    reason: Option<Reason>,
}

#[derive(Serialize, Deserialize, Clone)]
struct Reason {
    message: String,
    step: Option<String>,
}

#[derive(Clone, Serialize)]
struct LogEntry {
    timestamp: String,
    message: String,
    level: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    step: Option<String>,
}

/// A built template as `GET /templates` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateSummary {
    pub id: String,
    pub names: Vec<String>,
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u64>,
    /// When its first and latest builds were requested (RFC 3339).
    pub created: Option<String>,
    pub updated: Option<String>,
    pub build_count: usize,
    /// The build a create gets (the latest ready one), else the latest.
    pub build_id: Option<String>,
    /// The latest build's status: `waiting`, `building`, `ready`, `error`.
    pub build_status: Option<String>,
    /// The store image of the latest ready build.
    pub ready_image: Option<String>,
    /// The store images of all its builds.
    pub images: Vec<String>,
}

/// The template record, the build logs of this run, and the builder.
pub struct Templates {
    dir: PathBuf,
    db: Mutex<Db>,
    logs: Mutex<BTreeMap<String, Arc<Mutex<Vec<LogEntry>>>>>,
    builder: Arc<dyn Builder>,
    key: Vec<u8>,
    /// Where the builds' images are (to remove those a newer build replaced).
    images: cordon_image::Store,
}

fn now_iso() -> String {
    crate::api::iso(SystemTime::now())
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `[a-z0-9]{20}`, as E2B's template ids.
fn new_template_id() -> String {
    cordon_sandbox::new_id()[1..].to_string()
}

/// A UUID v4, as E2B's build ids.
fn new_build_id() -> String {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("the kernel's random source is available");
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// A template name (E2B's alias rules, which are also an image name's): lowercase letters,
/// digits, `-` and `_`, 1..128.
fn check_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty() && name.len() <= 128 && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_' || b == b'.' || b == b'/');
    if !ok {
        return Err(ApiError::bad_request(format!("invalid template name '{}': use lowercase letters, digits, '-', '_' and '.'", name.escape_debug())));
    }
    Ok(())
}

fn check_tag(tag: &str) -> Result<(), ApiError> {
    let ok = !tag.is_empty() && tag.len() <= 128 && tag.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if !ok {
        return Err(ApiError::bad_request(format!("invalid tag '{}': use letters, digits, '-', '_' and '.'", tag.escape_debug())));
    }
    Ok(())
}

impl Templates {
    /// Opens (creating) `<state>/templates`. Builds that were running when a previous server
    /// stopped are recorded as failed: their sandboxes are gone.
    pub fn open(state_dir: &Path, images: cordon_image::Store, builder: Arc<dyn Builder>) -> std::io::Result<Templates> {
        let dir = state_dir.join("templates");
        std::fs::create_dir_all(dir.join("files"))?;
        let mut db: Db = match std::fs::read(dir.join("db.json")) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| std::io::Error::other(format!("{} is damaged: {e}", dir.join("db.json").display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Db::default(),
            Err(e) => return Err(e),
        };
        for t in db.templates.values_mut() {
            for b in &mut t.builds {
                if b.status == "building" || b.status == "waiting" {
                    b.status = "error".into();
                    b.reason = Some(Reason { message: "the server stopped during the build: build it again".into(), step: None });
                }
            }
        }
        let key = crate::auth::signing_key(&dir.join("upload-key"))?;
        let t = Templates { dir, db: Mutex::new(db), logs: Mutex::new(BTreeMap::new()), builder, key, images };
        t.save(&t.db.lock().expect("db lock"))?;
        Ok(t)
    }

    fn save(&self, db: &Db) -> std::io::Result<()> {
        let tmp = self.dir.join(format!(".db.{}.json", std::process::id()));
        std::fs::write(&tmp, serde_json::to_vec_pretty(db).expect("serializes"))?;
        std::fs::rename(&tmp, self.dir.join("db.json"))
    }

    fn save_or_500(&self, db: &Db) -> Result<(), ApiError> {
        self.save(db).map_err(|e| ApiError::internal(format!("cannot record the template: {e}")))
    }

    /// The template id `name_or_id` names (an alias, `alias:tag`, or an id) and the tag.
    fn find(db: &Db, name_or_id: &str) -> Option<(String, Option<String>)> {
        let (name, tag) = match name_or_id.split_once(':') {
            Some((n, t)) => (n, Some(t.to_string())),
            None => (name_or_id, None),
        };
        if db.templates.contains_key(name) {
            return Some((name.to_string(), tag));
        }
        db.templates.iter().find(|(_, t)| t.names.iter().any(|n| n == name)).map(|(id, _)| (id.clone(), tag))
    }

    /// The store image a create's `templateID` means, if it names a built template: the tagged
    /// build, or the latest ready one.
    pub fn resolve(&self, name_or_id: &str) -> Option<String> {
        let db = self.db.lock().expect("db lock");
        let (id, tag) = Self::find(&db, name_or_id)?;
        let t = &db.templates[&id];
        let build = match tag {
            Some(tag) => t.tags.get(&tag).map(|r| r.build.clone())?,
            None => t.builds.iter().rev().find(|b| b.status == "ready")?.id.clone(),
        };
        t.builds.iter().find(|b| b.id == build && b.status == "ready").map(|b| b.image.clone())
    }

    /// Template `name_or_id`'s record with its ready builds only, and their images: what
    /// another node of a cluster copies (see `crate::cluster`).
    pub fn export(&self, name_or_id: &str) -> Option<(String, Value, Vec<String>)> {
        let db = self.db.lock().expect("db lock");
        let (id, _) = Self::find(&db, name_or_id)?;
        let mut rec = db.templates[&id].clone();
        rec.builds.retain(|b| b.status == "ready");
        rec.tags.retain(|_, t| rec.builds.iter().any(|b| b.id == t.build));
        if rec.builds.is_empty() {
            return None;
        }
        let images = rec.builds.iter().map(|b| b.image.clone()).collect();
        Some((id, serde_json::to_value(&rec).expect("serializes"), images))
    }

    /// Records template `id` copied from another node (its builds' images are in the store
    /// already), unless this node has a template of that id or of one of its names.
    pub fn add_copy(&self, id: &str, record: Value) -> Result<(), ApiError> {
        let rec: TemplateRec = serde_json::from_value(record).map_err(|e| ApiError::internal(format!("a template record this version does not read: {e}")))?;
        let mut db = self.db.lock().expect("db lock");
        if db.templates.contains_key(id) || db.templates.values().any(|t| t.names.iter().any(|n| rec.names.contains(n))) {
            return Ok(());
        }
        db.templates.insert(id.to_string(), rec);
        self.save_or_500(&db)
    }

    /// `GET /templates/aliases/{alias}`: whether a template of that name exists.
    pub fn alias(&self, alias: &str) -> Option<String> {
        let db = self.db.lock().expect("db lock");
        Self::find(&db, alias).map(|(id, _)| id)
    }

    /// `POST /v3/templates`.
    pub async fn request(&self, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
        #[derive(Deserialize)]
        struct Body3 {
            name: Option<String>,
            alias: Option<String>,
            #[serde(default)]
            tags: Option<Vec<String>>,
            #[serde(rename = "cpuCount")]
            cpu_count: Option<u32>,
            #[serde(rename = "memoryMB")]
            memory_mb: Option<u64>,
        }
        let b: Body3 = crate::api::read_json(req, false).await?;
        let full = b.name.or(b.alias).filter(|n| !n.is_empty()).ok_or_else(|| ApiError::bad_request("a template needs a name"))?;
        let (name, name_tag) = match full.split_once(':') {
            Some((n, t)) => (n.to_string(), Some(t.to_string())),
            None => (full.clone(), None),
        };
        check_name(&name)?;
        let mut tags: Vec<String> = name_tag.into_iter().chain(b.tags.unwrap_or_default()).collect();
        for t in &tags {
            check_tag(t)?;
        }
        tags.dedup();
        if b.cpu_count == Some(0) {
            return Err(ApiError::bad_request("cpuCount must be at least 1"));
        }
        if b.memory_mb.is_some_and(|m| m < 128) {
            return Err(ApiError::bad_request("memoryMB must be at least 128"));
        }
        let mut db = self.db.lock().expect("db lock");
        let id = Self::find(&db, &name).map(|(id, _)| id).unwrap_or_else(new_template_id);
        let build = new_build_id();
        let t = db.templates.entry(id.clone()).or_default();
        if !t.names.contains(&name) {
            t.names.push(name.clone());
        }
        t.cpu_count = b.cpu_count.or(t.cpu_count);
        t.memory_mb = b.memory_mb.or(t.memory_mb);
        t.builds.push(BuildRec { id: build.clone(), status: "waiting".into(), image: format!("tpl-{id}-{}", &build[..8]), created: now_iso(), tags: tags.clone(), reason: None });
        self.save_or_500(&db)?;
        Ok(json_response(StatusCode::ACCEPTED, &json!({"templateID": id, "buildID": build, "public": false, "names": [name], "tags": tags, "aliases": [name]})))
    }

    /// `GET /templates/{id}/files/{hash}`: whether the step's files are here, else where to PUT
    /// them. `base` is this server's URL as the client reached it.
    pub fn files(&self, id: &str, hash: &str, base: &str) -> Result<Response<Body>, ApiError> {
        if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(ApiError::bad_request("Invalid files hash"));
        }
        let id = self.template_id(id)?;
        if self.dir.join("files").join(&id).join(hash).is_file() {
            return Ok(json_response(StatusCode::CREATED, &json!({"present": true})));
        }
        let expires = unix_now() + UPLOAD_URL_SECS;
        let sig = self.sign(&id, hash, expires);
        let url = format!("{base}{UPLOAD_PREFIX}{id}/{hash}?expires={expires}&signature={sig}");
        Ok(json_response(StatusCode::CREATED, &json!({"present": false, "url": url})))
    }

    fn template_id(&self, id: &str) -> Result<String, ApiError> {
        let id = query::percent_decode(id, false);
        let db = self.db.lock().expect("db lock");
        Self::find(&db, &id).map(|(id, _)| id).ok_or_else(|| ApiError::not_found(format!("template '{id}' not found")))
    }

    fn sign(&self, id: &str, hash: &str, expires: u64) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("any key length");
        mac.update(format!("{id}\0{hash}\0{expires}").as_bytes());
        mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// `PUT /_cordon/template-files/{id}/{hash}?expires&signature`: stores an upload. The
    /// signature is the only credential; the archive appears by rename once complete.
    pub async fn upload(&self, path: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
        let rest = path.strip_prefix(UPLOAD_PREFIX).unwrap_or("");
        let (id, hash) = rest.split_once('/').ok_or_else(|| ApiError::not_found("no such upload URL"))?;
        let q = req.uri().query();
        let expires: u64 = query::get(q, "expires").and_then(|e| e.parse().ok()).ok_or_else(|| ApiError::unauthorized("the upload URL is not signed"))?;
        let sig = query::get(q, "signature").unwrap_or_default();
        let want = self.sign(id, hash, expires);
        if !crate::auth::ct_eq(&sig, &want) {
            return Err(ApiError::unauthorized("the upload URL's signature does not match"));
        }
        if unix_now() > expires {
            return Err(ApiError::unauthorized("the upload URL has expired: ask for a new one"));
        }
        let dir = self.dir.join("files").join(id);
        std::fs::create_dir_all(&dir).map_err(|e| ApiError::internal(format!("cannot store the upload: {e}")))?;
        let part = dir.join(format!(".{hash}.{}", unix_now_nanos()));
        let result = write_body(req.into_body(), &part).await;
        match result {
            Ok(()) => std::fs::rename(&part, dir.join(hash)).map_err(|e| ApiError::internal(format!("cannot store the upload: {e}")))?,
            Err(e) => {
                let _ = std::fs::remove_file(&part);
                return Err(e);
            }
        }
        let mut r = Response::new(crate::full(Bytes::new()));
        *r.status_mut() = StatusCode::CREATED;
        Ok(r)
    }

    /// `POST /v2/templates/{id}/builds/{buildID}`: starts the build in the background.
    pub async fn start(self: &Arc<Self>, id: &str, build: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
        #[derive(Deserialize)]
        struct Start {
            #[serde(rename = "fromImage")]
            from_image: Option<String>,
            #[serde(rename = "fromTemplate")]
            from_template: Option<String>,
            #[serde(default)]
            force: bool,
            #[serde(default)]
            steps: Vec<Step>,
            #[serde(rename = "startCmd")]
            start_cmd: Option<String>,
            #[serde(rename = "readyCmd")]
            ready_cmd: Option<String>,
            #[serde(rename = "fromImageRegistry")]
            registry: Option<Value>,
        }
        let id = self.template_id(id)?;
        let b: Start = crate::api::read_json(req, false).await?;
        let (from_image, from_template) = (b.from_image.filter(|s| !s.is_empty()), b.from_template.filter(|s| !s.is_empty()));
        if from_image.is_some() == from_template.is_some() {
            return Err(ApiError::bad_request("give exactly one of fromImage and fromTemplate"));
        }
        for s in &b.steps {
            if let Some(h) = &s.files_hash {
                if h.len() != 64 || !h.bytes().all(|c| c.is_ascii_hexdigit()) {
                    return Err(ApiError::bad_request(format!("step {} has an invalid filesHash", s.kind)));
                }
            }
        }
        let registry_auth = match &b.registry {
            None => None,
            Some(r) if r["type"] == "registry" => match (r["username"].as_str(), r["password"].as_str()) {
                (Some(u), Some(p)) if !u.is_empty() => Some((u.to_string(), p.to_string())),
                _ => return Err(ApiError::bad_request("fromImageRegistry: a registry needs a username and a password")),
            },
            Some(r) => {
                return Err(ApiError::bad_request(format!("fromImageRegistry of type {} is not supported: cordon pulls with a registry username and password", r["type"])))
            }
        };
        let from_template_image = from_template.as_ref().map(|t| self.resolve(t).unwrap_or_else(|| t.clone()));
        let job = {
            let mut db = self.db.lock().expect("db lock");
            let t = db.templates.get_mut(&id).ok_or_else(|| ApiError::not_found(format!("template '{id}' not found")))?;
            let (cpu_count, memory_mb) = (t.cpu_count, t.memory_mb);
            let rec = t.builds.iter_mut().find(|r| r.id == build).ok_or_else(|| ApiError::not_found(format!("build '{build}' of template '{id}' not found")))?;
            if rec.status != "waiting" {
                return Err(ApiError::new(StatusCode::CONFLICT, format!("build '{build}' was already started")));
            }
            rec.status = "building".into();
            let job = BuildJob {
                image: rec.image.clone(),
                from_image,
                from_template_image,
                steps: b.steps,
                start_cmd: b.start_cmd.filter(|s| !s.trim().is_empty()),
                ready_cmd: b.ready_cmd.filter(|s| !s.trim().is_empty()),
                force: b.force,
                files: self.dir.join("files").join(&id),
                cpu_count,
                memory_mb,
                registry_auth,
            };
            self.save_or_500(&db)?;
            job
        };
        let log = Arc::new(Mutex::new(Vec::new()));
        self.logs.lock().expect("logs lock").insert(build.to_string(), log.clone());
        let me = self.clone();
        let (id, build) = (id.clone(), build.to_string());
        tokio::task::spawn_blocking(move || me.run(&id, &build, &job, &log));
        let mut r = Response::new(crate::full(Bytes::new()));
        *r.status_mut() = StatusCode::ACCEPTED;
        Ok(r)
    }

    fn run(&self, id: &str, build: &str, job: &BuildJob, log: &Mutex<Vec<LogEntry>>) {
        let push = |level: &'static str, step: Option<&str>, message: &str| {
            log.lock().expect("log lock").push(LogEntry { timestamp: now_iso(), message: message.to_string(), level, step: step.map(str::to_string) });
        };
        tracing::info!(template = id, build, image = %job.image, "template build started");
        let outcome = self.builder.build(job, &mut |step, line| push("info", step, line));
        let mut db = self.db.lock().expect("db lock");
        let Some(t) = db.templates.get_mut(id) else { return };
        let tags = match t.builds.iter_mut().find(|r| r.id == build) {
            None => return,
            Some(rec) => match &outcome {
                Ok(()) => {
                    rec.status = "ready".into();
                    rec.tags.clone()
                }
                Err(f) => {
                    rec.status = "error".into();
                    rec.reason = Some(Reason { message: f.message.clone(), step: Some(f.step.clone()) });
                    Vec::new()
                }
            },
        };
        for tag in tags {
            t.tags.insert(tag, TagRec { build: build.to_string(), created: now_iso() });
        }
        // The images of earlier builds that no tag names any more are replaced by this one:
        // removed (a sandbox still running on one keeps it, pinned, until a later build).
        if outcome.is_ok() {
            let tagged: Vec<String> = t.tags.values().map(|r| r.build.clone()).collect();
            for old in t.builds.iter_mut().filter(|b| b.id != build && b.status == "ready" && !tagged.contains(&b.id)) {
                match self.images.remove(&old.image) {
                    Ok(()) | Err(cordon_image::ImageError::NotFound { .. }) => old.status = "replaced".into(),
                    Err(e) => tracing::info!(image = %old.image, error = %e, "keeping the image of an earlier template build"),
                }
            }
        }
        match &outcome {
            Ok(()) => {
                push("info", Some("finalize"), "build finished");
                tracing::info!(template = id, build, "template build ready");
            }
            Err(f) => {
                push("error", Some(&f.step), &f.message);
                tracing::warn!(template = id, build, step = %f.step, error = %f.message, "template build failed");
            }
        }
        if let Err(e) = self.save(&db) {
            tracing::error!(error = %e, "cannot record a template build's end");
        }
    }

    /// `GET /templates/{id}/builds/{buildID}/status?logsOffset&limit`.
    pub fn status(&self, id: &str, build: &str, q: Option<&str>) -> Result<Response<Body>, ApiError> {
        let id = self.template_id(id)?;
        let (status, reason) = {
            let db = self.db.lock().expect("db lock");
            let rec = db.templates.get(&id).and_then(|t| t.builds.iter().find(|b| b.id == build)).ok_or_else(|| ApiError::not_found(format!("build '{build}' of template '{id}' not found")))?;
            // A build a later one replaced was ready; its image is gone, its record is not.
            let status = if rec.status == "replaced" { "ready".to_string() } else { rec.status.clone() };
            (status, rec.reason.clone())
        };
        let offset: usize = query::get(q, "logsOffset").and_then(|v| v.parse().ok()).unwrap_or(0);
        let limit: usize = query::get(q, "limit").and_then(|v| v.parse().ok()).unwrap_or(100).clamp(1, 100);
        let entries: Vec<LogEntry> = match self.logs.lock().expect("logs lock").get(build) {
            Some(l) => l.lock().expect("log lock").iter().skip(offset).take(limit).cloned().collect(),
            None => Vec::new(),
        };
        let mut body = json!({"templateID": id, "buildID": build, "status": status, "logs": [], "logEntries": entries});
        if let Some(r) = reason {
            body["reason"] = json!({"message": r.message, "step": r.step});
        }
        Ok(json_response(StatusCode::OK, &body))
    }

    /// `POST /templates/tags {target, tags}`.
    pub async fn assign_tags(&self, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
        #[derive(Deserialize)]
        struct Assign {
            target: String,
            tags: Vec<String>,
        }
        let b: Assign = crate::api::read_json(req, false).await?;
        for t in &b.tags {
            check_tag(t)?;
        }
        let mut db = self.db.lock().expect("db lock");
        let (id, tag) = Self::find(&db, &b.target).ok_or_else(|| ApiError::not_found(format!("template '{}' not found", b.target)))?;
        let t = db.templates.get_mut(&id).expect("found");
        let build = match tag {
            Some(tag) => t.tags.get(&tag).map(|r| r.build.clone()).ok_or_else(|| ApiError::not_found(format!("tag '{tag}' of '{}' not found", b.target)))?,
            None => t.builds.iter().rev().find(|r| r.status == "ready").map(|r| r.id.clone()).ok_or_else(|| ApiError::not_found(format!("template '{}' has no finished build", b.target)))?,
        };
        for tag in &b.tags {
            t.tags.insert(tag.clone(), TagRec { build: build.clone(), created: now_iso() });
        }
        self.save_or_500(&db)?;
        Ok(json_response(StatusCode::CREATED, &json!({"tags": b.tags, "buildID": build})))
    }

    /// `DELETE /templates/tags {name, tags}`.
    pub async fn remove_tags(&self, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
        #[derive(Deserialize)]
        struct Remove {
            name: String,
            tags: Vec<String>,
        }
        let b: Remove = crate::api::read_json(req, false).await?;
        let mut db = self.db.lock().expect("db lock");
        let (id, _) = Self::find(&db, &b.name).ok_or_else(|| ApiError::not_found(format!("template '{}' not found", b.name)))?;
        let t = db.templates.get_mut(&id).expect("found");
        for tag in &b.tags {
            t.tags.remove(tag);
        }
        self.save_or_500(&db)?;
        let mut r = Response::new(crate::full(Bytes::new()));
        *r.status_mut() = StatusCode::NO_CONTENT;
        Ok(r)
    }

    /// `DELETE /templates/{id}`: the template, its builds' images and its uploads. A build still
    /// running finishes into nothing.
    pub fn delete(&self, id: &str) -> Result<Response<Body>, ApiError> {
        let id = self.template_id(id)?;
        let mut db = self.db.lock().expect("db lock");
        let t = db.templates.get(&id).cloned().expect("found");
        for b in &t.builds {
            match self.images.remove(&b.image) {
                Ok(()) | Err(cordon_image::ImageError::NotFound { .. }) => {}
                Err(e @ cordon_image::ImageError::InUse { .. }) => return Err(ApiError::new(StatusCode::CONFLICT, e.to_string())),
                Err(e) => return Err(ApiError::internal(e.to_string())),
            }
        }
        db.templates.remove(&id);
        self.save_or_500(&db)?;
        let _ = std::fs::remove_dir_all(self.dir.join("files").join(&id));
        let mut r = Response::new(crate::full(Bytes::new()));
        *r.status_mut() = StatusCode::NO_CONTENT;
        Ok(r)
    }

    /// Every built template, for `GET /templates` (see [`crate::template_list`]).
    pub fn summaries(&self) -> Vec<TemplateSummary> {
        let db = self.db.lock().expect("db lock");
        db.templates
            .iter()
            .map(|(id, t)| {
                let latest = t.builds.last();
                TemplateSummary {
                    id: id.clone(),
                    names: t.names.clone(),
                    cpu_count: t.cpu_count,
                    memory_mb: t.memory_mb,
                    created: t.builds.first().map(|b| b.created.clone()),
                    updated: latest.map(|b| b.created.clone()),
                    build_count: t.builds.len(),
                    build_id: t.builds.iter().rev().find(|b| b.status == "ready").or(latest).map(|b| b.id.clone()),
                    build_status: latest.map(|b| b.status.clone()),
                    ready_image: t.builds.iter().rev().find(|b| b.status == "ready").map(|b| b.image.clone()),
                    images: t.builds.iter().map(|b| b.image.clone()).collect(),
                }
            })
            .collect()
    }

    /// `GET /templates/{id}/tags`.
    pub fn tags(&self, id: &str) -> Result<Response<Body>, ApiError> {
        let id = self.template_id(id)?;
        let db = self.db.lock().expect("db lock");
        let list: Vec<Value> = db.templates[&id].tags.iter().map(|(tag, r)| json!({"tag": tag, "buildID": r.build, "createdAt": r.created})).collect();
        Ok(json_response(StatusCode::OK, &Value::Array(list)))
    }
}

fn unix_now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

/// Streams a request body into `path`, refusing more than [`MAX_UPLOAD`] bytes.
async fn write_body(mut body: Incoming, path: &Path) -> Result<(), ApiError> {
    use tokio::io::AsyncWriteExt;
    let mut f = tokio::fs::File::create(path).await.map_err(|e| ApiError::internal(format!("cannot store the upload: {e}")))?;
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::bad_request(format!("the upload broke off: {e}")))?;
        if let Ok(data) = frame.into_data() {
            total += data.len() as u64;
            if total > MAX_UPLOAD {
                return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the upload exceeds {} GiB", MAX_UPLOAD >> 30)));
            }
            f.write_all(&data).await.map_err(|e| ApiError::internal(format!("cannot store the upload: {e}")))?;
        }
    }
    f.flush().await.map_err(|e| ApiError::internal(format!("cannot store the upload: {e}")))?;
    Ok(())
}
