//! Sandboxes that outlive the server: a restart (SIGTERM with `--shutdown keep`, an upgrade,
//! a crash, `kill -9`) leaves them running, and the next server on the same state directory
//! adopts them with everything the API knows of them.
//!
//! Two halves, each kept by its owner: the tier keeps what it needs to take the running
//! sandbox back (its run ledger, see `Backend::adopt`), and this module keeps what the API
//! knows (`<state>/live/<id>.json`: ids, tokens, deadline, metadata, the network policy in
//! force, the paused state), rewritten at every change and removed when the sandbox leaves
//! the list. At start, a sandbox the tier kept and a record names is adopted; one the tier
//! kept with no record (a pooled sandbox nobody took, a create the crash cut short) is ended;
//! a record whose sandbox is gone (it died while no server watched it) is deleted.
//!
//! A tier that cannot let go of a running sandbox but can save one with its memory (vm) has
//! its running sandboxes paused to disk at a stop, marked for the next server, which
//! resumes them at its start ([`Sandboxes::resume_saved_at_start`]); a crash loses those.
//!
//! What does not survive: connections open through the egress forwarder (new ones follow the
//! policy as before), the start command's log so far, and the ns tier's audit trail of denied
//! syscalls (they stay denied; see its notes). A running sandbox whose agent does not answer
//! at adoption (caught by the crash in a transition: a gvisor agent parked for a checkpoint)
//! is ended rather than listed but broken. A deadline that passed meanwhile is applied by
//! the first sweep, which pauses or kills as the sandbox's lifecycle says.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::registry::{LiveSandbox, Sandboxes, MAX_STREAMS_PER_SANDBOX};

/// How long an adopted running sandbox's agent has to answer.
const ADOPT_HEALTH_WITHIN: Duration = Duration::from_secs(5);

/// What the API knows of a live sandbox that outlives the server.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    id: String,
    tier: cordon_spec::Tier,
    template: String,
    image: String,
    own_image: Option<String>,
    token: String,
    traffic_token: String,
    token_ports: Vec<u16>,
    public_traffic: bool,
    mask_host: Option<String>,
    network: cordon_spec::NetworkPolicy,
    metadata: BTreeMap<String, String>,
    env_vars: BTreeMap<String, String>,
    lifecycle: crate::pause::Lifecycle,
    cpu_count: u32,
    memory_mb: u64,
    disk_mb: u64,
    envd_version: String,
    started_unix_ms: u64,
    end_unix_ms: u64,
    frozen_unix_ms: Option<u64>,
    volume_mounts: Vec<crate::volumes::MountRequest>,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn from_unix_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

impl Record {
    fn of(e: &LiveSandbox) -> Record {
        Record {
            id: e.id.clone(),
            tier: e.tier,
            template: e.template.clone(),
            image: e.image.clone(),
            own_image: e.own_image.clone(),
            token: e.token.clone(),
            traffic_token: e.traffic_token.clone(),
            token_ports: e.token_ports.clone(),
            public_traffic: e.traffic.public,
            mask_host: e.traffic.mask_host.clone(),
            network: e.network(),
            metadata: e.metadata.clone(),
            env_vars: e.env_vars.clone(),
            lifecycle: e.lifecycle,
            cpu_count: e.cpu_count,
            memory_mb: e.memory_mb,
            disk_mb: e.disk_mb,
            envd_version: e.envd_version.clone(),
            started_unix_ms: unix_ms(e.started_at),
            end_unix_ms: unix_ms(e.end_at()),
            frozen_unix_ms: e.frozen_at().map(unix_ms),
            volume_mounts: e.volume_mounts.clone(),
        }
    }

    fn spec(&self) -> cordon_spec::SandboxSpec {
        cordon_spec::SandboxSpec {
            id: self.id.clone(),
            tier: self.tier,
            image: self.image.clone(),
            limits: cordon_sandbox::served::limits(self.memory_mb, self.cpu_count, self.disk_mb),
            network: self.network.clone(),
            keep: true,
            ..Default::default()
        }
    }
}

fn path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.json"))
}

fn read(p: &Path) -> Option<Record> {
    serde_json::from_slice(&fs::read(p).ok()?).ok()
}

