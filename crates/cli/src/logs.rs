//! `cordon logs ID`: what the sandbox's template start command printed (the code interpreter's
//! server, an app's `set_start_cmd`), as the server keeps it: its last 1000 lines or 1 MiB
//! (`GET /sandboxes/{id}/logs`). Lines from its stdout go to ours, from its stderr to ours.
//! `--follow` asks again every half second for what came since, until the sandbox is gone.

use std::io::Write;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use cordon_envd::Timestamp;
use serde_json::Value;

use crate::api_client::{self, Api, Refused, ServerArgs};

/// How often `--follow` asks.
const POLL: Duration = Duration::from_millis(500);

#[derive(Args, Debug)]
pub struct LogsArgs {
    /// The sandbox's id.
    id: String,
    /// Keep printing new lines until the sandbox ends (or Ctrl-C).
    #[arg(long, short)]
    follow: bool,
    /// Start each line with its time (RFC 3339).
    #[arg(long, short)]
    timestamps: bool,
    #[command(flatten)]
    server: ServerArgs,
}

/// Where the next ask starts: the last line's millisecond, and how many lines of that
/// millisecond were printed (the server's cursor has millisecond precision).
#[derive(Default)]
struct Cursor {
    ms: u64,
    seen_at_ms: usize,
}

impl Cursor {
    /// The entries not printed yet, moving the cursor past them.
    fn fresh<'a>(&mut self, entries: &'a [Value]) -> Vec<&'a Value> {
        let mut skip_at = (self.ms, self.seen_at_ms);
        let mut out = Vec::new();
        for e in entries {
            let ms = e["timestamp"].as_str().and_then(|t| Timestamp::parse_rfc3339(t).ok()).map_or(0, |t| {
                t.to_system_time().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
            });
            if ms == skip_at.0 && skip_at.1 > 0 {
                skip_at.1 -= 1;
                continue;
            }
            if ms == self.ms {
                self.seen_at_ms += 1;
            } else {
                (self.ms, self.seen_at_ms) = (ms, 1);
            }
            out.push(e);
        }
        out
    }
}

pub fn main(a: LogsArgs) -> Result<u8> {
    let api = Api::new(&a.server)?;
    let id = api_client::check_id(&a.id)?.to_string();
    api_client::runtime()?.block_on(async {
        let mut cursor = Cursor::default();
        let mut first = true;
        loop {
            let path = format!("/sandboxes/{id}/logs?start={}&limit=1000", cursor.ms);
            let v = match api.get(&path).await {
                Ok(v) => v,
                // Followed to its end: the sandbox is gone.
                Err(e) if !first && e.downcast_ref::<Refused>().is_some_and(|r| r.status == 404) => {
                    eprintln!("cordon logs: sandbox {id} has ended");
                    return Ok(0);
                }
                Err(e) => return Err(e),
            };
            first = false;
            let entries = v["logEntries"].as_array().cloned().unwrap_or_default();
            for e in cursor.fresh(&entries) {
                let mut line = String::new();
                if a.timestamps {
                    line.push_str(e["timestamp"].as_str().unwrap_or_default());
                    line.push(' ');
                }
                line.push_str(e["message"].as_str().unwrap_or_default());
                line.push('\n');
                if e["fields"]["stream"] == "stderr" {
                    std::io::stderr().write_all(line.as_bytes())?;
                } else {
                    std::io::stdout().write_all(line.as_bytes())?;
                }
            }
            std::io::stdout().flush()?;
            // One page is all the server keeps.
            if !a.follow {
                return Ok(0);
            }
            tokio::time::sleep(POLL).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_cursor_skips_what_was_printed_at_the_same_millisecond() {
        let at = |ms: u64, m: &str| json!({"timestamp": cordon_envd::Timestamp::from_system_time(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_rfc3339(), "message": m});
        let mut c = Cursor::default();
        let first = [at(5, "a"), at(7, "b"), at(7, "c")];
        assert_eq!(c.fresh(&first).len(), 3);
        assert_eq!((c.ms, c.seen_at_ms), (7, 2));
        // The next ask starts at 7 and sees b and c again, and d new at the same millisecond.
        let again = [at(7, "b"), at(7, "c"), at(7, "d"), at(9, "e")];
        let fresh: Vec<&str> = c.fresh(&again).iter().map(|e| e["message"].as_str().unwrap()).collect();
        assert_eq!(fresh, ["d", "e"]);
    }
}
