use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use minijinja::value::{from_args, Kwargs, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior, Value};

use crate::pyjson::{self, DumpOptions};
use crate::tokenizer::check_dir;
use crate::{ChatRequest, TextError};

/// Name under which the template is registered (shows up in error locations).
const TEMPLATE_NAME: &str = "chat_template";
/// Render arguments that transformers passes itself; a request kwarg of the same name would
/// be a Python `TypeError` (multiple values for keyword argument).
const RESERVED_KWARGS: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];
/// Keys of transformers' `special_tokens_map` (those set are passed to the template).
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A compiled chat template, rendered the way transformers' `apply_chat_template` renders it
/// with Jinja2 (see `shared/tokenizer/README.md`):
///
/// * `trim_blocks`, `lstrip_blocks`, `loopcontrols`, no auto-escaping, no trailing-newline
///   keeping; undefined values print as empty and fail on attribute access (Jinja2's default
///   `Undefined`);
/// * globals `raise_exception(msg)` (→ [`TextError::Template`] carrying `msg` verbatim) and
///   `strftime_now(fmt)` (local time);
/// * `tojson` = Python `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
///   sort_keys=False)` (`", "`/`": "` separators, non-ASCII kept, no HTML escaping, key order
///   kept, Python float spelling), with the same optional arguments;
/// * `|trim` and `str.strip/lstrip/rstrip()` strip Python's whitespace set (`str.isspace`);
///   other Python methods on strings, dicts and lists (`startswith`, `split`, `items`, ...)
///   come from `minijinja-contrib`'s `pycompat`;
/// * render variables: `messages`, `tools`, `documents=None`, `add_generation_prompt`, the
///   special tokens of `tokenizer_config.json`, then the request kwargs (`enable_thinking`,
///   `preserve_thinking`, ...).
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: BTreeMap<String, Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a Jinja chat template from its source text (e.g. the content of
    /// `chat_template.jinja`). No special tokens are passed to it.
    ///
    /// Errors: [`TextError::Template`] on a syntax error.
    pub fn from_source(source: String) -> Result<Self, TextError> {
        Ok(ChatTemplate {
            env: build_env(source)?,
            special_tokens: BTreeMap::new(),
        })
    }

    /// Loads the chat template of a model snapshot folder: `chat_template.jinja`, else the
    /// `chat_template` field of `tokenizer_config.json` (a string, or a list of
    /// `{name, template}` of which the one named `"default"` is used). Special tokens
    /// (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
    /// `mask_token` as strings or `{content: ...}` objects, `additional_special_tokens`) are
    /// read from `tokenizer_config.json` when present and passed to the template.
    ///
    /// Returns `Ok(None)` when there is no template. Errors: [`TextError::Io`] when `dir` is
    /// not a folder or a file cannot be read; [`TextError::Config`] for malformed
    /// `tokenizer_config.json` or a template list without `"default"`;
    /// [`TextError::Template`] when the template does not compile.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, TextError> {
        check_dir(dir)?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path)
                .map_err(|e| TextError::io(&config_path, e))?;
            let value: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| TextError::Config {
                    path: config_path.clone(),
                    reason: e.to_string(),
                })?;
            if !value.is_object() {
                return Err(TextError::Config {
                    path: config_path,
                    reason: "top level is not a JSON object".into(),
                });
            }
            Some(value)
        } else {
            None
        };

        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.exists() {
            Some(std::fs::read_to_string(&jinja_path).map_err(|e| TextError::io(&jinja_path, e))?)
        } else if let Some(config) = &config {
            template_from_config(config, &config_path)?
        } else {
            None
        };
        let Some(source) = source else {
            return Ok(None);
        };

        let special_tokens = match &config {
            Some(config) => special_tokens_from_config(config, &config_path)?,
            None => BTreeMap::new(),
        };
        Ok(Some(ChatTemplate {
            env: build_env(source)?,
            special_tokens,
        }))
    }

    /// Renders the prompt string for `req` (not tokenised; encode it with
    /// [`crate::Tokenizer::encode`], which matches the special tokens in it).
    ///
    /// Errors: [`TextError::Template`] when the template fails — for `raise_exception(msg)`
    /// the error string is exactly `msg` (e.g. `"System message must be at the
    /// beginning."`); [`TextError::Request`] when `req.kwargs` contains a name the renderer
    /// sets itself (`messages`, `tools`, `documents`, `add_generation_prompt`).
    pub fn render(&self, req: &ChatRequest) -> Result<String, TextError> {
        if let Some(key) = RESERVED_KWARGS
            .iter()
            .find(|k| req.kwargs.contains_key(**k))
        {
            return Err(TextError::request(
                format!("kwargs.{key}"),
                "is set by the renderer itself and cannot be a template kwarg",
            ));
        }
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(k, v.clone());
        }
        for (k, v) in &req.kwargs {
            ctx.insert(k, Value::from_serialize(v));
        }
        ctx.insert("messages", Value::from_serialize(&req.messages));
        ctx.insert("tools", Value::from_serialize(&req.tools));
        ctx.insert("documents", Value::from(()));
        ctx.insert(
            "add_generation_prompt",
            Value::from(req.add_generation_prompt),
        );

        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        tmpl.render(&ctx).map_err(template_error)
    }
}

