// Gated DeltaNet prefill for a block of T prompt tokens, chunked form (docs/MODEL.md §3.5
// steps 2-7 with chunk C = 64, and step 8's gated RMSNorm; transformers
// `torch_chunk_gated_delta_rule`; CPU twin: the prefill path of model::Model's GDN mixer with
// model::reference::{causal_conv_silu, l2norm_inplace, gdn_chunk, gated_rms_norm}).
//
// T is padded to Tpad = 64·NC (NC chunks); padded rows have q = k = v = 0, g = 0, beta = 0, so
// they change neither the state nor the real rows. Four launches per layer:
//
//   gdnp_conv      causal conv + SiLU of q|k|v over the T tokens, continuing from the conv
//                  state; L2 norm of q and k (q scaled by d_k^-1/2); the gates g (log-decay) and
//                  beta. Writes q̂, k̂ [n_k, Tpad, d_k], v [n_v, Tpad, d_v], g, beta [n_v, Tpad].
//   gdnp_prep_*    one block per (QK head, chunk), covering both V heads of the QK head:
//                  everything of a chunk that does not depend on the state S:
//                    γ_r = Σ_{s≤r} g_s,  A[r,s] = β_r (k̂_r·k̂_s) e^{γ_r−γ_s} (s < r),
//                    Tm = (I + A)^-1 (forward substitution, one column per thread, fp32),
//                    U = Tm·diag(β)·V (written over v), W = Tm·diag(β e^γ)·K̂,
//                    P = (Q̂K̂ᵀ) ⊙ D, D[r,s] = e^{γ_r−γ_s} for s ≤ r, else 0.
//                  Also shifts the conv state (every read of it is in gdnp_conv).
//   gdnp_state_*   one block per (V head, quarter of the value columns); the chunks in order:
//                    V' = U − W S,  O = diag(e^γ) Q̂ S + P V',
//                    S ← e^{γ_C} S + K̂ᵀ (diag(e^{γ_C−γ}) V').
//                  Writes O (before the norm) into out. Chunk inputs are prefetched with
//                  cp.async one phase ahead.
//   gdnp_norm      gated RMSNorm of out in place: norm_w ⊙ o/rms(o) ⊙ SiLU(z), per V head
//                  (gdnp_norm_acts: into out_proj's bf16 activations). gdnp_state_tf32wgcn
//                  does that norm itself, its four blocks of a V head as a cluster ("the
//                  gated norm inside the state kernel" below): three launches then.
//
// _f32 variants: every product on the CUDA cores in fp32. _tf32 variants: the matrix products
// on the tensor cores (mma.sync m16n8k8, operands rounded to TF32 with cvt.rna, fp32
// accumulation). In both, the state S, its accumulation, the triangular solve, the gates and
// all elementwise math are fp32.

#ifndef CALLA_N_V_HEADS
#error "dims header missing"
#endif

namespace calla_gdnp {

constexpr int NK = CALLA_N_K_HEADS;
constexpr int NV = CALLA_N_V_HEADS;
constexpr int DK = CALLA_D_K;
constexpr int DV = CALLA_D_V;
using calla_gdn_layout::KEY_DIM;
using calla_gdn_layout::CONV_DIM;
using calla_gdn_layout::Z_OFF;
using calla_gdn_layout::B_OFF;
using calla_gdn_layout::A_OFF;
using calla_gdn_layout::PROJ;  // floats per token of the stacked in_proj output
constexpr int VPK = NV / NK;           // V heads per QK head (consecutive grouping)
constexpr int CH = 64;                 // chunk length C (= spec GDN_CHUNK, checked on the host)
constexpr float L2_EPS = 1e-6f;        // l2norm epsilon, inside the sum (as the reference)

static_assert(CALLA_CONV_KERNEL == 4, "conv taps are read as one float4");
static_assert(VPK == 2, "gdnp_prep handles the two V heads of one QK head");
static_assert(DK == 128 && DV == 128, "tiling assumes 128-wide heads");
static_assert(PROJ % 4 == 0 && CONV_DIM % 4 == 0, "float4 rows");

// ---- accurate elementwise helpers (no fast-math intrinsics: the CPU twin uses libm)
__device__ __forceinline__ float sigmoid_acc(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_acc(float x) { return x * sigmoid_acc(x); }
// PyTorch softplus (threshold 20): x for x > 20, else log(1 + e^x).
__device__ __forceinline__ float softplus_acc(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float comp(const float4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// ---- tensor cores: mma.sync m16n8k8 TF32 with fp32 accumulation
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float round_tf32(float x) { return __uint_as_float(to_tf32(x)); }
__device__ __forceinline__ void mma_tf32(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Warp-level product: acc[nt] (the 16 x 8 tile nt of a 16 x 8·NT block) += A·B over k-steps
// [0, ksteps) of 8, where a(r, k) = A[r*AR + k*AK] (r < 16) and b(k, n) = B[k*BK + n*BN]
// (n < 8·NT). Fragments (PTX ISA, mma.m16n8k8 .tf32), g = lane/4, q = lane%4:
// a0 (g, q), a1 (g+8, q), a2 (g, q+4), a3 (g+8, q+4); b0 (k q, n g), b1 (k q+4, n g);
// c0, c1 (g, 2q), (g, 2q+1); c2, c3 (g+8, 2q), (g+8, 2q+1).
// With BR, B already holds TF32-rounded values (no cvt on load); with ARD, A does. (A cvt.rna
// is not one instruction on sm_90: ptxas expands it into a compare with infinity, a predicated
// add and a mask, about four instructions per element.)
// LDS (shared-memory operands laid out for it): A row-major (AK = 1) and B n-major (BK = 1),
// both row strides multiples of 4 floats and the tiles 16-byte aligned, so that one
// `ldmatrix.x4` (8 x 8 b16 matrices = 8 rows x 4 floats) fetches a k-step's four A values and
// another the two B values of two n-tiles, instead of 4 + 2·NT scalar loads: thread t receives
// word t%4 of row t/4 of each matrix, i.e. element (g, q) of an 8 x 4 float block. The same
// values reach the same registers, so the same bits.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const float* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// This lane's row address for the ldmatrix form (matrix m = lane/8, row lane%8): A's matrices
// are rows 0-7 / 8-15 (m&1) x columns 0-3 / 4-7 (m>>1), giving a0..a3; B's (n-major) are
// n 0-7 / 8-15 (m>>1) x k 0-3 / 4-7 (m&1), giving b0, b1 of n-tile 0, then of n-tile 1.
template <int AR>
__device__ __forceinline__ const float* ldsm_a_lane(const float* A) {
    const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    return A + (r + 8 * (m & 1)) * AR + 4 * (m >> 1);
}
template <int BN>
__device__ __forceinline__ const float* ldsm_b_lane(const float* B) {
    const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    return B + (r + 8 * (m >> 1)) * BN + 4 * (m & 1);
}
// One k-step of warp_mma; ak, bk: this lane's addresses (ldsm_*_lane for the ldmatrix forms,
// else A + g*AR + q*AK and B + q*BK + g*BN), advanced by the k-step. ALD / BLD: A / B by
// ldmatrix (layouts above).
template <int NT, int AR, int AK, int BK, int BN, bool BR, bool ARD, bool ALD, bool BLD>
__device__ __forceinline__ void warp_mma_step(float (&acc)[NT][4], const float* ak, const float* bk) {
    static_assert(!ALD || (AK == 1 && AR % 4 == 0), "ldmatrix A: row-major, rows of whole 16-byte chunks");
    static_assert(!BLD || (BK == 1 && BN % 4 == 0 && NT % 2 == 0), "ldmatrix B: n-major, rows of whole 16-byte chunks, n-tile pairs");
    const auto ld = [](float x) { return ARD ? __float_as_uint(x) : to_tf32(x); };
    unsigned a[4];
    if constexpr (ALD) {
        ldsm_x4(a, ak);
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = ld(__uint_as_float(a[i]));
    } else {
        a[0] = ld(ak[0]);
        a[1] = ld(ak[8 * AR]);
        a[2] = ld(ak[4 * AK]);
        a[3] = ld(ak[8 * AR + 4 * AK]);
    }
    if constexpr (BLD) {
        const auto cvb = [](unsigned x) { return BR ? x : to_tf32(__uint_as_float(x)); };
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            unsigned b[4];
            ldsm_x4(b, bk + np * 16 * BN);
            mma_tf32(acc[2 * np], a[0], a[1], a[2], a[3], cvb(b[0]), cvb(b[1]));
            mma_tf32(acc[2 * np + 1], a[0], a[1], a[2], a[3], cvb(b[2]), cvb(b[3]));
        }
    } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float f0 = bk[nt * 8 * BN], f1 = bk[4 * BK + nt * 8 * BN];
            mma_tf32(acc[nt], a[0], a[1], a[2], a[3], BR ? __float_as_uint(f0) : to_tf32(f0), BR ? __float_as_uint(f1) : to_tf32(f1));
        }
    }
}
template <int NT, int AR, int AK, int BK, int BN, bool BR = false, bool ARD = false, bool ALD = false, bool BLD = false>
__device__ __forceinline__ void warp_mma(float (&acc)[NT][4], const float* A, const float* B, int ksteps) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const float* a = ALD ? ldsm_a_lane<AR>(A) : A + g * AR + q * AK;
    const float* b = BLD ? ldsm_b_lane<BN>(B) : B + q * BK + g * BN;
#pragma unroll 2
    for (int ks = 0; ks < ksteps; ++ks) warp_mma_step<NT, AR, AK, BK, BN, BR, ARD, ALD, BLD>(acc, a + ks * 8 * AK, b + ks * 8 * BK);
}
// warp_mma over a compile-time number of k-steps, fully unrolled (every shared-memory address
// an immediate offset from one base).
template <int KSTEPS, int NT, int AR, int AK, int BK, int BN, bool BR = false, bool ARD = false, bool ALD = false,
          bool BLD = false>
__device__ __forceinline__ void warp_mma_k(float (&acc)[NT][4], const float* A, const float* B) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const float* a = ALD ? ldsm_a_lane<AR>(A) : A + g * AR + q * AK;
    const float* b = BLD ? ldsm_b_lane<BN>(B) : B + q * BK + g * BN;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) warp_mma_step<NT, AR, AK, BK, BN, BR, ARD, ALD, BLD>(acc, a + ks * 8 * AK, b + ks * 8 * BK);
}

