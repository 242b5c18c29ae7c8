//! The sandbox's syscall filter, compiled from `seccomp/sandbox.json` at build time.
//!
//! Filters are stacked: first the allowlist (EPERM for everything it does not name), then one
//! small filter per errno override (ENOSYS for `clone3`, EAFNOSUPPORT for other socket
//! families, ...). The kernel runs every installed filter; among equal verdicts the most
//! recently installed one wins, which is how a syscall gets a different errno than the rest.
//!
//! The filters are installed without `PR_SET_NO_NEW_PRIVS`, which root of the sandbox's user
//! namespace may do, so that setuid programs of the image (sudo) keep working; the filter is
//! inherited by every process regardless.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

mod filters {
    include!(concat!(env!("OUT_DIR"), "/seccomp_filters.rs"));
}

const SECCOMP_FILTER_FLAG_NEW_LISTENER: libc::c_ulong = 1 << 3;

/// Installs one program; with `listener` the kernel returns a user-notification fd for it.
fn install(prog: &[(u16, u8, u8, u32)], listener: bool) -> io::Result<Option<OwnedFd>> {
    let insns: Vec<libc::sock_filter> =
        prog.iter().map(|&(code, jt, jf, k)| libc::sock_filter { code, jt, jf, k }).collect();
    let fprog = libc::sock_fprog { len: insns.len() as u16, filter: insns.as_ptr() as *mut _ };
    let flags = if listener { SECCOMP_FILTER_FLAG_NEW_LISTENER } else { 0 };
    // SAFETY: `fprog` points at `insns`, which outlives the call; the kernel copies the program.
    let r = unsafe { libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, flags, &fprog as *const libc::sock_fprog) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("install seccomp filter: {e}")));
    }
    // SAFETY: with NEW_LISTENER the return value is a fresh fd owned by us.
    Ok(listener.then(|| unsafe { OwnedFd::from_raw_fd(r as RawFd) }))
}

/// Installs the sandbox filters on the calling thread; everything it execs inherits them.
/// With `audit`, denials are sent to the returned listener instead of failing on the spot; its
/// holder must answer them (see [`crate::audit`]). The listener must never stay inside the
/// sandbox: whoever holds it can let a denied call through.
pub fn apply(allow_ptrace: bool, audit: bool) -> io::Result<Option<OwnedFd>> {
    let allow = match (allow_ptrace, audit) {
        (false, false) => filters::SANDBOX,
        (true, false) => filters::SANDBOX_PTRACE,
        (false, true) => filters::SANDBOX_AUDIT,
        (true, true) => filters::SANDBOX_PTRACE_AUDIT,
    };
    let listener = install(allow, audit)?;
    for f in filters::OVERRIDES {
        install(f, false)?;
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_are_compiled_in() {
        assert!(super::filters::SANDBOX.len() > 100);
        assert!(super::filters::SANDBOX_PTRACE.len() > super::filters::SANDBOX.len());
        assert_eq!(super::filters::OVERRIDES.len(), 3);
        // The audited variant differs only in its verdict for denied calls.
        assert_eq!(super::filters::SANDBOX_AUDIT.len(), super::filters::SANDBOX.len());
        assert_ne!(super::filters::SANDBOX_AUDIT, super::filters::SANDBOX);
    }
}
