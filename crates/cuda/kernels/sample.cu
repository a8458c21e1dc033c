// On-device sampling at the end of a decode step: the token `sampler::Sampler::sample` would pick
// (crates/sampler/src/sampler.rs), bit for bit, with the ids/pos/n_fixed contract of
// argmax_step (step.cu), so that a captured decode graph can sample instead of taking the argmax.
//
// Four launches, all with the same arguments (host: crates/cuda/src/sample.rs):
//
//   sample_prep    G blocks x 512: steps 1-3 of Sampler::sample in place (ids >= n set to -inf,
//                  repetition / presence / frequency penalties for the tokens the sampler picked
//                  before, from the per-token counts), the argmax of the penalised row, and for
//                  top-k the count histogram of the top 12 bits of each logit's order key. The
//                  last block (atomic ticket) decides the mode: SKIP (a prompt position: nothing
//                  is sampled, no random number is used), DONE (greedy, vocab_limit 0, or a row
//                  with no value above -inf: the argmax), SPARSE (top-k) or DENSE; its thread 32
//                  draws the ChaCha20 u64 of this call (non-greedy, n > 0) while warp 0 reduces
//                  the argmax; for top-k the block finds the histogram bucket that holds the k-th
//                  largest logit (parallel integer prefix over the bins).
//   sample_weights G blocks x 512: w[i] = exp_neg((clean(x[i]) - max) / temperature), the CPU's
//                  Cand::w. DENSE with top-p: the mass histogram of the top 9 bits of w (exact
//                  integer sums, see below); the last block stages it in shared memory, lists the
//                  non-empty buckets heaviest first with their masses (in parallel) and one thread
//                  adds them in that order (Sampler::dense_top_p's total and first `crossing`).
//                  SPARSE: the ids of the k-th largest's bucket are listed and the last block
//                  finds the k-th largest logit `thr` exactly (radix select over their keys,
//                  copied into shared memory once; each pass's bin found by a warp-wide integer
//                  prefix).
//   sample_select  G blocks x 512: SPARSE: the candidates (clean(x) >= thr, w > 0) in id order
//                  (per-block segments, gathered by all threads of the last block: a scan of the
//                  segment lengths, then one candidate per thread); the last block runs
//                  Sampler::plan_top_k's top-p and min-p, and draw_sparse. DENSE with top-p: the
//                  ids of the crossing bucket; the last block (their weights staged in shared
//                  memory when at most WCAP) refines it on the next 11 and the last 11 bits (the
//                  CPU's two refinements; each crossing added by one thread over the listed
//                  non-empty bins), cuts the tokens of weight exactly w* by rank, sets w_min.
//   sample_draw    ceil(ceil(n / 1024) / 8) blocks x 256: DENSE: the CPU's draw_dense block
//                  sums (one warp per block of 1024 ids, staged in shared memory; lanes 0..7 sum
//                  ids j, j+8, ... in order, then the lanes 0..7 and the remainder), and in the
//                  last block the inverse-CDF walk: one thread adds the block sums in order from
//                  shared memory keeping each running sum (the same values the CPU's crossing
//                  compares), all threads find the crossing block from them, one thread walks
//                  it. Every mode: ids[q] = token, counts[token] += 1, pos = q (q = pos + 1;
//                  SKIP only advances pos).
//
// Bit-exactness. Every f32/f64 operation is the CPU's, in the CPU's order, with the _rn
// intrinsics (NVRTC is called with --fmad=true; the intrinsics are never contracted, and no
// flush-to-zero is requested, so subnormal weights are kept). Sums whose order the GPU cannot
// follow are sums the CPU computes exactly in f64, so any order gives the same value:
//   * a histogram bucket of the top 9 bits of w (or a refinement bucket inside one) holds values
//     with one exponent, all multiples of that exponent's f32 ulp, at most one per row entry
//     (the host refuses rows > 2^24, SAMPLE_MAX_ROWS): the sum fits 24 + 24 = 48 bits of a
//     double. The GPU adds the integer significands (u64) and scales once.
//   * the tokens of weight exactly w*: j * w* is exact for every j (24 + 24 bits).
//   * top-k candidates whose weights are all multiples of g = 2^emin with count * 2^-emin <= 2^53
//     (for instance when every candidate has the same weight, as in a row of equal logits): every
//     partial sum is exact, so the GPU uses parallel integer prefix sums there.
// Everything else follows the CPU's order exactly: the totals and walks over ids (one thread, in
// id order), the block sums of the dense draw, the crossings (heaviest bucket first), and the
// top-p prefix over the candidates sorted by rank when there are at most 64 of them (the CPU
// sorts such a window outright). Such a sequential sum reads shared memory that all threads
// filled first, and the running sums it produces may be searched in parallel afterwards (empty
// bins, which the CPU skips, are left out of the list it adds); only its adds are serial. The one place the GPU cannot follow the CPU: top-p over more
// than 64 top-k candidates whose sums are not exact. The CPU's nucleus_len sums each half-window
// in the order std's select_nth_unstable leaves it; the GPU sums the same sets in rank order, so
// the nucleus can differ only when its mass lies within ~1e-16 (relative) of the target.
//
// ChaCha20 as rand_chacha's ChaCha20Rng::from_seed(key): state = "expand 32-byte k", the key as 8
// little-endian words, a 64-bit block counter in words 12-13 and stream 0 in words 14-15; 20
// rounds; output words in order; next_u64 takes two consecutive words, low word first. The k-th
// next_u64 of a fresh generator is words 2k and 2k+1 of the keystream: block k / 8, words
// 2 (k % 8) and 2 (k % 8) + 1. The host expands the seed into the key (SplitMix64, as
// sampler::math::expand_seed) and checks this emulation against rand_chacha (unit tests).
//
// State (device memory, so a graph replays with no host value changing): `ctl` holds the
// parameters and the key (written by the host at reset), the RNG position (u64 outputs used so
// far; advanced here), the per-step values passed between the launches, the tickets, per-block
// partials and two histograms; all tickets, histograms and list lengths are zero between steps.
// `counts[rows]`: how often each id was picked past the prompt (Sampler::accept).

#ifndef CALLA_D_MODEL
#error "dims header missing"
#endif

