//! A cluster node's front door: every node answers the whole API, and a request for a sandbox
//! another node owns goes to that node, unchanged, streamed both ways.
//!
//! - A sandbox's requests (control plane `/sandboxes/<id>/...`, and its data plane: envd,
//!   files, ports, websockets) go to the node its id names ([`cordon_cluster::node_of`]): no
//!   store is asked per request. A node missing from the members' view, or one that does not
//!   take the connection, answers as E2B does for a missing sandbox, at once.
//! - A create goes to the node [`cordon_cluster::placement`] picks; a node that refuses it (full,
//!   failing, gone, without the template) passes it to the next, so a create succeeds while any
//!   node has room.
//! - A list asks every node for its page after the same position and merges them: the position
//!   (start time, then id) is global, so the next page's token works on any node.
//!
//! A request one node sends another carries [`HOP_HEADER`]: the receiver serves it itself,
//! whatever its view says, so two nodes whose views differ for a moment never bounce a request
//! between them. The client's API key goes along and is checked by the node that serves it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cordon_cluster::placement::Want;
use cordon_cluster::{Cluster, NodeInfo};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, HOST};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpStream;

use crate::error::{json_response, sandbox_not_found, ApiError};
use crate::routes::Route;
use crate::{App, Body};

/// Marks a request one node passed to another.
pub const HOP_HEADER: &str = "x-cordon-hop";

/// The cluster's own endpoints (nodes, drains, a node's page of a list).
pub const PREFIX: &str = "/cluster/v1";

/// How long a node has to take a connection before it counts as gone.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a node has to answer its part of a list.
const FAN_OUT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the front door does with a request: answers it, or hands it back for this node to serve.
pub async fn route(app: &Arc<App>, cluster: &Arc<Cluster>, route: &Route, req: Request<Incoming>) -> Result<Response<Body>, Request<Incoming>> {
    let path = req.uri().path().trim_end_matches('/').to_string();
    if path.starts_with(PREFIX) {
        return Ok(endpoints(app, cluster, &path, req).await.unwrap_or_else(ApiError::into_response));
    }
    if req.headers().contains_key(HOP_HEADER) {
        return Err(req);
    }
    // Old SDKs send the access token alone after a connect: the token names the owner too.
    if let Route::ByToken(token) = route {
        return match cordon_cluster::ids::node_of_token(token).filter(|n| !cluster.is_self(n)).and_then(|n| cluster.node(n)) {
            Some(node) => Ok(forward(&node.url, req).await.unwrap_or_else(|e| ApiError::new(StatusCode::BAD_GATEWAY, format!("the sandbox's node did not take the request: {e}")).into_response())),
            None => Err(req),
        };
    }
    let id = match route {
        Route::Sandbox { id, .. } => id.clone(),
        Route::Api => {
            let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
            let segs = segs.strip_prefix(&["v2"]).unwrap_or(&segs);
            match (req.method(), segs) {
                (&Method::POST, ["sandboxes"]) => return Ok(create(app, cluster, req).await.unwrap_or_else(ApiError::into_response)),
                (&Method::GET, ["sandboxes"]) => return Ok(list(app, cluster, req).await.unwrap_or_else(ApiError::into_response)),
                (&Method::GET, ["sandboxes", "metrics"]) => return Ok(metrics(app, cluster, req).await.unwrap_or_else(ApiError::into_response)),
                // A snapshot may have been copied to other nodes: it goes from all of them.
                (&Method::DELETE, ["templates", _]) => return Ok(everywhere(app, cluster, req).await.unwrap_or_else(ApiError::into_response)),
                (_, ["sandboxes", id, ..]) => id.to_string(),
                _ => return Err(req),
            }
        }
        Route::ByToken(_) | Route::Invalid(_) => return Err(req),
    };
    let Some(owner) = cordon_cluster::node_of(&id) else { return Err(req) };
    if cluster.is_self(owner) {
        return Err(req);
    }
    let data_plane = matches!(route, Route::Sandbox { .. });
    let gone = |id: &str| if data_plane { sandbox_not_found(id) } else { crate::api::not_found(id).into_response() };
    let Some(node) = cluster.node(owner) else { return Ok(gone(&id)) };
    match forward(&node.url, req).await {
        Ok(r) => Ok(r),
        Err(e) => {
            tracing::info!(sandbox_id = %id, node = %node.name, "cluster: the owner did not take the request: {e}");
            Ok(gone(&id))
        }
    }
}

