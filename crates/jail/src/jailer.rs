//! The jailer: a short-lived, single-threaded process that creates one sandbox and exits.
//!
//! The host process (a multi-threaded server) cannot safely fork and then run setup code, so it
//! re-executes its own binary as the jailer, which does one thing in a fixed order, as
//! Firecracker's jailer does:
//!
//! 1. join the sandbox's cgroups (everything forked later inherits them);
//! 2. bind the agent's socket on the host side, in the host's network namespace;
//! 3. create the network namespace, owned by the host's user namespace so that nothing inside
//!    ever holds CAP_NET_ADMIN over it, and bring loopback up; with an egress policy, also the
//!    TUN device whose descriptor the host takes (see `tun`);
//! 4. clone the sandbox init into new user, mount, pid, ipc, uts and cgroup namespaces, the
//!    user namespace created by the range's own host uid (see `run`);
//! 5. write its uid/gid maps, clone the image as an idmapped read-only tree through that user
//!    namespace and hand it over;
//! 6. wait until the init has exec'd the agent (its end of a close-on-exec socket closes) or
//!    reported an error, print the outcome, exit.
//!
//! The init (the clone) builds its root, pivots, leaves the session (and so the controlling
//! terminal) of whoever started cordon, drops to a clean fd table and environment, and execs the
//! agent from a descriptor: the agent binary is never mounted into the sandbox. The descriptor is
//! a detached clone of the binary's mount, so `/proc/1/exe` and the agent's maps name `/` and
//! nothing of the host's paths. The agent's configuration arrives on a sealed memfd
//! ([`CONFIG_FD`]), never in the environment, whose single strings the kernel caps at 128 KiB.

use crate::landlock::Enforced;
use crate::{rootfs, sys};
use serde::{Deserialize, Serialize};
use std::ffi::CString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

/// Everything the jailer needs, sent as JSON on its stdin.
#[derive(Debug, Serialize, Deserialize)]
pub struct JailerConfig {
    pub id: String,
    /// The image's layers, bottom first.
    pub layers: Vec<PathBuf>,
    pub staging: PathBuf,
    /// `staging` is already a tmpfs the host mounted (a kept writable layer): use it as is.
    #[serde(default)]
    pub premounted: bool,
    pub socket: PathBuf,
    pub uid_base: u32,
    pub uid_count: u32,
    /// The sandbox's cgroup v2 group, if the host has the unified hierarchy.
    pub cgroup_unified: Option<PathBuf>,
    /// Its v1 groups' `tasks` files (see [`enter_cgroups`]).
    pub cgroup_v1_tasks: Vec<PathBuf>,
    pub disk_bytes: u64,
    pub nofile: u64,
    /// Bytes the agent reads from [`CONFIG_FD`]; sent raw after the JSON line, not inside it.
    #[serde(skip)]
    pub agent_config: Vec<u8>,
    pub agent_config_len: usize,
    /// Whether ptrace and process_vm_* are allowed inside (debuggers, profilers).
    #[serde(default)]
    pub allow_ptrace: bool,
    /// Whether denied syscalls go to a host-side audit listener (see `audit`).
    #[serde(default)]
    pub audit: bool,
    /// Give the sandbox a TUN interface whose far end the host holds (egress policy set).
    #[serde(default)]
    pub tun: bool,
    /// TCP ports Landlock allows connecting to; `None`: TCP not handled by Landlock.
    #[serde(default)]
    pub connect_ports: Option<Vec<(u16, u16)>>,
    /// Volumes: host directories to bind at paths inside, after the image's layers.
    #[serde(default)]
    pub volumes: Vec<cordon_spec::VolumeMount>,
    /// The host's egress CA, added to the image's trust (see `cordon_host::trust`).
    #[serde(default)]
    pub egress_ca: Option<String>,
}

/// The descriptor the agent finds its configuration on (`CORDON_AGENT_CONFIG_FD`), after the
/// listening socket on 3.
pub const CONFIG_FD: RawFd = 4;

