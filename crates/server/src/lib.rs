//! `cordon serve`: the API the official E2B SDKs speak, on one port.
//!
//! - The control plane (`/sandboxes`, `/v2/sandboxes`, ...) creates, lists, extends and kills
//!   sandboxes; it is guarded by an API key on `X-API-KEY`.
//! - The data plane forwards envd traffic (port 49983) to the agent socket of the addressed
//!   sandbox, checking its per-sandbox `envdAccessToken`, and traffic for any other port through
//!   the agent's forwarding endpoint to that port inside the sandbox.
//!
//! Which plane a request belongs to is decided in [`routes`], in the order the protocol notes
//! prescribe. Sandboxes live in the [`registry::Sandboxes`] registry, the only part that talks
//! to a [`cordon_sandbox::Backend`] (every tier, in production); the HTTP layer never touches
//! namespaces.

pub mod adoption;
pub mod agent_link;
pub mod api;
pub mod auth;
pub mod cluster;
pub mod error;
pub mod first_build;
pub mod fork;
pub mod isolation;
pub mod lifecycle;
pub mod metrics;
pub mod metrics_listener;
pub mod network;
pub mod pause;
pub mod pool;
pub mod port_token;
pub mod proxy;
pub mod query;
pub mod request_id;
pub mod registry;
pub mod routes;
pub mod sandbox_logs;
pub mod saved;
pub mod secrets;
pub mod server_metrics;
pub mod snapshots;
pub mod start_command;
pub mod template_list;
pub mod templates;
pub mod terminal;
pub mod tls;
pub mod traffic;
pub mod ui;
pub mod volume_content;
pub mod volume_token;
pub mod volumes;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

pub use error::{ApiError, ServerError};
pub use registry::Sandboxes;

/// The body of every response: a buffer for API answers, a stream for proxied ones.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// A complete response body.
pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never: Infallible| match never {}).boxed()
}

/// The envd version reported when none is configured: the agent implements every feature
/// gate up to it (default user, octet-stream and gzip upload, file metadata, `include_entry`,
/// CloseStdin, StreamInput).
pub const DEFAULT_ENVD_VERSION: &str = "0.6.13";

/// The envd port of every sandbox, as the SDKs hard-code it.
pub const ENVD_PORT: u16 = 49983;

/// What the server needs besides the registry.
pub struct App {
    pub api_key: String,
    pub sandboxes: Arc<Sandboxes>,
    /// The image store: the templates sandboxes are made from.
    pub images: cordon_image::Store,
    /// What a create's network fields mean (`--network-default`).
    pub network_default: network::NetworkDefault,
    /// The sandboxes' domain (`--domain`), returned on create and connect, so that the SDKs'
    /// `get_host()` URLs (`<port>-<id>.<domain>`) point here.
    pub domain: Option<String>,
    /// TLS on the listener, when configured (see [`tls`]).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// Recipes' images being built for the creates that asked for them; `None` leaves the
    /// first use of a recipe to the backend (which then builds it inside the create).
    pub builds: Option<first_build::FirstBuilds>,
    /// Template builds through the API (`Template()` of the SDKs); `None` answers them 501.
    pub templates: Option<Arc<templates::Templates>>,
    /// Volumes (`/volumes`, `/volumecontent`, `volumeMounts`); `None` answers them 501.
    pub volumes: Option<Arc<volumes::VolumeApi>>,
    /// Secrets (`/secrets`); `None` answers them 501.
    pub secrets: Option<Arc<cordon_secret::SecretStore>>,
    /// The cluster this server is a node of, once it has joined (see [`cluster`]).
    pub cluster: std::sync::OnceLock<Arc<cordon_cluster::Cluster>>,
}

impl App {
    /// The value of the secret named `name` (in any case), if this server keeps secrets and
    /// has it: what a sandbox's egress substitutes for `${e2b.secrets.<name>}`.
    pub fn secret_value(&self, name: &str) -> Option<String> {
        self.secrets.as_ref()?.value(name)
    }

