//! `cordon image build NAME -f Dockerfile`: the build's log line by line on stderr, as
//! `docker build --progress=plain` prints it.

use crate::state::State;
use crate::usage;
use anyhow::Result;
use cordon_build::{dockerfile_build, BuildError, Executor, Options};
use cordon_image::Store;
use std::path::PathBuf;

#[allow(clippy::too_many_arguments)]
pub fn main(state: &State, store: &Store, name: String, file: PathBuf, context: Option<PathBuf>, build_args: Vec<String>, allow_net: Vec<String>, no_cache: bool) -> Result<()> {
    crate::preflight::require_root("building from a Dockerfile needs root (each RUN runs in a sandbox): run cordon as root")?;
    if !file.is_file() {
        return Err(usage(format!("{} is not a file: give the Dockerfile with -f", file.display())));
    }
    let context = context.unwrap_or_else(|| file.parent().filter(|p| !p.as_os_str().is_empty()).map_or_else(|| PathBuf::from("."), PathBuf::from));
    let build_args = build_args
        .iter()
        .map(|a| a.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| usage(format!("--build-arg {a}: use KEY=VALUE"))))
        .collect::<Result<Vec<_>>>()?;
    let network = cordon_spec::NetworkPolicy::parse(&allow_net, &[] as &[&str]).map_err(|e| usage(format!("--allow-net: {}", e.reason)))?;
    cordon_jail::become_subreaper();
    state.ensure()?;
    let opts = Options { network, no_cache, ..Options::default() };
    let mut exec = Executor::open(&state.host(None), opts).map_err(build_error)?;
    let req = dockerfile_build::Request { name: name.clone(), dockerfile: file, context, build_args };
    let started = std::time::Instant::now();
    let mut pull = |reference: &str, log: &mut dyn FnMut(&str)| -> Result<String, BuildError> {
        log(&format!("pulling {reference}"));
        let img = store.pull(reference, None, &cordon_image::Auth::DockerConfig, &mut cordon_image::NoProgress)?;
        Ok(img.name)
    };
    let mut log = |l: &str| eprintln!("{l}");
    match dockerfile_build::build(&mut exec, &req, &mut pull, &mut log) {
        Ok(img) => {
            eprintln!("built image {name} ({}, {} layers) in {:.1}s", cordon_spec::format_size(img.meta.size_bytes), img.layers.len(), started.elapsed().as_secs_f64());
            Ok(())
        }
        Err(e) => Err(build_error(e)),
    }
}

/// What the Dockerfile's author has to fix is a usage error (exit 2); the host's failures are not.
fn build_error(e: BuildError) -> anyhow::Error {
    match e {
        BuildError::Parse(_) | BuildError::Step { .. } | BuildError::Invalid(_) => usage(e.to_string()),
        BuildError::Image(e) => crate::image_cmd::image_error(e),
        e => e.into(),
    }
}
