//! The forwarder's CPU counts against its sandbox's `--cpus`.
//!
//! Each sandbox's forwarder runs on a thread of its own (with a single-threaded runtime, so
//! every task of its flows, DNS questions and upstream connections runs there too). Where the
//! sandbox's CPU quota is a v1 `cpu` group, that thread joins the group and the kernel's
//! scheduler caps the sandbox and its forwarder together ([`CpuCharge::group`]). A v2 group
//! cannot hold one thread of another process, so there the forwarder keeps itself within the
//! sandbox's quota on its own clock ([`Budget`]): whatever the sandbox sends, the forwarder
//! spends at most `--cpus` more of the host on it.

use std::time::{Duration, Instant};

/// How the forwarder's CPU is bounded.
#[derive(Debug, Clone)]
pub struct CpuCharge {
    /// The sandbox's quota, in CPUs.
    pub cpus: f64,
    /// The sandbox's own CPU group, when it can take the forwarder's thread (its quota then
    /// covers both). Without one, or if joining it fails, the forwarder holds itself to `cpus`.
    pub group: Option<cordon_host::ThreadCharge>,
}

/// How often the budget looks at the thread's clock.
const TICK: Duration = Duration::from_millis(10);
/// Credit a budget can save up, in periods of [`PERIOD`] at its rate (as a CFS quota runs a
/// period's worth at most before it is throttled).
const PERIOD: Duration = Duration::from_millis(100);

/// A token bucket over the forwarder thread's CPU clock: credit grows at `cpus` seconds per
/// second of wall time up to one period's worth, each tick spends what the thread used, and a
/// debt is paid by stopping the thread (its whole runtime) for as long as the rate takes to
/// cover it.
#[derive(Debug)]
pub(crate) struct Budget {
    cpus: f64,
    credit: f64,
    wall: Instant,
    cpu: Duration,
}

impl Budget {
    pub(crate) fn new(cpus: f64, now: Instant, cpu: Duration) -> Budget {
        Budget { cpus, credit: cpus * PERIOD.as_secs_f64(), wall: now, cpu }
    }

    /// Books the wall and thread time since the last tick; how long to stop, if in debt.
    pub(crate) fn tick(&mut self, now: Instant, cpu: Duration) -> Option<Duration> {
        let earned = self.cpus * now.saturating_duration_since(self.wall).as_secs_f64();
        let spent = cpu.saturating_sub(self.cpu).as_secs_f64();
        (self.wall, self.cpu) = (now, cpu);
        self.credit = (self.credit + earned - spent).min(self.cpus * PERIOD.as_secs_f64());
        (self.credit < 0.0).then(|| Duration::from_secs_f64(-self.credit / self.cpus))
    }
}

/// CPU time of the calling thread.
pub(crate) fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to the valid pointer given.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Keeps the calling thread within `cpus`. Runs as a task on the forwarder's single-threaded
/// runtime: the stop is a blocking sleep on purpose, since stopping the whole runtime (every
/// flow of this sandbox, nobody else's) is what throttling it means.
pub(crate) async fn enforce(cpus: f64) {
    let mut budget = Budget::new(cpus, Instant::now(), thread_cpu());
    loop {
        tokio::time::sleep(TICK).await;
        if let Some(pause) = budget.tick(Instant::now(), thread_cpu()) {
            std::thread::sleep(pause);
            // The pause itself earns credit at the next tick, which is what pays the debt.
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_stops_for_the_debt_and_saves_up_one_period_at_most() {
        let t0 = Instant::now();
        let mut b = Budget::new(0.1, t0, Duration::ZERO);
        // 10 ms of CPU in 10 ms of wall at 0.1 CPUs: 1 ms earned, 10 spent, 10 ms of credit
        // to start with: 1 ms left, no stop.
        assert_eq!(b.tick(t0 + Duration::from_millis(10), Duration::from_millis(10)), None);
        // 11 ms more in the next 10 ms: 1 ms earned, 9 ms short, paid by 90 ms at 0.1.
        let stop = b.tick(t0 + Duration::from_millis(20), Duration::from_millis(21)).unwrap();
        assert!((stop.as_secs_f64() - 0.09).abs() < 1e-6, "{stop:?}");
        // The stop earns back the debt; an idle hour saves up only one period's worth.
        assert_eq!(b.tick(t0 + Duration::from_secs(3600), Duration::from_millis(21)), None);
        assert!((b.credit - 0.01).abs() < 1e-9, "{b:?}");
    }

    /// A forwarder thread that would spin a whole core stays within its budget, measured on
    /// the thread's own clock against the wall time it ran.
    #[test]
    fn a_busy_runtime_is_held_to_its_budget() {
        let cpus = 0.2;
        let (cpu, wall) = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            let (t0, c0) = (Instant::now(), thread_cpu());
            rt.block_on(async {
                tokio::spawn(enforce(cpus));
                let stop = Instant::now() + Duration::from_secs(2);
                while Instant::now() < stop {
                    tokio::task::yield_now().await;
                }
            });
            (thread_cpu() - c0, t0.elapsed())
        })
        .join()
        .unwrap();
        let allowed = cpus * wall.as_secs_f64() + cpus * PERIOD.as_secs_f64() + TICK.as_secs_f64();
        assert!(cpu.as_secs_f64() <= allowed * 1.1, "spent {cpu:?} in {wall:?} at {cpus} CPUs (allowed {allowed:.3}s)");
        // And it did run: the budget is a cap, not a stop.
        assert!(cpu.as_secs_f64() >= 0.25 * cpus * wall.as_secs_f64(), "spent only {cpu:?} in {wall:?}");
    }
}
