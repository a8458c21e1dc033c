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
constexpr int QK_OWN = DK / CLUSTER;         // q/k conv-state channels written per block
constexpr float L2_EPS = 1e-6f;              // l2norm epsilon (inside the sum), as in the reference

static_assert(CALLA_CONV_KERNEL == 4, "conv taps are read as one float4");
static_assert(NV % NK == 0, "V heads must group evenly over QK heads");
static_assert(CLUSTER <= 8, "portable cluster size");
static_assert(DV % (4 * COL_BLOCKS) == 0 && 32 % C4 == 0, "column split");
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

// Thread roles of the step for NT threads per block: C4 threads across the block's COLS
// columns (a float4 each), RG row groups, RPT rows of S per thread (rg, rg + RG, ...).
template <int NT>
struct StepShape {
    static constexpr int WARPS = NT / 32;
    static constexpr int RG = NT / C4;
    static constexpr int RPT = DK / RG;
    static_assert(RG * C4 == NT && DK % RG == 0, "row split");
    static_assert(DK % 32 == 0 && DK + COLS + 1 <= NT, "thread roles of the prologue");
};

// What a thread loads before the PDL wait (nothing in it comes from the previous kernel).
template <int NT>
struct StepLoads {
    float4 S[StepShape<NT>::RPT];  // its rows of the block's [d_k, COLS] slice of S
    float4 wq, wk;                 // conv taps of its channel (q or v role) and of the k channel
    float x0, x1, x2, y0, y1, y2;  // cached conv rows: q (or v), k
    float nw, ane, dtb;            // gated-norm weight of its column; -exp(A_log), dt_bias
    int ch;                        // conv channel (q role, or v role), -1 for none
};

// Shared memory step_core works in (the caller provides it: the fused kernel reuses its
// consumed weight tiles).
template <int NT>
struct StepScratch {
    float q[DK], k[DK];                             // raw (conv + SiLU) q and k of QK head i
    float red[2][StepShape<NT>::WARPS][COLS];       // per-warp S^T k, S^T q
};

// The block's coordinates: QK head i (the cluster), V-head j, first column c0.
struct StepAt {
    unsigned rank;
    int i, j, c0;
};
__device__ __forceinline__ StepAt step_at() {
    StepAt a;
    a.rank = calla_cluster_ctarank();
    a.i = (int)calla_cluster_id_x();
    a.j = a.i * V_PER_K + (int)a.rank / COL_BLOCKS;
    a.c0 = ((int)a.rank % COL_BLOCKS) * COLS;
    return a;
}

// Every load that does not depend on the previous kernel: weights, and S and the conv state,
// which only this kernel writes (once per decode step; the previous step is an earlier graph
// launch). Issued before any arithmetic.
template <int NT>
__device__ __forceinline__ void step_loads(StepLoads<NT>& L, const StepAt& at, const float* __restrict__ s,
                                           const float* __restrict__ conv_state, const float* __restrict__ conv_w,
                                           const float* __restrict__ a_neg_exp, const float* __restrict__ dt_bias,
                                           const float* __restrict__ norm_w) {
    using SH = StepShape<NT>;
    const int t = threadIdx.x;
    const int c4 = t % C4, rg = t / C4;
    L.ch = -1;
    if (t < DK) L.ch = at.i * DK + t;
    else if (t < DK + COLS) L.ch = 2 * KEY_DIM + at.j * DV + at.c0 + (t - DK);
    const float* srow = s + (size_t)at.j * DK * DV + at.c0 + 4 * c4;
#pragma unroll
    for (int m = 0; m < SH::RPT; ++m) L.S[m] = ld_f4(srow + (size_t)(rg + SH::RG * m) * DV);
    L.wq = make_float4(0.f, 0.f, 0.f, 0.f);
    L.wk = L.wq;
    L.x0 = L.x1 = L.x2 = L.y0 = L.y1 = L.y2 = 0.f;
    L.nw = L.ane = L.dtb = 0.f;
    if (L.ch >= 0) {
        L.wq = ld_nc_f4(conv_w + 4 * L.ch);
        L.x0 = ld_f(conv_state + L.ch);
        L.x1 = ld_f(conv_state + CONV_DIM + L.ch);
        L.x2 = ld_f(conv_state + 2 * CONV_DIM + L.ch);
    }
    if (t < DK) {
        const int kc = KEY_DIM + L.ch;
        L.wk = ld_nc_f4(conv_w + 4 * kc);
        L.y0 = ld_f(conv_state + kc);
        L.y1 = ld_f(conv_state + CONV_DIM + kc);
        L.y2 = ld_f(conv_state + 2 * CONV_DIM + kc);
    } else if (t < DK + COLS) {
        L.nw = ld_nc_f(norm_w + at.c0 + (t - DK));
    } else if (t == DK + COLS) {
        L.ane = ld_nc_f(a_neg_exp + at.j);
        L.dtb = ld_nc_f(dt_bias + at.j);
    }
}

// This thread's inputs of the step from proj (written by the previous kernel: after the PDL
// wait): xx = the pre-conv q channel (t < DK) or v channel of its column, or a; yx = the k
// channel, z of its column, or b (see step_core); zero for the other threads.
template <int NT>
__device__ __forceinline__ void step_proj_loads(const StepLoads<NT>& L, const StepAt& at, const float* __restrict__ proj,
                                                float& xx, float& yx) {
    const int t = threadIdx.x;
    xx = 0.f;
    yx = 0.f;
    if (t < DK) {
        xx = ld_f(proj + L.ch);
        yx = ld_f(proj + KEY_DIM + L.ch);
    } else if (t < DK + COLS) {
        xx = ld_f(proj + L.ch);
        yx = ld_f(proj + Z_OFF + at.j * DV + at.c0 + (t - DK));
    } else if (t == DK + COLS) {
        xx = ld_f(proj + A_OFF + at.j);
        yx = ld_f(proj + B_OFF + at.j);
    }
}

