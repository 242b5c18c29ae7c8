//! Egress: real sandboxes (`cordon run`) against a test internet the test builds in a network
//! namespace (testnet.rs: HTTP, HTTPS, DNS, a UDP sink and a capture on TEST-NET addresses).
//! Each case attacks or uses the network from inside and checks what arrived on the other side
//! (the servers' log) as well as what the sandbox saw and what the audit recorded.

mod common;
#[path = "egress/testnet.rs"]
mod testnet;

use common::*;
use serde_json::Value;
use std::time::Duration;
use testnet::*;

// The cases that hold on every tier (the same forwarder behind a different kernel: in a
// microVM its frames reach it from a virtio-net device over a socket pair); the rest are the ns
// tier's own (Landlock's TCP rules) or need two sandboxes.
every_tier!(
    no_policy_means_no_interface_and_not_one_packet_out,
    allowed_domain_over_http_with_curl,
    allowed_domain_over_https_with_curl,
    allowed_domain_with_python_urllib_http_and_https,
    unlisted_domain_fails_and_is_audited,
    query_straight_to_another_resolver_fails,
    raw_ip_connect_to_an_unlisted_address_fails,
    udp_and_icmp_fail_even_with_everything_allowed,
    denied_connections_fail_at_once_with_a_reset_or_an_unreachable,
    allowed_names_resolving_to_loopback_private_or_metadata_are_refused,
    sni_naming_an_allowed_host_while_dialling_another_ip_reaches_only_the_allowed_host,
    services_on_the_hosts_loopback_are_unreachable_with_any_policy,
    services_on_the_hosts_own_addresses_are_unreachable_with_any_policy,
    ipv6_goes_through_the_same_forwarder,
);

// Root owns its kernel's network configuration only in a microVM.
mod root {
    use super::*;
    crate::on_vm!(guest_root_rewiring_its_network_reaches_nothing_more);
}

// The policy's matching and the real clients (pip, git) on ns and in a microVM. gvisor runs the
// ns tier's policy code behind the same forwarder, which the cases above already cover.
mod policy {
    use super::*;
    crate::ns_and_vm!(
        dns_for_unlisted_names_is_nxdomain_over_udp_and_tcp,
        wildcard_matches_subdomains_not_the_apex,
        names_match_case_insensitively,
        cidr_rules_allow_addresses_and_nothing_else,
        port_rules_limit_a_name_to_its_ports,
        the_forwarder_enforces_ports_where_landlock_does_not,
        deny_rules_cut_holes_in_allow_rules,
        pip_installs_from_an_allowed_index_with_files_on_a_wildcard_host,
        pip_fails_when_the_index_is_allowed_but_its_file_host_is_not,
        git_clones_over_https_from_an_allowed_host_and_not_otherwise,
    );
}

/// `cordon run` with the test internet's DNS as upstream, the given rules, and a bash script.
fn net(allow: &[&str], deny: &[&str], script: &str) -> Run {
    net_on(Tier::Ns, allow, deny, script)
}

/// [`net`] on a given tier.
fn net_on(tier: Tier, allow: &[&str], deny: &[&str], script: &str) -> Run {
    internet();
    let _shared = QUIET.read().unwrap_or_else(|e| e.into_inner());
    let mut flags = vec!["--tier", tier.as_str(), "--dns-upstream", DNS, "--timeout", "60s"];
    for a in allow {
        flags.extend(["--allow-net", a]);
    }
    for d in deny {
        flags.extend(["--deny-net", d]);
    }
    sh(&flags, script)
}

fn blocked(r: &Run) -> Vec<Value> {
    r.record["blocked_connections"].as_array().cloned().unwrap_or_default()
}

/// Whether the audit holds a blocked attempt of `proto` whose destination, name and reason
/// contain the given parts.
fn has_block(r: &Run, proto: &str, dest: &str, reason: &str) -> bool {
    blocked(r).iter().any(|b| {
        b["proto"] == proto
            && b["destination"].as_str().unwrap_or("").contains(dest)
            && b["reason"].as_str().unwrap_or("").contains(reason)
    })
}

/// IPv4 unless a test says otherwise: the test names have IPv6 addresses too.
const CURL: &str = "curl -4 -sS --max-time 8";
const CURL6: &str = "curl -6 -sS --max-time 8";

// A DNS query for NAME, type A, sent by python straight to SERVER; prints the rcode or "timeout".
const PY_DNS: &str = r#"
import socket, struct, sys
name, server, proto = sys.argv[1], sys.argv[2], sys.argv[3]
q = struct.pack('!HHHHHH', 0x1234, 0x0100, 1, 0, 0, 0)
q += b''.join(bytes([len(l)]) + l.encode() for l in name.split('.')) + b'\0' + struct.pack('!HH', 1, 1)
try:
    if proto == 'udp':
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
        s.sendto(q, (server, 53)); a = s.recv(4096)
    else:
        s = socket.create_connection((server, 53), timeout=3)
        s.sendall(struct.pack('!H', len(q)) + q); n = struct.unpack('!H', s.recv(2))[0]; a = s.recv(n)
    print('rcode', a[3] & 15, 'answers', struct.unpack('!H', a[6:8])[0])
except Exception as e:
    print('failed', type(e).__name__)
"#;

fn py_dns(name: &str, server: &str, proto: &str) -> String {
    format!("python3 -c \"$(cat <<'EOF'\n{PY_DNS}\nEOF\n)\" {name} {server} {proto}")
}

