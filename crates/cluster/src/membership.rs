//! A node's membership: its key in etcd under a lease, renewed with its capacity, and the view
//! of every node that each node keeps by reading the members' keys once a second.
//!
//! Keys (values are JSON):
//! - `/cordon/v1/nodes/<name>`: a live node's [`NodeInfo`], attached to its lease. A node that
//!   dies stops renewing; etcd deletes the key when the lease runs out, and the next read of
//!   every other node drops it, so its sandboxes answer as missing from then on.
//! - `/cordon/v1/drain/<name>`: present while a node is drained (no lease: a drain outlives the
//!   node's restarts until `cordon node undrain`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::etcd::{Etcd, LeaseId};
use crate::{ids, placement, ClusterError};

const NODES: &str = "/cordon/v1/nodes/";
const DRAIN: &str = "/cordon/v1/drain/";

/// How often a node reads the members' keys: how stale its view of who is alive can be,
/// beyond the lease's TTL.
const VIEW_REFRESH: Duration = Duration::from_secs(1);

/// Longest time between two publications of a node's capacity.
const MAX_HEARTBEAT: Duration = Duration::from_secs(2);

/// How a node joins (`cordon serve --cluster ... --node-name ... --advertise ...`).
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd's client URLs.
    pub etcd: Vec<String>,
    /// This node's name: part of every id of its sandboxes.
    pub node: String,
    /// Where the other nodes reach this one (`http://HOST:PORT`).
    pub advertise: String,
    /// The lease's time to live: a dead node drops out after at most this (plus a second).
    pub ttl: Duration,
}

impl ClusterConfig {
    /// From `--cluster etcd=URL[,URL...]` and the other flags, checked.
    pub fn parse(spec: &str, node: &str, advertise: &str, ttl: Duration) -> Result<ClusterConfig, ClusterError> {
        let urls = spec.strip_prefix("etcd=").ok_or_else(|| ClusterError::BadSpec(spec.to_string()))?;
        let etcd: Vec<String> = urls.split(',').map(str::trim).filter(|u| !u.is_empty()).map(str::to_string).collect();
        Etcd::new(&etcd)?;
        if !ids::valid_node_name(node) {
            return Err(ClusterError::BadNodeName(node.to_string()));
        }
        if crate::host_port(advertise).is_none() {
            return Err(ClusterError::BadEndpoint(advertise.to_string()));
        }
        Ok(ClusterConfig { etcd, node: node.to_string(), advertise: advertise.trim_end_matches('/').to_string(), ttl: ttl.max(Duration::from_secs(2)) })
    }
}

/// What a node publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeInfo {
    pub name: String,
    /// Where its API answers.
    pub url: String,
    /// The host's available memory (`MemAvailable`), bytes.
    pub free_memory: u64,
    pub cpus: u32,
    /// Live sandboxes, and the most it takes (`--max-sandboxes`).
    pub sandboxes: usize,
    pub max_sandboxes: usize,
    /// The tiers it can run.
    pub tiers: Vec<String>,
    /// The templates it holds (names, aliases, snapshot ids).
    pub templates: Vec<String>,
    /// Its warm pools, as `template:tier=N`.
    pub pools: Vec<String>,
    /// Counts its publications: a placement decided since the last one is not in its figures.
    pub seq: u64,
    pub started_unix_ms: u64,
    /// Set in the view, from the drain keys: not published by the node itself.
    #[serde(default)]
    pub draining: bool,
}

/// What the server reports of itself at each heartbeat.
#[derive(Debug, Clone, Default)]
pub struct Load {
    pub sandboxes: usize,
    pub max_sandboxes: usize,
    pub tiers: Vec<String>,
    pub templates: Vec<String>,
    pub pools: Vec<String>,
}

type LoadFn = dyn Fn() -> Load + Send + Sync;

/// A joined node.
pub struct Cluster {
    etcd: Etcd,
    config: ClusterConfig,
    load: Box<LoadFn>,
    lease: Mutex<LeaseId>,
    seq: std::sync::atomic::AtomicU64,
    started_unix_ms: u64,
    view: RwLock<HashMap<String, NodeInfo>>,
    /// Memory placed on each node by this one since that node's publication `seq`.
    placed: Mutex<HashMap<String, (u64, u64)>>,
}

