//! Several `cordon serve` nodes acting as one E2B endpoint.
//!
//! - [`etcd`]: the store. Membership lives in etcd, not in a coordinator of cordon's own: each
//!   node keeps one key under a lease it renews, so a node that dies drops out when its lease
//!   runs out.
//! - [`ids`]: a sandbox's id names the node that owns it, so any node routes a request for it
//!   without asking anyone.
//! - [`membership`]: registering, the heartbeat that republishes this node's capacity, and the
//!   view of the other nodes every node keeps current by polling.
//! - [`placement`]: which node a create goes to (power of two choices over free memory).
//!
//! The HTTP side (forwarding a request to its owner, fanning a list out) is the server's.

pub mod etcd;
pub mod ids;
pub mod membership;
pub mod placement;

pub use ids::{node_of, valid_node_name};

/// `HOST:PORT` of an `http://HOST:PORT` URL (a trailing `/` allowed), the only form the
/// cluster's addresses take: etcd's endpoints and the nodes' `--advertise`.
pub fn host_port(url: &str) -> Option<&str> {
    url.strip_prefix("http://").map(|r| r.trim_end_matches('/')).filter(|r| !r.is_empty() && !r.contains('/') && r.contains(':'))
}
pub use membership::{Cluster, ClusterConfig, NodeInfo};

/// What can go wrong talking to the cluster's store or joining it.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("--cluster {0:?}: give etcd=http://HOST:PORT[,http://HOST:PORT...]")]
    BadSpec(String),
    #[error("--node-name {0:?}: use 1 to 20 of a-z and 0-9 (it becomes part of every sandbox id)")]
    BadNodeName(String),
    #[error("etcd endpoint {0:?}: only http://HOST:PORT is supported")]
    BadEndpoint(String),
    #[error("no etcd endpoint answered ({endpoints}): {last}")]
    Unreachable { endpoints: String, last: String },
    #[error("etcd refused {call}: {status} {message}")]
    Refused { call: &'static str, status: u16, message: String },
    #[error("etcd's answer to {call} is not what its API documents: {why}")]
    BadAnswer { call: &'static str, why: String },
    #[error("node name {name:?} is taken by a live node at {url}: give this node another --node-name, or stop that one")]
    NameTaken { name: String, url: String },
}
