//! Gated full-attention decode step (MODEL.md §3.6) on the GPU: batch 1, one token per call,
//! bf16 KV cache, split-K ("flash decoding") attention. Kernels: `kernels/attention.cu`.
//!
//! One step is two launches with grids fixed at [`CudaContext::attn_scratch`] time (so the step
//! can be captured in a CUDA graph and replayed while the position in device memory advances):
//! `attn_decode_split` (grid `n_splits × N_KV_HEADS`; each block covers an even share of the
//! current keys, chosen from `pos` on the device, for all 8 query heads of its KV head) and
//! `attn_decode_combine` (merges the partials, applies the output gate).

use cudarc::driver::{
    sys::CUfunction_attribute, CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use spec::production as p;

use crate::{CudaContext, CudaError};

/// Width of the stacked attention projection output: `q_proj` rows
/// (`N_Q_HEADS · 2 · HEAD_DIM` = 8192, per head `[query HEAD_DIM | gate HEAD_DIM]`, interleaved
/// per head exactly as `model::load::AttnWeights::q_proj` rows) | k (`N_KV_HEADS · HEAD_DIM` =
/// 512) | v (512) = 9216.
pub const ATTN_PROJ: usize = p::N_Q_HEADS * 2 * p::HEAD_DIM + 2 * p::N_KV_HEADS * p::HEAD_DIM;

/// Keys per warp tile of `attn_decode_split` (the unit the splits are made of).
const TILE: usize = 16;
/// Threads per block of `attn_decode_split` (4 warps).
const SPLIT_THREADS: u32 = 128;
/// Dynamic shared memory of `attn_decode_split`: 4 warps × 3 stages × (K + V tile of 16 keys).
const SPLIT_SMEM: usize = 4 * 3 * 2 * TILE * p::HEAD_DIM * 2;
/// Most splits the combine kernel takes (its shared arrays).
const MAX_SPLITS: usize = 1024;
/// Threads per block of `attn_decode_combine` (8 warps over the splits, 32 dims per block).
const COMBINE_THREADS: u32 = 256;

/// Device scratch of [`CudaContext::attn_decode_step`]: the split-K partials (per KV head and
/// split: unnormalised output `[8, HEAD_DIM]`, running max and softmax sum per query head),
/// sized for `max_ctx` when created. One per concurrently running attention step (the layers of
/// one decode step run in order and may share one).
pub struct AttnScratch {
    max_ctx: usize,
    n_splits: usize,
    /// `[N_KV_HEADS, n_splits, N_Q_HEADS / N_KV_HEADS, HEAD_DIM]` f32.
    part_o: CudaSlice<f32>,
    /// `[N_KV_HEADS, n_splits, N_Q_HEADS / N_KV_HEADS, 2]` f32: (max in log2 units, sum).
    part_ml: CudaSlice<f32>,
    /// L2 prefetch hints passed with the next split kernel (the decode step sets the layer's
    /// `o_proj` here); empty by default.
    pub l2_prefetch: crate::L2Prefetch,
}

impl AttnScratch {
    /// Positions the KV caches used with this scratch must hold.
    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// Blocks per KV head of the split kernel (fixed for the scratch's life).
    pub fn n_splits(&self) -> usize {
        self.n_splits
    }
}

impl CudaContext {
    /// Allocates the split-K scratch for caches of `max_ctx` positions. The number of splits is
    /// fixed here: one block per SM over both KV heads (`sm_count / N_KV_HEADS`), fewer when
    /// `max_ctx` has fewer 16-key tiles.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `max_ctx` is 0 or does not fit an `i32`; driver errors.
    pub fn attn_scratch(&self, max_ctx: usize) -> Result<AttnScratch, CudaError> {
        if max_ctx == 0 || max_ctx > i32::MAX as usize / p::HEAD_DIM {
            return Err(CudaError::Unsupported(format!(
                "attention max_ctx {max_ctx}"
            )));
        }
        let n_splits = (self.sm_count() as usize / p::N_KV_HEADS)
            .min(max_ctx.div_ceil(TILE))
            .clamp(1, MAX_SPLITS);
        let g = p::N_Q_HEADS / p::N_KV_HEADS;
        self.raw().bind_to_thread()?;
        self.func("attn_decode_split")?.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            SPLIT_SMEM as i32,
        )?;
        let stream = self.stream();
        Ok(AttnScratch {
            max_ctx,
            n_splits,
            part_o: stream.alloc_zeros(p::N_KV_HEADS * n_splits * g * p::HEAD_DIM)?,
            part_ml: stream.alloc_zeros(p::N_KV_HEADS * n_splits * g * 2)?,
            l2_prefetch: crate::L2Prefetch::default(),
        })
    }

    /// One decode step of gated full attention (MODEL.md §3.6) for the token at position
    /// `*pos` (read on the device: the number of positions already cached):
    ///
    /// 1. q_h (16 heads) and k (2 KV heads) ← ZNorm over `HEAD_DIM` (eps `RMS_EPS`, weight
    ///    `1 + w`), then rotate-half RoPE on the first `ROTARY_DIM` dims at angle
    ///    `pos · inv_freq[i]` in f32 (`model::reference::{zrms_norm, rope_inplace}`);
    /// 2. k and v rounded to bf16 (nearest even) and written to row `pos` of the caches;
    /// 3. causal GQA attention of query head h (KV head h / 8) over rows `0..=pos`, scale
    ///    `HEAD_DIM^-1/2`, f32 softmax, on the bf16 cache;
    /// 4. `out[h] = attention_h ⊙ sigmoid(gate_h)`.
    ///
    /// Shapes: `proj` `[ATTN_PROJ]` f32 (q_proj | k_proj | v_proj outputs, see [`ATTN_PROJ`]);
    /// `q_norm`, `k_norm` `[HEAD_DIM]` (zero-centred); `inv_freq` `[ROTARY_DIM / 2]`
    /// (= `model::reference::rope_inv_freq(theta, ROTARY_DIM)`); `pos` `[1]` i32;
    /// `k_cache`, `v_cache` `[scratch.max_ctx(), N_KV_HEADS, HEAD_DIM]` bf16 bits (k stored after
    /// k_norm and RoPE); `out` `[N_Q_HEADS · HEAD_DIM]` f32, head-major (the input of o_proj).
    /// `proj`, `q_norm`, `k_norm`, the caches and `out` must be 16-byte aligned.
    ///
    /// Safe for any `*pos`: with `pos >= max_ctx` nothing is written to the caches and the
    /// step attends over the `max_ctx` cached rows; with `pos < 0` the output is 0. Two
    /// launches on [`Self::stream`], graph-capturable (fixed grids, no host reads).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] on wrong lengths or alignment; driver errors.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode_step(
        &self,
        proj: &CudaView<'_, f32>,
        q_norm: &CudaView<'_, f32>,
        k_norm: &CudaView<'_, f32>,
        inv_freq: &CudaView<'_, f32>,
        pos: &CudaView<'_, i32>,
        k_cache: &mut CudaViewMut<'_, u16>,
        v_cache: &mut CudaViewMut<'_, u16>,
        scratch: &mut AttnScratch,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        self.attn_decode_kernels(
            proj, q_norm, k_norm, inv_freq, pos, k_cache, v_cache, scratch, out, true, true,
        )
    }

    /// [`Self::attn_decode_step`] with either of its two launches left out (`split`:
    /// `attn_decode_split`, `combine`: `attn_decode_combine`). For timing each kernel alone in
    /// the self-test; a partial step leaves `out` or the scratch stale.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode_kernels(
        &self,
        proj: &CudaView<'_, f32>,
        q_norm: &CudaView<'_, f32>,
        k_norm: &CudaView<'_, f32>,
        inv_freq: &CudaView<'_, f32>,
        pos: &CudaView<'_, i32>,
        k_cache: &mut CudaViewMut<'_, u16>,
        v_cache: &mut CudaViewMut<'_, u16>,
        scratch: &mut AttnScratch,
        out: &mut CudaViewMut<'_, f32>,
        split: bool,
        combine: bool,
    ) -> Result<(), CudaError> {
        let hd = p::HEAD_DIM;
        let cache_len = scratch.max_ctx * p::N_KV_HEADS * hd;
        if proj.len() != ATTN_PROJ
            || q_norm.len() != hd
            || k_norm.len() != hd
            || inv_freq.len() != p::ROTARY_DIM / 2
            || pos.is_empty()
            || k_cache.len() != cache_len
            || v_cache.len() != cache_len
            || out.len() != p::N_Q_HEADS * hd
        {
            return Err(CudaError::Unsupported(format!(
                "attn_decode_step shapes: proj {} (want {ATTN_PROJ}), q_norm {}, k_norm {} (want \
                 {hd}), inv_freq {} (want {}), pos {}, caches {} / {} (want {cache_len} for \
                 max_ctx {}), out {} (want {})",
                proj.len(),
                q_norm.len(),
                k_norm.len(),
                inv_freq.len(),
                p::ROTARY_DIM / 2,
                pos.len(),
                k_cache.len(),
                v_cache.len(),
                scratch.max_ctx,
                out.len(),
                p::N_Q_HEADS * hd
            )));
        }
        let stream = self.stream();
        let aligned = [
            proj.device_ptr(stream).0,
            q_norm.device_ptr(stream).0,
            k_norm.device_ptr(stream).0,
            k_cache.device_ptr(stream).0,
            v_cache.device_ptr(stream).0,
            out.device_ptr(stream).0,
        ]
        .iter()
        .all(|a| a % 16 == 0);
        if !aligned {
            return Err(CudaError::Unsupported(
                "attn_decode_step: proj, q_norm, k_norm, the caches and out must be 16-byte aligned"
                    .into(),
            ));
        }
        let max_ctx = scratch.max_ctx as i32;
        let n_splits = scratch.n_splits as i32;
        let qscale = (std::f64::consts::LOG2_E / (hd as f64).sqrt()) as f32;
        let cfg = LaunchConfig {
            grid_dim: (scratch.n_splits as u32, p::N_KV_HEADS as u32, 1),
            block_dim: (SPLIT_THREADS, 1, 1),
            shared_mem_bytes: SPLIT_SMEM as u32,
        };
        if split {
            let split_early = i32::from(self.attn_split_early_trigger());
            let mut b = stream.launch_builder(self.func("attn_decode_split")?);
            b.arg(proj)
                .arg(q_norm)
                .arg(k_norm)
                .arg(inv_freq)
                .arg(pos)
                .arg(k_cache)
                .arg(v_cache)
                .arg(&mut scratch.part_o)
                .arg(&mut scratch.part_ml)
                .arg(&max_ctx)
                .arg(&n_splits)
                .arg(&qscale)
                .arg(&scratch.l2_prefetch)
                .arg(&split_early);
            // SAFETY: argument types, lengths and alignment match the kernel (checked above); the
            // dynamic shared memory limit was raised in `attn_scratch`.
            unsafe { b.launch(cfg) }?;
        }
        if !combine {
            return Ok(());
        }

        let cfg = LaunchConfig {
            grid_dim: (p::N_Q_HEADS as u32, (hd / 32) as u32, 1),
            block_dim: (COMBINE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let early = i32::from(self.attn_combine_early_trigger());
        let mut b = stream.launch_builder(self.func("attn_decode_combine")?);
        b.arg(proj)
            .arg(pos)
            .arg(&scratch.part_o)
            .arg(&scratch.part_ml)
            .arg(out)
            .arg(&max_ctx)
            .arg(&n_splits)
            .arg(&early);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
