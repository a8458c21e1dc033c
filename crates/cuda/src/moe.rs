//! The sparse MoE block's decode step (batch 1) on the GPU: MODEL.md §3.7, the CPU definition
//! being `model::Model::moe` with [`model::top_k_renorm`] and [`model::expert_forward`].
//!
//! * [`CudaContext::upload_moe`] restacks one layer's MLX-quantized MoE weights into the tile
//!   layout of `kernels/moe.cu` ([`DeviceMoe`]);
//! * [`CudaContext::moe_decode_step`] runs router + softmax + top-k, the chosen experts' and the
//!   shared expert's SwiGLU, and the weighted combine with the residual: three launches, fixed
//!   grids, chosen expert ids read on the device, so it can be captured in a CUDA graph (with
//!   programmatic edges too: every kernel calls `calla_pdl_wait` before reading what an
//!   earlier kernel wrote, except the down kernel's read of the ids, which is safe by the order
//!   explained in `kernels/moe.cu`).
//! * `MoeFlags` / `moe_decode_part` (doc-hidden): the measured variants (where the top-k runs,
//!   an L2 prefetch of the down weights), for the self-test.
//!
//! Design and measurements: `docs/CUDA.md`, section "MoE decode".

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;
use quant::{Bits, QMatRef};
use rayon::prelude::*;
use spec::production as p;

use crate::{CudaContext, CudaError, QUANT_GROUP};

/// Rows of one tile (the `m16n8k32` mma's M).
pub(crate) const TILE_ROWS: usize = 16;
/// Router-kernel warps per block (`R_WARPS` in `moe.cu`).
const ROUTER_WARPS: usize = 8;
/// Warps per gate/up block splitting K (`GU_KS` in `moe.cu`).
const GU_KS: usize = 4;
/// Warps per slot in a down block splitting K (`DN_KS` in `moe.cu`).
const DN_KS: usize = 2;
/// Warps per block of the fused kernel (`FU_WARPS` in `moe.cu`).
const FU_WARPS: usize = 20;
/// Down tiles per warp (`DN_GPW` in `moe.cu`): `D_EXPERT / 64 / DN_KS`.
const DN_GPW: usize = p::D_EXPERT / QUANT_GROUP / DN_KS;
/// f64 between two of the router fold's accumulators (`RF_STRIDE` in `kernels/gemv.cu` and
/// `kernels/moe.cu`): one 128-byte L2 line each.
const RF_STRIDE: usize = 16;
/// Tiles of 16 rows one block of the router-fold output projection may own (`RF_CAP`,
/// `kernels/gemv.cu`).
const RF_CAP: usize = 16;
/// f64 of one set of the router fold's accumulators: `N_EXPERTS` logit sums, the shared gate's,
/// Σ h², each [`RF_STRIDE`] apart; then, at [`RF_ACC_H`], `D_MODEL` sums of `h − x` (the split
/// output projection's, [`CudaContext::gdn_step_out`]).
const RF_SET: usize = RF_ACC_H + p::D_MODEL;
/// Offset of `h − x` in a set (`RF_ACC_H` in `kernels/moe.cu`, `OUT_ACC_H` in `kernels/gdn.cu`).
const RF_ACC_H: usize = (p::N_EXPERTS + 2) * RF_STRIDE;
/// Sets of router-fold accumulators in a [`MoeScratch`]: consecutive layers use different sets
/// (a layer's down launch zeroes the next layer's set while its own is still being read), and a
/// step's last layer one different from its first; three cover any number of layers
/// ([`fold_set`]).
pub const FOLD_SETS: usize = 3;

/// The accumulator set layer `layer` of `n_layers` uses in the decode step: alternating 0, 1,
/// and 2 for the last layer of an odd count, so that no two consecutive layers (the last and
/// the first of the next step included) share one.
pub fn fold_set(layer: usize, n_layers: usize) -> usize {
    if n_layers % 2 == 1 && layer + 1 == n_layers {
        2
    } else {
        layer % 2
    }
}

/// Dynamic shared memory of `moe_fused_*` at `bits` expert bits: each down warp's staged
/// tiles (`fu_stage_bytes` in `moe.cu`: per tile `bits · 128` code bytes and 8 `{scale|bias}`
/// pairs).
fn fused_smem_bytes(bits: u32) -> usize {
    DN_KS * (p::TOP_K + 1) * DN_GPW * (bits as usize * 128 + 64)
}

/// Blocks per cluster of the expert-per-cluster kernel (`CL` in `moe.cu`).
const CL: usize = 8;
/// Words per block of the expert-per-cluster kernel's phase probe (`CL_MARKS` in `moe.cu`).
#[doc(hidden)]
pub const CL_MARKS: usize = 11;
/// `flags` bit of `moe_cluster_fold_e4`: block 0 also zeroes `h − x` of the next layer's set
/// (`CL_ZERO_ACC_H` in `moe.cu`), for a step whose GDN layers run the split output projection.
const CL_ZERO_ACC_H: i32 = 8;
/// `flags` bit of the expert-per-cluster kernels: with the fold, trigger the next launch once the
/// block's expert tiles are here (`CL_LATE_TRIGGER` in `moe.cu`; `CudaContext::set_moe_cluster_late_trigger`).
const CL_LATE_TRIGGER: i32 = 1;
/// `flags` bit of the expert-per-cluster kernels: the timeline probe's mark when the copies are
/// issued instead of when the tiles are all here (`CL_MARK_ISSUE` in `moe.cu`;
/// `CudaContext::set_moe_cluster_mark_issue`).
const CL_MARK_ISSUE: i32 = 2;
/// `flags` bit of the expert-per-cluster kernel after the fold: stream fixed experts' tiles
/// whatever the top-k chose, for measurement (`CL_PIN_EXPERTS` in `moe.cu`;
/// `CudaContext::set_moe_cluster_pin_experts`).
const CL_PIN_EXPERTS: i32 = 4;
/// `flags` bit of `moe_cluster_fold_e4`: combine by f64 atomics into the next set's `h` sums
/// and zero this set's (`CL_HSUM` in `moe.cu`; `CudaContext::set_moe_hsum`).
const CL_HSUM: i32 = 64;
/// The routed experts' bulk copies carry an L2 evict_first policy (`CL_EVICT_FIRST` in
/// `moe.cu`; [`MoeScratch::evict_first`]).
const CL_EVICT_FIRST: i32 = 128;
/// Whether a new context's decode step combines the MoE by f64 atomics
/// (`CudaContext::set_moe_hsum`) unless [`set_default_moe_hsum`] said otherwise.
pub const MOE_HSUM_DEFAULT: bool = true;

static DEFAULT_MOE_HSUM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(MOE_HSUM_DEFAULT);

/// The MoE combine every [`CudaContext`] created afterwards starts with
/// ([`CudaContext::set_moe_hsum`]). Process-wide, so that the engine's accelerator and a tool's
/// own context agree (`calla cuda-check --moe-hsum`).
pub fn set_default_moe_hsum(on: bool) {
    DEFAULT_MOE_HSUM.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a new [`CudaContext`] combines the decode step's MoE by f64 atomics
/// ([`set_default_moe_hsum`]; [`MOE_HSUM_DEFAULT`] unless set).
pub fn default_moe_hsum() -> bool {
    DEFAULT_MOE_HSUM.load(std::sync::atomic::Ordering::Relaxed)
}
/// Blocks of the expert-per-cluster kernel.
#[doc(hidden)]
pub const CL_BLOCKS: usize = (p::TOP_K + 1) * CL;
/// Warps per block of the expert-per-cluster kernel (`CL_WARPS` in `moe.cu`).
const CL_WARPS: usize = 16;

/// Dynamic shared memory of `moe_cluster_e4` at `bits` expert bits (`ClSmem` in `moe.cu`): the
/// block's gate/up tiles (`D_EXPERT·2 / 16 / CL` row tiles × `D_MODEL / 64` groups) and down
/// tiles (`D_MODEL / 16 / CL` × `D_EXPERT / 64`), each `bits · 128` code bytes and 8
/// `{scale|bias}` pairs.
fn cluster_smem_bytes(bits: u32) -> usize {
    let tiles = 2 * p::D_EXPERT / TILE_ROWS / CL * (p::D_MODEL / QUANT_GROUP) + p::D_MODEL / TILE_ROWS / CL * (p::D_EXPERT / QUANT_GROUP);
    tiles * (bits as usize * 128 + 64)
}

/// Launch shape of `moe_cluster_e4` / `moe_cluster_fold_e4` / `moe_cluster_split_e4`: `TOP_K + 1` clusters of [`CL`]
/// blocks (the cluster shape is the kernels' `__cluster_dims__`).
fn cluster_cfg() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (((p::TOP_K + 1) * CL) as u32, 1, 1),
        block_dim: ((CL_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: cluster_smem_bytes(4) as u32,
    }
}

/// The residual-stream buffers the fold cluster kernels take first: `out` then `h`
/// (`moe_cluster_fold_e4`), or `x`, read and written in place (`moe_cluster_split_e4`).
enum ClusterStream<'v, 'a, 'b> {
    OutH(&'v mut CudaViewMut<'a, f32>, &'v CudaView<'b, f32>),
    InPlace(&'v mut CudaViewMut<'a, f32>),
}

/// The expert weights of `moe_cluster_e4` / `moe_cluster_fold_e4` / `moe_cluster_split_e4`, in their parameter order:
/// routed gate/up tiles and pairs, the shared expert's, routed down, shared down.
fn cluster_tile_args<'a>(b: &mut cudarc::driver::LaunchArgs<'a>, m: &'a DeviceMoe) {
    b.arg(&m.gu_codes)
        .arg(&m.gu_sb)
        .arg(&m.sh_gu_codes)
        .arg(&m.sh_gu_sb)
        .arg(&m.down_codes)
        .arg(&m.down_sb)
        .arg(&m.sh_down_codes)
        .arg(&m.sh_down_sb);
}

/// Blocks of the fused kernel: enough for one round of every phase (a down row tile per
/// block, FU_WARPS / GU_KS gate/up units per block, a router row per warp), at most one per SM.
fn fused_grid(sm_count: u32) -> u32 {
    let down_tiles = p::D_MODEL / TILE_ROWS;
    let gu_units = (p::TOP_K + 1) * 2 * p::D_EXPERT / TILE_ROWS;
    let need = down_tiles.max(gu_units.div_ceil(FU_WARPS / GU_KS));
    need.min(sm_count as usize) as u32
}

