//! `calla cuda-bench` and `calla cuda-check`: the CUDA backend (cargo feature `cuda`) measured on
//! a checkpoint, and checked end to end against the CPU path.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use cuda::decode::{CudaModel, CudaSession};
use cuda::prefill::Prefiller;
use cuda::CudaContext;
use model::{Logits, Model};
use spec::production as p;

/// The decode step's MoE launches (`--moe`), for measurement and checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MoePath {
    /// What `CudaSession::new` picks: `fold-cluster` when every expert matrix is 4-bit and the
    /// model has at least two layers, else `three` (the fold needs fused norms: with
    /// `--no-fuse-norm`, `fold-cluster` runs as `cluster` and `fold` as `three`).
    Auto,
    /// The router kernel (top-k in its last block), gate/up, down + combine: three kernels.
    Three,
    /// The router folded into the output projection, then gate/up and down.
    Fold,
    /// The router kernel, then one thread-block cluster per expert (gate/up, down, combine).
    Cluster,
    /// The router folded into the output projection, then a cluster per expert.
    FoldCluster,
    /// Router, top-k, gate/up and down as one launch with grid-wide barriers.
    Fused,
}

/// The entry point of the 4-bit output projections with the router fold (`--out-proj`;
/// `cuda::OutProjVariant`): all compute the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutProj {
    /// Unbounded registers (102), a 5-stage ring (~219 KB of shared memory): the default
    /// until session 20.
    Wide,
    /// At most 88 registers per thread: fits on an SM beside a GDN step block.
    C88,
    /// At most 88 registers and a 3-stage ring (142 KiB): also beside an attention combine
    /// block. The default (`cuda::OUT_PROJ_VARIANT`).
    C88s3,
}

impl OutProj {
    fn variant(self) -> cuda::OutProjVariant {
        match self {
            Self::Wide => cuda::OutProjVariant::Wide,
            Self::C88 => cuda::OutProjVariant::Cap88,
            Self::C88s3 => cuda::OutProjVariant::Cap88Stages3,
        }
    }
}

impl MoePath {
    /// Sets the session's router fold and MoE flags for this path (`Auto`: leaves the
    /// defaults, with `down_r48` applied).
    fn apply(self, sess: &mut CudaSession, down_r48: bool) {
        use cuda::moe::MoeFlags;
        let base = MoeFlags { down_reg_cap: down_r48, ..MoeFlags::DEFAULT };
        let (fold, flags) = match self {
            MoePath::Auto => (sess.router_fold(), MoeFlags { down_reg_cap: down_r48, ..sess.moe_flags() }),
            MoePath::Three => (false, base),
            MoePath::Fold => (true, base),
            MoePath::Cluster => (false, MoeFlags { cluster: true, ..base }),
            MoePath::FoldCluster => (true, MoeFlags { cluster: true, ..base }),
            MoePath::Fused => (false, MoeFlags { fused: true, ..base }),
        };
        sess.set_router_fold(fold);
        sess.set_moe_flags(flags);
    }
}

/// The prefill's router kernels (`--prefill-router`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefillRouter {
    /// Integer products on the tensor cores (`CudaContext::router_logits_digits`).
    Digits,
    /// Sequential f32 chains on the CUDA cores (`CudaContext::router_logits_f32`).
    F32,
}

impl PrefillRouter {
    /// The library's default (`cuda::prefill::ROUTER_F32_DEFAULT`).
    const DEFAULT: PrefillRouter = if cuda::prefill::ROUTER_F32_DEFAULT { PrefillRouter::F32 } else { PrefillRouter::Digits };
}

/// The prefill GEMMs' main loop (`--gemm-main-loop`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GemmMainLoop {
    /// The plain wgmma loop (`cuda::gemm::GemmEngine::Wgmma`).
    Plain,
    /// The same with its copies in fewer instructions (`cuda::gemm::GemmEngine::WgmmaLean`).
    Lean,
}

impl GemmMainLoop {
    /// The library's default (`cuda::gemm::GEMM_LEAN_DEFAULT`).
    const DEFAULT: GemmMainLoop = if cuda::gemm::GEMM_LEAN_DEFAULT { GemmMainLoop::Lean } else { GemmMainLoop::Plain };
}

/// The batched prefill's options shared by `cuda-bench` and `cuda-check` (set process-wide by
/// `set_prefill_options`, so the engine's accelerator gets them too).
#[derive(Args, Debug, Clone)]
pub struct PrefillFlags {
    /// The prefill's MoE router: `f32` (sequential f32 chains) or `digits` (integer products on
    /// the tensor cores); the default is `cuda::prefill::ROUTER_F32_DEFAULT`'s.
    #[arg(long, value_enum, default_value_t = PrefillRouter::DEFAULT)]
    prefill_router: PrefillRouter,
    /// The prefill GEMMs' main loop: plain or lean (the same bits); the default is `cuda::gemm::GEMM_LEAN_DEFAULT`'s.
    #[arg(long, value_enum, default_value_t = GemmMainLoop::DEFAULT)]
    gemm_main_loop: GemmMainLoop,
    /// The prefill's norms write f32 rows that each GEMM converts to bf16 itself, instead of
    /// writing the GEMMs' activations (the same bits; `Prefiller::fused_norm_acts`).
    #[arg(long)]
    prefill_norm_acts_apart: bool,
    /// The grouped expert GEMMs' narrow tile on the lean loop at two blocks per SM instead of
    /// three (the same bits; `CudaContext::set_gemm_grouped3`).
    #[arg(long)]
    gemm_grouped2: bool,
    /// The dense GEMMs' weight tiles by per-thread `cp.async` copies instead of bulk copies
    /// (the same bits; `CudaContext::set_gemm_bulk`).
    #[arg(long)]
    gemm_no_bulk: bool,
    /// The grouped expert GEMMs' weight tiles by bulk copies too (measured slower; the same
    /// bits; `CudaContext::set_gemm_bulk_grouped`).
    #[arg(long)]
    gemm_bulk_grouped: bool,
    /// The 4-bit grouped expert GEMMs (tall and narrow tiles) on the warp-specialized loop
    /// (a producer warpgroup dequantizing into shared memory; the same bits;
    /// `CudaContext::set_gemm_ws`).
    #[arg(long)]
    gemm_ws: bool,
    /// Long prompts' dense GEMMs never on the wide tile (128 weight rows × 256 tokens), which
    /// they take from 256 tokens on otherwise (the same bits unless split over K, where the
    /// number of splits can differ; `CudaContext::set_gemm_wide`).
    #[arg(long)]
    gemm_no_wide: bool,
    /// 8k chunks' GDN input projection (12,352 rows) on the wide tile like every other dense
    /// product, instead of the big tile (256 rows × 128 tokens) it takes by default since
    /// session 56 (the same bits; `CudaContext::set_gemm_big_long`).
    #[arg(long)]
    gemm_no_big_long: bool,
    /// Give the dense projections (GDN and attention input and output projections, the shared
    /// experts) bf16 copies of their weights at upload (~2.7 GB for the full model) and run their long-prompt
    /// products (wide and big tiles) on them: the A tile copied, not dequantized, and read by
    /// wgmma from shared memory (session 57; the same bits, `CudaContext::set_gemm_bf16_weights`;
    /// `--prefill-compare` case `dense_bf16_weights_ms` then times both).
    #[arg(long)]
    gemm_bf16_weights: bool,
    /// Long prompts' grouped expert GEMMs on the wide tile from 192 entries per expert (the
    /// same bits; measured slower, session 32; `CudaContext::set_gemm_wide_grouped`).
    #[arg(long)]
    gemm_wide_grouped: bool,
    /// The attention prefill never splits a causal prompt's key ranges in two (the plans of
    /// before session 41; `CudaContext::set_attn_causal_split`).
    #[arg(long)]
    attn_no_causal_split: bool,
    /// The attention prefill's 128-row tile warp-specialized (a producer warpgroup and two
    /// consumer warpgroups taking turns on the tensor cores; `--attn-ws-form` says which; the
    /// same bits) or as before session 53 (`false`: `Wg128`). Default:
    /// `cuda::attn_prefill::ATTN_WS_DEFAULT`; `CudaContext::set_attn_ws`.
    #[arg(long, value_name = "BOOL")]
    attn_ws: Option<bool>,
    /// Which warp-specialized tile `--attn-ws true` (and the `--prefill-compare` case
    /// `attn_wg128ws_ms`) runs: `tma` (bulk tensor copies; the default), `ws` (cp.async from
    /// the producer warpgroup) or `mc` (bulk tensor copies multicast over clusters of two
    /// blocks).
    #[arg(long, value_name = "FORM", default_value = "tma", value_parser = ["ws", "tma", "mc"])]
    attn_ws_form: String,
    /// The GDN prefill's state kernel with every product on mma.sync (`GdnPrefillMath::Tf32`)
    /// instead of on warpgroup MMAs (wgmma, the default; the same bits).
    #[arg(long, conflicts_with = "gdn_prefill_wg")]
    gdn_prefill_mma: bool,
    /// The GDN prefill's state kernel with only `W·S` and `Q̂·S` on warpgroup MMAs and its
    /// chunk update (`K̂ᵀV'`, `P·V'`) on mma.sync (`GdnPrefillMath::Tf32Wg`, the default of
    /// sessions 46-47; the same bits).
    #[arg(long)]
    gdn_prefill_wg: bool,
    /// The GDN prefill's TF32 prep kernel in its form before session 52 (`gdnp_prep_tf32lx`:
    /// the `Tm` products' operands rounded at every load, A and P made apart; the same bits;
    /// `GdnPrefillScratch::set_prep_lean`).
    #[arg(long)]
    gdn_prep_old: bool,
    /// The GDN prefill's lean TF32 prep with its four `Tm` products one 16-row tile per warp
    /// (`gdnp_prep_tf32`, the default before session 56: warp w does 2 to 8 k-steps, where the
    /// default `gdnp_prep_tf32b` balances them at 10 per warp; the same bits, self-test
    /// `gdnpre`; `GdnPrefillScratch::set_prep_balanced`).
    #[arg(long)]
    gdn_prep_unbalanced: bool,
    /// The GDN prefill's gated norm inside its state kernel (`gdnp_state_tf32wgcn`, session 55:
    /// the four blocks of a V head as a cluster exchange their rows' partial sums of squares and
    /// write out_proj's bf16 activations themselves; no `gdnp_norm_acts` launch; the same
    /// bits, self-test `acts`; measured slower on an H100 in session 56, which holds 30 of its
    /// 32 clusters at once: +60% for the layer's state and norm at 8k;
    /// `GdnPrefillScratch::set_fused_norm`).
    #[arg(long)]
    gdn_fused_norm: bool,
    /// That fused norm without clusters: the partial sums through global memory in tagged
    /// 8-byte words (`gdnp_state_tf32wgcg`, session 55; for GPUs that hold fewer than 32 of the
    /// cluster form's clusters at once; implies --gdn-fused-norm; the same bits; measured
    /// slower on an H100 in session 56: +7% for the layer's state and norm at 8k;
    /// `GdnPrefillScratch::set_fused_norm_global`).
    #[arg(long)]
    gdn_fused_norm_global: bool,
    /// Launch the prefill's kernels without programmatic dependent launch (a full stream
    /// boundary between every two; the same bits; `Prefiller::eager_pdl`).
    #[arg(long)]
    prefill_no_pdl: bool,
    /// Never split the prefill's dense GEMMs over K (short prompts split them by default;
    /// other bits, the same rounding class; `CudaContext::set_gemm_splitk`).
    #[arg(long)]
    gemm_no_splitk: bool,
    /// The wgmma GEMMs multiply every tile at its full token width instead of the narrowest
    /// width that covers its tokens (the same bits; `CudaContext::set_gemm_fit_n`).
    #[arg(long)]
    gemm_full_n: bool,
    /// The dense GEMMs with `+ residual` (GDN out_proj, attention o_proj) write their f32
    /// outputs as 4-byte elements straight from the MMA accumulators instead of 16-byte runs
    /// staged in shared memory (the same bits; `CudaContext::set_gemm_staged_epilogue`).
    #[arg(long)]
    gemm_epilogue_direct: bool,
    /// The grouped MoE down GEMM stores each routed entry's row as f32 for the combine instead
    /// of bf16 (other bits: one rounding fewer; `CudaContext::set_moe_slot_bf16`).
    #[arg(long)]
    moe_slot_f32: bool,
}

