// Prefill (batched) matrix products for MLX affine-quantized weights on Hopper tensor cores, and
// the MoE top-k routing they need.
//
//   Y[t, n] = sum_k X[t, k] * W[n, k],   W[n, k] = scale[n, k/64] * q[n, k] + bias[n, k/64]
//
// W layout (crates/quant/README.md): packed u32 [N, K*BITS/32], element 0 in the low bits;
// scales/biases bf16 [N, K/64] (raw u16 bits). One K tile of the kernels is one quantization
// group (64 columns), so a tile has exactly one scale and one bias per row.
// Optionally (sbt != nullptr) the GEMMs read the scales and biases from a group-major copy
// instead (qmat_group_major): one u32 per (group, row), sbt[g * N + n] = scale | bias << 16, so
// a tile's rows are contiguous and a warp's 32 four-byte copies coalesce into one 128-byte
// request (in the MLX layout a tile's rows are K/32 bytes apart). The same bits either way.
// With pk_gm (which needs sbt) `packed` is the codes' group-major copy too
// (qmat_pack_group_major): tile t's 2·BITS words of row n at (t * N + n) * 2·BITS, so a tile's
// rows are one contiguous run as well.
//
// Roles: W is the MMA's A operand (M = output features), X the B operand (N = tokens), so the
// accumulator holds Y^T tiles and the packed weights never go through a bf16 copy in shared
// memory: each warp owns 16 rows of W per 64-row slice, reads its packed words from shared
// memory (cp.async, 5-stage ring; 4 for the 8-bit tall tile) and dequantizes them straight into
// the A fragment registers. (Two exceptions: the warp-specialized loop, whose producer
// dequantizes into a bf16 A tile in shared memory, and the dense products on bf16 weight
// copies, qgemm_bf_*, which copy such a tile from global memory; both then run wgmma with both
// operands in shared memory.)
//
// K permutation. A dot product does not care in which order the 64 columns of a tile meet, so
// the MMA's k slots are mapped to columns to suit the dequantization: thread c (= lane % 4) of
// a quad owns columns 16c .. 16c+15 of the tile (one u32 pair at 4 bits, one uint4 at 8 bits)
// and at k-step s (0..3) of the tile feeds slot pairs
//   (2c, 2c+1)   <- columns (16c + s,     16c + s + 4)
//   (2c+8, 2c+9) <- columns (16c + 8 + s, 16c + 12 + s)
// i.e. tile position P = 16s + 8h + 2c + l holds column k = 16c + 8h + 4l + s. At 4 bits the
// pair (s, s+4) is nibbles s and s+4 of one word, which one LOP3 turns into two bf16 lanes
// (0x4300 | q = 128 + q), so a pair costs SHF + LOP3 + 2 HFMA2.BF16 (the second computes
// scale*q + bias with one rounding). At 8 bits a PRMT builds the f32 32768 + q, one FFMA with
// (bias - 32768*scale) gives scale*q + bias, and one F2FP packs two of them.
// The activations are converted once per GEMM (qgemm_x_to_bf16) to bf16 in the same permuted
// order, so the B operand needs no shuffling: shared memory holds rows of 64 bf16 (128 bytes)
// per token, 128-byte swizzled (16-byte chunk j of row r at chunk j ^ (r & 7)).
//
// MMA engines (template WG):
// * WG = true: wgmma.mma_async m64nBNk16, A from registers (the dequantized fragments), B from
//   the swizzled shared tile through a descriptor. Asynchronous: the dequantization of the next
//   64-row slice overlaps the running MMAs; two A register buffers, wgmma.wait_group 1.
//   The MMAs are only as wide as the block's tokens need (fitted width: the narrowest of
//   {16, 32, 48, 64} for BN 64, {16, 32} for BN 32, {64, 96, 128} for BN 128, {64, 128, 192,
//   256} for BN 256 that covers cnt;
//   mode flag MODE_FULL_N keeps BN): a grouped expert tile averaging ~32 of its 64 entries
//   (a 1k-token prompt) no longer multiplies the padding. Same bits either way.
// * WG = false: mma.sync m16n8k16, B fragments with ldmatrix from the same shared layout.
// Both leave the accumulators in the same layout (per 8-token chunk j: rows g and g+8, tokens
// 8j + 2c and 8j + 2c + 1), so the epilogues are shared.
// Copies (template LEAN): the plain ones (load_tile) and the lean ones (wgmma, group-major
// scales only) fill the same ring stages with the same bytes, so both give the same bits; the
// lean ones spend fewer instructions per K tile on addresses.
// Copies (template BULK, with LEAN; group-major codes and scales): a tile's codes and scales
// by bulk copies from one thread, completed on a per-stage mbarrier, the activations as the
// lean ones; the same bytes, so the same bits (the SwiGLU modes' gate and up rows land in the
// tile's two halves instead of interleaved by 8, and the dequantization reads them there).
//
// Block: 256 threads = 2 warpgroups; each warpgroup owns MS slices of 64 W rows (BM = 128*MS
// rows per block) and all BN tokens of the block. Tiles: big (MS 2, BN 128, one block per SM),
// tall (MS 2, BN 64, two per SM), small (MS 1, BN 64, two per SM), narrow (MS 2, BN 32, two per SM),
// wide (MS 1, BN 256, one block per SM: a warpgroup's 64 dequantized rows feed 256 tokens, a
// quarter of the tall tile's dequantization instructions per MMA (the copies per MMA about the same); wgmma only).
//
// Modes (runtime, uniform per launch):
//   0 dense          y[t, n] = acc (+ res[t, n])           rows n < n_rows, tokens t < T
//   1 dense SwiGLU   y[t, j] = silu(acc_gate) * acc_up    W = [gate (I rows) | up (I rows)]
//   2 MoE gate/up    act[entry, j] (bf16, permuted layout) = silu(G_e x) * (U_e x) for the
//                    entries (token*k + slot) routed to expert e; W rows e*n_rows ..
//   3 MoE down       y[entry, n] = D_e act[entry]                     W rows e*n_rows ..
//   5 MoE down, bf16 the same rows rounded to bf16 (y holds u16), staged in shared memory and
//                    written with 16-byte stores: half the bytes of mode 3 for the combine to
//                    read back (the prefill's default; mode 3 is its measured twin)
// In the SwiGLU modes a warp's 16-row slice holds gate rows j..j+7 (rows 0-7) and the matching
// up rows (rows 8-15), so both values of an output meet in the same thread (c0/c2 registers).
// In the MoE modes blockIdx.y indexes the tiles of BN entries of all experts
// (tile_offs = exclusive scan of ceil(count_e / BN), written by qgemm_moe_scan).

#ifndef CALLA_QUANT_GROUP
#error "dims header missing"
#endif

