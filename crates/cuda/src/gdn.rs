//! Gated DeltaNet decode step on the GPU (batch 1, one token per call): `kernels/gdn.cu`.
//!
//! One launch does docs/MODEL.md §3.5 steps 2-6 and step 8's gated RMSNorm: causal conv +
//! SiLU over the token's pre-conv q|k|v and the conv-state shift, L2 norm of q and k (q scaled
//! by `d_k^-1/2`), the gates, the delta-rule update of the GDN state and its read-out, and the
//! gated RMSNorm. The CPU twin is the T = 1 path of `model::Model`'s GDN mixer
//! (`reference::{causal_conv_silu, l2norm_inplace, gdn_step, gated_rms_norm}`).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use quant::{Bits, QMatRef};
use rayon::prelude::*;
use spec::production as p;

use crate::moe::{pack_tile, tile_words, TILE_ROWS};
use crate::{CudaContext, CudaError, DeviceQMat, QUANT_GROUP};

/// Channels of the causal conv: `q | k | v` = `2·n_k·d_k + n_v·d_v` = 8192.
pub const GDN_CONV_DIM: usize = 2 * p::N_K_HEADS * p::D_K + p::N_V_HEADS * p::D_V;

/// Width of the stacked GDN input projection output: qkv (conv_dim = 2*n_k*d_k + n_v*d_v =
/// 8192) | z (n_v*d_v = 4096) | b (n_v = 32) | a (n_v = 32) = 12352, in that order.
pub const GDN_PROJ: usize = GDN_CONV_DIM + p::N_V_HEADS * p::D_V + 2 * p::N_V_HEADS;

/// f32 elements of one layer's conv state: `[CONV_KERNEL - 1, GDN_CONV_DIM]`, oldest row first.
pub const GDN_CONV_STATE_LEN: usize = (p::CONV_KERNEL - 1) * GDN_CONV_DIM;

/// f32 elements of one layer's GDN state `S`: `[n_v, d_k, d_v]` (2 MiB).
pub const GDN_STATE_LEN: usize = p::N_V_HEADS * p::D_K * p::D_V;

/// Width of the GDN output (input of `out_proj`): `n_v·d_v`.
pub const GDN_OUT: usize = p::N_V_HEADS * p::D_V;
/// `flags` bit of `gdn_decode_step`: trigger the dependent launch at entry (`GDN_STEP_EARLY_TRIGGER`
/// in `kernels/gdn.cu`; `CudaContext::set_gdn_step_early_trigger`).
const GDN_STEP_EARLY_TRIGGER: i32 = 1;

/// Blocks per V-head (must match `COL_BLOCKS` in `kernels/gdn.cu`).
const COL_BLOCKS: usize = 4;
/// Threads per block (must match `THREADS` in `kernels/gdn.cu`).
const THREADS: u32 = 256;
/// Blocks per cluster: the column blocks of the V-heads of one QK head (`CLUSTER`).
const CLUSTER: usize = (p::N_V_HEADS / p::N_K_HEADS) * COL_BLOCKS;
/// Value columns per block (`COLS`).
const COLS: usize = p::D_V / COL_BLOCKS;
/// Threads per block of the fused input projection + step (`IN_THREADS`).
const IN_THREADS: u32 = THREADS;
/// 16-row tiles of the input projection per block of [`CudaContext::gdn_in_step`]
/// (`IN_TILES`): two of q|k channels, two of v, two of z.
const IN_TILES: usize = 6;
/// Key width of the stacked projection's q (and k) part: `n_k·d_k`.
const KEY_DIM: usize = p::N_K_HEADS * p::D_K;

/// u32 words of one block's region of [`GdnInProj`]: `IN_TILES × D_MODEL/64` tiles, then
/// their `{scale|bias}` pairs (`[IN_TILES][D_MODEL/64][8][2]`: 16 words per tile).
fn in_block_words(bits: Bits) -> usize {
    IN_TILES * (p::D_MODEL / QUANT_GROUP) * (tile_words(bits) + 16)
}

/// Dynamic shared memory of [`CudaContext::gdn_in_step`] (`InSmem<BITS>::BYTES`): one block's
/// region of the tiles.
fn in_step_smem_bytes(bits: Bits) -> usize {
    4 * in_block_words(bits)
}

/// Row `tile`·16 + `rho` of block `blk`'s tiles as a row of the stacked projection
/// `qkv | z | b | a` (`GDN_PROJ` rows): tiles 0-1 are the q|k channels 32r.. of QK head `i`
/// (q for rank r < 4, k after), tiles 2-3 the v channels and tiles 4-5 the z rows of the
/// block's own V-head columns (`kernels/gdn.cu`, `in_step`).
fn in_row(blk: usize, tile: usize, rho: usize) -> usize {
    let (i, r) = (blk / CLUSTER, blk % CLUSTER);
    let j = i * (p::N_V_HEADS / p::N_K_HEADS) + r / COL_BLOCKS;
    let c0 = (r % COL_BLOCKS) * COLS;
    let within = 16 * (tile % 2) + rho;
    match tile / 2 {
        0 => {
            let c = 32 * r + within;
            if c < p::D_K {
                i * p::D_K + c
            } else {
                KEY_DIM + i * p::D_K + (c - p::D_K)
            }
        }
        1 => 2 * KEY_DIM + j * p::D_V + c0 + within,
        _ => GDN_CONV_DIM + j * p::D_V + c0 + within,
    }
}

