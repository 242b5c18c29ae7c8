//! `cordon serve`: the E2B-compatible API and data plane on one port (see `cordon_server`).

use crate::state::State;
use crate::usage;
use anyhow::{Context, Result};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on, for the API and every sandbox's traffic.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// API key clients send in X-API-KEY (default: generated on first start, kept in <state>/api-key).
    #[arg(long, env = "CORDON_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Most sandboxes alive at once; further creates get 429.
    #[arg(long, default_value_t = 100)]
    max_sandboxes: usize,
    /// envd version reported to SDKs (it turns SDK features on and off).
    #[arg(long, default_value = cordon_server::DEFAULT_ENVD_VERSION)]
    envd_version: String,
    /// What a create without network rules gets: `closed` (no network until an allowOut rule
    /// opens it) or `open` (E2B's semantics: the internet, denyOut as a blocklist; never the
    /// host, private ranges or metadata).
    #[arg(long, value_enum, default_value_t = NetworkDefaultArg::Closed)]
    network_default: NetworkDefaultArg,
    /// The sandboxes' domain: create and connect return it, and the SDKs then reach sandbox
    /// ports at https://<port>-<id>.DOMAIN (DNS: *.DOMAIN and DOMAIN to this server).
    #[arg(long, value_name = "DOMAIN")]
    domain: Option<String>,
    /// Serve TLS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key", conflicts_with = "tls_self_signed")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve TLS with a certificate for DOMAIN and *.DOMAIN issued at each start by a CA kept in
    /// <state>/tls/ (made once); clients trust <state>/tls/ca.pem. Needs --domain.
    #[arg(long, requires = "domain")]
    tls_self_signed: bool,
    /// Build or pull these images before serving (the server says it is listening only once
    /// they are in): a built-in recipe such as `code-interpreter-v1`, or a registry reference
    /// such as `127.0.0.1:5000/team/app:1.2` (stored under its default name). Without it, a
    /// recipe's image is built on its first create, which is answered 503 with Retry-After
    /// while the build runs.
    #[arg(long, value_name = "IMAGE", num_args = 1..)]
    prebuild: Vec<String>,
    /// The registry template builds pull a `fromImage` from when the store does not have it
    /// (`HOST[:PORT][/PREFIX]`, e.g. `127.0.0.1:5000/mirror`); a reference that names its own
    /// registry is pulled from there.
    #[arg(long, value_name = "URL")]
    registry: Option<String>,
    /// Open egress for the RUN steps of template builds (repeatable), as `cordon run
    /// --allow-net` (a package index, say); closed by default. API callers cannot open it.
    #[arg(long = "build-allow-net", value_name = "RULE")]
    build_allow_net: Vec<String>,
    /// Most disk the layers made from sandboxes may take (pauses to disk, snapshots, forks), e.g.
    /// 50G; a pause, snapshot or fork past it is refused (507). Default: no budget.
    #[arg(long, value_name = "SIZE")]
    state_budget: Option<String>,
    /// Paused sandboxes older than this are deleted (e.g. 30d, 12h).
    #[arg(long, value_name = "DURATION", default_value = "30d")]
    paused_ttl: String,
    /// Size cap of a volume created through the API (`POST /volumes` has no size field);
    /// images are sparse, so an empty volume takes a few MiB whatever its cap.
    #[arg(long, default_value = crate::volume_cmd::DEFAULT_SIZE)]
    volume_size: String,
    /// CA certificates (PEM) that the hosts of header injection rules (`network.rules`) are
    /// verified against, instead of this host's trust store.
    #[arg(long = "upstream-ca", value_name = "FILE")]
    upstream_ca: Option<std::path::PathBuf>,
    /// Keep N sandboxes of TEMPLATE (on TIER; ns when left out) started and idle, so that a
    /// create that matches is a hand-over (repeatable): e.g. --pool base=8 --pool
    /// code-interpreter-v1=2. The pools refill in the background.
    #[arg(long = "pool", value_name = "TEMPLATE[:TIER]=N")]
    pool: Vec<String>,
    /// Most memory the waiting pooled sandboxes may use together, e.g. 4G; a pool stops
    /// refilling at it. Default: a quarter of the host's memory.
    #[arg(long, value_name = "SIZE", requires = "pool")]
    pool_memory: Option<String>,
    /// Also serve GET /metrics (Prometheus) on this address, without the API key (bind it to a
    /// private address). /metrics on --listen always answers, with the key (X-API-KEY, or
    /// Authorization: Bearer KEY).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// Add per-sandbox CPU and memory series, labelled with each sandbox's id, to /metrics (one
    /// series per sandbox: opt-in for that reason).
    #[arg(long)]
    metrics_per_sandbox: bool,
    /// Log lines as human text, or as one JSON object per line (with the request's id and the
    /// sandbox's id on the lines about them).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// On SIGTERM or SIGINT: `keep` the sandboxes running for the next `cordon serve` on this
    /// state dir, which adopts them (ns tier; the others' are destroyed); `destroy` every
    /// sandbox at once (one paused in place stays paused, to its files); or `drain`: refuse new
    /// sandboxes, serve the live ones until they end or --drain-grace passes, then destroy what
    /// is left.
    #[arg(long, value_enum, env = "CORDON_SHUTDOWN", default_value_t = ShutdownArg::Keep)]
    shutdown: ShutdownArg,
    /// How long a draining shutdown waits for the live sandboxes to end (e.g. 10m).
    #[arg(long, value_name = "DURATION", default_value = "5m")]
    drain_grace: String,
    /// Join a cluster of cordon nodes coordinated by etcd (`etcd=http://HOST:2379[,...]`): every
    /// node then serves the whole API and routes each request to the node that owns its
    /// sandbox. Needs --node-name and --advertise; every node must have the same API key.
    #[arg(long, value_name = "etcd=URL[,URL...]", requires_all = ["node_name", "advertise"])]
    cluster: Option<String>,
    /// This node's name in the cluster (1 to 20 of a-z, 0-9): part of its sandboxes' ids.
    #[arg(long, value_name = "NAME", requires = "cluster")]
    node_name: Option<String>,
    /// Where the other nodes reach this one, as http://HOST:PORT.
    #[arg(long, value_name = "URL", requires = "cluster")]
    advertise: Option<String>,
    /// How long a node that stopped answering etcd stays a member (its lease's time to live):
    /// its sandboxes answer as missing after it.
    #[arg(long, value_name = "DURATION", default_value = "10s", requires = "cluster")]
    cluster_ttl: String,
    /// Settings file: every flag here under its long name (`listen = "0.0.0.0:3000"`,
    /// `pool = ["base=4"]`); flags given here override it. Default: /etc/cordon/cordon.toml,
    /// when it exists (`--config /dev/null` reads none).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum ShutdownArg {
    Keep,
    Destroy,
    Drain,
}

