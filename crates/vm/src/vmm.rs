//! The virtual machine monitor behind the tier. [`Vmm`] is what a VMM has to provide: the
//! binary, its arguments for one boot, and the host paths it needs inside its jail. QEMU's
//! `microvm` machine is the one implemented; Firecracker and Cloud Hypervisor boot the same
//! vmlinux (PVH/ELF), initramfs, disks (virtio-blk, found by serial) and agent channel
//! (virtio-console port, or vsock where the host has vhost-vsock), so each is one more impl.

use crate::VmError;
use std::path::{Path, PathBuf};

/// Names the QEMU binary to use instead of `qemu-system-x86_64` on PATH.
pub const ENV_QEMU: &str = "CORDON_QEMU";

/// How the guest's CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualisation through /dev/kvm.
    Kvm,
    /// QEMU's software emulation (no KVM needed; about 4-20x slower).
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    /// How many times longer work inside the guest may take than on the host, for whatever
    /// waits on it (an image's start command). The code interpreter's server and first kernel,
    /// ready in 3 s in an `ns` sandbox, took 66 s under TCG here (22x): a waiting budget sized
    /// for the host gets this factor, which leaves room for a busy host.
    pub fn slowdown(self) -> u32 {
        match self {
            Accel::Kvm => 1,
            Accel::Tcg => 8,
        }
    }
}

/// The MAC every VM's interface starts with (see [`BootSpec::net_fd`]).
pub const TEMPLATE_MAC: &str = "02:c0:d0:00:00:02";

/// One boot, with paths as the VMM sees them inside its jail.
#[derive(Debug, Clone)]
pub struct BootSpec {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// Kernel command line (the VMM may append its own).
    pub cmdline: String,
    pub memory_mib: u64,
    pub vcpus: u32,
    pub accel: Accel,
    /// The image disk, attached read-only; `None` for the boot probe.
    pub root_disk: Option<PathBuf>,
    /// The writable layer.
    pub rw_disk: Option<PathBuf>,
    /// The host end of the agent channel, as a descriptor number in the VMM process.
    pub channel_fd: Option<i32>,
    /// Start from the machine state readable on this descriptor instead of booting.
    pub incoming_fd: Option<i32>,
    /// A QMP monitor on this socket descriptor (template VMs only, to save their state).
    pub monitor_fd: Option<i32>,
    /// A virtio-net interface whose frames go to this Unix datagram socket, one per datagram
    /// (see `cordon_net::ethernet`). Its MAC here is the same for every VM, so that VMs of one
    /// kind share a snapshot; the guest sets its own when it gets its config.
    pub net_fd: Option<i32>,
    /// virtio-fs shares: (vhost-user socket path inside the jail, tag). Their daemons map the
    /// guest's memory, which is then a shared memfd.
    pub shares: Vec<(PathBuf, String)>,
}

pub trait Vmm: Send + Sync {
    fn name(&self) -> &'static str;
    /// The binary, as found on the host.
    fn binary(&self) -> &Path;
    fn args(&self, spec: &BootSpec) -> Vec<String>;
    /// Whether VMs can start from a saved state: `monitor_fd` then takes QMP and `incoming_fd`
    /// a state to resume (see [`crate::snapshot`]). Firecracker's own snapshot API would be
    /// another way to provide it.
    fn snapshots(&self) -> bool {
        false
    }
}

/// QEMU with `-M microvm`: no PCI, no firmware tables beyond ACPI, virtio-mmio devices only.
pub struct Qemu {
    bin: PathBuf,
    /// Host TSC frequency: under TCG the guest cannot calibrate its TSC (microvm has no PIT or
    /// HPET to measure against) and hangs unless told.
    tsc_khz: Option<u64>,
}

impl Qemu {
    /// Finds QEMU: `CORDON_QEMU` if set (it must exist), else `qemu-system-x86_64` on PATH.
    pub fn find() -> Result<Qemu, VmError> {
        let bin = match std::env::var_os(ENV_QEMU) {
            Some(p) => {
                let p = PathBuf::from(p);
                if !p.is_file() {
                    return Err(VmError::Unsupported(format!(
                        "{ENV_QEMU}={}: no such file; point it at a qemu-system-x86_64 binary or unset it",
                        p.display()
                    )));
                }
                p
            }
            None => which("qemu-system-x86_64").ok_or_else(|| {
                VmError::Unsupported(
                    "QEMU is not installed (qemu-system-x86_64 not on PATH): install it with `apt-get install qemu-system-x86` \
                     (scripts/install-deps does) or set CORDON_QEMU"
                        .into(),
                )
            })?,
        };
        Ok(Qemu { bin, tsc_khz: host_tsc_khz() })
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .unwrap_or_else(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into())
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// The host's TSC frequency from /proc/cpuinfo (`cpu MHz`); TCG's guest TSC is the host's.
fn host_tsc_khz() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = text.lines().find(|l| l.starts_with("cpu MHz"))?.split(':').nth(1)?.trim().parse().ok()?;
    Some((mhz * 1000.0) as u64)
}

impl Vmm for Qemu {
    fn name(&self) -> &'static str {
        "qemu-microvm"
    }

