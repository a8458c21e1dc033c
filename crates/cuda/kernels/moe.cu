// Sparse MoE block, decode step (batch 1): MODEL.md §3.7. CPU definition: crates/model/src/lib.rs
// (`Model::moe`, `top_k_renorm`, `expert_forward`).
//
//   p      = softmax(router · u)                       (fp32, over all N_EXPERTS logits)
//   S      = top-k of p (descending; ties: lower expert id first), w_k = p_k / Σ_S p
//   y_e    = down_e(silu(gate_e · u) * (up_e · u))
//   out    = resid + Σ_k w_k y_{S_k} + sigmoid(shared_gate · u) · y_shared
//
// Three kernels, fixed grids, everything on the device (graph-capturable):
//
//  1. moe_router_r{RB}_g{GB}: router rows (then the shared-expert gate row, one more block) on
//     the CUDA cores, each lane one 16-byte chunk of a row (a row spans D*BITS/128/32 warps of
//     a block); weights are loaded before calla_pdl_wait(). Warps 0..DG/2-1 of the grid also
//     write u as integer digits for the tensor cores (below) to `uq`/`umeta`. With
//     F_TOPK_IN_ROUTER (the default), the last block to finish (atomic counter, reset by it) runs
//     softmax + top-k + renormalisation in one warp and writes sel_ids[TOP_K], sel_w[TOP_K + 1]
//     (routing weights, then the shared gate's sigmoid). Given norm weights, every block first
//     replaces u by rms_norm(u) in shared memory (the layer's post_attention_layernorm, fused:
//     no separate norm launch; then `u` is the residual stream h itself).
//  2. moe_gate_up_e{EB}_s{SB}: one block per (slot, 16-row tile): slots 0..TOP_K-1 are the
//     chosen experts (ids read from device memory), slot TOP_K the shared expert. A tile holds 8
//     gate rows and the 8 up rows of the same outputs, so SwiGLU happens in the block: act[slot]
//     = silu(gate·u) * (up·u). 4 warps split K; the shared expert's weights are loaded before
//     calla_pdl_wait(). Without F_TOPK_IN_ROUTER every routed block does the top-k itself from
//     the logits (block 0 stores sel_ids/sel_w). With F_PREFETCH_DOWN each block also asks for
//     its expert's down tiles of kernel 3 to be prefetched into L2 (measured slower: off).
//  3. moe_down_e{EB}_s{SB}: one block per 16 output rows, two warps per slot (K halves), then
//     out[r] = resid[r] + Σ_k w_k y_k[r] + w_shared y_shared[r] from shared memory (no
//     atomics). With F_TOPK_IN_ROUTER the routed experts' ids (written by kernel 1) are read and
//     their weights loaded BEFORE calla_pdl_wait(): kernel 2 triggers its dependents only after
//     its own wait, i.e. after kernel 1 has completed, so kernel 1's writes are visible whenever
//     kernel 3 runs. (Otherwise kernel 2 wrote the ids: read after the wait.) Given hist_row
//     (expert-load telemetry), block 0 adds one to hist_row[id] for each chosen id.
//
// Kernels 2 and 3 also exist as one launch of a thread-block cluster per expert (section 5,
// moe_cluster_*: 4-bit experts; with the router folded into the output projection the decode
// step's default), and kernels 1-3 as one launch with grid barriers (section 4, measured slower).
//
// Expert products on the integer tensor cores (mma.m16n8k32 u8 x s8 -> s32), exact:
//   * weights: the MLX codes q (0..15 or 0..255) are the u8 A operand as they are (4-bit codes are
//     split into bytes with one LOP3 per 4 codes). The host restacks each expert into tiles of
//     16 rows x 64 columns (one quantization group), 512 B (4-bit) or 1 KB (8-bit), laid out so
//     that lane l's 16-byte load(s) are exactly its A fragments (see crates/cuda/src/moe.rs
//     `pack_tile`); scale and bias of rows g and g+8 of the tile are one 8-byte load.
//   * activations: per group of 64 values x with m = max|x| < 2^E, X = round(x · 2^(30-E)) is
//     written as four balanced base-256 digits d0..d3 (s8): x = 2^(E-30) Σ_i 256^i d_i up to
//     2^(E-31) <= m·2^-30 (fp32 itself keeps 2^-24 of each value). The digits are the B operand
//     (column n = digit n, columns 4..7 zero), so C[row][n] = Σ_k q·d_n exactly in int32 and
//       Σ_k q_k x_k = 2^(E-30) ((C0 + 256 C1) + 65536 (C2 + 256 C3)),
//       Σ_k w_k x_k = scale · Σ q x + bias · Σ x      (per row and group, in fp32).
//     Fragment layout of one group (64 words): word 16n + 4t + 2h + r holds digit n of the four
//     values x[32h + 16r + 4t + 0..3] (byte b <-> value b), so lane l = 4n + t reads its B
//     fragments of both k-halves h as one uint4 at word 4l.
//
// Dims come from the generated header (CALLA_* macros) prepended by the host.

#ifndef CALLA_QUANT_GROUP
#error "dims header missing"
#endif

namespace calla_moe {

using namespace calla_qt;  // the quantized-tile helpers (kernels/qtile.cuh)

constexpr int D = CALLA_D_MODEL;
constexpr int NE = CALLA_N_EXPERTS;
constexpr int TOPK = CALLA_TOP_K;
constexpr int DE = CALLA_D_EXPERT;
constexpr int GROUP = CALLA_QUANT_GROUP;
constexpr int NSLOT = TOPK + 1;  // routed slots, then the shared expert
constexpr int DG = D / GROUP;    // quantization groups along D_MODEL
constexpr int EG = DE / GROUP;   // quantization groups along D_EXPERT

static_assert(GROUP == 64, "a tile is 16 rows x one 64-column group = two k32 mmas");
static_assert(CALLA_D_SHARED_EXPERT == CALLA_D_EXPERT, "the shared expert is one more slot of the same shape");
static_assert(NE % 32 == 0 && TOPK <= 32, "top-k: N_EXPERTS / 32 logits per lane");
static_assert(DE % 8 == 0 && D % 16 == 0 && DE % GROUP == 0 && D % GROUP == 0, "tiles");

// router kernel
constexpr int R_WARPS = 8;  // warps per block; a router row spans D*BITS/128/32 of them
static_assert(DG % 2 == 0 && DG / 2 <= NE, "router warps (at least NE) that write u's digits, two groups each");
// gate/up kernel
constexpr int GU_RT = 2 * DE / 16;  // 16-row tiles per expert: 8 gate rows + the 8 up rows of the same outputs
constexpr int GU_KS = 4;            // warps per block, splitting K
constexpr int GU_GPW = DG / GU_KS;  // groups per warp
static_assert(DG % GU_KS == 0, "K split");
// down kernel
constexpr int DN_RT = D / 16;        // 16-row tiles of the output
constexpr int DN_KS = 2;             // warps per slot, splitting K
constexpr int DN_GPW = EG / DN_KS;   // groups per warp
static_assert(DN_RT == 2 * GU_RT, "each gate/up block prefetches two down row tiles");
static_assert(EG % DN_KS == 0 && DN_GPW % 2 == 0, "K split (quantize_group: two groups per warp pass)");

// ---------------------------------------------------------------------------------------------
// helpers (the tile products and digits: kernels/qtile.cuh)

// Runtime options of a step (kernel argument `flags`, the same for the three launches):
constexpr int F_TOPK_IN_ROUTER = 1;  // the router's last block does the top-k (else every gate/up block does)
constexpr int F_PREFETCH_DOWN = 2;   // gate/up blocks prefetch the down kernel's tiles into L2

// Exactly the CPU's sigmoid / silu (crates/model/src/reference.rs): 1 / (1 + exp(-x)).
__device__ __forceinline__ float sigmoid_ref(float x) { return 1.0f / (1.0f + expf(-x)); }

// act of output i of a gate/up tile from its K-split warps' row sums red[w][16] (gate rows
// 0-7, up rows 8-15), summed in warp order: silu(gate) * up.
__device__ __forceinline__ float swiglu_row(const float (*red)[16], int i) {
    float g = 0.f, up = 0.f;
#pragma unroll
    for (int w = 0; w < GU_KS; ++w) {
        g += red[w][i];
        up += red[w][8 + i];
    }
    return g * sigmoid_ref(g) * up;
}


// ---------------------------------------------------------------------------------------------
// 1. router

// Router rows in MLX layout (packed [D*BITS/32] u32, element 0 in the low bits): each lane of a
// warp takes one 16-byte chunk, so a row spans WPR warps of one block.
template <int BITS>
struct RouterShape {
    static constexpr int CH = D * BITS / 128;  // 16-byte chunks per row
    static constexpr int WPR = CH / 32;        // warps per row
    static constexpr int RPB = R_WARPS / WPR;  // rows per block
    static constexpr int EPC = 128 / BITS;     // values per chunk
    static_assert(CH % 32 == 0 && R_WARPS % WPR == 0 && NE % RPB == 0, "router split");
};

// This lane's share of W[row] . x: chunk c of the row (values c*EPC ..), in fp32.
template <int BITS>
__device__ __forceinline__ float router_part(uint4 w, unsigned sbw, const float* __restrict__ x, int c) {
    constexpr int EPC = 128 / BITS, EPW = 32 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    const float4* xv = reinterpret_cast<const float4*>(x + c * EPC);
    float4 xx[EPC / 4];
#pragma unroll
    for (int v = 0; v < EPC / 4; ++v) xx[v] = xv[v];  // all loads first
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
    float qx0 = 0.f, qx1 = 0.f, xs0 = 0.f, xs1 = 0.f;
#pragma unroll
    for (int v = 0; v < EPC / 4; ++v) {
        const float e4[4] = {xx[v].x, xx[v].y, xx[v].z, xx[v].w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int j = 4 * v + u;
            const unsigned code = (words[j / EPW] >> ((j % EPW) * BITS)) & MASK;
            const float f = __uint_as_float(0x4B000000u | code) - 8388608.0f;  // exact
            if (u & 1) {
                qx1 = fmaf(f, e4[u], qx1);
                xs1 += e4[u];
            } else {
                qx0 = fmaf(f, e4[u], qx0);
                xs0 += e4[u];
            }
        }
    }
    return fmaf(bf16_lo(sbw), qx0 + qx1, bf16_hi(sbw) * (xs0 + xs1));
}

// Softmax over the NE logits, top-k (ties: lower id first), renormalise; one warp.
// Matches crates/model: softmax_inplace (max, exp, sum, multiply by 1/sum) and top_k_renorm
// (descending p, sum of the k in that order, p / sum).
__device__ __forceinline__ void router_topk(const float* __restrict__ logits, int* sel_ids, float* sel_w, int lane) {
    const float gate_logit = logits[NE];
    int ids[TOPK];
    float ps[TOPK];
    calla_router_topk(logits, lane, ids, ps);
    if (lane == 0) {
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < TOPK; ++k) sum += ps[k];
#pragma unroll
        for (int k = 0; k < TOPK; ++k) {
            sel_ids[k] = ids[k];
            sel_w[k] = ps[k] / sum;
        }
        sel_w[TOPK] = sigmoid_ref(gate_logit);
    }
}

