//! Model output → OpenAI message parts, incrementally: reasoning (`reasoning_content`),
//! content, and `<tool_call>` blocks (`tool_calls`). Also stop strings and UTF-8 assembly.
//!
//! The parser is a pure function of the text: feeding it in any chunking gives the same
//! aggregate as feeding it whole ([`aggregate`]); it holds back only the text that could still
//! be the start of a tag.
//!
//! Qwen3.6 writes tool calls as (chat template):
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//! A JSON body (`{"name": ..., "arguments": {...}}`, Qwen3's older form) is accepted too.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

const THINK: &str = "<think>";
const THINK_END: &str = "</think>";
const CALL: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";

/// A parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// Function name.
    pub name: String,
    /// Arguments as a JSON object.
    pub arguments: Map<String, Value>,
}

/// One piece of parsed output.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Reasoning text.
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// A complete tool call.
    Call(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
}

/// The incremental parser.
#[derive(Debug, Clone)]
pub struct OutputParser {
    mode: Mode,
    parse_tools: bool,
    schemas: BTreeMap<String, BTreeMap<String, String>>,
    buf: String,
    in_call: bool,
    // Content started (leading newlines after `</think>` are dropped until then).
    content_started: bool,
    // Reasoning started (leading newlines of the reasoning are dropped until then).
    reasoning_started: bool,
    // Newlines held at the end of reasoning (they belong before `</think>` unless text follows).
    held_newlines: String,
}

impl OutputParser {
    /// A parser for output that starts inside the reasoning (`thinking`: the prompt ended with
    /// `<think>\n`) or in the answer; `parse_tools` turns `<tool_call>` parsing on, with the
    /// declared tools' parameter types (name → parameter → JSON-schema type).
    pub fn new(thinking: bool, parse_tools: bool, schemas: BTreeMap<String, BTreeMap<String, String>>) -> Self {
        OutputParser {
            mode: if thinking { Mode::Reasoning } else { Mode::Content },
            parse_tools,
            schemas,
            buf: String::new(),
            in_call: false,
            content_started: false,
            reasoning_started: false,
            held_newlines: String::new(),
        }
    }

