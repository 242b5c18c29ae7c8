//! The link holder: a small process per gvisor sandbox made to outlive the process that made
//! it (`SandboxConfig::keep`: a server's), `cordon __gvisor-link`, which holds the host's ends of
//! the agent's stdio and serves the agent's socket from them. Other sandboxes (a one-shot
//! run's) keep the link in a thread of their maker, which costs no exec.
//!
//! The agent's link is one multiplexed session over `runsc run`'s stdin and stdout. Served by a
//! thread of the server, it died with the server: a session cut mid-frame cannot be taken up
//! again, and the pipes' last holder gone, the agent saw its end. The holder runs that same
//! thread (`launch::serve_link`) instead, in the sandbox's own cgroup (so that its end is the
//! sandbox's: a kill of the group, a reap), and takes three commands on a control socket in the
//! sandbox's directory, one line each, answered `ok` or `error: ...`: `park` and `wake` (a
//! checkpoint's), and `stop`. The server keeps a connection to it for the sandbox's life; when
//! that connection ends (the server exited), the holder waits for the next server's.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::launch::{self, Opening};
use crate::{io_err, GvisorError};

/// The holder's control socket, in the sandbox's directory.
pub const CONTROL: &str = "link.sock";

/// The descriptors the holder finds its ends at.
const FROM_AGENT: RawFd = 3;
const TO_AGENT: RawFd = 4;
const AGENT_LISTENER: RawFd = 5;
const CONTROL_LISTENER: RawFd = 6;

/// How long a command may take: a park waits for the agent (see `launch::PARK_DEADLINE`).
const COMMAND_DEADLINE: Duration = Duration::from_secs(30);