/// How `cordon serve` writes its log (`--log-format`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum NetworkDefaultArg {
    Closed,
    Open,
}

pub fn main(state: &State, a: ServeArgs) -> Result<u8> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(usage("cordon serve needs root (sandboxes need cgroups and idmapped mounts): run it as root"));
    }
    if a.max_sandboxes == 0 {
        return Err(usage("--max-sandboxes must be at least 1"));
    }
    let state_budget = a.state_budget.as_deref().map(cordon_spec::parse_size).transpose().map_err(|e| usage(format!("--state-budget: {}", e.reason)))?;
    let volume_size = cordon_spec::parse_size(&a.volume_size).map_err(|e| usage(format!("--volume-size: {}", e.reason)))?;
    let pools = pool_configs(&a.pool)?;
    let pool_memory = match a.pool_memory.as_deref() {
        Some(s) => cordon_spec::parse_size(s).map_err(|e| usage(format!("--pool-memory: {}", e.reason)))?,
        None => host_memory() / 4,
    };
    let drain_grace = cordon_spec::parse_duration(&a.drain_grace).map_err(|e| usage(format!("--drain-grace: {}", e.reason)))?;
    let shutdown_mode = match a.shutdown {
        ShutdownArg::Keep => cordon_server::ShutdownMode::Keep,
        ShutdownArg::Destroy => cordon_server::ShutdownMode::Destroy,
        ShutdownArg::Drain => cordon_server::ShutdownMode::Drain { grace: drain_grace },
    };
    let paused_ttl = cordon_spec::parse_duration(&a.paused_ttl).map_err(|e| usage(format!("--paused-ttl: {}", e.reason)))?;
    let cluster = match &a.cluster {
        Some(spec) => {
            let ttl = cordon_spec::parse_duration(&a.cluster_ttl).map_err(|e| usage(format!("--cluster-ttl: {}", e.reason)))?;
            let (node, advertise) = (a.node_name.as_deref().unwrap_or_default(), a.advertise.as_deref().unwrap_or_default());
            let config = cordon_cluster::ClusterConfig::parse(spec, node, advertise, ttl).map_err(|e| usage(e.to_string()))?;
            // Before anything is built, started or reaped: a node that cannot join stops here.
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(cordon_cluster::Cluster::preflight(&config)).map_err(|e| usage(format!("--cluster: {e}")))?;
            Some(config)
        }
        None => None,
    };
    if let Some(d) = &a.domain {
        if !cordon_server::tls::valid_domain(d) {
            return Err(usage(format!("--domain {d:?} is not a DNS name: give lowercase labels such as sandboxes.example.org")));
        }
    }
    let tls = match (&a.tls_cert, &a.tls_key, &a.domain) {
        (Some(cert), Some(key), _) => Some(cordon_server::tls::from_pem_files(cert, key).map_err(|e| usage(format!("--tls-cert/--tls-key: {e}")))?),
        (_, _, Some(domain)) if a.tls_self_signed => {
            state.ensure()?;
            let (acceptor, ca) = cordon_server::tls::self_signed(state.dir(), domain).context("--tls-self-signed")?;
            eprintln!(
                "cordon serve: TLS for {domain} and *.{domain}; clients must trust {0} (SSL_CERT_FILE={0}, NODE_EXTRA_CA_CERTS={0})",
                ca.display()
            );
            Some(acceptor)
        }
        (_, _, Some(domain)) => {
            eprintln!("cordon serve: --domain {domain} without TLS here: the SDKs use https://, so put a TLS proxy in front, or give --tls-cert/--tls-key or --tls-self-signed");
            None
        }
        _ => None,
    };
    let build_network = cordon_spec::NetworkPolicy::parse(&a.build_allow_net, &[] as &[&str]).map_err(|e| usage(format!("--build-allow-net: {}", e.reason)))?;
    let registry = a.registry.as_deref().map(|r| r.trim_start_matches("http://").trim_start_matches("https://").trim_end_matches('/').to_string());
    let store = state.images()?;
    for name in &a.prebuild {
        prebuild(&store, name)?;
    }
    let builds = cordon_server::first_build::FirstBuilds::default();
    // The default template: built in the background, so that the server answers at once and
    // the first create waits for it (or is told to retry) instead of finding no server.
    if matches!(cordon_sandbox::image::lookup(&store, "base"), Ok(cordon_sandbox::image::Lookup::Build)) {
        eprintln!("cordon serve: building the default image `base` in the background (about a minute, once; --prebuild base waits for it)");
        builds.begin(&store, "base");
    }
    if let Some(config) = &a.config {
        eprintln!("cordon serve: settings from {} (flags given override them)", config.display());
    }
    let api_key = match a.api_key.filter(|k| !k.is_empty()) {
        Some(k) => k,
        None => {
            let (key, created) = cordon_server::auth::load_or_create_api_key(state.dir())?;
            let path = cordon_server::auth::api_key_path(state.dir());
            if created {
                eprintln!("cordon serve: generated API key (stored in {}): {key}", path.display());
            } else {
                eprintln!("cordon serve: using the API key in {}", path.display());
            }
            key
        }
    };

    cordon_jail::become_subreaper();
    cordon_host::orphans::start();
    // Opening a tier reaps every sandbox of it a crashed cordon left behind: sandboxes are not
    // adopted, since their tokens and deadlines died with the old process.
    // The secret store's values live in this process from here on: never in a core dump.
    cordon_host::sys::forbid_core_dumps().context("make the server undumpable")?;
    let secrets = cordon_server::secrets::open(state.dir())?;
    let intercept = interception(state, a.upstream_ca.as_deref(), &secrets)?;
    let host = cordon_sandbox::Host { intercept: intercept.clone(), ..state.host(Some(a.envd_version.clone())) };
    let tiers = cordon_sandbox::Tiers::new(host, &crate::tiers::TABLE);
    tiers.backend(cordon_spec::Tier::Ns).map_err(|e| usage(e.to_string()))?;
    // The other tiers are opened now too where the host can run them, so that what a crashed
    // server left of them is reaped at start; the ones it cannot run are refused per create.
    let mut runnable = vec![cordon_spec::Tier::Ns.to_string()];
    for t in [cordon_spec::Tier::Gvisor, cordon_spec::Tier::Vm] {
        match tiers.backend(t) {
            Ok(_) => runnable.push(t.to_string()),
            Err(e) => tracing::info!(tier = %t, "tier not available: {e}"),
        }
    }
    for p in &pools {
        if let Err(e) = tiers.backend(p.tier) {
            return Err(usage(format!("--pool {}:{}={}: {e}", p.template, p.tier, p.size)));
        }
    }
    let backend = tiers;
    // Paused sandboxes and snapshots outlive the server: they are read back here.
    let volumes = Arc::new(cordon_server::volumes::VolumeApi::open(state.dir(), volume_size).context("open the volume store")?);
    let saved = cordon_server::saved::Saved::open(state.images()?, state.dir(), paused_ttl, state_budget, Some(volumes.clone())).context("open the paused sandboxes and snapshots")?;
    let sandboxes = cordon_server::Sandboxes::with_saved(backend, a.max_sandboxes, a.envd_version, Some(saved));
    // Sandboxes outlive the server whatever --shutdown says: a crash or `kill -9` must not
    // lose them either.
    sandboxes.keep_across_restarts(state.dir().join("live")).context("open the live sandboxes' records")?;
    if let Some(i) = &intercept {
        sandboxes.trust_egress_ca(i.ca().cert_pem().to_string());
    }
    let network_default = match a.network_default {
        NetworkDefaultArg::Closed => cordon_server::network::NetworkDefault::Closed,
        NetworkDefaultArg::Open => cordon_server::network::NetworkDefault::Open,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let domain = a.domain.clone();
    let builder = crate::template_build::TemplateBuilder { host: state.host(None), store: state.images()?, registry, network: build_network };
    let templates = cordon_server::templates::Templates::open(state.dir(), state.images()?, Arc::new(builder)).context("open the template records")?;
    for p in &pools {
        let image = templates.resolve(&p.template).unwrap_or_else(|| p.template.clone());
        if cordon_sandbox::image::lookup(&store, &image).is_err() {
            return Err(usage(format!(
                "--pool {}: no such template: give a recipe ({}), an image of `cordon image ls`, or a template built through the API",
                p.template,
                cordon_image::recipes().join(", ")
            )));
        }
    }
    let app = Arc::new(cordon_server::App { api_key, sandboxes, images: store, network_default, domain, tls, builds: Some(builds), templates: Some(Arc::new(templates)), volumes: Some(volumes), secrets: Some(secrets), cluster: Default::default() });

    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("listen on {}", a.listen))?;
        let addr = listener.local_addr()?;
        match &a.domain {
            Some(d) => eprintln!(
                "cordon serve: listening on {scheme}://{addr} for {d} (E2B_DOMAIN={d}, with DNS for {d} and *.{d} pointing here{})",
                if scheme == "https" && addr.port() == 443 { "" } else { "; the SDKs expect port 443" }
            ),
            None => eprintln!("cordon serve: listening on {scheme}://{addr} (E2B_API_URL={scheme}://{addr} E2B_SANDBOX_URL={scheme}://{addr})"),
        }
        tracing::info!(addr = %a.listen, max_sandboxes = a.max_sandboxes, network_default = %network_default, "serving");
        app.sandboxes.stats.set_per_sandbox(a.metrics_per_sandbox);
        let metrics = match a.metrics_listen {
            Some(at) => {
                let l = tokio::net::TcpListener::bind(at).await.with_context(|| format!("--metrics-listen {at}"))?;
                eprintln!("cordon serve: metrics on http://{}/metrics (no API key)", l.local_addr()?);
                Some(tokio::spawn(cordon_server::metrics_listener::serve(l, app.clone())))
            }
            None => None,
        };
        // Before the pools and the first request: the uid ranges and ids of the sandboxes the
        // last server left running are taken back first.
        let adopted = app.sandboxes.adopt_kept().await + app.sandboxes.resume_saved_at_start().await;
        if adopted > 0 {
            eprintln!("cordon serve: took over {adopted} running sandbox(es) from the last server");
        }
        if !pools.is_empty() {
            cordon_server::pool::Pools::start(&app, pools, pool_memory);
        }
        // Joined last: a node is placed on as soon as the others read its key.
        let member = match cluster {
            Some(config) => {
                let (node, etcd) = (config.node.clone(), config.etcd.join(","));
                app.sandboxes.set_node(&node);
                let weak = Arc::downgrade(&app);
                let joined = cordon_cluster::Cluster::join(config, move || weak.upgrade().map(|app| cordon_server::cluster::load(&app, &runnable)).unwrap_or_default())
                    .await
                    .map_err(|e| usage(format!("--cluster: {e}")))?;
                let _ = app.cluster.set(joined.clone());
                eprintln!("cordon serve: node {node} of the cluster in etcd at {etcd} ({} node(s) now)", joined.nodes().len());
                Some(joined)
            }
            None => None,
        };
        // The listener is bound (connections queue from here) and every --prebuild image is in.
        crate::sd_notify::notify(&format!("READY=1\nSTATUS=listening on {scheme}://{addr}"));
                let served = cordon_server::serve_until(listener, app, shutdown(shutdown_mode), shutdown_mode).await;
        if let Some(m) = metrics {
            m.abort();
        }
        if let Some(c) = member {
            c.leave().await;
        }
        served?;
        tracing::info!("stopped");
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(0)
}