    fn binary(&self) -> &Path {
        &self.bin
    }

    fn snapshots(&self) -> bool {
        true
    }

    fn args(&self, s: &BootSpec) -> Vec<String> {
        let mut cmdline = format!("{} pci=off", s.cmdline);
        let (accel, cpu) = match s.accel {
            Accel::Kvm => ("kvm".to_string(), "host"),
            Accel::Tcg => {
                if let Some(khz) = self.tsc_khz {
                    cmdline.push_str(&format!(" tsc_early_khz={khz}"));
                }
                // Bounded translation cache: the default (1 GiB) would count against the cgroup.
                ("tcg,tb-size=64".to_string(), "max")
            }
        };
        let mut a: Vec<String> = [
            "-M", "microvm,x-option-roms=off,rtc=off",
            "-accel", &accel,
            "-cpu", cpu,
            "-m", &format!("{}M", s.memory_mib),
            "-smp", &s.vcpus.to_string(),
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            // QEMU's own seccomp filter: no obsolete syscalls, no setuid, no fork/exec, no
            // scheduler or resource changes.
            "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            "-serial", "stdio",
            "-kernel", &s.kernel.to_string_lossy(),
            "-initrd", &s.initramfs.to_string_lossy(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for (disk, serial, ro) in [(&s.root_disk, crate::guest::ROOT_SERIAL, true), (&s.rw_disk, crate::guest::RW_SERIAL, false)] {
            if let Some(d) = disk {
                let opts = if ro { "readonly=on" } else { "cache=unsafe,discard=unmap" };
                a.push("-drive".into());
                a.push(format!("id={serial},file={},format=raw,if=none,{opts}", d.display()));
                a.push("-device".into());
                a.push(format!("virtio-blk-device,drive={serial},serial={serial}"));
            }
        }
        if let Some(fd) = s.channel_fd {
            a.extend(
                [
                    "-device".to_string(),
                    "virtio-serial-device,max_ports=2".into(),
                    "-chardev".into(),
                    format!("socket,id=agent,fd={fd}"),
                    "-device".into(),
                    format!("virtserialport,chardev=agent,name={}", crate::guest::PORT_NAME),
                ],
            );
        }
        if !s.shares.is_empty() {
            a.extend([
                "-object".to_string(),
                format!("memory-backend-memfd,id=mem,size={}M,share=on", s.memory_mib),
                "-machine".into(),
                "memory-backend=mem".into(),
                // vhost-user devices speak modern virtio only; microvm's mmio transport is
                // legacy unless told otherwise.
                "-global".into(),
                "virtio-mmio.force-legacy=false".into(),
            ]);
            for (i, (socket, tag)) in s.shares.iter().enumerate() {
                a.extend([
                    "-chardev".to_string(),
                    format!("socket,id=vfs{i},path={}", socket.display()),
                    "-device".into(),
                    format!("vhost-user-fs-device,chardev=vfs{i},tag={tag}"),
                ]);
            }
        }
        if let Some(fd) = s.net_fd {
            a.extend([
                "-netdev".to_string(),
                format!("socket,id=net0,fd={fd}"),
                "-device".into(),
                format!("virtio-net-device,netdev=net0,mac={TEMPLATE_MAC},host_mtu={}", cordon_host::tun::MTU),
            ]);
        }
        if let Some(fd) = s.monitor_fd {
            a.extend(["-chardev".to_string(), format!("socket,id=monitor,fd={fd}"), "-mon".into(), "chardev=monitor,mode=control".into()]);
        }
        if let Some(fd) = s.incoming_fd {
            a.extend(["-incoming".to_string(), format!("fd:{fd}")]);
        }
        a.push("-append".into());
        a.push(cmdline);
        a
    }
}
