// Gated full-attention layer core for a block of T prompt tokens (prefill), docs/MODEL.md §3.6
// steps 2-5 (everything between the q|k|v projections and o_proj). Two kernels:
//
// attn_prefill_prep   per token: ZNorm (weight 1 + w) of the 16 query heads and 2 key heads,
//                     rotate-half RoPE on the first ROTARY_DIM dims at position pos0 + t;
//                     queries -> bf16 scratch [T, N_Q_HEADS, HEAD_DIM], keys and values -> bf16
//                     KV cache rows pos0 + t ([max_ctx, N_KV_HEADS, HEAD_DIM]).
// attn_prefill_flash  causal flash attention (FlashAttention-2 style online softmax in fp32) on
//                     tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation) over cache rows
//                     0 .. pos0 + t, then out = attention ⊙ sigmoid(gate), [T, N_Q_HEADS·HEAD_DIM].
//
// GQA packing: a block owns one KV head m and a tile of TOK consecutive tokens; its Q tile has
// BM = 8·TOK rows, token-major with the 8 query heads of m inside (row r = token r/8, head
// m·8 + r%8). Each loaded K/V tile thus serves all 8 heads. A warp owns 16 rows = 2 tokens ×
// 8 heads: in the mma accumulator layout thread (g = lane/4, c = lane%4) holds rows g (token A,
// head g) and g+8 (token B, head g). Key blocks of BN = 64 rows; blocks past the tile's last
// token are never loaded (causal skipping); only blocks crossing a warp's diagonal are masked.
//
// Shared memory rows are HEAD_DIM bf16 = 512 bytes = 32 chunks of 16 bytes; chunk c of row r is
// stored at chunk c ^ (r & 7), so the 8 row addresses of every ldmatrix hit 8 distinct bank
// groups.

#define AP_HD CALLA_HEAD_DIM
#define AP_NQ CALLA_N_Q_HEADS
#define AP_NKV CALLA_N_KV_HEADS
#define AP_GROUP (AP_NQ / AP_NKV)
// q_proj (per head query | gate) | k | v, per token
#define AP_PROJ (AP_NQ * 2 * AP_HD + 2 * AP_NKV * AP_HD)
#define AP_HALF_ROT (CALLA_ROTARY_DIM / 2)
#define AP_BN 64
#define AP_NEG_INF __int_as_float(0xff800000)
#define AP_ROW_BYTES (AP_HD * 2)
#define AP_CHUNKS (AP_ROW_BYTES / 16)

static_assert(AP_HD == 32 * 8, "prep: a lane holds 8 consecutive dims of a head");
static_assert(AP_HALF_ROT == 32, "prep: rotary pairs (i, i + 32) sit in lanes l and l ^ 4");
static_assert(AP_GROUP == 8, "flash: an mma row block is 2 tokens x the 8 heads of a KV head");
static_assert(AP_CHUNKS == 32, "flash: 32 chunks of 16 bytes per smem row");

// ---------------------------------------------------------------------------------------------
// prep

__device__ __forceinline__ unsigned ap_pack_bf16x2(float lo, float hi) {
    return (unsigned)calla_f32_to_bf16(lo) | ((unsigned)calla_f32_to_bf16(hi) << 16);
}

// One warp per (token, head item): items 0..NQ-1 query heads, NQ..NQ+NKV-1 key heads, then
// the NKV value heads. Lane l holds dims 8l .. 8l+7.
extern "C" __global__ void __launch_bounds__(256) attn_prefill_prep(
    unsigned short* __restrict__ q_out,    // [T, NQ, HD] bf16
    unsigned short* __restrict__ k_cache,  // [max_ctx, NKV, HD] bf16
    unsigned short* __restrict__ v_cache,  // [max_ctx, NKV, HD] bf16
    const float* __restrict__ proj,        // [T, AP_PROJ]
    const float* __restrict__ q_norm,      // [HD] zero-centred
    const float* __restrict__ k_norm,      // [HD] zero-centred
    const float* __restrict__ inv_freq,    // [ROTARY_DIM / 2]
    int t_count, int pos0) {
    calla_pdl_wait();
    const int lane = threadIdx.x & 31;
    constexpr int ITEMS = AP_NQ + 2 * AP_NKV;
    const long long n_items = (long long)t_count * ITEMS;
    for (long long it = (long long)blockIdx.x * 8 + (threadIdx.x >> 5); it < n_items;
         it += (long long)gridDim.x * 8) {
        const int t = (int)(it / ITEMS), h = (int)(it % ITEMS);
        const float* row = proj + (size_t)t * AP_PROJ;
        const float* src;
        unsigned short* dst;
        if (h < AP_NQ) {
            src = row + h * 2 * AP_HD;
            dst = q_out + ((size_t)t * AP_NQ + h) * AP_HD;
        } else if (h < AP_NQ + AP_NKV) {
            src = row + AP_NQ * 2 * AP_HD + (h - AP_NQ) * AP_HD;
            dst = k_cache + ((size_t)(pos0 + t) * AP_NKV + (h - AP_NQ)) * AP_HD;
        } else {
            src = row + AP_NQ * 2 * AP_HD + AP_NKV * AP_HD + (h - AP_NQ - AP_NKV) * AP_HD;
            dst = v_cache + ((size_t)(pos0 + t) * AP_NKV + (h - AP_NQ - AP_NKV)) * AP_HD;
        }
        const float4 a = reinterpret_cast<const float4*>(src)[lane * 2];
        const float4 b = reinterpret_cast<const float4*>(src)[lane * 2 + 1];
        float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        if (h < AP_NQ + AP_NKV) {  // warp-uniform
            // ZNorm: x / sqrt(mean(x²) + eps) · (1 + w)
            const float* w = h < AP_NQ ? q_norm : k_norm;
            float ss = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) ss += x[j] * x[j];
            ss = calla_warp_sum(ss);
            const float r = 1.0f / sqrtf(ss / (float)AP_HD + CALLA_RMS_EPS);
            const float4 wa = reinterpret_cast<const float4*>(w)[lane * 2];
            const float4 wb = reinterpret_cast<const float4*>(w)[lane * 2 + 1];
            const float wv[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
            for (int j = 0; j < 8; ++j) x[j] = x[j] * r * (1.0f + wv[j]);
            // rotate-half RoPE on dims 0..63: lanes 0-3 hold i, lanes 4-7 hold i + 32
            float partner[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) partner[j] = __shfl_xor_sync(0xffffffffu, x[j], 4);
            if (lane < 8) {
                const float p = (float)(pos0 + t);
                const int fi = (lane & 3) * 8;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float s, c;
                    sincosf(p * inv_freq[fi + j], &s, &c);
                    x[j] = lane < 4 ? x[j] * c - partner[j] * s : x[j] * c + partner[j] * s;
                }
            }
        }
        uint4 o;
        o.x = ap_pack_bf16x2(x[0], x[1]);
        o.y = ap_pack_bf16x2(x[2], x[3]);
        o.z = ap_pack_bf16x2(x[4], x[5]);
        o.w = ap_pack_bf16x2(x[6], x[7]);
        reinterpret_cast<uint4*>(dst)[lane] = o;
    }
}

// ---------------------------------------------------------------------------------------------
// flash

// Dynamic shared memory of the flash kernels (the wgmma ones round the base up to 1 KiB).
extern __shared__ __align__(1024) unsigned char ap_smem[];

__device__ __forceinline__ unsigned ap_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
// 16-byte async copy; src_bytes = 0 fills the destination with zeros.
__device__ __forceinline__ void ap_cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void ap_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void ap_cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ap_ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ap_ldsm_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// d += a · b, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void ap_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats -> bf16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ unsigned ap_cvt_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// Byte offset of 16-byte chunk c of row r in a swizzled tile.
__device__ __forceinline__ unsigned ap_swz(int r, int c) {
    return (unsigned)(r * AP_ROW_BYTES + ((c ^ (r & 7)) << 4));
}

// Rows kb .. kb + AP_BN - 1 of one KV head of a cache into a swizzled smem tile; rows at or
// past n_keys are zero-filled (never read from the cache: they may hold anything, and a NaN
// times a zero probability would still be NaN).
template <int NT>
__device__ __forceinline__ void ap_load_kv(unsigned s, const unsigned short* __restrict__ cache, int m, int kb,
                                           int n_keys, int tid) {
    static_assert(AP_BN * AP_CHUNKS % NT == 0, "whole chunks per thread");
#pragma unroll
    for (int ii = 0; ii < AP_BN * AP_CHUNKS / NT; ++ii) {
        const int i = tid + ii * NT;
        const int r = i / AP_CHUNKS, c = i % AP_CHUNKS;
        const int key = kb + r;
        const bool ok = key < n_keys;
        const unsigned short* src = cache + ((size_t)(ok ? key : 0) * AP_NKV + m) * AP_HD + c * 8;
        ap_cp_async16(s + ap_swz(r, c), src, ok ? 16 : 0);
    }
}