/// Variants of the decode step's launches, for measurement; [`CudaContext::moe_decode_step`]
/// uses [`MoeFlags::DEFAULT`].
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeFlags {
    /// The router kernel's last block (atomic counter) does softmax + top-k; else every
    /// gate/up block does it from the logits (and block 0 stores `sel_ids`/`sel_w`).
    pub topk_in_router: bool,
    /// Gate/up blocks prefetch the down kernel's tiles of their expert into L2.
    pub prefetch_down: bool,
    /// The down kernel from its 48-register entry point (`moe_down_r48_*`: same results, fits
    /// beside three gate/up blocks on an SM, but spills at 8 bits (up to 216 B per thread) and
    /// measured slower in the decode step: off).
    pub down_reg_cap: bool,
    /// Router, top-k, gate/up and down in one launch (`moe_fused_*`: one block per SM, phases
    /// separated by grid-wide barriers, every block doing the top-k itself; same results bit
    /// for bit). Used when the layer's router and shared gate share one width and all expert
    /// matrices another, and the blocks fit on the GPU at once ([`CudaContext::moe_fused_ready`]);
    /// otherwise the three kernels run. Part 0 of [`CudaContext::moe_decode_part`] is then the
    /// whole step and parts 1 and 2 launch nothing; `topk_in_router`, `prefetch_down` and
    /// `down_reg_cap` do not apply.
    pub fused: bool,
    /// With `fused`: the router kernel (`moe_router_*`, top-k in its last block) still runs
    /// first, as part 0, and the fused kernel does gate/up and down only (part 1; one barrier),
    /// reading the router's ids, weights and u digits.
    pub fused_keep_router: bool,
    /// After the router kernel (top-k in its last block), gate/up, down and the combine in one
    /// launch of one thread-block cluster of 8 blocks per expert (`moe_cluster_e4`: the gate/up
    /// outputs move to the expert's down blocks through distributed shared memory, no grid
    /// barrier; the last block of each 256-row slice adds the experts up; the same bits as the
    /// three kernels). Used when every expert matrix (routed and shared) is 4-bit
    /// ([`CudaContext::moe_cluster_ready`]), else the three kernels run. Part 1 of
    /// [`CudaContext::moe_decode_part`] is then the cluster kernel and part 2 launches nothing;
    /// `topk_in_router` is taken as set, `prefetch_down` and `down_reg_cap` do not apply.
    /// Ignored with `fused`.
    pub cluster: bool,
}

impl MoeFlags {
    /// What `moe_decode_step` runs: the fastest on the H200 with PDL edges (docs/CUDA.md).
    pub const DEFAULT: MoeFlags =
        MoeFlags { topk_in_router: true, prefetch_down: false, down_reg_cap: false, fused: false, fused_keep_router: false, cluster: false };

    fn bits(self) -> i32 {
        i32::from(self.topk_in_router) | (i32::from(self.prefetch_down) << 1)
    }
}

/// One expert's three projections as quantized views: `gate`, `up` `[d_ff, D_MODEL]`, `down`
/// `[D_MODEL, d_ff]`.
#[derive(Clone, Copy, Debug)]
pub struct ExpertRefs<'a> {
    /// `[d_ff, D_MODEL]`.
    pub gate: QMatRef<'a>,
    /// `[d_ff, D_MODEL]`.
    pub up: QMatRef<'a>,
    /// `[D_MODEL, d_ff]`.
    pub down: QMatRef<'a>,
}

/// One layer's MoE weights as quantized views: what [`CudaContext::upload_moe`] takes from
/// `model::load::MoeWeights`, or a test builds from its own buffers.
#[derive(Clone, Debug)]
pub struct MoeRefs<'a> {
    /// `[N_EXPERTS, D_MODEL]`.
    pub router: QMatRef<'a>,
    /// `N_EXPERTS` routed experts, by id, `d_ff = D_EXPERT`.
    pub experts: Vec<ExpertRefs<'a>>,
    /// The shared expert, `d_ff = D_SHARED_EXPERT`.
    pub shared: ExpertRefs<'a>,
    /// `[1, D_MODEL]`: the shared expert's sigmoid gate.
    pub shared_gate: QMatRef<'a>,
}

/// One layer's MoE weights on the device, restacked for `kernels/moe.cu`.
///
/// * router and shared-expert gate: MLX layout (packed `u32` rows), scale and bias of each group
///   in one `u32` (`scale | bias << 16`, bf16 bits);
/// * experts: tiles of 16 rows × one 64-column group, each lane's A fragments of the
///   `mma.m16n8k32` contiguous (see `pack_tile`); gate/up tiles hold 8 gate rows then the 8 up
///   rows of the same outputs. Per group-tile the `{scale|bias}` words of rows `g, g+8`
///   side by side (`[8][2]` u32).
///
/// Bytes stored equal the MLX checkpoint's (codes, scales, biases). `Clone` copies on the device.
#[derive(Clone)]
pub struct DeviceMoe {
    router_bits: Bits,
    shared_gate_bits: Bits,
    gate_up_bits: Bits,
    down_bits: Bits,
    shared_gate_up_bits: Bits,
    shared_down_bits: Bits,
    router_packed: CudaSlice<u32>,
    router_sb: CudaSlice<u32>,
    sgate_packed: CudaSlice<u32>,
    sgate_sb: CudaSlice<u32>,
    gu_codes: CudaSlice<u32>,
    gu_sb: CudaSlice<u32>,
    down_codes: CudaSlice<u32>,
    down_sb: CudaSlice<u32>,
    sh_gu_codes: CudaSlice<u32>,
    sh_gu_sb: CudaSlice<u32>,
    sh_down_codes: CudaSlice<u32>,
    sh_down_sb: CudaSlice<u32>,
}

/// The router and the shared-expert gate of a [`DeviceMoe`] in the MLX layout, for the kernels
/// that fold the router into a projection (`gdn_step_out_*`).
pub(crate) struct RouterRefs<'a> {
    pub router_bits: Bits,
    pub gate_bits: Bits,
    pub router_packed: &'a CudaSlice<u32>,
    pub router_sb: &'a CudaSlice<u32>,
    pub gate_packed: &'a CudaSlice<u32>,
    pub gate_sb: &'a CudaSlice<u32>,
}

impl DeviceMoe {
    pub(crate) fn router_refs(&self) -> RouterRefs<'_> {
        RouterRefs {
            router_bits: self.router_bits,
            gate_bits: self.shared_gate_bits,
            router_packed: &self.router_packed,
            router_sb: &self.router_sb,
            gate_packed: &self.sgate_packed,
            gate_sb: &self.sgate_sb,
        }
    }

    /// The shared expert's restacked tiles as device regions `(address, bytes)`: gate/up codes
    /// and scales, down codes and scales (what the cluster kernels copy before their PDL
    /// wait), for the L2 follower ([`crate::follow`]).
    pub(crate) fn shared_expert_regions(&self, cx: &CudaContext) -> [(u64, usize); 4] {
        let st = cx.stream();
        let r = |s: &CudaSlice<u32>| (s.device_ptr(st).0, s.len() * 4);
        [r(&self.sh_gu_codes), r(&self.sh_gu_sb), r(&self.sh_down_codes), r(&self.sh_down_sb)]
    }
}

impl MoeScratch {
    /// Accumulator set `set` of the router fold ([`RF_SET`] f64), for a kernel that adds into it.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `set` ≥ [`FOLD_SETS`].
    pub(crate) fn fold_set_mut(&mut self, set: usize) -> Result<CudaViewMut<'_, f64>, CudaError> {
        check_set(set)?;
        Ok(self.racc.slice_mut(set * RF_SET..(set + 1) * RF_SET))
    }

    /// The `h` sums of accumulator set `set` (`D_MODEL` f64 after the router sums): with
    /// `CudaContext::set_moe_hsum`, the residual stream the MoE of the layer before the one
    /// that reads `set` left, for [`CudaContext::gemv_norm_xd`].
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `set` ≥ [`FOLD_SETS`].
    pub fn hsum(&self, set: usize) -> Result<CudaView<'_, f64>, CudaError> {
        check_set(set)?;
        Ok(self.racc.slice(set * RF_SET + RF_ACC_H..(set + 1) * RF_SET))
    }

    /// The expert-per-cluster kernel's unweighted expert outputs of its last counted combine
    /// (`[TOP_K + 1][D_MODEL]` f32, slot order, the shared expert last), for checks.
    #[doc(hidden)]
    pub fn cluster_parts(&self) -> CudaView<'_, f32> {
        self.part.slice(..)
    }

    /// The fused kernel's grid-barrier state (arrivals, generation), for checks.
    #[doc(hidden)]
    pub fn bar_state(&self) -> CudaView<'_, u32> {
        self.bar.slice(..)
    }

    /// The router fold's accumulators ([`FOLD_SETS`] sets of `(N_EXPERTS + 2)·16` f64, every
    /// 16th used, then `D_MODEL` f64 of `h − x`), for checks.
    #[doc(hidden)]
    pub fn fold_accumulators(&self) -> CudaView<'_, f64> {
        self.racc.slice(..)
    }
}

impl DeviceMoe {
    /// Bytes one decode step reads from the weights: router, shared-expert gate, `TOP_K`
    /// routed experts (gate, up, down: codes, scales, biases) and the shared expert.
    pub fn bytes_per_step(&self) -> usize {
        self.router_bytes() + self.expert_bytes_per_step()
    }

    /// Bytes of the expert part of [`Self::bytes_per_step`]: `TOP_K` routed experts and the
    /// shared expert.
    pub fn expert_bytes_per_step(&self) -> usize {
        let per_expert = (self.gu_codes.len() + self.gu_sb.len() + self.down_codes.len() + self.down_sb.len())
            * 4
            / p::N_EXPERTS;
        let shared = (self.sh_gu_codes.len() + self.sh_gu_sb.len() + self.sh_down_codes.len() + self.sh_down_sb.len()) * 4;
        p::TOP_K * per_expert + shared
    }

    /// Bytes of the router and the shared-expert gate.
    pub fn router_bytes(&self) -> usize {
        (self.router_packed.len() + self.router_sb.len() + self.sgate_packed.len() + self.sgate_sb.len()) * 4
    }

    /// Bits of (router, shared-expert gate, routed gate/up, routed down, shared gate/up,
    /// shared down).
    pub fn bits(&self) -> [u32; 6] {
        [
            self.router_bits,
            self.shared_gate_bits,
            self.gate_up_bits,
            self.down_bits,
            self.shared_gate_up_bits,
            self.shared_down_bits,
        ]
        .map(|b| b.bits())
    }
}

