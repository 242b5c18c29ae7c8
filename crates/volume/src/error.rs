use std::path::PathBuf;

/// What the volume store can refuse or fail at; each message says what to change.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("invalid volume name '{0}': use letters, digits, '_' and '-' (at most 128)")]
    InvalidName(String),
    #[error("invalid volume ID '{0}': volume IDs are UUIDs")]
    InvalidId(String),
    #[error("invalid volume size {0} bytes: use 16M to 16T")]
    InvalidSize(u64),
    #[error("volume with name '{0}' already exists")]
    NameTaken(String),
    #[error("volume '{0}' not found")]
    NotFound(String),
    #[error("volume '{0}' not found: create it first (cordon volume create {0})")]
    NameNotFound(String),
    #[error("volume '{0}' is in use by a sandbox (running or paused) or a request: kill the sandbox first")]
    InUse(String),
    #[error("a volume of {size} bytes does not fit in the {free} bytes free on the host's disk: choose a smaller size")]
    NoRoom { size: u64, free: u64 },
    #[error("cannot make volume '{name}': {detail}")]
    Mkfs { name: String, detail: String },
    #[error("volume '{name}' is damaged: {detail}")]
    Damaged { name: String, detail: String },
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
