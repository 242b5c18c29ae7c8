//! The MCP server: one [`Session`] per MCP session, holding (lazily) one sandbox, dispatching
//! `tools/call` to the tools. Everything a tool can get wrong in the model's hands comes back as
//! a tool error (`isError: true`) with a message that says what to change; only a call to a
//! tool that does not exist is a protocol error.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, InitializeResult,
    JsonObject, ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ProgressToken, ProtocolVersion,
    ServerCapabilities, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, Peer, RoleServer, ServerHandler};
use serde::de::DeserializeOwned;

use crate::exec::{self, Job, Outcome, Progress};
use crate::sandbox::{Live, Pool, SessionSandbox};
use crate::tools::{self, CommandLine, Encoding, Language, RunResult};

/// Where `run_code` puts a program too long to pass as an argument.
const CODE_DIR: &str = "/tmp/.cordon-mcp";

/// Longest program `run_code` passes with `-c`; below the kernel's 128 KiB per argument.
const INLINE_CODE_MAX: usize = 100_000;

/// One MCP session.
#[derive(Clone)]
pub struct Session {
    sandbox: Arc<SessionSandbox>,
    tools: Arc<Vec<Tool>>,
    /// Offer only protocol versions that have sessions (streamable HTTP, where the session is
    /// what ties calls to one sandbox; from 2026-07-28 on, HTTP requests carry no session).
    session_based: bool,
}

impl Session {
    pub fn new(pool: Arc<Pool>) -> Session {
        Session { sandbox: Arc::new(SessionSandbox::new(pool)), tools: Arc::new(tools::all()), session_based: false }
    }

    /// See [`Session::session_based`].
    pub fn session_based(mut self) -> Session {
        self.session_based = true;
        self
    }

    /// Destroys the session's sandbox now (also done when the last clone is dropped).
    pub async fn close(&self) {
        self.sandbox.reset().await;
    }

    fn pool(&self) -> &Arc<Pool> {
        self.sandbox.pool()
    }

    async fn dispatch(&self, name: &str, args: JsonObject, ctx: RequestContext<RoleServer>) -> CallToolResult {
        let r = match name {
            "run_code" => match parse::<tools::RunCodeArgs>(name, args) {
                Ok(a) => self.run_code(a, ctx).await,
                Err(e) => Err(e),
            },
            "run_command" => match parse::<tools::RunCommandArgs>(name, args) {
                Ok(a) => self.run_command(a, ctx).await,
                Err(e) => Err(e),
            },
            "write_file" => match parse::<tools::WriteFileArgs>(name, args) {
                Ok(a) => self.write_file(a).await,
                Err(e) => Err(e),
            },
            "read_file" => match parse::<tools::ReadFileArgs>(name, args) {
                Ok(a) => self.read_file(a).await,
                Err(e) => Err(e),
            },
            "list_files" => match parse::<tools::ListFilesArgs>(name, args) {
                Ok(a) => self.list_files(a).await,
                Err(e) => Err(e),
            },
            "reset" => match parse::<tools::ResetArgs>(name, args) {
                Ok(_) => self.reset().await,
                Err(e) => Err(e),
            },
            _ => unreachable!("checked by call_tool"),
        };
        r.unwrap_or_else(|msg| CallToolResult::error(vec![ContentBlock::text(msg)]))
    }

    /// The sandbox, with a note when it was just made.
    async fn live(&self, notes: &mut Vec<String>) -> Result<Live, String> {
        let (live, fresh) = self.sandbox.get().await?;
        if fresh {
            notes.push(format!("started a fresh sandbox ({})", live.id));
        }
        Ok(live)
    }

