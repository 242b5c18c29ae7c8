//! Server side of the Connect protocol: decoding requests, and unary, server-streaming and
//! client-streaming responses.

use std::future::Future;
use std::ops::ControlFlow;
use std::time::Duration;

use bytes::Bytes;
use cordon_envd::connect::{
    encode_end_stream, encode_message, is_connect_json, media_type, Code, ConnectError, EnvelopeDecoder,
    CONTENT_TYPE_CONNECT_JSON, CONTENT_TYPE_JSON, HEADER_KEEPALIVE_INTERVAL, HEADER_TIMEOUT_MS,
};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{HeaderMap, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::body::{read_limited, Body};
use crate::users::parse_basic_auth;

/// Largest request message accepted (SendInput chunks are the big ones).
pub(crate) const MAX_REQUEST: usize = 32 << 20;
/// Keepalive period when the client does not ask for one (envd's default).
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);
/// Envelopes buffered between a stream task and the connection.
const STREAM_QUEUE: usize = 4;

/// What the request headers say about the call.
#[derive(Clone, Debug, Default)]
pub(crate) struct CallCtx {
    /// The user named by `Authorization: Basic`; `Some(Err)` for a header that is not valid.
    pub auth_user: Option<Result<String, ()>>,
    /// `Connect-Timeout-Ms`.
    pub timeout: Option<Duration>,
    /// `Keepalive-Ping-Interval`.
    pub keepalive: Duration,
}

impl CallCtx {
    pub fn from_headers(h: &HeaderMap) -> Result<CallCtx, ConnectError> {
        let auth_user = h
            .get(AUTHORIZATION)
            .map(|v| v.to_str().ok().and_then(parse_basic_auth).ok_or(()));
        let timeout = match h.get(HEADER_TIMEOUT_MS) {
            None => None,
            Some(v) => {
                let ms: u64 = v
                    .to_str()
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .ok_or_else(|| ConnectError::invalid_argument("invalid Connect-Timeout-Ms header"))?;
                // 0 is what clients send for "no deadline" in practice.
                (ms > 0).then(|| Duration::from_millis(ms))
            }
        };
        let keepalive = h
            .get(HEADER_KEEPALIVE_INTERVAL)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse::<u64>().ok())
            .filter(|s| *s > 0)
            .map_or(DEFAULT_KEEPALIVE, Duration::from_secs);
        Ok(CallCtx { auth_user, timeout, keepalive })
    }
}

fn content_type(h: &HeaderMap) -> &str {
    h.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("")
}

/// A unary error response: the code's HTTP status and `{"code","message"}`.
pub(crate) fn unary_error(e: &ConnectError) -> Response<Body> {
    let status = StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, CONTENT_TYPE_JSON)
        .body(Body::full(e.to_unary_body()))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

fn unsupported_media(ct: &str) -> Response<Body> {
    let e = ConnectError::new(Code::Unimplemented, format!("unsupported content type {ct:?}; only JSON is served"));
    let mut r = unary_error(&e);
    *r.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
    r
}

/// A streaming response with the given body.
fn stream_response(body: Body) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(CONTENT_TYPE, CONTENT_TYPE_CONNECT_JSON)
        .body(body)
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

/// A streaming response that only carries an end-stream error (Connect streams report errors
/// with HTTP 200).
pub(crate) fn stream_error(e: &ConnectError) -> Response<Body> {
    stream_response(Body::full(encode_end_stream(Some(e))))
}

fn is_proto_codec(ct: &str) -> bool {
    let m = media_type(ct).to_ascii_lowercase();
    m.ends_with("proto") || m.starts_with("application/grpc")
}

fn parse<T: DeserializeOwned>(data: &[u8]) -> Result<T, ConnectError> {
    let data: &[u8] = if data.iter().all(u8::is_ascii_whitespace) { b"{}" } else { data };
    serde_json::from_slice(data).map_err(|e| ConnectError::invalid_argument(format!("invalid request message: {e}")))
}

/// The content type and context of a call, or the response that refuses it. A codec other than
/// JSON is refused alike for every kind of call; a bad header the way `error` answers for this kind.
/// (Boxed: a response is too large to pass around as an error.)
fn accept(
    headers: &HeaderMap,
    error: fn(&ConnectError) -> Response<Body>,
) -> Result<(String, CallCtx), Box<Response<Body>>> {
    let ct = content_type(headers).to_string();
    if is_proto_codec(&ct) {
        return Err(Box::new(unsupported_media(&ct)));
    }
    let ctx = CallCtx::from_headers(headers).map_err(|e| Box::new(error(&e)))?;
    Ok((ct, ctx))
}

