//! Header injection at egress: for requests to a host a rule names, the forwarder (outside the
//! sandbox) sets headers whose values may name secrets, so that code inside never holds the
//! credential it uses.
//!
//! A rule's key is an exact host name (`api.example.com`) or a wildcard (`*.example.com`: every
//! subdomain at any depth, not the apex); for a host, an exact key wins over wildcards, then the
//! longest matching wildcard, and rules are never merged. A value is text with placeholders:
//! `${e2b.secrets.NAME}` is the current value of the secret `NAME` (names are case-insensitive),
//! resolved by the forwarder for each request. Any other text, including `${...}` that does not
//! start with `e2b.`, is literal. A placeholder runs to the first `}`; an unterminated or nested
//! one is refused, as are identity tokens (`${e2b.identity.tokens.NAME}`), which need a token
//! issuer this server does not have.
//!
//! Rules do not open the network: the allow rules still decide where a connection may go.

use crate::SpecError;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Most distinct host keys in one sandbox's rules.
pub const MAX_DOMAINS: usize = 10;
/// Most headers one rule sets.
pub const MAX_HEADERS: usize = 20;
/// Longest host key.
pub const MAX_DOMAIN_LEN: usize = 128;
/// Longest header name.
pub const MAX_HEADER_NAME: usize = 64;
/// Longest header value as written (before placeholders are filled in).
pub const MAX_HEADER_VALUE: usize = 2048;
/// Most distinct secrets one host's rule may name.
pub const MAX_SECRETS_PER_DOMAIN: usize = 32;
/// Longest secret name.
pub const MAX_SECRET_NAME: usize = 128;

const SECRET_PREFIX: &str = "e2b.secrets.";
const IDENTITY_PREFIX: &str = "e2b.identity.";

/// Headers a rule may not set: they frame the message or the connection, which the forwarder
/// owns (setting them could split one request into two).
const RESERVED: [&str; 9] = ["host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te", "trailer", "proxy-connection"];

/// One piece of a header value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Text(String),
    /// A secret's canonical (lower-case) name.
    Secret(String),
}

/// A header value with its placeholders parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    raw: String,
    parts: Vec<Part>,
}

/// A value could not be filled in at request time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FillError {
    #[error("secret '{0}' does not exist (any more): create it, or change the sandbox's network rules")]
    MissingSecret(String),
    /// The value would not be a valid header value (a secret holding a line break, say); the
    /// message never includes the value.
    #[error("secret '{0}' holds characters a header value cannot carry (control characters or line breaks)")]
    BadValue(String),
}

impl Template {
    /// Parses a header value as written in a rule.
    pub fn parse(raw: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut text = String::new();
        let mut rest = raw;
        while let Some(at) = rest.find("${") {
            let after = &rest[at + 2..];
            if !after.starts_with("e2b.") {
                // Opaque text: `${` that is no placeholder of ours stays as written.
                text.push_str(&rest[..at + 2]);
                rest = after;
                continue;
            }
            text.push_str(&rest[..at]);
            let Some(end) = after.find('}') else { return Err(format!("placeholder '${{{after}' is not closed with '}}'")) };
            let inner = &after[..end];
            if inner.contains("${") {
                return Err(format!("placeholder '${{{inner}}}' is nested in another"));
            }
            if let Some(name) = inner.strip_prefix(SECRET_PREFIX) {
                let name = secret_name(name).ok_or_else(|| format!("'{name}' in '${{{inner}}}' is not a secret name (1 to {MAX_SECRET_NAME} of A-Z, a-z, 0-9, _ and -)"))?;
                if !text.is_empty() {
                    parts.push(Part::Text(std::mem::take(&mut text)));
                }
                parts.push(Part::Secret(name));
            } else if inner.starts_with(IDENTITY_PREFIX) {
                return Err(format!("'${{{inner}}}': identity tokens are not supported by this server; use a secret (${{e2b.secrets.NAME}})"));
            } else {
                return Err(format!("'${{{inner}}}' is not a known placeholder: use ${{e2b.secrets.NAME}}"));
            }
            rest = &after[end + 1..];
        }
        text.push_str(rest);
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        Ok(Template { raw: raw.to_string(), parts })
    }

    /// The value as written.
    pub fn raw(&self) -> &str {
        &self.raw
    }

    /// The secrets the value names.
    pub fn secrets(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Secret(s) => Some(s.as_str()),
            Part::Text(_) => None,
        })
    }

    /// The value with every placeholder filled in by `lookup`.
    pub fn fill(&self, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, FillError> {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::Secret(name) => {
                    let v = lookup(name).ok_or_else(|| FillError::MissingSecret(name.clone()))?;
                    if !valid_value(&v) {
                        return Err(FillError::BadValue(name.clone()));
                    }
                    out.push_str(&v);
                }
            }
        }
        Ok(out)
    }
}

