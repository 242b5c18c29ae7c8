//! What `cordon doctor` asks of a tier: its own checks of this host, each with the fix when it
//! fails, and a verdict. Each tier crate answers for itself ([`TierEntry::diagnose`]), so the
//! doctor prints one line per tier from the tier, never a guess from a tier's name.
//!
//! [`TierEntry::diagnose`]: crate::TierEntry::diagnose

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    /// Works, with less than it could (or needs something only some uses need).
    Warn,
    /// Something required is missing: what depends on it cannot run.
    Missing,
}

/// One check: what was checked, how it came out, and the fix when it did not pass.
#[derive(Debug, Clone)]
pub struct Finding {
    pub name: &'static str,
    pub status: Status,
    pub detail: String,
    pub fix: Option<String>,
}

impl Finding {
    pub fn ok(name: &'static str, detail: impl Into<String>) -> Finding {
        Finding { name, status: Status::Ok, detail: detail.into(), fix: None }
    }

    pub fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Finding {
        Finding { name, status: Status::Warn, detail: detail.into(), fix: Some(fix.into()) }
    }

    pub fn missing(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Finding {
        Finding { name, status: Status::Missing, detail: detail.into(), fix: Some(fix.into()) }
    }
}

/// How a tier's sandboxes pause here (what `pauseMode` the API can give), for the tiers whose
/// sandboxes are host processes in host cgroups: frozen in place where the host can freeze a
/// group, and to files where the tier keeps its writable layer on the host.
pub fn pause(layout: &cordon_host::Layout, keeps_files: bool) -> Finding {
    let files = if keeps_files { "to files: the writable layer becomes a layer (pauseMode filesystem)" } else { "to files: not on this tier yet" };
    match layout.freezer() {
        Some(how) => Finding::ok("pause", format!("with memory: frozen in place, resident and counted against the cap, through {how} (pauseMode full); {files}; no CRIU checkpoint to disk")),
        None => Finding::warn(
            "pause",
            format!("with memory: not here (no unified cgroup hierarchy and no v1 freezer); {files}"),
            "mount the v1 freezer (mount -t cgroup -o freezer freezer /sys/fs/cgroup/freezer) or run on a cgroup v2 host",
        ),
    }
}

/// A tier's answer: its checks, and whether it can run here.
#[derive(Debug, Clone)]
pub struct Diagnosis {
    pub findings: Vec<Finding>,
    /// `Ok` with an optional one-line summary (how it will run) when sandboxes of this tier can
    /// be created here; `Err` with the reason when not.
    pub verdict: Result<Option<String>, String>,
}

impl Diagnosis {
    /// The verdict of a tier whose checks are `findings`: not available when one of them is
    /// missing, otherwise what opening the tier says (`open` runs only then; opening also reaps
    /// what a crashed cordon left of it).
    pub fn from_checks(findings: Vec<Finding>, open: impl FnOnce() -> Result<Option<String>, String>) -> Diagnosis {
        let verdict = if findings.iter().any(|f| f.status == Status::Missing) { Err("see MISSING above".into()) } else { open() };
        Diagnosis { findings, verdict }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_check_decides_without_opening_the_tier() {
        let d = Diagnosis::from_checks(vec![Finding::ok("a", ""), Finding::missing("b", "gone", "install b")], || panic!("opened"));
        assert_eq!(d.verdict, Err("see MISSING above".into()));
        let d = Diagnosis::from_checks(vec![Finding::warn("a", "meh", "tune a")], || Err("no cgroup2".into()));
        assert_eq!(d.verdict, Err("no cgroup2".into()));
        let d = Diagnosis::from_checks(vec![], || Ok(Some("tcg".into())));
        assert_eq!(d.verdict, Ok(Some("tcg".into())));
    }
}
