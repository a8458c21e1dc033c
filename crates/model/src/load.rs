//! Binding checkpoint tensors to the model's structure, with every shape checked at load.
//!
//! Tensor names are those of the Hugging Face releases (docs/MODEL.md §2): decoder tensors under
//! `model.language_model.` (published multimodal checkpoint) or `model.` (text-only exports),
//! `lm_head.weight` at the top, routed experts either fused (`mlp.experts.gate_up_proj`
//! [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]) or one tensor per expert
//! (`mlp.experts.{e}.{gate,up,down}_proj.weight`). `model.visual.*` and `mtp.*` are not read.

use std::path::Path;

use quant::QuantSpec;
use spec::{LayerKind, TextConfig};
use weights::{DType, LoadError, Snapshot, Tensor};

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
    /// How the checkpoint names and stores its tensors.
    pub layout: Layout,
}

/// How a snapshot names and stores its tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Prefix of decoder tensors: `model.language_model.` (published), `model.` (text-only
    /// export) or `language_model.model.` (mlx-lm's saved names).
    pub prefix: String,
    /// Name of the LM head tensor (without `.weight` for quantized heads).
    pub lm_head: String,
    /// mlx-lm's `sanitize` was applied: zero-centred norms are stored as `1 + w`, conv1d as
    /// [C, K, 1], routed experts stacked as `mlp.switch_mlp.{gate,up,down}_proj`.
    pub mlx_sanitized: bool,
}

struct Binder<'a> {
    snap: &'a Snapshot,
    layout: Layout,
    cfg: &'a TextConfig,
}

impl Binder<'_> {
    fn name(&self, rest: &str) -> String {
        format!("{}{rest}", self.layout.prefix)
    }

    fn t(&self, rest: &str) -> Result<&Tensor, LoadError> {
        self.snap.get(&self.name(rest))
    }

    /// A linear layer by full module path (without `.weight`): dense float, or an MLX
    /// quantized triple (`.weight` U32 + `.scales` + `.biases`).
    fn lin_full(&self, module: &str, rows: usize, cols: usize) -> Result<Linear, ModelError> {
        let (packed, q) = self.quant_triple(module)?;
        match q {
            None => Ok(Linear::new(packed, rows, cols)?),
            Some((scales, biases, spec)) => {
                let shape = quant::check_tensor_shapes(spec, packed.shape(), Some(scales.shape()), Some(biases.shape()))
                    .map_err(|e| quant_err(module, packed, e))?;
                if shape.experts.is_some() || shape.rows != rows || shape.cols != cols {
                    return Err(LoadError::ShapeMismatch {
                        tensor: packed.name().to_string(),
                        file: packed.file().to_path_buf(),
                        expected: vec![rows, spec.words_per_row(cols)],
                        found: packed.shape().to_vec(),
                    }
                    .into());
                }
                Ok(Linear::quant(packed, scales, biases, spec, 0, rows, cols)?)
            }
        }
    }

    fn lin(&self, module: &str, rows: usize, cols: usize) -> Result<Linear, ModelError> {
        self.lin_full(&self.name(module), rows, cols)
    }

    /// `module.weight`, and for quantized modules its scales, biases and spec (bits from the
    /// packed width, group size from the scales, both checked against the config's
    /// `quantization` section).
    #[allow(clippy::type_complexity)]
    fn quant_triple(&self, module: &str) -> Result<(&Tensor, Option<(&Tensor, &Tensor, QuantSpec)>), ModelError> {
        let w = self.snap.get(&format!("{module}.weight"))?;
        if w.dtype()? != DType::U32 {
            if self.snap.contains(&format!("{module}.scales")) {
                return Err(ModelError::Mismatch {
                    field: "quantization".into(),
                    reason: format!("`{module}.scales` exists but `{module}.weight` is {}, not packed U32", w.dtype()?),
                });
            }
            return Ok((w, None));
        }
        let scales = self.snap.get(&format!("{module}.scales"))?;
        let biases = self.snap.get(&format!("{module}.biases"))?;
        for t in [scales, biases] {
            if t.dtype()? != DType::BF16 {
                return Err(LoadError::DTypeMismatch {
                    tensor: t.name().to_string(),
                    file: t.file().to_path_buf(),
                    expected: "BF16".into(),
                    found: t.dtype()?.to_string(),
                }
                .into());
            }
        }
        let qcfg = self.cfg.quantization.as_ref().ok_or_else(|| ModelError::Mismatch {
            field: "quantization".into(),
            reason: format!("`{module}.weight` is quantized (U32) but config.json has no `quantization` section"),
        })?;
        let (bits, gs) = qcfg.for_module(module);
        let spec = QuantSpec::new(bits, gs).map_err(|e| quant_err(module, w, e))?;
        Ok((w, Some((scales, biases, spec))))
    }

    fn vec(&self, rest: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        self.t(rest)?.expect_shape(shape)?.to_f32()
    }

    /// A zero-centred norm weight `w` (the model computes `1 + w`); mlx-sanitized checkpoints
    /// store `1 + w`, which is undone here in f32.
    fn znorm(&self, rest: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let mut v = self.vec(rest, shape)?;
        if self.layout.mlx_sanitized {
            v.iter_mut().for_each(|x| *x -= 1.0);
        }
        Ok(v)
    }
}

