//! `config.json` of a Qwen3.5/3.6 MoE snapshot, parsed and checked against the architecture.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value};

/// A config that cannot describe this architecture. Every variant names the offending field
/// (as a JSON path inside `config.json`, e.g. `text_config.num_experts`).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// Path of the file.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The file is not valid JSON.
    #[error("{path} is not valid JSON: {source}")]
    Json {
        /// Path of the file.
        path: String,
        /// Underlying error.
        source: serde_json::Error,
    },
    /// A required field is absent.
    #[error("config field `{field}` is missing")]
    Missing {
        /// JSON path of the field.
        field: String,
    },
    /// A field has the wrong JSON type.
    #[error("config field `{field}` must be {expected}, found {found}")]
    Type {
        /// JSON path of the field.
        field: String,
        /// What was expected, e.g. "a positive integer".
        expected: &'static str,
        /// What was found, rendered as JSON.
        found: String,
    },
    /// A field's value is inconsistent with the architecture.
    #[error("config field `{field}`: {reason}")]
    Invalid {
        /// JSON path of the field.
        field: String,
        /// Why the value is refused.
        reason: String,
    },
}

/// The kind of token mixer in one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Gated DeltaNet (`layer_types` value `linear_attention`); weights under `linear_attn.`.
    LinearAttention,
    /// Gated full attention (`full_attention`); weights under `self_attn.`.
    FullAttention,
}

impl LayerKind {
    /// The `layer_types` string of this kind.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerKind::LinearAttention => "linear_attention",
            LayerKind::FullAttention => "full_attention",
        }
    }
}

/// MLX-style group-wise affine quantization settings (the top-level `quantization` section of
/// mlx-community checkpoints): `bits` and `group_size` by default, with per-module overrides
/// keyed by module path (e.g. `model.language_model.layers.0.mlp.gate`).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizationConfig {
    /// Default bits per weight (4 or 8).
    pub bits: u32,
    /// Default number of weights sharing one scale and bias.
    pub group_size: usize,
    /// Per-module `(bits, group_size)` overrides, by module path without `.weight`.
    pub overrides: BTreeMap<String, (u32, usize)>,
}

impl QuantizationConfig {
    /// `(bits, group_size)` for a module path (without `.weight`).
    pub fn for_module(&self, module: &str) -> (u32, usize) {
        self.overrides.get(module).copied().unwrap_or((self.bits, self.group_size))
    }
}

/// The decoder settings of a Qwen3.5/3.6 MoE model, validated.
///
/// Field names follow transformers' `Qwen3_5MoeTextConfig`. Dimension-generic: small test
/// models load as well as the production shape ([`crate::production`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TextConfig {
    /// Rows of `embed_tokens` / `lm_head`.
    pub vocab_size: usize,
    /// Residual width `d_model`.
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Mixer kind of each layer, `num_hidden_layers` long.
    pub layer_types: Vec<LayerKind>,
    /// Gated attention query heads.
    pub num_attention_heads: usize,
    /// Gated attention key/value heads.
    pub num_key_value_heads: usize,
    /// Gated attention head dimension.
    pub head_dim: usize,
    /// Fraction of `head_dim` that is rotated.
    pub partial_rotary_factor: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Gated DeltaNet query/key heads.
    pub linear_num_key_heads: usize,
    /// Gated DeltaNet value heads.
    pub linear_num_value_heads: usize,
    /// Gated DeltaNet key head dimension.
    pub linear_key_head_dim: usize,
    /// Gated DeltaNet value head dimension.
    pub linear_value_head_dim: usize,
    /// Causal conv kernel width.
    pub linear_conv_kernel_dim: usize,
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Routed expert intermediate width.
    pub moe_intermediate_size: usize,
    /// Shared expert intermediate width.
    pub shared_expert_intermediate_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Longest sequence the model was configured for, in tokens.
    pub max_position_embeddings: usize,
    /// Whether `lm_head` shares `embed_tokens`.
    pub tie_word_embeddings: bool,
    /// End-of-sequence ids from the config (often empty; `generation_config.json` is preferred).
    pub eos_token_ids: Vec<u32>,
    /// Whether the published multimodal form (`text_config` nested) was read. Its tensors are
    /// named `model.language_model.*`.
    pub nested: bool,
    /// Group-wise quantization section, when the checkpoint is quantized.
    pub quantization: Option<QuantizationConfig>,
}

