//! Credentials: the API key of the control plane, the per-sandbox envd access token, and the
//! `/files` URL signatures the SDK's `download_url()`/`upload_url()` produce.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use base64::Engine;
use sha2::{Digest, Sha256};

use crate::error::ServerError;

/// Equality whose time does not depend on where the inputs differ, so that a client cannot
/// learn a key byte by byte from response times.
pub fn ct_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The control plane's check of `X-API-KEY`.
pub fn check_api_key(headers: &hyper::HeaderMap, api_key: &str) -> Result<(), crate::ApiError> {
    let key = headers.get("x-api-key").and_then(|v| v.to_str().ok()).unwrap_or("");
    if ct_eq(key, api_key) {
        return Ok(());
    }
    Err(crate::ApiError::unauthorized(if key.is_empty() { "missing API key: send it in the X-API-KEY header" } else { "invalid API key" }))
}

/// The API key as a scraper sends it: `X-API-KEY`, or `Authorization: Bearer KEY` (what
/// Prometheus' `authorization` setting sends).
pub fn check_scrape_key(headers: &hyper::HeaderMap, api_key: &str) -> Result<(), crate::ApiError> {
    let bearer = headers.get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    match bearer {
        Some(key) if ct_eq(key.trim(), api_key) => Ok(()),
        Some(_) => Err(crate::ApiError::unauthorized("invalid API key")),
        None => check_api_key(headers, api_key),
    }
}

fn random_hex(bytes: usize) -> String {
    let mut raw = vec![0u8; bytes];
    getrandom::fill(&mut raw).expect("the kernel's random source is available");
    raw.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh API key, `e2b_` + 40 hex digits: SDKs 2.30–2.45 check `^e2b_[0-9a-f]+$` client-side.
pub fn new_api_key() -> String {
    format!("e2b_{}", random_hex(20))
}

/// A fresh envd access token for one sandbox.
pub fn new_access_token() -> String {
    random_hex(32)
}

/// Where the generated key is kept.
pub fn api_key_path(state_dir: &Path) -> std::path::PathBuf {
    state_dir.join("api-key")
}

/// The stored API key, or a new one written with mode 0600 (`created` is then true).
pub fn load_or_create_api_key(state_dir: &Path) -> Result<(String, bool), ServerError> {
    let path = api_key_path(state_dir);
    let io = |what: &str| {
        let what = format!("{what} {}", path.display());
        move |source| ServerError::Io { what, source }
    };
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => return Ok((s.trim().to_string(), false)),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("read")(e)),
    }
    let key = new_api_key();
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp).map_err(io("create"))?;
    f.write_all(format!("{key}\n").as_bytes()).map_err(io("write"))?;
    f.sync_all().map_err(io("write"))?;
    std::fs::rename(&tmp, &path).map_err(io("write"))?;
    Ok((key, true))
}

/// `/files` operation a signature grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOp {
    Read,
    Write,
}

/// `"v1_" + base64_nopad(sha256("{path}:{op}:{user}:{token}[:{expiration}]"))`.
pub fn file_signature(path: &str, op: FileOp, user: &str, token: &str, expiration: Option<i64>) -> String {
    let op = match op {
        FileOp::Read => "read",
        FileOp::Write => "write",
    };
    let raw = match expiration {
        Some(exp) => format!("{path}:{op}:{user}:{token}:{exp}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest))
}

/// envd's answers to a bad signed URL (the SDK shows them as they are).
pub const INVALID_SIGNATURE: &str = "invalid signature";
pub const EXPIRED_SIGNATURE: &str = "signature is already expired";

/// Whether `signature` was made with `token` for this path, operation, user and expiration,
/// whatever the time now: it names the sandbox a signed URL belongs to, expired or not.
pub fn file_signature_matches(signature: &str, expiration: Option<&str>, path: &str, op: FileOp, user: &str, token: &str) -> bool {
    match parse_expiration(expiration) {
        Ok(exp) => ct_eq(signature, &file_signature(path, op, user, token, exp)),
        Err(_) => false,
    }
}

fn parse_expiration(expiration: Option<&str>) -> Result<Option<i64>, &'static str> {
    match expiration.filter(|e| !e.is_empty()) {
        None => Ok(None),
        Some(e) => e.parse::<i64>().map(Some).map_err(|_| "signature_expiration is not a unix timestamp"),
    }
}

/// Checks a signed `/files` URL. `now` is in unix seconds. The signature is checked first, so
/// only a URL really signed with this token learns that it has expired.
pub fn check_file_signature(
    signature: &str,
    expiration: Option<&str>,
    path: &str,
    op: FileOp,
    user: &str,
    token: &str,
    now: i64,
) -> Result<(), &'static str> {
    let exp = parse_expiration(expiration)?;
    if !ct_eq(signature, &file_signature(path, op, user, token, exp)) {
        return Err(INVALID_SIGNATURE);
    }
    if exp.is_some_and(|e| e < now) {
        return Err(EXPIRED_SIGNATURE);
    }
    Ok(())
}

