//! A parsed Dockerfile driven through the [`Executor`]: stage by stage, instruction by
//! instruction, each failure named by its Dockerfile line.
//!
//! Choices where Docker's behaviour depends on things cordon does not have:
//! - `FROM` names an image of the store, an earlier stage, or else a registry reference that
//!   is pulled (`FROM scratch` is refused: an image needs a tree to run in);
//! - RUN steps of a stage that starts from one of cordon's recipe images (`base`,
//!   `code-interpreter-v1`) run as root until a `USER` says otherwise, as they would on a
//!   Debian image under Docker; the built image keeps the base's default user (`user`) unless
//!   the Dockerfile set one. Other images' steps run as their config's `User`;
//! - `ADD` takes local files and directories like COPY (a URL or a local archive to unpack is
//!   refused with what to do instead);
//! - `/tmp` of a RUN step is the sandbox's own scratch space and is not part of the layer.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use cordon_image::{Image, ImageError};

use crate::copy::{self, Attrs};
use crate::dockerfile::{self, Command, Instruction, Kind};
use crate::executor::{Executor, Stage, StepFailure};
use crate::BuildError;

/// Pulls a reference the store does not have, logging to the second argument; returns the
/// store name it pulled to.
pub type Pull<'a> = dyn FnMut(&str, &mut dyn FnMut(&str)) -> Result<String, BuildError> + 'a;

/// What to build.
#[derive(Debug, Clone)]
pub struct Request {
    /// Name of the image to make.
    pub name: String,
    pub dockerfile: PathBuf,
    /// The build context COPY reads from (default: the Dockerfile's directory).
    pub context: PathBuf,
    pub build_args: Vec<(String, String)>,
}

/// Builds `req` with `exec`, pulling `FROM` references the store does not have with `pull`
/// (which returns the store name it pulled to). Logs each step and its output to `log`.
pub fn build(exec: &mut Executor, req: &Request, pull: &mut Pull<'_>, log: &mut dyn FnMut(&str)) -> Result<Image, BuildError> {
    cordon_image::validate_name(&req.name)?;
    let text = std::fs::read_to_string(&req.dockerfile).map_err(|e| BuildError::Invalid(format!("cannot read the Dockerfile {}: {e}", req.dockerfile.display())))?;
    if !req.context.is_dir() {
        return Err(BuildError::Invalid(format!("the build context {} is not a directory: give one with --context DIR", req.context.display())));
    }
    let file = dockerfile::parse(&text, &req.build_args)?;
    let total: usize = file.stages.iter().map(|s| s.instructions.len() + 1).sum();
    let mut n = 0;
    let mut done: Vec<(Option<String>, Stage)> = Vec::new();
    for st in &file.stages {
        n += 1;
        log(&format!("[{n}/{total}] FROM {}{}", st.from, st.name.as_ref().map(|a| format!(" AS {a}")).unwrap_or_default()));
        let at = |line: usize, text: &str| format!("Dockerfile line {line} ({})", clip(text));
        let from_at = at(st.line, &format!("FROM {}", st.from));
        let mut stage = match done.iter().find(|(name, _)| name.as_deref() == Some(st.from.to_lowercase().as_str())) {
            Some((_, s)) => s.clone(),
            None => start(exec, &st.from, pull, log).map_err(|e| BuildError::Step { at: from_at.clone(), message: e.to_string(), tail: Vec::new() })?,
        };
        let mut ctx = StageCtx::new(&stage, req);
        for ins in &st.instructions {
            n += 1;
            log(&format!("[{n}/{total}] {}", clip(&ins.text)));
            let cached = step(exec, &mut stage, &mut ctx, ins, &done, log).map_err(|f| BuildError::Step { at: at(ins.line, &ins.text), message: f.message, tail: f.tail })?;
            if cached {
                log("  cached");
            }
        }
        if let Some(u) = &ctx.user_set {
            stage.meta.default_user = u.clone();
        }
        done.push((st.name.clone(), stage));
    }
    let (_, last) = done.pop().ok_or_else(|| BuildError::Invalid("the Dockerfile has no FROM".into()))?;
    exec.commit(&last, &req.name, format!("build {}", req.dockerfile.display()), log)
}

