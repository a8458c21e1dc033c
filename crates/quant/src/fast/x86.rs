//! x86_64 kernels: AVX2 (+FMA, F16C) and AVX-512F.
//!
//! Callers guarantee: the level's features are present (checked by `Level::is_available`),
//! `m` passed `validate`, `x`/`dst` hold `cols` values (permuted as `super::permute_x` does),
//! `xsum` holds one value per group, and `out` covers rows `r0 .. r0 + out.len()` of `m`.

use super::GEMM_TOK_BLOCK;
use crate::{bf16_f32, Bits, QMatRef};
use std::arch::x86_64::*;

/// `2²⁴`: `vcvtph2ps` reads a code `q < 1024` as the half subnormal `q·2⁻²⁴`.
const HALF_SUBNORMAL_SCALE: f32 = 16_777_216.0;

#[inline(always)]
unsafe fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

// ---------------------------------------------------------------------------------------------
// AVX2

/// Groups whose scales are staged at a time in a stack buffer (broadcast from memory later).
const GROUP_CHUNK: usize = 64;

/// Eight bf16 at `p` widened to f32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn cvt8_bf16(p: *const half::bf16) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)),
        16,
    ))
}

/// Stages `n ≤ GROUP_CHUNK` scales (times `mul`) into `sbuf` and returns `Σ bias·xsum` over
/// the same groups.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn stage_groups(
    sc: *const half::bf16,
    bi: *const half::bf16,
    xsum: *const f32,
    n: usize,
    mul: f32,
    sbuf: &mut [f32; GROUP_CHUNK],
) -> f32 {
    let mv = _mm256_set1_ps(mul);
    let mut bacc = _mm256_setzero_ps();
    let mut g = 0;
    while g + 8 <= n {
        _mm256_storeu_ps(
            sbuf.as_mut_ptr().add(g),
            _mm256_mul_ps(cvt8_bf16(sc.add(g)), mv),
        );
        bacc = _mm256_fmadd_ps(cvt8_bf16(bi.add(g)), _mm256_loadu_ps(xsum.add(g)), bacc);
        g += 8;
    }
    let mut bsum = hsum256(bacc);
    while g < n {
        sbuf[g] = bf16_f32(*sc.add(g)) * mul;
        bsum += bf16_f32(*bi.add(g)) * *xsum.add(g);
        g += 1;
    }
    bsum
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv_rows_avx2(
    m: &QMatRef<'_>,
    r0: usize,
    out: &mut [f32],
    x: &[f32],
    xsum: &[f32],
) {
    match (m.spec.bits, m.spec.group_size) {
        (Bits::B4, 32) => q4_gemv_avx2::<1>(m, r0, out, x, xsum),
        (Bits::B4, 64) => q4_gemv_avx2::<2>(m, r0, out, x, xsum),
        (Bits::B4, _) => q4_gemv_avx2::<4>(m, r0, out, x, xsum),
        (Bits::B8, 32) => q8_gemv_avx2::<1>(m, r0, out, x, xsum),
        (Bits::B8, 64) => q8_gemv_avx2::<2>(m, r0, out, x, xsum),
        (Bits::B8, _) => q8_gemv_avx2::<4>(m, r0, out, x, xsum),
    }
}

/// 4-bit, `UPG` × 32 columns per group, column order: word `j` holds columns `8j .. 8j+7`;
/// it is broadcast to 8 lanes, shifted right by `4·lane` (`vpsrlvd`), masked to 4 bits and
/// converted (`vcvtdq2ps`). On Zen 3 this beat a `vcvtph2ps`-on-16-bit-lanes variant by ~12%
/// and a nibble-split + `vpmovzxbd` variant by ~30% (single thread, L2-resident).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_gemv_avx2<const UPG: usize>(
    m: &QMatRef<'_>,
    r0: usize,
    out: &mut [f32],
    x: &[f32],
    xsum: &[f32],
) {
    let cols = m.cols;
    let wpr = cols / 8;
    let gpr = cols / (32 * UPG);
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let m4 = _mm256_set1_epi32(0xF);
    let xb = x.as_ptr();
    let mut sbuf = [0f32; GROUP_CHUNK];
    for (i, o) in out.iter_mut().enumerate() {
        let r = r0 + i;
        let w = m.packed.as_ptr().add(r * wpr) as *const __m128i;
        let sc = m.scales.as_ptr().add(r * gpr);
        let bi = m.biases.as_ptr().add(r * gpr);
        let (mut t0, mut t1, mut t2, mut t3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let mut bsum = 0f32;
        let mut g0 = 0;
        while g0 < gpr {
            let n = (gpr - g0).min(GROUP_CHUNK);
            bsum += stage_groups(
                sc.add(g0),
                bi.add(g0),
                xsum.as_ptr().add(g0),
                n,
                1.0,
                &mut sbuf,
            );
            for j in 0..n {
                let g = g0 + j;
                let (mut a0, mut a1, mut a2, mut a3) = (
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                );
                let wp = w as *const i32;
                for uu in 0..UPG {
                    let u = g * UPG + uu;
                    let xu = xb.add(u * 32);
                    let wu = wp.add(u * 4);
                    let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32(*wu), shifts),
                        m4,
                    ));
                    let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32(*wu.add(1)), shifts),
                        m4,
                    ));
                    let q2 = _mm256_cvtepi32_ps(_mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32(*wu.add(2)), shifts),
                        m4,
                    ));
                    let q3 = _mm256_cvtepi32_ps(_mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32(*wu.add(3)), shifts),
                        m4,
                    ));
                    a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xu), a0);
                    a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xu.add(8)), a1);
                    a2 = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xu.add(16)), a2);
                    a3 = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xu.add(24)), a3);
                }
                let sv = _mm256_broadcast_ss(&*sbuf.as_ptr().add(j));
                t0 = _mm256_fmadd_ps(sv, a0, t0);
                t1 = _mm256_fmadd_ps(sv, a1, t1);
                t2 = _mm256_fmadd_ps(sv, a2, t2);
                t3 = _mm256_fmadd_ps(sv, a3, t3);
            }
            g0 += n;
        }
        *o = hsum256(_mm256_add_ps(_mm256_add_ps(t0, t1), _mm256_add_ps(t2, t3))) + bsum;
    }
}

