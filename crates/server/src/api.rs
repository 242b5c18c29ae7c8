//! The control plane: the REST endpoints the SDK's `Sandbox.create/connect/kill/set_timeout/
//! get_info/list/get_metrics` call.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use cordon_envd::Timestamp;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{json_response, ApiError};
use crate::registry::{LiveSandbox, NewSandbox, MAX_TIMEOUT_SECS};
use crate::{auth, query, App, Body};

/// Largest control-plane request body.
const MAX_BODY: usize = 1 << 20;
/// E2B's default sandbox lifetime.
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;
/// Most items per list page.
const MAX_LIMIT: usize = 100;

/// Resource defaults when a create names none: the same caps as `cordon run`.
pub(crate) const DEFAULT_CPUS: u32 = 1;
pub(crate) const DEFAULT_MEMORY_MB: u64 = cordon_spec::DEFAULT_MEMORY >> 20;
pub(crate) const DEFAULT_DISK_MB: u64 = cordon_spec::DEFAULT_DISK >> 20;

pub async fn handle(app: &Arc<App>, req: Request<Incoming>) -> Response<Body> {
    match route(app, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn route(app: &Arc<App>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let method = req.method().clone();
    if path.is_empty() || path == "/health" {
        return match method {
            Method::GET | Method::HEAD => Ok(json_response(StatusCode::OK, &json!({"status": "ok"}))),
            _ => Err(ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "use GET")),
        };
    }
    // A template build's upload URL carries its own signature: the SDKs PUT to it without the
    // API key.
    if path.starts_with(crate::templates::UPLOAD_PREFIX.trim_end_matches('/')) && method == Method::PUT {
        return templates(app)?.upload(&path, req).await;
    }
    // The content API takes a volume's own bearer token, never the API key.
    if let Some(rest) = path.strip_prefix("/volumecontent/") {
        let rest = rest.to_string();
        return crate::volume_content::handle(volumes(app)?, &method, &rest, req).await;
    }
    if path == "/metrics" {
        auth::check_scrape_key(req.headers(), &app.api_key)?;
        return metrics_text(app, &method, req.headers());
    }
    // The dashboard's files hold no data; its terminal checks the key in its first message.
    if crate::ui::is_ui_path(req.uri().path()) {
        return Ok(crate::ui::handle(app, req).await);
    }
    auth::check_api_key(req.headers(), &app.api_key)?;
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let segs = match segs.as_slice() {
        ["v2", rest @ ..] => (true, rest.to_vec()),
        rest => (false, rest.to_vec()),
    };
    match (&method, segs.0, segs.1.as_slice()) {
        (&Method::POST, _, ["sandboxes"]) => create(app, req).await,
        (&Method::GET, _, ["sandboxes"]) => list(app, req.uri().query()),
        (&Method::GET, false, ["sandboxes", "metrics"]) => Ok(json_response(StatusCode::OK, &json!({ "sandboxes": metrics_of(app, &metrics_ids(req.uri().query())?) }))),
        (&Method::GET, false, ["sandboxes", id]) => detail(app, id),
        (&Method::DELETE, false, ["sandboxes", id]) => kill(app, id).await,
        (&Method::POST, false, ["sandboxes", id, "pause"]) => {
            let id = id.to_string();
            pause(app, &id, req).await
        }
        (&Method::POST, false, ["sandboxes", id, "resume"]) => {
            let id = id.to_string();
            resume(app, &id, req).await
        }
        (&Method::POST, false, ["sandboxes", id, "snapshots"]) => {
            let id = id.to_string();
            snapshot(app, &id, req).await
        }
        (&Method::GET, false, ["snapshots"]) => snapshots(app, req.uri().query()),
        (&Method::GET, false, ["pools"]) => Ok(pools(app)),
        (&Method::POST, false, ["sandboxes", id, "fork"]) => {
            let id = id.to_string();
            fork(app, &id, req).await
        }
        (&Method::POST, false, ["sandboxes", id, "timeout"]) => {
            let id = id.to_string();
            set_timeout(app, &id, req).await
        }
        (&Method::POST, _, ["sandboxes", id, "connect"]) => {
            let id = id.to_string();
            connect(app, &id, req).await
        }
        (&Method::GET, false, ["sandboxes", id, "metrics"]) => metrics(app, id, req.uri().query()),
        (&Method::GET, false, ["sandboxes", id, "audit"]) => audit(app, id),
        (&Method::GET, v2, ["sandboxes", id, "logs"]) => logs(app, id, v2, req.uri().query()),
        (&Method::GET, false, ["sandboxes", id, "isolation"]) => {
            let verify = req.uri().query().is_some_and(|q| q.split('&').any(|kv| kv == "verify=true" || kv == "verify=1"));
            isolation(app, id, verify).await
        }
        (&Method::PUT, false, ["sandboxes", id, "network"]) => {
            let id = id.to_string();
            update_network(app, &id, req).await
        }
        (_, false, ["volumes", ..]) => volumes(app)?.handle(&method, &segs.1, req).await,
        (_, false, ["secrets", ..]) => crate::secrets::handle(secrets(app)?, &method, &segs.1, req).await,
        (&Method::GET, false, ["templates"]) => Ok(json_response(StatusCode::OK, &crate::template_list::list(app)?)),
        (&Method::GET, false, ["templates", "aliases", alias]) => template_alias(app, alias),
        (&Method::POST, false, ["v3", "templates"]) => templates(app)?.request(req).await,
        (&Method::GET, false, ["templates", id, "files", hash]) => {
            let base = self_url(app, &req);
            templates(app)?.files(id, hash, &base)
        }
        (&Method::POST, true, ["templates", id, "builds", build]) => {
            let (id, build) = (id.to_string(), build.to_string());
            templates(app)?.start(&id, &build, req).await
        }
        (&Method::GET, false, ["templates", id, "builds", build, "status"]) => templates(app)?.status(id, build, req.uri().query()),
        (&Method::POST, false, ["templates", "tags"]) => templates(app)?.assign_tags(req).await,
        (&Method::DELETE, false, ["templates", "tags"]) => templates(app)?.remove_tags(req).await,
        (&Method::GET, false, ["templates", id, "tags"]) => templates(app)?.tags(id),
        (&Method::DELETE, false, ["templates", id]) => {
            // A snapshot is deleted as a template (its id arrives percent-encoded).
            let reference = query::percent_decode(id, false);
            match crate::snapshots::delete(&app.sandboxes, &reference).await? {
                Some(()) => Ok(empty(StatusCode::NO_CONTENT)),
                None => templates(app)?.delete(id),
            }
        }
        (_, false, ["sandboxes", _, op @ "refreshes"]) => Err(
            ApiError::new(StatusCode::NOT_IMPLEMENTED, format!("'{op}' is not supported by cordon: use connect or set_timeout to extend a sandbox's life")).no_retry(),
        ),
        _ => Err(ApiError::not_found(format!("no API endpoint {method} {path}"))),
    }
}

/// `GET /metrics`: the server's metrics in the Prometheus text format, or OpenMetrics when the
/// scraper asks for it.
pub fn metrics_text(app: &App, method: &Method, headers: &hyper::HeaderMap) -> Result<Response<Body>, ApiError> {
    if !matches!(*method, Method::GET | Method::HEAD) {
        return Err(ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "use GET"));
    }
    let openmetrics = crate::server_metrics::wants_openmetrics(headers.get(hyper::header::ACCEPT).and_then(|v| v.to_str().ok()));
    let text = app.sandboxes.stats.render(&app.sandboxes, openmetrics);
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(hyper::header::CONTENT_TYPE, crate::server_metrics::content_type(openmetrics))
        .body(crate::full(text))
        .expect("a static response"))
}