namespace calla_sample {

constexpr int THREADS = 512;          // threads of sample_prep / _weights / _select
constexpr int DRAW_THREADS = 256;     // threads of sample_draw (8 warps, one draw block each)
constexpr int MAX_BLOCKS = 256;       // most blocks of the first three launches
constexpr int KEY_SHIFT = 20;         // order-key histogram: top 12 bits
constexpr int KEY_BINS = 1 << (32 - KEY_SHIFT);
constexpr int TOP_BINS = 512;         // Sampler::dense_top_p: top 9 bits of w (>> 22)
constexpr int TOP_SHIFT = 22;
constexpr int LOW_BITS = 11;          // its two refinements, 11 bits each
constexpr int LOW_BINS = 1 << LOW_BITS;
constexpr int DRAW_BLOCK = 1024;      // sampler.rs DRAW_BLOCK
constexpr int DRAW_WARPS = DRAW_THREADS / 32;  // sample_draw: one draw block per warp
constexpr int DRAW_SCAP = DRAW_WARPS * DRAW_BLOCK / 4;  // most block sums the last block stages (2 doubles each)
static_assert(DRAW_THREADS % 32 == 0 && 2 * DRAW_SCAP * 8 == DRAW_WARPS * DRAW_BLOCK * 4, "sample_draw staging");
constexpr int NUCLEUS_SORT_LEN = 64;  // sampler.rs NUCLEUS_SORT_LEN
constexpr int TOPK_CAP = 1024;        // most top-k candidates above the k-th value (top_k <= 1024)
constexpr int SCAP = 1 << 11;         // candidates kept in shared memory (more: read from global)
constexpr int KCACHE = 1 << 12;         // keys of sample_weights' radix select kept in shared memory
constexpr int WCAP = 1 << 12;           // dense_tp_finish: weight bits of the bucket's ids in shared memory
constexpr int NONE = 0x7fffffff;
constexpr unsigned FULL = 0xffffffffu;

// ctl layout (u32 words; crates/cuda/src/sample.rs mirrors it)
constexpr int C_TEMP = 0, C_TOP_P = 1, C_MIN_P = 2, C_PRES = 3, C_FREQ = 4, C_REP = 5, C_TOP_K = 6;
constexpr int C_KEY = 8;       // 8 words
constexpr int C_CALLS = 16;    // u64: next_u64 calls so far
constexpr int C_MODE = 20, C_Q = 21, C_TOKEN = 22, C_ARGMAX = 23, C_MAXC = 24, C_KTHR = 25;
constexpr int C_SEL_BIN = 26, C_SEL_NEED = 27, C_WMIN = 28, C_LIST_LEN = 29, C_TP_ON = 30, C_TP_B1 = 31;
constexpr int C_U = 32;        // f64: the uniform of this call
constexpr int C_TP_TARGET = 34, C_TP_ABOVE = 36;  // f64
constexpr int C_TICKET = 40;   // 4 words: one per launch
constexpr int C_PART_MAX = 64;
constexpr int C_PART_IDX = C_PART_MAX + MAX_BLOCKS;
constexpr int C_PART_CNT = C_PART_IDX + MAX_BLOCKS;
constexpr int C_KHIST = C_PART_CNT + MAX_BLOCKS;  // KEY_BINS u32
constexpr int C_WHIST = C_KHIST + KEY_BINS;       // TOP_BINS u64
constexpr int CTL_WORDS = C_WHIST + 2 * TOP_BINS;
static_assert(CTL_WORDS == 5952, "ctl layout differs from crates/cuda/src/sample.rs");
static_assert(C_WHIST % 2 == 0 && C_U % 2 == 0 && C_CALLS % 2 == 0, "8-byte fields");
static_assert(KEY_BINS % THREADS == 0, "whole bins per thread");

constexpr unsigned MODE_SKIP = 1, MODE_DONE = 2, MODE_DENSE = 3, MODE_SPARSE = 4;

#define CS_NEG_INF __uint_as_float(0xff800000u)
#define CS_FLT_MAX __uint_as_float(0x7f7fffffu)

struct Params {
    float temperature, top_p, min_p, presence, frequency, repetition;
    unsigned top_k;
};

__device__ __forceinline__ Params load_params(const unsigned* ctl) {
    Params p;
    p.temperature = __uint_as_float(ctl[C_TEMP]);
    p.top_p = __uint_as_float(ctl[C_TOP_P]);
    p.min_p = __uint_as_float(ctl[C_MIN_P]);
    p.presence = __uint_as_float(ctl[C_PRES]);
    p.frequency = __uint_as_float(ctl[C_FREQ]);
    p.repetition = __uint_as_float(ctl[C_REP]);
    p.top_k = ctl[C_TOP_K];
    return p;
}

__device__ __forceinline__ double ld_f64(const unsigned* p) { return __ldcg(reinterpret_cast<const double*>(p)); }
__device__ __forceinline__ void st_f64(unsigned* p, double v) { *reinterpret_cast<double*>(p) = v; }

// ---------------------------------------------------------------------------------------------
// Scalar math of crates/sampler/src/math.rs

// sampler::math::clean: NaN -> -inf, +inf -> f32::MAX.
__device__ __forceinline__ float clean(float x) { return x != x ? CS_NEG_INF : fminf(x, CS_FLT_MAX); }

// Order-preserving key of a non-NaN f32, the order of f32::total_cmp (-0 below +0).
__device__ __forceinline__ unsigned okey(float x) {
    const unsigned b = __float_as_uint(x);
    return b ^ ((b & 0x80000000u) ? 0xffffffffu : 0x80000000u);
}
__device__ __forceinline__ float okey_inv(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

// sampler::math::exp_neg, operation by operation (constants as their f32 bit patterns).
__device__ __forceinline__ float exp_neg(float z) {
    const float LOG2E = __uint_as_float(0x3fb8aa3bu);
    const float LN2_HI = __uint_as_float(0x3f318000u);
    const float LN2_LO = __uint_as_float(0xb95e8083u);
    const float P0 = __uint_as_float(0x39506967u);
    const float P1 = __uint_as_float(0x3ab743ceu);
    const float P2 = __uint_as_float(0x3c088908u);
    const float P3 = __uint_as_float(0x3d2aa9c1u);
    const float P4 = __uint_as_float(0x3e2aaaaau);
    const float P5 = __uint_as_float(0x3f000000u);
    const float ROUND = __uint_as_float(0x4b400000u);
    const float CUTOFF = -87.0f;
    float zc = z > CUTOFF ? z : CUTOFF;  // NaN -> CUTOFF
    zc = zc < 0.0f ? zc : 0.0f;
    const float t = __fadd_rn(__fmul_rn(zc, LOG2E), ROUND);
    const float nf = __fsub_rn(t, ROUND);
    const int n = (int)(__float_as_uint(t) - __float_as_uint(ROUND));
    const float r = __fsub_rn(__fsub_rn(zc, __fmul_rn(nf, LN2_HI)), __fmul_rn(nf, LN2_LO));
    float poly = __fadd_rn(__fmul_rn(P0, r), P1);
    poly = __fadd_rn(__fmul_rn(poly, r), P2);
    poly = __fadd_rn(__fmul_rn(poly, r), P3);
    poly = __fadd_rn(__fmul_rn(poly, r), P4);
    poly = __fadd_rn(__fmul_rn(poly, r), P5);
    const float y = __fadd_rn(__fadd_rn(__fmul_rn(poly, __fmul_rn(r, r)), r), 1.0f);
    const float scale = __uint_as_float((unsigned)(n + 127) << 23);
    const float e = __fmul_rn(y, scale);
    return z > CUTOFF ? e : 0.0f;
}

// Sampler's Scale::apply: d * (1 / t) when 1 / t is finite, d / t otherwise.
struct Scale {
    float t, inv;
    bool use_inv;
    __device__ __forceinline__ explicit Scale(float temperature) {
        t = temperature;
        inv = __fdiv_rn(1.0f, temperature);
        use_inv = (__float_as_uint(inv) & 0x7f800000u) != 0x7f800000u;
    }
    __device__ __forceinline__ float apply(float d) const { return use_inv ? __fmul_rn(d, inv) : __fdiv_rn(d, t); }
};

// The CPU's Cand::w of a logit x (already penalised) given the row's clean maximum.
__device__ __forceinline__ float weight_of(float x, float maxc, const Scale& s) {
    return exp_neg(s.apply(__fsub_rn(clean(x), maxc)));
}

// Steps 2-3 of Sampler::sample for a token generated `c` >= 1 times (apply_penalties).
// A NaN is returned as it is: the CPU's arithmetic propagates its bits (payload and sign), the
// GPU's would replace it by the canonical NaN (measured: rows of NaN logits came back changed).
__device__ __forceinline__ float penalize(float x, unsigned c, const Params& p) {
    if (x != x) return x;
    if (p.repetition != 1.0f) x = x > 0.0f ? __fdiv_rn(x, p.repetition) : __fmul_rn(x, p.repetition);
    if (p.presence != 0.0f || p.frequency != 0.0f)
        x = __fsub_rn(x, __fadd_rn(__fmul_rn(__uint2float_rn(c), p.frequency), p.presence));
    return x;
}

// sampler::math::unit_f64: the top 53 bits as a uniform double in [0, 1).
__device__ __forceinline__ double unit_f64(unsigned long long bits) {
    return __dmul_rn(__ull2double_rn(bits >> 11), 1.0 / 9007199254740992.0);  // 2^-53
}

// 2^e as a double, -1022 <= e <= 1023.
__device__ __forceinline__ double exp2i(int e) { return __longlong_as_double((long long)(e + 1023) << 52); }

// A positive f32 as significand * 2^exponent (significand < 2^24, exponent >= -149).
__device__ __forceinline__ unsigned sig_of(unsigned bits) {
    const unsigned e = bits >> 23, m = bits & 0x7fffffu;
    return e ? (m | 0x800000u) : m;
}
__device__ __forceinline__ int exp_of(unsigned bits) {
    const int e = (int)(bits >> 23);
    return (e ? e : 1) - 150;
}
// Exponent of the lowest set bit of a positive f32.
__device__ __forceinline__ int lowbit_exp(float w) {
    const unsigned b = __float_as_uint(w);
    return exp_of(b) + __ffs((int)sig_of(b)) - 1;
}
// w / 2^emin as an integer (emin <= lowbit_exp(w); the caller keeps the result below 2^53).
__device__ __forceinline__ unsigned long long units_of(float w, int emin) {
    const unsigned b = __float_as_uint(w);
    const int sh = exp_of(b) - emin;
    const unsigned long long s = sig_of(b);
    return sh >= 0 ? s << sh : s >> (-sh);
}

// ChaCha20 block `counter` of `key` (rand_chacha's layout, see the top of the file).
__device__ __forceinline__ unsigned rotl32(unsigned x, int r) { return (x << r) | (x >> (32 - r)); }
#define CS_QR(a, b, c, d)                                  \
    x[a] += x[b]; x[d] = rotl32(x[d] ^ x[a], 16);          \
    x[c] += x[d]; x[b] = rotl32(x[b] ^ x[c], 12);          \
    x[a] += x[b]; x[d] = rotl32(x[d] ^ x[a], 8);           \
    x[c] += x[d]; x[b] = rotl32(x[b] ^ x[c], 7);

// The `call`-th next_u64 (0-based) of ChaCha20Rng::from_seed(key).
__device__ unsigned long long chacha_u64(const unsigned* key, unsigned long long call) {
    const unsigned long long block = call >> 3;
    unsigned s[16] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u,
                      key[0], key[1], key[2], key[3], key[4], key[5], key[6], key[7],
                      (unsigned)block, (unsigned)(block >> 32), 0u, 0u};
    unsigned x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = s[i];
#pragma unroll 1
    for (int r = 0; r < 10; ++r) {
        CS_QR(0, 4, 8, 12) CS_QR(1, 5, 9, 13) CS_QR(2, 6, 10, 14) CS_QR(3, 7, 11, 15)
        CS_QR(0, 5, 10, 15) CS_QR(1, 6, 11, 12) CS_QR(2, 7, 8, 13) CS_QR(3, 4, 9, 14)
    }
    const int w = 2 * (int)(call & 7);
    unsigned lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const unsigned o = x[i] + s[i];
        if (i == w) lo = o;
        if (i == w + 1) hi = o;
    }
    return ((unsigned long long)hi << 32) | lo;
}
#undef CS_QR

