//! Users and groups, read straight from `<root>/etc/passwd` and `<root>/etc/group`.
//!
//! The agent is a static binary running inside foreign images, so NSS is not an option; the
//! files are re-read on every request because commands inside the sandbox may add users.

use std::io;
use std::path::{Component, Path, PathBuf};

use base64::Engine as _;

/// Files larger than this are refused rather than read into memory.
const MAX_DB_FILE: u64 = 16 << 20;

/// A resolved user: who a command runs as and where its relative paths start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    /// Primary group first, then the supplementary groups from `/etc/group`.
    pub groups: Vec<u32>,
}

#[derive(Clone, Debug)]
struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

#[derive(Clone, Debug)]
struct GroupEntry {
    name: String,
    gid: u32,
    members: Vec<String>,
}

/// A snapshot of the user and group databases.
#[derive(Clone, Debug, Default)]
pub(crate) struct UserDb {
    passwd: Vec<PasswdEntry>,
    groups: Vec<GroupEntry>,
}

fn read_small(path: &Path) -> io::Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    let mut s = String::new();
    f.take(MAX_DB_FILE).read_to_string(&mut s)?;
    Ok(s)
}

/// The colon-separated fields of each line of a passwd-style file that has at least
/// `min_fields` of them and a name; comments and malformed lines are skipped.
fn records(text: &str, min_fields: usize) -> impl Iterator<Item = Vec<&str>> {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| l.split(':').collect::<Vec<&str>>())
        .filter(move |f| f.len() >= min_fields && !f[0].is_empty())
}

impl UserDb {
    /// Reads the databases below `root`; a missing file counts as empty.
    pub fn load(root: &Path) -> UserDb {
        let passwd = read_small(&root.join("etc/passwd")).unwrap_or_default();
        let group = read_small(&root.join("etc/group")).unwrap_or_default();
        UserDb::parse(&passwd, &group)
    }

    /// Parses the text of `/etc/passwd` and `/etc/group`; malformed lines are skipped.
    pub fn parse(passwd: &str, group: &str) -> UserDb {
        let passwd = records(passwd, 7)
            .filter_map(|f| {
                Some(PasswdEntry {
                    name: f[0].to_string(),
                    uid: f[2].parse().ok()?,
                    gid: f[3].parse().ok()?,
                    home: f[5].to_string(),
                })
            })
            .collect();
        let groups = records(group, 3)
            .filter_map(|f| {
                Some(GroupEntry {
                    name: f[0].to_string(),
                    gid: f[2].parse().ok()?,
                    members: f
                        .get(3)
                        .map(|m| m.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect())
                        .unwrap_or_default(),
                })
            })
            .collect();
        UserDb { passwd, groups }
    }

    /// Looks a user up by name, with its supplementary groups. As in an OCI image config's
    /// `User`, `UID` or `UID:GID` names a user by number, listed in /etc/passwd or not (an image
    /// without one, distroless say).
    pub fn user(&self, name: &str) -> Option<User> {
        let Some(p) = self.passwd.iter().find(|p| p.name == name) else {
            let (uid, gid) = match name.split_once(':') {
                Some((u, g)) => (u.parse::<u32>().ok()?, Some(g.parse::<u32>().ok()?)),
                None => (name.parse::<u32>().ok()?, None),
            };
            if let Some(p) = self.passwd.iter().find(|p| p.uid == uid) {
                let mut u = self.user(&p.name.clone())?;
                if let Some(g) = gid {
                    u.gid = g;
                    u.groups = vec![g];
                }
                return Some(u);
            }
            let gid = gid.unwrap_or(uid);
            return Some(User { name: uid.to_string(), uid, gid, home: PathBuf::from("/"), groups: vec![gid] });
        };
        let mut groups = vec![p.gid];
        for g in &self.groups {
            if g.members.iter().any(|m| m == name) && !groups.contains(&g.gid) {
                groups.push(g.gid);
            }
        }
        let home = if p.home.is_empty() { PathBuf::from("/") } else { PathBuf::from(&p.home) };
        Some(User { name: p.name.clone(), uid: p.uid, gid: p.gid, home, groups })
    }

