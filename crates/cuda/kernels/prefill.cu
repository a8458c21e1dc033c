// Glue kernels of the batched (prefill) path.
//
// * router_f32_q{4,8}: y[t, n] = Σ_k W[n, k]·x[t, k] in f32 for a quantized W [n, D_MODEL]:
//   the MoE router logits of a prefill chunk. The tensor-core GEMMs round activations and
//   dequantized weights to bf16 (relative 2^-9), which is enough to flip near-tied top-k
//   choices; the router is tiny (257 rows), so it runs exactly in f32 on the CUDA cores.
//   Blocks of 128 threads own 32 or 64 tokens x 32 rows (8 or 16 outputs per thread, the
//   operands read k-major from shared memory); K walks in double-buffered chunks of 32, each
//   weight dequantized once per block. One accumulator per output in K order: the same bits
//   as a sequential f32 sum of fmas.
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

// The f32 router. Lanes: tx = lane % 8 owns TN consecutive rows, ty = lane / 8 four consecutive
// tokens (a warp: 16 tokens x 8·TN rows); warps WT (tokens) x WR (rows) per block: BT = 16·WT
// tokens x BR = 8·TN·WR rows. K walks in chunks of KC through two shared-memory buffers, both
// k-major (xs[k][token], ws[k][row]) so that at each k a warp reads 64 contiguous bytes of x
// (4 float4, each broadcast to 8 lanes) and 64 or 128 contiguous bytes of W (8 float2/float4)
// for 4·TN fmas per thread. Within a row, groups of 4 floats are XOR-swizzled by k so that the
// transposing stores of coalesced global loads hit distinct banks. Each chunk's x (float4 along
// K) and packed words are loaded into registers two chunks ahead and stored (W dequantized) at
// the end of the chunk before theirs: one barrier per chunk, two chunks of fmas to hide the
// loads' latency.
template <int BITS, int TN, int WT, int WR>
struct RouterCfg {
    static constexpr int K = CALLA_D_MODEL;
    static constexpr int KC = 32;                      // k per chunk
    static constexpr int NT = 32 * WT * WR;            // threads
    static constexpr int BT = 16 * WT, BR = 8 * TN * WR;
    static constexpr int XV = BT * KC / 4 / NT;        // float4 of x per thread per chunk
    static constexpr int WU = BR * KC / 8 / NT;        // 8-weight units per thread per chunk
    static constexpr int WPR = K * BITS / 32;          // packed words per row
    static constexpr int GPR = K / CALLA_QUANT_GROUP;
    static_assert(BT * KC % (4 * NT) == 0 && BR * KC % (8 * NT) == 0, "chunk split");
    static_assert(K % (2 * KC) == 0 && CALLA_QUANT_GROUP % 8 == 0 && KC == 32, "chunking");
    static_assert(BT % 32 == 0 && BR == 32, "rows of whole bank sets; the swizzles below");
    static_assert(TN == 2 || TN == 4, "W read as float2 or float4");
};

// Swizzled offsets within a k-row: x (BT tokens, groups of 4 XOR (k/4) mod 8) and W (32 rows,
// groups of 4 XOR 2·((k/8) mod 4)). See the store patterns in router_f32_body.
template <int BT>
__device__ __forceinline__ int rx_off(int k, int tok) { return k * BT + 4 * ((tok >> 2) ^ ((k >> 2) & 7)) + (tok & 3); }
__device__ __forceinline__ int rw_off(int k, int row) { return k * 32 + 4 * ((row >> 2) ^ (2 * ((k >> 3) & 3))) + (row & 3); }

