//! The link holder of a VM made to outlive the process that made it (`VmConfig::keep`: a
//! server's): `cordon __vm-link`, a small process that holds the host's ends of the VM's links
//! and serves its agent's. Other VMs (a one-shot run's, a template's) keep the link in a thread
//! of their maker, which costs no exec.
//!
//! The agent's link is one multiplexed session over a virtio-serial port. Served by a thread of
//! the server, it died with the server: a session cut mid-frame cannot be taken up again, and
//! the guest, its link closed, powers off. The holder serves it instead (`crate::serve_agent`,
//! the same code the thread runs), in the VM's own cgroups so that its end is the VM's (a kill
//! of the group, a reap). It also holds a copy of the host's end of the VMM's monitor and of
//! the network link, which a server that adopts the VM takes with `pidfd_getfd` (a datagram
//! pair and a monitor connection have no name to open again). It takes five commands on a
//! control socket in the VM's directory (`cordon_host::holder`'s protocol): `ready` (the first
//! handshake's result), `pid` (for an adopter's `pidfd_getfd`), `park` and `wake` (a save's),
//! and `stop`. The server keeps a
//! connection to it for the VM's life; when that connection ends (the server exited), the
//! holder waits for the next server's.

use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use cordon_host::holder::{self, Reply};
use serde::{Deserialize, Serialize};

use crate::link_handshake::GuestConfig;
use crate::{io_err, Handshake, LinkControls, VmError, BOOT_DEADLINE};

/// The descriptors the holder finds its ends at: the agent link, the agent's socket, its
/// control socket, the monitor and (with `--net`) the network link.
const AGENT_LINK: RawFd = holder::FIRST_FD;
const AGENT_LISTENER: RawFd = AGENT_LINK + 1;
const CONTROL_LISTENER: RawFd = AGENT_LINK + 2;
const MONITOR: RawFd = AGENT_LINK + 3;
const NET: RawFd = AGENT_LINK + 4;

/// How long a command may take: a park waits for the guest, `ready` for a resumed one.
const COMMAND_DEADLINE: Duration = Duration::from_secs(120);

/// What the holder reads on its stdin: how the link opens, and the guest's config (sent again,
/// with a fresh seed, at each wake).
#[derive(Serialize, Deserialize)]
struct Opening {
    /// `fresh`, `restored` or `resumed` (see [`Handshake`]).
    handshake: String,
    guest: GuestConfig,
}

/// The server's end of the control connection.
pub(crate) struct Control(holder::Control);

impl Control {
    /// Connects to the holder of the VM in `dir`.
    pub fn connect(dir: &Path) -> io::Result<Control> {
        holder::Control::connect(dir, COMMAND_DEADLINE).map(Control)
    }

    /// Sends `command` and returns what follows `ok` in the answer.
    fn ask(&mut self, command: &str) -> Result<String, VmError> {
        self.0.ask(command).map_err(io_err(format!("ask the VM's link holder to {command}")))?.map_err(VmError::Boot)
    }

    /// Waits for the first handshake (a resumed guest's answer to its wake).
    pub fn ready(&mut self) -> Result<(), VmError> {
        self.ask("ready").map(drop)
    }

    /// Asks the agent to park its link and waits until it has.
    pub fn park(&mut self) -> Result<(), VmError> {
        self.ask("park").map(drop)
    }

    /// Lets a parked guest serve again, with a fresh seed.
    pub fn wake(&mut self) -> Result<(), VmError> {
        self.ask("wake").map(drop)
    }

    /// Ends the holder (the VM has ended, or is being destroyed).
    pub fn stop(mut self) {
        let _ = self.ask("stop");
    }

    /// Copies of the holder's ends of the monitor and (with `net`) the network link, taken from
    /// the holder with `pidfd_getfd`: what an adopter needs besides the agent's socket.
    pub fn take_ends(&mut self, net: bool) -> Result<(UnixStream, Option<OwnedFd>), VmError> {
        // Asked, not read from the connection's credentials: those are the listener's at
        // `listen()`, the server that bound the socket for the holder.
        let pid: libc::pid_t = self.ask("pid")?.parse().map_err(|_| VmError::Boot("the VM's link holder did not say its pid".into()))?;
        let copied = (|| {
            let pidfd = cordon_host::sys::pidfd_open(pid)?;
            let monitor = UnixStream::from(getfd(&pidfd, MONITOR)?);
            let net = if net { Some(getfd(&pidfd, NET)?) } else { None };
            Ok((monitor, net))
        })();
        copied.map_err(io_err("copy the monitor and network ends from the VM's link holder"))
    }
}

/// A copy of descriptor `fd` of the process behind `pidfd`.
fn getfd(pidfd: &OwnedFd, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd on a pidfd we own; it returns a new descriptor (close-on-exec) that
    // nothing else owns, or -1.
    let new = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned by the kernel, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(new as RawFd) })
}

/// The ends [`spawn`] hands over.
pub(crate) struct Ends {
    pub agent_link: UnixStream,
    pub agent_listener: UnixListener,
    pub monitor: UnixStream,
    pub net: Option<OwnedFd>,
}

