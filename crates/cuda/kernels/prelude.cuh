// Device helpers shared by every kernel file (prepended after the dims header by
// cuda::full_source).

#pragma once

// Programmatic dependent launch (Hopper). A kernel launched with the programmatic-serialization
// attribute may start while the previous kernel in the stream is still running; everything
// before calla_pdl_wait() must not read what the previous kernel writes (weights may be
// prefetched there) and must not write any buffer. Without the attribute both are no-ops.
// Every thread calls calla_pdl_wait() before it exits, so completion stays transitive.
//
// With CALLA_TIMELINE defined (cuda::timeline, `calla cuda-bench --timeline`), thread 0 of every
// block also appends one record to a device log around the wait and stamps the trigger, so the
// host can lay out when each kernel's blocks became resident, were released and triggered.
// The GPU's nanosecond timer (advances in steps of ~256 ns on the H200; docs/CUDA.md).
__device__ __forceinline__ unsigned long long calla_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

#ifdef CALLA_TIMELINE
// Set by the host in every module (cuda::timeline): the log of CALLA_TL_WORDS-word records, its
// append cursor, its capacity in records and an epoch the host bumps at every reset;
// rec == nullptr: off.
struct CallaTimeline {
    unsigned long long* rec;
    unsigned* cursor;
    unsigned cap;
    unsigned epoch;
};
__device__ CallaTimeline calla_tl;
// this block's record (thread 0 only) and a tag that tells it from what an earlier block left in
// the same shared memory
__shared__ unsigned calla_tl_slot, calla_tl_tag;
#define CALLA_TL_WORDS 8
__device__ __forceinline__ unsigned long long calla_gridid() {
    unsigned long long g;
    asm("mov.u64 %0, %%gridid;" : "=l"(g));
    return g;
}
__device__ __forceinline__ bool calla_tl_lead() { return (threadIdx.x | threadIdx.y | threadIdx.z) == 0; }
__device__ __forceinline__ unsigned calla_tl_block() { return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); }
// The grid id is the same in every replay of a graph node; the epoch tells the log's resets apart.
__device__ __forceinline__ unsigned calla_tl_tag_of(unsigned slot, unsigned epoch) {
    return slot ^ (calla_tl_block() * 0x9E3779B9u) ^ (unsigned)calla_gridid() ^ (epoch * 0x85EBCA6Bu) ^ 0xA5A5A5A5u;
}
#endif

// With the probe, thread 0 copies the log's descriptor and takes its slot (one atomic) BEFORE
// the wait, where a block that is resident early has time to spare, and after the wait only
// reads the timer and stores; the trigger reads the timer right after the trigger instruction.
// Kernels trigger only after their wait (the tag check skips a trigger stamp otherwise).
__device__ __forceinline__ void calla_pdl_wait() {
#ifdef CALLA_TIMELINE
    // record: gridid, smid << 32 | block, the kernel's mark and done stamps (calla_tl_mark,
    // calla_tl_done; 0: none), globaltimer at the trigger (0: none), globaltimer before / after
    // the wait, blocks in the grid
    const bool lead = calla_tl_lead();
    CallaTimeline tl = {nullptr, nullptr, 0u, 0u};
    unsigned long long g0 = 0;
    unsigned slot = 0xffffffffu;
    if (lead) {
        tl = calla_tl;
        if (tl.rec != nullptr) {
            g0 = calla_globaltimer();
            slot = atomicAdd(tl.cursor, 1u);
        }
    }
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef CALLA_TIMELINE
    if (lead && tl.rec != nullptr) {
        const unsigned long long g1 = calla_globaltimer();
        calla_tl_slot = slot;
        calla_tl_tag = calla_tl_tag_of(slot, tl.epoch);
        if (slot < tl.cap) {
            unsigned smid;
            asm("mov.u32 %0, %%smid;" : "=r"(smid));
            unsigned long long* r = tl.rec + (size_t)slot * CALLA_TL_WORDS;
            r[0] = calla_gridid();
            r[1] = ((unsigned long long)smid << 32) | calla_tl_block();
            r[2] = 0;
            r[3] = 0;
            r[4] = 0;
            r[5] = g0;
            r[6] = g1;
            r[7] = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
        }
    }
#endif
}
__device__ __forceinline__ void calla_pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" :::);
#ifdef CALLA_TIMELINE
    if (calla_tl_lead()) {
        const unsigned long long t = calla_globaltimer();
        const CallaTimeline tl = calla_tl;
        // the slot is this block's only if its wait ran first in this epoch (the tag says so);
        // the first trigger after the wait wins (r[4] was zeroed by the same thread)
        const unsigned slot = calla_tl_slot;
        if (tl.rec != nullptr && slot < tl.cap && calla_tl_tag == calla_tl_tag_of(slot, tl.epoch)) {
            tl.rec[(size_t)slot * CALLA_TL_WORDS + 4] = t;
            calla_tl_tag = ~calla_tl_tag;
        }
    }