    /// Routes one request to the control plane or to a sandbox, inside a span that gives every
    /// log line of it the request's id (the client's `X-Request-Id` when it sends a usable one, a
    /// fresh one otherwise), which the response carries back.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        use tracing::Instrument as _;
        let id = request_id::of(req.headers());
        let span = tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.uri().path(), sandbox_id = tracing::field::Empty);
        let mut resp = self.route(req).instrument(span).await;
        if let Ok(v) = hyper::header::HeaderValue::from_str(&id) {
            resp.headers_mut().insert(request_id::HEADER, v);
        }
        resp
    }

    async fn route(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let route = routes::classify(req.uri().path(), req.headers());
        // On a cluster, a request for another node's sandbox (or a create, or a list) is the
        // front door's; what it hands back is this node's to serve.
        let req = match self.cluster.get() {
            Some(c) => match cluster::route(&self, c, &route, req).await {
                Ok(answered) => return answered,
                Err(mine) => mine,
            },
            None => req,
        };
        match route {
            // A signed `/files` URL made from E2B_SANDBOX_URL names no sandbox: the signature,
            // made with one sandbox's token, is what identifies it.
            routes::Route::Api if req.uri().path() == "/files" => match proxy::signed_by(&self.sandboxes, &req) {
                Ok(Some(entry)) => proxy::handle(&self, &entry.id, ENVD_PORT, req).await,
                Ok(None) => api::handle(&self, req).await,
                Err(e) => e.into_response(),
            },
            routes::Route::Api => api::handle(&self, req).await,
            routes::Route::Sandbox { id, port } => {
                tracing::Span::current().record("sandbox_id", id.as_str());
                proxy::handle(&self, &id, port, req).await
            }
            routes::Route::ByToken(token) => match self.sandboxes.by_token(&token) {
                Some(entry) => {
                    tracing::Span::current().record("sandbox_id", entry.id.as_str());
                    proxy::handle(&self, &entry.id, ENVD_PORT, req).await
                }
                None => api::handle(&self, req).await,
            },
            routes::Route::Invalid(msg) => ApiError::bad_request(msg).into_response(),
        }
    }
}

/// Serves `listener` until `shutdown` resolves, then destroys every sandbox.
/// How long a client has to finish its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// HTTP/1.1 (with upgrades, for websockets) on one accepted connection, plain or TLS.
async fn serve_connection<I>(io: I, app: Arc<App>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req| {
        let app = app.clone();
        async move { Ok::<_, Infallible>(app.handle(req).await) }
    });
    // A client hanging up mid-stream only ends its own connection.
    let _ = http1::Builder::new().keep_alive(true).serve_connection(TokioIo::new(io), service).with_upgrades().await;
}

/// What a server does with its sandboxes when told to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Leaves the sandboxes of the tiers that can outlive the server running, for the next
    /// server on the same state directory to adopt (see [`adoption`]); destroys the rest as
    /// `Destroy` does.
    Keep,
    /// Destroys every sandbox at once (one paused in place is kept paused to its files).
    Destroy,
    /// Refuses new sandboxes and serves the live ones until they have all ended (killed,
    /// timed out) or `grace` has passed, then destroys what is left.
    Drain { grace: Duration },
}

/// How often a draining server looks whether its last sandbox has ended.
const DRAIN_POLL: Duration = Duration::from_millis(250);

/// [`serve_until`] with [`ShutdownMode::Destroy`].
pub async fn serve(listener: TcpListener, app: Arc<App>, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
    serve_until(listener, app, shutdown, ShutdownMode::Destroy).await
}

/// Serves `listener` until `shutdown` resolves, then ends as `mode` says.
pub async fn serve_until(listener: TcpListener, app: Arc<App>, shutdown: impl Future<Output = ()>, mode: ShutdownMode) -> Result<(), ServerError> {
    let sweeper = tokio::spawn(lifecycle::sweep(app.sandboxes.clone()));
    tokio::pin!(shutdown);
    let mut drain_until: Option<std::time::Instant> = None;
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) if lifecycle::is_transient(&e) => {
                    // Out of descriptors: back off instead of spinning; live connections go on.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(e) => {
                    sweeper.abort();
                    app.sandboxes.destroy_all().await;
                    return Err(ServerError::Io { what: "accept".into(), source: e });
                }
            },
            () = &mut shutdown, if drain_until.is_none() => match mode {
                ShutdownMode::Destroy | ShutdownMode::Keep => break,
                ShutdownMode::Drain { grace } => {
                    app.sandboxes.begin_drain().await;
                    tracing::info!(sandboxes = app.sandboxes.len(), grace_s = grace.as_secs(), "draining: new sandboxes refused; the server stops once the live ones end or the grace passes");
                    drain_until = Some(std::time::Instant::now() + grace);
                    continue;
                }
            },
            () = tokio::time::sleep(DRAIN_POLL), if drain_until.is_some() => {
                if app.sandboxes.is_empty() || drain_until.is_some_and(|t| std::time::Instant::now() >= t) {
                    break;
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        tokio::spawn(async move {
            match app.tls.clone() {
                None => serve_connection(stream, app).await,
                // A handshake that does not finish in time only costs its own task.
                Some(tls) => {
                    if let Ok(Ok(s)) = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
                        serve_connection(s, app).await;
                    }
                }
            }
        });
    }
    sweeper.abort();
    match mode {
        ShutdownMode::Keep => app.sandboxes.leave_all().await,
        _ => app.sandboxes.destroy_all().await,
    }
    Ok(())
}