// The step from this thread's pre-conv inputs on: xx = the q channel (t < DK) or the v
// channel of its column (DK <= t < DK + COLS) or a (t == DK + COLS); yx = the k channel, z
// of its column, or b. mbar (CLUSTER * 4 bytes expected) and ssq_s: this block's, initialised
// before the cluster arrival; `waited`: the caller already passed calla_cluster_wait();
// scratch: StepScratch<NT> in this block's shared memory (16-byte aligned); y_keep: when not
// null, threads t < C4 also leave their four outputs (columns c0 + 4t ..) there.
template <int NT>
__device__ __forceinline__ void step_core(const StepLoads<NT>& L, const StepAt& at, float xx, float yx,
                                          float* __restrict__ out, float* __restrict__ s,
                                          float* __restrict__ conv_state, unsigned long long* mbar, float* ssq_s,
                                          bool waited, StepScratch<NT>& sc, float4* y_keep = nullptr) {
    using SH = StepShape<NT>;
    constexpr int RG = SH::RG, RPT = SH::RPT, WARPS = SH::WARPS;
    float* q_s = sc.q;
    float* k_s = sc.k;
    auto& red_s = sc.red;
    __shared__ __align__(16) float v_s[COLS], sz_s[COLS], w_s[COLS];  // v, SiLU(z), norm weight of the columns
    __shared__ float part_s[DK / 32][3];           // per-warp |q|^2, |k|^2, q.k
    __shared__ float gate_s[2];                    // alpha, beta

    const int t = threadIdx.x;
    const int c4 = t % C4, rg = t / C4;
    const int lane = t & 31, warp = t >> 5;
    const int ch = L.ch;
    const int j = at.j, c0 = at.c0;
    const unsigned rank = at.rank;
    float* srow = s + (size_t)j * DK * DV + c0 + 4 * c4;

    // --- prologue: conv + SiLU, gates
    if (t < DK) {
        const float qv = conv_silu(L.wq, L.x0, L.x1, L.x2, xx);
        const float kv = conv_silu(L.wk, L.y0, L.y1, L.y2, yx);
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
        v_s[cc] = conv_silu(L.wq, L.x0, L.x1, L.x2, xx);
        conv_state[ch] = L.x1;
        conv_state[CONV_DIM + ch] = L.x2;
        conv_state[2 * CONV_DIM + ch] = xx;
        sz_s[cc] = silu_acc(yx);
        w_s[cc] = L.nw;
    } else if (t == DK + COLS) {
        // g = -exp(A_log) * softplus(a + dt_bias); alpha = exp(g); beta = sigmoid(b)
        const float g = L.ane * softplus_acc(xx + L.dtb);
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
        pk.x = fmaf(L.S[m].x, kr, pk.x); pk.y = fmaf(L.S[m].y, kr, pk.y);
        pk.z = fmaf(L.S[m].z, kr, pk.z); pk.w = fmaf(L.S[m].w, kr, pk.w);
        pq.x = fmaf(L.S[m].x, qr, pq.x); pq.y = fmaf(L.S[m].y, qr, pq.y);
        pq.z = fmaf(L.S[m].z, qr, pq.z); pq.w = fmaf(L.S[m].w, qr, pq.w);
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
    if (!waited) calla_cluster_wait();  // every block started and initialised its mbarrier
    if (warp == 0) {
        float ss = o.x * o.x + o.y * o.y + o.z * o.z + o.w * o.w;
#pragma unroll
        for (int off = 1; off < C4; off <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if (lane < CLUSTER) calla_st_async_f32(&ssq_s[rank], mbar, lane, ss);
    }

    // --- state update (while the sums travel)
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
        float4 n;
        n.x = fmaf(khat[m], d.x, alpha * L.S[m].x);
        n.y = fmaf(khat[m], d.y, alpha * L.S[m].y);
        n.z = fmaf(khat[m], d.z, alpha * L.S[m].z);
        n.w = fmaf(khat[m], d.w, alpha * L.S[m].w);
        reinterpret_cast<float4*>(srow)[(size_t)(rg + RG * m) * (DV / 4)] = n;
    }

    calla_mbar_wait_phase0(mbar);  // all CLUSTER sums are here: every block passed its prologue

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
        if (y_keep != nullptr) *y_keep = y;
    }

    // --- q/k conv-state shift (each channel has one writer; every reader is done)
    if (t < DK && t / QK_OWN == (int)rank) {
        const int kc = KEY_DIM + ch;
        conv_state[ch] = L.x1; conv_state[CONV_DIM + ch] = L.x2; conv_state[2 * CONV_DIM + ch] = xx;
        conv_state[kc] = L.y1; conv_state[CONV_DIM + kc] = L.y2; conv_state[2 * CONV_DIM + kc] = yx;
    }
}

// The step for the block of V-head j, columns [c0, c0 + COLS) (see the file header), proj
// written by the previous kernel.
__device__ __forceinline__ void step(float* __restrict__ out, float* __restrict__ s, float* __restrict__ conv_state,
                                     const float* __restrict__ proj, const float* __restrict__ conv_w,
                                     const float* __restrict__ a_neg_exp, const float* __restrict__ dt_bias,
                                     const float* __restrict__ norm_w, const CallaL2Prefetch* pf = nullptr) {
    __shared__ float ssq_s[CLUSTER];               // sum of o^2 of every block of the cluster, by rank
    __shared__ __align__(8) unsigned long long mbar;  // completes when all CLUSTER sums arrived
    const int t = threadIdx.x;
    const StepAt at = step_at();
    if (t == 0) calla_mbar_init_expect(&mbar, CLUSTER * sizeof(float));
    calla_cluster_arrive_relaxed();  // "started, mbarrier ready"; waited for before the first send

    StepLoads<THREADS> L;
    step_loads<THREADS>(L, at, s, conv_state, conv_w, a_neg_exp, dt_bias, norm_w);

    calla_pdl_wait();
    if (pf != nullptr) calla_l2_progress_bump(*pf);  // the input projection has completed

    // --- proj, written by the previous kernel
    float xx, yx;
    step_proj_loads<THREADS>(L, at, proj, xx, yx);
    __shared__ __align__(16) StepScratch<THREADS> sc;
    step_core<THREADS>(L, at, xx, yx, out, s, conv_state, &mbar, ssq_s, false, sc);
}

