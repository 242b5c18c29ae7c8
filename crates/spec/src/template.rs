//! One step of an E2B template build (`TemplateStep` of `TemplateBuildStartV2`), as the API
//! takes it and the builder runs it.

use serde::{Deserialize, Serialize};

/// `{type, args, force, filesHash}`; the keys the SDKs add beyond these (`forceUpload`,
/// `resolveSymlinks`, `gzip`) are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateStep {
    /// `RUN`, `COPY`, `ENV`, `WORKDIR` or `USER`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    /// Run it even if the build cache has it.
    #[serde(default)]
    pub force: bool,
    /// COPY: the digest the SDK computed over the files, under which it uploaded them.
    #[serde(rename = "filesHash", default, skip_serializing_if = "Option::is_none")]
    pub files_hash: Option<String>,
}
