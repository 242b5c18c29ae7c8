//! Errors of [`crate::EnvdClient`].

use crate::connect::{Code, ConnectError, FrameError};

/// Why a call to envd failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server answered with a Connect error (or an HTTP error classified as one).
    #[error("{0}")]
    Rpc(#[from] ConnectError),
    /// The socket could not be reached or the connection broke.
    #[error("envd connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// The server's answer did not follow the protocol.
    #[error("envd protocol error: {0}")]
    Protocol(String),
}

impl Error {
    /// The Connect code, when the server sent one.
    pub fn code(&self) -> Option<Code> {
        match self {
            Error::Rpc(e) => Some(e.code),
            _ => None,
        }
    }
}

impl From<FrameError> for Error {
    fn from(e: FrameError) -> Self {
        Error::Protocol(e.to_string())
    }
}

impl From<hyper::Error> for Error {
    fn from(e: hyper::Error) -> Self {
        Error::Io(std::io::Error::other(e))
    }
}

/// Result of client calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;
