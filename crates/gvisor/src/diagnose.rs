//! What the gvisor tier needs of the host (`cordon doctor`): runsc, and a platform that runs a
//! sandbox here. `ptrace` always works where runsc does; `systrap` and `kvm` are chosen only
//! when this runsc knows them and a probe with a deadline runs a sandbox on them (kvm hangs on
//! some hosts). The choice is recorded for every later open of the tier.

use std::path::Path;
use std::time::Duration;

use cordon_sandbox::diagnosis::{Diagnosis, Finding};
use cordon_sandbox::Host;

use crate::runsc;

/// How long one platform's probe may take before it counts as not working.
const PROBE_DEADLINE: Duration = Duration::from_secs(3);

/// The tier's checks, and whether it opens.
pub fn diagnose(host: &Host) -> Diagnosis {
    let (finding, platform) = runsc_platform(host);
    let verdict = match platform {
        Some(_) => crate::backend::open(host).map(|_| None).map_err(|e| e.to_string()),
        None => Err("see runsc above".into()),
    };
    let pause = match (platform, crate::launch::cp()) {
        (Some(_), Ok(_)) => Finding::ok(
            "pause",
            "with memory, to disk: runsc checkpoint writes the sandbox's kernel and ends it, freeing its RAM, and the writable layer is copied out (pauseMode full); a sandbox with a network policy (host sockets, which runsc cannot save) is frozen in place instead; to files: the writable layer becomes a layer (pauseMode filesystem)",
        ),
        (_, Err(e)) => Finding::warn("pause", format!("with memory: frozen in place only ({e})"), "apt-get install coreutils"),
        (None, _) => cordon_sandbox::diagnosis::pause(&cordon_host::Layout::detect(), crate::backend::CAPABILITIES.keep_writable),
    };
    Diagnosis { findings: vec![finding, pause], verdict }
}

/// Finds runsc and the first platform that runs a sandbox, recording the choice.
fn runsc_platform(host: &Host) -> (Finding, Option<&'static str>) {
    let rs = match crate::Runsc::locate() {
        Ok(r) => r,
        Err(e) => return (Finding::warn("runsc", e.to_string(), "scripts/install-deps (apt-get install runsc), or set CORDON_RUNSC"), None),
    };
    let scratch = host.state_dir.join("gvisor");
    let _ = std::fs::create_dir_all(&scratch);
    let mut notes = Vec::new();
    let mut chosen = None;
    for p in ["systrap", "kvm", "ptrace"] {
        if p == "kvm" && !Path::new("/dev/kvm").exists() {
            notes.push("kvm: no /dev/kvm".to_string());
            continue;
        }
        match rs.probe(p, &scratch, PROBE_DEADLINE) {
            Ok(t) => {
                chosen = chosen.or(Some(p));
                notes.push(format!("{p}: works ({} ms)", t.as_millis()));
            }
            Err(e) => notes.push(format!("{p}: {e}")),
        }
    }
    let detail = format!("{} ({})", rs.path.display(), rs.version);
    let finding = match chosen {
        Some(p) => {
            let _ = runsc::record_platform(&rs, &scratch.join("platform"), p);
            Finding::ok("runsc", format!("{detail}, platform {p}; {}", notes.join("; ")))
        }
        None => Finding::warn(
            "runsc",
            format!("{detail}: no platform runs a sandbox; {}", notes.join("; ")),
            "check `runsc --platform=ptrace do true` by hand",
        ),
    };
    (finding, chosen)
}