// ---- cp.async (16-byte global -> shared copies, grouped)
__device__ __forceinline__ void cp16(float* smem, const float* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
// 8 bytes (both addresses 8-byte aligned; through L1, as .cg takes only 16)
__device__ __forceinline__ void cp8(float* smem, const float* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// =====================================================================================
// gdnp_conv: grid (Tpad / 32, 2·n_k + n_v), 128 threads. Block y: q head (y < n_k), k head
// (y < 2·n_k) or V head; each warp handles 8 consecutive tokens of the block's 128 channels,
// lane = 4 channels (float4), with the conv window in registers.
// =====================================================================================
constexpr int CV_TOK = 8;                    // tokens per warp
constexpr int CV_WARPS = 4;
constexpr int CV_BLOCK_TOK = CV_TOK * CV_WARPS;

__device__ __forceinline__ float conv4(const float4& w, float x0, float x1, float x2, float x3) {
    float acc = w.x * x0;
    acc = fmaf(w.y, x1, acc);
    acc = fmaf(w.z, x2, acc);
    acc = fmaf(w.w, x3, acc);
    return silu_acc(acc);
}

}  // namespace calla_gdnp

extern "C" __global__ void __launch_bounds__(128)
gdnp_conv(float* __restrict__ qn, float* __restrict__ kn, float* __restrict__ vb, float* __restrict__ g_out,
          float* __restrict__ beta_out, const float* __restrict__ proj, const float* __restrict__ conv_state,
          const float* __restrict__ conv_w, const float* __restrict__ a_neg_exp,
          const float* __restrict__ dt_bias, int T, int Tpad, int round_qk) {
    using namespace calla_gdnp;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hb = blockIdx.y;
    const int kind = hb < NK ? 0 : (hb < 2 * NK ? 1 : 2);  // q, k, v
    const int head = kind == 0 ? hb : (kind == 1 ? hb - NK : hb - 2 * NK);
    const int ch = (kind == 0 ? head * DK : (kind == 1 ? KEY_DIM + head * DK : 2 * KEY_DIM + head * DV)) + 4 * lane;
    float* dst = kind == 0 ? qn : (kind == 1 ? kn : vb);
    float4 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = reinterpret_cast<const float4*>(conv_w)[ch + i];
    float ane = 0.f, dtb = 0.f;
    if (kind == 2) {
        ane = a_neg_exp[head];
        dtb = dt_bias[head];
    }

    calla_pdl_wait();

    const int t0 = blockIdx.x * CV_BLOCK_TOK + warp * CV_TOK;
    if (t0 >= Tpad) return;
    // window: x[r] = pre-conv row of token t0 - 3 + r (the conv state for tokens < 0)
    float4 x[CV_TOK + 3];
#pragma unroll
    for (int r = 0; r < CV_TOK + 3; ++r) {
        const int tt = t0 - 3 + r;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (tt < 0)
            v = *reinterpret_cast<const float4*>(conv_state + (size_t)(tt + 3) * CONV_DIM + ch);
        else if (tt < T)
            v = *reinterpret_cast<const float4*>(proj + (size_t)tt * PROJ + ch);
        x[r] = v;
    }
    // V heads: lane r < CV_TOK loads the gate inputs a, b of token t0 + r together with the
    // window (not one dependent load pair per token inside the loop) and writes g, β below
    float a_in = 0.f, b_in = 0.f;
    const int tg = t0 + lane;
    if (kind == 2 && lane < CV_TOK && tg < T) {
        const float* pr = proj + (size_t)tg * PROJ;
        a_in = pr[A_OFF + head];
        b_in = pr[B_OFF + head];
    }
    const float qscale = 1.0f / sqrtf((float)DK);
#pragma unroll
    for (int r = 0; r < CV_TOK; ++r) {
        const int tt = t0 + r;
        if (tt >= Tpad) break;
        float4 y = make_float4(0.f, 0.f, 0.f, 0.f);
        if (tt < T) {  // warp-uniform
            y.x = conv4(w[0], x[r].x, x[r + 1].x, x[r + 2].x, x[r + 3].x);
            y.y = conv4(w[1], x[r].y, x[r + 1].y, x[r + 2].y, x[r + 3].y);
            y.z = conv4(w[2], x[r].z, x[r + 1].z, x[r + 2].z, x[r + 3].z);
            y.w = conv4(w[3], x[r].w, x[r + 1].w, x[r + 2].w, x[r + 3].w);
            if (kind < 2) {
                const float ss = calla_warp_sum(y.x * y.x + y.y * y.y + y.z * y.z + y.w * y.w);
                const float inv = 1.0f / sqrtf(ss + L2_EPS);
                y.x *= inv;
                y.y *= inv;
                y.z *= inv;
                y.w *= inv;
                if (kind == 0) {
                    y.x *= qscale;
                    y.y *= qscale;
                    y.z *= qscale;
                    y.w *= qscale;
                }
                if (round_qk) {  // TF32: stored rounded, so the tensor-core loads need no cvt (prep's β e^γ k̂ scales these)
                    y.x = round_tf32(y.x);
                    y.y = round_tf32(y.y);
                    y.z = round_tf32(y.z);
                    y.w = round_tf32(y.w);
                }
            }
        }
        reinterpret_cast<float4*>(dst + ((size_t)head * Tpad + tt) * DK)[lane] = y;
    }
    if (kind == 2 && lane < CV_TOK && tg < Tpad) {
        const bool real = tg < T;
        g_out[(size_t)head * Tpad + tg] = real ? ane * softplus_acc(a_in + dtb) : 0.f;
        beta_out[(size_t)head * Tpad + tg] = real ? sigmoid_acc(b_in) : 0.f;
    }
}

// =====================================================================================
// gdnp_prep_{f32,tf32}: grid (n_k, NC), 256 threads, dynamic shared memory PB_FLOATS floats.
// =====================================================================================
namespace calla_gdnp {

constexpr int PB_THREADS = 256;
constexpr int KSP = DK + 4;    // row stride of K̂ / Q̂ chunks (row-major operands)
constexpr int XSP = DK + 8;    // row stride of the scaled V / K̂ chunk (k-major operand)
constexpr int AP = CH + 4;     // row stride of the 64 x 64 matrices
constexpr int PB_KS = 0;                   // [CH][KSP]  K̂ chunk
constexpr int PB_XS = PB_KS + CH * KSP;    // [CH][XSP]  Q̂ chunk (stride KSP), then A_0, A_1
                                           //            ([CH][AP] each), then β V, β e^γ K̂
constexpr int PB_A0 = PB_XS + CH * XSP;    // [CH][AP]   Tm of V head 0
constexpr int PB_A1 = PB_A0 + CH * AP;     // [CH][AP]   K̂K̂ᵀ, then Tm of V head 1
constexpr int PB_G = PB_A1 + CH * AP;      // [2][CH]    g
constexpr int PB_GAM = PB_G + 2 * CH;      // [2][CH]    γ
constexpr int PB_BET = PB_GAM + 2 * CH;    // [2][CH]    β
constexpr int PB_BEG = PB_BET + 2 * CH;    // [2][CH]    β e^γ
constexpr int PB_FLOATS = PB_BEG + 2 * CH;
static_assert(PB_XS % 4 == 0 && PB_A0 % 4 == 0 && PB_A1 % 4 == 0 && PB_G % 4 == 0, "16-byte alignment");
static_assert(2 * CH * AP <= CH * XSP, "A_0 and A_1 fit in the XS space");

// Position (row, col) of element e (0..31) of this thread's share of a 64 x 64 product computed
// by 128 threads (tid 0..127): TC: warp tid/32 owns rows 16w..16w+15 as 8 mma tiles; SIMT: rows
// 4(tid/8)+ii, cols (tid%8) + 8u.
template <bool TC>
__device__ __forceinline__ void gram_pos(int e, int tid, int& r, int& c) {
    if constexpr (TC) {
        const int wq = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
        const int nt = e >> 2, el = e & 3;
        r = 16 * wq + g + 8 * (el >> 1);
        c = 8 * nt + 2 * q + (el & 1);
    } else {
        const int ii = e >> 3, u = e & 7;
        r = 4 * (tid >> 3) + ii;
        c = (tid & 7) + 8 * u;
    }
}

// acc = Arows · Browsᵀ (64 x 64 over DK), rows of both with stride KSP; 128 threads.
template <bool TC, bool PRE = true>
__device__ __forceinline__ void gram(float (&acc)[32], const float* Arows, const float* Brows, int tid) {
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[e] = 0.f;
    if constexpr (TC) {
        float(&a)[8][4] = *reinterpret_cast<float(*)[8][4]>(acc);
        const int wq = tid >> 5;
        // q̂, k̂ TF32 already (PRE); both row-major with stride KSP: ldmatrix fragments
        warp_mma<8, KSP, 1, 1, KSP, PRE, PRE, true, true>(a, Arows + 16 * wq * KSP, Brows, DK / 8);
    } else {
        const int rt = tid >> 3, ct = tid & 7;
#pragma unroll 2
        for (int k = 0; k < DK; k += 4) {
            float4 a[4], b[8];
#pragma unroll
            for (int ii = 0; ii < 4; ++ii) a[ii] = *reinterpret_cast<const float4*>(Arows + (4 * rt + ii) * KSP + k);
#pragma unroll
            for (int u = 0; u < 8; ++u) b[u] = *reinterpret_cast<const float4*>(Brows + (ct + 8 * u) * KSP + k);
#pragma unroll
            for (int ii = 0; ii < 4; ++ii)
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    float s = acc[ii * 8 + u];
                    s = fmaf(a[ii].x, b[u].x, s);
                    s = fmaf(a[ii].y, b[u].y, s);
                    s = fmaf(a[ii].z, b[u].z, s);
                    s = fmaf(a[ii].w, b[u].w, s);
                    acc[ii * 8 + u] = s;
                }
        }
    }
}

// Tm = (I + A)^-1 for a strictly lower-triangular A (stride AP), by blocked forward
// substitution over row blocks of 16: for row block b (rows r0 = 16b ..), first
// R = -A[rows, :r0] · Tm[:r0, :r0] (the part from finished rows), then per column c the
// 16-row forward substitution (I + A_bb) X = R (c < r0) or = the identity block (r0 <= c <
// r0+16); columns beyond are zero. 128 threads per matrix (ht = 0..127); every thread of the
// block calls this (it synchronises the block).
__device__ __forceinline__ void solve_blocked(float* __restrict__ Tm, const float* __restrict__ A, int ht) {
    for (int b = 0; b < CH / 16; ++b) {
        const int r0 = 16 * b;
        for (int e = ht; e < 16 * r0; e += 128) {
            const int rr = e / r0, c = e - rr * r0;
            const float* arow = A + (r0 + rr) * AP;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;  // Tm[k][c] = 0 for k < c
            for (int k = c & ~3; k < r0; k += 4) {
                const float4 av = *reinterpret_cast<const float4*>(arow + k);
                a0 = fmaf(av.x, Tm[k * AP + c], a0);
                a1 = fmaf(av.y, Tm[(k + 1) * AP + c], a1);
                a2 = fmaf(av.z, Tm[(k + 2) * AP + c], a2);
                a3 = fmaf(av.w, Tm[(k + 3) * AP + c], a3);
            }
            Tm[(r0 + rr) * AP + c] = -((a0 + a1) + (a2 + a3));
        }
        __syncthreads();
        if (ht < CH) {
            const int c = ht;
            float x[16];
            if (c < r0 + 16) {
#pragma unroll
                for (int rr = 0; rr < 16; ++rr) x[rr] = c < r0 ? Tm[(r0 + rr) * AP + c] : (c - r0 == rr ? 1.f : 0.f);
#pragma unroll
                for (int rr = 1; rr < 16; ++rr) {
                    const float* arow = A + (r0 + rr) * AP + r0;
                    float sum = x[rr];
#pragma unroll
                    for (int m = 0; m < rr; ++m) sum = fmaf(-arow[m], x[m], sum);
                    x[rr] = sum;
                }
            } else {
#pragma unroll
                for (int rr = 0; rr < 16; ++rr) x[rr] = 0.f;
            }
#pragma unroll
            for (int rr = 0; rr < 16; ++rr) Tm[(r0 + rr) * AP + c] = x[rr];
        }
        __syncthreads();
    }
}

// A 64 x 128 f32 chunk (rows of stride `sstride`) into registers, every load issued before any
// is used: thread t (of PB_THREADS) holds float4 e = t + PB_THREADS·j, i.e. row e / 32, columns
// 4·(e % 32) .. + 3.
__device__ __forceinline__ void load_chunk(float4 (&r)[CH * DK / 4 / PB_THREADS], const float* src, int sstride,
                                           int t) {
#pragma unroll
    for (int j = 0; j < CH * DK / 4 / PB_THREADS; ++j) {
        const int e = t + j * PB_THREADS;
        r[j] = *reinterpret_cast<const float4*>(src + (size_t)(e >> 5) * sstride + 4 * (e & 31));
    }
}

// dst[r][c] = chunk[r][c] (dst stride KSP) for a chunk held as load_chunk leaves it.
__device__ __forceinline__ void store_chunk(float* dst, const float4 (&r)[CH * DK / 4 / PB_THREADS], int t) {
#pragma unroll
    for (int j = 0; j < CH * DK / 4 / PB_THREADS; ++j) {
        const int e = t + j * PB_THREADS;
        *reinterpret_cast<float4*>(dst + (e >> 5) * KSP + 4 * (e & 31)) = r[j];
    }
}

// dst[r][c] = scale[r] · chunk[r][c] (dst stride XSP) for a chunk held as load_chunk leaves it;
// RND: TF32-rounded (cvt.rna), for a tensor-core operand that is then loaded without a cvt.
template <bool RND = false>
__device__ __forceinline__ void store_chunk_scaled(float* dst, const float4 (&r)[CH * DK / 4 / PB_THREADS],
                                                   const float* scale, int t) {
    const auto rd = [](float x) { return RND ? round_tf32(x) : x; };
#pragma unroll
    for (int j = 0; j < CH * DK / 4 / PB_THREADS; ++j) {
        const int e = t + j * PB_THREADS, row = e >> 5;
        const float s = scale[row];
        *reinterpret_cast<float4*>(dst + row * XSP + 4 * (e & 31)) =
            make_float4(rd(r[j].x * s), rd(r[j].y * s), rd(r[j].z * s), rd(r[j].w * s));
    }
}

// dst[r][c] = scale[r] · src[r][c] for a 64 x 128 chunk; dst stride XSP, src stride sstride;
// PB_THREADS threads. RND as store_chunk_scaled.
template <bool RND = false>
__device__ __forceinline__ void scale_rows(float* dst, const float* src, int sstride, const float* scale, int t) {
    float4 r[CH * DK / 4 / PB_THREADS];
    load_chunk(r, src, sstride, t);
    store_chunk_scaled<RND>(dst, r, scale, t);
}

// A warp's 16 x 8·NT block of mma accumulators (warp_mma's C layout: acc[nt] is the n-tile of
// columns col0 + 8·nt ..) stored at rows row0 .. of out (global, row stride DV), a float2 per lane
// and row; RND: TF32-rounded.
template <int NT, bool RND>
__device__ __forceinline__ void store_acc_tile(float* __restrict__ out, const float (&acc)[NT][4], int row0, int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + g + 8 * h, c = col0 + 8 * nt + 2 * q;
            const float o0 = acc[nt][2 * h], o1 = acc[nt][2 * h + 1];
            *reinterpret_cast<float2*>(out + (size_t)r * DV + c) =
                RND ? make_float2(round_tf32(o0), round_tf32(o1)) : make_float2(o0, o1);
        }
}

// out (global, 64 rows of stride DV) = Tm (stride AP, lower triangular) · X (64 x 128, stride
// XSP); 256 threads. Warps skip the k range above their rows.
// RND (TC only): store the products TF32-rounded (W, an mma operand of gdnp_state_tf32 only).
// OPR (TC only): Tm and X hold TF32-rounded values already (no cvt on their loads).
template <bool TC, bool RND = false, bool OPR = false>
__device__ __forceinline__ void tri_mm(float* __restrict__ out, const float* Tm, const float* X, int t) {
    const int warp = t >> 5;
    if constexpr (TC) {
        const int mt = warp & 3, nh = warp >> 2;
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
        warp_mma<8, AP, 1, XSP, 1, OPR, OPR, true, false>(acc, Tm + 16 * mt * AP, X + 64 * nh, 2 * mt + 2);
        store_acc_tile<8, RND>(out, acc, 16 * mt, 64 * nh);
    } else {
        const int rt = t >> 4, ct = t & 15, mend = 8 * warp + 8;
        float acc[4][8];
#pragma unroll
        for (int ii = 0; ii < 4; ++ii)
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[ii][c] = 0.f;
#pragma unroll 2
        for (int m = 0; m < mend; m += 4) {
            float4 a[4], b0[4], b1[4];
#pragma unroll
            for (int ii = 0; ii < 4; ++ii) a[ii] = *reinterpret_cast<const float4*>(Tm + (4 * rt + ii) * AP + m);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                b0[kk] = *reinterpret_cast<const float4*>(X + (m + kk) * XSP + 4 * ct);
                b1[kk] = *reinterpret_cast<const float4*>(X + (m + kk) * XSP + 64 + 4 * ct);
            }
#pragma unroll
            for (int ii = 0; ii < 4; ++ii)
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    const float av = comp(a[ii], kk);
                    acc[ii][0] = fmaf(av, b0[kk].x, acc[ii][0]);
                    acc[ii][1] = fmaf(av, b0[kk].y, acc[ii][1]);
                    acc[ii][2] = fmaf(av, b0[kk].z, acc[ii][2]);
                    acc[ii][3] = fmaf(av, b0[kk].w, acc[ii][3]);
                    acc[ii][4] = fmaf(av, b1[kk].x, acc[ii][4]);
                    acc[ii][5] = fmaf(av, b1[kk].y, acc[ii][5]);
                    acc[ii][6] = fmaf(av, b1[kk].z, acc[ii][6]);
                    acc[ii][7] = fmaf(av, b1[kk].w, acc[ii][7]);
                }
        }