// post_attention_layernorm fused in front: kernels/rms_norm.cu's arithmetic in its order (equal
// bit for bit); every block normalizes its own copy of u (D values, from global memory through
// L2: written by the previous kernel) into s_u. Threads 0 .. D/8-1 take 8 values each (nw0, nw1:
// their norm weights); every thread of the block must call it (two barriers); s_part holds
// D/256 floats and is free again afterwards.
__device__ __forceinline__ void norm_to_smem(const float* __restrict__ u, float4 nw0, float4 nw1, float eps,
                                             float* s_part, float* s_u) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool live = threadIdx.x < D / 8;  // warp-uniform
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
    if (live) {
        a = __ldcg(reinterpret_cast<const float4*>(u) + 2 * threadIdx.x);
        b = __ldcg(reinterpret_cast<const float4*>(u) + 2 * threadIdx.x + 1);
        float ss = a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) s_part[warp] = ss;
    }
    __syncthreads();
    if (live) {
        float tot = 0.f;
#pragma unroll
        for (int i = 0; i < D / 256; ++i) tot += s_part[i];
        const float inv = rsqrtf(tot / float(D) + eps);
        float4* su = reinterpret_cast<float4*>(s_u) + 2 * threadIdx.x;
        su[0] = make_float4(a.x * inv * (1.f + nw0.x), a.y * inv * (1.f + nw0.y), a.z * inv * (1.f + nw0.z), a.w * inv * (1.f + nw0.w));
        su[1] = make_float4(b.x * inv * (1.f + nw1.x), b.y * inv * (1.f + nw1.y), b.z * inv * (1.f + nw1.z), b.w * inv * (1.f + nw1.w));
    }
    __syncthreads();  // s_u complete; s_part free again
}

// Blocks 0 .. NE/RPB-1: RPB router rows each; the last block: the shared-expert gate row.
template <int RB, int GB>
__device__ __forceinline__ void router_body(const uint4* __restrict__ r_packed, const unsigned* __restrict__ r_sb,
                                            const uint4* __restrict__ g_packed, const unsigned* __restrict__ g_sb,
                                            const float* __restrict__ u, float* __restrict__ logits,
                                            unsigned* __restrict__ uq, float2* __restrict__ umeta,
                                            int* __restrict__ sel_ids, float* __restrict__ sel_w,
                                            unsigned* __restrict__ counter, int flags,
                                            const float* __restrict__ norm_w, float eps,
                                            const CallaL2Prefetch& pf) {
    calla_l2_prefetch_share(pf);  // e.g. the next layer's input projection and GDN state
    using R = RouterShape<RB>;
    using G = RouterShape<GB>;
    static_assert(R_WARPS * 32 * 8 == D, "the fused norm: one thread per 8 values of u");
    __shared__ float s_part[R_WARPS];
    __shared__ unsigned s_last;
    __shared__ __align__(16) float s_u[D];  // u = rms_norm(u, norm_w) when norm_w is given
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool gate_block = blockIdx.x == NE / R::RPB;
    // this lane's chunk: row, chunk index c
    int row, c;
    bool active;
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    unsigned sbw = 0u;
    if (!gate_block) {
        row = blockIdx.x * R::RPB + warp / R::WPR;
        c = (warp % R::WPR) * 32 + lane;
        active = true;
        w = __ldg(r_packed + (size_t)row * R::CH + c);
        sbw = __ldg(r_sb + (size_t)row * DG + c * R::EPC / GROUP);
    } else {
        row = NE;
        c = warp * 32 + lane;
        active = warp < G::WPR;
        if (active) {
            w = __ldg(g_packed + c);
            sbw = __ldg(g_sb + c * G::EPC / GROUP);
        }
    }
    float4 nw0 = make_float4(0.f, 0.f, 0.f, 0.f), nw1 = nw0;
    if (norm_w != nullptr) {  // constant: before the wait
        nw0 = __ldg(reinterpret_cast<const float4*>(norm_w) + 2 * threadIdx.x);
        nw1 = __ldg(reinterpret_cast<const float4*>(norm_w) + 2 * threadIdx.x + 1);
    }
    calla_pdl_wait();  // u comes from the previous kernel
    if (norm_w != nullptr) {
        norm_to_smem(u, nw0, nw1, eps, s_part, s_u);
        u = s_u;
    }
    float v = 0.f;
    if (active) v = gate_block ? router_part<GB>(w, sbw, u, c) : router_part<RB>(w, sbw, u, c);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s_part[warp] = v;
    // u's digits for the gate/up kernel: warps 0 .. DG/2-1 of the grid, two groups each
    const int gw = blockIdx.x * R_WARPS + warp;
    if (gw < DG / 2) {
        const int gi = 2 * gw + (lane >> 4);
        quantize_group(u + gi * GROUP, lane & 15, uq + gi * 64, umeta + gi);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (!gate_block) {
#pragma unroll
            for (int r = 0; r < R::RPB; ++r) {
                float sum = 0.f;
#pragma unroll
                for (int k = 0; k < R::WPR; ++k) sum += s_part[r * R::WPR + k];
                logits[blockIdx.x * R::RPB + r] = sum;
            }
        } else {
            float sum = 0.f;
#pragma unroll
            for (int k = 0; k < G::WPR; ++k) sum += s_part[k];
            logits[NE] = sum;
        }
    }
    calla_pdl_launch_dependents();
    if (!(flags & F_TOPK_IN_ROUTER)) return;
    // The last block to finish does the top-k. Thread 0 wrote this block's logits: release them
    // with the counter increment (threadFenceReduction pattern).
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(counter, 1u) == gridDim.x - 1 ? 1u : 0u;
    }
    __syncthreads();
    if (s_last == 0u || warp != 0) return;
    __threadfence();
    router_topk(logits, sel_ids, sel_w, lane);
    if (lane == 0) *counter = 0u;  // for the next launch (kernel boundaries order it)
    // (Prefetching the chosen experts' ~14 MB into L2 from here was measured: one SM's bulk
    // prefetches move only ~0.25 TB/s, so this block ran ~60 us. Off.)
}

// ---------------------------------------------------------------------------------------------
// 2. gate/up + SwiGLU

// Where the down kernel's weights of an expert live, to prefetch them into L2: tiles
// [experts][DN_RT][EG] of `tile_bytes`, scale/bias [experts][DN_RT][EG][64 B].
struct DownRef {
    const char* codes;
    const char* sb;
    unsigned tile_bytes;
};

// Prefetch the down tiles of output row tiles 2*rt, 2*rt+1 (this block's share: DN_RT = 2*GU_RT).
__device__ __forceinline__ void prefetch_down(const DownRef& dn, int e, int rt) {
    const size_t t0 = ((size_t)e * DN_RT + 2 * rt) * EG;
    calla_prefetch_l2(dn.codes + t0 * dn.tile_bytes, 2 * EG * dn.tile_bytes);
    calla_prefetch_l2(dn.sb + t0 * 64, 2 * EG * 64);
}

// One warp's tiles of gate/up row tile rt of expert e over its K range (groups g0 ..
// g0 + GU_GPW - 1). codes: [experts][GU_RT][DG] tiles; sb: [experts][GU_RT][DG][8] uint2.
template <int BITS>
__device__ __forceinline__ void gate_up_tiles_load(Tile<BITS> (&tl)[GU_GPW], const uint4* __restrict__ codes,
                                                   const uint2* __restrict__ sb, int e, int rt, int g0, int lane) {
    const size_t t0 = ((size_t)e * GU_RT + rt) * DG + g0;
#pragma unroll
    for (int i = 0; i < GU_GPW; ++i) tile_load<BITS>(tl[i], codes + (t0 + i) * tile_u4<BITS>(), sb + (t0 + i) * 8, lane);
}

// The end of a gate/up block: each warp's dot products of its tiles with its K range's digits
// (s_bq/s_meta, written before), summed over the warps: act[slot] rows 8rt.. = silu(gate) * up.
// Every thread of the block calls it (one barrier).
template <int BITS>
__device__ __forceinline__ void gate_up_finish(const Tile<BITS> (&tl)[GU_GPW], uint4 (*s_bq)[GU_GPW][16],
                                               float2 (*s_meta)[GU_GPW], float (*s_red)[16],
                                               float* __restrict__ act, int slot, int rt) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float r0, r1;  // gate row 8rt + g, up row 8rt + g
    tiles_dot<BITS>(tl, &s_bq[warp][0][0], s_meta[warp], lane, r0, r1);
    store_rows(s_red[warp], r0, r1, lane);
    __syncthreads();
    if (threadIdx.x < 8) act[slot * DE + rt * 8 + threadIdx.x] = swiglu_row(s_red, threadIdx.x);
}

template <int BITS>
__device__ __forceinline__ void gate_up_block(const uint4* __restrict__ codes, const uint2* __restrict__ sb,
                                              const DownRef& dn, int* __restrict__ sel_ids,
                                              float* __restrict__ sel_w, const float* __restrict__ logits,
                                              int slot, bool routed, int rt, const unsigned* __restrict__ uq,
                                              const float2* __restrict__ umeta, float* __restrict__ act, int flags,
                                              uint4 (*s_bq)[GU_GPW][16], float2 (*s_meta)[GU_GPW],
                                              float (*s_red)[16], int* s_ids, float* s_w) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g0 = warp * GU_GPW;  // first group of this warp's K range
    Tile<BITS> tl[GU_GPW];
    auto load = [&](int e) { gate_up_tiles_load<BITS>(tl, codes, sb, e, rt, g0, lane); };
    if (!routed) {  // the shared expert: before the wait
        load(0);
        if ((flags & F_PREFETCH_DOWN) && threadIdx.x == 0) prefetch_down(dn, 0, rt);
    }
    calla_pdl_wait();
    if (routed) {
        int e;
        if (flags & F_TOPK_IN_ROUTER) {
            e = sel_ids[slot];
        } else {
            // softmax + top-k here, from the router's logits (one warp; the block waits for it)
            if (warp == 0) router_topk(logits, s_ids, s_w, lane);
            __syncthreads();
            e = s_ids[slot];
            if (blockIdx.x == 0 && threadIdx.x < NSLOT) {  // for the down kernel and telemetry
                if (threadIdx.x < TOPK) sel_ids[threadIdx.x] = s_ids[threadIdx.x];
                sel_w[threadIdx.x] = s_w[threadIdx.x];
            }
        }
        load(e);
        if ((flags & F_PREFETCH_DOWN) && threadIdx.x == 0) prefetch_down(dn, e, rt);
    }
    calla_pdl_launch_dependents();  // after the wait: moe_down relies on it (see the header)

    // this warp's B fragments (u's digits, written by the router kernel) into shared memory
    const uint4* uq4 = reinterpret_cast<const uint4*>(uq) + g0 * 16;
#pragma unroll
    for (int i = lane; i < GU_GPW * 16; i += 32) s_bq[warp][i / 16][i % 16] = uq4[i];
    if (lane < GU_GPW) s_meta[warp][lane] = umeta[g0 + lane];
    __syncwarp();

    gate_up_finish<BITS>(tl, s_bq, s_meta, s_red, act, slot, rt);
}

template <int EB, int SB>
__device__ __forceinline__ void gate_up_body(const uint4* __restrict__ codes_e, const uint2* __restrict__ sb_e,
                                             const uint4* __restrict__ codes_s, const uint2* __restrict__ sb_s,
                                             DownRef dn_e, DownRef dn_s, int* __restrict__ sel_ids,
                                             float* __restrict__ sel_w, const float* __restrict__ logits,
                                             const unsigned* __restrict__ uq, const float2* __restrict__ umeta,
                                             float* __restrict__ act, int flags) {
    __shared__ uint4 s_bq[GU_KS][GU_GPW][16];
    __shared__ float2 s_meta[GU_KS][GU_GPW];
    __shared__ float s_red[GU_KS][16];
    __shared__ int s_ids[TOPK];
    __shared__ float s_w[NSLOT];
    const int slot = blockIdx.x / GU_RT, rt = blockIdx.x % GU_RT;
    if (slot == TOPK)
        gate_up_block<SB>(codes_s, sb_s, dn_s, sel_ids, sel_w, logits, slot, false, rt, uq, umeta, act, flags, s_bq,
                          s_meta, s_red, s_ids, s_w);
    else
        gate_up_block<EB>(codes_e, sb_e, dn_e, sel_ids, sel_w, logits, slot, true, rt, uq, umeta, act, flags, s_bq,
                          s_meta, s_red, s_ids, s_w);
}

