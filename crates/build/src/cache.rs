//! The step cache: what each build step produced, keyed by the digest of everything it
//! depended on (the step before it, what it does, its inputs), so an unchanged step is not run
//! again and a changed one invalidates every step after it (their keys chain through it).
//!
//! An entry is one small file, `<state>/build-cache/<key>.json`, naming the layer the step
//! made (or none); it counts only while that layer is still in the store, so a prune that took
//! the layer turns the entry into a miss, never into a broken image.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

#[derive(Serialize, Deserialize)]
struct Entry {
    /// The layer the step made; `None` when it changed no file.
    layer: Option<String>,
}

pub struct Cache {
    dir: PathBuf,
}

/// The key of a step: the previous key and each part, length-prefixed so that no two
/// different sequences of parts hash alike.
pub fn key(parent: &str, parts: &[&str]) -> String {
    let mut h = Sha256::new();
    h.update(parent.as_bytes());
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    format!("{:x}", h.finalize())
}

impl Cache {
    pub fn open(state_dir: &Path) -> std::io::Result<Cache> {
        let dir = state_dir.join("build-cache");
        fs::create_dir_all(&dir)?;
        Ok(Cache { dir })
    }

    /// What step `key` made, if it ran before: `Some(None)` for no layer.
    pub fn get(&self, key: &str, layer_exists: impl Fn(&str) -> bool) -> Option<Option<String>> {
        let text = fs::read_to_string(self.dir.join(format!("{key}.json"))).ok()?;
        let e: Entry = serde_json::from_str(&text).ok()?;
        match e.layer {
            Some(l) if !layer_exists(&l) => None,
            l => Some(l),
        }
    }

    /// Records what step `key` made. Only a cache: a failure to write costs a rerun next time.
    pub fn put(&self, key: &str, layer: Option<&str>) {
        let path = self.dir.join(format!("{key}.json"));
        let tmp = self.dir.join(format!(".{key}.{}", std::process::id()));
        let json = serde_json::to_vec(&Entry { layer: layer.map(str::to_string) }).expect("serializes");
        if let Err(e) = fs::write(&tmp, json).and_then(|()| fs::rename(&tmp, &path)) {
            tracing::warn!(path = %path.display(), error = %e, "cannot record a build step in the cache");
        }
    }
}
