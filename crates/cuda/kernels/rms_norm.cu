// Zero-centred RMSNorm (Qwen3-Next / Qwen3.5 style): y = x / sqrt(mean(x^2) + eps) * (1 + w).
// One block of D/8 threads per row; each thread owns 8 consecutive elements (two float4).
// x, y: f32 [n_rows, D]; w: f32 [D]. Dims from the generated header.
// rms_norm_acts_d_model also (or only) writes the normed row as the prefill GEMMs' bf16
// activations (the permuted order of gemm.cu's qgemm_x_to_bf16, same rounding), so a GEMM after
// the norm needs no conversion pass of its own.

#ifndef CALLA_D_MODEL
#error "dims header missing"
#endif

namespace calla_norm {

// The norm of one row whose elements 8t .. 8t+7 thread t holds as a, b; wa, wb the matching
// weights. y may be null when xb is not (acts only); xb null: the plain norm.
template <int D>
__device__ __forceinline__ void rms_norm_tail(float* __restrict__ y, float4 a, float4 b, float4 wa, float4 wb,
                                              float eps, unsigned* __restrict__ xb) {
    constexpr int THREADS = D / 8;
    constexpr int WARPS = THREADS / 32;
    static_assert(D % 256 == 0, "D must be a multiple of 256");
    __shared__ float partial[WARPS];
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    float ss = a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((t & 31) == 0) partial[t >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) tot += partial[i];
    const float inv = rsqrtf(tot / float(D) + eps);
    calla_pdl_launch_dependents();
    const float4 ya = make_float4(a.x * inv * (1.f + wa.x), a.y * inv * (1.f + wa.y), a.z * inv * (1.f + wa.z), a.w * inv * (1.f + wa.w));
    const float4 yb = make_float4(b.x * inv * (1.f + wb.x), b.y * inv * (1.f + wb.y), b.z * inv * (1.f + wb.z), b.w * inv * (1.f + wb.w));
    if (y != nullptr) {
        float4* yr = reinterpret_cast<float4*>(y + (size_t)row * D) + 2 * t;
        yr[0] = ya;
        yr[1] = yb;
    }
    if (xb != nullptr) {
        // Columns 8t .. 8t+7 = 64·tile + 16c + 8h + s (s = 0..7, t % 8 = 2c + h). Word
        // m = 8s + 4h + c (s < 4) of the tile holds columns (16c + 8h + s, +4): gemm.cu's order.
        const int tile = t >> 3, c = (t & 7) >> 1, h = t & 1;
        unsigned* wr = xb + (size_t)row * (D / 2) + 32 * tile + 4 * h + c;
        wr[0] = (unsigned)calla_f32_to_bf16(ya.x) | ((unsigned)calla_f32_to_bf16(yb.x) << 16);
        wr[8] = (unsigned)calla_f32_to_bf16(ya.y) | ((unsigned)calla_f32_to_bf16(yb.y) << 16);
        wr[16] = (unsigned)calla_f32_to_bf16(ya.z) | ((unsigned)calla_f32_to_bf16(yb.z) << 16);
        wr[24] = (unsigned)calla_f32_to_bf16(ya.w) | ((unsigned)calla_f32_to_bf16(yb.w) << 16);
    }
}

template <int D>
__device__ __forceinline__ void rms_norm_body(float* __restrict__ y, const float* __restrict__ x,
                                              const float* __restrict__ w, float eps,
                                              unsigned* __restrict__ xb = nullptr) {
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    const float4* wr = reinterpret_cast<const float4*>(w) + 2 * t;
    const float4 wa = wr[0], wb = wr[1];  // weights: safe to read before the wait
    calla_pdl_wait();
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)row * D) + 2 * t;
    rms_norm_tail<D>(y, xr[0], xr[1], wa, wb, eps, xb);
}

}  // namespace calla_norm

// Residual-stream norm (input_layernorm, post_attention_layernorm, final norm): D = D_MODEL.
extern "C" __global__ void __launch_bounds__(CALLA_D_MODEL / 8)
rms_norm_d_model(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w, float eps) {
    calla_norm::rms_norm_body<CALLA_D_MODEL>(y, x, w, eps);
}