/// Starts the holder of a VM whose VMM was just started: it takes the ends, binds its control
/// socket (here, so that the caller can connect as soon as this returns), joins the VM's
/// cgroups and serves.
pub(crate) fn spawn(exe: &Path, dir: &Path, socket: &Path, ends: Ends, handshake: &Handshake, cgroup_procs: &[PathBuf]) -> Result<(std::process::Child, Control), VmError> {
    let (kind, guest) = match handshake {
        Handshake::Fresh(g) => ("fresh", g),
        Handshake::Restored(g) => ("restored", g),
        Handshake::Resumed(g) => ("resumed", g),
        Handshake::Template => return Err(VmError::BadRequest("a template's link is served by its maker".into())),
    };
    let opening = serde_json::to_vec(&Opening { handshake: kind.into(), guest: guest.clone() }).map_err(|e| io_err("encode the link holder's opening")(io::Error::other(e)))?;
    let control = holder::bind_control(dir).map_err(io_err("bind the link holder's control socket"))?;
    let mut fds = vec![ends.agent_link.as_raw_fd(), ends.agent_listener.as_raw_fd(), control.as_raw_fd(), ends.monitor.as_raw_fd()];
    if let Some(n) = &ends.net {
        fds.push(n.as_raw_fd());
    }
    let mut cmd = Command::new(exe);
    cmd.arg("__vm-link").arg(socket);
    if ends.net.is_some() {
        cmd.arg("--net");
    }
    let mut child = holder::spawn(cmd, &fds, cgroup_procs, &opening).map_err(io_err(format!("start the VM's link holder ({})", exe.display())))?;
    drop((ends, control));
    match Control::connect(dir) {
        Ok(c) => Ok((child, c)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(io_err("connect to the VM's link holder")(e))
        }
    }
}

/// `cordon __vm-link SOCKET [--net]`: the holder itself. Never returns.
pub fn main() -> ! {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(2).collect();
    let socket = args.first().map(PathBuf::from).unwrap_or_default();
    let net = args.iter().any(|a| a == "--net");
    let code = match serve(&socket, net) {
        Ok(()) => 0,
        Err(_) => 1,
    };
    std::process::exit(code)
}

fn serve(socket: &Path, net: bool) -> io::Result<()> {
    let mut raw = Vec::new();
    io::stdin().lock().read_to_end(&mut raw)?;
    let opening: Opening = serde_json::from_slice(&raw).map_err(io::Error::other)?;
    // SAFETY: these descriptors were put at these numbers by `spawn` and nothing else in this
    // process owns them. The monitor and network ends are only held, for an adopter to copy.
    let (agent_link, agent_listener, control, _monitor, _net) = unsafe {
        (
            UnixStream::from_raw_fd(AGENT_LINK),
            UnixListener::from_raw_fd(AGENT_LISTENER),
            UnixListener::from_raw_fd(CONTROL_LISTENER),
            OwnedFd::from_raw_fd(MONITOR),
            net.then(|| OwnedFd::from_raw_fd(NET)),
        )
    };
    for fd in [agent_link.as_raw_fd(), agent_listener.as_raw_fd(), control.as_raw_fd()] {
        // SAFETY: fcntl on a descriptor this process owns.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    agent_listener.set_nonblocking(true)?;
    let guest = opening.guest;
    let handshake = match opening.handshake.as_str() {
        "fresh" => Handshake::Fresh(guest.clone()),
        "restored" => Handshake::Restored(guest.clone()),
        "resumed" => Handshake::Resumed(guest.clone()),
        other => return Err(io::Error::other(format!("unknown handshake {other:?}"))),
    };
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let (link, controls) = LinkControls::pair(agent_link, agent_listener, guest);
    // Detached: it ends with the link, and the holder with the VM's groups.
    std::thread::spawn(move || crate::serve_agent(link, handshake, ready_tx, &mut || {}));
    // Whether the first handshake's result was taken already (a fresh start sends none).
    let mut ready_seen = false;
    // One server at a time: the one that made the VM, then whichever adopts it.
    holder::serve_control(&control, |command| {
        let answer: Result<String, String> = match command {
            "ready" if ready_seen => Ok(String::new()),
            "ready" => {
                ready_seen = true;
                match ready_rx.recv_timeout(BOOT_DEADLINE) {
                    Ok(r) => r.map(|()| String::new()).map_err(|e| e.to_string()),
                    Err(_) => Err("the resumed guest did not answer its wake".into()),
                }
            }
            "pid" => Ok(std::process::id().to_string()),
            "park" => controls.park(socket).map(|()| String::new()).map_err(|e| format!("the guest did not park its link: {e}")),
            "wake" => controls.wake().map(|()| String::new()).map_err(|e| e.to_string()),
            "stop" => return Reply::Stop,
            other => Err(format!("unknown command {other:?}")),
        };
        match answer {
            Ok(v) => Reply::Ok(v),
            Err(e) => Reply::Error(e),
        }
    });
    Ok(())
}
