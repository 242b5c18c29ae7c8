//! Running processes: spawning as a user, pumping their output to subscribers, input, signals,
//! and the table `Connect` and friends look processes up in.
//!
//! Output flow: one pump task per process reads the pipes (or the PTY master) and hands each
//! chunk to the subscribers. The subscriber of `Start` is awaited, so a slow client slows the
//! reads and the process blocks on a full pipe instead of the agent buffering without bound;
//! later `Connect` subscribers get chunks only while they keep up. When the exit status arrives
//! the pump drains what is already readable, publishes the end event, and keeps discarding
//! output of background grandchildren until they close the pipe, so they never get SIGPIPE.

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use bytes::Bytes;
use cordon_envd::connect::{Code, ConnectError};
use cordon_envd::process::{DataEvent, EndEvent, ProcessConfig, ProcessInfo, ProcessInput, ProcessSelector};
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::sync::oneshot;

use crate::fdio::Fd;
use crate::pty;
use crate::reaper::{self, WaitStatus};
use crate::users::User;

/// How long an ended process stays visible to `Connect`.
pub(crate) const RETENTION: Duration = Duration::from_secs(30);
/// Largest chunk read from a pipe at once.
const CHUNK: usize = 32 << 10;
/// Chunks queued for the `Start` stream before the pump waits for it.
const PRIMARY_QUEUE: usize = 16;
/// Chunks queued for a `Connect` stream before further chunks are dropped for it.
const LOSSY_QUEUE: usize = 64;
/// After the exit status arrives, at most this much already-buffered output is still forwarded;
/// a grandchild that keeps writing must not postpone the end event forever.
const DRAIN_LIMIT: usize = 16 << 20;
/// How long a PTY may stay silent after the exit before its output counts as complete (unless
/// it reports EOF first, which it does as soon as no one else holds the terminal).
const PTY_SETTLE: Duration = Duration::from_millis(100);

/// Everything needed to start one process.
pub(crate) struct SpawnSpec {
    /// The request's config, reported by `List`.
    pub config: ProcessConfig,
    pub tag: Option<String>,
    pub user: User,
    /// The complete environment, in order; later entries win.
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    /// Give the process a stdin pipe (otherwise `/dev/null`).
    pub stdin: bool,
    /// Run on a PTY of this size (cols, rows).
    pub pty: Option<(u16, u16)>,
}

#[derive(Clone, Copy)]
enum OutputKind {
    Stdout,
    Stderr,
    Pty,
}

impl OutputKind {
    fn event(self, data: &[u8]) -> DataEvent {
        let b = Bytes::copy_from_slice(data);
        match self {
            OutputKind::Stdout => DataEvent::Stdout(b),
            OutputKind::Stderr => DataEvent::Stderr(b),
            OutputKind::Pty => DataEvent::Pty(b),
        }
    }
}

#[derive(Clone)]
struct Subscriber {
    tx: mpsc::Sender<DataEvent>,
    lossy: bool,
}

#[derive(Default)]
struct State {
    subscribers: Vec<Subscriber>,
    end: Option<EndEvent>,
}

/// One process started by the agent.
pub(crate) struct Proc {
    pub pid: u32,
    pub tag: Option<String>,
    pub config: ProcessConfig,
    stdin: tokio::sync::Mutex<Option<Fd>>,
    pty: Option<Arc<Fd>>,
    /// Signals go through a pidfd so that a recycled pid can never be hit.
    pidfd: Option<OwnedFd>,
    state: Mutex<State>,
    deadline_hit: AtomicBool,
    /// Woken when the end is published.
    ended: tokio::sync::Notify,
}

/// A subscriber's view of a process: its output chunks, then (when the channel closes) its end.
pub(crate) struct Subscription {
    pub data: mpsc::Receiver<DataEvent>,
    proc: Arc<Proc>,
}

impl Subscription {
    /// The end event, once the process has ended (always set when `data` is closed).
    pub fn end(&self) -> Option<EndEvent> {
        self.proc.state().end.clone()
    }
}

fn not_found(sel: &ProcessSelector) -> ConnectError {
    match sel {
        ProcessSelector::Pid(pid) => ConnectError::not_found(format!("process with pid {pid} not found")),
        ProcessSelector::Tag(tag) => ConnectError::not_found(format!("process with tag {tag} not found")),
    }
}

