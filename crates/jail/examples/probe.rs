//! Development probe: builds one sandbox over a given rootfs with a stand-in agent that runs a
//! shell script on the first connection and streams its output back.
//! `cargo run -p cordon-jail --example probe -- ROOTFS 'SCRIPT'` (as root).

use cordon_sandbox::host_sandbox::HostSandbox;
use std::io::Read;
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};

fn main() {
    let mut args = std::env::args();
    let argv0 = args.next().unwrap_or_default();
    if argv0.ends_with("cordon-agent") {
        stand_in_agent();
    }
    let first = args.next();
    if first.as_deref() == Some("__jail") {
        cordon_jail::jailer::main();
    }
    let rootfs = first.expect("ROOTFS");
    let script = args.next().unwrap_or_else(|| "id; hostname; ls /".into());
    cordon_jail::become_subreaper();
    let jail = cordon_jail::Jail::open(std::path::Path::new("/tmp/cordon-probe"), "/proc/self/exe".into()).unwrap();
    let t = std::time::Instant::now();
    let sb = jail
        .create(&cordon_jail::SandboxConfig {
            id: cordon_sandbox::new_id(),
            layers: vec![rootfs.into()],
            limits: Default::default(),
            agent_config: script.into_bytes(),
            allow_ptrace: false,
            audit: false,
            tun: false,
            connect_ports: None,
            writable: None,
            keep_writable: false,
            volumes: Vec::new(),
            egress_ca: None,
            default_user: String::new(),
            keep: false,
        })
        .unwrap();
    eprintln!("created in {:?}, pid {}, uid base {}", t.elapsed(), sb.host_pid(), sb.uid_base());
    let mut s = UnixStream::connect(sb.socket_path()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    print!("{out}");
    eprintln!("total {:?}", t.elapsed());
}

fn stand_in_agent() -> ! {
    // SAFETY: fd 3 is the listening socket the jailer passes to the agent.
    let l = unsafe { UnixListener::from_raw_fd(3) };
    let (conn, _) = l.accept().unwrap();
    let mut script = String::new();
    // SAFETY: the jailer hands the config (here: the script) over on this descriptor.
    let mut config = unsafe { std::fs::File::from_raw_fd(cordon_jail::jailer::CONFIG_FD) };
    config.read_to_string(&mut script).unwrap();
    let err = std::os::unix::process::CommandExt::exec(
        std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(script)
            .stdout(std::os::fd::OwnedFd::from(conn.try_clone().unwrap()))
            .stderr(std::os::fd::OwnedFd::from(conn)),
    );
    panic!("{err}");
}