/// `POST /sandboxes` on a cluster: placed, and passed on until a node takes it.
async fn create(app: &Arc<App>, cluster: &Arc<Cluster>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    crate::auth::check_api_key(req.headers(), &app.api_key)?;
    let (parts, body) = req.into_parts();
    let body = crate::api::read_body(body).await?;
    let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    let template = v.get("templateID").and_then(Value::as_str).filter(|t| !t.is_empty()).unwrap_or("base");
    let memory = v.get("memoryMB").and_then(Value::as_u64).unwrap_or(crate::api::DEFAULT_MEMORY_MB) << 20;
    let want = Want { template, tier: v.get("tier").and_then(Value::as_str), memory };
    let nodes = cluster.placement(&want);
    if nodes.is_empty() {
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no node of the cluster can take a sandbox now (all full, drained, or without this tier): add a node or retry"));
    }
    let mut last: Option<Response<Body>> = None;
    for node in &nodes {
        let answer = if cluster.is_self(&node.name) {
            // This node's own share needs no connection.
            Ok(crate::api::create_from(app, body.clone()).await.unwrap_or_else(ApiError::into_response))
        } else {
            forward(&node.url, Request::from_parts(parts.clone(), Full::new(body.clone()))).await
        };
        match answer {
            Ok(resp) if !refused(resp.status()) => {
                if resp.status().is_success() {
                    cluster.note_placed(&node.name, want.memory);
                }
                return Ok(resp);
            }
            Ok(resp) => {
                tracing::info!(node = %node.name, status = %resp.status(), "cluster: a node refused a create: trying the next");
                last = Some(resp);
            }
            Err(e) => tracing::info!(node = %node.name, "cluster: a node did not take a create ({e}): trying the next"),
        }
    }
    Ok(last.unwrap_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no node of the cluster took the sandbox: retry").into_response()))
}

/// Answers another node may not give. A node's lack of room or its failure is tried elsewhere,
/// and so is a 400 or 404: a node answers those for a template it does not hold (a snapshot's
/// `id:tag` is not even an image name there), and the holder may be missing from this node's
/// view for the second it takes to read a new publication. A request that is bad everywhere
/// costs one quick answer per node. The key was checked already.
fn refused(s: StatusCode) -> bool {
    !s.is_success() && !s.is_informational() && s != StatusCode::UNAUTHORIZED
}

/// `GET /sandboxes` on a cluster: every node's page after the same position, merged.
async fn list(app: &Arc<App>, cluster: &Arc<Cluster>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    crate::auth::check_api_key(req.headers(), &app.api_key)?;
    let q = req.uri().query().map(str::to_string);
    let local = crate::api::list_page(app, q.as_deref())?;
    let (limit, ascending) = (local.limit, local.ascending);
    let mut items = local.items;
    let mut more = local.more;
    let peers: Vec<NodeInfo> = cluster.nodes().into_iter().filter(|n| !cluster.is_self(&n.name)).collect();
    let path = format!("{PREFIX}/sandboxes{}", q.as_deref().map(|q| format!("?{q}")).unwrap_or_default());
    let asks = peers.iter().map(|n| {
        let path = path.clone();
        async move { tokio::time::timeout(FAN_OUT_TIMEOUT, page_of(app, &n.url, path)).await.map_err(|_| "no answer in time".to_string()).and_then(|r| r) }
    });
    for (n, got) in peers.iter().zip(futures_util::future::join_all(asks).await) {
        match got {
            Ok((page, m)) => {
                items.extend(page);
                more |= m;
            }
            Err(e) => tracing::warn!(node = %n.name, "cluster: a node's sandboxes are left out of a list: {e}"),
        }
    }
    items.sort_by(|a, b| a.0.cmp(&b.0));
    if !ascending {
        items.reverse();
    }
    more |= items.len() > limit;
    items.truncate(limit);
    let token = items.last().filter(|_| more).map(|(k, _)| crate::api::position_token(k));
    let mut r = json_response(StatusCode::OK, &Value::Array(items.into_iter().map(|(_, v)| v).collect()));
    if let Some(v) = token.and_then(|t| HeaderValue::from_str(&t).ok()) {
        r.headers_mut().insert("x-next-token", v);
    }
    Ok(r)
}

/// `GET /sandboxes/metrics?sandbox_ids=...` on a cluster: each owner asked for its own, merged.
async fn metrics(app: &Arc<App>, cluster: &Arc<Cluster>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    crate::auth::check_api_key(req.headers(), &app.api_key)?;
    let ids = crate::api::metrics_ids(req.uri().query())?;
    let mut merged = crate::api::metrics_of(app, &ids);
    let mut by_node: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for id in &ids {
        if let Some(n) = cordon_cluster::node_of(id).filter(|n| !cluster.is_self(n)) {
            by_node.entry(n.to_string()).or_default().push(id.clone());
        }
    }
    let asks = by_node.into_iter().filter_map(|(n, ids)| cluster.node(&n).map(|node| (node, ids))).map(|(node, ids)| async move {
        let got = tokio::time::timeout(FAN_OUT_TIMEOUT, peer_json(app, &node.url, format!("/sandboxes/metrics?sandbox_ids={}", ids.join(",")))).await;
        (node.name, got)
    });
    for (name, got) in futures_util::future::join_all(asks).await {
        match got {
            Ok(Ok(Some(v))) => merged.extend(v.get("sandboxes").and_then(Value::as_object).cloned().unwrap_or_default()),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => tracing::warn!(node = %name, "cluster: a node's metrics are left out: {e}"),
            Err(_) => tracing::warn!(node = %name, "cluster: a node's metrics are left out: no answer in time"),
        }
    }
    Ok(json_response(StatusCode::OK, &json!({ "sandboxes": merged })))
}

/// A request every node serves (this one through its own door too): the first success is the
/// answer, else this node's own.
async fn everywhere(app: &Arc<App>, cluster: &Arc<Cluster>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    crate::auth::check_api_key(req.headers(), &app.api_key)?;
    let (parts, body) = req.into_parts();
    let body = crate::api::read_body(body).await?;
    let nodes = cluster.nodes();
    let sends = nodes.iter().map(|n| {
        let r = Request::from_parts(parts.clone(), Full::new(body.clone()));
        async move { tokio::time::timeout(FAN_OUT_TIMEOUT, forward(&n.url, r)).await }
    });
    let mut mine = None;
    let mut ok = None;
    for (n, got) in nodes.iter().zip(futures_util::future::join_all(sends).await) {
        match got {
            Ok(Ok(r)) if r.status().is_success() && ok.is_none() => ok = Some(r),
            Ok(Ok(r)) if cluster.is_self(&n.name) => mine = Some(r),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(node = %n.name, "cluster: a node did not take a request meant for all: {e}"),
            Err(_) => tracing::warn!(node = %n.name, "cluster: a node did not answer a request meant for all in time"),
        }
    }
    ok.or(mine).ok_or_else(|| ApiError::new(StatusCode::BAD_GATEWAY, "no node of the cluster answered: retry"))
}

/// One node's page (`path`: its `/cluster/v1/sandboxes` with the list's query): `(position,
/// item)` pairs and whether it has more.
async fn page_of(app: &App, url: &str, path: String) -> Result<(Vec<crate::api::Positioned>, bool), String> {
    let v = peer_json(app, url, path).await?.ok_or("404: it serves no cluster pages")?;
    let mut out = Vec::new();
    for it in v.get("items").and_then(Value::as_array).into_iter().flatten() {
        let key = it.get("position").and_then(Value::as_str).and_then(crate::api::parse_position).ok_or("an item without its position")?;
        out.push((key, it.get("sandbox").cloned().unwrap_or(Value::Null)));
    }
    Ok((out, v.get("more").and_then(Value::as_bool).unwrap_or(false)))
}

/// `/cluster/v1/...`: the members, drains, and this node's own page of a list.
async fn endpoints(app: &Arc<App>, cluster: &Arc<Cluster>, path: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    crate::auth::check_api_key(req.headers(), &app.api_key)?;
    let rest = &path[PREFIX.len()..];
    let segs: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
    match (req.method(), segs.as_slice()) {
        (&Method::GET, ["nodes"]) => Ok(json_response(StatusCode::OK, &json!(cluster.nodes()))),
        (m @ (&Method::POST | &Method::DELETE), ["nodes", name, "drain"]) => {
            if cluster.node(name).is_none() && *m == Method::POST {
                return Err(ApiError::not_found(format!("node {name} is not a live member of the cluster: see GET {PREFIX}/nodes")));
            }
            cluster.set_drain(name, *m == Method::POST).await.map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("cannot record the drain in etcd: {e}")))?;
            Ok(json_response(StatusCode::OK, &json!(cluster.node(name))))
        }
        (&Method::GET, ["snapshots", reference]) => snapshot_for_copy(app, &crate::query::percent_decode(reference, false)).await,
        (&Method::GET, ["templates", reference]) => template_for_copy(app, &crate::query::percent_decode(reference, false)).await,
        (&Method::GET, ["layers", diff_id]) => send_layer(app, diff_id),
        (&Method::GET, ["sandboxes"]) => {
            let page = crate::api::list_page(app, req.uri().query())?;
            let items: Vec<Value> = page.items.into_iter().map(|(k, v)| json!({ "position": crate::api::position_token(&k), "sandbox": v })).collect();
            Ok(json_response(StatusCode::OK, &json!({ "items": items, "more": page.more })))
        }
        _ => Err(ApiError::not_found(format!("no such cluster endpoint: {path}"))),
    }
}