impl Sandboxes {
    /// Keeps sandboxes across restarts, recording them in `dir`: sandboxes of the tiers that
    /// can are created to outlive this server from now on.
    pub fn keep_across_restarts(&self, dir: PathBuf) -> std::io::Result<()> {
        fs::create_dir_all(&dir)?;
        let _ = self.live_dir.set(dir);
        Ok(())
    }

    /// Whether a sandbox of `tier` made now outlives this server.
    pub(crate) fn keeps(&self, tier: cordon_spec::Tier) -> bool {
        self.live_dir.get().is_some() && self.backend.capabilities(tier).survive_restart
    }

    /// Records `e` for the next server (after each change the API shows), where it outlives
    /// this one. A write that fails costs only the adoption: it is logged, never an error of
    /// the request that changed it.
    pub(crate) fn persist(&self, e: &LiveSandbox) {
        let Some(dir) = self.live_dir.get().filter(|_| self.keeps(e.tier)) else { return };
        let (tmp, to) = (dir.join(format!(".{}.json.tmp", e.id)), path(dir, &e.id));
        let written = serde_json::to_vec(&Record::of(e)).map_err(std::io::Error::other).and_then(|b| fs::write(&tmp, b)).and_then(|()| fs::rename(&tmp, &to));
        if let Err(err) = written {
            tracing::warn!(sandbox_id = %e.id, "cannot record the sandbox for the next server: {err}");
        }
    }

    pub(crate) fn unpersist(&self, id: &str) {
        if let Some(dir) = self.live_dir.get() {
            let _ = fs::remove_file(path(dir, id));
        }
    }

    /// Lets go of every sandbox the next server adopts, leaving it running, and destroys the
    /// rest as [`Sandboxes::destroy_all`] does (the pools' idle sandboxes among them).
    pub async fn leave_all(&self) {
        if let Some(pools) = self.pools.get() {
            pools.close().await;
        }
        self.save_for_restart().await;
        let kept: Vec<Arc<LiveSandbox>> = self.all().into_iter().filter(|e| self.keeps(e.tier)).collect();
        let n = kept.len();
        for e in kept {
            // Whatever transition runs finishes first: its result is what is recorded.
            let _turn = e.transition.lock().await;
            self.persist(&e);
            if self.forget(&e.id).is_none() {
                continue;
            }
            if let Some(instance) = e.take_instance() {
                let _ = tokio::task::spawn_blocking(move || instance.leave_running()).await;
            }
        }
        if n > 0 {
            tracing::info!(count = n, "sandboxes left running for the next server");
        }
        self.destroy_all().await;
    }

    /// The running sandboxes of the tiers that cannot outlive the server but can save a
    /// sandbox with its memory (vm) are paused to disk, each marked to be resumed by
    /// the next server (see [`Sandboxes::resume_saved_at_start`]); one that cannot be saved now
    /// is left to be destroyed.
    async fn save_for_restart(&self) {
        let Some(saved) = &self.saved else { return };
        let due: Vec<Arc<LiveSandbox>> = self
            .all()
            .into_iter()
            .filter(|e| !self.keeps(e.tier) && e.frozen_at().is_none() && self.capabilities(e.tier).checkpoint)
            .collect();
        for e in due {
            let _turn = e.transition.lock().await;
            if !e.is_live() || !e.checkpointable().await {
                tracing::info!(sandbox_id = %e.id, tier = %e.tier, "this sandbox cannot be saved now: it is destroyed with the server");
                continue;
            }
            let end = unix_ms(e.end_at());
            match saved.pause_with_memory(&e).await.and_then(|_| saved.set_resume_at_start(&e.id, Some(end))) {
                Ok(()) => {
                    if let Some(gone) = self.forget(&e.id) {
                        self.destroy(&gone).await;
                    }
                    tracing::info!(sandbox_id = %e.id, tier = %e.tier, "sandbox saved with its memory, for the next server to resume");
                }
                Err(err) => tracing::warn!(sandbox_id = %e.id, "cannot save the sandbox for the next server: {}", err.message),
            }
        }
    }