fn secrets(app: &App) -> Result<&Arc<cordon_secret::SecretStore>, ApiError> {
    app.secrets.as_ref().ok_or_else(|| ApiError::new(StatusCode::NOT_IMPLEMENTED, "this server keeps no secrets").no_retry())
}

fn volumes(app: &App) -> Result<&Arc<crate::volumes::VolumeApi>, ApiError> {
    app.volumes.as_ref().ok_or_else(|| ApiError::new(StatusCode::NOT_IMPLEMENTED, "this server keeps no volumes").no_retry())
}

pub(crate) async fn read_json<T: for<'de> Deserialize<'de>>(req: Request<Incoming>, empty_ok: bool) -> Result<T, ApiError> {
    parse_json(&read_body(req.into_body()).await?, empty_ok)
}

/// A control-plane request's body, at most [`MAX_BODY`] bytes.
pub(crate) async fn read_body(body: Incoming) -> Result<Bytes, ApiError> {
    match Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("request body exceeds {MAX_BODY} bytes"))),
        Err(e) => Err(ApiError::bad_request(format!("cannot read the request body: {e}"))),
    }
}

fn parse_json<T: for<'de> Deserialize<'de>>(body: &[u8], empty_ok: bool) -> Result<T, ApiError> {
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) && empty_ok { b"{}" } else { body };
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// `NewSandbox` (≤2.49) and `NewSandboxV2` (2.52+), plus cordon's extensions.
#[derive(Deserialize)]
struct CreateBody {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<i64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(rename = "envVars", default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(rename = "cpuCount")]
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u64>,
    #[serde(rename = "diskSizeMB")]
    disk_mb: Option<u64>,
    tier: Option<String>,
    /// Old SDKs always send `true`. `false` keeps the sandbox closed even when rules are given;
    /// otherwise the server's network default decides what no rules mean (see `network`).
    allow_internet_access: Option<bool>,
    network: Option<NetworkBody>,
    #[serde(rename = "autoPause")]
    auto_pause: Option<bool>,
    #[serde(rename = "autoPauseMemory")]
    auto_pause_memory: Option<bool>,
    #[serde(rename = "autoResume")]
    auto_resume: Option<AutoResume>,
    #[serde(rename = "volumeMounts", default)]
    volume_mounts: Option<Vec<crate::volumes::MountRequest>>,
}

/// `autoResume: {"enabled": bool}`.
#[derive(Deserialize)]
struct AutoResume {
    enabled: Option<bool>,
}

