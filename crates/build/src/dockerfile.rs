//! Dockerfile parsing for the Docker-less image builder.
//!
//! [`parse`] turns Dockerfile text into stages of instructions, each tagged with the line it
//! starts on so every later error (parse time or build time) can point at the Dockerfile. No I/O.
//!
//! Arguments stay raw: the executor substitutes variables at build time with its own environment
//! via [`substitute`], because only it knows the ENV/ARG values in effect at each step. The one
//! exception is `FROM`, whose image must be known before any stage runs, so it is substituted here
//! with the ARGs declared before the first FROM.
//!
//! ENV, LABEL and ARG values are the exception to "raw" in one way: their quotes are removed
//! here (splitting `K=V K2="a b"` needs quote awareness anyway). To keep that lossless, the
//! stored values are "substitution-ready": a literal `$` (from `\$` or single quotes) is stored
//! as `\$` and a literal backslash as `\\`, so passing them through [`substitute`] yields exactly
//! what a shell would.

/// A parsed Dockerfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dockerfile {
    pub stages: Vec<Stage>,
}

/// One `FROM` and the instructions up to the next `FROM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// 0-based.
    pub index: usize,
    /// `FROM x AS name`, lowercased as Docker does.
    pub name: Option<String>,
    /// The image reference (or earlier stage name), global ARGs already substituted.
    pub from: String,
    /// Line of the FROM.
    pub line: usize,
    pub instructions: Vec<Instruction>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instruction {
    /// 1-based line the instruction starts on.
    pub line: usize,
    /// The instruction as written, continuation lines joined and comment lines dropped.
    pub text: String,
    pub kind: Kind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Run through the stage's SHELL (default `/bin/sh -c`).
    Shell(String),
    /// JSON form: argv, no shell.
    Exec(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Run(Command),
    Copy { srcs: Vec<String>, dest: String, from: Option<String>, chown: Option<String>, chmod: Option<String> },
    Add { srcs: Vec<String>, dest: String, chown: Option<String>, chmod: Option<String> },
    /// Unquoted, substitution-ready values (see the module docs).
    Env(Vec<(String, String)>),
    /// `default` is unquoted and substitution-ready. A stage's `ARG NAME` without a default that
    /// re-declares a global ARG (or an automatic platform ARG) gets the global's value here, as
    /// Docker does; the executor still lets a build arg override it.
    Arg { name: String, default: Option<String> },
    Workdir(String),
    User(String),
    Cmd(Command),
    Entrypoint(Command),
    /// Each `port[-port]/proto`, proto defaulting to tcp; entries containing `$` are kept raw.
    Expose(Vec<String>),
    /// Same value form as [`Kind::Env`].
    Label(Vec<(String, String)>),
    Shell(Vec<String>),
    StopSignal(String),
    Healthcheck(String),
    Volume(Vec<String>),
    OnBuild(String),
    Maintainer(String),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Dockerfile line {line}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

fn error(line: usize, message: impl Into<String>) -> ParseError {
    ParseError { line, message: message.into() }
}

const KEYWORDS: &[&str] = &[
    "FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "SHELL",
    "STOPSIGNAL", "HEALTHCHECK", "VOLUME", "ONBUILD", "MAINTAINER",
];

/// BuildKit predefines these in the global scope; we only ever build linux/amd64.
const PLATFORM_ARGS: &[(&str, &str)] = &[
    ("TARGETPLATFORM", "linux/amd64"),
    ("TARGETOS", "linux"),
    ("TARGETARCH", "amd64"),
    ("BUILDPLATFORM", "linux/amd64"),
    ("BUILDOS", "linux"),
    ("BUILDARCH", "amd64"),
];

/// Parses a Dockerfile. `build_args` override the defaults of global ARGs when substituting FROM;
/// build args nobody declares are ignored (Docker only warns).
pub fn parse(text: &str, build_args: &[(String, String)]) -> Result<Dockerfile, ParseError> {
    let mut stages: Vec<Stage> = Vec::new();
    // ARGs before the first FROM with their effective values; later declarations shadow earlier.
    let mut globals: Vec<(String, Option<String>)> = Vec::new();
    let build_arg = |name: &str| build_args.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone());

    for logical in logical_lines(text)? {
        let line = logical.line;
        let (word, rest) = match logical.text.split_once(char::is_whitespace) {
            Some((w, r)) => (w, r.trim()),
            None => (logical.text.as_str(), ""),
        };
        let keyword = word.to_ascii_uppercase();

        if keyword == "FROM" {
            let stage = parse_from(rest, line, stages.len(), &globals)?;
            if let Some(name) = &stage.name {
                if let Some(prev) = stages.iter().find(|s| s.name.as_ref() == Some(name)) {
                    return Err(error(line, format!("duplicate stage name '{name}' (already used on line {})", prev.line)));
                }
            }
            stages.push(stage);
            continue;
        }

        let Some(stage) = stages.last_mut() else {
            if keyword != "ARG" {
                return Err(error(
                    line,
                    if KEYWORDS.contains(&keyword.as_str()) {
                        format!("the first instruction must be FROM (found {keyword}; only ARG may come before FROM)")
                    } else {
                        format!("unknown instruction '{word}'")
                    },
                ));
            }
            let (name, default) = parse_arg(rest).map_err(|m| error(line, m))?;
            let value = match build_arg(&name) {
                // Build args are literal values from the user, never substituted.
                Some(v) => Some(v),
                None => default
                    .map(|d| substitute(&d, &|n| global_value(&globals, n)))
                    .transpose()
                    .map_err(|m| error(line, format!("ARG {name}: {m}")))?,
            };
            globals.push((name, value));
            continue;
        };

        let mut kind = parse_kind(&keyword, word, rest).map_err(|m| error(line, m))?;
        if let Kind::Arg { name, default: default @ None } = &mut kind {
            *default = global_value(&globals, name).map(|v| escape_literal(&v));
        }
        stage.instructions.push(Instruction { line, text: logical.text, kind });
    }

    if stages.is_empty() {
        return Err(error(1, "the Dockerfile has no FROM"));
    }
    Ok(Dockerfile { stages })
}

fn global_value(globals: &[(String, Option<String>)], name: &str) -> Option<String> {
    globals
        .iter()
        .rev()
        .find(|(n, _)| n == name)
        .and_then(|(_, v)| v.clone())
        .or_else(|| PLATFORM_ARGS.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_string()))
}

