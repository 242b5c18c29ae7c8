//! Query strings of the control plane: percent-decoding and the parameters the API reads.
//! (`/files` has its own strict parser, `cordon_envd::files::FilesQuery`, shared with the agent.)

pub use cordon_envd::files::percent_decode;

/// The decoded `(key, value)` pairs of a query string, in order.
pub fn pairs(query: Option<&str>) -> Vec<(String, String)> {
    let Some(q) = query else { return Vec::new() };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k, true), percent_decode(v, true))
        })
        .collect()
}

/// The first value of `key`.
pub fn get(query: Option<&str>, key: &str) -> Option<String> {
    pairs(query).into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// The SDK's metadata filter: `quote(k)=quote(v)&...`, URL-encoded once more as one query
/// value. The query layer has already undone the outer encoding; this splits and undoes the
/// inner one. A part without `=` is a malformed filter.
pub fn metadata_filter(decoded_once: &str) -> Result<Vec<(String, String)>, String> {
    decoded_once
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((percent_decode(k, false), percent_decode(v, false))),
            _ => Err(format!("metadata filter part {p:?} is not key=value")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding() {
        assert_eq!(percent_decode("a%20b%2Fc", false), "a b/c");
        assert_eq!(percent_decode("a+b", true), "a b");
        assert_eq!(percent_decode("a+b", false), "a+b");
        assert_eq!(percent_decode("100%", false), "100%");
        assert_eq!(percent_decode("%zz%4", false), "%zz%4");
        assert_eq!(percent_decode("%41", false), "A");
    }

    #[test]
    fn double_encoded_metadata() {
        // urlencode({quote("user id"): quote("a&b")}) then encoded again by httpx.
        let q = "metadata=user%2520id%3Da%2526b%26k%3Dv";
        let once = get(Some(q), "metadata").unwrap();
        assert_eq!(once, "user%20id=a%26b&k=v");
        assert_eq!(
            metadata_filter(&once).unwrap(),
            vec![("user id".to_string(), "a&b".to_string()), ("k".to_string(), "v".to_string())]
        );
        assert!(metadata_filter("novalue").is_err());
    }
}
