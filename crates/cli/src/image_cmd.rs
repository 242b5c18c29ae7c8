//! `cordon image ...`

use crate::progress::Bar;
use crate::state::State;
use anyhow::Result;
use clap::Subcommand;
use cordon_image::{BuildOptions, ImageError, Store};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum ImageCmd {
    /// Build an image: from a built-in recipe (e.g. `base`; cached unless --rebuild), or with
    /// `-f` from a Dockerfile, each RUN in a sandbox, each step a cached layer.
    Build {
        name: String,
        /// Build again even if the image exists (recipes).
        #[arg(long)]
        rebuild: bool,
        /// Debian mirror to build from (default: CORDON_DEBIAN_MIRROR or Debian's).
        #[arg(long)]
        mirror: Option<String>,
        /// The Dockerfile to build.
        #[arg(long = "file", short = 'f')]
        file: Option<PathBuf>,
        /// The build context COPY reads from (default: the Dockerfile's directory).
        #[arg(long, requires = "file")]
        context: Option<PathBuf>,
        /// A build argument (repeatable).
        #[arg(long = "build-arg", value_name = "KEY=VALUE", requires = "file")]
        build_arg: Vec<String>,
        /// Open egress for RUN steps (repeatable), as `cordon run --allow-net` (e.g. a package
        /// index); closed by default.
        #[arg(long = "allow-net", value_name = "RULE", requires = "file")]
        allow_net: Vec<String>,
        /// Run every step again instead of taking it from the step cache.
        #[arg(long, requires = "file")]
        no_cache: bool,
    },
    /// Import an image: an OCI image layout (directory or tar), a `docker save` archive, or a
    /// rootfs tarball (e.g. from `docker export`).
    Import {
        name: String,
        path: PathBuf,
        /// Which image of an archive or layout that holds several (its tag or ref name).
        #[arg(long)]
        tag: Option<String>,
    },
    /// Pull an image from a registry (OCI distribution protocol); registries on loopback are
    /// spoken to over plain HTTP.
    Pull {
        /// REGISTRY/REPOSITORY[:TAG|@DIGEST], e.g. `127.0.0.1:5000/team/app:1.2`.
        reference: String,
        /// Store it under this name (default: the repository's last part, `-TAG` added for a
        /// tag other than latest).
        #[arg(long)]
        name: Option<String>,
        /// USER:PASSWORD for the registry (default: the Docker config's entry for it, else
        /// anonymous).
        #[arg(long, value_name = "USER:PASSWORD", env = "CORDON_REGISTRY_AUTH", hide_env_values = true)]
        registry_auth: Option<String>,
    },
    /// Remove the layers no image uses any more.
    Prune,
    /// List images.
    #[command(alias = "list")]
    Ls {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Remove an image.
    Rm { name: String },
}

/// Image errors that are the caller's to fix are usage errors (exit 2).
pub fn image_error(e: ImageError) -> anyhow::Error {
    match e {
        ImageError::NotFound { .. }
        | ImageError::InvalidName { .. }
        | ImageError::UnknownRecipe { .. }
        | ImageError::Import { .. }
        | ImageError::Pull { .. }
        | ImageError::InUse { .. } => {
            crate::usage(e.to_string())
        }
        e => e.into(),
    }
}

pub fn main(state: &State, cmd: ImageCmd) -> Result<()> {
    let store = state.images()?;
    match cmd {
        ImageCmd::Build { name, file: Some(file), context, build_arg, allow_net, no_cache, .. } => {
            crate::dockerfile::main(state, &store, name, file, context, build_arg, allow_net, no_cache)?;
        }
        ImageCmd::Build { name, rebuild, mirror, file: None, .. } => {
            build(&store, &name, &BuildOptions { rebuild, mirror })?;
        }
        ImageCmd::Import { name, path, tag } => {
            if !path.exists() {
                return Err(crate::usage(format!("{} does not exist: give the path of an OCI layout, a docker save archive or a rootfs tarball", path.display())));
            }
            let mut bar = Bar::new(&format!("importing {name}"));
            match store.import(&name, &path, tag.as_deref(), &mut bar) {
                Ok(img) => bar.finish(&format!("imported ({}, {} layers)", cordon_spec::format_size(img.meta.size_bytes), img.layers.len())),
                Err(e) => {
                    bar.abandon();
                    return Err(image_error(e));
                }
            }
        }
        ImageCmd::Pull { reference, name, registry_auth } => {
            let auth = match registry_auth {
                None => cordon_image::Auth::DockerConfig,
                Some(s) => match s.split_once(':') {
                    Some((u, p)) if !u.is_empty() => cordon_image::Auth::Basic(u.into(), p.into()),
                    _ => return Err(crate::usage("--registry-auth: use USER:PASSWORD")),
                },
            };
            pull(&store, &reference, name.as_deref(), &auth)?;
        }
        ImageCmd::Prune => {
            let p = store.prune().map_err(image_error)?;
            eprintln!("removed {} unused layers ({})", p.layers, cordon_spec::format_size(p.bytes));
        }
        ImageCmd::Ls { json } => {
            let images = store.usage()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&images)?);
            } else {
                println!("{:<24} {:>10} {:>10} {:>6}  {:<12} SOURCE", "NAME", "SIZE", "SHARED", "LAYERS", "USER");
                for i in images {
                    println!(
                        "{:<24} {:>10} {:>10} {:>6}  {:<12} {}",
                        i.name,
                        cordon_spec::format_size(i.size_bytes),
                        cordon_spec::format_size(i.shared_bytes),
                        i.layers.len().max(1),
                        i.default_user,
                        i.source
                    );
                }
            }
        }
        ImageCmd::Rm { name } => {
            store.remove(&name).map_err(image_error)?;
            eprintln!("removed image {name}");
        }
    }
    Ok(())
}

