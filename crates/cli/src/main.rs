//! `cordon`: self-hosted sandboxes for code that AI agents write.
//!
//! One static binary plays three roles, chosen before anything else runs:
//! - `cordon-agent` (argv[0]): PID 1 inside a sandbox;
//! - `cordon __jail`: the single-threaded jailer that builds one sandbox;
//! - `cordon __gvisor-link`: the process that serves a gvisor sandbox's agent link;
//! - `cordon __vm-link`: the same for a VM, which also holds its monitor and network ends;
//! - `/init` as PID 1: the guest init of a vm-tier sandbox;
//! - everything else: the command line.

mod api_client;
mod audit;
mod config_file;
mod copy;
mod cp;
mod doctor;
mod dockerfile;
mod exec;
mod image_cmd;
mod inject;
mod inspect;
mod kill;
mod logs;
mod mcp;
mod node;
mod preflight;
mod probe;
mod progress;
mod ps;
mod run;
mod sd_notify;
mod serve;
mod shell;
mod state;
mod template_build;
mod tiers;
mod vm;
mod volume_cmd;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// Self-hosted sandboxes for running code that AI agents write.
#[derive(Parser)]
#[command(name = "cordon", version, about, propagate_version = true)]
struct Cli {
    /// State directory: images, live sandboxes, keys.
    #[arg(long, global = true, env = "CORDON_HOME", default_value = "/var/lib/cordon", value_name = "DIR")]
    state_dir: PathBuf,
    /// Log verbosity (also RUST_LOG).
    #[arg(long, short, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one command in a fresh sandbox, then destroy it.
    Run(run::RunArgs),
    /// Build, import, list and remove images.
    #[command(subcommand)]
    Image(image_cmd::ImageCmd),
    /// Create, list, inspect and delete persistent volumes.
    #[command(subcommand)]
    Volume(volume_cmd::VolumeCmd),
    /// Check every kernel feature and tool cordon uses, and say how to fix what is missing.
    Doctor,
    /// Serve the E2B API (control plane and sandbox traffic) on one port.
    Serve(serve::ServeArgs),
    /// The VMM command line of a bare boot of the vm tier's kit (for the bench).
    #[command(name = "__vm-boot-args", hide = true)]
    VmBootArgs,
    /// Write the ns tier's seccomp programs as raw BPF files into DIR (for the bench).
    #[command(name = "__seccomp-bpf", hide = true)]
    SeccompBpf { dir: std::path::PathBuf },
    /// Serve sandboxes as tools to an MCP client (stdio, or streamable HTTP with --http).
    Mcp(mcp::McpArgs),
    /// Print a sandbox's isolation report from a running server; --verify checks it from inside.
    Inspect(inspect::InspectArgs),
    /// Print what this sandbox looks like from within, as JSON (run it inside a sandbox).
    Probe,
    /// List a running server's sandboxes: id, template, tier, state, age, CPU, memory, network.
    Ps(ps::PsArgs),
    /// Run a command in a running sandbox, streaming its output; exits with its exit code.
    Exec(exec::ExecArgs),
    /// An interactive shell in a running sandbox (a PTY; Ctrl-C goes to the sandbox).
    Shell(shell::ShellArgs),
    /// Copy one file into or out of a sandbox: `cordon cp ./f ID:/path` or `cordon cp ID:/path ./f` (no directories).
    Cp(cp::CpArgs),
    /// Kill sandboxes of a running server.
    Kill(kill::KillArgs),
    /// The nodes of a cluster: list them, drain one (no new sandboxes; wait for its own to end), undrain it.
    Node(node::NodeArgs),
    /// What a sandbox's filters refused: denied syscalls, blocked connections.
    Audit(audit::AuditArgs),
    /// What a sandbox's template start command printed; --follow for more as it comes.
    Logs(logs::LogsArgs),
}

/// An error the user caused (bad flag, unknown image): exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

