// Quantized 16-row x 64-column tiles on the integer tensor cores: the helpers the MoE kernels
// (kernels/moe.cu) and the fused GDN input projection (kernels/gdn.cu) share. Prepended to every
// kernel file after the prelude (crates/cuda/src/lib.rs full_source).
//
// Weights: the MLX codes of a tile (16 rows x one 64-column quantization group), restacked on
// the host so that lane l's 16-byte load(s) are exactly its A fragments
// (crates/cuda/src/moe.rs `pack_tile`), 512 B (4-bit) or 1 KB (8-bit); the {scale | bias << 16}
// bf16 pairs of rows g and g+8 are one 8-byte load. Activations: per group of 64 values, four
// balanced base-256 digits d0..d3 of round(x * 2^(30-E)) (kernels/moe.cu header), the B operand;
// Σ_k w_k x_k = scale * 2^(E-30) ((C0 + 256 C1) + 65536 (C2 + 256 C3)) + bias * Σ x per row.

namespace calla_qt {

// D += A (16x32 u8, row-major) * B (32x8 s8, col-major), int32.
// Fragments (lane = 4g + t): a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..],
// a3 = A[g+8][16+4t..]; b0 = B[4t..4t+3][g], b1 = B[16+4t..][g]; d0,d1 = D[g][2t, 2t+1],
// d2,d3 = D[g+8][2t, 2t+1].
__device__ __forceinline__ void mma_u8s8(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }

// One 16-row x 64-column tile as one lane holds it: its A fragments (BITS/4 uint4) and the
// {scale | bias << 16} words of rows g and g+8.
template <int BITS>
struct Tile {
    uint4 c[BITS / 4];
    uint2 sb;
};

// Words of one tile: 32 * BITS (512 B at 4 bits, 1 KB at 8 bits), as uint4.
template <int BITS>
constexpr int tile_u4() { return 8 * BITS; }

template <int BITS>
__device__ __forceinline__ void tile_load(Tile<BITS>& t, const uint4* __restrict__ tile,
                                          const uint2* __restrict__ sb, int lane) {
#pragma unroll
    for (int c = 0; c < BITS / 4; ++c) t.c[c] = __ldcs(tile + c * 32 + lane);
    t.sb = __ldcs(sb + (lane >> 2));
}

// acc0 (row g) and acc1 (row g+8) += this lane's share of the tile's dot products with the group
// whose digits are bq (this lane's B fragments; zero for lanes >= 16) and meta = {2^(E-30), Σx}.
// tmul = 65536 for odd t (digits 2, 3), 1 for even t; xmask = 1 for t == 0 (adds bias·Σx once).
template <int BITS>
__device__ __forceinline__ void tile_dot(const Tile<BITS>& t, uint4 bq, float2 meta, float tmul, float xmask,
                                         float& acc0, float& acc1) {
    unsigned a[8];
    if constexpr (BITS == 4) {
        const unsigned w[4] = {t.c[0].x, t.c[0].y, t.c[0].z, t.c[0].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            a[2 * j] = w[j] & 0x0F0F0F0Fu;
            a[2 * j + 1] = (w[j] >> 4) & 0x0F0F0F0Fu;
        }
    } else {
        a[0] = t.c[0].x; a[1] = t.c[0].y; a[2] = t.c[0].z; a[3] = t.c[0].w;
        a[4] = t.c[1].x; a[5] = t.c[1].y; a[6] = t.c[1].z; a[7] = t.c[1].w;
    }
    int d[4] = {0, 0, 0, 0};
    mma_u8s8(d, a[0], a[1], a[2], a[3], bq.x, bq.y);
    mma_u8s8(d, a[4], a[5], a[6], a[7], bq.z, bq.w);
    const float v0 = (float)(d[0] + d[1] * 256);
    const float v1 = (float)(d[2] + d[3] * 256);
    const float f = meta.x * tmul;
    const float xs = meta.y * xmask;
    acc0 = fmaf(bf16_lo(t.sb.x) * f, v0, fmaf(bf16_hi(t.sb.x), xs, acc0));
    acc1 = fmaf(bf16_lo(t.sb.y) * f, v1, fmaf(bf16_hi(t.sb.y), xs, acc1));
}

// Sum over the 4 lanes t of a quad (the four digit-pair lanes of one row).
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}

