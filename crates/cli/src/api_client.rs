//! The client side of a running `cordon serve`, shared by `inspect`, `ps`, `exec`, `shell`,
//! `cp`, `kill`, `audit` and `logs`: where the server is and its key (`--server`/`--api-key`,
//! else `$E2B_API_URL`/`$E2B_API_KEY`), its REST API, and a sandbox's envd through its data
//! plane. Every failure reads as one line that says what to do.

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use clap::Args;
use cordon_envd::EnvdClient;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::usage;

/// Where the server answers when neither `--server` nor `$E2B_API_URL` says.
const DEFAULT_SERVER: &str = "http://127.0.0.1:3000";

#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// The server, as http://HOST:PORT (default: $E2B_API_URL, else http://127.0.0.1:3000).
    #[arg(long, env = "E2B_API_URL")]
    server: Option<String>,
    /// The server's API key (default: $E2B_API_KEY).
    #[arg(long, env = "E2B_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

/// A server's answer other than success, with its message.
#[derive(Debug)]
pub struct Refused {
    pub status: u16,
    pub message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.message)?;
        if self.status == 401 {
            write!(f, ": set E2B_API_KEY (or --api-key) to the key `cordon serve` printed")?;
        }
        Ok(())
    }
}

impl std::error::Error for Refused {}

/// The server's answer to one request.
pub struct Reply {
    pub status: u16,
    /// `x-next-token`, for the lists that page.
    pub next_token: Option<String>,
    pub body: Bytes,
}

#[derive(Clone)]
pub struct Api {
    /// As given, for messages.
    server: String,
    /// `host:port`.
    authority: String,
    key: String,
}

impl Api {
    pub fn new(a: &ServerArgs) -> Result<Api> {
        let server = a.server.clone().filter(|s| !s.is_empty()).unwrap_or_else(|| DEFAULT_SERVER.into());
        let Some(authority) = server.strip_prefix("http://").map(|s| s.trim_end_matches('/').to_string()).filter(|s| !s.is_empty() && !s.contains('/')) else {
            return Err(usage(format!("server {server:?}: give http://HOST:PORT in E2B_API_URL or --server (for a TLS listener, go through a local port)")));
        };
        let key = a.api_key.clone().filter(|k| !k.is_empty()).ok_or_else(|| usage("no API key: set E2B_API_KEY or give --api-key"))?;
        Ok(Api { server, authority, key })
    }

    /// One request to the control plane (JSON body, if any).
    pub async fn request(&self, method: Method, path: &str, body: Option<&Value>) -> Result<Reply> {
        let unreachable = || format!("cannot reach {}: is `cordon serve` running there? (set E2B_API_URL or --server)", self.server);
        let stream = tokio::net::TcpStream::connect(&self.authority).await.with_context(unreachable)?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.with_context(unreachable)?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder().method(method).uri(path).header("host", &self.authority).header("x-api-key", &self.key);
        let body = match body {
            Some(v) => {
                req = req.header("content-type", "application/json");
                Bytes::from(serde_json::to_vec(v)?)
            }
            None => Bytes::new(),
        };
        let resp = sender.send_request(req.body(Full::new(body))?).await.with_context(unreachable)?;
        let status = resp.status().as_u16();
        let next_token = resp.headers().get("x-next-token").and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty()).map(str::to_string);
        let body = resp.into_body().collect().await.with_context(unreachable)?.to_bytes();
        Ok(Reply { status, next_token, body })
    }

    /// A request that must succeed: its body as JSON (`null` when empty), or the server's
    /// message as a [`Refused`] error.
    pub async fn json(&self, method: Method, path: &str, body: Option<&Value>) -> Result<(Value, Option<String>)> {
        let r = self.request(method, path, body).await?;
        if !(200..300).contains(&r.status) {
            return Err(refused(&self.server, r.status, &r.body).into());
        }
        if r.body.is_empty() {
            return Ok((Value::Null, r.next_token));
        }
        let v = serde_json::from_slice(&r.body).map_err(|_| anyhow!("{} answered {} with something other than JSON: {}", self.server, r.status, String::from_utf8_lossy(&r.body)))?;
        Ok((v, r.next_token))
    }

    pub async fn get(&self, path: &str) -> Result<Value> {
        Ok(self.json(Method::GET, path, None).await?.0)
    }

    /// Sandbox `id`'s envd through the server's data plane, with the access token a connect
    /// returns (a paused sandbox is resumed by it, as the SDKs' `connect` does).
    pub async fn envd(&self, id: &str) -> Result<EnvdClient> {
        let v = self.json(Method::POST, &format!("/sandboxes/{}/connect", check_id(id)?), Some(&serde_json::json!({}))).await?.0;
        let token = v["envdAccessToken"].as_str().unwrap_or_default();
        Ok(EnvdClient::remote(&self.authority, id, token)?)
    }
}

/// The error for a refusal: the server's own message, or a plainer one for a missing sandbox.
fn refused(server: &str, status: u16, body: &[u8]) -> Refused {
    let message = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{server} answered {status}: {}", String::from_utf8_lossy(body).trim()));
    let message = match status {
        404 if message.starts_with("sandbox ") => format!("{message} (`cordon ps --all` lists the sandboxes)"),
        _ => message,
    };
    Refused { status, message }
}

/// A sandbox id as the server shapes them, so that it can go into a path as it is.
pub fn check_id(id: &str) -> Result<&str> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) {
        return Err(usage(format!("{id:?} is not a sandbox id (lowercase letters and digits; `cordon ps` lists them)")));
    }
    Ok(id)
}

/// A runtime for one command's calls.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// An envd error in words: a Connect error's message without its code, else the error itself.
pub fn envd_error(e: cordon_envd::Error) -> anyhow::Error {
    match e {
        cordon_envd::Error::Rpc(c) => anyhow!("{}", c.message),
        e => e.into(),
    }
}