/// Per-step buffers of [`CudaContext::moe_decode_step`]. One per stream; layers may share it
/// (the step leaves nothing in it that the next step needs).
pub struct MoeScratch {
    /// `[TOP_K]` chosen expert ids, descending routing weight (ties: lower id first), as
    /// `model::top_k_renorm` orders them. For expert-load telemetry.
    pub sel_ids: CudaSlice<i32>,
    /// `[TOP_K + 1]`: the renormalised routing weights of `sel_ids`, then
    /// `sigmoid(shared_gate · u)`.
    pub sel_w: CudaSlice<f32>,
    /// `[N_EXPERTS + 1]`: router logits, then the shared-expert gate's logit.
    pub logits: CudaSlice<f32>,
    /// u as integer digits (B fragments), `D_MODEL / 64` groups × 64 words.
    uq: CudaSlice<u32>,
    /// Per group of u: `{2^(E-30), Σ u}` (f32 pairs).
    umeta: CudaSlice<f32>,
    /// `[TOP_K + 1, D_EXPERT]`: `silu(gate·u) * (up·u)` of each slot (shared expert last).
    act: CudaSlice<f32>,
    /// Finished-block counter of the router kernel (zero between launches).
    counter: CudaSlice<u32>,
    /// Grid barrier of the fused kernel: arrivals (zero between barriers), generation.
    bar: CudaSlice<u32>,
    /// The router fold's accumulators (see [`CudaContext::gemv_residual_router`]): [`FOLD_SETS`]
    /// sets of `N_EXPERTS + 2` f64 (logit sums, shared-gate sum, Σ h²), [`RF_STRIDE`] apart,
    /// then `D_MODEL` f64 of `h − x` at [`RF_ACC_H`] ([`CudaContext::gdn_step_out`]).
    racc: CudaSlice<f64>,
    /// `[TOP_K + 1, D_MODEL]`: each slot's down projection (not yet weighted), from the
    /// expert-per-cluster kernel ([`MoeFlags::cluster`]) to the block that combines a slice.
    part: CudaSlice<f32>,
    /// [`CudaContext::moe_fold_cluster`] also zeroes `h − x` of the set it zeroes (for a step
    /// whose GDN layers run [`CudaContext::gdn_step_out`], which adds into it; the decode step
    /// sets it). Off in a new scratch.
    pub zero_acc_h: bool,
    /// [`CudaContext::moe_fold_cluster`] combines by f64 atomics into the `h` sums of the set
    /// it zeroes and zeroes those of the set it reads ([`MoeScratch::hsum`]), instead of
    /// writing `out`. The decode step sets it when [`CudaContext::moe_hsum`] is on and its
    /// configuration reads the sums (not with [`Self::zero_acc_h`]). Off in a new scratch.
    pub hsum_combine: bool,
    /// The cluster kernels' routed-expert copies carry an L2 evict_first policy (hints only:
    /// the same results), so that the experts, read once per token, do not evict what the L2
    /// follower asked L2 to hold ([`crate::follow`]). Set by the decode step from the
    /// follower's plan; off in a new scratch.
    pub evict_first: bool,
    /// Finished-block counters of the expert-per-cluster kernel, one per 256-row slice (zero
    /// between launches).
    cl_counts: CudaSlice<u32>,
    /// Whether the expert-per-cluster kernels can run here: their shared memory could be
    /// granted and a block fits on an SM (else [`MoeFlags::cluster`] falls back to the three
    /// kernels, never an error of the default path).
    cluster_ok: bool,
    /// Blocks of the fused kernel per expert width (index 0: 4 bits, 1: 8 bits); 0 where its
    /// blocks cannot all be resident at once (it then never launches).
    fused_grid: [u32; 2],
    /// L2 prefetch hints passed with the next router launch, or the next cluster launch after
    /// the fold (issued once its blocks' own copies are), each block taking its share (the
    /// decode step sets the next layer's input projection and GDN state here with
    /// `CudaSession::set_l2_prefetch`, or the input projection's late-landing rows with
    /// `CudaSession::set_moe_l2_late`); empty by default.
    pub l2_prefetch: crate::L2Prefetch,
    /// Device address of an `[N_EXPERTS]` i32 row the down launch (or the cluster kernel) adds
    /// one to for each chosen expert (expert-load telemetry: the decode step points it at its session's row of the
    /// layer); 0, the default: none. Not counted by the fused kernel ([`MoeFlags::fused`]).
    /// Must stay valid while launches that read it can run.
    pub hist_row: u64,
    /// Measurement: device address of `[(TOP_K + 1) · 8 blocks, CL_MARKS]` u64 the
    /// expert-per-cluster kernel fills with its phase times (block start and PDL release in
    /// `%globaltimer` ns, then clock64 cycles since the release: copies issued, gate/up row
    /// tiles of rounds 0 and 1 arrived, gate/up done, down tiles arrived, activations
    /// exchanged, y written, counted, combined); 0: none.
    #[doc(hidden)]
    pub cl_probe: u64,
}

fn unsupported(msg: String) -> CudaError {
    CudaError::Unsupported(msg)
}

fn check_shape(m: &QMatRef<'_>, what: &str, rows: usize, cols: usize) -> Result<(), CudaError> {
    quant::validate(m).map_err(|e| unsupported(format!("MoE {what}: {e}")))?;
    if m.rows != rows || m.cols != cols {
        return Err(unsupported(format!(
            "MoE {what} is [{}, {}]; the CUDA MoE kernels are built for [{rows}, {cols}]",
            m.rows, m.cols
        )));
    }
    if m.spec.group_size != QUANT_GROUP {
        return Err(unsupported(format!(
            "MoE {what}: group size {} (kernels are built for {QUANT_GROUP})",
            m.spec.group_size
        )));
    }
    Ok(())
}

fn sb_word(s: bf16, b: bf16) -> u32 {
    u32::from(s.to_bits()) | (u32::from(b.to_bits()) << 16)
}

/// `a` (four 4-bit codes in 16 bits) -> the codes in the low nibbles of four bytes.
fn spread4(a: u32) -> u32 {
    let x = (a | (a << 8)) & 0x00FF_00FF;
    (x | (x << 4)) & 0x0F0F_0F0F
}

/// u32 words of one 16 × 64 tile.
pub(crate) fn tile_words(bits: Bits) -> usize {
    TILE_ROWS * QUANT_GROUP * bits.bits() as usize / 32
}