/// The jailer's one line of output.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JailerReply {
    /// `phases`: microseconds since the jailer started at the end of each step, for tracing.
    /// `notify_fd`: the jailer's fd number of the seccomp listener, which the host takes with
    /// pidfd_getfd before letting the jailer exit; `tun_fd` likewise for the TUN device.
    Ready {
        pid: i32,
        phases: Vec<(String, u64)>,
        /// `None` when the init exec'd without saying (it always says, before its exec).
        landlock: Option<Enforced>,
        notify_fd: Option<i32>,
        #[serde(default)]
        tun_fd: Option<i32>,
        /// The process holding `notify_fd` and `tun_fd`: the jailer's copy born in the
        /// sandbox's cgroup (see [`enter_cgroups`]), else the jailer itself.
        #[serde(default)]
        holder: Option<i32>,
    },
    Failed { error: String },
}

/// Entry point of `cordon __jail`. Never returns.
pub fn main() -> ! {
    let mut input = String::new();
    let mut keep = Vec::new();
    let reply = match io::stdin().read_line(&mut input) {
        Err(e) => JailerReply::Failed { error: format!("reading jailer config: {e}") },
        Ok(_) => match serde_json::from_str::<JailerConfig>(&input).map_err(|e| format!("bad jailer config: {e}")).and_then(|mut cfg| {
            cfg.agent_config = vec![0; cfg.agent_config_len];
            io::stdin().read_exact(&mut cfg.agent_config).map_err(|e| format!("reading the agent's config: {e}"))?;
            Ok(cfg)
        }) {
            Err(error) => JailerReply::Failed { error },
            Ok(cfg) => match run(&cfg) {
                Ok(Ready { pid, phases, landlock, listener, tun }) => {
                    let notify_fd = listener.as_ref().map(|l| l.as_raw_fd());
                    let tun_fd = tun.as_ref().map(|t| t.as_raw_fd());
                    keep.extend(listener);
                    keep.extend(tun);
                    JailerReply::Ready { pid, phases, landlock, notify_fd, tun_fd, holder: Some(std::process::id() as i32) }
                }
                Err(e) => JailerReply::Failed { error: e.to_string() },
            },
        },
    };
    let ok = matches!(reply, JailerReply::Ready { .. });
    let mut out = io::stdout().lock();
    let _ = serde_json::to_writer(&mut out, &reply);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
    if !keep.is_empty() {
        // The host takes the listener and the TUN from us; EOF on stdin says it has.
        let _ = io::stdin().read_to_end(&mut Vec::new());
    }
    drop(keep);
    std::process::exit(if ok { 0 } else { 1 })
}

/// Puts the jailer, and so everything it starts, in the sandbox's cgroups without the wait a
/// move costs. A write to `cgroup.procs` takes the kernel's threadgroup lock, whose writer waits
/// for an RCU grace period (5-10 ms on this machine kind, on every start; `cordon doctor`'s
/// `cgroup moves`). So the unified group is entered by being born in it: the jailer clones
/// itself with `CLONE_INTO_CGROUP`, the copy goes on and replies, and the original waits for it
/// and exits with its status. A v1 group is entered by writing "0" to its `tasks`, which moves
/// the calling thread only (all of the single-threaded jailer) and takes no such lock. A kernel
/// without clone3 or `CLONE_INTO_CGROUP` (before 5.7) gets the `cgroup.procs` write.
fn enter_cgroups(cfg: &JailerConfig) -> io::Result<()> {
    let join = |file: &std::path::Path| fs::write(file, "0").map_err(|e| io::Error::new(e.kind(), format!("join cgroup {}: {e}", file.display())));
    if let Some(dir) = &cfg.cgroup_unified {
        // SAFETY: the jailer is single-threaded (a fresh exec that starts no threads).
        match unsafe { sys::fork_into_cgroup(dir) } {
            Ok(0) => {}
            Ok(copy) => exit_as(copy),
            Err(e) => {
                tracing::debug!("{e}: joining by cgroup.procs");
                join(&dir.join("cgroup.procs"))?;
            }
        }
    }
    for tasks in &cfg.cgroup_v1_tasks {
        join(tasks)?;
    }
    Ok(())
}

