//! The per-flow decisions: what each TCP connection, UDP datagram and other packet the sandbox
//! sends gets.

use crate::guard;
use crate::sniff::{sniff, Sniffed, MAX_PEEK};
use crate::Shared;
use cordon_spec::{NetworkPolicy, Target, Verdict};
use ipstack::{IpNumber, IpStack, IpStackConfig, IpStackStream, IpStackTcpStream, IpStackUdpStream, TcpConfig, TcpOptions};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a connection may stay silent before we decide it names no host (server-speaks-first
/// protocols such as SSH or SMTP wait this long once, when no address rule already allows them).
const PEEK_WAIT: Duration = Duration::from_millis(1000);
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes ipstack holds for one connection's unread data from the sandbox; its receive window
/// follows what is left of this (see vendor/ipstack), so a destination that does not read
/// stops the sandbox's sender instead of growing the forwarder.
const TCP_READ_BUFFER: usize = 1 << 16;
/// IP and TCP headers of a segment at most (IPv6's 40 and TCP's 20, options aside): the MSS is
/// the MTU less these, for either family.
const TCP_IP_HEADERS: u16 = 60;
/// The copy buffer from a destination toward the sandbox: one MSS of the link every tier uses
/// (`cordon_host::tun::MTU`), so that a full read goes out as one segment and not as one and a
/// sliver.
const COPY_TOWARD_SANDBOX: usize = (cordon_host::tun::MTU - TCP_IP_HEADERS) as usize;
/// Open TCP connections per sandbox; each holds at most [`TCP_READ_BUFFER`] of unread data,
/// ipstack's [`MAX_UNACKED`] of data toward the sandbox and a copy buffer each way.
pub(crate) const MAX_TCP_FLOWS: usize = 256;
/// Bytes sent toward the sandbox and not yet acknowledged, per connection.
const MAX_UNACKED: u32 = 1 << 20;
/// UDP flows (source ports) to the gateway's DNS per sandbox.
pub(crate) const MAX_UDP_FLOWS: usize = 64;
/// DNS questions being answered at once per sandbox (UDP and TCP together); a question that
/// finds none free is dropped, and the sandbox's resolver asks again, as it would of a busy
/// server. The reading goes on meanwhile, so a slow upstream never lets datagrams pile up.
pub(crate) const MAX_DNS_INFLIGHT: usize = 32;
/// The largest DNS question over UDP read whole (EDNS's usual buffer size).
const DNS_UDP_MAX: usize = 4096;

pub(crate) async fn serve<D>(device: D, mtu: u16, shared: Arc<Shared>)
where
    D: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut cfg = IpStackConfig::default();
    if cfg.mtu(mtu).is_err() {
        cfg.mtu_unchecked(mtu);
    }
    cfg.udp_timeout(Duration::from_secs(30));
    let mut tcp_cfg = TcpConfig::default();
    tcp_cfg.timeout = Duration::from_secs(600);
    // ipstack's defaults (16 KiB in flight, 16 KiB of receive buffer) cap a download at about
    // 50 MB/s here; the sandbox's kernel is a fast, lossless peer, so keep more in flight.
    tcp_cfg.max_unacked_bytes = MAX_UNACKED;
    tcp_cfg.read_buffer_size = TCP_READ_BUFFER;
    // Without an MSS in the SYN-ACK the sandbox's kernel sends 536-byte segments.
    tcp_cfg.options = Some(vec![TcpOptions::MaximumSegmentSize(mtu.saturating_sub(TCP_IP_HEADERS))]);
    cfg.with_tcp_config(tcp_cfg);
    let mut stack = IpStack::new(cfg, device);
    loop {
        let flow = match stack.accept().await {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!("egress stack ended: {e}");
                return;
            }
        };
        let shared = shared.clone();
        match flow {
            IpStackStream::Tcp(s) => {
                let Ok(permit) = shared.tcp_flows.clone().try_acquire_owned() else {
                    let mut s = s;
                    shared.audit.record("tcp", s.peer_addr().to_string(), None, format!("more than {MAX_TCP_FLOWS} connections open at once"));
                    s.reset();
                    continue;
                };
                tokio::spawn(async move {
                    tcp(shared, s).await;
                    drop(permit);
                });
            }
            IpStackStream::Udp(s) => {
                tokio::spawn(udp(shared, s));
            }
            IpStackStream::UnknownTransport(u) => {
                let dst = u.dst_addr();
                // The kernel's own multicast chatter (MLD, router solicitation) is no attempt.
                if dst.is_multicast() {
                    continue;
                }
                let proto = match u.ip_protocol() {
                    IpNumber::ICMP => "icmp".to_string(),
                    IpNumber::IPV6_ICMP => "icmpv6".to_string(),
                    n => format!("ip-proto-{}", n.0),
                };
                shared.audit.record(&proto, dst.to_string(), None, "only TCP and DNS leave the sandbox".into());
            }
            IpStackStream::UnknownNetwork(_) => {}
        }
    }
}

