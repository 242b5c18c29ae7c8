//! Compiles `seccomp/sandbox.json` into BPF at build time (as Firecracker does), so the policy
//! is checked when cordon is built and installing it costs no parsing at sandbox start.
//!
//! The program cordon installs comes from `build/bpf.rs` (a binary search over syscall numbers).
//! seccompiler compiles the same policy into the reference programs the tests compare it with.

#[path = "build/bpf.rs"]
mod bpf;

use bpf::{Cond, Handler, Op, Rule, Verdict};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::str::FromStr;

const POLICY: &str = "seccomp/sandbox.json";
const EPERM: u32 = 1;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_USER_NOTIF: u32 = 0x7fc0_0000;

/// Names and argument lists of a group list (`syscalls: [...]` sharing one `why`).
fn entries(groups: &Value) -> Vec<(&str, Option<&Value>)> {
    let mut out = Vec::new();
    for g in groups.as_array().expect("rule list") {
        let names: Vec<&str> = match (g.get("syscalls"), g.get("syscall")) {
            (Some(list), _) => list.as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect(),
            (None, Some(one)) => vec![one.as_str().unwrap()],
            _ => panic!("{POLICY}: a rule needs `syscall` or `syscalls`: {g}"),
        };
        out.extend(names.into_iter().map(|n| (n, g.get("args"))));
    }
    out
}

/// seccompiler's rule list for a group list.
fn seccompiler_rules(groups: &Value) -> Vec<Value> {
    entries(groups)
        .into_iter()
        .map(|(name, args)| match args {
            Some(args) => json!({ "syscall": name, "args": args }),
            None => json!({ "syscall": name }),
        })
        .collect()
}

fn syscall_nr(name: &str) -> u32 {
    let nr = syscalls::x86_64::Sysno::from_str(name).unwrap_or_else(|_| panic!("{POLICY}: no x86_64 syscall named {name}"));
    nr.id() as u32
}

fn cond(arg: &Value) -> Cond {
    let index = arg["index"].as_u64().filter(|i| *i < 6).unwrap_or_else(|| panic!("{POLICY}: argument index 0-5: {arg}"));
    let qword = match arg["type"].as_str() {
        Some("dword") => false,
        Some("qword") => true,
        _ => panic!("{POLICY}: argument type is dword or qword: {arg}"),
    };
    let op = match &arg["op"] {
        Value::String(s) if s == "eq" => Op::Eq,
        Value::String(s) if s == "ne" => Op::Ne,
        Value::Object(o) if o.contains_key("masked_eq") => Op::MaskedEq(o["masked_eq"].as_u64().expect("mask")),
        _ => panic!("{POLICY}: the filter compiler knows the ops eq, ne and masked_eq: {arg}"),
    };
    let val = arg["val"].as_u64().unwrap_or_else(|| panic!("{POLICY}: val: {arg}"));
    Cond { index: index as u8, qword, op, val }
}

/// Rules by syscall number, in the file's order.
fn rules_by_nr(groups: &Value) -> BTreeMap<u32, Vec<Rule>> {
    let mut out: BTreeMap<u32, Vec<Rule>> = BTreeMap::new();
    for (name, args) in entries(groups) {
        let rule = args.map(|a| a.as_array().expect("args list").iter().map(cond).collect()).unwrap_or_default();
        out.entry(syscall_nr(name)).or_default().push(rule);
    }
    out
}

/// Each syscall's handler. The reference installs the allowlist and then one filter per
/// override; the kernel lets an errno beat allow, and among errnos the latest filter win. So an
/// override that matches decides (the last one listed first), and otherwise the allowlist does.
fn handlers(policy: &Value, ptrace: bool) -> BTreeMap<u32, Handler> {
    let mut allow = rules_by_nr(&policy["allow"]);
    if ptrace {
        for (nr, rules) in rules_by_nr(&policy["allow_with_ptrace"]) {
            allow.entry(nr).or_default().extend(rules);
        }
    }
    let overrides: Vec<(BTreeMap<u32, Vec<Rule>>, u16)> = policy["errno_overrides"]
        .as_array()
        .expect("errno_overrides")
        .iter()
        .map(|o| (rules_by_nr(&o["rules"]), o["errno"].as_u64().and_then(|e| u16::try_from(e).ok()).expect("override errno")))
        .collect();
    let mut nrs: Vec<u32> = allow.keys().copied().collect();
    nrs.extend(overrides.iter().flat_map(|(r, _)| r.keys().copied()));
    nrs.into_iter()
        .map(|nr| {
            let mut clauses: Vec<(Vec<Rule>, Verdict)> = overrides
                .iter()
                .rev()
                .filter_map(|(rules, errno)| rules.get(&nr).map(|r| (r.clone(), Verdict::Errno(*errno))))
                .collect();
            if let Some(rules) = allow.get(&nr) {
                clauses.push((rules.clone(), Verdict::Allow));
            }
            (nr, Handler { clauses, otherwise: Verdict::Deny })
        })
        .collect()
}

