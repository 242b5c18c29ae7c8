//! The server end to end over TCP, with a backend that runs `cordon-agent`'s service in this
//! process instead of in a jail: routing, auth, malformed input, limits and lifetimes need no
//! root this way. (The SDK suite in tests/e2b covers the real jail.)

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cordon_sandbox::{Backend, Capabilities, Error as BackendError, Sandbox, SandboxSpec};
use cordon_server::{App, Sandboxes};
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

const KEY: &str = "e2b_test_key";

struct InProcess {
    dir: PathBuf,
}

struct InProcessInstance {
    socket: PathBuf,
    task: tokio::task::JoinHandle<()>,
    start: Option<cordon_image::StartCommand>,
    slowdown: u32,
}

impl Sandbox for InProcessInstance {
    fn socket_path(&self) -> &Path {
        &self.socket
    }
    fn death_fd(&self) -> Option<OwnedFd> {
        None
    }
    fn memory_current(&self) -> Option<u64> {
        Some(1 << 20)
    }
    fn start_command(&self) -> Option<&cordon_image::StartCommand> {
        self.start.as_ref()
    }
    fn slowdown(&self) -> u32 {
        self.slowdown
    }
    fn destroy(&mut self) -> Result<(), BackendError> {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
        Ok(())
    }
}

