//! Secrets: named values a sandbox may use without ever holding them, kept by the server.
//!
//! The E2B API (`/secrets`) writes a value and reads back only its description
//! ([`SecretInfo`]: ID, name, version, metadata, times); the value itself leaves the store only
//! through [`SecretStore::value`], which the egress forwarder asks when it substitutes a
//! secret into a request on its way out of a sandbox.
//!
//! - Names are `[a-zA-Z0-9_-]{1,128}`, case-insensitive (kept lowercased), and never start
//!   with `sec_`, the prefix of IDs, so that an argument may be either.
//! - On disk: `<state>/secrets/<id>.json`, the directory 0700 and every file 0600, owned by the
//!   server's user, each write atomic (see [`store`]).
//! - No value is in any error, log line or `Debug` output: the types that hold one print it
//!   redacted.

mod error;
pub mod store;

pub use error::SecretError;
pub use store::{canonical_name, valid_id, Metadata, SecretInfo, SecretPage, SecretStore, ID_PREFIX, MAX_PAGE, MAX_SECRETS};

#[cfg(test)]
mod tests;
