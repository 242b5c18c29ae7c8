//! The audit trail: every syscall the filter denies, by name, with its count and a sample of
//! the pids that tried it.
//!
//! The allowlist's EPERM verdict is turned into seccomp user notification (see build.rs), and a
//! host thread holding the listener records each denial and answers EPERM itself. Allowed
//! syscalls never reach it, so they cost nothing extra; a denied one costs a round trip to this
//! thread (tens of microseconds). Socket families refused with EAFNOSUPPORT/EPROTONOSUPPORT and
//! `clone3`'s ENOSYS come from separate filters and are not recorded: they are the expected,
//! gracefully handled answers, and libc calls `clone3` on every fork.
//!
//! A sandbox decides how often it calls what the filter denies, so everything this costs the
//! host is bounded:
//! - memory: at most [`MAX_KINDS`] syscall numbers are kept apart, every further number is
//!   counted in one `other` entry, and each entry keeps at most [`MAX_PIDS`] pids; the trail
//!   (and the audit answer made from it) is a few kilobytes however long the sandbox floods;
//! - CPU: denials are answered at most [`RATE`] a second after a burst of [`BURST`]. Past that
//!   the thread waits before taking the next notification, so the sandbox's denied calls wait
//!   in its own kernel (asleep, killable, each a thread of its own pids budget) instead of
//!   costing the host a core. The answer stays EPERM and every denial is still counted;
//! - `/proc` reads: a pid's in-sandbox number is looked up only while some entry's sample has
//!   room, and remembered for [`MAX_PID_CACHE`] pids.
//!
//! The trail is freed with the sandbox: the thread ends when the last process using the filter
//! is gone, and the sandbox holds the only other reference.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Distinct syscall numbers recorded each on its own (the policy names about 60); others are
/// counted together under [`OTHER`].
pub const MAX_KINDS: usize = 128;
/// Pids kept per entry.
pub const MAX_PIDS: usize = 16;
/// Denials answered at once before the rate applies.
pub const BURST: f64 = 1000.0;
/// Denials answered per second past the burst.
pub const RATE: f64 = 1000.0;
/// Host pid -> sandbox pid lookups remembered.
const MAX_PID_CACHE: usize = 256;
/// The entry that counts every syscall number beyond [`MAX_KINDS`].
const OTHER: i32 = -1;

/// One kind of denied call (at most [`MAX_PIDS`] pids each).
pub use cordon_sandbox::Denial;

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
/// Per syscall number: how often it was refused, and the first pids that asked.
type Counts = BTreeMap<i32, (u64, Vec<u32>)>;

#[derive(Clone, Default)]
pub struct Trail {
    inner: Arc<Mutex<Counts>>,
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

    /// Counts one denial of `nr`; `pid` is asked for only when the entry's sample has room.
    fn record(&self, nr: i32, pid: impl FnOnce() -> u32) {
        let mut map = self.inner.lock().expect("audit lock");
        let key = if map.contains_key(&nr) || map.len() < MAX_KINDS { nr } else { OTHER };
        let e = map.entry(key).or_default();
        e.0 += 1;
        if e.1.len() < MAX_PIDS {
            let pid = pid();
            if !e.1.contains(&pid) {
                e.1.push(pid);
            }
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

/// A token bucket: [`BURST`] at once, then [`RATE`] a second.
struct Pace {
    tokens: f64,
    last: Instant,
}

impl Pace {
    fn new() -> Pace {
        Pace { tokens: BURST, last: Instant::now() }
    }

    /// How long to wait before the next answer (zero while tokens last); takes one token.
    fn next(&mut self) -> Duration {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * RATE).min(BURST);
        self.last = now;
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / RATE)
        }
    }
}

fn run(listener: OwnedFd, trail: Trail) {
    let fd = listener.as_raw_fd();
    let mut pace = Pace::new();
    let mut pids = PidCache::default();
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
        // The wait comes before taking the notification: until then the caller sleeps in the
        // sandbox's kernel, which costs the host nothing.
        let wait = pace.next();
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        let mut notif = Notif::default();
        // SAFETY: NOTIF_RECV fills a zeroed struct seccomp_notif of the right size.
        if unsafe { libc::ioctl(fd, NOTIF_RECV, &mut notif) } != 0 {
            continue; // the caller died before we read it
        }
        trail.record(notif.data.nr, || pids.inner(notif.pid));
        let resp = NotifResp { id: notif.id, val: 0, error: -libc::EPERM, flags: 0 };
        // SAFETY: answering the notification we just received; ENOENT (caller gone) is fine.
        unsafe { libc::ioctl(fd, NOTIF_SEND, &resp) };
    }
}

/// Host pid -> the pid as the sandbox sees it, remembered for a bounded number of pids.
#[derive(Default)]
struct PidCache(HashMap<u32, u32>);

impl PidCache {
    fn inner(&mut self, host_pid: u32) -> u32 {
        if let Some(&p) = self.0.get(&host_pid) {
            return p;
        }
        if self.0.len() >= MAX_PID_CACHE {
            self.0.clear();
        }
        let p = inner_pid(host_pid);
        self.0.insert(host_pid, p);
        p
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
        .map_or_else(|| if nr == OTHER { "other".to_string() } else { format!("syscall_{nr}") }, |(_, s)| s.to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_and_sorting() {
        assert_eq!(super::name(libc::SYS_bpf as i32), "bpf");
        assert_eq!(super::name(100_000), "syscall_100000");
        let t = super::Trail::default();
        t.record(libc::SYS_bpf as i32, || 5);
        t.record(libc::SYS_mount as i32, || 5);
        t.record(libc::SYS_mount as i32, || 6);
        let d = t.denials();
        assert_eq!(d[0].syscall, "mount");
        assert_eq!((d[0].count, d[0].pids.clone()), (2, vec![5, 6]));
        assert_eq!(d[1].syscall, "bpf");
    }

    #[test]
    fn the_trail_is_bounded_however_many_numbers_and_pids_are_denied() {
        let t = super::Trail::default();
        for i in 0..100_000u32 {
            t.record(1000 + i as i32, || i);
        }
        let d = t.denials();
        assert_eq!(d.len(), super::MAX_KINDS + 1, "{} entries", d.len());
        let other = d.iter().find(|x| x.syscall == "other").unwrap();
        assert_eq!(other.count, 100_000 - super::MAX_KINDS as u64);
        assert!(d.iter().all(|x| x.pids.len() <= super::MAX_PIDS));
        assert_eq!(d.iter().map(|x| x.count).sum::<u64>(), 100_000);
    }

    #[test]
    fn pids_are_looked_up_only_while_a_sample_has_room() {
        let t = super::Trail::default();
        let mut asked = 0;
        for i in 0..1000u32 {
            t.record(libc::SYS_bpf as i32, || {
                asked += 1;
                i
            });
        }
        assert_eq!(asked, super::MAX_PIDS);
    }

    #[test]
    fn the_pace_allows_a_burst_then_the_rate() {
        let mut p = super::Pace::new();
        let free = (0..super::BURST as usize).filter(|_| p.next().is_zero()).count();
        assert!(free >= super::BURST as usize - 1, "{free}");
        let w = p.next();
        assert!(w > std::time::Duration::ZERO && w <= std::time::Duration::from_secs_f64(2.0 / super::RATE), "{w:?}");
    }
}
