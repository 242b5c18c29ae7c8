//! The audit trail: every syscall the filter denies, by name, with its count and the pids that
//! tried it.
//!
//! The allowlist's EPERM verdict is turned into seccomp user notification (see build.rs), and a
//! host thread holding the listener records each denial and answers EPERM itself. Allowed
//! syscalls never reach it, so they cost nothing extra; a denied one costs a round trip to this
//! thread (tens of microseconds). Socket families refused with EAFNOSUPPORT/EPROTONOSUPPORT and
//! `clone3`'s ENOSYS come from separate filters and are not recorded: they are the expected,
//! gracefully handled answers, and libc calls `clone3` on every fork.

use serde::Serialize;
use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

/// One kind of denied call.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Denial {
    pub syscall: String,
    pub count: u64,
    /// Pids inside the sandbox that tried it (first 16).
    pub pids: Vec<u32>,
}

#[repr(C)]
#[derive(Default)]
struct SeccompData {
    nr: i32,
    arch: u32,
    instruction_pointer: u64,
    args: [u64; 6],
}

#[repr(C)]
#[derive(Default)]
struct Notif {
    id: u64,
    pid: u32,
    flags: u32,
    data: SeccompData,
}

#[repr(C)]
struct NotifResp {
    id: u64,
    val: i64,
    error: i32,
    flags: u32,
}

// _IOWR('!', 0, struct seccomp_notif) and _IOWR('!', 1, struct seccomp_notif_resp).
const NOTIF_RECV: libc::c_ulong = 0xc050_2100;
const NOTIF_SEND: libc::c_ulong = 0xc018_2101;

/// Records of one sandbox, filled by its supervisor thread.
#[derive(Clone, Default)]
pub struct Trail {
    inner: Arc<Mutex<BTreeMap<i32, (u64, Vec<u32>)>>>,
}

impl Trail {
    pub fn denials(&self) -> Vec<Denial> {
        let map = self.inner.lock().expect("audit lock");
        let mut out: Vec<Denial> = map
            .iter()
            .map(|(nr, (count, pids))| Denial { syscall: name(*nr), count: *count, pids: pids.clone() })
            .collect();
        out.sort_by(|a, b| b.count.cmp(&a.count).then(a.syscall.cmp(&b.syscall)));
        out
    }

    fn record(&self, nr: i32, pid: u32) {
        let mut map = self.inner.lock().expect("audit lock");
        let e = map.entry(nr).or_default();
        e.0 += 1;
        if e.1.len() < 16 && !e.1.contains(&pid) {
            e.1.push(pid);
        }
    }
}

/// Starts the supervisor thread for `listener`; it ends when the sandbox's last process is gone.
pub fn supervise(listener: OwnedFd, id: &str) -> io::Result<Trail> {
    let trail = Trail::default();
    let t = trail.clone();
    std::thread::Builder::new().name(format!("audit-{id}")).spawn(move || run(listener, t))?;
    Ok(trail)
}

fn run(listener: OwnedFd, trail: Trail) {
    let fd = listener.as_raw_fd();
    loop {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, 1000) };
        if n < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return;
        }
        if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            return; // no process uses the filter any more
        }
        if p.revents & libc::POLLIN == 0 {
            continue;
        }
        let mut notif = Notif::default();
        // SAFETY: NOTIF_RECV fills a zeroed struct seccomp_notif of the right size.
        if unsafe { libc::ioctl(fd, NOTIF_RECV, &mut notif) } != 0 {
            continue; // the caller died before we read it
        }
        trail.record(notif.data.nr, inner_pid(notif.pid));
        let resp = NotifResp { id: notif.id, val: 0, error: -libc::EPERM, flags: 0 };
        // SAFETY: answering the notification we just received; ENOENT (caller gone) is fine.
        unsafe { libc::ioctl(fd, NOTIF_SEND, &resp) };
    }
}

/// The pid as the sandbox sees it (the last field of NSpid), falling back to the host pid.
fn inner_pid(host_pid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{host_pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("NSpid:")).and_then(|l| l.split_whitespace().last()?.parse().ok()))
        .unwrap_or(host_pid)
}