fn quant_err(module: &str, t: &Tensor, e: quant::QuantError) -> ModelError {
    ModelError::Mismatch {
        field: "quantization".into(),
        reason: format!("`{module}` in {}: {e}", t.file().display()),
    }
}

/// Works out how a snapshot names its tensors (see [`Layout`]).
///
/// # Errors
/// [`ModelError::Load`] naming the embedding tensor when none of the known namings is present.
pub fn detect_layout(snap: &Snapshot, cfg: &TextConfig) -> Result<Layout, ModelError> {
    let preferred = cfg.tensor_prefix();
    let candidates = [preferred, "model.language_model.", "model.", "language_model.model."];
    let prefix = candidates
        .iter()
        .find(|p| snap.contains(&format!("{p}embed_tokens.weight")))
        .ok_or_else(|| LoadError::MissingTensor {
            tensor: format!("{preferred}embed_tokens.weight"),
            where_: format!("{} (also tried the model.*, model.language_model.* and language_model.model.* namings)", snap.dir().display()),
        })?
        .to_string();
    let lm_head = if prefix == "language_model.model." { "language_model.lm_head" } else { "lm_head" }.to_string();
    // mlx-lm's own test: conv1d weights whose last dim is 1 have been sanitized, and then the
    // zero-centred norms carry the +1 (mlx_lm/models/qwen3_5.py `sanitize`).
    let first_gdn = cfg.layer_types.iter().position(|k| *k == LayerKind::LinearAttention);
    let mlx_sanitized = match first_gdn {
        Some(l) => snap
            .get(&format!("{prefix}layers.{l}.linear_attn.conv1d.weight"))
            .map(|t| t.shape().len() == 3 && t.shape()[2] == 1 && cfg.linear_conv_kernel_dim > 1)
            .unwrap_or(false),
        None => false,
    };
    Ok(Layout { prefix, lm_head, mlx_sanitized })
}

impl Weights {
    /// Binds every tensor the text model needs, checking shapes and dtypes against `cfg`.
    ///
    /// # Errors
    /// [`ModelError::Load`] for a missing tensor, wrong shape or dtype (naming tensor and file);
    /// [`ModelError::Mismatch`] when the checkpoint disagrees with a config field (expert count,
    /// layer pattern), naming the field.
    pub fn bind(snap: &Snapshot, cfg: &TextConfig) -> Result<Self, ModelError> {
        let layout = detect_layout(snap, cfg)?;
        let b = Binder { snap, layout, cfg };
        let (v, d) = (cfg.vocab_size, cfg.hidden_size);
        let embed = b.lin("embed_tokens", v, d)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            b.lin_full(&b.layout.lm_head.clone(), v, d)?
        };
        let final_norm = b.znorm("norm.weight", &[d])?;
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
        Ok(Weights { embed, lm_head, final_norm, layers, layout: b.layout })
    }
}

fn bind_layer(b: &Binder<'_>, cfg: &TextConfig, l: usize, kind: LayerKind) -> Result<LayerWeights, ModelError> {
    let d = cfg.hidden_size;
    let p = format!("layers.{l}.");
    let has_gdn = b.snap.contains(&b.name(&format!("{p}linear_attn.in_proj_qkv.weight")));
    let has_attn = b.snap.contains(&b.name(&format!("{p}self_attn.q_proj.weight")));
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
                in_proj_qkv: b.lin(&format!("{a}in_proj_qkv"), conv_dim, d)?,
                in_proj_z: b.lin(&format!("{a}in_proj_z"), nv * dv, d)?,
                in_proj_b: b.lin(&format!("{a}in_proj_b"), nv, d)?,
                in_proj_a: b.lin(&format!("{a}in_proj_a"), nv, d)?,
                // [C, 1, K] as published, [C, K, 1] after mlx-lm's sanitize: same memory order.
                conv1d: b.vec(&format!("{a}conv1d.weight"), &if b.layout.mlx_sanitized { [conv_dim, kk, 1] } else { [conv_dim, 1, kk] })?,
                a_neg_exp: a_log.iter().map(|x| -x.exp()).collect(),
                dt_bias: b.vec(&format!("{a}dt_bias"), &[nv])?,
                norm: b.vec(&format!("{a}norm.weight"), &[dv])?,
                out_proj: b.lin(&format!("{a}out_proj"), d, nv * dv)?,
            })
        }
        LayerKind::FullAttention => {
            let (nq, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
            let a = format!("{p}self_attn.");
            Mixer::Attn(AttnWeights {
                q_proj: b.lin(&format!("{a}q_proj"), nq * 2 * hd, d)?,
                k_proj: b.lin(&format!("{a}k_proj"), nkv * hd, d)?,
                v_proj: b.lin(&format!("{a}v_proj"), nkv * hd, d)?,
                o_proj: b.lin(&format!("{a}o_proj"), d, nq * hd)?,
                q_norm: b.znorm(&format!("{a}q_norm.weight"), &[hd])?,
                k_norm: b.znorm(&format!("{a}k_norm.weight"), &[hd])?,
            })
        }
    };
    Ok(LayerWeights {
        input_norm: b.znorm(&format!("{p}input_layernorm.weight"), &[d])?,
        post_norm: b.znorm(&format!("{p}post_attention_layernorm.weight"), &[d])?,
        mixer,
        moe: bind_moe(b, cfg, l)?,
    })
}