/// The first stage of a FROM: a store image, else a pull.
fn start(exec: &mut Executor, from: &str, pull: &mut Pull<'_>, log: &mut dyn FnMut(&str)) -> Result<Stage, BuildError> {
    if from == "scratch" {
        return Err(BuildError::Invalid("FROM scratch is not supported: start from an image (base, or one pulled or imported)".into()));
    }
    if cordon_image::validate_name(from).is_ok() {
        match exec.start(from, log) {
            Err(BuildError::Image(ImageError::NotFound { .. })) if !from.contains('/') && !from.contains(':') && cordon_image::recipes().contains(&from) => {
                log(&format!("building image '{from}' from its recipe"));
                exec.store().build(from, &Default::default(), &mut crate::executor::LineProgress(log))?;
                return exec.start(from, log);
            }
            Err(BuildError::Image(ImageError::NotFound { .. })) => {}
            other => return other,
        }
    }
    let name = match pull(from, log) {
        Ok(n) => n,
        // A plain name was most likely meant as a store image: say that first.
        Err(e) if cordon_image::validate_name(from).is_ok() && !from.contains('/') => {
            return Err(BuildError::Invalid(format!("'{from}' is not an image of the store (see cordon image ls) and pulling it failed: {e}")))
        }
        Err(e) => return Err(e),
    };
    exec.start(&name, log)
}

/// What a stage's instructions see besides its image: ARG values, the SHELL, whether USER
/// was set, and the build context.
struct StageCtx<'a> {
    args: HashMap<String, String>,
    shell: Vec<String>,
    /// The user RUN steps run as.
    run_user: String,
    user_set: Option<String>,
    req: &'a Request,
}

impl<'a> StageCtx<'a> {
    fn new(stage: &Stage, req: &'a Request) -> Self {
        let run_user = if stage.meta.recipe.is_some() { "root".to_string() } else { stage.meta.default_user.clone() };
        StageCtx { args: HashMap::new(), shell: vec!["/bin/sh".into(), "-c".into()], run_user, user_set: None, req }
    }

    /// `$VAR` in an instruction: the stage's ENV, then its ARGs.
    fn subst(&self, stage: &Stage, s: &str) -> Result<String, StepFailure> {
        let lookup = |k: &str| stage.meta.env.iter().rev().find(|(ek, _)| ek == k).map(|(_, v)| v.clone()).or_else(|| self.args.get(k).cloned());
        dockerfile::substitute(s, &lookup).map_err(|message| StepFailure { message, tail: Vec::new() })
    }
}

fn fail(message: impl Into<String>) -> StepFailure {
    StepFailure { message: message.into(), tail: Vec::new() }
}

