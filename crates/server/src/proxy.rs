//! The data plane: requests for a sandbox go to its agent socket, bodies streamed both ways.
//!
//! Port 49983 is envd, served by the agent itself. Any other port goes through the agent's
//! forwarding endpoint (an HTTP/1.1 upgrade to `/__cordon/forward/<port>`), after which the
//! agent splices bytes to that port inside the sandbox and the request is replayed over the
//! spliced connection. Each request has its own agent connection: Unix connects are cheap,
//! and a stream that ends (or a client that hangs up) then never affects another request.

use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use cordon_envd::files::FilesQuery;
use hyper::header::{HeaderName, AUTHORIZATION, CONNECTION, UPGRADE};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use crate::auth::{self, FileOp};
use crate::error::{sandbox_not_found, ApiError};
use crate::agent_link::{ask_forward, ProxyError, FORWARD_PREFIX};
use crate::registry::LiveSandbox;
use crate::{port_token, App, Body, ENVD_PORT};

/// envd's `POST /init`, which only the host calls.
pub const INIT_PATH: &str = "/init";

/// Wakes a sandbox paused to disk with its memory whose lifecycle lets traffic wake it, for a
/// request that may wake it: `/health`, or one with its envd token or traffic token (or any,
/// to a public port). The request is then checked in full against the running sandbox, as any
/// other. `None`: there is no such sandbox to wake.
async fn wake_saved<B>(app: &Arc<App>, id: &str, port: u16, req: &Request<B>) -> Option<Result<Arc<LiveSandbox>, Response<Body>>> {
    let r = app.sandboxes.saved.as_ref()?.get(id)?;
    if r.memory.is_none() || !r.lifecycle.auto_resume {
        return None;
    }
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("");
    let health = port == ENVD_PORT && req.uri().path() == "/health" && matches!(*req.method(), Method::GET | Method::HEAD);
    let may_wake = health
        || auth::ct_eq(header("x-access-token"), &r.token)
        || (port != ENVD_PORT && (r.public_traffic || auth::ct_eq(header(crate::port_token::TRAFFIC_TOKEN_HEADER), &r.traffic_token)));
    if !may_wake {
        return None;
    }
    let timeout = std::time::Duration::from_secs(r.lifecycle.resume_timeout_secs);
    match crate::pause::resume(&app.sandboxes, id, timeout).await {
        Ok((e, _)) => {
            tracing::info!(sandbox_id = %id, port, "sandbox woken from disk by a request");
            Some(Ok(e))
        }
        Err(e) if e.status == StatusCode::NOT_FOUND => None,
        Err(e) => Some(Err(e.into_response())),
    }
}

/// Headers that describe one hop, not the request (RFC 9110 7.6.1).
const HOP_BY_HOP: &[&str] = &["connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer", "upgrade"];

