//! Image store for cordon sandboxes.
//!
//! Images live under `<state>/images/<name>/`: `rootfs/` is the root
//! filesystem tree and `image.json` its [`ImageMeta`]. An image directory
//! only ever appears by an atomic rename of a finished staging directory
//! (`<state>/images/.staging-<name>-<pid>`), so a crashed build or import
//! never leaves something that looks like a valid image; leftover staging
//! directories are deleted by the next build, import or removal of the same
//! name. Operations on one name serialize on an flock of
//! `<state>/images/.lock-<name>`.
//!
//! Once in place a rootfs is never written again: sandboxes see it only
//! read-only, below an overlay.

mod build;
mod built;
mod digest;
mod error;
mod fsutil;
mod import;
mod layered;
mod layers;
mod oci;
mod pull;
mod recipe;
mod tree_tar;

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub use digest::Digest;
pub use error::ImageError;
pub use built::LayerHold;
pub use layers::LayerInfo;
pub use pull::Auth;

use build::{BuildLog, Stages};

/// Name of the metadata file inside an image directory.
const META_FILE: &str = "image.json";
/// Name of the root filesystem directory inside an image directory.
const ROOTFS_DIR: &str = "rootfs";
const STAGING_PREFIX: &str = ".staging-";

/// Receives progress of long operations (build, import), e.g. to draw a bar
/// with the current stage and the latest output line.
pub trait Progress {
    /// A new stage starts: `index` counts from 0 up to `total - 1`, in order,
    /// and stages may be skipped but are never repeated.
    fn stage(&mut self, index: usize, total: usize, name: &str);
    /// One line of output or an informational message.
    fn line(&mut self, text: &str);
    /// Bytes of one item of several going on at once (a layer being pulled): `done` of
    /// `total`, when the total is known.
    fn bytes(&mut self, _item: &str, _done: u64, _total: Option<u64>) {}
}

/// A [`Progress`] that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn stage(&mut self, _index: usize, _total: usize, _name: &str) {}
    fn line(&mut self, _text: &str) {}
}

/// Options for [`Store::build`].
#[derive(Debug, Default, Clone)]
pub struct BuildOptions {
    /// Build even if the image exists; the old image is replaced atomically
    /// only once the new one is complete.
    pub rebuild: bool,
    /// Debian mirror URL (e.g. `http://deb.debian.org/debian`). When unset,
    /// `CORDON_DEBIAN_MIRROR` is used, else mmdebstrap's default.
    pub mirror: Option<String>,
}

/// Metadata of an image, stored as `image.json` next to its rootfs.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ImageMeta {
    /// Image name (same as its directory name).
    pub name: String,
    /// When the image was built or imported (seconds since the epoch).
    pub created_unix: u64,
    /// Where it came from: `"mmdebstrap bookworm"` or `"import <file>"`.
    pub source: String,
    /// Disk usage of the rootfs in bytes.
    pub size_bytes: u64,
    /// Default environment for processes started in the image.
    pub env: Vec<(String, String)>,
    /// User that processes run as unless told otherwise (`"user"` or `"root"`).
    pub default_user: String,
    /// A service every sandbox of the image runs (absent in images built
    /// before this field existed, and in imported ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartCommand>,
    /// Digest of the recipe it was built from (absent in imported images and in images built
    /// before this field existed); see [`Store::is_stale`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe: Option<String>,
    /// The layers of an OCI image (diff_ids, bottom first), in the layer store; empty for an
    /// image that is one tree of its own (built from a recipe, or a rootfs tarball).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
    /// The working directory processes start in unless told otherwise (the image config's
    /// `WorkingDir`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// The image config's `Entrypoint` and `Cmd`: what `cordon run --image-command` runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
    /// The image config's `ExposedPorts` (`80/tcp`), recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exposed_ports: Vec<String>,
}