#endif
}

// Phase stamps of the probe (no-ops without CALLA_TIMELINE), called by thread 0 after its wait:
// calla_tl_mark() stores %globaltimer as the block's "mark", a point each kernel that calls it
// defines (the decode GEMVs: the last weights of warp 0 present; the MoE cluster kernel: all of
// the block's expert tiles present), calla_tl_done() as the block's "done" (its work finished).
// The last call of each wins.
__device__ __forceinline__ void calla_tl_stamp(int word) {
#ifdef CALLA_TIMELINE
    if (calla_tl_lead()) {
        const unsigned long long t = calla_globaltimer();
        const CallaTimeline tl = calla_tl;
        const unsigned slot = calla_tl_slot;
        const unsigned tag = calla_tl_tag_of(slot, tl.epoch);
        if (tl.rec != nullptr && slot < tl.cap && (calla_tl_tag == tag || calla_tl_tag == ~tag))
            tl.rec[(size_t)slot * CALLA_TL_WORDS + word] = t;
    }
#else
    (void)word;
#endif
}
__device__ __forceinline__ void calla_tl_mark() { calla_tl_stamp(2); }
__device__ __forceinline__ void calla_tl_done() { calla_tl_stamp(3); }

// bf16 stored as raw 16-bit patterns (no cuda_bf16.h needed under NVRTC).
__device__ __forceinline__ float calla_bf16_to_f32(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
// Round to nearest even (finite inputs; NaN stays NaN).
__device__ __forceinline__ unsigned short calla_f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Four consecutive values (index d4 of a row) of a slot row, as floats: f32 rows or bf16 rows.
__device__ __forceinline__ float4 calla_slot4(const float* __restrict__ row, int d4) {
    return reinterpret_cast<const float4*>(row)[d4];
}
__device__ __forceinline__ float4 calla_slot4(const unsigned short* __restrict__ row, int d4) {
    const uint2 v = reinterpret_cast<const uint2*>(row)[d4];
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}

// One float4 (index d4 of the row) of the prefill's MoE combine for one token:
// resid + (Σ_slot w[slot]·slot_row[slot] + sw·shared), slots in order (fmaf chain); slot rows of
// `stride` values (f32, or bf16 from the down GEMM's mode 5) from `slot_rows`. Shared by gemm.cu's
// qgemm_moe_combine* and rms_norm.cu's moe_combine_norm_acts*, which must agree bit for bit.
template <int TK, typename Slot>
__device__ __forceinline__ float4 calla_moe_combine4(const Slot* __restrict__ slot_rows, size_t stride, int d4,
                                                     const float (&w)[TK], float sw, float4 sh, float4 r) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < TK; ++s) {
        const float4 v = calla_slot4(slot_rows + s * stride, d4);
        acc.x = fmaf(w[s], v.x, acc.x);
        acc.y = fmaf(w[s], v.y, acc.y);
        acc.z = fmaf(w[s], v.z, acc.z);
        acc.w = fmaf(w[s], v.w, acc.w);
    }
    return make_float4(r.x + fmaf(sw, sh.x, acc.x), r.y + fmaf(sw, sh.y, acc.y), r.z + fmaf(sw, sh.z, acc.z),
                       r.w + fmaf(sw, sh.w, acc.w));
}

