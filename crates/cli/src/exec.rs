//! `cordon exec ID -- CMD...`: one command in a running sandbox, through envd's
//! `process.Process/Start` on the server's data plane. Its stdout and stderr stream to ours as
//! they come; our stdin goes to it when it is not a terminal (a pipe or a file; a terminal would
//! wait for keys nobody means to type); we exit with its exit code, 128+N for signal N.
//! Ctrl-C (SIGINT) or SIGTERM here asks the sandbox to end it with SIGTERM, a second with SIGKILL.

use std::io::{IsTerminal, Read, Write};

use anyhow::{anyhow, Result};
use clap::Args;
use cordon_envd::process::{DataEvent, EndEvent, ProcessConfig, ProcessEvent, Signal, StartRequest};
use cordon_envd::EnvdClient;

use crate::api_client::{self, envd_error, Api, ServerArgs};
use crate::usage;

#[derive(Args, Debug)]
pub struct ExecArgs {
    /// The sandbox's id.
    id: String,
    /// An environment variable for the command, KEY=VALUE (repeatable).
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
    /// The command and its arguments, after --.
    #[arg(last = true, required = true, value_name = "CMD")]
    cmd: Vec<String>,
}

/// `K=V` pairs as a map; anything else is a usage error.
pub fn env_pairs(env: &[String]) -> Result<std::collections::BTreeMap<String, String>> {
    env.iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(usage(format!("-e {kv:?}: give KEY=VALUE"))),
        })
        .collect()
}

/// The exit status of an ended process as a shell reports it: its code, or 128+N when signal N
/// ended it (envd says which as Go spells it, `signal: killed`).
pub fn exit_code(end: &EndEvent) -> u8 {
    if end.exited {
        return (end.exit_code & 0xff) as u8;
    }
    let name = end.status.strip_prefix("signal: ").unwrap_or(&end.status);
    let name = name.strip_suffix(" (core dumped)").unwrap_or(name);
    (1..=64).find(|n| cordon_agent::signal_name(*n) == name).map_or(1, |n| (128 + n) as u8)
}

pub fn main(a: ExecArgs) -> Result<u8> {
    let api = Api::new(&a.server)?;
    api_client::check_id(&a.id)?;
    let envs = env_pairs(&a.env)?;
    let (program, args) = a.cmd.split_first().ok_or_else(|| usage("give the command after --, as in `cordon exec ID -- ls -l`"))?;
    let req = StartRequest {
        process: Some(ProcessConfig { cmd: program.clone(), args: args.to_vec(), envs, cwd: a.workdir.clone() }),
        pty: None,
        tag: None,
        stdin: Some(!std::io::stdin().is_terminal()),
    };
    api_client::runtime()?.block_on(async {
        let client = api.envd(&a.id).await?;
        run(&client, req, a.user.as_deref()).await
    })
}

async fn run(client: &EnvdClient, req: StartRequest, user: Option<&str>) -> Result<u8> {
    let forward_stdin = req.stdin == Some(true);
    let mut stream = client.start(req, user, None).await.map_err(envd_error)?;
    let pid = stream.pid();
    if forward_stdin {
        forward(client.clone(), pid);
    }
    let (mut int, mut term) = {
        use tokio::signal::unix::{signal, SignalKind};
        (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?)
    };
    let mut asked = 0;
    loop {
        let ev = tokio::select! {
            ev = stream.next() => ev,
            _ = int.recv() => { asked += 1; stop(client, pid, asked).await; continue }
            _ = term.recv() => { asked += 1; stop(client, pid, asked).await; continue }
        };
        match ev {
            Some(Ok(ProcessEvent::Data(DataEvent::Stdout(b) | DataEvent::Pty(b)))) => {
                let mut out = std::io::stdout().lock();
                out.write_all(&b)?;
                out.flush()?;
            }
            Some(Ok(ProcessEvent::Data(DataEvent::Stderr(b)))) => {
                let mut err = std::io::stderr().lock();
                err.write_all(&b)?;
                err.flush()?;
            }
            Some(Ok(ProcessEvent::End(end))) => return Ok(exit_code(&end)),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(envd_error(e).context("the command's output stream broke")),
            None => return Err(anyhow!("the command's output stream ended without its exit status")),
        }
    }
}

/// Asks the sandbox to end the command: SIGTERM first, SIGKILL after.
async fn stop(client: &EnvdClient, pid: u32, asked: u32) {
    let signal = if asked > 1 { Signal::Sigkill } else { Signal::Sigterm };
    // The command may have ended already; its end event says so.
    let _ = client.send_signal(pid, signal).await;
}

/// Our stdin, chunk by chunk as reads return, read on a thread of its own: a blocking read
/// must hold up neither the runtime nor its shutdown (the thread dies with the process). The
/// channel closes at end of file.
pub fn stdin_chunks() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n @ 1..) = stdin.read(&mut buf) {
            if tx.blocking_send(buf[..n].to_vec()).is_err() {
                return;
            }
        }
    });
    rx
}

/// Copies our stdin to the command's, then closes the command's stdin at our end of file.
fn forward(client: EnvdClient, pid: u32) {
    let mut chunks = stdin_chunks();
    tokio::spawn(async move {
        while let Some(b) = chunks.recv().await {
            if client.send_input(pid, &b).await.is_err() {
                return;
            }
        }
        let _ = client.close_stdin(pid).await;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell() {
        let end = |exited, code, status: &str| EndEvent { exit_code: code, exited, status: status.into(), error: None };
        assert_eq!(exit_code(&end(true, 3, "exit status 3")), 3);
        assert_eq!(exit_code(&end(false, -1, "signal: killed")), 137);
        assert_eq!(exit_code(&end(false, -1, "signal: interrupt")), 130);
        assert_eq!(exit_code(&end(false, -1, "signal: segmentation fault (core dumped)")), 139);
    }

    #[test]
    fn env_pairs_need_an_equals_sign() {
        assert_eq!(env_pairs(&["A=1".into(), "B=x=y".into()]).unwrap().get("B").map(String::as_str), Some("x=y"));
        assert!(env_pairs(&["A".into()]).is_err());
    }
}
