//! `GET /templates`: E2B's list of templates, with cordon's sizes. A built template (through
//! `Template.build`) is listed under its ID; every other image of the store a create can name
//! is listed as a template whose ID is its name (as `GET /templates/aliases/{name}` answers).
//! Images cordon makes for its own bookkeeping (builds, paused sandboxes, snapshots, forks)
//! are not templates and are left out; their space is in the sizes of what uses them.

use std::collections::{HashMap, HashSet};

use serde_json::{json, Value};

use crate::api::{DEFAULT_CPUS, DEFAULT_DISK_MB, DEFAULT_MEMORY_MB};
use crate::error::ApiError;
use crate::templates::TemplateSummary;
use crate::App;

/// Prefixes of the store images that are never a template of their own: a build's image
/// (`tpl-`), a paused sandbox's (`paused-`), a snapshot's (`snap-`, listed by
/// `GET /snapshots`), a sandbox's own over a snapshot or fork (`own-`).
const INTERNAL_IMAGE_PREFIXES: &[&str] = &["tpl-", "paused-", "snap-", "own-"];

/// Whether a store image is listed as a template of its own.
pub fn is_listed_image(name: &str) -> bool {
    !INTERNAL_IMAGE_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// An image's size as the store reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageSize {
    pub size_bytes: u64,
    pub shared_bytes: u64,
    pub source: String,
    pub created_unix: Option<u64>,
}

