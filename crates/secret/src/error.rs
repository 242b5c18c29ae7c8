use std::path::PathBuf;

/// What the secret store can refuse or fail at; each message says what is wrong and what to
/// change. No variant carries a secret's value: values never reach an error, a log line or a
/// client's answer.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("invalid secret name '{0}': use 1 to 128 letters, digits, '_' and '-'")]
    InvalidName(String),
    #[error("invalid secret name '{0}': the prefix 'sec_' is reserved for secret IDs, choose a name without it")]
    ReservedName(String),
    #[error("secret value is {len} bytes: store at most {max} bytes")]
    ValueTooLarge { len: usize, max: usize },
    #[error("secret metadata has {count} entries: use at most {max}")]
    MetadataEntries { count: usize, max: usize },
    #[error("secret metadata key of {len} bytes: use keys of at most {max} bytes")]
    MetadataKey { len: usize, max: usize },
    #[error("secret metadata value of key '{key}' is {len} bytes: use values of at most {max} bytes")]
    MetadataValue { key: String, len: usize, max: usize },
    #[error("secret metadata is {total} bytes in all (keys and values): use at most {max}")]
    MetadataTotal { total: usize, max: usize },
    #[error("page limit {limit} is out of range: use 1 to {max}")]
    InvalidLimit { limit: usize, max: usize },
    #[error("invalid page token: pass the x-next-token of the previous page unchanged")]
    InvalidToken,
    #[error("secret with name '{0}' already exists: update it, or delete it first")]
    NameTaken(String),
    #[error("the store already holds {max} secrets, its limit: delete one first")]
    LimitReached { max: usize },
    #[error("secret '{0}' not found")]
    NotFound(String),
    #[error("secret store {} is owned by uid {uid}, not by this process (uid {euid}): remove it or chown it to uid {euid}", path.display())]
    ForeignOwner { path: PathBuf, uid: u32, euid: u32 },
    #[error("secret store {} is not a directory: move it away", path.display())]
    NotADirectory { path: PathBuf },
    #[error("cannot draw a random secret ID: {0}")]
    Random(getrandom::Error),
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