// ---------------------------------------------------------------------------------------------
// Block helpers

// Block b of the first three launches owns ids [b * chunk, (b + 1) * chunk) of [0, rows).
__device__ __forceinline__ int chunk_len(int rows) {
    const int per = (rows + (int)gridDim.x - 1) / (int)gridDim.x;
    return (per + THREADS - 1) / THREADS * THREADS;
}

__device__ __forceinline__ unsigned lanemask_lt() {
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

// Exclusive prefix sum over the block in thread order; `total` gets the block's sum. Every
// thread of the block must call it (it synchronises).
template <class T>
__device__ T block_exclusive_scan(T v, T& total) {
    __shared__ T s_warp[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T u = __shfl_up_sync(FULL, incl, o);
        if (lane >= o) incl += u;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        T w = lane < nw ? s_warp[lane] : (T)0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T u = __shfl_up_sync(FULL, w, o);
            if (lane >= o) w += u;
        }
        if (lane < nw) s_warp[lane] = w;
    }
    __syncthreads();
    const T base = warp > 0 ? s_warp[warp - 1] : (T)0;
    total = s_warp[nw - 1];
    __syncthreads();  // s_warp is reused by the next call
    return base + incl - v;
}

template <class T>
__device__ __forceinline__ T block_sum(T v) {
    T total;
    block_exclusive_scan<T>(v, total);
    return total;
}

// The bin of 256 counts h where the running count (bins in order) reaches m: the first b < 255
// with h[0] + .. + h[b] >= m, else 255; `acc` gets h[0] + .. + h[b - 1]. Warp 0 calls it (all
// 32 lanes): lane l owns bins 8l .. 8l + 7, the lane whose running count first reaches m (a
// ballot over the integer prefixes) walks its 8 bins in order, as one thread over all 256 would.
// True in that lane only, which alone gets out_b and out_acc.
__device__ __forceinline__ bool select_bin(const unsigned* h, unsigned m, unsigned& out_b, unsigned& out_acc) {
    const int lane = threadIdx.x & 31;
    unsigned hv[8];
    unsigned loc = 0u;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        hv[k] = h[8 * lane + k];
        loc += hv[k];
    }
    unsigned incl = loc;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned u = __shfl_up_sync(FULL, incl, o);
        if (lane >= o) incl += u;
    }
    const unsigned bal = __ballot_sync(FULL, incl >= m);
    const int owner = bal ? __ffs((int)bal) - 1 : 31;  // none: bin 255, counted from lane 31
    if (lane == owner) {
        unsigned acc = incl - loc, b = 8u * (unsigned)lane;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (b == 255u || acc + hv[k] >= m) break;
            acc += hv[k];
            ++b;
        }
        out_b = b;
        out_acc = acc;
        return true;
    }
    return false;
}

// The key of rank m (1-based: the m-th smallest) among the valid keys of list entries
// j in [0, len), where key_of(j, key) says whether entry j takes part. Radix select, 8 bits a
// pass. Requires 1 <= m <= the number of valid entries. Every thread must call it.
template <class KeyOf>
__device__ unsigned radix_select(unsigned len, unsigned m, KeyOf key_of) {
    __shared__ unsigned s_h[256];
    __shared__ unsigned s_res[2];
    unsigned prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) s_h[b] = 0u;
        __syncthreads();
        for (unsigned j = threadIdx.x; j < len; j += blockDim.x) {
            unsigned key;
            if (key_of(j, key) && (key & mask) == prefix) atomicAdd(&s_h[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            unsigned b, acc;
            if (select_bin(s_h, m, b, acc)) {
                s_res[0] = prefix | (b << shift);
                s_res[1] = m - acc;
            }
        }
        __syncthreads();
        prefix = s_res[0];
        m = s_res[1];
        mask |= 255u << shift;
    }
    __syncthreads();  // s_res is read before anyone may call again
    return prefix;
}

// radix_select, with the valid keys first copied into `cache` (shared, `cap` entries) when
// len <= cap, so that the four passes read shared memory instead of calling key_of (global
// loads) again. The histogram counts do not depend on the order of the copy.
template <class KeyOf>
__device__ unsigned block_select(unsigned len, unsigned m, KeyOf key_of, unsigned* cache, unsigned cap) {
    if (len > cap) return radix_select(len, m, key_of);
    __shared__ unsigned s_cnt;
    if (threadIdx.x == 0) s_cnt = 0u;
    __syncthreads();
    for (unsigned b0 = 0; b0 < len; b0 += blockDim.x) {  // whole warps: warp-aggregated slots
        const unsigned j = b0 + threadIdx.x;
        unsigned key = 0u;
        const bool v = j < len && key_of(j, key);
        const unsigned bal = __ballot_sync(FULL, v);
        if (bal == 0u) continue;
        const int leader = __ffs((int)bal) - 1;
        unsigned base = 0u;
        if ((int)(threadIdx.x & 31) == leader) base = atomicAdd(&s_cnt, (unsigned)__popc(bal));
        base = __shfl_sync(FULL, base, leader);
        if (v) cache[base + __popc(bal & lanemask_lt())] = key;
    }
    __syncthreads();
    const unsigned cnt = s_cnt;  // radix_select synchronises before anyone may reset s_cnt
    return radix_select(cnt, m, [&](unsigned j, unsigned& key) {
        key = cache[j];
        return true;
    });
}

// Appends `i` to list[ctl[C_LIST_LEN]++] when `hit` (order not kept). Whole warps call it.
__device__ __forceinline__ void warp_append(bool hit, unsigned i, unsigned* ctl, unsigned* list) {
    const unsigned m = __ballot_sync(FULL, hit);
    if (m == 0u) return;
    const int leader = __ffs((int)m) - 1;
    unsigned base = 0u;
    if ((int)(threadIdx.x & 31) == leader) base = atomicAdd(ctl + C_LIST_LEN, (unsigned)__popc(m));
    base = __shfl_sync(FULL, base, leader);
    if (hit) list[base + __popc(m & lanemask_lt())] = i;
}

// Takes the atomic ticket `which`; true in every thread of the block that finished last. Every
// thread fences its own writes first.
__device__ __forceinline__ bool last_block(unsigned* ctl, int which) {
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(ctl + C_TICKET + which, 1u) == gridDim.x - 1;
    __syncthreads();
    if (s_last) __threadfence();  // every other block's writes are visible now
    return s_last;
}

// argmax_step's reduction (step.cu): larger value, or equal with a lower id; NaN never wins.

// ---------------------------------------------------------------------------------------------
// The top-k candidates (sample_select, SPARSE) as seen by its last block: in id order, in
// shared memory when there are at most SCAP of them, else read through the global `cand` list.
struct Cands {
    unsigned n;
    bool smem;
    const unsigned* s_idx;
    const float* s_w;
    const unsigned* s_xk;
    const unsigned* g_idx;
    const float* weights;
    const float* logits;
    __device__ __forceinline__ unsigned idx(unsigned j) const { return smem ? s_idx[j] : __ldcg(g_idx + j); }
    __device__ __forceinline__ float w(unsigned j) const { return smem ? s_w[j] : weights[idx(j)]; }
    __device__ __forceinline__ unsigned xk(unsigned j) const { return smem ? s_xk[j] : okey(clean(logits[idx(j)])); }
};

