//! `cordon ps`: the sandboxes of a running `cordon serve`, one row each: id, template, tier,
//! state, age, CPU and memory (the server's latest sample), network. The list pages through
//! `GET /sandboxes`; the figures come from each running sandbox's `GET /sandboxes/{id}/metrics`
//! asked from now on, which the server answers with a sample taken for the request.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Result;
use clap::Args;
use cordon_envd::Timestamp;
use serde::Serialize;
use serde_json::Value;

use crate::api_client::{Api, ServerArgs};

#[derive(Args, Debug)]
pub struct PsArgs {
    /// Print the rows as a JSON array.
    #[arg(long)]
    json: bool,
    /// Paused sandboxes too (by default only running ones).
    #[arg(long, short)]
    all: bool,
    #[command(flatten)]
    server: ServerArgs,
}

#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
struct Row {
    id: String,
    template: String,
    tier: String,
    /// `running` or `paused`.
    state: String,
    started_at: String,
    age_seconds: u64,
    /// Share of the sandbox's cores used, in percent; absent without a sample (paused).
    cpu_pct: Option<f64>,
    cpu_count: u64,
    mem_used_bytes: Option<u64>,
    mem_total_bytes: u64,
    /// `closed` (no network), `allowlist` (only what rules allow) or `open` (the internet).
    network: &'static str,
}

pub fn main(a: PsArgs) -> Result<u8> {
    let api = Api::new(&a.server)?;
    let rows = crate::api_client::runtime()?.block_on(rows(&api, a.all))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", table(&rows));
    }
    Ok(0)
}

async fn rows(api: &Api, all: bool) -> Result<Vec<Row>> {
    let mut listed = Vec::new();
    let mut next: Option<String> = None;
    loop {
        let mut path = format!("/sandboxes?limit=100{}", if all { "" } else { "&state=running" });
        if let Some(t) = &next {
            path.push_str(&format!("&nextToken={}", cordon_envd::files::percent_encode(t)));
        }
        let (page, token) = api.json(hyper::Method::GET, &path, None).await?;
        listed.extend(page.as_array().cloned().unwrap_or_default());
        match token {
            Some(t) if next.as_ref() != Some(&t) => next = Some(t),
            _ => break,
        }
    }
    let now = SystemTime::now();
    // One sample per running sandbox, asked for all at once.
    let since = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut asks = tokio::task::JoinSet::new();
    for (i, s) in listed.iter().enumerate().filter(|(_, s)| s["state"] == "running") {
        let (api, id) = (api.clone(), s["sandboxID"].as_str().unwrap_or_default().to_string());
        asks.spawn(async move {
            // A sandbox that ended meanwhile has no figures.
            let v = api.get(&format!("/sandboxes/{id}/metrics?start={since}")).await.unwrap_or(Value::Null);
            (i, v.as_array().and_then(|a| a.last().cloned()).unwrap_or(Value::Null))
        });
    }
    let mut samples = vec![Value::Null; listed.len()];
    while let Some(Ok((i, v))) = asks.join_next().await {
        samples[i] = v;
    }
    Ok(listed.iter().zip(samples).map(|(s, m)| row(s, &m, now)).collect())
}

fn network(n: &Value) -> &'static str {
    let allow: Vec<&str> = n["allowOut"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    if allow.is_empty() {
        "closed"
    } else if allow.iter().any(|r| *r == "0.0.0.0/0" || *r == "::/0") {
        "open"
    } else {
        "allowlist"
    }
}

fn row(s: &Value, m: &Value, now: SystemTime) -> Row {
    let str_of = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let started = s["startedAt"].as_str().and_then(|t| Timestamp::parse_rfc3339(t).ok()).map(Timestamp::to_system_time);
    Row {
        id: str_of(&s["sandboxID"]),
        template: str_of(&s["templateID"]),
        tier: s["tier"].as_str().unwrap_or("ns").to_string(),
        state: str_of(&s["state"]),
        started_at: str_of(&s["startedAt"]),
        age_seconds: started.and_then(|t| now.duration_since(t).ok()).map_or(0, |d| d.as_secs()),
        cpu_pct: m["cpuUsedPct"].as_f64(),
        cpu_count: s["cpuCount"].as_u64().unwrap_or_default(),
        mem_used_bytes: m["memUsed"].as_u64(),
        mem_total_bytes: m["memTotal"].as_u64().unwrap_or_else(|| s["memoryMB"].as_u64().unwrap_or_default() << 20),
        network: network(&s["network"]),
    }
}

/// `3s`, `4m`, `2h`, `5d`: the largest unit that fits.
fn age(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn mib(b: u64) -> String {
    format!("{}M", (b + (1 << 19)) >> 20)
}

fn table(rows: &[Row]) -> String {
    let mut cells = vec![["ID", "TEMPLATE", "TIER", "STATE", "AGE", "CPU", "MEMORY", "NETWORK"].map(String::from).to_vec()];
    for r in rows {
        cells.push(vec![
            r.id.clone(),
            r.template.clone(),
            r.tier.clone(),
            r.state.clone(),
            age(r.age_seconds),
            r.cpu_pct.map_or("-".into(), |p| format!("{p:.1}%")),
            match r.mem_used_bytes {
                Some(u) => format!("{}/{}", mib(u), mib(r.mem_total_bytes)),
                None => format!("-/{}", mib(r.mem_total_bytes)),
            },
            r.network.to_string(),
        ]);
    }
    let widths: Vec<usize> = (0..cells[0].len()).map(|i| cells.iter().map(|c| c[i].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for c in &cells {
        let line: Vec<String> = c.iter().zip(&widths).map(|(v, w)| format!("{v:<w$}")).collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn network_kinds() {
        assert_eq!(network(&json!({"allowOut": [], "denyOut": ["1.1.1.1"]})), "closed");
        assert_eq!(network(&json!({"allowOut": ["0.0.0.0/0", "::/0"], "denyOut": ["10.0.0.0/8"]})), "open");
        assert_eq!(network(&json!({"allowOut": ["pypi.org"]})), "allowlist");
    }

    #[test]
    fn ages_and_table() {
        assert_eq!(age(59), "59s");
        assert_eq!(age(3600 * 5), "5h");
        let r = row(
            &json!({"sandboxID": "abc", "templateID": "base", "tier": "ns", "state": "running", "cpuCount": 1, "memoryMB": 512, "network": {"allowOut": []}}),
            &json!({"cpuUsedPct": 12.34, "memUsed": 10 << 20, "memTotal": 512 << 20}),
            SystemTime::now(),
        );
        let t = table(&[r]);
        assert!(t.lines().nth(1).is_some_and(|l| l.starts_with("abc") && l.contains("12.3%") && l.contains("10M/512M") && l.ends_with("closed")), "{t}");
    }
}