impl Cluster {
    /// Registers this node (refused when a live node at another URL has its name), reads the
    /// members once, and starts the heartbeat and the view's refresh on the current runtime.
    pub async fn join(config: ClusterConfig, load: impl Fn() -> Load + Send + Sync + 'static) -> Result<Arc<Cluster>, ClusterError> {
        let etcd = Self::preflight(&config).await?;
        let lease = etcd.grant(config.ttl.as_secs()).await?;
        let started_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let cluster = Arc::new(Cluster {
            etcd,
            config,
            load: Box::new(load),
            lease: Mutex::new(lease),
            seq: Default::default(),
            started_unix_ms,
            view: RwLock::new(HashMap::new()),
            placed: Mutex::new(HashMap::new()),
        });
        cluster.publish().await?;
        cluster.refresh().await?;
        tokio::spawn(heartbeat(Arc::downgrade(&cluster)));
        tokio::spawn(watch(Arc::downgrade(&cluster)));
        Ok(cluster)
    }

    /// Checks, before a server does anything else, that etcd answers and that no live node at
    /// another URL has this node's name.
    pub async fn preflight(config: &ClusterConfig) -> Result<Etcd, ClusterError> {
        let etcd = Etcd::new(&config.etcd)?;
        let key = format!("{NODES}{}", config.node);
        for (k, v) in etcd.prefix(&key).await? {
            if k != key {
                continue;
            }
            // The same node restarting within its old lease's TTL takes its name back.
            if let Ok(old) = serde_json::from_slice::<NodeInfo>(&v) {
                if old.url != config.advertise {
                    return Err(ClusterError::NameTaken { name: config.node.clone(), url: old.url });
                }
            }
        }
        Ok(etcd)
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.config.node
    }

    /// The lease's time to live.
    pub fn ttl(&self) -> Duration {
        self.config.ttl
    }

