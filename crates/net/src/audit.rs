//! The sandbox's record of blocked network attempts (what, where, which name, why, how often)
//! and of the headers the forwarder injected (host, header name, how often; never a value).

use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One kind of blocked attempt, counted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Blocked {
    /// `tcp`, `udp`, `dns` or the IP protocol's name (`icmp`, `icmpv6`, ...).
    pub proto: String,
    /// The address the sandbox sent to (`ip:port`, or `ip` for protocols without ports).
    pub destination: String,
    /// The host name involved (TLS SNI, HTTP Host, DNS question), if any.
    pub name: Option<String>,
    pub reason: String,
    pub count: u64,
}

/// Distinct attempts kept; beyond this only counts of known ones grow, so a flood inside the
/// sandbox cannot grow the host's memory.
const MAX_ENTRIES: usize = 4096;

/// What identifies one kind of refusal, so repeats count instead of adding an entry.
type Key = (String, String, Option<String>, String);

/// Requests given a rule's header, counted per host and header name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Injected {
    pub host: String,
    pub header: String,
    pub count: u64,
}

/// Connections (and DNS questions, and other packets) counted since the forwarder started:
/// totals that keep growing after [`MAX_ENTRIES`] distinct refusals are kept, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FlowCounts {
    /// TCP connections the policy let out.
    pub allowed: u64,
    /// Attempts the policy (or a limit of the forwarder) refused.
    pub blocked: u64,
}

#[derive(Default)]
pub struct AuditLog {
    entries: Mutex<(Vec<Blocked>, HashMap<Key, usize>)>,
    injections: Mutex<std::collections::BTreeMap<(String, String), u64>>,
    allowed: AtomicU64,
    blocked: AtomicU64,
}

impl AuditLog {
    pub fn record(&self, proto: &str, destination: String, name: Option<String>, reason: String) {
        tracing::debug!(proto, %destination, ?name, %reason, "egress blocked");
        self.blocked.fetch_add(1, Ordering::Relaxed);
        let mut g = self.entries.lock().expect("audit lock");
        let (list, index) = &mut *g;
        let key = (proto.to_string(), destination, name, reason);
        if let Some(&i) = index.get(&key) {
            list[i].count += 1;
            return;
        }
        if list.len() >= MAX_ENTRIES {
            return;
        }
        index.insert(key.clone(), list.len());
        list.push(Blocked { proto: key.0, destination: key.1, name: key.2, reason: key.3, count: 1 });
    }

    /// Counts one injection of `header` into a request to `host`. Hosts are the names of
    /// connections the rules matched (at most a rule's wildcard's worth); beyond
    /// [`MAX_ENTRIES`] pairs only known ones count.
    pub fn injected(&self, host: &str, header: &str) {
        let mut g = self.injections.lock().expect("audit lock");
        let key = (host.to_string(), header.to_ascii_lowercase());
        if let Some(n) = g.get_mut(&key) {
            *n += 1;
        } else if g.len() < MAX_ENTRIES {
            g.insert(key, 1);
        }
    }

    /// Counts one connection the policy let out.
    pub fn allowed(&self) {
        self.allowed.fetch_add(1, Ordering::Relaxed);
    }

    pub fn counts(&self) -> FlowCounts {
        FlowCounts { allowed: self.allowed.load(Ordering::Relaxed), blocked: self.blocked.load(Ordering::Relaxed) }
    }

    pub fn injections(&self) -> Vec<Injected> {
        self.injections.lock().expect("audit lock").iter().map(|((host, header), n)| Injected { host: host.clone(), header: header.clone(), count: *n }).collect()
    }

    pub fn snapshot(&self) -> Vec<Blocked> {
        self.entries.lock().expect("audit lock").0.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_repeats_once() {
        let log = AuditLog::default();
        for _ in 0..3 {
            log.record("tcp", "198.51.100.9:80".into(), None, "no rule".into());
        }
        log.record("dns", "10.0.2.1:53".into(), Some("x.test".into()), "no rule".into());
        let s = log.snapshot();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].count, 3);
        assert_eq!(s[1].name.as_deref(), Some("x.test"));
        log.allowed();
        assert_eq!(log.counts(), FlowCounts { allowed: 1, blocked: 4 });
    }

    #[test]
    fn totals_grow_past_the_kept_entries() {
        let log = AuditLog::default();
        for i in 0..MAX_ENTRIES + 10 {
            log.record("tcp", format!("198.51.100.{}:{}", i % 250, 1000 + i), None, "no rule".into());
        }
        assert_eq!(log.snapshot().len(), MAX_ENTRIES);
        assert_eq!(log.counts().blocked, (MAX_ENTRIES + 10) as u64);
    }
}