impl Proc {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the end event has not been published yet.
    pub fn is_running(&self) -> bool {
        self.state().end.is_none()
    }

    /// Whether the `Connect-Timeout-Ms` deadline of `Start` killed the process.
    pub fn deadline_hit(&self) -> bool {
        self.deadline_hit.load(Ordering::Relaxed)
    }

    /// Subscribes to the output from now on. A lossy subscriber never slows the process down.
    pub fn subscribe(self: &Arc<Self>, lossy: bool) -> Subscription {
        let (tx, rx) = mpsc::channel(if lossy { LOSSY_QUEUE } else { PRIMARY_QUEUE });
        let mut st = self.state();
        // After the end the sender is dropped right away: the subscriber sees a closed channel
        // and goes straight to the end event.
        if st.end.is_none() {
            st.subscribers.push(Subscriber { tx, lossy });
        }
        drop(st);
        Subscription { data: rx, proc: self.clone() }
    }

    async fn deliver(&self, ev: DataEvent) {
        let subs = self.state().subscribers.clone();
        let mut gone = false;
        for s in &subs {
            if s.lossy {
                if let Err(TrySendError::Closed(_)) = s.tx.try_send(ev.clone()) {
                    gone = true;
                }
            } else if s.tx.send(ev.clone()).await.is_err() {
                gone = true;
            }
        }
        if gone {
            self.state().subscribers.retain(|s| !s.tx.is_closed());
        }
    }

    fn finish(&self, end: EndEvent) {
        let mut st = self.state();
        st.end = Some(end);
        st.subscribers.clear();
        drop(st);
        self.ended.notify_waiters();
    }

    /// Waits until the process has ended (reaped, its end published), at most `limit`; true if
    /// it has.
    pub async fn wait_end(&self, limit: Duration) -> bool {
        let notified = self.ended.notified();
        tokio::pin!(notified);
        // Registered before the check, so an end published in between still wakes us.
        notified.as_mut().enable();
        if !self.is_running() {
            return true;
        }
        tokio::time::timeout(limit, notified).await.is_ok()
    }

    /// Sends a signal to the process (not its group: envd semantics). A process that is already
    /// gone is not an error.
    pub fn signal(&self, sig: i32) -> io::Result<()> {
        let r = match &self.pidfd {
            // SAFETY: pidfd_send_signal on a pidfd we own, with no siginfo.
            Some(fd) => unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    sig,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            },
            None if self.is_running() => {
                // SAFETY: kill with integer arguments; without a pidfd this is the best we have.
                unsafe { libc::kill(self.pid as libc::pid_t, sig) as libc::c_long }
            }
            None => return Ok(()),
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Kills the process with SIGKILL once `after` has passed, unless it ended before.
    pub fn kill_after(self: &Arc<Self>, after: Duration) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            if let Some(p) = weak.upgrade() {
                if p.is_running() {
                    p.deadline_hit.store(true, Ordering::Relaxed);
                    let _ = p.signal(libc::SIGKILL);
                }
            }
        });
    }

    /// Writes input to the stdin pipe or the PTY.
    pub async fn write_input(&self, input: &ProcessInput) -> Result<(), ConnectError> {
        match (input, &self.pty) {
            // Stdin bytes for a PTY process are keystrokes too.
            (ProcessInput::Pty(data) | ProcessInput::Stdin(data), Some(master)) => {
                master.write_all(data).await.map_err(|e| {
                    ConnectError::internal(format!("error writing to tty of process {}: {e}", self.pid))
                })
            }
            (ProcessInput::Pty(_), None) => Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("process {} has no tty; send stdin instead", self.pid),
            )),
            (ProcessInput::Stdin(data), None) => {
                let guard = self.stdin.lock().await;
                let Some(fd) = guard.as_ref() else {
                    return Err(ConnectError::new(
                        Code::FailedPrecondition,
                        format!("stdin of process {} is not enabled or was closed", self.pid),
                    ));
                };
                fd.write_all(data).await.map_err(|e| {
                    ConnectError::internal(format!("error writing to stdin of process {}: {e}", self.pid))
                })
            }
        }
    }

    /// Closes the stdin pipe so the process reads end of file.
    pub async fn close_stdin(&self) -> Result<(), ConnectError> {
        if self.pty.is_some() {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                "cannot close stdin of a tty process; send Ctrl+D (0x04) instead",
            ));
        }
        self.stdin.lock().await.take();
        Ok(())
    }

    /// Resizes the PTY.
    pub fn resize(&self, cols: u16, rows: u16) -> Result<(), ConnectError> {
        let Some(master) = &self.pty else {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("process {} has no tty", self.pid),
            ));
        };
        pty::resize(master.raw(), cols, rows)
            .map_err(|e| ConnectError::internal(format!("error resizing tty of process {}: {e}", self.pid)))
    }

    fn info(&self) -> ProcessInfo {
        ProcessInfo { config: Some(self.config.clone()), pid: self.pid, tag: self.tag.clone() }
    }
}

