//! A read-only view of an image being built, as its sandboxes see it: the stage's layers
//! stacked in an overlay mounted on the host. COPY resolves its destination through it (so
//! `/bin` that is a symlink to `usr/bin` stays one), `COPY --from` reads another stage's files
//! from it, and `--chown=name` reads its `/etc/passwd`.
//!
//! The trees were written by sandboxes, so nothing here follows a symlink on the host's
//! terms: paths are resolved component by component against the view's own root, the way the
//! sandbox would see them, and every lookup stays below it.

use std::fs;
use std::io;
use std::os::unix::fs::symlink;
use std::path::{Component, Path, PathBuf};

/// Symlinks a path may go through before it is refused (as the kernel's ELOOP).
const MAX_LINKS: usize = 40;

/// A mounted view; unmounted and removed when dropped.
pub struct Merged {
    dir: PathBuf,
    root: PathBuf,
}

impl Merged {
    /// Mounts `layers` (bottom first) read-only under `dir`, which must not exist.
    pub fn mount(dir: &Path, layers: &[PathBuf]) -> io::Result<Merged> {
        fs::create_dir_all(dir.join("l"))?;
        let root = dir.join("root");
        fs::create_dir(&root)?;
        let view = Merged { dir: dir.to_owned(), root };
        // Short names for the layers keep the option string under the page the kernel reads
        // it into (as Docker's overlay2 driver does with its `l/` links).
        let mut lower = Vec::with_capacity(layers.len());
        for (i, l) in layers.iter().enumerate().rev() {
            let link = view.dir.join("l").join(i.to_string());
            symlink(l, &link)?;
            lower.push(link.display().to_string());
        }
        let opts = if lower.len() == 1 {
            // overlayfs wants two layers without an upper; one tree is bound instead.
            rustix::mount::mount_bind(&layers[0], &view.root)?;
            rustix::mount::mount_remount(&view.root, rustix::mount::MountFlags::BIND | rustix::mount::MountFlags::RDONLY, "")?;
            return Ok(view);
        } else {
            format!("lowerdir={}", lower.join(":"))
        };
        rustix::mount::mount("cordon-build-view", &view.root, "overlay", rustix::mount::MountFlags::RDONLY | rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV, Some(std::ffi::CString::new(opts).map_err(io::Error::other)?.as_c_str()))?;
        Ok(view)
    }

    /// The view's root on the host.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `path` (absolute, as inside the image) with every symlink resolved inside the view:
    /// relative to the root, free of symlinks, never above it. Components that do not exist
    /// are kept as they are.
    pub fn resolve(&self, path: &str) -> io::Result<PathBuf> {
        let mut out = PathBuf::new();
        let mut pending: Vec<PathBuf> = Path::new(path).components().rev().filter_map(normal).collect();
        let mut links = 0;
        while let Some(c) = pending.pop() {
            if c == Path::new("..") {
                out.pop();
                continue;
            }
            let candidate = out.join(&c);
            let on_host = self.root.join(&candidate);
            match fs::symlink_metadata(&on_host) {
                Ok(m) if m.file_type().is_symlink() => {
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(io::Error::other(format!("too many symlinks in {path}")));
                    }
                    let target = fs::read_link(&on_host)?;
                    if target.is_absolute() {
                        out = PathBuf::new();
                    }
                    pending.extend(target.components().rev().filter_map(normal));
                }
                _ => out = candidate,
            }
        }
        Ok(out)
    }

    /// The host path of `path` inside the view, resolved as [`Merged::resolve`] does.
    pub fn host_path(&self, path: &str) -> io::Result<PathBuf> {
        Ok(self.root.join(self.resolve(path)?))
    }

    /// Whether `path` names an executable file of the image.
    pub fn has_program(&self, path: &str) -> bool {
        use std::os::unix::fs::PermissionsExt;
        self.host_path(path).ok().and_then(|p| fs::metadata(p).ok()).is_some_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    }
}

/// A component as a push onto the pending stack: `.` and `/` vanish, `..` stays.
fn normal(c: Component<'_>) -> Option<PathBuf> {
    match c {
        Component::Normal(n) => Some(PathBuf::from(n)),
        Component::ParentDir => Some(PathBuf::from("..")),
        _ => None,
    }
}

impl Drop for Merged {
    fn drop(&mut self) {
        // Never a recursive removal through a view still mounted: it would reach the layers.
        match rustix::mount::unmount(&self.root, rustix::mount::UnmountFlags::DETACH) {
            Ok(()) | Err(rustix::io::Errno::INVAL) => {}
            Err(e) => {
                tracing::warn!(path = %self.root.display(), error = %e, "cannot unmount a build view");
                return;
            }
        }
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            tracing::warn!(path = %self.dir.display(), error = %e, "cannot remove a build view");
        }
    }
}
