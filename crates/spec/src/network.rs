//! Egress policy: which destinations a sandbox may reach, as data.
//!
//! A rule names a domain (`pypi.org`), a wildcard (`*.pythonhosted.org`: subdomains only, not
//! the apex), any name (`*`), or an address range (`198.51.100.0/24`, `2001:db8::/32`, a bare
//! address meaning a single host), each with an optional port or port range (`:443`,
//! `:8000-8100`; IPv6 ranges take the port after brackets: `[2001:db8::/32]:443`).
//!
//! Deciding: among the allow and the deny rules that match, the most specific wins (an exact
//! name over a wildcard, a longer wildcard suffix over a shorter one, a longer prefix over a
//! shorter one); on a tie, deny wins. So `--allow-net '*.example.org' --deny-net
//! evil.example.org` keeps the one host out, and E2B's `denyOut: ["0.0.0.0/0"]` with
//! `allowOut: ["198.51.100.7"]` lets the one host in. Nothing matching means denied.
//!
//! Names and addresses are separate questions: a connection that names a host (TLS SNI, HTTP
//! Host) is allowed by a name rule, and then goes to the address the forwarder resolves for that
//! name; a connection without an allowed name is allowed only by an address rule. Which
//! addresses are never dialled (loopback, private ranges, the host's own) is the forwarder's
//! business, except that [`NetworkPolicy::names_range_explicitly`] tells it when a rule opens
//! one of those ranges on purpose.

use crate::SpecError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// What a rule matches, before its port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Target {
    /// Exactly this name (lower case, no trailing dot).
    Domain(String),
    /// Any strict subdomain of this name (the part after `*.`).
    Wildcard(String),
    /// Any name at all (`*`).
    AnyName,
    /// An address range.
    Cidr(Cidr),
}