// ---------------------------------------------------------------------------------------------
// The input projection fused in front of the step (gdn_in_step_q{4,8}): one launch per GDN layer
// instead of the stacked in_proj GEMV (gemv_norm_*) and gdn_decode_step.
//
// Same grid, clusters and threads as the step. The cluster of QK head i computes exactly the
// in_proj rows its blocks read: the head's 256 q|k channels, and the v and z rows of the V_PER_K
// V-heads' columns. Block rank r owns six 16-row tiles (IN_TILES), restacked by the host
// (crates/cuda/src/gdn.rs `GdnInProj`) as the MoE's 16 x 64 tiles (kernels/qtile.cuh):
//   tiles 0, 1: q|k channels 32r .. 32r + 31 of the head (q for r < 4, k after);
//   tiles 2, 3: the v channels of its own columns (V-head j, columns c0 .. c0 + 31);
//   tiles 4, 5: the z rows of its own columns.
// The b and a rows of its V-head (two rows) are dot products on the CUDA cores from the stacked
// matrix in the MLX layout.
//  * before the PDL wait: the step's loads (S, conv state, weights), the b/a rows and the input
//    norm's weights, then warp 0 requests the six tiles (codes and {scale|bias} pairs) by bulk
//    copies (TMA) into shared memory, one mbarrier per tile (loads issued after the copies
//    would wait behind their data);
//  * after it: x = rms_norm(h) * (1 + w) (the layer's input_layernorm; Σ h² over the block),
//    warp w builds the digits of K eighth w in registers (quantize_group_frag) and runs that
//    eighth of the six tiles as they arrive; the eighths are summed in order;
//  * the block sends its 32 q|k channels to every block of the cluster (st.async, counted on
//    their mbarrier), then runs the step from its inputs (step_core) in the consumed tiles'
//    shared memory.
// Footprint: 108 KB of tiles (4-bit) + ~2 KB, at most 128 registers: two blocks fit on an SM, so
// a cluster of 8 needs 4 SMs of one GPC (at one block per SM the H200's GPCs held 14 of the 16
// clusters at once and the last two ran as a second wave). At 8 bits the tiles take 204 KB:
// one block per SM (the host uses the kernel only when every cluster fits at once).
// The sums are not those of the GEMV (other digits, other order): the projection agrees with the
// stacked GEMV to ~1e-6 relative, not bit for bit.
constexpr int IN_THREADS = THREADS;
// `flags` bits of gdn_in_step_*: trigger the dependent launch right after the PDL wait (instead
// of after the step's prologue, as gdn_decode_step does).
constexpr int IN_EARLY_TRIGGER = 1;
// ... and request the tiles into L2 only (cp.async.bulk.prefetch.L2) before the PDL wait, their
// bulk copies into shared memory after h's loads (which would otherwise queue behind them).
constexpr int IN_L2_FIRST = 2;
constexpr int IN_MARKS = 6;  // probe words per block (gdn.rs IN_MARKS)
constexpr int IN_WARPS = IN_THREADS / 32;
constexpr int IN_D = CALLA_D_MODEL;
constexpr int IN_DG = IN_D / CALLA_QUANT_GROUP;      // groups along K
constexpr int IN_TILES = 6;                          // 16-row tiles per block
constexpr int IN_GPW = IN_DG / IN_WARPS;             // groups per warp (its K part)
constexpr int IN_CPT = IN_D / IN_THREADS;            // columns per thread (norm, b/a)
constexpr int IN_QK = 2 * DK;                        // q|k channels of a QK head
static_assert(CALLA_QUANT_GROUP == 64 && IN_DG % IN_WARPS == 0 && IN_GPW % 2 == 0, "K parts of whole group pairs");
static_assert(IN_QK == 32 * CLUSTER && COLS == 32, "block r: q|k channels 32r.., 32 v and 32 z rows");
static_assert(IN_CPT == 8 && CALLA_QUANT_GROUP % IN_CPT == 0, "two float4 of h per thread, in one group");

// Dynamic shared memory of one block (host: gdn.rs in_step_smem_bytes): codes [IN_TILES][IN_DG]
// tiles, then their {scale|bias} pairs [IN_TILES][IN_DG][8]; the same layout as the block's
// region of the restacked weights. Once every tile is consumed it holds the units' row sums
// (InRed) and the step's scratch.
template <int BITS>
struct InSmem {
    static constexpr int CODES = IN_TILES * IN_DG * BITS * 128;
    static constexpr int SB = IN_TILES * IN_DG * 64;
    static constexpr int BYTES = CODES + SB;
};
struct InReuse {
    float part[IN_TILES][IN_WARPS][16];  // row sums of each (tile, K part)
    StepScratch<IN_THREADS> sc;
};
static_assert(sizeof(InReuse) <= InSmem<4>::BYTES, "the reused tiles hold the sums and the step's scratch");

// b/a row `row` of the stacked in_proj (MLX layout): this thread's columns IN_CPT·t .. as codes
// (BITS·IN_CPT bits), and their group's scale and bias.
template <int BITS>
__device__ __forceinline__ void ba_load(const unsigned char* packed, const unsigned short* scales,
                                        const unsigned short* biases, int row, uint2& codes, float& sc, float& bi) {
    const int t = threadIdx.x;
    const unsigned char* p = packed + (size_t)row * (IN_D * BITS / 8) + t * (IN_CPT * BITS / 8);
    if (BITS == 4) codes = make_uint2(__ldg(reinterpret_cast<const unsigned*>(p)), 0u);
    else codes = __ldg(reinterpret_cast<const uint2*>(p));
    const size_t g = (size_t)row * IN_DG + (IN_CPT * t) / CALLA_QUANT_GROUP;
    sc = __uint_as_float((unsigned)__ldg(scales + g) << 16);
    bi = __uint_as_float((unsigned)__ldg(biases + g) << 16);
}
// Σ over this thread's columns of (scale * q + bias) * u.
template <int BITS>
__device__ __forceinline__ float ba_part(uint2 codes, float sc, float bi, const float (&u)[IN_CPT]) {
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr int EPW = 32 / BITS;  // codes per word
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < IN_CPT; ++c) {
        const unsigned w = c < EPW ? codes.x : codes.y;
        acc = fmaf(fmaf(sc, (float)((w >> ((c % EPW) * BITS)) & MASK), bi), u[c], acc);
    }
    return acc;
}

