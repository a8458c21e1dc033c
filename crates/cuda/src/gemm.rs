//! Prefill (batched) matrix products for MLX affine-quantized weights (group 64, 4 or 8 bits)
//! on the H200's tensor cores, and the MoE top-k routing and grouped expert GEMMs of a prefill
//! step. Kernels: `kernels/gemm.cu` (design in its header comment and in `docs/CUDA.md`,
//! section "Prefill GEMM").
//!
//! All products are `Y[t, n] = Σ_k X[t, k]·W[n, k]` with `W` a [`DeviceQMat`] (`[N, K]`, MLX
//! layout as uploaded by [`CudaContext::upload_qmat`], read through its group-major copies of
//! the scales, biases and codes where it has them: [`CudaContext::add_group_major`],
//! [`CudaContext::add_group_major_codes`], [`CudaContext::regroup_codes`]), `X` `[T, K]` f32
//! row-major and `Y`
//! `[T, N]` f32 row-major (`Lin(W, u) = u·Wᵀ`, MODEL.md §3.1). Inside, the activations are
//! rounded to bf16 once per GEMM ([`CudaContext::convert_acts`]), the weights are dequantized to
//! bf16 (`scale·q + bias`, one rounding) and the products accumulate in f32 on the tensor
//! cores: about 2⁻⁹ relative error per product, so an output has a relative error of a few 1e-3
//! against the f32 CPU reference (`quant::reference::gemm`), not the 1e-6 of the decode GEMV.
//!
//! Supported: any `N ≥ 1` (even for the SwiGLU forms), `K` a multiple of 128 (the model uses 512,
//! 2048 and 4096), any `T ≥ 1` up to the scratch's `max_t`. Everything is asynchronous on
//! [`CudaContext::stream`] with no host synchronisation; `T` is a host argument (prefill runs
//! eagerly, not inside the decode graph).
//!
//! The MoE block of a prefill step (MODEL.md §3.7) with these calls:
//!
//! ```text
//! convert_acts(u)                                     u = ZNorm(h), once for the four products below
//! qgemm_converted(logits, router|shared_gate, Store)  [T, N_EXPERTS + 1] (8-bit in the MLX checkpoints)
//! moe_route(logits, routing)                          softmax, top-k, renormalise, sort by expert
//! qgemm_converted(s_act, shared gate|up, SwiGlu)      [T, D_SHARED_EXPERT]
//! moe_gate_up_grouped(experts gate|up, routing)       routing.act: [T·k, D_EXPERT] bf16
//! qgemm(s_out, shared down, s_act)                    [T, D_MODEL] (converts s_act: after the line above)
//! moe_down_grouped(out, experts down, routing, resid = h, shared = s_out)
//!                                                     out = h + Σ w·D_e·act + sigmoid(gate)·s_out
//! ```

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig,
};
use quant::Bits;
use spec::production as p;

use crate::{CudaContext, CudaError, DeviceQMat};

/// Largest `K` (input columns) of any product in the model (`N_Q_HEADS·HEAD_DIM`, the input of
/// o_proj / out_proj): sizes the bf16 activation scratch.
pub const MAX_K: usize = p::N_Q_HEADS * p::HEAD_DIM;

/// Entries per chunk of the expert sort (`SORT_CHUNK` in `gemm.cu`).
const SORT_CHUNK: usize = 256;
/// Whether automatically chosen GEMM variants of a new [`CudaContext`] take the lean main loop
/// ([`GemmEngine::WgmmaLean`]), unless [`set_default_gemm_lean`] changed the process default.
pub const GEMM_LEAN_DEFAULT: bool = true;

static DEFAULT_GEMM_LEAN: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(GEMM_LEAN_DEFAULT);

