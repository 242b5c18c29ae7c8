//! `cordon serve`'s template builds: the API's [`BuildJob`]s run by the Dockerfile path's
//! executor (`cordon_build`), with the operator's choices: the registry a `fromImage` the store
//! does not have is pulled from (`--registry`), and the network of RUN steps
//! (`--build-allow-net`), never an API caller's.

use cordon_build::{template, Executor, Options};
use cordon_image::Store;
use cordon_server::templates::{BuildFailure, BuildJob, Builder};
use cordon_spec::NetworkPolicy;

pub struct TemplateBuilder {
    pub host: cordon_sandbox::Host,
    pub store: Store,
    /// `--registry`: `HOST[:PORT][/PREFIX]` that image names are pulled from.
    pub registry: Option<String>,
    pub network: NetworkPolicy,
}

/// The SDKs' default base image (`Template()` with no `from_*`), which is cordon's `base`.
const SDK_DEFAULT_BASE: &str = "e2bdev/base";

fn base(message: impl Into<String>) -> BuildFailure {
    BuildFailure { step: "base".into(), message: message.into() }
}

impl TemplateBuilder {
    /// The store image a build starts from, pulled or built first if need be.
    fn from(&self, job: &BuildJob, log: &mut dyn FnMut(Option<&str>, &str)) -> Result<String, BuildFailure> {
        if let Some(img) = &job.from_template_image {
            return match self.store.get(img) {
                Ok(_) => Ok(img.clone()),
                Err(_) if cordon_image::recipes().contains(&img.as_str()) => self.recipe(img, log),
                Err(_) => Err(base(format!("template '{img}' not found: build it first, or start from an image"))),
            };
        }
        let image = job.from_image.as_deref().unwrap_or(SDK_DEFAULT_BASE);
        let bare = image.strip_suffix(":latest").unwrap_or(image);
        if bare == SDK_DEFAULT_BASE || bare == "base" {
            return self.recipe("base", log);
        }
        if cordon_image::validate_name(bare).is_ok() {
            if self.store.get(bare).is_ok() {
                return Ok(bare.to_string());
            }
            if cordon_image::recipes().contains(&bare) {
                return self.recipe(bare, log);
            }
        }
        // A reference that names its registry (`127.0.0.1:5000/app:1`) is pulled from there;
        // any other from the operator's registry.
        let first = image.split('/').next().unwrap_or("");
        let reference = if image.contains('/') && (first.contains('.') || first.contains(':') || first == "localhost") {
            image.to_string()
        } else {
            match &self.registry {
                Some(r) => format!("{}/{image}", r.trim_end_matches('/')),
                None => return Err(base(format!("image '{image}' is not in the store and no registry is configured: start cordon serve with --registry URL, or pull it with cordon image pull"))),
            }
        };
        log(Some("base"), &format!("pulling {reference}"));
        let auth = match &job.registry_auth {
            Some((u, p)) => cordon_image::Auth::Basic(u.clone(), p.clone()),
            None => cordon_image::Auth::DockerConfig,
        };
        let img = self.store.pull(&reference, None, &auth, &mut cordon_image::NoProgress).map_err(|e| base(e.to_string()))?;
        Ok(img.name)
    }

    fn recipe(&self, name: &str, log: &mut dyn FnMut(Option<&str>, &str)) -> Result<String, BuildFailure> {
        if self.store.get(name).is_err() {
            log(Some("base"), &format!("building image '{name}' from its recipe (once)"));
            self.store.build(name, &Default::default(), &mut cordon_sandbox::image::LogProgress(name)).map_err(|e| base(e.to_string()))?;
        }
        Ok(name.to_string())
    }
}

impl Builder for TemplateBuilder {
    fn build(&self, job: &BuildJob, log: &mut dyn FnMut(Option<&str>, &str)) -> Result<(), BuildFailure> {
        let from = self.from(job, log)?;
        let mut opts = Options { network: self.network.clone(), ..Options::default() };
        if let Some(c) = job.cpu_count {
            opts.limits.cpus = f64::from(c);
        }
        if let Some(m) = job.memory_mb {
            opts.limits.memory_bytes = m << 20;
        }
        let mut exec = Executor::open(&self.host, opts).map_err(|e| base(e.to_string()))?;
        let t = template::Template {
            from,
            steps: job.steps.clone(),
            start_cmd: job.start_cmd.clone(),
            ready_cmd: job.ready_cmd.clone(),
            force: job.force,
        };
        template::build(&mut exec, &t, &job.files, &job.image, log).map(drop).map_err(|f| BuildFailure { step: f.step, message: f.message })
    }
}