/// A server's own signing key at `path`: 32 random bytes made on first use (0600), the same
/// across restarts so that what it signed stays valid.
pub fn signing_key(path: &Path) -> std::io::Result<Vec<u8>> {
    match std::fs::read(path) {
        Ok(k) if k.len() >= 32 => Ok(k),
        _ => {
            let mut k = vec![0u8; 32];
            getrandom::fill(&mut k).map_err(|e| std::io::Error::other(e.to_string()))?;
            let tmp = path.with_extension("tmp");
            let _ = std::fs::remove_file(&tmp);
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?.write_all(&k)?;
            std::fs::rename(&tmp, path)?;
            Ok(k)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_the_sdk() {
        // python: get_signature("/home/user/a.txt", "read", None, "tok")
        //   base64.b64encode(sha256(b"/home/user/a.txt:read::tok").digest()).rstrip(b"=")
        let s = file_signature("/home/user/a.txt", FileOp::Read, "", "tok", None);
        assert!(s.starts_with("v1_"));
        assert_eq!(s.len(), 3 + 43);
        assert!(check_file_signature(&s, None, "/home/user/a.txt", FileOp::Read, "", "tok", 0).is_ok());
        assert!(check_file_signature(&s, None, "/home/user/a.txt", FileOp::Write, "", "tok", 0).is_err());
        assert!(check_file_signature(&s, None, "/home/user/a.txt", FileOp::Read, "root", "tok", 0).is_err());
        assert!(check_file_signature(&s, None, "/home/user/a.txt", FileOp::Read, "", "other", 0).is_err());
    }

    #[test]
    fn expiration_is_signed_and_enforced() {
        let s = file_signature("p", FileOp::Write, "user", "t", Some(1000));
        assert!(check_file_signature(&s, Some("1000"), "p", FileOp::Write, "user", "t", 999).is_ok());
        assert_eq!(check_file_signature(&s, Some("1000"), "p", FileOp::Write, "user", "t", 1001), Err(EXPIRED_SIGNATURE));
        // Expired or not, the signature names its token; a wrong one says only "invalid".
        assert!(file_signature_matches(&s, Some("1000"), "p", FileOp::Write, "user", "t"));
        assert!(!file_signature_matches(&s, Some("1000"), "p", FileOp::Write, "user", "other"));
        assert_eq!(check_file_signature(&s, Some("1000"), "p", FileOp::Write, "user", "other", 1001), Err(INVALID_SIGNATURE));
        assert!(check_file_signature(&s, Some("1001"), "p", FileOp::Write, "user", "t", 0).is_err());
        assert!(check_file_signature(&s, None, "p", FileOp::Write, "user", "t", 0).is_err());
        assert!(check_file_signature(&s, Some("x"), "p", FileOp::Write, "user", "t", 0).is_err());
    }

    #[test]
    fn keys() {
        assert!(ct_eq("abc", "abc"));
        assert!(!ct_eq("abc", "abd"));
        assert!(!ct_eq("abc", "ab"));
        let k = new_api_key();
        assert!(k.starts_with("e2b_") && k.len() == 44 && k[4..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(new_access_token(), new_access_token());
    }

    #[test]
    fn api_key_file_is_private_and_stable() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("cordon-server-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (k1, created) = load_or_create_api_key(&dir).unwrap();
        assert!(created);
        let mode = std::fs::metadata(api_key_path(&dir)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (k2, created) = load_or_create_api_key(&dir).unwrap();
        assert!(!created);
        assert_eq!(k1, k2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