/// `GET /cluster/v1/snapshots/<reference>`: a snapshot's record and its image's metadata, for
/// a node that copies it. Its layers are the image's own, as diff_ids of this node's store.
async fn snapshot_for_copy(app: &Arc<App>, reference: &str) -> Result<Response<Body>, ApiError> {
    let saved = app.sandboxes.saved.as_ref().ok_or_else(|| ApiError::not_found("this node keeps no snapshots"))?;
    let snap = saved.snapshots.find(reference).ok_or_else(|| ApiError::not_found(format!("no snapshot {reference} on this node")))?;
    if snap.memory.is_some() {
        return Err(ApiError::new(StatusCode::CONFLICT, format!("snapshot {reference} keeps a sandbox's memory: it starts sandboxes on its own node only")));
    }
    let meta = layered_meta(app, &snap.image).await?;
    Ok(json_response(StatusCode::OK, &json!({ "snapshot": snap, "meta": meta })))
}

/// `GET /cluster/v1/templates/<reference>`: a built template's record (its ready builds) and
/// their images' metadata, for a node that copies it.
async fn template_for_copy(app: &Arc<App>, reference: &str) -> Result<Response<Body>, ApiError> {
    let (id, record, images) = app.templates.as_ref().and_then(|t| t.export(reference)).ok_or_else(|| ApiError::not_found(format!("no built template {reference} on this node")))?;
    let mut metas = serde_json::Map::new();
    for image in images {
        let meta = layered_meta(app, &image).await?;
        metas.insert(image, serde_json::to_value(meta).expect("serializes"));
    }
    Ok(json_response(StatusCode::OK, &json!({ "id": id, "record": record, "metas": metas })))
}

