//! CUDA backend for Hopper (`sm_90a`): kernels in CUDA C++ (`kernels/*.cu`), compiled at first
//! use with NVRTC into cubins (cached on disk), launched through `cudarc`.
//!
//! * [`dims_header`]: the model's dimensions as `#define`s, generated from
//!   [`spec::production`] — the one place they live — and prepended to every kernel source.
//! * [`nvrtc`]: loading `libnvrtc`, compiling a source to a cubin, the on-disk cache. Needs no
//!   GPU and no driver: CI compiles every kernel with it (`tests/compile.rs`).
//! * [`CudaContext`]: a device context with the kernels loaded; [`DeviceQMat`] (a quantized
//!   matrix on the device), [`CudaContext::gemv`], [`CudaContext::gemv_residual`],
//!   [`CudaContext::rms_norm`]; [`step`]: embedding gather, greedy argmax, position advance.
//!
//! See `docs/CUDA.md` for how to build, test and benchmark.

pub mod accel;
pub mod attention;
pub mod attn_prefill;
pub mod gdn;
pub mod gemm;
pub mod gdn_prefill;
pub mod moe;
pub mod decode;
pub mod follow;
pub mod graph;
pub mod launch;
pub mod nvrtc;
pub mod prefill;
pub mod sample;
pub mod step;
pub mod timeline;

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use quant::{Bits, QMatRef};
use spec::production as p;

pub use cudarc;

/// The GPU architecture every kernel is built for (H100/H200, with the Hopper-only
/// instructions: wgmma, TMA, setmaxnreg).
pub const ARCH: &str = "sm_90a";

/// Whether the attention decode step's combine kernel triggers the next launch at its entry by
/// default ([`CudaContext::set_attn_combine_early_trigger`]): measured ~1% faster per decode
/// step at context 128 on the H200 (`cuda-bench --compare`, session 18).
pub const ATTN_COMBINE_EARLY_TRIGGER: bool = true;

/// Whether the attention decode step's split kernel triggers the next launch before its PDL
/// wait by default ([`CudaContext::set_attn_split_early_trigger`]).
pub const ATTN_SPLIT_EARLY_TRIGGER: bool = false;

/// Whether the kernels that run right before a decode-step GEMV ([`CudaContext::BEFORE_GEMV`])
/// ask for the largest shared-memory carve-out by default ([`CudaContext::set_carveout_of`]).
/// With the slim output projection ([`OutProjVariant::Cap88Stages3`], the default) measured
/// 8-14 µs per decode step faster at context 128 on the H200 than the driver's carve-out and
/// the wide output projection, in four processes (`cuda-bench --out-proj-compare`, session
/// 20); with the wide one it measured slower (sessions 11 and 20). The MoE cluster kernel
/// (before the next input projection) is not in [`CudaContext::BEFORE_GEMV`] and keeps the
/// driver's choice.
pub const CARVEOUT_BEFORE_GEMV: bool = true;

/// The decode step's 4-bit output projection with the router fold by default
/// ([`CudaContext::set_out_proj_variant`]; session 20, see [`CARVEOUT_BEFORE_GEMV`]).
pub const OUT_PROJ_VARIANT: OutProjVariant = OutProjVariant::Cap88Stages3;

/// Group size of the MLX affine quantization the kernels are built for (the published
/// `mlx-community` 4-bit and 8-bit checkpoints use 64).
pub const QUANT_GROUP: usize = 64;

/// One kernel source file: its name and CUDA C++ text (without the dims header).
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File stem, also the NVRTC program name and the cache-file prefix.
    pub name: &'static str,
    /// CUDA C++ source.
    pub src: &'static str,
    /// `extern "C"` entry points it defines.
    pub entries: &'static [&'static str],
}

/// Every kernel source of the crate. CI compiles each of them for [`ARCH`].
pub const KERNELS: &[KernelSource] = &[
    KernelSource {
        name: "prefill",
        src: include_str!("../kernels/prefill.cu"),
        entries: &["embed_rows_q4", "embed_rows_q8", "router_f32_q4", "router_f32_q8", "router_f32w_q4", "router_f32w_q8",
            "router_dg_q4_p4", "router_dg_q8_p4", "router_dg_q4_p8", "router_dg_q8_p8", "router_dg_q4_p4_k2",
            "router_dg_q4_p4_k4", "router_dg_q4_p4_k8", "router_dg_q8_p4_k2", "router_dg_q8_p4_k4", "router_dg_q8_p4_k8"],
    },
    KernelSource {
        name: "gemv",
        src: include_str!("../kernels/gemv.cu"),
        entries: &[
            "gemv_q4_k512",
            "gemv_q8_k512",
            "gemv_q4_k2048",
            "gemv_q8_k2048",
            "gemv_q4_k4096",
            "gemv_q8_k4096",
            "gemv_resid_q4_k512",
            "gemv_resid_q8_k512",
            "gemv_resid_q4_k2048",
            "gemv_resid_q8_k2048",
            "gemv_resid_q4_k4096",
            "gemv_resid_q8_k4096",
            "gemv_norm_q4_k2048",
            "gemv_norm_q8_k2048",
            "gemv_norm_r56_q4_k2048",
            "gemv_norm_r56_q8_k2048",
            "gemv_norm_r56_s4_k2048",
            "gemv_norm_xd_q4_k2048",
            "gemv_norm_xd_q8_k2048",
            "gemv_norm_r56_xd_q4_k2048",
            "gemv_norm_r56_xd_q8_k2048",
            "gemv_resid_rf_r4_g4_q4_k4096",
            "gemv_resid_rf_r4_g8_q4_k4096",
            "gemv_resid_rf_r8_g4_q4_k4096",
            "gemv_resid_rf_r8_g8_q4_k4096",
            "gemv_resid_rf_r4_g4_q8_k4096",
            "gemv_resid_rf_r4_g8_q8_k4096",
            "gemv_resid_rf_r8_g4_q8_k4096",
            "gemv_resid_rf_r8_g8_q8_k4096",
            "gemv_resid_rf_r4_g4_s4_k4096",
            "gemv_resid_rf_r4_g8_s4_k4096",
            "gemv_resid_rf_r8_g4_s4_k4096",
            "gemv_resid_rf_r8_g8_s4_k4096",
            "gemv_resid_rf_c88_r4_g4_q4_k4096",
            "gemv_resid_rf_c88_r4_g8_q4_k4096",
            "gemv_resid_rf_c88_r8_g4_q4_k4096",
            "gemv_resid_rf_c88_r8_g8_q4_k4096",
            "gemv_resid_rf_c88s3_r4_g4_q4_k4096",
            "gemv_resid_rf_c88s3_r4_g8_q4_k4096",
            "gemv_resid_rf_c88s3_r8_g4_q4_k4096",
            "gemv_resid_rf_c88s3_r8_g8_q4_k4096",
            "gemv_chain_q4",
        ],
    },
    KernelSource {
        name: "step",
        src: include_str!("../kernels/step.cu"),
        entries: &["embed_gather_q4", "embed_gather_q8", "argmax_step", "advance_pos", "l2_follow"],
    },
    KernelSource {
        name: "stream",
        src: include_str!("../kernels/stream.cu"),
        entries: &["stream_bulk", "stream_bulk_cl8", "stream_thread"],
    },
    KernelSource {
        name: "sample",
        src: include_str!("../kernels/sample.cu"),
        entries: &["sample_prep", "sample_weights", "sample_select", "sample_draw"],
    },
    KernelSource {
        name: "gemm",
        src: include_str!("../kernels/gemm.cu"),
        entries: &[
            "qgemm_q4_big_wg",
            "qgemm_q4_tall_wg",
            "qgemm_q4_small_wg",
            "qgemm_q8_big_wg",
            "qgemm_q8_tall_wg",
            "qgemm_q8_small_wg",
            "qgemm_q4_big_mma",
            "qgemm_q4_tall_mma",
            "qgemm_q4_small_mma",
            "qgemm_q8_big_mma",
            "qgemm_q8_tall_mma",
            "qgemm_q8_small_mma",
            "qgemm_q4_narrow_wg",
            "qgemm_q8_narrow_wg",
            "qgemm_q4_narrow_mma",
            "qgemm_q8_narrow_mma",
            "qgemm_q4_big_ln",
            "qgemm_q4_tall_ln",
            "qgemm_q4_narrow_ln",
            "qgemm_q4_small_ln",
            "qgemm_q8_small_ln",
            "qgemm_q8_big_ln",
            "qgemm_q8_tall_ln",
            "qgemm_q8_narrow_ln",
            "qgemm_q4_narrow_ln3",
            "qgemm_q4_small_ln3",
            "qgemm_q4_big_lb",
            "qgemm_q4_tall_lb",
            "qgemm_q4_small_lb",
            "qgemm_q4_narrow_lb",
            "qgemm_q8_big_lb",
            "qgemm_q8_tall_lb",
            "qgemm_q8_small_lb",
            "qgemm_q8_narrow_lb",
            "qgemm_q4_narrow_lb3",
            "qgemm_q4_small_lb3",
            "qgemm_q4_tall_ws",
            "qgemm_q4_narrow_ws",
            "qgemm_q4_wide_wg",
            "qgemm_q8_wide_wg",
            "qgemm_q4_wide_ln",
            "qgemm_q8_wide_ln",
            "qgemm_q4_wide_lb",
            "qgemm_q8_wide_lb",
            "qgemm_q4_mid_wg",
            "qgemm_q8_mid_wg",
            "qgemm_q4_mid_ln",
            "qgemm_q8_mid_ln",
            "qgemm_q4_mid_lb",
            "qgemm_q8_mid_lb",
            "qgemm_bf_wide",
            "qgemm_bf_big",
            "qgemm_x_to_bf16",
            "qmat_bf16_perm",
            "qmat_group_major",
            "qmat_pack_group_major",
            "qgemm_moe_route",
            "qgemm_moe_hist",
            "qgemm_moe_scan",
            "qgemm_moe_route_hist",
            "qgemm_splitk_reduce",
            "qgemm_moe_place",
            "qgemm_moe_combine",
            "qgemm_moe_combine_b16",
        ],
    },
    KernelSource {
        name: "rms_norm",
        src: include_str!("../kernels/rms_norm.cu"),
        entries: &["rms_norm_d_model", "rms_norm_acts_d_model", "moe_combine_norm_acts", "moe_combine_norm_acts_b16"],
    },
    KernelSource {
        name: "gdn",
        src: include_str!("../kernels/gdn.cu"),
        entries: &[
            "gdn_decode_step",
            "gdn_in_step_q4",
            "gdn_in_step_q8",
            "gdn_step_out_r4_g4",
            "gdn_step_out_r4_g8",
            "gdn_step_out_r8_g4",
            "gdn_step_out_r8_g8",
            "gdn_diag_null_cluster",
            "gdn_diag_null",
        ],
    },
    KernelSource {
        name: "gdn_prefill",
        src: include_str!("../kernels/gdn_prefill.cu"),
        entries: &["gdnp_conv", "gdnp_prep_f32", "gdnp_prep_tf32", "gdnp_prep_tf32b", "gdnp_prep_tf32lx", "gdnp_state_f32", "gdnp_state_tf32", "gdnp_norm", "gdnp_norm_acts", "gdnp_prep_tf32old", "gdnp_state_tf32old", "gdnp_state_tf32wg", "gdnp_state_tf32wgc", "gdnp_state_tf32wgcn", "gdnp_state_tf32wgcg"],
    },
    KernelSource {
        name: "attention",
        src: include_str!("../kernels/attention.cu"),
        entries: &["attn_decode_split", "attn_decode_combine"],
    },
    KernelSource {
        name: "attn_prefill",
        src: include_str!("../kernels/attn_prefill.cu"),
        entries: &[
            "attn_prefill_prep",
            "attn_prefill_flash_q64",
            "attn_prefill_flash_q128",
            "attn_prefill_flash_wg64",
            "attn_prefill_flash_wg128",
            "attn_prefill_flash_wg64_acts",
            "attn_prefill_flash_wg128_acts",
            "attn_prefill_flash_wg128ws",
            "attn_prefill_flash_wg128ws_acts",
            "attn_prefill_flash_wg128tma",
            "attn_prefill_flash_wg128tma_acts",
            "attn_prefill_flash_wg128mc",
            "attn_prefill_flash_wg128mc_acts",
            "attn_prefill_flash_wg64_split",
            "attn_prefill_combine",
            "attn_prefill_combine_acts",
            "attn_prefill_wgmma_probe",
        ],
    },
    KernelSource {
        name: "moe",
        src: include_str!("../kernels/moe.cu"),
        entries: &[
            "moe_router_r4_g4",
            "moe_router_r4_g8",
            "moe_router_r8_g4",
            "moe_router_r8_g8",
            "moe_gate_up_e4_s4",
            "moe_gate_up_e4_s8",
            "moe_gate_up_e8_s4",
            "moe_gate_up_e8_s8",
            "moe_gate_up_fold_e4_s4",
            "moe_gate_up_fold_e4_s8",
            "moe_gate_up_fold_e8_s4",
            "moe_gate_up_fold_e8_s8",
            "moe_down_e4_s4",
            "moe_down_e4_s8",
            "moe_down_e8_s4",
            "moe_down_e8_s8",
            "moe_down_r48_e4_s4",
            "moe_down_r48_e4_s8",
            "moe_down_r48_e8_s4",
            "moe_down_r48_e8_s8",
            "moe_down_fold_e4_s4",
            "moe_down_fold_e4_s8",
            "moe_down_fold_e8_s4",
            "moe_down_fold_e8_s8",
            "moe_fused_r4_e4",
            "moe_fused_r4_e8",
            "moe_fused_r8_e4",
            "moe_fused_r8_e8",
            "moe_cluster_e4",
            "moe_cluster_fold_e4",
            "moe_cluster_split_e4",
            "moe_grid_barrier_probe",
            "moe_flag_barrier_probe",
        ],
    },
];

