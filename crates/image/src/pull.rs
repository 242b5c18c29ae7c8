//! Pulling images from registries over the OCI distribution protocol (`oci-client`): the
//! manifest (an index resolved to linux/amd64), the config, then the layers, each streamed
//! straight into the layer store's unpack and verified there; layers the store already has are
//! not fetched again, which is also what makes an interrupted pull resume by layer.

use std::cell::RefCell;
use std::io::{self, Read};

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use oci_client::client::{linux_amd64_resolver, ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use oci_spec::image::MediaType;

use crate::digest::{self, Digest};
use crate::layers::{Expect, LayerStore};
use crate::oci::{self, Plan};
use crate::{NoProgress, Progress};

/// Layers fetched at once, as Docker does by default.
const PARALLEL: usize = 3;

/// Credentials for a pull.
#[derive(Debug, Clone, Default)]
pub enum Auth {
    /// Whatever the Docker config (`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`)
    /// has for the registry, else anonymous.
    #[default]
    DockerConfig,
    /// User and password (or token) for the registry's basic or bearer-token auth.
    Basic(String, String),
}

/// A parsed image reference and the name it is stored under by default.
pub(crate) struct Target {
    pub reference: Reference,
}

impl Target {
    pub(crate) fn parse(r: &str) -> Result<Target, String> {
        let reference: Reference = r.parse().map_err(|e| format!("'{}' is not an image reference ({e}): use REGISTRY/REPOSITORY[:TAG|@DIGEST]", r.escape_debug()))?;
        Ok(Target { reference })
    }

    /// `bb` for `host/a/bb:latest`, `bb-1.2` for `host/a/bb:1.2`.
    pub(crate) fn default_name(&self) -> String {
        let repo = self.reference.repository().rsplit('/').next().unwrap_or("image");
        let base: String = repo.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c.to_ascii_lowercase() } else { '-' }).collect();
        match self.reference.tag() {
            Some(t) if t != "latest" => format!("{base}-{}", t.to_ascii_lowercase()),
            _ => base,
        }
    }
}

/// Registries spoken to over plain HTTP: the host's own (as Docker does for loopback).
fn is_loopback(registry: &str) -> bool {
    let host = registry.rsplit_once(':').map_or(registry, |(h, p)| if p.chars().all(|c| c.is_ascii_digit()) { h } else { registry });
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The Docker config's credentials for `registry`.
fn docker_config_auth(registry: &str) -> Result<RegistryAuth, String> {
    let path = match std::env::var_os("DOCKER_CONFIG") {
        Some(d) => std::path::PathBuf::from(d).join("config.json"),
        None => match std::env::var_os("HOME") {
            Some(h) => std::path::PathBuf::from(h).join(".docker/config.json"),
            None => return Ok(RegistryAuth::Anonymous),
        },
    };
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(RegistryAuth::Anonymous) };
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{} is not valid JSON ({e}): fix or remove it", path.display()))?;
    let Some(auth) = v.get("auths").and_then(|a| a.get(registry)).and_then(|e| e.get("auth")).and_then(|a| a.as_str()) else {
        return Ok(RegistryAuth::Anonymous);
    };
    use base64::Engine as _;
    let decoded = base64::engine::general_purpose::STANDARD.decode(auth).ok().and_then(|b| String::from_utf8(b).ok());
    match decoded.as_deref().and_then(|s| s.split_once(':')) {
        Some((u, p)) => Ok(RegistryAuth::Basic(u.to_string(), p.to_string())),
        None => Err(format!("the auth entry for {registry} in {} is not base64 of USER:PASSWORD", path.display())),
    }
}

