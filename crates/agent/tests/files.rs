//! `/files` upload and download.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;

use bytes::Bytes;
use common::*;
use cordon_envd::Code;

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn gunzip(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data).read_to_end(&mut out).unwrap();
    out
}

#[tokio::test]
async fn upload_download_round_trip() {
    let a = start_agent().await;
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let infos = a.client.upload_file("dir/sub/a.bin", None, Bytes::from(data.clone())).await.unwrap();
    assert_eq!(infos.len(), 1);
    let expected = a.home.join("dir/sub/a.bin");
    assert_eq!(infos[0].path, expected.display().to_string());
    assert_eq!(infos[0].name, "a.bin");
    assert_eq!(infos[0].entry_type.as_deref(), Some("file"));
    assert_eq!(std::fs::read(&expected).unwrap(), data);
    assert_eq!(a.client.download_file("dir/sub/a.bin", None).await.unwrap(), data);
    assert_eq!(a.client.download_file(&expected.display().to_string(), None).await.unwrap(), data);

    let small = a.client.clone().with_max_download(1000);
    let err = small.download_file("dir/sub/a.bin", None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::ResourceExhausted), "{err}");

    // Overwrite truncates.
    a.client.upload_file("~/dir/sub/a.bin", None, Bytes::from_static(b"short")).await.unwrap();
    assert_eq!(a.client.download_file("dir/sub/a.bin", None).await.unwrap(), "short");

    let err = a.client.download_file("missing.txt", None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound), "{err}");
    let err = a.client.download_file("dir", None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
    let err = a.client.upload_file("dir", None, Bytes::from_static(b"x")).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument), "{err}");
    let err = a.client.download_file("x", Some("ghost")).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::Unauthenticated), "{err}");
}

#[tokio::test]
async fn error_bodies_are_json() {
    let a = start_agent().await;
    let resp = raw_request(&a.socket, &get("/files?path=nope.txt", "")).await;
    assert_eq!(resp.status, 404);
    assert_eq!(resp.header("content-type"), Some("application/json"));
    let v: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(v["code"], 404);
    assert!(v["message"].as_str().unwrap().contains("nope.txt"));
    let resp = raw_request(&a.socket, &get("/files?path=%2Fdev%2Fnull", "")).await;
    assert_eq!(resp.status, 400, "devices are refused");
    let resp = raw_request(&a.socket, &post("/files", "application/octet-stream", "", b"x")).await;
    assert_eq!(resp.status, 400, "octet-stream needs ?path=");
}

#[tokio::test]
async fn multipart_several_files_with_metadata() {
    let a = start_agent().await;
    let abs = a.dir.join("elsewhere/m2.txt");
    let boundary = "XyZ123boundary";
    let mut body = Vec::new();
    for (name, content, ct) in [
        ("dir/a.txt", &b"alpha"[..], "text/plain"),
        (abs.to_str().unwrap(), &b"\x00\x01binary"[..], "application/octet-stream"),
    ] {
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: {ct}\r\n\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(content);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let req = chunked_post(
        "/files?username=tester",
        &format!("multipart/form-data; boundary={boundary}"),
        "X-Metadata-Owner: Alice\r\nx-metadata-KIND: test\r\n",
        &[&body[..40], &body[40..]],
    );
    let resp = raw_request(&a.socket, &req).await;
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    let infos: Vec<cordon_envd::WriteInfo> = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(infos.len(), 2);
    assert_eq!(infos[0].path, a.home.join("dir/a.txt").display().to_string());
    assert_eq!(infos[1].path, abs.display().to_string());
    assert_eq!(std::fs::read(a.home.join("dir/a.txt")).unwrap(), b"alpha");
    assert_eq!(std::fs::read(&abs).unwrap(), b"\x00\x01binary");
    // Metadata needs user xattrs on the test filesystem.
    if !infos[0].metadata.is_empty() {
        assert_eq!(infos[0].metadata.get("owner").map(String::as_str), Some("Alice"));
        assert_eq!(infos[0].metadata.get("kind").map(String::as_str), Some("test"));
        let st = a.client.stat("dir/a.txt", None).await.unwrap();
        assert_eq!(st.metadata, infos[0].metadata);
    } else {
        eprintln!("note: no user xattr support on {}; metadata not checked", a.dir.display());
    }

    // One file with ?path=: the query wins over the filename.
    let one = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"ignored.txt\"\r\n\r\nsingle\r\n--{boundary}--\r\n"
    );
    let req = post("/files?path=single.txt", &format!("multipart/form-data; boundary={boundary}"), "", one.as_bytes());
    let resp = raw_request(&a.socket, &req).await;
    assert_eq!(resp.status, 200);
    assert_eq!(std::fs::read(a.home.join("single.txt")).unwrap(), b"single");
    assert!(!a.home.join("ignored.txt").exists());
}

