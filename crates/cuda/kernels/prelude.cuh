// Device helpers shared by every kernel file (prepended after the dims header by
// cuda::full_source).

#pragma once

// Programmatic dependent launch (Hopper). A kernel launched with the programmatic-serialization
// attribute may start while the previous kernel in the stream is still running; everything
// before calla_pdl_wait() must not read what the previous kernel writes (weights may be
// prefetched there) and must not write any buffer. Without the attribute both are no-ops.
// Every thread calls calla_pdl_wait() before it exits, so completion stays transitive.
__device__ __forceinline__ void calla_pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void calla_pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// bf16 stored as raw 16-bit patterns (no cuda_bf16.h needed under NVRTC).
__device__ __forceinline__ float calla_bf16_to_f32(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
// Round to nearest even (finite inputs; NaN stays NaN).
__device__ __forceinline__ unsigned short calla_f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float calla_sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float calla_silu(float x) { return x / (1.0f + __expf(-x)); }

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
