//! Gated DeltaNet prefill on the GPU: a block of `T` prompt tokens of one layer in the chunked
//! form (docs/MODEL.md §3.5 steps 2-7 with chunk `C = 64`, and the gated RMSNorm of step 8),
//! continuing from and updating the same conv state and GDN state as the decode step
//! ([`CudaContext::gdn_decode_step`]). Kernels: `kernels/gdn_prefill.cu`.
//!
//! The CPU twin is the prefill path of `model::Model`'s GDN mixer (crates/model/src/lib.rs),
//! built from `model::reference::{causal_conv_silu, l2norm_inplace, softplus, sigmoid,
//! gdn_chunk, gated_rms_norm}`; the chunk math follows transformers
//! `torch_chunk_gated_delta_rule`.
//!
//! Four launches, eager on [`CudaContext::stream`] with `T` as a host argument (prefill is not
//! part of the decode graph):
//!
//! 1. `gdnp_conv`: causal conv + SiLU, L2 norms, gates → `q̂, k̂, v, g, β` in the scratch.
//! 2. `gdnp_prep_*`: per (QK head, chunk), everything that does not depend on the state:
//!    `γ`, `Tm = (I + A)⁻¹`, `U`, `W`, `P = (Q̂K̂ᵀ) ⊙ D`; shifts the conv state.
//! 3. `gdnp_state_*`: per (V head, quarter of the value columns), the chunks in order:
//!    `V' = U − W S`, `O = e^γ Q̂ S + P V'`, `S ← e^{γ_C} S + K̂ᵀ e^{γ_C−γ} V'`.
//! 4. `gdnp_norm`: gated RMSNorm of `O` in place (`gdnp_norm_acts` for
//!    [`CudaContext::gdn_prefill_acts`]: into `out_proj`'s bf16 activations). With
//!    [`GdnPrefillScratch::set_fused_norm`] the state kernel does that itself
//!    (`gdnp_state_tf32wgcn`, a cluster per V head) and there are three launches.
//!
//! [`GdnPrefillMath`] selects fp32 CUDA-core products or TF32 tensor-core products (fp32
//! accumulation) for steps 2 and 3; the state, the triangular solve and all elementwise math
//! are fp32 either way. With TF32 the state kernel runs every product on warpgroup MMAs
//! (`wgmma`, [`GdnPrefillMath::Tf32WgC`], the default), only `W·S` and `Q̂·S` there
//! ([`GdnPrefillMath::Tf32Wg`]), or every product on `mma.sync` ([`GdnPrefillMath::Tf32`]):
//! the same bits.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig};
use spec::production as p;

use crate::gdn::{GDN_CONV_DIM, GDN_CONV_STATE_LEN, GDN_OUT, GDN_PROJ, GDN_STATE_LEN};
use crate::gemm::GemmScratch;
use crate::{CudaContext, CudaError};

/// Chunk length of the chunked form (`C`); the kernels are built for 64.
pub const GDN_PREFILL_CHUNK: usize = 64;
const _: () = assert!(GDN_PREFILL_CHUNK == p::GDN_CHUNK, "kernels/gdn_prefill.cu is built for C = 64");

const CH: usize = GDN_PREFILL_CHUNK;
/// Blocks per V head in `gdnp_state_*` (`SPLIT` in the kernel file).
const SPLIT: usize = 4;
/// Dynamic shared memory of `gdnp_prep_*` in f32 (`PB_FLOATS` in the kernel file; the kernel
/// traps if it gets less).
const PREP_FLOATS: usize = CH * (p::D_K + 4) + CH * (p::D_K + 8) + 2 * CH * (CH + 4) + 8 * CH;
/// Dynamic shared memory of `gdnp_state_*` in f32 (`SC_FLOATS` in the kernel file): three ring
/// slots of W/Q̂ key-column halves, two U slices and γ, K̂, P, S, V', e^{γ_C−γ}V', e^γQ̂S.
const STATE_FLOATS: usize = {
    let cwp = p::D_V / SPLIT + 8;
    3 * 2 * CH * (p::D_K / 2 + 4) + 2 * CH * cwp + 2 * CH + CH * (p::D_K + 8) + CH * (CH + 4) + p::D_K * cwp + 3 * CH * cwp
};

/// Dynamic shared memory of `gdnp_state_tf32wgcn` ([`GdnPrefillScratch::set_fused_norm`]) in
/// bytes: [`GdnPrefillMath::Tf32WgC`]'s, plus `NRM_EXTRA` = 68 floats (warpgroup 3's 64 partial
/// sums and two mbarriers; the chunk's z and the partial-sum slots use the `e^γQ̂S` region that
/// the TF32 forms leave empty).
const FUSED_NORM_SMEM: usize = (STATE_FLOATS + 128 + CH + 4) * 4 + 1024;

