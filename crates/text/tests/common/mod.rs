//! Shared helpers of the `text` integration tests. Paths are the repo copies of the assets.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::Value;
use text::{ChatTemplate, Tokenizer};

/// Repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn asset_dir() -> PathBuf {
    repo_root().join("assets/tokenizer")
}

pub fn testdata(name: &str) -> PathBuf {
    repo_root().join("testdata/tokenizer").join(name)
}

/// The real Qwen3.6 tokenizer, loaded once per test binary.
pub fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_file(&asset_dir().join("tokenizer.json")).expect("load tokenizer.json")
    })
}

/// The official chat template, compiled once per test binary.
pub fn template() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| {
        let src = std::fs::read_to_string(asset_dir().join("chat_template.jinja"))
            .expect("read chat_template.jinja");
        ChatTemplate::from_source(src).expect("compile chat template")
    })
}

/// Parses a JSON-lines file; panics (test failure) on an unreadable file or bad line.
pub fn read_jsonl(name: &str) -> Vec<Value> {
    let path = testdata(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rows: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .collect();
    assert!(!rows.is_empty(), "{} is empty", path.display());
    rows
}

/// A token vector record of vectors.jsonl / llamacpp_vectors.jsonl.
#[derive(Debug, Clone)]
pub struct Vector {
    pub file: &'static str,
    pub name: String,
    pub text: String,
    pub ids: Vec<u32>,
    pub decoded: String,
    pub decoded_skip_special: String,
    pub token_bytes: Vec<Vec<u8>>,
    pub has_partial_utf8_tokens: bool,
}

fn hex(s: &str) -> Vec<u8> {
    assert_eq!(s.len() % 2, 0, "odd hex {s}");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Every vector of both files.
pub fn vectors() -> Vec<Vector> {
    let mut out = Vec::new();
    for file in ["vectors.jsonl", "llamacpp_vectors.jsonl"] {
        for row in read_jsonl(file) {
            let s = |k: &str| {
                row[k]
                    .as_str()
                    .unwrap_or_else(|| panic!("{file}: {k}"))
                    .to_string()
            };
            out.push(Vector {
                file,
                name: s("name"),
                text: s("text"),
                ids: row["ids"]
                    .as_array()
                    .expect("ids")
                    .iter()
                    .map(|v| v.as_u64().expect("id") as u32)
                    .collect(),
                decoded: s("decoded"),
                decoded_skip_special: s("decoded_skip_special"),
                token_bytes: row["token_bytes_hex"]
                    .as_array()
                    .expect("token_bytes_hex")
                    .iter()
                    .map(|v| hex(v.as_str().expect("hex string")))
                    .collect(),
                has_partial_utf8_tokens: row["has_partial_utf8_tokens"].as_bool().unwrap_or(false),
            });
        }
    }
    out
}
