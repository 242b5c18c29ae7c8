//! The one error of the sandbox seam. Front ends map the variants to what their users see (an
//! HTTP status, an exit code, an MCP tool error); the message is always one line that says what
//! is wrong and what to do.

/// A source error of any crate below the seam.
pub type Source = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The template names no image in the store (the message lists the known ones).
    #[error("{0}")]
    UnknownTemplate(String),
    /// The request is out of range or asks for what the tier cannot do.
    #[error("{0}")]
    BadRequest(String),
    /// The host cannot run the requested tier (a missing tool or kernel feature); never a
    /// fallback to another tier.
    #[error("{0}")]
    Unavailable(String),
    /// The sandbox was made without network access, so there is no policy to change.
    #[error("this sandbox was created without network access; create it with a policy to change one")]
    NoNetwork,
    /// The host failed while doing `what`.
    #[error("{what}: {source}")]
    Failed {
        what: String,
        #[source]
        source: Source,
    },
}

impl From<cordon_spec::SpecError> for Error {
    fn from(e: cordon_spec::SpecError) -> Error {
        Error::BadRequest(format!("{}: {}", e.field, e.reason))
    }
}

impl Error {
    /// A host failure while doing `what`.
    pub fn failed(what: impl Into<String>, source: impl Into<Source>) -> Error {
        Error::Failed { what: what.into(), source: source.into() }
    }
}
