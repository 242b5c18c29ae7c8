//! The network namespace of a gvisor sandbox that has an egress policy: made by the host before
//! runsc starts, holding a loopback and the same TUN interface as an `ns` sandbox's (addresses,
//! routes and MTU from `cordon_host::tun`), whose descriptor the host keeps and serves with the
//! egress forwarder. runsc then runs in it with `--network=host`: gVisor's kernel forwards the
//! sandbox's sockets to this namespace, where the only way off loopback is that TUN device.
//!
//! Why not gVisor's own network stack (`--network=sandbox`), which would keep socket calls off
//! the host kernel: the runsc Debian ships (2022-12) refuses to start in it on this kernel, as it
//! takes any new namespace for the host's. What the sandbox can reach is the same either way,
//! because the forwarder, not the stack, decides; what differs is how much of the host's TCP/IP
//! code the sentry's sockets touch (and only inside this namespace, which the sandbox cannot
//! configure: gVisor gives it no CAP_NET_ADMIN on the host, and raw sockets stay off, runsc's
//! `--net-raw` being unset).

use std::fs::File;
use std::os::fd::OwnedFd;

use crate::GvisorError;

/// A network namespace with loopback up and the egress TUN device in it.
pub struct Netns {
    /// `/proc/thread-self/ns/net` of the thread that made it: runsc joins it with setns.
    pub ns: OwnedFd,
    /// The TUN device's descriptor, for the forwarder.
    pub tun: OwnedFd,
}

/// Makes the namespace on a short-lived thread of its own: `unshare(CLONE_NEWNET)` moves only
/// the calling thread, so the rest of the process stays in the host's namespace, and the
/// namespace outlives the thread through the descriptor kept here.
pub fn with_tun() -> Result<Netns, GvisorError> {
    let made = std::thread::Builder::new()
        .name("gvisor-netns".into())
        .spawn(|| -> std::io::Result<Netns> {
            // SAFETY: unshare with a flag word only; it changes this thread's namespace, which
            // no other thread shares, and the thread ends right after.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            cordon_host::sys::loopback_up()?;
            let tun = cordon_host::tun::create()?;
            let ns = File::open("/proc/thread-self/ns/net")?;
            Ok(Netns { ns: ns.into(), tun })
        })
        .map_err(crate::io_err("start the thread that makes the network namespace"))?
        .join()
        .map_err(|_| GvisorError::Setup("the thread making the network namespace panicked".into()))?;
    made.map_err(crate::io_err("make the sandbox's network namespace with its TUN interface"))
}
