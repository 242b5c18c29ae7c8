//! `cordon mcp`: cordon sandboxes as tools for any agent that speaks the Model Context Protocol,
//! over stdio (one session: the client that started the process) or streamable HTTP (one
//! session per MCP session id).
//!
//! Each session gets one sandbox, made through the same [`Backend`] `cordon serve` uses when a
//! tool first needs it, and destroyed when the session ends: EOF on stdin, a closed or expired
//! HTTP session, or SIGTERM/SIGINT (the caller's `shutdown` future). The caps come from the
//! operator's [`Config`], fixed at start; see [`config`] for how a call is kept within them.

pub mod capture;
pub mod config;
pub mod exec;
pub mod sandbox;
pub mod server;
pub mod tools;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use cordon_sandbox::Backend;
use rmcp::ServiceExt;

pub use config::Config;
pub use sandbox::Pool;
pub use server::Session;

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The operator's settings do not fit together.
    #[error("{0}")]
    Config(String),
    /// The HTTP listener could not be opened.
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
}

/// Serves one MCP session on stdin/stdout until the client closes stdin or `shutdown`
/// resolves, then destroys every sandbox it made.
pub async fn serve_stdio(backend: Arc<dyn Backend>, config: Config, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    config.validate().map_err(Error::Config)?;
    let pool = Pool::new(backend, config);
    let session = Session::new(pool.clone());
    tokio::pin!(shutdown);
    let served = async {
        match session.clone().serve(rmcp::transport::stdio_pipes()).await {
            Ok(running) => {
                let ct = running.cancellation_token();
                (Some(ct), running.waiting().await.map(|r| format!("{r:?}")).unwrap_or_else(|e| e.to_string()))
            }
            // The client went away (or spoke nonsense) before the handshake finished.
            Err(e) => (None, format!("no session: {e}")),
        }
    };
    tokio::select! {
        (_, why) = served => tracing::info!("session ended: {why}"),
        () = &mut shutdown => tracing::info!("shutdown requested"),
    }
    session.close().await;
    pool.destroy_all().await;
    Ok(())
}

/// Serves MCP over streamable HTTP on `addr` (path `/mcp`) until `shutdown` resolves. Every
/// MCP session has its own sandbox; it is destroyed when the client deletes the session, when
/// the session sits idle past the session manager's keep-alive, and at shutdown.
pub async fn serve_http(
    backend: Arc<dyn Backend>,
    config: Config,
    addr: SocketAddr,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};

    config.validate().map_err(Error::Config)?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Listen { addr, source })?;
    let local = listener.local_addr().map_err(|source| Error::Listen { addr, source })?;
    eprintln!("cordon mcp: listening on http://{local}/mcp");
    let pool = Pool::new(backend, config);
    let mut http_cfg = StreamableHttpServerConfig::default();
    // Sessions carry the sandbox, so the session-based protocol is the one served here.
    http_cfg.legacy_session_mode = true;
    http_cfg.allowed_hosts.push(local.ip().to_string());
    http_cfg.allowed_hosts.push(local.to_string());
    let stop = http_cfg.cancellation_token.clone();
    let factory_pool = pool.clone();
    let service = StreamableHttpService::new(
        move || Ok(Session::new(factory_pool.clone()).session_based()),
        Arc::new(LocalSessionManager::default()),
        http_cfg,
    );
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let svc = hyper_util::service::TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
    stop.cancel();
    pool.destroy_all().await;
    Ok(())
}
