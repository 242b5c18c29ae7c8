//! Header injection at egress (`--secret`, `--inject`): real sandboxes against the test
//! internet (testnet.rs), whose HTTPS server has a certificate of a test CA (the forwarder's
//! `--upstream-ca`) and echoes what each request carried. Each case checks both what the
//! sandbox saw and what the server received.

mod common;
#[path = "egress/testnet.rs"]
mod testnet;

use common::*;
use serde_json::Value;
use testnet::*;

per_tier!(
    the_rule_host_receives_the_secret_and_the_sandbox_only_sees_the_placeholder,
    a_wildcard_rule_injects_for_subdomains_not_for_the_apex,
    an_http2_client_works_and_keep_alive_holds_through_injection,
    an_upstream_with_an_invalid_certificate_fails_closed,
    a_host_without_a_rule_is_not_intercepted,
    a_redirect_to_another_host_does_not_carry_the_header,
);

/// A value no file, variable or process of the sandbox may ever show.
const SECRET: &str = "sk-live-7f3a9c1e55d04b7a";

/// `cordon run` on the test internet with a secret and the rules most cases need: `api.test`
/// gets `Authorization`, its subdomains `X-Api-Key`, `badcert.test` `Authorization`.
fn injecting(tier: Tier, script: &str) -> (Run, String) {
    internet();
    // Tests run at once against one server: each tags its requests (`?t=$T`) to find its own.
    let tag = format!("t{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    let tag_env = format!("T={tag}");
    let _shared = QUIET.read().unwrap_or_else(|e| e.into_inner());
    let ca = test_ca_pem();
    let ca = ca.to_str().unwrap();
    let flags = [
        "--tier", tier.as_str(), "--dns-upstream", DNS, "--timeout", "90s", "--upstream-ca", ca,
        "--allow-net", "api.test", "--allow-net", "*.api.test", "--allow-net", "other-api.test", "--allow-net", BADCERT, "--allow-net", "allowed.test",
        "--secret", "KEY", "-e", &tag_env,
        "--inject", "api.test:Authorization=Bearer ${secrets.KEY}",
        "--inject", "*.api.test:X-Api-Key=${secrets.KEY}",
        "--inject", "badcert.test:Authorization=Bearer ${secrets.KEY}",
    ];
    // `--secret KEY` reads `KEY` from cordon's environment.
    (run_with_env(&flags, &["bash", "-c", script], &[("KEY", SECRET)]), tag)
}

fn header<'a>(echo: &'a Value, name: &str) -> Vec<&'a str> {
    echo["headers"].as_array().unwrap().iter().filter(|h| h[0].as_str().unwrap().eq_ignore_ascii_case(name)).map(|h| h[1].as_str().unwrap()).collect()
}

/// The echoes of requests tagged `tag` to exactly `host`.
fn echoes_for(tag: &str, host: &str) -> Vec<Value> {
    let tagged = |e: &Value| e["path"].as_str().is_some_and(|p| p.contains(&format!("t={tag}")));
    internet().echoes("").into_iter().filter(|e| tagged(e) && e["host"].as_str().is_some_and(|h| h.split(':').next() == Some(host))).collect()
}

