//! What the sandbox's `/proc` says about the host, narrowed to what programs need.
//!
//! A fresh procfs in a pid namespace still shows host-wide kernel files. Those that identify or
//! describe the host and that ordinary programs do not need are replaced the way gVisor's own
//! procfs answers them: `cmdline` without the host's boot arguments, `loadavg` as zeros (so
//! `uptime`, `top` and `w` still parse it), and a `boot_id` of the sandbox's own, random at
//! creation and stable for its life. `config.gz`, `diskstats` and `partitions` read empty and
//! `pressure` is an empty directory (as on a kernel without PSI), all of which gVisor lacks
//! too. The synthesized files live in a directory of the writable layer's tmpfs that the
//! sandbox cannot reach except through these read-only binds.

use crate::rootfs::MountOps;
use std::fs;
use std::io;
use std::path::Path;

/// Files of the sandbox's /proc (relative to its new root) replaced by a synthesized one.
const SYNTHESIZED: [(&str, &str); 3] =
    [("cmdline", "proc/cmdline"), ("loadavg", "proc/loadavg"), ("boot_id", "proc/sys/kernel/random/boot_id")];

/// The /proc paths (relative to the root) replaced by synthesized files.
pub(crate) fn synthesized() -> impl Iterator<Item = &'static str> {
    SYNTHESIZED.iter().map(|(_, p)| *p)
}

/// gVisor's answer for the load averages: none measured, and no host figure shown.
const LOADAVG: &str = "0.00 0.00 0.00 0/0 0\n";

/// Writes the synthesized files into `dir` (on the writable layer's tmpfs, before the pivot,
/// while the host's /proc and /dev are still reachable).
pub(crate) fn write_files(dir: &Path) -> io::Result<()> {
    // The kernel release is no secret from a sandbox that shares the kernel (`uname -r`); the
    // boot arguments are.
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let files = [
        ("cmdline", format!("BOOT_IMAGE=/vmlinuz-{} quiet\n", release.trim())),
        ("loadavg", LOADAVG.to_string()),
        ("boot_id", format!("{}\n", random_uuid()?)),
    ];
    for (name, body) in files {
        let p = dir.join(name);
        fs::write(&p, body).map_err(|e| io::Error::new(e.kind(), format!("write {}: {e}", p.display())))?;
    }
    Ok(())
}

/// Binds the files of `dir` over their /proc counterparts under the new root `root`, read-only,
/// after the rest of /proc is masked (a bind over /proc/sys would hide a boot_id bound before
/// it).
pub(crate) fn bind_over_proc(ops: &dyn MountOps, dir: &Path, root: &Path) -> io::Result<()> {
    let ro = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    for (name, target) in SYNTHESIZED {
        let target = root.join(target);
        if target.exists() {
            ops.bind_with(&dir.join(name), &target, ro)?;
        }
    }
    Ok(())
}

/// A random version-4 UUID in the kernel's `boot_id` format.
fn random_uuid() -> io::Result<String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| io::Error::other(e.to_string()))?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32]))
}

#[cfg(test)]
mod tests {
    #[test]
    fn uuids_have_the_boot_id_shape_and_differ() {
        let (a, b) = (super::random_uuid().unwrap(), super::random_uuid().unwrap());
        assert_ne!(a, b);
        let parts: Vec<usize> = a.split('-').map(str::len).collect();
        assert_eq!(parts, [8, 4, 4, 4, 12], "{a}");
        assert_eq!(&a[14..15], "4", "{a}");
    }
}
