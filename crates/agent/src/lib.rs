//! `cordon-agent`: the init process of every sandbox. It serves the E2B envd protocol —
//! Connect services `process.Process` and `filesystem.Filesystem`, plus HTTP `/files`, `/health`
//! and `/init` (the host gives a sandbox started ahead of its create that create's `envVars`) —
//! and one cordon question of the host's ([`SAVEABLE_PATH`]) over a Unix socket that only the
//! host can reach, and reaps every orphan of the sandbox as PID 1.
//!
//! The host starts it with `CORDON_AGENT_CONFIG_FD` (a descriptor carrying an [`AgentConfig`],
//! see [`encode_config`]) and either `CORDON_AGENT_FD` (an inherited, listening `AF_UNIX` socket)
//! or, where the sandbox has only one byte stream to the host, `CORDON_AGENT_LINK` (see
//! [`Link`]): the host multiplexes its connections over that stream with `cordon-channel`. Either
//! way the host treats everything the agent says as untrusted.
//!
//! The configuration travels on a descriptor, not in the environment: the kernel caps one
//! environment string at 128 KiB, and a sandbox's variables may take up to a MiB together.

use std::os::fd::{FromRawFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;

use cordon_envd::connect::ConnectError;
use serde::{Deserialize, Serialize};

mod as_user;
mod body;
mod command_scope;
mod fdio;
mod files;
mod filesystem;
mod forward;
mod http;
mod init;
pub mod park;
mod process;
mod process_rpc;
mod pty;
mod reaper;
mod rpc;
mod saveable;
mod users;
mod watch;
mod xattr;

/// Environment variable naming the inherited listening socket.
pub const ENV_FD: &str = "CORDON_AGENT_FD";
/// Environment variable naming the link to serve on instead of a listening socket (see [`Link`]).
pub const ENV_LINK: &str = "CORDON_AGENT_LINK";
/// Environment variable naming the descriptor the [`AgentConfig`] is read from, framed as
/// [`encode_config`] frames it (a sealed memfd, or the start of the link itself).
pub const ENV_CONFIG_FD: &str = "CORDON_AGENT_CONFIG_FD";
/// Largest configuration the agent accepts: the sandbox's variables (at most a MiB, see
/// `cordon_spec::MAX_ENV_TOTAL`) with the image's and room to spare.
pub const MAX_CONFIG: usize = 4 << 20;

/// The configuration as the agent reads it from its descriptor: a 4-byte little-endian length,
/// then that many bytes of JSON. The length lets it share a stream with what follows.
pub fn encode_config(config: &AgentConfig) -> Vec<u8> {
    let json = serde_json::to_vec(config).expect("an AgentConfig serialises");
    let mut out = Vec::with_capacity(4 + json.len());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

/// Reads one framed configuration (see [`encode_config`]) from `fd`, and nothing after it.
fn read_config(fd: RawFd) -> Result<AgentConfig, StartError> {
    use std::io::Read;
    // SAFETY: the host hands this descriptor over for the configuration; it is borrowed (as a
    // File that is never dropped) only for these reads.
    let mut file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    let mut len = [0u8; 4];
    file.read_exact(&mut len).map_err(StartError::ReadConfig)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_CONFIG {
        return Err(StartError::ConfigTooLarge(len));
    }
    let mut json = vec![0u8; len];
    file.read_exact(&mut json).map_err(StartError::ReadConfig)?;
    serde_json::from_slice(&json).map_err(StartError::BadConfig)
}

/// Makes the agent non-dumpable: no process of the sandbox, root included, may then open its
/// memory, descriptors or environment through /proc or attach to it, unless it holds
/// CAP_SYS_PTRACE over the agent's user namespace, which no tier grants inside. The flag
/// survives until the agent's own exec (it never execs; commands are fresh processes and get
/// the kernel's default back at their exec).
pub fn make_undumpable() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn default_root() -> PathBuf {
    PathBuf::from("/")
}

/// How the host configures the agent of one sandbox.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct AgentConfig {
    /// The sandbox's id (for messages).
    pub sandbox_id: String,
    /// The user commands and file operations run as when a request names none (`user`).
    pub default_user: String,
    /// Default working directory of commands; `None` means the user's home.
    pub workdir: Option<String>,
    /// Sandbox-level environment (image defaults, then the user's): applied after
    /// `PATH`/`HOME`/`USER`/`LOGNAME` and before each command's own variables.
    pub env: Vec<(String, String)>,
    /// Where `etc/passwd` and `etc/group` are read from: `/` in a sandbox.
    #[serde(default = "default_root")]
    pub root: PathBuf,
    /// The envd version the agent stands in for (reported to clients by the host).
    #[serde(default)]
    pub envd_version: Option<String>,
    /// Put each command into a Landlock domain of its own, so that no command reads another's
    /// (or the agent's) memory through /proc (see `command_scope`); the ns tier sets it when
    /// ptrace is off.
    #[serde(default)]
    pub isolate_commands: bool,
}

/// State shared by all connections of one agent.
pub(crate) struct Agent {
    pub config: AgentConfig,
    /// The sandbox-level environment: `config.env`, then what `POST /init` merged in.
    env: std::sync::RwLock<Vec<(String, String)>>,
    pub processes: Arc<process::Processes>,
    pub watchers: watch::Watchers,
}

impl Agent {
    /// The sandbox-level environment now (see [`AgentConfig::env`]).
    pub fn env(&self) -> Vec<(String, String)> {
        self.env.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Merges a create's `envVars` into it (see `init.rs`).
    pub fn merge_env(&self, add: std::collections::BTreeMap<String, String>) {
        let mut env = self.env.write().unwrap_or_else(|p| p.into_inner());
        *env = init::merged(std::mem::take(&mut *env), add);
    }

    /// A fresh snapshot of the user database.
    pub fn users(&self) -> users::UserDb {
        users::UserDb::load(&self.config.root)
    }

    /// The user a call runs as: the one named by `Authorization: Basic`, else the default.
    pub fn user(&self, ctx: &rpc::CallCtx) -> Result<users::User, ConnectError> {
        let name = match &ctx.auth_user {
            Some(Ok(n)) => n.clone(),
            Some(Err(())) => return Err(ConnectError::unauthenticated("invalid authorization header")),
            None => self.config.default_user.clone(),
        };
        self.users()
            .user(&name)
            .ok_or_else(|| ConnectError::unauthenticated(format!("invalid username: '{name}'")))
    }
}

/// The agent of `serve` and `serve_link`. The shared child reaper listens first: it must be
/// collecting exits before the agent can spawn anything.
fn start_agent(config: AgentConfig) -> std::io::Result<Arc<Agent>> {
    reaper::global().listen()?;
    Ok(Arc::new(Agent {
        processes: Arc::new(process::Processes::new(command_scope::Scope::prepare(config.isolate_commands))),
        env: std::sync::RwLock::new(config.env.clone()),
        config,
        watchers: watch::Watchers::default(),
    }))
}

/// Serves the envd protocol on `listener` until accepting fails for good.
///
/// Every `serve` in a process shares one child reaper, so several agents (as in tests) never
/// take each other's exit statuses; it must run inside a tokio runtime with IO and time enabled.
pub async fn serve(listener: tokio::net::UnixListener, config: AgentConfig) -> std::io::Result<()> {
    let agent = start_agent(config)?;
    http::run(listener, agent).await
}

/// Serves the envd protocol on every stream the host opens over `link` (see `cordon-channel`),
/// until the host closes it. Same runtime requirements as [`serve`].
pub async fn serve_link<L>(link: L, config: AgentConfig) -> std::io::Result<()>
where
    L: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let agent = start_agent(config)?;
    http::run_link(link, agent).await.map(drop)
}

/// How one session of a link ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkEnd {
    /// The host closed it (or it broke): the sandbox is going away.
    Closed,
    /// The host asked the agent to let go of the link (see [`PARK_REQUEST`]): the agent closed
    /// its multiplexer cleanly, at a frame boundary, and waits for the host to come back; its
    /// processes, their output and its watchers are kept.
    Parked,
}