fn the_rule_host_receives_the_secret_and_the_sandbox_only_sees_the_placeholder(tier: Tier) {
    // A placeholder of its own in the request, to the rule's host and to another allowed host;
    // then every place the value could hide inside.
    let (r, tag) = injecting(
        tier,
        r#"set -u
curl -sS --fail -H 'Authorization: Bearer ${e2b.secrets.key}' -o /dev/null https://api.test/echo?t=$T && echo RULE-OK
curl -sSk --fail -H 'Authorization: Bearer ${e2b.secrets.key}' -o /dev/null https://other-api.test/echo?t=$T && echo OTHER-OK
python3 - <<'EOF'
import json, os, urllib.request
print("PY", json.load(urllib.request.urlopen("https://api.test/echo?t=" + os.environ["T"]))["scheme"])
EOF
env | grep -c sk-live || true
cat /proc/*/environ 2>/dev/null | tr '\0' '\n' | grep -c sk-live || true
grep -rIl sk-live /etc /home /root /tmp /usr/local /.cordon 2>/dev/null | head -3; echo SEARCHED"#,
    );
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("RULE-OK") && r.stdout.contains("OTHER-OK") && r.stdout.contains("PY https"), "{}", r.stdout);
    assert!(!r.stdout.contains(SECRET) && !r.stderr.contains(SECRET), "the value showed up inside:\n{}", r.stdout);
    let counts: Vec<&str> = r.stdout.lines().filter(|l| l.chars().all(|c| c.is_ascii_digit()) && !l.is_empty()).collect();
    assert_eq!(counts, ["0", "0"], "env or /proc/*/environ held the value:\n{}", r.stdout);
    assert!(r.stdout.trim_end().ends_with("SEARCHED") && !r.stdout.lines().any(|l| l.starts_with('/')), "a file held the value:\n{}", r.stdout);
    // On the wire: the rule's host got the real value, once, replacing the sandbox's own.
    let rule = echoes_for(&tag, "api.test");
    assert_eq!(rule.len(), 2, "{rule:?}");
    for e in &rule {
        assert_eq!(header(e, "authorization"), [format!("Bearer {SECRET}").as_str()], "{e}");
        assert_eq!(e["sni"], "api.test");
    }
    // The other host got the placeholder as the sandbox sent it.
    let other = echoes_for(&tag, "other-api.test");
    assert_eq!(other.len(), 1, "{other:?}");
    assert_eq!(header(&other[0], "authorization"), ["Bearer ${e2b.secrets.key}"]);
    // The audit counts the injections, never the value.
    let injected = r.record["injected_headers"].as_array().cloned().unwrap_or_default();
    assert!(injected.iter().any(|i| i["host"] == "api.test" && i["header"] == "authorization" && i["count"] == 2), "{injected:?}");
    assert!(!r.record.to_string().contains(SECRET));
    assert_clean(r.id());
}

fn a_wildcard_rule_injects_for_subdomains_not_for_the_apex(tier: Tier) {
    let (r, tag) = injecting(tier, "curl -sS --fail -o /dev/null https://a.api.test/echo?t=$T && curl -sS --fail -o /dev/null https://b.a.api.test/echo?t=$T && curl -sS --fail -o /dev/null https://api.test/echo?t=$T && echo DONE");
    assert!(r.stdout.contains("DONE"), "{}\n{}", r.stdout, r.stderr);
    for host in ["a.api.test", "b.a.api.test"] {
        let e = echoes_for(&tag, host);
        assert_eq!(e.len(), 1, "{host}: {e:?}");
        assert_eq!(header(&e[0], "x-api-key"), [SECRET], "{host}");
        assert!(header(&e[0], "authorization").is_empty(), "{host} got the apex's rule too: {}", e[0]);
    }
    // The apex has its own exact rule: that one, not the wildcard's.
    let apex = echoes_for(&tag, "api.test");
    assert_eq!(apex.len(), 1);
    assert!(header(&apex[0], "x-api-key").is_empty(), "{}", apex[0]);
    assert_eq!(header(&apex[0], "authorization"), [format!("Bearer {SECRET}").as_str()]);
}

fn an_http2_client_works_and_keep_alive_holds_through_injection(tier: Tier) {
    // One curl, two requests: HTTP/2 toward the forwarder, then HTTP/1.1 with keep-alive.
    let (r, tag) = injecting(
        tier,
        r#"curl -sS --fail --http2 -w 'v=%{http_version}\n' -o /dev/null "https://api.test/echo?t=$T" -o /dev/null "https://api.test/echo?t=$T&second"
curl -sS --fail --http1.1 -w 'v=%{http_version} n=%{num_connects}\n' -o /dev/null "https://api.test/echo?t=$T&a" -o /dev/null "https://api.test/echo?t=$T&b""#,
    );
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines[..2], ["v=2", "v=2"], "{}", r.stdout);
    // The second HTTP/1.1 request reused the first one's connection.
    assert_eq!(lines[2..], ["v=1.1 n=1", "v=1.1 n=0"], "{}", r.stdout);
    let got = echoes_for(&tag, "api.test");
    assert_eq!(got.len(), 4, "{got:?}");
    assert!(got.iter().all(|e| header(e, "authorization") == [format!("Bearer {SECRET}").as_str()]), "{got:?}");
}

