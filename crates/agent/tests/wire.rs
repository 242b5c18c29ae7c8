//! The exact bytes on the wire: content types, envelopes, unary bodies, error shapes.

mod common;

use common::*;

#[tokio::test]
async fn start_stream_wire_format_with_chunked_request() {
    let a = start_agent().await;
    let body = envelope(0, br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"BAR":"baz"}},"stdin":false}"#);
    // The SDK (>= 2.40) sends the single request envelope chunked; split it mid-header.
    let req = chunked_post(
        "/process.Process/Start",
        "application/connect+json",
        "Connect-Protocol-Version: 1\r\nConnect-Timeout-Ms: 60000\r\nKeepalive-Ping-Interval: 50\r\n",
        &[&body[..3], &body[3..10], &body[10..]],
    );
    let resp = raw_request(&a.socket, &req).await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-type"), Some("application/connect+json"));
    assert!(resp.chunked, "stream responses are chunked");
    let envs = split_envelopes(&resp.body);
    assert!(envs.len() >= 4, "{envs:?}");
    let first: serde_json::Value = serde_json::from_slice(&envs[0].1).unwrap();
    assert_eq!(envs[0].0, 0);
    assert!(first["event"]["start"]["pid"].as_u64().unwrap() > 0, "{first}");
    let data: Vec<&(u8, Vec<u8>)> = envs.iter().filter(|(_, j)| j.starts_with(br#"{"event":{"data""#)).collect();
    assert_eq!(data.len(), 1);
    assert_eq!(data[0].1, br#"{"event":{"data":{"stdout":"aGkK"}}}"#);
    let n = envs.len();
    assert_eq!(envs[n - 2], (0, br#"{"event":{"end":{"exited":true,"status":"exit status 0"}}}"#.to_vec()));
    assert_eq!(envs[n - 1], (2, b"{}".to_vec()));
}

#[tokio::test]
async fn stream_request_with_content_length_and_error_end_stream() {
    let a = start_agent().await;
    let body = envelope(0, br#"{"process":{"cmd":"/bin/true","cwd":"/nonexistent-dir"}}"#);
    let resp = raw_request(&a.socket, &post("/process.Process/Start", "application/connect+json", "", &body)).await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-type"), Some("application/connect+json"));
    let envs = split_envelopes(&resp.body);
    assert_eq!(envs.len(), 1);
    assert_eq!(envs[0].0, 2);
    let v: serde_json::Value = serde_json::from_slice(&envs[0].1).unwrap();
    assert_eq!(v["error"]["code"], "invalid_argument");
    assert_eq!(v["error"]["message"], "cwd '/nonexistent-dir' does not exist");
}

#[tokio::test]
async fn malformed_stream_requests_are_invalid_argument() {
    let a = start_agent().await;
    let syntax: Vec<Vec<u8>> = vec![
        b"\x00\x00\x00".to_vec(),              // truncated header
        b"\x00\x00\x00\x00\x09{\"a\"".to_vec(), // truncated payload
        envelope(0, b"{not json"),              // bad JSON
        envelope(1, b"{}"),                     // compressed without negotiation
        Vec::new(),                             // no message at all
    ];
    let semantic: Vec<Vec<u8>> = vec![
        envelope(0, br#"{"process":{"cmd":5}}"#),           // wrong type
        envelope(0, br#"{"process":{"pid":1,"tag":"x"}}"#), // two selectors (Connect), no cmd (Start)
    ];
    let cases = syntax
        .iter()
        .flat_map(|b| ["/process.Process/Start", "/process.Process/Connect", "/filesystem.Filesystem/WatchDir"].map(|p| (p, b)))
        .chain(semantic.iter().flat_map(|b| ["/process.Process/Start", "/process.Process/Connect"].map(|p| (p, b))));
    for (path, body) in cases {
        let resp = raw_request(&a.socket, &post(path, "application/connect+json", "", body)).await;
        assert_eq!(resp.status, 200, "{path}");
        let envs = split_envelopes(&resp.body);
        assert_eq!(envs.len(), 1, "{path} {body:?}: {envs:?}");
        assert_eq!(envs[0].0, 2);
        let v: serde_json::Value = serde_json::from_slice(&envs[0].1).unwrap();
        assert_eq!(v["error"]["code"], "invalid_argument", "{path} {body:?}: {v}");
    }
}

#[tokio::test]
async fn unary_bodies() {
    let a = start_agent().await;
    let resp = raw_request(&a.socket, &post("/process.Process/List", "application/json", "Connect-Protocol-Version: 1\r\n", b"{}")).await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert_eq!(resp.body, b"{}", "an empty list is an empty object, never an empty body");

    // A running process, then SendSignal answers exactly {}.
    let out = a
        .client
        .start(
            cordon_envd::process::StartRequest {
                process: Some(cordon_envd::process::ProcessConfig {
                    cmd: "/bin/sleep".into(),
                    args: vec!["30".into()],
                    ..Default::default()
                }),
                stdin: Some(false),
                ..Default::default()
            },
            None,
            None,
        )
        .await
        .unwrap();
    let pid = out.pid();
    let resp = raw_request(&a.socket, &post("/process.Process/List", "application/json", "", b"{}")).await;
    let v: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(v["processes"][0]["pid"], pid);
    assert_eq!(v["processes"][0]["config"]["cmd"], "/bin/sleep");
    let body = format!(r#"{{"process":{{"pid":{pid}}},"signal":"SIGNAL_SIGKILL"}}"#);
    let resp = raw_request(&a.socket, &post("/process.Process/SendSignal", "application/json", "", body.as_bytes())).await;
    assert_eq!((resp.status, resp.body.as_slice()), (200, &b"{}"[..]));
    let end = out.collect().await.unwrap().end.unwrap();
    assert_eq!(end.status, "signal: killed");
}

#[tokio::test]
async fn unary_errors() {
    let a = start_agent().await;
    let resp = raw_request(&a.socket, &post("/process.Process/SendSignal", "application/json", "", br#"{"process":{"pid":999999999},"signal":9}"#)).await;
    assert_eq!(resp.status, 404);
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert_eq!(resp.body, br#"{"code":"not_found","message":"process with pid 999999999 not found"}"#);

    let resp = raw_request(&a.socket, &post("/process.Process/SendSignal", "application/json", "", b"{\"process\":")).await;
    assert_eq!(resp.status, 400);
    let v: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(v["code"], "invalid_argument");

    let resp = raw_request(&a.socket, &post("/filesystem.Filesystem/Stat", "application/json", "Authorization: Basic bm9ib2R5eDo=\r\n", br#"{"path":"/"}"#)).await;
    assert_eq!(resp.status, 401);
    let v: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(v["code"], "unauthenticated");

    let resp = raw_request(&a.socket, &post("/nope", "application/json", "", b"{}")).await;
    assert_eq!(resp.status, 404);
    let v: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(v["code"], "not_found");

    let resp = raw_request(&a.socket, &post("/process.Process/Nope", "application/json", "", b"{}")).await;
    assert_eq!(resp.status, 404);

    let resp = raw_request(&a.socket, &get("/process.Process/List", "")).await;
    assert_eq!(resp.status, 405);

    let resp = raw_request(&a.socket, &post("/process.Process/List", "application/proto", "", b"")).await;
    assert_eq!(resp.status, 415);
}

#[tokio::test]
async fn health() {
    let a = start_agent().await;
    let resp = raw_request(&a.socket, &get("/health", "")).await;
    assert_eq!(resp.status, 204);
    a.client.health().await.unwrap();
    let resp = raw_request(&a.socket, &get("/envs", "")).await;
    let v: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(v["SANDBOX_VAR"], "from-sandbox");
}

#[tokio::test]
async fn keep_alive_connection_serves_several_requests() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let a = start_agent().await;
    let mut s = tokio::net::UnixStream::connect(&a.socket).await.unwrap();
    let one = b"POST /process.Process/List HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    s.write_all(one).await.unwrap();
    s.write_all(one).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out);
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2, "{text}");
    assert_eq!(text.matches("HTTP/1.1 204").count(), 1, "{text}");
}