namespace calla_qgemm {

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

static_assert(CALLA_QUANT_GROUP == 64, "one K tile is one quantization group of 64 columns");
constexpr int KTILE = CALLA_QUANT_GROUP;
constexpr int THREADS = 256;

// MODE_BENCH: dense mapping, nothing stored (benchmarks of the main loop alone).
enum { MODE_DENSE = 0, MODE_SWIGLU = 1, MODE_MOE_GATE_UP = 2, MODE_MOE_DOWN = 3, MODE_BENCH = 4, MODE_MOE_DOWN_B16 = 5 };
// Flag ORed into the mode: the wgmma loop multiplies the tile's full BN token columns even when
// fewer tokens (routed entries) fill the block's tile (the measured twin of the fitted width).
constexpr int MODE_FULL_N = 16;
// Flag ORed into MODE_DENSE: the f32 epilogue stages the block's outputs in shared memory and
// writes them (adding the residual, read the same way) as 16-byte rows per token instead of
// from the accumulators' scattered 4-byte elements (session 39; the direct form is its twin).
constexpr int MODE_STAGED_EPI = 32;

// A compile-time MMA width handed to the generic main loop.
template <int N>
struct Width {
    static constexpr int value = N;
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// (the fences and waits of wgmma: calla_fence_proxy_async, calla_wgmma_* in prelude.cuh)

// Keeps the 16 registers of an A buffer alive (unmodified) up to this point: an in-flight
// wgmma reads them asynchronously, which the compiler cannot see.
__device__ __forceinline__ void keep_alive(const u32 (&a)[4][4]) {
    asm volatile("" ::"r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(a[1][0]), "r"(a[1][1]),
                 "r"(a[1][2]), "r"(a[1][3]), "r"(a[2][0]), "r"(a[2][1]), "r"(a[2][2]), "r"(a[2][3]),
                 "r"(a[3][0]), "r"(a[3][1]), "r"(a[3][2]), "r"(a[3][3]));
}

__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// One f32 to bf16 (round to nearest even; NaN stays NaN). One instruction, no branch: a branch
// in an epilogue that reads the accumulators made ptxas serialize the main loop's wgmma.
__device__ __forceinline__ u16 to_bf16(float x) {
    u16 d;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(d) : "f"(x));
    return d;
}
// Two f32 to one bf16x2 (round to nearest even): lo in bits 0-15, hi in bits 16-31.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// 4-bit: nibbles 0 and 4 of v (bits 0-3 and 16-19) -> bf16x2 (scale*q + bias), one rounding.
// One LOP3 masks the pair and sets its exponent bits ((v & 0x000F000F) | 0x43004300: bf16 128 + q
// in both halves).
__device__ __forceinline__ u32 deq4(u32 v, u32 s2, u32 b2) {
    u32 t;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(t) : "r"(v), "r"(0x000F000Fu), "r"(0x43004300u));
    const u32 q = fma_bf16x2(t, 0x3F803F80u, 0xC300C300u);  // (128 + q) * 1 - 128 = q, exact
    return fma_bf16x2(q, s2, b2);
}
// 8-bit: byte S of word -> f32 scale*q + bias; bq = bias - 32768*scale.
template <int S>
__device__ __forceinline__ float deq8(u32 word, float s, float bq) {
    const float f = __uint_as_float(__byte_perm(word, 0x47000000u, 0x7504 | (S << 4)));  // 32768 + q
    return fmaf(f, s, bq);
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float* d, const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Position inside a 64-column tile of the permuted layout for column kk (0..63).
__device__ __forceinline__ int perm_pos(int kk) {
    return 16 * (kk & 3) + 8 * ((kk >> 3) & 1) + 2 * (kk >> 4) + ((kk >> 2) & 1);
}

// D[64 x 64] += A[64 x 16] (registers, bf16) * B[16 x 64] (shared memory, K-major, 128B swizzle)
__device__ __forceinline__ void wgmma_n64(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// D[64 x 32] += A[64 x 16] (registers, bf16) * B[16 x 32] (shared memory, K-major, 128B swizzle)
__device__ __forceinline__ void wgmma_n32(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// D[64 x 16] += A[64 x 16] (registers, bf16) * B[16 x 16] (shared memory, K-major, 128B swizzle)
__device__ __forceinline__ void wgmma_n16(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// D[64 x 48] += A[64 x 16] (registers, bf16) * B[16 x 48] (shared memory, K-major, 128B swizzle)
__device__ __forceinline__ void wgmma_n48(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23}, "
        "{%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// D[64 x 96] += A[64 x 16] (registers, bf16) * B[16 x 96] (shared memory, K-major, 128B swizzle)
__device__ __forceinline__ void wgmma_n96(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
        "{%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// D[64 x 128] += A[64 x 16] (registers, bf16) * B[16 x 128] (shared memory, K-major, 128B swizzle)
__device__ __forceinline__ void wgmma_n128(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// D[64 x 192] += A[64 x 16] (registers, bf16) * B[16 x 192] (shared memory, K-major, 128B swizzle)
__device__ __forceinline__ void wgmma_n192(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
        "{%96, %97, %98, %99}, %100, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// D[64 x 256] += A[64 x 16] (registers, bf16) * B[16 x 256] (shared memory, K-major, 128B swizzle)
__device__ __forceinline__ void wgmma_n256(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// Shared-memory descriptor bits for a K-major B tile with 128-byte swizzle: SBO = 1024 bytes
// (8 rows of 128 bytes), LBO unused (1), layout type 1 (bits 62-63). The start address (bits
// 0-13, in 16-byte units) is ORed in; +2 per k-step of 16 bf16 (32 bytes).
constexpr u64 DESC_SW128 = (1ull << 62) | (64ull << 32) | (1ull << 16);

template <int BN>
__device__ __forceinline__ void wgmma_bn(float* d, const u32* a, u64 desc);
template <>
__device__ __forceinline__ void wgmma_bn<16>(float* d, const u32* a, u64 desc) { wgmma_n16(d, a, desc); }
template <>
__device__ __forceinline__ void wgmma_bn<32>(float* d, const u32* a, u64 desc) { wgmma_n32(d, a, desc); }
template <>
__device__ __forceinline__ void wgmma_bn<48>(float* d, const u32* a, u64 desc) { wgmma_n48(d, a, desc); }
template <>
__device__ __forceinline__ void wgmma_bn<64>(float* d, const u32* a, u64 desc) { wgmma_n64(d, a, desc); }
template <>
__device__ __forceinline__ void wgmma_bn<96>(float* d, const u32* a, u64 desc) { wgmma_n96(d, a, desc); }
template <>
__device__ __forceinline__ void wgmma_bn<128>(float* d, const u32* a, u64 desc) { wgmma_n128(d, a, desc); }
template <>
__device__ __forceinline__ void wgmma_bn<192>(float* d, const u32* a, u64 desc) { wgmma_n192(d, a, desc); }
template <>
__device__ __forceinline__ void wgmma_bn<256>(float* d, const u32* a, u64 desc) { wgmma_n256(d, a, desc); }

// D[64 x N] += A[64 x 16] * B[16 x N], both operands from shared memory (K-major, 128-byte
// swizzle, descriptors as DESC_SW128): the warp-specialized loop's MMA.
template <int N>
__device__ __forceinline__ void wgmma_ss_bn(float* d, u64 da, u64 db);
template <>
__device__ __forceinline__ void wgmma_ss_bn<16>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ss_bn<32>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ss_bn<48>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "l"(da), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ss_bn<64>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(1));
}

// The wider forms, for the dense GEMMs on bf16 weight copies (BFW in qgemm_body).
template <>
__device__ __forceinline__ void wgmma_ss_bn<96>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
        "%48, %49, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "l"(da), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ss_bn<128>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ss_bn<192>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
        "%96, %97, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(da), "l"(db), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_ss_bn<256>(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1));
}

template <int BITS, int MS, int BN>
struct Cfg {
    static constexpr int BM = 128 * MS;                 // W rows per block (2 warpgroups x 64 x MS)
    static constexpr int RB = BITS * 8;                 // packed bytes per W row per K tile
    static constexpr int XB = BN * 128;                 // X tile: BN rows of 64 bf16
    static constexpr int WB = BM * RB;                  // W tile
    // a bf16 pair per row (scales; biases after); none for bf16 weights (BITS 16, BFW)
    static constexpr int SB = BITS == 16 ? 0 : BM * 4;
    static constexpr int STAGE = (XB + WB + 2 * SB + 1023) / 1024 * 1024;
    // ring stages: 5, but 4 for the 8-bit tall tile so that two blocks fit an SM, and 4 for
    // bf16 weights (48 KB stages)
    static constexpr int STAGES = (BITS == 16 || (BITS == 8 && MS == 2 && BN == 64)) ? 4 : 5;
    static constexpr int SMEM = STAGES * STAGE + 1024;  // + slack to align the ring to 1024
    static constexpr int NJ = BN / 8;                   // 8-token chunks
    static constexpr int XPT = BN * 8 / THREADS;        // 16-byte X copies per thread per tile
    static constexpr int WPT = BM * RB / 16 / THREADS;  // 16-byte W copies per thread per tile
    static constexpr int SPT = BM * 2 / THREADS;        // 4-byte scale/bias copies per thread
    static_assert(XPT >= 1 && WPT >= 1 && SPT >= 1, "tile too small for the block");
    static_assert(BN * (BM / 2) * 2 <= STAGES * STAGE, "MoE epilogue staging must fit the ring");
    static constexpr int DSP = BM + 8;  // bf16 down staging: row stride (16 bytes of padding)
    static_assert(BN * DSP * 2 <= STAGES * STAGE, "MoE down staging must fit the ring");
    // f32 dense staging (MODE_STAGED_EPI): row stride in floats; +4 keeps a warp's stores of
    // 8 rows x 4 tokens on 32 different banks and every row 16-byte aligned
    static constexpr int FSP = BM + 4;
    static_assert(BN * FSP * 4 <= STAGES * STAGE, "f32 epilogue staging must fit the ring");
};

template <int BITS, int MS, int BN, bool WG, bool LEAN, bool BULK = false, bool WS = false, bool BFW = false>
__device__ __forceinline__ void qgemm_body(const u32* __restrict__ packed, const u16* __restrict__ scales,
                                           const u16* __restrict__ biases, const u32* __restrict__ sbt,
                                           int sbt_rows, int pk_gm, const u16* __restrict__ xb, float* y,
                                           const float* res, u16* act, const int* __restrict__ sorted,
                                           const int* __restrict__ offsets, const int* __restrict__ tile_offs,
                                           int n_rows, int K, int T, int mode, int ldy, int topk) {
    using C = Cfg<BITS, MS, BN>;
    extern __shared__ unsigned char smem_dyn[];
    __shared__ int s_wrow[C::BM];
    __shared__ int s_xrow[BN];
    __shared__ int s_orow[BN];
    __shared__ int s_tile[3];  // MoE modes: the block's expert, first sorted entry, entries
    // BULK: a tile's codes and scales landed (one per stage); WS: 4 `full` then 4 `empty`
    __shared__ alignas(8) unsigned long long s_full[WS ? 8 : C::STAGES];
    static_assert(!BULK || LEAN, "the bulk copies replace the lean loop's per-thread weight copies");
    static_assert(!WS || (LEAN && !BULK && BITS == 4 && MS == 2), "the warp-specialized loop: 4-bit, 256-row tiles");
    static_assert(BFW == (BITS == 16) && (!BFW || (WG && LEAN && !BULK && !WS)),
                  "bf16 weights (BITS 16): the wgmma loop with both operands in shared memory");

    calla_pdl_wait();
    const int tid = threadIdx.x;
    // The block's row block (bx) and token tile or MoE tile (by): the grid's own, but for bf16
    // weights (dense products only) grouped by 8 row blocks (consecutive blocks walk the token tiles of 8 row
    // blocks), so that the blocks resident together read 8 row blocks' weights (8 MB as bf16 on
    // the big tile) rather than all of them (50 MB for the GDN input projection: more than L2,
    // read again by every wave).
    int bx = blockIdx.x, by = blockIdx.y;
    if constexpr (BFW) {
        constexpr int G = 8;
        const int gx = gridDim.x, gy = gridDim.y;
        const int lin = by * gx + bx, grp = lin / (G * gy), first = grp * G;
        const int gs = min(G, gx - first), loc = lin - grp * G * gy;
        bx = first + loc % gs;
        by = loc / gs;
    }
    // the thread index the shared copy set-up uses: the WS producer threads (256..) compute a
    // consumer's assignments, which they never use, instead of reading past the row tables
    const int ctid = WS ? (tid & (THREADS - 1)) : tid;
    // the epilogues' block barrier: the consumer warpgroups only in the warp-specialized loop
    // (its producer warpgroup has exited by then)
    auto epi_sync = [&]() {
        if constexpr (WS) asm volatile("bar.sync 1, 256;" ::: "memory");
        else __syncthreads();
    };
    const bool full_n = (mode & MODE_FULL_N) != 0;
    const bool staged = (mode & MODE_STAGED_EPI) != 0;
    mode &= ~(MODE_FULL_N | MODE_STAGED_EPI);

    // ---- work item: which W rows, which tokens (or routed entries)
    const bool moe = mode == MODE_MOE_GATE_UP || mode == MODE_MOE_DOWN || mode == MODE_MOE_DOWN_B16;
    int expert = 0, tok0, cnt;
    if (moe) {
        const int tile = by;
        if (tile >= tile_offs[CALLA_N_EXPERTS]) return;  // grid is sized for the worst case
        // The block's expert is the one e with tile_offs[e] <= tile < tile_offs[e + 1] (an
        // empty expert has none). Each thread looks at one expert, loading its four words
        // together: one round trip of parallel loads, where a binary search over the 257 tile
        // offsets waited for eight dependent ones before any copy could start.
        for (int e = tid; e < CALLA_N_EXPERTS; e += blockDim.x) {
            const int a = tile_offs[e], b = tile_offs[e + 1], o0 = offsets[e], o1 = offsets[e + 1];
            if (a <= tile && tile < b) {
                const int t0 = o0 + (tile - a) * BN;
                s_tile[0] = e;
                s_tile[1] = t0;
                s_tile[2] = min(BN, o1 - t0);
            }
        }
        __syncthreads();
        expert = s_tile[0];
        tok0 = s_tile[1];
        cnt = s_tile[2];
    } else {
        tok0 = by * BN;
        if (tok0 >= T) return;
        cnt = min(BN, T - tok0);
    }
    const int half_rows = n_rows >> 1;  // I in the SwiGLU modes
    const bool swiglu_rows = mode == MODE_SWIGLU || mode == MODE_MOE_GATE_UP;  // gate/up rows interleaved by 8
    for (int i = tid; i < C::BM; i += THREADS) {
        int row;
        if (mode != MODE_SWIGLU && mode != MODE_MOE_GATE_UP) {
            row = min(bx * C::BM + i, n_rows - 1);  // clamped; stores are skipped
        } else {
            const int col = min(bx * (C::BM / 2) + (i >> 4) * 8 + (i & 7), half_rows - 1);
            row = ((i & 15) >= 8 ? half_rows : 0) + col;
        }
        s_wrow[i] = row + expert * n_rows;
    }
    for (int i = tid; i < BN; i += THREADS) {
        int xr = -1, orow = -1;
        if (i < cnt) {
            if (moe) {
                const int e = sorted[tok0 + i];
                orow = e;
                xr = mode == MODE_MOE_GATE_UP ? e / topk : e;
            } else {
                xr = orow = tok0 + i;
            }
        }
        s_xrow[i] = xr;
        s_orow[i] = orow;
    }
    if (BULK && tid == 0) {
        for (int i = 0; i < C::STAGES; ++i) calla_mbar_init(&s_full[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (WS && tid == 0) {
        for (int i = 0; i < 4; ++i) {
            calla_mbar_init(&s_full[i], 128);      // full: every producer thread
            calla_mbar_init(&s_full[4 + i], THREADS);  // empty: every consumer thread
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // ---- shared ring, aligned to 1024 bytes (128-byte swizzle atoms)
    const u32 sraw = smem_addr(smem_dyn);
    const u32 sbase = (sraw + 1023u) & ~1023u;
    unsigned char* const sptr = smem_dyn + (sbase - sraw);

    // split K (dense modes, gridDim.z > 1): block z takes tiles kt0 .. kt0 + KT of the K / KTILE
    // (the host splits them evenly, KT even) and stores raw partial sums into slab z of y
    const int KT = K / KTILE / (int)gridDim.z;
    const int kt0 = (int)blockIdx.z * KT;
    const int wpr = K * BITS / 32;  // packed words per W row
    const int gpr = K / KTILE;      // groups per W row

    // fixed per-thread copy assignments
    int xoff[C::XPT], xsz[C::XPT];
    u32 xdst[C::XPT];
#pragma unroll
    for (int v = 0; v < C::XPT; ++v) {
        const int id = ctid + v * THREADS, row = id >> 3, ch = id & 7;
        const int xr = s_xrow[row];
        xoff[v] = max(xr, 0) * K + ch * 8;
        xsz[v] = xr >= 0 ? 16 : 0;  // zero-fill the rows past the end
        xdst[v] = row * 128 + ((ch ^ (row & 7)) << 4);
    }
    constexpr int PIECES = C::RB / 16;
    int woff[C::WPT];
    u32 wdst[C::WPT];
#pragma unroll
    for (int v = 0; v < C::WPT; ++v) {
        const int id = ctid + v * THREADS, row = id / PIECES, pc = id % PIECES;
        // MLX layout: row r's words of tile t at r * wpr + t * 2·BITS; group-major codes
        // (pk_gm): at (t * sbt_rows + r) * 2·BITS, a tile's rows contiguous
        woff[v] = s_wrow[row] * (pk_gm ? 2 * BITS : wpr) + pc * 4;
        wdst[v] = C::XB + row * C::RB + pc * 16;
    }
    // words from one tile to the next (fits int: a matrix's codes are < 2^31 words, as woff)
    const int wstep = pk_gm ? sbt_rows * (2 * BITS) : 2 * BITS;
    // Scales and biases. MLX layout: even threads copy the aligned scale pair holding group t
    // of row id/2 into the scale area, odd threads the bias pair into the bias area (C::SB
    // later). Group-major (sbt, uniform): threads id < BM copy row id's (scale, bias) word of
    // group t into the scale area; the bias area stays unused.
    const bool gm = sbt != nullptr;
    int soff[C::SPT];
    u32 sdst[C::SPT];
    const u16* const sb_src = (ctid & 1) ? biases : scales;
#pragma unroll
    for (int v = 0; v < C::SPT; ++v) {
        const int id = ctid + v * THREADS;
        if (gm) {
            const int row = min(id, C::BM - 1);
            soff[v] = s_wrow[row];  // word of group 0; group t at + t * sbt_rows
            sdst[v] = C::XB + C::WB + row * 4;
        } else {
            const int row = id >> 1;
            soff[v] = s_wrow[row] * gpr;
            sdst[v] = C::XB + C::WB + (id & 1) * C::SB + row * 4;
        }
    }
    auto load_tile = [&](int t, int stage) {
        const u32 st = sbase + stage * C::STAGE;
#pragma unroll
        for (int v = 0; v < C::XPT; ++v) cp_async16(st + xdst[v], xb + xoff[v] + t * KTILE, xsz[v]);
#pragma unroll
        for (int v = 0; v < C::WPT; ++v) cp_async16(st + wdst[v], packed + woff[v] + t * wstep, 16);
        if (gm) {  // one (scale, bias) word per row of group t
            const u32* const src = sbt + (size_t)t * sbt_rows;
#pragma unroll
            for (int v = 0; v < C::SPT; ++v)
                if (ctid + v * THREADS < C::BM) cp_async4(st + sdst[v], src + soff[v]);
        } else {  // the aligned bf16 pair holding group t (K/64 is even)
#pragma unroll
            for (int v = 0; v < C::SPT; ++v) cp_async4(st + sdst[v], sb_src + soff[v] + (t & ~1));
        }
    };

    const int warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int rbase = (warp >> 2) * 64 * MS + (warp & 3) * 16 + g;  // block-local row (slice 0, row g)

    // Dequantizes this thread's A fragments of slice m (rows rbase + 64m and +8) for the 4
    // k-steps of tile t (in stage `stage`).
    auto dequant = [&](int stage, int t, int m, u32 (&A)[4][4]) {
        const unsigned char* st = sptr + stage * C::STAGE;
        // block rows r0 (a gate row in the SwiGLU modes) and r1 = r0 + 8 (the matching up row);
        // with bulk copies in the SwiGLU modes they sit in the gate and up halves of the tile
        int r0 = rbase + m * 64, r1 = r0 + 8;
        if (BULK && swiglu_rows) {
            r0 = ((r0 >> 4) << 3) + g;
            r1 = r0 + C::BM / 2;
        }
        // Group t's scale and bias of rows r0 and r1 (4 bits: the bf16 splatted to both halves;
        // 8 bits: as f32 bits). MLX layout: the aligned pairs of groups t&~1 and t|1 (scales;
        // biases C::SB later), group t's value in half t&1. Group-major: one word per row,
        // scale in the low half, bias in the high half.
        u32 s0, b0, s1, b1;
        if (LEAN || gm) {
            const u32 p0 = *reinterpret_cast<const u32*>(st + C::XB + C::WB + r0 * 4);
            const u32 p1 = *reinterpret_cast<const u32*>(st + C::XB + C::WB + r1 * 4);
            if constexpr (BITS == 4) {
                s0 = __byte_perm(p0, 0, 0x1010u);
                b0 = __byte_perm(p0, 0, 0x3232u);
                s1 = __byte_perm(p1, 0, 0x1010u);
                b1 = __byte_perm(p1, 0, 0x3232u);
            } else {
                s0 = p0 << 16;
                b0 = p0 & 0xFFFF0000u;
                s1 = p1 << 16;
                b1 = p1 & 0xFFFF0000u;
            }
        } else {
            const u32 sp0 = *reinterpret_cast<const u32*>(st + C::XB + C::WB + r0 * 4);
            const u32 bp0 = *reinterpret_cast<const u32*>(st + C::XB + C::WB + C::SB + r0 * 4);
            const u32 sp1 = *reinterpret_cast<const u32*>(st + C::XB + C::WB + r1 * 4);
            const u32 bp1 = *reinterpret_cast<const u32*>(st + C::XB + C::WB + C::SB + r1 * 4);
            if constexpr (BITS == 4) {
                const u32 sel = (t & 1) ? 0x3232u : 0x1010u;  // splat the bf16 of group t
                s0 = __byte_perm(sp0, 0, sel);
                b0 = __byte_perm(bp0, 0, sel);
                s1 = __byte_perm(sp1, 0, sel);
                b1 = __byte_perm(bp1, 0, sel);
            } else {
                const bool hi = t & 1;
                s0 = hi ? (sp0 & 0xFFFF0000u) : (sp0 << 16);
                b0 = hi ? (bp0 & 0xFFFF0000u) : (bp0 << 16);
                s1 = hi ? (sp1 & 0xFFFF0000u) : (sp1 << 16);
                b1 = hi ? (bp1 & 0xFFFF0000u) : (bp1 << 16);
            }
        }
        if constexpr (BITS == 4) {
            const uint2 w0 = *reinterpret_cast<const uint2*>(st + C::XB + r0 * C::RB + c * 8);
            const uint2 w1 = *reinterpret_cast<const uint2*>(st + C::XB + r1 * C::RB + c * 8);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                A[s][0] = deq4(w0.x >> (4 * s), s0, b0);
                A[s][1] = deq4(w1.x >> (4 * s), s1, b1);
                A[s][2] = deq4(w0.y >> (4 * s), s0, b0);
                A[s][3] = deq4(w1.y >> (4 * s), s1, b1);
            }
        } else {
            const float fs0 = __uint_as_float(s0), fb0 = __uint_as_float(b0);
            const float fs1 = __uint_as_float(s1), fb1 = __uint_as_float(b1);
            const float bq0 = fmaf(-32768.0f, fs0, fb0), bq1 = fmaf(-32768.0f, fs1, fb1);
            const uint4 w0 = *reinterpret_cast<const uint4*>(st + C::XB + r0 * C::RB + c * 16);
            const uint4 w1 = *reinterpret_cast<const uint4*>(st + C::XB + r1 * C::RB + c * 16);
#define CALLA_DEQ8_STEP(S)                                                                         \
    A[S][0] = pack_bf16x2(deq8<S>(w0.x, fs0, bq0), deq8<S>(w0.y, fs0, bq0));                      \
    A[S][1] = pack_bf16x2(deq8<S>(w1.x, fs1, bq1), deq8<S>(w1.y, fs1, bq1));                      \
    A[S][2] = pack_bf16x2(deq8<S>(w0.z, fs0, bq0), deq8<S>(w0.w, fs0, bq0));                      \
    A[S][3] = pack_bf16x2(deq8<S>(w1.z, fs1, bq1), deq8<S>(w1.w, fs1, bq1));
            CALLA_DEQ8_STEP(0)
            CALLA_DEQ8_STEP(1)
            CALLA_DEQ8_STEP(2)
            CALLA_DEQ8_STEP(3)
#undef CALLA_DEQ8_STEP
        }
    };

    float acc[MS][C::NJ * 4];
#pragma unroll
    for (int m = 0; m < MS; ++m)
#pragma unroll
        for (int i = 0; i < C::NJ * 4; ++i) acc[m][i] = 0.f;
    u32 A0[4][4], A1[4][4];
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) A0[s][i] = A1[s][i] = 0u;

    static_assert(!LEAN || WG, "the lean copies serve the wgmma loop");
    // The lean entry points (group-major scales only) make the same copies into the same places
    // as load_tile in fewer instructions: every source is a 32-bit element offset fixed per
    // thread plus a per-tile step that the whole block shares (one IMAD.WIDE.U32 per address
    // instead of a sign-extended 64-bit sum), and a thread's destinations are one register plus
    // constants.
    static_assert(THREADS % PIECES == 0 && C::BM <= THREADS, "lean copy layout");
    u32 xo[C::XPT], xs[C::XPT], wo[C::WPT];
    // thread ctid's copy v: X row ctid/8 + 32v (its 16-byte chunk and swizzle do not depend on v),
    // W row ctid/PIECES + v·THREADS/PIECES (the same piece)
    const u32 xd = (ctid >> 3) * 128 + (((ctid & 7) ^ ((ctid >> 3) & 7)) << 4);
    const u32 wd = C::XB + (ctid / PIECES) * C::RB + (ctid % PIECES) * 16;
    // one (scale, bias) word per row of the tile: threads ctid < BM, one copy each
    const bool has_s = C::BM >= THREADS || ctid < C::BM;
    u32 so = 0;
    if constexpr (LEAN) {
#pragma unroll
        for (int v = 0; v < C::XPT; ++v) {
            const int xr = s_xrow[(ctid >> 3) + 32 * v];
            xo[v] = (u32)max(xr, 0) * (u32)K + (u32)((ctid & 7) * 8);
            xs[v] = xr >= 0 ? 16u : 0u;  // zero-fill the rows past the end
        }
        if constexpr (BFW) {
            // bf16 weights, group-major ([K/64, rows, 64] bf16: tile t's row r at words
            // (t · sbt_rows + r) · 32): thread ctid copies 16-byte chunk ctid % 8 of rows
            // ctid / 8 + 32v, swizzled as the activations
#pragma unroll
            for (int v = 0; v < C::WPT; ++v) wo[v] = (u32)s_wrow[(ctid >> 3) + 32 * v] * 32u + (u32)((ctid & 7) * 4);
        } else {
#pragma unroll
            for (int v = 0; v < C::WPT; ++v)
                wo[v] = (u32)s_wrow[ctid / PIECES + v * (THREADS / PIECES)] * (u32)(pk_gm ? 2 * BITS : wpr) + (u32)((ctid % PIECES) * 4);
        }
        so = has_s ? (u32)s_wrow[ctid] : 0u;
    }
    // BULK: a tile's codes and (scale, bias) words come as one or two runs of consecutive matrix
    // rows (group-major, so a run is contiguous per tile): one run of the block's rows, or in
    // the SwiGLU modes the gate rows into shared rows 0 .. BM/2 and the up rows into BM/2 .. BM
    // (the dequantization maps its rows r0, r1 there). Only the matrix's own rows are copied;
    // the shared rows past them keep stale bytes, whose products land in rows no epilogue stores.
    int run_row = 0, run_n = 0;  // first matrix row and rows of run 0 (run 1: + half_rows)
    if constexpr (BULK) {
        if (swiglu_rows) {
            const int c0 = bx * (C::BM / 2);
            run_row = expert * n_rows + c0;
            run_n = min(C::BM / 2, half_rows - c0);
        } else {
            const int r0 = bx * C::BM;
            run_row = expert * n_rows + r0;
            run_n = min(C::BM, n_rows - r0);
        }
    }
    // tile t into ring stage `stage`
    auto load = [&](int tl, int stage) {
        const int t = tl + kt0;  // the tile of the whole K range
        if constexpr (BULK) {
            const u32 st = sbase + stage * C::STAGE;
            const u32 tx = (u32)t * KTILE;
            if (tid == 0) {
                unsigned char* const sp = sptr + stage * C::STAGE;
                const int runs = swiglu_rows ? 2 : 1;
                calla_mbar_arrive_expect_tx(&s_full[stage], (u32)(runs * run_n * (C::RB + 4)));
                for (int r = 0; r < runs; ++r) {
                    const size_t row = (size_t)t * sbt_rows + run_row + r * half_rows;
                    const int dst_row = r * (C::BM / 2);
                    calla_bulk_copy(sp + C::XB + dst_row * C::RB, packed + row * (2 * BITS), (u32)(run_n * C::RB), &s_full[stage]);
                    calla_bulk_copy(sp + C::XB + C::WB + dst_row * 4, sbt + row, (u32)(run_n * 4), &s_full[stage]);
                }
            }
#pragma unroll
            for (int v = 0; v < C::XPT; ++v) cp_async16(st + xd + v * 32 * 128, xb + (xo[v] + tx), (int)xs[v]);
        } else if constexpr (BFW) {
            // the A tile: 128-byte rows of bf16 in the activations' permuted order, swizzled as
            // they are (chunk j of row r at j ^ (r & 7)); rows 32 apart share the swizzle
            const u32 st = sbase + stage * C::STAGE;
            const u32 tx = (u32)t * KTILE, tw = (u32)t * (u32)sbt_rows * 32u;
#pragma unroll
            for (int v = 0; v < C::XPT; ++v) cp_async16(st + xd + v * 32 * 128, xb + (xo[v] + tx), (int)xs[v]);
#pragma unroll
            for (int v = 0; v < C::WPT; ++v) cp_async16(st + C::XB + xd + v * 32 * 128, packed + (wo[v] + tw), 16);
        } else if constexpr (LEAN) {
            const u32 st = sbase + stage * C::STAGE;
            const u32 tx = (u32)t * KTILE, tw = (u32)t * (u32)wstep, ts = (u32)t * (u32)sbt_rows;
#pragma unroll
            for (int v = 0; v < C::XPT; ++v) cp_async16(st + xd + v * 32 * 128, xb + (xo[v] + tx), (int)xs[v]);
#pragma unroll
            for (int v = 0; v < C::WPT; ++v) cp_async16(st + wd + v * (THREADS / PIECES) * C::RB, packed + (wo[v] + tw), 16);
            if (has_s) cp_async4(st + C::XB + C::WB + tid * 4, sbt + (so + ts));
        } else {
            load_tile(t, stage);
        }
    };

    if constexpr (WS) {
        // ---- warp-specialized loop (WS): threads 256.. (one warpgroup) copy each K tile into
        // a raw stage (codes, scales, the gathered activations), dequantize the codes into a
        // bf16 A tile in the activations' layout (64 permuted columns, 128-byte rows, 128-byte
        // swizzle: chunk j = 2s + h of a row holds nibbles s and s + 4 of code words h, 2 + h,
        // 4 + h, 6 + h, the four deq4 results of the lean loop's A fragment at k-step s) and
        // arrive on the stage's `full` mbarrier; threads 0..255 (the two consumer warpgroups)
        // multiply with wgmma reading both operands from shared memory and arrive on `empty`
        // once a stage's MMAs have retired. The same bf16 values meet in the same order.
        constexpr int SW = C::STAGE;                 // raw part of a stage (X | codes | scales)
        constexpr int AW = C::BM * 128;              // the stage's bf16 A tile, after SW
        constexpr int WSTAGE = SW + AW;
        constexpr int WST = 4;                       // stages
        constexpr int LA = 2;                        // tiles the producer copies ahead
        if (tid >= THREADS) {
            const int pt = tid - THREADS;            // 0..127
            // fixed copy assignments: X rows pt/8 + 16v (v < BN/16), W rows pt/2 + 64v (v < 4)
            // pieces pt%2, scale words of rows pt and pt + 128
            constexpr int XV = BN / 16;
            u32 pxo[XV], pxs[XV];
#pragma unroll
            for (int v = 0; v < XV; ++v) {
                const int xr = s_xrow[(pt >> 3) + 16 * v];
                pxo[v] = (u32)max(xr, 0) * (u32)K + (u32)((pt & 7) * 8);
                pxs[v] = xr >= 0 ? 16u : 0u;
            }
            const u32 pxd = (pt >> 3) * 128 + (((pt & 7) ^ ((pt >> 3) & 7)) << 4);
            u32 pwo[4];
#pragma unroll
            for (int v = 0; v < 4; ++v) pwo[v] = (u32)s_wrow[(pt >> 1) + 64 * v] * (u32)(2 * BITS) + (u32)((pt & 1) * 4);
            const u32 pwd = C::XB + (pt >> 1) * C::RB + (pt & 1) * 16;
            const u32 pso0 = (u32)s_wrow[pt], pso1 = (u32)s_wrow[pt + 128];
            auto pload = [&](int tl) {
                const int t = tl + kt0;
                const u32 st = sbase + (tl % WST) * WSTAGE;
                const u32 tx = (u32)t * KTILE, tw = (u32)t * (u32)wstep, ts = (u32)t * (u32)sbt_rows;
#pragma unroll
                for (int v = 0; v < XV; ++v) cp_async16(st + pxd + v * 16 * 128, xb + (pxo[v] + tx), (int)pxs[v]);
#pragma unroll
                for (int v = 0; v < 4; ++v) cp_async16(st + pwd + v * 64 * C::RB, packed + (pwo[v] + tw), 16);
                cp_async4(st + C::XB + C::WB + pt * 4, sbt + (pso0 + ts));
                cp_async4(st + C::XB + C::WB + (pt + 128) * 4, sbt + (pso1 + ts));
            };
#pragma unroll
            for (int p = 0; p < LA; ++p) {
                if (p < KT) pload(p);
                cp_async_commit();
            }
            for (int t = 0; t < KT; ++t) {
                const int tn = t + LA;
                if (tn < KT) {
                    // the stage last held tile tn - WST, released by the consumers
                    if (tn >= WST) calla_mbar_wait_parity(&s_full[WST + tn % WST], (u32)(tn / WST - 1) & 1u);
                    pload(tn);
                }
                cp_async_commit();
                cp_async_wait<LA>();  // this thread's copies of tile t
                asm volatile("bar.sync 2, 128;" ::: "memory");  // every producer's copies of tile t
                const unsigned char* raw = sptr + (t % WST) * WSTAGE;
                unsigned char* at = sptr + (t % WST) * WSTAGE + SW;
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const int r = pt + 128 * rr;
                    const u32 sb = *reinterpret_cast<const u32*>(raw + C::XB + C::WB + r * 4);
                    const u32 s2 = __byte_perm(sb, 0, 0x1010u), b2 = __byte_perm(sb, 0, 0x3232u);
                    const uint4 wa = *reinterpret_cast<const uint4*>(raw + C::XB + r * C::RB);
                    const uint4 wb = *reinterpret_cast<const uint4*>(raw + C::XB + r * C::RB + 16);
                    const u32 w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const int sk = j >> 1, h = j & 1;
                        uint4 o;
                        o.x = deq4(w[h] >> (4 * sk), s2, b2);
                        o.y = deq4(w[2 + h] >> (4 * sk), s2, b2);
                        o.z = deq4(w[4 + h] >> (4 * sk), s2, b2);
                        o.w = deq4(w[6 + h] >> (4 * sk), s2, b2);
                        *reinterpret_cast<uint4*>(at + r * 128 + ((j ^ (r & 7)) << 4)) = o;
                    }
                }
                calla_fence_proxy_async();  // this thread's A stores and activation copies, for wgmma
                calla_mbar_arrive(&s_full[t % WST]);
            }
            cp_async_wait<0>();
            return;
        }
        // consumers: warpgroup wg = warp / 4 multiplies A rows 128·wg .. (slices of 64)
        auto consume = [&](auto width) {
            constexpr int NN = decltype(width)::value;
            const int wg = warp >> 2;
            for (int t = 0; t < KT; ++t) {
                const int stg = t % WST;
                calla_mbar_wait_parity(&s_full[stg], (u32)(t / WST) & 1u);
                const u32 st = sbase + stg * WSTAGE;
                const u64 db = DESC_SW128 | (u64)((st >> 4) & 0x3FFFu);
                calla_wgmma_fence();
#pragma unroll
                for (int m = 0; m < MS; ++m) {
                    const u64 da = DESC_SW128 | (u64)(((st + SW + (wg * MS + m) * 64 * 128) >> 4) & 0x3FFFu);
#pragma unroll
                    for (int k = 0; k < 4; ++k) wgmma_ss_bn<NN>(acc[m], da + 2 * k, db + 2 * k);
                }
                calla_wgmma_commit();
                calla_wgmma_wait<1>();  // tile t - 1's MMAs have retired: its stage is free
                if (t > 0) calla_mbar_arrive(&s_full[WST + (t - 1) % WST]);
            }
            calla_wgmma_wait<0>();
        };
        const int need = full_n ? BN : cnt;
        if constexpr (BN == 64) {
            if (need > 48) consume(Width<64>{});
            else if (need > 32) consume(Width<48>{});
            else if (need > 16) consume(Width<32>{});
            else consume(Width<16>{});
        } else {
            static_assert(BN == 32, "warp-specialized tiles: tall and narrow");
            if (need > 16) consume(Width<32>{});
            else consume(Width<16>{});
        }
    } else {
    // Ring: tile t lives in stage t % C::STAGES (rs, advanced by increments); tiles t+1 ..
    // t+C::STAGES-3 are in flight while t is consumed. The stage refilled at tile t (ls) held
    // tile t-2, whose MMAs every thread has waited for (wgmma.wait_group 1 at the end of tile
    // t-1) before the barrier of tile t.
#pragma unroll
    for (int p = 0; p < C::STAGES - 2; ++p) {
        if (p < KT) load(p, p);
        cp_async_commit();
    }
    int rs = 0, ls = C::STAGES - 2;  // stages of tile t and of tile t + STAGES - 2
    auto begin_tile = [&](int t) {
        cp_async_wait<C::STAGES - 3>();
        if constexpr (BULK) calla_mbar_wait_parity(&s_full[rs], (u32)(t / C::STAGES) & 1u);
        calla_fence_proxy_async();
        __syncthreads();
        if (t + C::STAGES - 2 < KT) load(t + C::STAGES - 2, ls);
        cp_async_commit();
        ls = ls + 1 == C::STAGES ? 0 : ls + 1;
    };
    auto next_tile = [&]() { rs = rs + 1 == C::STAGES ? 0 : rs + 1; };

    if constexpr (WG) {
        // The main loop with MMAs NN tokens wide (NN <= BN, a multiple of 16): the block's
        // first NN B rows. Token columns are independent in a product, so a tile of cnt <= NN
        // tokens gets the same bits from any width; the accumulators past NN stay zero and
        // belong to no token (the epilogues skip them).
        auto main_loop = [&](auto width) {
            constexpr int NN = decltype(width)::value;
            static_assert(NN % 16 == 0 && NN <= BN, "MMA width");
            auto issue = [&](int stage, int m, const u32 (&A)[4][4]) {
                const u64 desc = DESC_SW128 | (u64)(((sbase + stage * C::STAGE) >> 4) & 0x3FFFu);
                calla_wgmma_fence();
#pragma unroll
                for (int s = 0; s < 4; ++s) wgmma_bn<NN>(acc[m], A[s], desc + 2 * s);
                calla_wgmma_commit();
            };
            if constexpr (BFW) {
                // both operands in shared memory: warpgroup wg's slice m is A rows
                // (wg · MS + m) · 64 .. + 63 of the stage; one commit group per tile, and
                // wait_group 1 retires tile t - 1's MMAs before the barrier of tile t + 1 lets
                // its stage be refilled (as the register-A loops)
                const int wg = warp >> 2;
                for (int t = 0; t < KT; ++t) {
                    begin_tile(t);
                    const u32 st = sbase + rs * C::STAGE;
                    const u64 db = DESC_SW128 | (u64)((st >> 4) & 0x3FFFu);
                    calla_wgmma_fence();
#pragma unroll
                    for (int m = 0; m < MS; ++m) {
                        const u64 da = DESC_SW128 | (u64)(((st + C::XB + (wg * MS + m) * 64 * 128) >> 4) & 0x3FFFu);
#pragma unroll
                        for (int s = 0; s < 4; ++s) wgmma_ss_bn<NN>(acc[m], da + 2 * s, db + 2 * s);
                    }
                    calla_wgmma_commit();
                    calla_wgmma_wait<1>();
                    next_tile();
                }
            } else if constexpr (MS == 2) {
                for (int t = 0; t < KT; ++t) {
                    begin_tile(t);
                    dequant(rs, t, 0, A0);
                    issue(rs, 0, A0);
                    calla_wgmma_wait<1>();  // slice 1 of tile t-1 done: A1 is free
                    keep_alive(A1);
                    dequant(rs, t, 1, A1);
                    issue(rs, 1, A1);
                    calla_wgmma_wait<1>();  // slice 0 of tile t done: A0 is free
                    keep_alive(A0);
                    next_tile();
                }
            } else {
                for (int t = 0; t < KT; t += 2) {  // KT is even (the host checks K % 128 == 0)
                    begin_tile(t);
                    dequant(rs, t, 0, A0);
                    issue(rs, 0, A0);
                    calla_wgmma_wait<1>();  // tile t-1 done: A1 is free
                    keep_alive(A1);
                    next_tile();
                    begin_tile(t + 1);
                    dequant(rs, t + 1, 0, A1);
                    issue(rs, 0, A1);
                    calla_wgmma_wait<1>();  // tile t done: A0 is free
                    keep_alive(A0);
                    next_tile();
                }
            }
        };
        // Fitted width: the narrowest of the tile's widths that covers the block's cnt tokens
        // (routed entries), unless the launch asks for the full width (MODE_FULL_N, the twin).
        const int need = full_n ? BN : cnt;
        if constexpr (BN == 256) {
            if (need > 192) main_loop(Width<256>{});
            else if (need > 128) main_loop(Width<192>{});
            else if (need > 64) main_loop(Width<128>{});
            else main_loop(Width<64>{});
        } else if constexpr (BN == 128) {
            if (need > 96) main_loop(Width<128>{});
            else if (need > 64) main_loop(Width<96>{});
            else main_loop(Width<64>{});
        } else if constexpr (BN == 64) {
            if (need > 48) main_loop(Width<64>{});
            else if (need > 32) main_loop(Width<48>{});
            else if (need > 16) main_loop(Width<32>{});
            else main_loop(Width<16>{});
        } else {
            static_assert(BN == 32, "tile widths");
            if (need > 16) main_loop(Width<32>{});
            else main_loop(Width<16>{});
        }
        calla_wgmma_wait<0>();
        keep_alive(A0);
        keep_alive(A1);
    } else {
        const int mi = lane >> 3, rr = lane & 7;  // ldmatrix: matrix and row this lane addresses
        for (int t = 0; t < KT; ++t) {
            begin_tile(t);
            dequant(rs, t, 0, A0);
            if constexpr (MS == 2) dequant(rs, t, 1, A1);
            const u32 xst = sbase + rs * C::STAGE;
#pragma unroll
            for (int j = 0; j < C::NJ; ++j) {
                const u32 ra = xst + (j * 8 + rr) * 128;
                u32 b[2][4];
                ldmatrix_x4(b[0], ra + ((mi ^ rr) << 4));        // chunks 0-3: k-steps 0, 1
                ldmatrix_x4(b[1], ra + (((4 + mi) ^ rr) << 4));  // chunks 4-7: k-steps 2, 3
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const u32 b0 = b[s >> 1][(s & 1) * 2], b1 = b[s >> 1][(s & 1) * 2 + 1];
                    mma_bf16(&acc[0][4 * j], A0[s], b0, b1);
                    if constexpr (MS == 2) mma_bf16(&acc[1][4 * j], A1[s], b0, b1);
                }
            }
            next_tile();
        }
    }
    }
    if constexpr (!WS) cp_async_wait<0>();  // only empty groups remain; the ring is reused below
    epi_sync();

    // ---- epilogues
    if (mode == MODE_MOE_GATE_UP) {
        // act tile [BN entries][BM/2 columns] bf16 in the permuted layout, staged in shared
        // memory, then written with 16-byte stores.
        constexpr int OC = C::BM / 2;
        u16* stg = reinterpret_cast<u16*>(sptr);
#pragma unroll
        for (int m = 0; m < MS; ++m) {
            const int cl = ((warp >> 2) * 4 * MS + m * 4 + (warp & 3)) * 8 + g;  // block-local column
            const int pos = (cl & ~63) + perm_pos(cl & 63);
#pragma unroll
            for (int j = 0; j < C::NJ; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int tok = 8 * j + 2 * c + e;
                    const float v = calla_silu(acc[m][4 * j + e]) * acc[m][4 * j + 2 + e];
                    stg[tok * OC + pos] = calla_f32_to_bf16(v);
                }
        }
        epi_sync();
        const int col0 = bx * OC;
        for (int idx = tid; idx < BN * (OC / 8); idx += THREADS) {
            const int tok = idx / (OC / 8), ch = idx % (OC / 8);
            const int orow = s_orow[tok];
            if (orow >= 0)
                *reinterpret_cast<uint4*>(act + (size_t)orow * ldy + col0 + ch * 8) =
                    *reinterpret_cast<const uint4*>(stg + tok * OC + ch * 8);
        }
        return;
    }
    if (gridDim.z > 1) y += (size_t)blockIdx.z * (size_t)T * (size_t)ldy;  // this split's slab
    if (mode == MODE_SWIGLU) {
        // split over K (gridDim.z > 1): the partial sums of the gate and up rows, raw, gate
        // column col at col and up at I + col (qgemm_splitk_reduce applies the SwiGLU to the sums)
        const bool split = gridDim.z > 1;
#pragma unroll
        for (int m = 0; m < MS; ++m) {
            const int col = bx * (C::BM / 2) + ((warp >> 2) * 4 * MS + m * 4 + (warp & 3)) * 8 + g;
#pragma unroll
            for (int j = 0; j < C::NJ; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int orow = s_orow[8 * j + 2 * c + e];
                    if (col >= half_rows || orow < 0) continue;
                    const float gate = acc[m][4 * j + e], up = acc[m][4 * j + 2 + e];
                    if (split) {
                        y[(size_t)orow * ldy + col] = gate;
                        y[(size_t)orow * ldy + half_rows + col] = up;
                    } else {
                        y[(size_t)orow * ldy + col] = calla_silu(gate) * up;
                    }
                }
        }
        return;
    }
    if (mode == MODE_BENCH) {  // keep the MMAs alive without storing
        float sum = 0.f;
#pragma unroll
        for (int m = 0; m < MS; ++m)
#pragma unroll
            for (int i = 0; i < C::NJ * 4; ++i) sum += acc[m][i];
        if (sum == 1234.5f) y[0] = sum;
        return;
    }
    // dense / MoE down. MoE down in bf16 (mode 5): the [BN entries][BM rows] tile is staged in
    // shared memory (rows padded to DSP: the four entries of one store land 32 bytes apart in
    // the banks), then written with 16-byte stores; every output row exists (n_rows is a
    // multiple of BM for the experts' down matrices).
    const bool b16 = mode == MODE_MOE_DOWN_B16;
    u16* stg = reinterpret_cast<u16*>(sptr);
    // MODE_STAGED_EPI (dense f32 outputs): the [BN tokens][BM rows] tile of sums goes to the
    // ring (free since the barrier above), then each thread writes whole 16-byte runs of a token's
    // outputs, after reading the residual's matching run with one 16-byte load. The accumulators
    // hold rows g, g + 8 of tokens 2c, 2c + 1 (4-byte elements 8 rows and whole output rows
    // apart), so the direct form below issues 32-128 scalar loads and stores per thread. The same
    // sums and the same additions (acc + res), so the same bits. A thread reads and writes the
    // same elements, so y may alias res here too. Rows whose outputs are not 16-byte aligned
    // (ldy % 4 != 0, an unaligned y or res) or pass n_rows go element by element.
    if constexpr (!WS) {
        if (staged && !b16) {
            float* fs = reinterpret_cast<float*>(sptr);
#pragma unroll
            for (int m = 0; m < MS; ++m)
#pragma unroll
                for (int j = 0; j < C::NJ; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        fs[(8 * j + 2 * c + (e & 1)) * C::FSP + rbase + m * 64 + (e >> 1) * 8] = acc[m][4 * j + e];
            epi_sync();
            constexpr int CH = C::BM / 4;  // 16-byte runs per token row
            // runs in flight per thread: their residual loads are all issued before any store
            // (y may alias res, so the compiler may not hoist a load above an earlier store; one
            // run at a time waited out one round trip per run: 32 per thread on the big tile)
            constexpr int U = 8;
            const int n0 = bx * C::BM;
            const bool vec = (ldy & 3) == 0 &&
                             ((reinterpret_cast<size_t>(y) | reinterpret_cast<size_t>(res)) & 15) == 0;
            for (int base = tid; base < BN * CH; base += U * THREADS) {
                float4 r[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    r[u] = make_float4(0.f, 0.f, 0.f, 0.f);
                    const int idx = base + u * THREADS;
                    if (idx >= BN * CH || res == nullptr || !vec) continue;
                    const int tok = idx / CH, n = n0 + 4 * (idx % CH);
                    const int orow = s_orow[tok];
                    if (orow >= 0 && n + 4 <= n_rows)
                        r[u] = __ldcg(reinterpret_cast<const float4*>(res + (size_t)orow * ldy + n));
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int idx = base + u * THREADS;
                    if (idx >= BN * CH) break;
                    const int tok = idx / CH, n = n0 + 4 * (idx % CH);
                    const int orow = s_orow[tok];
                    if (orow < 0 || n >= n_rows) continue;
                    float4 v = *reinterpret_cast<const float4*>(fs + tok * C::FSP + 4 * (idx % CH));
                    const size_t o = (size_t)orow * ldy + n;
                    if (vec && n + 4 <= n_rows) {
                        if (res != nullptr) {
                            v.x += r[u].x;
                            v.y += r[u].y;
                            v.z += r[u].z;
                            v.w += r[u].w;
                        }
                        *reinterpret_cast<float4*>(y + o) = v;
                    } else {
                        const float vs[4] = {v.x, v.y, v.z, v.w};
                        for (int i = 0; i < 4 && n + i < n_rows; ++i)
                            y[o + i] = res != nullptr ? vs[i] + __ldcg(res + o + i) : vs[i];
                    }
                }
            }
            return;
        }
    }
    // `+ residual`: every residual value is read before any output is stored. y may alias res,
    // so in one loop the compiler could not move a load above the store before it: each of the
    // thread's 32-128 loads would wait for its own round trip. A thread reads and writes the
    // same elements, so reading them all first is correct when y == res too.
    if (!b16 && res != nullptr) {
#pragma unroll
        for (int m = 0; m < MS; ++m)
#pragma unroll
            for (int j = 0; j < C::NJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int nl = rbase + m * 64 + (e >> 1) * 8, tl = 8 * j + 2 * c + (e & 1);
                    const int n = bx * C::BM + nl;
                    const int orow = s_orow[tl];
                    if (n < n_rows && orow >= 0) acc[m][4 * j + e] += __ldcg(res + (size_t)orow * ldy + n);
                }
    }
#pragma unroll
    for (int m = 0; m < MS; ++m)
#pragma unroll
        for (int j = 0; j < C::NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int nl = rbase + m * 64 + (e >> 1) * 8, tl = 8 * j + 2 * c + (e & 1);
                if (b16) {
                    stg[tl * C::DSP + nl] = to_bf16(acc[m][4 * j + e]);
                    continue;
                }
                const int n = bx * C::BM + nl;
                const int orow = s_orow[tl];
                if (n < n_rows && orow >= 0) y[(size_t)orow * ldy + n] = acc[m][4 * j + e];
            }
    if (!b16) return;
    epi_sync();
    u16* yb = reinterpret_cast<u16*>(y) + (size_t)bx * C::BM;
    for (int idx = tid; idx < BN * (C::BM / 8); idx += THREADS) {
        const int tok = idx / (C::BM / 8), ch = idx % (C::BM / 8);
        const int orow = s_orow[tok];
        if (orow >= 0)
            *reinterpret_cast<uint4*>(yb + (size_t)orow * ldy + ch * 8) = *reinterpret_cast<const uint4*>(stg + tok * C::DSP + ch * 8);
    }
}

}  // namespace calla_qgemm

// ---- GEMM entry points: (bits) x (big: 256 W rows x 128 tokens, 1 block/SM | tall: 256 x 64,
// 2 blocks/SM | small: 128 x 64, 2 blocks/SM | narrow: 256 x 32, 2 blocks/SM, for grouped expert
// products that average few entries per expert | wide: 128 x 256, 1 block/SM, wgmma engines only
// | mid: 128 x 128, 2 blocks/SM, wgmma engines only)
// x (engine); the _ln3 / _lb3 ones 3 blocks/SM
#define CALLA_QGEMM_ENTRY_B(NAME, BITS, MS, BN, WG, LEAN, MINB, BULK)                                        \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                       \
        NAME(const unsigned* packed, const unsigned short* scales, const unsigned short* biases,             \
             const unsigned* sbt, int sbt_rows, int pk_gm, const unsigned short* xb, float* y,                \
             const float* res, unsigned short* act, const int* sorted, const int* offsets,                   \
             const int* tile_offs, int n_rows, int k, int t, int mode, int ldy, int topk) {                  \
        calla_qgemm::qgemm_body<BITS, MS, BN, WG, LEAN, BULK>(packed, scales, biases, sbt, sbt_rows, pk_gm, xb, y, res, \
                                                      act, sorted, offsets, tile_offs, n_rows, k, t, mode, ldy, \
                                                      topk);                                                 \
    }

#define CALLA_QGEMM_ENTRY(NAME, BITS, MS, BN, WG, LEAN, MINB) CALLA_QGEMM_ENTRY_B(NAME, BITS, MS, BN, WG, LEAN, MINB, false)

CALLA_QGEMM_ENTRY(qgemm_q4_big_wg, 4, 2, 128, true, false, 1)
CALLA_QGEMM_ENTRY(qgemm_q4_tall_wg, 4, 2, 64, true, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q4_small_wg, 4, 1, 64, true, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_big_wg, 8, 2, 128, true, false, 1)
CALLA_QGEMM_ENTRY(qgemm_q8_tall_wg, 8, 2, 64, true, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_small_wg, 8, 1, 64, true, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q4_big_mma, 4, 2, 128, false, false, 1)
CALLA_QGEMM_ENTRY(qgemm_q4_tall_mma, 4, 2, 64, false, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q4_small_mma, 4, 1, 64, false, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_big_mma, 8, 2, 128, false, false, 1)
CALLA_QGEMM_ENTRY(qgemm_q8_tall_mma, 8, 2, 64, false, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_small_mma, 8, 1, 64, false, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q4_narrow_wg, 4, 2, 32, true, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_narrow_wg, 8, 2, 32, true, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q4_narrow_mma, 4, 2, 32, false, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_narrow_mma, 8, 2, 32, false, false, 2)
// the wide tile (128 W rows x 256 tokens, one block per SM; wgmma engines only)
CALLA_QGEMM_ENTRY(qgemm_q4_wide_wg, 4, 1, 256, true, false, 1)
CALLA_QGEMM_ENTRY(qgemm_q8_wide_wg, 8, 1, 256, true, false, 1)
CALLA_QGEMM_ENTRY(qgemm_q4_wide_ln, 4, 1, 256, true, true, 1)
CALLA_QGEMM_ENTRY(qgemm_q8_wide_ln, 8, 1, 256, true, true, 1)
CALLA_QGEMM_ENTRY_B(qgemm_q4_wide_lb, 4, 1, 256, true, true, 1, true)
CALLA_QGEMM_ENTRY_B(qgemm_q8_wide_lb, 8, 1, 256, true, true, 1, true)
// mid (prepared in session 52, not yet run on a GPU): 128 W rows x 128 tokens, two blocks per SM,
// wgmma engines only
CALLA_QGEMM_ENTRY(qgemm_q4_mid_wg, 4, 1, 128, true, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_mid_wg, 8, 1, 128, true, false, 2)
CALLA_QGEMM_ENTRY(qgemm_q4_mid_ln, 4, 1, 128, true, true, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_mid_ln, 8, 1, 128, true, true, 2)
CALLA_QGEMM_ENTRY_B(qgemm_q4_mid_lb, 4, 1, 128, true, true, 2, true)
CALLA_QGEMM_ENTRY_B(qgemm_q8_mid_lb, 8, 1, 128, true, true, 2, true)
// the lean copies (group-major scales only)
CALLA_QGEMM_ENTRY(qgemm_q4_big_ln, 4, 2, 128, true, true, 1)
CALLA_QGEMM_ENTRY(qgemm_q4_tall_ln, 4, 2, 64, true, true, 2)
CALLA_QGEMM_ENTRY(qgemm_q4_small_ln, 4, 1, 64, true, true, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_small_ln, 8, 1, 64, true, true, 2)
CALLA_QGEMM_ENTRY(qgemm_q4_narrow_ln, 4, 2, 32, true, true, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_big_ln, 8, 2, 128, true, true, 1)
CALLA_QGEMM_ENTRY(qgemm_q8_tall_ln, 8, 2, 64, true, true, 2)
CALLA_QGEMM_ENTRY(qgemm_q8_narrow_ln, 8, 2, 32, true, true, 2)
// the lean copies compiled for three blocks per SM (at most 80 registers): 4-bit narrow and
// small tiles, whose 66-71 KB rings fit three to an SM (GemmEngine::WgmmaLean3)
CALLA_QGEMM_ENTRY(qgemm_q4_narrow_ln3, 4, 2, 32, true, true, 3)
CALLA_QGEMM_ENTRY(qgemm_q4_small_ln3, 4, 1, 64, true, true, 3)
// the lean loop with each tile's codes and scales by bulk copies (TMA) into the same ring
// stages, issued by one thread and completed on a per-stage mbarrier (CudaContext::set_gemm_bulk
// and set_gemm_bulk_grouped pick them for GemmEngine::WgmmaLean / WgmmaLean3); matrices with
// group-major codes and scales only
CALLA_QGEMM_ENTRY_B(qgemm_q4_big_lb, 4, 2, 128, true, true, 1, true)
CALLA_QGEMM_ENTRY_B(qgemm_q4_tall_lb, 4, 2, 64, true, true, 2, true)
CALLA_QGEMM_ENTRY_B(qgemm_q4_small_lb, 4, 1, 64, true, true, 2, true)
CALLA_QGEMM_ENTRY_B(qgemm_q4_narrow_lb, 4, 2, 32, true, true, 2, true)
CALLA_QGEMM_ENTRY_B(qgemm_q8_big_lb, 8, 2, 128, true, true, 1, true)
CALLA_QGEMM_ENTRY_B(qgemm_q8_tall_lb, 8, 2, 64, true, true, 2, true)
CALLA_QGEMM_ENTRY_B(qgemm_q8_small_lb, 8, 1, 64, true, true, 2, true)
CALLA_QGEMM_ENTRY_B(qgemm_q8_narrow_lb, 8, 2, 32, true, true, 2, true)
CALLA_QGEMM_ENTRY_B(qgemm_q4_narrow_lb3, 4, 2, 32, true, true, 3, true)
CALLA_QGEMM_ENTRY_B(qgemm_q4_small_lb3, 4, 1, 64, true, true, 3, true)
// the warp-specialized loop (384 threads: a producer warpgroup dequantizing into a bf16 A tile,
// two consumer warpgroups on wgmma with both operands in shared memory; CudaContext::set_gemm_ws)
#define CALLA_QGEMM_WS_ENTRY(NAME, BN)                                                                       \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                      \
        NAME(const unsigned* packed, const unsigned short* scales, const unsigned short* biases,             \
             const unsigned* sbt, int sbt_rows, int pk_gm, const unsigned short* xb, float* y,                \
             const float* res, unsigned short* act, const int* sorted, const int* offsets,                   \
             const int* tile_offs, int n_rows, int k, int t, int mode, int ldy, int topk) {                  \
        calla_qgemm::qgemm_body<4, 2, BN, true, true, false, true>(packed, scales, biases, sbt, sbt_rows, pk_gm, xb, y, res, \
                                                                  act, sorted, offsets, tile_offs, n_rows, k, t, mode, ldy, topk); \
    }
CALLA_QGEMM_WS_ENTRY(qgemm_q4_tall_ws, 64)
CALLA_QGEMM_WS_ENTRY(qgemm_q4_narrow_ws, 32)

// Dense products on a bf16 copy of the weights (CudaContext::add_bf16_weights, qmat_bf16_perm
// below; CudaContext::set_gemm_bf16_weights): the lean loop's ring and epilogues, the A tile
// copied rather than dequantized and read by wgmma from shared memory. The copy holds the
// values the dequantization makes, in the positions the activations use, so every product
// meets the same operands in the same MMA slots as on the quantized tiles (wide, big).
#define CALLA_QGEMM_BF_ENTRY(NAME, MS, BN)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                      \
        NAME(const unsigned* packed, const unsigned short* scales, const unsigned short* biases,             \
             const unsigned* sbt, int sbt_rows, int pk_gm, const unsigned short* xb, float* y,                \
             const float* res, unsigned short* act, const int* sorted, const int* offsets,                   \
             const int* tile_offs, int n_rows, int k, int t, int mode, int ldy, int topk) {                  \
        calla_qgemm::qgemm_body<16, MS, BN, true, true, false, false, true>(packed, scales, biases, sbt, sbt_rows, pk_gm, xb, y, \
                                                                            res, act, sorted, offsets, tile_offs, n_rows, k, t, \
                                                                            mode, ldy, topk);                 \
    }
CALLA_QGEMM_BF_ENTRY(qgemm_bf_wide, 1, 256)
CALLA_QGEMM_BF_ENTRY(qgemm_bf_big, 2, 128)

// The bf16 copy of a quantized matrix for the kernels above: packed (MLX layout, BITS 4 or 8),
// scales and biases bf16 [rows, groups] -> out [groups, rows, 32] u32 (two bf16 each), group
// g's row r at words (g * rows + r) * 32. Word 8s + 4h + c holds the bf16 pair the lean loop's
// dequantization gives quad lane c at k-step s in A fragment register 2h (row g) or 2h + 1
// (row g + 8): tile positions 16s + 8h + 2c + {0, 1}, columns 16c + 8h + s and + 4 (the
// K permutation in the header comment), computed by the same deq4 / deq8 as there, so the
// same bits.
extern "C" __global__ void qmat_bf16_perm(const unsigned* __restrict__ packed, const unsigned short* __restrict__ scales,
                                          const unsigned short* __restrict__ biases, unsigned* __restrict__ out, int rows,
                                          int groups, int bits) {
    using namespace calla_qgemm;
    const size_t n = (size_t)rows * groups * 32;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const int o = (int)(i & 31);
        const size_t gr = i >> 5;
        const int g = (int)(gr / rows), r = (int)(gr % rows);
        const int s = o >> 3, h = (o >> 2) & 1, c = o & 3;
        const u32 sc = scales[(size_t)r * groups + g], bi = biases[(size_t)r * groups + g];
        u32 v;
        if (bits == 4) {
            const u32 w = packed[((size_t)r * groups + g) * 8 + 2 * c + h];
            v = deq4(w >> (4 * s), sc | (sc << 16), bi | (bi << 16));
        } else {
            const size_t base = ((size_t)r * groups + g) * 16 + 4 * c + 2 * h;
            const u32 w0 = packed[base], w1 = packed[base + 1];
            const float fs = __uint_as_float(sc << 16), fb = __uint_as_float(bi << 16);
            const float bq = fmaf(-32768.0f, fs, fb);
            switch (s) {
                case 0: v = pack_bf16x2(deq8<0>(w0, fs, bq), deq8<0>(w1, fs, bq)); break;
                case 1: v = pack_bf16x2(deq8<1>(w0, fs, bq), deq8<1>(w1, fs, bq)); break;
                case 2: v = pack_bf16x2(deq8<2>(w0, fs, bq), deq8<2>(w1, fs, bq)); break;
                default: v = pack_bf16x2(deq8<3>(w0, fs, bq), deq8<3>(w1, fs, bq)); break;
            }
        }
        out[i] = v;
    }
}

// The group-major copy of a matrix's scales and biases (header comment): scales, biases bf16
// [rows, groups] (MLX layout) -> out u32 [groups, rows], out[g * rows + r] = scale | bias << 16.
extern "C" __global__ void qmat_group_major(const unsigned short* __restrict__ scales,
                                            const unsigned short* __restrict__ biases, unsigned* __restrict__ out,
                                            int rows, int groups) {
    calla_pdl_wait();
    const long long total = (long long)rows * groups;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long g = i / rows, r = i - g * rows;
        const long long src = r * groups + g;
        out[i] = (unsigned)scales[src] | ((unsigned)biases[src] << 16);
    }
}

// The group-major copy of a matrix's codes (header comment): packed u32 [rows, groups * wpg]
// (MLX layout, wpg = 2 * BITS words per 64-column group) -> out [groups, rows, wpg],
// out[(g * rows + r) * wpg + w] = packed[(r * groups + g) * wpg + w].
extern "C" __global__ void qmat_pack_group_major(const unsigned* __restrict__ packed, unsigned* __restrict__ out,
                                                 int rows, int groups, int wpg) {
    calla_pdl_wait();
    const long long total = (long long)rows * groups * wpg;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long w = i % wpg, gr = i / wpg;
        const long long g = gr / rows, r = gr - g * rows;
        out[i] = packed[(r * groups + g) * wpg + w];
    }
}

// The sum of a split-K dense GEMM's ksplit partial slabs ([ksplit][t][ldp] f32, slab order)
// with the epilogue of its mode: y[tok, n] = Σ_z part[z, tok, n] (+ res[tok, n]), or with
// swiglu (ldp = 2·n_out) y[tok, j] = silu(Σ_z part[z, tok, j]) · Σ_z part[z, tok, n_out + j].
// y, res: [t, n_out]; one thread per output; y may alias res.
extern "C" __global__ void __launch_bounds__(256)
    qgemm_splitk_reduce(float* y, const float* __restrict__ part, const float* res, int t, int n_out, int ldp,
                        int ksplit, int swiglu) {
    calla_pdl_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)t * (size_t)n_out) return;
    const size_t tok = i / (size_t)n_out, n = i % (size_t)n_out, slab = (size_t)t * (size_t)ldp;
    const float* p = part + tok * (size_t)ldp + n;
    float a = p[0];
    for (int z = 1; z < ksplit; ++z) a += p[z * slab];
    if (swiglu) {
        float b = p[n_out];
        for (int z = 1; z < ksplit; ++z) b += p[z * slab + n_out];
        y[i] = calla_silu(a) * b;
    } else {
        if (res) a += res[i];
        y[i] = a;
    }
}