/// E2B's network config: `allowOut` and `denyOut` take cordon's rule forms (domain,
/// `*.domain`, IP or CIDR, each with an optional `:PORT`). Other keys are accepted and ignored.
#[derive(Deserialize, Default)]
struct NetworkBody {
    #[serde(rename = "allowOut", default)]
    allow_out: Vec<String>,
    #[serde(rename = "denyOut", default)]
    deny_out: Vec<String>,
    #[serde(rename = "allowPublicTraffic", default)]
    allow_public_traffic: Option<bool>,
    #[serde(rename = "maskRequestHost", default)]
    mask_request_host: Option<String>,
    /// In `PUT /sandboxes/{id}/network`'s body: `false` closes everything.
    #[serde(default)]
    allow_internet_access: Option<bool>,
    /// Header injection: `{"<host>": [{"transform": {"headers": {"<Name>": "<value>"}}}]}`.
    #[serde(default)]
    rules: Option<BTreeMap<String, Vec<RuleBody>>>,
}

/// One rule of `network.rules` (E2B allows one per host).
#[derive(Deserialize, Default)]
struct RuleBody {
    #[serde(default)]
    transform: Option<TransformBody>,
}

#[derive(Deserialize, Default)]
struct TransformBody {
    #[serde(default)]
    headers: Option<BTreeMap<String, String>>,
}

impl NetworkBody {
    /// The policy the body asks for, its injection rules checked against the secrets this
    /// server holds and its ability to inject at all.
    fn policy(&self, app: &App, internet: Option<bool>) -> Result<cordon_spec::NetworkPolicy, ApiError> {
        let mut p = app.network_default.policy(&self.allow_out, &self.deny_out, internet).map_err(|e| ApiError::bad_request(format!("network: {}", e.reason)))?;
        let Some(rules) = &self.rules else { return Ok(p) };
        let mut given = Vec::with_capacity(rules.len());
        for (host, list) in rules {
            if list.len() > 1 {
                return Err(ApiError::bad_request(format!("network.rules: '{host}' has {} rules: at most 1 per host", list.len())));
            }
            let headers = list.iter().filter_map(|r| r.transform.as_ref()).filter_map(|t| t.headers.clone()).flatten();
            given.push((host.clone(), headers.collect::<Vec<_>>()));
        }
        let transforms = cordon_spec::Transforms::new(given).map_err(|e| ApiError::bad_request(format!("network.rules: {}", e.reason)))?;
        if transforms.is_empty() || internet == Some(false) {
            return Ok(p);
        }
        if app.sandboxes.egress_ca().is_none() {
            return Err(ApiError::bad_request("network.rules: this server cannot inject headers (no egress CA; see its log at start)"));
        }
        if let Some(missing) = transforms.secrets().into_iter().find(|s| app.secret_value(s).is_none()) {
            return Err(ApiError::bad_request(format!("network.rules: secret '{missing}' does not exist: create it first (Secret.create or POST /secrets)")));
        }
        p.transforms = transforms;
        Ok(p)
    }
}

fn timeout_from(t: Option<i64>, default: u64) -> Result<Duration, ApiError> {
    match t {
        None => Ok(Duration::from_secs(default)),
        Some(t) if t >= 0 && (t as u64) <= MAX_TIMEOUT_SECS => Ok(Duration::from_secs(t as u64)),
        Some(t) => Err(ApiError::bad_request(format!("timeout {t} is out of range: use 0 to {MAX_TIMEOUT_SECS} seconds"))),
    }
}

async fn create(app: &Arc<App>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let b: CreateBody = read_json(req, false).await?;
    create_sandbox(app, b).await
}

/// A create whose body was read already (a cluster's front door read it to place it).
pub(crate) async fn create_from(app: &Arc<App>, body: Bytes) -> Result<Response<Body>, ApiError> {
    create_sandbox(app, parse_json(&body, false)?).await
}