/// Makes a literal value safe to store where [`substitute`] will run over it later.
fn escape_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c == '$' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

struct Logical {
    line: usize,
    text: String,
}

/// Joins continuation lines and drops comments and blank lines, remembering where each
/// instruction starts.
fn logical_lines(text: &str) -> Result<Vec<Logical>, ParseError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut out = Vec::new();
    let mut current: Option<Logical> = None;
    // Whether whitespace separated the last piece from its backslash; see the join below.
    let mut pending_space = false;
    // Parser directives are only recognised before anything else, as in Docker.
    let mut in_directives = true;

    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = raw.trim();
        if in_directives {
            if let Some((key, value)) = directive(trimmed) {
                if key == "escape" && value != "\\" {
                    return Err(error(n, format!("'# escape={value}' is not supported; only the default backslash is")));
                }
                continue;
            }
            in_directives = false;
        }
        // Docker drops comment and blank lines even in the middle of a continuation.
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let body = raw.trim_end();
        let (body, continues) = match body.strip_suffix('\\') {
            Some(b) => (b, true),
            None => (body, false),
        };
        let piece = body.trim();
        let cur = current.get_or_insert_with(|| Logical { line: n, text: String::new() });
        if !piece.is_empty() {
            // Docker concatenates continuation lines verbatim; we collapse the indentation to one
            // space for readable logs and stable cache keys, but keep `foo\` + `bar` as `foobar`.
            if !cur.text.is_empty() && (pending_space || body.starts_with(char::is_whitespace)) {
                cur.text.push(' ');
            }
            cur.text.push_str(piece);
            pending_space = body.ends_with(char::is_whitespace);
        } else {
            pending_space |= !body.is_empty();
        }
        if !continues {
            out.extend(current.take().filter(|l| !l.text.is_empty()));
            pending_space = false;
        }
    }
    // A continuation at end of file just ends the instruction, as in Docker.
    out.extend(current.filter(|l| !l.text.is_empty()));
    Ok(out)
}

/// `# key=value` at the top of the file.
fn directive(line: &str) -> Option<(String, &str)> {
    let (key, value) = line.strip_prefix('#')?.split_once('=')?;
    let key = key.trim();
    (!key.is_empty() && key.chars().all(|c| c.is_ascii_alphabetic())).then(|| (key.to_ascii_lowercase(), value.trim()))
}

fn parse_from(rest: &str, line: usize, index: usize, globals: &[(String, Option<String>)]) -> Result<Stage, ParseError> {
    let fail = |m: String| error(line, m);
    let lookup = |n: &str| global_value(globals, n);
    let (flags, args) = take_flags(rest).map_err(fail)?;
    for (flag, value) in flags {
        if flag != "platform" {
            return Err(fail(format!("FROM: unknown flag --{flag}")));
        }
        let value = value.ok_or_else(|| fail("FROM --platform needs a value".into()))?;
        let platform = substitute(&value, &lookup).map_err(|m| fail(format!("FROM --platform: {m}")))?;
        if !platform.eq_ignore_ascii_case("linux/amd64") {
            return Err(fail(format!("FROM --platform={platform} is not supported; only linux/amd64 can be built")));
        }
    }
    let words: Vec<&str> = args.split_whitespace().collect();
    let (image, name) = match words.as_slice() {
        [] => return Err(fail("FROM requires an argument".into())),
        [image] => (*image, None),
        [image, as_, name] if as_.eq_ignore_ascii_case("as") => (*image, Some(name.to_ascii_lowercase())),
        _ => return Err(fail(format!("FROM expects 'image [AS name]', got '{args}'"))),
    };
    if let Some(name) = &name {
        let mut chars = name.chars();
        let valid = chars.next().is_some_and(|c| c.is_ascii_lowercase())
            && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c));
        if !valid {
            return Err(fail(format!("invalid stage name '{name}' (letters, digits, '-', '_', '.'; starting with a letter)")));
        }
    }
    let from = substitute(image, &lookup).map_err(|m| fail(format!("FROM: {m}")))?;
    if from.is_empty() {
        return Err(fail(format!("FROM: image '{image}' is empty after substituting ARGs")));
    }
    Ok(Stage { index, name, from, line, instructions: Vec::new() })
}

