//! Egress for sandboxes with a network policy.
//!
//! The sandbox's only non-loopback interface is a TUN device whose descriptor the host holds
//! (created by the jailer; see `cordon_host::tun`), or for a VM a virtio-net interface whose
//! frames reach the host on a socket pair ([`ethernet`]). [`Egress`] terminates that link in a
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
//! - every blocked attempt is recorded ([`audit`]);
//! - a connection to a host with injection rules (and only those) is terminated here, its
//!   requests given the rule's headers, and relayed to the real host over verified TLS
//!   ([`intercept`], with leaf certificates of the host's egress CA, [`ca`]); each injection is
//!   counted in the audit, never its value.
//!
//! The policy sits behind a lock and can be replaced while the sandbox runs
//! ([`Egress::update_policy`]); connections already open stay open.
//!
//! Each sandbox's forwarder runs on a thread of its own whose CPU counts against the sandbox's
//! `--cpus` ([`cpu`]), and its queues and connections are bounded per sandbox ([`forward`]'s
//! budgets), so what a sandbox makes its forwarder do stays within what the sandbox was given.

mod allocator;
pub mod audit;
pub mod ca;
pub mod cpu;
mod device;
pub mod dns;
pub mod ethernet;
mod forward;
pub mod guard;
pub mod intercept;
pub mod sniff;

pub use audit::{AuditLog, Blocked, FlowCounts, Injected};
pub use ca::{CaError, EgressCa};
pub use intercept::{Interception, SecretSource};
pub use cpu::CpuCharge;

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
    /// The forwarder's thread or runtime could not be started.
    #[error("cannot start the forwarder's thread: {0}")]
    Thread(std::io::Error),
    /// An upstream given as text did not parse.
    #[error("DNS upstream '{0}' is not IP:PORT (or IP, meaning port 53)")]
    BadUpstream(String),
    /// Injection rules were given to a forwarder that cannot terminate TLS.
    #[error("header injection rules need the egress CA, which this forwarder was not given")]
    NoInterception,
    /// What upstream hosts are verified against could not be loaded.
    #[error("upstream CA certificates ({path}): {reason}")]
    UpstreamCa { path: String, reason: String },
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
    /// How the forwarder's own CPU is held to the sandbox's quota.
    pub cpu: CpuCharge,
    /// Termination of TLS for the hosts of injection rules; `None`: a policy with such rules
    /// is refused.
    pub intercept: Option<Arc<Interception>>,
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
    pub(crate) audit: Arc<AuditLog>,
    pub(crate) dns: dns::Dns,
    gateways: Vec<IpAddr>,
    /// The per-sandbox budgets of the forwarder (see `forward`): open TCP connections, UDP DNS
    /// flows and DNS questions in flight.
    pub(crate) tcp_flows: Arc<tokio::sync::Semaphore>,
    pub(crate) udp_flows: Arc<tokio::sync::Semaphore>,
    pub(crate) dns_inflight: Arc<tokio::sync::Semaphore>,
    pub(crate) intercept: Option<Arc<Interception>>,
}

impl Shared {
    pub(crate) fn policy(&self) -> Arc<NetworkPolicy> {
        self.policy.read().expect("policy lock").clone()
    }

    pub(crate) fn is_gateway(&self, ip: IpAddr) -> bool {
        self.gateways.contains(&ip)
    }
}

/// The host end of a sandbox's one network link.
#[derive(Debug)]
pub enum Link {
    /// A TUN device's descriptor: IP packets.
    Tun(OwnedFd),
    /// One end of a Unix datagram socket pair whose other end is a VMM's virtio-net backend:
    /// Ethernet frames ([`ethernet`]).
    Ethernet(OwnedFd),
}

/// A running forwarder for one sandbox. Dropping it stops it (the sandbox loses its network).
pub struct Egress {
    shared: Arc<Shared>,
    /// Ends the forwarder's runtime (every flow with it) when sent or dropped.
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Whether the forwarder's thread joined the sandbox's CPU group.
    charged: bool,
    tid: libc::pid_t,
}