fn an_upstream_with_an_invalid_certificate_fails_closed(tier: Tier) {
    let (r, tag) = injecting(tier, "curl -sS -o /dev/null -w 'code=%{http_code}\\n' https://badcert.test/echo?t=$T; echo exit=$?");
    // The sandbox's handshake fails: nothing was sent, no response was made up.
    assert!(r.stdout.contains("code=000") && !r.stdout.contains("exit=0"), "{}\n{}", r.stdout, r.stderr);
    assert!(echoes_for(&tag, BADCERT).is_empty(), "a request reached the host: {}", internet().log());
    let blocked = r.record["blocked_connections"].as_array().cloned().unwrap_or_default();
    assert!(blocked.iter().any(|b| b["name"] == BADCERT && b["reason"].as_str().unwrap_or("").contains("TLS")), "{blocked:?}");
}

fn a_host_without_a_rule_is_not_intercepted(tier: Tier) {
    // Without a rule the sandbox talks TLS with the host itself: the certificate it sees is the
    // test CA's (which it does not trust, hence -k), not the egress CA's.
    let (r, _) = injecting(tier, "echo | openssl s_client -connect allowed.test:443 -servername allowed.test 2>/dev/null | grep -E '^(issuer|subject)=' ; echo | openssl s_client -connect api.test:443 -servername api.test 2>/dev/null | grep -E '^issuer='");
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let issuers: Vec<&str> = r.stdout.lines().filter(|l| l.starts_with("issuer=")).collect();
    assert_eq!(issuers.len(), 2, "{}", r.stdout);
    assert!(issuers[0].contains("cordon test CA"), "allowed.test was intercepted: {}", r.stdout);
    assert!(issuers[1].contains("cordon egress CA"), "api.test was not intercepted: {}", r.stdout);
}

fn a_redirect_to_another_host_does_not_carry_the_header(tier: Tier) {
    let (r, tag) = injecting(tier, "curl -sSk --fail -L -o /dev/null \"https://api.test/redirect?to=https://other-api.test/echo%3Ft%3D$T\" && echo FOLLOWED");
    assert!(r.stdout.contains("FOLLOWED"), "{}\n{}", r.stdout, r.stderr);
    let other = echoes_for(&tag, "other-api.test");
    assert_eq!(other.len(), 1, "{other:?}");
    assert!(header(&other[0], "authorization").is_empty(), "the header followed the redirect: {}", other[0]);
    assert!(!other[0].to_string().contains(SECRET));
}

/// A request naming another host on a connection to a rule's host is refused, not sent with
/// the secret; plain HTTP to the rule's host is injected too.
#[test]
fn a_request_for_another_host_on_an_injected_connection_is_refused() {
    require_root!();
    let (r, tag) = injecting(
        Tier::Ns,
        "curl -sS -o /dev/null -w 'code=%{http_code}\\n' -H 'Host: other-api.test' --connect-to other-api.test:443:api.test:443 https://api.test/echo?t=$T; curl -sS --fail -o /dev/null http://api.test/echo?t=$T && echo PLAIN-OK",
    );
    assert!(r.stdout.contains("code=421"), "{}\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("PLAIN-OK"), "{}\n{}", r.stdout, r.stderr);
    let got: Vec<Value> = ["api.test", "other-api.test"].iter().flat_map(|h| echoes_for(&tag, h)).collect();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["scheme"], "http");
    assert_eq!(header(&got[0], "authorization"), [format!("Bearer {SECRET}").as_str()]);
}

