//! The HTTP/1.1 server on the agent socket (or on each stream of a link) and the routing of its
//! paths.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use cordon_envd::connect::{Code, ConnectError};
use hyper::body::Incoming;
use hyper::header::ALLOW;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::UnixListener;

use crate::body::{json, Body};
use crate::{files, filesystem, forward, park, process_rpc, rpc, Agent, LinkEnd};

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

/// Serves every stream the host opens over `link` until the host closes it or parks it (see
/// [`crate::park`]): then the multiplexer is closed from this side, so that its last frame is
/// whole and the host can read what follows on the bare link.
pub(crate) async fn run_link<L>(link: L, agent: Arc<Agent>) -> std::io::Result<LinkEnd>
where
    L: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut acceptor = cordon_channel::Acceptor::new(link);
    let park = Arc::new(tokio::sync::Notify::new());
    loop {
        let stream = tokio::select! {
            s = acceptor.accept() => s,
            () = park.notified() => {
                acceptor.close().await?;
                return Ok(LinkEnd::Parked);
            }
        };
        let Some(stream) = stream else { return Ok(LinkEnd::Closed) };
        let stream = stream?;
        let (agent, park) = (agent.clone(), park.clone());
        // The handler runs on its own task so that `accept` keeps driving the link.
        tokio::spawn(async move {
            match park::opening(stream).await {
                Some(park::Opening::Http(s)) => serve_connection(s, agent).await,
                Some(park::Opening::Park) => park.notify_one(),
                None => {}
            }
        });
    }
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
        crate::SAVEABLE_PATH => match *req.method() {
            Method::GET => {
                let found = tokio::task::spawn_blocking(crate::saveable::blocker).await.ok().flatten();
                let (status, body) = match found {
                    None => (StatusCode::NO_CONTENT, Body::empty()),
                    Some(why) => (StatusCode::CONFLICT, Body::full(why)),
                };
                Response::builder().status(status).body(body).unwrap_or_else(|_| Response::new(Body::empty()))
            }
            _ => method_not_allowed("GET"),
        },
        "/envs" => match *req.method() {
            Method::GET => {
                let map: std::collections::BTreeMap<String, String> = agent.env().into_iter().collect();
                json(StatusCode::OK, &map)
            }
            _ => method_not_allowed("GET"),
        },
        "/init" => match *req.method() {
            Method::POST => crate::init::handle(agent, req).await,
            _ => method_not_allowed("POST"),
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
                cordon_envd::process::SERVICE => process_rpc::is_method(method),
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
                cordon_envd::process::SERVICE => process_rpc::dispatch(agent, &method, req).await,
                _ => filesystem::dispatch(agent, &method, req).await,
            }
        }
    }
}

fn not_found(path: &str) -> Response<Body> {
    rpc::unary_error(&ConnectError::not_found(format!("no route for {path}")))
}
