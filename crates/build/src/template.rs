//! An E2B template build (the SDKs' `Template()` builder, sent as `TemplateBuildStartV2`)
//! driven through the same [`Executor`] and step cache as a Dockerfile.
//!
//! The steps mean what E2B's build executor makes of them: RUN is `bash -l -c CMD` (`sh -c` on
//! an image without bash) as the step's user or the current USER; COPY unpacks the archive the
//! SDK uploaded for its files hash and places the matched files at the destination (relative
//! to WORKDIR, Docker's rules, owned by the step's user or `user`); ENV sets variables for the
//! steps after it (build time only, as E2B documents); WORKDIR makes its directory and USER
//! changes the current user. A failure names its step as E2B does: `base` (the `from_*` call),
//! `1`.. for the steps, `finalize` for the start and ready commands.

use std::io::Read;
use std::path::{Path, PathBuf};

use cordon_image::{Image, StartCommand};

use crate::copy::{self, Attrs};
use crate::executor::{Executor, Stage, StepFailure};

pub use cordon_spec::TemplateStep as Step;

/// What to build.
#[derive(Debug, Clone)]
pub struct Template {
    /// The store image it starts from (the caller resolved `fromImage`/`fromTemplate`).
    pub from: String,
    pub steps: Vec<Step>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    /// Run every step, cached or not.
    pub force: bool,
}

/// A failed build: the step E2B's SDKs map back to the builder call, and why.
#[derive(Debug, Clone)]
pub struct Failure {
    pub step: String,
    pub message: String,
}

/// How long a template's start command may take to get ready in each sandbox.
pub const READY_TIMEOUT_SECS: u64 = 300;

/// Where a template build finds the archives the SDK uploaded, by files hash.
pub trait Files {
    fn archive(&self, hash: &str) -> Option<PathBuf>;
}

impl Files for PathBuf {
    fn archive(&self, hash: &str) -> Option<PathBuf> {
        let p = self.join(hash);
        p.is_file().then_some(p)
    }
}

/// Builds `t` as image `name`. `log` gets each line with the step it belongs to.
pub fn build(exec: &mut Executor, t: &Template, files: &dyn Files, name: &str, log: &mut dyn FnMut(Option<&str>, &str)) -> Result<Image, Failure> {
    let base = |message: String| Failure { step: "base".into(), message };
    log(Some("base"), &format!("FROM {}", t.from));
    let mut stage = exec.start(&t.from, &mut |l| log(Some("base"), l)).map_err(|e| base(e.to_string()))?;
    let mut cur = Current { user: stage.meta.default_user.clone(), env: Vec::new() };
    let total = t.steps.len();
    for (i, step) in t.steps.iter().enumerate() {
        let n = (i + 1).to_string();
        log(Some(&n), &format!("[{n}/{total}] {} {}", step.kind, step.args.join(" ")));
        exec.set_no_cache(t.force || step.force);
        let cached = run_step(exec, &mut stage, &mut cur, step, files, &mut |l| log(Some(&n), l)).map_err(|f| {
            let mut message = f.message;
            if let Some(last) = f.tail.last() {
                message.push_str(&format!(" (last output: {last})"));
            }
            Failure { step: n.clone(), message }
        })?;
        if cached {
            log(Some(&n), "cached");
        }
    }
    exec.set_no_cache(false);
    let finalize = |message: String| Failure { step: "finalize".into(), message };
    stage.meta.default_user = cur.user.clone();
    if let Some(start) = &t.start_cmd {
        let view = exec.view(&stage).map_err(|e| finalize(e.to_string()))?;
        let shell = shell(&view);
        stage.meta.start = Some(StartCommand {
            cmd: vec![shell.0.into(), shell.1.into(), start.clone()],
            user: cur.user.clone(),
            cwd: stage.meta.workdir.clone(),
            env: cur.env.clone(),
            ready_port: None,
            ready_cmd: t.ready_cmd.clone().filter(|c| !c.trim().is_empty()),
            ready_timeout_secs: READY_TIMEOUT_SECS,
            needs_token: false,
        });
    } else if t.ready_cmd.is_some() {
        return Err(finalize("a ready command needs a start command (set_start_cmd)".into()));
    }
    exec.commit(&stage, name, format!("template build from {}", t.from), &mut |l| log(Some("finalize"), l)).map_err(|e| finalize(e.to_string()))
}

/// The build-time state the steps change besides the image's config.
struct Current {
    user: String,
    env: Vec<(String, String)>,
}

fn fail(message: impl Into<String>) -> StepFailure {
    StepFailure { message: message.into(), tail: Vec::new() }
}

/// `bash -l -c`, as E2B runs commands, or `sh -c` on an image without bash.
fn shell(view: &crate::merged::Merged) -> (&'static str, &'static str) {
    if view.has_program("/bin/bash") {
        ("/bin/bash", "-lc")
    } else {
        ("/bin/sh", "-c")
    }
}

