//! `cordon run`: one command in a fresh sandbox, streamed live, then nothing left behind.

use crate::state::State;
use crate::usage;
use anyhow::Result;
use clap::Args;
use cordon_sandbox::{Backend, Blocked, Capabilities, Denial, Error as BackendError, Sandbox, SandboxSpec};
use cordon_spec::{format_size, parse_duration, parse_env, parse_size, Limits, NetworkPolicy, Tier};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Image to run (see `cordon image ls`); `base` is built on first use.
    #[arg(long, default_value = "base")]
    image: String,
    /// Isolation tier: ns, gvisor or vm.
    #[arg(long, default_value = "ns")]
    tier: String,
    /// Memory cap, swap excluded (e.g. 512M, 2G).
    #[arg(long, default_value = "512M")]
    memory: String,
    /// CPU quota in cores (fractional allowed).
    #[arg(long, default_value_t = 1.0)]
    cpus: f64,
    /// Maximum number of processes and threads.
    #[arg(long, default_value_t = 256)]
    pids: u32,
    /// Size of the writable layer over the image, and of /tmp (memory-backed).
    #[arg(long, default_value = "1G")]
    disk: String,
    /// Open-file limit of every process.
    #[arg(long, default_value_t = cordon_spec::DEFAULT_NOFILE)]
    nofile: u64,
    /// Wall-clock limit; the whole sandbox is killed when it passes (exit 124).
    #[arg(long, default_value = "300s")]
    timeout: String,
    /// Environment variable for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Working directory inside the sandbox (default: the user's home).
    #[arg(long, short = 'w')]
    workdir: Option<String>,
    /// User inside the sandbox (`user` or `root`, or any user of the image; default: the
    /// image's user, `User` of an OCI image's config).
    #[arg(long, short = 'u')]
    user: Option<String>,
    /// Copy a host file or directory in before the command starts (repeatable). Never mounted.
    #[arg(long = "copy", value_name = "HOST:SANDBOX")]
    copy: Vec<String>,
    /// Mount a volume (`cordon volume create`) at an absolute path, read-write or with `:ro`
    /// read-only (repeatable).
    #[arg(long = "volume", value_name = "NAME:/PATH[:ro]")]
    volume: Vec<String>,
    /// Allow ptrace and process_vm_* inside the sandbox (debuggers, profilers).
    #[arg(long)]
    allow_ptrace: bool,
    /// Open egress to a destination (repeatable): a domain (`pypi.org`), subdomains
    /// (`*.pythonhosted.org`), an address or CIDR (`198.51.100.0/24`), each with an optional
    /// `:PORT` or `:LOW-HIGH`. Without any, the sandbox has loopback only.
    #[arg(long = "allow-net", value_name = "RULE")]
    allow_net: Vec<String>,
    /// Close a destination that an --allow-net rule would open (repeatable, same forms; the
    /// more specific rule wins, deny on a tie).
    #[arg(long = "deny-net", value_name = "RULE")]
    deny_net: Vec<String>,
    /// DNS server the egress forwarder resolves allowed names with (default: the host's
    /// /etc/resolv.conf).
    #[arg(long = "dns-upstream", env = "CORDON_DNS_UPSTREAM", value_name = "IP:PORT")]
    dns_upstream: Option<String>,
    #[command(flatten)]
    inject: crate::inject::InjectArgs,
    /// Print a summary of the syscalls the filter denied and the network attempts the egress
    /// policy blocked, at exit.
    #[arg(long)]
    audit: bool,
    /// Print a final JSON record (exit code, reason, duration, peak memory) as the last line of stdout.
    #[arg(long)]
    json: bool,
    /// Print the sandbox's isolation report (what confined it, measured on the host as the
    /// command ended; the README's schema) as one JSON line on stderr.
    #[arg(long)]
    report: bool,
    /// Run the image's own command (its config's Entrypoint and Cmd); arguments after `--`
    /// then replace Cmd, as with `docker run`.
    #[arg(long)]
    image_command: bool,
    /// The command and its arguments, after `--`.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

/// Why a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Exit,
    Signal(i32),
    Oom,
    Timeout,
    Interrupted,
    SandboxDied,
}

impl Reason {
    fn name(self) -> &'static str {
        match self {
            Reason::Exit => "exit",
            Reason::Signal(9) => "killed",
            Reason::Signal(_) => "signal",
            Reason::Oom => "oom",
            Reason::Timeout => "timeout",
            Reason::Interrupted => "interrupted",
            Reason::SandboxDied => "sandbox_died",
        }
    }
}

