//! Compact vocabularies (`calla_vocab.json`): a model trained on a subset of the tokenizer's
//! ids, with its embedding and LM head rows renumbered.
//!
//! Method `calla-compact-vocab-v1` (written by `scripts/train_demo/prepare_corpus.py`):
//! `{"method": "calla-compact-vocab-v1", "unk_row": 0, "tokenizer_ids": [-1, id₁, id₂, ...]}`.
//! Model row r stands for tokenizer id `tokenizer_ids[r]`; rows whose entry is -1 (the unknown
//! row, padding) stand for no token: they are never sampled. A tokenizer id that is not listed
//! is fed to the model as `unk_row`.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use crate::ConfigError;

/// File name of a compact vocabulary inside a snapshot folder.
pub const VOCAB_MAP_FILE: &str = "calla_vocab.json";

/// A compact vocabulary: tokenizer ids ↔ model rows.
#[derive(Debug, Clone, PartialEq)]
pub struct VocabMap {
    to_id: Vec<i64>,
    to_row: HashMap<u32, u32>,
    unk_row: u32,
}

impl VocabMap {
    /// Reads `calla_vocab.json` from a snapshot folder; `Ok(None)` when there is none.
    ///
    /// # Errors
    /// [`ConfigError`] naming the file and field.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, ConfigError> {
        let path = dir.join(VOCAB_MAP_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io { path: path.display().to_string(), source })?;
        let v: Value = serde_json::from_str(&text).map_err(|source| ConfigError::Json { path: path.display().to_string(), source })?;
        Self::from_json(&v).map(Some)
    }

    /// Parses the JSON form.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field (`calla_vocab.json:` prefix).
    pub fn from_json(v: &Value) -> Result<Self, ConfigError> {
        let field = |f: &str| format!("{VOCAB_MAP_FILE}:{f}");
        match v.get("method").and_then(Value::as_str) {
            Some("calla-compact-vocab-v1") => {}
            other => {
                return Err(ConfigError::Invalid {
                    field: field("method"),
                    reason: format!("expected `calla-compact-vocab-v1`, found {other:?}"),
                })
            }
        }
        let ids = v.get("tokenizer_ids").and_then(Value::as_array).ok_or_else(|| ConfigError::Missing { field: field("tokenizer_ids") })?;
        let to_id = ids
            .iter()
            .map(|x| x.as_i64().filter(|&i| i >= -1 && i <= u32::MAX as i64))
            .collect::<Option<Vec<i64>>>()
            .ok_or_else(|| ConfigError::Type { field: field("tokenizer_ids"), expected: "a list of token ids (or -1)", found: "another value".into() })?;
        let unk_row = v.get("unk_row").and_then(Value::as_u64).ok_or_else(|| ConfigError::Missing { field: field("unk_row") })? as u32;
        if unk_row as usize >= to_id.len() {
            return Err(ConfigError::Invalid { field: field("unk_row"), reason: format!("{unk_row} is not a row of {}", to_id.len()) });
        }
        let mut to_row = HashMap::new();
        for (r, &id) in to_id.iter().enumerate() {
            if id >= 0 && to_row.insert(id as u32, r as u32).is_some() {
                return Err(ConfigError::Invalid { field: field("tokenizer_ids"), reason: format!("tokenizer id {id} is listed twice") });
            }
        }
        Ok(VocabMap { to_id, to_row, unk_row })
    }

    /// Model rows.
    pub fn rows(&self) -> usize {
        self.to_id.len()
    }

    /// The row a tokenizer id is fed as (`unk_row` when the id is not kept).
    pub fn row(&self, id: u32) -> u32 {
        self.to_row.get(&id).copied().unwrap_or(self.unk_row)
    }

    /// The row of a tokenizer id, if it is kept.
    pub fn row_of(&self, id: u32) -> Option<u32> {
        self.to_row.get(&id).copied()
    }

    /// The tokenizer id a row stands for; `None` for the unknown row and padding rows.
    pub fn id(&self, row: u32) -> Option<u32> {
        self.to_id.get(row as usize).and_then(|&i| u32::try_from(i).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_both_ways() {
        let m = VocabMap::from_json(&serde_json::json!({"method": "calla-compact-vocab-v1", "unk_row": 0, "tokenizer_ids": [-1, 5, 9, 248046, -1]})).unwrap();
        assert_eq!(m.rows(), 5);
        assert_eq!(m.row(9), 2);
        assert_eq!(m.row(7), 0);
        assert_eq!(m.id(3), Some(248046));
        assert_eq!(m.id(0), None);
        assert_eq!(m.id(4), None);
        assert_eq!(m.id(99), None);
        let bad = VocabMap::from_json(&serde_json::json!({"method": "calla-compact-vocab-v1", "unk_row": 0, "tokenizer_ids": [-1, 5, 5]}));
        assert!(bad.unwrap_err().to_string().contains("listed twice"));
    }
}