#pragma unroll
        for (int ii = 0; ii < 4; ++ii) {
            float* o = out + (size_t)(4 * rt + ii) * DV;
            *reinterpret_cast<float4*>(o + 4 * ct) = make_float4(acc[ii][0], acc[ii][1], acc[ii][2], acc[ii][3]);
            *reinterpret_cast<float4*>(o + 64 + 4 * ct) = make_float4(acc[ii][4], acc[ii][5], acc[ii][6], acc[ii][7]);
        }
    }
}

// tri_mm on the tensor cores with the warps' shares balanced (session 54). tri_mm gives warp w
// the row tile w & 3 (2, 4, 6 or 8 k-steps: Tm is lower triangular) and 64 columns, so the warps
// of row tile 3 do four times the work of row tile 0's and the rest wait at the next barrier.
// Here warp w takes the row tiles P and 3 − P (P = w & 1: 2 + 8 or 4 + 6 k-steps, 10 either
// way) and the 32 columns 32·(w >> 1) ..; a k-step's B fragments (scalar loads of the k-major X)
// serve both row tiles while both need them. Every output element meets the same Tm and X
// values in the same k-step order as in tri_mm (one mma.sync per k-step, from zero), so the
// same bits. RND / OPR as tri_mm.
template <bool RND, bool OPR, int P>
__device__ __forceinline__ void tri_mm_bal_p(float* __restrict__ out, const float* Tm, const float* X, int cq) {
    constexpr int MA = P, MB = 3 - P;                // row tiles (16 rows each)
    constexpr int KA = 2 * MA + 2, KB = 2 * MB + 2;  // their k-steps (KA < KB)
    static_assert(KA < KB && KA + KB == 10, "row tile pairs {0, 3}, {1, 2}");
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    float acc_a[4][4], acc_b[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_a[nt][e] = acc_b[nt][e] = 0.f;
    const float* ta = ldsm_a_lane<AP>(Tm + 16 * MA * AP);
    const float* tb = ldsm_a_lane<AP>(Tm + 16 * MB * AP);
    const float* xb = X + q * XSP + g + 32 * cq;
    const auto cv = [](float x) { return OPR ? __float_as_uint(x) : to_tf32(x); };
#pragma unroll
    for (int ks = 0; ks < KB; ++ks) {
        unsigned b[4][2];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            b[nt][0] = cv(xb[ks * 8 * XSP + nt * 8]);
            b[nt][1] = cv(xb[ks * 8 * XSP + 4 * XSP + nt * 8]);
        }
        unsigned a[4];
        ldsm_x4(a, tb + ks * 8);
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = cv(__uint_as_float(a[i]));
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma_tf32(acc_b[nt], a[0], a[1], a[2], a[3], b[nt][0], b[nt][1]);
        if (ks < KA) {
            ldsm_x4(a, ta + ks * 8);
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = cv(__uint_as_float(a[i]));
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) mma_tf32(acc_a[nt], a[0], a[1], a[2], a[3], b[nt][0], b[nt][1]);
        }
    }
    store_acc_tile<4, RND>(out, acc_a, 16 * MA, 32 * cq);
    store_acc_tile<4, RND>(out, acc_b, 16 * MB, 32 * cq);
}
template <bool RND, bool OPR>
__device__ __forceinline__ void tri_mm_bal(float* __restrict__ out, const float* Tm, const float* X, int t) {
    static_assert(4 * 32 == DV, "four warps' 32-column quarters cover the value (key) columns");
    const int warp = t >> 5;
    if (warp & 1) tri_mm_bal_p<RND, OPR, 1>(out, Tm, X, warp >> 1);
    else tri_mm_bal_p<RND, OPR, 0>(out, Tm, X, warp >> 1);
}

// tri_mm, or with BAL (TC only) tri_mm_bal: the same products, the same bits.
template <bool TC, bool RND, bool OPR, bool BAL>
__device__ __forceinline__ void tri_mm_pick(float* __restrict__ out, const float* Tm, const float* X, int t) {
    if constexpr (BAL) tri_mm_bal<RND, OPR>(out, Tm, X, t);
    else tri_mm<TC, RND, OPR>(out, Tm, X, t);
}

// RX (TC with PRE only): the operands of the four Tm products rounded to TF32 once, where they
// are stored (β V and β e^γ K̂ as they are scaled into XS, Tm_0 and Tm_1 after the solve), so
// that tri_mm loads them without a cvt.rna (about four instructions per element on sm_90), and
// A_h and P_h made in one pass that computes each decay factor e^{γ_h[r] − γ_h[m]} once for both
// (the form before computed A in warps 0-3 and P in warps 4-7, each factor twice). The same
// values reach the tensor cores and the same expressions make A and P, so the same bits.
// BAL (TC only; session 54): the four Tm products with the warps' shares balanced (tri_mm_bal).
// `ablate` (measurement only; 0 in every real call): bits 1, 2, 4, 8 leave out the solve, the
// four Tm products, the A and P element loops, the Gram products (the outputs are then wrong;
// the time they save is their cost in place).
template <bool TC, bool PRE = true, bool RX = false, bool BAL = false>
__device__ __forceinline__ void prep_body(float* __restrict__ vb, float* __restrict__ w_out, float* __restrict__ p_out,
                                          float* __restrict__ gam_out, float* __restrict__ conv_state,
                                          const float* __restrict__ qn, const float* __restrict__ kn,
                                          const float* __restrict__ g_in, const float* __restrict__ beta_in,
                                          const float* __restrict__ proj, int T, int Tpad, int NC, int ablate) {
    constexpr bool RS = TC && PRE && RX;  // Tm products' operands rounded where stored
    extern __shared__ float4 smem4[];
    float* S = reinterpret_cast<float*>(smem4);
    float* KS = S + PB_KS;
    float* XS = S + PB_XS;
    float* A0 = S + PB_A0;
    float* A1 = S + PB_A1;
    float* G = S + PB_G;
    float* GAM = S + PB_GAM;
    float* BET = S + PB_BET;
    float* BEG = S + PB_BEG;
    const int i = blockIdx.x, n = blockIdx.y, t = threadIdx.x, warp = t >> 5, tid = t & 127;
    if (t == 0 && dynamic_smem_bytes() < PB_FLOATS * 4u) __trap();

    calla_pdl_wait();

    // The chunk's loads first, so that their round trips overlap the conv-state shift and, with
    // the tensor cores, V_0's the Gram products and the solve: K̂, Q̂, g, β, and (TC) V_0, held
    // in registers until its scaled copy is stored after the solve. The SIMT products need
    // those registers themselves: there K̂ and Q̂ come one after the other, V_0 after the solve.
    const size_t qk0 = ((size_t)i * Tpad + (size_t)n * CH) * DK;
    const size_t v0 = ((size_t)(VPK * i) * Tpad + (size_t)n * CH) * DV;
    const size_t v1 = ((size_t)(VPK * i + 1) * Tpad + (size_t)n * CH) * DV;
    float4 vr[CH * DK / 4 / PB_THREADS];
    float gv = 0.f, bv = 0.f;
    if (t < 2 * CH) {
        const size_t gi = (size_t)(VPK * i + t / CH) * Tpad + (size_t)n * CH + (t % CH);
        gv = g_in[gi];
        bv = beta_in[gi];
    }
    // Conv-state shift: new row r = window row T + r (window = [old state ‖ T pre-conv rows]).
    // One thread per channel reads all three sources before writing; gdnp_conv (the only reader
    // of the old state) has finished.
    auto shift_conv_state = [&]() {
        const int nb = gridDim.x * gridDim.y, b = n * gridDim.x + i;
        for (int c = b * PB_THREADS + t; c < CONV_DIM; c += nb * PB_THREADS) {
            float v[3];
#pragma unroll
            for (int r = 0; r < 3; ++r) {
                const int w = T + r;
                v[r] = w < 3 ? conv_state[(size_t)w * CONV_DIM + c] : proj[(size_t)(w - 3) * PROJ + c];
            }
#pragma unroll
            for (int r = 0; r < 3; ++r) conv_state[(size_t)r * CONV_DIM + c] = v[r];
        }
    };
    if constexpr (TC) {
        float4 kr[CH * DK / 4 / PB_THREADS], qr[CH * DK / 4 / PB_THREADS];
        load_chunk(kr, kn + qk0, DK, t);
        load_chunk(qr, qn + qk0, DK, t);
        load_chunk(vr, vb + v0, DV, t);
        shift_conv_state();
        store_chunk(KS, kr, t);
        store_chunk(XS, qr, t);
    } else {
        shift_conv_state();
        load_chunk(vr, kn + qk0, DK, t);  // vr as scratch: V_0 comes after the solve
        store_chunk(KS, vr, t);
        load_chunk(vr, qn + qk0, DK, t);
        store_chunk(XS, vr, t);
    }
    if (t < 2 * CH) {
        G[t] = gv;
        BET[t] = bv;
    }
    __syncthreads();
    if ((t & 31) == 0 && t < 32 * VPK) {
        // γ_r = Σ_{s≤r} g_s, summed in order (as the reference): lane 0 of warp h, head h
        const int h = t >> 5;
        float acc = 0.f;
#pragma unroll
        for (int s4 = 0; s4 < CH; s4 += 4) {
            const float4 gv = *reinterpret_cast<const float4*>(G + h * CH + s4);
            acc += gv.x;
            GAM[h * CH + s4] = acc;
            acc += gv.y;
            GAM[h * CH + s4 + 1] = acc;
            acc += gv.z;
            GAM[h * CH + s4 + 2] = acc;
            acc += gv.w;
            GAM[h * CH + s4 + 3] = acc;
        }
    }

    // K̂K̂ᵀ (warps 0-3) and Q̂K̂ᵀ (warps 4-7), 32 elements per thread.
    float acc[32];
    if (!(ablate & 8)) gram<TC, PRE>(acc, warp < 4 ? KS : XS, KS, tid);
    else {
#pragma unroll
        for (int e = 0; e < 32; ++e) acc[e] = 0.f;
    }
    if (warp < 4 || RS) {
        // K̂K̂ᵀ into A1; with RS also Q̂K̂ᵀ into A0 (free until the solve writes Tm_0 there)
#pragma unroll
        for (int e = 0; e < 32; ++e) {
            int r, c;
            gram_pos<TC>(e, tid, r, c);
            (warp < 4 ? A1 : A0)[r * AP + c] = acc[e];
        }
    }
    __syncthreads();  // γ and K̂K̂ᵀ (RS: and Q̂K̂ᵀ) ready
    if (t < 2 * CH) {
        const float gm = GAM[t];
        BEG[t] = BET[t] * expf(gm);
        gam_out[(size_t)(VPK * i + t / CH) * Tpad + (size_t)n * CH + (t % CH)] = gm;
    }

    float* AX0 = XS;            // A_0, A_1 in the XS space (Q̂ is no longer needed)
    float* AX1 = XS + CH * AP;
    if (ablate & 4) {
    } else if (RS) {
        // A_h and P_h in one pass over the 64 x 64 positions, both from one e^{γ_h[r] − γ_h[m]}
        // (the expression of the two loops below, so the same bits): 16 positions per thread,
        // a warp's 32 lanes one half-row, the halves alternating so that every warp has the
        // same share of the lower triangle; P's rows stored whole (coalesced).
        float* const P0 = p_out + ((size_t)(VPK * i) * NC + n) * CH * CH;  // P_1 at + NC·CH·CH
        const int m0 = 32 * ((t >> 5) & 1) + (t & 31), m1 = m0 ^ 32;  // even j, odd j
#pragma unroll 2
        for (int j = 0; j < CH * CH / PB_THREADS; ++j) {
            const int r = (t >> 6) + 4 * j, m = (j & 1) ? m1 : m0;
            const float kk = A1[r * AP + m], qk = A0[r * AP + m];
#pragma unroll
            for (int h = 0; h < VPK; ++h) {
                float a = 0.f, v = 0.f;
                if (m <= r) {
                    const float d = expf(GAM[h * CH + r] - GAM[h * CH + m]);
                    if (m < r) a = (BET[h * CH + r] * kk) * d;
                    v = round_tf32(qk * d);  // P is only an mma operand
                }
                (h ? AX1 : AX0)[r * AP + m] = a;
                P0[(size_t)h * NC * CH * CH + r * CH + m] = v;
            }
        }
    } else if (warp < 4) {
        // A_h[r, m] = β_h[r] (k̂_r·k̂_m) e^{γ_h[r] − γ_h[m]} for m < r, else 0.
        for (int e = tid; e < CH * CH; e += 128) {
            const int r = e >> 6, m = e & 63;
            const float kk = A1[r * AP + m];
            float a0 = 0.f, a1 = 0.f;
            if (m < r) {
                a0 = (BET[r] * kk) * expf(GAM[r] - GAM[m]);
                a1 = (BET[CH + r] * kk) * expf(GAM[CH + r] - GAM[CH + m]);
            }
            AX0[r * AP + m] = a0;
            AX1[r * AP + m] = a1;
        }
    } else {
        // P_h = (Q̂K̂ᵀ) ⊙ D_h, lower triangle with the diagonal, zeros above.
#pragma unroll
        for (int h = 0; h < VPK; ++h) {
            float* P = p_out + ((size_t)(VPK * i + h) * NC + n) * CH * CH;
#pragma unroll
            for (int e = 0; e < 32; ++e) {
                int r, c;
                gram_pos<TC>(e, tid, r, c);
                float v = 0.f;
                if (c <= r) v = acc[e] * expf(GAM[h * CH + r] - GAM[h * CH + c]);
                P[r * CH + c] = TC && PRE ? round_tf32(v) : v;  // TC: P is only an mma operand
            }
        }
    }
    __syncthreads();

    // Tm_h = (I + A_h)^-1 into the A0 / A1 buffers: threads 0-127 head 0, 128-255 head 1.
    if (!(ablate & 1)) solve_blocked((t >> 7) ? A1 : A0, (t >> 7) ? AX1 : AX0, tid);

    if constexpr (RS) {
        // Tm_0 and Tm_1 (adjacent, 64 rows of stride AP each; the solve wrote every column
        // below 64 and ended with a barrier) TF32-rounded in place: only the products below
        // read them from here
#pragma unroll
        for (int j = 0; j < 2 * CH * AP / 4 / PB_THREADS + 1; ++j) {
            const int e = t + j * PB_THREADS;
            if (e < 2 * CH * AP / 4) {
                float4* q = reinterpret_cast<float4*>(A0) + e;
                const float4 v = *q;
                *q = make_float4(round_tf32(v.x), round_tf32(v.y), round_tf32(v.z), round_tf32(v.w));
            }
        }
    }
    if constexpr (TC) store_chunk_scaled<RS>(XS, vr, BET, t);
    else scale_rows(XS, vb + v0, DV, BET, t);
    __syncthreads();

    // U_0 = Tm_0 β_0 V_0 (over v, in place), U_1, then W_0 = Tm_0 β_0 e^γ0 K̂, W_1. TC: V_1's
    // loads are issued before U_0's product (other rows of vb) and land during it.
    const bool mm = !(ablate & 2);
    if constexpr (TC) load_chunk(vr, vb + v1, DV, t);
    if (mm) tri_mm_pick<TC, false, RS, BAL>(vb + v0, A0, XS, t);
    __syncthreads();
    if constexpr (TC) store_chunk_scaled<RS>(XS, vr, BET + CH, t);
    else scale_rows(XS, vb + v1, DV, BET + CH, t);
    __syncthreads();
    if (mm) tri_mm_pick<TC, false, RS, BAL>(vb + v1, A1, XS, t);
    __syncthreads();
    scale_rows<RS>(XS, KS, KSP, BEG, t);
    __syncthreads();
    if (mm) tri_mm_pick<TC, PRE, RS, BAL>(w_out + v0, A0, XS, t);
    __syncthreads();
    scale_rows<RS>(XS, KS, KSP, BEG + CH, t);
    __syncthreads();
    if (mm) tri_mm_pick<TC, PRE, RS, BAL>(w_out + v1, A1, XS, t);
}

}  // namespace calla_gdnp

