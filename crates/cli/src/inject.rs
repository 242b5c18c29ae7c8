//! `--secret` and `--inject` of `cordon run` and `cordon mcp`: credentials the forwarder adds
//! to requests to one host, which the sandbox never holds.
//!
//! `--inject 'api.example.com:Authorization=Bearer ${secrets.KEY}'` sets a header on every
//! request to that host (or `*.example.com`: its subdomains), with `${secrets.NAME}` (or the
//! API's `${e2b.secrets.NAME}`) filled in from `--secret NAME=VALUE`, or `--secret NAME` to take
//! the value from cordon's own environment (which keeps it out of the process list). A rule
//! does not open the network: the host still needs `--allow-net`.

use crate::usage;
use anyhow::Result;
use cordon_spec::Transforms;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Debug, Default, Clone)]
pub struct InjectArgs {
    /// A secret for --inject rules: NAME=VALUE, or NAME to read it from cordon's environment
    /// (repeatable). Never visible inside the sandbox.
    #[arg(long = "secret", value_name = "NAME[=VALUE]")]
    pub secret: Vec<String>,
    /// Set a header on the sandbox's requests to a host, outside the sandbox (repeatable):
    /// HOST:Header=value, where HOST is a name or *.domain and value may use ${secrets.NAME}.
    /// The forwarder terminates TLS for that host only, with a CA the sandbox trusts.
    #[arg(long = "inject", value_name = "HOST:HEADER=VALUE")]
    pub inject: Vec<String>,
    /// CA certificates (PEM) that hosts with --inject rules are verified against, instead of
    /// the host's trust store.
    #[arg(long = "upstream-ca", value_name = "FILE")]
    pub upstream_ca: Option<PathBuf>,
}

/// Secrets given on the command line, held in this process only.
struct Given(HashMap<String, String>);

impl cordon_net::SecretSource for Given {
    fn value(&self, name: &str) -> Option<String> {
        self.0.get(name).cloned()
    }
}

impl InjectArgs {
    /// The rules, checked; every secret they name must be given.
    pub fn transforms(&self) -> Result<Transforms> {
        let mut by_host: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for r in &self.inject {
            let bad = || usage(format!("--inject {r}: use HOST:HEADER=VALUE (e.g. 'api.example.com:Authorization=Bearer ${{secrets.KEY}}')"));
            let (host, rest) = r.split_once(':').ok_or_else(bad)?;
            let (name, value) = rest.split_once('=').ok_or_else(bad)?;
            // The short form of the command line is the API's placeholder.
            let value = value.replace("${secrets.", "${e2b.secrets.");
            by_host.entry(host.to_string()).or_default().push((name.trim().to_string(), value));
        }
        let t = Transforms::new(by_host).map_err(|e| usage(format!("--inject: {}", e.reason)))?;
        let given = self.given()?;
        if let Some(missing) = t.secrets().into_iter().find(|s| !given.0.contains_key(*s)) {
            return Err(usage(format!("--inject names secret '{missing}', which no --secret gives")));
        }
        Ok(t)
    }

    fn given(&self) -> Result<Given> {
        let mut out = HashMap::new();
        for s in &self.secret {
            let (name, value) = match s.split_once('=') {
                Some((n, v)) => (n, v.to_string()),
                None => (s.as_str(), std::env::var(s).map_err(|_| usage(format!("--secret {s}: no value given and {s} is not set in the environment")))?),
            };
            let canonical = cordon_spec::secret_name(name).ok_or_else(|| usage(format!("--secret {name}: a name is 1 to 128 of A-Z, a-z, 0-9, _ and -")))?;
            if !cordon_spec::valid_value(&value) {
                return Err(usage(format!("--secret {name}: the value holds control characters or line breaks, which no header can carry")));
            }
            out.insert(canonical, value);
        }
        Ok(Given(out))
    }

    /// The TLS termination for the rules, with the host's egress CA under `state_dir`; `None`
    /// when there are no rules.
    pub fn interception(&self, state_dir: &std::path::Path, rules: &Transforms) -> Result<Option<Arc<cordon_net::Interception>>> {
        if rules.is_empty() {
            return Ok(None);
        }
        // The secrets' values live in this process from here on: never in a core dump.
        cordon_host::sys::forbid_core_dumps()?;
        let ca = Arc::new(cordon_net::EgressCa::open(state_dir)?);
        let i = cordon_net::Interception::new(ca, self.upstream_ca.as_deref(), Arc::new(self.given()?)).map_err(|e| usage(format!("--upstream-ca: {e}")))?;
        Ok(Some(Arc::new(i)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_take_the_short_placeholder_and_need_their_secrets() {
        let a = InjectArgs { secret: vec!["KEY=s3cret".into()], inject: vec!["api.test:Authorization=Bearer ${secrets.KEY}".into(), "api.test:X-Team=blue".into()], upstream_ca: None };
        let t = a.transforms().unwrap();
        let (_, rules) = t.for_host("api.test").unwrap();
        assert_eq!(rules.len(), 2);
        assert_eq!(rules[0].value.fill(&|n| (n == "key").then(|| "v".to_string())).unwrap(), "Bearer v");
        let missing = InjectArgs { secret: vec![], ..a.clone() };
        assert!(missing.transforms().is_err());
        let bad = InjectArgs { inject: vec!["api.test".into()], ..a };
        assert!(bad.transforms().is_err());
    }
}