// The same norm, the result also (y not null) or only (y null) as bf16 GEMM activations
// xb [n_rows, D/2] words in gemm.cu's permuted order: bit for bit rms_norm_d_model followed by
// qgemm_x_to_bf16.
extern "C" __global__ void __launch_bounds__(CALLA_D_MODEL / 8)
rms_norm_acts_d_model(float* __restrict__ y, unsigned* __restrict__ xb, const float* __restrict__ x,
                      const float* __restrict__ w, float eps) {
    calla_norm::rms_norm_body<CALLA_D_MODEL>(y, x, w, eps, xb);
}

// The prefill's MoE combine (calla_moe_combine4, as gemm.cu's qgemm_moe_combine)
// fused with the next layer's input norm: per token (one block of D_MODEL/8 threads, thread t
// owns elements 8t .. 8t+7)
//   out = resid + (Σ_slot w[tok, slot]·slot_out[tok·k + slot] + shared_w[tok]·shared[tok])
// stored as f32 (the residual stream; out may alias resid), then rms_norm_acts_d_model of out
// with norm_w into xb (bf16 GEMM activations, nothing else): bit for bit the combine followed
// by that norm.
template <typename Slot>
__device__ __forceinline__ void moe_combine_norm_acts_body(float* out, const float* resid, const Slot* __restrict__ slot_out,
                                                           const float* __restrict__ wts, const float* __restrict__ shared,
                                                           const float* __restrict__ shared_w,
                                                           const float* __restrict__ norm_w, unsigned* __restrict__ xb,
                                                           float eps, int t) {
    constexpr int D = CALLA_D_MODEL, TK = CALLA_TOP_K;
    const int tok = blockIdx.x, th = threadIdx.x;
    const float4* nw = reinterpret_cast<const float4*>(norm_w) + 2 * th;
    const float4 wa = nw[0], wb = nw[1];  // weights: safe to read before the wait
    calla_pdl_wait();
    if (tok >= t) return;
    float w[TK];
#pragma unroll
    for (int s = 0; s < TK; ++s) w[s] = wts[tok * TK + s];
    const float sw = shared_w[tok];
    float4 o[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int d4 = 2 * th + h;
        const float4 sh = reinterpret_cast<const float4*>(shared + (size_t)tok * D)[d4];
        const float4 r = reinterpret_cast<const float4*>(resid + (size_t)tok * D)[d4];
        o[h] = calla_moe_combine4<TK>(slot_out + (size_t)tok * TK * D, D, d4, w, sw, sh, r);
    }
    // every thread read its own elements of resid before writing them (out may alias it)
    float4* orow = reinterpret_cast<float4*>(out + (size_t)tok * D) + 2 * th;
    orow[0] = o[0];
    orow[1] = o[1];
    calla_norm::rms_norm_tail<D>(nullptr, o[0], o[1], wa, wb, eps, xb);
}
extern "C" __global__ void __launch_bounds__(CALLA_D_MODEL / 8)
moe_combine_norm_acts(float* out, const float* resid, const float* __restrict__ slot_out,
                      const float* __restrict__ wts, const float* __restrict__ shared,
                      const float* __restrict__ shared_w, const float* __restrict__ norm_w,
                      unsigned* __restrict__ xb, float eps, int t) {
    moe_combine_norm_acts_body(out, resid, slot_out, wts, shared, shared_w, norm_w, xb, eps, t);
}
// The same over bf16 slot rows (the down GEMM's mode 5, the prefill's default).
extern "C" __global__ void __launch_bounds__(CALLA_D_MODEL / 8)
moe_combine_norm_acts_b16(float* out, const float* resid, const unsigned short* __restrict__ slot_out,
                          const float* __restrict__ wts, const float* __restrict__ shared,
                          const float* __restrict__ shared_w, const float* __restrict__ norm_w,
                          unsigned* __restrict__ xb, float eps, int t) {
    moe_combine_norm_acts_body(out, resid, slot_out, wts, shared, shared_w, norm_w, xb, eps, t);
}
