//! The parts of the Connect protocol (v1, JSON codec) that envd speaks: error codes, error
//! bodies, and the envelope framing of streaming calls.
//!
//! A stream body is a sequence of envelopes: one flag byte, a big-endian `u32` length, then that
//! many bytes of JSON. Flag [`FLAG_END_STREAM`] marks the last envelope of a response, whose JSON
//! is `{}` or `{"error":{"code":..,"message":..}}`. Compression ([`FLAG_COMPRESSED`]) is never used.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// Content type of unary requests and responses.
pub const CONTENT_TYPE_JSON: &str = "application/json";
/// Content type of streaming requests and responses; clients reject any parameter on it.
pub const CONTENT_TYPE_CONNECT_JSON: &str = "application/connect+json";
/// Header carrying the call deadline in milliseconds.
pub const HEADER_TIMEOUT_MS: &str = "connect-timeout-ms";
/// Header carrying the protocol version (`1`).
pub const HEADER_PROTOCOL_VERSION: &str = "connect-protocol-version";
/// Header in which E2B clients ask for keepalive events every N seconds.
pub const HEADER_KEEPALIVE_INTERVAL: &str = "keepalive-ping-interval";
/// Envelope flag: the payload is compressed.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: the last envelope of a response stream.
pub const FLAG_END_STREAM: u8 = 0x02;
/// Size of the envelope prefix (flag + length).
pub const ENVELOPE_HEADER_LEN: usize = 5;

/// Connect (gRPC) status codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    /// The operation was cancelled.
    Canceled,
    /// Unknown error.
    Unknown,
    /// The request is malformed or names something invalid.
    InvalidArgument,
    /// The deadline passed.
    DeadlineExceeded,
    /// Something requested does not exist.
    NotFound,
    /// Something to be created exists already.
    AlreadyExists,
    /// Not allowed.
    PermissionDenied,
    /// Out of some resource.
    ResourceExhausted,
    /// The system is not in the state the operation needs.
    FailedPrecondition,
    /// Aborted (e.g. a conflict).
    Aborted,
    /// Out of range.
    OutOfRange,
    /// Not implemented.
    Unimplemented,
    /// Internal error.
    Internal,
    /// Temporarily unavailable.
    Unavailable,
    /// Data loss.
    DataLoss,
    /// Missing or bad credentials.
    Unauthenticated,
}

impl Code {
    /// Every code, in gRPC number order.
    pub const ALL: [Code; 16] = [
        Code::Canceled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// The snake_case name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The gRPC number (1..=16).
    pub fn number(self) -> u32 {
        Code::ALL.iter().position(|c| *c == self).map_or(2, |i| i as u32 + 1)
    }

    /// The code with a gRPC number.
    pub fn from_number(n: u32) -> Option<Code> {
        Code::ALL.get((n as usize).checked_sub(1)?).copied()
    }

    /// The HTTP status a unary error with this code is sent with.
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown => 500,
            Code::InvalidArgument => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::FailedPrecondition => 400,
            Code::Aborted => 409,
            Code::OutOfRange => 400,
            Code::Unimplemented => 501,
            Code::Internal => 500,
            Code::Unavailable => 503,
            Code::DataLoss => 500,
            Code::Unauthenticated => 401,
        }
    }

    /// How clients classify an error response without a Connect body, by HTTP status.
    pub fn from_http_status(status: u16) -> Code {
        match status {
            400 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            409 => Code::AlreadyExists,
            413 | 429 => Code::ResourceExhausted,
            499 => Code::Canceled,
            500 => Code::Internal,
            501 | 505 => Code::Unimplemented,
            502 | 503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Unknown,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that is not a Connect code name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown Connect code {0:?}")]
pub struct UnknownCode(pub String);

impl FromStr for Code {
    type Err = UnknownCode;

    fn from_str(s: &str) -> Result<Code, UnknownCode> {
        Code::ALL
            .iter()
            .copied()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownCode(s.to_string()))
    }
}

impl Serialize for Code {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Code {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Code, D::Error> {
        // Some servers send the gRPC number instead of the name.
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(s) => Ok(s.parse().unwrap_or(Code::Unknown)),
            serde_json::Value::Number(n) => Ok(n
                .as_u64()
                .and_then(|n| Code::from_number(u32::try_from(n).ok()?))
                .unwrap_or(Code::Unknown)),
            _ => Err(serde::de::Error::custom("expected a Connect code name")),
        }
    }
}

/// A Connect error: a code and a human-readable message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ConnectError {
    /// The code.
    pub code: Code,
    /// What went wrong.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

impl ConnectError {
    /// An error with a code and message.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    /// `invalid_argument`.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    /// `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    /// `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// `unauthenticated`.
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(Code::Unauthenticated, message)
    }

    /// The JSON body of a unary error response, `{"code":"not_found","message":"..."}`.
    pub fn to_unary_body(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_else(|_| b"{\"code\":\"internal\"}".to_vec()))
    }

    /// Reads an error response the way Connect clients do: a JSON body with a `code` wins;
    /// otherwise the HTTP status decides and the body (if any) becomes the message.
    pub fn from_response(status: u16, body: &[u8]) -> Self {
        #[derive(Deserialize)]
        struct Body {
            code: Option<serde_json::Value>,
            message: Option<String>,
        }
        if let Ok(b) = serde_json::from_slice::<Body>(body) {
            let code = match &b.code {
                Some(serde_json::Value::String(s)) => s.parse().ok(),
                Some(serde_json::Value::Number(n)) => {
                    n.as_u64().and_then(|n| u16::try_from(n).ok()).map(Code::from_http_status)
                }
                _ => None,
            };
            if code.is_some() || b.message.is_some() {
                return Self::new(
                    code.unwrap_or_else(|| Code::from_http_status(status)),
                    b.message.unwrap_or_default(),
                );
            }
        }
        let text = String::from_utf8_lossy(body).trim().to_string();
        let message = if text.is_empty() { format!("HTTP status {status}") } else { text };
        Self::new(Code::from_http_status(status), message)
    }
}

