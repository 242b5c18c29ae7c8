//! [`HostBacked`]: the [`Sandbox`] of a tier whose sandbox is a tree of host processes in host
//! cgroups, with the host's egress forwarder on its TUN device (the ns and gvisor tiers). The
//! tier gives its handle as a [`HostSandbox`]; stats come from the cgroups, the network from
//! the forwarder, the same way for both.

use std::os::fd::OwnedFd;
use std::path::Path;

use cordon_host::Cgroup;
use cordon_spec::NetworkPolicy;

use crate::egress::Egress;
use crate::{Blocked, Denial, Error, Sandbox};

/// What such a tier's live handle gives.
pub trait HostSandbox: Send {
    type Error: std::error::Error + Send + Sync + 'static;
    fn socket_path(&self) -> &Path;
    /// A new pidfd of the process whose exit is the sandbox's death.
    fn death_fd(&self) -> Option<OwnedFd>;
    /// The cgroups holding every process of the sandbox.
    fn cgroup(&self) -> &Cgroup;
    /// Bytes used and total of the writable layer, when it can be read.
    fn disk_usage(&self) -> Option<(u64, u64)>;
    fn kill(&self);
    fn destroy(&mut self) -> Result<(), Self::Error>;
    /// How much Landlock the kernel enforced, where the tier uses it.
    fn landlock(&self) -> Option<String> {
        None
    }
    /// The syscalls the host's filter denied, where the tier records them.
    fn denials(&self) -> Vec<Denial> {
        Vec::new()
    }
    /// The writable layer the host keeps, where the tier does (see [`Sandbox::writable_layer`]).
    fn writable_layer(&self) -> Option<crate::WritableLayer> {
        None
    }
    /// Rewrites its memory and CPU caps (see [`Sandbox::set_limits`]): the cgroups' by default;
    /// a tier whose own processes share the group adds their share first.
    fn set_limits(&self, limits: &cordon_spec::Limits) -> std::io::Result<()> {
        self.cgroup().set_limits(limits)
    }
    /// What the tier knows of the sandbox's confinement (see [`Sandbox::tier_facts`]).
    fn tier_facts(&self) -> crate::report::TierFacts {
        crate::report::TierFacts::opaque(Default::default(), "this tier does not report it")
    }
    /// Whether [`HostSandbox::checkpoint`] can save this sandbox.
    fn checkpointable(&self) -> bool {
        false
    }
    /// Saves it with its processes and memory (see [`Sandbox::checkpoint`]).
    fn checkpoint(&mut self, _dir: &Path, _keep_running: bool) -> Result<(), Error> {
        Err(Error::Unavailable("this tier cannot save a running sandbox to disk".into()))
    }
    /// Lets go of it without ending it (see [`Sandbox::leave_running`]); a drop by default.
    fn leave_running(self)
    where
        Self: Sized,
    {
    }
}

/// A tier's handle with its forwarder and its image's start command.
pub struct HostBacked<S> {
    /// Declared before `sandbox`, so it is dropped first on every path: the forwarder's
    /// thread leaves the sandbox's CPU group before the tier removes that group.
    pub egress: Egress,
    pub sandbox: S,
    pub start: Option<cordon_image::StartCommand>,
    /// The image's pin: `cordon image rm` refuses while the sandbox lives.
    pub pin: cordon_image::Pin,
}

impl<S: HostSandbox> Sandbox for HostBacked<S> {
    fn socket_path(&self) -> &Path {
        self.sandbox.socket_path()
    }

    fn death_fd(&self) -> Option<OwnedFd> {
        self.sandbox.death_fd()
    }

    fn memory_current(&self) -> Option<u64> {
        self.sandbox.cgroup().memory_current()
    }

    fn cpu_usage_usec(&self) -> Option<u64> {
        self.sandbox.cgroup().cpu_usage_usec()
    }

    fn disk_usage(&self) -> Option<(u64, u64)> {
        self.sandbox.disk_usage()
    }

    fn kill(&self) {
        self.sandbox.kill()
    }

    fn oom_kills(&self) -> Option<u64> {
        self.sandbox.cgroup().oom_kills()
    }

    fn peak_memory(&self) -> Option<u64> {
        self.sandbox.cgroup().peak_memory()
    }

    fn landlock(&self) -> Option<String> {
        self.sandbox.landlock()
    }

    fn denials(&self) -> Vec<Denial> {
        self.sandbox.denials()
    }

    fn blocked(&self) -> Vec<Blocked> {
        self.egress.blocked()
    }

    fn flow_counts(&self) -> Option<crate::FlowCounts> {
        self.egress.flow_counts()
    }

    fn injected(&self) -> Vec<crate::Injected> {
        self.egress.injected()
    }

    fn set_network(&self, policy: NetworkPolicy) -> Result<(), Error> {
        self.egress.set_network(policy)
    }

    fn start_command(&self) -> Option<&cordon_image::StartCommand> {
        self.start.as_ref()
    }

    fn writable_layer(&self) -> Option<crate::WritableLayer> {
        self.sandbox.writable_layer()
    }

    fn set_limits(&self, limits: &cordon_spec::Limits) -> Result<(), Error> {
        self.sandbox.set_limits(limits).map_err(|e| Error::failed("set the sandbox's limits", e))
    }

    fn tier_facts(&self) -> crate::report::TierFacts {
        self.sandbox.tier_facts()
    }

    fn cgroup_limits(&self) -> Option<crate::report::CgroupLimits> {
        Some(self.sandbox.cgroup().limits())
    }

    fn checkpointable(&self) -> bool {
        self.sandbox.checkpointable()
    }

    fn checkpoint(&mut self, dir: &Path, keep_running: bool) -> Result<(), Error> {
        self.sandbox.checkpoint(dir, keep_running)
    }

    fn freeze(&self, on: bool) -> Result<(), Error> {
        self.sandbox.cgroup().freeze(on).map_err(|e| Error::failed(if on { "freeze the sandbox" } else { "thaw the sandbox" }, e))
    }

    fn leave_running(self: Box<Self>) {
        let HostBacked { mut egress, sandbox, .. } = *self;
        // The forwarder lets go of the TUN descriptor; the device stays, for the adopter.
        egress.stop();
        drop(egress);
        sandbox.leave_running();
    }

    fn destroy(&mut self) -> Result<(), Error> {
        // The sandbox's processes go first, so nothing more is sent and its CPU quota is free
        // for the forwarder's thread (charged to the same group) to wind down at once; then the
        // forwarder, so nothing more is dialled; then the tier's own teardown.
        self.sandbox.kill();
        // A v1 freezer holds even killed tasks until thawed; the unified one lets SIGKILL in.
        if self.sandbox.cgroup().is_frozen() {
            let _ = self.sandbox.cgroup().freeze(false);
        }
        self.egress.stop();
        self.sandbox.destroy().map_err(|e| Error::failed("teardown", e))
    }
}
