//! Volume tokens: the bearer credential of the content API (`/volumecontent/{id}/...`), which
//! the SDKs send instead of the API key. E2B mints a JWT; the SDKs never look inside, so a
//! token here is `cv1.<volume id>.<expiry>.<HMAC-SHA256>` under a key of the server's own
//! (`<state>/volumes/.token-key`), checked without any lookup. A token opens one volume only,
//! and only until it expires; a deleted volume's token opens nothing (ids are never reused).

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::ApiError;

/// How long a token is good for: a day, as the SDKs fetch a fresh one on every connect.
pub const TOKEN_SECS: u64 = 24 * 3600;
const PREFIX: &str = "cv1";

pub struct VolumeTokens {
    key: Vec<u8>,
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl VolumeTokens {
    pub fn open(volumes_dir: &Path) -> std::io::Result<VolumeTokens> {
        Ok(VolumeTokens { key: crate::auth::signing_key(&volumes_dir.join(".token-key"))? })
    }

    fn mac(&self, volume: &str, expires: u64) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("any key length");
        mac.update(format!("{PREFIX}\0{volume}\0{expires}").as_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    }

    /// A fresh token for `volume`.
    pub fn issue(&self, volume: &str) -> String {
        let expires = now() + TOKEN_SECS;
        format!("{PREFIX}.{volume}.{expires}.{}", self.mac(volume, expires))
    }

    /// Checks `Authorization: Bearer <token>` for `volume`.
    pub fn check(&self, authorization: Option<&str>, volume: &str) -> Result<(), ApiError> {
        let token = authorization
            .and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer ")))
            .map(str::trim)
            .ok_or_else(|| ApiError::unauthorized("missing volume token: send Authorization: Bearer <token> (the token of Volume.create or Volume.connect)"))?;
        let mut parts = token.splitn(4, '.');
        let (prefix, vol, expires, mac) = (parts.next(), parts.next(), parts.next(), parts.next());
        let valid = prefix == Some(PREFIX)
            && vol == Some(volume)
            && expires.and_then(|e| e.parse::<u64>().ok()).zip(mac).is_some_and(|(e, m)| crate::auth::ct_eq(m, &self.mac(volume, e)));
        if !valid {
            return Err(ApiError::unauthorized(format!("invalid volume token for volume {volume}")));
        }
        if expires.and_then(|e| e.parse::<u64>().ok()).is_some_and(|e| e < now()) {
            return Err(ApiError::unauthorized("the volume token has expired: get a fresh one with Volume.connect"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_opens_its_volume_only_and_not_once_tampered() {
        let dir = std::env::temp_dir().join(format!("cordon-vtok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = VolumeTokens::open(&dir).unwrap();
        let (a, b) = ("11111111-1111-4111-8111-111111111111", "22222222-2222-4222-8222-222222222222");
        let tok = t.issue(a);
        t.check(Some(&format!("Bearer {tok}")), a).unwrap();
        assert!(t.check(Some(&format!("Bearer {tok}")), b).is_err());
        assert!(t.check(None, a).is_err());
        assert!(t.check(Some(&tok), a).is_err(), "no Bearer scheme");
        // A later expiry with the old MAC, and another volume's id in a valid token.
        let parts: Vec<&str> = tok.split('.').collect();
        let forged = format!("cv1.{a}.{}.{}", parts[2].parse::<u64>().unwrap() + 1000, parts[3]);
        assert!(t.check(Some(&format!("Bearer {forged}")), a).is_err());
        // The key survives a restart: the same token is still good.
        let again = VolumeTokens::open(&dir).unwrap();
        again.check(Some(&format!("Bearer {tok}")), a).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