/// The server's end of the control connection.
pub struct Control {
    conn: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Control {
    /// Connects to the holder of the sandbox in `dir`.
    pub fn connect(dir: &Path) -> io::Result<Control> {
        let conn = UnixStream::connect(dir.join(CONTROL))?;
        conn.set_read_timeout(Some(COMMAND_DEADLINE))?;
        let reader = BufReader::new(conn.try_clone()?);
        Ok(Control { conn, reader })
    }

    fn ask(&mut self, command: &str) -> Result<(), GvisorError> {
        let said = (|| {
            self.conn.write_all(format!("{command}\n").as_bytes())?;
            let mut line = String::new();
            self.reader.read_line(&mut line)?;
            Ok::<_, io::Error>(line)
        })()
        .map_err(io_err(format!("ask the sandbox's link holder to {command}")))?;
        match said.trim_end() {
            "ok" => Ok(()),
            "" => Err(GvisorError::Setup(format!("the sandbox's link holder ended before it would {command}"))),
            other => Err(GvisorError::Setup(other.strip_prefix("error: ").unwrap_or(other).to_string())),
        }
    }

    /// Asks the agent to park its link (see `launch::LinkThread::park`).
    pub fn park(&mut self) -> Result<(), GvisorError> {
        self.ask("park")
    }

    /// Lets a parked agent serve again.
    pub fn wake(&mut self) -> Result<(), GvisorError> {
        self.ask("wake")
    }

    /// Ends the holder (the sandbox has ended, or is being destroyed).
    pub fn stop(mut self) {
        let _ = self.ask("stop");
    }
}

/// Starts the holder of a sandbox whose `runsc run` was just launched: it takes the host's ends
/// of the agent's stdio, the agent's socket and a control socket (both bound here, so that the
/// caller can connect as soon as this returns), joins the sandbox's cgroups and serves.
pub fn spawn(exe: &Path, dir: &Path, socket: &Path, from_agent: OwnedFd, to_agent: OwnedFd, opening: Opening, cgroup_procs: &[PathBuf]) -> Result<(std::process::Child, Control), GvisorError> {
    let agent = UnixListener::bind(socket).map_err(io_err("bind the agent socket"))?;
    let control_path = dir.join(CONTROL);
    let _ = std::fs::remove_file(&control_path);
    let control = UnixListener::bind(&control_path).map_err(io_err("bind the link holder's control socket"))?;
    let procs: Vec<std::fs::File> = cgroup_procs
        .iter()
        .map(|p| std::fs::OpenOptions::new().write(true).open(p))
        .collect::<io::Result<_>>()
        .map_err(io_err("open the sandbox's cgroups for its link holder"))?;
    let (config, resume) = match opening {
        Opening::Config(c) => (c, false),
        Opening::Resume => (Vec::new(), true),
    };
    let fds = [from_agent.as_raw_fd(), to_agent.as_raw_fd(), agent.as_raw_fd(), control.as_raw_fd()];
    let proc_fds: Vec<RawFd> = procs.iter().map(|f| f.as_raw_fd()).collect();
    let mut cmd = Command::new(exe);
    cmd.arg("__gvisor-link").arg(socket).stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::null());
    if resume {
        cmd.arg("--resume");
    }
    // SAFETY: between fork and exec only async-signal-safe calls on descriptors opened above:
    // a new session (no terminal's signals), the cgroups joined, then the four ends moved to
    // 3..=6 without close-on-exec. The sources are all above 6 or moved in an order that never
    // overwrites one not yet moved (each is dup'ed above the targets first).
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
            let mut high = [0; 4];
            for (i, fd) in fds.iter().enumerate() {
                high[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 16);
                if high[i] < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            for (i, fd) in high.iter().enumerate() {
                if libc::dup2(*fd, FROM_AGENT + i as RawFd) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(io_err(format!("start the link holder ({})", exe.display())))?;
    // The configuration goes first on the agent's stdin, written by the holder: it reads it here.
    let wrote = child.stdin.take().map(|mut s| s.write_all(&config));
    if let Some(Err(e)) = wrote {
        let _ = child.kill();
        let _ = child.wait();
        return Err(io_err("hand the agent's configuration to its link holder")(e));
    }
    drop((from_agent, to_agent, agent, control, procs));
    match Control::connect(dir) {
        Ok(c) => Ok((child, c)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(io_err("connect to the link holder")(e))
        }
    }
}

/// `cordon __gvisor-link SOCKET [--resume]`: the holder itself. Never returns.
pub fn main() -> ! {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(2).collect();
    let socket = args.first().map(PathBuf::from).unwrap_or_default();
    let resume = args.iter().any(|a| a == "--resume");
    let code = match serve(&socket, resume) {
        Ok(()) => 0,
        Err(_) => 1,
    };
    std::process::exit(code)
}

fn serve(socket: &Path, resume: bool) -> io::Result<()> {
    let mut config = Vec::new();
    io::stdin().lock().read_to_end(&mut config)?;
    // SAFETY: the four descriptors were put at these numbers by `spawn` and nothing else in
    // this process owns them.
    let (from_agent, to_agent, agent, control) = unsafe {
        (
            OwnedFd::from_raw_fd(FROM_AGENT),
            OwnedFd::from_raw_fd(TO_AGENT),
            UnixListener::from_raw_fd(AGENT_LISTENER),
            UnixListener::from_raw_fd(CONTROL_LISTENER),
        )
    };
    for fd in [&from_agent, &to_agent] {
        // SAFETY: fcntl on a descriptor this process owns.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    let opening = if resume { Opening::Resume } else { Opening::Config(config) };
    let link = launch::serve_link(from_agent, to_agent, agent, opening).map_err(|e| io::Error::other(e.to_string()))?;
    // One server at a time: the one that made it, then whichever adopts it.
    for conn in control.incoming() {
        let Ok(conn) = conn else { continue };
        let Ok(read_half) = conn.try_clone() else { continue };
        let mut out = conn;
        for line in BufReader::new(read_half).lines() {
            let Ok(line) = line else { break };
            let answer = match line.trim() {
                "park" => link.park(socket),
                "wake" => link.wake(),
                "stop" => {
                    let _ = out.write_all(b"ok\n");
                    link.stop();
                    return Ok(());
                }
                other => Err(GvisorError::Setup(format!("unknown command {other:?}"))),
            };
            let reply = match answer {
                Ok(()) => "ok\n".to_string(),
                Err(e) => format!("error: {}\n", e.to_string().replace('\n', " ")),
            };
            if out.write_all(reply.as_bytes()).is_err() {
                break;
            }
        }
    }
    Ok(())
}
