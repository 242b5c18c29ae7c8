//! What a sandbox's start command printed (the template's service: the code interpreter's
//! server, an app's `set_start_cmd`), kept for E2B's `GET /sandboxes/{id}/logs` and
//! `GET /v2/sandboxes/{id}/logs`.
//!
//! The output is the sandbox's, so it is held in a ring bounded by lines and bytes, and each
//! line is bounded in length: a chatty or hostile service costs the server a fixed amount of
//! memory, its oldest lines going first.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::error::ApiError;
use crate::query;

/// Lines kept per sandbox.
pub const MAX_LINES: usize = 1000;
/// Bytes of text kept per sandbox.
pub const MAX_BYTES: usize = 1 << 20;
/// The longest line kept whole; a longer one is kept as pieces of at most this many bytes.
pub const MAX_LINE: usize = 8 << 10;
/// E2B's default and largest page.
const MAX_LIMIT: usize = 1000;
/// E2B's bound on a v2 `search`.
const MAX_SEARCH: usize = 256;

/// Which of the process's outputs a line came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }

    /// E2B's level of a line: what the service wrote to stderr counts as an error.
    fn level(self) -> Level {
        match self {
            Stream::Stdout => Level::Info,
            Stream::Stderr => Level::Error,
        }
    }
}

/// E2B's log levels, lowest first (a v2 `level` is the minimum).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        }
    }

    fn parse(s: &str) -> Option<Level> {
        [Level::Debug, Level::Info, Level::Warn, Level::Error].into_iter().find(|l| l.name() == s)
    }
}

/// One line, as it came, stamped with when it was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLine {
    /// Milliseconds since the epoch: the precision E2B's cursors have.
    pub ms: u64,
    pub stream: Stream,
    pub text: String,
}

impl LogLine {
    fn level(&self) -> Level {
        self.stream.level()
    }

    fn timestamp(&self) -> String {
        crate::api::iso(UNIX_EPOCH + Duration::from_millis(self.ms))
    }

    /// E2B's `SandboxLogEntry`.
    fn entry(&self) -> Value {
        json!({
            "timestamp": self.timestamp(),
            "message": self.text,
            "level": self.level().name(),
            "fields": {"stream": self.stream.name(), "logger": "start"},
        })
    }

    /// E2B's `SandboxLog`: `line` is a JSON object, which the E2B CLI parses for its `level`.
    fn v1(&self) -> Value {
        let line = json!({"level": self.level().name(), "logger": "start", "message": self.text, "stream": self.stream.name()});
        json!({"timestamp": self.timestamp(), "line": line.to_string()})
    }
}

#[derive(Default)]
struct Ring {
    lines: VecDeque<LogLine>,
    bytes: usize,
    /// Each stream's unfinished line (at most [`MAX_LINE`] bytes).
    partial: [Vec<u8>; 2],
    last_ms: u64,
}

impl Ring {
    fn keep(&mut self, stream: Stream, bytes: &[u8], now_ms: u64) {
        // Never backwards, whatever the clock does: readers page by timestamp.
        self.last_ms = self.last_ms.max(now_ms);
        let text = String::from_utf8_lossy(bytes).into_owned();
        self.bytes += text.len();
        self.lines.push_back(LogLine { ms: self.last_ms, stream, text });
        while self.lines.len() > MAX_LINES || self.bytes > MAX_BYTES {
            let Some(old) = self.lines.pop_front() else { break };
            self.bytes -= old.text.len();
        }
    }

    fn push(&mut self, stream: Stream, mut data: &[u8], now_ms: u64) {
        let i = stream.index();
        while !data.is_empty() {
            let room = MAX_LINE - self.partial[i].len();
            match data.iter().take(room + 1).position(|&b| b == b'\n') {
                Some(n) => {
                    let mut line = std::mem::take(&mut self.partial[i]);
                    line.extend_from_slice(&data[..n]);
                    if line.last() == Some(&b'\r') {
                        line.pop();
                    }
                    self.keep(stream, &line, now_ms);
                    data = &data[n + 1..];
                }
                None if data.len() < room => {
                    self.partial[i].extend_from_slice(data);
                    data = &[];
                }
                None => {
                    // A line this long is kept in pieces, each cut where a character ends.
                    let mut cut = room;
                    let mut whole = std::mem::take(&mut self.partial[i]);
                    while cut > 0 && cut < data.len() && (data[cut] & 0xC0) == 0x80 && room - cut < 4 {
                        cut -= 1;
                    }
                    whole.extend_from_slice(&data[..cut]);
                    self.keep(stream, &whole, now_ms);
                    data = &data[cut..];
                }
            }
        }
    }
}

