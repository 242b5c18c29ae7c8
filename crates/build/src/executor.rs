//! The executor every build front end shares (a Dockerfile, an E2B template's steps): an image
//! being built is a [`Stage`], a stack of layers and a config; each step that changes files
//! adds one layer, each that changes only the config (ENV, USER, …) changes only the config,
//! and every step chains the stage's cache key.
//!
//! A RUN step runs in an ns-tier sandbox of the stage as it is: the same jail, syscall filter,
//! caps and egress policy as any sandbox, no network unless the builder's operator opened it.
//! Its writable layer is kept on the host ([`cordon_jail::SandboxConfig::writable`]) and,
//! once the sandbox is gone, becomes the step's layer through the layer store's confined
//! unpack.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cordon_image::{Image, ImageError, ImageMeta, Store};
use cordon_jail::backend::JailBackend;
use cordon_sandbox::{Host, SandboxSpec};
use cordon_spec::{Limits, NetworkPolicy, Tier};

use crate::cache::{self, Cache};
use crate::merged::Merged;
use crate::BuildError;

/// How a build's steps run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Egress for RUN steps (closed by default).
    pub network: NetworkPolicy,
    /// Caps of each RUN step's sandbox; `timeout` is per step.
    pub limits: Limits,
    /// Run every step even if the cache has it.
    pub no_cache: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            network: NetworkPolicy::default(),
            limits: Limits {
                memory_bytes: 2 << 30,
                cpus: 2.0,
                pids: 1024,
                disk_bytes: 8 << 30,
                timeout: Duration::from_secs(30 * 60),
                ..Limits::default()
            },
            no_cache: false,
        }
    }
}

/// An image being built.
#[derive(Debug, Clone)]
pub struct Stage {
    /// The store image the stage started from, pinned while its steps run.
    pub base: String,
    /// Its layers, bottom first (diff_ids in the layer store).
    pub layers: Vec<String>,
    /// Its config so far.
    pub meta: ImageMeta,
    /// The cache key of its last step.
    pub key: String,
}

impl Stage {
    /// An absolute path inside the image: `p` itself, or `p` under the stage's WORKDIR.
    pub fn absolute(&self, p: &str) -> String {
        if p.starts_with('/') {
            p.to_string()
        } else {
            let wd = self.meta.workdir.as_deref().unwrap_or("/");
            format!("{}/{p}", wd.trim_end_matches('/'))
        }
    }
}

/// What a step that ran said.
#[derive(Debug)]
pub struct StepFailure {
    pub message: String,
    /// Its last lines of output.
    pub tail: Vec<String>,
}

/// The lines a failure quotes.
const TAIL: usize = 12;

pub struct Executor {
    store: Store,
    backend: JailBackend,
    rt: tokio::runtime::Runtime,
    cache: Cache,
    /// `<state>/builds/<pid>-<n>`: this build's kept writable layers and views.
    work: PathBuf,
    seq: u32,
    opts: Options,
    /// Set by [`Executor::set_no_cache`].
    force: bool,
    _hold: cordon_image::LayerHold,
}

impl Drop for Executor {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.work);
    }
}

