//! Header injection: the flows to hosts with injection rules, and only those, are terminated
//! here, their requests given the rule's headers, and sent on to the real host.
//!
//! For such a flow the forwarder first dials the host (at the address it resolved itself, as
//! for any flow) and completes TLS with it, verifying its certificate against the host's trust
//! store (or `--upstream-ca`); only then does it finish the sandbox's handshake, with a leaf
//! certificate for the name signed by the egress CA ([`crate::ca`]). A host whose certificate
//! does not verify therefore fails the sandbox's handshake: nothing is sent, closed as it came.
//! Plain HTTP to such a host is handled the same way without the TLS.
//!
//! Then every request (HTTP/1.1 with keep-alive or HTTP/2 toward the sandbox, whichever it
//! offers; either toward the host, whichever it takes) is checked to name the flow's host
//! (another `Host` or `:authority` is answered 421 and never sent), given the headers of the
//! rule in force at that moment (replacing any of the same names; `${e2b.secrets.NAME}` filled
//! in from the secret store for this request), and relayed, bodies streamed both ways.
//! A rule whose secret is missing answers 502 and sends nothing. Upgrades (WebSocket) are
//! relayed once the host accepts them. The values are marked sensitive (never indexed by
//! HPACK) and appear in no log or audit record: the audit counts injections per host and
//! header name.

use crate::ca::EgressCa;
use crate::{NetError, Shared};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderName, HeaderValue, CONNECTION, HOST, UPGRADE};
use hyper::{Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use ipstack::IpStackTcpStream;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

/// Where the forwarder reads the current value of a secret a rule names.
pub trait SecretSource: Send + Sync {
    /// The value of the secret with this canonical (lower-case) name, if it exists.
    fn value(&self, name: &str) -> Option<String>;
}

/// What the forwarder needs to terminate TLS for the hosts of injection rules: the egress CA,
/// what it trusts upstream, and the secrets.
pub struct Interception {
    ca: Arc<EgressCa>,
    upstream: Arc<rustls::ClientConfig>,
    secrets: Arc<dyn SecretSource>,
    /// The TLS implementation both sides use, made once (not per connection).
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl std::fmt::Debug for Interception {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interception").field("ca", &self.ca).finish_non_exhaustive()
    }
}

const ALPN_H2: &[u8] = b"h2";
const ALPN_H1: &[u8] = b"http/1.1";
/// Streams at once on one HTTP/2 connection from a sandbox.
const MAX_H2_STREAMS: u32 = 64;
/// How long the TLS handshakes may take, each way.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);

impl Interception {
    /// `upstream_ca`: the only CAs trusted for upstream hosts (`--upstream-ca`); `None`: the
    /// host's trust store.
    pub fn new(ca: Arc<EgressCa>, upstream_ca: Option<&Path>, secrets: Arc<dyn SecretSource>) -> Result<Interception, NetError> {
        let mut roots = rustls::RootCertStore::empty();
        match upstream_ca {
            Some(p) => {
                use rustls::pki_types::pem::PemObject;
                let bad = |reason: String| NetError::UpstreamCa { path: p.display().to_string(), reason };
                let certs = rustls::pki_types::CertificateDer::pem_file_iter(p).map_err(|e| bad(e.to_string()))?;
                for c in certs {
                    roots.add(c.map_err(|e| bad(e.to_string()))?).map_err(|e| bad(e.to_string()))?;
                }
                if roots.is_empty() {
                    return Err(bad("it holds no certificate".into()));
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                for c in found.certs {
                    // One unparsable certificate in the store does not stop the others.
                    let _ = roots.add(c);
                }
                if roots.is_empty() {
                    return Err(NetError::UpstreamCa { path: "the host's trust store".into(), reason: "no CA certificate found: install ca-certificates or give --upstream-ca FILE".into() });
                }
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| NetError::UpstreamCa { path: "TLS".into(), reason: e.to_string() })?
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_H1.to_vec()];
        Ok(Interception { ca, upstream: Arc::new(cfg), secrets, provider })
    }

    pub fn ca(&self) -> &Arc<EgressCa> {
        &self.ca
    }

    fn server_config(&self, name: &str) -> Result<Arc<rustls::ServerConfig>, String> {
        let leaf = self.ca.leaf(name).map_err(|e| e.to_string())?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(Fixed(leaf)));
        cfg.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_H1.to_vec()];
        Ok(Arc::new(cfg))
    }
}