impl Backend for InProcess {
    fn capabilities(&self, _tier: cordon_spec::Tier) -> Capabilities {
        // The API's policy checks run as for the ns tier; the in-process agent has no interface.
        Capabilities { egress: true, syscall_audit: false, host_oom_count: true, freeze: false, keep_writable: false, checkpoint: false, checkpoint_keeps_running: false, keep_disk: false, volumes: false, set_limits: false, survive_restart: false }
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>, BackendError> {
        // `svc-<port>`: a template whose start command serves on <port> after a pause;
        // `svc-broken`: one whose start command fails; `late-<slowdown>-<port>`: one that serves
        // after 1.5 s with a readiness timeout of 1 s, in a sandbox `slowdown` times slower
        // than the host (an emulated CPU).
        let mut slowdown = 1;
        let start = match spec.image.as_str() {
            "base" => None,
            "svc-broken" => Some(start_command("echo missing-config-file >&2; exit 3", Some(1))),
            t if t.starts_with("late-") => {
                let (factor, port) = t["late-".len()..].split_once('-').expect("late-<slowdown>-<port>");
                slowdown = factor.parse().expect("slowdown");
                let mut cmd = start_command(
                    &format!(
                        "exec python3 -c 'import socket, time; time.sleep(1.5); s = socket.socket(); \
                         s.bind((\"127.0.0.1\", {port})); s.listen(); time.sleep(20)'"
                    ),
                    Some(port.parse().expect("port")),
                );
                cmd.ready_timeout_secs = 1;
                Some(cmd)
            }
            // `tok-<port>` / `pub-<port>`: a start command whose port needs the token / is open,
            // serving HTTP that answers with the names of the headers it was sent.
            t if t.starts_with("tok-") || t.starts_with("pub-") => {
                let port: u16 = t[4..].parse().expect("port");
                let mut cmd = start_command(&header_echo(port), Some(port));
                cmd.needs_token = t.starts_with("tok-");
                Some(cmd)
            }
            t => match t.strip_prefix("svc-").and_then(|p| p.parse::<u16>().ok()) {
                Some(port) => Some(start_command(
                    &format!(
                        "exec python3 -c 'import socket, time; time.sleep(0.4); s = socket.socket(); \
                         s.bind((\"127.0.0.1\", {port})); s.listen(); time.sleep(20)'"
                    ),
                    Some(port),
                )),
                None => return Err(BackendError::UnknownTemplate(format!("template '{}' not found", spec.image))),
            },
        };
        let socket = self.dir.join(format!("{}.sock", spec.id));
        let l = std::os::unix::net::UnixListener::bind(&socket).map_err(|e| BackendError::failed("bind the agent socket", e))?;
        l.set_nonblocking(true).map_err(|e| BackendError::failed("bind the agent socket", e))?;
        let cfg = cordon_agent::AgentConfig {
            sandbox_id: spec.id.clone(),
            default_user: "root".into(),
            workdir: None,
            env: spec.env.clone().into_iter().collect(),
            root: PathBuf::from("/"),
            envd_version: None,
            isolate_commands: false,
        };
        // `create` runs on a blocking thread of the server's runtime.
        let task = tokio::runtime::Handle::current().spawn(async move {
            let l = tokio::net::UnixListener::from_std(l).expect("listener");
            let _ = cordon_agent::serve(l, cfg).await;
        });
        Ok(Box::new(InProcessInstance { socket, task, start, slowdown }))
    }
}

/// A shell command serving HTTP on `port` whose answer lists the (lowercase) names of the
/// request's headers.
fn header_echo(port: u16) -> String {
    let py = [
        "import http.server as h",
        "class H(h.BaseHTTPRequestHandler):",
        "    def do_GET(self):",
        "        b = \",\".join(sorted(k.lower() for k in self.headers.keys())).encode()",
        "        self.send_response(200); self.send_header(\"content-length\", str(len(b))); self.end_headers(); self.wfile.write(b)",
        &format!("h.HTTPServer((\"127.0.0.1\", {port}), H).serve_forever()"),
    ]
    .join("\n");
    format!("exec python3 -c '{py}'")
}

fn start_command(script: &str, ready_port: Option<u16>) -> cordon_image::StartCommand {
    cordon_image::StartCommand {
        cmd: vec!["sh".into(), "-c".into(), script.into()],
        user: "root".into(),
        cwd: Some("/".into()),
        env: vec![],
        ready_port,
        ready_cmd: None,
        ready_timeout_secs: 20,
        needs_token: false,
    }
}

struct Server {
    addr: SocketAddr,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn start(max: usize) -> Server {
    start_with(max, Default::default()).await
}

async fn start_with(max: usize, network_default: cordon_server::network::NetworkDefault) -> Server {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "cordon-server-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let backend = Arc::new(InProcess { dir: dir.clone() });
    let sandboxes = Sandboxes::new(backend, max, "0.6.13".into());
    let images = cordon_image::Store::open(&dir).unwrap();
    let app = Arc::new(App { api_key: KEY.into(), sandboxes, images, network_default, domain: None, tls: None, builds: None, templates: None, volumes: None, secrets: Some(cordon_server::secrets::open(&dir).unwrap()), cluster: Default::default() });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(cordon_server::serve(listener, app, std::future::pending()));
    Server { addr, _dir: TempDir(dir) }
}

struct Resp {
    status: StatusCode,
    headers: hyper::HeaderMap,
    body: Bytes,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
}

async fn call(addr: SocketAddr, method: Method, path: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Resp {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut b = Request::builder().method(method).uri(path);
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        b = b.header("host", addr.to_string());
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = tx.send_request(b.body(Full::new(body.into())).unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    Resp { status: parts.status, headers: parts.headers, body: body.collect().await.unwrap().to_bytes() }
}

async fn api(addr: SocketAddr, method: Method, path: &str, body: &str) -> Resp {
    call(addr, method, path, &[("x-api-key", KEY), ("content-type", "application/json")], body.to_string()).await
}

/// Creates a sandbox; returns (id, token).
async fn create(addr: SocketAddr, body: Value) -> (String, String) {
    let r = api(addr, Method::POST, "/v2/sandboxes", &body.to_string()).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let v = r.json();
    (v["sandboxID"].as_str().unwrap().to_string(), v["envdAccessToken"].as_str().unwrap().to_string())
}

const STAT: &str = "/filesystem.Filesystem/Stat";

async fn stat(addr: SocketAddr, id: &str, token: Option<&str>) -> Resp {
    let mut h = vec![("e2b-sandbox-id", id), ("e2b-sandbox-port", "49983"), ("content-type", "application/json")];
    if let Some(t) = token {
        h.push(("x-access-token", t));
    }
    call(addr, Method::POST, STAT, &h, r#"{"path":"/"}"#).await
}

fn assert_error(r: &Resp, status: StatusCode) {
    assert_eq!(r.status, status, "{:?}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["code"], json!(status.as_u16()));
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required() {
    let s = start(10).await;
    let r = call(s.addr, Method::GET, "/health", &[], "").await;
    assert_eq!(r.status, StatusCode::OK);
    let r = call(s.addr, Method::GET, "/v2/sandboxes", &[], "").await;
    assert_error(&r, StatusCode::UNAUTHORIZED);
    let r = call(s.addr, Method::POST, "/v2/sandboxes", &[("x-api-key", "e2b_wrong")], "{}").await;
    assert_error(&r, StatusCode::UNAUTHORIZED);
    let r = api(s.addr, Method::GET, "/v2/sandboxes", "").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json(), json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_tokens_guard_each_sandbox() {
    let s = start(10).await;
    let (a, ta) = create(s.addr, json!({"templateID": "base"})).await;
    let (b, tb) = create(s.addr, json!({})).await;
    assert_ne!(ta, tb);
    // /health needs no token.
    let r = call(s.addr, Method::GET, "/health", &[("e2b-sandbox-id", &a)], "").await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_error(&stat(s.addr, &a, None).await, StatusCode::UNAUTHORIZED);
    assert_error(&stat(s.addr, &a, Some("wrong")).await, StatusCode::UNAUTHORIZED);
    // One sandbox's token does not open another.
    assert_error(&stat(s.addr, &a, Some(&tb)).await, StatusCode::UNAUTHORIZED);
    assert_error(&stat(s.addr, &b, Some(&ta)).await, StatusCode::UNAUTHORIZED);
    let r = stat(s.addr, &a, Some(&ta)).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.json()["entry"]["path"], json!("/"));
    // The token alone (old SDKs after connect) routes to its own sandbox.
    let r = call(s.addr, Method::POST, STAT, &[("x-access-token", &tb), ("content-type", "application/json")], r#"{"path":"/"}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    // /files: header, or a signature made with the right token.
    let files = |sig: String| format!("/files?path=%2Fetc%2Fhostname&signature={sig}");
    let good = cordon_server::auth::file_signature("/etc/hostname", cordon_server::auth::FileOp::Read, "", &ta, None);
    let good = good.replace('+', "%2B").replace('/', "%2F");
    let r = call(s.addr, Method::GET, &files(good.clone()), &[("e2b-sandbox-id", &a)], "").await;
    assert_ne!(r.status, StatusCode::UNAUTHORIZED, "{:?}", r.body);
    // A signed URL without sandbox headers finds its sandbox by the signature.
    let r = call(s.addr, Method::GET, &files(good.clone()), &[], "").await;
    assert_ne!(r.status, StatusCode::UNAUTHORIZED, "{:?}", r.body);
    let r = call(s.addr, Method::GET, &files(good), &[("e2b-sandbox-id", &b)], "").await;
    assert_error(&r, StatusCode::UNAUTHORIZED);
    let r = call(s.addr, Method::GET, "/files?path=/etc/hostname", &[("e2b-sandbox-id", &a)], "").await;
    assert_error(&r, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_400_and_the_server_lives_on() {
    let s = start(10).await;
    for body in [
        "{",
        "[]",
        "null",
        r#"{"timeout":"x"}"#,
        r#"{"timeout":-1}"#,
        r#"{"timeout":99999999}"#,
        r#"{"metadata":{"k":1}}"#,
        r#"{"envVars":[]}"#,
        r#"{"tier":"docker"}"#,
        r#"{"cpuCount":0}"#,
        r#"{"memoryMB":1}"#,
        r#"{"templateID":"../etc"}"#,
    ] {
        let r = api(s.addr, Method::POST, "/v2/sandboxes", body).await;
        assert_error(&r, StatusCode::BAD_REQUEST);
    }
    let r = api(s.addr, Method::POST, "/sandboxes", r#"{"templateID":"nope"}"#).await;
    assert_error(&r, StatusCode::NOT_FOUND);
    assert!(r.json()["message"].as_str().unwrap().contains("nope"));
    let big = format!(r#"{{"metadata":{{"k":"{}"}}}}"#, "x".repeat(2 << 20));
    assert_error(&api(s.addr, Method::POST, "/v2/sandboxes", &big).await, StatusCode::PAYLOAD_TOO_LARGE);

    let (id, _) = create(s.addr, json!({})).await;
    assert_error(&api(s.addr, Method::POST, &format!("/sandboxes/{id}/timeout"), "").await, StatusCode::BAD_REQUEST);
    assert_error(&api(s.addr, Method::POST, &format!("/sandboxes/{id}/timeout"), "{}").await, StatusCode::BAD_REQUEST);
    assert_error(&api(s.addr, Method::POST, &format!("/v2/sandboxes/{id}/connect"), "{x").await, StatusCode::BAD_REQUEST);
    for q in ["limit=0", "limit=101", "limit=x", "nextToken=garbage", "state=weird", "metadata=novalue"] {
        assert_error(&api(s.addr, Method::GET, &format!("/v2/sandboxes?{q}"), "").await, StatusCode::BAD_REQUEST);
    }
    let r = call(s.addr, Method::GET, "/health", &[("e2b-sandbox-id", &id), ("e2b-sandbox-port", "nope")], "").await;
    assert_error(&r, StatusCode::BAD_REQUEST);
    let r = call(s.addr, Method::GET, "/health", &[("e2b-sandbox-id", "UPPER")], "").await;
    assert_error(&r, StatusCode::BAD_REQUEST);
    assert_error(&api(s.addr, Method::GET, "/sandboxes/x/nothing", "").await, StatusCode::NOT_FOUND);
    // Still serving.
    assert_eq!(api(s.addr, Method::GET, &format!("/sandboxes/{id}"), "").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_info_list_kill_and_expiry() {
    let s = start(10).await;
    let (id, tok) = create(s.addr, json!({"timeout": 60, "metadata": {"team": "a b&c"}, "cpuCount": 2, "memoryMB": 256})).await;
    let (other, _) = create(s.addr, json!({"metadata": {"team": "z"}})).await;
    let d = api(s.addr, Method::GET, &format!("/sandboxes/{id}"), "").await.json();
    for k in ["templateID", "sandboxID", "clientID", "startedAt", "endAt", "envdVersion", "cpuCount", "memoryMB", "diskSizeMB", "state"] {
        assert!(!d[k].is_null(), "{k} missing in {d}");
    }
    assert_eq!((d["cpuCount"].clone(), d["memoryMB"].clone(), d["state"].clone()), (json!(2), json!(256), json!("running")));
    // The SDK's double encoding of {"team": "a b&c"}.
    let r = api(s.addr, Method::GET, "/v2/sandboxes?metadata=team%3Da%2520b%2526c", "").await;
    let ids: Vec<Value> = r.json().as_array().unwrap().iter().map(|s| s["sandboxID"].clone()).collect();
    assert_eq!(ids, vec![json!(id)]);
    // Pagination: one per page.
    let r = api(s.addr, Method::GET, "/v2/sandboxes?limit=1", "").await;
    let token = r.headers.get("x-next-token").expect("a next token").to_str().unwrap().to_string();
    let r2 = api(s.addr, Method::GET, &format!("/v2/sandboxes?limit=1&nextToken={token}"), "").await;
    assert!(r2.headers.get("x-next-token").is_none());
    let mut seen = vec![r.json()[0]["sandboxID"].clone(), r2.json()[0]["sandboxID"].clone()];
    seen.sort_by_key(|v| v.to_string());
    let mut want = vec![json!(id), json!(other)];
    want.sort_by_key(|v| v.to_string());
    assert_eq!(seen, want);
    // Metrics.
    let m = api(s.addr, Method::GET, &format!("/sandboxes/{id}/metrics"), "").await.json();
    assert_eq!(m[0]["memTotal"], json!(256u64 << 20));
    // Kill: 204, then 404, and the data plane says the sandbox is gone.
    assert_eq!(api(s.addr, Method::DELETE, &format!("/sandboxes/{id}"), "").await.status, StatusCode::NO_CONTENT);
    assert_error(&api(s.addr, Method::DELETE, &format!("/sandboxes/{id}"), "").await, StatusCode::NOT_FOUND);
    let r = stat(s.addr, &id, Some(&tok)).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.json(), json!({"sandboxId": id, "message": "The sandbox was not found", "code": 502}));
    // Expiry: a timeout of 1 s from now.
    assert_eq!(api(s.addr, Method::POST, &format!("/sandboxes/{other}/timeout"), r#"{"timeout":1}"#).await.status, StatusCode::NO_CONTENT);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_error(&api(s.addr, Method::GET, &format!("/sandboxes/{other}"), "").await, StatusCode::NOT_FOUND);
    assert_error(&api(s.addr, Method::POST, &format!("/sandboxes/{other}/connect"), "{}").await, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_limit_is_429_without_retry() {
    let s = start(1).await;
    let (id, _) = create(s.addr, json!({})).await;
    let r = api(s.addr, Method::POST, "/v2/sandboxes", "{}").await;
    assert_error(&r, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.headers.get("should-retry").unwrap(), "false");
    api(s.addr, Method::DELETE, &format!("/sandboxes/{id}"), "").await;
    create(s.addr, json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_ports_are_forwarded_through_the_agent() {
    let s = start(10).await;
    let (id, _) = create(s.addr, json!({})).await;
    // The in-process agent shares this network namespace, so a host listener stands in for a
    // server inside the sandbox.
    let inner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = inner.local_addr().unwrap().port().to_string();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = inner.accept().await else { return };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                    let path = req.uri().path().to_string();
                    let body = req.into_body().collect().await?.to_bytes();
                    Ok::<_, hyper::Error>(hyper::Response::new(Full::new(Bytes::from(format!("{path}:{}", body.len())))))
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    let r = call(s.addr, Method::POST, "/echo", &[("e2b-sandbox-id", &id), ("e2b-sandbox-port", &port)], "12345").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body, Bytes::from("/echo:5"));
    let host = format!("{port}-{id}.localhost:3000");
    let r = call(s.addr, Method::GET, "/via-host", &[("host", &host)], "").await;
    assert_eq!(r.body, Bytes::from("/via-host:0"));
    // Nothing listening: 502 saying so.
    let r = call(s.addr, Method::GET, "/", &[("e2b-sandbox-id", &id), ("e2b-sandbox-port", "1")], "").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert!(r.json()["message"].as_str().unwrap().contains("port is not open"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_waits_for_the_start_command_and_reports_its_failure() {
    let s = start(10).await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let begun = std::time::Instant::now();
    let (id, token) = create(s.addr, json!({"templateID": format!("svc-{port}")})).await;
    // Answered only once the service listens: no retry needed by the client.
    assert!(begun.elapsed() >= Duration::from_millis(400));
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("the service listens once create returns");
    // It is an ordinary process of the sandbox, tagged so that it can be found.
    let r = call(
        s.addr,
        Method::POST,
        "/process.Process/List",
        &[("e2b-sandbox-id", &id), ("e2b-sandbox-port", "49983"), ("x-access-token", &token), ("content-type", "application/json")],
        "{}",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.json()["processes"].as_array().unwrap().iter().any(|p| p["tag"] == json!("start")), "{:?}", r.json());

    let r = api(s.addr, Method::POST, "/v2/sandboxes", r#"{"templateID": "svc-broken"}"#).await;
    assert_error(&r, StatusCode::INTERNAL_SERVER_ERROR);
    let msg = r.json()["message"].as_str().unwrap().to_string();
    assert!(msg.contains("exit status 3") && msg.contains("missing-config-file"), "{msg}");
    // The failed sandbox is gone, not half-made.
    let r = api(s.addr, Method::GET, "/v2/sandboxes", "").await;
    assert_eq!(r.json().as_array().unwrap().len(), 1, "{:?}", r.json());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slower_sandbox_gets_more_time_to_start_its_service() {
    let s = start(10).await;
    let free_port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // At the host's speed, a service later than its image's timeout fails the create...
    let r = api(s.addr, Method::POST, "/v2/sandboxes", &json!({"templateID": format!("late-1-{}", free_port())}).to_string()).await;
    assert_error(&r, StatusCode::INTERNAL_SERVER_ERROR);
    let msg = r.json()["message"].as_str().unwrap().to_string();
    assert!(msg.contains("did not open port") && msg.contains("within 1s"), "{msg}");
    // ...while a sandbox that runs code 10x slower (an emulated CPU) is given 10x the time.
    let port = free_port();
    create(s.addr, json!({"templateID": format!("late-10-{port}")})).await;
    std::net::TcpStream::connect(("127.0.0.1", port)).expect("the service listens once create returns");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_files_urls_act_only_on_what_was_signed() {
    use cordon_server::auth::{file_signature, FileOp};
    let s = start(10).await;
    let (id, token) = create(s.addr, json!({})).await;
    // The in-process agent sees the host's files.
    let public = s._dir.0.join("public.txt");
    let secret = s._dir.0.join("secret.txt");
    std::fs::write(&public, "public").unwrap();
    std::fs::write(&secret, "secret").unwrap();
    let enc = |v: &str| cordon_envd::files::percent_encode(v);
    let (public_s, secret_s) = (public.to_str().unwrap(), secret.to_str().unwrap());
    let sig = enc(&file_signature(public_s, FileOp::Read, "", &token, None));
    let url = format!("/files?path={}&signature={sig}", enc(public_s));
    let r = call(s.addr, Method::GET, &url, &[("e2b-sandbox-id", &id)], "").await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"public"[..]));

    // A user the signature does not name is refused by the signature.
    let r = call(s.addr, Method::GET, &format!("{url}&username=root"), &[("e2b-sandbox-id", &id)], "").await;
    assert_error(&r, StatusCode::UNAUTHORIZED);
    // A second path (in any spelling of the key) or user is refused, with or without sandbox
    // headers, and so is a repeated signature.
    let signed_for_root = enc(&file_signature(public_s, FileOp::Read, "root", &token, None));
    let url_root = format!("/files?path={}&username=root&signature={signed_for_root}", enc(public_s));
    let r = call(s.addr, Method::GET, &url_root, &[("e2b-sandbox-id", &id)], "").await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"public"[..]));
    for (url, extra) in [
        (&url, format!("&path={}", enc(secret_s))),
        (&url, format!("&pa%74h={}", enc(secret_s))),
        (&url, format!("&signature={sig}")),
        (&url_root, "&username=nobody".to_string()),
        (&url_root, "&user%6Eame=".to_string()),
    ] {
        for headers in [&[("e2b-sandbox-id", id.as_str())][..], &[]] {
            let r = call(s.addr, Method::GET, &format!("{url}{extra}"), headers, "").await;
            assert_error(&r, StatusCode::BAD_REQUEST);
            let msg = r.json()["message"].as_str().unwrap().to_string();
            assert!(msg.starts_with("Invalid format for parameter ") && msg.contains("give each query parameter once"), "{msg}");
        }
        let bad = format!("{url}{extra}");
        let r = call(s.addr, Method::GET, &bad, &[("e2b-sandbox-id", &id), ("x-access-token", &token)], "").await;
        assert_error(&r, StatusCode::BAD_REQUEST);
    }
    // Parameters the signature does not cover do not reach the agent.
    let r = call(s.addr, Method::GET, &format!("{url}&gzip=1&other=x"), &[("e2b-sandbox-id", &id)], "").await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"public"[..]));

    // A write URL: the signed path is written, nothing else.
    let target = s._dir.0.join("upload.txt");
    let wsig = enc(&file_signature(target.to_str().unwrap(), FileOp::Write, "", &token, None));
    let wurl = format!("/files?path={}&signature={wsig}", enc(target.to_str().unwrap()));
    let h = [("e2b-sandbox-id", id.as_str()), ("content-type", "application/octet-stream")];
    let r = call(s.addr, Method::POST, &format!("{wurl}&path={}", enc(secret_s)), &h, "pwned").await;
    assert_error(&r, StatusCode::BAD_REQUEST);
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "secret");
    let r = call(s.addr, Method::POST, &wurl, &h, "written").await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_command_port_that_needs_the_token_takes_only_requests_with_it() {
    let s = start(10).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let r = api(s.addr, Method::POST, "/v2/sandboxes", &json!({"templateID": format!("tok-{port}")}).to_string()).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let v = r.json();
    let (id, token) = (v["sandboxID"].as_str().unwrap().to_string(), v["envdAccessToken"].as_str().unwrap().to_string());
    let traffic = v["trafficAccessToken"].as_str().expect("a traffic token").to_string();
    assert_ne!(traffic, token);
    let (_, other_token) = create(s.addr, json!({})).await;
    let port_s = port.to_string();
    let get = |extra: Vec<(&'static str, String)>| {
        let mut h: Vec<(&str, String)> = vec![("e2b-sandbox-id", id.clone()), ("e2b-sandbox-port", port_s.clone())];
        h.extend(extra);
        async move {
            let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
            call(s.addr, Method::GET, "/", &h, "").await
        }
    };
    // The sandbox id alone, a wrong token, another sandbox's token: refused before the service.
    assert_error(&get(vec![]).await, StatusCode::UNAUTHORIZED);
    assert_error(&get(vec![("x-access-token", "wrong".into())]).await, StatusCode::UNAUTHORIZED);
    assert_error(&get(vec![("x-access-token", other_token.clone())]).await, StatusCode::UNAUTHORIZED);
    assert_error(&get(vec![("e2b-traffic-access-token", token.clone() + "x")]).await, StatusCode::UNAUTHORIZED);
    assert_error(
        &get(vec![("x-access-token", token.clone()), ("e2b-traffic-access-token", "wrong".into())]).await,
        StatusCode::UNAUTHORIZED,
    );
    // The Host form (`get_host()` URLs) is the same port.
    let host = format!("{port}-{id}.localhost");
    assert_error(&call(s.addr, Method::GET, "/", &[("host", &host)], "").await, StatusCode::UNAUTHORIZED);
    // Either token opens it, and the service never sees either header.
    for (name, value) in [("x-access-token", token.clone()), ("e2b-traffic-access-token", traffic.clone())] {
        let r = get(vec![(name, value)]).await;
        assert_eq!(r.status, StatusCode::OK, "{name}: {:?}", r.body);
        let seen = String::from_utf8_lossy(&r.body).to_string();
        assert!(seen.contains("e2b-sandbox-id") && !seen.contains("token"), "{seen}");
    }
    // The traffic token is not an envd credential.
    assert_error(&stat(s.addr, &id, Some(&traffic)).await, StatusCode::UNAUTHORIZED);

    // A start command that does not declare it keeps its port open.
    let open = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (oid, _) = create(s.addr, json!({"templateID": format!("pub-{open}")})).await;
    let open_s = open.to_string();
    let r = call(s.addr, Method::GET, "/", &[("e2b-sandbox-id", &oid), ("e2b-sandbox-port", &open_s)], "").await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_are_newest_first_unless_asc() {
    let s = start(10).await;
    let mut made = Vec::new();
    for _ in 0..3 {
        made.push(json!(create(s.addr, json!({})).await.0));
    }
    let ids = |r: Resp| -> Vec<Value> { r.json().as_array().unwrap().iter().map(|s| s["sandboxID"].clone()).collect() };
    let newest_first: Vec<Value> = made.iter().rev().cloned().collect();
    assert_eq!(ids(api(s.addr, Method::GET, "/v2/sandboxes", "").await), newest_first);
    assert_eq!(ids(api(s.addr, Method::GET, "/v2/sandboxes?order=desc", "").await), newest_first);
    assert_eq!(ids(api(s.addr, Method::GET, "/v2/sandboxes?order=asc", "").await), made);
    // Pages keep the order across tokens.
    let first = api(s.addr, Method::GET, "/v2/sandboxes?limit=2", "").await;
    let token = first.headers.get("x-next-token").expect("a next token").to_str().unwrap().to_string();
    let mut walked = ids(first);
    walked.extend(ids(api(s.addr, Method::GET, &format!("/v2/sandboxes?limit=2&nextToken={token}"), "").await));
    assert_eq!(walked, newest_first);
    let r = api(s.addr, Method::GET, "/v2/sandboxes?order=sideways", "").await;
    assert_error(&r, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&r.body).contains("use asc or desc"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_aliases_exist_for_recipes_and_built_images_only() {
    let s = start(1).await;
    // Built-in recipes exist before their first build (a create builds them).
    for name in cordon_image::recipes() {
        let r = api(s.addr, Method::GET, &format!("/templates/aliases/{name}"), "").await;
        assert_eq!(r.status, StatusCode::OK, "{name}: {:?}", r.body);
        assert_eq!(r.json(), json!({"templateID": name, "public": false}));
    }
    for missing in ["no-such-template", "Bad%20Name", "%2e%2e"] {
        assert_error(&api(s.addr, Method::GET, &format!("/templates/aliases/{missing}"), "").await, StatusCode::NOT_FOUND);
    }
    // The API key guards it like every other endpoint.
    let r = call(s.addr, Method::GET, "/templates/aliases/base", &[], "").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_or_forged_signed_url_gets_envds_answer_not_the_control_planes() {
    use cordon_server::auth::{file_signature, FileOp};
    let s = start(10).await;
    let (_id, token) = create(s.addr, json!({})).await;
    let file = s._dir.0.join("f.txt");
    std::fs::write(&file, "f").unwrap();
    let enc = |v: &str| cordon_envd::files::percent_encode(v);
    let path = file.to_str().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    // URLs as download_url() makes them from E2B_SANDBOX_URL: no sandbox header, the
    // signature alone names the sandbox.
    let signed = |exp: i64| {
        let sig = enc(&file_signature(path, FileOp::Read, "", &token, Some(exp)));
        format!("/files?path={}&signature={sig}&signature_expiration={exp}", enc(path))
    };
    let r = call(s.addr, Method::GET, &signed(now + 60), &[], "").await;
    assert_eq!((r.status, &r.body[..]), (StatusCode::OK, &b"f"[..]));
    let r = call(s.addr, Method::GET, &signed(now - 10), &[], "").await;
    assert_error(&r, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json()["message"], json!("signature is already expired"));
    // A signature no sandbox made: envd's words, not "missing API key".
    let forged = format!("/files?path={}&signature=v1_AAAA", enc(path));
    let r = call(s.addr, Method::GET, &forged, &[], "").await;
    assert_error(&r, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json()["message"], json!("invalid signature"));
    // An expiry moved into the future breaks the signature instead.
    let moved = signed(now - 10).replace(&format!("signature_expiration={}", now - 10), &format!("signature_expiration={}", now + 60));
    let r = call(s.addr, Method::GET, &moved, &[], "").await;
    assert_eq!(r.json()["message"], json!("invalid signature"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answer_a_time_range() {
    let s = start(10).await;
    let (id, _) = create(s.addr, json!({})).await;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let get = |q: String| {
        let id = id.clone();
        async move { api(s.addr, Method::GET, &format!("/sandboxes/{id}/metrics{q}"), "").await }
    };
    let all = get(String::new()).await.json();
    assert!(!all.as_array().unwrap().is_empty(), "{all}");
    let inside = get(format!("?start={}&end={}", now - 5, now + 5)).await.json();
    let times: Vec<i64> = inside.as_array().unwrap().iter().map(|m| m["timestampUnix"].as_i64().unwrap()).collect();
    assert!(!times.is_empty() && times.iter().all(|t| (now - 5..=now + 5).contains(t)), "{inside}");
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "oldest first: {times:?}");
    // Before the sandbox existed: nothing.
    assert_eq!(get(format!("?start={}&end={}", now - 7200, now - 3600)).await.json(), json!([]));
    for bad in ["?start=yesterday", "?end=1.5", &format!("?start={}&end={}", now, now - 10)] {
        assert_error(&get(bad.to_string()).await, StatusCode::BAD_REQUEST);
    }
}

/// `--network-default open`: what each of E2B's network shapes gives, as the sandbox's detail
/// reports it (the forwarder's side of the same policies is driven in crates/cli/tests/egress.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_open_network_default_gives_e2bs_semantics_and_reports_them() {
    let open = start_with(8, cordon_server::network::NetworkDefault::Open).await;
    let closed = start(8).await;
    let network = |addr: SocketAddr, body: Value| async move {
        let (id, _) = create(addr, body).await;
        let d = api(addr, Method::GET, &format!("/sandboxes/{id}"), "").await;
        assert_eq!(d.status, StatusCode::OK);
        let n = d.json()["network"].clone();
        let list = |k: &str| n[k].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect::<Vec<_>>();
        (n["default"].as_str().unwrap().to_string(), list("allowOut"), list("denyOut"))
    };
    let all = ["0.0.0.0/0".to_string(), "::/0".to_string()];
    // No rules: the internet.
    let (mode, allow, deny) = network(open.addr, json!({"templateID": "base"})).await;
    assert_eq!((mode.as_str(), &allow[..], deny.len()), ("open", &all[..], 0));
    // denyOut alone: a blocklist.
    let (_, allow, deny) = network(open.addr, json!({"templateID": "base", "network": {"denyOut": ["203.0.113.0/24"]}})).await;
    assert_eq!((&allow[..], &deny[..]), (&all[..], &["203.0.113.0/24".to_string()][..]));
    // E2B's allowlist idiom: all traffic denied (IPv6 too), the allowOut entries through.
    let (_, allow, deny) = network(open.addr, json!({"templateID": "base", "network": {"allowOut": ["203.0.113.7"], "denyOut": ["0.0.0.0/0"]}})).await;
    assert!(allow.contains(&"203.0.113.7/32".to_string()), "{allow:?}");
    assert_eq!(deny, all, "{deny:?}");
    // allow_internet_access false: closed.
    let (mode, allow, _) = network(open.addr, json!({"templateID": "base", "allow_internet_access": false})).await;
    assert_eq!((mode.as_str(), allow.len()), ("closed", 0));
    // The closed default: no rules, or deny rules alone, are no network.
    let (mode, allow, _) = network(closed.addr, json!({"templateID": "base", "network": {"denyOut": ["203.0.113.0/24"]}})).await;
    assert_eq!((mode.as_str(), allow.len()), ("closed", 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_give_their_value_back() {
    const VALUE: &str = "s3cr3t-value-never-returned";
    let s = start(10).await;
    let r = call(s.addr, Method::GET, "/secrets", &[], "").await;
    assert_error(&r, StatusCode::UNAUTHORIZED);

    let r = api(s.addr, Method::POST, "/secrets", &json!({"name": "Api-Key", "value": VALUE, "metadata": {"team": "ml"}}).to_string()).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    let created = r.json();
    let id = created["secretID"].as_str().unwrap().to_string();
    assert!(id.starts_with("sec_"));
    assert_eq!((&created["name"], &created["currentVersion"], &created["metadata"]), (&json!("api-key"), &json!(1), &json!({"team": "ml"})));
    let mut keys: Vec<_> = created.as_object().unwrap().keys().cloned().collect();
    keys.sort();
    assert_eq!(keys, ["createdAt", "currentVersion", "metadata", "name", "secretID", "updatedAt"]);

    assert_error(&api(s.addr, Method::POST, "/secrets", &json!({"name": "API-KEY", "value": "x"}).to_string()).await, StatusCode::CONFLICT);
    for bad in [json!({"name": "sec_x", "value": "x"}), json!({"name": "a b", "value": "x"}), json!({"name": "n"}), json!({"name": "n", "value": 12345}), json!([1])] {
        let r = api(s.addr, Method::POST, "/secrets", &bad.to_string()).await;
        assert_error(&r, StatusCode::BAD_REQUEST);
        assert!(!String::from_utf8_lossy(&r.body).contains("12345"), "{:?}", r.body);
    }

    // By id, by name in any case, percent-encoded.
    for key in [id.as_str(), "api-key", "API-Key", "api%2Dkey"] {
        let r = api(s.addr, Method::GET, &format!("/secrets/{key}"), "").await;
        assert_eq!(r.status, StatusCode::OK, "{key}");
        assert_eq!(r.json(), created);
    }
    assert_error(&api(s.addr, Method::GET, "/secrets/missing", "").await, StatusCode::NOT_FOUND);

    let r = api(s.addr, Method::POST, "/secrets/API-KEY", &json!({"value": "second"}).to_string()).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!((&r.json()["currentVersion"], &r.json()["metadata"]), (&json!(2), &json!({"team": "ml"})));
    assert_error(&api(s.addr, Method::POST, "/secrets/missing", &json!({"value": "v"}).to_string()).await, StatusCode::NOT_FOUND);

    let r = api(s.addr, Method::POST, "/secrets", &json!({"name": "other", "value": VALUE}).to_string()).await;
    assert_eq!(r.json()["metadata"], json!({}));
    let r = api(s.addr, Method::GET, "/secrets?limit=1", "").await;
    assert_eq!(r.json().as_array().unwrap().len(), 1);
    let next = r.headers.get("x-next-token").unwrap().to_str().unwrap().to_string();
    let r = api(s.addr, Method::GET, &format!("/secrets?limit=1&nextToken={next}"), "").await;
    assert_eq!(r.json()[0]["name"], json!("other"));
    assert!(r.headers.get("x-next-token").is_none());
    assert_error(&api(s.addr, Method::GET, "/secrets?limit=0", "").await, StatusCode::BAD_REQUEST);
    assert_error(&api(s.addr, Method::GET, "/secrets?nextToken=bogus", "").await, StatusCode::BAD_REQUEST);
    for path in ["/secrets", &format!("/secrets/{id}"), "/secrets?limit=5"] {
        let r = api(s.addr, Method::GET, path, "").await;
        assert!(!String::from_utf8_lossy(&r.body).contains(VALUE) && !String::from_utf8_lossy(&r.body).contains("second"), "{path}");
    }

    let r = api(s.addr, Method::DELETE, "/secrets/Api-Key", "").await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_error(&api(s.addr, Method::DELETE, &format!("/secrets/{id}"), "").await, StatusCode::NOT_FOUND);
}
