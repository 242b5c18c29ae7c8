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

use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use cordon_host::holder::{self, Reply};

use crate::launch::{self, Opening};
use crate::{io_err, GvisorError};

/// The descriptors the holder finds its ends at.
const FROM_AGENT: RawFd = holder::FIRST_FD;
const TO_AGENT: RawFd = FROM_AGENT + 1;
const AGENT_LISTENER: RawFd = FROM_AGENT + 2;
const CONTROL_LISTENER: RawFd = FROM_AGENT + 3;

/// How long a command may take: a park waits for the agent (see `launch::PARK_DEADLINE`).
const COMMAND_DEADLINE: Duration = Duration::from_secs(30);

/// The server's end of the control connection.
pub struct Control(holder::Control);

impl Control {
    /// Connects to the holder of the sandbox in `dir`.
    pub fn connect(dir: &Path) -> io::Result<Control> {
        holder::Control::connect(dir, COMMAND_DEADLINE).map(Control)
    }

    fn ask(&mut self, command: &str) -> Result<(), GvisorError> {
        match self.0.ask(command).map_err(io_err(format!("ask the sandbox's link holder to {command}")))? {
            Ok(_) => Ok(()),
            Err(e) => Err(GvisorError::Setup(e)),
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
    let control = holder::bind_control(dir).map_err(io_err("bind the link holder's control socket"))?;
    let (config, resume) = match opening {
        Opening::Config(c) => (c, false),
        Opening::Resume => (Vec::new(), true),
    };
    let mut cmd = Command::new(exe);
    cmd.arg("__gvisor-link").arg(socket);
    if resume {
        cmd.arg("--resume");
    }
    // The configuration goes first on the agent's stdin, written by the holder: it reads it here.
    let fds = [from_agent.as_raw_fd(), to_agent.as_raw_fd(), agent.as_raw_fd(), control.as_raw_fd()];
    let mut child = holder::spawn(cmd, &fds, cgroup_procs, &config).map_err(io_err(format!("start the link holder ({})", exe.display())))?;
    drop((from_agent, to_agent, agent, control));
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
    holder::serve_control(&control, |command| {
        let answer = match command {
            "park" => link.park(socket),
            "wake" => link.wake(),
            "stop" => return Reply::Stop,
            other => Err(GvisorError::Setup(format!("unknown command {other:?}"))),
        };
        match answer {
            Ok(()) => Reply::Ok(String::new()),
            Err(e) => Reply::Error(e.to_string()),
        }
    });
    link.stop();
    Ok(())
}
