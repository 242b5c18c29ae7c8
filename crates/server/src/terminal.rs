//! The dashboard's terminal: a websocket at `/ui/terminal/{id}` bridged to a shell on a PTY
//! inside the sandbox, started through its agent (envd's `process.Process/Start` with a pty;
//! keystrokes by `SendInput`, size changes by `Update`).
//!
//! The API key never travels in the URL (it would end up in logs and history): the upgrade is
//! accepted for any well-formed request of the page's own origin, and the first message must
//! be `{"type":"auth","key":...}`; nothing about the sandbox is looked up before it checks.
//! Then the client sends `{"type":"input","data":"..."}` and `{"type":"resize","cols","rows"}`
//! as text frames, and receives the PTY's bytes as binary frames and `{"type":"ready"|"exit"|
//! "error",...}` as text frames. Closing the socket kills the shell.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cordon_envd::process::{DataEvent, ProcessConfig, ProcessEvent, Pty, PtySize, Signal, StartRequest};
use cordon_envd::EnvdClient;
use futures_util::{SinkExt, StreamExt};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONNECTION, HOST, ORIGIN, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_VERSION, UPGRADE};
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::json;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::error::ApiError;
use crate::{full, App, Body};

/// How long a client has to authenticate after the upgrade.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest message a client may send (a paste, at most).
const MAX_MESSAGE: usize = 1 << 20;
/// The PTY's size bounds: a zero size confuses programs, a huge one is a memory lever.
const MAX_COLS: u32 = 1000;
const MAX_ROWS: u32 = 500;
/// The size until the client says otherwise.
const DEFAULT_SIZE: PtySize = PtySize { cols: 80, rows: 24 };
/// The shells tried, in order: an image without bash still has a terminal.
const SHELLS: &[(&str, &[&str])] = &[("/bin/bash", &["-i", "-l"]), ("/bin/sh", &["-i"])];
/// Close codes of the private range (4000-4999) the page shows as reasons.
const CLOSE_UNAUTHORIZED: u16 = 4401;
const CLOSE_NOT_FOUND: u16 = 4404;

/// Why a websocket handshake is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandshakeError {
    #[error("the terminal is a websocket: send a GET with Upgrade: websocket")]
    NotUpgrade,
    #[error("unsupported websocket version (13 is)")]
    Version,
    #[error("missing Sec-WebSocket-Key")]
    MissingKey,
    #[error("the terminal only answers pages of this server's origin")]
    CrossOrigin,
}

impl HandshakeError {
    fn into_api(self) -> ApiError {
        let status = match self {
            HandshakeError::NotUpgrade => StatusCode::UPGRADE_REQUIRED,
            HandshakeError::CrossOrigin => StatusCode::FORBIDDEN,
            HandshakeError::Version | HandshakeError::MissingKey => StatusCode::BAD_REQUEST,
        };
        ApiError::new(status, self.to_string()).no_retry()
    }
}

/// A message from the page.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum ClientMessage {
    /// The first message: the API key and the terminal's size.
    Auth {
        key: String,
        #[serde(default)]
        cols: Option<u32>,
        #[serde(default)]
        rows: Option<u32>,
    },
    /// Keystrokes or a paste, as typed (UTF-8).
    Input { data: String },
    /// The element's new size in character cells.
    Resize { cols: u32, rows: u32 },
}

