//! Users' own images: OCI layouts and `docker save` archives imported, images pulled from a real
//! registry (Debian's docker-registry, filled by images/registry.py with small busybox images it
//! builds with umoci), and sandboxes run on them. Each test has a state dir of its own, so the
//! layer store it inspects holds only what the test put there.

mod common;

use common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/images/registry.py");

/// Skips the calling test, saying why, unless it runs as root with the fixture's tools.
macro_rules! require_tools {
    () => {
        require_root!();
        if let Some(why) = missing_tools() {
            common::skip(&why);
            return;
        }
    };
}

fn missing_tools() -> Option<String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let missing: Vec<&str> = ["umoci", "skopeo", "docker-registry", "busybox", "python3"]
        .into_iter()
        .filter(|t| !std::env::split_paths(&path).any(|d| d.join(t).is_file()))
        .collect();
    (!missing.is_empty()).then(|| format!("needs {} (scripts/install-deps installs them)", missing.join(", ")))
}

/// The fixture's images, built once per test binary.
fn images() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // One place per checkout, rebuilt by each run (and so not left behind run after run).
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("images-fixture");
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new("python3").arg(FIXTURE).arg("build-images").arg(&dir).stdout(Stdio::null()).output().expect("run registry.py");
        assert!(out.status.success(), "building the fixture's images failed:\n{}", String::from_utf8_lossy(&out.stderr));
        dir
    })
}

fn image_info() -> Value {
    serde_json::from_slice(&std::fs::read(images().join("images.json")).unwrap()).unwrap()
}

/// A registry.py `serve`: docker-registry on loopback with the fixture's images pushed, and its
/// proxy. It stops when dropped, or when this test binary exits (it holds the registry's stdin).
struct Registry {
    child: Child,
    _stdin: ChildStdin,
    info: Value,
    _dir: Option<TempDir>,
}

impl Registry {
    fn start(flags: &[&str]) -> Registry {
        let dir = TempDir::new("registry");
        let mut reg = Registry::start_in(dir.path(), flags);
        reg._dir = Some(dir);
        reg
    }

    fn start_in(dir: &Path, flags: &[&str]) -> Registry {
        let mut child = Command::new("python3")
            .arg(FIXTURE)
            .args(["serve", "--stop-on-eof", "--dir"])
            .arg(dir)
            .arg("--images")
            .arg(images())
            .args(flags)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run registry.py");
        let stdin = child.stdin.take().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let info: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("registry.py serve printed {line:?}: {e}"));
        Registry { child, _stdin: stdin, info, _dir: None }
    }

    fn addr(&self) -> &str {
        self.info["registry"].as_str().unwrap()
    }

    fn proxy(&self) -> &str {
        self.info["proxy"].as_str().unwrap()
    }

    fn dir(&self) -> &str {
        self.info["dir"].as_str().unwrap()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        // SAFETY: kill has no memory-safety preconditions; the pid is our own child's.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// The registry most tests share (anonymous, nothing cut or corrupted).
fn shared() -> &'static str {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| {
        // Never dropped: its storage goes next to the images, rebuilt by the next run.
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("images-registry");
        let _ = std::fs::remove_dir_all(&dir);
        Registry::start_in(&dir, &[])
    })
    .addr()
}