/// 8-bit, group = `QPG` × 32 columns: byte `c` of the row is the code of column `c`;
/// 8 at a time via `vpmovzxbd`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_gemv_avx2<const QPG: usize>(
    m: &QMatRef<'_>,
    r0: usize,
    out: &mut [f32],
    x: &[f32],
    xsum: &[f32],
) {
    let cols = m.cols;
    let gs = 32 * QPG;
    let gpr = cols / gs;
    let xb = x.as_ptr();
    let mut sbuf = [0f32; GROUP_CHUNK];
    for (i, o) in out.iter_mut().enumerate() {
        let r = r0 + i;
        let bp = (m.packed.as_ptr() as *const u8).add(r * cols);
        let sc = m.scales.as_ptr().add(r * gpr);
        let bi = m.biases.as_ptr().add(r * gpr);
        let (mut t0, mut t1, mut t2, mut t3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let mut bsum = 0f32;
        let mut g0 = 0;
        while g0 < gpr {
            let n = (gpr - g0).min(GROUP_CHUNK);
            bsum += stage_groups(
                sc.add(g0),
                bi.add(g0),
                xsum.as_ptr().add(g0),
                n,
                1.0,
                &mut sbuf,
            );
            for j in 0..n {
                let g = g0 + j;
                let (mut a0, mut a1, mut a2, mut a3) = (
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                );
                for qq in 0..QPG {
                    let c = g * gs + qq * 32;
                    let q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        bp.add(c) as *const __m128i
                    )));
                    let q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        bp.add(c + 8) as *const __m128i,
                    )));
                    let q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        bp.add(c + 16) as *const __m128i,
                    )));
                    let q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        bp.add(c + 24) as *const __m128i,
                    )));
                    a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xb.add(c)), a0);
                    a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb.add(c + 8)), a1);
                    a2 = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb.add(c + 16)), a2);
                    a3 = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb.add(c + 24)), a3);
                }
                let sv = _mm256_broadcast_ss(&*sbuf.as_ptr().add(j));
                t0 = _mm256_fmadd_ps(sv, a0, t0);
                t1 = _mm256_fmadd_ps(sv, a1, t1);
                t2 = _mm256_fmadd_ps(sv, a2, t2);
                t3 = _mm256_fmadd_ps(sv, a3, t3);
            }
            g0 += n;
        }
        *o = hsum256(_mm256_add_ps(_mm256_add_ps(t0, t1), _mm256_add_ps(t2, t3))) + bsum;
    }
}

/// Row `r` as f32 `s·q + b` (one rounding: FMA), in the AVX2 column order.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequant_row_avx2(m: &QMatRef<'_>, r: usize, dst: &mut [f32]) {
    let cols = m.cols;
    let gs = m.spec.group_size;
    let gpr = cols / gs;
    let sc = m.scales.as_ptr().add(r * gpr);
    let bi = m.biases.as_ptr().add(r * gpr);
    let d = dst.as_mut_ptr();
    match m.spec.bits {
        Bits::B4 => {
            let w = m.packed.as_ptr().add(r * cols / 8) as *const i32;
            let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            let m4 = _mm256_set1_epi32(0xF);
            let wpg = gs / 8;
            for g in 0..gpr {
                let sv = _mm256_set1_ps(bf16_f32(*sc.add(g)));
                let bv = _mm256_set1_ps(bf16_f32(*bi.add(g)));
                for j in g * wpg..(g + 1) * wpg {
                    let q = _mm256_cvtepi32_ps(_mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32(*w.add(j)), shifts),
                        m4,
                    ));
                    _mm256_storeu_ps(d.add(j * 8), _mm256_fmadd_ps(q, sv, bv));
                }
            }
        }
        Bits::B8 => {
            let bp = (m.packed.as_ptr() as *const u8).add(r * cols);
            for g in 0..gpr {
                let sv = _mm256_set1_ps(bf16_f32(*sc.add(g)));
                let bv = _mm256_set1_ps(bf16_f32(*bi.add(g)));
                let mut c = g * gs;
                while c < (g + 1) * gs {
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        bp.add(c) as *const __m128i
                    )));
                    _mm256_storeu_ps(d.add(c), _mm256_fmadd_ps(q, sv, bv));
                    c += 8;
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dots_rt_avx2<const R: usize, const T: usize>(
    ws: &[&[f32]; 2],
    xs: &[&[f32]; GEMM_TOK_BLOCK],
    res: &mut [[f32; GEMM_TOK_BLOCK]; 2],
) {
    let cols = ws[0].len();
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let wp: [*const f32; R] = std::array::from_fn(|r| ws[r].as_ptr());
    let xp: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
    let mut c = 0;
    while c < cols {
        let wv: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(wp[r].add(c)));
        for t in 0..T {
            let xv = _mm256_loadu_ps(xp[t].add(c));
            for r in 0..R {
                acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
            }
        }
        c += 8;
    }
    for r in 0..R {
        for t in 0..T {
            res[r][t] = hsum256(acc[r][t]);
        }
    }
}

