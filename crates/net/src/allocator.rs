//! The process's allocator, set as the forwarder needs it.
//!
//! Every segment toward the sandbox is a fresh buffer of up to 64 KiB, freed when the sandbox
//! acknowledges it. glibc hands an arena's free top back to the kernel once it passes its trim
//! threshold (128 KiB by default), so a download refaulted the same pages over and over: a third
//! of the forwarder's time went to page faults, and it moved 0.46x of the host's direct speed
//! against 0.67x with the threshold raised (256 MiB downloads, 2026-12-07). Up to
//! [`TRIM_THRESHOLD`] of free memory now stays in each arena. The setting is process-wide and
//! made once, before the first forwarder starts.

/// Free memory an arena keeps before giving it back to the kernel.
const TRIM_THRESHOLD: libc::c_int = 4 << 20;

pub(crate) fn keep_freed_memory() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(target_env = "gnu")]
        // SAFETY: mallopt only changes the allocator's parameters; it is called before the
        // forwarder's thread exists, and glibc serialises it against other threads' allocations.
        unsafe {
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
        }
    });
}
