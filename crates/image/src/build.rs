//! Building images with mmdebstrap.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;

use crate::recipe::{Recipe, DEFAULT_PATH};
use crate::{ImageError, Progress};

/// How many log lines an error message carries.
const TAIL_LINES: usize = 10;

/// Environment variable naming the Debian mirror when none is passed.
pub(crate) const MIRROR_ENV: &str = "CORDON_DEBIAN_MIRROR";

const STAGE_INSTALL_TOOL: &str = "installing mmdebstrap";
const STAGE_PREPARING: &str = "preparing";
const STAGE_UPDATE: &str = "updating package lists";
const STAGE_DOWNLOAD: &str = "downloading packages";
const STAGE_EXTRACT: &str = "extracting";
const STAGE_ESSENTIAL: &str = "installing essential packages";
const STAGE_INSTALL: &str = "installing packages";
pub(crate) const STAGE_FINALIZING: &str = "finalizing";

/// Finds an executable by name in PATH plus the standard directories (a
/// sudo or cron environment may have a PATH without the sbin dirs).
pub(crate) fn find_tool(name: &str) -> Option<PathBuf> {
    let env_path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&env_path).collect();
    dirs.extend(std::env::split_paths(DEFAULT_PATH));
    dirs.into_iter()
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Tracks the named stages of one build and reports each once, in order.
pub(crate) struct Stages<'a> {
    names: Vec<&'static str>,
    current: Option<usize>,
    progress: &'a mut dyn Progress,
}

impl<'a> Stages<'a> {
    pub(crate) fn new(names: Vec<&'static str>, progress: &'a mut dyn Progress) -> Stages<'a> {
        Stages {
            names,
            current: None,
            progress,
        }
    }

    /// Enters `name` unless the build is already at or past it; output of
    /// the tools is not strictly ordered, and a bar must never go back.
    pub(crate) fn enter(&mut self, name: &str) {
        let Some(idx) = self.names.iter().position(|n| *n == name) else {
            return;
        };
        if self.current.is_some_and(|c| idx <= c) {
            return;
        }
        self.current = Some(idx);
        self.progress.stage(idx, self.names.len(), self.names[idx]);
    }

    pub(crate) fn line(&mut self, text: &str) {
        self.progress.line(text);
    }

    /// The wrapped progress, for steps that report lines directly.
    pub(crate) fn progress_mut(&mut self) -> &mut dyn Progress {
        &mut *self.progress
    }
}

/// The build log file plus the last lines kept for error messages.
pub(crate) struct BuildLog {
    path: PathBuf,
    file: Option<File>,
    tail: VecDeque<String>,
}

