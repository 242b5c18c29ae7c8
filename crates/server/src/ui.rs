//! The dashboard at `/ui`: three static files compiled into the binary, and the terminal's
//! websocket ([`crate::terminal`]).
//!
//! The page holds no data, so it is served without the API key; the script asks the user for
//! the key, keeps it in `sessionStorage` and sends it as `X-API-KEY` on every call to the JSON
//! API, which checks it as for any client. Everything a sandbox controls (metadata, output,
//! audit entries) is put into the page as text, and the Content-Security-Policy forbids inline
//! script, so a string that looks like HTML stays a string even if some path forgot.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};

use crate::error::ApiError;
use crate::{full, App, Body};

/// Where the dashboard lives.
pub const PREFIX: &str = "/ui";

const INDEX_HTML: &str = include_str!("../ui/index.html");
const APP_JS: &str = include_str!("../ui/app.js");
const APP_CSS: &str = include_str!("../ui/app.css");

/// Only the page's own files and its own origin: no inline script or style, no frames, no
/// plugins, nothing fetched from elsewhere. `connect-src 'self'` covers the terminal's
/// `ws:`/`wss:` URL of the same host (CSP Level 3).
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; \
     connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Whether `path` belongs to the dashboard.
pub fn is_ui_path(path: &str) -> bool {
    path == PREFIX || path.strip_prefix(PREFIX).is_some_and(|rest| rest.starts_with('/'))
}

/// A static file of the dashboard: its body and media type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asset {
    pub body: &'static str,
    pub content_type: &'static str,
}

/// What a path under `/ui` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UiPath {
    Asset(Asset),
    /// The websocket of a terminal into this sandbox.
    Terminal(String),
    NotFound,
}

/// Resolves a dashboard path; the page itself answers at `/ui`, `/ui/` and `/ui/index.html`.
pub fn resolve(path: &str) -> UiPath {
    let rest = path.strip_prefix(PREFIX).unwrap_or("");
    match rest {
        "" | "/" | "/index.html" => UiPath::Asset(Asset { body: INDEX_HTML, content_type: "text/html; charset=utf-8" }),
        "/app.js" => UiPath::Asset(Asset { body: APP_JS, content_type: "text/javascript; charset=utf-8" }),
        "/app.css" => UiPath::Asset(Asset { body: APP_CSS, content_type: "text/css; charset=utf-8" }),
        _ => match rest.strip_prefix("/terminal/") {
            Some(id) if crate::routes::valid_id(id) => UiPath::Terminal(id.to_string()),
            _ => UiPath::NotFound,
        },
    }
}

/// Headers every dashboard answer carries: the page must not be framed (clickjacking of the
/// kill button), must not leak its URL, and must not be sniffed into another type.
fn secure(mut r: Response<Body>) -> Response<Body> {
    let h = r.headers_mut();
    h.insert("content-security-policy", HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    h.insert("cross-origin-opener-policy", HeaderValue::from_static("same-origin"));
    r
}

pub async fn handle(app: &Arc<App>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    match resolve(&path) {
        UiPath::Terminal(id) => secure(crate::terminal::handle(app, &id, req)),
        UiPath::NotFound => secure(ApiError::not_found(format!("no dashboard file {path}")).into_response()),
        UiPath::Asset(a) => {
            if !matches!(*req.method(), Method::GET | Method::HEAD) {
                let mut r = ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "use GET").into_response();
                r.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
                return secure(r);
            }
            let body = if *req.method() == Method::HEAD { full("") } else { full(a.body) };
            let mut r = Response::new(body);
            r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(a.content_type));
            // The files change with the binary, and an old script against a new API is worse
            // than one more small download.
            r.headers_mut().insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            secure(r)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ui_paths() {
        for p in ["/ui", "/ui/", "/ui/app.js", "/ui/terminal/iabc"] {
            assert!(is_ui_path(p), "{p}");
        }
        for p in ["/uix", "/u", "/", "/sandboxes/ui"] {
            assert!(!is_ui_path(p), "{p}");
        }
    }

    #[test]
    fn resolves_files_and_terminals() {
        for p in ["/ui", "/ui/", "/ui/index.html"] {
            assert!(matches!(resolve(p), UiPath::Asset(a) if a.content_type.starts_with("text/html")), "{p}");
        }
        assert!(matches!(resolve("/ui/app.js"), UiPath::Asset(a) if a.content_type.starts_with("text/javascript")));
        assert!(matches!(resolve("/ui/app.css"), UiPath::Asset(a) if a.content_type.starts_with("text/css")));
        assert_eq!(resolve("/ui/terminal/iabc123"), UiPath::Terminal("iabc123".into()));
        for p in ["/ui/terminal/", "/ui/terminal/../x", "/ui/terminal/ABC", "/ui/terminal/a/b", "/ui/other", "/ui/app.js/x"] {
            assert_eq!(resolve(p), UiPath::NotFound, "{p}");
        }
    }

    #[test]
    fn page_has_no_inline_script_or_outside_asset() {
        // The CSP would block them; this keeps the page honest about it.
        assert!(!INDEX_HTML.contains("<script>"), "inline script in index.html");
        assert!(!INDEX_HTML.contains("style="), "inline style in index.html");
        for f in [INDEX_HTML, APP_JS, APP_CSS] {
            assert!(!f.contains("http://") && !f.contains("https://"), "an outside URL in a dashboard file");
        }
        // Sandbox-controlled strings go in as text only.
        assert!(!APP_JS.contains("innerHTML") && !APP_JS.contains("outerHTML") && !APP_JS.contains("insertAdjacentHTML"));
        assert!(!APP_JS.contains("eval(") && !APP_JS.contains("document.write"));
    }
}
