//! The host and agent ends of a link, joined by a socketpair or a pair of pipes, with an echo
//! service on the agent end.

use std::os::fd::OwnedFd;
use std::time::Duration;

use cordon_channel::{serve_unix, Acceptor, FdLink};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

fn socket_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("cordon-channel-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("agent.sock")
}

/// Echoes every stream back in upper case until the stream's EOF, then closes it.
async fn echo_agent(link: FdLink) {
    let mut acceptor = Acceptor::new(link);
    while let Some(stream) = acceptor.accept().await {
        let mut stream = stream.unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            loop {
                let n = stream.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                buf[..n].make_ascii_uppercase();
                stream.write_all(&buf[..n]).await.unwrap();
            }
            stream.shutdown().await.unwrap();
        });
    }
}

async fn round_trip(socket: &std::path::Path, len: usize) {
    let c = UnixStream::connect(socket).await.unwrap();
    let (mut r, mut w) = c.into_split();
    let data: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
    let expect = data.to_ascii_uppercase();
    let writer = tokio::spawn(async move {
        w.write_all(&data).await.unwrap();
        // Half-close: the agent sees EOF, answers the rest and closes its side.
        w.shutdown().await.unwrap();
    });
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), r.read_to_end(&mut got)).await.expect("timed out").unwrap();
    writer.await.unwrap();
    assert_eq!(got.len(), expect.len());
    assert!(got == expect);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_over_a_socketpair() {
    let (h, a) = std::os::unix::net::UnixStream::pair().unwrap();
    let socket = socket_path("pair");
    let listener = UnixListener::bind(&socket).unwrap();
    let agent = tokio::spawn(echo_agent(FdLink::duplex(a.into()).unwrap()));
    let host = tokio::spawn(async move { serve_unix(FdLink::duplex(h.into()).unwrap(), &listener).await });
    let clients: Vec<_> = (0..32).map(|i| {
        let socket = socket.clone();
        tokio::spawn(async move { round_trip(&socket, 1000 + i * 40_000).await })
    }).collect();
    for c in clients {
        c.await.unwrap();
    }
    // The agent going away ends the host side cleanly, and new connections are refused.
    agent.abort();
    let _ = agent.await;
    // Ok for a clean close, an error for a reset: either way the host side must end.
    let _ = tokio::time::timeout(Duration::from_secs(10), host).await.expect("the host side did not notice").unwrap();
    assert!(UnixStream::connect(&socket).await.is_err());
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into `fds`.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just created and are owned here alone.
    unsafe { (std::os::fd::FromRawFd::from_raw_fd(fds[0]), std::os::fd::FromRawFd::from_raw_fd(fds[1])) }
}

#[tokio::test]
async fn a_pair_of_pipes_is_a_link_too() {
    // As under gVisor: the agent reads its stdin and writes its stdout.
    let (to_agent_r, to_agent_w) = pipe();
    let (from_agent_r, from_agent_w) = pipe();
    let socket = socket_path("pipes");
    let listener = UnixListener::bind(&socket).unwrap();
    tokio::spawn(echo_agent(FdLink::new(to_agent_r, from_agent_w).unwrap()));
    let host = tokio::spawn(async move { serve_unix(FdLink::new(from_agent_r, to_agent_w).unwrap(), &listener).await });
    round_trip(&socket, 3_000_000).await;
    round_trip(&socket, 1).await;
    host.abort();
}

#[tokio::test]
async fn streams_the_agent_opens_are_refused_and_the_host_ignores_them() {
    // A hostile agent opening streams towards the host gets nothing, and the link lives on.
    let (h, a) = std::os::unix::net::UnixStream::pair().unwrap();
    let socket = socket_path("hostile");
    let listener = UnixListener::bind(&socket).unwrap();
    tokio::spawn(async move { serve_unix(FdLink::duplex(h.into()).unwrap(), &listener).await });
    let (opener, driver) = cordon_channel::host(FdLink::duplex(a.into()).unwrap());
    tokio::spawn(driver);
    let mut s = opener.open().await.unwrap();
    let _ = s.write_all(b"hello host").await;
    let mut buf = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("the host left the stream hanging");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
}
