//! Fork: `count` new sandboxes from a running one's files. The source is frozen while its
//! writable layer becomes a layer, then thawed: it keeps its id, deadline and processes. Each
//! fork is a fresh sandbox (its own id, tokens, hostname, boot, random state and clock) on an
//! image of its own over the source's layers and that one, shared copy-on-write, with the
//! source's template, limits, environment, metadata, network policy and lifecycle. On the ns
//! and gvisor tiers a fork copies files, not processes; on a tier that saves a running sandbox
//! to disk (the vm tier) it copies the processes and memory too: the source's state is saved
//! once, the source goes on, and each fork is restored from that state with its own id,
//! hostname, seed and clock. Each fork's entry says which (`forkMode`).

use std::sync::Arc;
use std::time::Duration;

use hyper::StatusCode;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::registry::{Identity, NewSandbox, Sandboxes};
use crate::saved::OWN_PREFIX;

/// Most forks one request may ask for (E2B's server cap).
pub const MAX_FORKS: u32 = 100;
/// A fork's life when the request names none (E2B's default).
pub const DEFAULT_FORK_TIMEOUT_SECS: u64 = 15;

/// `POST /sandboxes/{id}/fork`: one entry per fork, `{sandbox}` or `{error}`.
pub async fn fork(sandboxes: &Arc<Sandboxes>, id: &str, count: u32, timeout: Duration, domain: Option<&str>) -> Result<Vec<Value>, ApiError> {
    if count == 0 || count > MAX_FORKS {
        return Err(ApiError::bad_request(format!("count {count} is out of range: use 1 to {MAX_FORKS}")));
    }
    let saved = sandboxes.saved.as_ref().ok_or_else(|| ApiError::new(StatusCode::NOT_IMPLEMENTED, "this server keeps no state: it cannot fork sandboxes").no_retry())?;
    let paused = || ApiError::new(StatusCode::CONFLICT, format!("sandbox '{id}' is paused and cannot be forked; resume it first")).no_retry();
    let caps = match sandboxes.get(id) {
        Some(e) => sandboxes.capabilities(e.tier),
        None if saved.get(id).is_some() => return Err(paused()),
        None => return Err(ApiError::not_found(format!("sandbox {id} not found"))),
    };
    if caps.checkpoint && !caps.keep_writable {
        return fork_memory(sandboxes, saved, id, count, timeout, domain, paused).await;
    }
    let (e, meta) = saved.capture_running(sandboxes, id, "fork", paused).await?;
    // Each fork gets an image of its own below.
    let req = like(&e, timeout);
    let one = |n: u32| {
        let (meta, mut req) = (meta.clone(), req.clone());
        async move {
            let who = Identity::fresh();
            let image = format!("{OWN_PREFIX}{}-{}", who.id, crate::saved::unix_ms(std::time::SystemTime::now()));
            saved.commit(&image, meta).await?;
            req.image = image.clone();
            req.own_image = Some(image.clone());
            let created = sandboxes.create_as(req, who).await;
            if created.is_err() {
                saved.drop_image(&image).await;
            }
            let e = created?;
            tracing::info!(sandbox = %e.id, source = %id, n, "sandbox forked");
            Ok::<_, ApiError>(e)
        }
    };
    let results = futures_util::future::join_all((0..count).map(one)).await;
    let layers_made = meta.layers.last().cloned();
    let entries: Vec<Value> = results
        .into_iter()
        .map(|r| match r {
            Ok(e) => {
                let mut s = crate::api::sandbox_json(&e, domain);
                s["forkMode"] = json!("filesystem");
                json!({"sandbox": s})
            }
            Err(err) => json!({"error": {"code": err.status.as_u16(), "message": err.message}}),
        })
        .collect();
    // A layer no fork came to name (every fork failed) goes.
    if let Some(l) = layers_made {
        let store = saved.store().clone();
        let _ = tokio::task::spawn_blocking(move || store.remove_unnamed(&[l])).await;
    }
    Ok(entries)
}

/// Forks that copy the source's processes and memory (see the module's text).
async fn fork_memory(
    sandboxes: &Arc<Sandboxes>,
    saved: &crate::saved::Saved,
    id: &str,
    count: u32,
    timeout: Duration,
    domain: Option<&str>,
    paused: impl Fn() -> ApiError,
) -> Result<Vec<Value>, ApiError> {
    let (e, kept) = saved.checkpoint_running(sandboxes, id, paused).await?;
    let req = NewSandbox { restore: Some(kept.dir.clone()), ..like(&e, timeout) };
    let one = |n: u32| {
        let req = req.clone();
        async move {
            let e = sandboxes.create_as(req, Identity::fresh()).await?;
            tracing::info!(sandbox = %e.id, source = %id, n, mode = "memory", "sandbox forked");
            Ok::<_, ApiError>(e)
        }
    };
    let results = futures_util::future::join_all((0..count).map(one)).await;
    drop(kept);
    Ok(results
        .into_iter()
        .map(|r| match r {
            Ok(e) => {
                let mut s = crate::api::sandbox_json(&e, domain);
                s["forkMode"] = json!("memory");
                json!({"sandbox": s})
            }
            Err(err) => json!({"error": {"code": err.status.as_u16(), "message": err.message}}),
        })
        .collect())
}

/// A create of a sandbox like `e` (its template, image, limits, environment, metadata, network
/// policy and lifecycle), for `timeout`.
fn like(e: &crate::registry::LiveSandbox, timeout: Duration) -> NewSandbox {
    NewSandbox {
        tier: e.tier,
        template: e.template.clone(),
        image: e.image.clone(),
        own_image: None,
        lifecycle: e.lifecycle,
        timeout,
        metadata: e.metadata.clone(),
        env_vars: e.env_vars.clone(),
        cpu_count: e.cpu_count,
        memory_mb: e.memory_mb,
        disk_mb: e.disk_mb,
        network: e.network(),
        traffic: e.traffic.clone(),
        restore: None,
        disk_from: None,
        volume_mounts: e.volume_mounts.clone(),
    }
}