/// Pulls `reference` with a bar per layer.
pub fn pull(store: &Store, reference: &str, name: Option<&str>, auth: &cordon_image::Auth) -> Result<cordon_image::Image> {
    let mut bars = crate::progress::Items::new(&format!("pulling {reference}"));
    let started = std::time::Instant::now();
    match store.pull(reference, name, auth, &mut bars) {
        Ok(img) => {
            bars.finish(&format!(
                "image {} ({}, {} layers) in {:.1}s",
                img.name,
                cordon_spec::format_size(img.meta.size_bytes),
                img.layers.len(),
                started.elapsed().as_secs_f64()
            ));
            Ok(img)
        }
        Err(e) => {
            bars.abandon();
            Err(image_error(e))
        }
    }
}

/// Builds a recipe with a progress bar; returns quickly when the image is cached.
pub fn build(store: &Store, name: &str, opts: &BuildOptions) -> Result<cordon_image::Image> {
    if !opts.rebuild {
        match store.get(name) {
            Ok(img) if !store.is_stale(&img) => {
                eprintln!("image {name} is already built (cordon image build --rebuild {name} to build it again)");
                return Ok(img);
            }
            _ => {}
        }
    }
    let mut bar = Bar::new(&format!("building image {name}"));
    let started = std::time::Instant::now();
    match store.build(name, opts, &mut bar) {
        Ok(img) => {
            bar.finish(&format!(
                "built in {:.0}s ({})",
                started.elapsed().as_secs_f64(),
                cordon_spec::format_size(img.meta.size_bytes)
            ));
            Ok(img)
        }
        Err(e) => {
            bar.abandon();
            Err(image_error(e))
        }
    }
}

/// The image `spec` names, built now (with a bar) if it is a recipe not built yet, then
/// whatever the tier makes for its first sandbox of it (a VM's kit and disk), with a bar only
/// when something has to be made. `announce` names the command for a line before a build.
pub fn ensure(state: &State, backend: &dyn cordon_sandbox::Backend, spec: &cordon_spec::SandboxSpec, announce: Option<&str>) -> Result<()> {
    let store = state.images()?;
    let image = match cordon_sandbox::image::lookup(&store, &spec.image).map_err(image_error)? {
        cordon_sandbox::image::Lookup::Ready(img) => *img,
        cordon_sandbox::image::Lookup::Build => {
            if let Some(who) = announce {
                eprintln!("cordon {who}: building the image `{}` first (about a minute, once)", spec.image);
            }
            build(&store, &spec.image, &Default::default())?
        }
    };
    let mut progress = crate::progress::Lazy::new("vm");
    let r = backend.prepare(spec, &image, &mut progress);
    match (&r, progress.bar()) {
        (Ok(Some(summary)), Some(bar)) => bar.finish(summary),
        (Err(_), Some(bar)) => bar.abandon(),
        _ => {}
    }
    r.map_err(|e| match e {
        cordon_sandbox::Error::Unavailable(m) | cordon_sandbox::Error::BadRequest(m) => crate::usage(m),
        e => e.into(),
    })?;
    Ok(())
}
