//! Landlock, applied best-effort with the newest ABI the kernel offers, as a second layer
//! under the mount namespace: file access only beneath the sandbox's own root (plus executing
//! the agent binary, which lives outside it), abstract Unix sockets and signals scoped to the
//! sandbox. The result is reported, never assumed.

use landlock::{
    Access, AccessFs, CompatLevel, Compatible, PathBeneath, PathFd, RestrictionStatus, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};
use std::io;
use std::os::fd::BorrowedFd;

/// What Landlock enforcement the sandbox got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforced {
    Full,
    Partial,
    None,
}

/// Restricts the calling process (and everything it will exec) to the current root. `agent`
/// is the agent binary, kept executable although it lies outside that root.
pub fn apply(agent: BorrowedFd<'_>) -> io::Result<Enforced> {
    let abi = ABI::V6;
    let err = |e: landlock::RulesetError| io::Error::other(format!("landlock: {e}"));
    let status: RestrictionStatus = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))
        .map_err(err)?
        .scope(Scope::from_all(abi))
        .map_err(err)?
        .create()
        .map_err(err)?
        .add_rule(PathBeneath::new(PathFd::new("/").map_err(|e| io::Error::other(format!("landlock: {e}")))?, AccessFs::from_all(abi)))
        .map_err(err)?
        .add_rule(PathBeneath::new(agent, AccessFs::Execute | AccessFs::ReadFile))
        .map_err(err)?
        // Root of the user namespace may restrict itself without no_new_privs; setting it
        // would break sudo inside the sandbox.
        .no_new_privs(false)
        .restrict_self()
        .map_err(err)?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => Enforced::Full,
        RulesetStatus::PartiallyEnforced => Enforced::Partial,
        RulesetStatus::NotEnforced => Enforced::None,
    })
}