async fn create_sandbox(app: &Arc<App>, mut b: CreateBody) -> Result<Response<Body>, ApiError> {
    let template = b.template_id.clone().filter(|t| !t.is_empty()).unwrap_or_else(|| "base".to_string());
    // A snapshot (`<templateID>:default`, `name[:tag]`) starts a sandbox of its files, or one
    // restored from its memory on the tier and with the limits it was saved with.
    let mut resolved = app.sandboxes.saved.as_ref().and_then(|s| s.snapshots.resolve(&template));
    // On a cluster, a snapshot or template another node holds is copied here on its first use.
    if resolved.is_none() && crate::cluster::fetch_template(app, &template).await? {
        resolved = app.sandboxes.saved.as_ref().and_then(|s| s.snapshots.resolve(&template));
    }
    let restore = match resolved.as_ref().and_then(|r| r.memory.clone()) {
        Some((dir, (tier, cpus, memory, disk))) => {
            if b.tier.as_deref().is_some_and(|t| t != tier.as_str()) {
                return Err(ApiError::bad_request(format!("snapshot '{template}' keeps the memory of a {tier} sandbox: create it on the {tier} tier (or leave the tier out)")));
            }
            b.tier = Some(tier.as_str().to_string());
            (b.cpu_count, b.memory_mb, b.disk_mb) = (Some(cpus), Some(memory), Some(disk));
            Some(dir)
        }
        None => None,
    };
    let memory_image = resolved.as_ref().filter(|r| r.memory.is_some()).map(|r| r.image.clone());
    let snapshot = resolved.filter(|r| r.memory.is_none()).map(|r| r.image);
    let tier = match b.tier.as_deref() {
        None => cordon_spec::Tier::Ns,
        Some(t) => t.parse().map_err(|e: cordon_spec::SpecError| ApiError::bad_request(format!("tier: {}", e.reason)))?,
    };
    // A built template's name (`name`, `name:tag`) or id means the image of its build.
    let template = match &snapshot {
        Some(_) => template,
        None if restore.is_some() => template,
        None => app.templates.as_ref().and_then(|t| t.resolve(&template)).unwrap_or(template),
    };
    if snapshot.is_none() && restore.is_none() && cordon_image::validate_name(&template).is_err() {
        return Err(ApiError::bad_request(format!("template '{template}' is not a valid image name")));
    }
    let cpu_count = b.cpu_count.unwrap_or(DEFAULT_CPUS);
    if cpu_count == 0 || cpu_count > 1024 {
        return Err(ApiError::bad_request(format!("cpuCount {cpu_count} is out of range: use 1 to 1024")));
    }
    let memory_mb = b.memory_mb.unwrap_or(DEFAULT_MEMORY_MB);
    let disk_mb = b.disk_mb.unwrap_or(DEFAULT_DISK_MB);
    if memory_mb > 1 << 30 || disk_mb > 1 << 30 {
        return Err(ApiError::bad_request("memoryMB and diskSizeMB must be below 2^30"));
    }
    let limits = cordon_spec::Limits {
        memory_bytes: memory_mb << 20,
        cpus: cpu_count as f64,
        disk_bytes: disk_mb << 20,
        ..Default::default()
    };
    if let Err(e) = limits.validate() {
        let field = match e.field {
            "memory" => "memoryMB",
            "disk" => "diskSizeMB",
            "cpus" => "cpuCount",
            f => f,
        };
        return Err(ApiError::bad_request(format!("{field}: {}", e.reason)));
    }
    let env_vars = b.env_vars.unwrap_or_default();
    cordon_spec::validate_env_vars(env_vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .map_err(|e| ApiError::bad_request(format!("envVars: {}", e.reason)))?;
    let body = b.network.as_ref();
    let network = body.unwrap_or(&NetworkBody::default()).policy(app, b.allow_internet_access)?;
    app.sandboxes.check_network(tier, &network).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let traffic = match &b.network {
        Some(n) => crate::traffic::Traffic::new(n.allow_public_traffic, n.mask_request_host.clone())?,
        None => Default::default(),
    };
    let timeout = timeout_from(b.timeout, DEFAULT_TIMEOUT_SECS)?;
    let lifecycle = crate::pause::Lifecycle::from_create(b.auto_pause, b.auto_pause_memory, b.auto_resume.and_then(|a| a.enabled), timeout)?;
    if let Some(builds) = (snapshot.is_none() && restore.is_none()).then_some(app.builds.as_ref()).flatten() {
        builds.ready(&app.images, &template).await?;
    }
    let who = app.sandboxes.fresh_identity();
    // A sandbox of a snapshot runs on an image of its own over the snapshot's layers, so that
    // the snapshot can be deleted while the sandbox lives.
    let (image, own_image) = match (&snapshot, &app.sandboxes.saved) {
        (Some(snap), Some(saved)) => {
            let own = format!("{}{}-{}", crate::saved::OWN_PREFIX, who.id, crate::saved::unix_ms(SystemTime::now()));
            saved.own_copy(snap, &own).await?;
            (own.clone(), Some(own))
        }
        // A snapshot with memory restores onto its source's image.
        _ => (memory_image.unwrap_or_else(|| template.clone()), None),
    };
    let created = app
        .sandboxes
        .create_as(
            NewSandbox {
            tier,
            template,
            image,
            own_image: own_image.clone(),
            lifecycle,
            timeout,
            metadata: b.metadata.unwrap_or_default(),
            env_vars,
            cpu_count,
            memory_mb,
            disk_mb,
            network,
            traffic,
            restore,
            disk_from: None,
            volume_mounts: b.volume_mounts.unwrap_or_default(),
            },
            who,
        )
        .await;
    let entry = match (created, own_image, &app.sandboxes.saved) {
        (Ok(e), _, _) => e,
        (Err(err), Some(own), Some(saved)) => {
            saved.drop_image(&own).await;
            return Err(err);
        }
        (Err(err), _, _) => return Err(err),
    };
    Ok(json_response(StatusCode::CREATED, &sandbox_json(&entry, app.domain.as_deref())))
}

/// cordon's extension `GET /pools`: each warm pool's size, waiting and starting sandboxes,
/// hand-overs and misses, and the memory its waiting sandboxes use (see [`crate::pool`]).
fn pools(app: &Arc<App>) -> Response<Body> {
    let v = app.sandboxes.pools.get().map_or_else(|| json!({ "memoryBudgetBytes": 0, "pools": [] }), |p| p.json());
    json_response(StatusCode::OK, &v)
}

pub(crate) fn iso(t: SystemTime) -> String {
    Timestamp::from_system_time(t).to_rfc3339()
}

/// The `Sandbox` model (create/connect answers). `domain`: the server's `--domain`, from which
/// the SDKs build `<port>-<id>.<domain>` URLs (with none they fall back to E2B's own domain).
pub fn sandbox_json(e: &LiveSandbox, domain: Option<&str>) -> Value {
    json!({
        "templateID": e.template,
        "sandboxID": e.id,
        "clientID": "cordon",
        "alias": e.template,
        "envdVersion": e.envd_version,
        "envdAccessToken": e.token,
        "trafficAccessToken": e.traffic_token,
        "domain": domain,
    })
}

/// `SandboxDetail` / `ListedSandbox` of a live sandbox (running, or paused in place).
pub fn detail_json(e: &LiveSandbox, domain: Option<&str>) -> Value {
    let frozen = e.frozen_at();
    let mut v = json!({
        "templateID": e.template,
        "sandboxID": e.id,
        "clientID": "cordon",
        "alias": e.template,
        "startedAt": iso(e.started_at),
        // A paused sandbox's end is its pause.
        "endAt": iso(frozen.unwrap_or_else(|| e.end_at())),
        "envdVersion": e.envd_version,
        "envdAccessToken": e.token,
        "cpuCount": e.cpu_count,
        "memoryMB": e.memory_mb,
        "diskSizeMB": e.disk_mb,
        "tier": e.tier.as_str(),
        "state": if frozen.is_some() { "paused" } else { "running" },
        "metadata": e.metadata,
        "domain": domain,
        "lifecycle": e.lifecycle.to_json(),
        "network": network_json(&e.network(), &e.traffic),
        "volumeMounts": e.volume_mounts,
    });
    if frozen.is_some() {
        v["pauseMode"] = json!(crate::pause::PauseMode::Full.as_str());
    }
    v
}

/// `SandboxDetail` / `ListedSandbox` of a sandbox paused to its files.
pub fn saved_json(r: &crate::saved::Record, domain: Option<&str>) -> Value {
    json!({
        "templateID": r.template,
        "sandboxID": r.id,
        "clientID": "cordon",
        "alias": r.template,
        "startedAt": iso(r.started_at()),
        "endAt": iso(r.paused_at()),
        "envdVersion": r.envd_version,
        "envdAccessToken": r.token,
        "cpuCount": r.cpu_count,
        "memoryMB": r.memory_mb,
        "diskSizeMB": r.disk_mb,
        "tier": r.tier.as_str(),
        "state": "paused",
        "pauseMode": r.mode().as_str(),
        "metadata": r.metadata,
        "domain": domain,
        "lifecycle": r.lifecycle.to_json(),
        "network": network_json(&r.network, &crate::traffic::Traffic { public: r.public_traffic, mask_host: r.mask_host.clone() }),
        "volumeMounts": r.volume_mounts,
    })
}

/// The policy in force, in cordon's rule forms: an empty allowOut means no network at all,
/// whatever denyOut says; the open default shows as 0.0.0.0/0 and ::/0.
fn network_json(network: &cordon_spec::NetworkPolicy, traffic: &crate::traffic::Traffic) -> Value {
    json!({
        "default": if network.resolve_unlisted { "open" } else { "closed" },
        "allowOut": network.allow.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "denyOut": network.deny.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "allowPublicTraffic": traffic.public,
        "maskRequestHost": traffic.mask_host,
        // As stored: placeholders, never a secret's value.
        "rules": network.transforms.rules().map(|(host, headers)| {
            let h: serde_json::Map<String, Value> = headers.iter().map(|r| (r.name.clone(), Value::from(r.value.raw()))).collect();
            (host.to_string(), json!([{"transform": {"headers": h}}]))
        }).collect::<serde_json::Map<String, Value>>(),
    })
}

pub(crate) fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("sandbox {id} not found"))
}

