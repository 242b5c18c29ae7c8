//! The E2B envd wire protocol as cordon speaks it: the `process` and `filesystem` message types
//! in proto3 JSON form, the Connect framing (envelopes, end-stream messages, error codes), the
//! `/files` types, and an async client for an envd socket.
//!
//! The wire contract is written down in `specs/e2b-protocol.md` (section 3); the types here follow
//! it field by field, so that the official SDKs can talk to `cordon-agent` through the host.

pub mod client;
pub mod connect;
pub mod error;
pub mod files;
pub mod filesystem;
mod json;
pub mod process;
pub mod timestamp;

pub use client::{basic_auth, EnvdClient, ProcessOutput, ProcessStream, ServerStream, DEFAULT_MAX_DOWNLOAD};
pub use connect::{Code, ConnectError};
pub use error::{Error, Result};
pub use files::WriteInfo;
pub use json::{decode_base64, encode_base64};
pub use timestamp::Timestamp;