fn parse_kind(keyword: &str, word: &str, rest: &str) -> Result<Kind, String> {
    // Every instruction needs something after the keyword; flags are checked first so that
    // `RUN --mount=...` reports the flag rather than something vaguer.
    let needs_arg = |s: &str| if s.is_empty() { Err(format!("{keyword} requires an argument")) } else { Ok(()) };
    let raw = |s: &str| needs_arg(s).map(|()| s.to_string());
    Ok(match keyword {
        "RUN" => {
            let (flags, args) = take_flags(rest)?;
            if let Some((flag, _)) = flags.first() {
                return Err(match flag.as_str() {
                    "mount" | "network" | "security" => format!("RUN --{flag} is not supported"),
                    _ => format!("RUN: unknown flag --{flag}"),
                });
            }
            needs_arg(args)?;
            match parse_command(args) {
                Command::Exec(argv) if argv.is_empty() => return Err("RUN requires a command".into()),
                Command::Shell(s) => {
                    reject_heredoc(&s)?;
                    Kind::Run(Command::Shell(s))
                }
                exec => Kind::Run(exec),
            }
        }
        "COPY" | "ADD" => parse_copy(keyword, rest)?,
        "ENV" => Kind::Env(parse_pairs(keyword, rest)?),
        "LABEL" => Kind::Label(parse_pairs(keyword, rest)?),
        "ARG" => {
            let (name, default) = parse_arg(rest)?;
            Kind::Arg { name, default }
        }
        "WORKDIR" => Kind::Workdir(raw(rest)?),
        "USER" => Kind::User(raw(rest)?),
        "CMD" => Kind::Cmd(parse_command(&raw(rest)?)),
        "ENTRYPOINT" => Kind::Entrypoint(parse_command(&raw(rest)?)),
        "EXPOSE" => {
            needs_arg(rest)?;
            Kind::Expose(rest.split_whitespace().map(normalize_port).collect::<Result<_, _>>()?)
        }
        "SHELL" => match json_array(rest) {
            Some(argv) if !argv.is_empty() => Kind::Shell(argv),
            _ => return Err(r#"SHELL requires a non-empty JSON array, e.g. SHELL ["/bin/bash", "-c"]"#.into()),
        },
        "VOLUME" => {
            needs_arg(rest)?;
            let volumes = json_array(rest).unwrap_or_else(|| rest.split_whitespace().map(String::from).collect());
            if volumes.is_empty() || volumes.iter().any(|v| v.trim().is_empty()) {
                return Err("VOLUME paths must not be empty".into());
            }
            Kind::Volume(volumes)
        }
        "STOPSIGNAL" => Kind::StopSignal(raw(rest)?),
        "HEALTHCHECK" => Kind::Healthcheck(raw(rest)?),
        "ONBUILD" => Kind::OnBuild(raw(rest)?),
        "MAINTAINER" => Kind::Maintainer(raw(rest)?),
        _ => return Err(format!("unknown instruction '{word}'")),
    })
}

/// `--name[=value]` flags in the order given.
type Flags = Vec<(String, Option<String>)>;

/// Splits leading `--name[=value]` words off an instruction's arguments.
fn take_flags(rest: &str) -> Result<(Flags, &str), String> {
    let mut flags = Vec::new();
    let mut rest = rest.trim_start();
    while let Some(after) = rest.strip_prefix("--") {
        let end = after.find(char::is_whitespace).unwrap_or(after.len());
        let (name, value) = match after[..end].split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (&after[..end], None),
        };
        if name.is_empty() {
            return Err("empty flag '--'".into());
        }
        if flags.iter().any(|(n, _)| n == name) {
            return Err(format!("flag --{name} given twice"));
        }
        flags.push((name.to_string(), value));
        rest = after[end..].trim_start();
    }
    Ok((flags, rest))
}

/// Docker's rule: a JSON array of strings is exec form; anything else, even a broken array, is shell form.
fn parse_command(args: &str) -> Command {
    json_array(args).map_or_else(|| Command::Shell(args.to_string()), Command::Exec)
}

fn json_array(args: &str) -> Option<Vec<String>> {
    if !args.starts_with('[') {
        return None;
    }
    serde_json::from_str(args).ok()
}

/// Like Docker, a word starting with `<<NAME` opens a heredoc; running one would need the
/// following lines as a file, which this parser does not collect.
fn reject_heredoc(args: &str) -> Result<(), String> {
    let is_heredoc = |w: &&str| w.strip_prefix("<<").is_some_and(|r| !r.is_empty() && !r.starts_with('<'));
    if args.split_whitespace().any(|w| is_heredoc(&w)) {
        return Err("heredocs are not supported; write the script to a file and COPY it".into());
    }
    Ok(())
}

fn parse_copy(keyword: &str, rest: &str) -> Result<Kind, String> {
    let (flags, args) = take_flags(rest)?;
    let (mut from, mut chown, mut chmod) = (None, None, None);
    for (flag, value) in flags {
        let slot = match flag.as_str() {
            "from" if keyword == "COPY" => &mut from,
            "from" => return Err("ADD does not support --from; use COPY --from".into()),
            "chown" => &mut chown,
            "chmod" => &mut chmod,
            // Layer linking is a BuildKit cache optimisation with no effect on the result.
            "link" if matches!(value.as_deref(), None | Some("true" | "false")) => continue,
            _ => return Err(format!("{keyword}: flag --{flag} is not supported")),
        };
        *slot = Some(value.filter(|v| !v.is_empty()).ok_or_else(|| format!("{keyword} --{flag} needs a value"))?);
    }
    let mut parts = match json_array(args) {
        Some(parts) => parts,
        None => {
            reject_heredoc(args)?;
            args.split_whitespace().map(String::from).collect()
        }
    };
    let dest = match parts.pop() {
        Some(dest) if !parts.is_empty() => dest,
        _ => return Err(format!("{keyword} requires at least one source and a destination")),
    };
    Ok(if keyword == "COPY" {
        Kind::Copy { srcs: parts, dest, from, chown, chmod }
    } else {
        Kind::Add { srcs: parts, dest, chown, chmod }
    })
}