/// [`CudaError::Unsupported`] naming the first buffer of `checks` (`(name, elements, expected)`)
/// whose length differs; `what` names the caller.
pub(crate) fn check_lengths(what: &str, checks: &[(&str, usize, usize)]) -> Result<(), CudaError> {
    for &(name, got, want) in checks {
        if got != want {
            return Err(CudaError::Unsupported(format!("{what}: {name} has {got} elements, expected {want}")));
        }
    }
    Ok(())
}

/// [`CudaError::Unsupported`] naming the first of `ptrs` (`(name, device address)`) that is not
/// 16-byte aligned (the kernels read them as float4); `what` names the caller.
pub(crate) fn check_aligned16(what: &str, ptrs: &[(&str, u64)]) -> Result<(), CudaError> {
    for &(name, ptr) in ptrs {
        if ptr % 16 != 0 {
            return Err(CudaError::Unsupported(format!("{what}: {name} at {ptr:#x} is not 16-byte aligned (float4 access)")));
        }
    }
    Ok(())
}

/// One GDN layer's input projection rows restacked for [`CudaContext::gdn_in_step`]: for each
/// of the `n_v·4` blocks, its six 16-row tiles (q|k, v, z rows; `in_row`) as the MoE kernels'
/// 16 × 64 tiles (`moe.rs pack_tile`: each lane's A fragments contiguous), so that one block's
/// weights are one contiguous region its bulk copies fetch. Holds the `qkv` and `z` rows once
/// (the `b` and `a` rows stay in the stacked matrix): 13.5 MB at 4 bits, in addition to the
/// stacked matrix the prefill reads.
pub struct GdnInProj {
    bits: Bits,
    tiles: CudaSlice<u32>,
}

impl GdnInProj {
    /// Bits per code of the restacked rows.
    pub fn bits(&self) -> Bits {
        self.bits
    }

    /// Bytes of weights one application reads (codes and `{scale|bias}` pairs).
    pub fn stored_bytes(&self) -> usize {
        4 * self.tiles.len()
    }
}

/// 16-row tiles of `h` per block of [`CudaContext::gdn_step_out`] (`OUT_RT`): rows
/// `256·rank ..` of the output projection.
const OUT_RT: usize = p::D_MODEL / TILE_ROWS / CLUSTER;
/// The output projection's K range of one cluster (`OUT_KC`): the columns of its V-heads.
const OUT_KC: usize = CLUSTER * COLS;
/// Groups of that range (`OUT_G`).
const OUT_G: usize = OUT_KC / QUANT_GROUP;
/// Router rows and the shared gate's (`OUT_NR`).
const OUT_NR: usize = p::N_EXPERTS + 1;
/// Rows of `B = W_r'·W_o` per block (`OUT_BR`).
const OUT_BR: usize = OUT_NR.div_ceil(CLUSTER);
/// Blocks of [`CudaContext::gdn_step_out`].
const OUT_BLOCKS: usize = p::N_V_HEADS * COL_BLOCKS;

/// u32 words of one block's region of [`GdnOutSplit`] (`OutSmem` in `kernels/gdn.cu`): the
/// 4-bit codes of its `OUT_RT × OUT_G` tiles, their `{scale|bias}` pairs (16 words per tile),
/// then its `OUT_BR` rows of `B` over the cluster's K range (f32).
fn out_block_words() -> usize {
    OUT_RT * OUT_G * (tile_words(Bits::B4) + 16) + OUT_BR * OUT_KC
}

/// One GDN layer's output projection split over the step's clusters, for
/// [`CudaContext::gdn_step_out`]: block `(i, r)` (cluster = QK head `i`, rank `r`) holds rows
/// `256r .. 256r + 255` of `out_proj` over the K range of the cluster's two V-heads
/// (`[256i, 256i + 256)`), restacked as the MoE kernels' 16 × 64 tiles (`moe.rs pack_tile`), and
/// rows `33r .. 33r + 32` of `B = W_r·diag(1 + post_norm)·W_o` over the same range (the
/// router's 256 rows, then the shared gate's; f32). 4.7 MB of tiles and 4.3 MB of `B` (rank 7's
/// last rows are padding): 9.0 MB per layer.
pub struct GdnOutSplit {
    words: CudaSlice<u32>,
}

impl GdnOutSplit {
    /// Bytes one application reads.
    pub fn stored_bytes(&self) -> usize {
        4 * self.words.len()
    }
}

