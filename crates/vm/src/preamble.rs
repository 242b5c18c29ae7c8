//! The first bytes on the agent link: the sandbox's configuration, sent by the host before the
//! multiplexed streams begin. Keeping it on the link (rather than the kernel command line, which
//! is limited to 2 KiB and visible in /proc/cmdline to every process) also lets a restored,
//! already-booted VM receive its identity after the fact.
//!
//! Format: a 4-byte little-endian length, then that many bytes of JSON ([`GuestConfig`]).

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};

/// Largest config accepted: bounds what a broken host side could make the guest allocate.
const MAX: usize = 1 << 20;

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct GuestConfig {
    pub hostname: String,
    pub agent: cordon_agent::AgentConfig,
}

pub fn encode(cfg: &GuestConfig) -> Vec<u8> {
    let json = serde_json::to_vec(cfg).expect("config serialises");
    let mut out = (json.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out
}

pub fn write(w: &mut impl Write, cfg: &GuestConfig) -> io::Result<()> {
    w.write_all(&encode(cfg))
}

/// Reads the config from the (still blocking) port. A virtio port reads 0 bytes while the host
/// side is not connected yet, so short reads are retried until the deadline.
pub fn read(fd: &OwnedFd) -> io::Result<GuestConfig> {
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

    #[test]
    fn round_trip() {
        let cfg = GuestConfig {
            hostname: "ixyz".into(),
            agent: cordon_agent::AgentConfig {
                sandbox_id: "ixyz".into(),
                default_user: "user".into(),
                workdir: None,
                env: vec![("A".into(), "b".into())],
                root: "/".into(),
                envd_version: None,
            },
        };
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut a = a;
        write(&mut a, &cfg).unwrap();
        let got = read(&OwnedFd::from(b)).unwrap();
        assert_eq!(got.hostname, "ixyz");
        assert_eq!(got.agent.env, cfg.agent.env);
    }
}
