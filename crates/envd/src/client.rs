//! A client for envd (or `cordon-agent`) listening on a Unix socket, or reached through a
//! `cordon serve` over TCP (the server routes by the sandbox's id and checks its access token).
//!
//! Each call opens its own HTTP/1.1 connection, which keeps the client free of pooling state and
//! makes dropping a stream close exactly that stream's connection, as a disconnecting SDK does.

use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::{TcpStream, UnixStream};

use crate::connect::{
    encode_message, is_connect_json, ConnectError, EnvelopeDecoder, CONTENT_TYPE_CONNECT_JSON,
    CONTENT_TYPE_JSON, HEADER_PROTOCOL_VERSION, HEADER_TIMEOUT_MS,
};
use crate::error::{Error, Result};
use crate::files::WriteInfo;
use crate::filesystem::{
    EntryInfo, ListDirRequest, ListDirResponse, MakeDirRequest, MakeDirResponse, MoveRequest, MoveResponse,
    RemoveRequest, RemoveResponse, StatRequest, StatResponse, WatchDirRequest, WatchDirResponse,
};
use crate::process::{
    CloseStdinRequest, CloseStdinResponse, ConnectRequest, DataEvent, EndEvent, ListRequest, ListResponse,
    ProcessEvent, ProcessInfo, ProcessInput, ProcessSelector, Pty, PtySize, SendInputRequest, SendInputResponse,
    SendSignalRequest, SendSignalResponse, Signal, StartRequest, StartResponse, UpdateRequest, UpdateResponse,
};

/// Largest response message or unary body the client accepts: the agent is untrusted.
const MAX_MESSAGE: usize = 64 << 20;
/// Default limit of [`EnvdClient::download_file`].
pub const DEFAULT_MAX_DOWNLOAD: usize = 1 << 30;

/// `Authorization` value selecting `user`, the way the E2B SDK spells it.
pub fn basic_auth(user: &str) -> String {
    let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
    format!("Basic {token}")
}

/// A client for one envd socket.
#[derive(Clone, Debug)]
pub struct EnvdClient {
    socket: PathBuf,
    /// Set for a sandbox reached through a server instead of its socket.
    remote: Option<Remote>,
    max_download: usize,
}

/// A sandbox's envd behind a `cordon serve` (or E2B-compatible) data plane.
#[derive(Clone, Debug)]
struct Remote {
    /// `host:port` of the server's plain HTTP listener.
    authority: String,
    sandbox_id: HeaderValue,
    access_token: HeaderValue,
}

impl EnvdClient {
    /// A client for the agent listening on `socket`.
    pub fn new(socket: PathBuf) -> Self {
        Self { socket, remote: None, max_download: DEFAULT_MAX_DOWNLOAD }
    }

    /// A client for sandbox `sandbox_id`'s envd through the server at `authority` (`host:port`,
    /// plain HTTP): each request carries `E2b-Sandbox-Id` and the sandbox's envd access token.
    pub fn remote(authority: &str, sandbox_id: &str, access_token: &str) -> Result<Self> {
        let header = |what: &str, v: &str| HeaderValue::from_str(v).map_err(|_| Error::Protocol(format!("{what} {v:?} cannot be sent in a header")));
        let remote = Remote {
            authority: authority.to_string(),
            sandbox_id: header("sandbox id", sandbox_id)?,
            access_token: header("access token", access_token)?,
        };
        Ok(Self { socket: PathBuf::new(), remote: Some(remote), max_download: DEFAULT_MAX_DOWNLOAD })
    }

    /// Sets the largest file [`EnvdClient::download_file`] reads into memory.
    pub fn with_max_download(mut self, bytes: usize) -> Self {
        self.max_download = bytes;
        self
    }