// WARPS warps, each 16 Q rows: BM = 16·WARPS rows = TOK = 2·WARPS tokens per block.
// Grid: (n_tiles · NKV); block x -> tile n_tiles - 1 - x / NKV (heaviest tiles first), KV head
// x % NKV. Dynamic smem: (BM + 2·BN) · 512 bytes.
template <int WARPS>
__device__ __forceinline__ void ap_flash(float* __restrict__ out, const unsigned short* __restrict__ q,
                                         const unsigned short* __restrict__ k_cache,
                                         const unsigned short* __restrict__ v_cache,
                                         const float* __restrict__ proj, int t_count, int pos0, float scale_log2) {
    constexpr int NT = 32 * WARPS;
    constexpr int BM = 16 * WARPS;
    constexpr int TOK = BM / AP_GROUP;
    const unsigned sq = ap_smem_addr(ap_smem);
    const unsigned sk = sq + BM * AP_ROW_BYTES;
    const unsigned sv = sk + AP_BN * AP_ROW_BYTES;

    calla_pdl_wait();
    const int n_tiles = (t_count + TOK - 1) / TOK;
    const int tile = n_tiles - 1 - (int)(blockIdx.x / AP_NKV);
    const int m = (int)(blockIdx.x % AP_NKV);
    if (tile < 0) return;
    const int t0 = tile * TOK;
    const int t_last = min(t0 + TOK, t_count) - 1;
    const int n_keys = pos0 + t_last + 1;  // keys 0 .. n_keys - 1 are visible to some row
    const int n_blk = (n_keys + AP_BN - 1) / AP_BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // Q tile (rows of tokens past T are zero-filled) and K block 0
#pragma unroll
    for (int ii = 0; ii < BM * AP_CHUNKS / NT; ++ii) {
        const int i = tid + ii * NT;
        const int r = i / AP_CHUNKS, c = i % AP_CHUNKS;
        const int tok = t0 + r / AP_GROUP;
        const bool ok = tok < t_count;
        const unsigned short* src =
            q + ((size_t)(ok ? tok : 0) * AP_NQ + m * AP_GROUP + r % AP_GROUP) * AP_HD + c * 8;
        ap_cp_async16(sq + ap_swz(r, c), src, ok ? 16 : 0);
    }
    ap_load_kv<NT>(sk, k_cache, m, 0, n_keys, tid);
    ap_cp_async_commit();

    // this thread's two rows: token A = t0 + 2·warp, token B = A + 1, both head m·8 + g
    const int g = lane >> 2, cq = lane & 3;
    const int t_a = t0 + 2 * warp, t_b = t_a + 1;
    // last visible key of each row (rows past T: clamp to the last token, never stored)
    const int lim_a = pos0 + min(t_a, t_count - 1), lim_b = pos0 + min(t_b, t_count - 1);

    float o[AP_HD / 8][4];
#pragma unroll
    for (int i = 0; i < AP_HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_a = AP_NEG_INF, m_b = AP_NEG_INF, l_a = 0.f, l_b = 0.f;

    // per-lane ldmatrix row/chunk offsets
    const int q_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, q_chunk = lane >> 4;
    const int k_row = (lane & 7) + (lane >> 4) * 8, k_chunk = (lane >> 3) & 1;
    const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_chunk = lane >> 4;

    for (int j = 0; j < n_blk; ++j) {
        const int kb = j * AP_BN;
        ap_cp_async_wait_all();  // K block j (and Q)
        __syncthreads();         // ... visible to all; every warp is done with V block j - 1
        ap_load_kv<NT>(sv, v_cache, m, kb, n_keys, tid);
        ap_cp_async_commit();

        const bool active = kb <= lim_b;  // warp-uniform: some key of the block is visible
        float s[AP_BN / 8][4];
#pragma unroll
        for (int i = 0; i < AP_BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
        if (active) {
            // S = Q Kᵀ over HEAD_DIM in k16 steps
#pragma unroll
            for (int kk = 0; kk < AP_HD / 16; ++kk) {
                unsigned a[4];
                ap_ldsm_x4(a, sq + ap_swz(q_row, kk * 2 + q_chunk));
#pragma unroll
                for (int np = 0; np < AP_BN / 16; ++np) {
                    unsigned b[4];
                    ap_ldsm_x4(b, sk + ap_swz(np * 16 + k_row, kk * 2 + k_chunk));
                    ap_mma(s[2 * np], a, b[0], b[1]);
                    ap_mma(s[2 * np + 1], a, b[2], b[3]);
                }
            }
            // causal mask on blocks crossing this warp's diagonal
            if (kb + AP_BN - 1 > lim_a) {
#pragma unroll
                for (int nt = 0; nt < AP_BN / 8; ++nt) {
                    const int key = kb + nt * 8 + 2 * cq;
                    if (key > lim_a) s[nt][0] = AP_NEG_INF;
                    if (key + 1 > lim_a) s[nt][1] = AP_NEG_INF;
                    if (key > lim_b) s[nt][2] = AP_NEG_INF;
                    if (key + 1 > lim_b) s[nt][3] = AP_NEG_INF;
                }
            }
            // online softmax in the log2 domain. Block 0 holds key 0, visible to every row, so
            // m_a and m_b are finite from the first block on.
            float mx_a = AP_NEG_INF, mx_b = AP_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < AP_BN / 8; ++nt) {
                mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
                mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
            }
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
            const float mn_a = fmaxf(m_a, mx_a * scale_log2), mn_b = fmaxf(m_b, mx_b * scale_log2);
            const float al_a = exp2f(m_a - mn_a), al_b = exp2f(m_b - mn_b);
            m_a = mn_a;
            m_b = mn_b;
            float rs_a = 0.f, rs_b = 0.f;
#pragma unroll
            for (int nt = 0; nt < AP_BN / 8; ++nt) {
                s[nt][0] = exp2f(fmaf(s[nt][0], scale_log2, -mn_a));
                s[nt][1] = exp2f(fmaf(s[nt][1], scale_log2, -mn_a));
                s[nt][2] = exp2f(fmaf(s[nt][2], scale_log2, -mn_b));
                s[nt][3] = exp2f(fmaf(s[nt][3], scale_log2, -mn_b));
                rs_a += s[nt][0] + s[nt][1];
                rs_b += s[nt][2] + s[nt][3];
            }
            l_a = l_a * al_a + rs_a;
            l_b = l_b * al_b + rs_b;
#pragma unroll
            for (int i = 0; i < AP_HD / 8; ++i) {
                o[i][0] *= al_a;
                o[i][1] *= al_a;
                o[i][2] *= al_b;
                o[i][3] *= al_b;
            }
        }

        ap_cp_async_wait_all();  // V block j
        __syncthreads();         // ... visible to all; every warp is done with K block j
        if (j + 1 < n_blk) {
            ap_load_kv<NT>(sk, k_cache, m, kb + AP_BN, n_keys, tid);
            ap_cp_async_commit();
        }

        if (active) {
            // O += P V: P straight from the S accumulators (the C layout of two n8 tiles is the
            // A layout of one k16 step)
#pragma unroll
            for (int kk = 0; kk < AP_BN / 16; ++kk) {
                unsigned a[4];
                a[0] = ap_cvt_bf16x2(s[2 * kk][0], s[2 * kk][1]);
                a[1] = ap_cvt_bf16x2(s[2 * kk][2], s[2 * kk][3]);
                a[2] = ap_cvt_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                a[3] = ap_cvt_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int dp = 0; dp < AP_HD / 16; ++dp) {
                    unsigned b[4];
                    ap_ldsm_x4_trans(b, sv + ap_swz(kk * 16 + v_row, dp * 2 + v_chunk));
                    ap_mma(o[2 * dp], a, b[0], b[1]);
                    ap_mma(o[2 * dp + 1], a, b[2], b[3]);
                }
            }
        }
    }

    // epilogue: normalise, gate, store (float2 per thread and dim tile)
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
    const int head = m * AP_GROUP + g;
    if (t_a < t_count) {
        const float* gate = proj + (size_t)t_a * AP_PROJ + head * 2 * AP_HD + AP_HD;
        float* dst = out + ((size_t)t_a * AP_NQ + head) * AP_HD;
#pragma unroll
        for (int i = 0; i < AP_HD / 8; ++i) {
            const int d = i * 8 + 2 * cq;
            const float2 gv = *reinterpret_cast<const float2*>(gate + d);
            *reinterpret_cast<float2*>(dst + d) =
                make_float2(o[i][0] * inv_a * calla_sigmoid(gv.x), o[i][1] * inv_a * calla_sigmoid(gv.y));
        }
    }
    if (t_b < t_count) {
        const float* gate = proj + (size_t)t_b * AP_PROJ + head * 2 * AP_HD + AP_HD;
        float* dst = out + ((size_t)t_b * AP_NQ + head) * AP_HD;
#pragma unroll
        for (int i = 0; i < AP_HD / 8; ++i) {
            const int d = i * 8 + 2 * cq;
            const float2 gv = *reinterpret_cast<const float2*>(gate + d);
            *reinterpret_cast<float2*>(dst + d) =
                make_float2(o[i][2] * inv_b * calla_sigmoid(gv.x), o[i][3] * inv_b * calla_sigmoid(gv.y));
        }
    }
}