fn run_step(exec: &mut Executor, stage: &mut Stage, cur: &mut Current, step: &Step, files: &dyn Files, log: &mut dyn FnMut(&str)) -> Result<bool, StepFailure> {
    let arg = |i: usize| step.args.get(i).map(String::as_str).filter(|a| !a.is_empty());
    match step.kind.as_str() {
        "RUN" => {
            let cmd = arg(0).ok_or_else(|| fail("RUN needs a command"))?;
            let user = arg(1).unwrap_or(&cur.user).to_string();
            let view = exec.view(stage).map_err(|e| fail(e.to_string()))?;
            let (sh, flag) = shell(&view);
            drop(view);
            let argv = vec![sh.to_string(), flag.to_string(), cmd.to_string()];
            exec.run(stage, &argv, &user, &cur.env, log).map_err(|f| StepFailure { message: format!("failed to run command '{cmd}': {}", f.message), tail: f.tail })
        }
        "COPY" => {
            let (src, dest) = (arg(0).ok_or_else(|| fail("COPY needs a source"))?, arg(1).ok_or_else(|| fail("COPY needs a destination"))?);
            let hash = step.files_hash.as_deref().ok_or_else(|| fail("COPY without a filesHash: the SDK uploads its files first"))?;
            let archive = files.archive(hash).ok_or_else(|| fail(format!("the files of COPY {src} (hash {hash}) were never uploaded")))?;
            let owner = arg(2).map(str::to_string);
            let mode = match arg(3) {
                None => None,
                Some(m) => Some(u32::from_str_radix(m, 8).map_err(|_| fail(format!("mode {m} is not octal")))?),
            };
            let dest = stage.absolute(dest);
            let user = cur.user.clone();
            let unpacked = exec.scratch_dir("files");
            let _cleanup = Scratch(unpacked.clone());
            unpack_upload(&archive, &unpacked).map_err(fail)?;
            let parts = ["copy", src, &dest, owner.as_deref().unwrap_or(""), arg(3).unwrap_or(""), hash];
            exec.add_tar(stage, &parts, |view, b| {
                let (uid, gid) = match &owner {
                    Some(o) => copy::owner(view, o)?,
                    // E2B's default owner is `user`; an image without one gets the current
                    // user's, else root's.
                    None => copy::owner(view, "user").or_else(|_| copy::owner(view, &user)).unwrap_or((0, 0)),
                };
                let matched = crate::dockerfile_build::sources(&unpacked, None, src)?;
                if matched.is_empty() {
                    return Err(format!("{src} matched no uploaded file"));
                }
                copy::write(view, b, &matched, &dest, Attrs { uid, gid, mode })?;
                Ok(true)
            })
        }
        "ENV" => {
            if !step.args.len().is_multiple_of(2) {
                return Err(fail("ENV takes name and value pairs"));
            }
            for pair in step.args.chunks(2) {
                cur.env.retain(|(k, _)| *k != pair[0]);
                cur.env.push((pair[0].clone(), pair[1].clone()));
            }
            Ok(false)
        }
        "WORKDIR" => {
            let dir = stage.absolute(arg(0).ok_or_else(|| fail("WORKDIR needs a directory"))?);
            stage.meta.workdir = Some(dir.clone());
            let user = cur.user.clone();
            exec.add_tar(stage, &["workdir", &dir, &user], |view, b| {
                let (uid, gid) = copy::owner(view, &user).unwrap_or((0, 0));
                copy::mkdir_p(view, b, &dir, uid, gid)
            })
        }
        "USER" => {
            let user = arg(0).ok_or_else(|| fail("USER needs a user"))?;
            cur.user = user.to_string();
            exec.note(stage, &["user", user]);
            Ok(false)
        }
        other => Err(fail(format!("unknown step type '{other}' (known: RUN, COPY, ENV, WORKDIR, USER)"))),
    }
}

/// Unpacks an uploaded archive (tar, gzip-compressed or not) into `dir`: regular files,
/// directories and symlinks only, never outside `dir`.
fn unpack_upload(archive: &Path, dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().mode(0o700).create(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let mut file = std::fs::File::open(archive).map_err(|e| format!("cannot open the uploaded files: {e}"))?;
    let mut magic = [0u8; 2];
    let n = file.read(&mut magic).map_err(|e| format!("cannot read the uploaded files: {e}"))?;
    let file = std::fs::File::open(archive).map_err(|e| format!("cannot open the uploaded files: {e}"))?;
    let input: Box<dyn Read> = if n == 2 && magic == [0x1f, 0x8b] { Box::new(flate2::read::MultiGzDecoder::new(file)) } else { Box::new(file) };
    let mut tar = tar::Archive::new(input);
    tar.set_preserve_permissions(true);
    tar.set_preserve_ownerships(false);
    tar.set_unpack_xattrs(false);
    let entries = tar.entries().map_err(|e| format!("the uploaded files are not a tar archive: {e}"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| format!("the uploaded archive is damaged: {e}"))?;
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind.is_dir() || kind.is_symlink() || kind.is_hard_link()) {
            continue;
        }
        let shown = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        if !entry.unpack_in(dir).map_err(|e| format!("cannot unpack {shown} of the uploaded files: {e}"))? {
            return Err(format!("the uploaded archive's entry {shown} points outside it"));
        }
    }
    Ok(())
}

/// A scratch directory removed however the step ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