__device__ __forceinline__ float calla_sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float calla_silu(float x) { return x / (1.0f + __expf(-x)); }

// A grid-wide barrier without atomics, split in two, over co-resident blocks (a cooperative
// launch): calla_flag_arrive publishes `epoch` in this block's word of flags[gridDim.x] once
// every thread of the block is done (st.release); calla_flag_wait returns once every block's
// word has reached `epoch` (warp 0 polls them all with relaxed loads, then one acquire fence).
// Epochs only grow, so no reset: a launch's first wait must be for an epoch its own arrivals
// reach (each word starts at most there). Between the two a block may do work that does not
// read the other blocks' results (issue loads of constant weights). Every thread of the block
// calls both. A wait that has not ended after 2 s of %globaltimer traps (a broken epoch
// contract or a grid that is not resident must fail the launch, not hang the GPU). Used by the
// measurement kernels moe_flag_barrier_probe and gemv_chain_* (1.48 us per arrive + wait on the
// H200).
__device__ __forceinline__ void calla_flag_arrive(unsigned* flags, unsigned epoch) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + blockIdx.x), "r"(epoch) : "memory");
}
__device__ __forceinline__ void calla_flag_wait(const unsigned* flags, unsigned epoch) {
    if (threadIdx.x < 32) {
        bool done = false;
        unsigned long long t0;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        unsigned spins = 0;
        while (!done) {
            if ((++spins & 1023u) == 0u) {
                unsigned long long t;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
                if (t - t0 > 2000000000ull) __trap();
            }
            bool mine = true;
            for (unsigned i = threadIdx.x; i < gridDim.x; i += 32) {
                unsigned v;
                asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flags + i) : "memory");
                mine &= (int)(v - epoch) >= 0;
            }
            done = __all_sync(0xffffffffu, mine);
        }
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    __syncthreads();
}

// Sum over a full warp.
__device__ __forceinline__ float calla_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float calla_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Maximum over a full warp in one instruction (redux.sync).
__device__ __forceinline__ int calla_warp_max_s32(int v) {
    int r;
    asm volatile("redux.sync.max.s32 %0, %1, 0xffffffff;\n" : "=r"(r) : "r"(v));
    return r;
}

// MoE routing of one token by one warp (MODEL.md 3.7): softmax over the CALLA_N_EXPERTS router
// logits at `logits` (max, exp, sum, multiply by 1/sum, as crates/model's softmax_inplace), then
// the CALLA_TOP_K largest probabilities in descending order, ties to the lower id (as
// model::top_k_renorm). Every lane returns the same ids[k] and p[k] (unnormalised; the callers
// renormalise over the k in this order). Lane l holds ids l*PER .. l*PER+PER-1, so the lowest
// lane holding the warp's best key holds the lowest id; a key is p's bits (p >= 0 orders like
// its bits), -1 once taken; per pick one redux.sync and one ballot instead of a butterfly.
__device__ __forceinline__ void calla_router_topk(const float* __restrict__ logits, int lane, int (&ids)[CALLA_TOP_K],
                                                  float (&ps)[CALLA_TOP_K]) {
    constexpr int NE = CALLA_N_EXPERTS, PER = NE / 32;
    static_assert(NE % 32 == 0 && CALLA_TOP_K <= 32, "router layout");
    float l[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) l[i] = logits[lane * PER + i];
    float m = l[0];
#pragma unroll
    for (int i = 1; i < PER; ++i) m = fmaxf(m, l[i]);
    m = calla_warp_max(m);
    float e[PER], s = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        e[i] = expf(l[i] - m);
        s += e[i];
    }
    s = calla_warp_sum(s);
    const float inv = 1.0f / s;
    int key[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) key[i] = __float_as_int(e[i] * inv);