/// The first bytes of a stream by which the host asks the agent to park its link, before the
/// VM is saved (a pause, a fork). It starts with a NUL, which no HTTP request does, so a
/// client of the sandbox, whose bytes reach the agent only as HTTP the host's proxy wrote,
/// cannot send it.
pub const PARK_REQUEST: &[u8; 16] = b"\0cordon-park-v1\n";
pub use park::{await_parked, await_resume, PARKED, RESUME};
/// Go's name of a signal, as an end event's `status` (`signal: <name>`) spells it.
pub use reaper::signal_name;

/// The host asks here, before it checkpoints a gvisor sandbox, whether its processes can be
/// saved: 204 when they can, 409 with the reason as text when not (see `saveable.rs`).
pub const SAVEABLE_PATH: &str = "/cordon/saveable";

/// An agent that outlives its link: the guest's PID 1 serves one session per host connection
/// (a VM that is saved and restored gets a new one), with one process table throughout.
pub struct LinkAgent {
    agent: Arc<Agent>,
}

impl LinkAgent {
    pub fn start(config: AgentConfig) -> std::io::Result<LinkAgent> {
        Ok(LinkAgent { agent: start_agent(config)? })
    }

    /// Serves one session of the link, until the host closes it or parks it.
    pub async fn serve<L>(&self, link: L) -> std::io::Result<LinkEnd>
    where
        L: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        http::run_link(link, self.agent.clone()).await
    }
}