/// A secret's canonical name: 1 to 128 of `[A-Za-z0-9_-]`, lower-cased.
pub fn secret_name(name: &str) -> Option<String> {
    let ok = !name.is_empty() && name.len() <= MAX_SECRET_NAME && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    ok.then(|| name.to_ascii_lowercase())
}

/// RFC 9110's token characters.
fn valid_header_name(n: &str) -> bool {
    !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Visible characters, spaces and tabs (and obs-text); never a control character or a line
/// break, so a value can never end a header early.
pub fn valid_value(v: &str) -> bool {
    v.bytes().all(|b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

/// One header a rule sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderRule {
    /// As written (the forwarder compares names case-insensitively).
    pub name: String,
    pub value: Template,
}

/// A sandbox's injection rules, by host key (`api.example.com` or `*.example.com`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transforms {
    rules: BTreeMap<String, Vec<HeaderRule>>,
}

impl Transforms {
    /// Builds and checks rules from `(host key, headers)` pairs as the API and the command line
    /// give them. Keys are lower-cased; two keys equal but for case are refused.
    pub fn new<I, H>(rules: I) -> Result<Transforms, SpecError>
    where
        I: IntoIterator<Item = (String, H)>,
        H: IntoIterator<Item = (String, String)>,
    {
        let err = |m: String| SpecError::new("rules", m);
        let mut out = BTreeMap::new();
        for (key, headers) in rules {
            let k = host_key(&key).map_err(err)?;
            if out.contains_key(&k) {
                return Err(err(format!("'{key}' is given twice (keys are case-insensitive)")));
            }
            let mut list: Vec<HeaderRule> = Vec::new();
            let mut secrets = BTreeSet::new();
            for (name, value) in headers {
                if !valid_header_name(&name) || name.len() > MAX_HEADER_NAME {
                    return Err(err(format!("'{name}' (rule for {k}) is not a header name: use up to {MAX_HEADER_NAME} token characters")));
                }
                if RESERVED.contains(&name.to_ascii_lowercase().as_str()) {
                    return Err(err(format!("header '{name}' (rule for {k}) frames the request and cannot be set by a rule")));
                }
                if list.iter().any(|h| h.name.eq_ignore_ascii_case(&name)) {
                    return Err(err(format!("header '{name}' is set twice in the rule for {k}")));
                }
                if value.len() > MAX_HEADER_VALUE || !valid_value(&value) {
                    return Err(err(format!("the value of header '{name}' (rule for {k}) must be at most {MAX_HEADER_VALUE} characters without control characters")));
                }
                let value = Template::parse(&value).map_err(|m| err(format!("header '{name}' (rule for {k}): {m}")))?;
                secrets.extend(value.secrets().map(str::to_string));
                list.push(HeaderRule { name, value });
            }
            if list.len() > MAX_HEADERS {
                return Err(err(format!("the rule for {k} sets {} headers: at most {MAX_HEADERS}", list.len())));
            }
            if secrets.len() > MAX_SECRETS_PER_DOMAIN {
                return Err(err(format!("the rule for {k} names {} secrets: at most {MAX_SECRETS_PER_DOMAIN}", secrets.len())));
            }
            out.insert(k, list);
        }
        if out.len() > MAX_DOMAINS {
            return Err(err(format!("{} hosts have rules: at most {MAX_DOMAINS}", out.len())));
        }
        Ok(Transforms { rules: out })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The rules by key, as given (keys lower-cased).
    pub fn rules(&self) -> impl Iterator<Item = (&str, &[HeaderRule])> {
        self.rules.iter().map(|(k, v)| (k.as_str(), v.as_slice()))
    }

    /// Every secret any rule names.
    pub fn secrets(&self) -> BTreeSet<&str> {
        self.rules.values().flatten().flat_map(|h| h.value.secrets()).collect()
    }

    /// The rule for `host` (a normalized name): the exact key, else the longest wildcard that
    /// matches. `None`: requests to it are not touched (nor intercepted).
    pub fn for_host(&self, host: &str) -> Option<(&str, &[HeaderRule])> {
        if let Some((k, v)) = self.rules.get_key_value(host) {
            return Some((k, v));
        }
        self.rules
            .iter()
            .filter(|(k, _)| k.strip_prefix("*.").is_some_and(|suffix| host.len() > suffix.len() + 1 && host.ends_with(suffix) && host.as_bytes()[host.len() - suffix.len() - 1] == b'.'))
            .max_by_key(|(k, _)| k.len())
            .map(|(k, v)| (k.as_str(), v.as_slice()))
    }
}

/// A rule's key, checked and lower-cased: a DNS name, or `*.` and one.
fn host_key(key: &str) -> Result<String, String> {
    if key.is_empty() || key.len() > MAX_DOMAIN_LEN {
        return Err(format!("host '{key}' must be 1 to {MAX_DOMAIN_LEN} characters"));
    }
    let (wild, name) = match key.strip_prefix("*.") {
        Some(n) => (true, n),
        None => (false, key),
    };
    let bad = || format!("host '{key}' is not a DNS name or '*.' and one");
    if name.parse::<std::net::IpAddr>().is_ok() || name.contains('*') {
        return Err(bad());
    }
    let n = crate::normalize_name(name).ok_or_else(bad)?;
    // A bare TLD wildcard (`*.com`) would inject into every host under it.
    if wild && !n.contains('.') {
        return Err(format!("host '{key}' is too broad: a wildcard needs at least two labels after '*.'"));
    }
    Ok(if wild { format!("*.{n}") } else { n })
}

/// On disk and in records: `{"<host key>": {"<Header>": "<value as written>"}}`.
impl Serialize for Transforms {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let m: BTreeMap<&str, Vec<(&str, &str)>> = self.rules.iter().map(|(k, v)| (k.as_str(), v.iter().map(|h| (h.name.as_str(), h.value.raw())).collect())).collect();
        m.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Transforms {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let m = BTreeMap::<String, Vec<(String, String)>>::deserialize(d)?;
        Transforms::new(m).map_err(|e| serde::de::Error::custom(e.reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(rules: &[(&str, &[(&str, &str)])]) -> Result<Transforms, SpecError> {
        Transforms::new(rules.iter().map(|(k, hs)| (k.to_string(), hs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect::<Vec<_>>())))
    }

    #[test]
    fn placeholders_parse_and_fill() {
        let v = Template::parse("Bearer ${e2b.secrets.API_Key} and ${HOME} ${e2b.secrets.x}!").unwrap();
        assert_eq!(v.secrets().collect::<Vec<_>>(), ["api_key", "x"]);
        let got = v.fill(&|n| Some(format!("<{n}>"))).unwrap();
        assert_eq!(got, "Bearer <api_key> and ${HOME} <x>!");
        assert_eq!(v.fill(&|_| None), Err(FillError::MissingSecret("api_key".into())));
        assert!(matches!(v.fill(&|_| Some("a\r\nX-Evil: 1".into())), Err(FillError::BadValue(_))));
        for bad in ["${e2b.secrets.x", "${e2b.secrets.${e2b.secrets.y}}", "${e2b.secrets.}", "${e2b.secrets.a b}", "${e2b.identity.tokens.aws}", "${e2b.other}"] {
            assert!(Template::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Template::parse("plain").unwrap().fill(&|_| None).unwrap(), "plain");
    }

    #[test]
    fn exact_wins_then_the_longest_wildcard_and_never_the_apex() {
        let r = t(&[("*.api.test", &[("A", "wild")]), ("*.a.api.test", &[("A", "longer")]), ("EXACT.api.test", &[("A", "exact")])]).unwrap();
        let pick = |h: &str| r.for_host(h).map(|(_, v)| v[0].value.raw().to_string());
        assert_eq!(pick("a.api.test").as_deref(), Some("wild"));
        assert_eq!(pick("x.a.api.test").as_deref(), Some("longer"));
        assert_eq!(pick("exact.api.test").as_deref(), Some("exact"));
        assert_eq!(pick("deep.x.api.test").as_deref(), Some("wild"));
        assert_eq!(pick("api.test"), None);
        assert_eq!(pick("xapi.test"), None);
    }

    #[test]
    fn limits_and_bad_input_are_refused() {
        assert!(t(&[("*", &[])]).is_err());
        assert!(t(&[("*.com", &[])]).is_err());
        assert!(t(&[("198.51.100.1", &[])]).is_err());
        assert!(t(&[("a.test", &[]), ("A.test", &[])]).is_err());
        assert!(t(&[("a.test", &[("Bad Name", "v")])]).is_err());
        assert!(t(&[("a.test", &[("Host", "v")])]).is_err());
        assert!(t(&[("a.test", &[("X", "a\nb")])]).is_err());
        assert!(t(&[("a.test", &[("X", "1"), ("x", "2")])]).is_err());
        let long = "v".repeat(MAX_HEADER_VALUE + 1);
        assert!(t(&[("a.test", &[("X", long.as_str())])]).is_err());
        let many: Vec<(String, Vec<(String, String)>)> = (0..=MAX_DOMAINS).map(|i| (format!("h{i}.test"), vec![])).collect();
        assert!(Transforms::new(many).is_err());
        let headers: Vec<(String, String)> = (0..=MAX_HEADERS).map(|i| (format!("X-{i}"), "v".into())).collect();
        assert!(Transforms::new([("a.test".to_string(), headers)]).is_err());
        let secrets = (0..=MAX_SECRETS_PER_DOMAIN).map(|i| format!("${{e2b.secrets.s{i}}}")).collect::<String>();
        assert!(t(&[("a.test", &[("X", secrets.as_str())])]).is_err());
    }

    #[test]
    fn round_trips_through_json() {
        let r = t(&[("*.api.test", &[("Authorization", "Bearer ${e2b.secrets.k}"), ("X-Team", "blue")])]).unwrap();
        let j = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Transforms>(&j).unwrap(), r);
        assert_eq!(r.secrets().into_iter().collect::<Vec<_>>(), ["k"]);
    }
}
