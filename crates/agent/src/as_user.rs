//! File operations with the credentials of the user they are for.
//!
//! The agent is root; a file API call names a user (`username=`, Basic auth, or the default
//! user). Run as root, the call would write through a symlink that user planted (to
//! `/etc/shadow`, say) and read what only root may. So each operation runs inside [`as_user`],
//! which gives the calling thread that user's effective uid and gid and supplementary groups
//! for the duration of one synchronous closure, then gives root back. The kernel then checks
//! every path walk, open, create, rename and unlink as it would for the user's own process, and
//! what is created belongs to the user without any chown.
//!
//! Why this shape:
//! - Credentials are per thread in the kernel (and in gVisor's sentry). The switch uses the
//!   raw per-thread system calls (rustix's `set_thread_*`); the C library's `setresuid` and
//!   `setgroups` would change every thread of the agent at once.
//! - The effective uid, not `setfsuid`: gVisor answers `setfsuid` with `ENOSYS`, and the agent
//!   is one binary on every tier. While the effective uid is not 0 the kernel clears the
//!   effective capabilities (no `CAP_DAC_OVERRIDE`, `CAP_FOWNER`, ...); the real and saved uid
//!   stay 0, so switching back needs no privilege and restores them, and a process of the
//!   user can neither signal nor ptrace the agent meanwhile (both look at the real and saved
//!   uid).
//! - On the calling thread itself, around a closure that cannot yield: the agent's runtime is
//!   single-threaded and file operations already ran inline on it, so nothing else runs on
//!   that thread while it is switched, and no helper thread or process is needed.

use std::io;

use rustix::process::{Gid, Uid};
use rustix::thread::{set_thread_groups, set_thread_res_gid, set_thread_res_uid};

use crate::users::User;

/// Whether this agent can take on another user's credentials (it is root). An agent that is
/// not (the in-process agents of tests run as whoever runs them) acts as itself, which is never
/// more than that user may do.
fn privileged() -> bool {
    rustix::process::geteuid().is_root()
}

/// Root's credentials of the calling thread, taken back when dropped.
struct Switched {
    gid: Gid,
    groups: Vec<Gid>,
}

impl Drop for Switched {
    fn drop(&mut self) {
        // The uid first: with it come the capabilities that the gid and groups need.
        let restored = set_thread_res_uid(None, Some(Uid::ROOT), None)
            .and_then(|()| set_thread_res_gid(None, Some(self.gid), None))
            .and_then(|()| set_thread_groups(&self.groups));
        if let Err(e) = restored {
            // The thread would go on serving everyone with one user's rights. Going back to
            // a uid that is still the real and saved one cannot fail short of a broken kernel.
            eprintln!("cordon-agent: cannot restore root's credentials after a file operation: {e}");
            std::process::abort();
        }
    }
}

/// Runs `f` on the calling thread with `user`'s effective uid, gid and supplementary groups.
/// `f` must not yield to other tasks (it is a plain closure, so it cannot await). Fails, without
/// running `f`, only when the switch is refused.
pub(crate) fn as_user<T>(user: &User, f: impl FnOnce() -> T) -> io::Result<T> {
    if !privileged() || user.uid == 0 {
        return Ok(f());
    }
    // From its making on, the guard restores whatever part of the switch happened.
    let guard = Switched { gid: rustix::process::getegid(), groups: rustix::process::getgroups()? };
    let groups: Vec<Gid> = user.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    let switch = || -> io::Result<()> {
        set_thread_groups(&groups)?;
        set_thread_res_gid(None, Some(Gid::from_raw(user.gid)), None)?;
        set_thread_res_uid(None, Some(Uid::from_raw(user.uid)), None)?;
        Ok(())
    };
    switch().map_err(|e| io::Error::new(e.kind(), format!("cannot take the credentials of user '{}': {e}", user.name)))?;
    let out = f();
    drop(guard);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn nobody() -> User {
        User { name: "nobody".into(), uid: 65534, gid: 65534, home: "/".into(), groups: vec![65534, 4242] }
    }

    #[test]
    fn switches_this_thread_only_and_back() {
        if !privileged() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = std::env::temp_dir().join(format!("cordon-as-user-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("secret");
        std::fs::write(&secret, "root only").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();

        let (other_tx, other_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        // Another thread keeps root's rights while this one is switched.
        let other = std::thread::spawn(move || {
            other_rx.recv().unwrap();
            let r = std::fs::read_to_string(std::env::temp_dir().join(format!("cordon-as-user-{}/secret", std::process::id())));
            done_tx.send(()).unwrap();
            r
        });
        let inside = as_user(&nobody(), || {
            other_tx.send(()).unwrap();
            done_rx.recv().unwrap();
            let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
            let line = |k: &str| status.lines().find(|l| l.starts_with(k)).unwrap().to_string();
            let created = dir.join("made-by-nobody");
            std::fs::write(&created, "x").unwrap();
            let md = std::fs::metadata(&created).unwrap();
            (std::fs::read_to_string(&secret).map_err(|e| e.kind()), line("Uid:"), line("Groups:"), line("CapEff:"), (md.uid(), md.gid()))
        })
        .unwrap();
        assert_eq!(inside.0, Err(io::ErrorKind::PermissionDenied));
        assert!(inside.1.split_whitespace().eq(["Uid:", "0", "65534", "0", "65534"]), "{}", inside.1);
        assert!(inside.2.split_whitespace().eq(["Groups:", "4242", "65534"]), "{}", inside.2);
        assert!(inside.3.ends_with("0000000000000000"), "{}", inside.3);
        assert_eq!(inside.4, (65534, 65534));
        assert_eq!(other.join().unwrap().unwrap(), "root only", "the other thread stayed root");
        // And this thread is root again.
        assert_eq!(std::fs::read_to_string(&secret).unwrap(), "root only");
        assert!(rustix::process::geteuid().is_root());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