// 2'. gate/up with the router folded into the output projection (kernels/gemv.cu RouterFold):
// no router launch. inv = 1/sqrt(mean(h²) + eps) from the output projection's Σ h²; every warp
// writes the digits of u = h · inv · (1 + norm_w) over its own K range; in the routed blocks
// warp 0 meanwhile reads the logit sums racc and runs softmax + top-k on inv · racc
// (router_topk). The block triggers its dependents right after its wait: moe_down_fold_* does
// the same top-k before its own wait (the output projection is complete by then), so its
// weights stream while this kernel runs.
constexpr int RF_STRIDE = 16;  // kernels/gemv.cu RF_STRIDE
constexpr int RF_SS = NE + 1;  // racc index of Σ h²

// racc index of acc_h in a set, the split output projection's sums of h − x (kernels/gdn.cu
// step_out, OUT_ACC_H; moe.rs RF_ACC_H): D f64 after the router's sums.
constexpr int RF_ACC_H = (NE + 2) * RF_STRIDE;

// This lane's router sums (lanes · PER ..) and the shared gate's, as fold_topk_scaled takes them.
struct FoldSums {
    double lg[NE / 32];
    double gate;
};
__device__ __forceinline__ FoldSums fold_sums_load(const double* __restrict__ racc, int lane) {
    constexpr int PER = NE / 32;
    FoldSums f;
#pragma unroll
    for (int i = 0; i < PER; ++i) f.lg[i] = __ldcg(racc + (lane * PER + i) * RF_STRIDE);
    f.gate = __ldcg(racc + NE * RF_STRIDE);
    return f;
}
// inv · the sums of the routed logits and the shared gate, then router_topk; one warp. The sums
// were written by the output projection, which has completed (see the callers). inv: the
// RMSNorm factor of h.
__device__ __forceinline__ void fold_topk_scaled(const FoldSums& f, float inv, float* s_logits, int* s_ids, float* s_w,
                                                 int lane) {
    constexpr int PER = NE / 32;
#pragma unroll
    for (int i = 0; i < PER; ++i) s_logits[lane * PER + i] = (float)f.lg[i] * inv;
    if (lane == 0) s_logits[NE] = (float)f.gate * inv;
    __syncwarp();
    router_topk(s_logits, s_ids, s_w, lane);
}
// The same with inv from the output projection's Σ h² (racc[RF_SS]).
__device__ __forceinline__ void fold_topk(const double* __restrict__ racc, float eps, float* s_logits, int* s_ids,
                                          float* s_w, int lane) {
    const FoldSums f = fold_sums_load(racc, lane);
    const float inv = rsqrtf((float)__ldcg(racc + RF_SS * RF_STRIDE) / float(D) + eps);
    fold_topk_scaled(f, inv, s_logits, s_ids, s_w, lane);
}

template <int BITS>
__device__ __forceinline__ void gate_up_fold_block(const uint4* __restrict__ codes, const uint2* __restrict__ sb,
                                                   const float* __restrict__ h, const float* __restrict__ norm_w,
                                                   float eps, const double* __restrict__ racc, int slot, bool routed,
                                                   int rt, float* __restrict__ act, uint4 (*s_bq)[GU_GPW][16],
                                                   float2 (*s_meta)[GU_GPW], float (*s_red)[16], float* s_logits,
                                                   int* s_ids, float* s_w) {
    static_assert(GU_GPW % 2 == 0, "two groups per warp pass");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g0 = warp * GU_GPW;
    const int q = lane & 15, hh = lane >> 4;
    Tile<BITS> tl[GU_GPW];
    auto load = [&](int e) { gate_up_tiles_load<BITS>(tl, codes, sb, e, rt, g0, lane); };
    if (!routed) load(0);  // the shared expert: before the wait
    calla_pdl_wait();      // h and racc come from the output projection
    calla_pdl_launch_dependents();
    if (routed && warp == 0) fold_topk(racc, eps, s_logits, s_ids, s_w, lane);
    // this lane's values of its warp's groups g0 + 2p + hh, laid out as quantize_group_v takes them
    const int off = 32 * (q >> 3) + 16 * ((q >> 2) & 1) + 4 * (q & 3);
    const float inv = rsqrtf((float)__ldcg(racc + RF_SS * RF_STRIDE) / float(D) + eps);
#pragma unroll
    for (int p = 0; p < GU_GPW / 2; ++p) {
        const int c = (g0 + 2 * p + hh) * GROUP + off;
        const float4 x = __ldcg(reinterpret_cast<const float4*>(h + c));
        const float4 nw = __ldg(reinterpret_cast<const float4*>(norm_w + c));
        const float4 u = make_float4(x.x * inv * (1.f + nw.x), x.y * inv * (1.f + nw.y), x.z * inv * (1.f + nw.z),
                                     x.w * inv * (1.f + nw.w));
        quantize_group_v(u, q, reinterpret_cast<unsigned*>(&s_bq[warp][2 * p + hh][0]), &s_meta[warp][2 * p + hh]);
    }
    if (routed) {
        __syncthreads();  // s_ids from warp 0
        load(s_ids[slot]);
    }
    __syncwarp();  // this warp's digits
    gate_up_finish<BITS>(tl, s_bq, s_meta, s_red, act, slot, rt);
}

template <int EB, int SB>
__device__ __forceinline__ void gate_up_fold_body(const uint4* __restrict__ codes_e, const uint2* __restrict__ sb_e,
                                                  const uint4* __restrict__ codes_s, const uint2* __restrict__ sb_s,
                                                  const float* __restrict__ h, const float* __restrict__ norm_w,
                                                  float eps, const double* __restrict__ racc, float* __restrict__ act) {
    __shared__ uint4 s_bq[GU_KS][GU_GPW][16];
    __shared__ float2 s_meta[GU_KS][GU_GPW];
    __shared__ float s_red[GU_KS][16];
    __shared__ float s_logits[NE + 1];
    __shared__ int s_ids[TOPK];
    __shared__ float s_w[NSLOT];
    static_assert(GU_KS * GU_GPW * GROUP == D, "the gate/up block's warps cover D");
    const int slot = blockIdx.x / GU_RT, rt = blockIdx.x % GU_RT;
    if (slot == TOPK)
        gate_up_fold_block<SB>(codes_s, sb_s, h, norm_w, eps, racc, slot, false, rt, act, s_bq, s_meta, s_red, s_logits,
                               s_ids, s_w);
    else
        gate_up_fold_block<EB>(codes_e, sb_e, h, norm_w, eps, racc, slot, true, rt, act, s_bq, s_meta, s_red, s_logits,
                               s_ids, s_w);
}

// ---------------------------------------------------------------------------------------------
// 3. down + combine + residual

// One warp: slot's expert, output rows 16rt..16rt+15, K groups kh*DN_GPW .. +DN_GPW of D_EXPERT.
// codes: [experts][DN_RT][EG] tiles; sb: [experts][DN_RT][EG][8] uint2. Returns the rows' partial
// dot products (valid in lanes t == 0).
template <int BITS>
__device__ __forceinline__ void down_warp(const uint4* __restrict__ codes, const uint2* __restrict__ sb,
                                          const int* __restrict__ sel_ids, int slot, bool routed, int kh, int rt,
                                          const float* __restrict__ act, int flags, unsigned* s_words,
                                          float2* s_meta, float& r0, float& r1) {
    const int lane = threadIdx.x & 31;
    const int g0 = kh * DN_GPW;
    Tile<BITS> tl[DN_GPW];
    auto load = [&](int e) {
        const size_t t0 = ((size_t)e * DN_RT + rt) * EG + g0;
#pragma unroll
        for (int i = 0; i < DN_GPW; ++i)
            tile_load<BITS>(tl[i], codes + (t0 + i) * tile_u4<BITS>(), sb + (t0 + i) * 8, lane);
    };
    // With the top-k in the router kernel, the routed ids are read before the wait: see the
    // header (kernel 1 has completed by now). Else the gate/up kernel wrote them: after it.
    const bool early = !routed || (flags & F_TOPK_IN_ROUTER);
    if (early) load(routed ? sel_ids[slot] : 0);
    calla_pdl_wait();  // act (and maybe sel_ids) come from moe_gate_up
    if (!early) load(sel_ids[slot]);
    calla_pdl_launch_dependents();
    const float* a = act + slot * DE + g0 * GROUP;
#pragma unroll
    for (int i = lane >> 4; i < DN_GPW; i += 2) quantize_group(a + i * GROUP, lane & 15, s_words + i * 64, s_meta + i);
    __syncwarp();
    tiles_dot<BITS>(tl, reinterpret_cast<const uint4*>(s_words), s_meta, lane, r0, r1);
}

// out[r] = resid[r] + Σ_k w_k (Σ_h red[h][k][i]): row i of a 16-row tile from the K halves'
// partial dot products of every slot (routed, then shared), in this order.
__device__ __forceinline__ void combine_row(const float (*red)[NSLOT][16], const float* w, int r, int i,
                                            const float* resid, float* out) {
    float m = 0.f;
#pragma unroll
    for (int k = 0; k < NSLOT; ++k) {
        float y = 0.f;
#pragma unroll
        for (int h = 0; h < DN_KS; ++h) y += red[h][k][i];
        m = fmaf(w[k], y, m);
    }
    out[r] = resid[r] + m;
}