/// `B = W_r·diag(1 + post_norm)·W_o` (`[N_EXPERTS + 1, N_V·D_V]`, row-major f32): the router's
/// rows (then the shared gate's row) times the RMSNorm's weights times the output projection,
/// from the dequantized weights (`quant::dequantize`), summed in f64 over the `D_MODEL` terms.
/// With `h = x + W_o·o` the fold's router sums are `W_r·((1 + w) ⊙ h) = W_r·((1 + w) ⊙ x) +
/// B·o` (kernels/gdn.cu `step_out`). About 2.2 G multiply-adds per layer (rayon over rows).
///
/// # Errors
/// [`CudaError::Unsupported`] naming the weight whose shape differs.
pub fn router_out_product(router: QMatRef<'_>, shared_gate: QMatRef<'_>, post_norm: &[f32], out_proj: QMatRef<'_>) -> Result<Vec<f32>, CudaError> {
    let (d, k) = (p::D_MODEL, GDN_OUT);
    for (what, m, want_rows, want_cols) in
        [("mlp.gate", &router, p::N_EXPERTS, d), ("mlp.shared_expert_gate", &shared_gate, 1, d), ("linear_attn.out_proj", &out_proj, d, k)]
    {
        if (m.rows, m.cols) != (want_rows, want_cols) {
            return Err(CudaError::Unsupported(format!("{what} is [{}, {}], expected [{want_rows}, {want_cols}]", m.rows, m.cols)));
        }
        quant::validate(m).map_err(|e| CudaError::Unsupported(format!("{what}: {e}")))?;
    }
    if post_norm.len() != d {
        return Err(CudaError::Unsupported(format!("post_attention_layernorm has {} weights, expected {d}", post_norm.len())));
    }
    let mut wo = vec![0f32; d * k];
    wo.par_chunks_mut(k).enumerate().for_each(|(n, row)| quant::dequantize(out_proj.slice_rows(n, n + 1), row));
    let mut b = vec![0f32; OUT_NR * k];
    b.par_chunks_mut(k).enumerate().for_each(|(e, brow)| {
        let mut wr = vec![0f32; d];
        if e < p::N_EXPERTS {
            quant::dequantize(router.slice_rows(e, e + 1), &mut wr);
        } else {
            quant::dequantize(shared_gate, &mut wr);
        }
        let mut acc = vec![0f64; k];
        for (n, w) in wr.iter().enumerate() {
            let c = f64::from(*w) * (1.0 + f64::from(post_norm[n]));
            if c != 0.0 {
                for (a, v) in acc.iter_mut().zip(&wo[n * k..(n + 1) * k]) {
                    *a += c * f64::from(*v);
                }
            }
        }
        for (o, a) in brow.iter_mut().zip(&acc) {
            *o = *a as f32;
        }
    });
    Ok(b)
}

/// Scratch of [`CudaContext::gdn_decode_step`]. The fused kernel needs none (blocks exchange
/// the gated norm's partial sums through cluster shared memory); the type keeps the API stable
/// should a variant need device scratch. Allocate once with [`CudaContext::gdn_scratch`].
#[derive(Debug)]
pub struct GdnScratch {
    /// L2 prefetch hints passed with the next [`CudaContext::gdn_decode_step`] (the decode step
    /// sets the layer's `out_proj` here); empty by default.
    pub l2_prefetch: crate::L2Prefetch,
    /// [`CudaContext::gdn_in_step`]: trigger the next kernel's launch right after the PDL wait
    /// (a measured variant; off by default).
    pub in_early_trigger: bool,
    /// [`CudaContext::gdn_in_step`]: before the PDL wait only prefetch the weight tiles into L2,
    /// and copy them into shared memory after `h`'s loads (a measured variant; off by default).
    pub in_l2_first: bool,
    /// [`CudaContext::gdn_in_step`]'s phase probe: `None`, or a buffer of at least
    /// [`IN_MARKS`] × [`IN_BLOCKS`] u64 that each launch fills per block with `%globaltimer` ns
    /// at: start, after the PDL wait, digits built, rows summed, every q|k channel arrived,
    /// end. Measurement only.
    #[doc(hidden)]
    pub in_probe: Option<CudaSlice<u64>>,
}

/// Words per block of [`GdnScratch::in_probe`] (`IN_MARKS` in `kernels/gdn.cu`).
pub const IN_MARKS: usize = 6;
/// Blocks of [`CudaContext::gdn_in_step`]'s grid.
pub const IN_BLOCKS: usize = p::N_V_HEADS * COL_BLOCKS;

impl CudaContext {
    /// Restacks one GDN layer's `in_proj_qkv` (`[conv_dim, D_MODEL]`) and `in_proj_z`
    /// (`[n_v·d_v, D_MODEL]`) for [`Self::gdn_in_step`] and copies them to the device.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] naming the matrix when a shape differs from the above, the
    /// group size is not 64, or the two differ in bits; [`CudaError::Driver`] on allocation.
    pub fn upload_gdn_in_proj(&self, qkv: QMatRef<'_>, z: QMatRef<'_>) -> Result<GdnInProj, CudaError> {
        for (what, m, rows) in [("in_proj_qkv", &qkv, GDN_CONV_DIM), ("in_proj_z", &z, p::N_V_HEADS * p::D_V)] {
            quant::validate(m).map_err(|e| CudaError::Unsupported(format!("{what}: {e}")))?;
            if m.rows != rows || m.cols != p::D_MODEL || m.spec.group_size != QUANT_GROUP {
                return Err(CudaError::Unsupported(format!(
                    "{what} is [{}, {}] with group {}; the fused GDN input projection is built for \
                     [{rows}, {}] with group {QUANT_GROUP}",
                    m.rows,
                    m.cols,
                    m.spec.group_size,
                    p::D_MODEL
                )));
            }
        }
        if qkv.spec.bits != z.spec.bits {
            return Err(CudaError::Unsupported(format!(
                "in_proj_qkv has {} bits, in_proj_z {}: the fused GDN input projection needs one width",
                qkv.spec.bits.bits(),
                z.spec.bits.bits()
            )));
        }
        let bits = qkv.spec.bits;
        let groups = p::D_MODEL / QUANT_GROUP;
        let tw = tile_words(bits);
        let blocks = p::N_V_HEADS * COL_BLOCKS;
        let per_block = in_block_words(bits);
        let mut host = vec![0u32; blocks * per_block];
        host.par_chunks_mut(per_block).enumerate().for_each(|(blk, region)| {
            let (codes, sb) = region.split_at_mut(IN_TILES * groups * tw);
            for tile in 0..IN_TILES {
                let rows: [(QMatRef<'_>, usize); TILE_ROWS] = std::array::from_fn(|rho| {
                    let row = in_row(blk, tile, rho);
                    if row < GDN_CONV_DIM {
                        (qkv, row)
                    } else {
                        (z, row - GDN_CONV_DIM)
                    }
                });
                pack_tile(&rows, &mut codes[tile * groups * tw..(tile + 1) * groups * tw], &mut sb[tile * groups * 16..(tile + 1) * groups * 16]);
            }
        });
        Ok(GdnInProj { bits, tiles: self.stream().clone_htod(&host)? })
    }

