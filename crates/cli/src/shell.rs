//! `cordon shell ID`: an interactive terminal in a running sandbox. envd's `Start` with a PTY
//! the size of ours; our terminal in raw mode, so that every key (Ctrl-C, Ctrl-D, Ctrl-Z
//! included) reaches the sandbox's PTY as a byte through `SendInput`, whose line discipline
//! turns it into a signal there; SIGWINCH sends our new size with `Update`. Our terminal's
//! settings come back on every way out: the shell's end, an error, SIGTERM/SIGHUP/SIGINT from
//! outside, a panic.

use std::io::{IsTerminal, Write};
use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use cordon_envd::process::{DataEvent, ProcessConfig, ProcessEvent, Pty, PtySize, Signal, StartRequest};
use cordon_envd::EnvdClient;
use rustix::termios::{tcgetattr, tcgetwinsize, tcsetattr, OptionalActions, Termios};

use crate::api_client::{self, envd_error, Api, ServerArgs};
use crate::usage;

#[derive(Args, Debug)]
pub struct ShellArgs {
    /// The sandbox's id.
    id: String,
    /// An environment variable for the shell, KEY=VALUE (repeatable).
    #[arg(short = 'e', long = "env", value_name = "K=V")]
    env: Vec<String>,
    /// Working directory inside the sandbox (default: the user's home).
    #[arg(short = 'w', long = "workdir", value_name = "DIR")]
    workdir: Option<String>,
    /// The user to run as (default: the sandbox's default user).
    #[arg(short = 'u', long = "user")]
    user: Option<String>,
    #[command(flatten)]
    server: ServerArgs,
    /// What to run instead of `/bin/bash -l`, after --.
    #[arg(last = true, value_name = "CMD")]
    cmd: Vec<String>,
}

/// Our terminal's settings before raw mode, for whichever way out restores them.
static SAVED: OnceLock<Termios> = OnceLock::new();

fn restore() {
    if let Some(t) = SAVED.get() {
        // Drain: what the shell printed last is shown with the settings it was written for.
        let _ = tcsetattr(std::io::stdin(), OptionalActions::Drain, t);
    }
}

/// Raw mode while it lives.
struct Raw;

impl Raw {
    fn enter() -> Result<Raw> {
        let saved = tcgetattr(std::io::stdin()).context("read the terminal's settings")?;
        let mut raw = saved.clone();
        raw.make_raw();
        if SAVED.set(saved).is_ok() {
            // The release build aborts on a panic, so no destructor would run: the hook does.
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                restore();
                previous(info);
            }));
        }
        tcsetattr(std::io::stdin(), OptionalActions::Now, &raw).context("put the terminal in raw mode")?;
        Ok(Raw)
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        restore();
    }
}

/// Our terminal's size, 80x24 when it does not say.
fn size() -> PtySize {
    match tcgetwinsize(std::io::stdin()) {
        Ok(w) if w.ws_col > 0 && w.ws_row > 0 => PtySize { cols: w.ws_col.into(), rows: w.ws_row.into() },
        _ => PtySize { cols: 80, rows: 24 },
    }
}

pub fn main(a: ShellArgs) -> Result<u8> {
    let api = Api::new(&a.server)?;
    api_client::check_id(&a.id)?;
    if !std::io::stdin().is_terminal() {
        return Err(usage("cordon shell needs a terminal on stdin: for a command without one, use `cordon exec ID -- CMD`"));
    }
    let mut envs = crate::exec::env_pairs(&a.env)?;
    // The sandbox's programs draw for the terminal we have.
    envs.entry("TERM".into()).or_insert_with(|| std::env::var("TERM").ok().filter(|t| !t.is_empty()).unwrap_or_else(|| "xterm-256color".into()));
    let (cmd, args) = match a.cmd.split_first() {
        Some((c, rest)) => (c.clone(), rest.to_vec()),
        None => ("/bin/bash".to_string(), vec!["-l".to_string()]),
    };
    let req = StartRequest {
        process: Some(ProcessConfig { cmd, args, envs, cwd: a.workdir.clone() }),
        pty: Some(Pty { size: Some(size()) }),
        tag: None,
        stdin: None,
    };
    api_client::runtime()?.block_on(async {
        let client = api.envd(&a.id).await?;
        let stream = client.start(req, a.user.as_deref(), None).await.map_err(envd_error)?;
        let raw = Raw::enter()?;
        let code = session(&client, stream).await;
        drop(raw);
        code
    })
}

async fn session(client: &EnvdClient, mut stream: cordon_envd::ProcessStream) -> Result<u8> {
    use tokio::signal::unix::{signal, SignalKind};
    let pid = stream.pid();
    let (mut winch, mut term, mut hup, mut int) =
        (signal(SignalKind::window_change())?, signal(SignalKind::terminate())?, signal(SignalKind::hangup())?, signal(SignalKind::interrupt())?);
    let mut keys = crate::exec::stdin_chunks();
    let typing = client.clone();
    // Keys go in order, one call at a time; what piles up meanwhile goes in the next call.
    let input = tokio::spawn(async move {
        while let Some(mut b) = keys.recv().await {
            while let Ok(more) = keys.try_recv() {
                b.extend_from_slice(&more);
            }
            if typing.send_pty_input(pid, &b).await.is_err() {
                return;
            }
        }
    });
    let result = loop {
        let ev = tokio::select! {
            ev = stream.next() => ev,
            _ = winch.recv() => {
                let s = size();
                let _ = client.resize_pty(pid, s.cols, s.rows).await;
                continue;
            }
            _ = term.recv() => break ended_here(client, pid, libc::SIGTERM).await,
            _ = hup.recv() => break ended_here(client, pid, libc::SIGHUP).await,
            _ = int.recv() => break ended_here(client, pid, libc::SIGINT).await,
        };
        match ev {
            Some(Ok(ProcessEvent::Data(DataEvent::Pty(b) | DataEvent::Stdout(b) | DataEvent::Stderr(b)))) => {
                let mut out = std::io::stdout().lock();
                out.write_all(&b)?;
                out.flush()?;
            }
            Some(Ok(ProcessEvent::End(end))) => break Ok(crate::exec::exit_code(&end)),
            Some(Ok(_)) => {}
            Some(Err(e)) => break Err(envd_error(e).context("the shell's stream broke")),
            None => break Err(anyhow!("the shell's stream ended without its exit status")),
        }
    };
    input.abort();
    result
}

/// We were told to stop: the shell goes too (an interactive shell ignores SIGTERM, so it is
/// killed), and we exit as the signal says.
async fn ended_here(client: &EnvdClient, pid: u32, sig: i32) -> Result<u8> {
    let _ = client.send_signal(pid, Signal::Sigkill).await;
    Ok((128 + sig) as u8)
}