/// An address and prefix length; the address has its host bits cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Cidr, String> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(format!("prefix /{prefix} is longer than {max}"));
        }
        Ok(Cidr { addr: mask(addr, prefix), prefix })
    }

    /// Whether `ip` lies in this range (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        match (self.addr, ip) {
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => mask(ip, self.prefix) == self.addr,
            _ => false,
        }
    }

    /// Whether all of `other` lies inside this range.
    pub fn covers(&self, other: &Cidr) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`) as the IPv4 address it is.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => ip,
        },
        v4 => v4,
    }
}

fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(a) => {
            let m = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix as u32) };
            IpAddr::V4(Ipv4Addr::from(u32::from(a) & m))
        }
        IpAddr::V6(a) => {
            let m = if prefix == 0 { 0 } else { u128::MAX << (128 - prefix as u32) };
            IpAddr::V6(Ipv6Addr::from(u128::from(a) & m))
        }
    }
}

/// One rule: a target and the ports it covers (inclusive; `None` means every port).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NetRule {
    pub target: Target,
    pub ports: Option<(u16, u16)>,
}

impl NetRule {
    fn port_ok(&self, port: u16) -> bool {
        self.ports.is_none_or(|(lo, hi)| (lo..=hi).contains(&port))
    }

    /// How specific a match by this rule is; larger is more specific.
    fn specificity(&self) -> (u32, u32) {
        let port = u32::from(self.ports.is_some());
        match &self.target {
            Target::Domain(d) => (1000 + d.len() as u32, port),
            Target::Wildcard(w) => (500 + w.len() as u32, port),
            Target::AnyName => (0, port),
            Target::Cidr(c) => (c.prefix as u32, port),
        }
    }

    fn matches_name(&self, name: &str, port: u16) -> bool {
        self.port_ok(port)
            && match &self.target {
                Target::Domain(d) => d == name,
                Target::Wildcard(w) => name.len() > w.len() + 1 && name.ends_with(w.as_str()) && name.as_bytes()[name.len() - w.len() - 1] == b'.',
                Target::AnyName => true,
                Target::Cidr(_) => false,
            }
    }

    fn matches_ip(&self, ip: IpAddr, port: u16) -> bool {
        self.port_ok(port) && matches!(&self.target, Target::Cidr(c) if c.contains(ip))
    }
}

impl fmt::Display for NetRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = match &self.target {
            Target::Domain(d) => d.clone(),
            Target::Wildcard(w) => format!("*.{w}"),
            Target::AnyName => "*".into(),
            Target::Cidr(c) if c.addr.is_ipv6() && self.ports.is_some() => format!("[{c}]"),
            Target::Cidr(c) => c.to_string(),
        };
        match self.ports {
            None => f.write_str(&host),
            Some((lo, hi)) if lo == hi => write!(f, "{host}:{lo}"),
            Some((lo, hi)) => write!(f, "{host}:{lo}-{hi}"),
        }
    }
}

impl FromStr for NetRule {
    type Err = SpecError;

    fn from_str(raw: &str) -> Result<NetRule, SpecError> {
        let bad = |why: String| SpecError::new("network rule", format!("'{raw}' {why}"));
        let s = raw.trim();
        if s.is_empty() {
            return Err(bad("is empty: give a domain, *.domain, an address or CIDR, each with an optional :port".into()));
        }
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let (inside, after) = rest.split_once(']').ok_or_else(|| bad("has '[' without ']'".into()))?;
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| bad("has text after ']' that is not :PORT".into()))?),
            };
            (inside, port)
        } else if s.matches(':').count() == 1 {
            let (h, p) = s.split_once(':').expect("one colon");
            (h, Some(p))
        } else {
            (s, None)
        };
        let ports = port.map(|p| parse_ports(p).map_err(bad)).transpose()?;
        let target = parse_target(host).map_err(bad)?;
        Ok(NetRule { target, ports })
    }
}

fn parse_ports(p: &str) -> Result<(u16, u16), String> {
    let one = |x: &str| match x.parse::<u16>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("has port '{x}': use a number from 1 to 65535")),
    };
    match p.split_once('-') {
        Some((a, b)) => {
            let (lo, hi) = (one(a)?, one(b)?);
            if lo > hi {
                return Err(format!("has port range {lo}-{hi} whose start is after its end"));
            }
            Ok((lo, hi))
        }
        None => {
            let n = one(p)?;
            Ok((n, n))
        }
    }
}

fn parse_target(h: &str) -> Result<Target, String> {
    if h == "*" {
        return Ok(Target::AnyName);
    }
    if let Some((a, p)) = h.split_once('/') {
        let addr: IpAddr = a.parse().map_err(|_| format!("has '{a}' before '/', which is not an IP address"))?;
        let prefix: u8 = p.parse().map_err(|_| format!("has prefix '/{p}', which is not a number"))?;
        return Cidr::new(canonical(addr), prefix).map(Target::Cidr);
    }
    if let Ok(addr) = h.parse::<IpAddr>() {
        let addr = canonical(addr);
        let full = if addr.is_ipv4() { 32 } else { 128 };
        return Ok(Target::Cidr(Cidr::new(addr, full).expect("full prefix")));
    }
    let (wild, name) = match h.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, h),
    };
    let name = normalize_name(name).ok_or_else(|| {
        "is not a domain, *.domain, IP address or CIDR (letters, digits, '-' and '_' in dot-separated labels)".to_string()
    })?;
    Ok(if wild { Target::Wildcard(name) } else { Target::Domain(name) })
}

/// A host name in the form rules compare: lower case, without a trailing dot; `None` when it
/// is not a well-formed name.
pub fn normalize_name(name: &str) -> Option<String> {
    let n = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    let ok = !n.is_empty()
        && n.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    ok.then_some(n)
}

/// The outcome of asking the policy about a destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed by this rule.
    Allow(NetRule),
    /// Denied by this explicit deny rule.
    Deny(NetRule),
    /// No rule mentions it: denied by default.
    NoRule,
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        matches!(self, Verdict::Allow(_))
    }
}

/// A sandbox's egress policy. Empty (the default) means no network at all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkPolicy {
    #[serde(default, with = "rules_as_strings")]
    pub allow: Vec<NetRule>,
    #[serde(default, with = "rules_as_strings")]
    pub deny: Vec<NetRule>,
    /// Names no rule mentions are resolved too, and a connection to one is judged by its
    /// address alone: E2B's "open unless restricted", where address rules are the policy and
    /// name rules only add to it. Off (cordon's own semantics): such names are NXDOMAIN.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resolve_unlisted: bool,
    /// Headers the forwarder sets on requests to the hosts these rules name (it terminates
    /// TLS for those hosts only); see [`crate::Transforms`].
    #[serde(default, skip_serializing_if = "crate::Transforms::is_empty")]
    pub transforms: crate::Transforms,
}

mod rules_as_strings {
    use super::NetRule;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(rules: &[NetRule], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(rules.iter().map(|r| r.to_string()))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<NetRule>, D::Error> {
        let raw = Vec::<String>::deserialize(d)?;
        raw.iter().map(|r| r.parse().map_err(serde::de::Error::custom)).collect()
    }
}

impl NetworkPolicy {
    /// Parses allow and deny rules as given on the command line or in an API request.
    pub fn parse<A: AsRef<str>, D: AsRef<str>>(allow: &[A], deny: &[D]) -> Result<NetworkPolicy, SpecError> {
        Ok(NetworkPolicy {
            allow: allow.iter().map(|r| r.as_ref().parse()).collect::<Result<_, _>>()?,
            deny: deny.iter().map(|r| r.as_ref().parse()).collect::<Result<_, _>>()?,
            resolve_unlisted: false,
            transforms: Default::default(),
        })
    }

    /// Whether the sandbox gets any network at all: only an allow rule opens anything.
    pub fn is_enabled(&self) -> bool {
        !self.allow.is_empty()
    }

    fn decide(&self, hit: impl Fn(&NetRule) -> bool) -> Verdict {
        let best = |rules: &[NetRule]| rules.iter().filter(|r| hit(r)).max_by_key(|r| r.specificity()).cloned();
        match (best(&self.allow), best(&self.deny)) {
            (Some(a), Some(d)) if a.specificity() > d.specificity() => Verdict::Allow(a),
            (_, Some(d)) => Verdict::Deny(d),
            (Some(a), None) => Verdict::Allow(a),
            (None, None) => Verdict::NoRule,
        }
    }

    /// Whether the forwarder answers DNS for `name` at all: an allowing rule, or no rule under
    /// [`NetworkPolicy::resolve_unlisted`] (the connection is then judged by address).
    pub fn answers_dns_for(&self, name: &str) -> Verdict {
        match self.name_resolvable(name) {
            Verdict::NoRule if self.resolve_unlisted => Verdict::Allow(NetRule { target: Target::AnyName, ports: None }),
            v => v,
        }
    }

    /// May a connection naming `name` on `port` go out (to the address the forwarder resolves)?
    pub fn check_name(&self, name: &str, port: u16) -> Verdict {
        match normalize_name(name) {
            Some(n) => self.decide(|r| r.matches_name(&n, port)),
            None => Verdict::NoRule,
        }
    }

    /// May the forwarder answer DNS for `name`: is it allowed on some port?
    pub fn name_resolvable(&self, name: &str) -> Verdict {
        let Some(n) = normalize_name(name) else { return Verdict::NoRule };
        let hit = |r: &NetRule| match &r.target {
            Target::Domain(d) => *d == n,
            Target::Wildcard(_) | Target::AnyName => r.matches_name(&n, r.ports.map_or(1, |p| p.0)),
            Target::Cidr(_) => false,
        };
        // A deny rule limited to some ports does not stop resolution: other ports may be open.
        let allow = self.allow.iter().filter(|r| hit(r)).max_by_key(|r| r.specificity()).cloned();
        let deny = self.deny.iter().filter(|r| r.ports.is_none() && hit(r)).max_by_key(|r| r.specificity()).cloned();
        match (allow, deny) {
            (Some(a), Some(d)) if a.specificity() > d.specificity() => Verdict::Allow(a),
            (_, Some(d)) => Verdict::Deny(d),
            (Some(a), None) => Verdict::Allow(a),
            (None, None) => Verdict::NoRule,
        }
    }

    /// May a connection to `ip:port` go out by address alone?
    pub fn check_ip(&self, ip: IpAddr, port: u16) -> Verdict {
        self.decide(|r| r.matches_ip(canonical(ip), port))
    }

    /// Whether an allow rule that matches `ip` lies entirely within `range`: how a policy opens
    /// a range the forwarder otherwise never dials (`--allow-net 10.1.0.0/16` opens 10.1.x.x;
    /// `0.0.0.0/0` does not open 10.x).
    pub fn names_range_explicitly(&self, ip: IpAddr, range: &Cidr) -> bool {
        self.allow.iter().any(|r| matches!(&r.target, Target::Cidr(c) if c.contains(ip) && range.covers(c)))
    }

    /// The TCP ports any allow rule can reach; `None` when some rule covers every port.
    pub fn allowed_ports(&self) -> Option<Vec<(u16, u16)>> {
        let mut out = Vec::new();
        for r in &self.allow {
            out.push(r.ports?);
        }
        out.sort_unstable();
        out.dedup();
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(allow: &[&str], deny: &[&str]) -> NetworkPolicy {
        NetworkPolicy::parse(allow, deny).unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn parses_every_form() {
        let cases = [
            ("pypi.org", Target::Domain("pypi.org".into()), None),
            ("PyPI.Org.", Target::Domain("pypi.org".into()), None),
            ("*.pythonhosted.org", Target::Wildcard("pythonhosted.org".into()), None),
            ("example.org:443", Target::Domain("example.org".into()), Some((443, 443))),
            ("example.org:8000-8100", Target::Domain("example.org".into()), Some((8000, 8100))),
            ("*", Target::AnyName, None),
            ("198.51.100.0/24", Target::Cidr(Cidr::new(ip("198.51.100.0"), 24).unwrap()), None),
            ("198.51.100.77/24", Target::Cidr(Cidr::new(ip("198.51.100.0"), 24).unwrap()), None),
            ("203.0.113.5:22", Target::Cidr(Cidr::new(ip("203.0.113.5"), 32).unwrap()), Some((22, 22))),
            ("2001:db8::/32", Target::Cidr(Cidr::new(ip("2001:db8::"), 32).unwrap()), None),
            ("[2001:db8::1]:443", Target::Cidr(Cidr::new(ip("2001:db8::1"), 128).unwrap()), Some((443, 443))),
            ("::ffff:10.0.0.1", Target::Cidr(Cidr::new(ip("10.0.0.1"), 32).unwrap()), None),
        ];
        for (raw, target, ports) in cases {
            let r: NetRule = raw.parse().unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert_eq!(r, NetRule { target, ports }, "{raw}");
            // Display gives back something that parses to the same rule.
            assert_eq!(r.to_string().parse::<NetRule>().unwrap(), r, "{raw}");
        }
    }

    #[test]
    fn rejects_bad_rules_with_a_reason() {
        for (raw, says) in [
            ("", "empty"),
            ("example.org:0", "1 to 65535"),
            ("example.org:99999", "1 to 65535"),
            ("example.org:http", "1 to 65535"),
            ("example.org:9-1", "start is after"),
            ("10.0.0.0/33", "longer than 32"),
            ("10.0.0.0/x", "not a number"),
            ("nope/8", "not an IP"),
            ("exa mple.org", "not a domain"),
            ("-x.org", "not a domain"),
            ("a..b", "not a domain"),
            ("*.*.org", "not a domain"),
            ("[2001:db8::1", "without ']'"),
            ("[2001:db8::1]443", "not :PORT"),
        ] {
            let e = raw.parse::<NetRule>().unwrap_err().to_string();
            assert!(e.contains(says), "{raw:?}: {e}");
        }
    }

    #[test]
    fn domains_match_case_insensitively_and_exactly() {
        let pol = p(&["Example.ORG"], &[]);
        assert!(pol.check_name("example.org", 80).allowed());
        assert!(pol.check_name("EXAMPLE.org.", 443).allowed());
        assert!(!pol.check_name("www.example.org", 443).allowed());
        assert!(!pol.check_name("notexample.org", 443).allowed());
        assert_eq!(pol.check_name("example.com", 443), Verdict::NoRule);
    }

    #[test]
    fn wildcard_matches_subdomains_not_apex() {
        let pol = p(&["*.pythonhosted.org"], &[]);
        assert!(pol.check_name("files.pythonhosted.org", 443).allowed());
        assert!(pol.check_name("a.b.pythonhosted.org", 443).allowed());
        assert!(!pol.check_name("pythonhosted.org", 443).allowed());
        assert!(!pol.check_name("evilpythonhosted.org", 443).allowed());
        assert!(pol.name_resolvable("FILES.pythonhosted.org").allowed());
        assert!(!pol.name_resolvable("pythonhosted.org").allowed());
    }

    #[test]
    fn ports_limit_rules() {
        let pol = p(&["example.org:443", "198.51.100.0/24:8000-8100"], &[]);
        assert!(pol.check_name("example.org", 443).allowed());
        assert!(!pol.check_name("example.org", 80).allowed());
        assert!(pol.name_resolvable("example.org").allowed());
        assert!(pol.check_ip(ip("198.51.100.9"), 8050).allowed());
        assert!(!pol.check_ip(ip("198.51.100.9"), 80).allowed());
        assert_eq!(pol.allowed_ports(), Some(vec![(443, 443), (8000, 8100)]));
        assert_eq!(p(&["example.org"], &[]).allowed_ports(), None);
    }

    #[test]
    fn cidrs_match_v4_v6_and_mapped() {
        let pol = p(&["198.51.100.0/24", "2001:db8::/32"], &[]);
        assert!(pol.check_ip(ip("198.51.100.255"), 1).allowed());
        assert!(pol.check_ip(ip("::ffff:198.51.100.1"), 1).allowed());
        assert!(!pol.check_ip(ip("198.51.101.1"), 1).allowed());
        assert!(pol.check_ip(ip("2001:db8:1::5"), 1).allowed());
        assert!(!pol.check_ip(ip("2001:db9::5"), 1).allowed());
        assert_eq!(pol.check_name("198.51.100.1", 80), Verdict::NoRule, "an address is not a name");
    }

    #[test]
    fn most_specific_wins_and_deny_wins_ties() {
        let pol = p(&["*.example.org"], &["evil.example.org"]);
        assert!(pol.check_name("good.example.org", 443).allowed());
        assert!(matches!(pol.check_name("evil.example.org", 443), Verdict::Deny(_)));
        assert!(matches!(pol.name_resolvable("evil.example.org"), Verdict::Deny(_)));
        // E2B's shape: deny everything, allow one host.
        let pol = p(&["198.51.100.7"], &["0.0.0.0/0"]);
        assert!(pol.check_ip(ip("198.51.100.7"), 80).allowed());
        assert!(matches!(pol.check_ip(ip("198.51.100.8"), 80), Verdict::Deny(_)));
        // Equal specificity: deny.
        let pol = p(&["example.org"], &["example.org"]);
        assert!(matches!(pol.check_name("example.org", 80), Verdict::Deny(_)));
        // A deny on one port leaves the others.
        let pol = p(&["example.org"], &["example.org:25"]);
        assert!(pol.check_name("example.org", 443).allowed());
        assert!(!pol.check_name("example.org", 25).allowed());
        assert!(pol.name_resolvable("example.org").allowed());
    }

    #[test]
    fn explicit_ranges() {
        let ten = Cidr::new(ip("10.0.0.0"), 8).unwrap();
        assert!(p(&["10.1.0.0/16"], &[]).names_range_explicitly(ip("10.1.2.3"), &ten));
        assert!(!p(&["0.0.0.0/0"], &[]).names_range_explicitly(ip("10.1.2.3"), &ten));
        assert!(!p(&["10.1.0.0/16"], &[]).names_range_explicitly(ip("10.2.0.1"), &ten));
    }

    #[test]
    fn empty_policy_is_no_network() {
        assert!(!NetworkPolicy::default().is_enabled());
        assert!(!p(&[], &["example.org"]).is_enabled());
        assert!(p(&["example.org"], &[]).is_enabled());
    }

    #[test]
    fn serialises_as_rule_strings() {
        let pol = p(&["*.a.org:443", "2001:db8::/32"], &["10.0.0.0/8"]);
        let j = serde_json::to_string(&pol).unwrap();
        assert_eq!(j, r#"{"allow":["*.a.org:443","2001:db8::/32"],"deny":["10.0.0.0/8"]}"#);
        assert_eq!(serde_json::from_str::<NetworkPolicy>(&j).unwrap(), pol);
        assert!(serde_json::from_str::<NetworkPolicy>(r#"{"allow":["a b"]}"#).is_err());
    }
}
