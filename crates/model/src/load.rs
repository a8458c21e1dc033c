//! Binding checkpoint tensors to the model's structure, with every shape checked at load.
//!
//! Tensor names are those of the Hugging Face releases (docs/MODEL.md §2): decoder tensors under
//! `model.language_model.` (published multimodal checkpoint) or `model.` (text-only exports),
//! `lm_head.weight` at the top, routed experts either fused (`mlp.experts.gate_up_proj`
//! [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]) or one tensor per expert
//! (`mlp.experts.{e}.{gate,up,down}_proj.weight`). `model.visual.*` and `mtp.*` are not read.

use std::path::Path;

use spec::{LayerKind, TextConfig};
use weights::{LoadError, Snapshot, Tensor};

use crate::linear::Linear;
use crate::ModelError;

/// One SiLU-gated feed-forward expert: `down(silu(gate(x)) * up(x))`.
#[derive(Clone, Debug)]
pub struct Expert {
    /// [d_expert, d_model]
    pub gate: Linear,
    /// [d_expert, d_model]
    pub up: Linear,
    /// [d_model, d_expert]
    pub down: Linear,
}

/// Gated DeltaNet mixer weights.
#[derive(Clone, Debug)]
pub struct GdnWeights {
    /// [conv_dim = 2·n_k·d_k + n_v·d_v, d_model]; rows q | k | v.
    pub in_proj_qkv: Linear,
    /// [n_v·d_v, d_model]: output gate z.
    pub in_proj_z: Linear,
    /// [n_v, d_model]: β = σ(b).
    pub in_proj_b: Linear,
    /// [n_v, d_model]: decay input a.
    pub in_proj_a: Linear,
    /// [conv_dim, kernel] depthwise taps, tap kernel-1 on the current token.
    pub conv1d: Vec<f32>,
    /// [n_v]: `-exp(A_log)`, precomputed in f32 (the transformed `A_log`).
    pub a_neg_exp: Vec<f32>,
    /// [n_v]
    pub dt_bias: Vec<f32>,
    /// [d_v]: gated norm weight, used as stored.
    pub norm: Vec<f32>,
    /// [d_model, n_v·d_v]
    pub out_proj: Linear,
}

/// Gated full-attention mixer weights.
#[derive(Clone, Debug)]
pub struct AttnWeights {
    /// [n_q·2·head_dim, d_model]; per head `[query (head_dim) | gate (head_dim)]`.
    pub q_proj: Linear,
    /// [n_kv·head_dim, d_model]
    pub k_proj: Linear,
    /// [n_kv·head_dim, d_model]
    pub v_proj: Linear,
    /// [d_model, n_q·head_dim]
    pub o_proj: Linear,
    /// [head_dim], zero-centred.
    pub q_norm: Vec<f32>,
    /// [head_dim], zero-centred.
    pub k_norm: Vec<f32>,
}

/// Token mixer of one layer.
#[derive(Clone, Debug)]
pub enum Mixer {
    /// Gated DeltaNet.
    Gdn(GdnWeights),
    /// Gated full attention.
    Attn(AttnWeights),
}

/// Sparse MoE block weights.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// [n_experts, d_model] router.
    pub router: Linear,
    /// Routed experts, by id.
    pub experts: Vec<Expert>,
    /// The shared expert.
    pub shared: Expert,
    /// [1, d_model]: the shared expert's sigmoid gate.
    pub shared_gate: Linear,
}

/// One decoder layer.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// [d_model], zero-centred.
    pub input_norm: Vec<f32>,
    /// [d_model], zero-centred.
    pub post_norm: Vec<f32>,
    /// The token mixer.
    pub mixer: Mixer,
    /// The MoE block.
    pub moe: MoeWeights,
}

/// All weights of the text model.
#[derive(Clone, Debug)]
pub struct Weights {
    /// [vocab, d_model]
    pub embed: Linear,
    /// [vocab, d_model] (the embedding itself when tied).
    pub lm_head: Linear,
    /// [d_model], zero-centred.
    pub final_norm: Vec<f32>,
    /// Decoder layers.
    pub layers: Vec<LayerWeights>,
}

struct Binder<'a> {
    snap: &'a Snapshot,
    prefix: String,
}

impl Binder<'_> {
    fn name(&self, rest: &str) -> String {
        format!("{}{rest}", self.prefix)
    }

    fn t(&self, rest: &str) -> Result<&Tensor, LoadError> {
        self.snap.get(&self.name(rest))
    }

    fn lin(&self, rest: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        Linear::new(self.t(rest)?, rows, cols)
    }

    fn vec(&self, rest: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        self.t(rest)?.expect_shape(shape)?.to_f32()
    }
}

