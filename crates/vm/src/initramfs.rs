//! The guest's initramfs, a newc cpio archive the kernel unpacks into its rootfs:
//!
//! ```text
//! /init                   the cordon binary (static); it runs the guest init as PID 1
//! /dev/console            so the kernel can give init its stdio before devtmpfs is mounted
//! /lib/modules/*.ko       the modules of the kit, and `order`
//! /dev /proc /sys /mnt    mount points
//! ```
//!
//! Uncompressed: the kernel copies it faster than it could decompress it under TCG.

use std::fs;
use std::io::{self, BufWriter, Write};
use std::path::Path;

pub fn write(dest: &Path, exe: &Path, modules: &Path) -> io::Result<()> {
    let mut w = BufWriter::new(fs::File::create(dest)?);
    let mut ino = 1u32;
    let mut next = || {
        ino += 1;
        ino
    };
    for d in ["dev", "proc", "sys", "mnt", "lib", "lib/modules"] {
        w = cpio::newc::Builder::new(d).ino(next()).mode(0o040755).nlink(2).write(w, 0).finish()?;
    }
    // /dev/console: character device 5:1.
    w = cpio::newc::Builder::new("dev/console").ino(next()).mode(0o020600).rdev_major(5).rdev_minor(1).write(w, 0).finish()?;
    let file = |w: BufWriter<fs::File>, name: &str, data: &[u8], mode: u32, ino: u32| -> io::Result<BufWriter<fs::File>> {
        let len = u32::try_from(data.len()).map_err(|_| io::Error::other(format!("{name} is too large for cpio")))?;
        let mut fw = cpio::newc::Builder::new(name).ino(ino).mode(mode).nlink(1).write(w, len);
        fw.write_all(data)?;
        fw.finish()
    };
    let bin = fs::read(exe)?;
    w = file(w, "init", &bin, 0o100755, next())?;
    let order = fs::read_to_string(modules.join("order"))?;
    w = file(w, "lib/modules/order", order.as_bytes(), 0o100644, next())?;
    for name in order.lines().filter(|l| !l.is_empty()) {
        let data = fs::read(modules.join(format!("{name}.ko")))?;
        w = file(w, &format!("lib/modules/{name}.ko"), &data, 0o100644, next())?;
    }
    let mut w = cpio::newc::trailer(w)?;
    w.flush()?;
    w.get_ref().sync_all()
}
