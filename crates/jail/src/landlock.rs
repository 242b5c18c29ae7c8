//! Landlock, applied best-effort with the newest ABI the kernel offers, as a second layer
//! under the mount namespace: file access only beneath the sandbox's own root (plus executing
//! the agent binary, which lives outside it), abstract Unix sockets and signals scoped to the
//! sandbox. The result is reported, never assumed.
//!
//! TCP (ABI 4 and later): Landlock's network rules name ports only, never addresses, so a rule
//! set that confines outbound connections also confines connections to the sandbox's own
//! loopback. It is therefore applied only when the egress policy itself is limited to ports
//! (every allow rule names a port): then `connect` is allowed to those ports and to 53 (DNS
//! over TCP to the gateway), and nothing else, loopback included. `bind` is never handled, so
//! servers inside keep working; UDP is outside Landlock's reach (the netns and the forwarder
//! cover it). Without a policy, or with one that allows any port, the netns and the forwarder
//! are the only network controls.

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, NetPort, Compatible, PathBeneath, PathFd, RestrictionStatus, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};
use std::io;
use std::os::fd::BorrowedFd;

/// What Landlock enforcement the sandbox got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Enforced {
    Full,
    Partial,
    None,
}

impl Enforced {
    const ALL: [Enforced; 3] = [Enforced::Full, Enforced::Partial, Enforced::None];

    /// The name the API and `--json` show (`full`, `partial`, `none`).
    pub fn as_str(self) -> &'static str {
        match self {
            Enforced::Full => "full",
            Enforced::Partial => "partial",
            Enforced::None => "none",
        }
    }

    /// The value of [`Enforced::as_str`], back; `None` for anything else.
    pub fn parse(s: &str) -> Option<Enforced> {
        Enforced::ALL.into_iter().find(|e| e.as_str() == s)
    }
}

/// The kernel's Landlock ABI version, `None` without Landlock.
pub fn kernel_abi() -> Option<i64> {
    // SAFETY: with a NULL attr, size 0 and LANDLOCK_CREATE_RULESET_VERSION this only reports
    // the ABI version (or an error when Landlock is absent).
    let v = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32) };
    (v > 0).then_some(v)
}

/// What [`apply`] asks of the kernel, in words, for the isolation report.
pub fn rules(connect_ports: Option<&[(u16, u16)]>) -> Vec<String> {
    let mut r = vec![
        "filesystem: every access handled; allowed only beneath the sandbox's own root".to_string(),
        "filesystem: execute and read of the agent binary, outside that root".to_string(),
        "scoped: abstract Unix sockets and signals stay within the sandbox".to_string(),
    ];
    r.push(match connect_ports {
        Some(ranges) => {
            let ports: Vec<String> = ranges.iter().map(|(lo, hi)| if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") }).collect();
            format!("tcp connect: only to ports {} and 53 (the policy names ports only)", ports.join(", "))
        }
        None => "tcp: not handled (the network namespace and the egress forwarder decide)".to_string(),
    });
    r
}

/// Restricts the calling process (and everything it will exec) to the current root. `agent`
/// is the agent binary, kept executable although it lies outside that root.
/// `connect_ports`: when set, the only TCP ports `connect` may reach (inclusive ranges).
pub fn apply(agent: BorrowedFd<'_>, connect_ports: Option<&[(u16, u16)]>) -> io::Result<Enforced> {
    let abi = ABI::V6;
    let err = |e: landlock::RulesetError| io::Error::other(format!("landlock: {e}"));
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))
        .map_err(err)?;
    if connect_ports.is_some() {
        ruleset = ruleset.handle_access(AccessNet::ConnectTcp).map_err(err)?;
    }
    let mut created = ruleset.scope(Scope::from_all(abi)).map_err(err)?.create().map_err(err)?;
    if let Some(ranges) = connect_ports {
        let dns = [(53u16, 53u16)];
        for &(lo, hi) in ranges.iter().chain(dns.iter()) {
            for port in lo..=hi {
                created = created.add_rule(NetPort::new(port, AccessNet::ConnectTcp)).map_err(err)?;
            }
        }
    }
    let status: RestrictionStatus = created
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
