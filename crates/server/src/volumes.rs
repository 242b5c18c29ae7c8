//! Volumes on the control plane: `POST/GET /volumes`, `GET/DELETE /volumes/{id}` (with the
//! API key), and the `volumeMounts` of a create, resolved here to leases on the store.
//! The store itself (images, mounts, locks) is `cordon_volume`'s; this layer parses, answers
//! in E2B's words and status codes, and delegates.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::error::{json_response, ApiError};
use crate::volume_token::VolumeTokens;
use crate::Body;
use cordon_volume::{Lease, VolumeError, Volumes};

/// The volume service of a server: the store, its tokens, the size of an API-made volume.
pub struct VolumeApi {
    pub store: Volumes,
    pub tokens: VolumeTokens,
    /// Size cap of a volume made through the API, which has no size field (`--volume-size`).
    pub default_size: u64,
}

/// `{name, path}` of a create's `volumeMounts`, as sandbox info shows them again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountRequest {
    pub name: String,
    pub path: String,
}

impl VolumeApi {
    pub fn open(state_dir: &std::path::Path, default_size: u64) -> Result<VolumeApi, crate::ServerError> {
        let store = Volumes::open(state_dir)?;
        store.reap();
        let tokens = VolumeTokens::open(store.dir()).map_err(|source| crate::ServerError::Io { what: "open the volume token key".into(), source })?;
        Ok(VolumeApi { store, tokens, default_size })
    }

    /// Routes `/volumes...` (the API key is already checked).
    pub async fn handle(self: &Arc<Self>, method: &Method, segs: &[&str], req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
        match (method, segs) {
            (&Method::POST, ["volumes"]) => {
                #[derive(Deserialize)]
                struct NewVolume {
                    name: String,
                }
                let b: NewVolume = crate::api::read_json(req, false).await?;
                let (this, name) = (self.clone(), b.name);
                let info = blocking(move || this.store.create(&name, this.default_size)).await?;
                Ok(json_response(StatusCode::CREATED, &self.with_token(&info)))
            }
            (&Method::GET, ["volumes"]) => {
                let this = self.clone();
                let list = blocking(move || this.store.list()).await?;
                Ok(json_response(StatusCode::OK, &json!(list.iter().map(|v| json!({"volumeID": v.id, "name": v.name})).collect::<Vec<_>>())))
            }
            (&Method::GET, ["volumes", id]) => {
                let (this, id) = (self.clone(), id.to_string());
                let info = blocking(move || this.store.get(&id)).await?;
                Ok(json_response(StatusCode::OK, &self.with_token(&info)))
            }
            (&Method::DELETE, ["volumes", id]) => {
                let (this, id) = (self.clone(), id.to_string());
                blocking(move || this.store.delete(&id)).await?;
                Ok(Response::builder().status(StatusCode::NO_CONTENT).body(crate::full("")).expect("a valid response"))
            }
            _ => Err(ApiError::not_found(format!("no API endpoint {method} /{}", segs.join("/")))),
        }
    }

    /// `VolumeAndToken`.
    fn with_token(&self, v: &cordon_volume::VolumeInfo) -> serde_json::Value {
        json!({"volumeID": v.id, "name": v.name, "token": self.tokens.issue(&v.id), "sizeBytes": v.size_bytes})
    }

    /// The leases (each volume mounted on the host) and bind mounts of a create's
    /// `volumeMounts` on `tier`, or E2B's 400 listing every mount that is wrong.
    pub fn resolve(&self, mounts: &[MountRequest], tier_mounts_volumes: bool, tier: cordon_spec::Tier) -> Result<Vec<(cordon_spec::VolumeMount, Lease)>, ApiError> {
        let mut problems = Vec::new();
        let mut out = Vec::new();
        for (i, m) in mounts.iter().enumerate() {
            let reason = if let Err(e) = cordon_spec::validate_mount_path(&m.path) {
                Some(e.reason)
            } else if mounts[..i].iter().any(|o| o.path == m.path) {
                Some(format!("path '{}' is already used", m.path))
            } else if !tier_mounts_volumes {
                Some(format!("the {tier} tier cannot mount volumes yet: use the ns or gvisor tier"))
            } else {
                match self.store.lease_by_name(&m.name) {
                    Ok(lease) => {
                        let bind = cordon_spec::VolumeMount { name: m.name.clone(), source: lease.root().to_path_buf(), target: m.path.clone(), read_only: false };
                        out.push((bind, lease));
                        None
                    }
                    Err(VolumeError::NameNotFound(_)) => Some(format!("volume '{}' not found", m.name)),
                    Err(e) => Some(e.to_string()),
                }
            };
            if let Some(r) = reason {
                problems.push(format!("\t- volume mount #{i}: {r}"));
            }
        }
        if !problems.is_empty() {
            return Err(ApiError::bad_request(format!("invalid mounts:\n{}", problems.join("\n"))));
        }
        Ok(out)
    }
}

/// Runs a store call (files, `mount`, locks) off the async threads, mapping its error.
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, VolumeError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(e.to_string()))?.map_err(api_error)
}

/// E2B's words and codes for the store's errors.
pub(crate) fn api_error(e: VolumeError) -> ApiError {
    match e {
        VolumeError::InvalidName(_) => ApiError::bad_request("Invalid volume name"),
        VolumeError::InvalidId(_) => ApiError::bad_request("Invalid volume ID"),
        VolumeError::NameTaken(n) => ApiError::bad_request(format!("Volume with name '{n}' already exists")),
        e @ (VolumeError::NotFound(_) | VolumeError::NameNotFound(_)) => ApiError::not_found(e.to_string()),
        e @ VolumeError::InUse(_) => ApiError::new(StatusCode::CONFLICT, e.to_string()),
        e @ (VolumeError::InvalidSize(_) | VolumeError::NoRoom { .. }) => ApiError::bad_request(e.to_string()),
        e => ApiError::internal(e.to_string()),
    }
}
