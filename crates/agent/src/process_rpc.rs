//! The `process.Process` service.

use std::sync::Arc;
use std::time::Duration;

use cordon_envd::connect::{Code, ConnectError};
use cordon_envd::process::{
    CloseStdinRequest, CloseStdinResponse, ConnectRequest, ListRequest, ListResponse, ProcessEvent,
    ProcessSelector, SendInputRequest, SendInputResponse, SendSignalRequest, SendSignalResponse, Signal,
    StartEvent, StartRequest, StartResponse, StreamInputRequest, UpdateRequest, UpdateResponse,
};
use hyper::body::Incoming;
use hyper::{Request, Response};
use tokio::time::Instant;

use crate::body::Body;
use crate::process::{Proc, SpawnSpec, Subscription};
use crate::rpc::{self, CallCtx, Heartbeat, StreamTx};
use crate::users::resolve_path;
use crate::{pty, Agent};

/// Used when neither the sandbox env nor the image sets `PATH`.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

const METHODS: &[&str] =
    &["Start", "Connect", "List", "SendInput", "StreamInput", "SendSignal", "CloseStdin", "Update"];

pub(crate) fn is_method(m: &str) -> bool {
    METHODS.contains(&m)
}

pub(crate) async fn dispatch(agent: Arc<Agent>, method: &str, req: Request<Incoming>) -> Response<Body> {
    match method {
        "Start" => rpc::server_stream(req, |m, ctx, tx| async move { start(&agent, m, ctx, tx) }).await,
        "Connect" => rpc::server_stream(req, |m, ctx, tx| async move { connect(&agent, m, ctx, tx) }).await,
        "List" => {
            rpc::unary(req, |_: ListRequest, _| async { Ok(ListResponse { processes: agent.processes.list() }) })
                .await
        }
        "SendInput" => rpc::unary(req, |m, _| send_input(&agent, m)).await,
        "StreamInput" => {
            rpc::client_stream(req, None::<Arc<Proc>>, |m: StreamInputRequest, _, target| {
                let agent = agent.clone();
                async move { stream_input(&agent, m, target).await }
            })
            .await
        }
        "SendSignal" => rpc::unary(req, |m, _| send_signal(&agent, m)).await,
        "CloseStdin" => rpc::unary(req, |m, _| close_stdin(&agent, m)).await,
        "Update" => rpc::unary(req, |m, _| async { update(&agent, m) }).await,
        _ => rpc::unary_error(&ConnectError::new(Code::Unimplemented, format!("unknown method {method}"))),
    }
}

fn selector(sel: Option<ProcessSelector>) -> Result<ProcessSelector, ConnectError> {
    sel.ok_or_else(|| ConnectError::invalid_argument("a process selector (pid or tag) is required"))
}

pub(crate) fn valid_env_key(k: &str) -> bool {
    !k.is_empty() && !k.contains('=') && !k.contains('\0')
}

fn start(agent: &Arc<Agent>, req: StartRequest, ctx: CallCtx, tx: StreamTx) -> Result<(), ConnectError> {
    let user = agent.user(&ctx)?;
    let config = req.process.ok_or_else(|| ConnectError::invalid_argument("process config is required"))?;
    if config.cmd.is_empty() {
        return Err(ConnectError::invalid_argument("process cmd is required"));
    }

    let cwd = match config.cwd.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => resolve_path(c, &user.home),
        None => match agent.config.workdir.as_deref().filter(|w| !w.is_empty()) {
            Some(w) => resolve_path(w, &user.home),
            None => user.home.clone(),
        },
    };
    match std::fs::metadata(&cwd) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(ConnectError::invalid_argument(format!("cwd '{}' is not a directory", cwd.display()))),
        Err(_) => return Err(ConnectError::invalid_argument(format!("cwd '{}' does not exist", cwd.display()))),
    }

    let sandbox_env = agent.env();
    let path = sandbox_env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map_or(DEFAULT_PATH.to_string(), |(_, v)| v.clone());
    let mut env = vec![
        ("PATH".to_string(), path),
        ("HOME".to_string(), user.home.to_string_lossy().into_owned()),
        ("USER".to_string(), user.name.clone()),
        ("LOGNAME".to_string(), user.name.clone()),
    ];
    if req.pty.is_some() {
        // Interactive shells need a terminal type; the sandbox or request env may override it.
        env.push(("TERM".to_string(), "xterm-256color".to_string()));
    }
    env.extend(sandbox_env);
    for (k, v) in &config.envs {
        if !valid_env_key(k) || v.contains('\0') {
            return Err(ConnectError::invalid_argument(format!("invalid environment variable {k:?}")));
        }
        env.push((k.clone(), v.clone()));
    }
    if config.cmd.contains('\0') || config.args.iter().any(|a| a.contains('\0')) {
        return Err(ConnectError::invalid_argument("cmd and args must not contain NUL bytes"));
    }

    let pty = req.pty.map(|p| {
        let size = p.size.unwrap_or_default();
        (pty::dimension(size.cols, 80), pty::dimension(size.rows, 24))
    });
    let spec = SpawnSpec {
        config,
        tag: req.tag,
        user,
        env,
        cwd,
        stdin: req.stdin.unwrap_or(true),
        pty,
    };
    let (proc, sub) = agent.processes.spawn(spec)?;
    if let Some(t) = ctx.timeout {
        proc.kill_after(t);
    }
    tokio::spawn(stream_events(tx, proc, sub, ctx.keepalive, StreamKind::Start));
    Ok(())
}

