//! TLS on the listener (rustls): the operator's certificate (`--tls-cert` / `--tls-key`, PEM),
//! or one issued at every start for the server's domain by a CA of cordon's own
//! (`--tls-self-signed`), whose certificate is kept in the state dir for clients to trust.
//!
//! The self-signed CA's key never leaves `<state>/tls/ca-key.pem` (0600); the leaf (for
//! `DOMAIN` and `*.DOMAIN`, what `get_host()` URLs and `api.DOMAIN` need) lives in memory only.
//! Only HTTP/1.1 is offered in ALPN: the server speaks nothing else, and every SDK falls back.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// What can go wrong setting TLS up. Each message names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} holds no PEM certificate: give the server's certificate chain, leaf first")]
    NoCertificate { path: PathBuf },
    #[error("{path} holds no PEM private key (PKCS#8, PKCS#1 or SEC1)")]
    NoKey { path: PathBuf },
    #[error("the certificate and key do not make a TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error("cannot issue a certificate: {0}")]
    Issue(#[from] rcgen::Error),
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

/// The acceptor for a certificate chain and key given as PEM files.
pub fn from_pem_files(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    let read = |p: &Path| fs::read(p).map_err(|source| TlsError::Read { path: p.to_path_buf(), source });
    let (cert_pem, key_pem) = (read(cert)?, read(key)?);
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem).filter_map(Result::ok).collect();
    if chain.is_empty() {
        return Err(TlsError::NoCertificate { path: cert.to_path_buf() });
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NoKey { path: key.to_path_buf() })?;
    acceptor(chain, key)
}

/// The acceptor for a certificate for `domain` and `*.domain`, issued now by the state dir's
/// CA (made on first use); returns the CA certificate's path too, for clients to trust.
pub fn self_signed(state_dir: &Path, domain: &str) -> Result<(TlsAcceptor, PathBuf), TlsError> {
    let dir = state_dir.join("tls");
    fs::create_dir_all(&dir).map_err(|source| TlsError::Write { path: dir.clone(), source })?;
    let (ca_cert_path, ca_key_path) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
    let ca_key = match fs::read_to_string(&ca_key_path) {
        Ok(pem) if ca_cert_path.exists() => KeyPair::from_pem(&pem)?,
        _ => {
            let key = KeyPair::generate()?;
            let cert = ca_params().self_signed(&key)?;
            // Key first, then the certificate: a CA certificate on disk always has its key.
            write_new(&ca_key_path, key.serialize_pem().as_bytes(), 0o600)?;
            write_new(&ca_cert_path, cert.pem().as_bytes(), 0o644)?;
            key
        }
    };
    // The same name and key as the CA on disk, so what it signs verifies against that file.
    let ca = ca_params().self_signed(&ca_key)?;
    let mut leaf = CertificateParams::new(vec![domain.to_string(), format!("*.{domain}")])?;
    leaf.distinguished_name = DistinguishedName::new();
    leaf.distinguished_name.push(DnType::CommonName, domain);
    let now = time::OffsetDateTime::now_utc();
    leaf.not_before = now - time::Duration::days(1);
    // Under the 398 days browsers accept; reissued at every start anyway.
    leaf.not_after = now + time::Duration::days(397);
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &ca, &ca_key)?;
    let key = PrivateKeyDer::try_from(leaf_key.serialize_der()).map_err(|_| TlsError::NoKey { path: ca_key_path.clone() })?;
    Ok((acceptor(vec![leaf_cert.der().clone(), ca.der().clone()], key)?, ca_cert_path))
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, "cordon serve local CA");
    p
}

/// Writes a file that must not exist yet (two servers starting at once: one wins), atomically
/// through a temporary name.
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    let err = |source| TlsError::Write { path: path.to_path_buf(), source };
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp).map_err(err)?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
}

fn acceptor(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Result<TlsAcceptor, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

/// Whether `d` can be the sandboxes' domain: lowercase DNS labels of letters, digits and
/// hyphens (not at either end), at least two of them, at most 253 characters in all.
pub fn valid_domain(d: &str) -> bool {
    d.len() <= 253
        && d.split('.').count() >= 2
        && d.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_are_dns_names() {
        assert!(valid_domain("sandbox.example.org") && valid_domain("cordon.test"));
        for bad in ["localhost", "Example.org", "a..b", "-a.b", "a-.b", "a b.c", ""] {
            assert!(!valid_domain(bad), "{bad}");
        }
    }

    #[test]
    fn the_self_signed_ca_is_made_once_and_signs_each_start() {
        let dir = std::env::temp_dir().join(format!("cordon-tls-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let (_, ca) = self_signed(&dir, "cordon.test").unwrap();
        let first = fs::read(&ca).unwrap();
        let (_, again) = self_signed(&dir, "cordon.test").unwrap();
        assert_eq!(fs::read(&again).unwrap(), first, "the CA the clients trust must not change");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(fs::metadata(dir.join("tls/ca-key.pem")).unwrap().permissions().mode() & 0o777, 0o600);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_files_say_which_and_what() {
        let dir = std::env::temp_dir().join(format!("cordon-tls-bad-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        fs::write(&junk, "not a certificate").unwrap();
        let e = from_pem_files(&junk, &junk).err().unwrap().to_string();
        assert!(e.contains("junk.pem") && e.contains("no PEM certificate"), "{e}");
        let e = from_pem_files(&dir.join("missing.pem"), &junk).err().unwrap().to_string();
        assert!(e.contains("missing.pem"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
