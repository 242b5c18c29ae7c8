//! [`Tiers`]: every tier of a table, each opened on first use, dispatching on the spec's tier.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cordon_spec::Tier;

use crate::{Backend, Capabilities, Diagnosis, Error, Host, Sandbox, SandboxSpec};

/// One tier as the binary knows it: the row a new tier adds.
pub struct TierEntry {
    pub tier: Tier,
    /// What its sandboxes support, known without opening it (front ends check requests first).
    pub capabilities: Capabilities,
    /// Opens it: checks the host can run it (`Error::Unavailable` with the reason if not) and
    /// reaps what a crashed cordon left of it.
    pub open: fn(&Host) -> Result<Arc<dyn Backend>, Error>,
    /// Checks what this tier needs of the host beyond what every tier needs (privileges,
    /// cgroups), probing for real where that is cheap, and says whether it can run here.
    pub diagnose: fn(&Host) -> Diagnosis,
}

impl TierEntry {
    /// The row of `tier` in `table`, or why this build cannot run it.
    pub fn find(table: &[TierEntry], tier: Tier) -> Result<&TierEntry, Error> {
        table.iter().find(|e| e.tier == tier).ok_or_else(|| Error::Unavailable(format!("tier {tier} is not part of this build")))
    }
}

/// Every tier of a table, each opened on first use. A tier the host cannot run is refused with
/// the reason; it never falls back to another.
pub struct Tiers {
    host: Host,
    table: &'static [TierEntry],
    opened: Mutex<BTreeMap<&'static str, Arc<dyn Backend>>>,
}

impl Tiers {
    pub fn new(host: Host, table: &'static [TierEntry]) -> Arc<Tiers> {
        Arc::new(Tiers { host, table, opened: Mutex::new(BTreeMap::new()) })
    }

    fn entry(&self, tier: Tier) -> Result<&'static TierEntry, Error> {
        TierEntry::find(self.table, tier)
    }

    /// The backend of `tier`, opening it (and reaping what a crashed cordon left of it) on
    /// first use.
    pub fn backend(&self, tier: Tier) -> Result<Arc<dyn Backend>, Error> {
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = opened.get(tier.as_str()) {
            return Ok(b.clone());
        }
        let b = (self.entry(tier)?.open)(&self.host)?;
        opened.insert(tier.as_str(), b.clone());
        Ok(b)
    }
}

impl Backend for Tiers {
    fn capabilities(&self, tier: Tier) -> Capabilities {
        self.entry(tier).map(|e| e.capabilities).unwrap_or_default()
    }

    fn prepare(
        &self,
        spec: &SandboxSpec,
        image: &cordon_image::Image,
        progress: &mut dyn cordon_image::Progress,
    ) -> Result<Option<String>, Error> {
        self.backend(spec.tier)?.prepare(spec, image, progress)
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>, Error> {
        self.backend(spec.tier)?.create(spec)
    }

    /// Opens only a tier that can keep sandboxes: no other has any to give back.
    fn kept(&self, tier: Tier) -> Vec<String> {
        match self.capabilities(tier).survive_restart {
            true => self.backend(tier).map(|b| b.kept(tier)).unwrap_or_default(),
            false => Vec::new(),
        }
    }

    fn adopt(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>, Error> {
        self.backend(spec.tier)?.adopt(spec)
    }

    fn exists(&self, tier: Tier, id: &str) -> bool {
        self.capabilities(tier).survive_restart && self.backend(tier).is_ok_and(|b| b.exists(tier, id))
    }

    fn reap_kept(&self, tier: Tier) -> usize {
        match self.capabilities(tier).survive_restart {
            true => self.backend(tier).map(|b| b.reap_kept(tier)).unwrap_or(0),
            false => 0,
        }
    }
}
