//! The agent serving over one multiplexed byte stream (`cordon-channel`), as under gVisor or in a
//! VM: the host keeps connecting to a Unix socket and every connection becomes a stream.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use cordon_envd::process::{ProcessConfig, StartRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn bash(script: &str) -> StartRequest {
    StartRequest {
        process: Some(ProcessConfig { cmd: "/bin/bash".into(), args: vec!["-c".into(), script.into()], ..Default::default() }),
        stdin: Some(false),
        ..Default::default()
    }
}

#[tokio::test]
async fn commands_and_files_over_a_link() {
    let a = start_agent_linked().await;
    a.client.health().await.unwrap();
    let out = a.client.start(bash("echo out; echo err >&2; exit 3"), None, None).await.unwrap().collect().await.unwrap();
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.end.unwrap().exit_code, 3);

    // Several yamux windows' worth each way.
    let data: Vec<u8> = (0..5_000_000u32).map(|i| (i % 253) as u8).collect();
    a.client.upload_file("big.bin", None, Bytes::from(data.clone())).await.unwrap();
    assert_eq!(std::fs::read(a.home.join("big.bin")).unwrap(), data);
    assert_eq!(a.client.download_file("big.bin", None).await.unwrap(), data);
}

#[tokio::test]
async fn concurrent_connections_each_get_a_stream() {
    let a = start_agent_linked().await;
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let client = a.client.clone();
            tokio::spawn(async move {
                let out = client.start(bash(&format!("echo {i}")), None, None).await.unwrap().collect().await.unwrap();
                assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{i}\n"));
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t).await.expect("timed out").unwrap();
    }
}

#[tokio::test]
async fn forward_upgrade_splices_through_a_link() {
    let a = start_agent_linked().await;
    // A server "inside the sandbox": here, on this host's loopback.
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut s, _) = server.accept().await.unwrap();
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.unwrap();
        buf.make_ascii_uppercase();
        s.write_all(&buf).await.unwrap();
    });
    let mut c = tokio::net::UnixStream::connect(&a.socket).await.unwrap();
    let req = format!(
        "GET /__cordon/forward/{port} HTTP/1.1\r\nHost: sandbox\r\nConnection: upgrade\r\nUpgrade: cordon-forward\r\n\r\n"
    );
    c.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        head.push(c.read_u8().await.unwrap());
    }
    assert!(head.starts_with(b"HTTP/1.1 101"), "{}", String::from_utf8_lossy(&head));
    c.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut back)).await.expect("timed out").unwrap();
    assert_eq!(&back, b"PING");
}