/// The GEMM main loop every [`CudaContext`] created afterwards starts with
/// ([`CudaContext::set_gemm_lean`]). Process-wide, so that the engine's accelerator and a
/// tool's own context agree (`calla cuda-check --gemm-main-loop`).
pub fn set_default_gemm_lean(on: bool) {
    DEFAULT_GEMM_LEAN.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Floats of a context's partial-sum slabs for dense products split over K (16 MiB: e.g. 2 ×
/// 128 tokens × the GDN input projection's 12,352 rows).
pub const SPLITK_FLOATS: usize = 4 << 20;

static SPLITK_DEFAULT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_splitk`] on (on unless
/// [`set_default_splitk`] said otherwise).
pub fn default_splitk() -> bool {
    SPLITK_DEFAULT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Sets [`default_splitk`] for contexts created afterwards (`calla cuda-bench | cuda-check
/// --gemm-no-splitk`).
pub fn set_default_splitk(on: bool) {
    SPLITK_DEFAULT.store(on, std::sync::atomic::Ordering::Relaxed);
}

static FIT_N_DEFAULT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_fit_n`] on (on unless
/// [`set_default_fit_n`] said otherwise).
pub fn default_fit_n() -> bool {
    FIT_N_DEFAULT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Sets [`default_fit_n`] for contexts created afterwards (`calla cuda-bench | cuda-check
/// --gemm-full-n`).
pub fn set_default_fit_n(on: bool) {
    FIT_N_DEFAULT.store(on, std::sync::atomic::Ordering::Relaxed);
}

static STAGED_EPI_DEFAULT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_staged_epilogue`] on (on
/// unless [`set_default_staged_epilogue`] said otherwise).
pub fn default_staged_epilogue() -> bool {
    STAGED_EPI_DEFAULT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Sets [`default_staged_epilogue`] for contexts created afterwards (`calla cuda-bench |
/// cuda-check --gemm-epilogue-direct`).
pub fn set_default_staged_epilogue(on: bool) {
    STAGED_EPI_DEFAULT.store(on, std::sync::atomic::Ordering::Relaxed);
}

static MOE_SLOT_BF16_DEFAULT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_moe_slot_bf16`] on (on unless
/// [`set_default_moe_slot_bf16`] said otherwise).
pub fn default_moe_slot_bf16() -> bool {
    MOE_SLOT_BF16_DEFAULT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Sets [`default_moe_slot_bf16`] for contexts created afterwards (`calla cuda-bench |
/// cuda-check --moe-slot-f32`).
pub fn set_default_moe_slot_bf16(on: bool) {
    MOE_SLOT_BF16_DEFAULT.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a new [`CudaContext`] runs [`CudaContext::moe_route`] as two launches (routing,
/// counts and scan fused in `qgemm_moe_route_hist`, then the placement) instead of four
/// ([`CudaContext::set_moe_route_fused`]).
pub const MOE_ROUTE_FUSED: bool = true;

/// Up to how many chunks of 256 routed entries (128 tokens) the fused routing launch places the
/// entries itself ([`CudaContext::set_moe_place_in_scan`]; `PLACE_WARPS` in `gemm.cu`, a chunk
/// per warp of its last block). Measured on the H200 (`cuda_selftest --only route`): one launch
/// 12.1 / 15.4 µs against two 13.0 / 16.1 at 16 / 128 tokens; a version whose last block
/// placed every chunk (32 warps) up to 64 chunks took 19.6 / 28.0 / 44.1 µs against 17.4 /
/// 18.3 / 20.4 at 512 / 1,024 / 2,048.
pub const MOE_PLACE_IN_SCAN_MAX_CHUNKS: usize = 4;

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_grouped3`] on (the
/// process default, [`set_default_gemm_grouped3`]; on unless set).
pub fn default_gemm_grouped3() -> bool {
    DEFAULT_GEMM_GROUPED3.load(std::sync::atomic::Ordering::Relaxed)
}

static DEFAULT_GEMM_GROUPED3: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Sets [`default_gemm_grouped3`] for contexts created afterwards (`calla cuda-bench |
/// cuda-check --gemm-grouped2` turns it off).
pub fn set_default_gemm_grouped3(on: bool) {
    DEFAULT_GEMM_GROUPED3.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Chunks of fewer tokens run their dense products on the per-thread copies unless
/// [`CudaContext::set_gemm_bulk_short`] is on (measured faster there, session 41).
pub const BULK_SHORT_BELOW: usize = 4096;

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_bulk`] on for the dense
/// products (the process default, [`set_default_gemm_bulk`]; on unless set). The grouped expert
/// products start with it off ([`CudaContext::set_gemm_bulk_grouped`]).
pub fn default_gemm_bulk() -> bool {
    DEFAULT_GEMM_BULK.load(std::sync::atomic::Ordering::Relaxed)
}

static DEFAULT_GEMM_BULK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Sets [`default_gemm_bulk`] for contexts created afterwards (`calla cuda-bench | cuda-check
/// --gemm-no-bulk` turns it off).
pub fn set_default_gemm_bulk(on: bool) {
    DEFAULT_GEMM_BULK.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_bulk_grouped`] on (the
/// process default, [`set_default_gemm_bulk_grouped`]; off unless set: measured slower).
pub fn default_gemm_bulk_grouped() -> bool {
    DEFAULT_GEMM_BULK_GROUPED.load(std::sync::atomic::Ordering::Relaxed)
}

static DEFAULT_GEMM_BULK_GROUPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets [`default_gemm_bulk_grouped`] for contexts created afterwards (`calla cuda-bench |
/// cuda-check --gemm-bulk-grouped` turns it on).
pub fn set_default_gemm_bulk_grouped(on: bool) {
    DEFAULT_GEMM_BULK_GROUPED.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_ws`] on (the process
/// default, [`set_default_gemm_ws`]; off unless set).
pub fn default_gemm_ws() -> bool {
    DEFAULT_GEMM_WS.load(std::sync::atomic::Ordering::Relaxed)
}

static DEFAULT_GEMM_WS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets [`default_gemm_ws`] for contexts created afterwards (`calla cuda-bench | cuda-check
/// --gemm-ws` turns it on).
pub fn set_default_gemm_ws(on: bool) {
    DEFAULT_GEMM_WS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// [`CudaContext::set_gemm_big_long`]: the fewest weight rows of a dense product that takes
/// the big tile instead of the wide one (the GDN input projection's 12,352 do; attention's
/// q|gate|k|v, 9,216, ran faster on the wide tile at 8k in session 53's self-test).
pub const BIG_LONG_ROWS: usize = 10_240;

/// [`CudaContext::set_gemm_big_long`]: the fewest tokens of a chunk whose products take it (the
/// only length measured, a whole 8k chunk).
pub const BIG_LONG_TOKENS: usize = 8_192;

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_big_long`] on (the process
/// default, [`set_default_gemm_big_long`]; on unless set, since session 56).
pub fn default_gemm_big_long() -> bool {
    DEFAULT_GEMM_BIG_LONG.load(std::sync::atomic::Ordering::Relaxed)
}

static DEFAULT_GEMM_BIG_LONG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Sets [`default_gemm_big_long`] for contexts created afterwards (`calla cuda-bench |
/// cuda-check --gemm-no-big-long` turns it off).
pub fn set_default_gemm_big_long(on: bool) {
    DEFAULT_GEMM_BIG_LONG.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_bf16_weights`] on, and
/// whether `CudaModel::upload` gives the mixers' dense projections their bf16 copies and
/// [`crate::prefill::Prefiller::new`] the shared experts' ([`CudaContext::add_bf16_weights`],
/// ~2.7 GB for the full model) (the process default, [`set_default_gemm_bf16_weights`]; off
/// unless set: session 57, not yet run on a GPU).
pub fn default_gemm_bf16_weights() -> bool {
    DEFAULT_GEMM_BF16_WEIGHTS.load(std::sync::atomic::Ordering::Relaxed)
}

static DEFAULT_GEMM_BF16_WEIGHTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets [`default_gemm_bf16_weights`] for contexts created and models uploaded afterwards
/// (`calla cuda-bench | cuda-check --gemm-bf16-weights`).
pub fn set_default_gemm_bf16_weights(on: bool) {
    DEFAULT_GEMM_BF16_WEIGHTS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_wide`] on (the process
/// default, [`set_default_gemm_wide`]; on unless set).
pub fn default_gemm_wide() -> bool {
    DEFAULT_GEMM_WIDE.load(std::sync::atomic::Ordering::Relaxed)
}

static DEFAULT_GEMM_WIDE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Sets [`default_gemm_wide`] for contexts created afterwards (`calla cuda-bench | cuda-check
/// --gemm-no-wide` turns it off).
pub fn set_default_gemm_wide(on: bool) {
    DEFAULT_GEMM_WIDE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_gemm_wide_grouped`] on (the
/// process default, [`set_default_gemm_wide_grouped`]; off unless set).
pub fn default_gemm_wide_grouped() -> bool {
    DEFAULT_GEMM_WIDE_GROUPED.load(std::sync::atomic::Ordering::Relaxed)
}

static DEFAULT_GEMM_WIDE_GROUPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets [`default_gemm_wide_grouped`] for contexts created afterwards (`calla cuda-bench |
/// cuda-check --gemm-wide-grouped` turns it on).
pub fn set_default_gemm_wide_grouped(on: bool) {
    DEFAULT_GEMM_WIDE_GROUPED.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// See [`set_default_gemm_lean`].
pub fn default_gemm_lean() -> bool {
    DEFAULT_GEMM_LEAN.load(std::sync::atomic::Ordering::Relaxed)
}

/// Threads per GEMM block.
const THREADS: u32 = 256;

/// Which MMA instructions a GEMM uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmEngine {
    /// `wgmma.mma_async` (Hopper warpgroup MMA, A from registers): the fast path.
    Wgmma,
    /// `mma.sync.m16n8k16` (warp MMA, B through `ldmatrix`): the fallback.
    MmaSync,
    /// `wgmma` as [`GemmEngine::Wgmma`] (the same ring, barriers, MMAs and bits) with copies
    /// in fewer instructions per K tile (`gemm.cu`, the `_ln` entry points): every address a
    /// fixed 32-bit offset plus a step per tile. Only for matrices with group-major scales
    /// ([`DeviceQMat::group_major`]; otherwise the launch runs [`GemmEngine::Wgmma`]).
    WgmmaLean,
    /// [`GemmEngine::WgmmaLean`] (the same bits) compiled for three blocks per SM (at most 80
    /// registers per thread instead of 128, 72 / 77 used: more warps to hide the
    /// dequantization's latency);
    /// 4-bit narrow and small tiles only, whose rings fit three to an SM. Other tiles and bit
    /// widths run [`GemmEngine::WgmmaLean`].
    WgmmaLean3,
}

/// Block tile of a GEMM launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmTile {
    /// 256 weight rows × 128 tokens, one block per SM.
    Big,
    /// 256 weight rows × 64 tokens, two blocks per SM.
    Tall,
    /// 128 weight rows × 64 tokens, two blocks per SM (for small grids).
    Small,
    /// 256 weight rows × 32 tokens, two blocks per SM: grouped expert products that average
    /// few entries per expert (less padding per expert than 64-entry tiles).
    Narrow,
    /// 128 weight rows × 256 tokens, one block per SM: each warpgroup's 64 dequantized rows
    /// feed 256 tokens (a quarter of [`GemmTile::Tall`]'s dequantization instructions per MMA;
    /// about as many copy instructions) for long prompts ([`CudaContext::set_gemm_wide`]). The wgmma engines only.
    Wide,
    /// 128 weight rows × 128 tokens, two blocks per SM: the wide tile's rows with half its
    /// tokens, so that an SM holds two blocks (four warps per scheduler instead of two; twice
    /// the dequantization per MMA). The wgmma engines only; opt-in, for measurement against the
    /// wide tile ([`CudaContext::set_gemm_mid`]; prepared in session 52, not yet run on a GPU).
    Mid,
}

impl GemmTile {
    /// Weight rows per block.
    pub const fn rows(self) -> usize {
        match self {
            GemmTile::Big | GemmTile::Tall | GemmTile::Narrow => 256,
            GemmTile::Small | GemmTile::Wide | GemmTile::Mid => 128,
        }
    }
    /// Tokens (or routed entries) per block.
    pub const fn tokens(self) -> usize {
        match self {
            GemmTile::Wide => 256,
            GemmTile::Big | GemmTile::Mid => 128,
            GemmTile::Tall | GemmTile::Small => 64,
            GemmTile::Narrow => 32,
        }
    }

    /// Blocks of this tile an SM holds at once (shared memory and registers; `gemm.cu`'s
    /// launch bounds).
    pub const fn per_sm(self) -> usize {
        match self {
            GemmTile::Big | GemmTile::Wide => 1,
            GemmTile::Tall | GemmTile::Small | GemmTile::Narrow | GemmTile::Mid => 2,
        }
    }

    /// Every tile.
    pub const ALL: [GemmTile; 6] = [GemmTile::Big, GemmTile::Tall, GemmTile::Small, GemmTile::Narrow, GemmTile::Wide, GemmTile::Mid];
}

/// One GEMM kernel variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmVariant {
    /// MMA instructions.
    pub engine: GemmEngine,
    /// Block tile.
    pub tile: GemmTile,
}

/// What the GEMM does with its accumulators.
#[derive(Clone, Copy)]
pub enum Epilogue<'a, 'b> {
    /// `Y = X·Wᵀ`, `Y` `[T, N]`.
    Store,
    /// `Y = R + X·Wᵀ`, `R` `[T, N]` (may be the same memory as `Y`).
    Residual(&'a CudaView<'b, f32>),
    /// `W` stacks `[gate (I rows) | up (I rows)]`; `Y[t, j] = silu(G·x_t)_j · (U·x_t)_j`,
    /// `Y` `[T, I]`, `I = N / 2`.
    SwiGlu,
}

/// Device scratch of the GEMMs: the activations converted to bf16 (permuted column order of
/// `gemm.cu`), `[max_t, MAX_K]`. Filled by [`CudaContext::convert_acts`] (or inside
/// [`CudaContext::qgemm`]); one per stream of prefill work.
pub struct GemmScratch {
    max_t: usize,
    xb: CudaSlice<u16>,
    /// Rows and columns of the activations converted last.
    conv: (usize, usize),
    /// Forces a kernel variant (tests and benchmarks); `None` chooses by the grid size.
    pub force: Option<GemmVariant>,
    /// Benchmarks only: the dense GEMMs run their main loop but store nothing.
    pub bench_no_store: bool,
}

impl GemmScratch {
    /// Most tokens per call.
    pub fn max_t(&self) -> usize {
        self.max_t
    }

    /// For a kernel outside this file that writes `[t, k]` activations into the scratch (in
    /// the permuted bf16 order of `gemm.cu`): checks the shape, marks the scratch as holding
    /// nothing until [`Self::filled`] and returns the buffer.
    pub(crate) fn fill(&mut self, what: &str, t: usize, k: usize) -> Result<&mut CudaSlice<u16>, CudaError> {
        check_k(k)?;
        if t == 0 || t > self.max_t {
            return Err(unsupported(format!("{what}: t = {t}, the GEMM scratch holds at most {} rows", self.max_t)));
        }
        self.conv = (0, 0);
        Ok(&mut self.xb)
    }

    /// The launch that [`Self::fill`] prepared is queued: the scratch holds `[t, k]` now.
    pub(crate) fn filled(&mut self, t: usize, k: usize) {
        self.conv = (t, k);
    }

    /// The scratch holds no activations (a call that wrote none, e.g. of 0 tokens).
    pub(crate) fn clear(&mut self) {
        self.conv = (0, 0);
    }

    /// The activations converted last, `[t, k]` bf16 bits in the permuted order of `gemm.cu`
    /// ([`unpermute_row`] restores a row's order); empty when the scratch holds none. For
    /// tests: waits for `cx`'s stream.
    ///
    /// # Errors
    /// Driver errors.
    #[doc(hidden)]
    pub fn download_acts(&self, cx: &CudaContext) -> Result<Vec<u16>, CudaError> {
        let (t, k) = self.conv;
        if t * k == 0 {
            return Ok(Vec::new());
        }
        Ok(cx.stream().clone_dtoh(&self.xb.slice(..t * k))?)
    }
}

/// MoE routing of up to `max_t` tokens and the buffers of the grouped expert GEMMs, all on the
/// device ([`CudaContext::moe_routing`] allocates, [`CudaContext::moe_route`] fills).
pub struct MoeRouting {
    /// Device address of an `[N_EXPERTS]` i32 row that every [`CudaContext::moe_route`] adds
    /// its per-expert counts into (expert-load telemetry: the prefill points it at its
    /// session's row of the layer); 0, the default: none. Must stay valid while launches that
    /// read it can run.
    pub count_into: u64,
    max_t: usize,
    /// Tokens of the last [`CudaContext::moe_route`].
    t: usize,
    /// `[T, TOP_K]` i32: chosen experts per token, by descending weight (ties: lower id).
    pub ids: CudaSlice<i32>,
    /// `[T, TOP_K]` f32: renormalised routing weights.
    pub weights: CudaSlice<f32>,
    /// `[T]` f32: `sigmoid(shared-expert gate logit)`.
    pub shared_weight: CudaSlice<f32>,
    /// `[N_EXPERTS]` i32: entries routed to each expert.
    pub counts: CudaSlice<i32>,
    /// `[N_EXPERTS + 1]` i32: exclusive scan of `counts` (`offsets[N_EXPERTS] = T·TOP_K`).
    pub offsets: CudaSlice<i32>,
    /// `[N_EXPERTS + 1]` i32: exclusive scan of `ceil(counts / 64)`.
    pub tiles64: CudaSlice<i32>,
    /// `[N_EXPERTS + 1]` i32: exclusive scan of `ceil(counts / 128)`.
    pub tiles128: CudaSlice<i32>,
    /// `[N_EXPERTS + 1]` i32: exclusive scan of `ceil(counts / 256)` (the wide tile's).
    pub tiles256: CudaSlice<i32>,
    /// `[N_EXPERTS + 1]` i32: exclusive scan of `ceil(counts / 32)`.
    pub tiles32: CudaSlice<i32>,
    /// `[T·TOP_K]` i32: entries `token·TOP_K + slot` grouped by expert (expert `e` at
    /// `offsets[e]..offsets[e+1]`), ascending within an expert.
    pub sorted: CudaSlice<i32>,
    /// `[T·TOP_K, D_EXPERT]` bf16 bits: `silu(G_e·x) ⊙ (U_e·x)` per entry, in the permuted
    /// column order of `gemm.cu` (use [`unpermute_row`] to read it).
    pub act: CudaSlice<u16>,
    /// `D_e·act` per entry (before the weights): `[T·TOP_K, D_MODEL]` bf16 bits in its first
    /// half with [`CudaContext::set_moe_slot_bf16`] on (the default), else f32. Allocated as
    /// f32 so that either fits.
    pub slot_out: CudaSlice<f32>,
    /// `[N_EXPERTS, chunks]` i32: entries of each 256-entry chunk routed to each expert.
    hist: CudaSlice<i32>,
    /// `[N_EXPERTS, chunks]` i32: where each chunk's entries of each expert start in `sorted`.
    base: CudaSlice<i32>,
    /// One u32: the arrival counter of the fused routing launch (`qgemm_moe_route_hist`), 0
    /// between launches.
    done: CudaSlice<u32>,
    /// Forces a kernel variant for the grouped GEMMs; `None` chooses by `T`.
    pub force: Option<GemmVariant>,
}

impl MoeRouting {
    /// Most tokens per call.
    pub fn max_t(&self) -> usize {
        self.max_t
    }
}

/// Position of column `k` in the permuted bf16 layout of `gemm.cu` (within its row): column
/// `k = 64·tile + 16c + 8h + 4l + s` sits at `64·tile + 16s + 8h + 2c + l`.
pub fn permuted_pos(k: usize) -> usize {
    let (tile, kk) = (k / 64, k % 64);
    tile * 64 + 16 * (kk & 3) + 8 * ((kk >> 3) & 1) + 2 * (kk >> 4) + ((kk >> 2) & 1)
}

/// Undoes the permutation of one row (`out[k] = row[permuted_pos(k)]`).
pub fn unpermute_row(row: &[u16], out: &mut [u16]) {
    for (k, o) in out.iter_mut().enumerate() {
        *o = row[permuted_pos(k)];
    }
}

/// FLOPs of one product: `2·T·N·K`.
pub fn gemm_flops(t: usize, n: usize, k: usize) -> f64 {
    2.0 * t as f64 * n as f64 * k as f64
}

fn unsupported(msg: String) -> CudaError {
    CudaError::Unsupported(msg)
}

fn entry_name(bits: Bits, v: GemmVariant) -> String {
    format!(
        "qgemm_q{}_{}_{}",
        bits.bits(),
        match v.tile {
            GemmTile::Big => "big",
            GemmTile::Tall => "tall",
            GemmTile::Small => "small",
            GemmTile::Narrow => "narrow",
            GemmTile::Wide => "wide",
            GemmTile::Mid => "mid",
        },
        match v.engine {
            GemmEngine::Wgmma => "wg",
            GemmEngine::MmaSync => "mma",
            GemmEngine::WgmmaLean => "ln",
            GemmEngine::WgmmaLean3 => "ln3",
        }
    )
}

/// The entry point of a lean variant ([`GemmEngine::WgmmaLean`], [`GemmEngine::WgmmaLean3`])
/// whose weight tiles come by bulk copies (`gemm.cu`, the `_lb` / `_lb3` entry points;
/// [`CudaContext::set_gemm_bulk`]); the name of any other variant unchanged.
fn bulk_entry_name(bits: Bits, v: GemmVariant) -> String {
    let name = entry_name(bits, v);
    match v.engine {
        GemmEngine::WgmmaLean | GemmEngine::WgmmaLean3 => name.replacen("_ln", "_lb", 1),
        _ => name,
    }
}

/// Dynamic shared memory of the warp-specialized grouped GEMMs (`_ws` in `gemm.cu`): four
/// stages of the raw tile (as [`smem_bytes`]'s stage) plus a bf16 A tile of 256 rows × 128 bytes.
fn smem_bytes_ws(tile: GemmTile) -> usize {
    let (bm, bn) = (tile.rows(), tile.tokens());
    let stage = (bn * 128 + bm * 32 + 2 * bm * 4).div_ceil(1024) * 1024;
    4 * (stage + bm * 128) + 1024
}

/// Dynamic shared memory of the dense GEMMs on bf16 weight copies (`qgemm_bf_wide`,
/// `qgemm_bf_big`: `Cfg<16, ..>` in `gemm.cu`): four stages of the activations' and the bf16
/// weights' tiles (128 bytes per row each).
fn smem_bytes_bf(tile: GemmTile) -> usize {
    let (bm, bn) = (tile.rows(), tile.tokens());
    4 * ((bn + bm) * 128).div_ceil(1024) * 1024 + 1024
}

/// The entry point of a dense product on a bf16 weight copy for `tile`, if there is one.
fn bf16_entry_name(tile: GemmTile) -> Option<&'static str> {
    match tile {
        GemmTile::Wide => Some("qgemm_bf_wide"),
        GemmTile::Big => Some("qgemm_bf_big"),
        _ => None,
    }
}

/// Threads per block of the warp-specialized grouped GEMMs (two consumer warpgroups and a
/// producer warpgroup).
const THREADS_WS: u32 = 384;

/// Whether a matrix of `rows` rows (all experts together) read as products of `n_rows` rows
/// each can take the bulk-copy entry points: every run a block copies (its rows, or the gate
/// and up halves of them) starts and ends on a 16-byte boundary of the group-major scales
/// (4 bytes per row), i.e. both counts are multiples of 8.
#[allow(clippy::manual_is_multiple_of)] // the workspace's rust-version is 1.85
fn bulk_rows_ok(rows: usize, n_rows: usize) -> bool {
    rows % 8 == 0 && n_rows % 8 == 0
}

/// The variant that runs: [`GemmEngine::WgmmaLean3`] exists for 4-bit narrow and small tiles
/// only, elsewhere it is [`GemmEngine::WgmmaLean`].
fn runnable(bits: Bits, v: GemmVariant) -> GemmVariant {
    match v.engine {
        GemmEngine::WgmmaLean3 if bits != Bits::B4 || !matches!(v.tile, GemmTile::Narrow | GemmTile::Small) => {
            GemmVariant { engine: GemmEngine::WgmmaLean, tile: v.tile }
        }
        _ => v,
    }
}

/// The routing's exclusive scan of each expert's tiles of `tile.tokens()` entries (the grouped
/// GEMMs' `tile_offs`). `scans`: the routing's `[tiles128, tiles64, tiles32, tiles256]` (fields,
/// so that the caller can hold other fields mutably).
fn grouped_tiles(scans: [&CudaSlice<i32>; 4], tile: GemmTile) -> &CudaSlice<i32> {
    match tile {
        GemmTile::Big | GemmTile::Mid => scans[0],
        GemmTile::Tall | GemmTile::Small => scans[1],
        GemmTile::Narrow => scans[2],
        GemmTile::Wide => scans[3],
    }
}

/// Whether `gemm.cu` has an entry point for the variant: the wide and mid tiles run on the
/// wgmma engines only.
fn has_entry(v: GemmVariant) -> bool {
    !(matches!(v.tile, GemmTile::Wide | GemmTile::Mid) && v.engine == GemmEngine::MmaSync)
}

/// Dynamic shared memory of a GEMM variant (`Cfg::SMEM` in `gemm.cu`).
fn smem_bytes(bits: Bits, tile: GemmTile) -> usize {
    let (bm, bn) = (tile.rows(), tile.tokens());
    let stage = (bn * 128 + bm * bits.bits() as usize * 8 + 2 * bm * 4).div_ceil(1024) * 1024;
    let stages = if bits == Bits::B8 && tile == GemmTile::Tall { 4 } else { 5 };
    stages * stage + 1024
}

const MODE_DENSE: i32 = 0;
const MODE_SWIGLU: i32 = 1;
const MODE_MOE_GATE_UP: i32 = 2;
const MODE_MOE_DOWN: i32 = 3;
const MODE_BENCH: i32 = 4;
/// MoE down with its rows stored as bf16 (`MODE_MOE_DOWN_B16` in `gemm.cu`), whose epilogue
/// writes whole tiles of 128 or 256 rows.
const MODE_MOE_DOWN_B16: i32 = 5;
#[allow(clippy::manual_is_multiple_of)] // the workspace's rust-version is 1.85 (see below)
const _: () = assert!(p::D_MODEL % 256 == 0, "the bf16 MoE down rows are written a whole row tile at a time");
#[allow(clippy::manual_is_multiple_of)]
const _: () = assert!(
    p::D_EXPERT % 128 == 0,
    "the MoE gate/up epilogue stores every column of its row tiles (with bulk copies, stale shared rows past a partial tile would reach act)"
);
/// Flag ORed into the mode: MMAs over the tile's full token width (`MODE_FULL_N` in `gemm.cu`).
const MODE_FULL_N: i32 = 16;
/// Flag ORed into [`MODE_DENSE`]: the f32 epilogue staged in shared memory and written in
/// 16-byte runs (`MODE_STAGED_EPI` in `gemm.cu`; [`CudaContext::set_gemm_staged_epilogue`]).
const MODE_STAGED_EPI: i32 = 32;

/// Raw arguments of one GEMM launch (device pointers; 0 = unused).
struct GemmArgs {
    xb: u64,
    y: u64,
    res: u64,
    act: u64,
    sorted: u64,
    offsets: u64,
    tile_offs: u64,
    n_rows: usize,
    k: usize,
    t: usize,
    mode: i32,
    ldy: usize,
    grid: (u32, u32),
    /// Blocks over K (grid z): 1, or a dense product split over K whose partial sums go to
    /// slabs of `ldy`-wide rows at `y` (see [`CudaContext::splitk`]).
    ksplit: u32,
}

fn check_i32(what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| unsupported(format!("{what} = {v} does not fit an i32")))
}

// `usize::is_multiple_of` needs Rust 1.87; the workspace's rust-version is 1.85.
#[allow(clippy::manual_is_multiple_of)]
fn check_k(k: usize) -> Result<(), CudaError> {
    if k == 0 || k % 128 != 0 || k > MAX_K {
        return Err(unsupported(format!(
            "GEMM with K = {k}: K must be a positive multiple of 128, at most {MAX_K}"
        )));
    }
    Ok(())
}

impl CudaContext {
    /// Lets the GEMMs of this file read a matrix's group-major scales and biases
    /// ([`DeviceQMat::group_major`], [`CudaContext::add_group_major`]) and codes
    /// ([`DeviceQMat::group_major_codes`]) when it has them (`true`, the default) or the MLX
    /// layout (`false`; a matrix whose codes are group-major in place,
    /// [`DeviceQMat::codes_group_major`], reads group-major either way). The same bits: for measuring
    /// both in one process (`cuda_selftest --only gemm`, `calla cuda-bench --prefill-compare`
    /// through [`crate::prefill::Prefiller::on_contexts`]). A
    /// [`CudaContext::sibling`] copies the setting when it is made and has its own afterwards.
    /// It applies to GEMMs launched afterwards; a graph captured earlier keeps what it captured
    /// (the decode step's graphs hold no GEMM of this file, so they are not captured again).
    #[doc(hidden)]
    pub fn set_gemm_group_major(&self, on: bool) {
        self.gemm_group_major.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_group_major`].
    #[doc(hidden)]
    pub fn gemm_group_major(&self) -> bool {
        self.gemm_group_major.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the automatic choice of a GEMM's variant ([`GemmScratch::force`] /
    /// [`MoeRouting::force`] `None`) take the lean main loop ([`GemmEngine::WgmmaLean`],
    /// `true`) or the plain one ([`GemmEngine::Wgmma`], `false`); the same bits either way (the
    /// same products in the same order). For measuring both in one process (`calla cuda-bench
    /// --prefill-compare`). A [`CudaContext::sibling`] copies the setting when it is made.
    #[doc(hidden)]
    pub fn set_gemm_lean(&self, on: bool) {
        self.gemm_lean.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_lean`].
    #[doc(hidden)]
    pub fn gemm_lean(&self) -> bool {
        self.gemm_lean.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the automatic choice of the grouped expert GEMMs' narrow tile (below 28 entries per
    /// expert) take [`GemmEngine::WgmmaLean3`] (three blocks per SM; `true`, the default,
    /// [`default_gemm_grouped3`]) instead of the lean loop at two blocks per SM (`false`). The
    /// same products in the same order, so the same bits. Only with the lean main loop
    /// ([`Self::set_gemm_lean`]). Measured on the H200 (`cuda_selftest --only gemm`, session
    /// 26): gate/up 129.4 against 130.2 µs and down + combine 87.7 against 91.0 at T = 512,
    /// 143.7 / 144.1 and 99.8 / 103.6 at T = 768. The small tile at three per SM, measured in
    /// place of the tall one from 28 entries per expert, was slower (whole prefill +3.7-5.3% at
    /// 1k-8k tokens), so the tall tile stays there. For measurement (`calla cuda-bench
    /// --prefill-compare`); a [`CudaContext::sibling`] copies the setting when it is made.
    #[doc(hidden)]
    pub fn set_gemm_grouped3(&self, on: bool) {
        self.gemm_grouped3.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_grouped3`].
    #[doc(hidden)]
    pub fn gemm_grouped3(&self) -> bool {
        self.gemm_grouped3.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the dense products on the lean GEMM variants ([`GemmEngine::WgmmaLean`],
    /// [`GemmEngine::WgmmaLean3`]) bring each K tile's weight codes and (scale, bias) words by
    /// bulk copies (`cp.async.bulk`, the TMA engine: one thread issues one or two contiguous
    /// runs per tile, completed on a per-stage mbarrier) instead of 16- and 4-byte `cp.async`
    /// copies from every thread (`true`, the default, [`default_gemm_bulk`]). The activations
    /// still come by `cp.async` (gathered rows). The same bytes reach the same values, so the
    /// same bits. Applies to matrices with group-major codes and scales whose row counts are
    /// multiples of 8 (the dense projections); others take the per-thread copies, and so do
    /// chunks under [`BULK_SHORT_BELOW`] tokens unless [`Self::set_gemm_bulk_short`]. Measured on
    /// the H200 (`cuda_selftest --only bulk`, session 31): in_proj 91.4 against 94.5 µs at
    /// T = 1,024 and 724.9 against 734.9 at 8,192, o_proj 43.8 / 43.4 and 217.6 / 227.0. For
    /// measurement (`calla cuda-bench --prefill-compare`); a [`CudaContext::sibling`] copies
    /// the setting.
    #[doc(hidden)]
    pub fn set_gemm_bulk(&self, on: bool) {
        self.gemm_bulk.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_bulk`].
    #[doc(hidden)]
    pub fn gemm_bulk(&self) -> bool {
        self.gemm_bulk.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the dense products of chunks under [`BULK_SHORT_BELOW`] tokens take the bulk copies
    /// of [`Self::set_gemm_bulk`] too (`true`; `false`, the default since session 41: those
    /// products take the per-thread copies, and [`Self::set_gemm_bulk`] applies from
    /// [`BULK_SHORT_BELOW`] tokens on). The same bits either way. Measured in the whole prefill
    /// (`calla cuda-bench --prefill-compare`, the dense products' per-thread copies against the
    /// bulk ones, sessions 40 and 41): 13 of 14 rows at 512 to 2,048 tokens faster with the
    /// per-thread copies (−0.4% to −2.6%, one +0.4%), on two H100s and an H200; at 8,192 tokens
    /// a wash (+0.9% to −1.2%). A [`CudaContext::sibling`] copies the setting.
    #[doc(hidden)]
    pub fn set_gemm_bulk_short(&self, on: bool) {
        self.gemm_bulk_short.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_bulk_short`].
    #[doc(hidden)]
    pub fn gemm_bulk_short(&self) -> bool {
        self.gemm_bulk_short.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`Self::set_gemm_bulk`] for the grouped expert products (`moe_gate_up_grouped`,
    /// `moe_down_grouped`; off by default): measured slower on the H200 (`cuda_selftest --only
    /// bulk`, session 31: gate/up 135.5 against 127.2 µs at T = 512, 157.5 / 147.0 at 1,024,
    /// 677.3 / 633.7 at 8,192; down + combine 2-3% slower). The same bits either way. For
    /// measurement; a [`CudaContext::sibling`] copies the setting.
    #[doc(hidden)]
    pub fn set_gemm_bulk_grouped(&self, on: bool) {
        self.gemm_bulk_grouped.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_bulk_grouped`].
    #[doc(hidden)]
    pub fn gemm_bulk_grouped(&self) -> bool {
        self.gemm_bulk_grouped.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the 4-bit grouped expert products on the tall and narrow tiles run the
    /// warp-specialized main loop (`gemm.cu`, `qgemm_q4_{tall,narrow}_ws`: a producer
    /// warpgroup copies each K tile and dequantizes it into a bf16 A tile in shared memory, two
    /// consumer warpgroups run `wgmma` with both operands there; the same products in the same
    /// order as the lean loop). Off by default; for measurement. A [`CudaContext::sibling`]
    /// copies the setting.
    #[doc(hidden)]
    pub fn set_gemm_ws(&self, on: bool) {
        self.gemm_ws.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_ws`].
    #[doc(hidden)]
    pub fn gemm_ws(&self) -> bool {
        self.gemm_ws.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the automatic choice of a dense GEMM's tile ([`GemmScratch::force`] `None`) take
    /// [`GemmTile::Wide`] (128 weight rows × 256 tokens, one block per SM) from 256 tokens on
    /// (`true`, the default, [`default_gemm_wide`]), instead of the big, tall and small tiles
    /// (`false`). Token columns are independent and every output's K order is the same, so the
    /// same bits unsplit; split over K ([`Self::set_gemm_splitk`], short prompts whose grid
    /// would not fill the GPU) the tile's block count can choose another number of splits, and
    /// the partial sums then add in another order. Session 40 (`calla cuda-bench --pdl
    /// --prefill-compare`, H200): the whole prefill took 41.03 / 150.92 ms without it and
    /// 39.16 / 146.63 ms with it at 2k / 8k tokens (24.22 / 24.24 ms at 1k, within the
    /// compare's noise). A [`CudaContext::sibling`] copies the setting. The grouped expert
    /// products have their own switch, [`Self::set_gemm_wide_grouped`].
    #[doc(hidden)]
    pub fn set_gemm_wide(&self, on: bool) {
        self.gemm_wide.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_wide`].
    #[doc(hidden)]
    pub fn gemm_wide(&self) -> bool {
        self.gemm_wide.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the automatic choice of a dense GEMM's tile take [`GemmTile::Mid`] (128 weight rows
    /// × 128 tokens, two blocks per SM) where it would take the wide tile (`true`; `false`, the
    /// default). The same bits unsplit, as [`Self::set_gemm_wide`]. For measurement (`calla
    /// cuda-bench --prefill-compare`, case `dense_mid_ms`); a [`CudaContext::sibling`] copies
    /// the setting.
    #[doc(hidden)]
    pub fn set_gemm_mid(&self, on: bool) {
        self.gemm_mid.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_mid`].
    #[doc(hidden)]
    pub fn gemm_mid(&self) -> bool {
        self.gemm_mid.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the automatic choice of a dense GEMM's tile take [`GemmTile::Big`] (256 weight rows
    /// × 128 tokens) instead of the wide tile for products of at least [`BIG_LONG_ROWS`] rows
    /// (not SwiGLU) over at least [`BIG_LONG_TOKENS`] tokens (`true`, the default since
    /// session 56; `false`: the wide tile, `calla cuda-bench | cuda-check --gemm-no-big-long`):
    /// the GDN input projection (12,352 × 2,048) of an 8k chunk, which session 53's self-test
    /// timed at 741.1 µs on the big tile against 762.6 µs on the wide one (an H100), while
    /// every other dense shape there ran faster on the wide tile. The whole 8k prefill: 149.20
    /// against 149.73 ms (−0.4%; session 56, an H100, `calla cuda-bench --prefill-compare`,
    /// case `dense_big_long_ms`). The same bits unsplit, as [`Self::set_gemm_wide`]. Where
    /// [`Self::set_gemm_mid`] is on too, these products take the big tile and the others the
    /// mid one. A [`CudaContext::sibling`] copies the setting.
    pub fn set_gemm_big_long(&self, on: bool) {
        self.gemm_big_long.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_big_long`].
    pub fn gemm_big_long(&self) -> bool {
        self.gemm_big_long.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Has dense products on the wide and big tiles read the weights' bf16 copy
    /// ([`DeviceQMat::bf16`], [`CudaContext::add_bf16_weights`]) where the matrix has one (`on`;
    /// the process default [`default_gemm_bf16_weights`]): the A tile copied into shared memory
    /// and multiplied from there (`wgmma` with both operands in shared memory) instead of the
    /// codes dequantized into registers per block. The same operands in the same MMA slots, so
    /// the same bits (self-test section `bf16w`); for measurement (`cuda-bench --prefill-compare`,
    /// case `dense_bf16_weights_ms`). Chunks of fewer than 256 tokens keep the quantized weights.
    /// A [`CudaContext::sibling`] copies the setting.
    pub fn set_gemm_bf16_weights(&self, on: bool) {
        self.gemm_bf16_weights.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_bf16_weights`].
    pub fn gemm_bf16_weights(&self) -> bool {
        self.gemm_bf16_weights.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the automatic choice of a grouped expert GEMM's tile ([`MoeRouting::force`] `None`)
    /// take [`GemmTile::Wide`] from 192 entries per expert on (`true`; `false`, the default,
    /// [`default_gemm_wide_grouped`]). The same bits, as [`Self::set_gemm_wide`]; a
    /// [`CudaContext::sibling`] copies the setting.
    #[doc(hidden)]
    pub fn set_gemm_wide_grouped(&self, on: bool) {
        self.gemm_wide_grouped.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_gemm_wide_grouped`].
    #[doc(hidden)]
    pub fn gemm_wide_grouped(&self) -> bool {
        self.gemm_wide_grouped.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// GEMM launches on the bulk-copy or warp-specialized entry points since this context was
    /// made (its own launches, not a sibling's): lets a test tell that [`Self::set_gemm_bulk`] /
    /// [`Self::set_gemm_bulk_grouped`] / [`Self::set_gemm_ws`] took effect rather than fell back
    /// to the lean loop's per-thread copies.
    #[doc(hidden)]
    pub fn gemm_bulk_launches(&self) -> u64 {
        self.gemm_bulk_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// GEMM launches on the bf16-weight entry points since this context was made
    /// ([`Self::set_gemm_bf16_weights`]; its own launches, not a sibling's): lets a test tell
    /// that the copies were read rather than the quantized weights.
    #[doc(hidden)]
    pub fn gemm_bf16_launches(&self) -> u64 {
        self.gemm_bf16_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The engine of an automatically chosen variant ([`Self::set_gemm_lean`]).
    fn auto_engine(&self) -> GemmEngine {
        if self.gemm_lean() {
            GemmEngine::WgmmaLean
        } else {
            GemmEngine::Wgmma
        }
    }

    /// Sets the dynamic shared-memory limit of every GEMM entry point (done by the scratch
    /// constructors).
    fn prepare_gemm(&self) -> Result<(), CudaError> {
        self.raw().bind_to_thread()?;
        for bits in [Bits::B4, Bits::B8] {
            for tile in GemmTile::ALL {
                for engine in [GemmEngine::Wgmma, GemmEngine::MmaSync, GemmEngine::WgmmaLean, GemmEngine::WgmmaLean3] {
                    if !has_entry(GemmVariant { engine, tile }) {
                        continue;
                    }
                    let v = runnable(bits, GemmVariant { engine, tile });
                    for name in [entry_name(bits, v), bulk_entry_name(bits, v)] {
                        self.func(&name)?.set_attribute(
                            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            smem_bytes(bits, tile) as i32,
                        )?;
                    }
                }
            }
        }
        for tile in [GemmTile::Wide, GemmTile::Big] {
            if let Some(name) = bf16_entry_name(tile) {
                self.func(name)?.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem_bytes_bf(tile) as i32,
                )?;
            }
        }
        for (name, tile) in [("qgemm_q4_tall_ws", GemmTile::Tall), ("qgemm_q4_narrow_ws", GemmTile::Narrow)] {
            self.func(name)?.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_bytes_ws(tile) as i32,
            )?;
        }
        Ok(())
    }

    /// Allocates the GEMM scratch for up to `max_t` tokens (`max_t · MAX_K` bf16).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `max_t` is 0 or too large for i32 offsets; driver errors.
    pub fn gemm_scratch(&self, max_t: usize) -> Result<GemmScratch, CudaError> {
        if max_t == 0 {
            return Err(unsupported("gemm_scratch with max_t = 0".into()));
        }
        check_i32("max_t * MAX_K", max_t * MAX_K)?;
        self.prepare_gemm()?;
        Ok(GemmScratch {
            max_t,
            xb: self.stream().alloc_zeros(max_t * MAX_K)?,
            conv: (0, 0),
            force: None,
            bench_no_store: false,
        })
    }

    /// Rounds `x` (`[t, k]` f32) to bf16 into `scratch`, in the column order the GEMM kernels
    /// read. Every `*_converted` GEMM and [`Self::moe_gate_up_grouped`] then use it as their
    /// input until the next conversion.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for `t` = 0 or above `scratch.max_t()`, a `k` the kernels do
    /// not support, or `x.len() != t·k`; driver errors.
    pub fn convert_acts(
        &self,
        x: &CudaView<'_, f32>,
        t: usize,
        k: usize,
        scratch: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        check_k(k)?;
        if t == 0 || t > scratch.max_t || x.len() != t * k {
            return Err(unsupported(format!(
                "convert_acts: t = {t} (max {}), k = {k}, x has {} values",
                scratch.max_t,
                x.len()
            )));
        }
        let words = t * k / 2;
        let blocks = words.div_ceil(256).min(self.sm_count() as usize * 16) as u32;
        let stream = self.stream();
        let (px, _gx) = x.device_ptr(stream);
        let (pxb, _gxb) = scratch.xb.device_ptr_mut(stream);
        let (rows, kk) = (check_i32("t", t)?, check_i32("k", k)?);
        let mut b = self.kernel(self.func("qgemm_x_to_bf16")?);
        b.arg(&px).arg(&pxb).arg(&rows).arg(&kk);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: x has t*k f32, the scratch has room for t*k bf16 (checked above).
        unsafe { b.launch(cfg) }?;
        scratch.conv = (t, k);
        Ok(())
    }

    /// The zero-centred RMSNorm of [`Self::rms_norm`] (`x/rms(x)·(1 + w)`, MODEL.md §3.3) on
    /// `t` rows of `x` (`[t, D_MODEL]` f32), written as the GEMMs' bf16 activations into
    /// `scratch` (bit for bit [`Self::rms_norm`] followed by [`Self::convert_acts`]) and, when
    /// `y` is given, also as f32 into `y` (`[t, D_MODEL]`). One launch instead of two, and the
    /// f32 rows are not read back. `*_converted` GEMMs and [`Self::moe_gate_up_grouped`] then
    /// read the activations.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for `t` = 0 or above `scratch.max_t()`, or wrong lengths;
    /// driver errors.
    pub fn rms_norm_acts(
        &self,
        y: Option<&mut CudaViewMut<'_, f32>>,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        t: usize,
        scratch: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        if w.len() != d || x.len() != t * d || y.as_ref().is_some_and(|y| y.len() != t * d) {
            return Err(unsupported(format!(
                "rms_norm_acts shapes: t = {t}, x {} y {:?} w {} (D = {d})",
                x.len(),
                y.as_ref().map(|y| y.len()),
                w.len()
            )));
        }
        let f = self.func("rms_norm_acts_d_model")?;
        let stream = self.stream();
        {
            // the kernel reads and writes float4s
            let mut ptrs = vec![("x", x.device_ptr(stream).0), ("w", w.device_ptr(stream).0)];
            if let Some(y) = y.as_ref() {
                ptrs.push(("y", y.device_ptr(stream).0));
            }
            crate::gdn::check_aligned16("rms_norm_acts", &ptrs)?;
        }
        {
            let xb = scratch.fill("rms_norm_acts", t, d)?;
            let (pxb, _gxb) = xb.device_ptr_mut(stream);
            let (py, _gy) = match y {
                Some(y) => {
                    let (py, gy) = y.device_ptr_mut(stream);
                    (py, Some(gy))
                }
                None => (0, None),
            };
            let eps = p::RMS_EPS;
            let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: ((d / 8) as u32, 1, 1), shared_mem_bytes: 0 };
            let mut b = self.kernel(f);
            b.arg(&py).arg(&pxb).ptr(x).ptr(w).arg(&eps);
            // SAFETY: x has t rows of D_MODEL f32, y (when not null) as many, the scratch room
            // for t·D_MODEL bf16 (checked above).
            unsafe { b.launch(cfg) }?;
        }
        scratch.filled(t, d);
        Ok(())
    }

    /// `Y[t, n] = Σ_k X[t, k]·W[n, k]` for a quantized `W` (`[N, K]`), `X` `[t, K]` f32,
    /// `Y` `[t, N]` f32: converts `X` ([`Self::convert_acts`]) and runs the GEMM.
    ///
    /// # Errors
    /// As [`Self::convert_acts`] and [`Self::qgemm_converted`].
    pub fn qgemm(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        w: &DeviceQMat,
        x: &CudaView<'_, f32>,
        t: usize,
        scratch: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        self.convert_acts(x, t, w.cols, scratch)?;
        self.qgemm_converted(y, w, scratch, t, Epilogue::Store)
    }

    /// `Y = R + X·Wᵀ` (`R` `[t, N]`, may be `Y`'s memory): the residual add fused.
    ///
    /// # Errors
    /// As [`Self::qgemm`].
    pub fn qgemm_residual(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        w: &DeviceQMat,
        x: &CudaView<'_, f32>,
        r: &CudaView<'_, f32>,
        t: usize,
        scratch: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        self.convert_acts(x, t, w.cols, scratch)?;
        self.qgemm_converted(y, w, scratch, t, Epilogue::Residual(r))
    }

    /// SwiGLU of a stacked `[gate (I rows) | up (I rows)]` matrix:
    /// `Y[t, j] = silu(G·x_t)_j · (U·x_t)_j`, `Y` `[t, I]` (the shared expert's first half,
    /// MODEL.md §3.7 step 4).
    ///
    /// # Errors
    /// As [`Self::qgemm`].
    pub fn qgemm_swiglu(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        w: &DeviceQMat,
        x: &CudaView<'_, f32>,
        t: usize,
        scratch: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        self.convert_acts(x, t, w.cols, scratch)?;
        self.qgemm_converted(y, w, scratch, t, Epilogue::SwiGlu)
    }

    /// The GEMM on the activations already in `scratch` (the last [`Self::convert_acts`], which
    /// must have had `t` rows of `w.cols` columns), with the epilogue `epi`.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for mismatched shapes (named in the message); driver errors.
    pub fn qgemm_converted(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        w: &DeviceQMat,
        scratch: &GemmScratch,
        t: usize,
        epi: Epilogue<'_, '_>,
    ) -> Result<(), CudaError> {
        let (n, k) = (w.rows, w.cols);
        check_k(k)?;
        if scratch.conv != (t, k) || t == 0 {
            return Err(unsupported(format!(
                "qgemm_converted: the scratch holds [{}, {}] activations, the call wants [{t}, {k}]",
                scratch.conv.0, scratch.conv.1
            )));
        }
        let (out_cols, mode) = match epi {
            Epilogue::SwiGlu => {
                if n % 2 != 0 {
                    return Err(unsupported(format!("SwiGLU GEMM with an odd row count {n}")));
                }
                (n / 2, MODE_SWIGLU)
            }
            _ if scratch.bench_no_store => (n, MODE_BENCH),
            _ => (n, MODE_DENSE),
        };
        if y.len() != t * out_cols {
            return Err(unsupported(format!(
                "qgemm: y has {} values, expected {t} x {out_cols}",
                y.len()
            )));
        }
        check_i32("t * N", t * n)?;
        let v = scratch.force.unwrap_or_else(|| self.choose_dense(n, t, mode == MODE_SWIGLU));
        let stream = self.stream();
        let (pxb, _gxb) = scratch.xb.device_ptr(stream);
        let (py, _gy) = y.device_ptr_mut(stream);
        let (pres, _gres) = match epi {
            Epilogue::Residual(r) => {
                if r.len() != t * n {
                    return Err(unsupported(format!(
                        "qgemm_residual: r has {} values, expected {t} x {n}",
                        r.len()
                    )));
                }
                let (p, g) = r.device_ptr(stream);
                (p, Some(g))
            }
            _ => (0, None),
        };
        let row_blocks = match mode {
            MODE_SWIGLU => (n / 2).div_ceil(v.tile.rows() / 2),
            _ => n.div_ceil(v.tile.rows()),
        };
        let token_tiles = t.div_ceil(v.tile.tokens());
        // split over K: the partial slabs hold raw sums, the SwiGLU's gate and up rows apart
        let ldp = if mode == MODE_SWIGLU { n } else { out_cols };
        let ks = if self.gemm_splitk() && mode != MODE_BENCH { self.splitk(v.tile, row_blocks * token_tiles, k, t * ldp) } else { 1 };
        // the slabs are this context's (its stream's), whoever's activations the GEMM reads
        let pp = if ks > 1 { self.splitk_slabs()?.device_ptr(stream).0 } else { 0 };
        let args = GemmArgs {
            xb: pxb,
            y: if ks > 1 { pp } else { py },
            res: if ks > 1 { 0 } else { pres },
            act: 0,
            sorted: 0,
            offsets: 0,
            tile_offs: 0,
            n_rows: n,
            k,
            t,
            // staged only with `+ residual` (the store-only products measured slower staged)
            mode: if mode == MODE_DENSE && ks == 1 && pres != 0 && self.gemm_staged_epilogue() { MODE_DENSE | MODE_STAGED_EPI } else { mode },
            ldy: if ks > 1 { ldp } else { out_cols },
            grid: (row_blocks as u32, token_tiles as u32),
            ksplit: ks as u32,
        };
        self.launch_gemm(w, v, &args)?;
        if ks > 1 {
            let (t_i, n_i, ldp_i, ks_i, sw) = (t as i32, out_cols as i32, ldp as i32, ks as i32, i32::from(mode == MODE_SWIGLU));
            let mut b = self.kernel(self.func("qgemm_splitk_reduce")?);
            b.arg(&py).arg(&pp).arg(&pres).arg(&t_i).arg(&n_i).arg(&ldp_i).arg(&ks_i).arg(&sw);
            let cfg = LaunchConfig { grid_dim: ((t * out_cols).div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: y (and res) hold t·out_cols f32 (checked above); the slabs ks·t·ldp
            // <= SPLITK_FLOATS (splitk).
            unsafe { b.launch(cfg) }?;
        }
        Ok(())
    }

    /// Blocks a dense product's K range is split over: with `blocks` blocks of `tile` (one
    /// token tile each for the short prompts this serves) it would leave SMs idle, each block
    /// walking all `k / 64` K tiles in turn (`cuda-bench --prefill-profile` and `ncu`, session
    /// 27: 16-token in_proj 14 MB in ~17 µs on 97 blocks). The largest of 8, 4, 2 that keeps
    /// the grid within one round (`per_sm` blocks on every SM), leaves each block an even
    /// number of at least 4 K tiles and fits the scratch's slabs (`slab` floats each), else 1.
    /// The partial sums are added in slab order by `qgemm_splitk_reduce`: other bits than
    /// unsplit, the same rounding class (f32 sums of f32 products).
    // `usize::is_multiple_of` needs Rust 1.87; the workspace's rust-version is 1.85.
    #[allow(clippy::manual_is_multiple_of)]
    fn splitk(&self, tile: GemmTile, blocks: usize, k: usize, slab: usize) -> usize {
        let per_sm = tile.per_sm();
        let room = per_sm * self.sm_count() as usize;
        let kt = k / 64;
        [8usize, 4, 2]
            .into_iter()
            .find(|&ks| blocks * ks <= room && kt % (2 * ks) == 0 && kt / ks >= 4 && ks * slab <= SPLITK_FLOATS)
            .unwrap_or(1)
    }

    /// This context's partial-sum slabs for dense products split over K ([`SPLITK_FLOATS`]
    /// f32, 16 MiB), allocated on first use. Used only by launches on this context's stream,
    /// which orders them.
    fn splitk_slabs(&self) -> Result<&CudaSlice<f32>, CudaError> {
        if let Some(b) = self.splitk_part.get() {
            return Ok(b);
        }
        let b = self.stream().alloc_zeros::<f32>(SPLITK_FLOATS)?;
        Ok(self.splitk_part.get_or_init(|| b))
    }

    /// Lets dense GEMMs on this context split over K when their grid would leave SMs idle
    /// (`on`, the default: [`default_splitk`]): other bits than unsplit, the same rounding
    /// class; for measurement and the self-test's comparisons.
    pub fn set_gemm_splitk(&self, on: bool) {
        self.gemm_splitk.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`CudaContext::set_gemm_splitk`] is on.
    pub fn gemm_splitk(&self) -> bool {
        self.gemm_splitk.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the wgmma GEMMs on this context fit their MMAs to the tokens (routed entries) of
    /// each block's tile (`on`, the default: [`default_fit_n`]): a tile holding `cnt` of its
    /// `BN` tokens multiplies only the narrowest of its widths that covers `cnt` (multiples of
    /// 16 up to 64; 64, 96 or 128 on the big tile), instead of all `BN` (`off`, the measured
    /// twin). The same bits: a product's token columns do not depend on each other. What it
    /// saves is the padding of the grouped expert products, whose tiles hold a few dozen entries
    /// at short prompts (~32 of 64 per expert at 1k tokens), and of every last token tile.
    pub fn set_gemm_fit_n(&self, on: bool) {
        self.gemm_fit_n.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`CudaContext::set_gemm_fit_n`] is on.
    pub fn gemm_fit_n(&self) -> bool {
        self.gemm_fit_n.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the dense GEMMs with `+ residual` on this context (GDN out_proj, attention o_proj)
    /// write their f32 outputs from shared memory (`on`; the default is
    /// [`default_staged_epilogue`]): the block's `[tokens, rows]` tile of sums is staged in the
    /// emptied ring and each thread reads 8 of the residual's 16-byte runs before it writes the
    /// sums, instead of 4-byte elements straight from the MMA accumulators, which lie 8 rows and
    /// whole output rows apart (`off`, the measured twin). The same sums and additions, so the
    /// same bits. Store-only products (and the split-K slabs) keep the direct stores: staged they
    /// measured slower (session 40, H200: the 4-bit `9216 × 2048` product at 8,192 tokens 655 µs
    /// against 612 µs). Session 40 (H100, self-test `gemm`): the `2048 × 4096` product with
    /// `+ residual` at 8,192 tokens takes 268.5 µs staged against 346.5 µs direct (239.7 µs
    /// store-only); 68.7 against 90.1 at 2,048.
    pub fn set_gemm_staged_epilogue(&self, on: bool) {
        self.gemm_staged_epi.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`CudaContext::set_gemm_staged_epilogue`] is on.
    pub fn gemm_staged_epilogue(&self) -> bool {
        self.gemm_staged_epi.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The tile for a dense product: the one whose grid finishes first, counting whole waves
    /// (1 big or 2 tall/small blocks per SM) and the per-block efficiency measured on the H200
    /// (tall ≈ 0.9, small ≈ 0.76 of big at the same work).
    fn choose_dense(&self, n: usize, t: usize, swiglu: bool) -> GemmVariant {
        if self.gemm_wide() && t >= GemmTile::Wide.tokens() {
            if self.gemm_big_long() && !swiglu && n >= BIG_LONG_ROWS && t >= BIG_LONG_TOKENS {
                return GemmVariant { engine: self.auto_engine(), tile: GemmTile::Big };
            }
            let tile = if self.gemm_mid() { GemmTile::Mid } else { GemmTile::Wide };
            return GemmVariant { engine: self.auto_engine(), tile };
        }
        let sms = self.sm_count() as usize;
        let cost = |tile: GemmTile, per_sm: usize, eff: f64| {
            let rows = if swiglu { (n / 2).div_ceil(tile.rows() / 2) } else { n.div_ceil(tile.rows()) };
            let blocks = rows * t.div_ceil(tile.tokens());
            let work = (tile.rows() * tile.tokens() * per_sm) as f64 / eff;
            blocks.div_ceil(per_sm * sms) as f64 * work
        };
        let options = [
            (GemmTile::Big, cost(GemmTile::Big, 1, 1.0)),
            (GemmTile::Tall, cost(GemmTile::Tall, 2, 0.9)),
            (GemmTile::Small, cost(GemmTile::Small, 2, 0.76)),
        ];
        let tile = options.iter().min_by(|a, b| a.1.total_cmp(&b.1)).map(|o| o.0).unwrap_or(GemmTile::Big);
        GemmVariant { engine: self.auto_engine(), tile }
    }

    fn launch_gemm(&self, w: &DeviceQMat, v: GemmVariant, a: &GemmArgs) -> Result<(), CudaError> {
        if !has_entry(v) {
            return Err(unsupported(format!("no GEMM kernel for {v:?} (the wide tile runs on the wgmma engines only)")));
        }
        if a.grid.1 > 65_535 {
            return Err(unsupported(format!("GEMM grid of {} token tiles (at most 65535)", a.grid.1)));
        }
        let stream = self.stream();
        let (ps, _g2) = w.scales.device_ptr(stream);
        let (pb, _g3) = w.biases.device_ptr(stream);
        // the group-major scales and biases, or 0 (a null pointer: the kernel reads the MLX
        // layout); a matrix whose codes are group-major in place always reads them group-major
        let (psbt, _g4) = match (&w.group_major, self.gemm_group_major() || w.codes_group_major) {
            (Some(gm), true) => {
                let (ptr, g) = gm.device_ptr(stream);
                (ptr, Some(g))
            }
            _ => (0u64, None),
        };
        // the lean loop reads group-major scales only: without them, the plain loop (same bits)
        let v = runnable(w.bits, v);
        let v = match (v.engine, psbt) {
            (GemmEngine::WgmmaLean | GemmEngine::WgmmaLean3, 0) => GemmVariant { engine: GemmEngine::Wgmma, tile: v.tile },
            _ => v,
        };
        // the codes: group-major (in place, or their copy when the scales are group-major too)
        // or the MLX layout
        let (codes, pk_gm) = match (w.codes_group_major, &w.group_major_codes, psbt != 0) {
            (true, _, true) => (&w.packed, 1i32),
            (true, _, false) => {
                return Err(unsupported(format!("a [{}, {}] matrix with group-major codes but no group-major scales", w.rows, w.cols)))
            }
            (false, Some(c), true) => (c, 1i32),
            (false, _, _) => (&w.packed, 0i32),
        };
        // the lean loop's weight tiles by bulk copies: group-major codes and scales only, on
        // runs that start and end 16-byte aligned (the same bytes in the same stages' places)
        let grouped = matches!(a.mode, MODE_MOE_GATE_UP | MODE_MOE_DOWN | MODE_MOE_DOWN_B16);
        let on = if grouped {
            self.gemm_bulk_grouped()
        } else {
            self.gemm_bulk() && (a.t >= BULK_SHORT_BELOW || self.gemm_bulk_short())
        };
        let lean = matches!(v.engine, GemmEngine::WgmmaLean | GemmEngine::WgmmaLean3);
        // the warp-specialized loop: 4-bit grouped products on the tall or narrow tile
        let ws = grouped
            && self.gemm_ws()
            && lean
            && pk_gm == 1
            && w.bits == Bits::B4
            && matches!(v.tile, GemmTile::Tall | GemmTile::Narrow);
        // a dense product on the wide or big tile with the weights' bf16 copy (wgmma engines)
        // (long prompts only: below the wide tile's 256 tokens the automatic choice may still
        // take the big tile, where reading four times the bytes cannot pay)
        let bf16 = match (&w.bf16, bf16_entry_name(v.tile)) {
            (Some(c), Some(name))
                if !grouped && self.gemm_bf16_weights() && v.engine != GemmEngine::MmaSync && a.t >= GemmTile::Wide.tokens() =>
            {
                Some((c, name))
            }
            _ => None,
        };
        if bf16.is_some() {
            self.gemm_bf16_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let bulk = bf16.is_none() && !ws && on && lean && pk_gm == 1 && bulk_rows_ok(w.rows, a.n_rows);
        if bulk || ws {
            self.gemm_bulk_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let (codes, pk_gm) = match bf16 {
            Some((c, _)) => (c, 0i32),
            None => (codes, pk_gm),
        };
        let name = if let Some((_, name)) = bf16 {
            name.to_string()
        } else if ws {
            format!("qgemm_q4_{}_ws", if v.tile == GemmTile::Tall { "tall" } else { "narrow" })
        } else if bulk {
            bulk_entry_name(w.bits, v)
        } else {
            entry_name(w.bits, v)
        };
        let f = self.func(&name)?;
        check_i32("codes words", codes.len())?; // the kernel indexes them with int offsets
        let (pp, _g1) = codes.device_ptr(stream);
        let sbt_rows = check_i32("w.rows", w.rows)?;
        let n_rows = check_i32("n_rows", a.n_rows)?;
        let k = check_i32("k", a.k)?;
        let t = check_i32("t", a.t)?;
        let ldy = check_i32("ldy", a.ldy)?;
        let topk = p::TOP_K as i32;
        let mode = if self.gemm_fit_n() { a.mode } else { a.mode | MODE_FULL_N };
        let mut b = self.kernel(f);
        b.arg(&pp)
            .arg(&ps)
            .arg(&pb)
            .arg(&psbt)
            .arg(&sbt_rows)
            .arg(&pk_gm)
            .arg(&a.xb)
            .arg(&a.y)
            .arg(&a.res)
            .arg(&a.act)
            .arg(&a.sorted)
            .arg(&a.offsets)
            .arg(&a.tile_offs)
            .arg(&n_rows)
            .arg(&k)
            .arg(&t)
            .arg(&mode)
            .arg(&ldy)
            .arg(&topk);
        let cfg = LaunchConfig {
            grid_dim: (a.grid.0.max(1), a.grid.1.max(1), a.ksplit.max(1)),
            block_dim: (if ws { THREADS_WS } else { THREADS }, 1, 1),
            shared_mem_bytes: if bf16.is_some() {
                smem_bytes_bf(v.tile)
            } else if ws {
                smem_bytes_ws(v.tile)
            } else {
                smem_bytes(w.bits, v.tile)
            } as u32,
        };
        // SAFETY: the callers checked every buffer against the shapes the kernel reads/writes; a
        // group-major copy holds w.rows * w.cols/64 words (add_group_major), all the kernel reads;
        // the codes' group-major copy as many words as `packed` (add_group_major_codes); a bf16
        // copy rows · cols/2 words, group-major (add_bf16_weights), all the bf16 kernels read.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Allocates the routing and grouped-GEMM buffers for up to `max_t` tokens (the largest is
    /// `slot_out`, `max_t · TOP_K · D_MODEL` f32: 512 MiB at 8192 tokens, of which bf16 rows
    /// use half).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `max_t` is 0 or too large for i32 offsets; driver errors.
    pub fn moe_routing(&self, max_t: usize) -> Result<MoeRouting, CudaError> {
        if max_t == 0 {
            return Err(unsupported("moe_routing with max_t = 0".into()));
        }
        let e = max_t * p::TOP_K;
        check_i32("max_t * TOP_K * D_MODEL", e * p::D_MODEL)?;
        let chunks = e.div_ceil(SORT_CHUNK);
        self.prepare_gemm()?;
        let s = self.stream();
        Ok(MoeRouting {
            count_into: 0,
            max_t,
            t: 0,
            ids: s.alloc_zeros(e)?,
            weights: s.alloc_zeros(e)?,
            shared_weight: s.alloc_zeros(max_t)?,
            counts: s.alloc_zeros(p::N_EXPERTS)?,
            offsets: s.alloc_zeros(p::N_EXPERTS + 1)?,
            tiles64: s.alloc_zeros(p::N_EXPERTS + 1)?,
            tiles128: s.alloc_zeros(p::N_EXPERTS + 1)?,
            tiles32: s.alloc_zeros(p::N_EXPERTS + 1)?,
            tiles256: s.alloc_zeros(p::N_EXPERTS + 1)?,
            sorted: s.alloc_zeros(e)?,
            act: s.alloc_zeros(e * p::D_EXPERT)?,
            slot_out: s.alloc_zeros(e * p::D_MODEL)?,
            hist: s.alloc_zeros(p::N_EXPERTS * chunks)?,
            base: s.alloc_zeros(p::N_EXPERTS * chunks)?,
            done: s.alloc_zeros(1)?,
            force: None,
        })
    }

    /// MoE routing of `t` tokens (MODEL.md §3.7 steps 1-2, `model::top_k_renorm`): `logits`
    /// `[t, N_EXPERTS + 1]` f32 (router columns, then the shared-expert gate column) →
    /// softmax over the `N_EXPERTS`, the `TOP_K` largest (ties: lower id), weights renormalised
    /// over the k, shared weight `sigmoid(last column)`; then the per-expert counts, their
    /// exclusive scans and the entry list sorted by expert (a stable counting sort over chunks of
    /// 256 entries). No host synchronisation; deterministic. Two launches
    /// (`qgemm_moe_route_hist`: routing, per-chunk counts and, in the block that finishes
    /// last, the scan; `qgemm_moe_place`), one up to [`MOE_PLACE_IN_SCAN_MAX_CHUNKS`] chunks
    /// (that block places the entries too; [`CudaContext::set_moe_place_in_scan`]), or the four
    /// separate ones with [`CudaContext::set_moe_route_fused`] off: the same outputs.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for `t` = 0 or above `routing.max_t()`, or `logits.len()`
    /// other than `t·(N_EXPERTS + 1)`; driver errors.
    pub fn moe_route(
        &self,
        logits: &CudaView<'_, f32>,
        t: usize,
        routing: &mut MoeRouting,
    ) -> Result<(), CudaError> {
        if t == 0 || t > routing.max_t || logits.len() != t * (p::N_EXPERTS + 1) {
            return Err(unsupported(format!(
                "moe_route: t = {t} (max {}), logits has {} values (expected t x {})",
                routing.max_t,
                logits.len(),
                p::N_EXPERTS + 1
            )));
        }
        let stream = self.stream();
        let ti = t as i32;
        let n_entries = t * p::TOP_K;
        let chunks = n_entries.div_ceil(SORT_CHUNK);
        let (ne_i, ch_i) = (n_entries as i32, chunks as i32);
        let warp_blocks = (chunks.div_ceil(8) as u32, 1, 1);
        let fused = self.moe_route_fused();
        // the placement in the fused launch's last block (no qgemm_moe_place launch)
        let place_in_scan = fused && self.moe_place_in_scan() && chunks <= MOE_PLACE_IN_SCAN_MAX_CHUNKS;
        if fused {
            let mut b = self.kernel(self.func("qgemm_moe_route_hist")?);
            b.ptr(logits).arg(&ti).ptr_mut(&mut routing.ids).ptr_mut(&mut routing.weights).ptr_mut(&mut routing.shared_weight);
            b.arg(&ch_i).ptr_mut(&mut routing.hist).ptr_mut(&mut routing.base).ptr_mut(&mut routing.counts);
            b.ptr_mut(&mut routing.offsets).ptr_mut(&mut routing.tiles64).ptr_mut(&mut routing.tiles128);
            b.ptr_mut(&mut routing.tiles32).ptr_mut(&mut routing.tiles256).arg(&routing.count_into).ptr_mut(&mut routing.done);
            if place_in_scan {
                b.ptr_mut(&mut routing.sorted);
            } else {
                b.arg(&0u64);
            }
            let cfg = LaunchConfig { grid_dim: (chunks as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: logits [t, N_EXPERTS+1]; ids/weights hold max_t*TOP_K >= t*TOP_K,
            // shared_weight max_t; hist/base N_EXPERTS * chunks(max_t); done one word, 0;
            // sorted (or null) max_t*TOP_K.
            unsafe { b.launch(cfg) }?;
        } else {
            {
                let (pl, _g0) = logits.device_ptr(stream);
                let (pi, _g1) = routing.ids.device_ptr_mut(stream);
                let (pw, _g2) = routing.weights.device_ptr_mut(stream);
                let (ps, _g3) = routing.shared_weight.device_ptr_mut(stream);
                let mut b = self.kernel(self.func("qgemm_moe_route")?);
                b.arg(&pl).arg(&ti).arg(&pi).arg(&pw).arg(&ps);
                let cfg = LaunchConfig {
                    grid_dim: ((t * 32).div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: logits [t, N_EXPERTS+1]; ids/weights hold max_t*TOP_K >= t*TOP_K.
                unsafe { b.launch(cfg) }?;
            }
            {
                let (pi, _g1) = routing.ids.device_ptr(stream);
                let (ph, _g2) = routing.hist.device_ptr_mut(stream);
                let mut b = self.kernel(self.func("qgemm_moe_hist")?);
                b.arg(&pi).arg(&ne_i).arg(&ch_i).arg(&ph);
                let cfg = LaunchConfig { grid_dim: warp_blocks, block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: hist holds N_EXPERTS * chunks(max_t) >= N_EXPERTS * chunks.
                unsafe { b.launch(cfg) }?;
            }
            {
                let (ph, _g1) = routing.hist.device_ptr(stream);
                let (pb, _g2) = routing.base.device_ptr_mut(stream);
                let (pc, _g3) = routing.counts.device_ptr_mut(stream);
                let (po, _g4) = routing.offsets.device_ptr_mut(stream);
                let (p64, _g5) = routing.tiles64.device_ptr_mut(stream);
                let (p128, _g6) = routing.tiles128.device_ptr_mut(stream);
                let (p32, _g7) = routing.tiles32.device_ptr_mut(stream);
                let (p256, _g8) = routing.tiles256.device_ptr_mut(stream);
                let mut b = self.kernel(self.func("qgemm_moe_scan")?);
                b.arg(&ph).arg(&ch_i).arg(&pb).arg(&pc).arg(&po).arg(&p64).arg(&p128).arg(&p32).arg(&p256).arg(&routing.count_into);
                let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: as allocated by moe_routing.
                unsafe { b.launch(cfg) }?;
            }
        }
        if !place_in_scan {
            let (pi, _g1) = routing.ids.device_ptr(stream);
            let (pb, _g2) = routing.base.device_ptr(stream);
            let (ps, _g3) = routing.sorted.device_ptr_mut(stream);
            let mut b = self.kernel(self.func("qgemm_moe_place")?);
            b.arg(&pi).arg(&ne_i).arg(&ch_i).arg(&pb).arg(&ps);
            let cfg = LaunchConfig { grid_dim: warp_blocks, block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: sorted holds max_t * TOP_K >= n_entries; base as many chunks.
            unsafe { b.launch(cfg) }?;
        }
        routing.t = t;
        Ok(())
    }

    /// Whether [`CudaContext::moe_down_grouped`] stores the routed entries' down rows
    /// (`MoeRouting::slot_out`) as bf16 (`on`, the default: [`default_moe_slot_bf16`]) or as
    /// f32 for the combine to read back. bf16 halves that round trip (67 MB written and read
    /// per layer at 1,024 tokens in f32); each expert's output is rounded once more, to bf16,
    /// before the weighted sum, which stays f32 (transformers' reference rounds it too and
    /// sums in bf16). f32 is the measured twin.
    pub fn set_moe_slot_bf16(&self, on: bool) {
        self.moe_slot_bf16.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`CudaContext::set_moe_slot_bf16`] is on.
    pub fn moe_slot_bf16(&self) -> bool {
        self.moe_slot_bf16.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs [`CudaContext::moe_route`]'s routing, per-chunk counts and scan as one launch
    /// (`on`, the default: [`MOE_ROUTE_FUSED`]) or as three: the same outputs; for measurement
    /// and the self-test.
    pub fn set_moe_route_fused(&self, on: bool) {
        self.moe_route_fused.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the fused routing launch also places the entries in its last block when the
    /// prompt has at most [`MOE_PLACE_IN_SCAN_MAX_CHUNKS`] chunks of 256 entries (`on`, the
    /// default: one launch instead of two up to 128 tokens), or always leaves that to a
    /// `qgemm_moe_place` launch: the same outputs; for measurement and the self-test.
    pub fn set_moe_place_in_scan(&self, on: bool) {
        self.moe_place_in_scan.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`CudaContext::set_moe_place_in_scan`] is on.
    pub fn moe_place_in_scan(&self) -> bool {
        self.moe_place_in_scan.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether [`CudaContext::set_moe_route_fused`] is on.
    pub fn moe_route_fused(&self) -> bool {
        self.moe_route_fused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Grouped GEMMs by the entries an expert averages: big tiles from 512 (not reached by
    /// chunks of up to 8,192 tokens), tall (64-entry tiles, less padding per expert) from 28,
    /// narrow (32-entry tiles) below. At T = 8192 (256 per expert) on the H200 with the
    /// group-major scales and codes (session 22, `cuda_selftest --only gemm`), gate/up + down
    /// take 1,362 µs on tall against 1,447 on big with uniform routing and 1,273 against 1,280
    /// with skewed routing, so tall serves there too (big was chosen from 128 before, when
    /// it tied on uniform routing and was 11% faster skewed).
    /// With the group-major scales (session 22; `cuda_selftest --only gemm`, uniform routing,
    /// docs/CUDA.md): at T = 512 (16 per expert) narrow takes gate/up 163 µs and down + combine
    /// 106 against tall's 195 and 119; at T = 768 (24) 181 and 120 against 194 and 128; at
    /// T = 1024 (32) tall is faster, 195 and 139 against 236 and 159. The threshold lies
    /// between the last two. The narrow tile runs at three blocks per SM
    /// ([`GemmEngine::WgmmaLean3`]) while [`Self::set_gemm_grouped3`] is on (the default).
    fn choose_grouped(&self, t: usize) -> GemmVariant {
        let per_expert = t * p::TOP_K / p::N_EXPERTS;
        let three = self.gemm_grouped3() && self.auto_engine() == GemmEngine::WgmmaLean;
        let (engine, tile) = match per_expert {
            192.. if self.gemm_wide_grouped() => (self.auto_engine(), GemmTile::Wide),
            512.. => (self.auto_engine(), GemmTile::Big),
            28.. => (self.auto_engine(), GemmTile::Tall),
            _ if three => (GemmEngine::WgmmaLean3, GemmTile::Narrow),
            _ => (self.auto_engine(), GemmTile::Narrow),
        };
        GemmVariant { engine, tile }
    }

    /// Grouped expert gate/up GEMM with SwiGLU: for every expert `e` and every entry
    /// `token·TOP_K + slot` routed to it, `routing.act[entry, :] = silu(G_e·x_token) ⊙
    /// (U_e·x_token)` (MODEL.md §3.7 step 3), where `x` is the `[t, D_MODEL]` input last
    /// converted into `xs` ([`Self::convert_acts`]) and `gate_up` is one [`DeviceQMat`] of
    /// `[N_EXPERTS·2·D_EXPERT, D_MODEL]` rows: expert `e`'s gate rows at `e·2·D_EXPERT ..` and
    /// its up rows right after. `act` is bf16 (the down GEMM's input precision) in the permuted
    /// column order. One launch; the grid covers the worst case of `routing` (blocks past the
    /// routed tiles exit at once).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for shapes other than those above, or `t` other than the last
    /// [`Self::moe_route`]'s; driver errors.
    pub fn moe_gate_up_grouped(
        &self,
        gate_up: &DeviceQMat,
        xs: &GemmScratch,
        routing: &mut MoeRouting,
        t: usize,
    ) -> Result<(), CudaError> {
        let per = 2 * p::D_EXPERT;
        if gate_up.rows != p::N_EXPERTS * per || gate_up.cols != p::D_MODEL {
            return Err(unsupported(format!(
                "moe_gate_up_grouped: gate_up is [{}, {}], expected [{}, {}]",
                gate_up.rows,
                gate_up.cols,
                p::N_EXPERTS * per,
                p::D_MODEL
            )));
        }
        if routing.t != t || t == 0 || xs.conv != (t, p::D_MODEL) {
            return Err(unsupported(format!(
                "moe_gate_up_grouped: t = {t}, routed {}, converted activations [{}, {}]",
                routing.t, xs.conv.0, xs.conv.1
            )));
        }
        let v = routing.force.unwrap_or_else(|| self.choose_grouped(t));
        let bn = v.tile.tokens();
        let max_tiles = (t * p::TOP_K + p::N_EXPERTS * (bn - 1)) / bn;
        let stream = self.stream();
        let (pxb, _g0) = xs.xb.device_ptr(stream);
        let (pact, _g1) = routing.act.device_ptr_mut(stream);
        let (psort, _g2) = routing.sorted.device_ptr(stream);
        let (poff, _g3) = routing.offsets.device_ptr(stream);
        let (ptile, _g4) = grouped_tiles([&routing.tiles128, &routing.tiles64, &routing.tiles32, &routing.tiles256], v.tile).device_ptr(stream);
        let args = GemmArgs {
            xb: pxb,
            y: 0,
            res: 0,
            act: pact,
            sorted: psort,
            offsets: poff,
            tile_offs: ptile,
            n_rows: per,
            k: p::D_MODEL,
            t,
            mode: MODE_MOE_GATE_UP,
            ldy: p::D_EXPERT,
            grid: ((p::D_EXPERT / (v.tile.rows() / 2)) as u32, max_tiles as u32),
            ksplit: 1,
        };
        self.launch_gemm(gate_up, v, &args)
    }

    /// Grouped expert down GEMM and the MoE combine (MODEL.md §3.7 steps 3 and 5):
    /// `routing.slot_out[entry] = D_e·act[entry]` for every routed entry (one launch; rounded
    /// to bf16 unless [`Self::set_moe_slot_bf16`] is off), then
    /// `out[tok] = resid[tok] + Σ_slot w[tok, slot]·slot_out[tok·TOP_K + slot]
    ///             + shared_weight[tok]·shared[tok]` (one launch, f32, slots in order).
    /// `down`: one [`DeviceQMat`] `[N_EXPERTS·D_MODEL, D_EXPERT]` (expert `e`'s rows at
    /// `e·D_MODEL`); `resid`, `shared`, `out`: `[t, D_MODEL]` f32, `shared` being the shared
    /// expert's output **before** its sigmoid gate (applied here from `routing`). `out` may be
    /// `resid`'s memory. Deterministic: no atomics.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for other shapes, buffers not 16-byte aligned, or `t` other
    /// than the last [`Self::moe_route`]'s; driver errors.
    pub fn moe_down_grouped(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        down: &DeviceQMat,
        routing: &mut MoeRouting,
        resid: &CudaView<'_, f32>,
        shared: &CudaView<'_, f32>,
        t: usize,
    ) -> Result<(), CudaError> {
        self.moe_down_grouped_into(out, down, routing, resid, shared, t, None)
    }

    /// [`Self::moe_down_grouped`] with the next layer's input norm fused into the combine:
    /// `out` as there, and `rms_norm(out)·(1 + next_norm)` written as the GEMMs' bf16
    /// activations into `acts` (`[t, D_MODEL]`; bit for bit `moe_down_grouped` followed by
    /// [`Self::rms_norm_acts`]`(None, out, next_norm)`), so the next layer's input projection
    /// runs [`Self::qgemm_converted`] without a norm launch or a read of `out`.
    ///
    /// # Errors
    /// As [`Self::moe_down_grouped`]; [`CudaError::Unsupported`] when `next_norm` is not
    /// `[D_MODEL]` or `t` exceeds `acts.max_t()`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_grouped_acts(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        down: &DeviceQMat,
        routing: &mut MoeRouting,
        resid: &CudaView<'_, f32>,
        shared: &CudaView<'_, f32>,
        t: usize,
        next_norm: &CudaView<'_, f32>,
        acts: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        if next_norm.len() != p::D_MODEL {
            return Err(unsupported(format!("moe_down_grouped_acts: next_norm has {} values, expected {}", next_norm.len(), p::D_MODEL)));
        }
        crate::gdn::check_aligned16("moe_down_grouped_acts", &[("next_norm", next_norm.device_ptr(self.stream()).0)])?;
        self.moe_down_grouped_into(out, down, routing, resid, shared, t, Some((next_norm, acts)))
    }

    #[allow(clippy::too_many_arguments)]
    fn moe_down_grouped_into(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        down: &DeviceQMat,
        routing: &mut MoeRouting,
        resid: &CudaView<'_, f32>,
        shared: &CudaView<'_, f32>,
        t: usize,
        norm_acts: Option<(&CudaView<'_, f32>, &mut GemmScratch)>,
    ) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        if down.rows != p::N_EXPERTS * d || down.cols != p::D_EXPERT {
            return Err(unsupported(format!(
                "moe_down_grouped: down is [{}, {}], expected [{}, {}]",
                down.rows,
                down.cols,
                p::N_EXPERTS * d,
                p::D_EXPERT
            )));
        }
        if routing.t != t || t == 0 || out.len() != t * d || resid.len() != t * d || shared.len() != t * d {
            return Err(unsupported(format!(
                "moe_down_grouped: t = {t} (routed {}), out {} resid {} shared {} values",
                routing.t,
                out.len(),
                resid.len(),
                shared.len()
            )));
        }
        let mut norm_acts = norm_acts;
        if let Some((_, acts)) = norm_acts.as_mut() {
            // the activations' shape is checked before anything is queued
            acts.fill("moe_down_grouped_acts", t, d)?;
        }
        let v = routing.force.unwrap_or_else(|| self.choose_grouped(t));
        let bn = v.tile.tokens();
        let max_tiles = (t * p::TOP_K + p::N_EXPERTS * (bn - 1)) / bn;
        // bf16 rows: the kernel's 16-byte stores cover whole row tiles (D_MODEL is a multiple of
        // every tile's rows, asserted at compile time below MODE_MOE_DOWN_B16)
        let bf16_slots = self.moe_slot_bf16();
        let stream = self.stream();
        {
            let (pact, _g0) = routing.act.device_ptr(stream);
            let (pslot, _g1) = routing.slot_out.device_ptr_mut(stream);
            let (psort, _g2) = routing.sorted.device_ptr(stream);
            let (poff, _g3) = routing.offsets.device_ptr(stream);
            let (ptile, _g4) = grouped_tiles([&routing.tiles128, &routing.tiles64, &routing.tiles32, &routing.tiles256], v.tile).device_ptr(stream);
            let args = GemmArgs {
                xb: pact,
                y: pslot,
                res: 0,
                act: 0,
                sorted: psort,
                offsets: poff,
                tile_offs: ptile,
                n_rows: d,
                k: p::D_EXPERT,
                t,
                mode: if bf16_slots { MODE_MOE_DOWN_B16 } else { MODE_MOE_DOWN },
                ldy: d,
                grid: ((d / v.tile.rows()) as u32, max_tiles as u32),
                ksplit: 1,
            };
            self.launch_gemm(down, v, &args)?;
        }
        let (po, _g0) = out.device_ptr_mut(stream);
        let (pr, _g1) = resid.device_ptr(stream);
        let (pslot, _g2) = routing.slot_out.device_ptr(stream);
        let (pw, _g3) = routing.weights.device_ptr(stream);
        let (psh, _g4) = shared.device_ptr(stream);
        let (psw, _g5) = routing.shared_weight.device_ptr(stream);
        if (po | pr | psh) % 16 != 0 {
            return Err(unsupported("moe_down_grouped: out, resid and shared must be 16-byte aligned".into()));
        }
        let ti = t as i32;
        match norm_acts {
            None => {
                let mut b = self.kernel(self.func(if bf16_slots { "qgemm_moe_combine_b16" } else { "qgemm_moe_combine" })?);
                b.arg(&po).arg(&pr).arg(&pslot).arg(&pw).arg(&psh).arg(&psw).arg(&ti);
                let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: all buffers [t, D_MODEL] (checked), slot_out/weights sized for max_t >= t.
                unsafe { b.launch(cfg) }?;
            }
            Some((nw, acts)) => {
                {
                    let f = self.func(if bf16_slots { "moe_combine_norm_acts_b16" } else { "moe_combine_norm_acts" })?;
                    let xb = acts.fill("moe_down_grouped_acts", t, d)?;
                    let (pxb, _g6) = xb.device_ptr_mut(stream);
                    let (pnw, _g7) = nw.device_ptr(stream);
                    let eps = p::RMS_EPS;
                    let mut b = self.kernel(f);
                    b.arg(&po).arg(&pr).arg(&pslot).arg(&pw).arg(&psh).arg(&psw).arg(&pnw).arg(&pxb).arg(&eps).arg(&ti);
                    let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: ((d / 8) as u32, 1, 1), shared_mem_bytes: 0 };
                    // SAFETY: as above; next_norm has D_MODEL values, the scratch room for
                    // t·D_MODEL bf16 (checked by `fill`).
                    unsafe { b.launch(cfg) }?;
                }
                acts.filled(t, d);
            }
        }
        Ok(())
    }
}
