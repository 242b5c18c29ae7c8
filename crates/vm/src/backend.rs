//! The `vm` tier as a [`cordon_sandbox::Backend`]: images from the store, each sandbox a microVM
//! with its own kernel, started from a snapshot of a booted template where it can be.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;

use cordon_sandbox::egress::{Egress, Link, Upstream};
use cordon_sandbox::{Backend, Blocked, Capabilities, Error, Host, SandboxSpec};
use cordon_spec::Tier;

use crate::{VmError, VmTier};

/// What vm sandboxes support: egress through the host's forwarder (the guest's frames reach it
/// on a socket pair, see `cordon_net::ethernet`), no host syscall audit (the guest kernel
/// answers), and the OOM count is the guest's (a round trip through the agent).
pub const CAPABILITIES: Capabilities = Capabilities { egress: true, syscall_audit: false, host_oom_count: false, freeze: false, keep_writable: false, checkpoint: true, checkpoint_keeps_running: true, keep_disk: true, volumes: true, set_limits: false, survive_restart: true };

/// The tier table's row for vm.
pub const TIER: cordon_sandbox::TierEntry = cordon_sandbox::TierEntry { tier: Tier::Vm, capabilities: CAPABILITIES, open, diagnose: crate::diagnose::diagnose };

/// Opens the tier (a VMM found, cgroups usable), reaping what a crashed cordon left of it.
pub fn open(host: &Host) -> Result<Arc<dyn Backend>, Error> {
    let store = cordon_image::Store::open(&host.state_dir).map_err(|e| Error::failed("open the image store", e))?;
    let tier = VmTier::open(&host.state_dir, host.exe.clone()).map_err(|e| Error::Unavailable(e.to_string()))?;
    Ok(Arc::new(VmBackend { tier, store, envd_version: host.envd_version.clone(), upstream: Upstream::of(host) }))
}

/// The `vm` tier: images from the store, each sandbox a microVM with its own kernel.
pub struct VmBackend {
    tier: VmTier,
    store: cordon_image::Store,
    envd_version: Option<String>,
    upstream: Upstream,
}

fn vm_err(what: &'static str) -> impl Fn(VmError) -> Error {
    move |e| match e {
        VmError::BadRequest(m) => Error::BadRequest(m),
        VmError::Unsupported(m) => Error::Unavailable(m),
        e => Error::failed(what, e),
    }
}

struct VmSandbox {
    vm: crate::Vm,
    egress: Egress,
    start: Option<cordon_image::StartCommand>,
    /// It has volumes.
    volumes: bool,
    /// Holds the image against `cordon image rm` while the VM lives.
    _pin: cordon_image::Pin,
}

impl cordon_sandbox::Sandbox for VmSandbox {
    fn tier_facts(&self) -> cordon_sandbox::report::TierFacts {
        cordon_sandbox::report::TierFacts::opaque(
            self.vm.runtime(),
            "the guest's own kernel holds it, out of the host's sight: `cordon probe` reports it from inside",
        )
    }

    fn socket_path(&self) -> &Path {
        self.vm.socket_path()
    }

    /// The VMM's groups: the guest's memory and vCPUs plus the VMM's own share.
    fn cgroup_limits(&self) -> Option<cordon_sandbox::report::CgroupLimits> {
        Some(self.vm.cgroup().limits())
    }

    fn death_fd(&self) -> Option<OwnedFd> {
        self.vm.pidfd().and_then(|fd| fd.try_clone_to_owned().ok())
    }

    fn memory_current(&self) -> Option<u64> {
        self.vm.memory_current()
    }

    fn cpu_usage_usec(&self) -> Option<u64> {
        self.vm.cgroup().cpu_usage_usec()
    }

    fn kill(&self) {
        self.vm.kill()
    }

    fn oom_kills(&self) -> Option<u64> {
        self.vm.oom_kills()
    }

    fn peak_memory(&self) -> Option<u64> {
        self.vm.peak_memory()
    }

    fn blocked(&self) -> Vec<Blocked> {
        self.egress.blocked()
    }

    fn flow_counts(&self) -> Option<cordon_sandbox::FlowCounts> {
        self.egress.flow_counts()
    }

    fn injected(&self) -> Vec<cordon_sandbox::Injected> {
        self.egress.injected()
    }

    fn set_network(&self, policy: cordon_spec::NetworkPolicy) -> Result<(), Error> {
        self.egress.set_network(policy)
    }

    fn start_command(&self) -> Option<&cordon_image::StartCommand> {
        self.start.as_ref()
    }

    fn slowdown(&self) -> u32 {
        self.vm.accel().slowdown()
    }

    /// Not with volumes: QEMU cannot migrate a vhost-user-fs device (its daemon's state lives
    /// outside the VM).
    fn checkpointable(&self) -> bool {
        !self.volumes
    }

    fn checkpoint(&mut self, dir: &Path, keep_running: bool) -> Result<(), Error> {
        self.vm.save(dir, keep_running).map(drop).map_err(vm_err("save the VM"))
    }

    fn keep_disk(&mut self, dir: &Path) -> Result<(), Error> {
        self.vm.keep_disk(dir).map_err(vm_err("keep the VM's disk"))
    }

    fn leave_running(self: Box<Self>) {
        let VmSandbox { mut egress, vm, .. } = *self;
        // The forwarder lets go of its end of the network link; the holder keeps a copy.
        egress.stop();
        drop(egress);
        vm.leave_running();
    }