/// Accessor over one JSON object that reports errors with the full field path.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    fn path(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{}", self.prefix, key)
        }
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        let v = self.get(key).ok_or_else(|| ConfigError::Missing { field: self.path(key) })?;
        v.as_u64().filter(|&n| n > 0).map(|n| n as usize).ok_or_else(|| ConfigError::Type {
            field: self.path(key),
            expected: "a positive integer",
            found: v.to_string(),
        })
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        if self.get(key).is_some() {
            self.usize(key)
        } else {
            Ok(default)
        }
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| ConfigError::Type {
                field: self.path(key),
                expected: "a number",
                found: v.to_string(),
            }),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| ConfigError::Type {
                field: self.path(key),
                expected: "true or false",
                found: v.to_string(),
            }),
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<&'a str>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| ConfigError::Type {
                field: self.path(key),
                expected: "a string",
                found: v.to_string(),
            }),
        }
    }

    fn token_ids(&self, key: &str) -> Result<Vec<u32>, ConfigError> {
        token_ids(self.get(key), &self.path(key))
    }
}

/// An id or a list of ids (`eos_token_id` may be either).
pub(crate) fn token_ids(v: Option<&Value>, field: &str) -> Result<Vec<u32>, ConfigError> {
    let bad = |v: &Value| ConfigError::Type {
        field: field.to_string(),
        expected: "a token id or a list of token ids",
        found: v.to_string(),
    };
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).ok_or_else(|| bad(v.unwrap())),
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| i.as_u64().map(|n| n as u32).ok_or_else(|| bad(i)))
            .collect(),
        Some(other) => Err(bad(other)),
    }
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), reason: reason.into() }
}