template <int BITS>
__device__ __forceinline__ void in_step(float* __restrict__ out, float* __restrict__ s, float* __restrict__ conv_state,
                                        const float* __restrict__ h, const float* __restrict__ in_norm_w, float eps,
                                        const unsigned char* __restrict__ tiles, const unsigned char* __restrict__ ba_packed,
                                        const unsigned short* __restrict__ ba_scales,
                                        const unsigned short* __restrict__ ba_biases, const float* __restrict__ conv_w,
                                        const float* __restrict__ a_neg_exp, const float* __restrict__ dt_bias,
                                        const float* __restrict__ norm_w, int flags, unsigned long long* probe) {
    using namespace calla_qt;
    // Measurement (probe != null): thread 0 of each block stores %globaltimer at its start, after
    // the PDL wait, with the digits built, with the rows summed, with every q|k channel here, and
    // at the end of the step (IN_MARKS words; written after the wait, like every store).
    const unsigned long long t_start = probe != nullptr && threadIdx.x == 0 ? calla_globaltimer() : 0;
    auto mark = [&](int i) {
        if (probe != nullptr && threadIdx.x == 0) probe[blockIdx.x * IN_MARKS + i] = calla_globaltimer();
    };
    using S = InSmem<BITS>;
    static_assert(S::BYTES + 3 * 1024 <= 227 * 1024, "shared memory of one block");
    extern __shared__ __align__(128) unsigned char in_dyn[];
    __shared__ __align__(8) unsigned long long mbar_t[IN_TILES];  // tile k's codes and pairs arrived
    __shared__ __align__(8) unsigned long long mbar_qk;           // every block's q|k channels arrived
    __shared__ __align__(8) unsigned long long mbar_ss;           // step_core: every block's Σ o²
    __shared__ float ssq_s[CLUSTER];
    __shared__ __align__(16) float s_qk[IN_QK];                   // the head's pre-conv q|k, by channel
    __shared__ __align__(16) float s_rows[IN_TILES * 16];         // this block's projected rows
    __shared__ float s_red[IN_WARPS][3];                          // per warp: Σ h², b and a partials

    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const StepAt at = step_at();
    const int blk = at.i * CLUSTER + (int)at.rank;  // this block's region of the tiles
    const unsigned char* region = tiles + (size_t)blk * S::BYTES;

    if (t == 0) {
        for (int k = 0; k < IN_TILES; ++k) calla_mbar_init_expect(&mbar_t[k], IN_DG * (BITS * 128 + 64));
        calla_mbar_init_expect(&mbar_qk, IN_QK * sizeof(float));
        calla_mbar_init_expect(&mbar_ss, CLUSTER * sizeof(float));
    }
    calla_cluster_arrive_relaxed();  // "started, mbarriers ready"; waited for before the first send
    __syncthreads();                 // the mbarriers are initialised before anyone polls them

    // --- before the PDL wait: the step's loads, the b/a rows, the norm weights, then the tiles
    StepLoads<IN_THREADS> L;
    step_loads<IN_THREADS>(L, at, s, conv_state, conv_w, a_neg_exp, dt_bias, norm_w);
    uint2 cb, ca;
    float sb_, bb_, sa_, ba_;
    ba_load<BITS>(ba_packed, ba_scales, ba_biases, B_OFF + at.j, cb, sb_, bb_);
    ba_load<BITS>(ba_packed, ba_scales, ba_biases, A_OFF + at.j, ca, sa_, ba_);
    const float4 nw_a = __ldg(reinterpret_cast<const float4*>(in_norm_w) + 2 * t);
    const float4 nw_b = __ldg(reinterpret_cast<const float4*>(in_norm_w) + 2 * t + 1);
    const int g0 = warp * IN_GPW;  // this warp's K part
    const int q = lane & 15, hh = lane >> 4;
    const int off = 32 * (q >> 3) + 16 * ((q >> 2) & 1) + 4 * (q & 3);  // quantize_group_frag's layout
    float4 nwd[IN_GPW / 2];
#pragma unroll
    for (int pp = 0; pp < IN_GPW / 2; ++pp)
        nwd[pp] = __ldg(reinterpret_cast<const float4*>(in_norm_w + (g0 + 2 * pp + hh) * CALLA_QUANT_GROUP + off));
    const bool l2_first = flags & IN_L2_FIRST;
    auto request = [&]() {  // lanes of warp 0: one bulk copy each
        if (warp == 0 && lane < 2 * IN_TILES) {
            const int k = lane >> 1;
            if ((lane & 1) == 0)
                calla_bulk_copy(in_dyn + k * IN_DG * BITS * 128, region + k * IN_DG * BITS * 128, IN_DG * BITS * 128, &mbar_t[k]);
            else
                calla_bulk_copy(in_dyn + S::CODES + k * IN_DG * 64, region + S::CODES + k * IN_DG * 64, IN_DG * 64, &mbar_t[k]);
        }
    };
    if (!l2_first) {
        request();
    } else if (warp == 0 && lane < 2 * IN_TILES) {
        const int k = lane >> 1;
        if ((lane & 1) == 0) calla_prefetch_l2(region + k * IN_DG * BITS * 128, IN_DG * BITS * 128);
        else calla_prefetch_l2(region + S::CODES + k * IN_DG * 64, IN_DG * 64);
    }

    calla_pdl_wait();  // h comes from the previous kernel
    if (flags & IN_EARLY_TRIGGER) calla_pdl_launch_dependents();
    if (probe != nullptr && threadIdx.x == 0) probe[blockIdx.x * IN_MARKS] = t_start;
    mark(1);

    // --- x = rms_norm(h) * (1 + w): Σ h² over the block (this thread's 8 values, warps in order)
    const float4 ha = __ldcg(reinterpret_cast<const float4*>(h) + 2 * t);
    const float4 hb = __ldcg(reinterpret_cast<const float4*>(h) + 2 * t + 1);
    float4 hd[IN_GPW / 2];
#pragma unroll
    for (int pp = 0; pp < IN_GPW / 2; ++pp)
        hd[pp] = __ldcg(reinterpret_cast<const float4*>(h + (g0 + 2 * pp + hh) * CALLA_QUANT_GROUP + off));
    if (l2_first) request();  // after h's loads
    {
        const float ss = calla_warp_sum(ha.x * ha.x + ha.y * ha.y + ha.z * ha.z + ha.w * ha.w + hb.x * hb.x +
                                        hb.y * hb.y + hb.z * hb.z + hb.w * hb.w);
        if (lane == 0) s_red[warp][0] = ss;
    }
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < IN_WARPS; ++w) tot += s_red[w][0];
    const float inv = rsqrtf(tot / float(IN_D) + eps);
    // b and a of V-head j: this thread's columns, then the warp, then (below) the block
    {
        const float u[IN_CPT] = {ha.x * inv * (1.f + nw_a.x), ha.y * inv * (1.f + nw_a.y), ha.z * inv * (1.f + nw_a.z),
                                 ha.w * inv * (1.f + nw_a.w), hb.x * inv * (1.f + nw_b.x), hb.y * inv * (1.f + nw_b.y),
                                 hb.z * inv * (1.f + nw_b.z), hb.w * inv * (1.f + nw_b.w)};
        const float pb = calla_warp_sum(ba_part<BITS>(cb, sb_, bb_, u));
        const float pa = calla_warp_sum(ba_part<BITS>(ca, sa_, ba_, u));
        if (lane == 0) {
            s_red[warp][1] = pb;
            s_red[warp][2] = pa;
        }
    }
    // this warp's groups as digits, in registers
    uint4 bq[IN_GPW];
    float2 bm[IN_GPW];