/// The original jailer's end after [`enter_cgroups`]: waits for its copy and exits as it did.
fn exit_as(copy: libc::pid_t) -> ! {
    let mut status = 0;
    // SAFETY: waiting for our own child, with a valid status pointer.
    let r = unsafe { libc::waitpid(copy, &mut status, 0) };
    let code = if r == copy && libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 1 };
    std::process::exit(code)
}

struct Ready {
    pid: i32,
    phases: Vec<(String, u64)>,
    landlock: Option<Enforced>,
    listener: Option<OwnedFd>,
    tun: Option<OwnedFd>,
}

fn run(cfg: &JailerConfig) -> io::Result<Ready> {
    let t0 = std::time::Instant::now();
    let mut phases = Vec::new();
    let mut mark = |name: &str| phases.push((name.to_string(), t0.elapsed().as_micros() as u64));
    enter_cgroups(cfg)?;
    mark("cgroups joined");
    // Bound before the network namespace exists: a Unix socket belongs to the namespace it was
    // made in, and the sandbox's /proc/net/unix lists its own namespace's sockets with their
    // paths. Made here, the agent's listener (and every connection accepted on it) stays in the
    // host's namespace, and no host path shows inside.
    let _ = fs::remove_file(&cfg.socket);
    let listener = UnixListener::bind(&cfg.socket)
        .map_err(|e| io::Error::new(e.kind(), format!("bind agent socket {}: {e}", cfg.socket.display())))?;
    fs::set_permissions(&cfg.socket, fs::Permissions::from_mode(0o600))?;

    sys::unshare(libc::CLONE_NEWNET)?;
    sys::loopback_up()?;
    // Close-on-exec: the init inherits it across the clone but drops it at its exec.
    let tun = if cfg.tun { Some(crate::tun::create()?) } else { None };
    mark("netns ready");

    // A detached clone of the binary's mount, not the file opened by path: exec'd from it, the
    // agent's /proc/1/exe and maps read `/` instead of the host path of the cordon binary.
    let exe = sys::open_tree_clone(std::path::Path::new("/proc/self/exe"))?;
    let (parent_end, child_end) = sys::socketpair()?;

    let flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP;
    // The user namespace is created by the range's own host uid, not by host root. The kernel
    // counts what the users of a namespace hold (inotify instances and watches, POSIX message
    // queue bytes, pending signals, locked memory, processes, namespaces) in every ancestor
    // namespace too, ending at the host uid that created it: made by root, every sandbox would
    // spend host root's per-user budgets, and one sandbox could exhaust them for the host and
    // all the others. Made by its own uid, a sandbox has exactly one host user's share.
    sys::set_effective_ids(cfg.uid_base)?;
    // SAFETY: the jailer is single-threaded (it is a fresh exec that starts no threads).
    let forked = unsafe { sys::clone_fork(flags) };
    if !matches!(forked, Ok(0)) {
        sys::set_effective_ids(0)?;
    }
    let pid = forked?;
    if pid == 0 {
        drop(parent_end);
        init(cfg, child_end, listener.as_raw_fd(), exe.as_raw_fd());
    }
    drop(child_end);
    drop(listener);
    drop(exe);

    mark("init cloned");
    match hand_over(cfg, pid, &parent_end) {
        Ok((landlock, listener)) => {
            mark("agent exec'd");
            Ok(Ready { pid, phases, landlock, listener, tun })
        }
        Err(e) => {
            // SAFETY: pid is our own child, just created.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            Err(e)
        }
    }
}

