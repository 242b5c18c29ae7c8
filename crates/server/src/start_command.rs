//! An image's start command: the service every sandbox of the image runs (the code
//! interpreter's server on port 49999, for `code-interpreter-v1`), like an E2B template's.
//!
//! It goes through the agent like any command (so it runs as the sandbox's user, under the
//! sandbox's caps, in every tier), and the create is answered only once the service's port
//! accepts connections inside the sandbox. Its output goes to the sandbox's log ring
//! ([`crate::sandbox_logs`]) for as long as it runs, and its last bytes until it is ready, so
//! that a service that dies on the way says why in the create's error.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cordon_envd::process::{DataEvent, ProcessConfig, ProcessEvent, StartRequest};
use cordon_envd::{EnvdClient, ProcessStream};
use cordon_image::StartCommand;

use crate::sandbox_logs::{SandboxLogs, Stream};

/// How many times slower than the host the sandbox runs code, told to the start command (see
/// [`cordon_sandbox::Sandbox::slowdown`]).
pub const SLOWDOWN_ENV: &str = "CORDON_SLOWDOWN";
/// The tag the start command's process gets (`commands.connect`-able by it).
pub const TAG: &str = "start";
/// Output kept for the error message of a start command that fails.
const TAIL_BYTES: usize = 2048;
/// Readiness polling: the first checks come quickly (a service that binds at once costs
/// little), later ones back off.
const FIRST_POLL: Duration = Duration::from_millis(5);
const MAX_POLL: Duration = Duration::from_millis(50);

/// Why a start command failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the image's start command is empty")]
    Empty,
    #[error("cannot start `{cmd}`: {reason}")]
    Spawn { cmd: String, reason: String },
    #[error("`{cmd}` ended ({how}) before {ready}{output}")]
    Exited { cmd: String, how: String, ready: Ready, output: String },
    #[error("`{cmd}` {} within {secs}s{output}", ready.failed())]
    NotReady { cmd: String, ready: Ready, secs: u64, output: String },
    #[error("cannot check whether {ready}: {reason}")]
    Probe { ready: Ready, reason: String },
}

/// What makes a start command ready.
#[derive(Debug, Clone)]
pub enum Ready {
    /// Something listens on this port inside the sandbox.
    Port(u16),
    /// This shell command exits 0 (an E2B template's ready command).
    Cmd(String),
}

impl Ready {
    /// What a start command that never got ready did not do.
    fn failed(&self) -> String {
        match self {
            Ready::Port(p) => format!("did not open port {p}"),
            Ready::Cmd(c) => format!("did not get ready (`{c}` never passed)"),
        }
    }
}

impl std::fmt::Display for Ready {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ready::Port(p) => write!(f, "port {p} opened"),
            Ready::Cmd(c) => write!(f, "`{c}` passed"),
        }
    }
}

/// Runs a ready command once: whether it exited 0.
async fn ready_cmd_passes(client: &EnvdClient, cmd: &str, start: &StartCommand) -> Result<bool, String> {
    let req = StartRequest {
        process: Some(ProcessConfig {
            cmd: "/bin/sh".into(),
            args: vec!["-c".into(), cmd.into()],
            envs: start.env.iter().cloned().collect(),
            cwd: start.cwd.clone(),
        }),
        pty: None,
        tag: None,
        stdin: Some(false),
    };
    let mut stream = client.start(req, Some(start.user.as_str()), None).await.map_err(|e| e.to_string())?;
    while let Some(ev) = stream.next().await {
        if let ProcessEvent::End(end) = ev.map_err(|e| e.to_string())? {
            return Ok(end.exited && end.exit_code == 0);
        }
    }
    Err("its output stream closed".into())
}

/// The last bytes a process printed, for an error message.
#[derive(Default)]
struct Tail(Vec<u8>);

impl Tail {
    fn push(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
        if self.0.len() > TAIL_BYTES {
            self.0.drain(..self.0.len() - TAIL_BYTES);
        }
    }

    fn shown(&self) -> String {
        let text = String::from_utf8_lossy(&self.0);
        let text = text.trim();
        if text.is_empty() {
            String::new()
        } else {
            format!("; its last output:\n{text}")
        }
    }
}

/// Keeps what a ready start command prints in `logs` until it ends (or its sandbox does, which
/// closes the stream).
fn keep_logging(mut stream: ProcessStream, logs: Arc<SandboxLogs>) {
    tokio::spawn(async move {
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(ProcessEvent::Data(DataEvent::Stdout(b) | DataEvent::Pty(b))) => logs.push(Stream::Stdout, &b),
                Ok(ProcessEvent::Data(DataEvent::Stderr(b))) => logs.push(Stream::Stderr, &b),
                Ok(ProcessEvent::End(_)) | Err(_) => break,
                Ok(_) => {}
            }
        }
        logs.finish();
    });
}

