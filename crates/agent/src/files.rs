//! `GET /files` (download) and `POST /files` (upload: octet-stream or multipart, optionally
//! gzip-encoded). Bodies stream between the socket and the disk; nothing is held in memory whole.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use cordon_envd::files::{FilesError, FilesQuery, WriteInfo, METADATA_HEADER_PREFIX};
use flate2::write::{GzDecoder, GzEncoder};
use hyper::body::{Body as _, Incoming};
use hyper::header::{HeaderMap, ACCEPT_ENCODING, AUTHORIZATION, CONTENT_ENCODING, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use tokio::sync::mpsc;

use crate::as_user::as_user;
use crate::filesystem::create_dirs;
use crate::body::{json, Body};
use crate::users::{parse_basic_auth, resolve_path, User};
use crate::{xattr, Agent};

/// Size of the chunks a download is read in.
const CHUNK: usize = 64 << 10;

/// A failed `/files` call: the status and message of its JSON error body.
struct FilesErr {
    status: StatusCode,
    message: String,
}

impl FilesErr {
    fn into_response(self) -> Response<Body> {
        json(self.status, &FilesError { message: self.message, code: self.status.as_u16() })
    }
}

type FilesResult<T> = Result<T, FilesErr>;

fn error(status: StatusCode, message: impl Into<String>) -> FilesErr {
    FilesErr { status, message: message.into() }
}

/// The decoded query; a parameter given twice is refused (see [`FilesQuery::parse`]).
fn query<B>(req: &Request<B>) -> FilesResult<FilesQuery> {
    FilesQuery::parse(req.uri().query()).map_err(|e| error(StatusCode::BAD_REQUEST, e.to_string()))
}

/// The user from `?username=`, else `Authorization: Basic`, else the default user.
fn user(agent: &Agent, q: &FilesQuery, h: &HeaderMap) -> FilesResult<User> {
    let name = match q.username.as_ref().filter(|u| !u.is_empty()) {
        Some(u) => u.clone(),
        None => match h.get(AUTHORIZATION) {
            Some(v) => v
                .to_str()
                .ok()
                .and_then(parse_basic_auth)
                .ok_or_else(|| error(StatusCode::UNAUTHORIZED, "invalid authorization header"))?,
            None => agent.config.default_user.clone(),
        },
    };
    agent
        .users()
        .user(&name)
        .ok_or_else(|| error(StatusCode::UNAUTHORIZED, format!("invalid username: '{name}'")))
}

fn accepts_gzip(h: &HeaderMap) -> bool {
    h.get_all(ACCEPT_ENCODING).iter().filter_map(|v| v.to_str().ok()).any(|v| {
        v.split(',').any(|item| {
            let mut parts = item.split(';');
            let coding = parts.next().unwrap_or("").trim();
            let refused = parts.any(|p| {
                let p = p.trim();
                p.strip_prefix("q=").and_then(|q| q.trim().parse::<f32>().ok()) == Some(0.0)
            });
            coding.eq_ignore_ascii_case("gzip") && !refused
        })
    })
}

/// Serves `GET /files?path=`.
pub(crate) async fn download(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    download_inner(&agent, &req).unwrap_or_else(FilesErr::into_response)
}

fn download_inner(agent: &Agent, req: &Request<Incoming>) -> FilesResult<Response<Body>> {
    let q = query(req)?;
    let user = user(agent, &q, req.headers())?;
    let raw = q.path.as_ref().filter(|p| !p.is_empty()).ok_or_else(|| error(StatusCode::BAD_REQUEST, "path is required"))?;
    let path = resolve_path(raw, &user.home);
    // Opened with the user's rights: their symlinks and permissions decide, not root's. The
    // open file is then read as any descriptor.
    let file = as_user_or_500(&user, || open_for_download(&path))?;
    let gzip = accepts_gzip(req.headers());
    let mut resp = Response::builder()
        .status(StatusCode::OK)
        .header(CONTENT_TYPE, "application/octet-stream")
        .header("content-disposition", content_disposition(&path));
    if gzip {
        resp = resp.header(CONTENT_ENCODING, "gzip");
    }
    if req.method() == Method::HEAD {
        return Ok(resp.body(Body::empty()).unwrap_or_else(|_| Response::new(Body::empty())));
    }
    let (tx, rx) = mpsc::channel(2);
    tokio::spawn(send_file(file, gzip, tx));
    Ok(resp.body(Body::channel(rx)).unwrap_or_else(|_| Response::new(Body::empty())))
}

/// Runs `f` with `user`'s credentials (see [`as_user`]); a refused switch is a 500.
fn as_user_or_500<T>(user: &User, f: impl FnOnce() -> FilesResult<T>) -> FilesResult<T> {
    as_user(user, f).unwrap_or_else(|e| Err(error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())))
}

