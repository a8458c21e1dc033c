//! Gated full-attention layer core for a block of prompt tokens (prefill) on the GPU:
//! docs/MODEL.md §3.6 steps 2-5 between the `q|k|v` projections and `o_proj`. Kernels:
//! `kernels/attn_prefill.cu`.
//!
//! Two launches, queued eagerly on [`CudaContext::stream`] with `t` and `pos0` as host values
//! (prefill runs outside the decode graph):
//! * `attn_prefill_prep`: q/k ZNorm (`1 + w`, eps `RMS_EPS`) and rotate-half RoPE on the first
//!   `ROTARY_DIM` dims at positions `pos0 .. pos0 + t`; queries to a bf16 scratch, keys and
//!   values to the bf16 KV cache rows `pos0 .. pos0 + t`.
//! * `attn_prefill_flash_q{64,128}`: causal flash attention on tensor cores (mma.sync m16n8k16
//!   bf16, fp32 accumulation, FlashAttention-2 online softmax in fp32) over cache rows
//!   `0 .. pos0 + t`, the 8 query heads of a KV head sharing every loaded K/V tile, then the
//!   output gate `⊙ sigmoid(gate)`.
//!
//! The CPU twin is the attention path of `model::Model` (crates/model/src/lib.rs) with
//! `model::reference::{zrms_norm, rope_inplace, attend, sigmoid}`.

use cudarc::driver::{
    sys, sys::CUfunction_attribute, CudaSlice, CudaView, CudaViewMut, DevicePtr, DeviceRepr, DriverError, LaunchConfig,
};
use spec::production as p;

use crate::{gemm::GemmScratch, CudaContext, CudaError};

/// Width of one token's row of `proj`: `q_proj` output (`N_Q_HEADS` heads × `[query HEAD_DIM |
/// gate HEAD_DIM]`, interleaved per head as `model::load::AttnWeights::q_proj` rows) | k
/// (`N_KV_HEADS · HEAD_DIM`) | v (`N_KV_HEADS · HEAD_DIM`) = 9216.
pub const ATTN_PREFILL_PROJ: usize =
    p::N_Q_HEADS * 2 * p::HEAD_DIM + 2 * p::N_KV_HEADS * p::HEAD_DIM;

/// Width of one token's row of the output (input of `o_proj`): `N_Q_HEADS · HEAD_DIM`.
pub const ATTN_PREFILL_OUT: usize = p::N_Q_HEADS * p::HEAD_DIM;

/// bf16 elements of one position of a KV cache: `N_KV_HEADS · HEAD_DIM`.
pub const KV_ROW: usize = p::N_KV_HEADS * p::HEAD_DIM;

/// Keys per K/V tile of the flash kernel (`AP_BN` in the kernel).
const BN: usize = 64;

/// Entry point of the split-KV flash kernel (the Wg64 tile).
const SPLIT_ENTRY: &str = "attn_prefill_flash_wg64_split";

/// Q tile of the flash kernel: rows = 8 query heads × tokens, one block per tile and KV head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnTile {
    /// 64 rows (8 tokens), 4 warps, 96 KiB shared memory, two blocks per SM.
    Q64,
    /// 128 rows (16 tokens), 8 warps, 128 KiB shared memory, one block per SM.
    Q128,
    /// 64 rows (8 tokens), one warpgroup issuing wgmma (operands straight from shared
    /// memory), 97 KiB shared memory, two blocks per SM.
    Wg64,
    /// 128 rows (16 tokens), two warpgroups issuing wgmma, 129 KiB shared memory, one block
    /// per SM.
    Wg128,
    /// [`AttnTile::Wg128`] warp-specialized as FlashAttention-3 (Shah et al. 2024, §3.1-3.2)
    /// arranges it: a producer warpgroup copies K and V into two stages each (mbarriers, no
    /// block barrier in the loop) and the two consumer warpgroups take turns on the tensor
    /// cores, one's softmax beside the other's products (384 threads, 240 registers per
    /// consumer thread by `setmaxnreg`, 193 KiB shared memory). The same products in the same
    /// order, so the same bits. This form's producer copies by cp.async from all its 128
    /// threads (1,329 µs at 8,192 tokens on an H100); [`CudaContext::set_attn_ws`] runs it
    /// where the plan says `Wg128` when [`set_attn_ws_form`] names it.
    Wg128ws,
    /// [`AttnTile::Wg128ws`] with the producer's copies as bulk tensor copies (TMA) from one
    /// thread, from tensor maps of the Q scratch and the caches built at each call (rows past
    /// `pos0 + t` read as zeros). What the prefill runs where the plan says `Wg128` (session
    /// 53: 1,030 against 1,377 µs for `Wg128` at 8,192 tokens on an H100, 534 TFLOP/s).
    Wg128tma,
    /// [`AttnTile::Wg128tma`] over clusters of two blocks that hold adjacent tiles of one KV
    /// head: each block copies half of every K and V block and multicasts it into both, so
    /// each key block crosses from L2 once per two tiles. Measured slower (1,658 µs at 8,192
    /// tokens on an H100: the consumers' cluster-scope releases of each stage stall on memory
    /// barriers); opt-in.
    Wg128mc,
}

impl AttnTile {
    /// Every tile, for tests and benchmarks.
    pub const ALL: [AttnTile; 7] = [
        AttnTile::Q64,
        AttnTile::Q128,
        AttnTile::Wg64,
        AttnTile::Wg128,
        AttnTile::Wg128ws,
        AttnTile::Wg128tma,
        AttnTile::Wg128mc,
    ];

    /// The warp-specialized forms (a producer warpgroup, 384 threads).
    fn specialized(self) -> bool {
        matches!(self, AttnTile::Wg128ws | AttnTile::Wg128tma | AttnTile::Wg128mc)
    }

    /// Warps that hold Q rows (16 rows each).
    fn warps(self) -> usize {
        match self {
            AttnTile::Q64 | AttnTile::Wg64 => 4,
            AttnTile::Q128 | AttnTile::Wg128 | AttnTile::Wg128ws | AttnTile::Wg128tma | AttnTile::Wg128mc => 8,
        }
    }

    /// Threads per block: the Q rows' warps, plus the producer warpgroup of the
    /// warp-specialized tiles.
    fn threads(self) -> usize {
        let producer = if self.specialized() { 128 } else { 0 };
        self.warps() * 32 + producer
    }