    /// Restacks one GDN layer's `out_proj` (`[D_MODEL, N_V·D_V]`, 4-bit, group 64) and its
    /// `B = W_r·diag(1 + post_norm)·W_o` ([`router_out_product`], `[N_EXPERTS + 1, N_V·D_V]`) for
    /// [`Self::gdn_step_out`] ([`GdnOutSplit`]) and copies them to the device.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `out_proj` has another shape, width or group size, or `b`
    /// another length; [`CudaError::Driver`] on allocation.
    pub fn upload_gdn_out_split(&self, out_proj: QMatRef<'_>, b: &[f32]) -> Result<GdnOutSplit, CudaError> {
        quant::validate(&out_proj).map_err(|e| CudaError::Unsupported(format!("linear_attn.out_proj: {e}")))?;
        if out_proj.rows != p::D_MODEL || out_proj.cols != GDN_OUT || out_proj.spec.group_size != QUANT_GROUP || out_proj.spec.bits != Bits::B4 {
            return Err(CudaError::Unsupported(format!(
                "linear_attn.out_proj is [{}, {}] at {} bits, group {}; the split output projection is built for [{}, {GDN_OUT}] at 4 bits, group {QUANT_GROUP}",
                out_proj.rows,
                out_proj.cols,
                out_proj.spec.bits.bits(),
                out_proj.spec.group_size,
                p::D_MODEL
            )));
        }
        if b.len() != OUT_NR * GDN_OUT {
            return Err(CudaError::Unsupported(format!(
                "B (router_out_product's result) has {} elements, expected {}",
                b.len(),
                OUT_NR * GDN_OUT
            )));
        }
        let tw = tile_words(Bits::B4);
        let groups = GDN_OUT / QUANT_GROUP;
        // every 16-row tile of the matrix, all its groups (pack_tile), then scattered by block
        let row_tiles = p::D_MODEL / TILE_ROWS;
        let mut packed = vec![0u32; row_tiles * groups * (tw + 16)];
        packed.par_chunks_mut(groups * (tw + 16)).enumerate().for_each(|(rt, chunk)| {
            let rows: [(QMatRef<'_>, usize); TILE_ROWS] = std::array::from_fn(|rho| (out_proj, rt * TILE_ROWS + rho));
            let (codes, sb) = chunk.split_at_mut(groups * tw);
            pack_tile(&rows, codes, sb);
        });
        let per_block = out_block_words();
        let mut host = vec![0u32; OUT_BLOCKS * per_block];
        host.par_chunks_mut(per_block).enumerate().for_each(|(blk, region)| {
            let (i, r) = (blk / CLUSTER, blk % CLUSTER);
            let (codes, rest) = region.split_at_mut(OUT_RT * OUT_G * tw);
            let (sb, brows) = rest.split_at_mut(OUT_RT * OUT_G * 16);
            for lt in 0..OUT_RT {
                let src = &packed[(r * OUT_RT + lt) * groups * (tw + 16)..][..groups * (tw + 16)];
                let (src_codes, src_sb) = src.split_at(groups * tw);
                for g in 0..OUT_G {
                    let (tile, sg) = (lt * OUT_G + g, i * OUT_G + g);
                    codes[tile * tw..(tile + 1) * tw].copy_from_slice(&src_codes[sg * tw..(sg + 1) * tw]);
                    sb[tile * 16..(tile + 1) * 16].copy_from_slice(&src_sb[sg * 16..(sg + 1) * 16]);
                }
            }
            for br in 0..OUT_BR {
                let e = OUT_BR * r + br;
                if e < OUT_NR {
                    let src = &b[e * GDN_OUT + i * OUT_KC..][..OUT_KC];
                    for (o, v) in brows[br * OUT_KC..(br + 1) * OUT_KC].iter_mut().zip(src) {
                        *o = v.to_bits();
                    }
                }
            }
        });
        out_split_smem_allow(self)?;
        Ok(GdnOutSplit { words: self.stream().clone_htod(&host)? })
    }

    /// The checks every GDN step launch makes ([`Self::gdn_decode_step`], [`Self::gdn_in_step`],
    /// [`Self::gdn_step_out`]): the lengths in `inputs` (the launch's own inputs, first), then
    /// those of the step's weights, conv state, `S` and `out`; then the addresses in
    /// `inputs_aligned`, and `s`, `conv_w` and `out` 16-byte aligned. `what` names the launch.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] naming the first buffer of another length or alignment.
    #[allow(clippy::too_many_arguments)]
    fn check_step_buffers(
        &self,
        what: &str,
        inputs: &[(&str, usize, usize)],
        inputs_aligned: &[(&str, u64)],
        conv_w: &CudaView<'_, f32>,
        a_neg_exp: &CudaView<'_, f32>,
        dt_bias: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        conv_state: &CudaViewMut<'_, f32>,
        s: &CudaViewMut<'_, f32>,
        out: &CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        check_lengths(what, inputs)?;
        let step = [
            ("conv_w", conv_w.len(), GDN_CONV_DIM * p::CONV_KERNEL),
            ("a_neg_exp", a_neg_exp.len(), p::N_V_HEADS),
            ("dt_bias", dt_bias.len(), p::N_V_HEADS),
            ("norm_w", norm_w.len(), p::D_V),
            ("conv_state", conv_state.len(), GDN_CONV_STATE_LEN),
            ("s", s.len(), GDN_STATE_LEN),
            ("out", out.len(), GDN_OUT),
        ];
        check_lengths(what, &step)?;
        check_aligned16(what, inputs_aligned)?;
        let stream = self.stream();
        check_aligned16(what, &[("s", s.device_ptr(stream).0), ("conv_w", conv_w.device_ptr(stream).0), ("out", out.device_ptr(stream).0)])
    }

    /// Scratch for [`Self::gdn_decode_step`] (currently no device memory).
    pub fn gdn_scratch(&self) -> Result<GdnScratch, CudaError> {
        Ok(GdnScratch { l2_prefetch: crate::L2Prefetch::default(), in_early_trigger: false, in_l2_first: false, in_probe: None })
    }

    /// One Gated DeltaNet decode step for one layer (batch 1, one token), one kernel launch:
    /// docs/MODEL.md §3.5 steps 2-6 and the gated RMSNorm of step 8 (not `out_proj`).
    ///
    /// * `proj`: `[GDN_PROJ]` = `qkv | z | b | a`, the stacked `in_proj` GEMV output.
    /// * `conv_w`: `[conv_dim, 4]` = `GdnWeights::conv1d` (tap 3 on the current token).
    /// * `a_neg_exp`: `[n_v]` = `-exp(A_log)`; `dt_bias`: `[n_v]`.
    /// * `norm_w`: `[d_v]` gated-norm weight, used as stored (no +1).
    /// * `conv_state`: `[3, conv_dim]`, oldest row first (= `LayerState::Gdn::conv`); shifted
    ///   in place: the current pre-conv `qkv` becomes the newest row.
    /// * `s`: `[n_v, d_k, d_v]` f32 GDN state, row = key dim (= `LayerState::Gdn::s`), updated
    ///   in place: `S ← αS + k̂ δᵀ`, `δ = β(v − (αS)ᵀk̂)`.
    /// * `out`: `[n_v·d_v]`, head-major: `norm_w ⊙ o/rms(o) ⊙ SiLU(z)` per V-head, with
    ///   `o = S_newᵀ q̂`. V-head `j` uses QK head `j / (n_v/n_k)`.
    ///
    /// Asynchronous on [`Self::stream`]; graph-capturable (fixed grid, no host values).
    /// Launch: 128 blocks of 256 threads in clusters of 8 (the four column blocks of the two
    /// V-heads of one QK head); no device scratch. About 3.6 µs per call with the state in L2,
    /// 4.7 µs over 30 layers' distinct states, 3.1 µs with PDL between calls (H200,
    /// docs/CUDA.md "GDN decode").
    ///
    /// PDL: only `proj` is read after `griddepcontrol.wait`. Weights, `s` and `conv_state` are
    /// prefetched before it: the previous writer of `s`/`conv_state` must not be a kernel that
    /// can still be running when this one starts, i.e. anything but this same step one token
    /// earlier must finish before the predecessor triggers (true when every kernel of the chain
    /// waits before it triggers, and across graph launches; with
    /// [`CudaContext::set_gdn_step_early_trigger`] this step triggers first, which keeps it
    /// true because the output projection after it waits before it triggers).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when a length differs from the above or `s`, `conv_w` or
    /// `out` is not 16-byte aligned; [`CudaError::Driver`] when the launch fails.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_decode_step(
        &self,
        proj: &CudaView<'_, f32>,
        conv_w: &CudaView<'_, f32>,
        a_neg_exp: &CudaView<'_, f32>,
        dt_bias: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        conv_state: &mut CudaViewMut<'_, f32>,
        s: &mut CudaViewMut<'_, f32>,
        scratch: &mut GdnScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        let inputs = [("proj", proj.len(), GDN_PROJ)];
        self.check_step_buffers("gdn_decode_step", &inputs, &[], conv_w, a_neg_exp, dt_bias, norm_w, conv_state, s, out)?;
        let stream = self.stream();
        let cfg = LaunchConfig {
            grid_dim: ((p::N_V_HEADS * COL_BLOCKS) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            // unused padding (CudaContext::set_gdn_step_smem_pad; 0 by default)
            shared_mem_bytes: self.gdn_step_smem_pad.load(std::sync::atomic::Ordering::Relaxed),
        };
        let flags = if self.gdn_step_early_trigger.load(std::sync::atomic::Ordering::Relaxed) { GDN_STEP_EARLY_TRIGGER } else { 0 };
        let mut b = stream.launch_builder(self.func("gdn_decode_step")?);
        b.arg(out)
            .arg(s)
            .arg(conv_state)
            .arg(proj)
            .arg(conv_w)
            .arg(a_neg_exp)
            .arg(dt_bias)
            .arg(norm_w)
            .arg(&scratch.l2_prefetch)
            .arg(&flags);
        // SAFETY: argument order and types match the kernel's signature; lengths checked above.
        // The cluster shape is a compile-time attribute of the kernel (__cluster_dims__), and
        // the grid is a multiple of it.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The stacked input projection and the Gated DeltaNet step of one layer as one launch
    /// (`gdn_in_step_q4|q8`): `proj = [W_qkv|W_z|W_b|W_a]·rms_norm(h)` as
    /// [`CudaContext::gemv_norm`] computes it, then [`Self::gdn_decode_step`] on it, without
    /// `proj` ever leaving the chip. Each cluster computes the rows its blocks read (the QK
    /// head's q|k channels, exchanged in the cluster; the v, z, b, a rows of its own V-head
    /// columns); the weights arrive by bulk copies requested before the PDL wait (with
    /// [`GdnScratch::in_l2_first`]: only prefetched into L2 before it, copied after `h`'s loads).
    ///
    /// * `w`: the layer's restacked `qkv`/`z` rows ([`Self::upload_gdn_in_proj`]);
    /// * `stacked`: the same layer's stacked `in_proj` (`[GDN_PROJ, D_MODEL]`, one run, the
    ///   bits of `w`): its `b` and `a` rows are read in the MLX layout;
    /// * `h`: `[D_MODEL]` residual stream, 16-byte aligned; `in_norm_w`: `[D_MODEL]`
    ///   `input_layernorm` weight (zero-centred: the scale is `1 + w`), 16-byte aligned; the
    ///   norm's epsilon is `RMS_EPS`;
    /// * the rest as [`Self::gdn_decode_step`]; `scratch`: its options (no device memory).
    ///
    /// The projection is not that of the GEMV bit for bit (other digits and order of sums):
    /// both are within ~1e-6 relative of `quant::reference::gemv`.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] on a length or alignment as above, or a `stacked` matrix of
    /// another shape or width than `w`; [`CudaError::Driver`] when the launch fails.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_in_step(
        &self,
        w: &GdnInProj,
        stacked: &DeviceQMat,
        h: &CudaView<'_, f32>,
        in_norm_w: &CudaView<'_, f32>,
        conv_w: &CudaView<'_, f32>,
        a_neg_exp: &CudaView<'_, f32>,
        dt_bias: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        conv_state: &mut CudaViewMut<'_, f32>,
        s: &mut CudaViewMut<'_, f32>,
        scratch: &GdnScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        if stacked.rows != GDN_PROJ || stacked.cols != p::D_MODEL || stacked.bits != w.bits {
            return Err(CudaError::Unsupported(format!(
                "gdn_in_step: the stacked in_proj is [{}, {}] at {} bits; expected [{GDN_PROJ}, {}] at {} bits",
                stacked.rows,
                stacked.cols,
                stacked.bits.bits(),
                p::D_MODEL,
                w.bits.bits()
            )));
        }
        let stream = self.stream();
        let inputs = [("h", h.len(), p::D_MODEL), ("in_norm_w", in_norm_w.len(), p::D_MODEL)];
        let aligned = [("h", h.device_ptr(stream).0), ("in_norm_w", in_norm_w.device_ptr(stream).0)];
        self.check_step_buffers("gdn_in_step", &inputs, &aligned, conv_w, a_neg_exp, dt_bias, norm_w, conv_state, s, out)?;
        let name = match w.bits {
            Bits::B4 => "gdn_in_step_q4",
            Bits::B8 => "gdn_in_step_q8",
        };
        let cfg = LaunchConfig {
            grid_dim: ((p::N_V_HEADS * COL_BLOCKS) as u32, 1, 1),
            block_dim: (IN_THREADS, 1, 1),
            shared_mem_bytes: in_step_smem_bytes(w.bits) as u32,
        };
        let eps = p::RMS_EPS;
        let flags = i32::from(scratch.in_early_trigger) | (i32::from(scratch.in_l2_first) << 1);
        let (probe, _probe_guard) = match &scratch.in_probe {
            Some(b) if b.len() < IN_BLOCKS * IN_MARKS => {
                return Err(CudaError::Unsupported(format!(
                    "gdn_in_step: the probe holds {} words, the grid writes {}",
                    b.len(),
                    IN_BLOCKS * IN_MARKS
                )))
            }
            Some(b) => {
                let (ptr, guard) = b.device_ptr(stream);
                (ptr, Some(guard))
            }
            None => (0u64, None),
        };
        let mut b = stream.launch_builder(self.func(name)?);
        b.arg(out)
            .arg(s)
            .arg(conv_state)
            .arg(h)
            .arg(in_norm_w)
            .arg(&eps)
            .arg(&w.tiles)
            .arg(stacked.mlx_codes()?)
            .arg(&stacked.scales)
            .arg(&stacked.biases)
            .arg(conv_w)
            .arg(a_neg_exp)
            .arg(dt_bias)
            .arg(norm_w)
            .arg(&flags)
            .arg(&probe);
        // SAFETY: argument order and types match `gdn_in_step_*`; lengths and alignment checked
        // above, the tiles hold one region per block (upload_gdn_in_proj), and the stacked
        // matrix has the b and a rows the kernel reads. The dynamic shared memory was allowed at
        // context creation (in_step_smem_allow). The probe is null or a buffer of IN_MARKS u64 per
        // block (checked above), held by its guard until the launch is queued.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

impl CudaContext {
    /// Whether every cluster of [`Self::gdn_in_step`] at `bits` can be resident at once on this
    /// device (`cuOccupancyMaxActiveClusters` ≥ the grid's 16 clusters). When not, the last
    /// clusters would run as a second wave and the two-launch path is faster. On the H200 30
    /// clusters fit at 4 bits (two blocks per SM) and 15 at 8 bits (one per SM: its tiles take
    /// 204 KB); a first version with one 512-thread block per SM fit 14.
    ///
    /// # Errors
    /// Driver errors of the query.
    pub fn gdn_in_step_fits(&self, bits: Bits) -> Result<bool, CudaError> {
        let name = match bits {
            Bits::B4 => "gdn_in_step_q4",
            Bits::B8 => "gdn_in_step_q8",
        };
        let grid = (p::N_V_HEADS * COL_BLOCKS) as u32;
        let n = self.max_active_clusters(name, grid, IN_THREADS, in_step_smem_bytes(bits) as u32)?;
        Ok(n as usize >= p::N_V_HEADS * COL_BLOCKS / CLUSTER)
    }
}

/// Allows `gdn_in_step_q4|q8` their dynamic shared memory (more than the default 48 KB); called
/// once at context creation.
pub(crate) fn in_step_smem_allow(cx: &CudaContext) -> Result<(), CudaError> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    for (name, bits) in [("gdn_in_step_q4", Bits::B4), ("gdn_in_step_q8", Bits::B8)] {
        cx.func(name)?.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, in_step_smem_bytes(bits) as i32)?;
    }
    Ok(())
}

/// Allows `gdn_step_out_*` (and the MoE kernel after it) their dynamic shared memory; called when
/// a model gets its split output projections ([`CudaContext::upload_gdn_out_split`]), so that a
/// failure here never touches the default path.
fn out_split_smem_allow(cx: &CudaContext) -> Result<(), CudaError> {
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    cx.raw().bind_to_thread()?;
    for rb in [4, 8] {
        for gb in [4, 8] {
            cx.func(&format!("gdn_step_out_r{rb}_g{gb}"))?
                .set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (4 * out_block_words()) as i32)?;
        }
    }
    cx.allow_split_cluster()
}

impl CudaContext {
    /// [`Self::gdn_decode_step`] with the layer's output projection and the MoE router's sums
    /// behind it, one launch (`gdn_step_out_r*_g*`, kernels/gdn.cu `step_out`): the step's
    /// output `o` goes to `out` as before, and each cluster adds its K range's share of
    /// `W_o·o` into `h − x` and of the router fold's sums (`W_r·((1 + post_norm) ⊙ h)`, the
    /// shared gate's too) into accumulator set `set` of `scratch`, `W_r·((1 + post_norm) ⊙ x)`
    /// included; the set must be zero on entry. `Σ h²` is not summed:
    /// [`Self::moe_split_cluster`] makes `h = x + (h − x)` and the norm itself. Replaces
    /// [`Self::gdn_decode_step`] + [`Self::gemv_residual_router`] (within f32 rounding; the
    /// f64 sums arrive in any order, exact in practice).
    ///
    /// * `w`: the layer's [`GdnOutSplit`]; `m`: its MoE (router and shared gate);
    /// * `post_norm`: `[D_MODEL]` `post_attention_layernorm` (zero-centred), 16-byte aligned;
    /// * `x`: `[D_MODEL]` the residual stream before the layer, 16-byte aligned;
    /// * the rest as [`Self::gdn_decode_step`].
    ///
    /// # Errors
    /// As [`Self::gdn_decode_step`]; [`CudaError::Unsupported`] for `post_norm` or `x` of
    /// another length or alignment, or `set` ≥ [`crate::moe::FOLD_SETS`].
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_step_out(
        &self,
        w: &GdnOutSplit,
        m: &crate::moe::DeviceMoe,
        post_norm: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        proj: &CudaView<'_, f32>,
        conv_w: &CudaView<'_, f32>,
        a_neg_exp: &CudaView<'_, f32>,
        dt_bias: &CudaView<'_, f32>,
        norm_w: &CudaView<'_, f32>,
        conv_state: &mut CudaViewMut<'_, f32>,
        s: &mut CudaViewMut<'_, f32>,
        scratch: &mut crate::moe::MoeScratch,
        set: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        if w.words.len() != OUT_BLOCKS * out_block_words() {
            return Err(CudaError::Unsupported(format!("gdn_step_out: the split weights hold {} words, expected {}", w.words.len(), OUT_BLOCKS * out_block_words())));
        }
        let stream = self.stream();
        let inputs = [("post_norm", post_norm.len(), p::D_MODEL), ("x", x.len(), p::D_MODEL), ("proj", proj.len(), GDN_PROJ)];
        let aligned = [("post_norm", post_norm.device_ptr(stream).0), ("x", x.device_ptr(stream).0)];
        self.check_step_buffers("gdn_step_out", &inputs, &aligned, conv_w, a_neg_exp, dt_bias, norm_w, conv_state, s, out)?;
        let r = m.router_refs();
        let name = format!("gdn_step_out_r{}_g{}", r.router_bits.bits(), r.gate_bits.bits());
        let cfg = LaunchConfig {
            grid_dim: (OUT_BLOCKS as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let flags = self.gdn_out_flags.load(std::sync::atomic::Ordering::Relaxed) as i32;
        // (flag 8: the weights through L2 into registers, no shared memory)
        let cfg = LaunchConfig { shared_mem_bytes: if flags & 8 == 0 { (4 * out_block_words()) as u32 } else { 0 }, ..cfg };
        let mut acc = scratch.fold_set_mut(set)?;
        let mut b = stream.launch_builder(self.func(&name)?);
        b.arg(out)
            .arg(s)
            .arg(conv_state)
            .arg(proj)
            .arg(conv_w)
            .arg(a_neg_exp)
            .arg(dt_bias)
            .arg(norm_w)
            .arg(&w.words)
            .arg(r.router_packed)
            .arg(r.router_sb)
            .arg(r.gate_packed)
            .arg(r.gate_sb)
            .arg(post_norm)
            .arg(x)
            .arg(&mut acc)
            .arg(&flags);
        // SAFETY: argument order and types match `gdn_step_out_r*_g*` (kernels/gdn.cu); lengths
        // and alignment checked above, the split weights hold one region per block
        // (upload_gdn_out_split), the router rows are [N_EXPERTS, D_MODEL] and [1, D_MODEL] in
        // the MLX layout at the entry point's widths (upload_moe_refs), acc is one whole set
        // (RF_SET f64). The dynamic shared memory was allowed at context creation
        // (in_step_smem_allow); the cluster shape is the kernel's __cluster_dims__.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quant::{QMat, QuantSpec};

    /// Uniform values in ±`amp` from a fixed LCG (no GPU, no files).
    fn rand_vec(n: usize, seed: u64, amp: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
            })
            .collect()
    }

    fn rand_qmat(rows: usize, cols: usize, bits: u32, seed: u64) -> QMat {
        quant::quantize(&rand_vec(rows * cols, seed, 0.05), rows, cols, QuantSpec::new(bits, QUANT_GROUP).unwrap()).unwrap()
    }

    fn dequant(m: &QMat) -> Vec<f32> {
        let mut out = vec![0f32; m.rows * m.cols];
        quant::dequantize(m.as_ref(), &mut out);
        out
    }

    /// The identity `gdn_step_out` relies on: the router's sums of `h = x + W_o·o` (each row
    /// times `(1 + post_norm) ⊙ h`) equal those of `x` plus `B·o`, with `B` from
    /// `router_out_product`, to f32 rounding (here against f64 sums of the same dequantized
    /// weights).
    #[test]
    fn router_out_product_gives_the_router_sums_of_the_output_projection() {
        let (d, k) = (p::D_MODEL, GDN_OUT);
        let router = rand_qmat(p::N_EXPERTS, d, 8, 1);
        let gate = rand_qmat(1, d, 8, 2);
        let wo = rand_qmat(d, k, 4, 3);
        let nw = rand_vec(d, 4, 0.5);
        let (x, o) = (rand_vec(d, 5, 2.0), rand_vec(k, 6, 1.0));
        let b = router_out_product(router.as_ref(), gate.as_ref(), &nw, wo.as_ref()).unwrap();
        assert_eq!(b.len(), (p::N_EXPERTS + 1) * k);
        let (wr, wg, wod) = (dequant(&router), dequant(&gate), dequant(&wo));
        let h: Vec<f64> = (0..d)
            .map(|n| f64::from(x[n]) + (0..k).map(|c| f64::from(wod[n * k + c]) * f64::from(o[c])).sum::<f64>())
            .collect();
        let (mut err, mut norm) = (0f64, 0f64);
        for e in 0..=p::N_EXPERTS {
            let row = if e < p::N_EXPERTS { &wr[e * d..(e + 1) * d] } else { &wg[..] };
            let w1 = |n: usize| f64::from(row[n]) * (1.0 + f64::from(nw[n]));
            let direct: f64 = (0..d).map(|n| w1(n) * h[n]).sum();
            let split: f64 = (0..d).map(|n| w1(n) * f64::from(x[n])).sum::<f64>()
                + (0..k).map(|c| f64::from(b[e * k + c]) * f64::from(o[c])).sum::<f64>();
            err += (direct - split).powi(2);
            norm += direct * direct;
        }
        let rel = (err / norm).sqrt();
        assert!(rel < 1e-6, "router sums through B: relative error {rel:.2e}");
    }

    /// Shapes that are not the model's name the weight.
    #[test]
    fn router_out_product_names_a_misshapen_weight() {
        let (d, k) = (p::D_MODEL, GDN_OUT);
        let router = rand_qmat(16, d, 8, 1);
        let gate = rand_qmat(1, d, 8, 2);
        let wo = rand_qmat(64, k, 4, 3);
        let err = router_out_product(router.as_ref(), gate.as_ref(), &vec![0.0; d], wo.as_ref()).unwrap_err().to_string();
        assert!(err.contains("mlp.gate") && err.contains("[16, 2048]"), "{err}");
        let router = rand_qmat(p::N_EXPERTS, d, 8, 1);
        let err = router_out_product(router.as_ref(), gate.as_ref(), &vec![0.0; d], wo.as_ref()).unwrap_err().to_string();
        assert!(err.contains("linear_attn.out_proj"), "{err}");
        let wo = rand_qmat(d, k, 4, 3);
        let err = router_out_product(router.as_ref(), gate.as_ref(), &[0.0; 7], wo.as_ref()).unwrap_err().to_string();
        assert!(err.contains("post_attention_layernorm"), "{err}");
    }
}
