//! The OCI bundle runsc runs: `config.json` written with the `oci-spec` crate from the sandbox's
//! plan. The root is the overlay cordon mounted; the agent is the container's init.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxNamespaceBuilder, LinuxNamespaceType, MountBuilder,
    PosixRlimitBuilder, PosixRlimitType, ProcessBuilder, RootBuilder, Spec, SpecBuilder, UserBuilder,
};

/// Where the agent binary appears inside the sandbox. Its file name is what makes the cordon
/// binary run as the agent.
pub const AGENT_PATH: &str = "/.cordon/cordon-agent";

/// What goes into one bundle.
pub struct Bundle<'a> {
    pub id: &'a str,
    /// The mounted overlay root (host path).
    pub rootfs: &'a Path,
    /// The cordon binary on the host, bind-mounted read-only as the agent.
    pub agent: &'a Path,
    /// Environment of the agent (its link and its configuration).
    pub agent_env: &'a [(String, String)],
    /// The writable layer's tmpfs on the host (capped at `--disk`), whose `tmp` and `shm`
    /// subdirectories are bound at /tmp and /dev/shm: one budget for the root, /tmp and /dev/shm.
    pub disk: &'a Path,
    pub nofile: u64,
    /// Most tasks per user inside the sandbox: gVisor enforces RLIMIT_NPROC in its own kernel,
    /// where the host's pids cgroup sees only gVisor's own threads.
    pub nproc: u64,
    /// With an egress policy: the host file bound read-only over /etc/resolv.conf (the gateway,
    /// where the forwarder answers DNS). The sandbox then shares the network namespace cordon
    /// made (see `netns`) instead of getting a new one.
    pub resolv_conf: Option<&'a Path>,
    /// Volumes, bound at their paths. The sandbox sees their files with the owners on disk,
    /// as it sees the image's: gVisor's kernel, not a user namespace, stands between them.
    pub volumes: &'a [cordon_spec::VolumeMount],
    /// Host files bound read-only over the image's CA bundle and at the egress CA's place
    /// (`cordon_host::trust::BUNDLE`, `CA_FILE`).
    pub trust: Option<(&'a Path, &'a Path)>,
}

/// What the agent needs to start commands as other users, and nothing for the host: gVisor
/// implements these capabilities inside its own kernel. Each with its number (linux/capability.h).
const CAPS: [(Capability, u32); 9] = [
    (Capability::Chown, 0),
    (Capability::DacOverride, 1),
    (Capability::Fowner, 3),
    (Capability::Fsetid, 4),
    (Capability::Kill, 5),
    (Capability::Setgid, 6),
    (Capability::Setuid, 7),
    (Capability::Setpcap, 8),
    (Capability::NetBindService, 10),
];

fn err(e: impl std::fmt::Display) -> crate::GvisorError {
    crate::GvisorError::Setup(format!("OCI bundle: {e}"))
}