/// Bad flags are refused before any sandbox exists, with a message that says what to do.
#[test]
fn bad_injection_flags_are_refused_with_a_clear_message() {
    let cases: [(&[&str], &str); 4] = [
        (&["--allow-net", "api.test", "--inject", "api.test:Authorization=${secrets.NOPE}"], "no --secret gives"),
        (&["--allow-net", "api.test", "--inject", "api.test"], "HOST:HEADER=VALUE"),
        (&["--inject", "api.test:X=1"], "--allow-net"),
        (&["--allow-net", "api.test", "--inject", "api.test:Host=x"], "cannot be set"),
    ];
    for (flags, want) in cases {
        let out = cordon().arg("run").args(flags).args(["--", "true"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(want) && err.lines().count() == 1, "{flags:?}: {err}");
    }
}

/// A process holding secrets' values never leaves them in a core dump: `cordon serve` killed by
/// SIGABRT writes none where an ordinary process, killed the same way, does.
#[test]
fn the_server_holding_secrets_leaves_no_core_dump() {
    if !is_root() {
        skip("this test starts cordon serve and needs root (CI runs as root)");
        return;
    }
    let pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap_or_default();
    if pattern.trim() != "core" {
        skip(&format!("core_pattern is '{}', not a plain file in the working directory this test can look in", pattern.trim()));
        return;
    }
    let dir = std::env::temp_dir().join(format!("cordon-core-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dumped = |script: &str, ready: &dyn Fn() -> bool| -> bool {
        let sub = dir.join(format!("{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()));
        std::fs::create_dir_all(&sub).unwrap();
        let mut child = std::process::Command::new("bash").arg("-c").arg(format!("ulimit -c unlimited; exec {script}")).current_dir(&sub).env("CORDON_HOME", state_dir()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
        let t0 = std::time::Instant::now();
        let exec_done = || std::fs::read_to_string(format!("/proc/{}/comm", child.id())).is_ok_and(|c| c.trim() != "bash");
        while !(exec_done() && ready()) && t0.elapsed() < std::time::Duration::from_secs(60) {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        std::process::Command::new("kill").args(["-ABRT", &child.id().to_string()]).status().unwrap();
        let _ = child.wait();
        std::fs::read_dir(&sub).unwrap().flatten().any(|e| e.file_name().to_string_lossy().starts_with("core"))
    };
    // The control: this host does write core files for an ordinary process.
    assert!(dumped("sleep 60", &|| true), "an ordinary process left no core here: the check below would prove nothing");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let serve = format!("{} serve --listen 127.0.0.1:{port} --api-key e2b_{}", cordon_bin().display(), "0".repeat(40));
    // Up: answering on its port (so past the store's opening), as itself, not the shell.
    let up = || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
    assert!(!dumped(&serve, &up), "cordon serve left a core dump");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The clients agent code uses trust the egress CA without a flag: each one's request to the
/// rule's host completes its handshake and arrives with the header. Tools the image lacks are
/// said so and left out; curl, Python and git are in every image the tests use.
#[test]
fn common_clients_trust_the_egress_ca_without_flags() {
    require_root!();
    let (r, tag) = injecting(
        Tier::Ns,
        r#"curl -sS --fail -o /dev/null "https://api.test/echo?t=$T-curl" && echo ok curl
python3 -c 'import os, urllib.request; urllib.request.urlopen("https://api.test/echo?t=" + os.environ["T"] + "-urllib")' && echo ok urllib
# git asks for refs and gets JSON back: the handshake (and the request) is what counts here.
git ls-remote "https://api.test/echo?t=$T-git" >/dev/null 2>/tmp/git.err; grep -q 'SSL\|certificate' /tmp/git.err || echo ok git
python3 -c 'import requests' 2>/dev/null && python3 -c 'import os, requests; requests.get("https://api.test/echo?t=" + os.environ["T"] + "-requests").raise_for_status()' && echo ok requests
command -v pip >/dev/null && { pip download --no-deps -q -d /tmp/dl --index-url "https://api.test/echo?t=$T-pip" nothing-here >/dev/null 2>/tmp/pip.err; grep -q 'SSL\|CERTIFICATE' /tmp/pip.err || echo ok pip; }
command -v node >/dev/null && node -e 'require("https").get("https://api.test/echo?t="+process.env.T+"-node", r => { r.resume(); r.on("end", () => console.log("ok node")) })'
true"#,
    );
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let ok: Vec<&str> = r.stdout.lines().filter_map(|l| l.strip_prefix("ok ")).collect();
    for must in ["curl", "urllib", "git"] {
        assert!(ok.contains(&must), "{must} did not get through: {}\n{}", r.stdout, r.stderr);
    }
    let echoes = echoes_for(&tag, "api.test");
    for tool in &ok {
        let e = echoes.iter().find(|e| e["path"].as_str().unwrap().contains(&format!("{tag}-{tool}"))).unwrap_or_else(|| panic!("{tool}: no request arrived"));
        assert_eq!(header(e, "authorization"), [format!("Bearer {SECRET}").as_str()], "{tool}");
    }
    eprintln!("clients that trusted the egress CA: {}", ok.join(", "));
}