    /// The socket path (empty for a client made by [`EnvdClient::remote`]).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn send(&self, mut req: Request<Full<Bytes>>) -> Result<Response<Incoming>> {
        let Some(remote) = &self.remote else {
            let stream = UnixStream::connect(&self.socket).await?;
            return send_on(stream, req).await;
        };
        let h = req.headers_mut();
        h.insert(HOST, HeaderValue::from_str(&remote.authority).map_err(|_| Error::Protocol(format!("server {:?} is not a host:port", remote.authority)))?);
        h.insert("e2b-sandbox-id", remote.sandbox_id.clone());
        h.insert("x-access-token", remote.access_token.clone());
        let stream = TcpStream::connect(&remote.authority).await?;
        // Interactive streams (a shell's keystrokes) should not wait for Nagle.
        let _ = stream.set_nodelay(true);
        send_on(stream, req).await
    }

    fn request(
        method: Method,
        uri: &str,
        content_type: Option<&str>,
        user: Option<&str>,
    ) -> Result<hyper::http::request::Builder> {
        let mut b = Request::builder().method(method).uri(uri).header(HOST, "localhost");
        if let Some(ct) = content_type {
            b = b.header(CONTENT_TYPE, ct);
        }
        if let Some(u) = user {
            let v = HeaderValue::from_str(&basic_auth(u))
                .map_err(|_| Error::Protocol(format!("user name {u:?} cannot be sent in a header")))?;
            b = b.header(AUTHORIZATION, v);
        }
        Ok(b)
    }

    /// Calls a unary procedure, e.g. `"/process.Process/List"`.
    pub async fn unary<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        procedure: &str,
        req: &Req,
        user: Option<&str>,
        timeout_ms: Option<u64>,
    ) -> Result<Resp> {
        let body = Bytes::from(serde_json::to_vec(req).map_err(|e| Error::Protocol(e.to_string()))?);
        let mut b = Self::request(Method::POST, procedure, Some(CONTENT_TYPE_JSON), user)?
            .header(HEADER_PROTOCOL_VERSION, "1");
        if let Some(t) = timeout_ms {
            b = b.header(HEADER_TIMEOUT_MS, t.to_string());
        }
        let req = b.body(Full::new(body)).map_err(|e| Error::Protocol(e.to_string()))?;
        let call = async {
            let resp = self.send(req).await?;
            let status = resp.status();
            let bytes = read_body(resp.into_body(), MAX_MESSAGE).await?;
            if status != StatusCode::OK {
                return Err(Error::Rpc(ConnectError::from_response(status.as_u16(), &bytes)));
            }
            serde_json::from_slice(&bytes).map_err(|e| Error::Protocol(format!("bad response to {procedure}: {e}")))
        };
        match timeout_ms {
            Some(ms) => tokio::time::timeout(Duration::from_millis(ms), call).await.unwrap_or_else(|_| {
                Err(Error::Rpc(ConnectError::new(crate::connect::Code::DeadlineExceeded, "deadline exceeded")))
            }),
            None => call.await,
        }
    }

    /// Calls a server-streaming procedure, e.g. `"/process.Process/Start"`.
    pub async fn server_stream<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        procedure: &str,
        req: &Req,
        user: Option<&str>,
        timeout_ms: Option<u64>,
    ) -> Result<ServerStream<Resp>> {
        let body = encode_message(req).map_err(|e| Error::Protocol(e.to_string()))?;
        let mut b = Self::request(Method::POST, procedure, Some(CONTENT_TYPE_CONNECT_JSON), user)?
            .header(HEADER_PROTOCOL_VERSION, "1")
            .header(crate::connect::HEADER_KEEPALIVE_INTERVAL, "50");
        if let Some(t) = timeout_ms {
            b = b.header(HEADER_TIMEOUT_MS, t.to_string());
        }
        let req = b.body(Full::new(body)).map_err(|e| Error::Protocol(e.to_string()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let ct = resp.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        if status != StatusCode::OK || !is_connect_json(&ct) {
            let bytes = read_body(resp.into_body(), MAX_MESSAGE).await?;
            return Err(Error::Rpc(ConnectError::from_response(status.as_u16(), &bytes)));
        }
        Ok(ServerStream {
            body: resp.into_body(),
            decoder: EnvelopeDecoder::new(MAX_MESSAGE),
            done: false,
            _msg: PhantomData,
        })
    }

    /// Starts a process and returns its event stream (`start` first, `end` last). Errors the
    /// server reports instead of a `start` event (bad cwd, unknown user...) are returned here.
    pub async fn start(&self, req: StartRequest, user: Option<&str>, timeout_ms: Option<u64>) -> Result<ProcessStream> {
        let inner = self.server_stream("/process.Process/Start", &req, user, timeout_ms).await?;
        ProcessStream::open(inner).await
    }

    /// Attaches to a running (or just ended) process; `not_found` is returned here.
    pub async fn connect(&self, selector: ProcessSelector, timeout_ms: Option<u64>) -> Result<ProcessStream> {
        let req = ConnectRequest { process: Some(selector) };
        let inner = self.server_stream("/process.Process/Connect", &req, None, timeout_ms).await?;
        ProcessStream::open(inner).await
    }

    /// Lists running processes.
    pub async fn list(&self) -> Result<Vec<ProcessInfo>> {
        let r: ListResponse = self.unary("/process.Process/List", &ListRequest {}, None, None).await?;
        Ok(r.processes)
    }

    /// Writes to the stdin pipe of a process.
    pub async fn send_input(&self, pid: u32, data: &[u8]) -> Result<()> {
        self.send_process_input(pid, ProcessInput::Stdin(Bytes::copy_from_slice(data))).await
    }

    /// Writes to the PTY of a process.
    pub async fn send_pty_input(&self, pid: u32, data: &[u8]) -> Result<()> {
        self.send_process_input(pid, ProcessInput::Pty(Bytes::copy_from_slice(data))).await
    }

    async fn send_process_input(&self, pid: u32, input: ProcessInput) -> Result<()> {
        let req = SendInputRequest { process: Some(ProcessSelector::Pid(pid)), input: Some(input) };
        let _: SendInputResponse = self.unary("/process.Process/SendInput", &req, None, None).await?;
        Ok(())
    }

    /// Closes the stdin pipe of a process (it then reads EOF).
    pub async fn close_stdin(&self, pid: u32) -> Result<()> {
        let req = CloseStdinRequest { process: Some(ProcessSelector::Pid(pid)) };
        let _: CloseStdinResponse = self.unary("/process.Process/CloseStdin", &req, None, None).await?;
        Ok(())
    }

    /// Sends a signal to a process.
    pub async fn send_signal(&self, pid: u32, signal: Signal) -> Result<()> {
        let req = SendSignalRequest { process: Some(ProcessSelector::Pid(pid)), signal };
        let _: SendSignalResponse = self.unary("/process.Process/SendSignal", &req, None, None).await?;
        Ok(())
    }

    /// Resizes the PTY of a process.
    pub async fn resize_pty(&self, pid: u32, cols: u32, rows: u32) -> Result<()> {
        let req = UpdateRequest {
            process: Some(ProcessSelector::Pid(pid)),
            pty: Some(Pty { size: Some(PtySize { cols, rows }) }),
        };
        let _: UpdateResponse = self.unary("/process.Process/Update", &req, None, None).await?;
        Ok(())
    }

    /// Stats a path.
    pub async fn stat(&self, path: &str, user: Option<&str>) -> Result<EntryInfo> {
        let r: StatResponse =
            self.unary("/filesystem.Filesystem/Stat", &StatRequest { path: path.into() }, user, None).await?;
        r.entry.ok_or_else(|| Error::Protocol("Stat response without entry".into()))
    }

    /// Lists a directory down to `depth` levels.
    pub async fn list_dir(&self, path: &str, depth: u32, user: Option<&str>) -> Result<Vec<EntryInfo>> {
        let req = ListDirRequest { path: path.into(), depth };
        let r: ListDirResponse = self.unary("/filesystem.Filesystem/ListDir", &req, user, None).await?;
        Ok(r.entries)
    }

    /// Creates a directory and its parents.
    pub async fn make_dir(&self, path: &str, user: Option<&str>) -> Result<EntryInfo> {
        let req = MakeDirRequest { path: path.into() };
        let r: MakeDirResponse = self.unary("/filesystem.Filesystem/MakeDir", &req, user, None).await?;
        r.entry.ok_or_else(|| Error::Protocol("MakeDir response without entry".into()))
    }

    /// Moves or renames an entry.
    pub async fn rename(&self, source: &str, destination: &str, user: Option<&str>) -> Result<EntryInfo> {
        let req = MoveRequest { source: source.into(), destination: destination.into() };
        let r: MoveResponse = self.unary("/filesystem.Filesystem/Move", &req, user, None).await?;
        r.entry.ok_or_else(|| Error::Protocol("Move response without entry".into()))
    }

    /// Removes a file or a directory tree (a missing path is not an error).
    pub async fn remove(&self, path: &str, user: Option<&str>) -> Result<()> {
        let req = RemoveRequest { path: path.into() };
        let _: RemoveResponse = self.unary("/filesystem.Filesystem/Remove", &req, user, None).await?;
        Ok(())
    }

    /// Watches a directory; the first message is `start`.
    pub async fn watch_dir(
        &self,
        req: WatchDirRequest,
        user: Option<&str>,
        timeout_ms: Option<u64>,
    ) -> Result<ServerStream<WatchDirResponse>> {
        self.server_stream("/filesystem.Filesystem/WatchDir", &req, user, timeout_ms).await
    }

    /// Writes a file (`POST /files`, octet-stream body); parents are created.
    pub async fn upload_file(&self, path: &str, user: Option<&str>, data: Bytes) -> Result<Vec<WriteInfo>> {
        let uri = files_uri(path, user);
        let req = Self::request(Method::POST, &uri, Some("application/octet-stream"), None)?
            .body(Full::new(data))
            .map_err(|e| Error::Protocol(e.to_string()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let bytes = read_body(resp.into_body(), MAX_MESSAGE).await?;
        if status != StatusCode::OK {
            return Err(Error::Rpc(ConnectError::from_response(status.as_u16(), &bytes)));
        }
        serde_json::from_slice(&bytes).map_err(|e| Error::Protocol(format!("bad /files response: {e}")))
    }

    /// Reads a whole file (`GET /files`); larger than the download limit is `resource_exhausted`.
    pub async fn download_file(&self, path: &str, user: Option<&str>) -> Result<Bytes> {
        let uri = files_uri(path, user);
        let req = Self::request(Method::GET, &uri, None, None)?
            .body(Full::new(Bytes::new()))
            .map_err(|e| Error::Protocol(e.to_string()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let bytes = match read_body(resp.into_body(), self.max_download).await {
            Err(Error::Protocol(_)) if status == StatusCode::OK => {
                return Err(Error::Rpc(ConnectError::new(
                    crate::connect::Code::ResourceExhausted,
                    format!("{path} is larger than the download limit of {} bytes", self.max_download),
                )))
            }
            r => r?,
        };
        if status != StatusCode::OK {
            return Err(Error::Rpc(ConnectError::from_response(status.as_u16(), &bytes)));
        }
        Ok(bytes)
    }

    /// `POST /init` with the sandbox-level `envVars` of a create (envd's own call, made by the
    /// host alone): the agent merges them into every later command's environment.
    pub async fn init(&self, env_vars: &std::collections::BTreeMap<String, String>) -> Result<()> {
        let body = serde_json::to_vec(&serde_json::json!({ "envVars": env_vars })).map_err(|e| Error::Protocol(e.to_string()))?;
        self.plain(Method::POST, "/init", Some(CONTENT_TYPE_JSON), Bytes::from(body)).await
    }

    /// `GET /health`: succeeds on any 2xx.
    pub async fn health(&self) -> Result<()> {
        self.plain(Method::GET, "/health", None, Bytes::new()).await
    }

    /// A plain HTTP call whose answer is only its status: any 2xx succeeds, anything else is
    /// the error the body describes.
    async fn plain(&self, method: Method, uri: &str, content_type: Option<&str>, body: Bytes) -> Result<()> {
        let req = Self::request(method, uri, content_type, None)?.body(Full::new(body)).map_err(|e| Error::Protocol(e.to_string()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let bytes = read_body(resp.into_body(), MAX_MESSAGE).await?;
        if !status.is_success() {
            return Err(Error::Rpc(ConnectError::from_response(status.as_u16(), &bytes)));
        }
        Ok(())
    }

    /// Asks `/health` until the agent answers, for at most `within`: a new sandbox's agent may
    /// still be starting. Polls at 2 ms, doubling up to 100 ms; the error is the last failure.
    pub async fn wait_healthy(&self, within: Duration) -> std::result::Result<(), String> {
        let deadline = std::time::Instant::now() + within;
        let mut delay = Duration::from_millis(2);
        loop {
            match tokio::time::timeout(Duration::from_secs(2), self.health()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) if std::time::Instant::now() >= deadline => return Err(e.to_string()),
                Err(_) if std::time::Instant::now() >= deadline => return Err("no answer to /health".into()),
                _ => {}
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(100));
        }
    }
}

/// One request on a fresh HTTP/1.1 connection over `stream`.
async fn send_on<S>(stream: S, req: Request<Full<Bytes>>) -> Result<Response<Incoming>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        // The connection ends with the response body; its error, if any, surfaces there.
        let _ = conn.await;
    });
    Ok(sender.send_request(req).await?)
}

fn files_uri(path: &str, user: Option<&str>) -> String {
    let q = crate::files::FilesQuery { path: Some(path.into()), username: user.map(String::from), ..Default::default() };
    format!("/files?{}", q.encode())
}

async fn read_body(body: Incoming, limit: usize) -> Result<Bytes> {
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => match e.downcast::<hyper::Error>() {
            Ok(h) => Err(Error::from(*h)),
            Err(e) => Err(Error::Protocol(format!("response body: {e}"))),
        },
    }
}

/// The messages of a server-streaming response.
#[derive(Debug)]
pub struct ServerStream<T> {
    body: Incoming,
    decoder: EnvelopeDecoder,
    done: bool,
    _msg: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> ServerStream<T> {
    /// The next message; `None` after a successful end of stream; an error for an end-stream
    /// error, a broken connection or a stream that ends without an end-stream envelope.
    pub async fn next(&mut self) -> Option<Result<T>> {
        if self.done {
            return None;
        }
        let r = self.next_inner().await;
        if !matches!(r, Some(Ok(_))) {
            self.done = true;
        }
        r
    }

    async fn next_inner(&mut self) -> Option<Result<T>> {
        loop {
            match self.decoder.next_envelope() {
                Err(e) => return Some(Err(e.into())),
                Ok(Some(env)) if env.is_end_stream() => {
                    return match env.end_stream() {
                        Err(e) => Some(Err(e.into())),
                        Ok(end) => end.error.map(|e| Err(Error::Rpc(e))),
                    };
                }
                Ok(Some(env)) if env.is_compressed() => {
                    return Some(Err(Error::Protocol("compressed envelope, but no compression was agreed".into())));
                }
                Ok(Some(env)) => {
                    return Some(
                        serde_json::from_slice(&env.data)
                            .map_err(|e| Error::Protocol(format!("bad stream message: {e}"))),
                    );
                }
                Ok(None) => {}
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.decoder.push(&data);
                    }
                }
                Some(Err(e)) => return Some(Err(e.into())),
                None => {
                    return Some(Err(match self.decoder.finish() {
                        Err(e) => e.into(),
                        Ok(()) => Error::Protocol("stream ended without an end-stream message".into()),
                    }))
                }
            }
        }
    }
}

/// The event stream of `Start` or `Connect`.
#[derive(Debug)]
pub struct ProcessStream {
    inner: ServerStream<StartResponse>,
    /// The first event, read when the stream was opened and not yet handed out.
    first: Option<ProcessEvent>,
    pid: u32,
}

/// Everything a process stream carried, gathered by [`ProcessStream::collect`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessOutput {
    /// From the `start` event.
    pub pid: u32,
    /// All stdout bytes.
    pub stdout: Vec<u8>,
    /// All stderr bytes.
    pub stderr: Vec<u8>,
    /// All PTY bytes.
    pub pty: Vec<u8>,
    /// The `end` event, if the stream had one.
    pub end: Option<EndEvent>,
}