fn step(exec: &mut Executor, stage: &mut Stage, ctx: &mut StageCtx<'_>, ins: &Instruction, done: &[(Option<String>, Stage)], log: &mut dyn FnMut(&str)) -> Result<bool, StepFailure> {
    match &ins.kind {
        Kind::Run(cmd) => {
            let argv = match cmd {
                Command::Shell(s) => {
                    let mut v = ctx.shell.clone();
                    v.push(s.clone());
                    v
                }
                Command::Exec(v) if v.is_empty() => return Err(fail("RUN needs a command")),
                Command::Exec(v) => v.clone(),
            };
            if matches!(cmd, Command::Shell(_)) {
                let view = exec.view(stage).map_err(|e| fail(e.to_string()))?;
                if !view.has_program(&ctx.shell[0]) {
                    return Err(fail(format!("the image has no {}: give the command in exec form (RUN [\"program\", \"arg\"]) or set SHELL", ctx.shell[0])));
                }
            }
            let mut env: Vec<(String, String)> = ctx.args.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            env.sort();
            let user = ctx.run_user.clone();
            exec.run(stage, &argv, &user, &env, &mut |l| log(&format!("  {l}")))
        }
        Kind::Copy { srcs, dest, from, chown, chmod } => copy_step(exec, stage, ctx, ins, srcs, dest, from.as_deref(), chown.as_deref(), chmod.as_deref(), done),
        Kind::Add { srcs, dest, chown, chmod } => {
            if let Some(url) = srcs.iter().find(|s| s.contains("://")) {
                return Err(fail(format!("ADD of a URL ({url}) is not supported: download it in a RUN step (with --allow-net) instead")));
            }
            copy_step(exec, stage, ctx, ins, srcs, dest, None, chown.as_deref(), chmod.as_deref(), done)
        }
        Kind::Env(pairs) => {
            for (k, v) in pairs {
                let v = ctx.subst(stage, v)?;
                stage.meta.env.retain(|(ek, _)| ek != k);
                stage.meta.env.push((k.clone(), v));
            }
            let json = serde_json::to_string(&stage.meta.env).expect("serializes");
            exec.note(stage, &["env", &json]);
            Ok(false)
        }
        Kind::Arg { name, default } => {
            let value = match ctx.req.build_args.iter().rev().find(|(k, _)| k == name) {
                Some((_, v)) => v.clone(),
                None => match default {
                    Some(d) => ctx.subst(stage, d)?,
                    None => String::new(),
                },
            };
            ctx.args.insert(name.clone(), value);
            Ok(false)
        }
        Kind::Workdir(p) => {
            let p = ctx.subst(stage, p)?;
            let abs = stage.absolute(&p);
            stage.meta.workdir = Some(abs.clone());
            exec.add_tar(stage, &["workdir", &abs], |view, b| copy::mkdir_p(view, b, &abs, 0, 0))
        }
        Kind::User(u) => {
            let u = ctx.subst(stage, u)?;
            ctx.run_user = u.clone();
            ctx.user_set = Some(u.clone());
            exec.note(stage, &["user", &u]);
            Ok(false)
        }
        Kind::Cmd(c) => {
            stage.meta.cmd = argv_of(c, &ctx.shell);
            Ok(false)
        }
        Kind::Entrypoint(c) => {
            stage.meta.entrypoint = argv_of(c, &ctx.shell);
            // Docker: a new ENTRYPOINT drops the CMD inherited from the base image.
            stage.meta.cmd.clear();
            Ok(false)
        }
        Kind::Expose(ports) => {
            for p in ports {
                let p = ctx.subst(stage, p)?;
                if !stage.meta.exposed_ports.contains(&p) {
                    stage.meta.exposed_ports.push(p);
                }
            }
            Ok(false)
        }
        Kind::Shell(v) => {
            if v.is_empty() {
                return Err(fail("SHELL needs a program"));
            }
            ctx.shell = v.clone();
            Ok(false)
        }
        Kind::Label(_) | Kind::StopSignal(_) | Kind::Healthcheck(_) | Kind::Maintainer(_) => Ok(false),
        Kind::Volume(_) => {
            log("  VOLUME is recorded nowhere: a sandbox's files are its own; use a volume at create");
            Ok(false)
        }
        Kind::OnBuild(_) => {
            log("  ONBUILD is ignored");
            Ok(false)
        }
    }
}

