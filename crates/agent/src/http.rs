//! The HTTP/1.1 server on the agent socket (or on each stream of a link) and the routing of its
//! paths.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use cordon_envd::connect::{Code, ConnectError};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::UnixListener;
use tokio::sync::mpsc;

use crate::{files, filesystem, forward, process_service, rpc, Agent};

/// Response bodies: a complete buffer, or a stream of chunks from a task.
pub(crate) enum Body {
    Full(Option<Bytes>),
    Channel(mpsc::Receiver<Bytes>),
}

impl Body {
    pub fn full(b: impl Into<Bytes>) -> Body {
        Body::Full(Some(b.into()))
    }

    pub fn empty() -> Body {
        Body::Full(None)
    }

    pub fn channel(rx: mpsc::Receiver<Bytes>) -> Body {
        Body::Channel(rx)
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Channel(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Body::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Body::Full(None) => SizeHint::with_exact(0),
            Body::Channel(_) => SizeHint::default(),
        }
    }
}

/// Reads a whole request body, refusing more than `limit` bytes.
pub(crate) async fn read_limited(body: Incoming, limit: usize) -> Result<Bytes, ConnectError> {
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ConnectError::new(
            Code::ResourceExhausted,
            format!("request body exceeds the limit of {limit} bytes"),
        )),
        Err(e) => Err(ConnectError::new(Code::Canceled, format!("error reading the request body: {e}"))),
    }
}

/// A JSON response.
pub(crate) fn json(status: StatusCode, value: &impl serde::Serialize) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"null".to_vec());
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "application/json")
        .body(Body::full(body))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

fn method_not_allowed(allow: &'static str) -> Response<Body> {
    let e = ConnectError::new(Code::Unimplemented, format!("method not allowed; use {allow}"));
    let mut r = rpc::unary_error(&e);
    *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    r.headers_mut().insert(ALLOW, hyper::header::HeaderValue::from_static(allow));
    r
}

/// Accepts connections until the listener fails for good.
pub(crate) async fn run(listener: UnixListener, agent: Arc<Agent>) -> std::io::Result<()> {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) if is_transient(&e) => {
                // Out of descriptors or memory: back off instead of spinning or giving up.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        tokio::spawn(serve_connection(stream, agent.clone()));
    }
}

/// Serves every stream the host opens over `link` until the host closes it.
pub(crate) async fn run_link<L>(link: L, agent: Arc<Agent>) -> std::io::Result<()>
where
    L: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut acceptor = cordon_channel::Acceptor::new(link);
    while let Some(stream) = acceptor.accept().await {
        // The handler runs on its own task so that `accept` keeps driving the link.
        tokio::spawn(serve_connection(stream?, agent.clone()));
    }
    Ok(())
}

/// One HTTP/1.1 connection from the host, upgrades included.
async fn serve_connection<S>(stream: S, agent: Arc<Agent>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req| {
        let agent = agent.clone();
        async move { Ok::<_, Infallible>(route(agent, req).await) }
    });
    // Connection errors (a client hanging up mid-stream) only concern that connection.
    let _ = http1::Builder::new().keep_alive(true).serve_connection(TokioIo::new(stream), service).with_upgrades().await;
}

fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::ECONNABORTED | libc::EINTR | libc::EAGAIN)
    )
}

async fn route(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    if path.starts_with(forward::PREFIX) {
        return forward::handle(req).await;
    }
    match path.as_str() {
        "/health" => match *req.method() {
            Method::GET | Method::HEAD => Response::builder()
                .status(StatusCode::NO_CONTENT)
                .body(Body::empty())
                .unwrap_or_else(|_| Response::new(Body::empty())),
            _ => method_not_allowed("GET"),
        },
        "/envs" => match *req.method() {
            Method::GET => {
                let map: std::collections::BTreeMap<&str, &str> =
                    agent.config.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                json(StatusCode::OK, &map)
            }
            _ => method_not_allowed("GET"),
        },
        "/files" => match *req.method() {
            Method::GET | Method::HEAD => files::download(agent, req).await,
            Method::POST | Method::PUT => files::upload(agent, req).await,
            _ => method_not_allowed("GET, POST"),
        },
        _ => {
            let Some((service, method)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
                return not_found(&path);
            };
            let known = match service {
                cordon_envd::process::SERVICE => process_service::is_method(method),
                cordon_envd::filesystem::SERVICE => filesystem::is_method(method),
                _ => return not_found(&path),
            };
            if !known {
                let e = ConnectError::new(Code::Unimplemented, format!("procedure {path} is not implemented"));
                let mut r = rpc::unary_error(&e);
                *r.status_mut() = StatusCode::NOT_FOUND;
                return r;
            }
            if req.method() != Method::POST {
                return method_not_allowed("POST");
            }
            let method = method.to_string();
            match service {
                cordon_envd::process::SERVICE => process_service::dispatch(agent, &method, req).await,
                _ => filesystem::dispatch(agent, &method, req).await,
            }
        }
    }
}

fn not_found(path: &str) -> Response<Body> {
    rpc::unary_error(&ConnectError::not_found(format!("no route for {path}")))
}