// X f32 [rows, k] -> bf16 [rows, k] in the permuted tile order (header comment): word m of a
// 64-column tile holds columns (16c + 8h + s, +4) with s = m >> 3, h = (m >> 2) & 1, c = m & 3.
extern "C" __global__ void qgemm_x_to_bf16(const float* __restrict__ x, unsigned* __restrict__ xb, int rows,
                                           int k) {
    calla_pdl_wait();
    const int hk = k >> 1;
    const long long total = (long long)rows * hk;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long row = idx / hk;
        const int w = (int)(idx - row * hk);
        const int m = w & 31;
        const int col = (w >> 5) * 64 + 16 * (m & 3) + 8 * ((m >> 2) & 1) + (m >> 3);
        const float* xr = x + row * k + col;
        xb[idx] = (unsigned)calla_f32_to_bf16(xr[0]) | ((unsigned)calla_f32_to_bf16(xr[4]) << 16);
    }
}

// ---- MoE routing (MODEL.md 3.7; model::top_k_renorm)

// One warp per token: softmax over the N_EXPERTS router logits (f32), the TOP_K largest
// probabilities (ties: lower id), weights renormalised over the k (summed in choice order, as
// the CPU does), shared-expert weight sigmoid(logit[N_EXPERTS]); the softmax and the picks are
// calla_router_topk (prelude.cuh), which the decode MoE kernels run too.
// logits: [t, N_EXPERTS + 1]; ids, wts: [t, TOP_K] (descending weight); shared_w: [t].
// The routing of token `tok` by one warp; returns the expert of slot `lane` (lanes < TOP_K;
// the others return an unspecified id).
__device__ __forceinline__ int moe_route_token(const float* __restrict__ logits, int tok, int lane,
                                               int* __restrict__ ids, float* __restrict__ wts,
                                               float* __restrict__ shared_w) {
    constexpr int NE = CALLA_N_EXPERTS, TK = CALLA_TOP_K;
    const float* row = logits + (size_t)tok * (NE + 1);
    const float gate_logit = row[NE];
    int pick[TK];
    float ps[TK];
    calla_router_topk(row, lane, pick, ps);
    float sum = 0.f, my_p = 0.f;
    int my_id = 0;
#pragma unroll
    for (int r = 0; r < TK; ++r) {
        sum += ps[r];
        if (lane == r) {
            my_id = pick[r];
            my_p = ps[r];
        }
    }
    if (lane < TK) {
        ids[tok * TK + lane] = my_id;
        wts[tok * TK + lane] = my_p / sum;
    }
    if (lane == 0) shared_w[tok] = 1.0f / (1.0f + expf(-gate_logit));
    return my_id;
}

