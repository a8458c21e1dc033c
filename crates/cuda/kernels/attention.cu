// Gated full-attention decode step (MODEL.md §3.6), batch 1, one token: q/k ZNorm, partial
// rotate-half RoPE, append k/v to the bf16 KV cache, causal GQA attention over positions
// 0..=pos with split-K (flash decoding), output gate. Two kernels:
//
// * attn_decode_split: grid (n_splits, N_KV_HEADS), 4 warps. Every block serves all
//   G = N_Q/N_KV query heads of its KV head, so each K/V row is read from memory once. The
//   block's key range comes from pos at run time (the T = ceil(n/16) tiles of 16 keys are spread
//   evenly over the n_splits blocks: split s owns tiles [s*T/S, (s+1)*T/S)), so the fixed grid
//   uses the whole GPU at any context length. Each warp streams its tiles through a private
//   3-stage cp.async pipeline (K and V tile: 2 x 8 KB) and runs both products on tensor cores
//   (mma.sync m16n8k16 bf16, f32 accumulate):
//     S[16 x 16 keys] = [q_hi; q_lo](16 x 256) . K^T      (rows 0-7 hi, 8-15 lo: s = hi + lo)
//     O^T[256 x 8]   += V^T(256 x 16 keys) . P_hi^T + V^T . P_lo^T
//   q and p are split into bf16 hi + lo parts (x = hi + lo to ~2^-17 relative) and the cache is
//   bf16, so every product is exact and the result keeps f32-level accuracy. The S accumulator
//   layout equals the B-fragment layout of the second product: no shuffles between them.
//   Online softmax in base 2 (log2(e)/sqrt(head_dim) is folded into q). The block that owns
//   position pos computes k (ZNorm, RoPE) and v, rounds them to bf16, writes them to the caches
//   and puts them into its shared tile (row pos is never read from global memory). The warps'
//   states are merged in shared memory; one partial (m, l, o[G][HEAD_DIM]) per block.
// * attn_decode_combine: grid (N_Q_HEADS, HEAD_DIM / 32): merges the partials of the non-empty
//   splits, divides by the softmax sum and multiplies by sigmoid(gate).
//
// proj layout: [q_proj rows: per head (query HEAD_DIM | gate HEAD_DIM)] | k [N_KV, HEAD_DIM] |
// v [N_KV, HEAD_DIM], f32. Caches: [max_ctx, N_KV, HEAD_DIM] bf16 bits.

#ifndef CALLA_HEAD_DIM
#error "dims header missing"
#endif

namespace calla_attn {

#define NEG_INF (__int_as_float(0xff800000u))

constexpr int HD = CALLA_HEAD_DIM;
constexpr int NQ = CALLA_N_Q_HEADS;
constexpr int NKV = CALLA_N_KV_HEADS;
constexpr int G = NQ / NKV;           // query heads per KV head
constexpr int HALF = CALLA_ROTARY_DIM / 2;
constexpr int QW = 2 * HD;            // proj floats per query head (query | gate)
constexpr int K_OFF = NQ * QW;        // k in proj
constexpr int V_OFF = K_OFF + NKV * HD;
constexpr int ROW = NKV * HD;         // cache elements per position
constexpr int TILE = 16;              // keys per warp tile
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int STAGES = 3;
constexpr int ROW_BYTES = HD * 2;     // one key (or value) row of one KV head, bf16
constexpr int TILE_BYTES = TILE * ROW_BYTES;
constexpr int STAGE_BYTES = 2 * TILE_BYTES;  // K tile then V tile
constexpr int SMEM_BYTES = WARPS * STAGES * STAGE_BYTES;
constexpr int KSL = HD / 16;          // 16-wide k-slices of the QK product = m-tiles of PV
constexpr int OB_STRIDE = HD + 4;     // padded f32 row of the block merge (no bank conflicts)
constexpr int MAX_SPLITS = 1024;
constexpr int COMBINE_THREADS = 256;

static_assert(G == 8, "the G query heads of a KV head are the n = 8 side of the mma");
static_assert(ROW_BYTES == 32 * 16, "a key row is one 16-byte chunk per lane");
static_assert(HALF % 8 == 0 && 2 * HALF <= HD && HALF <= 32, "RoPE halves are whole 8-element lane slices");
static_assert(G == 2 * WARPS, "each warp prepares two query heads");
static_assert(WARPS * G * OB_STRIDE * 4 <= SMEM_BYTES && OB_STRIDE % 4 == 0, "block merge fits in the stage memory");
static_assert(HD % 32 == 0, "combine: 32 dims per block");

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
// 16-byte async copy global -> shared; src_bytes = 0 zero-fills without reading.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
// c += a . b, m16n8k16, bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// x = hi + lo in bf16 (each round to nearest even), for two elements packed (x0 in the low half).
__device__ __forceinline__ void split2(float x0, float x1, unsigned& hi, unsigned& lo) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(hi) : "f"(x1), "f"(x0));
    const float r0 = x0 - calla_bf16_to_f32((unsigned short)(hi & 0xffffu));
    const float r1 = x1 - calla_bf16_to_f32((unsigned short)(hi >> 16));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(lo) : "f"(r1), "f"(r0));
}
// Byte offset of 16-byte chunk `ch` of row `r` in a [TILE][ROW_BYTES] tile, XOR-swizzled so the
// 8 rows an ldmatrix reads land in 8 different bank groups.
__device__ __forceinline__ unsigned tile_off(int r, int ch) { return r * ROW_BYTES + ((ch ^ (r & 7)) << 4); }