template <int BITS, int TN, int WT, int WR>
__device__ __forceinline__ void router_f32_body(float* __restrict__ y, const unsigned* __restrict__ packed,
                                                const unsigned short* __restrict__ scales,
                                                const unsigned short* __restrict__ biases,
                                                const float* __restrict__ x, int t, int n) {
    using C = RouterCfg<BITS, TN, WT, WR>;
    constexpr int KC = C::KC, BT = C::BT, BR = C::BR;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr int WPU = BITS / 4;                      // packed words per 8-weight unit
    __shared__ __align__(16) float xs[2][KC * BT];
    __shared__ __align__(16) float ws[2][KC * BR];
    calla_pdl_wait();
    const int t0 = blockIdx.y * BT, r0 = blockIdx.x * BR;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tx = lane & 7, ty = lane >> 3;
    const int xo = (warp % WT) * 16 + ty * 4;          // this thread's first token in the tile
    const int wo = (warp / WT) * 8 * TN + tx * TN;     // its first row

    // Fill roles (coalesced global loads). x: float4 i = tid + NT·v of the chunk -> k4 = i % 8,
    // token i / 8 (8 lanes read 128 contiguous bytes of one token). W: unit u = tid + NT·v ->
    // k8 = u % 4, row u / 4 (4 lanes read one row's 16 or 32 contiguous bytes).
    // Two register sets: [s] holds the chunk two ahead of the one that last used it.
    float4 xr[2][C::XV];
    unsigned wr[2][C::WU][WPU];
    unsigned short sr[2][C::WU], br[2][C::WU];
    auto load = [&](int sl, int k0) {
#pragma unroll
        for (int v = 0; v < C::XV; ++v) {
            const int i = tid + C::NT * v, tok = t0 + i / 8, k4 = i % 8;
            xr[sl][v] = tok < t ? __ldcg(reinterpret_cast<const float4*>(x + (size_t)tok * C::K + k0 + 4 * k4))
                                : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int v = 0; v < C::WU; ++v) {
            const int u = tid + C::NT * v, row = r0 + u / 4, c = k0 + 8 * (u % 4);
            if (row < n) {
#pragma unroll
                for (int j = 0; j < WPU; ++j) wr[sl][v][j] = __ldg(packed + (size_t)row * C::WPR + c * BITS / 32 + j);
                const size_t g = (size_t)row * C::GPR + c / CALLA_QUANT_GROUP;
                sr[sl][v] = __ldg(scales + g);
                br[sl][v] = __ldg(biases + g);
            } else {
#pragma unroll
                for (int j = 0; j < WPU; ++j) wr[sl][v][j] = 0u;
                sr[sl][v] = 0;
                br[sl][v] = 0; // zero scale and bias: the weight is exactly 0
            }
        }
    };
    // Stores: lane l of a warp writes k-rows 4·(l % 8) + c (x) at tokens l / 8 (+ a multiple of
    // 4): 8 k-groups x 4 tokens -> 32 distinct banks through rx_off; W: k-rows 8·(l % 4) + j at
    // rows l / 4 (+ a multiple of 8) -> 32 distinct banks through rw_off.
    auto store = [&](int sl, int b) {
#pragma unroll
        for (int v = 0; v < C::XV; ++v) {
            const int i = tid + C::NT * v, tt = i / 8, k = 4 * (i % 8);
            xs[b][rx_off<BT>(k, tt)] = xr[sl][v].x;
            xs[b][rx_off<BT>(k + 1, tt)] = xr[sl][v].y;
            xs[b][rx_off<BT>(k + 2, tt)] = xr[sl][v].z;
            xs[b][rx_off<BT>(k + 3, tt)] = xr[sl][v].w;
        }
#pragma unroll
        for (int v = 0; v < C::WU; ++v) {
            const int u = tid + C::NT * v, rr = u / 4, k8 = u % 4;
            // dequantized as quant::dequantize does: scale·q rounded, then + bias rounded
            const float sc = calla_bf16_to_f32(sr[sl][v]), bi = calla_bf16_to_f32(br[sl][v]);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const unsigned q = (wr[sl][v][(j * BITS) / 32] >> ((j * BITS) % 32)) & MASK;
                ws[b][rw_off(8 * k8 + j, rr)] = __fadd_rn(__fmul_rn(sc, (float)q), bi);
            }
        }
    };

    float acc[4][TN];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
    constexpr int NC = C::K / KC;
    load(0, 0);
    load(1, KC);
    store(0, 0);
    __syncthreads();
    // chunk c computes from buffer c % 2; its registers (set c % 2) take chunk c + 2; at its end
    // chunk c + 1 (set (c + 1) % 2, loaded a chunk earlier) goes to the other buffer, which was
    // last read in chunk c - 1, before the barrier that ended it.
    auto chunk = [&](int c, int b) { // b = c % 2, a constant after unrolling
        if (c + 2 < NC) load(b, (c + 2) * KC);
        const float* xb = xs[b];
        const float* wb = ws[b];
#pragma unroll 8
        for (int k = 0; k < KC; ++k) {
            const float4 xv = *reinterpret_cast<const float4*>(xb + rx_off<BT>(k, xo));
            float w[TN];
            if constexpr (TN == 4) {
                const float4 t4 = *reinterpret_cast<const float4*>(wb + rw_off(k, wo));
                w[0] = t4.x; w[1] = t4.y; w[2] = t4.z; w[3] = t4.w;
            } else {
                const float2 t2 = *reinterpret_cast<const float2*>(wb + rw_off(k, wo));
                w[0] = t2.x; w[1] = t2.y;
            }
            const float xa[4] = {xv.x, xv.y, xv.z, xv.w};
            // one accumulator per output, k ascending: the CPU's sequential f32 sum of fmas
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(xa[i], w[j], acc[i][j]);
        }
        if (c + 1 < NC) store(b ^ 1, b ^ 1);
        __syncthreads();
    };
