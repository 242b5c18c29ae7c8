//! Capabilities: root of the sandbox keeps only what ordinary programs and package managers
//! need (Docker's default set, without NET_RAW). Dropped from the bounding set, they can never
//! be regained inside, not even through a setuid binary or file capabilities.

use std::io;

/// Capabilities kept, by number (linux/capability.h).
const KEEP: [u32; 13] = [
    0,  // CAP_CHOWN
    1,  // CAP_DAC_OVERRIDE
    3,  // CAP_FOWNER
    4,  // CAP_FSETID
    5,  // CAP_KILL
    6,  // CAP_SETGID
    7,  // CAP_SETUID
    8,  // CAP_SETPCAP
    10, // CAP_NET_BIND_SERVICE
    18, // CAP_SYS_CHROOT
    27, // CAP_MKNOD
    29, // CAP_AUDIT_WRITE
    31, // CAP_SETFCAP
];

/// The bounding set every command starts with, in the kernel's hex form (`CapBnd:`): the kept
/// capabilities only (the agent's CAP_SYS_ADMIN, when it has it, is dropped before each exec).
pub fn command_bounding() -> String {
    cordon_host::proc_facts::cap_set(&KEEP)
}

fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// CAP_SYS_ADMIN, left to the agent alone when it scopes commands (see the agent's
/// `command_scope`): each command drops it from its bounding set before its exec.
const CAP_SYS_ADMIN: u32 = 21;

/// Drops every other capability from the bounding set and clears the ambient set. Must run
/// before the seccomp filter is installed only in so far as prctl stays allowed (it does).
/// `agent_admin`: leave CAP_SYS_ADMIN for the agent, which takes it from every command.
pub fn drop_bounding(agent_admin: bool) -> io::Result<()> {
    for cap in 0..=last_cap() {
        if KEEP.contains(&cap) || (agent_admin && cap == CAP_SYS_ADMIN) {
            continue;
        }
        // SAFETY: prctl with integer arguments.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
            let e = io::Error::last_os_error();
            // Capabilities newer than this kernel's headers are simply not there.
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(io::Error::new(e.kind(), format!("drop capability {cap}: {e}")));
            }
        }
    }
    // SAFETY: as above.
    unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0, 0, 0) };
    Ok(())
}