#pragma unroll
    for (int k = 0; k < CALLA_TOP_K; ++k) {
        int best = -1, bi = 0;
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (key[i] > best) {
                best = key[i];
                bi = i;
            }
        const int wbest = calla_warp_max_s32(best);
        const int src = __ffs(__ballot_sync(0xffffffffu, best == wbest)) - 1;  // lowest lane = lowest id
        ids[k] = __shfl_sync(0xffffffffu, lane * PER + bi, src);
        ps[k] = __int_as_float(wbest);
        if (lane == src) {
#pragma unroll
            for (int i = 0; i < PER; ++i)
                if (i == bi) key[i] = -1;
        }
    }
}

// Eight consecutive columns c0 .. c0+7 (c0 = 8 * lane, inside one quantization group) of row
// `id` of an MLX-quantized [n_rows, CALLA_D_MODEL] matrix, dequantized exactly as
// quant::dequantize does (scale·q rounded, then + bias rounded, in f32). An id outside
// [0, n_rows) gives NaN, so a bad token poisons its row visibly instead of reading another one.
// Used by the embedding gathers (step.cu, prefill.cu).
template <int BITS>
__device__ __forceinline__ void calla_dequant_row8(float v[8], const unsigned* __restrict__ packed,
                                                   const unsigned short* __restrict__ scales,
                                                   const unsigned short* __restrict__ biases, int id,
                                                   int n_rows, int lane) {
    constexpr int WPR = CALLA_D_MODEL * BITS / 32;            // packed words per row
    constexpr int GPR = CALLA_D_MODEL / CALLA_QUANT_GROUP;    // groups per row
    static_assert(CALLA_D_MODEL % 8 == 0 && CALLA_QUANT_GROUP % 8 == 0, "8 columns per lane inside one group");
    if (id < 0 || id >= n_rows) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __int_as_float(0x7fc00000);
        return;
    }
    const size_t g = (size_t)id * GPR + (lane * 8) / CALLA_QUANT_GROUP;
    const float s = calla_bf16_to_f32(scales[g]);
    const float b = calla_bf16_to_f32(biases[g]);
    if (BITS == 4) {
        const unsigned w = packed[(size_t)id * WPR + lane];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __fadd_rn(__fmul_rn(s, (float)((w >> (4 * k)) & 15u)), b);
    } else {
        const uint2 w = *reinterpret_cast<const uint2*>(packed + (size_t)id * WPR + 2 * lane);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[k] = __fadd_rn(__fmul_rn(s, (float)((w.x >> (8 * k)) & 255u)), b);
            v[4 + k] = __fadd_rn(__fmul_rn(s, (float)((w.y >> (8 * k)) & 255u)), b);
        }
    }
}

// The stacked GDN in_proj output of one token (MODEL.md §3.5): q | k (N_K_HEADS·D_K each) | v
// (N_V_HEADS·D_V), which are the conv channels, then z (N_V_HEADS·D_V), b, a (N_V_HEADS each).
// Used by the decode step (gdn.cu) and prefill (gdn_prefill.cu); checked against the host's
// cuda::gdn::{GDN_CONV_DIM, GDN_PROJ}, which the dims header carries.
namespace calla_gdn_layout {
constexpr int KEY_DIM = CALLA_N_K_HEADS * CALLA_D_K;
constexpr int CONV_DIM = 2 * KEY_DIM + CALLA_N_V_HEADS * CALLA_D_V;
constexpr int Z_OFF = CONV_DIM;
constexpr int B_OFF = Z_OFF + CALLA_N_V_HEADS * CALLA_D_V;
constexpr int A_OFF = B_OFF + CALLA_N_V_HEADS;
constexpr int PROJ = A_OFF + CALLA_N_V_HEADS;  // floats per token
static_assert(CONV_DIM == CALLA_GDN_CONV_DIM && PROJ == CALLA_GDN_PROJ,
              "GDN in_proj layout differs from crates/cuda/src/gdn.rs");
}  // namespace calla_gdn_layout

