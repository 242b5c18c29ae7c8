//! The content API, `/volumecontent/{volumeID}/{path,dir,file}?path=...`: a volume's files
//! read and written from outside any sandbox, with the volume's bearer token (never the API
//! key). Errors carry a string `code`, unlike the control plane's. Every operation holds the
//! volume in use (so it cannot be deleted half-way) and runs on a blocking thread through
//! `cordon_volume::content`, which confines each path to the volume.

use std::sync::Arc;

use bytes::Bytes;
use cordon_envd::Timestamp;
use cordon_volume::content::{ContentError, Entry, Meta, Root};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};

use crate::error::{json_response, ApiError};
use crate::volumes::VolumeApi;
use crate::{query, Body};

/// Bytes read from a file per chunk of a download.
const CHUNK: usize = 64 << 10;

/// A failure in the content API's shape: `{"code": "<string>", "message"}`.
struct Failure {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl Failure {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Failure {
        Failure { status, code, message: message.into() }
    }

    fn bad(message: impl Into<String>) -> Failure {
        Failure::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    fn into_response(self) -> Response<Body> {
        json_response(self.status, &json!({"code": self.code, "message": self.message}))
    }
}

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Failure {
        let code = match e.status {
            StatusCode::NOT_FOUND => "volume_not_found",
            StatusCode::UNAUTHORIZED => "unauthorized",
            StatusCode::CONFLICT => "conflict",
            StatusCode::BAD_REQUEST => "invalid_request",
            _ => "internal",
        };
        Failure::new(e.status, code, e.message)
    }
}

impl From<ContentError> for Failure {
    fn from(e: ContentError) -> Failure {
        let (status, code) = match &e {
            ContentError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ContentError::Exists(_) => (StatusCode::CONFLICT, "already_exists"),
            ContentError::IsDirectory(_) => (StatusCode::CONFLICT, "is_directory"),
            ContentError::NotDirectory(_) => (StatusCode::BAD_REQUEST, "not_directory"),
            ContentError::NotRegular(_) => (StatusCode::BAD_REQUEST, "not_regular_file"),
            ContentError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid_request"),
            ContentError::TooLarge(_) => (StatusCode::BAD_REQUEST, "too_large"),
            ContentError::NoSpace(_) => (StatusCode::INSUFFICIENT_STORAGE, "volume_full"),
            ContentError::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        Failure::new(status, code, e.to_string())
    }
}

/// `VolumeEntryStat`.
fn entry_json(e: &Entry) -> Value {
    let t = |t| Timestamp::from_system_time(t).to_rfc3339();
    let mut v = json!({
        "name": e.name, "type": e.kind.as_str(), "path": e.path, "size": e.size, "mode": e.mode,
        "uid": e.uid, "gid": e.gid, "atime": t(e.atime), "mtime": t(e.mtime), "ctime": t(e.ctime),
    });
    if let Some(target) = &e.target {
        v["target"] = json!(target);
    }
    v
}

/// The query's options, parsed strictly: a malformed number is a 400, not a default.
struct Options {
    path: String,
    meta: Meta,
    force: bool,
    depth: u32,
}

fn options(q: Option<&str>) -> Result<Options, Failure> {
    let num = |k: &str| -> Result<Option<u32>, Failure> {
        query::get(q, k).map(|v| v.parse::<u32>().map_err(|_| Failure::bad(format!("{k}={v:?} is not a number")))).transpose()
    };
    let path = query::get(q, "path").filter(|p| !p.is_empty()).ok_or_else(|| Failure::bad("the path query parameter is required"))?;
    let force = match query::get(q, "force").as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(v) => return Err(Failure::bad(format!("force={v:?} is not true or false"))),
    };
    Ok(Options { path, meta: Meta { uid: num("uid")?, gid: num("gid")?, mode: num("mode")? }, force, depth: num("depth")?.unwrap_or(1) })
}

pub async fn handle(api: &Arc<VolumeApi>, method: &Method, rest: &str, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    Ok(match serve(api, method, rest, req).await {
        Ok(r) => r,
        Err(f) => f.into_response(),
    })
}

async fn serve(api: &Arc<VolumeApi>, method: &Method, rest: &str, req: Request<Incoming>) -> Result<Response<Body>, Failure> {
    let (id, what) = rest.split_once('/').ok_or_else(|| Failure::new(StatusCode::NOT_FOUND, "not_found", format!("no content endpoint /volumecontent/{rest}")))?;
    if !cordon_volume::store::valid_id(id) {
        return Err(Failure::bad(format!("invalid volume ID '{id}'")));
    }
    let auth = req.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    api.tokens.check(auth, id)?;
    let o = options(req.uri().query())?;
    let (store, id) = (api.store.clone(), id.to_string());
    // Held until the operation (or the download's last byte) is done.
    let lease = crate::volumes::blocking(move || store.lease(&id)).await?;
    let root = Root::open(lease.root())?;
    let stat = |status, e: Entry| json_response(status, &entry_json(&e));
    Ok(match (method, what) {
        (&Method::GET, "path") => stat(StatusCode::OK, run(move || root.stat(&o.path)).await?),
        (&Method::PATCH, "path") => {
            #[derive(serde::Deserialize, Default)]
            struct Patch {
                uid: Option<u32>,
                gid: Option<u32>,
                mode: Option<u32>,
            }
            let p: Patch = crate::api::read_json(req, true).await?;
            let meta = Meta { uid: p.uid, gid: p.gid, mode: p.mode };
            stat(StatusCode::OK, run(move || root.set_meta(&o.path, meta)).await?)
        }
        (&Method::DELETE, "path") => {
            run(move || root.remove(&o.path)).await?;
            Response::builder().status(StatusCode::NO_CONTENT).body(crate::full("")).expect("a valid response")
        }
        (&Method::GET, "dir") => {
            let list = run(move || root.list(&o.path, o.depth)).await?;
            json_response(StatusCode::OK, &json!(list.iter().map(entry_json).collect::<Vec<_>>()))
        }
        (&Method::POST, "dir") => stat(StatusCode::CREATED, run(move || root.make_dir(&o.path, o.meta, o.force)).await?),
        (&Method::GET, "file") => {
            let (file, _) = run(move || root.open_read(&o.path)).await.map_err(|f| match f.code {
                // Reading a directory is a bad request, not a conflict.
                "is_directory" => Failure::bad(f.message),
                _ => f,
            })?;
            download(file, lease)
        }
        (&Method::PUT, "file") => {
            let mut body = req.into_body();
            let file = match run(move || root.create_file(&o.path, o.meta, o.force)).await {
                Ok(f) => f,
                Err(f) => {
                    drain(&mut body).await;
                    return Err(f);
                }
            };
            stat(StatusCode::CREATED, upload(file, body).await?)
        }
        _ => return Err(Failure::new(StatusCode::NOT_FOUND, "not_found", format!("no content endpoint {method} /volumecontent/{rest}"))),
    })
}

async fn run<T: Send + 'static>(f: impl FnOnce() -> Result<T, ContentError> + Send + 'static) -> Result<T, Failure> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?.map_err(Failure::from)
}

