use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::store::{format_rfc3339, parse_rfc3339, MAX_METADATA_ENTRIES, MAX_METADATA_KEY, MAX_METADATA_TOTAL, MAX_METADATA_VALUE, MAX_VALUE_LEN};
use crate::{Metadata, SecretError, SecretStore, MAX_SECRETS};

const VALUE: &str = "hunter2-very-secret-value";

/// A fresh state directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).unwrap();
        let p = std::env::temp_dir().join(format!("cordon-secret-test-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn meta(pairs: &[(&str, &str)]) -> Metadata {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn create_get_update_list_delete() {
    let t = TempDir::new();
    let s = SecretStore::open(t.path()).unwrap();
    let a = s.create("OpenAI-Key", VALUE, meta(&[("team", "ml")])).unwrap();
    assert!(crate::valid_id(&a.id), "{}", a.id);
    assert_eq!((a.name.as_str(), a.current_version), ("openai-key", 1));
    assert_eq!(a.created_at, a.updated_at);
    assert!(parse_rfc3339(&a.created_at).is_some(), "{}", a.created_at);
    assert_eq!(s.get(&a.id).unwrap(), a);
    assert_eq!(s.get("OPENAI-KEY").unwrap(), a);
    assert_eq!(s.get(&a.id.to_uppercase()).unwrap(), a);
    assert_eq!(s.value("openai-key").as_deref(), Some(VALUE));
    assert_eq!(s.value("OpenAI-KEY").as_deref(), Some(VALUE));
    assert_eq!(s.value("other"), None);

    // Duplicate names, in any case, are refused.
    assert!(matches!(s.create("openai-KEY", "x", Metadata::new()), Err(SecretError::NameTaken(n)) if n == "openai-key"));

    // Metadata None keeps the old; Some replaces it.
    let b = s.update("openai-key", "v2", None).unwrap();
    assert_eq!((b.current_version, &b.metadata), (2, &meta(&[("team", "ml")])));
    assert_eq!(b.created_at, a.created_at);
    assert!(b.updated_at >= a.updated_at);
    assert_eq!(s.value("openai-key").as_deref(), Some("v2"));
    let c = s.update(&a.id, "v3", Some(Metadata::new())).unwrap();
    assert_eq!((c.current_version, c.metadata.len()), (3, 0));
    assert!(matches!(s.update("nope", "v", None), Err(SecretError::NotFound(_))));

    let d = s.create("second", "v", Metadata::new()).unwrap();
    let e = s.create("third", "v", Metadata::new()).unwrap();
    let names: Vec<_> = s.list().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["openai-key", "second", "third"]);
    assert!(a.created_at < d.created_at && d.created_at < e.created_at);

    s.delete("SECOND").unwrap();
    assert!(matches!(s.delete("second"), Err(SecretError::NotFound(_))));
    assert!(matches!(s.get(&d.id), Err(SecretError::NotFound(_))));
    assert_eq!(s.value("second"), None);
    assert_eq!(s.len(), 2);
    assert!(!s.dir().join(format!("{}.json", d.id)).exists());
    // The name is free again.
    s.create("second", "again", Metadata::new()).unwrap();
}

#[test]
fn names() {
    let t = TempDir::new();
    let s = SecretStore::open(t.path()).unwrap();
    for bad in ["", "a b", "a/b", "ä", "a.b", "${x}", &"x".repeat(129)] {
        assert!(matches!(s.create(bad, "v", Metadata::new()), Err(SecretError::InvalidName(_))), "{bad:?}");
    }
    for reserved in ["sec_x", "SEC_abc", "Sec_"] {
        assert!(matches!(s.create(reserved, "v", Metadata::new()), Err(SecretError::ReservedName(_))), "{reserved:?}");
    }
    s.create(&"y".repeat(128), "v", Metadata::new()).unwrap();
    s.create("sec", "v", Metadata::new()).unwrap();
    s.create("a_sec_b-C9", "v", Metadata::new()).unwrap();
    assert_eq!(s.get("A_SEC_B-c9").unwrap().name, "a_sec_b-c9");
    // An ID-shaped key that is no secret's, and keys no secret can have, are simply not found.
    assert!(matches!(s.get("sec_00000000000000000000000000000000"), Err(SecretError::NotFound(_))));
    assert!(matches!(s.get("../../etc/passwd"), Err(SecretError::NotFound(_))));
}

