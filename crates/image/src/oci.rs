//! Reading OCI and Docker images: an image config into [`ImageMeta`] fields, a manifest into
//! the layers to unpack, and the two on-disk forms (`docker save` archives, OCI image layouts as
//! a directory or a tar) into both. The registry form is in `pull`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use oci_spec::image::{Arch, Descriptor, ImageConfiguration, ImageIndex, ImageManifest, MediaType, Os};
use serde::Deserialize;

use crate::digest::{self, Digest};

/// Largest manifest, index or config read into memory.
const MAX_JSON: u64 = 16 << 20;

/// One layer to unpack: where its blob is and what it must hash to.
#[derive(Debug, Clone)]
pub(crate) struct LayerRef {
    /// The blob's name in its source (a path in an archive, a digest in a registry).
    pub blob: String,
    /// Digest of the blob as stored (compressed); unknown for `docker save` layers.
    pub digest: Option<Digest>,
    /// Digest of the uncompressed tar (the image config's `rootfs.diff_ids`).
    pub diff_id: Digest,
    /// Size of the blob, when the manifest says.
    pub size: Option<u64>,
}

/// What the store needs of an image config.
#[derive(Debug, Clone, Default)]
pub(crate) struct Settings {
    pub env: Vec<(String, String)>,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub exposed_ports: Vec<String>,
}

/// An image resolved to its config and layers, bottom layer first.
#[derive(Debug)]
pub(crate) struct Plan {
    pub settings: Settings,
    pub layers: Vec<LayerRef>,
}

/// A manifest's layer entry: blob name, digest, size, media type (each as far as known).
pub(crate) type LayerDesc = (String, Option<Digest>, Option<u64>, Option<MediaType>);

/// Parses an image config, checks it is for linux/amd64, and pairs its diff_ids with the
/// manifest's layer descriptors (`layers`: blob name, digest, size, media type).
pub(crate) fn plan(config: &[u8], layers: Vec<LayerDesc>) -> Result<Plan, String> {
    let cfg: ImageConfiguration = serde_json::from_slice(config).map_err(|e| format!("its image config is not valid JSON of an OCI image config ({e})"))?;
    if *cfg.os() != Os::Linux {
        return Err(format!("it is an image for {}, not linux", cfg.os()));
    }
    if *cfg.architecture() != Arch::Amd64 {
        return Err(format!("it is an image for {}, and this host runs amd64 (pull or import the linux/amd64 variant)", cfg.architecture()));
    }
    let diff_ids = cfg.rootfs().diff_ids();
    if diff_ids.len() != layers.len() {
        return Err(format!("its manifest lists {} layers but its config {} (the image is malformed)", layers.len(), diff_ids.len()));
    }
    let mut out = Vec::new();
    for ((blob, digest, size, media), diff_id) in layers.into_iter().zip(diff_ids) {
        if let Some(m) = &media {
            check_layer_media_type(m)?;
        }
        out.push(LayerRef { blob, digest, diff_id: Digest::parse(diff_id)?, size });
    }
    let c = cfg.config().clone().unwrap_or_default();
    let env = c
        .env()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
    let nonempty = |s: &Option<String>| s.clone().filter(|s| !s.is_empty());
    let settings = Settings {
        env,
        workdir: nonempty(c.working_dir()),
        user: nonempty(c.user()),
        entrypoint: c.entrypoint().clone().unwrap_or_default(),
        cmd: c.cmd().clone().unwrap_or_default(),
        exposed_ports: c.exposed_ports().clone().unwrap_or_default(),
    };
    Ok(Plan { settings, layers: out })
}