/// How many CA certificates the host's trust store holds: what upstream hosts of injection
/// rules are verified against without `--upstream-ca` (0: injection needs that flag).
pub fn host_trust_count() -> usize {
    rustls_native_certs::load_native_certs().certs.len()
}

#[derive(Debug)]
struct Fixed(Arc<rustls::sign::CertifiedKey>);

impl rustls::server::ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// One intercepted connection: where it goes and how.
struct Flow {
    shared: Arc<Shared>,
    icpt: Arc<Interception>,
    /// The host the connection named (SNI or Host), which every request must name too.
    name: String,
    targets: Vec<SocketAddr>,
    port: u16,
    tls: bool,
}

/// The connection toward the host, made again when the host closes it between requests.
enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Incoming>),
    H2(hyper::client::conn::http2::SendRequest<Incoming>),
}

impl Sender {
    fn is_usable(&self) -> bool {
        match self {
            Sender::H1(s) => !s.is_closed(),
            Sender::H2(s) => !s.is_closed() && s.is_ready(),
        }
    }
}

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

type Body = BoxBody<Bytes, hyper::Error>;

impl Flow {
    /// Dials the host at one of the forwarder's addresses and, for TLS, completes a verified
    /// handshake with it.
    async fn dial(&self) -> Result<Sender, String> {
        let tcp = crate::forward::dial(&self.targets).await.map_err(|last| format!("cannot reach {} ({last})", self.name))?;
        let (io, h2): (Box<dyn Io>, bool) = if self.tls {
            let server = ServerName::try_from(self.name.clone()).map_err(|e| format!("{}: {e}", self.name))?;
            let connector = tokio_rustls::TlsConnector::from(self.icpt.upstream.clone());
            let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(server, tcp))
                .await
                .map_err(|_| format!("TLS with {} timed out", self.name))?
                .map_err(|e| format!("TLS with {} failed: {e}", self.name))?;
            let h2 = tls.get_ref().1.alpn_protocol() == Some(ALPN_H2);
            (Box::new(tls), h2)
        } else {
            (Box::new(tcp), false)
        };
        let io = TokioIo::new(io);
        if h2 {
            let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.map_err(|e| format!("HTTP/2 with {}: {e}", self.name))?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            Ok(Sender::H2(send))
        } else {
            let (send, conn) = hyper::client::conn::http1::handshake(io).await.map_err(|e| format!("HTTP/1.1 with {}: {e}", self.name))?;
            tokio::spawn(async move {
                let _ = conn.with_upgrades().await;
            });
            Ok(Sender::H1(send))
        }
    }
}

/// Serves an intercepted connection: `first` is what the sandbox sent before it was named
/// (its ClientHello or request head), `targets` where the forwarder's policy lets it go.
pub(crate) async fn serve(shared: Arc<Shared>, icpt: Arc<Interception>, mut s: IpStackTcpStream, first: Vec<u8>, name: String, targets: Vec<SocketAddr>, tls: bool) {
    let dst = s.peer_addr();
    let flow = Arc::new(Flow { shared: shared.clone(), icpt, name, targets, port: dst.port(), tls });
    // The host first: a host that cannot be reached or does not verify resets the sandbox's
    // connection before its handshake completes, so nothing of the request is ever sent.
    let upstream = match flow.dial().await {
        Ok(u) => u,
        Err(reason) => {
            shared.audit.record("tcp", dst.to_string(), Some(flow.name.clone()), format!("injection: {reason}"));
            s.reset();
            return;
        }
    };
    let sandbox = SandboxSide::new(s, first);
    let sender = Arc::new(tokio::sync::Mutex::new(Some(upstream)));
    let service = {
        let flow = flow.clone();
        hyper::service::service_fn(move |req| {
            let (flow, sender) = (flow.clone(), sender.clone());
            async move { Ok::<_, Infallible>(handle(&flow, &sender, req).await) }
        })
    };
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http2().max_concurrent_streams(MAX_H2_STREAMS);
    if !tls {
        // Plain HTTP is HTTP/1 here (no prior-knowledge HTTP/2 to a host with rules).
        let b = builder.http1_only();
        let _ = b.serve_connection_with_upgrades(TokioIo::new(sandbox), service).await;
        return;
    }
    let cfg = match flow.icpt.server_config(&flow.name) {
        Ok(c) => c,
        Err(reason) => {
            shared.audit.record("tcp", dst.to_string(), Some(flow.name.clone()), format!("injection: {reason}"));
            return;
        }
    };
    let accepted = tokio::time::timeout(HANDSHAKE_TIMEOUT, tokio_rustls::TlsAcceptor::from(cfg).accept(sandbox)).await;
    let Ok(Ok(stream)) = accepted else { return };
    let _ = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).await;
}