fn open_for_download(path: &Path) -> FilesResult<File> {
    // O_NONBLOCK: opening a FIFO must not hang the agent; regular files ignore the flag.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => error(StatusCode::NOT_FOUND, format!("path '{}' does not exist", path.display())),
            io::ErrorKind::PermissionDenied => {
                error(StatusCode::FORBIDDEN, format!("cannot read '{}': {e}", path.display()))
            }
            _ => error(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot open '{}': {e}", path.display())),
        })?;
    let md = file
        .metadata()
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot stat '{}': {e}", path.display())))?;
    if md.is_dir() {
        return Err(error(StatusCode::BAD_REQUEST, format!("path '{}' is a directory", path.display())));
    }
    if !md.is_file() {
        // Devices and pipes could block the agent or never end.
        return Err(error(StatusCode::BAD_REQUEST, format!("path '{}' is not a regular file", path.display())));
    }
    Ok(file)
}

fn content_disposition(path: &Path) -> String {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let safe: String = name.chars().map(|c| if c == '"' || c == '\\' || c.is_control() { '_' } else { c }).collect();
    format!("attachment; filename=\"{safe}\"")
}

async fn send_file(mut file: File, gzip: bool, tx: mpsc::Sender<Bytes>) {
    let mut buf = vec![0u8; CHUNK];
    let mut enc = gzip.then(|| GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    loop {
        // Regular files: a read is a page-cache copy, short enough to do on the runtime thread.
        let n = match file.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // The status line is gone already; ending the body early is all that is left.
            Err(_) => return,
        };
        let out = match (&mut enc, n) {
            (None, 0) => return,
            (None, n) => Bytes::copy_from_slice(&buf[..n]),
            (Some(_), 0) => match enc.take().map(GzEncoder::finish) {
                Some(Ok(rest)) => {
                    let _ = tx.send(Bytes::from(rest)).await;
                    return;
                }
                _ => return,
            },
            (Some(e), n) => {
                if e.write_all(&buf[..n]).is_err() {
                    return;
                }
                Bytes::from(std::mem::take(e.get_mut()))
            }
        };
        if !out.is_empty() && tx.send(out).await.is_err() {
            return;
        }
        tokio::task::yield_now().await;
    }
}

/// A request body that the upload reads and its caller can take back: what the upload left
/// unread when it failed is drained before the error is answered.
type SharedBody = Arc<std::sync::Mutex<Option<Incoming>>>;

/// The request body as a stream of (decoded) data chunks.
struct BodyStream {
    body: SharedBody,
    gzip: Option<GzDecoder<Vec<u8>>>,
    done: bool,
}

impl BodyStream {
    fn new(body: SharedBody, gzip: bool) -> Self {
        BodyStream { body, gzip: gzip.then(|| GzDecoder::new(Vec::new())), done: false }
    }

