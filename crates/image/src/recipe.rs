//! The table of buildable images.
//!
//! A recipe is pure data: adding an image (say a code interpreter with
//! numpy and pandas) means adding an entry to [`RECIPES`], not new code.

use std::sync::OnceLock;

use crate::StartCommand;

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
    /// Packages for `--include`, on top of the variant's set, in groups so
    /// that a recipe can extend another's list without repeating it.
    pub packages: &'static [&'static [&'static str]],
    /// dpkg path filters, in groups; documentation and translations are
    /// dead weight in a sandbox and make up a large share of a small image.
    pub dpkg_opts: &'static [&'static [&'static str]],
    /// Shell commands for `--customize-hook`, in groups run in order; `$1`
    /// is the new root.
    pub customize: &'static [&'static [&'static str]],
    /// Progress stage name shown while the customize hooks run.
    pub customize_stage: &'static str,
    /// Files written into the rootfs once mmdebstrap is done (owned by
    /// root), before the `must_exist` check.
    pub files: &'static [ImageFile],
    /// Paths (relative to the rootfs) that must exist afterwards, as a
    /// sanity check that the hooks did their job; in groups like `packages`.
    pub must_exist: &'static [&'static [&'static str]],
    /// Default environment for processes.
    pub env: &'static [(&'static str, &'static str)],
    /// User that sandbox processes run as by default.
    pub default_user: &'static str,
    /// A service every sandbox of the image starts (see [`StartCommand`]).
    pub start: Option<StartRecipe>,
}

/// A file shipped with a recipe: its contents live in the cordon binary.
#[derive(Debug)]
pub(crate) struct ImageFile {
    /// Absolute path inside the image.
    pub path: &'static str,
    pub contents: &'static str,
    pub mode: u32,
}

/// The static form of [`StartCommand`].
#[derive(Debug)]
pub(crate) struct StartRecipe {
    pub cmd: &'static [&'static str],
    pub user: &'static str,
    pub cwd: &'static str,
    pub env: &'static [(&'static str, &'static str)],
    pub ready_port: u16,
    pub ready_timeout_secs: u64,
}

impl StartRecipe {
    pub(crate) fn to_command(&self) -> StartCommand {
        StartCommand {
            cmd: self.cmd.iter().map(|s| s.to_string()).collect(),
            user: self.user.into(),
            cwd: Some(self.cwd.into()),
            env: self
                .env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ready_port: Some(self.ready_port),
            ready_cmd: None,
            ready_timeout_secs: self.ready_timeout_secs,
            // Every recipe's service so far runs code for its callers. (A field of the recipe
            // would change its digest, and with it every image built from it would count as
            // stale: add one when a recipe's service is meant to be public.)
            needs_token: true,
        }
    }
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

/// Build-time-only files that scipy's dependencies drag in: Boost's headers
/// (for pythran, which only compiles scipy itself) and the static OpenBLAS
/// library. Nothing at run time reads them; they are a quarter of the image.
const INTERP_DPKG: &[&str] = &[
    "path-exclude=/usr/include/boost/*",
    "path-exclude=/usr/lib/x86_64-linux-gnu/openblas-pthread/*.a",
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

/// What every image has: a shell, Python, and the tools agents reach for first.
const BASE_PACKAGES: &[&str] = &[
    "bash",
    "coreutils",
    "python3",
    // `python` as well: E2B's base has it, and its docs start servers with `python -m ...`.
    "python-is-python3",
    "python3-pip",
    "python3-venv",
    "curl",
    "ca-certificates",
    "git",
    "sudo",
    "procps",
    // `ss`: the SDKs' `wait_for_port` ready command is `ss -Htuln sport = :PORT`.
    "iproute2",
    // /etc/services and /etc/protocols; without them getaddrinfo with
    // service names and many Python networking calls fail.
    "netbase",
];

const BASE_MUST_EXIST: &[&str] = &[
    "usr/bin/python3",
    "usr/bin/ss",
    "usr/bin/python",
    "usr/bin/sudo",
    "home/user",
    "etc/sudoers.d/user",
    "proc",
    "dev",
    "sys",
    "tmp",
];

/// The stack of `code-interpreter-v1`: a real Jupyter kernel (ipykernel,
/// driven through jupyter_client) and the libraries a data-analysis agent
/// imports without asking. All from Debian, so the build needs no PyPI.
/// Debian's scipy depends on pythran, which brings g++ and the Python
/// headers: that makes the image larger, and `pip install` of packages
/// with C extensions work inside it.
const INTERP_PACKAGES: &[&str] = &[
    "python3-ipykernel",
    "python3-jupyter-client",
    "python3-matplotlib-inline",
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
    "python3-scipy",
    "python3-seaborn",
    "python3-sklearn",
    "python3-sympy",
    "python3-requests",
    "python3-pil",
    "python3-openpyxl",
    "python3-xlrd",
    "python3-bs4",
    "python3-lxml",
    "python3-tabulate",
];

/// Where the interpreter service lives in the image.
const INTERP_SERVER: &str = "/opt/cordon/interp/server.py";

/// The port `e2b-code-interpreter` talks to.
pub(crate) const INTERP_PORT: u16 = 49999;

/// Hooks of `code-interpreter-v1`, run after [`USER_HOOKS`].
const INTERP_HOOKS: &[&str] = &[
    // matplotlib builds its font cache on first import (seconds); build it
    // once here, in the user's home of the image, instead of in every
    // sandbox's first plotting cell.
    r#"chroot --userspec=1000:1000 "$1" env HOME=/home/user MPLBACKEND=Agg python3 -c 'import matplotlib.pyplot'"#,
];

/// All recipes.
pub(crate) static RECIPES: &[Recipe] = &[
    Recipe {
        name: "base",
        suite: "bookworm",
        variant: "minbase",
        packages: &[BASE_PACKAGES],
        dpkg_opts: &[SMALL_DPKG],
        customize: &[USER_HOOKS],
        customize_stage: "creating user",
        files: &[],
        must_exist: &[BASE_MUST_EXIST],
        env: &[("PATH", DEFAULT_PATH), ("LANG", "C.UTF-8")],
        default_user: "user",
        start: None,
    },
    Recipe {
        name: "code-interpreter-v1",
        suite: "bookworm",
        variant: "minbase",
        packages: &[BASE_PACKAGES, INTERP_PACKAGES],
        dpkg_opts: &[SMALL_DPKG, INTERP_DPKG],
        customize: &[USER_HOOKS, INTERP_HOOKS],
        customize_stage: "creating user, font cache",
        files: &[
            ImageFile {
                path: INTERP_SERVER,
                contents: include_str!("../interp/server.py"),
                mode: 0o644,
            },
            // IPython reads this for every kernel (system config dir).
            ImageFile {
                path: "/etc/ipython/ipython_kernel_config.py",
                contents: include_str!("../interp/ipython_kernel_config.py"),
                mode: 0o644,
            },
        ],
        must_exist: &[
            BASE_MUST_EXIST,
            &[
                "usr/share/jupyter/kernels/python3/kernel.json",
                "home/user/.cache/matplotlib",
                "opt/cordon/interp/server.py",
            ],
        ],
        env: &[("PATH", DEFAULT_PATH), ("LANG", "C.UTF-8")],
        default_user: "user",
        start: Some(StartRecipe {
            cmd: &["python3", INTERP_SERVER],
            user: "user",
            cwd: "/home/user",
            env: &[],
            ready_port: INTERP_PORT,
            // A kernel starts in one or two seconds; a host busy with many
            // creates at once can take much longer.
            ready_timeout_secs: 60,
        }),
    },
];

/// Looks a recipe up by name.
impl Recipe {
    /// What the recipe says, as a short digest: an image built from an older recipe (other
    /// packages, hooks or shipped files, such as the interpreter's server) has another one.
    pub(crate) fn digest(&self) -> String {
        use sha2::Digest;
        let d = sha2::Sha256::digest(format!("{self:?}").as_bytes());
        d.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }
}

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
