//! Per-sandbox cgroups on v1, v2 or the hybrid of both, detected at run time.
//!
//! Limits come from whichever hierarchy has the controller: on pure v2 hosts the unified tree,
//! on v1/hybrid hosts the `memory`, `pids` and `cpu` hierarchies. When a unified hierarchy
//! exists at all (even without controllers, as on hybrid hosts) the sandbox also gets a group
//! there, for its `cgroup.kill` and `cgroup.events`.

use cordon_spec::Limits;
use serde::{Deserialize, Serialize};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const ROOT: &str = "/sys/fs/cgroup";
const PERIOD_US: u64 = 100_000;

/// Where each controller lives on this host.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Layout {
    /// The unified (v2) mount point, if any.
    pub unified: Option<PathBuf>,
    /// Which of memory, pids and cpu the unified hierarchy serves.
    pub v2_controllers: Vec<String>,
    /// v1 mount points of memory, pids and cpu, where v1 provides them.
    pub v1: Vec<(String, PathBuf)>,
}

impl Layout {
    /// The layout of this host's `/sys/fs/cgroup`.
    pub fn detect() -> Layout {
        Layout::detect_at(Path::new(ROOT))
    }

    /// The layout of the cgroup mounts under `root` (a temporary tree in tests).
    pub fn detect_at(root: &Path) -> Layout {
        let unified = if root.join("cgroup.controllers").exists() {
            Some(root.to_path_buf())
        } else if root.join("unified/cgroup.controllers").exists() {
            Some(root.join("unified"))
        } else {
            None
        };
        let v2_controllers: Vec<String> = unified
            .as_ref()
            .and_then(|u| fs::read_to_string(u.join("cgroup.controllers")).ok())
            .map(|s| {
                s.split_whitespace().filter(|c| ["memory", "pids", "cpu"].contains(c)).map(String::from).collect()
            })
            .unwrap_or_default();
        let mut v1 = Vec::new();
        // The unified hierarchy freezes a group through its core `cgroup.freeze` file, with or
        // without controllers; only a host without one needs v1's freezer hierarchy.
        let freezer = unified.is_none().then_some("freezer");
        for c in ["memory", "pids", "cpu"].into_iter().chain(freezer) {
            if v2_controllers.iter().any(|x| x == c) {
                continue;
            }
            let p = root.join(c);
            if p.join("cgroup.procs").exists() {
                v1.push((c.to_string(), p));
            }
        }
        Layout { unified, v2_controllers, v1 }
    }

    /// How a sandbox's group is frozen on this host (a pause with memory), if it can be.
    pub fn freezer(&self) -> Option<String> {
        if let Some(u) = &self.unified {
            return Some(format!("cgroup.freeze of the unified hierarchy at {}", u.display()));
        }
        self.v1.iter().find(|(c, _)| c == "freezer").map(|(_, p)| format!("the v1 freezer at {}", p.display()))
    }

    /// Which of memory, pids and cpu nobody provides.
    pub fn missing(&self) -> Vec<&'static str> {
        ["memory", "pids", "cpu"]
            .into_iter()
            .filter(|c| !self.v2_controllers.iter().any(|x| x == c) && !self.v1.iter().any(|(n, _)| n == c))
            .collect()
    }

    pub fn describe(&self) -> String {
        let v2 = if self.v2_controllers.is_empty() { "none".into() } else { self.v2_controllers.join(" ") };
        let v1: Vec<&str> = self.v1.iter().map(|(n, _)| n.as_str()).collect();
        match (&self.unified, v1.is_empty()) {
            (Some(u), true) => format!("v2 at {} (controllers: {v2})", u.display()),
            (Some(u), false) => format!("hybrid: v1 {} + v2 at {} (controllers: {v2})", v1.join(" "), u.display()),
            (None, _) => format!("v1 {}", v1.join(" ")),
        }
    }
}