#pragma unroll 1
    for (int c = 0; c < NC; c += 2) {
        chunk(c, 0);
        chunk(c + 1, 1);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int tok = t0 + xo + i;
        if (tok >= t) continue;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int row = r0 + wo + j;
            if (row < n) y[(size_t)tok * n + row] = acc[i][j];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The router from exact integer products (router_dg_q{4,8}_p{4,8}). Per token and 64-column
// group, x is written as four balanced base-256 digits of X = round(x · 2^(30-E))
// (calla_qt::quantize_words, as the MoE decode kernels quantize u), so that
//   Σ_{c in g} W[r, c] x[c] = scale[r,g] · 2^(E-30) · Σ_c q[r,c] X[c] + bias[r,g] · Σ_c x[c]
// with Σ q X = C0 + 256 C1 + 65536 (C2 + 256 C3), C_i = Σ_c q[r,c] d_i[c] exact in int32
// (|C_i| <= 64 · 255 · 128). The roundings: X (2^-30 of the group's largest |x|), Σx (an f32
// tree sum), the f32 conversions of C0 + 256 C1 and of C2 + 256 C3 (the powers of two 2^(E-30)
// and 65536 scale them exactly), two f32 fma chains over the 32 groups (one per lane of a pair:
// the low digits with bias·Σx, the high digits), and the add of the two. About as accurate as a
// sequential f32 chain over the 2,048 columns (the router_f32 kernels'; on the self-test's
// inputs 1.1e-7 against 3.1e-7 of Σ|w·x|), not the same bits. The two chains' partial sums can
// be a few times Σ|w·x| when a group's values share a sign (scale·q and bias·Σx then cancel),
// which the accuracy then follows. mma.m16n8k32 u8 x s8: the 8 columns of B are 2 tokens x 4
// digits.
//
// Block: one warp per 16-row tile of W (blockDim = 32 · ceil(n / 16), n <= N_EXPERTS + 1), TB = 2 ·
// PAIRS tokens. First the block writes its tokens' digits into shared memory (a half-warp per
// (token, group)): dg[token][group][digit][16 words], word j of a digit row holding the digits of
// the 4 columns lane t of an mma consumes as A's bytes: at 8 bits columns 4j .. 4j+3; at 4 bits
// 8(j/2) + (j%2) + {0, 2, 4, 6} (the nibbles w & 0x0F0F0F0F and (w >> 4) & 0x0F0F0F0F of packed
// word j/2 give), then per group each warp loads lane t's 16 bytes (8 bits) or 8 bytes (4 bits)
// of rows g and g+8 straight from the MLX layout (columns 16t .. 16t+15: digit-row words 4t ..
// 4t+3) and runs 2 mmas per token pair. Dynamic shared memory: TB · (NG · 256 + NG · 8) bytes.
constexpr int DG_GROUPS = CALLA_D_MODEL / CALLA_QUANT_GROUP;
constexpr int DG_TOKEN_BYTES = DG_GROUPS * (256 + 8);  // digits, then meta {2^(E-30), Σx}, per token
constexpr int DG_MAX_THREADS = 32 * ((CALLA_N_EXPERTS + 1 + 15) / 16);  // the router and shared-gate rows
// groups of weights in flight per warp (dividing DG_GROUPS), as many as fit the 96 registers
// per thread ptxas gives these entry points (17 warps) without spills: at 4 bits 4 with 8
// tokens per block, 2 with 16; at 8 bits 2 and 1 (one group ahead)
template <int BITS, int PAIRS>
constexpr int dg_ahead() { return BITS == 4 ? (PAIRS == 4 ? 4 : 2) : (PAIRS == 4 ? 2 : 1); }

template <int BITS>
__device__ __forceinline__ float4 dg_values(const float* __restrict__ xg, int q) {
    if (BITS == 8) return __ldcg(reinterpret_cast<const float4*>(xg + 4 * q));
    const int c = 8 * (q >> 1) + (q & 1);
    return make_float4(__ldcg(xg + c), __ldcg(xg + c + 2), __ldcg(xg + c + 4), __ldcg(xg + c + 6));
}

// KS > 1 (router_dg_*_k{KS}, short prompts): the 32 groups are split over a cluster of KS blocks
// (blockIdx.y = the block's rank, groups KS·rank .. of NG / KS), each block running the same
// two chains over its groups and adding the pair (low + high); rank 0 then adds the ranks'
// partial sums in rank order from their shared memory (DSMEM) and stores. Deterministic, not
// the bits of KS = 1 (the chains restart per rank). Dynamic shared memory: TB · (NG / KS) ·
// 264 bytes of digits, then (KS > 1) the partials, 32 · ceil(n / 16) · PAIRS float2.
template <int BITS, int PAIRS, int KS>
__device__ __forceinline__ void router_dg_body(float* __restrict__ y, const unsigned* __restrict__ packed,
                                               const unsigned short* __restrict__ scales,
                                               const unsigned short* __restrict__ biases,
                                               const float* __restrict__ x, int t, int n) {
    constexpr int K = CALLA_D_MODEL, NGA = DG_GROUPS, NG = NGA / KS, TB = 2 * PAIRS;
    constexpr int WPR = K * BITS / 32;   // packed words per row
    constexpr int WPG = 64 * BITS / 32;  // packed words per row and group
    constexpr int DG_AHEAD = dg_ahead<BITS, PAIRS>() < NG ? dg_ahead<BITS, PAIRS>() : NG;
    static_assert(NGA % KS == 0 && NG % DG_AHEAD == 0, "whole rounds of the weight ring");
    static_assert(CALLA_QUANT_GROUP == 64, "one mma pair per 64-column group");
    extern __shared__ __align__(16) unsigned dg[];                        // [TB][NG][4][16]
    float2* meta = reinterpret_cast<float2*>(dg + TB * NG * 64);         // [TB][NG]
    float2* part = meta + TB * NG;                                       // KS > 1: [warps][PAIRS][32]
    calla_pdl_wait();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int t0 = blockIdx.x * TB;
    const int rank = KS > 1 ? (int)blockIdx.y : 0, gbase = rank * NG;  // this block's first group

    // the block's tokens as digits, DG_JOBS (token, group) jobs per half-warp and pass with all
    // their loads issued first (both half-warps of a warp run the same jobs up to the parity:
    // TB · NG and the strides are even, so the shuffles of quantize_words see all 32 lanes)
    {
        constexpr int DG_JOBS = 4;
        const int q = lane & 15;
        for (int j0 = 2 * warp + (lane >> 4); j0 < TB * NG; j0 += 2 * nw * DG_JOBS) {
            float4 v[DG_JOBS];
#pragma unroll
            for (int u = 0; u < DG_JOBS; ++u) {
                const int job = j0 + 2 * nw * u, tok = t0 + job / NG;
                v[u] = job < TB * NG && tok < t ? dg_values<BITS>(x + (size_t)tok * K + (gbase + job % NG) * 64, q)
                                                : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < DG_JOBS; ++u) {
                const int job = j0 + 2 * nw * u;
                if (job < TB * NG) {  // the same for both half-warps
                    const int tt = job / NG, gi = job % NG;
                    unsigned w[4];
                    float2 mt;
                    calla_qt::quantize_words(v[u], w, mt);
                    if (!(fabsf(mt.y) <= 3.402823466e38f)) mt.x = __int_as_float(0x7fc00000);  // NaN / inf poison the token
                    unsigned* d = dg + (tt * NG + gi) * 64;
#pragma unroll
                    for (int k = 0; k < 4; ++k) d[16 * k + q] = w[k];
                    if (q == 0) meta[tt * NG + gi] = mt;
                }
            }
        }
    }
    __syncthreads();
    const int r0 = warp * 16;
    if (KS == 1 && r0 >= n) return;  // with a cluster every thread reaches its barriers
    const int g = lane >> 2, tq = lane & 3;
    const int ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);
    const unsigned* pa = packed + (size_t)ra * WPR + gbase * WPG + (BITS == 8 ? 4 : 2) * tq;
    const unsigned* pb = packed + (size_t)rb * WPR + gbase * WPG + (BITS == 8 ? 4 : 2) * tq;
    const unsigned short* sa = scales + (size_t)ra * NGA + gbase;
    const unsigned short* sb = scales + (size_t)rb * NGA + gbase;
    const unsigned short* ba = biases + (size_t)ra * NGA + gbase;
    const unsigned short* bb = biases + (size_t)rb * NGA + gbase;
    // lane t's C columns 2t, 2t+1: token 2p + t/2, digits {0, 1} (t even) or {2, 3}
    const float tmul = (tq & 1) ? 65536.0f : 1.0f, xmask = (tq & 1) ? 0.0f : 1.0f;
    // lane (g, t)'s B column g: token 2p + g/4, digit g % 4
    const unsigned* bcol = dg + (g >> 2) * NG * 64 + (g & 3) * 16 + 4 * tq;
    const float2* mcol = meta + (tq >> 1) * NG;
    float acc[PAIRS][2];
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) acc[p][0] = acc[p][1] = 0.f;
    auto load_a = [&](int gi, uint4& wa, uint4& wb, float4& sbv) {
        if (BITS == 8) {
            wa = __ldg(reinterpret_cast<const uint4*>(pa + gi * WPG));
            wb = __ldg(reinterpret_cast<const uint4*>(pb + gi * WPG));
        } else {
            const uint2 a = __ldg(reinterpret_cast<const uint2*>(pa + gi * WPG));
            const uint2 b = __ldg(reinterpret_cast<const uint2*>(pb + gi * WPG));
            wa = make_uint4(a.x, a.y, 0u, 0u);
            wb = make_uint4(b.x, b.y, 0u, 0u);
        }
        sbv = make_float4(calla_bf16_to_f32(__ldg(sa + gi)), calla_bf16_to_f32(__ldg(ba + gi)),
                          calla_bf16_to_f32(__ldg(sb + gi)), calla_bf16_to_f32(__ldg(bb + gi)));
    };
    // a ring of DG_AHEAD groups of weights in registers: group gi's slot is refilled with
    // group gi + DG_AHEAD as soon as it is copied out, before gi's products, so that that many
    // L2 round trips overlap (one group ahead, each group waited ~1 us: the time per block
    // followed the 32 groups)
    uint4 ring_a[DG_AHEAD], ring_b[DG_AHEAD];
    float4 ring_s[DG_AHEAD];
