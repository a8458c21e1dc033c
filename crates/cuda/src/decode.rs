//! The whole decode step on the GPU: weights uploaded once ([`CudaModel`]), per-sequence state
//! and activations on the device ([`CudaSession`]), and one step captured as a CUDA graph that is
//! replayed token after token. The sampled token never leaves the GPU between steps: the last
//! kernel of a step writes the greedy token into the device-side token history and advances the
//! device-side position, and the next replay's first kernel embeds it.
//!
//! Step (MODEL.md §3.3), every tensor f32 on the device except the bf16 KV cache:
//!
//! ```text
//! x = embed[ids[pos]]
//! for each layer:
//!     u = ZNorm(x; input_layernorm)
//!     GDN:  proj = [W_qkv|W_z|W_b|W_a]·u ; o = gdn_decode_step(proj, conv/S state) ; h = x + W_out·o
//!     attn: proj = [W_q|W_k|W_v]·u       ; o = attn_decode_step(proj, KV cache)     ; h = x + W_o·o
//!     u = ZNorm(h; post_attention_layernorm)
//!     x = h + MoE(u)
//! logits = lm_head · ZNorm(x; norm) ; ids[pos+1] = argmax(logits) (or sampled: set_sampling) ; pos += 1
//! ```
//!
//! Prompt tokens before the last run a second graph without the final norm, LM head and argmax
//! (only `pos += 1`). This token-by-token prompt pass is correct but is not the batched prefill
//! (issue 4 item 3); it exists so generation works end to end.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr};
use model::linear::Linear;
use model::load::{Mixer, Weights};
use quant::{Bits, QMatRef};
use spec::production as p;
use spec::{LayerKind, TextConfig};

use crate::attention::{AttnScratch, ATTN_PROJ};
use crate::gdn::{GdnScratch, GDN_PROJ};
use crate::graph::StepGraph;
use crate::moe::{DeviceMoe, MoeScratch};
use crate::{CudaContext, CudaError, DeviceQMat, L2Prefetch};

/// Several quantized matrices with the same input that one decode step applies to the same
/// vector, stacked by rows into as few device matrices as their formats allow (one when all
/// parts share bits and group size). Output rows keep the parts' order.
pub struct StackedQMat {
    /// `(matrix, first output row)` per run of parts with one format.
    pub runs: Vec<(DeviceQMat, usize)>,
    /// Total output rows.
    pub rows: usize,
}

impl StackedQMat {
    /// Uploads `parts` (all `[rows_i, cols]` with one `cols`), merging consecutive parts of the
    /// same quantization format.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a dense (unquantized) part, naming it, or as
    /// [`CudaContext::upload_qmat_rows`].
    pub fn upload(cx: &CudaContext, parts: &[(&str, &Linear)]) -> Result<Self, CudaError> {
        let mut refs: Vec<QMatRef<'_>> = Vec::with_capacity(parts.len());
        for (name, l) in parts {
            refs.push(quantized(name, l)?);
        }
        let mut runs = Vec::new();
        let mut row = 0;
        for r in run_ranges(&refs) {
            let m = cx.upload_qmat_rows(&refs[r])?;
            let rows = m.rows;
            runs.push((m, row));
            row += rows;
        }
        Ok(StackedQMat { runs, rows: row })
    }