fn bind_moe(b: &Binder<'_>, cfg: &TextConfig, l: usize) -> Result<MoeWeights, ModelError> {
    let (d, e, i, si) = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size);
    let m = format!("layers.{l}.mlp.");
    let experts_field = if cfg.nested { "text_config.num_experts" } else { "num_experts" };
    let expert_count_error = |t: &Tensor, found: usize| ModelError::Mismatch {
        field: experts_field.into(),
        reason: format!("config says {e} experts but `{}` in {} has {found}", t.name(), t.file().display()),
    };
    let router_t = b.t(&format!("{m}gate.weight"))?;
    if router_t.shape().len() == 2 && router_t.shape()[0] != e {
        return Err(expert_count_error(router_t, router_t.shape()[0]));
    }
    let router = b.lin(&format!("{m}gate"), e, d)?;
    let fused = b.name(&format!("{m}experts.gate_up_proj"));
    let switch = b.name(&format!("{m}switch_mlp.gate_proj"));
    let experts = if b.snap.contains(&fused) {
        // Published bf16 release: [E, 2I, H] (gate rows first) and [E, H, I].
        let gu = b.snap.get(&fused)?;
        let dn = b.t(&format!("{m}experts.down_proj"))?;
        if let Some(&found) = gu.shape().first().filter(|&&x| x != e) {
            return Err(expert_count_error(gu, found));
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
    } else if b.snap.contains(&format!("{switch}.weight")) {
        // mlx-lm's stacked experts: [E, rows, cols] each, dense or quantized.
        let stacked = |proj: &str, rows: usize, cols: usize| -> Result<Vec<Linear>, ModelError> {
            let module = b.name(&format!("{m}switch_mlp.{proj}"));
            let (w, q) = b.quant_triple(&module)?;
            if let Some(&found) = w.shape().first().filter(|&&x| x != e) {
                return Err(expert_count_error(w, found));
            }
            match q {
                None => {
                    w.expect_shape(&[e, rows, cols])?;
                    (0..e).map(|x| Ok(Linear::slice(w, x * rows, rows, cols)?)).collect()
                }
                Some((sc, bi, spec)) => {
                    let shape = quant::check_tensor_shapes(spec, w.shape(), Some(sc.shape()), Some(bi.shape()))
                        .map_err(|err| quant_err(&module, w, err))?;
                    if shape.experts != Some(e) || shape.rows != rows || shape.cols != cols {
                        return Err(LoadError::ShapeMismatch {
                            tensor: w.name().to_string(),
                            file: w.file().to_path_buf(),
                            expected: vec![e, rows, spec.words_per_row(cols)],
                            found: w.shape().to_vec(),
                        }
                        .into());
                    }
                    (0..e).map(|x| Ok(Linear::quant(w, sc, bi, spec, x * rows, rows, cols)?)).collect()
                }
            }
        };
        let gate = stacked("gate_proj", i, d)?;
        let up = stacked("up_proj", i, d)?;
        let down = stacked("down_proj", d, i)?;
        gate.into_iter().zip(up).zip(down).map(|((gate, up), down)| Expert { gate, up, down }).collect()
    } else {
        // One tensor per expert (FP8 release naming, transformers' save_pretrained).
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
                    gate: b.lin(&format!("{ep}gate_proj"), i, d)?,
                    up: b.lin(&format!("{ep}up_proj"), i, d)?,
                    down: b.lin(&format!("{ep}down_proj"), d, i)?,
                })
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    let s = format!("{m}shared_expert.");
    Ok(MoeWeights {
        router,
        experts,
        shared: Expert {
            gate: b.lin(&format!("{s}gate_proj"), si, d)?,
            up: b.lin(&format!("{s}up_proj"), si, d)?,
            down: b.lin(&format!("{s}down_proj"), d, si)?,
        },
        shared_gate: b.lin(&format!("{m}shared_expert_gate"), 1, d)?,
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
