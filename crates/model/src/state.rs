//! Per-sequence decode state: KV cache for the attention layers, conv and recurrent state for
//! the Gated DeltaNet layers (docs/MODEL.md §4).

use spec::{LayerKind, TextConfig};

/// State of one layer.
#[derive(Clone, Debug)]
pub enum LayerState {
    /// Gated DeltaNet layer.
    Gdn {
        /// [kernel-1, conv_dim]: the last pre-conv `in_proj_qkv` outputs, oldest first (zero at
        /// the start of a sequence).
        conv: Vec<f32>,
        /// [n_v, d_k, d_v]: recurrent state S per value head, row = key dim (HF layout), f32.
        s: Vec<f32>,
    },
    /// Gated attention layer.
    Attn {
        /// [pos, n_kv, head_dim]: keys after k_norm and RoPE.
        k: Vec<f32>,
        /// [pos, n_kv, head_dim]: values.
        v: Vec<f32>,
    },
}

/// Everything a sequence carries between forward calls. Cloning it forks the sequence (the
/// basis of prefix reuse: GDN state cannot be truncated, only snapshotted).
#[derive(Clone, Debug)]
pub struct State {
    /// Tokens processed so far (the position of the next token).
    pub pos: usize,
    /// Context limit in tokens.
    pub max_ctx: usize,
    /// One entry per layer.
    pub layers: Vec<LayerState>,
}

impl State {
    /// A fresh state for `cfg` with a context limit in tokens.
    pub fn new(cfg: &TextConfig, max_ctx: usize) -> Self {
        let layers = cfg
            .layer_types
            .iter()
            .map(|k| match k {
                LayerKind::LinearAttention => LayerState::Gdn {
                    conv: vec![0.0; (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim()],
                    s: vec![0.0; cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim],
                },
                LayerKind::FullAttention => LayerState::Attn { k: Vec::new(), v: Vec::new() },
            })
            .collect();
        State { pos: 0, max_ctx, layers }
    }

    /// Bytes held: KV cache plus GDN state, as f32.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn { conv, s } => (conv.len() + s.len()) * 4,
                LayerState::Attn { k, v } => (k.len() + v.len()) * 4,
            })
            .sum()
    }
}