// Warp w: slot w % NSLOT, K half w / NSLOT. out may alias resid (each element is read, then
// written, by the same thread).
template <int EB, int SB>
__device__ __forceinline__ void down_body(float* out, const float* resid, const float* __restrict__ act,
                                          const int* __restrict__ sel_ids, const float* __restrict__ sel_w,
                                          const uint4* __restrict__ codes_e, const uint2* __restrict__ sb_e,
                                          const uint4* __restrict__ codes_s, const uint2* __restrict__ sb_s,
                                          int flags, int* __restrict__ hist_row) {
    __shared__ __align__(16) unsigned s_words[DN_KS * NSLOT][DN_GPW * 64];
    __shared__ float2 s_meta[DN_KS * NSLOT][DN_GPW];
    __shared__ float s_red[DN_KS][NSLOT][16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int slot = warp % NSLOT, kh = warp / NSLOT;
    const int rt = blockIdx.x;
    float r0, r1;
    if (slot == TOPK)
        down_warp<SB>(codes_s, sb_s, sel_ids, slot, false, kh, rt, act, flags, s_words[warp], s_meta[warp], r0, r1);
    else
        down_warp<EB>(codes_e, sb_e, sel_ids, slot, true, kh, rt, act, flags, s_words[warp], s_meta[warp], r0, r1);
    store_rows(s_red[kh][slot], r0, r1, lane);
    // expert-load telemetry: this layer's row of counts (the ids are distinct; after the wait)
    if (hist_row != nullptr && blockIdx.x == 0 && threadIdx.x < TOPK) hist_row[sel_ids[threadIdx.x]] += 1;
    __syncthreads();
    if (threadIdx.x < 16) combine_row(s_red, sel_w, rt * 16 + threadIdx.x, threadIdx.x, resid, out);
}

// With the router folded into the output projection: warp 0 runs the top-k from racc (the
// output projection's sums, complete: moe_gate_up_fold triggered this launch after its own
// wait) before the wait, so every warp's expert tiles load before it; block 0 stores
// sel_ids/sel_w for telemetry and zeroes racc_zero (the next layer's accumulators: its readers
// of old, earlier layers' gate/up and down, have completed) after it.
template <int EB, int SB>
__device__ __forceinline__ void down_fold_body(float* out, const float* resid, const float* __restrict__ act,
                                               int* __restrict__ sel_ids, float* __restrict__ sel_w,
                                               const uint4* __restrict__ codes_e, const uint2* __restrict__ sb_e,
                                               const uint4* __restrict__ codes_s, const uint2* __restrict__ sb_s,
                                               const double* __restrict__ racc, double* __restrict__ racc_zero,
                                               float eps, int* __restrict__ hist_row) {
    __shared__ __align__(16) unsigned s_words[DN_KS * NSLOT][DN_GPW * 64];
    __shared__ float2 s_meta[DN_KS * NSLOT][DN_GPW];
    __shared__ float s_red[DN_KS][NSLOT][16];
    __shared__ float s_logits[NE + 1];
    __shared__ int s_ids[TOPK];
    __shared__ float s_w[NSLOT];
    static_assert(DN_KS * NSLOT * 32 > NE + 1, "a thread per accumulator");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int slot = warp % NSLOT, kh = warp / NSLOT;
    const int rt = blockIdx.x;
    if (warp == 0) fold_topk(racc, eps, s_logits, s_ids, s_w, lane);
    __syncthreads();
    float r0, r1;  // (F_TOPK_IN_ROUTER: the ids are known, the tiles load before the wait)
    if (slot == TOPK)
        down_warp<SB>(codes_s, sb_s, s_ids, slot, false, kh, rt, act, F_TOPK_IN_ROUTER, s_words[warp], s_meta[warp], r0, r1);
    else
        down_warp<EB>(codes_e, sb_e, s_ids, slot, true, kh, rt, act, F_TOPK_IN_ROUTER, s_words[warp], s_meta[warp], r0, r1);
    store_rows(s_red[kh][slot], r0, r1, lane);
    if (blockIdx.x == 0) {  // after the wait (down_warp)
        if (threadIdx.x < TOPK) sel_ids[threadIdx.x] = s_ids[threadIdx.x];
        if (threadIdx.x < NSLOT) sel_w[threadIdx.x] = s_w[threadIdx.x];
        if (threadIdx.x <= NE + 1) racc_zero[threadIdx.x * RF_STRIDE] = 0.0;
        if (hist_row != nullptr && threadIdx.x < TOPK) hist_row[s_ids[threadIdx.x]] += 1;
    }
    __syncthreads();
    if (threadIdx.x < 16) combine_row(s_red, s_w, rt * 16 + threadIdx.x, threadIdx.x, resid, out);
}

// ---------------------------------------------------------------------------------------------
// 4. fused: router + top-k + gate/up + down in one launch, phases separated by grid barriers
//
// One block of FU_WARPS warps per SM (the host launches min(SMs, what the work needs) blocks and
// checks that they fit on the GPU at once: the barriers need every block resident). The same
// arithmetic in the same order as kernels 1-3 above (results equal bit for bit):
//
//  0. before calla_pdl_wait (weights only): each warp's router row, the shared expert's gate/up
//     tiles of its unit (registers) and its down tiles of the first row tile (cp.async into
//     shared memory);
//  1. every block: u = rms_norm(h) (or u as given) and u's digits in shared memory; router row
//     r = block + G·warp (the shared-expert gate is row N_EXPERTS), logits to global memory;
//     barrier;
//  2. every block: softmax + top-k from the logits itself (one warp, no serial tail), then the
//     routed experts' down tiles of its row tile start loading (cp.async), and gate/up units
//     (slot, 16-row tile) u = block + G·(warp/4 + 5·round), 4 warps splitting K as in kernel 2;
//     act = silu(gate)·up to global memory; barrier;
//  3. row tile rt = block + G·round: 18 warps (slot, K half) as in kernel 3, combine + residual.
//
// Cross-block data (logits, act) is read through L2 (ld.cg): L1 is not coherent.
//
// Given uq_in/um_in (kernel 1's u digits), kernel 1 has run before (the router co-resides with
// the output projection, as in the three-kernel path) and this launch is gate/up + down only:
// phase 1, its barrier and the top-k are skipped, ids and weights read from sel_ids/sel_w.

constexpr int FU_WARPS = 20;                   // warps per block
constexpr int FU_THREADS = FU_WARPS * 32;
constexpr int FU_UPB = FU_WARPS / GU_KS;       // gate/up units per block and round
constexpr int FU_UNITS = NSLOT * GU_RT;        // gate/up units: (slot, 16-row tile)
constexpr int FU_DNW = DN_KS * NSLOT;          // down warps of a row tile
static_assert(FU_WARPS % GU_KS == 0 && FU_DNW <= FU_WARPS && DG / 2 <= FU_WARPS && D / 8 <= FU_THREADS, "fused block shape");

// Shared-memory bytes of one warp's staged down tiles (DN_GPW tiles: codes, then 8 {scale|bias}
// pairs each) at BITS; the dynamic shared memory is FU_DNW times that (lib: moe.rs).
template <int BITS>
constexpr int fu_stage_bytes() { return DN_GPW * (BITS * 128 + 64); }

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Grid-wide barrier over co-resident blocks: bar[0] counts arrivals (back to 0 after each use),
// bar[1] is the generation. Writes before it are visible after it to loads through L2.
__device__ __forceinline__ void grid_sync(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned gen = ld_acquire_gpu(bar + 1);  // before arriving: it cannot move until we do
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            bar[0] = 0u;
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (ld_acquire_gpu(bar + 1) == gen) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}

// One warp's DN_GPW down tiles of (expert e, row tile rt, K half kh) into its stage (cp.async,
// committed as one group).
template <int BITS>
__device__ __forceinline__ void fu_stage_down(unsigned char* stage, const uint4* __restrict__ codes,
                                              const uint2* __restrict__ sb, int e, int rt, int kh, int lane) {
    const size_t t0 = ((size_t)e * DN_RT + rt) * EG + kh * DN_GPW;
#pragma unroll
    for (int i = 0; i < DN_GPW; ++i) {
        uint4* sc = reinterpret_cast<uint4*>(stage + i * (BITS * 128 + 64));
        const uint4* gc = codes + (t0 + i) * tile_u4<BITS>();
#pragma unroll
        for (int c = 0; c < BITS / 4; ++c) cp_async16(sc + c * 32 + lane, gc + c * 32 + lane);
        if (lane < 8) cp_async8(reinterpret_cast<uint2*>(sc + (BITS / 4) * 32) + lane, sb + (t0 + i) * 8 + lane);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int BITS>
__device__ __forceinline__ void fu_tile_from_stage(Tile<BITS>& t, const unsigned char* stage, int i, int lane) {
    const uint4* sc = reinterpret_cast<const uint4*>(stage + i * (BITS * 128 + 64));
#pragma unroll
    for (int c = 0; c < BITS / 4; ++c) t.c[c] = sc[c * 32 + lane];
    t.sb = reinterpret_cast<const uint2*>(sc + (BITS / 4) * 32)[lane >> 2];
}

// RB: router and shared-gate bits; EB: every expert matrix's bits (routed and shared).
template <int RB, int EB>
__device__ __forceinline__ void fused_body(const uint4* __restrict__ r_packed, const unsigned* __restrict__ r_sb,
                                           const uint4* __restrict__ g_packed, const unsigned* __restrict__ g_sb,
                                           const uint4* __restrict__ gu_e, const uint2* __restrict__ gu_sb_e,
                                           const uint4* __restrict__ gu_s, const uint2* __restrict__ gu_sb_s,
                                           const uint4* __restrict__ dn_e, const uint2* __restrict__ dn_sb_e,
                                           const uint4* __restrict__ dn_s, const uint2* __restrict__ dn_sb_s,
                                           const float* u, const float* resid, float* out, float* logits,
                                           float* act, int* __restrict__ sel_ids, float* __restrict__ sel_w,
                                           unsigned* bar, const float* __restrict__ norm_w, float eps,
                                           const unsigned* uq_in, const float2* um_in) {
    using R = RouterShape<RB>;
    // With uq_in, kernel 1 (moe_router_*, top-k in its last block) has run: u's digits, the ids
    // and weights come from it; phase 1, the first barrier and the top-k are skipped.
    const bool routed_in = uq_in != nullptr;
    extern __shared__ __align__(16) unsigned char fu_dyn[];  // [FU_DNW] warps' staged down tiles
    __shared__ __align__(16) float s_u[D];
    __shared__ __align__(16) unsigned s_uq[DG * 64];
    __shared__ float2 s_um[DG];
    __shared__ float s_part[D / 256];
    __shared__ float s_logits[NE + 1];
    __shared__ int s_ids[TOPK];
    __shared__ float s_w[NSLOT];
    __shared__ float s_gu[FU_UPB][GU_KS][16];
    __shared__ __align__(16) unsigned s_words[FU_DNW][DN_GPW * 64];
    __shared__ float2 s_dmeta[FU_DNW][DN_GPW];
    __shared__ float s_dn[DN_KS][NSLOT][16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = gridDim.x, b = blockIdx.x;
    unsigned char* stage = fu_dyn + warp * fu_stage_bytes<EB>();

    // ---- 0. weights only (before the wait)
    const int rrow = b + G * warp;  // this warp's router row (the host makes G·FU_WARPS > NE)
    uint4 rw[R::WPR];
    unsigned rsb[R::WPR];
    if (!routed_in && rrow < NE) {
#pragma unroll
        for (int i = 0; i < R::WPR; ++i) {
            const int c = i * 32 + lane;
            rw[i] = __ldg(r_packed + (size_t)rrow * R::CH + c);
            rsb[i] = __ldg(r_sb + (size_t)rrow * DG + c * R::EPC / GROUP);
        }
    } else if (!routed_in && rrow == NE) {
#pragma unroll
        for (int i = 0; i < R::WPR; ++i) {
            const int c = i * 32 + lane;
            rw[i] = __ldg(g_packed + c);
            rsb[i] = __ldg(g_sb + c * R::EPC / GROUP);
        }
    }
    // gate/up: unit of round 0; the shared expert's tiles now
    const int gj = warp / GU_KS, kq = warp % GU_KS, g0 = kq * GU_GPW;
    Tile<EB> tl[GU_GPW];
    auto gu_load = [&](const uint4* __restrict__ codes, const uint2* __restrict__ sb, int e, int rt) {
        gate_up_tiles_load<EB>(tl, codes, sb, e, rt, g0, lane);
    };
    {
        const int unit = b + G * gj;
        if (unit < FU_UNITS && unit / GU_RT == TOPK) gu_load(gu_s, gu_sb_s, 0, unit % GU_RT);
    }
    // down: this warp's (slot, K half) of row tile b; the shared expert's tiles now
    const int dslot = warp % NSLOT, dkh = warp / NSLOT;
    if (b < DN_RT && warp < FU_DNW && dslot == TOPK) fu_stage_down<EB>(stage, dn_s, dn_sb_s, 0, b, dkh, lane);
    float4 nw0 = make_float4(0.f, 0.f, 0.f, 0.f), nw1 = nw0;
    if (!routed_in && norm_w != nullptr && threadIdx.x < D / 8) {
        nw0 = __ldg(reinterpret_cast<const float4*>(norm_w) + 2 * threadIdx.x);
        nw1 = __ldg(reinterpret_cast<const float4*>(norm_w) + 2 * threadIdx.x + 1);
    }
    calla_pdl_wait();  // u (and resid) come from the previous kernel

    if (routed_in) {
        // kernel 1's outputs (it has completed: this launch waited on it)
        if (threadIdx.x < DG * 16) reinterpret_cast<uint4*>(s_uq)[threadIdx.x] = __ldcg(reinterpret_cast<const uint4*>(uq_in) + threadIdx.x);
        if (threadIdx.x < DG) s_um[threadIdx.x] = __ldcg(um_in + threadIdx.x);
        if (threadIdx.x < TOPK) s_ids[threadIdx.x] = __ldcg(sel_ids + threadIdx.x);
        if (threadIdx.x < NSLOT) s_w[threadIdx.x] = __ldcg(sel_w + threadIdx.x);
        __syncthreads();
    } else {
        // ---- 1. u, its digits, the router
        if (norm_w != nullptr) {
            norm_to_smem(u, nw0, nw1, eps, s_part, s_u);
        } else {
            if (threadIdx.x < D / 4) reinterpret_cast<float4*>(s_u)[threadIdx.x] = __ldcg(reinterpret_cast<const float4*>(u) + threadIdx.x);
            __syncthreads();
        }
        if (warp < DG / 2) {
            const int gi = 2 * warp + (lane >> 4);
            quantize_group(s_u + gi * GROUP, lane & 15, s_uq + gi * 64, s_um + gi);
        }
        if (rrow <= NE) {
            // as kernel 1: chunk i·32 + lane of the row, warp sums, then the row's sum in chunk order
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < R::WPR; ++i) {
                float v = router_part<RB>(rw[i], rsb[i], s_u, i * 32 + lane);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                sum += v;
            }
            if (lane == 0) logits[rrow] = sum;
        }
        grid_sync(bar);  // every block has its logits in

        // ---- 2. top-k (every block), routed down tiles, gate/up
        if (warp == 0) {
            for (int i = lane; i <= NE; i += 32) s_logits[i] = __ldcg(logits + i);
            __syncwarp();
            router_topk(s_logits, s_ids, s_w, lane);
            if (b == 0 && lane < NSLOT) {  // for telemetry and the host
                if (lane < TOPK) sel_ids[lane] = s_ids[lane];
                sel_w[lane] = s_w[lane];
            }
        }
        __syncthreads();
    }
    if (b < DN_RT && warp < FU_DNW && dslot < TOPK) fu_stage_down<EB>(stage, dn_e, dn_sb_e, s_ids[dslot], b, dkh, lane);
    const int t = lane & 3;
    const float tmul = (t & 1) ? 65536.0f : 1.0f, xmask = t == 0 ? 1.0f : 0.0f;
    const int gu_rounds = (FU_UNITS + G * FU_UPB - 1) / (G * FU_UPB);
    for (int round = 0; round < gu_rounds; ++round) {
        const int unit = b + G * (gj + FU_UPB * round);
        const int slot = unit / GU_RT, rt = unit % GU_RT;
        if (unit < FU_UNITS) {
            if (slot < TOPK) gu_load(gu_e, gu_sb_e, s_ids[slot], rt);
            else if (round > 0) gu_load(gu_s, gu_sb_s, 0, rt);
            float r0, r1;
            tiles_dot<EB>(tl, reinterpret_cast<const uint4*>(s_uq) + g0 * 16, s_um + g0, lane, r0, r1);
            store_rows(s_gu[gj][kq], r0, r1, lane);
        }
        __syncthreads();
        if (threadIdx.x < FU_UPB * 8) {
            const int j = threadIdx.x / 8, r = threadIdx.x % 8;
            const int un = b + G * (j + FU_UPB * round);
            if (un < FU_UNITS) act[(un / GU_RT) * DE + (un % GU_RT) * 8 + r] = swiglu_row(s_gu[j], r);
        }
        __syncthreads();  // s_gu free for the next round
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // this lane's staged down tiles are in
    grid_sync(bar);  // act complete; every block is resident
    calla_pdl_launch_dependents();

    // ---- 3. down + combine + residual, one row tile per block and round
    const int dn_rounds = (DN_RT + G - 1) / G;
    for (int round = 0; round < dn_rounds; ++round) {
        const int rt = b + G * round;
        if (rt < DN_RT && warp < FU_DNW) {
            if (round > 0) {
                __syncwarp();  // the previous round's reads of the stage are done
                if (dslot < TOPK) fu_stage_down<EB>(stage, dn_e, dn_sb_e, s_ids[dslot], rt, dkh, lane);
                else fu_stage_down<EB>(stage, dn_s, dn_sb_s, 0, rt, dkh, lane);
                asm volatile("cp.async.wait_all;\n" ::: "memory");
            }
            const float* a = act + dslot * DE + dkh * DN_GPW * GROUP;
            unsigned* words = s_words[warp];
#pragma unroll
            for (int i = lane >> 4; i < DN_GPW; i += 2) {
                const int q = lane & 15;
                const float* xg = a + i * GROUP + 32 * (q >> 3) + 16 * ((q >> 2) & 1) + 4 * (q & 3);
                quantize_group_v(__ldcg(reinterpret_cast<const float4*>(xg)), q, words + i * 64, &s_dmeta[warp][i]);
            }
            __syncwarp();
            float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
            for (int i = 0; i < DN_GPW; ++i) {
                Tile<EB> dt;
                fu_tile_from_stage<EB>(dt, stage, i, lane);
                const uint4 bq = lane < 16 ? reinterpret_cast<const uint4*>(words + i * 64)[lane] : make_uint4(0u, 0u, 0u, 0u);
                tile_dot<EB>(dt, bq, s_dmeta[warp][i], tmul, xmask, acc0, acc1);
            }
            store_rows(s_dn[dkh][dslot], quad_sum(acc0), quad_sum(acc1), lane);
        }
        __syncthreads();
        if (rt < DN_RT && threadIdx.x < 16) combine_row(s_dn, s_w, rt * 16 + threadIdx.x, threadIdx.x, resid, out);
        __syncthreads();  // s_dn free for the next round
    }
}

// ---------------------------------------------------------------------------------------------
// 5. one expert per thread-block cluster: gate/up + SwiGLU + down + combine in one launch after
//    the router kernel (MoeFlags::cluster; every expert matrix 4-bit)
//
// Grid NSLOT clusters of CL blocks (__cluster_dims__); cluster c = slot c (the chosen experts in
// sel_ids order, then the shared expert), block rank r of it:
//  * all of the block's weights arrive by bulk copies (cp.async.bulk, the TMA engine) into
//    shared memory, requested at once as soon as the expert id is known: gate/up row tiles
//    CL_GU_RT·r .. +CL_GU_RT-1 (one copy of codes and one of scales per row tile, each on its
//    own mbarrier, so the first row tiles are used while the rest arrive), and down row tiles
//    CL_DN_RT·r .. +CL_DN_RT-1 (one more mbarrier). (A first version with per-thread 16-byte
//    cp.async and register loads streamed only ~1.3 TB/s from these 72 SMs.)
//  * gate/up: act values 64r .. 64r+63, exactly group r of the down projection's K. 16 warps =
//    (row tile, K quarter) units in two rounds, SwiGLU as in moe_gate_up_* (the quarters summed
//    in order);
//  * the block writes its group as digits (quantize_group, as moe_down_* does) and sends them to
//    every block of the cluster with st.async (slot r of their s_dq, counted on their mbarrier):
//    no block reads another's shared memory, so none has to wait for the others before exiting;
//  * down row tile CL_DN_RT·r + warp (output rows 256r .. 256r+255 in all) over all EG groups,
//    the two K halves summed as moe_down_* does;
//  * y (not yet weighted) to part[slot][row]; the last of the NSLOT blocks of rank r to finish
//    (counter counts[r], release/acquire, which it resets) adds them up for rows 256r .. 256r+255 as
//    combine_row does: out = resid + Σ_k w_k y_k in slot order.
// The routed ids are read after calla_pdl_wait() (the router kernel wrote them), the shared
// expert's weights are requested before it. Every product and sum is that of moe_gate_up_* then
// moe_down_*, in their order: out is equal bit for bit to the three-kernel path.
constexpr int CL = 8;                  // blocks per cluster (portable size)
constexpr int CL_WARPS = 16;
constexpr int CL_THREADS = CL_WARPS * 32;
constexpr int CL_GU_RT = GU_RT / CL;   // gate/up row tiles per block
constexpr int CL_DN_RT = DN_RT / CL;   // down row tiles per block
constexpr int CL_MSG = GROUP * 4 + 8;  // bytes each block sends to each: a group's digits and meta
// bulk copies per block: codes and scales of each gate/up row tile, of the down tiles
constexpr int CL_COPIES = 2 * CL_GU_RT + 2;
constexpr int CL_MARKS = 11;  // words per block of the phase probe (moe.rs CL_MARKS)
// `flags` of the cluster kernels: with the fold, trigger the dependent launch (the next layer's
// input projection) once the block's expert tiles are all here instead of right after the PDL
// wait, so the next kernel's blocks do not land (and request their weights) while the experts
// stream (moe.rs CL_LATE_TRIGGER).
constexpr int CL_LATE_TRIGGER = 1;
// ... and (timeline probe only) stamp the block's mark when its copies are issued instead of when
// its tiles are all here (moe.rs CL_MARK_ISSUE).
constexpr int CL_MARK_ISSUE = 2;
// Measurement only: the routed blocks stream the tiles of fixed experts, slot · NE/TOPK + 7,
// whatever the top-k chose, so every token reads the same pages; the output is wrong (moe.rs
// CL_PIN_EXPERTS).
constexpr int CL_PIN_EXPERTS = 4;
// With the fold: block 0 also zeroes acc_h of the next layer's set (moe.rs CL_ZERO_ACC_H), for a
// step whose GDN layers run the split output projection (kernels/gdn.cu step_out); always done
// by moe_cluster_split_e4.
constexpr int CL_ZERO_ACC_H = 8;
// Measurement only, wrong outputs (lib.rs set_decode_diag): every block leaves once its rows of y
// are written (no count, no combine; with CL_HSUM, no atomics), to time the combine in place.
constexpr int CL_DIAG_NO_COMBINE = 16;
// With the fold (not SPLIT): the combine by f64 atomics instead of the counted last block (moe.rs
// CL_HSUM, MoeScratch::hsum_combine; CudaContext::set_moe_hsum). Every block adds its rows'
// w_slot · y (f32 products) into the next set's h accumulators (racc_zero + RF_ACC_H, D
// doubles, zero on entry), the shared expert's blocks the residual h too, and leaves: no count,
// no last block reading every slot. The next layer's input projection (or the LM head) reads
// them as f64 and rounds to f32 (gemv.cu gemv_norm_*xd*). Block 0 zeroes this layer's own
// set's accumulators: their reader (this layer's input projection, or for the first layer the
// previous step's LM head) has completed. The 10 terms of a row are f32 values: their f64 sum
// is exact, whatever the order of the atomics, while their exponents span at most 25 binades
// (53 bits = 24 + 25 + 4 for the carries); beyond that the f64 sum is rounded and may depend
// on the order, which changes the f32 result only when it lies that close to an f32 rounding
// boundary.
constexpr int CL_HSUM = 64;
// The routed experts' bulk copies carry an L2 evict_first policy (moe.rs CL_EVICT_FIRST; the L2
// follower's `ef` plans, cuda::follow): each expert tile is read once per token, so it should
// not evict what the follower asked L2 to hold for the next input projection. Hints only
// (measured in session 35: it did not make that prefetch pay).
constexpr int CL_EVICT_FIRST = 128;
static_assert(GU_RT % CL == 0 && CL_GU_RT * 8 == GROUP && EG == CL, "a block's gate/up outputs are one group of the down's K");
static_assert(CL_DN_RT == CL_WARPS, "one down row tile per warp");
static_assert(CL_GU_RT * GU_KS == 2 * CL_WARPS && CL_WARPS % GU_KS == 0, "two gate/up units (row tile, K quarter) per warp");
static_assert(DN_KS == 2 && EG == 2 * DN_GPW, "down: two K halves, as moe_down_*");
static_assert(CL_DN_RT * 16 <= CL_THREADS && NSLOT <= 32 && CL_COPIES <= 32, "thread roles");

// Dynamic shared memory (lib: moe.rs cluster_smem_bytes): gate/up codes [CL_GU_RT][DG] tiles,
// their {scale|bias} pairs [CL_GU_RT][DG][8], down codes [CL_DN_RT][EG] tiles, their pairs.
template <int BITS>
struct ClSmem {
    static constexpr int GU_CODES = CL_GU_RT * DG * BITS * 128;
    static constexpr int GU_SB = CL_GU_RT * DG * 64;
    static constexpr int DN_CODES = CL_DN_RT * EG * BITS * 128;
    static constexpr int DN_SB = CL_DN_RT * EG * 64;
    static constexpr int BYTES = GU_CODES + GU_SB + DN_CODES + DN_SB;
};

__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Where the routing and u's digits come from: the router kernel (FOLD = false: its ids, weights
// and digits), or the router folded into the output projection (FOLD = true: every block runs the
// top-k from the accumulator set racc in warp 0, as moe_down_fold_* does, and its warps make
// the digits of u = h · inv · (1 + norm_w) of their K quarter themselves, as moe_gate_up_fold_*
// does, in registers; block 0 stores sel_ids/sel_w and zeroes racc_zero, the next layer's set).
struct ClRoute {
    int* sel_ids;
    float* sel_w;
    const unsigned* uq;
    const float2* umeta;
    const float* h;
    const float* norm_w;
    float eps;
    const double* racc;
    double* racc_zero;
};

// SPLIT (with FOLD): after the split output projection (kernels/gdn.cu step_out): h = resid +
// acc_h (racc + RF_ACC_H, f64 sums) is made here, and Σ h² over the block (the four warps of
// distinct K quarters, in order) gives the norm's factor instead of racc[RF_SS]; out may be
// resid (every block reads its h before any block combines: see the combine below).
template <int BITS, bool FOLD, bool SPLIT = false>
__device__ __forceinline__ void cluster_body(float* out, const float* resid, const uint4* __restrict__ gu_e,
                                             const uint2* __restrict__ gu_sb_e, const uint4* __restrict__ gu_s,
                                             const uint2* __restrict__ gu_sb_s, const uint4* __restrict__ dn_e,
                                             const uint2* __restrict__ dn_sb_e, const uint4* __restrict__ dn_s,
                                             const uint2* __restrict__ dn_sb_s, const ClRoute rt, float* part,
                                             unsigned* counts, int* __restrict__ hist_row,
                                             unsigned long long* probe, int flags,
                                             const CallaL2Prefetch& pf = CallaL2Prefetch{}) {
    using S = ClSmem<BITS>;
    // Measurement (probe != null): thread 0 of each block records %globaltimer at its start and
    // after its PDL wait, then clock64 cycles since the wait at each phase (CL_MARKS words).
    // (Written after the wait, like every store of the kernel.)
    unsigned long long c_wait = 0;
    const unsigned long long t_start = probe != nullptr && threadIdx.x == 0 ? calla_globaltimer() : 0;
    auto mark = [&](int i) {
        if (probe != nullptr && threadIdx.x == 0) probe[blockIdx.x * CL_MARKS + i] = clock64() - c_wait;
    };
    static_assert(S::BYTES + 6 * 1024 <= 227 * 1024, "shared memory of one block");
    extern __shared__ __align__(128) unsigned char cl_dyn[];
    __shared__ float s_gu[CL_GU_RT][GU_KS][16];         // row sums of each unit
    __shared__ __align__(16) float s_act[GROUP];        // this block's act values (group r)
    __shared__ __align__(16) unsigned s_myq[2][GROUP];  // group r as digits (half-warp 0's; 1: scratch)
    __shared__ __align__(8) float2 s_mym[2];
    __shared__ __align__(16) unsigned s_dq[CL][GROUP];  // every block's group as digits, by rank
    __shared__ __align__(8) float2 s_dm[CL];
    __shared__ __align__(8) unsigned long long mbar_x;            // all CL groups arrived
    __shared__ __align__(8) unsigned long long mbar_gu[CL_GU_RT];  // a gate/up row tile arrived
    __shared__ __align__(8) unsigned long long mbar_dn;            // the down tiles arrived
    __shared__ float s_w[NSLOT];
    __shared__ int s_ids[TOPK];
    __shared__ float s_logits[FOLD ? NE + 1 : 1];
    __shared__ float s_ss[SPLIT ? GU_KS : 1];  // SPLIT: Σ h² of each K quarter
    __shared__ unsigned s_last;

    const uint4* sm_gu = reinterpret_cast<const uint4*>(cl_dyn);
    const uint2* sm_gsb = reinterpret_cast<const uint2*>(cl_dyn + S::GU_CODES);
    const uint4* sm_dn = reinterpret_cast<const uint4*>(cl_dyn + S::GU_CODES + S::GU_SB);
    const uint2* sm_dsb = reinterpret_cast<const uint2*>(cl_dyn + S::GU_CODES + S::GU_SB + S::DN_CODES);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned r = calla_cluster_ctarank();
    const int slot = (int)calla_cluster_id_x();
    const bool routed = slot < TOPK;

    if (threadIdx.x == 0) {
        calla_mbar_init_expect(&mbar_x, CL * CL_MSG);
        for (int j = 0; j < CL_GU_RT; ++j)
            calla_mbar_init_expect(&mbar_gu[j], DG * (BITS * 128 + 64));
        calla_mbar_init_expect(&mbar_dn, S::DN_CODES + S::DN_SB);
    }
    calla_cluster_arrive_relaxed();  // "started, mbarrier ready"; waited for before the first send
    __syncthreads();                 // the mbarriers are initialised before anyone polls them
    // lanes of warp 0: one bulk copy each (expert e)
    unsigned long long policy = 0;
    const bool hint = routed && (flags & CL_EVICT_FIRST);
    if (hint) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    auto copy = [&](void* dst, const void* src, unsigned bytes, unsigned long long* m) {
        if (hint)
            calla_bulk_copy_hint(dst, src, bytes, m, policy);
        else
            calla_bulk_copy(dst, src, bytes, m);
    };
    auto request = [&](int e) {
        const uint4* gu = routed ? gu_e : gu_s;
        const uint2* gsb = routed ? gu_sb_e : gu_sb_s;
        const uint4* dn = routed ? dn_e : dn_s;
        const uint2* dsb = routed ? dn_sb_e : dn_sb_s;
        const size_t gt = ((size_t)e * GU_RT + (int)r * CL_GU_RT) * DG;  // first gate/up tile
        const size_t dt = ((size_t)e * DN_RT + (int)r * CL_DN_RT) * EG;  // first down tile
        // row tile j's codes and scales from lanes 2j, 2j + 1 (in the order they are used)
        if (lane < 2 * CL_GU_RT && (lane & 1) == 0) {
            const int j = lane >> 1;
            copy(cl_dyn + j * DG * BITS * 128, gu + (gt + j * DG) * tile_u4<BITS>(), DG * BITS * 128, &mbar_gu[j]);
        } else if (lane < 2 * CL_GU_RT) {
            const int j = lane >> 1;
            copy(cl_dyn + S::GU_CODES + j * DG * 64, gsb + (gt + j * DG) * 8, DG * 64, &mbar_gu[j]);
        } else if (lane == 2 * CL_GU_RT) {
            copy(cl_dyn + S::GU_CODES + S::GU_SB, dn + dt * tile_u4<BITS>(), S::DN_CODES, &mbar_dn);
        } else if (lane == 2 * CL_GU_RT + 1) {
            copy(cl_dyn + S::GU_CODES + S::GU_SB + S::DN_CODES, dsb + dt * 8, S::DN_SB, &mbar_dn);
        }
    };
    if (!routed && warp == 0) request(0);  // the shared expert: before the wait
    calla_pdl_wait();  // the routing and u come from the previous kernel (router or output projection)
    if (probe != nullptr && threadIdx.x == 0) {
        probe[blockIdx.x * CL_MARKS] = t_start;
        probe[blockIdx.x * CL_MARKS + 1] = calla_globaltimer();
        c_wait = clock64();
    }
    // The small reads of this launch go out before the bulk copies (measured: a load issued
    // after them waits ~2 us behind their data), then warp 0 requests the expert's tiles.
    const int kq = warp % GU_KS, g0 = kq * GU_GPW;  // this warp's K quarter (both rounds)
    uint4 bq[GU_GPW];                               // u's digits of it, in registers
    float2 bm[GU_GPW];
    if constexpr (FOLD) {
        if (!(flags & CL_LATE_TRIGGER)) calla_pdl_launch_dependents();
        // this lane's values of h and norm_w for the digits of u = h · inv · (1 + norm_w), two
        // groups per pass (one per half-warp), as moe_gate_up_fold_* lays them out
        static_assert(GU_GPW % 2 == 0, "two groups per pass");
        const int q = lane & 15, hh = lane >> 4;
        const int off = 32 * (q >> 3) + 16 * ((q >> 2) & 1) + 4 * (q & 3);
        float4 hx[GU_GPW / 2], hw[GU_GPW / 2];
#pragma unroll
        for (int pp = 0; pp < GU_GPW / 2; ++pp) {
            const int c = (g0 + 2 * pp + hh) * GROUP + off;
            hx[pp] = __ldcg(reinterpret_cast<const float4*>(rt.h + c));
            hw[pp] = __ldg(reinterpret_cast<const float4*>(rt.norm_w + c));
            if constexpr (SPLIT) {
                const double2 a = __ldcg(reinterpret_cast<const double2*>(rt.racc + RF_ACC_H + c));
                const double2 b = __ldcg(reinterpret_cast<const double2*>(rt.racc + RF_ACC_H + c + 2));
                hx[pp] = make_float4(hx[pp].x + (float)a.x, hx[pp].y + (float)a.y, hx[pp].z + (float)b.x,
                                     hx[pp].w + (float)b.y);
            }
        }
        float inv = 0.f;
        double ss_fold = 0.0;  // the fold's Σ h²: requested here, used after the copies are issued
        if constexpr (!SPLIT) ss_fold = __ldcg(rt.racc + RF_SS * RF_STRIDE);
        if constexpr (SPLIT) {
            // warp 0's sums requested with h (one round trip), scaled once Σ h² is known
            FoldSums fs{};
            if (warp == 0) fs = fold_sums_load(rt.racc, lane);
            float ss = 0.f;
#pragma unroll
            for (int pp = 0; pp < GU_GPW / 2; ++pp)
                ss += hx[pp].x * hx[pp].x + hx[pp].y * hx[pp].y + hx[pp].z * hx[pp].z + hx[pp].w * hx[pp].w;
            ss = calla_warp_sum(ss);
            if (lane == 0 && warp < GU_KS) s_ss[warp] = ss;
            __syncthreads();
            float tot = 0.f;
#pragma unroll
            for (int k = 0; k < GU_KS; ++k) tot += s_ss[k];
            inv = rsqrtf(tot / float(D) + rt.eps);
            if (warp == 0) fold_topk_scaled(fs, inv, s_logits, s_ids, s_w, lane);
        } else {
            if (warp == 0) fold_topk(rt.racc, rt.eps, s_logits, s_ids, s_w, lane);
        }
        __syncthreads();
        if (routed && warp == 0) request((flags & CL_PIN_EXPERTS) ? slot * (NE / TOPK) + 7 : s_ids[slot]);
        // after the block's own copies: its share of the L2 hints (the decode step's plan: the
        // next input projection's rows that its late-landing blocks read; empty by default)
        calla_l2_prefetch_share(pf);
        mark(2);  // bulk copies issued
        if (flags & CL_MARK_ISSUE) calla_tl_mark();
        if constexpr (!SPLIT) inv = rsqrtf((float)ss_fold / float(D) + rt.eps);
#pragma unroll
        for (int pp = 0; pp < GU_GPW / 2; ++pp) {
            const float4 x = hx[pp], nw = hw[pp];
            const float4 u = make_float4(x.x * inv * (1.f + nw.x), x.y * inv * (1.f + nw.y), x.z * inv * (1.f + nw.z),
                                         x.w * inv * (1.f + nw.w));
            uint4 f;
            float2 mt;
            quantize_group_frag(u, lane, f, mt);
            const uint4 hi = make_uint4(__shfl_down_sync(0xffffffffu, f.x, 16), __shfl_down_sync(0xffffffffu, f.y, 16),
                                        __shfl_down_sync(0xffffffffu, f.z, 16), __shfl_down_sync(0xffffffffu, f.w, 16));
            bq[2 * pp] = lane < 16 ? f : make_uint4(0u, 0u, 0u, 0u);
            bq[2 * pp + 1] = lane < 16 ? hi : make_uint4(0u, 0u, 0u, 0u);
            bm[2 * pp] = make_float2(__shfl_sync(0xffffffffu, mt.x, 0), __shfl_sync(0xffffffffu, mt.y, 0));
            bm[2 * pp + 1] = make_float2(__shfl_sync(0xffffffffu, mt.x, 16), __shfl_sync(0xffffffffu, mt.y, 16));
        }
        if (blockIdx.x == 0) {  // for telemetry and the host; the next layer's accumulators
            if (threadIdx.x < TOPK) rt.sel_ids[threadIdx.x] = s_ids[threadIdx.x];
            if (threadIdx.x < NSLOT) rt.sel_w[threadIdx.x] = s_w[threadIdx.x];
            if (threadIdx.x <= NE + 1) rt.racc_zero[threadIdx.x * RF_STRIDE] = 0.0;
            if (SPLIT || (flags & CL_ZERO_ACC_H))
                for (int i = threadIdx.x; i < D; i += CL_THREADS) rt.racc_zero[RF_ACC_H + i] = 0.0;
            if (!SPLIT && (flags & CL_HSUM))  // this set's h sums: its reader has completed
                for (int i = threadIdx.x; i < D; i += CL_THREADS) const_cast<double*>(rt.racc)[RF_ACC_H + i] = 0.0;
        }
    } else {
        const int e = routed && warp == 0 ? rt.sel_ids[slot] : 0;
#pragma unroll
        for (int i = 0; i < GU_GPW; ++i) {
            bq[i] = lane < 16 ? reinterpret_cast<const uint4*>(rt.uq)[(g0 + i) * 16 + lane] : make_uint4(0u, 0u, 0u, 0u);
            bm[i] = rt.umeta[g0 + i];
        }
        if (threadIdx.x < TOPK) s_ids[threadIdx.x] = rt.sel_ids[threadIdx.x];
        if (threadIdx.x < NSLOT) s_w[threadIdx.x] = rt.sel_w[threadIdx.x];
        if (routed && warp == 0) request(e);
        mark(2);  // bulk copies issued
        if (flags & CL_MARK_ISSUE) calla_tl_mark();
        calla_pdl_launch_dependents();
    }
    __syncthreads();  // s_ids, s_w
    // expert-load telemetry: this layer's row of counts (the ids are distinct)
    if (hist_row != nullptr && blockIdx.x == 0 && threadIdx.x < TOPK) hist_row[s_ids[threadIdx.x]] += 1;

    // ---- gate/up: units (row tile j, K quarter kq), j = warp / GU_KS and one round later
    const int t = lane & 3;
    const float tmul = (t & 1) ? 65536.0f : 1.0f, xmask = t == 0 ? 1.0f : 0.0f;
#pragma unroll
    for (int round = 0; round < 2; ++round) {
        const int j = warp / GU_KS + round * (CL_WARPS / GU_KS);
        calla_mbar_wait_phase0(&mbar_gu[j]);
        mark(3 + round);  // row tile j's weights are here
        float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
        for (int i = 0; i < GU_GPW; ++i) {
            Tile<BITS> tl;
            const int tile = j * DG + g0 + i;
            tile_from_smem<BITS>(tl, sm_gu + tile * tile_u4<BITS>(), sm_gsb + tile * 8, lane);
            tile_dot<BITS>(tl, bq[i], bm[i], tmul, xmask, acc0, acc1);
        }
        store_rows(s_gu[j][kq], quad_sum(acc0), quad_sum(acc1), lane);
    }
    __syncthreads();
    if (threadIdx.x < GROUP) s_act[threadIdx.x] = swiglu_row(s_gu[threadIdx.x / 8], threadIdx.x % 8);
    __syncthreads();
    mark(5);  // gate/up done

    // ---- group r's digits to every block of the cluster
    calla_cluster_wait();  // every block started and initialised its mbarriers
    if (warp == 0) {
        quantize_group(s_act, lane & 15, s_myq[lane >> 4], &s_mym[lane >> 4]);  // both halves alike
        __syncwarp();
        constexpr int ITEMS = GROUP / 4 + 1;  // 16-byte pieces of the digits, then the meta
        for (int it = lane; it < CL * ITEMS; it += 32) {
            const int k = it / ITEMS, i = it % ITEMS;
            if (i < GROUP / 4)
                calla_st_async_u4(&s_dq[r][4 * i], &mbar_x, (unsigned)k, reinterpret_cast<const uint4*>(s_myq[0])[i]);
            else
                calla_st_async_u2(&s_dm[r], &mbar_x, (unsigned)k, *reinterpret_cast<const uint2*>(&s_mym[0]));
        }
    }
    calla_mbar_wait_phase0(&mbar_dn);  // the down tiles
    mark(6);
    // the L2 follower's landing cue (host: cuda::follow parts::IN_LATE; nullptr: none): every
    // block adds 1 once all of its expert tiles are in shared memory (gate/up's were waited for
    // before the barrier above), so the follower can ask L2 for the next input projection's
    // late-landing rows once the experts' stream is over instead of competing with it
    if (pf.progress != nullptr && threadIdx.x == 0)
        asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(pf.progress) : "memory");
    if (!(flags & CL_MARK_ISSUE)) calla_tl_mark();  // timeline probe: the block's expert tiles are all here
    if (FOLD && (flags & CL_LATE_TRIGGER)) calla_pdl_launch_dependents();
    calla_mbar_wait_phase0(&mbar_x);   // all CL groups
    mark(7);

    // ---- down: this warp's row tile over both K halves (as moe_down_*: a warp per half)
    const int drt = (int)r * CL_DN_RT + warp;
    float y0 = 0.f, y1 = 0.f;  // rows g and g+8 of the tile
#pragma unroll
    for (int h = 0; h < DN_KS; ++h) {
        float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
        for (int i = 0; i < DN_GPW; ++i) {
            const int g = h * DN_GPW + i;
            Tile<BITS> dt;
            const int tile = warp * EG + g;
            tile_from_smem<BITS>(dt, sm_dn + tile * tile_u4<BITS>(), sm_dsb + tile * 8, lane);
            const uint4 b = lane < 16 ? reinterpret_cast<const uint4*>(s_dq[g])[lane] : make_uint4(0u, 0u, 0u, 0u);
            tile_dot<BITS>(dt, b, s_dm[g], tmul, xmask, acc0, acc1);
        }
        y0 += quad_sum(acc0);
        y1 += quad_sum(acc1);
    }
    if (FOLD && !SPLIT && (flags & CL_HSUM)) {
        if (t == 0 && !(flags & CL_DIAG_NO_COMBINE)) {  // (the diagnostic leaves the atomics out)
            const int r0 = drt * 16 + (lane >> 2), r1 = r0 + 8;
            double v0 = (double)(s_w[slot] * y0), v1 = (double)(s_w[slot] * y1);
            if (slot == NSLOT - 1) {  // the shared expert's blocks add the residual
                v0 += (double)resid[r0];
                v1 += (double)resid[r1];
            }
            double* hs = rt.racc_zero + RF_ACC_H;
            atomicAdd(hs + r0, v0);
            atomicAdd(hs + r1, v1);
        }
        calla_tl_done();
        return;
    }
    if (t == 0) {
        float* py = part + slot * D + drt * 16;
        py[lane >> 2] = y0;
        py[8 + (lane >> 2)] = y1;
    }

    // ---- the last block of rank r adds every slot's rows up. The barrier orders every
    // thread's y before thread 0's counter increment, whose release (gpu scope, cumulative)
    // publishes them; the last block's acquire, then its barrier, orders its reads after.
    __syncthreads();
    mark(8);  // y written
    if (flags & CL_DIAG_NO_COMBINE) {
        calla_tl_done();
        return;
    }
    if (threadIdx.x == 0) s_last = atom_add_acq_rel_gpu(counts + r, 1u) == NSLOT - 1 ? 1u : 0u;
    __syncthreads();
    mark(9);  // counted
    if (s_last == 0u) {
        calla_tl_done();
        return;
    }
    if (threadIdx.x < CL_DN_RT * 16) {
        const int row = (int)r * CL_DN_RT * 16 + threadIdx.x;
        float y[NSLOT];
#pragma unroll
        for (int k = 0; k < NSLOT; ++k) y[k] = __ldcg(part + k * D + row);
        float m = 0.f;
#pragma unroll
        for (int k = 0; k < NSLOT; ++k) m = fmaf(s_w[k], y[k], m);
        // SPLIT: h as the digits were made from it. out may be resid: every block of every
        // cluster read all of h before it sent its group's digits, and this block is past the
        // arrival of every slot's block of rank r, each of which waited for its cluster's groups
        const float hr = SPLIT ? resid[row] + (float)__ldcg(rt.racc + RF_ACC_H + row) : resid[row];
        out[row] = hr + m;
    }
    if (threadIdx.x == 0) counts[r] = 0u;  // for the next launch (kernel boundaries order it)
    mark(10);  // the last block: combined
    calla_tl_done();
}

}  // namespace calla_moe

// ---------------------------------------------------------------------------------------------
// entry points: router bits x shared-gate bits; routed x shared expert bits

#define CALLA_MOE_ROUTER(NAME, RB, GB)                                                                   \
    extern "C" __global__ void __launch_bounds__(calla_moe::R_WARPS * 32) NAME(                          \
        const uint4* __restrict__ r_packed, const unsigned* __restrict__ r_sb,                            \
        const uint4* __restrict__ g_packed, const unsigned* __restrict__ g_sb, const float* __restrict__ u, \
        float* __restrict__ logits, unsigned* __restrict__ uq, float2* __restrict__ umeta,                \
        int* __restrict__ sel_ids, float* __restrict__ sel_w, unsigned* __restrict__ counter, int flags,   \
        const float* __restrict__ norm_w, float eps, CallaL2Prefetch pf) {                                \
        calla_moe::router_body<RB, GB>(r_packed, r_sb, g_packed, g_sb, u, logits, uq, umeta, sel_ids,     \
                                       sel_w, counter, flags, norm_w, eps, pf);                           \
    }
CALLA_MOE_ROUTER(moe_router_r4_g4, 4, 4)
CALLA_MOE_ROUTER(moe_router_r4_g8, 4, 8)
CALLA_MOE_ROUTER(moe_router_r8_g4, 8, 4)
CALLA_MOE_ROUTER(moe_router_r8_g8, 8, 8)

// 5 blocks of 128 threads per SM at 4 bits (<= 102 registers): the whole grid in one wave.
#define CALLA_MOE_GATE_UP(NAME, EB, SB)                                                                   \
    extern "C" __global__ void __launch_bounds__(calla_moe::GU_KS * 32, (EB == 8 || SB == 8) ? 4 : 5) NAME( \
        const uint4* __restrict__ codes_e, const uint2* __restrict__ sb_e,                                \
        const uint4* __restrict__ codes_s, const uint2* __restrict__ sb_s,                                \
        const char* dn_codes_e, const char* dn_sb_e, unsigned dn_tile_e,                                   \
        const char* dn_codes_s, const char* dn_sb_s, unsigned dn_tile_s,                                   \
        int* __restrict__ sel_ids, float* __restrict__ sel_w, const float* __restrict__ logits,           \
        const unsigned* __restrict__ uq, const float2* __restrict__ umeta, float* __restrict__ act,        \
        int flags) {                                                                                       \
        calla_moe::gate_up_body<EB, SB>(codes_e, sb_e, codes_s, sb_s, {dn_codes_e, dn_sb_e, dn_tile_e},   \
                                        {dn_codes_s, dn_sb_s, dn_tile_s}, sel_ids, sel_w, logits, uq,      \
                                        umeta, act, flags);                                                \
    }
CALLA_MOE_GATE_UP(moe_gate_up_e4_s4, 4, 4)
CALLA_MOE_GATE_UP(moe_gate_up_e4_s8, 4, 8)
CALLA_MOE_GATE_UP(moe_gate_up_e8_s4, 8, 4)
CALLA_MOE_GATE_UP(moe_gate_up_e8_s8, 8, 8)

// With the router folded into the output projection (kernels/gemv.cu gemv_resid_rf_*): h is the
// residual stream after it, norm_w the post_attention_layernorm, racc its logit sums and Σ h²
// [(N_EXPERTS + 2) * RF_STRIDE] f64; the grid and block of moe_gate_up_*.
#define CALLA_MOE_GATE_UP_FOLD(NAME, EB, SB)                                                              \
    extern "C" __global__ void __launch_bounds__(calla_moe::GU_KS * 32, (EB == 8 || SB == 8) ? 4 : 5) NAME( \
        const uint4* __restrict__ codes_e, const uint2* __restrict__ sb_e,                                \
        const uint4* __restrict__ codes_s, const uint2* __restrict__ sb_s, const float* __restrict__ h,   \
        const float* __restrict__ norm_w, float eps, const double* __restrict__ racc,                     \
        float* __restrict__ act) {                                                                         \
        calla_moe::gate_up_fold_body<EB, SB>(codes_e, sb_e, codes_s, sb_s, h, norm_w, eps, racc, act);     \
    }
CALLA_MOE_GATE_UP_FOLD(moe_gate_up_fold_e4_s4, 4, 4)
CALLA_MOE_GATE_UP_FOLD(moe_gate_up_fold_e4_s8, 4, 8)
CALLA_MOE_GATE_UP_FOLD(moe_gate_up_fold_e8_s4, 8, 4)
CALLA_MOE_GATE_UP_FOLD(moe_gate_up_fold_e8_s8, 8, 8)

// QUALS: CALLA_MOE_DOWN_ONE_PER_SM (the default) or CALLA_MOE_DOWN_48_REGS: at most 48 registers
// per thread (__maxnreg__, which excludes __launch_bounds__): 576 x 48 = 27,648 registers, so a
// down block fits on an SM beside three gate/up blocks and can start (and load its weights)
// before they drain. A measured variant (MoeFlags::down_reg_cap): slower, it spills at 8 bits.
#define CALLA_MOE_DOWN_ONE_PER_SM __launch_bounds__(calla_moe::DN_KS * calla_moe::NSLOT * 32, 1)
#define CALLA_MOE_DOWN_48_REGS __maxnreg__(48)
#define CALLA_MOE_DOWN(NAME, EB, SB, QUALS)                                                               \
    extern "C" __global__ void QUALS NAME(                                                                \
        float* out, const float* resid, const float* __restrict__ act,                                    \
        const int* __restrict__ sel_ids, const float* __restrict__ sel_w,                                  \
        const uint4* __restrict__ codes_e, const uint2* __restrict__ sb_e,                                \
        const uint4* __restrict__ codes_s, const uint2* __restrict__ sb_s, int flags, int* hist_row) {    \
        calla_moe::down_body<EB, SB>(out, resid, act, sel_ids, sel_w, codes_e, sb_e, codes_s, sb_s, flags, \
                                     hist_row);                                                            \
    }
CALLA_MOE_DOWN(moe_down_e4_s4, 4, 4, CALLA_MOE_DOWN_ONE_PER_SM)
CALLA_MOE_DOWN(moe_down_e4_s8, 4, 8, CALLA_MOE_DOWN_ONE_PER_SM)
CALLA_MOE_DOWN(moe_down_e8_s4, 8, 4, CALLA_MOE_DOWN_ONE_PER_SM)
CALLA_MOE_DOWN(moe_down_e8_s8, 8, 8, CALLA_MOE_DOWN_ONE_PER_SM)
CALLA_MOE_DOWN(moe_down_r48_e4_s4, 4, 4, CALLA_MOE_DOWN_48_REGS)
CALLA_MOE_DOWN(moe_down_r48_e4_s8, 4, 8, CALLA_MOE_DOWN_48_REGS)
CALLA_MOE_DOWN(moe_down_r48_e8_s4, 8, 4, CALLA_MOE_DOWN_48_REGS)
CALLA_MOE_DOWN(moe_down_r48_e8_s8, 8, 8, CALLA_MOE_DOWN_48_REGS)

// After moe_gate_up_fold_*: the down kernel with its own top-k from racc (see down_fold_body);
// racc_zero: the accumulators the next layer's output projection adds into.
#define CALLA_MOE_DOWN_FOLD(NAME, EB, SB)                                                                 \
    extern "C" __global__ void __maxnreg__(64) NAME(                                                      \
        float* out, const float* resid, const float* __restrict__ act, int* __restrict__ sel_ids,         \
        float* __restrict__ sel_w, const uint4* __restrict__ codes_e, const uint2* __restrict__ sb_e,     \
        const uint4* __restrict__ codes_s, const uint2* __restrict__ sb_s, const double* __restrict__ racc, \
        double* __restrict__ racc_zero, float eps, int* hist_row) {                                        \
        calla_moe::down_fold_body<EB, SB>(out, resid, act, sel_ids, sel_w, codes_e, sb_e, codes_s, sb_s, racc, \
                                          racc_zero, eps, hist_row);                                       \
    }
CALLA_MOE_DOWN_FOLD(moe_down_fold_e4_s4, 4, 4)
CALLA_MOE_DOWN_FOLD(moe_down_fold_e4_s8, 4, 8)
CALLA_MOE_DOWN_FOLD(moe_down_fold_e8_s4, 8, 4)
CALLA_MOE_DOWN_FOLD(moe_down_fold_e8_s8, 8, 8)

// Fused (one launch, grid barriers): router/shared-gate bits x expert bits (routed and shared
// alike; other mixes use the three kernels). One block per SM (FU_THREADS threads).
#define CALLA_MOE_FUSED(NAME, RB, EB)                                                                     \
    extern "C" __global__ void __launch_bounds__(calla_moe::FU_THREADS, 1) NAME(                         \
        const uint4* __restrict__ r_packed, const unsigned* __restrict__ r_sb,                            \
        const uint4* __restrict__ g_packed, const unsigned* __restrict__ g_sb,                            \
        const uint4* __restrict__ gu_e, const uint2* __restrict__ gu_sb_e,                                \
        const uint4* __restrict__ gu_s, const uint2* __restrict__ gu_sb_s,                                \
        const uint4* __restrict__ dn_e, const uint2* __restrict__ dn_sb_e,                                \
        const uint4* __restrict__ dn_s, const uint2* __restrict__ dn_sb_s, const float* u,                \
        const float* resid, float* out, float* logits, float* act, int* __restrict__ sel_ids,             \
        float* __restrict__ sel_w, unsigned* bar, const float* __restrict__ norm_w, float eps,            \
        const unsigned* uq_in, const float2* um_in) {                                                      \
        calla_moe::fused_body<RB, EB>(r_packed, r_sb, g_packed, g_sb, gu_e, gu_sb_e, gu_s, gu_sb_s, dn_e,  \
                                      dn_sb_e, dn_s, dn_sb_s, u, resid, out, logits, act, sel_ids, sel_w, \
                                      bar, norm_w, eps, uq_in, um_in);                                    \
    }
CALLA_MOE_FUSED(moe_fused_r4_e4, 4, 4)
CALLA_MOE_FUSED(moe_fused_r4_e8, 4, 8)
CALLA_MOE_FUSED(moe_fused_r8_e4, 8, 4)
CALLA_MOE_FUSED(moe_fused_r8_e8, 8, 8)

// One expert per cluster of CL blocks, after moe_router_* (top-k in its last block): gate/up,
// down and the combine (cluster_body). 4-bit experts, routed and shared; one block per SM.
extern "C" __global__ void __cluster_dims__(calla_moe::CL, 1, 1) __launch_bounds__(calla_moe::CL_THREADS, 1)
    moe_cluster_e4(float* out, const float* resid, const uint4* __restrict__ gu_e, const uint2* __restrict__ gu_sb_e,
                   const uint4* __restrict__ gu_s, const uint2* __restrict__ gu_sb_s, const uint4* __restrict__ dn_e,
                   const uint2* __restrict__ dn_sb_e, const uint4* __restrict__ dn_s, const uint2* __restrict__ dn_sb_s,
                   int* sel_ids, float* sel_w, const unsigned* __restrict__ uq, const float2* __restrict__ umeta,
                   float* part, unsigned* counts, int* hist_row, unsigned long long* probe, int flags) {
    const calla_moe::ClRoute rt = {sel_ids, sel_w, uq, umeta, nullptr, nullptr, 0.f, nullptr, nullptr};
    calla_moe::cluster_body<4, false>(out, resid, gu_e, gu_sb_e, gu_s, gu_sb_s, dn_e, dn_sb_e, dn_s, dn_sb_s, rt, part,
                                      counts, hist_row, probe, flags);
}
// The same after the output projection with the router folded in (gemv_resid_rf_*): h is the
// residual stream after it (and resid), norm_w the post_attention_layernorm, racc its set of
// sums, racc_zero the next layer's set (zeroed here); no router launch.
extern "C" __global__ void __cluster_dims__(calla_moe::CL, 1, 1) __launch_bounds__(calla_moe::CL_THREADS, 1)
    moe_cluster_fold_e4(float* out, const float* h, const uint4* __restrict__ gu_e, const uint2* __restrict__ gu_sb_e,
                        const uint4* __restrict__ gu_s, const uint2* __restrict__ gu_sb_s, const uint4* __restrict__ dn_e,
                        const uint2* __restrict__ dn_sb_e, const uint4* __restrict__ dn_s,
                        const uint2* __restrict__ dn_sb_s, int* sel_ids, float* sel_w, const float* __restrict__ norm_w,
                        float eps, const double* racc, double* racc_zero, float* part, unsigned* counts, int* hist_row,
                        unsigned long long* probe, int flags, CallaL2Prefetch pf) {
    const calla_moe::ClRoute rt = {sel_ids, sel_w, nullptr, nullptr, h, norm_w, eps, racc, racc_zero};
    calla_moe::cluster_body<4, true>(out, h, gu_e, gu_sb_e, gu_s, gu_sb_s, dn_e, dn_sb_e, dn_s, dn_sb_s, rt, part, counts,
                                     hist_row, probe, flags, pf);
}

// The same after the split output projection (kernels/gdn.cu gdn_step_out_*): x is the
// residual stream before it, updated in place (h = x + acc_h is made here: cluster_body's
// SPLIT), acc its set of sums (router shares, then acc_h at RF_ACC_H), acc_zero the next layer's
// set (zeroed here, acc_h included).
extern "C" __global__ void __cluster_dims__(calla_moe::CL, 1, 1) __launch_bounds__(calla_moe::CL_THREADS, 1)
    moe_cluster_split_e4(float* x, const uint4* __restrict__ gu_e, const uint2* __restrict__ gu_sb_e,
                         const uint4* __restrict__ gu_s, const uint2* __restrict__ gu_sb_s, const uint4* __restrict__ dn_e,
                         const uint2* __restrict__ dn_sb_e, const uint4* __restrict__ dn_s,
                         const uint2* __restrict__ dn_sb_s, int* sel_ids, float* sel_w, const float* __restrict__ norm_w,
                         float eps, const double* acc, double* acc_zero, float* part, unsigned* counts, int* hist_row,
                         unsigned long long* probe, int flags, CallaL2Prefetch pf) {
    const calla_moe::ClRoute rt = {sel_ids, sel_w, nullptr, nullptr, x, norm_w, eps, acc, acc_zero};
    calla_moe::cluster_body<4, true, true>(x, x, gu_e, gu_sb_e, gu_s, gu_sb_s, dn_e, dn_sb_e, dn_s, dn_sb_s, rt, part,
                                           counts, hist_row, probe, flags, pf);
}

// Measurement only (cuda_selftest): n flag barriers (calla_flag_arrive + calla_flag_wait in
// prelude.cuh, epochs base + 1 .. base + n) in a row on the fused kernel's block shape.
extern "C" __global__ void __launch_bounds__(calla_moe::FU_THREADS, 1) moe_flag_barrier_probe(unsigned* flags, int n, unsigned base) {
    calla_pdl_wait();
    for (int i = 0; i < n; ++i) {
        calla_flag_arrive(flags, base + 1u + (unsigned)i);
        calla_flag_wait(flags, base + 1u + (unsigned)i);
    }
}

// Measurement only (cuda_selftest): n grid barriers in a row on the fused kernel's block shape,
// to time one barrier (n = 64 against n = 0).
extern "C" __global__ void __launch_bounds__(calla_moe::FU_THREADS, 1) moe_grid_barrier_probe(unsigned* bar, int n) {
    calla_pdl_wait();
    for (int i = 0; i < n; ++i) calla_moe::grid_sync(bar);
}
