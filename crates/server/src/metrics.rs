//! Each live sandbox's metrics history, for `GET /sandboxes/{id}/metrics?start=&end=`: one
//! reading every [`INTERVAL`] (E2B's collection bucket is 5 s too), the last [`KEPT`] of them
//! (an hour), plus one taken when asked. CPU is the share of the sandbox's cores used over the
//! window before a reading: from the latest earlier reading at least one interval older (or the
//! sandbox's start), so a reading taken just after another still covers a whole interval.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::registry::LiveSandbox;

/// How often a live sandbox is read.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// How many readings are kept: an hour's worth.
pub const KEPT: usize = 720;

/// What the sandbox's tier told at one moment (`None`: it cannot tell).
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    pub at: SystemTime,
    pub cpu_usec: Option<u64>,
    pub mem_used: Option<u64>,
    pub disk: Option<(u64, u64)>,
}

/// The kept readings of one sandbox, oldest first.
#[derive(Debug, Default)]
pub struct History(Mutex<VecDeque<Reading>>);

impl History {
    pub fn record(&self, r: Reading) {
        let mut h = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if h.len() == KEPT {
            h.pop_front();
        }
        h.push_back(r);
    }

    fn readings(&self) -> Vec<Reading> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect()
    }
}

/// A reading of `e` now.
pub fn read(e: &LiveSandbox) -> Reading {
    Reading { at: SystemTime::now(), cpu_usec: e.cpu_usage_usec(), mem_used: e.memory_current(), disk: e.disk_usage() }
}

/// Unix seconds of `t`.
fn unix(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The samples of `e` whose time (in unix seconds) lies in `[start, end]`, oldest first, with a
/// fresh reading at the end when now is in range. A range that ends before the sandbox
/// existed is empty.
pub fn samples(e: &LiveSandbox, start: Option<i64>, end: Option<i64>) -> Vec<Value> {
    let mut all = e.metrics.readings();
    all.push(read(e));
    let in_range = |r: &Reading| start.is_none_or(|s| unix(r.at) >= s) && end.is_none_or(|t| unix(r.at) <= t);
    (0..all.len()).filter(|&i| in_range(&all[i])).map(|i| sample_json(e, &all[..=i])).collect()
}

/// The last of `upto` as E2B's `SandboxMetric`; the readings before it give its CPU window.
fn sample_json(e: &LiveSandbox, upto: &[Reading]) -> Value {
    let r = upto[upto.len() - 1];
    let from = upto[..upto.len() - 1]
        .iter()
        .rev()
        .find(|p| r.at.duration_since(p.at).is_ok_and(|d| d >= INTERVAL))
        .map(|p| (p.at, p.cpu_usec.unwrap_or(0)))
        .unwrap_or((e.started_at, 0));
    let window_us = r.at.duration_since(from.0).map_or(0, |d| d.as_micros() as u64).max(1);
    let used_us = r.cpu_usec.unwrap_or(0).saturating_sub(from.1);
    let cpu_pct = used_us as f64 * 100.0 / (window_us as f64 * f64::from(e.cpu_count.max(1)));
    // E2B's metrics are numbers, so a figure this host cannot read is sent as 0 (the disk's
    // total as the cap it was given).
    let (disk_used, disk_total) = r.disk.unwrap_or((0, 0));
    json!({
        "timestamp": crate::api::iso(r.at),
        "timestampUnix": unix(r.at),
        "cpuCount": e.cpu_count,
        "cpuUsedPct": (cpu_pct * 100.0).round() / 100.0,
        "memUsed": r.mem_used.unwrap_or(0),
        "memTotal": e.memory_mb << 20,
        "memCache": 0,
        "diskUsed": disk_used,
        "diskTotal": if disk_total > 0 { disk_total } else { e.disk_mb << 20 },
    })
}
