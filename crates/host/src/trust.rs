//! The egress CA in a sandbox's trust: where it goes in the image's files and which variables
//! name it, the same on every tier.
//!
//! The image's system bundle gets the CA appended (in the sandbox's writable layer, or as a
//! file bound over it), and the CA alone goes where Debian's `update-ca-certificates` finds
//! local CAs, so a sandbox that rebuilds its bundle keeps it. `SSL_CERT_FILE` (OpenSSL, Python's
//! ssl and httpx), `REQUESTS_CA_BUNDLE` (requests, pip), `CURL_CA_BUNDLE` (curl) name the bundle
//! and `NODE_EXTRA_CA_CERTS` (node, which otherwise trusts only its own store) names the CA.

/// The system bundle of Debian, Ubuntu and Alpine images (made if the image has none).
pub const BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The CA alone.
pub const CA_FILE: &str = "/usr/local/share/ca-certificates/cordon-egress-ca.crt";

/// Environment variables that make the common clients trust the bundle and the CA. A sandbox's
/// own value of one of them wins (see `cordon_sandbox::agent::config`).
pub fn env() -> [(&'static str, &'static str); 4] {
    [("SSL_CERT_FILE", BUNDLE), ("REQUESTS_CA_BUNDLE", BUNDLE), ("CURL_CA_BUNDLE", BUNDLE), ("NODE_EXTRA_CA_CERTS", CA_FILE)]
}

/// The image's bundle with the CA appended (or the CA alone when the image has no bundle).
pub fn bundle(image_bundle: Option<&[u8]>, ca_pem: &str) -> Vec<u8> {
    let mut out = image_bundle.map(<[u8]>::to_vec).unwrap_or_default();
    if !out.is_empty() && !out.ends_with(b"\n") {
        out.push(b'\n');
    }
    out.extend_from_slice(b"# cordon egress CA: terminates TLS only for hosts with header injection rules\n");
    out.extend_from_slice(ca_pem.as_bytes());
    if !out.ends_with(b"\n") {
        out.push(b'\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_after_the_images_certificates() {
        let b = bundle(Some(b"-----IMAGE-----"), "-----CA-----\n");
        let s = String::from_utf8(b).unwrap();
        assert!(s.starts_with("-----IMAGE-----\n#"));
        assert!(s.ends_with("-----CA-----\n"));
        assert!(String::from_utf8(bundle(None, "x")).unwrap().ends_with("x\n"));
    }
}