// Number of keys attended: positions 0..=pos, clamped to the cache.
__device__ __forceinline__ int n_keys(int pos, int max_ctx) {
    return pos < 0 ? 0 : (pos >= max_ctx ? max_ctx : pos + 1);
}

// ZNorm over the HEAD_DIM values of one head held 8 per lane (x), weight 1 + w, then
// rotate-half RoPE on the first 2*HALF dims (the CPU reference:
// model::reference::{zrms_norm, rope_inplace}). w: this lane's 8 weights (zero-centred).
// sn, cs: sin and cos of pos * inv_freq[lane]
// (one sincosf per lane, shared by every head). Whole warp (apply = false: x unchanged, the
// shuffles still run so that every call is warp-convergent).
__device__ __forceinline__ void norm_rope(float (&x)[8], const float (&w)[8], float sn, float cs, int lane,
                                          bool apply = true) {
    float x_in[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x_in[j] = x[j];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += x[j] * x[j];
    ss = calla_warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / float(HD) + CALLA_RMS_EPS);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = x[j] * r * (1.0f + w[j]);
    constexpr int PL = HALF / 8;  // lanes per RoPE half
    const int partner = lane < PL ? lane + PL : lane - PL;
    const int f0 = (lane % PL) * 8;  // first frequency of this lane's slice
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float o = __shfl_sync(0xffffffffu, x[j], partner & 31);
        const float s = __shfl_sync(0xffffffffu, sn, f0 + j);
        const float c = __shfl_sync(0xffffffffu, cs, f0 + j);
        if (lane < PL)
            x[j] = x[j] * c - o * s;
        else if (lane < 2 * PL)
            x[j] = x[j] * c + o * s;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = apply ? x[j] : x_in[j];
}

}  // namespace calla_attn

using namespace calla_attn;