/// ENV and LABEL: `K=V K2="v 2"` or the legacy `K rest of the line`.
fn parse_pairs(keyword: &str, rest: &str) -> Result<Vec<(String, String)>, String> {
    let words = split_words(rest)?;
    let Some(first) = words.first() else { return Err(format!("{keyword} requires an argument")) };
    if !first.contains('=') {
        let (key, value) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        let value = value.trim();
        if value.is_empty() {
            return Err(format!("{keyword} {key} needs a value ({keyword} KEY=VALUE or {keyword} KEY VALUE)"));
        }
        return Ok(vec![(unquote(key, false)?, unquote(value, true)?)]);
    }
    words
        .iter()
        .map(|w| {
            let (k, v) = w.split_once('=').ok_or_else(|| format!("{keyword}: expected KEY=VALUE, found '{w}'"))?;
            let key = unquote(k, false)?;
            if key.is_empty() {
                return Err(format!("{keyword}: empty name in '{w}'"));
            }
            Ok((key, unquote(v, true)?))
        })
        .collect()
}

fn parse_arg(rest: &str) -> Result<(String, Option<String>), String> {
    let words = split_words(rest)?;
    let word = match words.as_slice() {
        [] => return Err("ARG requires an argument".into()),
        [word] => word,
        _ => return Err("ARG declares one name per line (ARG NAME or ARG NAME=default)".into()),
    };
    let (name, default) = match word.split_once('=') {
        Some((n, d)) => (n, Some(unquote(d, true)?)),
        None => (word.as_str(), None),
    };
    // Only names `substitute` can refer to are useful.
    let mut chars = name.chars();
    let valid = chars.next().is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric());
    if !valid {
        return Err(format!("invalid ARG name '{name}'"));
    }
    Ok((name.to_string(), default))
}

/// Splits on whitespace outside quotes, keeping quotes and backslashes for [`unquote`].
fn split_words(s: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                }
                continue;
            }
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None | Some('"'), '\\') => {
                // The escaped character never splits or closes a quote.
                cur.push(c);
                if let Some(next) = chars.next() {
                    cur.push(next);
                }
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if quote.is_some() {
        return Err(format!("unterminated quote in '{s}'"));
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    Ok(words)
}

/// Removes shell quoting. With `for_substitution`, literal `$` and `\` come out escaped so a later
/// [`substitute`] expands only what the shell would have expanded.
fn unquote(raw: &str, for_substitution: bool) -> Result<String, String> {
    let mut out = String::with_capacity(raw.len());
    let literal = |out: &mut String, c: char| {
        if for_substitution && (c == '$' || c == '\\') {
            out.push('\\');
        }
        out.push(c);
    };
    let mut quote: Option<char> = None;
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (Some('\''), c) => literal(&mut out, c),
            (None, '\\') => literal(&mut out, chars.next().unwrap_or('\\')),
            // In double quotes a backslash only escapes these, like sh.
            (Some(_), '\\') => match chars.peek() {
                Some(&n @ ('"' | '\\' | '$')) => {
                    chars.next();
                    literal(&mut out, n);
                }
                _ => literal(&mut out, '\\'),
            },
            (_, '$') => out.push('$'),
            (_, c) => literal(&mut out, c),
        }
    }
    if quote.is_some() {
        return Err(format!("unterminated quote in '{raw}'"));
    }
    Ok(out)
}

fn normalize_port(word: &str) -> Result<String, String> {
    // A variable can only be checked once the executor has substituted it.
    if word.contains('$') {
        return Ok(word.to_string());
    }
    let (ports, proto) = word.split_once('/').unwrap_or((word, "tcp"));
    let proto = proto.to_ascii_lowercase();
    if !matches!(proto.as_str(), "tcp" | "udp" | "sctp") {
        return Err(format!("EXPOSE: invalid protocol in '{word}' (tcp, udp or sctp)"));
    }
    let port = |p: &str| p.bytes().all(|b| b.is_ascii_digit()).then(|| p.parse::<u16>().ok()).flatten().filter(|&n| n > 0);
    let valid = match ports.split_once('-') {
        Some((a, b)) => port(a).zip(port(b)).is_some_and(|(a, b)| a <= b),
        None => port(ports).is_some(),
    };
    if !valid {
        return Err(format!("EXPOSE: invalid port '{word}'"));
    }
    Ok(format!("{ports}/{proto}"))
}

/// Shell-style variable substitution as Docker does it in ENV, ARG, WORKDIR, USER, COPY, ADD,
/// EXPOSE, LABEL and FROM: `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`,
/// `${VAR:+alternative}`, `${VAR+alternative}`; defaults may nest (`${A:-${B}}`).
/// `\$` is a literal dollar and `\\` a literal backslash; any other backslash is kept.
/// Unset variables become empty; a malformed `${` is an error.
pub fn substitute(s: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let chars: Vec<char> = s.chars().collect();
    let mut pos = 0;
    Ok(expand(&chars, &mut pos, lookup, false)?.0)
}