pub async fn handle(app: &Arc<App>, id: &str, port: u16, mut req: Request<Incoming>) -> Response<Body> {
    let mut entry = match app.sandboxes.get(id) {
        Some(e) => e,
        None => match wake_saved(app, id, port, &req).await {
            Some(Ok(e)) => e,
            Some(Err(refused)) => return refused,
            None => return sandbox_not_found(id),
        },
    };
    // A sandbox paused in place answers as a missing one (the SDKs' `is_running()` is false),
    // unless its lifecycle lets traffic wake it: then a request it would admit does.
    let paused = entry.frozen_at().is_some();
    if paused && !entry.lifecycle.auto_resume {
        return sandbox_not_found(id);
    }
    if port == ENVD_PORT {
        match authorize(&entry, &req) {
            Err(e) => return e.into_response(),
            Ok(Grant::Signed(file)) => file.bind(&mut req),
            Ok(Grant::Open | Grant::Token) => {}
        }
        // The host's own endpoints of the agent: port forwarding, and `/init`, by which the host
        // gives a sandbox its create's environment (see `crate::pool`).
        if req.uri().path().starts_with(FORWARD_PREFIX) || req.uri().path() == INIT_PATH {
            return ApiError::not_found("no such envd endpoint").into_response();
        }
    } else {
        // A port that needs a token already took one (the envd token or the traffic token).
        let token_checked = entry.token_ports.contains(&port);
        if token_checked {
            if let Err(e) = port_token::check(&entry, port, req.headers_mut()) {
                return e.into_response();
            }
        }
        if let Err(e) = entry.traffic.admit(&entry, port, token_checked, req.headers_mut()) {
            return e.into_response();
        }
    }
    if paused {
        let timeout = std::time::Duration::from_secs(entry.lifecycle.resume_timeout_secs);
        match crate::pause::resume(&app.sandboxes, id, timeout).await {
            Ok((e, _)) => entry = e,
            Err(e) if e.status == StatusCode::NOT_FOUND => return sandbox_not_found(id),
            Err(e) => return e.into_response(),
        }
        tracing::info!(sandbox_id = %id, port, "sandbox woken by a request");
    }
    let Ok(permit) = entry.streams.clone().try_acquire_owned() else {
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("too many requests in flight to sandbox {id} (at most {})", crate::registry::MAX_STREAMS_PER_SANDBOX),
        )
        .into_response();
    };
    // A command's latency runs from its start request to the end of its output stream.
    let command = (port == ENVD_PORT && req.uri().path() == COMMAND_START_PATH)
        .then(|| CommandTimer { sandboxes: app.sandboxes.clone(), tier: entry.tier, since: std::time::Instant::now() });
    match forward(&entry.socket, port, req).await {
        // The permit is held until the response body is done or dropped.
        Ok(r) => {
            // A Connect stream cut by the sandbox's end is finished the way envd finishes one
            // whose process side went away, so that clients see an error they can classify.
            let is_stream = r
                .headers()
                .get(hyper::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|ct| ct.starts_with("application/connect+"));
            let cut = (port == ENVD_PORT && is_stream).then(|| id.to_string());
            r.map(|body| Permitted { body, _permit: permit, cut, ended: false, _command: command }.boxed())
        }
        Err(e) => {
            // The sandbox may have died while the request was on its way.
            if app.sandboxes.get(id).is_none() {
                return sandbox_not_found(id);
            }
            tracing::debug!(sandbox_id = %id, port, "proxy: {e}");
            ApiError::new(StatusCode::BAD_GATEWAY, format!("the sandbox did not answer on port {port}: {e}"))
                .no_retry()
                .into_response()
        }
    }
}

/// What let a request to envd through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// `GET /health`: open to all.
    Open,
    /// The sandbox's access token: the whole envd API, as any user.
    Token,
    /// A `/files` URL signature: one operation on one path as one user, until its expiry.
    Signed(SignedFile),
}

/// The values a `/files` signature was checked against; only these reach the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedFile {
    pub op: FileOp,
    pub path: String,
    /// Empty: the sandbox's default user (as signed).
    pub user: String,
}

impl SignedFile {
    /// Makes `req` say exactly what was signed: its query is rebuilt from the checked path and
    /// user (no other parameter survives, so nothing unchecked can steer the agent), and an
    /// `Authorization` header, which the agent would take for the user when the signature names
    /// none, is dropped. The operation is bound by the method, which was checked with it.
    pub fn bind<B>(&self, req: &mut Request<B>) {
        let q = FilesQuery {
            path: Some(self.path.clone()).filter(|p| !p.is_empty()),
            username: Some(self.user.clone()).filter(|u| !u.is_empty()),
            ..Default::default()
        };
        let encoded = q.encode();
        let pq = if encoded.is_empty() { "/files".to_string() } else { format!("/files?{encoded}") };
        *req.uri_mut() = pq.parse::<Uri>().unwrap_or_else(|_| Uri::from_static("/files"));
        req.headers_mut().remove(AUTHORIZATION);
    }
}

