// Measurement only (cuda_selftest --only stream; host: CudaContext::stream_probe): how fast
// blocks move bytes from DRAM into their shared memory, the two ways the decode step does it:
//   * bulk copies (cp.async.bulk, the TMA engine), as the MoE cluster kernel fetches its experts:
//     lane i of warp 0 requests chunks i, i + 32, ... of the block's bytes at once, all counted
//     on one mbarrier; with or without thread-block clusters of 8 (which the hardware places
//     within one GPC);
//   * per-thread 16-byte cp.async, as the decode GEMVs fill their rings: every thread requests
//     its share at once, then waits for all of it.
// Session 19 measured the step's input projection and MoE weights arriving at ~1.3-1.7 TB/s
// together while the LM head streams at 4.1 TB/s (docs/CUDA.md "Session 19"); these launches,
// alone and side by side on two streams in the step's proportions, say which mix is slow.
//
// Block b copies `bytes` (a multiple of 16, and of `chunk` for bulk copies; at most the dynamic
// shared memory) from src + (base + b) * stride, and thread 0 stores %globaltimer at its start
// and once the last byte is in shared memory into times[2b], times[2b + 1]. The bytes are not
// used: a copy into shared memory cannot be optimised away.

namespace calla_stream {

constexpr int THREADS = 512;

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

template <bool BULK>
__device__ __forceinline__ void body(const unsigned char* __restrict__ src, unsigned long long stride, unsigned base,
                                     unsigned bytes, unsigned chunk, unsigned long long* times) {
    extern __shared__ __align__(128) unsigned char buf[];
    __shared__ __align__(8) unsigned long long mbar;
    const unsigned long long t0 = calla_globaltimer();
    const unsigned char* p = src + (size_t)(base + blockIdx.x) * stride;
    if (BULK) {
        if (threadIdx.x == 0) calla_mbar_init_expect(&mbar, bytes);
        __syncthreads();  // the mbarrier is initialised before anyone issues or polls
        if (threadIdx.x < 32) {
            for (unsigned off = threadIdx.x * chunk; off < bytes; off += 32 * chunk)
                calla_bulk_copy(buf + off, p + off, chunk, &mbar);
        }
        calla_mbar_wait_phase0(&mbar);
    } else {
        const unsigned s = calla_smem_u32(buf);
        for (unsigned off = threadIdx.x * 16; off < bytes; off += THREADS * 16) cp_async16(s + off, p + off);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    }
    __syncthreads();  // every byte of the block is here
    if (threadIdx.x == 0) {
        times[2 * blockIdx.x] = t0;
        times[2 * blockIdx.x + 1] = calla_globaltimer();
    }
}

}  // namespace calla_stream

// One block per SM (the dynamic shared memory the host asks for is ~216 KB).
extern "C" __global__ void __launch_bounds__(calla_stream::THREADS, 1)
    stream_bulk(const unsigned char* __restrict__ src, unsigned long long stride, unsigned base, unsigned bytes,
                unsigned chunk, unsigned long long* times) {
    calla_stream::body<true>(src, stride, base, bytes, chunk, times);
}
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(calla_stream::THREADS, 1)
    stream_bulk_cl8(const unsigned char* __restrict__ src, unsigned long long stride, unsigned base, unsigned bytes,
                    unsigned chunk, unsigned long long* times) {
    calla_stream::body<true>(src, stride, base, bytes, chunk, times);
}
extern "C" __global__ void __launch_bounds__(calla_stream::THREADS, 1)
    stream_thread(const unsigned char* __restrict__ src, unsigned long long stride, unsigned base, unsigned bytes,
                  unsigned chunk, unsigned long long* times) {
    (void)chunk;
    calla_stream::body<false>(src, stride, base, bytes, chunk, times);
}
