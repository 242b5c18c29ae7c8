//! Pause and resume. A pause keeps a sandbox in one of two ways:
//!
//! - with its memory (`full`): every process frozen in place in its cgroup, on the tiers that
//!   can ([`cordon_sandbox::Capabilities::freeze`]): no instruction runs, its memory stays
//!   resident and counted against its cap, its deadline stops; a resume thaws it, and with
//!   `autoResume` any request to it does. On a tier that saves a running sandbox to disk
//!   instead ([`cordon_sandbox::Capabilities::checkpoint`]: the vm tier, where QEMU writes the
//!   guest's memory and devices to a file and exits; the gvisor tier, where runsc writes its
//!   kernel's state and exits), its processes and memory go to
//!   `<state>/paused/<id>.mem` and all of its RAM is freed; a resume restores it (same
//!   processes, same `boot_id`), also after a restart of the server;
//! - to its files (`filesystem`): its writable layer becomes a layer of the store, every
//!   process ends and all its memory is freed ([`crate::saved`]); a resume (a `connect`) starts
//!   a fresh sandbox on those files with the same id and tokens. A tier whose files the host
//!   must not read (a VM's disk, written by its guest's kernel) keeps the whole disk instead
//!   (`<state>/paused/<id>.disk`), and the resume boots afresh on a copy of it.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use hyper::StatusCode;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::registry::{Identity, LiveSandbox, Sandboxes};

/// E2B's lifecycle of a sandbox, from the create's flat fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    /// At its deadline the sandbox is paused instead of killed.
    pub auto_pause: bool,
    /// That pause keeps memory (`true`, E2B's default) or files only.
    pub auto_pause_memory: bool,
    /// A request to a sandbox paused with its memory wakes it.
    pub auto_resume: bool,
    /// The life a sandbox woken by a request gets (the create's timeout).
    pub resume_timeout_secs: u64,
}

impl Default for Lifecycle {
    fn default() -> Lifecycle {
        Lifecycle { auto_pause: false, auto_pause_memory: true, auto_resume: false, resume_timeout_secs: crate::api::DEFAULT_TIMEOUT_SECS }
    }
}

impl Lifecycle {
    /// From the create body's `autoPause`, `autoPauseMemory` and `autoResume.enabled`, with
    /// E2B's server-side refusals.
    pub fn from_create(auto_pause: Option<bool>, memory: Option<bool>, auto_resume: Option<bool>, timeout: Duration) -> Result<Lifecycle, ApiError> {
        let auto_pause = auto_pause.unwrap_or(false);
        if memory == Some(false) && !auto_pause {
            return Err(ApiError::bad_request("autoPauseMemory=false only applies when autoPause is true."));
        }
        let auto_pause_memory = memory.unwrap_or(true);
        let auto_resume = auto_resume.unwrap_or(false);
        if auto_resume && !auto_pause_memory {
            return Err(ApiError::bad_request(
                "autoResume cannot be combined with a filesystem-only pause (autoPauseMemory=false): such a sandbox resumes only through connect",
            ));
        }
        Ok(Lifecycle { auto_pause, auto_pause_memory, auto_resume, resume_timeout_secs: timeout.as_secs().max(1) })
    }

    /// `lifecycle` as `GET /sandboxes/{id}` reports it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"autoResume": self.auto_resume, "onTimeout": if self.auto_pause { "pause" } else { "kill" }})
    }
}

/// How a paused sandbox was kept, as the API's `pauseMode` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// Processes and memory kept (frozen in place).
    Full,
    /// Files only.
    Filesystem,
}

impl PauseMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Full => "full",
            PauseMode::Filesystem => "filesystem",
        }
    }
}

fn already_paused(id: &str) -> ApiError {
    ApiError::new(StatusCode::CONFLICT, format!("Error pausing sandbox - sandbox '{id}' is already paused")).no_retry()
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("sandbox {id} not found"))
}

