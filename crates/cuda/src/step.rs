//! Decode-step bookkeeping on the device (`kernels/step.cu`): the embedding gather at the start
//! of a step, the greedy pick with the token history at its end, and the position advance of a
//! prompt step. Together with [`CudaContext::gemv_residual`] these let a whole decode step —
//! and the prompt, token by token — replay from one CUDA graph: the current position is an
//! `i32` in device memory (`pos[0]`), the token history `ids` lives on the device, and no
//! launch argument changes between replays.

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use quant::Bits;
use spec::production as p;

use crate::{CudaContext, CudaError, DeviceQMat};

/// Threads per block of `argmax_step` (`ARGMAX_THREADS` in `kernels/step.cu`).
const ARGMAX_THREADS: usize = 512;
/// Most blocks of `argmax_step` (`ARGMAX_MAX_BLOCKS` in `kernels/step.cu`).
const ARGMAX_MAX_BLOCKS: usize = 256;
/// Logits per thread `argmax_step` aims for (sets the grid: 122 blocks for 248,320 logits).
const ARGMAX_PER_THREAD: usize = 4;
/// Words of the context's argmax scratch: per-block best values and ids, and the ticket counter
/// (zero between launches).
pub const STEP_SCRATCH_WORDS: usize = 2 * ARGMAX_MAX_BLOCKS + 1;

fn i32_len(what: &str, n: usize) -> Result<i32, CudaError> {
    i32::try_from(n).map_err(|_| CudaError::Unsupported(format!("{what}: {n} does not fit an i32")))
}

impl CudaContext {
    /// `x[0..D_MODEL] = embed[ids[pos[0]]]`, the row dequantized as `quant::dequantize` does
    /// (`scale·q` rounded, then `+ bias` rounded, in f32), so bit-identical to the CPU
    /// embedding (MODEL.md §3.3). `embed`: `[n_rows, D_MODEL]` quantized, 4 or 8 bits, any
    /// number of rows; `ids`: the token history; `pos`: `[1]`, the position of the token to
    /// embed. A position outside `ids` or an id outside `[0, n_rows)` writes a row of NaN
    /// (never another token's row). One block; reads `ids` and `pos` after the PDL wait.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `x` is not `D_MODEL` long or not 16-byte aligned,
    /// `embed` has other than `D_MODEL` columns, `pos` is empty, or a length does not fit an
    /// `i32`.
    pub fn embed_gather(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        embed: &DeviceQMat,
        ids: &CudaView<'_, i32>,
        pos: &CudaView<'_, i32>,
    ) -> Result<(), CudaError> {
        let d = p::D_MODEL;
        if x.len() != d || embed.cols != d || pos.is_empty() {
            return Err(CudaError::Unsupported(format!(
                "embed_gather shapes: x {} from a [{}, {}] embedding, pos {} (D_MODEL = {d})",
                x.len(),
                embed.rows,
                embed.cols,
                pos.len()
            )));
        }
        let xp = x.device_ptr(self.stream()).0;
        if xp % 16 != 0 {
            return Err(CudaError::Unsupported(format!(
                "embed_gather: x must be 16-byte aligned (device address {xp:#x})"
            )));
        }
        let n_ids = i32_len("embed_gather ids", ids.len())?;
        let n_rows = i32_len("embed_gather rows", embed.rows)?;
        let f = self.func(match embed.bits {
            Bits::B4 => "embed_gather_q4",
            Bits::B8 => "embed_gather_q8",
        })?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: ((d / 8) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(f);
        b.arg(x)
            .arg(embed.mlx_codes()?)
            .arg(&embed.scales)
            .arg(&embed.biases)
            .arg(ids)
            .arg(pos)
            .arg(&n_ids)
            .arg(&n_rows);
        // SAFETY: argument types match the kernel; every index is bounds-checked on the device.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The greedy pick at the end of a decode step: `t = argmax(logits[0..vocab_limit))` (ties
    /// to the lowest id, NaN never wins, 0 when no value is a number: `sampler::argmax`), then,
    /// with `q = pos[0] + 1`: `ids[q] = t` if `q >= n_fixed[0]` (past the prompt, whose ids
    /// the host uploaded) and `q < ids.len()` (the history is `max_ctx = ids.len()` long), and
    /// `pos[0] = q` in every case. `n_fixed`: `[1]`, the prompt length.
    ///
    /// Up to 256 blocks each reduce a share of the logits; the last to finish (an atomic ticket
    /// in a scratch buffer of the context) reduces their results, writes, and resets the ticket,
    /// so launches and graph replays follow each other freely on [`Self::stream`] (one at a
    /// time: the scratch is shared). `vocab_limit` is fixed per launch (it sets the grid):
    /// `spec::production::VOCAB_REAL` masks the padding rows of the LM head.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `vocab_limit > logits.len()`, `n_fixed` or `pos` is
    /// empty, or a length does not fit an `i32`.
    pub fn argmax_step(
        &self,
        logits: &CudaView<'_, f32>,
        vocab_limit: usize,
        ids: &mut CudaViewMut<'_, i32>,
        n_fixed: &CudaView<'_, i32>,
        pos: &mut CudaViewMut<'_, i32>,
    ) -> Result<(), CudaError> {
        if vocab_limit > logits.len() || n_fixed.is_empty() || pos.is_empty() {
            return Err(CudaError::Unsupported(format!(
                "argmax_step: vocab_limit {vocab_limit} of {} logits, n_fixed {}, pos {}",
                logits.len(),
                n_fixed.len(),
                pos.len()
            )));
        }
        let limit = i32_len("argmax_step vocab_limit", vocab_limit)?;
        let max_ctx = i32_len("argmax_step ids", ids.len())?;
        let blocks = vocab_limit
            .div_ceil(ARGMAX_THREADS * ARGMAX_PER_THREAD)
            .clamp(1, ARGMAX_MAX_BLOCKS);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (ARGMAX_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(self.func("argmax_step")?);
        b.arg(logits)
            .arg(&limit)
            .arg(ids)
            .arg(&max_ctx)
            .arg(n_fixed)
            .arg(pos)
            .arg(&self.step_scratch);
        // SAFETY: argument types match the kernel; indices are bounds-checked on the device;
        // the scratch has STEP_SCRATCH_WORDS words with the ticket zero between launches.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `pos[0] += 1`: the end of a prompt step that skips the LM head (the next prompt token is
    /// already in the history). One thread.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `pos` is empty; driver errors from the launch.
    pub fn advance_pos(&self, pos: &mut CudaViewMut<'_, i32>) -> Result<(), CudaError> {
        if pos.is_empty() {
            return Err(CudaError::Unsupported("advance_pos: empty pos".into()));
        }
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(self.func("advance_pos")?);
        b.arg(pos);
        // SAFETY: one i32 written, `pos` is non-empty.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
