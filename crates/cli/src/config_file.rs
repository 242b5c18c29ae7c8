//! `cordon serve --config FILE`: every `cordon serve` flag, set from a TOML file under its long
//! name (`listen = "0.0.0.0:3000"`, `max-sandboxes = 100`, `pool = ["base=4"]`, booleans as
//! true/false). Without `--config`, `/etc/cordon/cordon.toml` is read when it exists.
//!
//! The file is turned into command-line flags and parsed by clap together with the real ones, so
//! each value is checked by the same parser as its flag and a flag added to `ServeArgs` later is a
//! key of the file with no code here: the keys are whatever long names clap knows for `serve`
//! (its own flags and the global ones, such as `state-dir`). A key is taken from the file only
//! when neither the command line nor the flag's environment variable set it, so the precedence is
//! command line, then environment, then file, then the flag's default.

use clap::parser::ValueSource;
use clap::{ArgAction, Command, Parser};
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

/// The file `cordon serve` reads when `--config` is not given, if it exists.
pub const DEFAULT_PATH: &str = "/etc/cordon/cordon.toml";

/// The subcommand whose flags the file holds.
const SUBCOMMAND: &str = "serve";
/// The id of `--config` itself, which the file cannot set.
const CONFIG_ID: &str = "config";

/// Why the command line could not be parsed.
#[derive(Debug)]
pub enum ParseError {
    /// The command line itself (clap's own error, help and version included).
    Clap(clap::Error),
    /// The configuration file.
    Config(ConfigError),
}

/// A configuration file that cannot be used; each says what to do, on one line.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--config {}: no such file: give an existing file (without --config, {DEFAULT_PATH} is read only when it exists)", path.display())]
    Missing { path: PathBuf },
    #[error("{}: cannot read it: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}:{line}:{column}: not valid TOML: {message}", path.display())]
    Syntax { path: PathBuf, line: usize, column: usize, message: String },
    #[error("{}: unknown key `{key}`{}: the keys are the long flags of `cordon serve` (see cordon serve --help)", path.display(), hint.as_ref().map(|h| format!(" (did you mean `{h}`?)")).unwrap_or_default())]
    UnknownKey { path: PathBuf, key: String, hint: Option<String> },
    #[error("{}: `{key}` must be {expected}, not {found}", path.display())]
    WrongType { path: PathBuf, key: String, expected: &'static str, found: &'static str },
    #[error("{}: `{key}`: {message}: fix it in the file, or override it with --{key}", path.display())]
    Value { path: PathBuf, key: String, message: String },
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    #[error("{} holds api-key and is readable by every user (mode {mode:04o}): chmod 600 {}, or leave the key out of it (CORDON_API_KEY, or the generated <state>/api-key)", path.display(), path.display())]
    KeyExposed { path: PathBuf, mode: u32 },
    #[error("{} is writable by every user (mode {mode:04o}), who could then choose what cordon serve runs as root: chmod o-w {}", path.display(), path.display())]
    WorldWritable { path: PathBuf, mode: u32 },
}

/// Parses `argv` as `P`, with the flags of `cordon serve` that the command line leaves unset
/// taken from the configuration file: `--config`, else `default` when it exists.
pub fn parse<P: Parser>(argv: Vec<OsString>, default: &Path) -> Result<P, ParseError> {
    let Some(merged) = merge(P::command(), &argv, default).map_err(ParseError::Config)? else {
        return P::try_parse_from(argv).map_err(ParseError::Clap);
    };
    P::try_parse_from(&merged.argv).map_err(|e| merged.blame(e, || P::try_parse_from(&argv).err()))
}

/// The command line with the file's flags appended.
struct Merged {
    argv: Vec<OsString>,
    path: PathBuf,
    /// The keys whose flags came from the file.
    from_file: Vec<String>,
}

