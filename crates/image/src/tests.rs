use super::*;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!(
            "cordon-image-test-{}-{n}-{tag}",
            std::process::id()
        ));
        let _ = fsutil::remove_tree(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p.canonicalize().unwrap())
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fsutil::remove_tree(&self.0);
    }
}

/// Records everything reported, for assertions.
#[derive(Default)]
struct Rec {
    stages: Vec<(usize, usize, String)>,
    lines: Vec<String>,
}

impl Progress for Rec {
    fn stage(&mut self, index: usize, total: usize, name: &str) {
        self.stages.push((index, total, name.to_string()));
    }
    fn line(&mut self, text: &str) {
        self.lines.push(text.to_string());
    }
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h
}

/// Sets a raw name, bypassing the builder's refusal of `..` paths.
fn raw_name(h: &mut tar::Header, name: &str) {
    let field = &mut h.as_old_mut().name;
    field.fill(0);
    field[..name.len()].copy_from_slice(name.as_bytes());
    h.set_cksum();
}

fn add_file(b: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32, data: &[u8]) {
    let mut h = header(tar::EntryType::Regular, mode, data.len() as u64);
    b.append_data(&mut h, path, data).unwrap();
}

fn add_dir(b: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32) {
    let mut h = header(tar::EntryType::Directory, mode, 0);
    b.append_data(&mut h, path, io::empty()).unwrap();
}

fn add_link(b: &mut tar::Builder<Vec<u8>>, kind: tar::EntryType, path: &str, target: &str) {
    let mut h = header(kind, 0o777, 0);
    b.append_link(&mut h, path, target).unwrap();
}

/// A pax extended header carrying one xattr for the next entry.
fn add_xattr(b: &mut tar::Builder<Vec<u8>>, key: &str, value: &str) {
    let body = format!(" SCHILY.xattr.{key}={value}\n");
    let mut len = body.len();
    while format!("{len}{body}").len() != len {
        len = format!("{len}{body}").len();
    }
    let record = format!("{len}{body}");
    let mut h = header(tar::EntryType::XHeader, 0o644, record.len() as u64);
    raw_name(&mut h, "PaxHeaders/x");
    b.append(&h, record.as_bytes()).unwrap();
}

fn finish(b: tar::Builder<Vec<u8>>, dir: &Path, file: &str) -> PathBuf {
    let p = dir.join(file);
    fs::write(&p, b.into_inner().unwrap()).unwrap();
    p
}

/// A small rootfs exercising every entry kind, plus a `../escape` entry.
fn sample_tar(dir: &Path, file: &str, marker: &str) -> PathBuf {
    let mut b = tar::Builder::new(Vec::new());
    add_dir(&mut b, "./", 0o755);
    add_dir(&mut b, "etc", 0o755);
    add_file(
        &mut b,
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n",
    );
    add_dir(&mut b, "bin", 0o755);
    let mut h = header(tar::EntryType::Regular, 0o4755, marker.len() as u64);
    h.set_uid(1234);
    h.set_gid(5678);
    add_xattr(&mut b, "user.cordon", "yes");
    b.append_data(&mut h, "bin/hello", marker.as_bytes())
        .unwrap();
    add_link(&mut b, tar::EntryType::Symlink, "bin/sh", "hello");
    add_link(&mut b, tar::EntryType::Symlink, "bin/abs", "/etc/passwd");
    add_link(&mut b, tar::EntryType::Link, "bin/hello2", "bin/hello");
    // Read-only directory with content: must still unpack and be removable.
    add_dir(&mut b, "secret", 0o500);
    add_file(&mut b, "secret/file", 0o400, b"s");
    // Device node: skipped on purpose.
    let mut dev = header(tar::EntryType::Char, 0o666, 0);
    dev.set_device_major(1).unwrap();
    dev.set_device_minor(3).unwrap();
    b.append_data(&mut dev, "dev/null", io::empty()).unwrap();
    // Traversal attempt.
    let mut esc = header(tar::EntryType::Regular, 0o644, 6);
    raw_name(&mut esc, "../escape");
    b.append(&esc, &b"pwned\n"[..]).unwrap();
    let mut esc2 = header(tar::EntryType::Regular, 0o644, 6);
    raw_name(&mut esc2, "etc/../../escape2");
    b.append(&esc2, &b"pwned\n"[..]).unwrap();
    finish(b, dir, file)
}

