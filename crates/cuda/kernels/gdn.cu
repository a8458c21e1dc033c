// Gated DeltaNet decode step, batch 1, one token (docs/MODEL.md §3.5 steps 2-6 and step 8's
// gated RMSNorm; state layout §4). One launch does: causal conv + SiLU over the token's
// pre-conv q|k|v channels and the conv-state shift, L2 norm of q and k (q scaled by d_k^-1/2),
// the gates, the delta-rule update of the recurrent state S and its read-out, and the gated
// RMSNorm of the output.
//
// Buffers (f32):
//   proj        [conv_dim | n_v*d_v | n_v | n_v]: pre-conv q|k|v, then z, b, a (in_proj output)
//   conv_w      [conv_dim, 4] depthwise taps, tap 3 on the current token
//   conv_state  [3, conv_dim] last three pre-conv rows, oldest first (updated)
//   s           [n_v, d_k, d_v] recurrent state, row = key dim (HF layout; updated)
//   out         [n_v * d_v] gated-normed output, head-major (input of out_proj)
//
// Work split: V-head j's 128 value columns are split over COL_BLOCKS blocks (columns of S are
// independent in the recurrence); each block keeps its [d_k, COLS] slice of S in registers.
// The blocks of the V_PER_K V-heads that share one QK head form a thread-block cluster (8
// blocks): every block recomputes that QK head's q and k (256 channels, cheap), so no data
// has to move between blocks before the recurrence. Inside the cluster:
//   * each block sends its partial sum of o^2 (gated norm) to every block of the cluster with
//     st.async into slot [its rank] of their shared memory, counted on their mbarrier (32
//     bytes expected). A block sums the COL_BLOCKS slots of its V-head in rank order, so the
//     siblings agree bit for bit. No barrier.cluster.arrive.release (which compiles to
//     MEMBAR.ALL.GPU) and no remote reads, so a block may exit as soon as its mbarrier is done.
//   * the arrival of all CLUSTER sums also tells a block that every block of the cluster is
//     past its prologue, i.e. done reading the q/k channels of the conv state (only this
//     cluster reads them): only then are they shifted, each channel by one owner block. The v
//     channels have a single reader, which shifts them at once.
//   * one cluster barrier: arrive (relaxed) at the start after the mbarrier init, wait before
//     the first st.async (DSMEM needs the target block to have started).
//
// PDL: weights, S and the conv state are loaded before griddepcontrol.wait (only proj comes
// from the previous kernel). S and the conv state are written by this kernel alone, once per
// decode step: the previous writer is this kernel one step earlier (an earlier graph launch,
// or an earlier kernel of a PDL chain in which every kernel waits before it triggers). A
// kernel that writes them (reset, snapshot restore) must not be a PDL predecessor in the
// same chain without that rule.
//
// Math per block (V-head j, QK head i = j / V_PER_K, columns [c0, c0 + COLS)):
//   q, k = SiLU(conv(...)) raw;  inv_q = 1/sqrt(|q|^2 + 1e-6), inv_k likewise
//   R = S^T k (raw), Q = S^T q (raw), both from the state before the update, in one pass
//   r = alpha * inv_k * R                               (= (alpha S)^T k_hat)
//   delta = beta * (v - r)
//   S <- alpha * S + k_hat delta^T
//   o = alpha * inv_q * scale * Q + (k_hat . q_hat) * delta   (= S_new^T q_hat, exactly in
//                                                              real arithmetic)
//   out = norm_w * (o / sqrt(mean_head(o^2) + eps)) * SiLU(z)

#ifndef CALLA_N_V_HEADS
#error "dims header missing"
#endif