#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dots_avx2(
    rb: usize,
    tb: usize,
    ws: &[&[f32]; 2],
    xs: &[&[f32]; GEMM_TOK_BLOCK],
    res: &mut [[f32; GEMM_TOK_BLOCK]; 2],
) {
    match (rb, tb) {
        (2, 4) => dots_rt_avx2::<2, 4>(ws, xs, res),
        (2, 3) => dots_rt_avx2::<2, 3>(ws, xs, res),
        (2, 2) => dots_rt_avx2::<2, 2>(ws, xs, res),
        (2, 1) => dots_rt_avx2::<2, 1>(ws, xs, res),
        (1, 4) => dots_rt_avx2::<1, 4>(ws, xs, res),
        (1, 3) => dots_rt_avx2::<1, 3>(ws, xs, res),
        (1, 2) => dots_rt_avx2::<1, 2>(ws, xs, res),
        _ => dots_rt_avx2::<1, 1>(ws, xs, res),
    }
}

// ---------------------------------------------------------------------------------------------
// AVX-512F

#[cfg(quant_avx512)]
pub(super) use avx512::*;

#[cfg(quant_avx512)]
mod avx512 {
    use super::*;

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(in crate::fast) unsafe fn gemv_rows_avx512(
        m: &QMatRef<'_>,
        r0: usize,
        out: &mut [f32],
        x: &[f32],
        xsum: &[f32],
    ) {
        match m.spec.bits {
            Bits::B4 => q4_gemv_avx512(m, r0, out, x, xsum),
            Bits::B8 => q8_gemv_avx512(m, r0, out, x, xsum),
        }
    }