// Rank order of the CPU's `rank`: higher logit first (total order), then lower id.
__device__ __forceinline__ unsigned long long rank_key(unsigned xk, unsigned idx) {
    return ((unsigned long long)(~xk) << 32) | idx;
}

// Id of the m-th (0-based, id order) candidate whose order key passes `pred`.
template <class Pred>
__device__ unsigned find_mth(const Cands& cv, unsigned m, Pred pred) {
    __shared__ unsigned s_found;
    if (threadIdx.x == 0) s_found = 0u;
    __syncthreads();
    unsigned running = 0u;
    for (unsigned b0 = 0; b0 < cv.n; b0 += blockDim.x) {
        const unsigned j = b0 + threadIdx.x;
        const bool f = j < cv.n && pred(cv.xk(j));
        unsigned total;
        const unsigned pre = block_exclusive_scan<unsigned>(f ? 1u : 0u, total);
        if (f && running + pre == m) s_found = cv.idx(j);
        running += total;
        if (running > m) break;
    }
    __syncthreads();
    const unsigned r = s_found;
    __syncthreads();
    return r;
}

struct SparseSmem {
    unsigned long long keyA[TOPK_CAP];  // rank keys of the candidates above thr, then sorted
    float wA[TOPK_CAP];                 // their weights, in rank order
    unsigned idx[SCAP];                 // the candidates in id order (when they fit)
    float w[SCAP];
    unsigned xk[SCAP];
    unsigned off[MAX_BLOCKS + 1];       // per-block segment offsets
};
struct DenseSmem {
    unsigned long long h[LOW_BINS];  // refinement histogram (integer significand sums)
    unsigned short bin[LOW_BINS];    // its non-empty bins, heaviest first (compact_bins)
    unsigned wb[WCAP];               // weight bits of list[j], when len <= WCAP
};
union FinSmem {
    SparseSmem s;
    DenseSmem d;
};

// The last token step: ids[q] = token, counts[token] += 1 (saturating; Sampler::accept), pos = q.
// SKIP only advances pos. One thread.
__device__ __forceinline__ void finish(unsigned mode, unsigned token, const unsigned* ctl, int* ids,
                                       int* pos, unsigned* counts) {
    const int q = (int)ctl[C_Q];
    if (mode != MODE_SKIP) {
        ids[q] = (int)token;
        const unsigned c = counts[token];
        if (c != 0xffffffffu) counts[token] = c + 1u;
    }
    pos[0] = q;
}

// The CPU's `crossing` from the heaviest bucket down over integer significand sums h[b] (scaled
// by bucket_scale(b)): the first non-empty bucket where the running mass (from `above`) reaches
// `target`, and the mass above it; else the lightest non-empty bucket. False when all are empty.
template <class H, class ScaleOf>
__device__ bool crossing(H h, int nbins, double target, double above, ScaleOf bucket_scale, int& out_b,
                         double& out_above) {
    double acc = above;
    int last = -1;
    double last_acc = 0.0;
    for (int b = nbins - 1; b >= 0; --b) {
        const unsigned long long u = h(b);
        if (u == 0ull) continue;
        const double m = __dmul_rn(__ull2double_rn(u), bucket_scale(b));
        if (__dadd_rn(acc, m) >= target) {
            out_b = b;
            out_above = acc;
            return true;
        }
        last = b;
        last_acc = acc;
        acc = __dadd_rn(acc, m);
    }
    out_b = last;
    out_above = last_acc;
    return last >= 0;
}

// The non-empty bins of the NB integer sums h (shared), heaviest (highest bin) first: their masses
// __dmul_rn(__ull2double_rn(h[b]), bucket_scale(b)) (crossing()'s m) written over h[0 .. K) as
// doubles, their bins into bin[0 .. K). Returns K in every thread. Every thread calls it.
template <int NB, class ScaleOf>
__device__ int compact_bins(unsigned long long* h, unsigned short* bin, ScaleOf bucket_scale) {
    static_assert(NB % THREADS == 0, "whole bins per thread");
    constexpr int PER = NB / THREADS;
    unsigned long long u[PER];
    int cnt = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        u[j] = h[NB - 1 - (PER * (int)threadIdx.x + j)];  // thread order = descending bins
        cnt += u[j] != 0ull ? 1 : 0;
    }
    int total;
    int pos = block_exclusive_scan<int>(cnt, total);  // synchronises: every h read before a write
    double* m = reinterpret_cast<double*>(h);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        if (u[j] == 0ull) continue;
        const int b = NB - 1 - (PER * (int)threadIdx.x + j);
        m[pos] = __dmul_rn(__ull2double_rn(u[j]), bucket_scale(b));
        bin[pos] = (unsigned short)b;
        ++pos;
    }
    __syncthreads();
    return total;
}

// crossing() over the K listed masses m (compact_bins), from `above`: one thread, reading
// shared memory, adding in the same order (empty bins added nothing there either).
__device__ __forceinline__ bool crossing_list(const double* m, const unsigned short* bin, int K, double target,
                                              double above, int& out_b, double& out_above) {
    double acc = above, prev = 0.0;
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
        const double nx = __dadd_rn(acc, m[k]);
        if (nx >= target) {
            out_b = bin[k];
            out_above = acc;
            return true;
        }
        prev = acc;
        acc = nx;
    }
    out_b = K > 0 ? (int)bin[K - 1] : -1;
    out_above = prev;
    return K > 0;
}