fn spec_from(a: &RunArgs) -> Result<SandboxSpec> {
    let bad = |e: cordon_spec::SpecError, flag: &str| usage(format!("--{flag}: {}", e.reason));
    let tier: Tier = a.tier.parse().map_err(|e| bad(e, "tier"))?;
    let limits = Limits {
        memory_bytes: parse_size(&a.memory).map_err(|e| bad(e, "memory"))?,
        cpus: a.cpus,
        pids: a.pids,
        disk_bytes: parse_size(&a.disk).map_err(|e| bad(e, "disk"))?,
        nofile: a.nofile,
        timeout: parse_duration(&a.timeout).map_err(|e| bad(e, "timeout"))?,
    };
    let none: [&str; 0] = [];
    NetworkPolicy::parse(&none, &a.deny_net).map_err(|e| bad(e, "deny-net"))?;
    let mut network = NetworkPolicy::parse(&a.allow_net, &a.deny_net).map_err(|e| bad(e, "allow-net"))?;
    network.transforms = a.inject.transforms()?;
    if !network.transforms.is_empty() && !network.is_enabled() {
        return Err(usage("--inject: the sandbox has no network; open the rule's host with --allow-net (rules do not open it)"));
    }
    let env = a.env.iter().map(|e| parse_env(e)).collect::<Result<Vec<_>, _>>().map_err(|e| bad(e, "env"))?;
    let spec = SandboxSpec {
        id: cordon_sandbox::new_id(),
        image: a.image.clone(),
        tier,
        limits,
        env,
        workdir: a.workdir.clone(),
        user: a.user.clone().unwrap_or_else(|| "user".into()),
        allow_ptrace: a.allow_ptrace,
        network,
        // Always recorded; `--audit` decides whether it is printed.
        audit: true,
        keep_writable: false,
        restore: None,
        disk_from: None,
        volumes: Vec::new(),
        // Set with the rules' TLS termination (see `plan`).
        egress_ca: None,
        // A one-shot sandbox ends with this process.
        keep: false,
    };
    for v in &a.volume {
        crate::volume_cmd::parse_mount(v)?;
    }
    if spec.network.transforms.is_empty() {
        spec.validate().map_err(|e| usage(format!("--{}: {}", e.field, e.reason)))?;
    }
    Ok(spec)
}

/// A `--copy` pair, checked before any sandbox exists.
struct Copy {
    host: PathBuf,
    sandbox: String,
}

fn parse_copy(s: &str) -> Result<Copy> {
    let (host, sandbox) = s
        .rsplit_once(':')
        .filter(|(h, s)| !h.is_empty() && !s.is_empty())
        .ok_or_else(|| usage(format!("--copy {s}: use HOST_PATH:SANDBOX_PATH")))?;
    let host = PathBuf::from(host);
    if !host.exists() {
        return Err(usage(format!("--copy {s}: {} does not exist on the host", host.display())));
    }
    Ok(Copy { host, sandbox: sandbox.to_string() })
}

pub fn main(state: &State, a: RunArgs) -> Result<u8> {
    if a.command.is_empty() && !a.image_command {
        return Err(usage("give the command to run after `--` (e.g. `cordon run -- python3 -V`), or --image-command to run the image's own"));
    }
    let mut plan = plan(state, &a)?;
    let backend = open_tier(state, &plan)?;
    let command = image_defaults(state, &a, &mut plan.spec)?;
    let rt = runtime(&plan.spec)?;
    cordon_sandbox::trace::mark("flags, image and tier checked");
    let started = Instant::now();
    let sandbox = create_sandbox(&rt, backend.as_ref(), &plan.spec)?;
    tracing::debug!(elapsed = ?started.elapsed(), "sandbox created");
    cordon_sandbox::trace::mark("sandbox created");
    let end = run_and_destroy(rt, sandbox, &plan, &command, started, a.report);

    let spec = &plan.spec;
    let ended = match end.outcome {
        Ok(ended) => ended,
        Err(e) => {
            end.teardown.map_err(|t| anyhow::anyhow!("{t}"))?;
            return Err(e);
        }
    };
    let (code, reason) = exit_of(ended, end.stats.oom);
    report_reason(reason, spec, &a.timeout);
    if a.audit {
        report_audit(spec, plan.caps, &end.stats);
    }
    if let Some(r) = &end.stats.report {
        eprintln!("{r}");
    }
    if let Err(e) = end.teardown {
        eprintln!("cordon: warning: {e}");
    }
    if a.json {
        print_record(spec, code, reason, end.duration, &end.stats);
    }
    Ok(code.clamp(0, 255) as u8)
}

