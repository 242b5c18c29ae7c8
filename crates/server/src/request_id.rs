//! The id of one request, on each of its log lines and in its response's `X-Request-Id`: a
//! client (or a proxy in front) may bring its own, so that its logs and the server's meet.

use hyper::HeaderMap;

/// The header it travels in, both ways.
pub const HEADER: &str = "x-request-id";

/// Longest id taken from a client: a log line is no place for a client's essay.
const MAX_LEN: usize = 64;

/// The client's id when it is 1 to 64 characters of letters, digits, `-`, `_`, `.` or `:`
/// (nothing that could forge a log field or a line), a fresh 16 hex digits otherwise.
pub fn of(headers: &HeaderMap) -> String {
    let given = headers
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let usable = !given.is_empty()
        && given.len() <= MAX_LEN
        && given
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    if usable {
        return given.to_string();
    }
    let mut raw = [0u8; 8];
    // Without the kernel's random source an id is still unique enough from the clock: it
    // only correlates log lines.
    if getrandom::fill(&mut raw).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        raw = (t.as_nanos() as u64).to_be_bytes();
    }
    raw.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(HEADER, v.parse().unwrap());
        h
    }

    #[test]
    fn takes_a_sane_client_id_and_makes_one_otherwise() {
        assert_eq!(of(&with("trace-01.a:b_c")), "trace-01.a:b_c");
        for bad in ["a b", "x\"y", "{\"json\":1}", &"a".repeat(65), ""] {
            let id = of(&with(bad));
            assert_ne!(id, bad);
            assert_eq!(id.len(), 16, "{id}");
            assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        }
        assert_ne!(of(&HeaderMap::new()), of(&HeaderMap::new()));
    }
}