/// The JSON of an end-stream envelope.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EndStream {
    /// Set when the call failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ConnectError>,
    /// Trailers.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, Vec<String>>,
}

/// One envelope of a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// Flag bits ([`FLAG_COMPRESSED`], [`FLAG_END_STREAM`]).
    pub flags: u8,
    /// The payload (JSON).
    pub data: Bytes,
}

impl Envelope {
    /// Whether this is the end-stream envelope.
    pub fn is_end_stream(&self) -> bool {
        self.flags & FLAG_END_STREAM != 0
    }

    /// Whether the payload is compressed (which envd never does).
    pub fn is_compressed(&self) -> bool {
        self.flags & FLAG_COMPRESSED != 0
    }

    /// Reads the payload of an end-stream envelope.
    pub fn end_stream(&self) -> Result<EndStream, FrameError> {
        if self.data.iter().all(u8::is_ascii_whitespace) {
            return Ok(EndStream::default());
        }
        serde_json::from_slice(&self.data).map_err(|e| FrameError::BadEndStream(e.to_string()))
    }
}

/// Frames `data` as one envelope.
pub fn encode_envelope(flags: u8, data: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(ENVELOPE_HEADER_LEN + data.len());
    out.put_u8(flags);
    out.put_u32(data.len() as u32);
    out.put_slice(data);
    out.freeze()
}

/// Serializes a message and frames it as a data envelope (flag 0).
pub fn encode_message<T: Serialize>(msg: &T) -> Result<Bytes, serde_json::Error> {
    let json = serde_json::to_vec(msg)?;
    Ok(encode_envelope(0, &json))
}

/// The end-stream envelope: `{}` on success, `{"error":{...}}` on failure.
pub fn encode_end_stream(error: Option<&ConnectError>) -> Bytes {
    let body = match error {
        None => b"{}".to_vec(),
        Some(e) => serde_json::to_vec(&EndStream { error: Some(e.clone()), metadata: BTreeMap::new() })
            .unwrap_or_else(|_| b"{\"error\":{\"code\":\"internal\"}}".to_vec()),
    };
    encode_envelope(FLAG_END_STREAM, &body)
}

/// Framing errors.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// An envelope announced more bytes than allowed.
    #[error("envelope of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The body ended inside an envelope.
    #[error("stream ended inside an envelope ({0} bytes left over)")]
    Truncated(usize),
    /// The end-stream JSON could not be read.
    #[error("malformed end-stream message: {0}")]
    BadEndStream(String),
}