    /// Adds the staged copy ([`CudaContext::stage_qmat`]) to every 4-bit run that has none yet;
    /// `parts` as given to [`Self::upload`]. Returns the runs staged.
    ///
    /// # Errors
    /// As [`Self::upload`] and [`CudaContext::stage_qmat`].
    pub fn stage(&mut self, cx: &CudaContext, parts: &[(&str, &Linear)]) -> Result<usize, CudaError> {
        let mut refs: Vec<QMatRef<'_>> = Vec::with_capacity(parts.len());
        for (name, l) in parts {
            refs.push(quantized(name, l)?);
        }
        let mut n = 0;
        for ((m, _), r) in self.runs.iter_mut().zip(run_ranges(&refs)) {
            if m.bits == Bits::B4 && m.staged.is_none() {
                cx.stage_qmat(m, &refs[r])?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// `out[0..rows] = W·x` with one GEMV per run.
    ///
    /// # Errors
    /// As [`CudaContext::gemv`].
    pub fn gemv(&self, cx: &CudaContext, out: &mut CudaViewMut<'_, f32>, x: &CudaView<'_, f32>) -> Result<(), CudaError> {
        for (m, r0) in &self.runs {
            let mut o = out.slice_mut(*r0..*r0 + m.rows);
            cx.gemv(&mut o, m, x)?;
        }
        Ok(())
    }

    /// `out[0..rows] = W·rms_norm(x, norm_w)` with one fused GEMV per run
    /// ([`CudaContext::gemv_norm`]). `x`, `norm_w`: `[D_MODEL]` f32, 16-byte aligned; `out`:
    /// `[rows]` f32.
    ///
    /// # Errors
    /// As [`CudaContext::gemv_norm`].
    pub fn gemv_norm(
        &self,
        cx: &CudaContext,
        out: &mut CudaViewMut<'_, f32>,
        x: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
    ) -> Result<(), CudaError> {
        for (m, r0) in &self.runs {
            let mut o = out.slice_mut(*r0..*r0 + m.rows);
            cx.gemv_norm(&mut o, m, x, norm_w)?;
        }
        Ok(())
    }

    /// [`Self::gemv_norm`] of the residual stream held as f64 sums
    /// ([`CudaContext::gemv_norm_xd`]): every run reads `xd` and stores the same f32 `xout`.
    ///
    /// # Errors
    /// As [`CudaContext::gemv_norm_xd`].
    pub fn gemv_norm_xd(
        &self,
        cx: &CudaContext,
        out: &mut CudaViewMut<'_, f32>,
        xd: &CudaView<'_, f64>,
        xout: &mut CudaViewMut<'_, f32>,
        norm_w: &CudaView<'_, f32>,
    ) -> Result<(), CudaError> {
        for (m, r0) in &self.runs {
            let mut o = out.slice_mut(*r0..*r0 + m.rows);
            cx.gemv_norm_xd(&mut o, m, xd, xout, norm_w)?;
        }
        Ok(())
    }

    /// Bytes of weights one application reads.
    pub fn stored_bytes(&self) -> usize {
        self.runs.iter().map(|(m, _)| m.stored_bytes()).sum()
    }
}

/// The runs of consecutive parts with one format (spec and columns) that
/// [`StackedQMat::upload`] stacks into one device matrix each.
fn run_ranges(refs: &[QMatRef<'_>]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < refs.len() {
        let mut j = i + 1;
        while j < refs.len() && refs[j].spec == refs[i].spec && refs[j].cols == refs[i].cols {
            j += 1;
        }
        out.push(i..j);
        i = j;
    }
    out
}

/// The quantized view of a weight, or an error naming it.
fn quantized<'a>(name: &str, l: &'a Linear) -> Result<QMatRef<'a>, CudaError> {
    l.qref().ok_or_else(|| {
        CudaError::Unsupported(format!(
            "{name} is stored as floats; the CUDA backend runs MLX-layout quantized checkpoints \
             (make one with `calla convert --bits 4|8`)"
        ))
    })
}

/// Adds the group-major scales and codes the prefill GEMMs read
/// ([`CudaContext::add_group_major`], [`CudaContext::add_group_major_codes`]) to a layer's input
/// projection (every run) and output projection: ~1.1 times their 4-bit codes' bytes again
/// (~0.7 GB for the full model); the decode GEMVs read the MLX layout. With
/// [`crate::gemm::default_gemm_bf16_weights`] also their bf16 copies
/// ([`CudaContext::add_bf16_weights`]: four times the 4-bit codes' bytes, ~2.5 GB).
fn add_group_major(cx: &CudaContext, in_proj: &mut StackedQMat, out_proj: &mut DeviceQMat) -> Result<(), CudaError> {
    let bf16 = crate::gemm::default_gemm_bf16_weights();
    for m in in_proj.runs.iter_mut().map(|(m, _)| m).chain([out_proj]) {
        cx.add_group_major(m)?;
        cx.add_group_major_codes(m)?;
        if bf16 {
            cx.add_bf16_weights(m)?;
        }
    }
    Ok(())
}

/// One layer's token mixer on the device.
#[allow(clippy::large_enum_variant)] // one per layer, never moved in a hot path
pub enum DeviceMixer {
    /// Gated DeltaNet: stacked `in_proj` (qkv | z | b | a), conv taps, gates, gated-norm
    /// weight, `out_proj`.
    Gdn {
        in_proj: StackedQMat,
        /// `in_proj`'s q|k, v, z rows restacked for [`CudaContext::gdn_in_step`]
        /// ([`CudaModel::upload_gdn_in_step`]; `None` until then).
        in_step: Option<crate::gdn::GdnInProj>,
        /// `out_proj` split over the step's clusters with the router's `B` for
        /// [`CudaContext::gdn_step_out`] ([`CudaModel::upload_gdn_out_split`]; `None` until then).
        out_split: Option<crate::gdn::GdnOutSplit>,
        conv_w: CudaSlice<f32>,
        a_neg_exp: CudaSlice<f32>,
        dt_bias: CudaSlice<f32>,
        norm: CudaSlice<f32>,
        out_proj: DeviceQMat,
    },
    /// Gated attention: stacked `q|k|v`, q/k norms, `o_proj`.
    Attn {
        qkv: StackedQMat,
        q_norm: CudaSlice<f32>,
        k_norm: CudaSlice<f32>,
        o_proj: DeviceQMat,
    },
}

impl DeviceMixer {
    /// The stacked input projection: GDN `in_proj` (qkv | z | b | a) or attention `q|k|v`.
    pub fn input_projection(&self) -> &StackedQMat {
        match self {
            DeviceMixer::Gdn { in_proj, .. } => in_proj,
            DeviceMixer::Attn { qkv, .. } => qkv,
        }
    }
}

/// The weights with which layer `l` runs its GDN input projection and step as one launch
/// ([`CudaContext::gdn_in_step`]: its restacked rows and its stacked `in_proj`), where `on`
/// (the step fuses its norms and [`CudaSession::set_gdn_in_step`] asks for it) and the layer
/// has them ([`CudaModel::upload_gdn_in_step`]) in one stacked run; `None` otherwise.
fn in_step_weights(l: &DeviceLayer, on: bool) -> Option<(&crate::gdn::GdnInProj, &DeviceQMat)> {
    match &l.mixer {
        DeviceMixer::Gdn { in_step: Some(w), in_proj, .. } if on && in_proj.runs.len() == 1 => Some((w, &in_proj.runs[0].0)),
        _ => None,
    }
}

/// One decoder layer on the device.
pub struct DeviceLayer {
    /// `input_layernorm` weight [D_MODEL] (zero-centred).
    pub input_norm: CudaSlice<f32>,
    /// `post_attention_layernorm` weight [D_MODEL].
    pub post_norm: CudaSlice<f32>,
    /// Token mixer.
    pub mixer: DeviceMixer,
    /// MoE block.
    pub moe: DeviceMoe,
}

/// The whole model's weights on the device.
pub struct CudaModel {
    /// Unique per upload: a session's captured graphs hold this model's device pointers and
    /// replay only with the model they were captured from.
    id: u64,
    /// The checkpoint's config.
    pub cfg: TextConfig,
    /// `embed_tokens` [vocab, D_MODEL], quantized.
    pub embed: DeviceQMat,
    /// `lm_head` [vocab, D_MODEL], quantized.
    pub lm_head: DeviceQMat,
    /// Final norm weight [D_MODEL].
    pub final_norm: CudaSlice<f32>,
    /// Decoder layers.
    pub layers: Vec<DeviceLayer>,
    /// RoPE inverse frequencies [rotary_dim / 2] (MODEL.md §3.6 step 3).
    pub inv_freq: CudaSlice<f32>,
    /// Logit rows `>= vocab_limit` are never picked (the padding rows past the tokenizer's ids).
    pub vocab_limit: usize,
    /// Bytes of weights one decode step reads (non-expert weights, the chosen experts, one
    /// embedding row, the LM head), for the roofline.
    pub bytes_per_token: usize,
}

/// Source of [`CudaModel`] ids (unique per upload or change of the device weights).
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Checks that `cfg` has the production widths the kernels are compiled for (any number of
/// layers in the published 3:1 pattern or any other order of the two kinds is fine).
///
/// # Errors
/// [`CudaError::Unsupported`] naming the first config field that differs.
pub fn check_config(cfg: &TextConfig) -> Result<(), CudaError> {
    let checks: [(&str, usize, usize); 14] = [
        ("hidden_size", cfg.hidden_size, p::D_MODEL),
        ("num_attention_heads", cfg.num_attention_heads, p::N_Q_HEADS),
        ("num_key_value_heads", cfg.num_key_value_heads, p::N_KV_HEADS),
        ("head_dim", cfg.head_dim, p::HEAD_DIM),
        ("partial_rotary_factor (rotary dim)", cfg.rotary_dim(), p::ROTARY_DIM),
        ("linear_num_key_heads", cfg.linear_num_key_heads, p::N_K_HEADS),
        ("linear_num_value_heads", cfg.linear_num_value_heads, p::N_V_HEADS),
        ("linear_key_head_dim", cfg.linear_key_head_dim, p::D_K),
        ("linear_value_head_dim", cfg.linear_value_head_dim, p::D_V),
        ("linear_conv_kernel_dim", cfg.linear_conv_kernel_dim, p::CONV_KERNEL),
        ("num_experts", cfg.num_experts, p::N_EXPERTS),
        ("num_experts_per_tok", cfg.num_experts_per_tok, p::TOP_K),
        ("moe_intermediate_size", cfg.moe_intermediate_size, p::D_EXPERT),
        ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size, p::D_SHARED_EXPERT),
    ];
    for (field, got, want) in checks {
        if got != want {
            return Err(CudaError::Unsupported(format!(
                "config field {field} is {got}; the CUDA kernels are built for the published \
                 model's {want}"
            )));
        }
    }
    if (cfg.rms_norm_eps - p::RMS_EPS).abs() > f32::EPSILON * p::RMS_EPS {
        return Err(CudaError::Unsupported(format!(
            "config field rms_norm_eps is {}; the CUDA kernels are built for {}",
            cfg.rms_norm_eps,
            p::RMS_EPS
        )));
    }
    Ok(())
}

impl CudaModel {
    /// Checks that `w` has this model's layers and gives the model a new id before its device
    /// weights change: sessions' captured graphs hold the old launches, and changing the id before
    /// anything else means that an error part of the way through leaves no graph that could replay
    /// them.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `w` has other layers than this model.
    fn begin_weight_change(&mut self, w: &Weights) -> Result<(), CudaError> {
        if w.layers.len() != self.layers.len() {
            return Err(CudaError::Unsupported(format!("weights of {} layers for a model of {}", w.layers.len(), self.layers.len())));
        }
        self.id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Adds the staged copy ([`CudaContext::stage_qmat`]) of every 4-bit input and output
    /// projection that has none yet, so that the decode step's fused-norm input projections and
    /// router-fold output projections read it by bulk copies (TMA) while
    /// [`CudaContext::set_gemv_staged`] is on (the default); the other GEMV forms (separate
    /// norms, the output projection without the fold) keep reading the MLX layout. About 720 MB
    /// more at 4 bits for the full model. The same bits as the MLX layout; measured slower in
    /// the decode step on the H200 (docs/CUDA.md), hence not done by [`Self::upload`]. Returns
    /// the matrices staged by this call.
    ///
    /// # Errors
    /// As [`CudaContext::stage_qmat`]; [`CudaError::Unsupported`] when `w` does not match this
    /// model's layers.
    pub fn stage_gemvs(&mut self, cx: &CudaContext, w: &Weights) -> Result<usize, CudaError> {
        self.begin_weight_change(w)?;
        let mut n = 0;
        for (l, (dl, lw)) in self.layers.iter_mut().zip(&w.layers).enumerate() {
            let name = |s: &str| format!("layers.{l}.{s}");
            match (&mut dl.mixer, &lw.mixer) {
                (DeviceMixer::Gdn { in_proj, out_proj, .. }, Mixer::Gdn(g)) => {
                    let (qkv, z, b, a) = (name("linear_attn.in_proj_qkv"), name("linear_attn.in_proj_z"), name("linear_attn.in_proj_b"), name("linear_attn.in_proj_a"));
                    n += in_proj.stage(cx, &[(&qkv, &g.in_proj_qkv), (&z, &g.in_proj_z), (&b, &g.in_proj_b), (&a, &g.in_proj_a)])?;
                    if out_proj.bits == Bits::B4 && out_proj.staged.is_none() {
                        cx.stage_qmat(out_proj, &[quantized(&name("linear_attn.out_proj"), &g.out_proj)?])?;
                        n += 1;
                    }
                }
                (DeviceMixer::Attn { qkv, o_proj, .. }, Mixer::Attn(a)) => {
                    let (q, k, v) = (name("self_attn.q_proj"), name("self_attn.k_proj"), name("self_attn.v_proj"));
                    n += qkv.stage(cx, &[(&q, &a.q_proj), (&k, &a.k_proj), (&v, &a.v_proj)])?;
                    if o_proj.bits == Bits::B4 && o_proj.staged.is_none() {
                        cx.stage_qmat(o_proj, &[quantized(&name("self_attn.o_proj"), &a.o_proj)?])?;
                        n += 1;
                    }
                }
                _ => return Err(CudaError::Unsupported(format!("layer {l}: the weights' mixer differs from the model's"))),
            }
        }
        Ok(n)
    }

    /// Adds the staged copy ([`CudaContext::stage_qmat`]) of the LM head when it is 4-bit and
    /// has none yet, so that the step's final norm + LM head GEMV (`gemv_norm`, 248,320 rows
    /// at full size, the step's largest single read) streams it by bulk copies (TMA) while
    /// [`CudaContext::set_gemv_staged`] is on (the default). About 270 MB more at full size
    /// (the MLX-layout copy stays for the other GEMV forms). The same bits. Returns whether it
    /// staged the LM head: `false`, and nothing checked or changed, for an LM head that is not
    /// 4-bit with `D_MODEL` columns or is staged already.
    ///
    /// # Errors
    /// As [`CudaContext::stage_qmat`]; [`CudaError::Unsupported`] when `w` does not match this
    /// model's layers (checked only when it stages).
    pub fn stage_lm_head(&mut self, cx: &CudaContext, w: &Weights) -> Result<bool, CudaError> {
        if self.lm_head.bits != Bits::B4 || self.lm_head.cols != p::D_MODEL || self.lm_head.staged.is_some() {
            return Ok(false);
        }
        self.begin_weight_change(w)?;
        cx.stage_qmat(&mut self.lm_head, &[quantized("lm_head", &w.lm_head)?])?;
        Ok(true)
    }

    /// Restacks every GDN layer's input projection for [`CudaContext::gdn_in_step`] (the input
    /// projection and the step as one launch; [`CudaSession::set_gdn_in_step`]) and copies it to
    /// the device: 13.5 MB per layer at 4 bits, beside the stacked matrix. A layer whose
    /// `in_proj` parts differ in width, or whose clusters would not all fit on the device at once
    /// ([`CudaContext::gdn_in_step_fits`]; the 8-bit kernel on the H200), keeps the two launches.
    /// Measured slower than the two launches on the H200 (docs/CUDA.md), hence not done by
    /// [`Self::upload`]. Returns the layers that have it.
    ///
    /// # Errors
    /// As [`CudaContext::upload_gdn_in_proj`]; [`CudaError::Unsupported`] when `w` has other
    /// layers than this model.
    pub fn upload_gdn_in_step(&mut self, cx: &CudaContext, w: &Weights) -> Result<usize, CudaError> {
        self.begin_weight_change(w)?;
        let mut n = 0;
        for (dl, lw) in self.layers.iter_mut().zip(&w.layers) {
            if let (DeviceMixer::Gdn { in_proj, in_step, .. }, Mixer::Gdn(g)) = (&mut dl.mixer, &lw.mixer) {
                if in_step.is_some() {
                    n += 1; // kept: replacing it would free a buffer graphs may still read
                    continue;
                }
                // one run: b and a share the width of qkv and z (the kernel reads them with it)
                if let (1, Some(mq), Some(mz)) = (in_proj.runs.len(), g.in_proj_qkv.qref(), g.in_proj_z.qref()) {
                    if mq.spec.bits == in_proj.runs[0].0.bits && cx.gdn_in_step_fits(mq.spec.bits)? {
                        *in_step = Some(cx.upload_gdn_in_proj(mq, mz)?);
                        n += 1;
                    }
                }
            }
        }
        Ok(n)
    }

    /// Builds every GDN layer's output projection split over the step's clusters
    /// ([`CudaContext::upload_gdn_out_split`], with `B` = [`crate::gdn::router_out_product`] of
    /// the layer's router, shared gate, post-attention norm and `out_proj`) for
    /// [`CudaSession::set_gdn_out_split`]: 9.0 MB per layer beside the weights the rest of the
    /// model reads, and ~2.2 G multiply-adds per layer on the CPU. Layers whose `out_proj` is not
    /// 4-bit are left out. Returns the layers that have it.
    ///
    /// # Errors
    /// As [`CudaContext::upload_gdn_out_split`] and [`crate::gdn::router_out_product`];
    /// [`CudaError::Unsupported`] when `w` has other layers than this model.
    pub fn upload_gdn_out_split(&mut self, cx: &CudaContext, w: &Weights) -> Result<usize, CudaError> {
        self.begin_weight_change(w)?;
        let mut n = 0;
        for (i, (dl, lw)) in self.layers.iter_mut().zip(&w.layers).enumerate() {
            if let (DeviceMixer::Gdn { out_split, .. }, Mixer::Gdn(g)) = (&mut dl.mixer, &lw.mixer) {
                if out_split.is_some() {
                    n += 1; // kept: replacing it would free a buffer graphs may still read
                    continue;
                }
                let name = |s: &str| format!("model.layers.{i}.{s}");
                let wo = quantized(&name("linear_attn.out_proj"), &g.out_proj)?;
                if wo.spec.bits != Bits::B4 {
                    continue;
                }
                let router = quantized(&name("mlp.gate"), &lw.moe.router)?;
                let shared_gate = quantized(&name("mlp.shared_expert_gate"), &lw.moe.shared_gate)?;
                let in_layer = |e: CudaError| match e {
                    CudaError::Unsupported(m) => CudaError::Unsupported(format!("model.layers.{i}: {m}")),
                    e => e,
                };
                let b = crate::gdn::router_out_product(router, shared_gate, &lw.post_norm, wo).map_err(in_layer)?;
                *out_split = Some(cx.upload_gdn_out_split(wo, &b).map_err(in_layer)?);
                n += 1;
            }
        }
        Ok(n)
    }

    /// Uploads a loaded model's weights (an MLX-layout quantized checkpoint, as loaded by
    /// `model::Model::open`).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a config the kernels are not built for (naming the field)
    /// or a float (unquantized) weight (naming it); driver errors (e.g. out of memory).
    pub fn upload(cx: &CudaContext, cfg: &TextConfig, w: &Weights, vocab_limit: usize) -> Result<Self, CudaError> {
        check_config(cfg)?;
        let f = |v: &[f32]| cx.upload_f32(v);
        let embed = cx.upload_qmat(quantized("embed_tokens", &w.embed)?)?;
        let lm_head = cx.upload_qmat(quantized("lm_head", &w.lm_head)?)?;
        let mut layers = Vec::with_capacity(w.layers.len());
        let mut bytes = embed.stored_bytes() / embed.rows + lm_head.stored_bytes();
        for (l, lw) in w.layers.iter().enumerate() {
            let name = |s: &str| format!("layers.{l}.{s}");
            let mixer = match &lw.mixer {
                Mixer::Gdn(g) => {
                    let (qkv, z, b, a) = (name("linear_attn.in_proj_qkv"), name("linear_attn.in_proj_z"), name("linear_attn.in_proj_b"), name("linear_attn.in_proj_a"));
                    let mut in_proj = StackedQMat::upload(
                        cx,
                        &[(&qkv, &g.in_proj_qkv), (&z, &g.in_proj_z), (&b, &g.in_proj_b), (&a, &g.in_proj_a)],
                    )?;
                    debug_assert_eq!(in_proj.rows, GDN_PROJ);
                    let mut out_proj = cx.upload_qmat(quantized(&name("linear_attn.out_proj"), &g.out_proj)?)?;
                    bytes += in_proj.stored_bytes() + out_proj.stored_bytes();
                    add_group_major(cx, &mut in_proj, &mut out_proj)?;
                    DeviceMixer::Gdn {
                        in_proj,
                        in_step: None,
                        out_split: None,
                        conv_w: f(&g.conv1d)?,
                        a_neg_exp: f(&g.a_neg_exp)?,
                        dt_bias: f(&g.dt_bias)?,
                        norm: f(&g.norm)?,
                        out_proj,
                    }
                }
                Mixer::Attn(a) => {
                    let (q, k, v) = (name("self_attn.q_proj"), name("self_attn.k_proj"), name("self_attn.v_proj"));
                    let mut qkv = StackedQMat::upload(cx, &[(&q, &a.q_proj), (&k, &a.k_proj), (&v, &a.v_proj)])?;
                    debug_assert_eq!(qkv.rows, ATTN_PROJ);
                    let mut o_proj = cx.upload_qmat(quantized(&name("self_attn.o_proj"), &a.o_proj)?)?;
                    bytes += qkv.stored_bytes() + o_proj.stored_bytes();
                    add_group_major(cx, &mut qkv, &mut o_proj)?;
                    DeviceMixer::Attn { qkv, q_norm: f(&a.q_norm)?, k_norm: f(&a.k_norm)?, o_proj }
                }
            };
            let moe = cx.upload_moe(&lw.moe)?;
            bytes += moe_bytes_per_token(&lw.moe);
            layers.push(DeviceLayer { input_norm: f(&lw.input_norm)?, post_norm: f(&lw.post_norm)?, mixer, moe });
        }
        let inv_freq = f(&model::reference::rope_inv_freq(cfg.rope_theta, cfg.rotary_dim()))?;
        Ok(CudaModel {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            cfg: cfg.clone(),
            embed,
            lm_head,
            final_norm: f(&w.final_norm)?,
            layers,
            inv_freq,
            vocab_limit: vocab_limit.min(cfg.vocab_size),
            bytes_per_token: bytes,
        })
    }
}

/// Weight bytes one token's MoE block reads: router, shared-expert gate, shared expert, and
/// top-k of the routed experts (the first expert's size stands for all).
fn moe_bytes_per_token(m: &model::load::MoeWeights) -> usize {
    let e = |x: &model::load::Expert| x.gate.stored_bytes() + x.up.stored_bytes() + x.down.stored_bytes();
    m.router.stored_bytes()
        + m.shared_gate.stored_bytes()
        + e(&m.shared)
        + m.experts.first().map_or(0, e) * p::TOP_K
}

/// Per-layer decode state on the device.
pub(crate) enum DeviceLayerState {
    /// GDN conv state [3, conv_dim] and recurrent state [n_v, d_k, d_v], f32.
    Gdn { conv: CudaSlice<f32>, s: CudaSlice<f32> },
    /// KV cache [max_ctx, n_kv, head_dim] bf16 bits.
    Attn { k: CudaSlice<u16>, v: CudaSlice<u16> },
}

/// Kernel classes of the decode step, as bit flags for [`CudaSession::set_ablation`]: the
/// time a step loses when one class is left out is that class's share of the step, including
/// the launch gaps and overlap it costs in place (`calla cuda-bench --ablate`).
pub mod ablate {
    /// Every RMSNorm (input, post-attention, final).
    pub const NORM: u32 = 1;
    /// The stacked input projections (GDN qkv|z|b|a, attention q|gate|k|v).
    pub const IN_PROJ: u32 = 2;
    /// The mixer cores (GDN conv + gates + recurrent update + gated norm; attention q/k norm,
    /// RoPE, KV write, split-K attention and combine).
    pub const MIXER: u32 = 4;
    /// The output projections with the residual add.
    pub const OUT_PROJ: u32 = 8;
    /// MoE kernel 1: router GEMV, top-k and the activation digits.
    pub const MOE_ROUTER: u32 = 16;
    /// MoE kernel 2: expert and shared-expert gate/up + SwiGLU.
    pub const MOE_GATE_UP: u32 = 32;
    /// MoE kernel 3: expert and shared-expert down + weighted combine + residual.
    pub const MOE_DOWN: u32 = 64;
    /// The LM head GEMV (the greedy pick stays).
    pub const LM_HEAD: u32 = 128;
    /// Every class with its name, in step order.
    pub const ALL: [(u32, &str); 8] = [
        (NORM, "rms_norm"),
        (IN_PROJ, "in_proj"),
        (MIXER, "mixer"),
        (OUT_PROJ, "out_proj+resid"),
        (MOE_ROUTER, "moe_router"),
        (MOE_GATE_UP, "moe_gate_up"),
        (MOE_DOWN, "moe_down"),
        (LM_HEAD, "lm_head"),
    ];
}

/// One sequence on the GPU: token history, position, GDN state, KV cache, activations, and the
/// captured step graphs.
pub struct CudaSession {
    pub(crate) max_ctx: usize,
    /// Expert-load telemetry: `[layers, N_EXPERTS]` i32, token slots routed to each expert by
    /// the decode steps and the batched prefill since the last [`Self::take_expert_counts`].
    pub(crate) expert_hist: CudaSlice<i32>,
    /// Token history [max_ctx + 1] (the kernels see the first max_ctx): the prompt, then
    /// generated tokens.
    pub(crate) ids: CudaSlice<i32>,
    /// [1]: prompt length (ids below it are never overwritten).
    pub(crate) n_fixed: CudaSlice<i32>,
    /// [1]: position of the next token to run.
    pub(crate) pos: CudaSlice<i32>,
    /// Host mirror of `pos` (the device value advances one per replay).
    pub(crate) host_pos: usize,
    /// Host mirror of the prompt length.
    pub(crate) host_fixed: usize,
    pub(crate) x: CudaSlice<f32>,
    pub(crate) h: CudaSlice<f32>,
    pub(crate) u: CudaSlice<f32>,
    pub(crate) proj: CudaSlice<f32>,
    pub(crate) mix: CudaSlice<f32>,
    pub(crate) logits: CudaSlice<f32>,
    pub(crate) layers: Vec<DeviceLayerState>,
    pub(crate) gdn_scratch: GdnScratch,
    pub(crate) attn_scratch: AttnScratch,
    pub(crate) moe_scratch: MoeScratch,
    /// Step with LM head and the pick of the current mode (greedy, or sampled with
    /// [`Self::sampling`]).
    pub(crate) graph_full: Option<StepGraph>,
    /// The full step of the other mode, kept across [`Self::set_sampling`] switches so that
    /// mixed greedy and sampled requests do not capture the graphs again at every switch; when
    /// that mode is sampling, it reads [`Self::sampler_idle`]'s buffers.
    pub(crate) graph_full_alt: Option<StepGraph>,
    /// The device sampler's state while the session picks greedily (kept for the next switch).
    pub(crate) sampler_idle: Option<(crate::sample::SampleState, sampler::SamplingParams)>,
    /// Sampling was switched on or off since the sequence started: [`Self::decode`] refuses
    /// until the next start (the sampler's state belongs to a sequence).
    pub(crate) pick_switched: bool,
    /// Step without them (prompt tokens before the last).
    pub(crate) graph_prompt: Option<StepGraph>,
    /// Capture with programmatic dependent launch (see [`crate::graph`]).
    pub(crate) pdl: bool,
    /// [`ablate`] classes left out of the captured step (0 in normal use).
    pub(crate) skip: u32,
    /// RMSNorms fused into the kernels that read their output (the default), or run as
    /// separate launches (for comparison).
    pub(crate) fuse_norm: bool,
    /// Latency-bound kernels prefetch the next weights into L2 (off by default: measured
    /// slower; see [`Self::set_l2_prefetch`]).
    pub(crate) l2_prefetch: bool,
    /// The MoE cluster kernels ask L2 for the next input projection's late-landing rows
    /// ([`Self::set_moe_l2_late`]).
    moe_l2_late: bool,
    /// The L2 follower's plan ([`Self::set_l2_follow`]; `None`: no follower).
    l2_follow: Option<crate::follow::FollowPlan>,
    /// The follower the step graphs hold (its table, progress and base words), and the plan
    /// it runs (the one asked for, less the parts that do not apply), the [`CudaModel`] id
    /// and the [`CudaContext::launch_generation`] it was built for (`follow_key`; `None` with
    /// a follower of `None`: none asked for or applicable; a key with no follower: the plan
    /// asks for nothing here).
    follower: Option<crate::follow::Follower>,
    follow_key: Option<(crate::follow::FollowPlan, u64, u64)>,
    /// MoE launch variant (see [`Self::new`] for the default).
    pub(crate) moe_flags: crate::moe::MoeFlags,
    /// The MoE router folded into the output projection ([`Self::set_router_fold`]; used only
    /// with fused norms and not with [`crate::moe::MoeFlags::fused`]).
    pub(crate) router_fold: bool,
    /// Each GDN layer's input projection and step as one launch ([`Self::set_gdn_in_step`];
    /// with fused norms, for layers that have [`DeviceMixer::Gdn`]'s `in_step`).
    pub(crate) gdn_in_step: bool,
    /// GDN layers run [`CudaContext::gdn_step_out`] + [`CudaContext::moe_split_cluster`]
    /// ([`Self::set_gdn_out_split`]).
    pub(crate) gdn_out_split: bool,
    /// On-device sampling ([`Self::set_sampling`]): the device state and the parameters the
    /// next sequence starts with; `None`: the greedy pick (`argmax_step`).
    pub(crate) sampling: Option<(crate::sample::SampleState, sampler::SamplingParams)>,
    /// [`CudaModel`] id the graphs were captured with.
    pub(crate) graph_model: Option<u64>,
    /// [`CudaContext::launch_generation`] when the graphs were captured.
    pub(crate) graph_gen: u64,
}

impl CudaSession {
    /// Allocates a sequence with room for `max_ctx` tokens.
    ///
    /// The MoE runs as measured fastest on the H200 (docs/CUDA.md): when every layer's expert
    /// matrices are 4-bit and the model has at least two layers, the router folded into the
    /// output projection ([`Self::set_router_fold`]) and one thread-block cluster per expert
    /// for gate/up, down and the combine ([`crate::moe::MoeFlags::cluster`]): 1,266.2 against
    /// 1,316.9 µs per token for the router kernel, gate/up and down, in one process. Otherwise
    /// those three kernels.
    ///
    /// # Errors
    /// Driver errors (out of memory).
    pub fn new(cx: &CudaContext, m: &CudaModel, max_ctx: usize) -> Result<Self, CudaError> {
        let st = cx.stream();
        let cfg = &m.cfg;
        let mut layers = Vec::with_capacity(cfg.layer_types.len());
        for k in &cfg.layer_types {
            layers.push(match k {
                LayerKind::LinearAttention => DeviceLayerState::Gdn {
                    conv: st.alloc_zeros::<f32>((p::CONV_KERNEL - 1) * cfg.gdn_conv_dim())?,
                    s: st.alloc_zeros::<f32>(p::N_V_HEADS * p::D_K * p::D_V)?,
                },
                LayerKind::FullAttention => DeviceLayerState::Attn {
                    k: st.alloc_zeros::<u16>(max_ctx * p::N_KV_HEADS * p::HEAD_DIM)?,
                    v: st.alloc_zeros::<u16>(max_ctx * p::N_KV_HEADS * p::HEAD_DIM)?,
                },
            });
        }
        let moe_scratch = cx.moe_scratch()?;
        let cluster = m.layers.len() >= 2 && m.layers.iter().all(|l| cx.moe_cluster_ready(&l.moe, &moe_scratch));
        Ok(CudaSession {
            max_ctx,
            expert_hist: st.alloc_zeros::<i32>(cfg.layer_types.len() * p::N_EXPERTS)?,
            ids: st.alloc_zeros::<i32>(max_ctx + 1)?,
            n_fixed: st.alloc_zeros::<i32>(1)?,
            pos: st.alloc_zeros::<i32>(1)?,
            host_pos: 0,
            host_fixed: 0,
            x: st.alloc_zeros::<f32>(p::D_MODEL)?,
            h: st.alloc_zeros::<f32>(p::D_MODEL)?,
            u: st.alloc_zeros::<f32>(p::D_MODEL)?,
            proj: st.alloc_zeros::<f32>(GDN_PROJ.max(ATTN_PROJ))?,
            mix: st.alloc_zeros::<f32>((p::N_Q_HEADS * p::HEAD_DIM).max(p::N_V_HEADS * p::D_V))?,
            logits: st.alloc_zeros::<f32>(m.lm_head.rows)?,
            layers,
            gdn_scratch: cx.gdn_scratch()?,
            attn_scratch: cx.attn_scratch(max_ctx)?,
            moe_scratch,
            graph_full: None,
            graph_full_alt: None,
            sampler_idle: None,
            pick_switched: false,
            graph_prompt: None,
            pdl: false,
            skip: 0,
            fuse_norm: true,
            l2_prefetch: false,
            moe_l2_late: false,
            l2_follow: crate::follow::default_plan(),
            follower: None,
            follow_key: None,
            moe_flags: crate::moe::MoeFlags { cluster, ..crate::moe::MoeFlags::DEFAULT },
            router_fold: cluster,
            gdn_in_step: false,
            gdn_out_split: false,
            sampling: None,
            graph_model: None,
            graph_gen: 0,
        })
    }

