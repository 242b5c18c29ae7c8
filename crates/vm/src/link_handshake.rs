//! The first bytes on the agent link, before the multiplexed streams begin: the sandbox's
//! configuration and the time. Keeping the config on the link (rather than the kernel command
//! line, which is limited to 2 KiB and visible in /proc/cmdline to every process) also lets a
//! VM restored from a snapshot receive its identity after the fact.
//!
//! The exchange, guest first:
//! 1. guest: `R`, "ready for the config" (a snapshot is taken right after it, see
//!    [`crate::snapshot`]);
//! 2. host: a 4-byte little-endian length, then that many bytes of JSON ([`GuestConfig`]);
//! 3. guest: `T`, "the time, now";
//! 4. host: seconds and nanoseconds since the epoch (u64 and u32, little-endian).
//!
//! The time comes last and on request because a cold guest reads the config seconds after the
//! host could have sent it, and a restored one reads it in a state saved long before: either
//! way only a fresh answer sets the guest's clock right. A restored guest said `R` before its
//! snapshot was taken, so the host sends its config without waiting for it.
//!
//! A running guest can also be parked and resumed (a pause, a fork: the VM is saved while
//! parked), as `cordon_agent::park` describes; on a wake the host follows [`RESUME`] with the
//! config as in step 2 above (a fork's own hostname and seed; the agent's processes are kept
//! either way), then the time as in steps 3 and 4.

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Largest config accepted: bounds what a broken host side could make the guest allocate.
const MAX: usize = 1 << 20;
pub const READY: u8 = b'R';
pub use cordon_agent::{await_parked, PARKED, RESUME};
pub const TIME: u8 = b'T';

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct GuestConfig {
    pub hostname: String,
    pub agent: cordon_agent::AgentConfig,
    /// Fresh randomness from the host, mixed into the guest's kernel RNG, which then reseeds:
    /// VMs restored from one snapshot would otherwise share the RNG state it holds.
    #[serde(default)]
    pub seed: Vec<u8>,
    /// Volumes shared by the host over virtio-fs, mounted at their paths before the agent starts.
    #[serde(default)]
    pub volumes: Vec<GuestVolume>,
    /// The network interface's settings, when the VM has one (it has an egress policy).
    #[serde(default)]
    pub network: Option<GuestNetwork>,
}

/// What the guest sets on its interface; addresses, routes and resolver are every tier's
/// (`cordon_host::tun`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct GuestNetwork {
    /// This VM's own MAC (locally administered, unicast).
    pub mac: [u8; 6],
    /// The egress CA (PEM) to add to the guest's trust, when the policy injects headers.
    pub egress_ca: Option<String>,
}

/// A virtio-fs share (its tag) and where it goes.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct GuestVolume {
    pub tag: String,
    pub target: String,
    pub read_only: bool,
}

pub fn encode(cfg: &GuestConfig) -> Vec<u8> {
    let json = serde_json::to_vec(cfg).expect("config serialises");
    let mut out = (json.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out
}

fn expect_byte(r: &mut impl Read, want: u8) -> io::Result<()> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    if b[0] != want {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("expected {:?} from the guest, got byte {}", want as char, b[0])));
    }
    Ok(())
}

/// Host: waits for the guest's `R`.
pub fn await_ready(link: &mut impl Read) -> io::Result<()> {
    expect_byte(link, READY)
}

/// Host: the rest of the exchange, from the config on (after [`await_ready`] for a fresh boot).
pub fn send(link: &mut (impl Read + Write), cfg: &GuestConfig) -> io::Result<()> {
    link.write_all(&encode(cfg))?;
    expect_byte(link, TIME)?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let mut t = now.as_secs().to_le_bytes().to_vec();
    t.extend_from_slice(&now.subsec_nanos().to_le_bytes());
    link.write_all(&t)
}

/// Host: wakes a parked guest (restored or not) with `cfg` and the time.
pub fn resume(link: &mut (impl Read + Write), cfg: &GuestConfig) -> io::Result<()> {
    link.write_all(RESUME)?;
    send(link, cfg)
}

/// Guest: says it is parked, then waits (for as long as it takes: the VM may be saved
/// meanwhile) for the host's [`RESUME`], and reads the config and the time that follow.
pub fn park(fd: &OwnedFd) -> io::Result<(GuestConfig, SystemTime)> {
    blocking(fd)?;
    let mut f = FdReader(fd);
    f.write_all(PARKED)?;
    cordon_agent::await_resume(&mut f)?;
    finish(fd)
}

