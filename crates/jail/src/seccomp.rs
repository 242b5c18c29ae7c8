//! The sandbox's syscall filter, compiled from `seccomp/sandbox.json` at build time.
//!
//! One program: the allowlist (EPERM for everything it does not name) with the policy's errno
//! overrides folded in (ENOSYS for `clone3`, EAFNOSUPPORT for other socket families, ...). It
//! finds a syscall's verdict by binary search over syscall numbers (see `build/bpf.rs`), which
//! keeps it short; the kernel emulates a new filter once per syscall number when it is attached,
//! so a long program costs every sandbox start. The tests prove it gives the verdicts of
//! seccompiler's programs for the same policy.
//!
//! The filter is installed without `PR_SET_NO_NEW_PRIVS`, which root of the sandbox's user
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
    install(allow, audit)
}

/// The policy file the programs are compiled from, as built in.
pub const POLICY: &str = include_str!("../seccomp/sandbox.json");

/// The program [`apply`] installs for these settings, as the kernel's `struct sock_filter` array.
pub fn program(allow_ptrace: bool, audit: bool) -> Vec<u8> {
    as_bytes(match (allow_ptrace, audit) {
        (false, false) => filters::SANDBOX,
        (true, false) => filters::SANDBOX_PTRACE,
        (false, true) => filters::SANDBOX_AUDIT,
        (true, true) => filters::SANDBOX_PTRACE_AUDIT,
    })
}

/// The programs [`apply`] installs without auditing, in order, each as the raw `struct
/// sock_filter` array the kernel takes: for loading the same filter with another runtime
/// (`bwrap --add-seccomp-fd`), which is how the bench prices the filter on its own.
pub fn programs(allow_ptrace: bool) -> Vec<Vec<u8>> {
    let allow = if allow_ptrace { filters::SANDBOX_PTRACE } else { filters::SANDBOX };
    vec![as_bytes(allow)]
}

