//! The `ns` tier as a [`cordon_sandbox::Backend`]: images from the store, sandboxes from the
//! [`Jail`], egress through the forwarder on the sandbox's TUN device.

use std::sync::Arc;

use cordon_sandbox::host_sandbox::HostBacked;
use cordon_sandbox::{egress::Egress, Backend, Capabilities, Error, Host, SandboxSpec};
use cordon_spec::{NetworkPolicy, Tier};

use crate::Jail;

/// What ns sandboxes support: all of it.
pub const CAPABILITIES: Capabilities = Capabilities { egress: true, syscall_audit: true, host_oom_count: true, freeze: true, keep_writable: true, checkpoint: false, checkpoint_keeps_running: false, keep_disk: false, volumes: true, set_limits: true, survive_restart: true };

/// The tier table's row for ns.
pub const TIER: cordon_sandbox::TierEntry = cordon_sandbox::TierEntry { tier: Tier::Ns, capabilities: CAPABILITIES, open, diagnose: crate::diagnose::diagnose };

/// Opens the tier, reaping what a crashed cordon left of it.
pub fn open(host: &Host) -> Result<Arc<dyn Backend>, Error> {
    Ok(Arc::new(JailBackend::open(host)?))
}

/// The `ns` tier: images from the store, sandboxes from the jail.
pub struct JailBackend {
    jail: Jail,
    store: cordon_image::Store,
    envd_version: Option<String>,
    upstream: cordon_sandbox::egress::Upstream,
}

/// Ports for Landlock's TCP connect rules: only when every allow rule names ports (see the
/// landlock module for why), and not absurdly many of them.
fn landlock_ports(policy: &NetworkPolicy) -> Option<Vec<(u16, u16)>> {
    if !policy.is_enabled() {
        return None;
    }
    let ports = policy.allowed_ports()?;
    let total: u32 = ports.iter().map(|(lo, hi)| u32::from(hi - lo) + 1).sum();
    (total <= 1024).then_some(ports)
}

impl Backend for JailBackend {
    fn capabilities(&self, _tier: Tier) -> Capabilities {
        CAPABILITIES
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn cordon_sandbox::Sandbox>, Error> {
        // Pinned before it is looked up, so it cannot be removed between the two.
        let pin = self.store.pin(&spec.image).map_err(|e| Error::UnknownTemplate(e.to_string()))?;
        let image = cordon_sandbox::image::ensure(&self.store, &spec.image, &mut cordon_sandbox::image::LogProgress(&spec.image))?;
        self.create_from(spec, &image, pin, None).map(|(sb, _)| sb)
    }

    fn kept(&self, _tier: Tier) -> Vec<String> {
        self.jail.kept()
    }

    /// Its limits are what its cgroups hold (`spec.limits` only sizes the forwarder's share).
    fn adopt(&self, spec: &SandboxSpec) -> Result<Box<dyn cordon_sandbox::Sandbox>, Error> {
        let pin = self.store.pin(&spec.image).map_err(|e| Error::UnknownTemplate(e.to_string()))?;
        let image = self.store.get(&spec.image).map_err(|e| Error::UnknownTemplate(e.to_string()))?;
        let adopted = self.jail.adopt(&spec.id).map_err(|e| Error::failed("ns tier", e))?;
        let egress = self.egress(adopted.tun, &adopted.sandbox, spec)?;
        Ok(Box::new(HostBacked { sandbox: adopted.sandbox, egress, start: image.meta.start.clone(), pin }))
    }

    fn exists(&self, _tier: Tier, id: &str) -> bool {
        self.jail.exists(id)
    }

    fn reap_kept(&self, _tier: Tier) -> usize {
        self.jail.reap_kept()
    }
}

/// A sandbox of an image build step (see [`JailBackend::create_build`]).
pub struct BuildSandbox {
    pub sandbox: Box<dyn cordon_sandbox::Sandbox>,
    /// Sandbox uid N is host uid `uid_base + N`, also in the kept writable layer.
    pub uid_base: u32,
}

impl JailBackend {
    /// A sandbox of `image` (an image being built: its layers so far, not a store name) whose
    /// writable layer is kept at `writable` (see [`crate::SandboxConfig::writable`]); `pin` is
    /// the hold on the store image the build started from. Everything else is as any sandbox
    /// of `spec`: the same jail, filter, caps and egress policy.
    pub fn create_build(&self, spec: &SandboxSpec, image: &cordon_image::Image, pin: cordon_image::Pin, writable: &std::path::Path) -> Result<BuildSandbox, Error> {
        let (sandbox, uid_base) = self.create_from(spec, image, pin, Some(writable.to_owned()))?;
        Ok(BuildSandbox { sandbox, uid_base })
    }

    /// Opens the ns tier for image builds, as [`open`] does for sandboxes.
    pub fn open(host: &Host) -> Result<JailBackend, Error> {
        let store = cordon_image::Store::open(&host.state_dir).map_err(|e| Error::failed("open the image store", e))?;
        let jail = Jail::open(&host.state_dir, host.exe.clone()).map_err(|e| Error::Unavailable(e.to_string()))?;
        Ok(JailBackend { jail, store, envd_version: host.envd_version.clone(), upstream: cordon_sandbox::egress::Upstream::of(host) })
    }

    fn create_from(&self, spec: &SandboxSpec, image: &cordon_image::Image, pin: cordon_image::Pin, writable: Option<std::path::PathBuf>) -> Result<(Box<dyn cordon_sandbox::Sandbox>, u32), Error> {
        spec.validate()?;
        CAPABILITIES.check_restore(Tier::Ns, spec)?;
        let mut agent_cfg = cordon_sandbox::agent::config(spec, image, self.envd_version.as_deref());
        // With ptrace off, no command may open another's memory through /proc either.
        agent_cfg.isolate_commands = !spec.allow_ptrace;
        // A build step's sandbox is its build's alone.
        let keep = spec.keep && writable.is_none();
        let cfg = crate::SandboxConfig {
            id: spec.id.clone(),
            layers: image.layers.clone(),
            limits: spec.limits.clone(),
            agent_config: cordon_agent::encode_config(&agent_cfg),
            allow_ptrace: spec.allow_ptrace,
            audit: spec.audit,
            tun: spec.network.is_enabled(),
            connect_ports: landlock_ports(&spec.network),
            writable,
            keep_writable: spec.keep_writable,
            volumes: spec.volumes.clone(),
            egress_ca: spec.trusted_egress_ca().map(str::to_string),
            default_user: agent_cfg.default_user.clone(),
            keep,
        };
        let mut sandbox = self.jail.create(&cfg).map_err(|e| Error::failed("ns tier", e))?;
        let uid_base = sandbox.uid_base();
        let tun = sandbox.take_tun();
        let egress = self.egress(tun, &sandbox, spec)?;
        Ok((Box::new(HostBacked { sandbox, egress, start: image.meta.start.clone(), pin }), uid_base))
    }

    /// The forwarder of `sandbox` on its TUN device, serving `spec.network`.
    fn egress(&self, tun: Option<std::os::fd::OwnedFd>, sandbox: &crate::Sandbox, spec: &SandboxSpec) -> Result<Egress, Error> {
        let gateways = vec![crate::tun::GATEWAY_V4.into(), crate::tun::GATEWAY_V6.into()];
        Egress::start(tun.map(cordon_sandbox::egress::Link::Tun), &spec.network, gateways, crate::tun::MTU, &self.upstream, &sandbox.cgroup, &spec.limits)
    }
}