impl ProcessStream {
    async fn open(inner: ServerStream<StartResponse>) -> Result<ProcessStream> {
        let mut s = ProcessStream { inner, first: None, pid: 0 };
        match s.next_raw().await {
            Some(Ok(ev)) => {
                if let ProcessEvent::Start(st) = &ev {
                    s.pid = st.pid;
                }
                s.first = Some(ev);
                Ok(s)
            }
            Some(Err(e)) => Err(e),
            None => Err(Error::Protocol("the stream ended before its first event".into())),
        }
    }

    /// The pid from the `start` event (0 if the stream did not begin with one).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The next event (messages without an event are skipped).
    pub async fn next(&mut self) -> Option<Result<ProcessEvent>> {
        if let Some(ev) = self.first.take() {
            return Some(Ok(ev));
        }
        self.next_raw().await
    }

    async fn next_raw(&mut self) -> Option<Result<ProcessEvent>> {
        loop {
            match self.inner.next().await? {
                Ok(StartResponse { event: Some(e) }) => return Some(Ok(e)),
                Ok(StartResponse { event: None }) => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// Reads the stream to its end, gathering output; keepalives are dropped.
    pub async fn collect(mut self) -> Result<ProcessOutput> {
        let mut out = ProcessOutput::default();
        while let Some(ev) = self.next().await {
            match ev? {
                ProcessEvent::Start(s) => out.pid = s.pid,
                ProcessEvent::Data(DataEvent::Stdout(b)) => out.stdout.extend_from_slice(&b),
                ProcessEvent::Data(DataEvent::Stderr(b)) => out.stderr.extend_from_slice(&b),
                ProcessEvent::Data(DataEvent::Pty(b)) => out.pty.extend_from_slice(&b),
                ProcessEvent::End(e) => out.end = Some(e),
                ProcessEvent::Keepalive(_) => {}
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_auth_matches_the_sdk() {
        assert_eq!(basic_auth("root"), "Basic cm9vdDo=");
        assert_eq!(basic_auth("user"), "Basic dXNlcjo=");
    }

    #[test]
    fn files_uri_encodes() {
        assert_eq!(files_uri("/a b/c&d.txt", Some("u")), "/files?path=/a%20b/c%26d.txt&username=u");
    }
}
