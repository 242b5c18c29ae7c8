//! `cordon-agent`: the init process of every sandbox. It serves the E2B envd protocol —
//! Connect services `process.Process` and `filesystem.Filesystem`, plus HTTP `/files` and
//! `/health` — over a Unix socket that only the host can reach, and reaps every orphan of the
//! sandbox as PID 1.
//!
//! The host starts it with `CORDON_AGENT_FD` (an inherited, listening `AF_UNIX` socket) and
//! `CORDON_AGENT_CONFIG` (an [`AgentConfig`] as JSON), and treats everything it says as untrusted.

use std::os::fd::{FromRawFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;

use cordon_envd::connect::ConnectError;
use serde::{Deserialize, Serialize};

mod fdio;
mod files;
mod filesystem;
mod forward;
mod http;
mod process;
mod process_service;
mod pty;
mod reaper;
mod rpc;
mod users;
mod watch;
mod xattr;

/// Environment variable naming the inherited listening socket.
pub const ENV_FD: &str = "CORDON_AGENT_FD";
/// Environment variable holding the [`AgentConfig`] JSON.
pub const ENV_CONFIG: &str = "CORDON_AGENT_CONFIG";

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
}

/// State shared by all connections of one agent.
pub(crate) struct Agent {
    pub config: AgentConfig,
    pub processes: Arc<process::Processes>,
    pub watchers: watch::Watchers,
}

impl Agent {
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

/// Serves the envd protocol on `listener` until accepting fails for good.
///
/// Every `serve` in a process shares one child reaper, so several agents (as in tests) never
/// take each other's exit statuses; it must run inside a tokio runtime with IO and time enabled.
pub async fn serve(listener: tokio::net::UnixListener, config: AgentConfig) -> std::io::Result<()> {
    reaper::global().listen()?;
    let agent = Arc::new(Agent {
        config,
        processes: Arc::new(process::Processes::default()),
        watchers: watch::Watchers::default(),
    });
    http::run(listener, agent).await
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
    /// The descriptor is not a listening Unix socket.
    #[error("descriptor {0} is not a Unix socket: {1}")]
    NotASocket(RawFd, std::io::Error),
    /// The configuration JSON is invalid.
    #[error("invalid {ENV_CONFIG}: {0}")]
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
    let fd_text = std::env::var(ENV_FD).map_err(|_| StartError::MissingEnv(ENV_FD))?;
    let config_text = std::env::var(ENV_CONFIG).map_err(|_| StartError::MissingEnv(ENV_CONFIG))?;
    // Children build their environment from scratch, but nothing should see these either.
    std::env::remove_var(ENV_FD);
    std::env::remove_var(ENV_CONFIG);
    let fd: RawFd = fd_text.trim().parse().map_err(|_| StartError::BadFd(fd_text.clone()))?;
    if fd < 0 {
        return Err(StartError::BadFd(fd_text));
    }
    let config: AgentConfig = serde_json::from_str(&config_text).map_err(StartError::BadConfig)?;
    check_socket(fd).map_err(|e| StartError::NotASocket(fd, e))?;
    // SAFETY: the host passes this descriptor for the agent alone; it was checked to be a socket
    // and nothing else in this process refers to it.
    let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
    std_listener.set_nonblocking(true)?;

    // One thread: an idle sandbox should cost the host as little memory as possible.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(std_listener)?;
        serve(listener, config).await
    })?;
    Ok(())
}

/// Entry point when the binary runs as `cordon-agent`: reads the socket and config from the
/// environment and serves until the sandbox is torn down. Exits non-zero with a message on
/// stderr when it cannot start.
pub fn main() -> ! {
    match start() {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("cordon-agent: {e}");
            std::process::exit(1)
        }
    }
}
