//! Many connections over one byte stream.
//!
//! Some tiers give the sandbox's agent a single byte stream to the host instead of a socket in
//! the host's filesystem: the container init's stdio pipes under gVisor, a virtio-serial port in
//! a VM. This crate multiplexes that stream with yamux (the protocol of libp2p and HashiCorp's
//! tools) so that the rest of cordon keeps connecting to a Unix socket as before:
//!
//! - host side, [`serve_unix`] takes the link and a listener bound at the sandbox's socket path,
//!   opens one multiplexed stream per accepted connection and splices the two;
//! - agent side, [`Acceptor`] yields one stream per host connection, on which the agent serves
//!   its HTTP service exactly as on a socket connection (HTTP upgrades included: a stream is a
//!   plain bidirectional byte stream).
//!
//! A link is anything `AsyncRead + AsyncWrite`; [`FdLink`] makes one from file descriptors (a
//! pipe pair, a socket, a character device). The host opens every stream, the agent never does:
//! streams the agent opens are refused.

mod fd;

pub use fd::FdLink;

use std::future::{poll_fn, Future};
use std::io;
use std::task::Poll;

use futures_util::future::FutureExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};

/// One multiplexed connection: a bidirectional byte stream (tokio's I/O traits).
pub type Stream = Compat<yamux::Stream>;

/// Most streams open at once on one link. The host's proxy allows 512 requests in flight per
/// sandbox; each stream may buffer up to yamux's 256 KiB window.
pub const MAX_STREAMS: usize = 512;

fn config() -> yamux::Config {
    let mut cfg = yamux::Config::default();
    // The agent is untrusted: bound what it can make the host buffer (streams x window).
    cfg.set_max_connection_receive_window(Some(MAX_STREAMS * 256 * 1024));
    cfg.set_max_num_streams(MAX_STREAMS);
    cfg
}

fn io_error(e: yamux::ConnectionError) -> io::Error {
    match e {
        yamux::ConnectionError::Io(e) => e,
        e => io::Error::other(e),
    }
}

type OpenReply = oneshot::Sender<io::Result<Stream>>;

/// Opens streams to the agent; cheap to clone. Streams fail once the link is gone.
#[derive(Clone)]
pub struct Opener {
    requests: mpsc::Sender<OpenReply>,
}

impl Opener {
    /// A new stream to the agent.
    pub async fn open(&self) -> io::Result<Stream> {
        let (tx, rx) = oneshot::channel();
        let gone = || io::Error::new(io::ErrorKind::BrokenPipe, "the sandbox's link is closed");
        self.requests.send(tx).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

/// The host end of a link: an [`Opener`], and the future that drives the link. The future must
/// be polled for any stream to make progress; it ends when the link closes (`Ok`) or breaks.
pub fn host<L>(link: L) -> (Opener, impl Future<Output = io::Result<()>> + Send)
where
    L: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (requests, mut rx) = mpsc::channel::<OpenReply>(64);
    let mut conn = yamux::Connection::new(link.compat(), config(), yamux::Mode::Client);
    let driver = async move {
        let mut pending: Option<OpenReply> = None;
        poll_fn(move |cx| loop {
            // One open at a time: yamux hands out outbound streams in order.
            match pending.take() {
                Some(reply) => match conn.poll_new_outbound(cx) {
                    Poll::Ready(r) => {
                        let _ = reply.send(r.map(FuturesAsyncReadCompatExt::compat).map_err(io_error));
                        continue;
                    }
                    Poll::Pending => pending = Some(reply),
                },
                None => {
                    if let Poll::Ready(Some(reply)) = rx.poll_recv(cx) {
                        pending = Some(reply);
                        continue;
                    }
                }
            }
            // Polling for inbound streams is what moves every byte of the connection.
            match conn.poll_next_inbound(cx) {
                Poll::Ready(Some(Ok(stream))) => drop(stream), // the agent may not open streams
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(io_error(e))),
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        })
        .await
    };
    (Opener { requests }, driver)
}

/// Serves `listener` over `link` until the link closes: every accepted connection gets a stream
/// of its own, spliced both ways. Must run inside a tokio runtime (it spawns one task per
/// connection). Returns `Ok` when the agent closed the link, an error when it broke.
pub async fn serve_unix<L>(link: L, listener: &UnixListener) -> io::Result<()>
where
    L: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (opener, driver) = host(link);
    let mut driver = std::pin::pin!(driver.fuse());
    loop {
        let conn = tokio::select! {
            r = &mut driver => return r,
            a = listener.accept() => match a {
                Ok((c, _)) => c,
                // Out of descriptors and the like: the link and live streams go on.
                Err(_) => {
                    tokio::task::yield_now().await;
                    continue;
                }
            },
        };
        let opener = opener.clone();
        tokio::spawn(async move {
            let mut conn = conn;
            let Ok(mut stream) = opener.open().await else { return };
            // Either side closing ends the splice; errors concern this connection only.
            let _ = tokio::io::copy_bidirectional(&mut conn, &mut stream).await;
        });
    }
}

/// The agent end of a link: yields the streams the host opens.
///
/// [`Acceptor::accept`] drives the link, so it must be called again as soon as a stream is
/// handed off (spawn the work on each stream), as an accept loop does.
pub struct Acceptor<L> {
    conn: yamux::Connection<Compat<L>>,
}

impl<L> Acceptor<L>
where
    L: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    pub fn new(link: L) -> Acceptor<L> {
        Acceptor { conn: yamux::Connection::new(link.compat(), config(), yamux::Mode::Server) }
    }

    /// Closes the link from this side: every stream ends, and the last bytes this side sends
    /// are a whole frame (yamux's GoAway), after which the link may carry other things.
    pub async fn close(&mut self) -> io::Result<()> {
        poll_fn(|cx| self.conn.poll_close(cx)).await.map_err(io_error)
    }

    /// The next stream the host opened; `None` once the host closed the link.
    pub async fn accept(&mut self) -> Option<io::Result<Stream>> {
        poll_fn(|cx| self.conn.poll_next_inbound(cx))
            .await
            .map(|r| r.map(FuturesAsyncReadCompatExt::compat).map_err(io_error))
    }
}
