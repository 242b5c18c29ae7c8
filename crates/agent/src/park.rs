//! Parking the link: the host's request that the agent let go of its link for a while (a VM
//! about to be saved, see `cordon-vm`), told apart from HTTP by a stream's first byte.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

use crate::PARK_REQUEST;

/// What a new stream carries.
pub(crate) enum Opening<S> {
    /// The host's park request (the whole of it was read).
    Park,
    /// Anything else, with the byte read to tell: served as HTTP.
    Http(Prefixed<S>),
}

/// Reads as much of a stream as it takes to tell a park request from HTTP. `None`: the stream
/// ended or failed first.
pub(crate) async fn opening<S: AsyncRead + Unpin>(mut s: S) -> Option<Opening<S>> {
    let mut first = [0u8; 1];
    if s.read(&mut first).await.ok()? == 0 {
        return None;
    }
    if first[0] != PARK_REQUEST[0] {
        return Some(Opening::Http(Prefixed { first: Some(first[0]), inner: s }));
    }
    let mut rest = [0u8; PARK_REQUEST.len() - 1];
    s.read_exact(&mut rest).await.ok()?;
    // Any other NUL-led stream is nothing the agent speaks: dropped.
    (rest[..] == PARK_REQUEST[1..]).then_some(Opening::Park)
}

/// A stream whose first byte was already read.
pub(crate) struct Prefixed<S> {
    first: Option<u8>,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if let Some(b) = self.first {
            if buf.remaining() > 0 {
                buf.put_slice(&[b]);
                self.first = None;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn tells_a_park_request_from_http_and_keeps_every_byte_of_http() {
        let (mut a, b) = tokio::io::duplex(64);
        a.write_all(PARK_REQUEST).await.unwrap();
        assert!(matches!(opening(b).await, Some(Opening::Park)));

        let (mut a, b) = tokio::io::duplex(64);
        a.write_all(b"GET /health HTTP/1.1\r\n").await.unwrap();
        drop(a);
        let Some(Opening::Http(mut s)) = opening(b).await else { panic!("HTTP taken for a park request") };
        let mut all = String::new();
        s.read_to_string(&mut all).await.unwrap();
        assert_eq!(all, "GET /health HTTP/1.1\r\n");

        let (mut a, b) = tokio::io::duplex(64);
        a.write_all(b"\0cordon-park-v2\n").await.unwrap();
        assert!(opening(b).await.is_none());
    }
}