/// Layer media types cordon unpacks; everything else (foreign or non-distributable layers,
/// encrypted layers, artifacts that are not container images) is refused by name.
pub(crate) fn check_layer_media_type(m: &MediaType) -> Result<(), String> {
    match m {
        MediaType::ImageLayer | MediaType::ImageLayerGzip | MediaType::ImageLayerZstd => Ok(()),
        MediaType::Other(s) if matches!(s.as_str(), "application/vnd.docker.image.rootfs.diff.tar.gzip" | "application/vnd.docker.image.rootfs.diff.tar") => Ok(()),
        MediaType::ImageLayerNonDistributable | MediaType::ImageLayerNonDistributableGzip | MediaType::ImageLayerNonDistributableZstd => {
            Err(format!("it has a non-distributable layer ({m}), which cordon does not fetch"))
        }
        other => Err(format!("it has a layer of media type '{other}', which is not a container image layer (supported: OCI tar, tar+gzip, tar+zstd and Docker's tar.gzip)")),
    }
}

/// Manifest media types that describe one image.
pub(crate) fn is_manifest(m: &MediaType) -> bool {
    matches!(m, MediaType::ImageManifest) || matches!(m, MediaType::Other(s) if s == "application/vnd.docker.distribution.manifest.v2+json")
}

/// Manifest media types that list images per platform.
pub(crate) fn is_index(m: &MediaType) -> bool {
    matches!(m, MediaType::ImageIndex) || matches!(m, MediaType::Other(s) if s == "application/vnd.docker.distribution.manifest.list.v2+json")
}

/// The linux/amd64 entry of an index, or an error naming the platforms it has.
pub(crate) fn pick_platform(index: &ImageIndex) -> Result<&Descriptor, String> {
    let candidates: Vec<&Descriptor> = index.manifests().iter().filter(|d| is_manifest(d.media_type()) || is_index(d.media_type())).collect();
    if let Some(d) = candidates.iter().find(|d| d.platform().as_ref().is_some_and(|p| *p.os() == Os::Linux && *p.architecture() == Arch::Amd64)) {
        return Ok(d);
    }
    // An index without platforms (an OCI layout's own index.json) with exactly one image.
    if candidates.len() == 1 && candidates[0].platform().is_none() {
        return Ok(candidates[0]);
    }
    let have: Vec<String> = candidates.iter().filter_map(|d| d.platform().as_ref().map(|p| format!("{}/{}", p.os(), p.architecture()))).collect();
    Err(format!("it has no linux/amd64 image (it has: {})", if have.is_empty() { "none".to_string() } else { have.join(", ") }))
}

/// Blobs of an image on disk, by name.
pub(crate) trait Blobs {
    /// Opens the blob `name` for reading.
    fn open(&self, name: &str) -> io::Result<Box<dyn Read + Send + '_>>;
    /// Whether the blob exists.
    fn has(&self, name: &str) -> bool;

    /// Reads a small blob whole (manifests, configs).
    fn read_small(&self, name: &str) -> Result<Vec<u8>, String> {
        let mut buf = Vec::new();
        self.open(name)
            .and_then(|r| r.take(MAX_JSON + 1).read_to_end(&mut buf))
            .map_err(|e| format!("cannot read '{name}' in it ({e})"))?;
        if buf.len() as u64 > MAX_JSON {
            return Err(format!("'{name}' in it is larger than {} MiB, which no manifest or config is", MAX_JSON >> 20));
        }
        Ok(buf)
    }
}

/// Only names a well-formed image can have: relative, no `..`, no empty components.
fn safe_name(name: &str) -> io::Result<&str> {
    let name = name.strip_prefix("./").unwrap_or(name);
    if name.is_empty() || name.starts_with('/') || name.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("'{}' is not a path inside the image", name.escape_debug())));
    }
    Ok(name)
}

/// An unpacked image directory (an OCI layout).
pub(crate) struct DirBlobs(pub PathBuf);