// One warp's dot products of its N tiles with N groups of activation digits, in group order:
// bq holds each group's B fragments (16 uint4, read by lanes 0-15), meta its {2^(E-30), Σx}.
// Returns the sums of rows g (r0) and g+8 (r1) of the tile, reduced over the quad (valid in
// lanes with t == 0).
template <int BITS, int N>
__device__ __forceinline__ void tiles_dot(const Tile<BITS> (&tl)[N], const uint4* bq, const float2* meta, int lane,
                                          float& r0, float& r1) {
    const int t = lane & 3;
    const float tmul = (t & 1) ? 65536.0f : 1.0f, xmask = t == 0 ? 1.0f : 0.0f;
    float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const uint4 b = lane < 16 ? bq[i * 16 + lane] : make_uint4(0u, 0u, 0u, 0u);
        tile_dot<BITS>(tl[i], b, meta[i], tmul, xmask, acc0, acc1);
    }
    r0 = quad_sum(acc0);
    r1 = quad_sum(acc1);
}

// Lanes t == 0 store a tile's two row sums (r0: row g, r1: row g+8) into row16[16].
__device__ __forceinline__ void store_rows(float* row16, float r0, float r1, int lane) {
    if ((lane & 3) == 0) {
        row16[lane >> 2] = r0;
        row16[8 + (lane >> 2)] = r1;
    }
}

// The arithmetic of quantize_group_v: this lane's four words (digit n of its four values: word n)
// and the group's {2^(E-30), Σ x} (in every lane of the half-warp).
__device__ __forceinline__ void quantize_words(float4 v, unsigned (&w)[4], float2& meta) {
    float m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    float s = (v.x + v.y) + (v.z + v.w);
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        s += __shfl_xor_sync(0xffffffffu, s, o);
    }
    // m < 2^e; e >= -90 keeps 2^(30-e) and 2^(e-30) normal (values below 2^-90 round to 0)
    const int e = max((int)((__float_as_uint(m) >> 23) & 0xFFu) - 126, -90);
    const float up = __uint_as_float((unsigned)(157 - e) << 23);  // 2^(30-e)
    // X + 0x80808080 has the bytes d_i + 128 of the balanced digits (|X| <= 2^30); ^0x80 -> d_i
    const unsigned d0 = ((unsigned)__float2int_rn(v.x * up) + 0x80808080u) ^ 0x80808080u;
    const unsigned d1 = ((unsigned)__float2int_rn(v.y * up) + 0x80808080u) ^ 0x80808080u;
    const unsigned d2 = ((unsigned)__float2int_rn(v.z * up) + 0x80808080u) ^ 0x80808080u;
    const unsigned d3 = ((unsigned)__float2int_rn(v.w * up) + 0x80808080u) ^ 0x80808080u;
    // transpose 4 values x 4 digits -> 4 digits x 4 values
    const unsigned lo01 = __byte_perm(d0, d1, 0x5140), hi01 = __byte_perm(d0, d1, 0x7362);
    const unsigned lo23 = __byte_perm(d2, d3, 0x5140), hi23 = __byte_perm(d2, d3, 0x7362);
    w[0] = __byte_perm(lo01, lo23, 0x5410);
    w[1] = __byte_perm(lo01, lo23, 0x7632);
    w[2] = __byte_perm(hi01, hi23, 0x5410);
    w[3] = __byte_perm(hi01, hi23, 0x7632);
    meta = make_float2(__uint_as_float((unsigned)(e + 97) << 23), s);  // 2^(e-30)
}
// Half a warp (16 lanes, q = lane & 15) writes one group of 64 values xg[0..63] as digits (see
// the header): lane q = 8h + 4r + t converts x[32h + 16r + 4t + 0..3]. words: the group's 64
// words; meta: {2^(E-30), Σ x}. Must be called by all 32 lanes (shuffles).
// quantize_group_v takes this lane's four values x[32h + 16r + 4t + 0..3] already loaded (e.g.
// with __ldcg when another block of the same launch wrote them).
__device__ __forceinline__ void quantize_group_v(float4 v, int q, unsigned* words, float2* meta) {
    const int t = q & 3, r = (q >> 2) & 1, h = q >> 3;
    unsigned w[4];
    float2 mt;
    quantize_words(v, w, mt);
    const int base = 4 * t + 2 * h + r;
#pragma unroll
    for (int n = 0; n < 4; ++n) words[16 * n + base] = w[n];
    if (q == 0) *meta = mt;
}
// The same without shared memory: each half-warp quantizes one group (this lane's values v as
// quantize_group_v takes them, q = lane & 15), and lane q = 4n + t of the half receives its B
// fragment (words 16n + 4t .. +3: digit n of values from lanes t, t + 4, t + 8, t + 12) by
// shuffles. Every lane of the warp must call it.
__device__ __forceinline__ void quantize_group_frag(float4 v, int lane, uint4& frag, float2& meta) {
    unsigned w[4];
    quantize_words(v, w, meta);
    const int t = lane & 3, n = (lane & 15) >> 2, half = lane & 16;
    unsigned c[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
            const unsigned val = __shfl_sync(0xffffffffu, w[nn], half + 4 * x + t);
            if (nn == n) c[x] = val;
        }
    }
    frag = make_uint4(c[0], c[1], c[2], c[3]);
}
__device__ __forceinline__ void quantize_group(const float* __restrict__ xg, int q, unsigned* words, float2* meta) {
    const int t = q & 3, r = (q >> 2) & 1, h = q >> 3;
    quantize_group_v(*reinterpret_cast<const float4*>(xg + 32 * h + 16 * r + 4 * t), q, words, meta);
}