fn no_policy_means_no_interface_and_not_one_packet_out(tier: Tier) {
    let inet = internet();
    let _alone = QUIET.write().unwrap_or_else(|e| e.into_inner());
    std::thread::sleep(Duration::from_millis(300));
    // The capture is on for the whole window the counter covers, so every frame counted is
    // also in the log, where its kind shows.
    let mark = inet.mark();
    inet.capture(true);
    std::thread::sleep(Duration::from_millis(100));
    let before = inet.packets_in();
    let r = sh(
        &tier.flags(&["--dns-upstream", DNS]),
        &format!(
            "grep -c : /proc/net/dev; grep -v Iface /proc/net/route | wc -l; cat /etc/resolv.conf 2>/dev/null | grep -c 10.0.2.1;\
             {CURL} http://{WEB_V4}/ ; echo curl=$?; {CURL} http://allowed.test/; echo name=$?;\
             python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b'x', ('{WEB_V4}', 9999))\"; echo udp=$?"
        ),
    );
    std::thread::sleep(Duration::from_millis(500));
    let after = inet.packets_in();
    std::thread::sleep(Duration::from_millis(100));
    inet.capture(false);
    let seen = inet.since(&mark);
    assert_eq!(r.code, 0, "{r:?}");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines[0], "1", "only loopback should exist: {r:?}");
    assert_eq!(lines[1], "0", "no route should exist: {r:?}");
    assert_eq!(lines[2], "0", "no gateway resolver without a policy: {r:?}");
    assert!(r.stdout.contains("curl=7"), "raw connect must fail at once (unreachable): {r:?}");
    assert!(r.stdout.contains("name=6"), "no name resolves: {r:?}");
    assert!(r.stdout.contains("udp=1"), "UDP send must fail (network unreachable): {r:?}");
    assert!(!seen.contains("pkt "), "a packet reached the test internet: {seen}");
    // Whatever the host did send in the window was its own link upkeep (an ARP probe of an
    // earlier test's neighbour, say), all of it captured above.
    let link = seen.lines().filter(|l| l.starts_with("link ")).count() as u64;
    assert!(after - before <= link, "the host sent {} frames into the test internet, {link} of them link upkeep: {seen}", after - before);
    assert!(blocked(&r).is_empty());
    assert_clean(r.id());
}

fn allowed_domain_over_http_with_curl(tier: Tier) {
    let r = net_on(tier, &["allowed.test"], &[], &format!("env | grep -ci proxy; {CURL} http://allowed.test/"));
    assert!(r.stdout.starts_with("0\n"), "no proxy variables: {r:?}");
    assert!(r.stdout.contains(&format!("reached {WEB_V4} via http host=allowed.test")), "{r:?}");
    assert_clean(r.id());
}

fn allowed_domain_over_https_with_curl(tier: Tier) {
    let r = net_on(tier, &["allowed.test"], &[], &format!("{CURL} -k https://allowed.test/"));
    assert!(r.stdout.contains(&format!("reached {WEB_V4} via https host=allowed.test")), "{r:?}");
}

fn allowed_domain_with_python_urllib_http_and_https(tier: Tier) {
    let r = net_on(
        tier,
        &["allowed.test"],
        &[],
        "python3 -c \"import ssl, urllib.request as u; c=ssl._create_unverified_context();\
         print(u.urlopen('http://allowed.test/', timeout=8).read().decode().strip());\
         print(u.urlopen('https://allowed.test/', timeout=8, context=c).read().decode().strip())\"",
    );
    assert!(r.stdout.contains("via http host=allowed.test"), "{r:?}");
    assert!(r.stdout.contains("via https host=allowed.test"), "{r:?}");
}

fn unlisted_domain_fails_and_is_audited(tier: Tier) {
    let _pip = PIP_ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let inet = internet();
    let mark = inet.mark();
    let r = net_on(tier, &["allowed.test"], &[], &format!("{CURL} http://other.test/; echo rc=$?"));
    assert!(r.stdout.contains("rc=6"), "other.test must not resolve: {r:?}");
    assert!(has_block(&r, "dns", "10.0.2.1:53", "no rule allows"), "{:?}", blocked(&r));
    assert!(blocked(&r).iter().any(|b| b["name"] == "other.test"), "{:?}", blocked(&r));
    let seen = inet.since(&mark);
    assert!(!seen.contains("dns other.test"), "the unlisted name was asked upstream: {seen}");
    assert!(!seen.contains(OTHER_V4), "{seen}");
}

fn dns_for_unlisted_names_is_nxdomain_over_udp_and_tcp(tier: Tier) {
    let r = net_on(tier, 
        &["allowed.test"],
        &[],
        &format!(
            "{}; {}; {}",
            py_dns("other.test", "10.0.2.1", "udp"),
            py_dns("other.test", "10.0.2.1", "tcp"),
            py_dns("allowed.test", "10.0.2.1", "tcp")
        ),
    );
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines, ["rcode 3 answers 0", "rcode 3 answers 0", "rcode 0 answers 1"], "{r:?}");
}

fn query_straight_to_another_resolver_fails(tier: Tier) {
    let inet = internet();
    let mark = inet.mark();
    let r = net_on(tier, &["allowed.test"], &[], &format!("{}; {}", py_dns("exfil.test", WEB_V4, "udp"), py_dns("exfil2.test", WEB_V4, "tcp")));
    assert_eq!(r.stdout.lines().count(), 2, "{r:?}");
    assert!(r.stdout.lines().all(|l| l.starts_with("failed")), "a direct query got an answer: {r:?}");
    assert!(has_block(&r, "udp", &format!("{WEB_V4}:53"), "UDP goes only"), "{:?}", blocked(&r));
    assert!(has_block(&r, "tcp", &format!("{WEB_V4}:53"), "no rule allows"), "{:?}", blocked(&r));
    let seen = inet.since(&mark);
    assert!(!seen.contains("exfil"), "the query reached the resolver: {seen}");
}