    fn tags(&self) -> Vec<&'static str> {
        let mut t = Vec::new();
        if self.mode == Mode::Reasoning {
            t.push(THINK_END);
            if !self.reasoning_started {
                t.push(THINK);
            }
        } else if !self.content_started {
            t.push(THINK);
        }
        if self.parse_tools {
            t.push(CALL);
        }
        t
    }

    /// Adds text; returns the parts now certain.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.buf.find(CALL_END) else { break };
                let body: String = self.buf[..end].to_string();
                self.buf.drain(..end + CALL_END.len());
                self.in_call = false;
                self.emit_call(&body, &mut out);
                continue;
            }
            let tags = self.tags();
            let first = tags.iter().filter_map(|t| self.buf.find(t).map(|i| (i, *t))).min_by_key(|(i, _)| *i);
            match first {
                Some((i, tag)) => {
                    let before: String = self.buf[..i].to_string();
                    self.buf.drain(..i + tag.len());
                    self.emit_text(&before, false, &mut out);
                    match tag {
                        THINK_END => {
                            self.held_newlines.clear();
                            self.mode = Mode::Content;
                        }
                        THINK => {
                            // `<think>` at the very start: reasoning begins (or continues) here.
                            self.mode = Mode::Reasoning;
                            self.reasoning_started = false;
                        }
                        _ => {
                            self.in_call = true;
                        }
                    }
                }
                None => {
                    let keep = held_suffix(&self.buf, &tags);
                    let cut = self.buf.len() - keep;
                    let text: String = self.buf[..cut].to_string();
                    self.buf.drain(..cut);
                    self.emit_text(&text, false, &mut out);
                    break;
                }
            }
        }
        out
    }

    /// Ends the output: flushes held text; an unfinished `<tool_call>` is parsed if it can be,
    /// else returned as text (of the current mode).
    pub fn finish(&mut self) -> Vec<Part> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            let body = rest.trim_end();
            let body =
                body.strip_suffix("</function>").map(|b| format!("{b}</function>")).unwrap_or_else(|| body.to_string());
            if parse_call_body(&body, &self.schemas).is_some() {
                self.emit_call(&body, &mut out);
            } else {
                self.emit_text(&format!("{CALL}{rest}"), true, &mut out);
            }
        } else {
            self.emit_text(&rest, true, &mut out);
        }
        // max_tokens ended inside the reasoning: held newlines are reasoning text.
        let h = std::mem::take(&mut self.held_newlines);
        if !h.is_empty() && self.mode == Mode::Reasoning {
            push_part(&mut out, Part::Reasoning(h));
        }
        out
    }

    fn emit_call(&mut self, body: &str, out: &mut Vec<Part>) {
        match parse_call_body(body, &self.schemas) {
            Some(c) => out.push(Part::Call(c)),
            None => {
                let raw = format!("{CALL}{body}{CALL_END}");
                self.emit_text(&raw, false, out);
            }
        }
    }

    fn emit_text(&mut self, text: &str, last: bool, out: &mut Vec<Part>) {
        if text.is_empty() {
            return;
        }
        match self.mode {
            Mode::Reasoning => {
                let mut t = text;
                if !self.reasoning_started {
                    t = t.trim_start_matches('\n');
                    if t.is_empty() {
                        return;
                    }
                    self.reasoning_started = true;
                }
                // Trailing newlines may precede `</think>`: hold them until more text comes.
                let body = t.trim_end_matches('\n');
                let tail = &t[body.len()..];
                if !body.is_empty() {
                    let mut s = std::mem::take(&mut self.held_newlines);
                    s.push_str(body);
                    push_part(out, Part::Reasoning(s));
                }
                self.held_newlines.push_str(tail);
                if last && !self.held_newlines.is_empty() {
                    // max_tokens ended inside the reasoning: the newlines are reasoning text.
                    let h = std::mem::take(&mut self.held_newlines);
                    push_part(out, Part::Reasoning(h));
                }
            }
            Mode::Content => {
                let mut t = text;
                if !self.content_started {
                    t = t.trim_start_matches(['\n', ' ']);
                    if t.is_empty() {
                        return;
                    }
                    self.content_started = true;
                }
                push_part(out, Part::Content(t.to_string()));
            }
        }
    }
}

fn push_part(out: &mut Vec<Part>, p: Part) {
    match (out.last_mut(), p) {
        (Some(Part::Reasoning(a)), Part::Reasoning(b)) => a.push_str(&b),
        (Some(Part::Content(a)), Part::Content(b)) => a.push_str(&b),
        (_, p) => out.push(p),
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of one of `tags`.
fn held_suffix(s: &str, tags: &[&str]) -> usize {
    let mut best = 0;
    for t in tags {
        for n in (1..t.len()).rev() {
            if n <= s.len() && s.is_char_boundary(s.len() - n) && s.ends_with(&t[..n]) {
                best = best.max(n);
                break;
            }
        }
    }
    best
}

/// Parses the text between `<tool_call>` and `</tool_call>`.
pub fn parse_call_body(body: &str, schemas: &BTreeMap<String, BTreeMap<String, String>>) -> Option<ToolCall> {
    let b = body.trim();
    if b.starts_with('{') {
        let v: Value = serde_json::from_str(b).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let args = match v.get("arguments").or_else(|| v.get("parameters")) {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s).ok()? {
                Value::Object(m) => m,
                _ => return None,
            },
            Some(_) => return None,
        };
        return Some(ToolCall { name, arguments: args });
    }
    let rest = b.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim().to_string();
    if name.is_empty() {
        return None;
    }
    let types = schemas.get(&name);
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() || rest.starts_with("</function>") {
            break;
        }
        let r = rest.strip_prefix("<parameter=")?;
        let (pname, r) = r.split_once('>')?;
        let end = r.find("</parameter>")?;
        let raw = &r[..end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let ty = types.and_then(|t| t.get(pname.trim())).map(String::as_str);
        args.insert(pname.trim().to_string(), convert_value(raw, ty));
        rest = &r[end + "</parameter>".len()..];
    }
    Some(ToolCall { name, arguments: args })
}

/// A parameter value as its schema type says: strings stay text; other types (or no schema)
/// are read as JSON when they parse, else kept as text.
fn convert_value(raw: &str, ty: Option<&str>) -> Value {
    if ty == Some("string") {
        return Value::String(raw.to_string());
    }
    match serde_json::from_str::<Value>(raw.trim()) {
        Ok(v) if ty.is_some() || !v.is_string() => v,
        _ => Value::String(raw.to_string()),
    }
}

/// Reasoning, content and calls of a whole output.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Aggregate {
    /// `reasoning_content` (None when empty).
    pub reasoning: Option<String>,
    /// `content` (None when empty).
    pub content: Option<String>,
    /// Tool calls in order.
    pub calls: Vec<ToolCall>,
}