/// Packs one 16-row tile row (all its groups): `rows[ρ]` = (matrix, row) of tile row ρ, all
/// with the same columns and bits. `codes`: `[groups][tile_words]`, `sb`: `[groups][8][2]`.
///
/// Lane `l = 4g + t` of the kernel's warp loads words `[l*4, l*4+4)` of each 512-byte chunk `c`
/// (one chunk at 4 bits, two at 8) and uses them as the A fragments of the two k32 mmas of the
/// group (`a[m]`, mma `h = m / 4`, register `i = m % 4`: row `g + 8(i&1)`, columns
/// `32h + 16(i>>1) + 4t + b` in byte `b`):
/// * 4 bits: word `j` = rows `g` (low nibbles) and `g+8` (high nibbles) at columns
///   `16j + 4t .. +3` of the group, one code per byte; the kernel splits it into `a[2j]`
///   (`& 0x0F0F0F0F`) and `a[2j+1]` (`>> 4 & 0x0F0F0F0F`);
/// * 8 bits: chunk `c` word `j` is `a[4c + j]` as stored.
pub(crate) fn pack_tile(rows: &[(QMatRef<'_>, usize); TILE_ROWS], codes: &mut [u32], sb: &mut [u32]) {
    let m0 = rows[0].0;
    let bits = m0.spec.bits;
    let groups = m0.cols / QUANT_GROUP;
    let wpr = m0.spec.words_per_row(m0.cols);
    let tw = tile_words(bits);
    let rw: [&[u32]; TILE_ROWS] = std::array::from_fn(|i| {
        let (m, r) = rows[i];
        &m.packed[r * wpr..(r + 1) * wpr]
    });
    for gi in 0..groups {
        let out = &mut codes[gi * tw..(gi + 1) * tw];
        let c0 = gi * QUANT_GROUP;
        match bits {
            Bits::B4 => {
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    for j in 0..4 {
                        let col = c0 + 16 * j + 4 * t;
                        let (w, sh) = (col / 8, 4 * (col % 8));
                        let a = (rw[g][w] >> sh) & 0xFFFF;
                        let b = (rw[g + 8][w] >> sh) & 0xFFFF;
                        out[lane * 4 + j] = spread4(a) | (spread4(b) << 4);
                    }
                }
            }
            Bits::B8 => {
                for c in 0..2 {
                    for lane in 0..32 {
                        let (g, t) = (lane / 4, lane % 4);
                        for j in 0..4 {
                            let row = g + 8 * (j & 1);
                            let col = c0 + 32 * c + 16 * (j >> 1) + 4 * t;
                            out[(c * 32 + lane) * 4 + j] = rw[row][col / 4];
                        }
                    }
                }
            }
        }
        for g in 0..8 {
            for (k, rho) in [g, g + 8].into_iter().enumerate() {
                let (m, r) = rows[rho];
                let i = r * groups + gi;
                sb[gi * 16 + 2 * g + k] = sb_word(m.scales[i], m.biases[i]);
            }
        }
    }
}

/// Restacks experts (all with the same shape and bits) into tiles. `gate_up`: tile `rt` holds
/// gate rows `8rt..8rt+8` then up rows `8rt..8rt+8`; else `down` rows `16rt..16rt+16`.
fn pack_experts(experts: &[ExpertRefs<'_>], gate_up: bool) -> (Vec<u32>, Vec<u32>) {
    let m0 = if gate_up { experts[0].gate } else { experts[0].down };
    let (rows, cols) = if gate_up { (2 * m0.rows, m0.cols) } else { (m0.rows, m0.cols) };
    let n_rt = rows / TILE_ROWS;
    let groups = cols / QUANT_GROUP;
    let tw = tile_words(m0.spec.bits);
    let mut codes = vec![0u32; experts.len() * n_rt * groups * tw];
    let mut sb = vec![0u32; experts.len() * n_rt * groups * 16];
    codes
        .par_chunks_mut(groups * tw)
        .zip(sb.par_chunks_mut(groups * 16))
        .enumerate()
        .for_each(|(i, (c, s))| {
            let (e, rt) = (i / n_rt, i % n_rt);
            let x = &experts[e];
            let rows: [(QMatRef<'_>, usize); TILE_ROWS] = std::array::from_fn(|rho| {
                if gate_up {
                    if rho < 8 {
                        (x.gate, 8 * rt + rho)
                    } else {
                        (x.up, 8 * rt + rho - 8)
                    }
                } else {
                    (x.down, TILE_ROWS * rt + rho)
                }
            });
            pack_tile(&rows, c, s);
        });
    (codes, sb)
}

/// Router-style matrix: packed words as stored, `{scale|bias}` words `[rows][groups]`.
fn pack_rows(m: &QMatRef<'_>) -> (Vec<u32>, Vec<u32>) {
    let sb = m.scales.iter().zip(m.biases).map(|(s, b)| sb_word(*s, *b)).collect();
    (m.packed.to_vec(), sb)
}

fn same_bits(parts: &[QMatRef<'_>], what: &str) -> Result<Bits, CudaError> {
    let b = parts[0].spec.bits;
    if let Some(i) = parts.iter().position(|m| m.spec.bits != b) {
        return Err(unsupported(format!(
            "MoE {what}: part {i} has {} bits, part 0 has {} (one kernel per layer needs one width)",
            parts[i].spec.bits.bits(),
            b.bits()
        )));
    }
    Ok(b)
}

fn bits_index(b: Bits) -> u32 {
    b.bits()
}

impl CudaContext {
    /// Copies one layer's MoE weights (as loaded by the model crate) to the device, restacked
    /// for the decode kernels.
    ///
    /// `w`: router `[N_EXPERTS, D_MODEL]`, `experts[e].{gate, up}` `[D_EXPERT, D_MODEL]`,
    /// `.down` `[D_MODEL, D_EXPERT]`, the shared expert likewise with `D_SHARED_EXPERT`,
    /// `shared_gate` `[1, D_MODEL]`; every one MLX affine-quantized, 4 or 8 bits, group 64.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] naming the weight: a dense float weight, a shape other than
    /// the production one, another group size, `N_EXPERTS` ≠ 256, gate and up of different
    /// widths, or routed experts whose widths differ; [`CudaError::Driver`] on allocation.
    pub fn upload_moe(&self, w: &model::load::MoeWeights) -> Result<DeviceMoe, CudaError> {
        fn q<'a>(l: &'a model::linear::Linear, what: &str) -> Result<QMatRef<'a>, CudaError> {
            l.qref().ok_or_else(|| {
                unsupported(format!(
                    "MoE {what} is a dense float weight; the CUDA MoE kernels need MLX-quantized (4 or 8 bits, group 64) weights"
                ))
            })
        }
        fn expert<'a>(x: &'a model::load::Expert, name: &str) -> Result<ExpertRefs<'a>, CudaError> {
            Ok(ExpertRefs {
                gate: q(&x.gate, &format!("{name} gate_proj"))?,
                up: q(&x.up, &format!("{name} up_proj"))?,
                down: q(&x.down, &format!("{name} down_proj"))?,
            })
        }
        let refs = MoeRefs {
            router: q(&w.router, "router (mlp.gate)")?,
            experts: w
                .experts
                .iter()
                .enumerate()
                .map(|(e, x)| expert(x, &format!("expert {e}")))
                .collect::<Result<_, _>>()?,
            shared: expert(&w.shared, "shared expert")?,
            shared_gate: q(&w.shared_gate, "shared_expert_gate")?,
        };
        self.upload_moe_refs(&refs)
    }

    /// [`Self::upload_moe`] from quantized views.
    ///
    /// # Errors
    /// As [`Self::upload_moe`].
    pub fn upload_moe_refs(&self, w: &MoeRefs<'_>) -> Result<DeviceMoe, CudaError> {
        let (d, ne, de, ds) = (p::D_MODEL, p::N_EXPERTS, p::D_EXPERT, p::D_SHARED_EXPERT);
        if w.experts.len() != ne {
            return Err(unsupported(format!(
                "MoE with {} experts; the CUDA MoE kernels are built for N_EXPERTS = {ne}",
                w.experts.len()
            )));
        }
        check_shape(&w.router, "router (mlp.gate)", ne, d)?;
        check_shape(&w.shared_gate, "shared_expert_gate", 1, d)?;
        for (e, x) in w.experts.iter().chain(std::iter::once(&w.shared)).enumerate() {
            let (name, ff) = if e < ne { (format!("expert {e}"), de) } else { ("shared expert".to_string(), ds) };
            check_shape(&x.gate, &format!("{name} gate_proj"), ff, d)?;
            check_shape(&x.up, &format!("{name} up_proj"), ff, d)?;
            check_shape(&x.down, &format!("{name} down_proj"), d, ff)?;
            if x.gate.spec.bits != x.up.spec.bits {
                return Err(unsupported(format!(
                    "MoE {name}: gate_proj has {} bits, up_proj {} (they share tiles)",
                    x.gate.spec.bits.bits(),
                    x.up.spec.bits.bits()
                )));
            }
        }
        if ds != de {
            return Err(unsupported(format!(
                "D_SHARED_EXPERT {ds} != D_EXPERT {de}: the kernels treat the shared expert as one more slot"
            )));
        }
        let gates: Vec<QMatRef<'_>> = w.experts.iter().map(|x| x.gate).collect();
        let downs: Vec<QMatRef<'_>> = w.experts.iter().map(|x| x.down).collect();
        let gate_up_bits = same_bits(&gates, "routed gate/up_proj")?;
        let down_bits = same_bits(&downs, "routed down_proj")?;

        let s = self.stream();
        let (rp, rsb) = pack_rows(&w.router);
        let (gp, gsb) = pack_rows(&w.shared_gate);
        let (guc, gus) = pack_experts(&w.experts, true);
        let (dnc, dns) = pack_experts(&w.experts, false);
        let sh = std::slice::from_ref(&w.shared);
        let (sguc, sgus) = pack_experts(sh, true);
        let (sdnc, sdns) = pack_experts(sh, false);
        Ok(DeviceMoe {
            router_bits: w.router.spec.bits,
            shared_gate_bits: w.shared_gate.spec.bits,
            gate_up_bits,
            down_bits,
            shared_gate_up_bits: w.shared.gate.spec.bits,
            shared_down_bits: w.shared.down.spec.bits,
            router_packed: s.clone_htod(&rp)?,
            router_sb: s.clone_htod(&rsb)?,
            sgate_packed: s.clone_htod(&gp)?,
            sgate_sb: s.clone_htod(&gsb)?,
            gu_codes: s.clone_htod(&guc)?,
            gu_sb: s.clone_htod(&gus)?,
            down_codes: s.clone_htod(&dnc)?,
            down_sb: s.clone_htod(&dns)?,
            sh_gu_codes: s.clone_htod(&sguc)?,
            sh_gu_sb: s.clone_htod(&sgus)?,
            sh_down_codes: s.clone_htod(&sdnc)?,
            sh_down_sb: s.clone_htod(&sdns)?,
        })
    }

    /// Allocates the per-step buffers of [`Self::moe_decode_step`] (zeroed).
    ///
    /// # Errors
    /// [`CudaError::Driver`] on allocation.
    pub fn moe_scratch(&self) -> Result<MoeScratch, CudaError> {
        let s = self.stream();
        let groups = p::D_MODEL / QUANT_GROUP;
        Ok(MoeScratch {
            sel_ids: s.alloc_zeros::<i32>(p::TOP_K)?,
            sel_w: s.alloc_zeros::<f32>(p::TOP_K + 1)?,
            logits: s.alloc_zeros::<f32>(p::N_EXPERTS + 1)?,
            uq: s.alloc_zeros::<u32>(groups * 64)?,
            umeta: s.alloc_zeros::<f32>(groups * 2)?,
            act: s.alloc_zeros::<f32>((p::TOP_K + 1) * p::D_EXPERT)?,
            counter: s.alloc_zeros::<u32>(1)?,
            bar: s.alloc_zeros::<u32>(2)?,
            racc: s.alloc_zeros::<f64>(FOLD_SETS * RF_SET)?,
            part: s.alloc_zeros::<f32>((p::TOP_K + 1) * p::D_MODEL)?,
            cl_counts: s.alloc_zeros::<u32>(CL)?,
            zero_acc_h: false,
            hsum_combine: false,
            evict_first: false,
            // the fused kernel is a measured variant: if its shared-memory size or occupancy
            // cannot be set up here, it is off (grid 0), never an error of the default path
            fused_grid: self.fused_grids().unwrap_or([0, 0]),
            cluster_ok: self.cluster_usable().unwrap_or(false),
            l2_prefetch: crate::L2Prefetch::default(),
            hist_row: 0,
            cl_probe: 0,
        })
    }

    /// Per expert width (4, 8 bits), the fused kernel's grid: [`fused_grid`] blocks when every
    /// router bit width's entry point fits that many blocks on the GPU at once (occupancy × SMs,
    /// with its dynamic shared memory allowed), else 0.
    fn fused_grids(&self) -> Result<[u32; 2], CudaError> {
        use cudarc::driver::sys::CUfunction_attribute;
        self.raw().bind_to_thread()?;
        let grid = fused_grid(self.sm_count());
        let mut out = [0u32; 2];
        for (i, eb) in [4u32, 8].into_iter().enumerate() {
            let smem = fused_smem_bytes(eb);
            let mut fits = grid as usize * FU_WARPS > p::N_EXPERTS;
            for rb in [4u32, 8] {
                let f = self.func(&format!("moe_fused_r{rb}_e{eb}"))?;
                f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
                let per_sm = f.occupancy_max_active_blocks_per_multiprocessor((FU_WARPS * 32) as u32, smem, None)?;
                fits &= per_sm as u64 * u64::from(self.sm_count()) >= u64::from(grid);
            }
            out[i] = if fits { grid } else { 0 };
        }
        Ok(out)
    }

    /// Whether [`MoeFlags::fused`] runs the fused kernel for layer `m` (else the three
    /// kernels): router and shared gate of one width, every expert matrix of one width, and
    /// the grid resident at once.
    pub fn moe_fused_ready(&self, m: &DeviceMoe, scratch: &MoeScratch) -> bool {
        self.fused_grid_for(m, scratch).is_some()
    }

    /// Whether [`MoeFlags::cluster`] runs the expert-per-cluster kernel for layer `m` (else
    /// the three kernels): every expert matrix, routed and shared, 4-bit (at 8 bits a block's
    /// tiles would not fit its shared memory), and the kernels usable on this GPU (`scratch`
    /// found their shared memory granted and a block fitting on an SM; whether 8 such SMs
    /// share a GPC, as a cluster needs, is not queried: true of every H100/H200).
    pub fn moe_cluster_ready(&self, m: &DeviceMoe, scratch: &MoeScratch) -> bool {
        scratch.cluster_ok && [m.gate_up_bits, m.down_bits, m.shared_gate_up_bits, m.shared_down_bits].iter().all(|b| *b == Bits::B4)
    }

    /// Raises the expert-per-cluster kernels' dynamic shared-memory limit to what they use and
    /// says whether one of their blocks then fits on an SM.
    fn cluster_usable(&self) -> Result<bool, CudaError> {
        use cudarc::driver::sys::CUfunction_attribute;
        self.raw().bind_to_thread()?;
        let smem = cluster_smem_bytes(4);
        let mut ok = true;
        for name in ["moe_cluster_e4", "moe_cluster_fold_e4"] {
            let f = self.func(name)?;
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
            ok &= f.occupancy_max_active_blocks_per_multiprocessor((CL_WARPS * 32) as u32, smem, None)? >= 1;
        }
        Ok(ok)
    }

    fn fused_grid_for(&self, m: &DeviceMoe, scratch: &MoeScratch) -> Option<u32> {
        let eb = m.gate_up_bits;
        let uniform = m.router_bits == m.shared_gate_bits
            && [m.down_bits, m.shared_gate_up_bits, m.shared_down_bits].iter().all(|b| *b == eb);
        let g = scratch.fused_grid[usize::from(eb == Bits::B8)];
        (uniform && g > 0).then_some(g)
    }

    /// `out = resid + MoE(u)` for one token (MODEL.md §3.7): `u` = the post-attention
    /// RMSNorm of the hidden state, `resid` = the hidden state, all `[D_MODEL]` f32 on the
    /// device. Router logits, softmax over all `N_EXPERTS` in f32, top-`TOP_K` (ties: lower id
    /// first), weights renormalised over the chosen; each chosen expert's and the shared
    /// expert's `down(silu(gate·u) * (up·u))`, weighted by the routing weights and by
    /// `sigmoid(shared_gate·u)`. Only the chosen experts' weights are read. Sums in f32
    /// (products of codes and activation digits exact in int32, see `kernels/moe.cu`).
    ///
    /// Three launches on [`Self::stream`], asynchronous, graph-capturable; `scratch.sel_ids`
    /// holds the chosen experts afterwards. `out` must not alias `u` (it may alias `resid`).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when a length is not `D_MODEL`; [`CudaError::Driver`].
    pub fn moe_decode_step(
        &self,
        m: &DeviceMoe,
        u: &CudaView<'_, f32>,
        resid: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        for part in 0..3 {
            self.moe_decode_part(m, u, resid, scratch, out, part, MoeFlags::DEFAULT, None)?;
        }
        Ok(())
    }

    /// [`Self::moe_decode_step`] on `u = rms_norm(h, norm_w)` with `resid = h`: the layer's
    /// post_attention_layernorm fused into the router kernel (each of its blocks normalizes h
    /// with the arithmetic of `kernels/rms_norm.cu`, so the result equals [`Self::rms_norm`]
    /// followed by [`Self::moe_decode_step`] bit for bit). `h`, `out`: `[D_MODEL]` f32, `out`
    /// not aliasing `h` (h is u here); `norm_w`: `[D_MODEL]` f32.
    ///
    /// # Errors
    /// As [`Self::moe_decode_step`]; a `norm_w` of another length is
    /// [`CudaError::Unsupported`].
    pub fn moe_decode_step_norm(
        &self,
        m: &DeviceMoe,
        h: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        for part in 0..3 {
            self.moe_decode_part(m, h, h, scratch, out, part, MoeFlags::DEFAULT, Some(norm_w))?;
        }
        Ok(())
    }

    /// One of the three launches of [`Self::moe_decode_step`] (0: router (and top-k), 1:
    /// gate/up (and top-k), 2: down and combine) with the given variant, for measurement. Part
    /// `i` reads what part `i - 1` left in `scratch`; all three must use the same `flags`.
    /// With `norm` (used by part 0 only), u is normalized first as in
    /// [`Self::moe_decode_step_norm`].
    ///
    /// # Errors
    /// As [`Self::moe_decode_step`]; `part > 2` is [`CudaError::Unsupported`].
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn moe_decode_part(
        &self,
        m: &DeviceMoe,
        u: &CudaView<'_, f32>,
        resid: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        out: &mut CudaViewMut<'_, f32>,
        part: usize,
        flags: MoeFlags,
        norm: Option<&CudaView<'_, f32>>,
    ) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        if u.len() != d || resid.len() != d || out.len() != d || norm.is_some_and(|w| w.len() != d) {
            return Err(unsupported(format!(
                "moe_decode_step: u {} resid {} out {} norm_w {:?} (D_MODEL = {d})",
                u.len(),
                resid.len(),
                out.len(),
                norm.map(|w| w.len())
            )));
        }
        let s = self.stream();
        if let Some(w) = norm {
            let (wp, _guard) = w.device_ptr(s);
            if wp % 16 != 0 {
                return Err(unsupported(format!("moe_decode_step: norm_w must be 16-byte aligned (device address {wp:#x})")));
            }
        }
        let mut flags = flags;
        if flags.fused {
            if let Some(grid) = self.fused_grid_for(m, scratch) {
                let fused_part = usize::from(flags.fused_keep_router);
                if part > 2 {
                    return Err(unsupported(format!("moe_decode_part {part} (0..=2)")));
                }
                if part == fused_part {
                    return self.moe_fused_launch(m, u, resid, scratch, out, norm, grid, flags.fused_keep_router);
                }
                if part > fused_part {
                    return Ok(());
                }
                // part 0 with the router kept: the three-kernel router, top-k in its last block
            }
            flags = MoeFlags { fused: false, fused_keep_router: false, ..MoeFlags::DEFAULT };
        } else if flags.cluster {
            if self.moe_cluster_ready(m, scratch) {
                flags = MoeFlags { cluster: false, ..MoeFlags::DEFAULT }; // part 0: the router, top-k in it
                match part {
                    1 => return self.moe_cluster_launch(m, resid, scratch, out),
                    2 => return Ok(()),
                    _ => {}
                }
            } else {
                flags = MoeFlags { cluster: false, ..flags };
            }
        }
        let fl = flags.bits();
        match part {
            0 => {
                let name = format!("moe_router_r{}_g{}", bits_index(m.router_bits), bits_index(m.shared_gate_bits));
                // a router row spans D_MODEL·bits/4096 warps (one 16-byte chunk per lane); one
                // more block for the shared-expert gate row
                let warps_per_row = p::D_MODEL * m.router_bits.bits() as usize / 128 / 32;
                let rows_per_block = ROUTER_WARPS / warps_per_row;
                let cfg = LaunchConfig {
                    grid_dim: ((p::N_EXPERTS / rows_per_block + 1) as u32, 1, 1),
                    block_dim: ((ROUTER_WARPS * 32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = s.launch_builder(self.func(&name)?);
                b.arg(&m.router_packed)
                    .arg(&m.router_sb)
                    .arg(&m.sgate_packed)
                    .arg(&m.sgate_sb)
                    .arg(u)
                    .arg(&mut scratch.logits)
                    .arg(&mut scratch.uq)
                    .arg(&mut scratch.umeta)
                    .arg(&mut scratch.sel_ids)
                    .arg(&mut scratch.sel_w)
                    .arg(&mut scratch.counter)
                    .arg(&fl);
                let null = 0u64; // a null norm_w: u is used as it is
                match norm {
                    Some(w) => b.arg(w),
                    None => b.arg(&null),
                };
                let eps = p::RMS_EPS;
                b.arg(&eps).arg(&scratch.l2_prefetch);
                // SAFETY: arguments match `moe_router_*` in kernels/moe.cu; lengths fixed by
                // upload_moe_refs and moe_scratch (norm_w: D_MODEL f32 or null).
                unsafe { b.launch(cfg) }?;
            }
            1 => {
                let name = format!(
                    "moe_gate_up_e{}_s{}",
                    bits_index(m.gate_up_bits),
                    bits_index(m.shared_gate_up_bits)
                );
                let cfg = LaunchConfig {
                    grid_dim: (((p::TOP_K + 1) * 2 * p::D_EXPERT / TILE_ROWS) as u32, 1, 1),
                    block_dim: ((GU_KS * 32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let dn_tile_e = (tile_words(m.down_bits) * 4) as u32;
                let dn_tile_s = (tile_words(m.shared_down_bits) * 4) as u32;
                let mut b = s.launch_builder(self.func(&name)?);
                b.arg(&m.gu_codes)
                    .arg(&m.gu_sb)
                    .arg(&m.sh_gu_codes)
                    .arg(&m.sh_gu_sb)
                    .arg(&m.down_codes)
                    .arg(&m.down_sb)
                    .arg(&dn_tile_e)
                    .arg(&m.sh_down_codes)
                    .arg(&m.sh_down_sb)
                    .arg(&dn_tile_s)
                    .arg(&mut scratch.sel_ids)
                    .arg(&mut scratch.sel_w)
                    .arg(&scratch.logits)
                    .arg(&scratch.uq)
                    .arg(&scratch.umeta)
                    .arg(&mut scratch.act)
                    .arg(&fl);
                // SAFETY: as above (`moe_gate_up_*`).
                unsafe { b.launch(cfg) }?;
            }
            2 => {
                let name = format!(
                    "moe_down{}_e{}_s{}",
                    if flags.down_reg_cap { "_r48" } else { "" },
                    bits_index(m.down_bits),
                    bits_index(m.shared_down_bits)
                );
                let cfg = LaunchConfig {
                    grid_dim: ((p::D_MODEL / TILE_ROWS) as u32, 1, 1),
                    block_dim: ((DN_KS * (p::TOP_K + 1) * 32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = s.launch_builder(self.func(&name)?);
                b.arg(out)
                    .arg(resid)
                    .arg(&scratch.act)
                    .arg(&scratch.sel_ids)
                    .arg(&scratch.sel_w)
                    .arg(&m.down_codes)
                    .arg(&m.down_sb)
                    .arg(&m.sh_down_codes)
                    .arg(&m.sh_down_sb)
                    .arg(&fl);
                b.arg(&scratch.hist_row);
                // SAFETY: as above (`moe_down_*`); hist_row is null or an [N_EXPERTS] i32 row
                // (its owner's contract).
                unsafe { b.launch(cfg) }?;
            }
            _ => return Err(unsupported(format!("moe_decode_part {part} (0..=2)"))),
        }
        Ok(())
    }
}

/// The decode step's MoE with its router folded into the output projection: no router launch
/// (one of the step's ~250 dependent kernels fewer per layer). See
/// [`CudaContext::gemv_residual_router`].
impl CudaContext {
    /// `out = resid + W·x` ([`Self::gemv_residual`], `W` = the layer's output projection
    /// `[D_MODEL, K]`), and the MoE router of layer `m` folded in: every block adds its rows'
    /// share of `Σ_c router[r, c]·(1 + norm_w[c])·out[c]` (each router row `r`, then the
    /// shared-expert gate's row) and of `Σ_c out[c]²` into accumulator set `set` of `scratch`
    /// (f64; 16 f64 apart). [`Self::moe_fold_gate_up`] and [`Self::moe_fold_down`] scale the
    /// sums by the RMSNorm factor `1/sqrt(mean(out²) + eps)`: the logits of
    /// `router · rms_norm(out, norm_w)` (MODEL.md §3.7), equal to the router kernel's up to f32
    /// rounding. The set must be zero on entry (it is in a new scratch; [`Self::moe_fold_down`]
    /// zeroes the set named as its `zero_set`). `out`, `resid`, `norm_w`: `[D_MODEL]` f32;
    /// `x`: `[K]`.
    ///
    /// # Errors
    /// As [`Self::gemv_residual`]; [`CudaError::Unsupported`] when `W` has other than `D_MODEL`
    /// rows or `K` ≠ `N_V_HEADS·D_V`, `norm_w` is not `D_MODEL` long, `set` ≥ [`FOLD_SETS`], or
    /// the launch would give a block more than 16 tiles of 16 rows (fewer than 8 SMs).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_residual_router(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        mat: &crate::DeviceQMat,
        x: &CudaView<'_, f32>,
        resid: &CudaView<'_, f32>,
        m: &DeviceMoe,
        norm_w: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        set: usize,
    ) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        check_set(set)?;
        const _: () = assert!(p::N_V_HEADS * p::D_V == p::N_Q_HEADS * p::HEAD_DIM, "gemv_resid_rf_* are built for K = ATTN_OUT");
        if mat.rows != d || mat.cols != p::N_V_HEADS * p::D_V || norm_w.len() != d {
            return Err(unsupported(format!(
                "gemv_residual_router: a [{}, {}] matrix with {} norm weights (built for [{d}, {}])",
                mat.rows,
                mat.cols,
                norm_w.len(),
                p::N_V_HEADS * p::D_V
            )));
        }
        let (_, mut cfg, ks_log2, rows) = self.gemv_prepare("gemv_residual_router", out.len(), mat, x, Some(resid.len()))?;
        let tpb = crate::GEMV_WARPS >> ks_log2;
        let iters = d.div_ceil(TILE_ROWS).div_ceil(tpb).div_ceil(cfg.grid_dim.0 as usize);
        if iters * tpb > RF_CAP {
            return Err(unsupported(format!(
                "gemv_residual_router: {} blocks would own {} tiles of 16 rows each (at most {RF_CAP})",
                cfg.grid_dim.0,
                iters * tpb
            )));
        }
        // the staged twin (bulk copies, 4-bit) when the matrix has a staged copy
        let staged = self.staged_of(mat);
        // 4-bit MLX-layout weights: the entry point CudaContext::set_out_proj_variant picked
        // (a slim one by default)
        let variant = self.out_proj_variant();
        let name = if staged.is_none() && mat.bits == Bits::B4 {
            cfg.shared_mem_bytes = variant.smem_bytes() as u32;
            variant.entry(bits_index(m.router_bits), bits_index(m.shared_gate_bits))
        } else {
            format!(
                "gemv_resid_rf_r{}_g{}_{}{}_k{}",
                bits_index(m.router_bits),
                bits_index(m.shared_gate_bits),
                if staged.is_some() { "s" } else { "q" },
                bits_index(mat.bits),
                mat.cols
            )
        };
        let flags = self.gemv_flags();
        let mut acc = scratch.racc.slice_mut(set * RF_SET..(set + 1) * RF_SET);
        let mut b = self.stream().launch_builder(self.func(&name)?);
        match staged {
            Some(st) => b.arg(out).arg(st),
            None => b.arg(out).arg(mat.mlx_codes()?),
        };
        b.arg(&mat.scales)
            .arg(&mat.biases)
            .arg(x)
            .arg(resid)
            .arg(&rows)
            .arg(&ks_log2)
            .arg(&flags)
            .arg(&m.router_packed)
            .arg(&m.router_sb)
            .arg(&m.sgate_packed)
            .arg(&m.sgate_sb)
            .arg(norm_w)
            .arg(&mut acc);
        // SAFETY: arguments match `gemv_resid_rf_*` in kernels/gemv.cu (shapes checked above and
        // in gemv_prepare; router [N_EXPERTS, D_MODEL] and shared gate [1, D_MODEL] by
        // upload_moe_refs; one set of racc, RF_SET f64); no block owns more than RF_CAP
        // tiles; a staged copy holds every tile of the matrix (stage_qmat).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The fold's MoE inputs: `h` and `norm_w` `[D_MODEL]` f32, 16-byte aligned (the kernels
    /// read them as float4). `what` names the caller in the error.
    fn check_fold_inputs(&self, what: &str, h: &CudaView<'_, f32>, norm_w: &CudaView<'_, f32>) -> Result<(), CudaError> {
        self.check_fold_inputs_named(what, "h", h, norm_w)
    }

    /// As [`Self::check_fold_inputs`] with the residual stream's buffer called `h_name`.
    fn check_fold_inputs_named(&self, what: &str, h_name: &str, h: &CudaView<'_, f32>, norm_w: &CudaView<'_, f32>) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        if h.len() != d || norm_w.len() != d {
            return Err(unsupported(format!("{what}: {h_name} {} norm_w {} (D_MODEL = {d})", h.len(), norm_w.len())));
        }
        for (name, v) in [(h_name, h), ("norm_w", norm_w)] {
            let (ptr, _guard) = v.device_ptr(self.stream());
            if ptr % 16 != 0 {
                return Err(unsupported(format!("{what}: {name} must be 16-byte aligned (device address {ptr:#x})")));
            }
        }
        Ok(())
    }

    /// After [`Self::gemv_residual_router`] into set `set`: `u = rms_norm(h, norm_w)` (the norm
    /// factor from the set's Σ h²) and softmax + top-k from the set's logit sums in every block,
    /// then the chosen and the shared experts' `silu(gate·u)·(up·u)` into `scratch`. `h`: the
    /// output projection's `out`; `norm_w`: the layer's post_attention_layernorm, both
    /// `[D_MODEL]` f32, 16-byte aligned.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] on other lengths, a misaligned `h`/`norm_w` or `set` ≥
    /// [`FOLD_SETS`]; driver errors.
    pub fn moe_fold_gate_up(
        &self,
        m: &DeviceMoe,
        h: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        set: usize,
    ) -> Result<(), CudaError> {
        let s = self.stream();
        check_set(set)?;
        self.check_fold_inputs("moe_fold_gate_up", h, norm_w)?;
        let name = format!("moe_gate_up_fold_e{}_s{}", bits_index(m.gate_up_bits), bits_index(m.shared_gate_up_bits));
        let cfg = LaunchConfig {
            grid_dim: (((p::TOP_K + 1) * 2 * p::D_EXPERT / TILE_ROWS) as u32, 1, 1),
            block_dim: ((GU_KS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let eps = p::RMS_EPS;
        let acc = scratch.racc.slice(set * RF_SET..(set + 1) * RF_SET);
        let mut b = s.launch_builder(self.func(&name)?);
        b.arg(&m.gu_codes)
            .arg(&m.gu_sb)
            .arg(&m.sh_gu_codes)
            .arg(&m.sh_gu_sb)
            .arg(h)
            .arg(norm_w)
            .arg(&eps)
            .arg(&acc)
            .arg(&mut scratch.act);
        // SAFETY: arguments match `moe_gate_up_fold_*` in kernels/moe.cu; lengths checked above
        // and fixed by upload_moe_refs and moe_scratch.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// After [`Self::moe_fold_gate_up`] on set `set`: `out = resid + Σ_k w_k·down_k(act_k) +
    /// c·down_s(act_s)` (the down kernel of [`Self::moe_decode_step`], with its own top-k from
    /// the set, so its weights load while gate/up runs); `sel_ids`/`sel_w` as
    /// [`Self::moe_decode_step`] leaves them; set `zero_set` zeroed for the next
    /// [`Self::gemv_residual_router`] (it must differ from `set`: the kernel's blocks still
    /// read `set` when the first of them zeroes). `resid`, `out`: `[D_MODEL]` f32.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] on other lengths, `set == zero_set` or a set ≥
    /// [`FOLD_SETS`]; driver errors.
    pub fn moe_fold_down(
        &self,
        m: &DeviceMoe,
        resid: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        out: &mut CudaViewMut<'_, f32>,
        set: usize,
        zero_set: usize,
    ) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        check_read_zero_sets("moe_fold_down", set, zero_set)?;
        if resid.len() != d || out.len() != d {
            return Err(unsupported(format!("moe_fold_down: resid {} out {} (D_MODEL = {d})", resid.len(), out.len())));
        }
        let name = format!("moe_down_fold_e{}_s{}", bits_index(m.down_bits), bits_index(m.shared_down_bits));
        let cfg = LaunchConfig {
            grid_dim: ((p::D_MODEL / TILE_ROWS) as u32, 1, 1),
            block_dim: ((DN_KS * (p::TOP_K + 1) * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let eps = p::RMS_EPS;
        // the two sets as disjoint views: `read` (set), `zero` (zero_set)
        let func = self.func(&name)?;
        with_read_zero_sets(&mut scratch.racc, set, zero_set, |read, zero| {
            let mut b = self.stream().launch_builder(func);
            b.arg(out)
                .arg(resid)
                .arg(&scratch.act)
                .arg(&mut scratch.sel_ids)
                .arg(&mut scratch.sel_w)
                .arg(&m.down_codes)
                .arg(&m.down_sb)
                .arg(&m.sh_down_codes)
                .arg(&m.sh_down_sb);
            b.arg(read).arg(zero).arg(&eps).arg(&scratch.hist_row);
            // SAFETY: arguments match `moe_down_fold_*` in kernels/moe.cu (shapes as
            // moe_decode_part's down launch; racc sets RF_SET f64 each, distinct).
            unsafe { b.launch(cfg) }?;
            Ok(())
        })
    }

    /// [`Self::moe_fold_gate_up`] and [`Self::moe_fold_down`] as one launch: one thread-block
    /// cluster per expert (`moe_cluster_fold_e4`, see [`MoeFlags::cluster`]), every block running
    /// the top-k from set `set` itself; the same results bit for bit, `sel_ids`/`sel_w` and set
    /// `zero_set` as they leave them. `h` is the residual stream the output projection wrote
    /// (and the residual of the sum), `norm_w` the post_attention_layernorm, `out` `[D_MODEL]`.
    /// With `scratch.hsum_combine` (a [`MoeScratch`] field) the combine is by f64 atomics
    /// instead, not bit-equal: `out` is left alone, the sum goes into set `zero_set`'s `h` sums
    /// ([`MoeScratch::hsum`], zero on entry), and set `set`'s are zeroed.
    ///
    /// # Errors
    /// As the two; [`CudaError::Unsupported`] when an expert matrix is not 4-bit
    /// ([`Self::moe_cluster_ready`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_fold_cluster(
        &self,
        m: &DeviceMoe,
        h: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        out: &mut CudaViewMut<'_, f32>,
        set: usize,
        zero_set: usize,
    ) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        check_read_zero_sets("moe_fold_cluster", set, zero_set)?;
        if !self.moe_cluster_ready(m, scratch) {
            return Err(unsupported(format!("moe_fold_cluster: expert widths {:?} (every expert matrix must be 4-bit)", m.bits())));
        }
        self.check_fold_inputs("moe_fold_cluster", h, norm_w)?;
        if out.len() != d {
            return Err(unsupported(format!("moe_fold_cluster: out {} (D_MODEL = {d})", out.len())));
        }
        if scratch.hsum_combine && scratch.zero_acc_h {
            return Err(unsupported("moe_fold_cluster: the combine by atomics (MoeScratch::hsum_combine) and the split output projection's h − x (zero_acc_h) share the sets' h accumulators".into()));
        }
        let flags = self.moe_cluster_flags()
            | if scratch.zero_acc_h { CL_ZERO_ACC_H } else { 0 }
            | if scratch.hsum_combine { CL_HSUM } else { 0 }
            | if scratch.evict_first { CL_EVICT_FIRST } else { 0 };
        self.fold_cluster_launch("moe_cluster_fold_e4", ClusterStream::OutH(out, h), m, norm_w, scratch, set, zero_set, flags)
    }

    /// The experts after [`Self::gdn_step_out`] (the split output projection), one cluster
    /// launch as [`Self::moe_fold_cluster`] (`moe_cluster_split_e4`): `h = x + (h − x)` from
    /// accumulator set `set`, the RMSNorm factor from `Σ h²` over `h` itself, the top-k from the
    /// set's router sums, then `x ← h + MoE(rms_norm(h))` in place. Zeroes set `zero_set` (the
    /// next layer's, `h − x` included).
    ///
    /// # Errors
    /// As [`Self::moe_fold_cluster`]; the launch fails (a driver error) on a context where no
    /// model got its split output projections yet ([`CudaContext::upload_gdn_out_split`] raises
    /// this kernel's shared-memory limit).
    pub fn moe_split_cluster(
        &self,
        m: &DeviceMoe,
        norm_w: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        x: &mut CudaViewMut<'_, f32>,
        set: usize,
        zero_set: usize,
    ) -> Result<(), CudaError> {
        check_read_zero_sets("moe_split_cluster", set, zero_set)?;
        if !self.moe_cluster_ready(m, scratch) {
            return Err(unsupported(format!("moe_split_cluster: expert widths {:?} (every expert matrix must be 4-bit)", m.bits())));
        }
        self.check_fold_inputs_named("moe_split_cluster", "x", &x.as_view(), norm_w)?;
        let flags = self.moe_cluster_flags();
        self.fold_cluster_launch("moe_cluster_split_e4", ClusterStream::InPlace(x), m, norm_w, scratch, set, zero_set, flags)
    }

    /// Launches `moe_cluster_fold_e4` or `moe_cluster_split_e4`, whose parameters differ only in
    /// the leading residual-stream buffers (`stream_bufs`): reads accumulator set `set`, zeroes
    /// `zero_set` (the callers check both, the buffers and the experts' widths).
    #[allow(clippy::too_many_arguments)]
    fn fold_cluster_launch(
        &self,
        name: &str,
        stream_bufs: ClusterStream<'_, '_, '_>,
        m: &DeviceMoe,
        norm_w: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        set: usize,
        zero_set: usize,
        flags: i32,
    ) -> Result<(), CudaError> {
        let s = self.stream();
        let eps = p::RMS_EPS;
        let func = self.func(name)?;
        with_read_zero_sets(&mut scratch.racc, set, zero_set, |read, zero| {
            let mut b = s.launch_builder(func);
            match stream_bufs {
                ClusterStream::OutH(out, h) => b.arg(out).arg(h),
                ClusterStream::InPlace(x) => b.arg(x),
            };
            cluster_tile_args(&mut b, m);
            b.arg(&mut scratch.sel_ids)
                .arg(&mut scratch.sel_w)
                .arg(norm_w)
                .arg(&eps)
                .arg(read)
                .arg(zero)
                .arg(&mut scratch.part)
                .arg(&mut scratch.cl_counts)
                .arg(&scratch.hist_row)
                .arg(&scratch.cl_probe)
                .arg(&flags)
                .arg(&scratch.l2_prefetch);
            // SAFETY: arguments match `moe_cluster_fold_e4` / `moe_cluster_split_e4` in
            // kernels/moe.cu (out then h, or x alone, then the same list); lengths checked by the
            // callers and fixed by upload_moe_refs (4-bit experts) and moe_scratch; racc sets
            // RF_SET f64 each, distinct; hist_row null or an [N_EXPERTS] i32 row. With x alone the
            // kernel reads and writes it, ordering every read of a row before its write
            // (cluster_body's SPLIT). Cluster shape and shared memory as moe_cluster_launch.
            unsafe { b.launch(cluster_cfg()) }?;
            Ok(())
        })
    }

    /// Raises `moe_cluster_split_e4`'s dynamic shared-memory limit to what it uses (done when a
    /// model gets its split output projections, [`CudaContext::upload_gdn_out_split`], so that
    /// the default path never depends on this variant's kernel).
    pub(crate) fn allow_split_cluster(&self) -> Result<(), CudaError> {
        use cudarc::driver::sys::CUfunction_attribute;
        self.raw().bind_to_thread()?;
        self.func("moe_cluster_split_e4")?
            .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, cluster_smem_bytes(4) as i32)?;
        Ok(())
    }

    /// `flags` of the expert-per-cluster kernels from the context's measurement switches.
    fn moe_cluster_flags(&self) -> i32 {
        let late = self.moe_cluster_late_trigger.load(std::sync::atomic::Ordering::Relaxed);
        let issue = self.moe_cluster_mark_issue.load(std::sync::atomic::Ordering::Relaxed);
        let pin = self.moe_cluster_pin_experts.load(std::sync::atomic::Ordering::Relaxed);
        (if late { CL_LATE_TRIGGER } else { 0 }) | (if issue { CL_MARK_ISSUE } else { 0 }) | (if pin { CL_PIN_EXPERTS } else { 0 }) | self.decode_diag_bits(true)
    }

    /// Zero every router-fold accumulator set (what [`Self::moe_fold_down`] does for the next
    /// layer), for a step that leaves the down launch out (the ablation).
    ///
    /// # Errors
    /// Driver errors.
    #[doc(hidden)]
    pub fn moe_fold_reset(&self, scratch: &mut MoeScratch) -> Result<(), CudaError> {
        self.stream().memset_zeros(&mut scratch.racc)?;
        Ok(())
    }
}

/// Both sets exist and differ (a launch that reads `set` and zeroes `zero_set`: its blocks still
/// read `set` when the first of them zeroes).
fn check_read_zero_sets(what: &str, set: usize, zero_set: usize) -> Result<(), CudaError> {
    check_set(set)?;
    check_set(zero_set)?;
    if set == zero_set {
        return Err(unsupported(format!("{what}: reads and zeroes accumulator set {set}")));
    }
    Ok(())
}

/// Accumulator sets `set` (read) and `zero_set` (zeroed by the kernel) of `racc` as two
/// disjoint views of [`RF_SET`] f64, for `f` (the sets must differ: [`check_read_zero_sets`]).
fn with_read_zero_sets<R>(
    racc: &mut CudaSlice<f64>,
    set: usize,
    zero_set: usize,
    f: impl FnOnce(&mut CudaViewMut<'_, f64>, &mut CudaViewMut<'_, f64>) -> R,
) -> R {
    let (lo, hi) = (set.min(zero_set), set.max(zero_set));
    let (mut below, mut above) = racc.split_at_mut(hi * RF_SET);
    let lo_v = below.slice_mut(lo * RF_SET..(lo + 1) * RF_SET);
    let hi_v = above.slice_mut(..RF_SET);
    let (mut read, mut zero) = if set < zero_set { (lo_v, hi_v) } else { (hi_v, lo_v) };
    f(&mut read, &mut zero)
}

fn check_set(set: usize) -> Result<(), CudaError> {
    if set >= FOLD_SETS {
        return Err(unsupported(format!("router-fold accumulator set {set} (there are {FOLD_SETS})")));
    }
    Ok(())
}

impl CudaContext {
    /// Measurement: `n` grid-wide barriers in a row (`moe_grid_barrier_probe`, the fused
    /// kernel's barrier on its grid and block shape), one launch; time `n` = 64 against 0 for
    /// the cost of one barrier.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when the fused kernel's grid cannot be resident at once (the
    /// probe would never finish); driver errors.
    #[doc(hidden)]
    pub fn moe_grid_barrier_probe(&self, scratch: &mut MoeScratch, n: i32) -> Result<(), CudaError> {
        let grid = scratch.fused_grid[0];
        if grid == 0 {
            return Err(unsupported("the fused MoE grid does not fit on this GPU at once".into()));
        }
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: ((FU_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream().launch_builder(self.func("moe_grid_barrier_probe")?);
        b.arg(&mut scratch.bar).arg(&n);
        // SAFETY: bar is the 2-word barrier state; the grid fits at once (fused_grids, with less
        // shared memory here than the fused kernel's); a cooperative launch, so the driver
        // refuses a grid that cannot be resident instead of letting the barrier spin.
        unsafe { b.launch_cooperative(cfg) }?;
        Ok(())
    }

    /// Measurement: `n` grid-wide barriers without atomics in a row (`moe_flag_barrier_probe`:
    /// every block stores its epoch in its own word, every block polls all the words), on the
    /// fused kernel's grid and block shape, one cooperative launch. `flags`: a word per block of
    /// that grid (e.g. one per SM), every word `<= base` (epochs only grow: pass the previous
    /// launch's `base + n`; zeroed words start at 0), left at `base + n`. Against
    /// [`Self::moe_grid_barrier_probe`]: the synchronisation a persistent decode kernel would
    /// need per phase.
    ///
    /// # Errors
    /// As [`Self::moe_grid_barrier_probe`].
    #[doc(hidden)]
    pub fn moe_flag_barrier_probe(&self, scratch: &MoeScratch, flags: &mut CudaSlice<u32>, n: i32, base: u32) -> Result<(), CudaError> {
        let grid = scratch.fused_grid[0];
        if grid == 0 {
            return Err(unsupported("the fused MoE grid does not fit on this GPU at once".into()));
        }
        if (grid as usize) > flags.len() {
            return Err(unsupported(format!("moe_flag_barrier_probe: {} flag words for a grid of {grid}", flags.len())));
        }
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: ((FU_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream().launch_builder(self.func("moe_flag_barrier_probe")?);
        b.arg(flags).arg(&n).arg(&base);
        // SAFETY: flags holds a word per SM (>= grid); a cooperative launch (every block
        // resident, or the driver refuses it), so the polling ends.
        unsafe { b.launch_cooperative(cfg) }?;
        Ok(())
    }

    /// The expert-per-cluster kernel (see [`MoeFlags::cluster`]): `TOP_K + 1` clusters of
    /// [`CL`] blocks, after the router kernel (its ids, weights and u digits in `scratch`).
    fn moe_cluster_launch(
        &self,
        m: &DeviceMoe,
        resid: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        let s = self.stream();
        let mut b = s.launch_builder(self.func("moe_cluster_e4")?);
        b.arg(out).arg(resid);
        cluster_tile_args(&mut b, m);
        b.arg(&mut scratch.sel_ids)
            .arg(&mut scratch.sel_w)
            .arg(&scratch.uq)
            .arg(&scratch.umeta)
            .arg(&mut scratch.part)
            .arg(&mut scratch.cl_counts)
            .arg(&scratch.hist_row)
            .arg(&scratch.cl_probe)
            .arg(&0i32); // flags: its trigger follows the router kernel's ids (no late trigger)
        // SAFETY: arguments match `moe_cluster_e4` in kernels/moe.cu; lengths fixed by
        // upload_moe_refs (every expert matrix 4-bit: moe_cluster_ready) and moe_scratch;
        // hist_row is null or an [N_EXPERTS] i32 row (its owner's contract). The cluster shape
        // is a compile-time attribute of the kernel (__cluster_dims__), and the grid a multiple
        // of it; moe_scratch raised the dynamic shared-memory limit (cluster_usable, which
        // moe_cluster_ready requires).
        unsafe { b.launch(cluster_cfg()) }?;
        Ok(())
    }

    /// The fused kernel (see [`MoeFlags::fused`]) on `grid` co-resident blocks; `after_router`:
    /// the router kernel ran before it ([`MoeFlags::fused_keep_router`]), so it reads the
    /// router's u digits (`scratch.uq`, `scratch.umeta`), ids and weights.
    #[allow(clippy::too_many_arguments)]
    fn moe_fused_launch(
        &self,
        m: &DeviceMoe,
        u: &CudaView<'_, f32>,
        resid: &CudaView<'_, f32>,
        scratch: &mut MoeScratch,
        out: &mut CudaViewMut<'_, f32>,
        norm: Option<&CudaView<'_, f32>>,
        grid: u32,
        after_router: bool,
    ) -> Result<(), CudaError> {
        let eb = m.gate_up_bits.bits();
        let name = format!("moe_fused_r{}_e{eb}", m.router_bits.bits());
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: ((FU_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: fused_smem_bytes(eb) as u32,
        };
        let s = self.stream();
        let mut b = s.launch_builder(self.func(&name)?);
        b.arg(&m.router_packed)
            .arg(&m.router_sb)
            .arg(&m.sgate_packed)
            .arg(&m.sgate_sb)
            .arg(&m.gu_codes)
            .arg(&m.gu_sb)
            .arg(&m.sh_gu_codes)
            .arg(&m.sh_gu_sb)
            .arg(&m.down_codes)
            .arg(&m.down_sb)
            .arg(&m.sh_down_codes)
            .arg(&m.sh_down_sb)
            .arg(u)
            .arg(resid)
            .arg(out)
            .arg(&mut scratch.logits)
            .arg(&mut scratch.act)
            .arg(&mut scratch.sel_ids)
            .arg(&mut scratch.sel_w)
            .arg(&mut scratch.bar);
        let null = 0u64;
        match norm {
            Some(w) => b.arg(w),
            None => b.arg(&null),
        };
        let eps = p::RMS_EPS;
        b.arg(&eps);
        if after_router {
            b.arg(&scratch.uq).arg(&scratch.umeta);
        } else {
            b.arg(&null).arg(&null);
        }
        // SAFETY: arguments match `moe_fused_*` in kernels/moe.cu; lengths fixed by
        // upload_moe_refs and moe_scratch (norm_w: D_MODEL f32, 16-byte aligned, or null). The
        // barriers need every block resident at once: fused_grids sized the grid by occupancy,
        // and the launch is cooperative, so the driver refuses a grid that cannot be resident
        // (fewer SMs under MPS or green contexts) instead of letting the barriers spin.
        unsafe { b.launch_cooperative(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quant::QuantSpec;

    /// The packing puts every code where the kernel's fragment arithmetic looks for it:
    /// emulate one warp's A fragments and compare with the source codes.
    #[test]
    fn tile_fragments_hold_the_right_codes() {
        for bits in [4u32, 8] {
            let spec = QuantSpec::new(bits, 64).unwrap();
            let (rows, cols) = (16usize, 128usize);
            let mut seed = 0x1234_5678_u64 + u64::from(bits);
            let packed: Vec<u32> = (0..rows * spec.words_per_row(cols))
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (seed >> 32) as u32
                })
                .collect();
            let n = rows * cols / 64;
            let scales: Vec<bf16> = (0..n).map(|i| bf16::from_f32(i as f32)).collect();
            let biases: Vec<bf16> = (0..n).map(|i| bf16::from_f32(-(i as f32))).collect();
            let m = QMatRef::new(rows, cols, spec, &packed, &scales, &biases).unwrap();
            let tile_rows: [(QMatRef<'_>, usize); TILE_ROWS] = std::array::from_fn(|r| (m, r));
            let b = spec.bits;
            let tw = tile_words(b);
            let mut codes = vec![0u32; 2 * tw];
            let mut sb = vec![0u32; 2 * 16];
            pack_tile(&tile_rows, &mut codes, &mut sb);
            for gi in 0..2 {
                let tile = &codes[gi * tw..(gi + 1) * tw];
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    // the kernel's a[0..8]
                    let a: Vec<u32> = match b {
                        Bits::B4 => (0..4)
                            .flat_map(|j| {
                                let w = tile[lane * 4 + j];
                                [w & 0x0F0F_0F0F, (w >> 4) & 0x0F0F_0F0F]
                            })
                            .collect(),
                        Bits::B8 => (0..8).map(|m| tile[((m / 4) * 32 + lane) * 4 + m % 4]).collect(),
                    };
                    for (mi, w) in a.iter().enumerate() {
                        let (h, i) = (mi / 4, mi % 4);
                        for byte in 0..4 {
                            let row = g + 8 * (i & 1);
                            let col = gi * 64 + 32 * h + 16 * (i >> 1) + 4 * t + byte;
                            assert_eq!((w >> (8 * byte)) & 0xFF, m.code(row, col), "bits {bits} lane {lane} a[{mi}] byte {byte}");
                        }
                    }
                    let want = [g, g + 8].map(|r| {
                        let i = r * 2 + gi;
                        sb_word(scales[i], biases[i])
                    });
                    assert_eq!(sb[gi * 16 + 2 * g..gi * 16 + 2 * g + 2], want);
                }
            }
        }
    }

    /// The kernel's digit arithmetic (emulated on the host): four balanced base-256 digits of
    /// round(x · 2^(30-E)) reconstruct x to 2^(E-31), and the fragment words carry digit n of
    /// x[32h + 16r + 4t + b] in byte b of word 16n + 4t + 2h + r.
    #[test]
    fn activation_digits_reconstruct_the_values() {
        let xs: Vec<f32> = (0..64).map(|i| ((i as f32) * 0.37).sin() * 3.0 + if i == 5 { 40.0 } else { 0.0 }).collect();
        let m = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let e = ((m.to_bits() >> 23) & 0xFF) as i32 - 126;
        let up = 2f32.powi(30 - e);
        let mut words = [0u32; 64];
        for q in 0..16 {
            let (t, r, h) = (q & 3, (q >> 2) & 1, q >> 3);
            let d: Vec<u32> = (0..4)
                .map(|b| {
                    let x = (xs[32 * h + 16 * r + 4 * t + b] * up).round_ties_even() as i32;
                    (x as u32).wrapping_add(0x8080_8080) ^ 0x8080_8080
                })
                .collect();
            for n in 0..4 {
                words[16 * n + 4 * t + 2 * h + r] =
                    (0..4).map(|b| ((d[b] >> (8 * n)) & 0xFF) << (8 * b)).fold(0, |a, v| a | v);
            }
        }
        for (k, x) in xs.iter().enumerate() {
            let (h, r, t, b) = (k / 32, (k / 16) % 2, (k / 4) % 4, k % 4);
            let mut v = 0f64;
            for n in 0..4 {
                let digit = ((words[16 * n + 4 * t + 2 * h + r] >> (8 * b)) & 0xFF) as u8 as i8;
                v += f64::from(digit) * 256f64.powi(n as i32);
            }
            let got = v * 2f64.powi(e - 30);
            assert!((got - f64::from(*x)).abs() <= 2f64.powi(e - 31), "x[{k}] = {x}, digits give {got}");
        }
    }
}

#[cfg(test)]
mod fold_set_tests {
    use super::{fold_set, FOLD_SETS};

    /// Consecutive layers, and a step's last and the next step's first, never share a set.
    #[test]
    fn consecutive_layers_use_different_sets() {
        for n in 2..=64 {
            for l in 0..n {
                let (a, b) = (fold_set(l, n), fold_set((l + 1) % n, n));
                assert!(a < FOLD_SETS && a != b, "{n} layers: layer {l} set {a}, next {b}");
            }
        }
    }
}