    /// Resumes the sandboxes a stopping server saved for this one (see
    /// [`Sandboxes::save_for_restart`]), each until its own deadline; one whose deadline passed
    /// meanwhile stays paused if its lifecycle pauses at the deadline and is deleted otherwise.
    /// Returns how many run again.
    pub async fn resume_saved_at_start(self: &Arc<Self>) -> usize {
        let Some(saved) = &self.saved else { return 0 };
        let mut resumed = 0;
        let now = unix_ms(SystemTime::now());
        for r in saved.all() {
            let Some(end) = r.resume_at_start else { continue };
            if end <= now {
                if r.lifecycle.auto_pause {
                    let _ = saved.set_resume_at_start(&r.id, None);
                    tracing::info!(sandbox_id = %r.id, "its deadline passed while no server ran: it stays paused");
                } else {
                    saved.delete(&r.id).await;
                    self.stats.ended(r.tier, crate::server_metrics::EndReason::Timeout);
                    tracing::info!(sandbox_id = %r.id, reason = "timeout", "its deadline passed while no server ran: deleted");
                }
                continue;
            }
            match crate::pause::resume(self, &r.id, Duration::from_millis(end - now)).await {
                Ok((e, _)) => {
                    // Its deadline to the millisecond, not one counted again after the resume.
                    e.set_end_at(from_unix_ms(end));
                    resumed += 1;
                }
                Err(e) => {
                    // Left paused, as a user's pause would be: resumable by hand.
                    let _ = saved.set_resume_at_start(&r.id, None);
                    tracing::warn!(sandbox_id = %r.id, "cannot resume a sandbox the last server saved; it stays paused: {}", e.message);
                }
            }
        }
        if resumed > 0 {
            tracing::info!(count = resumed, "sandboxes the last server saved resumed");
        }
        resumed
    }

    /// Adopts the sandboxes a previous server left running, as its records say, and ends those
    /// it left without one. Returns how many were adopted.
    pub async fn adopt_kept(self: &Arc<Self>) -> usize {
        let Some(dir) = self.live_dir.get().cloned() else { return 0 };
        let mut adopted = 0;
        for tier in [cordon_spec::Tier::Ns, cordon_spec::Tier::Gvisor, cordon_spec::Tier::Vm] {
            let backend = self.backend.clone();
            let ids = tokio::task::spawn_blocking(move || backend.kept(tier)).await.unwrap_or_default();
            for id in ids {
                let Some(rec) = read(&path(&dir, &id)).filter(|r| r.tier == tier) else { continue };
                // Its pause to disk finished before the server died: the paused sandbox is the
                // one that counts, and this one is ended with the rest.
                if self.saved.as_ref().is_some_and(|s| s.get(&id).is_some()) {
                    continue;
                }
                match self.adopt(rec).await {
                    Ok(()) => adopted += 1,
                    Err(e) => tracing::warn!(sandbox_id = %id, "cannot adopt a sandbox the last server left running; it is ended: {e}"),
                }
            }
            let backend = self.backend.clone();
            let reaped = tokio::task::spawn_blocking(move || backend.reap_kept(tier)).await.unwrap_or(0);
            if reaped > 0 {
                tracing::info!(tier = %tier, count = reaped, "sandboxes left running with no record (or not adoptable) ended");
            }
        }
        // What a save cut short by the last server's end wrote meanwhile: a `runsc checkpoint`
        // it started makes its directory first and ends with the sandbox it saves, which was
        // not adopted (its agent was parked) and is ended by now.
        if let Some(saved) = &self.saved {
            saved.sweep_unnamed_saves();
        }
        // Records of sandboxes that ended while no server watched them (not those of another
        // server's live sandboxes, on a state directory two servers share).
        if let Ok(entries) = fs::read_dir(&dir) {
            for f in entries.flatten() {
                let Some(rec) = read(&f.path()) else {
                    let _ = fs::remove_file(f.path());
                    continue;
                };
                let backend = self.backend.clone();
                let exists = tokio::task::spawn_blocking(move || backend.exists(rec.tier, &rec.id)).await.unwrap_or(true);
                if !exists {
                    let _ = fs::remove_file(f.path());
                }
            }
        }
        if adopted > 0 {
            tracing::info!(count = adopted, "sandboxes adopted from the last server");
        }
        adopted
    }