/// The `--pool` flags, each once per template and tier.
fn pool_configs(flags: &[String]) -> Result<Vec<cordon_server::pool::PoolConfig>> {
    let mut pools: Vec<cordon_server::pool::PoolConfig> = Vec::new();
    for f in flags {
        let p: cordon_server::pool::PoolConfig = f.parse().map_err(|e: cordon_server::pool::PoolConfigError| usage(e.to_string()))?;
        if pools.iter().any(|q| q.template == p.template && q.tier == p.tier) {
            return Err(usage(format!("--pool {f}: {}:{} has a pool already: give each template and tier once", p.template, p.tier)));
        }
        pools.push(p);
    }
    Ok(pools)
}

/// The host's memory in bytes (MemTotal), or 4 GiB when it cannot be read.
fn host_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find_map(|l| l.strip_prefix("MemTotal:").and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())))
        .map_or(4 << 30, |kb| kb << 10)
}

/// `--prebuild NAME`: a recipe built (or found built), a registry reference pulled, or an
/// image already in the store.
fn prebuild(store: &cordon_image::Store, name: &str) -> Result<()> {
    if name.contains('/') {
        crate::image_cmd::pull(store, name, None, &cordon_image::Auth::DockerConfig).with_context(|| format!("--prebuild {name}"))?;
        return Ok(());
    }
    if cordon_image::recipes().contains(&name) {
        crate::image_cmd::build(store, name, &Default::default())?;
        return Ok(());
    }
    match store.get(name) {
        Ok(_) => Ok(()),
        Err(cordon_image::ImageError::NotFound { .. }) => Err(usage(format!(
            "--prebuild {name}: no such image, and not a recipe ({}): give a recipe, an image of `cordon image ls`, or a registry reference REGISTRY/REPOSITORY[:TAG]",
            cordon_image::recipes().join(", ")
        ))),
        Err(e) => Err(crate::image_cmd::image_error(e)),
    }
}