/// A registry error as one line that says what to do.
/// `anonymous`: no credentials were sent (the hint then says the registry needs some).
fn registry_error(reference: &Reference, anonymous: bool, e: oci_client::errors::OciDistributionError) -> String {
    use oci_client::errors::OciDistributionError as E;
    let registry = reference.resolve_registry();
    let auth_hint = if anonymous {
        format!("the registry {registry} needs credentials: pass --registry-auth USER:PASSWORD, or add {registry} to the Docker config (docker login {registry})")
    } else {
        format!("the registry {registry} refused the credentials given: check them (--registry-auth USER:PASSWORD, or the Docker config's entry for {registry})")
    };
    let text = match &e {
        E::AuthenticationFailure(_) => auth_hint,
        E::ServerError { code: 401 | 403, .. } | E::UnauthorizedError { .. } => auth_hint,
        E::RegistryError { envelope, .. } if envelope.errors.iter().any(|er| matches!(er.code, oci_client::errors::OciErrorCode::Unauthorized | oci_client::errors::OciErrorCode::Denied)) => auth_hint,
        E::ImageManifestNotFoundError(_) | E::ServerError { code: 404, .. } => format!("{reference} was not found on {registry}: check the repository and tag"),
        E::RegistryError { envelope, .. } if envelope.errors.iter().any(|er| matches!(er.code, oci_client::errors::OciErrorCode::ManifestUnknown | oci_client::errors::OciErrorCode::NameUnknown)) => {
            format!("{reference} was not found on {registry}: check the repository and tag")
        }
        E::UnsupportedMediaTypeError(m) => format!("{reference} has manifest media type '{m}', which is not a container image (an OCI or Docker image manifest or index)"),
        E::RequestError(r) if r.is_connect() => format!("cannot connect to the registry {registry} ({}): check the address and that it runs", chain(r)),
        _ => format!("the registry {registry} failed: {}", chain(&e)),
    };
    one_line(&text)
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

fn one_line(s: &str) -> String {
    let flat: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if flat.len() > 400 {
        format!("{}...", &flat[..flat.char_indices().nth(400).map_or(flat.len(), |(i, _)| i)])
    } else {
        flat
    }
}

/// Bytes from a channel, for the blocking unpack of a layer the async side downloads.
struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<io::Result<Bytes>>,
    cur: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(Err(e)) => return Err(e),
                Some(Ok(b)) => self.cur = b,
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        let _ = self.cur.split_to(n);
        Ok(n)
    }
}

/// What a pull made of the registry's image.
pub(crate) struct Pulled {
    pub plan: Plan,
    /// The manifest's digest, for the image's source line.
    pub manifest_digest: String,
    pub fetched: usize,
}

/// Resolves `target` on its registry and puts every layer it lacks into `layers`.
pub(crate) fn pull(layers: &LayerStore, target: &Target, auth: &Auth, progress: &mut dyn Progress) -> Result<Pulled, String> {
    let reference = &target.reference;
    let registry = reference.resolve_registry().to_string();
    let auth = match auth {
        Auth::Basic(u, p) => RegistryAuth::Basic(u.clone(), p.clone()),
        Auth::DockerConfig => docker_config_auth(&registry)?,
    };
    let protocol = if is_loopback(&registry) { ClientProtocol::Http } else { ClientProtocol::Https };
    let client = Client::new(ClientConfig {
        protocol,
        platform_resolver: Some(Box::new(linux_amd64_resolver)),
        connect_timeout: Some(std::time::Duration::from_secs(15)),
        read_timeout: Some(std::time::Duration::from_secs(60)),
        ..Default::default()
    });
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| format!("cannot start the pull's runtime: {e}"))?;
    rt.block_on(async {
        progress.line(&format!("resolving {reference}"));
        let (manifest, manifest_digest, config) = client.pull_manifest_and_config(reference, &auth).await.map_err(|e| registry_error(reference, matches!(auth, RegistryAuth::Anonymous), e))?;
        let config_digest = Digest::parse(&manifest.config.digest)?;
        if digest::of_bytes(config.as_bytes()) != config_digest {
            return Err(format!("the config of {reference} does not match its digest {config_digest}: the registry sent corrupt data"));
        }
        let descs: Vec<oci::LayerDesc> = manifest
            .layers
            .iter()
            .map(|l| Ok((l.digest.clone(), Some(Digest::parse(&l.digest)?), u64::try_from(l.size).ok(), Some(MediaType::from(l.media_type.as_str())))))
            .collect::<Result<_, String>>()?;
        let plan = oci::plan(config.as_bytes(), descs).map_err(|e| format!("{reference}: {e}"))?;
        let total = plan.layers.len();
        let progress = RefCell::new(progress);
        let mut todo: Vec<(usize, oci::LayerRef, OciDescriptor)> = Vec::new();
        for (i, (l, desc)) in plan.layers.iter().zip(&manifest.layers).enumerate() {
            if layers.has(&l.diff_id) || todo.iter().any(|(_, t, _)| t.diff_id == l.diff_id) {
                progress.borrow_mut().line(&format!("layer {}/{total} {}: already present", i + 1, l.diff_id.short()));
            } else {
                todo.push((i, l.clone(), desc.clone()));
            }
        }
        let fetched = todo.len();
        let results: Vec<Result<(), String>> = futures_util::stream::iter(todo)
            .map(|(i, l, desc)| fetch_layer(&client, reference, layers, &progress, i, total, l, desc))
            .buffer_unordered(PARALLEL)
            .collect()
            .await;
        results.into_iter().collect::<Result<Vec<()>, String>>()?;
        Ok(Pulled { plan, manifest_digest, fetched })
    })
}