/// envd's rule: every route needs the access token except `GET /health`; `/files` takes the
/// token or a URL signature made with it. A `/files` query that repeats a parameter is refused
/// whatever the credential: the signature covers one value of each.
pub fn authorize<B>(entry: &LiveSandbox, req: &Request<B>) -> Result<Grant, ApiError> {
    let path = req.uri().path();
    if path == "/health" && matches!(*req.method(), Method::GET | Method::HEAD) {
        return Ok(Grant::Open);
    }
    let files = if path == "/files" {
        Some(FilesQuery::parse(req.uri().query()).map_err(|e| ApiError::bad_request(e.to_string()))?)
    } else {
        None
    };
    let header = req.headers().get("x-access-token").map(|v| v.to_str().unwrap_or(""));
    if let Some(token) = header {
        return if auth::ct_eq(token, &entry.token) {
            Ok(Grant::Token)
        } else {
            Err(ApiError::unauthorized("invalid X-Access-Token for this sandbox"))
        };
    }
    if let Some(q) = files {
        let op = file_op(req.method());
        let Some(sig) = q.signature else {
            return Err(ApiError::unauthorized("missing X-Access-Token header or signature"));
        };
        let file = q.path.unwrap_or_default();
        let user = q.username.unwrap_or_default();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        auth::check_file_signature(&sig, q.signature_expiration.as_deref(), &file, op, &user, &entry.token, now)
            .map_err(ApiError::unauthorized)?;
        return Ok(Grant::Signed(SignedFile { op, path: file, user }));
    }
    Err(ApiError::unauthorized("missing X-Access-Token header"))
}

/// What a `/files` request does, as its signature names it.
fn file_op(method: &Method) -> FileOp {
    match *method {
        Method::GET | Method::HEAD => FileOp::Read,
        _ => FileOp::Write,
    }
}

/// envd's process start: its stream lasts as long as the command.
const COMMAND_START_PATH: &str = "/process.Process/Start";

/// Counts a command's latency in the server's metrics when its stream's body goes, however
/// it ends (the command's end, the client hanging up, the sandbox's end).
struct CommandTimer {
    sandboxes: Arc<crate::registry::Sandboxes>,
    tier: cordon_spec::Tier,
    since: std::time::Instant,
}

impl Drop for CommandTimer {
    fn drop(&mut self) {
        self.sandboxes.stats.command(self.tier, self.since.elapsed());
    }
}

/// A response body that holds a stream permit of its sandbox.
struct Permitted {
    body: Body,
    _permit: tokio::sync::OwnedSemaphorePermit,
    _command: Option<CommandTimer>,
    /// For an envd Connect stream, the sandbox's id: if the agent's side breaks off (the
    /// sandbox was killed or died), the stream ends with an `unavailable` end-of-stream message
    /// and a proper end of the body instead of a cut connection.
    cut: Option<String>,
    ended: bool,
}