/// Arguments of `calla cuda-bench`.
#[derive(Args)]
pub struct CudaBenchArgs {
    /// MLX-layout quantized snapshot (e.g. `calla synth --bits 4`).
    #[arg(long)]
    model: PathBuf,
    /// Prompt lengths to prefill (TTFT and prefill tok/s), comma-separated.
    #[arg(long, default_value = "512,2048,8192", value_delimiter = ',')]
    prompt_tokens: Vec<usize>,
    /// Context lengths at which to measure decode, comma-separated.
    #[arg(long, default_value = "128,4096,32768", value_delimiter = ',')]
    decode_contexts: Vec<usize>,
    /// Tokens decoded per measurement.
    #[arg(long, default_value_t = 256)]
    gen_tokens: usize,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Prompt processing: `batched` (chunked prefill kernels) or `graph` (the decode step per token).
    #[arg(long, default_value = "batched")]
    prefill: String,
    /// Largest prefill chunk in tokens (batched prefill).
    #[arg(long, default_value_t = 8192)]
    prefill_chunk: usize,
    /// Capture the decode step with programmatic dependent launch.
    #[arg(long)]
    pdl: bool,
    /// Run every RMSNorm of the decode step as its own launch instead of fused into the next
    /// kernel (for comparison; the same bits either way).
    #[arg(long)]
    no_fuse_norm: bool,
    /// Let latency-bound decode kernels prefetch the next weights into L2 (measured slower; for
    /// comparison).
    #[arg(long)]
    l2_prefetch: bool,
    /// How the decode step runs each layer's MoE block (see `MoePath`): `auto` (the session's
    /// default), `three`, `fold`, `cluster`, `fold-cluster` or `fused`.
    #[arg(long, value_enum, default_value_t = MoePath::Auto)]
    moe: MoePath,
    /// Run each GDN layer's input projection and step as one launch (`CudaSession::set_gdn_in_step`;
    /// restacks the GDN input projections first: 13.5 MB per layer at 4 bits) instead of the
    /// fused-norm GEMV and the step (measured faster).
    #[arg(long)]
    gdn_in_step: bool,
    /// Run each GDN layer's step, output projection and router sums as one launch and its
    /// experts after it (`CudaSession::set_gdn_out_split`; builds the split output projections
    /// first: 9.0 MB per layer, ~2.2 G multiply-adds per layer on the CPU) instead of the step,
    /// the output projection with the router folded in and the MoE cluster kernel.
    #[arg(long)]
    gdn_out_split: bool,
    /// Give the 4-bit input and output projections a staged copy (`CudaModel::stage_gemvs`, ~720 MB
    /// at full size) that the decode step's fused-norm input projections and router-fold output
    /// projections read by bulk copies (TMA) instead of per-thread copies of the MLX layout (the
    /// same bits; measured slower).
    #[arg(long)]
    gemv_staged: bool,
    /// With `--gemv-staged`: let each warp of a staged input projection request its whole
    /// unit by one bulk copy (`CudaContext::set_gemv_staged_unit`; the same bits).
    #[arg(long)]
    gemv_staged_unit: bool,
    /// Ask for the largest shared-memory carve-out on the kernels that run right before a
    /// decode GEMV (`CudaContext::BEFORE_GEMV`), so the GEMV's blocks can land beside them.
    /// The default since session 20 (`cuda::CARVEOUT_BEFORE_GEMV`), so a no-op then; the
    /// `--compare` row "driver carve-out" and the `--out-proj-compare` rows "driver carve-out"
    /// measure without it.
    #[arg(long)]
    carveout_before_gemv: bool,
    /// Let every decode GEMV trigger the next kernel's launch right after its PDL wait
    /// (`CudaContext::set_gemv_early_trigger`).
    #[arg(long)]
    gemv_early_trigger: bool,
    /// Run the MoE down projection with at most 48 registers per thread (`MoeFlags::down_reg_cap`),
    /// so an input-projection GEMV block fits beside it in every SM sub-partition.
    #[arg(long)]
    moe_down_r48: bool,
    /// Also measure decode (first decode context) with each step option off in turn, in this
    /// process on the same weights: L2 prefetch, fused norms, both.
    #[arg(long)]
    compare: bool,
    /// Also measure each kernel class's share of the decode step (at the first decode context):
    /// the step is captured again with that class left out, and the time it saves is listed
    /// with the class's launches per step.
    #[arg(long)]
    ablate: bool,
    /// Also lay out the decode step (first decode context) as a kernel timeline, once per
    /// shared-memory carve-out setting: the kernels are compiled with a probe that logs, per
    /// block, when it became resident, was released by the previous kernel and triggered the
    /// next (`cuda::timeline`); prints per entry point what each launch adds to the step. The
    /// probe slows every kernel (~14% per step on the H200), so the other figures of such a run
    /// are not the plain ones.
    #[arg(long)]
    timeline: bool,
    /// With `--timeline`: also write the raw records (little-endian u64, 8 words per block
    /// record: `cuda::timeline::Record` in field order; the JSON lists the kernels) to this path
    /// with the extension replaced by `<carve-out setting>.bin`.
    #[arg(long)]
    timeline_raw: Option<PathBuf>,
    /// Also split the batched prefill of each prompt length into its phases (GPU time between
    /// timed events: embedding, norms, projections, GDN / attention core, router, routing,
    /// expert GEMMs, ...), summed over layers.
    #[arg(long)]
    prefill_profile: bool,
    /// Also time the batched prefill of each prompt length as configured, with the shared
    /// expert on the main stream instead of its own, with the other router (f32 chains or
    /// integer products) and with the dense projections' GEMMs reading the other layout of
    /// their codes, scales and biases (group-major or MLX; the experts' prefill copies are
    /// group-major in place either way), on the other GEMM main loop, with the norms and
    /// conversions apart (or fused), the grouped GEMMs at the other blocks per SM, the
    /// kernels launched without (or with) programmatic dependent launch, the MoE routing in
    /// four launches (or two), the dense GEMMs never (or sometimes) split over K and the
    /// GEMMs' MMAs at the full tile width (or fitted to each tile's tokens), and every other
    /// switch of `PREFILL_CASES` (the keys `--prefill-compare-only` names), alternating, in
    /// this process (median of 5 each by default, `--prefill-compare-rounds`).
    #[arg(long)]
    prefill_compare: bool,
    /// With `--prefill-compare`: only the cases whose JSON key (either one, e.g.
    /// `attn_wg128ws_ms` or `attn_wg128_ms`) is in this comma-separated list.
    #[arg(long, value_delimiter = ',', value_name = "KEYS")]
    prefill_compare_only: Vec<String>,
    /// With `--prefill-compare`: rounds of the interleaved runs (the first warms up and is not
    /// counted; the medians are over the others).
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(2..=200))]
    prefill_compare_rounds: u32,
    #[command(flatten)]
    prefill_flags: PrefillFlags,
    /// Also time decode (first decode context) with the input projections launched as
    /// `KS:BLOCKS` (K split over 2^KS warps, BLOCKS blocks; `CudaContext::set_in_proj_grid`),
    /// each entry in turn, between two rows as configured, in this process.
    #[arg(long, value_delimiter = ',', value_parser = parse_grid)]
    in_proj_grid: Vec<(i32, u32)>,
    /// Launch the input projections as `KS:BLOCKS` for the whole run (decode rows, timeline).
    #[arg(long, value_parser = parse_grid)]
    in_proj_grid_set: Option<(i32, u32)>,
    /// Also time decode (first decode context) with the input projections requesting their
    /// weights only after their wait, with the MoE cluster kernel triggering the next launch
    /// only once its expert tiles are here, and both, between two rows as configured.
    #[arg(long)]
    prefetch_compare: bool,
    /// For the whole run: the input projections request their weights after their wait
    /// (`CudaContext::set_in_proj_late_weights`).
    #[arg(long)]
    in_proj_late_weights: bool,
    /// For the whole run: the MoE cluster kernel triggers the next launch once its expert tiles
    /// are here (`CudaContext::set_moe_cluster_late_trigger`).
    #[arg(long)]
    moe_late_trigger: bool,
    /// With `--timeline`: the MoE cluster kernel's mark is when its expert copies are issued
    /// (after the top-k) instead of when its tiles are all here
    /// (`CudaContext::set_moe_cluster_mark_issue`).
    #[arg(long)]
    moe_mark_issue: bool,
    /// For the whole run: the entry point of the 4-bit output projections with the router fold
    /// (`CudaContext::set_out_proj_variant`).
    #[arg(long, value_enum, default_value_t = OutProj::C88s3)]
    out_proj: OutProj,
    /// Also time decode (first decode context) with each output projection (`wide`, `c88`,
    /// `c88s3`) under the driver's carve-out and the largest before the GEMVs, the GDN step
    /// triggering at entry and its blocks padded with 12 KB, and the MoE cluster kernel with
    /// the largest carve-out too, between two rows as configured, in this process.
    #[arg(long)]
    out_proj_compare: bool,
    /// For the whole run: unused dynamic shared memory (bytes, at most 40 KB) per GDN decode
    /// step block (`CudaContext::set_gdn_step_smem_pad`); `--out-proj-compare` also times 12 KB.
    #[arg(long, default_value_t = 0)]
    gdn_pad: u32,
    /// For the whole run: the GDN step triggers the output projection's launch at entry
    /// (`CudaContext::set_gdn_step_early_trigger`); `--out-proj-compare` also times it.
    #[arg(long)]
    gdn_early_trigger: bool,
    /// The decode step's MoE combine: by f64 atomics (`true`) or by the last block of each
    /// row slice (`false`); default `cuda::moe::MOE_HSUM_DEFAULT` (`CudaContext::set_moe_hsum`,
    /// process-wide).
    #[arg(long)]
    moe_hsum: Option<bool>,
    /// Also time decode (first decode context) with the MoE cluster kernel streaming fixed
    /// experts' tiles every token instead of the chosen ones (wrong outputs, timing only:
    /// `CudaContext::set_moe_cluster_pin_experts`), between two rows as configured: what reading
    /// other experts' pages each token costs.
    #[arg(long)]
    moe_pin_compare: bool,
    /// Also time decode (first decode context) with the split output projection in every GDN
    /// layer (`--gdn-out-split`'s step) between two rows as configured.
    #[arg(long)]
    gdn_out_split_compare: bool,
    /// Stage the LM head for bulk copies (`CudaModel::stage_lm_head`: ~270 MB more at full
    /// size; the same bits).
    #[arg(long)]
    stage_lm_head: bool,
    /// Also time decode (first decode context) with the staged GEMVs flipped
    /// (`CudaContext::set_gemv_staged`) between two rows as configured; stages the LM head.
    /// Without `--gemv-staged` that flips the LM head's copies alone.
    #[arg(long)]
    lm_head_compare: bool,
    /// Also time decode (first decode context) with parts of the GEMVs and of the MoE cluster
    /// kernel left out (wrong outputs, timing only: `CudaContext::set_decode_diag`), between
    /// two rows as configured: what the digit table, the fused norm, the router fold's
    /// epilogue and the MoE's combine (the counted one, or the atomics where they are on) cost
    /// in place.
    #[arg(long)]
    diag_compare: bool,
    /// Also time decode (first decode context) with the MoE's combine flipped between the
    /// counted last block and f64 atomics (`CudaContext::set_moe_hsum`), alternating with rows
    /// as configured.
    #[arg(long)]
    hsum_compare: bool,
    /// Also time decode (first decode context) with each MoE cluster kernel asking L2 for the
    /// next input projection's late-landing rows (`CudaSession::set_moe_l2_late`; hints only),
    /// alternating with rows as configured.
    #[arg(long)]
    moe_l2_compare: bool,
    /// For the whole run: the L2 follower beside the decode step (`CudaSession::set_l2_follow`,
    /// `cuda::follow::FollowPlan::parse`: parts `in`, `out`, `out-next`, `router`, `shared`,
    /// `in-late` joined by `+`, then `:BLOCKS`, `:last`, `:ef` and `:mN`, e.g. `in:16` or
    /// `out+out-next+in-late:m64`; `none`: no follower),
    /// process-wide; default `cuda::follow::FollowPlan::DEFAULT` (`out+out-next:16`).
    #[arg(long, value_parser = parse_follow)]
    l2_follow: Option<FollowArg>,
    /// Also time decode (first decode context) with each of these L2 follower plans (comma
    /// separated, as `--l2-follow`, `none` for no follower), alternating with rows as
    /// configured.
    #[arg(long, value_delimiter = ',')]
    follow_compare: Vec<String>,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One row of `cuda-bench --in-proj-grid` / `--prefetch-compare`: the input projections'
/// launch (`None`: as configured), whether they request their weights after their wait, whether
/// the MoE cluster kernel triggers late (`false`: as configured).
struct FocusRow {
    name: String,
    grid: Option<(i32, u32)>,
    late_w: bool,
    late_t: bool,
    /// The output projections' entry point (`None`: as configured).
    out: Option<OutProj>,
    /// The carve-out setting (`CARVEOUTS` index; `None`: as configured).
    carve: Option<u8>,
    /// The GDN step blocks' shared-memory padding (`None`: as configured).
    gdn_pad: Option<u32>,
    /// The GDN step triggers at entry (`false`: as configured).
    gdn_early: bool,
    /// GDN layers run the split output projection (`false`: as configured).
    split: bool,
    /// `CudaContext::set_gdn_out_flags` of the split output projection (measurement switches).
    split_flags: u32,
    /// The MoE cluster kernels (before each input projection) also ask for the largest
    /// carve-out (`false`: as configured).
    moe_carve: bool,
    /// The MoE cluster kernel streams fixed experts' tiles (`false`: the chosen ones).
    moe_pin: bool,
    /// The staged GEMVs (`CudaContext::set_gemv_staged`) flipped off (`false`: on, as
    /// configured).
    staged_flip: bool,
    /// `CudaContext::set_decode_diag` bits `(gemv, moe)` (`(0, 0)`: the kernels whole).
    diag: (u32, u32),
    /// The MoE's combine (`CudaContext::set_moe_hsum`) flipped from as configured.
    hsum_flip: bool,
    /// The MoE cluster kernels prefetch the next input projection's late rows into L2
    /// (`CudaSession::set_moe_l2_late`).
    moe_l2: bool,
    /// The L2 follower's plan (`None`: as configured; `Some(None)`: no follower).
    follow: Option<Option<cuda::follow::FollowPlan>>,
}

/// `KS:BLOCKS` of `--in-proj-grid`: the log2 of the K split and the number of blocks.
/// `--l2-follow`'s value: a plan, or `none` (no follower).
#[derive(Clone, Copy, Debug)]
struct FollowArg(Option<cuda::follow::FollowPlan>);

/// `--l2-follow`'s and `--follow-compare`'s values (`cuda::follow::FollowPlan::parse`, or
/// `none`).
fn parse_follow(s: &str) -> Result<FollowArg, String> {
    if s == "none" {
        return Ok(FollowArg(None));
    }
    cuda::follow::FollowPlan::parse(s).map(|p| FollowArg(Some(p)))
}

fn parse_grid(s: &str) -> Result<(i32, u32), String> {
    let (ks, blocks) = s.split_once(':').ok_or_else(|| format!("expected KS:BLOCKS, found {s:?}"))?;
    let ks: i32 = ks.trim().parse().map_err(|e| format!("KS in {s:?}: {e}"))?;
    let blocks: u32 = blocks.trim().parse().map_err(|e| format!("BLOCKS in {s:?}: {e}"))?;
    if !(0..=4).contains(&ks) || blocks == 0 {
        return Err(format!("{s:?}: KS must be 0..=4 and BLOCKS at least 1"));
    }
    Ok((ks, blocks))
}

/// A `KS:BLOCKS` launch of the input projections as JSON.
fn grid_json((ks_log2, blocks): (i32, u32)) -> serde_json::Value {
    serde_json::json!({"ks_log2": ks_log2, "blocks": blocks})
}

/// Arguments of `calla cuda-compile`.
#[derive(Args)]
pub struct CudaCompileArgs {
    /// Cache folder to fill. Default: the folder the CUDA backend reads (`$CALLA_CUDA_CACHE`,
    /// else `$XDG_CACHE_HOME/calla/cuda`, else `~/.cache/calla/cuda`).
    #[arg(long)]
    cache: Option<PathBuf>,
}

