//! The table of buildable images.
//!
//! A recipe is pure data: adding an image (say a code interpreter with
//! numpy and pandas) means adding an entry to [`RECIPES`], not new code.

use std::sync::OnceLock;

/// Default PATH for processes in every image.
pub(crate) const DEFAULT_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How to build one image with mmdebstrap.
#[derive(Debug)]
pub(crate) struct Recipe {
    /// Recipe and image name.
    pub name: &'static str,
    /// Debian suite.
    pub suite: &'static str,
    /// mmdebstrap `--variant`.
    pub variant: &'static str,
    /// Packages for `--include`, on top of the variant's set.
    pub packages: &'static [&'static str],
    /// dpkg path filters; documentation and translations are dead weight
    /// in a sandbox and make up a large share of a small image.
    pub dpkg_opts: &'static [&'static str],
    /// Shell commands for `--customize-hook`; `$1` is the new root.
    pub customize: &'static [&'static str],
    /// Progress stage name shown while the customize hooks run.
    pub customize_stage: &'static str,
    /// Paths (relative to the rootfs) that must exist afterwards, as a
    /// sanity check that the hooks did their job.
    pub must_exist: &'static [&'static str],
    /// Default environment for processes.
    pub env: &'static [(&'static str, &'static str)],
    /// User that sandbox processes run as by default.
    pub default_user: &'static str,
}

const SMALL_DPKG: &[&str] = &[
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/lintian/*",
];

/// Hooks that turn a bootstrap into a sandbox image with an unprivileged
/// `user` (uid/gid 1000) who may sudo without a password.
const USER_HOOKS: &[&str] = &[
    r#"chroot "$1" groupadd --gid 1000 user"#,
    r#"chroot "$1" useradd --uid 1000 --gid 1000 --groups sudo --create-home --home-dir /home/user --shell /bin/bash user"#,
    r#"mkdir -p "$1/etc/sudoers.d" && printf 'user ALL=(ALL:ALL) NOPASSWD: ALL\n' > "$1/etc/sudoers.d/user" && chmod 0440 "$1/etc/sudoers.d/user""#,
    // Mount points for the sandbox; /tmp must be world-writable and sticky.
    r#"mkdir -p "$1/proc" "$1/dev" "$1/sys" "$1/tmp" "$1/home/user" && chmod 1777 "$1/tmp""#,
    // Debian marks the system Python as externally managed, so a plain
    // `pip install x` fails; in a throwaway sandbox that is only an
    // obstacle (root installs into /usr/local, the user into ~/.local).
    r#"printf '[global]\nbreak-system-packages = true\n' > "$1/etc/pip.conf""#,
    // mmdebstrap copies the build host's name in; do not leak it, and make
    // the name resolvable (sudo complains on every call otherwise).
    r#"echo cordon > "$1/etc/hostname" && printf '127.0.1.1\tcordon\n' >> "$1/etc/hosts""#,
    // mmdebstrap also copies the build host's resolv.conf, which names a host resolver.
    // Sandboxes get DNS only from cordon's own egress path, never the host's.
    r#"rm -f "$1/etc/resolv.conf" && : > "$1/etc/resolv.conf""#,
];

/// All recipes.
pub(crate) static RECIPES: &[Recipe] = &[Recipe {
    name: "base",
    suite: "bookworm",
    variant: "minbase",
    packages: &[
        "bash",
        "coreutils",
        "python3",
        "python3-pip",
        "python3-venv",
        "curl",
        "ca-certificates",
        "git",
        "sudo",
        "procps",
        // /etc/services and /etc/protocols; without them getaddrinfo with
        // service names and many Python networking calls fail.
        "netbase",
    ],
    dpkg_opts: SMALL_DPKG,
    customize: USER_HOOKS,
    customize_stage: "creating user",
    must_exist: &[
        "usr/bin/python3",
        "usr/bin/sudo",
        "home/user",
        "etc/sudoers.d/user",
        "proc",
        "dev",
        "sys",
        "tmp",
    ],
    env: &[("PATH", DEFAULT_PATH), ("LANG", "C.UTF-8")],
    default_user: "user",
}];

/// Looks a recipe up by name.
pub(crate) fn find(name: &str) -> Option<&'static Recipe> {
    RECIPES.iter().find(|r| r.name == name)
}

/// Names of all recipes, in table order.
pub(crate) fn names() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES
        .get_or_init(|| RECIPES.iter().map(|r| r.name).collect())
        .as_slice()
}
