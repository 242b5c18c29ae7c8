//! The isolation report of one sandbox (schema [`SCHEMA`], documented in the README): what
//! confines it, from the host's side. A tier gives what it knows of itself ([`TierFacts`],
//! through [`crate::Sandbox::tier_facts`]), measured on the host where it can be (a process's
//! `/proc` entries, the cgroup files) rather than taken from what cordon meant to set;
//! [`report`] adds what every sandbox has (its limits as the cgroups hold them, its network
//! policy, its use so far, the audit counters). A field a tier cannot know is `null`, and
//! `unknown` says why; nothing is guessed. [`compare`] checks a report against what the sandbox
//! sees from inside (`cordon probe`).

use std::collections::BTreeMap;

use cordon_host::proc_facts::{Creds, Mount};
use cordon_spec::NetworkPolicy;
use serde::Serialize;
use serde_json::{json, Value};

use crate::Sandbox;

/// The report's schema; a change of a field's meaning changes it.
pub const SCHEMA: &str = "cordon.isolation/v1";

/// The isolation tier's runtime.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Runtime {
    /// gVisor's `runsc --version`, QEMU's version; for ns the host kernel's release.
    pub version: Option<String>,
    /// How gVisor intercepts syscalls (`ptrace`, `systrap`, `kvm`).
    pub platform: Option<String>,
    /// How the VM's CPU runs (`kvm`, `tcg`).
    pub accelerator: Option<String>,
    /// The kernel the sandbox's processes call: the host's (ns), gVisor's, or the guest's.
    pub kernel: Option<String>,
}

/// The capabilities every command of the default user starts with, as the tier sets them.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UserCaps {
    pub user: String,
    pub cap_bnd: String,
    pub cap_eff: String,
    pub cap_prm: String,
    pub cap_amb: String,
}

impl UserCaps {
    /// The sets of `user`'s commands under the bounding set `bnd` (the kernel's hex form): root
    /// of the sandbox's user namespace holds the whole bounding set, any other user none, and
    /// no tier grants ambient capabilities.
    pub fn of(user: &str, bnd: String) -> UserCaps {
        let none = cordon_host::proc_facts::cap_set(&[]);
        let held = if user == "root" { bnd.clone() } else { none.clone() };
        UserCaps { user: user.to_string(), cap_eff: held.clone(), cap_prm: held, cap_amb: none, cap_bnd: bnd }
    }
}

/// The syscall filter in force.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Seccomp {
    /// sha256 of the program installed (the kernel's `struct sock_filter` array).
    pub sha256: String,
    /// The policy file it was compiled from, and its sha256.
    pub policy: String,
    pub policy_sha256: String,
    /// Which syscalls the host is notified of, for the audit trail.
    pub notified: String,
}

/// Landlock as the sandbox got it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Landlock {
    /// How much of the rule set the kernel enforced: `full`, `partial`, `none`.
    pub enforced: String,
    /// The kernel's Landlock ABI version (`None`: no Landlock).
    pub abi: Option<i64>,
    /// The rules applied, in words.
    pub rules: Vec<String>,
}

/// What a tier knows of one of its sandboxes. `unknown` names each field left `None` and why.
#[derive(Debug, Clone, Default)]
pub struct TierFacts {
    pub runtime: Runtime,
    /// Namespaces the sandbox's init is in that the host's cordon is not.
    pub namespaces: Option<Vec<String>>,
    pub uid_map: Option<Vec<[u64; 3]>>,
    pub gid_map: Option<Vec<[u64; 3]>>,
    /// The sandbox's PID 1, measured on the host.
    pub pid1: Option<Creds>,
    pub default_user: Option<UserCaps>,
    pub seccomp: Option<Seccomp>,
    pub landlock: Option<Landlock>,
    pub mounts: Option<Vec<Mount>>,
    /// `/proc` paths the sandbox sees synthesized or empty instead of the host's.
    pub masked_proc: Option<Vec<String>>,
    pub unknown: BTreeMap<&'static str, String>,
}

impl TierFacts {
    /// Facts of a tier that can tell none of the per-process fields, each with `why`.
    pub fn opaque(runtime: Runtime, why: &str) -> TierFacts {
        let mut f = TierFacts { runtime, ..Default::default() };
        for k in ["namespaces", "idMaps", "capabilities.pid1", "capabilities.defaultUser", "seccomp", "landlock", "mounts", "maskedProc"] {
            f.unknown.insert(k, why.to_string());
        }
        f
    }
}

/// Limits as the sandbox's cgroups hold them now.
pub use cordon_host::CgroupLimits;