/// Expands from `pos` to the end of input or, when `in_braces`, to the `}` closing a
/// `${VAR:-word}` (consumed). Returns whether that `}` was found.
fn expand(c: &[char], pos: &mut usize, lookup: &dyn Fn(&str) -> Option<String>, in_braces: bool) -> Result<(String, bool), String> {
    let mut out = String::new();
    while let Some(&ch) = c.get(*pos) {
        *pos += 1;
        match ch {
            '\\' => match c.get(*pos) {
                Some(&n) if n == '$' || n == '\\' || (in_braces && n == '}') => {
                    out.push(n);
                    *pos += 1;
                }
                _ => out.push('\\'),
            },
            '}' if in_braces => return Ok((out, true)),
            '$' => expand_dollar(c, pos, lookup, &mut out)?,
            _ => out.push(ch),
        }
    }
    Ok((out, false))
}

/// Handles what follows a `$` at `pos`.
fn expand_dollar(c: &[char], pos: &mut usize, lookup: &dyn Fn(&str) -> Option<String>, out: &mut String) -> Result<(), String> {
    let is_name = |ch: &char| *ch == '_' || ch.is_ascii_alphanumeric();
    let read_name = |pos: &mut usize| {
        let start = *pos;
        while c.get(*pos).is_some_and(is_name) {
            *pos += 1;
        }
        c[start..*pos].iter().collect::<String>()
    };
    match c.get(*pos) {
        Some('{') => {
            *pos += 1;
            let name = read_name(pos);
            let op = match c.get(*pos) {
                None => return Err(format!("missing '}}' after '${{{name}'")),
                Some('}') => None,
                Some(':') => match c.get(*pos + 1) {
                    Some(&op @ ('-' | '+')) => Some((op, true)),
                    other => {
                        let shown: String = other.map(|ch| ch.to_string()).unwrap_or_default();
                        return Err(format!(
                            "unsupported '${{{name}:{shown}' (supported: ${{VAR}}, ${{VAR:-default}}, ${{VAR:+alternative}})"
                        ));
                    }
                },
                Some(&op @ ('-' | '+')) => Some((op, false)),
                Some(other) => return Err(format!("unexpected '{other}' in '${{{name}{other}' (expected '}}', ':-' or ':+')")),
            };
            if name.is_empty() {
                return Err("empty variable name in '${'".into());
            }
            if name.starts_with(|ch: char| ch.is_ascii_digit()) {
                return Err(format!("invalid variable name '{name}'"));
            }
            let value = lookup(&name);
            let Some((op, colon)) = op else {
                *pos += 1;
                out.push_str(&value.unwrap_or_default());
                return Ok(());
            };
            *pos += if colon { 2 } else { 1 };
            let (word, closed) = expand(c, pos, lookup, true)?;
            if !closed {
                return Err(format!("missing '}}' to close '${{{name}'"));
            }
            // With a colon, empty counts as unset (POSIX).
            let present = value.as_deref().is_some_and(|v| !colon || !v.is_empty());
            match (op, present) {
                ('-', true) => out.push_str(&value.unwrap_or_default()),
                ('-', false) | ('+', true) => out.push_str(&word),
                _ => {}
            }
        }
        Some(ch) if *ch == '_' || ch.is_ascii_alphabetic() => {
            let name = read_name(pos);
            out.push_str(&lookup(&name).unwrap_or_default());
        }
        // `$` before anything that cannot start a name (end, space, digit) is literal, as in Docker.
        _ => out.push('$'),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> Dockerfile {
        parse(text, &[]).unwrap_or_else(|e| panic!("{e}"))
    }

    fn err(text: &str) -> ParseError {
        parse(text, &[]).expect_err("expected a parse error")
    }

    /// Kinds of the last stage.
    fn kinds(text: &str) -> Vec<Kind> {
        ok(text).stages.pop().unwrap().instructions.into_iter().map(|i| i.kind).collect()
    }

    fn sub(s: &str) -> Result<String, String> {
        let vars = |n: &str| match n {
            "A" => Some("alpha".to_string()),
            "EMPTY" => Some(String::new()),
            _ => None,
        };
        substitute(s, &vars)
    }

    fn args(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn multi_stage_with_copy_from() {
        let df = ok("FROM golang:1.22 AS Builder\nWORKDIR /src\nRUN go build -o /app .\n\nfrom debian:12\n\
                     COPY --from=builder --chown=app:app --chmod=755 /app /usr/local/bin/app\n");
        assert_eq!(df.stages.len(), 2);
        let (a, b) = (&df.stages[0], &df.stages[1]);
        assert_eq!((a.index, a.name.as_deref(), a.from.as_str(), a.line), (0, Some("builder"), "golang:1.22", 1));
        assert_eq!((b.index, b.name.as_deref(), b.from.as_str(), b.line), (1, None, "debian:12", 5));
        assert_eq!(a.instructions[1].line, 3);
        assert_eq!(a.instructions[1].kind, Kind::Run(Command::Shell("go build -o /app .".into())));
        assert_eq!(
            b.instructions[0].kind,
            Kind::Copy {
                srcs: vec!["/app".into()],
                dest: "/usr/local/bin/app".into(),
                from: Some("builder".into()),
                chown: Some("app:app".into()),
                chmod: Some("755".into()),
            }
        );
        assert_eq!(b.instructions[0].line, 6);
        // Building FROM an earlier stage is just a reference for the executor.
        assert_eq!(ok("FROM alpine AS base\nFROM base\n").stages[1].from, "base");
    }

    #[test]
    fn continuations_comments_and_blank_lines() {
        let df = ok("# syntax=docker/dockerfile:1\nFROM alpine\nRUN apt-get update \\\n    # a comment Docker drops\n\n    \
                     && apt-get install -y \\\n       curl\nUSER nobody\nRUN echo foo\\\nbar\nCMD x \\");
        let ins = &df.stages[0].instructions;
        assert_eq!(ins[0].text, "RUN apt-get update && apt-get install -y curl");
        assert_eq!(ins[0].line, 3);
        assert_eq!((ins[1].line, ins[1].text.as_str()), (8, "USER nobody"));
        // No whitespace around the backslash: Docker concatenates, so do we.
        assert_eq!(ins[2].text, "RUN echo foobar");
        // A continuation at end of file just ends the instruction.
        assert_eq!(ins[3].kind, Kind::Cmd(Command::Shell("x".into())));
        // CRLF files and a BOM.
        let df = ok("\u{feff}FROM alpine\r\nRUN a \\\r\n  b\r\n");
        assert_eq!(df.stages[0].instructions[0].text, "RUN a b");
    }

    #[test]
    fn keywords_are_case_insensitive() {
        assert_eq!(kinds("from alpine\nWorkDir /app\nuser 1000"), vec![Kind::Workdir("/app".into()), Kind::User("1000".into())]);
    }

    #[test]
    fn exec_and_shell_forms() {
        let k = kinds(
            "FROM a\nRUN [\"apt-get\", \"install\", \"-y\"]\nCMD echo $HOME\nENTRYPOINT [\"/bin/tini\", \"--\"]\n\
             CMD [\"broken\",\nCMD []\nSHELL [\"/bin/bash\", \"-c\"]\nVOLUME [\"/data\", \"/logs\"]\nVOLUME /a /b",
        );
        assert_eq!(k[0], Kind::Run(Command::Exec(vec!["apt-get".into(), "install".into(), "-y".into()])));
        // Never substituted at parse time.
        assert_eq!(k[1], Kind::Cmd(Command::Shell("echo $HOME".into())));
        assert_eq!(k[2], Kind::Entrypoint(Command::Exec(vec!["/bin/tini".into(), "--".into()])));
        // A broken JSON array is shell form, as in Docker.
        assert_eq!(k[3], Kind::Cmd(Command::Shell("[\"broken\",".into())));
        assert_eq!(k[4], Kind::Cmd(Command::Exec(vec![])));
        assert_eq!(k[5], Kind::Shell(vec!["/bin/bash".into(), "-c".into()]));
        assert_eq!(k[6], Kind::Volume(vec!["/data".into(), "/logs".into()]));
        assert_eq!(k[7], Kind::Volume(vec!["/a".into(), "/b".into()]));
        let k = kinds("FROM a\nCOPY [\"a b\", \"c\", \"/dest/\"]\nADD --chown=1:1 --link x.tar /opt/\nCOPY --link=true a b");
        assert_eq!(
            k[0],
            Kind::Copy { srcs: vec!["a b".into(), "c".into()], dest: "/dest/".into(), from: None, chown: None, chmod: None }
        );
        assert_eq!(k[1], Kind::Add { srcs: vec!["x.tar".into()], dest: "/opt/".into(), chown: Some("1:1".into()), chmod: None });
        assert!(matches!(&k[2], Kind::Copy { dest, .. } if dest == "b"));
    }

    #[test]
    fn env_and_label_forms() {
        let k = kinds(
            "FROM a\nENV K=V K2=\"quoted v\" K3='single $HOME' K4=a\\ b K5=\"x\\\"y\" K6=$HOME K7=\\$lit K8=\nENV OLD some value here\n\
             LABEL \"com.example.vendor\"=\"ACME Inc\" version=1.0",
        );
        let pairs = |v: &[(&str, &str)]| v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>();
        assert_eq!(
            k[0],
            Kind::Env(pairs(&[
                ("K", "V"),
                ("K2", "quoted v"),
                ("K3", "single \\$HOME"),
                ("K4", "a b"),
                ("K5", "x\"y"),
                ("K6", "$HOME"),
                ("K7", "\\$lit"),
                ("K8", ""),
            ]))
        );
        assert_eq!(k[1], Kind::Env(pairs(&[("OLD", "some value here")])));
        assert_eq!(k[2], Kind::Label(pairs(&[("com.example.vendor", "ACME Inc"), ("version", "1.0")])));
        // Stored values are substitution-ready: single quotes and `\$` stay literal, `$HOME` expands.
        let home = |n: &str| (n == "HOME").then(|| "/root".to_string());
        let Kind::Env(env) = &k[0] else { unreachable!() };
        let expanded: Vec<String> = env.iter().map(|(_, v)| substitute(v, &home).unwrap()).collect();
        assert_eq!(expanded[2], "single $HOME");
        assert_eq!(expanded[5], "/root");
        assert_eq!(expanded[6], "$lit");
        // A literal backslash survives substitution too.
        let k = kinds("FROM a\nENV P='C:\\dir' Q=\"a\\\\$HOME\"");
        let Kind::Env(env) = &k[0] else { unreachable!() };
        assert_eq!(substitute(&env[0].1, &home).unwrap(), "C:\\dir");
        assert_eq!(substitute(&env[1].1, &home).unwrap(), "a\\/root");
    }

    #[test]
    fn global_args_substitute_into_from() {
        let text = "ARG BASE=debian\nARG TAG=${BASE}-12\nARG UNSET\nFROM ${BASE}:${TAG}$UNSET AS one\nARG TAG\nARG OTHER=x\nARG NOPE\n\
                    FROM --platform=$BUILDPLATFORM alpine:${VERSION:-3.19}\nARG TARGETARCH";
        let df = parse(text, &[]).unwrap();
        assert_eq!(df.stages[0].from, "debian:debian-12");
        assert_eq!(df.stages[0].line, 4);
        assert_eq!(df.stages[1].from, "alpine:3.19");
        // Re-declaring a global ARG inside a stage inherits its value; own defaults stay raw.
        let k: Vec<&Kind> = df.stages[0].instructions.iter().map(|i| &i.kind).collect();
        assert_eq!(*k[0], Kind::Arg { name: "TAG".into(), default: Some("debian-12".into()) });
        assert_eq!(*k[1], Kind::Arg { name: "OTHER".into(), default: Some("x".into()) });
        assert_eq!(*k[2], Kind::Arg { name: "NOPE".into(), default: None });
        assert_eq!(df.stages[1].instructions[0].kind, Kind::Arg { name: "TARGETARCH".into(), default: Some("amd64".into()) });

        // Build args override declared globals (literally) and are ignored when undeclared.
        let df = parse(text, &args(&[("BASE", "ubuntu"), ("VERSION", "9"), ("UNSET", "$x")])).unwrap();
        assert_eq!(df.stages[0].from, "ubuntu:ubuntu-12$x");
        assert_eq!(df.stages[1].from, "alpine:3.19");
        assert_eq!(df.stages[0].instructions[0].kind, Kind::Arg { name: "TAG".into(), default: Some("ubuntu-12".into()) });
        let df = parse(text, &args(&[("TAG", "jammy")])).unwrap();
        assert_eq!(df.stages[0].from, "debian:jammy");
        // Only the FROM is substituted; in-stage ARGs don't feed later FROMs.
        assert_eq!(parse("FROM a\nARG X=b\nFROM $X:1", &[]).unwrap().stages[1].from, ":1");
    }

    #[test]
    fn arg_forms() {
        let k = kinds("FROM a\nARG A\nARG B=\"x y\"\nARG C=");
        assert_eq!(k[0], Kind::Arg { name: "A".into(), default: None });
        assert_eq!(k[1], Kind::Arg { name: "B".into(), default: Some("x y".into()) });
        assert_eq!(k[2], Kind::Arg { name: "C".into(), default: Some(String::new()) });
    }

    #[test]
    fn expose_normalizes() {
        assert_eq!(
            kinds("FROM a\nEXPOSE 80 443/TCP 53/udp 8000-8010 $PORT"),
            vec![Kind::Expose(vec!["80/tcp".into(), "443/tcp".into(), "53/udp".into(), "8000-8010/tcp".into(), "$PORT".into()])]
        );
    }

    #[test]
    fn recorded_only_instructions_keep_raw_text() {
        let k = kinds("FROM a\nSTOPSIGNAL SIGTERM\nHEALTHCHECK --interval=5s CMD curl -f http://x/ || exit 1\nONBUILD RUN make\nMAINTAINER me <me@x>");
        assert_eq!(k[0], Kind::StopSignal("SIGTERM".into()));
        assert_eq!(k[1], Kind::Healthcheck("--interval=5s CMD curl -f http://x/ || exit 1".into()));
        assert_eq!(k[2], Kind::OnBuild("RUN make".into()));
        assert_eq!(k[3], Kind::Maintainer("me <me@x>".into()));
    }

    #[test]
    fn substitution_forms() {
        assert_eq!(sub("$A/${A}/x$A-y").unwrap(), "alpha/alpha/xalpha-y");
        assert_eq!(sub("[$UNSET][${UNSET}]").unwrap(), "[][]");
        assert_eq!(sub("${UNSET:-def} ${EMPTY:-def} ${A:-def}").unwrap(), "def def alpha");
        assert_eq!(sub("${UNSET-def} ${EMPTY-def} ${A-def}").unwrap(), "def  alpha");
        assert_eq!(sub("[${UNSET:+alt}][${EMPTY:+alt}][${A:+alt}]").unwrap(), "[][][alt]");
        assert_eq!(sub("[${UNSET+alt}][${EMPTY+alt}]").unwrap(), "[][alt]");
        assert_eq!(sub("${UNSET:-${A}-x} ${UNSET:-a\\}b}").unwrap(), "alpha-x a}b");
        assert_eq!(sub(r"\$A \\$A C:\dir").unwrap(), r"$A \alpha C:\dir");
        assert_eq!(sub("cost $5, end $").unwrap(), "cost $5, end $");
    }

    #[test]
    fn malformed_substitution() {
        for (input, wanted) in [
            ("${", "missing '}'"),
            ("x${A", "missing '}' after '${A'"),
            ("${A:-x", "missing '}' to close '${A'"),
            ("${}", "empty variable name"),
            ("${A B}", "unexpected ' '"),
            ("${A:?x}", "unsupported '${A:?'"),
            ("${1}", "invalid variable name '1'"),
        ] {
            let e = sub(input).expect_err(input);
            assert!(e.contains(wanted), "{input}: {e}");
        }
    }

    fn assert_err(text: &str, line: usize, wanted: &str) {
        let e = err(text);
        assert_eq!(e.line, line, "{text:?}: {e}");
        assert!(e.message.contains(wanted), "{text:?}: {e}");
    }

    #[test]
    fn errors_name_their_line() {
        assert_err("FROM a\nRUN x\n# c\nFOO bar\nRUN y\nRUN z", 4, "unknown instruction 'FOO'");
        assert_err("FROM a\nRUN x \\\n  y\nWORKDIR\nRUN z", 4, "WORKDIR requires an argument");
        assert_err("FROM a\n\nRUN", 3, "RUN requires an argument");
        assert_err("FROM a\nCMD", 2, "CMD requires an argument");
        assert_err("FROM a\nENV", 2, "ENV requires an argument");
        assert_err("# hi\nARG X\nRUN echo\nFROM a", 3, "the first instruction must be FROM");
        assert_err("", 1, "the Dockerfile has no FROM");
        assert_err("# only a comment\n\nARG X=1\n", 1, "the Dockerfile has no FROM");
        assert_err("FROM a AS x\nRUN y\nFROM b AS X", 3, "duplicate stage name 'x' (already used on line 1)");
        assert_err("FROM a AS 1x", 1, "invalid stage name");
        assert_err("FROM a b", 1, "FROM expects 'image [AS name]'");
        assert_err("FROM", 1, "FROM requires an argument");
        assert_err("ARG X\nFROM $X", 2, "empty after substituting ARGs");
        assert_err("ARG X=${Y\nFROM a", 1, "missing '}'");
        assert_err("FROM ${A", 1, "missing '}'");
        assert_err("FROM --platform=linux/arm64 a", 1, "--platform=linux/arm64 is not supported");
        assert_err("FROM --foo a", 1, "unknown flag --foo");
        assert_eq!(ok("FROM --platform=linux/amd64 a").stages[0].from, "a");
        assert_err("FROM a\nRUN x\nEXPOSE 80 99999", 3, "invalid port '99999'");
        assert_err("FROM a\nEXPOSE 80/foo", 2, "invalid protocol");
        assert_err("FROM a\nEXPOSE 90-80", 2, "invalid port");
        assert_err("FROM a\nRUN x\nCOPY --parents a b", 3, "COPY: flag --parents is not supported");
        assert_err("FROM a\nADD --checksum=sha256:x a b", 2, "ADD: flag --checksum is not supported");
        assert_err("FROM a\nADD --from=b a b", 2, "ADD does not support --from");
        assert_err("FROM a\nCOPY --from= a b", 2, "--from needs a value");
        assert_err("FROM a\nCOPY a", 2, "at least one source and a destination");
        assert_err("FROM a\nCOPY [\"a\"]", 2, "at least one source and a destination");
        assert_err("FROM a\nCOPY --chown=1 --chown=2 a b", 2, "given twice");
        assert_err("FROM a\n\nRUN --mount=type=cache,target=/x make", 3, "RUN --mount is not supported");
        assert_err("FROM a\nRUN --network=none make", 2, "RUN --network is not supported");
        assert_err("FROM a\nRUN --security=insecure make", 2, "RUN --security is not supported");
        assert_err("FROM a\nRUN --bogus make", 2, "unknown flag --bogus");
        assert_err("FROM a\nRUN x\nRUN <<EOF\necho hi\nEOF", 3, "heredocs are not supported");
        assert_err("FROM a\nRUN cat <<-'END' > f", 2, "heredocs are not supported");
        assert_err("FROM a\nCOPY <<EOF /f", 2, "heredocs are not supported");
        assert_err("FROM a\nSHELL /bin/bash -c", 2, "SHELL requires a non-empty JSON array");
        assert_err("FROM a\nSHELL []", 2, "SHELL requires");
        assert_err("FROM a\nVOLUME [\"\"]", 2, "must not be empty");
        assert_err("FROM a\nENV K", 2, "ENV K needs a value");
        assert_err("FROM a\nENV A=1 B", 2, "expected KEY=VALUE, found 'B'");
        assert_err("FROM a\nENV =1", 2, "empty name");
        assert_err("FROM a\nRUN x\nENV A=\"open", 3, "unterminated quote");
        assert_err("FROM a\nLABEL a='b", 2, "unterminated quote");
        assert_err("FROM a\nARG A B", 2, "one name per line");
        assert_err("FROM a\nARG 1X=2", 2, "invalid ARG name '1X'");
        assert_err("# escape=`\nFROM a", 1, "is not supported");
        // Errors print with their line for the user.
        assert_eq!(err("FROM a\nNOPE").to_string(), "Dockerfile line 2: unknown instruction 'NOPE'");
    }

    #[test]
    fn not_heredocs() {
        // Here-strings and shifts inside a word are ordinary shell.
        let k = kinds("FROM a\nRUN cat <<<\"$x\" && echo $((1<<2))\n# escape=`\nRUN x");
        assert_eq!(k[0], Kind::Run(Command::Shell("cat <<<\"$x\" && echo $((1<<2))".into())));
        // A directive-looking comment after the first line is only a comment.
        assert_eq!(k.len(), 2);
        assert!(ok("# escape=\\\nFROM a").stages.len() == 1);
    }
}