fn text(status: StatusCode, msg: String) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(msg + "\n")).map_err(|never| match never {}).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

/// The host part of an authority (`Host` or `:authority`), lower-cased, port and final dot off.
fn host_of(authority: &str) -> String {
    let h = if authority.starts_with('[') {
        authority.split(']').next().map(|h| format!("{h}]")).unwrap_or_default()
    } else {
        authority.rsplit_once(':').filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit())).map_or(authority, |(h, _)| h).to_string()
    };
    h.trim_end_matches('.').to_ascii_lowercase()
}

/// Headers that belong to one hop, never relayed: those listed in `Connection` as well.
fn strip_hop_headers(h: &mut hyper::HeaderMap, keep_upgrade: bool) {
    let listed: Vec<HeaderName> = h
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in listed {
        if !(keep_upgrade && n == UPGRADE) {
            h.remove(n);
        }
    }
    for n in ["connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"] {
        if keep_upgrade && n == "upgrade" {
            continue;
        }
        h.remove(n);
    }
}

async fn handle(flow: &Flow, sender: &tokio::sync::Mutex<Option<Sender>>, mut req: Request<Incoming>) -> Response<Body> {
    let authority = req.uri().authority().map(|a| a.to_string()).or_else(|| req.headers().get(HOST).and_then(|h| h.to_str().ok()).map(str::to_string));
    let Some(authority) = authority else {
        return text(StatusCode::BAD_REQUEST, "cordon: the request names no host".into());
    };
    if host_of(&authority) != flow.name {
        flow.shared.audit.record("tcp", format!("{}:{}", flow.name, flow.port), Some(host_of(&authority)), format!("a request for {} on a connection to {}", host_of(&authority), flow.name));
        return text(StatusCode::MISDIRECTED_REQUEST, format!("cordon: this connection is to {}; open another for {}", flow.name, host_of(&authority)));
    }
    let wants_upgrade = req.version() == Version::HTTP_11 && req.headers().contains_key(UPGRADE);
    let client_upgrade = wants_upgrade.then(|| hyper::upgrade::on(&mut req));
    let client_version = req.version();
    let (mut parts, body) = req.into_parts();
    strip_hop_headers(&mut parts.headers, wants_upgrade);
    if wants_upgrade {
        parts.headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    }
    // The rule in force now: an update of the sandbox's network applies to the next request.
    let policy = flow.shared.policy();
    if let Some((_, rules)) = policy.transforms.for_host(&flow.name) {
        let lookup = |n: &str| flow.icpt.secrets.value(n);
        for r in rules {
            let value = match r.value.fill(&lookup) {
                Ok(v) => v,
                Err(e) => {
                    flow.shared.audit.record("tcp", format!("{}:{}", flow.name, flow.port), Some(flow.name.clone()), format!("injection of {}: {e}", r.name));
                    return text(StatusCode::BAD_GATEWAY, format!("cordon: not sent: {e}"));
                }
            };
            let (Ok(name), Ok(mut value)) = (HeaderName::from_bytes(r.name.as_bytes()), HeaderValue::from_str(&value)) else {
                return text(StatusCode::BAD_GATEWAY, format!("cordon: not sent: header {} could not be set", r.name));
            };
            value.set_sensitive(true);
            parts.headers.insert(name, value);
            flow.shared.audit.injected(&flow.name, &r.name);
        }
    }
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    // The connection toward the host: the one held, or a new one if the host closed it.
    let mut guard = sender.lock().await;
    if !guard.as_ref().is_some_and(Sender::is_usable) {
        match flow.dial().await {
            Ok(s) => *guard = Some(s),
            Err(reason) => {
                *guard = None;
                flow.shared.audit.record("tcp", format!("{}:{}", flow.name, flow.port), Some(flow.name.clone()), format!("injection: {reason}"));
                return text(StatusCode::BAD_GATEWAY, format!("cordon: {reason}"));
            }
        }
    }
    let sent = match guard.as_mut().expect("a connection") {
        Sender::H1(s) => {
            parts.version = Version::HTTP_11;
            parts.uri = Uri::try_from(pq).unwrap_or_else(|_| Uri::from_static("/"));
            if let Ok(h) = HeaderValue::from_str(&authority) {
                parts.headers.insert(HOST, h);
            }
            if s.ready().await.is_err() {
                *guard = None;
                return text(StatusCode::BAD_GATEWAY, format!("cordon: the connection to {} closed", flow.name));
            }
            let f = s.send_request(Request::from_parts(parts, body));
            // HTTP/1.1 carries one exchange at a time: the next request waits in `ready` above
            // until this one's response is read.
            drop(guard);
            f.await
        }
        Sender::H2(s) => {
            parts.version = Version::HTTP_2;
            let scheme = if flow.tls { "https" } else { "http" };
            parts.uri = Uri::try_from(format!("{scheme}://{authority}{pq}")).unwrap_or_else(|_| Uri::from_static("/"));
            parts.headers.remove(HOST);
            let mut s = s.clone();
            drop(guard);
            s.send_request(Request::from_parts(parts, body)).await
        }
    };
    let mut resp = match sent {
        Ok(r) => r,
        Err(e) => return text(StatusCode::BAD_GATEWAY, format!("cordon: {}: {e}", flow.name)),
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client) = client_upgrade {
            let host = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                if let (Ok(c), Ok(h)) = (client.await, host.await) {
                    let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(c), &mut TokioIo::new(h)).await;
                }
            });
        }
        let (mut parts, _) = resp.into_parts();
        parts.headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        return Response::from_parts(parts, BoxBody::default());
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_headers(&mut parts.headers, false);
    parts.version = client_version;
    Response::from_parts(parts, body.boxed())
}