impl Weights {
    /// Binds every tensor the text model needs, checking shapes and dtypes against `cfg`.
    ///
    /// # Errors
    /// [`ModelError::Load`] for a missing tensor, wrong shape or dtype (naming tensor and file);
    /// [`ModelError::Mismatch`] when the checkpoint disagrees with a config field (expert count,
    /// layer pattern), naming the field.
    pub fn bind(snap: &Snapshot, cfg: &TextConfig) -> Result<Self, ModelError> {
        // The config form tells the prefix; accept the other naming too, as transformers does.
        let preferred = cfg.tensor_prefix();
        let other = if preferred == "model." { "model.language_model." } else { "model." };
        let prefix = if !snap.contains(&format!("{preferred}embed_tokens.weight"))
            && snap.contains(&format!("{other}embed_tokens.weight"))
        {
            other
        } else {
            preferred
        };
        let b = Binder { snap, prefix: prefix.to_string() };
        let (v, d) = (cfg.vocab_size, cfg.hidden_size);
        let embed = b.lin("embed_tokens.weight", v, d)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            Linear::new(snap.get("lm_head.weight")?, v, d)?
        };
        let final_norm = b.vec("norm.weight", &[d])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (l, kind) in cfg.layer_types.iter().enumerate() {
            layers.push(bind_layer(&b, cfg, l, *kind)?);
        }
        // A checkpoint with more layers than the config is a config mismatch, not a detail.
        let extra = format!("layers.{}.input_layernorm.weight", cfg.num_hidden_layers);
        if snap.contains(&b.name(&extra)) {
            return Err(ModelError::Mismatch {
                field: "num_hidden_layers".into(),
                reason: format!(
                    "config says {} layers but the checkpoint has `{}`",
                    cfg.num_hidden_layers,
                    b.name(&extra)
                ),
            });
        }
        Ok(Weights { embed, lm_head, final_norm, layers })
    }
}

fn bind_layer(b: &Binder<'_>, cfg: &TextConfig, l: usize, kind: LayerKind) -> Result<LayerWeights, ModelError> {
    let d = cfg.hidden_size;
    let p = format!("layers.{l}.");
    let has_gdn = b.snap.contains(&b.name(&format!("{p}linear_attn.in_proj_qkv.weight")))
        || b.snap.contains(&b.name(&format!("{p}linear_attn.in_proj_qkv.scales")));
    let has_attn = b.snap.contains(&b.name(&format!("{p}self_attn.q_proj.weight")))
        || b.snap.contains(&b.name(&format!("{p}self_attn.q_proj.scales")));
    let field = if cfg.nested { format!("text_config.layer_types[{l}]") } else { format!("layer_types[{l}]") };
    match kind {
        LayerKind::LinearAttention if !has_gdn && has_attn => {
            return Err(ModelError::Mismatch {
                field,
                reason: format!("config says `linear_attention` but the checkpoint has attention weights `{}self_attn.*`", b.name(&p)),
            })
        }
        LayerKind::FullAttention if !has_attn && has_gdn => {
            return Err(ModelError::Mismatch {
                field,
                reason: format!("config says `full_attention` but the checkpoint has Gated DeltaNet weights `{}linear_attn.*`", b.name(&p)),
            })
        }
        _ => {}
    }
    let mixer = match kind {
        LayerKind::LinearAttention => {
            let (nk, nv, dk, dv, kk) = (
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
            );
            let conv_dim = 2 * nk * dk + nv * dv;
            let a = format!("{p}linear_attn.");
            let a_log = b.vec(&format!("{a}A_log"), &[nv])?;
            Mixer::Gdn(GdnWeights {
                in_proj_qkv: b.lin(&format!("{a}in_proj_qkv.weight"), conv_dim, d)?,
                in_proj_z: b.lin(&format!("{a}in_proj_z.weight"), nv * dv, d)?,
                in_proj_b: b.lin(&format!("{a}in_proj_b.weight"), nv, d)?,
                in_proj_a: b.lin(&format!("{a}in_proj_a.weight"), nv, d)?,
                conv1d: b.vec(&format!("{a}conv1d.weight"), &[conv_dim, 1, kk])?,
                a_neg_exp: a_log.iter().map(|x| -x.exp()).collect(),
                dt_bias: b.vec(&format!("{a}dt_bias"), &[nv])?,
                norm: b.vec(&format!("{a}norm.weight"), &[dv])?,
                out_proj: b.lin(&format!("{a}out_proj.weight"), d, nv * dv)?,
            })
        }
        LayerKind::FullAttention => {
            let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
            let a = format!("{p}self_attn.");
            Mixer::Attn(AttnWeights {
                q_proj: b.lin(&format!("{a}q_proj.weight"), nq * 2 * hd, d)?,
                k_proj: b.lin(&format!("{a}k_proj.weight"), nkv * hd, d)?,
                v_proj: b.lin(&format!("{a}v_proj.weight"), nkv * hd, d)?,
                o_proj: b.lin(&format!("{a}o_proj.weight"), d, nq * hd)?,
                q_norm: b.vec(&format!("{a}q_norm.weight"), &[hd])?,
                k_norm: b.vec(&format!("{a}k_norm.weight"), &[hd])?,
            })
        }
    };
    Ok(LayerWeights {
        input_norm: b.vec(&format!("{p}input_layernorm.weight"), &[d])?,
        post_norm: b.vec(&format!("{p}post_attention_layernorm.weight"), &[d])?,
        mixer,
        moe: bind_moe(b, cfg, l)?,
    })
}

