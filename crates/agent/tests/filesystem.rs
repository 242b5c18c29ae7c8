//! `filesystem.Filesystem`: entries, directories, moves, removal, watches.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::*;
use cordon_envd::filesystem::{
    CreateWatcherRequest, CreateWatcherResponse, EventType, FileType, GetWatcherEventsRequest,
    GetWatcherEventsResponse, RemoveWatcherRequest, RemoveWatcherResponse, WatchDirRequest, WatchDirResponse,
};
use cordon_envd::Code;

#[tokio::test]
async fn stat_reports_entry_info() {
    let a = start_agent().await;
    let f = a.home.join("a.txt");
    std::fs::write(&f, b"hello world!").unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
    let e = a.client.stat("a.txt", None).await.unwrap();
    assert_eq!(e.name, "a.txt");
    assert_eq!(e.path, f.display().to_string());
    assert_eq!(e.file_type, FileType::File);
    assert_eq!(e.size, 12);
    assert_eq!(e.mode, 0o640);
    assert_eq!(e.permissions, "-rw-r-----");
    // The tests' uid also has the name root when they run as root (first entry wins).
    let (owner, group) = if is_root() { ("root", "root") } else { ("tester", "testgrp") };
    assert_eq!(e.owner, owner);
    assert_eq!(e.group, group);
    assert!(!e.is_symlink);
    let mtime = std::fs::metadata(&f).unwrap().modified().unwrap();
    assert_eq!(e.modified_time.unwrap().to_system_time(), mtime);

    let d = a.client.stat("~", None).await.unwrap();
    assert_eq!((d.file_type, d.permissions.starts_with('d')), (FileType::Directory, true));

    std::os::unix::fs::symlink(&f, a.home.join("link")).unwrap();
    let l = a.client.stat("link", None).await.unwrap();
    assert!(l.is_symlink);
    assert_eq!(l.file_type, FileType::File);
    assert_eq!(l.symlink_target.as_deref(), Some(f.to_str().unwrap()));
    assert!(l.permissions.starts_with('L'));
    std::os::unix::fs::symlink("/nonexistent/target", a.home.join("dangling")).unwrap();
    let dl = a.client.stat("dangling", None).await.unwrap();
    assert!(dl.is_symlink);

    let err = a.client.stat("missing", None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));

    // The wire form: size as a string, enum names.
    let resp = raw_request(&a.socket, &post("/filesystem.Filesystem/Stat", "application/json", "", br#"{"path":"a.txt"}"#)).await;
    let v: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(v["entry"]["size"], "12");
    assert_eq!(v["entry"]["type"], "FILE_TYPE_FILE");
    assert_eq!(v["entry"]["mode"], 0o640);
    assert!(v["entry"]["modifiedTime"].as_str().unwrap().ends_with('Z'));
}

#[tokio::test]
async fn make_dir_list_move_remove() {
    let a = start_agent().await;
    let e = a.client.make_dir("x/y/z", None).await.unwrap();
    assert_eq!(e.path, a.home.join("x/y/z").display().to_string());
    assert_eq!(e.file_type, FileType::Directory);
    let err = a.client.make_dir("x/y", None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::AlreadyExists));
    std::fs::write(a.home.join("x/file"), b"1").unwrap();
    let err = a.client.make_dir("x/file", None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument));

    let one = a.client.list_dir("x", 1, None).await.unwrap();
    let names: Vec<&str> = one.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["file", "y"]);
    let zero = a.client.list_dir("x", 0, None).await.unwrap();
    assert_eq!(zero.len(), 2, "depth 0 counts as 1");
    let deep = a.client.list_dir("x", 3, None).await.unwrap();
    let paths: Vec<String> = deep.iter().map(|e| e.path.clone()).collect();
    let home = a.home.display();
    assert_eq!(paths, [format!("{home}/x/file"), format!("{home}/x/y"), format!("{home}/x/y/z")]);
    let err = a.client.list_dir("x/file", 1, None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument));
    let err = a.client.list_dir("nothing", 1, None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));

    let moved = a.client.rename("x/file", "other/place/file2", None).await.unwrap();
    assert_eq!(moved.path, a.home.join("other/place/file2").display().to_string());
    assert!(!a.home.join("x/file").exists());
    let err = a.client.rename("x/file", "x/file3", None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));

    a.client.remove("x", None).await.unwrap();
    assert!(!a.home.join("x").exists());
    a.client.remove("x", None).await.unwrap();
    a.client.remove("other/place/file2", None).await.unwrap();
    assert!(!a.home.join("other/place/file2").exists());
}