#pragma unroll
    for (int pp = 0; pp < IN_GPW / 2; ++pp) {
        const float4 x = hd[pp], nw = nwd[pp];
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
    mark(2);

    // --- this warp's K part of every tile, as the tiles arrive (rows g and g+8 in r0, r1)
    const uint4* sm_codes = reinterpret_cast<const uint4*>(in_dyn);
    const uint2* sm_sb = reinterpret_cast<const uint2*>(in_dyn + S::CODES);
    const int tq = lane & 3;
    const float tmul = (tq & 1) ? 65536.0f : 1.0f, xmask = tq == 0 ? 1.0f : 0.0f;
    float r0[IN_TILES], r1[IN_TILES];
#pragma unroll
    for (int k = 0; k < IN_TILES; ++k) {
        calla_mbar_wait_phase0(&mbar_t[k]);
        float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
        for (int gi = 0; gi < IN_GPW; ++gi) {
            Tile<BITS> tl;
            const int tile = k * IN_DG + g0 + gi;
            tile_from_smem<BITS>(tl, sm_codes + tile * tile_u4<BITS>(), sm_sb + tile * 8, lane);
            tile_dot<BITS>(tl, bq[gi], bm[gi], tmul, xmask, acc0, acc1);
        }
        r0[k] = quad_sum(acc0);
        r1[k] = quad_sum(acc1);
    }
    __syncthreads();  // every tile consumed: its shared memory is reused from here
    InReuse& ru = *reinterpret_cast<InReuse*>(in_dyn);
#pragma unroll
    for (int k = 0; k < IN_TILES; ++k) store_rows(ru.part[k][warp], r0[k], r1[k], lane);
    __syncthreads();
    if (t < IN_TILES * 16) {
        float v = 0.f;
#pragma unroll
        for (int p = 0; p < IN_WARPS; ++p) v += ru.part[t / 16][p][t % 16];
        s_rows[t] = v;
    }
    __syncthreads();
    mark(3);

    // --- this block's q|k channels to every block of the cluster
    calla_cluster_wait();  // every block started and initialised its mbarriers
    if (warp == 0) {
        constexpr int PIECES = 32 / 4;  // 16-byte pieces of the block's 32 channels
#pragma unroll
        for (int it = lane; it < CLUSTER * PIECES; it += 32) {
            const int dst = it / PIECES, pc = it % PIECES;
            calla_st_async_u4(&s_qk[32 * at.rank + 4 * pc], &mbar_qk, (unsigned)dst,
                              reinterpret_cast<const uint4*>(s_rows)[pc]);
        }
    }
    float xx = 0.f, yx = 0.f;  // as step(): q (or v) and k; z; or a and b
    if (t >= DK && t < DK + COLS) {
        xx = s_rows[32 + (t - DK)];
        yx = s_rows[64 + (t - DK)];
    } else if (t == DK + COLS) {
        float a = 0.f, b = 0.f;
#pragma unroll
        for (int w = 0; w < IN_WARPS; ++w) {
            b += s_red[w][1];
            a += s_red[w][2];
        }
        xx = a;
        yx = b;
    }
    calla_mbar_wait_phase0(&mbar_qk);
    mark(4);
    if (t < DK) {
        xx = s_qk[t];
        yx = s_qk[DK + t];
    }
    step_core<IN_THREADS>(L, at, xx, yx, out, s, conv_state, &mbar_ss, ssq_s, true, ru.sc);
    mark(5);
}

// ---------------------------------------------------------------------------------------------
// The output projection and the MoE router's sums behind the step (gdn_step_out_r*_g*): one
// launch per GDN layer instead of gdn_decode_step and the output projection with the router
// folded in (kernels/gemv.cu gemv_resid_rf_*): the step's kernel boundary and the projection's
// own dependent phase go away.
//
// h = x + W_o·o is linear in o, and so are the fold's router sums (kernels/gemv.cu RouterFold):
// with W_r' = W_r·diag(1 + post_norm_w), Σ_c W_r'[e, c]·h_c = (W_r'·x)_e + ((W_r'·W_o)·o)_e. So
// the cluster of QK head i, which holds o's K range [256i, 256i + 256) (the columns of its two
// V-heads), adds its share of h and of every router sum while no block ever holds all of h:
//  * the blocks exchange their 32 outputs (st.async into slot [rank] of every block, counted on
//    an mbarrier) and each makes the range's four groups of digits (kernels/qtile.cuh);
//  * block rank r multiplies them into rows 256r .. 256r + 255 of W_o (16 × 4 tiles of 16 × 64,
//    4-bit, restacked by the host: crates/cuda/src/gdn.rs GdnOutSplit) and adds the rows into
//    acc_h with f64 atomics (16 clusters per row);
//  * and into rows 33r .. 33r + 32 of B = W_r'·W_o over the range (the router's rows, then the
//    shared gate's; f32, made by the host from the dequantized weights: bf16 would move the
//    logits by ~1e-3 of their spread, enough to flip a top-8 choice on most tokens of a
//    random-weight model), f64 atomics into the fold's sums acc[e · RF_STRIDE];
//  * the residual stream's part W_r'·x: block blk (= 8i + r) takes router rows blk, blk + 128,
//    blk + 256 (the shared gate's row is 256), 16 columns per thread as RouterFold does.
// Σ h² (the norm's factor) is not linear: the MoE cluster kernel after it
// (moe_cluster_split_e4, kernels/moe.cu) makes h = x + acc_h and Σ h² itself. f64 atomics of
// f32 shares (16 per row of h, up to 17 per router sum): exact while they span fewer than ~25
// binades, so the order of arrival does not change the sums in practice (as RouterFold's).
// Before the PDL wait: the step's loads, the router rows' codes (registers), and the bulk
// copies of the block's tiles and B rows; x, like proj, after it.
constexpr int OUT_D = CALLA_D_MODEL;
constexpr int OUT_NE = CALLA_N_EXPERTS;
constexpr int OUT_NR = OUT_NE + 1;                         // router rows, then the shared gate's
constexpr int OUT_KC = CLUSTER * COLS;                     // o's K range of one cluster
constexpr int OUT_G = OUT_KC / CALLA_QUANT_GROUP;          // its groups
constexpr int OUT_RT = OUT_D / 16 / CLUSTER;               // 16-row tiles of h per block
constexpr int OUT_TILES = OUT_RT * OUT_G;
constexpr int OUT_BR = (OUT_NR + CLUSTER - 1) / CLUSTER;   // rows of B per block
constexpr int OUT_NB = NV * COL_BLOCKS;                    // blocks
constexpr int OUT_RR = (OUT_NR + OUT_NB - 1) / OUT_NB;     // rows of W_r'·x of block 0 (the most)
constexpr int OUT_PASSES = (OUT_RR + 1) / 2;               // two rows per pass (a half-block each)
constexpr int OUT_CH = OUT_D / 16;                         // 16-column pieces of a router row
constexpr int OUT_RF_STRIDE = 16;                          // kernels/gemv.cu RF_STRIDE
constexpr int OUT_ACC_H = (OUT_NE + 2) * OUT_RF_STRIDE;    // acc_h in a set (kernels/moe.cu RF_ACC_H)
static_assert(OUT_G * CALLA_QUANT_GROUP == OUT_KC && OUT_G <= WARPS, "a warp per group of o's digits");
static_assert(OUT_RT == 2 * WARPS, "two row tiles of h per warp");
static_assert(THREADS == 2 * OUT_CH, "a half-block per router row of W_r'·x");
static_assert(COLS == 4 * C4 && CLUSTER * C4 == 64 && OUT_KC == 8 * 32, "o's exchange and B's rows: 8 values per lane");

