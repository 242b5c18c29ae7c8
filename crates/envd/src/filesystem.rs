//! Messages of the envd `filesystem` package (service `filesystem.Filesystem`), in proto3 JSON
//! form, with the same conventions as [`crate::process`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::json::{is_default, oneof, proto_enum};
use crate::process::KeepAlive;
use crate::timestamp::Timestamp;

/// The service name, the first path segment of its procedures.
pub const SERVICE: &str = "filesystem.Filesystem";

proto_enum! {
    /// `FileType`.
    pub enum FileType {
        /// Neither a regular file nor a directory (or a dangling link target).
        Unspecified = 0 => "FILE_TYPE_UNSPECIFIED",
        /// A regular file.
        File = 1 => "FILE_TYPE_FILE",
        /// A directory.
        Directory = 2 => "FILE_TYPE_DIRECTORY",
        /// A symbolic link (older servers; newer ones set `is_symlink`).
        Symlink = 3 => "FILE_TYPE_SYMLINK",
    }
}

proto_enum! {
    /// `EventType` of a directory watch.
    pub enum EventType {
        /// Not set.
        Unspecified = 0 => "EVENT_TYPE_UNSPECIFIED",
        /// An entry appeared (created or moved in).
        Create = 1 => "EVENT_TYPE_CREATE",
        /// A file was written.
        Write = 2 => "EVENT_TYPE_WRITE",
        /// An entry was deleted.
        Remove = 3 => "EVENT_TYPE_REMOVE",
        /// An entry was moved away or renamed.
        Rename = 4 => "EVENT_TYPE_RENAME",
        /// Permissions, ownership or other attributes changed.
        Chmod = 5 => "EVENT_TYPE_CHMOD",
    }
}

/// Information about one filesystem entry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct EntryInfo {
    /// Base name.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// The type (for a symlink: of its target, see `is_symlink`).
    #[serde(rename = "type", skip_serializing_if = "is_default")]
    pub file_type: FileType,
    /// Absolute path, as requested (links not resolved).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub path: String,
    /// Size in bytes (a string on the wire).
    #[serde(skip_serializing_if = "is_default", with = "crate::json::int64")]
    pub size: i64,
    /// Permission bits, e.g. `0o644` = 420.
    #[serde(skip_serializing_if = "is_default", deserialize_with = "crate::json::int32::deserialize")]
    pub mode: u32,
    /// `ls`-style mode string as Go formats it, e.g. `-rw-r--r--`, `drwxr-xr-x`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub permissions: String,
    /// Owner name (or uid when it has no name).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub owner: String,
    /// Group name (or gid when it has no name).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub group: String,
    /// Last modification.
    #[serde(alias = "modified_time", skip_serializing_if = "Option::is_none")]
    pub modified_time: Option<Timestamp>,
    /// For a symlink: the resolved target.
    #[serde(alias = "symlink_target", skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// User metadata (the `user.e2b.*` extended attributes, prefix stripped).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Whether the entry itself is a symlink.
    #[serde(alias = "is_symlink", skip_serializing_if = "is_default")]
    pub is_symlink: bool,
}

/// `Move` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct MoveRequest {
    /// Existing path.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub source: String,
    /// New path.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub destination: String,
}

/// `Move` response.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct MoveResponse {
    /// The entry at its new path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

/// `MakeDir` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct MakeDirRequest {
    /// The directory to create (parents too).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub path: String,
}

/// `MakeDir` response.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct MakeDirResponse {
    /// The new directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

/// `Remove` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct RemoveRequest {
    /// What to remove (directories recursively).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub path: String,
}

/// `Remove` response (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveResponse {}

/// `Stat` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StatRequest {
    /// The path.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub path: String,
}

/// `Stat` response.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct StatResponse {
    /// The entry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

/// `ListDir` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ListDirRequest {
    /// The directory.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub path: String,
    /// How many levels to descend; 0 counts as 1.
    #[serde(skip_serializing_if = "is_default", deserialize_with = "crate::json::int32::deserialize")]
    pub depth: u32,
}

/// `ListDir` response.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ListDirResponse {
    /// The entries below the directory (not the directory itself).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub entries: Vec<EntryInfo>,
}