/// One sandbox's start command output.
#[derive(Default)]
pub struct SandboxLogs {
    ring: Mutex<Ring>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl SandboxLogs {
    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Output as it arrives: complete lines are kept at once, the rest waits for its end.
    pub fn push(&self, stream: Stream, data: &[u8]) {
        self.ring().push(stream, data, now_ms());
    }

    /// The process ended: what it left unfinished is a line too.
    pub fn finish(&self) {
        let mut r = self.ring();
        let now = now_ms();
        for stream in [Stream::Stdout, Stream::Stderr] {
            let rest = std::mem::take(&mut r.partial[stream.index()]);
            if !rest.is_empty() {
                r.keep(stream, &rest, now);
            }
        }
    }

    /// The kept lines, oldest first.
    pub fn lines(&self) -> Vec<LogLine> {
        self.ring().lines.iter().cloned().collect()
    }

    /// The lines from `start_ms` on, oldest first, at most `limit`.
    pub fn since(&self, start_ms: u64, limit: usize) -> Vec<LogLine> {
        self.ring().lines.iter().filter(|l| l.ms >= start_ms).take(limit).cloned().collect()
    }

    /// A v2 query's lines, in its direction.
    pub fn query(&self, q: &V2Query) -> Vec<LogLine> {
        let r = self.ring();
        let wanted = |l: &&LogLine| l.level() >= q.level && q.search.as_deref().is_none_or(|s| l.text.contains(s));
        if q.backward {
            let cursor = q.cursor.unwrap_or(u64::MAX);
            r.lines.iter().rev().filter(|l| l.ms <= cursor).filter(wanted).take(q.limit).cloned().collect()
        } else {
            let cursor = q.cursor.unwrap_or(0);
            r.lines.iter().filter(|l| l.ms >= cursor).filter(wanted).take(q.limit).cloned().collect()
        }
    }
}

/// `GET /v2/sandboxes/{id}/logs`'s parameters.
#[derive(Debug, PartialEq, Eq)]
pub struct V2Query {
    pub cursor: Option<u64>,
    pub limit: usize,
    /// Newest first, from the cursor back.
    pub backward: bool,
    /// The lowest level returned.
    pub level: Level,
    /// A case-sensitive substring of the message.
    pub search: Option<String>,
}

fn number(q: Option<&str>, key: &str) -> Result<Option<u64>, ApiError> {
    query::get(q, key)
        .filter(|v| !v.is_empty())
        .map(|v| v.parse::<u64>().map_err(|_| ApiError::bad_request(format!("{key} {v:?} is not a time in milliseconds since the epoch"))))
        .transpose()
}

fn limit(q: Option<&str>) -> Result<usize, ApiError> {
    match query::get(q, "limit").filter(|v| !v.is_empty()) {
        None => Ok(MAX_LIMIT),
        Some(l) => match l.parse::<usize>() {
            Ok(n) if n <= MAX_LIMIT => Ok(n),
            _ => Err(ApiError::bad_request(format!("limit {l:?} is out of range: use 0 to {MAX_LIMIT}"))),
        },
    }
}

impl V2Query {
    pub fn parse(q: Option<&str>) -> Result<V2Query, ApiError> {
        let backward = match query::get(q, "direction").as_deref() {
            None | Some("") | Some("forward") => false,
            Some("backward") => true,
            Some(d) => return Err(ApiError::bad_request(format!("direction {d:?} is unknown: use forward or backward"))),
        };
        let level = match query::get(q, "level").filter(|v| !v.is_empty()) {
            None => Level::Debug,
            Some(l) => Level::parse(&l).ok_or_else(|| ApiError::bad_request(format!("level {l:?} is unknown: use debug, info, warn or error")))?,
        };
        let search = query::get(q, "search").filter(|s| !s.is_empty());
        if search.as_ref().is_some_and(|s| s.len() > MAX_SEARCH) {
            return Err(ApiError::bad_request(format!("search is longer than {MAX_SEARCH} bytes")));
        }
        Ok(V2Query { cursor: number(q, "cursor")?, limit: limit(q)?, backward, level, search })
    }
}

/// The answer to `GET /sandboxes/{id}/logs` (`v2` false: `?start&limit`, `{logs, logEntries}`)
/// or `GET /v2/sandboxes/{id}/logs` (`{logs: [entry]}`).
pub fn answer(logs: &SandboxLogs, v2: bool, q: Option<&str>) -> Result<Value, ApiError> {
    if v2 {
        let q = V2Query::parse(q)?;
        return Ok(json!({"logs": logs.query(&q).iter().map(LogLine::entry).collect::<Vec<_>>()}));
    }
    let lines = logs.since(number(q, "start")?.unwrap_or(0), limit(q)?);
    Ok(json!({
        "logs": lines.iter().map(LogLine::v1).collect::<Vec<_>>(),
        "logEntries": lines.iter().map(LogLine::entry).collect::<Vec<_>>(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(r: &Ring) -> Vec<String> {
        r.lines.iter().map(|l| l.text.clone()).collect()
    }

    #[test]
    fn lines_are_split_and_kept_in_order_per_stream() {
        let mut r = Ring::default();
        r.push(Stream::Stdout, b"one\ntw", 1);
        r.push(Stream::Stderr, b"err\r\n", 2);
        r.push(Stream::Stdout, b"o\nthree\n", 3);
        assert_eq!(texts(&r), ["one", "err", "two", "three"]);
        assert_eq!(r.lines[1].stream, Stream::Stderr);
        assert_eq!(r.lines.iter().map(|l| l.ms).collect::<Vec<_>>(), [1, 2, 3, 3]);
    }

    #[test]
    fn the_ring_is_bounded_by_lines_and_keeps_the_newest() {
        let mut r = Ring::default();
        for i in 0..MAX_LINES + 10 {
            r.push(Stream::Stdout, format!("line {i}\n").as_bytes(), i as u64);
        }
        assert_eq!(r.lines.len(), MAX_LINES);
        assert_eq!(r.lines[0].text, "line 10");
        assert_eq!(r.lines.back().map(|l| l.text.as_str()), Some(format!("line {}", MAX_LINES + 9).as_str()));
        assert_eq!(r.bytes, r.lines.iter().map(|l| l.text.len()).sum::<usize>());
    }

    #[test]
    fn the_ring_is_bounded_by_bytes_and_lines_by_length() {
        let mut r = Ring::default();
        // 3 MiB without a newline: pieces of at most MAX_LINE, at most MAX_BYTES in all.
        let chunk = vec![b'x'; 64 << 10];
        for _ in 0..48 {
            r.push(Stream::Stdout, &chunk, 0);
        }
        assert!(r.lines.iter().all(|l| l.text.len() <= MAX_LINE));
        assert!(r.bytes <= MAX_BYTES);
        assert!(r.partial[0].len() < MAX_LINE);
        // A multi-byte character is never cut in two.
        let mut r = Ring::default();
        let mut s = "a".repeat(MAX_LINE - 1).into_bytes();
        s.extend_from_slice("é\n".as_bytes());
        r.push(Stream::Stdout, &s, 0);
        assert_eq!(texts(&r), ["a".repeat(MAX_LINE - 1), "é".to_string()]);
    }

    #[test]
    fn time_never_goes_backwards() {
        let mut r = Ring::default();
        r.push(Stream::Stdout, b"a\n", 10);
        r.push(Stream::Stdout, b"b\n", 5);
        assert_eq!(r.lines.iter().map(|l| l.ms).collect::<Vec<_>>(), [10, 10]);
    }

    #[test]
    fn queries_page_filter_and_finish() {
        let logs = SandboxLogs::default();
        {
            let mut r = logs.ring();
            r.push(Stream::Stdout, b"a\n", 1);
            r.push(Stream::Stderr, b"b boom\n", 2);
            r.push(Stream::Stdout, b"c\n", 3);
            r.push(Stream::Stdout, b"unfinished", 4);
        }
        assert_eq!(logs.since(2, 10).iter().map(|l| l.text.as_str()).collect::<Vec<_>>(), ["b boom", "c"]);
        assert_eq!(logs.since(0, 1).len(), 1);
        logs.finish();
        assert_eq!(logs.lines().last().map(|l| l.text.as_str()), Some("unfinished"));
        let q = V2Query::parse(Some("direction=backward&cursor=3&limit=2")).unwrap();
        assert_eq!(logs.query(&q).iter().map(|l| l.text.as_str()).collect::<Vec<_>>(), ["c", "b boom"]);
        let q = V2Query::parse(Some("level=error&search=boom")).unwrap();
        assert_eq!(logs.query(&q).len(), 1);
        assert!(V2Query::parse(Some("direction=sideways")).is_err());
        assert!(V2Query::parse(Some("limit=1001")).is_err());
        let v = answer(&logs, false, Some("start=3")).unwrap();
        assert_eq!(v["logEntries"][0]["message"], "c");
        let line: Value = serde_json::from_str(v["logs"][0]["line"].as_str().unwrap()).unwrap();
        assert_eq!(line["level"], "info");
    }
}
