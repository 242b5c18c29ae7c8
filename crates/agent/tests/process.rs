//! `process.Process` against real processes, through `EnvdClient`.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use cordon_envd::process::{
    DataEvent, ProcessConfig, ProcessEvent, ProcessSelector, Pty, PtySize, Signal, StartRequest,
};
use cordon_envd::{Code, ProcessStream};

fn bash(script: &str) -> StartRequest {
    StartRequest {
        process: Some(ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-c".into(), script.into()],
            ..Default::default()
        }),
        stdin: Some(false),
        ..Default::default()
    }
}

async fn expect_start(s: &mut ProcessStream) -> u32 {
    match s.next().await {
        Some(Ok(ProcessEvent::Start(st))) => {
            assert!(st.pid > 0);
            st.pid
        }
        other => panic!("expected a start event first, got {other:?}"),
    }
}

/// Reads events until stdout contains `needle`.
async fn read_until_stdout(s: &mut ProcessStream, needle: &str) -> String {
    let mut out = String::new();
    while !out.contains(needle) {
        match tokio::time::timeout(Duration::from_secs(10), s.next()).await.expect("timed out") {
            Some(Ok(ProcessEvent::Data(DataEvent::Stdout(b)))) => out.push_str(&String::from_utf8_lossy(&b)),
            Some(Ok(ProcessEvent::Data(DataEvent::Pty(b)))) => out.push_str(&String::from_utf8_lossy(&b)),
            Some(Ok(ProcessEvent::Keepalive(_) | ProcessEvent::Data(_))) => {}
            other => panic!("stream ended before {needle:?} (got {out:?}): {other:?}"),
        }
    }
    out
}

#[tokio::test]
async fn stdout_stderr_and_exit_code() {
    let a = start_agent().await;
    let out = a
        .client
        .start(bash("echo out; echo err >&2; exit 3"), None, None)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert!(out.pid > 0);
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    let end = out.end.expect("end event");
    assert_eq!(end.exit_code, 3);
    assert!(end.exited);
    assert_eq!(end.status, "exit status 3");
    assert_eq!(end.error.as_deref(), Some("exit status 3"));

    let ok = a.client.start(bash("true"), None, None).await.unwrap().collect().await.unwrap();
    let end = ok.end.unwrap();
    assert_eq!((end.exit_code, end.exited, end.status.as_str(), end.error), (0, true, "exit status 0", None));
}

#[tokio::test]
async fn large_output_arrives_complete_and_in_order() {
    let a = start_agent().await;
    let out = a
        .client
        .start(bash("head -c 3000000 /dev/zero | tr '\\0' 'x'; echo; echo tail"), None, None)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(out.stdout.len(), 3_000_000 + 1 + 5);
    assert!(out.stdout.ends_with(b"x\ntail\n"));
    assert_eq!(out.end.unwrap().exit_code, 0);
}

#[tokio::test]
async fn environment_and_cwd() {
    let a = start_agent().await;
    std::fs::create_dir_all(a.home.join("sub")).unwrap();
    let mut req = bash("echo \"$SANDBOX_VAR|$OVERRIDE|$REQ|$HOME|$USER|$LOGNAME\"; pwd; echo $PATH");
    let p = req.process.as_mut().unwrap();
    p.envs = BTreeMap::from([("OVERRIDE".into(), "request".into()), ("REQ".into(), "r".into())]);
    p.cwd = Some("sub".into());
    let out = a.client.start(req, None, None).await.unwrap().collect().await.unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let home = a.home.display().to_string();
    assert_eq!(lines[0], format!("from-sandbox|request|r|{home}|tester|tester"));
    assert_eq!(lines[1], format!("{home}/sub"));
    assert!(lines[2].contains("/usr/bin"), "default PATH: {}", lines[2]);

    let mut req = bash("pwd");
    req.process.as_mut().unwrap().cwd = Some("~".into());
    let out = a.client.start(req, None, None).await.unwrap().collect().await.unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), home);
}

#[tokio::test]
async fn workdir_and_path_from_config() {
    let a = start_agent_with(|c| {
        c.workdir = Some("/tmp".into());
        c.env.push(("PATH".into(), "/custom/bin:/usr/bin:/bin".into()));
    })
    .await;
    let out = a.client.start(bash("pwd; echo $PATH"), None, None).await.unwrap().collect().await.unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "/tmp\n/custom/bin:/usr/bin:/bin\n");
}

#[tokio::test]
async fn missing_cwd_and_unknown_user_are_rejected() {
    let a = start_agent().await;
    let mut req = bash("true");
    req.process.as_mut().unwrap().cwd = Some("does/not/exist".into());
    let err = a.client.start(req, None, None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument));
    assert!(err.to_string().contains(&format!("cwd '{}/does/not/exist' does not exist", a.home.display())), "{err}");

    let err = a.client.start(bash("true"), Some("nosuchuser"), None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::Unauthenticated));

    let mut req = bash("true");
    req.process.as_mut().unwrap().cmd = "/nonexistent/program".into();
    let err = a.client.start(req, None, None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
}