fn detail(app: &Arc<App>, id: &str) -> Result<Response<Body>, ApiError> {
    if let Some(e) = app.sandboxes.get(id) {
        return Ok(json_response(StatusCode::OK, &detail_json(&e, app.domain.as_deref())));
    }
    let r = app.sandboxes.saved.as_ref().and_then(|s| s.get(id)).ok_or_else(|| not_found(id))?;
    Ok(json_response(StatusCode::OK, &saved_json(&r, app.domain.as_deref())))
}

async fn kill(app: &Arc<App>, id: &str) -> Result<Response<Body>, ApiError> {
    if !crate::pause::kill(&app.sandboxes, id).await {
        return Err(not_found(id));
    }
    Ok(empty(StatusCode::NO_CONTENT))
}

/// `SandboxPauseRequest`: `memory` (default true) keeps the processes; false keeps files only.
#[derive(Deserialize, Default)]
struct PauseBody {
    memory: Option<bool>,
    #[serde(rename = "requireHealthyGuest")]
    require_healthy_guest: Option<bool>,
}

async fn pause(app: &Arc<App>, id: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let b: PauseBody = read_json(req, true).await?;
    if b.require_healthy_guest == Some(true) {
        // A sandbox whose agent does not answer cannot be paused healthy.
        if let Some(e) = app.sandboxes.get(id).filter(|e| e.frozen_at().is_none()) {
            let healthy = cordon_envd::EnvdClient::new(e.socket.clone()).wait_healthy(Duration::from_secs(2)).await.is_ok();
            if !healthy {
                return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("sandbox {id}'s agent does not answer: it cannot be paused healthy")).no_retry());
            }
        }
    }
    crate::pause::pause(&app.sandboxes, id, b.memory.unwrap_or(true), false).await?;
    Ok(empty(StatusCode::NO_CONTENT))
}

