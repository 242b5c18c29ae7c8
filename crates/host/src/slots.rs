//! Distinct host uid ranges for concurrent sandboxes.
//!
//! Slot `n` owns uids `UID_BASE + n*65536 ..`. A slot is taken by holding an flock on
//! `slots/<n>`; the kernel drops the lock when its holder dies, and orphaned sandboxes are
//! reaped before any new slot is handed out, so two live sandboxes never share a range.

use crate::sys;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

const CAPACITY: u32 = 16_000;

pub struct Slots {
    dir: PathBuf,
}

/// A held slot; dropping it frees the range.
pub struct Slot {
    pub index: u32,
    _file: fs::File,
}

impl Slots {
    pub fn open(dir: &Path) -> io::Result<Slots> {
        fs::create_dir_all(dir)?;
        Ok(Slots { dir: dir.to_path_buf() })
    }

    pub fn capacity(&self) -> u32 {
        CAPACITY
    }

    pub fn acquire(&self) -> Option<Slot> {
        for index in 0..CAPACITY {
            let Ok(file) = fs::OpenOptions::new().create(true).truncate(false).write(true).open(self.dir.join(index.to_string())) else {
                continue;
            };
            if sys::flock_exclusive_nb(&file).unwrap_or(false) {
                return Some(Slot { index, _file: file });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_slots_are_distinct_and_freed_on_drop() {
        let dir = std::env::temp_dir().join(format!("cordon-slots-{}", std::process::id()));
        let slots = Slots::open(&dir).unwrap();
        let a = slots.acquire().unwrap();
        let b = slots.acquire().unwrap();
        assert_ne!(a.index, b.index);
        let ai = a.index;
        drop(a);
        let c = slots.acquire().unwrap();
        assert_eq!(c.index, ai);
        drop((b, c));
        fs::remove_dir_all(&dir).unwrap();
    }
}