#pragma unroll
    for (int i = 0; i < DG_AHEAD; ++i) load_a(i, ring_a[i], ring_b[i], ring_s[i]);
#pragma unroll 1
    for (int g0 = 0; g0 < NG; g0 += DG_AHEAD) {
#pragma unroll
        for (int slot = 0; slot < DG_AHEAD; ++slot) {
            const int gi = g0 + slot;
            const uint4 wa = ring_a[slot], wb = ring_b[slot];
            const float4 sbv = ring_s[slot];
            if (gi + DG_AHEAD < NG) load_a(gi + DG_AHEAD, ring_a[slot], ring_b[slot], ring_s[slot]);
            unsigned a[8];
            if (BITS == 8) {
                a[0] = wa.x; a[1] = wb.x; a[2] = wa.y; a[3] = wb.y;
                a[4] = wa.z; a[5] = wb.z; a[6] = wa.w; a[7] = wb.w;
            } else {
                a[0] = wa.x & 0x0F0F0F0Fu; a[1] = wb.x & 0x0F0F0F0Fu;
                a[2] = (wa.x >> 4) & 0x0F0F0F0Fu; a[3] = (wb.x >> 4) & 0x0F0F0F0Fu;
                a[4] = wa.y & 0x0F0F0F0Fu; a[5] = wb.y & 0x0F0F0F0Fu;
                a[6] = (wa.y >> 4) & 0x0F0F0F0Fu; a[7] = (wb.y >> 4) & 0x0F0F0F0Fu;
            }
#pragma unroll
            for (int p = 0; p < PAIRS; ++p) {
                const uint4 bq = *reinterpret_cast<const uint4*>(bcol + (2 * p * NG + gi) * 64);
                const float2 mt = mcol[2 * p * NG + gi];
                int d[4] = {0, 0, 0, 0};
                calla_qt::mma_u8s8(d, a[0], a[1], a[2], a[3], bq.x, bq.y);
                calla_qt::mma_u8s8(d, a[4], a[5], a[6], a[7], bq.z, bq.w);
                // f = 2^(E-30) (· 65536): f · v is exact (no subnormal scale · 2^(E-30) either)
                const float f = mt.x * tmul, xs = mt.y * xmask;
                acc[p][0] = fmaf(sbv.x, f * (float)(d[0] + 256 * d[1]), fmaf(sbv.y, xs, acc[p][0]));
                acc[p][1] = fmaf(sbv.z, f * (float)(d[2] + 256 * d[3]), fmaf(sbv.w, xs, acc[p][1]));
            }
        }
    }
    float2 v[PAIRS];
