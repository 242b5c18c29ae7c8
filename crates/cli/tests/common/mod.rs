//! Shared helpers for the integration tests: they drive the real `cordon` binary against real
//! namespaces and cgroups, and inspect the host afterwards.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Once;

/// User plus system CPU seconds from a `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat`.
pub fn stat_cpu_seconds(path: &str) -> f64 {
    let s = std::fs::read_to_string(path).unwrap();
    let f: Vec<&str> = s.rsplit_once(") ").unwrap().1.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / hz
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Says that the calling test is skipped and why: on stderr and, when the suite runs it
/// (`scripts/test` sets `CORDON_TEST_SKIPS`), as a line `<test>: <why>` in that file, so the
/// suite's summary lists every skip with its reason (libtest keeps a passing test's stderr).
pub fn skip(why: &str) {
    eprintln!("skipping: {why}");
    if let Some(log) = std::env::var_os("CORDON_TEST_SKIPS") {
        use std::io::Write;
        let test = std::thread::current().name().unwrap_or("?").to_string();
        let bin = std::env::current_exe().ok().and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned())).unwrap_or_default();
        let bin = bin.rsplit_once('-').map_or(bin.as_str(), |(name, _hash)| name).to_string();
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = writeln!(f, "{bin}::{test}: {why}");
        }
    }
}

/// Skips the calling test, with a printed reason, when not running as root.
#[macro_export]
macro_rules! require_root {
    () => {
        if !common::is_root() {
            common::skip("this test runs real sandboxes and needs root (CI runs as root)");
            return;
        }
    };
}

/// The tier a test body runs against (cordon's own); [`per_tier!`] makes one `#[test]` per tier
/// of each body.
pub use cordon_spec::Tier;

/// What the tests need of a [`Tier`] beyond what cordon itself does with one.
pub trait TierExt {
    /// `--tier <name>` followed by `flags`.
    fn flags<'a>(self, flags: &[&'a str]) -> Vec<&'a str>;
    /// Why this host cannot run the tier, if it cannot (the test is then skipped with it).
    fn unavailable(self) -> Option<String>;
}

impl TierExt for Tier {
    fn flags<'a>(self, flags: &[&'a str]) -> Vec<&'a str> {
        let mut v = vec!["--tier", self.as_str()];
        v.extend_from_slice(flags);
        v
    }

    fn unavailable(self) -> Option<String> {
        match self {
            Tier::Ns => None,
            Tier::Gvisor => {
                let named = std::env::var_os("CORDON_RUNSC").map(PathBuf::from);
                let found = named.clone().filter(|p| p.is_file()).or_else(|| {
                    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).map(|d| d.join("runsc")).find(|p| p.is_file())
                });
                found.is_none().then(|| "runsc is not installed (scripts/install-deps installs it)".to_string())
            }
            Tier::Vm => {
                let qemu = std::env::var_os("CORDON_QEMU").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/usr/bin/qemu-system-x86_64"));
                (!qemu.is_file()).then(|| "qemu-system-x86_64 is not installed (scripts/install-deps installs it)".to_string())
            }
        }
    }
}

/// `mod $module` with one `#[test]` per named `fn(Tier)` body, run on `Tier::$tier`: each
/// needs root and skips, saying why, when the host cannot run the tier.
#[macro_export]
macro_rules! tier_tests {
    ($module:ident, $tier:ident, $($name:ident),+) => {
        mod $module {
            $(
                #[test]
                fn $name() {
                    if !super::common::is_root() {
                        super::common::skip("this test runs real sandboxes and needs root (CI runs as root)");
                        return;
                    }
                    if let Some(why) = super::common::TierExt::unavailable(super::common::Tier::$tier) {
                        super::common::skip(&why);
                        return;
                    }
                    super::$name(super::common::Tier::$tier)
                }
            )+
        }
    };
}

/// One `#[test]` per tier for each named `fn(Tier)` body: `ns::<name>` and `gvisor::<name>`.
/// A gvisor test skips, saying why, when runsc is missing; all of them need root.
#[macro_export]
macro_rules! per_tier {
    ($($name:ident),+ $(,)?) => {
        $crate::tier_tests!(ns, Ns, $($name),+);
        $crate::tier_tests!(gvisor, Gvisor, $($name),+);
    };
}