// The prep entry points (grid (n_k, NC), 256 threads, PB_FLOATS floats of dynamic shared memory).
// gdnp_prep_tf32 is session 52's lean form (RX: the Tm products' operands rounded where stored,
// A and P in one pass), gdnp_prep_tf32lx its measured twin, the form before; gdnp_prep_tf32b is
// the lean form with the Tm products balanced over the warps (BAL, session 54; the default
// since session 56). The same bits.
#define CALLA_GDNP_PREP_ENTRY(NAME, TC, PRE, RX, BAL)                                                                \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                           \
    NAME(float* __restrict__ vb, float* __restrict__ w_out, float* __restrict__ p_out, float* __restrict__ gam_out, \
         float* __restrict__ conv_state, const float* __restrict__ qn, const float* __restrict__ kn,                \
         const float* __restrict__ g_in, const float* __restrict__ beta_in, const float* __restrict__ proj, int T,  \
         int Tpad, int NC, int ablate) {                                                                            \
        calla_gdnp::prep_body<TC, PRE, RX, BAL>(vb, w_out, p_out, gam_out, conv_state, qn, kn, g_in, beta_in, proj, \
                                                T, Tpad, NC, ablate);                                               \
    }
CALLA_GDNP_PREP_ENTRY(gdnp_prep_f32, false, true, false, false)
CALLA_GDNP_PREP_ENTRY(gdnp_prep_tf32b, true, true, true, true)
CALLA_GDNP_PREP_ENTRY(gdnp_prep_tf32, true, true, true, false)
CALLA_GDNP_PREP_ENTRY(gdnp_prep_tf32lx, true, true, false, false)

// =====================================================================================
// gdnp_state_{f32,tf32,tf32wg,tf32wgc}: grid (n_v · SPLIT), 256 (f32) or 512 (tf32*) threads,
// dynamic shared memory SC_FLOATS floats (the wgmma forms: see "the wgmma form" below).
// Block = (V head j, value columns [c0, c0 + CW)); the block's slice of S lives in registers
// (16 per thread) and, as the B operand of W·S and Q̂·S, in shared memory (TC: n-major, as V'
// and e^{γ_C−γ}V', so that ldmatrix fetches the mma fragments; SKP, VKP).
//
// Pipeline (cp.async groups, committed in this order per chunk n, one group each):
//   H(g): half g%2 (key columns 64·(g%2) ..) of the W and Q̂ rows of chunk g/2, into ring slot
//         g%3; H(2n+1) also carries U_n (the block's columns) and γ_n into buffer n%2.
//   KP(n): K̂ and P of chunk n (single buffer).
// Chunk n: X = [W; Q̂]·S over half 0 (slot of H(2n)), wait H(2n+1), barrier, issue H(2n+3);
// X += half 1, epilogue (V', e^{γ_C−γ}V', e^γ Q̂S), wait KP(n), barrier, issue H(2n+4); state
// update and O = e^γQ̂S + P V'; S to shared memory; barrier; issue KP(n+1). Every W/Q̂ half is
// requested about one chunk before it is used. Groups past the last chunk are empty.
// =====================================================================================
namespace calla_gdnp {

constexpr int SPLIT = 4;               // blocks per V head
constexpr int CW = DV / SPLIT;         // value columns per block
template <bool TC>
constexpr int sc_threads() { return TC ? 512 : 256; }  // TC: 16 warps, f32: 8 warps
template <bool TC>
constexpr int sc_ns() { return TC ? 8 : 16; }          // S elements per thread
constexpr int HK = DK / 2;             // key columns per ring slot
constexpr int HP = HK + 4;             // row stride of a slot (row-major A operand)
constexpr int KCP = DK + 8;            // K̂ rows (read transposed)
constexpr int PP = CH + 4;             // P rows
constexpr int CWP = CW + 8;            // rows of the CW-wide slices (k-major B operands)
constexpr int SC_SLOT = 2 * CH * HP;        // floats per ring slot: W rows 0..63, Q̂ rows 64..127
constexpr int SC_WQ = 0;                    // 3 ring slots
constexpr int SC_U = SC_WQ + 3 * SC_SLOT;   // 2 x [CH][CWP] U slices
constexpr int SC_GAM = SC_U + 2 * CH * CWP; // 2 x [CH] γ
constexpr int SC_KC = SC_GAM + 2 * CH;      // [CH][KCP]
constexpr int SC_P = SC_KC + CH * KCP;      // [CH][PP]
constexpr int SC_S = SC_P + CH * PP;        // [DK][CWP]
constexpr int SC_VP = SC_S + DK * CWP;      // [CH][CWP] V'
constexpr int SC_VD = SC_VP + CH * CWP;     // [CH][CWP] e^{γ_C − γ} V'
constexpr int SC_OB = SC_VD + CH * CWP;     // [CH][CWP] e^γ Q̂ S (f32 variant)
// TC: the mma B operands S, V' and e^{γ_C − γ}V' are stored n-major (column c of the block at
// row c), in the regions above, so that ldmatrix fetches their fragments (warp_mma's BLD):
// S as [CW][SKP], V' and e^{γ_C − γ}V' as [CW][VKP]. Row strides of 132 and 68 floats put the
// 8 rows of an ldmatrix and the lanes' transposed stores in distinct banks.
constexpr int SKP = DK + 4;
constexpr int VKP = CH + 4;
static_assert(CW * SKP <= DK * CWP && CW * VKP <= CH * CWP, "the n-major operands fit their regions");
static_assert(SKP % 4 == 0 && VKP % 4 == 0 && HP % 4 == 0 && PP % 4 == 0 && SC_SLOT % 4 == 0 && SC_VP % 4 == 0 &&
                  SC_VD % 4 == 0, "ldmatrix rows are whole 16-byte chunks");
constexpr int SC_FLOATS = SC_OB + CH * CWP;
static_assert(CW == 32, "thread mappings assume 32 value columns per block");
static_assert(SC_U % 4 == 0 && SC_GAM % 4 == 0 && SC_KC % 4 == 0 && SC_P % 4 == 0 && SC_S % 4 == 0, "alignment");
static_assert(SC_FLOATS * 4 <= 232448, "shared memory per block");

// Position of element e (0..sc_ns()-1) of this thread's share of the S slice [DK][CW]. TC:
// warp w owns the mma tiles of rows 16·(w%8).. and columns 16·(w/8)..+15 (two n-tiles).
template <bool TC>
__device__ __forceinline__ void s_pos(int e, int t, int& r, int& c) {
    if constexpr (TC) {
        const int warp = t >> 5, lane = t & 31, g = lane >> 2, q = lane & 3;
        const int nt = e >> 2, el = e & 3;
        r = 16 * (warp & 7) + g + 8 * (el >> 1);
        c = 16 * (warp >> 3) + 8 * nt + 2 * q + (el & 1);
    } else {
        r = 4 * (t >> 3) + (e >> 2);
        c = 4 * (t & 7) + (e & 3);
    }
}

// ---- the gated RMSNorm's arithmetic in one fixed order (MODEL.md §3.5 step 8: out = norm_w ⊙
// o / sqrt(mean(o²) + eps) ⊙ SiLU(z), per V head of DV = 128 columns), shared by gdnp_norm,
// gdnp_norm_acts and the state kernel that normalizes its own output (gdnp_state_tf32wgcn),
// so that they give the same bits. Σo²: the column pairs (2p, 2p + 1) as fma(o₁, o₁, o₀·o₀),
// then a binary tree over p = 0..63 whose level i (0..5) adds partner p ^ 2^i (commutative
// adds, so every holder of a partial gets the same bits); the value (o · r) · (norm_w ·
// SiLU(z)). The intrinsics keep the compiler from contracting or reordering any of it.
__device__ __forceinline__ float gn_pair_sq(float a, float b) { return __fmaf_rn(b, b, __fmul_rn(a, a)); }
// 1 / sqrt(Σo² / DV + eps) (DV a power of two: the division is exact)
__device__ __forceinline__ float gn_rinv(float ss) {
    return __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(ss, 1.0f / (float)DV), CALLA_RMS_EPS)));
}
__device__ __forceinline__ float gn_gate(float z, float nw) { return __fmul_rn(nw, silu_acc(z)); }
__device__ __forceinline__ float gn_val(float o, float r, float gate) { return __fmul_rn(__fmul_rn(o, r), gate); }
static_assert(DV == 128, "the norm's tree has 6 levels over 64 column pairs");

struct StateArgs {
    const float* qn;
    const float* kn;
    const float* vu;
    const float* w;
    const float* P;
    const float* gam;
    int j, c0, Tpad, NC;
};

// Copies ROWS rows of CHUNKS 16-byte chunks from src (row stride SS floats) to dst (row stride DS
// floats) with NTH threads: thread t takes chunk t % CHUNKS of rows t / CHUNKS + v · (NTH /
// CHUNKS), a compile-time trip count, so every copy is a fixed offset from the two bases.
template <int NTH, int ROWS, int CHUNKS, int SS, int DS>
__device__ __forceinline__ void copy_rows(float* dst, const float* src, int t) {
    constexpr int RPV = NTH / CHUNKS, NV = ROWS / RPV;
    static_assert(NTH % CHUNKS == 0 && ROWS % RPV == 0, "whole rows per pass");
    const int c = t % CHUNKS, r0 = t / CHUNKS;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
        const int r = r0 + v * RPV;
        cp16(dst + r * DS + 4 * c, src + r * SS + 4 * c);
    }
}