/// The `chat_template` field of a parsed `tokenizer_config.json`.
fn template_from_config(
    config: &serde_json::Value,
    path: &Path,
) -> Result<Option<String>, TextError> {
    let bad = |reason: String| TextError::Config {
        path: path.to_path_buf(),
        reason,
    };
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            for (i, entry) in list.iter().enumerate() {
                let name = entry.get("name").and_then(|n| n.as_str());
                let template = entry.get("template").and_then(|t| t.as_str());
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(_), Some(_)) => {}
                    _ => {
                        return Err(bad(format!(
                            "chat_template[{i}] must be an object with string `name` and `template`"
                        )))
                    }
                }
            }
            Err(bad(
                "chat_template is a list of named templates but none is named \"default\"".into(),
            ))
        }
        Some(other) => Err(bad(format!(
            "chat_template must be a string or a list of {{name, template}}, got {}",
            json_type(other)
        ))),
    }
}

/// transformers' `special_tokens_map` from a parsed `tokenizer_config.json`.
fn special_tokens_from_config(
    config: &serde_json::Value,
    path: &Path,
) -> Result<BTreeMap<String, Value>, TextError> {
    fn content(v: &serde_json::Value) -> Option<Option<String>> {
        match v {
            serde_json::Value::Null => Some(None),
            serde_json::Value::String(s) => Some(Some(s.clone())),
            serde_json::Value::Object(o) => match o.get("content") {
                Some(serde_json::Value::String(s)) => Some(Some(s.clone())),
                _ => None,
            },
            _ => None,
        }
    }
    let bad = |key: &str| TextError::Config {
        path: path.to_path_buf(),
        reason: format!("`{key}` must be a string, an object with string `content`, or null"),
    };
    let mut out = BTreeMap::new();
    for key in SPECIAL_TOKEN_KEYS {
        if let Some(v) = config.get(key) {
            if let Some(s) = content(v).ok_or_else(|| bad(key))? {
                out.insert(key.to_string(), Value::from(s));
            }
        }
    }
    let key = "additional_special_tokens";
    match config.get(key) {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Array(list)) => {
            let mut tokens = Vec::with_capacity(list.len());
            for v in list {
                if let Some(s) = content(v).ok_or_else(|| bad(key))? {
                    tokens.push(Value::from(s));
                }
            }
            out.insert(key.to_string(), Value::from(tokens));
        }
        Some(_) => return Err(bad(key)),
    }
    Ok(out)
}

pub(crate) fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn build_env(source: String) -> Result<Environment<'static>, TextError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(py_method);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", py_trim);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_template_owned(TEMPLATE_NAME, source)
        .map_err(template_error)?;
    Ok(env)
}

/// Converts a minijinja error into [`TextError::Template`]; a `raise_exception` message is
/// passed through verbatim.
fn template_error(err: Error) -> TextError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cur {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return TextError::Template(raised.0.clone());
        }
        cur = e.source();
    }
    TextError::Template(err.to_string())
}