#[allow(clippy::too_many_arguments)]
async fn fetch_layer(
    client: &Client,
    reference: &Reference,
    layers: &LayerStore,
    progress: &RefCell<&mut dyn Progress>,
    i: usize,
    total: usize,
    l: oci::LayerRef,
    desc: OciDescriptor,
) -> Result<(), String> {
    let label = format!("layer {}/{total} {}", i + 1, l.diff_id.short());
    let sized = client.pull_blob_stream(reference, &desc).await.map_err(|e| format!("{label}: {}", registry_error(reference, false, e)))?;
    let size = sized.content_length.or(l.size);
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(64);
    let store = layers.clone();
    let (digest, diff_id) = (l.digest.clone(), l.diff_id.clone());
    let unpack = tokio::task::spawn_blocking(move || {
        store.unpack_pending(ChannelReader { rx, cur: Bytes::new() }, &Expect { digest: digest.as_ref(), diff_id: &diff_id }, &mut NoProgress)
    });
    let mut stream = sized.stream;
    let mut done = 0u64;
    loop {
        match stream.try_next().await {
            Ok(Some(chunk)) => {
                done += chunk.len() as u64;
                progress.borrow_mut().bytes(&label, done, size);
                if tx.send(Ok(chunk)).await.is_err() {
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                let _ = tx.send(Err(io::Error::other(format!("the download broke off after {done} bytes ({e})")))).await;
                break;
            }
        }
    }
    drop(tx);
    let info = unpack.await.map_err(|e| format!("{label}: the unpack failed: {e}"))?.map_err(|e| format!("{label}: {e}"))?;
    let size = info.info.size_bytes;
    // Each layer appears once it verified, so a pull cut short keeps the layers it completed
    // and the next one fetches only the rest (the image itself appears only with all of them).
    layers.install(vec![info]).map_err(|e| format!("{label}: {e}"))?;
    progress.borrow_mut().line(&format!("{label}: done ({} unpacked)", crate::human_size(size)));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_protocols() {
        let t = Target::parse("127.0.0.1:5000/team/app:1.2").unwrap();
        assert_eq!(t.default_name(), "app-1.2");
        assert_eq!(Target::parse("localhost:5000/bb").unwrap().default_name(), "bb");
        assert!(Target::parse("UPPER/Case:x").is_err());
        assert!(is_loopback("127.0.0.1:5000") && is_loopback("localhost") && is_loopback("[::1]:80"));
        assert!(!is_loopback("registry.example.com:5000") && !is_loopback("198.51.100.1:5000"));
    }
}
