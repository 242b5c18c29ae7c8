//! The one "ensure the image" step every front end and tier takes: a built-in recipe that is
//! not built yet (or was built from an older recipe) is built now; anything else unknown is
//! refused with the list of known templates.

use cordon_image::{Image, ImageError, Progress, Store};

use crate::Error;

/// What the store holds for a template name.
pub enum Lookup {
    /// Built and current.
    Ready(Box<Image>),
    /// A built-in recipe that has to be built (first use, or an older recipe).
    Build,
}

/// What `name` is in `store`, without building anything: the one decision of when an image is
/// built on first use. Errors are the store's own (front ends word them for their users).
pub fn lookup(store: &Store, name: &str) -> Result<Lookup, ImageError> {
    match store.get(name) {
        Ok(img) if !store.is_stale(&img) => Ok(Lookup::Ready(Box::new(img))),
        Ok(_) | Err(ImageError::NotFound { .. }) if cordon_image::recipes().contains(&name) => Ok(Lookup::Build),
        // Only a recipe's image can be stale.
        Ok(img) => Ok(Lookup::Ready(Box::new(img))),
        Err(e) => Err(e),
    }
}

/// Whether a sandbox can be created from template `name`: built in the store, or a built-in
/// recipe built on first use. What `Template.exists` asks.
pub fn exists(store: &Store, name: &str) -> Result<bool, ImageError> {
    if cordon_image::validate_name(name).is_err() {
        return Ok(false);
    }
    match lookup(store, name) {
        Ok(_) => Ok(true),
        Err(ImageError::NotFound { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// [`lookup`]'s error as the API words it: a template that is not there lists the known ones.
fn template_error(store: &Store, template: &str, e: ImageError) -> Error {
    match e {
        ImageError::NotFound { .. } => {
            let known: Vec<String> = store.list().unwrap_or_default().into_iter().map(|i| i.name).collect();
            Error::UnknownTemplate(format!(
                "template '{}' not found; available templates: {} (build one with `cordon image build` or `cordon image import`)",
                template,
                if known.is_empty() { "none".to_string() } else { known.join(", ") }
            ))
        }
        e => Error::UnknownTemplate(format!("template '{template}': {e}")),
    }
}

/// The image `template` names, building a recipe's image first if it needs it (minutes, once;
/// a build that outlives the request that asked still finishes).
pub fn ensure(store: &Store, template: &str, progress: &mut dyn Progress) -> Result<Image, Error> {
    match lookup(store, template).map_err(|e| template_error(store, template, e))? {
        Lookup::Ready(img) => Ok(*img),
        Lookup::Build => {
            tracing::info!(image = template, "template not built yet, or built from an older recipe: building it");
            let started = std::time::Instant::now();
            let img = store
                .build(template, &Default::default(), progress)
                .map_err(|e| Error::failed(format!("building the image of template '{template}'"), e))?;
            tracing::info!(image = template, secs = started.elapsed().as_secs(), size = img.meta.size_bytes, "image built");
            Ok(img)
        }
    }
}

/// Build progress into the log, for images built on first use by a server.
pub struct LogProgress<'a>(pub &'a str);

impl Progress for LogProgress<'_> {
    fn stage(&mut self, index: usize, total: usize, name: &str) {
        tracing::info!(image = self.0, "building: step {}/{total}: {name}", index + 1);
    }

    fn line(&mut self, text: &str) {
        tracing::debug!(image = self.0, "build: {text}");
    }
}