/// Image `name`'s metadata with its layers listed (a one-tree image's tree made a layer once).
async fn layered_meta(app: &Arc<App>, name: &str) -> Result<cordon_image::ImageMeta, ApiError> {
    let (store, name) = (app.images.clone(), name.to_string());
    tokio::task::spawn_blocking(move || {
        let image = store.get(&name).map_err(|e| ApiError::not_found(e.to_string()))?;
        let mut meta = image.meta.clone();
        meta.layers = store.layer_ids(&image, &mut cordon_image::NoProgress).map_err(|e| ApiError::internal(e.to_string()))?;
        Ok(meta)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
}

/// `GET /cluster/v1/layers/<diff_id>`: a layer of this node's store as a tar, streamed as it is
/// written.
fn send_layer(app: &Arc<App>, diff_id: &str) -> Result<Response<Body>, ApiError> {
    if app.images.layer_path(diff_id).is_none() {
        return Err(ApiError::not_found(format!("no layer {diff_id} on this node")));
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let (store, id) = (app.images.clone(), diff_id.to_string());
    // A failed write ends the stream early: the receiver's unpack then fails on a short tar.
    tokio::task::spawn_blocking(move || {
        if let Err(e) = store.send_layer(&id, ChannelWriter { tx }) {
            tracing::warn!(layer = %id, "cluster: sending a layer to another node stopped: {e}");
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, hyper::Error>(hyper::body::Frame::data(b)), rx)) });
    let mut r = Response::new(BodyExt::boxed(http_body_util::StreamBody::new(stream)));
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, HeaderValue::from_static("application/x-tar"));
    Ok(r)
}

/// The tar writer's end of a streamed layer.
struct ChannelWriter {
    tx: tokio::sync::mpsc::Sender<Bytes>,
}

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tx.blocking_send(Bytes::copy_from_slice(buf)).map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the receiving node hung up"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The unpacking end of a layer arriving from another node.
struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<Bytes>,
    chunk: Bytes,
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.chunk.is_empty() {
            match self.rx.blocking_recv() {
                Some(b) => self.chunk = b,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len());
        buf[..n].copy_from_slice(&self.chunk[..n]);
        bytes::Buf::advance(&mut self.chunk, n);
        Ok(n)
    }
}