impl ClientMessage {
    pub fn parse(text: &str) -> Result<ClientMessage, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// A size within bounds; a missing or zero dimension takes the default's.
pub fn pty_size(cols: Option<u32>, rows: Option<u32>) -> PtySize {
    let pick = |v: Option<u32>, default: u32, max: u32| v.filter(|v| *v > 0).unwrap_or(default).min(max);
    PtySize { cols: pick(cols, DEFAULT_SIZE.cols, MAX_COLS), rows: pick(rows, DEFAULT_SIZE.rows, MAX_ROWS) }
}

fn header(h: &HeaderMap, name: impl hyper::header::AsHeaderName) -> Option<&str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// Whether an `Origin` is the server's own (its host and port as the Host header names them).
/// Browsers always send Origin on websockets; a page of another site must not reach a
/// terminal even though it would still need the key. A client without Origin (not a browser)
/// is let through to the key check.
pub fn same_origin(origin: Option<&str>, host: Option<&str>) -> bool {
    let Some(origin) = origin else { return true };
    let Some(host) = host else { return false };
    let Some(rest) = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://")) else { return false };
    rest.eq_ignore_ascii_case(host)
}

/// Checks an upgrade request; returns the `Sec-WebSocket-Accept` value to answer with.
pub fn check_handshake(method: &Method, headers: &HeaderMap) -> Result<String, HandshakeError> {
    let upgrade = header(headers, UPGRADE).is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let connection = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade")));
    if *method != Method::GET || !upgrade || !connection {
        return Err(HandshakeError::NotUpgrade);
    }
    if header(headers, SEC_WEBSOCKET_VERSION) != Some("13") {
        return Err(HandshakeError::Version);
    }
    let key = header(headers, SEC_WEBSOCKET_KEY).filter(|k| !k.is_empty()).ok_or(HandshakeError::MissingKey)?;
    if !same_origin(header(headers, ORIGIN), header(headers, HOST)) {
        return Err(HandshakeError::CrossOrigin);
    }
    Ok(tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes()))
}

/// Answers the upgrade and runs the session on the upgraded connection.
pub fn handle(app: &Arc<App>, id: &str, mut req: Request<Incoming>) -> Response<Body> {
    let accept = match check_handshake(req.method(), req.headers()) {
        Ok(a) => a,
        Err(e) => return e.into_api().into_response(),
    };
    let upgrade = hyper::upgrade::on(&mut req);
    let (app, id) = (app.clone(), id.to_string());
    tokio::spawn(async move {
        let Ok(upgraded) = upgrade.await else { return };
        let mut config = WebSocketConfig::default();
        config.max_message_size = Some(MAX_MESSAGE);
        config.max_frame_size = Some(MAX_MESSAGE);
        let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, Some(config)).await;
        session(app, id, ws).await;
    });
    let mut r = Response::new(full(""));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    if let Ok(v) = HeaderValue::from_str(&accept) {
        h.insert(SEC_WEBSOCKET_ACCEPT, v);
    }
    r
}

type Ws = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

fn status(kind: &str, message: &str) -> Message {
    Message::text(json!({"type": kind, "message": message}).to_string())
}

async fn refuse(mut ws: Ws, code: u16, message: &str) {
    let _ = ws.send(status("error", message)).await;
    let frame = CloseFrame { code: code.into(), reason: message.chars().take(100).collect::<String>().into() };
    let _ = ws.close(Some(frame)).await;
}

/// The first message, which must be a valid `auth`.
async fn authenticate(ws: &mut Ws, api_key: &str) -> Result<PtySize, &'static str> {
    let first = tokio::time::timeout(AUTH_TIMEOUT, ws.next()).await.map_err(|_| "no auth message in time")?;
    let Some(Ok(Message::Text(text))) = first else { return Err("the first message must be {\"type\":\"auth\",\"key\":...}") };
    match ClientMessage::parse(&text) {
        Ok(ClientMessage::Auth { key, cols, rows }) if crate::auth::ct_eq(&key, api_key) => Ok(pty_size(cols, rows)),
        Ok(ClientMessage::Auth { .. }) => Err("invalid API key"),
        _ => Err("the first message must be {\"type\":\"auth\",\"key\":...}"),
    }
}

/// What the process side reports to the bridge.
enum FromPty {
    Output(bytes::Bytes),
    Exit(String),
}

