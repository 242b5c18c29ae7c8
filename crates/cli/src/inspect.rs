//! `cordon inspect ID`: a sandbox's isolation report from a running `cordon serve` (its
//! `GET /sandboxes/{id}/isolation`), printed as JSON. `--verify` has the server run the probe
//! inside the sandbox and fails on any field where the host's report and the sandbox's own view
//! differ; `--expect FILE` fails on any field of FILE (a JSON object shaped like the report)
//! that the report does not hold. Either failure names each field, and exits 1.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use serde_json::Value;

use crate::api_client::{self, Api, ServerArgs};
use crate::usage;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The sandbox's id.
    id: String,
    /// Run the probe inside the sandbox and fail on any difference with the host's report.
    #[arg(long)]
    verify: bool,
    /// Fail unless the report holds every field of this JSON object (nested as in the report),
    /// e.g. {"cgroup": {"memoryBytes": 536870912}, "network": {"enabled": false}}.
    #[arg(long, value_name = "FILE")]
    expect: Option<PathBuf>,
    #[command(flatten)]
    server: ServerArgs,
}

pub fn main(a: InspectArgs) -> Result<u8> {
    let api = Api::new(&a.server)?;
    let expect: Option<Value> = match &a.expect {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| usage(format!("--expect {}: {e}", p.display())))?;
            Some(serde_json::from_str(&text).map_err(|e| usage(format!("--expect {}: not JSON: {e}", p.display())))?)
        }
        None => None,
    };
    let path = format!("/sandboxes/{}/isolation{}", api_client::check_id(&a.id)?, if a.verify { "?verify=true" } else { "" });
    let report = api_client::runtime()?.block_on(api.get(&path))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    let mut failed = Vec::new();
    if a.verify {
        for d in report["verify"]["differences"].as_array().into_iter().flatten() {
            failed.push(format!("{}: the host reports {}, the sandbox sees {}", d["field"].as_str().unwrap_or("?"), d["host"], d["inside"]));
        }
    }
    if let Some(want) = &expect {
        expected(want, &report, String::new(), &mut failed);
    }
    if failed.is_empty() {
        if a.verify {
            let n = report["verify"]["checked"].as_array().map_or(0, Vec::len);
            eprintln!("cordon inspect: verified: the host's report and the sandbox's own view agree on {n} fields");
        }
        return Ok(0);
    }
    for f in &failed {
        eprintln!("cordon inspect: {} differs: {f}", a.id);
    }
    Ok(1)
}

/// Every leaf of `want` that `got` does not hold, as "field: expected X, the report has Y".
fn expected(want: &Value, got: &Value, at: String, out: &mut Vec<String>) {
    match want {
        Value::Object(m) => {
            for (k, v) in m {
                let field = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
                expected(v, &got[k], field, out);
            }
        }
        leaf if leaf != got => out.push(format!("{at}: expected {leaf}, the report has {got}")),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn expectations_name_each_leaf_that_differs() {
        let report = json!({"cgroup": {"memoryBytes": 100, "pids": 5}, "network": {"enabled": false}});
        let mut out = Vec::new();
        super::expected(&json!({"cgroup": {"memoryBytes": 100, "pids": 6}, "network": {"enabled": true}}), &report, String::new(), &mut out);
        assert_eq!(out, ["cgroup.pids: expected 6, the report has 5", "network.enabled: expected true, the report has false"]);
        out.clear();
        super::expected(&json!({"cgroup": {"memoryBytes": 100}}), &report, String::new(), &mut out);
        assert!(out.is_empty());
    }
}
