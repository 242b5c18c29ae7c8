//! Who may reach a sandbox's own ports (everything but envd), and what Host they see.
//!
//! E2B's `network.allowPublicTraffic: false` makes every non-envd port take only requests that
//! carry the sandbox's `trafficAccessToken` in `e2b-traffic-access-token`, answered 403 with
//! E2B's own messages otherwise; the header is removed before the request goes on, so a process
//! in the sandbox never learns it. `network.maskRequestHost` replaces the Host header the
//! service inside sees (`${PORT}` becomes the port), so that a dev server that checks its Host
//! sees the name it expects instead of `8000-<id>.<domain>`.

use hyper::header::{HeaderValue, HOST};
use hyper::http::uri::Authority;
use hyper::{HeaderMap, StatusCode};

use crate::auth;
use crate::error::ApiError;
use crate::port_token::TRAFFIC_TOKEN_HEADER;
use crate::registry::LiveSandbox;

/// The placeholder `maskRequestHost` may hold.
const PORT_PLACEHOLDER: &str = "${PORT}";

/// A sandbox's public-traffic settings, as given at create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Traffic {
    /// `allowPublicTraffic`: `false` closes the ports to requests without the traffic token.
    pub public: bool,
    /// `maskRequestHost`, checked at create.
    pub mask_host: Option<String>,
}

impl Default for Traffic {
    fn default() -> Traffic {
        Traffic { public: true, mask_host: None }
    }
}

impl Traffic {
    /// Checks `maskRequestHost`: ASCII `host[:port]`, where `${PORT}` may stand for a port.
    pub fn new(public: Option<bool>, mask_host: Option<String>) -> Result<Traffic, ApiError> {
        if let Some(m) = &mask_host {
            let sample = m.replace(PORT_PLACEHOLDER, "8000");
            let valid = !sample.is_empty()
                && sample.is_ascii()
                && !sample.contains(['@', '/', '?', '#', ' '])
                && sample.parse::<Authority>().is_ok_and(|a| !a.host().is_empty());
            if !valid {
                return Err(ApiError::bad_request(format!(
                    "network.maskRequestHost {m:?} is not a host: use ASCII host[:port], where ${{PORT}} stands for the port"
                )));
            }
        }
        Ok(Traffic { public: public.unwrap_or(true), mask_host })
    }

    /// Lets a request to `port` (not envd's) of `entry` through or answers it as E2B does, and
    /// rewrites its headers: the traffic token is removed, the Host masked. `token_checked`: the
    /// port's own token check (see [`crate::port_token`]) already let it through.
    pub fn admit(&self, entry: &LiveSandbox, port: u16, token_checked: bool, headers: &mut HeaderMap) -> Result<(), ApiError> {
        if !self.public && !token_checked {
            let refused = |what: &str| ApiError::new(StatusCode::FORBIDDEN, format!("Sandbox is secured with traffic access token. {what}")).no_retry();
            match headers.get(TRAFFIC_TOKEN_HEADER).map(|v| v.to_str().unwrap_or("")) {
                None => return Err(refused(&format!("Token header '{TRAFFIC_TOKEN_HEADER}' is missing"))),
                Some(t) if !auth::ct_eq(t, &entry.traffic_token) => {
                    return Err(refused(&format!("Provided token in header '{TRAFFIC_TOKEN_HEADER}' is invalid")))
                }
                Some(_) => {}
            }
            headers.remove(TRAFFIC_TOKEN_HEADER);
        }
        if let Some(m) = &self.mask_host {
            if let Ok(v) = HeaderValue::from_str(&m.replace(PORT_PLACEHOLDER, &port.to_string())) {
                headers.insert(HOST, v);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_request_host_takes_host_and_port_forms_only() {
        for ok in ["localhost", "localhost:${PORT}", "app.internal:8080", "127.0.0.1:${PORT}", "[::1]:3000"] {
            assert!(Traffic::new(None, Some(ok.into())).is_ok(), "{ok} refused");
        }
        for bad in ["", "ho st", "user@host", "host/path", "hóst", "host:port:1", "http://host", ":80"] {
            assert!(Traffic::new(None, Some(bad.into())).is_err(), "{bad:?} accepted");
        }
        assert!(Traffic::new(None, None).unwrap().public);
        assert!(!Traffic::new(Some(false), None).unwrap().public);
    }
}