    /// Layer → device address of its row of the expert counts (`[N_EXPERTS]` i32; the buffer
    /// lives as long as the session, so graphs may hold it). Borrows nothing of the session.
    pub(crate) fn expert_hist_rows(&self, cx: &CudaContext) -> impl Fn(usize) -> u64 {
        let (base, _guard) = self.expert_hist.device_ptr(cx.stream());
        move |layer| base + (layer * p::N_EXPERTS * std::mem::size_of::<i32>()) as u64
    }

    /// Per layer and expert, the token slots the MoE routed to it (each token counts once
    /// for each of its `TOP_K` experts) in the batched prefills and decode steps since the last
    /// call, and zeroes the counts. Waits for the stream. The fused MoE kernel
    /// ([`crate::moe::MoeFlags::fused`], a measured variant) does not count.
    ///
    /// # Errors
    /// Driver errors.
    pub fn take_expert_counts(&mut self, cx: &CudaContext) -> Result<Vec<Vec<u64>>, CudaError> {
        let st = cx.stream();
        let flat = st.clone_dtoh(&self.expert_hist)?;
        st.memset_zeros(&mut self.expert_hist)?;
        Ok(flat.chunks_exact(p::N_EXPERTS).map(|r| r.iter().map(|&c| c.max(0) as u64).collect()).collect())
    }

