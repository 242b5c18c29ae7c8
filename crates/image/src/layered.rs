//! The store's doors for OCI images: `import` of an image archive or layout, and `pull` from a
//! registry. Both end the same way: every layer unpacked into the layer store (verified), then
//! the image's `image.json`, naming its layers, moved into place in one rename. The layer store
//! is held shared from the first layer to that rename, so a prune cannot take a layer an image
//! is about to name.

use std::path::Path;

use crate::layers::Expect;
use crate::oci::{self, Blobs, Input, Plan};
use crate::pull::{self, Auth, Target};
use crate::{now_unix, validate_name, Image, ImageError, ImageMeta, Progress, Store};

impl Store {
    /// Imports `path` as image `name`: an OCI image layout (directory or tar), a `docker save`
    /// archive, or a root filesystem tarball (told apart by their contents). `tag` picks one
    /// image of an archive that holds several.
    pub fn import(&self, name: &str, path: &Path, tag: Option<&str>, progress: &mut dyn Progress) -> Result<Image, ImageError> {
        validate_name(name)?;
        let err = |reason: String| ImageError::Import { name: name.into(), tarball: path.to_owned(), reason };
        let (blobs, plan): (Box<dyn Blobs>, Result<Plan, String>) = match oci::detect(path).map_err(err)? {
            Input::Rootfs => return self.import_tar(name, path, progress),
            Input::LayoutDir(b) => {
                let p = oci::layout_plan(&b, tag);
                (Box::new(b), p)
            }
            Input::LayoutTar(b) => {
                let p = oci::layout_plan(&b, tag);
                (Box::new(b), p)
            }
            Input::DockerSave(b) => {
                let p = oci::docker_save_plan(&b, tag);
                (Box::new(b), p)
            }
        };
        let plan = plan.map_err(err)?;
        let _store = self.layers.lock(false)?;
        self.layers.sweep();
        let total = plan.layers.len();
        let mut pending = Vec::new();
        for (i, l) in plan.layers.iter().enumerate() {
            let label = format!("layer {}/{total} {}", i + 1, l.diff_id.short());
            // The same layer twice in one image is unpacked once, as in a pull.
            if self.layers.has(&l.diff_id) || pending.iter().any(|p: &crate::layers::Pending| p.info.diff_id == l.diff_id.as_str()) {
                progress.line(&format!("{label}: already present"));
                continue;
            }
            progress.stage(i, total, &label);
            let reader = blobs.open(&l.blob).map_err(|e| err(format!("{label}: cannot read '{}' in it ({e})", l.blob)))?;
            pending.push(
                self.layers
                    .unpack_pending(reader, &Expect { digest: l.digest.as_ref(), diff_id: &l.diff_id }, &mut crate::NoProgress)
                    .map_err(|e| err(format!("{label}: {e}")))?,
            );
        }
        self.layers.install(pending).map_err(err)?;
        self.commit_layered(name, &plan, format!("import {}", path.display()), progress)
    }

    /// Pulls `reference` from its registry as image `name` (default: the repository's last
    /// component, with `-<tag>` for a tag other than `latest`).
    pub fn pull(&self, reference: &str, name: Option<&str>, auth: &Auth, progress: &mut dyn Progress) -> Result<Image, ImageError> {
        let perr = |reason: String| ImageError::Pull { reference: reference.escape_debug().to_string(), reason };
        let target = Target::parse(reference).map_err(perr)?;
        let name = match name {
            Some(n) => n.to_string(),
            None => target.default_name(),
        };
        validate_name(&name)?;
        let _store = self.layers.lock(false)?;
        self.layers.sweep();
        let pulled = pull::pull(&self.layers, &target, auth, progress).map_err(perr)?;
        if pulled.fetched == 0 {
            progress.line("every layer was already present");
        }
        self.commit_layered(&name, &pulled.plan, format!("pull {} ({})", target.reference, pulled.manifest_digest), progress)
    }

    /// Names a layered image whose layers are all in the store as `name`, with its config.
    fn commit_layered(&self, name: &str, plan: &Plan, source: String, progress: &mut dyn Progress) -> Result<Image, ImageError> {
        let s = &plan.settings;
        let meta = ImageMeta {
            name: name.into(),
            created_unix: now_unix(),
            source,
            size_bytes: 0,
            env: if s.env.is_empty() { vec![("PATH".into(), crate::recipe::DEFAULT_PATH.into())] } else { s.env.clone() },
            // OCI's default user is root.
            default_user: s.user.clone().unwrap_or_else(|| "root".into()),
            start: None,
            recipe: None,
            layers: plan.layers.iter().map(|l| l.diff_id.to_string()).collect(),
            workdir: s.workdir.clone(),
            entrypoint: s.entrypoint.clone(),
            cmd: s.cmd.clone(),
            exposed_ports: s.exposed_ports.clone(),
        };
        self.commit(name, meta, progress)
    }
}
