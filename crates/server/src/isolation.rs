//! `GET /sandboxes/{id}/isolation`: the sandbox's isolation report (see
//! `cordon_sandbox::report`), and with `?verify=true` the same report checked against what the
//! sandbox sees from inside: the server puts a probe into it (the `cordon-probe` next to its own
//! binary, else its own binary run as `cordon probe`), runs it as the default user, deletes it,
//! and answers the probe's view, the fields compared and every difference.

use std::sync::Arc;

use bytes::Bytes;
use cordon_envd::process::{ProcessConfig, StartRequest};
use hyper::StatusCode;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::registry::LiveSandbox;

/// The report of a live sandbox, read on a blocking thread (the tier reads `/proc`, or asks
/// its VMM's version).
pub async fn report(e: &Arc<LiveSandbox>) -> Result<Value, ApiError> {
    let e2 = e.clone();
    let v = tokio::task::spawn_blocking(move || {
        let network = e2.network();
        e2.with_instance(None, |i| Some(cordon_sandbox::report::report(&e2.id, e2.tier, i, &network)))
    })
    .await
    .map_err(|err| ApiError::internal(err.to_string()))?;
    v.ok_or_else(|| ApiError::new(StatusCode::CONFLICT, format!("sandbox {} is being paused, resumed or killed: ask again", e.id)))
}

/// The report with its check against a probe run inside: `verify.differences` is empty when
/// the two agree on every field both know.
pub async fn verified(e: &Arc<LiveSandbox>) -> Result<Value, ApiError> {
    if e.frozen_at().is_some() {
        return Err(ApiError::new(StatusCode::CONFLICT, format!("sandbox {} is paused: resume it to run the probe inside", e.id)));
    }
    let mut v = report(e).await?;
    let probe = run_probe(e).await?;
    let (checked, differences) = cordon_sandbox::report::compare(&v, &probe);
    v["verify"] = json!({ "probe": probe, "checked": checked, "differences": differences });
    Ok(v)
}

/// The probe's view from inside, as JSON.
async fn run_probe(e: &Arc<LiveSandbox>) -> Result<Value, ApiError> {
    let exe = std::env::current_exe().map_err(|err| ApiError::internal(format!("cannot find the server's binary: {err}")))?;
    let small = exe.with_file_name("cordon-probe");
    let (binary, args) = if small.is_file() { (small, "") } else { (exe, " probe") };
    let data = tokio::fs::read(&binary).await.map_err(|err| ApiError::internal(format!("read {}: {err}", binary.display())))?;
    let client = cordon_envd::EnvdClient::new(e.socket.clone());
    let path = format!("/tmp/.cordon-probe-{}", &cordon_sandbox::new_id()[1..9]);
    client
        .upload_file(&path, None, Bytes::from(data))
        .await
        .map_err(|err| ApiError::internal(format!("cannot put the probe into the sandbox: {err}")))?;
    // The upload leaves the file without its execute bit; the shell gives it, runs it once and
    // removes it, whatever the probe's exit.
    let script = format!("chmod 700 \"$0\" && \"$0\"{args}; s=$?; rm -f \"$0\"; exit $s");
    let req = StartRequest {
        process: Some(ProcessConfig { cmd: "/bin/sh".into(), args: vec!["-c".into(), script, path.clone()], envs: Default::default(), cwd: Some("/".into()) }),
        pty: None,
        tag: None,
        stdin: Some(false),
    };
    let out = async { client.start(req, None, Some(120_000)).await?.collect().await }
        .await
        .map_err(|err| ApiError::internal(format!("cannot run the probe in the sandbox (it needs /bin/sh): {err}")))?;
    serde_json::from_slice(&out.stdout).map_err(|err| {
        ApiError::internal(format!("the probe's answer is not JSON ({err}): {}", String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or("")))
    })
}
