//! The host end of a VM's network link as a stream of IP packets: Ethernet frames on a Unix
//! datagram socket, one frame per datagram, whose other end is the VMM's virtio-net backend
//! (QEMU's `-netdev socket,fd=N` on one end of a `socketpair`).
//!
//! Why frames on a socket pair rather than a tap device: a tap's other end is a kernel network
//! device, so a guest packet would enter some kernel's routing (the host's, or a namespace's
//! made for it); on a socket pair it enters nothing but this process, exactly as a sandbox
//! packet off a TUN does on the other tiers. The VMM needs no capability, no device node and no
//! network namespace other than its own empty one. The price is the small link layer a TUN does
//! not need, which is all this file is:
//! - the gateway answers ARP and IPv6 neighbour solicitations for *every* address the guest
//!   asks about (except its own address probes), with one MAC: whatever the guest does to its
//!   routes or addresses, each packet it sends lands here, where the policy is enforced, as on
//!   a TUN;
//! - IPv4 and IPv6 frames lose their Ethernet header and go to the user-space stack; its packets
//!   get one, addressed to the MAC the guest last sent from;
//! - other link-layer traffic (router solicitations, multicast listener reports, other
//!   ethertypes) is dropped, as a link with no router would; a frame too short or inconsistent to
//!   parse is dropped and counted in the sandbox's audit (`ethernet`, `malformed frame`).
//!
//! A guest that floods frames is held back by the socket's buffer (the VMM's virtio queue then
//! stops) and by the forwarder's per-sandbox budgets behind this.

use std::io;
use std::net::Ipv6Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::audit::AuditLog;

/// The gateway's MAC (locally administered, unicast): the only other station on the link.
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0xc0, 0xd0, 0x00, 0x00, 0x01];
const BROADCAST: [u8; 6] = [0xff; 6];
const ETH_HEADER: usize = 14;
const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_ARP: u16 = 0x0806;
const ETHERTYPE_IPV6: u16 = 0x86dd;
const ICMPV6: u8 = 58;
const ND_NEIGHBOR_SOLICIT: u8 = 135;
const ND_NEIGHBOR_ADVERT: u8 = 136;
/// Link-layer frames one read handles before it lets the stack's other work run.
const LINK_ONLY_BATCH: usize = 64;
/// The largest frame read: a 64 KiB IP packet and its header (the link's MTU is just below).
const MAX_FRAME: usize = ETH_HEADER + 65535;

/// A VM's link, read and written as IP packets by the user-space stack.
pub struct EthernetDevice {
    fd: AsyncFd<OwnedFd>,
    /// The guest's MAC as it last sent from it; broadcast until it has sent anything.
    guest: [u8; 6],
    audit: Arc<AuditLog>,
    frame: Vec<u8>,
}