impl TextConfig {
    /// Reads and validates `config.json` in a snapshot folder.
    ///
    /// # Errors
    /// [`ConfigError`] naming the file or the field.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|source| ConfigError::Io { path: path.display().to_string(), source })?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|source| ConfigError::Json { path: path.display().to_string(), source })?;
        Self::from_json(&value)
    }

    /// Parses and validates a `config.json` value: the published form (`model_type`
    /// `qwen3_5_moe`, decoder settings under `text_config`) or the flat text-only form
    /// (`qwen3_5_moe_text`).
    ///
    /// # Errors
    /// [`ConfigError`] naming the field (as a JSON path).
    pub fn from_json(root: &Value) -> Result<Self, ConfigError> {
        let root_obj = root.as_object().ok_or_else(|| ConfigError::Type {
            field: "(root)".into(),
            expected: "a JSON object",
            found: short(root),
        })?;
        let top = Fields { obj: root_obj, prefix: "" };
        let model_type = top.str_opt("model_type")?;
        let (text, nested) = match model_type {
            Some("qwen3_5_moe") => {
                let tc = top.get("text_config").ok_or_else(|| ConfigError::Missing {
                    field: "text_config".into(),
                })?;
                let obj = tc.as_object().ok_or_else(|| ConfigError::Type {
                    field: "text_config".into(),
                    expected: "a JSON object",
                    found: short(tc),
                })?;
                (Fields { obj, prefix: "text_config" }, true)
            }
            Some("qwen3_5_moe_text") => (Fields { obj: root_obj, prefix: "" }, false),
            Some(other) => {
                return Err(invalid(
                    "model_type",
                    format!(
                        "calla runs Qwen3.5/3.6 MoE only (`qwen3_5_moe` or `qwen3_5_moe_text`), found `{other}`"
                    ),
                ))
            }
            None => return Err(ConfigError::Missing { field: "model_type".into() }),
        };
        if nested {
            if let Some(tm) = text.str_opt("model_type")? {
                if tm != "qwen3_5_moe_text" {
                    return Err(invalid(
                        "text_config.model_type",
                        format!("expected `qwen3_5_moe_text`, found `{tm}`"),
                    ));
                }
            }
        }

        let num_hidden_layers = text.usize("num_hidden_layers")?;
        let layer_types = parse_layer_types(&text, num_hidden_layers)?;

        // RoPE: transformers 5 keeps these inside `rope_parameters`; older configs and the
        // published one also repeat them at the top of the text config.
        let rope = match text.get("rope_parameters") {
            Some(Value::Object(obj)) => Some(Fields { obj, prefix: "" }),
            Some(other) => {
                return Err(ConfigError::Type {
                    field: text.path("rope_parameters"),
                    expected: "a JSON object",
                    found: short(other),
                })
            }
            None => None,
        };
        let rope_path = text.path("rope_parameters");
        let rope = rope.map(|f| Fields { obj: f.obj, prefix: &rope_path });
        let from_rope = |key: &str| -> Result<Option<f64>, ConfigError> {
            match &rope {
                Some(r) => r.f64_opt(key),
                None => Ok(None),
            }
        };
        let rope_theta = match from_rope("rope_theta")? {
            Some(v) => v,
            None => text.f64_opt("rope_theta")?.unwrap_or(10_000.0),
        };
        let (partial_rotary_factor, rotary_field) = match from_rope("partial_rotary_factor")? {
            Some(v) => (v, format!("{rope_path}.partial_rotary_factor")),
            None => (text.f64_opt("partial_rotary_factor")?.unwrap_or(0.25), text.path("partial_rotary_factor")),
        };
        if let Some(r) = &rope {
            if let Some(t) = r.str_opt("rope_type")? {
                if t != "default" {
                    return Err(invalid(
                        r.path("rope_type"),
                        format!("only `default` RoPE is supported, found `{t}`"),
                    ));
                }
            }
        }

        let hidden_act = text.str_opt("hidden_act")?.unwrap_or("silu");
        if hidden_act != "silu" {
            return Err(invalid(text.path("hidden_act"), format!("expected `silu`, found `{hidden_act}`")));
        }
        if text.bool_or("attention_bias", false)? {
            return Err(invalid(text.path("attention_bias"), "this architecture has no attention biases"));
        }
        if !text.bool_or("attn_output_gate", true)? {
            return Err(invalid(text.path("attn_output_gate"), "this architecture has a gated attention output"));
        }
        let tie_word_embeddings = match text.get("tie_word_embeddings") {
            Some(_) => text.bool_or("tie_word_embeddings", false)?,
            None => top.bool_or("tie_word_embeddings", false)?,
        };
        let rms_norm_eps = text.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps > 0.0 && rms_norm_eps < 1e-2) {
            return Err(invalid(text.path("rms_norm_eps"), format!("{rms_norm_eps} is not a plausible epsilon")));
        }
        if let Some(step) = text.get("decoder_sparse_step") {
            if step.as_u64() != Some(1) {
                return Err(invalid(text.path("decoder_sparse_step"), "every layer must be a MoE layer (1)"));
            }
        }
        if let Some(Value::Array(m)) = text.get("mlp_only_layers") {
            if !m.is_empty() {
                return Err(invalid(text.path("mlp_only_layers"), "dense MLP layers are not part of this architecture"));
            }
        }

        let mut eos_token_ids = text.token_ids("eos_token_id")?;
        if eos_token_ids.is_empty() {
            eos_token_ids = top.token_ids("eos_token_id")?;
        }

        let quantization = match top.get("quantization").or_else(|| top.get("quantization_config")) {
            None => None,
            Some(q) => Some(parse_quantization(q, if top.get("quantization").is_some() { "quantization" } else { "quantization_config" })?),
        };

        let cfg = TextConfig {
            vocab_size: text.usize("vocab_size")?,
            hidden_size: text.usize("hidden_size")?,
            num_hidden_layers,
            layer_types,
            num_attention_heads: text.usize("num_attention_heads")?,
            num_key_value_heads: text.usize("num_key_value_heads")?,
            head_dim: text.usize("head_dim")?,
            partial_rotary_factor,
            rope_theta,
            linear_num_key_heads: text.usize("linear_num_key_heads")?,
            linear_num_value_heads: text.usize("linear_num_value_heads")?,
            linear_key_head_dim: text.usize("linear_key_head_dim")?,
            linear_value_head_dim: text.usize("linear_value_head_dim")?,
            linear_conv_kernel_dim: text.usize_or("linear_conv_kernel_dim", 4)?,
            num_experts: text.usize("num_experts")?,
            num_experts_per_tok: text.usize("num_experts_per_tok")?,
            moe_intermediate_size: text.usize("moe_intermediate_size")?,
            shared_expert_intermediate_size: text.usize("shared_expert_intermediate_size")?,
            rms_norm_eps: rms_norm_eps as f32,
            max_position_embeddings: text.usize_or("max_position_embeddings", 262_144)?,
            tie_word_embeddings,
            eos_token_ids,
            nested,
            quantization,
        };
        cfg.check(&text, &rotary_field)?;
        Ok(cfg)
    }

    /// Architecture invariants (head ratios, expert counts, rotary fraction).
    fn check(&self, f: &Fields<'_>, rotary_field: &str) -> Result<(), ConfigError> {
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(invalid(
                f.path("num_key_value_heads"),
                format!(
                    "{} query heads cannot be shared evenly by {} key/value heads",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            return Err(invalid(
                f.path("linear_num_value_heads"),
                format!(
                    "{} value heads cannot be grouped evenly over {} key heads",
                    self.linear_num_value_heads, self.linear_num_key_heads
                ),
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            return Err(invalid(
                f.path("num_experts_per_tok"),
                format!("top-{} routing needs at least that many experts, found {}", self.num_experts_per_tok, self.num_experts),
            ));
        }
        let rot = self.rotary_dim_exact();
        match rot {
            Some(r) if r > 0 && r % 2 == 0 && r <= self.head_dim => {}
            _ => {
                return Err(invalid(
                    rotary_field,
                    format!(
                        "{} of head_dim {} must give a whole, even number of rotary dimensions in 2..={}",
                        self.partial_rotary_factor, self.head_dim, self.head_dim
                    ),
                ))
            }
        }
        if self.rope_theta <= 1.0 {
            return Err(invalid(f.path("rope_theta"), format!("{} is not a valid RoPE base", self.rope_theta)));
        }
        if self.head_dim % 2 != 0 {
            return Err(invalid(f.path("head_dim"), "must be even"));
        }
        Ok(())
    }

    fn rotary_dim_exact(&self) -> Option<usize> {
        let r = self.head_dim as f64 * self.partial_rotary_factor;
        // transformers takes int(head_dim * factor); require it to be whole to avoid surprises.
        (r.fract().abs() < 1e-9).then_some(r as usize)
    }

    /// Rotated dimensions per attention head (`int(head_dim * partial_rotary_factor)`).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Gated DeltaNet key width (`n_k_heads * d_k`).
    pub fn gdn_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// Gated DeltaNet value width (`n_v_heads * d_v`).
    pub fn gdn_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Gated DeltaNet conv channels: q | k | v.
    pub fn gdn_conv_dim(&self) -> usize {
        2 * self.gdn_key_dim() + self.gdn_value_dim()
    }

    /// Prefix of the decoder tensors: `model.language_model.` (published) or `model.`.
    pub fn tensor_prefix(&self) -> &'static str {
        if self.nested {
            "model.language_model."
        } else {
            "model."
        }
    }

    /// Whether every dimension equals the published model's ([`crate::production`]).
    pub fn is_production(&self) -> bool {
        use crate::production as p;
        self.hidden_size == p::D_MODEL
            && self.num_hidden_layers == p::N_LAYERS
            && self.vocab_size == p::VOCAB
            && self.num_attention_heads == p::N_Q_HEADS
            && self.num_key_value_heads == p::N_KV_HEADS
            && self.head_dim == p::HEAD_DIM
            && self.rotary_dim() == p::ROTARY_DIM
            && self.linear_num_key_heads == p::N_K_HEADS
            && self.linear_num_value_heads == p::N_V_HEADS
            && self.linear_key_head_dim == p::D_K
            && self.linear_value_head_dim == p::D_V
            && self.linear_conv_kernel_dim == p::CONV_KERNEL
            && self.num_experts == p::N_EXPERTS
            && self.num_experts_per_tok == p::TOP_K
            && self.moe_intermediate_size == p::D_EXPERT
            && self.shared_expert_intermediate_size == p::D_SHARED_EXPERT
            && self.layer_types.iter().enumerate().all(|(i, k)| {
                (*k == LayerKind::FullAttention) == ((i + 1) % p::FULL_ATTENTION_INTERVAL == 0)
            })
    }
}

fn parse_layer_types(text: &Fields<'_>, n_layers: usize) -> Result<Vec<LayerKind>, ConfigError> {
    let field = text.path("layer_types");
    match text.get("layer_types") {
        Some(Value::Array(items)) => {
            if items.len() != n_layers {
                return Err(invalid(
                    field,
                    format!("has {} entries but num_hidden_layers is {n_layers}", items.len()),
                ));
            }
            let kinds = items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("linear_attention") => Ok(LayerKind::LinearAttention),
                    Some("full_attention") => Ok(LayerKind::FullAttention),
                    _ => Err(invalid(
                        format!("{field}[{i}]"),
                        format!("expected `linear_attention` or `full_attention`, found {v}"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            // The architecture is a repeated block of (interval - 1) Gated DeltaNet layers and
            // one gated attention layer (HF `full_attention_interval`).
            let interval = text.usize_or("full_attention_interval", crate::production::FULL_ATTENTION_INTERVAL)?;
            for (i, k) in kinds.iter().enumerate() {
                let want = if (i + 1) % interval == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention };
                if *k != want {
                    return Err(invalid(
                        format!("{field}[{i}]"),
                        format!(
                            "layer {i} is `{}` but the architecture's pattern ({} Gated DeltaNet layers, then one full-attention layer) puts `{}` there",
                            k.as_str(),
                            interval - 1,
                            want.as_str()
                        ),
                    ));
                }
            }
            Ok(kinds)
        }
        Some(other) => Err(ConfigError::Type { field, expected: "a list of layer type strings", found: short(other) }),
        None => {
            let interval = text.usize_or("full_attention_interval", crate::production::FULL_ATTENTION_INTERVAL)?;
            Ok((0..n_layers)
                .map(|i| if (i + 1) % interval == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention })
                .collect())
        }
    }
}

fn parse_quantization(q: &Value, field: &str) -> Result<QuantizationConfig, ConfigError> {
    let obj = q.as_object().ok_or_else(|| ConfigError::Type {
        field: field.to_string(),
        expected: "a JSON object",
        found: short(q),
    })?;
    let f = Fields { obj, prefix: field };
    let bits = f.usize("bits")? as u32;
    let group_size = f.usize("group_size")?;
    let check = |path: String, bits: u32, gs: usize| -> Result<(), ConfigError> {
        if bits != 4 && bits != 8 {
            return Err(invalid(format!("{path}.bits"), format!("only 4 and 8 bits are supported, found {bits}")));
        }
        if gs != 32 && gs != 64 && gs != 128 {
            return Err(invalid(format!("{path}.group_size"), format!("group size must be 32, 64 or 128, found {gs}")));
        }
        Ok(())
    };
    check(field.to_string(), bits, group_size)?;
    if let Some(mode) = f.str_opt("mode")? {
        if mode != "affine" {
            return Err(invalid(format!("{field}.mode"), format!("only MLX `affine` quantization is supported, found `{mode}`")));
        }
    }
    let mut overrides = BTreeMap::new();
    for (k, v) in obj {
        if let Value::Object(o) = v {
            let path = format!("{field}.{k}");
            let sub = Fields { obj: o, prefix: &path };
            let b = sub.usize("bits")? as u32;
            let g = sub.usize("group_size")?;
            check(path.clone(), b, g)?;
            overrides.insert(k.clone(), (b, g));
        }
    }
    Ok(QuantizationConfig { bits, group_size, overrides })
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        format!("{}…", &s[..s.char_indices().nth(77).map(|(i, _)| i).unwrap_or(s.len())])
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn flat() -> Value {
        json!({
            "model_type": "qwen3_5_moe_text",
            "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 8,
            "layer_types": ["linear_attention","linear_attention","linear_attention","full_attention",
                            "linear_attention","linear_attention","linear_attention","full_attention"],
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
            "linear_num_key_heads": 4, "linear_num_value_heads": 8,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
            "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_type": "default"}
        })
    }

    #[test]
    fn flat_and_nested_forms_agree() {
        let a = TextConfig::from_json(&flat()).unwrap();
        let mut text = flat();
        text["model_type"] = json!("qwen3_5_moe_text");
        let nested = json!({"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": false,
                            "vision_config": {"depth": 27}});
        let b = TextConfig::from_json(&nested).unwrap();
        assert!(!a.nested && b.nested);
        assert_eq!(a.tensor_prefix(), "model.");
        assert_eq!(b.tensor_prefix(), "model.language_model.");
        assert_eq!(TextConfig { nested: false, ..b }, a);
        assert_eq!(a.rotary_dim(), 16);
        assert!(!a.is_production());
    }

    #[test]
    fn errors_name_the_field() {
        let cases: Vec<(Box<dyn Fn(&mut Value)>, &str)> = vec![
            (Box::new(|v: &mut Value| v["num_experts_per_tok"] = json!(32)), "num_experts_per_tok"),
            (Box::new(|v: &mut Value| v["num_key_value_heads"] = json!(3)), "num_key_value_heads"),
            (Box::new(|v: &mut Value| v["linear_num_value_heads"] = json!(6)), "linear_num_value_heads"),
            (Box::new(|v: &mut Value| v["rope_parameters"]["partial_rotary_factor"] = json!(0.3)), "rope_parameters.partial_rotary_factor"),
            (Box::new(|v: &mut Value| v["layer_types"][2] = json!("full_attention")), "layer_types[2]"),
            (Box::new(|v: &mut Value| v["layer_types"] = json!(["linear_attention"])), "layer_types"),
            (Box::new(|v: &mut Value| v["hidden_size"] = json!("128")), "hidden_size"),
            (Box::new(|v: &mut Value| { v.as_object_mut().unwrap().remove("num_experts"); }), "num_experts"),
            (Box::new(|v: &mut Value| v["model_type"] = json!("llama")), "model_type"),
            (Box::new(|v: &mut Value| v["rope_parameters"]["rope_type"] = json!("yarn")), "rope_parameters.rope_type"),
        ];
        for (mutate, field) in cases {
            let mut v = flat();
            mutate(&mut v);
            let err = TextConfig::from_json(&v).unwrap_err().to_string();
            assert!(err.contains(&format!("`{field}`")), "error {err:?} does not name {field}");
        }
    }

    #[test]
    fn nested_errors_carry_the_text_config_path() {
        let mut text = flat();
        text["num_experts_per_tok"] = json!(99);
        let nested = json!({"model_type": "qwen3_5_moe", "text_config": text});
        let err = TextConfig::from_json(&nested).unwrap_err().to_string();
        assert!(err.contains("`text_config.num_experts_per_tok`"), "{err}");
    }

    #[test]
    fn production_shape_is_recognised() {
        let v = json!({
            "model_type": "qwen3_5_moe",
            "text_config": {
                "model_type": "qwen3_5_moe_text",
                "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                "full_attention_interval": 4,
                "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512, "partial_rotary_factor": 0.25,
                "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_type": "default",
                                     "mrope_section": [11, 11, 10], "mrope_interleaved": true}
            },
            "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                             "model.language_model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}
        });
        let c = TextConfig::from_json(&v).unwrap();
        assert!(c.is_production());
        assert_eq!(c.gdn_conv_dim(), 8192);
        let q = c.quantization.unwrap();
        assert_eq!(q.for_module("model.language_model.layers.0.mlp.gate"), (8, 64));
        assert_eq!(q.for_module("model.language_model.layers.0.mlp.shared_expert.up_proj"), (4, 64));
    }
}
