//! Egress for sandboxes with a network policy.
//!
//! The sandbox's only non-loopback interface is a TUN device whose descriptor the host holds
//! (created by the jailer; see `cordon_jail::tun`). [`Egress`] terminates that device in a
//! user-space TCP/IP stack (`ipstack`) inside the host process, so every flow is seen before
//! anything is dialled and the host's routing never carries a sandbox packet. Then:
//! - DNS to the gateway (UDP and TCP) is answered here, for allowed names only ([`dns`]);
//! - each TCP connection is named by its TLS SNI or HTTP Host ([`sniff`]) and checked against
//!   the policy; an allowed name is resolved here and the connection goes to the address
//!   resolved here (DNS pinning), never to the one the sandbox dialled; a connection without an
//!   allowed name goes out only to an address an address rule allows (or that this resolver
//!   gave for an allowed name);
//! - no address of the host itself, of loopback or of a private/link-local/metadata range is
//!   ever dialled unless a rule names that range explicitly ([`guard`]);
//! - other UDP, ICMP and every other protocol are dropped;
//! - every blocked attempt is recorded ([`audit`]).
//!
//! The policy sits behind a lock and can be replaced while the sandbox runs
//! ([`Egress::update_policy`]); connections already open stay open.

pub mod audit;
mod device;
pub mod dns;
mod forward;
pub mod guard;
pub mod sniff;

pub use audit::{AuditLog, Blocked};

use cordon_spec::NetworkPolicy;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::sync::{Arc, RwLock};

/// Errors of egress setup. Each message says what failed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The host's resolver configuration could not be read.
    #[error("cannot read the host's DNS configuration ({0}): give an upstream with --dns-upstream IP:PORT or CORDON_DNS_UPSTREAM")]
    Resolver(String),
    /// The TUN descriptor could not be used.
    #[error("sandbox network device: {0}")]
    Device(std::io::Error),
    /// An upstream given as text did not parse.
    #[error("DNS upstream '{0}' is not IP:PORT (or IP, meaning port 53)")]
    BadUpstream(String),
}

/// How the forwarder is set up (policy aside).
#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// The sandbox's gateway addresses, where DNS is answered.
    pub gateways: Vec<IpAddr>,
    /// Where allowed names are resolved; `None`: the host's /etc/resolv.conf.
    pub dns_upstream: Option<SocketAddr>,
    /// MTU of the sandbox's interface.
    pub mtu: u16,
}

/// Parses an upstream resolver given as `IP`, `IP:PORT` or `[IPv6]:PORT`.
pub fn parse_upstream(s: &str) -> Result<SocketAddr, NetError> {
    let s = s.trim();
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    s.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)).map_err(|_| NetError::BadUpstream(s.to_string()))
}

pub(crate) struct Shared {
    policy: RwLock<Arc<NetworkPolicy>>,
    pub(crate) audit: AuditLog,
    pub(crate) dns: dns::Dns,
    gateways: Vec<IpAddr>,
    /// The per-sandbox budgets of the forwarder (see `forward`): open TCP connections, UDP DNS
    /// flows and DNS questions in flight.
    pub(crate) tcp_flows: Arc<tokio::sync::Semaphore>,
    pub(crate) udp_flows: Arc<tokio::sync::Semaphore>,
    pub(crate) dns_inflight: Arc<tokio::sync::Semaphore>,
}

impl Shared {
    pub(crate) fn policy(&self) -> Arc<NetworkPolicy> {
        self.policy.read().expect("policy lock").clone()
    }

    pub(crate) fn is_gateway(&self, ip: IpAddr) -> bool {
        self.gateways.contains(&ip)
    }
}

/// A running forwarder for one sandbox. Dropping it stops it (the sandbox loses its network).
pub struct Egress {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Egress {
    /// Starts serving `tun` on the current tokio runtime (it must have I/O and time enabled).
    pub fn start(tun: OwnedFd, policy: NetworkPolicy, cfg: EgressConfig) -> Result<Egress, NetError> {
        let device = device::TunDevice::new(tun).map_err(NetError::Device)?;
        let shared = Arc::new(Shared {
            policy: RwLock::new(Arc::new(policy)),
            audit: AuditLog::default(),
            dns: dns::Dns::new(cfg.dns_upstream)?,
            gateways: cfg.gateways,
            tcp_flows: Arc::new(tokio::sync::Semaphore::new(forward::MAX_TCP_FLOWS)),
            udp_flows: Arc::new(tokio::sync::Semaphore::new(forward::MAX_UDP_FLOWS)),
            dns_inflight: Arc::new(tokio::sync::Semaphore::new(forward::MAX_DNS_INFLIGHT)),
        });
        let task = tokio::spawn(forward::serve(device, cfg.mtu, shared.clone()));
        Ok(Egress { shared, task })
    }

    /// Replaces the policy; new connections and DNS queries follow it at once.
    pub fn update_policy(&self, policy: NetworkPolicy) {
        *self.shared.policy.write().expect("policy lock") = Arc::new(policy);
    }

    pub fn policy(&self) -> Arc<NetworkPolicy> {
        self.shared.policy()
    }

    /// Every blocked attempt so far.
    pub fn blocked(&self) -> Vec<Blocked> {
        self.shared.audit.snapshot()
    }
}

impl Drop for Egress {
    fn drop(&mut self) {
        self.task.abort();
    }
}
