//! A link made of file descriptors, driven by tokio's reactor.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A byte stream over one descriptor to read and one to write: the two ends of a pipe pair
/// (stdin and stdout), or the same socket or character device twice (see [`FdLink::duplex`]).
///
/// Any descriptor `epoll` accepts works; it is switched to non-blocking mode.
pub struct FdLink {
    read: AsyncFd<OwnedFd>,
    write: AsyncFd<OwnedFd>,
}

fn nonblocking(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl with integer arguments on a descriptor we own.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl FdLink {
    /// A link reading from `read` and writing to `write`. Needs a tokio runtime with I/O.
    pub fn new(read: OwnedFd, write: OwnedFd) -> io::Result<FdLink> {
        nonblocking(&read)?;
        nonblocking(&write)?;
        // SAFETY: each AsyncFd owns its descriptor outright, so the descriptor stays open and
        // refers to the same file for as long as it is registered.
        let read = unsafe { AsyncFd::register_with_interest(read, tokio::io::Interest::READABLE) }.map_err(|e| e.into_parts().1)?;
        // SAFETY: as above.
        let write = unsafe { AsyncFd::register_with_interest(write, tokio::io::Interest::WRITABLE) }.map_err(|e| e.into_parts().1)?;
        Ok(FdLink { read, write })
    }

    /// A link over one bidirectional descriptor (a socket, a serial port).
    pub fn duplex(fd: OwnedFd) -> io::Result<FdLink> {
        let other = fd.try_clone()?;
        FdLink::new(fd, other)
    }
}

impl AsyncRead for FdLink {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.read.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let r = guard.try_io(|fd| {
                // SAFETY: `unfilled` is a valid, writable buffer of the given length.
                let n = unsafe { libc::read(fd.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len()) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match r {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for FdLink {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.write.poll_write_ready(cx))?;
            let r = guard.try_io(|fd| {
                // SAFETY: `data` is a valid buffer of the given length.
                let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match r {
                Ok(Ok(n)) => return Poll::Ready(Ok(n)),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The link closes when both descriptors are dropped.
        Poll::Ready(Ok(()))
    }
}