// ---- the wgmma form of the state kernel's products (gdnp_state_tf32wg): warpgroup MMAs read
// their shared-memory operands once per warpgroup, where the mma.sync form has every warp load
// its fragments with ldmatrix (the B operand S eight times over). Canonical 128-byte-swizzle
// K-major layouts (PTX "matrix descriptor"; as attn_prefill.cu's, for 4-byte elements): a
// 64-row operand half (64 key columns) is 2 column blocks of 32 floats, block cb holding the
// 64 rows at 128 bytes each (8 KB per block), 16-byte chunk c of row r at chunk c ^ (r & 7);
// S (B, N = the block's 32 value columns, K = 128 key rows) is 4 such blocks of 32 n-rows
// (4 KB each); P (A of P·V', 64 chunk rows x 64) as a ring half; V' and e^{γ_C−γ}V' (B, N =
// 32 columns, K = 64 chunk rows) 2 blocks of 32 n-rows. Every operand starts 1024-byte aligned
// (the kernel aligns its dynamic shared memory up; the host adds 1 KiB). Descriptor: start +
// 32 bytes per k-step of 8, SBO 1024 (8 rows), LBO unused. The ring keeps its region; its
// slots are WG_SLOT = 8192 floats apart instead of SC_SLOT = 8704 (W rows then Q̂ rows); the
// swizzled S sits WG_SHIFT floats into the [DK][CWP] region of S (1024-byte aligned there).
// With the chunk update on wgmma too (WGC) every region but the ring moves up by WG_SHIFT
// floats, which puts S, P, V' and e^{γ_C−γ}V' on 1024-byte boundaries: shared memory
// SC_FLOATS + WG_SHIFT floats.
constexpr int WG_MAT = 2 * CH * 32;  // one 64-row operand half: 2 column blocks
constexpr int WG_SLOT = 2 * WG_MAT;  // W then Q̂
constexpr int WG_SHIFT = 128;
static_assert(3 * WG_SLOT + WG_SHIFT <= SC_U - SC_WQ && SC_WQ % 256 == 0, "the swizzled ring fits the ring region");
static_assert((SC_S + WG_SHIFT) % 256 == 0 && (SC_P + WG_SHIFT) % 256 == 0 && (SC_VP + WG_SHIFT) % 256 == 0 &&
                  (SC_VD + WG_SHIFT) % 256 == 0,
              "the swizzled operands start 1024-byte aligned");
static_assert(4 * CW * 32 + WG_SHIFT <= DK * CWP && CH * CH <= CH * PP && 2 * CW * 32 <= CH * CWP,
              "the swizzled operands fit their regions");
static_assert((SC_FLOATS + WG_SHIFT) * 4 + 1024 <= 232448, "shared memory per block of the wgmma forms");
// float offset of element (r, k) of a K-major operand of 32-float rows with `rows` rows per block
template <int ROWS>
__device__ __forceinline__ int sw_off(int r, int k) {
    return (k >> 5) * (ROWS * 32) + r * 32 + ((((k & 31) >> 2) ^ (r & 7)) << 2) + (k & 3);
}
// LBO 16 (unused), SBO 1024 (8 rows)
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) { return calla_wgmma_desc_sw128(addr, 16, 1024); }

// D(64 x 16) += A(64 x 8, smem) · B(8 x 16, smem), TF32, f32 accumulators in the mma.sync
// m16n8 layout per warp (d[4·nt ..] = n-tile nt)
__device__ __forceinline__ void wgmma_tf32_n16(float (&d)[16], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(1));
}
// Keeps the compiler from moving reads of the accumulators above wgmma.wait_group.
__device__ __forceinline__ void fence_acc8(float (&d)[16]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// X(64 x 16) += rows [W or Q̂] of one ring-slot half · S[key rows 64·half .., columns n0 ..]:
// warpgroup wg = warp / 4 takes W (even) or Q̂ (odd) and columns n0 = 16·(wg / 2), i.e. the
// rows and columns the mma.sync form gives warp w (m-tile w & 7, columns 16·(w >> 3)), in the
// same accumulator layout. Waits for its MMAs before returning.
__device__ __forceinline__ void half_product_wg(float (&acc)[16], const float* slot, const float* Sw, int half, int t) {
    const int wg = t >> 7;
    const unsigned long long da = wg_desc((unsigned)__cvta_generic_to_shared(slot + (wg & 1) * WG_MAT));
    const unsigned long long db = wg_desc((unsigned)__cvta_generic_to_shared(Sw + 2 * half * (CW * 32) + 16 * (wg >> 1) * 32));
    calla_wgmma_fence();
#pragma unroll
    for (int s = 0; s < HK / 8; ++s) {
        const unsigned off = (s & 3) * 32u;  // 8 floats per k-step within a 128-byte row
        wgmma_tf32_n16(acc, calla_wgmma_desc_at(da, (s >> 2) * (CH * 128) + off), calla_wgmma_desc_at(db, (s >> 2) * (CW * 128) + off));
    }
    calla_wgmma_commit();
    calla_wgmma_wait<0>();
    fence_acc8(acc);
}

// ---- the gated norm inside the state kernel (NRM, gdnp_state_tf32wgcn; docs/CUDA.md "GDN
// prefill"): the four blocks of a V head (one per column quarter) form a thread-block
// cluster. Per chunk, the odd warpgroups (which hold O) reduce Σo² over their 16 columns in
// the order of "the gated RMSNorm's arithmetic" (q lanes, then n-tiles, then warpgroup 3's
// partial added by warpgroup 1 through shared memory), warpgroup 1 sends the block's 64 row
// partials to slot [its rank] of every block of the cluster (st.async, counted on that
// block's mbarrier of the chunk's parity, NRM_TX bytes per phase), and one chunk later each
// odd thread takes the four partials of its rows, normalizes the O it kept in registers and
// writes out_proj's bf16 activations as gdnp_norm_acts does. z comes in by cp.async (each
// odd thread copies exactly the elements it reads back), the even warpgroups turn it into
// the gates norm_w ⊙ SiLU(z) while their chunk-update MMAs run.
constexpr int NRM_TX = SPLIT * CH * 4;   // bytes of partials a block receives per chunk
constexpr int NRM_EXTRA = CH + 4;        // floats past SC_FLOATS: warpgroup 3's partials, 2 mbarriers
static_assert(CH * CW + 2 * SPLIT * CH <= CH * CWP, "z and the partial-sum slots fit the SC_OB region");
static_assert((SC_FLOATS + WG_SHIFT + NRM_EXTRA) * 4 + 1024 <= 232448, "shared memory of the fused-norm form");
static_assert(CW == 32 && CH * CW % 256 == 0, "the gate loop's mapping");
// float offset of (row r, column c) of the chunk's z / gates, [CH][CW] with the 4-float groups
// XOR-swizzled by the row (8-byte pairs (c, c + 1), c even, stay together)
__device__ __forceinline__ int nz_off(int r, int c) { return r * CW + (c ^ ((r & 7) << 2)); }
// an even-warpgroup thread's first element in the gate loop (warpgroups 0 and 2: 0..255)
__device__ __forceinline__ int nrm_even_index(int t) { return (t & 127) + ((t >> 8) << 7); }
// the column of that thread's elements (all of them share it)
__device__ __forceinline__ int nrm_gate_col(int t) {
    const int e = nrm_even_index(t);
    return (e & 31) ^ (((e >> 5) & 7) << 2);
}
// An odd-warpgroup thread's z of chunk m (rows 16·(mt − 4) + g + 8h, columns cn + 8nt + 2q,
// +1) into nz; rows past T are not copied.
__device__ __forceinline__ void nrm_copy_z(float* nz, const float* proj, int j, int c0, int m, int T, int t) {
    const int warp = t >> 5, lane = t & 31, g = lane >> 2, q = lane & 3;
    const int om = (warp & 7) - 4, cn = 16 * (warp >> 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * om + g + 8 * h, tok = m * CH + r;
        if (tok < T) {
            const float* src = proj + (size_t)tok * PROJ + Z_OFF + j * DV + c0 + cn + 2 * q;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) cp8(nz + nz_off(r, cn + 8 * nt + 2 * q), src + 8 * nt);
        }
    }
}
// An odd-warpgroup thread's Σo² partials of its two rows (g, g + 8 of its 16-row block) over
// its warpgroup's 16 columns: pairs, then q lanes (XOR 1, 2), then the two n-tiles. Every lane
// of a row gets the same bits.
__device__ __forceinline__ void nrm_partials(float (&s3)[2], const float (&xo)[16]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float s2[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            float a = gn_pair_sq(xo[nt * 4 + 2 * h], xo[nt * 4 + 2 * h + 1]);
            a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 1));
            a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 2));
            s2[nt] = a;
        }
        s3[h] = __fadd_rn(s2[0], s2[1]);
    }
}
// An odd-warpgroup thread: waits for the four blocks' partials of chunk m, re-arms that
// mbarrier for chunk m + 2 (thread 128, after its own wait: no partial of chunk m + 2 can
// arrive before every odd thread here has passed this wait, since the blocks send chunk m + 2
// only after they have chunk m + 1's partials from this block, which it sends after the
// chunk's last barrier), normalizes its O of chunk m (xo, rows 16·(mt − 4) + g + 8h, columns
// cn + 8nt + 2q, +1) with the gates in nz and writes the bf16 activations word for word as
// gdnp_norm_acts does: word 8s + 4h + c of a 64-column tile holds columns (16c + 8h + s, +4),
// so the thread with q < 2 pairs its first value with lane q + 2's first, the other its
// second with lane q − 2's second (one shuffle per pair of values).
// G (gdnp_state_tf32wgcg, no cluster): the partials come from gx instead, each in one 8-byte
// word with its tag (nrm_tag) in the high half, polled until all eight words of the thread's
// rows carry chunk m's tag (no fence on either side: a word's value and tag arrive together).
template <bool G = false>
__device__ __forceinline__ void nrm_emit(const float (&xo)[16], const float* nz, const float* nsl, unsigned long long* nmb,
                                         unsigned* xb, int j, int rank, int m, int T, int t,
                                         const unsigned long long* gx = nullptr, unsigned tag = 0) {
    const int warp = t >> 5, lane = t & 31, g = lane >> 2, q = lane & 3;
    const int om = (warp & 7) - 4, cn = 16 * (warp >> 3);
    const int par = m & 1;
    float2 gb[SPLIT];
    if constexpr (G) {
        const unsigned long long* src = gx + (size_t)(j * 2 + par) * (SPLIT * CH) + 16 * om + 2 * g;
        bool all;
        unsigned spins = 0;
        unsigned long long since = 0;
        do {
            // a protocol fault traps (the launch fails) instead of spinning until the device's
            // watchdog: 2 s without the partials
            if ((++spins & 1023u) == 0) {
                const unsigned long long now = calla_globaltimer();
                if (since == 0) since = now;
                else if (now - since > 2000000000ull) __trap();
            }
            all = true;
#pragma unroll
            for (int b = 0; b < SPLIT; ++b) {
                unsigned long long w0, w1;
                asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(w0), "=l"(w1) : "l"(src + b * CH) : "memory");
                all = all && (unsigned)(w0 >> 32) == tag && (unsigned)(w1 >> 32) == tag;
                gb[b] = make_float2(__uint_as_float((unsigned)w0), __uint_as_float((unsigned)w1));
            }
        } while (!all);
    } else {
        calla_mbar_wait_parity_cluster(&nmb[par], (unsigned)(m >> 1) & 1u);
        if (t == 128) calla_mbar_arrive_expect_tx(&nmb[par], NRM_TX);
        const float* sl = nsl + par * (SPLIT * CH) + 16 * om + 2 * g;
#pragma unroll
        for (int b = 0; b < SPLIT; ++b) gb[b] = *reinterpret_cast<const float2*>(sl + b * CH);
    }
    static_assert(SPLIT == 4, "the last two levels of the tree: ranks (0 + 1) + (2 + 3)");
    const float rr[2] = {gn_rinv(__fadd_rn(__fadd_rn(gb[0].x, gb[1].x), __fadd_rn(gb[2].x, gb[3].x))),
                         gn_rinv(__fadd_rn(__fadd_rn(gb[0].y, gb[1].y), __fadd_rn(gb[2].y, gb[3].y)))};
    const int tile = 2 * j + (rank >> 1), cc = 2 * (rank & 1) + (cn >> 4);
    const bool lo = q < 2;
    const int s = lo ? 2 * q : 2 * (q - 2) + 1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * om + g + 8 * h, tok = m * CH + r;
        unsigned* wr = xb + (size_t)tok * (NV * DV / 2) + 32 * tile + 8 * s + cc;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const float2 gz = *reinterpret_cast<const float2*>(nz + nz_off(r, cn + 8 * nt + 2 * q));
            const float v0 = gn_val(xo[nt * 4 + 2 * h], rr[h], gz.x), v1 = gn_val(xo[nt * 4 + 2 * h + 1], rr[h], gz.y);
            const float other = __shfl_xor_sync(0xffffffffu, lo ? v1 : v0, 2);
            const float wlo = lo ? v0 : other, whi = lo ? other : v1;
            if (tok < T) wr[4 * nt] = (unsigned)calla_f32_to_bf16(wlo) | ((unsigned)calla_f32_to_bf16(whi) << 16);
        }
    }
}

// The tag of chunk m's partials in launch `epoch` (gdnp_state_tf32wgcg): a slot of gx holds
// chunk m − 2 or m of its parity when a reader of chunk m looks, and every launch has its own
// epoch (from 1: the scratch starts zeroed; the 32-bit ticket counter repeats an epoch after
// 2^25 launches), so m's two low bits are enough.
__device__ __forceinline__ unsigned nrm_tag(unsigned epoch, int m) { return (epoch << 2) | ((unsigned)m & 3u); }

// The block's place in the grid: blockIdx.x, or with NRG its ticket (gdnp_state_tf32wgcg),
// taken after the PDL wait from the scratch's counter: ticket / grid + 1 is the launch's epoch
// (the same for all its blocks: the next launch's blocks pass their wait only after this one
// has completed; graph replays count too) and ticket % grid the block's place, so that the
// four blocks of a V head are the four that took consecutive tickets, all of them running:
// heads complete in ticket order whatever order the blocks start in, given four SMs. Epoch in
// words[0], place in words[1] (shared memory; a barrier inside).
template <bool NRG>
__device__ __forceinline__ unsigned state_place(unsigned* gctr, unsigned* words, int t) {
    if constexpr (NRG) {
        calla_pdl_wait();
        if (t == 0) {
            const unsigned tk = atomicAdd(gctr, 1u);
            words[0] = tk / gridDim.x + 1u;
            words[1] = tk % gridDim.x;
        }
        __syncthreads();
        return words[1];
    } else {
        return blockIdx.x;
    }
}

