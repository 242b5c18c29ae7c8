//! The host's egress CA: the certificate authority whose leaf certificates the forwarder shows
//! a sandbox when it terminates TLS for a host with injection rules, and which sandboxes trust.
//!
//! Made on first use under the state dir (`egress-ca/ca.pem`, and `ca.key` readable by root
//! only) and kept, so that a server restart, `cordon run` and `cordon serve` all use the same
//! one. The key never leaves the host: a sandbox only ever sees the certificate. Leaf
//! certificates are made per host name on first use, signed with one leaf key made at open and
//! held in memory only, and cached for the life of the process (a day's validity, remade when
//! half of it has passed).

use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose, ExtendedKeyUsagePurpose};
use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::sign::CertifiedKey;

/// Why the CA could not be opened or a leaf made.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("egress CA at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("egress CA at {path} is not usable ({reason}): remove the directory to make a new one (sandboxes started with the old one must be restarted)")]
    Corrupt { path: PathBuf, reason: String },
    #[error("cannot make a certificate for {name}: {reason}")]
    Leaf { name: String, reason: String },
}

/// How long a leaf certificate is valid, and when a cached one is remade.
const LEAF_VALIDITY: Duration = Duration::from_secs(24 * 3600);
/// Leaf certificates cached; beyond this the cache is cleared (names come from the sandboxes'
/// rules, at most ten keys each, but wildcard keys match any number of names).
const MAX_CACHED: usize = 4096;

pub struct EgressCa {
    dir: PathBuf,
    cert_pem: String,
    issuer: rcgen::Certificate,
    issuer_key: KeyPair,
    leaf_key: KeyPair,
    /// `leaf_key` as rustls signs with it, shared by every leaf.
    leaf_signer: Arc<dyn rustls::sign::SigningKey>,
    leaves: Mutex<HashMap<String, (Instant, Arc<CertifiedKey>)>>,
}

impl std::fmt::Debug for EgressCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressCa").field("dir", &self.dir).finish_non_exhaustive()
    }
}

impl EgressCa {
    /// Opens the CA under `state_dir/egress-ca`, making it first if there is none. Two
    /// processes making it at once agree on one (the directory is renamed into place whole).
    pub fn open(state_dir: &Path) -> Result<EgressCa, CaError> {
        let dir = state_dir.join("egress-ca");
        if !dir.join("ca.key").exists() {
            make(state_dir, &dir)?;
        }
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| CaError::Io { path, source }
        };
        let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
        let cert_pem = fs::read_to_string(&cert_path).map_err(io(&cert_path))?;
        let key_pem = fs::read_to_string(&key_path).map_err(io(&key_path))?;
        let corrupt = |reason: String| CaError::Corrupt { path: dir.clone(), reason };
        let issuer_key = KeyPair::from_pem(&key_pem).map_err(|e| corrupt(format!("key: {e}")))?;
        let params = CertificateParams::from_ca_cert_pem(&cert_pem).map_err(|e| corrupt(format!("certificate: {e}")))?;
        // The issuer as rcgen signs with it: the same name and key as the certificate on disk,
        // which is what a leaf's chain is checked against.
        let issuer = params.self_signed(&issuer_key).map_err(|e| corrupt(format!("certificate: {e}")))?;
        let leaf_key = KeyPair::generate().map_err(|e| corrupt(format!("leaf key: {e}")))?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let leaf_signer = rustls::crypto::ring::sign::any_supported_type(&der).map_err(|e| corrupt(format!("leaf key: {e}")))?;
        Ok(EgressCa { dir, cert_pem, issuer, issuer_key, leaf_key, leaf_signer, leaves: Mutex::new(HashMap::new()) })
    }

    /// The CA certificate, PEM: what sandboxes add to their trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for `name` signed by this CA, with its key, ready for a TLS server.
    pub fn leaf(&self, name: &str) -> Result<Arc<CertifiedKey>, CaError> {
        let mut cache = self.leaves.lock().expect("leaf cache lock");
        if let Some((made, ck)) = cache.get(name) {
            if made.elapsed() < LEAF_VALIDITY / 2 {
                return Ok(ck.clone());
            }
        }
        let bad = |reason: String| CaError::Leaf { name: name.to_string(), reason };
        let mut params = CertificateParams::new(vec![name.to_string()]).map_err(|e| bad(e.to_string()))?;
        let now = time::OffsetDateTime::now_utc();
        // An hour back: a sandbox whose clock is a little behind still accepts it.
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::seconds(LEAF_VALIDITY.as_secs() as i64);
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params.signed_by(&self.leaf_key, &self.issuer, &self.issuer_key).map_err(|e| bad(e.to_string()))?;
        let ck = Arc::new(CertifiedKey::new(vec![CertificateDer::from(cert.der().to_vec())], self.leaf_signer.clone()));
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(name.to_string(), (Instant::now(), ck.clone()));
        Ok(ck)
    }
}