    async fn next_chunk(&mut self) -> Option<io::Result<Bytes>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next_chunk(cx)).await
    }

    fn poll_next_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            let polled = match self.body.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                Some(b) => Pin::new(b).poll_frame(cx),
                None => Poll::Ready(None),
            };
            match polled {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(io::Error::other(e))));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else { continue };
                    match &mut self.gzip {
                        None => return Poll::Ready(Some(Ok(data))),
                        Some(d) => {
                            if let Err(e) = d.write_all(&data) {
                                self.done = true;
                                return Poll::Ready(Some(Err(invalid_gzip(e))));
                            }
                            let out = std::mem::take(d.get_mut());
                            if !out.is_empty() {
                                return Poll::Ready(Some(Ok(Bytes::from(out))));
                            }
                        }
                    }
                }
                Poll::Ready(None) => {
                    self.done = true;
                    if let Some(d) = self.gzip.take() {
                        return match d.finish() {
                            Ok(rest) if !rest.is_empty() => Poll::Ready(Some(Ok(Bytes::from(rest)))),
                            Ok(_) => Poll::Ready(None),
                            Err(e) => Poll::Ready(Some(Err(invalid_gzip(e)))),
                        };
                    }
                    return Poll::Ready(None);
                }
            }
        }
    }
}

fn invalid_gzip(e: io::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("invalid gzip body: {e}"))
}

impl futures_core::Stream for BodyStream {
    type Item = io::Result<Bytes>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_next_chunk(cx)
    }
}

fn body_error(e: io::Error) -> FilesErr {
    if e.kind() == io::ErrorKind::InvalidData {
        error(StatusCode::BAD_REQUEST, e.to_string())
    } else {
        error(StatusCode::BAD_REQUEST, format!("error reading the request body: {e}"))
    }
}

/// A file being written for an upload.
struct Upload {
    file: File,
    path: PathBuf,
    user: User,
}

impl Upload {
    /// Creates (or truncates) `path` and its missing parents with `user`'s credentials, so they
    /// belong to the user, and a path the user may not write (through a symlink of theirs, or
    /// not) is refused as it would be for their own process.
    fn create(path: &Path, user: &User) -> FilesResult<Upload> {
        let file = as_user_or_500(user, || Upload::open(path))?;
        Ok(Upload { file, path: path.to_path_buf(), user: user.clone() })
    }

    fn open(path: &Path) -> FilesResult<File> {
        if path.is_dir() {
            return Err(error(StatusCode::BAD_REQUEST, format!("path '{}' is a directory", path.display())));
        }
        if let Some(parent) = path.parent() {
            create_dirs(parent).map_err(|e| {
                let status = match e.kind() {
                    io::ErrorKind::NotADirectory | io::ErrorKind::AlreadyExists => StatusCode::BAD_REQUEST,
                    io::ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
                    _ => StatusCode::INTERNAL_SERVER_ERROR,
                };
                error(status, format!("cannot create the parent directories of '{}': {e}", path.display()))
            })?;
        }
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
            .map_err(|e| {
                let status = match e.kind() {
                    io::ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
                    _ => StatusCode::INTERNAL_SERVER_ERROR,
                };
                error(status, format!("cannot open '{}': {e}", path.display()))
            })?;
        let md = file
            .metadata()
            .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot stat '{}': {e}", path.display())))?;
        if !md.is_file() {
            return Err(error(StatusCode::BAD_REQUEST, format!("path '{}' is not a regular file", path.display())));
        }
        Ok(file)
    }

    fn write(&mut self, data: &[u8]) -> FilesResult<()> {
        self.file.write_all(data).map_err(|e| {
            let status = if e.raw_os_error() == Some(libc::ENOSPC) || e.raw_os_error() == Some(libc::EDQUOT) {
                StatusCode::INSUFFICIENT_STORAGE
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            };
            error(status, format!("error writing '{}': {e}", self.path.display()))
        })
    }