/// The processes of one agent: running ones, and ended ones for [`RETENTION`].
#[derive(Default)]
pub(crate) struct Processes {
    map: Mutex<HashMap<u32, Arc<Proc>>>,
    /// Each command in a Landlock domain of its own (see `command_scope`), when configured.
    scope: Option<Arc<crate::command_scope::Scope>>,
}

/// The environment of a spawned child, prepared before `fork` so that the child does no
/// allocation between `fork` and `exec`.
struct ChildSetup {
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
    switch_user: bool,
    cwd: CString,
    controlling_tty: bool,
    scope: Option<Arc<crate::command_scope::Scope>>,
}

impl ChildSetup {
    /// Runs in the child between `fork` and `exec`: only async-signal-safe calls.
    fn apply(&self) -> io::Result<()> {
        fn check(r: libc::c_int) -> io::Result<()> {
            if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        }
        // SAFETY: (all calls below) plain syscalls on integers and on pointers to data owned by
        // `self`, which outlives the call; none of them allocates or takes locks.
        unsafe {
            // Own session and process group: job-control signals from a terminal or a group
            // kill aimed at the agent never reach commands by accident.
            check(libc::setsid())?;
            if self.controlling_tty {
                check(libc::ioctl(0, libc::TIOCSCTTY, 0))?;
            }
            // While still the agent's user: entering the domain needs its capability.
            if let Some(scope) = &self.scope {
                scope.enter()?;
            }
            if self.switch_user {
                check(libc::setgroups(self.groups.len(), self.groups.as_ptr()))?;
                check(libc::setresgid(self.gid, self.gid, self.gid))?;
                check(libc::setresuid(self.uid, self.uid, self.uid))?;
            }
            // After dropping privileges, so a directory the user cannot enter is refused.
            check(libc::chdir(self.cwd.as_ptr()))?;
        }
        Ok(())
    }

    /// Prepares the child's identity and directory for `spec`; `controlling_tty` when its
    /// stdio is a PTY slave.
    fn new(
        spec: &SpawnSpec,
        controlling_tty: bool,
        scope: Option<Arc<crate::command_scope::Scope>>,
    ) -> Result<ChildSetup, ConnectError> {
        // SAFETY: geteuid/getegid cannot fail and touch no memory.
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Ok(ChildSetup {
            uid: spec.user.uid,
            gid: spec.user.gid,
            groups: spec.user.groups.clone(),
            // Without privileges the only possible identity is the current one; asking for it
            // anyway would fail on setgroups.
            switch_user: euid == 0 || euid != spec.user.uid || egid != spec.user.gid,
            cwd: CString::new(spec.cwd.as_os_str().as_bytes())
                .map_err(|_| ConnectError::invalid_argument("cwd contains a NUL byte"))?,
            controlling_tty,
            scope,
        })
    }

