//! The tools as a model sees them: names, descriptions and argument schemas (derived from the
//! argument types, so the schema and the parser cannot disagree). Every argument type refuses
//! unknown fields: a call cannot smuggle in a cap the schema does not offer.

use std::collections::BTreeMap;

use rmcp::model::{Tool, ToolAnnotations};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Language of `run_code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    Python,
    Bash,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCodeArgs {
    /// "python" (Python 3) or "bash".
    pub language: Language,
    /// The program text. It runs as a fresh process each call: variables do not carry over
    /// between calls, files do.
    pub code: String,
    /// Seconds before the run is killed (optional; the server has a default and a ceiling).
    #[serde(default)]
    pub timeout: Option<f64>,
}

/// A command line: an argv list run as is, or one string run by `bash -c`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum CommandLine {
    /// Program and arguments, no shell involved, e.g. ["ls", "-la", "/tmp"].
    Argv(Vec<String>),
    /// A shell command line, run with `bash -c`, e.g. "ls -la | head -5".
    Shell(String),
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCommandArgs {
    /// Either an argv list (["pip", "list"]) or a shell string ("pip list | grep numpy").
    pub command: CommandLine,
    /// Working directory; relative paths start at the home directory /home/user (the default).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment variables for this command only.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Seconds before the command is killed (optional; the server has a default and a ceiling).
    #[serde(default)]
    pub timeout: Option<f64>,
}

/// How `content` is encoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// UTF-8 text.
    #[default]
    Text,
    /// Base64 of raw bytes (for binary files).
    Base64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    /// Path in the sandbox; relative paths start at /home/user. Parent directories are created.
    pub path: String,
    /// The whole new content of the file (an existing file is replaced).
    pub content: String,
    /// "text" (default) or "base64" for binary data.
    #[serde(default)]
    pub encoding: Encoding,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    /// Path in the sandbox; relative paths start at /home/user.
    pub path: String,
    /// "text" (default; fails on bytes that are not UTF-8) or "base64" (any file).
    #[serde(default)]
    pub encoding: Encoding,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// Directory in the sandbox (default: /home/user).
    #[serde(default)]
    pub path: Option<String>,
    /// How many levels to descend, 1 to 5 (default 1: the directory's own entries).
    #[serde(default)]
    pub depth: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResetArgs {}

/// What a run returns.
#[derive(Debug, Serialize, JsonSchema)]
pub struct RunResult {
    /// Standard output (the middle is cut out when long; see stdout_truncated_bytes).
    pub stdout: String,
    /// Standard error (likewise).
    pub stderr: String,
    /// The exit status, or null when the process did not exit by itself.
    pub exit_code: Option<i32>,
    /// Why the run ended: "exit", "signal", "timeout", "oom", "cancelled" or "sandbox_died".
    pub reason: String,
    /// Wall-clock time of the run in milliseconds.
    pub duration_ms: u64,
    /// Bytes of stdout left out of the result (0 when nothing was cut).
    pub stdout_truncated_bytes: u64,
    /// Bytes of stderr left out of the result.
    pub stderr_truncated_bytes: u64,
    /// Anything else the caller should know (a clamped timeout, a fresh sandbox...).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

fn schema<T: JsonSchema + 'static>(name: &'static str, description: &'static str) -> Tool {
    Tool::new(name, description, rmcp::model::JsonObject::new()).with_input_schema::<T>()
}

fn annotations(title: &str, read_only: bool, destructive: bool, idempotent: bool) -> ToolAnnotations {
    // open_world false: the sandbox is closed to the world unless the operator opened it.
    ToolAnnotations::from_raw(Some(title.into()), Some(read_only), Some(destructive), Some(idempotent), Some(false))
}

/// Every tool, in the order `tools/list` gives them.
pub fn all() -> Vec<Tool> {
    vec![
        schema::<RunCodeArgs>(
            "run_code",
            "Run a Python 3 or bash program in an isolated Linux sandbox (Debian, no network) and \
             return its stdout, stderr, exit code and why it ended (reason: exit, signal, timeout, \
             oom, cancelled, sandbox_died). Each call is a new process: keep state in files. The \
             sandbox persists across calls of this session; files you write stay until `reset`. \
             Long output is cut in the middle and the cut is marked.",
        )
        .with_output_schema::<RunResult>()
        .annotate(annotations("Run code in the sandbox", false, true, false)),
        schema::<RunCommandArgs>(
            "run_command",
            "Run a command in the sandbox as user `user` (passwordless sudo inside the sandbox): \
             an argv list runs as is, a string runs under `bash -c`. Returns stdout, stderr, exit \
             code and the reason it ended. There is no network access; installing packages from \
             the internet will fail.",
        )
        .with_output_schema::<RunResult>()
        .annotate(annotations("Run a command in the sandbox", false, true, false)),
        schema::<WriteFileArgs>(
            "write_file",
            "Create or replace a file in the sandbox with the given content (text, or base64 for \
             binary). Parent directories are created. Relative paths start at /home/user.",
        )
        .annotate(annotations("Write a file in the sandbox", false, true, true)),
        schema::<ReadFileArgs>(
            "read_file",
            "Read a file from the sandbox, as text (UTF-8) or base64 (binary). Files larger than \
             the server's size limit are refused; use run_command with head, tail or grep to read \
             part of a large file.",
        )
        .annotate(annotations("Read a file from the sandbox", true, false, true)),
        schema::<ListFilesArgs>(
            "list_files",
            "List a directory of the sandbox: name, type (file, dir, symlink), size in bytes and \
             path of each entry, optionally a few levels deep.",
        )
        .annotate(annotations("List files in the sandbox", true, false, true)),
        schema::<ResetArgs>(
            "reset",
            "Throw the sandbox away, with every file and process in it, and start from a fresh \
             one on the next call. Use it when the sandbox is in a bad state.",
        )
        .annotate(annotations("Reset the sandbox", false, true, true)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_refuse_unknown_fields_and_describe_every_argument() {
        for t in all() {
            let s = serde_json::Value::Object(t.input_schema.as_ref().clone());
            assert_eq!(s["type"], "object", "{}", t.name);
            assert_eq!(s["additionalProperties"], false, "{}: {s}", t.name);
            if let Some(props) = s["properties"].as_object() {
                for (k, v) in props {
                    let described = v.get("description").is_some() || v.get("$ref").is_some() || v.get("anyOf").is_some();
                    assert!(described, "{}.{k} has no description: {v}", t.name);
                }
            }
            assert!(t.description.as_deref().is_some_and(|d| d.len() > 40), "{}", t.name);
        }
    }

    #[test]
    fn command_lines_parse_both_ways() {
        let a: RunCommandArgs = serde_json::from_value(serde_json::json!({"command": ["ls", "-l"]})).unwrap();
        assert!(matches!(a.command, CommandLine::Argv(v) if v == ["ls", "-l"]));
        let a: RunCommandArgs = serde_json::from_value(serde_json::json!({"command": "ls | wc -l"})).unwrap();
        assert!(matches!(a.command, CommandLine::Shell(s) if s == "ls | wc -l"));
        let e = serde_json::from_value::<RunCommandArgs>(serde_json::json!({"command": "ls", "memory": "8G"}));
        assert!(e.is_err());
    }
}