/// A long-running service that every sandbox of an image starts, like an
/// E2B template's start command: the code interpreter's server, say.
///
/// Whoever creates sandboxes for clients (`cordon serve`) starts it through
/// the agent right after the sandbox is up and answers the create only once
/// `ready_port` accepts connections, so a client never races the service.
/// `cordon run` does not start it: a one-shot command does not need it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct StartCommand {
    /// Program and arguments.
    pub cmd: Vec<String>,
    /// User it runs as.
    pub user: String,
    /// Working directory (default: the user's home).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Environment on top of the sandbox's.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Ready once something listens on this loopback port inside the
    /// sandbox; `None` (and no `ready_cmd`): ready as soon as it has started.
    #[serde(default)]
    pub ready_port: Option<u16>,
    /// Ready once this shell command exits 0 inside the sandbox (an E2B template's ready
    /// command, e.g. `[ -n "$(ss -Htuln sport = :8000)" ]`), run as `user`; checked when there
    /// is no `ready_port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    /// How long readiness may take before the create fails.
    pub ready_timeout_secs: u64,
    /// Whether requests to `ready_port` through `cordon serve` must carry the sandbox's access
    /// token (envd's `X-Access-Token`, or the `E2B-Traffic-Access-Token` the code-interpreter
    /// SDK sends), as a service that runs code for its callers needs. `false` opens the port to
    /// everyone who knows the sandbox id (a web app's preview, say). Absent in an image's
    /// metadata: `true`, so that a service nobody declared open is not.
    #[serde(default = "needs_token_by_default")]
    pub needs_token: bool,
}

fn needs_token_by_default() -> bool {
    true
}

/// An image in the store.
#[derive(Clone, Debug)]
pub struct Image {
    /// Image name.
    pub name: String,
    /// Absolute paths of its layer trees, bottom first (to be used read-only, stacked as
    /// overlay lower layers); one tree for an image that is not layered.
    pub layers: Vec<PathBuf>,
    /// Its metadata.
    pub meta: ImageMeta,
}

impl Image {
    /// The image's one tree, when it has exactly one layer.
    pub fn single_tree(&self) -> Option<&Path> {
        match self.layers.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }
}

/// An image's disk use as `cordon image ls` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub name: String,
    /// Bytes of all its layers.
    pub size_bytes: u64,
    /// Bytes of the layers it shares with at least one other image.
    pub shared_bytes: u64,
    /// Its layers (diff_ids, bottom first); empty for a one-tree image.
    pub layers: Vec<String>,
    pub source: String,
    pub default_user: String,
}

/// What `Store::prune` removed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Pruned {
    pub layers: usize,
    pub bytes: u64,
}

/// `12.3 MiB`.
pub(crate) fn human_size(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else if b >= 1 << 20 {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}

/// A live sandbox's hold on its image: `Store::remove` refuses while one exists. A shared
/// flock, so it is released by the kernel however the holder ends.
#[derive(Debug)]
pub struct Pin {
    _file: fs::File,
}

/// Names of the recipes [`Store::build`] accepts.
pub fn recipes() -> &'static [&'static str] {
    recipe::names()
}

/// Checks that `name` can be used as an image name:
/// `^[a-z0-9][a-z0-9._-]{0,62}$`.
pub fn validate_name(name: &str) -> Result<(), ImageError> {
    let shown = || {
        let mut s: String = name.chars().take(70).collect();
        if s.len() < name.len() {
            s.push_str("...");
        }
        s.escape_debug().to_string()
    };
    let invalid = |reason: String| {
        Err(ImageError::InvalidName {
            name: shown(),
            reason,
        })
    };
    let Some(first) = name.chars().next() else {
        return invalid("it is empty".into());
    };
    if name.len() > 63 {
        return invalid(format!("it is {} characters long", name.chars().count()));
    }
    if !(first.is_ascii_lowercase() || first.is_ascii_digit()) {
        return invalid(format!("it starts with '{}'", first.escape_debug()));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-')))
    {
        let what = if bad.is_ascii_uppercase() {
            "an uppercase letter".to_string()
        } else {
            format!("'{}'", bad.escape_debug())
        };
        return invalid(format!("it contains {what}"));
    }
    Ok(())
}

/// The image store: a directory of images under a state directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    layers: layers::LayerStore,
}

impl Store {
    /// Opens (creating it if needed) the store in `<state_dir>/images`.
    pub fn open(state_dir: &Path) -> Result<Store, ImageError> {
        let root = state_dir.join("images");
        fs::create_dir_all(&root)
            .map_err(|e| ImageError::io(format!("cannot create {}", root.display()), e))?;
        // Absolute paths keep Image::rootfs valid after a chdir and make the
        // mount-point checks during cleanup exact.
        let root = root
            .canonicalize()
            .map_err(|e| ImageError::io(format!("cannot open {}", root.display()), e))?;
        let layers = layers::LayerStore::open(state_dir)?;
        Ok(Store { root, layers })
    }

