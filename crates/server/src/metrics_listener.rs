//! `--metrics-listen`: `GET /metrics` on a listener of its own, without the API key, for a
//! scraper on a private network (the main listener serves it too, behind the key). Nothing
//! else is served there: no sandbox and no API is reachable through it.

use std::convert::Infallible;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::error::ApiError;
use crate::{App, Body};

/// Serves `listener` for as long as the task runs (the server aborts it at shutdown).
pub async fn serve(listener: TcpListener, app: Arc<App>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors, say: the main listener matters more; try again shortly.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let app = app.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let app = app.clone();
                async move { Ok::<_, Infallible>(answer(&app, req)) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn answer(app: &App, req: Request<Incoming>) -> Response<Body> {
    if req.uri().path().trim_end_matches('/') != "/metrics" {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "only /metrics is served on this listener",
        )
        .into_response();
    }
    crate::api::metrics_text(app, req.method(), req.headers()).unwrap_or_else(|e| e.into_response())
}
