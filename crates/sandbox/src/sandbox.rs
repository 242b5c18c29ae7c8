//! A live sandbox as the front ends see it: [`Sandbox`].

use std::os::fd::OwnedFd;
use std::path::Path;

use cordon_spec::NetworkPolicy;

use crate::{Blocked, Error};

/// One kind of syscall the host's filter denied.
#[derive(Debug, Clone, serde::Serialize, PartialEq, Eq)]
pub struct Denial {
    pub syscall: String,
    pub count: u64,
    /// Pids inside the sandbox that tried it (the first few).
    pub pids: Vec<u32>,
}

/// A sandbox's writable layer as the host sees it: an overlay upper directory, whose owners
/// are the sandbox's uids shifted by `uid_base` (sandbox uid N is host uid `uid_base + N`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritableLayer {
    pub upper: std::path::PathBuf,
    pub uid_base: u32,
}

/// A live sandbox. Only `socket_path`, `death_fd`, `memory_current` and `destroy` are required;
/// the rest have defaults for tiers that cannot tell (what a tier can tell is in its
/// [`crate::Capabilities`]). A figure the tier cannot read is `None`, never a 0 that would look
/// like a measurement.
pub trait Sandbox: Send {
    /// The agent's socket.
    fn socket_path(&self) -> &Path;
    /// A pidfd that becomes readable when the sandbox dies, if the tier has one.
    fn death_fd(&self) -> Option<OwnedFd>;
    /// Memory in use now, in bytes.
    fn memory_current(&self) -> Option<u64>;
    /// Whether its init has exited, as far as the tier can tell (false when it cannot).
    fn is_dead(&self) -> bool {
        self.death_fd().is_some_and(|fd| crate::lifecycle::is_dead(&fd))
    }
    /// CPU time used so far, in microseconds.
    fn cpu_usage_usec(&self) -> Option<u64> {
        None
    }
    /// Bytes used and total of the writable layer.
    fn disk_usage(&self) -> Option<(u64, u64)> {
        None
    }
    /// Kills every process of the sandbox now, without waiting; `destroy` still has to follow.
    fn kill(&self) {}
    /// How many times the memory cap killed a process.
    fn oom_kills(&self) -> Option<u64> {
        None
    }
    /// Highest memory use seen, in bytes.
    fn peak_memory(&self) -> Option<u64> {
        None
    }
    /// How much Landlock the kernel enforced (`full`, `partial`, `none`), where the tier uses it.
    fn landlock(&self) -> Option<String> {
        None
    }
    /// The syscalls the host's filter denied, when created with `audit` and the tier has one.
    fn denials(&self) -> Vec<Denial> {
        Vec::new()
    }
    /// The network attempts the egress policy blocked (destination, name, reason, count).
    fn blocked(&self) -> Vec<Blocked> {
        Vec::new()
    }
    /// Connections its egress forwarder let out and attempts it refused, where it has one.
    fn flow_counts(&self) -> Option<crate::FlowCounts> {
        None
    }
    /// Headers the forwarder injected into the sandbox's requests, per host and header name.
    fn injected(&self) -> Vec<crate::Injected> {
        Vec::new()
    }
    /// Replaces the egress policy of a running sandbox; it applies to new connections.
    fn set_network(&self, _policy: NetworkPolicy) -> Result<(), Error> {
        Err(Error::NoNetwork)
    }
    /// The service the sandbox's image starts in every sandbox.
    fn start_command(&self) -> Option<&cordon_image::StartCommand> {
        None
    }
    /// How many times slower than the host the sandbox runs code (an emulated CPU): waits on
    /// work inside it, like its start command's readiness, are stretched by this.
    fn slowdown(&self) -> u32 {
        1
    }
    /// Freezes (`true`) or thaws (`false`) every process of the sandbox where it is, waiting
    /// until the kernel has done it. Blocking. Tiers without [`crate::Capabilities::freeze`]
    /// refuse.
    fn freeze(&self, _on: bool) -> Result<(), Error> {
        Err(Error::Unavailable("this tier cannot pause a sandbox in place".into()))
    }
    /// The sandbox's own files as the host can read them, when it was created with
    /// `keep_writable` on a tier that keeps it (see [`crate::Capabilities::keep_writable`]).
    fn writable_layer(&self) -> Option<WritableLayer> {
        None
    }
    /// Saves the running sandbox, processes and memory, into `dir` (which it creates), for a
    /// create with `SandboxSpec::restore`. With `keep_running` it goes on afterwards (a fork's
    /// source); without, it is left stopped, to be destroyed (a pause). On an error nothing is
    /// left in `dir` and the sandbox runs on. Blocking. Tiers without
    /// [`crate::Capabilities::checkpoint`] refuse.
    fn checkpoint(&mut self, _dir: &Path, _keep_running: bool) -> Result<(), Error> {
        Err(Error::Unavailable("this tier cannot save a running sandbox to disk".into()))
    }
    /// Keeps the sandbox's writable disk whole in `dir` (which it creates), for a create with
    /// `SandboxSpec::disk_from`: its files, not its processes. The sandbox is left stopped, to
    /// be destroyed; on an error nothing is left in `dir` and it runs on. Blocking. Tiers
    /// without [`crate::Capabilities::keep_disk`] refuse.
    fn keep_disk(&mut self, _dir: &Path) -> Result<(), Error> {
        Err(Error::Unavailable("this tier cannot keep a sandbox's disk".into()))
    }
    /// Rewrites the memory and CPU caps of the running sandbox (a pooled sandbox given the caps
    /// of the create that took it). Tiers whose caps are fixed when it starts (a VM's memory)
    /// refuse.
    fn set_limits(&self, _limits: &cordon_spec::Limits) -> Result<(), Error> {
        Err(Error::Unavailable("this tier cannot change a running sandbox's limits".into()))
    }
    /// What the tier knows of the sandbox's confinement, for its isolation report (see
    /// [`crate::report`]); fields it cannot know are left `None` with a reason.
    fn tier_facts(&self) -> crate::report::TierFacts {
        crate::report::TierFacts::opaque(Default::default(), "this tier does not report it")
    }
    /// The limits its cgroups hold now, where the sandbox is a group of host processes.
    fn cgroup_limits(&self) -> Option<crate::report::CgroupLimits> {
        None
    }
    /// Whether [`Sandbox::checkpoint`] can save this sandbox (a tier with
    /// [`crate::Capabilities::checkpoint`] may still not save some of its sandboxes: gvisor
    /// with host networking); a pause with memory then freezes it in place where the tier can.
    fn checkpointable(&self) -> bool {
        false
    }
    /// Lets go of it without ending it, for the next process to adopt, when it was created
    /// with `keep` on a tier that can ([`crate::Capabilities::survive_restart`]); anything
    /// else is destroyed, as a drop would. Blocking.
    fn leave_running(self: Box<Self>) {}

    /// Kills it and removes every trace. Blocking.
    fn destroy(&mut self) -> Result<(), Error>;
}
