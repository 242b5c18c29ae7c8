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

mod filters {
    include!(concat!(env!("OUT_DIR"), "/seccomp_filters.rs"));
}

fn install(prog: &[(u16, u8, u8, u32)]) -> io::Result<()> {
    let insns: Vec<libc::sock_filter> =
        prog.iter().map(|&(code, jt, jf, k)| libc::sock_filter { code, jt, jf, k }).collect();
    let fprog = libc::sock_fprog { len: insns.len() as u16, filter: insns.as_ptr() as *mut _ };
    // SAFETY: `fprog` points at `insns`, which outlives the call; the kernel copies the program.
    let r = unsafe { libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, 0, &fprog as *const libc::sock_fprog) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("install seccomp filter: {e}")));
    }
    Ok(())
}

/// Installs the sandbox filters on the calling thread; everything it execs inherits them.
pub fn apply(allow_ptrace: bool) -> io::Result<()> {
    install(if allow_ptrace { filters::SANDBOX_PTRACE } else { filters::SANDBOX })?;
    for f in filters::OVERRIDES {
        install(f)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_are_compiled_in() {
        assert!(super::filters::SANDBOX.len() > 100);
        assert!(super::filters::SANDBOX_PTRACE.len() > super::filters::SANDBOX.len());
        assert_eq!(super::filters::OVERRIDES.len(), 3);
    }
}
