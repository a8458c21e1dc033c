//! Batched prefill on the GPU: the prompt runs in chunks of up to `max_t` tokens, every layer
//! as a few big kernels over the whole chunk instead of one decode step per token.
//!
//! Per chunk of `t` tokens starting at position `pos0` (MODEL.md §3.3; shapes `[t, ·]` f32):
//!
//! ```text
//! x = embed[ids[pos0 .. pos0+t]]                                  embed_rows
//! for each layer:
//!     u = ZNorm(x; input_layernorm)                                rms_norm_acts (t rows, bf16 GEMM input)
//!     GDN:  proj = u·[W_qkv|W_z|W_b|W_a]ᵀ ; o = chunked GDN (C = 64, state carried) ; h = x + o·W_outᵀ
//!     attn: proj = u·[W_q|W_k|W_v]ᵀ       ; o = flash attention over the KV cache    ; h = x + o·W_oᵀ
//!     u = ZNorm(h; post_attention_layernorm)
//!     router logits = u·[W_router|w_shared_gate]ᵀ ; top-k routing, tokens sorted by expert
//!     x = h + Σ_k w_k·down_e(SwiGLU(gate_up_e·u)) + σ(g)·shared(u)   grouped GEMMs + combine
//! ```
//!
//! then the last token's final norm, LM head and greedy pick, exactly as the decode step ends.
//! The norms before the GEMMs (input norm, post-attention norm, the GDN gated norm) and the
//! attention's flash epilogue write the GEMMs' bf16 activations themselves
//! ([`Prefiller::fused_norm_acts`]); the post-attention norm also writes f32 `u` for the
//! router, and every layer's input norm but the first runs inside the previous layer's MoE
//! combine ([`CudaContext::moe_down_grouped_acts`]). Matrix products run on tensor cores in
//! bf16 with f32 accumulation ([`crate::gemm`]); the GDN state, the residual stream and the
//! products' outputs stay f32.
//!
//! The grouped expert GEMMs read the experts in the [`DeviceQMat`] layout, while the decode
//! kernels read them in [`crate::moe::DeviceMoe`]'s own layout, so today the routed experts are
//! held twice on the device (about 2 × 17 GB at 4 bits for the full model; the H200 has 141 GB).
//! The prefill's copy holds its codes group-major in place ([`CudaContext::regroup_codes`]: a
//! K tile's rows contiguous, so only the GEMMs can read it) and its scales and biases a second
//! time, group-major ([`CudaContext::add_group_major`]; ~1/8 of the 4-bit codes' bytes again,
//! about 2 GB).

use cudarc::driver::{CudaFunction, CudaSlice, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig};
use model::load::Weights;
use quant::{Bits, QMatRef};
use spec::production as p;

use crate::attn_prefill::AttnPrefillScratch;
use crate::decode::{CudaModel, CudaSession, DeviceLayerState, DeviceMixer};
use crate::gdn::GDN_PROJ;
use crate::gdn_prefill::GdnPrefillScratch;
use crate::gemm::{Epilogue, GemmScratch, MoeRouting};
use crate::attention::ATTN_PROJ;
use crate::{CudaContext, CudaError, DeviceQMat};

/// One layer's MoE weights in the layout of the grouped GEMMs. The expert and shared-expert
/// matrices hold their codes group-major in place ([`DeviceQMat::codes_group_major`],
/// [`CudaContext::regroup_codes`]: readable by the GEMMs only) and a group-major copy of their
/// scales and biases ([`DeviceQMat::group_major`], [`CudaContext::add_group_major`]: one more
/// u32 per 64 weights, ~1/8 of the 4-bit codes' bytes again). The router keeps the MLX layout
/// (the router kernels read it).
pub struct PrefillMoe {
    /// `[N_EXPERTS + 1, D_MODEL]`: router rows, then the shared-expert gate row.
    pub router: DeviceQMat,
    /// `[N_EXPERTS · 2 · D_EXPERT, D_MODEL]`: per expert its gate rows, then its up rows.
    pub gate_up: DeviceQMat,
    /// `[N_EXPERTS · D_MODEL, D_EXPERT]`: per expert its down rows.
    pub down: DeviceQMat,
    /// `[2 · D_SHARED_EXPERT, D_MODEL]`: shared expert gate rows, then up rows.
    pub shared_gate_up: DeviceQMat,
    /// `[D_MODEL, D_SHARED_EXPERT]`.
    pub shared_down: DeviceQMat,
}

fn qref<'a>(what: String, l: &'a model::linear::Linear) -> Result<QMatRef<'a>, CudaError> {
    l.qref().ok_or_else(|| CudaError::Unsupported(format!("{what} is stored as floats; the CUDA backend needs a quantized checkpoint")))
}

impl PrefillMoe {
    /// Uploads layer `l`'s MoE weights restacked for the grouped GEMMs.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when a weight is not quantized or the parts stacked into one
    /// matrix differ in format (naming them); driver errors.
    pub fn upload(cx: &CudaContext, l: usize, m: &model::load::MoeWeights) -> Result<Self, CudaError> {
        let name = |s: &str| format!("layers.{l}.mlp.{s}");
        let router = cx
            .upload_qmat_rows(&[qref(name("gate"), &m.router)?, qref(name("shared_expert_gate"), &m.shared_gate)?])
            .map_err(|e| CudaError::Unsupported(format!("layer {l}: router and shared-expert gate: {e}")))?;
        let mut gu = Vec::with_capacity(2 * m.experts.len());
        let mut dn = Vec::with_capacity(m.experts.len());
        for (e, x) in m.experts.iter().enumerate() {
            gu.push(qref(name(&format!("experts.{e}.gate_proj")), &x.gate)?);
            gu.push(qref(name(&format!("experts.{e}.up_proj")), &x.up)?);
            dn.push(qref(name(&format!("experts.{e}.down_proj")), &x.down)?);
        }
        let mut pm = PrefillMoe {
            router,
            gate_up: cx.upload_qmat_rows(&gu)?,
            down: cx.upload_qmat_rows(&dn)?,
            shared_gate_up: cx.upload_qmat_rows(&[
                qref(name("shared_expert.gate_proj"), &m.shared.gate)?,
                qref(name("shared_expert.up_proj"), &m.shared.up)?,
            ])?,
            shared_down: cx.upload_qmat(qref(name("shared_expert.down_proj"), &m.shared.down)?)?,
        };
        // the shared expert's dense products on bf16 copies too, where asked for
        // (crate::gemm::default_gemm_bf16_weights; ~6 MB per layer), made from the MLX layout
        if crate::gemm::default_gemm_bf16_weights() {
            cx.add_bf16_weights(&mut pm.shared_gate_up)?;
            cx.add_bf16_weights(&mut pm.shared_down)?;
        }
        // the GEMMs' coalesced scale/bias copies and their codes group-major in place (these
        // copies serve the prefill GEMMs only); not the router's: its kernels read the MLX layout
        for w in [&mut pm.gate_up, &mut pm.down, &mut pm.shared_gate_up, &mut pm.shared_down] {
            cx.add_group_major(w)?;
            cx.regroup_codes(w)?;
        }
        Ok(pm)
    }
}

/// Whether a [`Prefiller`] starts with the f32-chain router ([`Prefiller::router_f32`]) unless
/// [`set_default_router_f32`] says otherwise. Off: the integer-product router is the default
/// since session 22. It measured 3.6-7.0% faster prefill on the H200 than the f32 chains at 512
/// to 8,192 tokens and is closer to the exact sum (docs/CUDA.md "Session 21"), and `calla
/// cuda-check --pdl --prefill-router digits` passes with it.
pub const ROUTER_F32_DEFAULT: bool = false;

