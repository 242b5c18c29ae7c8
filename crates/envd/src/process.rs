//! Messages of the envd `process` package (service `process.Process`), in proto3 JSON form.
//!
//! Field names are camelCase on output and accepted in snake_case too; default values are left
//! out on output; bytes are base64. Oneofs are Rust enums written as a one-member object.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::json::{is_default, oneof, proto_enum};

/// The service name, the first path segment of its procedures.
pub const SERVICE: &str = "process.Process";

/// Terminal size of a PTY.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PtySize {
    /// Columns.
    #[serde(skip_serializing_if = "is_default", deserialize_with = "crate::json::int32::deserialize")]
    pub cols: u32,
    /// Rows.
    #[serde(skip_serializing_if = "is_default", deserialize_with = "crate::json::int32::deserialize")]
    pub rows: u32,
}

/// Requests a PTY for the process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Pty {
    /// Initial terminal size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<PtySize>,
}

/// What to run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ProcessConfig {
    /// The program (looked up in `PATH` when it has no slash).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub cmd: String,
    /// Arguments, without the program name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Environment variables added on top of the sandbox's.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, String>,
    /// Working directory; relative paths and `~` resolve against the user's home.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// `List` request (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListRequest {}

/// One running process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ProcessInfo {
    /// How it was started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<ProcessConfig>,
    /// Its pid inside the sandbox.
    #[serde(skip_serializing_if = "is_default", deserialize_with = "crate::json::int32::deserialize")]
    pub pid: u32,
    /// The tag it was started with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// `List` response.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ListResponse {
    /// The running processes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<ProcessInfo>,
}

/// `Start` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StartRequest {
    /// What to run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessConfig>,
    /// Run on a PTY instead of pipes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pty: Option<Pty>,
    /// A name to find the process by (`ProcessSelector::Tag`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Whether stdin is a pipe the caller can write to; absent means `true`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdin: Option<bool>,
}

/// `Update` request: resizes the PTY of a process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct UpdateRequest {
    /// Which process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessSelector>,
    /// The new PTY settings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pty: Option<Pty>,
}

/// `Update` response (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateResponse {}

oneof! {
    /// One event of a process stream (`ProcessEvent`, oneof `event`).
    pub enum ProcessEvent ("event") via ProcessEventRepr {
        /// Sent first, right after the process was spawned (or on `Connect`).
        Start(StartEvent) => start,
        /// Output.
        Data(DataEvent) => data,
        /// Sent last, once the process has exited and its output was sent.
        End(EndEvent) => end,
        /// Sent after a period of silence to keep proxies from closing the stream.
        Keepalive(KeepAlive) => keepalive,
    }
}

/// `ProcessEvent.StartEvent`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StartEvent {
    /// The pid of the process.
    #[serde(skip_serializing_if = "is_default", deserialize_with = "crate::json::int32::deserialize")]
    pub pid: u32,
}

oneof! {
    /// `ProcessEvent.DataEvent`: a chunk of output (oneof `output`).
    pub enum DataEvent ("output") via DataEventRepr {
        /// Bytes the process wrote to stdout.
        Stdout(Bytes) => stdout [with = "crate::json::opt_b64"],
        /// Bytes the process wrote to stderr.
        Stderr(Bytes) => stderr [with = "crate::json::opt_b64"],
        /// Bytes read from the PTY master.
        Pty(Bytes) => pty [with = "crate::json::opt_b64"],
    }
}

/// `ProcessEvent.EndEvent`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct EndEvent {
    /// The exit code; `-1` when the process was killed by a signal.
    #[serde(
        alias = "exit_code",
        skip_serializing_if = "is_default",
        deserialize_with = "crate::json::int32::deserialize"
    )]
    pub exit_code: i32,
    /// Whether the process exited by itself (rather than by a signal).
    #[serde(skip_serializing_if = "is_default")]
    pub exited: bool,
    /// Go's `ProcessState.String()`, e.g. `exit status 1` or `signal: killed`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub status: String,
    /// Set when the process did not succeed; the same text as `status`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `ProcessEvent.KeepAlive` (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepAlive {}

/// `Start` response: one event of the stream.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StartResponse {
    /// The event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event: Option<ProcessEvent>,
}

/// `Connect` response: one event of the stream.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ConnectResponse {
    /// The event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event: Option<ProcessEvent>,
}

oneof! {
    /// `ProcessInput` (oneof `input`).
    pub enum ProcessInput ("input") via ProcessInputRepr {
        /// Bytes for the stdin pipe.
        Stdin(Bytes) => stdin [with = "crate::json::opt_b64"],
        /// Bytes for the PTY (keystrokes).
        Pty(Bytes) => pty [with = "crate::json::opt_b64"],
    }
}

/// `SendInput` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct SendInputRequest {
    /// Which process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessSelector>,
    /// What to write.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<ProcessInput>,
}

/// `SendInput` response (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendInputResponse {}

oneof! {
    /// One message of the client stream of `StreamInput` (oneof `event`).
    pub enum StreamInputRequest ("event") via StreamInputRequestRepr {
        /// First message: which process.
        Start(StreamInputStartEvent) => start,
        /// Input bytes.
        Data(StreamInputDataEvent) => data,
        /// Keeps the request stream alive.
        Keepalive(KeepAlive) => keepalive,
    }
}

/// `StreamInputRequest.StartEvent`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StreamInputStartEvent {
    /// Which process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessSelector>,
}

/// `StreamInputRequest.DataEvent`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StreamInputDataEvent {
    /// What to write.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<ProcessInput>,
}

/// `StreamInput` response (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInputResponse {}

