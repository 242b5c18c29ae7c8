//! The vm tier: real QEMU microVMs with the Debian guest kernel, driven through `cordon run
//! --tier vm`. Under TCG (no usable KVM on this machine kind) each boot takes seconds, so each
//! test boots once and checks as much as that one VM can show.

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Skips (with the reason) when QEMU is not installed; in CI scripts/install-deps installs it.
macro_rules! require_vm {
    () => {
        require_root!();
        if let Some(why) = Tier::Vm.unavailable() {
            common::skip(&why);
            return;
        }
    };
}

fn vm_run(flags: &[&str], cmd: &[&str]) -> Run {
    let mut f = vec!["--tier", "vm"];
    f.extend_from_slice(flags);
    run(&f, cmd)
}

/// Nothing of VM `id` remains: no VMM process, no state (socket, writable layer, record), no
/// cgroup, no mount.
fn assert_vm_clean(id: &str) {
    assert_clean(id);
    let dir = state_dir().join("vm/run").join(id);
    wait_until(Duration::from_secs(5), || !dir.exists());
    assert!(!dir.exists(), "VM state {} remains", dir.display());
    // A zombie holds nothing but its pid; reaping it is the host init's job once cordon is gone.
    let qemu_in_cgroup = || {
        host_processes().into_iter().find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/cgroup")).unwrap_or_default().contains(id)
                && std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.starts_with("qemu"))
                && std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, r)| !r.starts_with('Z')))
        })
    };
    assert!(qemu_in_cgroup().is_none(), "a VMM of {id} remains");
}

fn host_file(p: &str) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

#[test]
fn python_prints_42_in_a_vm() {
    require_vm!();
    let r = vm_run(&[], &["python3", "-c", "print(6*7)"]);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(r.stdout, "42\n", "{r:?}");
    assert_eq!(r.reason(), "exit");
    assert_vm_clean(r.id());
}

/// One VM, as guest root: its own kernel, and kernel-level actions (sysctl writes, mounts,
/// hostname, module list) that stay in the guest; caps and no network, seen from inside.
#[test]
fn guest_has_its_own_kernel_and_root_there_cannot_touch_the_host() {
    require_vm!();
    let host_domain = host_file("/proc/sys/kernel/domainname");
    let host_hostname = host_file("/proc/sys/kernel/hostname");
    let host_mounts = host_file("/proc/mounts");
    let marker = format!("cordon-guest-{}", token());
    let script = format!(
        r#"
echo "uname=$(uname -r)"
echo "version=$(cat /proc/version)"
echo "hostname=$(cat /proc/sys/kernel/hostname)"
echo "nproc=$(nproc)"
echo "memtotal=$(awk '/MemTotal/ {{print $2}}' /proc/meminfo)"
echo "modules=$(cut -d' ' -f1 /proc/modules | sort | tr '\n' ,)"
echo {marker} > /proc/sys/kernel/domainname && echo "domain=$(cat /proc/sys/kernel/domainname)"
echo {marker}-h > /proc/sys/kernel/hostname && echo "newhost=$(cat /proc/sys/kernel/hostname)"
mkdir -p /mnt/{marker} && mount -t tmpfs {marker} /mnt/{marker} && echo "mounted=$(grep -c {marker} /proc/mounts)"
echo "ifaces=$(ls /sys/class/net | tr '\n' ,)"
python3 -c 'import socket
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("198.51.100.1", 80)); print("net=connected")
except OSError as e:
    print("net=" + type(e).__name__ + ":" + str(e.errno))'
python3 -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
c = socket.create_connection(s.getsockname(), timeout=5); print("loopback=ok")'
dd if=/dev/zero of=/root/fill bs=1M count=100 2>&1 | grep -o 'No space left on device' | head -1 | sed 's/^/dd=/'
echo "whoami=$(whoami)"
"#
    );
    let r = vm_run(&["--user", "root", "--cpus", "2", "--memory", "256M", "--disk", "64M"], &["bash", "-c", &script]);
    assert_eq!(r.code, 0, "{r:?}");
    let get = |k: &str| {
        r.stdout.lines().find_map(|l| l.strip_prefix(&format!("{k}="))).unwrap_or_else(|| panic!("no {k} in {r:?}")).to_string()
    };
    // Its own kernel: Debian's, not the host's.
    let host_release = host_file("/proc/sys/kernel/osrelease").trim().to_string();
    assert_ne!(get("uname"), host_release, "{r:?}");
    assert!(get("uname").contains("cloud-amd64"), "{r:?}");
    assert_ne!(get("version").trim(), host_file("/proc/version").trim());
    assert!(get("version").contains("Debian"), "{r:?}");
    assert_eq!(get("hostname"), r.id(), "hostname is the sandbox id");
    assert_eq!(get("nproc"), "2", "vCPUs from --cpus");
    let mem_kib: u64 = get("memtotal").parse().unwrap();
    assert!(mem_kib <= 256 * 1024 && mem_kib > 150 * 1024, "guest RAM is the memory cap: {mem_kib} KiB");
    // The guest kernel loaded its own modules; the host has none loaded (or cannot load any).
    assert!(get("modules").contains("virtio_blk") && get("modules").contains("overlay"), "{r:?}");
    // Kernel-level actions succeed in the guest ...
    assert_eq!(get("domain"), marker);
    assert_eq!(get("newhost"), format!("{marker}-h"));
    assert_eq!(get("mounted"), "1");
    assert_eq!(get("whoami"), "root");
    // ... and leave the host as it was.
    assert_eq!(host_file("/proc/sys/kernel/domainname"), host_domain);
    assert_eq!(host_file("/proc/sys/kernel/hostname"), host_hostname);
    assert!(!host_file("/proc/mounts").contains(&marker));
    assert_eq!(host_mounts.lines().filter(|l| l.contains("cordon-guest")).count(), 0);
    // No network at all: loopback only, and nothing routes out.
    assert_eq!(get("ifaces"), "lo,", "{r:?}");
    assert!(get("net").starts_with("OSError:101") || get("net").contains(":101"), "{r:?}");
    // Loopback works: servers inside are reached through it by the agent's port forwarding.
    assert_eq!(get("loopback"), "ok", "{r:?}");
    // The disk cap is the writable layer's size.
    assert_eq!(get("dd"), "No space left on device", "{r:?}");
    assert_vm_clean(r.id());
}