    async fn adopt(self: &Arc<Self>, rec: Record) -> Result<(), cordon_sandbox::Error> {
        let spec = rec.spec();
        let backend = self.backend.clone();
        let instance = tokio::task::spawn_blocking(move || backend.adopt(&spec))
            .await
            .map_err(|e| cordon_sandbox::Error::failed("adopt", std::io::Error::other(e.to_string())))??;
        let leases = match self.lease_volumes(&rec.volume_mounts, rec.tier).await {
            Ok(l) => l.into_iter().map(|(_, l)| l).collect(),
            Err(e) => {
                tracing::warn!(sandbox_id = %rec.id, "its volumes are not held for it: {}", e.message);
                Vec::new()
            }
        };
        if rec.frozen_unix_ms.is_none() {
            // Frozen by a pause, a snapshot or a fork the server's end cut short: it runs on,
            // as when that transition fails (a tier that cannot freeze, vm, lets its VM's CPUs
            // run again as it adopts it).
            let thaws = self.backend.capabilities(rec.tier).freeze;
            let (instance_thawed, thawed) = tokio::task::spawn_blocking(move || {
                let r = if thaws { instance.freeze(false) } else { Ok(()) };
                (instance, r)
            })
            .await
            .map_err(|e| cordon_sandbox::Error::failed("adopt", std::io::Error::other(e.to_string())))?;
            thawed?;
            // A running sandbox answers at once. One that does not was in a transition the
            // server's end cut short (a gvisor agent parked for a checkpoint): it is ended, as
            // its dropped handle does, rather than listed but broken.
            let client = cordon_envd::EnvdClient::new(instance_thawed.socket_path().to_path_buf());
            if let Err(e) = client.wait_healthy(ADOPT_HEALTH_WITHIN).await {
                let id = rec.id.clone();
                tokio::task::spawn_blocking(move || drop(instance_thawed)).await.ok();
                return Err(cordon_sandbox::Error::Unavailable(format!("sandbox {id}'s agent does not answer ({e})")));
            }
            return self.enlist_adopted(rec, instance_thawed, leases);
        }
        self.enlist_adopted(rec, instance, leases)
    }

    fn enlist_adopted(self: &Arc<Self>, rec: Record, instance: Box<dyn cordon_sandbox::Sandbox>, leases: Vec<cordon_volume::Lease>) -> Result<(), cordon_sandbox::Error> {
        let death = instance.death_fd();
        let socket = instance.socket_path().to_path_buf();
        let entry = Arc::new(LiveSandbox {
            id: rec.id,
            tier: rec.tier,
            template: rec.template,
            token: rec.token,
            traffic_token: rec.traffic_token,
            token_ports: rec.token_ports,
            traffic: crate::traffic::Traffic { public: rec.public_traffic, mask_host: rec.mask_host },
            network: Mutex::new(rec.network),
            metadata: rec.metadata,
            env_vars: rec.env_vars,
            image: rec.image,
            own_image: rec.own_image,
            lifecycle: rec.lifecycle,
            frozen: Mutex::new(rec.frozen_unix_ms.map(from_unix_ms)),
            transition: tokio::sync::Mutex::new(()),
            started_at: from_unix_ms(rec.started_unix_ms),
            cpu_count: rec.cpu_count,
            memory_mb: rec.memory_mb,
            disk_mb: rec.disk_mb,
            envd_version: rec.envd_version,
            socket,
            streams: Arc::new(tokio::sync::Semaphore::new(MAX_STREAMS_PER_SANDBOX)),
            metrics: Default::default(),
            logs: Arc::new(crate::sandbox_logs::SandboxLogs::default()),
            end_at: Mutex::new(from_unix_ms(rec.end_unix_ms)),
            instance: Mutex::new(Some(instance)),
            volume_mounts: rec.volume_mounts,
            volume_leases: Mutex::new(leases),
        });
        self.enlist(&entry, death);
        tracing::info!(sandbox_id = %entry.id, tier = %entry.tier, paused = entry.frozen_at().is_some(), "sandbox adopted");
        Ok(())
    }
}
