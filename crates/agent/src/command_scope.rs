//! Every command in a Landlock domain of its own, so that with ptrace off no command reaches
//! into another command's processes or into the agent through `/proc/<pid>/mem`, `environ`,
//! `fd/` and the like.
//!
//! The seccomp filter denies ptrace and process_vm_*, but it cannot see paths, and the kernel
//! lets a process open `/proc/<pid>/mem` of any dumpable process of the same user. Landlock
//! checks every such access (the kernel's ptrace access check, which /proc uses) and allows it
//! only towards processes in the same domain or one nested below it. The agent therefore puts
//! each command, between fork and exec, into a fresh domain nested under its own: a command
//! and its descendants share one domain, and no two commands, nor a command and the agent, do.
//! The new domain adds no file restriction (it allows every handled access beneath `/`, as the
//! sandbox's own domain does).
//!
//! Entering a domain without no_new_privs (which would break sudo) needs CAP_SYS_ADMIN in the
//! sandbox's user namespace. On the ns tier the init leaves that capability in the bounding set
//! for the agent alone: the agent keeps it out of its effective set, and each child raises it
//! for the one call, then drops it from its bounding set before its exec, so no command, not
//! even root through sudo, ever holds it.
//!
//! What stays open: processes of one command (a shell and what it starts) share a domain and
//! can still read each other's memory when they run as the same user.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const CAP_SYS_ADMIN: u32 = 21;
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
const LANDLOCK_RULE_PATH_BENEATH: libc::c_int = 1;
/// LANDLOCK_ACCESS_FS_EXECUTE: one handled access is enough to make a domain; it is allowed
/// beneath `/`, which the sandbox's own domain already confines everything to.
const ACCESS_FS_EXECUTE: u64 = 1;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// What a child does between fork and exec; prepared once by the agent.
pub(crate) struct Scope {
    /// A ruleset to enter; `None` where the kernel has no Landlock.
    ruleset: Option<OwnedFd>,
    /// The agent's capabilities with CAP_SYS_ADMIN effective (raised in the child for the
    /// restrict call) and without it (the agent's own from `prepare` on).
    raised: [CapData; 2],
    lowered: [CapData; 2],
    /// Whether the agent holds CAP_SYS_ADMIN at all (permitted).
    admin: bool,
}

fn capget() -> io::Result<[CapData; 2]> {
    let mut hdr = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: a v3 header and the two data structs the v3 layout needs.
    if unsafe { libc::syscall(libc::SYS_capget, &mut hdr as *mut CapHeader, data.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(data)
}

fn capset(data: &[CapData; 2]) -> io::Result<()> {
    let mut hdr = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    // SAFETY: a v3 header and two data structs; async-signal-safe (a plain syscall).
    if unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut CapHeader, data.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn ruleset() -> io::Result<OwnedFd> {
    // SAFETY: the version query takes no attribute.
    let abi = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, LANDLOCK_CREATE_RULESET_VERSION) };
    if abi < 1 {
        return Err(io::Error::last_os_error());
    }
    let attr = RulesetAttr { handled_access_fs: ACCESS_FS_EXECUTE };
    // SAFETY: a ruleset attribute of the size passed; the result is a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, &attr as *const RulesetAttr, std::mem::size_of::<RulesetAttr>(), 0u32) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let root = std::fs::File::open("/")?;
    let rule = PathBeneathAttr { allowed_access: ACCESS_FS_EXECUTE, parent_fd: root.as_raw_fd() };
    // SAFETY: a path-beneath rule naming an open directory, for our ruleset.
    let r = unsafe { libc::syscall(libc::SYS_landlock_add_rule, ruleset.as_raw_fd(), LANDLOCK_RULE_PATH_BENEATH, &rule as *const PathBeneathAttr, 0u32) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ruleset)
}

impl Scope {
    /// Prepares per-command domains; takes CAP_SYS_ADMIN out of the agent's effective set.
    /// `None` (commands are not scoped) when `isolate` is off.
    pub fn prepare(isolate: bool) -> Option<Scope> {
        if !isolate {
            return None;
        }
        let caps = capget().unwrap_or_default();
        let bit = 1u32 << CAP_SYS_ADMIN;
        let admin = caps[0].permitted & bit != 0;
        let mut raised = caps;
        let mut lowered = caps;
        if admin {
            raised[0].effective |= bit;
            lowered[0].effective &= !bit;
        }
        let ruleset = match ruleset() {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!("cordon-agent: commands are not in domains of their own (Landlock: {e})");
                None
            }
        };
        if admin {
            // The agent itself never needs it: only its children, for one call.
            let _ = capset(&lowered);
        }
        Some(Scope { ruleset, raised, lowered, admin })
    }

    /// In the child, between fork and exec, before it changes user: only async-signal-safe
    /// syscalls on data prepared in `prepare`.
    pub fn enter(&self) -> io::Result<()> {
        if let Some(ruleset) = &self.ruleset {
            if self.admin {
                capset(&self.raised)?;
            }
            // SAFETY: restrict_self on our ruleset descriptor, integer flags.
            if unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0u32) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        if self.admin {
            // Gone for good from this command and everything it execs, sudo included.
            // SAFETY: prctl with integer arguments.
            if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_ADMIN as libc::c_ulong, 0, 0, 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
            let mut none = self.lowered;
            none[0].permitted &= !(1u32 << CAP_SYS_ADMIN);
            capset(&none)?;
        }
        Ok(())
    }
}
