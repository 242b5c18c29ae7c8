//! Types of the plain HTTP `/files` endpoint of envd.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Path of the file endpoint.
pub const PATH: &str = "/files";
/// Prefix of request headers that carry file metadata (`X-Metadata-<key>: <value>`).
pub const METADATA_HEADER_PREFIX: &str = "x-metadata-";
/// Prefix of the extended attributes metadata is stored in.
pub const METADATA_XATTR_PREFIX: &str = "user.e2b.";

/// One written file, as the upload response lists it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct WriteInfo {
    /// Base name.
    pub name: String,
    /// `"file"` or `"dir"`.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub entry_type: Option<String>,
    /// Absolute path.
    pub path: String,
    /// The metadata now stored on the file.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// The JSON body of a `/files` error: `{"message":"...","code":404}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FilesError {
    /// What went wrong.
    pub message: String,
    /// The HTTP status, repeated.
    pub code: u16,
}