    /// 4-bit, group size ≥ 64: 32-byte blocks (64 columns) read as sixteen 16-bit lanes;
    /// `n_k` of lane `i` is column `4i + k`, placed by `permute_x` at `x[blk*64 + 16k + i]`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q4_gemv_avx512(m: &QMatRef<'_>, r0: usize, out: &mut [f32], x: &[f32], xsum: &[f32]) {
        let cols = m.cols;
        let gs = m.spec.group_size;
        debug_assert!(gs >= 64);
        let wpr = cols / 8;
        let gpr = cols / gs;
        let bpg = gs / 64;
        let mask = _mm256_set1_epi16(0x000F);
        let xb = x.as_ptr();
        for (i, o) in out.iter_mut().enumerate() {
            let r = r0 + i;
            let w = m.packed.as_ptr().add(r * wpr) as *const __m256i;
            let sc = m.scales.as_ptr().add(r * gpr);
            let bi = m.biases.as_ptr().add(r * gpr);
            let (mut t0, mut t1, mut t2, mut t3) = (
                _mm512_setzero_ps(),
                _mm512_setzero_ps(),
                _mm512_setzero_ps(),
                _mm512_setzero_ps(),
            );
            let mut bsum = 0f32;
            for g in 0..gpr {
                let s = bf16_f32(*sc.add(g)) * HALF_SUBNORMAL_SCALE;
                bsum += bf16_f32(*bi.add(g)) * *xsum.get_unchecked(g);
                let (mut a0, mut a1, mut a2, mut a3) = (
                    _mm512_setzero_ps(),
                    _mm512_setzero_ps(),
                    _mm512_setzero_ps(),
                    _mm512_setzero_ps(),
                );
                for b in g * bpg..(g + 1) * bpg {
                    let v = _mm256_loadu_si256(w.add(b));
                    let n0 = _mm256_and_si256(v, mask);
                    let n1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                    let n2 = _mm256_and_si256(_mm256_srli_epi16(v, 8), mask);
                    let n3 = _mm256_srli_epi16(v, 12);
                    let xu = xb.add(b * 64);
                    a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(n0), _mm512_loadu_ps(xu), a0);
                    a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(n1), _mm512_loadu_ps(xu.add(16)), a1);
                    a2 = _mm512_fmadd_ps(_mm512_cvtph_ps(n2), _mm512_loadu_ps(xu.add(32)), a2);
                    a3 = _mm512_fmadd_ps(_mm512_cvtph_ps(n3), _mm512_loadu_ps(xu.add(48)), a3);
                }
                let sv = _mm512_set1_ps(s);
                t0 = _mm512_fmadd_ps(sv, a0, t0);
                t1 = _mm512_fmadd_ps(sv, a1, t1);
                t2 = _mm512_fmadd_ps(sv, a2, t2);
                t3 = _mm512_fmadd_ps(sv, a3, t3);
            }
            *o = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(t0, t1), _mm512_add_ps(t2, t3)))
                + bsum;
        }
    }

    /// 8-bit: 16 columns at a time via `vpmovzxbd`; group sizes are multiples of 32.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q8_gemv_avx512(m: &QMatRef<'_>, r0: usize, out: &mut [f32], x: &[f32], xsum: &[f32]) {
        let cols = m.cols;
        let gs = m.spec.group_size;
        let gpr = cols / gs;
        let xb = x.as_ptr();
        for (i, o) in out.iter_mut().enumerate() {
            let r = r0 + i;
            let bp = (m.packed.as_ptr() as *const u8).add(r * cols);
            let sc = m.scales.as_ptr().add(r * gpr);
            let bi = m.biases.as_ptr().add(r * gpr);
            let (mut t0, mut t1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut bsum = 0f32;
            for g in 0..gpr {
                let s = bf16_f32(*sc.add(g));
                bsum += bf16_f32(*bi.add(g)) * *xsum.get_unchecked(g);
                let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
                let mut c = g * gs;
                while c < (g + 1) * gs {
                    let q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        bp.add(c) as *const __m128i
                    )));
                    let q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        bp.add(c + 16) as *const __m128i,
                    )));
                    a0 = _mm512_fmadd_ps(q0, _mm512_loadu_ps(xb.add(c)), a0);
                    a1 = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb.add(c + 16)), a1);
                    c += 32;
                }
                let sv = _mm512_set1_ps(s);
                t0 = _mm512_fmadd_ps(sv, a0, t0);
                t1 = _mm512_fmadd_ps(sv, a1, t1);
            }
            *o = _mm512_reduce_add_ps(_mm512_add_ps(t0, t1)) + bsum;
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(in crate::fast) unsafe fn dequant_row_avx512(m: &QMatRef<'_>, r: usize, dst: &mut [f32]) {
        let cols = m.cols;
        let gs = m.spec.group_size;
        let gpr = cols / gs;
        let sc = m.scales.as_ptr().add(r * gpr);
        let bi = m.biases.as_ptr().add(r * gpr);
        let d = dst.as_mut_ptr();
        match m.spec.bits {
            Bits::B4 => {
                let w = m.packed.as_ptr().add(r * cols / 8) as *const __m256i;
                let mask = _mm256_set1_epi16(0x000F);
                let bpg = gs / 64;
                for g in 0..gpr {
                    let sv = _mm512_set1_ps(bf16_f32(*sc.add(g)) * HALF_SUBNORMAL_SCALE);
                    let bv = _mm512_set1_ps(bf16_f32(*bi.add(g)));
                    for b in g * bpg..(g + 1) * bpg {
                        let v = _mm256_loadu_si256(w.add(b));
                        let n = [
                            _mm256_and_si256(v, mask),
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                            _mm256_and_si256(_mm256_srli_epi16(v, 8), mask),
                            _mm256_srli_epi16(v, 12),
                        ];
                        for (k, nk) in n.iter().enumerate() {
                            _mm512_storeu_ps(
                                d.add(b * 64 + 16 * k),
                                _mm512_fmadd_ps(_mm512_cvtph_ps(*nk), sv, bv),
                            );
                        }
                    }
                }
            }
            Bits::B8 => {
                let bp = (m.packed.as_ptr() as *const u8).add(r * cols);
                for g in 0..gpr {
                    let sv = _mm512_set1_ps(bf16_f32(*sc.add(g)));
                    let bv = _mm512_set1_ps(bf16_f32(*bi.add(g)));
                    let mut c = g * gs;
                    while c < (g + 1) * gs {
                        let q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                            bp.add(c) as *const __m128i,
                        )));
                        _mm512_storeu_ps(d.add(c), _mm512_fmadd_ps(q, sv, bv));
                        c += 16;
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn dots_rt_avx512<const R: usize, const T: usize>(
        ws: &[&[f32]; 2],
        xs: &[&[f32]; GEMM_TOK_BLOCK],
        res: &mut [[f32; GEMM_TOK_BLOCK]; 2],
    ) {
        let cols = ws[0].len();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let wp: [*const f32; R] = std::array::from_fn(|r| ws[r].as_ptr());
        let xp: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
        let mut c = 0;
        while c < cols {
            let wv: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(wp[r].add(c)));
            for t in 0..T {
                let xv = _mm512_loadu_ps(xp[t].add(c));
                for r in 0..R {
                    acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
                }
            }
            c += 16;
        }
        for r in 0..R {
            for t in 0..T {
                res[r][t] = _mm512_reduce_add_ps(acc[r][t]);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(in crate::fast) unsafe fn dots_avx512(
        rb: usize,
        tb: usize,
        ws: &[&[f32]; 2],
        xs: &[&[f32]; GEMM_TOK_BLOCK],
        res: &mut [[f32; GEMM_TOK_BLOCK]; 2],
    ) {
        match (rb, tb) {
            (2, 4) => dots_rt_avx512::<2, 4>(ws, xs, res),
            (2, 3) => dots_rt_avx512::<2, 3>(ws, xs, res),
            (2, 2) => dots_rt_avx512::<2, 2>(ws, xs, res),
            (2, 1) => dots_rt_avx512::<2, 1>(ws, xs, res),
            (1, 4) => dots_rt_avx512::<1, 4>(ws, xs, res),
            (1, 3) => dots_rt_avx512::<1, 3>(ws, xs, res),
            (1, 2) => dots_rt_avx512::<1, 2>(ws, xs, res),
            _ => dots_rt_avx512::<1, 1>(ws, xs, res),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2 fused gemm: unpack each 8-column unit of R rows once, use it for T tokens.

/// Rows `r, r+1, .., r+R-1` × `T` tokens. `xs[t]`: token `t` (column order, `cols` values);
/// `xsum[t]`: its per-group sums; `out[t]`: the token's output row (`rows` values, written at
/// `r..r+R`). Each 8-column unit (one 4-bit word, or 8 bytes at 8 bits) of each row is
/// unpacked, converted and multiplied by its group scale once (`s·q`), then FMA'd into all `T`
/// tokens; the bias enters as `Σ_g b_g·Σx` per token. R·T accumulators (8 for 2×4) keep the
/// FMA pipes busy and each loaded `x` vector serves R rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemm_tile_avx2<const R: usize, const T: usize>(
    m: &QMatRef<'_>,
    r: usize,
    xs: [*const f32; T],
    xsum: [*const f32; T],
    out: [*mut f32; T],
) {
    let cols = m.cols;
    let gs = m.spec.group_size;
    let gpr = cols / gs;
    let upg = gs / 8; // 8-column units per group
    let four = m.spec.bits == Bits::B4;
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let m4 = _mm256_set1_epi32(0xF);
    let mut sbuf = [[0f32; GROUP_CHUNK]; R];
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut bsum = [[0f32; T]; R];
    let w4: [*const i32; R] =
        std::array::from_fn(|i| m.packed.as_ptr().add((r + i) * cols / 8) as *const i32);
    let w8: [*const u8; R] =
        std::array::from_fn(|i| (m.packed.as_ptr() as *const u8).add((r + i) * cols));
    let mut g0 = 0;
    while g0 < gpr {
        let n = (gpr - g0).min(GROUP_CHUNK);
        for i in 0..R {
            let sc = m.scales.as_ptr().add((r + i) * gpr + g0);
            let bi = m.biases.as_ptr().add((r + i) * gpr + g0);
            for t in 0..T {
                bsum[i][t] += stage_groups(sc, bi, xsum[t].add(g0), n, 1.0, &mut sbuf[i]);
            }
        }
        for j in 0..n {
            let g = g0 + j;
            for u in g * upg..(g + 1) * upg {
                let mut wv = [_mm256_setzero_ps(); R];
                for i in 0..R {
                    let q = if four {
                        _mm256_cvtepi32_ps(_mm256_and_si256(
                            _mm256_srlv_epi32(_mm256_set1_epi32(*w4[i].add(u)), shifts),
                            m4,
                        ))
                    } else {
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                            w8[i].add(u * 8) as *const __m128i
                        )))
                    };
                    wv[i] = _mm256_mul_ps(q, _mm256_broadcast_ss(&*sbuf[i].as_ptr().add(j)));
                }
                for t in 0..T {
                    let xv = _mm256_loadu_ps(xs[t].add(u * 8));
                    for i in 0..R {
                        acc[i][t] = _mm256_fmadd_ps(wv[i], xv, acc[i][t]);
                    }
                }
            }
        }
        g0 += n;
    }
    for i in 0..R {
        for t in 0..T {
            *out[t].add(r + i) = hsum256(acc[i][t]) + bsum[i][t];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2 int8-activation gemm (`super::gemm_q8act`): integer dot products per group, combined in
// f32 exactly in `reference::gemm_q8act`'s order.

/// `[Σa, Σb, Σc, Σd]` of four vectors of eight i32 (exact: the sums stay far below 2³¹).
#[inline(always)]
unsafe fn hsum4_epi32(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m128i {
    let ab = _mm256_hadd_epi32(a, b);
    let cd = _mm256_hadd_epi32(c, d);
    let abcd = _mm256_hadd_epi32(ab, cd);
    _mm_add_epi32(
        _mm256_castsi256_si128(abcd),
        _mm256_extracti128_si256(abcd, 1),
    )
}

/// Ends group `g` for `R` rows × `T ≤ 4` tokens: reduces the i32 lanes per (row, token) and
/// adds `(s·sx)·I + b·Σx` to the 4-token f32 accumulators, in the reference's order.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q8act_group_end<const R: usize, const T: usize>(
    m: &QMatRef<'_>,
    r: usize,
    g: usize,
    gpr: usize,
    acc: &[[__m256i; T]; R],
    sx4: __m128,
    xs4: __m128,
    facc: &mut [__m128; R],
) {
    let z = _mm256_setzero_si256();
    for i in 0..R {
        let a = |t: usize| if t < T { acc[i][t] } else { z };
        let isum = _mm_cvtepi32_ps(hsum4_epi32(a(0), a(1), a(2), a(3)));
        let s = bf16_f32(*m.scales.get_unchecked((r + i) * gpr + g));
        let b = bf16_f32(*m.biases.get_unchecked((r + i) * gpr + g));
        let v = _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(s), sx4), isum);
        let w = _mm_mul_ps(_mm_set1_ps(b), xs4);
        facc[i] = _mm_add_ps(facc[i], _mm_add_ps(v, w));
    }
}

#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn q8act_store<const R: usize, const T: usize>(
    r: usize,
    facc: &[__m128; R],
    out: [*mut f32; T],
) {
    for i in 0..R {
        let mut lanes = [0f32; 4];
        _mm_storeu_ps(lanes.as_mut_ptr(), facc[i]);
        for t in 0..T {
            *out[t].add(r + i) = lanes[t];
        }
    }
}

/// 4-bit: rows `r..r+R` × `T` tokens. `xs[t]`: token `t`'s int8 activations, per 32 columns 16
/// even then 16 odd; `sxt`/`xst`: `[g][tp]` scales and sums, already offset to the tile's first
/// token; `out[t]`: the token's output row.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn q4act_tile_avx2<const R: usize, const T: usize>(
    m: &QMatRef<'_>,
    r: usize,
    xs: [*const u8; T],
    sxt: *const f32,
    xst: *const f32,
    tp: usize,
    out: [*mut f32; T],
) {
    let cols = m.cols;
    let gs = m.spec.group_size;
    let gpr = cols / gs;
    let upg = gs / 32;
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let wb: [*const u8; R] =
        std::array::from_fn(|i| (m.packed.as_ptr() as *const u8).add((r + i) * cols / 2));
    let mut facc = [_mm_setzero_ps(); R];
    for g in 0..gpr {
        let mut acc = [[_mm256_setzero_si256(); T]; R];
        if upg >= 2 {
            // 64-column units: one 32-byte load per row, low nibbles = even columns,
            // high = odd; activations laid out [32 even | 32 odd] per unit.
            let mut u = g * upg / 2;
            while u < (g + 1) * upg / 2 {
                let mut lo = [_mm256_setzero_si256(); R];
                let mut hi = [_mm256_setzero_si256(); R];
                for i in 0..R {
                    let v = _mm256_loadu_si256(wb[i].add(u * 32) as *const __m256i);
                    lo[i] = _mm256_and_si256(v, m4);
                    hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                for t in 0..T {
                    let x0 = _mm256_loadu_si256(xs[t].add(u * 64) as *const __m256i);
                    let x1 = _mm256_loadu_si256(xs[t].add(u * 64 + 32) as *const __m256i);
                    for i in 0..R {
                        acc[i][t] = _mm256_add_epi16(
                            acc[i][t],
                            _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo[i], x0),
                                _mm256_maddubs_epi16(hi[i], x1),
                            ),
                        );
                    }
                }
                u += 1;
            }
        } else {
            for u in g * upg..(g + 1) * upg {
                let wv: [__m256i; R] = std::array::from_fn(|i| {
                    let v = _mm_loadu_si128(wb[i].add(u * 16) as *const __m128i);
                    let w =
                        _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
                    _mm256_and_si256(w, m4)
                });
                for t in 0..T {
                    let xv = _mm256_loadu_si256(xs[t].add(u * 32) as *const __m256i);
                    for i in 0..R {
                        acc[i][t] = _mm256_add_epi16(acc[i][t], _mm256_maddubs_epi16(wv[i], xv));
                    }
                }
            }
        }
        for row in acc.iter_mut() {
            for a in row.iter_mut() {
                *a = _mm256_madd_epi16(*a, ones);
            }
        }
        let sx4 = _mm_loadu_ps(sxt.add(g * tp));
        let xs4 = _mm_loadu_ps(xst.add(g * tp));
        q8act_group_end::<R, T>(m, r, g, gpr, &acc, sx4, xs4, &mut facc);
    }
    q8act_store::<R, T>(r, &facc, out);
}