// A tile from shared memory: codes (tile_u4 uint4), pairs (8 uint2), as tile_load lays it out.
template <int BITS>
__device__ __forceinline__ void tile_from_smem(Tile<BITS>& t, const uint4* codes, const uint2* sb, int lane) {
#pragma unroll
    for (int c = 0; c < BITS / 4; ++c) t.c[c] = codes[c * 32 + lane];
    t.sb = sb[lane >> 2];
}

// A row of an MLX-quantized [rows, k] matrix (the MoE router, kernels/gemv.cu RouterFold; the
// GDN output projection's router part, kernels/gdn.cu): row r's codes of the 16 columns
// 16·tile.. (BITS/4 words: w.x, w.y at 4 bits, all four at 8) and their group's {scale | bias}
// word. packed: [rows][k·BITS/8] bytes; sb: [rows][k/64] words.
template <int BITS>
__device__ __forceinline__ void rf_load_row(const unsigned char* packed, const unsigned* sb, int r, int tile, int k,
                                            uint4& w, unsigned& sbw) {
    const unsigned char* p = packed + (size_t)r * (k * BITS / 8) + tile * 2 * BITS;
    if (BITS == 8) {
        w = __ldg(reinterpret_cast<const uint4*>(p));
    } else {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w = make_uint4(v.x, v.y, 0u, 0u);
    }
    sbw = __ldg(sb + (size_t)r * (k / CALLA_QUANT_GROUP) + tile * 16 / CALLA_QUANT_GROUP);
}

// Σ_c W[r, c] y_c over the 16 columns whose codes are w, y_c = h[c] · nw1[c] (nw1 = 1 + nw).
template <int BITS>
__device__ __forceinline__ float rf_part(uint4 w, unsigned sbw, const float* h, const float* nw1) {
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr int EPW = 32 / BITS;
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
    float qy = 0.f, ys = 0.f;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
        const float y = h[c] * nw1[c];
        const unsigned code = (words[c / EPW] >> ((c % EPW) * BITS)) & MASK;
        qy = fmaf((float)code, y, qy);
        ys += y;
    }
    return fmaf(__uint_as_float(sbw << 16), qy, __uint_as_float(sbw & 0xFFFF0000u) * ys);
}

}  // namespace calla_qt