fn find_named(root: &Path, needle: &str) -> Vec<PathBuf> {
    let mut hits = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if e.file_name().to_string_lossy().starts_with(needle) {
                hits.push(p.clone());
            }
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(p);
            }
        }
    }
    hits
}

fn staging_leftovers(store_root: &Path) -> Vec<String> {
    fs::read_dir(store_root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".staging-"))
        .collect()
}

#[test]
fn name_validation() {
    for ok in [
        "base",
        "a",
        "0",
        "code-interpreter-v1",
        "x.y_z-1",
        &"a".repeat(63),
    ] {
        validate_name(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    for bad in [
        "",
        "Base",
        "-x",
        ".hidden",
        "_x",
        "a/b",
        "a b",
        "..",
        "é",
        &"a".repeat(64),
        "x\n",
    ] {
        let e = validate_name(bad).expect_err(bad);
        assert!(matches!(e, ImageError::InvalidName { .. }), "{bad}");
        let msg = e.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("names are 1 to 63 characters"), "{msg}");
    }
    assert_eq!(
        validate_name("Foo").unwrap_err().to_string(),
        "invalid image name 'Foo': it starts with 'F'; names are 1 to 63 characters of a-z, 0-9, \
         '.', '_' and '-' and start with a letter or digit"
    );
    assert!(validate_name("fOo")
        .unwrap_err()
        .to_string()
        .contains("it contains an uppercase letter"));
}

#[test]
fn recipe_table() {
    assert_eq!(recipes(), &["base", "code-interpreter-v1"]);
    for r in recipe::RECIPES {
        validate_name(r.name).unwrap();
        for f in r.files {
            assert!(
                f.path.starts_with('/'),
                "{}: {} is not absolute",
                r.name,
                f.path
            );
            assert!(
                !f.contents.is_empty() && f.mode & 0o022 == 0,
                "{}: {}",
                r.name,
                f.path
            );
            // The build checks that what it wrote is there.
            let rel = f.path.trim_start_matches('/');
            assert!(
                r.must_exist.iter().any(|g| g.contains(&rel)) || f.path.starts_with("/etc/"),
                "{}: {} is not checked",
                r.name,
                f.path
            );
        }
        if let Some(s) = &r.start {
            let cmd = s.to_command();
            assert!(!cmd.cmd.is_empty() && cmd.ready_port.is_some() && cmd.ready_timeout_secs > 0);
        }
    }
    let ci = recipe::find("code-interpreter-v1").unwrap();
    let start = ci.start.as_ref().unwrap().to_command();
    assert_eq!(start.ready_port, Some(recipe::INTERP_PORT));
    assert_eq!(start.user, "user");
    // The interpreter image is the base image plus its own packages.
    let all = ci.packages.concat();
    for p in recipe::find("base").unwrap().packages.concat() {
        assert!(all.contains(&p), "{p}");
    }
    assert!(all.contains(&"python3-ipykernel") && all.contains(&"python3-pandas"));
}

#[test]
fn recipe_files_are_written_root_owned_with_their_mode() {
    let t = TempDir::new("files");
    let r = recipe::find("code-interpreter-v1").unwrap();
    build::write_files(r, t.path()).unwrap();
    let server = t.path().join("opt/cordon/interp/server.py");
    let meta = fs::metadata(&server).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o644);
    assert_eq!(
        fs::metadata(server.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o7777,
        0o755
    );
    if fsutil::is_root() {
        assert_eq!(meta.uid(), 0);
    }
    let text = fs::read_to_string(&server).unwrap();
    assert!(text.contains("def translate("));
    // Written again (a rebuild into a fresh root), the result is the same.
    build::write_files(r, t.path()).unwrap();
    assert_eq!(fs::read_to_string(&server).unwrap(), text);
}

#[test]
fn import_get_list_remove() {
    let t = TempDir::new("import");
    let store = Store::open(&t.path().join("state")).unwrap();
    let tarball = sample_tar(t.path(), "rootfs.tar", "hello v1\n");
    let mut rec = Rec::default();
    let img = store.import_tar("demo", &tarball, &mut rec).unwrap();

    assert_eq!(img.name, "demo");
    assert_eq!(img.layers[0], store.root.join("demo/rootfs"));
    assert_eq!(img.meta.default_user, "user");
    assert_eq!(img.meta.source, format!("import {}", tarball.display()));
    assert_eq!(
        img.meta.env,
        vec![("PATH".to_string(), recipe::DEFAULT_PATH.to_string())]
    );
    assert!(img.meta.size_bytes > 0);
    assert_eq!(
        rec.stages.iter().map(|s| s.2.as_str()).collect::<Vec<_>>(),
        ["unpacking", "finalizing"]
    );
    assert!(
        rec.lines.iter().any(|l| l.contains("skipped '../escape'")),
        "{:?}",
        rec.lines
    );

    let r = &img.layers[0];
    assert_eq!(
        fs::read_to_string(r.join("bin/hello")).unwrap(),
        "hello v1\n"
    );
    let hello = fs::symlink_metadata(r.join("bin/hello")).unwrap();
    assert_eq!(hello.mode() & 0o7777, 0o4755);
    assert_eq!(
        fs::read_link(r.join("bin/sh")).unwrap(),
        PathBuf::from("hello")
    );
    assert_eq!(
        fs::read_link(r.join("bin/abs")).unwrap(),
        PathBuf::from("/etc/passwd")
    );
    let hello2 = fs::symlink_metadata(r.join("bin/hello2")).unwrap();
    assert_eq!(hello.ino(), hello2.ino());
    assert_eq!(
        fs::symlink_metadata(r.join("secret")).unwrap().mode() & 0o7777,
        0o500
    );
    assert!(!r.join("dev/null").exists(), "device nodes are skipped");
    for d in ["proc", "dev", "sys", "tmp"] {
        assert!(r.join(d).is_dir(), "{d}");
    }
    assert_eq!(fs::metadata(r.join("tmp")).unwrap().mode() & 0o7777, 0o1777);
    if fsutil::is_root() {
        assert_eq!((hello.uid(), hello.gid()), (1234, 5678));
        let c = std::ffi::CString::new(r.join("bin/hello").as_os_str().as_encoded_bytes()).unwrap();
        let mut buf = [0u8; 16];
        // SAFETY: valid NUL-terminated strings and a buffer of the given
        // length, all outliving the call.
        let n = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                c"user.cordon".as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        assert_eq!(n, 3, "xattr not preserved: {}", io::Error::last_os_error());
        assert_eq!(&buf[..3], b"yes");
    }
    // Nothing escaped anywhere: not in the store, not next to the test dir.
    assert!(
        find_named(t.path(), "escape").is_empty(),
        "{:?}",
        find_named(t.path(), "escape")
    );
    assert!(!t.path().parent().unwrap().join("escape").exists());
    assert!(!t.path().parent().unwrap().join("escape2").exists());
    assert!(staging_leftovers(&store.root).is_empty());

    // Reopening sees the same thing.
    let again = Store::open(&t.path().join("state"))
        .unwrap()
        .get("demo")
        .unwrap();
    assert_eq!(again.meta, img.meta);

    // A second image and the listing.
    let plain = {
        let mut b = tar::Builder::new(Vec::new());
        add_file(
            &mut b,
            "etc/passwd",
            0o644,
            b"root:x:0:0:root:/root:/bin/sh\n",
        );
        finish(b, t.path(), "plain.tar")
    };
    let other = store.import_tar("alpha", &plain, &mut NoProgress).unwrap();
    assert_eq!(other.meta.default_user, "root");
    let names: Vec<String> = store.list().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["alpha", "demo"]);

    store.remove("demo").unwrap();
    assert!(matches!(
        store.get("demo"),
        Err(ImageError::NotFound { .. })
    ));
    assert!(matches!(
        store.remove("demo"),
        Err(ImageError::NotFound { .. })
    ));
    assert_eq!(store.list().unwrap().len(), 1);
    assert!(!store.root.join("demo").exists());
    assert!(staging_leftovers(&store.root).is_empty());
}