/// Folds parts into the message they describe.
pub fn aggregate(parts: impl IntoIterator<Item = Part>) -> Aggregate {
    let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::new());
    for p in parts {
        match p {
            Part::Reasoning(x) => r.push_str(&x),
            Part::Content(x) => c.push_str(&x),
            Part::Call(x) => calls.push(x),
        }
    }
    Aggregate { reasoning: (!r.is_empty()).then_some(r), content: (!c.is_empty()).then_some(c), calls }
}

/// Stop strings over streamed text: holds back what could be the start of a stop string.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty: pass-through).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops, held: String::new() }
    }

    /// Adds text; returns the text that is certain, and whether a stop string was hit (the
    /// stop string and what follows are dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.held.push_str(text);
        if let Some(i) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..i].to_string();
            self.held.clear();
            return (out, true);
        }
        let tags: Vec<&str> = self.stops.iter().map(String::as_str).collect();
        let keep = held_suffix(&self.held, &tags);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// The held text at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Token bytes → text without broken characters (an owned twin of `text::StreamDecoder`).
#[derive(Debug, Default)]
pub struct Utf8Assembler {
    pending: Vec<u8>,
}

impl Utf8Assembler {
    /// Adds bytes; returns the complete characters.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let v = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..v]).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..v + n);
                        }
                        None => {
                            self.pending.drain(..v);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// Flushes an incomplete character as U+FFFD.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schemas() -> BTreeMap<String, BTreeMap<String, String>> {
        let mut m = BTreeMap::new();
        m.insert(
            "read_file".to_string(),
            [("path".to_string(), "string".to_string()), ("lines".into(), "integer".into())].into_iter().collect(),
        );
        m
    }

    fn run(text_chunks: &[&str], thinking: bool, tools: bool) -> Aggregate {
        let mut p = OutputParser::new(thinking, tools, schemas());
        let mut parts = Vec::new();
        for c in text_chunks {
            parts.extend(p.push(c));
        }
        parts.extend(p.finish());
        aggregate(parts)
    }

    const OUTPUTS: &[(&str, bool)] = &[
        ("Let me look.\n\n</think>\n\nI'll read it.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\n/etc/hosts\n</parameter>\n<parameter=lines>\n10\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=q>\nüñí \"x\" <b>\n</parameter>\n</function>\n</tool_call>", true),
        ("Plan: call <tool_call>\n<function=read_file>\n<parameter=path>\na.txt\n</parameter>\n</function>\n</tool_call> then answer\n</think>\n\nDone.", true),
        ("<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"rust\", \"n\": 3}}\n</tool_call>", false),
        ("Just text with < and </ and <tool and </think but no tags.", false),
        ("reasoning cut by max_tokens\n\n", true),
        ("<tool_call>\n<function=read_file>\n<parameter=path>\nx\n</parameter>\n", false),
        ("broken <tool_call>\n<function read_file>\n</tool_call> after", false),
        ("<think>\nthought\n</think>\n\nanswer 😀 ok", false),
    ];

    #[test]
    fn whole_outputs() {
        let a = run(&[OUTPUTS[0].0], true, true);
        assert_eq!(a.reasoning.as_deref(), Some("Let me look."));
        assert_eq!(a.content.as_deref(), Some("I'll read it.\n\n\n"));
        assert_eq!(a.calls.len(), 2);
        assert_eq!(a.calls[0].name, "read_file");
        assert_eq!(Value::Object(a.calls[0].arguments.clone()), json!({"path": "/etc/hosts", "lines": 10}));
        assert_eq!(Value::Object(a.calls[1].arguments.clone()), json!({"q": "üñí \"x\" <b>"}));

        let a = run(&[OUTPUTS[1].0], true, true);
        assert_eq!(a.calls.len(), 1, "a call inside the reasoning is a call");
        assert_eq!(a.reasoning.as_deref(), Some("Plan: call  then answer"));
        assert_eq!(a.content.as_deref(), Some("Done."));

        let a = run(&[OUTPUTS[2].0], false, true);
        assert_eq!(Value::Object(a.calls[0].arguments.clone()), json!({"q": "rust", "n": 3}));
        assert_eq!(a.content, None);

        let a = run(&[OUTPUTS[3].0], false, true);
        assert_eq!(a.content.as_deref(), Some(OUTPUTS[3].0));

        let a = run(&[OUTPUTS[4].0], true, true);
        assert_eq!(a.reasoning.as_deref(), Some("reasoning cut by max_tokens\n\n"));
        assert_eq!(a.content, None);

        let a = run(&[OUTPUTS[5].0], false, true);
        assert_eq!(a.calls.len(), 1, "call cut before </function> still parses");

        let a = run(&[OUTPUTS[6].0], false, true);
        assert!(a.calls.is_empty());
        assert!(a.content.as_deref().unwrap().contains("<function read_file>"));

        let a = run(&[OUTPUTS[7].0], false, true);
        assert_eq!(a.reasoning.as_deref(), Some("thought"));
        assert_eq!(a.content.as_deref(), Some("answer 😀 ok"));

        // Tools off: tags stay text.
        let a = run(&[OUTPUTS[2].0], false, false);
        assert!(a.calls.is_empty());
        assert_eq!(a.content.as_deref(), Some(OUTPUTS[2].0));
    }

    #[test]
    fn every_split_matches_whole() {
        for &(text, thinking) in OUTPUTS {
            for tools in [true, false] {
                let whole = run(&[text], thinking, tools);
                // One split at every position.
                for (i, _) in text.char_indices() {
                    let got = run(&[&text[..i], &text[i..]], thinking, tools);
                    assert_eq!(got, whole, "split at {i} of {text:?}");
                }
                // Every character its own chunk, and chunks of 3.
                let chars: Vec<String> = text.chars().map(String::from).collect();
                let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
                assert_eq!(run(&refs, thinking, tools), whole, "per-char {text:?}");
                let threes: Vec<String> = chars.chunks(3).map(|c| c.concat()).collect();
                let refs: Vec<&str> = threes.iter().map(String::as_str).collect();
                assert_eq!(run(&refs, thinking, tools), whole, "threes {text:?}");
            }
        }
    }

    #[test]
    fn stop_strings_every_split() {
        let text = "hello wor\nld STOP here";
        for (i, _) in text.char_indices() {
            let mut m = StopMatcher::new(vec!["STOP".into(), "xyz".into()]);
            let (a, hit_a) = m.push(&text[..i]);
            let (b, hit_b) = if hit_a { (String::new(), true) } else { m.push(&text[i..]) };
            assert!(hit_a || hit_b);
            assert_eq!(format!("{a}{b}"), "hello wor\nld ", "split {i}");
        }
        let mut m = StopMatcher::new(vec!["abc".into()]);
        assert_eq!(m.push("xab"), ("x".into(), false));
        assert_eq!(m.finish(), "ab");
    }

    #[test]
    fn utf8_assembly() {
        let s = "a😀é";
        let mut u = Utf8Assembler::default();
        let mut out = String::new();
        for b in s.as_bytes() {
            out.push_str(&u.push(&[*b]));
        }
        out.push_str(&u.finish());
        assert_eq!(out, s);
        let mut u = Utf8Assembler::default();
        assert_eq!(u.push(&[0xF0, 0x9F]), "");
        assert_eq!(u.finish(), "\u{FFFD}");
    }
}
