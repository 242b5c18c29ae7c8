//! What every service of the agent answers with and reads through: the response [`Body`], a
//! bounded request-body read, a JSON response. A leaf: it imports no other module of the agent,
//! so the router (`http`) and the services it routes to do not import each other.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use cordon_envd::connect::{Code, ConnectError};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::header::CONTENT_TYPE;
use hyper::{Response, StatusCode};
use tokio::sync::mpsc;

/// Response bodies: a complete buffer, or a stream of chunks from a task.
pub(crate) enum Body {
    Full(Option<Bytes>),
    Channel(mpsc::Receiver<Bytes>),
}

impl Body {
    pub fn full(b: impl Into<Bytes>) -> Body {
        Body::Full(Some(b.into()))
    }

    pub fn empty() -> Body {
        Body::Full(None)
    }

    pub fn channel(rx: mpsc::Receiver<Bytes>) -> Body {
        Body::Channel(rx)
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Channel(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Body::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Body::Full(None) => SizeHint::with_exact(0),
            Body::Channel(_) => SizeHint::default(),
        }
    }
}

/// Reads a whole request body, refusing more than `limit` bytes.
pub(crate) async fn read_limited(body: Incoming, limit: usize) -> Result<Bytes, ConnectError> {
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ConnectError::new(
            Code::ResourceExhausted,
            format!("request body exceeds the limit of {limit} bytes"),
        )),
        Err(e) => Err(ConnectError::new(Code::Canceled, format!("error reading the request body: {e}"))),
    }
}

/// A JSON response.
pub(crate) fn json(status: StatusCode, value: &impl serde::Serialize) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"null".to_vec());
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "application/json")
        .body(Body::full(body))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}