namespace calla_gdn {

constexpr int NK = CALLA_N_K_HEADS;
constexpr int NV = CALLA_N_V_HEADS;
constexpr int DK = CALLA_D_K;
constexpr int DV = CALLA_D_V;
using calla_gdn_layout::KEY_DIM;
using calla_gdn_layout::CONV_DIM;
using calla_gdn_layout::Z_OFF;
using calla_gdn_layout::B_OFF;
using calla_gdn_layout::A_OFF;
constexpr int V_PER_K = NV / NK;             // V-heads per QK head (consecutive grouping)
constexpr int COL_BLOCKS = 4;                // blocks per V-head
constexpr int COLS = DV / COL_BLOCKS;        // value columns per block
constexpr int CLUSTER = V_PER_K * COL_BLOCKS;
constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int C4 = COLS / 4;                 // threads across a row segment (float4 each)
constexpr int RG = THREADS / C4;             // row groups
constexpr int RPT = DK / RG;                 // rows per thread: rg, rg + RG, ...
constexpr int QK_OWN = DK / CLUSTER;         // q/k conv-state channels written per block
constexpr float L2_EPS = 1e-6f;              // l2norm epsilon (inside the sum), as in the reference

static_assert(CALLA_CONV_KERNEL == 4, "conv taps are read as one float4");
static_assert(NV % NK == 0, "V heads must group evenly over QK heads");
static_assert(CLUSTER <= 8, "portable cluster size");
static_assert(DV % (4 * COL_BLOCKS) == 0 && 32 % C4 == 0, "column split");
static_assert(RG * C4 == THREADS && DK % RG == 0, "row split");
static_assert(DK % 32 == 0 && DK + COLS + 1 <= THREADS, "thread roles of the prologue");
static_assert(DK % CLUSTER == 0, "conv-state ownership");

__device__ __forceinline__ float sigmoid_acc(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_acc(float x) { return x * sigmoid_acc(x); }
// PyTorch softplus (threshold 20): x for x > 20, else log(1 + e^x).
__device__ __forceinline__ float softplus_acc(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Causal conv of one channel: taps (w.x .. w.z) on the three cached rows, w.w on the current
// input; then SiLU.
__device__ __forceinline__ float conv_silu(float4 w, float s0, float s1, float s2, float x) {
    float acc = w.x * s0;
    acc = fmaf(w.y, s1, acc);
    acc = fmaf(w.z, s2, acc);
    acc = fmaf(w.w, x, acc);
    return silu_acc(acc);
}

// Loads issued as volatile asm: they stay in program order relative to the PDL wait (the
// compiler moves ordinary read-only loads across it). Coherent for buffers this kernel also
// writes, .nc for weights. No memory clobber: the wait (which has one) separates them from
// every store of the kernel.
__device__ __forceinline__ float ld_f(const float* p) {
    float v;
    asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ld_f4(const float* p) {
    float4 v;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float ld_nc_f(const float* p) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ld_nc_f4(const float* p) {
    float4 v;
    asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// The step for the block of V-head j, columns [c0, c0 + COLS) (see the file header).
__device__ __forceinline__ void step(float* __restrict__ out, float* __restrict__ s, float* __restrict__ conv_state,
                                     const float* __restrict__ proj, const float* __restrict__ conv_w,
                                     const float* __restrict__ a_neg_exp, const float* __restrict__ dt_bias,
                                     const float* __restrict__ norm_w) {
    __shared__ float q_s[DK], k_s[DK];             // raw (conv + SiLU) q and k of QK head i
    __shared__ float v_s[COLS], sz_s[COLS], w_s[COLS];  // v, SiLU(z), norm weight of the columns
    __shared__ float part_s[DK / 32][3];           // per-warp |q|^2, |k|^2, q.k
    __shared__ float gate_s[2];                    // alpha, beta
    __shared__ __align__(16) float red_s[2][WARPS][COLS];  // per-warp S^T k, S^T q
    __shared__ float ssq_s[CLUSTER];               // sum of o^2 of every block of the cluster, by rank
    __shared__ __align__(8) unsigned long long mbar;  // completes when all CLUSTER sums arrived

    const int t = threadIdx.x;
    const unsigned rank = calla_cluster_ctarank();
    const int i = (int)calla_cluster_id_x();             // QK head of the cluster
    const int j = i * V_PER_K + (int)rank / COL_BLOCKS;  // V head of the block
    const int c0 = ((int)rank % COL_BLOCKS) * COLS;
    const int c4 = t % C4, rg = t / C4;
    const int lane = t & 31, warp = t >> 5;

    if (t == 0) calla_mbar_init_expect(&mbar, CLUSTER * sizeof(float));
    calla_cluster_arrive_relaxed();  // "started, mbarrier ready"; waited for before the first send

    // --- loads that do not depend on the previous kernel, before the PDL wait: weights, and
    // S and the conv state, which only this kernel writes (once per decode step; the previous
    // step is an earlier graph launch). Every load is issued here, before any arithmetic.
    int ch = -1;  // conv channel of this thread (q role, or v role)
    if (t < DK) ch = i * DK + t;
    else if (t < DK + COLS) ch = 2 * KEY_DIM + j * DV + c0 + (t - DK);
    float* srow = s + (size_t)j * DK * DV + c0 + 4 * c4;
    float4 S[RPT];
#pragma unroll
    for (int m = 0; m < RPT; ++m) S[m] = ld_f4(srow + (size_t)(rg + RG * m) * DV);
    float4 wq = make_float4(0.f, 0.f, 0.f, 0.f), wk = wq;
    float x0 = 0.f, x1 = 0.f, x2 = 0.f, y0 = 0.f, y1 = 0.f, y2 = 0.f;  // cached rows: q (or v), k
    float nw = 0.f, ane = 0.f, dtb = 0.f;
    if (ch >= 0) {
        wq = ld_nc_f4(conv_w + 4 * ch);
        x0 = ld_f(conv_state + ch);
        x1 = ld_f(conv_state + CONV_DIM + ch);
        x2 = ld_f(conv_state + 2 * CONV_DIM + ch);
    }
    if (t < DK) {
        const int kc = KEY_DIM + ch;
        wk = ld_nc_f4(conv_w + 4 * kc);
        y0 = ld_f(conv_state + kc);
        y1 = ld_f(conv_state + CONV_DIM + kc);
        y2 = ld_f(conv_state + 2 * CONV_DIM + kc);
    } else if (t < DK + COLS) {
        nw = ld_nc_f(norm_w + c0 + (t - DK));
    } else if (t == DK + COLS) {
        ane = ld_nc_f(a_neg_exp + j);
        dtb = ld_nc_f(dt_bias + j);
    }

    calla_pdl_wait();

    // --- proj, written by the previous kernel
    float xx = 0.f, yx = 0.f;  // current pre-conv q (or v) and k; z; or a and b
    if (t < DK) {
        xx = ld_f(proj + ch);
        yx = ld_f(proj + KEY_DIM + ch);
    } else if (t < DK + COLS) {
        xx = ld_f(proj + ch);
        yx = ld_f(proj + Z_OFF + j * DV + c0 + (t - DK));
    } else if (t == DK + COLS) {
        xx = ld_f(proj + A_OFF + j);
        yx = ld_f(proj + B_OFF + j);
    }

    // --- prologue: conv + SiLU, gates
    if (t < DK) {
        const float qv = conv_silu(wq, x0, x1, x2, xx);
        const float kv = conv_silu(wk, y0, y1, y2, yx);
        q_s[t] = qv;
        k_s[t] = kv;
        const float qq = calla_warp_sum(qv * qv), kk = calla_warp_sum(kv * kv), qk = calla_warp_sum(qv * kv);
        if (lane == 0) {
            part_s[warp][0] = qq;
            part_s[warp][1] = kk;
            part_s[warp][2] = qk;
        }
    } else if (t < DK + COLS) {
        // v channel of this block's columns: the only reader, so it shifts the state itself
        const int cc = t - DK;
        v_s[cc] = conv_silu(wq, x0, x1, x2, xx);
        conv_state[ch] = x1;
        conv_state[CONV_DIM + ch] = x2;
        conv_state[2 * CONV_DIM + ch] = xx;
        sz_s[cc] = silu_acc(yx);
        w_s[cc] = nw;
    } else if (t == DK + COLS) {
        // g = -exp(A_log) * softplus(a + dt_bias); alpha = exp(g); beta = sigmoid(b)
        const float g = ane * softplus_acc(xx + dtb);
        gate_s[0] = expf(g);
        gate_s[1] = sigmoid_acc(yx);
    }
    __syncthreads();
    calla_pdl_launch_dependents();

    float qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
    for (int w = 0; w < DK / 32; ++w) {
        qq += part_s[w][0];
        kk += part_s[w][1];
        qk += part_s[w][2];
    }
    const float scale = 1.0f / sqrtf((float)DK);
    const float inv_q = 1.0f / sqrtf(qq + L2_EPS), inv_k = 1.0f / sqrtf(kk + L2_EPS);
    const float alpha = gate_s[0], beta = gate_s[1];

    // --- R = S^T k, Q = S^T q (raw q, k) over this thread's rows, then over the block
    float4 pk = make_float4(0.f, 0.f, 0.f, 0.f), pq = pk;
    float khat[RPT];
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
        const int row = rg + RG * m;
        const float kr = k_s[row], qr = q_s[row];
        khat[m] = kr * inv_k;
        pk.x = fmaf(S[m].x, kr, pk.x); pk.y = fmaf(S[m].y, kr, pk.y);
        pk.z = fmaf(S[m].z, kr, pk.z); pk.w = fmaf(S[m].w, kr, pk.w);
        pq.x = fmaf(S[m].x, qr, pq.x); pq.y = fmaf(S[m].y, qr, pq.y);
        pq.z = fmaf(S[m].z, qr, pq.z); pq.w = fmaf(S[m].w, qr, pq.w);
    }
#pragma unroll
    for (int o = C4; o < 32; o <<= 1) {
        pk.x += __shfl_xor_sync(0xffffffffu, pk.x, o); pk.y += __shfl_xor_sync(0xffffffffu, pk.y, o);
        pk.z += __shfl_xor_sync(0xffffffffu, pk.z, o); pk.w += __shfl_xor_sync(0xffffffffu, pk.w, o);
        pq.x += __shfl_xor_sync(0xffffffffu, pq.x, o); pq.y += __shfl_xor_sync(0xffffffffu, pq.y, o);
        pq.z += __shfl_xor_sync(0xffffffffu, pq.z, o); pq.w += __shfl_xor_sync(0xffffffffu, pq.w, o);
    }
    if (lane < C4) {
        reinterpret_cast<float4*>(red_s[0][warp])[lane] = pk;
        reinterpret_cast<float4*>(red_s[1][warp])[lane] = pq;
    }
    __syncthreads();
    float4 R = make_float4(0.f, 0.f, 0.f, 0.f), Q = R;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const float4 a = reinterpret_cast<const float4*>(red_s[0][w])[c4];
        const float4 b = reinterpret_cast<const float4*>(red_s[1][w])[c4];
        R.x += a.x; R.y += a.y; R.z += a.z; R.w += a.w;
        Q.x += b.x; Q.y += b.y; Q.z += b.z; Q.w += b.w;
    }

    // --- delta and read-out: o = alpha * S^T q_hat + (k_hat . q_hat) * delta = S_new^T q_hat
    const float4 v = reinterpret_cast<const float4*>(v_s)[c4];
    const float ak = alpha * inv_k;
    float4 d;
    d.x = beta * (v.x - ak * R.x);
    d.y = beta * (v.y - ak * R.y);
    d.z = beta * (v.z - ak * R.z);
    d.w = beta * (v.w - ak * R.w);
    const float aq = alpha * (inv_q * scale);
    const float kq = qk * inv_q * scale * inv_k;  // q_hat . k_hat
    float4 o;
    o.x = fmaf(kq, d.x, aq * Q.x);
    o.y = fmaf(kq, d.y, aq * Q.y);
    o.z = fmaf(kq, d.z, aq * Q.z);
    o.w = fmaf(kq, d.w, aq * Q.w);

    // --- this block's sum of o^2 to every block of the cluster (slot = this rank): the V-head
    // siblings need it for the norm, and its arrival tells the q/k conv-state owners that this
    // block is done reading (row group 0 of warp 0 holds the block's columns)
    calla_cluster_wait();  // every block started and initialised its mbarrier
    if (warp == 0) {
        float ss = o.x * o.x + o.y * o.y + o.z * o.z + o.w * o.w;
#pragma unroll
        for (int off = 1; off < C4; off <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if (lane < CLUSTER) calla_st_async_f32(&ssq_s[rank], &mbar, lane, ss);
    }

    // --- state update (while the sums travel)
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
        float4 n;
        n.x = fmaf(khat[m], d.x, alpha * S[m].x);
        n.y = fmaf(khat[m], d.y, alpha * S[m].y);
        n.z = fmaf(khat[m], d.z, alpha * S[m].z);
        n.w = fmaf(khat[m], d.w, alpha * S[m].w);
        reinterpret_cast<float4*>(srow)[(size_t)(rg + RG * m) * (DV / 4)] = n;
    }

    calla_mbar_wait_phase0(&mbar);  // all CLUSTER sums are here: every block passed its prologue

    // --- gated RMSNorm over the V-head
    if (t < C4) {
        const int base = ((int)rank / COL_BLOCKS) * COL_BLOCKS;
        float tot = 0.f;
#pragma unroll
        for (int b = 0; b < COL_BLOCKS; ++b) tot += ssq_s[base + b];
        const float rinv = 1.0f / sqrtf(tot / (float)DV + CALLA_RMS_EPS);
        const float4 w = reinterpret_cast<const float4*>(w_s)[t];
        const float4 z = reinterpret_cast<const float4*>(sz_s)[t];
        float4 y;
        y.x = w.x * (o.x * rinv) * z.x;
        y.y = w.y * (o.y * rinv) * z.y;
        y.z = w.z * (o.z * rinv) * z.z;
        y.w = w.w * (o.w * rinv) * z.w;
        reinterpret_cast<float4*>(out + j * DV + c0)[t] = y;
    }

    // --- q/k conv-state shift (each channel has one writer; every reader is done)
    if (t < DK && t / QK_OWN == (int)rank) {
        const int kc = KEY_DIM + ch;
        conv_state[ch] = x1; conv_state[CONV_DIM + ch] = x2; conv_state[2 * CONV_DIM + ch] = xx;
        conv_state[kc] = y1; conv_state[CONV_DIM + kc] = y2; conv_state[2 * CONV_DIM + kc] = yx;
    }
}

}  // namespace calla_gdn

// The decode step: grid N_V * COL_BLOCKS blocks of THREADS, clusters of CLUSTER blocks (the
// column blocks of the V_PER_K V-heads of one QK head).
extern "C" __global__ void __cluster_dims__(calla_gdn::CLUSTER, 1, 1) __launch_bounds__(calla_gdn::THREADS)
gdn_decode_step(float* __restrict__ out, float* __restrict__ s, float* __restrict__ conv_state,
                const float* __restrict__ proj, const float* __restrict__ conv_w,
                const float* __restrict__ a_neg_exp, const float* __restrict__ dt_bias,
                const float* __restrict__ norm_w, CallaL2Prefetch pf) {
    calla_l2_prefetch_share(pf);  // e.g. out_proj's weights, read by the next kernel
    calla_gdn::step(out, s, conv_state, proj, conv_w, a_neg_exp, dt_bias, norm_w);
}

// Timing diagnostics for the self-test: empty kernels with the step's arguments and grid, with
// and without the cluster shape (the launch floor).
extern "C" __global__ void __cluster_dims__(calla_gdn::CLUSTER, 1, 1) __launch_bounds__(calla_gdn::THREADS)
gdn_diag_null_cluster(float* out, float*, float*, const float*, const float*, const float*,
                      const float*, const float*) {
    calla_pdl_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = 0.f;
}
extern "C" __global__ void __launch_bounds__(calla_gdn::THREADS)
gdn_diag_null(float* out, float*, float*, const float*, const float*, const float*, const float*,
              const float*) {
    calla_pdl_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = 0.f;
}