impl Blobs for DirBlobs {
    fn open(&self, name: &str) -> io::Result<Box<dyn Read + Send + '_>> {
        let name = safe_name(name)?;
        // Never through a symlink: an image directory from elsewhere could point at host files.
        let dir = rustix::fs::open(&self.0, rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC, rustix::fs::Mode::empty())?;
        let how = rustix::fs::ResolveFlags::BENEATH | rustix::fs::ResolveFlags::NO_SYMLINKS | rustix::fs::ResolveFlags::NO_MAGICLINKS;
        let fd = rustix::fs::openat2(&dir, name, rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC, rustix::fs::Mode::empty(), how)?;
        let f = File::from(fd);
        if !f.metadata()?.is_file() {
            return Err(io::Error::other(format!("'{name}' is not a regular file")));
        }
        Ok(Box::new(f))
    }

    fn has(&self, name: &str) -> bool {
        safe_name(name).is_ok_and(|n| self.0.join(n).is_file())
    }
}

/// An uncompressed tar archive (a `docker save` or an OCI layout tar), read in place: one pass
/// over its headers finds where each member's bytes are, then members are read with `pread`.
pub(crate) struct TarBlobs {
    file: File,
    members: HashMap<String, (u64, u64)>,
}

impl TarBlobs {
    /// Indexes `file`'s regular members; `None` when it is not a plain tar.
    pub(crate) fn index(file: File) -> Result<TarBlobs, String> {
        let mut members = HashMap::new();
        {
            let mut archive = tar::Archive::new(&file);
            let entries = archive.entries_with_seek().map_err(|e| format!("it is not a tar archive ({e})"))?;
            for entry in entries {
                let entry = entry.map_err(|e| format!("it is not a valid tar archive ({e})"))?;
                if !entry.header().entry_type().is_file() {
                    continue;
                }
                let name = String::from_utf8_lossy(&entry.path_bytes()).trim_start_matches("./").to_string();
                members.insert(name, (entry.raw_file_position(), entry.size()));
            }
        }
        Ok(TarBlobs { file, members })
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.members.keys().map(String::as_str)
    }
}

struct MemberReader<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl Read for MemberReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = buf.len().min((self.end - self.pos) as usize);
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the archive ends inside a member: it is truncated"));
        }
        self.pos += n as u64;
        Ok(n)
    }
}

impl Blobs for TarBlobs {
    fn open(&self, name: &str) -> io::Result<Box<dyn Read + Send + '_>> {
        let name = safe_name(name)?;
        let &(pos, size) = self.members.get(name).ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("the archive has no member '{name}'")))?;
        Ok(Box::new(MemberReader { file: &self.file, pos, end: pos + size }))
    }

    fn has(&self, name: &str) -> bool {
        safe_name(name).is_ok_and(|n| self.members.contains_key(n))
    }
}

/// The blob path of a digest in an OCI layout.
fn blob_path(d: &Digest) -> String {
    format!("blobs/sha256/{}", d.hex())
}

fn parse_digest(d: &oci_spec::image::Digest) -> Result<Digest, String> {
    Digest::parse(d.as_ref())
}

/// Reads blob `d` whole and checks it hashes to `d`.
fn read_verified(blobs: &dyn Blobs, d: &Digest) -> Result<Vec<u8>, String> {
    let bytes = blobs.read_small(&blob_path(d))?;
    let seen = digest::of_bytes(&bytes);
    if &seen != d {
        return Err(format!("blob {} does not match its digest (got {seen}): the image is corrupt", d.short()));
    }
    Ok(bytes)
}