extern "C" __global__ void qgemm_moe_route(const float* __restrict__ logits, int t, int* __restrict__ ids,
                                          float* __restrict__ wts, float* __restrict__ shared_w) {
    calla_pdl_wait();
    const int tok = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (tok >= t) return;
    moe_route_token(logits, tok, lane, ids, wts, shared_w);
}

// Sorting the entries (token*k + slot) by expert, deterministically (a stable counting sort):
// the entries are cut into chunks of SORT_CHUNK, one warp per chunk.
//   qgemm_moe_hist:  hist[e * n_chunks + chunk] = entries of the chunk routed to e
//   qgemm_moe_scan:  base[e * n_chunks + chunk] = exclusive scan of hist in that (expert-major)
//                    order; counts, offsets (its expert starts) and the tile offsets
//   qgemm_moe_place: sorted[base + rank] = entry, rank = earlier entries of the chunk with the
//                    same expert (rounds of 32 entries, __match_any_sync), so every expert's
//                    list is in ascending entry order.
constexpr int SORT_CHUNK = 256;  // = SORT_CHUNK in src/gemm.rs

extern "C" __global__ void __launch_bounds__(256) qgemm_moe_hist(const int* __restrict__ ids, int n_entries,
                                                                 int n_chunks, int* __restrict__ hist) {
    constexpr int NE = CALLA_N_EXPERTS;
    __shared__ int cnt[8][NE];
    calla_pdl_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunk = blockIdx.x * 8 + warp;
    if (chunk >= n_chunks) return;  // whole warps
    for (int e = lane; e < NE; e += 32) cnt[warp][e] = 0;
    __syncwarp();
    const int end = min((chunk + 1) * SORT_CHUNK, n_entries);
    for (int i0 = chunk * SORT_CHUNK; i0 < end; i0 += 32) {
        const int i = i0 + lane;
        const int e = i < end ? ids[i] : -1;
        const unsigned m = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && lane == __ffs(m) - 1) cnt[warp][e] += __popc(m);
        __syncwarp();
    }
    for (int e = lane; e < NE; e += 32) hist[e * n_chunks + chunk] = cnt[warp][e];
}

