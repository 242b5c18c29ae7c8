//! `cordon audit ID`: what a sandbox's filters refused so far (`GET /sandboxes/{id}/audit`):
//! the syscalls its seccomp filter denied and the connections its egress policy blocked, as
//! tables, or the server's JSON with `--json`.

use anyhow::Result;
use clap::Args;
use serde_json::Value;

use crate::api_client::{self, Api, ServerArgs};

#[derive(Args, Debug)]
pub struct AuditArgs {
    /// The sandbox's id.
    id: String,
    /// Print the server's answer as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    server: ServerArgs,
}

pub fn main(a: AuditArgs) -> Result<u8> {
    let api = Api::new(&a.server)?;
    let path = format!("/sandboxes/{}/audit", api_client::check_id(&a.id)?);
    let v = api_client::runtime()?.block_on(api.get(&path))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", text(&v));
    }
    Ok(0)
}

fn list(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

fn table(title: &str, head: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut out = format!("{title}:");
    if rows.is_empty() {
        out.push_str(" none\n");
        return out;
    }
    out.push('\n');
    let all: Vec<Vec<String>> = std::iter::once(head.iter().map(|h| h.to_string()).collect()).chain(rows).collect();
    let widths: Vec<usize> = (0..head.len()).map(|i| all.iter().map(|r| r[i].chars().count()).max().unwrap_or(0)).collect();
    for r in &all {
        let cells: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str("  ");
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

fn text(v: &Value) -> String {
    let s = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        v => v.to_string(),
    };
    let syscalls = list(&v["deniedSyscalls"])
        .iter()
        .map(|d| vec![s(&d["syscall"]), s(&d["count"]), list(&d["pids"]).iter().map(s).collect::<Vec<_>>().join(",")])
        .collect();
    let blocked = list(&v["blockedConnections"])
        .iter()
        .map(|b| vec![s(&b["proto"]), s(&b["destination"]), s(&b["name"]), s(&b["reason"]), s(&b["count"])])
        .collect();
    let mut out = table("denied syscalls", &["SYSCALL", "COUNT", "PIDS"], syscalls);
    out.push_str(&table("blocked connections", &["PROTO", "DESTINATION", "NAME", "REASON", "COUNT"], blocked));
    let injected: Vec<Vec<String>> = list(&v["injectedHeaders"]).iter().map(|i| vec![s(&i["host"]), s(&i["header"]), s(&i["count"])]).collect();
    if !injected.is_empty() {
        out.push_str(&table("injected headers", &["HOST", "HEADER", "COUNT"], injected));
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn tables_name_what_was_refused() {
        let t = super::text(&json!({
            "deniedSyscalls": [{"syscall": "mount", "count": 2, "pids": [7, 9]}],
            "blockedConnections": [],
            "injectedHeaders": [],
        }));
        assert_eq!(t, "denied syscalls:\n  SYSCALL  COUNT  PIDS\n  mount    2      7,9\nblocked connections: none\n");
    }
}
