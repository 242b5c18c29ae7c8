//! `cordon serve`: the E2B-compatible API and data plane on one port (see `cordon_server`).

use crate::state::State;
use crate::usage;
use anyhow::{Context, Result};
use clap::Args;
use std::net::SocketAddr;
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
}

pub fn main(state: &State, a: ServeArgs) -> Result<u8> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(usage("cordon serve needs root (sandboxes need cgroups and idmapped mounts): run it as root"));
    }
    if a.max_sandboxes == 0 {
        return Err(usage("--max-sandboxes must be at least 1"));
    }
    let store = state.images()?;
    if store.get("base").map_or(true, |img| store.is_stale(&img)) && cordon_image::recipes().contains(&"base") {
        eprintln!("cordon serve: building the default image `base` first (about a minute, once)");
        crate::image_cmd::build(&store, "base", &Default::default())?;
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
    // Opening a tier reaps every sandbox of it a crashed cordon left behind: sandboxes are not
    // adopted, since their tokens and deadlines died with the old process.
    let tiers = cordon_sandbox::Tiers::new(state.host(Some(a.envd_version.clone())), &crate::tiers::TABLE);
    tiers.backend(cordon_spec::Tier::Ns).map_err(|e| usage(e.to_string()))?;
    // The other tiers are opened now too where the host can run them, so that what a crashed
    // server left of them is reaped at start; the ones it cannot run are refused per create.
    for t in [cordon_spec::Tier::Gvisor] {
        if let Err(e) = tiers.backend(t) {
            tracing::info!(tier = %t, "tier not available: {e}");
        }
    }
    let backend = tiers;
    let sandboxes = cordon_server::Sandboxes::new(backend, a.max_sandboxes, a.envd_version);
    let app = Arc::new(cordon_server::App { api_key, sandboxes, images: state.images()? });

    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("listen on {}", a.listen))?;
        eprintln!(
            "cordon serve: listening on http://{0} (E2B_API_URL=http://{0} E2B_SANDBOX_URL=http://{0})",
            listener.local_addr()?
        );
        tracing::info!(addr = %a.listen, max_sandboxes = a.max_sandboxes, "serving");
        cordon_server::serve(listener, app, shutdown()).await?;
        tracing::info!("stopped");
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(0)
}

/// Resolves on the first SIGTERM or SIGINT.
async fn shutdown() {
    let name = crate::stop_signal().await;
    eprintln!("cordon serve: {name}: destroying every sandbox");
}