/// Clears `O_NONBLOCK`, which a link driven by the reactor set on the port.
fn blocking(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl with integer arguments on an open descriptor.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Guest: the whole exchange on the (still blocking) port; returns the config and the host's
/// time.
pub fn receive(fd: &OwnedFd) -> io::Result<(GuestConfig, SystemTime)> {
    let mut f = FdReader(fd);
    f.write_all(&[READY])?;
    finish(fd)
}

/// Guest: the config, then the time.
fn finish(fd: &OwnedFd) -> io::Result<(GuestConfig, SystemTime)> {
    let mut f = FdReader(fd);
    let cfg = read(fd)?;
    f.write_all(&[TIME])?;
    let mut t = [0u8; 12];
    read_exact_patient(&mut f, &mut t)?;
    let secs = u64::from_le_bytes(t[..8].try_into().expect("8 bytes"));
    let nanos = u32::from_le_bytes(t[8..].try_into().expect("4 bytes"));
    Ok((cfg, UNIX_EPOCH + Duration::new(secs, nanos.min(999_999_999))))
}

/// Reads the config. A virtio port reads 0 bytes while the host side is not connected yet, so
/// short reads are retried until the deadline.
fn read(fd: &OwnedFd) -> io::Result<GuestConfig> {
    let mut f = FdReader(fd);
    let mut len = [0u8; 4];
    read_exact_patient(&mut f, &mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX {
        return Err(io::Error::other(format!("config of {len} bytes is larger than {MAX}")));
    }
    let mut buf = vec![0u8; len];
    read_exact_patient(&mut f, &mut buf)?;
    serde_json::from_slice(&buf).map_err(io::Error::other)
}

fn read_exact_patient(r: &mut impl Read, mut buf: &mut [u8]) -> io::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !buf.is_empty() {
        match r.read(buf) {
            Ok(0) => {
                if std::time::Instant::now() > deadline {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

struct FdReader<'a>(&'a OwnedFd);

impl Write for FdReader<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: a valid buffer of the given length and an open descriptor.
        let n = unsafe { libc::write(self.0.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for FdReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: a valid buffer of the given length and an open descriptor.
        let n = unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> GuestConfig {
        GuestConfig {
            hostname: "ixyz".into(),
            agent: cordon_agent::AgentConfig {
                sandbox_id: "ixyz".into(),
                default_user: "user".into(),
                workdir: None,
                env: vec![("A".into(), "b".into())],
                root: "/".into(),
                envd_version: None,
                isolate_commands: false,
            },
            seed: vec![7; 32],
            volumes: vec![GuestVolume { tag: "cordon-vol0".into(), target: "/data".into(), read_only: true }],
            network: Some(GuestNetwork { mac: [2, 1, 2, 3, 4, 5], egress_ca: None }),
        }
    }

    #[test]
    fn the_exchange_carries_config_seed_and_a_fresh_time() {
        let (host, guest) = std::os::unix::net::UnixStream::pair().unwrap();
        let guest = std::thread::spawn(move || receive(&OwnedFd::from(guest)).unwrap());
        let mut host = host;
        await_ready(&mut host).unwrap();
        let sent_at = SystemTime::now();
        send(&mut host, &config()).unwrap();
        let (got, time) = guest.join().unwrap();
        assert_eq!(got.hostname, "ixyz");
        assert_eq!(got.agent.env, config().agent.env);
        assert_eq!(got.seed, vec![7; 32]);
        assert!(time >= sent_at - Duration::from_secs(1) && time <= SystemTime::now(), "{time:?}");
    }

    #[test]
    fn a_parked_guest_skips_to_the_resume_and_the_host_skips_frames_to_parked() {
        let (host, guest) = std::os::unix::net::UnixStream::pair().unwrap();
        let guest = std::thread::spawn(move || {
            let fd = OwnedFd::from(guest);
            // Frames the guest's multiplexer sent before it parked: a data frame, a ping.
            let mut frames = vec![0u8, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 5];
            frames.extend_from_slice(b"\xffcord"); // a body that looks like a marker's start
            frames.extend_from_slice(&[0u8, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9]);
            FdReader(&fd).write_all(&frames).unwrap();
            park(&fd).unwrap()
        });
        let mut host = host;
        await_parked(&mut host).unwrap();
        // Bytes a host multiplexer sent after the guest closed, ending mid-frame.
        host.write_all(&[0u8, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 1, 2]).unwrap();
        let mut cfg = config();
        cfg.hostname = "ifork".into();
        resume(&mut host, &cfg).unwrap();
        let (got, _) = guest.join().unwrap();
        assert_eq!(got.hostname, "ifork");
    }

    #[test]
    fn a_guest_that_does_not_park_is_an_error_not_a_hang() {
        let (mut host, mut guest) = std::os::unix::net::UnixStream::pair().unwrap();
        guest.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        assert!(await_parked(&mut host).is_err());
    }

    #[test]
    fn a_host_that_hears_something_else_than_ready_says_what() {
        let (mut host, mut guest) = std::os::unix::net::UnixStream::pair().unwrap();
        guest.write_all(b"x").unwrap();
        let e = await_ready(&mut host).unwrap_err();
        assert!(e.to_string().contains("expected 'R'"), "{e}");
    }
}