/// The deprecated `POST /sandboxes/{id}/resume`: 201 once resumed, 409 when it runs.
async fn resume(app: &Arc<App>, id: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let b: ConnectBody = read_json(req, true).await?;
    if app.sandboxes.get(id).is_some_and(|e| e.frozen_at().is_none()) {
        return Err(ApiError::new(StatusCode::CONFLICT, format!("sandbox {id} is already running")).no_retry());
    }
    let timeout = timeout_from(b.timeout, DEFAULT_TIMEOUT_SECS)?;
    let (e, _) = crate::pause::resume(&app.sandboxes, id, timeout).await?;
    Ok(json_response(StatusCode::CREATED, &sandbox_json(&e, app.domain.as_deref())))
}

#[derive(Deserialize, Default)]
struct SnapshotBody {
    name: Option<String>,
    memory: Option<bool>,
}

async fn snapshot(app: &Arc<App>, id: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let b: SnapshotBody = read_json(req, true).await?;
    let v = crate::snapshots::create(&app.sandboxes, id, b.name.as_deref(), b.memory).await?;
    Ok(json_response(StatusCode::CREATED, &v))
}

fn snapshots(app: &Arc<App>, q: Option<&str>) -> Result<Response<Body>, ApiError> {
    let limit = parse_limit(q)?;
    let sandbox = query::get(q, "sandboxID").filter(|s| !s.is_empty());
    let name = query::get(q, "name").filter(|s| !s.is_empty());
    let after = query::get(q, "nextToken").filter(|s| !s.is_empty());
    let (items, next) = crate::snapshots::list(&app.sandboxes, sandbox.as_deref(), name.as_deref(), limit, after.as_deref());
    let mut r = json_response(StatusCode::OK, &Value::Array(items));
    if let Some(v) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        r.headers_mut().insert("x-next-token", v);
    }
    Ok(r)
}

#[derive(Deserialize, Default)]
struct ForkBody {
    timeout: Option<i64>,
    count: Option<i64>,
}

async fn fork(app: &Arc<App>, id: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let b: ForkBody = read_json(req, true).await?;
    let count = b.count.unwrap_or(1);
    let max = crate::fork::MAX_FORKS.min(app.sandboxes.max() as u32);
    if count < 1 || count > max as i64 {
        return Err(ApiError::bad_request(format!("count {count} is out of range: use 1 to {max}")));
    }
    let timeout = timeout_from(b.timeout, crate::fork::DEFAULT_FORK_TIMEOUT_SECS)?;
    let entries = crate::fork::fork(&app.sandboxes, id, count as u32, timeout, app.domain.as_deref()).await?;
    Ok(json_response(StatusCode::CREATED, &Value::Array(entries)))
}

fn parse_limit(q: Option<&str>) -> Result<usize, ApiError> {
    match query::get(q, "limit") {
        None => Ok(MAX_LIMIT),
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
            _ => Err(ApiError::bad_request(format!("limit {l:?} is out of range: use 1 to {MAX_LIMIT}"))),
        },
    }
}

fn empty(status: StatusCode) -> Response<Body> {
    let mut r = Response::new(crate::full(Bytes::new()));
    *r.status_mut() = status;
    r
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: i64,
}

async fn set_timeout(app: &Arc<App>, id: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let b: TimeoutBody = read_json(req, false).await?;
    let t = timeout_from(Some(b.timeout), 0)?;
    app.sandboxes.set_timeout(id, t).ok_or_else(|| not_found(id))?;
    Ok(empty(StatusCode::NO_CONTENT))
}

#[derive(Deserialize, Default)]
struct ConnectBody {
    timeout: Option<i64>,
}

/// Connect: a paused sandbox is resumed (201, for the timeout asked, E2B's 300 s default); a
/// running one's life is only ever extended (200).
async fn connect(app: &Arc<App>, id: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let b: ConnectBody = read_json(req, true).await?;
    let running = app.sandboxes.get(id).filter(|e| e.frozen_at().is_none());
    if let Some(e) = running {
        if let Some(t) = b.timeout {
            app.sandboxes.extend(id, timeout_from(Some(t), 0)?);
        }
        return Ok(json_response(StatusCode::OK, &sandbox_json(&e, app.domain.as_deref())));
    }
    let timeout = timeout_from(b.timeout, DEFAULT_TIMEOUT_SECS)?;
    // The SDK's message for a 404 here speaks of a paused sandbox; ours says what happened.
    let (e, resumed) = crate::pause::resume(&app.sandboxes, id, timeout).await?;
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok(json_response(status, &sandbox_json(&e, app.domain.as_deref())))
}

/// E2B's metrics: the samples inside `start..=end` (unix seconds, both optional), oldest first;
/// see [`crate::metrics`] for the resolution and what is kept.
fn metrics(app: &Arc<App>, id: &str, q: Option<&str>) -> Result<Response<Body>, ApiError> {
    let bound = |key: &str| -> Result<Option<i64>, ApiError> {
        query::get(q, key)
            .filter(|v| !v.is_empty())
            .map(|v| v.parse::<i64>().map_err(|_| ApiError::bad_request(format!("{key} {v:?} is not a time in unix seconds"))))
            .transpose()
    };
    let (start, end) = (bound("start")?, bound("end")?);
    if let (Some(s), Some(e)) = (start, end) {
        if s > e {
            return Err(ApiError::bad_request(format!("start {s} is after end {e}")));
        }
    }
    let e = app.sandboxes.get(id).ok_or_else(|| not_found(id))?;
    Ok(json_response(StatusCode::OK, &Value::Array(crate::metrics::samples(&e, start, end))))
}