/// One node copies templates at a time: two creates of a new one fetch it once.
static FETCHING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Copies template `reference` (a snapshot, or a template built through the API) from a node
/// that holds it, on its first use here: its record, and the layers of its images this node
/// lacks, by content digest (a layer this store has under the same diff_id is not sent again).
/// True when it is here now; false when no other node holds it. Nothing is named before every
/// layer has arrived whole.
pub(crate) async fn fetch_template(app: &Arc<App>, reference: &str) -> Result<bool, ApiError> {
    let Some(cluster) = app.cluster.get() else { return Ok(false) };
    let holders: Vec<NodeInfo> = cluster.nodes().into_iter().filter(|n| !cluster.is_self(&n.name) && n.templates.iter().any(|t| t == reference)).collect();
    if holders.is_empty() {
        return Ok(false);
    }
    // Most creates name what every node has (`base`): nothing to copy, and no lock taken.
    if held_here(app, reference) {
        return Ok(true);
    }
    let _one = FETCHING.lock().await;
    if held_here(app, reference) {
        return Ok(true);
    }
    let mut last = String::new();
    for node in &holders {
        match copy_from(app, &node.url, reference).await {
            Ok(kind) => {
                tracing::info!(template = %reference, node = %node.name, kind, "cluster: copied from its node");
                return Ok(true);
            }
            Err(e) => {
                tracing::warn!(template = %reference, node = %node.name, "cluster: cannot copy: {e}");
                last = format!("{}: {e}", node.name);
            }
        }
    }
    Err(ApiError::new(StatusCode::BAD_GATEWAY, format!("template {reference} is on other nodes, and none gave a copy ({last}): retry, or create it through its node")))
}