/// Names of the syscalls the policy denies (x86_64); others are shown by number.
fn name(nr: i32) -> String {
    const NAMES: &[(libc::c_long, &str)] = &[
        (libc::SYS_io_uring_setup, "io_uring_setup"),
        (libc::SYS_io_uring_enter, "io_uring_enter"),
        (libc::SYS_io_uring_register, "io_uring_register"),
        (libc::SYS_bpf, "bpf"),
        (libc::SYS_perf_event_open, "perf_event_open"),
        (libc::SYS_userfaultfd, "userfaultfd"),
        (libc::SYS_keyctl, "keyctl"),
        (libc::SYS_add_key, "add_key"),
        (libc::SYS_request_key, "request_key"),
        (libc::SYS_kexec_load, "kexec_load"),
        (libc::SYS_kexec_file_load, "kexec_file_load"),
        (libc::SYS_init_module, "init_module"),
        (libc::SYS_finit_module, "finit_module"),
        (libc::SYS_delete_module, "delete_module"),
        (libc::SYS_open_by_handle_at, "open_by_handle_at"),
        (libc::SYS_name_to_handle_at, "name_to_handle_at"),
        (libc::SYS_mount, "mount"),
        (libc::SYS_umount2, "umount2"),
        (libc::SYS_fsopen, "fsopen"),
        (libc::SYS_fsconfig, "fsconfig"),
        (libc::SYS_fsmount, "fsmount"),
        (libc::SYS_fspick, "fspick"),
        (libc::SYS_move_mount, "move_mount"),
        (libc::SYS_open_tree, "open_tree"),
        (libc::SYS_mount_setattr, "mount_setattr"),
        (libc::SYS_pivot_root, "pivot_root"),
        (libc::SYS_unshare, "unshare"),
        (libc::SYS_setns, "setns"),
        (libc::SYS_clone, "clone"),
        (libc::SYS_ptrace, "ptrace"),
        (libc::SYS_process_vm_readv, "process_vm_readv"),
        (libc::SYS_process_vm_writev, "process_vm_writev"),
        (libc::SYS_kcmp, "kcmp"),
        (libc::SYS_pidfd_getfd, "pidfd_getfd"),
        (libc::SYS_acct, "acct"),
        (libc::SYS_swapon, "swapon"),
        (libc::SYS_swapoff, "swapoff"),
        (libc::SYS_syslog, "syslog"),
        (libc::SYS_quotactl, "quotactl"),
        (libc::SYS_lookup_dcookie, "lookup_dcookie"),
        (libc::SYS_iopl, "iopl"),
        (libc::SYS_ioperm, "ioperm"),
        (libc::SYS_modify_ldt, "modify_ldt"),
        (libc::SYS_clock_settime, "clock_settime"),
        (libc::SYS_clock_adjtime, "clock_adjtime"),
        (libc::SYS_settimeofday, "settimeofday"),
        (libc::SYS_adjtimex, "adjtimex"),
        (libc::SYS_reboot, "reboot"),
        (libc::SYS_personality, "personality"),
        (libc::SYS_ioctl, "ioctl"),
        (libc::SYS_socket, "socket"),
        (libc::SYS_socketpair, "socketpair"),
        (libc::SYS_fanotify_init, "fanotify_init"),
        (libc::SYS_fanotify_mark, "fanotify_mark"),
        (libc::SYS_vhangup, "vhangup"),
        (libc::SYS_uselib, "uselib"),
        (libc::SYS_ustat, "ustat"),
        (libc::SYS_sysfs, "sysfs"),
        (libc::SYS_move_pages, "move_pages"),
        (libc::SYS_migrate_pages, "migrate_pages"),
    ];
    NAMES
        .iter()
        .find(|(n, _)| *n == nr as libc::c_long)
        .map_or_else(|| format!("syscall_{nr}"), |(_, s)| s.to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_and_sorting() {
        assert_eq!(super::name(libc::SYS_bpf as i32), "bpf");
        assert_eq!(super::name(100_000), "syscall_100000");
        let t = super::Trail::default();
        t.record(libc::SYS_bpf as i32, 5);
        t.record(libc::SYS_mount as i32, 5);
        t.record(libc::SYS_mount as i32, 6);
        let d = t.denials();
        assert_eq!(d[0].syscall, "mount");
        assert_eq!((d[0].count, d[0].pids.clone()), (2, vec![5, 6]));
        assert_eq!(d[1].syscall, "bpf");
    }
}
