//! `cordon cp SRC DST`: one file between here and a running sandbox, `ID:/path` on exactly
//! one side, through envd's `/files` on the server's data plane (GET to download, POST to
//! upload; parents are created). A directory on either side is refused: one file per copy.
//! A destination that is a directory (or ends in `/`) gets the source's file name.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Args;
use cordon_envd::filesystem::FileType;

use crate::api_client::{self, envd_error, Api, ServerArgs};
use crate::usage;

#[derive(Args, Debug)]
pub struct CpArgs {
    /// What to copy: a local file, or ID:/path in a sandbox.
    src: String,
    /// Where to: a local path, or ID:/path in a sandbox (the other side from SRC).
    dst: String,
    /// The sandbox user the file is read or written as (default: the sandbox's default user).
    #[arg(short = 'u', long = "user")]
    user: Option<String>,
    #[command(flatten)]
    server: ServerArgs,
}

/// `ID:path` when `s` names a sandbox's file: a sandbox id (lowercase letters and digits)
/// before the first `:`. A local path with a `:` in it can be written `./a:b`.
fn remote(s: &str) -> Option<(&str, &str)> {
    let (id, path) = s.split_once(':')?;
    (!id.is_empty() && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())).then_some((id, path))
}

/// The last part of a path, for a destination that is a directory.
fn base_name(path: &str) -> Option<&str> {
    path.trim_end_matches('/').rsplit('/').next().filter(|n| !n.is_empty() && *n != "." && *n != "..")
}

pub fn main(a: CpArgs) -> Result<u8> {
    let shape = "give ID:/path on exactly one side, as in `cordon cp ./data.bin ID:/home/user/data.bin`";
    let (src, dst) = (a.src.as_str(), a.dst.as_str());
    let (id, down) = match (remote(src), remote(dst)) {
        (Some((id, _)), None) => (id, true),
        (None, Some((id, _))) => (id, false),
        (Some(_), Some(_)) => return Err(usage(format!("cp: both {src:?} and {dst:?} name a sandbox: {shape}"))),
        (None, None) => return Err(usage(format!("cp: neither {src:?} nor {dst:?} names a sandbox: {shape}"))),
    };
    let path = if down { remote(src) } else { remote(dst) }.map(|(_, p)| p).unwrap_or_default();
    if path.is_empty() {
        return Err(usage(format!("cp: {id}: names no path inside the sandbox: {shape}")));
    }
    api_client::check_id(id)?;
    let api = Api::new(&a.server)?;
    let user = a.user.as_deref();
    api_client::runtime()?.block_on(async {
        let client = api.envd(id).await?;
        if down {
            let info = client.stat(path, user).await.map_err(envd_error).with_context(|| format!("{id}:{path}"))?;
            if info.file_type == FileType::Directory {
                return Err(usage(format!("cp: {id}:{path} is a directory: cordon cp copies one file (archive it first, e.g. with `cordon exec {id} -- tar`)")));
            }
            let data = client.download_file(path, user).await.map_err(envd_error).with_context(|| format!("read {id}:{path}"))?;
            let mut to = PathBuf::from(dst);
            if to.is_dir() {
                to.push(base_name(path).unwrap_or("file"));
            }
            std::fs::write(&to, &data).with_context(|| format!("write {}", to.display()))?;
        } else {
            let from = Path::new(src);
            if from.is_dir() {
                return Err(usage(format!("cp: {src} is a directory: cordon cp copies one file (archive it first)")));
            }
            let data = std::fs::read(from).with_context(|| format!("read {src}"))?;
            let mut to = path.to_string();
            let is_dir = to.ends_with('/') || client.stat(&to, user).await.is_ok_and(|i| i.file_type == FileType::Directory);
            if is_dir {
                to = format!("{}/{}", to.trim_end_matches('/'), base_name(src).unwrap_or("file"));
            }
            client.upload_file(&to, user, Bytes::from(data)).await.map_err(envd_error).with_context(|| format!("write {id}:{to}"))?;
        }
        Ok(0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_side_is_the_sandbox() {
        assert_eq!(remote("abc123:/tmp/x"), Some(("abc123", "/tmp/x")));
        assert_eq!(remote("./a:b"), None);
        assert_eq!(remote("/tmp/x"), None);
        assert_eq!(remote("C:/x"), None);
        assert_eq!(base_name("/a/b/c.txt"), Some("c.txt"));
        assert_eq!(base_name("dir/"), Some("dir"));
        assert_eq!(base_name("/"), None);
    }
}