/// How the chunk products (`K̂K̂ᵀ`, `Q̂K̂ᵀ`, `Tm·V`, `Tm·K̂`, `W·S`, `Q̂·S`, `P·V'`, `K̂ᵀV'`) are
/// computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdnPrefillMath {
    /// fp32 on the CUDA cores: agrees with the fp32 CPU reference to ~1e-6 relative.
    F32,
    /// TF32 tensor cores (`mma.sync m16n8k8`, operands rounded to 10-bit mantissas with
    /// `cvt.rna`, fp32 accumulation): ~1e-3 relative, far below the model's own BF16 rounding.
    Tf32,
    /// TF32 as before session 24: every tensor-core operand rounded (`cvt.rna`) on each load
    /// instead of once where it is stored. The same arithmetic up to where the rounding happens;
    /// kept as the measured twin (`cuda_selftest --only gdnpre` times both).
    #[doc(hidden)]
    Tf32Old,
    /// TF32 as [`Self::Tf32`], with the state kernel's `W·S` and `Q̂·S` on warpgroup MMAs
    /// (`wgmma`: shared-memory operands read once per warpgroup instead of once per warp;
    /// `gdnp_state_tf32wg`): the same products of the same TF32-rounded operands, summed as
    /// `mma.sync` sums them, so the same bits (self-test `gdnpre`). The default in sessions
    /// 46-47; the measured twin of [`Self::Tf32WgC`] since.
    Tf32Wg,
    /// [`Self::Tf32Wg`] with the chunk update's `K̂ᵀV'` and `P·V'` on warpgroup MMAs too
    /// (`gdnp_state_tf32wgc`): the same bits again (self-test `gdnpre`, every case against the
    /// mma.sync kernel), the state kernel 1.2-3.4% faster than [`Self::Tf32Wg`] on an H100
    /// (session 48). The default ([`DEFAULT_MATH_CHOICE`]).
    Tf32WgC,
}

impl GdnPrefillMath {
    /// The prep entry point; `lean` picks, on the TF32 forms that pre-round their operands,
    /// session 52's form ([`GdnPrefillScratch::set_prep_lean`]), and `balanced` that form
    /// with its `Tm` products balanced over the warps ([`GdnPrefillScratch::set_prep_balanced`]).
    fn prep(self, lean: bool, balanced: bool) -> &'static str {
        match self {
            GdnPrefillMath::F32 => "gdnp_prep_f32",
            GdnPrefillMath::Tf32 | GdnPrefillMath::Tf32Wg | GdnPrefillMath::Tf32WgC => match (lean, balanced) {
                (true, true) => "gdnp_prep_tf32b",
                (true, false) => "gdnp_prep_tf32",
                (false, _) => "gdnp_prep_tf32lx",
            },
            GdnPrefillMath::Tf32Old => "gdnp_prep_tf32old",
        }
    }
    fn state(self) -> &'static str {
        match self {
            GdnPrefillMath::F32 => "gdnp_state_f32",
            GdnPrefillMath::Tf32 => "gdnp_state_tf32",
            GdnPrefillMath::Tf32Old => "gdnp_state_tf32old",
            GdnPrefillMath::Tf32Wg => "gdnp_state_tf32wg",
            GdnPrefillMath::Tf32WgC => "gdnp_state_tf32wgc",
        }
    }
    /// Dynamic shared memory of `gdnp_state_*` in bytes: `SC_FLOATS` floats; the wgmma forms
    /// align their base up to 1024 bytes (1 KiB of slack), and the one with the chunk update
    /// on wgmma moves its regions up by `WG_SHIFT` = 128 floats, so that every swizzled
    /// operand starts on a 1024-byte boundary.
    fn state_smem(self) -> usize {
        match self {
            GdnPrefillMath::Tf32Wg => STATE_FLOATS * 4 + 1024,
            GdnPrefillMath::Tf32WgC => (STATE_FLOATS + 128) * 4 + 1024,
            _ => STATE_FLOATS * 4,
        }
    }
    /// Threads per block of `gdnp_state_*` (`sc_threads` in the kernel file).
    fn state_threads(self) -> u32 {
        match self {
            GdnPrefillMath::F32 => 256,
            GdnPrefillMath::Tf32 | GdnPrefillMath::Tf32Old | GdnPrefillMath::Tf32Wg | GdnPrefillMath::Tf32WgC => 512,
        }
    }
}

/// The arithmetic a [`GdnPrefillScratch`] starts with unless [`set_default_math`] says
/// otherwise: every product of the state kernel on warpgroup MMAs ([`GdnPrefillMath::Tf32WgC`],
/// since session 48; `W·S` and `Q̂·S` only, [`GdnPrefillMath::Tf32Wg`], since session 46), the
/// same bits as the mma.sync kernel and faster (docs/CUDA.md, "GDN prefill").
pub const DEFAULT_MATH_CHOICE: GdnPrefillMath = GdnPrefillMath::Tf32WgC;

const DEFAULT_CHOICES: [GdnPrefillMath; 5] =
    [GdnPrefillMath::Tf32WgC, GdnPrefillMath::Tf32Wg, GdnPrefillMath::Tf32, GdnPrefillMath::F32, GdnPrefillMath::Tf32Old];
