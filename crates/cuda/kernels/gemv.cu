// Batch-1 decode GEMV for MLX affine group-wise quantized weights (4 or 8 bits, group 64).
//
//   out[r] = sum_c (scale[r, c/64] * q[r, c] + bias[r, c/64]) * x[c]
//          = sum_g scale_g * (sum_{c in g} q_c x_c) + bias_g * (sum_{c in g} x_c)
//
// Layout (crates/quant/README.md): packed u32 [rows, K*BITS/32], element 0 in the low bits;
// scales/biases bf16 [rows, K/64] (passed as raw u16 bits). x f32 [K], out f32 [rows].
//
// Mapping: a "team" of LANES lanes (<= 32, inside one warp) owns a row; lane l reads 16-byte
// chunks l, l+LANES, ... of the row (coalesced 16-byte loads). The lane's slice of x never
// changes, so it lives in registers for the whole kernel (loaded once per warp, pre-scaled, see
// below); a team walks rows grid-stride, RPW rows at a time so that RPW*IT 16-byte loads are
// in flight per lane.
//
// Dequantization without I2F: for a code q at bit offset s (s + BITS <= 16) of a 16-bit half
// word h, float_bits(0x4B000000 | (h & (MASK << s))) = 2^23 + q * 2^s exactly, so
// (that - 2^23) * (x * 2^-s) = q * x: one LOP3, one FADD, one FFMA per element. The 2^-s
// factor is folded into the x registers once.
//
// Dims come from the generated header (CALLA_* macros) prepended by the host.

#ifndef CALLA_QUANT_GROUP
#error "dims header missing"
#endif

namespace calla_gemv {

constexpr int GROUP = CALLA_QUANT_GROUP;

__device__ __forceinline__ float bf16_bits_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned)b) << 16);
}

template <int BITS, int K, int RPW>
__device__ __forceinline__ void gemv_body(float* __restrict__ out,
                                          const uint4* __restrict__ packed,
                                          const unsigned short* __restrict__ scales,
                                          const unsigned short* __restrict__ biases,
                                          const float* __restrict__ x,
                                          int rows) {
    constexpr int ROW_BYTES = K * BITS / 8;
    constexpr int CHUNKS = ROW_BYTES / 16;            // 16-byte chunks per row
    constexpr int LANES = CHUNKS < 32 ? CHUNKS : 32;  // lanes per row
    constexpr int IT = CHUNKS / LANES;                // chunks per lane per row
    constexpr int EPC = 128 / BITS;                   // elements per chunk
    constexpr int EPW = 32 / BITS;                    // elements per u32 word
    constexpr int EPH = EPW / 2;                      // elements per 16-bit half word
    constexpr int GPR = K / GROUP;                    // groups per row
    constexpr int CPG = GROUP / EPC;                  // chunks per group
    constexpr unsigned MASK = (1u << BITS) - 1u;
    static_assert(CHUNKS % LANES == 0, "row must split evenly over lanes");
    static_assert(LANES == 1 || LANES == 2 || LANES == 4 || LANES == 8 || LANES == 16 || LANES == 32, "lanes");
    static_assert(GROUP % EPC == 0, "a 16-byte chunk must lie inside one group");
    static_assert(K % GROUP == 0, "K must be whole groups");

    constexpr int TPW = 32 / LANES;                   // teams per warp
    const int lane = threadIdx.x & 31;
    const int sub = lane % LANES;                      // lane inside the team
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int n_warps = (gridDim.x * blockDim.x) >> 5;

    // x slice of this lane, pre-scaled by 2^-s, and per-chunk sums of x.
    float xs[IT][EPC];
    float xsum[IT];
#pragma unroll
    for (int i = 0; i < IT; ++i) {
        const int c0 = (i * LANES + sub) * EPC;
        const float4* xv = reinterpret_cast<const float4*>(x + c0);
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < EPC / 4; ++v) {
            float4 t = __ldg(xv + v);
            float e[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int j = v * 4 + u;                 // element inside the chunk
                const int shift = ((j % EPW) % EPH) * BITS; // bit offset inside its half word
                s += e[u];
                xs[i][j] = e[u] * (1.0f / float(1u << shift));
            }
        }
        xsum[i] = s;
    }

    // The loop bound is uniform across the warp (the shuffles below need every lane).
    for (int base = warp * TPW * RPW; base < rows; base += n_warps * TPW * RPW) {
        const int r0 = base + (lane / LANES) * RPW;
        uint4 w[RPW][IT];
        float sc[RPW][IT], bi[RPW][IT];
#pragma unroll
        for (int k = 0; k < RPW; ++k) {
            const int r = min(r0 + k, rows - 1);        // clamp: tail rows recompute the last row
#pragma unroll
            for (int i = 0; i < IT; ++i) {
                const int ch = i * LANES + sub;
                w[k][i] = __ldcs(packed + (size_t)r * CHUNKS + ch);
                const int g = ch / CPG;
                sc[k][i] = bf16_bits_to_f32(__ldg(scales + (size_t)r * GPR + g));
                bi[k][i] = bf16_bits_to_f32(__ldg(biases + (size_t)r * GPR + g));
            }
        }
#pragma unroll
        for (int k = 0; k < RPW; ++k) {
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < IT; ++i) {
                const unsigned words[4] = {w[k][i].x, w[k][i].y, w[k][i].z, w[k][i].w};
                float qx = 0.f;
#pragma unroll
                for (int wd = 0; wd < 4; ++wd) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const unsigned h = hh ? (words[wd] >> 16) : words[wd];
#pragma unroll
                        for (int p = 0; p < EPH; ++p) {
                            const int j = wd * EPW + hh * EPH + p;
                            const float f = __uint_as_float(0x4B000000u | (h & (MASK << (p * BITS)))) - 8388608.0f;
                            qx = fmaf(f, xs[i][j], qx);
                        }
                    }
                }
                acc = fmaf(sc[k][i], qx, fmaf(bi[k][i], xsum[i], acc));
            }
#pragma unroll
            for (int o = LANES / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (sub == 0 && r0 + k < rows) out[r0 + k] = acc;
        }
    }
}

}  // namespace calla_gemv

// One entry point per (bits, K) the model uses. K values come from the dims header.
#define CALLA_GEMV_ENTRY(NAME, BITS, K, RPW)                                                   \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                  \
        float* __restrict__ out, const uint4* __restrict__ packed,                             \
        const unsigned short* __restrict__ scales, const unsigned short* __restrict__ biases,  \
        const float* __restrict__ x, int rows) {                                               \
        calla_gemv::gemv_body<BITS, K, RPW>(out, packed, scales, biases, x, rows);             \
    }

// K = D_EXPERT (expert / shared-expert down projection)
CALLA_GEMV_ENTRY(gemv_q4_k512, 4, CALLA_D_EXPERT, 4)
CALLA_GEMV_ENTRY(gemv_q8_k512, 8, CALLA_D_EXPERT, 4)
// K = D_MODEL (every projection out of the residual stream, LM head)
CALLA_GEMV_ENTRY(gemv_q4_k2048, 4, CALLA_D_MODEL, 2)
CALLA_GEMV_ENTRY(gemv_q8_k2048, 8, CALLA_D_MODEL, 2)
// K = N_Q_HEADS * HEAD_DIM = N_V_HEADS * D_V (attention o_proj, GDN out_proj)
CALLA_GEMV_ENTRY(gemv_q4_k4096, 4, CALLA_ATTN_OUT, 2)
CALLA_GEMV_ENTRY(gemv_q8_k4096, 8, CALLA_ATTN_OUT, 1)