fn wildcard_matches_subdomains_not_the_apex(tier: Tier) {
    let r = net_on(tier, &["*.wild.test"], &[], &format!("{CURL} http://a.wild.test/; echo; {CURL} http://wild.test/; echo rc=$?"));
    assert!(r.stdout.contains("host=a.wild.test"), "{r:?}");
    assert!(r.stdout.contains("rc=6"), "the apex must not resolve: {r:?}");
}

fn names_match_case_insensitively(tier: Tier) {
    let r = net_on(tier, &["ALLOWED.Test"], &[], &format!("{CURL} http://Allowed.TEST/"));
    assert!(r.stdout.contains(&format!("reached {WEB_V4}")), "{r:?}");
}

fn raw_ip_connect_to_an_unlisted_address_fails(tier: Tier) {
    let _pip = PIP_ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let inet = internet();
    let mark = inet.mark();
    let r = net_on(tier, &["allowed.test"], &[], &format!("{CURL} http://{OTHER_V4}/; echo rc=$?"));
    assert!(!r.stdout.contains("reached"), "{r:?}");
    assert!(has_block(&r, "tcp", &format!("{OTHER_V4}:80"), "no rule allows"), "{:?}", blocked(&r));
    assert!(!inet.since(&mark).contains(OTHER_V4), "the request arrived");
}

