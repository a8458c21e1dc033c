//! The `quantization` section of an mlx-lm `config.json`.
//!
//! Written by `mlx_lm.utils.quantize_model` and read back by `mlx_lm.utils.load_model`
//! (ml-explore/mlx-lm `mlx_lm/utils.py`):
//!
//! ```json
//! "quantization": {
//!     "group_size": 64, "bits": 4, "mode": "affine",
//!     "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
//!     "language_model.model.layers.0.mlp.shared_expert_gate": {"group_size": 64, "bits": 8},
//!     ...
//! },
//! "quantization_config": { ...the same object again (for HF tooling)... }
//! ```
//!
//! * Top-level `group_size` / `bits` (/ `mode`, absent in older files, meaning `"affine"`) are
//!   the defaults.
//! * Any other key is a **module path in MLX naming** (after the model's `sanitize`, so it
//!   starts `language_model.`) whose value is either an object with its own `group_size` /
//!   `bits` (/ `mode`), or `false` for a module left unquantized. mlx-lm's qwen3_5
//!   `quant_predicate` puts every `*.mlp.gate` (router) and `*.mlp.shared_expert_gate` at
//!   8 bits, group 64.
//! * A module without an entry is quantized with the defaults **iff** its `{path}.scales`
//!   tensor exists (mlx-lm skips modules whose input dim is not a multiple of the group size,
//!   and conv1d / norms are never quantized).

use crate::{QuantError, QuantSpec};
use serde_json::Value;
use std::collections::BTreeMap;

/// How one module is stored, per the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleQuant {
    /// Quantized with this spec.
    Quantized(QuantSpec),
    /// The config names the module with `false`: stored unquantized.
    Unquantized,
}

/// Parsed `quantization` section: defaults plus per-module overrides.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantConfig {
    /// Default spec for modules without an override.
    pub default: QuantSpec,
    /// Per-module overrides keyed by MLX module path (no `.weight` suffix).
    pub overrides: BTreeMap<String, ModuleQuant>,
}

fn spec_from(obj: &serde_json::Map<String, Value>, at: &str) -> Result<QuantSpec, QuantError> {
    let num = |k: &str| -> Result<u64, QuantError> {
        obj.get(k).and_then(Value::as_u64).ok_or_else(|| {
            QuantError::Missing(format!("integer `{k}` in quantization config at {at}"))
        })
    };
    if let Some(mode) = obj.get("mode") {
        if mode.as_str() != Some("affine") {
            return Err(QuantError::Mismatch {
                what: format!("quantization mode at {at}"),
                expected: "\"affine\"".into(),
                found: mode.to_string(),
            });
        }
    }
    QuantSpec::new(num("bits")? as u32, num("group_size")? as usize)
}

impl QuantConfig {
    /// Reads the `quantization` object of a whole `config.json` (falling back to
    /// `quantization_config`, then to `text_config.quantization`). `Ok(None)` when the file
    /// has none of them (an unquantized checkpoint).
    ///
    /// # Errors
    /// [`QuantError::Missing`] / [`QuantError::Mismatch`] / spec errors for a malformed section,
    /// naming the key.
    pub fn from_model_config(config: &Value) -> Result<Option<QuantConfig>, QuantError> {
        let q = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"))
            .or_else(|| {
                config
                    .get("text_config")
                    .and_then(|t| t.get("quantization"))
            });
        match q {
            None => Ok(None),
            Some(v) => QuantConfig::from_section(v).map(Some),
        }
    }

    /// Parses the `quantization` object itself.
    ///
    /// # Errors
    /// As [`from_model_config`](Self::from_model_config).
    pub fn from_section(section: &Value) -> Result<QuantConfig, QuantError> {
        let obj = section.as_object().ok_or_else(|| QuantError::Mismatch {
            what: "quantization section".into(),
            expected: "a JSON object".into(),
            found: section.to_string(),
        })?;
        let default = spec_from(obj, "top level")?;
        let mut overrides = BTreeMap::new();
        for (k, v) in obj {
            if matches!(k.as_str(), "group_size" | "bits" | "mode" | "quant_method") {
                continue;
            }
            let mq = match v {
                Value::Bool(false) => ModuleQuant::Unquantized,
                Value::Bool(true) => ModuleQuant::Quantized(default),
                Value::Object(o) => ModuleQuant::Quantized(spec_from(o, k)?),
                other => {
                    return Err(QuantError::Mismatch {
                        what: format!("quantization override `{k}`"),
                        expected: "an object with bits/group_size, or a bool".into(),
                        found: other.to_string(),
                    })
                }
            };
            overrides.insert(k.clone(), mq);
        }
        Ok(QuantConfig { default, overrides })
    }

    /// The spec for module `path` (MLX naming, no `.weight`), given whether its `.scales`
    /// tensor exists: override if any, else the default when `has_scales`, else unquantized.
    pub fn module(&self, path: &str, has_scales: bool) -> ModuleQuant {
        match self.overrides.get(path) {
            Some(m) => *m,
            None if has_scales => ModuleQuant::Quantized(self.default),
            None => ModuleQuant::Unquantized,
        }
    }
}