/// A directory removed when dropped; searchable by others, as a state dir must be.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("cordon-images-{what}-{}", token()));
        std::fs::create_dir(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        TempDir(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A state dir of the test's own.
struct Home(TempDir);

impl Home {
    fn new() -> Home {
        Home(TempDir::new("home"))
    }

    fn cordon(&self, args: &[&str]) -> Command {
        let mut c = Command::new(cordon_bin());
        c.env("CORDON_HOME", self.0.path()).env_remove("RUST_LOG").env_remove("CORDON_REGISTRY_AUTH").args(args).stdin(Stdio::null());
        // No Docker config of the host's user is read by accident.
        c.env("DOCKER_CONFIG", self.0.path().join("no-docker-config"));
        c
    }

    fn ok(&self, args: &[&str]) -> Output {
        let out = self.cordon(args).output().unwrap();
        assert!(out.status.success(), "cordon {args:?} failed ({}):\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        out
    }

    /// `cordon ARGS`, which must fail with exit 2 and one line that says what is wrong; that line.
    fn usage_error(&self, args: &[&str]) -> String {
        let out = self.cordon(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "cordon {args:?}: want exit 2, got {}:\n{stderr}", out.status);
        let line = stderr.lines().rfind(|l| l.starts_with("cordon: ")).unwrap_or_else(|| panic!("no error line in:\n{stderr}")).to_string();
        assert!(!line.contains("panicked"), "{stderr}");
        line
    }

    /// `cordon run --image IMAGE FLAGS -- CMD`: exit code and stdout.
    fn run(&self, image: &str, flags: &[&str], cmd: &[&str]) -> (i32, String, String) {
        let out = self.cordon(&["run", "--image", image]).args(flags).arg("--").args(cmd).output().unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    }

    fn ls(&self) -> Vec<Value> {
        serde_json::from_slice::<Vec<Value>>(&self.ok(&["image", "ls", "--json"]).stdout).unwrap()
    }

    fn image(&self, name: &str) -> Option<Value> {
        self.ls().into_iter().find(|i| i["name"] == name)
    }

    /// Every entry of the layer store: complete layers by diff_id hex, and anything else.
    fn layer_dirs(&self) -> Vec<String> {
        let dir = self.0.path().join("layers/sha256");
        let mut v: Vec<String> = std::fs::read_dir(&dir)
            .map(|r| r.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n != ".lock").collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}

/// How many layers a pull's progress says it had already.
fn present(progress: &str) -> usize {
    progress.lines().filter(|l| l.contains(": layer ") && l.ends_with(": already present")).count()
}

/// The layer store's names (diff_id hex, sorted, once each) of an image of images.json.
fn hexes(image: &Value) -> Vec<String> {
    let mut v: Vec<String> = image["diff_ids"].as_array().unwrap().iter().map(|d| d.as_str().unwrap()[7..].to_string()).collect();
    v.sort();
    v.dedup();
    v
}

fn diff_hexes(image: &str) -> Vec<String> {
    hexes(&image_info()[image])
}

/// What bb's config and layers make of a sandbox: Env, WorkingDir, User (by name, uid 1234),
/// layer 2's whiteout of /old/gone.txt and layer 3's opaque /opq.
const BB_PROBE: &str = "echo $GREETING; pwd; id -u; ls /old; ls /opq; cat hello.txt";
const BB_SEES: &str = "hello\n/work\n1234\nkeep.txt\nc.txt\nhello from /work\n";

#[test]
fn a_pulled_image_runs_with_its_config_and_its_whiteouts() {
    require_tools!();
    let home = Home::new();
    let reference = format!("{}/bb:latest", shared());
    let out = home.ok(&["image", "pull", &reference]);
    let progress = String::from_utf8_lossy(&out.stderr);
    assert!(progress.contains("layer 2/3"), "no per-layer progress:\n{progress}");
    let bb = home.image("bb").expect("pulled under the repository's name");
    assert_eq!(bb["layers"].as_array().unwrap().len(), 3, "{bb}");
    assert_eq!(bb["default_user"], "app", "{bb}");
    assert_eq!(home.layer_dirs(), diff_hexes("bb"), "the store holds exactly bb's layers, by diff_id");
    let (code, stdout, stderr) = home.run("bb", &[], &["sh", "-c", BB_PROBE]);
    assert_eq!((code, stdout.as_str()), (0, BB_SEES), "{stderr}");
    // The image's user is a default, not a rule.
    let (code, stdout, stderr) = home.run("bb", &["--user", "root"], &["id", "-u"]);
    assert_eq!((code, stdout.as_str()), (0, "0\n"), "{stderr}");
    // Its Entrypoint and Cmd run when asked for.
    let out = home.cordon(&["run", "--image", "bb", "--image-command"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from bb\n", "{}", String::from_utf8_lossy(&out.stderr));
    // The sandbox wrote into its own upper layer only: the layers are as unpacked.
    let (code, _, stderr) = home.run("bb", &["--user", "root"], &["sh", "-c", "echo x > /work/hello.txt; rm /old/keep.txt; touch /opq/new"]);
    assert_eq!(code, 0, "{stderr}");
    let (_, stdout, _) = home.run("bb", &[], &["sh", "-c", BB_PROBE]);
    assert_eq!(stdout, BB_SEES);
    // A second pull of the same image fetches nothing.
    let out = home.ok(&["image", "pull", &reference, "--name", "bb2"]);
    let progress = String::from_utf8_lossy(&out.stderr);
    assert_eq!(present(&progress), 3, "{progress}");
}

// The other tiers, each skipping (with its reason) where the host cannot run it.
tier_tests!(gvisor, Gvisor, a_pulled_image_runs_on_the_tier);
tier_tests!(vm, Vm, a_pulled_image_runs_on_the_tier);

fn a_pulled_image_runs_on_the_tier(t: Tier) {
    if let Some(why) = missing_tools() {
        skip(&why);
        return;
    }
    let home = Home::new();
    home.ok(&["image", "pull", &format!("{}/bb:latest", shared())]);
    let (code, stdout, stderr) = home.run("bb", &t.flags(&[]), &["sh", "-c", BB_PROBE]);
    assert_eq!((code, stdout.as_str()), (0, BB_SEES), "{stderr}");
}

#[test]
fn an_index_resolves_to_linux_amd64() {
    require_tools!();
    let home = Home::new();
    home.ok(&["image", "pull", &format!("{}/multi:latest", shared())]);
    let (code, stdout, stderr) = home.run("multi", &[], &["sh", "-c", "cat /arch; ls /only-arm64 >/dev/null 2>&1 || echo no-arm64"]);
    assert_eq!((code, stdout.as_str()), (0, "amd64\nno-arm64\n"), "{stderr}");
    assert_eq!(home.layer_dirs(), hexes(&image_info()["multi"]["amd64"]), "only the amd64 image's layers were fetched");
}

#[test]
fn zstd_layers_unpack_to_the_same_tree() {
    require_tools!();
    let home = Home::new();
    home.ok(&["image", "pull", &format!("{}/bbzstd:latest", shared())]);
    // The same diff_ids as bb's gzip layers: the same layers in the store.
    assert_eq!(home.layer_dirs(), diff_hexes("bb"));
    let (code, stdout, stderr) = home.run("bbzstd", &[], &["sh", "-c", BB_PROBE]);
    assert_eq!((code, stdout.as_str()), (0, BB_SEES), "{stderr}");
}

#[test]
fn imports_of_every_form_share_their_layers() {
    require_tools!();
    let home = Home::new();
    let dir = images();
    home.ok(&["image", "import", "from-docker", dir.join("bb-docker.tar").to_str().unwrap()]);
    home.ok(&["image", "import", "from-oci-dir", dir.join("bb-oci").to_str().unwrap()]);
    home.ok(&["image", "import", "from-oci-tar", dir.join("bb-oci.tar").to_str().unwrap()]);
    home.ok(&["image", "pull", &format!("{}/bbplus:latest", shared())]);
    home.ok(&["image", "import", "flat", dir.join("bb-rootfs.tar").to_str().unwrap()]);
    // bb's three layers once, and bbplus's one more.
    let want = diff_hexes("bbplus");
    assert_eq!(want.len(), 4);
    assert_eq!(home.layer_dirs(), want);
    for name in ["from-docker", "from-oci-dir", "from-oci-tar", "bbplus"] {
        let i = home.image(name).unwrap();
        assert!(i["shared_bytes"].as_u64().unwrap() > 0, "{name} shares nothing: {i}");
        let (code, stdout, stderr) = home.run(name, &[], &["sh", "-c", BB_PROBE]);
        assert_eq!((code, stdout.as_str()), (0, BB_SEES), "{name}: {stderr}");
    }
    let (_, stdout, _) = home.run("bbplus", &[], &["cat", "/plus.txt"]);
    assert_eq!(stdout, "only in bbplus\n");
    // A flat rootfs tarball stays one tree of its own.
    assert_eq!(home.image("flat").unwrap()["layers"].as_array().unwrap().len(), 0);
    let (code, stdout, stderr) = home.run("flat", &["--user", "1234"], &["sh", "-c", "ls /old; ls /opq"]);
    assert_eq!((code, stdout.as_str()), (0, "keep.txt\nc.txt\n"), "{stderr}");
}

#[test]
fn token_auth_takes_the_flag_or_the_docker_config_and_nothing_else() {
    require_tools!();
    let reg = Registry::start(&["--token-auth"]);
    let reference = format!("{}/bb:latest", reg.addr());
    let home = Home::new();
    let line = home.usage_error(&["image", "pull", &reference]);
    assert!(line.contains("needs credentials") && line.contains("--registry-auth"), "{line}");
    let line = home.usage_error(&["image", "pull", &reference, "--registry-auth", "alice:wrong"]);
    assert!(line.contains("refused the credentials"), "{line}");
    assert!(home.ls().is_empty() && home.layer_dirs().is_empty(), "a refused pull left {:?}", home.layer_dirs());
    home.ok(&["image", "pull", &reference, "--registry-auth", "alice:s3cret"]);
    assert!(home.image("bb").is_some());

    // The Docker config's entry for the registry, as `docker login` writes it.
    let home = Home::new();
    let cfg = TempDir::new("docker-config");
    use base64::Engine as _;
    let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
    std::fs::write(cfg.path().join("config.json"), serde_json::json!({"auths": {reg.addr(): {"auth": auth}}}).to_string()).unwrap();
    let out = home.cordon(&["image", "pull", &reference]).env("DOCKER_CONFIG", cfg.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (code, stdout, stderr) = home.run("bb", &[], &["sh", "-c", BB_PROBE]);
    assert_eq!((code, stdout.as_str()), (0, BB_SEES), "{stderr}");
}

#[test]
fn a_blob_that_does_not_match_its_digest_is_refused_and_leaves_nothing() {
    require_tools!();
    let reg = Registry::start(&[]);
    let out = Command::new("python3").arg(FIXTURE).args(["corrupt", "--dir", reg.dir(), "--image", "bb", "--layer", "1"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let corrupted: Value = serde_json::from_slice(&out.stdout).unwrap();
    let home = Home::new();
    let line = home.usage_error(&["image", "pull", &format!("{}/bb:latest", reg.addr())]);
    assert!(line.contains("digest"), "{line}");
    assert!(home.image("bb").is_none());
    let bad = &corrupted["diff_id"].as_str().unwrap()[7..];
    let left = home.layer_dirs();
    assert!(!left.iter().any(|l| l.contains(bad)), "the corrupted layer is in the store: {left:?}");
    // What is left is whole layers only (the other two may have completed), each with its record.
    for l in &left {
        assert!(diff_hexes("bb").contains(l), "not a layer of bb: {l} in {left:?}");
        assert!(home.0.path().join("layers/sha256").join(l).join("layer.json").is_file(), "{l} is incomplete");
    }
}

#[test]
fn a_pull_cut_short_leaves_whole_layers_only_and_the_next_pull_fetches_the_rest() {
    require_tools!();
    // The proxy cuts every blob after 64 KiB: bb's small layers (1 and 3) come through whole,
    // busybox's layer (about 1 MiB of gzip) does not.
    let reg = Registry::start(&["--die-after", "65536"]);
    let home = Home::new();
    let line = home.usage_error(&["image", "pull", &format!("{}/bb:latest", reg.proxy())]);
    assert!(line.contains("layer"), "{line}");
    assert!(home.image("bb").is_none(), "an image appeared from a pull that failed");
    let info = image_info();
    let hex = |i: usize| info["bb"]["diff_ids"][i].as_str().unwrap()[7..].to_string();
    let mut whole = vec![hex(0), hex(2)];
    whole.sort();
    assert_eq!(home.layer_dirs(), whole, "want the two small layers and no partial or temporary one");
    let out = home.ok(&["image", "pull", &format!("{}/bb:latest", reg.addr())]);
    let progress = String::from_utf8_lossy(&out.stderr);
    assert_eq!(present(&progress), 2, "{progress}");
    let (code, stdout, stderr) = home.run("bb", &[], &["sh", "-c", BB_PROBE]);
    assert_eq!((code, stdout.as_str()), (0, BB_SEES), "{stderr}");
}

#[test]
fn bad_references_and_inputs_are_one_line_errors() {
    require_tools!();
    let home = Home::new();
    let line = home.usage_error(&["image", "pull", &format!("{}/nope:latest", shared())]);
    assert!(line.contains("not found"), "{line}");
    // The fixture's proxy answers repository `weird` with a manifest of a media type no one knows.
    let reg = Registry::start(&[]);
    let line = home.usage_error(&["image", "pull", &format!("{}/weird:latest", reg.proxy())]);
    assert!(line.contains("media type"), "{line}");
    let line = home.usage_error(&["image", "import", "x", "/nonexistent/image.tar"]);
    assert!(line.contains("/nonexistent/image.tar"), "{line}");
    let junk = TempDir::new("junk");
    std::fs::write(junk.path().join("junk.tar"), b"this is not a tar archive at all, not even close").unwrap();
    home.usage_error(&["image", "import", "x", junk.path().join("junk.tar").to_str().unwrap()]);
    assert!(home.ls().is_empty(), "{:?}", home.ls());
    assert!(home.layer_dirs().is_empty(), "{:?}", home.layer_dirs());
}

#[test]
fn an_image_without_a_shell_runs_programs() {
    require_tools!();
    let home = Home::new();
    home.ok(&["image", "pull", &format!("{}/noshell:latest", shared())]);
    let (code, stdout, stderr) = home.run("noshell", &[], &["/bin/busybox-ns", "echo", "hi"]);
    assert_eq!((code, stdout.as_str()), (0, "hi\n"), "{stderr}");
    let (code, _, stderr) = home.run("noshell", &[], &["sh", "-c", "true"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("no shell"), "{stderr}");
}

#[test]
fn rm_refuses_an_image_in_use_and_prune_keeps_shared_layers() {
    require_tools!();
    let home = Home::new();
    home.ok(&["image", "pull", &format!("{}/bb:latest", shared())]);
    home.ok(&["image", "pull", &format!("{}/bbplus:latest", shared())]);
    let marker = format!("{}", 3000 + (std::process::id() % 1000));
    let mut live = home.cordon(&["run", "--image", "bb", "--", "sleep", &marker]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    assert!(wait_until(Duration::from_secs(60), || !host_sleeps(&marker).is_empty()), "the sandbox did not start");
    let line = home.usage_error(&["image", "rm", "bb"]);
    assert!(line.contains("in use"), "{line}");
    assert!(home.image("bb").is_some(), "rm removed an image in use");
    // SAFETY: kill has no memory-safety preconditions; the pid is our own child's.
    unsafe { libc::kill(live.id() as i32, libc::SIGTERM) };
    live.wait().unwrap();
    home.ok(&["image", "rm", "bb"]);
    home.ok(&["image", "prune"]);
    // bbplus still names all four layers.
    assert_eq!(home.layer_dirs(), diff_hexes("bbplus"));
    let (code, stdout, stderr) = home.run("bbplus", &[], &["sh", "-c", BB_PROBE]);
    assert_eq!((code, stdout.as_str()), (0, BB_SEES), "{stderr}");
    home.ok(&["image", "rm", "bbplus"]);
    home.ok(&["image", "prune"]);
    assert!(home.layer_dirs().is_empty(), "{:?}", home.layer_dirs());
}

#[test]
fn serve_prebuild_pulls_before_it_listens_and_refuses_what_it_cannot_find() {
    require_tools!();
    let home = Home::new();
    let line = home.usage_error(&["serve", "--listen", "127.0.0.1:0", "--api-key", "k", "--prebuild", "nope"]);
    assert!(line.contains("--prebuild nope"), "{line}");
    let reference = format!("{}/bb:latest", shared());
    let mut serve = home
        .cordon(&["serve", "--listen", "127.0.0.1:0", "--api-key", "k", "--prebuild", &reference])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut seen = String::new();
    let mut lines = BufReader::new(serve.stderr.take().unwrap()).lines();
    for l in lines.by_ref() {
        let l = l.unwrap();
        seen.push_str(&l);
        seen.push('\n');
        if l.contains("listening on") {
            break;
        }
    }
    // Listening means the image is in.
    let in_store = home.image("bb");
    // SAFETY: kill has no memory-safety preconditions; the pid is our own child's.
    unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
    std::thread::spawn(move || lines.for_each(drop));
    serve.wait().unwrap();
    assert!(seen.contains("listening on"), "the server did not start:\n{seen}");
    assert!(in_store.is_some_and(|i| i["layers"].as_array().unwrap().len() == 3), "bb was not pulled before the server listened:\n{seen}");
    // The fresh state dir's `base` was being built in the background: that build ends with
    // the server, and leaves no process behind.
    let home_path = home.0.path().to_string_lossy().into_owned();
    let building = || -> Vec<String> {
        host_processes()
            .into_iter()
            .filter_map(|p| std::fs::read(format!("/proc/{p}/cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.contains(&home_path))
            .collect()
    };
    assert!(wait_until(Duration::from_secs(30), || building().is_empty()), "processes of the stopped server's build remain: {:?}", building());
}