// D(64 x 16) += A(64 x 8, registers: each warp's 16 rows as the mma.sync m16n8k8 A fragment,
// TF32 bits) · B(8 x 16, smem)
__device__ __forceinline__ void wgmma_tf32_rs_n16(float (&d)[16], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
// The chunk's second pair of products on warpgroup MMAs (after the barrier that publishes V',
// e^{γ_C−γ}V' and P): every warpgroup S ← S + K̂ᵀ·(e^{γ_C−γ}V') on its slice of S (key rows
// 64·(wg & 1) .., columns 16·(wg >> 1) ..: the mma.sync form's tiles of warp w, m-tile w & 7,
// columns 16·(w >> 3)), K̂ᵀ's fragments loaded from the row-major K̂ as there; the odd
// warpgroups also xo ← xo + P·V' (chunk rows, the same columns), P's zeros above the diagonal
// multiplied too (exact zeros: the same sums). sr / xo: the accumulators (S already scaled by
// e^{γ_C}). Waits for its MMAs before returning.
// NRM (the fused norm, gdnp_state_tf32wgcn): while their MMAs run, the even warpgroups also
// turn the chunk's z in nz (copied by the odd warpgroups, nz_off layout) into the gates
// norm_w ⊙ SiLU(z) in place; nwv: this thread's norm_w value (nrm_gate_col).
template <bool NRM = false>
__device__ __forceinline__ void chunk_update_wg(float (&sr)[16], float (&xo)[16], const float* kc, const float* P, const float* vp,
                                                const float* vd, int t, float* nz = nullptr, float nwv = 0.f) {
    const int wg = t >> 7, warp = t >> 5, lane = t & 31, g = lane >> 2, q = lane & 3;
    const int n0 = 16 * (wg >> 1);
    // K̂ᵀ fragment of k-step s: a(r, k) = K̂[8s + k][16·(warp & 7) + r]
    const float* ka = kc + q * KCP + 16 * (warp & 7) + g;
    const unsigned bd = (unsigned)__cvta_generic_to_shared(vd + n0 * 32);
    // every fragment in registers before the fence (loaded inside the MMA loop instead, they
    // cost 48 bytes of spills against 16)
    unsigned a[CH / 8][4];
#pragma unroll
    for (int s = 0; s < CH / 8; ++s) {
        const float* k8 = ka + 8 * s * KCP;
        a[s][0] = __float_as_uint(k8[0]);
        a[s][1] = __float_as_uint(k8[8]);
        a[s][2] = __float_as_uint(k8[4 * KCP]);
        a[s][3] = __float_as_uint(k8[4 * KCP + 8]);
    }
    calla_wgmma_fence();  // before the branch: it orders every register the MMAs below read (sr, xo, a)
    // the warpgroup index broadcast from lane 0, so that the compiler sees a warp-uniform
    // branch (on `t >> 7` itself ptxas serializes every wgmma of the kernel, C7520)
    const int wgu = __shfl_sync(0xffffffffu, wg, 0);
    if (wgu & 1) {
        const unsigned pa = (unsigned)__cvta_generic_to_shared(P), bv = (unsigned)__cvta_generic_to_shared(vp + n0 * 32);
#pragma unroll
        for (int s = 0; s < CH / 8; ++s)
            wgmma_tf32_n16(xo, wg_desc(pa + (s >> 2) * (CH * 128) + (s & 3) * 32u), wg_desc(bv + (s >> 2) * (CW * 128) + (s & 3) * 32u));
    }
#pragma unroll
    for (int s = 0; s < CH / 8; ++s) wgmma_tf32_rs_n16(sr, a[s], wg_desc(bd + (s >> 2) * (CW * 128) + (s & 3) * 32u));
    calla_wgmma_commit();
    if constexpr (NRM) {
        if (!(wgu & 1)) {
            // element e + 256·i of the [CH][CW] chunk: row e/32 + 8i, so one column (and one
            // norm_w value) for all of this thread's elements
            float* zp = nz + nrm_even_index(t);
#pragma unroll
            for (int i = 0; i < CH * CW / 256; ++i) zp[256 * i] = gn_gate(zp[256 * i], nwv);
        }
    }
    calla_wgmma_wait<0>();
    fence_acc8(sr);
    fence_acc8(xo);
}

// Copies ROWS rows of 16 16-byte chunks (64 floats, row stride SS in the source) into a
// swizzled 64-row operand half (sw_off<64>) with NTH threads, as copy_rows does.
template <int NTH, int SS>
__device__ __forceinline__ void copy_rows_sw(float* dst, const float* src, int t) {
    constexpr int CHUNKS = 16, RPV = NTH / CHUNKS, NV2 = CH / RPV;
    static_assert(NTH % CHUNKS == 0 && CH % RPV == 0, "whole rows per pass");
    const int c = t % CHUNKS, r0 = t / CHUNKS;
#pragma unroll
    for (int v = 0; v < NV2; ++v) {
        const int r = r0 + v * RPV;
        cp16(dst + sw_off<CH>(r, 4 * c), src + r * SS + 4 * c);
    }
}

// Issues H(g) and commits it (an empty group past the last chunk); NTH threads.
// WG: the swizzled ring; WGC: the regions moved up by WG_SHIFT.
template <int NTH, bool WG = false, bool WGC = false>
__device__ __forceinline__ void issue_half(float* S, const StateArgs& a, int g, int t) {
    const int n = g >> 1, half = g & 1;
    if (n < a.NC) {
        const float* wsrc = a.w + ((size_t)a.j * a.Tpad + (size_t)n * CH) * DK + HK * half;
        const float* qsrc = a.qn + ((size_t)(a.j / VPK) * a.Tpad + (size_t)n * CH) * DK + HK * half;
        if constexpr (WG) {
            float* slot = S + SC_WQ + (g % 3) * WG_SLOT;
            copy_rows_sw<NTH, DK>(slot, wsrc, t);
            copy_rows_sw<NTH, DK>(slot + WG_MAT, qsrc, t);
        } else {
            float* slot = S + SC_WQ + (g % 3) * SC_SLOT;
            copy_rows<NTH, CH, HK / 4, DK, HP>(slot, wsrc, t);            // W rows 0..CH-1
            copy_rows<NTH, CH, HK / 4, DK, HP>(slot + CH * HP, qsrc, t);  // Q̂ rows CH..2CH-1
        }
        if (half == 1) {
            float* R = S + (WGC ? WG_SHIFT : 0);
            const int ub = n & 1;
            const float* usrc = a.vu + ((size_t)a.j * a.Tpad + (size_t)n * CH) * DV + a.c0;
            copy_rows<NTH, CH, CW / 4, DV, CWP>(R + SC_U + ub * CH * CWP, usrc, t);
            if (t < CH / 4) cp16(R + SC_GAM + ub * CH + 4 * t, a.gam + (size_t)a.j * a.Tpad + (size_t)n * CH + 4 * t);
        }
    }
    cp_commit();
}

// Issues KP(n) and commits it (empty past the last chunk); NTH threads.
// WGC: the regions moved up by WG_SHIFT, P swizzled for the wgmma P·V'.
template <int NTH, bool WGC = false>
__device__ __forceinline__ void issue_kp(float* S, const StateArgs& a, int n, int t) {
    if (n < a.NC) {
        float* R = S + (WGC ? WG_SHIFT : 0);
        copy_rows<NTH, CH, DK / 4, DK, KCP>(R + SC_KC, a.kn + ((size_t)(a.j / VPK) * a.Tpad + (size_t)n * CH) * DK, t);
        if constexpr (WGC) copy_rows_sw<NTH, CH>(R + SC_P, a.P + ((size_t)a.j * a.NC + n) * CH * CH, t);
        else copy_rows<NTH, CH, CH / 4, CH, PP>(R + SC_P, a.P + ((size_t)a.j * a.NC + n) * CH * CH, t);
    }
    cp_commit();
}

// X += slot[:, 0..HK) · S[k0 .. k0+HK, :]. TC: warp w computes the mma tiles of rows
// 16·(w%8).. and columns 16·(w/8)..+15 (acc[0..8)); S in shared memory is TF32-rounded.
// f32: rows 4·(t/8)..+3 x columns 4·(t%8)..+3 (acc[0..16)).
template <bool TC, bool PRE = true>
__device__ __forceinline__ void half_product(float (&acc)[16], const float* slot, const float* Ssl, int half, int t) {
    if constexpr (TC) {
        // S n-major (SKP): key rows HK·half .. of columns 16·(warp/8) ..
        float(&a2)[2][4] = *reinterpret_cast<float(*)[2][4]>(acc);
        const int warp = t >> 5;
        const float* a = slot + 16 * (warp & 7) * HP;
        const float* b = Ssl + 16 * (warp >> 3) * SKP + HK * half;
        if constexpr (PRE)
            warp_mma_k<HK / 8, 2, HP, 1, 1, SKP, true, true, true, true>(a2, a, b);
        else
            warp_mma<2, HP, 1, 1, SKP, true, false, true, true>(a2, a, b, HK / 8);
    } else {
        const float* Srows = Ssl + HK * CWP * half;
        const int rg = t >> 3, cg = t & 7;
        const float* A = slot + 4 * rg * HP;
#pragma unroll 2
        for (int k = 0; k < HK; k += 4) {
            float4 a[4], b[4];
#pragma unroll
            for (int ii = 0; ii < 4; ++ii) a[ii] = *reinterpret_cast<const float4*>(A + ii * HP + k);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) b[kk] = *reinterpret_cast<const float4*>(Srows + (k + kk) * CWP + 4 * cg);
#pragma unroll
            for (int ii = 0; ii < 4; ++ii)
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    const float av = comp(a[ii], kk);
                    acc[ii * 4 + 0] = fmaf(av, b[kk].x, acc[ii * 4 + 0]);
                    acc[ii * 4 + 1] = fmaf(av, b[kk].y, acc[ii * 4 + 1]);
                    acc[ii * 4 + 2] = fmaf(av, b[kk].z, acc[ii * 4 + 2]);
                    acc[ii * 4 + 3] = fmaf(av, b[kk].w, acc[ii * 4 + 3]);
                }
        }
    }
}