/// What one received frame is.
#[derive(Debug, PartialEq, Eq)]
enum Frame<'a> {
    /// An IP packet for the stack.
    Ip(&'a [u8]),
    /// A frame to answer on the link (ARP or neighbour advertisement), not for the stack.
    Reply(Vec<u8>),
    /// Link-layer traffic with nothing to do.
    Ignored,
    Malformed(&'static str),
}

impl EthernetDevice {
    /// Takes the host end of the socket pair and makes it non-blocking; needs a tokio runtime
    /// with I/O enabled. Malformed frames are counted in `audit`.
    pub fn new(fd: OwnedFd, audit: Arc<AuditLog>) -> io::Result<EthernetDevice> {
        crate::device::set_nonblocking(&fd)?;
        // SAFETY: the AsyncFd owns `fd` outright, so it stays open and the same file for the
        // AsyncFd's whole life.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?;
        Ok(EthernetDevice { fd, guest: BROADCAST, audit, frame: vec![0; MAX_FRAME] })
    }

    /// Sends one frame made of `parts` without blocking.
    fn send(fd: &OwnedFd, parts: &[&[u8]]) -> io::Result<usize> {
        let iov: Vec<libc::iovec> = parts.iter().map(|p| libc::iovec { iov_base: p.as_ptr() as *mut _, iov_len: p.len() }).collect();
        // SAFETY: an all-zero msghdr is valid (no name, no control data); the iovecs point into
        // live slices for the duration of the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_ptr() as *mut _;
        msg.msg_iovlen = iov.len();
        // SAFETY: sendmsg on our descriptor with the message built above.
        let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

fn ethertype(f: &[u8]) -> u16 {
    u16::from_be_bytes([f[12], f[13]])
}

fn header(dst: [u8; 6], ethertype: u16) -> [u8; ETH_HEADER] {
    let mut h = [0u8; ETH_HEADER];
    h[..6].copy_from_slice(&dst);
    h[6..12].copy_from_slice(&GATEWAY_MAC);
    h[12..].copy_from_slice(&ethertype.to_be_bytes());
    h
}

/// Classifies a frame from the guest, making the link-layer answer where one is due.
fn classify(f: &[u8]) -> Frame<'_> {
    if f.len() < ETH_HEADER {
        return Frame::Malformed("shorter than an Ethernet header");
    }
    let (src, body) = (<[u8; 6]>::try_from(&f[6..12]).expect("six bytes"), &f[ETH_HEADER..]);
    match ethertype(f) {
        ETHERTYPE_IPV4 => {
            if body.len() < 20 || body[0] >> 4 != 4 {
                return Frame::Malformed("not an IPv4 packet");
            }
            Frame::Ip(body)
        }
        ETHERTYPE_IPV6 => {
            if body.len() < 40 || body[0] >> 4 != 6 {
                return Frame::Malformed("not an IPv6 packet");
            }
            if body[6] == ICMPV6 && body.len() >= 41 {
                match body[40] {
                    ND_NEIGHBOR_SOLICIT => return neighbour_advert(src, body),
                    // Router solicitations and adverts, redirects, multicast listener reports:
                    // there is no router and no multicast on this link.
                    130..=134 | 136 | 137 | 143 => return Frame::Ignored,
                    _ => {}
                }
            }
            Frame::Ip(body)
        }
        ETHERTYPE_ARP => arp_reply(src, body),
        _ => Frame::Ignored,
    }
}

/// The gateway's answer to an ARP request for any address but the asker's own.
fn arp_reply(src: [u8; 6], arp: &[u8]) -> Frame<'static> {
    if arp.len() < 28 {
        return Frame::Malformed("short ARP packet");
    }
    // Ethernet hardware, IPv4 protocol, 6- and 4-byte addresses.
    if arp[..6] != [0, 1, 0x08, 0x00, 6, 4] {
        return Frame::Malformed("ARP for another hardware or protocol");
    }
    let op = u16::from_be_bytes([arp[6], arp[7]]);
    let (sha, spa, tpa) = (&arp[8..14], &arp[14..18], &arp[24..28]);
    // Replies, gratuitous announcements and address probes (sender 0.0.0.0) need no answer.
    if op != 1 || spa == tpa || spa == [0, 0, 0, 0] {
        return Frame::Ignored;
    }
    let mut out = header(src, ETHERTYPE_ARP).to_vec();
    out.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 2]);
    out.extend_from_slice(&GATEWAY_MAC);
    out.extend_from_slice(tpa);
    out.extend_from_slice(sha);
    out.extend_from_slice(spa);
    Frame::Reply(out)
}

/// The gateway's neighbour advertisement for the target of a solicitation, unless it is a
/// duplicate address probe (from `::`), which must go unanswered.
fn neighbour_advert(src_mac: [u8; 6], ip6: &[u8]) -> Frame<'static> {
    // Header, then type, code, checksum, reserved and the 16-byte target.
    if ip6.len() < 40 + 24 {
        return Frame::Malformed("short neighbour solicitation");
    }
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip6[8..24]).expect("16 bytes"));
    if src.is_unspecified() {
        return Frame::Ignored;
    }
    let target = &ip6[48..64];
    let mut icmp = vec![ND_NEIGHBOR_ADVERT, 0, 0, 0];
    // Router (the guest's default routes go through it), solicited, override.
    icmp.extend_from_slice(&[0xe0, 0, 0, 0]);
    icmp.extend_from_slice(target);
    // Option: target link-layer address (type 2, 8 bytes).
    icmp.extend_from_slice(&[2, 1]);
    icmp.extend_from_slice(&GATEWAY_MAC);
    let from = <[u8; 16]>::try_from(target).expect("16 bytes");
    let sum = icmpv6_checksum(&from, &src.octets(), &icmp);
    icmp[2..4].copy_from_slice(&sum.to_be_bytes());
    let mut out = header(src_mac, ETHERTYPE_IPV6).to_vec();
    out.extend_from_slice(&[0x60, 0, 0, 0]);
    out.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    out.extend_from_slice(&[ICMPV6, 255]);
    out.extend_from_slice(&from);
    out.extend_from_slice(&src.octets());
    out.extend_from_slice(&icmp);
    Frame::Reply(out)
}