    async fn run_code(&self, a: tools::RunCodeArgs, ctx: RequestContext<RoleServer>) -> Result<CallToolResult, String> {
        let timeout = self.pool().config().call_timeout(a.timeout)?;
        let mut notes: Vec<String> = timeout.note.into_iter().collect();
        let live = self.live(&mut notes).await?;
        let (ext, interp) = match a.language {
            Language::Python => ("py", "python3"),
            Language::Bash => ("sh", "bash"),
        };
        // `-c` keeps the semantics a model expects (for Python, imports from the working
        // directory). A program too long for one argv string (the kernel caps each at 128 KiB)
        // goes in as a file instead.
        if a.code.len() < INLINE_CODE_MAX {
            let job = Job {
                cmd: interp.into(),
                args: vec!["-c".into(), a.code],
                env: Default::default(),
                cwd: None,
                timeout: timeout.limit,
            };
            return self.execute(&live, job, notes, ctx).await;
        }
        let path = format!("{CODE_DIR}/cell-{}.{ext}", cordon_sandbox::new_id());
        live.client()
            .upload_file(&path, Some(exec::USER), a.code.into_bytes().into())
            .await
            .map_err(|e| self.sandbox_error(&live, "store the code", e))?;
        let mut env = std::collections::BTreeMap::new();
        if a.language == Language::Python {
            env.insert("PYTHONPATH".to_string(), ".".to_string());
        }
        let job = Job { cmd: interp.into(), args: vec![path.clone()], env, cwd: None, timeout: timeout.limit };
        let r = self.execute(&live, job, notes, ctx).await;
        let _ = live.client().remove(&path, Some(exec::USER)).await;
        r
    }

    async fn run_command(&self, a: tools::RunCommandArgs, ctx: RequestContext<RoleServer>) -> Result<CallToolResult, String> {
        let timeout = self.pool().config().call_timeout(a.timeout)?;
        let (cmd, args) = match a.command {
            CommandLine::Argv(v) if v.is_empty() || v[0].is_empty() => {
                return Err("command is empty: give a program and its arguments, e.g. [\"ls\", \"-la\"]".into())
            }
            CommandLine::Argv(mut v) => {
                let cmd = v.remove(0);
                (cmd, v)
            }
            CommandLine::Shell(s) if s.trim().is_empty() => {
                return Err("command is empty: give a shell command line, e.g. \"ls -la\"".into())
            }
            CommandLine::Shell(s) => ("bash".to_string(), vec!["-c".to_string(), s]),
        };
        if let Some(k) = a.env.keys().find(|k| k.is_empty() || k.contains('=') || k.contains('\0')) {
            return Err(format!("env: {k:?} is not a valid variable name"));
        }
        let mut notes: Vec<String> = timeout.note.into_iter().collect();
        let live = self.live(&mut notes).await?;
        let job = Job { cmd, args, env: a.env, cwd: a.cwd, timeout: timeout.limit };
        self.execute(&live, job, notes, ctx).await
    }