    /// Context limit in tokens.
    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// Tokens processed so far.
    pub fn pos(&self) -> usize {
        self.host_pos
    }

    /// Queues one decode step on the stream (for [`Self::capture`]). Returns how often its
    /// launches bump the L2 follower's progress word per replay (0 without a follower): once
    /// per mixer launch, and with the follower's [`crate::follow::parts::IN_LATE`] once per MoE
    /// cluster block.
    fn enqueue_step(&mut self, cx: &CudaContext, m: &CudaModel, with_head: bool) -> Result<usize, CudaError> {
        let on = |class: u32| self.skip & class == 0;
        let fuse = self.fuse_norm;
        let (mixer_pf, router_pf) = if self.l2_prefetch { self.prefetch_plan(cx, m) } else { Default::default() };
        {
            let mut x = self.x.slice_mut(..);
            cx.embed_gather(&mut x, &m.embed, &self.ids.slice(..), &self.pos.slice(..))?;
        }
        let hist_row = self.expert_hist_rows(cx);
        // the experts of every layer as one cluster launch (MoeFlags::cluster; with the fold,
        // all layers or none, so that every layer's accumulator set is zeroed by the layer before)
        let (cluster_all, fold) = self.moe_cluster_fold(cx, m);
        let n_layers = m.layers.len();
        // the split output projection in every GDN layer (gdn_step_out + moe_split_cluster),
        // all or none: every MoE launch then also zeroes the next set's h − x
        let split_all = fold && self.gdn_out_split_applies(cx, m);
        self.moe_scratch.zero_acc_h = split_all;
        // the MoE's combine by f64 atomics (CudaContext::set_moe_hsum): layer i's MoE leaves the
        // residual stream as f64 sums in set fold_set(i + 1)'s h accumulators; the next input
        // projection (or the LM head) reads them and stores x. Layer 0 reads the embedding's x.
        // (not where a staged input projection or LM head would be bypassed: gemv_norm_xd reads
        // the MLX layout)
        let staged_reader = cx.gemv_reg_cap()
            && (m.layers.iter().any(|l| l.mixer.input_projection().runs.iter().any(|(mm, _)| cx.staged_of(mm).is_some()))
                || cx.staged_of(&m.lm_head).is_some());
        let hsum = fold && cluster_all && !split_all && !self.gdn_in_step && !staged_reader && cx.moe_hsum();
        self.moe_scratch.hsum_combine = hsum;
        // the L2 follower's progress word (0: none), which the mixer kernels bump; its plan may
        // ask the experts' copies to leave L2 first
        let progress = self.follower.as_ref().map_or(0, |f| f.progress(cx));
        // ... and which the MoE cluster kernels bump too, once per block as its tiles land
        let in_late = self.follower.as_ref().is_some_and(|f| f.plan().parts & crate::follow::parts::IN_LATE != 0);
        let moe_progress = if in_late { progress } else { 0 };
        let mut bumps = 0;
        self.moe_scratch.evict_first = self.follower.as_ref().is_some_and(|f| f.plan().experts_evict_first);
        for (i, (lw, ls)) in m.layers.iter().zip(self.layers.iter_mut()).enumerate() {
            let (mut mixer_pf, router_pf) = (mixer_pf.get(i).copied().unwrap_or_default(), router_pf.get(i).copied().unwrap_or_default());
            // the L2 follower's cue (0: none): the mixer kernel bumps it once its input is here
            mixer_pf.progress = progress;
            self.gdn_scratch.l2_prefetch = mixer_pf;
            self.attn_scratch.l2_prefetch = mixer_pf;
            self.moe_scratch.l2_prefetch = router_pf;
            self.moe_scratch.hist_row = hist_row(i);
            if !fuse && on(ablate::NORM) {
                cx.rms_norm(&mut self.u.slice_mut(..), &self.x.slice(..), &lw.input_norm.slice(..))?;
            }
            // the stacked input projection and the output projection around the mixer core
            let (in_mat, n_in, out_mat, n_out) = match &lw.mixer {
                DeviceMixer::Gdn { in_proj, out_proj, .. } => (in_proj, GDN_PROJ, out_proj, p::N_V_HEADS * p::D_V),
                DeviceMixer::Attn { qkv, o_proj, .. } => (qkv, ATTN_PROJ, o_proj, p::N_Q_HEADS * p::HEAD_DIM),
            };
            // the GDN input projection and step as one launch (gdn_in_step; the ablation
            // leaves it out as the mixer core)
            let in_step = in_step_weights(lw, fuse && self.gdn_in_step);
            if on(ablate::IN_PROJ) && in_step.is_none() {
                let out = &mut self.proj.slice_mut(..n_in);
                if hsum && i > 0 {
                    let xd = self.moe_scratch.hsum(crate::moe::fold_set(i, n_layers))?;
                    in_mat.gemv_norm_xd(cx, out, &xd, &mut self.x.slice_mut(..), &lw.input_norm.slice(..))?;
                } else if fuse {
                    in_mat.gemv_norm(cx, out, &self.x.slice(..), &lw.input_norm.slice(..))?;
                } else {
                    in_mat.gemv(cx, out, &self.u.slice(..))?;
                }
            }
            match (&lw.mixer, ls) {
                (DeviceMixer::Gdn { conv_w, a_neg_exp, dt_bias, norm, out_split: Some(w), .. }, DeviceLayerState::Gdn { conv, s })
                    if split_all =>
                {
                    let (set, next_set) = (crate::moe::fold_set(i, n_layers), crate::moe::fold_set((i + 1) % n_layers, n_layers));
                    cx.gdn_step_out(
                        w,
                        &lw.moe,
                        &lw.post_norm.slice(..),
                        &self.x.slice(..),
                        &self.proj.slice(..n_in),
                        &conv_w.slice(..),
                        &a_neg_exp.slice(..),
                        &dt_bias.slice(..),
                        &norm.slice(..),
                        &mut conv.slice_mut(..),
                        &mut s.slice_mut(..),
                        &mut self.moe_scratch,
                        set,
                        &mut self.mix.slice_mut(..n_out),
                    )?;
                    cx.moe_split_cluster(&lw.moe, &lw.post_norm.slice(..), &mut self.moe_scratch, &mut self.x.slice_mut(..), set, next_set)?;
                    continue;
                }
                (DeviceMixer::Gdn { conv_w, a_neg_exp, dt_bias, norm, .. }, DeviceLayerState::Gdn { conv, s }) => {
                    if let (Some((w, stacked)), true) = (in_step, on(ablate::MIXER)) {
                        cx.gdn_in_step(
                            w,
                            stacked,
                            &self.x.slice(..),
                            &lw.input_norm.slice(..),
                            &conv_w.slice(..),
                            &a_neg_exp.slice(..),
                            &dt_bias.slice(..),
                            &norm.slice(..),
                            &mut conv.slice_mut(..),
                            &mut s.slice_mut(..),
                            &self.gdn_scratch,
                            &mut self.mix.slice_mut(..n_out),
                        )?;
                    } else if in_step.is_none() && on(ablate::MIXER) {
                        bumps += usize::from(progress != 0);
                        cx.gdn_decode_step(
                            &self.proj.slice(..n_in),
                            &conv_w.slice(..),
                            &a_neg_exp.slice(..),
                            &dt_bias.slice(..),
                            &norm.slice(..),
                            &mut conv.slice_mut(..),
                            &mut s.slice_mut(..),
                            &mut self.gdn_scratch,
                            &mut self.mix.slice_mut(..n_out),
                        )?;
                    }
                }
                (DeviceMixer::Attn { q_norm, k_norm, .. }, DeviceLayerState::Attn { k, v }) => {
                    if on(ablate::MIXER) {
                        bumps += usize::from(progress != 0);
                        cx.attn_decode_step(
                            &self.proj.slice(..n_in),
                            &q_norm.slice(..),
                            &k_norm.slice(..),
                            &m.inv_freq.slice(..),
                            &self.pos.slice(..),
                            &mut k.slice_mut(..),
                            &mut v.slice_mut(..),
                            &mut self.attn_scratch,
                            &mut self.mix.slice_mut(..n_out),
                        )?;
                    }
                }
                _ => return Err(CudaError::Unsupported("layer state does not match its mixer".into())),
            }
            let (set, next_set) = (crate::moe::fold_set(i, n_layers), crate::moe::fold_set((i + 1) % n_layers, n_layers));
            if on(ablate::OUT_PROJ) {
                if fold {
                    cx.gemv_residual_router(
                        &mut self.h.slice_mut(..),
                        out_mat,
                        &self.mix.slice(..n_out),
                        &self.x.slice(..),
                        &lw.moe,
                        &lw.post_norm.slice(..),
                        &mut self.moe_scratch,
                        set,
                    )?;
                } else {
                    cx.gemv_residual(&mut self.h.slice_mut(..), out_mat, &self.mix.slice(..n_out), &self.x.slice(..))?;
                }
            }
            if fold && cluster_all {
                // gate/up, down and the combine as one cluster launch (MoeFlags::cluster); the
                // ablation leaves it out as the MoE gate/up class (it has no down launch of its
                // own) and zeroes the next layer's accumulators instead
                if self.moe_l2_late {
                    // the next input projection's rows past the SMs this launch leaves free
                    let mut pf = L2Prefetch::default();
                    if let Some(next) = m.layers.get(i + 1) {
                        if let [(first, _)] = next.mixer.input_projection().runs.as_slice() {
                            let free = (cx.sm_count() as usize).saturating_sub(crate::moe::CL_BLOCKS);
                            if let Some(rows) = cx.gemv_late_rows(first, free) {
                                pf.push_qmat_rows(cx, first, rows);
                            }
                        }
                    }
                    self.moe_scratch.l2_prefetch = pf;
                }
                self.moe_scratch.l2_prefetch.progress = moe_progress;
                if on(ablate::MOE_GATE_UP) {
                    bumps += if moe_progress != 0 { crate::moe::CL_BLOCKS } else { 0 };
                    cx.moe_fold_cluster(&lw.moe, &self.h.slice(..), &lw.post_norm.slice(..), &mut self.moe_scratch, &mut self.x.slice_mut(..), set, next_set)?;
                } else {
                    cx.moe_fold_reset(&mut self.moe_scratch)?;
                }
                continue;
            }
            if fold {
                if on(ablate::MOE_GATE_UP) {
                    cx.moe_fold_gate_up(&lw.moe, &self.h.slice(..), &lw.post_norm.slice(..), &mut self.moe_scratch, set)?;
                }
                if on(ablate::MOE_DOWN) {
                    cx.moe_fold_down(&lw.moe, &self.h.slice(..), &mut self.moe_scratch, &mut self.x.slice_mut(..), set, next_set)?;
                } else {
                    cx.moe_fold_reset(&mut self.moe_scratch)?; // the accumulators zero for the next layer
                }
                continue;
            }
            if !fuse && on(ablate::NORM) {
                cx.rms_norm(&mut self.u.slice_mut(..), &self.h.slice(..), &lw.post_norm.slice(..))?;
            }
            // fused: the router normalizes h itself (u = rms_norm(h), resid = h)
            let (u, norm) = if fuse { (self.h.slice(..), Some(lw.post_norm.slice(..))) } else { (self.u.slice(..), None) };
            for (part, class) in [ablate::MOE_ROUTER, ablate::MOE_GATE_UP, ablate::MOE_DOWN].into_iter().enumerate() {
                if on(class) {
                    cx.moe_decode_part(
                        &lw.moe,
                        &u,
                        &self.h.slice(..),
                        &mut self.moe_scratch,
                        &mut self.x.slice_mut(..),
                        part,
                        self.moe_flags,
                        norm.as_ref(),
                    )?;
                }
            }
        }
        self.gdn_scratch.l2_prefetch = L2Prefetch::default();
        self.attn_scratch.l2_prefetch = L2Prefetch::default();
        self.moe_scratch.l2_prefetch = L2Prefetch::default();
        if with_head {
            if !fuse && on(ablate::NORM) {
                cx.rms_norm(&mut self.u.slice_mut(..), &self.x.slice(..), &m.final_norm.slice(..))?;
            }
            if on(ablate::LM_HEAD) {
                if hsum {
                    let xd = self.moe_scratch.hsum(crate::moe::fold_set(0, n_layers))?;
                    cx.gemv_norm_xd(&mut self.logits.slice_mut(..), &m.lm_head, &xd, &mut self.x.slice_mut(..), &m.final_norm.slice(..))?;
                } else if fuse {
                    cx.gemv_norm(&mut self.logits.slice_mut(..), &m.lm_head, &self.x.slice(..), &m.final_norm.slice(..))?;
                } else {
                    cx.gemv(&mut self.logits.slice_mut(..), &m.lm_head, &self.u.slice(..))?;
                }
            }
            self.pick(cx, m)?;
        } else {
            cx.advance_pos(&mut self.pos.slice_mut(..))?;
        }
        Ok(bumps)
    }