impl hyper::body::Body for Permitted {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        use std::task::Poll;
        if self.ended {
            return Poll::Ready(None);
        }
        match std::pin::Pin::new(&mut self.body).poll_frame(cx) {
            Poll::Ready(Some(Err(e))) if self.cut.is_some() => {
                self.ended = true;
                let id = self.cut.take().unwrap_or_default();
                tracing::debug!(sandbox_id = %id, "agent stream broke off: {e}");
                let err = cordon_envd::connect::ConnectError::new(
                    cordon_envd::connect::Code::Unavailable,
                    format!("the connection to sandbox {id} ended before the stream completed"),
                );
                Poll::Ready(Some(Ok(hyper::body::Frame::data(cordon_envd::connect::encode_end_stream(Some(&err))))))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// The sandbox whose token produced the signature of a signed `/files` URL, expired or not
/// (its agent route then answers envd's "signature is already expired"); `None` for a request
/// that is not a signed URL. A signature no live sandbox made gets envd's 401, not the control
/// plane's. A query that repeats a parameter is refused here already.
pub fn signed_by<B>(sandboxes: &crate::Sandboxes, req: &Request<B>) -> Result<Option<Arc<LiveSandbox>>, ApiError> {
    let q = FilesQuery::parse(req.uri().query()).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let Some(sig) = q.signature.as_deref().filter(|_| !req.headers().contains_key("x-access-token")) else { return Ok(None) };
    let op = file_op(req.method());
    let (file, user) = (q.path.as_deref().unwrap_or_default(), q.username.as_deref().unwrap_or_default());
    let exp = q.signature_expiration.as_deref();
    let signer = sandboxes.all().into_iter().find(|e| auth::file_signature_matches(sig, exp, file, op, user, &e.token));
    signer.map(Some).ok_or_else(|| ApiError::unauthorized(auth::INVALID_SIGNATURE))
}

/// The request as it goes to the agent: origin-form URI, no hop-by-hop headers.
fn strip(mut req: Request<Incoming>) -> Request<Incoming> {
    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
    *req.uri_mut() = pq.parse::<Uri>().unwrap_or_else(|_| Uri::from_static("/"));
    strip_hop_by_hop(req.headers_mut());
    req
}

/// Removes the headers that describe one hop: those `Connection` names, and the standard ones.
pub(crate) fn strip_hop_by_hop(headers: &mut hyper::HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()).collect::<Vec<_>>())
        .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for h in HOP_BY_HOP {
        headers.remove(*h);
    }
}

/// Whether the client asks to switch protocols (websockets, mostly).
pub(crate) fn wants_upgrade<B>(req: &Request<B>) -> bool {
    req.headers().contains_key(UPGRADE)
        && req.headers().get_all(CONNECTION).iter().any(|v| {
            v.to_str().is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade")))
        })
}

/// After a 101 from upstream, splices the client's upgraded connection to upstream's.
pub(crate) fn splice_on_101<B>(client: hyper::upgrade::OnUpgrade, resp: &mut Response<B>) {
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let inner = hyper::upgrade::on(resp);
        tokio::spawn(async move {
            let (Ok(client), Ok(inner)) = (client.await, inner.await) else { return };
            let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(client), &mut TokioIo::new(inner)).await;
        });
    }
}

async fn forward(socket: &Path, port: u16, mut req: Request<Incoming>) -> Result<Response<Body>, ProxyError> {
    // A user port may switch protocols (a websocket server, say): then the upgrade headers
    // must reach it, and after its 101 both upgraded connections are spliced together.
    let client_upgrade = (port != ENVD_PORT && wants_upgrade(&req)).then(|| hyper::upgrade::on(&mut req));
    let req = match client_upgrade {
        Some(_) => {
            let pq = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
            *req.uri_mut() = pq.parse::<Uri>().unwrap_or_else(|_| Uri::from_static("/"));
            req
        }
        None => strip(req),
    };
    let stream = UnixStream::connect(socket).await.map_err(ProxyError::Connect)?;
    let resp = if port == ENVD_PORT {
        let (mut sender, conn) = http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        sender.send_request(req).await?
    } else {
        let resp = ask_forward(stream, port).await?;
        if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
            // The agent's JSON says why (nothing listening on the port, usually).
            let (parts, body) = resp.into_parts();
            return Ok(Response::from_parts(parts, body.boxed()));
        }
        let upgraded = hyper::upgrade::on(resp).await?;
        let (mut sender, conn) = http1::handshake(upgraded).await?;
        match client_upgrade {
            None => {
                tokio::spawn(conn);
                sender.send_request(req).await?
            }
            Some(client) => {
                tokio::spawn(conn.with_upgrades());
                let mut resp = sender.send_request(req).await?;
                splice_on_101(client, &mut resp);
                resp
            }
        }
    };
    let (parts, body) = resp.into_parts();
    Ok(Response::from_parts(parts, body.boxed()))
}