// Dynamic shared memory of one block (host: gdn.rs out_block_words), the block's region of the
// restacked weights as it lies in global memory: 4-bit codes [OUT_RT][OUT_G] tiles, their
// {scale|bias} pairs [OUT_RT][OUT_G][8], then B's rows [OUT_BR][OUT_KC] f32.
struct OutSmem {
    static constexpr int CODES = OUT_TILES * 4 * 128;
    static constexpr int SB = OUT_TILES * 64;
    static constexpr int BROWS = OUT_BR * OUT_KC * 4;
    static constexpr int BYTES = CODES + SB + BROWS;
};
static_assert(OutSmem::CODES % 16 == 0 && OutSmem::SB % 16 == 0 && OutSmem::BROWS % 16 == 0, "bulk copies of 16-byte multiples");

template <int RB, int GB>
__device__ __forceinline__ void step_out(float* __restrict__ out, float* __restrict__ s, float* __restrict__ conv_state,
                                         const float* __restrict__ proj, const float* __restrict__ conv_w,
                                         const float* __restrict__ a_neg_exp, const float* __restrict__ dt_bias,
                                         const float* __restrict__ norm_w, const unsigned char* __restrict__ tiles,
                                         const unsigned char* __restrict__ r_packed, const unsigned* __restrict__ r_sb,
                                         const unsigned char* __restrict__ g_packed, const unsigned* __restrict__ g_sb,
                                         const float* __restrict__ post_w, const float* x, double* acc, int flags) {
    using namespace calla_qt;
    using S = OutSmem;
    // measurement switches (CudaContext::set_gdn_out_flags): leave B out, leave W_o's tiles out (both
    // make the sums wrong), issue the bulk copies after the step; or no shared memory: the
    // region only prefetched into L2 before the wait, read into registers after the step
    const bool skip_b = flags & 1, skip_w = flags & 2, late_copy = flags & 4, l2_only = flags & 8;
    const unsigned copy_bytes =
        l2_only ? 0u : (skip_w ? 0u : (unsigned)(S::CODES + S::SB)) + (skip_b ? 0u : (unsigned)S::BROWS);
    static_assert(S::BYTES + 8 * 1024 <= 227 * 1024, "shared memory of one block (~7 KB static)");
    extern __shared__ __align__(128) unsigned char out_dyn[];
    __shared__ float ssq_s[CLUSTER];                              // step_core: every block's Σ o²
    __shared__ __align__(8) unsigned long long mbar;              // ... all arrived
    __shared__ __align__(8) unsigned long long mbar_o;            // every block's outputs arrived
    __shared__ __align__(8) unsigned long long mbar_w;            // the tiles and B rows arrived
    __shared__ __align__(16) float s_o[OUT_KC];                   // o over the cluster's K range
    __shared__ __align__(16) unsigned s_oq[OUT_G][CALLA_QUANT_GROUP];  // its digits (half-warp 0's)
    __shared__ __align__(16) unsigned s_oq_scratch[OUT_G][CALLA_QUANT_GROUP];  // half-warp 1's
    __shared__ __align__(8) float2 s_om[2][OUT_G];
    __shared__ float s_rr[OUT_PASSES][WARPS];                     // W_r'·x: per warp and pass

    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const StepAt at = step_at();
    const int blk = at.i * CLUSTER + (int)at.rank;
    const unsigned char* region = tiles + (size_t)blk * S::BYTES;
    if (t == 0) {
        calla_mbar_init_expect(&mbar, CLUSTER * sizeof(float));
        calla_mbar_init_expect(&mbar_o, OUT_KC * sizeof(float));
        calla_mbar_init_expect(&mbar_w, copy_bytes);
    }
    calla_cluster_arrive_relaxed();  // "started, mbarriers ready"; waited for before the first send
    __syncthreads();                 // the mbarriers are initialised before anyone polls them

    // --- before the PDL wait: the step's loads, the router rows' codes, then the bulk copies
    StepLoads<THREADS> L;
    step_loads<THREADS>(L, at, s, conv_state, conv_w, a_neg_exp, dt_bias, norm_w);
    const int half = t / OUT_CH, piece = t % OUT_CH;
    uint4 rw[OUT_PASSES];
    unsigned rsb[OUT_PASSES];
#pragma unroll
    for (int p = 0; p < OUT_PASSES; ++p) {
        const int row = blk + OUT_NB * (2 * p + half);
        rw[p] = make_uint4(0u, 0u, 0u, 0u);
        rsb[p] = 0u;
        if (row < OUT_NE) rf_load_row<RB>(r_packed, r_sb, row, piece, OUT_D, rw[p], rsb[p]);
        else if (row == OUT_NE) rf_load_row<GB>(g_packed, g_sb, 0, piece, OUT_D, rw[p], rsb[p]);
    }
    auto request = [&]() {
        if (l2_only) {
            if (warp == 0 && lane == 0 && !skip_w) calla_prefetch_l2(region, S::CODES + S::SB);
            if (warp == 0 && lane == 1 && !skip_b) calla_prefetch_l2(region + S::CODES + S::SB, S::BROWS);
            return;
        }
        if (warp == 0 && lane == 0 && !skip_w) calla_bulk_copy(out_dyn, region, S::CODES, &mbar_w);
        if (warp == 0 && lane == 1 && !skip_w) calla_bulk_copy(out_dyn + S::CODES, region + S::CODES, S::SB, &mbar_w);
        if (warp == 0 && lane == 2 && !skip_b)
            calla_bulk_copy(out_dyn + S::CODES + S::SB, region + S::CODES + S::SB, S::BROWS, &mbar_w);
    };
    if (!late_copy) request();

    calla_pdl_wait();

    // --- the step (as step()), keeping this block's 32 outputs
    float xx, yx;
    step_proj_loads<THREADS>(L, at, proj, xx, yx);
    const float4 xa = __ldcg(reinterpret_cast<const float4*>(x) + 4 * piece);
    const float4 xb = __ldcg(reinterpret_cast<const float4*>(x) + 4 * piece + 1);
    const float4 xc = __ldcg(reinterpret_cast<const float4*>(x) + 4 * piece + 2);
    const float4 xd = __ldcg(reinterpret_cast<const float4*>(x) + 4 * piece + 3);
    __shared__ __align__(16) StepScratch<THREADS> sc;
    float4 y = make_float4(0.f, 0.f, 0.f, 0.f);
    step_core<THREADS>(L, at, xx, yx, out, s, conv_state, &mbar, ssq_s, false, sc, &y);
    if (late_copy) request();

    // --- the 32 outputs to every block of the cluster (step_core passed calla_cluster_wait()):
    // lane l of warp 0 sends piece l % C4 (thread l % C4's float4) to blocks l / C4 + 4m
    if (warp == 0) {
        const int pc = lane % C4;
        const uint4 v = make_uint4(__float_as_uint(__shfl_sync(0xffffffffu, y.x, pc)), __float_as_uint(__shfl_sync(0xffffffffu, y.y, pc)),
                                   __float_as_uint(__shfl_sync(0xffffffffu, y.z, pc)), __float_as_uint(__shfl_sync(0xffffffffu, y.w, pc)));
#pragma unroll
        for (int dst = lane / C4; dst < CLUSTER; dst += 32 / C4)
            calla_st_async_u4(&s_o[COLS * at.rank + 4 * pc], &mbar_o, (unsigned)dst, v);
    }

    // --- W_r'·x: this thread's 16 columns of its pass rows, then the half-block, in order
    {
        const float4 wa = __ldg(reinterpret_cast<const float4*>(post_w) + 4 * piece);
        const float4 wb = __ldg(reinterpret_cast<const float4*>(post_w) + 4 * piece + 1);
        const float4 wc = __ldg(reinterpret_cast<const float4*>(post_w) + 4 * piece + 2);
        const float4 wd = __ldg(reinterpret_cast<const float4*>(post_w) + 4 * piece + 3);
        const float hv[16] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w, xc.x, xc.y, xc.z, xc.w, xd.x, xd.y, xd.z, xd.w};
        const float nw1[16] = {1.f + wa.x, 1.f + wa.y, 1.f + wa.z, 1.f + wa.w, 1.f + wb.x, 1.f + wb.y, 1.f + wb.z, 1.f + wb.w,
                               1.f + wc.x, 1.f + wc.y, 1.f + wc.z, 1.f + wc.w, 1.f + wd.x, 1.f + wd.y, 1.f + wd.z, 1.f + wd.w};
#pragma unroll
        for (int p = 0; p < OUT_PASSES; ++p) {
            const int row = blk + OUT_NB * (2 * p + half);
            float v = 0.f;
            if (row < OUT_NE) v = rf_part<RB>(rw[p], rsb[p], hv, nw1);
            else if (row == OUT_NE) v = rf_part<GB>(rw[p], rsb[p], hv, nw1);
            v = calla_warp_sum(v);
            if (lane == 0) s_rr[p][warp] = v;
        }
    }
    __syncthreads();
    if (t < 2 * OUT_PASSES) {
        const int p = t / 2, hf = t % 2;
        const int row = blk + OUT_NB * (2 * p + hf);
        if (row < OUT_NR) {
            constexpr int WPH = WARPS / 2;  // warps per half-block
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < WPH; ++w) v += s_rr[p][hf * WPH + w];
            atomicAdd(acc + row * OUT_RF_STRIDE, (double)v);
        }
    }

    // --- o's digits: group g by warp g (both half-warps alike, into separate buffers)
    calla_mbar_wait_phase0(&mbar_o);
    if (warp < OUT_G) {
        const int hh = lane >> 4;
        quantize_group(s_o + warp * CALLA_QUANT_GROUP, lane & 15, hh == 0 ? s_oq[warp] : s_oq_scratch[warp],
                       &s_om[hh][warp]);
    }
    __syncthreads();
    calla_mbar_wait_phase0(&mbar_w);

    // --- rows 256r .. of W_o over the range: warp w's row tiles 2w, 2w + 1, its groups in order
    const uint4* sm_codes = reinterpret_cast<const uint4*>(out_dyn);
    const uint2* sm_sb = reinterpret_cast<const uint2*>(out_dyn + S::CODES);
    const int tq = lane & 3;
    const float tmul = (tq & 1) ? 65536.0f : 1.0f, xmask = tq == 0 ? 1.0f : 0.0f;
    double* acc_h = acc + OUT_ACC_H;