#pragma unroll
    for (int p = 0; p < PAIRS; ++p)
        v[p] = make_float2(acc[p][0] + __shfl_xor_sync(0xffffffffu, acc[p][0], 1),
                           acc[p][1] + __shfl_xor_sync(0xffffffffu, acc[p][1], 1));
    if constexpr (KS > 1) {
        // rank 0 adds the other ranks' sums, in rank order, from their shared memory
#pragma unroll
        for (int p = 0; p < PAIRS; ++p) part[(warp * PAIRS + p) * 32 + lane] = v[p];
        calla_cluster_sync();
        if (rank == 0) {
#pragma unroll
            for (int r = 1; r < KS; ++r)
#pragma unroll
                for (int p = 0; p < PAIRS; ++p) {
                    const float2 o = calla_ld_dsmem_f2(&part[(warp * PAIRS + p) * 32 + lane], r);
                    v[p].x += o.x;
                    v[p].y += o.y;
                }
        }
        calla_cluster_sync();  // no block leaves while rank 0 may still read its partials
        if (rank != 0 || r0 >= n) return;
    }
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
        const int tok = t0 + 2 * p + (tq >> 1);
        if ((tq & 1) == 0 && tok < t) {
            if (r0 + g < n) y[(size_t)tok * n + r0 + g] = v[p].x;
            if (r0 + g + 8 < n) y[(size_t)tok * n + r0 + g + 8] = v[p].y;
        }
    }
}

}  // namespace calla_prefill