/// A run checked in full: nothing of it is built or started until every flag has passed.
struct Plan {
    spec: SandboxSpec,
    dns_upstream: Option<std::net::SocketAddr>,
    /// TLS termination for the --inject rules' hosts.
    intercept: Option<Arc<cordon_net::Interception>>,
    copies: Vec<Copy>,
    caps: Capabilities,
    /// The volumes' holds: released once the sandbox is gone.
    _volumes: Vec<cordon_volume::Lease>,
}

fn plan(state: &State, a: &RunArgs) -> Result<Plan> {
    let spec = spec_from(a)?;
    let dns_upstream = crate::preflight::dns_upstream(a.dns_upstream.as_deref())?;
    let copies = a.copy.iter().map(|c| parse_copy(c)).collect::<Result<Vec<_>>>()?;
    let caps = crate::tiers::capabilities(spec.tier);
    caps.check_network(spec.tier, &spec.network).map_err(|e| usage(e.to_string()))?;
    crate::preflight::require_root(format!(
        "the {} tier needs root (it creates cgroups and mounts): run cordon as root",
        spec.tier
    ))?;
    let mut spec = spec;
    let intercept = a.inject.interception(state.dir(), &spec.network.transforms)?;
    if let Some(i) = &intercept {
        spec.egress_ca = Some(i.ca().cert_pem().to_string());
        spec.validate().map_err(|e| usage(format!("--{}: {}", e.field, e.reason)))?;
    }
    if !a.volume.is_empty() {
        if !caps.volumes {
            return Err(usage(format!("--volume: the {} tier cannot mount volumes yet: use --tier ns or gvisor", spec.tier)));
        }
        let (mounts, leases) = crate::volume_cmd::attach(state, &a.volume)?;
        spec.volumes = mounts;
        spec.validate().map_err(|e| usage(format!("--{}: {}", e.field, e.reason)))?;
        return Ok(Plan { spec, dns_upstream, intercept, copies, caps, _volumes: leases });
    }
    Ok(Plan { spec, dns_upstream, intercept, copies, caps, _volumes: Vec::new() })
}

/// What the image's config decides where the flags did not: the user and working directory
/// (an OCI image's `User` and `WorkingDir`), and with `--image-command` the command itself.
fn image_defaults(state: &State, a: &RunArgs, spec: &mut SandboxSpec) -> Result<Vec<String>> {
    let image = state.images()?.get(&spec.image).map_err(crate::image_cmd::image_error)?;
    if a.user.is_none() {
        spec.user = image.meta.default_user.clone();
    }
    if spec.workdir.is_none() {
        spec.workdir = image.meta.workdir.clone();
    }
    if !a.image_command {
        return Ok(a.command.clone());
    }
    let cmd = if a.command.is_empty() { &image.meta.cmd } else { &a.command };
    let full: Vec<String> = image.meta.entrypoint.iter().chain(cmd).cloned().collect();
    if full.is_empty() {
        return Err(usage(format!("image {} has no Entrypoint or Cmd: give the command after `--`", spec.image)));
    }
    Ok(full)
}

/// Opens the tier and makes sure its image is ready, before any sandbox exists.
fn open_tier(state: &State, plan: &Plan) -> Result<Arc<dyn Backend>> {
    cordon_jail::become_subreaper();
    // A tier the host cannot run is refused here, before any image is built; never a fallback.
    let backend = state.backend(plan.spec.tier, plan.dns_upstream, plan.intercept.clone())?;
    // The image (built on first use) and whatever the tier prepares for its first sandbox of
    // it (a VM's kit and disk), shown as image builds are.
    crate::image_cmd::ensure(state, backend.as_ref(), &plan.spec, None)?;
    Ok(backend)
}

fn runtime(spec: &SandboxSpec) -> Result<tokio::runtime::Runtime> {
    // The egress forwarder runs in this runtime; a second worker keeps a busy download from
    // delaying the command's stream (and the other way round).
    Ok(if spec.network.is_enabled() {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?
    } else {
        tokio::runtime::Builder::new_current_thread().enable_all().build()?
    })
}

