//! Non-blocking reads and writes on raw file descriptors (pipes, PTY masters, inotify) driven by
//! the tokio reactor. Raw `read(2)` rather than tokio's pipe types lets the exit path drain a
//! descriptor synchronously, without trusting readiness state the reactor may not have updated yet.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use tokio::io::unix::AsyncFd;

/// A non-blocking descriptor registered with the reactor.
pub(crate) struct Fd {
    inner: AsyncFd<OwnedFd>,
    /// PTY masters report EIO once the last slave is closed; that is their end of file.
    eio_is_eof: bool,
}

pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own, with integer arguments only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs a `read(2)`-like call until a signal no longer interrupts it.
fn retry_eintr(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn raw_read(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: buf is valid for writes of buf.len() bytes for the duration of the call.
    retry_eintr(|| unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) })
}

fn raw_write(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: buf is valid for reads of buf.len() bytes for the duration of the call.
    retry_eintr(|| unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) })
}

impl Fd {
    /// Makes `fd` non-blocking and registers it.
    pub fn new(fd: OwnedFd) -> io::Result<Fd> {
        set_nonblocking(fd.as_raw_fd())?;
        // SAFETY: an OwnedFd is open and keeps returning the same descriptor until it is
        // dropped, which only happens together with the AsyncFd that owns it.
        let inner = unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?;
        Ok(Fd { inner, eio_is_eof: false })
    }

    /// Like [`Fd::new`], for a PTY master.
    pub fn new_pty_master(fd: OwnedFd) -> io::Result<Fd> {
        let mut f = Fd::new(fd)?;
        f.eio_is_eof = true;
        Ok(f)
    }

    pub fn raw(&self) -> RawFd {
        self.inner.get_ref().as_raw_fd()
    }

    fn map_read(&self, r: io::Result<usize>) -> io::Result<usize> {
        match r {
            Err(e) if self.eio_is_eof && e.raw_os_error() == Some(libc::EIO) => Ok(0),
            r => r,
        }
    }

    /// Waits for data; `Ok(0)` is end of file. Cancel-safe: no data is lost if the future is dropped.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.inner.readable().await?;
            match guard.try_io(|fd| raw_read(fd.as_raw_fd(), buf)) {
                Ok(r) => return self.map_read(r),
                Err(_would_block) => continue,
            }
        }
    }

    /// Reads what is there now, without waiting (`WouldBlock` when nothing is).
    pub fn read_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.map_read(raw_read(self.raw(), buf))
    }

    /// Writes all of `data`, waiting for room as needed.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.inner.writable().await?;
            match guard.try_io(|fd| raw_write(fd.as_raw_fd(), data)) {
                Ok(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }
}