    /// Per layer, the L2 prefetch hints of its latency-bound kernels: the mixer core (GDN step,
    /// split attention) asks for the layer's output projection; the MoE router for the next
    /// layer's stacked input projection (its first run) and, for a GDN layer, its recurrent
    /// state. Those kernels leave DRAM mostly idle, so the bytes arrive before their readers
    /// start (the in_proj GEMV alone is 14 MB at 4 bits: 3.4 µs of the copy roofline).
    fn prefetch_plan(&self, cx: &CudaContext, m: &CudaModel) -> (Vec<L2Prefetch>, Vec<L2Prefetch>) {
        let st = cx.stream();
        let n = m.layers.len();
        let mut mixer = vec![L2Prefetch::default(); n];
        let mut router = vec![L2Prefetch::default(); n];
        for i in 0..n {
            let out = match &m.layers[i].mixer {
                DeviceMixer::Gdn { out_proj, .. } => out_proj,
                DeviceMixer::Attn { o_proj, .. } => o_proj,
            };
            mixer[i].push_qmat(cx, out);
            if let Some(next) = m.layers.get(i + 1) {
                if let Some((first, _)) = next.mixer.input_projection().runs.first() {
                    router[i].push_qmat(cx, first);
                }
                if let Some(DeviceLayerState::Gdn { s, .. }) = self.layers.get(i + 1) {
                    router[i].push(s.device_ptr(st).0, s.len() * 4);
                }
            }
        }
        (mixer, router)
    }