static DEFAULT_ROUTER_F32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(ROUTER_F32_DEFAULT);

/// The router every [`Prefiller`] created afterwards starts with ([`Prefiller::router_f32`]):
/// the f32 chains when `on`, else the integer products. Process-wide, so that the engine's
/// accelerator and a tool's own prefiller agree (`calla cuda-check --prefill-router`).
pub fn set_default_router_f32(on: bool) {
    DEFAULT_ROUTER_F32.store(on, std::sync::atomic::Ordering::Relaxed);
}

static DEFAULT_FUSED_NORM_ACTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether every [`Prefiller`] created afterwards starts with [`Prefiller::fused_norm_acts`]
/// (default `true`). Process-wide, like [`set_default_router_f32`] (`calla cuda-check
/// --prefill-norm-acts-apart`).
pub fn set_default_fused_norm_acts(on: bool) {
    DEFAULT_FUSED_NORM_ACTS.store(on, std::sync::atomic::Ordering::Relaxed);
}

static DEFAULT_EAGER_PDL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether every [`Prefiller`] created afterwards starts with [`Prefiller::eager_pdl`] (default
/// `true`). Process-wide, like [`set_default_router_f32`] (`calla cuda-bench | cuda-check
/// --prefill-no-pdl`).
pub fn set_default_eager_pdl(on: bool) {
    DEFAULT_EAGER_PDL.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Buffers and weights of the batched prefill, for chunks of up to `max_t` tokens.
pub struct Prefiller {
    max_t: usize,
    moe: Vec<PrefillMoe>,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    u: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    mix: CudaSlice<f32>,
    router_logits: CudaSlice<f32>,
    shared_act: CudaSlice<f32>,
    shared_out: CudaSlice<f32>,
    gemm: GemmScratch,
    /// The shared expert's stream (a [`CudaContext::sibling`]), its own GEMM scratch and the
    /// events that order it against the main stream: "u is ready" (main → side) and "the
    /// shared expert's output is ready" (side → main).
    side: SharedExpertStream,
    /// Run the shared expert on the side stream, overlapping the routing and the routed
    /// experts (default `true`; `false` queues it on the main stream between them, as when
    /// profiling). For measurement (`calla cuda-bench --prefill-compare`).
    pub overlap_shared_expert: bool,
    /// Compute the router logits as sequential f32 chains ([`CudaContext::router_logits_f32`])
    /// instead of from integer products on the tensor cores
    /// ([`CudaContext::router_logits_digits`]). Both are about as accurate (the integer
    /// products somewhat more); for measurement (`calla cuda-bench --prefill-compare`,
    /// `--prefill-router`). Starts as [`set_default_router_f32`] last set
    /// ([`ROUTER_F32_DEFAULT`] unless set).
    pub router_f32: bool,
    /// Write the GEMMs' bf16 activations straight from the norms (`true`, the default): the
    /// input norm (fused into the previous layer's MoE combine,
    /// [`CudaContext::moe_down_grouped_acts`], from the second layer on), the post-attention
    /// norm ([`CudaContext::rms_norm_acts`]; the shared expert reads the main stream's copy)
    /// the GDN gated norm ([`CudaContext::gdn_prefill_acts`]) and the attention's flash
    /// epilogue for `o_proj` ([`CudaContext::attn_prefill_acts`]), instead of f32 rows that
    /// [`CudaContext::convert_acts`] reads again. The same bits; for measurement (`calla
    /// cuda-bench --prefill-compare`). Starts as
    /// [`set_default_fused_norm_acts`] last set.
    pub fused_norm_acts: bool,
    /// Launch the chunk's kernels with programmatic dependent launch
    /// ([`CudaContext::set_eager_pdl`], [`crate::launch`]): each kernel's grid is set up while
    /// the previous one drains and waits in `calla_pdl_wait()` for its results, instead of a
    /// full stream boundary between every two of the ~700 launches of a prefill. The same
    /// results; `false` for measurement (`calla cuda-bench --prefill-compare`, `--prefill-no-pdl`).
    /// Starts as [`set_default_eager_pdl`] last set (on unless set).
    pub eager_pdl: bool,
    /// Let the shared expert's GEMMs on the side stream split over K like the main stream's
    /// ([`CudaContext::set_gemm_splitk`]; `false`, the default: never). Split, a GEMM whose grid
    /// leaves SMs idle fills them, but on the side stream those SMs belong to the router and the
    /// routing beside it: at 1,024 tokens the shared gate/up split in two (and its reduction)
    /// made the whole prefill 2.5% slower than with this off (`cuda-bench --prefill-compare`,
    /// session 29; +0.6-1.1% at 16-512 tokens, within noise from 2k). Only masks the side
    /// context's [`CudaContext::set_gemm_splitk`]: with that off, nothing splits either way.
    /// For measurement (`calla cuda-bench --prefill-compare`).
    pub side_splitk: bool,
    routing: MoeRouting,
    gdn: GdnPrefillScratch,
    attn: AttnPrefillScratch,
    /// When set, every chunk records `blk.{l}.mixer_out` (`h − x`), `blk.{l}.moe_out` and
    /// `blk.{l}.out` (`[t, D_MODEL]`, downloaded: slow, for checks against the CPU trace).
    pub trace: Option<Vec<(String, Vec<f32>)>>,
    /// When set, the prefill records a timed event at the end of each phase (embedding, norms,
    /// projections, GDN / attention core, router, routing, expert GEMMs, ...): what
    /// [`Prefiller::take_profile`] adds up. Events cost a little; for `calla cuda-bench
    /// --prefill-profile` only.
    pub profile: Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
}

impl Prefiller {
    /// Uploads the prefill layout of the MoE weights of `w` and allocates buffers for chunks of
    /// up to `max_t` tokens (about 260 kB per token of chunk, 2.1 GB at 8,192, plus the weights).
    ///
    /// # Errors
    /// As [`PrefillMoe::upload`]; [`CudaError::Unsupported`] when a layer's stacked input
    /// projection has parts of different formats (the batched GEMM needs one matrix); driver
    /// errors (out of memory).
    pub fn new(cx: &CudaContext, m: &CudaModel, w: &Weights, max_t: usize) -> Result<Self, CudaError> {
        if max_t == 0 {
            return Err(CudaError::Unsupported("prefill chunk of 0 tokens".into()));
        }
        for (l, lw) in m.layers.iter().enumerate() {
            let runs = lw.mixer.input_projection().runs.len();
            if runs != 1 {
                return Err(CudaError::Unsupported(format!(
                    "layer {l}: the stacked input projections are stored in {runs} different formats; \
                     batched prefill needs them in one (use token-by-token prefill)"
                )));
            }
        }
        let moe = w
            .layers
            .iter()
            .enumerate()
            .map(|(l, lw)| PrefillMoe::upload(cx, l, &lw.moe))
            .collect::<Result<Vec<_>, _>>()?;
        let st = cx.stream();
        let d = p::D_MODEL;
        Ok(Prefiller {
            max_t,
            moe,
            x: st.alloc_zeros(max_t * d)?,
            h: st.alloc_zeros(max_t * d)?,
            u: st.alloc_zeros(max_t * d)?,
            proj: st.alloc_zeros(max_t * GDN_PROJ.max(ATTN_PROJ))?,
            mix: st.alloc_zeros(max_t * (p::N_V_HEADS * p::D_V).max(p::N_Q_HEADS * p::HEAD_DIM))?,
            router_logits: st.alloc_zeros(max_t * (p::N_EXPERTS + 1))?,
            shared_act: st.alloc_zeros(max_t * p::D_SHARED_EXPERT)?,
            shared_out: st.alloc_zeros(max_t * d)?,
            gemm: cx.gemm_scratch(max_t)?,
            side: SharedExpertStream::new(cx, max_t)?,
            overlap_shared_expert: true,
            router_f32: DEFAULT_ROUTER_F32.load(std::sync::atomic::Ordering::Relaxed),
            fused_norm_acts: DEFAULT_FUSED_NORM_ACTS.load(std::sync::atomic::Ordering::Relaxed),
            eager_pdl: DEFAULT_EAGER_PDL.load(std::sync::atomic::Ordering::Relaxed),
            side_splitk: false,
            routing: cx.moe_routing(max_t)?,
            gdn: cx.gdn_prefill_scratch(max_t)?,
            attn: cx.attn_prefill_scratch(max_t)?,
            trace: None,
            profile: None,
        })
    }

    /// The GDN prefill's product arithmetic (its scratch's [`GdnPrefillScratch::math`]).
    pub fn gdn_math(&self) -> crate::gdn_prefill::GdnPrefillMath {
        self.gdn.math()
    }

    /// Sets the GDN prefill's product arithmetic for later chunks (measurement; `calla
    /// cuda-bench --prefill-compare`).
    #[doc(hidden)]
    pub fn set_gdn_math(&mut self, math: crate::gdn_prefill::GdnPrefillMath) {
        self.gdn.set_math(math);
    }

    /// Whether the GDN prefill's TF32 prep runs session 52's lean form
    /// ([`GdnPrefillScratch::set_prep_lean`]).
    pub fn gdn_prep_lean(&self) -> bool {
        self.gdn.prep_lean()
    }

    /// Sets [`GdnPrefillScratch::set_prep_lean`] for later chunks (measurement;
    /// `calla cuda-bench --prefill-compare`).
    #[doc(hidden)]
    pub fn set_gdn_prep_lean(&mut self, on: bool) {
        self.gdn.set_prep_lean(on);
    }

    /// Whether the lean prep's `Tm` products are balanced over the warps
    /// ([`GdnPrefillScratch::set_prep_balanced`]).
    pub fn gdn_prep_balanced(&self) -> bool {
        self.gdn.prep_balanced()
    }

    /// Sets [`GdnPrefillScratch::set_prep_balanced`] for later chunks (measurement;
    /// `calla cuda-bench --prefill-compare`).
    #[doc(hidden)]
    pub fn set_gdn_prep_balanced(&mut self, on: bool) {
        self.gdn.set_prep_balanced(on);
    }

    /// Whether the GDN layers' gated norm runs inside the state kernel
    /// ([`GdnPrefillScratch::set_fused_norm`]).
    pub fn gdn_fused_norm(&self) -> bool {
        self.gdn.fused_norm()
    }

    /// Sets [`GdnPrefillScratch::set_fused_norm`] for later chunks (measurement;
    /// `calla cuda-bench --prefill-compare`).
    #[doc(hidden)]
    pub fn set_gdn_fused_norm(&mut self, on: bool) {
        self.gdn.set_fused_norm(on);
    }

    /// Whether that fused norm exchanges through global memory
    /// ([`GdnPrefillScratch::set_fused_norm_global`]).
    pub fn gdn_fused_norm_global(&self) -> bool {
        self.gdn.fused_norm_global()
    }

    /// Sets [`GdnPrefillScratch::set_fused_norm_global`] for later chunks (measurement;
    /// `calla cuda-bench --prefill-compare`).
    #[doc(hidden)]
    pub fn set_gdn_fused_norm_global(&mut self, on: bool) {
        self.gdn.set_fused_norm_global(on);
    }

    /// Applies a context setting `f` to `cx` (the context this prefiller runs on) and to the
    /// shared expert's stream's context, so both streams' GEMMs run alike: e.g.
    /// `pf.on_contexts(&cx, |c| c.set_gemm_lean(false))`. For the measurement switches of
    /// [`CudaContext`] (`set_gemm_group_major`, `set_gemm_lean`, `set_gemm_grouped3`,
    /// `set_gemm_fit_n`, `set_gemm_splitk`, `set_moe_slot_bf16`; `calla cuda-bench
    /// --prefill-compare`). The side stream's split over K is further masked by
    /// [`Prefiller::side_splitk`] while a chunk runs.
    #[doc(hidden)]
    pub fn on_contexts(&self, cx: &CudaContext, f: impl Fn(&CudaContext)) {
        f(cx);
        f(&self.side.cx);
    }

    /// Largest chunk in tokens.
    pub fn max_t(&self) -> usize {
        self.max_t
    }

    /// Waits for the profiled work and returns the GPU time of each phase in milliseconds,
    /// summed over layers and chunks, in the order the phases first ran (the first event is
    /// the reference and takes no time). Turns profiling off.
    ///
    /// # Errors
    /// Driver errors; [`CudaError::Unsupported`] when profiling was not on.
    pub fn take_profile(&mut self) -> Result<Vec<(&'static str, f64)>, CudaError> {
        let ev = self.profile.take().ok_or_else(|| CudaError::Unsupported("prefill profiling was not on".into()))?;
        let mut out: Vec<(&'static str, f64)> = Vec::new();
        if let Some((_, last)) = ev.last() {
            last.synchronize()?;
        }
        for w in ev.windows(2) {
            let ms = f64::from(w[0].1.elapsed_ms(&w[1].1)?);
            match out.iter_mut().find(|(n, _)| *n == w[1].0) {
                Some((_, t)) => *t += ms,
                None => out.push((w[1].0, ms)),
            }
        }
        Ok(out)
    }

    /// Runs tokens `pos0 .. pos0 + t` of the session's history through every layer, updating
    /// its GDN state and KV cache; the chunk's last hidden state ends in row `t - 1` of `x`.
    /// The chunk's kernels are launched with programmatic dependent launch when
    /// [`Prefiller::eager_pdl`] is on, and the side stream's GEMMs split over K only with
    /// [`Prefiller::side_splitk`]; the contexts' previous settings are restored afterwards.
    fn chunk(&mut self, cx: &CudaContext, m: &CudaModel, s: &mut CudaSession, pos0: usize, t: usize) -> Result<(), CudaError> {
        let was = (cx.eager_pdl(), self.side.cx.eager_pdl(), self.side.cx.gemm_splitk());
        cx.set_eager_pdl(self.eager_pdl);
        self.side.cx.set_eager_pdl(self.eager_pdl);
        self.side.cx.set_gemm_splitk(was.2 && self.side_splitk);
        let r = self.chunk_layers(cx, m, s, pos0, t);
        cx.set_eager_pdl(was.0);
        self.side.cx.set_eager_pdl(was.1);
        self.side.cx.set_gemm_splitk(was.2);
        r
    }

    fn chunk_layers(&mut self, cx: &CudaContext, m: &CudaModel, s: &mut CudaSession, pos0: usize, t: usize) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        mark(&mut self.profile, cx, "begin, restore, between chunks")?;
        embed_rows(cx, &mut self.x, &m.embed, &s.ids, pos0, t)?;
        mark(&mut self.profile, cx, "embedding")?;
        let st = cx.stream().clone();
        let mut x_in = Vec::new();
        let hist_row = s.expert_hist_rows(cx);
        // with the fused norms: the previous layer's MoE combine wrote this layer's input-norm
        // activations already (moe_down_grouped_acts)
        let mut acts_ready = false;
        for (l, ((lw, ls), pm)) in m.layers.iter().zip(s.layers.iter_mut()).zip(&self.moe).enumerate() {
            if self.trace.is_some() {
                x_in = st.clone_dtoh(&self.x.slice(..t * d))?;
            }
            let fused = self.fused_norm_acts;
            if fused {
                // u as bf16 GEMM activations only: nothing else reads the input norm's rows
                if !acts_ready {
                    cx.rms_norm_acts(None, &self.x.slice(..t * d), &lw.input_norm.slice(..), t, &mut self.gemm)?;
                }
            } else {
                cx.rms_norm(&mut self.u.slice_mut(..t * d), &self.x.slice(..t * d), &lw.input_norm.slice(..))?;
            }
            mark(&mut self.profile, cx, "rms norms")?;
            // the stacked input projection on the normed rows (converted by the GEMM call when
            // the norm wrote f32)
            let in_proj_gemm = |cx: &CudaContext, y: &mut CudaViewMut<'_, f32>, w: &DeviceQMat, u: &CudaSlice<f32>, gemm: &mut GemmScratch| {
                if fused {
                    cx.qgemm_converted(y, w, gemm, t, Epilogue::Store)
                } else {
                    cx.qgemm(y, w, &u.slice(..t * d), t, gemm)
                }
            };
            match (&lw.mixer, ls) {
                (DeviceMixer::Gdn { in_proj, conv_w, a_neg_exp, dt_bias, norm, out_proj, .. }, DeviceLayerState::Gdn { conv, s }) => {
                    let n_out = p::N_V_HEADS * p::D_V;
                    in_proj_gemm(cx, &mut self.proj.slice_mut(..t * GDN_PROJ), &in_proj.runs[0].0, &self.u, &mut self.gemm)?;
                    mark(&mut self.profile, cx, "GDN in_proj GEMM")?;
                    {
                        let (proj, mut mix) = (self.proj.slice(..t * GDN_PROJ), self.mix.slice_mut(..t * n_out));
                        let (conv_w, a_neg_exp, dt_bias, norm) = (conv_w.slice(..), a_neg_exp.slice(..), dt_bias.slice(..), norm.slice(..));
                        let (mut conv, mut s) = (conv.slice_mut(..), s.slice_mut(..));
                        if fused {
                            // the gated norm writes out_proj's bf16 activations; mix holds the raw o
                            // (unless the state kernel normalizes itself: GdnPrefillScratch::set_fused_norm)
                            cx.gdn_prefill_acts(&proj, t, &conv_w, &a_neg_exp, &dt_bias, &norm, &mut conv, &mut s, &mut self.gdn, &mut mix, &mut self.gemm)?;
                        } else {
                            cx.gdn_prefill(&proj, t, &conv_w, &a_neg_exp, &dt_bias, &norm, &mut conv, &mut s, &mut self.gdn, &mut mix)?;
                        }
                    }
                    mark(&mut self.profile, cx, "GDN chunked core")?;
                    if fused {
                        cx.qgemm_converted(&mut self.h.slice_mut(..t * d), out_proj, &self.gemm, t, Epilogue::Residual(&self.x.slice(..t * d)))?;
                    } else {
                        cx.qgemm_residual(&mut self.h.slice_mut(..t * d), out_proj, &self.mix.slice(..t * n_out), &self.x.slice(..t * d), t, &mut self.gemm)?;
                    }
                    mark(&mut self.profile, cx, "GDN out_proj GEMM")?;
                }
                (DeviceMixer::Attn { qkv, q_norm, k_norm, o_proj }, DeviceLayerState::Attn { k, v }) => {
                    let n_out = p::N_Q_HEADS * p::HEAD_DIM;
                    in_proj_gemm(cx, &mut self.proj.slice_mut(..t * ATTN_PROJ), &qkv.runs[0].0, &self.u, &mut self.gemm)?;
                    mark(&mut self.profile, cx, "attn q|gate|k|v GEMM")?;
                    let (proj, q_norm, k_norm, inv_freq) = (self.proj.slice(..t * ATTN_PROJ), q_norm.slice(..), k_norm.slice(..), m.inv_freq.slice(..));
                    let (mut k, mut v) = (k.slice_mut(..), v.slice_mut(..));
                    if fused {
                        // the flash epilogue writes o_proj's bf16 activations (no f32 rows)
                        cx.attn_prefill_acts(&proj, t, pos0, &q_norm, &k_norm, &inv_freq, &mut k, &mut v, &mut self.attn, &mut self.gemm)?;
                    } else {
                        cx.attn_prefill(&proj, t, pos0, &q_norm, &k_norm, &inv_freq, &mut k, &mut v, &mut self.attn, &mut self.mix.slice_mut(..t * n_out))?;
                    }
                    mark(&mut self.profile, cx, "attn flash core")?;
                    if fused {
                        cx.qgemm_converted(&mut self.h.slice_mut(..t * d), o_proj, &self.gemm, t, Epilogue::Residual(&self.x.slice(..t * d)))?;
                    } else {
                        cx.qgemm_residual(&mut self.h.slice_mut(..t * d), o_proj, &self.mix.slice(..t * n_out), &self.x.slice(..t * d), t, &mut self.gemm)?;
                    }
                    mark(&mut self.profile, cx, "attn o_proj GEMM")?;
                }
                _ => return Err(CudaError::Unsupported("layer state does not match its mixer".into())),
            }
            if let Some(tr) = self.trace.as_mut() {
                let h = st.clone_dtoh(&self.h.slice(..t * d))?;
                tr.push((format!("blk.{l}.mixer_out"), h.iter().zip(&x_in).map(|(a, b)| a - b).collect()));
                x_in = h;
            }
            if fused {
                // u in f32 for the router, and as bf16 activations for the grouped gate/up
                // and the shared expert
                cx.rms_norm_acts(Some(&mut self.u.slice_mut(..t * d)), &self.h.slice(..t * d), &lw.post_norm.slice(..), t, &mut self.gemm)?;
            } else {
                cx.rms_norm(&mut self.u.slice_mut(..t * d), &self.h.slice(..t * d), &lw.post_norm.slice(..))?;
            }
            mark(&mut self.profile, cx, "rms norms")?;
            // MoE: routing, the shared expert, the routed experts, the combine with the residual.
            // The shared expert depends on u only: unless serial, it runs on the side stream
            // beside the router, the routing and the grouped gate/up (whose SMs it fills: they
            // are latency-bound at small chunks), and the down + combine waits for it.
            let serial = self.profile.is_some() || !self.overlap_shared_expert;
            if !serial {
                self.side.fork_from(cx)?;
                let u_acts = if fused { Some(&self.gemm) } else { None };
                if let Err(e) = shared_expert(&self.side.cx, &mut self.side.gemm, u_acts, pm, &self.u, &mut self.shared_act, &mut self.shared_out, t) {
                    let _ = self.side.join_to(cx); // whatever was queued there finishes before u changes
                    return Err(e);
                }
            }
            let ne = p::N_EXPERTS + 1;
            // the routed experts' part on the main stream; the side stream is joined whether it
            // succeeds or not, so no later work on the main stream (or a retried chunk) can
            // overwrite u or read shared_out while the shared expert may still run
            let routed = (|| -> Result<(), CudaError> {
                if self.router_f32 {
                    cx.router_logits_f32(&mut self.router_logits, &pm.router, &self.u, t)?;
                    mark(&mut self.profile, cx, "router (f32)")?;
                } else {
                    cx.router_logits_digits(&mut self.router_logits, &pm.router, &self.u, t)?;
                    mark(&mut self.profile, cx, "router (integer products)")?;
                }
                self.routing.count_into = hist_row(l);
                let r = cx.moe_route(&self.router_logits.slice(..t * ne), t, &mut self.routing);
                self.routing.count_into = 0;
                r?;
                mark(&mut self.profile, cx, "top-k, count, sort")?;
                if let Some(tr) = self.trace.as_mut() {
                    let lg = st.clone_dtoh(&self.router_logits.slice(..t * ne))?;
                    let lg: Vec<f32> = lg.chunks_exact(ne).flat_map(|r| r[..p::N_EXPERTS].iter().copied()).collect();
                    tr.push((format!("blk.{l}.moe.router_logits"), lg));
                    let ids = st.clone_dtoh(&self.routing.ids.slice(..t * p::TOP_K))?;
                    tr.push((format!("blk.{l}.moe.topk_idx"), ids.iter().map(|&i| i as f32).collect()));
                }
                // the grouped gate/up GEMM reads the last converted activations: u (written by
                // the fused norm already)
                if !fused {
                    cx.convert_acts(&self.u.slice(..t * d), t, d, &mut self.gemm)?;
                    mark(&mut self.profile, cx, "activations to bf16")?;
                }
                cx.moe_gate_up_grouped(&pm.gate_up, &self.gemm, &mut self.routing, t)?;
                mark(&mut self.profile, cx, "experts gate/up (grouped)")?;
                Ok(())
            })();
            if serial {
                routed?;
                // when profiling: serial, so that the phase marks above and below time one thing each
                // (with the fused norm, u's activations are in the main scratch, which the
                // gate/up left as they were; the down product's conversion then goes into the
                // idle side stream's scratch)
                if fused {
                    shared_expert(cx, &mut self.side.gemm, Some(&self.gemm), pm, &self.u, &mut self.shared_act, &mut self.shared_out, t)?;
                } else {
                    shared_expert(cx, &mut self.gemm, None, pm, &self.u, &mut self.shared_act, &mut self.shared_out, t)?;
                }
                mark(&mut self.profile, cx, "shared expert")?;
            } else {
                let joined = self.side.join_to(cx);
                routed?;
                joined?;
            }
            // with the fused norms, the combine also writes the next layer's input-norm
            // activations (the last layer's output goes to the final norm of one row instead)
            {
                let (mut xv, hv, sv) = (self.x.slice_mut(..t * d), self.h.slice(..t * d), self.shared_out.slice(..t * d));
                match m.layers.get(l + 1).filter(|_| fused) {
                    Some(next) => {
                        let nw = next.input_norm.slice(..);
                        cx.moe_down_grouped_acts(&mut xv, &pm.down, &mut self.routing, &hv, &sv, t, &nw, &mut self.gemm)?;
                        acts_ready = true;
                    }
                    None => {
                        cx.moe_down_grouped(&mut xv, &pm.down, &mut self.routing, &hv, &sv, t)?;
                        acts_ready = false;
                    }
                }
            }
            mark(&mut self.profile, cx, "experts down + combine (grouped)")?;
            if let Some(tr) = self.trace.as_mut() {
                let x = st.clone_dtoh(&self.x.slice(..t * d))?;
                tr.push((format!("blk.{l}.moe_out"), x.iter().zip(&x_in).map(|(a, b)| a - b).collect()));
                tr.push((format!("blk.{l}.out"), x));
            }
        }
        Ok(())
    }
}

impl Drop for Prefiller {
    /// Waits for the side stream before the buffers it may still use (`u`, the shared expert's
    /// input and outputs) are freed on the main stream.
    fn drop(&mut self) {
        let _ = self.side.cx.stream().synchronize();
    }
}

/// The shared expert of one MoE block on a chunk's `t` rows of `u`:
/// `shared_out = down(silu(gate·u)·(up·u))` (its sigmoid gate is applied by the combine), on
/// `sx`'s stream with `scratch`. `u_acts`: a scratch that already holds `u` as bf16
/// activations (read, not written), or `None` to convert `u` into `scratch`.
#[allow(clippy::too_many_arguments)]
fn shared_expert(
    sx: &CudaContext,
    scratch: &mut GemmScratch,
    u_acts: Option<&GemmScratch>,
    pm: &PrefillMoe,
    u: &CudaSlice<f32>,
    act: &mut CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    t: usize,
) -> Result<(), CudaError> {
    let (d, ds) = (p::D_MODEL, p::D_SHARED_EXPERT);
    match u_acts {
        Some(ua) => sx.qgemm_converted(&mut act.slice_mut(..t * ds), &pm.shared_gate_up, ua, t, Epilogue::SwiGlu)?,
        None => sx.qgemm_swiglu(&mut act.slice_mut(..t * ds), &pm.shared_gate_up, &u.slice(..t * d), t, scratch)?,
    }
    sx.qgemm(&mut out.slice_mut(..t * d), &pm.shared_down, &act.slice(..t * ds), t, scratch)?;
    Ok(())
}

/// A second stream for the prefill's shared expert (see [`Prefiller`]): a sibling context, a
/// GEMM scratch of its own (the main stream's holds the converted MoE input that the grouped
/// gate/up reads meanwhile) and two reusable events.
struct SharedExpertStream {
    cx: CudaContext,
    gemm: GemmScratch,
    u_ready: cudarc::driver::CudaEvent,
    out_ready: cudarc::driver::CudaEvent,
}

impl SharedExpertStream {
    fn new(cx: &CudaContext, max_t: usize) -> Result<Self, CudaError> {
        let side = cx.sibling()?;
        let gemm = side.gemm_scratch(max_t)?;
        // the scratch is allocated on the side stream: complete before either stream uses it
        side.stream().synchronize()?;
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        Ok(SharedExpertStream { u_ready: cx.raw().new_event(flags)?, out_ready: cx.raw().new_event(flags)?, cx: side, gemm })
    }

    /// The side stream waits for everything queued on `cx`'s stream so far (u written, and the
    /// previous layer's combine done with the shared expert's buffers).
    fn fork_from(&self, cx: &CudaContext) -> Result<(), CudaError> {
        self.u_ready.record(cx.stream())?;
        self.cx.stream().wait(&self.u_ready)?;
        Ok(())
    }

    /// `cx`'s stream waits for everything queued on the side stream so far (the shared
    /// expert's output).
    fn join_to(&self, cx: &CudaContext) -> Result<(), CudaError> {
        self.out_ready.record(self.cx.stream())?;
        cx.stream().wait(&self.out_ready)?;
        Ok(())
    }
}

/// Records the end of phase `name` when profiling (see [`Prefiller::profile`]).
fn mark(profile: &mut Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>, cx: &CudaContext, name: &'static str) -> Result<(), CudaError> {
    if let Some(p) = profile.as_mut() {
        p.push((name, cx.stream().record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?));
    }
    Ok(())
}

impl CudaContext {
    /// The prefill's MoE router logits in exact f32 (the bf16 tensor-core GEMM would flip
    /// near-tied top-k choices): `y[i, r] = Σ_k W[r, k]·u[i, k]` for `i < t`,
    /// `W` a quantized `[rows, D_MODEL]` matrix (router rows, then the shared-expert gate row),
    /// `u` `[t, D_MODEL]`, `y` `[t, rows]`; each output one f32 sum of fmas in `k` order over
    /// the dequantized weights (`quant::dequantize`'s arithmetic), so it equals that sum on
    /// the CPU bit for bit (`kernels/prefill.cu`, `router_f32_q*`). The block tile (32 or 64
    /// tokens) is picked by [`router_wide_tile`].
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for other widths or short buffers; driver errors.
    pub fn router_logits_f32(&self, y: &mut CudaSlice<f32>, w: &DeviceQMat, u: &CudaSlice<f32>, t: usize) -> Result<(), CudaError> {
        self.router_logits_f32_tile(y, w, u, t, router_wide_tile(t, w.rows, self.sm_count() as usize))
    }

    /// [`Self::router_logits_f32`] with the block tile chosen by the caller: `wide` = 64 tokens
    /// × 32 rows per block (16 outputs per thread), else 32 × 32 (8 per thread). The same bits
    /// either way; for the self-test and the measurements behind [`router_wide_tile`].
    #[doc(hidden)]
    pub fn router_logits_f32_tile(&self, y: &mut CudaSlice<f32>, w: &DeviceQMat, u: &CudaSlice<f32>, t: usize, wide: bool) -> Result<(), CudaError> {
        let n = w.rows;
        if w.cols != p::D_MODEL || y.len() < t * n || u.len() < t * p::D_MODEL {
            return Err(CudaError::Unsupported(format!("router_f32: W [{n}, {}], {t} tokens", w.cols)));
        }
        if t == 0 {
            return Ok(());
        }
        let f = self.func(match (w.bits, wide) {
            (Bits::B4, false) => "router_f32_q4",
            (Bits::B8, false) => "router_f32_q8",
            (Bits::B4, true) => "router_f32w_q4",
            (Bits::B8, true) => "router_f32w_q8",
        })?;
        let bt = if wide { 64 } else { 32 };
        let cfg = LaunchConfig { grid_dim: (n.div_ceil(32) as u32, t.div_ceil(bt) as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: y holds t·n f32, u holds t·D_MODEL f32, W matches the kernel layout (checked).
        unsafe { self.launch_router(f, cfg, y, w, u, t) }
    }

    /// Launches a router entry point (`router_f32*_q*` or `router_dg_q*_p*`, which take the same
    /// arguments: `y, packed, scales, biases, u, t, n`) on the stream.
    ///
    /// # Safety
    /// The caller has checked the shapes against what the entry point reads and writes at
    /// `cfg`: `y` holds `t · w.rows` f32, `u` `t · D_MODEL` f32.
    unsafe fn launch_router(&self, f: &CudaFunction, cfg: LaunchConfig, y: &mut CudaSlice<f32>, w: &DeviceQMat, u: &CudaSlice<f32>, t: usize) -> Result<(), CudaError> {
        let st = self.stream();
        let (py, _g0) = y.device_ptr_mut(st);
        let (pp, _g1) = w.mlx_codes()?.device_ptr(st);
        let (ps, _g2) = w.scales.device_ptr(st);
        let (pb, _g3) = w.biases.device_ptr(st);
        let (pu, _g4) = u.device_ptr(st);
        let (t32, n32) = (t as i32, w.rows as i32);
        let mut b = self.kernel(f);
        b.arg(&py).arg(&pp).arg(&ps).arg(&pb).arg(&pu).arg(&t32).arg(&n32);
        // SAFETY: as the caller promised.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

impl CudaContext {
    /// The prefill's MoE router logits from exact integer products on the tensor cores:
    /// `y[i, r] = Σ_k W[r, k]·u[i, k]` for `i < t`, `W` a quantized `[rows, D_MODEL]` matrix
    /// (router rows, then the shared-expert gate row; `rows <= N_EXPERTS + 1`), `u`
    /// `[t, D_MODEL]`, `y` `[t, rows]`. Each 64-column group of `u` becomes four balanced
    /// base-256 digits of `round(u · 2^(30−E))` and meets the weight codes in int32
    /// (`kernels/prefill.cu`, `router_dg_*`): about as accurate as the f32 chain of
    /// [`Self::router_logits_f32`] (error ~1e-7 of `Σ|W·u|` on the self-test's inputs, where
    /// the chain's is ~3e-7), not the same bits. A
    /// non-finite value in a token's `u` makes that token's logits NaN. The block tile (8 or 16
    /// tokens) is picked by [`router_digits_pairs`].
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for other widths, too many rows or short buffers; driver errors.
    pub fn router_logits_digits(&self, y: &mut CudaSlice<f32>, w: &DeviceQMat, u: &CudaSlice<f32>, t: usize) -> Result<(), CudaError> {
        let sms = self.sm_count() as usize;
        let pairs = router_digits_pairs(t, sms);
        self.router_logits_digits_tile(y, w, u, t, pairs, router_digits_split(t, pairs, sms))
    }

    /// [`Self::router_logits_digits`] with `2 · pairs` tokens per block (`pairs` 4 or 8) and
    /// the 32 column groups split over a cluster of `split` blocks (1, or 2, 4, 8 with
    /// `pairs` = 4) chosen by the caller. The tiles give the same bits; a split restarts the
    /// two chains per block and adds the blocks' sums in order (other bits, the same bound).
    /// For the self-test and the measurements behind [`router_digits_pairs`] and
    /// [`router_digits_split`].
    #[doc(hidden)]
    pub fn router_logits_digits_tile(&self, y: &mut CudaSlice<f32>, w: &DeviceQMat, u: &CudaSlice<f32>, t: usize, pairs: usize, split: usize) -> Result<(), CudaError> {
        let n = w.rows;
        if w.cols != p::D_MODEL || n == 0 || n > p::N_EXPERTS + 1 || y.len() < t * n || u.len() < t * p::D_MODEL {
            return Err(CudaError::Unsupported(format!(
                "router_digits: W [{n}, {}] (at most {} rows of {}), {t} tokens, y of {} and u of {} f32",
                w.cols,
                p::N_EXPERTS + 1,
                p::D_MODEL,
                y.len(),
                u.len()
            )));
        }
        if t == 0 {
            return Ok(());
        }
        let name = match (w.bits, pairs, split) {
            (Bits::B4, 4, 1) => "router_dg_q4_p4",
            (Bits::B8, 4, 1) => "router_dg_q8_p4",
            (Bits::B4, 8, 1) => "router_dg_q4_p8",
            (Bits::B8, 8, 1) => "router_dg_q8_p8",
            (Bits::B4, 4, 2) => "router_dg_q4_p4_k2",
            (Bits::B4, 4, 4) => "router_dg_q4_p4_k4",
            (Bits::B4, 4, 8) => "router_dg_q4_p4_k8",
            (Bits::B8, 4, 2) => "router_dg_q8_p4_k2",
            (Bits::B8, 4, 4) => "router_dg_q8_p4_k4",
            (Bits::B8, 4, 8) => "router_dg_q8_p4_k8",
            _ => {
                return Err(CudaError::Unsupported(format!(
                    "router_digits: {pairs} token pairs per block (4 or 8), groups over {split} blocks (1, or 2, 4, 8 with 4 pairs)"
                )))
            }
        };
        let f = self.func(name)?;
        let warps = n.div_ceil(16);
        // the digits of the block's groups, then (split) the partial sums, [warps][pairs][32] f32 pairs
        let smem = 2 * pairs * ROUTER_DIGITS_TOKEN_BYTES / split + if split > 1 { warps * pairs * 32 * 8 } else { 0 };
        crate::allow_block_smem(f, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (t.div_ceil(2 * pairs) as u32, split as u32, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: y holds t·n f32, u holds t·D_MODEL f32, W matches the kernel layout, n rows
        // fit the block (checked).
        unsafe { self.launch_router(f, cfg, y, w, u, t) }
    }
}

/// Shared memory per token of the integer router (`DG_TOKEN_BYTES` in `kernels/prefill.cu`):
/// 32 groups × (4 digit rows of 64 bytes + an f32 pair).
const ROUTER_DIGITS_TOKEN_BYTES: usize = (p::D_MODEL / 64) * (256 + 8);

/// Token pairs per block of the integer router for a `t`-token chunk: 4 (8 tokens, more blocks
/// for short prompts) while that makes at most one block per SM, else 8 (half the weight reads
/// from L2 per token). Measured on the H200 (132 SMs, 257 rows, `cuda_selftest --only router`,
/// µs with 8 / 16 tokens per block, 4-bit; 8-bit alike): T = 512 31.6 / 48.1, 1,024 33.3 / 48.7,
/// 2,048 57.3 / 50.8, 8,192 206.7 / 186.3.
pub fn router_digits_pairs(t: usize, sm_count: usize) -> usize {
    if t.div_ceil(8) <= sm_count.max(1) { 4 } else { 8 }
}

/// Blocks (a thread-block cluster) the integer router's 32 column groups are split over for a
/// `t`-token chunk with `pairs` token pairs per block: with 8-token blocks, the largest of 8,
/// 4, 2 that keeps the grid within one block per SM (a block of 17 warps at 96 registers fills
/// an SM's registers), else 1. A short prompt's few blocks otherwise each walk all 32 groups
/// while most SMs idle.
pub fn router_digits_split(t: usize, pairs: usize, sm_count: usize) -> usize {
    if pairs != 4 {
        return 1;
    }
    let blocks = t.div_ceil(8);
    [8usize, 4, 2].into_iter().find(|&k| blocks * k <= sm_count.max(1)).unwrap_or(1)
}

/// Whether the f32 router of a `t`-token chunk over `rows` rows runs on the wide block tile (64
/// tokens x 32 rows, 16 outputs per thread) rather than the narrow one (32 x 32, 8 per
/// thread). The blocks are latency-bound (each output is a chain of D_MODEL dependent fmas), so
/// the time follows the outputs of the busiest SM: blocks per SM (rounded up) x outputs per
/// block, the narrow tile's outputs costing 1.25x the wide one's. Fitted on the H200
/// (`cuda_selftest --only gemm`, 257 rows, µs wide / narrow): T = 512 61 / 69, 1,024 96 / 90,
/// 2,048 126 / 139, 8,192 354 / 461; the model's wide / narrow ratios (0.80, 1.07, 0.96, 0.80)
/// are within 11% of those measured (0.89, 1.07, 0.91, 0.77) and pick the faster tile at all four.
pub fn router_wide_tile(t: usize, rows: usize, sm_count: usize) -> bool {
    let busiest = |bt: usize| (rows.div_ceil(32) * t.div_ceil(bt)).div_ceil(sm_count.max(1));
    // outputs of the busiest SM, in quarter-units of the wide tile's cost
    busiest(64) * 64 * 32 * 4 <= busiest(32) * 32 * 32 * 5
}

/// `x[i] = embed[ids[pos0 + i]]` for `i < t` (see `kernels/prefill.cu`).
fn embed_rows(cx: &CudaContext, x: &mut CudaSlice<f32>, embed: &DeviceQMat, ids: &CudaSlice<i32>, pos0: usize, t: usize) -> Result<(), CudaError> {
    if embed.cols != p::D_MODEL || x.len() < t * p::D_MODEL || pos0 + t > ids.len() {
        return Err(CudaError::Unsupported(format!(
            "embed_rows: embedding [{}, {}], {t} tokens at {pos0}, history of {}",
            embed.rows,
            embed.cols,
            ids.len()
        )));
    }
    let f = cx.func(match embed.bits {
        Bits::B4 => "embed_rows_q4",
        Bits::B8 => "embed_rows_q8",
    })?;
    let st = cx.stream();
    let (px, _gx) = x.device_ptr_mut(st);
    let (pp, _g1) = embed.mlx_codes()?.device_ptr(st);
    let (ps, _g2) = embed.scales.device_ptr(st);
    let (pb, _g3) = embed.biases.device_ptr(st);
    let (pi, _g4) = ids.device_ptr(st);
    let (pos0, t32, n_ids, n_rows) = (pos0 as i32, t as i32, ids.len() as i32, embed.rows as i32);
    let mut b = cx.kernel(f);
    b.arg(&px).arg(&pp).arg(&ps).arg(&pb).arg(&pi).arg(&pos0).arg(&t32).arg(&n_ids).arg(&n_rows);
    let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: ((p::D_MODEL / 8) as u32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: x holds t rows of D_MODEL, ids holds pos0 + t entries, the embedding matches the
    // kernel's layout (checked above).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// A sequence's state on the device after `tokens`: the GDN conv and recurrent state of every
/// linear-attention layer and the KV rows `0 .. tokens.len()` of every attention layer
/// (`SessionSnapshot::bytes`: about 63 MB plus 20 kB per token on the production model). The
/// GPU's prefix cache: Gated DeltaNet state cannot be truncated, so a later prompt reuses it
/// only when it starts with exactly `tokens` ([`CudaSession::start_batched_from`]).
pub struct SessionSnapshot {
    tokens: Vec<u32>,
    layers: Vec<DeviceLayerState>,
    /// The logits that followed `tokens` [vocab rows], as the LM head left them (before a
    /// sampler's penalties and masking): kept for the snapshot after a prompt, so that the same
    /// prompt again needs no prefill at all.
    logits: Option<CudaSlice<f32>>,
}

impl SessionSnapshot {
    /// The tokens whose state this is.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Whether it holds the logits after its tokens (a prompt equal to `tokens` can use it).
    pub fn has_logits(&self) -> bool {
        self.logits.is_some()
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        4 * self.logits.as_ref().map_or(0, |l| l.len())
            + self
            .layers
            .iter()
            .map(|l| match l {
                DeviceLayerState::Gdn { conv, s } => 4 * (conv.len() + s.len()),
                DeviceLayerState::Attn { k, v } => 2 * (k.len() + v.len()),
            })
            .sum::<usize>()
    }
}

impl CudaSession {
    /// Starts a sequence from scratch like [`CudaSession::start`], but runs the prompt through
    /// the batched prefill in chunks of `pf.max_t()` tokens; leaves the first generated token
    /// in the device history. Asynchronous: returns once the work is queued.
    ///
    /// # Errors
    /// As [`CudaSession::start`]; errors of the prefill kernels.
    pub fn start_batched(&mut self, cx: &CudaContext, m: &CudaModel, pf: &mut Prefiller, prompt: &[u32]) -> Result<(), CudaError> {
        self.start_batched_from(cx, m, pf, None, prompt, false).map(|_| ())
    }

    /// [`Self::start_batched`] continuing from `snap` (the state after a prefix of `prompt`):
    /// the state is copied back and only the rest of the prompt is prefilled (nothing at all
    /// when `prompt` equals the snapshot's tokens and it kept their logits). The result is the
    /// same as a fresh prefill of `prompt` up to the rounding of the bf16 prefill, whose chunks
    /// then start at the snapshot's end. With `keep`, returns a snapshot of the state after
    /// `prompt` with its logits (taken before the first token is picked; `None` when the device
    /// has no memory left for it).
    ///
    /// # Errors
    /// As [`Self::start_batched`]; [`CudaError::Unsupported`] when `prompt` does not start
    /// with `snap.tokens()`, equals them but the snapshot has no logits, or the snapshot is of
    /// another model's layout; driver errors (out of memory for the snapshot).
    pub fn start_batched_from(
        &mut self,
        cx: &CudaContext,
        m: &CudaModel,
        pf: &mut Prefiller,
        snap: Option<&SessionSnapshot>,
        prompt: &[u32],
        keep: bool,
    ) -> Result<Option<SessionSnapshot>, CudaError> {
        let c = snap.map_or(0, |s| s.tokens.len());
        if let Some(s) = snap {
            let usable = prompt.len() > c || (prompt.len() == c && s.logits.is_some());
            if !usable || !prompt.starts_with(&s.tokens) {
                return Err(CudaError::Unsupported(format!(
                    "a prompt of {} tokens does not extend the snapshot of {c} tokens{}",
                    prompt.len(),
                    if s.logits.is_some() { "" } else { " (which holds no logits)" }
                )));
            }
            if s.layers.len() != self.layers.len() {
                return Err(CudaError::Unsupported(format!("snapshot of {} layers for a model of {}", s.layers.len(), self.layers.len())));
            }
        }
        mark(&mut pf.profile, cx, "start")?;
        self.begin(cx, m, prompt)?;
        if let Some(s) = snap {
            let st = cx.stream().clone();
            for (to, from) in self.layers.iter_mut().zip(&s.layers) {
                match (to, from) {
                    (DeviceLayerState::Gdn { conv, s }, DeviceLayerState::Gdn { conv: c0, s: s0 }) if c0.len() == conv.len() && s0.len() == s.len() => {
                        st.memcpy_dtod(c0, conv)?;
                        st.memcpy_dtod(s0, s)?;
                    }
                    (DeviceLayerState::Attn { k, v }, DeviceLayerState::Attn { k: k0, v: v0 }) if k0.len() <= k.len() && v0.len() <= v.len() => {
                        st.memcpy_dtod(k0, &mut k.slice_mut(..k0.len()))?;
                        st.memcpy_dtod(v0, &mut v.slice_mut(..v0.len()))?;
                    }
                    _ => return Err(CudaError::Unsupported("snapshot layers do not match the session's".into())),
                }
            }
        }
        let n = prompt.len();
        let mut pos0 = c;
        let mut last_t = 0;
        while pos0 < n {
            let t = (n - pos0).min(pf.max_t);
            pf.chunk(cx, m, self, pos0, t)?;
            pos0 += t;
            last_t = t;
        }
        if last_t > 0 {
            // The last token's head, as the decode step ends: final norm, LM head.
            let d = p::D_MODEL;
            let last = pf.x.slice((last_t - 1) * d..last_t * d);
            cx.rms_norm(&mut self.u.slice_mut(..), &last, &m.final_norm.slice(..))?;
            cx.gemv(&mut self.logits.slice_mut(..), &m.lm_head, &self.u.slice(..))?;
        } else if let Some(l) = snap.and_then(|s| s.logits.as_ref()) {
            cx.stream().memcpy_dtod(l, &mut self.logits)?;
        }
        mark(&mut pf.profile, cx, "final norm, LM head")?;
        self.host_pos = n;
        let kept = if keep {
            match self.snapshot_with(cx, prompt, true) {
                Ok(s) => Some(s),
                // no room for the copy: the prompt still runs, without a snapshot
                Err(CudaError::Driver(e)) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => None,
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        // The pick (greedy or sampled) writes ids[n] and advances pos from n - 1 to n.
        cx.stream().memcpy_htod(&[(n - 1) as i32], &mut self.pos)?;
        self.pick(cx, m)?;
        mark(&mut pf.profile, cx, "pick")?;
        Ok(kept)
    }

    /// Copies the state after the tokens processed so far, which must be `tokens` (the prompt
    /// and the generated tokens fed back: `pos()` of them). Queued on the stream.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `tokens.len() != pos()`; driver errors (out of memory).
    pub fn snapshot(&self, cx: &CudaContext, tokens: &[u32]) -> Result<SessionSnapshot, CudaError> {
        self.snapshot_with(cx, tokens, false)
    }

    /// Device bytes of a [`SessionSnapshot`] after `n` tokens, its logits included.
    pub fn snapshot_bytes(&self, n: usize) -> usize {
        let w = n * p::N_KV_HEADS * p::HEAD_DIM;
        4 * self.logits.len()
            + self
                .layers
                .iter()
                .map(|l| match l {
                    DeviceLayerState::Gdn { conv, s } => 4 * (conv.len() + s.len()),
                    DeviceLayerState::Attn { .. } => 2 * 2 * w,
                })
                .sum::<usize>()
    }

    /// [`Self::snapshot`], with a copy of the logits row when `logits` (valid only right after
    /// the LM head, before the pick modifies it).
    fn snapshot_with(&self, cx: &CudaContext, tokens: &[u32], logits: bool) -> Result<SessionSnapshot, CudaError> {
        let n = tokens.len();
        if n != self.host_pos || n == 0 {
            return Err(CudaError::Unsupported(format!("snapshot of {n} tokens at position {}", self.host_pos)));
        }
        let st = cx.stream();
        let w = n * p::N_KV_HEADS * p::HEAD_DIM;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    DeviceLayerState::Gdn { conv, s } => DeviceLayerState::Gdn { conv: st.clone_dtod(conv)?, s: st.clone_dtod(s)? },
                    DeviceLayerState::Attn { k, v } => {
                        DeviceLayerState::Attn { k: st.clone_dtod(&k.slice(..w))?, v: st.clone_dtod(&v.slice(..w))? }
                    }
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let logits = if logits { Some(st.clone_dtod(&self.logits)?) } else { None };
        Ok(SessionSnapshot { tokens: tokens.to_vec(), layers, logits })
    }
}

#[cfg(test)]
mod tests {
    use super::{router_digits_pairs, router_wide_tile};

    /// The tile choices measured fastest on the H200 (132 SMs, 257 router rows): see
    /// `router_wide_tile`.
    #[test]
    fn router_tile_follows_the_h200_measurements() {
        let pick = |t| router_wide_tile(t, 257, 132);
        assert!(pick(512));
        assert!(!pick(1024));
        assert!(pick(2048));
        assert!(pick(8192));
        // a one-token chunk: one block either way, the narrow one has fewer idle threads
        assert!(!pick(1));
        // no SM count (0): counted as one SM, no division by zero
        assert!(!router_wide_tile(1, 257, 0));
    }

    /// The integer router's tiles measured fastest on the H200 (132 SMs): see
    /// `router_digits_pairs`.
    #[test]
    fn router_digits_tile_follows_the_h200_measurements() {
        let pick = |t| router_digits_pairs(t, 132);
        assert_eq!([pick(512), pick(1024), pick(2048), pick(8192)], [4, 4, 8, 8]);
        // one token, and no SM count (counted as one SM)
        assert_eq!(pick(1), 4);
        assert_eq!(router_digits_pairs(9, 0), 8);
    }
}
