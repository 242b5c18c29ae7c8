//! The host-side checks every command that starts sandboxes (`cordon run`, `cordon mcp`) makes
//! before it opens a tier, worded the same for each.

use crate::usage;
use anyhow::Result;
use std::net::SocketAddr;

/// `--dns-upstream`, parsed: refused as a usage error rather than found out at the first lookup.
pub fn dns_upstream(flag: Option<&str>) -> Result<Option<SocketAddr>> {
    flag.map(|u| cordon_net::parse_upstream(u).map_err(|e| usage(format!("--dns-upstream: {e}")))).transpose()
}

/// Refuses to go on as anyone but root; `refusal` says what of this command needs it.
pub fn require_root(refusal: impl Into<String>) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(usage(refusal));
    }
    Ok(())
}