// The scan by one block of 1024 threads (32 warps; warp w owns experts w, w+32, ...). hist is
// read through L2 (__ldcg): in qgemm_moe_route_hist other blocks of the same grid wrote it.
__device__ __forceinline__ void moe_scan_body(const int* hist, int n_chunks, int* __restrict__ base,
                                              int* __restrict__ counts, int* __restrict__ offsets,
                                              int* __restrict__ tiles64, int* __restrict__ tiles128,
                                              int* __restrict__ tiles32, int* __restrict__ tiles256,
                                              int* __restrict__ count_into) {
    constexpr int NE = CALLA_N_EXPERTS, PER = NE / 32;
    static_assert(NE % 32 == 0, "experts per lane");
    __shared__ int s_tot[NE];
    __shared__ int s_pre[NE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // warp w owns experts w + 32j (j < PER); every pass over 32 chunks issues the PER loads of
    // a lane before it adds any (one L2 round trip per pass, not one per expert)
    {
        int sum[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) sum[j] = 0;
        for (int c0 = 0; c0 < n_chunks; c0 += 32) {
            const int c = c0 + lane;
            int v[PER];
#pragma unroll
            for (int j = 0; j < PER; ++j) v[j] = c < n_chunks ? __ldcg(hist + (warp + 32 * j) * n_chunks + c) : 0;
#pragma unroll
            for (int j = 0; j < PER; ++j) sum[j] += v[j];
        }
#pragma unroll
        for (int j = 0; j < PER; ++j) sum[j] = __reduce_add_sync(0xffffffffu, sum[j]);
        if (lane < PER) {
            int mine = sum[0];
#pragma unroll
            for (int j = 1; j < PER; ++j) mine = lane == j ? sum[j] : mine;
            const int e = warp + 32 * lane;
            s_tot[e] = mine;
            if (count_into != nullptr) count_into[e] += mine;  // expert-load telemetry (null: none)
        }
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scans over the experts: lane owns experts lane*PER ..
        int a = 0, b = 0, c = 0, d = 0, f = 0;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int n = s_tot[lane * PER + j];
            a += n;
            b += (n + 63) >> 6;
            c += (n + 127) >> 7;
            d += (n + 31) >> 5;
            f += (n + 255) >> 8;
        }
        int ia = a, ib = b, ic = c, id = d, iff = f;  // inclusive scans over lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int va = __shfl_up_sync(0xffffffffu, ia, o);
            const int vb = __shfl_up_sync(0xffffffffu, ib, o);
            const int vc = __shfl_up_sync(0xffffffffu, ic, o);
            const int vd = __shfl_up_sync(0xffffffffu, id, o);
            const int vf = __shfl_up_sync(0xffffffffu, iff, o);
            if (lane >= o) {
                ia += va;
                ib += vb;
                ic += vc;
                id += vd;
                iff += vf;
            }
        }
        a = ia - a;
        b = ib - b;
        c = ic - c;
        d = id - d;
        f = iff - f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int e = lane * PER + j, n = s_tot[e];
            s_pre[e] = a;
            counts[e] = n;
            offsets[e] = a;
            tiles64[e] = b;
            tiles128[e] = c;
            tiles32[e] = d;
            tiles256[e] = f;
            a += n;
            b += (n + 63) >> 6;
            c += (n + 127) >> 7;
            d += (n + 31) >> 5;
            f += (n + 255) >> 8;
        }
        if (lane == 31) {
            offsets[NE] = a;
            tiles64[NE] = b;
            tiles128[NE] = c;
            tiles32[NE] = d;
            tiles256[NE] = f;
        }
    }
    __syncthreads();
    {
        int run[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) run[j] = s_pre[warp + 32 * j];
        for (int c0 = 0; c0 < n_chunks; c0 += 32) {
            const int c = c0 + lane;
            int v[PER], inc[PER];
#pragma unroll
            for (int j = 0; j < PER; ++j) v[j] = c < n_chunks ? __ldcg(hist + (warp + 32 * j) * n_chunks + c) : 0;
#pragma unroll
            for (int j = 0; j < PER; ++j) inc[j] = v[j];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1)
#pragma unroll
                for (int j = 0; j < PER; ++j) {
                    const int u = __shfl_up_sync(0xffffffffu, inc[j], o);
                    if (lane >= o) inc[j] += u;
                }
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                if (c < n_chunks) base[(warp + 32 * j) * n_chunks + c] = run[j] + inc[j] - v[j];
                run[j] += __shfl_sync(0xffffffffu, inc[j], 31);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024) qgemm_moe_scan(const int* __restrict__ hist, int n_chunks,
                                                                  int* __restrict__ base, int* __restrict__ counts,
                                                                  int* __restrict__ offsets, int* __restrict__ tiles64,
                                                                  int* __restrict__ tiles128, int* __restrict__ tiles32,
                                                                  int* __restrict__ tiles256, int* __restrict__ count_into) {
    calla_pdl_wait();
    moe_scan_body(hist, n_chunks, base, counts, offsets, tiles64, tiles128, tiles32, tiles256, count_into);
}

