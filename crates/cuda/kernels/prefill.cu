// Glue kernels of the batched (prefill) path.
//
// * router_f32_q{4,8}: y[t, n] = Σ_k W[n, k]·x[t, k] in f32 for a quantized W [n, D_MODEL]:
//   the MoE router logits of a prefill chunk. The tensor-core GEMMs round activations and
//   dequantized weights to bf16 (relative 2^-9), which is enough to flip near-tied top-k
//   choices; the router is tiny (257 rows), so it runs exactly in f32 on the CUDA cores.
//   Blocks of 256 threads own 16 tokens x 32 rows; K walks in chunks of 256 through shared
//   memory.
// * embed_rows_q{4,8}: x[i, 0..D_MODEL] = dequantized row ids[pos0 + i] of the quantized
//   embedding, for i in 0..t (MODEL.md §3.3), dequantized exactly as embed_gather (step.cu) and
//   quant::dequantize do (scale·q rounded, then + bias rounded, in f32). One block of
//   D_MODEL / 8 threads per token. A bad position or id writes NaN (never another row).

#ifndef CALLA_D_MODEL
#error "dims header missing"
#endif

namespace calla_prefill {

template <int BITS>
__device__ __forceinline__ void embed_rows_body(float* __restrict__ x, const unsigned* __restrict__ packed,
                                                const unsigned short* __restrict__ scales,
                                                const unsigned short* __restrict__ biases,
                                                const int* __restrict__ ids, int pos0, int t, int n_ids,
                                                int n_rows) {
    constexpr int D = CALLA_D_MODEL;
    calla_pdl_wait();
    const int i = blockIdx.x;
    if (i >= t) return;
    const int c0 = threadIdx.x * 8;
    const int p = pos0 + i;
    const int id = (p >= 0 && p < n_ids) ? __ldcg(ids + p) : -1;
    float v[8];
    calla_dequant_row8<BITS>(v, packed, scales, biases, id, n_rows, threadIdx.x);
    float4* xo = reinterpret_cast<float4*>(x + (size_t)i * D + c0);
    xo[0] = make_float4(v[0], v[1], v[2], v[3]);
    xo[1] = make_float4(v[4], v[5], v[6], v[7]);
}

template <int BITS>
__device__ __forceinline__ void router_f32_body(float* __restrict__ y, const unsigned* __restrict__ packed,
                                                const unsigned short* __restrict__ scales,
                                                const unsigned short* __restrict__ biases,
                                                const float* __restrict__ x, int t, int n) {
    constexpr int K = CALLA_D_MODEL;
    constexpr int KC = 256;
    constexpr int TT = 16, TR = 32;
    constexpr int WPR = K * BITS / 32;
    constexpr int GPR = K / CALLA_QUANT_GROUP;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    __shared__ float xs[TT][KC + 1];
    __shared__ float ws[TR][KC + 1];
    calla_pdl_wait();
    const int t0 = blockIdx.y * TT, r0 = blockIdx.x * TR;
    const int tid = threadIdx.x;
    const int ty = tid / 16, tx = tid % 16;
    float acc0 = 0.f, acc1 = 0.f;
    for (int k0 = 0; k0 < K; k0 += KC) {
        for (int i = tid; i < TT * KC; i += 256) {
            const int tt = i / KC, kk = i % KC, tok = t0 + tt;
            xs[tt][kk] = tok < t ? x[(size_t)tok * K + k0 + kk] : 0.f;
        }
        for (int i = tid; i < TR * KC; i += 256) {
            const int rr = i / KC, kk = i % KC, row = r0 + rr, c = k0 + kk;
            float w = 0.f;
            if (row < n) {
                const unsigned word = packed[(size_t)row * WPR + (c * BITS) / 32];
                const unsigned q = (word >> ((c * BITS) % 32)) & MASK;
                const size_t g = (size_t)row * GPR + c / CALLA_QUANT_GROUP;
                w = __fadd_rn(__fmul_rn(calla_bf16_to_f32(scales[g]), (float)q), calla_bf16_to_f32(biases[g]));
            }
            ws[rr][kk] = w;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < KC; ++kk) {
            const float xv = xs[ty][kk];
            acc0 = fmaf(xv, ws[tx][kk], acc0);
            acc1 = fmaf(xv, ws[tx + 16][kk], acc1);
        }
        __syncthreads();
    }
    const int tok = t0 + ty;
    if (tok < t) {
        if (r0 + tx < n) y[(size_t)tok * n + r0 + tx] = acc0;
        if (r0 + tx + 16 < n) y[(size_t)tok * n + r0 + tx + 16] = acc1;
    }
}

}  // namespace calla_prefill

extern "C" __global__ void __launch_bounds__(256)
router_f32_q4(float* __restrict__ y, const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales,
              const unsigned short* __restrict__ biases, const float* __restrict__ x, int t, int n) {
    calla_prefill::router_f32_body<4>(y, packed, scales, biases, x, t, n);
}

extern "C" __global__ void __launch_bounds__(256)
router_f32_q8(float* __restrict__ y, const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales,
              const unsigned short* __restrict__ biases, const float* __restrict__ x, int t, int n) {
    calla_prefill::router_f32_body<8>(y, packed, scales, biases, x, t, n);
}

extern "C" __global__ void __launch_bounds__(CALLA_D_MODEL / 8)
embed_rows_q4(float* __restrict__ x, const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales,
              const unsigned short* __restrict__ biases, const int* __restrict__ ids, int pos0, int t, int n_ids,
              int n_rows) {
    calla_prefill::embed_rows_body<4>(x, packed, scales, biases, ids, pos0, t, n_ids, n_rows);
}

extern "C" __global__ void __launch_bounds__(CALLA_D_MODEL / 8)
embed_rows_q8(float* __restrict__ x, const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales,
              const unsigned short* __restrict__ biases, const int* __restrict__ ids, int pos0, int t, int n_ids,
              int n_rows) {
    calla_prefill::embed_rows_body<8>(x, packed, scales, biases, ids, pos0, t, n_ids, n_rows);
}
