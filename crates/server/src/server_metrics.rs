//! The server's own metrics for Prometheus (`GET /metrics`): what runs (sandboxes by state, tier
//! and template; pools), what happened (creates, failures by reason, ends by reason), how long it
//! took (create and command latency), and what the sandboxes' filters refused (denied syscalls,
//! egress flows blocked and allowed).
//!
//! Events are counted as they happen; gauges are read from the registry at each scrape. Totals
//! kept by each sandbox (its audit counts, its OOM kills) are summed over the live sandboxes plus
//! what the destroyed ones had at their end ([`Retired`]), under one lock with the removal, so
//! that a counter never goes down when a sandbox goes away.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::registry::{LiveSandbox, Sandboxes};

/// Why a sandbox ended: a label of `cordon_sandbox_ends_total`, and the words of its log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// `DELETE /sandboxes/{id}` (or a client's `kill()`).
    Api,
    /// Its deadline passed.
    Timeout,
    /// Its deadline passed and its lifecycle asked for a pause, which failed.
    PauseFailed,
    /// Its init ended by itself.
    Exited,
    /// Its init ended after the kernel's OOM killer acted in it.
    Oom,
    /// Paused for longer than `--paused-ttl`.
    PausedTtl,
    /// The server shut down.
    Shutdown,
}

impl EndReason {
    pub fn label(self) -> &'static str {
        match self {
            EndReason::Api => "api",
            EndReason::Timeout => "timeout",
            EndReason::PauseFailed => "pause_failed",
            EndReason::Exited => "exited",
            EndReason::Oom => "oom",
            EndReason::PausedTtl => "paused_ttl",
            EndReason::Shutdown => "shutdown",
        }
    }
}

impl std::fmt::Display for EndReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EndReason::Api => "killed by the API",
            EndReason::Timeout => "timeout",
            EndReason::PauseFailed => "timeout (the pause failed)",
            EndReason::Exited => "sandbox init exited",
            EndReason::Oom => "sandbox init exited after an out-of-memory kill",
            EndReason::PausedTtl => "paused for longer than --paused-ttl",
            EndReason::Shutdown => "server shutdown",
        })
    }
}

/// How a create got its sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Started for the create.
    Cold,
    /// Taken from a warm pool.
    Pool,
    /// A paused sandbox resumed, or a snapshot's or fork's files started.
    Restore,
}