    /// Makes `cmd` apply this setup in the child, between `fork` and `exec`.
    fn install(self, cmd: &mut Command) {
        // SAFETY: `apply` only makes async-signal-safe syscalls on data prepared before fork.
        unsafe {
            cmd.pre_exec(move || self.apply());
        }
    }
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes integers and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd is a descriptor the kernel just gave us; nothing else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The program, arguments and complete environment of `spec`; nothing of the agent's own
/// environment leaks into the command.
fn command(spec: &SpawnSpec) -> Command {
    let mut cmd = Command::new(shell_of_image(&spec.config.cmd, |p| Path::new(p).exists()));
    cmd.args(&spec.config.args).env_clear();
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    cmd
}

/// Connects the child's stdio to a new PTY or to pipes; returns the PTY master, if any.
fn attach_stdio(cmd: &mut Command, spec: &SpawnSpec) -> Result<Option<OwnedFd>, ConnectError> {
    if let Some((cols, rows)) = spec.pty {
        return attach_pty(cmd, cols, rows).map(Some);
    }
    cmd.stdin(if spec.stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    Ok(None)
}

/// Opens a PTY and makes its slave all three of the child's stdio; returns the master.
fn attach_pty(cmd: &mut Command, cols: u16, rows: u16) -> Result<OwnedFd, ConnectError> {
    let pair = pty::open(cols, rows).map_err(|e| ConnectError::internal(format!("error opening a pty: {e}")))?;
    let out = pair.slave.try_clone().map_err(|e| ConnectError::internal(e.to_string()))?;
    let err = pair.slave.try_clone().map_err(|e| ConnectError::internal(e.to_string()))?;
    cmd.stdin(Stdio::from(pair.slave)).stdout(Stdio::from(out)).stderr(Stdio::from(err));
    Ok(pair.master)
}

/// Forks and execs `cmd` under the reaper; returns the child, its pidfd (when the kernel has
/// them) and where its exit status will arrive.
fn start_child(
    mut cmd: Command,
    config: &ProcessConfig,
) -> Result<(Child, Option<OwnedFd>, oneshot::Receiver<WaitStatus>), ConnectError> {
    let ((child, pidfd), exit) = reaper::global()
        .spawn(|| {
            let child = cmd.spawn()?;
            let pid = child.id();
            // Opened while reaping is held off, so it refers to this very child.
            let pidfd = pidfd_open(pid);
            Ok::<_, io::Error>((pid, (child, pidfd)))
        })
        .map_err(|e| start_error(config, e))?;
    // Drops the parent's copies of the PTY slave, so the master sees EOF when the child exits.
    drop(cmd);
    Ok((child, pidfd, exit))
}

/// E2B's SDKs run every shell command as `/bin/bash -l -c CMD`; an image without bash (Alpine,
/// busybox) runs it with `/bin/sh`, which takes the same flags.
fn shell_of_image(cmd: &str, exists: impl Fn(&str) -> bool) -> &str {
    if cmd == "/bin/bash" && !exists("/bin/bash") && exists("/bin/sh") {
        "/bin/sh"
    } else {
        cmd
    }
}

fn start_error(config: &ProcessConfig, e: io::Error) -> ConnectError {
    if e.kind() == io::ErrorKind::NotFound && matches!(config.cmd.as_str(), "/bin/bash" | "/bin/sh" | "bash" | "sh") && !Path::new("/bin/sh").exists() {
        return ConnectError::invalid_argument(format!(
            "this image has no shell (no /bin/sh), so '{}' cannot run: start the program directly, as a command with its arguments (cmd and args), not as a shell command line",
            config.cmd
        ));
    }
    let cmdline = std::iter::once(config.cmd.as_str())
        .chain(config.args.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join(" ");
    ConnectError::invalid_argument(format!("error starting process '{cmdline}': {e}"))
}

/// The agent's ends of a child's stdio, registered with the reactor.
struct ChildFds {
    master: Option<Arc<Fd>>,
    stdin: Option<Fd>,
    stdout: Option<Fd>,
    stderr: Option<Fd>,
}

impl ChildFds {
    fn register(child: &mut Child, master: Option<OwnedFd>) -> io::Result<ChildFds> {
        let wrap = |fd: Option<OwnedFd>| -> io::Result<Option<Fd>> { fd.map(Fd::new).transpose() };
        Ok(ChildFds {
            master: master.map(Fd::new_pty_master).transpose()?.map(Arc::new),
            stdin: wrap(child.stdin.take().map(OwnedFd::from))?,
            stdout: wrap(child.stdout.take().map(OwnedFd::from))?,
            stderr: wrap(child.stderr.take().map(OwnedFd::from))?,
        })
    }
}

/// Takes over the child's stdio. On failure the child is killed: the caller gets only an
/// error, so nobody could ever see its output or stop it.
fn adopt_fds(child: &mut Child, master: Option<OwnedFd>) -> Result<ChildFds, ConnectError> {
    ChildFds::register(child, master).map_err(|e| {
        let pid = child.id();
        // SAFETY: kill with integer arguments; the child is ours and not yet reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        ConnectError::internal(format!("error setting up the pipes of process {pid}: {e}"))
    })
}

/// What the pump reads, in the order it reads it: the PTY master, or stdout then stderr.
fn output_sources(master: Option<&Arc<Fd>>, stdout: Option<Fd>, stderr: Option<Fd>) -> Vec<Source> {
    let mut sources = Vec::with_capacity(2);
    if let Some(m) = master {
        sources.push(Source { fd: m.clone(), kind: OutputKind::Pty });
    }
    if let Some(f) = stdout {
        sources.push(Source { fd: Arc::new(f), kind: OutputKind::Stdout });
    }
    if let Some(f) = stderr {
        sources.push(Source { fd: Arc::new(f), kind: OutputKind::Stderr });
    }
    sources
}

async fn read_opt(fd: Option<&Arc<Fd>>, buf: &mut [u8]) -> io::Result<usize> {
    match fd {
        Some(fd) => fd.read(buf).await,
        None => std::future::pending().await,
    }
}

struct Source {
    fd: Arc<Fd>,
    kind: OutputKind,
}

impl Processes {
    pub fn new(scope: Option<crate::command_scope::Scope>) -> Processes {
        Processes { map: Mutex::default(), scope: scope.map(Arc::new) }
    }

    /// Spawns a process and returns it with the subscription of its starter (registered before
    /// any output is read, so none is lost).
    pub fn spawn(self: &Arc<Self>, spec: SpawnSpec) -> Result<(Arc<Proc>, Subscription), ConnectError> {
        let mut cmd = command(&spec);
        let master = attach_stdio(&mut cmd, &spec)?;
        ChildSetup::new(&spec, master.is_some(), self.scope.clone())?.install(&mut cmd);
        let (mut child, pidfd, exit) = start_child(cmd, &spec.config)?;
        let fds = adopt_fds(&mut child, master)?;
        let sources = output_sources(fds.master.as_ref(), fds.stdout, fds.stderr);
        let proc = Arc::new(Proc {
            pid: child.id(),
            tag: spec.tag,
            config: spec.config,
            stdin: tokio::sync::Mutex::new(fds.stdin),
            pty: fds.master,
            pidfd,
            state: Mutex::new(State::default()),
            deadline_hit: AtomicBool::new(false),
            ended: tokio::sync::Notify::new(),
        });
        let sub = self.register(&proc, sources, exit);
        Ok((proc, sub))
    }

    /// Subscribes the starter, lists the process and starts its pump, in that order: the
    /// subscription must exist before the pump reads the first chunk.
    fn register(self: &Arc<Self>, proc: &Arc<Proc>, sources: Vec<Source>, exit: oneshot::Receiver<WaitStatus>) -> Subscription {
        let sub = proc.subscribe(false);
        self.lock().insert(proc.pid, proc.clone());
        tokio::spawn(pump(proc.clone(), sources, exit, Arc::downgrade(self)));
        sub
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u32, Arc<Proc>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Finds a process, running or recently ended.
    pub fn find(&self, sel: &ProcessSelector) -> Result<Arc<Proc>, ConnectError> {
        let map = self.lock();
        let found = match sel {
            ProcessSelector::Pid(pid) => map.get(pid).cloned(),
            ProcessSelector::Tag(tag) => {
                let mut candidates: Vec<&Arc<Proc>> =
                    map.values().filter(|p| p.tag.as_deref() == Some(tag.as_str())).collect();
                // A running process wins over an ended one with the same tag; then the newest.
                candidates.sort_by_key(|p| (p.is_running(), p.pid));
                candidates.last().map(|p| (*p).clone())
            }
        };
        found.ok_or_else(|| not_found(sel))
    }

    /// Finds a process that has not ended.
    pub fn find_running(&self, sel: &ProcessSelector) -> Result<Arc<Proc>, ConnectError> {
        let p = self.find(sel)?;
        if p.is_running() {
            Ok(p)
        } else {
            Err(not_found(sel))
        }
    }

    /// The running processes, by pid.
    pub fn list(&self) -> Vec<ProcessInfo> {
        let mut v: Vec<ProcessInfo> =
            self.lock().values().filter(|p| p.is_running()).map(|p| p.info()).collect();
        v.sort_by_key(|p| p.pid);
        v
    }
}

fn end_event(status: Option<WaitStatus>) -> EndEvent {
    let Some(status) = status else {
        return EndEvent {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: Some("exit status was lost".into()),
        };
    };
    let (exit_code, exited, text) = status.describe();
    let failed = !(exited && exit_code == 0);
    EndEvent { exit_code, exited, error: failed.then(|| text.clone()), status: text }
}

async fn pump(proc: Arc<Proc>, sources: Vec<Source>, mut exit: oneshot::Receiver<WaitStatus>, table: Weak<Processes>) {
    let mut iter = sources.into_iter();
    let mut a = iter.next();
    let mut b = iter.next();
    let mut buf_a = vec![0u8; CHUNK];
    let mut buf_b = vec![0u8; CHUNK];

    let status = loop {
        tokio::select! {
            biased;
            r = read_opt(a.as_ref().map(|s| &s.fd), &mut buf_a) => match r {
                Ok(n) if n > 0 => {
                    let kind = a.as_ref().map_or(OutputKind::Stdout, |s| s.kind);
                    proc.deliver(kind.event(&buf_a[..n])).await;
                }
                _ => a = None,
            },
            r = read_opt(b.as_ref().map(|s| &s.fd), &mut buf_b) => match r {
                Ok(n) if n > 0 => {
                    let kind = b.as_ref().map_or(OutputKind::Stderr, |s| s.kind);
                    proc.deliver(kind.event(&buf_b[..n])).await;
                }
                _ => b = None,
            },
            s = &mut exit => break s.ok(),
        }
    };

    // Whatever the process wrote to a pipe before exiting is in the pipe buffer by now (the
    // kernel closes a process's files before it reports the exit), so draining without
    // waiting gets all of it; what a background grandchild writes later is not this process's
    // output. A PTY is different: the tty layer hands data to the master side from a kernel
    // work queue, so its tail may still be in flight; wait briefly for it (or for EOF).
    let mut budget = DRAIN_LIMIT;
    for src in [&mut a, &mut b] {
        while let Some(s) = src.as_ref() {
            if budget == 0 {
                break;
            }
            let r = match s.kind {
                OutputKind::Pty => match tokio::time::timeout(PTY_SETTLE, s.fd.read(&mut buf_a)).await {
                    Ok(r) => r,
                    Err(_) => break,
                },
                _ => s.fd.read_now(&mut buf_a),
            };
            match r {
                Ok(0) => *src = None,
                Ok(n) => {
                    budget = budget.saturating_sub(n);
                    let ev = s.kind.event(&buf_a[..n]);
                    proc.deliver(ev).await;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => *src = None,
            }
        }
    }

    proc.finish(end_event(status));
    let retained = Arc::downgrade(&proc);
    drop(proc);
    tokio::spawn(async move {
        tokio::time::sleep(RETENTION).await;
        if let (Some(table), Some(p)) = (table.upgrade(), retained.upgrade()) {
            let mut map = table.lock();
            if map.get(&p.pid).is_some_and(|cur| Arc::ptr_eq(cur, &p)) {
                map.remove(&p.pid);
            }
        }
    });

    // Keep reading (and discarding) until background grandchildren close their ends.
    while a.is_some() || b.is_some() {
        tokio::select! {
            r = read_opt(a.as_ref().map(|s| &s.fd), &mut buf_a) => if !matches!(r, Ok(n) if n > 0) { a = None },
            r = read_opt(b.as_ref().map(|s| &s.fd), &mut buf_b) => if !matches!(r, Ok(n) if n > 0) { b = None },
        }
    }
}

#[cfg(test)]
mod shell_tests {
    use super::shell_of_image;

    #[test]
    fn bash_falls_back_to_sh_only_where_bash_is_missing() {
        assert_eq!(shell_of_image("/bin/bash", |p| p == "/bin/sh"), "/bin/sh");
        assert_eq!(shell_of_image("/bin/bash", |_| true), "/bin/bash");
        // Neither: the exec fails and says the image has no shell.
        assert_eq!(shell_of_image("/bin/bash", |_| false), "/bin/bash");
        assert_eq!(shell_of_image("/usr/bin/python3", |_| false), "/usr/bin/python3");
    }
}
