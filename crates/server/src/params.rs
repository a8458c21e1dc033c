//! OpenAI request fields: types checked, ranges checked, unknown fields ignored. Every error
//! names the field.

use std::collections::BTreeMap;

use sampler::SamplingParams;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (default when tools are given).
    Auto,
    /// Tool calls are not parsed.
    None,
    /// The model is expected to call a tool.
    Required,
    /// A named function.
    Function(String),
}

/// The generation settings of a chat or completions request.
#[derive(Debug, Clone)]
pub struct GenParams {
    /// SSE streaming.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `max_completion_tokens`, else `max_tokens`, else the default.
    pub max_tokens: usize,
    /// Sampling (engine defaults overridden by the request).
    pub sampling: SamplingParams,
    /// Stop strings (at most 4).
    pub stop: Vec<String>,
    /// Tool choice (chat only).
    pub tool_choice: ToolChoice,
    /// Declared tools: name → parameter name → JSON-schema type (chat only).
    pub tool_schemas: BTreeMap<String, BTreeMap<String, String>>,
    /// `ignore_eos` (vLLM's extension): keep generating past the end-of-turn / end-of-text
    /// ids until `max_tokens` (benchmarks); stop strings still apply.
    pub ignore_eos: bool,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn opt_bool(o: &Map<String, Value>, k: &str) -> Result<Option<bool>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::field(k, format!("must be a boolean, got {}", type_name(v)))),
    }
}

fn opt_f32(o: &Map<String, Value>, k: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if !(lo..=hi).contains(&x) {
                return Err(ApiError::field(k, format!("must be between {lo} and {hi}, got {x}")));
            }
            Ok(Some(x as f32))
        }
        Some(v) => Err(ApiError::field(k, format!("must be a number, got {}", type_name(v)))),
    }
}

fn opt_uint(o: &Map<String, Value>, k: &str, min: u64) -> Result<Option<u64>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(x) if x >= min => Ok(Some(x)),
            _ => Err(ApiError::field(k, format!("must be an integer >= {min}, got {n}"))),
        },
        Some(v) => Err(ApiError::field(k, format!("must be an integer, got {}", type_name(v)))),
    }
}

/// Parses the fields shared by chat and completions requests.
///
/// # Errors
/// 400 naming the field.
pub fn parse_common(
    o: &Map<String, Value>,
    defaults: &SamplingParams,
    default_max_tokens: usize,
) -> Result<GenParams, ApiError> {
    let stream = opt_bool(o, "stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => match so.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ApiError::field(
                    "stream_options.include_usage",
                    format!("must be a boolean, got {}", type_name(v)),
                ))
            }
        },
        Some(v) => return Err(ApiError::field("stream_options", format!("must be an object, got {}", type_name(v)))),
    };
    if let Some(n) = opt_uint(o, "n", 1)? {
        if n != 1 {
            return Err(ApiError::field("n", format!("must be 1 (calla generates one choice per request), got {n}")));
        }
    }
    let max_tokens = match opt_uint(o, "max_completion_tokens", 1)? {
        Some(x) => x as usize,
        None => opt_uint(o, "max_tokens", 1)?.map(|x| x as usize).unwrap_or(default_max_tokens),
    };
    let mut s = defaults.clone();
    if let Some(x) = opt_f32(o, "temperature", 0.0, 2.0)? {
        s.temperature = x;
    }
    if let Some(x) = opt_f32(o, "top_p", 0.0, 1.0)? {
        if x <= 0.0 {
            return Err(ApiError::field("top_p", "must be greater than 0"));
        }
        s.top_p = x;
    }
    if let Some(x) = match o.get("top_k") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_i64() {
            Some(-1) => Some(0),
            Some(k) if k >= 0 => Some(k as usize),
            _ => return Err(ApiError::field("top_k", format!("must be an integer >= -1, got {n}"))),
        },
        Some(v) => return Err(ApiError::field("top_k", format!("must be an integer, got {}", type_name(v)))),
    } {
        s.top_k = x;
    }
    if let Some(x) = opt_f32(o, "min_p", 0.0, 1.0)? {
        s.min_p = x;
    }
    if let Some(x) = opt_f32(o, "presence_penalty", -2.0, 2.0)? {
        s.presence_penalty = x;
    }
    if let Some(x) = opt_f32(o, "frequency_penalty", -2.0, 2.0)? {
        s.frequency_penalty = x;
    }
    if let Some(x) = opt_f32(o, "repetition_penalty", 1e-6, 10.0)? {
        s.repetition_penalty = x;
    }
    match o.get("seed") {
        None | Some(Value::Null) => {}
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(x), _) => s.seed = Some(x),
            (None, Some(x)) => s.seed = Some(x as u64),
            _ => return Err(ApiError::field("seed", format!("must be an integer, got {n}"))),
        },
        Some(v) => return Err(ApiError::field("seed", format!("must be an integer, got {}", type_name(v)))),
    }
    if let Err(e) = s.validate() {
        return Err(ApiError::field(e.field(), e.to_string()));
    }
    let stop = match o.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(x)) => vec![x.clone()],
        Some(Value::Array(a)) => {
            if a.len() > 4 {
                return Err(ApiError::field("stop", format!("must have at most 4 sequences, got {}", a.len())));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(x) => Ok(x.clone()),
                    v => Err(ApiError::field(format!("stop[{i}]"), format!("must be a string, got {}", type_name(v)))),
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => {
            return Err(ApiError::field(
                "stop",
                format!("must be a string or an array of strings, got {}", type_name(v)),
            ))
        }
    };
    let stop = stop.into_iter().filter(|x: &String| !x.is_empty()).collect();
    let ignore_eos = opt_bool(o, "ignore_eos")?.unwrap_or(false);
    for k in ["model", "user"] {
        if let Some(v) = o.get(k) {
            if !v.is_string() && !v.is_null() {
                return Err(ApiError::field(k, format!("must be a string, got {}", type_name(v))));
            }
        }
    }
    Ok(GenParams {
        stream,
        include_usage,
        max_tokens,
        sampling: s,
        stop,
        tool_choice: ToolChoice::Auto,
        tool_schemas: BTreeMap::new(),
        ignore_eos,
    })
}