fn iso_unix(secs: u64) -> String {
    crate::api::iso(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

/// The E2B `Template` of a built template.
pub fn template_json(t: &TemplateSummary, size: Option<&ImageSize>, envd_version: &str) -> Value {
    json!({
        "templateID": t.id,
        "buildID": t.build_id,
        "cpuCount": t.cpu_count.unwrap_or(DEFAULT_CPUS),
        "memoryMB": t.memory_mb.unwrap_or(DEFAULT_MEMORY_MB),
        "diskSizeMB": DEFAULT_DISK_MB,
        "public": false,
        "aliases": t.names,
        "names": t.names,
        "createdAt": t.created,
        "updatedAt": t.updated,
        "createdBy": null,
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "buildCount": t.build_count,
        "buildStatus": t.build_status,
        "envdVersion": envd_version,
        "sizeBytes": size.map(|s| s.size_bytes),
        "sharedBytes": size.map(|s| s.shared_bytes),
        "image": t.ready_image,
    })
}

/// The E2B `Template` of a store image a create can name directly.
pub fn image_json(name: &str, size: &ImageSize, envd_version: &str) -> Value {
    let created = size.created_unix.map(iso_unix);
    json!({
        "templateID": name,
        "buildID": name,
        "cpuCount": DEFAULT_CPUS,
        "memoryMB": DEFAULT_MEMORY_MB,
        "diskSizeMB": DEFAULT_DISK_MB,
        "public": false,
        "aliases": [name],
        "names": [name],
        "createdAt": created,
        "updatedAt": created,
        "createdBy": null,
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "buildCount": 1,
        "buildStatus": "ready",
        "envdVersion": envd_version,
        "sizeBytes": size.size_bytes,
        "sharedBytes": size.shared_bytes,
        "image": name,
        "source": size.source,
    })
}

/// Built templates first (by ID), then the store's images (by name).
pub fn list_json(templates: &[TemplateSummary], images: &[(String, ImageSize)], envd_version: &str) -> Value {
    let by_name: HashMap<&str, &ImageSize> = images.iter().map(|(n, s)| (n.as_str(), s)).collect();
    let claimed: HashSet<&str> = templates.iter().flat_map(|t| t.images.iter().map(String::as_str)).collect();
    let mut out: Vec<Value> = templates
        .iter()
        .map(|t| template_json(t, t.ready_image.as_deref().and_then(|i| by_name.get(i).copied()), envd_version))
        .collect();
    out.extend(
        images
            .iter()
            .filter(|(n, _)| is_listed_image(n) && !claimed.contains(n.as_str()))
            .map(|(n, s)| image_json(n, s, envd_version)),
    );
    Value::Array(out)
}

/// `GET /templates`.
pub fn list(app: &App) -> Result<Value, ApiError> {
    let usage = app.images.usage().map_err(|e| ApiError::internal(format!("cannot list the images: {e}")))?;
    let created: HashMap<String, u64> = app
        .images
        .list()
        .map(|l| l.into_iter().map(|i| (i.name, i.meta.created_unix)).collect())
        .unwrap_or_default();
    let images: Vec<(String, ImageSize)> = usage
        .into_iter()
        .map(|u| {
            let created_unix = created.get(&u.name).copied();
            (u.name, ImageSize { size_bytes: u.size_bytes, shared_bytes: u.shared_bytes, source: u.source, created_unix })
        })
        .collect();
    let templates = app.templates.as_ref().map(|t| t.summaries()).unwrap_or_default();
    Ok(list_json(&templates, &images, app.sandboxes.envd_version()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary() -> TemplateSummary {
        TemplateSummary {
            id: "t1".into(),
            names: vec!["my-app".into()],
            cpu_count: Some(2),
            memory_mb: None,
            created: Some("2026-01-01T00:00:00Z".into()),
            updated: Some("2026-01-02T00:00:00Z".into()),
            build_count: 2,
            build_id: Some("b2".into()),
            build_status: Some("ready".into()),
            ready_image: Some("tpl-t1-b2".into()),
            images: vec!["tpl-t1-b1".into(), "tpl-t1-b2".into()],
        }
    }

    const E2B_FIELDS: &[&str] = &[
        "templateID", "buildID", "cpuCount", "memoryMB", "diskSizeMB", "public", "aliases", "names", "createdAt", "updatedAt",
        "createdBy", "lastSpawnedAt", "spawnCount", "buildCount", "buildStatus", "envdVersion",
    ];

    #[test]
    fn lists_templates_then_user_images_with_sizes() {
        let size = |b: u64| ImageSize { size_bytes: b, shared_bytes: 1, source: "s".into(), created_unix: Some(0) };
        let images = vec![
            ("base".to_string(), size(100)),
            ("own-x-1".to_string(), size(5)),
            ("paused-x-1".to_string(), size(5)),
            ("snap-base-1".to_string(), size(5)),
            ("tpl-t1-b1".to_string(), size(7)),
            ("tpl-t1-b2".to_string(), size(9)),
        ];
        let v = list_json(&[summary()], &images, "0.6.13");
        let list = v.as_array().unwrap();
        assert_eq!(list.len(), 2, "{v}");
        for item in list {
            for f in E2B_FIELDS {
                assert!(item.get(*f).is_some(), "{f} missing in {item}");
            }
        }
        assert_eq!(list[0]["templateID"], "t1");
        assert_eq!(list[0]["buildID"], "b2");
        assert_eq!(list[0]["cpuCount"], 2);
        assert_eq!(list[0]["memoryMB"], DEFAULT_MEMORY_MB);
        assert_eq!(list[0]["sizeBytes"], 9);
        assert_eq!(list[0]["aliases"], json!(["my-app"]));
        assert_eq!(list[1]["templateID"], "base");
        assert_eq!(list[1]["sizeBytes"], 100);
        assert_eq!(list[1]["createdAt"], "1970-01-01T00:00:00Z");
    }

    #[test]
    fn internal_images_are_not_templates() {
        assert!(is_listed_image("base"));
        assert!(is_listed_image("code-interpreter-v1"));
        assert!(is_listed_image("127.0.0.1-5000-team-app-1.2"));
        for n in ["tpl-a-b", "paused-x-1", "snap-base-1", "own-x-1"] {
            assert!(!is_listed_image(n), "{n}");
        }
    }
}
