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

/// The programs [`apply`] installs without auditing, in order, each as the raw `struct
/// sock_filter` array the kernel takes: for loading the same filter with another runtime
/// (`bwrap --add-seccomp-fd`), which is how the bench prices the filter on its own.
pub fn programs(allow_ptrace: bool) -> Vec<Vec<u8>> {
    let allow = if allow_ptrace { filters::SANDBOX_PTRACE } else { filters::SANDBOX };
    std::iter::once(allow)
        .chain(filters::OVERRIDES.iter().copied())
        .map(|prog| {
            prog.iter()
                .flat_map(|&(code, jt, jf, k)| {
                    let mut insn = Vec::with_capacity(8);
                    insn.extend_from_slice(&code.to_ne_bytes());
                    insn.extend_from_slice(&[jt, jf]);
                    insn.extend_from_slice(&k.to_ne_bytes());
                    insn
                })
                .collect()
        })
        .collect()
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

    #[test]
    fn programs_are_the_installed_filters_as_sock_filter_arrays() {
        let progs = super::programs(false);
        assert_eq!(progs.len(), 1 + super::filters::OVERRIDES.len());
        assert_eq!(progs[0].len(), super::filters::SANDBOX.len() * std::mem::size_of::<libc::sock_filter>());
        let (code, _, _, k) = super::filters::SANDBOX[0];
        assert_eq!(u16::from_ne_bytes([progs[0][0], progs[0][1]]), code);
        assert_eq!(u32::from_ne_bytes(progs[0][4..8].try_into().unwrap()), k);
    }
}