fn icmpv6_checksum(src: &[u8; 16], dst: &[u8; 16], msg: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut add = |b: &[u8]| {
        for c in b.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
    };
    add(src);
    add(dst);
    add(&(msg.len() as u32).to_be_bytes());
    add(&[0, 0, 0, ICMPV6]);
    add(msg);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

impl AsyncRead for EthernetDevice {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // Frames handled here without a packet for the stack (answers, drops) in this call: a
        // guest sending only those would otherwise keep the call, and the stack's other work on
        // this thread, from ever returning.
        let mut link_only = 0;
        loop {
            if link_only == LINK_ONLY_BATCH {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            link_only += 1;
            let mut guard = ready!(this.fd.poll_read_ready(cx))?;
            let frame = &mut this.frame;
            let res = guard.try_io(|fd| {
                // SAFETY: reading into our frame buffer, whose length is passed.
                let n = unsafe { libc::recv(fd.as_raw_fd(), frame.as_mut_ptr().cast(), frame.len(), libc::MSG_DONTWAIT) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            // An empty datagram is an empty frame, not the end of the link: a datagram socket
            // pair has no end of stream (a VMM that exits leaves this end quiet; the sandbox's
            // teardown stops the forwarder).
            let n = match res {
                Ok(Ok(n)) => n,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            };
            let f = &this.frame[..n];
            match classify(f) {
                Frame::Ip(packet) => {
                    if packet.len() > buf.remaining() {
                        this.audit.record("ethernet", "-".into(), None, "malformed frame: larger than the link's MTU".into());
                        continue;
                    }
                    this.guest.copy_from_slice(&f[6..12]);
                    buf.put_slice(packet);
                    return Poll::Ready(Ok(()));
                }
                Frame::Reply(out) => {
                    // A full socket loses the answer, as a busy link would; the guest asks again.
                    let _ = Self::send(this.fd.get_ref(), &[&out]);
                }
                Frame::Ignored => {}
                Frame::Malformed(why) => this.audit.record("ethernet", "-".into(), None, format!("malformed frame: {why}")),
            }
        }
    }
}

impl AsyncWrite for EthernetDevice {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let kind = match data.first().map(|b| b >> 4) {
            Some(4) => ETHERTYPE_IPV4,
            Some(6) => ETHERTYPE_IPV6,
            _ => return Poll::Ready(Ok(data.len())),
        };
        let head = header(this.guest, kind);
        loop {
            let mut guard = ready!(this.fd.poll_write_ready(cx))?;
            match guard.try_io(|fd| Self::send(fd.get_ref(), &[&head, data])) {
                Ok(Ok(_)) => return Poll::Ready(Ok(data.len())),
                // The VMM is gone or the frame too big for the socket: drop it, as a link would,
                // rather than end the stack.
                Ok(Err(e)) if matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNREFUSED | libc::EMSGSIZE)) => {
                    return Poll::Ready(Ok(data.len()))
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const GUEST: [u8; 6] = [0x02, 0, 0, 0, 0, 0x42];

    fn frame(ethertype: u16, body: &[u8]) -> Vec<u8> {
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&GUEST);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(body);
        f
    }

    fn arp_request(spa: Ipv4Addr, tpa: Ipv4Addr) -> Vec<u8> {
        let mut a = vec![0, 1, 0x08, 0x00, 6, 4, 0, 1];
        a.extend_from_slice(&GUEST);
        a.extend_from_slice(&spa.octets());
        a.extend_from_slice(&[0; 6]);
        a.extend_from_slice(&tpa.octets());
        frame(ETHERTYPE_ARP, &a)
    }

    #[test]
    fn arp_for_any_other_address_is_answered_with_the_gateways_mac() {
        for target in [Ipv4Addr::new(10, 0, 2, 1), Ipv4Addr::new(192, 168, 7, 1)] {
            let Frame::Reply(r) = classify(&arp_request(Ipv4Addr::new(10, 0, 2, 100), target)) else { panic!("no reply for {target}") };
            assert_eq!(&r[..6], &GUEST);
            assert_eq!(ethertype(&r), ETHERTYPE_ARP);
            let arp = &r[ETH_HEADER..];
            assert_eq!(&arp[6..8], &[0, 2]);
            assert_eq!(&arp[8..14], &GATEWAY_MAC);
            assert_eq!(&arp[14..18], &target.octets());
            assert_eq!(&arp[18..24], &GUEST);
            assert_eq!(&arp[24..28], &[10, 0, 2, 100]);
        }
    }

    #[test]
    fn address_probes_and_announcements_are_not_answered() {
        assert_eq!(classify(&arp_request(Ipv4Addr::UNSPECIFIED, Ipv4Addr::new(10, 0, 2, 100))), Frame::Ignored);
        assert_eq!(classify(&arp_request(Ipv4Addr::new(10, 0, 2, 100), Ipv4Addr::new(10, 0, 2, 100))), Frame::Ignored);
    }

    fn solicitation(src: Ipv6Addr, target: Ipv6Addr) -> Vec<u8> {
        let mut icmp = vec![ND_NEIGHBOR_SOLICIT, 0, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(&target.octets());
        let mut ip = vec![0x60, 0, 0, 0];
        ip.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
        ip.extend_from_slice(&[ICMPV6, 255]);
        ip.extend_from_slice(&src.octets());
        ip.extend_from_slice(&"ff02::1:ff00:1".parse::<Ipv6Addr>().unwrap().octets());
        ip.extend_from_slice(&icmp);
        frame(ETHERTYPE_IPV6, &ip)
    }

    #[test]
    fn neighbour_solicitations_get_a_valid_advertisement() {
        let (guest, gw): (Ipv6Addr, Ipv6Addr) = ("fd00:c0:d0::100".parse().unwrap(), "fd00:c0:d0::1".parse().unwrap());
        let Frame::Reply(r) = classify(&solicitation(guest, gw)) else { panic!("no advertisement") };
        assert_eq!(&r[..6], &GUEST);
        let ip = &r[ETH_HEADER..];
        assert_eq!(ip[6], ICMPV6);
        assert_eq!(ip[7], 255, "neighbour discovery needs hop limit 255");
        assert_eq!(&ip[8..24], &gw.octets());
        assert_eq!(&ip[24..40], &guest.octets());
        let icmp = &ip[40..];
        assert_eq!(icmp[0], ND_NEIGHBOR_ADVERT);
        assert_eq!(&icmp[8..24], &gw.octets());
        assert_eq!(&icmp[26..32], &GATEWAY_MAC);
        // A message with its checksum in place sums to zero.
        assert_eq!(icmpv6_checksum(&gw.octets(), &guest.octets(), icmp), 0);
        // Duplicate address detection (from ::) stays unanswered.
        assert_eq!(classify(&solicitation(Ipv6Addr::UNSPECIFIED, guest)), Frame::Ignored);
    }

    #[test]
    fn ip_frames_lose_their_header_and_garbage_is_malformed() {
        let mut v4 = vec![0x45; 20];
        v4[1] = 0;
        assert_eq!(classify(&frame(ETHERTYPE_IPV4, &v4)), Frame::Ip(&v4[..]));
        assert!(matches!(classify(&frame(ETHERTYPE_IPV4, &[0x45; 3])), Frame::Malformed(_)));
        assert!(matches!(classify(&frame(ETHERTYPE_IPV6, &[0x45; 40])), Frame::Malformed(_)));
        assert!(matches!(classify(&[1, 2, 3]), Frame::Malformed(_)));
        assert!(matches!(classify(&[]), Frame::Malformed(_)));
        assert!(matches!(classify(&frame(ETHERTYPE_ARP, &[0; 5])), Frame::Malformed(_)));
        assert_eq!(classify(&frame(0x88cc, &[0; 40])), Frame::Ignored);
    }
}
