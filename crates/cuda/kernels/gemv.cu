// Batch-1 decode GEMV for MLX affine group-wise quantized weights (4 or 8 bits, group 64),
// on the integer tensor cores.
//
//   out[r] = (resid[r] +) sum_g scale[r,g] * (sum_{c in g} q[r,c] x[c]) + bias[r,g] * (sum_{c in g} x[c])
//
// Layout (crates/quant/README.md): packed u32 [rows, K*BITS/32], element 0 in the low bits;
// scales/biases bf16 [rows, K/64] (raw u16 bits). x f32 [K], out (and resid) f32 [rows].
//
// Exact integer products. Per group of 64 columns, x is written as three signed 8-bit digits:
//   x[c] = w_g * (d0 + d1/254 + d2/254^2) + e,  w_g = 2^E (max|x_g| * 2^-E in [32, 64)),
//   |d0| <= 64, |d1|, |d2| <= 127,  |e| <= w_g / (2 * 254^2) ~ 2.4e-7 * max|x_g|
// (the f32 of a block-floating-point x with a 22-bit mantissa per group). Then
// sum_c q*x = w * (D0 + D1/254 + D2/254^2) with Dk = sum_c q*dk exact in int32: one
// mma.m16n8k32 u8 x s8 -> s32 multiplies 16 rows x 32 columns of codes by the 3 digit columns at
// once. A super-step is 128 columns (2 groups, 4 mmas into one accumulator): B columns 0-2 hold
// the digits of its first group, 4-6 of its second, 3 and 7 are zero. The 4-bit codes become u8
// with w & 0x0F0F0F0F (even columns) and (w >> 4) & 0x0F0F0F0F (odd columns): the k order
// inside an mma is free as long as A and B agree. 8-bit codes are u8 as stored.
//
// Work split. A warp owns 16-row tiles (mma rows g = lane/4 and g+8) and walks K in steps of 256
// columns = 2 super-steps (8 mmas in two independent accumulator chains); thread t = lane%4
// reads the 16-byte chunks t, 4+t (, 8+t, 12+t at 8 bits) of the step of both its rows. A block
// of NW warps (one block per SM) takes NW/KSPLIT tiles per iteration, KSPLIT warps per tile
// splitting K (KSPLIT = 2^ks_log2, chosen by the host from the shape); partial sums meet in
// shared memory. Blocks walk the tiles grid-stride.
//
// Memory pipeline. Each thread copies exactly the bytes it consumes with cp.async into a
// per-warp ring of STAGES steps in shared memory: 16-byte copies (L2 128-byte prefetch hint) for
// the codes, and one 8-byte copy of 4 scales or 4 biases of one row (lane roles: t = 0 scales of
// row g, 1 of row g+8, 2 biases of row g, 3 of row g+8), so STAGES-1 steps (8 KB per warp at 4
// bits) are in flight while the tensor cores work. The first STAGES-1 steps read only weights
// and are issued before calla_pdl_wait(); x is read after it, into a per-block table of B
// fragments (the digits in mma order, 1 KB per 128 columns) built once per block by all threads.
//
// Dims come from the generated header (CALLA_* macros) prepended by the host.

#ifndef CALLA_QUANT_GROUP
#error "dims header missing"
#endif

