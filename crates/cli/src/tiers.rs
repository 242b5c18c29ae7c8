//! The tiers this binary has: one row per tier crate. `run`, `serve` and `mcp` go through this
//! table; adding a tier is its crate, its `Tier` variant and one line here.

use cordon_sandbox::TierEntry;
use cordon_spec::Tier;

/// Every tier, in the order `serve` opens them at start.
pub static TABLE: [TierEntry; 3] = [cordon_jail::backend::TIER, cordon_gvisor::backend::TIER, cordon_vm::backend::TIER];

/// What sandboxes of `tier` support, known without opening the tier.
pub fn capabilities(tier: Tier) -> cordon_sandbox::Capabilities {
    TierEntry::find(&TABLE, tier).map(|e| e.capabilities).unwrap_or_default()
}