/// The model's dimensions as C preprocessor definitions, generated from
/// [`spec::production`]. Prepended to every kernel source, so a kernel never spells a
/// dimension itself.
pub fn dims_header() -> String {
    let defs: &[(&str, String)] = &[
        ("CALLA_D_MODEL", p::D_MODEL.to_string()),
        ("CALLA_N_LAYERS", p::N_LAYERS.to_string()),
        ("CALLA_VOCAB", p::VOCAB.to_string()),
        ("CALLA_N_Q_HEADS", p::N_Q_HEADS.to_string()),
        ("CALLA_N_KV_HEADS", p::N_KV_HEADS.to_string()),
        ("CALLA_HEAD_DIM", p::HEAD_DIM.to_string()),
        ("CALLA_ROTARY_DIM", p::ROTARY_DIM.to_string()),
        ("CALLA_N_K_HEADS", p::N_K_HEADS.to_string()),
        ("CALLA_N_V_HEADS", p::N_V_HEADS.to_string()),
        ("CALLA_D_K", p::D_K.to_string()),
        ("CALLA_D_V", p::D_V.to_string()),
        ("CALLA_CONV_KERNEL", p::CONV_KERNEL.to_string()),
        ("CALLA_N_EXPERTS", p::N_EXPERTS.to_string()),
        ("CALLA_TOP_K", p::TOP_K.to_string()),
        ("CALLA_D_EXPERT", p::D_EXPERT.to_string()),
        ("CALLA_D_SHARED_EXPERT", p::D_SHARED_EXPERT.to_string()),
        // width of the attention output / GDN output (input of o_proj / out_proj)
        ("CALLA_ATTN_OUT", (p::N_Q_HEADS * p::HEAD_DIM).to_string()),
        ("CALLA_GDN_OUT", (p::N_V_HEADS * p::D_V).to_string()),
        // the stacked GDN in_proj layout (kernels/prelude.cuh checks its own against these)
        ("CALLA_GDN_CONV_DIM", gdn::GDN_CONV_DIM.to_string()),
        ("CALLA_GDN_PROJ", gdn::GDN_PROJ.to_string()),
        ("CALLA_RMS_EPS", format!("{:e}f", p::RMS_EPS)),
        ("CALLA_QUANT_GROUP", QUANT_GROUP.to_string()),
    ];
    let mut s = String::from(
        "// generated by crates/cuda dims_header() from spec::production\n#pragma once\n",
    );
    for (k, v) in defs {
        s.push_str(&format!("#define {k} {v}\n"));
    }
    s
}

/// Device helpers every kernel file may use (PDL wait/trigger, bf16 conversion, warp
/// reductions): `kernels/prelude.cuh`.
pub const PRELUDE: &str = include_str!("../kernels/prelude.cuh");

/// Quantized 16 × 64 tile products on the integer tensor cores and the activation digits
/// (`kernels/qtile.cuh`, namespace `calla_qt`), shared by the MoE kernels and the fused GDN
/// input projection; prepended to every kernel file after [`PRELUDE`].
pub const QTILE: &str = include_str!("../kernels/qtile.cuh");

/// Full NVRTC source of a kernel file: the dims header, the prelude, the tile helpers, then the
/// file.
pub fn full_source(k: &KernelSource) -> String {
    full_source_with(k, timeline::enabled())
}

/// [`full_source`] with or without the timeline probe (`CALLA_TIMELINE`, see [`timeline`]).
pub fn full_source_with(k: &KernelSource, timeline: bool) -> String {
    format!(
        "{}{}#line 1 \"prelude.cuh\"\n{}\n#line 1 \"qtile.cuh\"\n{}\n#line 1 \"{}.cu\"\n{}",
        dims_header(),
        if timeline { "#define CALLA_TIMELINE 1\n" } else { "" },
        PRELUDE,
        QTILE,
        k.name,
        k.src
    )
}

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// NVRTC could not be loaded or a kernel did not compile.
    #[error("nvrtc: {0}")]
    Nvrtc(String),
    /// A CUDA driver call failed.
    #[error("cuda driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// Shapes or arguments that the kernels do not support.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// A quantized matrix `[rows, cols]` in device memory, MLX layout (see `quant::QMatRef`)
/// unless [`Self::codes_group_major`] says the codes were regrouped for the prefill GEMMs.
/// Scales and biases are kept as raw bf16 bits.
pub struct DeviceQMat {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Bits per code (4 or 8).
    pub bits: Bits,
    /// Packed codes, `rows * cols * bits / 32` words.
    pub packed: CudaSlice<u32>,
    /// bf16 bits, `rows * cols / 64`.
    pub scales: CudaSlice<u16>,
    /// bf16 bits, `rows * cols / 64`.
    pub biases: CudaSlice<u16>,
    /// The same weights in the staged layout of the decode GEMVs' bulk copies
    /// ([`CudaContext::stage_qmat`]), or `None`.
    pub staged: Option<CudaSlice<u32>>,
    /// The scales and biases again, group-major for the prefill GEMMs (`kernels/gemm.cu`):
    /// `[rows * cols/64]` u32, word `g * rows + r` = scale `[r, g]` (low half) | bias `[r, g]`
    /// (high half), so one group's rows are contiguous. `None` until
    /// [`CudaContext::add_group_major`]; the GEMMs read the MLX layout without it.
    pub group_major: Option<CudaSlice<u32>>,
    /// The packed codes again, group-major for the prefill GEMMs: `[cols/64, rows, 2·bits]`
    /// u32, row `r`'s words of group `g` at `(g · rows + r) · 2·bits`, so one K tile's rows are
    /// contiguous. `None` until [`CudaContext::add_group_major_codes`]; the GEMMs read them only
    /// together with [`Self::group_major`].
    pub group_major_codes: Option<CudaSlice<u32>>,
    /// `true` when `packed` itself holds the codes group-major (the layout of
    /// [`Self::group_major_codes`]; [`CudaContext::regroup_codes`]): only the prefill GEMMs read
    /// such a matrix (with [`Self::group_major`]); the GEMVs, the routers and the embedding
    /// gathers refuse it ([`Self::mlx_codes`]). For the prefill's own copies of the experts, so
    /// that the faster layout costs no memory.
    pub codes_group_major: bool,
    /// The weights dequantized to bf16 for the prefill's dense products on the wide and big
    /// tiles ([`CudaContext::add_bf16_weights`], read when
    /// [`CudaContext::set_gemm_bf16_weights`] is on): `[cols/64, rows, 32]` u32, two bf16 each,
    /// group `g`'s row `r` at words `(g · rows + r) · 32`, within a row the 64 values in the
    /// GEMM kernels' permuted column order (`kernels/gemm.cu`, `qmat_bf16_perm`): `rows · cols · 2`
    /// bytes, four times 4-bit codes', twice 8-bit ones'. `None` unless added.
    pub bf16: Option<CudaSlice<u32>>,
}

impl DeviceQMat {
    /// The packed codes in the MLX layout, for the kernels that read that layout.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `packed` holds the codes group-major
    /// ([`Self::codes_group_major`]).
    pub fn mlx_codes(&self) -> Result<&CudaSlice<u32>, CudaError> {
        if self.codes_group_major {
            return Err(CudaError::Unsupported(format!(
                "a [{}, {}] matrix whose codes are group-major (a prefill GEMM copy) given to a kernel that reads the MLX layout",
                self.rows, self.cols
            )));
        }
        Ok(&self.packed)
    }

    /// Bytes the GEMV must read from memory: packed codes, scales and biases.
    pub fn stored_bytes(&self) -> usize {
        self.packed.len() * 4 + (self.scales.len() + self.biases.len()) * 2
    }

    /// The packed codes, scales and biases as device regions `(address, bytes)`, in that order
    /// (for L2 prefetch hints: [`L2Prefetch`], [`crate::follow`]).
    pub(crate) fn regions(&self, st: &CudaStream) -> [(u64, usize); 3] {
        [
            (self.packed.device_ptr(st).0, self.packed.len() * 4),
            (self.scales.device_ptr(st).0, self.scales.len() * 2),
            (self.biases.device_ptr(st).0, self.biases.len() * 2),
        ]
    }

    /// Rows `rows` of [`Self::regions`] (their codes, scales and biases); `None` when the
    /// matrix is group-major (a row is not one run then) or the range is empty or out of
    /// bounds.
    pub(crate) fn row_regions(&self, st: &CudaStream, rows: std::ops::Range<usize>) -> Option<[(u64, usize); 3]> {
        if self.codes_group_major || rows.is_empty() || rows.end > self.rows {
            return None;
        }
        let n = rows.end - rows.start;
        Some(self.regions(st).map(|(ptr, bytes)| {
            let per_row = bytes / self.rows;
            (ptr + (rows.start * per_row) as u64, n * per_row)
        }))
    }
}

/// L2 prefetch hints handed to a kernel: up to four regions of device memory that a later
/// kernel of the step reads (`CallaL2Prefetch` in `kernels/prelude.cuh`, same layout). The
/// kernel's blocks split each region and ask L2 for it with `cp.async.bulk.prefetch.L2` before
/// their PDL wait, so weights stream in while a latency-bound kernel (router, GDN step, split
/// attention) leaves DRAM idle. Only a hint: results never depend on it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct L2Prefetch {
    ptr: [u64; 4],
    bytes: [u64; 4],
    /// Device address of the L2 follower's progress word (0: none), which the mixer kernels
    /// (GDN step, split attention) bump once their input has arrived, and with the follower's
    /// `in-late` part the MoE cluster kernel after the router fold once per block as its
    /// expert tiles land ([`crate::follow`]).
    pub(crate) progress: u64,
}

// SAFETY: plain old data with the C layout of CallaL2Prefetch (4 pointers, 4 u64, a pointer).
unsafe impl cudarc::driver::DeviceRepr for L2Prefetch {}

impl L2Prefetch {
    /// Regions in use.
    pub fn len(&self) -> usize {
        self.bytes.iter().filter(|&&b| b > 0).count()
    }

