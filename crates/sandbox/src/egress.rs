//! The egress forwarder of a sandbox with a network link, shared by every tier.

use std::net::IpAddr;
pub use cordon_net::{ethernet::GATEWAY_MAC, Link};

use cordon_host::Cgroup;
use cordon_spec::{Limits, NetworkPolicy};

use crate::{Blocked, Error};

/// What a tier's forwarders use of the host: where names resolve, and the TLS termination of
/// header injection rules (see [`crate::Host`]).
#[derive(Debug, Clone, Default)]
pub struct Upstream {
    pub dns: Option<std::net::SocketAddr>,
    pub intercept: Option<std::sync::Arc<cordon_net::Interception>>,
}

impl Upstream {
    pub fn of(host: &crate::Host) -> Upstream {
        Upstream { dns: host.dns_upstream, intercept: host.intercept.clone() }
    }
}

/// A sandbox's forwarder, if it has network access at all.
#[derive(Default)]
pub struct Egress(Option<cordon_net::Egress>);

impl Egress {
    /// Serves a new sandbox's link (its TUN device or its VM's frames, if it has one) on a
    /// forwarder thread of its own, whose CPU counts against `limits.cpus`: in the sandbox's
    /// `cgroup` where that can take a host thread (v1), on a budget of its own otherwise.
    /// `gateways` are the sandbox's gateway addresses, where DNS is answered; `upstream` where
    /// names resolve and how injection rules are served.
    pub fn start(
        link: Option<Link>,
        policy: &NetworkPolicy,
        gateways: Vec<IpAddr>,
        mtu: u16,
        upstream: &Upstream,
        cgroup: &Cgroup,
        limits: &Limits,
    ) -> Result<Egress, Error> {
        let Some(link) = link else { return Ok(Egress(None)) };
        let cpu = cordon_net::CpuCharge { cpus: limits.cpus, group: cgroup.thread_charge() };
        let cfg = cordon_net::EgressConfig { gateways, dns_upstream: upstream.dns, mtu, cpu, intercept: upstream.intercept.clone() };
        cordon_net::Egress::start(link, policy.clone(), cfg)
            .map(|e| Egress(Some(e)))
            .map_err(|e| Error::failed("start the sandbox's egress forwarder", e))
    }

    /// What the policy blocked so far.
    pub fn blocked(&self) -> Vec<Blocked> {
        self.0.as_ref().map(|e| e.blocked()).unwrap_or_default()
    }

    /// Connections let out and attempts refused so far (`None` without a network).
    pub fn flow_counts(&self) -> Option<cordon_net::FlowCounts> {
        self.0.as_ref().map(|e| e.flow_counts())
    }

    /// Headers the forwarder injected so far, per host and header name.
    pub fn injected(&self) -> Vec<cordon_net::Injected> {
        self.0.as_ref().map(|e| e.injected()).unwrap_or_default()
    }

    /// Replaces the policy; new connections follow it.
    pub fn set_network(&self, policy: NetworkPolicy) -> Result<(), Error> {
        match &self.0 {
            Some(e) => {
                e.update_policy(policy).map_err(|e| Error::failed("update the sandbox's network", e))
            }
            None => Err(Error::NoNetwork),
        }
    }

    /// Stops it: nothing more is dialled for the sandbox (first step of a teardown).
    pub fn stop(&mut self) {
        self.0.take();
    }
}