/// Splits a byte stream, fed in arbitrary chunks, into envelopes.
#[derive(Debug)]
pub struct EnvelopeDecoder {
    buf: BytesMut,
    max_len: usize,
}

impl EnvelopeDecoder {
    /// A decoder that refuses envelopes larger than `max_len` bytes of payload.
    pub fn new(max_len: usize) -> Self {
        Self { buf: BytesMut::new(), max_len }
    }

    /// Appends bytes read from the body.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete envelope, if one is buffered.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, FrameError> {
        if self.buf.len() < ENVELOPE_HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max_len {
            return Err(FrameError::TooLarge { len, max: self.max_len });
        }
        if self.buf.len() < ENVELOPE_HEADER_LEN + len {
            // No reserving ahead for the announced length: a peer could announce the maximum
            // for every envelope and make us allocate without sending anything.
            return Ok(None);
        }
        let flags = self.buf[0];
        self.buf.advance(ENVELOPE_HEADER_LEN);
        let data = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, data }))
    }

    /// Bytes buffered but not yet returned.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Call at the end of the body: fails if a partial envelope is left.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Truncated(self.buf.len()))
        }
    }
}

/// Whether a `Content-Type` value names the Connect streaming JSON codec.
pub fn is_connect_json(content_type: &str) -> bool {
    media_type(content_type).eq_ignore_ascii_case(CONTENT_TYPE_CONNECT_JSON)
}

/// The media type of a `Content-Type` value, without parameters.
pub fn media_type(content_type: &str) -> &str {
    content_type.split(';').next().unwrap_or("").trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for c in Code::ALL {
            assert_eq!(c.as_str().parse::<Code>().unwrap(), c);
            assert_eq!(Code::from_number(c.number()), Some(c));
        }
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::from_http_status(413), Code::ResourceExhausted);
        assert!("nope".parse::<Code>().is_err());
    }

    #[test]
    fn unary_error_body() {
        let e = ConnectError::not_found("process with pid 7 not found");
        assert_eq!(&e.to_unary_body()[..], br#"{"code":"not_found","message":"process with pid 7 not found"}"#);
        assert_eq!(ConnectError::from_response(400, &e.to_unary_body()), e);
        let plain = ConnectError::from_response(502, b"bad gateway");
        assert_eq!((plain.code, plain.message.as_str()), (Code::Unavailable, "bad gateway"));
        let files = ConnectError::from_response(404, br#"{"message":"no such file","code":404}"#);
        assert_eq!((files.code, files.message.as_str()), (Code::NotFound, "no such file"));
    }

    #[test]
    fn envelopes_decode_across_chunks() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&encode_message(&serde_json::json!({"a":1})).unwrap());
        wire.extend_from_slice(&encode_end_stream(Some(&ConnectError::internal("x"))));
        assert_eq!(&wire[..5], &[0, 0, 0, 0, 7]);
        let mut d = EnvelopeDecoder::new(1024);
        let mut got = Vec::new();
        for b in &wire {
            d.push(std::slice::from_ref(b));
            while let Some(e) = d.next_envelope().unwrap() {
                got.push(e);
            }
        }
        d.finish().unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(&got[0].data[..], br#"{"a":1}"#);
        assert!(got[1].is_end_stream());
        let end = got[1].end_stream().unwrap();
        assert_eq!(end.error, Some(ConnectError::internal("x")));
        assert_eq!(encode_end_stream(None)[..], [2, 0, 0, 0, 2, b'{', b'}']);
    }

    #[test]
    fn decoder_limits_and_truncation() {
        let mut d = EnvelopeDecoder::new(4);
        d.push(&[0, 0, 0, 0, 5, 1]);
        assert_eq!(d.next_envelope(), Err(FrameError::TooLarge { len: 5, max: 4 }));
        let mut d = EnvelopeDecoder::new(4);
        d.push(&[0, 0, 0]);
        assert_eq!(d.next_envelope(), Ok(None));
        assert_eq!(d.finish(), Err(FrameError::Truncated(3)));
    }

    #[test]
    fn content_types() {
        assert!(is_connect_json("application/connect+json"));
        assert!(is_connect_json("application/connect+json; charset=utf-8"));
        assert!(!is_connect_json("application/connect+proto"));
        assert_eq!(media_type("application/json; charset=utf-8"), "application/json");
    }
}