    async fn execute(
        &self,
        live: &Live,
        job: Job,
        mut notes: Vec<String>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, String> {
        let cfg = self.pool().config();
        let limit = job.timeout;
        let progress = ProgressReporter { token: ctx.meta.get_progress_token(), peer: ctx.peer.clone() };
        let ct = ctx.ct.clone();
        let outcome = exec::run(self.pool(), live, job, cfg.max_output, ct.cancelled_owned(), progress)
            .await
            .map_err(|e| e.0)?;
        match outcome.reason {
            exec::Reason::Timeout => notes.push(format!(
                "killed after the timeout of {}s; the sandbox is still usable (pass a larger timeout, up to {}s, for longer work)",
                limit.as_secs_f64(),
                cfg.max_timeout.as_secs_f64()
            )),
            exec::Reason::Oom => notes.push(format!(
                "killed by the out-of-memory killer: the sandbox has {} MiB of memory; use less",
                cfg.memory_mb
            )),
            exec::Reason::SandboxDied if self.pool().is_dead(&live.id) => {
                self.sandbox.discard(&live.id).await;
                notes.push("the sandbox died; a fresh one (without your files) starts on the next call".into());
            }
            exec::Reason::Signal => notes.push(format!("ended by {}", outcome.status)),
            _ => {}
        }
        Ok(run_result(outcome, notes))
    }

    async fn write_file(&self, a: tools::WriteFileArgs) -> Result<CallToolResult, String> {
        let data = match a.encoding {
            Encoding::Text => a.content.into_bytes(),
            Encoding::Base64 => base64::engine::general_purpose::STANDARD
                .decode(a.content.trim())
                .map_err(|e| format!("content is not valid base64 ({e}); encode the bytes with standard base64, or use encoding \"text\""))?,
        };
        let max = self.pool().config().max_file;
        if data.len() > max {
            return Err(format!("content is {} bytes, more than this server's limit of {max} bytes per file", data.len()));
        }
        let mut notes = Vec::new();
        let live = self.live(&mut notes).await?;
        let n = data.len();
        let info = live
            .client()
            .upload_file(&a.path, Some(exec::USER), data.into())
            .await
            .map_err(|e| self.sandbox_error(&live, &format!("write {}", a.path), e))?;
        let path = info.first().map(|i| i.path.clone()).unwrap_or(a.path);
        let mut text = format!("wrote {n} bytes to {path}");
        for n in &notes {
            text.push_str(&format!("\nnote: {n}"));
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
    }

    async fn read_file(&self, a: tools::ReadFileArgs) -> Result<CallToolResult, String> {
        let mut notes = Vec::new();
        let live = self.live(&mut notes).await?;
        let max = self.pool().config().max_file;
        let data = live
            .client()
            .with_max_download(max)
            .download_file(&a.path, Some(exec::USER))
            .await
            .map_err(|e| match e {
                cordon_envd::Error::Rpc(ref r) if r.code == cordon_envd::Code::ResourceExhausted => format!(
                    "{} is larger than this server's limit of {max} bytes; read part of it with run_command (head -c, tail, grep)",
                    a.path
                ),
                e => self.sandbox_error(&live, &format!("read {}", a.path), e),
            })?;
        let text = match a.encoding {
            Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(&data),
            Encoding::Text => String::from_utf8(data.to_vec()).map_err(|_| {
                format!("{} is not UTF-8 text ({} bytes); read it again with encoding \"base64\"", a.path, data.len())
            })?,
        };
        Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
    }

    async fn list_files(&self, a: tools::ListFilesArgs) -> Result<CallToolResult, String> {
        let depth = a.depth.unwrap_or(1);
        if !(1..=5).contains(&depth) {
            return Err(format!("depth must be between 1 and 5, got {depth}"));
        }
        let path = a.path.unwrap_or_else(|| "/home/user".into());
        let mut notes = Vec::new();
        let live = self.live(&mut notes).await?;
        let mut entries = live
            .client()
            .list_dir(&path, depth, Some(exec::USER))
            .await
            .map_err(|e| self.sandbox_error(&live, &format!("list {path}"), e))?;
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let max = self.pool().config().max_entries;
        let total = entries.len();
        let mut lines: Vec<String> = entries
            .iter()
            .take(max)
            .map(|e| {
                use cordon_envd::filesystem::FileType;
                let kind = if e.is_symlink {
                    "symlink"
                } else {
                    match e.file_type {
                        FileType::Directory => "dir",
                        FileType::File => "file",
                        _ => "other",
                    }
                };
                format!("{kind}\t{}\t{}", e.size, e.path)
            })
            .collect();
        if total > max {
            lines.push(format!("[... {} more entries not shown; list a subdirectory or use a smaller depth ...]", total - max));
        }
        if lines.is_empty() {
            lines.push(format!("{path} is empty"));
        } else {
            lines.insert(0, "type\tsize\tpath".into());
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(lines.join("\n"))]))
    }

    async fn reset(&self) -> Result<CallToolResult, String> {
        let text = match self.sandbox.reset().await {
            Some(id) => format!("sandbox {id} destroyed; the next call starts a fresh one"),
            None => "there was no sandbox yet; the next call starts a fresh one".into(),
        };
        Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
    }

    /// A failure talking to the agent: the agent's own message (bad path, permission...) when it
    /// answered, or news that the sandbox died.
    fn sandbox_error(&self, live: &Live, what: &str, e: cordon_envd::Error) -> String {
        if self.pool().is_dead(&live.id) {
            let sandbox = self.sandbox.clone();
            let id = live.id.clone();
            tokio::spawn(async move { sandbox.discard(&id).await });
            return format!("cannot {what}: the sandbox died; a fresh one (without your files) starts on the next call");
        }
        match e {
            cordon_envd::Error::Rpc(r) => format!("cannot {what}: {}", r.message),
            e => format!("cannot {what}: {e}"),
        }
    }
}

