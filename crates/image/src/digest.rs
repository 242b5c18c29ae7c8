//! Content digests (`sha256:<64 hex>`), the keys of the layer store, and a reader that computes
//! one while the bytes pass through.

use std::fmt;
use std::io::{self, Read};

use sha2::{Digest as _, Sha256};

/// A validated `sha256:` digest. Parsing is strict (lowercase hex, exact length) because the
/// hex part becomes a directory name in the store: a digest from a manifest must never be
/// able to name a path of its own choosing.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:<64 lowercase hex>`; anything else (other algorithms included) is refused
    /// with what is wrong.
    pub fn parse(s: &str) -> Result<Digest, String> {
        let Some(hex) = s.strip_prefix("sha256:") else {
            let shown: String = s.chars().take(80).collect();
            return Err(format!("digest '{}' is not a sha256 digest", shown.escape_debug()));
        };
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            let shown: String = s.chars().take(80).collect();
            return Err(format!("digest '{}' is malformed (want sha256: and 64 lowercase hex digits)", shown.escape_debug()));
        }
        Ok(Digest(s.to_string()))
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// The whole `sha256:<hex>` form.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 12 hex digits, as `docker` shows layer ids.
    pub fn short(&self) -> &str {
        &self.hex()[..12]
    }

    fn from_hasher(h: Sha256) -> Digest {
        Digest(format!("sha256:{:x}", h.finalize()))
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Passes bytes through and hashes them; [`HashReader::finish`] gives the digest of exactly
/// what was read.
pub(crate) struct HashReader<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
}

impl<R: Read> HashReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        HashReader { inner, hasher: Sha256::new(), bytes: 0 }
    }

    /// Reads what is left to the end, so the digest covers the whole stream (a tar reader
    /// stops at the end-of-archive marker, before the padding after it).
    pub(crate) fn drain(&mut self) -> io::Result<()> {
        io::copy(self, &mut io::sink()).map(|_| ())
    }

    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn finish(self) -> Digest {
        Digest::from_hasher(self.hasher)
    }
}

impl<R: Read> Read for HashReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// The digest of a byte string (manifests and configs, which are verified whole).
pub(crate) fn of_bytes(b: &[u8]) -> Digest {
    let mut h = Sha256::new();
    h.update(b);
    Digest::from_hasher(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_is_strict() {
        let good = format!("sha256:{}", "a1".repeat(32));
        assert_eq!(Digest::parse(&good).unwrap().hex(), "a1".repeat(32));
        for bad in [
            "sha512:00".to_string(),
            format!("sha256:{}", "A1".repeat(32)),
            format!("sha256:{}", "a".repeat(63)),
            format!("sha256:../../{}", "a".repeat(58)),
            format!("sha256:{}/", "a".repeat(63)),
            String::new(),
        ] {
            assert!(Digest::parse(&bad).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn hash_reader_hashes_what_passes() {
        let mut r = HashReader::new(&b"hello world"[..]);
        let mut first = [0u8; 5];
        r.read_exact(&mut first).unwrap();
        r.drain().unwrap();
        assert_eq!(HashReader::bytes(&r), 11);
        assert_eq!(r.finish(), of_bytes(b"hello world"));
        assert_eq!(of_bytes(b"").as_str(), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    }
}