/// Streams a file out from a blocking reader, a few chunks ahead of the client at most, so a
/// large file costs the server no more memory than a small one.
fn download(mut file: std::fs::File, lease: cordon_volume::Lease) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    tokio::task::spawn_blocking(move || {
        let _lease = lease;
        let mut buf = vec![0u8; CHUNK];
        loop {
            match std::io::Read::read(&mut file, &mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if tx.blocking_send(Bytes::copy_from_slice(&buf[..n])).is_err() {
                        break; // the client went away
                    }
                }
                Err(e) => {
                    // The body ends short; the client sees fewer bytes than the length it never got.
                    tracing::warn!("volume file read failed mid-download: {e}");
                    break;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, hyper::Error>(Frame::data(b)), rx)) });
    let mut r = Response::new(StreamBody::new(stream).boxed());
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    r
}

/// Most of a refused upload's body read (and dropped) before the refusal is sent.
const DRAIN_LIMIT: u64 = 64 << 20;
/// How long that reading may take at most.
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads what is left of a refused upload's body, up to a bound, before the refusal goes out. A
/// client still writing its body when the answer comes may never read it (its write fails with
/// a broken pipe, and that is all its user sees), and one that pools connections may send its
/// next request down the one the server is closing. Past the bound the connection is closed.
async fn drain(body: &mut Incoming) {
    let mut read = 0u64;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        while read <= DRAIN_LIMIT {
            match body.frame().await {
                Some(Ok(f)) => read += f.data_ref().map_or(0, |d| d.len() as u64),
                _ => break,
            }
        }
    })
    .await;
}

/// Writes a request body into a new file as it arrives; the file appears (by rename) only
/// once the whole body is in. A client that goes away leaves nothing behind.
async fn upload(mut file: cordon_volume::content::NewFile, mut body: Incoming) -> Result<Entry, Failure> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Option<Bytes>>(4);
    let writer = tokio::task::spawn_blocking(move || -> Result<Option<Entry>, ContentError> {
        while let Some(msg) = rx.blocking_recv() {
            match msg {
                Some(chunk) => file.write_all(&chunk)?,
                None => return file.commit().map(Some),
            }
        }
        Ok(None) // the sender went away without the end: dropped, the temporary file goes
    });
    let mut failed = None;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Ok(data) = f.into_data() {
                    if tx.send(Some(data)).await.is_err() {
                        // The writer stopped on an error, returned below once the body is read.
                        drain(&mut body).await;
                        break;
                    }
                }
            }
            Err(e) => {
                failed = Some(Failure::bad(format!("cannot read the request body: {e}")));
                break;
            }
        }
    }
    if failed.is_none() {
        let _ = tx.send(None).await;
    }
    drop(tx);
    let written = writer.await.map_err(|e| Failure::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    match (written, failed) {
        (Err(e), _) => Err(e.into()),
        (Ok(_), Some(f)) => Err(f),
        (Ok(Some(entry)), None) => Ok(entry),
        (Ok(None), None) => Err(Failure::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "the upload ended without its file")),
    }
}