/// 8-bit: as [`q4act_tile_avx2`], activations as i16 in column order; codes widened to i16,
/// `vpmaddwd` into i32 (no saturation: `2·255·127 < 2³¹`).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn q8act_tile_avx2<const R: usize, const T: usize>(
    m: &QMatRef<'_>,
    r: usize,
    xs: [*const i16; T],
    sxt: *const f32,
    xst: *const f32,
    tp: usize,
    out: [*mut f32; T],
) {
    let cols = m.cols;
    let gs = m.spec.group_size;
    let gpr = cols / gs;
    let wb: [*const u8; R] =
        std::array::from_fn(|i| (m.packed.as_ptr() as *const u8).add((r + i) * cols));
    let mut facc = [_mm_setzero_ps(); R];
    for g in 0..gpr {
        let mut acc = [[_mm256_setzero_si256(); T]; R];
        let mut c = g * gs;
        while c < (g + 1) * gs {
            let wv: [__m256i; R] = std::array::from_fn(|i| {
                _mm256_cvtepu8_epi16(_mm_loadu_si128(wb[i].add(c) as *const __m128i))
            });
            for t in 0..T {
                let xv = _mm256_loadu_si256(xs[t].add(c) as *const __m256i);
                for i in 0..R {
                    acc[i][t] = _mm256_add_epi32(acc[i][t], _mm256_madd_epi16(wv[i], xv));
                }
            }
            c += 16;
        }
        let sx4 = _mm_loadu_ps(sxt.add(g * tp));
        let xs4 = _mm_loadu_ps(xst.add(g * tp));
        q8act_group_end::<R, T>(m, r, g, gpr, &acc, sx4, xs4, &mut facc);
    }
    q8act_store::<R, T>(r, &facc, out);
}

