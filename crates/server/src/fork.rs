//! Fork: `count` new sandboxes from a running one's files. The source is frozen while its
//! writable layer becomes a layer, then thawed: it keeps its id, deadline and processes. Each
//! fork is a fresh sandbox (its own id, tokens, hostname, boot, random state and clock) on an
//! image of its own over the source's layers and that one, shared copy-on-write, with the
//! source's template, limits, environment, metadata, network policy and lifecycle. On the ns
//! tier (and a gvisor sandbox with a network policy, which runsc cannot save) a fork copies
//! files, not processes; on a tier that saves a running sandbox to disk it copies the processes
//! and memory too: the source's state is saved once and each fork is restored from that state
//! with its own id and hostname (the vm tier also gives each a seed and clock; gVisor's kernel
//! takes both from the host). The vm tier's source goes on while it is saved; a gvisor source is
//! paused to disk and resumed from the same save (`fork_through_pause`). Each fork's entry says
//! which (`forkMode`).

use std::sync::Arc;
use std::time::Duration;

use hyper::StatusCode;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::registry::{NewSandbox, Sandboxes};
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
    let (caps, checkpointable) = match sandboxes.get(id) {
        Some(e) => (sandboxes.capabilities(e.tier), e.checkpointable().await),
        None if saved.get(id).is_some() => return Err(paused()),
        None => return Err(ApiError::not_found(format!("sandbox {id} not found"))),
    };
    if caps.checkpoint && caps.checkpoint_keeps_running {
        return fork_memory(sandboxes, saved, id, count, timeout, domain, paused).await;
    }
    if caps.checkpoint && checkpointable {
        return fork_through_pause(sandboxes, saved, id, count, timeout, domain).await;
    }
    let (e, meta) = saved.capture_running(sandboxes, id, "fork", paused).await?;
    // Each fork gets an image of its own below.
    let req = like(&e, timeout);
    let one = |n: u32| {
        let (meta, mut req) = (meta.clone(), req.clone());
        async move {
            let who = sandboxes.fresh_identity();
            let image = format!("{OWN_PREFIX}{}-{}", who.id, crate::saved::unix_ms(std::time::SystemTime::now()));
            saved.commit(&image, meta).await?;
            req.image = image.clone();
            req.own_image = Some(image.clone());
            let created = sandboxes.create_as(req, who).await;
            if created.is_err() {
                saved.drop_image(&image).await;
            }
            let e = created?;
            tracing::info!(sandbox_id = %e.id, source = %id, n, "sandbox forked");
            Ok::<_, ApiError>(e)
        }
    };
    let results = futures_util::future::join_all((0..count).map(one)).await;
    let layers_made = meta.layers.last().cloned();
    let entries = entries(results, domain, "filesystem");
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
    let owns = e.own_image.is_some();
    let one = |n: u32| restore_one(sandboxes, saved, req.clone(), owns, id, n);
    let results = futures_util::future::join_all((0..count).map(one)).await;
    drop(kept);
    Ok(entries(results, domain, "memory"))
}

/// Forks that copy the processes on a tier whose checkpoint ends the sandbox (gvisor): the
/// source is paused to disk with its memory, each fork is restored from that save (read only,
/// one save starts many) under its own identity, then the source resumes from it with its own
/// id, tokens and the rest of its deadline. While the forks start the source is paused (and a
/// request for it waits or wakes it, as for any paused sandbox). A fork that fails is an
/// `{error}` entry; a source that cannot resume stays paused, resumable by `connect`.
async fn fork_through_pause(sandboxes: &Arc<Sandboxes>, saved: &crate::saved::Saved, id: &str, count: u32, timeout: Duration, domain: Option<&str>) -> Result<Vec<Value>, ApiError> {
    let e = sandboxes.get(id).ok_or_else(|| ApiError::not_found(format!("sandbox {id} not found")))?;
    let end = e.end_at();
    let left = end.duration_since(std::time::SystemTime::now()).unwrap_or_default().max(Duration::from_secs(1));
    drop(e);
    crate::pause::pause(sandboxes, id, true, false).await?;
    let Some(record) = saved.get(id) else {
        // Frozen in place instead (what runs in it could no longer be saved, see
        // `Sandbox::checkpointable`): it goes on, and the fork is refused.
        let _ = crate::pause::resume(sandboxes, id, left).await;
        return Err(ApiError::internal(format!("sandbox {id} could not be saved for the fork; it runs on")));
    };
    let dir = saved.memory_dir(&record).ok_or_else(|| ApiError::internal(format!("sandbox {id} was paused without its memory")))?;
    let req = NewSandbox { restore: Some(dir), own_image: None, ..record.new_sandbox(timeout) };
    let owns = record.owns();
    let one = |n: u32| restore_one(sandboxes, saved, req.clone(), owns, id, n);
    let results = futures_util::future::join_all((0..count).map(one)).await;
    match crate::pause::resume(sandboxes, id, left).await {
        // Its own deadline, to the millisecond, not one counted again from now.
        Ok((source, _)) => {
            source.set_end_at(end.max(std::time::SystemTime::now()));
            sandboxes.persist(&source);
        }
        Err(err) => tracing::warn!(sandbox_id = %id, "the fork's source stays paused: its resume failed: {}", err.message),
    }
    Ok(entries(results, domain, "memory"))
}

/// The answer's entries: `{sandbox}` with its `forkMode`, or `{error}`, one per fork.
fn entries(results: Vec<Result<Arc<crate::registry::LiveSandbox>, ApiError>>, domain: Option<&str>, mode: &str) -> Vec<Value> {
    results
        .into_iter()
        .map(|r| match r {
            Ok(e) => {
                let mut s = crate::api::sandbox_json(&e, domain);
                s["forkMode"] = json!(mode);
                json!({"sandbox": s})
            }
            Err(err) => json!({"error": {"code": err.status.as_u16(), "message": err.message}}),
        })
        .collect()
}

/// Fork `n` of `source`, restored from a save (`req.restore`). A source that ran on an image of
/// its own (deleted with it) gives each fork a copy of that image (its layers, no bytes
/// copied), deleted with the fork, so that no sandbox runs on an image another one deletes.
async fn restore_one(sandboxes: &Arc<Sandboxes>, saved: &crate::saved::Saved, mut req: NewSandbox, source_owns: bool, source: &str, n: u32) -> Result<Arc<crate::registry::LiveSandbox>, ApiError> {
    let who = sandboxes.fresh_identity();
    if source_owns {
        let own = format!("{OWN_PREFIX}{}-{}", who.id, crate::saved::unix_ms(std::time::SystemTime::now()));
        saved.own_copy(&req.image, &own).await?;
        req.image = own.clone();
        req.own_image = Some(own);
    }
    let own = req.own_image.clone();
    match sandboxes.create_as(req, who).await {
        Ok(e) => {
            tracing::info!(sandbox_id = %e.id, source, n, mode = "memory", "sandbox forked");
            Ok(e)
        }
        Err(err) => {
            if let Some(own) = own {
                saved.drop_image(&own).await;
            }
            Err(err)
        }
    }
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