#[test]
fn metadata_and_value_limits() {
    let t = TempDir::new();
    let s = SecretStore::open(t.path()).unwrap();
    let many: Metadata = (0..=MAX_METADATA_ENTRIES).map(|i| (format!("k{i}"), "v".into())).collect();
    assert!(matches!(s.create("a", "v", many), Err(SecretError::MetadataEntries { count: 33, .. })));
    let full: Metadata = (0..MAX_METADATA_ENTRIES).map(|i| (format!("k{i}"), "v".into())).collect();
    s.create("full", "v", full).unwrap();
    assert!(matches!(s.create("a", "v", meta(&[(&"k".repeat(MAX_METADATA_KEY + 1), "v")])), Err(SecretError::MetadataKey { .. })));
    s.create("longkey", "v", meta(&[(&"k".repeat(MAX_METADATA_KEY), "v")])).unwrap();
    assert!(matches!(s.create("a", "v", meta(&[("k", &"v".repeat(MAX_METADATA_VALUE + 1))])), Err(SecretError::MetadataValue { .. })));
    // Eight values of 1024 bytes are each allowed, but not together with their keys.
    let big: Metadata = (0..8).map(|i| (format!("k{i}"), "v".repeat(MAX_METADATA_VALUE))).collect();
    assert!(matches!(s.create("a", "v", big), Err(SecretError::MetadataTotal { total, .. }) if total > MAX_METADATA_TOTAL));
    // Update checks metadata too, and a refused update changes nothing.
    let many: Metadata = (0..=MAX_METADATA_ENTRIES).map(|i| (format!("k{i}"), "v".into())).collect();
    assert!(matches!(s.update("longkey", "new", Some(many)), Err(SecretError::MetadataEntries { .. })));
    assert_eq!((s.get("longkey").unwrap().current_version, s.value("longkey").as_deref()), (1, Some("v")));

    let huge = "x".repeat(MAX_VALUE_LEN + 1);
    let e = s.create("huge", &huge, Metadata::new()).unwrap_err();
    assert!(matches!(e, SecretError::ValueTooLarge { .. }));
    assert!(!e.to_string().contains("xxxx"), "{e}");
    s.create("max", &"x".repeat(MAX_VALUE_LEN), Metadata::new()).unwrap();
}

#[test]
fn the_store_has_a_limit() {
    let t = TempDir::new();
    let s = SecretStore::open(t.path()).unwrap();
    for i in 0..MAX_SECRETS {
        s.create(&format!("s{i}"), "v", Metadata::new()).unwrap();
    }
    assert!(matches!(s.create("one-more", "v", Metadata::new()), Err(SecretError::LimitReached { .. })));
    s.delete("s0").unwrap();
    s.create("one-more", "v", Metadata::new()).unwrap();
}

