//! The guest kit: a Debian kernel (as an uncompressed vmlinux), the modules the guest needs,
//! and an initramfs holding the cordon binary as `/init`. Built from the apt registry on first
//! use and cached under `<state>/vm/`; nothing is downloaded again once it is there.
//!
//! ```text
//! <state>/vm/kernel/current                  the version in use
//! <state>/vm/kernel/<version>/vmlinux        ELF, booted through its PVH entry
//! <state>/vm/kernel/<version>/modules/*.ko   + `order`, one name a line
//! <state>/vm/initramfs/<key>.cpio            per (kernel, cordon binary)
//! ```

use crate::{initramfs, modules, vmlinux, VmError};
use cordon_image::Progress;
use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The Debian kernel flavour whose virtio drivers are modules and whose ext4 is built in.
pub const DEFAULT_KERNEL_PACKAGE: &str = "linux-image-cloud-amd64";
/// Names another kernel package (or metapackage) to build the kit from.
pub const ENV_KERNEL_PACKAGE: &str = "CORDON_VM_KERNEL_PACKAGE";

/// A ready guest kit.
#[derive(Debug, Clone)]
pub struct Kit {
    pub kernel_version: String,
    pub vmlinux: PathBuf,
    pub initramfs: PathBuf,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let what = what.into();
    move |e| VmError::Io { what, source: e }
}

/// The kit for this state dir, building whatever part is missing. `exe` is the cordon binary
/// that becomes the guest's `/init`.
pub fn ensure(vm_dir: &Path, exe: &Path, progress: &mut dyn Progress) -> Result<Kit, VmError> {
    let kdir = vm_dir.join("kernel");
    let version = match current_kernel(&kdir) {
        Some(v) => v,
        None => build_kernel(&kdir, progress)?,
    };
    let kernel = kdir.join(&version);
    let initramfs = ensure_initramfs(vm_dir, &kernel, &version, exe, progress)?;
    Ok(Kit { kernel_version: version, vmlinux: kernel.join("vmlinux"), initramfs })
}

/// The cached kernel version, if its kit is complete.
pub fn current_kernel(kdir: &Path) -> Option<String> {
    let v = fs::read_to_string(kdir.join("current")).ok()?.trim().to_string();
    let k = kdir.join(&v);
    // A kit made for fewer modules than are wanted now is made again.
    let wanted = fs::read_to_string(k.join("modules/wanted")).ok()?;
    (k.join("vmlinux").is_file() && k.join("modules/order").is_file() && wanted == wanted_list()).then_some(v)
}

fn wanted_list() -> String {
    modules::WANTED.join("\n") + "\n"
}

const STAGES: usize = 5;