#define AP_FLASH_ENTRY(NAME, WARPS, MINB)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, MINB)                                         \
        NAME(float* __restrict__ out, const unsigned short* __restrict__ q,                               \
             const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache,       \
             const float* __restrict__ proj, int t_count, int pos0, float scale_log2) {                     \
        ap_flash<WARPS>(out, q, k_cache, v_cache, proj, t_count, pos0, scale_log2);                        \
    }

// 64-row Q tile (8 tokens), 4 warps, 96 KiB smem: two blocks per SM.
AP_FLASH_ENTRY(attn_prefill_flash_q64, 4, 2)
// 128-row Q tile (16 tokens), 8 warps, 128 KiB smem: one block per SM.
AP_FLASH_ENTRY(attn_prefill_flash_q128, 8, 1)

// ---------------------------------------------------------------------------------------------
// flash on warpgroup MMA (wgmma, sm_90a)
//
// Same GQA packing and pipeline as ap_flash (Q tile of 8 heads x tokens, 64-key blocks, one K
// and one V buffer filled by cp.async), but each warpgroup (64 rows) issues wgmma: S = Q·Kᵀ as
// m64n64k16 with Q and K from shared memory, O += P·V as m64n256k16 with P from registers and V
// from shared memory (transposed, MN-major). Operands are read from shared memory once per
// warpgroup instead of once per warp (ldmatrix), which bounds the mma.sync kernel. The
// accumulator layout of a warp's 16 rows is the mma.sync one, so masking and the online
// softmax are unchanged; O is rescaled only when a row's running max moved.
//
// Shared-memory layout: the canonical 128-byte-swizzle layout of wgmma. A tile of R rows x 256
// dims is 4 column blocks of 64 dims; block cb holds R rows of 128 bytes at cb·R·128; 16-byte
// chunk c of row r sits at chunk c ^ (r & 7) (what the hardware's Swizzle<3,4,3> computes from
// the address bits, so every tile starts 1024-byte aligned). Descriptors:
// * K-major (Q, K): start = row 0 of the column block + 32 bytes per k16 step, SBO = 1024 (8-row
//   groups), LBO unused (16).
// * MN-major (V as B of P·V: N = dims, K = keys): start = key row 16·kk, LBO = R·128 (next 64
//   dims), SBO = 1024 (next 8 keys).

// Keeps the compiler from moving reads of an accumulator above wgmma.wait_group.
template <int N>
__device__ __forceinline__ void ap_fence_acc(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}

// S(64 x 64) += A(64 x 16, smem, K-major) · B(64 x 16, smem, K-major)ᵀ for one warpgroup.
__device__ __forceinline__ void ap_wgmma_ss_n64(float (&d)[8][4], unsigned long long da, unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, 1, 1, 1, 0, 0;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db));
}

