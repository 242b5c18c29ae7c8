//! The `gvisor` tier as a [`cordon_sandbox::Backend`]: images from the store, sandboxes run by
//! runsc, egress through the forwarder on the sandbox's TUN device.

use std::sync::Arc;

use cordon_sandbox::host_sandbox::HostBacked;
use cordon_sandbox::{egress::Egress, Backend, Capabilities, Error, Host, SandboxSpec};
use cordon_spec::Tier;

use crate::Gvisor;

/// What gvisor sandboxes support: egress, but no host syscall audit (gVisor's own kernel
/// answers every call, so the host's filter has nothing to record); a pause with memory saves
/// the sandbox to disk with runsc's checkpoint (or, with host networking, freezes it in place).
pub const CAPABILITIES: Capabilities = Capabilities { egress: true, syscall_audit: false, host_oom_count: true, freeze: true, keep_writable: true, checkpoint: true, checkpoint_keeps_running: false, keep_disk: false, volumes: true, set_limits: true, survive_restart: true };

/// The tier table's row for gvisor.
pub const TIER: cordon_sandbox::TierEntry = cordon_sandbox::TierEntry { tier: Tier::Gvisor, capabilities: CAPABILITIES, open, diagnose: crate::diagnose::diagnose };

/// Opens the tier (runsc found and usable), reaping what a crashed cordon left of it.
pub fn open(host: &Host) -> Result<Arc<dyn Backend>, Error> {
    let store = cordon_image::Store::open(&host.state_dir).map_err(|e| Error::failed("open the image store", e))?;
    let gv = Gvisor::open(&host.state_dir, &host.exe).map_err(|e| Error::Unavailable(e.to_string()))?;
    Ok(Arc::new(GvisorBackend { gv, store, envd_version: host.envd_version.clone(), upstream: cordon_sandbox::egress::Upstream::of(host) }))
}

/// The `gvisor` tier: images from the store, sandboxes run by runsc.
pub struct GvisorBackend {
    gv: Gvisor,
    store: cordon_image::Store,
    envd_version: Option<String>,
    upstream: cordon_sandbox::egress::Upstream,
}

impl Backend for GvisorBackend {
    fn capabilities(&self, _tier: Tier) -> Capabilities {
        CAPABILITIES
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn cordon_sandbox::Sandbox>, Error> {
        CAPABILITIES.check_network(Tier::Gvisor, &spec.network)?;
        CAPABILITIES.check_restore(Tier::Gvisor, spec)?;
        // Pinned before it is looked up, so it cannot be removed between the two.
        let pin = self.store.pin(&spec.image).map_err(|e| Error::UnknownTemplate(e.to_string()))?;
        let image = cordon_sandbox::image::ensure(&self.store, &spec.image, &mut cordon_sandbox::image::LogProgress(&spec.image))?;
        spec.validate()?;
        if spec.allow_ptrace {
            // gVisor implements ptrace in its own kernel: nothing to open up on the host.
            tracing::debug!(id = %spec.id, "allow_ptrace has no effect under gVisor");
        }
        let agent_cfg = cordon_sandbox::agent::config(spec, &image, self.envd_version.as_deref());
        let cfg = crate::SandboxConfig {
            id: spec.id.clone(),
            layers: image.layers.clone(),
            limits: spec.limits.clone(),
            agent_config: cordon_agent::encode_config(&agent_cfg),
            tun: spec.network.is_enabled(),
            restore: spec.restore.clone(),
            volumes: spec.volumes.clone(),
            egress_ca: spec.trusted_egress_ca().map(str::to_string),
            default_user: agent_cfg.default_user.clone(),
            keep: spec.keep,
        };
        let mut sandbox = self.gv.create(&cfg).map_err(|e| Error::failed("gvisor tier", e))?;
        let tun = sandbox.take_tun();
        let egress = self.egress(tun, &sandbox, spec)?;
        Ok(Box::new(HostBacked { sandbox, egress, start: image.meta.start.clone(), pin }))
    }

    fn kept(&self, _tier: Tier) -> Vec<String> {
        self.gv.kept()
    }

    fn adopt(&self, spec: &SandboxSpec) -> Result<Box<dyn cordon_sandbox::Sandbox>, Error> {
        let pin = self.store.pin(&spec.image).map_err(|e| Error::UnknownTemplate(e.to_string()))?;
        let image = self.store.get(&spec.image).map_err(|e| Error::UnknownTemplate(e.to_string()))?;
        let (sandbox, tun) = self.gv.adopt(&spec.id).map_err(|e| Error::failed("gvisor tier", e))?;
        let egress = self.egress(tun, &sandbox, spec)?;
        Ok(Box::new(HostBacked { sandbox, egress, start: image.meta.start.clone(), pin }))
    }

    fn exists(&self, _tier: Tier, id: &str) -> bool {
        self.gv.exists(id)
    }

    fn reap_kept(&self, _tier: Tier) -> usize {
        self.gv.reap_kept()
    }
}

impl GvisorBackend {
    /// The forwarder of `sandbox` on its TUN device, serving `spec.network`.
    fn egress(&self, tun: Option<std::os::fd::OwnedFd>, sandbox: &crate::Sandbox, spec: &SandboxSpec) -> Result<Egress, Error> {
        let gateways = vec![cordon_host::tun::GATEWAY_V4.into(), cordon_host::tun::GATEWAY_V6.into()];
        Egress::start(tun.map(cordon_sandbox::egress::Link::Tun), &spec.network, gateways, cordon_host::tun::MTU, &self.upstream, &sandbox.cgroup, &spec.limits)
    }
}
