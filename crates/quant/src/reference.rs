//! Reference kernels: the definition the fast kernels are tested against.
//!
//! Plain loops: for each group, dequantize the group to f32 (`scale * q + bias`, as
//! [`crate::dequantize`]), then accumulate `w * x` in f32, left to right.

use half::bf16;

use crate::{quantize_act_q8, unpack_codes, validate, QMatRef};

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

/// `out[t, r] ≈ Σ_c W[r, c] · x[t, c]` with the activations quantized to int8 per group
/// ([`quantize_act_q8`]): the definition that [`crate::fast::gemm_q8act`] reproduces bit for bit.
///
/// Per token `t`, row `r`, with `(xi, sx, xs) = quantize_act_q8(x[t], group_size)`:
///
/// ```text
/// acc = 0
/// for g in 0..groups (ascending):
///     I   = Σ_{k in g} q[r, k] · xi[k]          // exact, i32 (|I| ≤ 255·127·128 < 2²⁴)
///     acc = acc + ((s[r,g] · sx[g]) · f32(I) + b[r,g] · xs[g])
/// out[t, r] = acc
/// ```
///
/// each `·` and `+` one f32 rounding, in exactly this order (no fused multiply-add); `f32(I)`
/// is exact.
///
/// ## Error against the exact `Σ_c W[r,c]·x[t,c]`
///
/// With `e_k = x_k − sx·xi_k`, `|e_k| ≤ ε_g := sx_g·(1/2 + 127·2⁻²⁴)` ([`quantize_act_q8`]),
/// the exact value of group `g`'s term is `C_g = s·Σ q_k x_k + b·Σ x_k
/// = s·sx·I + b·Σx_k + s·Σ q_k e_k`, so the activation rounding changes it by at most
///
/// ```text
/// |ΔC_g| ≤ |s_g| · ε_g · Σ_k q_k   ≤ |s_g| · Σ_k q_k · max|x_g| / 254 · (1 + 2⁻¹⁶)
/// ```
///
/// i.e. relative to `|s_g|·Σ_k q_k·max|x_g|` (the size the weight part of the group can reach)
/// at most `1/254`. The error is one-sided only in the worst case; on random data the `e_k`
/// are independent and the sum grows like `√gs` rather than `gs`. The f32 arithmetic adds at
/// most `γ_{groups+gs+3} · Σ_g (|s_g|·sx_g·Σ_k q_k|xi_k| + |b_g|·Σ_k |x_k|)` (`γ_n = n·u/(1−n·u)`,
/// `u = 2⁻²⁴`: `gs − 1` roundings in `xs`, three in the group term, `groups` in `acc`).
/// `tests/q8act.rs` checks `|gemm_q8act − exact| ≤ Σ_g |ΔC_g|-bound + that + the f32 gemm's
/// own bound`, computed per output from the data.
///
/// # Panics
/// If `m` fails [`validate`], `x.len() != t * cols`, `out.len() != t * rows`, or `x` holds a
/// non-finite value.
pub fn gemm_q8act(out: &mut [f32], m: QMatRef<'_>, x: &[f32], t: usize) {
    validate(&m).unwrap_or_else(|e| panic!("reference::gemm_q8act: {e}"));
    assert_eq!(x.len(), t * m.cols, "reference::gemm_q8act: x length");
    assert_eq!(out.len(), t * m.rows, "reference::gemm_q8act: out length");
    if m.rows == 0 || t == 0 {
        return;
    }
    let (rows, cols) = (m.rows, m.cols);
    let gs = m.spec.group_size;
    let wpr = m.spec.words_per_row(cols);
    let gpr = m.spec.groups_per_row(cols);
    let (xi, sx, xs) = quantize_act_q8(x, gs);
    let mut codes = vec![0u8; cols];
    for r in 0..rows {
        unpack_codes(&m.packed[r * wpr..(r + 1) * wpr], m.spec.bits, &mut codes);
        let (scales, biases) = (&m.scales[r * gpr..(r + 1) * gpr], &m.biases[r * gpr..(r + 1) * gpr]);
        for tt in 0..t {
            let g = tt * gpr..(tt + 1) * gpr;
            out[tt * rows + r] = q8act_row(&codes, scales, biases, &xi[tt * cols..(tt + 1) * cols], &sx[g.clone()], &xs[g], gs);
        }
    }
}

/// One output of [`gemm_q8act`]: row `codes` (unpacked, `[cols]`) with its per-group `scales`
/// and `biases` (`[cols / gs]`) against one token's int8 activations `xi` (`[cols]`) with
/// their group scales `sx` and sums `xs` (`[cols / gs]`): `Σ_g (s_g·sx_g)·Σ q·xi + b_g·xs_g`,
/// accumulated over groups in order. The fast path's portable fallback uses it too, so both
/// keep the same arithmetic and order.
pub(crate) fn q8act_row(codes: &[u8], scales: &[bf16], biases: &[bf16], xi: &[i8], sx: &[f32], xs: &[f32], gs: usize) -> f32 {
    let mut acc = 0f32;
    for (g, ((s, b), (sxg, xsg))) in scales.iter().zip(biases).zip(sx.iter().zip(xs)).enumerate() {
        let isum: i32 = codes[g * gs..(g + 1) * gs]
            .iter()
            .zip(&xi[g * gs..(g + 1) * gs])
            .map(|(&q, &v)| i32::from(q) * i32::from(v))
            .sum();
        let v = (s.to_f32() * sxg) * isum as f32;
        let w = b.to_f32() * xsg;
        acc += v + w;
    }
    acc
}