#[test]
fn gzip_import() {
    use flate2::{write::GzEncoder, Compression};
    let t = TempDir::new("gzip");
    let store = Store::open(t.path()).unwrap();
    let plain = sample_tar(t.path(), "rootfs.tar", "gz\n");
    let gz_path = t.path().join("rootfs.tar.gz");
    let mut enc = GzEncoder::new(fs::File::create(&gz_path).unwrap(), Compression::fast());
    io::copy(&mut fs::File::open(&plain).unwrap(), &mut enc).unwrap();
    enc.finish().unwrap();
    let img = store.import_tar("gz", &gz_path, &mut NoProgress).unwrap();
    assert_eq!(
        fs::read_to_string(img.layers[0].join("bin/hello")).unwrap(),
        "gz\n"
    );
}

#[test]
fn reimport_replaces_existing_image() {
    let t = TempDir::new("reimport");
    let store = Store::open(t.path()).unwrap();
    let v1 = sample_tar(t.path(), "v1.tar", "v1\n");
    let v2 = sample_tar(t.path(), "v2.tar", "v2 is longer\n");
    store.import_tar("app", &v1, &mut NoProgress).unwrap();
    let img = store.import_tar("app", &v2, &mut NoProgress).unwrap();
    assert_eq!(
        fs::read_to_string(img.layers[0].join("bin/hello")).unwrap(),
        "v2 is longer\n"
    );
    assert_eq!(
        store.get("app").unwrap().meta.source,
        format!("import {}", v2.display())
    );
    assert_eq!(store.list().unwrap().len(), 1);
    assert!(
        staging_leftovers(&store.root).is_empty(),
        "old image must be deleted"
    );

    // A failing re-import leaves the existing image untouched.
    let junk = t.path().join("junk.tar");
    fs::write(&junk, vec![b'x'; 4096]).unwrap();
    assert!(store.import_tar("app", &junk, &mut NoProgress).is_err());
    assert_eq!(
        fs::read_to_string(store.get("app").unwrap().layers[0].join("bin/hello")).unwrap(),
        "v2 is longer\n"
    );
}