/// Resolves an OCI image layout: `tag` selects by `org.opencontainers.image.ref.name` when the
/// layout holds several images; indexes resolve to linux/amd64.
pub(crate) fn layout_plan(blobs: &dyn Blobs, tag: Option<&str>) -> Result<Plan, String> {
    let index: ImageIndex = serde_json::from_slice(&blobs.read_small("index.json")?).map_err(|e| format!("its index.json is not an OCI image index ({e})"))?;
    let mut desc = match tag {
        Some(t) => index
            .manifests()
            .iter()
            .find(|d| d.annotations().as_ref().and_then(|a| a.get("org.opencontainers.image.ref.name")).is_some_and(|n| n == t))
            .cloned()
            .ok_or_else(|| format!("it has no image tagged '{t}'"))?,
        None if index.manifests().len() == 1 => index.manifests()[0].clone(),
        None => pick_platform(&index)
            .cloned()
            .map_err(|e| format!("it holds {} images and {e}: name one with NAME=PATH:TAG", index.manifests().len()))?,
    };
    // Nested indexes (a multi-platform image inside a layout).
    for _ in 0..4 {
        if !is_index(desc.media_type()) {
            break;
        }
        let inner: ImageIndex = serde_json::from_slice(&read_verified(blobs, &parse_digest(desc.digest())?)?).map_err(|e| format!("an index in it is not valid ({e})"))?;
        desc = pick_platform(&inner)?.clone();
    }
    if !is_manifest(desc.media_type()) {
        return Err(format!("its image has manifest media type '{}', which is not an image manifest", desc.media_type()));
    }
    let manifest: ImageManifest = serde_json::from_slice(&read_verified(blobs, &parse_digest(desc.digest())?)?).map_err(|e| format!("its manifest is not valid ({e})"))?;
    let config = read_verified(blobs, &parse_digest(manifest.config().digest())?)?;
    let layers = manifest
        .layers()
        .iter()
        .map(|l| {
            let d = parse_digest(l.digest())?;
            Ok((blob_path(&d), Some(d), Some(l.size()), Some(l.media_type().clone())))
        })
        .collect::<Result<Vec<_>, String>>()?;
    plan(&config, layers)
}

/// One image of a `docker save` archive's `manifest.json`.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SavedImage {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// Resolves a `docker save` archive: the image tagged `tag`, or its only image. Its layers are
/// verified against the config's diff_ids (`docker save` records no compressed digests); the
/// config against the digest its file name carries.
pub(crate) fn docker_save_plan(blobs: &dyn Blobs, tag: Option<&str>) -> Result<Plan, String> {
    let saved: Vec<SavedImage> = serde_json::from_slice(&blobs.read_small("manifest.json")?).map_err(|e| format!("its manifest.json is not a docker save manifest ({e})"))?;
    let image = match tag {
        Some(t) => saved
            .iter()
            .find(|i| i.repo_tags.iter().flatten().any(|rt| rt == t || rt.rsplit_once(':').is_some_and(|(_, tg)| tg == t)))
            .ok_or_else(|| format!("it has no image tagged '{t}'"))?,
        None if saved.len() == 1 => &saved[0],
        None => return Err(format!("it holds {} images: name one with PATH:TAG", saved.len())),
    };
    let config = blobs.read_small(&image.config)?;
    // `<hex>.json` (classic) or `blobs/sha256/<hex>` (Docker 25+): either way the name is the digest.
    let stem = image.config.rsplit('/').next().unwrap_or("").trim_end_matches(".json");
    if let Ok(d) = Digest::parse(&format!("sha256:{stem}")) {
        if digest::of_bytes(&config) != d {
            return Err(format!("its config {} does not match its digest: the archive is corrupt", d.short()));
        }
    }
    plan(&config, image.layers.iter().map(|l| (l.clone(), None, None, None)).collect())
}

/// What kind of image input a file or directory is.
pub(crate) enum Input {
    /// An OCI image layout directory.
    LayoutDir(DirBlobs),
    /// An OCI image layout as a tar (it has `oci-layout` and `index.json`; a Docker 25+ save
    /// archive is one too, and is read that way).
    LayoutTar(TarBlobs),
    /// A classic `docker save` archive.
    DockerSave(TarBlobs),
    /// Anything else: a root filesystem tarball.
    Rootfs,
}