fn mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Result<oci_spec::runtime::Mount, crate::GvisorError> {
    MountBuilder::default()
        .destination(PathBuf::from(dest))
        .typ(typ)
        .source(PathBuf::from(source))
        .options(options.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .build()
        .map_err(err)
}

/// The bounding set of every process of the sandbox (the kernel's hex form), for the isolation
/// report.
pub fn bounding() -> String {
    cordon_host::proc_facts::cap_set(&CAPS.map(|(_, n)| n))
}

impl Bundle<'_> {
    pub fn spec(&self) -> Result<Spec, crate::GvisorError> {
        let caps: HashSet<Capability> = CAPS.into_iter().map(|(c, _)| c).collect();
        let capabilities = LinuxCapabilitiesBuilder::default()
            .bounding(caps.clone())
            .effective(caps.clone())
            .permitted(caps.clone())
            .inheritable(HashSet::new())
            .ambient(HashSet::new())
            .build()
            .map_err(err)?;
        let env = self.agent_env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>();
        let process = ProcessBuilder::default()
            .terminal(false)
            .user(UserBuilder::default().uid(0u32).gid(0u32).build().map_err(err)?)
            .args(vec![AGENT_PATH.to_string()])
            .env(env)
            .cwd(PathBuf::from("/"))
            .capabilities(capabilities)
            // runsc sets no_new_privs on every sandbox process whatever the bundle says, so unlike
            // the ns tier, setuid programs (sudo) cannot raise privileges here; say so.
            .no_new_privileges(true)
            .rlimits(vec![
                PosixRlimitBuilder::default()
                    .typ(PosixRlimitType::RlimitNofile)
                    .hard(self.nofile)
                    .soft(self.nofile)
                    .build()
                    .map_err(err)?,
                PosixRlimitBuilder::default()
                    .typ(PosixRlimitType::RlimitNproc)
                    .hard(self.nproc)
                    .soft(self.nproc)
                    .build()
                    .map_err(err)?,
            ])
            .build()
            .map_err(err)?;
        let disk = self.disk.to_str().ok_or_else(|| err("the state directory's path is not UTF-8"))?;
        let (tmp, shm) = (format!("{disk}/{}", crate::launch::SHARED_TMP), format!("{disk}/{}", crate::launch::SHARED_SHM));
        let agent = self.agent.to_str().ok_or_else(|| err("the cordon binary's path is not UTF-8"))?;
        let mut mounts = vec![
            mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
            mount("/dev", "tmpfs", "tmpfs", &["nosuid", "mode=755"])?,
            mount("/dev/pts", "devpts", "devpts", &["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"])?,
            mount("/dev/shm", "bind", &shm, &["bind", "nosuid", "noexec", "nodev"])?,
            // runsc mounts its own sysfs where the bundle names none: an empty read-only /sys
            // instead, as in the ns tier.
            mount("/sys", "tmpfs", "cordon-sys", &["ro", "nosuid", "nodev", "noexec", "mode=555"])?,
            mount("/tmp", "bind", &tmp, &["bind", "nosuid", "nodev"])?,
            mount(AGENT_PATH, "bind", agent, &["bind", "ro", "nosuid", "nodev"])?,
        ];
        let mut namespaces = vec![LinuxNamespaceType::Pid, LinuxNamespaceType::Ipc, LinuxNamespaceType::Uts, LinuxNamespaceType::Mount];
        match self.resolv_conf {
            Some(path) => {
                let path = path.to_str().ok_or_else(|| err("the state directory's path is not UTF-8"))?;
                mounts.push(mount("/etc/resolv.conf", "bind", path, &["bind", "ro", "nosuid", "nodev", "noexec"])?);
            }
            None => namespaces.push(LinuxNamespaceType::Network),
        }
        if let Some((bundle, ca)) = self.trust {
            for (dest, src) in [(cordon_host::trust::BUNDLE, bundle), (cordon_host::trust::CA_FILE, ca)] {
                let src = src.to_str().ok_or_else(|| err("the state directory's path is not UTF-8"))?;
                mounts.push(mount(dest, "bind", src, &["bind", "ro", "nosuid", "nodev", "noexec"])?);
            }
        }
        // After the sandbox's own mounts, so that none can hide them. gVisor resolves each
        // destination inside its own root: a symlink in the image leads nowhere on the host.
        for v in self.volumes {
            let source = v.source.to_str().ok_or_else(|| err("the state directory's path is not UTF-8"))?;
            mounts.push(mount(&v.target, "bind", source, &["bind", "nosuid", "nodev", if v.read_only { "ro" } else { "rw" }])?);
        }
        let namespaces = namespaces
        .into_iter()
        .map(|t| LinuxNamespaceBuilder::default().typ(t).build().map_err(err))
        .collect::<Result<Vec<_>, _>>()?;
        SpecBuilder::default()
            .version("1.0.2")
            .root(RootBuilder::default().path(self.rootfs.to_path_buf()).readonly(false).build().map_err(err)?)
            .process(process)
            .hostname(self.id.to_string())
            .mounts(mounts)
            .linux(LinuxBuilder::default().namespaces(namespaces).build().map_err(err)?)
            .build()
            .map_err(err)
    }

    /// Writes `config.json` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), crate::GvisorError> {
        self.spec()?.save(dir.join("config.json")).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundle_says_what_the_sandbox_is() {
        let env = vec![("CORDON_AGENT_LINK".to_string(), "stdio".to_string())];
        let b = Bundle {
            id: "isbx",
            rootfs: Path::new("/state/gvisor/isbx/rootfs"),
            agent: Path::new("/usr/local/bin/cordon"),
            agent_env: &env,
            disk: Path::new("/state/gvisor/isbx/disk"),
            nofile: 4096,
            nproc: 64,
            resolv_conf: None,
            volumes: &[],
            trust: None,
        };
        let v = serde_json::to_value(b.spec().unwrap()).unwrap();
        assert_eq!(v["hostname"], "isbx");
        assert_eq!(v["root"]["path"], "/state/gvisor/isbx/rootfs");
        assert_eq!(v["process"]["args"][0], AGENT_PATH);
        assert_eq!(v["process"]["env"][0], "CORDON_AGENT_LINK=stdio");
        assert_eq!(v["process"]["noNewPrivileges"], true);
        assert_eq!(v["process"]["rlimits"][0]["hard"], 4096);
        assert_eq!(v["process"]["rlimits"][1]["type"], "RLIMIT_NPROC");
        let mounts = v["mounts"].as_array().unwrap();
        let agent = mounts.iter().find(|m| m["destination"] == AGENT_PATH).unwrap();
        assert!(agent["options"].as_array().unwrap().contains(&"ro".into()));
        let tmp = mounts.iter().find(|m| m["destination"] == "/tmp").unwrap();
        assert_eq!(tmp["source"], "/state/gvisor/isbx/disk/tmp", "/tmp shares the writable layer's budget");
        let shm = mounts.iter().find(|m| m["destination"] == "/dev/shm").unwrap();
        assert_eq!(shm["source"], "/state/gvisor/isbx/disk/shm");
        let caps = v["process"]["capabilities"]["bounding"].as_array().unwrap();
        assert!(!caps.contains(&"CAP_SYS_ADMIN".into()));
        let nss = v["linux"]["namespaces"].as_array().unwrap();
        assert!(nss.iter().any(|n| n["type"] == "network"), "no policy: a network namespace of its own");
    }

    #[test]
    fn with_a_policy_the_resolver_is_the_gateway_and_the_namespace_cordons() {
        let resolv = Path::new("/state/gvisor/isbx/resolv.conf");
        let b = Bundle {
            id: "isbx",
            rootfs: Path::new("/state/gvisor/isbx/rootfs"),
            agent: Path::new("/usr/local/bin/cordon"),
            agent_env: &[],
            disk: Path::new("/state/gvisor/isbx/disk"),
            nofile: 4096,
            nproc: 64,
            resolv_conf: Some(resolv),
            volumes: &[],
            trust: Some((Path::new("/state/gvisor/isbx/trust-bundle.crt"), Path::new("/state/gvisor/isbx/egress-ca.crt"))),
        };
        let v = serde_json::to_value(b.spec().unwrap()).unwrap();
        let mounts = v["mounts"].as_array().unwrap();
        let r = mounts.iter().find(|m| m["destination"] == "/etc/resolv.conf").unwrap();
        assert_eq!(r["source"], "/state/gvisor/isbx/resolv.conf");
        let t = mounts.iter().find(|m| m["destination"] == cordon_host::trust::BUNDLE).unwrap();
        assert_eq!(t["source"], "/state/gvisor/isbx/trust-bundle.crt");
        assert!(t["options"].as_array().unwrap().iter().any(|o| o == "ro"));
        assert!(r["options"].as_array().unwrap().contains(&"ro".into()));
        let nss = v["linux"]["namespaces"].as_array().unwrap();
        assert!(!nss.iter().any(|n| n["type"] == "network"));
    }
}
