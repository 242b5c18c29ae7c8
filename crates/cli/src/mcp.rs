//! `cordon mcp`: sandboxes as MCP tools (see `cordon_mcp`). Flags fix the caps of every sandbox
//! the server makes; no tool call can change them.

use crate::state::State;
use crate::usage;
use anyhow::Result;
use clap::Args;
use cordon_spec::{parse_duration, parse_size};
use std::net::SocketAddr;

#[derive(Args, Debug)]
pub struct McpArgs {
    /// Serve streamable HTTP on this loopback address (path /mcp) instead of stdio.
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,
    /// Image every sandbox starts from (see `cordon image ls`); `base` is built on first use.
    #[arg(long, default_value = "base")]
    image: String,
    /// Isolation tier: ns, gvisor or vm.
    #[arg(long, default_value = "ns")]
    tier: String,
    /// Memory cap of the sandbox, swap excluded (e.g. 512M, 2G).
    #[arg(long, default_value = "512M")]
    memory: String,
    /// CPU quota of the sandbox, in whole cores.
    #[arg(long, default_value_t = 1)]
    cpus: u32,
    /// Size of the sandbox's writable layer and /tmp (memory-backed).
    #[arg(long, default_value = "1G")]
    disk: String,
    /// Wall clock a tool call gets when it asks for none.
    #[arg(long, default_value = "60s")]
    timeout: String,
    /// The most wall clock a tool call may ask for (longer requests are cut down to it).
    #[arg(long, default_value = "10m")]
    max_timeout: String,
    /// Output kept per stream of a run; the middle of longer output is cut and marked.
    #[arg(long, default_value = "64K")]
    max_output: String,
    /// Largest file read_file returns and write_file accepts.
    #[arg(long, default_value = "8M")]
    max_file: String,
    /// Open egress to a destination for every sandbox (repeatable; same forms as `cordon run
    /// --allow-net`). No tool call can widen it.
    #[arg(long = "allow-net", value_name = "RULE")]
    allow_net: Vec<String>,
    /// Close a destination an --allow-net rule would open (repeatable).
    #[arg(long = "deny-net", value_name = "RULE")]
    deny_net: Vec<String>,
    /// DNS server the egress forwarder resolves allowed names with (default: the host's).
    #[arg(long = "dns-upstream", env = "CORDON_DNS_UPSTREAM", value_name = "IP:PORT")]
    dns_upstream: Option<String>,
    /// Mount a volume in every sandbox (`cordon volume create`), e.g. the agent's workspace
    /// that outlives each session: NAME:/PATH, or NAME:/PATH:ro (repeatable).
    #[arg(long = "volume", value_name = "NAME:/PATH[:ro]")]
    volume: Vec<String>,
    #[command(flatten)]
    inject: crate::inject::InjectArgs,
}

fn config_from(a: &McpArgs) -> Result<cordon_mcp::Config> {
    let size = |flag: &str, v: &str| parse_size(v).map_err(|e| usage(format!("--{flag}: {}", e.reason)));
    let dur = |flag: &str, v: &str| parse_duration(v).map_err(|e| usage(format!("--{flag}: {}", e.reason)));
    let mib = |flag: &str, v: &str| -> Result<u64> {
        let b = size(flag, v)?;
        if b < 1 << 20 {
            return Err(usage(format!("--{flag} {v}: must be at least 1M")));
        }
        Ok(b >> 20)
    };
    let cfg = cordon_mcp::Config {
        image: a.image.clone(),
        memory_mb: mib("memory", &a.memory)?,
        cpus: a.cpus,
        disk_mb: mib("disk", &a.disk)?,
        default_timeout: dur("timeout", &a.timeout)?,
        max_timeout: dur("max-timeout", &a.max_timeout)?,
        max_output: size("max-output", &a.max_output)? as usize,
        max_file: size("max-file", &a.max_file)? as usize,
        max_entries: 1000,
        tier: a.tier.parse().map_err(|e: cordon_spec::SpecError| usage(format!("--tier: {}", e.reason)))?,
        network: cordon_spec::NetworkPolicy { transforms: a.inject.transforms()?, ..cordon_spec::NetworkPolicy::parse(&a.allow_net, &a.deny_net).map_err(|e| usage(format!("--allow-net: {}", e.reason)))? },
        volumes: Vec::new(),
        egress_ca: None,
    };
    if !cfg.network.transforms.is_empty() && !cfg.network.is_enabled() {
        return Err(usage("--inject: the sandboxes have no network; open the rule's host with --allow-net (rules do not open it)"));
    }
    for v in &a.volume {
        crate::volume_cmd::parse_mount(v)?;
    }
    cfg.validate().map_err(usage)?;
    Ok(cfg)
}

pub fn main(state: &State, a: McpArgs) -> Result<u8> {
    let cfg = config_from(&a)?;
    if let Some(addr) = a.http.filter(|a| !a.ip().is_loopback()) {
        // Whoever reaches the port runs code: without authentication, loopback only.
        return Err(usage(format!(
            "--http {addr}: the MCP endpoint has no authentication, so it listens on loopback only (e.g. 127.0.0.1:{}); put an authenticating proxy in front for remote clients",
            addr.port()
        )));
    }
    let caps = crate::tiers::capabilities(cfg.tier);
    caps.check_network(cfg.tier, &cfg.network).map_err(|e| usage(e.to_string()))?;
    if !a.volume.is_empty() && !caps.volumes {
        return Err(usage(format!("--volume: the {} tier cannot mount volumes", cfg.tier)));
    }
    let dns_upstream = crate::preflight::dns_upstream(a.dns_upstream.as_deref())?;
    crate::preflight::require_root("cordon mcp needs root (sandboxes need cgroups and idmapped mounts): run it as root")?;
    // Held (and mounted on the host) for as long as this serves: no `cordon volume rm` under it.
    let (mounts, _volumes) = crate::volume_cmd::attach(state, &a.volume)?;
    let intercept = a.inject.interception(state.dir(), &cfg.network.transforms)?;
    let egress_ca = intercept.as_ref().map(|i| i.ca().cert_pem().to_string());
    let cfg = cordon_mcp::Config { volumes: mounts, egress_ca, ..cfg };
    cordon_jail::become_subreaper();
    cordon_host::orphans::start();
    // Opening the tier reaps whatever a crashed cordon left behind, and refuses a tier this
    // host cannot run.
    let backend = state.backend(cfg.tier, dns_upstream, intercept)?;
    // Checked (and built, for a known recipe) before the client's first call: a missing image is
    // the operator's problem to hear about now, not the model's later.
    let spec = cordon_spec::SandboxSpec { tier: cfg.tier, image: cfg.image.clone(), ..Default::default() };
    crate::image_cmd::ensure(state, backend.as_ref(), &spec, Some("mcp"))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        match a.http {
            Some(addr) => cordon_mcp::serve_http(backend, cfg, addr, shutdown()).await,
            None => cordon_mcp::serve_stdio(backend, cfg, shutdown()).await,
        }
    })
    .map_err(|e| match e {
        cordon_mcp::Error::Config(m) => usage(m),
        e => e.into(),
    })?;
    // stdin may still have a blocking read in flight (a terminal, not a pipe), which would hold
    // the runtime's shutdown: every sandbox is gone by now, so leave without waiting for it.
    rt.shutdown_background();
    Ok(0)
}

/// Resolves on the first SIGTERM or SIGINT.
async fn shutdown() {
    let name = crate::stop_signal().await;
    tracing::info!("{name}: destroying the sandboxes");
}