// The placement of one chunk's entries by one warp (pos: the warp's NE ints of shared memory).
// ids and base are read through L2 (__ldcg): in qgemm_moe_route_hist other blocks of the same
// grid wrote the ids, and an earlier layer's routing may sit in this SM's L1.
__device__ __forceinline__ void moe_place_chunk(const int* ids, int n_entries, int n_chunks, const int* base,
                                                int* __restrict__ sorted, int chunk, int lane, int* pos) {
    constexpr int NE = CALLA_N_EXPERTS;
    // every load of the warp issued before the first is used: the chunk's base column and its
    // 256 entries' experts (8 rounds of 32)
    constexpr int ROUNDS = SORT_CHUNK / 32;
    int b[NE / 32];
#pragma unroll
    for (int j = 0; j < NE / 32; ++j) b[j] = __ldcg(base + (lane + 32 * j) * n_chunks + chunk);
    const int end = min((chunk + 1) * SORT_CHUNK, n_entries);
    int ex[ROUNDS];
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int i = chunk * SORT_CHUNK + 32 * r + lane;
        ex[r] = i < end ? __ldcg(ids + i) : -1;
    }
#pragma unroll
    for (int j = 0; j < NE / 32; ++j) pos[lane + 32 * j] = b[j];
    __syncwarp();
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int i = chunk * SORT_CHUNK + 32 * r + lane;
        const int e = ex[r];
        const unsigned m = __match_any_sync(0xffffffffu, e);
        if (e >= 0) sorted[pos[e] + __popc(m & ((1u << lane) - 1u))] = i;
        __syncwarp();
        if (e >= 0 && lane == __ffs(m) - 1) pos[e] += __popc(m);
        __syncwarp();
    }
}