/// [`crate::quantize_act_q8`] for group sizes that are multiples of 8, bit for bit: the same
/// f32 `amax` (order-free), the same left-to-right `Σx`, the same IEEE division `x / sx` and
/// round-half-even (`vroundps` nearest), the same clamp. Panics on non-finite input like it.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_act_q8_avx2(
    x: &[f32],
    gs: usize,
    xi: &mut [i8],
    sx: &mut [f32],
    xs: &mut [f32],
) {
    let absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let lim = _mm256_set1_ps(127.0);
    let nlim = _mm256_set1_ps(-127.0);
    for (g, xg) in x.chunks_exact(gs).enumerate() {
        let p = xg.as_ptr();
        let mut amax = _mm256_setzero_ps();
        let mut c = 0;
        while c < gs {
            amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(p.add(c)), absm));
            c += 8;
        }
        let a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        let a = _mm_max_ps(a, _mm_movehl_ps(a, a));
        let a = _mm_cvtss_f32(_mm_max_ss(a, _mm_shuffle_ps(a, a, 1)));
        if !a.is_finite() {
            let k = xg.iter().position(|v| !v.is_finite()).unwrap_or(0);
            panic!(
                "quantize_act_q8: non-finite value {} at index {}",
                xg[k],
                g * gs + k
            );
        }
        let mut sum = 0f32;
        for &v in xg {
            sum += v;
        }
        let s = a / 127.0;
        sx[g] = s;
        xs[g] = sum;
        let q = xi.as_mut_ptr().add(g * gs);
        if s == 0.0 {
            std::ptr::write_bytes(q, 0, gs);
            continue;
        }
        let sv = _mm256_set1_ps(s);
        let mut c = 0;
        while c < gs {
            let v = _mm256_div_ps(_mm256_loadu_ps(p.add(c)), sv);
            let r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            let r = _mm256_min_ps(_mm256_max_ps(r, nlim), lim);
            let i32s = _mm256_cvtps_epi32(r);
            let w = _mm_packs_epi32(
                _mm256_castsi256_si128(i32s),
                _mm256_extracti128_si256(i32s, 1),
            );
            let b = _mm_packs_epi16(w, w);
            _mm_storel_epi64(q.add(c) as *mut __m128i, b);
            c += 8;
        }
    }
}