/// Makes a new CA in a private directory next to `dir` and renames it into place; if another
/// process got there first, its CA stands and this one is removed.
fn make(state_dir: &Path, dir: &Path) -> Result<(), CaError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| CaError::Io { path, source }
    };
    fs::create_dir_all(state_dir).map_err(io(state_dir))?;
    let tmp = state_dir.join(format!(".egress-ca-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::DirBuilder::new().mode(0o700).create(&tmp).map_err(io(&tmp))?;
    let made = (|| {
        let key = KeyPair::generate().map_err(|e| e.to_string())?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "cordon egress CA");
        dn.push(DnType::OrganizationName, "cordon");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::days(1);
        params.not_after = now + time::Duration::days(3650);
        let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
        Ok::<_, String>((cert.pem(), key.serialize_pem()))
    })();
    let (cert_pem, key_pem) = made.map_err(|reason| CaError::Corrupt { path: dir.to_owned(), reason })?;
    let write = |name: &str, data: &str, mode: u32| -> Result<(), CaError> {
        let p = tmp.join(name);
        // Created with its final mode: the key is never readable by anyone but root.
        let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&p).map_err(io(&p))?;
        f.write_all(data.as_bytes()).and_then(|()| f.sync_all()).map_err(io(&p))
    };
    write("ca.key", &key_pem, 0o600)?;
    write("ca.pem", &cert_pem, 0o644)?;
    // The directory is only traversable by root; the certificate is copied into sandboxes.
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o700)).map_err(io(&tmp))?;
    match fs::rename(&tmp, dir) {
        Ok(()) => Ok(()),
        Err(_) if dir.join("ca.key").exists() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(CaError::Io { path: dir.to_owned(), source: e })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::pem::PemObject;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn made_once_kept_private_and_signs_leaves_that_verify() {
        let state = std::env::temp_dir().join(format!("cordon-ca-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&state);
        let ca = EgressCa::open(&state).unwrap();
        assert_eq!(fs::metadata(state.join("egress-ca/ca.key")).unwrap().mode() & 0o777, 0o600);
        assert_eq!(fs::metadata(state.join("egress-ca")).unwrap().mode() & 0o777, 0o700);
        // Opened again: the same CA, not a new one.
        let again = EgressCa::open(&state).unwrap();
        assert_eq!(ca.cert_pem(), again.cert_pem());
        // A leaf from the reopened CA chains to the certificate on disk.
        let leaf = again.leaf("api.example.test").unwrap();
        let mut roots = rustls::RootCertStore::empty();
        let der = rustls::pki_types::CertificateDer::from_pem_slice(ca.cert_pem().as_bytes());
        roots.add(der.unwrap()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::new(rustls::crypto::ring::default_provider())).build().unwrap();
        let name = rustls::pki_types::ServerName::try_from("api.example.test").unwrap();
        let now = rustls::pki_types::UnixTime::now();
        verifier.verify_server_cert(&leaf.cert[0], &[], &name, &[], now).unwrap();
        let other = rustls::pki_types::ServerName::try_from("other.example.test").unwrap();
        assert!(verifier.verify_server_cert(&leaf.cert[0], &[], &other, &[], now).is_err());
        // Cached: the same certificate the second time.
        assert_eq!(again.leaf("api.example.test").unwrap().cert[0], leaf.cert[0]);
        fs::remove_dir_all(&state).unwrap();
    }
}
