//! One process in the session's sandbox, through the agent's envd API: started, its output
//! gathered within caps, ended by itself, by the call's timeout or by the client's cancellation,
//! with progress reported while it runs.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cordon_envd::process::{DataEvent, ProcessConfig, ProcessEvent, Signal, StartRequest};
use cordon_envd::EnvdClient;

use crate::capture::Capture;
use crate::sandbox::{Live, Pool};

/// The user every call runs as (uid 1000, passwordless sudo inside, as in E2B).
pub const USER: &str = "user";

/// How often a run with a progress token reports progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// How long to wait for the end event after the process was killed.
const DRAIN_AFTER_KILL: Duration = Duration::from_secs(3);

/// What to run.
pub struct Job {
    pub cmd: String,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub timeout: Duration,
}

/// Why a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Exit,
    Signal,
    Timeout,
    Oom,
    Cancelled,
    SandboxDied,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::Exit => "exit",
            Reason::Signal => "signal",
            Reason::Timeout => "timeout",
            Reason::Oom => "oom",
            Reason::Cancelled => "cancelled",
            Reason::SandboxDied => "sandbox_died",
        }
    }
}

/// How a run ended.
#[derive(Debug)]
pub struct Outcome {
    pub reason: Reason,
    pub exit_code: Option<i32>,
    /// The signal's name as envd reports it, when one ended the process.
    pub status: String,
    pub stdout: Capture,
    pub stderr: Capture,
    pub duration: Duration,
}

/// Reports progress of a run; called about once a second with the time elapsed and the output
/// so far.
pub trait Progress: Send {
    fn report(&mut self, elapsed: Duration, limit: Duration, out_bytes: u64, err_bytes: u64) -> impl std::future::Future<Output = ()> + Send;
}

/// No progress reporting.
pub struct NoProgress;

impl Progress for NoProgress {
    async fn report(&mut self, _: Duration, _: Duration, _: u64, _: u64) {}
}

/// Why a run could not start: a message for the model.
#[derive(Debug)]
pub struct StartError(pub String);

/// Runs `job` to its end. `cancel` resolves when the client gave up on the call.
pub async fn run(
    pool: &Pool,
    live: &Live,
    job: Job,
    max_output: usize,
    cancel: impl std::future::Future<Output = ()>,
    mut progress: impl Progress,
) -> Result<Outcome, StartError> {
    let client = live.client();
    let oom_before = pool.oom_kills(&live.id);
    let started = Instant::now();
    let req = StartRequest {
        process: Some(ProcessConfig { cmd: job.cmd.clone(), args: job.args, envs: job.env, cwd: job.cwd.clone() }),
        pty: None,
        tag: None,
        // No stdin: a program that reads it gets EOF at once instead of hanging until the timeout.
        stdin: Some(false),
    };
    let mut stream = client.start(req, Some(USER), None).await.map_err(|e| start_error(e, &job.cmd, job.cwd.as_deref()))?;
    let pid = stream.pid();
    tracing::debug!(sandbox_id = %live.id, pid, cmd = %job.cmd, "process started");
    let mut out = Capture::new(max_output);
    let mut err = Capture::new(max_output);
    let deadline = tokio::time::sleep(job.timeout);
    tokio::pin!(deadline);
    tokio::pin!(cancel);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_EVERY, PROGRESS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    // None: still running; Some(reason) once it was stopped from outside.
    let mut stopped: Option<Reason> = None;
    let mut drain_until: Option<tokio::time::Instant> = None;
    let ended = loop {
        let drain = async {
            match drain_until {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ev = stream.next() => match ev {
                Some(Ok(ProcessEvent::Data(DataEvent::Stdout(b)))) => out.push(&b),
                Some(Ok(ProcessEvent::Data(DataEvent::Stderr(b)))) => err.push(&b),
                Some(Ok(ProcessEvent::Data(DataEvent::Pty(b)))) => out.push(&b),
                Some(Ok(ProcessEvent::Start(_) | ProcessEvent::Keepalive(_))) => {}
                Some(Ok(ProcessEvent::End(end))) => break Some(end),
                Some(Err(e)) => {
                    tracing::debug!(sandbox_id = %live.id, pid, "event stream broke: {e}");
                    break None;
                }
                None => break None,
            },
            () = &mut deadline, if stopped.is_none() => {
                stopped = Some(Reason::Timeout);
                kill_group(&client, pid).await;
                drain_until = Some(tokio::time::Instant::now() + DRAIN_AFTER_KILL);
            }
            () = &mut cancel, if stopped.is_none() => {
                stopped = Some(Reason::Cancelled);
                kill_group(&client, pid).await;
                drain_until = Some(tokio::time::Instant::now() + DRAIN_AFTER_KILL);
            }
            _ = tick.tick(), if stopped.is_none() => {
                progress.report(started.elapsed(), job.timeout, out.total(), err.total()).await;
            }
            () = drain => break None,
        }
    };
    let duration = started.elapsed();
    // Unknown before or after (a gone guest) is no evidence of an OOM kill.
    let oom = matches!((oom_before, pool.oom_kills(&live.id)), (Some(before), Some(after)) if after > before);
    let (reason, exit_code, status) = match (stopped, ended) {
        (Some(r), end) => (r, end.as_ref().filter(|e| e.exited).map(|e| e.exit_code), String::new()),
        (None, Some(end)) if end.exited => (Reason::Exit, Some(end.exit_code), end.status),
        (None, Some(end)) if oom => (Reason::Oom, None, end.status),
        (None, Some(end)) => (Reason::Signal, None, end.status),
        (None, None) if oom => (Reason::Oom, None, String::new()),
        (None, None) => (Reason::SandboxDied, None, String::new()),
    };
    Ok(Outcome { reason, exit_code, status, stdout: out, stderr: err, duration })
}

/// Kills the process and its process group (the agent starts every process in a session of its
/// own, so its pid is the group id): background children of a killed shell go with it.
pub async fn kill_group(client: &EnvdClient, pid: u32) {
    if pid == 0 {
        return;
    }
    let group = StartRequest {
        process: Some(ProcessConfig {
            cmd: "/bin/kill".into(),
            args: vec!["-KILL".into(), "--".into(), format!("-{pid}")],
            ..Default::default()
        }),
        stdin: Some(false),
        ..Default::default()
    };
    // The group kill runs as root, so that it also reaches what the user started under sudo.
    match client.start(group, Some("root"), Some(5000)).await {
        Ok(s) => {
            let _ = tokio::time::timeout(Duration::from_secs(5), s.collect()).await;
        }
        Err(e) => tracing::debug!(pid, "group kill: {e}"),
    }
    // The leader itself, in case /bin/kill is missing from the image.
    if let Err(e) = client.send_signal(pid, Signal::Sigkill).await {
        tracing::debug!(pid, "kill: {e}");
    }
}

fn start_error(e: cordon_envd::Error, cmd: &str, cwd: Option<&str>) -> StartError {
    let msg = e.to_string();
    if let Some(cwd) = cwd.filter(|_| msg.contains("cwd") || msg.contains("directory")) {
        return StartError(format!("cannot run in directory {cwd}: {msg}; create it first or pick an existing one"));
    }
    if msg.contains("No such file") || msg.contains("not found") {
        return StartError(format!("command {cmd:?} not found in the sandbox ({msg}); check the name, or install it first"));
    }
    StartError(format!("cannot start {cmd:?}: {msg}"))
}
