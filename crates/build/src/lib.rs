//! Image builds without Docker: a Dockerfile (`cordon image build NAME -f Dockerfile`) or an E2B
//! template's steps, run by one [`executor`], ending in the layered image store.
//!
//! - [`dockerfile`] parses a Dockerfile into stages and instructions, each with its line;
//! - [`dockerfile_build`] drives a parsed Dockerfile through the executor;
//! - [`executor`] runs each step: RUN in an ns-tier sandbox whose writable layer becomes the
//!   step's layer, COPY and WORKDIR as layers written directly, the rest as config;
//! - [`template`] drives an E2B template's steps (`Template()` of the SDKs) through it;
//! - [`copy`] writes COPY's layer, [`merged`] is the read-only view of an image being built that
//!   it resolves paths in, and [`cache`] is the step cache that makes an unchanged rebuild
//!   take seconds.

pub mod cache;
pub mod copy;
pub mod dockerfile;
pub mod dockerfile_build;
pub mod executor;
pub mod merged;
pub mod template;

pub use executor::{Executor, Options, Stage, StepFailure};

/// Everything a build can fail with; each message is one line that says what and where.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{0}")]
    Parse(#[from] dockerfile::ParseError),
    /// A step failed: `at` names it (`Dockerfile line 7 (RUN make)`).
    #[error("{at}: {message}")]
    Step { at: String, message: String, tail: Vec<String> },
    /// The request itself is wrong (a missing context, a FROM that names nothing).
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Image(#[from] cordon_image::ImageError),
    #[error("{0}")]
    Sandbox(cordon_sandbox::Error),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}
