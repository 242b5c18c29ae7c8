//! What the vm tier needs of the host (`cordon doctor`): the tool that makes its disks, a VMM,
//! and whether guests run under KVM or TCG here (a real boot decides, not the presence of
//! /dev/kvm). Opening the tier also reaps VMs a crashed cordon left.

use cordon_sandbox::diagnosis::{Diagnosis, Finding};
use cordon_sandbox::Host;

use crate::VmTier;

/// The tier's checks, and whether it opens; the verdict's summary says how guests will run.
pub fn diagnose(host: &Host) -> Diagnosis {
    let mut findings = vec![
        mkfs(),
        Finding::ok(
            "pause",
            "with memory, to disk: the guest's memory and devices to a file by QEMU migration, the VMM exits and frees its RAM (pauseMode full); snapshots and forks keep memory too; to files: the guest syncs, its whole disk image is kept (never mounted by the host) and a resume boots afresh on it (pauseMode filesystem)",
        ),
    ];
    let tier = match VmTier::open(&host.state_dir, host.exe.clone()) {
        Ok(t) => t,
        Err(e) => {
            findings.push(Finding::warn("vm tier", e.to_string(), "apt-get install qemu-system-x86 (scripts/install-deps), or set CORDON_QEMU"));
            return Diagnosis { findings, verdict: Err(e.to_string()) };
        }
    };
    findings.push(Finding::ok("vmm", format!("{} ({})", tier.vmm().binary().display(), tier.vmm().name())));
    let kdir = tier.vm_dir().join("kernel");
    let Some(kernel) = crate::guest_kit::current_kernel(&kdir) else {
        let summary = "guest kit not built yet (built on the first `cordon run --tier vm`); KVM or TCG is decided then";
        findings.push(Finding::ok("vm tier", summary));
        return Diagnosis { findings, verdict: Ok(Some(summary.into())) };
    };
    findings.push(Finding::ok("guest kernel", format!("{kernel} in {}", kdir.display())));
    // The probe needs the kit (initramfs); building it is cheap once the kernel is cached.
    let accel = crate::guest_kit::ensure(tier.vm_dir(), &host.exe, &mut cordon_image::NoProgress)
        .and_then(|kit| crate::accel::choose(tier.vm_dir(), tier.vmm(), &kit));
    match accel {
        Ok(v) => {
            let summary = format!("{} ({})", v.accel.as_str(), v.reason);
            findings.push(Finding::ok("vm tier", summary.clone()));
            Diagnosis { findings, verdict: Ok(Some(summary)) }
        }
        Err(e) => {
            findings.push(Finding::warn("vm tier", e.to_string(), "see the message"));
            Diagnosis { findings, verdict: Err(e.to_string()) }
        }
    }
}

fn mkfs() -> Finding {
    match cordon_host::sys::which("mkfs.ext4") {
        Some(p) => Finding::ok("mkfs.ext4", p.display().to_string()),
        None => Finding::warn("mkfs.ext4", "not installed (the vm tier makes its disks with it)", "apt-get install e2fsprogs"),
    }
}