#[tokio::test]
async fn make_dir_as_other_user_owns_the_dirs() {
    if !is_root() {
        eprintln!("skipped: chown to uid 65534 needs root");
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let a = start_agent().await;
    let e = a.client.make_dir("p/q", Some("nobody")).await.unwrap();
    assert_eq!(e.owner, "nobody");
    assert_eq!(e.group, "nogroup");
    assert_eq!(std::fs::metadata(a.nobody_home.join("p")).unwrap().uid(), 65534);
}

#[tokio::test]
async fn polled_watcher_collects_events() {
    let a = start_agent().await;
    std::fs::create_dir_all(a.home.join("w/sub")).unwrap();
    let r: CreateWatcherResponse = a
        .client
        .unary(
            "/filesystem.Filesystem/CreateWatcher",
            &CreateWatcherRequest { path: "w".into(), recursive: true, include_entry: true, ..Default::default() },
            None,
            None,
        )
        .await
        .unwrap();
    assert!(r.watcher_id.starts_with('w') && r.watcher_id.len() == 21, "{}", r.watcher_id);
    std::fs::write(a.home.join("w/f.txt"), b"data").unwrap();
    std::fs::write(a.home.join("w/sub/deep.txt"), b"x").unwrap();
    std::fs::rename(a.home.join("w/f.txt"), a.home.join("w/g.txt")).unwrap();
    std::fs::remove_file(a.home.join("w/g.txt")).unwrap();

    let mut events = Vec::new();
    for _ in 0..50 {
        let got: GetWatcherEventsResponse = a
            .client
            .unary(
                "/filesystem.Filesystem/GetWatcherEvents",
                &GetWatcherEventsRequest { watcher_id: r.watcher_id.clone() },
                None,
                None,
            )
            .await
            .unwrap();
        events.extend(got.events);
        if events.iter().any(|e| e.name == "g.txt" && e.event_type == EventType::Remove) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let has = |name: &str, t: EventType| events.iter().any(|e| e.name == name && e.event_type == t);
    assert!(has("f.txt", EventType::Create), "{events:?}");
    assert!(has("f.txt", EventType::Write), "{events:?}");
    assert!(has("sub/deep.txt", EventType::Create), "{events:?}");
    assert!(has("f.txt", EventType::Rename), "{events:?}");
    assert!(has("g.txt", EventType::Create), "{events:?}");
    assert!(has("g.txt", EventType::Remove), "{events:?}");
    let created = events.iter().find(|e| e.name == "sub/deep.txt").unwrap();
    assert_eq!(created.entry.as_ref().map(|e| e.name.as_str()), Some("deep.txt"));

    let _: RemoveWatcherResponse = a
        .client
        .unary(
            "/filesystem.Filesystem/RemoveWatcher",
            &RemoveWatcherRequest { watcher_id: r.watcher_id.clone() },
            None,
            None,
        )
        .await
        .unwrap();
    let err = a
        .client
        .unary::<_, GetWatcherEventsResponse>(
            "/filesystem.Filesystem/GetWatcherEvents",
            &GetWatcherEventsRequest { watcher_id: r.watcher_id },
            None,
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));
}

#[tokio::test]
async fn watch_dir_stream() {
    let a = start_agent().await;
    std::fs::create_dir_all(a.home.join("wd")).unwrap();
    let mut s = a
        .client
        .watch_dir(WatchDirRequest { path: "wd".into(), ..Default::default() }, None, Some(10_000))
        .await
        .unwrap();
    assert!(matches!(s.next().await, Some(Ok(WatchDirResponse::Start(_)))));
    std::fs::write(a.home.join("wd/new.txt"), b"1").unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(5), s.next()).await.unwrap().unwrap().unwrap();
    match ev {
        WatchDirResponse::Filesystem(e) => {
            assert_eq!((e.name.as_str(), e.event_type), ("new.txt", EventType::Create));
            assert!(e.entry.is_none(), "entries only when asked for");
        }
        other => panic!("{other:?}"),
    }

    let err = a.client.watch_dir(WatchDirRequest { path: "nope".into(), ..Default::default() }, None, None).await;
    let mut s = err.unwrap();
    assert_eq!(s.next().await.unwrap().unwrap_err().code(), Some(Code::NotFound));
    std::fs::write(a.home.join("plain"), b"").unwrap();
    let mut s = a.client.watch_dir(WatchDirRequest { path: "plain".into(), ..Default::default() }, None, None).await.unwrap();
    assert_eq!(s.next().await.unwrap().unwrap_err().code(), Some(Code::InvalidArgument));

    // Removing the watched directory ends the stream cleanly.
    let mut s = a.client.watch_dir(WatchDirRequest { path: "wd".into(), ..Default::default() }, None, None).await.unwrap();
    assert!(matches!(s.next().await, Some(Ok(WatchDirResponse::Start(_)))));
    std::fs::remove_dir_all(a.home.join("wd")).unwrap();
    let mut ended = false;
    for _ in 0..10 {
        match tokio::time::timeout(Duration::from_secs(5), s.next()).await.unwrap() {
            None => {
                ended = true;
                break;
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => panic!("{e}"),
        }
    }
    assert!(ended);
}

#[tokio::test]
async fn filesystem_calls_run_with_the_users_rights() {
    if !is_root() {
        eprintln!("skipped: acting as uid 65534 needs root");
        return;
    }
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let a = start_agent().await;
    // A directory only root may read, and a root file in a directory nobody may not write.
    let private = a.dir.join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::write(private.join("inside.txt"), "x").unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let fixed = a.dir.join("fixed.txt");
    std::fs::write(&fixed, "x").unwrap();
    let (p, f) = (private.to_str().unwrap(), fixed.to_str().unwrap());
    let denied = |r: Result<_, cordon_envd::Error>, what: &str| {
        let e = r.err().unwrap_or_else(|| panic!("{what} succeeded"));
        assert_eq!(e.code(), Some(Code::PermissionDenied), "{what}: {e}");
    };
    denied(a.client.list_dir(p, 1, Some("nobody")).await.map(drop), "list");
    denied(a.client.stat(&format!("{p}/inside.txt"), Some("nobody")).await.map(drop), "stat");
    denied(a.client.remove(f, Some("nobody")).await, "remove");
    denied(a.client.rename(f, "stolen.txt", Some("nobody")).await.map(drop), "move");
    denied(a.client.make_dir(&format!("{}/made", a.dir.display()), Some("nobody")).await.map(drop), "make_dir");
    let w = a
        .client
        .watch_dir(WatchDirRequest { path: p.into(), ..Default::default() }, Some("nobody"), Some(2000))
        .await;
    match w {
        Ok(mut s) => denied(s.next().await.unwrap().map(drop), "watch"),
        Err(e) => assert_eq!(e.code(), Some(Code::PermissionDenied), "watch: {e}"),
    }
    assert!(fixed.exists() && private.join("inside.txt").exists() && !a.dir.join("made").exists());
    // A recursive watch of the user's home does not reach into a directory they cannot read.
    let hidden = a.nobody_home.join("hidden");
    std::fs::create_dir(&hidden).unwrap();
    std::fs::set_permissions(&hidden, std::fs::Permissions::from_mode(0o700)).unwrap();
    let mut s = a
        .client
        .watch_dir(WatchDirRequest { path: "~".into(), recursive: true, ..Default::default() }, Some("nobody"), Some(3000))
        .await
        .unwrap();
    s.next().await.unwrap().unwrap(); // start
    std::fs::write(hidden.join("leak.txt"), "x").unwrap();
    std::fs::write(a.nobody_home.join("seen.txt"), "x").unwrap();
    let mut names = Vec::new();
    while let Some(Ok(m)) = s.next().await {
        if let WatchDirResponse::Filesystem(e) = m {
            names.push(e.name.clone());
            if e.name == "seen.txt" {
                break;
            }
        }
    }
    assert!(names.contains(&"seen.txt".to_string()) && !names.iter().any(|n| n.contains("leak")), "{names:?}");
    // What the user may do still works, as them.
    let e = a.client.make_dir("mine/deep", Some("nobody")).await.unwrap();
    assert_eq!(e.owner, "nobody");
    assert_eq!(std::fs::metadata(a.nobody_home.join("mine")).unwrap().uid(), 65534);
    a.client.rename("mine/deep", "mine/moved", Some("nobody")).await.unwrap();
    a.client.remove("mine", Some("nobody")).await.unwrap();
    assert!(!a.nobody_home.join("mine").exists());
}