/// The cgroups of one sandbox. Serialisable, so that a later process can reap them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cgroup {
    /// The sandbox's group in the unified hierarchy, if there is one.
    pub unified: Option<PathBuf>,
    pub v2_limits: bool,
    /// (controller, group dir) for each v1 controller used.
    pub v1: Vec<(String, PathBuf)>,
}

fn write(path: &Path, value: &str) -> io::Result<()> {
    fs::write(path, value).map_err(|e| io::Error::new(e.kind(), format!("write {value:?} to {}: {e}", path.display())))
}

/// A cgroup's limits as its files hold them (`None`: missing, or `max`). `tcp_memory_bytes` is
/// v1's separate cap on kernel TCP buffers (v2 counts them in the memory cap).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CgroupLimits {
    pub memory_bytes: Option<u64>,
    pub swap_bytes: Option<u64>,
    pub pids: Option<u64>,
    pub cpu_quota_us: Option<u64>,
    pub cpu_period_us: Option<u64>,
    pub tcp_memory_bytes: Option<u64>,
}

impl Cgroup {
    /// The groups this sandbox would use, without creating anything yet.
    pub fn plan(layout: &Layout, id: &str) -> Cgroup {
        Cgroup {
            unified: layout.unified.as_ref().map(|u| u.join("cordon").join(id)),
            v2_limits: !layout.v2_controllers.is_empty(),
            v1: layout.v1.iter().map(|(c, p)| (c.clone(), p.join("cordon").join(id))).collect(),
        }
    }

    /// Creates the groups and writes the limits. On error, whatever was created is removed.
    pub fn create(&self, limits: &Limits) -> io::Result<()> {
        let r = self.create_inner(limits);
        if r.is_err() {
            let _ = self.remove();
        }
        r
    }