#[tokio::test]
async fn stdin_send_input_then_close() {
    let a = start_agent().await;
    let mut req = bash("cat");
    req.stdin = Some(true);
    let mut s = a.client.start(req, None, None).await.unwrap();
    let pid = expect_start(&mut s).await;
    a.client.send_input(pid, b"hello\n").await.unwrap();
    read_until_stdout(&mut s, "hello\n").await;
    a.client.close_stdin(pid).await.unwrap();
    let rest = s.collect().await.unwrap();
    assert_eq!(rest.end.unwrap().exit_code, 0);
}

#[tokio::test]
async fn stdin_absent_means_enabled_and_false_means_dev_null() {
    let a = start_agent().await;
    let mut req = bash("read line; echo got $line");
    req.stdin = None;
    let mut s = a.client.start(req, None, None).await.unwrap();
    let pid = expect_start(&mut s).await;
    a.client.send_input(pid, b"abc\n").await.unwrap();
    assert_eq!(s.collect().await.unwrap().stdout, b"got abc\n");

    let mut s = a.client.start(bash("cat; sleep 0.3"), None, None).await.unwrap();
    let pid = expect_start(&mut s).await;
    let err = a.client.send_input(pid, b"x").await.unwrap_err();
    assert_eq!(err.code(), Some(Code::FailedPrecondition), "{err}");
    let out = s.collect().await.unwrap();
    assert!(out.stdout.is_empty());
    assert_eq!(out.end.unwrap().exit_code, 0);
}

#[tokio::test]
async fn sigkill_reports_minus_one_and_signal_killed() {
    let a = start_agent().await;
    let mut req = bash("exec sleep 30");
    req.tag = Some("sleeper".into());
    let mut s = a.client.start(req, None, None).await.unwrap();
    let pid = expect_start(&mut s).await;
    let listed = a.client.list().await.unwrap();
    let info = listed.iter().find(|p| p.pid == pid).expect("listed");
    assert_eq!(info.tag.as_deref(), Some("sleeper"));
    assert_eq!(info.config.as_ref().unwrap().cmd, "/bin/bash");

    a.client.send_signal(pid, Signal::Sigkill).await.unwrap();
    let out = s.collect().await.unwrap();
    let end = out.end.unwrap();
    assert_eq!(end.exit_code, -1);
    assert!(!end.exited);
    assert_eq!(end.status, "signal: killed");
    assert_eq!(end.error.as_deref(), Some("signal: killed"));
    assert!(a.client.list().await.unwrap().iter().all(|p| p.pid != pid));
}

#[tokio::test]
async fn connect_gets_remaining_output_and_end() {
    let a = start_agent().await;
    let mut req = bash("echo first; read x; echo second $x; exit 4");
    req.stdin = Some(true);
    req.tag = Some("conn".into());
    let mut s = a.client.start(req, None, None).await.unwrap();
    let pid = expect_start(&mut s).await;
    read_until_stdout(&mut s, "first\n").await;

    let mut c = a.client.connect(ProcessSelector::Tag("conn".into()), None).await.unwrap();
    assert_eq!(expect_start(&mut c).await, pid);
    a.client.send_input(pid, b"now\n").await.unwrap();
    let seen = c.collect().await.unwrap();
    assert_eq!(seen.stdout, b"second now\n");
    assert_eq!(seen.end.as_ref().unwrap().exit_code, 4);
    let orig = s.collect().await.unwrap();
    assert_eq!(orig.stdout, b"second now\n");

    // The exit is kept for a late Connect.
    let late = a.client.connect(ProcessSelector::Pid(pid), None).await.unwrap().collect().await.unwrap();
    assert_eq!(late.pid, pid);
    assert_eq!(late.end.unwrap().status, "exit status 4");
    // But the process can no longer be signalled.
    let err = a.client.send_signal(pid, Signal::Sigkill).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));
}

#[tokio::test]
async fn unknown_pid_is_not_found() {
    let a = start_agent().await;
    let pid = 0x7fff_fff0;
    let err = a.client.connect(ProcessSelector::Pid(pid), None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));
    assert!(err.to_string().contains("process with pid 2147483632 not found"), "{err}");
    for err in [
        a.client.send_signal(pid, Signal::Sigterm).await.unwrap_err(),
        a.client.send_input(pid, b"x").await.unwrap_err(),
        a.client.close_stdin(pid).await.unwrap_err(),
        a.client.resize_pty(pid, 80, 24).await.unwrap_err(),
    ] {
        assert_eq!(err.code(), Some(Code::NotFound), "{err}");
    }
    let err = a.client.connect(ProcessSelector::Tag("nope".into()), None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));
}