fn emit(src: &mut String, name: &str, prog: &[bpf::Insn]) {
    writeln!(src, "pub static {name}: &[(u16, u8, u8, u32)] = &[").unwrap();
    for (code, jt, jf, k) in prog {
        writeln!(src, "    ({code}, {jt}, {jf}, {k}),").unwrap();
    }
    src.push_str("];\n");
}

/// seccompiler's programs for the same policy, for the tests: the allowlists and the override
/// filters that go on top of them, plus the argument values the policy compares against.
fn reference(policy: &Value) -> String {
    let allow = seccompiler_rules(&policy["allow"]);
    let mut allow_ptrace = allow.clone();
    allow_ptrace.extend(seccompiler_rules(&policy["allow_with_ptrace"]));
    let eperm = json!({ "errno": EPERM });
    let mut filters = json!({
        "sandbox": { "mismatch_action": eperm, "match_action": "allow", "filter": allow },
        "sandbox_ptrace": { "mismatch_action": eperm, "match_action": "allow", "filter": allow_ptrace },
    });
    let mut overrides = Vec::new();
    for o in policy["errno_overrides"].as_array().expect("errno_overrides") {
        let name = format!("override_{}", o["name"].as_str().expect("override name"));
        filters[&name] = json!({
            "mismatch_action": "allow",
            "match_action": { "errno": o["errno"].as_u64().expect("override errno") },
            "filter": seccompiler_rules(&o["rules"]),
        });
        overrides.push(name.to_uppercase());
    }
    let compiled: BTreeMap<String, _> =
        seccompiler::compile_from_json(filters.to_string().as_bytes(), seccompiler::TargetArch::x86_64)
            .unwrap_or_else(|e| panic!("{POLICY}: {e}"))
            .into_iter()
            .collect();
    let mut src = String::from("// Generated by build.rs from seccomp/sandbox.json with seccompiler. Do not edit.\n");
    for (name, prog) in compiled {
        let prog: Vec<bpf::Insn> = prog.iter().map(|f| (f.code, f.jt, f.jf, f.k)).collect();
        emit(&mut src, &name.to_uppercase(), &prog);
    }
    writeln!(src, "pub static OVERRIDES: &[&[(u16, u8, u8, u32)]] = &[{}];", overrides.join(", ")).unwrap();

    let mut with_args = std::collections::BTreeSet::new();
    let mut values = std::collections::BTreeSet::from([0u64, u64::MAX, u64::from(u32::MAX)]);
    let mut groups: Vec<&Value> = vec![&policy["allow"], &policy["allow_with_ptrace"]];
    groups.extend(policy["errno_overrides"].as_array().unwrap().iter().map(|o| &o["rules"]));
    for g in groups {
        for (nr, rules) in rules_by_nr(g) {
            for c in rules.iter().flatten() {
                with_args.insert(nr);
                values.insert(c.val);
                if let Op::MaskedEq(m) = c.op {
                    values.insert(m);
                    values.insert(c.val | !m);
                }
            }
        }
    }
    let more: Vec<u64> = values.iter().flat_map(|v| [v ^ 1, v ^ (1 << 40), v.wrapping_add(1)]).collect();
    values.extend(more);
    writeln!(src, "pub static ARG_SYSCALLS: &[u32] = &{:?};", with_args.into_iter().collect::<Vec<_>>()).unwrap();
    writeln!(src, "pub static ARG_VALUES: &[u64] = &{:?};", values.into_iter().collect::<Vec<_>>()).unwrap();
    src
}

fn main() {
    println!("cargo:rerun-if-changed={POLICY}");
    println!("cargo:rerun-if-changed=build/bpf.rs");
    let text = std::fs::read_to_string(POLICY).expect("read seccomp policy");
    let policy: Value = serde_json::from_str(&text).expect("seccomp policy is valid JSON");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());

    let mut src = String::from("// Generated by build.rs from seccomp/sandbox.json. Do not edit.\n");
    for (name, ptrace) in [("SANDBOX", false), ("SANDBOX_PTRACE", true)] {
        let h = handlers(&policy, ptrace);
        emit(&mut src, name, &bpf::compile(&h, SECCOMP_RET_ERRNO | EPERM));
        // Audited: what the allowlist denies goes to the supervisor on the host instead, which
        // records it and answers EPERM.
        emit(&mut src, &format!("{name}_AUDIT"), &bpf::compile(&h, SECCOMP_RET_USER_NOTIF));
    }
    std::fs::write(out.join("seccomp_filters.rs"), src).unwrap();
    std::fs::write(out.join("seccomp_reference.rs"), reference(&policy)).unwrap();
}