/// `WatchDir` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatchDirRequest {
    /// The directory.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub path: String,
    /// Watch subdirectories too.
    #[serde(skip_serializing_if = "is_default")]
    pub recursive: bool,
    /// Attach an [`EntryInfo`] to create/write/chmod events.
    #[serde(alias = "include_entry", skip_serializing_if = "is_default")]
    pub include_entry: bool,
    /// Allow watching network filesystems.
    #[serde(alias = "allow_network_mounts", skip_serializing_if = "is_default")]
    pub allow_network_mounts: bool,
}

/// One change below a watched directory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct FilesystemEvent {
    /// Path relative to the watched directory (`sub/file` when recursive).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// What happened.
    #[serde(rename = "type", skip_serializing_if = "is_default")]
    pub event_type: EventType,
    /// The entry after the change, when requested and it still exists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

/// `WatchDirResponse.StartEvent` (empty): the watch is established.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchStartEvent {}

oneof! {
    /// One message of the `WatchDir` stream (oneof `event`); the first is always `Start`.
    pub enum WatchDirResponse ("event") via WatchDirResponseRepr {
        /// The watch is in place.
        Start(WatchStartEvent) => start,
        /// A change.
        Filesystem(FilesystemEvent) => filesystem,
        /// Sent after a period of silence.
        Keepalive(KeepAlive) => keepalive,
    }
}

/// `CreateWatcher` request (same fields as [`WatchDirRequest`]).
pub type CreateWatcherRequest = WatchDirRequest;

/// `CreateWatcher` response.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct CreateWatcherResponse {
    /// Handle for `GetWatcherEvents` / `RemoveWatcher`.
    #[serde(alias = "watcher_id", skip_serializing_if = "String::is_empty")]
    pub watcher_id: String,
}

/// `GetWatcherEvents` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct GetWatcherEventsRequest {
    /// The watcher.
    #[serde(alias = "watcher_id", skip_serializing_if = "String::is_empty")]
    pub watcher_id: String,
}

/// `GetWatcherEvents` response.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct GetWatcherEventsResponse {
    /// Events since the previous call.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<FilesystemEvent>,
}

/// `RemoveWatcher` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct RemoveWatcherRequest {
    /// The watcher.
    #[serde(alias = "watcher_id", skip_serializing_if = "String::is_empty")]
    pub watcher_id: String,
}

/// `RemoveWatcher` response (empty).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveWatcherResponse {}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn entry_info_wire_form() {
        let e = EntryInfo {
            name: "a.txt".into(),
            file_type: FileType::File,
            path: "/home/user/a.txt".into(),
            size: 12,
            mode: 0o644,
            permissions: "-rw-r--r--".into(),
            owner: "user".into(),
            group: "user".into(),
            modified_time: Some(Timestamp { seconds: 1_700_000_000, nanos: 0 }),
            symlink_target: None,
            metadata: BTreeMap::from([("k".to_string(), "v".to_string())]),
            is_symlink: false,
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(
            v,
            json!({"name":"a.txt","type":"FILE_TYPE_FILE","path":"/home/user/a.txt","size":"12",
                   "mode":420,"permissions":"-rw-r--r--","owner":"user","group":"user",
                   "modifiedTime":"2023-11-14T22:13:20Z","metadata":{"k":"v"}})
        );
        let back: EntryInfo = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
        let n: EntryInfo =
            serde_json::from_str(r#"{"size":12,"type":2,"symlink_target":"/x","is_symlink":true}"#).unwrap();
        assert_eq!((n.size, n.file_type, n.is_symlink), (12, FileType::Directory, true));
        assert_eq!(n.symlink_target.as_deref(), Some("/x"));
    }

    #[test]
    fn watch_messages() {
        let start = serde_json::to_value(WatchDirResponse::Start(WatchStartEvent {})).unwrap();
        assert_eq!(start, json!({"start":{}}));
        let ev = WatchDirResponse::Filesystem(FilesystemEvent {
            name: "sub/f".into(),
            event_type: EventType::Create,
            entry: None,
        });
        assert_eq!(
            serde_json::to_value(&ev).unwrap(),
            json!({"filesystem":{"name":"sub/f","type":"EVENT_TYPE_CREATE"}})
        );
        let r: CreateWatcherRequest =
            serde_json::from_str(r#"{"path":"d","recursive":true,"include_entry":true}"#).unwrap();
        assert!(r.recursive && r.include_entry);
        let unknown: EventType = serde_json::from_str("\"EVENT_TYPE_FUTURE\"").unwrap();
        assert_eq!(unknown, EventType::Unspecified);
        let num: EventType = serde_json::from_str("9").unwrap();
        assert_eq!(serde_json::to_string(&num).unwrap(), "9");
    }
}