// L2 prefetch hints (Hopper cp.async.bulk.prefetch.L2): up to four regions of global memory
// that a LATER kernel of the step will read (e.g. the next projection's weights), handed to a
// kernel that leaves DRAM bandwidth idle (it waits on latency: the MoE router, the GDN step,
// split-K attention), so those bytes are on chip when their reader starts. Hints only: nothing
// depends on them, and they are issued before calla_pdl_wait() (they read no data). Each block
// takes its 1/grid share of every region (256-byte aligned pieces); warp 0's lanes issue 16 KB
// bulk prefetches. Host side: cuda::L2Prefetch (same layout: 4 pointers, 4 byte counts, then
// the progress word below).
// Measured in the decode step (docs/CUDA.md): slower, because a block's bulk prefetches drain
// before it retires, so the decode step leaves the hints empty unless asked (--l2-prefetch).
//
// `progress` (nullptr: none): the L2 follower's progress word (step.cu l2_follow, host
// cuda::follow). The mixer kernels that get one (GDN step, split attention) add 1 to it from
// one thread once their PDL wait has returned, i.e. once the layer's input projection has
// completed; the follower, running beside the step's chain, asks L2 for later weights at those
// points. The MoE cluster kernel after the router fold, when it gets one, adds 1 from every
// block once that block's expert tiles have all landed (moe.cu cluster_body; the follower's
// `in-late` part). A relaxed atomic that nothing in the chain waits for: timing only.
struct CallaL2Prefetch {
    const char* ptr[4];
    unsigned long long bytes[4];
    unsigned* progress;
};

// The bump described above: block 0's thread 0, after calla_pdl_wait().
__device__ __forceinline__ void calla_l2_progress_bump(const CallaL2Prefetch& pf) {
    if (pf.progress != nullptr && (threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) == 0)
        asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(pf.progress) : "memory");
}

// Share B of G of the `bytes` at `p` (256-byte aligned shares), asked of L2 in 16 KB bulk
// prefetches from lane `lane` of 32; with `hint`, under the L2 cache policy `policy`
// (createpolicy). Used by calla_l2_prefetch_share and the L2 follower (step.cu l2_follow).
__device__ __forceinline__ void calla_l2_prefetch_region(const char* p, unsigned long long bytes, unsigned long long G,
                                                         unsigned long long B, unsigned lane, bool hint = false,
                                                         unsigned long long policy = 0) {
    constexpr unsigned long long PIECE = 16384;
    const unsigned long long n = bytes & ~15ull;  // the size operand is a multiple of 16
    if (p == nullptr || n == 0) return;
    const unsigned long long share = ((n + G - 1) / G + 255) & ~255ull;
    const unsigned long long lo = share * B, hi = lo + share < n ? lo + share : n;
    for (unsigned long long o = lo + lane * PIECE; o < hi; o += 32 * PIECE) {
        const unsigned len = (unsigned)(hi - o < PIECE ? hi - o : PIECE);
        unsigned long long g;
        asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(p + o));
        if (hint)
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(g), "r"(len), "l"(policy) : "memory");
        else
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(g), "r"(len) : "memory");
    }
}

__device__ __forceinline__ void calla_l2_prefetch_share(const CallaL2Prefetch& pf) {
    const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    if (tid >= 32) return;
    const unsigned long long G = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
    const unsigned long long B = blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
#pragma unroll
    for (int r = 0; r < 4; ++r) calla_l2_prefetch_region(pf.ptr[r], pf.bytes[r], G, B, tid);
}