// Warps of qgemm_moe_route_hist's last block that place the entries (a chunk each, in turn):
// the host asks for that only up to MOE_PLACE_IN_SCAN_MAX_CHUNKS (src/gemm.rs) = this many
// chunks. Measured (H200): one SM placing 16 chunks or more takes longer than a
// qgemm_moe_place launch spread over the SMs (its scattered stores queue behind one SM).
constexpr int PLACE_WARPS = 4;

// qgemm_moe_route + qgemm_moe_hist + qgemm_moe_scan in one launch: block c (1024 threads) routes
// the 32 tokens of entry chunk c (warp w: token 32c + w), counts the chunk's entries per expert
// in shared memory and writes its hist column; the block that finishes last (an arrival counter,
// `done`, back to 0 when it leaves) runs the scan, and with `sorted` non-null the placement of
// every chunk too (warp w < PLACE_WARPS: chunks w, w + PLACE_WARPS, ...; the host asks for it
// for few chunks, where a qgemm_moe_place launch costs more than the last block's pass). The
// same outputs as the separate kernels: the routing is the same code, a chunk's counts are
// counts, the scan and the placement the same functions.
// Grid: n_chunks = ceil(t · TOP_K / SORT_CHUNK) blocks.
static_assert(SORT_CHUNK == 32 * CALLA_TOP_K, "one token per warp of a 1024-thread block");
extern "C" __global__ void __launch_bounds__(1024)
    qgemm_moe_route_hist(const float* __restrict__ logits, int t, int* __restrict__ ids, float* __restrict__ wts,
                         float* __restrict__ shared_w, int n_chunks, int* hist, int* __restrict__ base,
                         int* __restrict__ counts, int* __restrict__ offsets, int* __restrict__ tiles64,
                         int* __restrict__ tiles128, int* __restrict__ tiles32, int* __restrict__ tiles256,
                         int* __restrict__ count_into,
                         unsigned* __restrict__ done, int* __restrict__ sorted) {
    constexpr int NE = CALLA_N_EXPERTS, TK = CALLA_TOP_K;
    static_assert(NE <= 1024, "one thread per expert");
    __shared__ int cnt[NE];
    __shared__ int s_ids[SORT_CHUNK];
    __shared__ bool s_last;
    __shared__ int s_pos[PLACE_WARPS][NE];  // the last block's placement, a row per placing warp
    calla_pdl_wait();
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int chunk = blockIdx.x, tok = chunk * 32 + warp;
    if (tid < NE) cnt[tid] = 0;
    if (tok < t) {
        const int e = moe_route_token(logits, tok, lane, ids, wts, shared_w);
        if (lane < TK) s_ids[warp * TK + lane] = e;
    }
    __syncthreads();
    if (tid < SORT_CHUNK && chunk * 32 + tid / TK < t) atomicAdd(&cnt[s_ids[tid]], 1);
    __syncthreads();
    if (tid < NE) hist[tid * n_chunks + chunk] = cnt[tid];
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    moe_scan_body(hist, n_chunks, base, counts, offsets, tiles64, tiles128, tiles32, tiles256, count_into);
    if (tid == 0) *done = 0u;
    if (sorted == nullptr) return;
    __syncthreads();  // this block's base stores are visible to the whole block
    if (warp < PLACE_WARPS)
        for (int c = warp; c < n_chunks; c += PLACE_WARPS) moe_place_chunk(ids, t * TK, n_chunks, base, sorted, c, lane, s_pos[warp]);
}

