//! The sandbox's one network interface when it has an egress policy: a TUN device, created by
//! the jailer (host root, in the sandbox's network namespace, before the init is cloned), whose
//! descriptor goes back to the host. Every packet the sandbox sends off loopback arrives at the
//! host process that holds that descriptor and nowhere else: there is no veth, no bridge, no
//! host route and no NAT, so the host's routing never sees a sandbox packet.
//!
//! Addressing is the same in every sandbox (each has its own namespace): the sandbox is
//! 10.0.2.100/24 and fd00:c0:d0::100/64, the virtual gateway (where the forwarder answers DNS)
//! 10.0.2.1 and fd00:c0:d0::1, with default routes through it.
//!
//! Plain ioctls rather than netlink: five fixed steps do not justify a netlink stack in the
//! jailer, which must stay a small single-threaded program.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

pub const IFNAME: &str = "eth0";
pub const SANDBOX_V4: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 100);
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 1);
pub const PREFIX_V4: u8 = 24;
pub const SANDBOX_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc0, 0xd0, 0, 0, 0, 0, 0x100);
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc0, 0xd0, 0, 0, 0, 0, 1);
pub const PREFIX_V6: u8 = 64;
/// Large frames cost the user-space stack less per byte, and the sandbox never sees a real link:
/// near the largest IP packet, so that a read of nearly 64 KiB from a destination is one segment
/// toward the sandbox (the forwarder reads one MSS at a time).
pub const MTU: u16 = 65000;

/// The sandbox's /etc/resolv.conf: the gateway, where the forwarder answers DNS.
pub fn resolv_conf() -> String {
    format!("nameserver {GATEWAY_V4}\nnameserver {GATEWAY_V6}\noptions timeout:2 attempts:2\n")
}

const RTF_UP: u16 = 0x1;
const RTF_GATEWAY: u16 = 0x2;

/// `struct rtentry` of <net/route.h> (glibc's libc crate does not export it).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

/// `struct in6_rtmsg` of <linux/ipv6_route.h> (libc's has private fields).
#[repr(C)]
struct In6RtMsg {
    dst: libc::in6_addr,
    src: libc::in6_addr,
    gateway: libc::in6_addr,
    kind: u32,
    dst_len: u16,
    src_len: u16,
    metric: u32,
    info: libc::c_ulong,
    flags: u32,
    ifindex: libc::c_int,
}

fn check(r: libc::c_int, what: &str) -> io::Result<()> {
    if r < 0 {
        let e = io::Error::last_os_error();
        tracing::debug!("{what}: {e}");
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    tracing::debug!("{what}: ok");
    Ok(())
}

fn socket(family: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: a plain datagram socket used only for interface ioctls.
    let s = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    check(s, "socket for interface setup")?;
    // SAFETY: fresh fd from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(s) })
}

fn ifreq() -> libc::ifreq {
    // SAFETY: an all-zero ifreq is valid; the name is copied in with its NUL in range.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, b) in req.ifr_name.iter_mut().zip(IFNAME.bytes()) {
        *d = b as libc::c_char;
    }
    req
}

fn sockaddr_v4(a: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(a).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size on Linux; this is how the C API
    // passes IPv4 addresses in ifreq and rtentry.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ioctl<T>(fd: &OwnedFd, req: libc::Ioctl, arg: &mut T, what: &str) -> io::Result<()> {
    // SAFETY: `arg` is the structure this request expects, valid for the call.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), req, arg as *mut T) }, what)
}

/// A descriptor attached to the TUN device `eth0` of the current network namespace, which
/// this makes when there is none.
fn attach() -> io::Result<OwnedFd> {
    let path = c"/dev/net/tun";
    // SAFETY: static path; the returned fd is new and ours.
    let fd: RawFd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    check(fd, "open /dev/net/tun (is the tun module loaded?)")?;
    // SAFETY: fresh fd from the kernel.
    let tun = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = ifreq();
    req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
    ioctl(&tun, libc::TUNSETIFF, &mut req, "TUNSETIFF eth0")?;
    Ok(tun)
}

/// Creates the TUN device in the current network namespace, addresses it, routes everything
/// through it, and returns its descriptor (close-on-exec, so it can never reach the sandbox).
pub fn create() -> io::Result<OwnedFd> {
    let tun = attach()?;
    // Persistent: closing the last descriptor (the forwarder's, at teardown) then leaves the
    // device to its namespace, whose end (once the sandbox's last process and the descriptor
    // are gone) removes it in the kernel's batched cleanup. Not persistent, the close itself
    // unregisters the device and waits for the network stack to let go of it: 20-35 ms of
    // every networked sandbox's teardown.
    // SAFETY: TUNSETPERSIST takes its argument by value; the descriptor is ours.
    check(unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) }, "TUNSETPERSIST eth0")?;
    address(None)?;
    Ok(tun)
}

/// Attaches a new descriptor to the TUN device that [`create`] made in the network namespace
/// of process `pid` (a sandbox's), addresses and routes untouched: how the host takes a
/// sandbox's link back after the process that held it exited (the device is persistent, so it
/// outlived that descriptor with the sandbox's namespace). The namespace is entered by a
/// thread of its own, which ends afterwards: the caller's threads never change namespace.
pub fn reattach(pid: libc::pid_t) -> io::Result<OwnedFd> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::Builder::new()
        .name("tun-reattach".into())
        .spawn(move || -> io::Result<OwnedFd> {
            // SAFETY: setns on a namespace descriptor we opened; it changes this thread alone.
            check(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, "setns into the sandbox's network namespace")?;
            attach()
        })?
        .join()
        .map_err(|_| io::Error::other("the TUN reattach thread panicked"))?
}