fn main() -> ExitCode {
    cordon_sandbox::trace::start();
    if cordon_vm::guest::is_guest_init() {
        cordon_vm::guest::main();
    }
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_default();
    if std::path::Path::new(&argv0).file_name().is_some_and(|n| n == "cordon-agent") {
        cordon_agent::main();
    }
    match args.next() {
        Some(a) if a == "__jail" => cordon_jail::jailer::main(),
        Some(a) if a == "__gvisor-link" => cordon_gvisor::link_holder_main(),
        Some(a) if a == "__vm-link" => cordon_vm::holder::main(),
        _ => {}
    }

    // `cordon serve` takes the flags the command line leaves unset from its configuration file.
    let cli = match config_file::parse::<Cli>(std::env::args_os().collect(), std::path::Path::new(config_file::DEFAULT_PATH)) {
        Ok(cli) => cli,
        Err(config_file::ParseError::Config(e)) => {
            eprintln!("cordon: {e}");
            return ExitCode::from(2);
        }
        Err(config_file::ParseError::Clap(e)) => {
            use clap::error::ErrorKind::*;
            if matches!(e.kind(), DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand) {
                e.exit();
            }
            eprintln!("cordon: {}", clap_one_line(&e));
            return ExitCode::from(2);
        }
    };
    // A server's operator reads its sandbox events, so `serve` logs at info level by default.
    let json_log = matches!(&cli.command, Command::Serve(a) if a.log_format == serve::LogFormat::Json);
    init_tracing(if matches!(cli.command, Command::Serve(_)) { cli.verbose.max(1) } else { cli.verbose }, json_log);
    let state = state::State::new(cli.state_dir);
    let result = match cli.command {
        Command::Run(a) => run::main(&state, a),
        Command::Image(c) => image_cmd::main(&state, c).map(|()| 0),
        Command::Volume(c) => volume_cmd::main(&state, c),
        Command::Doctor => doctor::main(&state),
        Command::Serve(a) => serve::main(&state, a),
        Command::VmBootArgs => vm::boot_args(&state),
        Command::SeccompBpf { dir } => seccomp_bpf(&dir),
        Command::Mcp(a) => mcp::main(&state, a),
        Command::Inspect(a) => inspect::main(a),
        Command::Ps(a) => ps::main(a),
        Command::Exec(a) => exec::main(a),
        Command::Shell(a) => shell::main(a),
        Command::Cp(a) => cp::main(a),
        Command::Kill(a) => kill::main(a),
        Command::Node(a) => node::main(a),
        Command::Audit(a) => audit::main(a),
        Command::Logs(a) => logs::main(a),
        Command::Probe => {
            println!("{}", probe::report());
            Ok(0)
        }
    };
    cordon_sandbox::trace::print();
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            let code = if e.downcast_ref::<UsageError>().is_some() { 2 } else { 1 };
            eprintln!("cordon: {}", one_line(&e));
            ExitCode::from(code)
        }
    }
}

/// clap's multi-line usage error as one line: the message and its detail, then where to look.
fn clap_one_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let msg: Vec<&str> = text.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
    let msg = msg.join(" ");
    let msg = msg.strip_prefix("error: ").unwrap_or(&msg);
    if e.kind() == clap::error::ErrorKind::UnknownArgument {
        match std::env::args().nth(1).as_deref() {
            Some("run") => return format!("{msg}: put the command after --, as in `cordon run -- python3 -c 'print(1)'`"),
            Some("exec") => return format!("{msg}: put the command after --, as in `cordon exec ID -- ls -l`"),
            _ => {}
        }
    }
    format!("{msg} (see --help)")
}

/// The error and its causes on one line, without repeating a cause already in the message.
fn one_line(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}

fn init_tracing(verbose: u8, json: bool) {
    use tracing_subscriber::EnvFilter;
    // The forwarder's TCP/IP stack logs per packet, and every packet is the sandbox's: at warn it
    // let a sandbox print a line per datagram on the operator's terminal. Only its errors show
    // unless RUST_LOG asks (or -vv, for debugging the stack itself).
    let default = match verbose {
        0 => "warn,ipstack=error",
        1 => "info,ipstack=error",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // Colour only on a terminal: a server's log is often a file.
    use std::io::IsTerminal as _;
    let ansi = std::io::stderr().is_terminal();
    if json {
        // One object per line with a timestamp, the level, the event's fields at the top level,
        // and the request's span (its `request_id`, and `sandbox_id` for sandbox traffic).
        let _ = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
        return;
    }
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).without_time().try_init();
}

/// Resolves on the first SIGTERM or SIGINT with its name; never, if the handlers cannot be
/// installed (the process then ends the default way).
pub async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// Writes the filter programs `cordon run` installs (without auditing) as `<n>.bpf`, in install
/// order, and prints their paths.
fn seccomp_bpf(dir: &std::path::Path) -> anyhow::Result<u8> {
    use anyhow::Context;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    for (i, prog) in cordon_jail::seccomp_programs(false).iter().enumerate() {
        let path = dir.join(format!("{i}.bpf"));
        std::fs::write(&path, prog).with_context(|| format!("write {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(0)
}
