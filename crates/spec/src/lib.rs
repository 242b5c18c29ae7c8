//! What a sandbox is, as data: its image, tier, limits, environment and identity.
//!
//! Every front end (the `run` flags, the HTTP API, the MCP tools) turns its input into a
//! [`SandboxSpec`] and calls [`SandboxSpec::validate`]; backends only ever see validated specs.
//! Nothing here does I/O, so the rules are the same everywhere and testable without root.

mod limits;
mod network;
mod parse;
mod template;
mod transform;

pub use limits::{Limits, MAX_PIDS, DEFAULT_CPUS, DEFAULT_DISK, DEFAULT_MEMORY, DEFAULT_NOFILE, DEFAULT_PIDS, DEFAULT_TIMEOUT};
pub use network::{canonical, normalize_name, Cidr, NetRule, NetworkPolicy, Target, Verdict};
pub use parse::{parse_duration, parse_size, format_size};
pub use template::TemplateStep;
pub use transform::{secret_name, valid_value, FillError, HeaderRule, Template, Transforms};

use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// A spec that cannot be run, with the field at fault and what would be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct SpecError {
    pub field: &'static str,
    pub reason: String,
}

impl SpecError {
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        SpecError { field, reason: reason.into() }
    }
}

/// The isolation tier a sandbox runs under. One interface, several strengths of boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Linux namespaces, cgroups and filters over the shared host kernel.
    #[default]
    Ns,
    /// gVisor's user-space kernel (`runsc`).
    Gvisor,
    /// A microVM with its own guest kernel.
    Vm,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Ns, Tier::Gvisor, Tier::Vm];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Ns => "ns",
            Tier::Gvisor => "gvisor",
            Tier::Vm => "vm",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Tier {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s.to_ascii_lowercase().as_str() {
            "ns" | "namespace" | "namespaces" => Ok(Tier::Ns),
            "gvisor" | "runsc" => Ok(Tier::Gvisor),
            "vm" | "microvm" => Ok(Tier::Vm),
            _ => Err(SpecError::new("tier", format!("'{s}' is not a tier: use ns, gvisor or vm"))),
        }
    }
}

/// Everything needed to create one sandbox, the same for every front end and every tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// The sandbox's id, assigned by the front end that creates it (E2B's shape, see
    /// `cordon_sandbox::new_id`).
    #[serde(default)]
    pub id: String,
    /// Image name in the store (`base` by default).
    pub image: String,
    #[serde(default)]
    pub tier: Tier,
    #[serde(default)]
    pub limits: Limits,
    /// Sandbox-level environment, applied on top of the image's defaults.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Default working directory of commands; `None` means the user's home.
    #[serde(default)]
    pub workdir: Option<String>,
    /// Default user of commands inside the sandbox.
    #[serde(default = "default_user")]
    pub user: String,
    /// Allow ptrace and process_vm_* inside (debuggers, profilers). Off by default.
    #[serde(default)]
    pub allow_ptrace: bool,
    /// Egress allowlist; empty (the default) means loopback only.
    #[serde(default)]
    pub network: NetworkPolicy,
    /// Record the syscalls the host's filter denies (where the tier has one); costs a thread.
    #[serde(default)]
    pub audit: bool,
    /// Keep the writable layer where the host can read it, so that the sandbox's files can be
    /// taken as a layer while it runs (a snapshot, a fork, a filesystem-only pause).
    #[serde(default)]
    pub keep_writable: bool,
    /// Start from a running sandbox saved to this directory (`Sandbox::checkpoint`), with its
    /// processes and memory, instead of afresh: a resume, a fork. Only read: one saved sandbox
    /// can start many.
    #[serde(default)]
    pub restore: Option<std::path::PathBuf>,
    /// Start afresh on a writable disk kept whole by a files-only pause (`Sandbox::keep_disk`)
    /// in this directory: its files, none of its processes. Only read, as `restore` is.
    #[serde(default)]
    pub disk_from: Option<std::path::PathBuf>,
    /// Volumes bound into the sandbox: directories the host has mounted (`cordon_volume`), the
    /// only host data a sandbox sees, each named at its create.
    #[serde(default)]
    pub volumes: Vec<VolumeMount>,
    /// The host's egress CA certificate (PEM), which the sandbox trusts: the tier adds it to
    /// the image's CA bundle and names the bundle in `SSL_CERT_FILE` and its kin. Set when the
    /// forwarder may terminate TLS for the hosts of injection rules (now or after a network
    /// update); `None` leaves the image's trust as it is.
    #[serde(default)]
    pub egress_ca: Option<String>,
    /// Left running when the process that made it exits, for the next one on the same state
    /// directory to adopt (a server's restart), where the tier can.
    #[serde(default)]
    pub keep: bool,
}

/// A volume at a path inside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    /// The volume's name, as the API shows it.
    pub name: String,
    /// The host directory its filesystem is mounted on.
    pub source: std::path::PathBuf,
    /// Where it appears inside: absolute and clean (see [`validate_mount_path`]).
    pub target: String,
    #[serde(default)]
    pub read_only: bool,
}