/// Tells the inputs apart by what they contain, not by their names.
pub(crate) fn detect(path: &Path) -> Result<Input, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot open it ({e}){}", if e.kind() == io::ErrorKind::NotFound { ": check the path" } else { "" }))?;
    if meta.is_dir() {
        let blobs = DirBlobs(path.to_path_buf());
        if blobs.has("index.json") {
            return Ok(Input::LayoutDir(blobs));
        }
        return Err("it is a directory but not an OCI image layout (it has no index.json): pass an OCI layout, a 'docker save' archive or a rootfs tarball".into());
    }
    let file = File::open(path).map_err(|e| format!("cannot open it ({e})"))?;
    let mut magic = [0u8; 262];
    let n = file.read_at(&mut magic, 0).map_err(|e| format!("cannot read it ({e})"))?;
    // Only an uncompressed tar can be an image archive (a compressed one is a rootfs, as from
    // `docker export | gzip`); "ustar" at 257 marks a tar.
    if n < 262 || &magic[257..262] != b"ustar" {
        return Ok(Input::Rootfs);
    }
    let blobs = TarBlobs::index(file)?;
    let names: std::collections::HashSet<&str> = blobs.names().collect();
    if names.contains("oci-layout") && names.contains("index.json") {
        Ok(Input::LayoutTar(blobs))
    } else if names.contains("manifest.json") && !names.contains("etc/passwd") {
        Ok(Input::DockerSave(blobs))
    } else {
        Ok(Input::Rootfs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(layers: usize, arch: &str) -> Vec<u8> {
        let ids: Vec<String> = (0..layers).map(|i| format!("\"sha256:{}\"", format!("{i:x}").repeat(64).chars().take(64).collect::<String>())).collect();
        format!(
            r#"{{"architecture":"{arch}","os":"linux","config":{{"Env":["PATH=/bin","A=b=c"],"User":"app","WorkingDir":"/work","Entrypoint":["/bin/sh"],"Cmd":["-c","x"],"ExposedPorts":{{"80/tcp":{{}}}}}},"rootfs":{{"type":"layers","diff_ids":[{}]}}}}"#,
            ids.join(",")
        )
        .into_bytes()
    }

    #[test]
    fn config_settings_are_read() {
        let p = plan(&config(1, "amd64"), vec![("l".into(), None, None, Some(MediaType::ImageLayerGzip))]).unwrap();
        assert_eq!(p.settings.env, vec![("PATH".into(), "/bin".into()), ("A".into(), "b=c".into())]);
        assert_eq!(p.settings.user.as_deref(), Some("app"));
        assert_eq!(p.settings.workdir.as_deref(), Some("/work"));
        assert_eq!(p.settings.entrypoint, vec!["/bin/sh"]);
        assert_eq!(p.settings.cmd, vec!["-c", "x"]);
        assert_eq!(p.settings.exposed_ports, vec!["80/tcp"]);
        assert_eq!(p.layers.len(), 1);
    }

    #[test]
    fn wrong_images_are_refused_by_name() {
        let e = plan(&config(1, "arm64"), vec![("l".into(), None, None, None)]).unwrap_err();
        assert!(e.contains("arm64"), "{e}");
        let e = plan(&config(2, "amd64"), vec![("l".into(), None, None, None)]).unwrap_err();
        assert!(e.contains("2"), "{e}");
        let e = plan(&config(1, "amd64"), vec![("l".into(), None, None, Some(MediaType::Other("application/vnd.cncf.helm.chart.content.v1.tar+gzip".into())))]).unwrap_err();
        assert!(e.contains("helm"), "{e}");
        let e = plan(b"not json", vec![]).unwrap_err();
        assert!(e.contains("not valid"), "{e}");
    }

    #[test]
    fn archive_names_cannot_leave() {
        for bad in ["../x", "/etc/passwd", "a//b", "a/../b", ""] {
            assert!(safe_name(bad).is_err(), "{bad}");
        }
        assert_eq!(safe_name("./blobs/sha256/ab").unwrap(), "blobs/sha256/ab");
    }
}