impl BuildLog {
    pub(crate) fn create(path: PathBuf) -> Result<BuildLog, ImageError> {
        let file = File::create(&path).map_err(|e| {
            ImageError::io(format!("cannot create build log {}", path.display()), e)
        })?;
        Ok(BuildLog {
            path,
            file: Some(file),
            tail: VecDeque::new(),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn write(&mut self, line: &str) {
        if let Some(f) = &mut self.file {
            // A log that stops being writable (disk full) must not abort the
            // build by itself; the build will fail on its own if it matters.
            if writeln!(f, "{line}").is_err() {
                self.file = None;
            }
        }
        if self.tail.len() == TAIL_LINES {
            self.tail.pop_front();
        }
        self.tail.push_back(line.to_string());
    }

    pub(crate) fn tail(&self) -> Vec<String> {
        self.tail.iter().cloned().collect()
    }

    /// Starts a section so the tail of a failure is about the failing step.
    pub(crate) fn section(&mut self, title: &str) {
        self.tail.clear();
        self.write(&format!("==> {title}"));
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Runs `cmd` with stdout and stderr captured line by line (both `\n` and
/// `\r` end a line, so progress meters become lines too); every line goes
/// to the log and to `on_line`.
pub(crate) fn run_logged(
    mut cmd: Command,
    log: &mut BuildLog,
    on_line: &mut dyn FnMut(&str),
) -> io::Result<ExitStatus> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    tracing::debug!(command = ?cmd, "running");
    let mut child = cmd.spawn()?;
    let (tx, rx) = mpsc::channel::<String>();
    let mut readers = Vec::new();
    let outs: [Option<Box<dyn Read + Send>>; 2] = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ];
    for mut out in outs.into_iter().flatten() {
        let tx = tx.clone();
        readers.push(thread::spawn(move || {
            let mut buf = [0u8; 8192];
            let mut pending: Vec<u8> = Vec::new();
            let flush = |pending: &mut Vec<u8>| {
                if !pending.is_empty() {
                    let line = strip_ansi(&String::from_utf8_lossy(pending));
                    pending.clear();
                    let _ = tx.send(line);
                }
            };
            loop {
                match out.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        for &b in &buf[..n] {
                            if b == b'\n' || b == b'\r' {
                                flush(&mut pending);
                            } else {
                                pending.push(b);
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            flush(&mut pending);
        }));
    }
    drop(tx);
    for line in rx {
        let line = line.trim_end();
        if line.trim().is_empty() {
            continue;
        }
        log.write(line);
        on_line(line);
    }
    for r in readers {
        let _ = r.join();
    }
    child.wait()
}

fn base_command(program: &Path) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    cmd.env("PATH", DEFAULT_PATH)
        .env("LC_ALL", "C.UTF-8")
        .env("DEBIAN_FRONTEND", "noninteractive");
    // A build outlives no cordon: a server stopped while it builds in the background must not
    // leave mmdebstrap writing on (SIGTERM, so that it removes its own temporary files). The
    // signal follows the spawning thread, which waits for the child to the end.
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Installs mmdebstrap with apt-get, running `apt-get update` only if the
/// first attempt fails (package lists may be missing or stale).
pub(crate) fn install_mmdebstrap(
    stages: &mut Stages<'_>,
    log: &mut BuildLog,
) -> Result<PathBuf, ImageError> {
    stages.enter(STAGE_INSTALL_TOOL);
    let manual = "run 'apt-get install mmdebstrap' as root";
    let Some(apt) = find_tool("apt-get") else {
        return Err(ImageError::MissingTool {
            tool: "mmdebstrap".into(),
            hint: "install it with your distribution's package manager (on Debian or Ubuntu: \
                   'apt-get install mmdebstrap')"
                .into(),
        });
    };
    let install = |log: &mut BuildLog, stages: &mut Stages<'_>| -> io::Result<bool> {
        let mut cmd = base_command(&apt);
        cmd.args(["install", "-y", "--no-install-recommends", "mmdebstrap"]);
        log.section("apt-get install -y --no-install-recommends mmdebstrap");
        Ok(run_logged(cmd, log, &mut |l| stages.line(l))?.success())
    };
    let failed = |e: String, log: &BuildLog| ImageError::MissingTool {
        tool: "mmdebstrap".into(),
        hint: format!(
            "installing it automatically failed ({e}; see {}): {manual} and try again",
            log.path().display()
        ),
    };
    let mut ok = install(log, stages).map_err(|e| failed(e.to_string(), log))?;
    if !ok {
        let mut cmd = base_command(&apt);
        cmd.arg("update");
        log.section("apt-get update");
        let updated = run_logged(cmd, log, &mut |l| stages.line(l))
            .map_err(|e| failed(e.to_string(), log))?;
        if !updated.success() {
            return Err(failed(describe_exit("apt-get update", updated), log));
        }
        ok = install(log, stages).map_err(|e| failed(e.to_string(), log))?;
    }
    if !ok {
        let last = log.tail().last().cloned().unwrap_or_default();
        return Err(failed(format!("apt-get install failed: {last}"), log));
    }
    find_tool("mmdebstrap").ok_or_else(|| {
        failed(
            "apt-get succeeded but mmdebstrap is still not in PATH".into(),
            log,
        )
    })
}

/// The stage list of a build, in order.
pub(crate) fn stage_names(recipe: &Recipe, install_tool: bool) -> Vec<&'static str> {
    let mut v = Vec::new();
    if install_tool {
        v.push(STAGE_INSTALL_TOOL);
    }
    v.extend([
        STAGE_PREPARING,
        STAGE_UPDATE,
        STAGE_DOWNLOAD,
        STAGE_EXTRACT,
        STAGE_ESSENTIAL,
        STAGE_INSTALL,
        recipe.customize_stage,
        STAGE_FINALIZING,
    ]);
    v
}

/// Maps an mmdebstrap status line to the stage it starts.
fn stage_of(line: &str, recipe: &Recipe) -> Option<&'static str> {
    let msg = line.strip_prefix("I: ")?;
    let table: [(&str, &'static str); 8] = [
        ("running apt-get update", STAGE_UPDATE),
        ("downloading packages", STAGE_DOWNLOAD),
        ("extracting archives", STAGE_EXTRACT),
        ("installing essential packages", STAGE_ESSENTIAL),
        ("installing remaining packages", STAGE_INSTALL),
        ("running --customize-hook", recipe.customize_stage),
        ("running special hook", recipe.customize_stage),
        ("cleaning package lists", STAGE_FINALIZING),
    ];
    table
        .iter()
        .find(|(p, _)| msg.starts_with(p))
        .map(|(_, s)| *s)
}

/// The full mmdebstrap argument list for `recipe`.
pub(crate) fn mmdebstrap_args(
    recipe: &Recipe,
    target: &Path,
    mirror: Option<&str>,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        // Root mode gives a directory with correct ownership; the store only
        // builds as root.
        "--mode=root".into(),
        "--format=directory".into(),
        format!("--variant={}", recipe.variant).into(),
        // Verbose puts apt and dpkg output on stderr line by line; the
        // default progress bars only appear on a tty.
        "--verbose".into(),
        "--aptopt=Acquire::Retries \"3\"".into(),
    ];
    let packages: Vec<&str> = recipe.packages.concat();
    if !packages.is_empty() {
        args.push(format!("--include={}", packages.join(",")).into());
    }
    for opt in recipe.dpkg_opts.iter().copied().flatten() {
        args.push(format!("--dpkgopt={opt}").into());
    }
    for hook in recipe.customize.iter().copied().flatten() {
        args.push(format!("--customize-hook={hook}").into());
    }
    // Nothing after "--" can be taken for an option, whatever the mirror says.
    args.push("--".into());
    args.push(recipe.suite.into());
    args.push(target.as_os_str().to_owned());
    if let Some(m) = mirror {
        args.push(m.into());
    }
    args
}

/// Runs mmdebstrap for `recipe` into `target` (which must be empty).
pub(crate) fn run_mmdebstrap(
    tool: &Path,
    recipe: &Recipe,
    target: &Path,
    mirror: Option<&str>,
    stages: &mut Stages<'_>,
    log: &mut BuildLog,
) -> Result<(), String> {
    stages.enter(STAGE_PREPARING);
    let args = mmdebstrap_args(recipe, target, mirror);
    let shown: Vec<String> = args
        .iter()
        .map(|a| shell_quote(&a.to_string_lossy()))
        .collect();
    log.section(&format!("{} {}", tool.display(), shown.join(" ")));
    let mut cmd = base_command(tool);
    cmd.args(&args);
    // mmdebstrap clears TMPDIR for hooks anyway; an inherited odd TMPDIR
    // only risks surprises.
    cmd.env_remove("TMPDIR");
    let status = run_logged(cmd, log, &mut |line| {
        if let Some(stage) = stage_of(line, recipe) {
            stages.enter(stage);
        }
        stages.line(line);
    })
    .map_err(|e| format!("cannot run {}: {e}", tool.display()))?;
    if status.success() {
        Ok(())
    } else {
        Err(describe_exit("mmdebstrap", status))
    }
}

/// Writes the recipe's own files into the finished rootfs. Parent
/// directories are created 0755; the build runs as root, so everything is
/// root-owned and the sandbox user can read but not change it. Paths are
/// the recipe's constants, never input, and the rootfs was just made by
/// mmdebstrap, so no component can be a planted symlink.
pub(crate) fn write_files(recipe: &Recipe, rootfs: &Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    for f in recipe.files {
        let rel = f.path.trim_start_matches('/');
        let path = rootfs.join(rel);
        let fail = |what: &str, e: io::Error| format!("cannot {what} {} in the image: {e}", f.path);
        if let Some(dir) = path.parent() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| fail("create the directory of", e))?;
        }
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(f.mode)
            .open(&path)
            .map_err(|e| fail("create", e))?;
        out.write_all(f.contents.as_bytes())
            .map_err(|e| fail("write", e))?;
        // The umask may have narrowed the mode given at creation.
        fs::set_permissions(&path, fs::Permissions::from_mode(f.mode))
            .map_err(|e| fail("set the mode of", e))?;
    }
    Ok(())
}

fn describe_exit(what: &str, status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("{what} exited with status {code}"),
        (None, Some(sig)) => format!("{what} was killed by signal {sig}"),
        _ => format!("{what} failed ({status})"),
    }
}

/// Quotes an argument for the log so the logged command can be pasted
/// into a shell to reproduce a failure.
fn shell_quote(arg: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    if !arg.is_empty() && arg.chars().all(safe) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// Picks the mirror: explicit option, then the environment, then none
/// (mmdebstrap's default, deb.debian.org).
pub(crate) fn choose_mirror(opt: Option<&str>) -> Option<String> {
    opt.map(str::to_string)
        .or_else(|| std::env::var(MIRROR_ENV).ok())
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe;

    #[test]
    fn stage_mapping() {
        let r = recipe::find("base").unwrap();
        assert_eq!(
            stage_of("I: running apt-get update...", r),
            Some(STAGE_UPDATE)
        );
        assert_eq!(
            stage_of("I: downloading packages with apt...", r),
            Some(STAGE_DOWNLOAD)
        );
        assert_eq!(
            stage_of(
                "I: running --customize-hook in shell: sh -c 'chroot \"$1\" groupadd'",
                r
            ),
            Some("creating user")
        );
        assert_eq!(
            stage_of("Get:1 http://deb.debian.org/debian bookworm InRelease", r),
            None
        );
    }

    #[test]
    fn stages_never_go_back() {
        struct Rec(Vec<(usize, usize, String)>);
        impl Progress for Rec {
            fn stage(&mut self, i: usize, t: usize, n: &str) {
                self.0.push((i, t, n.to_string()));
            }
            fn line(&mut self, _: &str) {}
        }
        let r = recipe::find("base").unwrap();
        let mut rec = Rec(Vec::new());
        let mut s = Stages::new(stage_names(r, false), &mut rec);
        s.enter(STAGE_PREPARING);
        s.enter(STAGE_DOWNLOAD);
        s.enter(STAGE_UPDATE);
        s.enter(STAGE_DOWNLOAD);
        s.enter("no such stage");
        s.enter(STAGE_FINALIZING);
        let got: Vec<usize> = rec.0.iter().map(|x| x.0).collect();
        assert_eq!(got, vec![0, 2, 7]);
        assert!(rec.0.iter().all(|x| x.1 == 8));
    }

    #[test]
    fn args_end_with_suite_target_mirror() {
        let r = recipe::find("base").unwrap();
        let a = mmdebstrap_args(r, Path::new("/x/rootfs"), Some("http://m/debian"));
        let n = a.len();
        assert_eq!(a[n - 4], "--");
        assert_eq!(a[n - 3], "bookworm");
        assert_eq!(a[n - 2], "/x/rootfs");
        assert_eq!(a[n - 1], "http://m/debian");
        assert!(a.iter().any(|x| x
            .to_string_lossy()
            .starts_with("--include=bash,coreutils,python3,")));
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("--variant=minbase"), "--variant=minbase");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn ansi_is_stripped() {
        assert_eq!(strip_ansi("\u{1b}[2Kdone"), "done");
    }
}