#[test]
fn concurrent_imports_serialize() {
    let t = TempDir::new("concurrent");
    let store = Store::open(t.path()).unwrap();
    let tars: Vec<PathBuf> = (0..4)
        .map(|i| sample_tar(t.path(), &format!("{i}.tar"), &format!("v{i}\n")))
        .collect();
    std::thread::scope(|s| {
        for tb in &tars {
            let store = store.clone();
            s.spawn(move || store.import_tar("same", tb, &mut NoProgress).unwrap());
        }
    });
    let img = store.get("same").unwrap();
    let content = fs::read_to_string(img.layers[0].join("bin/hello")).unwrap();
    assert!(content.starts_with('v'));
    assert!(staging_leftovers(&store.root).is_empty());
}

#[test]
fn symlink_cannot_be_used_to_write_outside() {
    let t = TempDir::new("symlink-escape");
    let outside = t.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let store = Store::open(&t.path().join("state")).unwrap();

    let mut b = tar::Builder::new(Vec::new());
    add_file(&mut b, "etc/passwd", 0o644, b"root:x:0:0::/root:/bin/sh\n");
    add_link(
        &mut b,
        tar::EntryType::Symlink,
        "evil",
        outside.to_str().unwrap(),
    );
    add_file(&mut b, "evil/pwned", 0o644, b"pwned\n");
    let tarball = finish(b, t.path(), "evil.tar");
    let err = store
        .import_tar("evil", &tarball, &mut NoProgress)
        .unwrap_err();
    assert!(matches!(err, ImageError::Import { .. }), "{err}");
    assert!(err.to_string().contains("evil/pwned"), "{err}");
    eprintln!("{err}");
    assert!(
        fs::read_dir(&outside).unwrap().next().is_none(),
        "wrote outside the image"
    );

    // A symlinked directory replacing a real one, then a file through it.
    let mut b = tar::Builder::new(Vec::new());
    add_link(
        &mut b,
        tar::EntryType::Symlink,
        "etc",
        outside.to_str().unwrap(),
    );
    add_file(&mut b, "etc/passwd", 0o644, b"pwned\n");
    let tarball = finish(b, t.path(), "evil2.tar");
    assert!(store.import_tar("evil", &tarball, &mut NoProgress).is_err());
    assert!(
        fs::read_dir(&outside).unwrap().next().is_none(),
        "wrote outside the image"
    );

    // A hard link to a file outside.
    let host_file = outside.join("host");
    fs::write(&host_file, "host\n").unwrap();
    let mut b = tar::Builder::new(Vec::new());
    add_link(
        &mut b,
        tar::EntryType::Link,
        "stolen",
        host_file.to_str().unwrap(),
    );
    let tarball = finish(b, t.path(), "evil3.tar");
    assert!(store.import_tar("evil", &tarball, &mut NoProgress).is_err());
    assert_eq!(fs::metadata(&host_file).unwrap().nlink(), 1);

    assert!(matches!(
        store.get("evil"),
        Err(ImageError::NotFound { .. })
    ));
    assert!(staging_leftovers(&store.root).is_empty());
}