/// Whether a create of `reference` finds it here: a snapshot, a built template or an image.
fn held_here(app: &App, reference: &str) -> bool {
    app.sandboxes.saved.as_ref().is_some_and(|s| s.snapshots.find(reference).is_some())
        || app.templates.as_ref().is_some_and(|t| t.resolve(reference).is_some())
        || cordon_sandbox::image::lookup(&app.images, reference).is_ok()
}

/// A GET to another node with this cluster's key.
fn peer_get(app: &App, path: String) -> Request<Full<Bytes>> {
    let mut r = Request::builder().method(Method::GET).uri(path).body(Full::new(Bytes::new())).expect("a valid request");
    if let Ok(v) = HeaderValue::from_str(&app.api_key) {
        r.headers_mut().insert("x-api-key", v);
    }
    r
}

/// The JSON a node answers `path` with; `Ok(None)` for its 404.
async fn peer_json(app: &App, url: &str, path: String) -> Result<Option<Value>, String> {
    let resp = forward(url, peer_get(app, path)).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    match status {
        StatusCode::NOT_FOUND => Ok(None),
        s if s.is_success() => serde_json::from_slice(&body).map(Some).map_err(|e| format!("an answer this version does not read: {e}")),
        s => Err(format!("{s}: {}", String::from_utf8_lossy(&body))),
    }
}

/// Copies `reference` from the node at `url`: a snapshot if it is one there, else a built
/// template. Returns which.
async fn copy_from(app: &Arc<App>, url: &str, reference: &str) -> Result<&'static str, String> {
    let encoded: String = reference.bytes().map(|b| if b.is_ascii_alphanumeric() || b"-_.".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") }).collect();
    let hold = {
        let store = app.images.clone();
        tokio::task::spawn_blocking(move || store.hold_layers()).await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?
    };
    if let Some(v) = peer_json(app, url, format!("{PREFIX}/snapshots/{encoded}")).await? {
        let saved = app.sandboxes.saved.as_ref().ok_or("this node keeps no snapshots")?;
        let snapshot: crate::snapshots::Snapshot = serde_json::from_value(v["snapshot"].clone()).map_err(|e| e.to_string())?;
        let meta: cordon_image::ImageMeta = serde_json::from_value(v["meta"].clone()).map_err(|e| e.to_string())?;
        copy_image(app, url, &snapshot.image, meta).await?;
        drop(hold);
        saved.snapshots.add_copy(snapshot).map_err(|e| e.message)?;
        return Ok("snapshot");
    }
    let v = peer_json(app, url, format!("{PREFIX}/templates/{encoded}")).await?.ok_or("it holds neither a snapshot nor a built template of that name now")?;
    let templates = app.templates.as_ref().ok_or("this node keeps no templates")?;
    let id = v["id"].as_str().ok_or("a template without its id")?.to_string();
    for (image, meta) in v["metas"].as_object().into_iter().flatten() {
        let meta: cordon_image::ImageMeta = serde_json::from_value(meta.clone()).map_err(|e| e.to_string())?;
        copy_image(app, url, image, meta).await?;
    }
    drop(hold);
    templates.add_copy(&id, v["record"].clone()).map_err(|e| e.message)?;
    Ok("template")
}

