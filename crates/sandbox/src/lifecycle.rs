//! The parts of a sandbox's life every long-running front end shares: how long a new agent may
//! take to answer, and the watch on a sandbox's death.

use std::os::fd::OwnedFd;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// How long a new sandbox's agent may take to answer `/health` before the create fails.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Resolves once the process behind `pidfd` (a sandbox's init, from `Sandbox::death_fd`) has
/// exited: true then, false if the fd cannot be watched (the caller keeps its other checks).
pub async fn died(pidfd: OwnedFd) -> bool {
    // SAFETY: `pidfd` is owned by this AsyncFd alone, so it stays open and names the same
    // process for the AsyncFd's whole life.
    let Ok(afd) = (unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }) else { return false };
    afd.readable().await.is_ok()
}

/// Whether the process behind `pidfd` has exited, without waiting.
pub fn is_dead(pidfd: &OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd that lives across the call, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & libc::POLLIN != 0
}
