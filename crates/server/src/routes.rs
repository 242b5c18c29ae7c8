//! Which plane a request belongs to, decided from its path and headers alone.
//!
//! The order matters (protocol notes 1.7): API paths first, because SDKs 2.7–2.2x send sandbox
//! headers on their connect call; then the `E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers; then a
//! `<port>-<id>.<domain>` Host (what `get_host()` URLs use); then the access token alone (the
//! same old SDKs drop the sandbox headers after a connect); anything else is the control plane.

use hyper::header::HOST;
use hyper::HeaderMap;

use crate::ENVD_PORT;

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// The control plane (REST API, or its own `/health`).
    Api,
    /// A port of a sandbox.
    Sandbox { id: String, port: u16 },
    /// The envd of whichever sandbox owns this access token, if any; else the control plane.
    ByToken(String),
    /// Sandbox headers that cannot be valid.
    Invalid(String),
}

const API_PREFIXES: &[&str] = &["/sandboxes", "/v2/", "/v3/", "/templates", "/snapshots", "/volumes", "/volumecontent", "/secrets", "/teams", "/cluster"];

fn is_api_path(path: &str) -> bool {
    API_PREFIXES.iter().any(|p| {
        path.strip_prefix(p).is_some_and(|rest| p.ends_with('/') || rest.is_empty() || rest.starts_with('/') || rest.starts_with('?'))
    })
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// A sandbox id as E2B shapes them: `[a-z0-9]+`, never a `-`.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// `<port>-<id>.<anything>` from a Host header.
pub fn parse_host(host: &str) -> Option<(u16, String)> {
    let (label, rest) = host.split_once('.')?;
    if rest.is_empty() {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) || !valid_id(id) {
        return None;
    }
    Some((port.parse().ok()?, id.to_string()))
}

pub fn classify(path: &str, headers: &HeaderMap) -> Route {
    if is_api_path(path) {
        return Route::Api;
    }
    if let Some(id) = header(headers, "e2b-sandbox-id") {
        if !valid_id(id) {
            return Route::Invalid(format!("E2b-Sandbox-Id {id:?} is not a sandbox id"));
        }
        let port = match header(headers, "e2b-sandbox-port") {
            None => ENVD_PORT,
            Some(p) => match p.parse::<u16>() {
                Ok(p) if p != 0 => p,
                _ => return Route::Invalid(format!("E2b-Sandbox-Port {p:?} is not a port number")),
            },
        };
        return Route::Sandbox { id: id.to_string(), port };
    }
    if let Some((port, id)) = header(headers, HOST.as_str()).and_then(parse_host) {
        if port != 0 {
            return Route::Sandbox { id, port };
        }
    }
    if let Some(token) = header(headers, "x-access-token").filter(|t| !t.is_empty()) {
        return Route::ByToken(token.to_string());
    }
    Route::Api
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    fn h(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        m
    }

    const ID: &str = "iabc123";

    #[test]
    fn api_paths_win_over_sandbox_headers() {
        let hdr = h(&[("e2b-sandbox-id", ID), ("e2b-sandbox-port", "49983"), ("x-access-token", "t")]);
        for p in ["/sandboxes", "/sandboxes/iabc/connect", "/v2/sandboxes", "/v2/sandboxes/x/connect", "/templates", "/v3/x"] {
            assert_eq!(classify(p, &hdr), Route::Api, "{p}");
        }
    }

    #[test]
    fn prefixes_match_whole_segments() {
        assert_eq!(classify("/sandboxesx", &HeaderMap::new()), Route::Api); // falls through to the API anyway
        let hdr = h(&[("e2b-sandbox-id", ID)]);
        assert_eq!(classify("/sandboxesx", &hdr), Route::Sandbox { id: ID.into(), port: ENVD_PORT });
        assert_eq!(classify("/teamsfoo", &hdr), Route::Sandbox { id: ID.into(), port: ENVD_PORT });
    }

    #[test]
    fn sandbox_headers() {
        let hdr = h(&[("e2b-sandbox-id", ID), ("e2b-sandbox-port", "49983")]);
        assert_eq!(classify("/process.Process/Start", &hdr), Route::Sandbox { id: ID.into(), port: 49983 });
        let hdr = h(&[("e2b-sandbox-id", ID), ("e2b-sandbox-port", "8080")]);
        assert_eq!(classify("/", &hdr), Route::Sandbox { id: ID.into(), port: 8080 });
        let hdr = h(&[("e2b-sandbox-id", ID)]);
        assert_eq!(classify("/health", &hdr), Route::Sandbox { id: ID.into(), port: ENVD_PORT });
    }

    #[test]
    fn bad_sandbox_headers_are_invalid() {
        assert!(matches!(classify("/health", &h(&[("e2b-sandbox-id", "../x")])), Route::Invalid(_)));
        assert!(matches!(classify("/health", &h(&[("e2b-sandbox-id", ID), ("e2b-sandbox-port", "x")])), Route::Invalid(_)));
        assert!(matches!(classify("/health", &h(&[("e2b-sandbox-id", ID), ("e2b-sandbox-port", "70000")])), Route::Invalid(_)));
        assert!(matches!(classify("/health", &h(&[("e2b-sandbox-id", ID), ("e2b-sandbox-port", "0")])), Route::Invalid(_)));
    }

    #[test]
    fn host_routing() {
        let hdr = h(&[("host", "8080-iabc123.localhost:3000")]);
        assert_eq!(classify("/index.html", &hdr), Route::Sandbox { id: ID.into(), port: 8080 });
        let hdr = h(&[("host", "49983-iabc123.e2b.app")]);
        assert_eq!(classify("/health", &hdr), Route::Sandbox { id: ID.into(), port: 49983 });
        // Headers win over the Host.
        let hdr = h(&[("host", "8080-iother.localhost"), ("e2b-sandbox-id", ID)]);
        assert_eq!(classify("/", &hdr), Route::Sandbox { id: ID.into(), port: ENVD_PORT });
        for host in ["127.0.0.1:3000", "localhost", "8080-iabc", "x-iabc.localhost", "8080-IABC.localhost", "-iabc.x", "8080-.x", "99999-iabc.x"] {
            assert_eq!(classify("/", &h(&[("host", host)])), Route::Api, "{host}");
        }
    }

    #[test]
    fn token_fallback_then_api() {
        assert_eq!(classify("/filesystem.Filesystem/Stat", &h(&[("x-access-token", "tok")])), Route::ByToken("tok".into()));
        assert_eq!(classify("/health", &HeaderMap::new()), Route::Api);
        assert_eq!(classify("/health", &h(&[("host", "127.0.0.1:3000")])), Route::Api);
    }
}