namespace calla_gemv {

constexpr int GROUP = CALLA_QUANT_GROUP;
static_assert(GROUP == 64, "the super-step layout assumes 64-column groups");
constexpr int NW = 16;               // warps per block (one block per SM)
constexpr int THREADS = NW * 32;
// `flags` bits: trigger the dependent launch right after the PDL wait instead of once every
// weight copy is queued (the next kernel's launch takes 0.5-3.3 us after the trigger on the
// H200: cuda::timeline). Measured slower in the decode step; off by default.
constexpr int GEMV_EARLY_TRIGGER = 1;
// The chain kernel (gemv_chain_*) only: request a GEMV's weights after its flag barrier instead
// of before, to measure what requesting them early buys.
constexpr int GEMV_CHAIN_LATE_WEIGHTS = 2;
// Staged (TMA) GEMVs: stages requested before the PDL wait (the others right after x's loads),
// unless GEMV_STAGED_ALL_EARLY (flags) asks for all of them before it, as the per-thread copies do.
constexpr int STAGED_PRE = 2;
constexpr int GEMV_STAGED_ALL_EARLY = 4;
// Staged GEMVs whose warps each walk exactly one unit of at most STAGES - 1 steps (the input
// projections on their default grid; also the staged output projection, whose unit is one step,
// where it changes nothing): each warp's unit arrives by ONE bulk copy of all its steps (spu
// stage images, consecutive in both layouts) on the mbarrier of stage 0, requested before the
// PDL wait (as GEMV_STAGED_ALL_EARLY requests every stage), instead of one copy per stage.
// Larger copies per request, as the MoE's cluster kernel makes (16-72 KB), which streamed ~47
// GB/s per SM against ~22 for per-thread copies.
constexpr int GEMV_STAGED_UNIT = 8;
// Request no weights before the PDL wait (all of them right after x's loads): what the early
// requests cost the kernel that is still running (measurement; lib.rs GEMV_LATE_WEIGHTS).
constexpr int GEMV_LATE_WEIGHTS = 16;
// Measurement only, wrong outputs (lib.rs set_decode_diag): skip x's loads and the digit table
// (the products read whatever the table holds), to time what building it costs in place.
constexpr int GEMV_DIAG_NO_TABLE = 32;
// ... build the table from x without the fused RMSNorm (no Σ x² reduction and its barrier).
constexpr int GEMV_DIAG_NO_NORM = 64;
// ... skip the router fold's epilogue (the shares and Σ h² atomics) of the output projection.
constexpr int GEMV_DIAG_NO_FOLD = 128;
constexpr float MAGIC = 12582912.0f; // 1.5 * 2^23: x + MAGIC rounds x to an integer in the low mantissa bits

// ST > 0: a ring of ST stages instead of the default (the slim output projections below).
template <int BITS, int K, int ST = 0>
struct Cfg {
    static constexpr int NSS = K / 128;                     // super-steps per row
    static constexpr int NSTEP = K / 256;                   // steps per row
    static constexpr int NSTEP_LOG2 = NSTEP == 2 ? 1 : NSTEP == 4 ? 2 : NSTEP == 8 ? 3 : NSTEP == 16 ? 4 : NSTEP == 32 ? 5 : -1;
    static_assert(NSTEP_LOG2 >= 1, "K / 256 must be a power of 2 in [2, 32]");
    static constexpr int GPR = K / GROUP;                   // groups per row
    static constexpr int ROW_BYTES = K * BITS / 8;
    static constexpr int STEP_ROW_BYTES = 32 * BITS;        // bytes of one row per step (128 | 256)
    static constexpr int CPT = BITS / 2;                    // 16-byte chunks per thread per row per step
    static constexpr int CODE_BYTES = 2 * CPT * 32 * 16;    // codes of one step of one warp: [2 rows][CPT][32 lanes] x 16 B
    static constexpr int STAGE_BYTES = CODE_BYTES + 32 * 8; // + one 8-byte scale/bias cell per lane
    static constexpr int STAGES = ST > 0 ? ST : BITS == 4 ? 5 : (NSS <= 16 ? 3 : 2); // within the 227 KB of a block
    static_assert(STAGES >= 2, "a ring of at least two stages");
    static constexpr int BTAB = NSS * 2 * 32 * 16;          // B fragments [NSS][2][32 lanes] uint4
    static constexpr int CST = NSS * 4 * 16;                // per (super-step, t) float4 {u0, u1, xsum, 0}
    static constexpr int RING = BTAB + CST;                 // start of the per-warp rings
    static constexpr int SMEM = RING + NW * STAGES * STAGE_BYTES; // dynamic shared memory (lib.rs gemv_smem_bytes)
};

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// D += A (16x32 u8, row) * B (32x8 s8, col), int32 accumulate.
__device__ __forceinline__ void mma_u8s8(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Low bytes of four words -> one word (a in byte 0).
__device__ __forceinline__ unsigned pack_low_bytes(unsigned a, unsigned b, unsigned c, unsigned d) {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// Scale/bias cell of lane c in a stage, swizzled so that the 8 lanes 4g + k (one k) read 8
// distinct bank pairs.
__device__ __forceinline__ int sb_cell(int c) { return c ^ (((c >> 4) & 1) << 1); }

// This thread's 8 values of x (columns 8t .. 8t+7; zero past K), as build_x_table takes them.
template <int K>
__device__ __forceinline__ void load_x(const float* __restrict__ x, float4& xa, float4& xb) {
    const int c0 = threadIdx.x * 8;
    xa = make_float4(0.f, 0.f, 0.f, 0.f);
    xb = xa;
    if (c0 < K) {
        xa = __ldcg(reinterpret_cast<const float4*>(x + c0)); // L2: written by the previous kernel
        xb = __ldcg(reinterpret_cast<const float4*>(x + c0 + 4));
    }
}

// The same from x in f64 (the MoE's combine by atomics: moe.cu CL_HSUM), each value rounded to
// the nearest f32 as the combine's f32 sum would be stored.
template <int K>
__device__ __forceinline__ void load_x_f64(const double* __restrict__ x, float4& xa, float4& xb) {
    const int c0 = threadIdx.x * 8;
    xa = make_float4(0.f, 0.f, 0.f, 0.f);
    xb = xa;
    if (c0 < K) {
        const double2* p = reinterpret_cast<const double2*>(x + c0);
        const double2 a = __ldcg(p), b = __ldcg(p + 1), c = __ldcg(p + 2), d = __ldcg(p + 3);
        xa = make_float4((float)a.x, (float)a.y, (float)b.x, (float)b.y);
        xb = make_float4((float)c.x, (float)c.y, (float)d.x, (float)d.y);
    }
}

// The per-block table of B fragments (x as digits, in mma order) and the per-(super-step, t)
// constants. Thread i handles the 8 columns 8i..8i+7, which lie in one group (8 threads per
// group, reduced with shuffles) and fill two adjacent B words for each of the 8 mma columns n.
//
// Where column c lives (cc = c % 128, ks = c / 128, mma m of the super-step, thread t, word r, byte b):
//   4 bits: cc = 32t + 8m + 2b + r   (word m of chunk t: even columns in a0/b0, odd in a2/b1)
//   8 bits: cc = 64j + 16t + 8p + 4r + b, m = 2j + p   (chunk 4j + t, words 2p + r)
// B word (ks, m, lane = 4n + t, r) is at uint4 (2ks + m/2)*32 + lane, component 2(m%2) + r.
//
// With NORM, x is first replaced by the zero-centred RMSNorm of x (kernels/rms_norm.cu, same
// arithmetic in the same order, so the result equals rms_norm_d_model followed by the plain
// GEMV bit for bit): x <- x / sqrt(mean(x^2) + eps) * (1 + nw), nw = this thread's 8 norm
// weights. Must then be called by every thread of the block (one barrier); `ss_red` holds NW
// floats.
template <int BITS, int K, bool NORM>
__device__ __forceinline__ void build_x_table(unsigned char* smem, float4 xa, float4 xb, const float4 (&nw)[2],
                                              float eps, float* ss_red) {
    using C = Cfg<BITS, K>;
    unsigned* btab = reinterpret_cast<unsigned*>(smem);
    float4* cst = reinterpret_cast<float4*>(smem + C::BTAB);
    const int lane = threadIdx.x & 31;
    const int c0 = threadIdx.x * 8;
    const bool live = c0 < K; // warp-uniform (K / 8 is a multiple of 32)
    if (!NORM && !live) return;
    if (NORM) {
        static_assert(!NORM || K / 8 <= THREADS, "one thread per 8 columns");
        float ss = xa.x * xa.x + xa.y * xa.y + xa.z * xa.z + xa.w * xa.w + xb.x * xb.x + xb.y * xb.y + xb.z * xb.z + xb.w * xb.w;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) ss_red[threadIdx.x >> 5] = ss;
        __syncthreads();
        float tot = 0.f;
#pragma unroll
        for (int i = 0; i < K / 256; ++i) tot += ss_red[i]; // the warps holding columns, in order
        const float inv = rsqrtf(tot / float(K) + eps);
        if (!live) return;
        xa = make_float4(xa.x * inv * (1.f + nw[0].x), xa.y * inv * (1.f + nw[0].y), xa.z * inv * (1.f + nw[0].z), xa.w * inv * (1.f + nw[0].w));
        xb = make_float4(xb.x * inv * (1.f + nw[1].x), xb.y * inv * (1.f + nw[1].y), xb.z * inv * (1.f + nw[1].z), xb.w * inv * (1.f + nw[1].w));
    }
    const float v[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    float mx = 0.f, sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        mx = fmaxf(mx, fabsf(v[j]));
        sum += v[j];
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) { // the 8 lanes of this group
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    // w = 2^E with max * 2^-E in [32, 64); groups of zeros (or < 2^-121) get E = -126.
    unsigned eb = (__float_as_uint(mx) >> 23) & 0xFFu;
    const bool finite = eb != 0xFFu && fabsf(sum) <= 3.4e38f;
    eb = eb < 6u ? 6u : (eb > 254u ? 254u : eb);
    const float inv = __uint_as_float((259u - eb) << 23); // 2^-E
    const float w = finite ? __uint_as_float((eb - 5u) << 23) : __int_as_float(0x7fc00000); // NaN poisons the row
    unsigned s[3][8];                                       // digit k of column j in the low byte
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float tq = __fmul_rn(v[j], inv);                // exact, |tq| < 64
        const float a = __fadd_rn(tq, MAGIC);
        const float r1 = __fmul_rn(__fsub_rn(tq, __fsub_rn(a, MAGIC)), 254.f); // |r1| <= 127
        const float b = __fadd_rn(r1, MAGIC);
        const float r2 = __fmul_rn(__fsub_rn(r1, __fsub_rn(b, MAGIC)), 254.f);
        const float c = __fadd_rn(r2, MAGIC);
        s[0][j] = __float_as_uint(a);
        s[1][j] = __float_as_uint(b);
        s[2][j] = __float_as_uint(c);
    }
    uint2 word[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        if (BITS == 4) {
            word[k].x = pack_low_bytes(s[k][0], s[k][2], s[k][4], s[k][6]);
            word[k].y = pack_low_bytes(s[k][1], s[k][3], s[k][5], s[k][7]);
        } else {
            word[k].x = pack_low_bytes(s[k][0], s[k][1], s[k][2], s[k][3]);
            word[k].y = pack_low_bytes(s[k][4], s[k][5], s[k][6], s[k][7]);
        }
    }
    const int ks = c0 >> 7, cc = c0 & 127;
    int t, m, slot;
    if (BITS == 4) {
        t = cc >> 5;
        m = (cc >> 3) & 3;
        slot = t >> 1;
    } else {
        const int j = cc >> 6;
        t = (cc >> 4) & 3;
        m = 2 * j + ((cc >> 3) & 1);
        slot = j;
    }
    uint2* base = reinterpret_cast<uint2*>(btab + ((2 * ks + (m >> 1)) * 32 + t) * 4 + 2 * (m & 1));
    const uint2 zero = make_uint2(0u, 0u);
#pragma unroll
    for (int n = 0; n < 8; ++n) { // lane 4n + t: + 8 uint2 per n
        const bool live = (n >> 2) == slot && (n & 3) < 3;
        base[8 * n] = live ? word[(n & 3) < 3 ? (n & 3) : 0] : zero;
    }
    if ((lane & 7) == 0) { // first thread of the group writes its constants
        const int grp = c0 >> 6;
        float4* cg = cst + (grp >> 1) * 4 + 2 * (grp & 1);
        cg[0] = make_float4(w, w * (1.0f / 254.0f), sum, 0.f);        // t even: digits 0, 1 and the bias sum
        cg[1] = make_float4(w * (1.0f / 64516.0f), 0.f, 0.f, 0.f);     // t odd: digit 2, zero column
    }
}

// One super-step's 4 mmas: 4 bits from words wg/wh (rows g, g+8) of chunk t; 8 bits from the
// 8 words of chunks t and 4+t.
template <int BITS>
__device__ __forceinline__ void super_step(int (&d)[4], const uint4* ag, const uint4* ah, uint4 b0, uint4 b1) {
    const unsigned bw[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
    if (BITS == 4) {
        const unsigned wg[4] = {ag[0].x, ag[0].y, ag[0].z, ag[0].w};
        const unsigned wh[4] = {ah[0].x, ah[0].y, ah[0].z, ah[0].w};
#pragma unroll
        for (int m = 0; m < 4; ++m)
            mma_u8s8(d, wg[m] & 0x0F0F0F0Fu, wh[m] & 0x0F0F0F0Fu, (wg[m] >> 4) & 0x0F0F0F0Fu,
                     (wh[m] >> 4) & 0x0F0F0F0Fu, bw[2 * m], bw[2 * m + 1]);
    } else {
        const unsigned wg[8] = {ag[0].x, ag[0].y, ag[0].z, ag[0].w, ag[1].x, ag[1].y, ag[1].z, ag[1].w};
        const unsigned wh[8] = {ah[0].x, ah[0].y, ah[0].z, ah[0].w, ah[1].x, ah[1].y, ah[1].z, ah[1].w};
#pragma unroll
        for (int m = 0; m < 4; ++m)
            mma_u8s8(d, wg[2 * m], wh[2 * m], wg[2 * m + 1], wh[2 * m + 1], bw[2 * m], bw[2 * m + 1]);
    }
}

// ---------------------------------------------------------------------------------------------
// The MoE router folded into the output projection (gemv_resid_rf_*, RB > 0).
//
// The router reads u = rms_norm(h) = inv · (h ⊙ (1 + nw)), inv = 1/sqrt(mean(h²) + eps), a
// positive scalar of the whole h, so its logits are inv · Σ_c W[r, c] (1 + nw_c) h_c. The block
// that produces rows c of h (the output projection + residual) adds its share of that sum for
// every router row r (N_EXPERTS rows, then the shared-expert gate's row) into racc[r *
// RF_STRIDE], and its rows' Σ h² into racc[(N_EXPERTS + 1) * RF_STRIDE] (f64 atomics: the f32
// shares of 128 blocks add exactly in f64 while they span fewer than ~22 binades, so in practice
// the order of arrival does not change the result; a share that nearly cancels can break that,
// and then the sum may differ in its last f64 bits from run to run). The MoE gate/up and down kernels
// (moe_gate_up_fold_*, moe_down_fold_*) take inv from Σ h², scale the logits and each run the
// top-k; a later down launch zeroes racc again. Router weights in the MLX layout: packed
// [N_EXPERTS][K*RB/8] bytes (element 0 in the low bits), {scale | bias << 16} bf16 per row and
// 64-column group.
constexpr int RF_STRIDE = 16;   // doubles between accumulators: one 128-byte line each (no two share an L2 line)
constexpr int RF_CAP = 16;      // tiles of 16 rows a block may own (the host checks)
struct RouterFold {
    const unsigned char* r_packed;  // [N_EXPERTS][K * RB / 8]
    const unsigned* r_sb;           // [N_EXPERTS][K / 64]
    const unsigned char* g_packed;  // [K * GB / 8]: the shared-expert gate row
    const unsigned* g_sb;           // [K / 64]
    const float* norm_w;            // [K] post_attention_layernorm (zero-centred)
    double* racc;                   // [(N_EXPERTS + 2) * RF_STRIDE], zero on entry
};

using calla_qt::rf_load_row;
using calla_qt::rf_part;

// CHAIN: one GEMV of the persistent chain kernel below (gemv_chain_*): x comes from the
// previous GEMV of the same launch, so instead of calla_pdl_wait() the block waits at the flag
// barrier for epoch `chain_epoch` (every block done with that GEMV); its first weight copies
// are issued before, as before a PDL wait.
// XD: x is f64 (load_x_f64; `x` points at doubles), and block 0 stores x rounded to f32 into
// `xout` (the residual stream the output projection adds to: moe.cu CL_HSUM).
template <int BITS, int K, bool RESID, bool NORM, bool CHAIN = false, int RB = 0, int GB = 0, bool STAGED = false,
          int ST = 0, bool XD = false>
__device__ __forceinline__ void gemv_body(float* __restrict__ out, const unsigned char* __restrict__ packed,
                                          const unsigned short* __restrict__ scales,
                                          const unsigned short* __restrict__ biases, const float* __restrict__ x,
                                          const float* __restrict__ resid, const float* __restrict__ norm_w,
                                          float eps, int rows, int ks_log2, int flags,
                                          const unsigned* chain_flags = nullptr, unsigned chain_epoch = 0,
                                          const RouterFold rf = {}, float* __restrict__ xout = nullptr) {
    using C = Cfg<BITS, K, ST>;
    constexpr int STAGES = C::STAGES;
    constexpr int CPT = C::CPT;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float red[2][NW][16];
    __shared__ float ss_red[NW];
    constexpr bool RF = RB > 0;
    static_assert(!RF || (RESID && !NORM && !CHAIN && GB > 0), "the router fold: output projection + residual only");
    static_assert(!RF || (CALLA_N_EXPERTS + 2 <= THREADS && RF_CAP * 16 <= THREADS), "a thread per router row, Σ h² and stashed row");
    __shared__ float s_h[RF ? RF_CAP * 16 : 1];    // RF: this block's rows of out, by tile slot
    __shared__ float s_nw1[RF ? RF_CAP * 16 : 1];  // RF: 1 + norm weight of those rows
    // STAGED: one mbarrier per ring stage of each warp (a stage is one bulk copy)
    __shared__ __align__(8) unsigned long long s_mbar[STAGED ? NW * STAGES : 1];
    static_assert(!STAGED || !CHAIN, "the chain kernel reads the MLX layout");

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int spu_log2 = C::NSTEP_LOG2 - ks_log2;  // steps per unit (a tile's k-slice)
    const int spu = 1 << spu_log2;
    const int tpb = NW >> ks_log2;                 // tiles per block-iteration
    const int m_tiles = (rows + 15) >> 4;
    const int tile_local = warp >> ks_log2, slice = warp & ((1 << ks_log2) - 1);
    const int n_blk_iters = (m_tiles + tpb - 1) / tpb;
    const int G = gridDim.x, B = blockIdx.x;
    const int n_iters = B < n_blk_iters ? (n_blk_iters - B + G - 1) / G : 0;
    const int total = n_iters << spu_log2;         // steps of this warp (same for the whole block)
    const int step0 = slice << spu_log2;           // first step of this warp's k-slice

    unsigned char* ring = smem + C::RING + warp * (STAGES * C::STAGE_BYTES);
    const unsigned ring_s = calla_smem_u32(ring);
    const unsigned cp_dst = ring_s + lane * 16;                         // + stage + slot * 512
    const unsigned sb_dst = ring_s + C::CODE_BYTES + sb_cell(lane) * 8; // + stage
    const unsigned short* sb_src = (t & 2) ? biases : scales;

    // Producer state: the next step to copy (p_n-th of this warp), its stage, unit and pointers.
    // STAGED: `packed` is the staged layout (lib.rs stage_qmat): per (tile, step) one stage
    // image of STAGE_BYTES, steps of a tile consecutive; lane 0 copies it with one bulk copy.
    int p_n = 0, p_stage = 0, p_ss = 0, p_it = 0;
    bool p_live = false;
    const unsigned char* p_row0 = packed;
    const unsigned char* p_row1 = packed;
    const unsigned short* p_sb = scales;
    unsigned long long* mb = s_mbar + (STAGED ? warp * STAGES : 0);
    if (STAGED) {
        if (lane == 0) {
            for (int i = 0; i < STAGES; ++i) calla_mbar_init(mb + i, 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
    }
#define CALLA_GEMV_UNIT()                                                                          \
    {                                                                                              \
        const int tile = (p_it * G + B) * tpb + tile_local;                                        \
        p_live = tile < m_tiles;                                                                   \
        if (STAGED) {                                                                              \
            p_row0 = packed + ((size_t)tile * C::NSTEP + step0) * C::STAGE_BYTES;                  \
        } else {                                                                                   \
            const int r0 = min(tile * 16 + g, rows - 1), r1 = min(tile * 16 + g + 8, rows - 1);    \
            p_row0 = packed + (size_t)r0 * C::ROW_BYTES + step0 * C::STEP_ROW_BYTES + t * 16;      \
            p_row1 = packed + (size_t)r1 * C::ROW_BYTES + step0 * C::STEP_ROW_BYTES + t * 16;      \
            p_sb = sb_src + (size_t)((t & 1) ? r1 : r0) * C::GPR + 4 * step0;                      \
        }                                                                                          \
    }
#define CALLA_GEMV_ISSUE()                                                                         \
    {                                                                                              \
        if (STAGED && unit_copy) {                                                                 \
            if (p_n == 0 && total > 0 && p_live && lane == 0) { /* the whole unit at once */       \
                calla_mbar_arrive_expect_tx(mb, total * C::STAGE_BYTES);                           \
                calla_bulk_copy(ring, p_row0, total * C::STAGE_BYTES, mb);                         \
            }                                                                                      \
        } else if (STAGED) {                                                                       \
            if (p_n < total && p_live && lane == 0) {                                              \
                calla_fence_proxy_async(); /* the warp's reads of this stage come first */         \
                calla_mbar_arrive_expect_tx(mb + p_stage, C::STAGE_BYTES);                         \
                calla_bulk_copy(ring + p_stage * C::STAGE_BYTES, p_row0, C::STAGE_BYTES, mb + p_stage); \
            }                                                                                      \
        } else {                                                                                   \
            if (p_n < total && p_live) {                                                           \
                const unsigned st = p_stage * C::STAGE_BYTES;                                      \
                _Pragma("unroll") for (int j = 0; j < CPT; ++j) {                                  \
                    cp_async16(cp_dst + st + j * 512, p_row0 + j * 64);                            \
                    cp_async16(cp_dst + st + (CPT + j) * 512, p_row1 + j * 64);                    \
                }                                                                                  \
                cp_async8(sb_dst + st, p_sb);                                                      \
            }                                                                                      \
            cp_async_commit(); /* empty groups keep the count uniform */                           \
        }                                                                                          \
        ++p_n;                                                                                     \
        if (++p_stage == STAGES) p_stage = 0;                                                      \
        if (++p_ss == spu) {                                                                       \
            p_ss = 0;                                                                              \
            ++p_it;                                                                                \
            CALLA_GEMV_UNIT();                                                                     \
        } else if (STAGED) {                                                                       \
            p_row0 += C::STAGE_BYTES;                                                              \
        } else {                                                                                   \
            p_row0 += C::STEP_ROW_BYTES;                                                           \
            p_row1 += C::STEP_ROW_BYTES;                                                           \
            p_sb += 4;                                                                             \
        }                                                                                          \
    }

    // one bulk copy per warp (GEMV_STAGED_UNIT): only when the warp's whole walk is one unit
    // requested before the wait, so every stage is written once and its data arrive together
    const bool unit_copy = STAGED && (flags & GEMV_STAGED_UNIT) && total == spu && spu <= STAGES - 1;
    CALLA_GEMV_UNIT();
    float4 nw[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
    if (NORM && (int)threadIdx.x * 8 < K) { // norm weights: constant, read before the wait
        nw[0] = __ldg(reinterpret_cast<const float4*>(norm_w) + 2 * threadIdx.x);
        nw[1] = __ldg(reinterpret_cast<const float4*>(norm_w) + 2 * threadIdx.x + 1);
    }
    // RF: the block's tile slots li (tiles rf_tile(li), in increasing order), their norm
    // weights, and router row threadIdx.x's codes of the first slot: constant, before the wait
    const int rf_slots = min(n_iters * tpb, RF_CAP); // (the host keeps n_iters * tpb <= RF_CAP)
    auto rf_tile = [&](int li) { return ((li / tpb) * G + B) * tpb + li % tpb; }; // slot li's tile
    uint4 rf_w = make_uint4(0u, 0u, 0u, 0u);
    unsigned rf_sb = 0u;
    if constexpr (RF) {
        if ((int)threadIdx.x < rf_slots * 16) {
            const int li = threadIdx.x >> 4;
            const int row = rf_tile(li) * 16 + (threadIdx.x & 15);
            s_nw1[threadIdx.x] = row < rows ? 1.f + __ldg(rf.norm_w + row) : 0.f;
        }
        const int tile0 = B * tpb;
        if (rf_slots > 0 && tile0 < m_tiles) {
            if ((int)threadIdx.x < CALLA_N_EXPERTS)
                rf_load_row<RB>(rf.r_packed, rf.r_sb, threadIdx.x, tile0, rows, rf_w, rf_sb);
            else if ((int)threadIdx.x == CALLA_N_EXPERTS)
                rf_load_row<GB>(rf.g_packed, rf.g_sb, 0, tile0, rows, rf_w, rf_sb);
        }
    }
    // (a null chain_flags: the chain's first GEMV, whose input predates the launch)
    const bool late = CHAIN && (flags & GEMV_CHAIN_LATE_WEIGHTS);
    if (late && chain_flags != nullptr) calla_flag_wait(chain_flags, chain_epoch);
    // Weights only before the PDL wait. STAGED: STAGED_PRE stages; the rest right after x's loads
    // are issued (a load issued after a block's bulk copies waits behind their data).
    const int PRE = !CHAIN && (flags & GEMV_LATE_WEIGHTS) ? 0
                    : STAGED && !(flags & GEMV_STAGED_ALL_EARLY) ? (STAGED_PRE < STAGES - 1 ? STAGED_PRE : STAGES - 1)
                                                                 : STAGES - 1;
#pragma unroll 1
    for (int s = 0; s < PRE; ++s) CALLA_GEMV_ISSUE();
    if (!CHAIN)
        calla_pdl_wait();
    else if (!late && chain_flags != nullptr)
        calla_flag_wait(chain_flags, chain_epoch);
    const bool early = flags & GEMV_EARLY_TRIGGER;
    if (early) calla_pdl_launch_dependents();
    float4 xa, xb;
    const bool diag_no_table = flags & GEMV_DIAG_NO_TABLE;
    if (diag_no_table) {
    } else if constexpr (XD) {
        load_x_f64<K>(reinterpret_cast<const double*>(x), xa, xb);
    } else {
        load_x<K>(x, xa, xb);
    }
#pragma unroll 1
    for (int s = PRE; s < STAGES - 1; ++s) CALLA_GEMV_ISSUE();
    if constexpr (XD) {
        if (B == 0 && !diag_no_table && (int)threadIdx.x * 8 < K) { // the residual stream in f32
            reinterpret_cast<float4*>(xout)[2 * threadIdx.x] = xa;
            reinterpret_cast<float4*>(xout)[2 * threadIdx.x + 1] = xb;
        }
    }
    if (diag_no_table) {
    } else if (NORM && (flags & GEMV_DIAG_NO_NORM)) {
        build_x_table<BITS, K, false>(smem, xa, xb, nw, eps, ss_red);
    } else {
        build_x_table<BITS, K, NORM>(smem, xa, xb, nw, eps, ss_red);
    }
    __syncthreads();

    const uint4* btab = reinterpret_cast<const uint4*>(smem) + lane;
    const float4* cst = reinterpret_cast<const float4*>(smem + C::BTAB) + t;
    // bf16 (low or high half of a word holding 2 groups) -> f32 bits, by t's group of the super-step
    const unsigned bsel = (t & 2) ? 0x3244u : 0x1044u;
    // this quad's 4 role cells (scales g, g+8, biases g, g+8)
    const int cell0 = sb_cell(4 * g) * 8, cell1 = sb_cell(4 * g + 1) * 8;
    const int cell2 = sb_cell(4 * g + 2) * 8, cell3 = sb_cell(4 * g + 3) * 8;
    const int last_issue = total - (STAGES - 1) > 0 ? total - (STAGES - 1) : 0;
    if (total == 0 && !early) calla_pdl_launch_dependents();
    float acc0 = 0.f, acc1 = 0.f;
    int c_stage = 0, c_ss = 0, c_it = 0;
#pragma unroll 1
    for (int j = 0; j < total; ++j) {
        __syncwarp();
        CALLA_GEMV_ISSUE();
        if (j == last_issue && !early) calla_pdl_launch_dependents(); // every weight copy is queued
        if (STAGED) {
            // this step's stage, unless its tile is past the end (never copied; tiles only run
            // out at the end of a warp's walk, so the phases of the stages stay in step)
            if ((c_it * G + B) * tpb + tile_local < m_tiles) {
                if (!unit_copy)
                    calla_mbar_wait_parity(mb + c_stage, (unsigned)(j / STAGES) & 1u);
                else if (j == 0)
                    calla_mbar_wait_parity(mb, 0u);  // the whole unit
            }
        } else {
            cp_async_wait<STAGES - 1>();
        }
        __syncwarp();
        if (j == total - 1) calla_tl_mark();  // probe: warp 0's last weights are here
        const unsigned char* st = ring + c_stage * C::STAGE_BYTES;
        const int ks = 2 * (step0 + c_ss); // super-step A; B is ks + 1
        uint4 ag[CPT], ah[CPT];
#pragma unroll
        for (int i = 0; i < CPT; ++i) {
            ag[i] = *reinterpret_cast<const uint4*>(st + i * 512 + lane * 16);
            ah[i] = *reinterpret_cast<const uint4*>(st + (CPT + i) * 512 + lane * 16);
        }
        const uint2 s0 = *reinterpret_cast<const uint2*>(st + C::CODE_BYTES + cell0);
        const uint2 s1 = *reinterpret_cast<const uint2*>(st + C::CODE_BYTES + cell1);
        const uint2 s2 = *reinterpret_cast<const uint2*>(st + C::CODE_BYTES + cell2);
        const uint2 s3 = *reinterpret_cast<const uint2*>(st + C::CODE_BYTES + cell3);
        const uint4* bt = btab + ks * 64; // (2ks + i) * 32
        int dA[4] = {0, 0, 0, 0}, dB[4] = {0, 0, 0, 0};
        super_step<BITS>(dA, ag, ah, bt[0], bt[32]);
        super_step<BITS>(dB, ag + CPT / 2, ah + CPT / 2, bt[64], bt[96]);
        const float4 uA = cst[ks * 4], uB = cst[ks * 4 + 4];
        // super-step A: the low word of each cell (its 2 groups), B: the high word
        const float qA0 = fmaf((float)dA[1], uA.y, (float)dA[0] * uA.x); // row g: this thread's share of sum q*x
        const float qA1 = fmaf((float)dA[3], uA.y, (float)dA[2] * uA.x); // row g+8
        const float qB0 = fmaf((float)dB[1], uB.y, (float)dB[0] * uB.x);
        const float qB1 = fmaf((float)dB[3], uB.y, (float)dB[2] * uB.x);
        acc0 = fmaf(__uint_as_float(__byte_perm(s0.x, 0u, bsel)), qA0, acc0);
        acc1 = fmaf(__uint_as_float(__byte_perm(s1.x, 0u, bsel)), qA1, acc1);
        acc0 = fmaf(__uint_as_float(__byte_perm(s2.x, 0u, bsel)), uA.z, acc0);
        acc1 = fmaf(__uint_as_float(__byte_perm(s3.x, 0u, bsel)), uA.z, acc1);
        acc0 = fmaf(__uint_as_float(__byte_perm(s0.y, 0u, bsel)), qB0, acc0);
        acc1 = fmaf(__uint_as_float(__byte_perm(s1.y, 0u, bsel)), qB1, acc1);
        acc0 = fmaf(__uint_as_float(__byte_perm(s2.y, 0u, bsel)), uB.z, acc0);
        acc1 = fmaf(__uint_as_float(__byte_perm(s3.y, 0u, bsel)), uB.z, acc1);
        if (++c_stage == STAGES) c_stage = 0;
        if (++c_ss == spu) { // end of a unit (block-uniform)
            c_ss = 0;
            acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
            acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
            acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
            acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
            const int tile = (c_it * G + B) * tpb + tile_local;
            if (ks_log2 == 0) {
                if (t == 0) {
                    const int r0 = tile * 16 + g, r1 = r0 + 8;
                    const float v0 = RESID ? __ldcg(resid + min(r0, rows - 1)) + acc0 : acc0;
                    const float v1 = RESID ? __ldcg(resid + min(r1, rows - 1)) + acc1 : acc1;
                    if (r0 < rows) out[r0] = v0;
                    if (r1 < rows) out[r1] = v1;
                    if (RF && c_it * tpb + tile_local < RF_CAP) {
                        s_h[(c_it * tpb + tile_local) * 16 + g] = r0 < rows ? v0 : 0.f;
                        s_h[(c_it * tpb + tile_local) * 16 + g + 8] = r1 < rows ? v1 : 0.f;
                    }
                }
            } else {
                float* rb = red[c_it & 1][warp];
                if (t == 0) {
                    rb[g] = acc0;
                    rb[g + 8] = acc1;
                }
                __syncthreads(); // red[c_it & 1] is rewritten two iterations later, after the next barrier
                if (slice == 0 && lane < 16) {
                    float v = 0.f;
                    for (int s = 0; s < (1 << ks_log2); ++s) v += red[c_it & 1][warp + s][lane];
                    const int r = tile * 16 + lane;
                    const float o = RESID && r < rows ? __ldcg(resid + r) + v : v;
                    if (r < rows) out[r] = o;
                    if (RF && c_it * tpb + tile_local < RF_CAP) s_h[(c_it * tpb + tile_local) * 16 + lane] = r < rows ? o : 0.f;
                }
            }
            acc0 = 0.f;
            acc1 = 0.f;
            ++c_it;
        }
    }
    cp_async_wait<0>();
    if constexpr (RF) if (!(flags & GEMV_DIAG_NO_FOLD)) { // this block's share of every router row's logit (see RouterFold)
        __syncthreads(); // s_h complete
        const int r = threadIdx.x;
        if (r <= CALLA_N_EXPERTS) {
            float part = 0.f;
            for (int li = 0; li < rf_slots; ++li) {
                const int tile = rf_tile(li);
                if (tile >= m_tiles) break; // slots go up in tile order
                uint4 w = rf_w;
                unsigned sbw = rf_sb;
                if (li > 0) {
                    if (r < CALLA_N_EXPERTS)
                        rf_load_row<RB>(rf.r_packed, rf.r_sb, r, tile, rows, w, sbw);
                    else
                        rf_load_row<GB>(rf.g_packed, rf.g_sb, 0, tile, rows, w, sbw);
                }
                part += r < CALLA_N_EXPERTS ? rf_part<RB>(w, sbw, s_h + li * 16, s_nw1 + li * 16)
                                            : rf_part<GB>(w, sbw, s_h + li * 16, s_nw1 + li * 16);
            }
            atomicAdd(rf.racc + r * RF_STRIDE, (double)part);
        } else if (r == CALLA_N_EXPERTS + 1) { // Σ h² of this block's rows
            float ss = 0.f;
            for (int li = 0; li < rf_slots; ++li) {
                if (rf_tile(li) >= m_tiles) break;
#pragma unroll
                for (int c = 0; c < 16; ++c) ss = fmaf(s_h[li * 16 + c], s_h[li * 16 + c], ss);
            }
            atomicAdd(rf.racc + r * RF_STRIDE, (double)ss);
        }
    }
#ifdef CALLA_TIMELINE
    __syncthreads();  // probe: the block's work is done
    calla_tl_done();
#endif
#undef CALLA_GEMV_UNIT
#undef CALLA_GEMV_ISSUE
}

}  // namespace calla_gemv

// One pair of entry points per (bits, K) the model uses. K values come from the dims header.
// Launch: THREADS threads, calla_gemv::Cfg<BITS, K>::SMEM bytes of dynamic shared memory (the
// host computes the same number, see crates/cuda/src/lib.rs `gemv_smem_bytes`), at most one
// block per SM, 0 <= ks_log2 <= min(log2 NW, log2(K / 256)); flags: calla_gemv::GEMV_* bits.
#define CALLA_GEMV_ENTRY(NAME, RNAME, BITS, K)                                                              \
    extern "C" __global__ void __launch_bounds__(calla_gemv::THREADS, 1)                                    \
        NAME(float* __restrict__ out, const unsigned char* __restrict__ packed,                            \
             const unsigned short* __restrict__ scales, const unsigned short* __restrict__ biases,         \
             const float* __restrict__ x, int rows, int ks_log2, int flags) {                              \
        calla_gemv::gemv_body<BITS, K, false, false>(out, packed, scales, biases, x, nullptr, nullptr, 0.f, \
                                                     rows, ks_log2, flags);                                \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(calla_gemv::THREADS, 1)                                    \
        RNAME(float* __restrict__ out, const unsigned char* __restrict__ packed,                           \
              const unsigned short* __restrict__ scales, const unsigned short* __restrict__ biases,        \
              const float* __restrict__ x, const float* __restrict__ resid, int rows, int ks_log2,         \
              int flags) {                                                                                  \
        calla_gemv::gemv_body<BITS, K, true, false>(out, packed, scales, biases, x, resid, nullptr, 0.f,  \
                                                    rows, ks_log2, flags);                                 \
    }

// RMSNorm of x (weights norm_w f32 [K], eps) fused in front: the projections out of the residual
// stream (input_layernorm -> in_proj / q|gate|k|v, final norm -> LM head). QUALS is one of:
//   CALLA_GEMV_ONE_PER_SM: __launch_bounds__(THREADS, 1), as the other entry points;
//   CALLA_GEMV_56_REGS: at most 56 registers per thread (__maxnreg__, which excludes
//     __launch_bounds__): 16 warps x 56 = 28,672 registers, meant to fit on an SM beside a 4-bit
//     moe_down block (576 threads x 64 = 36,864 of the 65,536). Measured faster (the default;
//     the host's CudaContext::set_gemv_reg_cap picks), but not for that reason: the kernel
//     timeline shows the blocks do not land beside moe_down (registers are allocated per SM
//     sub-partition of 16,384: moe_down's 18 warps of 64 registers put 5 in two of them, 10,240,
//     and 4 GEMV warps x 56 x 32 do not fit beside them; nor does the shared memory below the
//     largest carve-out). A variant at 48 registers with a 3-stage ring (127 KB), sized to fit
//     beside moe_down, landed but ran slower (1,440 against 1,339 us per token; commit
//     fe51d13, docs/CUDA.md) and was removed.
#define CALLA_GEMV_ONE_PER_SM __launch_bounds__(calla_gemv::THREADS, 1)
#define CALLA_GEMV_56_REGS __maxnreg__(56)
// STAGED: `packed` is the staged layout (crates/cuda/src/lib.rs `stage_qmat`; scales and biases
// unused), each warp's steps arrive by bulk copies (TMA) on per-stage mbarriers.
#define CALLA_GEMV_NORM_ENTRY_S(NAME, BITS, K, QUALS, STAGED)                                               \
    extern "C" __global__ void QUALS                                                                       \
        NAME(float* __restrict__ out, const unsigned char* __restrict__ packed,                            \
             const unsigned short* __restrict__ scales, const unsigned short* __restrict__ biases,         \
             const float* __restrict__ x, const float* __restrict__ norm_w, float eps, int rows,           \
             int ks_log2, int flags) {                                                                     \
        calla_gemv::gemv_body<BITS, K, false, true, false, 0, 0, STAGED>(out, packed, scales, biases, x,   \
                                                                         nullptr, norm_w, eps, rows,       \
                                                                         ks_log2, flags);                  \
    }
#define CALLA_GEMV_NORM_ENTRY(NAME, BITS, K, QUALS) CALLA_GEMV_NORM_ENTRY_S(NAME, BITS, K, QUALS, false)
// The same with x in f64 (xd: the MoE's sums by atomics, moe.cu CL_HSUM), rounded to f32 as it
// is read; block 0 also stores that f32 x into xout (the residual stream).
#define CALLA_GEMV_NORM_XD_ENTRY(NAME, BITS, K, QUALS)                                                     \
    extern "C" __global__ void QUALS                                                                       \
        NAME(float* __restrict__ out, const unsigned char* __restrict__ packed,                            \
             const unsigned short* __restrict__ scales, const unsigned short* __restrict__ biases,         \
             const double* __restrict__ xd, float* __restrict__ xout, const float* __restrict__ norm_w,    \
             float eps, int rows, int ks_log2, int flags) {                                                \
        calla_gemv::gemv_body<BITS, K, false, true, false, 0, 0, false, 0, true>(                           \
            out, packed, scales, biases, reinterpret_cast<const float*>(xd), nullptr, norm_w, eps, rows,   \
            ks_log2, flags, nullptr, 0, calla_gemv::RouterFold{}, xout);                                   \
    }

// The output projection + residual with the MoE router folded in (see RouterFold): out [D_MODEL]
// as gemv_resid_*, and every router row's share added into racc. rows = D_MODEL (= the router's
// K); the grid may give a block at most RF_CAP tiles (the host checks).
#define CALLA_GEMV_RF_ENTRY_X(NAME, BITS, K, RB, GB, STAGED, QUALS, ST)                                    \
    extern "C" __global__ void QUALS                                                                       \
        NAME(float* __restrict__ out, const unsigned char* __restrict__ packed,                            \
             const unsigned short* __restrict__ scales, const unsigned short* __restrict__ biases,         \
             const float* __restrict__ x, const float* __restrict__ resid, int rows, int ks_log2,         \
             int flags, const unsigned char* __restrict__ r_packed, const unsigned* __restrict__ r_sb,     \
             const unsigned char* __restrict__ g_packed, const unsigned* __restrict__ g_sb,                \
             const float* __restrict__ norm_w, double* racc) {                                             \
        calla_gemv::gemv_body<BITS, K, true, false, false, RB, GB, STAGED, ST>(                             \
            out, packed, scales, biases, x, resid, nullptr, 0.f, rows, ks_log2, flags, nullptr, 0,          \
            calla_gemv::RouterFold{r_packed, r_sb, g_packed, g_sb, norm_w, racc});                          \
    }
#define CALLA_GEMV_RF_ENTRY_S(NAME, BITS, K, RB, GB, STAGED) \
    CALLA_GEMV_RF_ENTRY_X(NAME, BITS, K, RB, GB, STAGED, CALLA_GEMV_ONE_PER_SM, 0)
#define CALLA_GEMV_RF_ENTRY(NAME, BITS, K, RB, GB) CALLA_GEMV_RF_ENTRY_S(NAME, BITS, K, RB, GB, false)
// Slim output projections (lib.rs OutProjVariant; c88s3 is the decode step's default,
// OUT_PROJ_VARIANT), the MLX layout at 4 bits: at most 88 registers per thread (c88: 16 warps x
// 88 = 45,056 registers, and per SM sub-partition 4 x 88 x 32 = 11,264 beside gdn_decode_step's
// two warps of 64, 4,096, within 16,384; the wide entry points above take 102 and cannot), and
// with a ring of 3 stages instead of 5 (c88s3: 142 KiB of dynamic shared memory instead of 214,
// so that a block also fits beside attn_decode_combine's 9 KB). On its default grid (one 16-row
// tile per block, K split 16) a warp walks one step, so 3 stages still request all of its
// weights before the PDL wait. Meant to let the output projection's blocks land, and stream
// their weights, while the GDN step or the attention combine still runs.
#define CALLA_GEMV_88_REGS __maxnreg__(88)
CALLA_GEMV_RF_ENTRY_X(gemv_resid_rf_c88_r4_g4_q4_k4096, 4, CALLA_ATTN_OUT, 4, 4, false, CALLA_GEMV_88_REGS, 0)
CALLA_GEMV_RF_ENTRY_X(gemv_resid_rf_c88_r4_g8_q4_k4096, 4, CALLA_ATTN_OUT, 4, 8, false, CALLA_GEMV_88_REGS, 0)
CALLA_GEMV_RF_ENTRY_X(gemv_resid_rf_c88_r8_g4_q4_k4096, 4, CALLA_ATTN_OUT, 8, 4, false, CALLA_GEMV_88_REGS, 0)
CALLA_GEMV_RF_ENTRY_X(gemv_resid_rf_c88_r8_g8_q4_k4096, 4, CALLA_ATTN_OUT, 8, 8, false, CALLA_GEMV_88_REGS, 0)
CALLA_GEMV_RF_ENTRY_X(gemv_resid_rf_c88s3_r4_g4_q4_k4096, 4, CALLA_ATTN_OUT, 4, 4, false, CALLA_GEMV_88_REGS, 3)
CALLA_GEMV_RF_ENTRY_X(gemv_resid_rf_c88s3_r4_g8_q4_k4096, 4, CALLA_ATTN_OUT, 4, 8, false, CALLA_GEMV_88_REGS, 3)
CALLA_GEMV_RF_ENTRY_X(gemv_resid_rf_c88s3_r8_g4_q4_k4096, 4, CALLA_ATTN_OUT, 8, 4, false, CALLA_GEMV_88_REGS, 3)
CALLA_GEMV_RF_ENTRY_X(gemv_resid_rf_c88s3_r8_g8_q4_k4096, 4, CALLA_ATTN_OUT, 8, 8, false, CALLA_GEMV_88_REGS, 3)
// the same with 4-bit weights in the staged layout (TMA)
CALLA_GEMV_RF_ENTRY_S(gemv_resid_rf_r4_g4_s4_k4096, 4, CALLA_ATTN_OUT, 4, 4, true)
CALLA_GEMV_RF_ENTRY_S(gemv_resid_rf_r4_g8_s4_k4096, 4, CALLA_ATTN_OUT, 4, 8, true)
CALLA_GEMV_RF_ENTRY_S(gemv_resid_rf_r8_g4_s4_k4096, 4, CALLA_ATTN_OUT, 8, 4, true)
CALLA_GEMV_RF_ENTRY_S(gemv_resid_rf_r8_g8_s4_k4096, 4, CALLA_ATTN_OUT, 8, 8, true)
CALLA_GEMV_RF_ENTRY(gemv_resid_rf_r4_g4_q4_k4096, 4, CALLA_ATTN_OUT, 4, 4)
CALLA_GEMV_RF_ENTRY(gemv_resid_rf_r4_g8_q4_k4096, 4, CALLA_ATTN_OUT, 4, 8)
CALLA_GEMV_RF_ENTRY(gemv_resid_rf_r8_g4_q4_k4096, 4, CALLA_ATTN_OUT, 8, 4)
CALLA_GEMV_RF_ENTRY(gemv_resid_rf_r8_g8_q4_k4096, 4, CALLA_ATTN_OUT, 8, 8)
CALLA_GEMV_RF_ENTRY(gemv_resid_rf_r4_g4_q8_k4096, 8, CALLA_ATTN_OUT, 4, 4)
CALLA_GEMV_RF_ENTRY(gemv_resid_rf_r4_g8_q8_k4096, 8, CALLA_ATTN_OUT, 4, 8)
CALLA_GEMV_RF_ENTRY(gemv_resid_rf_r8_g4_q8_k4096, 8, CALLA_ATTN_OUT, 8, 4)
CALLA_GEMV_RF_ENTRY(gemv_resid_rf_r8_g8_q8_k4096, 8, CALLA_ATTN_OUT, 8, 8)

// K = D_EXPERT (expert / shared-expert down projection)
CALLA_GEMV_ENTRY(gemv_q4_k512, gemv_resid_q4_k512, 4, CALLA_D_EXPERT)
CALLA_GEMV_ENTRY(gemv_q8_k512, gemv_resid_q8_k512, 8, CALLA_D_EXPERT)
// K = D_MODEL (every projection out of the residual stream, LM head)
CALLA_GEMV_ENTRY(gemv_q4_k2048, gemv_resid_q4_k2048, 4, CALLA_D_MODEL)
CALLA_GEMV_ENTRY(gemv_q8_k2048, gemv_resid_q8_k2048, 8, CALLA_D_MODEL)
CALLA_GEMV_NORM_ENTRY(gemv_norm_q4_k2048, 4, CALLA_D_MODEL, CALLA_GEMV_ONE_PER_SM)
CALLA_GEMV_NORM_ENTRY(gemv_norm_q8_k2048, 8, CALLA_D_MODEL, CALLA_GEMV_ONE_PER_SM)
CALLA_GEMV_NORM_ENTRY(gemv_norm_r56_q4_k2048, 4, CALLA_D_MODEL, CALLA_GEMV_56_REGS)
CALLA_GEMV_NORM_ENTRY(gemv_norm_r56_q8_k2048, 8, CALLA_D_MODEL, CALLA_GEMV_56_REGS)
CALLA_GEMV_NORM_ENTRY_S(gemv_norm_r56_s4_k2048, 4, CALLA_D_MODEL, CALLA_GEMV_56_REGS, true)
CALLA_GEMV_NORM_XD_ENTRY(gemv_norm_xd_q4_k2048, 4, CALLA_D_MODEL, CALLA_GEMV_ONE_PER_SM)
CALLA_GEMV_NORM_XD_ENTRY(gemv_norm_xd_q8_k2048, 8, CALLA_D_MODEL, CALLA_GEMV_ONE_PER_SM)
CALLA_GEMV_NORM_XD_ENTRY(gemv_norm_r56_xd_q4_k2048, 4, CALLA_D_MODEL, CALLA_GEMV_56_REGS)
CALLA_GEMV_NORM_XD_ENTRY(gemv_norm_r56_xd_q8_k2048, 8, CALLA_D_MODEL, CALLA_GEMV_56_REGS)
// K = N_Q_HEADS * HEAD_DIM = N_V_HEADS * D_V (attention o_proj, GDN out_proj)
CALLA_GEMV_ENTRY(gemv_q4_k4096, gemv_resid_q4_k4096, 4, CALLA_ATTN_OUT)
CALLA_GEMV_ENTRY(gemv_q8_k4096, gemv_resid_q8_k4096, 8, CALLA_ATTN_OUT)

// Measurement only (cuda_selftest section `chain`): `layers` 4-bit GEMVs in ONE persistent
// launch, alternating W_a [ATTN_OUT, D_MODEL] (xb -> xa) and W_b [D_MODEL, ATTN_OUT] (xa -> xb),
// copy (l / 2) % copies of each (stacked: copy c's rows follow copy c-1's), separated by split
// flag barriers (calla_flag_arrive after a GEMV's outputs, calla_flag_wait before the next one
// reads them; its weight copies are issued in between). Against the same GEMVs as separate
// kernels under PDL, it prices the persistent decode kernel of docs/CUDA.md: a phase boundary
// as a flag barrier with the weights already requested, instead of a launch. Launch: a
// cooperative grid (every block resident) of THREADS threads, Cfg<4, ATTN_OUT>::SMEM bytes of
// dynamic shared memory; ks_a / ks_b as the host's GEMV split for the two shapes on that grid;
// flags[gridDim.x] all <= base, left at base + layers (GEMV l > 0 waits for epoch base + l,
// which every block's arrival after GEMV l - 1 publishes; GEMV 0 waits for nothing more than
// the launch's own PDL wait); gemv_flags: calla_gemv::GEMV_CHAIN_LATE_WEIGHTS or 0.
extern "C" __global__ void __launch_bounds__(calla_gemv::THREADS, 1)
    gemv_chain_q4(float* __restrict__ xa, float* __restrict__ xb, const unsigned char* __restrict__ pa,
                  const unsigned short* __restrict__ sa, const unsigned short* __restrict__ ba,
                  const unsigned char* __restrict__ pb, const unsigned short* __restrict__ sb,
                  const unsigned short* __restrict__ bb, int copies, int layers, int ks_a, int ks_b,
                  unsigned* flags, unsigned base, int gemv_flags) {
    constexpr int D = CALLA_D_MODEL, E = CALLA_ATTN_OUT;
    constexpr size_t W_BYTES = (size_t)D * E / 2;   // codes of one copy (either shape)
    constexpr size_t W_GROUPS = (size_t)D * E / 64; // scales (or biases) of one copy
    calla_pdl_wait();
    for (int l = 0; l < layers; ++l) {
        const size_t c = (size_t)((l / 2) % copies);
        if (l % 2 == 0)
            calla_gemv::gemv_body<4, D, false, false, true>(xa, pa + c * W_BYTES, sa + c * W_GROUPS, ba + c * W_GROUPS, xb,
                                                            nullptr, nullptr, 0.f, E, ks_a, gemv_flags, l ? flags : nullptr, base + l);
        else
            calla_gemv::gemv_body<4, E, false, false, true>(xb, pb + c * W_BYTES, sb + c * W_GROUPS, bb + c * W_GROUPS, xa,
                                                            nullptr, nullptr, 0.f, D, ks_b, gemv_flags, l ? flags : nullptr, base + l);
        calla_flag_arrive(flags, base + l + 1);
    }
}