/// Index of `math` in [`DEFAULT_CHOICES`] (a compile error if it is missing there).
const fn choice_index(math: GdnPrefillMath) -> u8 {
    let mut i = 0;
    while i < DEFAULT_CHOICES.len() {
        if DEFAULT_CHOICES[i] as u8 == math as u8 {
            return i as u8;
        }
        i += 1;
    }
    panic!("every GdnPrefillMath is in DEFAULT_CHOICES")
}
/// The arithmetic new scratches start with: an index into [`DEFAULT_CHOICES`].
static DEFAULT_MATH: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(choice_index(DEFAULT_MATH_CHOICE));

/// The arithmetic every [`GdnPrefillScratch`] created afterwards starts with (by default
/// [`DEFAULT_MATH_CHOICE`]). Process-wide, so that the engine's accelerator and a tool's own
/// prefiller agree (`calla cuda-bench | cuda-check --gdn-prefill-mma | --gdn-prefill-wg`).
pub fn set_default_math(math: GdnPrefillMath) {
    DEFAULT_MATH.store(choice_index(math), std::sync::atomic::Ordering::Relaxed);
}

/// Whether new scratches' TF32 prep runs session 52's lean form
/// ([`GdnPrefillScratch::set_prep_lean`]); on unless [`set_default_prep_lean`] turned it off.
static DEFAULT_PREP_LEAN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// The [`GdnPrefillScratch::set_prep_lean`] setting of every scratch created
/// afterwards (process-wide, as [`set_default_math`]; `calla cuda-bench | cuda-check
/// --gdn-prep-old`).
pub fn set_default_prep_lean(on: bool) {
    DEFAULT_PREP_LEAN.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether new scratches' lean TF32 prep runs its `Tm` products balanced over the warps
/// ([`GdnPrefillScratch::set_prep_balanced`]); on unless [`set_default_prep_balanced`] turned
/// it off (since session 56).
static DEFAULT_PREP_BALANCED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// The [`GdnPrefillScratch::set_prep_balanced`] setting of every scratch created afterwards
/// (process-wide, as [`set_default_math`]; `calla cuda-bench | cuda-check
/// --gdn-prep-unbalanced` turns it off).
pub fn set_default_prep_balanced(on: bool) {
    DEFAULT_PREP_BALANCED.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether new scratches normalize inside the state kernel ([`GdnPrefillScratch::set_fused_norm`]);
/// off unless [`set_default_fused_norm`] turned it on (measured slower, session 56:
/// [`GdnPrefillScratch::set_fused_norm`]).
static DEFAULT_FUSED_NORM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The [`GdnPrefillScratch::set_fused_norm`] setting of every scratch created afterwards
/// (process-wide, as [`set_default_math`]; `calla cuda-bench | cuda-check --gdn-fused-norm`).
pub fn set_default_fused_norm(on: bool) {
    DEFAULT_FUSED_NORM.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether new scratches' fused norm exchanges its partial sums through global memory
/// ([`GdnPrefillScratch::set_fused_norm_global`]); off unless [`set_default_fused_norm_global`]
/// turned it on.
static DEFAULT_FUSED_NORM_GLOBAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The [`GdnPrefillScratch::set_fused_norm_global`] setting of every scratch created afterwards
/// (process-wide; `calla cuda-bench | cuda-check --gdn-fused-norm-global`).
pub fn set_default_fused_norm_global(on: bool) {
    DEFAULT_FUSED_NORM_GLOBAL.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Device scratch of [`CudaContext::gdn_prefill`], sized for blocks of up to `max_t` tokens
/// (`Tp` = `max_t` rounded up to a multiple of 64): `q̂, k̂` `[n_k, Tp, d_k]`, `v`/`U` and `W`
/// `[n_v, Tp, d_v]`, `P` `[n_v, Tp/64, 64, 64]`, `g, β, γ` `[n_v, Tp]`, all f32
/// (14,432 floats ≈ 56 KiB per token of `max_t`; 451 MiB at 8192). One scratch serves every
/// layer.
pub struct GdnPrefillScratch {
    max_t: usize,
    math: GdnPrefillMath,
    prep_lean: bool,
    prep_balanced: bool,
    fused_norm: bool,
    fused_norm_global: bool,
    prep_ablate: i32,
    stages: u8,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    vu: CudaSlice<f32>,
    w: CudaSlice<f32>,
    p: CudaSlice<f32>,
    g: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    gam: CudaSlice<f32>,
    /// [`Self::set_fused_norm_global`]: the partial sums `[n_v][2][4][64]` (value | tag << 32)
    /// and the launch counter.
    nrm_gx: CudaSlice<u64>,
    nrm_ctr: CudaSlice<u32>,
}

impl GdnPrefillScratch {
    /// Largest block (tokens per call) this scratch holds.
    pub fn max_t(&self) -> usize {
        self.max_t
    }

    /// The product arithmetic in use ([`DEFAULT_MATH_CHOICE`] unless
    /// [`set_default_math`] chose another for new scratches, or [`Self::set_math`] since).
    pub fn math(&self) -> GdnPrefillMath {
        self.math
    }

    /// Selects the product arithmetic of later calls.
    pub fn set_math(&mut self, math: GdnPrefillMath) {
        self.math = math;
    }

    /// The TF32 prep kernel's form (`Tf32`, `Tf32Wg`, `Tf32WgC`; `F32` and `Tf32Old` ignore
    /// it). `on` (the default since session 52: `gdnp_prep_tf32`, or with
    /// [`Self::set_prep_balanced`], the default since session 56, `gdnp_prep_tf32b`): the
    /// operands of its four `Tm` products (`Tm_h`, `β V`, `β e^γ K̂`) are rounded to TF32 once,
    /// where they are stored in shared memory, and `A_h` and `P_h` are made in one pass that
    /// computes each decay factor `e^{γ_h[r] − γ_h[m]}` once for both. `off` (`gdnp_prep_tf32lx`, the measured twin, the
    /// form before): the operands are rounded at every load of an MMA fragment (a `cvt.rna` is
    /// about four instructions on sm_90) and A and P made by two groups of warps, each factor
    /// twice. The same values and expressions either way, so the same bits (self-test
    /// `gdnpre`).
    pub fn set_prep_lean(&mut self, on: bool) {
        self.prep_lean = on;
    }

    /// Whether [`Self::set_prep_lean`] is on.
    pub fn prep_lean(&self) -> bool {
        self.prep_lean
    }

    /// The lean TF32 prep's four `Tm` products (`U_h = Tm_h·β_h V_h`, `W_h = Tm_h·β_h e^γ K̂`,
    /// 64 × 64 lower-triangular times 64 × 128) with the warps' shares balanced. `on`
    /// (`gdnp_prep_tf32b`, session 54, the default since session 56): warp `w` takes the 16-row
    /// tiles `w & 1` and `3 − (w & 1)` (10 of the triangle's k-steps either way) and 32
    /// columns, a k-step's B fragments serving both tiles. `off` (`gdnp_prep_tf32`, the
    /// default before): warp `w` takes row tile `w & 3` and 64 columns, so row tile 3's warps
    /// do four times row tile 0's k-steps. Each output meets the same operands in the same
    /// k-step order either way, so the same bits (self-test `gdnpre` checks them word for
    /// word; it found them equal on an H100 in session 56). Measured there: the prep took 349
    /// against 384 µs per layer at 8k (−9%; 49 against 55 µs at 1k), the whole prefill
    /// 148.60 against 149.73 ms at 8k and 23.92 against 24.10 ms at 1k (`calla cuda-bench
    /// --prefill-compare`, `gdn_prep_balanced_ms`). Only with [`Self::set_prep_lean`] on.
    pub fn set_prep_balanced(&mut self, on: bool) {
        self.prep_balanced = on;
    }

    /// Whether [`Self::set_prep_balanced`] is on.
    pub fn prep_balanced(&self) -> bool {
        self.prep_balanced
    }

    /// The gated RMSNorm inside the state kernel, for [`CudaContext::gdn_prefill_acts`] with
    /// [`GdnPrefillMath::Tf32WgC`] (other arithmetics and [`CudaContext::gdn_prefill`] ignore
    /// it). `on` (`gdnp_state_tf32wgcn`, session 55, opt-in: measured slower): the four
    /// blocks of a V head run as a thread-block cluster; per chunk each block's odd warpgroups,
    /// which hold `O`, send the block's partial `Σo²` of every row to every block of the cluster
    /// (`st.async` into their shared memory, counted on an mbarrier), and one chunk later normalize the `O`
    /// they kept in registers and write `out_proj`'s bf16 activations; the even warpgroups turn
    /// the chunk's `z` into the gates `norm_w ⊙ SiLU(z)` while their chunk-update MMAs run. No
    /// `gdnp_norm_acts` launch, and no `O` written to and read back from `out` (2 × 4 bytes per
    /// output; `out` is left as it was). `off` (the default): the state kernel writes `O` and
    /// `gdnp_norm_acts` normalizes it. Both sum `Σo²` in one fixed order (a binary tree over the
    /// head's column pairs, `kernels/gdn_prefill.cu`), so the same bits (the self-test section
    /// `acts` checks them word for word; `gdnpre` times both).
    ///
    /// The launch is 32 clusters of four blocks, one block per SM (230 KB of shared memory
    /// each); where fewer fit on the GPU at once ([`CudaContext::gdn_fused_norm_clusters`]; its GPCs
    /// decide: the H200 of docs/CUDA.md holds 14 clusters of 8 such blocks, so likely 30 of 4),
    /// the last clusters run in a second wave and the kernel takes about twice as long (the
    /// results are the same); a default that turns the form on must check that first.
    ///
    /// Measured on an H100 (session 56, self-test `gdnpre`, one layer's state and norm): 30
    /// of the 32 clusters fit, and the layer took 1,734 µs at 8k against 1,078 µs with the
    /// norm kernel (+61%; +53% to +61% from 512 to 8k tokens); the whole 8k prefill took
    /// 164.80 against 149.73 ms (`calla cuda-bench --prefill-compare`, `gdn_fused_norm_ms`).
    pub fn set_fused_norm(&mut self, on: bool) {
        self.fused_norm = on;
    }

    /// With [`Self::set_fused_norm`]: the four blocks of a V head exchange their partial sums
    /// through global memory instead of a cluster (`gdnp_state_tf32wgcg`, session 55, opt-in:
    /// measured slower), for GPUs that hold fewer than `n_v` = 32 of the cluster form's
    /// clusters at once ([`CudaContext::gdn_fused_norm_clusters`]). Each partial travels in one 8-byte
    /// word with a tag of the launch and the chunk (no fence on either side; every block takes
    /// a ticket from a counter in this scratch to number the launch), and the readers poll L2
    /// until all eight words of their rows carry the chunk's tag: a round trip through L2 about
    /// one chunk ahead of its use, where the cluster's `st.async` goes between neighbouring
    /// SMs. A block's V head and column quarter come from its ticket too, so the four blocks
    /// that wait on each other are four that are running (four SMs suffice). The same bits as
    /// the cluster form and the norm kernel (self-test `acts`). Measured on an H100 (session
    /// 56): the layer's state and norm took 1,158 µs at 8k against 1,078 µs with the norm
    /// kernel (+7%; +7% to +9% from 512 to 8k tokens), and the whole prefill 149.75 against
    /// 149.73 ms at 8k and 24.47 against 24.10 ms at 1k: the exchange and the normalization
    /// inside the state kernel's chunk loop cost more than the norm kernel's launch and its
    /// reading back of `O`.
    pub fn set_fused_norm_global(&mut self, on: bool) {
        self.fused_norm_global = on;
    }

    /// Whether [`Self::set_fused_norm_global`] is on.
    pub fn fused_norm_global(&self) -> bool {
        self.fused_norm_global
    }

    /// Tests only: the tickets [`Self::set_fused_norm_global`]'s launches have taken from this
    /// scratch's counter (`n_v · 4` = 128 per launch; any other multiple means a block took
    /// none or two, and the epochs of later launches would disagree). Waits for `cx`'s stream.
    ///
    /// # Errors
    /// Driver errors of the copy.
    #[doc(hidden)]
    pub fn fused_norm_tickets(&self, cx: &CudaContext) -> Result<u32, CudaError> {
        Ok(cx.stream().clone_dtoh(&self.nrm_ctr)?[0])
    }

    /// Whether [`Self::set_fused_norm`] is on.
    pub fn fused_norm(&self) -> bool {
        self.fused_norm
    }

    /// Measurement only: the prep kernel leaves out the parts whose bits are set (1 the
    /// triangular solve, 2 the four `Tm` products, 4 the `A` and `P` element loops, 8 the Gram
    /// products), so that the time it saves is their cost in place. Any mask but 0 leaves the
    /// outputs wrong.
    #[doc(hidden)]
    pub fn set_prep_ablate(&mut self, mask: i32) {
        self.prep_ablate = mask;
    }

    /// Benchmarking only: launch just the stages whose bit is set (bit 0 conv, 1 prep,
    /// 2 state, 3 norm). Any other mask than `0b1111` leaves the outputs incomplete.
    #[doc(hidden)]
    pub fn set_stage_mask(&mut self, mask: u8) {
        self.stages = mask;
    }

    /// Diagnostics only: the scratch buffers by name (`q`, `k`, `vu`, `w`, `p`, `g`, `beta`,
    /// `gam`), laid out as in the type's docs with `Tp` = the last call's `T` rounded up to 64.
    #[doc(hidden)]
    pub fn buffers(&self) -> [(&'static str, &CudaSlice<f32>); 8] {
        [
            ("q", &self.q),
            ("k", &self.k),
            ("vu", &self.vu),
            ("w", &self.w),
            ("p", &self.p),
            ("g", &self.g),
            ("beta", &self.beta),
            ("gam", &self.gam),
        ]
    }
}

impl CudaContext {
    /// Scratch for [`Self::gdn_prefill`] calls of up to `max_t` tokens (see
    /// [`GdnPrefillScratch`] for the size). Also raises the dynamic shared-memory limit of the
    /// prefill kernels.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `max_t` is 0; [`CudaError::Driver`] when allocation fails.
    pub fn gdn_prefill_scratch(&self, max_t: usize) -> Result<GdnPrefillScratch, CudaError> {
        if max_t == 0 {
            return Err(CudaError::Unsupported("gdn_prefill_scratch: max_t = 0".into()));
        }
        for (name, bytes) in [
            ("gdnp_prep_f32", PREP_FLOATS * 4),
            ("gdnp_prep_tf32", PREP_FLOATS * 4),
            ("gdnp_prep_tf32b", PREP_FLOATS * 4),
            ("gdnp_prep_tf32lx", PREP_FLOATS * 4),
            ("gdnp_prep_tf32old", PREP_FLOATS * 4),
            ("gdnp_state_f32", GdnPrefillMath::F32.state_smem()),
            ("gdnp_state_tf32", GdnPrefillMath::Tf32.state_smem()),
            ("gdnp_state_tf32old", GdnPrefillMath::Tf32Old.state_smem()),
            ("gdnp_state_tf32wg", GdnPrefillMath::Tf32Wg.state_smem()),
            ("gdnp_state_tf32wgc", GdnPrefillMath::Tf32WgC.state_smem()),
            ("gdnp_state_tf32wgcn", FUSED_NORM_SMEM),
            ("gdnp_state_tf32wgcg", FUSED_NORM_SMEM),
        ] {
            self.func(name)?.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)?;
        }
        let tp = max_t.div_ceil(CH) * CH;
        let s = self.stream();
        Ok(GdnPrefillScratch {
            max_t,
            math: DEFAULT_CHOICES[DEFAULT_MATH.load(std::sync::atomic::Ordering::Relaxed) as usize % DEFAULT_CHOICES.len()],
            prep_lean: DEFAULT_PREP_LEAN.load(std::sync::atomic::Ordering::Relaxed),
            prep_balanced: DEFAULT_PREP_BALANCED.load(std::sync::atomic::Ordering::Relaxed),
            fused_norm: DEFAULT_FUSED_NORM.load(std::sync::atomic::Ordering::Relaxed),
            fused_norm_global: DEFAULT_FUSED_NORM_GLOBAL.load(std::sync::atomic::Ordering::Relaxed),
            prep_ablate: 0,
            stages: 0b1111,
            q: s.alloc_zeros(p::N_K_HEADS * tp * p::D_K)?,
            k: s.alloc_zeros(p::N_K_HEADS * tp * p::D_K)?,
            vu: s.alloc_zeros(p::N_V_HEADS * tp * p::D_V)?,
            w: s.alloc_zeros(p::N_V_HEADS * tp * p::D_K)?,
            p: s.alloc_zeros(p::N_V_HEADS * tp * CH)?,
            g: s.alloc_zeros(p::N_V_HEADS * tp)?,
            beta: s.alloc_zeros(p::N_V_HEADS * tp)?,
            gam: s.alloc_zeros(p::N_V_HEADS * tp)?,
            nrm_gx: s.alloc_zeros(p::N_V_HEADS * 2 * SPLIT * CH)?,
            nrm_ctr: s.alloc_zeros(1)?,
        })
    }

    /// How many clusters of `gdnp_state_tf32wgcn` ([`GdnPrefillScratch::set_fused_norm`]: four
    /// blocks of 512 threads and ~225 KiB of shared memory, one per SM) this GPU holds at once
    /// (`cuOccupancyMaxActiveClusters`; its GPCs decide). A prefill chunk launches `n_v` = 32
    /// of them; with fewer, the rest run in a second wave.
    ///
    /// # Errors
    /// Driver errors of the query or of raising the kernel's shared-memory limit.
    pub fn gdn_fused_norm_clusters(&self) -> Result<i32, CudaError> {
        self.func("gdnp_state_tf32wgcn")?
            .set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, FUSED_NORM_SMEM as i32)?;
        self.max_active_clusters("gdnp_state_tf32wgcn", (p::N_V_HEADS * SPLIT) as u32, 512, FUSED_NORM_SMEM as u32)
    }

    /// The Gated DeltaNet core of one layer for a block of `t` prompt tokens, chunked
    /// (docs/MODEL.md §3.5 steps 2-7, chunk 64) and the gated RMSNorm of step 8 (not
    /// `out_proj`), continuing from the conv state and GDN state of the tokens before the block.
    ///
    /// * `proj`: `[t, GDN_PROJ]`, per token `qkv (conv_dim) | z (n_v·d_v) | b (n_v) | a (n_v)`,
    ///   the stacked `in_proj` GEMM output.
    /// * `conv_w`: `[conv_dim, 4]` = `GdnWeights::conv1d` (tap 3 on the current token).
    /// * `a_neg_exp`: `[n_v]` = `-exp(A_log)`; `dt_bias`: `[n_v]`.
    /// * `norm_w`: `[d_v]` gated-norm weight, used as stored (no +1).
    /// * `conv_state`: `[3, conv_dim]` pre-conv rows, oldest first (= `LayerState::Gdn::conv`):
    ///   read as the rows before the block, then replaced by the last three rows of
    ///   `[conv_state ‖ qkv]`.
    /// * `s`: `[n_v, d_k, d_v]` f32 GDN state, row = key dim (= `LayerState::Gdn::s`), updated
    ///   to the state after the block.
    /// * `out`: `[t, n_v·d_v]`, token-major, head-major within a token:
    ///   `norm_w ⊙ o/rms(o) ⊙ SiLU(z)` per V head; V head `j` reads QK head `j / (n_v/n_k)`.
    ///
    /// Asynchronous on [`Self::stream`]; four launches (module docs). `t = 0` does nothing.
    /// Splitting a sequence into several calls gives the same result as one call up to fp32
    /// (or TF32) rounding.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `t > scratch.max_t()`, a length differs from the above or
    /// a buffer is not 16-byte aligned; [`CudaError::Driver`] when a launch fails.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_prefill(
        &self,
        proj: &CudaView<'_, f32>,
        t: usize,
        conv_w: &CudaView<'_, f32>,
        a_neg_exp: &CudaView<'_, f32>,
        dt_bias: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        conv_state: &mut CudaViewMut<'_, f32>,
        s: &mut CudaViewMut<'_, f32>,
        scratch: &mut GdnPrefillScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        self.gdn_prefill_into(proj, t, conv_w, a_neg_exp, dt_bias, norm_w, conv_state, s, scratch, out, None)
    }

    /// [`Self::gdn_prefill`] with the gated RMSNorm written only as the `out_proj` GEMM's bf16
    /// activations into `acts` (`[t, n_v·d_v]`, bit for bit `gdn_prefill` followed by
    /// [`Self::convert_acts`]; then [`Self::qgemm_converted`]). `out` receives the state
    /// kernel's un-normalised `o` (`[t, n_v·d_v]`, scratch for the caller): the norm reads it
    /// once and writes half the bytes, where `gdn_prefill` + `convert_acts` write it, read it
    /// and write it again. With [`GdnPrefillScratch::set_fused_norm`] (and the default
    /// arithmetic) the state kernel normalizes itself: three launches, the same activations,
    /// and `out` left as it was.
    ///
    /// # Errors
    /// As [`Self::gdn_prefill`]; [`CudaError::Unsupported`] when `t` exceeds `acts.max_t()`.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_prefill_acts(
        &self,
        proj: &CudaView<'_, f32>,
        t: usize,
        conv_w: &CudaView<'_, f32>,
        a_neg_exp: &CudaView<'_, f32>,
        dt_bias: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        conv_state: &mut CudaViewMut<'_, f32>,
        s: &mut CudaViewMut<'_, f32>,
        scratch: &mut GdnPrefillScratch,
        out: &mut CudaViewMut<'_, f32>,
        acts: &mut GemmScratch,
    ) -> Result<(), CudaError> {
        self.gdn_prefill_into(proj, t, conv_w, a_neg_exp, dt_bias, norm_w, conv_state, s, scratch, out, Some(acts))
    }

    #[allow(clippy::too_many_arguments)]
    fn gdn_prefill_into(
        &self,
        proj: &CudaView<'_, f32>,
        t: usize,
        conv_w: &CudaView<'_, f32>,
        a_neg_exp: &CudaView<'_, f32>,
        dt_bias: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        conv_state: &mut CudaViewMut<'_, f32>,
        s: &mut CudaViewMut<'_, f32>,
        scratch: &mut GdnPrefillScratch,
        out: &mut CudaViewMut<'_, f32>,
        acts: Option<&mut GemmScratch>,
    ) -> Result<(), CudaError> {
        if t > scratch.max_t {
            return Err(CudaError::Unsupported(format!(
                "gdn_prefill: {t} tokens, scratch holds {}",
                scratch.max_t
            )));
        }
        let checks = [
            ("proj", proj.len(), t * GDN_PROJ),
            ("conv_w", conv_w.len(), GDN_CONV_DIM * p::CONV_KERNEL),
            ("a_neg_exp", a_neg_exp.len(), p::N_V_HEADS),
            ("dt_bias", dt_bias.len(), p::N_V_HEADS),
            ("norm_w", norm_w.len(), p::D_V),
            ("conv_state", conv_state.len(), GDN_CONV_STATE_LEN),
            ("s", s.len(), GDN_STATE_LEN),
            ("out", out.len(), t * GDN_OUT),
        ];
        crate::gdn::check_lengths("gdn_prefill", &checks)?;
        if t == 0 {
            // nothing to do; the activations scratch holds nothing from this call
            if let Some(a) = acts {
                a.clear();
            }
            return Ok(());
        }
        // the activations' shape is checked before anything is queued
        let mut acts = acts;
        if let Some(a) = acts.as_deref_mut() {
            a.fill("gdn_prefill_acts", t, GDN_OUT)?;
        }
        let stream = self.stream();
        let aligned = [
            ("proj", proj.device_ptr(stream).0),
            ("conv_w", conv_w.device_ptr(stream).0),
            ("norm_w", norm_w.device_ptr(stream).0),
            ("conv_state", conv_state.device_ptr(stream).0),
            ("s", s.device_ptr(stream).0),
            ("out", out.device_ptr(stream).0),
        ];
        crate::gdn::check_aligned16("gdn_prefill", &aligned)?;
        let nc = t.div_ceil(CH);
        let tpad = nc * CH;
        let (t_i, tpad_i, nc_i) = (t as i32, tpad as i32, nc as i32);
        let math = scratch.math;
        // TF32: gdnp_conv stores q̂, k̂ TF32-rounded, as gdnp_prep_tf32 stores W and P, so the
        // tensor-core loads need no cvt (prep's β e^γ k̂ then scales the rounded k̂)
        let round_qk = i32::from(matches!(math, GdnPrefillMath::Tf32 | GdnPrefillMath::Tf32Wg | GdnPrefillMath::Tf32WgC));
        let stages = scratch.stages;
        // the gated norm inside the state kernel (set_fused_norm): the activations only
        let fused = acts.is_some() && scratch.fused_norm && math == GdnPrefillMath::Tf32WgC;
        let sc = scratch;

        if stages & 1 != 0 {
            let cs = conv_state.as_view();
            let cfg = LaunchConfig {
                grid_dim: ((tpad / 32) as u32, (2 * p::N_K_HEADS + p::N_V_HEADS) as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.kernel(self.func("gdnp_conv")?);
            b.ptr_mut(&mut sc.q)
                .ptr_mut(&mut sc.k)
                .ptr_mut(&mut sc.vu)
                .ptr_mut(&mut sc.g)
                .ptr_mut(&mut sc.beta)
                .ptr(proj)
                .ptr(&cs)
                .ptr(conv_w)
                .ptr(a_neg_exp)
                .ptr(dt_bias)
                .arg(&t_i)
                .arg(&tpad_i)
                .arg(&round_qk);
            // SAFETY: argument order and types match `gdnp_conv`; the scratch holds `tpad` rows.
            unsafe { b.launch(cfg) }?;
        }
        if stages & 2 != 0 {
            let cfg = LaunchConfig {
                grid_dim: (p::N_K_HEADS as u32, nc as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: (PREP_FLOATS * 4) as u32,
            };
            let mut b = self.kernel(self.func(math.prep(sc.prep_lean, sc.prep_balanced))?);
            b.ptr_mut(&mut sc.vu)
                .ptr_mut(&mut sc.w)
                .ptr_mut(&mut sc.p)
                .ptr_mut(&mut sc.gam)
                .ptr_mut(&mut *conv_state)
                .ptr(&sc.q)
                .ptr(&sc.k)
                .ptr(&sc.g)
                .ptr(&sc.beta)
                .ptr(proj)
                .arg(&t_i)
                .arg(&tpad_i)
                .arg(&nc_i)
                .arg(&sc.prep_ablate);
            // SAFETY: as above; the shared-memory size matches PB_FLOATS (the kernel checks).
            unsafe { b.launch(cfg) }?;
        }
        let fused_acts = if fused { acts.as_deref_mut() } else { None };
        if let (true, Some(a)) = (stages & 4 != 0, fused_acts) {
            // a cluster of the SPLIT blocks of each V head (the kernel's __cluster_dims__), or
            // the same grid without clusters exchanging through global memory
            let cfg = LaunchConfig {
                grid_dim: ((p::N_V_HEADS * SPLIT) as u32, 1, 1),
                block_dim: (math.state_threads(), 1, 1),
                shared_mem_bytes: FUSED_NORM_SMEM as u32,
            };
            let global = sc.fused_norm_global;
            {
                let xb = a.fill("gdn_prefill_acts", t, GDN_OUT)?;
                let mut b = self.kernel(self.func(if global { "gdnp_state_tf32wgcg" } else { "gdnp_state_tf32wgcn" })?);
                b.ptr_mut(xb)
                    .ptr_mut(&mut *s)
                    .ptr(&sc.q)
                    .ptr(&sc.k)
                    .ptr(&sc.vu)
                    .ptr(&sc.w)
                    .ptr(&sc.p)
                    .ptr(&sc.gam)
                    .ptr(proj)
                    .ptr(norm_w);
                if global {
                    b.ptr_mut(&mut sc.nrm_gx).ptr_mut(&mut sc.nrm_ctr);
                }
                b.arg(&t_i).arg(&tpad_i).arg(&nc_i);
                // SAFETY: argument order and types match `gdnp_state_tf32wgcn` (`_wgcg`: with
                // the exchange words and the launch counter before T); the activations
                // scratch has room for t·GDN_OUT bf16 (checked by `fill`), the shared-memory
                // size matches the kernel's (it checks), the grid is whole clusters.
                unsafe { b.launch(cfg) }?;
            }
            a.filled(t, GDN_OUT);
        } else if stages & 4 != 0 {
            let cfg = LaunchConfig {
                grid_dim: ((p::N_V_HEADS * SPLIT) as u32, 1, 1),
                block_dim: (math.state_threads(), 1, 1),
                shared_mem_bytes: math.state_smem() as u32,
            };
            let mut b = self.kernel(self.func(math.state())?);
            b.ptr_mut(&mut *out)
                .ptr_mut(&mut *s)
                .ptr(&sc.q)
                .ptr(&sc.k)
                .ptr(&sc.vu)
                .ptr(&sc.w)
                .ptr(&sc.p)
                .ptr(&sc.gam)
                .arg(&t_i)
                .arg(&tpad_i)
                .arg(&nc_i);
            // SAFETY: as above; the shared-memory size matches SC_FLOATS (the kernel checks).
            unsafe { b.launch(cfg) }?;
        }
        if stages & 8 != 0 && !fused {
            let warps = t * p::N_V_HEADS;
            let cfg = LaunchConfig {
                grid_dim: (warps.div_ceil(8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            match acts {
                Some(a) => {
                    let f = self.func("gdnp_norm_acts")?;
                    {
                        let xb = a.fill("gdn_prefill_acts", t, GDN_OUT)?;
                        let mut b = self.kernel(f);
                        let o = out.as_view();
                        b.ptr(xb).ptr(&o).ptr(proj).ptr(norm_w).arg(&t_i);
                        // SAFETY: argument order and types match `gdnp_norm_acts`; the scratch
                        // has room for t·GDN_OUT bf16 (checked by `fill`).
                        unsafe { b.launch(cfg) }?;
                    }
                    a.filled(t, GDN_OUT);
                }
                None => {
                    let mut b = self.kernel(self.func("gdnp_norm")?);
                    b.ptr_mut(&mut *out).ptr(proj).ptr(norm_w).arg(&t_i);
                    // SAFETY: argument order and types match `gdnp_norm`.
                    unsafe { b.launch(cfg) }?;
                }
            }
        }
        Ok(())
    }
}