    fn finish(self, metadata: &[(String, String)]) -> FilesResult<WriteInfo> {
        let path = &self.path;
        as_user_or_500(&self.user, || {
            xattr::replace(path, metadata).map_err(|e| {
                error(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot store metadata on '{}': {e}", path.display()))
            })?;
            Ok(WriteInfo {
                name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
                entry_type: Some("file".to_string()),
                path: path.to_string_lossy().into_owned(),
                metadata: xattr::read(path),
            })
        })
    }
}

fn metadata_headers(h: &HeaderMap) -> FilesResult<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (name, value) in h {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER_PREFIX) else { continue };
        if key.is_empty() {
            continue;
        }
        let v = value
            .to_str()
            .map_err(|_| error(StatusCode::BAD_REQUEST, format!("metadata header {name} is not valid text")))?;
        out.push((key.to_ascii_lowercase(), v.to_string()));
    }
    Ok(out)
}

/// Serves `POST /files`.
pub(crate) async fn upload(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let body: SharedBody = Arc::new(std::sync::Mutex::new(Some(body)));
    let result = upload_inner(&agent, Request::from_parts(parts, body.clone())).await;
    // Read what the client is still sending before answering: answering first and closing
    // made the client's write fail. A refused upload (a path the user may not write, say)
    // reached the caller as a broken connection instead of its error, and so did a good
    // multipart one whose closing boundary was followed by bytes the parser never asked for
    // (the JavaScript SDK's bodies end with a CRLF there), whenever the answer overtook them.
    let rest = body.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(mut rest) = rest {
        while let Some(Ok(_)) = http_body_util::BodyExt::frame(&mut rest).await {}
    }
    match result {
        Ok(infos) => json(StatusCode::OK, &infos),
        Err(e) => e.into_response(),
    }
}

async fn upload_inner(agent: &Agent, req: Request<SharedBody>) -> FilesResult<Vec<WriteInfo>> {
    let q = query(&req)?;
    let user = user(agent, &q, req.headers())?;
    let metadata = metadata_headers(req.headers())?;
    let gzip = req
        .headers()
        .get(CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|c| c.trim().eq_ignore_ascii_case("gzip")));
    let ct = req.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let query_path = q.path.clone().filter(|p| !p.is_empty());
    let stream = BodyStream::new(req.into_body(), gzip);

    if cordon_envd::connect::media_type(&ct).eq_ignore_ascii_case("multipart/form-data") {
        let boundary = multer::parse_boundary(&ct)
            .map_err(|e| error(StatusCode::BAD_REQUEST, format!("invalid multipart content type: {e}")))?;
        let mut mp = multer::Multipart::new(stream, boundary);
        let mut infos = Vec::new();
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return Err(error(StatusCode::BAD_REQUEST, format!("invalid multipart body: {e}"))),
            };
            if field.name() != Some("file") {
                continue;
            }
            // One file: the query names it. Several: each part's filename does.
            let target = match (&query_path, field.file_name()) {
                (Some(p), _) => p.clone(),
                (None, Some(f)) if !f.is_empty() => f.to_string(),
                _ => return Err(error(StatusCode::BAD_REQUEST, "multipart file part without a filename")),
            };
            let mut up = Upload::create(&resolve_path(&target, &user.home), &user)?;
            let mut field = field;
            loop {
                match field.chunk().await {
                    Ok(Some(c)) => up.write(&c)?,
                    Ok(None) => break,
                    Err(e) => return Err(error(StatusCode::BAD_REQUEST, format!("invalid multipart body: {e}"))),
                }
            }
            infos.push(up.finish(&metadata)?);
        }
        if infos.is_empty() {
            return Err(error(StatusCode::BAD_REQUEST, "the multipart body has no part named \"file\""));
        }
        return Ok(infos);
    }

    let target = query_path.ok_or_else(|| error(StatusCode::BAD_REQUEST, "path is required"))?;
    let mut up = Upload::create(&resolve_path(&target, &user.home), &user)?;
    let mut stream = stream;
    while let Some(chunk) = stream.next_chunk().await {
        up.write(&chunk.map_err(body_error)?)?;
    }
    Ok(vec![up.finish(&metadata)?])
}