fn udp_and_icmp_fail_even_with_everything_allowed(tier: Tier) {
    let inet = internet();
    let mark = inet.mark();
    let r = net_on(
        tier,
        &["0.0.0.0/0", "::/0", "*"],
        &[],
        &format!(
            "python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); [s.sendto(b'leak', ('{WEB_V4}', 9999)) for _ in range(3)]\"; echo udp=$?;\
             python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)\" 2>/dev/null; echo icmp_dgram=$?;\
             python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)\" 2>/dev/null; echo icmp_raw=$?"
        ),
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(r.stdout.contains("udp=0"), "sending itself works (the forwarder drops it): {r:?}");
    assert!(!r.stdout.contains("icmp_dgram=0"), "ICMP sockets must be refused: {r:?}");
    assert!(!r.stdout.contains("icmp_raw=0"), "raw sockets must be refused: {r:?}");
    assert!(has_block(&r, "udp", &format!("{WEB_V4}:9999"), "UDP goes only"), "{:?}", blocked(&r));
    assert!(!inet.since(&mark).contains("udp from="), "a datagram arrived");
}

/// How each kind of refused flow ends for the program that made it, with the wait it took:
/// a TCP connect by address (`tcp-addr`), a connect that sends nothing where name rules exist
/// (`tcp-silent`), a TLS hello naming an unlisted host (`tcp-sni`), and a connected UDP socket
/// (`udp`). Each client waits up to 8 s: "timeout" is the hang the refusal must not be.
const REFUSALS: &str = r#"
import errno, socket, ssl, sys, time
def outcome(f):
    t = time.time()
    try:
        r = f()
    except socket.timeout:
        r = 'timeout'
    except ssl.SSLError as e:
        r = 'ssl:' + type(e).__name__
    except OSError as e:
        r = errno.errorcode.get(e.errno, str(e.errno))
    return '%s %.1f' % (r, time.time() - t)
def tcp(ip, port, payload):
    s = socket.create_connection((ip, port), timeout=8)
    if payload: s.sendall(payload)
    return 'open' if s.recv(100) else 'eof'
def sni():
    c = ssl.create_default_context(); c.check_hostname = False; c.verify_mode = ssl.CERT_NONE
    s = socket.create_connection((sys.argv[2], 443), timeout=8)
    c.wrap_socket(s, server_hostname='unlisted.test').recv(100)
    return 'open'
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(8)
    s.connect((sys.argv[1], 9999)); s.send(b'x')
    s.send(b'x'); s.recv(100)
    return 'answer'
print('tcp-addr', outcome(lambda: tcp(sys.argv[1], 80, b'GET / HTTP/1.0\r\n\r\n')))
print('udp', outcome(udp))
if sys.argv[3] == 'names':
    print('tcp-silent', outcome(lambda: tcp(sys.argv[1], 22, b'')))
    print('tcp-sni', outcome(sni))
"#;

/// A refused connection fails at once, as a firewall's REJECT does: a TCP connection gets a
/// RST as soon as the address (at once) or the name (once the first bytes or the forwarder's
/// wait for a silent client settle it) refuses it, and a connected UDP socket gets an ICMP
/// unreachable (EHOSTUNREACH). Before, each hung until the
/// client's own timeout: the forwarder completed the handshake and then went quiet.
fn denied_connections_fail_at_once_with_a_reset_or_an_unreachable(tier: Tier) {
    let outcomes = |r: &Run| -> Vec<(String, String)> {
        r.stdout.lines().filter_map(|l| l.split_once(' ')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
    };
    let check = |r: &Run, want: &[(&str, &str)]| {
        assert_eq!(r.code, 0, "{r:?}");
        let got = outcomes(r);
        for (label, errnos) in want {
            let o = got.iter().find(|(k, _)| k == label).unwrap_or_else(|| panic!("{label}: no outcome: {r:?}"));
            assert!(errnos.split('|').any(|e| o.1.starts_with(&format!("{e} "))), "{label}: {} (want {errnos}): {r:?}", o.1);
        }
        assert!(has_block(r, "tcp", &format!("{OTHER_V4}:80"), ""), "{:?}", blocked(r));
        assert!(has_block(r, "udp", &format!("{OTHER_V4}:9999"), ""), "{:?}", blocked(r));
    };
    let run = |allow: &[&str], mode: &str| {
        net_on(tier, allow, &[], &format!("cat > /tmp/r.py <<'EOF'\n{REFUSALS}\nEOF\npython3 /tmp/r.py {OTHER_V4} {WEB_V4} {mode}"))
    };
    // Address rules only: the address settles it before anything is read (the stack may have
    // answered the SYN already, so the connect itself is refused or reset right after it).
    let net2 = format!("{NET2_V4}/32");
    check(&run(&[&net2], "addrs"), &[("tcp-addr", "ECONNREFUSED|ECONNRESET"), ("udp", "EHOSTUNREACH")]);
    // With a name rule the forwarder answers the handshake to read the name; it resets the
    // connection as soon as the name (or its absence) refuses it.
    check(
        &run(&["web.test", &net2], "names"),
        &[("tcp-addr", "ECONNRESET"), ("udp", "EHOSTUNREACH"), ("tcp-silent", "ECONNRESET"), ("tcp-sni", "ECONNRESET")],
    );
}

fn allowed_names_resolving_to_loopback_private_or_metadata_are_refused(tier: Tier) {
    let r = net_on(
        tier,
        &["loop.test", "private.test", "meta.test"],
        &[],
        &format!("for h in loop private meta; do {CURL} http://$h.test/ -o /dev/null; echo $h=$?; done"),
    );
    for h in ["loop", "private", "meta"] {
        assert!(!r.stdout.contains(&format!("{h}=0")), "{h}.test was reached: {r:?}");
    }
    // The sandbox got the addresses from DNS, dialled them, and the forwarder refused.
    assert!(has_block(&r, "tcp", "169.254.169.254:80", "cloud metadata"), "{:?}", blocked(&r));
    assert!(has_block(&r, "tcp", "10.0.0.5:80", "private range"), "{:?}", blocked(&r));
    assert!(r.stdout.contains("loop=7"), "127.0.0.1 is the sandbox's own loopback: {r:?}");
}

#[test]
fn allowed_name_resolving_to_the_hosts_own_address_is_refused() {
    require_root!();
    let r = net(&["self.test", "198.51.100.0/24"], &[], &format!("{CURL} http://self.test:8/ -o /dev/null; echo a=$?; {CURL} http://{HOST_V4}:8/; echo b=$?"));
    assert!(has_block(&r, "tcp", &format!("{HOST_V4}:8"), "address of the host"), "{:?}", blocked(&r));
}

fn sni_naming_an_allowed_host_while_dialling_another_ip_reaches_only_the_allowed_host(tier: Tier) {
    let _pip = PIP_ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let inet = internet();
    let mark = inet.mark();
    let r = net_on(tier, &["allowed.test"], &[], &format!("{CURL} -k --resolve allowed.test:443:{OTHER_V4} https://allowed.test/"));
    assert!(r.stdout.contains(&format!("reached {WEB_V4} via https")), "{r:?}");
    let seen = inet.since(&mark);
    assert!(!seen.contains(&format!("https {OTHER_V4}")), "{seen}");
}

#[test]
fn http_host_header_decides_not_the_dialled_address() {
    let _pip = PIP_ALONE.lock().unwrap_or_else(|e| e.into_inner());
    require_root!();
    let inet = internet();
    let mark = inet.mark();
    let r = net(
        &["allowed.test"],
        &[],
        &format!(
            "{CURL} -H 'Host: allowed.test' http://{OTHER_V4}/; echo; {CURL} --resolve other.test:80:{WEB_V4} http://other.test/; echo rc=$?"
        ),
    );
    // Host names the allowed host, the address is another: the request goes to allowed.test.
    assert!(r.stdout.contains(&format!("reached {WEB_V4} via http host=allowed.test")), "{r:?}");
    // Host names a forbidden host at the allowed host's address: refused.
    assert!(!r.stdout.contains("host=other.test"), "{r:?}");
    assert!(blocked(&r).iter().any(|b| b["name"] == "other.test" && b["proto"] == "tcp"), "{:?}", blocked(&r));
    assert!(!inet.since(&mark).contains(OTHER_V4));
}

fn cidr_rules_allow_addresses_and_nothing_else(tier: Tier) {
    let r = net_on(tier, &["203.0.113.0/24"], &[], &format!("{CURL} http://{NET2_V4}/; echo; {CURL} http://{WEB_V4}/; echo rc=$?"));
    assert!(r.stdout.contains(&format!("reached {NET2_V4} via http")), "{r:?}");
    assert!(!r.stdout.contains(&format!("reached {WEB_V4}")), "{r:?}");
    assert!(has_block(&r, "tcp", &format!("{WEB_V4}:80"), "no rule"), "{:?}", blocked(&r));
}

fn port_rules_limit_a_name_to_its_ports(tier: Tier) {
    let inet = internet();
    let mark = inet.mark();
    let r = net_on(tier, &["allowed.test:443"], &[], &format!("{CURL} -k https://allowed.test/; echo; {CURL} http://allowed.test/port-80-probe; echo rc=$?"));
    assert!(r.stdout.contains("via https"), "{r:?}");
    assert!(!r.stdout.contains("via http "), "{r:?}");
    assert!(!inet.since(&mark).contains("path=/port-80-probe"), "the plain HTTP request arrived");
    // With Landlock's TCP rules (every allow rule names a port) the connect fails in the
    // sandbox already; without them the forwarder refuses it.
    if r.record["landlock"] == "full" {
        assert!(r.stdout.contains("rc=7"), "{r:?}");
    } else {
        assert!(has_block(&r, "tcp", ":80", "no rule"), "{:?}", blocked(&r));
    }
}

fn the_forwarder_enforces_ports_where_landlock_does_not(tier: Tier) {
    // The CIDR rule has no port, so Landlock's TCP rules stay off and only the forwarder decides.
    let r = net_on(tier, 
        &["allowed.test:443", "203.0.113.0/24"],
        &[],
        &format!("{CURL} -k https://allowed.test/; echo; {CURL} http://allowed.test/; echo rc=$?"),
    );
    assert!(r.stdout.contains("via https"), "{r:?}");
    assert!(!r.stdout.contains("via http "), "{r:?}");
    assert!(has_block(&r, "tcp", &format!("{WEB_V4}:80"), "no rule allows allowed.test:80"), "{:?}", blocked(&r));
}

fn deny_rules_cut_holes_in_allow_rules(tier: Tier) {
    let r = net_on(tier, &["*.wild.test"], &["b.wild.test"], &format!("{CURL} http://a.wild.test/; echo; {CURL} http://b.wild.test/; echo rc=$?"));
    assert!(r.stdout.contains("host=a.wild.test"), "{r:?}");
    assert!(r.stdout.contains("rc=6"), "{r:?}");
    assert!(blocked(&r).iter().any(|b| b["reason"].as_str().unwrap_or("").contains("denied by rule b.wild.test")), "{:?}", blocked(&r));
}

fn ipv6_goes_through_the_same_forwarder(tier: Tier) {
    let r = net_on(tier, &["allowed.test"], &[], &format!("{CURL6} http://allowed.test/; echo; {CURL6} 'http://[2001:db8:100::11]/'; echo rc=$?"));
    assert!(r.stdout.contains(&format!("reached {WEB_V6} via http")), "{r:?}");
    assert!(has_block(&r, "tcp", "[2001:db8:100::11]:80", "no rule"), "{:?}", blocked(&r));
}

fn services_on_the_hosts_loopback_are_unreachable_with_any_policy(tier: Tier) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let r = net_on(
        tier,
        &["0.0.0.0/0", "::/0", "*", "loop.test"],
        &[],
        &format!("{CURL} http://127.0.0.1:{port}/; echo a=$?; {CURL} http://loop.test:{port}/; echo b=$?; {CURL} http://10.0.2.1:{port}/; echo c=$?"),
    );
    assert!(listener.accept().is_err(), "the host's loopback service got a connection: {r:?}");
    assert!(!r.stdout.contains("a=0") && !r.stdout.contains("b=0") && !r.stdout.contains("c=0"), "{r:?}");
    assert!(has_block(&r, "tcp", &format!("10.0.2.1:{port}"), "gateway serves only DNS"), "{:?}", blocked(&r));
}

fn services_on_the_hosts_own_addresses_are_unreachable_with_any_policy(tier: Tier) {
    internet();
    let listener = std::net::TcpListener::bind(format!("{HOST_V4}:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let r = net_on(
        tier,
        &["0.0.0.0/0", "198.51.100.0/24", "198.51.100.1", "self.test"],
        &[],
        &format!("{CURL} http://{HOST_V4}:{port}/; echo a=$?; {CURL} http://self.test:{port}/; echo b=$?"),
    );
    assert!(listener.accept().is_err(), "the host's service got a connection: {r:?}");
    assert!(has_block(&r, "tcp", &format!("{HOST_V4}:{port}"), "address of the host"), "{:?}", blocked(&r));
}

#[test]
fn a_sandbox_cannot_reach_another_sandbox() {
    require_root!();
    internet();
    let _shared = QUIET.read().unwrap_or_else(|e| e.into_inner());
    // Sandbox A serves on every address of its own namespace for a few seconds.
    let a = std::thread::spawn(|| {
        sh(
            &["--allow-net", "allowed.test", "--dns-upstream", DNS],
            "python3 -m http.server 8080 --bind 0.0.0.0 >/tmp/srv.log 2>&1 & sleep 6; cat /tmp/srv.log | grep -c GET",
        )
    });
    std::thread::sleep(Duration::from_millis(1500));
    let b = sh(
        &["--allow-net", "0.0.0.0/0", "--allow-net", "10.0.0.0/8", "--dns-upstream", DNS],
        &format!("for h in 10.0.2.100 10.0.2.1 {HOST_V4}; do {CURL} --max-time 3 http://$h:8080/ -o /dev/null; echo $h=$?; done"),
    );
    let a = a.join().unwrap();
    assert!(!b.stdout.contains("=0\n"), "B reached something: {b:?}");
    assert_eq!(a.stdout.trim(), "0", "A's server got a request: {a:?}");
}

#[test]
fn landlock_limits_tcp_connect_to_the_policys_ports() {
    require_root!();
    let r = net(
        &["allowed.test:443"],
        &[],
        &format!(
            "{CURL} -k https://allowed.test/; python3 -c \"
import socket
for addr in [('{WEB_V4}', 80), ('127.0.0.1', 8000)]:
    try:
        socket.create_connection(addr, timeout=3)
        print(addr[1], 'connected')
    except OSError as e:
        print(addr[1], 'errno', e.errno)
\"; {}",
            py_dns("allowed.test", "10.0.2.1", "tcp")
        ),
    );
    assert!(r.stdout.contains("via https"), "{r:?}");
    if r.record["landlock"] == "full" {
        assert!(r.stdout.contains("80 errno 13"), "port 80 should be refused by Landlock (EACCES): {r:?}");
        assert!(r.stdout.contains("8000 errno 13"), "{r:?}");
    }
    assert!(r.stdout.contains("rcode 0 answers 1"), "DNS over TCP to the gateway still works: {r:?}");
}

#[test]
fn audit_flag_prints_blocked_attempts() {
    require_root!();
    internet();
    let _shared = QUIET.read().unwrap_or_else(|e| e.into_inner());
    let r = sh(
        &["--audit", "--allow-net", "allowed.test", "--dns-upstream", DNS],
        &format!("{CURL} http://other.test/; {CURL} http://{OTHER_V4}/; true"),
    );
    assert!(r.stderr.contains("cordon: audit: blocked dns 10.0.2.1:53 (other.test) x"), "{r:?}");
    assert!(r.stderr.contains(&format!("cordon: audit: blocked tcp {OTHER_V4}:80 x1: no rule allows {OTHER_V4}:80")), "{r:?}");
}

#[test]
fn bad_rules_are_refused_with_one_line() {
    require_root!();
    for (flag, rule, says) in [
        ("--allow-net", "exa mple.org", "--allow-net: 'exa mple.org' is not a domain"),
        ("--allow-net", "example.org:0", "1 to 65535"),
        ("--deny-net", "10.0.0.0/40", "--deny-net: '10.0.0.0/40' prefix /40 is longer than 32"),
        ("--dns-upstream", "nope", "--dns-upstream: DNS upstream 'nope' is not IP:PORT"),
    ] {
        let out = cordon().args(["run", flag, rule, "--", "true"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{rule}: {err}");
        assert!(err.contains(says), "{rule}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

#[test]
fn policy_updated_at_run_time_takes_effect() {
    require_root!();
    internet();
    let _shared = QUIET.read().unwrap_or_else(|e| e.into_inner());
    runtime_update::check();
}

/// The forwarder's live policy swap, driven directly: a real TUN in a namespace made here, the
/// same jail code that plumbs a sandbox, and curl run inside that namespace.
mod runtime_update {
    use super::*;
    use std::process::Command;

    fn curl_in(ns: &str, url: &str) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", ns, "curl", "-sS", "--max-time", "5", url])
            .output()
            .unwrap();
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }

    /// A namespace made here with a sandbox's TUN device in it (as the jail plumbs one), and
    /// the resolv.conf `ip netns exec` shows in it. Returns the TUN's host end.
    fn namespace_with_tun(ns: &str) -> std::os::fd::OwnedFd {
        let _ = Command::new("ip").args(["netns", "del", ns]).status();
        assert!(Command::new("ip").args(["netns", "add", ns]).status().unwrap().success());
        // `ip netns exec` shows this file as the namespace's /etc/resolv.conf.
        let etc = format!("/etc/netns/{ns}");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(format!("{etc}/resolv.conf"), "nameserver 10.0.2.1\n").unwrap();
        let path = format!("/run/netns/{ns}");
        std::thread::spawn(move || {
            let f = std::fs::File::open(&path).unwrap();
            // SAFETY: setns on this short-lived thread only; the fd is valid.
            assert_eq!(unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&f), libc::CLONE_NEWNET) }, 0);
            let _ = Command::new("ip").args(["link", "set", "lo", "up"]).status();
            cordon_jail::tun::create().unwrap()
        })
        .join()
        .unwrap()
    }

    fn remove_namespace(ns: &str) {
        let _ = Command::new("ip").args(["netns", "del", ns]).status();
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
    }

    fn config(cpu: cordon_net::CpuCharge) -> cordon_net::EgressConfig {
        cordon_net::EgressConfig {
            gateways: vec![cordon_jail::tun::GATEWAY_V4.into(), cordon_jail::tun::GATEWAY_V6.into()],
            dns_upstream: Some(DNS.parse().unwrap()),
            mtu: cordon_jail::tun::MTU,
            cpu,
            intercept: None,
        }
    }

    pub fn check() {
        let ns = format!("cordon-upd-{}", std::process::id());
        let tun = namespace_with_tun(&ns);
        let policy = |a: &[&str]| cordon_spec::NetworkPolicy::parse(a, &[] as &[&str]).unwrap();
        let unbounded = cordon_net::CpuCharge { cpus: 64.0, group: None };
        let egress = cordon_net::Egress::start(cordon_net::Link::Tun(tun), policy(&["allowed.test"]), config(unbounded)).unwrap();
        let first = (curl_in(&ns, "http://allowed.test/"), curl_in(&ns, "http://a.wild.test/"));
        egress.update_policy(policy(&["*.wild.test"])).unwrap();
        let second = (curl_in(&ns, "http://allowed.test/"), curl_in(&ns, "http://a.wild.test/"));
        let blocked = egress.blocked();
        drop(egress);
        remove_namespace(&ns);
        assert!(first.0.contains("host=allowed.test"), "{first:?}");
        assert!(!first.1.contains("reached"), "{first:?}");
        assert!(!second.0.contains("reached"), "{second:?}");
        assert!(second.1.contains("host=a.wild.test"), "{second:?}");
        assert!(blocked.iter().any(|b| b.name.as_deref() == Some("allowed.test")), "{blocked:?}");
    }

    /// `cordon serve --network-default open`'s policies, driven through the forwarder: a name
    /// no rule mentions resolves and is reached, an address `denyOut` lists is refused at
    /// once, and after an update that closes everything (`allow_internet_access: false`) a
    /// connection that worked before is reset at once instead of hanging.
    pub fn open_check() {
        use cordon_server::network::NetworkDefault;
        let ns = format!("cordon-open-{}", std::process::id());
        let tun = namespace_with_tun(&ns);
        let deny = vec![format!("{OTHER_V4}/32")];
        let open = NetworkDefault::Open.policy(&[], &deny, None).unwrap();
        let egress = cordon_net::Egress::start(cordon_net::Link::Tun(tun), open, config(cordon_net::CpuCharge { cpus: 64.0, group: None })).unwrap();
        let unlisted = curl_in(&ns, "http://allowed.test/");
        let denied = curl_in(&ns, &format!("http://{OTHER_V4}/"));
        egress.update_policy(NetworkDefault::Open.policy(&[], &[], Some(false)).unwrap()).unwrap();
        let closed = curl_in(&ns, &format!("http://{WEB_V4}/"));
        let blocked = egress.blocked();
        drop(egress);
        remove_namespace(&ns);
        assert!(unlisted.contains("host=allowed.test"), "an unlisted name under the open default: {unlisted}");
        let refused_at_once = |out: &str| (out.contains("curl: (7)") || out.contains("curl: (56)")) && !out.contains("curl: (28)");
        assert!(refused_at_once(&denied), "a denyOut address: {denied}");
        assert!(refused_at_once(&closed), "after closing: {closed}");
        assert!(blocked.iter().any(|b| b.destination.contains(OTHER_V4)), "{blocked:?}");
    }

    /// Four connections from the namespace to the drain, sending as fast as they can for the
    /// seconds given; prints the bytes sent.
    const PUSH: &str = r#"
import socket, sys, threading, time
stop, sent = time.time() + float(sys.argv[1]), [0] * 4
def run(k):
    c = socket.create_connection(('198.51.100.11', 9003), timeout=3)
    while time.time() < stop:
        try: sent[k] += c.send(b'x' * 65536)
        except socket.timeout: pass
ts = [threading.Thread(target=run, args=(k,)) for k in range(4)]
for t in ts: t.start()
for t in ts: t.join()
print(sum(sent))
"#;

    /// CPU seconds of one thread of this process.
    fn thread_cpu(tid: libc::pid_t) -> f64 {
        common::stat_cpu_seconds(&format!("/proc/self/task/{tid}/stat"))
    }

    /// Where no cgroup can take the forwarder's thread (cgroup v2), the forwarder holds itself
    /// to the sandbox's `--cpus`: pushed at by a sender with a whole core, its thread spends
    /// at most the quota over the push's wall time (a quarter over it, and a tenth of a
    /// second, allowed for the clock's ticks), and the data still flows.
    pub fn budget_check() {
        let inet = internet();
        let mut drain = Command::new("ip")
            .args(["netns", "exec", &inet.ns, "python3", "-c", &drain_server(9003)])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(drain.stdout.as_mut().unwrap()), &mut line).unwrap();
        assert_eq!(line.trim(), "listening");
        let ns = format!("cordon-cpu-{}", std::process::id());
        let tun = namespace_with_tun(&ns);
        let cpus = 0.1;
        let policy = cordon_spec::NetworkPolicy::parse(&[format!("{OTHER_V4}:9003")], &[] as &[&str]).unwrap();
        let egress = cordon_net::Egress::start(cordon_net::Link::Tun(tun), policy, config(cordon_net::CpuCharge { cpus, group: None })).unwrap();
        assert!(!egress.charged_to_group());
        let (c0, t0) = (thread_cpu(egress.thread_id()), std::time::Instant::now());
        let out = Command::new("ip").args(["netns", "exec", &ns, "python3", "-c", PUSH, "4"]).output().unwrap();
        let (cpu, wall) = (thread_cpu(egress.thread_id()) - c0, t0.elapsed().as_secs_f64());
        drop(egress);
        remove_namespace(&ns);
        let _ = drain.kill();
        let _ = drain.wait();
        let sent: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0);
        eprintln!("a push at a budget of {cpus} CPUs: {sent} bytes in {wall:.1}s, forwarder CPU {cpu:.2}s");
        assert!(sent > 1 << 20, "the push barely ran: {out:?}");
        assert!(cpu <= cpus * wall * 1.25 + 0.1, "the forwarder spent {cpu:.2}s of CPU in {wall:.1}s on a budget of {cpus} CPUs");
    }
}

#[test]
fn the_open_network_default_is_e2bs_and_closing_it_refuses_at_once() {
    require_root!();
    internet();
    let _shared = QUIET.read().unwrap_or_else(|e| e.into_inner());
    runtime_update::open_check();
}

#[test]
fn the_forwarder_holds_itself_to_the_sandboxs_cpus_where_no_cgroup_can_take_it() {
    require_root!();
    let _shared = QUIET.read().unwrap_or_else(|e| e.into_inner());
    runtime_update::budget_check();
}

/// pip against the test index, with no proxy variables; one try, so a refused host fails fast.
const PIP: &str = "pip install -q --disable-pip-version-check --no-cache-dir --retries 0 --timeout 8 \
     --index-url https://pypi.test/simple --trusted-host pypi.test --trusted-host files.pypi.test tinypkg";
/// The pip tests read each other's hosts in the servers' log: one at a time. They reach
/// OTHER_V4 for real (files.pypi.test), so the tests that find OTHER_V4 nowhere in the log
/// take it too.
static PIP_ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn pip_installs_from_an_allowed_index_with_files_on_a_wildcard_host(tier: Tier) {
    let _alone = PIP_ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let inet = internet();
    let mark = inet.mark();
    let r = net_on(tier, 
        &["pypi.test", "*.pypi.test"],
        &[],
        &format!("env | grep -ci proxy; {PIP}; echo pip=$?; python3 -c 'import tinypkg; print(tinypkg.VALUE)'"),
    );
    let seen = inet.since(&mark);
    assert!(r.stdout.starts_with("0\n"), "no proxy variables: {r:?}");
    assert!(r.stdout.contains("pip=0"), "{r:?}");
    assert!(r.stdout.contains(&inet.pkg_value()), "the installed module is the index's: {r:?}");
    assert!(seen.contains("https 198.51.100.10 host=pypi.test path=/simple/tinypkg/"), "{seen}");
    assert!(seen.contains(&format!("https {OTHER_V4} host=files.pypi.test path=/packages/tinypkg-1.0-py3-none-any.whl")), "{seen}");
    assert!(blocked(&r).is_empty(), "{:?}", blocked(&r));
    assert_clean(r.id());
}

fn pip_fails_when_the_index_is_allowed_but_its_file_host_is_not(tier: Tier) {
    let _alone = PIP_ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let inet = internet();
    let mark = inet.mark();
    let r = net_on(tier, &["pypi.test"], &[], &format!("{PIP}; echo pip=$?; python3 -c 'import tinypkg' 2>/dev/null; echo import=$?"));
    let seen = inet.since(&mark);
    assert!(r.stdout.contains("import=1"), "nothing was installed: {r:?}");
    assert!(!r.stdout.contains("pip=0"), "{r:?}");
    assert!(seen.contains("host=pypi.test path=/simple/tinypkg/"), "the index itself is allowed: {seen}");
    assert!(!seen.contains("files.pypi.test"), "the file host was reached or asked: {seen}");
    assert!(blocked(&r).iter().any(|b| b["name"] == "files.pypi.test"), "the audit names the refused host: {:?}", blocked(&r));
}

fn git_clones_over_https_from_an_allowed_host_and_not_otherwise(tier: Tier) {
    let inet = internet();
    let clone = "git -c http.sslVerify=false clone -q https://git.test/repo.git /tmp/repo; echo clone=$?; \
                 git -C /tmp/repo log --format=%s 2>&1";
    let mark = inet.mark();
    let r = net_on(tier, &["git.test"], &[], clone);
    let seen = inet.since(&mark);
    assert!(r.stdout.contains("clone=0"), "{r:?}");
    assert!(r.stdout.contains("the commit the test internet made"), "{r:?}");
    assert!(seen.contains("host=git.test path=/repo.git/info/refs"), "{seen}");

    let mark = inet.mark();
    let r = net_on(tier, &["allowed.test"], &[], clone);
    let seen = inet.since(&mark);
    assert!(r.stdout.contains("clone=128"), "{r:?}");
    assert!(!r.stdout.contains("the commit the test internet made"), "{r:?}");
    assert!(!seen.contains("git.test"), "{seen}");
    assert!(blocked(&r).iter().any(|b| b["name"] == "git.test"), "{:?}", blocked(&r));
}

/// Root in a microVM owns its kernel's side of the link (on ns and gvisor it has no
/// CAP_NET_ADMIN over it at all): it sends a raw ICMP echo request, adds addresses and routes,
/// points the default route at a gateway that does not exist, names another resolver, and
/// takes another host's address as its own. None of it opens anything: every packet still ends
/// at the forwarder, which decides by the policy alone and answers DNS only itself.
fn guest_root_rewiring_its_network_reaches_nothing_more(tier: Tier) {
    let _pip = PIP_ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let inet = internet();
    let _shared = QUIET.read().unwrap_or_else(|e| e.into_inner());
    let mark = inet.mark();
    // First a raw ICMP echo request as root (the guest's kernel lets root open raw sockets).
    let ping = format!(
        "python3 -c \"import socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); \
         p = struct.pack('!BBHHH', 8, 0, 0, 1, 1) + b'x' * 8; c = sum(struct.unpack('!8H', p)); c = (c & 0xffff) + (c >> 16); \
         s.sendto(p[:2] + struct.pack('!H', ~c & 0xffff) + p[4:], ('{WEB_V4}', 0)); print('raw sent')\"; "
    );
    let script = ping + &format!(
        "ip addr add 203.0.113.77/24 dev eth0 && ip route add 198.51.100.0/24 dev eth0 src 203.0.113.77 && \
         ip route replace default via 10.0.2.99 dev eth0 onlink && echo rewired; \
         {CURL} http://{OTHER_V4}/; echo raw=$?; \
         echo 'nameserver {WEB_V4}' > /etc/resolv.conf; {CURL} http://other.test/; echo name=$?; \
         ip addr flush dev eth0 && ip addr add {OTHER_V4}/32 dev eth0 && ip route add default dev eth0 && echo spoofing; \
         {CURL} http://{NET2_V4}/; echo spoofed=$?"
    );
    let r = sh(&["--tier", tier.as_str(), "--user", "root", "--dns-upstream", DNS, "--timeout", "60s", "--allow-net", "allowed.test"], &script);
    std::thread::sleep(Duration::from_millis(300));
    let seen = inet.since(&mark);
    assert!(r.stdout.contains("rewired") && r.stdout.contains("spoofing"), "root could not change its own network, so nothing was tried: {r:?}");
    assert!(r.stdout.contains("raw sent"), "root could not send a raw packet, so nothing was tried: {r:?}");
    assert!(has_block(&r, "icmp", WEB_V4, "only TCP and DNS"), "{:?}", blocked(&r));
    for tried in ["raw", "name", "spoofed"] {
        assert!(r.stdout.contains(&format!("{tried}=")) && !r.stdout.contains(&format!("{tried}=0")), "{tried}: {r:?}");
    }
    assert!(!r.stdout.contains("reached"), "{r:?}");
    assert!(!seen.contains(OTHER_V4) && !seen.contains(NET2_V4), "a request arrived: {seen}");
    assert!(!seen.contains("dns other.test"), "the other resolver was asked: {seen}");
    assert!(has_block(&r, "tcp", &format!("{OTHER_V4}:80"), "no rule allows"), "{:?}", blocked(&r));
    assert!(has_block(&r, "tcp", &format!("{NET2_V4}:80"), "no rule allows"), "{:?}", blocked(&r));
    assert_clean(r.id());
}