impl Egress {
    /// Starts serving `link` on a thread of its own, charged as `cfg.cpu` says.
    pub fn start(link: Link, policy: NetworkPolicy, cfg: EgressConfig) -> Result<Egress, NetError> {
        if !policy.transforms.is_empty() && cfg.intercept.is_none() {
            return Err(NetError::NoInterception);
        }
        let shared = Arc::new(Shared {
            policy: RwLock::new(Arc::new(policy)),
            audit: Arc::default(),
            dns: dns::Dns::new(cfg.dns_upstream)?,
            gateways: cfg.gateways,
            tcp_flows: Arc::new(tokio::sync::Semaphore::new(forward::MAX_TCP_FLOWS)),
            udp_flows: Arc::new(tokio::sync::Semaphore::new(forward::MAX_UDP_FLOWS)),
            dns_inflight: Arc::new(tokio::sync::Semaphore::new(forward::MAX_DNS_INFLIGHT)),
            intercept: cfg.intercept,
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let (mtu, cpu, s) = (cfg.mtu, cfg.cpu, shared.clone());
        allocator::keep_freed_memory();
        let thread = std::thread::Builder::new()
            .name("cordon-egress".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() };
                let charged = cpu.group.is_some_and(|g| {
                    g.join_current_thread()
                        .map_err(|e| tracing::warn!("the forwarder cannot join the sandbox's CPU group ({e}); it keeps to a budget of its own"))
                        .is_ok()
                });
                let budget = (!charged).then_some(cpu.cpus);
                let started = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(NetError::Thread)
                    .and_then(|rt| {
                        let device = rt
                            .block_on(async {
                                Ok::<_, std::io::Error>(match link {
                                    Link::Tun(fd) => Device::Tun(device::TunDevice::new(fd)?),
                                    Link::Ethernet(fd) => Device::Ethernet(ethernet::EthernetDevice::new(fd, s.audit.clone())?),
                                })
                            })
                            .map_err(NetError::Device)?;
                        Ok((rt, device))
                    });
                let (rt, device) = match started {
                    Ok(x) => x,
                    // The thread ends here, which takes it out of the group again.
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((tid, charged)));
                rt.block_on(async move {
                    if let Some(cpus) = budget {
                        tokio::spawn(cpu::enforce(cpus));
                    }
                    let served = async {
                        match device {
                            Device::Tun(d) => forward::serve(d, mtu, s).await,
                            Device::Ethernet(d) => forward::serve(d, mtu, s).await,
                        }
                    };
                    tokio::select! {
                        () = served => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime drops every flow's task with it.
            })
            .map_err(NetError::Thread)?;
        let (tid, charged) = match ready.recv() {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(NetError::Thread(std::io::Error::other("the forwarder's thread ended at start")));
            }
        };
        Ok(Egress { shared, stop: Some(stop), thread: Some(thread), charged, tid })
    }

    /// Replaces the policy; new connections, DNS queries and requests on intercepted
    /// connections follow it at once.
    pub fn update_policy(&self, policy: NetworkPolicy) -> Result<(), NetError> {
        if !policy.transforms.is_empty() && self.shared.intercept.is_none() {
            return Err(NetError::NoInterception);
        }
        *self.shared.policy.write().expect("policy lock") = Arc::new(policy);
        Ok(())
    }

    /// Headers injected so far, counted per host and header name.
    pub fn injected(&self) -> Vec<Injected> {
        self.shared.audit.injections()
    }

    pub fn policy(&self) -> Arc<NetworkPolicy> {
        self.shared.policy()
    }

    /// Every blocked attempt so far.
    pub fn blocked(&self) -> Vec<Blocked> {
        self.shared.audit.snapshot()
    }

    /// Connections let out and attempts refused so far.
    pub fn flow_counts(&self) -> FlowCounts {
        self.shared.audit.counts()
    }

    /// The forwarder's host thread (its CPU is the forwarder's CPU).
    pub fn thread_id(&self) -> libc::pid_t {
        self.tid
    }

    /// Whether the forwarder's thread runs in the sandbox's CPU group.
    pub fn charged_to_group(&self) -> bool {
        self.charged
    }
}

enum Device {
    Tun(device::TunDevice),
    Ethernet(ethernet::EthernetDevice),
}

impl Drop for Egress {
    fn drop(&mut self) {
        // The thread leaves the sandbox's group by ending, without another cgroup migration.
        // The tier kills the sandbox's processes before this (see `HostBacked::destroy`), so
        // the thread does not wait for their quota to end; once it is joined the group can be
        // removed.
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