#pragma unroll
    for (int k = 0; k < (skip_w ? 0 : 2); ++k) {
        const int rt = 2 * warp + k;
        float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
        for (int g = 0; g < OUT_G; ++g) {
            Tile<4> tl;
            const int tile = rt * OUT_G + g;
            if (l2_only)
                tile_load<4>(tl, reinterpret_cast<const uint4*>(region) + tile * tile_u4<4>(),
                             reinterpret_cast<const uint2*>(region + S::CODES) + tile * 8, lane);
            else
                tile_from_smem<4>(tl, sm_codes + tile * tile_u4<4>(), sm_sb + tile * 8, lane);
            const uint4 b = lane < 16 ? reinterpret_cast<const uint4*>(s_oq[g])[lane] : make_uint4(0u, 0u, 0u, 0u);
            tile_dot<4>(tl, b, s_om[0][g], tmul, xmask, acc0, acc1);
        }
        const float r0 = quad_sum(acc0), r1 = quad_sum(acc1);
        if (tq == 0) {
            const int row = (int)at.rank * OUT_RT * 16 + rt * 16 + (lane >> 2);
            atomicAdd(acc_h + row, (double)r0);
            atomicAdd(acc_h + row + 8, (double)r1);
        }
    }

    // --- rows 33r .. of B over the range: warp w's rows w, w + 8, ..., 8 values per lane
    // (columns 4·lane .. and 128 + 4·lane ..: conflict-free float4 reads)
    const float* sm_b = reinterpret_cast<const float*>((l2_only ? region : out_dyn) + S::CODES + S::SB);
    const float4 oa = reinterpret_cast<const float4*>(s_o)[lane];
    const float4 ob = reinterpret_cast<const float4*>(s_o)[32 + lane];