// sample_select's last block, SPARSE: Sampler::plan_top_k after `thr`, then draw_sparse.
__device__ void sparse_finish(unsigned* ctl, const float* logits, const float* weights, const unsigned* list,
                              unsigned* cand, int rows, const Params& P, SparseSmem& S) {
    const int tid = threadIdx.x;
    const int G = gridDim.x, ch = chunk_len(rows);
    __shared__ unsigned s_nA, s_nT, s_nB, s_emin, s_first, s_last, s_L, s_tok;
    __shared__ float s_wt;
    __shared__ unsigned long long s_cut;
    __shared__ int s_has_cut;
    __shared__ double s_target;
    {
        // segment offsets: an exclusive scan of the per-block counts (G <= MAX_BLOCKS <= THREADS)
        const unsigned cnt = tid < G ? __ldcg(ctl + C_PART_CNT + tid) : 0u;
        unsigned total;
        const unsigned ex = block_exclusive_scan<unsigned>(cnt, total);
        if (tid < G) S.off[tid] = ex;
        if (tid == 0) {
            S.off[G] = total;
            s_nA = s_nT = s_nB = 0u;
            s_emin = 0xffffffffu;
            s_wt = 0.0f;
            s_has_cut = 0;
        }
    }
    __syncthreads();
    const unsigned C = S.off[G];
    const unsigned argmax_tok = ctl[C_ARGMAX];
    if (C == 0u) {  // unreachable: the maximum is always a candidate (weight 1)
        if (tid == 0) {
            ctl[C_TOKEN] = argmax_tok;
            ctl[C_MODE] = MODE_DONE;
        }
        return;
    }
    const bool smem = C <= (unsigned)SCAP;
    // the candidates in id order: segment b holds block b's, in id order. Candidate o (of all
    // C) is entry o - off[b] of the segment b with off[b] <= o < off[b + 1] (binary search).
    for (unsigned o = tid; o < C; o += THREADS) {
        int lo = 0, hi = G - 1;  // the last b with off[b] <= o (off[0] = 0 <= o)
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (S.off[mid] <= o) lo = mid; else hi = mid - 1;
        }
        const unsigned idx = __ldcg(list + (size_t)lo * ch + (o - S.off[lo]));
        if (smem) {
            S.idx[o] = idx;
            S.w[o] = weights[idx];
            S.xk[o] = okey(clean(logits[idx]));
        } else {
            cand[o] = idx;
        }
    }
    __syncthreads();
    const Cands cv{C, smem, S.idx, S.w, S.xk, cand, weights, logits};
    const unsigned kthr = ctl[C_KTHR];
    // A: above thr (at most k - 1 of them). T: order key equal to thr's. B: equal to thr as a
    // number but not as a key (-0 when thr is +0). T and B share one weight.
    {
        unsigned nt = 0u, nb = 0u, em = 0xffffffffu;
        float wt_seen = -1.0f;
        for (unsigned j = tid; j < C; j += THREADS) {
            const unsigned xk = cv.xk(j);
            const float w = cv.w(j);
            em = min(em, (unsigned)(lowbit_exp(w) + 256));
            if (xk > kthr) {
                const unsigned slot = atomicAdd(&s_nA, 1u);
                if (slot < (unsigned)TOPK_CAP) S.keyA[slot] = rank_key(xk, cv.idx(j));
            } else {
                if (xk == kthr) ++nt; else ++nb;
                wt_seen = w;
            }
        }
        if (nt != 0u) atomicAdd(&s_nT, nt);
        if (nb != 0u) atomicAdd(&s_nB, nb);
        atomicMin(&s_emin, em);
        if (wt_seen >= 0.0f) s_wt = wt_seen;  // the same value from every writer
    }
    __syncthreads();
    const unsigned nA = s_nA, nT = s_nT, nTB = s_nT + s_nB;
    if (nA > (unsigned)TOPK_CAP) {  // unreachable: the host limits top_k to TOPK_CAP
        if (tid == 0) {
            ctl[C_TOKEN] = argmax_tok;
            ctl[C_MODE] = MODE_DONE;
        }
        return;
    }
    const float wt = s_wt;
    const int emin = (int)s_emin - 256;
    // every partial sum of candidate weights is exact in f64 (see the top of the file)
    const bool exact = (32 - __clz((int)C)) - emin <= 53;
    const double g = exact ? exp2i(emin) : 0.0;
    // sort A by rank (bitonic, padded to a power of two)
    unsigned p2 = 1u;
    while (p2 < nA) p2 <<= 1;
    for (unsigned j = nA + tid; j < p2; j += THREADS) S.keyA[j] = ~0ull;
    __syncthreads();
    for (unsigned k = 2; k <= p2; k <<= 1) {
        for (unsigned jj = k >> 1; jj > 0; jj >>= 1) {
            for (unsigned i = tid; i < p2; i += THREADS) {
                const unsigned ixj = i ^ jj;
                if (ixj > i) {
                    const unsigned long long a = S.keyA[i], b = S.keyA[ixj];
                    if ((a > b) == ((i & k) == 0u)) {
                        S.keyA[i] = b;
                        S.keyA[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (unsigned p = tid; p < nA; p += THREADS) S.wA[p] = weights[(unsigned)S.keyA[p]];
    __syncthreads();
    // weight at rank position p (0-based)
    auto wr = [&](unsigned p) -> float { return p < nA ? S.wA[p] : wt; };

    // ---- top-p (Sampler::sparse_top_p)
    if (P.top_p < 1.0f && C > 1u) {
        // total over the candidates in id order
        double total = 0.0;
        if (exact) {
            unsigned long long u = 0ull;
            for (unsigned j = tid; j < C; j += THREADS) u += units_of(cv.w(j), emin);
            total = __dmul_rn(__ull2double_rn(block_sum<unsigned long long>(u)), g);
        } else if (tid == 0) {
            for (unsigned j = 0; j < C; ++j) total = __dadd_rn(total, (double)cv.w(j));
        }
        if (tid == 0) {
            s_target = __dmul_rn(__dsub_rn((double)P.top_p, 1e-6), total);
            s_L = C;
        }
        __syncthreads();
        const double target = s_target;
        if (C <= (unsigned)NUCLEUS_SORT_LEN) {
            // nucleus_len on a short window: sorted by rank, summed in that order
            if (tid == 0) {
                double acc = 0.0;
                for (unsigned p = 0; p < C; ++p) {
                    acc = __dadd_rn(acc, (double)wr(p));
                    if (acc >= target) {
                        s_L = p + 1;
                        break;
                    }
                }
            }
        } else if (exact) {
            // exact prefix sums in rank order: L = the first prefix that reaches the target
            const unsigned p0 = 2 * tid, p1 = 2 * tid + 1;  // nA <= 2 * THREADS
            const unsigned long long v0 = p0 < nA ? units_of(S.wA[p0], emin) : 0ull;
            const unsigned long long v1 = p1 < nA ? units_of(S.wA[p1], emin) : 0ull;
            unsigned long long totA;
            const unsigned long long ex = block_exclusive_scan<unsigned long long>(v0 + v1, totA);
            if (p0 < nA && __dmul_rn(__ull2double_rn(ex + v0), g) >= target) atomicMin(&s_L, p0 + 1);
            else if (p1 < nA && __dmul_rn(__ull2double_rn(ex + v0 + v1), g) >= target) atomicMin(&s_L, p1 + 1);
            __syncthreads();
            if (tid == 0 && s_L == C && nTB > 0u) {
                // not reached inside A: the smallest m in [1, nTB] with (totA + m ut) g >= target
                const unsigned long long ut = units_of(wt, emin);
                auto ok = [&](unsigned long long m) {
                    return __dmul_rn(__ull2double_rn(totA + m * ut), g) >= target;
                };
                const double est = (target / g - (double)totA) / (double)ut;
                unsigned long long m = est >= 1.0 ? (est > (double)nTB ? (unsigned long long)nTB : (unsigned long long)ceil(est)) : 1ull;
                while (m > 1ull && ok(m - 1)) --m;
                while (m <= nTB && !ok(m)) ++m;
                if (m <= nTB) s_L = nA + (unsigned)m;
            }
        } else if (tid == 0) {
            // nucleus_len's windows; the halves summed in rank order (the CPU: in select order)
            unsigned lo = 0, hi = C;
            double acc = 0.0;
            while (hi - lo > (unsigned)NUCLEUS_SORT_LEN) {
                const unsigned mid = lo + (hi - lo) / 2;
                double upper = 0.0;
                for (unsigned p = lo; p < mid; ++p) upper = __dadd_rn(upper, (double)wr(p));
                if (__dadd_rn(acc, upper) >= target) {
                    hi = mid;
                } else {
                    acc = __dadd_rn(acc, upper);
                    lo = mid;
                }
            }
            unsigned L = hi;
            for (unsigned p = lo; p < hi; ++p) {
                acc = __dadd_rn(acc, (double)wr(p));
                if (acc >= target) {
                    L = p + 1;
                    break;
                }
            }
            s_L = L;
        }
        __syncthreads();
        const unsigned L = s_L;
        if (L < C) {
            // the worst kept token (rank position L - 1); keep every candidate ranked no lower
            const unsigned p = L - 1;
            unsigned long long cut;
            if (p < nA) {
                cut = S.keyA[p];
            } else if (p - nA < nT) {
                cut = rank_key(kthr, find_mth(cv, p - nA, [&](unsigned xk) { return xk == kthr; }));
            } else {
                const unsigned id = find_mth(cv, p - nA - nT, [&](unsigned xk) { return xk < kthr; });
                cut = rank_key(okey(clean(logits[id])), id);
            }
            if (tid == 0) {
                s_cut = cut;
                s_has_cut = 1;
            }
        }
        __syncthreads();
    }
    const bool has_cut = s_has_cut != 0;
    const unsigned long long cut = s_cut;
    const float min_p = P.min_p;
    auto kept = [&](unsigned j, float w) {
        return (!has_cut || rank_key(cv.xk(j), cv.idx(j)) <= cut) && (!(min_p > 0.0f) || w >= min_p);
    };

    // ---- draw_sparse: inverse CDF over the kept candidates in id order
    const double u = ld_f64(ctl + C_U);
    if (exact) {
        if (tid == 0) {
            s_first = 0xffffffffu;
            s_last = 0xffffffffu;
        }
        __syncthreads();
        unsigned long long tot = 0ull;
        unsigned last = 0u;
        bool any = false;
        for (unsigned j = tid; j < C; j += THREADS) {
            const float w = cv.w(j);
            if (kept(j, w)) {
                tot += units_of(w, emin);
                last = j;
                any = true;
            }
        }
        if (any) atomicMax(reinterpret_cast<int*>(&s_last), (int)last);  // -1 (none) loses
        const unsigned long long U = block_sum<unsigned long long>(tot);
        const double r = __dmul_rn(u, __dmul_rn(__ull2double_rn(U), g));
        unsigned long long running = 0ull;
        for (unsigned b0 = 0; b0 < C && U > 0ull; b0 += THREADS) {
            const unsigned j = b0 + tid;
            unsigned long long v = 0ull;
            bool k = false;
            if (j < C) {
                const float w = cv.w(j);
                k = kept(j, w);
                if (k) v = units_of(w, emin);
            }
            unsigned long long chunk;
            const unsigned long long ex = block_exclusive_scan<unsigned long long>(v, chunk);
            if (k && r < __dmul_rn(__ull2double_rn(running + ex + v), g)) atomicMin(&s_first, j);
            __syncthreads();
            if (s_first != 0xffffffffu) break;
            running += chunk;
        }
        __syncthreads();
        if (tid == 0) {
            const unsigned j = s_first != 0xffffffffu ? s_first : s_last;
            s_tok = (U == 0ull || j == 0xffffffffu) ? argmax_tok : cv.idx(j);
        }
    } else if (tid == 0) {
        double total = 0.0;
        for (unsigned j = 0; j < C; ++j) {
            const float w = cv.w(j);
            if (kept(j, w)) total = __dadd_rn(total, (double)w);
        }
        const double r = __dmul_rn(u, total);
        double acc = 0.0;
        unsigned tok = argmax_tok;  // no kept candidate: Plan::Degenerate
        for (unsigned j = 0; j < C; ++j) {
            const float w = cv.w(j);
            if (!kept(j, w)) continue;
            acc = __dadd_rn(acc, (double)w);
            tok = cv.idx(j);  // the last kept one if rounding leaves r unreached
            if (r < acc) break;
        }
        s_tok = tok;
    }
    __syncthreads();
    if (tid == 0) {
        ctl[C_TOKEN] = s_tok;
        ctl[C_MODE] = MODE_DONE;
    }
}

// sample_select's last block, DENSE with top-p: Sampler::dense_top_p after the first crossing.
__device__ void dense_tp_finish(unsigned* ctl, const float* logits, float* weights, const unsigned* list,
                                const Params& P, DenseSmem& D) {
    const int tid = threadIdx.x;
    __shared__ int s_b, s_ok;
    __shared__ double s_above;
    __shared__ unsigned s_L;
    const unsigned len = __ldcg(ctl + C_LIST_LEN);
    const unsigned b1 = ctl[C_TP_B1];
    const double target = ld_f64(ctl + C_TP_TARGET);
    double above = ld_f64(ctl + C_TP_ABOVE);
    const int e1 = (int)(b1 >> 1);
    const double bscale = exp2i((e1 ? e1 : 1) - 150);  // every token of the bucket: significand * bscale
    unsigned prefix = 0u, mask = 0u;                    // fixed low bits so far
    bool ok = true;
    const bool staged = len <= (unsigned)WCAP;
    if (staged) {  // one pass of dependent loads; the histogram passes read shared memory
        for (unsigned j = tid; j < len; j += THREADS) D.wb[j] = __float_as_uint(weights[__ldcg(list + j)]);
        __syncthreads();
    }
    for (int level = 0; level < 2; ++level) {
        const int shift = level == 0 ? LOW_BITS : 0;
        for (int b = tid; b < LOW_BINS; b += THREADS) D.h[b] = 0ull;
        __syncthreads();
        for (unsigned j = tid; j < len; j += THREADS) {
            const unsigned bits = staged ? D.wb[j] : __float_as_uint(weights[__ldcg(list + j)]);
            if ((bits & mask) == prefix) atomicAdd(&D.h[(bits >> shift) & (LOW_BINS - 1)], (unsigned long long)sig_of(bits));
        }
        __syncthreads();
        const int K = compact_bins<LOW_BINS>(D.h, D.bin, [&](int) { return bscale; });
        if (tid == 0) {
            int b;
            double a;
            s_ok = crossing_list(reinterpret_cast<const double*>(D.h), D.bin, K, target, above, b, a);
            s_b = b;
            s_above = a;
        }
        __syncthreads();
        if (!s_ok) {  // unreachable: the bucket is not empty
            ok = false;
            break;
        }
        prefix |= (unsigned)s_b << shift;
        mask |= (unsigned)(LOW_BINS - 1) << shift;
        above = s_above;
        __syncthreads();
    }
    float w_min = 0.0f;
    if (ok) {
        const unsigned wbits = (b1 << TOP_SHIFT) | prefix;
        const float wstar = __uint_as_float(wbits);
        auto is_tie = [&](unsigned idx) { return __float_as_uint(weights[idx]) == wbits; };
        unsigned c = 0u;
        for (unsigned j = tid; j < len; j += THREADS)
            c += (staged ? D.wb[j] == wbits : is_tie(__ldcg(list + j))) ? 1u : 0u;
        c = block_sum<unsigned>(c);
        // nucleus_len over c tokens of weight w*: j * w* is exact, so L is the smallest j >= 1
        // with j * w* >= target - above, or c
        if (tid == 0) {
            const double t2 = __dsub_rn(target, above);
            const double wd = (double)wstar;
            auto prod = [&](unsigned long long j) { return __dmul_rn((double)j, wd); };
            unsigned long long j = 1ull;
            if (!(t2 <= wd)) {
                const double est = t2 / wd;
                j = est >= (double)c ? (unsigned long long)c : (unsigned long long)ceil(est);
                if (j < 1ull) j = 1ull;
            }
            while (j > 1ull && prod(j - 1) >= t2) --j;
            while (j < c && prod(j) < t2) ++j;
            s_L = (unsigned)j;
        }
        __syncthreads();
        const unsigned L = s_L;
        if (L < c) {
            // keep the L best ties by rank (logit, then id); zero the weights of the others
            const unsigned kx = ~block_select(len, L, [&](unsigned j, unsigned& key) {
                const unsigned idx = __ldcg(list + j);
                if (!is_tie(idx)) return false;
                key = ~okey(clean(logits[idx]));
                return true;
            }, nullptr, 0u);
            unsigned na = 0u;
            for (unsigned j = tid; j < len; j += THREADS) {
                const unsigned idx = __ldcg(list + j);
                na += (is_tie(idx) && okey(clean(logits[idx])) > kx) ? 1u : 0u;
            }
            na = block_sum<unsigned>(na);
            const unsigned id_cut = block_select(len, L - na, [&](unsigned j, unsigned& key) {
                const unsigned idx = __ldcg(list + j);
                if (!is_tie(idx) || okey(clean(logits[idx])) != kx) return false;
                key = idx;
                return true;
            }, nullptr, 0u);
            for (unsigned j = tid; j < len; j += THREADS) {
                const unsigned idx = __ldcg(list + j);
                if (!is_tie(idx)) continue;
                const unsigned xk = okey(clean(logits[idx]));
                if (xk < kx || (xk == kx && idx > id_cut)) weights[idx] = 0.0f;
            }
        }
        w_min = wstar;
    }
    if (P.min_p > 0.0f) w_min = fmaxf(w_min, P.min_p);
    __syncthreads();
    if (tid == 0) {
        ctl[C_WMIN] = __float_as_uint(w_min);
        ctl[C_LIST_LEN] = 0u;
    }
}

}  // namespace calla_sample

// Arguments of all four launches: logits [rows] (steps 1-3 written in place), rows, n =
// vocab_limit <= rows, ids [max_ctx] (the token history), n_fixed [1] (prompt length), pos [1],
// ctl [CTL_WORDS], counts [rows], weights [rows] (f32), list [rows], cand [rows],
// bsum [ceil(rows / 1024)] (f64).
#define CS_ARGS                                                                                        \
    float *logits, int rows, int n, int *ids, int max_ctx, const int *n_fixed, int *pos, unsigned *ctl, \
        unsigned *counts, float *weights, unsigned *list, unsigned *cand, double *bsum

extern "C" __global__ void __launch_bounds__(calla_sample::THREADS) sample_prep(CS_ARGS) {
    using namespace calla_sample;
    calla_pdl_wait();  // logits come from the LM head; pos, counts, ctl from the last step
    __shared__ unsigned s_hist[KEY_BINS];
    __shared__ unsigned s_mode;
    const int tid = threadIdx.x;
    const Params P = load_params(ctl);
    const int q = pos[0] + 1;
    const bool active = q >= n_fixed[0] && q >= 0 && q < max_ctx;
    if (!active) {  // a prompt position (or past the history): no sampling, pos advances only
        if (blockIdx.x == 0 && tid == 0) {
            ctl[C_MODE] = MODE_SKIP;
            ctl[C_Q] = (unsigned)q;
        }
        return;
    }
    const bool greedy = P.temperature == 0.0f;
    const bool sparse = !greedy && n > 0 && P.top_k > 0u && P.top_k < (unsigned)n;
    const bool pen = P.repetition != 1.0f || P.presence != 0.0f || P.frequency != 0.0f;
    if (sparse) {
        for (int b = tid; b < KEY_BINS; b += THREADS) s_hist[b] = 0u;
        __syncthreads();
    }
    const int ch = chunk_len(rows);
    const int lo = blockIdx.x * ch, hi = min(rows, lo + ch);
    float bv = CS_NEG_INF;
    int bi = NONE;
    for (int i = lo + tid; i < hi; i += THREADS) {
        if (i >= n) {  // step 1: ids >= vocab_limit
            logits[i] = CS_NEG_INF;
            continue;
        }
        float x = logits[i];
        if (pen) {
            const unsigned c = counts[i];
            if (c != 0u) {
                x = penalize(x, c, P);
                logits[i] = x;
            }
        }
        // ids grow along the loop: an equal value never replaces, the first -inf is taken
        if (x > bv || (x == bv && bi == NONE)) {
            bv = x;
            bi = i;
        }
        if (sparse) atomicAdd(&s_hist[okey(clean(x)) >> KEY_SHIFT], 1u);
    }
    calla_pdl_launch_dependents();
    if (sparse) {
        __syncthreads();
        for (int b = tid; b < KEY_BINS; b += THREADS)
            if (s_hist[b] != 0u) atomicAdd(ctl + C_KHIST + b, s_hist[b]);
    }
    calla_block_best(bv, bi);
    if (tid == 0) {
        ctl[C_PART_MAX + blockIdx.x] = __float_as_uint(bv);
        ctl[C_PART_IDX + blockIdx.x] = (unsigned)bi;
    }
    if (!last_block(ctl, 0)) return;

    if (tid < 32) {
        bv = CS_NEG_INF;
        bi = NONE;
        for (int b = tid; b < (int)gridDim.x; b += 32)
            calla_take_better(bv, bi, __uint_as_float(__ldcg(ctl + C_PART_MAX + b)), (int)__ldcg(ctl + C_PART_IDX + b));
        calla_warp_best(bv, bi);
        if (tid == 0) {
            const unsigned tok = bi == NONE ? 0u : (unsigned)bi;  // sampler::argmax
            unsigned mode;
            ctl[C_Q] = (unsigned)q;
            ctl[C_ARGMAX] = tok;
            if (n <= 0) {  // Sampler::sample: empty row -> 0, no random number
                mode = MODE_DONE;
                ctl[C_TOKEN] = 0u;
            } else if (greedy) {
                mode = MODE_DONE;
                ctl[C_TOKEN] = tok;
            } else {
                // (the next_u64 of this call is drawn by thread 32, below)
                const float maxc = fminf(bv, CS_FLT_MAX);  // max_non_nan(..).min(f32::MAX)
                if (maxc == CS_NEG_INF) {                  // Plan::Degenerate
                    mode = MODE_DONE;
                    ctl[C_TOKEN] = tok;
                } else {
                    ctl[C_MAXC] = __float_as_uint(maxc);
                    mode = sparse ? MODE_SPARSE : MODE_DENSE;
                }
            }
            ctl[C_MODE] = mode;
            s_mode = mode;
        }
    } else if (tid == 32 && n > 0 && !greedy) {
        // one next_u64 per non-greedy call with n > 0 (exactly the calls thread 0 does not
        // settle as empty or greedy), drawn before the plan (degenerate rows too); in another
        // warp, alongside the argmax reduction
        unsigned long long* calls = reinterpret_cast<unsigned long long*>(ctl + C_CALLS);
        const unsigned long long k = *calls;
        st_f64(ctl + C_U, unit_f64(chacha_u64(ctl + C_KEY, k)));
        *calls = k + 1ull;
    }
    __syncthreads();
    if (sparse) {
        if (s_mode == MODE_SPARSE) {
            // the bucket holding the k-th largest: thread t owns 8 bins, counted from the top
            constexpr int PER = KEY_BINS / THREADS;
            const int top = KEY_BINS - PER * tid;
            const unsigned k = P.top_k;
            unsigned local = 0u;
            for (int j = 1; j <= PER; ++j) local += __ldcg(ctl + C_KHIST + top - j);
            unsigned total;
            const unsigned above = block_exclusive_scan<unsigned>(local, total);
            if (above < k && k <= above + local) {
                unsigned acc = above;
                for (int j = 1; j <= PER; ++j) {
                    const unsigned h = __ldcg(ctl + C_KHIST + top - j);
                    if (acc + h >= k) {
                        ctl[C_SEL_BIN] = (unsigned)(top - j);
                        ctl[C_SEL_NEED] = k - acc;
                        break;
                    }
                    acc += h;
                }
            }
            __syncthreads();
        }
        for (int b = tid; b < KEY_BINS; b += THREADS) ctl[C_KHIST + b] = 0u;  // zero for the next step
    }
    if (tid == 0) ctl[C_TICKET + 0] = 0u;
}

extern "C" __global__ void __launch_bounds__(calla_sample::THREADS) sample_weights(CS_ARGS) {
    using namespace calla_sample;
    calla_pdl_wait();
    const unsigned mode = ctl[C_MODE];
    if (mode != MODE_DENSE && mode != MODE_SPARSE) return;
    __shared__ unsigned long long s_h[TOP_BINS];
    __shared__ unsigned short s_bin[TOP_BINS];
    __shared__ unsigned s_keys[KCACHE];
    const int tid = threadIdx.x;
    const Params P = load_params(ctl);
    const float maxc = __uint_as_float(ctl[C_MAXC]);
    const Scale sc(P.temperature);
    const bool tp = mode == MODE_DENSE && P.top_p < 1.0f;
    const bool sparse = mode == MODE_SPARSE;
    const unsigned sel_bin = ctl[C_SEL_BIN];
    if (tp) {
        for (int b = tid; b < TOP_BINS; b += THREADS) s_h[b] = 0ull;
        __syncthreads();
    }
    const int ch = chunk_len(rows);
    const int lo = blockIdx.x * ch, end = min(min(rows, n), lo + ch);
    for (int b0 = lo; b0 < end; b0 += THREADS) {
        const int i = b0 + tid;
        bool hit = false;
        if (i < end) {
            const float x = logits[i];
            const float w = weight_of(x, maxc, sc);
            weights[i] = w;
            if (tp && w > 0.0f) {
                const unsigned bits = __float_as_uint(w);
                atomicAdd(&s_h[bits >> TOP_SHIFT], (unsigned long long)sig_of(bits));
            }
            hit = sparse && (okey(clean(x)) >> KEY_SHIFT) == sel_bin;
        }
        if (sparse) warp_append(hit, (unsigned)i, ctl, list);
    }
    calla_pdl_launch_dependents();
    if (tp) {
        __syncthreads();
        unsigned long long* gh = reinterpret_cast<unsigned long long*>(ctl + C_WHIST);
        for (int b = tid; b < TOP_BINS; b += THREADS)
            if (s_h[b] != 0ull) atomicAdd(gh + b, s_h[b]);
    }
    if (!last_block(ctl, 1)) return;

    if (sparse) {
        // thr: the sel_need-th largest order key in the listed bucket
        const unsigned len = __ldcg(ctl + C_LIST_LEN), need = ctl[C_SEL_NEED];
        const unsigned kinv = block_select(len, need, [&](unsigned j, unsigned& key) {
            key = ~okey(clean(logits[__ldcg(list + j)]));
            return true;
        }, s_keys, (unsigned)KCACHE);
        if (tid == 0) {
            ctl[C_KTHR] = ~kinv;
            ctl[C_LIST_LEN] = 0u;
        }
    } else if (tp) {
        // dense_top_p: total over the buckets (heaviest first), target, first crossing. The
        // histogram is staged in shared memory (and zeroed for the next step), the non-empty
        // buckets listed heaviest first with their masses; one thread adds them in that order.
        unsigned long long* gh = reinterpret_cast<unsigned long long*>(ctl + C_WHIST);
        for (int b = tid; b < TOP_BINS; b += THREADS) {
            s_h[b] = __ldcg(gh + b);
            gh[b] = 0ull;
        }
        __syncthreads();
        const int K = compact_bins<TOP_BINS>(s_h, s_bin, [](int b) {
            const int e = b >> 1;
            return exp2i((e ? e : 1) - 150);
        });
        if (tid == 0) {
            const double* m = reinterpret_cast<const double*>(s_h);
            double total = 0.0;
#pragma unroll 8
            for (int k = 0; k < K; ++k) total = __dadd_rn(total, m[k]);
            const double target = __dmul_rn(__dsub_rn((double)P.top_p, 1e-6), total);
            int b1;
            double above;
            if (crossing_list(m, s_bin, K, target, 0.0, b1, above)) {
                ctl[C_TP_ON] = 1u;
                ctl[C_TP_B1] = (unsigned)b1;
                st_f64(ctl + C_TP_ABOVE, above);
                st_f64(ctl + C_TP_TARGET, target);
            } else {  // unreachable (the maximum has weight 1): no top-p cut
                ctl[C_TP_ON] = 0u;
                ctl[C_WMIN] = __float_as_uint(P.min_p > 0.0f ? P.min_p : 0.0f);
            }
        }
    } else if (tid == 0) {
        ctl[C_TP_ON] = 0u;
        ctl[C_WMIN] = __float_as_uint(P.min_p > 0.0f ? P.min_p : 0.0f);
    }
    if (tid == 0) ctl[C_TICKET + 1] = 0u;
}

extern "C" __global__ void __launch_bounds__(calla_sample::THREADS) sample_select(CS_ARGS) {
    using namespace calla_sample;
    calla_pdl_wait();
    const unsigned mode = ctl[C_MODE];
    const bool sparse = mode == MODE_SPARSE;
    if (!sparse && !(mode == MODE_DENSE && ctl[C_TP_ON] != 0u)) return;
    __shared__ FinSmem fin;
    const int tid = threadIdx.x;
    const Params P = load_params(ctl);
    const int ch = chunk_len(rows);
    const int lo = blockIdx.x * ch, end = min(min(rows, n), lo + ch);
    if (sparse) {
        // candidates clean(x) >= thr with w > 0, in id order, into this block's segment
        const float thr = okey_inv(ctl[C_KTHR]);
        unsigned running = 0u;
        for (int b0 = lo; b0 < end; b0 += THREADS) {
            const int i = b0 + tid;
            const bool f = i < end && clean(logits[i]) >= thr && weights[i] > 0.0f;
            unsigned total;
            const unsigned pre = block_exclusive_scan<unsigned>(f ? 1u : 0u, total);
            if (f) list[lo + running + pre] = (unsigned)i;
            running += total;
        }
        if (tid == 0) ctl[C_PART_CNT + blockIdx.x] = running;
    } else {
        const unsigned b1 = ctl[C_TP_B1];
        for (int b0 = lo; b0 < end; b0 += THREADS) {
            const int i = b0 + tid;
            bool hit = false;
            if (i < end) {
                const float w = weights[i];
                hit = w > 0.0f && (__float_as_uint(w) >> TOP_SHIFT) == b1;
            }
            warp_append(hit, (unsigned)i, ctl, list);
        }
    }
    calla_pdl_launch_dependents();
    if (!last_block(ctl, 2)) return;
    if (sparse)
        sparse_finish(ctl, logits, weights, list, cand, rows, P, fin.s);
    else
        dense_tp_finish(ctl, logits, weights, list, P, fin.d);
    if (tid == 0) ctl[C_TICKET + 2] = 0u;
}

extern "C" __global__ void __launch_bounds__(calla_sample::DRAW_THREADS) sample_draw(CS_ARGS) {
    using namespace calla_sample;
    calla_pdl_wait();
    const int tid = threadIdx.x;
    const unsigned mode = ctl[C_MODE];
    if (mode != MODE_DENSE) {
        if (blockIdx.x == 0 && tid == 0) finish(mode, ctl[C_TOKEN], ctl, ids, pos, counts);
        return;
    }
    __shared__ float s_w[DRAW_BLOCK];
    __shared__ double s_buf[2 * DRAW_SCAP];  // block sums: DRAW_WARPS x 1024 floats; last block: bsum, prefixes
    __shared__ int s_db, s_tok, s_tok_last;
    __shared__ double s_acc, s_r;
    const float w_min = __uint_as_float(ctl[C_WMIN]);
    auto eff = [&](float w) { return w >= w_min ? w : 0.0f; };  // sampler.rs eff
    const int ndb = (n + DRAW_BLOCK - 1) / DRAW_BLOCK;
    {
        // block_sum of draw block db (one per warp): its 1024 weights staged in shared memory
        // (coalesced), then lane j < 8 sums ids start + j, start + j + 8, ... in order, the
        // lanes' sums are added 0..7, then the remainder in id order
        const int warp = tid >> 5, lane = tid & 31;
        const int db = blockIdx.x * DRAW_WARPS + warp;
        float* sw = reinterpret_cast<float*>(s_buf) + warp * DRAW_BLOCK;
        if (db < ndb) {
            const int start = db * DRAW_BLOCK;
            const int len = min(DRAW_BLOCK, n - start);
#pragma unroll 8
            for (int j = lane; j < len; j += 32) sw[j] = eff(weights[start + j]);
            __syncwarp();
            const int nfull = len >> 3;
            double acc = 0.0;
            if (lane < 8) {
#pragma unroll 8
                for (int c = 0; c < nfull; ++c) acc = __dadd_rn(acc, (double)sw[8 * c + lane]);
            }
            double s = 0.0;
#pragma unroll
            for (int k = 0; k < 8; ++k) s = __dadd_rn(s, __shfl_sync(FULL, acc, k));
            if (lane == 0) {
                for (int t = 8 * nfull; t < len; ++t) s = __dadd_rn(s, (double)sw[t]);
                bsum[db] = s;
            }
        }
    }
    calla_pdl_launch_dependents();
    if (!last_block(ctl, 3)) return;

    // draw_dense: the block whose running sum passes r, then the walk inside it
    const unsigned argmax_tok = ctl[C_ARGMAX];
    if (ndb <= DRAW_SCAP) {
        // the block sums staged in shared memory; one thread adds them in order (total), keeping
        // each running sum: they are the sums the CPU's crossing walk compares (same adds, same
        // order, from 0), so the crossing block is found by all threads from the stored values
        double* sb = s_buf;
        double* pre = s_buf + DRAW_SCAP;  // pre[b] = bsum[0] + .. + bsum[b], added in order
        for (int b = tid; b < ndb; b += DRAW_THREADS) sb[b] = __ldcg(bsum + b);
        if (tid == 0) s_db = 0x7fffffff;
        __syncthreads();
        if (tid == 0) {
            double total = 0.0;
#pragma unroll 8
            for (int b = 0; b < ndb; ++b) {
                total = __dadd_rn(total, sb[b]);
                pre[b] = total;
            }
            s_r = total;  // the total, until r replaces it
        }
        __syncthreads();
        const double total = s_r;
        const bool valid = total == total && total > 0.0;
        const double r = valid ? __dmul_rn(ld_f64(ctl + C_U), total) : 0.0;
        if (valid) {
            int first = 0x7fffffff;
            for (int b = tid; b < ndb; b += DRAW_THREADS)
                if (sb[b] > 0.0 && r < pre[b]) first = min(first, b);
            if (first != 0x7fffffff) atomicMin(&s_db, first);
        }
        __syncthreads();
        if (tid == 0) {
            if (!valid) {
                s_db = -2;
            } else if (s_db == 0x7fffffff) {
                s_db = -1;
            } else {
                s_acc = s_db > 0 ? pre[s_db - 1] : 0.0;
            }
            s_r = r;
            s_tok = (int)argmax_tok;
            s_tok_last = -1;
        }
    } else if (tid == 0) {
        double total = 0.0;
        for (int b = 0; b < ndb; ++b) total = __dadd_rn(total, __ldcg(bsum + b));
        s_db = -2;
        if (total == total && total > 0.0) {
            const double r = __dmul_rn(ld_f64(ctl + C_U), total);
            double a = 0.0;
            s_db = -1;
            for (int b = 0; b < ndb; ++b) {
                const double sb = __ldcg(bsum + b);
                if (sb > 0.0 && r < __dadd_rn(a, sb)) {
                    s_db = b;
                    break;
                }
                a = __dadd_rn(a, sb);
            }
            s_acc = a;
            s_r = r;
        }
        s_tok = (int)argmax_tok;
        s_tok_last = -1;
    }
    __syncthreads();
    const int b = s_db;
    if (b >= 0) {
        const int st = b * DRAW_BLOCK, bl = min(DRAW_BLOCK, n - st);
        for (int j = tid; j < bl; j += DRAW_THREADS) s_w[j] = eff(weights[st + j]);
        __syncthreads();
        if (tid == 0) {
            const double r = s_r;
            double a = s_acc;
            int last = -1;
            for (int j = 0; j < bl; ++j) {
                const float w = s_w[j];
                if (w > 0.0f) {
                    a = __dadd_rn(a, (double)w);
                    last = j;
                    if (r < a) break;
                }
            }
            if (last >= 0) s_tok = st + last;
        }
    } else if (b == -1) {
        // r >= total through rounding: the last id with weight
        int last = -1;
        for (int i = tid; i < n; i += DRAW_THREADS)
            if (eff(weights[i]) > 0.0f) last = i;
        if (last >= 0) atomicMax(&s_tok_last, last);
        __syncthreads();
        if (tid == 0 && s_tok_last >= 0) s_tok = s_tok_last;
    }
    __syncthreads();
    if (tid == 0) {
        finish(MODE_DENSE, (unsigned)s_tok, ctl, ids, pos, counts);
        ctl[C_TICKET + 3] = 0u;
    }
}