fn create_sandbox(rt: &tokio::runtime::Runtime, backend: &dyn Backend, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
    // The egress forwarder a tier starts at create belongs to this runtime.
    let _enter = rt.enter();
    backend.create(spec).map_err(|e| match e {
        BackendError::Unavailable(m) | BackendError::BadRequest(m) | BackendError::UnknownTemplate(m) => usage(m),
        e => anyhow::anyhow!("create sandbox: {e}"),
    })
}

/// What a run left to report once its sandbox is gone.
struct End {
    outcome: Result<Ended>,
    stats: Stats,
    teardown: Result<(), BackendError>,
    duration: Duration,
}

/// The sandbox's own account of the run, read before it is destroyed.
struct Stats {
    oom: bool,
    landlock: Option<String>,
    denials: Vec<Denial>,
    blocked: Vec<Blocked>,
    injected: Vec<cordon_sandbox::Injected>,
    /// `None` where the tier cannot tell (printed as null, never as a 0 that looks measured).
    peak: Option<u64>,
    cpu_usec: Option<u64>,
    /// The isolation report, with `--report`.
    report: Option<serde_json::Value>,
}

/// Drives the command to its end, reads the sandbox's stats, then destroys it and the runtime.
fn run_and_destroy(rt: tokio::runtime::Runtime, mut sandbox: Box<dyn Sandbox>, plan: &Plan, cmd: &[String], started: Instant, report: bool) -> End {
    let outcome = rt.block_on(drive(sandbox.as_ref(), &plan.spec, cmd, &plan.copies));
    let blocked = sandbox.blocked();
    tracing::debug!(elapsed = ?started.elapsed(), "command ended");
    cordon_sandbox::trace::mark("command ran through the agent");
    // A VM's count comes from its guest, a round trip through the agent: asked only when the
    // command was killed.
    let killed = matches!(outcome, Ok(Ended::Signaled(9) | Ended::Died));
    let oom = (killed || plan.caps.host_oom_count) && sandbox.oom_kills().is_some_and(|n| n > 0);
    let stats = Stats {
        oom,
        landlock: sandbox.landlock(),
        denials: sandbox.denials(),
        blocked,
        injected: sandbox.injected(),
        peak: sandbox.peak_memory(),
        cpu_usec: sandbox.cpu_usage_usec(),
        report: report.then(|| cordon_sandbox::report::report(&plan.spec.id, plan.spec.tier, sandbox.as_ref(), &plan.spec.network)),
    };
    cordon_sandbox::trace::mark("stats read");
    let teardown = sandbox.destroy();
    // Flows still open belonged to the sandbox just destroyed: do not wait for them (ipstack
    // streams block in their destructors until their session tasks end).
    rt.shutdown_background();
    let duration = started.elapsed();
    tracing::debug!(elapsed = ?duration, "sandbox destroyed");
    cordon_sandbox::trace::mark("sandbox destroyed");
    End { outcome, stats, teardown, duration }
}

/// The exit code and reason of a command that ended.
fn exit_of(ended: Ended, oom: bool) -> (i32, Reason) {
    match ended {
        Ended::Exited(code) => (code, Reason::Exit),
        Ended::Signaled(9) if oom => (137, Reason::Oom),
        Ended::Signaled(sig) => (128 + sig, Reason::Signal(sig)),
        Ended::Timeout => (124, Reason::Timeout),
        Ended::Interrupted(sig) => (128 + sig, Reason::Interrupted),
        Ended::Died if oom => (137, Reason::Oom),
        Ended::Died => (137, Reason::SandboxDied),
    }
}

/// One line on stderr for an end the command's own output would not explain.
fn report_reason(reason: Reason, spec: &SandboxSpec, timeout_flag: &str) {
    match reason {
        Reason::Oom => eprintln!("cordon: out of memory (limit {})", format_size(spec.limits.memory_bytes)),
        Reason::Timeout => eprintln!("cordon: timed out after {} (limit --timeout {})", secs(spec.limits.timeout), timeout_flag),
        Reason::Signal(9) => eprintln!("cordon: command killed (SIGKILL)"),
        Reason::Interrupted => eprintln!("cordon: interrupted; sandbox destroyed"),
        Reason::SandboxDied => eprintln!("cordon: the sandbox died unexpectedly"),
        _ => {}
    }
}