#pragma unroll
    for (int br = warp; br < (skip_b ? 0 : OUT_BR); br += WARPS) {
        const float4 wa = l2_only ? __ldcs(reinterpret_cast<const float4*>(sm_b + br * OUT_KC) + lane)
                                  : reinterpret_cast<const float4*>(sm_b + br * OUT_KC)[lane];
        const float4 wb = l2_only ? __ldcs(reinterpret_cast<const float4*>(sm_b + br * OUT_KC) + 32 + lane)
                                  : reinterpret_cast<const float4*>(sm_b + br * OUT_KC)[32 + lane];
        float v = wa.x * oa.x;
        v = fmaf(wa.y, oa.y, v);
        v = fmaf(wa.z, oa.z, v);
        v = fmaf(wa.w, oa.w, v);
        v = fmaf(wb.x, ob.x, v);
        v = fmaf(wb.y, ob.y, v);
        v = fmaf(wb.z, ob.z, v);
        v = fmaf(wb.w, ob.w, v);
        v = calla_warp_sum(v);
        const int row = OUT_BR * (int)at.rank + br;
        if (lane == 0 && row < OUT_NR) atomicAdd(acc + row * OUT_RF_STRIDE, (double)v);
    }
}

}  // namespace calla_gdn

// The step with the output projection and the router's sums behind it (see calla_gdn::step_out):
// grid N_V * COL_BLOCKS blocks of THREADS in clusters of CLUSTER, OutSmem::BYTES of dynamic
// shared memory. out: the step's output as gdn_decode_step's (also kept); tiles: the layer's
// GdnOutSplit (gdn.rs); r_packed/r_sb, g_packed/g_sb: the router and the shared gate (MLX
// layout, RB / GB bits); post_w: post_attention_layernorm (zero-centred); x: the residual stream
// [D_MODEL] before the layer (16-byte aligned); acc: the layer's router-fold set (moe.rs RF_SET
// f64; zero on entry), router sums at [e · 16], h − x at OUT_ACC_H; flags: measurement switches
// (step_out, 0 normally).
#define CALLA_GDN_STEP_OUT(NAME, RB, GB)                                                                          \
    extern "C" __global__ void __cluster_dims__(calla_gdn::CLUSTER, 1, 1) __launch_bounds__(calla_gdn::THREADS)   \
        NAME(float* __restrict__ out, float* __restrict__ s, float* __restrict__ conv_state,                      \
             const float* __restrict__ proj, const float* __restrict__ conv_w, const float* __restrict__ a_neg_exp, \
             const float* __restrict__ dt_bias, const float* __restrict__ norm_w,                                \
             const unsigned char* __restrict__ tiles, const unsigned char* __restrict__ r_packed,                 \
             const unsigned* __restrict__ r_sb, const unsigned char* __restrict__ g_packed,                       \
             const unsigned* __restrict__ g_sb, const float* __restrict__ post_w, const float* x, double* acc,    \
             int flags) {                                                                                         \
        calla_gdn::step_out<RB, GB>(out, s, conv_state, proj, conv_w, a_neg_exp, dt_bias, norm_w, tiles, r_packed, \
                                    r_sb, g_packed, g_sb, post_w, x, acc, flags);                                 \
    }
CALLA_GDN_STEP_OUT(gdn_step_out_r4_g4, 4, 4)
CALLA_GDN_STEP_OUT(gdn_step_out_r4_g8, 4, 8)
CALLA_GDN_STEP_OUT(gdn_step_out_r8_g4, 8, 4)
CALLA_GDN_STEP_OUT(gdn_step_out_r8_g8, 8, 8)

// The decode step: grid N_V * COL_BLOCKS blocks of THREADS, clusters of CLUSTER blocks (the
// column blocks of the V_PER_K V-heads of one QK head). flags: GDN_STEP_EARLY_TRIGGER (lib
// gdn.rs): trigger the dependent launch (the output projection) at entry instead of after the
// block's proj loads and conv, so that its blocks land, and request their weights, while the
// step still runs (a dependent launch takes ~2 us to land on the H200: cuda::timeline).
constexpr int GDN_STEP_EARLY_TRIGGER = 1;
extern "C" __global__ void __cluster_dims__(calla_gdn::CLUSTER, 1, 1) __launch_bounds__(calla_gdn::THREADS)
gdn_decode_step(float* __restrict__ out, float* __restrict__ s, float* __restrict__ conv_state,
                const float* __restrict__ proj, const float* __restrict__ conv_w,
                const float* __restrict__ a_neg_exp, const float* __restrict__ dt_bias,
                const float* __restrict__ norm_w, CallaL2Prefetch pf, int flags) {
    if (flags & GDN_STEP_EARLY_TRIGGER) calla_pdl_launch_dependents();
    calla_l2_prefetch_share(pf);  // e.g. out_proj's weights, read by the next kernel
    calla_gdn::step(out, s, conv_state, proj, conv_w, a_neg_exp, dt_bias, norm_w, &pf);
}

// The input projection fused in front of the step (see calla_gdn::in_step): grid N_V *
// COL_BLOCKS blocks of IN_THREADS (at most two per SM) in clusters of CLUSTER, InSmem<BITS>::BYTES of dynamic shared
// memory. h: the residual stream [D_MODEL] (16-byte aligned); in_norm_w: input_layernorm
// (zero-centred); tiles: the layer's restacked q|k, v, z rows (gdn.rs GdnInProj); ba_*: the
// stacked in_proj in the MLX layout (its b and a rows are read); flags: calla_gdn::IN_* bits;
// probe: null, or IN_MARKS words per block (measurement).
#define CALLA_GDN_IN_STEP(NAME, BITS)                                                                         \
    extern "C" __global__ void __cluster_dims__(calla_gdn::CLUSTER, 1, 1) __launch_bounds__(calla_gdn::IN_THREADS, 2) \
        NAME(float* __restrict__ out, float* __restrict__ s, float* __restrict__ conv_state,                  \
             const float* __restrict__ h, const float* __restrict__ in_norm_w, float eps,                     \
             const unsigned char* __restrict__ tiles, const unsigned char* __restrict__ ba_packed,             \
             const unsigned short* __restrict__ ba_scales, const unsigned short* __restrict__ ba_biases,      \
             const float* __restrict__ conv_w, const float* __restrict__ a_neg_exp,                           \
             const float* __restrict__ dt_bias, const float* __restrict__ norm_w, int flags,                  \
             unsigned long long* probe) {                                                                     \
        calla_gdn::in_step<BITS>(out, s, conv_state, h, in_norm_w, eps, tiles, ba_packed, ba_scales, ba_biases, \
                                 conv_w, a_neg_exp, dt_bias, norm_w, flags, probe);                            \
    }
CALLA_GDN_IN_STEP(gdn_in_step_q4, 4)
CALLA_GDN_IN_STEP(gdn_in_step_q8, 8)

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