#[tokio::test]
async fn gzip_upload_and_download() {
    let a = start_agent().await;
    let data = "compress me ".repeat(10_000).into_bytes();
    let gz = gzip(&data);
    let req = chunked_post(
        "/files?path=gz%2Fdata.txt",
        "application/octet-stream",
        "Content-Encoding: gzip\r\n",
        &[&gz[..gz.len() / 2], &gz[gz.len() / 2..]],
    );
    let resp = raw_request(&a.socket, &req).await;
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    assert_eq!(std::fs::read(a.home.join("gz/data.txt")).unwrap(), data);

    let resp = raw_request(&a.socket, &get("/files?path=gz/data.txt", "Accept-Encoding: gzip\r\n")).await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-encoding"), Some("gzip"));
    assert_eq!(resp.header("content-type"), Some("application/octet-stream"));
    assert!(resp.body.len() < data.len() / 10);
    assert_eq!(gunzip(&resp.body), data);

    let resp = raw_request(&a.socket, &get("/files?path=gz/data.txt", "Accept-Encoding: identity\r\n")).await;
    assert_eq!(resp.header("content-encoding"), None);
    assert_eq!(resp.body, data);

    let req = post("/files?path=bad.txt", "application/octet-stream", "Content-Encoding: gzip\r\n", b"not gzip at all");
    let resp = raw_request(&a.socket, &req).await;
    assert_eq!(resp.status, 400);
}

#[tokio::test]
async fn uploads_belong_to_the_user() {
    if !is_root() {
        eprintln!("skipped: chown to uid 65534 needs root");
        return;
    }
    let a = start_agent().await;
    let infos = a.client.upload_file("new/dir/f.txt", Some("nobody"), Bytes::from_static(b"hi")).await.unwrap();
    let p = a.nobody_home.join("new/dir/f.txt");
    assert_eq!(infos[0].path, p.display().to_string());
    for path in [p.clone(), a.nobody_home.join("new/dir"), a.nobody_home.join("new")] {
        let md = std::fs::metadata(&path).unwrap();
        assert_eq!((md.uid(), md.gid()), (65534, 65534), "{}", path.display());
    }
    // Basic auth selects the user too.
    let req = post(
        "/files?path=via-auth.txt",
        "application/octet-stream",
        "Authorization: Basic bm9ib2R5Og==\r\n",
        b"x",
    );
    let resp = raw_request(&a.socket, &req).await;
    assert_eq!(resp.status, 200);
    assert_eq!(std::fs::metadata(a.nobody_home.join("via-auth.txt")).unwrap().uid(), 65534);
}

#[tokio::test]
async fn a_parameter_given_twice_is_refused() {
    let a = start_agent().await;
    std::fs::write(a.home.join("public.txt"), "public").unwrap();
    std::fs::write(a.home.join("other.txt"), "other").unwrap();
    for q in ["path=public.txt&path=other.txt", "path=public.txt&pa%74h=other.txt", "path=public.txt&username=tester&username=root"] {
        let resp = raw_request(&a.socket, &get(&format!("/files?{q}"), "")).await;
        assert_eq!(resp.status, 400, "{q}");
        let v: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
        assert!(v["message"].as_str().unwrap().starts_with("Invalid format for parameter "), "{v}");
        let resp = raw_request(&a.socket, &post(&format!("/files?{q}"), "application/octet-stream", "", b"x")).await;
        assert_eq!(resp.status, 400, "{q}");
    }
    assert_eq!(std::fs::read_to_string(a.home.join("other.txt")).unwrap(), "other");
    assert_eq!(std::fs::read_to_string(a.home.join("public.txt")).unwrap(), "public");
}

/// A root-owned file that only root may read or write, in a directory `nobody` may enter.
fn root_only(a: &TestAgent, name: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = a.dir.join(name);
    std::fs::write(&p, "root only").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

#[tokio::test]
async fn files_are_read_and_written_with_the_users_rights() {
    if !is_root() {
        eprintln!("skipped: acting as uid 65534 needs root");
        return;
    }
    let a = start_agent().await;
    let secret = root_only(&a, "secret");
    let err = a.client.download_file(secret.to_str().unwrap(), Some("nobody")).await.unwrap_err();
    assert!(err.to_string().contains("Permission denied"), "{err}");
    // The same file for root.
    assert_eq!(a.client.download_file(secret.to_str().unwrap(), Some("root")).await.unwrap(), "root only");

    // A symlink the user planted in their home, pointing at the root-only file.
    let shadow = root_only(&a, "shadow");
    std::os::unix::fs::symlink(&shadow, a.nobody_home.join("notes.txt")).unwrap();
    let err = a.client.upload_file("notes.txt", Some("nobody"), Bytes::from_static(b"pwned")).await.unwrap_err();
    assert!(err.to_string().contains("Permission denied"), "{err}");
    assert!(a.client.download_file("notes.txt", Some("nobody")).await.is_err());
    let md = std::fs::metadata(&shadow).unwrap();
    assert_eq!((md.uid(), md.gid(), std::fs::read_to_string(&shadow).unwrap().as_str()), (0, 0, "root only"));
    // Nor can the user create files where they may not.
    let err = a.client.upload_file(a.dir.join("new.txt").to_str().unwrap(), Some("nobody"), Bytes::from_static(b"x")).await;
    assert!(err.is_err() && !a.dir.join("new.txt").exists());
    // Their own files still work, and are theirs.
    a.client.upload_file("mine.txt", Some("nobody"), Bytes::from_static(b"mine")).await.unwrap();
    let md = std::fs::metadata(a.nobody_home.join("mine.txt")).unwrap();
    assert_eq!((md.uid(), md.gid()), (65534, 65534));
    assert_eq!(a.client.download_file("mine.txt", Some("nobody")).await.unwrap(), "mine");
}
