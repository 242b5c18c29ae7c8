//! `cordon volume create|ls|rm|inspect`, and the `--volume NAME:/path[:ro]` of `run` and `mcp`.

use anyhow::Result;
use clap::Subcommand;

use crate::state::State;
use crate::usage;

/// The size of a volume when `--size` is not given.
pub const DEFAULT_SIZE: &str = "10G";

#[derive(Subcommand)]
pub enum VolumeCmd {
    /// Create an empty volume: its own filesystem of at most --size (sparse: an empty volume
    /// takes a few MiB of the host's disk).
    Create {
        name: String,
        #[arg(long, default_value = DEFAULT_SIZE)]
        size: String,
    },
    /// List the volumes.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Delete a volume and its files (refused while a sandbox uses it).
    Rm { name: String },
    /// Show a volume: id, size cap, bytes used, mount point on the host.
    Inspect { name: String },
}

pub fn volume_error(e: cordon_volume::VolumeError) -> anyhow::Error {
    use cordon_volume::VolumeError::*;
    match e {
        InvalidName(_) | InvalidId(_) | InvalidSize(_) | NameTaken(_) | NotFound(_) | NameNotFound(_) | InUse(_) | NoRoom { .. } => usage(e.to_string()),
        e => e.into(),
    }
}

/// A volume by name, or by id.
fn find(volumes: &cordon_volume::Volumes, name: &str) -> Result<cordon_volume::VolumeInfo> {
    match volumes.by_name(name) {
        Err(cordon_volume::VolumeError::NameNotFound(_)) if cordon_volume::store::valid_id(name) => volumes.get(name).map_err(volume_error),
        r => r.map_err(volume_error),
    }
}

pub fn main(state: &State, cmd: VolumeCmd) -> Result<u8> {
    crate::preflight::require_root("volumes are filesystems the host mounts: run cordon volume as root")?;
    let volumes = state.volumes()?;
    match cmd {
        VolumeCmd::Create { name, size } => {
            let size = cordon_spec::parse_size(&size).map_err(|e| usage(format!("--size: {}", e.reason)))?;
            let v = volumes.create(&name, size).map_err(volume_error)?;
            println!("{}", v.id);
        }
        VolumeCmd::Ls { json } => {
            let list = volumes.list().map_err(volume_error)?;
            if json {
                println!("{}", serde_json::to_string(&list)?);
            } else {
                println!("{:<36}  {:<24}  {:>8}", "ID", "NAME", "SIZE");
                for v in list {
                    println!("{:<36}  {:<24}  {:>8}", v.id, v.name, human(v.size_bytes));
                }
            }
        }
        VolumeCmd::Rm { name } => {
            let v = find(&volumes, &name)?;
            volumes.delete(&v.id).map_err(volume_error)?;
            eprintln!("deleted volume {} ({})", v.name, v.id);
        }
        VolumeCmd::Inspect { name } => {
            let v = find(&volumes, &name)?;
            let lease = volumes.lease(&v.id).map_err(volume_error)?;
            let used = rustix::fs::statvfs(lease.root()).map(|s| (s.f_blocks - s.f_bfree) * s.f_frsize).unwrap_or(0);
            let out = serde_json::json!({
                "id": v.id, "name": v.name, "size_bytes": v.size_bytes, "used_bytes": used,
                "created_unix_ms": v.created_unix_ms, "mountpoint": lease.root(),
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
    }
    Ok(0)
}

fn human(bytes: u64) -> String {
    const UNITS: [(u64, &str); 4] = [(1 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    UNITS.iter().find(|(u, _)| bytes >= *u && bytes.is_multiple_of(*u)).map_or_else(|| bytes.to_string(), |(u, s)| format!("{}{s}", bytes / u))
}

/// `NAME:/path[:ro]`.
pub fn parse_mount(s: &str) -> Result<(String, String, bool)> {
    let bad = || usage(format!("--volume {s}: use NAME:/PATH or NAME:/PATH:ro"));
    let (name, rest) = s.split_once(':').ok_or_else(bad)?;
    let (path, ro) = match rest.rsplit_once(':') {
        Some((p, "ro")) => (p, true),
        Some((p, "rw")) => (p, false),
        Some(_) => return Err(bad()),
        None => (rest, false),
    };
    if name.is_empty() || path.is_empty() {
        return Err(bad());
    }
    cordon_spec::validate_mount_path(path).map_err(|e| usage(format!("--volume {s}: {}", e.reason)))?;
    Ok((name.to_string(), path.to_string(), ro))
}

/// The volumes of `--volume` flags, each held in use (and mounted on the host) for as long as
/// the returned leases live: drop them after the sandbox is gone.
pub fn attach(state: &State, flags: &[String]) -> Result<(Vec<cordon_spec::VolumeMount>, Vec<cordon_volume::Lease>)> {
    if flags.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let volumes = state.volumes()?;
    let (mut mounts, mut leases) = (Vec::new(), Vec::new());
    for flag in flags {
        let (name, target, read_only) = parse_mount(flag)?;
        if mounts.iter().any(|m: &cordon_spec::VolumeMount| m.target == target) {
            return Err(usage(format!("--volume {flag}: path '{target}' is already used")));
        }
        let v = find(&volumes, &name)?;
        let lease = volumes.lease(&v.id).map_err(volume_error)?;
        mounts.push(cordon_spec::VolumeMount { name: v.name.clone(), source: lease.root().to_path_buf(), target, read_only });
        leases.push(lease);
    }
    Ok((mounts, leases))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_flags() {
        assert_eq!(parse_mount("data:/mnt/data").unwrap(), ("data".into(), "/mnt/data".into(), false));
        assert_eq!(parse_mount("data:/mnt/data:ro").unwrap(), ("data".into(), "/mnt/data".into(), true));
        for bad in ["data", ":/x", "data:", "data:rel", "data:/x:rx", "data:/a/../b"] {
            assert!(parse_mount(bad).is_err(), "{bad}");
        }
    }
}
