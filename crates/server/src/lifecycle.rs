//! Lifetimes: the TTL sweeper and the watch on each sandbox's init, so that a sandbox that
//! dies by itself (OOM of its init, a kill from outside) leaves the registry at once.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::registry::Sandboxes;

/// How often deadlines are checked: the granularity of expiry.
const SWEEP_EVERY: Duration = Duration::from_millis(250);

/// Destroys expired sandboxes, forever.
pub async fn sweep(sandboxes: Arc<Sandboxes>) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        sandboxes.expire_due().await;
    }
}

/// Waits for the sandbox's init to exit, then takes it out of the registry.
pub async fn watch_death(sandboxes: Weak<Sandboxes>, id: String, pidfd: OwnedFd) {
    // SAFETY: `pidfd` is owned by this AsyncFd alone, so it stays open and names the same
    // process for the AsyncFd's whole life.
    let Ok(afd) = (unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }) else { return };
    if afd.readable().await.is_err() {
        return;
    }
    if let Some(s) = sandboxes.upgrade() {
        s.remove(&id, "sandbox init exited").await;
    }
}

/// Accept errors worth waiting out rather than stopping for.
pub fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::ECONNABORTED | libc::EINTR | libc::EAGAIN)
    )
}
