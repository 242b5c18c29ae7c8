//! `--copy HOST:SANDBOX`: a host file or tree copied into the sandbox through the agent's file
//! API, before the command starts.
//!
//! cordon reads the host tree as root while other host processes may change it, so no entry
//! below the named path is ever reached by path: each is opened relative to its parent
//! directory's descriptor with `O_NOFOLLOW` (a single name, so no other component resolves),
//! and what was opened is checked on the descriptor (`fstat`: same inode as the entry listed,
//! still a regular file or a directory). An entry swapped for a symlink between the listing and
//! the open fails with `ELOOP` and is looked at again; a symlink is copied as a symlink (its
//! target text), never followed, so a link to a host file never brings the file in. FIFOs,
//! sockets and device nodes are skipped without being opened. The named path itself is
//! resolved as the operator wrote it.

use anyhow::{bail, Context, Result};
use cordon_envd::EnvdClient;
use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;
use std::ffi::{CStr, CString};
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// How often an entry that changes kind between its stat and its open is looked at again
/// before the copy gives up on it.
const RETRIES: usize = 16;

/// Symlinks made per process in the sandbox (each is two arguments).
const LINKS_PER_PROCESS: usize = 256;

/// One entry of the host tree, as opened.
enum Entry {
    File(OwnedFd),
    Dir(OwnedFd),
    Link(String),
    /// Not a regular file, directory or symlink, or gone since it was listed.
    Skip,
}

/// Copies `host` (a file or a directory tree) to `dest` in the sandbox as `user`.
pub async fn copy_in(client: &EnvdClient, host: &Path, dest: &str, user: Option<&str>) -> Result<()> {
    let fd = rustix::fs::open(host, read_flags(), Mode::empty()).with_context(|| format!("--copy: open {}", host.display()))?;
    let st = rustix::fs::fstat(&fd).with_context(|| format!("--copy: stat {}", host.display()))?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => upload(client, fd, dest, user).await,
        FileType::Directory => copy_tree(client, fd, host, dest.trim_end_matches('/'), user).await,
        _ => bail!("--copy: {} is neither a file nor a directory", host.display()),
    }
}

fn read_flags() -> OFlags {
    // NONBLOCK: an entry swapped for a FIFO must not hang the copy at its open.
    OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK
}

async fn upload(client: &EnvdClient, fd: OwnedFd, dest: &str, user: Option<&str>) -> Result<()> {
    let mut data = Vec::new();
    std::fs::File::from(fd).read_to_end(&mut data).with_context(|| format!("--copy: read the file for {dest}"))?;
    client.upload_file(dest, user, data.into()).await.with_context(|| format!("--copy: write {dest} in the sandbox"))?;
    Ok(())
}

/// A directory being walked: its descriptor, the names still to copy, and where it goes.
struct Frame {
    dir: OwnedFd,
    names: Vec<CString>,
    target: String,
}

fn frame(dir: OwnedFd, host: &dyn std::fmt::Display, target: String) -> Result<Frame> {
    let mut names = Vec::new();
    for e in Dir::read_from(&dir).with_context(|| format!("--copy: list {host}"))? {
        let e = e.with_context(|| format!("--copy: list {host}"))?;
        let n = e.file_name();
        if n != c"." && n != c".." {
            names.push(n.to_owned());
        }
    }
    Ok(Frame { dir, names, target })
}

/// Walks the tree depth-first, holding one descriptor per level (not per directory seen).
async fn copy_tree(client: &EnvdClient, top: OwnedFd, host: &Path, dest: &str, user: Option<&str>) -> Result<()> {
    make_dir(client, dest, user).await?;
    let mut stack = vec![frame(top, &host.display(), dest.to_string())?];
    let mut links = Vec::new();
    while let Some(f) = stack.last_mut() {
        let Some(name) = f.names.pop() else {
            stack.pop();
            continue;
        };
        let t = format!("{}/{}", f.target, name.to_string_lossy());
        match open_entry(f.dir.as_fd(), &name).with_context(|| format!("--copy: open the host entry for {t}"))? {
            Entry::File(fd) => upload(client, fd, &t, user).await?,
            Entry::Dir(fd) => {
                make_dir(client, &t, user).await?;
                let next = frame(fd, &t, t.clone())?;
                stack.push(next);
            }
            Entry::Link(target) => links.push((target, t)),
            Entry::Skip => {}
        }
    }
    make_links(client, &links, user).await
}

