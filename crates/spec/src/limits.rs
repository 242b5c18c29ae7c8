//! The hard caps of a sandbox. Defaults are deliberately strict: a caller widens them, never
//! the other way round.

use crate::{format_size, SpecError};
use serde::{Deserialize, Serialize};
use std::time::Duration;

pub const DEFAULT_MEMORY: u64 = 512 << 20;
pub const DEFAULT_CPUS: f64 = 1.0;
pub const DEFAULT_PIDS: u32 = 256;
pub const DEFAULT_DISK: u64 = 1 << 30;
pub const DEFAULT_NOFILE: u64 = 4096;
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Smallest values that still let an agent and a shell start; below them a sandbox would only
/// fail in confusing ways, so they are refused up front.
const MIN_MEMORY: u64 = 16 << 20;
const MIN_DISK: u64 = 1 << 20;
const MIN_PIDS: u32 = 8;
/// Most tasks a sandbox may ask for: far beyond what one sandbox needs, and low enough that every
/// tier can write it into a cgroup (the kernel refuses `pids.max` above its PID_MAX_LIMIT of
/// 4,194,304, and the gvisor tier multiplies the figure by its tasks per sandbox task).
pub const MAX_PIDS: u32 = 65_536;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Limits {
    /// Memory in bytes, swap excluded (no swap is ever granted).
    pub memory_bytes: u64,
    /// CPU quota in cores; fractional values give a CFS quota below one core.
    pub cpus: f64,
    /// Maximum number of tasks (processes and threads) alive at once.
    pub pids: u32,
    /// Size of the writable layer over the image, and of `/tmp`.
    pub disk_bytes: u64,
    /// RLIMIT_NOFILE for every process.
    pub nofile: u64,
    /// Wall-clock lifetime; the whole sandbox is killed when it runs out.
    #[serde(with = "duration_secs")]
    pub timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: DEFAULT_MEMORY,
            cpus: DEFAULT_CPUS,
            pids: DEFAULT_PIDS,
            disk_bytes: DEFAULT_DISK,
            nofile: DEFAULT_NOFILE,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl Limits {
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.memory_bytes < MIN_MEMORY {
            return Err(SpecError::new(
                "memory",
                format!("{} is below the minimum of {}", format_size(self.memory_bytes), format_size(MIN_MEMORY)),
            ));
        }
        if !(self.cpus.is_finite() && self.cpus >= 0.01 && self.cpus <= 1024.0) {
            return Err(SpecError::new("cpus", format!("{} is not between 0.01 and 1024", self.cpus)));
        }
        if !(MIN_PIDS..=MAX_PIDS).contains(&self.pids) {
            return Err(SpecError::new("pids", format!("{} is not between {MIN_PIDS} and {MAX_PIDS}", self.pids)));
        }
        if self.disk_bytes < MIN_DISK {
            return Err(SpecError::new(
                "disk",
                format!("{} is below the minimum of {}", format_size(self.disk_bytes), format_size(MIN_DISK)),
            ));
        }
        if self.nofile < 16 || self.nofile > 1 << 20 {
            return Err(SpecError::new("nofile", format!("{} is not between 16 and 1048576", self.nofile)));
        }
        if self.timeout.is_zero() {
            return Err(SpecError::new("timeout", "must be greater than zero"));
        }
        Ok(())
    }

    /// CFS quota per 100 ms period, in microseconds.
    pub fn cpu_quota_us(&self, period_us: u64) -> u64 {
        ((self.cpus * period_us as f64).round() as u64).max(1000)
    }
}

mod duration_secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        if !(secs.is_finite() && secs >= 0.0) {
            return Err(serde::de::Error::custom("timeout must be a non-negative number of seconds"));
        }
        Ok(Duration::from_secs_f64(secs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_strict() {
        let l = Limits::default();
        l.validate().unwrap();
        assert_eq!(l.memory_bytes, 512 << 20);
        assert_eq!(l.pids, 256);
    }

    #[test]
    fn rejects_tiny_or_absurd_values() {
        let bad = [
            Limits { memory_bytes: 1 << 20, ..Default::default() },
            Limits { cpus: 0.0, ..Default::default() },
            Limits { cpus: f64::NAN, ..Default::default() },
            Limits { pids: 1, ..Default::default() },
            Limits { pids: u32::MAX, ..Default::default() },
            Limits { pids: MAX_PIDS + 1, ..Default::default() },
            Limits { disk_bytes: 10, ..Default::default() },
            Limits { timeout: Duration::ZERO, ..Default::default() },
        ];
        for l in bad {
            assert!(l.validate().is_err(), "{l:?} accepted");
        }
    }

    #[test]
    fn cpu_quota() {
        let l = Limits { cpus: 0.5, ..Default::default() };
        assert_eq!(l.cpu_quota_us(100_000), 50_000);
        let l = Limits { cpus: 2.0, ..Default::default() };
        assert_eq!(l.cpu_quota_us(100_000), 200_000);
    }
}