    /// A live node by name, as last read.
    pub fn node(&self, name: &str) -> Option<NodeInfo> {
        self.view.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    /// Every live node, by name.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        let mut v: Vec<NodeInfo> = self.view.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Whether `name` is this node.
    pub fn is_self(&self, name: &str) -> bool {
        name == self.config.node
    }

    /// Marks a node drained (no new sandboxes placed there) or not.
    pub async fn set_drain(&self, name: &str, drain: bool) -> Result<(), ClusterError> {
        let key = format!("{DRAIN}{name}");
        if drain {
            self.etcd.put(&key, b"1", None).await?;
        } else {
            self.etcd.delete(&key).await?;
        }
        self.refresh().await
    }

    /// Leaves the cluster now (the lease and its key go), rather than when the lease expires.
    pub async fn leave(&self) {
        let lease = *self.lease.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = self.etcd.revoke(lease).await {
            tracing::warn!("cluster: could not leave at once (the lease will expire): {e}");
        }
    }

    /// The nodes a create should try, best first (see [`placement`]).
    pub fn placement(&self, want: &placement::Want<'_>) -> Vec<NodeInfo> {
        let nodes = self.nodes();
        let placed = self.placed.lock().unwrap_or_else(|e| e.into_inner());
        let scored: Vec<placement::Scored> = nodes
            .into_iter()
            .map(|n| {
                let pending = placed.get(&n.name).filter(|(seq, _)| *seq == n.seq).map_or(0, |(_, m)| *m);
                placement::Scored { node: n, pending }
            })
            .collect();
        drop(placed);
        placement::order(scored, want, random())
    }

    /// Counts `memory` placed on `name` until that node publishes figures that include it.
    pub fn note_placed(&self, name: &str, memory: u64) {
        let Some(seq) = self.node(name).map(|n| n.seq) else { return };
        let mut placed = self.placed.lock().unwrap_or_else(|e| e.into_inner());
        let e = placed.entry(name.to_string()).or_insert((seq, 0));
        if e.0 != seq {
            *e = (seq, 0);
        }
        e.1 += memory;
    }

    /// Writes this node's key with its current figures.
    async fn publish(&self) -> Result<(), ClusterError> {
        let load = (self.load)();
        let info = NodeInfo {
            name: self.config.node.clone(),
            url: self.config.advertise.clone(),
            free_memory: mem_available(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            sandboxes: load.sandboxes,
            max_sandboxes: load.max_sandboxes,
            tiers: load.tiers,
            templates: load.templates,
            pools: load.pools,
            seq: self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
            started_unix_ms: self.started_unix_ms,
            draining: false,
        };
        let body = serde_json::to_vec(&info).map_err(|e| ClusterError::BadAnswer { call: "publish", why: e.to_string() })?;
        let lease = *self.lease.lock().unwrap_or_else(|e| e.into_inner());
        self.etcd.put(&format!("{NODES}{}", self.config.node), &body, Some(lease)).await
    }

    /// Renews the lease (a new one when it ran out: etcd was unreachable for longer than the
    /// TTL, say), then publishes.
    async fn beat(&self) -> Result<(), ClusterError> {
        let lease = *self.lease.lock().unwrap_or_else(|e| e.into_inner());
        if !self.etcd.keep_alive(lease).await? {
            let fresh = self.etcd.grant(self.config.ttl.as_secs()).await?;
            tracing::warn!(node = %self.config.node, "cluster: this node's lease had expired: registered again");
            *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = fresh;
        }
        self.publish().await
    }

    /// Reads every node's key and the drain marks.
    async fn refresh(&self) -> Result<(), ClusterError> {
        let drained: Vec<String> = self.etcd.prefix(DRAIN).await?.into_iter().map(|(k, _)| k[DRAIN.len()..].to_string()).collect();
        let mut view = HashMap::new();
        for (k, v) in self.etcd.prefix(NODES).await? {
            match serde_json::from_slice::<NodeInfo>(&v) {
                Ok(mut n) if n.name == k[NODES.len()..] => {
                    n.draining = drained.contains(&n.name);
                    view.insert(n.name.clone(), n);
                }
                _ => tracing::warn!(key = %k, "cluster: a member's record is not one this version reads; skipped"),
            }
        }
        *self.view.write().unwrap_or_else(|e| e.into_inner()) = view;
        Ok(())
    }
}

/// Renews the lease and republishes, until the cluster is dropped.
async fn heartbeat(cluster: std::sync::Weak<Cluster>) {
    let mut failing = false;
    loop {
        let Some(c) = cluster.upgrade() else { return };
        let every = (c.config.ttl / 3).min(MAX_HEARTBEAT);
        match c.beat().await {
            Ok(()) if failing => {
                tracing::info!("cluster: etcd answers again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!("cluster: heartbeat failed (retrying): {e}");
                failing = true;
            }
            Err(_) => {}
        }
        drop(c);
        tokio::time::sleep(every).await;
    }
}

/// Keeps the view current, until the cluster is dropped. When etcd cannot be read the last
/// view stands.
async fn watch(cluster: std::sync::Weak<Cluster>) {
    let mut failing = false;
    loop {
        tokio::time::sleep(VIEW_REFRESH).await;
        let Some(c) = cluster.upgrade() else { return };
        match c.refresh().await {
            Ok(()) => failing = false,
            Err(e) if !failing => {
                tracing::warn!("cluster: cannot read the members (keeping the last view): {e}");
                failing = true;
            }
            Err(_) => {}
        }
    }
}

/// `MemAvailable` of this host, in bytes (0 when unreadable).
fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find_map(|l| l.strip_prefix("MemAvailable:").and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())))
        .map_or(0, |kb| kb << 10)
}

fn random() -> u64 {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_checked() {
        let ok = ClusterConfig::parse("etcd=http://127.0.0.1:2379,http://127.0.0.2:2379", "a1", "http://10.0.0.1:3000", Duration::from_secs(10)).unwrap();
        assert_eq!(ok.etcd.len(), 2);
        assert!(matches!(ClusterConfig::parse("http://127.0.0.1:2379", "a", "http://h:1", Duration::from_secs(5)), Err(ClusterError::BadSpec(_))));
        assert!(matches!(ClusterConfig::parse("etcd=http://h:1", "A", "http://h:1", Duration::from_secs(5)), Err(ClusterError::BadNodeName(_))));
        assert!(matches!(ClusterConfig::parse("etcd=http://h:1", "a", "h:1", Duration::from_secs(5)), Err(ClusterError::BadEndpoint(_))));
        assert!(matches!(ClusterConfig::parse("etcd=h:1", "a", "http://h:1", Duration::from_secs(5)), Err(ClusterError::BadEndpoint(_))));
    }
}