/// Most ids one `GET /sandboxes/metrics` takes.
const MAX_METRICS_IDS: usize = 100;

/// `sandbox_ids` of `GET /sandboxes/metrics`: required, comma-joined, at most 100, unique.
pub(crate) fn metrics_ids(q: Option<&str>) -> Result<Vec<String>, ApiError> {
    let raw = query::get(q, "sandbox_ids").unwrap_or_default();
    let ids: Vec<String> = raw.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect();
    if ids.is_empty() {
        return Err(ApiError::bad_request("sandbox_ids is required: give the sandboxes' ids, comma-separated"));
    }
    if ids.len() > MAX_METRICS_IDS {
        return Err(ApiError::bad_request(format!("sandbox_ids names {} sandboxes: give at most {MAX_METRICS_IDS}", ids.len())));
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = ids.iter().find(|i| !seen.insert(*i)) {
        return Err(ApiError::bad_request(format!("sandbox_ids names {dup} twice: give each once")));
    }
    Ok(ids)
}

/// The latest `SandboxMetric` of each of `ids` that runs here, by id (the others are left out,
/// as E2B leaves out the ones it does not find).
pub(crate) fn metrics_of(app: &Arc<App>, ids: &[String]) -> serde_json::Map<String, Value> {
    ids.iter()
        .filter_map(|id| app.sandboxes.get(id))
        .filter_map(|e| crate::metrics::samples(&e, None, None).pop().map(|m| (e.id.clone(), m)))
        .collect()
}

/// cordon's extension: what the sandbox's filters refused so far (syscalls and network
/// attempts), and the headers its egress rules injected (counts, never values).
fn audit(app: &Arc<App>, id: &str) -> Result<Response<Body>, ApiError> {
    let e = app.sandboxes.get(id).ok_or_else(|| not_found(id))?;
    Ok(json_response(
        StatusCode::OK,
        &json!({"sandboxID": e.id, "deniedSyscalls": e.denials(), "blockedConnections": e.blocked(), "injectedHeaders": e.injected()}),
    ))
}

/// E2B's logs: what the sandbox's start command printed (see [`crate::sandbox_logs`]). A
/// sandbox paused to its files has none kept.
fn logs(app: &Arc<App>, id: &str, v2: bool, q: Option<&str>) -> Result<Response<Body>, ApiError> {
    let kept = match app.sandboxes.get(id) {
        Some(e) => e.logs.clone(),
        None if app.sandboxes.saved.as_ref().and_then(|s| s.get(id)).is_some() => Default::default(),
        None => return Err(not_found(id)),
    };
    Ok(json_response(StatusCode::OK, &crate::sandbox_logs::answer(&kept, v2, q)?))
}

/// cordon's extension: the sandbox's isolation report, checked from inside with `verify`.
async fn isolation(app: &Arc<App>, id: &str, verify: bool) -> Result<Response<Body>, ApiError> {
    let e = app.sandboxes.get(id).ok_or_else(|| not_found(id))?;
    let v = if verify { crate::isolation::verified(&e).await? } else { crate::isolation::report(&e).await? };
    Ok(json_response(StatusCode::OK, &v))
}

/// E2B's `update_network`: the new rules replace the old for new connections (an empty body
/// is the server's default again: open or closed). A sandbox
/// created without network rules has no interface to open, so it is refused rather than
/// pretending.
async fn update_network(app: &Arc<App>, id: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let b: NetworkBody = read_json(req, true).await?;
    let policy = b.policy(app, b.allow_internet_access)?;
    let e = app.sandboxes.get(id).ok_or_else(|| not_found(id))?;
    e.set_network(policy).map_err(|m| ApiError::new(StatusCode::CONFLICT, m.to_string()).no_retry())?;
    app.sandboxes.persist(&e);
    Ok(empty(StatusCode::NO_CONTENT))
}

/// `Template.exists(name)`: 200 with the template's id for every image in the store and every
/// built-in recipe (built on first use), 404 for anything else. The name arrives
/// percent-encoded; the template's id is its name, as in the create answer.
/// The template builds, or why there are none.
fn templates(app: &Arc<App>) -> Result<&Arc<crate::templates::Templates>, ApiError> {
    app.templates.as_ref().ok_or_else(|| ApiError::new(StatusCode::NOT_IMPLEMENTED, "template builds are not enabled on this server").no_retry())
}

/// This server's URL as the client reached it (for the upload URLs it hands out).
fn self_url(app: &Arc<App>, req: &Request<Incoming>) -> String {
    let host = req.headers().get(hyper::header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("localhost");
    format!("{}://{host}", if app.tls.is_some() { "https" } else { "http" })
}

fn template_alias(app: &Arc<App>, alias: &str) -> Result<Response<Body>, ApiError> {
    let name = query::percent_decode(alias, false);
    if let Some(id) = app.templates.as_ref().and_then(|t| t.alias(&name)) {
        return Ok(json_response(StatusCode::OK, &json!({"templateID": id, "public": false})));
    }
    match cordon_sandbox::image::exists(&app.images, &name) {
        Ok(true) => Ok(json_response(StatusCode::OK, &json!({"templateID": name, "public": false}))),
        Ok(false) => Err(ApiError::not_found(format!("template '{name}' not found"))),
        Err(e) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("template '{name}': {e}"))),
    }
}

