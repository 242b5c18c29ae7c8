//! Secrets on the control plane: `POST/GET /secrets`, `GET/POST/DELETE /secrets/{secretID}`
//! (with the API key), where `{secretID}` is a secret's ID (`sec_…`) or its name, in any case.
//! The store (files, modes, versions, limits) is `cordon_secret`'s; this layer parses, answers
//! in E2B's shapes and status codes, and delegates.
//!
//! A value arrives in a request body and goes nowhere but the store: no answer carries it, and
//! the bodies are parsed here by hand rather than by serde's derive, whose error messages may
//! quote the offending input (a value sent as a number, say).

use std::path::Path;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Map, Value};

use crate::error::{json_response, ApiError};
use crate::{query, Body};
use cordon_secret::{Metadata, SecretError, SecretInfo, SecretStore, MAX_PAGE};

/// The store under `state_dir`, for [`crate::App::secrets`].
pub fn open(state_dir: &Path) -> Result<Arc<SecretStore>, crate::ServerError> {
    Ok(Arc::new(SecretStore::open(state_dir)?))
}

/// The store as the egress forwarder reads it, at each request.
pub struct Source(pub Arc<SecretStore>);

impl cordon_sandbox::SecretSource for Source {
    fn value(&self, name: &str) -> Option<String> {
        self.0.value(name)
    }
}

/// Routes `/secrets...` (the API key is already checked).
pub async fn handle(store: &Arc<SecretStore>, method: &Method, segs: &[&str], req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    match (method, segs) {
        (&Method::POST, ["secrets"]) => {
            let body = read_object(req).await?;
            let name = string_field(&body, "name")?.to_string();
            let value = string_field(&body, "value")?.to_string();
            let metadata = metadata_field(&body)?.unwrap_or_default();
            let store = store.clone();
            let info = blocking(move || store.create(&name, &value, metadata)).await?;
            Ok(json_response(StatusCode::CREATED, &secret_json(&info)))
        }
        (&Method::GET, ["secrets"]) => {
            let q = req.uri().query();
            let limit = match query::get(q, "limit") {
                None => MAX_PAGE,
                Some(l) => l.parse::<usize>().map_err(|_| ApiError::bad_request(format!("limit {l:?} is not a number: use 1 to {MAX_PAGE}")))?,
            };
            let token = query::get(q, "nextToken").filter(|t| !t.is_empty());
            let page = store.page(limit, token.as_deref()).map_err(api_error)?;
            let mut r = json_response(StatusCode::OK, &Value::Array(page.items.iter().map(secret_json).collect()));
            if let Some(v) = page.next_token.and_then(|t| HeaderValue::from_str(&t).ok()) {
                r.headers_mut().insert("x-next-token", v);
            }
            Ok(r)
        }
        (&Method::GET, ["secrets", key]) => {
            let info = store.get(&query::percent_decode(key, false)).map_err(api_error)?;
            Ok(json_response(StatusCode::OK, &secret_json(&info)))
        }
        (&Method::POST, ["secrets", key]) => {
            let key = query::percent_decode(key, false);
            let body = read_object(req).await?;
            let value = string_field(&body, "value")?.to_string();
            let metadata = metadata_field(&body)?;
            let store = store.clone();
            let info = blocking(move || store.update(&key, &value, metadata)).await?;
            Ok(json_response(StatusCode::OK, &secret_json(&info)))
        }
        (&Method::DELETE, ["secrets", key]) => {
            let key = query::percent_decode(key, false);
            let store = store.clone();
            blocking(move || store.delete(&key)).await?;
            Ok(Response::builder().status(StatusCode::NO_CONTENT).body(crate::full("")).expect("a valid response"))
        }
        _ => Err(ApiError::not_found(format!("no API endpoint {method} /{}", segs.join("/")))),
    }
}

/// E2B's `Secret`: never the value; `metadata` always present.
fn secret_json(s: &SecretInfo) -> Value {
    json!({
        "secretID": s.id,
        "name": s.name,
        "currentVersion": s.current_version,
        "metadata": s.metadata,
        "createdAt": s.created_at,
        "updatedAt": s.updated_at,
    })
}

/// The body as a JSON object. serde_json's syntax errors name a line and column, never the
/// text, so they are safe to return.
async fn read_object(req: Request<Incoming>) -> Result<Map<String, Value>, ApiError> {
    match crate::api::read_json::<Value>(req, false).await? {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad_request("the request body must be a JSON object")),
    }
}

fn string_field<'a>(body: &'a Map<String, Value>, key: &str) -> Result<&'a str, ApiError> {
    match body.get(key) {
        Some(Value::String(s)) => Ok(s),
        None | Some(Value::Null) => Err(ApiError::bad_request(format!("'{key}' is required: send it as a string"))),
        Some(_) => Err(ApiError::bad_request(format!("'{key}' must be a string"))),
    }
}

/// `metadata`, absent or null as `None`; an object of strings otherwise.
fn metadata_field(body: &Map<String, Value>) -> Result<Option<Metadata>, ApiError> {
    match body.get("metadata") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(ApiError::bad_request("'metadata' values must be strings")),
            })
            .collect::<Result<Metadata, _>>()
            .map(Some),
        Some(_) => Err(ApiError::bad_request("'metadata' must be an object of strings")),
    }
}

/// Runs a store change (a file written and synced) off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, SecretError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(e.to_string()))?.map_err(api_error)
}

/// E2B's status codes for the store's errors: 400 for invalid input, 409 for a taken name or a
/// full store, 404 for a missing secret.
fn api_error(e: SecretError) -> ApiError {
    match e {
        e @ (SecretError::InvalidName(_)
        | SecretError::ReservedName(_)
        | SecretError::ValueTooLarge { .. }
        | SecretError::MetadataEntries { .. }
        | SecretError::MetadataKey { .. }
        | SecretError::MetadataValue { .. }
        | SecretError::MetadataTotal { .. }
        | SecretError::InvalidLimit { .. }
        | SecretError::InvalidToken) => ApiError::bad_request(e.to_string()),
        e @ (SecretError::NameTaken(_) | SecretError::LimitReached { .. }) => ApiError::new(StatusCode::CONFLICT, e.to_string()),
        e @ SecretError::NotFound(_) => ApiError::not_found(e.to_string()),
        e => ApiError::internal(e.to_string()),
    }
}