/// One `#[test]` in `mod vm` for each named `fn(Tier)` body that also holds in a microVM
/// (`vm::<name>`): the bodies [`per_tier!`] lists whose expectations cover the vm tier. Kept to a
/// subset because every run boots a guest (seconds each under TCG).
#[macro_export]
macro_rules! on_vm {
    ($($name:ident),+ $(,)?) => {
        $crate::tier_tests!(vm, Vm, $($name),+);
    };
}

/// One `#[test]` per tier, the vm tier's included, for each named `fn(Tier)` body:
/// [`per_tier!`] and [`on_vm!`] of one list.
#[macro_export]
macro_rules! every_tier {
    ($($name:ident),+ $(,)?) => {
        $crate::per_tier!($($name),+);
        $crate::on_vm!($($name),+);
    };
}

/// `ns::<name>` and `vm::<name>` for each named `fn(Tier)` body (in a module of the caller's
/// when [`per_tier!`] has made `ns` already): cases whose difference between tiers is the
/// kernel, the host's or a guest's, where gvisor adds nothing the per-tier cases do not cover.
#[macro_export]
macro_rules! ns_and_vm {
    ($($name:ident),+ $(,)?) => {
        $crate::tier_tests!(ns, Ns, $($name),+);
        $crate::tier_tests!(vm, Vm, $($name),+);
    };
}

/// The state dir the tests use. Shared with the default so that the image built once by the
/// quick start or a previous run is reused.
pub fn state_dir() -> PathBuf {
    std::env::var_os("CORDON_TEST_HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/var/lib/cordon"))
}

/// The `cordon` binary under test: `CORDON_BIN` when set (the suite points it at the release
/// build, exactly as users get it, while the test harnesses build in the lighter `ci` profile),
/// else the one cargo built beside this test.
pub fn cordon_bin() -> PathBuf {
    std::env::var_os("CORDON_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_cordon")))
}

pub fn cordon() -> Command {
    let mut c = Command::new(cordon_bin());
    c.env("CORDON_HOME", state_dir()).env_remove("RUST_LOG").env_remove("CORDON_TRACE");
    c
}

static BASE: Once = Once::new();

/// Builds the default image once per test binary (the store serialises concurrent builds).
pub fn ensure_base() {
    BASE.call_once(|| {
        let out = cordon().args(["image", "build", "base"]).stderr(Stdio::inherit()).output().expect("run cordon");
        assert!(out.status.success(), "building base failed");
    });
}

#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub record: Value,
}

impl Run {
    pub fn reason(&self) -> &str {
        self.record["reason"].as_str().unwrap_or("")
    }

    pub fn id(&self) -> &str {
        self.record["sandbox_id"].as_str().unwrap_or("")
    }
}

/// Splits `cordon run --json`'s output into the command's stdout and the JSON record.
pub fn parse(out: Output) -> Run {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let (body, last) = match stdout.trim_end_matches('\n').rsplit_once('\n') {
        Some((b, l)) => (format!("{b}\n"), l.to_string()),
        None => (String::new(), stdout.trim_end().to_string()),
    };
    let record: Value = serde_json::from_str(&last).unwrap_or(Value::Null);
    let stdout = if record.is_null() { stdout } else { body };
    Run { code: out.status.code().unwrap_or(-1), stdout, stderr, record }
}

/// `cordon run --json <flags> -- <cmd>`; the JSON record is split off stdout.
pub fn run(flags: &[&str], cmd: &[&str]) -> Run {
    run_with_env(flags, cmd, &[])
}

/// [`run`] with variables added to cordon's own environment (not the sandbox's: cordon passes
/// none of its own on), as `--secret NAME` reads them.
pub fn run_with_env(flags: &[&str], cmd: &[&str], env: &[(&str, &str)]) -> Run {
    ensure_base();
    let out = cordon()
        .arg("run")
        .arg("--json")
        .args(flags)
        .arg("--")
        .args(cmd)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run cordon");
    parse(out)
}

