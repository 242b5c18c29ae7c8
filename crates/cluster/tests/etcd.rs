//! The cluster's store calls and membership against a real etcd (Debian's etcd-server), started
//! here on loopback ports of its own. Skips, saying why, where etcd is not installed.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cordon_cluster::etcd::Etcd;
use cordon_cluster::membership::Load;
use cordon_cluster::{Cluster, ClusterConfig, ClusterError};

struct EtcdProcess {
    child: Child,
    url: String,
    _dir: TempDir,
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A fresh etcd, or `None` (with the reason printed) where there is none to run.
fn etcd() -> Option<EtcdProcess> {
    if Command::new("etcd").arg("--version").stdout(Stdio::null()).status().is_err() {
        eprintln!("skipped: etcd is not installed (scripts/install-deps installs etcd-server)");
        return None;
    }
    let mut raw = [0u8; 8];
    getrandom::fill(&mut raw).unwrap();
    let dir = std::env::temp_dir().join(format!("cordon-etcd-{}", u64::from_le_bytes(raw)));
    let (client, peer) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let child = Command::new("etcd")
        .args(["--name", "t", "--data-dir"])
        .arg(&dir)
        .args(["--listen-client-urls", &url, "--advertise-client-urls", &url, "--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url, "--initial-cluster", &format!("t={peer_url}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Some(EtcdProcess { child, url, _dir: TempDir(dir) })
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

async fn ready(e: &Etcd) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while e.prefix("/").await.is_err() {
        assert!(Instant::now() < deadline, "etcd did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn keys_leases_and_their_expiry() {
    let Some(p) = etcd() else { return };
    rt().block_on(async {
        let e = Etcd::new(std::slice::from_ref(&p.url)).unwrap();
        ready(&e).await;
        e.put("/t/a", b"1", None).await.unwrap();
        e.put("/t/b", b"", None).await.unwrap();
        e.put("/u/c", b"3", None).await.unwrap();
        let got = e.prefix("/t/").await.unwrap();
        assert_eq!(got, vec![("/t/a".to_string(), b"1".to_vec()), ("/t/b".to_string(), Vec::new())]);
        e.delete("/t/a").await.unwrap();
        assert_eq!(e.prefix("/t/").await.unwrap().len(), 1);

        // A key on a lease goes when the lease does: revoked, or run out.
        let lease = e.grant(2).await.unwrap();
        e.put("/l/x", b"x", Some(lease)).await.unwrap();
        assert!(e.keep_alive(lease).await.unwrap());
        e.revoke(lease).await.unwrap();
        assert!(e.prefix("/l/").await.unwrap().is_empty());
        assert!(!e.keep_alive(lease).await.unwrap());

        let lease = e.grant(2).await.unwrap();
        e.put("/l/y", b"y", Some(lease)).await.unwrap();
        let put_at = Instant::now();
        while !e.prefix("/l/").await.unwrap().is_empty() {
            assert!(put_at.elapsed() < Duration::from_secs(10), "the lease never ran out");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(put_at.elapsed() >= Duration::from_secs(1), "the key went before its lease ran out");

        // A dead endpoint is skipped for the next one; none at all is a clear error.
        let two = Etcd::new(&[format!("http://127.0.0.1:{}", free_port()), p.url.clone()]).unwrap();
        assert_eq!(two.prefix("/u/").await.unwrap().len(), 1);
        let none = Etcd::new(&[format!("http://127.0.0.1:{}", free_port())]).unwrap();
        assert!(matches!(none.prefix("/").await, Err(ClusterError::Unreachable { .. })));
    });
}

#[test]
fn members_see_each_other_drains_and_a_dead_member_drops_out() {
    let Some(p) = etcd() else { return };
    rt().block_on(async {
        ready(&Etcd::new(std::slice::from_ref(&p.url)).unwrap()).await;
        let config = |name: &str, port: u16| ClusterConfig::parse(&format!("etcd={}", p.url), name, &format!("http://127.0.0.1:{port}"), Duration::from_secs(2)).unwrap();
        let load = |n: usize| move || Load { sandboxes: n, max_sandboxes: 10, tiers: vec!["ns".into()], templates: vec!["base".into()], pools: vec![] };
        let a = Cluster::join(config("a", 1001), load(1)).await.unwrap();
        let b = Cluster::join(config("b", 1002), load(2)).await.unwrap();
        // b read both at its join; a sees b within a refresh.
        assert_eq!(b.nodes().iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        let deadline = Instant::now() + Duration::from_secs(5);
        while a.node("b").is_none() {
            assert!(Instant::now() < deadline, "a never saw b");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let nb = a.node("b").unwrap();
        assert_eq!((nb.url.as_str(), nb.sandboxes, nb.max_sandboxes), ("http://127.0.0.1:1002", 2, 10));

        // The name is b's while b lives, whoever asks from another address.
        assert!(matches!(Cluster::preflight(&config("b", 1003)).await, Err(ClusterError::NameTaken { .. })));
        assert!(Cluster::preflight(&config("b", 1002)).await.is_ok(), "the same node restarting takes its name back");

        a.set_drain("b", true).await.unwrap();
        assert!(a.node("b").unwrap().draining);
        let want = cordon_cluster::placement::Want { template: "base", tier: None, memory: 1 };
        assert_eq!(a.placement(&want).iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["a"]);
        a.set_drain("b", false).await.unwrap();
        assert_eq!(a.placement(&want).len(), 2);

        // b stops beating (dropped, as a crash would): it leaves the view once its lease runs out.
        drop(b);
        let dropped = Instant::now();
        while a.node("b").is_some() {
            assert!(dropped.elapsed() < Duration::from_secs(10), "a dead member stayed in the view");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A leaving member goes at once.
        a.leave().await;
        let e = Etcd::new(std::slice::from_ref(&p.url)).unwrap();
        assert!(e.prefix("/cordon/v1/nodes/").await.unwrap().is_empty());
    });
}