/// `[Σa, …, Σh]`: the eight i32 vectors of eight consecutive groups reduced to one vector of
/// their totals, lane `k` = group `k` (exact).
#[inline(always)]
unsafe fn hsum8_epi32(v: &[__m256i; 8]) -> __m256i {
    // hadd pairs within 128-bit halves: ab = [a01 a23 b01 b23 | a45 a67 b45 b67], ...
    let ab = _mm256_hadd_epi32(v[0], v[1]);
    let cd = _mm256_hadd_epi32(v[2], v[3]);
    let ef = _mm256_hadd_epi32(v[4], v[5]);
    let gh = _mm256_hadd_epi32(v[6], v[7]);
    // [a0..3 b0..3 c0..3 d0..3 | a4..7 b4..7 c4..7 d4..7]
    let abcd = _mm256_hadd_epi32(ab, cd);
    let efgh = _mm256_hadd_epi32(ef, gh);
    _mm256_add_epi32(
        _mm256_permute2x128_si256(abcd, efgh, 0x20),
        _mm256_permute2x128_si256(abcd, efgh, 0x31),
    )
}

/// Σ of the eight i32 lanes (exact).
#[inline(always)]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// i32 lanes (summing to `Σ q·xi`) of group `g` of a 4-bit row: `UPG` units of 64 columns,
/// each one 32-byte load `v`, `v & 0xF` (even columns) × `x[0..32]` and `(v >> 4) & 0xF`
/// (odd columns) × `x[32..64]` by `vpmaddubsw` (i16 lanes ≤ `UPG·2·2·15·127 ≤ 15240`), then
/// `vpmaddwd` by 1.
#[inline(always)]
unsafe fn q4act_group<const UPG: usize>(w: *const u8, x: *const i8, g: usize) -> __m256i {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_si256();
    for uu in 0..UPG {
        let u = g * UPG + uu;
        let v = _mm256_loadu_si256(w.add(u * 32) as *const __m256i);
        let lo = _mm256_and_si256(v, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        let x0 = _mm256_loadu_si256(x.add(u * 64) as *const __m256i);
        let x1 = _mm256_loadu_si256(x.add(u * 64 + 32) as *const __m256i);
        acc = _mm256_add_epi16(
            acc,
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)),
        );
    }
    _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
}

/// How far ahead [`qact_gemv_avx2`] prefetches, in bytes of packed codes (whole rows).
const PREFETCH_BYTES: usize = 6 << 10;

/// i32 lanes (summing to `Σ q·xi`) of group `g` (`16·N` columns) of an 8-bit row: codes
/// widened to i16 (`vpmovzxbw`), activations stored as i16, `vpmaddwd` (pairs ≤ `2·255·127`).
#[inline(always)]
unsafe fn q8act_group<const N: usize>(w: *const u8, x: *const i16, g: usize) -> __m256i {
    let mut acc = _mm256_setzero_si256();
    for k in 0..N {
        let c = (g * N + k) * 16;
        let wv = _mm256_cvtepu8_epi16(_mm_loadu_si128(w.add(c) as *const __m128i));
        let xv = _mm256_loadu_si256(x.add(c) as *const __m256i);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(wv, xv));
    }
    acc
}

/// One-token int8-activation product of rows `r0..r1` ([`crate::reference::gemm_q8act`] with
/// `t = 1`, bit for bit), `out[i]` receiving row `r0 + i`; `sx`, `xs`: per group scale and
/// `Σx`. `B8 = false`: 4-bit, groups of `N·64` columns, `x` the activation codes per 64
/// columns `[32 even | 32 odd]` (i8, [`q4act_group`]); `B8 = true`: 8-bit, groups of `N·16`
/// columns, `x` the codes as i16 in column order ([`q8act_group`]).
///
/// Per row, eight groups at a time: the integer sums `I_g`, reduced by [`hsum8_epi32`]; then
/// `(s_g·sx_g)·f32(I_g) + b_g·xs_g` with lanes = groups (no FMA: each operation rounded as in
/// the reference); then the eight terms added to the row's sum in ascending order. Groups past
/// the last multiple of eight are done one at a time.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn qact_gemv_avx2<const B8: bool, const N: usize>(
    m: &QMatRef<'_>,
    r0: usize,
    r1: usize,
    x: *const u8,
    sx: *const f32,
    xs: *const f32,
    out: *mut f32,
) {
    let cols = m.cols;
    let gpr = cols / m.spec.group_size;
    let row_bytes = if B8 { cols } else { cols / 2 };
    let group = |w: *const u8, g: usize| {
        if B8 {
            q8act_group::<N>(w, x as *const i16, g)
        } else {
            q4act_group::<N>(w, x as *const i8, g)
        }
    };
    let mut terms = [0f32; 8];
    // Software prefetch of the row about PREFETCH_BYTES ahead (codes, scales, biases): the
    // hardware prefetcher alone left the 272 MiB LM head at ~23 GB/s of 2 threads here, with it
    // ~27 (gemv_speed, best of batches).
    let ahead = PREFETCH_BYTES.div_ceil(row_bytes).max(1);
    for r in r0..r1 {
        let w = (m.packed.as_ptr() as *const u8).add(r * row_bytes);
        let sc = m.scales.as_ptr().add(r * gpr);
        let bi = m.biases.as_ptr().add(r * gpr);
        if r + ahead < m.rows {
            let pw = w.add(ahead * row_bytes);
            let mut off = 0;
            while off < row_bytes {
                _mm_prefetch(pw.add(off) as *const i8, _MM_HINT_T0);
                off += 64;
            }
            _mm_prefetch(sc.add(ahead * gpr) as *const i8, _MM_HINT_T0);
            _mm_prefetch(bi.add(ahead * gpr) as *const i8, _MM_HINT_T0);
        }
        let mut acc = 0f32;
        let mut g = 0;
        while g + 8 <= gpr {
            let v: [__m256i; 8] = std::array::from_fn(|k| group(w, g + k));
            let isum = _mm256_cvtepi32_ps(hsum8_epi32(&v));
            let sv = _mm256_mul_ps(cvt8_bf16(sc.add(g)), _mm256_loadu_ps(sx.add(g)));
            let bv = _mm256_mul_ps(cvt8_bf16(bi.add(g)), _mm256_loadu_ps(xs.add(g)));
            _mm256_storeu_ps(
                terms.as_mut_ptr(),
                _mm256_add_ps(_mm256_mul_ps(sv, isum), bv),
            );
            for tv in terms {
                acc += tv;
            }
            g += 8;
        }
        while g < gpr {
            let isum = hsum_epi32(group(w, g)) as f32;
            let v = (bf16_f32(*sc.add(g)) * *sx.add(g)) * isum;
            let b = bf16_f32(*bi.add(g)) * *xs.add(g);
            acc += v + b;
            g += 1;
        }
        *out.add(r - r0) = acc;
    }
}