/// Paths a volume may not cover: the root, and what the sandbox's own plumbing lives under.
const RESERVED_MOUNT_PATHS: [&str; 5] = ["/proc", "/sys", "/dev", "/.cordon", "/etc/resolv.conf"];

/// A volume's mount path: absolute, clean (no `.`/`..`, empty or trailing components, as
/// E2B's create checks it), and not the root or the sandbox's own plumbing. The reasons are
/// E2B's words where it has them.
pub fn validate_mount_path(path: &str) -> Result<(), SpecError> {
    let bad = |reason: String| Err(SpecError::new("volume", reason));
    if !path.starts_with('/') {
        return bad("path must be absolute".into());
    }
    if path.split('/').skip(1).any(|c| c == "." || c == "..") {
        return bad("path must not contain any '.' or '..' components".into());
    }
    if path.contains("//") || (path.len() > 1 && path.ends_with('/')) {
        return bad(format!("path '{path}' is not clean: remove empty components and the trailing '/'"));
    }
    if path == "/" {
        return bad("path '/' would cover the whole root: mount a volume below it".into());
    }
    if path.contains('\0') || path.len() > 4096 {
        return bad("path contains a NUL byte or is longer than 4096 bytes".into());
    }
    if let Some(r) = RESERVED_MOUNT_PATHS.iter().find(|r| path == **r || path.strip_prefix(**r).is_some_and(|rest| rest.starts_with('/'))) {
        return bad(format!("path '{path}' is under {r}, which the sandbox itself needs: choose another path"));
    }
    Ok(())
}

fn default_user() -> String {
    "user".to_string()
}

impl Default for SandboxSpec {
    fn default() -> Self {
        SandboxSpec {
            id: String::new(),
            image: "base".into(),
            tier: Tier::Ns,
            limits: Limits::default(),
            env: Vec::new(),
            workdir: None,
            user: default_user(),
            allow_ptrace: false,
            network: NetworkPolicy::default(),
            audit: false,
            keep_writable: false,
            restore: None,
            disk_from: None,
            volumes: Vec::new(),
            egress_ca: None,
            keep: false,
        }
    }
}

impl SandboxSpec {
    /// The egress CA the sandbox's files and environment trust: only where it has a network
    /// (a sandbox without one has nothing to be intercepted).
    pub fn trusted_egress_ca(&self) -> Option<&str> {
        self.egress_ca.as_deref().filter(|_| self.network.is_enabled())
    }

    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), SpecError> {
        validate_image_name(&self.image)?;
        self.limits.validate()?;
        validate_env_vars(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
        if let Some(w) = &self.workdir {
            if !w.starts_with('/') {
                return Err(SpecError::new("workdir", format!("'{w}' is not an absolute path")));
            }
            if w.contains('\0') {
                return Err(SpecError::new("workdir", "contains a NUL byte"));
            }
        }
        validate_user(&self.user)?;
        if !self.network.transforms.is_empty() && self.egress_ca.is_none() {
            return Err(SpecError::new("rules", "header injection needs the host's egress CA, which this sandbox was not given"));
        }
        let mut seen = std::collections::HashSet::new();
        for v in &self.volumes {
            validate_mount_path(&v.target)?;
            if !seen.insert(v.target.as_str()) {
                return Err(SpecError::new("volume", format!("path '{}' is already used", v.target)));
            }
        }
        Ok(())
    }
}

/// Image names are path components in the store, so they are kept to a safe alphabet.
pub fn validate_image_name(name: &str) -> Result<(), SpecError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(SpecError::new(
            "image",
            format!("'{name}' is not an image name: use 1-63 of a-z 0-9 . _ -, starting with a letter or digit"),
        ))
    }
}

/// Parses `K=V` as given to `--env`.
pub fn parse_env(s: &str) -> Result<(String, String), SpecError> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| SpecError::new("env", format!("'{s}' is not KEY=VALUE")))?;
    validate_env(k, v)?;
    Ok((k.to_string(), v.to_string()))
}

/// Longest `KEY=VALUE` a sandbox variable may be, in bytes with its terminating NUL: the kernel
/// refuses any longer single string at `execve` (MAX_ARG_STRLEN), so every command would fail.
pub const MAX_ENV_VAR: usize = 128 << 10;
/// Most bytes all sandbox variables may take together (each `KEY=VALUE` and its NUL): a quarter
/// of the 8 MiB default stack is all `execve` takes for arguments and environment together, and
/// commands need room for their own arguments and variables on top.
pub const MAX_ENV_TOTAL: usize = 1 << 20;