// Argmax reductions (sampler::argmax's rules): (bv, bi) <- (v, i) when v is larger, or equal
// with a lower id; NaN never wins (every comparison with NaN is false). Start from (-inf,
// 0x7fffffff). Used by argmax_step (step.cu) and the sampler (sample.cu).
__device__ __forceinline__ void calla_take_better(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}
__device__ __forceinline__ void calla_warp_best(float& bv, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bv, o);
        const int i = __shfl_xor_sync(0xffffffffu, bi, o);
        calla_take_better(bv, bi, v, i);
    }
}
// Best (value, id) of the whole block (blockDim.x a multiple of 32), valid in every thread of
// warp 0. Every thread of the block must call it (two barriers; the second frees the shared
// slots for the next call).
__device__ __forceinline__ void calla_block_best(float& bv, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    calla_warp_best(bv, bi);
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : __uint_as_float(0xff800000u);
        bi = lane < nw ? si[lane] : 0x7fffffff;
        calla_warp_best(bv, bi);
    }
    __syncthreads();
}

// ---- thread-block clusters (sm_90): used by kernels/gdn.cu and kernels/moe.cu

__device__ __forceinline__ unsigned calla_cluster_ctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned calla_cluster_id_x() {
    unsigned r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}
// Arrival that orders nothing: only says "this block has started" (DSMEM may be accessed only in
// blocks that have started and not exited).
__device__ __forceinline__ void calla_cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void calla_cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Full cluster barrier: every thread of every block of the cluster; this block's shared-memory
// writes before it are visible to the cluster after it.
__device__ __forceinline__ void calla_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Shared-memory addresses: this block's (32-bit), and the same offset in block `rank` of the cluster.
__device__ __forceinline__ unsigned calla_smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned calla_mapa_u32(unsigned local, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
    return r;
}
// Reads the float2 at `p` (a __shared__ address of this block) in block `rank` of the cluster.
__device__ __forceinline__ float2 calla_ld_dsmem_f2(const float2* p, unsigned rank) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(calla_mapa_u32(calla_smem_u32(p), rank)) : "memory");
    return v;
}
__device__ __forceinline__ void calla_mbar_wait_phase0(unsigned long long* m) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(calla_smem_u32(m))
                     : "memory");
    }
}
// mbarrier of this block with `count` arrivals per phase (no transaction bytes yet); the
// caller makes it visible (fence + barrier) before anyone waits on it.
__device__ __forceinline__ void calla_mbar_init(unsigned long long* m, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(calla_smem_u32(m)), "r"(count) : "memory");
}
// One arrival on m that also expects `tx_bytes` of asynchronous copies in the current phase.
__device__ __forceinline__ void calla_mbar_arrive_expect_tx(unsigned long long* m, unsigned tx_bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(calla_smem_u32(m)), "r"(tx_bytes)
                 : "memory");
}
// mbarrier of one arrival per phase whose first phase expects `tx_bytes` (e.g. of remote st.async),
// initialised and armed by the calling thread, visible to the cluster.
__device__ __forceinline__ void calla_mbar_init_expect(unsigned long long* m, unsigned tx_bytes) {
    calla_mbar_init(m, 1);
    calla_mbar_arrive_expect_tx(m, tx_bytes);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival on m (release, CTA scope), no transaction bytes.
__device__ __forceinline__ void calla_mbar_arrive(unsigned long long* m) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(calla_smem_u32(m)) : "memory");
}
// Waits until the phase with parity `parity` of m has completed (CTA scope).
__device__ __forceinline__ void calla_mbar_wait_parity(unsigned long long* m, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(calla_smem_u32(m)), "r"(parity)
                     : "memory");
    }
}
// The same, acquiring at cluster scope (arrivals from other blocks of the cluster).
__device__ __forceinline__ void calla_mbar_wait_parity_cluster(unsigned long long* m, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(calla_smem_u32(m)), "r"(parity)
                     : "memory");
    }
}
// Orders this thread's earlier generic-proxy accesses of shared memory before its later
// asynchronous-proxy ones (a bulk copy into a buffer the block just read; cp.async or st.shared
// writes that warpgroup MMAs read after the barrier that follows).
__device__ __forceinline__ void calla_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Warpgroup MMA (wgmma) ordering: the fence before the first wgmma that reads registers written
// since, the commit of the issued wgmma into a group, and the wait until at most N groups are
// pending (the accumulators and shared-memory operands of the others are then free).
__device__ __forceinline__ void calla_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void calla_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void calla_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// A wgmma shared-memory matrix descriptor for the 128-byte-swizzle layout (PTX ISA "Matrix
// Descriptor Format"): start address, leading and stride byte offsets (all >> 4), swizzle mode
// 1 in bits 62-63. `addr` is a shared-state-space address.
__device__ __forceinline__ unsigned long long calla_wgmma_desc_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}
// The descriptor of `addr + bytes` from d, the descriptor of `addr`: the start field is addr / 16
// in the low 14 bits and every shared address stays below 2^18, so the add carries into no other
// field. The same descriptor as rebuilding it from the address, in one add.
__device__ __forceinline__ unsigned long long calla_wgmma_desc_at(unsigned long long d, unsigned bytes) { return d + (bytes >> 4); }
// One bulk copy (TMA) of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global
// `src` into this block's shared memory at `dst`, completing `bytes` on mbarrier m.
__device__ __forceinline__ void calla_bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* m) {
    unsigned long long g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(src));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(calla_smem_u32(dst)),
                 "l"(g), "r"(bytes), "r"(calla_smem_u32(m))
                 : "memory");
}

