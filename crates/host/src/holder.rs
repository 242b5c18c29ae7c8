//! Plumbing shared by the tiers' link holders: the small processes that serve a kept sandbox's
//! links in its place so that they outlive the server that made it (`cordon __gvisor-link`,
//! `cordon __vm-link`). What a holder serves is its tier's business; this is how it is started
//! (its descriptors at 3 and up, a session of its own, in the sandbox's cgroups so that its end
//! is the sandbox's) and how a server talks to it: a control socket in the sandbox's directory,
//! one command a line, answered `ok`, `ok VALUE` or `error: MESSAGE`, one server at a time.

use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A holder's control socket, in the sandbox's directory.
pub const CONTROL: &str = "link.sock";

/// The first descriptor number a holder finds its ends at.
pub const FIRST_FD: RawFd = 3;

/// The most descriptors [`spawn`] hands over.
const MAX_FDS: usize = 8;

/// A server's connection to a holder.
pub struct Control {
    conn: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Control {
    /// Connects to the holder of the sandbox in `dir`; a command may take up to `deadline`.
    pub fn connect(dir: &Path, deadline: Duration) -> io::Result<Control> {
        let conn = UnixStream::connect(dir.join(CONTROL))?;
        conn.set_read_timeout(Some(deadline))?;
        let reader = BufReader::new(conn.try_clone()?);
        Ok(Control { conn, reader })
    }

    /// Sends `command`: `Ok(Ok(value))` for `ok [VALUE]`, `Ok(Err(message))` for an error or a
    /// holder that ended before it answered, `Err` when the connection failed.
    pub fn ask(&mut self, command: &str) -> io::Result<Result<String, String>> {
        self.conn.write_all(format!("{command}\n").as_bytes())?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        Ok(match line.trim_end() {
            "ok" => Ok(String::new()),
            "" => Err(format!("the link holder ended before it would {command}")),
            other => match other.strip_prefix("ok ") {
                Some(value) => Ok(value.to_string()),
                None => Err(other.strip_prefix("error: ").unwrap_or(other).to_string()),
            },
        })
    }
}

/// Binds a holder's control socket in `dir` (replacing one a dead holder left), before the
/// holder starts, so that its maker can connect as soon as it is spawned.
pub fn bind_control(dir: &Path) -> io::Result<UnixListener> {
    let path = dir.join(CONTROL);
    let _ = std::fs::remove_file(&path);
    UnixListener::bind(&path)
}

/// Starts `cmd` as a holder: `fds` at [`FIRST_FD`] and up in that order (without
/// close-on-exec), a session of its own (no terminal's signals), in the groups whose
/// `cgroup.procs` files are `cgroup_procs`, and `stdin` written to its standard input, which
/// is then closed. Its stdout and stderr are `/dev/null`.
pub fn spawn(mut cmd: Command, fds: &[RawFd], cgroup_procs: &[PathBuf], stdin: &[u8]) -> io::Result<Child> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors for a link holder"));
    }
    let procs: Vec<std::fs::File> = cgroup_procs.iter().map(|p| std::fs::OpenOptions::new().write(true).open(p)).collect::<io::Result<_>>()?;
    let proc_fds: Vec<RawFd> = procs.iter().map(|f| f.as_raw_fd()).collect();
    let fds = fds.to_vec();
    cmd.stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::null());
    // SAFETY: between fork and exec only async-signal-safe calls on descriptors opened before
    // the fork: a new session, the cgroups joined, then the ends moved into place. Each is
    // first dup'ed above every target, so that no move overwrites one not yet moved.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            for f in &proc_fds {
                if libc::write(*f, b"0".as_ptr().cast(), 1) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            let mut high = [0; MAX_FDS];
            for (i, fd) in fds.iter().enumerate() {
                high[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, FIRST_FD + MAX_FDS as RawFd + 8);
                if high[i] < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            for (i, fd) in high.iter().take(fds.len()).enumerate() {
                if libc::dup2(*fd, FIRST_FD + i as RawFd) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    drop(procs);
    let wrote = child.stdin.take().map(|mut s| s.write_all(stdin));
    if let Some(Err(e)) = wrote {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    Ok(child)
}

/// What a holder answers to one command.
pub enum Reply {
    Ok(String),
    Error(String),
    /// Answers `ok`, then [`serve_control`] returns: the holder ends.
    Stop,
}

/// Serves the control socket: one connection at a time (the server that made the sandbox,
/// then whichever adopts it), each command line given to `answer`. Returns on [`Reply::Stop`].
pub fn serve_control(control: &UnixListener, mut answer: impl FnMut(&str) -> Reply) {
    for conn in control.incoming() {
        let Ok(conn) = conn else { continue };
        let Ok(read_half) = conn.try_clone() else { continue };
        let mut out = conn;
        for line in BufReader::new(read_half).lines() {
            let Ok(line) = line else { break };
            let reply = match answer(line.trim()) {
                Reply::Ok(v) if v.is_empty() => "ok\n".to_string(),
                Reply::Ok(v) => format!("ok {}\n", v.replace('\n', " ")),
                Reply::Error(e) => format!("error: {}\n", e.replace('\n', " ")),
                Reply::Stop => {
                    let _ = out.write_all(b"ok\n");
                    return;
                }
            };
            if out.write_all(reply.as_bytes()).is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_s_answer_reaches_its_sender_and_stop_ends_the_holder() {
        let dir = std::env::temp_dir().join(format!("cordon-holder-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let listener = bind_control(&dir).unwrap();
        let served = std::thread::spawn(move || {
            serve_control(&listener, |cmd| match cmd {
                "pid" => Reply::Ok("42".into()),
                "park" => Reply::Ok(String::new()),
                "stop" => Reply::Stop,
                other => Reply::Error(format!("unknown command {other:?}\nsecond line")),
            })
        });
        // The first server goes away mid-life; the next one is served.
        drop(Control::connect(&dir, Duration::from_secs(5)).unwrap());
        let mut c = Control::connect(&dir, Duration::from_secs(5)).unwrap();
        assert_eq!(c.ask("pid").unwrap(), Ok("42".into()));
        assert_eq!(c.ask("park").unwrap(), Ok(String::new()));
        assert_eq!(c.ask("dance").unwrap(), Err("unknown command \"dance\" second line".into()));
        assert_eq!(c.ask("stop").unwrap(), Ok(String::new()));
        served.join().unwrap();
        assert!(!matches!(c.ask("pid"), Ok(Ok(_))), "a holder that stopped answered");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