    /// The name of a uid, if it has one.
    pub fn user_name(&self, uid: u32) -> Option<&str> {
        self.passwd.iter().find(|p| p.uid == uid).map(|p| p.name.as_str())
    }

    /// The name of a gid, if it has one.
    pub fn group_name(&self, gid: u32) -> Option<&str> {
        self.groups.iter().find(|g| g.gid == gid).map(|g| g.name.as_str())
    }
}

/// The user name in an `Authorization: Basic base64("<user>:<anything>")` header.
pub(crate) fn parse_basic_auth(value: &str) -> Option<String> {
    let value = value.trim();
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD.decode(token.trim()).ok()?;
    let text = String::from_utf8(raw).ok()?;
    let user = text.split(':').next().unwrap_or("");
    Some(user.to_string())
}

/// Resolves a path given by a caller the way envd does: `~` and `~/x` expand to the home
/// directory, relative paths are joined to it, and the result is cleaned lexically.
pub(crate) fn resolve_path(path: &str, home: &Path) -> PathBuf {
    let joined = if path == "~" {
        home.to_path_buf()
    } else if let Some(rest) = path.strip_prefix("~/") {
        home.join(rest)
    } else if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        home.join(path)
    };
    clean(&joined)
}

/// Lexical cleaning: drops `.`, resolves `..` against the preceding component, keeps it absolute.
pub(crate) fn clean(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n# comment\nuser:x:1000:1000::/home/user:/bin/bash\nbroken\n";
    const GROUP: &str = "root:x:0:\nuser:x:1000:\ndocker:x:999:user,other\nwheel:x:10:root\n";

    #[test]
    fn parses_users_and_groups() {
        let db = UserDb::parse(PASSWD, GROUP);
        let u = db.user("user").unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_path()), (1000, 1000, Path::new("/home/user")));
        assert_eq!(u.groups, vec![1000, 999]);
        assert_eq!(db.user("root").unwrap().groups, vec![0, 10]);
        assert!(db.user("nobody").is_none());
        // By number, as an OCI config's User may say: a listed uid is that user...
        assert_eq!(db.user("1000").unwrap().name, "user");
        assert_eq!(db.user("1000:10").unwrap().gid, 10);
        // ...and an unlisted one runs as itself.
        let n = db.user("4321:99").unwrap();
        assert_eq!((n.uid, n.gid, n.home.as_path()), (4321, 99, Path::new("/")));
        assert!(db.user("12x").is_none() && db.user("1:x").is_none());
        assert_eq!(db.user_name(1000), Some("user"));
        assert_eq!(db.group_name(999), Some("docker"));
        assert_eq!(db.group_name(5), None);
    }

    #[test]
    fn basic_auth() {
        assert_eq!(parse_basic_auth("Basic cm9vdDo=").as_deref(), Some("root"));
        assert_eq!(parse_basic_auth("basic dXNlcjpzZWNyZXQ=").as_deref(), Some("user"));
        assert_eq!(parse_basic_auth("Bearer x"), None);
        assert_eq!(parse_basic_auth("Basic !!!"), None);
    }

    #[test]
    fn resolves_paths() {
        let home = Path::new("/home/user");
        assert_eq!(resolve_path("~", home), PathBuf::from("/home/user"));
        assert_eq!(resolve_path("~/a/../b", home), PathBuf::from("/home/user/b"));
        assert_eq!(resolve_path("dir/a.txt", home), PathBuf::from("/home/user/dir/a.txt"));
        assert_eq!(resolve_path("/tmp/./x/", home), PathBuf::from("/tmp/x"));
        assert_eq!(resolve_path("/../..", home), PathBuf::from("/"));
        assert_eq!(resolve_path("", home), PathBuf::from("/home/user"));
    }
}
