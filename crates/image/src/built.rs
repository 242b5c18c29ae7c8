//! The store's door for images built here (`cordon image build`, E2B template builds): layers
//! made from trees and tars, kept by the same confined unpack as a pulled layer, and an image
//! that names them.
//!
//! A build does not flatten anything: a one-tree image it starts from (`base`, built from a
//! recipe) is adopted once as a layer of the layer store ([`Store::tree_layer`], remembered per
//! image version under `layers/trees/`), every step's files become one more layer on top, and
//! layers are shared with every other image and build that has them.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::tree_tar::{self, TreeKind};
use crate::{fsutil, Image, ImageError, ImageMeta, Progress, Store, META_FILE};

/// The shared hold on the layer store a build keeps for its whole run, so that a prune cannot
/// remove a layer the build made and is about to name (see `Store::prune`).
pub struct LayerHold {
    _lock: crate::layers::StoreLock,
}

/// What `layers/trees/<image>.json` remembers of an adopted one-tree image.
#[derive(Serialize, Deserialize)]
struct Adopted {
    created_unix: u64,
    source: String,
    diff_id: String,
}

impl Store {
    /// Holds the layer store shared until dropped (see [`LayerHold`]).
    pub fn hold_layers(&self) -> Result<LayerHold, ImageError> {
        let lock = self.layers.lock(false)?;
        self.layers.sweep();
        Ok(LayerHold { _lock: lock })
    }

    /// The image's layers as diff_ids, bottom first: a layered image's own, or for a one-tree
    /// image the diff_id of its tree adopted as a layer (made the first time).
    pub fn layer_ids(&self, img: &Image, progress: &mut dyn Progress) -> Result<Vec<String>, ImageError> {
        if !img.meta.layers.is_empty() {
            return Ok(img.meta.layers.clone());
        }
        Ok(vec![self.tree_layer(img, progress)?])
    }

    /// Writes layer `diff_id` as a layer tar (overlay whiteouts as OCI `.wh.` entries, owners
    /// as stored) to `out`: what another node of a cluster unpacks into its own store with
    /// [`Store::receive_layer`].
    pub fn send_layer(&self, diff_id: &str, out: impl io::Write) -> Result<(), ImageError> {
        let err = |reason: String| ImageError::Layer { what: format!("layer {diff_id}"), reason };
        let d = Digest::parse(diff_id).map_err(err)?;
        if !self.layers.has(&d) {
            return Err(err("it is not in the store".into()));
        }
        // Its owners are a sandbox's already (0-65535), so the upper tree's shift is by 0.
        tree_tar::write(&self.layers.diff_path(&d), TreeKind::Upper { uid_base: 0 }, out).map(drop).map_err(|e| err(format!("cannot write it: {e}")))
    }

    /// Unpacks a layer tar another node sent, with the same confined unpack as a pulled layer's,
    /// and returns its diff_id here: the digest of what arrived. Hold the layers
    /// ([`Store::hold_layers`]) until an image names it.
    pub fn receive_layer(&self, input: impl Read) -> Result<String, ImageError> {
        let err = |reason: String| ImageError::Layer { what: "a layer from another node".into(), reason };
        let pending = self.layers.unpack_new(input, &mut crate::NoProgress).map_err(err)?;
        let id = pending.info.diff_id.clone();
        self.layers.install(vec![pending]).map_err(err)?;
        Ok(id)
    }

    /// The layers one-tree images were adopted as (`layers/trees/*.json`).
    pub(crate) fn adopted_layers(&self) -> Vec<Digest> {
        let Ok(rd) = fs::read_dir(self.layers.root().join("trees")) else { return Vec::new() };
        rd.flatten()
            .filter_map(|e| fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice::<Adopted>(&b).ok())
            .filter_map(|a| Digest::parse(&a.diff_id).ok())
            .collect()
    }

    /// The size of layer `diff_id` unpacked, if the store has it.
    pub fn layer_size(&self, diff_id: &str) -> Option<u64> {
        let d = Digest::parse(diff_id).ok()?;
        self.layers.info(&d).map(|i| i.size_bytes)
    }

    /// The tree of layer `diff_id`, if the store has it.
    pub fn layer_path(&self, diff_id: &str) -> Option<PathBuf> {
        let d = Digest::parse(diff_id).ok()?;
        self.layers.has(&d).then(|| self.layers.diff_path(&d))
    }