    /// Lets the latency-bound kernels of the step prefetch the next weights into L2
    /// ([`Self::prefetch_plan`]) or not (`false`, the default). Results are the same. Measured
    /// on the H200 (docs/CUDA.md): slower, 1,442.5 vs 1,317.8 µs per token, because a block's
    /// bulk prefetches must drain before it retires, which lengthens the router (+2.3 µs per
    /// layer) more than the GEMVs gain.
    /// The step graphs are captured again on the next [`Self::start`] when this changes.
    pub fn set_l2_prefetch(&mut self, on: bool) {
        if on != self.l2_prefetch {
            self.l2_prefetch = on;
            self.drop_graphs();
        }
    }

    /// Lets each layer's MoE cluster kernel (after the router fold) ask L2, once its own expert
    /// copies are issued, for the rows of the next layer's input projection that the
    /// projection's late-landing blocks read (`true`): the blocks past the SMs the cluster
    /// kernel leaves free (`CudaContext::gemv_late_rows`), which land only as the MoE drains
    /// and then stream their weights from DRAM at one block's rate. Results are the same
    /// (hints only); `false`, the default. The step graphs are captured again on the next
    /// [`Self::start`] when this changes.
    pub fn set_moe_l2_late(&mut self, on: bool) {
        if on != self.moe_l2_late {
            self.moe_l2_late = on;
            self.drop_graphs();
        }
    }

    /// Drops the captured step graphs; they are captured again on the next [`Self::start`].
    fn drop_graphs(&mut self) {
        self.graph_full = None;
        self.graph_full_alt = None;
        self.graph_prompt = None;
    }

    /// The MoE launch variant in use ([`Self::set_moe_flags`]; the default: [`Self::new`]).
    #[doc(hidden)]
    pub fn moe_flags(&self) -> crate::moe::MoeFlags {
        self.moe_flags
    }

    /// Whether the MoE router is folded into the output projection ([`Self::set_router_fold`]).
    pub fn router_fold(&self) -> bool {
        self.router_fold
    }

    /// Runs the MoE with another launch variant (for measurement); graphs are captured again
    /// on the next [`Self::start`] when it changes.
    #[doc(hidden)]
    pub fn set_moe_flags(&mut self, flags: crate::moe::MoeFlags) {
        if flags != self.moe_flags {
            self.moe_flags = flags;
            self.drop_graphs();
        }
    }

    /// Folds the MoE router into the output projection (`true`: no router launch,
    /// [`CudaContext::gemv_residual_router`], 40 kernels fewer per step) or runs it as its own
    /// kernel (`false`). The default is [`Self::new`]'s. Measured on the H200 (docs/CUDA.md):
    /// with gate/up and down as two kernels, the same time per token (1,333.4 against 1,333.8
    /// µs); with a cluster per expert ([`MoeFlags::cluster`]) 1,266.2 against 1,316.9 µs for
    /// the router kernel and the cluster, or for the router kernel, gate/up and down. The
    /// fold applies with fused norms, not with [`MoeFlags::fused`], and with at least two
    /// layers; its logits equal the router kernel's up to f32 rounding. With the fold the
    /// router kernel's L2 prefetch hints ([`Self::set_l2_prefetch`]) are not issued. The step graphs are captured again on the
    /// next [`Self::start`] when this changes.
    ///
    /// [`MoeFlags::fused`]: crate::moe::MoeFlags::fused
    /// [`MoeFlags::cluster`]: crate::moe::MoeFlags::cluster
    pub fn set_router_fold(&mut self, on: bool) {
        if on != self.router_fold {
            self.router_fold = on;
            self.drop_graphs();
        }
    }

    /// Runs each GDN layer's stacked input projection and step as one launch
    /// ([`CudaContext::gdn_in_step`]) or as the fused-norm GEMV and
    /// [`CudaContext::gdn_decode_step`] (`false`, the default: measured faster on the H200,
    /// docs/CUDA.md). Applies with fused norms to the layers that have the restacked weights
    /// ([`CudaModel::upload_gdn_in_step`]). In those layers the [`ablate`] class `MIXER` leaves
    /// out the input projection too and `IN_PROJ` leaves out nothing. The step graphs are captured again on the next
    /// [`Self::start`] when this changes.
    pub fn set_gdn_in_step(&mut self, on: bool) {
        if on != self.gdn_in_step {
            self.gdn_in_step = on;
            self.drop_graphs();
        }
    }

    /// Lets [`CudaContext::gdn_in_step`] trigger the next launch right after its PDL wait (a
    /// measured variant; see [`crate::gdn::GdnScratch::in_early_trigger`]). The step graphs are
    /// captured again on the next [`Self::start`] when this changes.
    pub fn set_gdn_in_early_trigger(&mut self, on: bool) {
        if on != self.gdn_scratch.in_early_trigger {
            self.gdn_scratch.in_early_trigger = on;
            self.drop_graphs();
        }
    }

    /// Lets [`CudaContext::gdn_in_step`] prefetch its weights into L2 before the PDL wait and copy
    /// them into shared memory after `h`'s loads ([`crate::gdn::GdnScratch::in_l2_first`]). The
    /// step graphs are captured again on the next [`Self::start`] when this changes.
    pub fn set_gdn_in_l2_first(&mut self, on: bool) {
        if on != self.gdn_scratch.in_l2_first {
            self.gdn_scratch.in_l2_first = on;
            self.drop_graphs();
        }
    }

    /// Runs each GDN layer's step, output projection and router sums as one launch
    /// ([`CudaContext::gdn_step_out`]) and its experts as [`CudaContext::moe_split_cluster`],
    /// instead of the step, the output projection with the router folded in and
    /// [`CudaContext::moe_fold_cluster`] (`false`, the default; measured slower, docs/CUDA.md).
    /// Applies only where [`Self::gdn_out_split_applies`] says; the step graphs are captured again
    /// on the next [`Self::start`] when this changes.
    pub fn set_gdn_out_split(&mut self, on: bool) {
        if on != self.gdn_out_split {
            self.gdn_out_split = on;
            self.drop_graphs();
        }
    }

