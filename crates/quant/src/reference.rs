//! Reference kernels: the definition the fast kernels are tested against.
//!
//! Plain loops: for each group, dequantize the group to f32 (`scale * q + bias`, as
//! [`crate::dequantize`]), then accumulate `w * x` in f32, left to right.

use crate::{unpack_codes, validate, QMatRef};

/// `out[r] = Σ_c W[r, c] · x[c]`: quantized matrix `[rows, cols]` times vector `[cols]`.
///
/// # Panics
/// If `m` fails [`validate`], `x.len() != cols` or `out.len() != rows`.
pub fn gemv(out: &mut [f32], m: QMatRef<'_>, x: &[f32]) {
    validate(&m).unwrap_or_else(|e| panic!("reference::gemv: {e}"));
    assert_eq!(x.len(), m.cols, "reference::gemv: x length");
    assert_eq!(out.len(), m.rows, "reference::gemv: out length");
    let gs = m.spec.group_size;
    let wpr = m.spec.words_per_row(m.cols);
    let gpr = m.spec.groups_per_row(m.cols);
    let mut codes = vec![0u8; m.cols];
    let mut wg = vec![0f32; gs];
    for (r, o) in out.iter_mut().enumerate() {
        // codes of row r, column order
        unpack_codes(&m.packed[r * wpr..(r + 1) * wpr], m.spec.bits, &mut codes);
        let mut acc = 0f32;
        for g in 0..gpr {
            let s = m.scales[r * gpr + g].to_f32();
            let b = m.biases[r * gpr + g].to_f32();
            // dequantize the group
            for (k, w) in wg.iter_mut().enumerate() {
                *w = s * f32::from(codes[g * gs + k]) + b;
            }
            // dot in f32
            for (k, w) in wg.iter().enumerate() {
                acc += w * x[g * gs + k];
            }
        }
        *o = acc;
    }
}

/// `out[t, r] = Σ_c W[r, c] · x[t, c]` for `t` tokens: `x` is `[t, cols]`, `out` is `[t, rows]`,
/// both row-major. One [`gemv`] per token.
///
/// # Panics
/// If `m` fails [`validate`], `x.len() != t * cols` or `out.len() != t * rows`.
pub fn gemm(out: &mut [f32], m: QMatRef<'_>, x: &[f32], t: usize) {
    validate(&m).unwrap_or_else(|e| panic!("reference::gemm: {e}"));
    assert_eq!(x.len(), t * m.cols, "reference::gemm: x length");
    assert_eq!(out.len(), t * m.rows, "reference::gemm: out length");
    if m.rows == 0 {
        return;
    }
    for (o, xt) in out.chunks_exact_mut(m.rows).zip(x.chunks_exact(m.cols)) {
        gemv(o, m, xt);
    }
}