fn unsupported(message: String) -> ApiError {
    ApiError::new(StatusCode::NOT_IMPLEMENTED, message).no_retry()
}

/// Freezes (`true`) or thaws a live sandbox, on a blocking thread (the kernel's freeze is
/// waited for).
pub(crate) async fn freeze(e: &Arc<LiveSandbox>, on: bool) -> Result<(), ApiError> {
    let e = e.clone();
    let gone = || Err(cordon_sandbox::Error::Unavailable("the sandbox is gone".into()));
    tokio::task::spawn_blocking(move || e.with_instance(gone(), |i| i.freeze(on)))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|err| ApiError::internal(err.to_string()))
}

/// A pause whose `save` ends the sandbox (to disk with its memory, or keeping its whole disk):
/// listed as paused from the start, so that the data plane answers as for a paused sandbox
/// (and an autoResume request waits for its turn, then resumes it from disk); once the record
/// is written the sandbox leaves the list and is destroyed. If `save` fails, it runs on.
async fn pause_ending(
    sandboxes: &Arc<Sandboxes>,
    e: &Arc<LiveSandbox>,
    save: impl std::future::Future<Output = Result<Arc<crate::saved::Record>, ApiError>>,
) -> Result<Arc<crate::saved::Record>, ApiError> {
    e.set_frozen(Some(SystemTime::now()));
    let record = match save.await {
        Ok(r) => r,
        Err(err) => {
            e.set_frozen(None);
            return Err(err);
        }
    };
    if let Some(gone) = sandboxes.take(&e.id) {
        sandboxes.destroy(&gone).await;
    }
    Ok(record)
}

/// Pauses sandbox `id`, with its memory or to its files. `auto`: the pause of its deadline.
pub async fn pause(sandboxes: &Arc<Sandboxes>, id: &str, memory: bool, auto: bool) -> Result<(), ApiError> {
    if sandboxes.saved.as_ref().is_some_and(|s| s.get(id).is_some()) {
        return Err(already_paused(id));
    }
    let e = sandboxes.get(id).ok_or_else(|| not_found(id))?;
    let _turn = e.transition.lock().await;
    // Killed or paused to disk while this waited for its turn.
    if !sandboxes.get(id).is_some_and(|now| Arc::ptr_eq(&now, &e)) {
        return Err(if sandboxes.saved.as_ref().is_some_and(|s| s.get(id).is_some()) { already_paused(id) } else { not_found(id) });
    }
    if e.frozen_at().is_some() {
        return Err(already_paused(id));
    }
    let caps = sandboxes.capabilities(e.tier);
    // Saved to disk where the tier can save this sandbox (the VM's memory, gVisor's kernel),
    // which frees its memory; else frozen in place.
    if memory && caps.checkpoint && e.checkpointable().await {
        let saved = sandboxes.saved.as_ref().ok_or_else(|| unsupported("this server keeps no state: it cannot save a sandbox's memory to disk".into()))?;
        saved.check_budget(e.memory_current().unwrap_or(0) + e.disk_usage().map_or(0, |(used, _)| used))?;
        let record = pause_ending(sandboxes, &e, saved.pause_with_memory(&e)).await?;
        tracing::info!(sandbox_id = %id, auto, mode = "full", saved = ?record.memory, "sandbox paused to disk with its memory");
        return Ok(());
    }
    if memory {
        if caps.checkpoint && !caps.freeze {
            return Err(crate::saved::unsaveable(&e));
        }
        if !caps.freeze {
            return Err(unsupported(format!(
                "the {} tier cannot pause a sandbox with its memory yet: pause it with memory=false (files only) where the tier keeps files, or kill it",
                e.tier
            )));
        }
        freeze(&e, true).await?;
        e.set_frozen(Some(SystemTime::now()));
        sandboxes.persist(&e);
        tracing::info!(sandbox_id = %id, auto, mode = "full", "sandbox paused");
        return Ok(());
    }
    let saved = sandboxes.saved.as_ref().ok_or_else(|| unsupported("this server keeps no state: it cannot pause a sandbox to its files".into()))?;
    if caps.keep_disk {
        // The whole disk is kept (a VM's, which the host never mounts); the sandbox ends.
        saved.check_budget(e.disk_usage().map_or(e.disk_mb << 20, |(used, _)| used))?;
        let record = pause_ending(sandboxes, &e, saved.pause_keeping_disk(&e)).await?;
        tracing::info!(sandbox_id = %id, auto, mode = "filesystem", kept = ?record.disk, "sandbox paused to its disk");
        return Ok(());
    }
    if !caps.keep_writable || !e.with_instance(false, |i| i.writable_layer().is_some()) {
        return Err(unsupported(format!("the {} tier cannot keep a sandbox's files yet: pause it with its memory, or kill it", e.tier)));
    }
    saved.check_budget(e.disk_usage().map_or(0, |(used, _)| used))?;
    freeze(&e, true).await?;
    let record = match saved.pause_to_disk(&e).await {
        Ok(r) => r,
        Err(err) => {
            // Nothing was kept: the sandbox goes on as it was.
            let _ = freeze(&e, false).await;
            return Err(err);
        }
    };
    // The record is on disk: from here on the sandbox is paused, whatever happens to this
    // server. Its processes go.
    if let Some(gone) = sandboxes.take(id) {
        sandboxes.destroy(&gone).await;
    }
    tracing::info!(sandbox_id = %id, auto, mode = "filesystem", image = %record.image, "sandbox paused");
    Ok(())
}

