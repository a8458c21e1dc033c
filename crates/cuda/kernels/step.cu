// Decode-step bookkeeping on the device, so that a whole step (and the prompt, token by token)
// replays from one CUDA graph with no host value changing between replays:
//
// * embed_gather_q{4,8}: x[0..D_MODEL] = dequantized row ids[pos[0]] of the quantized embedding
//   (MODEL.md §3.3), computed as quant::dequantize does: scale * q rounded, then + bias rounded
//   (no fused multiply-add), so the row is bit-identical to the CPU one.
// * argmax_step: t = argmax(logits[0..vocab_limit)) (ties -> lowest id, NaN never wins, no
//   non-NaN value -> 0: sampler::argmax), then ids[pos+1] = t when pos+1 is past the prompt
//   (pos+1 >= n_fixed[0]) and inside the history (pos+1 < max_ctx), then pos[0] += 1.
//   Many blocks: each reduces a grid-stride share to (value, id) in the scratch, the last block to
//   finish (an atomic ticket) reduces the partials, writes, and resets the ticket to 0 so the next
//   launch or graph replay starts clean.
// * advance_pos: pos[0] += 1 (a prompt step that skips the LM head).
//
// Dims from the generated header.

#ifndef CALLA_D_MODEL
#error "dims header missing"
#endif

namespace calla_step {

constexpr int ARGMAX_THREADS = 512;
constexpr int ARGMAX_MAX_BLOCKS = 256; // crates/cuda/src/step.rs ARGMAX_MAX_BLOCKS
constexpr int NONE = 0x7fffffff;       // "no candidate yet" (loses every tie)
#define CALLA_NEG_INF __uint_as_float(0xff800000u)

// Scratch words: [0, MAXB) best values (f32 bits), [MAXB, 2 MAXB) their ids, [2 MAXB] ticket.
constexpr int SCRATCH_IDS = ARGMAX_MAX_BLOCKS;
constexpr int SCRATCH_TICKET = 2 * ARGMAX_MAX_BLOCKS;


template <int BITS>
__device__ __forceinline__ void embed_body(float* __restrict__ x, const unsigned* __restrict__ packed,
                                           const unsigned short* __restrict__ scales,
                                           const unsigned short* __restrict__ biases, const int* __restrict__ ids,
                                           const int* __restrict__ pos, int n_ids, int n_rows) {
    calla_pdl_wait(); // ids and pos are written by earlier kernels
    const int c0 = threadIdx.x * 8;
    const int p = __ldcg(pos);
    const int id = (p >= 0 && p < n_ids) ? __ldcg(ids + p) : -1;
    float v[8];
    // a bad position or token id poisons the step visibly instead of reading another row
    calla_dequant_row8<BITS>(v, packed, scales, biases, id, n_rows, threadIdx.x);
    calla_pdl_launch_dependents();
    float4* xo = reinterpret_cast<float4*>(x + c0);
    xo[0] = make_float4(v[0], v[1], v[2], v[3]);
    xo[1] = make_float4(v[4], v[5], v[6], v[7]);
}

}  // namespace calla_step

// One block of D_MODEL / 8 threads. ids: [n_ids] token history, pos: [1].
extern "C" __global__ void __launch_bounds__(CALLA_D_MODEL / 8)
embed_gather_q4(float* __restrict__ x, const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales,
                const unsigned short* __restrict__ biases, const int* __restrict__ ids, const int* __restrict__ pos,
                int n_ids, int n_rows) {
    calla_step::embed_body<4>(x, packed, scales, biases, ids, pos, n_ids, n_rows);
}
extern "C" __global__ void __launch_bounds__(CALLA_D_MODEL / 8)
embed_gather_q8(float* __restrict__ x, const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales,
                const unsigned short* __restrict__ biases, const int* __restrict__ ids, const int* __restrict__ pos,
                int n_ids, int n_rows) {
    calla_step::embed_body<8>(x, packed, scales, biases, ids, pos, n_ids, n_rows);
}

