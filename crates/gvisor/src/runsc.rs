//! Finding runsc, its version, and the platform (how gVisor intercepts syscalls) it will use.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::GvisorError;

/// Environment variable naming the runsc binary (default: `runsc` on `PATH`).
pub const ENV_RUNSC: &str = "CORDON_RUNSC";
/// Environment variable forcing a platform (`ptrace`, `systrap`, `kvm`) instead of the default.
pub const ENV_PLATFORM: &str = "CORDON_RUNSC_PLATFORM";

/// The runsc binary cordon drives.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Runsc {
    pub path: PathBuf,
    /// First line of `runsc --version`, e.g. `runsc version 0.0~20221219.0`.
    pub version: String,
    /// Platforms this build knows (`runsc help platforms`).
    pub platforms: Vec<String>,
}

/// What identifies one build of a binary on disk: path, size, modification time.
fn identity(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(format!("{}:{}:{}.{}", path.display(), m.size(), m.mtime(), m.mtime_nsec()))
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

impl Runsc {
    /// Finds runsc (`CORDON_RUNSC`, else `PATH`) and asks it what it is.
    pub fn locate() -> Result<Runsc, GvisorError> {
        let path = Self::find()?;
        Self::ask(path)
    }

    /// As [`Runsc::locate`], but reuses what `cache` says about the same binary (same path, size
    /// and modification time): asking runsc costs two Go program starts, ~80 ms on a busy host.
    pub fn locate_cached(cache: &Path) -> Result<Runsc, GvisorError> {
        let path = Self::find()?;
        let key = identity(&path);
        if let Some(hit) = std::fs::read(cache)
            .ok()
            .and_then(|b| serde_json::from_slice::<(String, Runsc)>(&b).ok())
            .filter(|(k, r)| Some(k) == key.as_ref() && r.path == path)
        {
            return Ok(hit.1);
        }
        let r = Self::ask(path)?;
        if let Some(k) = key {
            let tmp = cache.with_extension("tmp");
            if std::fs::write(&tmp, serde_json::to_vec(&(k, &r)).unwrap_or_default()).is_ok() {
                let _ = std::fs::rename(&tmp, cache);
            }
        }
        Ok(r)
    }

    fn find() -> Result<PathBuf, GvisorError> {
        let path = match std::env::var_os(ENV_RUNSC).filter(|v| !v.is_empty()) {
            Some(p) => {
                let p = PathBuf::from(p);
                if !p.is_file() {
                    return Err(GvisorError::Unavailable(format!(
                        "{ENV_RUNSC}={} does not exist: point it at a runsc binary or unset it",
                        p.display()
                    )));
                }
                p
            }
            None => on_path("runsc").ok_or_else(|| {
                GvisorError::Unavailable(
                    "runsc (gVisor) is not installed: run scripts/install-deps (apt package runsc), or set CORDON_RUNSC".into(),
                )
            })?,
        };
        Ok(path)
    }

    fn ask(path: PathBuf) -> Result<Runsc, GvisorError> {
        let out = Command::new(&path)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| GvisorError::Unavailable(format!("cannot run {}: {e}", path.display())))?;
        if !out.status.success() {
            return Err(GvisorError::Unavailable(format!("{} --version failed: is it runsc?", path.display())));
        }
        let version = String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").trim().to_string();
        let help = Command::new(&path).args(["help", "platforms"]).stdin(Stdio::null()).output();
        let platforms = help
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_alphanumeric()))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Runsc { path, version, platforms })
    }

    pub fn knows(&self, platform: &str) -> bool {
        self.platforms.iter().any(|p| p == platform)
    }

    /// Runs `runsc --platform=<p> do true` with a deadline: whether that platform works here.
    /// (`kvm` hangs on some hosts, so a probe must never wait unbounded.)
    pub fn probe(&self, platform: &str, scratch: &Path, deadline: Duration) -> Result<Duration, String> {
        if !self.knows(platform) {
            return Err(format!("this runsc does not know the {platform} platform"));
        }
        let root = scratch.join(format!("probe-{platform}-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&root);
        let started = Instant::now();
        let mut child = Command::new(&self.path)
            .arg(format!("--root={}", root.display()))
            .arg(format!("--platform={platform}"))
            .args(["--network=none", "--ignore-cgroups", "do", "true"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        let result = loop {
            match child.try_wait() {
                Ok(Some(st)) if st.success() => break Ok(started.elapsed()),
                Ok(Some(st)) => break Err(format!("runsc do true failed ({st})")),
                Ok(None) if started.elapsed() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break Err(format!("no answer within {deadline:?} (hangs)"));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => break Err(e.to_string()),
            }
        };
        let _ = std::fs::remove_dir_all(&root);
        result
    }
}

/// The platform a sandbox runs on: `CORDON_RUNSC_PLATFORM` when set, else the one a previous
/// probe (`cordon doctor`) recorded in `choice_file` for this runsc version, else `systrap` when
/// this runsc knows it, else `ptrace`, which every build has and needs nothing of the host.
pub fn platform(runsc: &Runsc, choice_file: &Path) -> Result<String, GvisorError> {
    if let Some(p) = std::env::var(ENV_PLATFORM).ok().filter(|p| !p.is_empty()) {
        if !runsc.knows(&p) {
            return Err(GvisorError::Unavailable(format!(
                "{ENV_PLATFORM}={p}: this runsc knows only {}",
                runsc.platforms.join(", ")
            )));
        }
        return Ok(p);
    }
    if let Ok(text) = std::fs::read_to_string(choice_file) {
        if let Some((version, p)) = text.trim().rsplit_once('\t') {
            if version == runsc.version && runsc.knows(p) {
                return Ok(p.to_string());
            }
        }
    }
    Ok(if runsc.knows("systrap") { "systrap" } else { "ptrace" }.to_string())
}

/// Records a probed platform choice for this runsc version (see [`platform`]).
pub fn record_platform(runsc: &Runsc, choice_file: &Path, platform: &str) -> std::io::Result<()> {
    std::fs::write(choice_file, format!("{}\t{platform}\n", runsc.version))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(platforms: &[&str]) -> Runsc {
        Runsc {
            path: PathBuf::from("/usr/bin/runsc"),
            version: "runsc version 0.0~test".into(),
            platforms: platforms.iter().map(|p| p.to_string()).collect(),
        }
    }

    #[test]
    fn a_recorded_probe_is_used_only_for_the_same_runsc() {
        let dir = std::env::temp_dir().join(format!("cordon-runsc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let choice = dir.join("platform");
        let rs = fake(&["kvm", "ptrace"]);
        // Nothing recorded: the platform every build has.
        assert_eq!(platform(&rs, &choice).unwrap(), "ptrace");
        record_platform(&rs, &choice, "kvm").unwrap();
        assert_eq!(platform(&rs, &choice).unwrap(), "kvm");
        // Another runsc (an upgrade) must be probed again.
        let newer = Runsc { version: "runsc version 0.0~newer".into(), ..fake(&["kvm", "ptrace", "systrap"]) };
        assert_eq!(platform(&newer, &choice).unwrap(), "systrap");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn probing_a_platform_the_build_lacks_says_so() {
        let err = fake(&["ptrace"]).probe("systrap", Path::new("/nonexistent"), Duration::from_millis(10)).unwrap_err();
        assert!(err.contains("does not know the systrap platform"), "{err}");
    }
}