    fn destroy(&mut self) -> Result<(), Error> {
        // Nothing more is dialled for it, then the VM goes.
        self.egress.stop();
        self.vm.destroy().map_err(|e| Error::failed("teardown", e))
    }
}

impl Backend for VmBackend {
    fn capabilities(&self, _tier: Tier) -> Capabilities {
        CAPABILITIES
    }

    /// The guest kit (built and cached on first use), the accelerator verdict and the image's
    /// disk; `create` then finds them cached.
    fn prepare(
        &self,
        _spec: &SandboxSpec,
        image: &cordon_image::Image,
        progress: &mut dyn cordon_image::Progress,
    ) -> Result<Option<String>, Error> {
        let prep = self.tier.prepare(&image.name, &image.layers, progress).map_err(vm_err("prepare the VM"))?;
        Ok(Some(format!("guest kernel {}, {} ({})", prep.kit.kernel_version, prep.accel.accel.as_str(), prep.accel.reason)))
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn cordon_sandbox::Sandbox>, Error> {
        CAPABILITIES.check_network(Tier::Vm, &spec.network)?;
        CAPABILITIES.check_restore(Tier::Vm, spec)?;
        let pin = self.store.pin(&spec.image).map_err(|e| Error::UnknownTemplate(e.to_string()))?;
        let image = cordon_sandbox::image::ensure(&self.store, &spec.image, &mut cordon_sandbox::image::LogProgress(&spec.image))?;
        spec.validate()?;
        // Cached after the first VM of an image: the kit, the KVM/TCG verdict and the disk.
        let prep = self.tier.prepare(&image.name, &image.layers, &mut cordon_image::NoProgress).map_err(vm_err("prepare the VM"))?;
        // An interface only with a policy (or when the saved VM being restored had one).
        let wants_net = spec.network.is_enabled() || spec.restore.as_deref().is_some_and(crate::Saved::had_network);
        let network = wants_net
            .then(|| -> Result<_, Error> {
                let resumed = spec.restore.as_deref().and_then(|dir| crate::Saved::resumed_mac(dir, &spec.id));
                let mac = match resumed {
                    Some(mac) => mac,
                    None => guest_mac()?,
                };
                Ok(crate::link_handshake::GuestNetwork { mac, egress_ca: spec.trusted_egress_ca().map(str::to_string) })
            })
            .transpose()?;
        let cfg = crate::VmConfig {
            id: spec.id.clone(),
            limits: spec.limits.clone(),
            agent: cordon_sandbox::agent::config(spec, &image, self.envd_version.as_deref()),
            volumes: spec.volumes.clone(),
            network,
            keep: spec.keep,
        };
        let vm = match (&spec.restore, &spec.disk_from) {
            (Some(dir), _) => self.tier.restore(&cfg, &prep, dir).map_err(vm_err("restore the saved VM"))?,
            (None, Some(dir)) => self.tier.create_on(&cfg, &prep, dir).map_err(vm_err("start the VM on its kept disk"))?,
            (None, None) => self.tier.create(&cfg, &prep).map_err(vm_err("create the VM"))?,
        };
        self.serve(vm, spec, image.meta.start.clone(), pin)
    }

    fn kept(&self, _tier: Tier) -> Vec<String> {
        self.tier.kept()
    }

    fn adopt(&self, spec: &SandboxSpec) -> Result<Box<dyn cordon_sandbox::Sandbox>, Error> {
        let pin = self.store.pin(&spec.image).map_err(|e| Error::UnknownTemplate(e.to_string()))?;
        let image = self.store.get(&spec.image).map_err(|e| Error::UnknownTemplate(e.to_string()))?;
        let vm = self.tier.adopt(&spec.id).map_err(vm_err("adopt the VM"))?;
        self.serve(vm, spec, image.meta.start.clone(), pin)
    }

    fn exists(&self, _tier: Tier, id: &str) -> bool {
        self.tier.exists(id)
    }

    fn reap_kept(&self, _tier: Tier) -> usize {
        self.tier.reap_kept()
    }
}

impl VmBackend {
    /// The sandbox of a running `vm`, its forwarder serving `spec.network` on its network link.
    fn serve(&self, mut vm: crate::Vm, spec: &SandboxSpec, start: Option<cordon_image::StartCommand>, pin: cordon_image::Pin) -> Result<Box<dyn cordon_sandbox::Sandbox>, Error> {
        let gateways = vec![cordon_host::tun::GATEWAY_V4.into(), cordon_host::tun::GATEWAY_V6.into()];
        let link = vm.take_net_link().map(Link::Ethernet);
        let egress = Egress::start(link, &spec.network, gateways, cordon_host::tun::MTU, &self.upstream, vm.cgroup(), &spec.limits)?;
        Ok(Box::new(VmSandbox { vm, egress, start, volumes: !spec.volumes.is_empty(), _pin: pin }))
    }
}

/// A random MAC of its own for a VM: locally administered, unicast, never the gateway's.
fn guest_mac() -> Result<[u8; 6], Error> {
    loop {
        let mut mac = [0u8; 6];
        getrandom::fill(&mut mac).map_err(|e| Error::failed("make the VM's MAC", std::io::Error::other(e)))?;
        mac[0] = (mac[0] & 0xfc) | 0x02;
        if mac != cordon_sandbox::egress::GATEWAY_MAC {
            return Ok(mac);
        }
    }
}
