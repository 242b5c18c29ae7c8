//! What the host's kernel says of one process of a sandbox, read from `/proc/PID` on the host:
//! its credentials and filters ([`Creds`]), its user namespace's maps, which namespaces it does
//! not share with the host, and its mounts. Measurements, never what cordon meant to set: the
//! isolation report (see `cordon_sandbox::report`) puts them next to the sandbox's own view.

use std::fs;
use std::io;

/// Credentials and filters of a process, as `/proc/PID/status` gives them (capability sets in
/// the kernel's hex form, e.g. `00000000a80425fb`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Creds {
    pub cap_bnd: String,
    pub cap_eff: String,
    pub cap_prm: String,
    pub cap_amb: String,
    pub no_new_privs: bool,
    /// `Seccomp:`: 0 none, 1 strict, 2 filter.
    pub seccomp_mode: u32,
    /// `Seccomp_filters:`: how many filters are attached.
    pub seccomp_filters: u32,
}

impl Creds {
    /// Parses the fields of a `/proc/PID/status` text.
    pub fn parse(status: &str) -> Option<Creds> {
        let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_string()));
        Some(Creds {
            cap_bnd: field("CapBnd:")?,
            cap_eff: field("CapEff:")?,
            cap_prm: field("CapPrm:")?,
            cap_amb: field("CapAmb:")?,
            no_new_privs: field("NoNewPrivs:")? == "1",
            seccomp_mode: field("Seccomp:")?.parse().ok()?,
            seccomp_filters: field("Seccomp_filters:").and_then(|v| v.parse().ok()).unwrap_or(0),
        })
    }

    pub fn read(pid: i32) -> io::Result<Creds> {
        let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
        Creds::parse(&status).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("/proc/{pid}/status lacks a credential field")))
    }
}

/// The capability set (kernel hex form) of exactly `caps` (numbers of linux/capability.h).
pub fn cap_set(caps: &[u32]) -> String {
    format!("{:016x}", caps.iter().fold(0u64, |m, c| m | (1u64 << c)))
}

/// One mount of the process's mount namespace (`/proc/PID/mountinfo`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mount {
    pub target: String,
    pub fstype: String,
    pub source: String,
    /// Per-mount options (`ro`, `nosuid`, `nodev`, `noexec`, `idmapped`, ...).
    pub options: String,
    /// Mapped through an idmapping (the kernel lists `idmapped` among the mount's options).
    pub idmapped: bool,
}

/// Parses a `mountinfo` text: `ID PARENT MAJ:MIN ROOT TARGET OPTIONS [TAGS...] - FSTYPE SOURCE SUPER`.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            let options = l.get(5)?.to_string();
            Some(Mount {
                target: unescape(l.get(4)?),
                fstype: r.first()?.to_string(),
                source: unescape(r.get(1).unwrap_or(&"")),
                idmapped: options.split(',').any(|o| o == "idmapped"),
                options,
            })
        })
        .collect()
}

/// mountinfo's octal escapes (`\040` for a space) back to bytes.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn mounts(pid: i32) -> io::Result<Vec<Mount>> {
    Ok(parse_mountinfo(&fs::read_to_string(format!("/proc/{pid}/mountinfo"))?))
}

/// The namespace kinds the kernel knows, as `/proc/PID/ns` names them.
const NAMESPACES: [&str; 8] = ["cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts"];

/// The namespaces `pid` is in that this process (the host's cordon) is not: the ones in force
/// around it. A kind the kernel lacks is left out.
pub fn namespaces(pid: i32) -> io::Result<Vec<String>> {
    let mut own = Vec::new();
    for ns in NAMESPACES {
        let theirs = match fs::read_link(format!("/proc/{pid}/ns/{ns}")) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if fs::read_link(format!("/proc/self/ns/{ns}")).ok().as_ref() != Some(&theirs) {
            own.push(ns.to_string());
        }
    }
    Ok(own)
}

/// `/proc/PID/uid_map` or `gid_map`, one `inside outside count` triple per line.
pub fn id_map(pid: i32, kind: &str) -> io::Result<Vec<[u64; 3]>> {
    let text = fs::read_to_string(format!("/proc/{pid}/{kind}"))?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let v: Vec<u64> = l.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            (v.len() == 3).then(|| [v[0], v[1], v[2]])
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_parse() {
        let s = "Name:\tx\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000001\nCapEff:\t0000000000000001\nCapBnd:\t00000000a80425fb\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t1\n";
        let c = Creds::parse(s).unwrap();
        assert_eq!((c.cap_bnd.as_str(), c.no_new_privs, c.seccomp_mode, c.seccomp_filters), ("00000000a80425fb", true, 2, 1));
        assert!(Creds::parse("Name:\tx\n").is_none());
    }

    #[test]
    fn cap_sets_are_the_kernel_s_hex() {
        assert_eq!(cap_set(&[0, 1, 3]), "000000000000000b");
        assert_eq!(cap_set(&[]), "0000000000000000");
    }

    #[test]
    fn mountinfo_lines_parse_with_escapes_and_idmapping() {
        let t = "36 35 0:30 / /home/user\\040x rw,nosuid,idmapped shared:1 - ext4 /dev/vda rw\n37 35 0:31 / /proc ro,nosuid,nodev - proc proc rw\n";
        let m = parse_mountinfo(t);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].target.as_str(), m[0].fstype.as_str(), m[0].idmapped), ("/home/user x", "ext4", true));
        assert_eq!((m[1].target.as_str(), m[1].options.as_str(), m[1].idmapped), ("/proc", "ro,nosuid,nodev", false));
    }

    #[test]
    fn this_process_shares_every_namespace_with_itself() {
        let me = std::process::id() as i32;
        assert_eq!(namespaces(me).unwrap(), Vec::<String>::new());
        assert!(!id_map(me, "uid_map").unwrap().is_empty());
    }
}
