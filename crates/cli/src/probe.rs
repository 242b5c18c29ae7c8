//! `cordon probe`: what a sandbox looks like from within, as one JSON object (in the spirit of
//! youki's `runtimetest`): the user namespace's maps, this process's capability sets,
//! no_new_privs and seccomp mode, the Landlock ABI, the hostname, mounts, network interfaces and
//! visible processes. Run inside any sandbox (it reads only `/proc`); `cordon inspect --verify`
//! compares its answer with the host's isolation report. Also built alone as `cordon-probe`, a
//! small static program the tests copy in.

use std::fs;

fn read(p: &str) -> String {
    fs::read_to_string(p).unwrap_or_default()
}

fn status_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
        .unwrap_or_default()
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_list(items: &[String]) -> String {
    format!("[{}]", items.iter().map(|s| json_str(s)).collect::<Vec<_>>().join(","))
}

fn landlock_abi() -> i64 {
    // SAFETY: with a NULL attr, size 0 and LANDLOCK_CREATE_RULESET_VERSION this only reports
    // the ABI version (or an error when Landlock is absent or filtered).
    unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32) }
}

/// The sandbox as this process sees it, as one JSON object.
pub fn report() -> String {
    let status = read("/proc/self/status");
    let mounts: Vec<String> = read("/proc/self/mounts")
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            format!("{} {} {}", f.get(1).unwrap_or(&""), f.get(2).unwrap_or(&""), f.get(3).unwrap_or(&""))
        })
        .collect();
    let ifaces: Vec<String> = read("/proc/net/dev")
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next().map(|n| n.trim().to_string()))
        .collect();
    let mut pids: Vec<u32> = fs::read_dir("/proc")
        .map(|d| d.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    pids.sort_unstable();
    let pids: Vec<String> = pids.iter().map(|p| format!("{p}:{}", read(&format!("/proc/{p}/comm")).trim())).collect();
    let hostname = read("/proc/sys/kernel/hostname");
    let fields = [
        ("uid_map", json_str(read("/proc/self/uid_map").trim())),
        ("gid_map", json_str(read("/proc/self/gid_map").trim())),
        ("uid", json_str(&status_field(&status, "Uid:"))),
        ("cap_eff", json_str(&status_field(&status, "CapEff:"))),
        ("cap_prm", json_str(&status_field(&status, "CapPrm:"))),
        ("cap_bnd", json_str(&status_field(&status, "CapBnd:"))),
        ("cap_amb", json_str(&status_field(&status, "CapAmb:"))),
        ("seccomp", json_str(&status_field(&status, "Seccomp:"))),
        ("seccomp_filters", json_str(&status_field(&status, "Seccomp_filters:"))),
        ("no_new_privs", json_str(&status_field(&status, "NoNewPrivs:"))),
        ("landlock_abi", landlock_abi().to_string()),
        ("hostname", json_str(hostname.trim())),
        ("mounts", json_list(&mounts)),
        ("interfaces", json_list(&ifaces)),
        ("pids", json_list(&pids)),
    ];
    let body: Vec<String> = fields.iter().map(|(k, v)| format!("{}:{v}", json_str(k))).collect();
    format!("{{{}}}", body.join(","))
}