// Router entry points: `router_f32_q{4,8}` the narrow tile (32 tokens x 32 rows per block, 8
// outputs per thread: more blocks for short prompts), `router_f32w_q{4,8}` the wide one (64
// tokens x 32 rows, 16 outputs per thread: fewer shared-memory reads per fma). 128 threads,
// grid (ceil(n / 32), ceil(t / BT)); the host picks (prefill.rs router_logits_f32).
#define CALLA_ROUTER_ENTRY(NAME, BITS, TN, WT, WR)                                                         \
    extern "C" __global__ void __launch_bounds__(32 * WT * WR)                                              \
    NAME(float* __restrict__ y, const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales, \
         const unsigned short* __restrict__ biases, const float* __restrict__ x, int t, int n) {            \
        calla_prefill::router_f32_body<BITS, TN, WT, WR>(y, packed, scales, biases, x, t, n);             \
    }
CALLA_ROUTER_ENTRY(router_f32_q4, 4, 2, 2, 2)
CALLA_ROUTER_ENTRY(router_f32_q8, 8, 2, 2, 2)
CALLA_ROUTER_ENTRY(router_f32w_q4, 4, 4, 4, 1)
CALLA_ROUTER_ENTRY(router_f32w_q8, 8, 4, 4, 1)

// Integer router entry points: router_dg_q{BITS}_p{PAIRS} (2 · PAIRS tokens per block), grid
// ceil(t / (2 · PAIRS)), 32 · ceil(n / 16) threads (n <= N_EXPERTS + 1), dynamic shared memory
// 2 · PAIRS · DG_TOKEN_BYTES; the host picks (prefill.rs router_logits_digits).
#define CALLA_ROUTER_DG_ENTRY(NAME, BITS, PAIRS)                                                           \
    extern "C" __global__ void __launch_bounds__(calla_prefill::DG_MAX_THREADS)                             \
    NAME(float* __restrict__ y, const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales, \
         const unsigned short* __restrict__ biases, const float* __restrict__ x, int t, int n) {            \
        calla_prefill::router_dg_body<BITS, PAIRS, 1>(y, packed, scales, biases, x, t, n);                 \
    }