/// One sandbox of a list, running or paused (in place or to its files).
struct Listed {
    started_at: SystemTime,
    id: String,
    template: String,
    metadata: BTreeMap<String, String>,
    paused: bool,
    json: Value,
}

impl Listed {
    /// Page position: start time, ties broken by id, so that a token names a stable position.
    /// Pages run newest first unless the caller asks for `order=asc` (E2B's default is desc).
    fn sort_key(&self) -> (u128, String) {
        (self.started_at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()), self.id.clone())
    }
}

fn list(app: &Arc<App>, q: Option<&str>) -> Result<Response<Body>, ApiError> {
    let page = list_page(app, q)?;
    let token = page.items.last().filter(|_| page.more).map(|(k, _)| position_token(k));
    let body: Vec<Value> = page.items.into_iter().map(|(_, v)| v).collect();
    let mut r = json_response(StatusCode::OK, &Value::Array(body));
    if let Some(v) = token.and_then(|t| HeaderValue::from_str(&t).ok()) {
        r.headers_mut().insert("x-next-token", v);
    }
    Ok(r)
}

/// A listed sandbox with its position in the list: start time (ns since the epoch), then id.
pub(crate) type Positioned = ((u128, String), Value);

/// One page of `GET /sandboxes` on this server.
pub(crate) struct Page {
    pub items: Vec<Positioned>,
    /// More items follow the page.
    pub more: bool,
    pub limit: usize,
    pub ascending: bool,
}

/// A position as a `nextToken` (`<start ns>_<id>`).
pub(crate) fn position_token(p: &(u128, String)) -> String {
    format!("{}_{}", p.0, p.1)
}

/// A position as a `nextToken` gives it (see [`position_token`]).
pub(crate) fn parse_position(t: &str) -> Option<(u128, String)> {
    t.split_once('_').and_then(|(n, id)| Some((n.parse::<u128>().ok()?, id.to_string())))
}

/// This server's page of `GET /sandboxes` for query `q`.
pub(crate) fn list_page(app: &Arc<App>, q: Option<&str>) -> Result<Page, ApiError> {
    let filter = match query::get(q, "metadata") {
        Some(m) => query::metadata_filter(&m).map_err(ApiError::bad_request)?,
        None => Vec::new(),
    };
    // `state` may come comma-joined or repeated, depending on the client.
    let states: Vec<String> = query::pairs(q).into_iter().filter(|(k, _)| k == "state").map(|(_, v)| v).collect();
    let states: Vec<&str> = states.iter().flat_map(|s| s.split(',')).map(str::trim).filter(|s| !s.is_empty()).collect();
    if let Some(bad) = states.iter().find(|s| !matches!(**s, "running" | "paused")) {
        return Err(ApiError::bad_request(format!("state '{bad}' is unknown: use running or paused")));
    }
    // No state: both, as on E2B.
    let want_running = states.is_empty() || states.contains(&"running");
    let want_paused = states.is_empty() || states.contains(&"paused");
    let limit = parse_limit(q)?;
    let after = match query::get(q, "nextToken").filter(|t| !t.is_empty()) {
        None => None,
        Some(t) => {
            let parsed = parse_position(&t);
            Some(parsed.ok_or_else(|| ApiError::bad_request(format!("nextToken {t:?} is not one this server issued")))?)
        }
    };
    let ascending = match query::get(q, "order").as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(o) => return Err(ApiError::bad_request(format!("order {o:?} is unknown: use asc or desc"))),
    };
    let template = query::get(q, "template");
    let started_after = match query::get(q, "startedAfter") {
        None => None,
        Some(t) => Some(
            Timestamp::parse_rfc3339(&t)
                .map_err(|e| ApiError::bad_request(format!("startedAfter {t:?} is not an ISO 8601 time: {e}")))?
                .to_system_time(),
        ),
    };
    let domain = app.domain.as_deref();
    let mut items: Vec<Listed> = app
        .sandboxes
        .all()
        .iter()
        .map(|e| Listed {
            started_at: e.started_at,
            id: e.id.clone(),
            template: e.template.clone(),
            metadata: e.metadata.clone(),
            paused: e.frozen_at().is_some(),
            json: detail_json(e, domain),
        })
        .collect();
    if let Some(saved) = &app.sandboxes.saved {
        items.extend(saved.all().iter().map(|r| Listed {
            started_at: r.started_at(),
            id: r.id.clone(),
            template: r.template.clone(),
            metadata: r.metadata.clone(),
            paused: true,
            json: saved_json(r, domain),
        }));
    }
    items.retain(|e| if e.paused { want_paused } else { want_running });
    items.retain(|e| filter.iter().all(|(k, v)| e.metadata.get(k) == Some(v)));
    if let Some(t) = &template {
        items.retain(|e| &e.template == t);
    }
    if let Some(t) = started_after {
        items.retain(|e| e.started_at >= t);
    }
    items.sort_by_key(Listed::sort_key);
    if ascending {
        if let Some(a) = &after {
            items.retain(|e| e.sort_key() > *a);
        }
    } else {
        items.reverse();
        if let Some(a) = &after {
            items.retain(|e| e.sort_key() < *a);
        }
    }
    let more = items.len() > limit;
    items.truncate(limit);
    let items = items.into_iter().map(|e| (e.sort_key(), e.json)).collect();
    Ok(Page { items, more, limit, ascending })
}