/// Checks a sandbox's variables one by one and together: names and values every command can
/// be started with (see [`MAX_ENV_VAR`], [`MAX_ENV_TOTAL`]).
pub fn validate_env_vars<'a>(vars: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<(), SpecError> {
    let mut total = 0usize;
    for (k, v) in vars {
        validate_env(k, v)?;
        total += k.len() + v.len() + 2;
    }
    if total > MAX_ENV_TOTAL {
        return Err(SpecError::new(
            "env",
            format!("the variables take {total} bytes together, more than the {MAX_ENV_TOTAL} a sandbox may have: pass large data as a file"),
        ));
    }
    Ok(())
}

fn validate_env(k: &str, v: &str) -> Result<(), SpecError> {
    let key_ok = !k.is_empty()
        && !k.as_bytes()[0].is_ascii_digit()
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !key_ok {
        return Err(SpecError::new(
            "env",
            format!("'{k}' is not a variable name: use letters, digits and _, not starting with a digit"),
        ));
    }
    if v.contains('\0') {
        return Err(SpecError::new("env", format!("the value of {k} contains a NUL byte")));
    }
    let len = k.len() + v.len() + 2;
    if len > MAX_ENV_VAR {
        return Err(SpecError::new(
            "env",
            format!("{k} takes {len} bytes, more than the {MAX_ENV_VAR} one variable may have (KEY=VALUE and a NUL): pass large data as a file"),
        ));
    }
    Ok(())
}

fn validate_user(u: &str) -> Result<(), SpecError> {
    let ok = !u.is_empty()
        && u.len() <= 32
        && u.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(SpecError::new("user", format!("'{u}' is not a user name")))
    }
}

/// The wall-clock limit as a `Duration` (a convenience for callers holding a spec).
impl SandboxSpec {
    pub fn timeout(&self) -> Duration {
        self.limits.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_spec_is_valid() {
        SandboxSpec::default().validate().unwrap();
    }

    #[test]
    fn volume_mount_paths() {
        for ok in ["/data", "/home/user/work", "/mnt/a-b_c", "/devices", "/procfs"] {
            validate_mount_path(ok).unwrap();
        }
        for (bad, says) in [
            ("data", "must be absolute"),
            ("/a/../b", "'.' or '..'"),
            ("/a/./b", "'.' or '..'"),
            ("/a//b", "not clean"),
            ("/a/", "not clean"),
            ("/", "whole root"),
            ("/proc/x", "under /proc"),
            ("/dev", "under /dev"),
            ("/.cordon", "under /.cordon"),
        ] {
            let e = validate_mount_path(bad).unwrap_err();
            assert!(e.reason.contains(says), "{bad}: {}", e.reason);
        }
        let v = |t: &str| VolumeMount { name: "v".into(), source: "/x".into(), target: t.into(), read_only: false };
        let spec = SandboxSpec { volumes: vec![v("/a"), v("/a")], ..Default::default() };
        assert_eq!(spec.validate().unwrap_err().reason, "path '/a' is already used");
    }

    #[test]
    fn image_names() {
        assert!(validate_image_name("base").is_ok());
        assert!(validate_image_name("code-interpreter-v1").is_ok());
        for bad in ["", "../etc", "Base", "a/b", "-x", &"x".repeat(64)] {
            assert!(validate_image_name(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn env_pairs() {
        assert_eq!(parse_env("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert_eq!(parse_env("EMPTY=").unwrap(), ("EMPTY".into(), "".into()));
        let e = parse_env("novalue").unwrap_err();
        assert!(e.to_string().contains("KEY=VALUE"), "{e}");
        assert!(parse_env("1X=1").is_err());
        assert!(parse_env("A-B=1").is_err());
        assert!(parse_env("A\0B=1").is_err());
        let big = "x".repeat(MAX_ENV_VAR);
        assert!(parse_env(&format!("A={big}")).unwrap_err().reason.contains("131072"));
        let fits = "x".repeat(MAX_ENV_VAR - 4);
        assert!(parse_env(&format!("A={fits}")).is_ok());
        let many: Vec<(String, String)> = (0..9).map(|i| (format!("V{i}"), "y".repeat(120 << 10))).collect();
        let e = validate_env_vars(many.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap_err();
        assert!(e.reason.contains("together"), "{e}");
    }

    #[test]
    fn tiers_parse() {
        assert_eq!("ns".parse::<Tier>().unwrap(), Tier::Ns);
        assert_eq!("gVisor".parse::<Tier>().unwrap(), Tier::Gvisor);
        assert!("docker".parse::<Tier>().unwrap_err().to_string().contains("ns, gvisor or vm"));
    }

    #[test]
    fn workdir_must_be_absolute() {
        let s = SandboxSpec { workdir: Some("home".into()), ..Default::default() };
        assert_eq!(s.validate().unwrap_err().field, "workdir");
    }

    #[test]
    fn spec_roundtrips_as_json() {
        let s = SandboxSpec { env: vec![("A".into(), "1".into())], ..Default::default() };
        let j = serde_json::to_string(&s).unwrap();
        let back: SandboxSpec = serde_json::from_str(&j).unwrap();
        assert_eq!(s, back);
    }
}
