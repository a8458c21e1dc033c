// Zero-centred RMSNorm (Qwen3-Next / Qwen3.5 style): y = x / sqrt(mean(x^2) + eps) * (1 + w).
// One block of D/8 threads per row; each thread owns 8 consecutive elements (two float4).
// x, y: f32 [n_rows, D]; w: f32 [D]. Dims from the generated header.

#ifndef CALLA_D_MODEL
#error "dims header missing"
#endif

namespace calla_norm {

template <int D>
__device__ __forceinline__ void rms_norm_body(float* __restrict__ y, const float* __restrict__ x,
                                              const float* __restrict__ w, float eps) {
    constexpr int THREADS = D / 8;
    constexpr int WARPS = THREADS / 32;
    static_assert(D % 256 == 0, "D must be a multiple of 256");
    __shared__ float partial[WARPS];
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    const float4* wr = reinterpret_cast<const float4*>(w) + 2 * t;
    const float4 wa = wr[0], wb = wr[1];  // weights: safe to read before the wait
    calla_pdl_wait();
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)row * D) + 2 * t;
    float4 a = xr[0], b = xr[1];
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
    float4* yr = reinterpret_cast<float4*>(y + (size_t)row * D) + 2 * t;
    yr[0] = make_float4(a.x * inv * (1.f + wa.x), a.y * inv * (1.f + wa.y), a.z * inv * (1.f + wa.z), a.w * inv * (1.f + wa.w));
    yr[1] = make_float4(b.x * inv * (1.f + wb.x), b.y * inv * (1.f + wb.y), b.z * inv * (1.f + wb.z), b.w * inv * (1.f + wb.w));
}

}  // namespace calla_norm

// Residual-stream norm (input_layernorm, post_attention_layernorm, final norm): D = D_MODEL.
extern "C" __global__ void __launch_bounds__(CALLA_D_MODEL / 8)
rms_norm_d_model(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w, float eps) {
    calla_norm::rms_norm_body<CALLA_D_MODEL>(y, x, w, eps);
}
