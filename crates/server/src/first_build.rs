//! Templates built on first use, without holding a create past what the SDKs wait.
//!
//! A built-in recipe's image (`base`, `code-interpreter-v1`) is built the first time a sandbox
//! asks for it: a minute or two. The SDKs give a request 60 s in all, retries included, and retry
//! a 503 by themselves after its `Retry-After`. So a create of a template that must be built
//! starts the build in the background (or joins the one running), waits a few seconds in case
//! it is about to end, and otherwise answers 503 with `Retry-After` and a message that says what
//! is being built and how far it is. A build that takes less than the SDK's window is invisible
//! to the caller; a longer one is a clear "retry" rather than a read timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cordon_image::{Progress, Store};
use cordon_sandbox::image::{lookup, Lookup};
use hyper::StatusCode;

use crate::error::ApiError;

/// How long one create waits for a build in progress before it answers 503.
const HOLD: Duration = Duration::from_secs(5);
/// The `Retry-After` of that 503. With [`HOLD`], the Python SDK's four attempts (three retries)
/// fall at 0, 17, 34 and 51 s and each waits 5 s: builds of up to about 56 s end inside its
/// 60 s window.
pub const RETRY_AFTER_SECS: u32 = 12;

/// The builds a server runs on behalf of creates, by template name.
#[derive(Default)]
pub struct FirstBuilds {
    running: Mutex<HashMap<String, Arc<Build>>>,
}

struct Build {
    started: Instant,
    state: Mutex<State>,
}

#[derive(Clone)]
enum State {
    /// Step `index` of `total`, called `stage`.
    Running { index: usize, total: usize, stage: String },
    Done,
    Failed(String),
}

impl FirstBuilds {
    /// Returns once `template` can be made into a sandbox without a build (or is not a
    /// recipe at all: the create then says what is wrong); a 503 with `Retry-After` while its
    /// build runs; the build's error, once, when it failed (the next create tries again).
    pub async fn ready(&self, store: &Store, template: &str) -> Result<(), ApiError> {
        let deadline = Instant::now() + HOLD;
        // Built, or not a recipe (for the create to refuse in its own words): nothing to wait for.
        while matches!(lookup(store, template), Ok(Lookup::Build)) {
            let build = self.start(store, template);
            loop {
                let state = build.state.lock().unwrap_or_else(|e| e.into_inner()).clone();
                match state {
                    // The store has it now, unless it went again since (the lookup says).
                    State::Done => {
                        self.forget(template, &build);
                        break;
                    }
                    State::Failed(e) => {
                        self.forget(template, &build);
                        return Err(ApiError::internal(format!(
                            "building the image of template '{template}' failed: {e}; the next create of it tries again"
                        )));
                    }
                    State::Running { .. } if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
                    State::Running { index, total, stage } => {
                        let step = if total > 0 { format!("step {}/{total}: {stage}", index + 1) } else { "starting".to_string() };
                        return Err(ApiError {
                            retry_after: Some(RETRY_AFTER_SECS),
                            ..ApiError::new(
                                StatusCode::SERVICE_UNAVAILABLE,
                                format!(
                                    "template '{template}' is being built on its first use ({step}, {} s so far; a minute or two in all); \
                                     retry in {RETRY_AFTER_SECS} s (the SDKs retry by themselves), or start the server with \
                                     --prebuild {template} to build it before the first create",
                                    build.started.elapsed().as_secs()
                                ),
                            )
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Starts building `template` in the background (at server start, so that the first create
    /// finds it under way); a no-op when one is running.
    pub fn begin(&self, store: &Store, template: &str) {
        self.start(store, template);
    }

    fn start(&self, store: &Store, template: &str) -> Arc<Build> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = running.get(template) {
            return b.clone();
        }
        let build = Arc::new(Build {
            started: Instant::now(),
            state: Mutex::new(State::Running { index: 0, total: 0, stage: String::new() }),
        });
        running.insert(template.to_string(), build.clone());
        let (store, name, b) = (store.clone(), template.to_string(), build.clone());
        tracing::info!(image = %name, "template not built yet, or built from an older recipe: building it in the background");
        let spawned = std::thread::Builder::new().name(format!("build-{name}")).spawn(move || {
            let mut progress = Track { image: &name, build: &b };
            let outcome = match store.build(&name, &Default::default(), &mut progress) {
                Ok(img) => {
                    tracing::info!(image = %name, secs = b.started.elapsed().as_secs(), size = img.meta.size_bytes, "image built");
                    State::Done
                }
                Err(e) => {
                    tracing::warn!(image = %name, "building the image failed: {e}");
                    State::Failed(e.to_string())
                }
            };
            *b.state.lock().unwrap_or_else(|e| e.into_inner()) = outcome;
        });
        if let Err(e) = spawned {
            *build.state.lock().unwrap_or_else(|e| e.into_inner()) = State::Failed(format!("cannot start the build: {e}"));
        }
        build
    }

    fn forget(&self, template: &str, build: &Arc<Build>) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if running.get(template).is_some_and(|b| Arc::ptr_eq(b, build)) {
            running.remove(template);
        }
    }
}

/// A build's progress: into its state, for the 503's message, and into the log.
struct Track<'a> {
    image: &'a str,
    build: &'a Build,
}

impl Progress for Track<'_> {
    fn stage(&mut self, index: usize, total: usize, name: &str) {
        tracing::info!(image = self.image, "building: step {}/{total}: {name}", index + 1);
        *self.build.state.lock().unwrap_or_else(|e| e.into_inner()) = State::Running { index, total, stage: name.to_string() };
    }

    fn line(&mut self, text: &str) {
        tracing::debug!(image = self.image, "build: {text}");
    }
}
