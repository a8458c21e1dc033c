//! The model as data: Qwen3.6-35B-A3B (`model_type` `qwen3_5_moe`).
//!
//! This crate holds the one place where the model's shape lives:
//! - [`production`]: the published dimensions as `const`s, for fast paths and kernels;
//! - [`TextConfig`]: a parsed and validated Hugging Face `config.json` (either the published
//!   multimodal form with `text_config` nested inside, or the flat `qwen3_5_moe_text` form that
//!   `Qwen3_5MoeForCausalLM.save_pretrained` writes);
//! - [`GenerationConfig`]: `generation_config.json`;
//! - [`tokens`]: special token ids of the Qwen3.5/3.6 tokenizer.
//!
//! Source of the math and names: transformers `models/qwen3_5_moe/configuration_qwen3_5_moe.py`
//! and `modeling_qwen3_5_moe.py`; see `docs/MODEL.md` in this repository.

mod config;
mod generation;
mod vocab;

pub use config::{ConfigError, LayerKind, QuantizationConfig, TextConfig};
pub use generation::GenerationConfig;
pub use vocab::{VocabMap, VOCAB_MAP_FILE};

/// The published Qwen3.6-35B-A3B dimensions. Fast paths and GPU kernels use these as
/// compile-time constants; [`TextConfig::is_production`] tells whether a loaded config matches.
pub mod production {
    /// Residual stream width.
    pub const D_MODEL: usize = 2048;
    /// Decoder layers (30 Gated DeltaNet + 10 gated attention).
    pub const N_LAYERS: usize = 40;
    /// Every `FULL_ATTENTION_INTERVAL`-th layer (1-based) is full attention.
    pub const FULL_ATTENTION_INTERVAL: usize = 4;
    /// Rows of `embed_tokens` and `lm_head` (padded vocabulary).
    pub const VOCAB: usize = 248_320;
    /// Ids actually produced by the tokenizer (0..248_077); rows above are padding.
    pub const VOCAB_REAL: usize = 248_077;
    /// Gated attention: query heads.
    pub const N_Q_HEADS: usize = 16;
    /// Gated attention: key/value heads (GQA 16:2).
    pub const N_KV_HEADS: usize = 2;
    /// Gated attention: head dimension.
    pub const HEAD_DIM: usize = 256;
    /// Rotary dimensions per head (`partial_rotary_factor` 0.25 of 256).
    pub const ROTARY_DIM: usize = 64;
    /// RoPE base.
    pub const ROPE_THETA: f64 = 1.0e7;
    /// Gated DeltaNet: query/key heads.
    pub const N_K_HEADS: usize = 16;
    /// Gated DeltaNet: value heads.
    pub const N_V_HEADS: usize = 32;
    /// Gated DeltaNet: key head dimension.
    pub const D_K: usize = 128;
    /// Gated DeltaNet: value head dimension.
    pub const D_V: usize = 128;
    /// Gated DeltaNet: causal depthwise conv kernel width.
    pub const CONV_KERNEL: usize = 4;
    /// Routed experts per MoE layer.
    pub const N_EXPERTS: usize = 256;
    /// Experts chosen per token (top-k routing).
    pub const TOP_K: usize = 8;
    /// Routed expert intermediate width.
    pub const D_EXPERT: usize = 512;
    /// Shared expert intermediate width.
    pub const D_SHARED_EXPERT: usize = 512;
    /// RMSNorm epsilon, every norm.
    pub const RMS_EPS: f32 = 1e-6;
    /// Chunk length of the chunked Gated DeltaNet prefill (as in the reference and FLA).
    pub const GDN_CHUNK: usize = 64;
}

/// Special token ids of the Qwen3.5/3.6 tokenizer (`tokenizer.json`, 248 077 ids).
pub mod tokens {
    /// `<|endoftext|>`: end of a document; also a stop token.
    pub const ENDOFTEXT: u32 = 248_044;
    /// `<|im_start|>`.
    pub const IM_START: u32 = 248_045;
    /// `<|im_end|>`: end of a chat turn; the main stop token.
    pub const IM_END: u32 = 248_046;
    /// `<tool_call>`.
    pub const TOOL_CALL: u32 = 248_058;
    /// `</tool_call>`.
    pub const TOOL_CALL_END: u32 = 248_059;
    /// `<think>`.
    pub const THINK: u32 = 248_068;
    /// `</think>`.
    pub const THINK_END: u32 = 248_069;
}
