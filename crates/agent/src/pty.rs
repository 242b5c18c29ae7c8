//! Pseudo-terminals for `Start` with `pty`.

use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// A freshly opened PTY: the master stays with the agent, the slave becomes the child's tty.
pub(crate) struct PtyPair {
    pub master: OwnedFd,
    pub slave: OwnedFd,
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Opens a PTY of the given size. Uses `/dev/ptmx` directly (no libutil), and `TIOCGPTPEER`
/// so the slave is opened relative to the master rather than by a path that could be swapped.
pub(crate) fn open(cols: u16, rows: u16) -> io::Result<PtyPair> {
    let ptmx = CString::new("/dev/ptmx").expect("no NUL in literal");
    // SAFETY: open with a valid NUL-terminated path; the result is checked.
    let m = cvt(unsafe { libc::open(ptmx.as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) })?;
    // SAFETY: m is a descriptor we just opened and own exclusively.
    let master = unsafe { OwnedFd::from_raw_fd(m) };
    let unlock: libc::c_int = 0;
    // SAFETY: TIOCSPTLCK reads one int from the valid pointer we pass.
    cvt(unsafe { libc::ioctl(m, libc::TIOCSPTLCK, &unlock) })?;
    // SAFETY: TIOCGPTPEER takes open flags by value and returns a new descriptor.
    let s = unsafe { libc::ioctl(m, libc::TIOCGPTPEER, libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    let s = if s >= 0 {
        s
    } else {
        // Kernels before 4.13: open the slave by its number.
        let mut n: libc::c_uint = 0;
        // SAFETY: TIOCGPTN writes one unsigned int to the valid pointer we pass.
        cvt(unsafe { libc::ioctl(m, libc::TIOCGPTN, &mut n) })?;
        let path = CString::new(format!("/dev/pts/{n}")).expect("no NUL in a formatted number");
        // SAFETY: open with a valid NUL-terminated path; the result is checked.
        cvt(unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) })?
    };
    // SAFETY: s is a descriptor we just obtained and own exclusively.
    let slave = unsafe { OwnedFd::from_raw_fd(s) };
    resize(m, cols, rows)?;
    Ok(PtyPair { master, slave })
}

/// Sets the window size of the terminal behind `fd` (the master works).
pub(crate) fn resize(fd: RawFd, cols: u16, rows: u16) -> io::Result<()> {
    let ws = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads a winsize from the valid pointer we pass.
    cvt(unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) })?;
    Ok(())
}

/// Clamps a requested dimension into what `winsize` holds, with a usable default for 0.
pub(crate) fn dimension(v: u32, default: u16) -> u16 {
    if v == 0 {
        default
    } else {
        v.min(u16::MAX as u32) as u16
    }
}
