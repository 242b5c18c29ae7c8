//! Persistent volumes: the one kind of host data a sandbox may see, named at its create.
//!
//! - [`store`]: each volume is its own ext4 filesystem in a sparse image file under
//!   `<state>/volumes/<id>/`, so its size cap is the filesystem's (ENOSPC inside, never a full
//!   host disk), mounted once on the host (nosuid, nodev) and bound from there into sandboxes.
//!   A [`store::Lease`] (a shared `flock`) marks a volume in use by a sandbox or a request, in
//!   this process or any other (`cordon run --volume` next to `cordon serve`); a delete takes
//!   the lock exclusively and so refuses a volume in use.
//! - [`content`]: the volume API's file operations, every path resolved inside the volume with
//!   `openat2(RESOLVE_IN_ROOT)`, so that `..` and symlinks planted by a sandbox reach nothing
//!   outside it.

pub mod content;
mod error;
pub mod store;

pub use error::VolumeError;
pub use store::{Lease, VolumeInfo, Volumes};