    fn create_inner(&self, limits: &Limits) -> io::Result<()> {
        if let Some(u) = &self.unified {
            let parent = u.parent().expect("cgroup has a parent");
            fs::create_dir_all(parent)?;
            if self.v2_limits {
                // Controllers must be enabled top-down for the leaf to have the files.
                let want = "+memory +pids +cpu";
                for dir in [parent.parent().expect("mount point"), parent] {
                    for c in want.split(' ') {
                        let _ = fs::write(dir.join("cgroup.subtree_control"), c);
                    }
                }
            }
            fs::create_dir(u)?;
            if self.v2_limits {
                write(&u.join("memory.max"), &limits.memory_bytes.to_string())?;
                if u.join("memory.swap.max").exists() {
                    write(&u.join("memory.swap.max"), "0")?;
                }
                write(&u.join("pids.max"), &limits.pids.to_string())?;
                write(&u.join("cpu.max"), &format!("{} {PERIOD_US}", limits.cpu_quota_us(PERIOD_US)))?;
            }
        }
        for (c, dir) in &self.v1 {
            fs::create_dir_all(dir)?;
            match c.as_str() {
                "memory" => {
                    write(&dir.join("memory.limit_in_bytes"), &limits.memory_bytes.to_string())?;
                    // memsw is memory+swap: equal to the memory limit means no swap at all.
                    let memsw = dir.join("memory.memsw.limit_in_bytes");
                    if memsw.exists() {
                        write(&memsw, &limits.memory_bytes.to_string())?;
                    }
                    let _ = fs::write(dir.join("memory.swappiness"), "0");
                    // v1 charges kernel TCP buffers to a group only once its TCP limit is set, and
                    // only for sockets made after that: so it is set here, before anything joins.
                    // Without it a sandbox's sockets hold host memory outside every cap. The
                    // counter is separate from the memory limit's on v1 (v2 counts sockets in
                    // memory.max itself), so it gets the same size.
                    let tcp = dir.join("memory.kmem.tcp.limit_in_bytes");
                    if tcp.exists() {
                        write(&tcp, &limits.memory_bytes.to_string())?;
                    } else {
                        tracing::warn!("{} is missing: this kernel cannot cap the sandbox's TCP buffers on cgroup v1", tcp.display());
                    }
                }
                "pids" => write(&dir.join("pids.max"), &limits.pids.to_string())?,
                "cpu" => {
                    write(&dir.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
                    write(&dir.join("cpu.cfs_quota_us"), &limits.cpu_quota_us(PERIOD_US).to_string())?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The limits the groups hold now, read back from their files (v2's unified group where it
    /// has the controllers, else each v1 controller's).
    pub fn limits(&self) -> CgroupLimits {
        let num = |p: PathBuf| -> Option<u64> { fs::read_to_string(p).ok().and_then(|v| v.trim().parse().ok()) };
        let mut l = CgroupLimits::default();
        if let Some(u) = self.unified.as_ref().filter(|_| self.v2_limits) {
            l.memory_bytes = num(u.join("memory.max"));
            l.swap_bytes = num(u.join("memory.swap.max"));
            l.pids = num(u.join("pids.max"));
            if let Ok(cpu) = fs::read_to_string(u.join("cpu.max")) {
                let mut f = cpu.split_whitespace();
                l.cpu_quota_us = f.next().and_then(|q| q.parse().ok());
                l.cpu_period_us = f.next().and_then(|p| p.parse().ok());
            }
        }
        for (c, dir) in &self.v1 {
            match c.as_str() {
                "memory" => {
                    l.memory_bytes = num(dir.join("memory.limit_in_bytes"));
                    // memsw is memory + swap: the swap allowed is the difference.
                    l.swap_bytes = num(dir.join("memory.memsw.limit_in_bytes")).zip(l.memory_bytes).map(|(sw, m)| sw.saturating_sub(m));
                    l.tcp_memory_bytes = num(dir.join("memory.kmem.tcp.limit_in_bytes"));
                }
                "pids" => l.pids = num(dir.join("pids.max")),
                "cpu" => {
                    l.cpu_quota_us = num(dir.join("cpu.cfs_quota_us"));
                    l.cpu_period_us = num(dir.join("cpu.cfs_period_us"));
                }
                _ => {}
            }
        }
        l
    }

    /// Rewrites the memory and CPU caps of groups already made (a pooled sandbox given the caps
    /// of the create that took it). The pids cap and the TCP buffer cap's size stay as made.
    pub fn set_limits(&self, limits: &Limits) -> io::Result<()> {
        if let Some(u) = self.unified.as_ref().filter(|_| self.v2_limits) {
            write(&u.join("memory.max"), &limits.memory_bytes.to_string())?;
            write(&u.join("cpu.max"), &format!("{} {PERIOD_US}", limits.cpu_quota_us(PERIOD_US)))?;
        }
        for (c, dir) in &self.v1 {
            match c.as_str() {
                "memory" => {
                    // v1 keeps memory <= memory+swap at every step: raise the pair from the top,
                    // lower it from the bottom.
                    let memsw = dir.join("memory.memsw.limit_in_bytes");
                    let mem = dir.join("memory.limit_in_bytes");
                    let value = limits.memory_bytes.to_string();
                    let now: u64 = fs::read_to_string(&mem).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0);
                    let order = if limits.memory_bytes > now { [&memsw, &mem] } else { [&mem, &memsw] };
                    for f in order {
                        if f.exists() {
                            write(f, &value)?;
                        }
                    }
                }
                "cpu" => write(&dir.join("cpu.cfs_quota_us"), &limits.cpu_quota_us(PERIOD_US).to_string())?,
                _ => {}
            }
        }
        Ok(())
    }

    /// The files a single-threaded process (a child between fork and exec) writes "0" to in
    /// order to join every group: the unified group's `cgroup.procs`, and each v1 group's
    /// `tasks`, which moves the calling thread without the threadgroup lock (and the RCU grace
    /// period its writer waits for) that a `cgroup.procs` write takes.
    pub fn join_files(&self) -> Vec<PathBuf> {
        self.unified.iter().map(|d| d.join("cgroup.procs")).chain(self.v1_tasks_files()).collect()
    }

    /// The unified (v2) group's directory, where the host has that hierarchy: a process can be
    /// born in it (clone3 with `CLONE_INTO_CGROUP`) rather than moved.
    pub fn unified_dir(&self) -> Option<&Path> {
        self.unified.as_deref()
    }

    /// The v1 groups' `tasks` files: a single-threaded process that writes "0" to one moves
    /// itself there without the threadgroup lock a `cgroup.procs` write waits for.
    pub fn v1_tasks_files(&self) -> Vec<PathBuf> {
        self.v1.iter().map(|(_, d)| d.join("tasks")).collect()
    }

    fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
        self.unified.iter().chain(self.v1.iter().map(|(_, d)| d))
    }

    /// The processes in the groups, cordon's own excluded: a v1 group lists the process of
    /// every thread in it, and a thread of cordon's may be in the sandbox's `cpu` group (see
    /// [`Cgroup::thread_charge`]); it must never be killed or waited for with the sandbox.
    fn pids(&self) -> Vec<libc::pid_t> {
        let own = std::process::id() as libc::pid_t;
        let mut out = Vec::new();
        for d in self.dirs() {
            if let Ok(s) = fs::read_to_string(d.join("cgroup.procs")) {
                out.extend(s.lines().filter_map(|l| l.trim().parse::<libc::pid_t>().ok()));
            }
        }
        out.retain(|&p| p != own);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// A pidfd of each process in the groups now (see [`crate::sys::reap_all`]).
    pub fn pidfds(&self) -> Vec<(libc::pid_t, std::os::fd::OwnedFd)> {
        self.pids().into_iter().filter_map(|p| crate::sys::pidfd_open(p).ok().map(|fd| (p, fd))).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.pids().is_empty()
    }

    /// Whether `pid` is in the groups now.
    pub fn holds(&self, pid: libc::pid_t) -> bool {
        self.pids().binary_search(&pid).is_ok()
    }

    /// Kills every process in the groups: `cgroup.kill` where the kernel has it, otherwise
    /// SIGKILL to each listed pid (repeated by [`Cgroup::kill_and_wait`] until none is left).
    pub fn kill(&self) {
        if let Some(u) = &self.unified {
            if fs::write(u.join("cgroup.kill"), "1").is_ok() {
                return;
            }
        }
        for pid in self.pids() {
            // SAFETY: kill with a pid read from the group's own member list.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }

    /// Kills and waits until the groups are empty or `deadline` passes.
    pub fn kill_and_wait(&self, deadline: Duration) -> bool {
        let start = Instant::now();
        loop {
            if self.is_empty() {
                return true;
            }
            self.kill();
            if start.elapsed() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// How many times the kernel's OOM killer fired inside the sandbox.
    pub fn oom_kills(&self) -> Option<u64> {
        if self.v2_limits {
            if let Some(u) = &self.unified {
                return read_key(&u.join("memory.events"), "oom_kill");
            }
        }
        self.v1_dir("memory").and_then(|d| read_key(&d.join("memory.oom_control"), "oom_kill"))
    }

    /// Peak memory use in bytes (page cache and tmpfs included, as the limit counts them).
    pub fn peak_memory(&self) -> Option<u64> {
        if self.v2_limits {
            if let Some(u) = &self.unified {
                return read_u64(&u.join("memory.peak"));
            }
        }
        self.v1_dir("memory").and_then(|d| read_u64(&d.join("memory.max_usage_in_bytes")))
    }

    /// Current memory use in bytes.
    pub fn memory_current(&self) -> Option<u64> {
        if self.v2_limits {
            if let Some(u) = &self.unified {
                return read_u64(&u.join("memory.current"));
            }
        }
        self.v1_dir("memory").and_then(|d| read_u64(&d.join("memory.usage_in_bytes")))
    }

    /// CPU time used by the sandbox so far, in microseconds. The unified hierarchy keeps
    /// `cpu.stat` even without the cpu controller (as on hybrid hosts); on v1-only hosts it
    /// is not known (`None`).
    pub fn cpu_usage_usec(&self) -> Option<u64> {
        self.unified.as_ref().and_then(|u| read_key(&u.join("cpu.stat"), "usage_usec"))
    }

    /// Where a host thread doing the sandbox's work (its egress forwarder) can be charged so
    /// that the sandbox's CPU quota covers that thread and the sandbox together: the v1 `cpu`
    /// group, which takes single threads of any process. `None` when the quota is v2's
    /// `cpu.max`: a v2 group holds whole processes, never one thread of another process.
    pub fn thread_charge(&self) -> Option<ThreadCharge> {
        if self.v2_limits {
            return None;
        }
        Some(ThreadCharge { group: self.v1_dir("cpu")?.clone() })
    }

    fn v1_dir(&self, c: &str) -> Option<&PathBuf> {
        self.v1.iter().find(|(n, _)| n == c).map(|(_, d)| d)
    }

    /// Stops (`true`) or restarts (`false`) every process of the groups where it is, and waits
    /// until the kernel says it is done: a frozen process runs no instruction and its memory
    /// stays resident, counted against the cap as before. Through the unified hierarchy's
    /// `cgroup.freeze` where there is one (a fatal signal still ends a frozen process there),
    /// else v1's freezer.
    pub fn freeze(&self, on: bool) -> io::Result<()> {
        let (file, value, done): (PathBuf, &str, Box<dyn Fn() -> bool>) = if let Some(u) = &self.unified {
            let events = u.join("cgroup.events");
            let want = if on { 1 } else { 0 };
            (u.join("cgroup.freeze"), if on { "1" } else { "0" }, Box::new(move || read_key(&events, "frozen") == Some(want)))
        } else if let Some(d) = self.v1_dir("freezer") {
            let state = d.join("freezer.state");
            let want = if on { "FROZEN" } else { "THAWED" };
            (state.clone(), want, Box::new(move || fs::read_to_string(&state).is_ok_and(|s| s.trim() == want)))
        } else {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "this host has neither a unified cgroup hierarchy nor a v1 freezer"));
        };
        write(&file, value)?;
        // A task in an uninterruptible sleep (a page fault on a slow disk) freezes once it
        // wakes; the wait covers that, not a task that never does.
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        while !done() {
            if start.elapsed() > Duration::from_secs(10) {
                return Err(io::Error::new(io::ErrorKind::TimedOut, format!("{} did not become {value} within 10 s", file.display())));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Whether the groups are frozen now (see [`Cgroup::freeze`]).
    pub fn is_frozen(&self) -> bool {
        if let Some(u) = &self.unified {
            return read_key(&u.join("cgroup.events"), "frozen") == Some(1);
        }
        self.v1_dir("freezer").is_some_and(|d| fs::read_to_string(d.join("freezer.state")).is_ok_and(|s| s.trim() == "FROZEN"))
    }

    /// Removes the (empty) groups. Missing groups are not an error: removal is idempotent.
    pub fn remove(&self) -> io::Result<()> {
        let mut first_err = None;
        for d in self.dirs() {
            let mut tries = 0;
            loop {
                match fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    // The last task may still be exiting; the kernel refuses rmdir until then.
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 5000 => {
                        tries += 1;
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    Err(e) => {
                        first_err.get_or_insert(io::Error::new(e.kind(), format!("rmdir {}: {e}", d.display())));
                        break;
                    }
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// A sandbox's v1 `cpu` group, as a place for one host thread (see [`Cgroup::thread_charge`]).
#[derive(Debug, Clone)]
pub struct ThreadCharge {
    group: PathBuf,
}

impl ThreadCharge {
    /// Moves the calling thread (only it: v1 `tasks` moves one thread) into the sandbox's
    /// group. It leaves the group by ending, which the sandbox's teardown waits for before it
    /// removes the group. "0" names the calling thread, which the kernel moves without the
    /// threadgroup lock a thread id written here takes (its writer waits for an RCU grace
    /// period: milliseconds on every networked start).
    pub fn join_current_thread(&self) -> io::Result<()> {
        write(&self.group.join("tasks"), "0")
    }
}

fn read_u64(p: &Path) -> Option<u64> {
    fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn read_key(p: &Path, key: &str) -> Option<u64> {
    let s = fs::read_to_string(p).ok()?;
    s.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_freezer_hierarchy_is_used_only_without_a_unified_one() {
        let root = std::env::temp_dir().join(format!("cordon-layout-{}", std::process::id()));
        for c in ["memory", "pids", "cpu", "freezer"] {
            fs::create_dir_all(root.join(c)).unwrap();
            fs::write(root.join(c).join("cgroup.procs"), "").unwrap();
        }
        let v1 = Layout::detect_at(&root);
        assert!(v1.v1.iter().any(|(c, _)| c == "freezer"), "{v1:?}");
        fs::create_dir_all(root.join("unified")).unwrap();
        fs::write(root.join("unified/cgroup.controllers"), "").unwrap();
        let hybrid = Layout::detect_at(&root);
        assert!(hybrid.unified.is_some() && !hybrid.v1.iter().any(|(c, _)| c == "freezer"), "{hybrid:?}");
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn plan_places_groups_under_cordon() {
        let layout = Layout {
            unified: Some("/sys/fs/cgroup/unified".into()),
            v2_controllers: vec![],
            v1: vec![("memory".into(), "/sys/fs/cgroup/memory".into())],
        };
        let cg = Cgroup::plan(&layout, "abc");
        assert_eq!(cg.unified.as_deref(), Some(Path::new("/sys/fs/cgroup/unified/cordon/abc")));
        assert!(!cg.v2_limits);
        assert_eq!(cg.v1[0].1, Path::new("/sys/fs/cgroup/memory/cordon/abc"));
        assert_eq!(cg.join_files().len(), 2);
    }

    #[test]
    fn missing_controllers_are_named() {
        let layout = Layout { unified: None, v2_controllers: vec!["memory".into()], v1: vec![] };
        assert_eq!(layout.missing(), vec!["pids", "cpu"]);
    }

    /// A directory tree standing in for the cgroup mounts: the files the kernel would offer are
    /// made beforehand, and what `create` writes into them is read back.
    fn fake_root(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cordon-cg-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn v1_caps_kernel_tcp_buffers_at_the_memory_limit_before_anyone_joins() {
        let root = fake_root("v1");
        let layout = Layout { unified: None, v2_controllers: vec![], v1: vec![("memory".into(), root.join("memory"))] };
        let cg = Cgroup::plan(&layout, "sb");
        let dir = &cg.v1[0].1;
        fs::create_dir_all(dir).unwrap();
        fs::write(dir.join("memory.kmem.tcp.limit_in_bytes"), "9223372036854771712").unwrap();
        let limits = Limits { memory_bytes: 64 << 20, ..Default::default() };
        cg.create(&limits).unwrap();
        let read = |f: &str| fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(read("memory.limit_in_bytes"), (64u64 << 20).to_string());
        assert_eq!(read("memory.kmem.tcp.limit_in_bytes"), (64u64 << 20).to_string());
        // Nothing has joined: create only writes limits (the jailer joins afterwards).
        assert!(!dir.join("cgroup.procs").exists());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn v2_needs_no_tcp_file_sockets_count_in_memory_max() {
        let root = fake_root("v2");
        let layout = Layout {
            unified: Some(root.clone()),
            v2_controllers: vec!["memory".into(), "pids".into(), "cpu".into()],
            v1: vec![],
        };
        let cg = Cgroup::plan(&layout, "sb");
        let limits = Limits { memory_bytes: 64 << 20, ..Default::default() };
        cg.create(&limits).unwrap();
        let u = cg.unified.as_ref().unwrap();
        assert_eq!(fs::read_to_string(u.join("memory.max")).unwrap(), (64u64 << 20).to_string());
        assert!(!u.join("memory.kmem.tcp.limit_in_bytes").exists());
        fs::remove_dir_all(&root).unwrap();
    }

    /// Marks `dir` as a cgroup mount: v2 when `controllers` is given, else v1.
    fn mount(dir: &Path, controllers: Option<&str>) {
        fs::create_dir_all(dir).unwrap();
        match controllers {
            Some(c) => fs::write(dir.join("cgroup.controllers"), c).unwrap(),
            None => fs::write(dir.join("cgroup.procs"), "").unwrap(),
        }
    }

    #[test]
    fn v2_layout_is_detected_with_its_controllers() {
        let root = fake_root("detect-v2");
        mount(&root, Some("cpuset cpu io memory hugetlb pids rdma"));
        let l = Layout::detect_at(&root);
        assert_eq!(l.unified.as_deref(), Some(root.as_path()));
        assert_eq!(l.v2_controllers, vec!["cpu", "memory", "pids"]);
        assert!(l.v1.is_empty() && l.missing().is_empty());
        assert!(l.describe().starts_with("v2 at "), "{}", l.describe());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn hybrid_layout_takes_limits_from_v1_and_kill_from_unified() {
        // This machine kind's shape: v1 controllers, a unified mount with no controllers.
        let root = fake_root("detect-hybrid");
        for c in ["memory", "pids", "cpu"] {
            mount(&root.join(c), None);
        }
        mount(&root.join("unified"), Some(""));
        let l = Layout::detect_at(&root);
        assert_eq!(l.unified.as_deref(), Some(root.join("unified").as_path()));
        assert!(l.v2_controllers.is_empty());
        let v1: Vec<&str> = l.v1.iter().map(|(c, _)| c.as_str()).collect();
        assert_eq!(v1, vec!["memory", "pids", "cpu"]);
        assert!(l.describe().starts_with("hybrid: v1 memory pids cpu + v2 at "), "{}", l.describe());
        let cg = Cgroup::plan(&l, "sb");
        assert!(!cg.v2_limits);
        assert_eq!(cg.join_files().len(), 4);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn v1_layout_without_pids_says_what_is_missing() {
        let root = fake_root("detect-v1");
        mount(&root.join("memory"), None);
        mount(&root.join("cpu"), None);
        let l = Layout::detect_at(&root);
        assert!(l.unified.is_none());
        assert_eq!(l.missing(), vec!["pids"]);
        assert_eq!(l.describe(), "v1 memory cpu");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn v1_limits_are_written_where_the_kernel_reads_them() {
        let root = fake_root("limits-v1");
        for c in ["memory", "pids", "cpu"] {
            mount(&root.join(c), None);
        }
        let l = Layout::detect_at(&root);
        let cg = Cgroup::plan(&l, "sb");
        let limits = Limits { memory_bytes: 96 << 20, pids: 77, cpus: 0.5, ..Default::default() };
        cg.create(&limits).unwrap();
        let read = |c: &str, f: &str| fs::read_to_string(root.join(c).join("cordon/sb").join(f)).unwrap();
        assert_eq!(read("memory", "memory.limit_in_bytes"), (96u64 << 20).to_string());
        assert_eq!(read("pids", "pids.max"), "77");
        assert_eq!(read("cpu", "cpu.cfs_period_us"), PERIOD_US.to_string());
        assert_eq!(read("cpu", "cpu.cfs_quota_us"), (PERIOD_US / 2).to_string());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn only_a_v1_cpu_group_takes_a_thread() {
        let v1 = Layout { unified: None, v2_controllers: vec![], v1: vec![("cpu".into(), "/c/cpu".into())] };
        let c = Cgroup::plan(&v1, "sb");
        let t = c.thread_charge().expect("v1 cpu takes threads");
        assert_eq!(t.group, Path::new("/c/cpu/cordon/sb"));
        let v2 = Layout { unified: Some("/c".into()), v2_controllers: vec!["cpu".into()], v1: vec![] };
        assert!(Cgroup::plan(&v2, "sb").thread_charge().is_none());
    }

    #[test]
    fn keyed_files_parse() {
        let dir = std::env::temp_dir().join(format!("cordon-cg-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let f = dir.join("memory.oom_control");
        fs::write(&f, "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n").unwrap();
        assert_eq!(read_key(&f, "oom_kill"), Some(3));
        assert_eq!(read_key(&f, "nope"), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
