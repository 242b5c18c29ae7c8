//! KVM or TCG. /dev/kvm existing proves little (on some hosts it is a backend that cannot run
//! a stock kernel), so KVM is chosen only when a guest actually boots under it: the kit's
//! kernel and init, in probe mode, must print that init is up within a short deadline. The
//! verdict is cached per (host kernel, guest kernel) in `<state>/vm/accel.json`.

use crate::vmm::{Accel, BootSpec, Vmm};
use crate::{guest_kit::Kit, VmError};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Forces the choice: `kvm` or `tcg`.
pub const ENV_ACCEL: &str = "CORDON_VM_ACCEL";
const PROBE_DEADLINE: Duration = Duration::from_secs(8);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Verdict {
    pub accel: Accel,
    /// Why (for `cordon doctor`).
    pub reason: String,
    host_kernel: String,
    guest_kernel: String,
}

fn host_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_string()
}

/// The cached verdict, if it is for this host and kit.
pub fn cached(vm_dir: &Path, guest_kernel: &str) -> Option<Verdict> {
    let v: Verdict = serde_json::from_slice(&std::fs::read(vm_dir.join("accel.json")).ok()?).ok()?;
    (v.host_kernel == host_release() && v.guest_kernel == guest_kernel).then_some(v)
}

pub fn choose(vm_dir: &Path, vmm: &dyn Vmm, kit: &Kit) -> Result<Verdict, VmError> {
    let make = |accel, reason: String| Verdict { accel, reason, host_kernel: host_release(), guest_kernel: kit.kernel_version.clone() };
    match std::env::var(ENV_ACCEL).as_deref() {
        Ok("kvm") => return Ok(make(Accel::Kvm, format!("{ENV_ACCEL}=kvm"))),
        Ok("tcg") => return Ok(make(Accel::Tcg, format!("{ENV_ACCEL}=tcg"))),
        Ok(other) => return Err(VmError::Unsupported(format!("{ENV_ACCEL}={other}: use kvm or tcg"))),
        Err(_) => {}
    }
    if let Some(v) = cached(vm_dir, &kit.kernel_version) {
        return Ok(v);
    }
    let v = if !Path::new("/dev/kvm").exists() {
        make(Accel::Tcg, "no /dev/kvm".into())
    } else {
        match probe(vmm, kit, Accel::Kvm) {
            Ok(t) => make(Accel::Kvm, format!("a guest booted under KVM in {} ms", t.as_millis())),
            Err(e) => make(Accel::Tcg, format!("/dev/kvm is present but a guest does not boot under it ({e})")),
        }
    };
    let _ = std::fs::write(vm_dir.join("accel.json"), serde_json::to_vec(&v).expect("serialises"));
    Ok(v)
}

/// A boot of the kit in probe mode: no disks, no channel; the init powers off as soon as it runs.
pub fn probe_spec(kit: &Kit, accel: Accel) -> BootSpec {
    BootSpec {
        kernel: kit.vmlinux.clone(),
        initramfs: kit.initramfs.clone(),
        cmdline: format!("console=ttyS0 quiet panic=-1 {}", crate::guest::PROBE_ARG),
        memory_mib: 256,
        vcpus: 1,
        accel,
        root_disk: None,
        rw_disk: None,
        channel_fd: None,
        incoming_fd: None,
        monitor_fd: None,
        net_fd: None,
        shares: Vec::new(),
    }
}

/// Boots the kit in probe mode (the init prints that it is up and powers off) and returns how
/// long it took. Also the anchor of the bench: a bare boot of the same kernel and initramfs.
pub fn probe(vmm: &dyn Vmm, kit: &Kit, accel: Accel) -> Result<Duration, String> {
    let spec = probe_spec(kit, accel);
    let start = Instant::now();
    let mut child = Command::new(vmm.binary())
        .args(vmm.args(&spec))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", vmm.binary().display()))?;
    let mut out = child.stdout.take().expect("piped");
    let deadline = start + PROBE_DEADLINE;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no init within {} s", PROBE_DEADLINE.as_secs()));
            }
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    let took = start.elapsed();
    let mut text = String::new();
    let _ = out.read_to_string(&mut text);
    if text.contains(crate::guest::PROBE_OK) {
        Ok(took)
    } else {
        let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output").trim().to_string();
        Err(format!("the guest did not reach init: {last}"))
    }
}
