//! A tier: [`Backend`], what it can do ([`Capabilities`]), and what it needs of the host
//! ([`Host`]).

use std::path::PathBuf;

use cordon_spec::{NetworkPolicy, Tier};

use crate::{Error, Sandbox, SandboxSpec};

/// What a tier supports, asked by the front ends instead of comparing tier names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// Enforces a network allowlist (the egress forwarder); without it a policy is refused.
    pub egress: bool,
    /// The host's syscall filter records what it denies (`Sandbox::denials`).
    pub syscall_audit: bool,
    /// The OOM-kill count is the host's own and costs nothing to read; `false` when it is a
    /// round trip to the sandbox (a guest kernel's count), asked only when it can matter.
    pub host_oom_count: bool,
    /// A sandbox can be frozen in place ([`Sandbox::freeze`]): a pause that keeps every
    /// process, its memory resident and counted against the cap, and uses no CPU.
    pub freeze: bool,
    /// A sandbox created with `keep_writable` gives the host its writable layer while it
    /// runs ([`Sandbox::writable_layer`]): its files can become a layer (a snapshot, a fork, a
    /// filesystem-only pause).
    pub keep_writable: bool,
    /// A running sandbox can be saved to disk with its processes and memory
    /// ([`Sandbox::checkpoint`]) and started again from there (`SandboxSpec::restore`): a pause
    /// that frees its memory, a fork that copies its processes.
    pub checkpoint: bool,
    /// A checkpoint can leave the sandbox running ([`Sandbox::checkpoint`] with
    /// `keep_running`): a fork copies its processes without stopping it. Without it (gvisor,
    /// whose runsc ends a sandbox it checkpoints) the source is paused to disk for the fork and
    /// resumed from the same save.
    pub checkpoint_keeps_running: bool,
    /// A sandbox's writable disk can be kept whole ([`Sandbox::keep_disk`]) and a sandbox
    /// started afresh on it (`SandboxSpec::disk_from`): a files-only pause on a tier whose
    /// files the host must not read itself (a VM's disk image, written by its guest kernel).
    pub keep_disk: bool,
    /// Binds volumes (`SandboxSpec::volumes`) into a sandbox.
    pub volumes: bool,
    /// A running sandbox's memory and CPU caps can be rewritten ([`Sandbox::set_limits`]).
    pub set_limits: bool,
    /// A sandbox created with `keep` outlives the process that made it, which lets go of it
    /// with [`Sandbox::leave_running`], and the next one takes it back ([`Backend::adopt`]).
    pub survive_restart: bool,
}

impl Capabilities {
    /// Refuses a network policy this tier cannot enforce rather than run with less than asked.
    pub fn check_network(&self, tier: Tier, network: &NetworkPolicy) -> Result<(), Error> {
        if network.is_enabled() && !self.egress {
            return Err(Error::BadRequest(format!(
                "the {tier} tier cannot enforce network rules and runs with no network: drop the rules or use a tier with egress"
            )));
        }
        Ok(())
    }

    /// Refuses to start from a saved sandbox on a tier that cannot save one, rather than start
    /// a fresh sandbox that looks like the saved one.
    pub fn check_restore(&self, tier: Tier, spec: &SandboxSpec) -> Result<(), Error> {
        if spec.restore.is_some() && !self.checkpoint {
            return Err(Error::Unavailable(format!("the {tier} tier cannot start a sandbox from a saved one's memory")));
        }
        if spec.disk_from.is_some() && !self.keep_disk {
            return Err(Error::Unavailable(format!("the {tier} tier cannot start a sandbox on a kept disk")));
        }
        Ok(())
    }
}

/// Everything a tier may need to open: the state directory, the binary, the agent's version and
/// the egress forwarder's resolver.
#[derive(Debug, Clone)]
pub struct Host {
    /// cordon's state directory (`/var/lib/cordon`).
    pub state_dir: PathBuf,
    /// The cordon binary, re-run as jailer or used as the sandbox's agent.
    pub exe: PathBuf,
    /// The envd version the agent reports (`None`: the agent's own default).
    pub envd_version: Option<String>,
    /// Where the egress forwarder resolves allowed names (`None`: the host's resolv.conf).
    pub dns_upstream: Option<std::net::SocketAddr>,
    /// TLS termination for the hosts of header injection rules (the egress CA, the upstream
    /// trust, the secrets); `None`: sandboxes with such rules are refused.
    pub intercept: Option<std::sync::Arc<cordon_net::Interception>>,
}

/// A tier that makes sandboxes. `create` blocks; async front ends call it on a blocking thread.
pub trait Backend: Send + Sync {
    /// What sandboxes of `tier` support here. A single-tier backend answers for its own tier.
    fn capabilities(&self, tier: Tier) -> Capabilities;

    /// Makes whatever the first sandbox of `image` would otherwise make on its own (a VM's
    /// guest kit and disk), reporting progress; returns a one-line summary when something was
    /// prepared. Tiers with nothing to prepare do nothing.
    fn prepare(
        &self,
        _spec: &SandboxSpec,
        _image: &cordon_image::Image,
        _progress: &mut dyn cordon_image::Progress,
    ) -> Result<Option<String>, Error> {
        Ok(None)
    }

    /// Creates a sandbox from `spec`, or says why not; never a half-made one.
    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>, Error>;

    /// The ids of the sandboxes of `tier` that a process gone before kept running for the
    /// next one (see [`Capabilities::survive_restart`]).
    fn kept(&self, _tier: Tier) -> Vec<String> {
        Vec::new()
    }

    /// Takes back the kept sandbox `spec.id` as it runs, its egress serving `spec.network`
    /// (the policy in force when its last owner let go), its image `spec.image` pinned. On an
    /// error it is left as it was, for [`Backend::reap_kept`].
    fn adopt(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>, Error> {
        Err(Error::Unavailable(format!("the {} tier cannot take back a running sandbox", spec.tier)))
    }

    /// Whether sandbox `id` of `tier` is still on this host, owned by any process or by none.
    fn exists(&self, _tier: Tier, _id: &str) -> bool {
        false
    }

    /// Ends the kept sandboxes of `tier` that were not adopted. Returns how many.
    fn reap_kept(&self, _tier: Tier) -> usize {
        0
    }
}
