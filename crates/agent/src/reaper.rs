//! The one child reaper of the process.
//!
//! As PID 1 the agent inherits every orphan of the sandbox, so it must `waitpid(-1)` to keep
//! zombies from piling up. That rules out any per-child waiting (std's `Child::wait`,
//! `tokio::process`): whoever calls `waitpid(-1)` first would steal the others' statuses. Instead
//! one table, shared by every `serve` in the process, maps pids to the channel that wants their
//! status, and SIGCHLD drives a `waitpid(-1, WNOHANG)` loop that fills it.
//!
//! Spawning and reaping exclude each other through the table's lock: a child can then never be
//! reaped before its pid is registered, and std's own `waitpid` on a child whose `exec` failed
//! cannot be pre-empted by the loop here.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// Statuses nobody registered for (orphans) are dropped after this long.
const UNCLAIMED_TTL: Duration = Duration::from_secs(5);
/// And at most this many are kept.
const UNCLAIMED_MAX: usize = 1024;

/// A raw `waitpid` status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WaitStatus(pub i32);

#[derive(Default)]
struct Table {
    waiting: HashMap<i32, oneshot::Sender<WaitStatus>>,
    unclaimed: HashMap<i32, (WaitStatus, Instant)>,
}

/// The process-wide reaper.
pub(crate) struct Reaper {
    table: Mutex<Table>,
}

/// The reaper shared by everything in this process.
pub(crate) fn global() -> &'static Reaper {
    static REAPER: OnceLock<Reaper> = OnceLock::new();
    REAPER.get_or_init(|| Reaper { table: Mutex::new(Table::default()) })
}

impl Reaper {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the lock cannot leave the maps inconsistent; keep going.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `spawn` (which returns the new child's pid and anything else) with reaping held
    /// off, and registers the pid; the receiver gets its exit status.
    pub fn spawn<T, E>(
        &self,
        spawn: impl FnOnce() -> Result<(u32, T), E>,
    ) -> Result<(T, oneshot::Receiver<WaitStatus>), E> {
        let mut table = self.lock();
        let (pid, extra) = spawn()?;
        let (tx, rx) = oneshot::channel();
        let pid = pid as i32;
        // A status left over from an earlier process with the same pid cannot be this child's
        // (it has not been reaped: we hold the lock), so it must not be handed out as such.
        table.unclaimed.remove(&pid);
        table.waiting.insert(pid, tx);
        Ok((extra, rx))
    }

    /// Collects every exited child and hands each status to whoever registered for it.
    pub fn reap(&self) {
        let mut table = self.lock();
        loop {
            let mut status: libc::c_int = 0;
            // SAFETY: waitpid only writes the status integer we pass a valid pointer to.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid == 0 {
                break;
            }
            if pid < 0 {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // ECHILD: no children at all.
                break;
            }
            let status = WaitStatus(status);
            match table.waiting.remove(&pid) {
                // The receiver may be gone (its server shut down); nothing to do then.
                Some(tx) => drop(tx.send(status)),
                None => {
                    table.unclaimed.insert(pid, (status, Instant::now()));
                }
            }
        }
        let now = Instant::now();
        table.unclaimed.retain(|_, (_, at)| now.duration_since(*at) < UNCLAIMED_TTL);
        if table.unclaimed.len() > UNCLAIMED_MAX {
            let mut oldest: Vec<(i32, Instant)> = table.unclaimed.iter().map(|(p, (_, at))| (*p, *at)).collect();
            oldest.sort_by_key(|(_, at)| *at);
            let excess = table.unclaimed.len() - UNCLAIMED_MAX;
            for (pid, _) in oldest.into_iter().take(excess) {
                table.unclaimed.remove(&pid);
            }
        }
    }

    /// Starts reaping on SIGCHLD on the current runtime. Every `serve` calls this: several
    /// listeners are harmless (the table is shared), and one survives when another's runtime ends.
    pub fn listen(&'static self) -> std::io::Result<()> {
        let mut sigchld = signal(SignalKind::child())?;
        tokio::spawn(async move {
            // Children that exited before the handler was installed sent no signal we saw.
            self.reap();
            while sigchld.recv().await.is_some() {
                self.reap();
            }
        });
        Ok(())
    }
}

/// Go's names for signals (`syscall.Signal.String()`), which envd's status strings use.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "hangup",
        libc::SIGINT => "interrupt",
        libc::SIGQUIT => "quit",
        libc::SIGILL => "illegal instruction",
        libc::SIGTRAP => "trace/breakpoint trap",
        libc::SIGABRT => "aborted",
        libc::SIGBUS => "bus error",
        libc::SIGFPE => "floating point exception",
        libc::SIGKILL => "killed",
        libc::SIGUSR1 => "user defined signal 1",
        libc::SIGSEGV => "segmentation fault",
        libc::SIGUSR2 => "user defined signal 2",
        libc::SIGPIPE => "broken pipe",
        libc::SIGALRM => "alarm clock",
        libc::SIGTERM => "terminated",
        libc::SIGSTKFLT => "stack fault",
        libc::SIGCHLD => "child exited",
        libc::SIGCONT => "continued",
        libc::SIGSTOP => "stopped (signal)",
        libc::SIGTSTP => "stopped",
        libc::SIGTTIN => "stopped (tty input)",
        libc::SIGTTOU => "stopped (tty output)",
        libc::SIGURG => "urgent I/O condition",
        libc::SIGXCPU => "CPU time limit exceeded",
        libc::SIGXFSZ => "file size limit exceeded",
        libc::SIGVTALRM => "virtual timer expired",
        libc::SIGPROF => "profiling timer expired",
        libc::SIGWINCH => "window changed",
        libc::SIGIO => "I/O possible",
        libc::SIGPWR => "power failure",
        libc::SIGSYS => "bad system call",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

impl WaitStatus {
    /// `(exit_code, exited, status)` as Go's `ProcessState` reports them: the code is -1 when
    /// the process did not exit by itself; the status reads `exit status 3` or `signal: killed`.
    pub fn describe(self) -> (i32, bool, String) {
        let s = self.0;
        if libc::WIFEXITED(s) {
            let code = libc::WEXITSTATUS(s);
            (code, true, format!("exit status {code}"))
        } else if libc::WIFSIGNALED(s) {
            let mut status = format!("signal: {}", signal_name(libc::WTERMSIG(s)));
            if libc::WCOREDUMP(s) {
                status.push_str(" (core dumped)");
            }
            (-1, false, status)
        } else {
            (-1, false, format!("unknown wait status {s:#x}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describes_like_go() {
        assert_eq!(WaitStatus(0).describe(), (0, true, "exit status 0".into()));
        assert_eq!(WaitStatus(3 << 8).describe(), (3, true, "exit status 3".into()));
        assert_eq!(WaitStatus(libc::SIGKILL).describe(), (-1, false, "signal: killed".into()));
        assert_eq!(WaitStatus(libc::SIGSEGV | 0x80).describe(), (-1, false, "signal: segmentation fault (core dumped)".into()));
        assert_eq!(signal_name(40), "signal 40");
    }
}
