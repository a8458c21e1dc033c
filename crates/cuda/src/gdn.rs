//! Gated DeltaNet decode step on the GPU (batch 1, one token per call): `kernels/gdn.cu`.
//!
//! One launch does docs/MODEL.md §3.5 steps 2-6 and step 8's gated RMSNorm: causal conv +
//! SiLU over the token's pre-conv q|k|v and the conv-state shift, L2 norm of q and k (q scaled
//! by `d_k^-1/2`), the gates, the delta-rule update of the GDN state and its read-out, and the
//! gated RMSNorm. The CPU twin is the T = 1 path of `model::Model`'s GDN mixer
//! (`reference::{causal_conv_silu, l2norm_inplace, gdn_step, gated_rms_norm}`).

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use spec::production as p;

use crate::{CudaContext, CudaError};

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

/// Blocks per V-head (must match `COL_BLOCKS` in `kernels/gdn.cu`).
const COL_BLOCKS: usize = 4;
/// Threads per block (must match `THREADS` in `kernels/gdn.cu`).
const THREADS: u32 = 256;

/// Scratch of [`CudaContext::gdn_decode_step`]. The fused kernel needs none (blocks exchange
/// the gated norm's partial sums through cluster shared memory); the type keeps the API stable
/// should a variant need device scratch. Allocate once with [`CudaContext::gdn_scratch`].
#[derive(Debug)]
pub struct GdnScratch {
    /// L2 prefetch hints passed with the next [`CudaContext::gdn_decode_step`] (the decode step
    /// sets the layer's `out_proj` here); empty by default.
    pub l2_prefetch: crate::L2Prefetch,
}

impl CudaContext {
    /// Scratch for [`Self::gdn_decode_step`] (currently no device memory).
    pub fn gdn_scratch(&self) -> Result<GdnScratch, CudaError> {
        Ok(GdnScratch { l2_prefetch: crate::L2Prefetch::default() })
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
    /// waits before it triggers, and across graph launches).
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
        let checks = [
            ("proj", proj.len(), GDN_PROJ),
            ("conv_w", conv_w.len(), GDN_CONV_DIM * p::CONV_KERNEL),
            ("a_neg_exp", a_neg_exp.len(), p::N_V_HEADS),
            ("dt_bias", dt_bias.len(), p::N_V_HEADS),
            ("norm_w", norm_w.len(), p::D_V),
            ("conv_state", conv_state.len(), GDN_CONV_STATE_LEN),
            ("s", s.len(), GDN_STATE_LEN),
            ("out", out.len(), GDN_OUT),
        ];
        for (name, got, want) in checks {
            if got != want {
                return Err(CudaError::Unsupported(format!(
                    "gdn_decode_step: {name} has {got} elements, expected {want}"
                )));
            }
        }
        let stream = self.stream();
        let aligned = [
            ("s", s.device_ptr(stream).0),
            ("conv_w", conv_w.device_ptr(stream).0),
            ("out", out.device_ptr(stream).0),
        ];
        for (name, ptr) in aligned {
            if ptr % 16 != 0 {
                return Err(CudaError::Unsupported(format!(
                    "gdn_decode_step: {name} at {ptr:#x} is not 16-byte aligned (float4 access)"
                )));
            }
        }
        let cfg = LaunchConfig {
            grid_dim: ((p::N_V_HEADS * COL_BLOCKS) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(self.func("gdn_decode_step")?);
        b.arg(out)
            .arg(s)
            .arg(conv_state)
            .arg(proj)
            .arg(conv_w)
            .arg(a_neg_exp)
            .arg(dt_bias)
            .arg(norm_w)
            .arg(&scratch.l2_prefetch);
        // SAFETY: argument order and types match the kernel's signature; lengths checked above.
        // The cluster shape is a compile-time attribute of the kernel (__cluster_dims__), and
        // the grid is a multiple of it.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