#[test]
fn memory_cap_ends_with_oom() {
    require_vm!();
    let r = vm_run(&["--memory", "192M"], &["python3", "-c", "a = []\nwhile True: a.append(bytearray(8 << 20))"]);
    assert_eq!(r.code, 137, "{r:?}");
    assert_eq!(r.reason(), "oom", "{r:?}");
    assert!(r.stderr.contains("out of memory (limit 192 MiB)"), "{r:?}");
    assert_vm_clean(r.id());
}

#[test]
fn timeout_kills_the_vm_with_124() {
    require_vm!();
    let t = Instant::now();
    let r = vm_run(&["--timeout", "4s"], &["sleep", "600"]);
    assert_eq!(r.code, 124, "{r:?}");
    assert_eq!(r.reason(), "timeout", "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(120), "took {:?}", t.elapsed());
    assert_vm_clean(r.id());
}

#[test]
fn files_and_stdin_go_through_the_agent() {
    require_vm!();
    let dir = std::env::temp_dir().join(format!("cordon-vm-copy-{}", token()));
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("a.txt"), "alpha\n").unwrap();
    std::fs::write(dir.join("sub/b.bin"), vec![7u8; 300_000]).unwrap();
    let copy = format!("{}:/home/user/in", dir.display());
    let r = run_with_stdin(
        &["--tier", "vm", "--copy", &copy],
        &["bash", "-c", "cat /home/user/in/a.txt; stat -c %s /home/user/in/sub/b.bin; stat -c %U /home/user/in/a.txt; wc -c"],
        &vec![b'x'; 100_000],
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(r.stdout, "alpha\n300000\nuser\n100000\n", "{r:?}");
    assert_vm_clean(r.id());
}

/// `cordon run --json --tier vm` with the vm crate's log on stderr, and extra environment.
fn vm_run_logged(env: &[(&str, &str)], script: &str) -> Run {
    vm_run_logged_with(env, &[], script)
}

/// [`vm_run_logged`] with extra flags.
fn vm_run_logged_with(env: &[(&str, &str)], flags: &[&str], script: &str) -> Run {
    ensure_base();
    parse(
        cordon()
            .env("RUST_LOG", "cordon_vm=debug")
            .envs(env.iter().copied())
            .args(["run", "--json", "--tier", "vm"])
            .args(flags)
            .args(["--", "bash", "-c", script])
            .stdin(Stdio::null())
            .output()
            .unwrap(),
    )
}

fn snapshots() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(state_dir().join("vm/snapshots"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| !n.starts_with('.') && !n.ends_with(".lock")).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// A digest of every file of every snapshot.
fn snapshot_digest() -> Vec<u64> {
    snapshots()
        .iter()
        .flat_map(|s| ["state", "rw.ext4"].map(|f| file_digest(&state_dir().join("vm/snapshots").join(s).join(f))))
        .collect()
}

const IDENTITY: &str = "date +%s; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; \
    python3 -c 'import os; print(os.urandom(16).hex())'; hostname; echo mine > /home/user/f; sync";

fn host_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64
}

/// Each VM of a snapshot is its own: the host's time, randomness no other VM of it draws, its
/// own name; and the snapshot, shared by all of them, is byte for byte what it was after they
/// ran and wrote to their disks.
#[test]
fn vms_restored_from_one_snapshot_get_their_own_clock_randomness_and_name() {
    require_vm!();
    // The first run of the default caps makes the snapshot if no earlier run did.
    let first = vm_run_logged(&[], IDENTITY);
    assert_eq!(first.code, 0, "{first:?}");
    let known = snapshots();
    assert!(!known.is_empty(), "no snapshot after a vm run: {first:?}");
    let digest = snapshot_digest();
    let mut seen = std::collections::HashSet::new();
    for (i, r) in [first, vm_run_logged(&[], IDENTITY), vm_run_logged(&[], IDENTITY)].into_iter().enumerate() {
        assert_eq!(r.code, 0, "{r:?}");
        if i > 0 {
            assert!(r.stderr.contains("restoring the VM from a snapshot"), "{}", r.stderr);
        }
        let lines: Vec<&str> = r.stdout.lines().collect();
        let t: i64 = lines[0].parse().unwrap();
        assert!((t - host_now()).abs() < 60, "guest clock {t}, host {}", host_now());
        assert_eq!(lines[3], r.id(), "the guest's hostname is its sandbox id");
        for random in &lines[1..3] {
            assert_eq!(random.len(), 32, "{r:?}");
            assert!(seen.insert(random.to_string()), "two VMs drew the same random bytes {random}");
        }
        assert_vm_clean(r.id());
    }
    // The last two restored from the first's snapshot and made none of their own.
    assert_eq!(snapshots(), known);
    assert_eq!(snapshot_digest(), digest, "a VM changed the snapshot it was restored from");
}

#[test]
fn with_snapshots_off_a_vm_boots_cold_and_is_the_same_guest() {
    require_vm!();
    let r = vm_run_logged(&[("CORDON_VM_SNAPSHOTS", "0")], IDENTITY);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(!r.stderr.contains("restoring the VM from a snapshot"), "{}", r.stderr);
    let lines: Vec<&str> = r.stdout.lines().collect();
    let t: i64 = lines[0].parse().unwrap();
    assert!((t - host_now()).abs() < 60, "guest clock {t}, host {}", host_now());
    assert_eq!(lines[3], r.id());
    assert_vm_clean(r.id());
}

/// The live VMM process is jailed: an unprivileged uid, no capabilities, no_new_privs, QEMU's
/// seccomp filter, namespaces of its own, and a root holding only its libraries and this VM's
/// boot files and disks.
fn assert_vmm_jailed(pid: u32) {
    let status = host_file(&format!("/proc/{pid}/status"));
    let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).unwrap_or_default().split_whitespace().collect::<Vec<_>>();
    let uid: u32 = field("Uid:")[0].parse().unwrap();
    assert!(uid >= 1_000_000_000, "VMM runs as uid {uid}");
    assert!(field("Uid:").iter().all(|u| *u == uid.to_string()), "real, effective, saved and fs uids agree");
    assert_eq!(field("CapEff:")[0], "0000000000000000");
    assert_eq!(field("CapPrm:")[0], "0000000000000000");
    assert_eq!(field("NoNewPrivs:")[0], "1");
    assert_eq!(field("Seccomp:")[0], "2", "QEMU's -sandbox filter is on");
    // PID 1 of a PID namespace of its own: it sees and can signal no other process.
    assert_eq!(field("NSpid:").len(), 2, "{status}");
    assert_eq!(field("NSpid:")[1], "1", "{status}");
    for ns in ["mnt", "net", "ipc", "uts", "cgroup", "pid"] {
        let mine = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        let its = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap();
        assert_ne!(mine, its, "the VMM shares the host's {ns} namespace");
    }
    let root = format!("/proc/{pid}/root");
    let mut top: Vec<String> = std::fs::read_dir(&root).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    top.sort();
    for name in &top {
        assert!(["bin", "dev", "etc", "lib", "lib32", "lib64", "sbin", "usr", "vm"].contains(&name.as_str()), "the VMM sees /{name}: {top:?}");
    }
    let mut vm: Vec<String> = std::fs::read_dir(format!("{root}/vm")).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    vm.sort();
    assert_eq!(vm, ["initramfs", "root.ext4", "rw.ext4", "vmlinux"]);
    let etc: Vec<_> = std::fs::read_dir(format!("{root}/etc")).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(etc.iter().all(|n| n == "ld.so.cache"), "the VMM sees host /etc files: {etc:?}");
    assert!(!std::path::Path::new(&format!("{root}/var/lib/cordon")).exists());
    // Its network namespace is empty: loopback at most.
    let dev = host_file(&format!("/proc/{pid}/net/dev"));
    let ifaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert!(ifaces.iter().all(|i| *i == "lo"), "the VMM sees interfaces {ifaces:?}");
}