    /// No region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds `bytes` at device address `ptr` (16-byte aligned; the size is rounded down to a
    /// multiple of 16). Returns `false`, adding nothing, when all four slots are taken.
    pub fn push(&mut self, ptr: u64, bytes: usize) -> bool {
        match self.bytes.iter().position(|&b| b == 0) {
            Some(i) if bytes >= 16 => {
                self.ptr[i] = ptr;
                self.bytes[i] = bytes as u64;
                true
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Adds a quantized matrix (codes, scales, biases: three regions); `false` when they do
    /// not all fit or the codes are group-major ([`DeviceQMat::codes_group_major`]; then none
    /// is added).
    pub fn push_qmat(&mut self, cx: &CudaContext, m: &DeviceQMat) -> bool {
        if 4 - self.len() < 3 || m.codes_group_major {
            return false;
        }
        for (ptr, bytes) in m.regions(cx.stream()) {
            self.push(ptr, bytes);
        }
        true
    }

    /// Adds rows `rows` of a matrix in the MLX layout (their codes, scales and biases: three
    /// regions); `false`, adding nothing, when fewer than three slots are free, the matrix is
    /// group-major or the range is empty or out of bounds.
    pub fn push_qmat_rows(&mut self, cx: &CudaContext, m: &DeviceQMat, rows: std::ops::Range<usize>) -> bool {
        match m.row_regions(cx.stream(), rows) {
            Some(regions) if 4 - self.len() >= 3 => {
                for (ptr, bytes) in regions {
                    self.push(ptr, bytes);
                }
                true
            }
            _ => false,
        }
    }
}

/// A CUDA context on one device with every kernel of [`KERNELS`] loaded, and one stream that
/// all its launches go to (in order). A [`CudaContext::sibling`] has a stream of its own.
pub struct CudaContext {
    ctx: Arc<cudarc::driver::CudaContext>,
    stream: Arc<CudaStream>,
    gemv: [[Option<CudaFunction>; 3]; 2], // [bits 4|8][k 512|2048|4096]
    gemv_resid: [[Option<CudaFunction>; 3]; 2],
    gemv_norm: [Option<CudaFunction>; 2], // [bits 4|8], K = D_MODEL
    gemv_norm_r56: [Option<CudaFunction>; 2], // the same, at most 56 registers per thread
    /// Use `gemv_norm_r56` (see `kernels/gemv.cu`; the default, measured faster in the decode
    /// step); set by [`Self::set_gemv_reg_cap`].
    gemv_reg_cap: std::sync::atomic::AtomicBool,
    /// Every GEMV triggers its dependents right after its PDL wait (`GEMV_EARLY_TRIGGER` in
    /// `kernels/gemv.cu`); set by [`Self::set_gemv_early_trigger`].
    gemv_early_trigger: std::sync::atomic::AtomicBool,
    /// `attn_decode_combine` triggers its dependent launch at entry; set by
    /// [`Self::set_attn_combine_early_trigger`].
    attn_combine_early_trigger: std::sync::atomic::AtomicBool,
    /// `attn_decode_split` triggers its dependent launch before its PDL wait; set by
    /// [`Self::set_attn_split_early_trigger`].
    attn_split_early_trigger: std::sync::atomic::AtomicBool,
    /// Decode GEMVs read a matrix's staged copy by bulk copies when it has one
    /// ([`CudaContext::set_gemv_staged`]).
    gemv_staged: std::sync::atomic::AtomicBool,
    /// Staged GEMVs request every stage before the PDL wait ([`CudaContext::set_gemv_staged_all_early`]).
    gemv_staged_all_early: std::sync::atomic::AtomicBool,
    /// Staged GEMVs whose warps walk one unit request it by one bulk copy ([`CudaContext::set_gemv_staged_unit`]).
    gemv_staged_unit: std::sync::atomic::AtomicBool,
    /// The input projections request no weights before their PDL wait ([`CudaContext::set_in_proj_late_weights`]).
    in_proj_late_weights: std::sync::atomic::AtomicBool,
    /// The MoE cluster kernel (after the fold) triggers the next launch once its expert tiles
    /// are here ([`CudaContext::set_moe_cluster_late_trigger`]).
    pub(crate) moe_cluster_late_trigger: std::sync::atomic::AtomicBool,
    /// The MoE cluster kernel's timeline mark is when its copies are issued
    /// ([`CudaContext::set_moe_cluster_mark_issue`]).
    pub(crate) moe_cluster_mark_issue: std::sync::atomic::AtomicBool,
    /// The MoE cluster kernel streams fixed experts' tiles, for measurement
    /// ([`CudaContext::set_moe_cluster_pin_experts`]).
    pub(crate) moe_cluster_pin_experts: std::sync::atomic::AtomicBool,
    /// The MoE cluster kernel after the fold combines by f64 atomics ([`CudaContext::set_moe_hsum`]).
    pub(crate) moe_hsum: std::sync::atomic::AtomicBool,
    /// Measurement-only `flags` bits ORed into every decode GEMV's and every MoE cluster
    /// kernel's launch, packed `moe << 16 | gemv` ([`CudaContext::set_decode_diag`]).
    pub(crate) decode_diag: std::sync::atomic::AtomicU32,
    /// The input projections' launch forced to `(ks_log2, blocks)`, packed as
    /// `ks_log2 << 32 | blocks` (0: the default of `gemv_launch`); set by
    /// [`CudaContext::set_in_proj_grid`].
    in_proj_grid: std::sync::atomic::AtomicU64,
    /// Which entry point runs the 4-bit output projections with the router fold
    /// ([`OutProjVariant`] as `u8`); set by [`CudaContext::set_out_proj_variant`].
    pub(crate) out_proj_variant: std::sync::atomic::AtomicU8,
    /// Unused dynamic shared memory (bytes) each GDN decode step block asks for; set by
    /// [`CudaContext::set_gdn_step_smem_pad`].
    pub(crate) gdn_step_smem_pad: std::sync::atomic::AtomicU32,
    /// [`CudaContext::set_gdn_out_flags`].
    pub(crate) gdn_out_flags: std::sync::atomic::AtomicU32,
    /// The GDN decode step triggers its dependent launch at entry; set by
    /// [`CudaContext::set_gdn_step_early_trigger`].
    pub(crate) gdn_step_early_trigger: std::sync::atomic::AtomicBool,
    /// The prefill GEMMs read a matrix's group-major scales and biases when it has them
    /// ([`CudaContext::set_gemm_group_major`]).
    pub(crate) gemm_group_major: std::sync::atomic::AtomicBool,
    /// Whether automatically chosen GEMM variants take the lean main loop
    /// ([`CudaContext::set_gemm_lean`]).
    pub(crate) gemm_lean: std::sync::atomic::AtomicBool,
    /// Whether automatically chosen grouped expert GEMMs on the narrow tile (below 28 entries
    /// per expert) take the three-blocks-per-SM lean entry point
    /// ([`CudaContext::set_gemm_grouped3`]).
    pub(crate) gemm_grouped3: std::sync::atomic::AtomicBool,
    /// Whether the lean GEMM variants bring their weight tiles by bulk copies
    /// ([`CudaContext::set_gemm_bulk`]).
    pub(crate) gemm_bulk: std::sync::atomic::AtomicBool,
    /// The same for the grouped expert products ([`CudaContext::set_gemm_bulk_grouped`]).
    pub(crate) gemm_bulk_grouped: std::sync::atomic::AtomicBool,
    /// Whether short chunks' dense products take the bulk copies too
    /// ([`CudaContext::set_gemm_bulk_short`]).
    pub(crate) gemm_bulk_short: std::sync::atomic::AtomicBool,
    /// GEMM launches on the bulk-copy entry points ([`CudaContext::gemm_bulk_launches`]).
    pub(crate) gemm_bulk_launches: std::sync::atomic::AtomicU64,
    /// GEMM launches on the bf16-weight entry points ([`CudaContext::gemm_bf16_launches`]).
    pub(crate) gemm_bf16_launches: std::sync::atomic::AtomicU64,
    /// Whether the 4-bit grouped products run the warp-specialized loop ([`CudaContext::set_gemm_ws`]).
    pub(crate) gemm_ws: std::sync::atomic::AtomicBool,
    /// Whether long prompts' dense products may take the wide tile ([`CudaContext::set_gemm_wide`]).
    pub(crate) gemm_wide: std::sync::atomic::AtomicBool,
    /// Whether long prompts' dense products take the mid tile instead of the wide one
    /// ([`CudaContext::set_gemm_mid`]).
    pub(crate) gemm_mid: std::sync::atomic::AtomicBool,
    /// Whether the longest chunks' tallest dense products take the big tile instead of the
    /// wide one ([`CudaContext::set_gemm_big_long`]).
    pub(crate) gemm_big_long: std::sync::atomic::AtomicBool,
    /// Whether dense products on the wide and big tiles read a matrix's bf16 copy where it has
    /// one ([`CudaContext::set_gemm_bf16_weights`]).
    pub(crate) gemm_bf16_weights: std::sync::atomic::AtomicBool,
    /// Whether long prompts' grouped expert products may take the wide tile
    /// ([`CudaContext::set_gemm_wide_grouped`]).
    pub(crate) gemm_wide_grouped: std::sync::atomic::AtomicBool,
    /// Whether the attention prefill may split causal prompts' key ranges in two
    /// ([`CudaContext::set_attn_causal_split`]).
    pub(crate) attn_causal_split: std::sync::atomic::AtomicBool,
    /// The plan's 128-row attention tile as its pipelined form
    /// ([`CudaContext::set_attn_ws`]).
    pub(crate) attn_ws: std::sync::atomic::AtomicBool,
    /// Launches made through [`CudaContext::kernel`] carry the programmatic-stream-serialization
    /// attribute ([`CudaContext::set_eager_pdl`]; off unless set).
    eager_pdl: std::sync::atomic::AtomicBool,
    /// [`CudaContext::moe_route`] runs the routing, the per-chunk counts and the scan as one
    /// launch ([`CudaContext::set_moe_route_fused`]).
    pub(crate) moe_route_fused: std::sync::atomic::AtomicBool,
    /// The fused routing launch places the entries of short prompts itself
    /// ([`CudaContext::set_moe_place_in_scan`]).
    pub(crate) moe_place_in_scan: std::sync::atomic::AtomicBool,
    /// Dense GEMMs may split over K ([`CudaContext::set_gemm_splitk`]).
    pub(crate) gemm_splitk: std::sync::atomic::AtomicBool,
    /// The wgmma GEMMs fit their MMA width to the tokens of each tile
    /// ([`CudaContext::set_gemm_fit_n`]).
    pub(crate) gemm_fit_n: std::sync::atomic::AtomicBool,
    /// The dense GEMMs with `+ residual` (not split over K) write their f32 outputs staged in
    /// shared memory ([`CudaContext::set_gemm_staged_epilogue`]).
    pub(crate) gemm_staged_epi: std::sync::atomic::AtomicBool,
    /// The grouped MoE down GEMM stores its per-entry rows as bf16 for the combine
    /// ([`CudaContext::set_moe_slot_bf16`]).
    pub(crate) moe_slot_bf16: std::sync::atomic::AtomicBool,
    /// The partial-sum slabs of GEMMs split over K, allocated on first use (each context its
    /// own: they are used on the context's stream only).
    pub(crate) splitk_part: std::sync::OnceLock<CudaSlice<f32>>,
    /// Bumped whenever a context-wide launch option changes, so captured graphs notice.
    launch_gen: std::sync::atomic::AtomicU64,
    /// Scratch of [`CudaContext::argmax_step`] (per-block maxima and the finished-block counter,
    /// zero between launches): [`step::STEP_SCRATCH_WORDS`] words.
    step_scratch: CudaSlice<u32>,
    rms_norm_d_model: CudaFunction,
    /// Every entry point of every file in [`KERNELS`], by name.
    funcs: std::collections::HashMap<&'static str, CudaFunction>,
    sm_count: u32,
    /// The device log of the timeline probe, when [`timeline::enable`] was called first.
    pub(crate) timeline: Option<std::sync::Mutex<timeline::DeviceLog>>,
}

impl CudaContext {
    /// Opens device `ordinal`, compiles (or takes from the cache) every kernel for [`ARCH`],
    /// and loads them. Fails if the device is not compute capability 9.0.
    ///
    /// Event tracking of cudarc is disabled: a context's launches run on its one stream, in
    /// order; work on a sibling's stream ([`Self::sibling`]) is ordered by explicit events.
    pub fn new(ordinal: usize) -> Result<CudaContext, CudaError> {
        let ctx = cudarc::driver::CudaContext::new(ordinal)?;
        let cc = ctx.compute_capability()?;
        if cc != (9, 0) {
            return Err(CudaError::Unsupported(format!(
                "kernels are built for {ARCH}; device {ordinal} is compute capability {}.{}",
                cc.0, cc.1
            )));
        }
        // SAFETY: every launch of a context goes to its one stream; the only buffers used on
        // two streams (a sibling's, the prefill's shared expert) are ordered by explicit events
        // (prefill.rs SharedExpertStream) and outlive the side stream's work (Prefiller's Drop).
        unsafe { ctx.disable_event_tracking() };
        // A created stream, not the legacy default one, so launches can be captured in graphs.
        let stream = ctx.new_stream()?;
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        let mut modules = std::collections::HashMap::new();
        for (k, cubin) in KERNELS.iter().zip(nvrtc::compile_all_cached(KERNELS)?) {
            let m = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
            modules.insert(k.name, m);
        }
        let mut funcs = std::collections::HashMap::new();
        for k in KERNELS {
            for e in k.entries {
                funcs.insert(*e, modules[k.name].load_function(e)?);
            }
        }
        let f = |module: &str, name: &str| modules[module].load_function(name);
        let mut gemv: [[Option<CudaFunction>; 3]; 2] = Default::default();
        let mut gemv_resid: [[Option<CudaFunction>; 3]; 2] = Default::default();
        for (bi, b) in [4, 8].iter().enumerate() {
            for (ki, k) in [512, 2048, 4096].iter().enumerate() {
                let cols = [p::D_EXPERT, p::D_MODEL, p::N_Q_HEADS * p::HEAD_DIM][ki];
                let smem = gemv_smem_bytes(*b, cols);
                for (slot, name) in [(&mut gemv, format!("gemv_q{b}_k{k}")), (&mut gemv_resid, format!("gemv_resid_q{b}_k{k}"))] {
                    let func = f("gemv", &name)?;
                    allow_block_smem(&func, smem)?;
                    slot[bi][ki] = Some(func);
                }
            }
        }
        let mut gemv_norm: [Option<CudaFunction>; 2] = Default::default();
        let mut gemv_norm_r56: [Option<CudaFunction>; 2] = Default::default();
        for (bi, b) in [4, 8].iter().enumerate() {
            for (slot, name) in [
                (&mut gemv_norm, format!("gemv_norm_q{b}_k2048")),
                (&mut gemv_norm_r56, format!("gemv_norm_r56_q{b}_k2048")),
            ] {
                let func = f("gemv", &name)?;
                allow_block_smem(&func, gemv_smem_bytes(*b, p::D_MODEL))?;
                slot[bi] = Some(func);
            }
            // the same reading x as f64 sums (gemv_norm_xd)
            for name in [format!("gemv_norm_xd_q{b}_k2048"), format!("gemv_norm_r56_xd_q{b}_k2048")] {
                allow_block_smem(&f("gemv", &name)?, gemv_smem_bytes(*b, p::D_MODEL))?;
            }
            // the output projection with the MoE router folded in (moe.rs gemv_residual_router)
            for rb in [4, 8] {
                for gb in [4, 8] {
                    allow_block_smem(&f("gemv", &format!("gemv_resid_rf_r{rb}_g{gb}_q{b}_k4096"))?, gemv_smem_bytes(*b, p::N_V_HEADS * p::D_V))?;
                }
            }
        }
        // the slim 4-bit output projections (OutProjVariant): their own ring depths
        for v in [OutProjVariant::Cap88, OutProjVariant::Cap88Stages3] {
            for rb in [4, 8] {
                for gb in [4, 8] {
                    allow_block_smem(&f("gemv", &v.entry(rb, gb))?, v.smem_bytes())?;
                }
            }
        }
        // the staged (bulk-copy) 4-bit entry points: the same shared memory as their twins
        {
            let mut staged = vec![("gemv_norm_r56_s4_k2048".to_string(), p::D_MODEL)];
            for rb in [4, 8] {
                for gb in [4, 8] {
                    staged.push((format!("gemv_resid_rf_r{rb}_g{gb}_s4_k4096"), p::N_V_HEADS * p::D_V));
                }
            }
            for (name, cols) in staged {
                allow_block_smem(&f("gemv", &name)?, gemv_smem_bytes(4, cols))?;
            }
        }
        let step_scratch = stream.alloc_zeros::<u32>(step::STEP_SCRATCH_WORDS)?;
        let timeline = if timeline::enabled() { Some(std::sync::Mutex::new(timeline::DeviceLog::new(&stream, &modules)?)) } else { None };
        let cx = CudaContext {
            timeline,
            rms_norm_d_model: f("rms_norm", "rms_norm_d_model")?,
            gemv,
            gemv_resid,
            gemv_norm,
            gemv_norm_r56,
            gemv_reg_cap: std::sync::atomic::AtomicBool::new(true),
            gemv_early_trigger: std::sync::atomic::AtomicBool::new(false),
            attn_combine_early_trigger: std::sync::atomic::AtomicBool::new(ATTN_COMBINE_EARLY_TRIGGER),
            attn_split_early_trigger: std::sync::atomic::AtomicBool::new(ATTN_SPLIT_EARLY_TRIGGER),
            gemv_staged: std::sync::atomic::AtomicBool::new(true),
            gemv_staged_all_early: std::sync::atomic::AtomicBool::new(false),
            gemv_staged_unit: std::sync::atomic::AtomicBool::new(false),
            in_proj_late_weights: std::sync::atomic::AtomicBool::new(false),
            moe_cluster_late_trigger: std::sync::atomic::AtomicBool::new(false),
            moe_cluster_mark_issue: std::sync::atomic::AtomicBool::new(false),
            moe_cluster_pin_experts: std::sync::atomic::AtomicBool::new(false),
            moe_hsum: std::sync::atomic::AtomicBool::new(moe::default_moe_hsum()),
            decode_diag: std::sync::atomic::AtomicU32::new(0),
            in_proj_grid: std::sync::atomic::AtomicU64::new(0),
            out_proj_variant: std::sync::atomic::AtomicU8::new(OUT_PROJ_VARIANT as u8),
            gdn_step_smem_pad: std::sync::atomic::AtomicU32::new(0),
            gdn_out_flags: std::sync::atomic::AtomicU32::new(0),
            gdn_step_early_trigger: std::sync::atomic::AtomicBool::new(false),
            gemm_group_major: std::sync::atomic::AtomicBool::new(true),
            gemm_lean: std::sync::atomic::AtomicBool::new(gemm::default_gemm_lean()),
            gemm_grouped3: std::sync::atomic::AtomicBool::new(gemm::default_gemm_grouped3()),
            gemm_bulk: std::sync::atomic::AtomicBool::new(gemm::default_gemm_bulk()),
            gemm_bulk_grouped: std::sync::atomic::AtomicBool::new(gemm::default_gemm_bulk_grouped()),
            gemm_bulk_short: std::sync::atomic::AtomicBool::new(false),
            gemm_bulk_launches: std::sync::atomic::AtomicU64::new(0),
            gemm_bf16_launches: std::sync::atomic::AtomicU64::new(0),
            gemm_ws: std::sync::atomic::AtomicBool::new(gemm::default_gemm_ws()),
            gemm_wide: std::sync::atomic::AtomicBool::new(gemm::default_gemm_wide()),
            gemm_mid: std::sync::atomic::AtomicBool::new(false),
            gemm_big_long: std::sync::atomic::AtomicBool::new(gemm::default_gemm_big_long()),
            gemm_bf16_weights: std::sync::atomic::AtomicBool::new(gemm::default_gemm_bf16_weights()),
            gemm_wide_grouped: std::sync::atomic::AtomicBool::new(gemm::default_gemm_wide_grouped()),
            attn_causal_split: std::sync::atomic::AtomicBool::new(attn_prefill::default_attn_causal_split()),
            attn_ws: std::sync::atomic::AtomicBool::new(attn_prefill::default_attn_ws()),
            eager_pdl: std::sync::atomic::AtomicBool::new(false),
            moe_route_fused: std::sync::atomic::AtomicBool::new(gemm::MOE_ROUTE_FUSED),
            moe_place_in_scan: std::sync::atomic::AtomicBool::new(true),
            gemm_splitk: std::sync::atomic::AtomicBool::new(gemm::default_splitk()),
            gemm_fit_n: std::sync::atomic::AtomicBool::new(gemm::default_fit_n()),
            gemm_staged_epi: std::sync::atomic::AtomicBool::new(gemm::default_staged_epilogue()),
            moe_slot_bf16: std::sync::atomic::AtomicBool::new(gemm::default_moe_slot_bf16()),
            splitk_part: std::sync::OnceLock::new(),
            launch_gen: std::sync::atomic::AtomicU64::new(0),
            step_scratch,
            funcs,
            ctx,
            stream,
            sm_count,
        };
        gdn::in_step_smem_allow(&cx)?;
        if CARVEOUT_BEFORE_GEMV {
            cx.set_carveout_of(Self::BEFORE_GEMV, 100)?;
        }
        Ok(cx)
    }

    /// A second handle on the same device context, modules and launch options whose launches go
    /// to a stream of their own: for independent work that may overlap this context's (the
    /// prefill runs the shared expert on one, `prefill.rs`). Buffers of either may be used by
    /// both, but nothing orders the two streams: the caller does, with events
    /// (`CudaEvent::record` on one, `CudaStream::wait` on the other). The new stream starts
    /// after the work queued on this one so far. It has no timeline log of its own: with the
    /// probe compiled in, its kernels log into this context's.
    ///
    /// # Errors
    /// Driver errors (stream creation, the scratch allocation).
    pub fn sibling(&self) -> Result<CudaContext, CudaError> {
        let copy = |a: &std::sync::atomic::AtomicBool| std::sync::atomic::AtomicBool::new(a.load(std::sync::atomic::Ordering::Relaxed));
        let stream = self.stream.fork()?;
        let step_scratch = stream.alloc_zeros::<u32>(step::STEP_SCRATCH_WORDS)?;
        Ok(CudaContext {
            timeline: None,
            rms_norm_d_model: self.rms_norm_d_model.clone(),
            gemv: self.gemv.clone(),
            gemv_resid: self.gemv_resid.clone(),
            gemv_norm: self.gemv_norm.clone(),
            gemv_norm_r56: self.gemv_norm_r56.clone(),
            gemv_reg_cap: copy(&self.gemv_reg_cap),
            gemv_early_trigger: copy(&self.gemv_early_trigger),
            attn_combine_early_trigger: copy(&self.attn_combine_early_trigger),
            attn_split_early_trigger: copy(&self.attn_split_early_trigger),
            gemv_staged: copy(&self.gemv_staged),
            gemv_staged_all_early: copy(&self.gemv_staged_all_early),
            gemv_staged_unit: copy(&self.gemv_staged_unit),
            in_proj_late_weights: copy(&self.in_proj_late_weights),
            moe_cluster_late_trigger: copy(&self.moe_cluster_late_trigger),
            moe_cluster_mark_issue: copy(&self.moe_cluster_mark_issue),
            moe_cluster_pin_experts: copy(&self.moe_cluster_pin_experts),
            moe_hsum: copy(&self.moe_hsum),
            decode_diag: std::sync::atomic::AtomicU32::new(self.decode_diag.load(std::sync::atomic::Ordering::Relaxed)),
            in_proj_grid: std::sync::atomic::AtomicU64::new(self.in_proj_grid.load(std::sync::atomic::Ordering::Relaxed)),
            out_proj_variant: std::sync::atomic::AtomicU8::new(self.out_proj_variant.load(std::sync::atomic::Ordering::Relaxed)),
            gdn_step_smem_pad: std::sync::atomic::AtomicU32::new(self.gdn_step_smem_pad.load(std::sync::atomic::Ordering::Relaxed)),
            gdn_out_flags: std::sync::atomic::AtomicU32::new(self.gdn_out_flags.load(std::sync::atomic::Ordering::Relaxed)),
            gdn_step_early_trigger: copy(&self.gdn_step_early_trigger),
            gemm_group_major: copy(&self.gemm_group_major),
            gemm_lean: copy(&self.gemm_lean),
            gemm_grouped3: copy(&self.gemm_grouped3),
            gemm_bulk: copy(&self.gemm_bulk),
            gemm_bulk_grouped: copy(&self.gemm_bulk_grouped),
            gemm_bulk_short: copy(&self.gemm_bulk_short),
            gemm_bulk_launches: std::sync::atomic::AtomicU64::new(0),
            gemm_bf16_launches: std::sync::atomic::AtomicU64::new(0),
            gemm_ws: copy(&self.gemm_ws),
            gemm_wide: copy(&self.gemm_wide),
            gemm_mid: copy(&self.gemm_mid),
            gemm_big_long: copy(&self.gemm_big_long),
            gemm_bf16_weights: copy(&self.gemm_bf16_weights),
            gemm_wide_grouped: copy(&self.gemm_wide_grouped),
            attn_causal_split: copy(&self.attn_causal_split),
            attn_ws: copy(&self.attn_ws),
            eager_pdl: copy(&self.eager_pdl),
            moe_route_fused: copy(&self.moe_route_fused),
            moe_place_in_scan: copy(&self.moe_place_in_scan),
            gemm_splitk: copy(&self.gemm_splitk),
            gemm_fit_n: copy(&self.gemm_fit_n),
            gemm_staged_epi: copy(&self.gemm_staged_epi),
            moe_slot_bf16: copy(&self.moe_slot_bf16),
            splitk_part: std::sync::OnceLock::new(),
            launch_gen: std::sync::atomic::AtomicU64::new(0),
            step_scratch,
            funcs: self.funcs.clone(),
            ctx: self.ctx.clone(),
            stream,
            sm_count: self.sm_count,
        })
    }

    /// Lets the eager launches made through [`CudaContext::kernel`] (the batched prefill's
    /// kernels) overlap the previous kernel on the stream by programmatic dependent launch
    /// (`on`) or not: the same results, only the boundaries between kernels change (see
    /// [`launch`]). Off for a new context; the prefill turns it on for its chunks
    /// ([`prefill::Prefiller::eager_pdl`]). Must be off while a stream capture records launches
    /// made through [`CudaContext::kernel`].
    pub fn set_eager_pdl(&self, on: bool) {
        self.eager_pdl.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`CudaContext::set_eager_pdl`] is on.
    pub fn eager_pdl(&self) -> bool {
        self.eager_pdl.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A launch of `func` on this context's stream, with programmatic dependent launch when
    /// [`CudaContext::set_eager_pdl`] is on.
    pub fn kernel<'a>(&'a self, func: &'a CudaFunction) -> launch::Launch<'a> {
        launch::Launch::new(&self.stream, func, self.eager_pdl())
    }

    /// The loaded entry point `name` (an `extern "C"` kernel listed in [`KERNELS`]).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when no kernel file lists `name`.
    pub fn func(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.funcs
            .get(name)
            .ok_or_else(|| CudaError::Unsupported(format!("no kernel entry point named {name}")))
    }

    /// Thread-block clusters of entry point `name` (compiled with `__cluster_dims__`) that can be
    /// resident on the device at once, with `grid` blocks of `block` threads and `smem` bytes of
    /// dynamic shared memory each (`cuOccupancyMaxActiveClusters`).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for an unknown entry point; driver errors of the query.
    pub fn max_active_clusters(&self, name: &str, grid: u32, block: u32, smem: u32) -> Result<i32, CudaError> {
        use cudarc::driver::sys;
        let f = self.func(name)?.cu_function();
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: std::ptr::null_mut(),
            numAttrs: 0,
        };
        let mut n: std::ffi::c_int = 0;
        self.ctx.bind_to_thread()?;
        // SAFETY: `f` is a loaded function of this context, `cfg` a complete launch
        // configuration without attributes (the cluster shape is the kernel's own), `n` a valid
        // out-pointer.
        let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f, &cfg) };
        r.result()?;
        Ok(n)
    }

    /// The underlying cudarc context.
    pub fn raw(&self) -> &Arc<cudarc::driver::CudaContext> {
        &self.ctx
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Streaming multiprocessors on the device.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Copies a quantized matrix to the device. Only `group_size == 64` and the column counts
    /// the kernels are built for (512, 2048, 4096) are accepted.
    pub fn upload_qmat(&self, m: QMatRef<'_>) -> Result<DeviceQMat, CudaError> {
        quant::validate(&m).map_err(|e| CudaError::Unsupported(e.to_string()))?;
        if m.spec.group_size != QUANT_GROUP {
            return Err(CudaError::Unsupported(format!(
                "group size {} (kernels are built for {QUANT_GROUP})",
                m.spec.group_size
            )));
        }
        k_index(m.cols)?;
        let scales: &[u16] = bytemuck::cast_slice(m.scales);
        let biases: &[u16] = bytemuck::cast_slice(m.biases);
        Ok(DeviceQMat {
            rows: m.rows,
            cols: m.cols,
            bits: m.spec.bits,
            packed: self.stream.clone_htod(m.packed)?,
            scales: self.stream.clone_htod(scales)?,
            biases: self.stream.clone_htod(biases)?,
            staged: None,
            group_major: None,
            group_major_codes: None,
            codes_group_major: false,
            bf16: None,
        })
    }

    /// Copies several quantized matrices with the same columns, bits and group size into one
    /// device matrix, rows stacked in order (`parts[0]`'s rows first). This is how stacked
    /// projections (GDN `qkv|z|b|a`, attention `q|k|v`, router `|` shared-expert gate,
    /// expert `gate|up`) become a single GEMV.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `parts` is empty or the parts differ in columns, bits or
    /// group size, or as [`Self::upload_qmat`].
    pub fn upload_qmat_rows(&self, parts: &[QMatRef<'_>]) -> Result<DeviceQMat, CudaError> {
        let first = parts
            .first()
            .ok_or_else(|| CudaError::Unsupported("no matrices to stack".into()))?;
        for (i, m) in parts.iter().enumerate() {
            if m.cols != first.cols || m.spec != first.spec {
                return Err(CudaError::Unsupported(format!(
                    "stacked part {i}: [{}, {}] at {} bits, group {} does not match part 0: \
                     [{}, {}] at {} bits, group {}",
                    m.rows,
                    m.cols,
                    m.spec.bits.bits(),
                    m.spec.group_size,
                    first.rows,
                    first.cols,
                    first.spec.bits.bits(),
                    first.spec.group_size
                )));
            }
        }
        if parts.len() == 1 {
            return self.upload_qmat(*first);
        }
        fn concat<'a, T: Copy + 'a>(parts: impl Iterator<Item = &'a [T]> + Clone) -> Vec<T> {
            let mut v = Vec::with_capacity(parts.clone().map(<[T]>::len).sum());
            for p in parts {
                v.extend_from_slice(p);
            }
            v
        }
        let packed = concat(parts.iter().map(|m| m.packed));
        let scales = concat(parts.iter().map(|m| m.scales));
        let biases = concat(parts.iter().map(|m| m.biases));
        let rows = parts.iter().map(|m| m.rows).sum();
        let m = QMatRef::new(rows, first.cols, first.spec, &packed, &scales, &biases)
            .map_err(|e| CudaError::Unsupported(e.to_string()))?;
        self.upload_qmat(m)
    }

    /// Copies f32 data to a new device buffer.
    pub fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        Ok(self.stream.clone_htod(v)?)
    }

    /// Copies a device buffer back (waits for the stream).
    pub fn download_f32(&self, v: &CudaSlice<f32>) -> Result<Vec<f32>, CudaError> {
        Ok(self.stream.clone_dtoh(v)?)
    }

    /// `out[r] = Σ_c W[r, c]·x[c]` for a quantized `W` ([`DeviceQMat`]): the batch-1 decode
    /// GEMV (`kernels/gemv.cu`: exact integer products on the tensor cores, x split into three
    /// 8-bit digits per group of 64; relative error ~1e-6 against `quant::reference::gemv`).
    /// `x` has `mat.cols` f32 (16-byte aligned: a view starting at a multiple of 4 elements),
    /// `out` has `mat.rows` f32. Asynchronous on [`Self::stream`]; graph-capturable.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] on mismatched lengths, a misaligned `x`, or a column count the
    /// kernels are not built for; driver errors from the launch.
    pub fn gemv(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        mat: &DeviceQMat,
        x: &CudaView<'_, f32>,
    ) -> Result<(), CudaError> {
        self.gemv_tuned(out, mat, x, None, None)
    }

    /// `out[r] = resid[r] + Σ_c W[r, c]·x[c]`: [`Self::gemv`] with the residual add fused
    /// (attention `o_proj` / GDN `out_proj` into the residual stream, MODEL.md §3.3). `resid`
    /// has `mat.rows` f32 and may not be `out` itself. Same shapes, errors and accuracy as
    /// [`Self::gemv`].
    pub fn gemv_residual(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        mat: &DeviceQMat,
        x: &CudaView<'_, f32>,
        resid: &CudaView<'_, f32>,
    ) -> Result<(), CudaError> {
        self.gemv_tuned(out, mat, x, Some(resid), None)
    }

    /// `out = W·rms_norm(x, norm_w)`: [`Self::rms_norm`] fused in front of [`Self::gemv`] for a
    /// matrix of `D_MODEL` columns (input_layernorm → in_proj / q|gate|k|v, final norm → LM
    /// head, MODEL.md §3.1). Every block normalizes x itself with the arithmetic of
    /// `kernels/rms_norm.cu`, so the result equals the two launches bit for bit. `norm_w`:
    /// `[D_MODEL]` f32 (zero-centred: the scale is `1 + w`).
    ///
    /// # Errors
    /// As [`Self::gemv`]; also [`CudaError::Unsupported`] when `mat.cols` or `norm_w.len()` is
    /// not `D_MODEL`.
    pub fn gemv_norm(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        mat: &DeviceQMat,
        x: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
    ) -> Result<(), CudaError> {
        let (cfg, ks_log2, rows, flags, cap) = self.gemv_norm_setup("gemv_norm", out.len(), mat, x, norm_w)?;
        let table = if cap { &self.gemv_norm_r56 } else { &self.gemv_norm };
        // the staged twin (bulk copies) when the matrix has a staged copy (56 registers only)
        let staged = if cap { self.staged_of(mat) } else { None };
        let f = match staged {
            Some(_) => self.func("gemv_norm_r56_s4_k2048")?,
            None => table[match mat.bits {
                Bits::B4 => 0,
                Bits::B8 => 1,
            }]
            .as_ref()
            .expect("loaded"),
        };
        let eps = p::RMS_EPS;
        let mut b = self.stream.launch_builder(f);
        match staged {
            Some(st) => b.arg(out).arg(st),
            None => b.arg(out).arg(mat.mlx_codes()?),
        };
        b
            .arg(&mat.scales)
            .arg(&mat.biases)
            .arg(x)
            .arg(norm_w)
            .arg(&eps)
            .arg(&rows)
            .arg(&ks_log2)
            .arg(&flags);
        // SAFETY: argument types and lengths match `gemv_norm_*` (checked above and in
        // gemv_prepare); the grid never exceeds the blocks with work. A staged copy holds every
        // tile of the matrix (stage_qmat checked its rows, columns and bits).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// [`Self::gemv_norm`] of the residual stream held as f64 sums (`xd`, `[D_MODEL]`: what the
    /// MoE's combine by atomics leaves, [`Self::set_moe_hsum`]): every block rounds `xd` to f32
    /// as it reads it, and block 0 also stores that f32 vector into `xout` (`[D_MODEL]`, the
    /// residual stream the next output projection adds to). The product is then that of
    /// [`Self::gemv_norm`] on `xout`, bit for bit (the self-test checks it). Reads the matrix in
    /// the MLX layout even when it has a staged copy (the decode step does not combine by
    /// atomics where a staged copy would be read).
    ///
    /// # Errors
    /// As [`Self::gemv_norm`]; also [`CudaError::Unsupported`] when `xd` is not `D_MODEL` long
    /// or not 16-byte aligned.
    pub fn gemv_norm_xd(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        mat: &DeviceQMat,
        xd: &CudaView<'_, f64>,
        xout: &mut CudaViewMut<'_, f32>,
        norm_w: &CudaView<'_, f32>,
    ) -> Result<(), CudaError> {
        let (xdp, _g) = xd.device_ptr(&self.stream);
        if xd.len() != p::D_MODEL || xdp % 16 != 0 {
            return Err(CudaError::Unsupported(format!(
                "gemv_norm_xd: xd has {} values at {xdp:#x} (D_MODEL = {} f64, 16-byte aligned)",
                xd.len(),
                p::D_MODEL
            )));
        }
        let (cfg, ks_log2, rows, flags, cap) = self.gemv_norm_setup("gemv_norm_xd", out.len(), mat, &xout.as_view(), norm_w)?;
        let f = self.func(&format!("gemv_norm{}_xd_q{}_k2048", if cap { "_r56" } else { "" }, mat.bits.bits()))?;
        let eps = p::RMS_EPS;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(mat.mlx_codes()?)
            .arg(&mat.scales)
            .arg(&mat.biases)
            .arg(xd)
            .arg(xout)
            .arg(norm_w)
            .arg(&eps)
            .arg(&rows)
            .arg(&ks_log2)
            .arg(&flags);
        // SAFETY: argument types and lengths match `gemv_norm_*xd_*` (checked above and in
        // gemv_prepare, xout standing for x: both D_MODEL f32); the grid never exceeds the
        // blocks with work.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The checks and launch configuration shared by [`Self::gemv_norm`] and
    /// [`Self::gemv_norm_xd`]: (config with the shared memory set, ks_log2, rows, flags, whether
    /// the 56-register entry points run).
    fn gemv_norm_setup(
        &self,
        op: &str,
        out_len: usize,
        mat: &DeviceQMat,
        x: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
    ) -> Result<(LaunchConfig, i32, i32, i32, bool), CudaError> {
        if mat.cols != p::D_MODEL || norm_w.len() != p::D_MODEL {
            return Err(CudaError::Unsupported(format!(
                "{op}: a [{}, {}] matrix with {} norm weights (built for D_MODEL = {} columns)",
                mat.rows,
                mat.cols,
                norm_w.len(),
                p::D_MODEL
            )));
        }
        let (_, mut cfg, mut ks_log2, rows) = self.gemv_prepare(op, out_len, mat, x, None)?;
        cfg.shared_mem_bytes = gemv_smem_bytes(mat.bits.bits() as usize, mat.cols) as u32;
        let in_proj = mat.rows <= gdn::GDN_PROJ.max(attention::ATTN_PROJ);
        let forced = self.in_proj_grid.load(std::sync::atomic::Ordering::Relaxed);
        if forced != 0 && in_proj {
            (ks_log2, cfg.grid_dim.0) = clamp_gemv_tune(mat, (forced >> 32) as i32, forced as u32);
        }
        let (wp, _guard) = norm_w.device_ptr(&self.stream);
        if wp % 16 != 0 {
            return Err(CudaError::Unsupported(format!("{op}: norm_w must be 16-byte aligned (device address {wp:#x})")));
        }
        let late = in_proj && self.in_proj_late_weights.load(std::sync::atomic::Ordering::Relaxed);
        let flags = self.gemv_flags() | if late { GEMV_LATE_WEIGHTS } else { 0 };
        Ok((cfg, ks_log2, rows, flags, self.gemv_reg_cap()))
    }

    /// [`Self::gemv`] (or, with `resid`, [`Self::gemv_residual`]) with the launch configuration
    /// forced: `tune = Some((ks_log2, blocks))` splits K over `2^ks_log2` warps (clamped to
    /// `0..=min(4, log2(cols / 256))`) and uses `blocks` blocks (clamped to the blocks with
    /// work). For the self-test's sweeps.
    #[doc(hidden)]
    pub fn gemv_tuned(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        mat: &DeviceQMat,
        x: &CudaView<'_, f32>,
        resid: Option<&CudaView<'_, f32>>,
        tune: Option<(i32, u32)>,
    ) -> Result<(), CudaError> {
        let op = if resid.is_some() { "gemv_residual" } else { "gemv" };
        let (f, mut cfg, mut ks_log2, rows) = self.gemv_prepare(op, out.len(), mat, x, resid.map(|r| r.len()))?;
        if let Some((ks, blocks)) = tune {
            (ks_log2, cfg.grid_dim.0) = clamp_gemv_tune(mat, ks, blocks);
        }
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(mat.mlx_codes()?)
            .arg(&mat.scales)
            .arg(&mat.biases)
            .arg(x);
        if let Some(r) = resid {
            b.arg(r);
        }
        let flags = self.gemv_flags();
        b.arg(&rows).arg(&ks_log2).arg(&flags);
        // SAFETY: argument types and lengths match the kernel's signature (checked in
        // gemv_prepare); the grid never exceeds the blocks with work.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Lets [`Self::stream_probe`]'s kernels take up to `max_bytes` of dynamic shared memory and
    /// asks for the largest shared-memory carve-out for them (as the decode GEMVs do). Call once
    /// before the probes, outside any graph capture.
    ///
    /// # Errors
    /// Driver errors (e.g. `max_bytes` beyond what a block may use beside the kernels' 128 bytes
    /// of static shared memory).
    #[doc(hidden)]
    pub fn stream_probe_prepare(&self, max_bytes: u32) -> Result<(), CudaError> {
        for name in ["stream_bulk", "stream_bulk_cl8", "stream_thread"] {
            allow_block_smem(self.func(name)?, max_bytes as usize)?;
        }
        Ok(())
    }

    /// Measurement (`cuda_selftest --only stream`): `blocks` blocks of 512 threads, one per SM,
    /// each moving `bytes` from `src + (base + b) * stride` (block `b`) into its shared memory
    /// the `how` way (`kernels/stream.cu`), thread 0 storing `%globaltimer` (ns) at its start and
    /// once its bytes are all there into `times[2b]`, `times[2b + 1]`. Asynchronous on
    /// [`Self::stream`]; [`Self::stream_probe_prepare`] must have allowed `bytes` of dynamic
    /// shared memory (else the launch fails with a driver error).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `bytes` is 0, not a multiple of 16 (and of `chunk`, a
    /// multiple of 16, for bulk copies) or over 227 KB, when a block's bytes would pass the end
    /// of `src`, when `times` is shorter than `2 · blocks`, or when a clustered launch's
    /// `blocks` is not a multiple of 8; driver errors.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn stream_probe(
        &self,
        how: StreamProbe,
        src: &CudaSlice<u8>,
        stride: usize,
        base: u32,
        blocks: u32,
        bytes: u32,
        chunk: u32,
        times: &mut CudaSlice<u64>,
    ) -> Result<(), CudaError> {
        let bulk = how != StreamProbe::Threads;
        let last_end = (base as usize + blocks as usize).saturating_sub(1) * stride + bytes as usize;
        if bytes == 0
            || !bytes.is_multiple_of(16)
            || bytes > 227 * 1024
            || (bulk && (chunk == 0 || !chunk.is_multiple_of(16) || !bytes.is_multiple_of(chunk)))
            || blocks == 0
            || last_end > src.len()
            || times.len() < 2 * blocks as usize
            || (how == StreamProbe::BulkClusters && !blocks.is_multiple_of(8))
        {
            return Err(CudaError::Unsupported(format!(
                "stream_probe: {how:?}, {blocks} blocks of {bytes} B in chunks of {chunk} B at stride {stride} from block {base} of a {}-byte source, {} time words",
                src.len(),
                times.len()
            )));
        }
        let f = self.func(match how {
            StreamProbe::Bulk => "stream_bulk",
            StreamProbe::BulkClusters => "stream_bulk_cl8",
            StreamProbe::Threads => "stream_thread",
        })?;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (512, 1, 1), shared_mem_bytes: bytes };
        let stride_u = stride as u64;
        let mut b = self.stream.launch_builder(f);
        b.arg(src).arg(&stride_u).arg(&base).arg(&bytes).arg(&chunk).arg(times);
        // SAFETY: argument types match `stream_*` in kernels/stream.cu; every block reads
        // [(base + b) * stride, + bytes) of src, in bounds (checked), and writes times[2b..2b+2]
        // (checked); the clustered entry point's grid is a multiple of its cluster (checked).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Measurement: `layers` 4-bit GEMVs in one persistent launch (`gemv_chain_q4` in
    /// `kernels/gemv.cu`), alternating `xa = W_a·xb` and `xb = W_b·xa`, layer `l` on copy
    /// `(l / 2) % copies` of each, separated by split flag barriers; to price the persistent
    /// decode kernel against the same GEMVs launched one by one ([`Self::gemv`] under PDL gives
    /// the same bits). `wa`: `copies` stacked `[N_Q_HEADS·HEAD_DIM, D_MODEL]` matrices, `wb`:
    /// `copies` stacked `[D_MODEL, N_Q_HEADS·HEAD_DIM]` ([`Self::upload_qmat_rows`]); `xa`, `xb`
    /// the two activations; `flags`: one word per SM, every word `<= base` (they end at
    /// `base + layers`); `late_weights`: request each GEMV's weights after its barrier instead
    /// of before (what requesting them early buys).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] on other shapes or bits, or when the two shapes' GEMV splits
    /// use different grids; driver errors (a cooperative launch: refused when the grid cannot be
    /// resident at once).
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_chain_probe(
        &self,
        xa: &mut CudaSlice<f32>,
        xb: &mut CudaSlice<f32>,
        wa: &DeviceQMat,
        wb: &DeviceQMat,
        copies: usize,
        layers: usize,
        flags: &mut CudaSlice<u32>,
        base: u32,
        late_weights: bool,
    ) -> Result<(), CudaError> {
        let (d, e) = (p::D_MODEL, p::N_Q_HEADS * p::HEAD_DIM);
        let (ks_a, blocks_a) = gemv_split(e, d, self.sm_count);
        let (ks_b, blocks_b) = gemv_split(d, e, self.sm_count);
        if copies == 0
            || wa.bits != Bits::B4
            || wb.bits != Bits::B4
            || (wa.rows, wa.cols) != (copies * e, d)
            || (wb.rows, wb.cols) != (copies * d, e)
            || xa.len() != e
            || xb.len() != d
            || blocks_a != blocks_b
            || flags.len() < blocks_a
            || layers > i32::MAX as usize
        {
            return Err(CudaError::Unsupported(format!(
                "gemv_chain_probe: W_a [{}, {}] q{}, W_b [{}, {}] q{}, {copies} copies, xa {} xb {}, grids {blocks_a}/{blocks_b}, {} flags",
                wa.rows,
                wa.cols,
                wa.bits.bits(),
                wb.rows,
                wb.cols,
                wb.bits.bits(),
                xa.len(),
                xb.len(),
                flags.len()
            )));
        }
        let f = self.func("gemv_chain_q4")?;
        let smem = gemv_smem_bytes(4, d).max(gemv_smem_bytes(4, e));
        allow_block_smem(f, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks_a as u32, 1, 1),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (copies_i, layers_i) = (copies as i32, layers as i32);
        let gemv_flags = if late_weights { GEMV_CHAIN_LATE_WEIGHTS } else { 0 };
        let mut b = self.stream.launch_builder(f);
        b.arg(xa)
            .arg(xb)
            .arg(wa.mlx_codes()?)
            .arg(&wa.scales)
            .arg(&wa.biases)
            .arg(wb.mlx_codes()?)
            .arg(&wb.scales)
            .arg(&wb.biases)
            .arg(&copies_i)
            .arg(&layers_i)
            .arg(&ks_a)
            .arg(&ks_b)
            .arg(flags)
            .arg(&base)
            .arg(&gemv_flags);
        // SAFETY: shapes checked above (copies stacked as the kernel indexes them); flags has a
        // word per block; a cooperative launch, so every block is resident and the barriers end.
        unsafe { b.launch_cooperative(cfg) }?;
        Ok(())
    }

    /// Checks a GEMV's shapes and picks the entry point and launch configuration.
    fn gemv_prepare(
        &self,
        op: &str,
        out_len: usize,
        mat: &DeviceQMat,
        x: &CudaView<'_, f32>,
        resid_len: Option<usize>,
    ) -> Result<(&CudaFunction, LaunchConfig, i32, i32), CudaError> {
        mat.mlx_codes()?;
        if out_len != mat.rows
            || x.len() != mat.cols
            || resid_len.is_some_and(|n| n != mat.rows)
            || mat.rows == 0
            || mat.rows > i32::MAX as usize
        {
            return Err(CudaError::Unsupported(format!(
                "{op} shapes: out {out_len} x {} resid {resid_len:?} for a [{}, {}] matrix",
                x.len(),
                mat.rows,
                mat.cols
            )));
        }
        let (xp, _guard) = x.device_ptr(&self.stream);
        if xp % 16 != 0 {
            return Err(CudaError::Unsupported(format!(
                "{op}: x must be 16-byte aligned (device address {xp:#x})"
            )));
        }
        let bi = match mat.bits {
            Bits::B4 => 0,
            Bits::B8 => 1,
        };
        let table = if resid_len.is_some() { &self.gemv_resid } else { &self.gemv };
        let f = table[bi][k_index(mat.cols)?].as_ref().expect("loaded");
        let (cfg, ks_log2) = gemv_launch(mat.rows, mat.cols, mat.bits.bits() as usize, self.sm_count);
        Ok((f, cfg, ks_log2, mat.rows as i32))
    }

    /// Zero-centred RMSNorm over rows of `D_MODEL`: `y = x / sqrt(mean(x²) + eps) · (1 + w)`
    /// (eps = `spec::production::RMS_EPS`). `x`, `y`: `[n_rows, D_MODEL]` f32; `w`: `[D_MODEL]`
    /// f32. Asynchronous on [`Self::stream`].
    pub fn rms_norm(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
    ) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        if w.len() != d || x.len() % d != 0 || y.len() != x.len() || x.is_empty() {
            return Err(CudaError::Unsupported(format!(
                "rms_norm shapes: y {} x {} w {} (D = {d})",
                y.len(),
                x.len(),
                w.len()
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: ((x.len() / d) as u32, 1, 1),
            block_dim: ((d / 8) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let eps = p::RMS_EPS;
        let mut b = self.stream.launch_builder(&self.rms_norm_d_model);
        b.arg(y).arg(x).arg(w).arg(&eps);
        // SAFETY: as checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Launches [`Self::gemv_norm`] from its register-capped entry point (`true`, the default:
    /// at most 56 registers per thread, so a block can share an SM with the MoE down kernel it
    /// follows and start its weight loads early; measured 1,317.8 vs 1,342.5 µs per 4-bit decode
    /// step on the H200) or from the unbounded one (74 registers at 4 bits, 78 at 8). Same
    /// results. The fit is exact at 4 bits (16 warps x 1,792 + 18 warps x 2,048 = 65,536
    /// registers); an 8-bit `moe_down` (76-83 registers) or the 8-bit GEMV's 221 KiB of shared
    /// memory never fit beside it, so there the cap gains nothing measured. Graphs captured
    /// earlier are captured again ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_gemv_reg_cap(&self, on: bool) {
        self.set_launch_option(&self.gemv_reg_cap, on);
    }

    /// Lets every GEMV trigger the launch of the next kernel right after its PDL wait
    /// (`true`) instead of once all its weight copies are queued (`false`, the default): the
    /// next kernel's launch takes 0.5-3.3 µs after the trigger on the H200 (`cuda::timeline`). The
    /// same bits either way. For measurement (`calla cuda-bench --compare`); graphs captured
    /// earlier are captured again ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_gemv_early_trigger(&self, on: bool) {
        self.set_launch_option(&self.gemv_early_trigger, on);
    }

    /// Lets the attention decode step's combine kernel (`attn_decode_combine`) trigger the launch
    /// of the next kernel (the output projection) at its entry (`true`) instead of after its
    /// partial sums (`false`); default [`ATTN_COMBINE_EARLY_TRIGGER`]. The same bits either way
    /// (the next kernel waits for the combine's completion before reading its output). Graphs
    /// captured earlier are captured again ([`Self::launch_generation`]).
    pub fn set_attn_combine_early_trigger(&self, on: bool) {
        self.set_launch_option(&self.attn_combine_early_trigger, on);
    }

    /// See [`Self::set_attn_combine_early_trigger`].
    pub fn attn_combine_early_trigger(&self) -> bool {
        self.attn_combine_early_trigger.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the attention decode step's split kernel (`attn_decode_split`) trigger the launch
    /// of the combine kernel before its PDL wait (`true`) instead of after its key loop
    /// (`false`); default [`ATTN_SPLIT_EARLY_TRIGGER`]. The same bits either way. Graphs
    /// captured earlier are captured again ([`Self::launch_generation`]).
    pub fn set_attn_split_early_trigger(&self, on: bool) {
        self.set_launch_option(&self.attn_split_early_trigger, on);
    }

    /// See [`Self::set_attn_split_early_trigger`].
    pub fn attn_split_early_trigger(&self) -> bool {
        self.attn_split_early_trigger.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the decode GEMVs that have a staged copy of their weights ([`Self::stage_qmat`])
    /// read it by bulk copies (`true`, the default) or read the MLX layout with per-thread
    /// copies (`false`); the same bits either way. Graphs captured earlier are captured again
    /// ([`Self::launch_generation`]).
    pub fn set_gemv_staged(&self, on: bool) {
        self.set_launch_option(&self.gemv_staged, on);
    }

    /// The rows of `mat` that the blocks of its decode GEMV past the first `free_sms` compute
    /// (its default launch, one block-iteration: block `b` owns rows `b·R .. (b+1)·R`): the
    /// blocks that land only once SMs beyond the `free_sms` free ones drain. `None` when every
    /// block fits, the launch takes more than one round of blocks, or it is forced
    /// ([`Self::set_in_proj_grid`]).
    pub(crate) fn gemv_late_rows(&self, mat: &DeviceQMat, free_sms: usize) -> Option<std::ops::Range<usize>> {
        if self.in_proj_grid.load(std::sync::atomic::Ordering::Relaxed) != 0 {
            return None;
        }
        let (ks_log2, blocks) = gemv_split(mat.rows, mat.cols, self.sm_count());
        let rows_per_block = (GEMV_WARPS >> ks_log2) * 16;
        if blocks * rows_per_block < mat.rows {
            return None;
        }
        let row0 = free_sms * rows_per_block;
        (row0 < mat.rows).then_some(row0..mat.rows)
    }

    /// Whether the fused-norm GEMVs run at 56 registers ([`Self::set_gemv_reg_cap`]).
    pub(crate) fn gemv_reg_cap(&self) -> bool {
        self.gemv_reg_cap.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The staged copy of `mat` when the staged GEMVs are on and `mat` has one.
    pub(crate) fn staged_of<'a>(&self, mat: &'a DeviceQMat) -> Option<&'a CudaSlice<u32>> {
        if self.gemv_staged.load(std::sync::atomic::Ordering::Relaxed) {
            mat.staged.as_ref()
        } else {
            None
        }
    }

    /// Adds the staged copy of a 4-bit matrix (`parts`: its host rows, stacked in order, as
    /// uploaded into `mat`) for the decode GEMVs' bulk copies: per 16-row tile and 256-column
    /// step one image of what a warp's ring stage holds (`kernels/gemv.cu`): the codes of rows
    /// `g` and `g + 8` in the lanes' order, then each lane's 4 scales or biases in its swizzled
    /// cell. Steps of a tile are consecutive, so a warp's steps are consecutive images. Rows past
    /// the end repeat the last row (as the kernel clamps them). The same bytes as the MLX layout
    /// (rounded up to whole tiles).
    ///
    /// Only the fused-norm GEMV at 56 registers ([`Self::gemv_norm`], the default) and the output
    /// projection with the router fold ([`Self::gemv_residual_router`]) have staged twins;
    /// [`Self::gemv`] and [`Self::gemv_residual`] read the MLX layout.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] unless `mat` is 4-bit with 2048 or 4096 columns, has no staged
    /// copy yet, and the parts add up to it; [`CudaError::Driver`] on allocation.
    pub fn stage_qmat(&self, mat: &mut DeviceQMat, parts: &[QMatRef<'_>]) -> Result<(), CudaError> {
        let rows: usize = parts.iter().map(|m| m.rows).sum();
        if mat.bits != Bits::B4
            || !(mat.cols == p::D_MODEL || mat.cols == p::N_Q_HEADS * p::HEAD_DIM)
            || rows != mat.rows
            || parts.iter().any(|m| m.cols != mat.cols || m.spec != parts[0].spec || m.spec.bits != Bits::B4)
        {
            return Err(CudaError::Unsupported(format!(
                "stage_qmat: a [{}, {}] {}-bit matrix from parts of {rows} rows (staged: 4-bit, 2048 or 4096 columns)",
                mat.rows,
                mat.cols,
                mat.bits.bits()
            )));
        }
        if mat.staged.is_some() {
            // replacing it would free a buffer that captured graphs may still read
            return Err(CudaError::Unsupported("stage_qmat: the matrix already has a staged copy".into()));
        }
        let host = stage_rows(parts, mat.cols);
        mat.staged = Some(self.stream.clone_htod(&host)?);
        Ok(())
    }

    /// Adds the group-major copy of `w`'s scales and biases ([`DeviceQMat::group_major`]) that
    /// the prefill GEMMs ([`Self::qgemm`] and the grouped expert GEMMs) read instead of the MLX
    /// layout when [`Self::gemm_group_major`] is on: `[rows * cols/64]` u32, word `g * rows + r`
    /// = scale `[r, g]` | bias `[r, g]` << 16, so the rows of one K tile (one group) are
    /// contiguous and a warp's scale/bias copies coalesce. Costs one more u32 per 64 weights,
    /// the size of the scales and biases again (1/8 of a 4-bit matrix's codes, 1/16 of an 8-bit
    /// one's). Built on the device from the uploaded scales and biases (one launch on
    /// [`Self::stream`], asynchronous). The same results either way; the GEMVs never read it.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `w` already has a group-major copy (replacing it would
    /// free a buffer that queued launches may still read) or is too large for the kernel's i32
    /// arguments; [`CudaError::Driver`] on allocation or launch.
    pub fn add_group_major(&self, w: &mut DeviceQMat) -> Result<(), CudaError> {
        if w.group_major.is_some() {
            return Err(CudaError::Unsupported("add_group_major: the matrix already has a group-major copy".into()));
        }
        let groups = w.cols / QUANT_GROUP;
        let n = w.rows * groups;
        debug_assert_eq!(w.scales.len(), n);
        let (rows, gi) = match (i32::try_from(w.rows), i32::try_from(groups), i32::try_from(n)) {
            (Ok(r), Ok(g), Ok(_)) => (r, g),
            _ => {
                return Err(CudaError::Unsupported(format!(
                    "add_group_major: a [{}, {}] matrix is too large for i32 sizes",
                    w.rows, w.cols
                )))
            }
        };
        if n == 0 {
            return Ok(()); // an empty matrix: nothing to read either way
        }
        let mut out = self.stream.alloc_zeros::<u32>(n)?;
        let blocks = n.div_ceil(256).min(65_535) as u32;
        let mut b = self.stream.launch_builder(self.func("qmat_group_major")?);
        b.arg(&w.scales).arg(&w.biases).arg(&mut out).arg(&rows).arg(&gi);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: scales and biases hold rows * cols/64 bf16 each (upload_qmat validated the
        // shapes), `out` rows * cols/64 u32; the kernel's grid-stride loop stays below that.
        unsafe { b.launch(cfg) }?;
        w.group_major = Some(out);
        Ok(())
    }

    /// Adds the group-major copy of `w`'s packed codes ([`DeviceQMat::group_major_codes`]),
    /// which the prefill GEMMs read together with the group-major scales
    /// ([`Self::add_group_major`]) when [`Self::gemm_group_major`] is on: `[cols/64, rows,
    /// 2·bits]` u32, so a K tile's rows' codes are contiguous. Costs the codes' size again
    /// (`CudaModel::upload` gives the dense projections, which the decode GEMVs read in the MLX
    /// layout, this copy: ~0.7 GB for the full model with their scales). One launch on
    /// [`Self::stream`], asynchronous; the same results.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `w`'s codes are group-major already (a copy or in
    /// place) or `w` is too large for the kernel's i32 arguments; [`CudaError::Driver`] on
    /// allocation or launch.
    pub fn add_group_major_codes(&self, w: &mut DeviceQMat) -> Result<(), CudaError> {
        if w.group_major_codes.is_some() || w.codes_group_major {
            return Err(CudaError::Unsupported("add_group_major_codes: the matrix's codes are group-major already".into()));
        }
        let groups = w.cols / QUANT_GROUP;
        let wpg = 2 * w.bits.bits() as usize;
        let n = w.packed.len();
        debug_assert_eq!(n, w.rows * groups * wpg);
        let (rows, gi, wi) = match (i32::try_from(w.rows), i32::try_from(groups), i32::try_from(wpg)) {
            (Ok(r), Ok(g), Ok(x)) => (r, g, x),
            _ => return Err(CudaError::Unsupported(format!("add_group_major_codes: a [{}, {}] matrix is too large for i32 sizes", w.rows, w.cols))),
        };
        if n == 0 {
            return Ok(());
        }
        let mut out = self.stream.alloc_zeros::<u32>(n)?;
        let blocks = n.div_ceil(256).min(65_535) as u32;
        let mut b = self.stream.launch_builder(self.func("qmat_pack_group_major")?);
        b.arg(&w.packed).arg(&mut out).arg(&rows).arg(&gi).arg(&wi);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: packed holds rows · groups · wpg words (upload_qmat validated the shape), `out`
        // as many; the kernel's grid-stride loop stays below that.
        unsafe { b.launch(cfg) }?;
        w.group_major_codes = Some(out);
        Ok(())
    }

    /// Adds the bf16 copy of `w` ([`DeviceQMat::bf16`]) that the prefill's dense products on the
    /// wide and big tiles read instead of dequantizing the codes when
    /// [`Self::set_gemm_bf16_weights`] is on: `rows · cols · 2` bytes (the dense projections of
    /// the full model: ~2.5 GB). Each value is computed as the GEMMs' dequantization computes it
    /// (`scale·q + bias`, one bf16 rounding), so the products keep their bits. One launch on
    /// [`Self::stream`], asynchronous.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `w` has a bf16 copy already, its codes are group-major in
    /// place (the kernel reads the MLX layout), or it is too large for the kernel's i32
    /// arguments; [`CudaError::Driver`] on allocation (out of memory) or launch.
    pub fn add_bf16_weights(&self, w: &mut DeviceQMat) -> Result<(), CudaError> {
        if w.bf16.is_some() {
            return Err(CudaError::Unsupported("add_bf16_weights: the matrix has a bf16 copy already".into()));
        }
        let packed = w.mlx_codes()?;
        let groups = w.cols / QUANT_GROUP;
        let n = w.rows * groups * 32;
        let (rows, gi, bits) = match (i32::try_from(w.rows), i32::try_from(groups), i32::try_from(n)) {
            (Ok(r), Ok(g), Ok(_)) => (r, g, w.bits.bits() as i32),
            _ => return Err(CudaError::Unsupported(format!("add_bf16_weights: a [{}, {}] matrix is too large for i32 sizes", w.rows, w.cols))),
        };
        if n == 0 {
            return Ok(());
        }
        let mut out = self.stream.alloc_zeros::<u32>(n)?;
        {
            let blocks = n.div_ceil(256).min(65_535) as u32;
            let mut b = self.stream.launch_builder(self.func("qmat_bf16_perm")?);
            b.arg(packed).arg(&w.scales).arg(&w.biases).arg(&mut out).arg(&rows).arg(&gi).arg(&bits);
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: packed holds rows · groups · 2·bits words in the MLX layout, scales and
            // biases rows · groups bf16 (upload_qmat validated the shapes), `out` rows · groups ·
            // 32 u32; the kernel's grid-stride loop stays below those.
            unsafe { b.launch(cfg) }?;
        }
        w.bf16 = Some(out);
        Ok(())
    }

    /// Rewrites `w`'s codes group-major in place ([`DeviceQMat::codes_group_major`]): the
    /// layout of [`Self::add_group_major_codes`] without keeping the MLX copy, so only the
    /// prefill GEMMs can read `w` afterwards (they then read it group-major whatever
    /// [`Self::set_gemm_group_major`] says). `w` must have its group-major scales
    /// ([`Self::add_group_major`]). Peak memory: the codes twice, briefly (the old buffer is
    /// freed once the copy is queued: its free is ordered after the copy on [`Self::stream`];
    /// should `w`'s buffer belong to another stream, this waits for the copy first).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] without the group-major scales, when the codes are
    /// group-major already, or as [`Self::add_group_major_codes`]; driver errors.
    pub fn regroup_codes(&self, w: &mut DeviceQMat) -> Result<(), CudaError> {
        if w.group_major.is_none() {
            return Err(CudaError::Unsupported("regroup_codes: the matrix has no group-major scales (add_group_major first)".into()));
        }
        self.add_group_major_codes(w)?;
        if let Some(codes) = w.group_major_codes.take() {
            // the old buffer is freed on its own stream, without waiting for the copy queued
            // on this one: the same stream orders them, another one must wait
            if !Arc::ptr_eq(w.packed.stream(), &self.stream) {
                self.stream.synchronize()?;
            }
            w.packed = codes;
        }
        w.codes_group_major = true;
        Ok(())
    }

    /// Forces the launch of the input projections ([`Self::gemv_norm`] on a matrix of at most
    /// `max(GDN_PROJ, ATTN_PROJ)` rows, i.e. not the LM head): `Some((ks_log2, blocks))` splits
    /// K over `2^ks_log2` warps and uses `blocks` blocks (clamped as in [`Self::gemv_tuned`]);
    /// `None` restores the default (`gemv_launch`: the most blocks that cover the matrix in one
    /// block-iteration, 97 for the GDN input projection on the H200). Fewer blocks each
    /// request more bytes before the PDL wait, and land during the MoE kernel on the SMs it
    /// leaves free instead of after it. The same bits either way (each 16-row tile is summed in
    /// the same order whatever block runs it, as long as the split is the same; another split
    /// sums K in other pieces). For measurement (`calla cuda-bench --in-proj-grid`); graphs
    /// captured earlier are captured again ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_in_proj_grid(&self, tune: Option<(i32, u32)>) {
        let packed = tune.map_or(0, |(ks, blocks)| ((ks.max(0) as u64) << 32) | blocks.max(1) as u64);
        self.launch_option_changed(self.in_proj_grid.swap(packed, std::sync::atomic::Ordering::Relaxed) != packed);
    }

    /// Picks the entry point of the 4-bit output projections with the router fold
    /// ([`Self::gemv_residual_router`] on an MLX-layout matrix; default [`OUT_PROJ_VARIANT`]):
    /// the wide one, or a slim one that can land beside the GDN step or the attention combine
    /// ([`OutProjVariant`]). The same bits either way. A matrix with a staged copy
    /// ([`Self::stage_qmat`]) runs the staged entry point whatever the variant. For measurement
    /// (`calla cuda-bench --out-proj-compare`); graphs captured earlier are captured again
    /// ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_out_proj_variant(&self, v: OutProjVariant) {
        self.launch_option_changed(self.out_proj_variant.swap(v as u8, std::sync::atomic::Ordering::Relaxed) != v as u8);
    }

    /// Lets every GDN decode step block ([`Self::gdn_decode_step`]) ask for `bytes` of dynamic
    /// shared memory it does not use (0, the default: none; clamped to 40 KB). A block of the step
    /// (256 threads, 64 registers, 3.5 KB) is small enough that the scheduler may put two or
    /// more on one SM, where the output projection's block then cannot land beside them before
    /// they finish; with ~10-28 KB of padding two of them no longer fit beside an input
    /// projection block (~205 KB). The same bits either way. For measurement; graphs captured
    /// earlier are captured again ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_gdn_step_smem_pad(&self, bytes: u32) {
        // within the 48 KB a block gets without opting in, beside the step's 3.5 KB of static
        let bytes = bytes.min(40 * 1024);
        self.launch_option_changed(self.gdn_step_smem_pad.swap(bytes, std::sync::atomic::Ordering::Relaxed) != bytes);
    }

    /// Measurement switches of [`Self::gdn_step_out`] (`flags` of `gdn_step_out_*`, 0 by
    /// default): bit 0 leaves `B` out (not copied, not multiplied: the router sums miss the
    /// output's share), bit 1 the output projection's tiles (`h − x` stays zero), bit 2 issues
    /// the bulk copies after the step instead of before the PDL wait, bit 3 gives the kernel no
    /// shared memory (its weights prefetched into L2 before the wait, read into registers after
    /// the step). Bits 0 and 1 make the outputs wrong (timing only). Graphs captured earlier are
    /// captured again.
    #[doc(hidden)]
    pub fn set_gdn_out_flags(&self, flags: u32) {
        let flags = flags & 15;
        self.launch_option_changed(self.gdn_out_flags.swap(flags, std::sync::atomic::Ordering::Relaxed) != flags);
    }

    /// Lets the GDN decode step ([`Self::gdn_decode_step`]) trigger its dependent launch (the
    /// output projection) at entry (`true`) instead of after its blocks' proj loads and conv
    /// (`false`, the default), so that the output projection's blocks land while the step runs.
    /// The same bits either way (the output projection reads only constants before its own
    /// wait, and triggers only after it). The timeline probe records no trigger stamp before a
    /// wait, so the step's trigger stamps stay the later ones. For measurement; graphs captured
    /// earlier are captured again ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_gdn_step_early_trigger(&self, on: bool) {
        self.set_launch_option(&self.gdn_step_early_trigger, on);
    }

    /// The entry point [`Self::set_out_proj_variant`] picked.
    #[doc(hidden)]
    pub fn out_proj_variant(&self) -> OutProjVariant {
        OutProjVariant::from_u8(self.out_proj_variant.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Lets the input projections ([`Self::gemv_norm`] on a matrix of at most
    /// `max(GDN_PROJ, ATTN_PROJ)` rows) request no weights before their PDL wait (`true`), all
    /// of them right after `x`'s loads, instead of their first ring stages (`false`, the
    /// default). Their blocks still land early, beside the MoE kernel, but take no bandwidth
    /// from its experts. The same bits either way. For measurement; graphs captured earlier are
    /// captured again ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_in_proj_late_weights(&self, on: bool) {
        self.set_launch_option(&self.in_proj_late_weights, on);
    }

    /// Lets the MoE cluster kernel after the router fold ([`Self::moe_fold_cluster`]) trigger
    /// the next launch (the next layer's input projection) once each block's expert tiles are
    /// all in shared memory (`true`) instead of right after its PDL wait (`false`, the default),
    /// so the input projection's blocks land, and request their weights, only after the
    /// experts have streamed. The same bits either way. For measurement; graphs captured
    /// earlier are captured again ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_moe_cluster_late_trigger(&self, on: bool) {
        self.set_launch_option(&self.moe_cluster_late_trigger, on);
    }

    /// With the timeline probe ([`timeline`]): the MoE cluster kernel after the fold stamps its
    /// blocks' mark when their expert copies are issued (`true`: after the top-k) instead of when
    /// the tiles are all in shared memory (`false`, the default). Nothing else changes. Graphs
    /// captured earlier are captured again ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_moe_cluster_mark_issue(&self, on: bool) {
        self.set_launch_option(&self.moe_cluster_mark_issue, on);
    }

    /// Measurement only, **wrong outputs**: the MoE cluster kernel after the fold
    /// ([`Self::moe_fold_cluster`]) streams the tiles of fixed experts (routed slot `s` reads
    /// expert `s · 32 + 7` of every layer) instead of the chosen ones, so that every decode step
    /// reads the same pages of expert weights; the timing against the routed step says what
    /// reading other experts each token (address translation, DRAM pages) costs. Graphs
    /// captured earlier are captured again ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_moe_cluster_pin_experts(&self, on: bool) {
        self.set_launch_option(&self.moe_cluster_pin_experts, on);
    }

    /// Measurement only, **wrong outputs**: parts of the decode step's kernels left out, to time
    /// what they cost in place. `gemv` (every decode GEMV): [`DIAG_GEMV_NO_TABLE`] skips x's
    /// loads and the digit table, [`DIAG_GEMV_NO_NORM`] builds the table without the fused
    /// RMSNorm, [`DIAG_GEMV_NO_FOLD`] skips the router fold's epilogue; `moe` (the MoE cluster
    /// kernels): [`DIAG_MOE_NO_COMBINE`] leaves once y is written. `(0, 0)` (the
    /// default) runs the kernels whole. Graphs captured earlier are captured again
    /// ([`Self::launch_generation`]).
    #[doc(hidden)]
    pub fn set_decode_diag(&self, gemv: u32, moe: u32) {
        let v = (moe & 0xFFFF) << 16 | (gemv & 0xFFFF);
        self.launch_option_changed(self.decode_diag.swap(v, std::sync::atomic::Ordering::Relaxed) != v);
    }

    /// `flags` bits of [`Self::set_decode_diag`] for the GEMVs (low half) or the MoE (high half).
    pub(crate) fn decode_diag_bits(&self, moe: bool) -> i32 {
        let v = self.decode_diag.load(std::sync::atomic::Ordering::Relaxed);
        (if moe { v >> 16 } else { v & 0xFFFF }) as i32
    }

    /// Lets the decode step's MoE cluster kernel after the router fold combine the experts by
    /// f64 atomics (`true`) instead of in the last block of each row slice (`false`): every
    /// block adds its rows' `w · y` (the shared expert's blocks also the residual `h`) into the
    /// next layer's accumulator set and leaves, and the next input projection (or the LM head)
    /// reads the sums through [`Self::gemv_norm_xd`], which also stores the residual stream.
    /// The terms (f32 products `w · y` and `h`) summed in f64 and rounded once, where the
    /// counted combine rounds an f32 `fma` chain at every term: not bit-equal to it (the
    /// self-test saw up to 240 f32 ulps on nearly cancelling sums; `kernels/moe.cu` `CL_HSUM`).
    /// Used by [`decode::CudaSession`] steps with the fold and the cluster kernel in every
    /// layer, and not with the split output projection, the GDN input-in-step variant or
    /// staged input projections / LM head (which `gemv_norm_xd` would bypass): those steps set
    /// `MoeScratch::hsum_combine` off and combine as before. Graphs captured earlier are
    /// captured again ([`Self::launch_generation`]).
    pub fn set_moe_hsum(&self, on: bool) {
        self.set_launch_option(&self.moe_hsum, on);
    }

    /// Whether the MoE combines by f64 atomics ([`Self::set_moe_hsum`]).
    pub fn moe_hsum(&self) -> bool {
        self.moe_hsum.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets one of the context-wide launch options to `on`; a change bumps the launch
    /// generation, so graphs captured earlier are captured again ([`Self::launch_generation`]).
    fn set_launch_option(&self, flag: &std::sync::atomic::AtomicBool, on: bool) {
        self.launch_option_changed(flag.swap(on, std::sync::atomic::Ordering::Relaxed) != on);
    }

    /// Bumps the launch generation when a context-wide launch option `changed`.
    fn launch_option_changed(&self, changed: bool) {
        if changed {
            self.launch_gen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn gemv_flags(&self) -> i32 {
        let early = if self.gemv_early_trigger.load(std::sync::atomic::Ordering::Relaxed) { GEMV_EARLY_TRIGGER } else { 0 };
        let all = if self.gemv_staged_all_early.load(std::sync::atomic::Ordering::Relaxed) { GEMV_STAGED_ALL_EARLY } else { 0 };
        let unit = if self.gemv_staged_unit.load(std::sync::atomic::Ordering::Relaxed) { GEMV_STAGED_UNIT } else { 0 };
        early | all | unit | self.decode_diag_bits(false)
    }

    /// Lets a staged GEMV whose warps each walk exactly one unit (the input projections on
    /// their default grid) request each warp's unit by one bulk copy of all its steps (`true`)
    /// instead of one copy per ring stage (`false`, the default): fewer, larger requests, as
    /// the MoE's cluster kernel makes. The same bits either way. For measurement; graphs
    /// captured earlier are captured again.
    #[doc(hidden)]
    pub fn set_gemv_staged_unit(&self, on: bool) {
        self.set_launch_option(&self.gemv_staged_unit, on);
    }

    /// Lets the staged GEMVs request every ring stage before their PDL wait (`true`, as the
    /// per-thread copies do) instead of two, the rest after `x`'s loads (`false`, the default).
    /// For measurement; graphs captured earlier are captured again.
    #[doc(hidden)]
    pub fn set_gemv_staged_all_early(&self, on: bool) {
        self.set_launch_option(&self.gemv_staged_all_early, on);
    }

    /// Generation of the context-wide launch options ([`Self::set_gemv_reg_cap`],
    /// [`Self::set_gemv_early_trigger`], [`Self::set_step_carveout`],
    /// [`Self::set_carveout_of`]): a graph captured under another generation is captured again
    /// before its next use (`CudaSession` checks this).
    pub fn launch_generation(&self) -> u64 {
        self.launch_gen.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Asks for the largest shared-memory carve-out (`pct` = 100) on every decode-step kernel,
    /// or the driver's default (`pct` = -1) on those that do not need it (the GEMVs always ask
    /// for 100). An SM changes its L1/shared split only when idle, so a kernel preferring a
    /// smaller carve-out can keep the next GEMV's 200 KB blocks off an SM until it drains.
    /// For measurement (`calla cuda-bench --compare`; measured slower); affects launches queued
    /// afterwards, and graphs captured earlier are captured again
    /// ([`Self::launch_generation`]). `pct` = -1 also undoes [`CARVEOUT_BEFORE_GEMV`].
    ///
    /// # Errors
    /// Driver errors from setting the attribute.
    #[doc(hidden)]
    pub fn set_step_carveout(&self, pct: i32) -> Result<(), CudaError> {
        self.set_carveout_where(|name| !name.starts_with("gemv_"), pct)
    }

    /// Kernels that run right before a decode-step GEMV (K = 2,048 or 4,096; ~200 KB of shared
    /// memory): the MoE down projection (before the next layer's input projection and the LM
    /// head), the GDN step and the attention combine (before the output projection).
    pub const BEFORE_GEMV: &'static [&'static str] = &["moe_down_", "gdn_decode_step", "attn_decode_combine"];

    /// [`Self::set_step_carveout`] for the entry points whose name starts with one of
    /// `prefixes` only (e.g. [`Self::BEFORE_GEMV`]): an SM configured for a kernel with a
    /// small carve-out cannot take a GEMV block beside it until it drains.
    ///
    /// # Errors
    /// Driver errors from setting the attribute.
    #[doc(hidden)]
    pub fn set_carveout_of(&self, prefixes: &[&str], pct: i32) -> Result<(), CudaError> {
        self.set_carveout_where(|name| prefixes.iter().any(|p| name.starts_with(p)), pct)
    }

    fn set_carveout_where(&self, pick: impl Fn(&str) -> bool, pct: i32) -> Result<(), CudaError> {
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        for (name, f) in &self.funcs {
            if pick(name) {
                f.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, pct)?;
            }
        }
        self.launch_gen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Registers per thread, static shared memory (bytes) and the most threads per block of
    /// every loaded entry point, sorted by name (for occupancy and co-residency analysis).
    pub fn kernel_resources(&self) -> Vec<(&'static str, i32, i32, i32)> {
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        let mut v: Vec<_> = self
            .funcs
            .iter()
            .map(|(name, f)| {
                let get = |a| f.get_attribute(a).unwrap_or(-1);
                (*name, get(A::CU_FUNC_ATTRIBUTE_NUM_REGS), get(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES), get(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK))
            })
            .collect();
        v.sort();
        v
    }

    /// Waits until all queued work is done.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// Device pointer of a buffer (for diagnostics).
    pub fn ptr_of(&self, s: &CudaSlice<f32>) -> u64 {
        let (p, _g) = s.device_ptr(&self.stream);
        p
    }
}

fn k_index(cols: usize) -> Result<usize, CudaError> {
    match cols {
        c if c == p::D_EXPERT => Ok(0),
        c if c == p::D_MODEL => Ok(1),
        c if c == p::N_Q_HEADS * p::HEAD_DIM => Ok(2),
        c => Err(CudaError::Unsupported(format!(
            "gemv with {c} input columns (built for {}, {}, {})",
            p::D_EXPERT,
            p::D_MODEL,
            p::N_Q_HEADS * p::HEAD_DIM
        ))),
    }
}

/// The GEMV launch the host picks for a `[rows, cols]` matrix at `bits` on `sm_count` SMs:
/// `(ks_log2, blocks)` (see [`CudaContext::gemv_tuned`]). For the self-test's sweeps.
#[doc(hidden)]
pub fn gemv_config(rows: usize, cols: usize, bits: usize, sm_count: u32) -> (i32, u32) {
    let (cfg, ks_log2) = gemv_launch(rows, cols, bits, sm_count);
    (ks_log2, cfg.grid_dim.0)
}

/// Warps per GEMV block (`NW` in `kernels/gemv.cu`); one block per SM.
const GEMV_WARPS: usize = 16;

/// [`CudaContext::set_decode_diag`] GEMV bit: no x loads, no digit table (`GEMV_DIAG_NO_TABLE`
/// in `kernels/gemv.cu`). Measurement only, wrong outputs.
#[doc(hidden)]
pub const DIAG_GEMV_NO_TABLE: u32 = 32;
/// [`CudaContext::set_decode_diag`] GEMV bit: the table without the fused RMSNorm.
#[doc(hidden)]
pub const DIAG_GEMV_NO_NORM: u32 = 64;
/// [`CudaContext::set_decode_diag`] GEMV bit: no router-fold epilogue in the output projection.
#[doc(hidden)]
pub const DIAG_GEMV_NO_FOLD: u32 = 128;
/// [`CudaContext::set_decode_diag`] MoE bit: no count and no combine (`CL_DIAG_NO_COMBINE`).
#[doc(hidden)]
pub const DIAG_MOE_NO_COMBINE: u32 = 16;

/// `flags` bit of every GEMV entry point: trigger the dependent launch right after the PDL
/// wait (`calla_gemv::GEMV_EARLY_TRIGGER` in `kernels/gemv.cu`).
const GEMV_EARLY_TRIGGER: i32 = 1;
/// `flags` bit of the chain kernel's GEMVs: weights requested after the barrier
/// (`calla_gemv::GEMV_CHAIN_LATE_WEIGHTS`).
const GEMV_CHAIN_LATE_WEIGHTS: i32 = 2;
/// `flags` bit of the staged GEMVs: every stage requested before the PDL wait
/// (`calla_gemv::GEMV_STAGED_ALL_EARLY`).
const GEMV_STAGED_ALL_EARLY: i32 = 4;
/// `flags` bit of the staged GEMVs: one bulk copy per warp's unit (`calla_gemv::GEMV_STAGED_UNIT`).
const GEMV_STAGED_UNIT: i32 = 8;
/// `flags` bit of every GEMV: no weights requested before the PDL wait
/// (`calla_gemv::GEMV_LATE_WEIGHTS`).
const GEMV_LATE_WEIGHTS: i32 = 16;

/// Bytes of one ring stage of a 4-bit decode GEMV: codes of 16 rows × 256 columns (2 KB),
/// then 32 cells of 8 bytes of scales or biases (`Cfg<4, K>::STAGE_BYTES`).
const STAGE_BYTES_Q4: usize = 2048 + 32 * 8;

/// The staged layout of [`CudaContext::stage_qmat`] from the stacked rows of `parts` (4-bit,
/// `cols` columns), as u32 words.
fn stage_rows(parts: &[QMatRef<'_>], cols: usize) -> Vec<u32> {
    use rayon::prelude::*;
    let rows: usize = parts.iter().map(|m| m.rows).sum();
    let tiles = rows.div_ceil(16);
    let nstep = cols / 256;
    let wpr = cols / 8; // u32 words per row at 4 bits
    let gpr = cols / QUANT_GROUP;
    let sw = STAGE_BYTES_Q4 / 4;
    // row r of the stack -> (part, row in it)
    let at = |r: usize| -> (&QMatRef<'_>, usize) {
        let mut r = r.min(rows - 1);
        for m in parts {
            if r < m.rows {
                return (m, r);
            }
            r -= m.rows;
        }
        unreachable!("row within the stack")
    };
    let mut out = vec![0u32; tiles * nstep * sw];
    out.par_chunks_mut(nstep * sw).enumerate().for_each(|(tile, img)| {
        for step in 0..nstep {
            let st = &mut img[step * sw..(step + 1) * sw];
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for h in 0..2 {
                    let (m, r) = at(tile * 16 + g + 8 * h);
                    for j in 0..2 {
                        // 16 bytes at byte offset step*128 + j*64 + t*16 of the row
                        let w0 = r * wpr + (step * 128 + j * 64 + t * 16) / 4;
                        let dst = ((h * 2 + j) * 512 + lane * 16) / 4;
                        st[dst..dst + 4].copy_from_slice(&m.packed[w0..w0 + 4]);
                    }
                }
                // this lane's cell: scales (t = 0, 1) or biases (t = 2, 3) of row g (t even) or
                // g + 8 (t odd), groups 4·step .. 4·step + 3, at the swizzled cell (sb_cell)
                let (m, r) = at(tile * 16 + g + 8 * (t & 1));
                let src = if t & 2 != 0 { m.biases } else { m.scales };
                let v: [u16; 4] = std::array::from_fn(|k| src[r * gpr + 4 * step + k].to_bits());
                let cell = lane ^ (((lane >> 4) & 1) << 1);
                let dst = (2048 + cell * 8) / 4;
                st[dst] = u32::from(v[0]) | (u32::from(v[1]) << 16);
                st[dst + 1] = u32::from(v[2]) | (u32::from(v[3]) << 16);
            }
        }
    });
    out
}

/// Dynamic shared memory of a GEMV block, as `calla_gemv::Cfg<BITS, K>::SMEM` in
/// `kernels/gemv.cu`: the B-fragment table (1 KB per 128 columns), the per-super-step constants
/// (64 B per 128 columns), and per warp a cp.async ring of `STAGES` steps, each the codes of
/// 16 rows x 256 columns (2 KB at 4 bits, 4 KB at 8) and 256 B of scales/biases. `STAGES` is 5
/// at 4 bits, 3 at 8 bits (2 above 2,048 columns): at most 221 KB of the 227 KB a block may use.
fn gemv_smem_bytes(bits: usize, cols: usize) -> usize {
    let stages = match (bits, cols / 128) {
        (4, _) => 5,
        (_, n) if n <= 16 => 3,
        _ => 2,
    };
    gemv_smem_bytes_with(bits, cols, stages)
}

/// Lets one-block-per-SM kernel `f` take `bytes` of dynamic shared memory (beyond the default
/// 48 KB) and asks for all of the L1/shared carve-out for it, as the decode GEMVs need (one
/// 512-thread block per SM, up to 221 KB).
fn allow_block_smem(f: &CudaFunction, bytes: usize) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)?;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
}

/// [`gemv_smem_bytes`] for a ring of `stages` stages (`calla_gemv::Cfg<BITS, K, ST>`).
fn gemv_smem_bytes_with(bits: usize, cols: usize, stages: usize) -> usize {
    let nss = cols / 128;
    let stage_bytes = 2 * (bits / 2) * 32 * 16 + 32 * 8;
    nss * 1024 + nss * 64 + GEMV_WARPS * stages * stage_bytes
}

/// Which entry point runs the decode step's 4-bit output projection with the router fold
/// ([`CudaContext::set_out_proj_variant`]; `kernels/gemv.cu`, "Slim output projections"). All
/// compute the same bits. The wide one takes 102 registers per thread and ~219 KB of shared
/// memory, so its blocks cannot land on an SM while a GDN step block (registers) or an
/// attention combine block (shared memory) still runs there; the slim ones can.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutProjVariant {
    /// `gemv_resid_rf_r*_g*_q4_k4096`: unbounded registers, a 5-stage ring (the default until
    /// session 20).
    Wide = 0,
    /// `gemv_resid_rf_c88_*`: at most 88 registers per thread (fits beside the GDN step).
    Cap88 = 1,
    /// `gemv_resid_rf_c88s3_*`: at most 88 registers and a 3-stage ring (145,408 B of dynamic
    /// shared memory; fits beside the GDN step and the attention combine). The default
    /// ([`OUT_PROJ_VARIANT`]).
    Cap88Stages3 = 2,
}

impl OutProjVariant {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Cap88,
            2 => Self::Cap88Stages3,
            _ => Self::Wide,
        }
    }

    /// The entry point for router bits `rb` and shared-gate bits `gb` (4 or 8), 4-bit weights.
    pub(crate) fn entry(self, rb: u32, gb: u32) -> String {
        let tag = match self {
            Self::Wide => "",
            Self::Cap88 => "c88_",
            Self::Cap88Stages3 => "c88s3_",
        };
        format!("gemv_resid_rf_{tag}r{rb}_g{gb}_q4_k{}", p::N_V_HEADS * p::D_V)
    }

    /// Dynamic shared memory of the entry point (4-bit, K = N_V_HEADS * D_V), bytes.
    pub(crate) fn smem_bytes(self) -> usize {
        let k = p::N_V_HEADS * p::D_V;
        match self {
            Self::Cap88Stages3 => gemv_smem_bytes_with(4, k, 3),
            _ => gemv_smem_bytes(4, k),
        }
    }
}

/// How [`CudaContext::stream_probe`]'s blocks move their bytes into shared memory.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamProbe {
    /// Bulk copies (TMA) from lanes of warp 0, on one mbarrier (the MoE cluster kernel's way).
    Bulk,
    /// The same in thread-block clusters of 8 (placed within one GPC each).
    BulkClusters,
    /// Per-thread 16-byte `cp.async` (the decode GEMVs' way).
    Threads,
}

/// `(ks_log2, blocks)` for a forced GEMV launch on `mat`: the split clamped to
/// `0..=min(log2 GEMV_WARPS, log2(cols / 256))`, the blocks to `1..=` the block-iterations.
fn clamp_gemv_tune(mat: &DeviceQMat, ks: i32, blocks: u32) -> (i32, u32) {
    let nstep = mat.cols / 256;
    let ks_log2 = ks.clamp(0, GEMV_WARPS.trailing_zeros() as i32).min(nstep.trailing_zeros() as i32);
    let tpb = GEMV_WARPS >> ks_log2;
    let useful = mat.rows.div_ceil(16).div_ceil(tpb) as u32;
    (ks_log2, blocks.clamp(1, useful))
}

/// `(ks_log2, blocks)` of [`gemv_launch`].
fn gemv_split(rows: usize, cols: usize, sm_count: u32) -> (i32, usize) {
    let nstep = cols / 256;
    let m_tiles = rows.div_ceil(16);
    let max_blocks = sm_count.max(1) as usize;
    let splits = (0..=GEMV_WARPS.trailing_zeros() as i32).filter(|&k| (1usize << k) <= nstep);
    // one round on at least half of the SMs: the most blocks
    let one_round = splits
        .clone()
        .map(|k| (k, m_tiles.div_ceil(GEMV_WARPS >> k)))
        .filter(|&(_, b)| b <= max_blocks && 2 * b >= max_blocks)
        .max_by_key(|&(_, b)| b);
    if let Some(best) = one_round {
        return best;
    }
    let mut best: Option<(f64, usize, i32)> = None;
    for ks_log2 in splits {
        let ksplit = 1usize << ks_log2;
        let block_iters = m_tiles.div_ceil(GEMV_WARPS / ksplit);
        let blocks = block_iters.min(max_blocks);
        let iters = block_iters.div_ceil(blocks);
        let cost = (iters * (nstep / ksplit)) as f64 + if ks_log2 > 0 { 0.1 * iters as f64 } else { 0.0 };
        if best.is_none_or(|(c, _, _)| cost < c) {
            best = Some((cost, blocks, ks_log2));
        }
    }
    let (_, blocks, ks_log2) = best.expect("cols >= 256");
    (ks_log2, blocks)
}

/// Launch configuration of the GEMV and its `ks_log2` (K split over `2^ks_log2` warps of a
/// block): 512-thread blocks, one per SM; a block-iteration covers `16 / 2^ks_log2` tiles of
/// 16 rows, each warp a k-slice of `cols / 256 / 2^ks_log2` steps (256 columns).
///
/// The choice follows the H200 sweep (`cuda_selftest --only gemv --gemv-sweep`, docs/CUDA.md):
/// * when some split covers the matrix in a single block-iteration on at least half of the SMs,
///   the one with the most blocks: every byte is requested at kernel start and no warp waits on
///   a second round of barriers (9,216 x 2,048 at 4 bits: split 2 on 72 blocks 7.9 µs, split 8
///   in up to 3 rounds on 132 blocks 8.2 µs; 2,048 x 4,096: split 16 on 128 blocks 5.2 µs,
///   split 8 on 64 blocks 5.8 µs);
/// * otherwise the fewest steps per warp, a split-K reduction (a block barrier) counted as 0.1
///   step (LM head: split 2, 15 rounds of 4 steps, 72.1 µs; unsplit, 8 rounds of 8 steps with
///   the last one 35% full, 77.0 µs).
fn gemv_launch(rows: usize, cols: usize, bits: usize, sm_count: u32) -> (LaunchConfig, i32) {
    let (ks_log2, blocks) = gemv_split(rows, cols, sm_count);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: gemv_smem_bytes(bits, cols) as u32,
    };
    (cfg, ks_log2)
}

#[cfg(test)]
mod gemv_launch_tests {
    use super::gemv_split;

    /// The launch choices the H200 sweep measured as best (docs/CUDA.md, GEMV).
    #[test]
    fn splits_follow_the_sweep() {
        assert_eq!(gemv_split(248_320, 2048, 132), (1, 132)); // LM head
        assert_eq!(gemv_split(12_352, 2048, 132), (1, 97)); // GDN in_proj
        assert_eq!(gemv_split(9216, 2048, 132), (1, 72)); // attention q|gate|k|v
        assert_eq!(gemv_split(4096, 2048, 132), (3, 128));
        assert_eq!(gemv_split(2048, 4096, 132), (4, 128)); // o_proj / out_proj
        assert_eq!(gemv_split(2048, 512, 132), (1, 16)); // expert down
        assert_eq!(gemv_split(8, 512, 132), (1, 1));
    }
}