/// Starts `start` in the sandbox behind `socket` and waits until it is ready, its output going
/// to `logs` from the first byte. `slowdown`
/// (see [`cordon_sandbox::Sandbox::slowdown`]) stretches the image's readiness timeout and the
/// polling: under an emulated CPU the service starts that many times slower, and each probe
/// costs the guest that much more.
pub async fn run(socket: &Path, start: &StartCommand, slowdown: u32, logs: &Arc<SandboxLogs>) -> Result<(), StartError> {
    let (program, args) = start.cmd.split_first().ok_or(StartError::Empty)?;
    let shown = start.cmd.join(" ");
    let client = EnvdClient::new(socket.to_path_buf());
    let req = StartRequest {
        process: Some(ProcessConfig {
            cmd: program.clone(),
            args: args.to_vec(),
            // The service's own waits (the interpreter's for its first kernel) stretch by the
            // same factor as the readiness timeout here.
            envs: start.env.iter().cloned().chain([(SLOWDOWN_ENV.to_string(), slowdown.max(1).to_string())]).collect(),
            cwd: start.cwd.clone(),
        }),
        pty: None,
        tag: Some(TAG.into()),
        stdin: Some(false),
    };
    let started = Instant::now();
    let mut stream = client
        .start(req, Some(start.user.as_str()), None)
        .await
        .map_err(|e| StartError::Spawn { cmd: shown.clone(), reason: e.to_string() })?;
    tracing::debug!(pid = stream.pid(), cmd = %shown, "start command running");
    let ready = match (start.ready_port, &start.ready_cmd) {
        (Some(port), _) => Ready::Port(port),
        (None, Some(cmd)) => Ready::Cmd(cmd.clone()),
        // Nothing to wait for.
        (None, None) => {
            keep_logging(stream, logs.clone());
            return Ok(());
        }
    };
    let slowdown = slowdown.max(1);
    let ready_secs = start.ready_timeout_secs.saturating_mul(u64::from(slowdown));
    // A ready command is a process per check: polled less eagerly than a port.
    let max_poll = if matches!(ready, Ready::Cmd(_)) { MAX_POLL * 4 } else { MAX_POLL } * slowdown;
    let deadline = started + Duration::from_secs(ready_secs);
    let mut tail = Tail::default();
    let mut delay = FIRST_POLL;
    let mut next_probe = Instant::now();
    loop {
        let now = Instant::now();
        if now >= next_probe {
            let probe = match &ready {
                Ready::Port(port) => crate::agent_link::port_open(socket, *port).await.map_err(|e| e.to_string()),
                Ready::Cmd(cmd) => ready_cmd_passes(&client, cmd, start).await,
            };
            match probe {
                Ok(true) => {
                    tracing::debug!(%ready, ms = started.elapsed().as_millis() as u64, "start command ready");
                    keep_logging(stream, logs.clone());
                    return Ok(());
                }
                Ok(false) => {}
                Err(reason) => return Err(StartError::Probe { ready, reason }),
            }
            if Instant::now() >= deadline {
                return Err(StartError::NotReady { cmd: shown, ready, secs: ready_secs, output: tail.shown() });
            }
            next_probe = Instant::now() + delay;
            delay = (delay * 2).min(max_poll);
        }
        // Meanwhile, keep its output and notice if it ends.
        match tokio::time::timeout_at(next_probe.into(), stream.next()).await {
            Err(_) => {}
            Ok(Some(Ok(ProcessEvent::Data(DataEvent::Stdout(b) | DataEvent::Pty(b))))) => {
                logs.push(Stream::Stdout, &b);
                tail.push(&b)
            }
            Ok(Some(Ok(ProcessEvent::Data(DataEvent::Stderr(b))))) => {
                logs.push(Stream::Stderr, &b);
                tail.push(&b)
            }
            Ok(Some(Ok(ProcessEvent::End(end)))) => {
                let how = if end.status.is_empty() { format!("exit code {}", end.exit_code) } else { end.status };
                return Err(StartError::Exited { cmd: shown, how, ready, output: tail.shown() });
            }
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(e))) => {
                return Err(StartError::Exited { cmd: shown, how: e.to_string(), ready, output: tail.shown() })
            }
            Ok(None) => {
                return Err(StartError::Exited {
                    cmd: shown,
                    how: "its output stream closed".into(),
                    ready,
                    output: tail.shown(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_end() {
        let mut t = Tail::default();
        t.push(&vec![b'a'; TAIL_BYTES]);
        t.push(b"\nTraceback: boom\n");
        assert_eq!(t.0.len(), TAIL_BYTES);
        assert!(t.shown().ends_with("Traceback: boom"));
        assert_eq!(Tail::default().shown(), "");
    }
}