// ARGMAX_THREADS threads, at most ARGMAX_MAX_BLOCKS blocks. scratch: SCRATCH_TICKET + 1 words,
// the ticket zero before the launch (it is left zero after it).
extern "C" __global__ void __launch_bounds__(calla_step::ARGMAX_THREADS)
argmax_step(const float* __restrict__ logits, int vocab_limit, int* __restrict__ ids, int max_ctx,
            const int* __restrict__ n_fixed, int* __restrict__ pos, unsigned* __restrict__ scratch) {
    using namespace calla_step;
    calla_pdl_wait(); // the logits come from the LM head
    float bv = CALLA_NEG_INF;
    int bi = NONE;
    const int stride = gridDim.x * blockDim.x;
#pragma unroll 4
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vocab_limit; i += stride) {
        // ids grow along the loop, so an equal value never replaces; the first -inf is taken
        const float v = __ldcg(logits + i);
        if (v > bv || (v == bv && bi == NONE)) {
            bv = v;
            bi = i;
        }
    }
    calla_pdl_launch_dependents();
    calla_block_best(bv, bi);
    __shared__ bool last;
    if (threadIdx.x == 0) {
        scratch[blockIdx.x] = __float_as_uint(bv);
        scratch[SCRATCH_IDS + blockIdx.x] = (unsigned)bi;
        __threadfence(); // the partial is visible before the ticket is taken
        last = atomicAdd(scratch + SCRATCH_TICKET, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence(); // every other block's partial is visible now
    if (threadIdx.x < 32) {
        bv = CALLA_NEG_INF;
        bi = NONE;
        for (int b = threadIdx.x; b < (int)gridDim.x; b += 32)
            calla_take_better(bv, bi, __uint_as_float(__ldcg(scratch + b)), (int)__ldcg(scratch + SCRATCH_IDS + b));
        calla_warp_best(bv, bi);
        if (threadIdx.x == 0) {
            const int tok = bi == NONE ? 0 : bi;
            const int next = __ldcg(pos) + 1;
            if (next >= __ldcg(n_fixed) && next >= 0 && next < max_ctx) ids[next] = tok;
            pos[0] = next;
            scratch[SCRATCH_TICKET] = 0u; // every block has taken its ticket: ready for the next launch
        }
    }
}

// One thread.
extern "C" __global__ void advance_pos(int* __restrict__ pos) {
    calla_pdl_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) pos[0] += 1;
}

// The L2 follower (host: cuda::follow, CudaSession::set_l2_follow): a root node of the decode
// step's graph, beside the chain of kernels and never waited for by any of them, that asks L2
// for weights the chain reads later, at points the chain signals. The mixer kernels (GDN step,
// split attention) add 1 to `progress` once their PDL wait returns, i.e. once the layer's input
// projection has completed (calla_l2_progress_bump, prelude.cuh); with the plan's in-late part
// every block of the MoE cluster kernel after the router fold adds 1 once its expert tiles have
// landed (moe.cu cluster_body). Entry j is asked for once
// `progress` has advanced by entries[j].trigger since this block's `base`: weights stream into
// L2 while the GDN step and the output projection leave DRAM mostly idle (the default plan: the
// layer's and the next layer's output projections; docs/CUDA.md "L2 follower").
//
// Grid: G blocks of 32 threads; block b asks for its 1/G share of every entry (256-byte
// aligned, 16 KB bulk prefetches from its lanes). Only hints: no result depends on this kernel.
// base[b]: `progress` at the start of this replay as block b counts it (the host zeroes both
// between captures). Every replay bumps exactly `total` times (the host checks it when it
// captures), so block b waits for `total` bumps and stores base[b] + total. Entries are in
// trigger order. A block that has waited `timeout_ns` in all stops waiting and asks for the
// rest at once (a chain held back for that long, e.g. kernels serialised by a profiler): that
// replay's hints come early, and base[b] + total keeps the next replay in step.
// flags: FOLLOW_EVICT_LAST: the prefetches carry an L2 evict_last policy.
namespace calla_step {
constexpr int FOLLOW_EVICT_LAST = 1;
struct FollowEntry {
    const char* ptr;
    unsigned long long bytes;
    unsigned long long trigger;
};
__device__ __forceinline__ unsigned follow_poll(const unsigned* progress) {
    unsigned v = 0;
    if ((threadIdx.x & 31) == 0) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(progress) : "memory");
    return __shfl_sync(0xffffffffu, v, 0);
}
}  // namespace calla_step

extern "C" __global__ void __launch_bounds__(32)
l2_follow(const calla_step::FollowEntry* __restrict__ entries, int n, const unsigned* progress, unsigned* base,
          unsigned total, unsigned long long timeout_ns, int flags) {
    using namespace calla_step;
    const unsigned lane = threadIdx.x;
    const unsigned b0 = base[blockIdx.x];
    const unsigned long long t0 = calla_globaltimer();
    bool late = false;  // timed out: stop waiting
    unsigned seen = follow_poll(progress);
    unsigned long long policy = 0;
    if (flags & FOLLOW_EVICT_LAST) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    for (int j = 0; j <= n; ++j) {
        const unsigned long long want = j < n ? entries[j].trigger : total;
        while (!late && (unsigned long long)(seen - b0) < want) {
            __nanosleep(64);
            seen = follow_poll(progress);
            // lane 0's clock decides for the warp (follow_poll's shuffle needs every lane)
            late = __shfl_sync(0xffffffffu, (int)(calla_globaltimer() - t0 > timeout_ns), 0) != 0;
        }
        if (j == n) break;
        const FollowEntry e = entries[j];
        calla_l2_prefetch_region(e.ptr, e.bytes, gridDim.x, blockIdx.x, lane, flags & FOLLOW_EVICT_LAST, policy);
    }
    if (lane == 0) base[blockIdx.x] = b0 + total;
}