/// The one byte stream to the host, as `CORDON_AGENT_LINK` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Link {
    /// `stdio`: read from descriptor 0, write to descriptor 1 (a container init's pipes).
    Stdio,
    /// `fd:N`: one inherited bidirectional descriptor (a socket).
    Fd(RawFd),
    /// A path: a character device opened read-write (a virtio-serial port).
    Device(PathBuf),
}

impl std::str::FromStr for Link {
    type Err = String;
    fn from_str(s: &str) -> Result<Link, String> {
        if s == "stdio" {
            return Ok(Link::Stdio);
        }
        if let Some(n) = s.strip_prefix("fd:") {
            return n.parse::<RawFd>().ok().filter(|n| *n >= 0).map(Link::Fd).ok_or_else(|| format!("{ENV_LINK}={s:?}: fd:N needs a descriptor number"));
        }
        if s.starts_with('/') {
            return Ok(Link::Device(PathBuf::from(s)));
        }
        Err(format!("{ENV_LINK}={s:?}: use stdio, fd:N or a device path"))
    }
}

/// Moves `fd` to a fresh close-on-exec descriptor, so that commands never inherit the link.
fn take_fd(fd: RawFd) -> std::io::Result<std::os::fd::OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC with integer arguments; the result is a new descriptor we own.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if new < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `new` was just created and nothing else refers to it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(new) })
}

/// The two ends of the link as descriptors the agent keeps: a session's multiplexer runs on
/// copies of them, and a parked agent reads and writes them directly.
struct LinkFds {
    read: std::os::fd::OwnedFd,
    write: std::os::fd::OwnedFd,
}

impl LinkFds {
    fn session(&self) -> std::io::Result<cordon_channel::FdLink> {
        cordon_channel::FdLink::new(self.read.try_clone()?, self.write.try_clone()?)
    }

    /// Says it is parked and waits for the host's resume, blocking (see [`park`]).
    fn park(&self) -> std::io::Result<()> {
        use std::io::Write;
        for fd in [&self.read, &self.write] {
            blocking(fd)?;
        }
        std::fs::File::from(self.write.try_clone()?).write_all(PARKED)?;
        await_resume(&mut std::fs::File::from(self.read.try_clone()?))
    }
}