// proj [ATTN_PROJ] f32; q_norm, k_norm [HEAD_DIM] (zero-centred); inv_freq [ROTARY_DIM/2];
// pos [1]; k_cache, v_cache [max_ctx, N_KV, HEAD_DIM] bf16; part_o [N_KV, n_splits, G, HEAD_DIM],
// part_ml [N_KV, n_splits, G, 2] (running max in log2 units, softmax sum) f32. qscale =
// log2(e)/sqrt(HEAD_DIM). Dynamic shared memory: SMEM_BYTES. `early` (nonzero): trigger the
// dependent launch before the PDL wait instead of after the key loop.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
attn_decode_split(const float* __restrict__ proj, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                  const float* __restrict__ inv_freq, const int* __restrict__ pos_p, unsigned short* k_cache,
                  unsigned short* v_cache, float* __restrict__ part_o, float* __restrict__ part_ml, int max_ctx,
                  int n_splits, float qscale, CallaL2Prefetch pf, int early) {
    calla_l2_prefetch_share(pf);  // e.g. o_proj's weights, read right after the combine
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(16) unsigned short qs_hi[G][HD];
    __shared__ __align__(16) unsigned short qs_lo[G][HD];
    __shared__ __align__(16) unsigned short new_kv[2][HD];  // this token's k (normed, roped), v: bf16
    __shared__ float wml[WARPS][G][2];
    __shared__ float wf[WARPS][G];

    const int split = blockIdx.x, kv = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;

    // constants (never written by an earlier kernel): loaded before the PDL wait
    const float freq = inv_freq[lane % HALF];
    float qw[8], kw[8];
    {
        const float4* a = reinterpret_cast<const float4*>(q_norm + lane * 8);
        const float4* b = reinterpret_cast<const float4*>(k_norm + lane * 8);
        const float4 a0 = a[0], a1 = a[1], b0 = b[0], b1 = b[1];
        qw[0] = a0.x, qw[1] = a0.y, qw[2] = a0.z, qw[3] = a0.w, qw[4] = a1.x, qw[5] = a1.y, qw[6] = a1.z, qw[7] = a1.w;
        kw[0] = b0.x, kw[1] = b0.y, kw[2] = b0.z, kw[3] = b0.w, kw[4] = b1.x, kw[5] = b1.y, kw[6] = b1.z, kw[7] = b1.w;
    }
    // early: the combine kernel may launch (and trigger the output projection in turn) as soon
    // as every block of this one runs; it still waits for this grid's completion
    if (early) calla_pdl_launch_dependents();
    calla_pdl_wait();
    calla_l2_progress_bump(pf);  // the input projection has completed (the L2 follower's cue)
    // this warp's two query heads, loaded together with pos (one memory round trip)
    float4 qin[2][2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const float4* src = reinterpret_cast<const float4*>(proj + (kv * G + warp * 2 + k) * QW + lane * 8);
        qin[k][0] = src[0];
        qin[k][1] = src[1];
    }
    // and this token's k (warp 0) or v (warp 1); warps 2, 3 load k and discard it
    float4 ein[2];
    {
        const float4* src = reinterpret_cast<const float4*>(proj + (warp == 1 ? V_OFF : K_OFF) + kv * HD + lane * 8);
        ein[0] = src[0];
        ein[1] = src[1];
    }
    const int pos = *pos_p;
    const int n = n_keys(pos, max_ctx);
    const int n_tiles = (n + TILE - 1) / TILE;
    const int t0 = split * n_tiles / n_splits, t1 = (split + 1) * n_tiles / n_splits;
    if (t0 >= t1) return;  // nothing to do at this length (the combine skips this split)
    const bool has_new = pos >= 0 && pos < max_ctx;  // row pos is this token's own k/v
    const int n_read = has_new ? pos : n;            // rows read from the cache: [0, n_read)
    const bool own_new = has_new && pos / TILE >= t0 && pos / TILE < t1;

    // warp w takes the block's tiles t0 + w, t0 + w + WARPS, ...
    const int my_n = (t1 - t0 > warp) ? (t1 - t0 - warp + WARPS - 1) / WARPS : 0;
    unsigned char* wstage = smem + warp * STAGES * STAGE_BYTES;
    const unsigned wstage_s = smem_addr(wstage);
    auto issue = [&](int i) {
        if (i < my_n) {
            const int t = t0 + warp + i * WARPS;
            const unsigned st = wstage_s + (i % STAGES) * STAGE_BYTES;
#pragma unroll 4
            for (int r = 0; r < TILE; ++r) {
                const int key = t * TILE + r;
                const bool ok = key < n_read;
                const size_t off = (size_t)(ok ? key : 0) * ROW + kv * HD + lane * 8;
                const unsigned d = st + tile_off(r, lane);
                cp_async16(d, k_cache + off, ok ? 16 : 0);
                cp_async16(d + TILE_BYTES, v_cache + off, ok ? 16 : 0);
            }
        }
        cp_async_commit();
    };
#pragma unroll 1
    for (int i = 0; i < STAGES - 1; ++i) issue(i);

    // sin/cos of the RoPE angles, one frequency per lane (angle pos * inv_freq in f32, as the
    // reference); the heads get them by shuffles
    float sn, cs;
    sincosf((float)pos * freq, &sn, &cs);

    // --- this block's query heads: ZNorm, RoPE, scale, split into bf16 hi + lo
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int hl = warp * 2 + k;
        const float4 a = qin[k][0], b = qin[k][1];
        float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        norm_rope(x, qw, sn, cs, lane);
        unsigned hi[4], lo[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) split2(x[2 * j] * qscale, x[2 * j + 1] * qscale, hi[j], lo[j]);
        *reinterpret_cast<uint4*>(&qs_hi[hl][lane * 8]) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        *reinterpret_cast<uint4*>(&qs_lo[hl][lane * 8]) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
    // --- this token's k (ZNorm, RoPE) and v, to bf16; the block that owns row pos writes them to
    // the caches and to new_kv (for its tile). Every warp runs norm_rope (convergent shuffles).
    {
        float x[8] = {ein[0].x, ein[0].y, ein[0].z, ein[0].w, ein[1].x, ein[1].y, ein[1].z, ein[1].w};
        norm_rope(x, kw, sn, cs, lane, warp != 1);
        if (own_new && warp < 2) {
            unsigned u[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                u[j] = (unsigned)calla_f32_to_bf16(x[2 * j]) | ((unsigned)calla_f32_to_bf16(x[2 * j + 1]) << 16);
            const uint4 v4 = make_uint4(u[0], u[1], u[2], u[3]);
            *reinterpret_cast<uint4*>(&new_kv[warp][lane * 8]) = v4;
            unsigned short* cache = warp == 0 ? k_cache : v_cache;
            *reinterpret_cast<uint4*>(cache + (size_t)pos * ROW + kv * HD + lane * 8) = v4;
        }
    }
    __syncthreads();

    // q fragments (A operand of S = Q K^T): rows 0-7 q_hi of head g, rows 8-15 q_lo
    unsigned qa[KSL][4];
#pragma unroll
    for (int j = 0; j < KSL; ++j) {
        qa[j][0] = *reinterpret_cast<const unsigned*>(&qs_hi[g][16 * j + 2 * c]);
        qa[j][1] = *reinterpret_cast<const unsigned*>(&qs_lo[g][16 * j + 2 * c]);
        qa[j][2] = *reinterpret_cast<const unsigned*>(&qs_hi[g][16 * j + 8 + 2 * c]);
        qa[j][3] = *reinterpret_cast<const unsigned*>(&qs_lo[g][16 * j + 8 + 2 * c]);
    }

    // O^T accumulators: acc[i] = O[head 2c, 2c+1][dim 16i + g], O[2c, 2c+1][dim 16i + g + 8]
    float acc[KSL][4];
#pragma unroll
    for (int i = 0; i < KSL; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_run = NEG_INF, l_run = 0.f;  // for head g (same in the 4 lanes of the group)

    // ldmatrix row addresses: lane -> matrix lane>>3, row (lane&7) + 8*(lane>>4), chunk +(lane>>3)&1
    const int lr = (lane & 7) + ((lane >> 4) << 3);
    const int lch = (lane >> 3) & 1;

    for (int i = 0; i < my_n; ++i) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();
        issue(i + STAGES - 1);  // into the stage consumed in the previous iteration
        const int t = t0 + warp + i * WARPS;
        unsigned char* st = wstage + (i % STAGES) * STAGE_BYTES;
        const unsigned st_s = wstage_s + (i % STAGES) * STAGE_BYTES;
        if (own_new && pos / TILE == t) {
            const int r = pos - t * TILE;
            *reinterpret_cast<uint4*>(st + tile_off(r, lane)) = *reinterpret_cast<const uint4*>(&new_kv[0][lane * 8]);
            *reinterpret_cast<uint4*>(st + TILE_BYTES + tile_off(r, lane)) =
                *reinterpret_cast<const uint4*>(&new_kv[1][lane * 8]);
            __syncwarp();
        }

        // S = Q K^T over 16 keys: n-tile 0 = keys 0-7, 1 = keys 8-15; even/odd k-slices apart
        float s_acc[2][2][4] = {};
#pragma unroll
        for (int j = 0; j < KSL; ++j) {
            unsigned b[4];
            ldsm_x4(st_s + tile_off(lr, 2 * j + lch), b);
            mma_bf16(s_acc[j & 1][0], qa[j], b[0], b[1]);
            mma_bf16(s_acc[j & 1][1], qa[j], b[2], b[3]);
        }
        // scores of head g at keys 2c, 2c+1, 8+2c, 9+2c (log2 units): hi rows + lo rows
        float sc[4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            sc[2 * nt] = (s_acc[0][nt][0] + s_acc[1][nt][0]) + (s_acc[0][nt][2] + s_acc[1][nt][2]);
            sc[2 * nt + 1] = (s_acc[0][nt][1] + s_acc[1][nt][1]) + (s_acc[0][nt][3] + s_acc[1][nt][3]);
        }
        const int kbase = t * TILE + 2 * c;
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (kbase + (q & 1) + 8 * (q >> 1) >= n) sc[q] = NEG_INF;
        float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_old = m_run;
        const float m_new = fmaxf(m_old, mx);  // finite: every tile holds a key < n
        const float alpha = exp2f(m_old - m_new);
        float p[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) p[q] = exp2f(sc[q] - m_new);
        l_run = l_run * alpha + ((p[0] + p[1]) + (p[2] + p[3]));
        m_run = m_new;
        // rescale when a running max moved (the first tile finds acc = 0: nothing to scale)
        if (__any_sync(0xffffffffu, m_new != m_old && m_old > NEG_INF)) {
            const float a0 = __shfl_sync(0xffffffffu, alpha, 8 * c);
            const float a1 = __shfl_sync(0xffffffffu, alpha, 8 * c + 4);
#pragma unroll
            for (int k = 0; k < KSL; ++k) {
                acc[k][0] *= a0;
                acc[k][1] *= a1;
                acc[k][2] *= a0;
                acc[k][3] *= a1;
            }
        }
        // P as the B operand of O^T += V^T P^T (keys 2c, 2c+1 | 8+2c, 9+2c of head g), hi + lo
        unsigned ph0, pl0, ph1, pl1;
        split2(p[0], p[1], ph0, pl0);
        split2(p[2], p[3], ph1, pl1);
#pragma unroll
        for (int k = 0; k < KSL; ++k) {
            unsigned va[4];
            ldsm_x4_t(st_s + TILE_BYTES + tile_off(lr, 2 * k + lch), va);
            mma_bf16(acc[k], va, ph0, ph1);
            mma_bf16(acc[k], va, pl0, pl1);
        }
    }
    if (!early) calla_pdl_launch_dependents();

    // --- merge the warps' states in shared memory (the stage buffers are free now)
    cp_async_wait<0>();
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    __syncthreads();
    float* ob = reinterpret_cast<float*>(smem);  // [WARPS][G][OB_STRIDE]
    if (c == 0) {
        wml[warp][g][0] = m_run;
        wml[warp][g][1] = l_run;
    }
    float* obw = ob + warp * G * OB_STRIDE;
#pragma unroll
    for (int k = 0; k < KSL; ++k) {
        obw[(2 * c) * OB_STRIDE + 16 * k + g] = acc[k][0];
        obw[(2 * c + 1) * OB_STRIDE + 16 * k + g] = acc[k][1];
        obw[(2 * c) * OB_STRIDE + 16 * k + g + 8] = acc[k][2];
        obw[(2 * c + 1) * OB_STRIDE + 16 * k + g + 8] = acc[k][3];
    }
    __syncthreads();
    const size_t part = (size_t)kv * n_splits + split;
    if (tid < G) {  // block max and sum per head; each warp's weight 2^(m_w - m)
        float m = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, wml[w][tid][0]);
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float wm = wml[w][tid][0];
            const float f = wm > NEG_INF ? exp2f(wm - m) : 0.f;  // empty warps: acc = 0, l = 0
            wf[w][tid] = f;
            l += f * wml[w][tid][1];
        }
        part_ml[(part * G + tid) * 2] = m;
        part_ml[(part * G + tid) * 2 + 1] = l;
    }
    __syncthreads();
    float4* po = reinterpret_cast<float4*>(part_o + part * G * HD);
