//! Unpacking rootfs tarballs.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use crate::Progress;

/// Compression detected from the first bytes of a tarball.
#[derive(Debug, PartialEq, Eq)]
enum Compression {
    None,
    Gzip,
    /// Recognized but not supported: the name of the tool that decompresses it.
    Unsupported(&'static str, &'static str),
}

fn detect(magic: &[u8]) -> Compression {
    if magic.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if magic.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
        Compression::Unsupported("xz", "xz -d")
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Unsupported("zstd", "zstd -d")
    } else if magic.starts_with(b"BZh") {
        Compression::Unsupported("bzip2", "bunzip2")
    } else {
        Compression::None
    }
}

/// What an unpack did, for progress reporting.
#[derive(Debug, Default)]
pub(crate) struct Summary {
    pub entries: u64,
    pub skipped_special: u64,
    pub skipped_unsafe: u64,
}

const ADVICE: &str =
    "pass a tar archive of a root filesystem (uncompressed or gzip), e.g. from 'docker export'";

/// Unpacks `file` into the (empty) directory `rootfs`.
///
/// Errors are returned as user-facing reasons (they end up in
/// `ImageError::Import`).
pub(crate) fn unpack(
    file: File,
    rootfs: &Path,
    progress: &mut dyn Progress,
) -> Result<Summary, String> {
    let mut reader = BufReader::with_capacity(1 << 16, file);
    let magic = reader
        .fill_buf()
        .map_err(|e| format!("cannot read it: {e}"))?
        .to_vec();
    if magic.is_empty() {
        return Err(format!("the file is empty: {ADVICE}"));
    }
    let input: Box<dyn Read> = match detect(&magic) {
        Compression::None => Box::new(reader),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(reader)),
        Compression::Unsupported(kind, tool) => {
            return Err(format!(
                "it is {kind}-compressed, which is not supported: decompress it first \
                 (e.g. '{tool} FILE') and import the plain .tar"
            ))
        }
    };
    unpack_tar(input, rootfs, progress)
}

fn unpack_tar(
    input: Box<dyn Read>,
    rootfs: &Path,
    progress: &mut dyn Progress,
) -> Result<Summary, String> {
    let root = crate::fsutil::is_root();
    let mut archive = tar::Archive::new(input);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    // Numeric ownership and security xattrs (file capabilities) can only be
    // applied as root; an unprivileged import keeps the caller's ownership.
    archive.set_preserve_ownerships(root);
    archive.set_unpack_xattrs(root);
    archive.set_mask(0);

    let mut summary = Summary::default();
    // Directories are applied last (deepest first), as tar::Archive::unpack
    // does, so a read-only directory mode cannot block its own contents.
    let mut dirs = Vec::new();
    let entries = archive
        .entries()
        .map_err(|e| format!("cannot read it: {e}"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| {
            if summary.entries == 0 {
                format!(
                    "it is not a valid tar archive ({}): {ADVICE}",
                    clip(&e.to_string())
                )
            } else {
                format!(
                    "the archive is damaged after {} entries ({}): check that the file is complete",
                    summary.entries,
                    clip(&e.to_string())
                )
            }
        })?;
        let kind = entry.header().entry_type();
        let path = clip(&String::from_utf8_lossy(&entry.path_bytes()));
        // The archive's own root ("./") carries nothing worth counting; an
        // archive with only that is as empty as one with no entries.
        if path.split('/').any(|c| !c.is_empty() && c != ".") {
            summary.entries += 1;
        }
        // Device nodes and FIFOs are skipped: every sandbox gets a fresh
        // /dev with exactly the devices it may use, and a device node inside
        // an image would be a way around that.
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            summary.skipped_special += 1;
            continue;
        }
        if kind.is_dir() {
            dirs.push(entry);
            continue;
        }
        progress.line(&path);
        // unpack_in refuses absolute and `..` paths (returns false), checks
        // that the parent directory, symlinks resolved, is still inside
        // `rootfs`, never writes through an existing symlink (it unlinks and
        // recreates), and checks hard link targets the same way. So a symlink
        // in the archive cannot be used to write outside the image.
        let inside = entry
            .unpack_in(rootfs)
            .map_err(|e| unpack_error(&path, &e))?;
        if !inside {
            summary.skipped_unsafe += 1;
            progress.line(&format!("skipped '{path}': it points outside the image"));
        }
    }
    dirs.sort_by(|a, b| b.path_bytes().cmp(&a.path_bytes()));
    for mut dir in dirs {
        let path = clip(&String::from_utf8_lossy(&dir.path_bytes()));
        let inside = dir.unpack_in(rootfs).map_err(|e| unpack_error(&path, &e))?;
        if !inside {
            summary.skipped_unsafe += 1;
            progress.line(&format!("skipped '{path}': it points outside the image"));
        }
    }
    Ok(summary)
}

pub(crate) fn unpack_error(path: &str, e: &io::Error) -> String {
    let chain = error_chain(e);
    if chain.contains("outside of destination") {
        format!(
            "entry '{path}' would be written outside the image (through a symlink or hard link); \
             the archive is malformed or malicious: recreate it, e.g. with 'docker export'"
        )
    } else {
        format!(
            "cannot unpack '{path}': {}: check free disk space and the archive",
            clip(&chain)
        )
    }
}

/// Makes text from an archive (names, parser messages quoting header
/// bytes) safe for a one-line message: control characters escaped, length
/// bounded.
pub(crate) fn clip(s: &str) -> String {
    const MAX: usize = 200;
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == MAX {
            out.push_str("...");
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// tar's errors wrap the interesting part (e.g. "trying to unpack outside
/// of destination") in an inner error; show the whole chain on one line.
fn error_chain(e: &io::Error) -> String {
    let mut s = e.to_string();
    let mut cur: Option<&(dyn std::error::Error + 'static)> =
        e.get_ref().and_then(|inner| inner.source());
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// True when `/etc/passwd` in the image has an entry named `user`.
pub(crate) fn has_user(rootfs: &Path) -> bool {
    let Ok(passwd) = crate::fsutil::read_inside(rootfs, "etc/passwd") else {
        return false;
    };
    String::from_utf8_lossy(&passwd)
        .lines()
        .any(|l| l.split(':').next() == Some("user"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magic_detection() {
        assert_eq!(detect(&[0x1f, 0x8b, 8, 0]), Compression::Gzip);
        assert!(matches!(
            detect(b"\xfd7zXZ\x00rest"),
            Compression::Unsupported("xz", _)
        ));
        assert!(matches!(
            detect(b"BZh91AY"),
            Compression::Unsupported("bzip2", _)
        ));
        assert_eq!(detect(b"etc/passwd\0\0\0"), Compression::None);
    }
}