/// kill -9 of cordon mid-run: the VMM dies with it (parent-death signal), and the next cordon
/// removes the rest (cgroup, writable layer, socket).
#[test]
fn kill_9_of_cordon_leaves_no_vm_behind() {
    require_vm!();
    kill_9_of_a_live_vm(&[]);
}

/// A VM with a network policy: its own snapshot kind (the virtio-net device is part of the
/// machine), each VM restored from it with a MAC of its own and the tiers' address and
/// resolver; its VMM keeps the whole jail (its network namespace still holds no interface but
/// loopback: the frames leave on the socket pair it was handed) and dies with cordon.
#[test]
fn networked_vms_restore_from_their_own_snapshot_each_with_its_own_mac_and_a_jailed_vmm() {
    require_vm!();
    const NET: &str = "cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0 | awk '{print $4}'; grep -m1 nameserver /etc/resolv.conf";
    let mut macs = std::collections::HashSet::new();
    for i in 0..3 {
        let r = vm_run_logged_with(&[], &["--allow-net", "allowed.test"], NET);
        assert_eq!(r.code, 0, "{r:?}");
        if i > 0 {
            assert!(r.stderr.contains("restoring the VM from a snapshot"), "{}", r.stderr);
        }
        let lines: Vec<&str> = r.stdout.lines().collect();
        assert_eq!(lines[1..], ["10.0.2.100/24", "nameserver 10.0.2.1"], "{r:?}");
        assert!(!["02:c0:d0:00:00:01", "02:c0:d0:00:00:02"].contains(&lines[0]), "the template's or the gateway's MAC: {r:?}");
        assert!(macs.insert(lines[0].to_string()), "two VMs got the MAC {}", lines[0]);
        assert_vm_clean(r.id());
    }
    kill_9_of_a_live_vm(&["--allow-net", "allowed.test"]);
}