fn connect(agent: &Arc<Agent>, req: ConnectRequest, ctx: CallCtx, tx: StreamTx) -> Result<(), ConnectError> {
    let proc = agent.processes.find(&selector(req.process)?)?;
    let sub = proc.subscribe(true);
    let deadline = ctx.timeout.map(|t| Instant::now() + t);
    tokio::spawn(stream_events(tx, proc, sub, ctx.keepalive, StreamKind::Connect { deadline }));
    Ok(())
}

enum StreamKind {
    /// The stream of `Start`: its deadline kills the process, and is reported after the end event.
    Start,
    /// The stream of `Connect`: its deadline only ends the stream.
    Connect { deadline: Option<Instant> },
}

fn event(e: ProcessEvent) -> StartResponse {
    StartResponse { event: Some(e) }
}

/// Writes `start`, the output, then `end` and the end-stream message. A client that goes away
/// only ends this task; the process keeps running.
async fn stream_events(tx: StreamTx, proc: Arc<Proc>, mut sub: Subscription, keepalive: Duration, kind: StreamKind) {
    if tx.send(&event(ProcessEvent::Start(StartEvent { pid: proc.pid }))).await.is_err() {
        return;
    }
    let deadline = match kind {
        StreamKind::Connect { deadline } => deadline,
        StreamKind::Start => None,
    };
    let mut beat = Heartbeat::new(keepalive, deadline);
    loop {
        tokio::select! {
            biased;
            d = sub.data.recv() => match d {
                Some(d) => {
                    if tx.send(&event(ProcessEvent::Data(d))).await.is_err() {
                        return;
                    }
                    beat.sent();
                }
                None => break,
            },
            idle = beat.idle(&tx) => {
                let ping = event(ProcessEvent::Keepalive(Default::default()));
                if beat.answer(idle, &tx, &ping).await.is_break() {
                    return;
                }
            }
        }
    }
    let Some(end) = sub.end() else {
        tx.finish(Some(ConnectError::internal("process output ended without an exit status"))).await;
        return;
    };
    if tx.send(&event(ProcessEvent::End(end))).await.is_err() {
        return;
    }
    let error = (matches!(kind, StreamKind::Start) && proc.deadline_hit())
        .then(|| ConnectError::new(Code::DeadlineExceeded, "deadline exceeded: the process was killed"));
    tx.finish(error).await;
}

async fn send_input(agent: &Agent, req: SendInputRequest) -> Result<SendInputResponse, ConnectError> {
    let proc = agent.processes.find_running(&selector(req.process)?)?;
    let input = req.input.ok_or_else(|| ConnectError::invalid_argument("input is required"))?;
    proc.write_input(&input).await?;
    Ok(SendInputResponse {})
}

async fn stream_input(
    agent: &Agent,
    msg: StreamInputRequest,
    target: Option<Arc<Proc>>,
) -> Result<Option<Arc<Proc>>, ConnectError> {
    match msg {
        StreamInputRequest::Start(s) => Ok(Some(agent.processes.find_running(&selector(s.process)?)?)),
        StreamInputRequest::Data(d) => {
            let proc = target.ok_or_else(|| {
                ConnectError::new(Code::FailedPrecondition, "the first message of StreamInput must be start")
            })?;
            if let Some(input) = &d.input {
                proc.write_input(input).await?;
            }
            Ok(Some(proc))
        }
        StreamInputRequest::Keepalive(_) => Ok(target),
    }
}

/// How long `SendSignal` with SIGKILL waits for the process to be gone. A killed process ends
/// at once unless it is stuck in the kernel; the answer then comes anyway, and the end follows.
const KILL_WAIT: Duration = Duration::from_secs(2);

/// Sends a signal. SIGKILL returns once the process has ended (as E2B's does), so that a
/// `kill -0` of its pid right after fails.
async fn send_signal(agent: &Agent, req: SendSignalRequest) -> Result<SendSignalResponse, ConnectError> {
    let proc = agent.processes.find_running(&selector(req.process)?)?;
    let sig = match req.signal {
        Signal::Sigkill => libc::SIGKILL,
        Signal::Sigterm => libc::SIGTERM,
        // The proto only names two signals; numbers beyond them are Linux signal numbers.
        Signal::Unknown(n) if (1..=64).contains(&n) => n,
        other => {
            return Err(ConnectError::invalid_argument(format!("invalid signal: {other:?}")));
        }
    };
    proc.signal(sig).map_err(|e| ConnectError::internal(format!("error sending signal: {e}")))?;
    if sig == libc::SIGKILL {
        // Not ended by then (stuck in the kernel): answer anyway; the end event follows.
        let _ = proc.wait_end(KILL_WAIT).await;
    }
    Ok(SendSignalResponse {})
}

async fn close_stdin(agent: &Agent, req: CloseStdinRequest) -> Result<CloseStdinResponse, ConnectError> {
    let proc = agent.processes.find_running(&selector(req.process)?)?;
    proc.close_stdin().await?;
    Ok(CloseStdinResponse {})
}

fn update(agent: &Agent, req: UpdateRequest) -> Result<UpdateResponse, ConnectError> {
    let proc = agent.processes.find_running(&selector(req.process)?)?;
    if let Some(size) = req.pty.and_then(|p| p.size) {
        proc.resize(pty::dimension(size.cols, 80), pty::dimension(size.rows, 24))?;
    }
    Ok(UpdateResponse {})
}