    /// Whether the step runs the split output projection in every GDN layer: it is asked for
    /// ([`Self::set_gdn_out_split`]), the step runs the router fold with the MoE cluster kernels
    /// (fused norms, every layer's experts 4-bit, at least two layers), no class is ablated, every
    /// GDN layer has its split weights ([`CudaModel::upload_gdn_out_split`]; only 4-bit output
    /// projections get them) and none runs its input projection in the step
    /// ([`Self::set_gdn_in_step`] with [`CudaModel::upload_gdn_in_step`]'s weights).
    pub fn gdn_out_split_applies(&self, cx: &CudaContext, m: &CudaModel) -> bool {
        let cluster_all = self.moe_flags.cluster
            && !self.moe_flags.fused
            && m.layers.iter().all(|l| cx.moe_cluster_ready(&l.moe, &self.moe_scratch));
        self.gdn_out_split
            && self.router_fold
            && self.fuse_norm
            && m.layers.len() >= 2
            && cluster_all
            && self.skip == 0
            && m.layers.iter().all(|l| match &l.mixer {
                DeviceMixer::Gdn { out_split, .. } => out_split.is_some() && in_step_weights(l, self.gdn_in_step).is_none(),
                DeviceMixer::Attn { .. } => true,
            })
    }

    /// Whether GDN layers run the split output projection when it applies
    /// ([`Self::set_gdn_out_split`], [`Self::gdn_out_split_applies`]).
    pub fn gdn_out_split(&self) -> bool {
        self.gdn_out_split
    }

    /// Whether GDN layers run their input projection and step as one launch
    /// ([`Self::set_gdn_in_step`]).
    pub fn gdn_in_step(&self) -> bool {
        self.gdn_in_step
    }

    fn capture(&mut self, cx: &CudaContext, m: &CudaModel, with_head: bool) -> Result<StepGraph, CudaError> {
        let st = cx.stream().clone();
        let pdl = self.pdl;
        // with the L2 follower (built by ensure_graphs), every layer's mixer kernel bumps its
        // progress word once (and with its in-late part every MoE cluster block): n_layers ×
        // bumps_per_layer per replay
        let total = self.follower.as_ref().map_or(0, |f| m.layers.len() * f.plan().bumps_per_layer());
        let root = match &self.follower {
            Some(f) => Some(f.root_kernel(cx, total as u32)?),
            None => None,
        };
        let follows = root.is_some();
        let mut bumps = 0;
        let g = StepGraph::capture_with_root(
            &st,
            pdl,
            || {
                bumps = self.enqueue_step(cx, m, with_head)?;
                Ok(())
            },
            root,
        )?;
        if follows && bumps != total {
            return Err(CudaError::Unsupported(format!("the L2 follower expects {total} progress bumps per step; the step has {bumps}")));
        }
        Ok(g)
    }

    /// Runs the L2 follower beside the step graphs with `plan` ([`crate::follow`]; a new
    /// session starts with [`crate::follow::default_plan`], normally
    /// [`crate::follow::FollowPlan::DEFAULT`]; `None`: no follower). It applies only where
    /// every layer's mixer kernel bumps its progress word (no class left out by the ablation,
    /// no GDN input projection in the step, no split output projection) and the plan asks for
    /// something in this model; elsewhere the step runs without it. Its
    /// [`crate::follow::parts::IN_LATE`] part applies only where every layer's experts run as
    /// the MoE cluster kernel after the router fold; elsewhere the plan runs without that part
    /// ([`Self::l2_follow_effective`]). Results are the same bit
    /// for bit (hints only). The step graphs are captured again on the next [`Self::start`]
    /// when this changes.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a plan that [`crate::follow::FollowPlan::check`] rejects
    /// (nothing changes then).
    pub fn set_l2_follow(&mut self, plan: Option<crate::follow::FollowPlan>) -> Result<(), CudaError> {
        if let Some(p) = &plan {
            p.check()?;
        }
        if plan != self.l2_follow {
            self.l2_follow = plan;
            self.drop_graphs();
        }
        Ok(())
    }

    /// The L2 follower's plan ([`Self::set_l2_follow`]).
    pub fn l2_follow(&self) -> Option<crate::follow::FollowPlan> {
        self.l2_follow
    }

    /// Whether the step graphs hold an L2 follower (after the first [`Self::start`]).
    pub fn l2_follow_active(&self) -> bool {
        self.follower.is_some()
    }

    /// The plan the step graphs' L2 follower runs (after the first [`Self::start`]; `None`
    /// without one): [`Self::l2_follow`]'s less the parts that do not apply here.
    pub fn l2_follow_effective(&self) -> Option<crate::follow::FollowPlan> {
        self.follower.as_ref().map(|f| f.plan())
    }

    /// The follower the next captures use: [`Self::set_l2_follow`]'s plan where it applies,
    /// less the parts that do not apply (`in-late` without the fold cluster kernel in every
    /// layer), built for `m`; rebuilt (and every graph dropped, since graphs hold its
    /// buffers) when that plan, the model or the context's launch settings (which choose the
    /// regions: staged copies, the input projections' grids) changed. Its words are zeroed
    /// (between replays, before captures).
    fn ensure_follower(&mut self, cx: &CudaContext, m: &CudaModel) -> Result<(), CudaError> {
        let applies = self.skip == 0
            && !self.gdn_out_split_applies(cx, m)
            && !m.layers.iter().any(|l| in_step_weights(l, self.fuse_norm && self.gdn_in_step).is_some());
        // the in-late part needs every layer's experts as the cluster kernel after the router
        // fold (the kernel that bumps as its tiles land)
        let (cluster_all, fold) = self.moe_cluster_fold(cx, m);
        let want = self.l2_follow.filter(|_| applies).map(|mut p| {
            if !(cluster_all && fold) {
                p.parts &= !crate::follow::parts::IN_LATE;
            }
            (p, m.id, cx.launch_generation())
        });
        if want != self.follow_key {
            self.drop_graphs();
            self.follower = None;
            self.follow_key = None;
            if let Some((plan, _, _)) = want {
                self.follower = crate::follow::Follower::new(cx, m, plan)?;
            }
            self.follow_key = want;
        }
        if let Some(f) = &mut self.follower {
            f.reset(cx)?;
        }
        Ok(())
    }

    /// How the step runs its experts: `(cluster_all, fold)`, i.e. every layer's experts as one
    /// cluster launch ([`crate::moe::MoeFlags::cluster`]; with the fold, all layers or none, so
    /// that every layer's accumulator set is zeroed by the layer before), and the router folded
    /// into the output projection (no router launch; fused norms, not the fused MoE kernel; a
    /// single layer would read and zero one accumulator set, so not folded; with gate/up and
    /// down as two kernels, not with gate/up left out by the ablation: down's top-k before its
    /// wait relies on gate/up's wait having seen the output projection complete).
    fn moe_cluster_fold(&self, cx: &CudaContext, m: &CudaModel) -> (bool, bool) {
        let cluster_all = self.moe_flags.cluster
            && !self.moe_flags.fused
            && m.layers.iter().all(|l| cx.moe_cluster_ready(&l.moe, &self.moe_scratch));
        let fold = self.router_fold
            && self.fuse_norm
            && !self.moe_flags.fused
            && m.layers.len() >= 2
            && (cluster_all || self.skip & ablate::MOE_GATE_UP == 0);
        (cluster_all, fold)
    }

    /// Chooses programmatic dependent launch for the step graphs (captured again on the next
    /// [`Self::start`] when the choice changes).
    pub fn set_pdl(&mut self, on: bool) {
        if on != self.pdl {
            self.pdl = on;
            self.drop_graphs();
        }
    }

    /// Leaves the [`ablate`] classes in `skip` out of the step graphs (captured again on the
    /// next [`Self::start`] when it changes). For measurement only: a step with any class left
    /// out computes garbage (indices stay in range), only its time means anything.
    #[doc(hidden)]
    pub fn set_ablation(&mut self, skip: u32) {
        if skip != self.skip {
            self.skip = skip;
            self.drop_graphs();
        }
    }

    /// Fuses every RMSNorm into the kernel that reads its output (`true`, the default:
    /// [`CudaContext::gemv_norm`], [`CudaContext::moe_decode_step_norm`]) or runs them as
    /// separate launches (`false`); both compute the same bits. The step graphs are captured
    /// again on the next [`Self::start`] when this changes.
    pub fn set_fuse_norm(&mut self, on: bool) {
        if on != self.fuse_norm {
            self.fuse_norm = on;
            self.drop_graphs();
        }
    }

    /// Kernel launches per full decode step, and how many of its edges are programmatic
    /// (after the first [`Self::start`]).
    pub fn graph_stats(&self) -> Option<(usize, usize)> {
        self.graph_full.as_ref().map(|g| (g.kernels, g.programmatic_edges))
    }

    /// The kernels of the full decode step graph in launch order, `(entry point, blocks)`
    /// (after the first [`Self::start`]); for [`crate::timeline::layout`].
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] before the graphs are captured; driver errors.
    pub fn step_kernel_launches(&self) -> Result<Vec<(String, u64)>, CudaError> {
        self.graph_full
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported("no step graph captured yet: start a sequence first".into()))?
            .kernel_launches()
    }

    /// The last kernel(s) of a step that ran the LM head: the greedy pick (`argmax_step`) or,
    /// with [`Self::set_sampling`], the device sampler (`sample_step`); either writes the token
    /// to `ids[pos + 1]` past the prompt and advances `pos`.
    pub(crate) fn pick(&mut self, cx: &CudaContext, m: &CudaModel) -> Result<(), CudaError> {
        let ids = &mut self.ids.slice_mut(..self.max_ctx);
        match &mut self.sampling {
            None => cx.argmax_step(&self.logits.slice(..), m.vocab_limit, ids, &self.n_fixed.slice(..), &mut self.pos.slice_mut(..)),
            Some((state, _)) => cx.sample_step(&mut self.logits.slice_mut(..), ids, &self.n_fixed.slice(..), &mut self.pos.slice_mut(..), state),
        }
    }

