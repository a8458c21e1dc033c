use serde_json::{Map, Value};

use crate::template::json_type;
use crate::TextError;

/// Input of [`crate::ChatTemplate::render`]: what transformers' `apply_chat_template` takes.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The conversation, one JSON object per message (`role`, `content`, optional
    /// `reasoning_content`, `tool_calls`, ...), passed to the template as is.
    pub messages: Vec<Value>,
    /// Tool definitions (OpenAI `{"type": "function", "function": {...}}` objects), or `None`
    /// (the template then sees `none`).
    pub tools: Option<Vec<Value>>,
    /// Whether to end the prompt with the assistant turn opener
    /// (`<|im_start|>assistant\n<think>\n` for Qwen3.6).
    pub add_generation_prompt: bool,
    /// Extra template variables (`enable_thinking`, `preserve_thinking`, `add_vision_id`, ...).
    /// Must not contain `messages`, `tools`, `documents` or `add_generation_prompt`.
    pub kwargs: Map<String, Value>,
}

impl ChatRequest {
    /// Builds a request from an OpenAI chat-completions request body (a JSON object):
    ///
    /// * `messages` (required): array of objects, each with a string `role`;
    /// * `tools` (optional, null = absent): array of objects;
    /// * `add_generation_prompt` (optional, null = absent): boolean, default `true` (vLLM's
    ///   extension);
    /// * `chat_template_kwargs` (optional, null = absent): object, becomes [`Self::kwargs`]
    ///   (e.g. `{"enable_thinking": false}`). As in vLLM, an `add_generation_prompt` inside it
    ///   overrides the top-level one; `messages`/`tools`/`documents` inside it are rejected.
    ///
    /// Other fields (model, sampling parameters, ...) are ignored. In assistant messages,
    /// `tool_calls[].function.arguments` given as a JSON string is parsed and must be an
    /// object (the template iterates it as a mapping); an empty string or null becomes `{}`
    /// (as vLLM does); an object is kept as is.
    ///
    /// Errors: [`TextError::Request`] whose `field` is the JSON path of the first offending
    /// field (`messages`, `messages[1].role`,
    /// `messages[2].tool_calls[0].function.arguments`, `tools[0]`, ...).
    pub fn from_openai_json(body: &Value) -> Result<Self, TextError> {
        let obj = body.as_object().ok_or_else(|| {
            TextError::request(
                "body",
                format!("must be a JSON object, got {}", json_type(body)),
            )
        })?;

        let messages = match obj.get("messages") {
            None => return Err(TextError::request("messages", "is required")),
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, m)| normalize_message(m, i))
                .collect::<Result<Vec<_>, _>>()?,
            Some(other) => {
                return Err(TextError::request(
                    "messages",
                    format!("must be an array, got {}", json_type(other)),
                ))
            }
        };

        let tools = match obj.get("tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(list)) => {
                for (i, t) in list.iter().enumerate() {
                    if !t.is_object() {
                        return Err(TextError::request(
                            format!("tools[{i}]"),
                            format!("must be an object, got {}", json_type(t)),
                        ));
                    }
                }
                Some(list.clone())
            }
            Some(other) => {
                return Err(TextError::request(
                    "tools",
                    format!("must be an array, got {}", json_type(other)),
                ))
            }
        };

        let mut add_generation_prompt = match obj.get("add_generation_prompt") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(TextError::request(
                    "add_generation_prompt",
                    format!("must be a boolean, got {}", json_type(other)),
                ))
            }
        };

        let mut kwargs = match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(map)) => map.clone(),
            Some(other) => {
                return Err(TextError::request(
                    "chat_template_kwargs",
                    format!("must be an object, got {}", json_type(other)),
                ))
            }
        };
        if let Some(v) = kwargs.remove("add_generation_prompt") {
            add_generation_prompt = match v {
                Value::Bool(b) => b,
                Value::Null => add_generation_prompt,
                other => {
                    return Err(TextError::request(
                        "chat_template_kwargs.add_generation_prompt",
                        format!("must be a boolean, got {}", json_type(&other)),
                    ))
                }
            };
        }
        for key in ["messages", "tools", "documents"] {
            if kwargs.contains_key(key) {
                return Err(TextError::request(
                    format!("chat_template_kwargs.{key}"),
                    "cannot be overridden through chat_template_kwargs",
                ));
            }
        }

        Ok(ChatRequest {
            messages,
            tools,
            add_generation_prompt,
            kwargs,
        })
    }
}

/// Checks one message and converts string tool-call arguments to objects.
fn normalize_message(msg: &Value, i: usize) -> Result<Value, TextError> {
    let field = format!("messages[{i}]");
    let Some(obj) = msg.as_object() else {
        return Err(TextError::request(
            field,
            format!("must be an object, got {}", json_type(msg)),
        ));
    };
    match obj.get("role") {
        Some(Value::String(_)) => {}
        None => return Err(TextError::request(format!("{field}.role"), "is required")),
        Some(other) => {
            return Err(TextError::request(
                format!("{field}.role"),
                format!("must be a string, got {}", json_type(other)),
            ))
        }
    }
    let mut obj = obj.clone();
    match obj.get_mut("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            for (j, call) in calls.iter_mut().enumerate() {
                let call_field = format!("{field}.tool_calls[{j}]");
                let Some(call) = call.as_object_mut() else {
                    return Err(TextError::request(
                        call_field,
                        format!("must be an object, got {}", json_type(call)),
                    ));
                };
                match call.get_mut("function") {
                    None => {}
                    Some(Value::Object(function)) => {
                        normalize_arguments(function, &format!("{call_field}.function"))?
                    }
                    Some(other) => {
                        return Err(TextError::request(
                            format!("{call_field}.function"),
                            format!("must be an object, got {}", json_type(other)),
                        ))
                    }
                }
            }
        }
        Some(other) => {
            return Err(TextError::request(
                format!("{field}.tool_calls"),
                format!("must be an array, got {}", json_type(other)),
            ))
        }
    }
    Ok(Value::Object(obj))
}

/// `arguments`: JSON-object string → object; "" / null → {}; object kept; anything else is
/// an error.
fn normalize_arguments(function: &mut Map<String, Value>, field: &str) -> Result<(), TextError> {
    let field = format!("{field}.arguments");
    let Some(args) = function.get_mut("arguments") else {
        return Ok(());
    };
    match args {
        Value::Object(_) => {}
        Value::Null => *args = Value::Object(Map::new()),
        Value::String(s) if s.trim().is_empty() => *args = Value::Object(Map::new()),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => *args = v,
            Ok(other) => {
                return Err(TextError::request(
                    field,
                    format!("must encode a JSON object, got {}", json_type(&other)),
                ))
            }
            Err(e) => {
                return Err(TextError::request(field, format!("is not valid JSON: {e}")));
            }
        },
        other => {
            return Err(TextError::request(
                field,
                format!(
                    "must be an object or a JSON string, got {}",
                    json_type(other)
                ),
            ))
        }
    }
    Ok(())
}
