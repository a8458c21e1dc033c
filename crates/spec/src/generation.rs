//! `generation_config.json`: default sampling settings and stop tokens of a snapshot.

use std::path::Path;

use serde_json::Value;

use crate::config::{token_ids, ConfigError};

/// Sampling defaults and stop ids from `generation_config.json` (all optional there).
///
/// Field names follow transformers' `GenerationConfig`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// Stop ids (`eos_token_id`, an id or a list).
    pub eos_token_ids: Vec<u32>,
    /// `do_sample`; when false, decoding is greedy.
    pub do_sample: Option<bool>,
    /// Softmax temperature.
    pub temperature: Option<f32>,
    /// Keep the k most likely tokens.
    pub top_k: Option<usize>,
    /// Nucleus sampling mass.
    pub top_p: Option<f32>,
    /// Drop tokens below `min_p` times the top probability.
    pub min_p: Option<f32>,
    /// Multiplicative repetition penalty (CTRL style).
    pub repetition_penalty: Option<f32>,
    /// Additive presence penalty (OpenAI style).
    pub presence_penalty: Option<f32>,
}

impl GenerationConfig {
    /// Reads `generation_config.json` from a snapshot folder; a missing file gives the default.
    ///
    /// # Errors
    /// [`ConfigError`] when the file exists but is not valid or has a field of the wrong type.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|source| ConfigError::Io { path: path.display().to_string(), source })?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|source| ConfigError::Json { path: path.display().to_string(), source })?;
        Self::from_json(&v)
    }

    /// Parses a `generation_config.json` value.
    ///
    /// # Errors
    /// [`ConfigError::Type`] naming the field of the wrong type.
    pub fn from_json(v: &Value) -> Result<Self, ConfigError> {
        let num = |key: &str| -> Result<Option<f64>, ConfigError> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x.as_f64().map(Some).ok_or_else(|| ConfigError::Type {
                    field: key.to_string(),
                    expected: "a number",
                    found: x.to_string(),
                }),
            }
        };
        let do_sample = match v.get("do_sample") {
            None | Some(Value::Null) => None,
            Some(x) => Some(x.as_bool().ok_or_else(|| ConfigError::Type {
                field: "do_sample".into(),
                expected: "true or false",
                found: x.to_string(),
            })?),
        };
        Ok(GenerationConfig {
            eos_token_ids: token_ids(v.get("eos_token_id"), "eos_token_id")?,
            do_sample,
            temperature: num("temperature")?.map(|x| x as f32),
            top_k: num("top_k")?.map(|x| x as usize),
            top_p: num("top_p")?.map(|x| x as f32),
            min_p: num("min_p")?.map(|x| x as f32),
            repetition_penalty: num("repetition_penalty")?.map(|x| x as f32),
            presence_penalty: num("presence_penalty")?.map(|x| x as f32),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_generation_config() {
        let v = serde_json::json!({"bos_token_id": 248044, "do_sample": true, "eos_token_id": [248046, 248044],
            "pad_token_id": 248044, "temperature": 1.0, "top_k": 20, "top_p": 0.95});
        let g = GenerationConfig::from_json(&v).unwrap();
        assert_eq!(g.eos_token_ids, vec![248046, 248044]);
        assert_eq!(g.top_k, Some(20));
        assert_eq!(g.do_sample, Some(true));
        let bad = serde_json::json!({"top_p": "high"});
        assert!(GenerationConfig::from_json(&bad).unwrap_err().to_string().contains("`top_p`"));
    }
}