/// Runs a shell script in the sandbox.
pub fn sh(flags: &[&str], script: &str) -> Run {
    run(flags, &["bash", "-c", script])
}

pub fn run_with_stdin(flags: &[&str], cmd: &[&str], input: &[u8]) -> Run {
    use std::io::Write;
    ensure_base();
    let mut child = cordon()
        .arg("run")
        .arg("--json")
        .args(flags)
        .arg("--")
        .args(cmd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn cordon");
    child.stdin.take().unwrap().write_all(input).unwrap();
    parse(child.wait_with_output().unwrap())
}

/// Asserts that nothing of sandbox `id` remains: no mount, no cgroup, no state, no process.
pub fn assert_clean(id: &str) {
    assert!(!id.is_empty(), "no sandbox id to check");
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(!mounts.contains(id), "a mount of {id} remains:\n{mounts}");
    for entry in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        let cg = entry.path().join("cordon").join(id);
        assert!(!cg.exists(), "cgroup {} remains", cg.display());
    }
    for run_dir in [state_dir().join("run").join(id), state_dir().join("gvisor/run").join(id), state_dir().join("vm/run").join(id)] {
        assert!(!run_dir.exists(), "state {} remains", run_dir.display());
    }
    // A zombie holds nothing but its pid; reaping it is its parent's job (the host's init, once
    // the cordon that owned the sandbox was killed), so only live processes count.
    let live = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
            .unwrap_or(false)
    };
    let in_sandbox = || {
        host_processes().into_iter().find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/cgroup")).unwrap_or_default().contains(id) && live(*p)
        })
    };
    wait_until(std::time::Duration::from_secs(5), || in_sandbox().is_none());
    if let Some(pid) = in_sandbox() {
        panic!("process {pid} of sandbox {id} remains");
    }
}

pub fn host_processes() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect()
}

/// Host pids whose command line contains `marker`, with their real uid.
/// The runsc child of the `cordon run --tier gvisor` process `run_pid`, and the sandbox id its
/// cgroup names.
pub fn gvisor_sandbox_of(run_pid: u32) -> (u32, String) {
    let runsc = host_processes()
        .into_iter()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(") ").and_then(|(_, r)| r.split_whitespace().nth(1).map(str::to_string)))
                .is_some_and(|ppid| ppid == run_pid.to_string())
        })
        .expect("cordon run has a runsc child");
    let cg = std::fs::read_to_string(format!("/proc/{runsc}/cgroup")).unwrap();
    let id = cg.lines().find_map(|l| l.split("/cordon/").nth(1)).map(|s| s.trim().to_string()).expect("runsc is in a cordon cgroup");
    (runsc, id)
}

pub fn host_processes_with(marker: &str) -> Vec<(u32, u32)> {
    host_processes()
        .into_iter()
        .filter_map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if !cmd.contains(marker) || cmd.contains("cordon") {
                return None;
            }
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let uid = status.lines().find(|l| l.starts_with("Uid:"))?.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, uid))
        })
        .collect()
}

/// Host processes running `sleep <marker>` themselves: a shell that is about to exec into the
/// sleep has the marker in its command line too, and is left out.
pub fn host_sleeps(marker: &str) -> Vec<(u32, u32)> {
    host_processes_with(&format!("sleep {marker}"))
        .into_iter()
        .filter(|(p, _)| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "sleep"))
        .collect()
}

/// A random token, so that concurrent tests never collide on names.
pub fn token() -> String {
    let mut b = [0u8; 8];
    getrandom(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read;
    std::fs::File::open("/dev/urandom").unwrap().read_exact(buf).unwrap();
}

/// A digest of a file's bytes, read in pieces (disk images are GiBs, mostly holes).
pub fn file_digest(path: &Path) -> u64 {
    use std::hash::Hasher;
    use std::io::Read;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut f = std::fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            return h.finish();
        }
        h.write(&buf[..n]);
    }
}

pub fn free_bytes(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: zeroed statvfs is a valid output buffer.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and output pointer.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
    s.f_bavail * s.f_frsize
}

/// Waits (bounded) until `f` holds.
pub fn wait_until(timeout: std::time::Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    f()
}