#pragma unroll 1
    for (int idx = tid; idx < G * HD / 4; idx += THREADS) {
        const int h = idx / (HD / 4), d4 = idx % (HD / 4);
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = wf[w][h];
            const float4 v = reinterpret_cast<const float4*>(ob + (w * G + h) * OB_STRIDE)[d4];
            o.x += f * v.x;
            o.y += f * v.y;
            o.z += f * v.z;
            o.w += f * v.w;
        }
        po[idx] = o;
    }
}

// Merges the split partials: out[h, d] = (sum_s 2^(m_s - M) o_s[d]) / (sum_s 2^(m_s - M) l_s)
// * sigmoid(gate_h[d]) over the non-empty splits. Grid (N_Q_HEADS, HEAD_DIM / 32), 256 threads:
// warp w sums splits w, w + 8, ... for 32 dims (independent loads), then the 8 sums are added.
// out [N_Q_HEADS * HEAD_DIM] f32, head-major. With no keys (pos < 0) the output is 0. `early`
// (nonzero): trigger the dependent launch at entry instead of after the partial sums.
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
attn_decode_combine(const float* __restrict__ proj, const int* __restrict__ pos_p, const float* __restrict__ part_o,
                    const float* __restrict__ part_ml, float* __restrict__ out, int max_ctx, int n_splits, int early) {
    constexpr int CW = COMBINE_THREADS / 32;  // warps
    __shared__ float sf[MAX_SPLITS];          // running max of split s, then its weight 2^(m_s - M)
    __shared__ float sl[MAX_SPLITS];          // softmax sum of split s
    __shared__ float red[CW][32];
    __shared__ float s_inv_l;
    const int h = blockIdx.x, kv = h / G, hl = h % G;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int d = blockIdx.y * 32 + lane;
    // early: the next kernel (the output projection, whose 200 KB blocks take ~3 us to land and
    // then stream their weights before their own wait) may launch as soon as every block of this
    // one runs; it still waits for this grid's completion before reading `out`.
    if (early) calla_pdl_launch_dependents();
    calla_pdl_wait();
    // pos, the gate and every split's (m, l) in one memory round trip; then drop empty splits
    const float* ml = part_ml + ((size_t)kv * n_splits * G + hl) * 2;
    float2 mls[(MAX_SPLITS + COMBINE_THREADS - 1) / COMBINE_THREADS];
#pragma unroll
    for (int i = 0; i < (MAX_SPLITS + COMBINE_THREADS - 1) / COMBINE_THREADS; ++i) {
        const int s = tid + i * COMBINE_THREADS;
        if (s < n_splits) mls[i] = *reinterpret_cast<const float2*>(ml + (size_t)s * G * 2);
    }
    const int n = n_keys(*pos_p, max_ctx);
    const float gate = proj[h * QW + HD + d];
    const int n_tiles = (n + TILE - 1) / TILE;
#pragma unroll
    for (int i = 0; i < (MAX_SPLITS + COMBINE_THREADS - 1) / COMBINE_THREADS; ++i) {
        const int s = tid + i * COMBINE_THREADS;
        if (s < n_splits) {
            const bool live = (s + 1) * n_tiles / n_splits > s * n_tiles / n_splits;
            sf[s] = live ? mls[i].x : NEG_INF;
            sl[s] = live ? mls[i].y : 0.f;
        }
    }
    __syncthreads();
    if (warp == 0) {
        float m = NEG_INF;
        for (int s = lane; s < n_splits; s += 32) m = fmaxf(m, sf[s]);
        m = calla_warp_max(m);
        float l = 0.f;
        for (int s = lane; s < n_splits; s += 32) {
            const float ms = sf[s];
            const float f = ms > NEG_INF ? exp2f(ms - m) : 0.f;
            sf[s] = f;
            l += f * sl[s];
        }
        l = calla_warp_sum(l);
        if (lane == 0) s_inv_l = l > 0.f ? 1.f / l : 0.f;
    }
    __syncthreads();
    const float* po = part_o + ((size_t)kv * n_splits * G + hl) * HD + d;
    float o = 0.f;
#pragma unroll 4
    for (int s = warp; s < n_splits; s += CW) {
        const float f = sf[s];
        const float v = po[(size_t)s * G * HD];  // in bounds; stale for empty splits (f = 0)
        o += f != 0.f ? f * v : 0.f;
    }
    red[warp][lane] = o;
    __syncthreads();
    if (!early) calla_pdl_launch_dependents();
    if (warp == 0) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < CW; ++w) t += red[w][lane];
        out[h * HD + d] = n == 0 ? 0.f : t * s_inv_l * calla_sigmoid(gate);
    }
}
