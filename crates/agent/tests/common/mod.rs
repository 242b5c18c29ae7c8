//! Test harness: an in-process agent on a temporary socket, a temporary user database, and a
//! raw HTTP/1.1 client for checking exact bytes on the wire.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cordon_agent::{serve, AgentConfig};
use cordon_envd::EnvdClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

/// Supplementary group given to `nobody` in the test database.
pub const EXTRA_GID: u32 = 4242;

pub struct TestAgent {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub client: EnvdClient,
    /// Home of the default user `tester` (the uid the tests run as).
    pub home: PathBuf,
    /// Home of `nobody` (uid 65534), owned by it when running as root.
    pub nobody_home: PathBuf,
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn unique_dir() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "cordon-agent-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub async fn start_agent() -> TestAgent {
    start_agent_with(|_| {}).await
}

pub async fn start_agent_with(tweak: impl FnOnce(&mut AgentConfig)) -> TestAgent {
    start_agent_on(false, tweak).await
}

/// An agent that serves over a multiplexed link (a socketpair) instead of a listening socket,
/// with the host's end of `cordon-channel` serving `socket`: what the gvisor and vm tiers do.
pub async fn start_agent_linked() -> TestAgent {
    start_agent_on(true, |_| {}).await
}

async fn start_agent_on(linked: bool, tweak: impl FnOnce(&mut AgentConfig)) -> TestAgent {
    let dir = unique_dir();
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    let home = dir.join("home/tester");
    let nobody_home = dir.join("home/nobody");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&nobody_home).unwrap();
    // SAFETY: geteuid/getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if is_root() {
        std::os::unix::fs::chown(&nobody_home, Some(65534), Some(65534)).unwrap();
    }
    let passwd = format!(
        "root:x:0:0:root:/root:/bin/bash\n\
         tester:x:{uid}:{gid}:tester:{}:/bin/bash\n\
         nobody:x:65534:65534:nobody:{}:/usr/sbin/nologin\n",
        home.display(),
        nobody_home.display()
    );
    let group = format!(
        "root:x:0:\ntestgrp:x:{gid}:\nnogroup:x:65534:\nextra:x:{EXTRA_GID}:nobody\n"
    );
    std::fs::write(root.join("etc/passwd"), passwd).unwrap();
    std::fs::write(root.join("etc/group"), group).unwrap();

    let socket = dir.join("agent.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let mut config = AgentConfig {
        sandbox_id: "itest".into(),
        default_user: "tester".into(),
        workdir: None,
        env: vec![("SANDBOX_VAR".into(), "from-sandbox".into()), ("OVERRIDE".into(), "sandbox".into())],
        root,
        envd_version: Some("0.6.13".into()),
        isolate_commands: false,
    };
    tweak(&mut config);
    if linked {
        let (host, agent) = std::os::unix::net::UnixStream::pair().unwrap();
        let agent = cordon_channel::FdLink::duplex(agent.into()).unwrap();
        let host = cordon_channel::FdLink::duplex(host.into()).unwrap();
        tokio::spawn(async move {
            if let Err(e) = cordon_agent::serve_link(agent, config).await {
                panic!("agent stopped: {e}");
            }
        });
        tokio::spawn(async move {
            if let Err(e) = cordon_channel::serve_unix(host, &listener).await {
                panic!("host end of the link stopped: {e}");
            }
        });
    } else {
        tokio::spawn(async move {
            if let Err(e) = serve(listener, config).await {
                panic!("agent stopped: {e}");
            }
        });
    }
    let client = EnvdClient::new(socket.clone());
    TestAgent { dir, socket, client, home, nobody_home }
}

/// A parsed HTTP/1.1 response.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// The body after de-chunking.
    pub body: Vec<u8>,
    pub chunked: bool,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn parse_response(raw: &[u8]) -> RawResponse {
    let head_end = find(raw, b"\r\n\r\n").expect("no end of headers");
    let head = std::str::from_utf8(&raw[..head_end]).unwrap();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let status: u16 = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect();
    let mut rest = &raw[head_end + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        let mut body = Vec::new();
        loop {
            let line_end = find(rest, b"\r\n").expect("bad chunk");
            let size = usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).unwrap().trim(), 16).unwrap();
            rest = &rest[line_end + 2..];
            if size == 0 {
                break;
            }
            body.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
        body
    } else {
        rest.to_vec()
    };
    RawResponse { status, headers, body, chunked }
}

/// Sends raw request bytes (which should include `Connection: close`) and reads the response.
pub async fn raw_request(socket: &Path, request: &[u8]) -> RawResponse {
    let mut s = UnixStream::connect(socket).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await.expect("response timed out").unwrap();
    parse_response(&out)
}

/// Frames JSON as a Connect envelope.
pub fn envelope(flags: u8, json: &[u8]) -> Vec<u8> {
    let mut v = vec![flags];
    v.extend_from_slice(&(json.len() as u32).to_be_bytes());
    v.extend_from_slice(json);
    v
}

/// Splits a body into `(flags, payload)` envelopes.
pub fn split_envelopes(mut body: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while !body.is_empty() {
        assert!(body.len() >= 5, "truncated envelope");
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        out.push((body[0], body[5..5 + len].to_vec()));
        body = &body[5 + len..];
    }
    out
}

/// A chunked POST whose body is sent as the given chunks.
pub fn chunked_post(path: &str, content_type: &str, extra_headers: &str, chunks: &[&[u8]]) -> Vec<u8> {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n{extra_headers}\r\n"
    )
    .into_bytes();
    for c in chunks {
        req.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        req.extend_from_slice(c);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    req
}

/// A POST with a Content-Length body.
pub fn post(path: &str, content_type: &str, extra_headers: &str, body: &[u8]) -> Vec<u8> {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{extra_headers}\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    req
}

pub fn get(path: &str, extra_headers: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{extra_headers}\r\n").into_bytes()
}