/// Resolves on the first SIGTERM or SIGINT.
async fn shutdown(mode: cordon_server::ShutdownMode) {
    let name = crate::stop_signal().await;
    match mode {
        cordon_server::ShutdownMode::Keep => {
            eprintln!("cordon serve: {name}: leaving the sandboxes running for the next server");
            crate::sd_notify::notify(&format!("STOPPING=1\nSTATUS={name}: leaving the sandboxes running"));
        }
        cordon_server::ShutdownMode::Destroy => {
            eprintln!("cordon serve: {name}: destroying every sandbox");
            crate::sd_notify::notify(&format!("STOPPING=1\nSTATUS={name}: destroying every sandbox"));
        }
        cordon_server::ShutdownMode::Drain { grace } => {
            eprintln!("cordon serve: {name}: draining: no new sandboxes; stopping once the live ones end, or in {}s", grace.as_secs());
            crate::sd_notify::notify(&format!("STOPPING=1\nSTATUS={name}: draining"));
        }
    }
}

/// TLS termination for header injection rules: the egress CA (made on first start) and the
/// secret store. A host without a usable trust store serves without injection (rules are then
/// refused with a 400) unless `--upstream-ca` was given, which must work.
fn interception(state: &State, upstream_ca: Option<&std::path::Path>, secrets: &Arc<cordon_secret::SecretStore>) -> Result<Option<Arc<cordon_sandbox::Interception>>> {
    let ca = Arc::new(cordon_sandbox::EgressCa::open(state.dir()).context("open the egress CA")?);
    let source = Arc::new(cordon_server::secrets::Source(secrets.clone()));
    match cordon_sandbox::Interception::new(ca, upstream_ca, source) {
        Ok(i) => Ok(Some(Arc::new(i))),
        Err(e) if upstream_ca.is_some() => Err(usage(format!("--upstream-ca: {e}"))),
        Err(e) => {
            tracing::warn!("header injection is off: {e}");
            Ok(None)
        }
    }
}
