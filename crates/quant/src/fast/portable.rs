//! Portable kernels: plain Rust shaped for auto-vectorization.
//!
//! Column order inside a group is "code `k` of every word, for k = 0..per" (see
//! `super::permute_x`), so each unpack pass shifts every word by the same amount.

use super::GEMM_TOK_BLOCK;
use crate::{bf16_f32, QMatRef};

const LANES: usize = 8;

/// Unpacks the codes of `words` (one group) to f32, pass `k` (code `k` of each word) after
/// pass `k - 1`: `out[k·words.len() + j] = code k of words[j]`.
#[inline(always)]
fn unpack_group(words: &[u32], bits: u32, out: &mut [f32]) {
    let per = (32 / bits) as usize;
    let mask = (1u32 << bits) - 1;
    let wpg = words.len();
    for k in 0..per {
        let sh = k as u32 * bits;
        for (o, w) in out[k * wpg..(k + 1) * wpg].iter_mut().zip(words) {
            *o = ((w >> sh) & mask) as f32;
        }
    }
}

#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (ca, cb) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += ca[l] * cb[l];
        }
    }
    acc.iter().sum()
}

pub(super) fn gemv_rows(m: &QMatRef<'_>, r0: usize, out: &mut [f32], x: &[f32], xsum: &[f32]) {
    let gs = m.spec.group_size;
    let bits = m.spec.bits.bits();
    let wpr = m.spec.words_per_row(m.cols);
    let gpr = m.spec.groups_per_row(m.cols);
    let wpg = gs / m.spec.bits.per_word();
    let mut q = [0f32; 128];
    for (i, o) in out.iter_mut().enumerate() {
        let r = r0 + i;
        let words = &m.packed[r * wpr..(r + 1) * wpr];
        let mut acc = 0f32;
        for g in 0..gpr {
            let s = bf16_f32(m.scales[r * gpr + g]);
            let b = bf16_f32(m.biases[r * gpr + g]);
            unpack_group(&words[g * wpg..(g + 1) * wpg], bits, &mut q[..gs]);
            let d = dot_lanes(&q[..gs], &x[g * gs..(g + 1) * gs]);
            acc += s * d + b * xsum[g];
        }
        *o = acc;
    }
}

pub(super) fn dequant_row(m: &QMatRef<'_>, r: usize, dst: &mut [f32]) {
    let gs = m.spec.group_size;
    let bits = m.spec.bits.bits();
    let wpr = m.spec.words_per_row(m.cols);
    let gpr = m.spec.groups_per_row(m.cols);
    let wpg = gs / m.spec.bits.per_word();
    let words = &m.packed[r * wpr..(r + 1) * wpr];
    for (g, d) in dst.chunks_exact_mut(gs).enumerate() {
        let s = bf16_f32(m.scales[r * gpr + g]);
        let b = bf16_f32(m.biases[r * gpr + g]);
        unpack_group(&words[g * wpg..(g + 1) * wpg], bits, d);
        for v in d.iter_mut() {
            *v = s * *v + b;
        }
    }
}

pub(super) fn dots(
    rb: usize,
    tb: usize,
    ws: &[&[f32]; 2],
    xs: &[&[f32]; GEMM_TOK_BLOCK],
    res: &mut [[f32; GEMM_TOK_BLOCK]; 2],
) {
    for i in 0..rb {
        for j in 0..tb {
            res[i][j] = dot_lanes(ws[i], xs[j]);
        }
    }
}