    /// A one-tree image's tree as a layer (written as a tar and unpacked like any layer, so it
    /// obeys the layer store's rules: no set-uid bits, no devices).
    fn tree_layer(&self, img: &Image, progress: &mut dyn Progress) -> Result<String, ImageError> {
        let tree = img.single_tree().ok_or_else(|| ImageError::Layer { what: format!("image '{}'", img.name), reason: "it has no tree of its own".into() })?;
        let dir = self.layers.root().join("trees");
        let memo = dir.join(format!("{}.json", img.name));
        if let Ok(text) = fs::read_to_string(&memo) {
            if let Ok(a) = serde_json::from_str::<Adopted>(&text) {
                if a.created_unix == img.meta.created_unix && a.source == img.meta.source && self.layer_path(&a.diff_id).is_some() {
                    return Ok(a.diff_id);
                }
            }
        }
        progress.line(&format!("making image '{}' a layer (once per version of it)", img.name));
        let diff_id = self.layer_from_tree(tree, TreeKind::Plain, &format!("image '{}'", img.name))?
            .ok_or_else(|| ImageError::Layer { what: format!("image '{}'", img.name), reason: "its tree is empty".into() })?;
        let a = Adopted { created_unix: img.meta.created_unix, source: img.meta.source.clone(), diff_id: diff_id.clone() };
        let write = || -> io::Result<()> {
            fs::create_dir_all(&dir)?;
            let tmp = dir.join(format!(".{}.{}", img.name, std::process::id()));
            fs::write(&tmp, serde_json::to_vec(&a).expect("serializes"))?;
            fs::rename(&tmp, &memo)
        };
        // Only a cache: without it the next build adopts the tree again (the same diff_id).
        if let Err(e) = write() {
            tracing::warn!(path = %memo.display(), error = %e, "cannot remember an adopted image tree");
        }
        Ok(diff_id)
    }

    /// The upper directory of a build step's overlay (written by a sandbox whose uid 0 is host
    /// uid `uid_base`) as a layer; `None` when the step changed no file.
    pub fn layer_from_upper(&self, upper: &Path, uid_base: u32) -> Result<Option<String>, ImageError> {
        self.layer_from_tree(upper, TreeKind::Upper { uid_base }, "the step's files")
    }

    /// A layer tar (plain, gzip or zstd) as a layer, its diff_id what it turns out to be.
    pub fn layer_from_tar(&self, tar: impl Read, what: &str) -> Result<String, ImageError> {
        let pending = self.layers.unpack_new(tar, &mut crate::NoProgress).map_err(|reason| ImageError::Layer { what: what.into(), reason })?;
        let id = pending.info.diff_id.clone();
        self.layers.install(vec![pending]).map_err(|reason| ImageError::Layer { what: what.into(), reason })?;
        Ok(id)
    }

    fn layer_from_tree(&self, tree: &Path, kind: TreeKind, what: &str) -> Result<Option<String>, ImageError> {
        let err = |reason: String| ImageError::Layer { what: what.into(), reason };
        if tree_tar::is_empty(tree).map_err(|e| err(format!("cannot read {}: {e}", tree.display())))? {
            return Ok(None);
        }
        // The tar streams through a pipe into the unpack: no copy of it on disk.
        let (reader, writer) = io::pipe().map_err(|e| err(format!("cannot make a pipe: {e}")))?;
        let root = tree.to_owned();
        let producer = std::thread::spawn(move || tree_tar::write(&root, kind, io::BufWriter::with_capacity(1 << 16, writer)));
        let unpacked = self.layers.unpack_new(reader, &mut crate::NoProgress);
        let written = producer.join().unwrap_or_else(|_| Err(io::Error::other("the tar writer panicked")));
        // A write error explains a broken unpack better than the unpack's own error does.
        written.map_err(|e| err(format!("cannot read {}: {e}", tree.display())))?;
        let pending = unpacked.map_err(err)?;
        let id = pending.info.diff_id.clone();
        self.layers.install(vec![pending]).map_err(err)?;
        Ok(Some(id))
    }

    /// Writes the image.json of an image whose layers are all in the store and moves it into
    /// place as `name` (replacing an image of that name atomically).
    pub fn commit(&self, name: &str, mut meta: ImageMeta, progress: &mut dyn Progress) -> Result<Image, ImageError> {
        crate::validate_name(name)?;
        let corrupt = |reason: String| ImageError::Layer { what: format!("image '{name}'"), reason };
        let mut size = 0;
        for l in &meta.layers {
            let d = Digest::parse(l).map_err(corrupt)?;
            let info = self.layers.info(&d).ok_or_else(|| corrupt(format!("its layer {} is not in the store", d.short())))?;
            size += info.size_bytes;
        }
        meta.name = name.into();
        meta.size_bytes = size;
        let _lock = self.lock(name, progress)?;
        self.sweep_staging(name)?;
        let staging = self.staging_dir(name);
        let result = crate::create_dir(&staging).and_then(|()| {
            let path = staging.join(META_FILE);
            let json = serde_json::to_vec_pretty(&meta).expect("ImageMeta serializes");
            (|| -> io::Result<()> {
                use std::io::Write;
                let mut f = fs::File::create(&path)?;
                f.write_all(&json)?;
                f.write_all(b"\n")?;
                f.sync_all()
            })()
            .map_err(|e| ImageError::io(format!("cannot write {}", path.display()), e))?;
            self.finish(name, &staging, meta, &mut |l| progress.line(l))
        });
        if result.is_err() {
            self.discard(&staging);
        }
        let _ = fsutil::sync_dir(&self.root);
        result
    }
}