fn bind_moe(b: &Binder<'_>, cfg: &TextConfig, l: usize) -> Result<MoeWeights, ModelError> {
    let (d, e, i, si) = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size);
    let m = format!("layers.{l}.mlp.");
    let experts_field = if cfg.nested { "text_config.num_experts" } else { "num_experts" };
    let router_t = b.t(&format!("{m}gate.weight"))?;
    if router_t.shape().len() == 2 && router_t.shape()[0] != e {
        return Err(ModelError::Mismatch {
            field: experts_field.into(),
            reason: format!(
                "config says {e} experts but router `{}` in {} has {} rows",
                router_t.name(),
                router_t.file().display(),
                router_t.shape()[0]
            ),
        });
    }
    let router = Linear::new(router_t, e, d)?;
    let fused = b.name(&format!("{m}experts.gate_up_proj"));
    let experts = if b.snap.contains(&fused) {
        let gu = b.snap.get(&fused)?;
        let dn = b.t(&format!("{m}experts.down_proj"))?;
        if gu.shape().first() != Some(&e) {
            return Err(ModelError::Mismatch {
                field: experts_field.into(),
                reason: format!("config says {e} experts but `{fused}` has shape {:?}", gu.shape()),
            });
        }
        gu.expect_shape(&[e, 2 * i, d])?;
        dn.expect_shape(&[e, d, i])?;
        (0..e)
            .map(|x| -> Result<Expert, ModelError> {
                Ok(Expert {
                    gate: Linear::slice(gu, x * 2 * i, i, d)?,
                    up: Linear::slice(gu, x * 2 * i + i, i, d)?,
                    down: Linear::slice(dn, x * d, d, i)?,
                })
            })
            .collect::<Result<Vec<_>, _>>()?
    } else {
        let extra = b.name(&format!("{m}experts.{e}.gate_proj.weight"));
        if b.snap.contains(&extra) {
            return Err(ModelError::Mismatch {
                field: experts_field.into(),
                reason: format!("config says {e} experts but the checkpoint also has `{extra}`"),
            });
        }
        (0..e)
            .map(|x| -> Result<Expert, ModelError> {
                let ep = format!("{m}experts.{x}.");
                Ok(Expert {
                    gate: b.lin(&format!("{ep}gate_proj.weight"), i, d)?,
                    up: b.lin(&format!("{ep}up_proj.weight"), i, d)?,
                    down: b.lin(&format!("{ep}down_proj.weight"), d, i)?,
                })
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    let s = format!("{m}shared_expert.");
    Ok(MoeWeights {
        router,
        experts,
        shared: Expert {
            gate: b.lin(&format!("{s}gate_proj.weight"), si, d)?,
            up: b.lin(&format!("{s}up_proj.weight"), si, d)?,
            down: b.lin(&format!("{s}down_proj.weight"), d, si)?,
        },
        shared_gate: b.lin(&format!("{m}shared_expert_gate.weight"), 1, d)?,
    })
}

/// Opens a snapshot folder: config, generation config and weights.
///
/// # Errors
/// [`ModelError`] naming the file, tensor or config field.
pub fn open_dir(dir: &Path) -> Result<(TextConfig, Weights), ModelError> {
    if !dir.is_dir() {
        return Err(ModelError::NotADir(dir.to_path_buf()));
    }
    let cfg = TextConfig::from_dir(dir)?;
    let snap = Snapshot::open(dir)?;
    let w = Weights::bind(&snap, &cfg)?;
    Ok((cfg, w))
}