/// Serves a unary call: JSON in, JSON out; `Connect-Timeout-Ms` bounds the handler.
pub(crate) async fn unary<Req, Resp, F, Fut>(req: Request<Incoming>, handler: F) -> Response<Body>
where
    Req: DeserializeOwned,
    Resp: Serialize,
    F: FnOnce(Req, CallCtx) -> Fut,
    Fut: Future<Output = Result<Resp, ConnectError>>,
{
    let (_, ctx) = match accept(req.headers(), unary_error) {
        Ok(v) => v,
        Err(refused) => return *refused,
    };
    let body = match read_limited(req.into_body(), MAX_REQUEST).await {
        Ok(b) => b,
        Err(e) => return unary_error(&e),
    };
    let msg: Req = match parse(&body) {
        Ok(m) => m,
        Err(e) => return unary_error(&e),
    };
    let timeout = ctx.timeout;
    let call = handler(msg, ctx);
    let result = match timeout {
        Some(t) => tokio::time::timeout(t, call)
            .await
            .unwrap_or_else(|_| Err(ConnectError::new(Code::DeadlineExceeded, "deadline exceeded"))),
        None => call.await,
    };
    match result.and_then(|r| serde_json::to_vec(&r).map_err(|e| ConnectError::internal(e.to_string()))) {
        Ok(json) => Response::builder()
            .status(StatusCode::OK)
            .header(CONTENT_TYPE, CONTENT_TYPE_JSON)
            .body(Body::full(Bytes::from(json)))
            .unwrap_or_else(|_| Response::new(Body::empty())),
        Err(e) => unary_error(&e),
    }
}

/// The sending half of a response stream.
pub(crate) struct StreamTx {
    tx: mpsc::Sender<Bytes>,
}

/// The client has gone away.
#[derive(Debug)]
pub(crate) struct Gone;

impl StreamTx {
    /// Sends one message envelope, waiting while the client is slow.
    pub async fn send<T: Serialize>(&self, msg: &T) -> Result<(), Gone> {
        let env = match encode_message(msg) {
            Ok(e) => e,
            Err(_) => return Ok(()),
        };
        self.tx.send(env).await.map_err(|_| Gone)
    }

    /// Ends the stream, with an error or with `{}`.
    pub async fn finish(self, error: Option<ConnectError>) {
        self.end(error.as_ref()).await;
    }

    /// Sends the end-stream message; the caller sends nothing after it.
    async fn end(&self, error: Option<&ConnectError>) {
        let _ = self.tx.send(encode_end_stream(error)).await;
    }

    /// Resolves once the connection has dropped the response body.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// What a response stream with nothing to send wakes up for.
pub(crate) enum Idle {
    /// It has been quiet for the keepalive period.
    Keepalive,
    /// The call's deadline has passed.
    Deadline,
    /// The client has gone away.
    Gone,
}

/// The clocks of a response stream: a keepalive message after each quiet spell, so that the
/// client and proxies on the way do not give up on an idle connection, and the call's deadline.
pub(crate) struct Heartbeat {
    every: Duration,
    quiet_until: Instant,
    deadline: Option<Instant>,
}

impl Heartbeat {
    /// Starts the first quiet spell now.
    pub fn new(every: Duration, deadline: Option<Instant>) -> Heartbeat {
        Heartbeat { every, quiet_until: Instant::now() + every, deadline }
    }

    /// Starts a new quiet spell: the stream has just carried a message.
    pub fn sent(&mut self) {
        self.quiet_until = Instant::now() + self.every;
    }

    /// Waits until the stream needs a keepalive, reaches its deadline or loses its client, in
    /// that order of precedence. Cancel-safe, so it can race the stream's own messages; the
    /// answer comes from [`Heartbeat::answer`] afterwards, which is not.
    pub async fn idle(&self, tx: &StreamTx) -> Idle {
        tokio::select! {
            biased;
            _ = tokio::time::sleep_until(self.quiet_until) => Idle::Keepalive,
            _ = sleep_until_opt(self.deadline) => Idle::Deadline,
            _ = tx.closed() => Idle::Gone,
        }
    }