    /// Samples the generated tokens on the device with `params` (`sampler::Sampler::sample`'s
    /// arithmetic and random stream, token for token: see [`crate::sample`]), or picks greedily
    /// with `None` (the default; `argmax_step`, which equals sampling at temperature 0 without
    /// penalties). Takes effect at the next [`Self::start`] / [`Self::start_batched`]: each
    /// sequence starts the sampler afresh (counts for the penalties zeroed, the random stream
    /// from `params.seed`, or from a fresh OS-entropy seed per sequence when it is `None`;
    /// [`Self::sampling_seed`] reads it). A sequence in progress keeps its sampler state;
    /// after switching sampling on or off [`Self::decode`] refuses to go on until the next
    /// start. The full step graph of each mode is kept (and the sampler's device state while
    /// greedy), so switching back and forth captures nothing again; new parameters that need a
    /// differently sized sampler state (another vocabulary limit) capture the sampled step
    /// again at the next start.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] naming the parameter that [`sampler::SamplingParams::validate`]
    /// rejects, or a `top_k` above [`crate::sample::SAMPLE_MAX_TOP_K`] (below the vocabulary);
    /// driver errors.
    pub fn set_sampling(&mut self, cx: &CudaContext, m: &CudaModel, params: Option<&sampler::SamplingParams>) -> Result<(), CudaError> {
        let fits = |state: &crate::sample::SampleState| state.rows() == m.lm_head.rows && state.vocab_limit() == m.vocab_limit;
        match params {
            None => {
                if self.sampling.is_some() {
                    // sampled -> greedy: park the sampler and the sampled step
                    self.sampler_idle = self.sampling.take();
                    std::mem::swap(&mut self.graph_full, &mut self.graph_full_alt);
                    self.pick_switched = true;
                }
            }
            Some(p) => {
                crate::sample::check_params(p, m.vocab_limit)?;
                let was_sampling = self.sampling.is_some();
                let kept = if was_sampling { &self.sampling } else { &self.sampler_idle };
                let reused = kept.as_ref().is_some_and(|(state, _)| fits(state));
                // the fallible allocation before anything changes: an error leaves the session
                // (its sampler and graphs) as it was
                let fresh = if reused { None } else { Some(cx.sample_state(m.lm_head.rows, m.vocab_limit, p)?) };
                let current = if was_sampling { self.sampling.take() } else { self.sampler_idle.take() };
                let state = match (fresh, current) {
                    (Some(state), _) | (None, Some((state, _))) => state,
                    // `reused` implies a kept state
                    (None, None) => return Err(CudaError::Unsupported("set_sampling: no sampler state to reuse".into())),
                };
                self.sampling = Some((state, p.clone()));
                if !was_sampling {
                    // greedy -> sampled: the greedy step is kept as the other mode's
                    std::mem::swap(&mut self.graph_full, &mut self.graph_full_alt);
                    self.pick_switched = true;
                }
                if !reused {
                    // a new sampler state: the sampled step read the old one's buffers
                    self.graph_full = None;
                }
            }
        }
        Ok(())
    }

    /// The seed of the device sampler's random stream for the sequence started last (`None`
    /// when picking greedily).
    pub fn sampling_seed(&self) -> Option<u64> {
        self.sampling.as_ref().map(|(s, _)| s.seed())
    }

    /// Captures the two step graphs (once per session). Called by [`Self::start`].
    pub(crate) fn ensure_graphs(&mut self, cx: &CudaContext, m: &CudaModel) -> Result<(), CudaError> {
        if self.graph_model != Some(m.id) || self.graph_gen != cx.launch_generation() {
            // graphs of another model hold its (maybe freed) device pointers, and graphs of an
            // older launch generation other kernels or attributes: capture again
            self.drop_graphs();
            self.graph_model = None;
            self.graph_gen = cx.launch_generation();
        }
        if self.graph_full.is_none() || self.graph_prompt.is_none() {
            // the steps of one capture keep the router fold's accumulator sets (and the MoE's
            // h sums, CudaContext::set_moe_hsum) zero where the next step expects them; steps
            // of another configuration (the split output projection's h − x, the ablation) may
            // have left them otherwise
            cx.moe_fold_reset(&mut self.moe_scratch)?;
            self.ensure_follower(cx, m)?;
        }
        if self.graph_full.is_none() {
            self.graph_full = Some(self.capture(cx, m, true)?);
        }
        if self.graph_prompt.is_none() {
            self.graph_prompt = Some(self.capture(cx, m, false)?);
        }
        self.graph_model = Some(m.id);
        Ok(())
    }

    /// Validates `prompt`, captures the step graphs if needed, clears the GDN state and
    /// uploads the prompt as the token history with the position at 0. Queued, not waited for.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for an empty prompt, an id outside the vocabulary, or a prompt
    /// that leaves no room in the context; driver errors.
    pub(crate) fn begin(&mut self, cx: &CudaContext, m: &CudaModel, prompt: &[u32]) -> Result<(), CudaError> {
        if prompt.is_empty() {
            return Err(CudaError::Unsupported("empty prompt".into()));
        }
        if prompt.len() >= self.max_ctx {
            return Err(CudaError::Unsupported(format!(
                "prompt of {} tokens leaves no room in a context of {}",
                prompt.len(),
                self.max_ctx
            )));
        }
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= m.cfg.vocab_size) {
            return Err(CudaError::Unsupported(format!("token id {id} outside the vocabulary of {}", m.cfg.vocab_size)));
        }
        self.ensure_graphs(cx, m)?;
        let st = cx.stream().clone();
        for l in &mut self.layers {
            match l {
                DeviceLayerState::Gdn { conv, s } => {
                    st.memset_zeros(conv)?;
                    st.memset_zeros(s)?;
                }
                // KV rows at or beyond pos are never read, no need to clear
                DeviceLayerState::Attn { .. } => {}
            }
        }
        if let Some((state, params)) = &mut self.sampling {
            cx.sample_reset(state, params)?;
        }
        self.pick_switched = false;
        let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        st.memcpy_htod(&ids, &mut self.ids.slice_mut(..ids.len()))?;
        st.memcpy_htod(&[ids.len() as i32], &mut self.n_fixed)?;
        st.memcpy_htod(&[0i32], &mut self.pos)?;
        self.host_fixed = ids.len();
        self.host_pos = 0;
        Ok(())
    }

    /// Starts a sequence from scratch: clears all state, uploads `prompt`, runs it token by
    /// token through the step graph (all but the last without the LM head) and leaves the first
    /// generated token in the device history. Asynchronous: returns once the work is queued.
    /// [`Self::start_batched`] (module [`crate::prefill`]) is the fast way for long prompts.
    ///
    /// # Errors
    /// As [`Self::begin`].
    pub fn start(&mut self, cx: &CudaContext, m: &CudaModel, prompt: &[u32]) -> Result<(), CudaError> {
        self.begin(cx, m, prompt)?;
        let gp = self.graph_prompt.as_ref().expect("captured");
        for _ in 0..prompt.len() - 1 {
            gp.launch()?;
        }
        self.graph_full.as_ref().expect("captured").launch()?;
        self.host_pos = prompt.len();
        Ok(())
    }

    /// Queues `n` decode steps of model `m` (each embeds the last token, runs the model, and
    /// appends the greedy or sampled token). Stops early at the context limit. Returns the number queued.
    ///
    /// # Errors
    /// Driver errors; [`CudaError::Unsupported`] before [`Self::start`] or with another model
    /// than the sequence was started with.
    pub fn decode(&mut self, m: &CudaModel, n: usize) -> Result<usize, CudaError> {
        if self.graph_model != Some(m.id) {
            return Err(CudaError::Unsupported("decode before start, or with another model than the sequence was started with".into()));
        }
        let Some(g) = self.graph_full.as_ref().filter(|_| !self.pick_switched) else {
            return Err(CudaError::Unsupported(
                "a setting changed since start (sampling on/off, PDL, MoE variant, fused norms, ablation, L2 prefetch): start the sequence again".into(),
            ));
        };
        // the step at host_pos writes ids[host_pos + 1]
        let n = n.min(self.max_ctx.saturating_sub(self.host_pos + 1));
        for i in 0..n {
            if let Err(e) = g.launch() {
                self.host_pos += i;
                return Err(e);
            }
        }
        self.host_pos += n;
        Ok(n)
    }

    /// Waits for the queued steps and returns the generated tokens so far (the tokens after
    /// the prompt).
    ///
    /// # Errors
    /// Driver errors.
    pub fn generated(&self, cx: &CudaContext) -> Result<Vec<u32>, CudaError> {
        let n = self.host_pos + 1;
        let v = cx.stream().clone_dtoh(&self.ids.slice(..n.min(self.max_ctx)))?;
        Ok(v.get(self.host_fixed..).unwrap_or(&[]).iter().map(|&t| t as u32).collect())
    }

    /// Waits and returns the logits of the last step that ran the LM head [vocab rows]. With
    /// sampling on, the row as the sampler left it, like the CPU sampler: penalties applied,
    /// ids `>= vocab_limit` set to `-inf`.
    ///
    /// # Errors
    /// Driver errors.
    pub fn logits(&self, cx: &CudaContext) -> Result<Vec<f32>, CudaError> {
        Ok(cx.stream().clone_dtoh(&self.logits)?)
    }

    /// Waits and returns the device-side position (for checks).
    ///
    /// # Errors
    /// Driver errors.
    pub fn device_pos(&self, cx: &CudaContext) -> Result<usize, CudaError> {
        Ok(cx.stream().clone_dtoh(&self.pos)?[0] as usize)
    }
}
