//! The vm tier's share of the command line: the bench's bare-boot anchor. (Preparing a VM's kit
//! and disk is the tier's `Backend::prepare`, shown by `image_cmd::ensure`.)

use anyhow::Result;

/// `cordon __vm-boot-args`: the VMM command line of a bare boot of the kit (the init powers
/// off at once), as JSON `{"accel": .., "argv": [..]}`: the bench's anchor for boot time.
pub fn boot_args(state: &crate::state::State) -> Result<u8> {
    let tier = state.vm()?;
    let kit = cordon_vm::guest_kit::ensure(tier.vm_dir(), std::path::Path::new("/proc/self/exe"), &mut cordon_image::NoProgress)?;
    let verdict = cordon_vm::accel::choose(tier.vm_dir(), tier.vmm(), &kit)?;
    let spec = cordon_vm::accel::probe_spec(&kit, verdict.accel);
    let mut argv = vec![tier.vmm().binary().display().to_string()];
    argv.extend(tier.vmm().args(&spec));
    println!("{}", serde_json::json!({ "accel": verdict.accel.as_str(), "argv": argv }));
    Ok(0)
}