fn parse<T: DeserializeOwned>(tool: &str, args: JsonObject) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::Object(args))
        .map_err(|e| format!("invalid arguments for {tool}: {e}; see the tool's input schema"))
}

fn run_result(o: Outcome, notes: Vec<String>) -> CallToolResult {
    let r = RunResult {
        stdout: o.stdout.render("stdout"),
        stderr: o.stderr.render("stderr"),
        exit_code: o.exit_code,
        reason: o.reason.name().into(),
        duration_ms: o.duration.as_millis() as u64,
        stdout_truncated_bytes: o.stdout.dropped(),
        stderr_truncated_bytes: o.stderr.dropped(),
        notes,
    };
    // The text block is what most clients show the model; the structured copy is for programs.
    let mut text = match r.exit_code {
        Some(c) => format!("exit_code: {c}  reason: {}  duration_ms: {}", r.reason, r.duration_ms),
        None => format!("exit_code: none  reason: {}  duration_ms: {}", r.reason, r.duration_ms),
    };
    for n in &r.notes {
        text.push_str(&format!("\nnote: {n}"));
    }
    if !r.stdout.is_empty() {
        text.push_str("\n--- stdout ---\n");
        text.push_str(&r.stdout);
    }
    if !r.stderr.is_empty() {
        text.push_str("\n--- stderr ---\n");
        text.push_str(&r.stderr);
    }
    let value = serde_json::to_value(&r).unwrap_or_default();
    let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
    result.structured_content = Some(value);
    result
}

/// Sends `notifications/progress` when the client asked for them with a progress token.
struct ProgressReporter {
    token: Option<ProgressToken>,
    peer: Peer<RoleServer>,
}

impl Progress for ProgressReporter {
    async fn report(&mut self, elapsed: Duration, limit: Duration, out: u64, err: u64) {
        let Some(token) = &self.token else { return };
        let p = ProgressNotificationParam::new(token.clone(), elapsed.as_secs_f64())
            .with_total(limit.as_secs_f64())
            .with_message(format!(
                "running for {:.0}s of at most {:.0}s; {out} bytes of stdout, {err} of stderr so far",
                elapsed.as_secs_f64(),
                limit.as_secs_f64()
            ));
        if let Err(e) = self.peer.notify_progress(p).await {
            tracing::debug!("progress notification: {e}");
        }
    }
}

impl ServerHandler for Session {
    fn get_info(&self) -> InitializeResult {
        let c = self.pool().config();
        let mut info = InitializeResult::new(ServerCapabilities::builder().enable_tools().build());
        info.server_info = Implementation::new("cordon", env!("CARGO_PKG_VERSION")).with_title("cordon sandbox");
        info.instructions = Some(format!(
            "Tools to run code in an isolated Linux sandbox (image {}, {} MiB memory, {} CPU, {} MiB disk, no network). \
             The sandbox is created on the first call and kept for this session: files persist between calls, \
             processes do not. Calls time out after {}s unless they ask for another timeout (at most {}s). \
             Use `reset` to start over from a clean sandbox.",
            c.image,
            c.memory_mb,
            c.cpus,
            c.disk_mb,
            c.default_timeout.as_secs_f64(),
            c.max_timeout.as_secs_f64()
        ));
        info
    }

    fn supported_protocol_versions(&self) -> std::borrow::Cow<'static, [ProtocolVersion]> {
        if self.session_based {
            std::borrow::Cow::Borrowed(ProtocolVersion::known_up_to(&ProtocolVersion::LATEST_WITH_INITIALIZE))
        } else {
            std::borrow::Cow::Borrowed(ProtocolVersion::KNOWN_VERSIONS)
        }
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools.as_ref().clone()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tools.iter().find(|t| t.name == name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if self.get_tool(&request.name).is_none() {
            let names: Vec<&str> = self.tools.iter().map(|t| t.name.as_ref()).collect();
            return Err(ErrorData::invalid_params(
                format!("unknown tool {:?}; the tools are {}", request.name, names.join(", ")),
                None,
            ));
        }
        let args = request.arguments.unwrap_or_default();
        Ok(self.dispatch(&request.name, args, context).await.into())
    }
}