/// The jailer's half of the handshake: maps, idmapped image, then wait for exec or an error.
/// Returns the Landlock status the init reported and, when auditing, the seccomp listener.
fn hand_over(cfg: &JailerConfig, pid: i32, sock: &OwnedFd) -> io::Result<(Option<Enforced>, Option<OwnedFd>)> {
    let map = format!("0 {} {}\n", cfg.uid_base, cfg.uid_count);
    fs::write(format!("/proc/{pid}/uid_map"), &map)?;
    fs::write(format!("/proc/{pid}/gid_map"), &map)?;

    let userns: OwnedFd = fs::File::open(format!("/proc/{pid}/ns/user"))?.into();
    // Every layer idmapped for the sandbox's range, in order, bottom first; the init counts
    // them from the same config.
    let mut trees = Vec::with_capacity(cfg.layers.len());
    for layer in &cfg.layers {
        let tree = sys::open_tree_clone(layer)?;
        sys::mount_setattr(&tree, sys::MOUNT_ATTR_IDMAP | sys::MOUNT_ATTR_RDONLY | sys::MOUNT_ATTR_NODEV, Some(&userns))?;
        trees.push(tree);
    }
    // Then every volume, idmapped the same way: a file that sandbox uid 1000 wrote is uid 1000
    // on the volume's disk and in every other sandbox that mounts it, whatever their ranges.
    for v in &cfg.volumes {
        let tree = sys::open_tree_clone(&v.source)?;
        let ro = if v.read_only { sys::MOUNT_ATTR_RDONLY } else { 0 };
        sys::mount_setattr(&tree, sys::MOUNT_ATTR_IDMAP | sys::MOUNT_ATTR_NOSUID | sys::MOUNT_ATTR_NODEV | ro, Some(&userns))?;
        trees.push(tree);
    }
    for tree in trees {
        sys::send_fd(sock, &tree)?;
    }

    // Messages until EOF: the seccomp listener (an fd), `landlock=<status>` just before exec,
    // or an error. EOF (the close-on-exec socket closing) means the exec happened.
    let mut landlock = None;
    let mut listener = None;
    loop {
        let (msg, fd) = sys::recv_msg(sock)?;
        if let Some(fd) = fd {
            listener = Some(fd);
            continue;
        }
        if msg.is_empty() {
            return Ok((landlock, listener));
        }
        let msg = String::from_utf8_lossy(&msg).into_owned();
        match msg.strip_prefix("landlock=") {
            Some(status) => {
                landlock = Some(Enforced::parse(status).ok_or_else(|| io::Error::other(format!("the init sent an unknown Landlock status {status:?}")))?)
            }
            None => return Err(io::Error::other(msg)),
        }
    }
}

/// The sandbox init before it becomes the agent. Never returns: it execs or reports and exits.
fn init(cfg: &JailerConfig, sock: OwnedFd, listener: RawFd, exe: RawFd) -> ! {
    let err = match init_inner(cfg, &sock, listener, exe) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    let msg = format!("sandbox setup failed: {err}");
    // SAFETY: writing a local buffer to our socket end; we exit right after.
    unsafe {
        libc::write(sock.as_raw_fd(), msg.as_ptr().cast(), msg.len());
        libc::_exit(127)
    }
}

