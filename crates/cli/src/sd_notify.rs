//! systemd's readiness protocol (sd_notify(3)) for `Type=notify` units: `READY=1` once the
//! server answers, `STOPPING=1` when it begins to shut down, each with a `STATUS=` line.
//!
//! Written by hand rather than with the sd-notify crate: the protocol is one datagram of
//! `KEY=VALUE` lines to the socket named in `$NOTIFY_SOCKET`, a path or (`@NAME`) an abstract
//! address, both of which std's `UnixDatagram` reaches without unsafe code, so a dependency
//! would add nothing but its version to track. Descriptor passing and the watchdog, the crate's
//! other features, are not used.

use std::ffi::OsStr;
use std::io;
use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` (newline-separated `KEY=VALUE` assignments) to the service manager, when there
/// is one. Failing to tell it is logged, never fatal: the server works without it.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&socket, state) {
        tracing::warn!("cannot tell the service manager {state:?} through NOTIFY_SOCKET={}: {e}", socket.to_string_lossy());
    }
}

/// Sends `state` as one datagram to `socket`: a path, or `@NAME` for an abstract address.
pub fn send(socket: &OsStr, state: &str) -> io::Result<()> {
    let addr = address(socket)?;
    let sock = UnixDatagram::unbound()?;
    let sent = sock.send_to_addr(state.as_bytes(), &addr)?;
    if sent != state.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, format!("sent {sent} of {} bytes", state.len())));
    }
    Ok(())
}

fn address(socket: &OsStr) -> io::Result<SocketAddr> {
    match socket.as_bytes() {
        [b'@', name @ ..] => SocketAddr::from_abstract_name(name),
        [b'/', ..] => SocketAddr::from_pathname(socket),
        // systemd also hands VMs `vsock:` addresses; a server on the host is never given one.
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "not an absolute path nor an @abstract name")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt as _;

    fn receive(sock: &UnixDatagram) -> String {
        sock.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 4096];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn a_path_socket_gets_the_state_as_one_datagram() {
        let path = std::env::temp_dir().join(format!("cordon-notify-test-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let sock = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "READY=1\nSTATUS=listening").unwrap();
        assert_eq!(receive(&sock), "READY=1\nSTATUS=listening");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn an_abstract_socket_is_named_with_an_at_sign() {
        let name = format!("cordon-notify-test-{}", std::process::id());
        let sock = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        send(&std::ffi::OsString::from_vec(format!("@{name}").into_bytes()), "STOPPING=1").unwrap();
        assert_eq!(receive(&sock), "STOPPING=1");
    }

    #[test]
    fn other_addresses_are_refused_and_a_missing_socket_is_an_error() {
        assert!(send(OsStr::new("vsock:2:1234"), "READY=1").is_err());
        assert!(send(OsStr::new("/nonexistent/notify.sock"), "READY=1").is_err());
    }
}
