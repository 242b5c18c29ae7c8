//! Host primitives every tier shares, below the tiers and above the kernel:
//!
//! - [`cgroup`]: the host's cgroup layout (v1, v2 or the hybrid of both, detected at run time)
//!   and one sandbox's groups, limits and counters. Everything goes through paths under the
//!   layout's mount points, so a temporary directory tree stands in for `/sys/fs/cgroup` in
//!   tests (no trait needed: the cgroup interface is plain files).
//! - [`ledger`]: the on-disk record and lock of each live sandbox, and the reaping of those
//!   whose owner died.
//! - [`slots`]: distinct host uid ranges for concurrent sandboxes ([`UID_BASE`], [`UID_COUNT`]).
//! - [`tun`]: the sandbox's one network interface when it has an egress policy.
//! - [`sys`]: checked wrappers for pidfds, locks, the loopback interface, passing descriptors.

pub mod cgroup;
pub mod holder;
pub mod ledger;
pub mod orphans;
pub mod proc_facts;
pub mod slots;
pub mod sys;
pub mod trust;
pub mod tun;

pub use cgroup::{Cgroup, CgroupLimits, Layout, ThreadCharge};
pub use ledger::Ledger;
pub use slots::{Slot, Slots};

/// Host uids/gids of sandbox `n` start at `UID_BASE + n * UID_COUNT`: far above the ranges
/// distributions hand out in /etc/subuid, below 2^31 so no tool misreads them as negative.
pub const UID_BASE: u32 = 1_000_000_000;
pub const UID_COUNT: u32 = 65_536;