/// Opens `name` in `dir` without following a symlink, and checks on the descriptor that it is
/// the entry just looked at.
fn open_entry(dir: BorrowedFd<'_>, name: &CStr) -> std::io::Result<Entry> {
    for _ in 0..RETRIES {
        let st = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(Entry::Skip),
            Err(e) => return Err(e.into()),
        };
        let kind = FileType::from_raw_mode(st.st_mode);
        let flags = match kind {
            FileType::Symlink => match rustix::fs::readlinkat(dir, name, Vec::new()) {
                Ok(target) => return Ok(Entry::Link(target.to_string_lossy().into_owned())),
                // No longer a symlink: look again.
                Err(Errno::INVAL) => continue,
                Err(Errno::NOENT) => return Ok(Entry::Skip),
                Err(e) => return Err(e.into()),
            },
            FileType::RegularFile => read_flags() | OFlags::NOFOLLOW,
            FileType::Directory => read_flags() | OFlags::NOFOLLOW | OFlags::DIRECTORY,
            _ => return Ok(Entry::Skip),
        };
        let fd = match rustix::fs::openat(dir, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            // Swapped for a symlink (ELOOP) or for a non-directory (ENOTDIR) since the stat.
            Err(Errno::LOOP | Errno::NOTDIR) => continue,
            Err(Errno::NOENT) => return Ok(Entry::Skip),
            Err(e) => return Err(e.into()),
        };
        if same_entry(&st, &rustix::fs::fstat(&fd)?) {
            return Ok(if kind == FileType::Directory { Entry::Dir(fd) } else { Entry::File(fd) });
        }
    }
    Err(std::io::Error::other(format!("it kept changing while it was copied ({RETRIES} tries)")))
}

fn same_entry(listed: &Stat, opened: &Stat) -> bool {
    listed.st_dev == opened.st_dev
        && listed.st_ino == opened.st_ino
        && FileType::from_raw_mode(listed.st_mode) == FileType::from_raw_mode(opened.st_mode)
}

async fn make_dir(client: &EnvdClient, dest: &str, user: Option<&str>) -> Result<()> {
    match client.make_dir(dest, user).await {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some(cordon_envd::Code::AlreadyExists) => Ok(()),
        Err(e) => Err(e).with_context(|| format!("--copy: make directory {dest} in the sandbox")),
    }
}

/// Makes the tree's symlinks in the sandbox, as `user`, after every directory exists. The file
/// API has no call for a symlink, so `ln` inside does it, many per process.
async fn make_links(client: &EnvdClient, links: &[(String, String)], user: Option<&str>) -> Result<()> {
    use cordon_envd::process::{ProcessConfig, StartRequest};
    const SCRIPT: &str = r#"while [ "$#" -ge 2 ]; do ln -sfn -- "$1" "$2" || exit 1; shift 2; done"#;
    for chunk in links.chunks(LINKS_PER_PROCESS) {
        let mut args = vec!["-c".to_string(), SCRIPT.to_string(), "sh".to_string()];
        for (target, path) in chunk {
            args.push(target.clone());
            args.push(path.clone());
        }
        let req = StartRequest {
            process: Some(ProcessConfig { cmd: "/bin/sh".to_string(), args, envs: Default::default(), cwd: None }),
            pty: None,
            tag: None,
            stdin: Some(false),
        };
        let out = client.start(req, user, None).await.context("--copy: start ln in the sandbox to make symlinks")?;
        let out = out.collect().await.context("--copy: make symlinks in the sandbox")?;
        if !out.end.as_ref().is_some_and(|e| e.exited && e.exit_code == 0) {
            bail!(
                "--copy: could not make symlinks in the sandbox (the image needs /bin/sh and ln): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    Ok(())
}