    fn image_dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// Returns the image `name`.
    pub fn get(&self, name: &str) -> Result<Image, ImageError> {
        validate_name(name)?;
        let dir = self.image_dir(name);
        let meta_path = dir.join(META_FILE);
        let text = match fs::read_to_string(&meta_path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return if fs::symlink_metadata(&dir).is_ok() {
                    Err(ImageError::Corrupt {
                        name: name.into(),
                        reason: format!("{} is missing", meta_path.display()),
                    })
                } else {
                    Err(ImageError::NotFound { name: name.into() })
                };
            }
            Err(e) => {
                return Err(ImageError::io(
                    format!("cannot read {}", meta_path.display()),
                    e,
                ))
            }
        };
        let meta: ImageMeta = serde_json::from_str(&text).map_err(|e| ImageError::Corrupt {
            name: name.into(),
            reason: format!("{} is not valid: {e}", meta_path.display()),
        })?;
        self.image_from(name, meta)
    }

    /// The image `meta` describes, checking that its trees are there.
    fn image_from(&self, name: &str, meta: ImageMeta) -> Result<Image, ImageError> {
        let corrupt = |reason: String| ImageError::Corrupt { name: name.into(), reason };
        let layers = if meta.layers.is_empty() {
            vec![self.image_dir(name).join(ROOTFS_DIR)]
        } else {
            let mut v = Vec::new();
            for l in &meta.layers {
                let d = Digest::parse(l).map_err(&corrupt)?;
                if !self.layers.has(&d) {
                    return Err(corrupt(format!("its layer {} is missing from the layer store", d.short())));
                }
                v.push(self.layers.diff_path(&d));
            }
            v
        };
        for l in &layers {
            if !fs::symlink_metadata(l).map(|m| m.is_dir()).unwrap_or(false) {
                return Err(corrupt(format!("{} is missing", l.display())));
            }
        }
        Ok(Image { name: name.into(), layers, meta })
    }

    /// Pins image `name` for a sandbox's lifetime (see [`Pin`]).
    pub fn pin(&self, name: &str) -> Result<Pin, ImageError> {
        validate_name(name)?;
        let path = self.root.join(format!(".use-{name}"));
        let file = fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(|e| ImageError::io(format!("cannot open {}", path.display()), e))?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockShared) {
            Ok(()) => Ok(Pin { _file: file }),
            Err(rustix::io::Errno::WOULDBLOCK) => Err(ImageError::InUse { name: name.into(), what: "being removed".into() }),
            Err(e) => Err(ImageError::io(format!("cannot lock {}", path.display()), e.into())),
        }
    }

    /// Disk use of every image, with the bytes each shares with others.
    pub fn usage(&self) -> Result<Vec<Usage>, ImageError> {
        let images = self.list()?;
        let mut refs: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for i in &images {
            for l in &i.meta.layers {
                *refs.entry(l.as_str()).or_default() += 1;
            }
        }
        Ok(images
            .iter()
            .map(|i| {
                let shared = i
                    .meta
                    .layers
                    .iter()
                    .filter(|l| refs.get(l.as_str()).copied().unwrap_or(0) > 1)
                    .filter_map(|l| Digest::parse(l).ok().and_then(|d| self.layers.info(&d)))
                    .map(|info| info.size_bytes)
                    .sum();
                Usage {
                    name: i.name.clone(),
                    size_bytes: i.meta.size_bytes,
                    shared_bytes: shared,
                    layers: i.meta.layers.clone(),
                    source: i.meta.source.clone(),
                    default_user: i.meta.default_user.clone(),
                }
            })
            .collect())
    }

    /// Removes every layer no image references (and interrupted unpacks). Waits for pulls and
    /// imports in progress, whose layers are not referenced yet, to finish.
    pub fn prune(&self) -> Result<Pruned, ImageError> {
        let _lock = self.layers.lock(true)?;
        self.layers.sweep();
        let keep = self.named_layers()?;
        let (layers, bytes) = self.layers.remove_except(&keep)?;
        Ok(Pruned { layers, bytes })
    }

    /// Removes those of `layers` (diff_ids) that no image names any more: what deleting one
    /// image of layers of its own (a paused sandbox's, a snapshot's) leaves behind, without
    /// touching any other unnamed layer (a build step's cache).
    pub fn remove_unnamed(&self, layers: &[String]) -> Result<Pruned, ImageError> {
        let _lock = self.layers.lock(true)?;
        let candidates: std::collections::HashSet<Digest> = layers.iter().filter_map(|l| Digest::parse(l).ok()).collect();
        let mut named = self.named_layers()?;
        // A one-tree image adopted as a layer (see `Store::layer_ids`) is named by its memo,
        // not by an image.json: a build or a capture may be about to name it.
        named.extend(self.adopted_layers());
        let keep = self.layers.all().into_iter().filter(|d| !candidates.contains(d) || named.contains(d)).collect();
        let (layers, bytes) = self.layers.remove_except(&keep)?;
        Ok(Pruned { layers, bytes })
    }

    /// Every layer some image.json names.
    fn named_layers(&self) -> Result<std::collections::HashSet<Digest>, ImageError> {
        let mut keep = std::collections::HashSet::new();
        let rd = fs::read_dir(&self.root).map_err(|e| ImageError::io(format!("cannot list {}", self.root.display()), e))?;
        for entry in rd.flatten() {
            // Every image.json, damaged images and staging ones included: a layer is only
            // removed when nothing at all names it.
            let Ok(text) = fs::read_to_string(entry.path().join(META_FILE)) else { continue };
            let Ok(meta) = serde_json::from_str::<ImageMeta>(&text) else {
                return Err(ImageError::Corrupt { name: entry.file_name().to_string_lossy().into_owned(), reason: "its image.json cannot be read, so prune cannot tell which layers it uses".into() });
            };
            keep.extend(meta.layers.iter().filter_map(|l| Digest::parse(l).ok()));
        }
        Ok(keep)
    }

    /// All images, sorted by name. Damaged images are left out (and logged);
    /// [`Store::get`] reports what is wrong with them.
    pub fn list(&self) -> Result<Vec<Image>, ImageError> {
        let rd = fs::read_dir(&self.root)
            .map_err(|e| ImageError::io(format!("cannot list {}", self.root.display()), e))?;
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry
                .map_err(|e| ImageError::io(format!("cannot list {}", self.root.display()), e))?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            // Staging dirs, locks and logs all start with '.', which no
            // valid name does.
            if validate_name(&name).is_err()
                || !entry.file_type().map(|t| t.is_dir()).unwrap_or(false)
            {
                continue;
            }
            match self.get(&name) {
                Ok(img) => out.push(img),
                Err(e) => tracing::warn!(image = %name, error = %e, "skipping damaged image"),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Deletes the image `name`.
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        validate_name(name)?;
        let _lock = self.lock(name, &mut NoProgress)?;
        self.sweep_staging(name)?;
        let dir = self.image_dir(name);
        if fs::symlink_metadata(&dir).is_err() {
            return Err(ImageError::NotFound { name: name.into() });
        }
        // Held until the image is gone, so no sandbox can pin it meanwhile.
        let _in_use = self.exclusive_use(name)?;
        // Rename first so the image disappears atomically; if the deletion
        // is interrupted the leftover is an ordinary stale staging dir.
        let trash = self.staging_dir(name);
        fs::rename(&dir, &trash)
            .map_err(|e| ImageError::io(format!("cannot remove {}", dir.display()), e))?;
        fsutil::remove_tree(&trash)
            .map_err(|e| ImageError::io(format!("cannot delete {}", trash.display()), e))
    }

    /// The exclusive side of [`Store::pin`]: fails while a sandbox runs from `name`.
    fn exclusive_use(&self, name: &str) -> Result<fs::File, ImageError> {
        let path = self.root.join(format!(".use-{name}"));
        let file = fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(|e| ImageError::io(format!("cannot open {}", path.display()), e))?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(file),
            Err(rustix::io::Errno::WOULDBLOCK) => Err(ImageError::InUse { name: name.into(), what: "in use by a running sandbox".into() }),
            Err(e) => Err(ImageError::io(format!("cannot lock {}", path.display()), e.into())),
        }
    }

    /// Whether `img` was built from a recipe that has changed since (a newer cordon ships other
    /// packages or files for it): the front ends then build it again before use, so an upgrade
    /// never runs sandboxes on an image its own recipe no longer describes. Imported images are
    /// never stale, whatever their name.
    pub fn is_stale(&self, img: &Image) -> bool {
        match recipe::find(&img.name) {
            Some(r) => img.meta.source.starts_with("mmdebstrap") && img.meta.recipe.as_deref() != Some(r.digest().as_str()),
            None => false,
        }
    }

    /// Builds the image of `recipe` (the image gets the recipe's name).
    ///
    /// If the image already exists and `opts.rebuild` is false it is
    /// returned unchanged. Building needs root and mmdebstrap, which is
    /// installed with apt-get when missing.
    pub fn build(
        &self,
        recipe: &str,
        opts: &BuildOptions,
        progress: &mut dyn Progress,
    ) -> Result<Image, ImageError> {
        let r = known_recipe(recipe)?;
        let name = r.name;
        if !opts.rebuild {
            if let Some(img) = self.cached(name, progress)? {
                self.sweep_if_idle(name);
                return Ok(img);
            }
        }
        let tool = build::find_tool("mmdebstrap");
        require_root_to_build(name, tool.is_some())?;
        let mirror = build::choose_mirror(opts.mirror.as_deref());

        let _lock = self.lock(name, progress)?;
        // Whoever held the lock before may just have built it.
        if !opts.rebuild {
            if let Some(img) = self.cached(name, progress)? {
                return Ok(img);
            }
        }
        self.sweep_staging(name)?;

        let mut log = BuildLog::create(self.root.join(format!(".build-{name}.log")))?;
        let mut stages = Stages::new(build::stage_names(r, tool.is_none()), progress);
        let tool = match tool {
            Some(t) => t,
            None => build::install_mmdebstrap(&mut stages, &mut log)?,
        };
        self.in_staging(name, |staging, rootfs| {
            build_rootfs(r, &tool, rootfs, mirror.as_deref(), &mut stages, &mut log)?;
            self.finish(name, staging, recipe_meta(r), &mut |l| {
                log.write(l);
                stages.line(l)
            })
        })
    }

    /// Imports a rootfs tarball (plain or gzip-compressed tar, e.g. the
    /// output of `docker export`) as image `name`, replacing an existing
    /// image of that name atomically once the new one is complete.
    ///
    /// Permissions, numeric ownership, xattrs, symlinks and hard links are
    /// kept (ownership and xattrs only when running as root); device nodes
    /// and FIFOs are skipped. Entries that would land outside the image are
    /// skipped (`..` paths) or make the import fail (writes through
    /// symlinks).
    pub fn import_tar(
        &self,
        name: &str,
        tarball: &Path,
        progress: &mut dyn Progress,
    ) -> Result<Image, ImageError> {
        validate_name(name)?;
        let file = open_tarball(name, tarball)?;

        let _lock = self.lock(name, progress)?;
        self.sweep_staging(name)?;
        let mut stages = Stages::new(vec!["unpacking", build::STAGE_FINALIZING], progress);
        self.in_staging(name, |staging, rootfs| {
            let summary = unpack_rootfs(name, tarball, file, rootfs, &mut stages)?;
            stages.enter(build::STAGE_FINALIZING);
            report_skipped(&summary, &mut stages);
            fsutil::ensure_mount_dirs(rootfs).map_err(|e| {
                ImageError::io(
                    format!("cannot create mount points in {}", rootfs.display()),
                    e,
                )
            })?;
            let meta = imported_meta(name, tarball, rootfs);
            self.finish(name, staging, meta, &mut |l| stages.line(l))
        })
    }

    /// Runs `fill` on a fresh staging dir for `name` and its empty rootfs;
    /// when that fails the staging dir is deleted, so a failed operation
    /// leaves nothing for the next one to sweep.
    fn in_staging(
        &self,
        name: &str,
        fill: impl FnOnce(&Path, &Path) -> Result<Image, ImageError>,
    ) -> Result<Image, ImageError> {
        let staging = self.staging_dir(name);
        let rootfs = staging.join(ROOTFS_DIR);
        let result = create_dir(&staging)
            .and_then(|()| create_dir(&rootfs))
            .and_then(|()| fill(&staging, &rootfs));
        if result.is_err() {
            self.discard(&staging);
        }
        result
    }

    /// Returns the existing image when it can be reused as is.
    fn cached(&self, name: &str, progress: &mut dyn Progress) -> Result<Option<Image>, ImageError> {
        match self.get(name) {
            Ok(img) if self.is_stale(&img) => {
                progress.line(&format!("image '{name}' was built from an older recipe: building it again"));
                Ok(None)
            }
            Ok(img) => {
                progress.line(&format!(
                    "image '{name}' is already built, reusing it (to build it again: 'cordon image build {name} --rebuild')"
                ));
                Ok(Some(img))
            }
            // A damaged image is rebuilt rather than reported.
            Err(ImageError::NotFound { .. }) | Err(ImageError::Corrupt { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes the metadata into `staging` and moves it into place as `name`.
    fn finish(
        &self,
        name: &str,
        staging: &Path,
        mut meta: ImageMeta,
        line: &mut dyn FnMut(&str),
    ) -> Result<Image, ImageError> {
        if meta.layers.is_empty() {
            let rootfs = staging.join(ROOTFS_DIR);
            meta.size_bytes = fsutil::tree_size(&rootfs)
                .map_err(|e| ImageError::io(format!("cannot measure {}", rootfs.display()), e))?;
        }
        line(&format!(
            "image size {:.1} MiB",
            meta.size_bytes as f64 / (1024.0 * 1024.0)
        ));
        let meta_path = staging.join(META_FILE);
        let json = serde_json::to_vec_pretty(&meta).expect("ImageMeta serializes");
        (|| -> io::Result<()> {
            let mut f = fs::File::create(&meta_path)?;
            f.write_all(&json)?;
            f.write_all(b"\n")?;
            f.sync_all()
        })()
        .map_err(|e| ImageError::io(format!("cannot write {}", meta_path.display()), e))?;
        // Everything must be on disk before the name appears, or a power
        // loss could leave a valid-looking image with missing file contents.
        // (A layered image's staging dir holds only its image.json, synced
        // above; its layers are the layer store's, see `LayerStore::install`.)
        if meta.layers.is_empty() {
            fsutil::syncfs(staging)
                .map_err(|e| ImageError::io(format!("cannot sync {}", staging.display()), e))?;
        }

        let dir = self.image_dir(name);
        let replaced = if fs::symlink_metadata(&dir).is_ok() {
            match fsutil::exchange(staging, &dir) {
                Ok(()) => true,
                // Filesystems without RENAME_EXCHANGE: move the old image
                // aside first (a crash in between leaves no image, never a
                // broken one).
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) => {
                    let old = self
                        .root
                        .join(format!("{STAGING_PREFIX}{name}-{}-old", std::process::id()));
                    fs::rename(&dir, &old).map_err(|e| {
                        ImageError::io(format!("cannot replace {}", dir.display()), e)
                    })?;
                    fs::rename(staging, &dir).map_err(|e| {
                        ImageError::io(format!("cannot rename {}", staging.display()), e)
                    })?;
                    fsutil::remove_tree(&old).map_err(|e| {
                        ImageError::io(format!("cannot delete {}", old.display()), e)
                    })?;
                    false
                }
                Err(e) => {
                    return Err(ImageError::io(
                        format!("cannot replace {}", dir.display()),
                        e,
                    ))
                }
            }
        } else {
            fs::rename(staging, &dir)
                .map_err(|e| ImageError::io(format!("cannot rename {}", staging.display()), e))?;
            false
        };
        let _ = fsutil::sync_dir(&self.root);
        if replaced {
            // The staging path now holds the previous image.
            fsutil::remove_tree(staging).map_err(|e| {
                ImageError::io(
                    format!("cannot delete the previous image at {}", staging.display()),
                    e,
                )
            })?;
        }
        self.image_from(name, meta)
    }

    fn staging_dir(&self, name: &str) -> PathBuf {
        self.root
            .join(format!("{STAGING_PREFIX}{name}-{}", std::process::id()))
    }

    /// Deletes a failed staging dir; failure to do so is only logged since
    /// the next operation on the name retries.
    fn discard(&self, staging: &Path) {
        if let Err(e) = fsutil::remove_tree(staging) {
            tracing::warn!(path = %staging.display(), error = %e, "cannot delete staging directory");
        }
    }

    /// Deletes stale staging dirs of `name`. Must hold the name's lock: then
    /// any staging dir of that name belongs to a process that died.
    fn sweep_staging(&self, name: &str) -> Result<(), ImageError> {
        let prefix = format!("{STAGING_PREFIX}{name}-");
        let rd = fs::read_dir(&self.root)
            .map_err(|e| ImageError::io(format!("cannot list {}", self.root.display()), e))?;
        for entry in rd.flatten() {
            let file_name = entry.file_name();
            let Some(fname) = file_name.to_str() else {
                continue;
            };
            let Some(rest) = fname.strip_prefix(&prefix) else {
                continue;
            };
            // The suffix is exactly "<pid>" or "<pid>-old"; anything else
            // belongs to a longer name sharing this prefix ("foo" vs "foo-1").
            let pid = rest.strip_suffix("-old").unwrap_or(rest);
            if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let path = entry.path();
            tracing::info!(path = %path.display(), "removing stale staging directory");
            fsutil::remove_tree(&path).map_err(|e| {
                ImageError::io(format!("cannot delete stale {}", path.display()), e)
            })?;
        }
        Ok(())
    }

    /// Deletes stale staging dirs of `name` if nobody is working on it right
    /// now; never waits, and failures only get logged, since this is
    /// housekeeping on a path that otherwise did not need the lock.
    fn sweep_if_idle(&self, name: &str) {
        let path = self.root.join(format!(".lock-{name}"));
        if let Ok(fsutil::TryLock::Acquired(_lock)) = fsutil::try_lock(&path) {
            if let Err(e) = self.sweep_staging(name) {
                tracing::warn!(image = %name, error = %e, "cannot clean up staging directories");
            }
        }
    }

    /// Takes the per-name lock, telling `progress` when it has to wait.
    fn lock(
        &self,
        name: &str,
        progress: &mut dyn Progress,
    ) -> Result<fsutil::FileLock, ImageError> {
        let path = self.root.join(format!(".lock-{name}"));
        let err = |e| ImageError::io(format!("cannot lock {}", path.display()), e);
        match fsutil::try_lock(&path).map_err(err)? {
            fsutil::TryLock::Acquired(l) => Ok(l),
            fsutil::TryLock::Busy(file) => {
                progress.line(&format!(
                    "waiting for another build, import or removal of '{name}' to finish"
                ));
                fsutil::lock_blocking(file).map_err(err)
            }
        }
    }
}

/// The recipe called `recipe`, or an error listing the known ones.
fn known_recipe(recipe: &str) -> Result<&'static recipe::Recipe, ImageError> {
    recipe::find(recipe).ok_or_else(|| ImageError::UnknownRecipe {
        recipe: recipe.escape_debug().to_string(),
        known: recipes().join(", "),
    })
}

/// Fails early without root, before taking the lock: mmdebstrap cannot
/// build then, nor can apt-get install it. A missing tool is named first
/// because it needs fixing even once the user is root.
fn require_root_to_build(name: &str, have_tool: bool) -> Result<(), ImageError> {
    if fsutil::is_root() {
        return Ok(());
    }
    if !have_tool {
        return Err(ImageError::MissingTool {
            tool: "mmdebstrap".into(),
            hint: "run 'apt-get install mmdebstrap' as root".into(),
        });
    }
    Err(ImageError::NotRoot {
        action: format!("building image '{name}'"),
    })
}

/// Fills the empty `rootfs` for recipe `r`: mmdebstrap, then the recipe's
/// own files, then the check that what the recipe needs is there.
fn build_rootfs(
    r: &recipe::Recipe,
    tool: &Path,
    rootfs: &Path,
    mirror: Option<&str>,
    stages: &mut Stages<'_>,
    log: &mut BuildLog,
) -> Result<(), ImageError> {
    build::run_mmdebstrap(tool, r, rootfs, mirror, stages, log)
        .map_err(|reason| build_failed(r.name, reason, log))?;
    stages.enter(build::STAGE_FINALIZING);
    build::write_files(r, rootfs).map_err(|reason| logged_build_failure(r.name, reason, log))?;
    let missing = missing_paths(r, rootfs);
    if !missing.is_empty() {
        let reason = format!(
            "mmdebstrap succeeded but the result lacks {}",
            missing.join(", ")
        );
        return Err(logged_build_failure(r.name, reason, log));
    }
    Ok(())
}

/// The paths of `r.must_exist` that the built `rootfs` lacks.
fn missing_paths(r: &recipe::Recipe, rootfs: &Path) -> Vec<&'static str> {
    r.must_exist
        .iter()
        .copied()
        .flatten()
        .copied()
        .filter(|p| fs::symlink_metadata(rootfs.join(p)).is_err())
        .collect()
}