// WG (TC only): X = [W; Q̂]·S by warpgroup MMAs (half_product_wg) on the swizzled ring and S;
// WGC (with WG): also S ← S + K̂ᵀV'd and O += P·V' by warpgroup MMAs (chunk_update_wg) on
// swizzled P, V', V'd, the regions moved up by WG_SHIFT. The rest as the mma.sync form.
// NRM (with WGC; a cluster of the SPLIT blocks of a V head): the gated norm too ("the gated
// norm inside the state kernel" above): no `out`, the bf16 activations into xb instead, from
// z in proj and norm_w.
// NRG (with NRM; gdnp_state_tf32wgcg): no cluster; the partials go through gx (global memory,
// [n_v][2 (chunk parity)][SPLIT][CH] 8-byte words, value and tag), and a block's V head and
// column quarter come from a ticket (state_place), so that the four blocks that wait on each
// other are running together.
template <bool TC, bool PRE = true, bool WG = false, bool WGC = false, bool NRM = false, bool NRG = false>
__device__ __forceinline__ void state_body(float* __restrict__ out, float* __restrict__ s_state,
                                           const float* __restrict__ qn, const float* __restrict__ kn,
                                           const float* __restrict__ vu, const float* __restrict__ w,
                                           const float* __restrict__ P, const float* __restrict__ gam, int T, int Tpad,
                                           int NC, unsigned* __restrict__ xb = nullptr, const float* __restrict__ proj = nullptr,
                                           const float* __restrict__ norm_w = nullptr, unsigned long long* __restrict__ gx = nullptr,
                                           unsigned* __restrict__ gctr = nullptr) {
    constexpr int NTH = sc_threads<TC>(), NS = sc_ns<TC>();
    static_assert(!WG || (TC && PRE), "the wgmma form reads TF32-rounded operands");
    static_assert(!WGC || WG, "the wgmma chunk update needs the wgmma layout");
    static_assert(!NRM || WGC, "the fused norm runs in the wgmma chunk-update form");
    static_assert(!NRG || NRM, "the global exchange is a form of the fused norm");
    extern __shared__ __align__(1024) float4 smem4[];
    // WG: the swizzled operands need 1024-byte alignment (the host adds 1 KiB of slack)
    // (an offset added to the shared pointer, not a pointer rebuilt from an integer: the compiler
    // then still knows S is shared memory and emits LDS / STS, not generic LD / ST, and no
    // address-space conversion before each ldmatrix, cp.async or wgmma descriptor. From the
    // __align__(1024) declaration the compiler folds the offset to 0 and ptxas places the buffer
    // on a 1 KiB boundary; the check below traps if a toolchain ever does not.)
    float* S = reinterpret_cast<float*>(smem4);
    if constexpr (WG) S += ((1024u - ((unsigned)__cvta_generic_to_shared(smem4) & 1023u)) & 1023u) / 4;
    float* const R = S + (WGC ? WG_SHIFT : 0);  // every region but the ring
    float* const SO = S + SC_S + WG_SHIFT;      // WG: the swizzled S, 1024-byte aligned either way
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31, g = lane >> 2, q = lane & 3;
    const int mt = warp & 7, cn = 16 * (warp >> 3);  // TC: m-tile and first column of the warp
    // NRM: the chunk's z, then its gates [CH][CW] (nz_off), and the partial-sum slots
    // [2 (chunk parity)][SPLIT (sender)][CH] in the SC_OB region (unused by the TF32 forms);
    // warpgroup 3's partials [CH] and the two mbarriers (NRG: the epoch and the place) past
    // SC_FLOATS
    float* const NZ = R + SC_OB;
    float* const NSL = NZ + CH * CW;
    float* const NLX = R + SC_FLOATS;
    unsigned long long* const NMB = reinterpret_cast<unsigned long long*>(R + SC_FLOATS + CH);
    const unsigned place = state_place<NRG>(gctr, reinterpret_cast<unsigned*>(NMB), t);  // (unsigned: the divisions as before)
    const int j = place / SPLIT, rank = place % SPLIT, c0 = rank * CW;
    if (t == 0 && dynamic_smem_bytes() < (SC_FLOATS + (WGC ? WG_SHIFT : 0) + (NRM ? NRM_EXTRA : 0)) * 4u + (WG ? 1024u : 0u))
        __trap();
    if constexpr (WG) {
        // the swizzled operands' real shared address (asm: not folded from the declaration)
        unsigned long long sa;
        asm volatile("cvta.to.shared.u64 %0, %1;" : "=l"(sa) : "l"(S));
        if (t == 0 && (sa & 1023u) != 0) __trap();
    }
    const StateArgs a{qn, kn, vu, w, P, gam, j, c0, Tpad, NC};
    const bool odd = (warp >> 2) & 1;  // NRM: a warp of warpgroup 1 or 3, which hold O
    float nwv = 0.f;                   // NRM, even warpgroups: norm_w of their gate column
    if constexpr (NRM && !NRG) {
        if (t == 0) {
            if (calla_cluster_ctarank() != (unsigned)rank) __trap();  // the partials' slots are by rank
            calla_mbar_init_expect(&NMB[0], NRM_TX);
            calla_mbar_init_expect(&NMB[1], NRM_TX);
        }
        calla_cluster_arrive_relaxed();  // waited before the first st.async
    }
    if constexpr (NRM)
        if (!odd) nwv = norm_w[c0 + nrm_gate_col(t)];

    if constexpr (!NRG) calla_pdl_wait();  // (NRG: waited in state_place)

    float* sg = s_state + (size_t)j * DK * DV + c0;
    for (int e = t; e < DK * CW / 4; e += NTH) {
        const int r = e >> 3, c4 = e & 7;
        *reinterpret_cast<float4*>(R + SC_S + r * CWP + 4 * c4) = *reinterpret_cast<const float4*>(sg + (size_t)r * DV + 4 * c4);
    }
    issue_half<NTH, WG, WGC>(S, a, 0, t);
    issue_half<NTH, WG, WGC>(S, a, 1, t);
    issue_half<NTH, WG, WGC>(S, a, 2, t);
    if constexpr (NRM)
        if (odd) nrm_copy_z(NZ, proj, j, c0, 0, T, t);  // with KP(0)
    issue_kp<NTH, WGC>(S, a, 0, t);
    cp_wait<3>();  // H(0)
    if constexpr (WG) calla_fence_proxy_async();
    __syncthreads();
    float sr[16];  // this thread's share of S (s_pos), sr[0..NS)
#pragma unroll
    for (int e = 0; e < NS; ++e) {
        int r, c;
        s_pos<TC>(e, t, r, c);
        sr[e] = R[SC_S + r * CWP + c];
    }
    if constexpr (TC) {
        // the shared copy of S is only an mma operand: keep it TF32-rounded
        __syncthreads();
#pragma unroll
        for (int e = 0; e < NS; ++e) {
            int r, c;
            s_pos<TC>(e, t, r, c);
            if constexpr (WG) SO[sw_off<CW>(c, r)] = round_tf32(sr[e]);
            else S[SC_S + c * SKP + r] = round_tf32(sr[e]);  // n-major (the other threads' reads are done)
        }
        if constexpr (WG) calla_fence_proxy_async();
        __syncthreads();
    }
    float xo[16];  // TC, m-tiles 4-7: O rows 16(mt-4).. as mma accumulators (xo[0..8))
    float s3[2];   // NRM, odd warpgroups: Σo² partials of the thread's two rows (nrm_partials)
    if constexpr (NRM && !NRG) calla_cluster_wait();  // every block of the cluster started, its mbarriers set

    for (int n = 0; n < NC; ++n) {
        // ---- X = [W; Q̂] · S: rows 0..63 give V' = U − W S, rows 64..127 give e^γ Q̂ S.
        float acc[16];
#pragma unroll
        for (int e = 0; e < 16; ++e) acc[e] = 0.f;  // TC uses acc[0..8)
        if constexpr (WG) half_product_wg(acc, S + SC_WQ + ((2 * n) % 3) * WG_SLOT, SO, 0, t);
        else half_product<TC, PRE>(acc, S + SC_WQ + ((2 * n) % 3) * SC_SLOT, S + SC_S, 0, t);
        if constexpr (NRM)  // the odd warpgroups: chunk n − 1's activations (its partials came
            if (n > 0 && odd)  // during its last phase)
                nrm_emit<NRG>(xo, NZ, NSL, NMB, xb, j, rank, n - 1, T, t, gx,
                              NRG ? nrm_tag(*reinterpret_cast<const unsigned*>(NMB), n - 1) : 0u);
        cp_wait<2>();  // H(2n+1)
        if constexpr (WG) calla_fence_proxy_async();
        __syncthreads();
        // NRM: the odd warpgroups' z of chunk n into the elements whose gates they read above
        // (the barrier orders those reads before these copies), as a commit group of its own
        // before H(2n+3): the wait before the chunk update, which leaves H(2n+3) pending, covers it
        if constexpr (NRM)
            if (n > 0 && odd) {
                nrm_copy_z(NZ, proj, j, c0, n, T, t);
                cp_commit();
            }
        issue_half<NTH, WG, WGC>(S, a, 2 * n + 3, t);  // into the slot just read
        if constexpr (WG) half_product_wg(acc, S + SC_WQ + ((2 * n + 1) % 3) * WG_SLOT, SO, 1, t);
        else half_product<TC, PRE>(acc, S + SC_WQ + ((2 * n + 1) % 3) * SC_SLOT, S + SC_S, 1, t);

        const float* U = R + SC_U + (n & 1) * CH * CWP;
        const float* GM = R + SC_GAM + (n & 1) * CH;
        const float gC = GM[CH - 1];
        if constexpr (TC) {
            // V' and e^{γ_C−γ}V' are only mma operands: stored TF32-rounded.
            if (mt < 4) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = 16 * mt + g + 8 * h;
                    const float d = expf(gC - GM[r]);
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) {
                        const int c = cn + 8 * nt + 2 * q;
                        const float2 u = *reinterpret_cast<const float2*>(U + r * CWP + c);
                        const float p0 = u.x - acc[nt * 4 + 2 * h], p1 = u.y - acc[nt * 4 + 2 * h + 1];
                        if constexpr (WGC) {  // swizzled K-major B operands
                            R[SC_VP + sw_off<CW>(c, r)] = round_tf32(p0);
                            R[SC_VP + sw_off<CW>(c + 1, r)] = round_tf32(p1);
                            R[SC_VD + sw_off<CW>(c, r)] = round_tf32(p0 * d);
                            R[SC_VD + sw_off<CW>(c + 1, r)] = round_tf32(p1 * d);
                        } else {
                            R[SC_VP + c * VKP + r] = round_tf32(p0);  // n-major
                            R[SC_VP + (c + 1) * VKP + r] = round_tf32(p1);
                            R[SC_VD + c * VKP + r] = round_tf32(p0 * d);
                            R[SC_VD + (c + 1) * VKP + r] = round_tf32(p1 * d);
                        }
                    }
                }
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = 16 * (mt - 4) + g + 8 * h;
                    const float eg = expf(GM[r]);
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) {
                        xo[nt * 4 + 2 * h] = acc[nt * 4 + 2 * h] * eg;
                        xo[nt * 4 + 2 * h + 1] = acc[nt * 4 + 2 * h + 1] * eg;
                    }
                }
            }
        } else {
            const int rg = t >> 3, cg = t & 7;
            if (warp < 4) {
#pragma unroll
                for (int ii = 0; ii < 4; ++ii) {
                    const int r = 4 * rg + ii;
                    const float d = expf(gC - GM[r]);
                    const float4 u = *reinterpret_cast<const float4*>(U + r * CWP + 4 * cg);
                    const float4 pv = make_float4(u.x - acc[ii * 4 + 0], u.y - acc[ii * 4 + 1], u.z - acc[ii * 4 + 2],
                                                  u.w - acc[ii * 4 + 3]);
                    *reinterpret_cast<float4*>(S + SC_VP + r * CWP + 4 * cg) = pv;
                    *reinterpret_cast<float4*>(S + SC_VD + r * CWP + 4 * cg) =
                        make_float4(pv.x * d, pv.y * d, pv.z * d, pv.w * d);
                }
            } else {
#pragma unroll
                for (int ii = 0; ii < 4; ++ii) {
                    const int r = 4 * rg + ii - CH;
                    const float eg = expf(GM[r]);
                    *reinterpret_cast<float4*>(S + SC_OB + r * CWP + 4 * cg) =
                        make_float4(acc[ii * 4 + 0] * eg, acc[ii * 4 + 1] * eg, acc[ii * 4 + 2] * eg, acc[ii * 4 + 3] * eg);
                }
            }
        }
        cp_wait<1>();  // KP(n) (and H(2n+2))
        if constexpr (WG) calla_fence_proxy_async();
        __syncthreads();
        issue_half<NTH, WG, WGC>(S, a, 2 * n + 4, t);  // into the slot of H(2n+1)

        // ---- S ← e^{γ_C} S + K̂ᵀ V'd;  O = e^γ Q̂ S + P V'
        const float eC = expf(gC);
#pragma unroll
        for (int e = 0; e < NS; ++e) sr[e] *= eC;
        if constexpr (TC) {
            float(&o2)[2][4] = *reinterpret_cast<float(*)[2][4]>(xo);
            const int om = mt - 4;
            if constexpr (WGC) {
                chunk_update_wg<NRM>(sr, xo, R + SC_KC, R + SC_P, R + SC_VP, R + SC_VD, t, NZ, nwv);
            } else {
                float(&s2)[2][4] = *reinterpret_cast<float(*)[2][4]>(sr);
                if constexpr (PRE)
                    warp_mma_k<CH / 8, 2, 1, KCP, 1, VKP, true, true, false, true>(s2, R + SC_KC + 16 * mt, R + SC_VD + cn * VKP);
                else
                    warp_mma<2, 1, KCP, 1, VKP, true, false, false, true>(s2, R + SC_KC + 16 * mt, R + SC_VD + cn * VKP, CH / 8);
                if (mt >= 4) {
                    // P's causal rows: 2·om + 2 k-steps, compile-time per (warp-uniform) om
                    const float* pa = R + SC_P + 16 * om * PP;
                    const float* vb = R + SC_VP + cn * VKP;
                    switch (om) {
                        case 0: warp_mma_k<2, 2, PP, 1, 1, VKP, true, PRE, true, true>(o2, pa, vb); break;
                        case 1: warp_mma_k<4, 2, PP, 1, 1, VKP, true, PRE, true, true>(o2, pa, vb); break;
                        case 2: warp_mma_k<6, 2, PP, 1, 1, VKP, true, PRE, true, true>(o2, pa, vb); break;
                        default: warp_mma_k<8, 2, PP, 1, 1, VKP, true, PRE, true, true>(o2, pa, vb); break;
                    }
                }
            }
            if constexpr (NRM) {
                if (odd) {
                    nrm_partials(s3, xo);
                    // warpgroup 3's partials for warpgroup 1 (read after the barrier below)
                    if ((warp >> 3) && q == 0) *reinterpret_cast<float2*>(NLX + 16 * om + 2 * g) = make_float2(s3[0], s3[1]);
                }
            } else if (mt >= 4) {
                static_assert(CH / 16 == 4, "four 16-row blocks of O");
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = 16 * om + g + 8 * h, tok = n * CH + r;
                    if (tok < T) {
                        float* o = out + (size_t)tok * (NV * DV) + j * DV + c0 + cn;
#pragma unroll
                        for (int nt = 0; nt < 2; ++nt)
                            *reinterpret_cast<float2*>(o + 8 * nt + 2 * q) = make_float2(o2[nt][2 * h], o2[nt][2 * h + 1]);
                    }
                }
            }
        } else {
            const int kg = t >> 3, cg = t & 7;
#pragma unroll 4
            for (int r = 0; r < CH; ++r) {
                const float4 ka = *reinterpret_cast<const float4*>(S + SC_KC + r * KCP + 4 * kg);
                const float4 b = *reinterpret_cast<const float4*>(S + SC_VD + r * CWP + 4 * cg);
#pragma unroll
                for (int ii = 0; ii < 4; ++ii) {
                    const float av = comp(ka, ii);
                    sr[ii * 4 + 0] = fmaf(av, b.x, sr[ii * 4 + 0]);
                    sr[ii * 4 + 1] = fmaf(av, b.y, sr[ii * 4 + 1]);
                    sr[ii * 4 + 2] = fmaf(av, b.z, sr[ii * 4 + 2]);
                    sr[ii * 4 + 3] = fmaf(av, b.w, sr[ii * 4 + 3]);
                }
            }
            // O rows 2·(t/8), +1; columns 4·(t%8)..+3; s up to the warp's last row
            const int r0 = 2 * (t >> 3), send = 8 * warp + 8;
            float o[2][4];
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float4 ob = *reinterpret_cast<const float4*>(S + SC_OB + (r0 + rr) * CWP + 4 * cg);
                o[rr][0] = ob.x;
                o[rr][1] = ob.y;
                o[rr][2] = ob.z;
                o[rr][3] = ob.w;
            }
