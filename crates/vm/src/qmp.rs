//! Just enough of the QEMU Machine Protocol to take a snapshot: JSON lines over a socket the
//! VMM was given as its monitor (`-chardev socket,fd=N -mon mode=control`). The host end of
//! that socket is the host's alone: the guest has no device that reaches it.

use serde_json::{json, Value};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Bytes per second a migration to a file may use: no real cap.
pub const MAX_BANDWIDTH: u64 = 64 << 30;

pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

fn proto(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

impl Qmp {
    /// Reads the greeting and leaves capability negotiation, as every QMP client must.
    pub fn connect(sock: UnixStream, timeout: Duration) -> io::Result<Qmp> {
        sock.set_read_timeout(Some(timeout))?;
        let writer = sock.try_clone()?;
        let mut q = Qmp { reader: BufReader::new(sock), writer };
        let greeting = q.line()?;
        if greeting.get("QMP").is_none() {
            return Err(proto(format!("not a QMP greeting: {greeting}")));
        }
        q.execute("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    /// Takes over a monitor connection another process used (the VM's previous owner): the
    /// greeting may still be unread and the negotiation done or not, and replies to commands
    /// the other sent may be pending. A negotiation tagged with an id of its own settles all
    /// three: everything before its answer is the old connection's, and either answer (done
    /// now, or done before) leaves command mode.
    pub fn adopt(sock: UnixStream, timeout: Duration) -> io::Result<Qmp> {
        const TAG: &str = "cordon-adopt";
        sock.set_read_timeout(Some(timeout))?;
        let writer = sock.try_clone()?;
        let mut q = Qmp { reader: BufReader::new(sock), writer };
        let msg = json!({ "execute": "qmp_capabilities", "id": TAG });
        q.writer.write_all(format!("{msg}\n").as_bytes())?;
        while q.line()?.get("id").and_then(Value::as_str) != Some(TAG) {}
        Ok(q)
    }

    fn line(&mut self) -> io::Result<Value> {
        let mut l = String::new();
        if self.reader.read_line(&mut l)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        serde_json::from_str(&l).map_err(|e| proto(format!("QMP sent {l:?}: {e}")))
    }

    /// Runs one command and returns its `return` value; events that arrive meanwhile are
    /// skipped.
    pub fn execute(&mut self, command: &str, arguments: Value) -> io::Result<Value> {
        let msg = json!({ "execute": command, "arguments": arguments });
        self.writer.write_all(format!("{msg}\n").as_bytes())?;
        self.reply(command)
    }

    fn reply(&mut self, command: &str) -> io::Result<Value> {
        loop {
            let v = self.line()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(io::Error::other(format!("QMP {command}: {}", e["desc"].as_str().unwrap_or("failed"))));
            }
        }
    }

    /// Migrates the running VM into `file` and waits until it is written. The VM stops when
    /// the migration completes; its state says it was running, so a VMM started with
    /// `-incoming` on that state resumes the guest by itself.
    pub fn migrate_to(&mut self, file: &std::fs::File, deadline: Duration) -> io::Result<()> {
        use std::os::fd::AsFd;
        // The descriptor travels on the `getfd` command that names it.
        let getfd = json!({ "execute": "getfd", "arguments": { "fdname": "snapshot" } });
        cordon_host::sys::send_fd_with(self.writer.as_fd(), file.as_fd(), format!("{getfd}\n").as_bytes())?;
        self.reply("getfd")?;
        // A file takes the state as fast as the disk does; QEMU's default cap (128 MiB/s) is
        // for networks.
        self.execute("migrate-set-parameters", json!({ "max-bandwidth": MAX_BANDWIDTH }))?;
        self.execute("migrate", json!({ "uri": "fd:snapshot" }))?;
        let end = Instant::now() + deadline;
        loop {
            let st = self.execute("query-migrate", json!({}))?;
            match st["status"].as_str() {
                Some("completed") => return Ok(()),
                Some("failed") | Some("cancelled") => {
                    return Err(io::Error::other(format!("migration {}: {}", st["status"], st["error-desc"].as_str().unwrap_or(""))));
                }
                _ if Instant::now() > end => return Err(io::Error::new(io::ErrorKind::TimedOut, "migration did not complete")),
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// What an adopter finds on a monitor another process used: maybe an unread greeting, a
    /// reply to a command whose sender died, an event. All of it is skipped, and the next
    /// command gets its own answer.
    #[test]
    fn an_adopted_monitor_skips_what_the_old_connection_left() {
        let (ours, mut vmm) = UnixStream::pair().unwrap();
        let stale = concat!(
            r#"{"QMP": {"version": {}, "capabilities": []}}"#, "\n",
            r#"{"return": {"status": "postmigrate"}}"#, "\n",
            r#"{"event": "STOP", "timestamp": {}}"#, "\n",
            r#"{"error": {"class": "CommandNotFound", "desc": "Capabilities negotiation is already complete"}, "id": "cordon-adopt"}"#, "\n",
            r#"{"return": {"status": "running", "running": true}}"#, "\n",
        );
        vmm.write_all(stale.as_bytes()).unwrap();
        let mut q = Qmp::adopt(ours, Duration::from_secs(5)).unwrap();
        let status = q.execute("query-status", json!({})).unwrap();
        assert_eq!(status["status"], "running");
        drop(q);
        let mut sent = String::new();
        vmm.read_to_string(&mut sent).unwrap();
        let cmds: Vec<Value> = sent.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(cmds[0], json!({"execute": "qmp_capabilities", "id": "cordon-adopt"}));
        assert_eq!(cmds[1]["execute"], "query-status");
    }

    #[test]
    fn an_adopted_monitor_that_never_answers_is_an_error() {
        let (ours, _vmm) = UnixStream::pair().unwrap();
        assert!(Qmp::adopt(ours, Duration::from_millis(200)).is_err());
    }
}
