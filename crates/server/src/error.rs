//! Errors: [`ApiError`] is what a client sees (`{"code": int, "message": str}`, the shape every
//! SDK parser requires); [`ServerError`] is what stops the server from starting or serving.

use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};

use crate::{full, Body};

/// Why the server could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{0}")]
    Config(String),
    #[error("open the volume store: {0}")]
    Volumes(#[from] cordon_volume::VolumeError),
    #[error("open the secret store: {0}")]
    Secrets(#[from] cordon_secret::SecretError),
}

/// An error answer of the control plane or the data plane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `Should-Retry: false` tells the SDK's retrying transport not to retry 429/502/503.
    pub no_retry: bool,
    /// `Retry-After` seconds, for a 503 the SDKs should retry by themselves.
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), no_retry: false, retry_after: None }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError { no_retry: true, ..ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message) }
    }

    pub fn no_retry(mut self) -> ApiError {
        self.no_retry = true;
        self
    }

    pub fn into_response(self) -> Response<Body> {
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        let mut r = json_response(self.status, &body);
        if self.no_retry {
            r.headers_mut().insert("should-retry", HeaderValue::from_static("false"));
        }
        if let Some(secs) = self.retry_after {
            r.headers_mut().insert(hyper::header::RETRY_AFTER, HeaderValue::from(secs));
        }
        r
    }
}

/// A JSON response.
pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(full(serde_json::to_vec(value).unwrap_or_default()));
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// The data plane's answer for a sandbox that does not exist (any more), as upstream's proxy
/// gives it: the SDK reads "was not found" as "the sandbox is not running".
pub fn sandbox_not_found(id: &str) -> Response<Body> {
    let mut r = json_response(
        StatusCode::BAD_GATEWAY,
        &serde_json::json!({ "sandboxId": id, "message": "The sandbox was not found", "code": 502 }),
    );
    // Retrying cannot bring a killed sandbox back.
    r.headers_mut().insert("should-retry", HeaderValue::from_static("false"));
    r
}