#[test]
fn invalid_tarballs_leave_nothing_behind() {
    let t = TempDir::new("invalid");
    let store = Store::open(t.path()).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty.tar", vec![], "the file is empty"),
        ("zeros.tar", vec![0; 10240], "it contains no files"),
        (
            "garbage.tar",
            b"this is not a tar archive\n".repeat(100),
            "it is not a valid tar archive",
        ),
        (
            "x.tar.xz",
            b"\xfd7zXZ\x00\x00\x04".to_vec(),
            "xz-compressed",
        ),
    ];
    for (file, data, expect) in cases {
        let p = t.path().join(file);
        fs::write(&p, data).unwrap();
        let err = store.import_tar("bad", &p, &mut NoProgress).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ImageError::Import { .. }), "{msg}");
        assert!(msg.contains(expect), "{file}: {msg}");
        assert!(
            msg.starts_with(&format!("cannot import '{}' as image 'bad': ", p.display())),
            "{msg}"
        );
        assert!(!msg.contains('\n'), "{msg}");
    }
    // Only the root directory entry.
    let mut b = tar::Builder::new(Vec::new());
    add_dir(&mut b, "./", 0o755);
    let p = finish(b, t.path(), "rootonly.tar");
    assert!(store
        .import_tar("bad", &p, &mut NoProgress)
        .unwrap_err()
        .to_string()
        .contains("no files"));
    // Truncated in the middle of a file.
    let full = fs::read(sample_tar(t.path(), "full.tar", &"x".repeat(5000))).unwrap();
    let p = t.path().join("truncated.tar");
    fs::write(&p, &full[..full.len() / 2]).unwrap();
    assert!(matches!(
        store.import_tar("bad", &p, &mut NoProgress),
        Err(ImageError::Import { .. })
    ));
    // Missing file.
    let err = store
        .import_tar("bad", &t.path().join("nope.tar"), &mut NoProgress)
        .unwrap_err();
    assert!(err.to_string().contains("check the path"), "{err}");

    assert!(matches!(store.get("bad"), Err(ImageError::NotFound { .. })));
    assert!(staging_leftovers(&store.root).is_empty());
    assert!(store.list().unwrap().is_empty());
}

#[test]
fn stale_staging_dirs_are_cleaned() {
    let t = TempDir::new("stale");
    let store = Store::open(t.path()).unwrap();
    let root = store.root.clone();
    // Crashed runs for "foo" (plain and the replace fallback).
    fs::create_dir_all(root.join(".staging-foo-99999999/rootfs/usr")).unwrap();
    fs::write(root.join(".staging-foo-99999999/rootfs/usr/x"), "x").unwrap();
    fs::create_dir_all(root.join(".staging-foo-12-old/rootfs")).unwrap();
    // Looks similar but belongs to image "foo-1": must survive.
    fs::create_dir_all(root.join(".staging-foo-1-123")).unwrap();
    // A half-made image dir that is not valid: never listed.
    fs::create_dir_all(root.join("half/rootfs")).unwrap();

    assert!(store.list().unwrap().is_empty());
    assert!(matches!(store.get("half"), Err(ImageError::Corrupt { .. })));

    let tb = sample_tar(t.path(), "r.tar", "x\n");
    store.import_tar("foo", &tb, &mut NoProgress).unwrap();
    let left = staging_leftovers(&root);
    assert_eq!(left, [".staging-foo-1-123"]);
    let names: Vec<String> = store.list().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["foo"]);
}

