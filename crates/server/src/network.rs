//! What E2B's network fields (`allowOut`, `denyOut`, `allow_internet_access`) mean under the
//! server's network default (`cordon serve --network-default`).
//!
//! - **closed** (cordon's default): only an allow rule opens anything; no rules, or deny rules
//!   alone, mean no network at all.
//! - **open** (E2B's semantics): no rules mean the internet; `denyOut` alone is a blocklist;
//!   `allowOut` entries win over `denyOut` (so `denyOut: ["0.0.0.0/0"]` with a few `allowOut`
//!   entries is an allowlist, E2B's idiom); names no rule mentions resolve, and connections to
//!   them are judged by address. Never the host, loopback, private ranges or the metadata
//!   address, whatever the rules (the forwarder's guard). `0.0.0.0/0` in `denyOut` is E2B's
//!   "all traffic" and closes IPv6 as well.
//!
//! Either way `allow_internet_access: false` closes everything.

use cordon_spec::{NetRule, NetworkPolicy, SpecError};

/// The server's network default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NetworkDefault {
    #[default]
    Closed,
    Open,
}

impl NetworkDefault {
    /// The policy for a create's or an update's rules under this default.
    pub fn policy(self, allow_out: &[String], deny_out: &[String], internet: Option<bool>) -> Result<NetworkPolicy, SpecError> {
        if internet == Some(false) {
            return Ok(NetworkPolicy::default());
        }
        let mut p = NetworkPolicy::parse(allow_out, deny_out)?;
        if self == NetworkDefault::Open {
            let all = |s: &str| -> NetRule { s.parse().expect("a literal rule") };
            let (v4, v6) = (all("0.0.0.0/0"), all("::/0"));
            let denies = |p: &NetworkPolicy, r: &NetRule| p.deny.iter().any(|d| d.ports.is_none() && d.target == r.target);
            if denies(&p, &v4) && !denies(&p, &v6) {
                p.deny.push(v6.clone());
            }
            // An allowOut entry wins over a denyOut entry as specific as it (cordon's tie goes
            // to deny; E2B's precedence goes to allowOut).
            let given = &p.allow;
            p.deny.retain(|d| !given.iter().any(|a| a.target == d.target && a.ports == d.ports));
            // The open default, below every rule the caller gave: a caller's allow is at least
            // as specific, and the most specific rule decides.
            p.allow.extend([v4, v6]);
            p.resolve_unlisted = true;
        }
        Ok(p)
    }

    /// Whether a create that names no rules still gets a network.
    pub fn is_open(self) -> bool {
        self == NetworkDefault::Open
    }
}

impl std::fmt::Display for NetworkDefault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NetworkDefault::Closed => "closed",
            NetworkDefault::Open => "open",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cordon_spec::Verdict;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn closed_opens_only_what_is_allowed() {
        let p = NetworkDefault::Closed.policy(&[], &s(&["198.51.100.0/24"]), None).unwrap();
        assert!(!p.is_enabled());
        let p = NetworkDefault::Closed.policy(&s(&["example.org"]), &[], None).unwrap();
        assert!(p.is_enabled() && !p.resolve_unlisted);
    }

    #[test]
    fn open_is_the_internet_with_deny_as_a_blocklist_and_allow_winning() {
        let ip = |p: &NetworkPolicy, a: &str| p.check_ip(a.parse().unwrap(), 443).allowed();
        let open = NetworkDefault::Open.policy(&[], &[], None).unwrap();
        assert!(open.is_enabled() && open.resolve_unlisted && open.deny.is_empty());
        assert!(ip(&open, "203.0.113.7") && ip(&open, "2001:db8::1"));
        assert!(open.answers_dns_for("anything.example").allowed());
        let block = NetworkDefault::Open.policy(&[], &s(&["203.0.113.0/24"]), None).unwrap();
        assert!(!ip(&block, "203.0.113.7") && ip(&block, "198.51.100.7"));
        // E2B's allowlist idiom: deny all traffic, allow a few; all traffic covers IPv6 too.
        let list = NetworkDefault::Open.policy(&s(&["203.0.113.7", "example.org"]), &s(&["0.0.0.0/0"]), None).unwrap();
        assert!(ip(&list, "203.0.113.7") && !ip(&list, "198.51.100.7") && !ip(&list, "2001:db8::1"));
        assert!(list.check_name("example.org", 443).allowed());
        // An allowOut entry equal to a denyOut entry wins.
        let tie = NetworkDefault::Open.policy(&s(&["203.0.113.0/24"]), &s(&["203.0.113.0/24"]), None).unwrap();
        assert!(ip(&tie, "203.0.113.7"));
        assert!(matches!(NetworkDefault::Open.policy(&s(&["203.0.113.7"]), &[], Some(false)).unwrap().check_ip("203.0.113.7".parse().unwrap(), 1), Verdict::NoRule));
    }
}
