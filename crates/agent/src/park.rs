//! Parking the link: the host's request that the agent let go of its link for a while (a
//! sandbox about to be saved, see `cordon-vm` and `cordon-gvisor`), told apart from HTTP by a
//! stream's first byte.
//!
//! The exchange on the bare link, once the multiplexer is closed:
//! 1. host: a stream beginning with [`PARK_REQUEST`] over the multiplexer;
//! 2. agent: closes the multiplexer (its last frame is whole), then writes [`PARKED`];
//! 3. host: reads frames up to [`PARKED`] ([`await_parked`]); the sandbox may now be saved,
//!    and the saved sandbox restored any number of times;
//! 4. host, on whichever link the agent now has: [`RESUME`] ([`await_resume`] on the agent's
//!    side skips whatever comes before it: bytes the host's multiplexer sent after the agent
//!    closed its own), then whatever the tier sends on a wake, then a new multiplexer session.

use std::io::{self, Read};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

use crate::PARK_REQUEST;

/// The agent's "parked": shaped like a multiplexer frame header (12 bytes) whose version byte
/// no yamux frame has, so the host finds it by reading frame by frame.
pub const PARKED: &[u8; 12] = b"\xffcordon-park";
/// The host's "resuming": searched for byte by byte, since what precedes it may end mid-frame.
pub const RESUME: &[u8; 32] = b"\xffcordon:resume:2f9c41d7e8a6b35\xff\xff";
/// Most bytes of frames a parking agent may still send before [`PARKED`].
const PARK_SLACK: u64 = 64 << 20;

/// Host: reads the frames a parking agent still sends, up to its [`PARKED`].
pub fn await_parked(link: &mut impl Read) -> io::Result<()> {
    let mut skipped = 0u64;
    loop {
        let mut h = [0u8; 12];
        link.read_exact(&mut h)?;
        if &h == PARKED {
            return Ok(());
        }
        if h[0] != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the agent sent neither a frame nor its parked marker"));
        }
        // Only data frames (type 0) carry a body, of the header's length.
        let body = if h[1] == 0 { u32::from_be_bytes(h[8..12].try_into().expect("4 bytes")) as u64 } else { 0 };
        skipped += 12 + body;
        if skipped > PARK_SLACK {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the agent kept sending instead of parking"));
        }
        io::copy(&mut link.take(body), &mut io::sink())?;
    }
}

/// Agent: waits (for as long as it takes: the sandbox may be saved meanwhile) until the host's
/// [`RESUME`] has been read. A read of 0 bytes is a link with no host behind it yet (a virtio
/// port between the old VMM and the restored one): retried.
pub fn await_resume(link: &mut impl Read) -> io::Result<()> {
    let mut window = [0u8; RESUME.len()];
    let mut filled = 0usize;
    let mut b = [0u8; 1];
    loop {
        match link.read(&mut b) {
            Ok(0) => std::thread::sleep(Duration::from_millis(5)),
            Ok(_) => {
                if filled < window.len() {
                    window[filled] = b[0];
                    filled += 1;
                } else {
                    window.copy_within(1.., 0);
                    window[RESUME.len() - 1] = b[0];
                }
                if filled == window.len() && &window == RESUME {
                    return Ok(());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

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

    #[test]
    fn the_host_skips_frames_to_parked_and_the_agent_skips_bytes_to_resume() {
        // Frames the agent's multiplexer sent before it parked: a data frame, a ping.
        let mut from_agent = vec![0u8, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 3, b'a', b'b', b'c'];
        from_agent.extend_from_slice(&[0, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9]);
        from_agent.extend_from_slice(PARKED);
        await_parked(&mut &from_agent[..]).unwrap();
        // Half a frame of the host's, then the resume, then the next session's bytes.
        let mut to_agent = vec![0u8, 0, 0, 7, 1];
        to_agent.extend_from_slice(RESUME);
        to_agent.extend_from_slice(b"next");
        let mut r = &to_agent[..];
        await_resume(&mut r).unwrap();
        assert_eq!(r, b"next", "nothing after the resume is consumed");
    }

    #[test]
    fn an_agent_that_does_not_park_is_an_error_not_a_hang() {
        assert!(await_parked(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]).is_err());
    }
}