#[test]
fn error_messages() {
    let t = TempDir::new("errors");
    let store = Store::open(t.path()).unwrap();
    assert_eq!(
        store.get("foo").unwrap_err().to_string(),
        "image 'foo' not found: build it with 'cordon image build foo' or import one with \
         'cordon image import foo rootfs.tar'"
    );
    assert_eq!(
        store
            .build("xyz", &BuildOptions::default(), &mut NoProgress)
            .unwrap_err()
            .to_string(),
        "unknown recipe 'xyz': known recipes are base, code-interpreter-v1"
    );
    assert!(matches!(
        store.get("../etc"),
        Err(ImageError::InvalidName { .. })
    ));
    assert!(matches!(
        store.remove("Nope"),
        Err(ImageError::InvalidName { .. })
    ));
    assert_eq!(
        ImageError::MissingTool {
            tool: "mmdebstrap".into(),
            hint: "run 'apt-get install mmdebstrap' as root".into()
        }
        .to_string(),
        "mmdebstrap is not installed: run 'apt-get install mmdebstrap' as root"
    );
    assert_eq!(
        ImageError::NotRoot {
            action: "building image 'base'".into()
        }
        .to_string(),
        "building image 'base' needs root privileges: run the command again as root (for example with sudo)"
    );
    let failed = ImageError::BuildFailed {
        name: "base".into(),
        reason: "mmdebstrap exited with status 1".into(),
        log: PathBuf::from("/var/lib/cordon/images/.build-base.log"),
        tail: vec![
            "W: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease".into(),
            "".into(),
            "E: apt-get update failed".into(),
        ],
    };
    assert_eq!(
        failed.to_string(),
        "building image 'base' failed: mmdebstrap exited with status 1 (the Debian mirror is unreachable: \
         check network access or set CORDON_DEBIAN_MIRROR to a reachable mirror); last output: \
         E: apt-get update failed; \
         full log in /var/lib/cordon/images/.build-base.log: fix the cause and run 'cordon image build base' again"
    );
    let corrupt = ImageError::Corrupt {
        name: "x".into(),
        reason: "image.json is missing".into(),
    };
    assert_eq!(
        corrupt.to_string(),
        "image 'x' is damaged (image.json is missing): remove it with 'cordon image remove x' and build or import it again"
    );
    let io = ImageError::io(
        "cannot create /var/lib/cordon/images",
        io::Error::from_raw_os_error(libc::EACCES),
    );
    assert_eq!(
        io.to_string(),
        "cannot create /var/lib/cordon/images: Permission denied (os error 13) (run the command as root)"
    );
}

#[test]
fn build_returns_cached_image() {
    let t = TempDir::new("cached");
    let store = Store::open(t.path()).unwrap();
    // Stand in for a finished build of "base".
    let tb = sample_tar(t.path(), "r.tar", "x\n");
    let imported = store.import_tar("base", &tb, &mut NoProgress).unwrap();
    fs::create_dir_all(store.root.join(".staging-base-99999999/rootfs")).unwrap();
    let mut rec = Rec::default();
    let start = Instant::now();
    let img = store
        .build("base", &BuildOptions::default(), &mut rec)
        .unwrap();
    assert!(start.elapsed().as_secs() < 2);
    assert_eq!(img.meta, imported.meta);
    assert!(rec.stages.is_empty());
    assert!(
        rec.lines.iter().any(|l| l.contains("already built")),
        "{:?}",
        rec.lines
    );
    assert!(
        staging_leftovers(&store.root).is_empty(),
        "a cached build still cleans up"
    );
}

