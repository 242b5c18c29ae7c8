//! `CORDON_TRACE=1`: when each phase of a command ended, printed to stderr as it exits.
//!
//! Marks cost an `Instant::now()` and a push when tracing is on and nothing when it is off; the
//! table is printed once, after everything the caller waits for (teardown included), so the
//! figures add up to what a stopwatch around the process sees, less its exec and exit.
//! `RUST_LOG=debug` shows the phases inside each tier (the jailer's, the VMM's) as they happen.

use std::sync::{Mutex, OnceLock};
use std::time::Instant;

struct Trace {
    start: Instant,
    marks: Mutex<Vec<(&'static str, Instant)>>,
}

static TRACE: OnceLock<Option<Trace>> = OnceLock::new();

/// Reads `CORDON_TRACE` and starts the clock; called first thing in `main`.
pub fn start() {
    TRACE.get_or_init(|| {
        (std::env::var_os("CORDON_TRACE").is_some_and(|v| v == "1")).then(|| Trace { start: Instant::now(), marks: Mutex::new(Vec::new()) })
    });
}

/// Records that the phase named `what` ended now.
pub fn mark(what: &'static str) {
    if let Some(Some(t)) = TRACE.get() {
        t.marks.lock().unwrap_or_else(|e| e.into_inner()).push((what, Instant::now()));
    }
}

/// Prints the phases, each with when it ended and how long it took, to stderr.
pub fn print() {
    let Some(Some(t)) = TRACE.get() else { return };
    let marks = t.marks.lock().unwrap_or_else(|e| e.into_inner());
    let mut last = t.start;
    for (what, at) in marks.iter() {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        eprintln!("cordon: trace {:>8.2} ms  {:>+8.2} ms  {what}", ms(*at - t.start), ms(*at - last));
        last = *at;
    }
}
