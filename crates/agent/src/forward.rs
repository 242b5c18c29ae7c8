//! Port forwarding for the host: `GET /__cordon/forward/<port>` with `Upgrade: cordon-forward`
//! answers 101 and then splices the connection to `127.0.0.1:<port>` inside the sandbox.
//!
//! The sandbox's network namespace has only loopback, so a server a user starts inside (say
//! `python3 -m http.server 8080`) is reachable from nowhere but here. The host sends its
//! request bytes over the upgraded connection unchanged, which keeps this side protocol-blind:
//! HTTP/1.1, websockets or anything else a user runs on that port.

use std::net::{Ipv4Addr, SocketAddr};

use hyper::body::Incoming;
use hyper::header::{CONNECTION, UPGRADE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use crate::body::{json, Body};

/// Path prefix of the forwarding endpoint.
pub(crate) const PREFIX: &str = "/__cordon/forward/";
/// The protocol name the host must ask for in `Upgrade`.
pub(crate) const PROTOCOL: &str = "cordon-forward";

fn error(status: StatusCode, message: String) -> Response<Body> {
    json(status, &serde_json::json!({ "code": status.as_u16(), "message": message }))
}

/// Connects to the port first, so that a closed port is a plain 502 answer rather than an
/// upgraded connection that dies at once.
pub(crate) async fn handle(req: Request<Incoming>) -> Response<Body> {
    let Some(port) = req.uri().path().strip_prefix(PREFIX).and_then(|p| p.parse::<u16>().ok()).filter(|p| *p != 0) else {
        return error(StatusCode::BAD_REQUEST, format!("use {PREFIX}<port> with a port between 1 and 65535"));
    };
    let asks_upgrade = req
        .headers()
        .get(UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(PROTOCOL));
    if !asks_upgrade {
        return error(StatusCode::BAD_REQUEST, format!("forwarding needs `Upgrade: {PROTOCOL}`"));
    }
    let target = match tokio::net::TcpStream::connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await {
        Ok(s) => s,
        Err(e) => {
            return error(StatusCode::BAD_GATEWAY, format!("port is not open: nothing listens on port {port} in the sandbox ({e})"))
        }
    };
    let _ = target.set_nodelay(true);
    tokio::spawn(async move {
        let Ok(upgraded) = hyper::upgrade::on(req).await else { return };
        let mut client = TokioIo::new(upgraded);
        let mut target = target;
        // Either side closing ends the splice; errors only concern this one connection.
        let _ = tokio::io::copy_bidirectional(&mut client, &mut target).await;
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(CONNECTION, "upgrade")
        .header(UPGRADE, PROTOCOL)
        .body(Body::empty())
        .unwrap_or_else(|_| Response::new(Body::empty()))
}