impl Executor {
    /// Opens the store and the ns tier of `host`'s state dir.
    pub fn open(host: &Host, opts: Options) -> Result<Executor, BuildError> {
        let store = Store::open(&host.state_dir)?;
        let backend = JailBackend::open(host).map_err(BuildError::Sandbox)?;
        let io = |what: &str| {
            let what = what.to_string();
            move |source| BuildError::Io { what, source }
        };
        // The egress forwarder of a step's sandbox runs here; a second worker keeps a busy
        // download from stalling the step's output.
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(io("start a runtime"))?;
        let cache = Cache::open(&host.state_dir).map_err(io("open the build cache"))?;
        let builds = host.state_dir.join("builds");
        std::fs::create_dir_all(&builds).map_err(io("create the builds directory"))?;
        sweep(&builds);
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let work = builds.join(format!("{}-{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        std::fs::create_dir(&work).map_err(io("create a build directory"))?;
        let hold = store.hold_layers()?;
        Ok(Executor { store, backend, rt, cache, work, seq: 0, opts, force: false, _hold: hold })
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// A stage of store image `name`.
    pub fn start(&mut self, name: &str, log: &mut dyn FnMut(&str)) -> Result<Stage, BuildError> {
        let img = self.store.get(name)?;
        let mut progress = LineProgress(log);
        let layers = self.store.layer_ids(&img, &mut progress)?;
        let meta = img.meta.clone();
        let config = serde_json::to_string(&(&meta.env, &meta.default_user, &meta.workdir)).expect("serializes");
        let key = cache::key("", &["from", &layers.join(","), &config]);
        Ok(Stage { base: name.to_string(), layers, meta, key })
    }

    fn layer_paths(&self, stage: &Stage) -> Result<Vec<PathBuf>, BuildError> {
        stage
            .layers
            .iter()
            .map(|l| self.store.layer_path(l).ok_or_else(|| BuildError::Image(ImageError::Layer { what: format!("image '{}'", stage.base), reason: format!("layer {l} is missing from the store") })))
            .collect()
    }

    /// Runs the steps after this call whether or not the cache has them (an E2B step's
    /// `force`), or takes them from it again.
    pub fn set_no_cache(&mut self, on: bool) {
        self.force = on;
    }

    /// A fresh path in the build's directory (not created).
    pub fn scratch_dir(&mut self, what: &str) -> PathBuf {
        self.next_dir(what)
    }

    fn next_dir(&mut self, what: &str) -> PathBuf {
        self.seq += 1;
        self.work.join(format!("{what}-{}", self.seq))
    }

    /// A read-only view of the stage's files.
    pub fn view(&mut self, stage: &Stage) -> Result<Merged, BuildError> {
        let layers = self.layer_paths(stage)?;
        let dir = self.next_dir("view");
        Merged::mount(&dir, &layers).map_err(|source| BuildError::Io { what: "mount a view of the image being built".into(), source })
    }

    /// Chains a step that changes only the config into the stage's key.
    pub fn note(&self, stage: &mut Stage, parts: &[&str]) {
        stage.key = cache::key(&stage.key, parts);
    }

    /// Runs `argv` as `user` in a sandbox of the stage and adds what it changed as a layer.
    /// Returns whether the cache had it.
    pub fn run(&mut self, stage: &mut Stage, argv: &[String], user: &str, env: &[(String, String)], log: &mut dyn FnMut(&str)) -> Result<bool, StepFailure> {
        let fail = |message: String| StepFailure { message, tail: Vec::new() };
        let env_json = serde_json::to_string(&(&stage.meta.env, env)).expect("serializes");
        let argv_json = serde_json::to_string(argv).expect("serializes");
        let workdir = stage.meta.workdir.clone().unwrap_or_default();
        let key = cache::key(&stage.key, &["run", &argv_json, user, &env_json, &workdir]);
        if let Some(layer) = self.cached(&key) {
            stage.layers.extend(layer);
            stage.key = key;
            return Ok(true);
        }
        let layers = self.layer_paths(stage).map_err(|e| fail(e.to_string()))?;
        let image = Image { name: stage.base.clone(), layers, meta: stage.meta.clone() };
        let pin = self.store.pin(&stage.base).map_err(|e| fail(e.to_string()))?;
        let writable = Kept(self.next_dir("rw"));
        let spec = SandboxSpec {
            id: cordon_sandbox::new_id(),
            image: stage.base.clone(),
            tier: Tier::Ns,
            limits: self.opts.limits.clone(),
            env: env.to_vec(),
            workdir: stage.meta.workdir.clone(),
            user: user.to_string(),
            allow_ptrace: false,
            network: self.opts.network.clone(),
            audit: false,
            // The step keeps its writable layer where the builder says (create_build).
            keep_writable: false,
            restore: None,
            disk_from: None,
            volumes: Vec::new(),
            // A build step's files become the image: the host's CA stays out of them.
            egress_ca: None,
            // A build step ends with its build.
            keep: false,
        };
        let created = {
            let _enter = self.rt.enter();
            self.backend.create_build(&spec, &image, pin, &writable.0)
        };
        let mut sb = created.map_err(|e| fail(format!("cannot start the step's sandbox: {e}")))?;
        let mut tail = std::collections::VecDeque::new();
        let outcome = self.rt.block_on(async {
            tokio::time::timeout(spec.limits.timeout, run_in(sb.sandbox.socket_path(), argv, user, env, spec.workdir.clone(), &mut |l| {
                if tail.len() == TAIL {
                    tail.pop_front();
                }
                tail.push_back(l.to_string());
                log(l)
            }))
            .await
        });
        let destroyed = sb.sandbox.destroy();
        let tail: Vec<String> = tail.into();
        let fail = |message: String| StepFailure { message, tail: tail.clone() };
        match outcome {
            Err(_) => return Err(fail(format!("did not finish within {} s (the build's per-step timeout)", spec.limits.timeout.as_secs()))),
            Ok(Err(e)) => return Err(fail(e)),
            Ok(Ok(0)) => {}
            Ok(Ok(code)) => return Err(fail(format!("exited with code {code}"))),
        }
        destroyed.map_err(|e| fail(format!("cannot end the step's sandbox: {e}")))?;
        let layer = self.store.layer_from_upper(&writable.0.join("upper"), sb.uid_base).map_err(|e| fail(e.to_string()))?;
        self.cache.put(&key, layer.as_deref());
        stage.layers.extend(layer);
        stage.key = key;
        Ok(false)
    }

    fn cached(&self, key: &str) -> Option<Option<String>> {
        if self.opts.no_cache || self.force {
            return None;
        }
        self.cache.get(key, |l| self.store.layer_path(l).is_some())
    }

    /// Adds the layer `make` writes as a tar (given a view of the stage), unless the cache has
    /// the step `parts` describe (they must name every input: a digest of the files copied).
    /// `make` returning `false` adds no layer. Returns whether the cache had it.
    pub fn add_tar(&mut self, stage: &mut Stage, parts: &[&str], make: impl FnOnce(&Merged, &mut tar::Builder<&mut std::fs::File>) -> Result<bool, String>) -> Result<bool, StepFailure> {
        let fail = |message: String| StepFailure { message, tail: Vec::new() };
        let key = cache::key(&stage.key, parts);
        if let Some(layer) = self.cached(&key) {
            stage.layers.extend(layer);
            stage.key = key;
            return Ok(true);
        }
        let view = self.view(stage).map_err(|e| fail(e.to_string()))?;
        // Spooled to a file in the build's directory, not memory: a copy can be large.
        let path = self.next_dir("copy");
        let _spool = Spool(path.clone());
        let mut file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).map_err(|e| fail(format!("cannot create {}: {e}", path.display())))?;
        let any = {
            let mut b = tar::Builder::new(&mut file);
            let any = make(&view, &mut b).map_err(fail)?;
            b.finish().map_err(|e| fail(format!("cannot write the layer: {e}")))?;
            any
        };
        drop(view);
        let layer = if any {
            use std::io::Seek;
            file.rewind().map_err(|e| fail(e.to_string()))?;
            Some(self.store.layer_from_tar(std::io::BufReader::new(file), "the copied files").map_err(|e| fail(e.to_string()))?)
        } else {
            None
        };
        self.cache.put(&key, layer.as_deref());
        stage.layers.extend(layer);
        stage.key = key;
        Ok(false)
    }

    /// Names the stage's layers and config as image `name`.
    pub fn commit(&self, stage: &Stage, name: &str, source: String, log: &mut dyn FnMut(&str)) -> Result<Image, BuildError> {
        let mut meta = stage.meta.clone();
        meta.layers = stage.layers.clone();
        meta.source = source;
        meta.recipe = None;
        meta.created_unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Ok(self.store.commit(name, meta, &mut LineProgress(log))?)
    }
}

/// A kept writable layer, released however the step ends.
struct Kept(PathBuf);

impl Drop for Kept {
    fn drop(&mut self) {
        if let Err(e) = cordon_jail::release_writable(&self.0) {
            tracing::warn!(path = %self.0.display(), error = %e, "cannot release a build step's writable layer");
        }
    }
}

/// A spooled layer tar, deleted however the step ends.
struct Spool(PathBuf);

impl Drop for Spool {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Releases what builds of processes that are gone left mounted, then removes it.
fn sweep(builds: &Path) {
    let Ok(rd) = std::fs::read_dir(builds) else { return };
    for entry in rd.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.split('-').next()).and_then(|p| p.parse::<u32>().ok());
        if pid.is_none_or(|p| p == std::process::id() || Path::new(&format!("/proc/{p}")).exists()) {
            continue;
        }
        let mut clean = true;
        for child in std::fs::read_dir(entry.path()).into_iter().flatten().flatten() {
            let p = child.path();
            let view_root = p.join("root");
            for m in [&view_root, &p] {
                match rustix::mount::unmount(m, rustix::mount::UnmountFlags::DETACH) {
                    Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
                    Err(_) => clean = false,
                }
            }
        }
        // Only once nothing is mounted below it: a removal through a mounted view would reach
        // the layers.
        if clean {
            tracing::info!(path = %entry.path().display(), "removing what an interrupted build left");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Runs one command through the sandbox's agent, passing each line of its output to `log`.
/// Returns its exit code.
async fn run_in(socket: &Path, argv: &[String], user: &str, env: &[(String, String)], cwd: Option<String>, log: &mut dyn FnMut(&str)) -> Result<i32, String> {
    use cordon_envd::process::{DataEvent, ProcessConfig, ProcessEvent, StartRequest};
    let client = cordon_envd::EnvdClient::new(socket.to_path_buf());
    let req = StartRequest {
        process: Some(ProcessConfig { cmd: argv[0].clone(), args: argv[1..].to_vec(), envs: env.iter().cloned().collect(), cwd }),
        pty: None,
        tag: None,
        stdin: Some(false),
    };
    let mut stream = client.start(req, Some(user), None).await.map_err(|e| format!("cannot start it: {e}"))?;
    let mut lines = Lines::default();
    loop {
        let Some(ev) = stream.next().await else { return Err("its sandbox ended before it did".into()) };
        match ev.map_err(|e| format!("lost its output: {e}"))? {
            ProcessEvent::Data(DataEvent::Stdout(b) | DataEvent::Stderr(b) | DataEvent::Pty(b)) => lines.push(&b, log),
            ProcessEvent::End(end) => {
                lines.flush(log);
                return if end.exited { Ok(end.exit_code) } else { Err(format!("was killed ({})", end.status)) };
            }
            _ => {}
        }
    }
}

/// Splits a byte stream into lines for the log.
#[derive(Default)]
struct Lines(Vec<u8>);

impl Lines {
    fn push(&mut self, b: &[u8], log: &mut dyn FnMut(&str)) {
        self.0.extend_from_slice(b);
        while let Some(i) = self.0.iter().position(|&c| c == b'\n') {
            let line: Vec<u8> = self.0.drain(..=i).collect();
            log(String::from_utf8_lossy(&line[..i]).trim_end_matches('\r'));
        }
    }
    fn flush(&mut self, log: &mut dyn FnMut(&str)) {
        if !self.0.is_empty() {
            log(&String::from_utf8_lossy(&self.0));
            self.0.clear();
        }
    }
}

/// The store's progress as log lines.
pub(crate) struct LineProgress<'a>(pub &'a mut dyn FnMut(&str));

impl cordon_image::Progress for LineProgress<'_> {
    fn stage(&mut self, _index: usize, _total: usize, name: &str) {
        (self.0)(name)
    }
    fn line(&mut self, text: &str) {
        (self.0)(text)
    }
}
