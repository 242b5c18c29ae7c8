//! Addresses the forwarder never dials on a sandbox's behalf, whatever a name resolves to.
//!
//! Loopback, unspecified, multicast and the host's own interface addresses are refused under
//! every policy: they are the host itself. The other special ranges (private, shared/CGNAT,
//! link-local with the cloud metadata address, ULA, NAT64, reserved) are refused unless an
//! allow rule names a range inside them explicitly (`--allow-net 10.1.0.0/16`), so an allowed
//! name that resolves into them (DNS rebinding) gets nowhere.

use cordon_spec::{canonical, Cidr, NetworkPolicy};
use std::net::IpAddr;

fn cidr(s: &str) -> Cidr {
    let (a, p) = s.split_once('/').expect("static cidr");
    Cidr::new(a.parse().expect("static addr"), p.parse().expect("static prefix")).expect("static cidr")
}

/// Ranges opened only by an explicit rule, with the name used in audit reasons.
fn special() -> &'static [(Cidr, &'static str)] {
    static LIST: std::sync::OnceLock<Vec<(Cidr, &'static str)>> = std::sync::OnceLock::new();
    LIST.get_or_init(|| {
        [
            ("169.254.169.254/32", "cloud metadata address"),
            ("0.0.0.0/8", "'this network' range"),
            ("10.0.0.0/8", "private range"),
            ("100.64.0.0/10", "shared (CGNAT) range"),
            ("169.254.0.0/16", "link-local range"),
            ("172.16.0.0/12", "private range"),
            ("192.0.0.0/24", "IETF protocol range"),
            ("192.168.0.0/16", "private range"),
            ("198.18.0.0/15", "benchmarking range"),
            ("240.0.0.0/4", "reserved range"),
            ("fd00:ec2::254/128", "cloud metadata address"),
            ("fc00::/7", "unique local (ULA) range"),
            ("fe80::/10", "link-local range"),
            ("64:ff9b::/96", "NAT64 range"),
            ("64:ff9b:1::/48", "NAT64 range"),
            ("100::/64", "discard range"),
        ]
        .into_iter()
        .map(|(c, n)| (cidr(c), n))
        .collect()
    })
}

/// The host's own addresses, on every interface, read now (interfaces come and go).
pub fn host_addresses() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points at a sockaddr whose family says which struct it is.
            let fam = unsafe { (*ifa.ifa_addr).sa_family } as libc::c_int;
            if fam == libc::AF_INET {
                // SAFETY: AF_INET means a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.push(IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()));
            } else if fam == libc::AF_INET6 {
                // SAFETY: AF_INET6 means a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.push(IpAddr::from(sin6.sin6_addr.s6_addr));
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// Why `ip` must not be dialled under `policy`, or `None` when it may be.
pub fn refusal(ip: IpAddr, policy: &NetworkPolicy, host: &[IpAddr]) -> Option<String> {
    let ip = canonical(ip);
    if ip.is_loopback() {
        return Some(format!("{ip} is a loopback address"));
    }
    if ip.is_unspecified() {
        return Some(format!("{ip} is the unspecified address"));
    }
    if ip.is_multicast() || ip == IpAddr::from([255, 255, 255, 255]) {
        return Some(format!("{ip} is a multicast or broadcast address"));
    }
    if host.iter().any(|h| canonical(*h) == ip) {
        return Some(format!("{ip} is an address of the host"));
    }
    for (range, what) in special() {
        if range.contains(ip) && !policy.names_range_explicitly(ip, range) {
            return Some(format!("{ip} is in the {what} {range}, which no rule names explicitly"));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(ip: &str, allow: &[&str]) -> bool {
        let pol = NetworkPolicy::parse(allow, &[] as &[&str]).unwrap();
        refusal(ip.parse().unwrap(), &pol, &["192.0.2.7".parse().unwrap()]).is_some()
    }

    #[test]
    fn special_ranges_are_refused_by_default() {
        for ip in [
            "127.0.0.1", "127.9.9.9", "::1", "0.0.0.0", "::", "10.1.2.3", "172.16.0.1", "192.168.1.1",
            "100.64.0.1", "169.254.169.254", "169.254.1.1", "fd00::1", "fe80::1", "::ffff:127.0.0.1",
            "::ffff:10.0.0.1", "224.0.0.1", "ff02::1", "255.255.255.255", "192.0.2.7", "64:ff9b::a00:1",
        ] {
            assert!(refused(ip, &["0.0.0.0/0", "::/0", "*"]), "{ip} not refused");
        }
    }

    #[test]
    fn public_and_test_addresses_pass() {
        for ip in ["198.51.100.10", "203.0.113.5", "2001:db8::1", "8.8.8.8"] {
            assert!(!refused(ip, &[]), "{ip} refused");
        }
    }

    #[test]
    fn explicit_rules_open_special_ranges_but_never_the_host() {
        assert!(!refused("10.1.2.3", &["10.1.0.0/16"]));
        assert!(refused("10.2.0.1", &["10.1.0.0/16"]));
        assert!(!refused("169.254.169.254", &["169.254.169.254"]));
        assert!(refused("169.254.169.254", &["169.254.0.0/16"]), "the metadata /32 needs its own rule");
        assert!(refused("127.0.0.1", &["127.0.0.0/8"]));
        assert!(refused("192.0.2.7", &["192.0.2.0/24"]));
    }
}
