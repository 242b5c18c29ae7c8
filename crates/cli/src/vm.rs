//! The vm tier's share of the command line: preparing a VM's kit and disk with progress.

use crate::progress::Bar;
use anyhow::Result;
use cordon_image::Progress;

/// Shows a bar only once something has to be built (the kit or an image's disk).
struct Lazy {
    bar: Option<Bar>,
}

impl Progress for Lazy {
    fn stage(&mut self, index: usize, total: usize, name: &str) {
        self.bar.get_or_insert_with(|| Bar::new("vm")).stage(index, total, name);
    }

    fn line(&mut self, text: &str) {
        if let Some(b) = &mut self.bar {
            b.line(text);
        }
    }
}

/// The kit (built and cached on first use), the accelerator and the image's disk, with a
/// progress bar when something has to be built; the backend then finds them cached.
pub fn prepare(state: &crate::state::State, store: &cordon_image::Store, image: &str) -> Result<()> {
    let tier = state.vm().map_err(|e| crate::usage(e.to_string()))?;
    let image = store.get(image)?;
    let mut p = Lazy { bar: None };
    let r = tier.prepare(&image.name, &image.rootfs, &mut p);
    if let Some(bar) = &p.bar {
        match &r {
            Ok(prep) => bar.finish(&format!("guest kernel {}, {} ({})", prep.kit.kernel_version, prep.accel.accel.as_str(), prep.accel.reason)),
            Err(_) => bar.abandon(),
        }
    }
    r?;
    Ok(())
}

/// `cordon __vm-boot-args`: the VMM command line of a bare boot of the kit (the init powers
/// off at once), as JSON `{"accel": .., "argv": [..]}`: the bench's anchor for boot time.
pub fn boot_args(state: &crate::state::State) -> Result<u8> {
    let tier = state.vm()?;
    let kit = cordon_vm::kit::ensure(tier.vm_dir(), std::path::Path::new("/proc/self/exe"), &mut cordon_image::NoProgress)?;
    let verdict = cordon_vm::accel::choose(tier.vm_dir(), tier.vmm(), &kit)?;
    let spec = cordon_vm::accel::probe_spec(&kit, verdict.accel);
    let mut argv = vec![tier.vmm().binary().display().to_string()];
    argv.extend(tier.vmm().args(&spec));
    println!("{}", serde_json::json!({ "accel": verdict.accel.as_str(), "argv": argv }));
    Ok(0)
}