/// Resumes sandbox `id` if it is paused (`true`), or extends a running one's life to at least
/// `timeout` (`false`).
pub async fn resume(sandboxes: &Arc<Sandboxes>, id: &str, timeout: Duration) -> Result<(Arc<LiveSandbox>, bool), ApiError> {
    if let Some(e) = sandboxes.get(id) {
        let _turn = e.transition.lock().await;
        if !sandboxes.get(id).is_some_and(|now| Arc::ptr_eq(&now, &e)) {
            return Err(not_found(id));
        }
        if e.frozen_at().is_none() {
            let want = SystemTime::now() + timeout;
            if want > e.end_at() {
                e.set_end_at(want);
                sandboxes.persist(&e);
            }
            return Ok((e.clone(), false));
        }
        freeze(&e, false).await?;
        e.set_frozen(None);
        e.set_end_at(SystemTime::now() + timeout);
        sandboxes.persist(&e);
        tracing::info!(sandbox_id = %id, mode = "full", "sandbox resumed");
        return Ok((e.clone(), true));
    }
    let saved = sandboxes.saved.as_ref().ok_or_else(|| not_found(id))?;
    // Taken out of the list while it starts, so that two resumes do not start it twice.
    let record = saved.take(id).ok_or_else(|| not_found(id))?;
    let mut req = record.new_sandbox(timeout);
    req.restore = saved.memory_dir(&record);
    req.disk_from = saved.disk_dir(&record);
    let who = Identity { id: record.id.clone(), token: record.token.clone(), traffic_token: record.traffic_token.clone(), new: false };
    match sandboxes.create_as(req, who).await {
        Ok(e) => {
            saved.forget_resumed(&record).await;
            tracing::info!(sandbox_id = %id, mode = record.mode().as_str(), "sandbox resumed");
            Ok((e, true))
        }
        Err(err) => {
            saved.put_back(record);
            Err(err)
        }
    }
}

/// Kills a paused or running sandbox; false when there is none of that id.
pub async fn kill(sandboxes: &Arc<Sandboxes>, id: &str) -> bool {
    if let Some(e) = sandboxes.get(id) {
        let _turn = e.transition.lock().await;
        if sandboxes.remove(id, crate::server_metrics::EndReason::Api).await {
            return true;
        }
        // Paused to disk while this waited for its turn: the saved state goes below.
    }
    match &sandboxes.saved {
        Some(saved) => saved.delete(id).await,
        None => false,
    }
}
