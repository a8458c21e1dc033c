//! aarch64 NEON gemv (natural column order; gemm uses the portable dequant + dots).
//!
//! NOTE: written against the `core::arch::aarch64` API but not compiled or run in this
//! project's CI, which is x86_64 only. The tests run it wherever they run on aarch64.

use crate::{bf16_f32, Bits, QMatRef};
use core::arch::aarch64::*;

#[target_feature(enable = "neon")]
pub(super) unsafe fn gemv_rows(
    m: &QMatRef<'_>,
    r0: usize,
    out: &mut [f32],
    x: &[f32],
    xsum: &[f32],
) {
    match m.spec.bits {
        Bits::B4 => q4(m, r0, out, x, xsum),
        Bits::B8 => q8(m, r0, out, x, xsum),
    }
}

/// Widens 16 codes (u8) to four f32x4 and accumulates them times `x[0..16]`.
#[inline(always)]
unsafe fn fma16(e: uint8x16_t, xp: *const f32, a0: &mut float32x4_t, a1: &mut float32x4_t) {
    let lo = vmovl_u8(vget_low_u8(e));
    let hi = vmovl_high_u8(e);
    let f0 = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
    let f1 = vcvtq_f32_u32(vmovl_high_u16(lo));
    let f2 = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
    let f3 = vcvtq_f32_u32(vmovl_high_u16(hi));
    *a0 = vfmaq_f32(*a0, f0, vld1q_f32(xp));
    *a1 = vfmaq_f32(*a1, f1, vld1q_f32(xp.add(4)));
    *a0 = vfmaq_f32(*a0, f2, vld1q_f32(xp.add(8)));
    *a1 = vfmaq_f32(*a1, f3, vld1q_f32(xp.add(12)));
}

/// 4-bit: byte `j` of a row holds columns `2j` (low nibble) and `2j+1` (high nibble);
/// `zip(lo, hi)` restores column order.
#[target_feature(enable = "neon")]
unsafe fn q4(m: &QMatRef<'_>, r0: usize, out: &mut [f32], x: &[f32], xsum: &[f32]) {
    let cols = m.cols;
    let gs = m.spec.group_size;
    let gpr = cols / gs;
    let xb = x.as_ptr();
    let mask = vdupq_n_u8(0x0F);
    for (i, o) in out.iter_mut().enumerate() {
        let r = r0 + i;
        let bp = (m.packed.as_ptr() as *const u8).add(r * cols / 2);
        let mut t0 = vdupq_n_f32(0.0);
        let mut t1 = vdupq_n_f32(0.0);
        let mut bsum = 0f32;
        for g in 0..gpr {
            let s = bf16_f32(m.scales[r * gpr + g]);
            bsum += bf16_f32(m.biases[r * gpr + g]) * xsum[g];
            let mut a0 = vdupq_n_f32(0.0);
            let mut a1 = vdupq_n_f32(0.0);
            let mut c = g * gs;
            while c < (g + 1) * gs {
                let v = vld1q_u8(bp.add(c / 2));
                let lo = vandq_u8(v, mask);
                let hi = vshrq_n_u8::<4>(v);
                fma16(vzip1q_u8(lo, hi), xb.add(c), &mut a0, &mut a1);
                fma16(vzip2q_u8(lo, hi), xb.add(c + 16), &mut a0, &mut a1);
                c += 32;
            }
            let sv = vdupq_n_f32(s);
            t0 = vfmaq_f32(t0, sv, a0);
            t1 = vfmaq_f32(t1, sv, a1);
        }
        *o = vaddvq_f32(vaddq_f32(t0, t1)) + bsum;
    }
}

/// 8-bit: byte `c` of a row is column `c`.
#[target_feature(enable = "neon")]
unsafe fn q8(m: &QMatRef<'_>, r0: usize, out: &mut [f32], x: &[f32], xsum: &[f32]) {
    let cols = m.cols;
    let gs = m.spec.group_size;
    let gpr = cols / gs;
    let xb = x.as_ptr();
    for (i, o) in out.iter_mut().enumerate() {
        let r = r0 + i;
        let bp = (m.packed.as_ptr() as *const u8).add(r * cols);
        let mut t0 = vdupq_n_f32(0.0);
        let mut t1 = vdupq_n_f32(0.0);
        let mut bsum = 0f32;
        for g in 0..gpr {
            let s = bf16_f32(m.scales[r * gpr + g]);
            bsum += bf16_f32(m.biases[r * gpr + g]) * xsum[g];
            let mut a0 = vdupq_n_f32(0.0);
            let mut a1 = vdupq_n_f32(0.0);
            let mut c = g * gs;
            while c < (g + 1) * gs {
                fma16(vld1q_u8(bp.add(c)), xb.add(c), &mut a0, &mut a1);
                c += 16;
            }
            let sv = vdupq_n_f32(s);
            t0 = vfmaq_f32(t0, sv, a0);
            t1 = vfmaq_f32(t1, sv, a1);
        }
        *o = vaddvq_f32(vaddq_f32(t0, t1)) + bsum;
    }
}