/// Parses a chat-completions body's generation fields (messages are parsed by `text`).
///
/// # Errors
/// 400 naming the field.
pub fn parse_chat(body: &Value, defaults: &SamplingParams, default_max_tokens: usize) -> Result<GenParams, ApiError> {
    let o =
        body.as_object().ok_or_else(|| ApiError::bad_request("invalid_request", "the body must be a JSON object"))?;
    let mut p = parse_common(o, defaults, default_max_tokens)?;
    if let Some(Value::Array(tools)) = o.get("tools") {
        for (i, t) in tools.iter().enumerate() {
            let f = t.get("function").unwrap_or(t);
            let name = match f.get("name") {
                Some(Value::String(n)) => n.clone(),
                Some(v) => {
                    return Err(ApiError::field(
                        format!("tools[{i}].function.name"),
                        format!("must be a string, got {}", type_name(v)),
                    ))
                }
                None => return Err(ApiError::field(format!("tools[{i}].function.name"), "is required")),
            };
            let mut params = BTreeMap::new();
            if let Some(Value::Object(props)) = f.pointer("/parameters/properties") {
                for (k, v) in props {
                    let ty = v.get("type").and_then(Value::as_str).unwrap_or("").to_string();
                    params.insert(k.clone(), ty);
                }
            }
            p.tool_schemas.insert(name, params);
        }
    }
    p.tool_choice = match o.get("tool_choice") {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::field(
                    "tool_choice",
                    format!("must be \"auto\", \"none\", \"required\" or an object, got \"{other}\""),
                ))
            }
        },
        Some(Value::Object(t)) => match t.get("function").and_then(|f| f.get("name")) {
            Some(Value::String(n)) => {
                if !p.tool_schemas.contains_key(n) {
                    return Err(ApiError::field(
                        "tool_choice.function.name",
                        format!("names `{n}`, which is not in `tools`"),
                    ));
                }
                ToolChoice::Function(n.clone())
            }
            _ => return Err(ApiError::field("tool_choice.function.name", "is required and must be a string")),
        },
        Some(v) => {
            return Err(ApiError::field("tool_choice", format!("must be a string or an object, got {}", type_name(v))))
        }
    };
    if p.tool_choice != ToolChoice::None && p.tool_choice != ToolChoice::Auto && p.tool_schemas.is_empty() {
        return Err(ApiError::field("tool_choice", "needs `tools`"));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> Result<GenParams, ApiError> {
        parse_chat(&v, &SamplingParams::default(), 100)
    }

    #[test]
    fn wrong_types_name_the_field() {
        let cases = [
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"max_tokens": -1}), "max_tokens"),
            (json!({"ignore_eos": 1}), "ignore_eos"),
            (json!({"max_tokens": 1.5}), "max_tokens"),
            (json!({"max_completion_tokens": "9"}), "max_completion_tokens"),
            (json!({"stream": 1}), "stream"),
            (json!({"n": 2}), "n"),
            (json!({"stop": [1]}), "stop[0]"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"seed": "x"}), "seed"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_k": -3}), "top_k"),
            (json!({"stream_options": {"include_usage": "yes"}}), "stream_options.include_usage"),
            (json!({"tool_choice": "sometimes"}), "tool_choice"),
            (json!({"tool_choice": {"type": "function", "function": {"name": "x"}}}), "tool_choice.function.name"),
            (json!({"model": 5}), "model"),
            (json!({"presence_penalty": 3}), "presence_penalty"),
        ];
        for (body, field) in cases {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
            assert_eq!(e.status.as_u16(), 400);
            assert!(e.message.contains(field), "{}", e.message);
        }
    }

    #[test]
    fn values_and_defaults() {
        let p = chat(json!({"max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "seed": 3, "stop": "x",
            "unknown_field": {"ignored": true}, "stream": true, "stream_options": {"include_usage": true}}))
        .unwrap();
        assert_eq!(p.max_tokens, 7);
        assert_eq!(p.sampling.temperature, 0.0);
        assert_eq!(p.sampling.seed, Some(3));
        assert_eq!(p.stop, ["x"]);
        assert!(p.stream && p.include_usage);
        assert_eq!(chat(json!({})).unwrap().max_tokens, 100);
        let p = chat(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}))
        .unwrap();
        assert_eq!(p.tool_choice, ToolChoice::Function("f".into()));
        assert_eq!(p.tool_schemas["f"]["n"], "integer");
    }
}
