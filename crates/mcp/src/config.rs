//! What the operator fixes when `cordon mcp` starts. Nothing a tool call carries can change it:
//! the tool schemas have no field for any of these caps, unknown arguments are refused, and the
//! one cap a call may name (its timeout) is clamped to [`Config::max_timeout`] in
//! [`Config::call_timeout`], the only place a per-call value meets an operator value.

use std::time::Duration;

/// The operator's settings for every sandbox this server makes.
#[derive(Debug, Clone)]
pub struct Config {
    /// Image (the backend's template) every sandbox starts from.
    pub image: String,
    /// Memory cap of a sandbox, MiB, swap excluded.
    pub memory_mb: u64,
    /// CPU quota of a sandbox, whole cores.
    pub cpus: u32,
    /// Writable layer (and /tmp) of a sandbox, MiB.
    pub disk_mb: u64,
    /// Wall clock a call gets when it names none.
    pub default_timeout: Duration,
    /// The most wall clock a call may ask for.
    pub max_timeout: Duration,
    /// Bytes of stdout, and again of stderr, a result carries before the middle is cut out.
    pub max_output: usize,
    /// Largest file `read_file` returns and `write_file` accepts.
    pub max_file: usize,
    /// Most entries `list_files` returns.
    pub max_entries: usize,
    /// Isolation tier of every sandbox.
    pub tier: cordon_spec::Tier,
    /// Egress allowlist of every sandbox; empty: loopback only.
    pub network: cordon_spec::NetworkPolicy,
    /// Volumes every sandbox mounts (an agent's workspace that outlives its sessions), held in
    /// use by whoever made the config for as long as it serves.
    pub volumes: Vec<cordon_spec::VolumeMount>,
    /// The egress CA every sandbox trusts, when `network` has header injection rules.
    pub egress_ca: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            image: "base".into(),
            memory_mb: 512,
            cpus: 1,
            disk_mb: 1024,
            default_timeout: Duration::from_secs(60),
            max_timeout: Duration::from_secs(600),
            max_output: 64 << 10,
            tier: cordon_spec::Tier::Ns,
            network: cordon_spec::NetworkPolicy::default(),
            max_file: 8 << 20,
            max_entries: 1000,
            volumes: Vec::new(),
            egress_ca: None,
        }
    }
}

/// How long one call may run, and a note for the model when its request was cut down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallTimeout {
    pub limit: Duration,
    pub note: Option<String>,
}

impl Config {
    /// Checks the settings against each other; the message names the flag to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.image.is_empty() {
            return Err("--image must name an image".into());
        }
        if self.cpus == 0 {
            return Err("--cpus must be at least 1".into());
        }
        if self.default_timeout.is_zero() || self.max_timeout.is_zero() {
            return Err("--timeout and --max-timeout must be longer than zero".into());
        }
        if self.default_timeout > self.max_timeout {
            return Err(format!(
                "--timeout {}s is longer than --max-timeout {}s: raise --max-timeout or lower --timeout",
                self.default_timeout.as_secs_f64(),
                self.max_timeout.as_secs_f64()
            ));
        }
        if self.max_output < 256 {
            return Err("--max-output must be at least 256 bytes".into());
        }
        if self.max_file == 0 || self.max_entries == 0 {
            return Err("--max-file and --max-entries must be at least 1".into());
        }
        Ok(())
    }

    /// The wall clock for a call that asked for `requested` seconds (or nothing). A request above
    /// the operator's ceiling is cut down to it, and the result says so, rather than failing:
    /// the model learns the limit and its work still runs.
    pub fn call_timeout(&self, requested: Option<f64>) -> Result<CallTimeout, String> {
        let Some(secs) = requested else {
            return Ok(CallTimeout { limit: self.default_timeout, note: None });
        };
        if !secs.is_finite() || secs <= 0.0 {
            return Err(format!("timeout must be a positive number of seconds, got {secs}"));
        }
        let asked = Duration::from_secs_f64(secs.min(1e9));
        if asked > self.max_timeout {
            return Ok(CallTimeout {
                limit: self.max_timeout,
                note: Some(format!(
                    "timeout {secs}s exceeds this server's limit of {}s; ran with {}s",
                    self.max_timeout.as_secs_f64(),
                    self.max_timeout.as_secs_f64()
                )),
            });
        }
        Ok(CallTimeout { limit: asked, note: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_clamped_never_raised() {
        let c = Config { default_timeout: Duration::from_secs(30), max_timeout: Duration::from_secs(60), ..Default::default() };
        assert_eq!(c.call_timeout(None).unwrap().limit, Duration::from_secs(30));
        assert_eq!(c.call_timeout(Some(5.0)).unwrap(), CallTimeout { limit: Duration::from_secs(5), note: None });
        let t = c.call_timeout(Some(3600.0)).unwrap();
        assert_eq!(t.limit, Duration::from_secs(60));
        assert!(t.note.unwrap().contains("limit of 60s"));
        assert!(c.call_timeout(Some(f64::INFINITY)).is_err());
        assert!(c.call_timeout(Some(-1.0)).is_err());
        assert!(c.call_timeout(Some(0.0)).is_err());
    }

    #[test]
    fn validation_names_the_flag() {
        assert!(Config::default().validate().is_ok());
        let c = Config { default_timeout: Duration::from_secs(700), ..Default::default() };
        assert!(c.validate().unwrap_err().contains("--max-timeout"));
        assert!(Config { cpus: 0, ..Default::default() }.validate().unwrap_err().contains("--cpus"));
    }
}