/// Several-token int8-activation product of one row `r` of a 4-bit matrix with groups of
/// `UPG·64` columns, for `T ≤ 8` tokens ([`crate::reference::gemm_q8act`], bit for bit).
/// `x`: token `j`'s activation codes at `x + j·cols`, per 64 columns `[32 even | 32 odd]`;
/// `sxt`, `xst`: `[groups, tp]` scales and `Σx` per group, offset to the first token (eight
/// readable lanes per group, zero past the last token); `out[j]`: token `j`'s output row.
///
/// Per group: the row's 64-column units are unpacked once (`v & 0xF`, `(v >> 4) & 0xF`) and
/// multiplied into each token's i16 accumulator (`vpmaddubsw`, ≤ `UPG·2·2·15·127` per lane);
/// then `vpmaddwd` by 1, the eight tokens' i32 vectors reduced by [`hsum8_epi32`] (lane =
/// token), and `acc += (s·sx)·f32(I) + b·xs` for eight tokens at once, each operation rounded
/// as in the reference. The row's scales and biases are widened to f32 once per 64 groups.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn q4act_row8_avx2<const UPG: usize, const T: usize>(
    m: &QMatRef<'_>,
    r: usize,
    x: *const i8,
    sxt: *const f32,
    xst: *const f32,
    tp: usize,
    out: [*mut f32; T],
) {
    let cols = m.cols;
    let gpr = cols / (64 * UPG);
    let w = (m.packed.as_ptr() as *const u8).add(r * cols / 2);
    let sc = m.scales.as_ptr().add(r * gpr);
    let bi = m.biases.as_ptr().add(r * gpr);
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut sbuf = [0f32; GROUP_CHUNK];
    let mut bbuf = [0f32; GROUP_CHUNK];
    let mut facc = _mm256_setzero_ps();
    let mut g0 = 0;
    while g0 < gpr {
        let n = (gpr - g0).min(GROUP_CHUNK);
        let mut k = 0;
        while k + 8 <= n {
            _mm256_storeu_ps(sbuf.as_mut_ptr().add(k), cvt8_bf16(sc.add(g0 + k)));
            _mm256_storeu_ps(bbuf.as_mut_ptr().add(k), cvt8_bf16(bi.add(g0 + k)));
            k += 8;
        }
        while k < n {
            sbuf[k] = bf16_f32(*sc.add(g0 + k));
            bbuf[k] = bf16_f32(*bi.add(g0 + k));
            k += 1;
        }
        for j in 0..n {
            let g = g0 + j;
            let mut acc = [_mm256_setzero_si256(); 8];
            for uu in 0..UPG {
                let u = g * UPG + uu;
                let v = _mm256_loadu_si256(w.add(u * 32) as *const __m256i);
                let lo = _mm256_and_si256(v, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                for (t, a) in acc.iter_mut().enumerate().take(T) {
                    let xp = x.add(t * cols + u * 64);
                    let x0 = _mm256_loadu_si256(xp as *const __m256i);
                    let x1 = _mm256_loadu_si256(xp.add(32) as *const __m256i);
                    *a = _mm256_add_epi16(
                        *a,
                        _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)),
                    );
                }
            }
            for a in acc.iter_mut().take(T) {
                *a = _mm256_madd_epi16(*a, ones);
            }
            let isum = _mm256_cvtepi32_ps(hsum8_epi32(&acc));
            let sv = _mm256_mul_ps(_mm256_broadcast_ss(&sbuf[j]), _mm256_loadu_ps(sxt.add(g * tp)));
            let bv = _mm256_mul_ps(_mm256_broadcast_ss(&bbuf[j]), _mm256_loadu_ps(xst.add(g * tp)));
            facc = _mm256_add_ps(facc, _mm256_add_ps(_mm256_mul_ps(sv, isum), bv));
        }
        g0 += n;
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), facc);
    for (t, o) in out.iter().enumerate() {
        *o.add(r) = lanes[t];
    }
}