/// Starts a VM with `flags`, checks its live VMM's jail, kills cordon with SIGKILL and checks
/// that nothing of the VM is left once the next cordon has looked.
fn kill_9_of_a_live_vm(flags: &[&str]) {
    ensure_base();
    let mut child = cordon()
        .args(["run", "--tier", "vm"])
        .args(flags)
        .args(["--", "bash", "-c", "echo up; sleep 600"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line, "up\n");
    let before: Vec<_> = std::fs::read_dir(state_dir().join("vm/run")).unwrap().flatten().map(|e| e.file_name()).collect();
    // The VM of this run: the one whose VMM is a child of our cordon.
    let qemu = host_processes()
        .into_iter()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.split_whitespace().nth(1).map(String::from)))
                .flatten()
                == Some(child.id().to_string())
                && std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.starts_with("qemu"))
        })
        .expect("the VMM is a child of cordon");
    assert_vmm_jailed(qemu);
    let cgroup = host_file(&format!("/proc/{qemu}/cgroup"));
    let id = before
        .iter()
        .map(|n| n.to_string_lossy().into_owned())
        .find(|n| cgroup.contains(n.as_str()))
        .expect("the VMM's cgroup names its sandbox");
    // SAFETY: SIGKILL to the cordon process this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
    let gone = wait_until(Duration::from_secs(10), || !std::path::Path::new(&format!("/proc/{qemu}")).exists()
        || std::fs::read_to_string(format!("/proc/{qemu}/stat")).is_ok_and(|s| s.contains(") Z")));
    assert!(gone, "the VMM outlived cordon");
    // Any later cordon that opens the vm tier reaps the rest; doctor does.
    let out = cordon().arg("doctor").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("vm"), "doctor reports the vm tier");
    assert_vm_clean(&id);
}

#[test]
fn a_missing_qemu_is_a_clear_error_never_a_fallback() {
    require_root!();
    ensure_base();
    let out = cordon()
        .env("CORDON_QEMU", "/nonexistent/qemu-system-x86_64")
        .args(["run", "--tier", "vm", "--", "echo", "ran"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("ran"), "the command ran anyway");
    assert!(stderr.contains("CORDON_QEMU=/nonexistent/qemu-system-x86_64: no such file"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
}