/// `--audit`: the denied syscalls and the blocked network attempts, on stderr.
fn report_audit(spec: &SandboxSpec, caps: Capabilities, stats: &Stats) {
    if !caps.syscall_audit {
        // The host's syscall filter is the ns tier's; under gVisor or in a VM, their own
        // kernel answers.
        eprintln!("cordon: audit: not available in the {} tier (no host syscall filter to record)", spec.tier);
    } else if stats.denials.is_empty() {
        eprintln!("cordon: audit: no syscall was denied");
    } else {
        let parts: Vec<String> = stats
            .denials
            .iter()
            .map(|d| {
                let pids: Vec<String> = d.pids.iter().map(|p| p.to_string()).collect();
                format!("{} x{} (pid {})", d.syscall, d.count, pids.join(","))
            })
            .collect();
        eprintln!("cordon: audit: denied {}", parts.join("; "));
    }
    if spec.network.is_enabled() {
        if stats.blocked.is_empty() {
            eprintln!("cordon: audit: no network attempt was blocked");
        }
        for b in &stats.blocked {
            let name = b.name.as_ref().map(|n| format!(" ({n})")).unwrap_or_default();
            eprintln!("cordon: audit: blocked {} {}{} x{}: {}", b.proto, b.destination, name, b.count, b.reason);
        }
        for i in &stats.injected {
            eprintln!("cordon: audit: injected {} into requests to {} x{}", i.header, i.host, i.count);
        }
    }
}

/// `--json`: the run's record, as the last line of stdout.
fn print_record(spec: &SandboxSpec, code: i32, reason: Reason, duration: Duration, stats: &Stats) {
    let rec = serde_json::json!({
        "sandbox_id": spec.id,
        "exit_code": code,
        "reason": reason.name(),
        "duration_ms": duration.as_secs_f64() * 1000.0,
        "peak_memory_bytes": stats.peak,
        "cpu_time_ms": stats.cpu_usec.map(|u| u / 1000),
        "oom_killed": stats.oom,
        "landlock": stats.landlock,
        "denied_syscalls": stats.denials,
        "blocked_connections": stats.blocked,
        "injected_headers": stats.injected,
    });
    // A reader that went away (`| head`) loses the record; that is no reason to panic, and the
    // exit status still says how the command ended.
    let _ = writeln!(std::io::stdout(), "{rec}");
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

#[derive(Debug)]
enum Ended {
    Exited(i32),
    Signaled(i32),
    Timeout,
    Interrupted(i32),
    Died,
}

async fn drive(sandbox: &dyn Sandbox, spec: &SandboxSpec, cmd: &[String], copies: &[Copy]) -> Result<Ended> {
    use tokio::signal::unix::{signal, SignalKind};
    let deadline = tokio::time::sleep(spec.limits.timeout);
    tokio::pin!(deadline);
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let died = async {
        match sandbox.death_fd() {
            Some(owned) => {
                // SAFETY: `owned` is a pidfd this AsyncFd owns outright, so it stays open and
                // refers to the same process for the AsyncFd's whole life.
                let afd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) }
                    .map_err(|e| e.into_parts().1)?;
                let _ = afd.readable().await?;
                Ok::<_, std::io::Error>(())
            }
            None => std::future::pending().await,
        }
    };
    tokio::pin!(died);
    let work = run_command(sandbox.socket_path(), spec, cmd, copies);
    tokio::pin!(work);
    let ended = tokio::select! {
        r = &mut work => r?,
        _ = &mut deadline => Ended::Timeout,
        _ = sigint.recv() => Ended::Interrupted(libc::SIGINT),
        _ = sigterm.recv() => Ended::Interrupted(libc::SIGTERM),
        _ = &mut died => {
            // The stream may still hold the end event: give it a moment to finish first.
            match tokio::time::timeout(Duration::from_millis(200), &mut work).await {
                Ok(Ok(e)) => e,
                _ => Ended::Died,
            }
        }
    };
    if !matches!(ended, Ended::Exited(_) | Ended::Signaled(_)) {
        sandbox.kill();
    }
    Ok(ended)
}