async fn session(app: Arc<App>, id: String, mut ws: Ws) {
    let size = match authenticate(&mut ws, &app.api_key).await {
        Ok(s) => s,
        Err(why) => return refuse(ws, CLOSE_UNAUTHORIZED, why).await,
    };
    let Some(entry) = app.sandboxes.get(&id).filter(|e| e.frozen_at().is_none()) else {
        return refuse(ws, CLOSE_NOT_FOUND, &format!("sandbox {id} is not running")).await;
    };
    // A terminal is a stream like any other of the sandbox's, under the same limit.
    let Ok(_permit) = entry.streams.clone().try_acquire_owned() else {
        return refuse(ws, 1013, "too many streams to this sandbox").await;
    };
    let client = EnvdClient::new(entry.socket.clone());
    drop(entry);
    let mut started = Err(String::new());
    for (cmd, args) in SHELLS {
        let req = StartRequest {
            process: Some(ProcessConfig {
                cmd: (*cmd).to_string(),
                args: args.iter().map(|a| (*a).to_string()).collect(),
                // The page renders plain text with a few controls; programs that ask get a
                // basic terminal rather than one with colours and alternate screens.
                envs: BTreeMap::from([("TERM".to_string(), "xterm".to_string())]),
                cwd: None,
            }),
            pty: Some(Pty { size: Some(size.clone()) }),
            tag: None,
            stdin: None,
        };
        match client.start(req, None, None).await {
            Ok(s) => {
                started = Ok(s);
                break;
            }
            Err(e) => started = Err(e.to_string()),
        }
    }
    let mut stream = match started {
        Ok(s) => s,
        Err(e) => return refuse(ws, 1011, &format!("cannot start a shell: {e}")).await,
    };
    let pid = stream.pid();
    tracing::info!(sandbox = %id, pid, "dashboard terminal opened");
    if ws.send(Message::text(json!({"type": "ready", "pid": pid}).to_string())).await.is_err() {
        let _ = client.send_signal(pid, Signal::Sigkill).await;
        return;
    }
    // The process stream is read by a task of its own, so the bridge below waits on a channel
    // (which loses nothing when a select drops a pending receive).
    let (tx, mut rx) = tokio::sync::mpsc::channel::<FromPty>(64);
    let reader = tokio::spawn(async move {
        while let Some(ev) = stream.next().await {
            let msg = match ev {
                Ok(ProcessEvent::Data(DataEvent::Pty(b) | DataEvent::Stdout(b) | DataEvent::Stderr(b))) => FromPty::Output(b),
                Ok(ProcessEvent::End(end)) => FromPty::Exit(end.status),
                Ok(_) => continue,
                Err(e) => FromPty::Exit(e.to_string()),
            };
            let last = matches!(msg, FromPty::Exit(_));
            if tx.send(msg).await.is_err() || last {
                return;
            }
        }
        let _ = tx.send(FromPty::Exit("the shell's stream ended".into())).await;
    });
    let mut exited: Option<String> = None;
    loop {
        tokio::select! {
            out = rx.recv() => match out {
                Some(FromPty::Output(b)) => {
                    if ws.send(Message::Binary(b)).await.is_err() {
                        break;
                    }
                }
                Some(FromPty::Exit(why)) => {
                    exited = Some(why);
                    break;
                }
                None => {
                    exited = Some(String::new());
                    break;
                }
            },
            msg = ws.next() => {
                let input = match msg {
                    Some(Ok(Message::Text(t))) => match ClientMessage::parse(&t) {
                        Ok(m) => m,
                        Err(e) => {
                            let _ = ws.send(status("error", &format!("bad message: {e}"))).await;
                            continue;
                        }
                    },
                    Some(Ok(Message::Binary(b))) => ClientMessage::Input { data: String::from_utf8_lossy(&b).into_owned() },
                    Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => continue,
                    Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                };
                let r = match input {
                    ClientMessage::Input { data } => client.send_pty_input(pid, data.as_bytes()).await,
                    ClientMessage::Resize { cols, rows } => {
                        let s = pty_size(Some(cols), Some(rows));
                        client.resize_pty(pid, s.cols, s.rows).await
                    }
                    ClientMessage::Auth { .. } => Ok(()),
                };
                if let Err(e) = r {
                    tracing::debug!(sandbox = %id, pid, "terminal input: {e}");
                }
            }
        }
    }
    reader.abort();
    if let Some(why) = exited {
        let _ = ws.send(Message::text(json!({"type": "exit", "message": why}).to_string())).await;
        let _ = ws.close(None).await;
    } else {
        // The page went away: the shell goes with it rather than lingering unseen.
        let _ = client.send_signal(pid, Signal::Sigkill).await;
    }
    tracing::info!(sandbox = %id, pid, "dashboard terminal closed");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    const GOOD: &[(&str, &str)] = &[
        ("host", "127.0.0.1:3000"),
        ("upgrade", "websocket"),
        ("connection", "keep-alive, Upgrade"),
        ("sec-websocket-version", "13"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("origin", "http://127.0.0.1:3000"),
    ];

    #[test]
    fn handshake_answers_the_rfc_example() {
        // RFC 6455 1.3.
        assert_eq!(check_handshake(&Method::GET, &headers(GOOD)).unwrap(), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }

    #[test]
    fn handshake_refusals() {
        let without = |name: &str| headers(&GOOD.iter().copied().filter(|(k, _)| *k != name).collect::<Vec<_>>());
        let with = |name: &'static str, v: &str| {
            let mut h = without(name);
            h.insert(name, HeaderValue::from_str(v).unwrap());
            h
        };
        assert_eq!(check_handshake(&Method::POST, &headers(GOOD)), Err(HandshakeError::NotUpgrade));
        assert_eq!(check_handshake(&Method::GET, &without("upgrade")), Err(HandshakeError::NotUpgrade));
        assert_eq!(check_handshake(&Method::GET, &with("connection", "keep-alive")), Err(HandshakeError::NotUpgrade));
        assert_eq!(check_handshake(&Method::GET, &with("sec-websocket-version", "8")), Err(HandshakeError::Version));
        assert_eq!(check_handshake(&Method::GET, &without("sec-websocket-key")), Err(HandshakeError::MissingKey));
        assert_eq!(check_handshake(&Method::GET, &with("origin", "http://evil.example")), Err(HandshakeError::CrossOrigin));
        // A non-browser client sends no Origin and still needs the key in its first message.
        assert!(check_handshake(&Method::GET, &without("origin")).is_ok());
    }

    #[test]
    fn origins() {
        assert!(same_origin(Some("http://127.0.0.1:3000"), Some("127.0.0.1:3000")));
        assert!(same_origin(Some("https://API.example.com"), Some("api.example.com")));
        assert!(same_origin(None, Some("x")));
        assert!(!same_origin(Some("http://127.0.0.1:3001"), Some("127.0.0.1:3000")));
        assert!(!same_origin(Some("null"), Some("127.0.0.1:3000")));
        assert!(!same_origin(Some("http://a.example"), None));
        assert!(!same_origin(Some("http://127.0.0.1:3000.evil.example"), Some("127.0.0.1:3000")));
    }

    #[test]
    fn messages() {
        assert_eq!(
            ClientMessage::parse(r#"{"type":"auth","key":"k","cols":120,"rows":40}"#).unwrap(),
            ClientMessage::Auth { key: "k".into(), cols: Some(120), rows: Some(40) }
        );
        assert_eq!(ClientMessage::parse(r#"{"type":"auth","key":"k"}"#).unwrap(), ClientMessage::Auth { key: "k".into(), cols: None, rows: None });
        assert_eq!(ClientMessage::parse(r#"{"type":"input","data":"\u0003"}"#).unwrap(), ClientMessage::Input { data: "\u{3}".into() });
        assert_eq!(ClientMessage::parse(r#"{"type":"resize","cols":3,"rows":2}"#).unwrap(), ClientMessage::Resize { cols: 3, rows: 2 });
        for bad in [r#"{"type":"auth"}"#, r#"{"type":"exec","cmd":"x"}"#, r#"{"data":"x"}"#, r#"{"type":"resize","cols":-1,"rows":2}"#, "not json"] {
            assert!(ClientMessage::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sizes_are_bounded() {
        assert_eq!(pty_size(None, None), DEFAULT_SIZE);
        assert_eq!(pty_size(Some(0), Some(0)), DEFAULT_SIZE);
        assert_eq!(pty_size(Some(132), Some(43)), PtySize { cols: 132, rows: 43 });
        assert_eq!(pty_size(Some(u32::MAX), Some(u32::MAX)), PtySize { cols: MAX_COLS, rows: MAX_ROWS });
    }
}