extern "C" __global__ void __launch_bounds__(256) qgemm_moe_place(const int* __restrict__ ids, int n_entries,
                                                                  int n_chunks, const int* __restrict__ base,
                                                                  int* __restrict__ sorted) {
    constexpr int NE = CALLA_N_EXPERTS;
    __shared__ int pos[8][NE];
    calla_pdl_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunk = blockIdx.x * 8 + warp;
    if (chunk >= n_chunks) return;  // whole warps
    moe_place_chunk(ids, n_entries, n_chunks, base, sorted, chunk, lane, pos[warp]);
}

// out[tok] = resid[tok] + (sum_slot w[tok, slot] * slot_out[tok*k + slot] + shared_w[tok] * shared[tok])
// over D_MODEL columns; one block per token. out may alias resid. slot_out f32 (mode 3) or bf16
// (mode 5: qgemm_moe_combine_b16).
template <typename Slot>
__device__ __forceinline__ void moe_combine_body(float* out, const float* resid, const Slot* __restrict__ slot_out,
                                                 const float* __restrict__ wts, const float* __restrict__ shared,
                                                 const float* __restrict__ shared_w, int t) {
    constexpr int D = CALLA_D_MODEL, TK = CALLA_TOP_K;
    calla_pdl_wait();
    const int tok = blockIdx.x;
    if (tok >= t) return;
    float w[TK];
#pragma unroll
    for (int s = 0; s < TK; ++s) w[s] = wts[tok * TK + s];
    const float sw = shared_w[tok];
    for (int d4 = threadIdx.x; d4 < D / 4; d4 += blockDim.x) {
        const float4 sh = reinterpret_cast<const float4*>(shared + (size_t)tok * D)[d4];
        const float4 r = reinterpret_cast<const float4*>(resid + (size_t)tok * D)[d4];
        reinterpret_cast<float4*>(out + (size_t)tok * D)[d4] =
            calla_moe_combine4<TK>(slot_out + (size_t)tok * TK * D, D, d4, w, sw, sh, r);
    }
}
extern "C" __global__ void qgemm_moe_combine(float* out, const float* resid, const float* __restrict__ slot_out,
                                             const float* __restrict__ wts, const float* __restrict__ shared,
                                             const float* __restrict__ shared_w, int t) {
    moe_combine_body(out, resid, slot_out, wts, shared, shared_w, t);
}
extern "C" __global__ void qgemm_moe_combine_b16(float* out, const float* resid,
                                                 const unsigned short* __restrict__ slot_out,
                                                 const float* __restrict__ wts, const float* __restrict__ shared,
                                                 const float* __restrict__ shared_w, int t) {
    moe_combine_body(out, resid, slot_out, wts, shared, shared_w, t);
}
