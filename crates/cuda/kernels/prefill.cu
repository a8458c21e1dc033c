// Glue kernels of the batched (prefill) path.
//
// * router_f32_q{4,8}: y[t, n] = Σ_k W[n, k]·x[t, k] in f32 for a quantized W [n, D_MODEL]:
//   the MoE router logits of a prefill chunk. The tensor-core GEMMs round activations and
//   dequantized weights to bf16 (relative 2^-9), which is enough to flip near-tied top-k
//   choices; the router is tiny (257 rows), so it runs exactly in f32 on the CUDA cores.
//   Blocks of 256 threads own 64 tokens x 32 rows (8 outputs per thread, read as float4 along
//   K from shared memory); K walks in chunks of 64, each weight dequantized once per block.
//   One accumulator per output in K order: the same bits as a sequential f32 sum of fmas.
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
    constexpr int KC = 64;          // k per shared-memory chunk
    constexpr int TT = 64, TR = 32; // tokens x rows per block
    constexpr int PAD = KC + 4;     // row stride in floats: 16-byte rows, conflict-free float4 reads
    constexpr int WPR = K * BITS / 32;
    constexpr int GPR = K / CALLA_QUANT_GROUP;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    static_assert(K % KC == 0 && CALLA_QUANT_GROUP % 8 == 0, "chunking");
    __shared__ __align__(16) float xs[TT * PAD];
    __shared__ __align__(16) float ws[TR * PAD];
    calla_pdl_wait();
    const int t0 = blockIdx.y * TT, r0 = blockIdx.x * TR;
    const int tid = threadIdx.x;
    // each thread: rows tx and tx + 16, tokens ty + 16 j (j < 4)
    const int tx = tid % 16, ty = tid / 16;
    float acc[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = 0.f;
    for (int k0 = 0; k0 < K; k0 += KC) {
        for (int i = tid; i < TT * KC / 4; i += 256) {
            const int tt = i / (KC / 4), k4 = i % (KC / 4), tok = t0 + tt;
            const float4 v = tok < t ? *reinterpret_cast<const float4*>(x + (size_t)tok * K + k0 + 4 * k4)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
            *reinterpret_cast<float4*>(&xs[tt * PAD + 4 * k4]) = v;
        }
        {
            // 8 consecutive weights of one row per thread (one group: CALLA_QUANT_GROUP % 8 == 0),
            // dequantized as quant::dequantize does: scale·q rounded, then + bias rounded
            const int rr = tid / 8, k8 = (tid % 8) * 8, row = r0 + rr, c = k0 + k8;
            float w[8];
            if (row < n) {
                const size_t g = (size_t)row * GPR + c / CALLA_QUANT_GROUP;
                const float sc = calla_bf16_to_f32(scales[g]), bi = calla_bf16_to_f32(biases[g]);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int cj = c + j;
                    const unsigned q = (packed[(size_t)row * WPR + (cj * BITS) / 32] >> ((cj * BITS) % 32)) & MASK;
                    w[j] = __fadd_rn(__fmul_rn(sc, (float)q), bi);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) w[j] = 0.f;
            }
            *reinterpret_cast<float4*>(&ws[rr * PAD + k8]) = make_float4(w[0], w[1], w[2], w[3]);
            *reinterpret_cast<float4*>(&ws[rr * PAD + k8 + 4]) = make_float4(w[4], w[5], w[6], w[7]);
        }
        __syncthreads();
#pragma unroll 4
        for (int kk = 0; kk < KC; kk += 4) {
            const float4 w0 = *reinterpret_cast<const float4*>(&ws[tx * PAD + kk]);
            const float4 w1 = *reinterpret_cast<const float4*>(&ws[(tx + 16) * PAD + kk]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float4 xv = *reinterpret_cast<const float4*>(&xs[(ty + 16 * j) * PAD + kk]);
                // one accumulator per output, k ascending: the CPU's sequential f32 sum of fmas
                acc[j][0] = fmaf(xv.x, w0.x, acc[j][0]);
                acc[j][0] = fmaf(xv.y, w0.y, acc[j][0]);
                acc[j][0] = fmaf(xv.z, w0.z, acc[j][0]);
                acc[j][0] = fmaf(xv.w, w0.w, acc[j][0]);
                acc[j][1] = fmaf(xv.x, w1.x, acc[j][1]);
                acc[j][1] = fmaf(xv.y, w1.y, acc[j][1]);
                acc[j][1] = fmaf(xv.z, w1.z, acc[j][1]);
                acc[j][1] = fmaf(xv.w, w1.w, acc[j][1]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int tok = t0 + ty + 16 * j;
        if (tok < t) {
            if (r0 + tx < n) y[(size_t)tok * n + r0 + tx] = acc[j][0];
            if (r0 + tx + 16 < n) y[(size_t)tok * n + r0 + tx + 16] = acc[j][1];
        }
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
