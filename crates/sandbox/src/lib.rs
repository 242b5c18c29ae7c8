//! One sandbox abstraction that every tier implements and every front end (`cordon run`,
//! `cordon serve`, `cordon mcp`) uses.
//!
//! - [`Backend`] is a tier: what it supports ([`Capabilities`]), an optional preparation with
//!   progress (a VM's kit and disk), and `create`, which makes a [`Sandbox`] from one
//!   [`SandboxSpec`] (`cordon-spec`'s, which every front end fills in and validates).
//! - [`Sandbox`] is a live sandbox: its agent's socket, its death, its stats, kill, the egress
//!   policy, destroy.
//! - [`Tiers`] dispatches on the spec's tier over a table the binary gives it (one row per
//!   tier crate, [`TierEntry`]), opening each tier on first use.
//! - [`diagnosis`] is what a tier says of this host for `cordon doctor`: its own checks and
//!   whether it can run here.
//! - [`host_sandbox`] is the `Sandbox` of the tiers whose sandboxes are host processes in host
//!   cgroups behind the egress forwarder (ns, gvisor): stats, network and teardown, once.
//! - [`lifecycle`] holds what long-running front ends share: the agent's readiness timeout and
//!   the watch on a sandbox's death.
//! - [`report`] is the isolation report: a tier's facts of a sandbox, what every sandbox has,
//!   and the comparison with what `cordon probe` sees inside.
//! - [`image`] is the one "ensure the image" step: a built-in recipe not built yet is built on
//!   first use, anything else unknown is refused with the list of known templates.
//!
//! The tier crates (`cordon-jail`, `cordon-gvisor`, `cordon-vm`) depend on this crate and
//! implement [`Backend`] themselves; nothing here knows a tier's internals.

pub mod agent;
mod backend;
pub mod diagnosis;
pub mod egress;
mod error;
pub mod host_sandbox;
pub mod image;
pub mod lifecycle;
pub mod report;
mod sandbox;
pub mod served;
pub mod trace;
mod tiers;

pub use backend::{Backend, Capabilities, Host};
pub use cordon_net::{Blocked, EgressCa, FlowCounts, Injected, Interception, SecretSource};
pub use diagnosis::{Diagnosis, Finding};
pub use error::Error;
pub use sandbox::{Denial, Sandbox, WritableLayer};
pub use cordon_spec::SandboxSpec;
pub use tiers::{TierEntry, Tiers};

use std::time::Duration;

/// The longest timeout the API grants a sandbox, in seconds (24 hours, as E2B's Pro tier).
pub const MAX_TIMEOUT_SECS: u64 = 24 * 3600;

/// How long a sandbox of a long-running front end may live at most, as far as its backend
/// knows: the front end ends it earlier by its own TTL; this is only a backstop beyond the
/// longest TTL the API grants.
pub const SERVER_BACKSTOP: Duration = Duration::from_secs(MAX_TIMEOUT_SECS + 3600);

/// A random sandbox id in E2B's shape: `i` followed by 20 of `[a-z0-9]`.
pub fn new_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut raw = [0u8; 20];
    getrandom::fill(&mut raw).expect("the kernel's random source is available");
    let mut id = String::with_capacity(21);
    id.push('i');
    id.extend(raw.iter().map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char));
    id
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_have_e2b_shape() {
        let id = super::new_id();
        assert_eq!(id.len(), 21);
        assert!(id.starts_with('i'));
        assert!(id[1..].bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()));
        assert_ne!(super::new_id(), id);
    }
}