#[test]
fn pages() {
    let t = TempDir::new();
    let s = SecretStore::open(t.path()).unwrap();
    let made: Vec<String> = (0..5).map(|i| s.create(&format!("p{i}"), "v", Metadata::new()).unwrap().id).collect();
    let mut seen = Vec::new();
    let mut token = None;
    loop {
        let page = s.page(2, token.as_deref()).unwrap();
        assert!(page.items.len() <= 2);
        seen.extend(page.items.into_iter().map(|i| i.id));
        match page.next_token {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    assert_eq!(seen, made);
    // A page ending exactly at the last secret has no next token.
    assert_eq!(s.page(5, None).unwrap().next_token, None);
    assert_eq!(s.page(100, None).unwrap().items.len(), 5);
    // A token stays good when the secret it ends at is deleted.
    let first = s.page(2, None).unwrap();
    s.delete(&made[1]).unwrap();
    let ids: Vec<_> = s.page(100, first.next_token.as_deref()).unwrap().items.into_iter().map(|i| i.id).collect();
    assert_eq!(ids, &made[2..]);
    assert!(matches!(s.page(0, None), Err(SecretError::InvalidLimit { .. })));
    assert!(matches!(s.page(101, None), Err(SecretError::InvalidLimit { .. })));
    for bad in ["x", "1.x", "x.sec_00000000000000000000000000000000", ""] {
        assert!(matches!(s.page(1, Some(bad)), Err(SecretError::InvalidToken)), "{bad:?}");
    }
}

#[test]
fn survives_a_reopen() {
    let t = TempDir::new();
    let (a, b) = {
        let s = SecretStore::open(t.path()).unwrap();
        s.create("alpha", VALUE, meta(&[("k", "v")])).unwrap();
        let b = s.create("beta", "b", Metadata::new()).unwrap();
        let a = s.update("ALPHA", "new value", None).unwrap();
        (a, b)
    };
    let s = SecretStore::open(t.path()).unwrap();
    assert_eq!(s.list(), vec![a.clone(), b]);
    assert_eq!(s.value("alpha").as_deref(), Some("new value"));
    // Creation order goes on after a reopen.
    let c = s.create("gamma", "c", Metadata::new()).unwrap();
    assert!(c.created_at > a.created_at);
    assert_eq!(s.update(&a.id, "v3", None).unwrap().current_version, 3);
}

#[test]
fn modes_and_leftovers() {
    let t = TempDir::new();
    let s = SecretStore::open(t.path()).unwrap();
    let a = s.create("alpha", VALUE, Metadata::new()).unwrap();
    let dir = t.path().join("secrets");
    let file = dir.join(format!("{}.json", a.id));
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&file), 0o600);
    let euid = rustix::process::geteuid().as_raw();
    assert_eq!((std::fs::metadata(&dir).unwrap().uid(), std::fs::metadata(&file).unwrap().uid()), (euid, euid));
    s.update("alpha", "again", None).unwrap();
    assert_eq!(mode(&file), 0o600);
    // Only the record: no temporary file stays behind.
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(names, [format!("{}.json", a.id)]);
    drop(s);

    // Widened modes are narrowed at open; a crash's temporary file is removed; a damaged
    // record and a symlink are skipped, not fatal.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(dir.join(".sec_0.json.tmp"), "half").unwrap();
    std::fs::write(dir.join("sec_11111111111111111111111111111111.json"), format!("{{\"value\": \"{VALUE}\", \"current_version\": \"{VALUE}\"")).unwrap();
    std::os::unix::fs::symlink(&file, dir.join("sec_22222222222222222222222222222222.json")).unwrap();
    let s = SecretStore::open(t.path()).unwrap();
    assert_eq!((mode(&dir), mode(&file)), (0o700, 0o600));
    assert!(!dir.join(".sec_0.json.tmp").exists());
    assert_eq!(s.list().len(), 1);
    assert_eq!(s.value("alpha").as_deref(), Some("again"));
}

#[test]
fn a_file_or_symlink_where_the_directory_belongs_is_refused() {
    let t = TempDir::new();
    std::fs::write(t.path().join("secrets"), "").unwrap();
    assert!(matches!(SecretStore::open(t.path()), Err(SecretError::NotADirectory { .. })));
    // Nor is a symlink to a directory elsewhere followed.
    std::fs::remove_file(t.path().join("secrets")).unwrap();
    std::fs::create_dir(t.path().join("elsewhere")).unwrap();
    std::os::unix::fs::symlink("elsewhere", t.path().join("secrets")).unwrap();
    assert!(matches!(SecretStore::open(t.path()), Err(SecretError::NotADirectory { .. })));
}

#[test]
fn values_are_never_printed() {
    let t = TempDir::new();
    let s = SecretStore::open(t.path()).unwrap();
    let info = s.create("alpha", VALUE, meta(&[("k", "v")])).unwrap();
    let shown = format!("{s:?} {s:#?} {info:?} {:?}", s.list());
    assert!(!shown.contains(VALUE), "{shown}");
    assert!(shown.contains("secrets: 1"), "{shown}");
    let errors = [
        s.create("alpha", VALUE, Metadata::new()).unwrap_err(),
        s.update("missing", VALUE, None).unwrap_err(),
        s.create("bad name", VALUE, Metadata::new()).unwrap_err(),
    ];
    for e in errors {
        assert!(!format!("{e} {e:?}").contains(VALUE), "{e}");
    }
}

#[test]
fn times_are_rfc3339() {
    assert_eq!(format_rfc3339(0), "1970-01-01T00:00:00.000000Z");
    // 2024-02-29T12:34:56.789012Z, a leap day.
    let us = 1_709_210_096_789_012;
    assert_eq!(format_rfc3339(us), "2024-02-29T12:34:56.789012Z");
    assert_eq!(format_rfc3339(951_782_400_000_000), "2000-02-29T00:00:00.000000Z");
    assert_eq!(format_rfc3339(4_102_444_799_999_999), "2099-12-31T23:59:59.999999Z");
    let mut x = 1u64;
    for _ in 0..200 {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let us = x % 5_000_000_000_000_000;
        assert_eq!(parse_rfc3339(&format_rfc3339(us)), Some(us));
    }
    for bad in ["2024-02-29T12:34:56Z", "2024-02-29 12:34:56.000000Z", "2024-13-01T00:00:00.000000Z", "1969-12-31T23:59:59.000000Z"] {
        assert_eq!(parse_rfc3339(bad), None, "{bad}");
    }
}