impl Source {
    fn label(self) -> &'static str {
        match self {
            Source::Cold => "cold",
            Source::Pool => "pool",
            Source::Restore => "restore",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CreateLabels {
    tier: String,
    template: String,
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LatencyLabels {
    tier: String,
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    tier: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndLabels {
    tier: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
    tier: String,
    template: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    template: String,
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolStateLabels {
    template: String,
    tier: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabels {
    verdict: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SandboxLabels {
    sandbox_id: String,
    template: String,
    tier: String,
}

/// Latency buckets in seconds: a pooled create takes milliseconds, a VM's first create minutes.
const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The per-sandbox totals of sandboxes already destroyed.
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    denied_syscalls: u64,
    flows_allowed: u64,
    flows_blocked: u64,
    oom_kills: u64,
}

impl Totals {
    fn of(e: &LiveSandbox) -> Totals {
        let flows = e.flow_counts().unwrap_or_default();
        Totals {
            denied_syscalls: e.denials().iter().map(|d| d.count).sum(),
            flows_allowed: flows.allowed,
            flows_blocked: flows.blocked,
            oom_kills: e.oom_kills().unwrap_or(0),
        }
    }

    fn add(&mut self, o: Totals) {
        self.denied_syscalls += o.denied_syscalls;
        self.flows_allowed += o.flows_allowed;
        self.flows_blocked += o.flows_blocked;
        self.oom_kills += o.oom_kills;
    }
}

/// What the destroyed sandboxes had, held while a sandbox leaves the registry.
#[derive(Debug, Default)]
pub struct Retired(Mutex<Totals>);

impl Retired {
    /// Runs `remove` (which takes a sandbox out of the registry) and moves that sandbox's totals
    /// to the retired ones in the same step, as a scrape sees it.
    pub fn retire(
        &self,
        remove: impl FnOnce() -> Option<Arc<LiveSandbox>>,
    ) -> Option<Arc<LiveSandbox>> {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let gone = remove()?;
        g.add(Totals::of(&gone));
        Some(gone)
    }
}

/// The server's counters and histograms, and whether scrapes add per-sandbox series.
#[derive(Debug)]
pub struct ServerMetrics {
    creates: Family<CreateLabels, Counter>,
    create_failures: Family<FailureLabels, Counter>,
    ends: Family<EndLabels, Counter>,
    create_seconds: Family<LatencyLabels, Histogram, fn() -> Histogram>,
    command_seconds: Family<TierLabels, Histogram, fn() -> Histogram>,
    pub(crate) retired: Retired,
    /// `--metrics-per-sandbox`: CPU and memory series labelled with each sandbox's id (one
    /// series per sandbox ever seen by the scraper: opt-in for that reason).
    per_sandbox: std::sync::atomic::AtomicBool,
}

impl Default for ServerMetrics {
    fn default() -> ServerMetrics {
        ServerMetrics {
            creates: Family::default(),
            create_failures: Family::default(),
            ends: Family::default(),
            create_seconds: Family::new_with_constructor(latency_histogram),
            command_seconds: Family::new_with_constructor(latency_histogram),
            retired: Retired::default(),
            per_sandbox: Default::default(),
        }
    }
}

impl ServerMetrics {
    pub fn set_per_sandbox(&self, on: bool) {
        self.per_sandbox
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn created(&self, tier: cordon_spec::Tier, template: &str, source: Source, took: Duration) {
        let tier = tier.as_str().to_string();
        self.creates
            .get_or_create(&CreateLabels {
                tier: tier.clone(),
                template: template.to_string(),
                source: source.label().into(),
            })
            .inc();
        self.create_seconds
            .get_or_create(&LatencyLabels {
                tier,
                source: source.label().into(),
            })
            .observe(took.as_secs_f64());
    }

    /// A create that failed, by its answer's status: `bad_request` (what was asked cannot be
    /// made), `not_found` (no such template), `limit` (the concurrency limit), `failed` (the
    /// server or the tier failed).
    pub fn create_failed(&self, tier: cordon_spec::Tier, status: hyper::StatusCode) {
        let reason = match status.as_u16() {
            404 => "not_found",
            429 => "limit",
            400..=499 => "bad_request",
            _ => "failed",
        };
        self.create_failures
            .get_or_create(&FailureLabels {
                tier: tier.as_str().into(),
                reason: reason.into(),
            })
            .inc();
    }

    pub fn ended(&self, tier: cordon_spec::Tier, reason: EndReason) {
        self.ends
            .get_or_create(&EndLabels {
                tier: tier.as_str().into(),
                reason: reason.label().into(),
            })
            .inc();
    }

    /// One envd command (`process.Process/Start`) from its request to the end of its stream.
    pub fn command(&self, tier: cordon_spec::Tier, took: Duration) {
        self.command_seconds
            .get_or_create(&TierLabels {
                tier: tier.as_str().into(),
            })
            .observe(took.as_secs_f64());
    }

    /// The text exposition of every metric now: OpenMetrics when `openmetrics`, else the
    /// Prometheus text format (0.0.4).
    pub fn render(&self, sandboxes: &Sandboxes, openmetrics: bool) -> String {
        let mut reg = Registry::with_prefix("cordon");
        reg.register(
            "sandbox_creates",
            "Sandboxes created, by tier, template and how (cold, pool, restore)",
            self.creates.clone(),
        );
        reg.register(
            "sandbox_create_failures",
            "Creates that failed, by tier and reason (bad_request, not_found, limit, failed)",
            self.create_failures.clone(),
        );
        reg.register("sandbox_ends", "Sandboxes ended, by tier and reason (api, timeout, pause_failed, exited, oom, paused_ttl, shutdown)", self.ends.clone());
        reg.register(
            "sandbox_create_seconds",
            "Time from a create's request to its sandbox answering, by tier and how",
            self.create_seconds.clone(),
        );
        reg.register(
            "command_seconds",
            "Time from an envd process start to the end of its stream, by tier",
            self.command_seconds.clone(),
        );

        // The live state and the sandboxes' own totals, read together with the retired ones.
        let (live, totals) = {
            let g = self.retired.0.lock().unwrap_or_else(|p| p.into_inner());
            let live = sandboxes.all();
            let mut t = *g;
            for e in &live {
                t.add(Totals::of(e));
            }
            (live, t)
        };
        let by_state: Family<StateLabels, Gauge> = Family::default();
        for e in &live {
            let state = if e.frozen_at().is_some() {
                "paused"
            } else {
                "running"
            };
            by_state
                .get_or_create(&StateLabels {
                    state: state.into(),
                    tier: e.tier.as_str().into(),
                    template: e.template.clone(),
                })
                .inc();
        }
        // Paused to its files: a record, no process (a paused-in-place one is live, frozen).
        if let Some(saved) = &sandboxes.saved {
            for r in saved.all() {
                by_state
                    .get_or_create(&StateLabels {
                        state: "paused".into(),
                        tier: r.tier.as_str().into(),
                        template: r.template.clone(),
                    })
                    .inc();
            }
        }
        reg.register(
            "sandboxes",
            "Sandboxes now, by state (running, paused), tier and template",
            by_state,
        );
        reg.register(
            "sandboxes_max",
            "The concurrency limit (--max-sandboxes)",
            ConstGauge::new(sandboxes.max() as i64),
        );

        reg.register(
            "denied_syscalls",
            "System calls the sandboxes' filters denied",
            ConstCounter::new(totals.denied_syscalls),
        );
        let flows: Family<VerdictLabels, Counter> = Family::default();
        flows
            .get_or_create(&VerdictLabels {
                verdict: "allowed".into(),
            })
            .inc_by(totals.flows_allowed);
        flows
            .get_or_create(&VerdictLabels {
                verdict: "blocked".into(),
            })
            .inc_by(totals.flows_blocked);
        reg.register(
            "egress_flows",
            "Egress attempts by verdict: TCP connections let out, and attempts the policy refused",
            flows,
        );
        reg.register(
            "oom_kills",
            "Processes the kernel's OOM killer ended inside sandboxes",
            ConstCounter::new(totals.oom_kills),
        );

        if let Some(pools) = sandboxes.pools.get() {
            let size: Family<PoolLabels, Gauge> = Family::default();
            let waiting: Family<PoolStateLabels, Gauge> = Family::default();
            let taken: Family<PoolLabels, Counter> = Family::default();
            let missed: Family<PoolLabels, Counter> = Family::default();
            let memory: Family<PoolLabels, Gauge> = Family::default();
            for p in pools.counts() {
                let l = PoolLabels {
                    template: p.template.clone(),
                    tier: p.tier.as_str().into(),
                };
                size.get_or_create(&l).set(p.size as i64);
                let state = |s: &str| PoolStateLabels {
                    template: p.template.clone(),
                    tier: p.tier.as_str().into(),
                    state: s.into(),
                };
                waiting.get_or_create(&state("ready")).set(p.ready as i64);
                waiting
                    .get_or_create(&state("starting"))
                    .set(p.starting as i64);
                taken.get_or_create(&l).inc_by(p.taken as u64);
                missed.get_or_create(&l).inc_by(p.missed as u64);
                memory.get_or_create(&l).set(p.memory as i64);
            }
            reg.register("pool_size", "Sandboxes each warm pool keeps (--pool)", size);
            reg.register(
                "pool_sandboxes",
                "Sandboxes waiting in each pool, ready or starting",
                waiting,
            );
            reg.register("pool_taken", "Creates given a pooled sandbox", taken);
            reg.register(
                "pool_missed",
                "Creates that matched a pool while it was empty",
                missed,
            );
            reg.register(
                "pool_memory_bytes",
                "Memory the waiting sandboxes of each pool use",
                memory,
            );
        }

        if self.per_sandbox.load(std::sync::atomic::Ordering::Relaxed) {
            let cpu: Family<SandboxLabels, Counter<f64>> = Family::default();
            let mem: Family<SandboxLabels, Gauge> = Family::default();
            for e in &live {
                let l = SandboxLabels {
                    sandbox_id: e.id.clone(),
                    template: e.template.clone(),
                    tier: e.tier.as_str().into(),
                };
                if let Some(us) = e.cpu_usage_usec() {
                    cpu.get_or_create(&l).inc_by(us as f64 / 1e6);
                }
                if let Some(b) = e.memory_current() {
                    mem.get_or_create(&l).set(b as i64);
                }
            }
            reg.register(
                "sandbox_cpu_seconds",
                "CPU time each live sandbox used (--metrics-per-sandbox)",
                cpu,
            );
            reg.register(
                "sandbox_memory_bytes",
                "Memory each live sandbox uses now (--metrics-per-sandbox)",
                mem,
            );
        }
        let up = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        reg.register(
            "scrape_timestamp_seconds",
            "When this scrape was rendered (unix seconds)",
            ConstGauge::new(up.as_secs_f64()),
        );

        let mut out = String::new();
        let r = if openmetrics {
            prometheus_client::encoding::text::encode(&mut out, &reg)
        } else {
            prometheus_client::encoding::prometheus_text::encode(&mut out, &reg)
        };
        // Writing to a String cannot fail; an encoder error would be a bug in a label.
        if let Err(e) = r {
            tracing::warn!("metrics: {e}");
        }
        out
    }
}

/// Whether a scraper asked for OpenMetrics (its `Accept`), as Prometheus does when it can.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| a.contains("application/openmetrics-text"))
}

/// The content type of [`ServerMetrics::render`]'s output.
pub fn content_type(openmetrics: bool) -> &'static str {
    if openmetrics {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        prometheus_client::encoding::prometheus_text::CONTENT_TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_reasons_have_distinct_labels() {
        let all = [
            EndReason::Api,
            EndReason::Timeout,
            EndReason::PauseFailed,
            EndReason::Exited,
            EndReason::Oom,
            EndReason::PausedTtl,
            EndReason::Shutdown,
        ];
        let labels: std::collections::BTreeSet<_> = all.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), all.len());
        assert_eq!(EndReason::Api.to_string(), "killed by the API");
    }

    #[test]
    fn openmetrics_only_when_asked() {
        assert!(wants_openmetrics(Some(
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        )));
        assert!(!wants_openmetrics(Some("text/plain")));
        assert!(!wants_openmetrics(None));
    }
}
