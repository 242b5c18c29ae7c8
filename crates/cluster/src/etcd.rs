//! The few etcd v3 calls the cluster makes, over etcd's own JSON gateway (`/v3/...` on every
//! client URL, part of etcd's documented API since 3.3).
//!
//! Why not the `etcd-client` crate: it compiles etcd's protobuf files with `protoc` at build
//! time, which a fresh machine does not have, and the README's first command (`cargo run`) must
//! build there; it also brings a gRPC stack into a static binary for six unary calls. The gateway
//! speaks the same API (same keys, leases and revisions), as JSON: keys and values in base64,
//! 64-bit numbers as strings.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpStream;

use crate::ClusterError;

/// How long one call may take before the next endpoint is tried.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// A lease's id, as etcd numbers it.
pub type LeaseId = i64;

/// A client of one etcd cluster, given by its client URLs.
#[derive(Debug, Clone)]
pub struct Etcd {
    /// `host:port` of each endpoint, tried in order.
    endpoints: Vec<String>,
}

impl Etcd {
    /// From `http://HOST:PORT` URLs.
    pub fn new(urls: &[String]) -> Result<Etcd, ClusterError> {
        let mut endpoints = Vec::new();
        for u in urls {
            endpoints.push(crate::host_port(u).ok_or_else(|| ClusterError::BadEndpoint(u.clone()))?.to_string());
        }
        if endpoints.is_empty() {
            return Err(ClusterError::BadSpec(String::new()));
        }
        Ok(Etcd { endpoints })
    }

    /// One gateway call, on the first endpoint that answers.
    async fn call(&self, call: &'static str, path: &str, body: Value) -> Result<Value, ClusterError> {
        let body = Bytes::from(body.to_string());
        let mut last = String::new();
        for ep in &self.endpoints {
            match tokio::time::timeout(CALL_TIMEOUT, post(ep, path, body.clone())).await {
                Ok(Ok((status, answer))) if status < 300 => {
                    return serde_json::from_slice(&answer).map_err(|e| ClusterError::BadAnswer { call, why: e.to_string() });
                }
                Ok(Ok((status, answer))) => {
                    let v: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
                    let message = v.get("message").or_else(|| v.get("error")).and_then(Value::as_str).map_or_else(|| String::from_utf8_lossy(&answer).into_owned(), str::to_string);
                    return Err(ClusterError::Refused { call, status, message });
                }
                Ok(Err(e)) => last = format!("{ep}: {e}"),
                Err(_) => last = format!("{ep}: no answer in {} s", CALL_TIMEOUT.as_secs()),
            }
        }
        Err(ClusterError::Unreachable { endpoints: self.endpoints.join(","), last })
    }

    /// A lease of `ttl` seconds.
    pub async fn grant(&self, ttl: u64) -> Result<LeaseId, ClusterError> {
        let v = self.call("lease grant", "/v3/lease/grant", json!({ "TTL": ttl })).await?;
        int(&v, "ID").ok_or_else(|| ClusterError::BadAnswer { call: "lease grant", why: format!("no ID in {v}") })
    }

    /// Renews a lease; `false` when it is gone (expired or revoked).
    pub async fn keep_alive(&self, lease: LeaseId) -> Result<bool, ClusterError> {
        let v = self.call("lease keepalive", "/v3/lease/keepalive", json!({ "ID": lease.to_string() })).await?;
        // A streamed call: the gateway wraps its one answer in `result`.
        let r = v.get("result").unwrap_or(&v);
        Ok(int(r, "TTL").unwrap_or(0) > 0)
    }

    /// Ends a lease now, and with it the keys attached to it.
    pub async fn revoke(&self, lease: LeaseId) -> Result<(), ClusterError> {
        self.call("lease revoke", "/v3/lease/revoke", json!({ "ID": lease.to_string() })).await.map(drop)
    }

    /// Sets `key`, attached to `lease` when given (the key then goes with the lease).
    pub async fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), ClusterError> {
        let mut body = json!({ "key": B64.encode(key), "value": B64.encode(value) });
        if let Some(l) = lease {
            body["lease"] = Value::String(l.to_string());
        }
        self.call("put", "/v3/kv/put", body).await.map(drop)
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &str) -> Result<(), ClusterError> {
        self.call("delete", "/v3/kv/deleterange", json!({ "key": B64.encode(key) })).await.map(drop)
    }

    /// Every key under `prefix`, with its value.
    pub async fn prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, ClusterError> {
        let v = self.call("range", "/v3/kv/range", json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix.as_bytes())) })).await?;
        let mut out = Vec::new();
        for kv in v.get("kvs").and_then(Value::as_array).into_iter().flatten() {
            let field = |name: &str| kv.get(name).and_then(Value::as_str).map(|s| B64.decode(s));
            let bad = |why: String| ClusterError::BadAnswer { call: "range", why };
            let key = field("key").ok_or_else(|| bad(format!("a kv without a key: {kv}")))?.map_err(|e| bad(e.to_string()))?;
            // An empty value is left out of the JSON altogether.
            let value = field("value").transpose().map_err(|e| bad(e.to_string()))?.unwrap_or_default();
            out.push((String::from_utf8_lossy(&key).into_owned(), value));
        }
        Ok(out)
    }
}

/// The end of the key range that holds every key starting with `prefix`: the prefix with its
/// last byte below 0xff incremented (etcd's own rule, as in `etcdctl get --prefix`).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// A 64-bit number the gateway may give as a string or a number.
fn int(v: &Value, name: &str) -> Option<i64> {
    match v.get(name)? {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

/// One POST on a connection of its own: a few calls a second at most, on a local network.
async fn post(endpoint: &str, path: &str, body: Bytes) -> Result<(u16, Bytes), String> {
    let stream = TcpStream::connect(endpoint).await.map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(hyper::header::HOST, endpoint)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/cordon/"), b"/cordon0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }

    #[test]
    fn endpoints_must_be_plain_http_host_port() {
        assert!(Etcd::new(&["http://127.0.0.1:2379".into(), "http://10.0.0.2:2379/".into()]).is_ok());
        for bad in ["https://127.0.0.1:2379", "127.0.0.1:2379", "http://127.0.0.1", "http://h:1/x", "http://"] {
            assert!(matches!(Etcd::new(&[bad.into()]), Err(ClusterError::BadEndpoint(_))), "{bad}");
        }
        assert!(Etcd::new(&[]).is_err());
    }

    #[test]
    fn numbers_come_as_strings_or_numbers() {
        assert_eq!(int(&json!({"ID": "7587862215913395203"}), "ID"), Some(7587862215913395203));
        assert_eq!(int(&json!({"TTL": 5}), "TTL"), Some(5));
        assert_eq!(int(&json!({}), "TTL"), None);
    }
}