#[tokio::test]
async fn connect_timeout_kills_the_process() {
    let a = start_agent().await;
    let t0 = Instant::now();
    let mut s = a.client.start(bash("echo started; exec sleep 30"), None, Some(700)).await.unwrap();
    let pid = expect_start(&mut s).await;
    read_until_stdout(&mut s, "started").await;
    let mut end = None;
    let mut err = None;
    while let Some(ev) = s.next().await {
        match ev {
            Ok(ProcessEvent::End(e)) => end = Some(e),
            Ok(_) => {}
            Err(e) => err = Some(e),
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
    let end = end.expect("end event before the deadline error");
    assert_eq!((end.exit_code, end.status.as_str()), (-1, "signal: killed"));
    assert_eq!(err.and_then(|e| e.code()), Some(Code::DeadlineExceeded));
    assert!(a.client.list().await.unwrap().iter().all(|p| p.pid != pid));
}

#[tokio::test]
async fn client_disconnect_leaves_the_process_running() {
    let a = start_agent().await;
    let marker = a.dir.join("marker");
    let script = format!("echo begin; sleep 1; echo done > {}; echo more", marker.display());
    let mut s = a.client.start(bash(&script), None, None).await.unwrap();
    let pid = expect_start(&mut s).await;
    read_until_stdout(&mut s, "begin").await;
    drop(s);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(a.client.list().await.unwrap().iter().any(|p| p.pid == pid), "still running after disconnect");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !marker.exists() {
        assert!(Instant::now() < deadline, "the process did not finish after the client left");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "done\n");
    // Its exit is still collected.
    let late = a.client.connect(ProcessSelector::Pid(pid), None).await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(5), late.collect()).await.unwrap().unwrap();
    assert_eq!(out.end.unwrap().exit_code, 0);
}

#[tokio::test]
async fn background_grandchild_does_not_hold_up_the_end() {
    let a = start_agent().await;
    let t0 = Instant::now();
    let out = tokio::time::timeout(
        Duration::from_secs(5),
        a.client.start(bash("sleep 8 & echo hi"), None, None).await.unwrap().collect(),
    )
    .await
    .expect("end event did not arrive while a grandchild holds stdout")
    .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(4));
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(out.end.unwrap().exit_code, 0);
}