// The same with an L2 cache policy (createpolicy; e.g. evict_first for bytes read once).
__device__ __forceinline__ void calla_bulk_copy_hint(void* dst, const void* src, unsigned bytes, unsigned long long* m,
                                                     unsigned long long policy) {
    unsigned long long g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(src));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(calla_smem_u32(dst)),
                 "l"(g), "r"(bytes), "r"(calla_smem_u32(m)), "l"(policy)
                 : "memory");
}

// Hint: bring `bytes` (a multiple of 16) at global `p` (16-byte aligned) into L2
// (cp.async.bulk.prefetch.L2; no data comes to the SM).
__device__ __forceinline__ void calla_prefetch_l2(const void* p, unsigned bytes) {
    unsigned long long g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(p));
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(g), "r"(bytes) : "memory");
}

// Stores v at `dst` (a __shared__ address of this block) in block `rank` of the cluster and
// counts 4 bytes on that block's mbarrier `m` (the complete-tx has release semantics at
// cluster scope).
__device__ __forceinline__ void calla_st_async_f32(float* dst, unsigned long long* m, unsigned rank, float v) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(calla_mapa_u32(calla_smem_u32(dst), rank)),
                 "r"(__float_as_uint(v)), "r"(calla_mapa_u32(calla_smem_u32(m), rank))
                 : "memory");
}
// The same for 16 bytes (dst 16-byte aligned; counts 16 bytes) and 8 bytes (dst 8-byte aligned).
__device__ __forceinline__ void calla_st_async_u4(void* dst, unsigned long long* m, unsigned rank, uint4 v) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(calla_mapa_u32(calla_smem_u32(dst), rank)),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(calla_mapa_u32(calla_smem_u32(m), rank))
                 : "memory");
}
__device__ __forceinline__ void calla_st_async_u2(void* dst, unsigned long long* m, unsigned rank, uint2 v) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(calla_mapa_u32(calla_smem_u32(dst), rank)),
                 "r"(v.x), "r"(v.y), "r"(calla_mapa_u32(calla_smem_u32(m), rank))
                 : "memory");
}