#[test]
fn an_image_built_from_an_older_recipe_is_stale_and_an_import_never_is() {
    let t = TempDir::new("stale");
    let store = Store::open(t.path()).unwrap();
    let tb = sample_tar(t.path(), "r.tar", "x\n");
    let mut img = store.import_tar("base", &tb, &mut NoProgress).unwrap();
    assert!(!store.is_stale(&img), "an import named like a recipe is the user's, not stale");
    img.meta.source = "mmdebstrap bookworm".into();
    assert!(store.is_stale(&img), "built before recipes were recorded");
    img.meta.recipe = Some("0000000000000000".into());
    assert!(store.is_stale(&img), "built from another recipe");
    img.meta.recipe = Some(crate::recipe::find("base").unwrap().digest());
    assert!(!store.is_stale(&img));
    let other = crate::recipe::find("code-interpreter-v1").unwrap().digest();
    assert_ne!(other, crate::recipe::find("base").unwrap().digest());
}

#[test]
fn meta_json_roundtrip() {
    let m = ImageMeta {
        name: "base".into(),
        created_unix: 1,
        source: "mmdebstrap bookworm".into(),
        size_bytes: 2,
        env: vec![("LANG".into(), "C.UTF-8".into())],
        default_user: "user".into(),
        start: None,
        recipe: None,
        ..ImageMeta::empty()
    };
    let j = serde_json::to_string(&m).unwrap();
    // Fields an older image.json lacks stay absent, and it still reads.
    assert!(!j.contains("layers") && !j.contains("workdir"), "{j}");
    assert!(j.contains(r#""env":[["LANG","C.UTF-8"]]"#), "{j}");
    assert!(!j.contains("start"), "no start command, no field: {j}");
    assert_eq!(serde_json::from_str::<ImageMeta>(&j).unwrap(), m);

    let with_start = ImageMeta {
        start: Some(
            recipe::find("code-interpreter-v1")
                .unwrap()
                .start
                .as_ref()
                .unwrap()
                .to_command(),
        ),
        ..m
    };
    let j = serde_json::to_string(&with_start).unwrap();
    assert!(j.contains(r#""ready_port":49999"#), "{j}");
    assert!(j.contains(r#""needs_token":true"#), "the interpreter's port needs the token: {j}");
    assert_eq!(serde_json::from_str::<ImageMeta>(&j).unwrap(), with_start);

    // Metadata written before the field existed: the port needs the token, as now declared.
    let old = j.replace(r#","needs_token":true"#, "");
    assert!(!old.contains("needs_token"), "{old}");
    assert!(serde_json::from_str::<ImageMeta>(&old).unwrap().start.unwrap().needs_token);
    let open = j.replace(r#""needs_token":true"#, r#""needs_token":false"#);
    assert!(!serde_json::from_str::<ImageMeta>(&open).unwrap().start.unwrap().needs_token);
}

/// Builds the real base image with mmdebstrap (network, root, 1-3 minutes).
/// Run with `cargo test -p cordon-image -- --ignored --nocapture`.
#[test]
#[ignore]
fn build_base_with_mmdebstrap() {
    assert!(fsutil::is_root(), "building needs root");
    let t = TempDir::new("build-base");
    let store = Store::open(t.path()).unwrap();

    struct Print(Vec<String>);
    impl Progress for Print {
        fn stage(&mut self, index: usize, total: usize, name: &str) {
            eprintln!("[{}/{total}] {name}", index + 1);
            self.0.push(name.to_string());
        }
        fn line(&mut self, _text: &str) {}
    }
    let mut p = Print(Vec::new());
    let start = Instant::now();
    let img = match store.build("base", &BuildOptions::default(), &mut p) {
        Ok(i) => i,
        Err(e) => panic!("{e}"),
    };
    let took = start.elapsed();
    eprintln!(
        "built base in {:.1}s, size {} bytes ({:.1} MiB), stages {:?}",
        took.as_secs_f64(),
        img.meta.size_bytes,
        img.meta.size_bytes as f64 / 1048576.0,
        p.0
    );
    let r = &img.layers[0];
    for f in [
        "usr/bin/python3",
        "usr/bin/sudo",
        "usr/bin/git",
        "usr/bin/curl",
        "usr/bin/ps",
        "home/user",
    ] {
        assert!(fs::symlink_metadata(r.join(f)).is_ok(), "{f} missing");
    }
    let passwd = fs::read_to_string(r.join("etc/passwd")).unwrap();
    assert!(passwd.contains("user:x:1000:1000:"), "{passwd}");
    let group = fs::read_to_string(r.join("etc/group")).unwrap();
    assert!(
        group
            .lines()
            .any(|l| l.starts_with("sudo:") && l.ends_with("user")),
        "{group}"
    );
    let sudoers = r.join("etc/sudoers.d/user");
    assert_eq!(
        fs::read_to_string(&sudoers).unwrap(),
        "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
    );
    assert_eq!(
        fs::metadata(&sudoers).unwrap().permissions().mode() & 0o777,
        0o440
    );
    let home = fs::metadata(r.join("home/user")).unwrap();
    assert_eq!((home.uid(), home.gid()), (1000, 1000));
    for d in ["proc", "dev", "sys", "tmp"] {
        assert!(r.join(d).is_dir(), "{d}");
    }
    assert_eq!(img.meta.default_user, "user");
    assert_eq!(img.meta.source, "mmdebstrap bookworm");
    assert!(p.0.contains(&"creating user".to_string()));
    assert!(store.root.join(".build-base.log").is_file());

    // The tools actually run inside.
    let out = std::process::Command::new("chroot")
        .arg(r)
        .args([
            "/usr/bin/python3",
            "-c",
            "import venv, pip, ssl, sqlite3; print('ok')",
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "ok",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Second build is served from the store.
    let start = Instant::now();
    let again = store
        .build("base", &BuildOptions::default(), &mut NoProgress)
        .unwrap();
    assert!(start.elapsed().as_millis() < 1000);
    assert_eq!(again.meta, img.meta);
    assert!(staging_leftovers(&store.root).is_empty());
}

#[test]
fn a_layer_sent_to_another_store_arrives_whole_whiteouts_and_all() {
    use std::os::unix::fs::FileTypeExt;
    let (one, two) = (TempDir::new("send"), TempDir::new("receive"));
    let (from, to) = (Store::open(one.path()).unwrap(), Store::open(two.path()).unwrap());
    let mut b = tar::Builder::new(Vec::new());
    add_dir(&mut b, "etc/", 0o755);
    add_file(&mut b, "etc/.wh.motd", 0o644, b"");
    add_dir(&mut b, "opt/", 0o755);
    add_file(&mut b, "opt/.wh..wh..opq", 0o644, b"");
    add_file(&mut b, "opt/new", 0o640, b"new data");
    let id = from.receive_layer(io::Cursor::new(b.into_inner().unwrap())).unwrap();

    let mut sent = Vec::new();
    from.send_layer(&id, &mut sent).unwrap();
    let got = to.receive_layer(io::Cursor::new(sent.clone())).unwrap();
    let tree = to.layer_path(&got).unwrap();
    let motd = fs::symlink_metadata(tree.join("etc/motd")).unwrap();
    assert!(motd.file_type().is_char_device() && motd.rdev() == 0, "the whiteout is a whiteout there too");
    assert_eq!(fs::read(tree.join("opt/new")).unwrap(), b"new data");
    assert_eq!(fs::metadata(tree.join("opt/new")).unwrap().permissions().mode() & 0o777, 0o640);
    let mut opaque = [0u8; 4];
    let n = rustix::fs::getxattr(tree.join("opt"), "user.overlay.opaque", &mut opaque).unwrap();
    assert_eq!(&opaque[..n], b"y");

    // Sent again from where it arrived, the same tree is the same bytes: a third store would
    // find it under the same digest.
    let mut again = Vec::new();
    to.send_layer(&got, &mut again).unwrap();
    assert_eq!(again, sent);
    assert!(matches!(from.send_layer("sha256:0000000000000000000000000000000000000000000000000000000000000000", &mut Vec::new()), Err(ImageError::Layer { .. })));
}