/// The sandbox's end of an intercepted connection: what was read before it was named, then
/// the stream itself.
struct SandboxSide {
    head: Vec<u8>,
    at: usize,
    inner: IpStackTcpStream,
    /// Re-polls of a shutdown ipstack does not wake, on `forward::close_toward`'s schedule.
    closing: Option<Closing>,
}

struct Closing {
    attempt: u32,
    deadline: tokio::time::Instant,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl SandboxSide {
    fn new(inner: IpStackTcpStream, head: Vec<u8>) -> SandboxSide {
        SandboxSide { head, at: 0, inner, closing: None }
    }
}

impl AsyncRead for SandboxSide {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if self.at < self.head.len() {
            let n = buf.remaining().min(self.head.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.head[at..at + n]);
            self.at += n;
            if self.at == self.head.len() {
                self.head = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for SandboxSide {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Poll::Ready(r) = Pin::new(&mut self.inner).poll_shutdown(cx) {
            return Poll::Ready(r);
        }
        // ipstack sends the FIN once everything written is acknowledged but wakes nobody when
        // that happens: ask to be polled again, as `forward::close_toward` does.
        let now = tokio::time::Instant::now();
        let c = self.closing.get_or_insert_with(|| Closing { attempt: 0, deadline: now + crate::forward::SHUTDOWN_DEADLINE, timer: None });
        if now >= c.deadline {
            return Poll::Ready(Ok(()));
        }
        match crate::forward::shutdown_retry(c.attempt) {
            None => cx.waker().wake_by_ref(),
            Some(d) => {
                let timer = c.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(d)));
                timer.as_mut().reset(now + d);
                let _ = timer.as_mut().poll(cx);
            }
        }
        c.attempt += 1;
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authority_hosts() {
        assert_eq!(host_of("API.test:8443"), "api.test");
        assert_eq!(host_of("api.test."), "api.test");
        assert_eq!(host_of("[2001:db8::1]:443"), "[2001:db8::1]");
    }

    #[test]
    fn hop_headers_go_and_listed_ones_with_them() {
        let mut h = hyper::HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("keep-alive, X-Hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("authorization", HeaderValue::from_static("placeholder"));
        strip_hop_headers(&mut h, false);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("authorization"));
    }
}