/// Clears `O_NONBLOCK`, which a session's multiplexer set on the link's file.
fn blocking(fd: &std::os::fd::OwnedFd) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl with integer arguments on an open descriptor.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Opens the link. For `stdio`, descriptors 0 and 1 then point at /dev/null: the link lives on
/// close-on-exec copies only.
fn open_link(link: &Link) -> std::io::Result<LinkFds> {
    match link {
        Link::Stdio => {
            let (read, write) = (take_fd(0)?, take_fd(1)?);
            let null = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null")?;
            for fd in [0, 1] {
                // SAFETY: dup2 onto the standard descriptors, whose old files live on in `r`/`w`.
                if unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), fd) } < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(LinkFds { read, write })
        }
        Link::Fd(fd) => {
            let owned = take_fd(*fd)?;
            // SAFETY: close the original number; the link lives on in `owned`.
            unsafe { libc::close(*fd) };
            Ok(LinkFds { write: owned.try_clone()?, read: owned })
        }
        Link::Device(path) => {
            use std::os::unix::fs::OpenOptionsExt;
            let f = std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC | libc::O_NOCTTY).open(path)?;
            let owned = std::os::fd::OwnedFd::from(f);
            Ok(LinkFds { write: owned.try_clone()?, read: owned })
        }
    }
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
enum StartError {
    /// A required environment variable is missing.
    #[error("{0} is not set")]
    MissingEnv(&'static str),
    /// The descriptor variable is not a number.
    #[error("{ENV_FD}={0:?} is not a file descriptor number")]
    BadFd(String),
    /// The configuration descriptor variable is not a number.
    #[error("{ENV_CONFIG_FD}={0:?} is not a file descriptor number")]
    BadConfigFd(String),
    /// The descriptor is not a listening Unix socket.
    #[error("descriptor {0} is not a Unix socket: {1}")]
    NotASocket(RawFd, std::io::Error),
    /// The link variable is malformed.
    #[error("{0}")]
    BadLink(String),
    /// The configuration descriptor could not be read.
    #[error("reading the configuration from {ENV_CONFIG_FD}: {0}")]
    ReadConfig(std::io::Error),
    /// The configuration is larger than any host sends.
    #[error("the configuration announces {0} bytes, more than the {MAX_CONFIG} accepted")]
    ConfigTooLarge(usize),
    /// The configuration JSON is invalid.
    #[error("invalid configuration: {0}")]
    BadConfig(serde_json::Error),
    /// The runtime or the listener could not be set up.
    #[error("cannot start: {0}")]
    Io(#[from] std::io::Error),
}

fn check_socket(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fstat writes into the zeroed stat struct we pass.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(std::io::Error::other("not a socket"));
    }
    // Commands must not inherit the agent's socket: it is the host's channel.
    // SAFETY: fcntl with integer arguments on a descriptor we were handed.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn start() -> Result<(), StartError> {
    // First of all: until this returns, sandbox root could open the agent's memory.
    make_undumpable()?;
    let config_fd_text = std::env::var(ENV_CONFIG_FD).map_err(|_| StartError::MissingEnv(ENV_CONFIG_FD))?;
    let link = std::env::var(ENV_LINK).ok();
    let fd_text = std::env::var(ENV_FD).ok();
    // Children build their environment from scratch, but nothing should see these either.
    std::env::remove_var(ENV_FD);
    std::env::remove_var(ENV_LINK);
    std::env::remove_var(ENV_CONFIG_FD);
    let config_fd: RawFd = config_fd_text.trim().parse().ok().filter(|n| *n >= 0).ok_or_else(|| StartError::BadConfigFd(config_fd_text.clone()))?;
    let config = read_config(config_fd)?;
    // A descriptor of its own (not the start of a stdio link) is done with once read.
    if !(link.as_deref() == Some("stdio") && config_fd == 0) {
        // SAFETY: closing the configuration descriptor, which nothing else uses.
        unsafe { libc::close(config_fd) };
    }
    // One thread: an idle sandbox should cost the host as little memory as possible.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;

    if let Some(link) = link {
        let link: Link = link.parse().map_err(StartError::BadLink)?;
        runtime.block_on(async move {
            let fds = open_link(&link)?;
            let agent = LinkAgent::start(config)?;
            // One session per host connection; a parked agent keeps its processes while the
            // sandbox is saved, and serves a new session once the host resumes it.
            while agent.serve(fds.session()?).await? == LinkEnd::Parked {
                let fds = LinkFds { read: fds.read.try_clone()?, write: fds.write.try_clone()? };
                tokio::task::spawn_blocking(move || fds.park()).await.map_err(std::io::Error::other)??;
            }
            Ok::<(), std::io::Error>(())
        })?;
        return Ok(());
    }

    let fd_text = fd_text.ok_or(StartError::MissingEnv(ENV_FD))?;
    let fd: RawFd = fd_text.trim().parse().map_err(|_| StartError::BadFd(fd_text.clone()))?;
    if fd < 0 {
        return Err(StartError::BadFd(fd_text));
    }
    check_socket(fd).map_err(|e| StartError::NotASocket(fd, e))?;
    // SAFETY: the host passes this descriptor for the agent alone; it was checked to be a socket
    // and nothing else in this process refers to it.
    let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
    std_listener.set_nonblocking(true)?;
    runtime.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(std_listener)?;
        serve(listener, config).await
    })?;
    Ok(())
}

/// The hostname, and the line of /etc/hosts that resolves it, of a sandbox renamed.
fn rename(name: &str) -> std::io::Result<()> {
    // SAFETY: pointer and length of a live byte slice.
    if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open("/etc/hosts") {
        use std::io::Write;
        let _ = writeln!(f, "127.0.1.1\t{name}");
    }
    Ok(())
}

/// Entry point when the binary runs as `cordon-agent`: reads the socket and config from the
/// environment and serves until the sandbox is torn down. Exits non-zero with a message on
/// stderr when it cannot start.
pub fn main() -> ! {
    // `cordon-agent --rename NAME`: run by the host in a sandbox restored under another name (a
    // gvisor fork), where the restored kernel still holds the source's hostname. Changing it
    // takes CAP_SYS_ADMIN, which only the host's exec grants; in the sandbox's own processes
    // this fails.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, name] = args.as_slice() {
        if flag == "--rename" {
            match rename(name) {
                Ok(()) => std::process::exit(0),
                Err(e) => {
                    eprintln!("cordon-agent: rename to {name}: {e}");
                    std::process::exit(1)
                }
            }
        }
    }
    match start() {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("cordon-agent: {e}");
            std::process::exit(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Link;

    #[test]
    fn link_names() {
        assert_eq!("stdio".parse::<Link>().unwrap(), Link::Stdio);
        assert_eq!("fd:5".parse::<Link>().unwrap(), Link::Fd(5));
        assert_eq!("/dev/vport0p1".parse::<Link>().unwrap(), Link::Device("/dev/vport0p1".into()));
        for bad in ["", "fd:", "fd:-1", "fd:x", "vport0p1"] {
            assert!(bad.parse::<Link>().is_err(), "{bad:?} accepted");
        }
    }
}