CALLA_ROUTER_DG_ENTRY(router_dg_q4_p4, 4, 4)
CALLA_ROUTER_DG_ENTRY(router_dg_q8_p4, 8, 4)
CALLA_ROUTER_DG_ENTRY(router_dg_q4_p8, 4, 8)
CALLA_ROUTER_DG_ENTRY(router_dg_q8_p8, 8, 8)
// The groups split over a cluster of KS blocks (grid (ceil(t / 8), KS)): short prompts, whose
// few blocks would each walk all 32 groups.
#define CALLA_ROUTER_DG_KS_ENTRY(NAME, BITS, KS)                                                           \
    extern "C" __global__ void __cluster_dims__(1, KS, 1) __launch_bounds__(calla_prefill::DG_MAX_THREADS)  \
    NAME(float* __restrict__ y, const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales, \
         const unsigned short* __restrict__ biases, const float* __restrict__ x, int t, int n) {            \
        calla_prefill::router_dg_body<BITS, 4, KS>(y, packed, scales, biases, x, t, n);                    \
    }
CALLA_ROUTER_DG_KS_ENTRY(router_dg_q4_p4_k2, 4, 2)
CALLA_ROUTER_DG_KS_ENTRY(router_dg_q4_p4_k4, 4, 4)
CALLA_ROUTER_DG_KS_ENTRY(router_dg_q4_p4_k8, 4, 8)
CALLA_ROUTER_DG_KS_ENTRY(router_dg_q8_p4_k2, 8, 2)
CALLA_ROUTER_DG_KS_ENTRY(router_dg_q8_p4_k4, 8, 4)
CALLA_ROUTER_DG_KS_ENTRY(router_dg_q8_p4_k8, 8, 8)

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