fn argv_of(c: &Command, shell: &[String]) -> Vec<String> {
    match c {
        Command::Exec(v) => v.clone(),
        Command::Shell(s) => {
            let mut v = shell.to_vec();
            v.push(s.clone());
            v
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn copy_step(exec: &mut Executor, stage: &mut Stage, ctx: &StageCtx<'_>, ins: &Instruction, srcs: &[String], dest: &str, from: Option<&str>, chown: Option<&str>, chmod: Option<&str>, done: &[(Option<String>, Stage)]) -> Result<bool, StepFailure> {
    let dest = stage.absolute(&ctx.subst(stage, dest)?);
    let mode = match chmod {
        None => None,
        Some(m) => Some(u32::from_str_radix(&ctx.subst(stage, m)?, 8).map_err(|_| fail(format!("--chmod={m} is not an octal mode")))?),
    };
    let chown = chown.map(|c| ctx.subst(stage, c)).transpose()?;
    // The files to copy: from the context, or from another stage's view.
    let mut source_view = None;
    let (root, what) = match from {
        None => (ctx.req.context.canonicalize().map_err(|e| fail(format!("cannot open the build context: {e}")))?, "the build context".to_string()),
        Some(f) => {
            let f = f.to_lowercase();
            let other = done.iter().find(|(n, _)| n.as_deref() == Some(f.as_str())).map(|(_, s)| s.clone()).or_else(|| f.parse::<usize>().ok().and_then(|i| done.get(i).map(|(_, s)| s.clone())));
            let other = match other {
                Some(o) => o,
                None => return Err(fail(format!("--from={f} names no earlier stage (stages are named with FROM ... AS NAME)"))),
            };
            let v = exec.view(&other).map_err(|e| fail(e.to_string()))?;
            let root = v.root().to_path_buf();
            source_view = Some(v);
            (root, format!("stage {f}"))
        }
    };
    let mut files = Vec::new();
    for s in srcs {
        let s = ctx.subst(stage, s)?;
        let matched = sources(&root, source_view.as_ref(), &s).map_err(fail)?;
        if matched.is_empty() {
            return Err(fail(format!("{s} is not in {what}")));
        }
        files.extend(matched);
    }
    let digest = copy::digest_sources(&root, &files).map_err(|e| fail(format!("cannot read the files to copy: {e}")))?;
    let chown_key = chown.clone().unwrap_or_default();
    let mode_key = mode.map(|m| format!("{m:o}")).unwrap_or_default();
    exec.add_tar(stage, &["copy", &ins.text, &dest, &digest, &chown_key, &mode_key], |view, b| {
        let (uid, gid) = match &chown {
            Some(c) => copy::owner(view, c)?,
            None => (0, 0),
        };
        copy::write(view, b, &files, &dest, Attrs { uid, gid, mode })?;
        Ok(true)
    })
}

/// The host paths a COPY source names: in the build context `root` (a path or a glob, never
/// outside it), or in another stage's `view`, resolved as that image would resolve it (a
/// glob only in its last component there), so no symlink of the image leads to a host file.
pub(crate) fn sources(root: &Path, view: Option<&crate::merged::Merged>, src: &str) -> Result<Vec<PathBuf>, String> {
    let rel = src.trim_start_matches('/');
    let has_glob = |s: &str| s.contains(['*', '?', '[']);
    if let Some(view) = view {
        let (dir, last) = match rel.rsplit_once('/') {
            Some((d, l)) => (d, l),
            None => ("", rel),
        };
        if has_glob(dir) {
            return Err(format!("{src}: with --from, only the last component may be a pattern"));
        }
        if !has_glob(last) {
            let p = view.host_path(&format!("/{rel}")).map_err(|e| format!("cannot resolve {src}: {e}"))?;
            return Ok(if std::fs::symlink_metadata(&p).is_ok() { vec![p] } else { Vec::new() });
        }
        let parent = view.host_path(&format!("/{dir}")).map_err(|e| format!("cannot resolve {src}: {e}"))?;
        let pattern = glob::Pattern::new(last).map_err(|e| format!("{src} is not a valid pattern: {e}"))?;
        let mut out: Vec<PathBuf> = std::fs::read_dir(&parent)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(|n| pattern.matches(n)))
            .map(|e| e.path())
            .collect();
        out.sort();
        return Ok(out);
    }
    if rel.split('/').any(|c| c == "..") {
        return Err(format!("{src} leaves the build context ('..')"));
    }
    let root = &root.canonicalize().map_err(|e| format!("cannot open {}: {e}", root.display()))?;
    let candidates: Vec<PathBuf> = if has_glob(rel) {
        let pattern = format!("{}/{rel}", glob::Pattern::escape(&root.to_string_lossy()));
        glob::glob(&pattern).map_err(|e| format!("{src} is not a valid pattern: {e}"))?.filter_map(Result::ok).collect()
    } else if rel.is_empty() || rel == "." {
        vec![root.to_path_buf()]
    } else {
        let p = root.join(rel);
        if std::fs::symlink_metadata(&p).is_ok() { vec![p] } else { Vec::new() }
    };
    let mut out = Vec::new();
    for c in candidates {
        // A source reached through a symlink that leaves the context (the context's own
        // `link -> /etc`) is refused, as Docker refuses it.
        let real = c.canonicalize().map_err(|e| format!("cannot read {}: {e}", c.display()))?;
        if !real.starts_with(root) {
            return Err(format!("{src} points outside the build context"));
        }
        out.push(real);
    }
    out.sort();
    Ok(out)
}

fn clip(s: &str) -> String {
    if s.chars().count() > 72 {
        let mut t: String = s.chars().take(69).collect();
        t.push_str("...");
        t
    } else {
        s.to_string()
    }
}