/// Sets the MAC of the Ethernet interface `eth0` (a VM's; up or not).
pub fn set_mac(mac: [u8; 6]) -> io::Result<()> {
    set_mac_with(&socket(libc::AF_INET)?, mac)
}

fn set_mac_with(s4: &OwnedFd, mac: [u8; 6]) -> io::Result<()> {
    let mut req = ifreq();
    // SAFETY: an all-zero sockaddr is valid; the family and the first six data bytes are set.
    let mut hw: libc::sockaddr = unsafe { std::mem::zeroed() };
    hw.sa_family = libc::ARPHRD_ETHER;
    for (d, b) in hw.sa_data.iter_mut().zip(mac) {
        *d = b as libc::c_char;
    }
    req.ifr_ifru.ifru_hwaddr = hw;
    ioctl(s4, libc::SIOCSIFHWADDR, &mut req, "SIOCSIFHWADDR eth0")
}

/// Gives `eth0` the sandbox's addresses, MTU and default routes through the gateway, as every
/// tier has them: a TUN device made by [`create`], or a VM's virtio-net interface, which is
/// given `mac` first. An Ethernet interface skips IPv6 duplicate detection, as a TUN does: the
/// link has one other end, the forwarder, and the address is usable at once.
pub fn address(mac: Option<[u8; 6]>) -> io::Result<()> {
    let s4 = socket(libc::AF_INET)?;
    if let Some(mac) = mac {
        set_mac_with(&s4, mac)?;
        let _ = std::fs::write("/proc/sys/net/ipv6/conf/eth0/accept_dad", "0");
    }
    let mut req = ifreq();
    req.ifr_ifru.ifru_mtu = MTU as libc::c_int;
    ioctl(&s4, libc::SIOCSIFMTU, &mut req, "SIOCSIFMTU eth0")?;
    let mut req = ifreq();
    req.ifr_ifru.ifru_addr = sockaddr_v4(SANDBOX_V4);
    ioctl(&s4, libc::SIOCSIFADDR, &mut req, "SIOCSIFADDR eth0")?;
    let mut req = ifreq();
    req.ifr_ifru.ifru_netmask = sockaddr_v4(Ipv4Addr::from(u32::MAX << (32 - PREFIX_V4)));
    ioctl(&s4, libc::SIOCSIFNETMASK, &mut req, "SIOCSIFNETMASK eth0")?;
    let mut req = ifreq();
    ioctl(&s4, libc::SIOCGIFFLAGS, &mut req, "SIOCGIFFLAGS eth0")?;
    // SAFETY: the flags member was just written by the kernel.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    ioctl(&s4, libc::SIOCSIFFLAGS, &mut req, "SIOCSIFFLAGS eth0 up")?;
    let mut req = ifreq();
    ioctl(&s4, libc::SIOCGIFINDEX, &mut req, "SIOCGIFINDEX eth0")?;
    // SAFETY: the index member was just written by the kernel.
    let ifindex = unsafe { req.ifr_ifru.ifru_ifindex };

    let mut dev = *b"eth0\0";
    // SAFETY: all-zero is a valid rtentry (null pointers, zero addresses); fields set below.
    let mut rt: RtEntry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr_v4(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr_v4(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr_v4(GATEWAY_V4);
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    rt.rt_dev = dev.as_mut_ptr().cast();
    ioctl(&s4, libc::SIOCADDRT, &mut rt, "SIOCADDRT default via 10.0.2.1")?;

    // IPv6: TUN devices are NOARP, so the address skips duplicate detection and is usable at
    // once (an Ethernet one had it turned off above). A host with IPv6 disabled gets an
    // IPv4-only sandbox rather than a failed one.
    let s6 = match socket(libc::AF_INET6) {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!("no IPv6 in the sandbox: {e}");
            return Ok(());
        }
    };
    let mut a6 = libc::in6_ifreq {
        ifr6_addr: libc::in6_addr { s6_addr: SANDBOX_V6.octets() },
        ifr6_prefixlen: PREFIX_V6 as u32,
        ifr6_ifindex: ifindex,
    };
    if let Err(e) = ioctl(&s6, libc::SIOCSIFADDR, &mut a6, "SIOCSIFADDR eth0 v6") {
        tracing::debug!("no IPv6 in the sandbox: {e}");
        return Ok(());
    }
    let mut r6 = In6RtMsg {
        dst: libc::in6_addr { s6_addr: [0; 16] },
        src: libc::in6_addr { s6_addr: [0; 16] },
        gateway: libc::in6_addr { s6_addr: GATEWAY_V6.octets() },
        kind: 0,
        dst_len: 0,
        src_len: 0,
        metric: 1,
        info: 0,
        flags: (RTF_UP | RTF_GATEWAY) as u32,
        ifindex,
    };
    ioctl(&s6, libc::SIOCADDRT, &mut r6, "SIOCADDRT default via fd00:c0:d0::1")?;
    // No router solicitations or other chatter of the kernel's own on the wire.
    let _ = std::fs::write("/proc/sys/net/ipv6/conf/eth0/router_solicitations", "0");
    Ok(())
}