/// The message of a template's `raise_exception(...)` call.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// `raise_exception(message)`: transformers raises `jinja2.exceptions.TemplateError(message)`.
fn raise_exception(message: Value) -> Result<Value, Error> {
    let msg = match message.as_str() {
        Some(s) => s.to_string(),
        None => message.to_string(),
    };
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

/// `strftime_now(format)`: `datetime.now().strftime(format)` in local time.
fn strftime_now(format: &str) -> Result<Value, Error> {
    let now = chrono::Local::now();
    let mut out = String::new();
    write!(out, "{}", now.format(format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported format {format:?}"),
        )
    })?;
    Ok(Value::from(out))
}

/// Python's `str.isspace()` set: Unicode White_Space plus the separators U+001C..U+001F.
fn py_whitespace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

#[derive(Clone, Copy)]
enum Side {
    Both,
    Start,
    End,
}

/// Python `str.strip/lstrip/rstrip(chars=None)`.
fn py_strip<'s>(s: &'s str, chars: Option<&str>, side: Side) -> &'s str {
    let set: Option<Vec<char>> = chars.map(|c| c.chars().collect());
    let strip = |c: char| match &set {
        Some(set) => set.contains(&c),
        None => py_whitespace(c),
    };
    match side {
        Side::Both => s.trim_matches(strip),
        Side::Start => s.trim_start_matches(strip),
        Side::End => s.trim_end_matches(strip),
    }
}

/// Keeps the safe-string mark of `like` (macro output is safe in minijinja).
fn same_safety(like: &Value, s: &str) -> Value {
    if like.is_safe() {
        Value::from_safe_string(s.to_string())
    } else {
        Value::from(s)
    }
}

/// Jinja2 `trim(value, chars=None)` = `str(value).strip(chars)` (Python whitespace).
fn py_trim(value: &Value, chars: Option<&str>) -> Value {
    let owned;
    let s = match value.as_str() {
        Some(s) => s,
        None => {
            owned = value.to_string();
            &owned
        }
    };
    same_safety(value, py_strip(s, chars, Side::Both))
}

/// Python methods on values: Python-exact `strip`/`lstrip`/`rstrip`/`isspace` on strings,
/// everything else from `minijinja_contrib::pycompat`.
fn py_method(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let (ValueKind::String, Some(s)) = (value.kind(), value.as_str()) {
        let side = match method {
            "strip" => Some(Side::Both),
            "lstrip" => Some(Side::Start),
            "rstrip" => Some(Side::End),
            "isspace" => {
                let () = from_args(args)?;
                return Ok(Value::from(!s.is_empty() && s.chars().all(py_whitespace)));
            }
            _ => None,
        };
        if let Some(side) = side {
            let (chars,): (Option<&str>,) = from_args(args)?;
            return Ok(same_safety(value, py_strip(s, chars, side)));
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` = Python `json.dumps` with those arguments (positional or keyword).
fn tojson(value: &Value, args: Rest<Value>) -> Result<Value, Error> {
    let (ensure_ascii, indent, separators, sort_keys, kwargs): (
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Kwargs,
    ) = from_args(&args)?;
    let pick = |pos: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        match pos {
            Some(v) => Ok(Some(v)),
            None => kwargs.get::<Option<Value>>(name),
        }
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?;
    let indent = pick(indent, "indent")?;
    let separators = pick(separators, "separators")?;
    let sort_keys = pick(sort_keys, "sort_keys")?;
    kwargs.assert_all_used()?;

    let invalid = |msg: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson: {msg}"));
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.kind() {
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            ValueKind::Number => {
                let n = i64::try_from(v).map_err(|_| invalid("indent must be an integer"))?;
                Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
            }
            _ => return Err(invalid("indent must be an integer, a string or none")),
        },
    };
    let separators = match separators {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            let parts: Vec<Value> = v
                .try_iter()
                .map_err(|_| invalid("separators must be a pair of strings"))?
                .collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => Some((
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                )),
                _ => return Err(invalid("separators must be a pair of strings")),
            }
        }
    };
    let opts = DumpOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        separators,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    pyjson::dumps(value, &opts)
        .map(Value::from)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}