    /// Tokens per Q tile.
    pub fn tokens(self) -> usize {
        self.warps() * 16 / (p::N_Q_HEADS / p::N_KV_HEADS)
    }

    fn entry(self) -> &'static str {
        match self {
            AttnTile::Q64 => "attn_prefill_flash_q64",
            AttnTile::Q128 => "attn_prefill_flash_q128",
            AttnTile::Wg64 => "attn_prefill_flash_wg64",
            AttnTile::Wg128 => "attn_prefill_flash_wg128",
            AttnTile::Wg128ws => "attn_prefill_flash_wg128ws",
            AttnTile::Wg128tma => "attn_prefill_flash_wg128tma",
            AttnTile::Wg128mc => "attn_prefill_flash_wg128mc",
        }
    }

    /// The entry point that writes the o_proj GEMM's bf16 activations instead of f32 rows
    /// (the wgmma tiles only).
    fn acts_entry(self) -> Option<&'static str> {
        match self {
            AttnTile::Wg64 => Some("attn_prefill_flash_wg64_acts"),
            AttnTile::Wg128 => Some("attn_prefill_flash_wg128_acts"),
            AttnTile::Wg128ws => Some("attn_prefill_flash_wg128ws_acts"),
            AttnTile::Wg128tma => Some("attn_prefill_flash_wg128tma_acts"),
            AttnTile::Wg128mc => Some("attn_prefill_flash_wg128mc_acts"),
            AttnTile::Q64 | AttnTile::Q128 => None,
        }
    }

    /// Dynamic shared memory: the Q tile and one K and one V tile of [`BN`] keys (two of
    /// each and the stages' eight mbarriers for the warp-specialized tiles), bf16, plus 1 KiB for
    /// the wgmma kernels to align their tiles to the 128-byte swizzle's 1 KiB atoms.
    fn smem_bytes(self) -> usize {
        let slack = match self {
            AttnTile::Wg64 | AttnTile::Wg128 => 1024,
            AttnTile::Wg128ws | AttnTile::Wg128tma | AttnTile::Wg128mc => 1024 + 8 * 8,
            AttnTile::Q64 | AttnTile::Q128 => 0,
        };
        let kv_tiles = if self.specialized() { 4 } else { 2 };
        (self.warps() * 16 + kv_tiles * BN) * p::HEAD_DIM * 2 + slack
    }
}

/// A bulk-tensor-copy descriptor (`CUtensorMap`) as a kernel argument (`ApTmap` in
/// `kernels/attn_prefill.cu`: 128 opaque bytes, 64-byte aligned, passed by value as a
/// `__grid_constant__` parameter).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TensorMap3d(sys::CUtensorMap);

// SAFETY: plain bytes that the driver copies into the kernel's parameter space.
unsafe impl DeviceRepr for TensorMap3d {}

impl TensorMap3d {
    /// The map of a bf16 tensor at device address `ptr` with `dims` elements (innermost first),
    /// the byte strides of dimensions 1 and 2, copied in boxes of `boxes` elements into the
    /// 128-byte-swizzled layout the wgmma tiles read (`boxes[0]` · 2 = 128 bytes); elements
    /// outside `dims` read as zeros (`cuTensorMapEncodeTiled`, CUDA driver API). Errors: the
    /// driver's, e.g. for a misaligned address or stride.
    fn bf16(ptr: u64, dims: [u64; 3], strides: [u64; 2], boxes: [u32; 3]) -> Result<Self, CudaError> {
        // SAFETY: an all-zero CUtensorMap is a valid (opaque) value to be overwritten.
        let mut map = TensorMap3d(unsafe { std::mem::zeroed() });
        let elem_strides = [1u32; 3];
        // SAFETY: every pointer is to a local array of the rank's length; the driver only
        // writes `map`.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map.0,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                3,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(map)
        } else {
            Err(CudaError::Driver(DriverError(r)))
        }
    }
}

/// Most (token, split) pairs the split-KV partials of a scratch hold: `t · n_split ≤
/// SPLIT_CAP` (64 MiB of f32 partial outputs).
pub const SPLIT_CAP: usize = 4096;
/// Most splits of one call.
pub const MAX_SPLIT: usize = 32;
/// Fewest 64-key blocks a split is planned with (a split also loads its Q tile and writes
/// 64 KiB of partials).
const MIN_SPLIT_BLOCKS: usize = 4;
/// Planning cost of the split's combine pass, in units of one 64-key block of a Wg64 block
/// (~3 µs: one more launch and the partials' round trip).
const SPLIT_OVERHEAD_BLOCKS: usize = 3;

/// How [`CudaContext::attn_prefill`] runs the flash part: the tile, and `n_split > 1` for
/// split-KV (only with [`AttnTile::Wg64`]: `attn_prefill_flash_wg64_split` then
/// `attn_prefill_combine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnPlan {
    /// Q tile.
    pub tile: AttnTile,
    /// Key-range splits per tile (1: none).
    pub n_split: usize,
}