impl Merged {
    /// Turns clap's error about the merged command line into one about whichever part is wrong:
    /// the command line alone (`cli_error`) unless all it lacks is a flag the file may give,
    /// else a key of the file, else the two together.
    fn blame(&self, e: clap::Error, cli_error: impl FnOnce() -> Option<clap::Error>) -> ParseError {
        if let Some(cli) = cli_error().filter(|c| c.kind() != clap::error::ErrorKind::MissingRequiredArgument) {
            return ParseError::Clap(cli);
        }
        // A value its flag refused is the key's; flags that do not go together are the file's.
        use clap::error::ErrorKind::*;
        let about_a_value = matches!(e.kind(), InvalidValue | ValueValidation | InvalidUtf8 | TooManyValues | TooFewValues | WrongNumberOfValues);
        match invalid_key(&e).filter(|k| about_a_value && self.from_file.contains(k)) {
            Some(key) => ParseError::Config(ConfigError::Value { path: self.path.clone(), key, message: clap_message(&e) }),
            None => ParseError::Config(ConfigError::Invalid { path: self.path.clone(), message: clap_message(&e) }),
        }
    }
}

/// The merged command line, or `None` when there is no file to read (not `serve`, or no
/// `--config` and no default file) or the command line does not parse far enough to tell; clap
/// then reports on the command line alone.
fn merge(mut cmd: Command, argv: &[OsString], default: &Path) -> Result<Option<Merged>, ConfigError> {
    // A first, forgiving pass finds `--config` and what the command line sets, even when the
    // command line alone is incomplete (`--pool-memory` whose `pool` the file has).
    let Ok(matches) = cmd.clone().ignore_errors(true).try_get_matches_from(argv) else {
        return Ok(None);
    };
    let Some((SUBCOMMAND, sub)) = matches.subcommand() else {
        return Ok(None);
    };
    let named = sub.try_get_one::<PathBuf>(CONFIG_ID).ok().flatten().filter(|_| user_set(sub.value_source(CONFIG_ID)));
    let (path, explicit) = match named {
        Some(p) => (p.clone(), true),
        None if default.exists() => (default.to_path_buf(), false),
        None => return Ok(None),
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && explicit => return Err(ConfigError::Missing { path }),
        Err(source) => return Err(ConfigError::Read { path, source }),
    };
    let table = read_table(&path, &text)?;
    if let Ok(meta) = std::fs::metadata(&path) {
        // Only a regular file: `--config /dev/null` (no file) is world-writable and harmless.
        if meta.is_file() {
            if let Some(warning) = check_mode(&path, meta.permissions().mode(), table.contains_key("api-key"))? {
                eprintln!("cordon: warning: {warning}");
            }
        }
    }

    cmd.build();
    let serve = cmd.find_subcommand(SUBCOMMAND).expect("the serve subcommand exists");
    let keys: Vec<&clap::Arg> = serve.get_arguments().filter(|a| a.get_long().is_some() && a.get_id() != CONFIG_ID && settable(a.get_action())).collect();
    let mut argv = argv.to_vec();
    let mut from_file = Vec::new();
    for (key, value) in &table {
        let Some(arg) = keys.iter().find(|a| a.get_long() == Some(key.as_str())) else {
            let hint = closest(key, keys.iter().filter_map(|a| a.get_long()));
            return Err(ConfigError::UnknownKey { path, key: key.clone(), hint });
        };
        // Checked even when the command line overrides it: a wrong file is wrong either way.
        let flags = flags(&path, key, arg.get_action(), value)?;
        if !user_set(sub.value_source(arg.get_id().as_str())) {
            argv.extend(flags);
            from_file.push(key.clone());
        }
    }
    if !explicit {
        // So that `serve` can say which file it read.
        let mut flag = OsString::from("--config=");
        flag.push(&path);
        argv.push(flag);
    }
    Ok(Some(Merged { argv, path, from_file }))
}

/// The flag was given on the command line or through its environment variable, both of which
/// take precedence over the file.
fn user_set(source: Option<ValueSource>) -> bool {
    matches!(source, Some(ValueSource::CommandLine | ValueSource::EnvVariable))
}

/// The actions that a file can ask for (not help or version).
fn settable(action: &ArgAction) -> bool {
    matches!(action, ArgAction::Set | ArgAction::Append | ArgAction::SetTrue | ArgAction::SetFalse | ArgAction::Count)
}

