//! The image's CA bundle, read from its layers on the host to add the egress CA to it.

use std::io::Read;
use std::path::PathBuf;

/// The largest bundle read (Debian's is about 200 KiB).
const MAX_BUNDLE: u64 = 4 << 20;

/// The bundle at `cordon_host::trust::BUNDLE` in the topmost layer that has it. Each layer is
/// opened as its own root (`RESOLVE_IN_ROOT`): a symlink in the image resolves inside that
/// layer, never to a host file, and one that leads out of the layer reads as absent.
pub fn image_bundle(layers: &[PathBuf]) -> Option<Vec<u8>> {
    use rustix::fs::{openat2, Mode, OFlags, ResolveFlags};
    let inside = cordon_host::trust::BUNDLE.trim_start_matches('/');
    for layer in layers.iter().rev() {
        let Ok(root) = rustix::fs::open(layer, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()) else { continue };
        let how = ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV;
        let Ok(fd) = openat2(&root, inside, OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK, Mode::empty(), how) else { continue };
        let f = std::fs::File::from(fd);
        if !f.metadata().is_ok_and(|m| m.is_file()) {
            continue;
        }
        let mut v = Vec::new();
        if f.take(MAX_BUNDLE).read_to_end(&mut v).is_ok() {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn topmost_layer_wins_and_symlinks_stay_inside() {
        let base = std::env::temp_dir().join(format!("cordon-trust-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let (low, high) = (base.join("low"), base.join("high"));
        for l in [&low, &high] {
            fs::create_dir_all(l.join("etc/ssl/certs")).unwrap();
        }
        fs::write(low.join("etc/ssl/certs/ca-certificates.crt"), "low").unwrap();
        assert_eq!(image_bundle(&[low.clone(), high.clone()]).as_deref(), Some(&b"low"[..]));
        // A link to a host file, from the top layer: resolved inside the layer, so not found
        // there, and the lower layer's bundle is read instead.
        let secret = base.join("host-secret");
        fs::write(&secret, "host").unwrap();
        std::os::unix::fs::symlink(&secret, high.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
        assert_eq!(image_bundle(&[low.clone(), high.clone()]).as_deref(), Some(&b"low"[..]));
        fs::remove_file(high.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
        fs::write(high.join("etc/ssl/certs/ca-certificates.crt"), "high").unwrap();
        assert_eq!(image_bundle(&[low, high]).as_deref(), Some(&b"high"[..]));
        fs::remove_dir_all(&base).unwrap();
    }
}