fn build_failed(name: &str, reason: String, log: &BuildLog) -> ImageError {
    ImageError::BuildFailed {
        name: name.into(),
        reason,
        log: log.path().to_owned(),
        tail: log.tail(),
    }
}

/// A failure of a check after mmdebstrap: it goes into the log too, below
/// mmdebstrap's output, so the log alone tells why the build failed.
fn logged_build_failure(name: &str, reason: String, log: &mut BuildLog) -> ImageError {
    log.write(&format!("E: {reason}"));
    build_failed(name, reason, log)
}

/// The metadata of an image built from `r`, created now.
fn recipe_meta(r: &recipe::Recipe) -> ImageMeta {
    ImageMeta {
        name: r.name.into(),
        created_unix: now_unix(),
        source: format!("mmdebstrap {}", r.suite),
        size_bytes: 0,
        env: r
            .env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        default_user: r.default_user.into(),
        start: r.start.as_ref().map(|s| s.to_command()),
        recipe: Some(r.digest()),
        ..ImageMeta::empty()
    }
}

fn import_error(name: &str, tarball: &Path, reason: String) -> ImageError {
    ImageError::Import {
        name: name.into(),
        tarball: tarball.to_owned(),
        reason,
    }
}

/// Opens the tarball before the lock is taken, so a wrong path fails at
/// once instead of after waiting for another operation on `name`.
fn open_tarball(name: &str, tarball: &Path) -> Result<fs::File, ImageError> {
    let file = fs::File::open(tarball).map_err(|e| {
        let hint = if e.kind() == io::ErrorKind::NotFound {
            ": check the path"
        } else {
            ""
        };
        import_error(name, tarball, format!("cannot open it ({e}){hint}"))
    })?;
    if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(import_error(
            name,
            tarball,
            "it is a directory: pass a tar archive of a root filesystem, e.g. from 'docker export'".into(),
        ));
    }
    Ok(file)
}