fn read_table(path: &Path, text: &str) -> Result<toml::Table, ConfigError> {
    text.parse::<toml::Table>().map_err(|e| {
        let (line, column) = e.span().map_or((1, 1), |s| line_column(text, s.start));
        ConfigError::Syntax { path: path.to_path_buf(), line, column, message: e.message().trim().replace('\n', "; ") }
    })
}

/// 1-based line and column of byte `offset`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Refuses a file anyone can write (it decides what a root process runs) or, when it holds the
/// API key, read; warns when its group can read the key.
fn check_mode(path: &Path, mode: u32, holds_key: bool) -> Result<Option<String>, ConfigError> {
    let mode = mode & 0o7777;
    if mode & 0o002 != 0 {
        return Err(ConfigError::WorldWritable { path: path.to_path_buf(), mode });
    }
    if holds_key && mode & 0o004 != 0 {
        return Err(ConfigError::KeyExposed { path: path.to_path_buf(), mode });
    }
    if holds_key && mode & 0o040 != 0 {
        return Ok(Some(format!("{} holds api-key and its group can read it (mode {mode:04o}): chmod 600 {} unless that group is meant to", path.display(), path.display())));
    }
    Ok(None)
}

/// The command-line flags that say what `value` says for the flag `--key`.
fn flags(path: &Path, key: &str, action: &ArgAction, value: &toml::Value) -> Result<Vec<OsString>, ConfigError> {
    let wrong = |expected: &'static str| ConfigError::WrongType { path: path.to_path_buf(), key: key.to_string(), expected, found: kind(value) };
    // `--key=value`, never `--key value`: a value that starts with `-` stays a value.
    let with = |v: String| OsString::from(format!("--{key}={v}"));
    match action {
        ArgAction::SetTrue | ArgAction::SetFalse => match value {
            toml::Value::Boolean(true) => Ok(vec![OsString::from(format!("--{key}"))]),
            toml::Value::Boolean(false) => Ok(Vec::new()),
            _ => Err(wrong("true or false")),
        },
        ArgAction::Count => match value {
            toml::Value::Integer(n @ 0..=16) => Ok((0..*n).map(|_| OsString::from(format!("--{key}"))).collect()),
            _ => Err(wrong("a count from 0 to 16")),
        },
        ArgAction::Append => match value {
            toml::Value::Array(items) => items.iter().map(|v| scalar(v).map(with).ok_or_else(|| wrong("a list of strings or numbers"))).collect(),
            v => scalar(v).map(|s| vec![with(s)]).ok_or_else(|| wrong("a string or number, or a list of them")),
        },
        _ => scalar(value).map(|s| vec![with(s)]).ok_or_else(|| wrong("one string or number")),
    }
}

/// A single value as its flag would take it.
fn scalar(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(n) => Some(n.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        toml::Value::Datetime(_) | toml::Value::Array(_) | toml::Value::Table(_) => None,
    }
}

fn kind(value: &toml::Value) -> &'static str {
    match value {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a float",
        toml::Value::Boolean(_) => "a boolean",
        toml::Value::Datetime(_) => "a date",
        toml::Value::Array(_) => "a list",
        toml::Value::Table(_) => "a table",
    }
}

/// The key of the flag clap's error is about, when it names one (`--listen <LISTEN>`).
fn invalid_key(e: &clap::Error) -> Option<String> {
    let clap::error::ContextValue::String(arg) = e.get(clap::error::ContextKind::InvalidArg)? else {
        return None;
    };
    let name = arg.strip_prefix("--")?;
    Some(name.split([' ', '=']).next().unwrap_or(name).to_string())
}

/// clap's error on one line, without its usage and help lines.
fn clap_message(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let lines: Vec<&str> = text.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
    let msg = lines.join(" ");
    msg.strip_prefix("error: ").unwrap_or(&msg).to_string()
}

