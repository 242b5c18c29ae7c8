//! Ports that need a credential: an image's start command may declare that its port (the code
//! interpreter's 49999, which runs code for whoever reaches it) takes only requests that carry
//! the sandbox's envd access token, not everyone who knows the sandbox id.
//!
//! The official code-interpreter SDK sends `X-Access-Token: <envdAccessToken>` on `/execute` and
//! `E2B-Traffic-Access-Token: <trafficAccessToken>` on every call (the context calls carry
//! nothing else), so either one is accepted. The traffic token is a second per-sandbox secret
//! that opens these ports and nothing more: envd does not take it. Both headers are removed
//! before the request goes on, so a process inside the sandbox that listens on the port in the
//! service's place never learns a credential.

use hyper::HeaderMap;

use crate::auth;
use crate::error::ApiError;
use crate::registry::LiveSandbox;

/// The header the SDKs put the envd access token in.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// The header the code-interpreter SDK puts the traffic access token in.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// Checks a request to `port` of `entry`, a port that needs the token, and strips the
/// credentials from `headers`.
pub fn check(entry: &LiveSandbox, port: u16, headers: &mut HeaderMap) -> Result<(), ApiError> {
    let given = |name: &str| headers.get(name).map(|v| v.to_str().unwrap_or(""));
    let ok = match (given(ACCESS_TOKEN_HEADER), given(TRAFFIC_TOKEN_HEADER)) {
        (None, None) => {
            return Err(ApiError::unauthorized(format!(
                "port {port} of sandbox {} needs the sandbox's access token: send X-Access-Token (envdAccessToken) \
                 or E2B-Traffic-Access-Token (trafficAccessToken)",
                entry.id
            )))
        }
        // A wrong value in either header fails, even if the other one is right.
        (a, t) => {
            a.is_none_or(|a| auth::ct_eq(a, &entry.token)) && t.is_none_or(|t| auth::ct_eq(t, &entry.traffic_token))
        }
    };
    if !ok {
        return Err(ApiError::unauthorized(format!("invalid access token for port {port} of sandbox {}", entry.id)));
    }
    headers.remove(ACCESS_TOKEN_HEADER);
    headers.remove(TRAFFIC_TOKEN_HEADER);
    Ok(())
}