async fn run_command(socket: &Path, spec: &SandboxSpec, cmd: &[String], copies: &[Copy]) -> Result<Ended> {
    use cordon_envd::process::{DataEvent, ProcessConfig, ProcessEvent, StartRequest};
    let client = cordon_envd::EnvdClient::new(socket.to_path_buf());
    let user = Some(spec.user.as_str());
    for c in copies {
        crate::copy::copy_in(&client, &c.host, &c.sandbox, user).await?;
    }
    let req = StartRequest {
        process: Some(ProcessConfig {
            cmd: cmd[0].clone(),
            args: cmd[1..].to_vec(),
            envs: Default::default(),
            cwd: spec.workdir.clone(),
        }),
        pty: None,
        tag: None,
        stdin: Some(true),
    };
    let mut stream = match client.start(req, user, None).await {
        Ok(s) => s,
        Err(e) => return Err(start_error(e, spec)),
    };
    let mut stdin_task: Option<tokio::task::JoinHandle<()>> = None;
    let result = loop {
        let Some(ev) = stream.next().await else { break Ended::Died };
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                tracing::debug!("event stream broke: {e}");
                break Ended::Died;
            }
        };
        match ev {
            ProcessEvent::Start(s) => {
                let client = client.clone();
                stdin_task = Some(tokio::spawn(forward_stdin(client, s.pid)));
            }
            ProcessEvent::Data(DataEvent::Stdout(b)) => write_out(&mut std::io::stdout().lock(), &b),
            ProcessEvent::Data(DataEvent::Stderr(b)) => write_out(&mut std::io::stderr().lock(), &b),
            ProcessEvent::Data(DataEvent::Pty(b)) => write_out(&mut std::io::stdout().lock(), &b),
            ProcessEvent::Keepalive(_) => {}
            ProcessEvent::End(end) => {
                break match signal_of(&end.status) {
                    Some(sig) if !end.exited => Ended::Signaled(sig),
                    _ => Ended::Exited(end.exit_code),
                }
            }
        }
    };
    if let Some(t) = stdin_task {
        t.abort();
    }
    Ok(result)
}

fn start_error(e: cordon_envd::Error, spec: &SandboxSpec) -> anyhow::Error {
    let msg = e.to_string();
    if msg.contains("unauthenticated") || msg.contains("user") && msg.contains("not found") {
        return usage(format!("--user {}: no such user in image {}", spec.user, spec.image));
    }
    if msg.contains("cwd") {
        return usage(format!("--workdir: {msg}"));
    }
    if msg.contains("No such file") || msg.contains("not found") {
        return usage(format!("command not found in image {}: {msg}", spec.image));
    }
    anyhow::anyhow!("start command: {msg}")
}

fn write_out(w: &mut dyn Write, b: &[u8]) {
    // A closed stdout (e.g. piped into `head`) must not abort the run: the sandbox still has to
    // be torn down properly.
    let _ = w.write_all(b);
    let _ = w.flush();
}

async fn forward_stdin(client: cordon_envd::EnvdClient, pid: u32) {
    use tokio::io::AsyncReadExt;
    let mut stdin = tokio::io::stdin();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match stdin.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if client.send_input(pid, &buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
    let _ = client.close_stdin(pid).await;
}

/// Go's names for the signals a process commonly dies of, as envd reports them.
fn signal_of(status: &str) -> Option<i32> {
    let name = status.strip_prefix("signal: ")?;
    let name = name.trim_end_matches(" (core dumped)");
    Some(match name {
        "hangup" => 1,
        "interrupt" => 2,
        "quit" => 3,
        "illegal instruction" => 4,
        "trace/breakpoint trap" => 5,
        "aborted" => 6,
        "bus error" => 7,
        "floating point exception" => 8,
        "killed" => 9,
        "user defined signal 1" => 10,
        "segmentation fault" => 11,
        "user defined signal 2" => 12,
        "broken pipe" => 13,
        "alarm clock" => 14,
        "terminated" => 15,
        other => other.strip_prefix("signal ").and_then(|n| n.parse().ok())?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_from_go_status_strings() {
        assert_eq!(signal_of("signal: killed"), Some(9));
        assert_eq!(signal_of("signal: segmentation fault (core dumped)"), Some(11));
        assert_eq!(signal_of("exit status 1"), None);
    }

    #[test]
    fn copy_pairs() {
        assert!(parse_copy("/etc/hostname:/home/user/h").is_ok());
        assert!(parse_copy("nocolon").is_err());
        assert!(parse_copy("/definitely/not/here:/x").is_err());
    }
}