    /// Acts on `idle`: sends `ping` when a keepalive is due, ends the stream with
    /// `DeadlineExceeded` at the deadline. `Break` once the stream is over.
    pub async fn answer<T: Serialize>(&mut self, idle: Idle, tx: &StreamTx, ping: &T) -> ControlFlow<()> {
        match idle {
            Idle::Keepalive => {
                if tx.send(ping).await.is_err() {
                    return ControlFlow::Break(());
                }
                self.sent();
                ControlFlow::Continue(())
            }
            Idle::Deadline => {
                tx.end(Some(&ConnectError::new(Code::DeadlineExceeded, "deadline exceeded"))).await;
                ControlFlow::Break(())
            }
            Idle::Gone => ControlFlow::Break(()),
        }
    }
}

async fn sleep_until_opt(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Serves a server-streaming call. The handler validates the request and, if it accepts it,
/// spawns a task that writes the stream through the [`StreamTx`]; it must not write before
/// returning (the response is only handed to the connection afterwards).
pub(crate) async fn server_stream<Req, F, Fut>(req: Request<Incoming>, handler: F) -> Response<Body>
where
    Req: DeserializeOwned,
    F: FnOnce(Req, CallCtx, StreamTx) -> Fut,
    Fut: Future<Output = Result<(), ConnectError>>,
{
    let (ct, ctx) = match accept(req.headers(), stream_error) {
        Ok(v) => v,
        Err(refused) => return *refused,
    };
    let enveloped = is_connect_json(&ct);
    let body = match read_limited(req.into_body(), MAX_REQUEST).await {
        Ok(b) => b,
        Err(e) => return stream_error(&e),
    };
    let msg: Req = match first_message(&body, enveloped) {
        Ok(m) => m,
        Err(e) => return stream_error(&e),
    };
    let (tx, rx) = mpsc::channel(STREAM_QUEUE);
    match handler(msg, ctx, StreamTx { tx }).await {
        Ok(()) => stream_response(Body::channel(rx)),
        Err(e) => stream_error(&e),
    }
}

/// The single request message of a server-streaming call. Clients that do not speak the
/// streaming content type are met halfway: a bare JSON body is taken as the message.
fn first_message<T: DeserializeOwned>(body: &[u8], enveloped: bool) -> Result<T, ConnectError> {
    if !enveloped && body.first().is_some_and(|b| *b == b'{') {
        return parse(body);
    }
    let mut dec = EnvelopeDecoder::new(MAX_REQUEST);
    dec.push(body);
    loop {
        match dec.next_envelope() {
            Err(e) => return Err(ConnectError::invalid_argument(format!("invalid request envelope: {e}"))),
            Ok(None) => {
                return Err(match dec.finish() {
                    Err(e) => ConnectError::invalid_argument(format!("invalid request envelope: {e}")),
                    Ok(()) => ConnectError::invalid_argument("request stream carried no message"),
                })
            }
            Ok(Some(env)) if env.is_compressed() => {
                return Err(ConnectError::invalid_argument("compressed request envelope, but no compression was negotiated"))
            }
            Ok(Some(env)) if env.is_end_stream() => continue,
            Ok(Some(env)) => return parse(&env.data),
        }
    }
}

/// Reads a client stream envelope by envelope as it arrives, passing each message to `on_msg`.
pub(crate) async fn client_stream<Req, S, F, Fut>(
    req: Request<Incoming>,
    mut state: S,
    mut on_msg: F,
) -> Response<Body>
where
    Req: DeserializeOwned,
    F: FnMut(Req, CallCtx, S) -> Fut,
    Fut: Future<Output = Result<S, ConnectError>>,
{
    let (_, ctx) = match accept(req.headers(), stream_error) {
        Ok(v) => v,
        Err(refused) => return *refused,
    };
    let mut body = req.into_body();
    let mut dec = EnvelopeDecoder::new(MAX_REQUEST);
    let result: Result<(), ConnectError> = async {
        loop {
            while let Some(env) =
                dec.next_envelope().map_err(|e| ConnectError::invalid_argument(format!("invalid request envelope: {e}")))?
            {
                if env.is_compressed() {
                    return Err(ConnectError::invalid_argument("compressed request envelope"));
                }
                if env.is_end_stream() {
                    continue;
                }
                let msg: Req = parse(&env.data)?;
                state = on_msg(msg, ctx.clone(), state).await?;
            }
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        dec.push(&data);
                    }
                }
                Some(Err(e)) => return Err(ConnectError::new(Code::Canceled, format!("request stream broke: {e}"))),
                None => {
                    return dec
                        .finish()
                        .map_err(|e| ConnectError::invalid_argument(format!("invalid request envelope: {e}")))
                }
            }
        }
    }
    .await;
    match result {
        Ok(()) => {
            let mut out = Vec::new();
            out.extend_from_slice(&encode_message(&serde_json::json!({})).unwrap_or_default());
            out.extend_from_slice(&encode_end_stream(None));
            stream_response(Body::full(Bytes::from(out)))
        }
        Err(e) => stream_error(&e),
    }
}