fn as_bytes(prog: &[(u16, u8, u8, u32)]) -> Vec<u8> {
    prog.iter()
        .flat_map(|&(code, jt, jf, k)| {
            let mut insn = Vec::with_capacity(8);
            insn.extend_from_slice(&code.to_ne_bytes());
            insn.extend_from_slice(&[jt, jf]);
            insn.extend_from_slice(&k.to_ne_bytes());
            insn
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::filters;

    mod reference {
        include!(concat!(env!("OUT_DIR"), "/seccomp_reference.rs"));
    }

    type Prog = [(u16, u8, u8, u32)];
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    const AUDIT_ARCH_I386: u32 = 0x4000_0003;
    const RET_ERRNO_EPERM: u32 = 0x0005_0001;
    const RET_USER_NOTIF: u32 = 0x7fc0_0000;

    /// A classic-BPF interpreter for the instructions seccomp programs use, run on a `struct
    /// seccomp_data` (nr, arch, instruction pointer, six arguments).
    fn run(prog: &Prog, nr: u32, arch: u32, args: [u64; 6]) -> u32 {
        let word = |off: u32| -> u32 {
            match off {
                0 => nr,
                4 => arch,
                8 | 12 => 0,
                16..=63 if off.is_multiple_of(4) => {
                    let a = args[(off as usize - 16) / 8];
                    if off.is_multiple_of(8) { a as u32 } else { (a >> 32) as u32 }
                }
                _ => panic!("load from seccomp_data offset {off}"),
            }
        };
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let (code, jt, jf, k) = prog[pc];
            pc += 1;
            let jump = |cond: bool| if cond { jt as usize } else { jf as usize };
            match code {
                0x20 => a = word(k),
                0x54 => a &= k,
                0x05 => pc += k as usize,
                0x15 => pc += jump(a == k),
                0x25 => pc += jump(a > k),
                0x35 => pc += jump(a >= k),
                0x45 => pc += jump(a & k != 0),
                0x06 => return k,
                _ => panic!("instruction {code:#x} at {}", pc - 1),
            }
        }
    }

    /// What the kernel returns for a stack of filters: the most restrictive action (compared as
    /// signed, so KILL_PROCESS is lowest), and among equal actions the latest filter's.
    fn stacked(progs: &[&Prog], nr: u32, arch: u32, args: [u64; 6]) -> u32 {
        let mut verdict: Option<u32> = None;
        for prog in progs.iter().rev() {
            let r = run(prog, nr, arch, args);
            let action = |v: u32| (v & 0xffff_0000) as i32;
            if verdict.is_none_or(|v| action(r) < action(v)) {
                verdict = Some(r);
            }
        }
        verdict.unwrap()
    }

    /// Every syscall number with a spread of arguments, and every combination of the policy's
    /// own constants on the syscalls whose arguments it checks.
    fn cases() -> Vec<(u32, u32, [u64; 6])> {
        let mut out = Vec::new();
        let plain = [[0; 6], [u64::MAX; 6], [1, 2, 3, 4, 5, 6], [0x7e1f_0000, 21522, 16, 0, 0, 0]];
        for nr in (0..600).chain([0x4000_0000, 0x4000_0001, 0x4000_0038, 0x4000_0200, u32::MAX]) {
            for arch in [AUDIT_ARCH_X86_64, AUDIT_ARCH_I386] {
                out.extend(plain.iter().map(|a| (nr, arch, *a)));
            }
        }
        let v = reference::ARG_VALUES;
        for &nr in reference::ARG_SYSCALLS {
            for a0 in v {
                for a1 in v {
                    for a2 in v {
                        out.push((nr, AUDIT_ARCH_X86_64, [*a0, *a1, *a2, 0, 0, 0]));
                    }
                }
            }
        }
        out
    }

    fn assert_same(ours: &Prog, theirs: &[&Prog]) {
        let mut checked = 0;
        for (nr, arch, args) in cases() {
            let (a, b) = (run(ours, nr, arch, args), stacked(theirs, nr, arch, args));
            assert_eq!(a, b, "syscall {nr} arch {arch:#x} args {args:x?}: ours {a:#x}, seccompiler's {b:#x}");
            checked += 1;
        }
        assert!(checked > 100_000, "only {checked} cases");
    }

    fn audited(prog: &Prog) -> Vec<(u16, u8, u8, u32)> {
        prog.iter().map(|&(c, jt, jf, k)| (c, jt, jf, if c == 0x06 && k == RET_ERRNO_EPERM { RET_USER_NOTIF } else { k })).collect()
    }

    fn with_overrides(allow: &Prog) -> Vec<&Prog> {
        std::iter::once(allow).chain(reference::OVERRIDES.iter().copied()).collect()
    }

    #[test]
    fn the_search_gives_seccompilers_verdict_for_every_syscall_and_argument() {
        assert_same(filters::SANDBOX, &with_overrides(reference::SANDBOX));
        assert_same(filters::SANDBOX_PTRACE, &with_overrides(reference::SANDBOX_PTRACE));
    }

    #[test]
    fn the_audited_search_notifies_exactly_where_the_reference_denies() {
        let (plain, ptrace) = (audited(reference::SANDBOX), audited(reference::SANDBOX_PTRACE));
        assert_same(filters::SANDBOX_AUDIT, &with_overrides(&plain));
        assert_same(filters::SANDBOX_PTRACE_AUDIT, &with_overrides(&ptrace));
    }

    #[test]
    fn the_search_is_much_shorter_than_the_linear_chain() {
        let (ours, theirs) = (filters::SANDBOX.len(), reference::SANDBOX.len());
        assert!(ours * 3 < theirs, "{ours} instructions against seccompiler's {theirs}");
        // Spot checks that do not lean on the reference: a few verdicts anyone can read off the
        // policy file.
        let x = AUDIT_ARCH_X86_64;
        assert_eq!(run(filters::SANDBOX, libc::SYS_read as u32, x, [0; 6]), 0x7fff_0000);
        assert_eq!(run(filters::SANDBOX, libc::SYS_bpf as u32, x, [0; 6]), RET_ERRNO_EPERM);
        assert_eq!(run(filters::SANDBOX, libc::SYS_clone3 as u32, x, [0; 6]), 0x0005_0000 | libc::ENOSYS as u32);
        assert_eq!(run(filters::SANDBOX, libc::SYS_socket as u32, x, [17, 3, 0, 0, 0, 0]), 0x0005_0000 | libc::EAFNOSUPPORT as u32);
        assert_eq!(run(filters::SANDBOX, libc::SYS_read as u32, AUDIT_ARCH_I386, [0; 6]), 0x8000_0000);
        assert_eq!(run(filters::SANDBOX, 0x4000_0000, x, [0; 6]), RET_ERRNO_EPERM);
    }

    #[test]
    fn programs_are_the_installed_filters_as_sock_filter_arrays() {
        let progs = super::programs(false);
        assert_eq!(progs.len(), 1);
        assert_eq!(progs[0].len(), filters::SANDBOX.len() * std::mem::size_of::<libc::sock_filter>());
        let (code, _, _, k) = filters::SANDBOX[3];
        assert_eq!(u16::from_ne_bytes([progs[0][24], progs[0][25]]), code);
        assert_eq!(u32::from_ne_bytes(progs[0][28..32].try_into().unwrap()), k);
    }
}