#pragma unroll 2
            for (int s = 0; s < send; s += 4) {
                float4 p[2], v[4];
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) p[rr] = *reinterpret_cast<const float4*>(S + SC_P + (r0 + rr) * PP + s);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) v[kk] = *reinterpret_cast<const float4*>(S + SC_VP + (s + kk) * CWP + 4 * cg);
#pragma unroll
                for (int rr = 0; rr < 2; ++rr)
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) {
                        const float pv = comp(p[rr], kk);
                        o[rr][0] = fmaf(pv, v[kk].x, o[rr][0]);
                        o[rr][1] = fmaf(pv, v[kk].y, o[rr][1]);
                        o[rr][2] = fmaf(pv, v[kk].z, o[rr][2]);
                        o[rr][3] = fmaf(pv, v[kk].w, o[rr][3]);
                    }
            }
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const int tok = n * CH + r0 + rr;
                if (tok < T)
                    *reinterpret_cast<float4*>(out + (size_t)tok * (NV * DV) + j * DV + c0 + 4 * cg) =
                        make_float4(o[rr][0], o[rr][1], o[rr][2], o[rr][3]);
            }
        }
        // S slice → shared memory for the next chunk's products (this chunk's reads of it
        // finished before the previous barrier); TF32-rounded for the mma variant.
#pragma unroll
        for (int e = 0; e < NS; ++e) {
            int r, c;
            s_pos<TC>(e, t, r, c);
            if constexpr (WG) SO[sw_off<CW>(c, r)] = round_tf32(sr[e]);
            else if constexpr (TC) S[SC_S + c * SKP + r] = round_tf32(sr[e]);  // n-major
            else S[SC_S + r * CWP + c] = sr[e];
        }
        if constexpr (WG) calla_fence_proxy_async();
        __syncthreads();
        if constexpr (NRM) {
            // warpgroup 1: the block's partials (its 16 columns + warpgroup 3's) to slot [rank]
            // of every block of the cluster (index 16·om + 2g + h holds row 16·om + g + 8h)
            if (odd && !(warp >> 3) && q == 0) {
                const int r0 = 16 * (mt - 4) + 2 * g;
                const float2 lx = *reinterpret_cast<const float2*>(NLX + r0);
                const uint2 v = make_uint2(__float_as_uint(__fadd_rn(s3[0], lx.x)), __float_as_uint(__fadd_rn(s3[1], lx.y)));
                if constexpr (NRG) {
                    const unsigned long long tg = (unsigned long long)nrm_tag(*reinterpret_cast<const unsigned*>(NMB), n) << 32;
                    unsigned long long* dst = gx + (size_t)(j * 2 + (n & 1)) * (SPLIT * CH) + rank * CH + r0;
                    asm volatile("st.relaxed.gpu.global.v2.b64 [%0], {%1, %2};" ::"l"(dst), "l"(tg | v.x), "l"(tg | v.y) : "memory");
                } else {
                    float* dst = NSL + (n & 1) * (SPLIT * CH) + rank * CH + r0;
#pragma unroll
                    for (int b = 0; b < SPLIT; ++b) calla_st_async_u2(dst, &NMB[n & 1], (unsigned)b, v);
                }
            }
        }
        issue_kp<NTH, WGC>(S, a, n + 1, t);  // K̂ / P buffers are free now
    }
    if constexpr (NRM)
        if (odd)  // the last chunk's activations
            nrm_emit<NRG>(xo, NZ, NSL, NMB, xb, j, rank, NC - 1, T, t, gx,
                          NRG ? nrm_tag(*reinterpret_cast<const unsigned*>(NMB), NC - 1) : 0u);
    cp_wait<0>();
#pragma unroll
    for (int e = 0; e < NS; ++e) {
        int r, c;
        s_pos<TC>(e, t, r, c);
        sg[(size_t)r * DV + c] = sr[e];
    }
}

}  // namespace calla_gdnp

extern "C" __global__ void __launch_bounds__(256, 1)
gdnp_state_f32(float* __restrict__ out, float* __restrict__ s_state, const float* __restrict__ qn,
               const float* __restrict__ kn, const float* __restrict__ vu, const float* __restrict__ w,
               const float* __restrict__ P, const float* __restrict__ gam, int T, int Tpad, int NC) {
    calla_gdnp::state_body<false>(out, s_state, qn, kn, vu, w, P, gam, T, Tpad, NC);
}

extern "C" __global__ void __launch_bounds__(512, 1)
gdnp_state_tf32(float* __restrict__ out, float* __restrict__ s_state, const float* __restrict__ qn,
                const float* __restrict__ kn, const float* __restrict__ vu, const float* __restrict__ w,
                const float* __restrict__ P, const float* __restrict__ gam, int T, int Tpad, int NC) {
    calla_gdnp::state_body<true>(out, s_state, qn, kn, vu, w, P, gam, T, Tpad, NC);
}

// The same with X = [W; Q̂]·S on warpgroup MMAs (GdnPrefillMath::Tf32Wg; dynamic shared memory
// SC_FLOATS floats + 1 KiB of alignment slack), and with all four products on them
// (GdnPrefillMath::Tf32WgC; (SC_FLOATS + WG_SHIFT) floats + 1 KiB).
extern "C" __global__ void __launch_bounds__(512, 1)
gdnp_state_tf32wg(float* __restrict__ out, float* __restrict__ s_state, const float* __restrict__ qn,
                   const float* __restrict__ kn, const float* __restrict__ vu, const float* __restrict__ w,
                   const float* __restrict__ P, const float* __restrict__ gam, int T, int Tpad, int NC) {
    calla_gdnp::state_body<true, true, true, false>(out, s_state, qn, kn, vu, w, P, gam, T, Tpad, NC);
}
extern "C" __global__ void __launch_bounds__(512, 1)
gdnp_state_tf32wgc(float* __restrict__ out, float* __restrict__ s_state, const float* __restrict__ qn,
                  const float* __restrict__ kn, const float* __restrict__ vu, const float* __restrict__ w,
                  const float* __restrict__ P, const float* __restrict__ gam, int T, int Tpad, int NC) {
    calla_gdnp::state_body<true, true, true, true>(out, s_state, qn, kn, vu, w, P, gam, T, Tpad, NC);
}
// gdnp_state_tf32wgc with the gated norm inside (clusters of the SPLIT blocks of a V head):
// writes out_proj's bf16 activations xb [T, n_v·d_v / 2] words as gdnp_norm_acts does, bit for
// bit, and no O (GdnPrefillScratch::set_fused_norm; dynamic shared memory (SC_FLOATS +
// WG_SHIFT + NRM_EXTRA) floats + 1 KiB).
extern "C" __global__ void __cluster_dims__(calla_gdnp::SPLIT, 1, 1) __launch_bounds__(512, 1)
gdnp_state_tf32wgcn(unsigned* __restrict__ xb, float* __restrict__ s_state, const float* __restrict__ qn,
                    const float* __restrict__ kn, const float* __restrict__ vu, const float* __restrict__ w,
                    const float* __restrict__ P, const float* __restrict__ gam, const float* __restrict__ proj,
                    const float* __restrict__ norm_w, int T, int Tpad, int NC) {
    calla_gdnp::state_body<true, true, true, true, true>(nullptr, s_state, qn, kn, vu, w, P, gam, T, Tpad, NC, xb, proj, norm_w);
}
// The same without a cluster: the partials through global memory (gx, tagged words; gctr the
// launch counter; GdnPrefillScratch::set_fused_norm_global), for GPUs that hold fewer than n_v
// of gdnp_state_tf32wgcn's clusters at once.
extern "C" __global__ void __launch_bounds__(512, 1)
gdnp_state_tf32wgcg(unsigned* __restrict__ xb, float* __restrict__ s_state, const float* __restrict__ qn,
                    const float* __restrict__ kn, const float* __restrict__ vu, const float* __restrict__ w,
                    const float* __restrict__ P, const float* __restrict__ gam, const float* __restrict__ proj,
                    const float* __restrict__ norm_w, unsigned long long* __restrict__ gx, unsigned* __restrict__ gctr, int T,
                    int Tpad, int NC) {
    calla_gdnp::state_body<true, true, true, true, true, true>(nullptr, s_state, qn, kn, vu, w, P, gam, T, Tpad, NC, xb, proj, norm_w,
                                                               gx, gctr);
}

// =====================================================================================
// gdnp_norm: gated RMSNorm in place, one warp per (token, V head), 256 threads per block:
// out = norm_w ⊙ (o / sqrt(mean(o²) + eps)) ⊙ SiLU(z), with norm_w used as stored (no +1).
// =====================================================================================
namespace calla_gdnp {
// The gated norm of one (token, V head) row: lane holds its 4 columns o, z and weights nw.
// (column pairs 2·lane and 2·lane + 1: level 0 of the tree in the lane, levels 1-5 across the
// lanes by XOR 1, 2, 4, 8, 16, in that order; "the gated RMSNorm's arithmetic" above)
__device__ __forceinline__ float4 gated_norm4(float4 o, float4 z, float4 nw) {
    float ss = __fadd_rn(gn_pair_sq(o.x, o.y), gn_pair_sq(o.z, o.w));
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, m));
    const float r = gn_rinv(ss);
    o.x = gn_val(o.x, r, gn_gate(z.x, nw.x));
    o.y = gn_val(o.y, r, gn_gate(z.y, nw.y));
    o.z = gn_val(o.z, r, gn_gate(z.z, nw.z));
    o.w = gn_val(o.w, r, gn_gate(z.w, nw.w));
    return o;
}
}  // namespace calla_gdnp

extern "C" __global__ void __launch_bounds__(256)
gdnp_norm(float* __restrict__ out, const float* __restrict__ proj, const float* __restrict__ norm_w, int T) {
    using namespace calla_gdnp;
    const int lane = threadIdx.x & 31;
    const int wg = blockIdx.x * 8 + (threadIdx.x >> 5);
    const float4 nw = reinterpret_cast<const float4*>(norm_w)[lane];

    calla_pdl_wait();

    if (wg >= T * NV) return;
    const int tok = wg / NV, j = wg % NV;
    float4* op = reinterpret_cast<float4*>(out + (size_t)tok * (NV * DV) + j * DV) + lane;
    const float4 z = reinterpret_cast<const float4*>(proj + (size_t)tok * PROJ + Z_OFF + j * DV)[lane];
    *op = gated_norm4(*op, z, nw);
}

// gdnp_norm_acts: the same gated RMSNorm, written only as the out_proj GEMM's bf16 activations
// xb [T, NV·DV/2] words in gemm.cu's permuted order (bit for bit gdnp_norm followed by
// qgemm_x_to_bf16); `o` (the state kernel's output) is only read. Lane l holds columns 4l..4l+3
// of head j = 64·tile + 16c + 8h + 4p + s (tile = 2j + l/16, c = (l%16)/4, h = (l/2)%2, p = l%2);
// word 8s + 4h + c of the tile holds columns (16c + 8h + s, +4), i.e. value s of the lane with
// p = 0 and value s of its neighbour: lanes p = 0 / 1 write words s = 0, 1 / 2, 3.
extern "C" __global__ void __launch_bounds__(256)
gdnp_norm_acts(unsigned* __restrict__ xb, const float* __restrict__ o_in, const float* __restrict__ proj,
               const float* __restrict__ norm_w, int T) {
    using namespace calla_gdnp;
    const int lane = threadIdx.x & 31;
    const int wg = blockIdx.x * 8 + (threadIdx.x >> 5);
    const float4 nw = reinterpret_cast<const float4*>(norm_w)[lane];

    calla_pdl_wait();

    if (wg >= T * NV) return;
    const int tok = wg / NV, j = wg % NV;
    const float4 z = reinterpret_cast<const float4*>(proj + (size_t)tok * PROJ + Z_OFF + j * DV)[lane];
    const float4 o = gated_norm4(reinterpret_cast<const float4*>(o_in + (size_t)tok * (NV * DV) + j * DV)[lane], z, nw);
    const int pp = lane & 1;
    // p = 0 sends values 2, 3 (its neighbour's words); p = 1 sends values 0, 1
    const float s0 = pp ? o.x : o.z, s1 = pp ? o.y : o.w;
    const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
    const float lo0 = pp ? r0 : o.x, hi0 = pp ? o.z : r0;  // word s = 2p
    const float lo1 = pp ? r1 : o.y, hi1 = pp ? o.w : r1;  // word s = 2p + 1
    const int tile = 2 * j + (lane >> 4), c = (lane & 15) >> 2, h = (lane >> 1) & 1;
    unsigned* wr = xb + (size_t)tok * (NV * DV / 2) + 32 * tile + 8 * (2 * pp) + 4 * h + c;
    wr[0] = (unsigned)calla_f32_to_bf16(lo0) | ((unsigned)calla_f32_to_bf16(hi0) << 16);
    wr[8] = (unsigned)calla_f32_to_bf16(lo1) | ((unsigned)calla_f32_to_bf16(hi1) << 16);
}

// The TF32 path as before session 24, every tensor-core operand rounded on load (PRE = false):
// the measured twin of gdnp_prep_tf32 / gdnp_state_tf32 (GdnPrefillMath::Tf32Old).
CALLA_GDNP_PREP_ENTRY(gdnp_prep_tf32old, true, false, false, false)
extern "C" __global__ void __launch_bounds__(512, 1)
gdnp_state_tf32old(float* __restrict__ out, float* __restrict__ s_state, const float* __restrict__ qn,
                const float* __restrict__ kn, const float* __restrict__ vu, const float* __restrict__ w,
                const float* __restrict__ P, const float* __restrict__ gam, int T, int Tpad, int NC) {
    calla_gdnp::state_body<true, false>(out, s_state, qn, kn, vu, w, P, gam, T, Tpad, NC);
}