/// Brings image `name` here: the layers of `meta` this store lacks, each streamed from the node
/// at `url` into the store's unpack, then the image named over them.
async fn copy_image(app: &Arc<App>, url: &str, name: &str, mut meta: cordon_image::ImageMeta) -> Result<(), String> {
    let store = app.images.clone();
    let mut layers = Vec::with_capacity(meta.layers.len());
    for id in &meta.layers {
        if store.layer_path(id).is_some() {
            layers.push(id.clone());
            continue;
        }
        let resp = forward(url, peer_get(app, format!("{PREFIX}/layers/{id}"))).await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("layer {id}: {}", resp.status()));
        }
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
        let unpack = {
            let store = store.clone();
            tokio::task::spawn_blocking(move || store.receive_layer(ChannelReader { rx, chunk: Bytes::new() }))
        };
        let mut body = resp.into_body();
        let mut cut = None;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => {
                    if let Ok(data) = f.into_data() {
                        if tx.send(data).await.is_err() {
                            break; // the unpack stopped: its error says why
                        }
                    }
                }
                Err(e) => {
                    cut = Some(e.to_string());
                    break;
                }
            }
        }
        drop(tx);
        let got = unpack.await.map_err(|e| e.to_string())?;
        if let Some(e) = cut {
            return Err(format!("layer {id} was cut off: {e}"));
        }
        layers.push(got.map_err(|e| e.to_string())?);
    }
    meta.layers = layers;
    meta.recipe = None;
    let name = name.to_string();
    tokio::task::spawn_blocking(move || store.commit(&name, meta, &mut cordon_image::NoProgress).map(drop).map_err(|e| e.to_string())).await.map_err(|e| e.to_string())?
}

/// Why a request could not be passed to a node.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("connect to {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("{0} took no connection in {1:?}")]
    Timeout(String, Duration),
    #[error("{0}")]
    Http(#[from] hyper::Error),
}

/// Sends `req` to the node at `url` and streams its answer back; a request that switches
/// protocols (a websocket) is spliced to the node's upgraded connection after its 101.
async fn forward<B>(url: &str, mut req: Request<B>) -> Result<Response<Body>, ForwardError>
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let hostport = cordon_cluster::host_port(url).unwrap_or(url).to_string();
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&hostport)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(ForwardError::Connect(hostport, e)),
        Err(_) => return Err(ForwardError::Timeout(hostport, CONNECT_TIMEOUT)),
    };
    let _ = stream.set_nodelay(true);
    let upgrade = crate::proxy::wants_upgrade(&req).then(|| hyper::upgrade::on(&mut req));
    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
    *req.uri_mut() = pq.parse::<Uri>().unwrap_or_else(|_| Uri::from_static("/"));
    if upgrade.is_none() {
        crate::proxy::strip_hop_by_hop(req.headers_mut());
    }
    req.headers_mut().insert(HOP_HEADER, HeaderValue::from_static("1"));
    if !req.headers().contains_key(HOST) {
        if let Ok(v) = HeaderValue::from_str(&hostport) {
            req.headers_mut().insert(HOST, v);
        }
    }
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn.with_upgrades());
    let mut resp = sender.send_request(req).await?;
    if let Some(client) = upgrade {
        crate::proxy::splice_on_101(client, &mut resp);
    }
    let (parts, body) = resp.into_parts();
    Ok(Response::from_parts(parts, body.boxed()))
}

/// What this node publishes at each heartbeat.
pub fn load(app: &App, tiers: &[String]) -> cordon_cluster::membership::Load {
    // What a create may name: the store's images listed as templates, built templates by id and
    // name, snapshots by id and `name:tag`.
    let mut templates: Vec<String> = app.images.list().unwrap_or_default().into_iter().map(|i| i.name).filter(|n| crate::template_list::is_listed_image(n)).collect();
    for t in app.templates.as_ref().map(|t| t.summaries()).unwrap_or_default() {
        templates.push(t.id);
        templates.extend(t.names);
    }
    if let Some(saved) = &app.sandboxes.saved {
        templates.extend(saved.snapshots.references());
    }
    templates.sort();
    templates.dedup();
    let pools = app.sandboxes.pools.get().map(|p| p.describe()).unwrap_or_default();
    cordon_cluster::membership::Load { sandboxes: app.sandboxes.len_with_creates(), max_sandboxes: app.sandboxes.max(), tiers: tiers.to_vec(), templates, pools }
}