/// The known key nearest to a mistyped one, when it is near (an edit or two, `_` for `-`).
fn closest<'a>(key: &str, known: impl Iterator<Item = &'a str>) -> Option<String> {
    let key = key.to_ascii_lowercase().replace('_', "-");
    known.map(|k| (edit_distance(&key, k), k)).filter(|(d, _)| *d <= 2).min().map(|(_, k)| k.to_string())
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, Subcommand};
    use std::net::SocketAddr;

    /// The shape of cordon's command line: a global flag, a subcommand with flags of each kind.
    #[derive(Parser, Debug)]
    struct TestCli {
        #[arg(long, global = true, env = "CORDON_CONFIG_FILE_TEST_HOME", default_value = "/var/lib/cordon")]
        state_dir: PathBuf,
        #[arg(long, short, global = true, action = ArgAction::Count)]
        verbose: u8,
        #[command(subcommand)]
        command: TestCommand,
    }

    #[derive(Subcommand, Debug)]
    enum TestCommand {
        Serve(TestServe),
        Run {
            #[arg(long)]
            image: Option<String>,
        },
    }

    #[derive(Args, Debug)]
    struct TestServe {
        #[arg(long, default_value = "127.0.0.1:3000")]
        listen: SocketAddr,
        #[arg(long, env = "CORDON_CONFIG_FILE_TEST_KEY")]
        api_key: Option<String>,
        #[arg(long, default_value_t = 100)]
        max_sandboxes: usize,
        #[arg(long, requires = "tls_key", conflicts_with = "tls_self_signed")]
        tls_cert: Option<PathBuf>,
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        #[arg(long)]
        tls_self_signed: bool,
        #[arg(long, num_args = 1..)]
        prebuild: Vec<String>,
        #[arg(long = "pool")]
        pool: Vec<String>,
        #[arg(long, requires = "pool")]
        pool_memory: Option<String>,
        #[arg(long, value_enum, default_value_t = Mode::Closed)]
        network_default: Mode,
        #[arg(long)]
        config: Option<PathBuf>,
    }

    #[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq)]
    enum Mode {
        Closed,
        Open,
    }

    /// A file with `text` at `mode`, removed when dropped.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(text: &str, mode: u32) -> TempFile {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!("cordon-config-test-{}-{}.toml", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn argv(args: &[&str]) -> Vec<OsString> {
        std::iter::once("cordon").chain(args.iter().copied()).map(OsString::from).collect()
    }

    fn no_default() -> PathBuf {
        PathBuf::from("/nonexistent/cordon/cordon.toml")
    }

    /// `cordon serve --config FILE ARGS...` with FILE holding `text`.
    fn serve_with(text: &str, args: &[&str]) -> Result<(TestCli, TestServe), ParseError> {
        let file = TempFile::new(text, 0o600);
        let mut a = vec!["serve", "--config", file.0.to_str().unwrap()];
        a.extend_from_slice(args);
        let cli: TestCli = parse(argv(&a), &no_default())?;
        let TestCli { state_dir, verbose, command: TestCommand::Serve(s) } = cli else { panic!("not serve") };
        Ok((TestCli { state_dir, verbose, command: TestCommand::Run { image: None } }, s))
    }

    fn config_error(r: Result<(TestCli, TestServe), ParseError>) -> ConfigError {
        match r {
            Err(ParseError::Config(e)) => e,
            Err(ParseError::Clap(e)) => panic!("a command-line error, not the file's: {e}"),
            Ok((_, s)) => panic!("parsed: {s:?}"),
        }
    }

    #[test]
    fn every_kind_of_value_becomes_its_flag() {
        let (cli, s) = serve_with(
            r#"
            listen = "0.0.0.0:3001"
            api-key = "from-the-file"
            max-sandboxes = 7
            tls-self-signed = true
            prebuild = ["base", "code-interpreter-v1"]
            pool = ["base=4", "code-interpreter-v1=2"]
            network-default = "open"
            state-dir = "/srv/cordon"
            verbose = 2
            "#,
            &[],
        )
        .unwrap();
        assert_eq!(s.listen, "0.0.0.0:3001".parse().unwrap());
        assert_eq!(s.api_key.as_deref(), Some("from-the-file"));
        assert_eq!(s.max_sandboxes, 7);
        assert!(s.tls_self_signed);
        assert_eq!(s.prebuild, ["base", "code-interpreter-v1"]);
        assert_eq!(s.pool, ["base=4", "code-interpreter-v1=2"]);
        assert_eq!(s.network_default, Mode::Open);
        assert_eq!(cli.state_dir, Path::new("/srv/cordon"));
        assert_eq!(cli.verbose, 2);
    }

    #[test]
    fn a_single_value_is_a_list_of_one_and_false_leaves_a_flag_off() {
        let (_, s) = serve_with("pool = \"base=2\"\ntls-self-signed = false\n", &[]).unwrap();
        assert_eq!(s.pool, ["base=2"]);
        assert!(!s.tls_self_signed);
    }

    #[test]
    fn the_command_line_overrides_the_file_lists_included() {
        let (_, s) = serve_with("listen = \"0.0.0.0:3001\"\nmax-sandboxes = 7\npool = [\"base=4\"]\n", &["--listen", "127.0.0.1:4000", "--pool", "base=1"]).unwrap();
        assert_eq!(s.listen, "127.0.0.1:4000".parse().unwrap());
        assert_eq!(s.pool, ["base=1"], "the command line's list replaces the file's");
        assert_eq!(s.max_sandboxes, 7);
    }

    #[test]
    fn a_flag_on_the_command_line_may_need_one_from_the_file() {
        let (_, s) = serve_with("pool = [\"base=4\"]\n", &["--pool-memory", "4G"]).unwrap();
        assert_eq!((s.pool.as_slice(), s.pool_memory.as_deref()), (&["base=4".to_string()][..], Some("4G")));
    }

    #[test]
    fn values_that_start_with_a_dash_stay_values() {
        let (_, s) = serve_with("api-key = \"--not-a-flag\"\n", &[]).unwrap();
        assert_eq!(s.api_key.as_deref(), Some("--not-a-flag"));
    }

    #[test]
    fn an_unknown_key_is_named_with_the_nearest_known_one() {
        let e = config_error(serve_with("lisen = \"0.0.0.0:1\"\n", &[]));
        assert!(matches!(&e, ConfigError::UnknownKey { key, hint: Some(h), .. } if key == "lisen" && h == "listen"), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains(".toml: unknown key `lisen` (did you mean `listen`?)") && !msg.contains('\n'), "{msg}");
        let e = config_error(serve_with("max_sandboxes = 3\n", &[]));
        assert!(matches!(&e, ConfigError::UnknownKey { hint: Some(h), .. } if h == "max-sandboxes"), "{e:?}");
        let e = config_error(serve_with("[serve]\nlisten = \"0.0.0.0:1\"\n", &[]));
        assert!(matches!(&e, ConfigError::UnknownKey { key, .. } if key == "serve"), "{e:?}");
        for key in ["config", "help", "version"] {
            let e = config_error(serve_with(&format!("{key} = \"x\"\n"), &[]));
            assert!(matches!(&e, ConfigError::UnknownKey { .. }), "{key}: {e:?}");
        }
    }

    #[test]
    fn wrong_types_say_what_the_key_takes() {
        for (text, key, found) in [
            ("tls-self-signed = \"yes\"\n", "tls-self-signed", "a string"),
            ("listen = [\"0.0.0.0:1\", \"0.0.0.0:2\"]\n", "listen", "a list"),
            ("pool = [[\"base\"]]\n", "pool", "a list"),
            ("listen = { host = \"x\" }\n", "listen", "a table"),
            ("verbose = true\n", "verbose", "a boolean"),
            ("api-key = 1979-05-27\n", "api-key", "a date"),
        ] {
            let e = config_error(serve_with(text, &[]));
            assert!(matches!(&e, ConfigError::WrongType { key: k, found: f, .. } if k == key && *f == found), "{text}: {e:?}");
        }
        // Checked even where the command line overrides the key.
        let e = config_error(serve_with("tls-self-signed = 1\n", &["--tls-self-signed"]));
        assert!(matches!(&e, ConfigError::WrongType { .. }), "{e:?}");
    }

    #[test]
    fn a_bad_value_is_the_files_and_names_its_key() {
        for (text, key) in [("listen = 3000\n", "listen"), ("max-sandboxes = \"many\"\n", "max-sandboxes"), ("max-sandboxes = -1\n", "max-sandboxes"), ("network-default = \"ajar\"\n", "network-default")] {
            let e = config_error(serve_with(text, &[]));
            let msg = e.to_string();
            assert!(matches!(&e, ConfigError::Value { key: k, .. } if k == key), "{text}: {e:?}");
            assert!(msg.contains(".toml: `") && msg.contains(&format!("override it with --{key}")) && !msg.contains('\n'), "{msg}");
        }
    }

    #[test]
    fn flags_that_do_not_go_together_are_the_files_when_the_command_line_alone_is_fine() {
        let e = config_error(serve_with("tls-cert = \"/c.pem\"\n", &[]));
        assert!(matches!(&e, ConfigError::Invalid { message, .. } if message.contains("--tls-key")), "{e:?}");
        let e = config_error(serve_with("tls-cert = \"/c.pem\"\ntls-key = \"/k.pem\"\ntls-self-signed = true\n", &[]));
        assert!(matches!(&e, ConfigError::Invalid { message, .. } if message.contains("cannot be used with")), "{e:?}");
        // The command line's own mistake stays clap's, the same key in the file or not.
        for text in ["listen = \"0.0.0.0:1\"\n", "max-sandboxes = 7\n"] {
            match serve_with(text, &["--max-sandboxes", "lots"]) {
                Err(ParseError::Clap(e)) => assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation),
                other => panic!("{text}: {:?}", other.map(|(_, s)| s)),
            }
        }
    }

    #[test]
    fn bad_toml_is_one_line_with_its_place() {
        let e = config_error(serve_with("listen = \"0.0.0.0:1\"\nmax-sandboxes = = 3\n", &[]));
        let msg = e.to_string();
        assert!(matches!(&e, ConfigError::Syntax { line: 2, .. }), "{e:?}");
        assert!(msg.contains(".toml:2:") && msg.contains("not valid TOML") && !msg.contains('\n'), "{msg}");
        let e = config_error(serve_with("listen = \"a\"\nlisten = \"b\"\n", &[]));
        assert!(matches!(&e, ConfigError::Syntax { line: 2, .. }), "a key given twice: {e:?}");
    }

    #[test]
    fn a_missing_config_is_an_error_and_a_missing_default_is_nothing() {
        let r: Result<TestCli, _> = parse(argv(&["serve", "--config", "/nonexistent/c.toml"]), &no_default());
        assert!(matches!(r, Err(ParseError::Config(ConfigError::Missing { .. }))), "{r:?}");
        let cli: TestCli = parse(argv(&["serve"]), &no_default()).unwrap();
        let TestCommand::Serve(s) = cli.command else { panic!() };
        assert_eq!((s.listen.port(), s.config), (3000, None));
    }

    #[test]
    fn the_default_file_is_read_when_it_exists_and_named_to_serve() {
        let file = TempFile::new("max-sandboxes = 9\n", 0o644);
        let cli: TestCli = parse(argv(&["serve"]), &file.0).unwrap();
        let TestCommand::Serve(s) = cli.command else { panic!() };
        assert_eq!((s.max_sandboxes, s.config.as_deref()), (9, Some(file.0.as_path())));
        // Other subcommands never read it.
        let cli: TestCli = parse(argv(&["run", "--image", "x"]), &file.0).unwrap();
        assert!(matches!(cli.command, TestCommand::Run { .. }));
        // `--config /dev/null`: no settings, whatever the default holds.
        let cli: TestCli = parse(argv(&["serve", "--config", "/dev/null"]), &file.0).unwrap();
        let TestCommand::Serve(s) = cli.command else { panic!() };
        assert_eq!(s.max_sandboxes, 100);
    }

    #[test]
    fn help_and_version_are_left_to_clap() {
        // Even when the file is wrong: help is how to find out what is right.
        let file = TempFile::new("lisen = 9\n", 0o644);
        let r: Result<TestCli, _> = parse(argv(&["serve", "--help"]), &file.0);
        assert!(matches!(&r, Err(ParseError::Clap(e)) if e.kind() == clap::error::ErrorKind::DisplayHelp), "{r:?}");
        let r: Result<crate::Cli, _> = parse(argv(&["serve", "--version"]), &file.0);
        assert!(matches!(&r, Err(ParseError::Clap(e)) if e.kind() == clap::error::ErrorKind::DisplayVersion), "{:?}", r.err());
    }

    #[test]
    fn a_key_in_a_file_others_can_read_is_refused_and_in_one_its_group_can_read_is_warned_of() {
        let p = Path::new("/etc/cordon/cordon.toml");
        assert!(matches!(check_mode(p, 0o100644, true), Err(ConfigError::KeyExposed { mode: 0o644, .. })));
        assert!(check_mode(p, 0o640, true).unwrap().is_some_and(|w| w.contains("chmod 600 /etc/cordon/cordon.toml")));
        assert_eq!(check_mode(p, 0o600, true).unwrap(), None);
        assert_eq!(check_mode(p, 0o644, false).unwrap(), None, "a file without the key may be read by all");
        assert!(matches!(check_mode(p, 0o666, false), Err(ConfigError::WorldWritable { .. })));
        let e = check_mode(p, 0o644, true).unwrap_err().to_string();
        assert!(e.contains("mode 0644") && e.contains("chmod 600 /etc/cordon/cordon.toml"), "{e}");

        let file = TempFile::new("api-key = \"k\"\n", 0o644);
        let r: Result<TestCli, _> = parse(argv(&["serve", "--config", file.0.to_str().unwrap()]), &no_default());
        assert!(matches!(r, Err(ParseError::Config(ConfigError::KeyExposed { .. }))), "{r:?}");
    }

    #[test]
    fn cordons_own_serve_flags_are_keys() {
        let file = TempFile::new("listen = \"0.0.0.0:3002\"\nmax-sandboxes = 5\npool = [\"base=4\", \"code-interpreter-v1=2\"]\napi-key = \"k\"\nstate-dir = \"/srv/c\"\n", 0o600);
        let cli: crate::Cli = parse(argv(&["serve", "--config", file.0.to_str().unwrap()]), &no_default()).unwrap();
        assert_eq!(cli.state_dir, Path::new("/srv/c"));
        assert!(matches!(cli.command, crate::Command::Serve(_)));
        let r: Result<crate::Cli, _> = parse(argv(&["serve", "--config", file.0.to_str().unwrap(), "--max-sandboxes", "0x"]), &no_default());
        assert!(matches!(r, Err(ParseError::Clap(_))), "{:?}", r.err());
    }

    /// The sample file shipped in the .deb names every key, so that an operator finds each
    /// flag there: a flag added to `cordon serve` goes into packaging/cordon.toml too.
    #[test]
    fn the_sample_file_names_every_key() {
        let sample = include_str!("../../../packaging/cordon.toml");
        let mut cmd = <crate::Cli as clap::CommandFactory>::command();
        cmd.build();
        let serve = cmd.find_subcommand(SUBCOMMAND).unwrap();
        let missing: Vec<&str> = serve
            .get_arguments()
            .filter(|a| a.get_id() != CONFIG_ID && settable(a.get_action()) && !a.is_hide_set())
            .filter_map(|a| a.get_long())
            .filter(|k| !sample.lines().any(|l| l.trim_start_matches(['#', ' ']).starts_with(&format!("{k} ="))))
            .collect();
        assert!(missing.is_empty(), "packaging/cordon.toml does not mention {missing:?}: add each as a commented `# KEY = VALUE` line with its help");
        // And the sample as shipped (everything commented) parses.
        let table = read_table(Path::new("cordon.toml"), sample).unwrap();
        assert!(table.is_empty(), "the sample sets {table:?}: the defaults belong to the binary");
    }

    #[test]
    fn places_in_text_are_counted_from_one() {
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
        assert_eq!(line_column("ab", 0), (1, 1));
        assert_eq!(edit_distance("lisen", "listen"), 1);
    }
}
