//! `CORDON_TRACE=1`: when each phase of a command ended, printed to stderr as it exits.
//!
//! The front end starts the clock and prints the table; any layer below marks the phases it
//! owns (a tier's steps inside `create`, say). Marks cost an `Instant::now()` and a push when
//! tracing is on and nothing when it is off; the table is printed once, after everything the
//! caller waits for (teardown included), so the steps add up to what a stopwatch around the
//! process sees, less its exec and exit. `RUST_LOG=debug` shows the same phases as they happen.

use std::borrow::Cow;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

struct Trace {
    start: Instant,
    marks: Mutex<Vec<(Cow<'static, str>, Instant)>>,
    notes: Mutex<Vec<String>>,
}

static TRACE: OnceLock<Option<Trace>> = OnceLock::new();

/// Marks (and notes) kept at most: a one-shot run makes about ten.
const MAX_LINES: usize = 1000;

fn on() -> Option<&'static Trace> {
    TRACE.get().and_then(Option::as_ref)
}

/// Reads `CORDON_TRACE` and starts the clock; called first thing in `main`.
pub fn start() {
    TRACE.get_or_init(|| {
        std::env::var_os("CORDON_TRACE").is_some_and(|v| v == "1").then(|| Trace {
            start: Instant::now(),
            marks: Mutex::new(Vec::new()),
            notes: Mutex::new(Vec::new()),
        })
    });
}

/// Whether marks are being kept (to skip building a note nobody reads).
pub fn enabled() -> bool {
    on().is_some()
}

/// Records that the phase named `what` ended now.
pub fn mark(what: impl Into<Cow<'static, str>>) {
    if let Some(t) = on() {
        let mut marks = t.marks.lock().unwrap_or_else(|e| e.into_inner());
        // A server run with tracing on marks every create until it exits: keep the first ones.
        if marks.len() < MAX_LINES {
            marks.push((what.into(), Instant::now()));
        }
    }
}

/// A line printed under the table: a phase's own breakdown that another clock measured (a
/// child process's, say), which cannot be placed on this one exactly.
pub fn note(line: String) {
    if let Some(t) = on() {
        let mut notes = t.notes.lock().unwrap_or_else(|e| e.into_inner());
        if notes.len() < MAX_LINES {
            notes.push(line);
        }
    }
}

/// Prints the phases, each with when it ended and how long it took, then the notes, to stderr.
pub fn print() {
    let Some(t) = on() else { return };
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let mut last = t.start;
    for (what, at) in t.marks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        eprintln!("cordon: trace {:>8.2} ms  {:>+8.2} ms  {what}", ms(*at - t.start), ms(*at - last));
        last = *at;
    }
    for line in t.notes.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        eprintln!("cordon: trace: {line}");
    }
}
