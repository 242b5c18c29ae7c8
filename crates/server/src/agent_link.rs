//! The agent's forwarding endpoint, as a client: asking the agent to connect to a port inside
//! the sandbox (the data plane's user ports, the start command's readiness check). Nothing here
//! knows the registry, so both the proxy and the start command use it without a cycle.

use std::path::Path;

use bytes::Bytes;
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::header::{CONNECTION, HOST, UPGRADE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

/// The agent's path for "connect me to this port" (must match the agent's forwarding
/// endpoint); a client's request for it is refused.
pub const FORWARD_PREFIX: &str = "/__cordon/forward/";
/// The protocol the agent's forwarding endpoint upgrades to.
pub const FORWARD_PROTOCOL: &str = "cordon-forward";

/// Why a request could not be passed to the agent.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("connect to the agent: {0}")]
    Connect(std::io::Error),
    #[error("{0}")]
    Http(#[from] hyper::Error),
    #[error("{0}")]
    Port(String),
}

/// Whether something inside the sandbox accepts connections on `port`: the agent answers the
/// forwarding request with 101 only after it connected to the port. The connection is then
/// dropped unused.
pub async fn port_open(socket: &Path, port: u16) -> Result<bool, ProxyError> {
    let stream = UnixStream::connect(socket).await.map_err(ProxyError::Connect)?;
    let resp = ask_forward(stream, port).await?;
    Ok(resp.status() == StatusCode::SWITCHING_PROTOCOLS)
}

/// Asks the agent, over `stream`, to connect to `port` inside the sandbox; its 101 answer
/// upgrades the stream into that connection.
pub async fn ask_forward(stream: UnixStream, port: u16) -> Result<Response<Incoming>, ProxyError> {
    let (mut sender, conn) = http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream)).await?;
    tokio::spawn(conn.with_upgrades());
    let up = Request::get(format!("{FORWARD_PREFIX}{port}"))
        .header(HOST, "cordon-agent")
        .header(CONNECTION, "upgrade")
        .header(UPGRADE, FORWARD_PROTOCOL)
        .body(Empty::new())
        .map_err(|e| ProxyError::Port(e.to_string()))?;
    Ok(sender.send_request(up).await?)
}

