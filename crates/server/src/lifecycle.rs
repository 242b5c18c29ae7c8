//! Lifetimes: the TTL sweeper. (The watch on each sandbox's init, so that a sandbox that dies
//! by itself leaves the registry at once, is `cordon_sandbox::lifecycle::died`, spawned by the
//! registry.)

use std::sync::Arc;
use std::time::Duration;

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

/// Accept errors worth waiting out rather than stopping for.
pub fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::ECONNABORTED | libc::EINTR | libc::EAGAIN)
    )
}
