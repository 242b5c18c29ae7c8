//! What an operator's install relies on: `cordon serve` under systemd (`Type=notify`, settings
//! from its configuration file), the unit file, and the Debian package of packaging/deb.

mod common;

use common::{cordon, cordon_bin, ensure_base, skip};
use std::io::{Read as _, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The repository's root (packaging/ lives there).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// A directory of this test's own, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("cordon-packaging-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One HTTP/1.1 GET on loopback: its status, or `None` when nothing answers.
fn get(port: u16, path: &str, key: &str) -> Option<u16> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {key}\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    String::from_utf8_lossy(&out).split(' ').nth(1)?.parse().ok()
}

/// `cordon serve`, sent SIGTERM when the test ends however it ends.
struct Server(std::process::Child);

impl Server {
    fn terminate(&mut self) {
        // SAFETY: kill(2) on the child this test started, which has not been waited for.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            self.terminate();
            let _ = self.0.wait();
        }
    }
}

/// The next datagram on `sock` within `timeout`, if one comes.
fn next_message(sock: &UnixDatagram, timeout: Duration) -> Option<String> {
    sock.set_read_timeout(Some(timeout)).unwrap();
    let mut buf = [0u8; 4096];
    let n = sock.recv(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

fn write_config(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

#[test]
fn serve_says_ready_once_it_answers_and_stopping_on_sigterm_with_settings_from_its_file() {
    require_root!();
    // Without base, serve would start building it in the background; it is built once anyway.
    ensure_base();
    let dir = TempDir::new("notify");
    let socket_path = dir.0.join("notify.sock");
    let sock = UnixDatagram::bind(&socket_path).unwrap();
    let (file_port, flag_port) = (free_port(), free_port());
    let key = format!("e2b_{}", "5".repeat(40));
    let config = dir.0.join("cordon.toml");
    write_config(&config, &format!("listen = \"127.0.0.1:{file_port}\"\napi-key = \"{key}\"\nmax-sandboxes = 3\n"));

    let started = Instant::now();
    let mut server = Server(
        cordon()
            .args(["serve", "--listen", &format!("127.0.0.1:{flag_port}"), "--config"])
            .arg(&config)
            .env("NOTIFY_SOCKET", &socket_path)
            .env_remove("CORDON_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let ready = next_message(&sock, Duration::from_secs(60)).expect("no message from cordon serve on NOTIFY_SOCKET within 60s");
    let ready_after = started.elapsed();
    // The first thing said is READY=1, and the server answers the moment it is said.
    assert!(ready.lines().any(|l| l == "READY=1"), "the first notification is {ready:?}");
    assert!(ready.lines().any(|l| l.starts_with("STATUS=listening on http://127.0.0.1:")), "{ready:?}");
    assert_eq!(get(flag_port, "/health", ""), Some(200), "READY=1 came before /health answered");
    eprintln!("READY=1 after {ready_after:?}: {ready:?}");

    // --listen overrode the file's listen; the file's API key is the server's.
    assert_eq!(get(file_port, "/health", ""), None, "the file's listen address was used over --listen");
    assert_eq!(get(flag_port, "/sandboxes", &key), Some(200), "the file's api-key was not taken");
    assert_eq!(get(flag_port, "/sandboxes", "e2b_wrong"), Some(401));

    server.terminate();
    let stopping = next_message(&sock, Duration::from_secs(30)).expect("no STOPPING=1 after SIGTERM");
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping:?}");
    let status = server.0.wait().unwrap();
    assert!(status.success(), "cordon serve ended {status} on SIGTERM");

    // Without --listen, the file's address is the one served.
    let _server = Server(
        cordon()
            .args(["serve", "--config"])
            .arg(&config)
            .env("NOTIFY_SOCKET", &socket_path)
            .env_remove("CORDON_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let ready = next_message(&sock, Duration::from_secs(60)).expect("no READY=1 from the second server");
    assert!(ready.contains("READY=1") && ready.contains(&format!("127.0.0.1:{file_port}")), "{ready:?}");
    assert_eq!(get(file_port, "/sandboxes", &key), Some(200));
}

#[test]
fn a_bad_config_file_is_one_line_naming_file_and_key_exit_2() {
    let dir = TempDir::new("bad");
    let config = dir.0.join("cordon.toml");
    for (text, expect) in [
        ("lisen = \"127.0.0.1:1\"\n", "unknown key `lisen` (did you mean `listen`?)"),
        ("max-sandboxes = \"many\"\n", "`max-sandboxes`: invalid value 'many'"),
        ("tls-self-signed = \"yes\"\n", "`tls-self-signed` must be true or false, not a string"),
        ("listen = \n", "not valid TOML"),
    ] {
        write_config(&config, text);
        let out = cordon().args(["serve", "--config"]).arg(&config).stdin(Stdio::null()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{text}: not one line: {err}");
        assert!(err.contains(&config.display().to_string()) && err.contains(expect), "{text}: {err}");
    }
    let out = cordon().args(["serve", "--config"]).arg(dir.0.join("missing.toml")).stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("missing.toml: no such file"), "{err}");

    write_config(&config, "api-key = \"k\"\n");
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = cordon().args(["serve", "--config"]).arg(&config).stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("readable by every user (mode 0644): chmod 600"), "{err}");
}

#[test]
fn the_unit_file_verifies() {
    let Some(analyze) = which("systemd-analyze") else {
        skip("systemd-analyze is not installed (apt-get install systemd)");
        return;
    };
    // verify checks that ExecStart's program exists: the binary under test stands in for
    // /usr/bin/cordon, in a copy of the unit named as the package installs it.
    let dir = TempDir::new("unit");
    let unit = std::fs::read_to_string(repo().join("packaging/cordon.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/cordon serve --config /etc/cordon/cordon.toml\n"), "{unit}");
    for line in ["Type=notify", "Restart=on-failure", "StateDirectory=cordon", "KillMode=process", "LimitNOFILE=", "TimeoutStopSec="] {
        assert!(unit.lines().any(|l| l.starts_with(line)), "the unit has no {line}");
    }
    let copy = dir.0.join("cordon.service");
    std::fs::write(&copy, unit.replace("ExecStart=/usr/bin/cordon ", &format!("ExecStart={} ", cordon_bin().display()))).unwrap();
    let out = Command::new(analyze).args(["verify", "--man=no"]).arg(&copy).env("SYSTEMD_LOG_LEVEL", "warning").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Lines about the host (no systemd running here, other units of the host's) are not the unit's.
    let about_unit: Vec<&str> = err.lines().filter(|l| l.contains("cordon.service")).collect();
    assert!(out.status.success() && about_unit.is_empty(), "systemd-analyze verify: {}\n{err}", out.status);
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).map(|d| d.join(name)).find(|p| p.is_file())
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}\n{}{}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_deb_holds_the_binary_unit_and_a_private_conffile_and_installs() {
    let dir = TempDir::new("deb");
    // gzip: a few seconds less than xz, and the compression is not what is tested.
    let out = run(Command::new(repo().join("packaging/deb")).env("CORDON_BIN", cordon_bin()).env("CORDON_DEB_DIR", dir.0.join("out")).env("CORDON_DEB_COMPRESSION", "gzip"));
    let deb = PathBuf::from(out.trim().lines().last().unwrap());
    let version = run(Command::new(cordon_bin()).arg("--version")).split_whitespace().nth(1).unwrap().to_string();
    assert_eq!(deb, dir.0.join("out").join(format!("cordon_{version}_amd64.deb")));

    let info = run(Command::new("dpkg-deb").arg("--info").arg(&deb));
    for want in [
        "Package: cordon".to_string(),
        format!("Version: {version}"),
        "Architecture: amd64".to_string(),
        "Depends: mmdebstrap, gpgv, debian-archive-keyring, e2fsprogs, mount".to_string(),
        "Recommends: runsc, qemu-system-x86, ca-certificates".to_string(),
    ] {
        assert!(info.lines().any(|l| l.trim() == want), "control has no {want:?}:\n{info}");
    }
    let ctrl = dir.0.join("ctrl");
    run(Command::new("dpkg-deb").arg("--control").arg(&deb).arg(&ctrl));
    assert_eq!(std::fs::read_to_string(ctrl.join("conffiles")).unwrap(), "/etc/cordon/cordon.toml\n");
    for script in ["postinst", "prerm", "postrm"] {
        let mode = std::fs::metadata(ctrl.join(script)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755, "{script}");
        let text = std::fs::read_to_string(ctrl.join(script)).unwrap();
        // Commands, not the advice echoed to the operator.
        let starts = text.lines().map(str::trim).filter(|l| l.starts_with("systemctl ")).any(|l| ["enable", "start", "restart", "try-restart"].iter().any(|v| l.split_whitespace().nth(1) == Some(v)));
        assert!(!starts, "{script} enables or starts the service:\n{text}");
    }

    // Paths, modes and owners.
    let contents = run(Command::new("dpkg-deb").arg("--contents").arg(&deb));
    for (mode, path) in [
        ("-rwxr-xr-x", "./usr/bin/cordon"),
        ("-rw-r--r--", "./lib/systemd/system/cordon.service"),
        ("-rw-------", "./etc/cordon/cordon.toml"),
        ("-rw-r--r--", "./usr/share/doc/cordon/README.md"),
        ("-rw-r--r--", "./usr/share/doc/cordon/copyright"),
    ] {
        assert!(
            contents.lines().any(|l| l.starts_with(mode) && l.contains(" root/root ") && l.ends_with(&format!(" {path}"))),
            "no {mode} root/root {path} in:\n{contents}"
        );
    }

    if let Some(lintian) = which("lintian") {
        // Advice only: printed, never failed on.
        let out = Command::new(lintian).arg(&deb).output().unwrap();
        eprintln!("lintian:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }

    if !common::is_root() {
        skip("installing the .deb into a throwaway root needs root (dpkg --root)");
        return;
    }
    // Installed into a throwaway root, its maintainer scripts run against that root (DPKG_ROOT).
    let root = dir.0.join("root");
    for d in ["var/lib/dpkg/info", "var/lib/dpkg/updates"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    let dpkg = |args: &[&str]| {
        let mut c = Command::new("dpkg");
        c.arg(format!("--root={}", root.display())).args(["--force-depends", "--force-script-chrootless", "--log=/dev/null"]).args(args);
        c
    };
    run(dpkg(&["-i"]).arg(&deb));
    let installed = root.join("usr/bin/cordon");
    let meta = std::fs::metadata(root.join("etc/cordon/cordon.toml")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert!(root.join("var/lib/cordon").is_dir(), "postinst did not make the state dir");
    assert_eq!(std::fs::metadata(root.join("var/lib/cordon")).unwrap().permissions().mode() & 0o777, 0o755);
    assert_eq!(run(Command::new(&installed).arg("--version")).trim(), format!("cordon {version}"));
    // The shipped settings file parses: serve gets past it to its own checks of the flags.
    let out = Command::new(&installed).args(["serve", "--max-sandboxes", "0", "--config"]).arg(root.join("etc/cordon/cordon.toml")).stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--max-sandboxes must be at least 1"), "{err}");

    run(&mut dpkg(&["--purge", "cordon"]));
    assert!(!installed.exists() && !root.join("etc/cordon/cordon.toml").exists(), "purge left the package's files");
    assert!(root.join("var/lib/cordon").is_dir(), "purge removed the state dir");
}