fn run(cmd: &mut Command, what: &str) -> Result<String, VmError> {
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| {
        VmError::Kit(format!("{what}: cannot run {:?}: {e} (the vm tier needs apt and dpkg: a Debian or Ubuntu host)", cmd.get_program()))
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("").trim().to_string();
        return Err(VmError::Kit(format!("{what} failed ({}): {last}", out.status)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The concrete package a metapackage such as `linux-image-cloud-amd64` points at.
fn resolve_package(meta: &str) -> Result<String, VmError> {
    let deps = |()| run(Command::new("apt-cache").args(["depends", "--no-recommends", "--no-suggests", meta]), "apt-cache depends");
    let text = match deps(()) {
        Ok(t) if t.contains("Depends:") => t,
        _ => {
            // Fresh machines often have no package lists yet.
            run(Command::new("apt-get").args(["update", "-qq"]), "apt-get update")?;
            deps(())?
        }
    };
    let concrete = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Depends:"))
        .map(str::trim)
        .find(|p| p.starts_with("linux-image-") && p.as_bytes().get(12).is_some_and(u8::is_ascii_digit));
    Ok(concrete.map(String::from).unwrap_or_else(|| meta.to_string()))
}

fn build_kernel(kdir: &Path, progress: &mut dyn Progress) -> Result<String, VmError> {
    fs::create_dir_all(kdir).map_err(io(format!("create {}", kdir.display())))?;
    let meta = std::env::var(ENV_KERNEL_PACKAGE).unwrap_or_else(|_| DEFAULT_KERNEL_PACKAGE.to_string());
    progress.stage(0, STAGES, "resolve kernel package");
    let pkg = resolve_package(&meta)?;
    progress.line(&pkg);

    progress.stage(1, STAGES, "download kernel");
    let tmp = kdir.join(format!(".tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(io("create download dir"))?;
    let cleanup = TmpDir(tmp.clone());
    run(Command::new("apt-get").args(["download", "-q", &pkg]).current_dir(&tmp), &format!("apt-get download {pkg}"))?;
    let deb = fs::read_dir(&tmp)
        .map_err(io("list download dir"))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| VmError::Kit(format!("apt-get download {pkg} produced no .deb")))?;

    progress.stage(2, STAGES, "unpack kernel");
    let unpacked = unpack_deb(&deb)?;
    let version = unpacked.version.clone();
    progress.line(&format!("kernel {version}, {} modules", unpacked.modules.len()));

    progress.stage(3, STAGES, "extract vmlinux");
    let vmlinux = vmlinux::extract(&unpacked.bzimage)?;
    let builtin = modules::builtin_names(&unpacked.builtin);
    let order = modules::load_order(&unpacked.modules, modules::WANTED, &builtin)?;
    let staged = tmp.join("kit");
    let mdir = staged.join("modules");
    fs::create_dir_all(&mdir).map_err(io("create modules dir"))?;
    fs::write(staged.join("vmlinux"), &vmlinux).map_err(io("write vmlinux"))?;
    for name in &order {
        fs::write(mdir.join(format!("{name}.ko")), &unpacked.modules[name].data).map_err(io("write module"))?;
    }
    fs::write(mdir.join("order"), order.join("\n") + "\n").map_err(io("write module order"))?;
    fs::write(mdir.join("wanted"), wanted_list()).map_err(io("write the wanted modules"))?;
    let dest = kdir.join(&version);
    let _ = fs::remove_dir_all(&dest);
    fs::rename(&staged, &dest).map_err(io(format!("install kernel into {}", dest.display())))?;
    let cur_tmp = kdir.join("current.tmp");
    fs::write(&cur_tmp, &version).map_err(io("write current kernel"))?;
    fs::rename(&cur_tmp, kdir.join("current")).map_err(io("write current kernel"))?;
    drop(cleanup);
    tracing::debug!(%version, modules = ?order, vmlinux_bytes = vmlinux.len(), "guest kernel ready");
    Ok(version)
}

struct TmpDir(PathBuf);
impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

struct Unpacked {
    version: String,
    bzimage: Vec<u8>,
    builtin: String,
    modules: BTreeMap<String, modules::Module>,
}

/// Streams the package's data archive (`dpkg-deb --fsys-tarfile`, which handles every
/// compression dpkg supports) and keeps the kernel, `modules.builtin` and the modules.
fn unpack_deb(deb: &Path) -> Result<Unpacked, VmError> {
    let mut child = Command::new("dpkg-deb")
        .arg("--fsys-tarfile")
        .arg(deb)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| VmError::Kit(format!("cannot run dpkg-deb: {e}")))?;
    let stdout = child.stdout.take().expect("piped");
    let mut ar = tar::Archive::new(stdout);
    let mut bzimage = None;
    let mut version = None;
    let mut builtin = String::new();
    let mut mods = BTreeMap::new();
    let entries = ar.entries().map_err(io("read kernel package"))?;
    for entry in entries {
        let mut entry = entry.map_err(io("read kernel package"))?;
        let path = entry.path().map_err(io("read kernel package"))?.to_string_lossy().trim_start_matches("./").to_string();
        if let Some(v) = path.strip_prefix("boot/vmlinuz-") {
            version = Some(v.to_string());
            let mut b = Vec::new();
            entry.read_to_end(&mut b).map_err(io("read vmlinuz"))?;
            bzimage = Some(b);
        } else if path.starts_with("lib/modules/") && path.ends_with("/modules.builtin") {
            entry.read_to_string(&mut builtin).map_err(io("read modules.builtin"))?;
        } else if path.starts_with("lib/modules/") && path.ends_with(".ko") {
            let file = path.rsplit('/').next().unwrap_or_default().to_string();
            let mut b = Vec::new();
            entry.read_to_end(&mut b).map_err(io("read module"))?;
            let m = modules::parse(&file, b)?;
            mods.insert(m.name.clone(), m);
        }
    }
    let status = child.wait().map_err(io("wait for dpkg-deb"))?;
    if !status.success() {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        return Err(VmError::Kit(format!("dpkg-deb --fsys-tarfile {} failed: {}", deb.display(), err.trim())));
    }
    match (bzimage, version) {
        (Some(bzimage), Some(version)) => Ok(Unpacked { version, bzimage, builtin, modules: mods }),
        _ => Err(VmError::Kit(format!("{} holds no boot/vmlinuz-*: not a kernel package", deb.display()))),
    }
}

/// The initramfs for this kernel and this cordon binary; rebuilt when either changes (a new
/// cordon binary must also be the new guest init).
fn ensure_initramfs(vm_dir: &Path, kernel: &Path, version: &str, exe: &Path, progress: &mut dyn Progress) -> Result<PathBuf, VmError> {
    let meta = fs::metadata(exe).map_err(io(format!("stat {}", exe.display())))?;
    let key = format!("{version}-{:x}-{:x}-{:x}", meta.len(), meta.mtime(), meta.ino());
    let dir = vm_dir.join("initramfs");
    let path = dir.join(format!("{key}.cpio"));
    if path.is_file() {
        return Ok(path);
    }
    progress.stage(4, STAGES, "write initramfs");
    fs::create_dir_all(&dir).map_err(io(format!("create {}", dir.display())))?;
    // Older initramfs files belong to replaced binaries (live VMs keep theirs open). One that is
    // recent may belong to another cordon binary still in use (a server next to a newer CLI)
    // that is about to start a VM from it: those stay.
    if let Ok(rd) = fs::read_dir(&dir) {
        let stale = std::time::SystemTime::now() - std::time::Duration::from_secs(24 * 3600);
        for e in rd.flatten() {
            if e.metadata().and_then(|m| m.modified()).is_ok_and(|t| t < stale) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    let tmp = dir.join(format!(".{key}.{}", std::process::id()));
    initramfs::write(&tmp, exe, &kernel.join("modules")).map_err(io("write initramfs"))?;
    fs::rename(&tmp, &path).map_err(io("install initramfs"))?;
    Ok(path)
}
