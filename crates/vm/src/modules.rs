//! The guest kernel modules the initramfs loads, in dependency order.
//!
//! Debian's kernel package ships no `modules.dep` (depmod writes it at install time), so the
//! dependencies are read from each module's own `.modinfo` section (`depends=a,b`), which is
//! where depmod takes them from too.

use crate::VmError;
use object::{Object, ObjectSection};
use std::collections::{BTreeMap, HashSet};

/// What the guest needs: virtio transports (mmio for microvm and Firecracker, pci for Cloud
/// Hypervisor), the block, console and network drivers, ext4 for the disks and overlayfs for
/// the root. Names that are built into the kernel are skipped.
pub const WANTED: &[&str] = &["virtio_mmio", "virtio_pci", "virtio_blk", "virtio_console", "virtio_net", "ext4", "overlay", "virtiofs"];

/// One module: its name as the kernel knows it, what it needs loaded first, and its bytes.
pub struct Module {
    pub name: String,
    pub depends: Vec<String>,
    pub data: Vec<u8>,
}

/// Reads `name` and `depends` from a module's `.modinfo`.
pub fn parse(file_name: &str, data: Vec<u8>) -> Result<Module, VmError> {
    let bad = |m: String| VmError::Kit(format!("kernel module {file_name}: {m}"));
    let (name, depends) = {
        let obj = object::File::parse(&*data).map_err(|e| bad(e.to_string()))?;
        let info = obj.section_by_name(".modinfo").ok_or_else(|| bad("no .modinfo section".into()))?;
        let info = info.data().map_err(|e| bad(e.to_string()))?;
        let mut name = None;
        let mut depends = Vec::new();
        for field in info.split(|b| *b == 0) {
            let field = String::from_utf8_lossy(field);
            if let Some(n) = field.strip_prefix("name=") {
                name = Some(n.to_string());
            } else if let Some(d) = field.strip_prefix("depends=") {
                depends = d.split(',').filter(|s| !s.is_empty()).map(String::from).collect();
            }
        }
        let name = name.unwrap_or_else(|| file_name.trim_end_matches(".ko").replace('-', "_"));
        (name, depends)
    };
    Ok(Module { name, depends, data })
}

/// The modules to load for `wanted`, dependencies first. `builtin` names need no loading.
pub fn load_order(all: &BTreeMap<String, Module>, wanted: &[&str], builtin: &HashSet<String>) -> Result<Vec<String>, VmError> {
    fn visit(
        name: &str,
        all: &BTreeMap<String, Module>,
        builtin: &HashSet<String>,
        seen: &mut HashSet<String>,
        out: &mut Vec<String>,
    ) -> Result<(), VmError> {
        if builtin.contains(name) || !seen.insert(name.to_string()) {
            return Ok(());
        }
        let m = all
            .get(name)
            .ok_or_else(|| VmError::Kit(format!("kernel module {name} is neither built in nor shipped by the kernel package")))?;
        for d in &m.depends {
            visit(d, all, builtin, seen, out)?;
        }
        out.push(name.to_string());
        Ok(())
    }
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for w in wanted {
        visit(w, all, builtin, &mut seen, &mut out)?;
    }
    Ok(out)
}

/// Module names listed in `modules.builtin` (paths like `kernel/fs/ext4/ext4.ko`).
pub fn builtin_names(text: &str) -> HashSet<String> {
    text.lines()
        .filter_map(|l| l.rsplit('/').next())
        .map(|f| f.trim_end_matches(".ko").replace('-', "_"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(name: &str, deps: &[&str]) -> (String, Module) {
        (name.into(), Module { name: name.into(), depends: deps.iter().map(|s| s.to_string()).collect(), data: vec![] })
    }

    #[test]
    fn dependencies_come_first_and_builtins_are_skipped() {
        let all: BTreeMap<_, _> = [
            m("virtio_blk", &["virtio", "virtio_ring"]),
            m("virtio_mmio", &["virtio", "virtio_ring"]),
            m("virtio", &[]),
            m("virtio_ring", &[]),
            m("overlay", &[]),
        ]
        .into_iter()
        .collect();
        let builtin = builtin_names("kernel/fs/ext4/ext4.ko\nkernel/fs/jbd2/jbd2.ko\n");
        let order = load_order(&all, &["virtio_mmio", "virtio_blk", "ext4", "overlay"], &builtin).unwrap();
        assert_eq!(order, ["virtio", "virtio_ring", "virtio_mmio", "virtio_blk", "overlay"]);
        assert!(load_order(&all, &["nope"], &builtin).is_err());
    }
}