fn high_fd(fd: RawFd) -> io::Result<RawFd> {
    // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor >= 64 for a valid fd.
    let r = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 64) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn init_inner(cfg: &JailerConfig, sock: &OwnedFd, listener: RawFd, exe: RawFd) -> io::Result<std::convert::Infallible> {
    // Move the two descriptors we keep out of the way of 0..=3, which are about to be reassigned.
    let listener = high_fd(listener)?;
    let exe = high_fd(exe)?;

    // The image arrives only after the maps are written, so this is also the go signal.
    let mut image = Vec::with_capacity(cfg.layers.len());
    for _ in 0..cfg.layers.len() {
        image.push(sys::recv_fd(sock)?.ok_or_else(|| io::Error::other("jailer went away"))?);
    }
    let mut volumes = Vec::with_capacity(cfg.volumes.len());
    for v in &cfg.volumes {
        volumes.push((sys::recv_fd(sock)?.ok_or_else(|| io::Error::other("jailer went away"))?, v.target.clone()));
    }
    sys::become_root()?;
    rootfs::enter(rootfs::RootPlan {
        staging: &cfg.staging,
        premounted: cfg.premounted,
        image,
        volumes,
        disk_bytes: cfg.disk_bytes,
        hostname: &cfg.id,
        nameservers: cfg.tun,
        egress_ca: cfg.egress_ca.as_deref(),
    }, &rootfs::Kernel)?;

    sys::setrlimit(libc::RLIMIT_NOFILE, cfg.nofile, cfg.nofile)?;
    sys::setrlimit(libc::RLIMIT_CORE, 0, 0)?;
    // A session of its own: the jailer runs in the session of whoever started cordon (a
    // terminal, for `cordon run` and `cordon mcp`), and a process of that session can reopen
    // its controlling terminal through /dev/tty. The new session has no terminal at all.
    sys::setsid()?;
    let config = sys::sealed_memfd("cordon-agent-config", &cfg.agent_config)?;

    let null: OwnedFd = fs::OpenOptions::new().read(true).write(true).open("/dev/null")?.into();
    for fd in 0..3 {
        sys::dup2(null.as_raw_fd(), fd)?;
    }
    drop(null);
    sys::dup2(listener, 3)?;
    sys::dup2(config.as_raw_fd(), CONFIG_FD)?;
    drop(config);
    sys::cloexec_from(CONFIG_FD as libc::c_uint + 1)?;

    // The three filters, in the order that keeps each step permitted by the ones before it.
    // SAFETY: `exe` is an fd this process owns until exec.
    let exe_fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(exe) };
    let landlock = crate::landlock::apply(exe_fd, cfg.connect_ports.as_deref())?;
    // With ptrace off the agent scopes every command in a Landlock domain of its own, which
    // takes CAP_SYS_ADMIN; it drops that from each command's bounding set (cordon-agent's
    // `command_scope`).
    crate::caps::drop_bounding(!cfg.allow_ptrace)?;
    // From here on a denied syscall waits for the audit listener's holder, so nothing below
    // may make one: sendmsg, write and execveat are all allowed.
    if let Some(listener) = crate::seccomp::apply(cfg.allow_ptrace, cfg.audit)? {
        sys::send_fd(sock, &listener)?;
    }
    let status = format!("landlock={}", landlock.as_str());
    // SAFETY: writing a local buffer to our socket end.
    unsafe { libc::write(sock.as_raw_fd(), status.as_ptr().cast(), status.len()) };

    let argv = [CString::new("cordon-agent").expect("static")];
    let envp = [
        CString::new("CORDON_AGENT_FD=3").expect("static"),
        CString::new(format!("CORDON_AGENT_CONFIG_FD={CONFIG_FD}")).expect("no NUL"),
    ];
    Err(sys::execveat_fd(exe, &argv, &envp))
}

/// What the host takes from the jailer before it exits.
#[derive(Default)]
pub(crate) struct Taken {
    pub listener: Option<OwnedFd>,
    pub tun: Option<OwnedFd>,
}

/// Runs a jailer as a child of the current process and waits for its reply; takes the seccomp
/// listener and the TUN from it when there are some.
pub(crate) fn spawn(exe: &std::path::Path, cfg: &JailerConfig) -> io::Result<(JailerReply, Taken)> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(exe)
        .arg("__jail")
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("start jailer {}: {e}", exe.display())))?;
    let mut input = serde_json::to_vec(cfg).map_err(io::Error::other)?;
    input.push(b'\n');
    input.extend_from_slice(&cfg.agent_config);
    let mut stdin = child.stdin.take().expect("piped");
    stdin.write_all(&input)?;
    let mut line = String::new();
    io::BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let reply = serde_json::from_str::<JailerReply>(line.trim());
    let mut taken = Taken::default();
    if let Ok(JailerReply::Ready { notify_fd, tun_fd, holder, .. }) = &reply {
        if notify_fd.is_some() || tun_fd.is_some() {
            let pidfd = sys::pidfd_open(holder.unwrap_or(child.id() as i32))?;
            if let Some(fd) = notify_fd {
                taken.listener = Some(sys::pidfd_getfd(&pidfd, *fd)?);
            }
            if let Some(fd) = tun_fd {
                taken.tun = Some(sys::pidfd_getfd(&pidfd, *fd)?);
            }
        }
    }
    drop(stdin);
    let mut err = String::new();
    let _ = child.stderr.take().expect("piped").read_to_string(&mut err);
    let status = child.wait()?;
    match reply {
        Ok(r) => Ok((r, taken)),
        Err(_) => Ok((
            JailerReply::Failed { error: format!("jailer exited with {status} without a reply: {}", err.trim()) },
            Taken::default(),
        )),
    }
}