proto_enum! {
    /// `Signal`: the signals `SendSignal` may deliver.
    pub enum Signal {
        /// No signal (rejected by the server).
        Unspecified = 0 => "SIGNAL_UNSPECIFIED",
        /// SIGTERM.
        Sigterm = 15 => "SIGNAL_SIGTERM",
        /// SIGKILL.
        Sigkill = 9 => "SIGNAL_SIGKILL",
    }
}

/// `SendSignal` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct SendSignalRequest {
    /// Which process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessSelector>,
    /// The signal.
    #[serde(skip_serializing_if = "is_default")]
    pub signal: Signal,
}

/// `SendSignal` response (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendSignalResponse {}

/// `CloseStdin` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct CloseStdinRequest {
    /// Which process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessSelector>,
}

/// `CloseStdin` response (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloseStdinResponse {}

/// `Connect` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ConnectRequest {
    /// Which process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessSelector>,
}

oneof! {
    /// `ProcessSelector` (oneof `selector`).
    pub enum ProcessSelector ("selector") via ProcessSelectorRepr {
        /// By pid.
        Pid(u32) => pid [with = "crate::json::opt_u32"],
        /// By the tag given at start.
        Tag(String) => tag,
    }
}

impl std::fmt::Display for ProcessSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessSelector::Pid(pid) => write!(f, "pid {pid}"),
            ProcessSelector::Tag(tag) => write!(f, "tag {tag:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn to(v: &impl Serialize) -> serde_json::Value {
        serde_json::to_value(v).unwrap()
    }

    #[test]
    fn events_are_externally_tagged() {
        let start = StartResponse { event: Some(ProcessEvent::Start(StartEvent { pid: 42 })) };
        assert_eq!(to(&start), json!({"event":{"start":{"pid":42}}}));
        let data = StartResponse {
            event: Some(ProcessEvent::Data(DataEvent::Stdout(Bytes::from_static(b"hi\n")))),
        };
        assert_eq!(to(&data), json!({"event":{"data":{"stdout":"aGkK"}}}));
        let ka = StartResponse { event: Some(ProcessEvent::Keepalive(KeepAlive {})) };
        assert_eq!(to(&ka), json!({"event":{"keepalive":{}}}));
    }

    #[test]
    fn end_event_omits_defaults() {
        let ok = EndEvent { exit_code: 0, exited: true, status: "exit status 0".into(), error: None };
        assert_eq!(to(&ok), json!({"exited":true,"status":"exit status 0"}));
        assert_eq!(to(&EndEvent::default()), json!({}));
        let killed = EndEvent {
            exit_code: -1,
            exited: false,
            status: "signal: killed".into(),
            error: Some("signal: killed".into()),
        };
        assert_eq!(
            to(&killed),
            json!({"exitCode":-1,"status":"signal: killed","error":"signal: killed"})
        );
    }

    #[test]
    fn decodes_sdk_requests() {
        let r: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"BAR":"baz"},"cwd":"/home/user"},"stdin":false,"future":1}"#,
        )
        .unwrap();
        let p = r.process.unwrap();
        assert_eq!(p.cmd, "/bin/bash");
        assert_eq!(p.args, ["-l", "-c", "echo hi"]);
        assert_eq!(p.envs["BAR"], "baz");
        assert_eq!(r.stdin, Some(false));

        let r: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":16083},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(r.process, Some(ProcessSelector::Pid(16083)));
        assert_eq!(r.signal, Signal::Sigkill);
        let r: SendSignalRequest = serde_json::from_str(r#"{"process":{"pid":"7"},"signal":15}"#).unwrap();
        assert_eq!(r.process, Some(ProcessSelector::Pid(7)));
        assert_eq!(r.signal, Signal::Sigterm);

        let r: SendInputRequest =
            serde_json::from_str(r#"{"process":{"tag":"t"},"input":{"stdin":"YWJjCg=="}}"#).unwrap();
        assert_eq!(r.process, Some(ProcessSelector::Tag("t".into())));
        assert_eq!(r.input, Some(ProcessInput::Stdin(Bytes::from_static(b"abc\n"))));
    }

    #[test]
    fn accepts_snake_case_and_numbers() {
        let e: EndEvent = serde_json::from_str(r#"{"exit_code":"3","exited":true}"#).unwrap();
        assert_eq!(e.exit_code, 3);
        let e: EndEvent = serde_json::from_str(r#"{"exitCode":-1}"#).unwrap();
        assert_eq!(e.exit_code, -1);
    }

    #[test]
    fn stream_input_messages() {
        let m: StreamInputRequest = serde_json::from_str(r#"{"start":{"process":{"pid":3}}}"#).unwrap();
        assert_eq!(
            m,
            StreamInputRequest::Start(StreamInputStartEvent { process: Some(ProcessSelector::Pid(3)) })
        );
        let m: StreamInputRequest = serde_json::from_str(r#"{"data":{"input":{"pty":"YQ=="}}}"#).unwrap();
        assert_eq!(
            to(&m),
            json!({"data":{"input":{"pty":"YQ=="}}}),
        );
    }

    #[test]
    fn oneof_errors_instead_of_panicking() {
        assert!(serde_json::from_str::<ProcessSelector>("{}").is_err());
        assert!(serde_json::from_str::<ProcessSelector>(r#"{"pid":1,"tag":"x"}"#).is_err());
        assert!(serde_json::from_str::<ProcessSelector>(r#"{"pid":-1}"#).is_err());
        assert!(serde_json::from_str::<ProcessSelector>(r#"{"pid":null,"tag":"x"}"#).is_ok());
        assert!(serde_json::from_str::<DataEvent>(r#"{"stdout":"***"}"#).is_err());
        assert!(serde_json::from_str::<StartRequest>(r#"[1]"#).is_err());
    }
}