/// The plan for `t` tokens at `pos0` on a GPU with `sm_count` SMs (a pure function; measured
/// on the H200, docs/CUDA.md), with the causal split on ([`attn_prefill_plan_with`]).
pub fn attn_prefill_plan(t: usize, pos0: usize, sm_count: usize) -> AttnPlan {
    attn_prefill_plan_with(t, pos0, sm_count, true)
}

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_attn_causal_split`] on (the
/// process default, [`set_default_attn_causal_split`]; on unless set).
pub fn default_attn_causal_split() -> bool {
    DEFAULT_ATTN_CAUSAL_SPLIT.load(std::sync::atomic::Ordering::Relaxed)
}

static DEFAULT_ATTN_CAUSAL_SPLIT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Sets [`default_attn_causal_split`] for contexts created afterwards (`calla cuda-bench |
/// cuda-check --attn-no-causal-split` turns it off).
pub fn set_default_attn_causal_split(on: bool) {
    DEFAULT_ATTN_CAUSAL_SPLIT.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a new [`CudaContext`] starts with [`CudaContext::set_attn_ws`] on (the
/// process default, [`set_default_attn_ws`]; [`ATTN_WS_DEFAULT`] unless set).
pub fn default_attn_ws() -> bool {
    DEFAULT_ATTN_WS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The built-in default of [`default_attn_ws`]: on since session 53 (with [`AttnTile::Wg128tma`],
/// [`set_attn_ws_form`]'s default: the flash part alone 25% faster at 8,192 tokens on an H100,
/// the same bits).
pub const ATTN_WS_DEFAULT: bool = true;

static DEFAULT_ATTN_WS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(ATTN_WS_DEFAULT);

/// Sets [`default_attn_ws`] for contexts created afterwards (`calla cuda-bench |
/// cuda-check --attn-ws BOOL`).
pub fn set_default_attn_ws(on: bool) {
    DEFAULT_ATTN_WS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Which warp-specialized tile [`CudaContext::set_attn_ws`] runs in place of the plan's
/// [`AttnTile::Wg128`], for every context of the process: [`AttnTile::Wg128tma`] (the default),
/// [`AttnTile::Wg128ws`] or [`AttnTile::Wg128mc`] (`calla cuda-bench | cuda-check
/// --attn-ws-form`); any other tile is refused with [`CudaError::Unsupported`].
#[doc(hidden)]
pub fn set_attn_ws_form(tile: AttnTile) -> Result<(), CudaError> {
    let code = match tile {
        AttnTile::Wg128tma => 0,
        AttnTile::Wg128ws => 1,
        AttnTile::Wg128mc => 2,
        other => return Err(CudaError::Unsupported(format!("set_attn_ws_form: {other:?} is not a warp-specialized tile"))),
    };
    ATTN_WS_FORM.store(code, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// See [`set_attn_ws_form`].
#[doc(hidden)]
pub fn attn_ws_form() -> AttnTile {
    match ATTN_WS_FORM.load(std::sync::atomic::Ordering::Relaxed) {
        1 => AttnTile::Wg128ws,
        2 => AttnTile::Wg128mc,
        _ => AttnTile::Wg128tma,
    }
}

static ATTN_WS_FORM: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The key blocks the [`AttnTile::Wg64`] tiles of `t` tokens at `pos0` walk: the heaviest
/// tile's (the last one's: its last query sees `pos0 + t` keys) and the sum over all tiles and
/// KV heads (tile `i` holds tokens `8i .. 8i + 8`, its last query sees `pos0 + 8i + 8` keys).
fn wg64_key_blocks(t: usize, pos0: usize) -> (usize, usize) {
    let tok = AttnTile::Wg64.tokens();
    let per_head: usize = (0..t.div_ceil(tok))
        .map(|i| (pos0 + ((i + 1) * tok).min(t)).div_ceil(BN))
        .sum();
    ((pos0 + t).div_ceil(BN), per_head * p::N_KV_HEADS)
}

/// [`attn_prefill_plan`] with the causal split on or off (`causal_split`;
/// [`CudaContext::set_attn_causal_split`], measured against each other by `calla cuda-bench
/// --prefill-compare`):
/// * **causal split** (`causal_split`, `t < 2048`): when the [`AttnTile::Wg64`] blocks fill
///   the SMs but the heaviest tile's key blocks exceed 1.2 × what each of the `2 · sm_count`
///   block slots would walk if the whole causal triangle were spread evenly, the heaviest
///   tiles set the time (a 1k-token prompt from position 0: 16 key blocks against ~9), so every
///   tile's key range is cut in two (`n_split` 2). Measured on the H200 (self-test `attnpre`,
///   flash part alone, µs): 768 tokens 63.8 → 42.2, 1,024 tokens 75.3 (Wg128) → 58.9, 1,536
///   114.9 (Wg128) → 98.8; three or four splits are slower than two there (their partials'
///   round trip grows with `t · n_split`), and at 2,048 tokens the tiles are balanced (Wg128
///   149.7 against 147.2 split, within noise), which the rule leaves to Wg128.
/// * `t ≥ 1024`: [`AttnTile::Wg128`] (half the K/V traffic per FLOP of Wg64; faster from
///   ~1-2k tokens on).
/// * otherwise [`AttnTile::Wg64`]; when its blocks (`⌈t/8⌉ · N_KV_HEADS`) do not fill the SMs,
///   the key range is split to minimise (waves of blocks) × (key blocks per split), counting
///   the combine pass as [`SPLIT_OVERHEAD_BLOCKS`], with at least [`MIN_SPLIT_BLOCKS`] key
///   blocks per split, `t · n_split ≤` [`SPLIT_CAP`] and `n_split ≤` [`MAX_SPLIT`].
pub fn attn_prefill_plan_with(t: usize, pos0: usize, sm_count: usize, causal_split: bool) -> AttnPlan {
    let sms = sm_count.max(1);
    let slots = 2 * sms; // two Wg64 blocks per SM
    let blocks = t.div_ceil(AttnTile::Wg64.tokens()).max(1) * p::N_KV_HEADS;
    if causal_split && t < 2048 && blocks >= sms && 2 * t <= SPLIT_CAP {
        let (heaviest, total) = wg64_key_blocks(t, pos0);
        if heaviest >= 2 && 5 * heaviest > 6 * total.div_ceil(slots) {
            return AttnPlan {
                tile: AttnTile::Wg64,
                n_split: 2,
            };
        }
    }
    if t >= 1024 {
        return AttnPlan {
            tile: AttnTile::Wg128,
            n_split: 1,
        };
    }
    let tile = AttnTile::Wg64;
    if blocks >= sms {
        return AttnPlan { tile, n_split: 1 };
    }
    let key_blocks = (pos0 + t).div_ceil(BN);
    let max_split = (key_blocks / MIN_SPLIT_BLOCKS)
        .min(SPLIT_CAP / t.max(1))
        .clamp(1, MAX_SPLIT);
    let cost = |n: usize| {
        let waves = (blocks * n).div_ceil(slots);
        waves * key_blocks.div_ceil(n) + if n > 1 { SPLIT_OVERHEAD_BLOCKS } else { 0 }
    };
    let n_split = (1..=max_split).min_by_key(|&n| (cost(n), n)).unwrap_or(1);
    AttnPlan { tile, n_split }
}

/// Device scratch of [`CudaContext::attn_prefill`]: the normed, roped queries of up to `max_t`
/// tokens as bf16, `[max_t, N_Q_HEADS, HEAD_DIM]`, and the split-KV partials (`[SPLIT_CAP,
/// N_Q_HEADS, HEAD_DIM]` outputs and `[SPLIT_CAP, N_Q_HEADS, 2]` max and sum, f32). Create
/// once with [`CudaContext::attn_prefill_scratch`] (which also raises the flash kernels'
/// shared-memory limit) and reuse for every layer.
pub struct AttnPrefillScratch {
    max_t: usize,
    q: CudaSlice<u16>,
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
}

impl AttnPrefillScratch {
    /// Most tokens one call may take.
    pub fn max_t(&self) -> usize {
        self.max_t
    }

    /// The queries of the last call (bf16 bits, `[max_t, N_Q_HEADS, HEAD_DIM]`, the first `t`
    /// rows valid): ZNormed with `q_norm` and roped, not scaled. For tests and diagnostics.
    pub fn q_bf16(&self) -> &CudaSlice<u16> {
        &self.q
    }
}

/// Floating-point operations of causal attention for `t` queries at positions `pos0 ..
/// pos0 + t` (query at `pos0 + i` sees `pos0 + i + 1` keys): `4 · HEAD_DIM · N_Q_HEADS ·
/// Σ keys` (Q·Kᵀ and P·V, multiply and add each). What the TFLOP/s figures count.
pub fn causal_flops(t: usize, pos0: usize) -> f64 {
    let keys = t as f64 * pos0 as f64 + (t as f64) * (t as f64 + 1.0) / 2.0;
    4.0 * (p::HEAD_DIM * p::N_Q_HEADS) as f64 * keys
}

impl CudaContext {
    /// Lets [`Self::attn_prefill`]'s plan cut causal prompts' key ranges in two (`true`, the
    /// default; [`attn_prefill_plan_with`]'s causal split) or keeps the plans of before
    /// (`false`, the measured twin). Results differ only by the f32 rounding of the split's
    /// merge. A [`CudaContext::sibling`] copies the setting.
    #[doc(hidden)]
    pub fn set_attn_causal_split(&self, on: bool) {
        self.attn_causal_split.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_attn_causal_split`].
    #[doc(hidden)]
    pub fn attn_causal_split(&self) -> bool {
        self.attn_causal_split.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs the plan's [`AttnTile::Wg128`] as the warp-specialized form [`set_attn_ws_form`]
    /// names ([`AttnTile::Wg128tma`] by default; `true`, the default since session 53) or as planned
    /// (`false`, the measured twin): the same bits either way. A [`CudaContext::sibling`]
    /// copies the setting; new contexts start with [`default_attn_ws`].
    #[doc(hidden)]
    pub fn set_attn_ws(&self, on: bool) {
        self.attn_ws.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// See [`Self::set_attn_ws`].
    #[doc(hidden)]
    pub fn attn_ws(&self) -> bool {
        self.attn_ws.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Scratch for [`Self::attn_prefill`] calls of up to `max_t` tokens (`max_t · 8 KiB` plus
    /// 64.5 MiB of device memory). Also sets the flash kernels' dynamic shared-memory limit (above the
    /// default 48 KiB), so create it before the first call.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `max_t` is 0; [`CudaError::Driver`] when allocation or the
    /// attribute fails.
    pub fn attn_prefill_scratch(&self, max_t: usize) -> Result<AttnPrefillScratch, CudaError> {
        if max_t == 0 {
            return Err(CudaError::Unsupported(
                "attn_prefill_scratch: max_t = 0".into(),
            ));
        }
        let entries = AttnTile::ALL
            .iter()
            .flat_map(|t| [Some(t.entry()), t.acts_entry()].into_iter().flatten().map(move |e| (e, t.smem_bytes())))
            .chain([(SPLIT_ENTRY, AttnTile::Wg64.smem_bytes())]);
        for (entry, smem) in entries {
            self.func(entry)?.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let stream = self.stream();
        let q = stream.alloc_zeros::<u16>(max_t * p::N_Q_HEADS * p::HEAD_DIM)?;
        let part_o = stream.alloc_zeros::<f32>(SPLIT_CAP * p::N_Q_HEADS * p::HEAD_DIM)?;
        let part_ml = stream.alloc_zeros::<f32>(SPLIT_CAP * p::N_Q_HEADS * 2)?;
        Ok(AttnPrefillScratch {
            max_t,
            q,
            part_o,
            part_ml,
        })
    }

    /// The gated full-attention core for `t` prompt tokens at positions `pos0 .. pos0 + t`
    /// (docs/MODEL.md §3.6 steps 2-5). Asynchronous on [`Self::stream`]:
    /// [`Self::attn_prefill_prep`], then the flash part as [`attn_prefill_plan_with`] says (with
    /// [`Self::attn_causal_split`])
    /// ([`Self::attn_prefill_flash`], or [`Self::attn_prefill_flash_split`] for few tokens
    /// over a long prefix): two or three kernel launches.
    ///
    /// * `proj`: `[≥ t, ATTN_PREFILL_PROJ]` f32, per token the `q_proj` output (16 heads ×
    ///   `[query 256 | gate 256]`) | k (2 × 256) | v (2 × 256); rows past `t` are not read.
    /// * `q_norm`, `k_norm`: `[HEAD_DIM]` zero-centred ZNorm weights (applied as `1 + w`).
    /// * `inv_freq`: `[ROTARY_DIM / 2]` = `model::reference::rope_inv_freq(ROPE_THETA,
    ///   ROTARY_DIM)`.
    /// * `k_cache`, `v_cache`: `[max_ctx, N_KV_HEADS, HEAD_DIM]` bf16 bits. Rows `0 .. pos0`
    ///   must hold the earlier positions; rows `pos0 .. pos0 + t` are written (K normed and
    ///   roped, V as projected, both rounded to nearest even); other rows are not touched.
    /// * `out`: `[≥ t, N_Q_HEADS · HEAD_DIM]` f32, head-major per token: `softmax(q·Kᵀ/16)·V ⊙
    ///   sigmoid(gate)` (the input of `o_proj`); rows past `t` are not written.
    ///
    /// `t = 0` does nothing.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `pos0 + t` exceeds the caches, `t` exceeds the scratch,
    /// a length is wrong, or a buffer is not 16-byte aligned; [`CudaError::Driver`] when a
    /// launch fails.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill(
        &self,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        q_norm: &CudaView<'_, f32>,
        k_norm: &CudaView<'_, f32>,
        inv_freq: &CudaView<'_, f32>,
        k_cache: &mut CudaViewMut<'_, u16>,
        v_cache: &mut CudaViewMut<'_, u16>,
        scratch: &mut AttnPrefillScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        self.attn_prefill_to(proj, t, pos0, q_norm, k_norm, inv_freq, k_cache, v_cache, scratch, FlashOut::F32(out))
    }

    /// [`Self::attn_prefill`] with the output written as the `o_proj` GEMM's bf16 activations
    /// into `acts` (`[t, N_Q_HEADS · HEAD_DIM]`, `gemm.cu`'s permuted order, rounded to
    /// nearest even as [`Self::convert_acts`] rounds: the same bits as `attn_prefill` followed
    /// by `convert_acts`), for [`Self::qgemm_converted`]; no f32 rows are written. The flash
    /// part runs on the planned wgmma tile (or split), whose epilogues write the activations.
    ///
    /// # Errors
    /// As [`Self::attn_prefill`], and [`CudaError::Unsupported`] when `t` exceeds `acts`.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill_acts(
        &self,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        q_norm: &CudaView<'_, f32>,
        k_norm: &CudaView<'_, f32>,
        inv_freq: &CudaView<'_, f32>,
        k_cache: &mut CudaViewMut<'_, u16>,
        v_cache: &mut CudaViewMut<'_, u16>,
        scratch: &mut AttnPrefillScratch,
        acts: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        self.attn_prefill_to(proj, t, pos0, q_norm, k_norm, inv_freq, k_cache, v_cache, scratch, FlashOut::Acts(acts))
    }

    #[allow(clippy::too_many_arguments)]
    fn attn_prefill_to(
        &self,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        q_norm: &CudaView<'_, f32>,
        k_norm: &CudaView<'_, f32>,
        inv_freq: &CudaView<'_, f32>,
        k_cache: &mut CudaViewMut<'_, u16>,
        v_cache: &mut CudaViewMut<'_, u16>,
        scratch: &mut AttnPrefillScratch,
        out: FlashOut<'_, '_>,
    ) -> Result<(), CudaError> {
        // the output's size before anything is queued (the flash part checks it again)
        out.check("attn_prefill", t, self.stream())?;
        self.attn_prefill_prep(
            proj, t, pos0, q_norm, k_norm, inv_freq, k_cache, v_cache, scratch,
        )?;
        let plan = attn_prefill_plan_with(t, pos0, self.sm_count() as usize, self.attn_causal_split());
        let (kc, vc) = (k_cache.as_view(), v_cache.as_view());
        if plan.n_split > 1 {
            self.flash_split(plan.n_split, proj, t, pos0, &kc, &vc, scratch, out)
        } else {
            let tile = match plan.tile {
                AttnTile::Wg128 if self.attn_ws() => attn_ws_form(),
                tile => tile,
            };
            self.flash(tile, proj, t, pos0, &kc, &vc, scratch, out)
        }
    }

    /// First half of [`Self::attn_prefill`]: ZNorm + RoPE of the queries into `scratch`, of the
    /// keys into `k_cache` rows `pos0 .. pos0 + t`, and the values into `v_cache` rows
    /// `pos0 .. pos0 + t` (bf16). One warp per token and head; arguments as there.
    ///
    /// # Errors
    /// As [`Self::attn_prefill`].
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill_prep(
        &self,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        q_norm: &CudaView<'_, f32>,
        k_norm: &CudaView<'_, f32>,
        inv_freq: &CudaView<'_, f32>,
        k_cache: &mut CudaViewMut<'_, u16>,
        v_cache: &mut CudaViewMut<'_, u16>,
        scratch: &mut AttnPrefillScratch,
    ) -> Result<(), CudaError> {
        let stream = self.stream();
        check_common(
            "attn_prefill_prep",
            proj,
            t,
            pos0,
            k_cache.len(),
            v_cache.len(),
            scratch,
        )?;
        let lens = [
            ("q_norm", q_norm.len(), p::HEAD_DIM),
            ("k_norm", k_norm.len(), p::HEAD_DIM),
            ("inv_freq", inv_freq.len(), p::ROTARY_DIM / 2),
        ];
        for (name, got, want) in lens {
            if got != want {
                return Err(CudaError::Unsupported(format!(
                    "attn_prefill_prep: {name} has {got} elements, expected {want}"
                )));
            }
        }
        check_aligned(
            "attn_prefill_prep",
            &[
                ("proj", proj.device_ptr(stream).0),
                ("q_norm", q_norm.device_ptr(stream).0),
                ("k_norm", k_norm.device_ptr(stream).0),
                ("k_cache", k_cache.device_ptr(stream).0),
                ("v_cache", v_cache.device_ptr(stream).0),
            ],
        )?;
        if t == 0 {
            return Ok(());
        }
        let items = t * (p::N_Q_HEADS + 2 * p::N_KV_HEADS);
        let cfg = LaunchConfig {
            grid_dim: (items.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (t_i, pos0_i) = (t as i32, pos0 as i32);
        let mut b = self.kernel(self.func("attn_prefill_prep")?);
        b.ptr_mut(&mut scratch.q)
            .ptr_mut(k_cache)
            .ptr_mut(v_cache)
            .ptr(proj)
            .ptr(q_norm)
            .ptr(k_norm)
            .ptr(inv_freq)
            .arg(&t_i)
            .arg(&pos0_i);
        // SAFETY: argument order and types match the kernel; lengths and bounds checked above
        // (the kernel touches proj rows < t, scratch rows < t ≤ max_t, cache rows < pos0 + t).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Second half of [`Self::attn_prefill`]: causal flash attention of the queries in
    /// `scratch` (written by [`Self::attn_prefill_prep`] for the same `t`) over cache rows
    /// `0 .. pos0 + t`, times `sigmoid(gate)` read from `proj`, into `out`. `tile` picks the Q
    /// tile; arguments and errors as [`Self::attn_prefill`].
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill_flash(
        &self,
        tile: AttnTile,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        k_cache: &CudaView<'_, u16>,
        v_cache: &CudaView<'_, u16>,
        scratch: &AttnPrefillScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        self.flash(tile, proj, t, pos0, k_cache, v_cache, scratch, FlashOut::F32(out))
    }

    /// [`Self::attn_prefill_flash`] writing the `o_proj` GEMM's bf16 activations into `acts`
    /// (as [`Self::attn_prefill_acts`]); the wgmma tiles only. For tests.
    ///
    /// # Errors
    /// As [`Self::attn_prefill_acts`]; [`CudaError::Unsupported`] for the mma.sync tiles.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill_flash_acts(
        &self,
        tile: AttnTile,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        k_cache: &CudaView<'_, u16>,
        v_cache: &CudaView<'_, u16>,
        scratch: &AttnPrefillScratch,
        acts: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        self.flash(tile, proj, t, pos0, k_cache, v_cache, scratch, FlashOut::Acts(acts))
    }

    /// [`Self::attn_prefill_flash`] into `out`'s kind of output.
    #[allow(clippy::too_many_arguments)]
    fn flash(
        &self,
        tile: AttnTile,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        k_cache: &CudaView<'_, u16>,
        v_cache: &CudaView<'_, u16>,
        scratch: &AttnPrefillScratch,
        out: FlashOut<'_, '_>,
    ) -> Result<(), CudaError> {
        let stream = self.stream();
        let op = "attn_prefill_flash";
        check_common(op, proj, t, pos0, k_cache.len(), v_cache.len(), scratch)?;
        check_aligned(
            op,
            &[
                ("proj", proj.device_ptr(stream).0),
                ("k_cache", k_cache.device_ptr(stream).0),
                ("v_cache", v_cache.device_ptr(stream).0),
            ],
        )?;
        let entry = match &out {
            FlashOut::F32(_) => tile.entry(),
            FlashOut::Acts(_) => tile.acts_entry().ok_or_else(|| {
                CudaError::Unsupported(format!("{op}: the {tile:?} tile writes no GEMM activations (the wgmma tiles do)"))
            })?,
        };
        let Some(mut out) = out.prepare(op, t, stream)? else {
            return Ok(());
        };
        let n_tiles = t.div_ceil(tile.tokens());
        // Wg128mc: clusters of two blocks, a pair of tiles each
        let blocks = if tile == AttnTile::Wg128mc { n_tiles.div_ceil(2) * 2 } else { n_tiles };
        let cfg = LaunchConfig {
            grid_dim: ((blocks * p::N_KV_HEADS) as u32, 1, 1),
            block_dim: (tile.threads() as u32, 1, 1),
            shared_mem_bytes: tile.smem_bytes() as u32,
        };
        let (t_i, pos0_i) = (t as i32, pos0 as i32);
        // softmax in base 2: exp(s / sqrt(d)) = 2^(s · log2(e) / sqrt(d))
        let scale_log2 = std::f32::consts::LOG2_E / (p::HEAD_DIM as f32).sqrt();
        let maps = match tile {
            AttnTile::Wg128tma | AttnTile::Wg128mc => {
                let (hd, row) = (p::HEAD_DIM as u64, 2 * p::HEAD_DIM as u64);
                let keys = (pos0 + t) as u64;
                Some([
                    TensorMap3d::bf16(scratch.q.device_ptr(stream).0, [hd, p::N_Q_HEADS as u64, t as u64], [row, row * p::N_Q_HEADS as u64], [64, 8, 16])?,
                    TensorMap3d::bf16(k_cache.device_ptr(stream).0, [hd, p::N_KV_HEADS as u64, keys], [row, row * p::N_KV_HEADS as u64], [64, 1, BN as u32])?,
                    TensorMap3d::bf16(v_cache.device_ptr(stream).0, [hd, p::N_KV_HEADS as u64, keys], [row, row * p::N_KV_HEADS as u64], [64, 1, BN as u32])?,
                ])
            }
            _ => None,
        };
        let mut b = self.kernel(self.func(entry)?);
        out.push(&mut b, op, t)?;
        match &maps {
            Some([qm, km, vm]) => {
                b.ptr(proj).arg(&t_i).arg(&pos0_i).arg(&scale_log2).arg(qm).arg(km).arg(vm);
            }
            None => {
                b.ptr(&scratch.q)
                    .ptr(k_cache)
                    .ptr(v_cache)
                    .ptr(proj)
                    .arg(&t_i)
                    .arg(&pos0_i)
                    .arg(&scale_log2);
            }
        }
        // SAFETY: argument order and types match the kernel; bounds checked above (reads proj
        // rows < t, scratch rows < t, cache rows < pos0 + t, the tensor maps' extents being
        // those; writes out rows < t, or words of acts rows < t). The shared memory limit was
        // raised by attn_prefill_scratch, which made `scratch`.
        unsafe { b.launch(cfg) }?;
        out.done(t);
        Ok(())
    }
}

impl CudaContext {
    /// Split-KV form of [`Self::attn_prefill_flash`] with [`AttnTile::Wg64`] (for few tokens
    /// over a long prefix, where one block per tile leaves SMs idle): each tile's key range is
    /// cut into `n_split` parts run as separate blocks (`attn_prefill_flash_wg64_split`, partial
    /// outputs, maxima and sums into `scratch`), then `attn_prefill_combine` merges them,
    /// normalises and applies the gate. Same results as the unsplit kernel up to f32
    /// rounding. Arguments and errors as [`Self::attn_prefill`], plus
    /// [`CudaError::Unsupported`] when `n_split` is 0, above [`MAX_SPLIT`], or `t · n_split`
    /// exceeds [`SPLIT_CAP`].
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill_flash_split(
        &self,
        n_split: usize,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        k_cache: &CudaView<'_, u16>,
        v_cache: &CudaView<'_, u16>,
        scratch: &mut AttnPrefillScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        self.flash_split(n_split, proj, t, pos0, k_cache, v_cache, scratch, FlashOut::F32(out))
    }

    /// [`Self::attn_prefill_flash_split`] writing the `o_proj` GEMM's bf16 activations into
    /// `acts` (as [`Self::attn_prefill_acts`]). For tests.
    ///
    /// # Errors
    /// As [`Self::attn_prefill_flash_split`] and [`Self::attn_prefill_acts`].
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill_flash_split_acts(
        &self,
        n_split: usize,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        k_cache: &CudaView<'_, u16>,
        v_cache: &CudaView<'_, u16>,
        scratch: &mut AttnPrefillScratch,
        acts: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        self.flash_split(n_split, proj, t, pos0, k_cache, v_cache, scratch, FlashOut::Acts(acts))
    }

    /// [`Self::attn_prefill_flash_split`] into `out`'s kind of output.
    #[allow(clippy::too_many_arguments)]
    fn flash_split(
        &self,
        n_split: usize,
        proj: &CudaView<'_, f32>,
        t: usize,
        pos0: usize,
        k_cache: &CudaView<'_, u16>,
        v_cache: &CudaView<'_, u16>,
        scratch: &mut AttnPrefillScratch,
        out: FlashOut<'_, '_>,
    ) -> Result<(), CudaError> {
        let stream = self.stream();
        let op = "attn_prefill_flash_split";
        check_common(op, proj, t, pos0, k_cache.len(), v_cache.len(), scratch)?;
        if n_split == 0 || n_split > MAX_SPLIT || t * n_split > SPLIT_CAP {
            return Err(CudaError::Unsupported(format!(
                "{op}: {n_split} splits of {t} tokens (1 ..= {MAX_SPLIT} splits, t · splits ≤ \
                 {SPLIT_CAP})"
            )));
        }
        check_aligned(
            op,
            &[
                ("proj", proj.device_ptr(stream).0),
                ("k_cache", k_cache.device_ptr(stream).0),
                ("v_cache", v_cache.device_ptr(stream).0),
            ],
        )?;
        let combine = match &out {
            FlashOut::F32(_) => "attn_prefill_combine",
            FlashOut::Acts(_) => "attn_prefill_combine_acts",
        };
        let Some(mut out) = out.prepare(op, t, stream)? else {
            return Ok(());
        };
        let tile = AttnTile::Wg64;
        let n_tiles = t.div_ceil(tile.tokens());
        let cfg = LaunchConfig {
            grid_dim: ((n_tiles * p::N_KV_HEADS * n_split) as u32, 1, 1),
            block_dim: (tile.threads() as u32, 1, 1),
            shared_mem_bytes: tile.smem_bytes() as u32,
        };
        let (t_i, pos0_i, n_split_i) = (t as i32, pos0 as i32, n_split as i32);
        let scale_log2 = std::f32::consts::LOG2_E / (p::HEAD_DIM as f32).sqrt();
        let mut b = self.kernel(self.func(SPLIT_ENTRY)?);
        b.ptr_mut(&mut scratch.part_o)
            .ptr_mut(&mut scratch.part_ml)
            .ptr(&scratch.q)
            .ptr(k_cache)
            .ptr(v_cache)
            .arg(&t_i)
            .arg(&pos0_i)
            .arg(&scale_log2)
            .arg(&n_split_i);
        // SAFETY: argument order and types match the kernel; bounds checked above (partials
        // rows < t · n_split ≤ SPLIT_CAP; reads as attn_prefill_flash). Shared memory limit
        // raised by attn_prefill_scratch.
        unsafe { b.launch(cfg) }?;
        let cfg = LaunchConfig {
            grid_dim: ((t * p::N_Q_HEADS).div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.kernel(self.func(combine)?);
        out.push(&mut b, op, t)?;
        b.ptr(&scratch.part_o)
            .ptr(&scratch.part_ml)
            .ptr(proj)
            .arg(&t_i)
            .arg(&n_split_i);
        // SAFETY: as above; writes out rows (or acts rows) < t, reads proj rows < t.
        unsafe { b.launch(cfg) }?;
        out.done(t);
        Ok(())
    }
}

impl CudaContext {
    /// Self-test hook for the wgmma forms and shared-memory layouts of
    /// `attn_prefill_flash_wg128`, on one warpgroup: `s = q·kᵀ` (`[64, 64]`) and `o = p·v`
    /// (`[64, HEAD_DIM]`), f32 out, from bf16 `q`, `k`, `v` (`[64, HEAD_DIM]`) and `p`
    /// (`[64, 64]`). Synchronous use only (sets a kernel attribute).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] on wrong lengths; [`CudaError::Driver`] on launch failure.
    #[doc(hidden)]
    pub fn attn_prefill_wgmma_probe(
        &self,
        s_out: &mut CudaViewMut<'_, f32>,
        o_out: &mut CudaViewMut<'_, f32>,
        q: &CudaView<'_, u16>,
        k: &CudaView<'_, u16>,
        v: &CudaView<'_, u16>,
        pm: &CudaView<'_, u16>,
    ) -> Result<(), CudaError> {
        let hd = p::HEAD_DIM;
        if s_out.len() != 64 * 64
            || o_out.len() != 64 * hd
            || q.len() != 64 * hd
            || k.len() != 64 * hd
            || v.len() != 64 * hd
            || pm.len() != 64 * 64
        {
            return Err(CudaError::Unsupported(
                "attn_prefill_wgmma_probe: lengths".into(),
            ));
        }
        let smem = 3 * 64 * hd * 2 + 1024;
        let f = self.func("attn_prefill_wgmma_probe")?;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut b = self.kernel(f);
        b.ptr_mut(s_out).ptr_mut(o_out).ptr(q).ptr(k).ptr(v).ptr(pm);
        // SAFETY: argument order and types match the kernel; lengths checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// Where the flash part writes its gated output: f32 rows `[≥ t, ATTN_PREFILL_OUT]`, or the
/// `o_proj` GEMM's bf16 activations in a [`GemmScratch`].
enum FlashOut<'a, 'b> {
    F32(&'a mut CudaViewMut<'b, f32>),
    Acts(&'a mut GemmScratch),
}

/// A [`FlashOut`] checked for `t` tokens, ready to be the kernel's first argument.
enum FlashDst<'a, 'b> {
    F32(&'a mut CudaViewMut<'b, f32>),
    Acts(&'a mut GemmScratch),
}

impl<'a, 'b> FlashOut<'a, 'b> {
    /// Whether the output holds `t` tokens (and f32 rows are 16-byte aligned); queues nothing.
    fn check(&self, op: &str, t: usize, stream: &cudarc::driver::CudaStream) -> Result<(), CudaError> {
        match self {
            FlashOut::F32(out) => {
                if out.len() < t * ATTN_PREFILL_OUT {
                    return Err(CudaError::Unsupported(format!(
                        "{op}: out has {} elements, {t} tokens need {}",
                        out.len(),
                        t * ATTN_PREFILL_OUT
                    )));
                }
                check_aligned(op, &[("out", out.device_ptr(stream).0)])
            }
            FlashOut::Acts(acts) if t > acts.max_t() => Err(CudaError::Unsupported(format!(
                "{op}: t = {t}, the GEMM scratch holds at most {} rows",
                acts.max_t()
            ))),
            FlashOut::Acts(_) => Ok(()),
        }
    }

    /// Checks the output's size and alignment for `t` tokens; `None` when `t = 0` (nothing to
    /// launch; a GEMM scratch then holds nothing).
    fn prepare(self, op: &str, t: usize, stream: &cudarc::driver::CudaStream) -> Result<Option<FlashDst<'a, 'b>>, CudaError> {
        self.check(op, t, stream)?;
        match self {
            FlashOut::F32(out) => Ok((t > 0).then_some(FlashDst::F32(out))),
            FlashOut::Acts(acts) => {
                if t == 0 {
                    acts.clear();
                    return Ok(None);
                }
                acts.fill(op, t, ATTN_PREFILL_OUT)?;
                Ok(Some(FlashDst::Acts(acts)))
            }
        }
    }
}

impl FlashDst<'_, '_> {
    /// Passes the output as the kernel's next (first) argument.
    fn push(&mut self, b: &mut crate::launch::Launch<'_>, op: &str, t: usize) -> Result<(), CudaError> {
        match self {
            FlashDst::F32(out) => {
                b.ptr_mut(&mut **out);
            }
            FlashDst::Acts(acts) => {
                b.ptr_mut(acts.fill(op, t, ATTN_PREFILL_OUT)?);
            }
        }
        Ok(())
    }

    /// The launch is queued: a GEMM scratch holds `[t, ATTN_PREFILL_OUT]` activations now.
    fn done(self, t: usize) {
        if let FlashDst::Acts(acts) = self {
            acts.filled(t, ATTN_PREFILL_OUT);
        }
    }
}

/// Checks shared by both launches: token count against the scratch, `pos0 + t` against the
/// caches, `proj` long enough, the caches whole positions of equal size, and `i32` ranges.
fn check_common(
    op: &str,
    proj: &CudaView<'_, f32>,
    t: usize,
    pos0: usize,
    k_len: usize,
    v_len: usize,
    scratch: &AttnPrefillScratch,
) -> Result<(), CudaError> {
    let err = |m: String| Err(CudaError::Unsupported(format!("{op}: {m}")));
    if k_len != v_len || !k_len.is_multiple_of(KV_ROW) {
        return err(format!(
            "k_cache ({k_len}) and v_cache ({v_len}) must be equal multiples of {KV_ROW} \
             ([max_ctx, N_KV_HEADS, HEAD_DIM])"
        ));
    }
    let max_ctx = k_len / KV_ROW;
    if pos0 + t > max_ctx {
        return err(format!(
            "positions {pos0}..{} exceed the KV cache of {max_ctx} positions",
            pos0 + t
        ));
    }
    if max_ctx > i32::MAX as usize {
        return err(format!("KV cache of {max_ctx} positions exceeds i32"));
    }
    if t > scratch.max_t {
        return err(format!(
            "{t} tokens exceed the scratch (max_t {})",
            scratch.max_t
        ));
    }
    if proj.len() < t * ATTN_PREFILL_PROJ {
        return err(format!(
            "proj has {} elements, {t} tokens need {}",
            proj.len(),
            t * ATTN_PREFILL_PROJ
        ));
    }
    Ok(())
}

fn check_aligned(op: &str, ptrs: &[(&str, u64)]) -> Result<(), CudaError> {
    for (name, ptr) in ptrs {
        if ptr % 16 != 0 {
            return Err(CudaError::Unsupported(format!(
                "{op}: {name} at {ptr:#x} is not 16-byte aligned (vector access)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_table() {
        let plan = |t, pos0| {
            let a = attn_prefill_plan(t, pos0, 132);
            (a.tile, a.n_split)
        };
        // long blocks: the two-warpgroup tile, no split
        assert_eq!(plan(8192, 0), (AttnTile::Wg128, 1));
        assert_eq!(plan(2048, 6144), (AttnTile::Wg128, 1));
        assert_eq!(plan(2048, 0), (AttnTile::Wg128, 1));
        assert_eq!(plan(1024, 8192), (AttnTile::Wg128, 1));
        // a causal triangle from (near) position 0: the heaviest tiles' keys cut in two
        assert_eq!(plan(1024, 0), (AttnTile::Wg64, 2));
        assert_eq!(plan(1536, 0), (AttnTile::Wg64, 2));
        assert_eq!(plan(1000, 0), (AttnTile::Wg64, 2));
        assert_eq!(plan(768, 100), (AttnTile::Wg64, 2));
        // enough Wg64 blocks to fill the SMs and balanced tiles, or too few keys to split
        assert_eq!(plan(1000, 4000), (AttnTile::Wg64, 1));
        assert_eq!(plan(300, 0), (AttnTile::Wg64, 1));
        assert_eq!(plan(1, 0), (AttnTile::Wg64, 1));
        // few tokens over a long prefix: split the keys
        assert_eq!(plan(512, 7680), (AttnTile::Wg64, 2));
        assert_eq!(plan(64, 8128), (AttnTile::Wg64, 16));
        assert_eq!(plan(100, 1000), (AttnTile::Wg64, 4));
        assert_eq!(plan(1, 100_000), (AttnTile::Wg64, MAX_SPLIT));
        // without the causal split: the earlier rules
        let old = |t, pos0| {
            let a = attn_prefill_plan_with(t, pos0, 132, false);
            (a.tile, a.n_split)
        };
        assert_eq!(old(1024, 0), (AttnTile::Wg128, 1));
        assert_eq!(old(1000, 0), (AttnTile::Wg64, 1));
        assert_eq!(old(512, 7680), (AttnTile::Wg64, 2));
        for t in [1, 7, 8, 9, 100, 500, 1023, 1024, 1500, 2047, 2048, 8192] {
            for pos0 in [0, 1, 1000, 30_000, 200_000] {
                for split in [false, true] {
                    let a = attn_prefill_plan_with(t, pos0, 132, split);
                    assert!(a.n_split >= 1 && a.n_split <= MAX_SPLIT);
                    assert!(a.n_split == 1 || t * a.n_split <= SPLIT_CAP);
                    assert!(a.n_split == 1 || a.tile == AttnTile::Wg64);
                }
            }
        }
        // the heaviest tile and the triangle's sum (two KV heads): 1,024 tokens from 0 are
        // 128 tiles per head walking 1, 1, ... 16 key blocks (8 tiles each)
        assert_eq!(wg64_key_blocks(1024, 0), (16, 2 * 8 * (1..=16).sum::<usize>()));
        assert_eq!(wg64_key_blocks(5, 62), (2, 2 * 2));
    }
}