/// `calla cuda-compile`: compiles every kernel file for sm_90a with NVRTC into the kernel cache
/// (`cuda::nvrtc::precompile_into`), skipping the cubins already there. Needs NVRTC, no GPU:
/// `scripts/gpu_bundle.sh` fills the cache on the build machine so that a GPU machine with the
/// same NVRTC version starts without compiling. Prints one line per kernel file.
///
/// # Errors
/// No cache folder known, NVRTC missing, a kernel that does not compile, or an unwritable folder.
pub fn compile(a: CudaCompileArgs) -> Result<()> {
    let dir = match a.cache {
        Some(d) => d,
        None => cuda::nvrtc::cache_dir().context("no cache folder known: pass --cache DIR or set CALLA_CUDA_CACHE")?,
    };
    let t0 = Instant::now();
    let done = cuda::nvrtc::precompile_into(&dir, cuda::KERNELS)?;
    for (path, compiled) in &done {
        println!("{} {}", if *compiled { "compiled" } else { "cached  " }, path.display());
    }
    let n = done.iter().filter(|(_, c)| *c).count();
    eprintln!(
        "{n} of {} kernel files compiled, the rest cached, into {} in {:.1} s",
        done.len(),
        dir.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Arguments of `calla cuda-check`.
#[derive(Args)]
pub struct CudaCheckArgs {
    /// MLX-layout quantized snapshot with the production widths (any number of layers).
    #[arg(long)]
    model: PathBuf,
    /// Prompt lengths to check (random ids, seeded).
    #[arg(long, default_value = "1,7,70,200", value_delimiter = ',')]
    prompt_tokens: Vec<usize>,
    /// Decode steps checked after each prompt.
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Largest prefill chunk in tokens (small values test chunk boundaries).
    #[arg(long, default_value_t = 64)]
    prefill_chunk: usize,
    #[command(flatten)]
    prefill_flags: PrefillFlags,
    /// Capture the decode step with programmatic dependent launch.
    #[arg(long)]
    pdl: bool,
    /// How the decode step runs each layer's MoE block (see `MoePath`): `auto` (the session's
    /// default), `three`, `fold`, `cluster`, `fold-cluster` or `fused`.
    #[arg(long, value_enum, default_value_t = MoePath::Auto)]
    moe: MoePath,
    /// Run each GDN layer's input projection and step as one launch (`CudaSession::set_gdn_in_step`;
    /// restacks the GDN input projections first: 13.5 MB per layer at 4 bits) instead of the
    /// fused-norm GEMV and the step (measured faster).
    #[arg(long)]
    gdn_in_step: bool,
    /// Run each GDN layer's step, output projection and router sums as one launch and its
    /// experts after it (`CudaSession::set_gdn_out_split`; builds the split output projections
    /// first: 9.0 MB per layer, ~2.2 G multiply-adds per layer on the CPU) instead of the step,
    /// the output projection with the router folded in and the MoE cluster kernel.
    #[arg(long)]
    gdn_out_split: bool,
    /// Give the 4-bit input and output projections a staged copy (`CudaModel::stage_gemvs`, ~720 MB
    /// at full size) that the decode step's fused-norm input projections and router-fold output
    /// projections read by bulk copies (TMA) instead of per-thread copies of the MLX layout (the
    /// same bits; measured slower).
    #[arg(long)]
    gemv_staged: bool,
    /// Stage the LM head for bulk copies (`CudaModel::stage_lm_head`; the same bits).
    #[arg(long)]
    stage_lm_head: bool,
    /// Flip where the attention decode step's split and combine kernels trigger the next launch
    /// (`CudaContext::set_attn_split_early_trigger`, `set_attn_combine_early_trigger`; the same
    /// bits): `split`, `combine` or `both`.
    #[arg(long)]
    attn_trigger_flip: Option<String>,
    /// With `--gemv-staged`: one bulk copy per warp's unit in the staged input projections
    /// (`CudaContext::set_gemv_staged_unit`).
    #[arg(long)]
    gemv_staged_unit: bool,
    /// The input projections request their weights after their wait
    /// (`CudaContext::set_in_proj_late_weights`; the same bits).
    #[arg(long)]
    in_proj_late_weights: bool,
    /// The MoE cluster kernel triggers the next launch once its expert tiles are here
    /// (`CudaContext::set_moe_cluster_late_trigger`; the same bits).
    #[arg(long)]
    moe_late_trigger: bool,
    /// Launch the input projections as `KS:BLOCKS` (`CudaContext::set_in_proj_grid`; a split
    /// other than the default sums K in other pieces, so the step's bits may differ).
    #[arg(long, value_parser = parse_grid)]
    in_proj_grid: Option<(i32, u32)>,
    /// The entry point of the 4-bit output projections with the router fold
    /// (`CudaContext::set_out_proj_variant`; the same bits).
    #[arg(long, value_enum, default_value_t = OutProj::C88s3)]
    out_proj: OutProj,
    /// The GDN step triggers the output projection's launch at entry
    /// (`CudaContext::set_gdn_step_early_trigger`; the same bits).
    #[arg(long)]
    gdn_early_trigger: bool,
    /// The decode step's MoE combine: by f64 atomics (`true`) or by the last block of each
    /// row slice (`false`); default `cuda::moe::MOE_HSUM_DEFAULT` (`CudaContext::set_moe_hsum`,
    /// process-wide: the engine's accelerator too; other bits: one f32 rounding of the exact
    /// sum against the f32 sum).
    #[arg(long)]
    moe_hsum: Option<bool>,
    /// The L2 follower beside the decode step (`cuda::follow`; hints only, the same bits),
    /// process-wide: the engine's sessions too. Form as `cuda-bench --l2-follow` (`none`: no
    /// follower); default `cuda::follow::FollowPlan::DEFAULT`.
    #[arg(long, value_parser = parse_follow)]
    l2_follow: Option<FollowArg>,
    /// Print every layer's error of the batched prefill against the CPU trace (prompts that
    /// fit one chunk); without it only routing differences are printed.
    #[arg(long)]
    trace: bool,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
}

/// One of `cuda-check`'s same-bits gates: every run in `runs[1..]` must equal `runs[0]` bit for
/// bit (and have its length), and `runs[0]` must be finite. Prints `what`, how many values
/// differ and ok / FAIL; returns whether it passed.
fn bits_gate(what: &str, runs: &[Vec<f32>]) -> bool {
    let first = &runs[0];
    let differ: usize = runs[1..]
        .iter()
        .map(|r| r.len().abs_diff(first.len()) + r.iter().zip(first).filter(|(x, y)| x.to_bits() != y.to_bits()).count())
        .sum();
    let good = differ == 0 && first.iter().all(|v| v.is_finite());
    println!(
        "{what}, bit for bit: {differ} of {} differ {}",
        (runs.len() - 1) * first.len(),
        if good { "ok" } else { "FAIL" }
    );
    good
}

fn random_prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Device-to-device copy bandwidth in bytes/s (read + write counted), median of 6 copies of
/// 2 GiB: the roofline.
fn copy_bandwidth(cx: &CudaContext) -> Result<f64> {
    let st = cx.stream();
    let n = 2usize << 30;
    let src = st.alloc_zeros::<u8>(n)?;
    let mut dst = st.alloc_zeros::<u8>(n)?;
    let mut ts = Vec::new();
    for i in 0..8 {
        cx.synchronize()?;
        let t = Instant::now();
        st.memcpy_dtod(&src, &mut dst)?;
        cx.synchronize()?;
        if i >= 2 {
            ts.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * n as f64 / median(&mut ts))
}

/// The median of `v` (the upper one of an even count); `v` is sorted in place. `v` must not be
/// empty.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn open(model: &std::path::Path, device: usize) -> Result<(Model, CudaContext, CudaModel, f64)> {
    let m = Model::open(model).with_context(|| format!("cannot load {}", model.display()))?;
    let t = Instant::now();
    let cx = CudaContext::new(device).context("cannot open the CUDA device")?;
    if m.vocab_map.is_some() {
        bail!("{} has a compact vocabulary ({}); the CUDA backend runs the published vocabulary only", model.display(), spec::VOCAB_MAP_FILE);
    }
    // rows past the real tokenizer's ids are padding: never picked (MODEL.md §3.3)
    let vocab_limit = p::VOCAB_REAL.min(m.cfg.vocab_size);
    let gm = CudaModel::upload(&cx, &m.cfg, &m.weights, vocab_limit).context("cannot upload the model to the GPU")?;
    cx.synchronize()?;
    Ok((m, cx, gm, t.elapsed().as_secs_f64()))
}

/// Turns the split output projection on or off in `sess` (`CudaSession::set_gdn_out_split`);
/// asked for where it would not run, an error naming `flag` rather than a silent fallback.
fn set_gdn_out_split(sess: &mut CudaSession, cx: &CudaContext, gm: &CudaModel, on: bool, flag: &str) -> Result<()> {
    sess.set_gdn_out_split(on);
    if on && !sess.gdn_out_split_applies(cx, gm) {
        bail!("{flag}: the split output projection does not apply to this step (it needs the router fold with the MoE cluster kernels, 4-bit output projections and experts, and no --gdn-in-step)");
    }
    Ok(())
}

/// The device weights the measured step variants need (`--gdn-in-step`: the GDN input
/// projections restacked; `--gemv-staged`: the projections' staged copies; `--gdn-out-split`:
/// the GDN output projections split over the step's clusters).
fn upload_variants(m: &Model, cx: &CudaContext, gm: &mut CudaModel, gdn_in_step: bool, gemv_staged: bool, gdn_out_split: bool) -> Result<()> {
    if gdn_in_step {
        let n = gm.upload_gdn_in_step(cx, &m.weights)?;
        eprintln!("GDN input projection + step as one launch in {n} layers");
    }
    if gdn_out_split {
        let t = Instant::now();
        let n = gm.upload_gdn_out_split(cx, &m.weights)?;
        eprintln!("GDN output projection split over the step's clusters in {n} layers ({:.1} s)", t.elapsed().as_secs_f64());
    }
    if gemv_staged {
        let n = gm.stage_gemvs(cx, &m.weights)?;
        eprintln!("staged copies (bulk-copy GEMVs) of {n} projections");
    }
    Ok(())
}

/// The CUDA backend as the engine's accelerator (`calla run|serve --device cuda`): device
/// `ordinal`, the engine's model, context limit and vocabulary limit, prefill chunks of up to
/// `prefill_chunk` tokens.
///
/// # Errors
/// As [`cuda::accel::CudaAccelerator::new`], with the model folder named.
pub fn accelerator(eng: &engine::Engine, ordinal: usize, prefill_chunk: usize) -> Result<Box<dyn engine::Accelerator>> {
    let t = Instant::now();
    let acc = cuda::accel::CudaAccelerator::new(ordinal, &eng.model, eng.max_ctx, eng.vocab_limit(), prefill_chunk)
        .with_context(|| format!("cannot run {} on CUDA device {ordinal}", eng.dir().display()))?;
    tracing::info!(target: "calla::cuda", seconds = t.elapsed().as_secs_f64(), "model uploaded to the GPU");
    Ok(Box::new(acc))
}

/// Bytes one decode step at context `ctx` reads: weights, GDN state (read + written, f32), KV
/// cache (bf16 K and V of every earlier position).
fn step_bytes(gm: &CudaModel, ctx: usize) -> usize {
    let n_gdn = gm.cfg.layer_types.iter().filter(|k| **k == spec::LayerKind::LinearAttention).count();
    let n_attn = gm.cfg.layer_types.len() - n_gdn;
    gm.bytes_per_token
        + n_gdn * 2 * 4 * (p::N_V_HEADS * p::D_K * p::D_V + (p::CONV_KERNEL - 1) * gm.cfg.gdn_conv_dim())
        + n_attn * 2 * ctx * p::N_KV_HEADS * p::HEAD_DIM * 2
}

/// Carve-out settings `cuda-bench --compare` and `--timeline` compare: 0 the driver's default
/// (GEMVs ask for the largest), 1 the largest on every kernel, 2 the largest on the GEMVs and
/// the kernels right before them (`CudaContext::BEFORE_GEMV`).
const CARVEOUTS: [&str; 3] = ["driver default", "every kernel", "before GEMVs"];

fn set_carveout(cx: &CudaContext, c: u8) -> Result<()> {
    cx.set_step_carveout(if c == 1 { 100 } else { -1 })?;
    if c == 2 {
        cx.set_carveout_of(CudaContext::BEFORE_GEMV, 100)?;
    }
    Ok(())
}

/// The `CARVEOUTS` setting the run is configured with: before GEMVs when the context's default
/// (`cuda::CARVEOUT_BEFORE_GEMV`) or `--carveout-before-gemv` asks for it, else the driver's.
fn configured_carveout(a: &CudaBenchArgs) -> u8 {
    if a.carveout_before_gemv || cuda::CARVEOUT_BEFORE_GEMV { 2 } else { 0 }
}

/// Decode steps laid out by `cuda-bench --timeline`.
const TIMELINE_STEPS: usize = 4;

/// `cuda-bench --timeline`: decodes [`TIMELINE_STEPS`] steps after `prompt` with the probe on,
/// prints per entry point what each launch adds to the step and the first 16 launches of the
/// first replay one by one, and returns both as JSON (all launches of the first replay).
fn step_timeline(
    cx: &CudaContext,
    gm: &CudaModel,
    sess: &mut CudaSession,
    start: &mut dyn FnMut(&mut CudaSession, &[u32]) -> Result<()>,
    prompt: &[u32],
    ctx: usize,
    raw: Option<&std::path::Path>,
    label: &str,
) -> Result<serde_json::Value> {
    start(sess, prompt)?;
    sess.decode(gm, 8)?;
    cx.synchronize()?;
    cx.timeline_reset()?;
    let t = Instant::now();
    let n = sess.decode(gm, TIMELINE_STEPS)?;
    cx.synchronize()?;
    let us = t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64;
    let (records, lost) = cx.timeline_records()?;
    anyhow::ensure!(lost == 0, "the timeline log overflowed by {lost} records");
    // the L2 follower (a root node beside the chain) logs nothing
    let kernels: Vec<_> = sess.step_kernel_launches()?.into_iter().filter(|(name, _)| name != "l2_follow").collect();
    if let Some(path) = raw {
        let mut b = Vec::with_capacity(records.len() * 64);
        for r in &records {
            for w in [r.grid, (r.sm as u64) << 32 | r.block as u64, r.ns_mark, r.ns_done, r.ns_trigger, r.ns_pre, r.ns_post, r.blocks] {
                b.extend_from_slice(&w.to_le_bytes());
            }
        }
        std::fs::write(path, b).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let steps = cuda::timeline::layout(&records, &kernels)?;
    let sum = cuda::timeline::summarize(&steps);
    let step_us: Vec<f64> = steps.iter().map(|s| s.last().map(|l| l.release).unwrap_or(0.0) / 1e3).collect();
    println!(
        "timeline @ {ctx}, carve-out {label}: {} steps of {} kernels, {:.1} us/token with the probe; first to last release {:.1} us per step",
        steps.len(),
        kernels.len(),
        us,
        step_us.iter().sum::<f64>() / step_us.len().max(1) as f64
    );
    println!(
        "{:<28} {:>7} {:>7} {:>9} {:>10} {:>9} {:>8} {:>10} {:>8} {:>10} {:>8} {:>11} {:>17}",
        "kernel", "per step", "blocks", "span us", "us/step", "launch us", "lead us", "resident %", "late us", "trigger us", "drain us",
        "mark us", "done us all/early/late"
    );
    let opt = |d: Option<f64>| d.map(|d| format!("{d:.2}")).unwrap_or_else(|| "-".into());
    for k in &sum {
        println!(
            "{:<28} {:>7.0} {:>7.0} {:>9.2} {:>10.1} {:>9} {:>8.2} {:>10.1} {:>8.2} {:>10} {:>8} {:>11} {:>17}",
            k.name,
            k.launches_per_step,
            k.blocks,
            k.span_us,
            k.total_us,
            k.launch_us.map(|d| format!("{d:.2}")).unwrap_or_else(|| "-".into()),
            k.lead_us,
            100.0 * k.resident_at_release,
            k.late_us,
            opt(k.trigger_us),
            opt(k.drain_us),
            k.mark_us.map(|(m, x)| format!("{m:.2}/{x:.2}")).unwrap_or_else(|| "-".into()),
            k.done_us.map(|(a, e, l)| format!("{a:.2}/{e:.2}/{}", opt(l))).unwrap_or_else(|| "-".into())
        );
    }
    let first = steps.first().map(|s| &s[..s.len().min(16)]).unwrap_or(&[]);
    println!("first launches of step 1 (us from its first release): resident first..last, release, all triggered, last done (after the release: all/early/late blocks)");
    for l in first {
        println!(
            "  {:<28} {:>5} blocks  {:>8.2} .. {:>8.2}  release {:>8.2}  triggered {}  done {}",
            l.name,
            l.blocks,
            l.first_resident / 1e3,
            l.last_resident / 1e3,
            l.release / 1e3,
            opt(l.all_triggered.map(|t| t / 1e3)),
            l.done.map(|(a, e, late)| format!("{:.2}/{:.2}/{}", a / 1e3, e / 1e3, opt(late.map(|t| t / 1e3)))).unwrap_or_else(|| "-".into())
        );
    }
    Ok(serde_json::json!({
        "context": ctx,
        "steps": steps.len(),
        "us_per_token_probed": us,
        "kernels": kernels.iter().map(|(k, b)| serde_json::json!([k, b])).collect::<Vec<_>>(),
        "summary": sum.iter().map(|k| serde_json::json!({
            "kernel": k.name, "launches_per_step": k.launches_per_step, "blocks": k.blocks,
            "span_us": k.span_us, "us_per_step": k.total_us, "lead_us": k.lead_us,
            "resident_at_release": k.resident_at_release, "late_us": k.late_us, "trigger_us": k.trigger_us, "drain_us": k.drain_us, "launch_us": k.launch_us,
            "mark_us": k.mark_us.map(|(m, x)| serde_json::json!({"mean": m, "latest": x})),
            "done_us": k.done_us.map(|(a, e, l)| serde_json::json!({"all": a, "early_blocks": e, "late_blocks": l})),
        })).collect::<Vec<_>>(),
        "first_step": steps.first().map(|s| s.iter().map(|l| serde_json::json!({
            "kernel": l.name, "blocks": l.blocks, "first_resident_us": l.first_resident / 1e3,
            "last_resident_us": l.last_resident / 1e3, "release_us": l.release / 1e3,
            "resident_at_release": l.resident_at_release,
            "all_triggered_us": l.all_triggered.map(|t| t / 1e3),
            "mark_after_release_us": l.mark.map(|(m, x)| serde_json::json!({"mean": m / 1e3, "latest": x / 1e3})),
            "done_after_release_us": l.done.map(|(a, e, late)| serde_json::json!({"all": a / 1e3, "early_blocks": e / 1e3, "late_blocks": late.map(|t| t / 1e3)})),
        })).collect::<Vec<_>>()),
    }))
}

/// The prefill options shared by `cuda-bench` and `cuda-check`, set process-wide (for the
/// prefillers and contexts created afterwards, the engine's accelerator included) and on `cx`.
fn set_prefill_options(cx: &CudaContext, f: &PrefillFlags) {
    cuda::prefill::set_default_eager_pdl(!f.prefill_no_pdl);
    cuda::gemm::set_default_splitk(!f.gemm_no_splitk);
    cx.set_gemm_splitk(!f.gemm_no_splitk);
    cuda::gemm::set_default_fit_n(!f.gemm_full_n);
    cx.set_gemm_fit_n(!f.gemm_full_n);
    cuda::gemm::set_default_staged_epilogue(!f.gemm_epilogue_direct);
    cx.set_gemm_staged_epilogue(!f.gemm_epilogue_direct);
    cuda::prefill::set_default_router_f32(f.prefill_router == PrefillRouter::F32);
    cuda::gemm::set_default_gemm_lean(f.gemm_main_loop == GemmMainLoop::Lean);
    cx.set_gemm_lean(f.gemm_main_loop == GemmMainLoop::Lean);
    cuda::prefill::set_default_fused_norm_acts(!f.prefill_norm_acts_apart);
    cuda::gemm::set_default_gemm_grouped3(!f.gemm_grouped2);
    cx.set_gemm_grouped3(!f.gemm_grouped2);
    cuda::gemm::set_default_gemm_bulk(!f.gemm_no_bulk);
    cx.set_gemm_bulk(!f.gemm_no_bulk);
    cuda::gemm::set_default_gemm_bulk_grouped(f.gemm_bulk_grouped);
    cx.set_gemm_bulk_grouped(f.gemm_bulk_grouped);
    cuda::gemm::set_default_gemm_ws(f.gemm_ws);
    cx.set_gemm_ws(f.gemm_ws);
    cuda::gemm::set_default_gemm_wide(!f.gemm_no_wide);
    cx.set_gemm_wide(!f.gemm_no_wide);
    cuda::gemm::set_default_gemm_big_long(!f.gemm_no_big_long);
    cx.set_gemm_big_long(!f.gemm_no_big_long);
    // the copies were made at upload (open_with); this sets their use
    cuda::gemm::set_default_gemm_bf16_weights(f.gemm_bf16_weights);
    cx.set_gemm_bf16_weights(f.gemm_bf16_weights);
    cuda::gemm::set_default_gemm_wide_grouped(f.gemm_wide_grouped);
    cx.set_gemm_wide_grouped(f.gemm_wide_grouped);
    cuda::attn_prefill::set_default_attn_causal_split(!f.attn_no_causal_split);
    cx.set_attn_causal_split(!f.attn_no_causal_split);
    {
        use cuda::attn_prefill::AttnTile as T;
        let form = match f.attn_ws_form.as_str() {
            "ws" => T::Wg128ws,
            "mc" => T::Wg128mc,
            _ => T::Wg128tma,
        };
        cuda::attn_prefill::set_attn_ws_form(form).expect("a warp-specialized tile");
    }
    let ws = f.attn_ws.unwrap_or(cuda::attn_prefill::ATTN_WS_DEFAULT);
    cuda::attn_prefill::set_default_attn_ws(ws);
    cx.set_attn_ws(ws);
    {
        use cuda::gdn_prefill::GdnPrefillMath as M;
        cuda::gdn_prefill::set_default_math(if f.gdn_prefill_mma {
            M::Tf32
        } else if f.gdn_prefill_wg {
            M::Tf32Wg
        } else {
            cuda::gdn_prefill::DEFAULT_MATH_CHOICE
        });
    }
    cuda::gdn_prefill::set_default_prep_lean(!f.gdn_prep_old);
    cuda::gdn_prefill::set_default_prep_balanced(!f.gdn_prep_unbalanced);
    cuda::gdn_prefill::set_default_fused_norm(f.gdn_fused_norm || f.gdn_fused_norm_global);
    cuda::gdn_prefill::set_default_fused_norm_global(f.gdn_fused_norm_global);
    if f.gdn_fused_norm && !f.gdn_fused_norm_global {
        match cx.gdn_fused_norm_clusters() {
            Ok(n) if n as usize >= p::N_V_HEADS => {}
            Ok(n) => eprintln!(
                "warning: --gdn-fused-norm: this GPU holds {n} of the state kernel's {} clusters at once; the rest run in a second wave",
                p::N_V_HEADS
            ),
            Err(e) => eprintln!("warning: --gdn-fused-norm: cannot count the state kernel's clusters: {e}"),
        }
    }
    cuda::gemm::set_default_moe_slot_bf16(!f.moe_slot_f32);
    cx.set_moe_slot_bf16(!f.moe_slot_f32);
}

/// The prefill settings `cuda-bench --prefill-compare` flips, one per case.
#[derive(Clone, Copy)]
struct PrefillKnobs {
    overlap_shared_expert: bool,
    router_f32: bool,
    group_major: bool,
    lean: bool,
    fused_acts: bool,
    grouped3: bool,
    eager_pdl: bool,
    route_fused: bool,
    splitk: bool,
    fit_n: bool,
    staged_epi: bool,
    slot_bf16: bool,
    side_splitk: bool,
    bulk: bool,
    bulk_grouped: bool,
    ws: bool,
    wide: bool,
    wide_grouped: bool,
    attn_split: bool,
    /// The 128-row attention tile warp-specialized (`--attn-ws-form`, `Wg128tma` by default).
    attn_ws: bool,
    bulk_short: bool,
    /// The GDN state kernel's `W·S` and `Q̂·S` on wgmma (`Tf32Wg`, or `Tf32WgC` with `gdn_wgc`);
    /// off: every product on mma.sync (`Tf32`).
    gdn_wg: bool,
    /// Its chunk update on wgmma too (`Tf32WgC`; implies `gdn_wg`).
    gdn_wgc: bool,
    /// The GDN prep kernel in session 52's lean form (else the form before).
    gdn_prep_lean: bool,
    /// Its `Tm` products balanced over the warps (session 54; else one row tile per warp).
    gdn_prep_bal: bool,
    /// The GDN gated norm inside the state kernel, its blocks as clusters (session 55; else
    /// `gdnp_norm_acts`).
    gdn_fnorm: bool,
    /// The same exchanging through global memory (takes precedence over `gdn_fnorm`).
    gdn_fnorm_g: bool,
    /// Long prompts' dense GEMMs on the mid tile in place of the wide one.
    mid: bool,
    /// The 8k chunks' GDN input projections on the big tile in place of the wide one.
    big_long: bool,
    /// Dense products on the wide and big tiles on the weights' bf16 copies (where made).
    bf16_weights: bool,
}

impl PrefillKnobs {
    /// The settings as `pf` and its contexts hold them now.
    fn read(cx: &CudaContext, pf: &Prefiller) -> Self {
        PrefillKnobs {
            overlap_shared_expert: pf.overlap_shared_expert,
            router_f32: pf.router_f32,
            group_major: cx.gemm_group_major(),
            lean: cx.gemm_lean(),
            fused_acts: pf.fused_norm_acts,
            grouped3: cx.gemm_grouped3(),
            eager_pdl: pf.eager_pdl,
            route_fused: cx.moe_route_fused(),
            splitk: cx.gemm_splitk(),
            fit_n: cx.gemm_fit_n(),
            staged_epi: cx.gemm_staged_epilogue(),
            slot_bf16: cx.moe_slot_bf16(),
            side_splitk: pf.side_splitk,
            bulk: cx.gemm_bulk(),
            bulk_grouped: cx.gemm_bulk_grouped(),
            ws: cx.gemm_ws(),
            wide: cx.gemm_wide(),
            wide_grouped: cx.gemm_wide_grouped(),
            attn_split: cx.attn_causal_split(),
            attn_ws: cx.attn_ws(),
            bulk_short: cx.gemm_bulk_short(),
            gdn_wg: matches!(pf.gdn_math(), cuda::gdn_prefill::GdnPrefillMath::Tf32Wg | cuda::gdn_prefill::GdnPrefillMath::Tf32WgC),
            gdn_wgc: pf.gdn_math() == cuda::gdn_prefill::GdnPrefillMath::Tf32WgC,
            gdn_prep_lean: pf.gdn_prep_lean(),
            gdn_prep_bal: pf.gdn_prep_balanced(),
            gdn_fnorm: pf.gdn_fused_norm() && !pf.gdn_fused_norm_global(),
            gdn_fnorm_g: pf.gdn_fused_norm() && pf.gdn_fused_norm_global(),
            mid: cx.gemm_mid(),
            big_long: cx.gemm_big_long(),
            bf16_weights: cx.gemm_bf16_weights(),
        }
    }

    /// Sets `pf` and both of its streams' contexts to these settings.
    fn apply(&self, cx: &CudaContext, pf: &mut Prefiller) {
        pf.overlap_shared_expert = self.overlap_shared_expert;
        pf.router_f32 = self.router_f32;
        pf.fused_norm_acts = self.fused_acts;
        pf.eager_pdl = self.eager_pdl;
        pf.side_splitk = self.side_splitk;
        {
            use cuda::gdn_prefill::GdnPrefillMath as M;
            pf.set_gdn_math(match (self.gdn_wg, self.gdn_wgc) {
                (false, _) => M::Tf32,
                (true, false) => M::Tf32Wg,
                (true, true) => M::Tf32WgC,
            });
        }
        pf.set_gdn_prep_lean(self.gdn_prep_lean);
        pf.set_gdn_prep_balanced(self.gdn_prep_bal);
        pf.set_gdn_fused_norm(self.gdn_fnorm || self.gdn_fnorm_g);
        pf.set_gdn_fused_norm_global(self.gdn_fnorm_g);
        cx.set_moe_route_fused(self.route_fused);
        pf.on_contexts(cx, |c| {
            c.set_gemm_group_major(self.group_major);
            c.set_gemm_lean(self.lean);
            c.set_gemm_grouped3(self.grouped3);
            c.set_gemm_splitk(self.splitk);
            c.set_gemm_fit_n(self.fit_n);
            c.set_gemm_staged_epilogue(self.staged_epi);
            c.set_moe_slot_bf16(self.slot_bf16);
            c.set_gemm_bulk(self.bulk);
            c.set_gemm_bulk_grouped(self.bulk_grouped);
            c.set_gemm_ws(self.ws);
            c.set_gemm_wide(self.wide);
            c.set_gemm_wide_grouped(self.wide_grouped);
            c.set_attn_causal_split(self.attn_split);
            c.set_attn_ws(self.attn_ws);
            c.set_gemm_bulk_short(self.bulk_short);
            c.set_gemm_mid(self.mid);
            c.set_gemm_big_long(self.big_long);
            c.set_gemm_bf16_weights(self.bf16_weights);
        });
    }

    /// These settings with one flipped.
    fn flipped(mut self, knob: fn(&mut PrefillKnobs) -> &mut bool) -> Self {
        let before = self;
        let v = knob(&mut self);
        *v = !*v;
        // the GDN state kernel's two knobs name three kernels: turning the chunk update's
        // wgmma on turns W·S's on too, turning W·S's off turns the chunk update's off too
        if self.gdn_wgc && !before.gdn_wgc {
            self.gdn_wg = true;
        }
        if !self.gdn_wg && before.gdn_wg {
            self.gdn_wgc = false;
        }
        self
    }
}

/// One `--prefill-compare` case: the setting it flips, and what the flipped run is called
/// (printed, and its JSON key) when the setting was on / off as configured.
struct PrefillCase {
    knob: fn(&mut PrefillKnobs) -> &mut bool,
    off_name: &'static str,
    off_key: &'static str,
    on_name: &'static str,
    on_key: &'static str,
}

/// The `--prefill-compare` case of the dense products on bf16 weight copies (run only when the
/// model was uploaded with them, `--gemm-bf16-weights`).
const BF16_WEIGHTS_KEY: &str = "dense_bf16_weights_ms";

const PREFILL_CASES: [PrefillCase; 30] = [
    PrefillCase { knob: |k| &mut k.overlap_shared_expert, off_name: "shared expert on the main stream", off_key: "serial_ms", on_name: "shared expert on its own stream", on_key: "overlap_on_ms" },
    PrefillCase { knob: |k| &mut k.router_f32, off_name: "integer-product router", off_key: "router_digits_ms", on_name: "f32-chain router", on_key: "router_f32_ms" },
    PrefillCase { knob: |k| &mut k.group_major, off_name: "dense GEMMs on the MLX layout", off_key: "dense_mlx_layout_ms", on_name: "dense GEMMs group-major", on_key: "dense_group_major_ms" },
    PrefillCase { knob: |k| &mut k.lean, off_name: "GEMMs on the plain loop", off_key: "gemm_plain_ms", on_name: "GEMMs on the lean loop", on_key: "gemm_lean_ms" },
    PrefillCase { knob: |k| &mut k.fused_acts, off_name: "norms and GEMM conversions apart", off_key: "norm_acts_apart_ms", on_name: "norms writing the GEMMs' activations", on_key: "norm_acts_fused_ms" },
    PrefillCase { knob: |k| &mut k.grouped3, off_name: "grouped GEMMs at two blocks per SM", off_key: "grouped_two_per_sm_ms", on_name: "grouped GEMMs at three blocks per SM", on_key: "grouped_three_per_sm_ms" },
    PrefillCase { knob: |k| &mut k.eager_pdl, off_name: "launches without PDL", off_key: "no_pdl_ms", on_name: "launches with PDL", on_key: "pdl_ms" },
    PrefillCase { knob: |k| &mut k.route_fused, off_name: "routing in four launches", off_key: "routing_four_launches_ms", on_name: "routing in two launches", on_key: "routing_two_launches_ms" },
    PrefillCase { knob: |k| &mut k.splitk, off_name: "dense GEMMs never split over K", off_key: "no_splitk_ms", on_name: "dense GEMMs split over K", on_key: "splitk_ms" },
    PrefillCase { knob: |k| &mut k.fit_n, off_name: "MMAs at the full tile width", off_key: "full_n_ms", on_name: "MMAs fitted to the tiles' tokens", on_key: "fit_n_ms" },
    PrefillCase { knob: |k| &mut k.staged_epi, off_name: "+ residual outputs from the accumulators", off_key: "epilogue_direct_ms", on_name: "+ residual outputs staged in shared memory", on_key: "epilogue_staged_ms" },
    PrefillCase { knob: |k| &mut k.slot_bf16, off_name: "MoE down rows in f32", off_key: "slot_f32_ms", on_name: "MoE down rows in bf16", on_key: "slot_bf16_ms" },
    PrefillCase { knob: |k| &mut k.side_splitk, off_name: "shared expert never split over K", off_key: "side_no_splitk_ms", on_name: "shared expert split over K", on_key: "side_splitk_ms" },
    PrefillCase { knob: |k| &mut k.bulk, off_name: "dense GEMM weights by per-thread copies", off_key: "gemm_no_bulk_ms", on_name: "dense GEMM weights by bulk copies", on_key: "gemm_bulk_ms" },
    PrefillCase { knob: |k| &mut k.bulk_grouped, off_name: "grouped GEMM weights by per-thread copies", off_key: "grouped_no_bulk_ms", on_name: "grouped GEMM weights by bulk copies", on_key: "grouped_bulk_ms" },
    PrefillCase { knob: |k| &mut k.ws, off_name: "grouped GEMMs on the lean loop", off_key: "grouped_lean_ms", on_name: "grouped GEMMs warp-specialized", on_key: "grouped_ws_ms" },
    PrefillCase { knob: |k| &mut k.wide, off_name: "dense GEMMs without the wide tile", off_key: "dense_no_wide_ms", on_name: "dense GEMMs on the wide tile", on_key: "dense_wide_ms" },
    PrefillCase { knob: |k| &mut k.wide_grouped, off_name: "grouped GEMMs without the wide tile", off_key: "grouped_no_wide_ms", on_name: "grouped GEMMs on the wide tile", on_key: "grouped_wide_ms" },
    PrefillCase { knob: |k| &mut k.attn_split, off_name: "attention without the causal split", off_key: "attn_no_causal_split_ms", on_name: "attention with the causal split", on_key: "attn_causal_split_ms" },
    PrefillCase { knob: |k| &mut k.bulk_short, off_name: "short chunks' dense GEMM weights by per-thread copies", off_key: "gemm_no_bulk_short_ms", on_name: "short chunks' dense GEMM weights by bulk copies too", on_key: "gemm_bulk_short_ms" },
    PrefillCase { knob: |k| &mut k.gdn_wg, off_name: "GDN state kernel on mma.sync", off_key: "gdn_state_mma_ms", on_name: "GDN state kernel's W·S, Q̂·S on wgmma", on_key: "gdn_state_wgmma_ms" },
    PrefillCase { knob: |k| &mut k.gdn_wgc, off_name: "GDN state kernel's chunk update on mma.sync", off_key: "gdn_state_update_mma_ms", on_name: "GDN state kernel's chunk update on wgmma too", on_key: "gdn_state_update_wgmma_ms" },
    PrefillCase { knob: |k| &mut k.gdn_prep_lean, off_name: "GDN prep as before session 52", off_key: "gdn_prep_old_ms", on_name: "GDN prep's lean form (session 52)", on_key: "gdn_prep_lean_ms" },
    PrefillCase { knob: |k| &mut k.gdn_prep_bal, off_name: "GDN prep's Tm products one row tile per warp", off_key: "gdn_prep_unbalanced_ms", on_name: "GDN prep's Tm products balanced over the warps (session 54)", on_key: "gdn_prep_balanced_ms" },
    PrefillCase { knob: |k| &mut k.gdn_fnorm, off_name: "GDN gated norm as its own kernel", off_key: "gdn_norm_kernel_ms", on_name: "GDN gated norm inside the state kernel (session 55)", on_key: "gdn_fused_norm_ms" },
    PrefillCase { knob: |k| &mut k.gdn_fnorm_g, off_name: "GDN gated norm as its own kernel (by clusters with --gdn-fused-norm)", off_key: "gdn_norm_not_global_ms", on_name: "GDN gated norm inside the state kernel, partials through global memory (session 55)", on_key: "gdn_fused_norm_global_ms" },
    PrefillCase { knob: |k| &mut k.mid, off_name: "dense GEMMs on the wide tile", off_key: "dense_wide_not_mid_ms", on_name: "dense GEMMs on the mid tile in place of the wide one", on_key: "dense_mid_ms" },
    PrefillCase { knob: |k| &mut k.big_long, off_name: "8k chunks' tallest dense GEMMs on the wide tile", off_key: "dense_wide_long_ms", on_name: "8k chunks' tallest dense GEMMs on the big tile", on_key: "dense_big_long_ms" },
    PrefillCase { knob: |k| &mut k.bf16_weights, off_name: "dense GEMMs dequantizing their weights", off_key: "dense_quantized_ms", on_name: "dense GEMMs on bf16 weight copies (--gemm-bf16-weights)", on_key: BF16_WEIGHTS_KEY },
    PrefillCase { knob: |k| &mut k.attn_ws, off_name: "attention's 128-row tile as before (Wg128)", off_key: "attn_wg128_ms", on_name: "attention's 128-row tile warp-specialized (--attn-ws-form)", on_key: "attn_wg128ws_ms" },
];

/// The `--prefill-compare-only` keys that name no case of [`PREFILL_CASES`], as an error that
/// lists the keys there are (checked before the model loads).
fn check_prefill_compare_only(only: &[String]) -> Result<()> {
    let keys: Vec<&str> = PREFILL_CASES.iter().flat_map(|c| [c.off_key, c.on_key]).collect();
    let unknown: Vec<&str> = only.iter().map(String::as_str).filter(|k| !keys.contains(k)).collect();
    if !unknown.is_empty() {
        bail!("--prefill-compare-only: no case has the key {}; the keys are {}", unknown.join(", "), keys.join(", "));
    }
    Ok(())
}

/// `calla cuda-bench`.
pub fn bench(a: CudaBenchArgs) -> Result<()> {
    check_prefill_compare_only(&a.prefill_compare_only)?;
    if a.timeline {
        cuda::timeline::enable();
    }
    // the dense projections' bf16 copies are made at upload
    cuda::gemm::set_default_gemm_bf16_weights(a.prefill_flags.gemm_bf16_weights);
    let (m, cx, mut gm, upload_s) = open(&a.model, a.device)?;
    upload_variants(&m, &cx, &mut gm, a.gdn_in_step, a.gemv_staged, a.gdn_out_split || a.gdn_out_split_compare)?;
    let lm_head_staged = (a.stage_lm_head || a.lm_head_compare) && gm.stage_lm_head(&cx, &m.weights)?;
    if lm_head_staged {
        eprintln!("LM head staged for bulk copies");
    } else if a.lm_head_compare && !a.gemv_staged {
        bail!("--lm-head-compare: the LM head has no staged form (4-bit, {} columns only) and --gemv-staged is off, so its rows would equal the configured ones", p::D_MODEL);
    }
    if a.carveout_before_gemv {
        cx.set_carveout_of(CudaContext::BEFORE_GEMV, 100)?;
    }
    cx.set_gemv_early_trigger(a.gemv_early_trigger);
    cx.set_in_proj_grid(a.in_proj_grid_set);
    cx.set_gemv_staged_unit(a.gemv_staged_unit);
    cx.set_in_proj_late_weights(a.in_proj_late_weights);
    cx.set_moe_cluster_late_trigger(a.moe_late_trigger);
    cx.set_moe_cluster_mark_issue(a.moe_mark_issue);
    cx.set_out_proj_variant(a.out_proj.variant());
    cx.set_gdn_step_smem_pad(a.gdn_pad);
    cx.set_gdn_step_early_trigger(a.gdn_early_trigger);
    if let Some(on) = a.moe_hsum {
        cuda::moe::set_default_moe_hsum(on); // the engine's accelerator too
        cx.set_moe_hsum(on);
    }
    if let Some(FollowArg(p)) = a.l2_follow {
        cuda::follow::set_default_plan(p);
    }
    let name = cx.raw().name().unwrap_or_default();
    let bw = copy_bandwidth(&cx)?;
    let max_ctx = a.prompt_tokens.iter().chain(&a.decode_contexts).max().copied().unwrap_or(1) + a.gen_tokens + 2;
    let mut sess = CudaSession::new(&cx, &gm, max_ctx)?;
    sess.set_pdl(a.pdl);
    sess.set_fuse_norm(!a.no_fuse_norm);
    a.moe.apply(&mut sess, a.moe_down_r48);
    sess.set_gdn_in_step(a.gdn_in_step);
    set_gdn_out_split(&mut sess, &cx, &gm, a.gdn_out_split, "--gdn-out-split")?;
    sess.set_l2_prefetch(a.l2_prefetch);
    let batched = match a.prefill.as_str() {
        "batched" => true,
        "graph" => false,
        other => bail!("--prefill must be batched or graph, found {other}"),
    };
    set_prefill_options(&cx, &a.prefill_flags);
    let mut pf = if batched { Some(Prefiller::new(&cx, &gm, &m.weights, a.prefill_chunk.min(max_ctx))?) } else { None };
    let vocab = m.cfg.vocab_size.min(p::VOCAB_REAL);
    let mut prefill_profile = Vec::new();
    if let (true, Some(pf)) = (a.prefill_profile, pf.as_mut()) {
        sess.start_batched(&cx, &gm, pf, &random_prompt(4, vocab, 0))?; // warm-up
        for (i, &n) in a.prompt_tokens.iter().enumerate() {
            let prompt = random_prompt(n.max(1), vocab, 1 + i as u64);
            sess.start_batched(&cx, &gm, pf, &prompt)?;
            cx.synchronize()?;
            pf.profile = Some(Vec::new());
            sess.start_batched(&cx, &gm, pf, &prompt)?;
            let phases = pf.take_profile()?;
            let total: f64 = phases.iter().map(|(_, ms)| ms).sum();
            eprintln!("prefill profile, {n} tokens: {total:.2} ms of GPU time (timed events between phases)");
            for (name, ms) in &phases {
                eprintln!("  {name:<34} {ms:>9.3} ms {:>6.1}%", 100.0 * ms / total.max(1e-9));
            }
            prefill_profile.push(serde_json::json!({"prompt_tokens": n, "total_ms": total,
                "phases": phases.iter().map(|(k, v)| serde_json::json!({"phase": k, "ms": v})).collect::<Vec<_>>()}));
        }
    }
    let mut prefill_compare = Vec::new();
    if let (true, Some(pf)) = (a.prefill_compare, pf.as_mut()) {
        let base = PrefillKnobs::read(&cx, pf);
        let cases: Vec<&PrefillCase> = PREFILL_CASES
            .iter()
            .filter(|c| a.prefill_compare_only.is_empty() || a.prefill_compare_only.iter().any(|k| k == c.on_key || k == c.off_key))
            // the bf16 weight copies exist only with --gemm-bf16-weights: without them the
            // flipped run would time the quantized products again under the copies' name
            .filter(|c| {
                let skip = c.on_key == BF16_WEIGHTS_KEY && !a.prefill_flags.gemm_bf16_weights;
                if skip && !a.prefill_compare_only.is_empty() {
                    eprintln!("note: --prefill-compare skips {BF16_WEIGHTS_KEY}: the model was uploaded without --gemm-bf16-weights (no bf16 copies)");
                }
                !skip
            })
            .collect();
        for (i, &n) in a.prompt_tokens.iter().enumerate() {
            let prompt = random_prompt(n.max(1), vocab, 1 + i as u64);
            // as configured, then each case with its one setting flipped; rounds interleaved,
            // round 0 warms up, medians of the others
            let mut ms: Vec<Vec<f64>> = vec![Vec::new(); cases.len() + 1];
            for round in 0..a.prefill_compare_rounds {
                for (j, knobs) in std::iter::once(base).chain(cases.iter().map(|c| base.flipped(c.knob))).enumerate() {
                    knobs.apply(&cx, pf);
                    cx.synchronize()?;
                    let t = Instant::now();
                    sess.start_batched(&cx, &gm, pf, &prompt)?;
                    cx.synchronize()?;
                    if round > 0 {
                        ms[j].push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
            }
            base.apply(&cx, pf);
            let times: Vec<f64> = ms.iter_mut().map(|v| median(v)).collect();
            let on = times[0];
            let mut line = format!("prefill compare {n:>6}: as configured {on:>8.2} ms");
            let mut row = serde_json::json!({"prompt_tokens": n, "overlap_ms": on});
            for (c, &t) in cases.iter().zip(&times[1..]) {
                let was = *(c.knob)(&mut base.clone());
                let (name, key) = if was { (c.off_name, c.off_key) } else { (c.on_name, c.on_key) };
                line.push_str(&format!("; {name} {t:>8.2} ms ({:+.1}%)", 100.0 * (t / on - 1.0)));
                row[key] = serde_json::json!(t);
            }
            eprintln!("{line}");
            prefill_compare.push(row);
        }
    }
    let mut start = |sess: &mut CudaSession, prompt: &[u32]| -> Result<()> {
        match pf.as_mut() {
            Some(pf) => sess.start_batched(&cx, &gm, pf, prompt)?,
            None => sess.start(&cx, &gm, prompt)?,
        }
        Ok(())
    };
    // warm-up: capture the graphs, touch every kernel
    start(&mut sess, &random_prompt(4, vocab, 0))?;
    sess.decode(&gm, 4)?;
    cx.synchronize()?;
    // what switching between greedy and sampled requests costs at the next start: the first
    // switch to sampling captures the sampled step; later switches reuse both steps
    let mut sampling_switch = Vec::new();
    {
        let prompt = random_prompt(16, vocab, 7);
        let sampled = sampling_cases()[0].clone();
        for (label, params) in [("greedy", None), ("sampled (first switch)", Some(&sampled)), ("greedy again", None), ("sampled again", Some(&sampled))] {
            sess.set_sampling(&cx, &gm, params)?;
            cx.synchronize()?;
            let t = Instant::now();
            start(&mut sess, &prompt)?;
            cx.synchronize()?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            eprintln!("start of a 16-token prompt after switching to {label:<24} {ms:>7.2} ms");
            sampling_switch.push(serde_json::json!({"mode": label, "start_ms": ms}));
        }
        sess.set_sampling(&cx, &gm, None)?;
    }

    let mut prefill = Vec::new();
    for (i, &n) in a.prompt_tokens.iter().enumerate() {
        let n = n.max(1);
        let prompt = random_prompt(n, vocab, 1 + i as u64);
        cx.synchronize()?;
        let t = Instant::now();
        start(&mut sess, &prompt)?;
        let first = sess.generated(&cx)?; // waits for the first token
        let ttft = t.elapsed().as_secs_f64();
        anyhow::ensure!(first.len() == 1, "expected one generated token after the prompt");
        prefill.push(serde_json::json!({"prompt_tokens": n, "ttft_ms": ttft * 1e3, "prefill_tok_s": n as f64 / ttft}));
        eprintln!("prefill {n:>6}: TTFT {:>9.2} ms, {:>9.1} tok/s", ttft * 1e3, n as f64 / ttft);
    }
    let mut decode = Vec::new();
    for (i, &ctx) in a.decode_contexts.iter().enumerate() {
        let prompt = random_prompt(ctx.max(1), vocab, 100 + i as u64);
        start(&mut sess, &prompt)?;
        cx.synchronize()?;
        let t = Instant::now();
        let n = sess.decode(&gm, a.gen_tokens)?;
        cx.synchronize()?;
        let dt = t.elapsed().as_secs_f64();
        let tps = n as f64 / dt;
        let bytes = step_bytes(&gm, ctx + n / 2);
        let gen = sess.generated(&cx)?;
        anyhow::ensure!(gen.len() == n + 1, "generated {} tokens, expected {}", gen.len(), n + 1);
        decode.push(serde_json::json!({
            "context": ctx, "tokens": n, "decode_tok_s": tps, "us_per_token": 1e6 / tps,
            "bytes_per_token": bytes, "roofline_pct": 100.0 * bytes as f64 * tps / bw,
            "roofline_tok_s": bw / bytes as f64,
        }));
        eprintln!("decode @ {ctx:>6}: {tps:>8.1} tok/s ({:.1} us/token), {:.1}% of the copy roofline", 1e6 / tps, 100.0 * bytes as f64 * tps / bw);
    }
    // the step graph as measured above (the comparisons below capture others)
    let graph_stats = sess.graph_stats();
    let mut variants = Vec::new();
    if a.out_proj_compare && a.gemv_staged {
        bail!("--out-proj-compare measures the MLX-layout output projections; --gemv-staged runs the staged one in every row");
    }
    if a.compare || !a.in_proj_grid.is_empty() || a.prefetch_compare || a.out_proj_compare || a.moe_pin_compare || a.gdn_out_split_compare || a.lm_head_compare || a.diag_compare || a.hsum_compare || a.moe_l2_compare || !a.follow_compare.is_empty() {
        let ctx = a.decode_contexts.first().copied().unwrap_or(128).max(1);
        let prompt = random_prompt(ctx, vocab, 100);
        use cuda::moe::MoeFlags;
        let d = sess.moe_flags();
        // the router kernel (or the fold), gate/up and down as two kernels
        let three = MoeFlags { down_reg_cap: a.moe_down_r48, ..MoeFlags::DEFAULT };
        let moe_cluster = MoeFlags { cluster: true, ..MoeFlags::DEFAULT };
        let gate_up_topk = MoeFlags { topk_in_router: false, ..three };
        let down_r48 = MoeFlags { down_reg_cap: true, ..three };
        let moe_fused = MoeFlags { fused: true, ..MoeFlags::DEFAULT };
        // (name, fused norms, L2 prefetch, MoE variant, carve-out setting (CARVEOUTS), fused
        // GEMV at 56 registers (the default), GEMV early trigger)
        let (fuse0, pf0) = (!a.no_fuse_norm, a.l2_prefetch);
        // µs per decoded token (after 8 warm-up steps) and kernels per step
        let mut time_decode = |sess: &mut CudaSession| -> Result<(f64, usize)> {
            start(sess, &prompt)?;
            sess.decode(&gm, 8)?;
            cx.synchronize()?;
            let t = Instant::now();
            let n = sess.decode(&gm, a.gen_tokens)?;
            cx.synchronize()?;
            let us = t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64;
            Ok((us, sess.graph_stats().map(|(k, _)| k).unwrap_or(0)))
        };
        // carve-out: 0 as configured, 1 the largest on every kernel, 2 the largest before GEMVs
        let carve0 = configured_carveout(&a);
        let early0 = a.gemv_early_trigger;
        // one step variant: every option the rows below vary, set together
        let fold0 = sess.router_fold();
        let gdn0 = sess.gdn_in_step();
        // the one row that flips the GDN input projection + step (one launch or two)
        const GDN_TWO: &str = "GDN in_proj + step flipped";
        // the decode GEMVs on the MLX layout with per-thread copies instead of the staged copy
        const GEMV_MLX: &str = "GEMV staged copies unused";
        const GEMV_ALL_EARLY: &str = "GEMV staged, every stage before the wait";
        const GEMV_UNIT: &str = "GEMV staged, one copy per unit";
        const GDN_EARLY: &str = "GDN in_proj + step, early trigger";
        const GDN_L2: &str = "GDN in_proj + step, L2 first";
        const GDN_L2_EARLY: &str = "GDN in_proj + step, L2 first, early trigger";
        // the attention combine's trigger placement flipped (cuda::ATTN_COMBINE_EARLY_TRIGGER)
        const ATTN_FLIP: &str = "attn combine trigger flipped";
        const ATTN_SPLIT_FLIP: &str = "attn split trigger flipped";
        let attn0 = cx.attn_combine_early_trigger();
        let split0 = cx.attn_split_early_trigger();
        let apply = |sess: &mut CudaSession, fuse: bool, pf: bool, flags: MoeFlags, carve: u8, cap: bool, early: bool, fold: bool| -> Result<()> {
            sess.set_router_fold(fold);
            sess.set_fuse_norm(fuse);
            sess.set_l2_prefetch(pf);
            sess.set_moe_flags(flags);
            set_carveout(&cx, carve)?;
            cx.set_gemv_reg_cap(cap);
            cx.set_gemv_early_trigger(early);
            Ok(())
        };
        let all_rows = [
            ("as configured", fuse0, pf0, d, carve0, true, early0, fold0),
            ("MoE router kernel, gate/up, down", fuse0, pf0, three, carve0, true, early0, false),
            ("MoE router folded, gate/up, down", fuse0, pf0, three, carve0, true, early0, true),
            ("GEMV+norm, registers unbounded", fuse0, pf0, d, carve0, false, early0, fold0),
            ("norms as launches", false, pf0, d, carve0, true, early0, fold0),
            ("L2 prefetch on", fuse0, true, d, carve0, true, early0, fold0),
            ("top-k in gate/up", fuse0, pf0, gate_up_topk, carve0, true, early0, false),
            ("max carve-out everywhere", fuse0, pf0, d, 1, true, early0, fold0),
            ("max carve-out before GEMVs", fuse0, pf0, d, 2, true, early0, fold0),
            ("driver carve-out", fuse0, pf0, d, 0, true, early0, fold0),
            ("MoE down at 48 registers", fuse0, pf0, down_r48, carve0, true, early0, false),
            ("MoE down r48, carve-out before GEMVs", fuse0, pf0, down_r48, 2, true, early0, false),
            ("GEMV early trigger", fuse0, pf0, d, carve0, true, true, fold0),
            (GEMV_MLX, fuse0, pf0, d, carve0, true, early0, fold0),
            (GEMV_ALL_EARLY, fuse0, pf0, d, carve0, true, early0, fold0),
            (GEMV_UNIT, fuse0, pf0, d, carve0, true, early0, fold0),
            ("MoE fused (grid barriers)", fuse0, pf0, moe_fused, carve0, true, early0, fold0),
            ("MoE router, then fused gate/up+down", fuse0, pf0, MoeFlags { fused_keep_router: true, ..moe_fused }, carve0, true, early0, fold0),
            ("MoE router kernel, a cluster per expert", fuse0, pf0, moe_cluster, carve0, true, early0, false),
            ("MoE router folded, a cluster per expert", fuse0, pf0, moe_cluster, carve0, true, early0, true),
            (ATTN_FLIP, fuse0, pf0, d, carve0, true, early0, fold0),
            (ATTN_SPLIT_FLIP, fuse0, pf0, d, carve0, true, early0, fold0),
            (GDN_TWO, fuse0, pf0, d, carve0, true, early0, fold0),
            (GDN_EARLY, fuse0, pf0, d, carve0, true, early0, fold0),
            (GDN_L2, fuse0, pf0, d, carve0, true, early0, fold0),
            (GDN_L2_EARLY, fuse0, pf0, d, carve0, true, early0, fold0),
            // the first row again: how far the machine drifted over the rows
            ("as configured, again", fuse0, pf0, d, carve0, true, early0, fold0),
        ];
        // --in-proj-grid alone: only its own rows (below)
        for &(name, fuse, pf, flags, carve, cap, early, fold) in if a.compare { &all_rows[..] } else { &[] } {
            if name.starts_with("GDN") && !a.gdn_in_step {
                continue; // the fused GDN kernel's rows: only with its weights (--gdn-in-step)
            }
            if (name == GEMV_MLX || name == GEMV_ALL_EARLY || name == GEMV_UNIT) && !a.gemv_staged {
                continue; // the staged GEMVs' rows: only with the staged copies (--gemv-staged)
            }
            apply(&mut sess, fuse, pf, flags, carve, cap, early, fold)?;
            // every row but one runs the GDN input projection as configured
            sess.set_gdn_in_step(if name == GDN_TWO { !gdn0 } else { gdn0 });
            sess.set_gdn_in_early_trigger(name == GDN_EARLY || name == GDN_L2_EARLY);
            sess.set_gdn_in_l2_first(name == GDN_L2 || name == GDN_L2_EARLY);
            cx.set_gemv_staged(name != GEMV_MLX);
            cx.set_gemv_staged_all_early(name == GEMV_ALL_EARLY);
            cx.set_gemv_staged_unit(if name == GEMV_UNIT { !a.gemv_staged_unit } else { a.gemv_staged_unit });
            cx.set_attn_combine_early_trigger(if name == ATTN_FLIP { !attn0 } else { attn0 });
            cx.set_attn_split_early_trigger(if name == ATTN_SPLIT_FLIP { !split0 } else { split0 });
            let (us, kernels) = time_decode(&mut sess)?;
            eprintln!("variant @ {ctx}: {name:<30} {us:>8.1} us/token ({:.1} tok/s, {kernels} kernels)", 1e6 / us);
            variants.push(serde_json::json!({"variant": name, "router_fold": fold && fuse && !flags.fused, "fused_norm": fuse, "l2_prefetch": pf, "topk_in_router": flags.topk_in_router, "down_reg_cap": flags.down_reg_cap, "moe_fused": flags.fused, "moe_fused_keep_router": flags.fused_keep_router, "moe_cluster": flags.cluster, "max_carveout": (CARVEOUTS[carve as usize]), "gemv_reg_cap": cap, "gemv_early_trigger": early, "gdn_in_step": sess.gdn_in_step(), "attn_combine_early_trigger": cx.attn_combine_early_trigger(), "attn_split_early_trigger": cx.attn_split_early_trigger(), "context": ctx, "us_per_token": us, "decode_tok_s": 1e6 / us, "kernels": kernels}));
        }
        // the device sampler in place of the greedy pick, with the step as configured (which it
        // stays in afterwards: the sampling cases change nothing else)
        apply(&mut sess, fuse0, pf0, d, carve0, true, early0, fold0)?;
        sess.set_gdn_in_step(gdn0);
        cx.set_gemv_staged(true);
        cx.set_gemv_staged_unit(a.gemv_staged_unit);
        cx.set_attn_combine_early_trigger(attn0);
        cx.set_attn_split_early_trigger(split0);
        // the input projections' launch (--in-proj-grid) and when the weights of the input
        // projection stream beside the MoE's experts (--prefetch-compare), between two rows as
        // configured: (name, grid, input projection's weights after its wait, MoE late trigger)
        if !a.in_proj_grid.is_empty() || a.prefetch_compare || a.out_proj_compare || a.moe_pin_compare || a.gdn_out_split_compare || a.lm_head_compare || a.diag_compare || a.hsum_compare || a.moe_l2_compare || !a.follow_compare.is_empty() {
            let row = |name: String, grid: Option<(i32, u32)>, late_w: bool, late_t: bool| FocusRow { name, grid, late_w, late_t, out: None, carve: None, gdn_pad: None, gdn_early: false, split: false, split_flags: 0, moe_carve: false, moe_pin: false, staged_flip: false, diag: (0, 0), hsum_flip: false, moe_l2: false, follow: None };
            let mut rows = vec![row("as configured".into(), None, false, false)];
            for &(ks, blocks) in &a.in_proj_grid {
                rows.push(row(format!("in_proj split {} on {blocks} blocks", 1 << ks), Some((ks, blocks)), false, false));
            }
            if a.prefetch_compare {
                rows.push(row("in_proj weights after its wait".into(), None, true, false));
                rows.push(row("MoE triggers once its tiles are here".into(), None, false, true));
                rows.push(row("both".into(), None, true, true));
            }
            if a.out_proj_compare {
                // each output projection with the driver's carve-out and with the largest
                // before the GEMVs (an SM the GDN step or the combine configured for a small
                // carve-out takes no output projection block until it drains)
                for o in [OutProj::Wide, OutProj::C88, OutProj::C88s3] {
                    for carve in [0, 2] {
                        let name = format!("out_proj {o:?}, {} carve-out", if carve == 0 { "driver" } else { "before-GEMV" });
                        rows.push(FocusRow { out: Some(o), carve: Some(carve), ..row(name, None, false, false) });
                    }
                }
                rows.push(FocusRow { gdn_early: true, ..row("GDN step triggers at entry".into(), None, false, false) });
                rows.push(FocusRow { gdn_pad: Some(12 * 1024), ..row("GDN step padded 12 KB".into(), None, false, false) });
                rows.push(FocusRow { moe_carve: true, ..row("MoE cluster kernel: largest carve-out too".into(), None, false, false) });
            }
            if a.moe_pin_compare {
                rows.push(FocusRow { moe_pin: true, ..row("MoE: fixed experts (timing only)".into(), None, false, false) });
            }
            if a.gdn_out_split_compare {
                rows.push(FocusRow { split: true, ..row("GDN split output projection".into(), None, false, false) });
                // where its time goes (wrong outputs, timing only): without B, without B and
                // the output projection's tiles; the weights through L2 without shared memory
                for (f, what) in [(1, "no B"), (3, "neither"), (8, "weights via L2, no smem"), (9, "via L2, no B"), (11, "via L2, neither")] {
                    rows.push(FocusRow { split: true, split_flags: f, ..row(format!("GDN split, {what}"), None, false, false) });
                }
            }
            if a.lm_head_compare {
                let what = if a.gemv_staged { "staged GEMVs flipped" } else { "LM head by per-thread copies" };
                rows.push(FocusRow { staged_flip: true, ..row(what.into(), None, false, false) });
                rows.push(row("as configured, again".into(), None, false, false));
                rows.push(FocusRow { staged_flip: true, ..row(format!("{what}, again"), None, false, false) });
            }
            if a.diag_compare {
                use cuda::{DIAG_GEMV_NO_FOLD, DIAG_GEMV_NO_NORM, DIAG_GEMV_NO_TABLE, DIAG_MOE_NO_COMBINE};
                for (d, what) in [
                    ((DIAG_GEMV_NO_TABLE, 0), "GEMVs: no x, no digit table"),
                    ((DIAG_GEMV_NO_NORM, 0), "GEMVs: table without the norm"),
                    ((DIAG_GEMV_NO_FOLD, 0), "out_proj: no router-fold epilogue"),
                    ((0, DIAG_MOE_NO_COMBINE), "MoE: no count, no combine"),
                    ((DIAG_GEMV_NO_TABLE, DIAG_MOE_NO_COMBINE), "no table, no combine"),
                ] {
                    rows.push(FocusRow { diag: d, ..row(format!("diag {what}"), None, false, false) });
                }
            }
            if a.hsum_compare {
                let what = if cx.moe_hsum() { "MoE combine by the last block" } else { "MoE combine by f64 atomics" };
                for again in ["", ", again"] {
                    rows.push(FocusRow { hsum_flip: true, ..row(format!("{what}{again}"), None, false, false) });
                    rows.push(row(format!("as configured{again}"), None, false, false));
                }
            }
            if a.moe_l2_compare {
                for again in ["", ", again"] {
                    rows.push(FocusRow { moe_l2: true, ..row(format!("MoE asks L2 for the next in_proj's late rows{again}"), None, false, false) });
                    rows.push(row(format!("as configured{again}"), None, false, false));
                }
            }
            if !a.follow_compare.is_empty() {
                let mut plans = Vec::new();
                for spec in &a.follow_compare {
                    plans.push(parse_follow(spec).map_err(|e| anyhow::anyhow!("--follow-compare: {e}"))?.0);
                }
                for again in ["", ", again"] {
                    for (spec, plan) in a.follow_compare.iter().zip(&plans) {
                        rows.push(FocusRow { follow: Some(*plan), ..row(format!("L2 follower {spec}{again}"), None, false, false) });
                    }
                    rows.push(row(format!("as configured{again}"), None, false, false));
                }
            }
            rows.push(row("as configured, again".into(), None, false, false));
            let hsum0 = cx.moe_hsum();
            let follow0 = sess.l2_follow();
            for FocusRow { name, grid, late_w, late_t, out, carve, gdn_pad, gdn_early, split, split_flags, moe_carve, moe_pin, staged_flip, diag, hsum_flip, moe_l2, follow } in rows {
                // what a row does not vary stays as configured
                let (grid, late_w, late_t) = (grid.or(a.in_proj_grid_set), late_w || a.in_proj_late_weights, late_t || a.moe_late_trigger);
                let out = out.unwrap_or(a.out_proj);
                cx.set_in_proj_grid(grid);
                cx.set_in_proj_late_weights(late_w);
                cx.set_moe_cluster_late_trigger(late_t);
                cx.set_out_proj_variant(out.variant());
                let carve = carve.unwrap_or(configured_carveout(&a));
                set_carveout(&cx, carve)?;
                if moe_carve {
                    // (the next row's set_carveout puts it back)
                    cx.set_carveout_of(&["moe_cluster"], 100)?;
                }
                let gdn_pad = gdn_pad.unwrap_or(a.gdn_pad);
                cx.set_gdn_step_smem_pad(gdn_pad);
                let gdn_early = gdn_early || a.gdn_early_trigger;
                cx.set_gdn_step_early_trigger(gdn_early);
                cx.set_moe_cluster_pin_experts(moe_pin);
                let split = split || a.gdn_out_split;
                set_gdn_out_split(&mut sess, &cx, &gm, split, "--gdn-out-split-compare")?;
                cx.set_gdn_out_flags(split_flags);
                cx.set_gemv_staged(!staged_flip);
                cx.set_decode_diag(diag.0, diag.1);
                cx.set_moe_hsum(hsum0 ^ hsum_flip);
                sess.set_moe_l2_late(moe_l2);
                let follow = follow.unwrap_or(follow0);
                sess.set_l2_follow(follow)?;
                let (us, kernels) = time_decode(&mut sess)?;
                eprintln!("variant @ {ctx}: {name:<30} {us:>8.1} us/token ({:.1} tok/s, {kernels} kernels)", 1e6 / us);
                variants.push(serde_json::json!({"variant": name, "in_proj_grid": grid.map(grid_json),
                    "gemv_staged": !staged_flip, "in_proj_late_weights": late_w, "moe_cluster_late_trigger": late_t, "out_proj": format!("{out:?}"), "carveout": CARVEOUTS[carve as usize], "gdn_pad": gdn_pad, "gdn_early_trigger": gdn_early, "moe_cluster_max_carveout": moe_carve, "moe_pin_experts": moe_pin, "gdn_out_split": split, "gdn_out_flags": split_flags, "decode_diag": [diag.0, diag.1], "moe_hsum": hsum0 ^ hsum_flip, "moe_l2_late": moe_l2, "l2_follow": follow.map(|p| format!("{p:?}")), "l2_follow_active": sess.l2_follow_active(), "l2_follow_effective": sess.l2_follow_effective().map(|p| format!("{p:?}")),
                    "context": ctx, "us_per_token": us, "decode_tok_s": 1e6 / us, "kernels": kernels}));
            }
            cx.set_in_proj_grid(a.in_proj_grid_set);
            cx.set_in_proj_late_weights(a.in_proj_late_weights);
            cx.set_moe_cluster_late_trigger(a.moe_late_trigger);
            cx.set_out_proj_variant(a.out_proj.variant());
            set_carveout(&cx, configured_carveout(&a))?;
            cx.set_gdn_step_smem_pad(a.gdn_pad);
            cx.set_gdn_step_early_trigger(a.gdn_early_trigger);
            cx.set_moe_cluster_pin_experts(false);
            sess.set_gdn_out_split(a.gdn_out_split);
            cx.set_gdn_out_flags(0);
            cx.set_gemv_staged(true);
            cx.set_decode_diag(0, 0);
            cx.set_moe_hsum(hsum0);
            sess.set_moe_l2_late(false);
            sess.set_l2_follow(follow0)?;
        }
        for params in sampling_cases().iter().filter(|_| a.compare) {
            sess.set_sampling(&cx, &gm, Some(params))?;
            let (us, kernels) = time_decode(&mut sess)?;
            let name = format!("sampled {}", sampling_label(params));
            eprintln!("variant @ {ctx}: {name:<30} {us:>8.1} us/token ({:.1} tok/s, {kernels} kernels)", 1e6 / us);
            variants.push(serde_json::json!({"variant": name, "context": ctx, "us_per_token": us, "decode_tok_s": 1e6 / us, "kernels": kernels}));
            sess.set_sampling(&cx, &gm, None)?;
        }
    }
    let mut ablation = Vec::new();
    if a.ablate {
        let ctx = a.decode_contexts.first().copied().unwrap_or(128).max(1);
        let prompt = random_prompt(ctx, vocab, 100);
        let mut time_step = |sess: &mut CudaSession, skip: u32| -> Result<(f64, usize)> {
            sess.set_ablation(skip);
            start(sess, &prompt)?;
            sess.decode(&gm, 8)?; // warm-up after the capture
            cx.synchronize()?;
            let t = Instant::now();
            let n = sess.decode(&gm, a.gen_tokens)?;
            cx.synchronize()?;
            let kernels = sess.graph_stats().map(|(k, _)| k).unwrap_or(0);
            Ok((t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64, kernels))
        };
        // every ablated step runs without the L2 follower (it needs every mixer launch), so
        // the full step here does too
        let follow0 = sess.l2_follow();
        sess.set_l2_follow(None)?;
        let (full_us, full_k) = time_step(&mut sess, 0)?;
        let all = cuda::decode::ablate::ALL.iter().fold(0, |acc, (c, _)| acc | c);
        let (floor_us, floor_k) = time_step(&mut sess, all)?;
        eprintln!("ablation @ {ctx}: full step {full_us:.1} us ({full_k} kernels); every class left out {floor_us:.1} us ({floor_k} kernels)");
        for &(class, name) in &cuda::decode::ablate::ALL {
            if class == cuda::decode::ablate::NORM && !a.no_fuse_norm {
                continue; // fused: no launch of its own to leave out
            }
            // the router folded into the output projection, or down inside the cluster kernel
            // (which is left out as "MoE gate/up"): no launch of their own either
            let flags = sess.moe_flags();
            if class == cuda::decode::ablate::MOE_ROUTER && sess.router_fold() && !a.no_fuse_norm && !flags.fused {
                continue;
            }
            if class == cuda::decode::ablate::MOE_DOWN && flags.cluster && !flags.fused {
                continue;
            }
            let (us, k) = time_step(&mut sess, class)?;
            let launches = full_k.saturating_sub(k);
            let saved = full_us - us;
            eprintln!("  without {name:<15} {us:>8.1} us  saves {saved:>7.1} us  over {launches:>3} launches ({:.2} us each)", saved / launches.max(1) as f64);
            ablation.push(serde_json::json!({"class": name, "us_without": us, "us_saved": saved, "launches": launches}));
        }
        sess.set_ablation(0);
        sess.set_l2_follow(follow0)?;
        ablation.insert(0, serde_json::json!({"class": "full", "us_without": full_us, "launches": full_k, "context": ctx}));
        ablation.push(serde_json::json!({"class": "all left out", "us_without": floor_us, "launches": floor_k}));
    }
    let mut timeline = serde_json::Value::Null;
    if a.timeline {
        // one layout per carve-out setting, then back to the configured one
        let ctx = a.decode_contexts.first().copied().unwrap_or(128).max(1);
        let prompt = random_prompt(ctx, vocab, 100);
        let mut runs = Vec::new();
        for (c, label) in CARVEOUTS.iter().enumerate() {
            set_carveout(&cx, c as u8)?;
            let raw = a.timeline_raw.as_ref().map(|p| p.with_extension(format!("{c}.bin")));
            let mut run = step_timeline(&cx, &gm, &mut sess, &mut start, &prompt, ctx, raw.as_deref(), label)?;
            run["carveout"] = serde_json::json!(label);
            runs.push(run);
        }
        set_carveout(&cx, configured_carveout(&a))?;
        timeline = serde_json::json!(runs);
    }
    println!(
        "calla cuda-bench · {} · {name} · {} layers · upload {upload_s:.1} s · copy roofline {:.0} GB/s · weights/token {:.3} GB",
        a.model.display(),
        m.cfg.num_hidden_layers,
        bw / 1e9,
        gm.bytes_per_token as f64 / 1e9
    );
    println!("{:>8} {:>12} {:>14}", "prompt", "TTFT ms", "prefill tok/s");
    for r in &prefill {
        println!("{:>8} {:>12.2} {:>14.1}", r["prompt_tokens"], r["ttft_ms"].as_f64().unwrap_or(0.0), r["prefill_tok_s"].as_f64().unwrap_or(0.0));
    }
    println!("{:>8} {:>13} {:>11} {:>14} {:>11} {:>15}", "context", "decode tok/s", "us/token", "bytes/token", "% roofline", "roofline tok/s");
    for r in &decode {
        println!(
            "{:>8} {:>13.1} {:>11.1} {:>14} {:>11.1} {:>15.0}",
            r["context"], r["decode_tok_s"].as_f64().unwrap_or(0.0), r["us_per_token"].as_f64().unwrap_or(0.0),
            r["bytes_per_token"], r["roofline_pct"].as_f64().unwrap_or(0.0), r["roofline_tok_s"].as_f64().unwrap_or(0.0)
        );
    }
    if a.ablate || a.compare {
        println!("{:<28} {:>5} {:>12} {:>12}", "kernel", "regs", "static smem", "max threads");
        for (name, regs, smem, threads) in cx.kernel_resources() {
            println!("{name:<28} {regs:>5} {smem:>12} {threads:>12}");
        }
    }
    for v in &variants {
        println!("decode variant {:<32} {:>9.1} us/token {:>8.1} tok/s", v["variant"].as_str().unwrap_or(""), v["us_per_token"].as_f64().unwrap_or(0.0), v["decode_tok_s"].as_f64().unwrap_or(0.0));
    }
    if !ablation.is_empty() {
        println!("{:>16} {:>12} {:>10} {:>9} {:>14}", "left out", "us/token", "us saved", "launches", "us per launch");
        for r in &ablation {
            let saved = r["us_saved"].as_f64();
            let launches = r["launches"].as_u64().unwrap_or(0);
            println!(
                "{:>16} {:>12.1} {:>10} {:>9} {:>14}",
                r["class"].as_str().unwrap_or(""),
                r["us_without"].as_f64().unwrap_or(0.0),
                saved.map(|v| format!("{v:.1}")).unwrap_or_default(),
                launches,
                saved.map(|v| format!("{:.2}", v / launches.max(1) as f64)).unwrap_or_default(),
            );
        }
    }
    let mut out = serde_json::json!({
        "engine": "calla-cuda",
        "device": name,
        "model": a.model.display().to_string(),
        "layers": m.cfg.num_hidden_layers,
        "quantization": m.cfg.quantization.as_ref().map(|q| serde_json::json!({"bits": q.bits, "group_size": q.group_size})),
        "copy_bandwidth_gb_s": bw / 1e9,
        "weight_bytes_per_token": gm.bytes_per_token,
        "upload_s": upload_s,
        "prefill_mode": if batched { format!("batched, chunks of {}", a.prefill_chunk) } else { "token-by-token graph replay".to_string() },
        "pdl": a.pdl,
        "fused_norm": !a.no_fuse_norm,
        "l2_prefetch": a.l2_prefetch,
        "moe_path": format!("{:?}", a.moe), "gdn_in_step": sess.gdn_in_step(), "moe_fused": sess.moe_flags().fused,
        "moe_cluster": sess.moe_flags().cluster,
        "moe_down_r48": a.moe_down_r48, "router_fold": sess.router_fold() && !a.no_fuse_norm && !sess.moe_flags().fused,
        "carveout_before_gemv": a.carveout_before_gemv || cuda::CARVEOUT_BEFORE_GEMV,
        "gemv_early_trigger": a.gemv_early_trigger,
        "in_proj_grid": a.in_proj_grid_set.map(grid_json),
        "gemv_staged": a.gemv_staged, "gemv_staged_unit": a.gemv_staged_unit,
        "in_proj_late_weights": a.in_proj_late_weights, "moe_late_trigger": a.moe_late_trigger, "moe_mark_issue": a.moe_mark_issue,
        "graph": graph_stats.map(|(k, e)| serde_json::json!({"kernels": k, "programmatic_edges": e})),
        "prefill": prefill,
        "prefill_profile": prefill_profile,
        "prefill_compare": prefill_compare,
        "decode": decode,
        "ablation": ablation,
        "variants": variants,
        "sampling_switch": sampling_switch,
        "timeline": timeline,
        "kernel_resources": if a.ablate || a.compare { cx.kernel_resources() } else { Vec::new() }.into_iter()
            .map(|(name, regs, smem, threads)| serde_json::json!({"kernel": name, "registers": regs, "static_smem": smem, "max_threads": threads}))
            .collect::<Vec<_>>(),
    });
    out["out_proj"] = serde_json::json!(format!("{:?}", a.out_proj));
    out["gdn_pad"] = serde_json::json!(a.gdn_pad);
    out["gdn_early_trigger"] = serde_json::json!(a.gdn_early_trigger);
    out["moe_hsum"] = serde_json::json!(cx.moe_hsum());
    out["l2_follow"] = serde_json::json!(sess.l2_follow().map(|p| format!("{p:?}")));
    out["l2_follow_effective"] = serde_json::json!(sess.l2_follow_effective().map(|p| format!("{p:?}")));
    out["gdn_out_split"] = serde_json::json!(sess.gdn_out_split_applies(&cx, &gm));
    let f = &a.prefill_flags;
    out["prefill_router"] = serde_json::json!(format!("{:?}", f.prefill_router));
    out["gemm_main_loop"] = serde_json::json!(format!("{:?}", f.gemm_main_loop));
    out["prefill_norm_acts"] = serde_json::json!(if f.prefill_norm_acts_apart { "apart" } else { "fused" });
    out["gemm_grouped3"] = serde_json::json!(!f.gemm_grouped2);
    out["gemm_bulk"] = serde_json::json!(!f.gemm_no_bulk);
    out["gemm_bulk_grouped"] = serde_json::json!(f.gemm_bulk_grouped);
    out["lm_head_staged"] = serde_json::json!(lm_head_staged);
    out["gemm_ws"] = serde_json::json!(f.gemm_ws);
    out["gemm_wide"] = serde_json::json!(!f.gemm_no_wide);
    out["gemm_big_long"] = serde_json::json!(!f.gemm_no_big_long);
    out["gemm_bf16_weights"] = serde_json::json!(f.gemm_bf16_weights);
    out["gemm_wide_grouped"] = serde_json::json!(f.gemm_wide_grouped);
    out["attn_ws"] = serde_json::json!(cx.attn_ws());
    out["attn_ws_form"] = serde_json::json!(format!("{:?}", cuda::attn_prefill::attn_ws_form()));
    out["prefill_eager_pdl"] = serde_json::json!(!f.prefill_no_pdl);
    out["gemm_splitk"] = serde_json::json!(!f.gemm_no_splitk);
    out["gemm_fit_n"] = serde_json::json!(!f.gemm_full_n);
    out["gemm_staged_epilogue"] = serde_json::json!(!f.gemm_epilogue_direct);
    out["gdn_prep_balanced"] = serde_json::json!(!f.gdn_prep_unbalanced);
    out["gdn_fused_norm"] = serde_json::json!(f.gdn_fused_norm || f.gdn_fused_norm_global);
    out["gdn_fused_norm_global"] = serde_json::json!(f.gdn_fused_norm_global);
    println!("JSON {}", serde_json::to_string(&out)?);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&out)?).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Sampling settings that `cuda-check` runs the session with (no penalties: the step leaves the
/// penalised logits behind, which the CPU sampler would penalise again) and `cuda-bench
/// --compare` times: Qwen3.6's thinking-mode defaults, and plain temperature with min-p.
fn sampling_cases() -> [sampler::SamplingParams; 2] {
    let base = sampler::SamplingParams { seed: Some(20261129), ..Default::default() };
    [
        sampler::SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..base.clone() },
        sampler::SamplingParams { temperature: 1.0, min_p: 0.05, ..base },
    ]
}

fn sampling_label(p: &sampler::SamplingParams) -> String {
    format!("(temperature {}, top-k {}, top-p {}, min-p {})", p.temperature, p.top_k, p.top_p, p.min_p)
}

/// Relative L2 error, max |error| over the reference's RMS, and whether the argmaxes agree.
fn compare(gpu: &[f32], cpu: &[f32]) -> (f64, f64, bool) {
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (g, c) in gpu.iter().zip(cpu) {
        let d = f64::from(*g) - f64::from(*c);
        num += d * d;
        den += f64::from(*c) * f64::from(*c);
        max = max.max(d.abs());
    }
    let rms = (den / cpu.len() as f64).sqrt();
    (
        (num / den).sqrt(),
        max / rms,
        sampler::argmax(gpu) == sampler::argmax(cpu),
    )
}

/// Largest minus second-largest logit.
fn top2_margin(v: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in v {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// `calla cuda-check`: the GPU decode path against the CPU path (`Backend::Fast`) on the same
/// checkpoint. After each prompt and after each decode step (the CPU is fed the GPU's greedy
/// tokens), the logits must agree to a relative L2 error below 5e-3 and the greedy tokens must
/// agree wherever the CPU's top-2 margin exceeds 0.05. Why 5e-3: the GPU keeps the KV cache in
/// bf16 (relative rounding up to 2^-9 ≈ 2e-3 per element; at a one-token context attention
/// returns V itself, so that rounding reaches the logits almost undiminished: 1.1e-3 measured on
/// the H200 at prompt length 1, 2e-4 at 70) and sums in a different order; the CPU keeps f32.
///
/// Each prompt runs twice: through the decode-step graph (f32 everywhere, gated as above) and
/// through the batched prefill (bf16 tensor-core GEMMs), which is gated on its first layer's
/// mixer output before any routing decision (relative error below 1e-2) and on finite logits;
/// its later drift and the tokens whose top-k routing flipped are reported, not gated: on
/// random-weight checkpoints the router's top-8 margins are tiny, so bf16 rounding flips some
/// choices, which is inherent to bf16 inference (transformers in bf16 does the same).
pub fn check(a: CudaCheckArgs) -> Result<()> {
    // the dense projections' bf16 copies are made at upload
    cuda::gemm::set_default_gemm_bf16_weights(a.prefill_flags.gemm_bf16_weights);
    let (m, cx, mut gm, upload_s) = open(&a.model, a.device)?;
    upload_variants(&m, &cx, &mut gm, a.gdn_in_step, a.gemv_staged, a.gdn_out_split)?;
    if a.stage_lm_head {
        if !gm.stage_lm_head(&cx, &m.weights)? {
            bail!("--stage-lm-head: the LM head has no staged form (4-bit, {} columns only)", p::D_MODEL);
        }
        eprintln!("LM head staged for bulk copies");
    }
    if let Some(which) = a.attn_trigger_flip.as_deref() {
        let (split, combine) = match which {
            "split" => (true, false),
            "combine" => (false, true),
            "both" => (true, true),
            other => bail!("--attn-trigger-flip must be split, combine or both, found {other}"),
        };
        cx.set_attn_split_early_trigger(cx.attn_split_early_trigger() ^ split);
        cx.set_attn_combine_early_trigger(cx.attn_combine_early_trigger() ^ combine);
        eprintln!("attention early triggers: split {}, combine {}", cx.attn_split_early_trigger(), cx.attn_combine_early_trigger());
    }
    cx.set_in_proj_grid(a.in_proj_grid);
    cx.set_out_proj_variant(a.out_proj.variant());
    cx.set_gdn_step_early_trigger(a.gdn_early_trigger);
    if let Some(on) = a.moe_hsum {
        cuda::moe::set_default_moe_hsum(on); // the engine's accelerator too
        cx.set_moe_hsum(on);
    }
    if let Some(FollowArg(p)) = a.l2_follow {
        cuda::follow::set_default_plan(p); // the engine's sessions too
    }
    eprintln!("L2 follower: {:?}", cuda::follow::default_plan());
    cx.set_gemv_staged_unit(a.gemv_staged_unit);
    cx.set_in_proj_late_weights(a.in_proj_late_weights);
    cx.set_moe_cluster_late_trigger(a.moe_late_trigger);
    if let Some((ks, blocks)) = a.in_proj_grid {
        eprintln!("input projections: K split {} on {blocks} blocks", 1 << ks);
    }
    eprintln!("uploaded in {upload_s:.1} s; {} layers", m.cfg.num_hidden_layers);
    let vocab = m.cfg.vocab_size.min(p::VOCAB_REAL);
    // room for the prefix-cache check's second turn: prompt, steps fed back, 23 new tokens, steps
    let max_ctx = a.prompt_tokens.iter().max().copied().unwrap_or(1) + 2 * a.steps + 32;
    let mut sess = CudaSession::new(&cx, &gm, max_ctx)?;
    sess.set_pdl(a.pdl);
    a.moe.apply(&mut sess, false);
    sess.set_gdn_in_step(a.gdn_in_step);
    set_gdn_out_split(&mut sess, &cx, &gm, a.gdn_out_split, "--gdn-out-split")?;
    // the engine's accelerator below creates its own prefiller: the same router for both
    set_prefill_options(&cx, &a.prefill_flags);
    let mut pf = Prefiller::new(&cx, &gm, &m.weights, a.prefill_chunk.min(max_ctx))?;
    let mut worst_rel = 0f64;
    let mut failures = 0usize;
    let mut checks = 0usize;
    for (i, &n) in a.prompt_tokens.iter().enumerate() {
      for batched in [false, true] {
        let prompt = random_prompt(n.max(1), vocab, 7 + i as u64);
        let mut st = m.new_state(max_ctx);
        let mut cpu_trace: Vec<(String, Vec<f32>)> = Vec::new();
        let mut cpu = {
            let mut tr = |name: &str, v: &[f32]| {
                if name.starts_with("blk.") {
                    cpu_trace.push((name.to_string(), v.to_vec()));
                }
            };
            m.forward_traced(&mut st, &prompt, Logits::Last, if batched { Some(&mut tr) } else { None })?
        };
        // expert-load telemetry (not counted by the fused MoE kernel): start from zero
        let count_experts = !sess.moe_flags().fused;
        sess.take_expert_counts(&cx)?;
        let k_top = m.cfg.num_experts_per_tok as u64;
        if batched {
            pf.trace = Some(Vec::new());
            sess.start_batched(&cx, &gm, &mut pf, &prompt)?;
            if let Some(gpu_trace) = pf.trace.take() {
                // the prefill's expert counts equal its own routing (the trace's top-k ids)
                if count_experts {
                    let counts = sess.take_expert_counts(&cx)?;
                    let mut want = vec![vec![0u64; m.cfg.num_experts]; counts.len()];
                    for (name, ids) in &gpu_trace {
                        let layer = name.strip_prefix("blk.").and_then(|r| r.strip_suffix(".moe.topk_idx")).and_then(|l| l.parse::<usize>().ok());
                        if let Some(row) = layer.and_then(|l| want.get_mut(l)) {
                            for &e in ids {
                                row[e as usize] += 1;
                            }
                        }
                    }
                    let good = counts == want && want.iter().all(|r| r.iter().sum::<u64>() == prompt.len() as u64 * k_top);
                    checks += 1;
                    if !good {
                        failures += 1;
                    }
                    println!("batched prompt {n:>4} expert counts of the prefill equal its routing ({} per layer): {}", prompt.len() as u64 * k_top, if good { "ok" } else { "FAIL" });
                }
                // Gate: the first layer's mixer output, before any routing decision, within the
                // bf16 bound (activations and dequantized weights rounded to bf16 in two GEMMs,
                // 2^-9 each, plus TF32 in the GDN core: about 6e-3; 1e-2 allowed).
                let l0 = gpu_trace.iter().find(|(n, _)| n == "blk.0.mixer_out");
                let c0 = cpu_trace.iter().find(|(n, _)| n == "blk.0.mixer_out");
                if let (Some((_, g)), Some((_, c))) = (l0, c0) {
                    let (rel, _, _) = compare(g, c);
                    checks += 1;
                    let good = rel < 1e-2 && g.iter().all(|v| v.is_finite());
                    if !good {
                        failures += 1;
                    }
                    println!("batched prompt {n:>4} layer 0 mixer (pre-routing, bf16 bound 1e-2): rel {rel:.2e} {}", if good { "ok" } else { "FAIL" });
                }
                // one chunk per prompt when prompt <= chunk: names match one to one
                for (name, g) in &gpu_trace {
                    if let Some((_, c)) = cpu_trace.iter().find(|(n, _)| n == name) {
                        if c.len() == g.len() && name.ends_with("topk_idx") {
                            // the same experts per token (order may differ on exact ties)
                            let k = m.cfg.num_experts_per_tok;
                            let differ = g.chunks(k).zip(c.chunks(k)).filter(|(a, b)| {
                                let mut a = a.to_vec();
                                let mut b = b.to_vec();
                                a.sort_by(f32::total_cmp);
                                b.sort_by(f32::total_cmp);
                                a != b
                            }).count();
                            if a.trace || differ > 0 {
                                println!("  trace {name:<28} tokens routed differently: {differ} of {}", c.len() / k);
                            }
                        } else if c.len() == g.len() && a.trace {
                            let (rel, mr, _) = compare(g, c);
                            println!("  trace {name:<28} rel {rel:.2e} max/rms {mr:.2e}");
                        }
                    }
                }
            }
        } else {
            sess.start(&cx, &gm, &prompt)?;
        }
        let mode = if batched { "batched" } else { "graph  " };
        for step in 0..=a.steps {
            let gpu = sess.logits(&cx)?;
            let gen = sess.generated(&cx)?;
            let tok = *gen.last().context("no generated token")?;
            let (rel, max_rms, same) = compare(&gpu[..cpu.len()], &cpu);
            let margin = top2_margin(&cpu);
            // The batched prefill computes in bf16 on tensor cores: its logits drift from the
            // f32 CPU path by ~1e-2 and near-tied routing choices flip; that drift is reported,
            // and only finiteness and positions gate it (the pre-routing gate is above).
            let finite = gpu.iter().all(|v| v.is_finite());
            let ok = if batched { finite } else { rel < 5e-3 && (same || margin <= 0.05) && finite };
            let dev_pos = sess.device_pos(&cx)?;
            let pos_ok = dev_pos == prompt.len() + step;
            checks += 1;
            if !ok || !pos_ok {
                failures += 1;
            }
            worst_rel = worst_rel.max(rel);
            println!(
                "{mode} prompt {n:>4} step {step:>3}: rel {rel:.2e} max/rms {max_rms:.2e} argmax {} (cpu margin {margin:.3}) token {tok} pos {dev_pos}{} {}",
                if same { "same" } else { "DIFFERENT" },
                if pos_ok { "" } else { " (WRONG POSITION)" },
                if ok && pos_ok { "ok" } else { "FAIL" }
            );
            if step == a.steps {
                break;
            }
            cpu = m.forward(&mut st, &[tok], Logits::Last)?;
            sess.decode(&gm, 1)?;
        }
        // every token run since: the decode steps (and, through the step graph, the prompt)
        if count_experts {
            let counts = sess.take_expert_counts(&cx)?;
            let fed = a.steps as u64 + if batched { 0 } else { prompt.len() as u64 };
            let good = counts.len() == m.cfg.num_hidden_layers && counts.iter().all(|r| r.iter().sum::<u64>() == fed * k_top);
            checks += 1;
            if !good {
                failures += 1;
            }
            let sums: Vec<u64> = counts.iter().map(|r| r.iter().sum()).collect();
            println!("{mode} prompt {n:>4} expert counts: {} per layer expected, {:?}: {}", fed * k_top, &sums[..sums.len().min(4)], if good { "ok" } else { "FAIL" });
        }
      }
    }
    // Gate: the prefill's fused forms (norms writing the GEMMs' activations, the MoE combine
    // with the next input norm, the grouped narrow tile at three blocks per SM) compute the
    // same bits as the plain ones: the logits after the same prompt, both ways, in this
    // process, bit for bit (this also covers the shared expert's stream reading the main
    // stream's activations, and every layer, not only the first).
    {
        let prompt = random_prompt(a.prompt_tokens.iter().copied().max().unwrap_or(1).max(1), vocab, 77);
        // without programmatic dependent launch, then with it three times: a kernel that read
        // or wrote before its PDL wait would race with the one before it and could differ
        // from run to run
        let pdl = pf.eager_pdl;
        let mut logits = Vec::new();
        for on in [false, true, true, true] {
            pf.eager_pdl = on;
            sess.start_batched(&cx, &gm, &mut pf, &prompt)?;
            logits.push(sess.logits(&cx)?);
        }
        pf.eager_pdl = pdl;
        checks += 1;
        if !bits_gate(&format!("batched prompt {:>4}: logits with the prefill's launches under PDL (3 runs) = without", prompt.len()), &logits) {
            failures += 1;
        }
    }
    {
        let prompt = random_prompt(a.prompt_tokens.iter().copied().max().unwrap_or(1).max(1), vocab, 77);
        let (fused, three) = (pf.fused_norm_acts, cx.gemm_grouped3());
        let mut logits = Vec::new();
        for on in [fused, !fused] {
            pf.fused_norm_acts = on;
            pf.on_contexts(&cx, |c| c.set_gemm_grouped3(if on == fused { three } else { !three }));
            sess.start_batched(&cx, &gm, &mut pf, &prompt)?;
            logits.push(sess.logits(&cx)?);
        }
        pf.fused_norm_acts = fused;
        pf.on_contexts(&cx, |c| c.set_gemm_grouped3(three));
        let what = format!(
            "batched prompt {:>4}: logits with the fused norms and three-per-SM narrow GEMMs {} = without",
            prompt.len(),
            if fused { "on" } else { "off" }
        );
        checks += 1;
        if !bits_gate(&what, &logits) {
            failures += 1;
        }
    }
    // On-device sampling in the session: every token the GPU samples equals what the CPU
    // sampler (same seed, same calls) picks from the GPU's own logits of that step.
    for (k, params) in sampling_cases().iter().enumerate() {
        let prompt = random_prompt(a.prompt_tokens.iter().copied().max().unwrap_or(1).max(1), vocab, 99 + k as u64);
        sess.set_sampling(&cx, &gm, Some(params))?;
        sess.start_batched(&cx, &gm, &mut pf, &prompt)?;
        let mut cpu_sampler = sampler::Sampler::new(params.clone())?;
        let (mut same, mut differ) = (0usize, Vec::new());
        for step in 0..=a.steps {
            let mut logits = sess.logits(&cx)?;
            let gen = sess.generated(&cx)?;
            let tok = *gen.last().context("no generated token")?;
            let want = cpu_sampler.sample(&mut logits, gm.vocab_limit);
            cpu_sampler.accept(want);
            if tok == want {
                same += 1;
            } else {
                differ.push((step, tok, want));
            }
            if step < a.steps {
                sess.decode(&gm, 1)?;
            }
        }
        checks += 1;
        let ok = differ.is_empty();
        if !ok {
            failures += 1;
        }
        println!(
            "sampled decode {}: {same} of {} tokens equal the CPU sampler on the GPU logits{} {}",
            sampling_label(params),
            a.steps + 1,
            if ok { String::new() } else { format!(" (step, gpu, cpu): {differ:?}") },
            if ok { "ok" } else { "FAIL" }
        );
    }
    sess.set_sampling(&cx, &gm, None)?;
    // The engine on the CUDA accelerator (what `calla run|serve --device cuda` run): its
    // tokens equal the session's own for the same prompt and sampler, greedy and sampled,
    // and a request after another one starts from a clean state.
    {
        let mut eng = engine::Engine::open(&a.model, max_ctx)?;
        let acc = accelerator(&eng, a.device, a.prefill_chunk)?;
        eng.set_accelerator(acc);
        // The session the engine's tokens are compared with, configured as the accelerator's
        // own (CudaAccelerator::new): one slot more than the engine's limit, PDL, the default
        // MoE and GDN paths. The decode attention's split count follows the context limit, so
        // a session of another limit rounds differently and may sample other tokens at
        // temperature 1 (it did once the prefill router changed the trajectory).
        // (--in-proj-grid changes the input projections' K split, hence their bits: back to the
        // default grid the accelerator's context launches; the other options keep the bits)
        cx.set_in_proj_grid(None);
        let mut esess = CudaSession::new(&cx, &gm, eng.max_ctx + 1)?;
        esess.set_pdl(true);
        let mut cases = vec![sampler::SamplingParams::greedy()];
        cases.extend(sampling_cases().into_iter().map(|mut c| {
            c.seed = Some(c.seed.unwrap_or(0x5EED));
            c
        }));
        let n = a.prompt_tokens.iter().copied().max().unwrap_or(1).max(1);
        let run_engine = |prompt: &[u32], params: &sampler::SamplingParams| -> Result<Vec<u32>> {
            let gp = engine::GenerateParams { sampling: params.clone(), max_tokens: a.steps + 1, stop_on_eos: false };
            let mut out = Vec::new();
            eng.generate(prompt, &gp, |id| {
                out.push(id);
                true
            })?;
            Ok(out)
        };
        // then greedy and the first sampler once more: after the switches, both run on the
        // step graphs kept from their first use, and must give the tokens they gave then
        let mut wants: Vec<Vec<u32>> = Vec::new();
        for (k, params) in cases.iter().chain(cases.iter().take(2)).enumerate() {
            let case = k % cases.len();
            let prompt = random_prompt(n, vocab, 311 + case as u64);
            let other = random_prompt(n.div_ceil(2), vocab, 977 + k as u64);
            let first = run_engine(&prompt, params)?;
            run_engine(&other, params)?;
            let again = run_engine(&prompt, params)?;
            esess.set_sampling(&cx, &gm, if params.is_greedy() { None } else { Some(params) })?;
            esess.start_batched(&cx, &gm, &mut pf, &prompt)?;
            esess.decode(&gm, a.steps)?;
            let want = esess.generated(&cx)?;
            let repeat = k >= cases.len();
            let before_ok = !repeat || wants[case] == want;
            checks += 1;
            let ok = first == want && again == want && before_ok;
            if !ok {
                failures += 1;
            }
            println!(
                "engine on the accelerator, {}{}: {} tokens equal the session's, and again after another request{}{} {}",
                sampling_label(params),
                if repeat { " (again, after switching sampling off and on)" } else { "" },
                want.len(),
                if repeat { ", and the tokens of its first run" } else { "" },
                if ok { String::new() } else { format!(" (engine {first:?}, again {again:?}, session {want:?}, first run {:?})", wants.get(case)) },
                if ok { "ok" } else { "FAIL" }
            );
            if !repeat {
                wants.push(want);
            }
        }
        esess.set_sampling(&cx, &gm, None)?;
        // The device prefix cache: a second turn that extends the first (its prompt, the
        // tokens fed back, new tokens) continues from the snapshot kept after the first and
        // prefills only the new part. Its tokens must equal the session's doing the same by
        // hand (prefill, decode steps, snapshot, continue); against a fresh prefill of the
        // whole second prompt they differ only by the bf16 prefill's chunk boundaries
        // (reported, not gated: on random weights that can flip a routing choice).
        let greedy = engine::GenerateParams { sampling: sampler::SamplingParams::greedy(), max_tokens: a.steps + 1, stop_on_eos: false };
        let mut cache = engine::PrefixCache::new(2);
        let turn = |cache: &mut engine::PrefixCache, prompt: &[u32]| -> Result<(Vec<u32>, usize)> {
            let mut out = Vec::new();
            let r = eng.generate_cached(cache, prompt, &greedy, &mut engine::prefix::NoObserver, |id| {
                out.push(id);
                true
            })?;
            Ok((out, r.cached_tokens))
        };
        let p1 = random_prompt(n, vocab, 4242);
        let (g1, c1) = turn(&mut cache, &p1)?;
        let mut p2 = p1.clone();
        p2.extend_from_slice(&g1[..a.steps]);
        p2.extend(random_prompt(23, vocab, 4343));
        let (g2, c2) = turn(&mut cache, &p2)?;
        esess.start_batched(&cx, &gm, &mut pf, &p1)?;
        esess.decode(&gm, a.steps)?;
        let snap = esess.snapshot(&cx, &p2[..p1.len() + a.steps])?;
        esess.start_batched_from(&cx, &gm, &mut pf, Some(&snap), &p2, false)?;
        esess.decode(&gm, a.steps)?;
        let want = esess.generated(&cx)?;
        esess.start_batched(&cx, &gm, &mut pf, &p2)?;
        esess.decode(&gm, a.steps)?;
        let fresh = esess.generated(&cx)?;
        let same_fresh = fresh.iter().zip(&g2).take_while(|(x, y)| x == y).count();
        // the second prompt again: the snapshot after it kept its logits, so nothing is prefilled
        let (g3, c3) = turn(&mut cache, &p2)?;
        checks += 1;
        let ok = c1 == 0 && c2 == p1.len() + a.steps && g2 == want && c3 == p2.len() && g3 == g2;
        if !ok {
            failures += 1;
        }
        println!(
            "prefix cache on the device: second turn of {} tokens reused {c2} (want {}), {} tokens equal the session's continued by hand{}; the same prompt again reused {c3}, same tokens: {}; {same_fresh} of {} leading tokens equal a fresh prefill of the whole prompt (snapshot {:.1} MB) {}",
            p2.len(),
            p1.len() + a.steps,
            want.len(),
            if g2 == want { String::new() } else { format!(" (engine {g2:?}, session {want:?})") },
            g3 == g2,
            g2.len(),
            snap.bytes() as f64 / 1e6,
            if ok { "ok" } else { "FAIL" }
        );
    }
    // what the check's session ran beside its step graphs (parts that do not apply are left out)
    let follow_run = sess.l2_follow_effective().map(|p| format!("{p:?}"));
    println!("L2 follower run by the session's step graphs: {}", follow_run.as_deref().unwrap_or("none"));
    println!("JSON {}", serde_json::json!({"checks": checks, "failures": failures, "worst_rel": worst_rel, "layers": m.cfg.num_hidden_layers, "l2_follow_effective": follow_run}));
    if failures > 0 {
        bail!("{failures} of {checks} GPU/CPU comparisons failed");
    }
    println!("CUDA CHECK OK ({checks} comparisons, worst relative error {worst_rel:.2e})");
    Ok(())
}