/// The whole report of `sandbox` (`id`, of `tier`) under `network`.
pub fn report(id: &str, tier: cordon_spec::Tier, sandbox: &dyn Sandbox, network: &NetworkPolicy) -> Value {
    let f = sandbox.tier_facts();
    let mut unknown: BTreeMap<String, String> = f.unknown.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    let cgroup = sandbox.cgroup_limits();
    if cgroup.is_none() {
        unknown.insert("cgroup".into(), "this tier's sandbox is not a group of host processes under its own cgroup".into());
    }
    let denials = sandbox.denials();
    let blocked = sandbox.blocked();
    let injected = sandbox.injected();
    let disk = sandbox.disk_usage();
    json!({
        "schema": SCHEMA,
        "sandboxID": id,
        "tier": tier.as_str(),
        "runtime": f.runtime,
        "namespaces": f.namespaces,
        "idMaps": f.uid_map.as_ref().map(|u| json!({ "uid": u, "gid": f.gid_map })),
        "capabilities": {
            "pid1": f.pid1.as_ref().map(|c| json!({ "capBnd": c.cap_bnd, "capEff": c.cap_eff, "capPrm": c.cap_prm, "capAmb": c.cap_amb })),
            "defaultUser": f.default_user,
        },
        "noNewPrivs": f.pid1.as_ref().map(|c| c.no_new_privs),
        "seccomp": f.seccomp.as_ref().map(|s| {
            let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
            if let (Some(c), Some(o)) = (&f.pid1, v.as_object_mut()) {
                o.insert("mode".into(), json!(match c.seccomp_mode { 0 => "disabled", 1 => "strict", _ => "filter" }));
                o.insert("filters".into(), json!(c.seccomp_filters));
            }
            v
        }),
        "landlock": f.landlock,
        "cgroup": cgroup,
        "mounts": f.mounts,
        "maskedProc": f.masked_proc,
        "network": {
            "enabled": network.is_enabled(),
            "allowOut": network.allow.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "denyOut": network.deny.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "default": if network.resolve_unlisted { "open" } else { "closed" },
            // Injection rules are served by terminating TLS to their hosts with the egress CA.
            "tlsTerminatedHosts": network.transforms.rules().map(|(host, _)| host.to_string()).collect::<Vec<_>>(),
        },
        "usage": {
            "memoryBytes": sandbox.memory_current(),
            "peakMemoryBytes": sandbox.peak_memory(),
            "cpuUsec": sandbox.cpu_usage_usec(),
            "diskBytes": disk.map(|(used, _)| used),
            "diskTotalBytes": disk.map(|(_, total)| total),
        },
        "audit": {
            "deniedSyscalls": denials.iter().map(|d| d.count).sum::<u64>(),
            "blockedConnections": blocked.iter().map(|b| b.count).sum::<u64>(),
            "injectedHeaders": injected.iter().map(|i| i.count).sum::<u64>(),
        },
        "unknown": unknown,
    })
}

/// One difference between the host's report and what the sandbox sees from inside.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Difference {
    pub field: String,
    pub host: Value,
    pub inside: Value,
}