#[tokio::test]
async fn keepalive_events_during_silence() {
    let a = start_agent().await;
    // The client asks for 50 s; a raw request can ask for 1 s.
    let body = envelope(0, br#"{"process":{"cmd":"/bin/sh","args":["-c","sleep 2.5"]},"stdin":false}"#);
    let req = post("/process.Process/Start", "application/connect+json", "Keepalive-Ping-Interval: 1\r\n", &body);
    let resp = raw_request(&a.socket, &req).await;
    let envs = split_envelopes(&resp.body);
    let keepalives = envs.iter().filter(|(_, j)| j == br#"{"event":{"keepalive":{}}}"#).count();
    assert!(keepalives >= 2, "{:?}", envs);
}

#[tokio::test]
async fn stream_input_client_stream() {
    let a = start_agent().await;
    let mut req = bash("cat");
    req.stdin = Some(true);
    let mut s = a.client.start(req, None, None).await.unwrap();
    let pid = expect_start(&mut s).await;
    let start = format!(r#"{{"start":{{"process":{{"pid":{pid}}}}}}}"#);
    let c1 = envelope(0, start.as_bytes());
    let c2 = envelope(0, br#"{"data":{"input":{"stdin":"b25lCg=="}}}"#);
    let c3 = envelope(0, br#"{"keepalive":{}}"#);
    let c4 = envelope(0, br#"{"data":{"input":{"stdin":"dHdvCg=="}}}"#);
    let req = chunked_post("/process.Process/StreamInput", "application/connect+json", "", &[&c1, &c2, &c3[..2], &c3[2..], &c4]);
    let resp = raw_request(&a.socket, &req).await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-type"), Some("application/connect+json"));
    assert_eq!(split_envelopes(&resp.body), vec![(0, b"{}".to_vec()), (2, b"{}".to_vec())]);
    read_until_stdout(&mut s, "one\ntwo\n").await;
    a.client.close_stdin(pid).await.unwrap();
    assert_eq!(s.collect().await.unwrap().end.unwrap().exit_code, 0);

    // Data before start is refused.
    let req = chunked_post("/process.Process/StreamInput", "application/connect+json", "", &[&c2]);
    let resp = raw_request(&a.socket, &req).await;
    let envs = split_envelopes(&resp.body);
    assert_eq!(envs.len(), 1);
    assert_eq!(envs[0].0, 2);
    assert!(String::from_utf8_lossy(&envs[0].1).contains("failed_precondition"));
}

#[tokio::test]
async fn pty_output_input_and_resize() {
    let a = start_agent().await;
    let req = StartRequest {
        process: Some(ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-c".into(), "tty; stty size; read x; stty size; echo \"[$TERM]\"".into()],
            ..Default::default()
        }),
        pty: Some(Pty { size: Some(PtySize { cols: 100, rows: 30 }) }),
        stdin: Some(false),
        ..Default::default()
    };
    let mut s = a.client.start(req, None, None).await.unwrap();
    let pid = expect_start(&mut s).await;
    let first = read_until_stdout(&mut s, "30 100").await;
    assert!(first.contains("/dev/pts/"), "{first:?}");
    a.client.resize_pty(pid, 120, 40).await.unwrap();
    a.client.send_pty_input(pid, b"go\r").await.unwrap();
    let mut tail = read_until_stdout(&mut s, "40 120").await;
    let rest = s.collect().await.unwrap();
    tail.push_str(&String::from_utf8_lossy(&rest.pty));
    assert!(tail.contains("[xterm-256color]"), "{tail:?}");
    assert_eq!(rest.end.unwrap().exit_code, 0);
}

#[tokio::test]
async fn runs_as_another_user_with_groups() {
    if !is_root() {
        eprintln!("skipped: switching to uid 65534 needs root");
        return;
    }
    let a = start_agent().await;
    let mut req = bash("id -u; id -g; id -G; echo $HOME $USER; pwd; touch f; stat -c %u f");
    req.process.as_mut().unwrap().cmd = "/bin/bash".into();
    let out = a.client.start(req, Some("nobody"), None).await.unwrap().collect().await.unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "65534", "{text} / {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(lines[1], "65534");
    assert!(lines[2].split(' ').any(|g| g == EXTRA_GID.to_string()), "groups: {}", lines[2]);
    assert_eq!(lines[3], format!("{} nobody", a.nobody_home.display()));
    assert_eq!(lines[4], a.nobody_home.display().to_string());
    assert_eq!(lines[5], "65534");

    let root = a.client.start(bash("id -u"), Some("root"), None).await.unwrap().collect().await.unwrap();
    assert_eq!(root.stdout, b"0\n");
}

#[tokio::test]
async fn orphans_are_reaped_and_statuses_not_mixed_up() {
    let a = start_agent().await;
    // Many short processes at once, each with its own exit code.
    let mut handles = Vec::new();
    for i in 0..12 {
        let client = a.client.clone();
        handles.push(tokio::spawn(async move {
            let out = client.start(bash(&format!("(sleep 0.1 &); exit {i}")), None, None).await.unwrap().collect().await.unwrap();
            (i, out.end.unwrap().exit_code)
        }));
    }
    for h in handles {
        let (i, code) = h.await.unwrap();
        assert_eq!(code, i);
    }
}

#[tokio::test]
async fn pty_output_is_complete_at_exit() {
    let a = start_agent().await;
    for _ in 0..5 {
        let req = StartRequest {
            process: Some(ProcessConfig { cmd: "seq".into(), args: vec!["1".into(), "3000".into()], ..Default::default() }),
            pty: Some(Pty { size: Some(PtySize { cols: 80, rows: 24 }) }),
            ..Default::default()
        };
        let out = a.client.start(req, None, None).await.unwrap().collect().await.unwrap();
        let text = String::from_utf8_lossy(&out.pty);
        assert!(text.ends_with("2999\r\n3000\r\n"), "tail: {:?}", &text[text.len().saturating_sub(40)..]);
        assert!(out.stdout.is_empty() && out.stderr.is_empty());
    }
}

#[tokio::test]
async fn program_is_looked_up_in_path() {
    let a = start_agent().await;
    let req = StartRequest {
        process: Some(ProcessConfig { cmd: "echo".into(), args: vec!["found".into()], ..Default::default() }),
        stdin: Some(false),
        ..Default::default()
    };
    let out = a.client.start(req, None, None).await.unwrap().collect().await.unwrap();
    assert_eq!(out.stdout, b"found\n");
}

#[tokio::test]
async fn slow_client_slows_the_process_instead_of_buffering() {
    let a = start_agent().await;
    let marker = a.dir.join("written");
    let script = format!("head -c 8000000 /dev/zero; echo done > {}", marker.display());
    let mut s = a.client.start(bash(&script), None, None).await.unwrap();
    let pid = expect_start(&mut s).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!marker.exists(), "8 MB went somewhere although nobody read them");
    assert!(a.client.list().await.unwrap().iter().any(|p| p.pid == pid));
    let out = s.collect().await.unwrap();
    assert_eq!(out.stdout.len(), 8_000_000);
    assert_eq!(out.end.unwrap().exit_code, 0);
    assert!(marker.exists());
}
