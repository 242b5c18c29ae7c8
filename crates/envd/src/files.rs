//! Types of the plain HTTP `/files` endpoint of envd.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Path of the file endpoint.
pub const PATH: &str = "/files";
/// Prefix of request headers that carry file metadata (`X-Metadata-<key>: <value>`).
pub const METADATA_HEADER_PREFIX: &str = "x-metadata-";
/// Prefix of the extended attributes metadata is stored in.
pub const METADATA_XATTR_PREFIX: &str = "user.e2b.";

/// One written file, as the upload response lists it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct WriteInfo {
    /// Base name.
    pub name: String,
    /// `"file"` or `"dir"`.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub entry_type: Option<String>,
    /// Absolute path.
    pub path: String,
    /// The metadata now stored on the file.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// The JSON body of a `/files` error: `{"message":"...","code":404}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FilesError {
    /// What went wrong.
    pub message: String,
    /// The HTTP status, repeated.
    pub code: u16,
}

/// A `/files` query parameter given more than once. The host checks a URL signature against
/// one value and the agent must act on that same value, so no value may be left to choose:
/// the message is envd's own (oapi-codegen's) for a repeated single-value parameter.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("Invalid format for parameter {0}: multiple values for single value parameter '{0}' (give each query parameter once)")]
pub struct DuplicateParameter(pub String);

/// The query of a `/files` request, decoded. The host (which checks signatures) and the agent
/// (which acts) both read it through [`FilesQuery::parse`], so they can never see different
/// values; and the host forwards [`FilesQuery::encode`] of what it checked, not the raw query.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FilesQuery {
    /// `path`: the file, absolute or relative to the user's home.
    pub path: Option<String>,
    /// `username`: whom the operation runs as (empty or absent: the default user).
    pub username: Option<String>,
    /// `signature`: `v1_...` (see the protocol notes).
    pub signature: Option<String>,
    /// `signature_expiration`: unix seconds, as signed.
    pub signature_expiration: Option<String>,
}

impl FilesQuery {
    /// Decodes `query` (`application/x-www-form-urlencoded`: `%XX` escapes, `+` for a space).
    /// Any key that appears twice, in whatever spelling decodes to it (`path`, `pa%74h`), is
    /// refused; keys other than the four above are ignored.
    pub fn parse(query: Option<&str>) -> Result<FilesQuery, DuplicateParameter> {
        let mut out = FilesQuery::default();
        let mut seen: Vec<String> = Vec::new();
        for part in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').unwrap_or((part, ""));
            let (key, value) = (percent_decode(k, true), percent_decode(v, true));
            if seen.contains(&key) {
                return Err(DuplicateParameter(key));
            }
            let slot = match key.as_str() {
                "path" => &mut out.path,
                "username" => &mut out.username,
                "signature" => &mut out.signature,
                "signature_expiration" => &mut out.signature_expiration,
                _ => {
                    seen.push(key);
                    continue;
                }
            };
            *slot = Some(value);
            seen.push(key);
        }
        Ok(out)
    }

    /// The query string of the parameters that are set, each once, percent-encoded.
    pub fn encode(&self) -> String {
        let fields = [
            ("path", &self.path),
            ("username", &self.username),
            ("signature", &self.signature),
            ("signature_expiration", &self.signature_expiration),
        ];
        let mut out = String::new();
        for (k, v) in fields {
            let Some(v) = v else { continue };
            if !out.is_empty() {
                out.push('&');
            }
            out.push_str(k);
            out.push('=');
            out.push_str(&percent_encode(v));
        }
        out
    }
}

/// Decodes `%XX` escapes (and `+` as a space when `plus_is_space`, as in a form query). Invalid
/// escapes are kept as they are; invalid UTF-8 is replaced, since every value is used as text.
/// The one decoder of query strings: the server's control-plane queries use it too.
pub fn percent_decode(s: &str, plus_is_space: bool) -> String {
    fn hex(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' if plus_is_space => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Percent-encodes everything but RFC 3986 unreserved characters (and `/`, for readability).
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_each_parameter() {
        let q = FilesQuery::parse(Some("path=%2Fhome%2Fuser%2Fa+b.txt&username=user&signature=v1_x&signature_expiration=9&gzip=1"))
            .unwrap();
        assert_eq!(q.path.as_deref(), Some("/home/user/a b.txt"));
        assert_eq!(q.username.as_deref(), Some("user"));
        assert_eq!(q.signature.as_deref(), Some("v1_x"));
        assert_eq!(q.signature_expiration.as_deref(), Some("9"));
        assert_eq!(FilesQuery::parse(None).unwrap(), FilesQuery::default());
        assert_eq!(FilesQuery::parse(Some("path")).unwrap().path.as_deref(), Some(""));
    }

    #[test]
    fn refuses_a_parameter_given_twice_in_any_spelling() {
        for q in [
            "path=/home/user/public.txt&username=user&path=/root/secret.txt",
            "path=a&username=user&username=root",
            "path=a&pa%74h=b",
            "path=a&%70ath=b",
            "signature=x&signature=y",
            "path=a&path=a",
            "other=1&other=2",
        ] {
            let e = FilesQuery::parse(Some(q)).unwrap_err();
            assert!(e.to_string().starts_with("Invalid format for parameter "), "{q}: {e}");
        }
        assert_eq!(
            FilesQuery::parse(Some("path=a&pa%74h=b")).unwrap_err(),
            DuplicateParameter("path".into())
        );
    }

    #[test]
    fn encoding_round_trips() {
        let q = FilesQuery {
            path: Some("/tmp/a&b=c+d %2F é".into()),
            username: Some("us er".into()),
            signature: None,
            signature_expiration: None,
        };
        let enc = q.encode();
        assert!(!enc.contains(' ') && !enc.contains('+') && enc.matches('&').count() == 1, "{enc}");
        assert_eq!(FilesQuery::parse(Some(&enc)).unwrap(), q);
        assert_eq!(FilesQuery::default().encode(), "");
    }

    #[test]
    fn decoding_keeps_bad_escapes() {
        assert_eq!(percent_decode("a%20b%2Fc", true), "a b/c");
        assert_eq!(percent_decode("100%", true), "100%");
        assert_eq!(percent_decode("%zz%4", true), "%zz%4");
        assert_eq!(percent_decode("%41", true), "A");
        assert_eq!(percent_decode("%4", true), "%4");
        assert_eq!(percent_decode("x%41", true), "xA");
    }
}
