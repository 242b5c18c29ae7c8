//! The error type of the image store.
//!
//! Every message is meant to be shown to a user as a single line, so each
//! one says what went wrong and what to do about it.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Everything that can go wrong in the image store.
#[derive(thiserror::Error, Debug)]
pub enum ImageError {
    /// No image with that name exists in the store.
    #[error(
        "image '{name}' not found: build it with 'cordon image build {name}' \
         or import one with 'cordon image import {name} rootfs.tar'"
    )]
    NotFound {
        /// The requested image name.
        name: String,
    },

    /// The name cannot be used for an image.
    #[error(
        "invalid image name '{name}': {reason}; names are 1 to 63 characters \
         of a-z, 0-9, '.', '_' and '-' and start with a letter or digit"
    )]
    InvalidName {
        /// The rejected name (possibly shortened for display).
        name: String,
        /// Which rule it breaks.
        reason: String,
    },

    /// `build` was asked for a recipe that does not exist.
    #[error("unknown recipe '{recipe}': known recipes are {known}")]
    UnknownRecipe {
        /// The requested recipe.
        recipe: String,
        /// Comma-separated list of the recipes that exist.
        known: String,
    },

    /// An external program needed for the operation is not available.
    #[error("{tool} is not installed: {hint}")]
    MissingTool {
        /// Program name, e.g. `mmdebstrap`.
        tool: String,
        /// How to get it.
        hint: String,
    },

    /// The operation needs root privileges and the caller does not have them.
    #[error(
        "{action} needs root privileges: run the command again as root (for example with sudo)"
    )]
    NotRoot {
        /// What was attempted, e.g. "building an image".
        action: String,
    },

    /// The image build ran but did not succeed.
    #[error("{}", DisplayBuildFailed(self))]
    BuildFailed {
        /// Image being built.
        name: String,
        /// Short description of the failure.
        reason: String,
        /// Full build log.
        log: PathBuf,
        /// The last lines of the log (at most about ten).
        tail: Vec<String>,
    },

    /// A tarball could not be imported.
    #[error("cannot import '{}' as image '{name}': {reason}", tarball.display())]
    Import {
        /// Target image name.
        name: String,
        /// The tarball given by the caller.
        tarball: PathBuf,
        /// What is wrong with it and what to do.
        reason: String,
    },

    /// An image could not be pulled from its registry.
    #[error("cannot pull '{reference}': {reason}")]
    Pull {
        /// The reference given.
        reference: String,
        /// What went wrong and what to do.
        reason: String,
    },

    /// A tree (a build step's files, an image adopted as a build's base) could not be made a
    /// layer.
    #[error("cannot make a layer of {what}: {reason}")]
    Layer {
        /// What was to become a layer.
        what: String,
        /// What went wrong.
        reason: String,
    },

    /// The image cannot be changed while sandboxes use it.
    #[error("image '{name}' is {what}: stop the sandboxes that use it (cordon ps) and try again")]
    InUse {
        /// Image name.
        name: String,
        /// "in use by a running sandbox", or "being removed" (for a pin).
        what: String,
    },

    /// An image directory exists but its metadata is unusable.
    #[error(
        "image '{name}' is damaged ({reason}): remove it with 'cordon image remove {name}' \
         and build or import it again"
    )]
    Corrupt {
        /// Image name.
        name: String,
        /// What is wrong.
        reason: String,
    },

    /// A filesystem operation of the store failed.
    ///
    /// The underlying error is part of the message rather than exposed as
    /// `source()`, so that error-chain printers do not show it twice.
    #[error("{context}: {err}{}", io_hint(err))]
    Io {
        /// What the store was doing, e.g. "cannot create /var/lib/cordon/images".
        context: String,
        /// The OS error.
        err: io::Error,
    },
}

impl ImageError {
    /// Wraps an I/O error with a description of what was being done.
    pub(crate) fn io(context: impl Into<String>, err: io::Error) -> ImageError {
        ImageError::Io {
            context: context.into(),
            err,
        }
    }
}

/// Turns common OS errors into advice; the raw error alone rarely says what
/// to do.
fn io_hint(err: &io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => " (run the command as root)",
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => " (free some disk space and try again)",
        Some(libc::EROFS) => {
            " (the state directory is on a read-only filesystem; choose another one)"
        }
        _ => "",
    }
}

struct DisplayBuildFailed<'a>(&'a ImageError);

impl fmt::Display for DisplayBuildFailed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ImageError::BuildFailed {
            name,
            reason,
            log,
            tail,
        } = self.0
        else {
            return Ok(());
        };
        write!(f, "building image '{name}' failed: {reason}")?;
        if let Some(hint) = failure_hint(tail) {
            write!(f, " ({hint})")?;
        }
        let mut shown: Vec<&str> = tail
            .iter()
            .map(|l| l.trim())
            .filter(|l| !l.is_empty())
            .collect();
        // apt and mmdebstrap mark real errors with "E:"; when there are any,
        // the surrounding chatter only hides them.
        if shown.iter().any(|l| l.starts_with("E: ")) {
            shown.retain(|l| l.starts_with("E: "));
        }
        shown.dedup();
        if !shown.is_empty() {
            write!(f, "; last output: {}", shown.join(" | "))?;
        }
        write!(
            f,
            "; full log in {}: fix the cause and run 'cordon image build {name}' again",
            log.display()
        )
    }
}

/// Recognizes the most common reasons a bootstrap fails so the message can
/// point at the fix instead of only at the log.
fn failure_hint(tail: &[String]) -> Option<&'static str> {
    let text = tail.join("\n");
    let network = [
        "Temporary failure resolving",
        "Could not resolve",
        "Failed to fetch",
        "Connection timed out",
        "Network is unreachable",
        "Connection refused",
        "Unable to connect",
    ];
    if network.iter().any(|n| text.contains(n)) {
        return Some(
            "the Debian mirror is unreachable: check network access or set CORDON_DEBIAN_MIRROR \
             to a reachable mirror",
        );
    }
    if text.contains("No space left on device") {
        return Some("the disk is full: free some space");
    }
    None
}