// O(64 x 256) += A(64 x 16, registers: the mma.sync A fragment of each warp's 16 rows) ·
// B(16 x 256, smem, MN-major) for one warpgroup.
__device__ __forceinline__ void ap_wgmma_rs_n256(float (&d)[32][4], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "{%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// Byte offset of 16-byte chunk c (0..31 over 256 dims) of row r in a 128B-swizzled tile of
// `rows` rows.
__device__ __forceinline__ unsigned ap_swz128(int rows, int r, int c) {
    return (unsigned)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

template <int NT>
__device__ __forceinline__ void ap_load_kv128(unsigned s, const unsigned short* __restrict__ cache, int m, int kb,
                                              int n_keys, int tid) {
    static_assert(AP_BN * AP_CHUNKS % NT == 0, "whole chunks per thread");
#pragma unroll
    for (int ii = 0; ii < AP_BN * AP_CHUNKS / NT; ++ii) {
        const int i = tid + ii * NT;
        const int r = i / AP_CHUNKS, c = i % AP_CHUNKS;
        const int key = kb + r;
        const bool ok = key < n_keys;
        const unsigned short* src = cache + ((size_t)(ok ? key : 0) * AP_NKV + m) * AP_HD + c * 8;
        ap_cp_async16(s + ap_swz128(AP_BN, r, c), src, ok ? 16 : 0);
    }
}

// S = Q·Kᵀ for one warpgroup: q_base = its 64 rows' start in a Q tile of q_rows rows.
// HOIST: both descriptors built once and advanced per k-step by calla_wgmma_desc_at (the same
// descriptors in fewer instructions: the 128-row tile's main loop 844 → 731 SASS instructions);
// off for the 64-row tiles, whose 255 registers then spill (20 bytes).
template <bool HOIST>
__device__ __forceinline__ void ap_wg_qk(float (&s)[AP_BN / 8][4], unsigned q_base, int q_rows, unsigned k_base) {
    const unsigned long long dq = calla_wgmma_desc_sw128(q_base, 16, 1024), dk = calla_wgmma_desc_sw128(k_base, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < AP_HD / 16; ++kk) {
        const unsigned off = (kk & 3) * 32;
        const unsigned qo = (kk >> 2) * q_rows * 128 + off, ko = (kk >> 2) * AP_BN * 128 + off;
        if constexpr (HOIST)
            ap_wgmma_ss_n64(s, calla_wgmma_desc_at(dq, qo), calla_wgmma_desc_at(dk, ko));
        else
            ap_wgmma_ss_n64(s, calla_wgmma_desc_sw128(q_base + qo, 16, 1024), calla_wgmma_desc_sw128(k_base + ko, 16, 1024));
    }
}

// O += P·V for one warpgroup, P as the A fragments of 4 k16 steps.
__device__ __forceinline__ void ap_wg_pv(float (&o)[AP_HD / 8][4], const unsigned (&p)[AP_BN / 16][4], unsigned v_base) {
    const unsigned long long dv = calla_wgmma_desc_sw128(v_base, AP_BN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < AP_BN / 16; ++kk) ap_wgmma_rs_n256(o, p[kk], calla_wgmma_desc_at(dv, kk * 16 * 128));
}

// 2^x on the MUFU (ex2.approx, relative error 2^-22; -inf -> +0).
__device__ __forceinline__ float ap_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The o_proj GEMM's bf16 activations (`ACTS` entry points) instead of the f32 output: the
// same gated values, rounded as qgemm_x_to_bf16 rounds them, in gemm.cu's permuted column
// order (word m = c + 4h + 8s of a 64-column tile holds columns 16c + 8h + s and + 4, the
// first in the low half), so the GEMM reads them without a conversion launch and the f32 rows
// are never written. Row stride AP_NQ · AP_HD / 2 words. Word address of 64-column tile `tile`,
// 8-column block `b8` within it and pair `s`:
__device__ __forceinline__ size_t ap_act_word(int tok, int tile, int b8, int s) {
    return (size_t)tok * (AP_NQ * AP_HD / 2) + tile * 32 + (b8 >> 1) + 4 * (b8 & 1) + 8 * s;
}

// Thread (g, cq) of the mma layout holds columns 2cq, 2cq + 1 of every 8-column block i of its
// head for tokens a (o[i][0..1]) and b (o[i][2..3]); a word pairs columns p and p + 4, i.e. the
// thread's values with those of lane cq ^ 2. The two lanes swap one token's pair each, so lanes
// cq < 2 write token a's two words of the block and lanes cq >= 2 token b's.
__device__ __forceinline__ void ap_store_acts(unsigned* __restrict__ xb, float (&o)[AP_HD / 8][4],
                                              const float* __restrict__ proj, int head, int t_a, int t_b,
                                              int t_count, float inv_a, float inv_b, int cq) {
    const bool lo = cq < 2;
    const int s = 2 * (cq & 1);
    const float* gate_a = proj + (size_t)t_a * AP_PROJ + head * 2 * AP_HD + AP_HD;
    const float* gate_b = proj + (size_t)t_b * AP_PROJ + head * 2 * AP_HD + AP_HD;
#pragma unroll
    for (int i = 0; i < AP_HD / 8; ++i) {
        const int d = i * 8 + 2 * cq;
        const float2 ga = t_a < t_count ? *reinterpret_cast<const float2*>(gate_a + d) : make_float2(0.f, 0.f);
        const float2 gb = t_b < t_count ? *reinterpret_cast<const float2*>(gate_b + d) : make_float2(0.f, 0.f);
        const float a0 = o[i][0] * inv_a * calla_sigmoid(ga.x), a1 = o[i][1] * inv_a * calla_sigmoid(ga.y);
        const float b0 = o[i][2] * inv_b * calla_sigmoid(gb.x), b1 = o[i][3] * inv_b * calla_sigmoid(gb.y);
        const float r0 = __shfl_xor_sync(0xffffffffu, lo ? b0 : a0, 2);
        const float r1 = __shfl_xor_sync(0xffffffffu, lo ? b1 : a1, 2);
        const int tok = lo ? t_a : t_b;
        if (tok < t_count) {
            const size_t w = ap_act_word(tok, head * (AP_HD / 64) + i / 8, i % 8, s);
            xb[w] = lo ? ap_pack_bf16x2(a0, r0) : ap_pack_bf16x2(r0, b0);
            xb[w + 8] = lo ? ap_pack_bf16x2(a1, r1) : ap_pack_bf16x2(r1, b1);
        }
    }
}

// Sum over the 4 lanes of a quad (the threads that hold one accumulator row).
__device__ __forceinline__ float ap_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The non-split epilogue of the wgmma tiles: O / l ⊙ sigmoid(gate) of the thread's rows (head
// `head`, tokens t_a and t_b; l_a, l_b already summed over the quad) as f32 rows of `out`
// [T, NQ·HD] or, ACTS, as the o_proj GEMM's bf16 activations (ap_store_acts).
template <bool ACTS>
__device__ __forceinline__ void ap_flash_store(float* __restrict__ out, float (&o)[AP_HD / 8][4],
                                               const float* __restrict__ proj, int head, int t_a, int t_b,
                                               int t_count, float l_a, float l_b, int cq) {
    const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
    if constexpr (ACTS) {
        ap_store_acts(reinterpret_cast<unsigned*>(out), o, proj, head, t_a, t_b, t_count, inv_a, inv_b, cq);
        return;
    }
    if (t_a < t_count) {
        const float* gate = proj + (size_t)t_a * AP_PROJ + head * 2 * AP_HD + AP_HD;
        float* dst = out + ((size_t)t_a * AP_NQ + head) * AP_HD;
#pragma unroll
        for (int i = 0; i < AP_HD / 8; ++i) {
            const int d = i * 8 + 2 * cq;
            const float2 gv = *reinterpret_cast<const float2*>(gate + d);
            *reinterpret_cast<float2*>(dst + d) =
                make_float2(o[i][0] * inv_a * calla_sigmoid(gv.x), o[i][1] * inv_a * calla_sigmoid(gv.y));
        }
    }
    if (t_b < t_count) {
        const float* gate = proj + (size_t)t_b * AP_PROJ + head * 2 * AP_HD + AP_HD;
        float* dst = out + ((size_t)t_b * AP_NQ + head) * AP_HD;
#pragma unroll
        for (int i = 0; i < AP_HD / 8; ++i) {
            const int d = i * 8 + 2 * cq;
            const float2 gv = *reinterpret_cast<const float2*>(gate + d);
            *reinterpret_cast<float2*>(dst + d) =
                make_float2(o[i][2] * inv_b * calla_sigmoid(gv.x), o[i][3] * inv_b * calla_sigmoid(gv.y));
        }
    }
}

// Block kb / BN's online softmax on a warpgroup tile's scores s (retired, the mma
// accumulator layout: thread (g, cq) holds rows a and b): the causal mask (keys past lim_a /
// lim_b), the rows' new maxima m (log2 units), s ← 2^(s·scale − base) and the sums l updated;
// al_a, al_b are the factors of the old O rows. A warp whose rows see no key of the block keeps
// its max (finite since block 0, which holds key 0; SPLIT: a split may start later and see none
// yet, then the max stays -inf and the exponent base is 0, so p = 0 and the zero O and sum stay
// zero).
template <bool SPLIT>
__device__ __forceinline__ void ap_softmax_block(float (&s)[AP_BN / 8][4], int kb, int lim_a, int lim_b, int cq,
                                                 float scale_log2, float& m_a, float& m_b, float& l_a, float& l_b,
                                                 float& al_a, float& al_b) {
    if (kb + AP_BN - 1 > lim_a) {
#pragma unroll
        for (int nt = 0; nt < AP_BN / 8; ++nt) {
            const int key = kb + nt * 8 + 2 * cq;
            if (key > lim_a) s[nt][0] = AP_NEG_INF;
            if (key + 1 > lim_a) s[nt][1] = AP_NEG_INF;
            if (key > lim_b) s[nt][2] = AP_NEG_INF;
            if (key + 1 > lim_b) s[nt][3] = AP_NEG_INF;
        }
    }
    float mx_a = AP_NEG_INF, mx_b = AP_NEG_INF;
#pragma unroll
    for (int nt = 0; nt < AP_BN / 8; ++nt) {
        mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    const float mn_a = fmaxf(m_a, mx_a * scale_log2), mn_b = fmaxf(m_b, mx_b * scale_log2);
    float base_a = mn_a, base_b = mn_b;
    if constexpr (SPLIT) {
        base_a = mn_a == AP_NEG_INF ? 0.f : mn_a;
        base_b = mn_b == AP_NEG_INF ? 0.f : mn_b;
    }
    al_a = ap_exp2(m_a - base_a);
    al_b = ap_exp2(m_b - base_b);
    m_a = mn_a;
    m_b = mn_b;
    float rs_a = 0.f, rs_b = 0.f;
#pragma unroll
    for (int nt = 0; nt < AP_BN / 8; ++nt) {
        s[nt][0] = ap_exp2(fmaf(s[nt][0], scale_log2, -base_a));
        s[nt][1] = ap_exp2(fmaf(s[nt][1], scale_log2, -base_a));
        s[nt][2] = ap_exp2(fmaf(s[nt][2], scale_log2, -base_b));
        s[nt][3] = ap_exp2(fmaf(s[nt][3], scale_log2, -base_b));
        rs_a += s[nt][0] + s[nt][1];
        rs_b += s[nt][2] + s[nt][3];
    }
    l_a = l_a * al_a + rs_a;
    l_b = l_b * al_b + rs_b;
}

// O's rows scaled by their softmax factors, only when some row's max moved in this warp (rare
// after the first blocks).
__device__ __forceinline__ void ap_rescale_o(float (&o)[AP_HD / 8][4], float al_a, float al_b) {
    if (__any_sync(0xffffffffu, al_a != 1.f || al_b != 1.f)) {
#pragma unroll
        for (int i = 0; i < AP_HD / 8; ++i) {
            o[i][0] *= al_a;
            o[i][1] *= al_a;
            o[i][2] *= al_b;
            o[i][3] *= al_b;
        }
    }
}

// The probabilities as the A fragments of P·V's 4 k16 steps (bf16 pairs).
__device__ __forceinline__ void ap_probs_bf16(const float (&s)[AP_BN / 8][4], unsigned (&p)[AP_BN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < AP_BN / 16; ++kk) {
        p[kk][0] = ap_cvt_bf16x2(s[2 * kk][0], s[2 * kk][1]);
        p[kk][1] = ap_cvt_bf16x2(s[2 * kk][2], s[2 * kk][3]);
        p[kk][2] = ap_cvt_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        p[kk][3] = ap_cvt_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// NWG warpgroups of 64 Q rows each: BM = 64·NWG rows = 8·NWG tokens per block. Grid and
// dynamic smem ((BM + 2·BN) · 512 + 1024 bytes) as ap_flash.
//
// SPLIT (split-KV, for few tiles over a long prefix): the grid is n_tiles · NKV · n_split, block
// x -> split x % n_split of block x / n_split; split sp takes the tile's key blocks
// [sp·per, (sp+1)·per), per = ceil(n_blk / n_split), and writes its unnormalised O, running max
// (log2 units) and sum per row to part_o [n_split, T, NQ, HD] and part_ml [n_split, T, NQ, 2];
// attn_prefill_combine merges them and applies the gate. A split may see no key of a row (or
// no block at all): max -inf, sum 0, O 0.
// ACTS: the epilogue writes o_proj's GEMM activations (ap_store_acts) instead of f32 rows.
template <int NWG, bool SPLIT, bool ACTS = false>
__device__ __forceinline__ void ap_flash_wg(float* __restrict__ out, const unsigned short* __restrict__ q,
                                            const unsigned short* __restrict__ k_cache,
                                            const unsigned short* __restrict__ v_cache,
                                            const float* __restrict__ proj, int t_count, int pos0, float scale_log2,
                                            float* __restrict__ part_o, float* __restrict__ part_ml, int n_split) {
    constexpr int BM = 64 * NWG, NT = 128 * NWG;
    constexpr int TOK = BM / AP_GROUP;
    const unsigned sq = (ap_smem_addr(ap_smem) + 1023u) & ~1023u;  // host adds 1 KiB of slack
    const unsigned sk = sq + BM * AP_ROW_BYTES;
    const unsigned sv = sk + AP_BN * AP_ROW_BYTES;

    calla_pdl_wait();
    const int n_tiles = (t_count + TOK - 1) / TOK;
    unsigned bx = blockIdx.x;
    int sp = 0;
    if constexpr (SPLIT) {
        sp = (int)(bx % (unsigned)n_split);
        bx /= (unsigned)n_split;
    }
    const int tile = n_tiles - 1 - (int)(bx / AP_NKV);
    const int m = (int)(bx % AP_NKV);
    if (tile < 0) return;
    const int t0 = tile * TOK;
    const int t_last = min(t0 + TOK, t_count) - 1;
    const int n_keys = pos0 + t_last + 1;
    const int n_blk = (n_keys + AP_BN - 1) / AP_BN;
    int j_begin = 0, j_end = n_blk;
    if constexpr (SPLIT) {
        const int per = (n_blk + n_split - 1) / n_split;
        j_begin = min(n_blk, sp * per);
        j_end = min(n_blk, j_begin + per);
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;

#pragma unroll
    for (int ii = 0; ii < BM * AP_CHUNKS / NT; ++ii) {
        const int i = tid + ii * NT;
        const int r = i / AP_CHUNKS, c = i % AP_CHUNKS;
        const int tok = t0 + r / AP_GROUP;
        const bool ok = tok < t_count;
        const unsigned short* src =
            q + ((size_t)(ok ? tok : 0) * AP_NQ + m * AP_GROUP + r % AP_GROUP) * AP_HD + c * 8;
        ap_cp_async16(sq + ap_swz128(BM, r, c), src, ok ? 16 : 0);
    }
    ap_load_kv128<NT>(sk, k_cache, m, j_begin * AP_BN, n_keys, tid);
    ap_cp_async_commit();

    const int g = lane >> 2, cq = lane & 3;
    const int t_a = t0 + 2 * warp, t_b = t_a + 1;
    const int lim_a = pos0 + min(t_a, t_count - 1), lim_b = pos0 + min(t_b, t_count - 1);
    // last visible key of the warpgroup's last row: blocks past it are skipped by all 4 warps
    const int lim_wg = pos0 + min(t0 + 8 * wg + 7, t_count - 1);
    const unsigned q_wg = sq + wg * 64 * 128;

    float o[AP_HD / 8][4];
#pragma unroll
    for (int i = 0; i < AP_HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_a = AP_NEG_INF, m_b = AP_NEG_INF, l_a = 0.f, l_b = 0.f;

    for (int j = j_begin; j < j_end; ++j) {
        const int kb = j * AP_BN;
        ap_cp_async_wait_all();  // K block j (and Q)
        calla_fence_proxy_async();
        __syncthreads();  // ... visible to all; every warpgroup is done with V block j - 1
        ap_load_kv128<NT>(sv, v_cache, m, kb, n_keys, tid);
        ap_cp_async_commit();

        const bool active = kb <= lim_wg;  // warpgroup-uniform
        float s[AP_BN / 8][4];
        if (active) {
#pragma unroll
            for (int i = 0; i < AP_BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
            calla_wgmma_fence();
            ap_wg_qk<BM == 128>(s, q_wg, BM, sk);
            calla_wgmma_commit();
            calla_wgmma_wait<0>();
            ap_fence_acc(s);
            float al_a, al_b;
            ap_softmax_block<SPLIT>(s, kb, lim_a, lim_b, cq, scale_log2, m_a, m_b, l_a, l_b, al_a, al_b);
            ap_rescale_o(o, al_a, al_b);
        }

        ap_cp_async_wait_all();  // V block j
        calla_fence_proxy_async();
        __syncthreads();  // ... visible to all; every warpgroup is done with K block j
        if (j + 1 < j_end) {
            ap_load_kv128<NT>(sk, k_cache, m, kb + AP_BN, n_keys, tid);
            ap_cp_async_commit();
        }

        if (active) {
            unsigned p[AP_BN / 16][4];
            ap_probs_bf16(s, p);
            calla_wgmma_fence();
            ap_wg_pv(o, p, sv);
            calla_wgmma_commit();
            calla_wgmma_wait<0>();
            ap_fence_acc(o);
        }
    }

    l_a = ap_quad_sum(l_a);
    l_b = ap_quad_sum(l_b);
    const int head = m * AP_GROUP + g;
    if constexpr (SPLIT) {
        ap_cp_async_wait_all();  // an empty split still has its Q and first K block in flight
        // unnormalised partials; the combine kernel applies 1/l and the gate
        const int tt[2] = {t_a, t_b};
        const float ml[2][2] = {{m_a, l_a}, {m_b, l_b}};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (tt[h] >= t_count) continue;
            const size_t row = ((size_t)sp * t_count + tt[h]) * AP_NQ + head;
            float* dst = part_o + row * AP_HD;
#pragma unroll
            for (int i = 0; i < AP_HD / 8; ++i)
                *reinterpret_cast<float2*>(dst + i * 8 + 2 * cq) = make_float2(o[i][2 * h], o[i][2 * h + 1]);
            if (cq == 0) *reinterpret_cast<float2*>(part_ml + row * 2) = make_float2(ml[h][0], ml[h][1]);
        }
        return;
    }
    ap_flash_store<ACTS>(out, o, proj, head, t_a, t_b, t_count, l_a, l_b, cq);
}

#define AP_FLASH_WG_ENTRY(NAME, NWG, MINB)                                                                 \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB)                                          \
        NAME(float* __restrict__ out, const unsigned short* __restrict__ q,                               \
             const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache,       \
             const float* __restrict__ proj, int t_count, int pos0, float scale_log2) {                     \
        ap_flash_wg<NWG, false>(out, q, k_cache, v_cache, proj, t_count, pos0, scale_log2, nullptr, nullptr, 1); \
    }

// 64-row Q tile (8 tokens), one warpgroup, 97 KiB smem: two blocks per SM, whose softmax and
// wgmma phases overlap.
AP_FLASH_WG_ENTRY(attn_prefill_flash_wg64, 1, 2)
// 128-row Q tile (16 tokens), two warpgroups, 129 KiB smem: one block per SM, half the K/V
// traffic from L2 per FLOP.
AP_FLASH_WG_ENTRY(attn_prefill_flash_wg128, 2, 1)

// The same two, writing the o_proj GEMM's bf16 activations xb [T, NQ·HD/2] words (gemm.cu's
// permuted order, ap_store_acts) instead of f32 rows.
#define AP_FLASH_WG_ACTS_ENTRY(NAME, NWG, MINB)                                                            \
    extern "C" __global__ void __launch_bounds__(128 * NWG, MINB)                                          \
        NAME(unsigned* __restrict__ xb, const unsigned short* __restrict__ q,                             \
             const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache,       \
             const float* __restrict__ proj, int t_count, int pos0, float scale_log2) {                     \
        ap_flash_wg<NWG, false, true>(reinterpret_cast<float*>(xb), q, k_cache, v_cache, proj, t_count, pos0, \
                                      scale_log2, nullptr, nullptr, 1);                                     \
    }
AP_FLASH_WG_ACTS_ENTRY(attn_prefill_flash_wg64_acts, 1, 2)
AP_FLASH_WG_ACTS_ENTRY(attn_prefill_flash_wg128_acts, 2, 1)

// ---- The warp-specialized 128-row tile (Wg128ws, session 53) ----
//
// FlashAttention-3's arrangement (Shah et al. 2024, "FlashAttention-3: Fast and Accurate
// Attention with Asynchrony and Low-precision", §3.1-3.2) on the Wg128 tile's math:
//  * a producer warpgroup (threads 256..383, 24 registers after setmaxnreg) copies Q once and
//    K and V blocks into two stages each and refills a stage once its `empty` mbarrier says
//    both consumer warpgroups are done with it (one arrival per consumer warp): by bulk tensor
//    copies from one thread (LOAD 1, Wg128tma, the default), by cp.async from all 128 (LOAD 0,
//    Wg128ws), or by bulk tensor copies multicast over a cluster of two (LOAD 2, Wg128mc; see
//    ap_flash_ws);
//  * two consumer warpgroups (threads 0..255, 240 registers) of 64 Q rows each, as in Wg128,
//    take turns on the tensor cores (named barriers 1 and 2, "ping-pong"): in its turn a
//    warpgroup issues block j's Q·Kᵀ and block j − 1's P·V, hands the turn over, and runs block
//    j's softmax while the other warpgroup's products run; O is rescaled once block j − 1's P·V
//    has retired.
// The same products in the same order as Wg128 (O ← α_j·O + P_j·V_j per block), so the same
// bits. No block barrier in the loop. 192 KiB of tiles + 1 KiB of alignment slack + the
// mbarriers: one block per SM. Session 53 (H100, 8,192 tokens): 1,030 µs with TMA against
// 1,377 for Wg128 (cp.async producer 1,329, multicast 1,658).
#define AP_WS_STAGES 2
#define AP_WS_KV_BYTES (AP_BN * AP_ROW_BYTES)

__device__ __forceinline__ void ap_bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void ap_bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
// One arrival on m once every cp.async this thread issued before has landed (the pending
// count is not raised: m's expected count includes this thread).
__device__ __forceinline__ void ap_cp_async_arrive(unsigned long long* m) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(ap_smem_addr(m)) : "memory");
}

// A tensor map (CUtensorMap, 128 bytes, opaque) passed by value as a __grid_constant__
// kernel parameter; the bulk tensor copies take its generic address.
struct __align__(64) ApTmap {
    unsigned long long w[16];
};

// Bulk tensor copy (TMA) of one 3-D box at coordinates (c0, c1, c2) of `map` into this block's
// shared memory at `dst`, completing its bytes on mbarrier `bar` (shared addresses).
__device__ __forceinline__ void ap_tma_3d(unsigned dst, const ApTmap& map, unsigned bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
// The same box into the same offset of every block of the cluster in `mask`, completing its
// bytes on the mbarrier at offset `bar` of each.
__device__ __forceinline__ void ap_tma_3d_mc(unsigned dst, const ApTmap& map, unsigned bar, int c0, int c1, int c2,
                                             unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, %4, "
        "%5}], [%2], %6;\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(mask)
        : "memory");
}
// One arrival (release, cluster scope) on the mbarrier at this block's offset of `m` in block
// `rank` of the cluster.
__device__ __forceinline__ void ap_mbar_arrive_remote(unsigned long long* m, unsigned rank) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(calla_mapa_u32(ap_smem_addr(m), rank))
                 : "memory");
}

// What the producer reads: the Q scratch and the caches (LOAD 0), or their tensor maps (LOAD
// 1, 2): Q [T, NQ, HD] as boxes of 64 dims × 8 heads × 16 tokens, K and V [pos0 + T, NKV, HD]
// (rows past pos0 + T read as zeros) as boxes of 64 dims × 1 head × 64 keys, 128-byte swizzle
// (the tiles' layout: ap_swz128).
struct ApWsSrc {
    const unsigned short* q;
    const unsigned short* k_cache;
    const unsigned short* v_cache;
    const ApTmap* qmap;
    const ApTmap* kmap;
    const ApTmap* vmap;
};

// LOAD: 0 = cp.async from every producer thread (each landing one arrival, count 128), 1 = bulk
// tensor copies (TMA) from one producer thread (count 1 + the bytes), 2 = TMA multicast over a
// cluster of two blocks: the blocks hold adjacent tiles of the same KV head (the heavier in rank
// 0; with an odd tile count the last cluster's rank 1 repeats rank 0's tile, writing the same
// values), each copies half of every K and V block's 64-dim column boxes into both, and a stage
// is refilled once the consumer warps of both blocks have released it (16 arrivals, the other
// block's remotely). Both blocks walk the heavier tile's key blocks; the lighter tile's extra
// block is masked whole for its rows.
template <bool ACTS, int LOAD>
__device__ __forceinline__ void ap_flash_ws(float* __restrict__ out, const ApWsSrc src,
                                            const float* __restrict__ proj, int t_count, int pos0, float scale_log2) {
    constexpr int BM = 128, TOK = BM / AP_GROUP;
    constexpr bool TMA = LOAD >= 1, MC = LOAD == 2;
    const unsigned base = ap_smem_addr(ap_smem);
    const unsigned sq = (base + 1023u) & ~1023u;  // host adds 1 KiB of slack
    const unsigned sk = sq + BM * AP_ROW_BYTES;   // stage s at sk + s · AP_WS_KV_BYTES
    const unsigned sv = sk + AP_WS_STAGES * AP_WS_KV_BYTES;
    // k_full[2], v_full[2], k_empty[2], v_empty[2] after the V stages
    unsigned long long* bars =
        reinterpret_cast<unsigned long long*>(ap_smem + (sv + AP_WS_STAGES * AP_WS_KV_BYTES - base));
    unsigned long long* k_full = bars;
    unsigned long long* v_full = bars + 2;
    unsigned long long* k_empty = bars + 4;
    unsigned long long* v_empty = bars + 6;

    calla_pdl_wait();
    const int n_tiles = (t_count + TOK - 1) / TOK;
    int tile, m, n_blk_tile = 0;
    unsigned rank = 0;
    if constexpr (MC) {
        rank = calla_cluster_ctarank();
        const int pair = (int)(blockIdx.x >> 1);
        m = pair % AP_NKV;
        const int heavy = n_tiles - 1 - 2 * (pair / AP_NKV);
        tile = max(heavy - (int)rank, 0);
        // the cluster walks the heavier tile's blocks
        n_blk_tile = (pos0 + min(heavy * TOK + TOK, t_count) + AP_BN - 1) / AP_BN;
    } else {
        tile = n_tiles - 1 - (int)(blockIdx.x / AP_NKV);
        m = (int)(blockIdx.x % AP_NKV);
        if (tile < 0) return;
    }
    const int t0 = tile * TOK;
    const int t_last = min(t0 + TOK, t_count) - 1;
    const int n_keys = pos0 + t_last + 1;
    const int n_blk = MC ? n_blk_tile : (n_keys + AP_BN - 1) / AP_BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        constexpr unsigned FULL = TMA ? 1 : 128, EMPTY = MC ? 16 : 8;
#pragma unroll
        for (int s = 0; s < AP_WS_STAGES; ++s) {
            calla_mbar_init(&k_full[s], FULL);
            calla_mbar_init(&v_full[s], FULL);
            calla_mbar_init(&k_empty[s], EMPTY);
            calla_mbar_init(&v_empty[s], EMPTY);
        }
        // the initialisations visible to the bulk copies' completions (async proxy) and, MC,
        // to the other block (as gemm.cu does for its bulk copies)
        if constexpr (TMA) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // the mbarriers are initialised before anyone arrives or polls (in both blocks)
    if constexpr (MC)
        calla_cluster_sync();
    else
        __syncthreads();

    if (warp >= 8) {
        // ---- producer warpgroup ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if constexpr (TMA) {
            if (warp == 8 && lane == 0) {
                constexpr unsigned Q_BYTES = BM * AP_ROW_BYTES;
                // this block's column boxes of each K and V block: all 4, or 2 of them (MC)
                constexpr int NC = MC ? 2 : 4;
                const int c0 = MC ? 2 * (int)rank : 0;
                for (int j = 0; j < n_blk; ++j) {
                    const int s = j & 1;
                    const unsigned prev = (unsigned)((j >> 1) + 1) & 1u;  // the stage's last use, block j − 2
                    if (j >= AP_WS_STAGES) calla_mbar_wait_parity_cluster(&k_empty[s], prev);
                    calla_mbar_arrive_expect_tx(&k_full[s], AP_WS_KV_BYTES + (j == 0 ? Q_BYTES : 0));
                    if (j == 0) {
#pragma unroll
                        for (int c = 0; c < 4; ++c)
                            ap_tma_3d(sq + c * BM * 128, *src.qmap, ap_smem_addr(&k_full[0]), c * 64, m * AP_GROUP, t0);
                    }
#pragma unroll
                    for (int c = c0; c < c0 + NC; ++c) {
                        const unsigned dst = sk + s * AP_WS_KV_BYTES + c * AP_BN * 128;
                        if constexpr (MC)
                            ap_tma_3d_mc(dst, *src.kmap, ap_smem_addr(&k_full[s]), c * 64, m, j * AP_BN, 3);
                        else
                            ap_tma_3d(dst, *src.kmap, ap_smem_addr(&k_full[s]), c * 64, m, j * AP_BN);
                    }
                    if (j >= AP_WS_STAGES) calla_mbar_wait_parity_cluster(&v_empty[s], prev);
                    calla_mbar_arrive_expect_tx(&v_full[s], AP_WS_KV_BYTES);
#pragma unroll
                    for (int c = c0; c < c0 + NC; ++c) {
                        const unsigned dst = sv + s * AP_WS_KV_BYTES + c * AP_BN * 128;
                        if constexpr (MC)
                            ap_tma_3d_mc(dst, *src.vmap, ap_smem_addr(&v_full[s]), c * 64, m, j * AP_BN, 3);
                        else
                            ap_tma_3d(dst, *src.vmap, ap_smem_addr(&v_full[s]), c * 64, m, j * AP_BN);
                    }
                }
            }
            // (MC: the block stays for the cluster barrier at the end; its partner may still
            // arrive on this block's mbarriers until then)
            __syncwarp();
            if constexpr (MC) calla_cluster_sync();
            return;
        } else {
            const unsigned short* __restrict__ q = src.q;
            const int pt = tid - 256;
            // thread pt copies chunk pt % 32 of rows pt / 32 + 4·ii (as ap_load_kv128 with 128
            // threads), addresses stepped instead of rebuilt: the warpgroup has 24 registers
            const int c = pt & 31, r0 = pt >> 5;
            const unsigned x0 = (unsigned)((c & 7) ^ (r0 & 7)) << 4, x1 = (unsigned)((c & 7) ^ ((r0 + 4) & 7)) << 4;
#pragma unroll 2
            for (int ii = 0; ii < BM / 4; ++ii) {
                const int r = r0 + 4 * ii;
                const int tok = t0 + r / AP_GROUP;
                const bool ok = tok < t_count;
                const unsigned short* qs =
                    q + ((size_t)(ok ? tok : 0) * AP_NQ + m * AP_GROUP + r % AP_GROUP) * AP_HD + c * 8;
                ap_cp_async16(sq + (c >> 3) * BM * 128 + r * 128 + ((ii & 1) ? x1 : x0), qs, ok ? 16 : 0);
            }
            // one 64-key block of K or V into the stage at `dst`
            auto load_kv = [&](unsigned dst, const unsigned short* __restrict__ cache, int kb) {
                const unsigned short* cs = cache + ((size_t)(kb + r0) * AP_NKV + m) * AP_HD + c * 8;
                dst += (c >> 3) * AP_BN * 128 + r0 * 128;
#pragma unroll 2
                for (int ii = 0; ii < AP_BN / 4; ++ii) {
                    const bool ok = kb + r0 + 4 * ii < n_keys;
                    ap_cp_async16(dst + ii * 4 * 128 + ((ii & 1) ? x1 : x0), ok ? cs + (size_t)ii * 4 * AP_NKV * AP_HD : cache,
                                  ok ? 16 : 0);
                }
            };
            for (int j = 0; j < n_blk; ++j) {
                const int s = j & 1;
                const unsigned prev = (unsigned)((j >> 1) + 1) & 1u;  // the stage's last use, block j − 2
                if (j >= AP_WS_STAGES) calla_mbar_wait_parity(&k_empty[s], prev);
                load_kv(sk + s * AP_WS_KV_BYTES, src.k_cache, j * AP_BN);
                ap_cp_async_arrive(&k_full[s]);  // Q too, with block 0
                if (j >= AP_WS_STAGES) calla_mbar_wait_parity(&v_empty[s], prev);
                load_kv(sv + s * AP_WS_KV_BYTES, src.v_cache, j * AP_BN);
                ap_cp_async_arrive(&v_full[s]);
            }
            ap_cp_async_wait_all();
            return;
        }
    }

    // ---- consumer warpgroups ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int wg = warp >> 2;
    const int g = lane >> 2, cq = lane & 3;
    const int t_a = t0 + 2 * warp, t_b = t_a + 1;
    const int lim_a = pos0 + min(t_a, t_count - 1), lim_b = pos0 + min(t_b, t_count - 1);
    // Both warpgroups walk every key block of the tile, with no branch around a product (ptxas
    // serializes wgmma issued in divergent paths, C7518/C7520): where warpgroup 0's rows end a
    // block before the tile's last one (a 64-key boundary among the tile's last 8 tokens: one
    // tile in four where pos0 % 16 is 1..8, never where it is 0), its last block is masked
    // whole, which leaves its max, sum and O as they are (p = 0 everywhere).
    const unsigned q_wg = sq + wg * 64 * 128;

    float o[AP_HD / 8][4];
#pragma unroll
    for (int i = 0; i < AP_HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_a = AP_NEG_INF, m_b = AP_NEG_INF, l_a = 0.f, l_b = 0.f;
    unsigned p[AP_BN / 16][4];  // block j − 1's probabilities, the A fragments of its P·V
    float sc[AP_BN / 8][4];

    // S = Q·K_j of stage j % 2 (issued, one commit group)
    auto issue_qk = [&](int j) {
#pragma unroll
        for (int i = 0; i < AP_BN / 8; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
        calla_mbar_wait_parity(&k_full[j & 1], (unsigned)(j >> 1) & 1u);
        if constexpr (!TMA) calla_fence_proxy_async();  // the cp.async writes, for wgmma
        calla_wgmma_fence();
        ap_wg_qk<true>(sc, q_wg, BM, sk + (j & 1) * AP_WS_KV_BYTES);
        calla_wgmma_commit();
    };
    // O += P_j·V_j of stage j % 2 (issued, one commit group)
    auto issue_pv = [&](int j) {
        calla_mbar_wait_parity(&v_full[j & 1], (unsigned)(j >> 1) & 1u);
        if constexpr (!TMA) calla_fence_proxy_async();
        calla_wgmma_fence();
        ap_wg_pv(o, p, sv + (j & 1) * AP_WS_KV_BYTES);
        calla_wgmma_commit();
    };
    // this warp is done with a stage: one arrival on its `empty` mbarrier (MC: in both blocks)
    auto release = [&](unsigned long long* e) {
        if constexpr (MC) {
            ap_mbar_arrive_remote(e, 0);
            ap_mbar_arrive_remote(e, 1);
        } else {
            calla_mbar_arrive(e);
        }
    };
    // Turns: warpgroup w waits on named barrier 1 + w (its own 128 threads plus the other
    // warpgroup's 128 arrivals) and hands over by arriving on the other one; warpgroup 0 goes
    // first. Every consumer warp arrives once per block on each `empty` mbarrier (count 8).
    if (wg == 1) ap_bar_arrive(1);
    {
        ap_bar_sync(1 + wg);
        issue_qk(0);
        ap_bar_arrive(1 + (wg ^ 1));
        calla_wgmma_wait<0>();
        ap_fence_acc(sc);
        if (lane == 0) release(&k_empty[0]);
        float al_a, al_b;
        ap_softmax_block<false>(sc, 0, lim_a, lim_b, cq, scale_log2, m_a, m_b, l_a, l_b, al_a, al_b);
        ap_probs_bf16(sc, p);  // (O is zero: nothing to rescale)
    }
    for (int j = 1; j < n_blk; ++j) {
        ap_bar_sync(1 + wg);
        issue_qk(j);
        issue_pv(j - 1);
        ap_bar_arrive(1 + (wg ^ 1));
        calla_wgmma_wait<1>();  // Q·Kᵀ (the older group) has retired, P·V may still run
        ap_fence_acc(sc);
        if (lane == 0) release(&k_empty[j & 1]);
        float al_a, al_b;
        ap_softmax_block<false>(sc, j * AP_BN, lim_a, lim_b, cq, scale_log2, m_a, m_b, l_a, l_b, al_a, al_b);
        calla_wgmma_wait<0>();  // block j − 1's P·V has retired: O and p are free
        ap_fence_acc(o);
        if (lane == 0) release(&v_empty[(j - 1) & 1]);
        ap_rescale_o(o, al_a, al_b);
        ap_probs_bf16(sc, p);
    }
    // the last block's P·V, in one more turn
    ap_bar_sync(1 + wg);
    issue_pv(n_blk - 1);
    ap_bar_arrive(1 + (wg ^ 1));
    calla_wgmma_wait<0>();
    ap_fence_acc(o);
    if (wg == 0) ap_bar_sync(1);  // warpgroup 1's last hand-over (leaves barrier 1 balanced)

    l_a = ap_quad_sum(l_a);
    l_b = ap_quad_sum(l_b);
    ap_flash_store<ACTS>(out, o, proj, m * AP_GROUP + g, t_a, t_b, t_count, l_a, l_b, cq);
    __syncwarp();
    if constexpr (MC) calla_cluster_sync();  // the partner's remote arrivals on this block are done
}

// Entry points: 128-row Q tile, a producer and two consumer warpgroups (384 threads; 240 + 24
// registers by setmaxnreg, so 168 at launch), 193 KiB smem: one block per SM. `_tma`: the
// producer's copies as bulk tensor copies from the tensor maps; `_mc`: those multicast over a
// cluster of two blocks.
extern "C" __global__ void __launch_bounds__(384, 1)
    attn_prefill_flash_wg128ws(float* __restrict__ out, const unsigned short* __restrict__ q,
                               const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache,
                               const float* __restrict__ proj, int t_count, int pos0, float scale_log2) {
    ap_flash_ws<false, 0>(out, ApWsSrc{q, k_cache, v_cache, nullptr, nullptr, nullptr}, proj, t_count, pos0, scale_log2);
}
extern "C" __global__ void __launch_bounds__(384, 1)
    attn_prefill_flash_wg128ws_acts(unsigned* __restrict__ xb, const unsigned short* __restrict__ q,
                                    const unsigned short* __restrict__ k_cache,
                                    const unsigned short* __restrict__ v_cache, const float* __restrict__ proj,
                                    int t_count, int pos0, float scale_log2) {
    ap_flash_ws<true, 0>(reinterpret_cast<float*>(xb), ApWsSrc{q, k_cache, v_cache, nullptr, nullptr, nullptr}, proj,
                         t_count, pos0, scale_log2);
}
#define AP_FLASH_TMA_ENTRY(NAME, ACTS, LOAD, ATTRS)                                                        \
    extern "C" __global__ void __launch_bounds__(384, 1) ATTRS                                             \
        NAME(float* __restrict__ out, const float* __restrict__ proj, int t_count, int pos0, float scale_log2, \
             const __grid_constant__ ApTmap qmap, const __grid_constant__ ApTmap kmap,                      \
             const __grid_constant__ ApTmap vmap) {                                                        \
        ap_flash_ws<ACTS, LOAD>(out, ApWsSrc{nullptr, nullptr, nullptr, &qmap, &kmap, &vmap}, proj, t_count, pos0, \
                                scale_log2);                                                               \
    }
AP_FLASH_TMA_ENTRY(attn_prefill_flash_wg128tma, false, 1, )
AP_FLASH_TMA_ENTRY(attn_prefill_flash_wg128tma_acts, true, 1, )
AP_FLASH_TMA_ENTRY(attn_prefill_flash_wg128mc, false, 2, __cluster_dims__(2, 1, 1))
AP_FLASH_TMA_ENTRY(attn_prefill_flash_wg128mc_acts, true, 2, __cluster_dims__(2, 1, 1))

// Split-KV form of attn_prefill_flash_wg64: partials to part_o / part_ml (see ap_flash_wg), no
// output; grid n_tiles · NKV · n_split.
extern "C" __global__ void __launch_bounds__(128, 2)
    attn_prefill_flash_wg64_split(float* __restrict__ part_o, float* __restrict__ part_ml,
                                  const unsigned short* __restrict__ q, const unsigned short* __restrict__ k_cache,
                                  const unsigned short* __restrict__ v_cache, int t_count, int pos0, float scale_log2,
                                  int n_split) {
    ap_flash_wg<1, true>(nullptr, q, k_cache, v_cache, nullptr, t_count, pos0, scale_log2, part_o, part_ml, n_split);
}

// Merges the n_split partials of each (token, head) row: with M = max of the split maxima,
// out = Σ 2^(m_s − M)·O_s / Σ 2^(m_s − M)·l_s ⊙ sigmoid(gate). One warp per row, lane l holds
// dims 8l .. 8l+7. Grid ceil(T·NQ / 8) blocks of 256.
// ACTS: the values as the o_proj GEMM's bf16 activations (xb, as ap_store_acts) instead of f32
// rows: lane l's 8 columns are one 8-column block, 4 words.
template <bool ACTS>
__device__ __forceinline__ void ap_combine(float* __restrict__ out, const float* __restrict__ part_o,
                                           const float* __restrict__ part_ml, const float* __restrict__ proj,
                                           int t_count, int n_split) {
    calla_pdl_wait();
    const int lane = threadIdx.x & 31;
    const size_t rows = (size_t)t_count * AP_NQ;
    const size_t row = (size_t)blockIdx.x * 8 + (threadIdx.x >> 5);  // token · NQ + head
    if (row >= rows) return;
    float mx = AP_NEG_INF;
    for (int sp = 0; sp < n_split; ++sp) mx = fmaxf(mx, part_ml[(sp * rows + row) * 2]);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float l = 0.f;
    for (int sp = 0; sp < n_split; ++sp) {
        const float2 ml = *reinterpret_cast<const float2*>(part_ml + (sp * rows + row) * 2);
        const float w = ap_exp2(ml.x - mx);  // split 0 holds key 0, so mx is finite
        l += w * ml.y;
        const float4* src = reinterpret_cast<const float4*>(part_o + (sp * rows + row) * AP_HD) + lane * 2;
        const float4 a = src[0], b = src[1];
        acc[0] += w * a.x;
        acc[1] += w * a.y;
        acc[2] += w * a.z;
        acc[3] += w * a.w;
        acc[4] += w * b.x;
        acc[5] += w * b.y;
        acc[6] += w * b.z;
        acc[7] += w * b.w;
    }
    const float inv = 1.0f / l;
    const size_t t = row / AP_NQ, head = row % AP_NQ;
    const float4* gp = reinterpret_cast<const float4*>(proj + t * AP_PROJ + head * 2 * AP_HD + AP_HD) + lane * 2;
    const float4 ga = gp[0], gb = gp[1];
    if constexpr (ACTS) {
        const float v[8] = {acc[0] * inv * calla_sigmoid(ga.x), acc[1] * inv * calla_sigmoid(ga.y),
                            acc[2] * inv * calla_sigmoid(ga.z), acc[3] * inv * calla_sigmoid(ga.w),
                            acc[4] * inv * calla_sigmoid(gb.x), acc[5] * inv * calla_sigmoid(gb.y),
                            acc[6] * inv * calla_sigmoid(gb.z), acc[7] * inv * calla_sigmoid(gb.w)};
        unsigned* xb = reinterpret_cast<unsigned*>(out);
#pragma unroll
        for (int sp = 0; sp < 4; ++sp)
            xb[ap_act_word((int)t, (int)head * (AP_HD / 64) + lane / 8, lane % 8, sp)] = ap_pack_bf16x2(v[sp], v[sp + 4]);
        return;
    }
    float4* dst = reinterpret_cast<float4*>(out + row * AP_HD) + lane * 2;
    dst[0] = make_float4(acc[0] * inv * calla_sigmoid(ga.x), acc[1] * inv * calla_sigmoid(ga.y),
                         acc[2] * inv * calla_sigmoid(ga.z), acc[3] * inv * calla_sigmoid(ga.w));
    dst[1] = make_float4(acc[4] * inv * calla_sigmoid(gb.x), acc[5] * inv * calla_sigmoid(gb.y),
                         acc[6] * inv * calla_sigmoid(gb.z), acc[7] * inv * calla_sigmoid(gb.w));
}
extern "C" __global__ void __launch_bounds__(256)
    attn_prefill_combine(float* __restrict__ out, const float* __restrict__ part_o, const float* __restrict__ part_ml,
                         const float* __restrict__ proj, int t_count, int n_split) {
    ap_combine<false>(out, part_o, part_ml, proj, t_count, n_split);
}
// The same into the o_proj GEMM's bf16 activations xb [T, NQ·HD/2] words.
extern "C" __global__ void __launch_bounds__(256)
    attn_prefill_combine_acts(unsigned* __restrict__ xb, const float* __restrict__ part_o,
                              const float* __restrict__ part_ml, const float* __restrict__ proj, int t_count,
                              int n_split) {
    ap_combine<true>(reinterpret_cast<float*>(xb), part_o, part_ml, proj, t_count, n_split);
}

// Self-test probe of the two wgmma forms and their shared-memory layouts, one warpgroup:
// s = q·kᵀ ([64, 64], q and k [64, HD] bf16) and o = p·v ([64, HD], p [64, 64], v [64, HD] bf16),
// f32 out. Launch: 1 block of 128 threads, dynamic smem 3·64·HD·2 + 1024 bytes.
extern "C" __global__ void __launch_bounds__(128)
    attn_prefill_wgmma_probe(float* __restrict__ s_out, float* __restrict__ o_out, const unsigned short* __restrict__ q,
                             const unsigned short* __restrict__ k, const unsigned short* __restrict__ v,
                             const unsigned short* __restrict__ pm) {
    calla_pdl_wait();  // launched through CudaContext::kernel, like every prefill kernel
    const unsigned sq = (ap_smem_addr(ap_smem) + 1023u) & ~1023u;
    const unsigned sk = sq + 64 * AP_ROW_BYTES;
    const unsigned sv = sk + 64 * AP_ROW_BYTES;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int i = tid; i < 64 * AP_CHUNKS; i += 128) {
        const int r = i / AP_CHUNKS, c = i % AP_CHUNKS;
        ap_cp_async16(sq + ap_swz128(64, r, c), q + r * AP_HD + c * 8, 16);
        ap_cp_async16(sk + ap_swz128(64, r, c), k + r * AP_HD + c * 8, 16);
        ap_cp_async16(sv + ap_swz128(64, r, c), v + r * AP_HD + c * 8, 16);
    }
    ap_cp_async_commit();
    ap_cp_async_wait_all();
    calla_fence_proxy_async();
    __syncthreads();
    const int g = lane >> 2, cq = lane & 3, r0 = warp * 16 + g;
    float s[AP_BN / 8][4];
#pragma unroll
    for (int i = 0; i < AP_BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    calla_wgmma_fence();
    ap_wg_qk<false>(s, sq, 64, sk);
    calla_wgmma_commit();
    calla_wgmma_wait<0>();
    ap_fence_acc(s);
#pragma unroll
    for (int nt = 0; nt < AP_BN / 8; ++nt) {
        const int c0 = nt * 8 + 2 * cq;
        s_out[r0 * 64 + c0] = s[nt][0];
        s_out[r0 * 64 + c0 + 1] = s[nt][1];
        s_out[(r0 + 8) * 64 + c0] = s[nt][2];
        s_out[(r0 + 8) * 64 + c0 + 1] = s[nt][3];
    }
    unsigned p[AP_BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < AP_BN / 16; ++kk) {
        const int c0 = kk * 16 + 2 * cq;
        p[kk][0] = (unsigned)pm[r0 * 64 + c0] | ((unsigned)pm[r0 * 64 + c0 + 1] << 16);
        p[kk][1] = (unsigned)pm[(r0 + 8) * 64 + c0] | ((unsigned)pm[(r0 + 8) * 64 + c0 + 1] << 16);
        p[kk][2] = (unsigned)pm[r0 * 64 + c0 + 8] | ((unsigned)pm[r0 * 64 + c0 + 9] << 16);
        p[kk][3] = (unsigned)pm[(r0 + 8) * 64 + c0 + 8] | ((unsigned)pm[(r0 + 8) * 64 + c0 + 9] << 16);
    }
    float o[AP_HD / 8][4];
#pragma unroll
    for (int i = 0; i < AP_HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    calla_wgmma_fence();
    ap_wg_pv(o, p, sv);
    calla_wgmma_commit();
    calla_wgmma_wait<0>();
    ap_fence_acc(o);
#pragma unroll
    for (int i = 0; i < AP_HD / 8; ++i) {
        const int c0 = i * 8 + 2 * cq;
        o_out[r0 * AP_HD + c0] = o[i][0];
        o_out[r0 * AP_HD + c0 + 1] = o[i][1];
        o_out[(r0 + 8) * AP_HD + c0] = o[i][2];
        o_out[(r0 + 8) * AP_HD + c0 + 1] = o[i][3];
    }
}