/// Compares a report with a probe's view from inside (`cordon probe`, run as the default
/// user): every field both sides know must agree. Returns the fields compared and the
/// differences.
pub fn compare(report: &Value, probe: &Value) -> (Vec<String>, Vec<Difference>) {
    let mut checked = Vec::new();
    let mut diffs = Vec::new();
    let mut check = |field: &str, host: Value, inside: Value| {
        // An empty answer inside is a field that kernel does not print (gVisor has no CapAmb).
        if host.is_null() || inside.is_null() || inside.as_str() == Some("") {
            return;
        }
        checked.push(field.to_string());
        if host != inside {
            diffs.push(Difference { field: field.to_string(), host, inside });
        }
    };
    // The user namespace's maps, as the kernel prints them.
    let map_text = |m: &Value| -> Value {
        m.as_array().map_or(Value::Null, |rows| {
            json!(rows.iter().map(|r| r.as_array().map(|t| t.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ")).unwrap_or_default()).collect::<Vec<_>>().join("\n"))
        })
    };
    let squash = |v: &Value| -> Value { v.as_str().map_or(Value::Null, |s| json!(s.split_whitespace().collect::<Vec<_>>().join(" "))) };
    check("idMaps.uid", map_text(&report["idMaps"]["uid"]), squash(&probe["uid_map"]));
    check("idMaps.gid", map_text(&report["idMaps"]["gid"]), squash(&probe["gid_map"]));
    let user = &report["capabilities"]["defaultUser"];
    for (field, key) in [("capBnd", "cap_bnd"), ("capEff", "cap_eff"), ("capPrm", "cap_prm"), ("capAmb", "cap_amb")] {
        check(&format!("capabilities.defaultUser.{field}"), user[field].clone(), probe[key].clone());
    }
    // No-new-privs and the filter are inherited from PID 1 by every process.
    check("noNewPrivs", report["noNewPrivs"].clone(), probe["no_new_privs"].as_str().map_or(Value::Null, |v| json!(v == "1")));
    let mode = probe["seccomp"].as_str().map_or(Value::Null, |m| json!(match m { "0" => "disabled", "1" => "strict", _ => "filter" }));
    check("seccomp.mode", report["seccomp"]["mode"].clone(), mode);
    check("sandboxID (hostname)", report["sandboxID"].clone(), probe["hostname"].clone());
    // The kernel's Landlock ABI, where the sandbox may ask it (a negative answer: it may not).
    let abi = probe["landlock_abi"].as_i64().filter(|v| *v > 0).map_or(Value::Null, |v| json!(v));
    check("landlock.abi", report["landlock"]["abi"].clone(), abi);
    // A sandbox without network has only loopback; one with a policy has its interface.
    let ifaces = probe["interfaces"].as_array().map(|l| l.iter().filter(|i| i.as_str() != Some("lo")).count());
    check("network.enabled (interfaces besides lo)", report["network"]["enabled"].clone(), ifaces.map_or(Value::Null, |n| json!(n > 0)));
    // Every mount point the host lists is one the sandbox sees, with the same filesystem type.
    if let (Some(host), Some(inside)) = (report["mounts"].as_array(), probe["mounts"].as_array()) {
        let seen: Vec<(String, String)> = inside
            .iter()
            .filter_map(|m| m.as_str())
            .filter_map(|m| {
                let f: Vec<&str> = m.split(' ').collect();
                Some((f.first()?.to_string(), f.get(1)?.to_string()))
            })
            .collect();
        let want: Vec<(String, String)> = host.iter().map(|m| (m["target"].as_str().unwrap_or("").to_string(), m["fstype"].as_str().unwrap_or("").to_string())).collect();
        let to_json = |l: &[(String, String)]| json!(l.iter().map(|(t, f)| format!("{t} {f}")).collect::<Vec<_>>());
        check("mounts (target and type)", to_json(&want), to_json(&seen));
    }
    (checked, diffs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> Value {
        json!({
            "sandboxID": "isbx",
            "idMaps": {"uid": [[0, 100000, 65536]], "gid": [[0, 100000, 65536]]},
            "capabilities": {"defaultUser": {"capBnd": "00000000a80425fb", "capEff": "0000000000000000", "capPrm": "0000000000000000", "capAmb": "0000000000000000"}},
            "noNewPrivs": false,
            "seccomp": {"mode": "filter"},
            "network": {"enabled": false},
            "mounts": [{"target": "/", "fstype": "overlay"}, {"target": "/proc", "fstype": "proc"}],
        })
    }

    fn inside() -> Value {
        json!({
            "uid_map": "         0     100000      65536", "gid_map": "0 100000 65536",
            "cap_bnd": "00000000a80425fb", "cap_eff": "0000000000000000", "cap_prm": "0000000000000000", "cap_amb": "0000000000000000",
            "no_new_privs": "0", "seccomp": "2", "hostname": "isbx", "interfaces": ["lo"],
            "mounts": ["/ overlay rw", "/proc proc rw"],
        })
    }

    #[test]
    fn a_probe_that_sees_what_the_host_reports_agrees() {
        let (checked, diffs) = compare(&host(), &inside());
        assert!(diffs.is_empty(), "{diffs:?}");
        assert!(checked.len() >= 10, "{checked:?}");
    }

    #[test]
    fn each_disagreement_is_named() {
        let mut p = inside();
        p["cap_bnd"] = json!("000001ffffffffff");
        p["interfaces"] = json!(["lo", "eth0"]);
        p["mounts"] = json!(["/ overlay rw", "/proc proc rw", "/host ext4 rw"]);
        let (_, diffs) = compare(&host(), &p);
        let fields: Vec<&str> = diffs.iter().map(|d| d.field.as_str()).collect();
        assert_eq!(fields, ["capabilities.defaultUser.capBnd", "network.enabled (interfaces besides lo)", "mounts (target and type)"]);
    }

    #[test]
    fn a_field_one_side_cannot_know_is_not_compared() {
        let mut h = host();
        h["idMaps"] = Value::Null;
        let mut p = inside();
        p["cap_amb"] = json!("");
        let (checked, diffs) = compare(&h, &p);
        assert!(diffs.is_empty());
        assert!(!checked.iter().any(|c| c.starts_with("idMaps") || c.ends_with("capAmb")));
    }
}