/// Unpacks `file` into the empty `rootfs`; an archive without a single
/// entry is refused, since it cannot be the root filesystem asked for.
fn unpack_rootfs(
    name: &str,
    tarball: &Path,
    file: fs::File,
    rootfs: &Path,
    stages: &mut Stages<'_>,
) -> Result<import::Summary, ImageError> {
    stages.enter("unpacking");
    let summary = import::unpack(file, rootfs, stages.progress_mut())
        .map_err(|reason| import_error(name, tarball, reason))?;
    if summary.entries == 0 {
        return Err(import_error(
            name,
            tarball,
            "it contains no files: pass a tar archive of a root filesystem, e.g. from 'docker export'".into(),
        ));
    }
    Ok(summary)
}

/// Says what the unpack left out, so a missing device node or file is not
/// a mystery later.
fn report_skipped(summary: &import::Summary, stages: &mut Stages<'_>) {
    if summary.skipped_special > 0 {
        stages.line(&format!(
            "skipped {} device nodes and FIFOs (sandboxes get their own /dev)",
            summary.skipped_special
        ));
    }
    if summary.skipped_unsafe > 0 {
        stages.line(&format!(
            "skipped {} entries with paths outside the image",
            summary.skipped_unsafe
        ));
    }
}

/// The metadata of an image imported from `tarball`, created now. Its
/// processes run as `user` when the image has one, as root otherwise.
fn imported_meta(name: &str, tarball: &Path, rootfs: &Path) -> ImageMeta {
    let default_user = if import::has_user(rootfs) {
        "user"
    } else {
        "root"
    };
    ImageMeta {
        name: name.into(),
        created_unix: now_unix(),
        source: format!("import {}", tarball.display()),
        size_bytes: 0,
        env: vec![("PATH".into(), recipe::DEFAULT_PATH.into())],
        default_user: default_user.into(),
        ..ImageMeta::empty()
    }
}

impl ImageMeta {
    fn empty() -> ImageMeta {
        ImageMeta {
            name: String::new(),
            created_unix: now_unix(),
            source: String::new(),
            size_bytes: 0,
            env: Vec::new(),
            default_user: "root".into(),
            start: None,
            recipe: None,
            layers: Vec::new(),
            workdir: None,
            entrypoint: Vec::new(),
            cmd: Vec::new(),
            exposed_ports: Vec::new(),
        }
    }
}

fn create_dir(p: &Path) -> Result<(), ImageError> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .mode(0o755)
        .create(p)
        .map_err(|e| ImageError::io(format!("cannot create {}", p.display()), e))
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