async fn udp(shared: Arc<Shared>, mut s: IpStackUdpStream) {
    let dst = s.peer_addr();
    if !(shared.is_gateway(dst.ip()) && dst.port() == 53) {
        if !dst.ip().is_multicast() {
            shared.audit.record("udp", dst.to_string(), None, "UDP goes only to the gateway's DNS".into());
            // Fail the sender's socket at once rather than let it wait for an answer.
            let _ = s.reject();
        }
        return;
    }
    let Ok(_flow) = shared.udp_flows.clone().try_acquire_owned() else {
        shared.audit.record("udp", dst.to_string(), None, format!("more than {MAX_UDP_FLOWS} DNS flows at once"));
        return;
    };
    // Answers come back through a short queue: each question is answered in its own task
    // (holding one of the sandbox's DNS permits), so this loop keeps reading while the
    // upstream is slow, and what it reads is either taken or dropped, never queued.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(8);
    let mut buf = vec![0u8; DNS_UDP_MAX];
    loop {
        tokio::select! {
            r = s.read(&mut buf) => {
                let n = match r {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let Ok(permit) = shared.dns_inflight.clone().try_acquire_owned() else { continue };
                let (shared, query, tx) = (shared.clone(), buf[..n].to_vec(), tx.clone());
                tokio::spawn(async move {
                    let policy = shared.policy();
                    if let Some(reply) = shared.dns.answer(&query, &policy, &shared.audit, dst).await {
                        let _ = tx.try_send(reply);
                    }
                    drop(permit);
                });
            }
            Some(reply) = rx.recv() => {
                if s.write_all(&reply).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// DNS over TCP: two-byte length, message, repeated.
async fn dns_tcp(shared: Arc<Shared>, mut s: IpStackTcpStream, dst: SocketAddr) {
    loop {
        let mut len = [0u8; 2];
        if s.read_exact(&mut len).await.is_err() {
            return;
        }
        let mut msg = vec![0u8; u16::from_be_bytes(len) as usize];
        if s.read_exact(&mut msg).await.is_err() {
            return;
        }
        let policy = shared.policy();
        // One question at a time per connection, and the connection count is bounded; the
        // sandbox-wide permit bounds the lookups all of them start.
        let Ok(_permit) = shared.dns_inflight.clone().acquire_owned().await else { return };
        let Some(reply) = shared.dns.answer(&msg, &policy, &shared.audit, dst).await else { return };
        let mut out = (reply.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(&reply);
        if s.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// Reads the connection's first bytes until they name a host, say they never will, or the
/// sandbox stays silent for [`PEEK_WAIT`].
async fn peek(s: &mut IpStackTcpStream, buf: &mut Vec<u8>) -> Sniffed {
    let deadline = tokio::time::Instant::now() + PEEK_WAIT;
    let mut chunk = vec![0u8; 4096];
    loop {
        let n = match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Ok(Ok(n)) => n,
            Ok(Err(_)) | Err(_) => return Sniffed::Nameless,
        };
        if n == 0 {
            return Sniffed::Nameless;
        }
        buf.extend_from_slice(&chunk[..n]);
        match sniff(buf) {
            Sniffed::Incomplete if buf.len() < MAX_PEEK => continue,
            Sniffed::Incomplete => return Sniffed::Nameless,
            done => return done,
        }
    }
}

fn deny_reason(v: &Verdict, what: &str) -> String {
    match v {
        Verdict::Deny(r) => format!("{what} denied by rule {r}"),
        _ => format!("no rule allows {what}"),
    }
}

/// Where a connection may go, or why it may not.
async fn decide(shared: &Shared, policy: &NetworkPolicy, dst: SocketAddr, name: Option<&str>) -> Result<Vec<SocketAddr>, String> {
    let host = guard::host_addresses();
    let port = dst.port();
    if let Some(name) = name {
        match policy.check_name(name, port) {
            Verdict::Allow(_) => {
                let addrs = shared.dns.resolve(name).await?;
                let mut refusals = Vec::new();
                let ok: Vec<SocketAddr> = addrs
                    .into_iter()
                    .filter(|ip| match guard::refusal(*ip, policy, &host) {
                        Some(r) => {
                            refusals.push(r);
                            false
                        }
                        None => true,
                    })
                    .map(|ip| SocketAddr::new(ip, port))
                    .collect();
                if ok.is_empty() {
                    return Err(format!("{name} resolves only to refused addresses: {}", refusals.join("; ")));
                }
                return Ok(ok);
            }
            v @ Verdict::Deny(_) => return Err(deny_reason(&v, &format!("{name}:{port}"))),
            Verdict::NoRule => {}
        }
    }
    let by_ip = policy.check_ip(dst.ip(), port);
    let allowed = by_ip.allowed()
        || (matches!(by_ip, Verdict::NoRule)
            && shared.dns.name_of(dst.ip()).is_some_and(|n| policy.check_name(&n, port).allowed()));
    if !allowed {
        let what = match name {
            Some(n) => format!("{n}:{port} or {dst}"),
            None => dst.to_string(),
        };
        return Err(deny_reason(&by_ip, &what));
    }
    if let Some(r) = guard::refusal(dst.ip(), policy, &host) {
        return Err(r);
    }
    Ok(vec![dst])
}

async fn tcp(shared: Arc<Shared>, mut s: IpStackTcpStream) {
    let dst = s.peer_addr();
    if shared.is_gateway(dst.ip()) {
        if dst.port() == 53 {
            dns_tcp(shared, s, dst).await;
        } else {
            shared.audit.record("tcp", dst.to_string(), None, "the gateway serves only DNS".into());
            s.reset();
        }
        return;
    }
    let policy = shared.policy();
    // Skip naming (and its wait for server-first protocols) when the address alone settles it
    // and no name rule could still deny.
    let name_denies = policy.deny.iter().any(|r| !matches!(r.target, Target::Cidr(_)));
    let ip_ok = policy.check_ip(dst.ip(), dst.port()).allowed()
        || shared.dns.name_of(dst.ip()).is_some_and(|n| policy.check_name(&n, dst.port()).allowed());
    // Without a name rule that could allow it, a connection the address does not allow is
    // refused before anything is read (its connect fails at once).
    let name_allows = policy.allow.iter().any(|r| !matches!(r.target, Target::Cidr(_)));
    // With injection rules every connection is named (however its address is judged): a
    // connection to a host with a rule must be recognised to be terminated.
    let may_inject = !policy.transforms.is_empty() && shared.intercept.is_some();
    let mut first = Vec::new();
    let skip_naming = !may_inject && ((ip_ok && !name_denies) || (!ip_ok && !name_allows));
    let sniffed = if skip_naming { Sniffed::Nameless } else { peek(&mut s, &mut first).await };
    let name = match &sniffed {
        Sniffed::Name(n) => Some(n.as_str()),
        _ => None,
    };
    let targets = match decide(&shared, &policy, dst, name).await {
        Ok(t) => {
            shared.audit.allowed();
            t
        }
        Err(reason) => {
            shared.audit.record("tcp", dst.to_string(), name.map(str::to_string), reason);
            s.reset();
            return;
        }
    };
    if let (Some(n), Some(icpt)) = (name, shared.intercept.clone()) {
        if policy.transforms.for_host(n).is_some() {
            let (n, tls) = (n.to_string(), first.first() == Some(&0x16));
            crate::intercept::serve(shared, icpt, s, first, n, targets, tls).await;
            return;
        }
    }
    // As the destination itself would answer a refused or unreachable connect.
    let Ok(mut up) = dial(&targets).await else {
        s.reset();
        return;
    };
    tracing::debug!(%dst, ?name, to = ?up.peer_addr().ok(), "egress connection");
    if !first.is_empty() && up.write_all(&first).await.is_err() {
        return;
    }
    splice(s, up).await;
}

/// Connects to the first of `targets` that answers (each within [`DIAL_TIMEOUT`]), with
/// Nagle off; otherwise says what the last one did.
pub(crate) async fn dial(targets: &[SocketAddr]) -> Result<TcpStream, String> {
    let mut last = String::from("no address to dial");
    for t in targets {
        match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(t)).await {
            Ok(Ok(c)) => {
                let _ = c.set_nodelay(true);
                return Ok(c);
            }
            Ok(Err(e)) => last = format!("{t}: {e}"),
            Err(_) => last = format!("{t}: timed out"),
        }
        tracing::debug!(%t, "dial failed: {last}");
    }
    Err(last)
}

/// Copies both ways until both sides have finished, passing each side's end of stream on.
///
/// Not `copy_bidirectional`: ipstack's `poll_shutdown` sends the FIN only once everything
/// written is acknowledged and is not woken again when that happens (see [`close_toward`]).
async fn splice(s: IpStackTcpStream, up: TcpStream) {
    let (mut sr, mut sw) = tokio::io::split(s);
    let (ur, mut uw) = up.into_split();
    let out = async {
        let _ = tokio::io::copy(&mut sr, &mut uw).await;
        let _ = uw.shutdown().await;
    };
    let back = async {
        // One read, one segment toward the sandbox: `copy`'s 8 KiB buffer would cut a download
        // into 8 KiB segments whatever the link's MTU, and each segment costs the stack alike.
        let mut ur = tokio::io::BufReader::with_capacity(COPY_TOWARD_SANDBOX, ur);
        let _ = tokio::io::copy_buf(&mut ur, &mut sw).await;
        close_toward(&mut sw).await;
    };
    tokio::join!(out, back);
}

/// Polls the shutdown toward the sandbox until the session is closed (or 10 s pass).
///
/// ipstack sends the FIN from `poll_shutdown` only when nothing written is unacknowledged, and
/// the acknowledgement that makes it so wakes nobody: the shutdown has to be polled again. The
/// sandbox's kernel acknowledges within microseconds (it is on this host), so the first retries
/// only yield, letting the stack's tasks take that acknowledgement in; then every millisecond;
/// then, once the FIN has surely gone and only the close is awaited, every 10 ms. A fixed 10 ms
/// retry held the end of every response back by 10 ms whenever the first poll came before the
/// acknowledgement (the bench's per-connection latency: +11.7 ms at p50).
async fn close_toward<W: tokio::io::AsyncWrite + Unpin>(sw: &mut W) {
    let deadline = tokio::time::Instant::now() + SHUTDOWN_DEADLINE;
    for attempt in 0u32.. {
        // One poll, whatever it returns: this loop decides when to poll again.
        let done = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *sw).poll_shutdown(cx).is_ready())).await;
        if done || tokio::time::Instant::now() >= deadline {
            return;
        }
        match shutdown_retry(attempt) {
            None => tokio::task::yield_now().await,
            Some(d) => tokio::time::sleep(d).await,
        }
    }
}

/// How long to wait before polling a shutdown toward the sandbox again after its `attempt`-th
/// unfinished poll (`None`: only yield); see [`close_toward`].
pub(crate) fn shutdown_retry(attempt: u32) -> Option<Duration> {
    match attempt {
        0..SHUTDOWN_YIELDS => None,
        SHUTDOWN_YIELDS..SHUTDOWN_FAST => Some(Duration::from_millis(1)),
        _ => Some(Duration::from_millis(10)),
    }
}

/// How long a shutdown toward the sandbox is retried at most.
pub(crate) const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);
/// Retries of the shutdown that only yield to the runtime, then up to this many that wait 1 ms.
const SHUTDOWN_YIELDS: u32 = 32;
const SHUTDOWN_FAST: u32 = SHUTDOWN_YIELDS + 20;
