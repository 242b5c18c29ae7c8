//! The state directory and the stores in it.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

pub struct State {
    dir: PathBuf,
}

impl State {
    pub fn new(dir: PathBuf) -> State {
        State { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates the directory on first use. It holds images and sandbox state, so only root may
    /// enter it.
    pub fn ensure(&self) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        if !self.dir.exists() {
            std::fs::create_dir_all(&self.dir)
                .with_context(|| format!("cannot create state dir {}: choose another with --state-dir or CORDON_HOME", self.dir.display()))?;
            std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o711))?;
        }
        // Sandboxes run as unprivileged host uids that must pass through the state dir (and every
        // directory above it) to reach their image layers and writable layer; a 0700 directory
        // (e.g. from `mktemp -d`) would fail every sandbox with a raw mount error later.
        for dir in self.dir.ancestors().filter(|d| !d.as_os_str().is_empty()) {
            let mode = std::fs::metadata(dir).map(|m| m.permissions().mode()).unwrap_or(0o755);
            if mode & 0o001 == 0 {
                return Err(crate::usage(format!(
                    "state dir {}: {} is mode {:o}, which sandbox users cannot pass through; run chmod o+x {} or choose another state dir",
                    self.dir.display(),
                    dir.display(),
                    mode & 0o7777,
                    dir.display()
                )));
            }
        }
        // Overlay mount options cannot carry these characters in paths.
        let s = self.dir.to_string_lossy();
        if s.contains([',', ':', '\\']) {
            return Err(crate::usage(format!("state dir {s} must not contain ',', ':' or '\\'")));
        }
        Ok(())
    }

    /// The volume store, with whatever an interrupted create or delete left removed.
    pub fn volumes(&self) -> Result<cordon_volume::Volumes> {
        self.ensure()?;
        let v = cordon_volume::Volumes::open(&self.dir)?;
        v.reap();
        Ok(v)
    }

    pub fn images(&self) -> Result<cordon_image::Store> {
        self.ensure()?;
        Ok(cordon_image::Store::open(&self.dir)?)
    }

    /// The backend of `tier`, or a one-line usage error saying why this host cannot run it.
    pub fn backend(
        &self,
        tier: cordon_spec::Tier,
        dns_upstream: Option<std::net::SocketAddr>,
        intercept: Option<std::sync::Arc<cordon_sandbox::Interception>>,
    ) -> Result<std::sync::Arc<dyn cordon_sandbox::Backend>> {
        self.ensure()?;
        let host = cordon_sandbox::Host { dns_upstream, intercept, ..self.host(None) };
        let entry = cordon_sandbox::TierEntry::find(&crate::tiers::TABLE, tier).map_err(|e| crate::usage(e.to_string()))?;
        (entry.open)(&host).map_err(|e| crate::usage(e.to_string()))
    }

    /// What the backends need to know about this host.
    pub fn host(&self, envd_version: Option<String>) -> cordon_sandbox::Host {
        // /proc/self/exe stays valid even if the binary on disk is replaced while we run.
        cordon_sandbox::Host {
            state_dir: self.dir.clone(),
            exe: PathBuf::from("/proc/self/exe"),
            envd_version,
            dns_upstream: None,
            intercept: None,
        }
    }

    /// The vm tier; fails with the reason when the host cannot run it (no QEMU, no cgroups).
    pub fn vm(&self) -> Result<cordon_vm::VmTier, cordon_vm::VmError> {
        self.ensure().map_err(|e| cordon_vm::VmError::Unsupported(e.to_string()))?;
        cordon_vm::VmTier::open(&self.dir, PathBuf::from("/proc/self/exe"))
    }
}
