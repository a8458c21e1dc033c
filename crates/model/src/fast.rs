//! Fast twins of the [`crate::reference`] kernels that are not matrix products: the same
//! arithmetic, operation for operation and in the same order per output element (so the
//! results are **bit for bit** those of the reference), with the loops interchanged and
//! blocked so that a block of outputs stays in registers, compiled for AVX2 + FMA when the
//! CPU has them (runtime detection; no fused multiply-add is used: Rust never contracts
//! `a * b + c`).

use crate::reference as r;

/// Output columns kept in registers per block (4 AVX2 vectors).
const COL_BLOCK: usize = 32;

/// Whether the AVX2 + FMA build of the kernels can run here (decided once).
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    use std::sync::OnceLock;
    static A: OnceLock<bool> = OnceLock::new();
    *A.get_or_init(|| std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"))
}

/// `acc[j] = init(j)` then, for `m` in `0..n` ascending, `acc[j] = acc[j] ⊕ (coef(m) · row(m)[j])`
/// with `⊕` = `+` (or `−` when `SUB`), each product and sum rounded to f32, for `j` in
/// `0..acc.len()`: the order of a plain `for m { for j { acc[j] += coef(m) * row(m)[j] } }`
/// loop, with `COL_BLOCK` columns of `acc` held in registers across all `m`.
#[inline(always)]
fn accumulate<const SUB: bool>(acc: &mut [f32], n: usize, coef: impl Fn(usize) -> f32, row: impl Fn(usize) -> *const f32) {
    let len = acc.len();
    let mut j0 = 0;
    while j0 + COL_BLOCK <= len {
        let mut a = [0f32; COL_BLOCK];
        a.copy_from_slice(&acc[j0..j0 + COL_BLOCK]);
        for m in 0..n {
            let c = coef(m);
            // SAFETY: the caller's rows hold at least `acc.len()` values.
            let rm = unsafe { std::slice::from_raw_parts(row(m).add(j0), COL_BLOCK) };
            for jj in 0..COL_BLOCK {
                if SUB {
                    a[jj] -= c * rm[jj];
                } else {
                    a[jj] += c * rm[jj];
                }
            }
        }
        acc[j0..j0 + COL_BLOCK].copy_from_slice(&a);
        j0 += COL_BLOCK;
    }
    if j0 < len {
        let tail = &mut acc[j0..];
        for m in 0..n {
            let c = coef(m);
            // SAFETY: as above.
            let rm = unsafe { std::slice::from_raw_parts(row(m).add(j0), tail.len()) };
            for (a, &x) in tail.iter_mut().zip(rm) {
                if SUB {
                    *a -= c * x;
                } else {
                    *a += c * x;
                }
            }
        }
    }
}

/// [`r::gdn_chunk`], bit for bit (same shapes and meaning; `c = g.len() ≤ 64`).
///
/// Same operations per element in the same order; what changes is the loop order: every
/// `[c, ·] = [c, ·]·[·, ·]`-shaped step (the substitution for `T`, `U`, `W`, `V'`, `O`, the
/// state update) runs as [`accumulate`] over an output row, so 32 outputs stay in registers
/// while the inner dimension streams, instead of a load-modify-store per product.
///
/// # Panics
/// If `c > 64` or the slices are shorter than the shapes say.
#[allow(clippy::too_many_arguments)]
pub fn gdn_chunk(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], dk: usize, dv: usize, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { gdn_chunk_avx2(s, q, k, v, g, beta, dk, dv, o) };
    }
    gdn_chunk_body(s, q, k, v, g, beta, dk, dv, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn gdn_chunk_avx2(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], dk: usize, dv: usize, o: &mut [f32]) {
    gdn_chunk_body(s, q, k, v, g, beta, dk, dv, o)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gdn_chunk_body(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], dk: usize, dv: usize, o: &mut [f32]) {
    const MAX_C: usize = 64;
    let c = g.len();
    assert!(c <= MAX_C, "gdn_chunk: chunk of {c} tokens > {MAX_C}");
    assert!(q.len() >= c * dk && k.len() >= c * dk && v.len() >= c * dv && o.len() >= c * dv && s.len() >= dk * dv);
    // γ_r: cumulative log-decay within the chunk.
    let mut gam = [0.0f32; MAX_C];
    let mut acc = 0.0f32;
    for rr in 0..c {
        acc += g[rr];
        gam[rr] = acc;
    }
    let mut eg = [0.0f32; MAX_C];
    for m in 0..c {
        eg[m] = gam[m].exp();
    }
    // A[r, s] = -β_r (k_r·k_s) exp(γ_r − γ_s) for s < r.
    let mut t = vec![0.0f32; c * c];
    for rr in 0..c {
        for sx in 0..rr {
            t[rr * c + sx] = -(beta[rr] * r::dot(&k[rr * dk..(rr + 1) * dk], &k[sx * dk..(sx + 1) * dk])) * (gam[rr] - gam[sx]).exp();
        }
    }
    // Forward substitution: row_i[j] += Σ_m row_i[m] · T[m, j] (m ascending), j < i.
    for i in 1..c {
        let mut row = [0.0f32; MAX_C];
        row[..i].copy_from_slice(&t[i * c..i * c + i]);
        let mut add = [0.0f32; MAX_C];
        accumulate::<false>(&mut add[..i], i, |m| row[m], |m| t[m * c..].as_ptr());
        for j in 0..i {
            t[i * c + j] = row[j] + add[j];
        }
    }
    for i in 0..c {
        t[i * c + i] = 1.0;
    }
    // U = T · diag(β) V  [c, dv];  W = T · diag(β e^γ) K  [c, dk]
    let mut u = vec![0.0f32; c * dv];
    let mut w = vec![0.0f32; c * dk];
    for rr in 0..c {
        let tb = |m: usize| t[rr * c + m] * beta[m];
        accumulate::<false>(&mut u[rr * dv..(rr + 1) * dv], rr + 1, tb, |m| v[m * dv..].as_ptr());
        accumulate::<false>(&mut w[rr * dk..(rr + 1) * dk], rr + 1, |m| tb(m) * eg[m], |m| k[m * dk..].as_ptr());
    }
    // V' = U − W S
    let mut vp = u;
    for rr in 0..c {
        let wr = &w[rr * dk..(rr + 1) * dk];
        accumulate::<true>(&mut vp[rr * dv..(rr + 1) * dv], dk, |i| wr[i], |i| s[i * dv..].as_ptr());
    }
    // O = diag(e^γ) Q S + ((Q Kᵀ) ⊙ D) V': per element first the dk state terms, then the
    // r + 1 intra-chunk terms, as the reference adds them.
    let mut a = [0.0f32; MAX_C];
    for rr in 0..c {
        let qr = &q[rr * dk..(rr + 1) * dk];
        for m in 0..=rr {
            a[m] = r::dot(qr, &k[m * dk..(m + 1) * dk]) * (gam[rr] - gam[m]).exp();
        }
        let orow = &mut o[rr * dv..(rr + 1) * dv];
        orow.iter_mut().for_each(|x| *x = 0.0);
        let e = gam[rr].exp();
        accumulate::<false>(orow, dk, |i| qr[i] * e, |i| s[i * dv..].as_ptr());
        accumulate::<false>(orow, rr + 1, |m| a[m], |m| vp[m * dv..].as_ptr());
    }
    // S_out = e^{γ_C} S + (diag(e^{γ_C − γ}) K)ᵀ V': per element the decay, then the c terms.
    let gl = gam[c - 1];
    let egl = gl.exp();
    let mut f = [0.0f32; MAX_C];
    for m in 0..c {
        f[m] = (gl - gam[m]).exp();
    }
    for i in 0..dk {
        let srow = &mut s[i * dv..(i + 1) * dv];
        srow.iter_mut().for_each(|x| *x *= egl);
        accumulate::<false>(srow, c, |m| k[m * dk + i] * f[m], |m| vp[m * dv..].as_ptr());
    }
}

/// [`r::gdn_step`], bit for bit (same shapes and meaning).
///
/// Two passes over the state instead of four, per block of 32 value columns (the block's
/// `d_k × 32` slice of `s`, 16 KiB at d_k = 128, stays in L1 between them): (1) scale row `i`
/// by `alpha` and add `s[i, j]·k[i]` to `delta[j]`; then `delta = β(v − delta)`; (2) add
/// `k[i]·delta[j]` to row `i` and `s[i, j]·q[i]` to `o[j]`. Per element the operations and
/// their order are the reference's (rows ascending in both sums), so the state is read from
/// memory once and written once.
///
/// # Panics
/// If the slices are shorter than the shapes say.
pub fn gdn_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], alpha: f32, beta: f32, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { gdn_step_avx2(s, q, k, v, alpha, beta, o) };
    }
    gdn_step_body(s, q, k, v, alpha, beta, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gdn_step_avx2(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], alpha: f32, beta: f32, o: &mut [f32]) {
    gdn_step_body(s, q, k, v, alpha, beta, o)
}

#[inline(always)]
fn gdn_step_body(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], alpha: f32, beta: f32, o: &mut [f32]) {
    let (dk, dv) = (k.len(), v.len());
    assert!(s.len() >= dk * dv && q.len() >= dk && o.len() >= dv);
    let mut j0 = 0;
    while j0 < dv {
        let n = (dv - j0).min(COL_BLOCK);
        let mut delta = [0.0f32; COL_BLOCK];
        for (i, &ki) in k.iter().enumerate() {
            let row = &mut s[i * dv + j0..i * dv + j0 + n];
            for (x, d) in row.iter_mut().zip(delta.iter_mut()) {
                *x *= alpha;
                *d += *x * ki;
            }
        }
        for (d, &vj) in delta.iter_mut().zip(&v[j0..j0 + n]) {
            *d = beta * (vj - *d);
        }
        let mut acc = [0.0f32; COL_BLOCK];
        for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
            let row = &mut s[i * dv + j0..i * dv + j0 + n];
            for ((x, d), a) in row.iter_mut().zip(&delta).zip(acc.iter_mut()) {
                *x += ki * *d;
                *a += *x * qi;
            }
        }
        o[j0..j0 + n].copy_from_slice(&acc[..n]);
        j0 += n;
    }
}

/// [`r::attend`], bit for bit (same arguments and meaning): the scores use the same
/// [`r::dot`] and softmax, and `out[j] = Σ_p w_p·v_p[j]` is accumulated over positions in
/// ascending order with 32 outputs held in registers.
///
/// # Panics
/// As [`r::attend`].
pub fn attend(out: &mut [f32], q: &[f32], keys: &[f32], values: &[f32], n_ctx: usize, stride: usize, scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { attend_avx2(out, q, keys, values, n_ctx, stride, scale) };
    }
    attend_body(out, q, keys, values, n_ctx, stride, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(out: &mut [f32], q: &[f32], keys: &[f32], values: &[f32], n_ctx: usize, stride: usize, scale: f32) {
    attend_body(out, q, keys, values, n_ctx, stride, scale)
}

#[inline(always)]
fn attend_body(out: &mut [f32], q: &[f32], keys: &[f32], values: &[f32], n_ctx: usize, stride: usize, scale: f32) {
    let hd = q.len();
    assert!(n_ctx == 0 || (keys.len() >= (n_ctx - 1) * stride + hd && values.len() >= (n_ctx - 1) * stride + hd));
    let mut scores: Vec<f32> = (0..n_ctx).map(|p| r::dot(q, &keys[p * stride..p * stride + hd]) * scale).collect();
    r::softmax_inplace(&mut scores);
    out.iter_mut().for_each(|x| *x = 0.0);
    accumulate::<false>(&mut out[..hd], n_ctx, |p| scores[p], |p| values[p * stride..].as_ptr());
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rnd(rng: &mut rand_chacha::ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect()
    }

    #[test]
    fn gdn_step_equals_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        for &(dk, dv) in &[(128usize, 128usize), (16, 24), (40, 72), (128, 40), (3, 33)] {
            let mut s_ref = rnd(&mut rng, dk * dv, 0.3);
            let mut s_fast = s_ref.clone();
            for step in 0..5 {
                let mut q = rnd(&mut rng, dk, 1.0);
                let mut k = rnd(&mut rng, dk, 1.0);
                r::l2norm_inplace(&mut q, dk, 1e-6);
                r::l2norm_inplace(&mut k, dk, 1e-6);
                let v = rnd(&mut rng, dv, 1.0);
                let (alpha, beta) = (rng.random::<f32>(), rng.random::<f32>());
                let mut o_ref = vec![0.0; dv];
                let mut o_fast = vec![1.0; dv];
                r::gdn_step(&mut s_ref, &q, &k, &v, alpha, beta, &mut o_ref);
                gdn_step(&mut s_fast, &q, &k, &v, alpha, beta, &mut o_fast);
                assert!(o_ref.iter().zip(&o_fast).all(|(x, y)| x.to_bits() == y.to_bits()), "o: dk {dk} dv {dv} step {step}");
                assert!(s_ref.iter().zip(&s_fast).all(|(x, y)| x.to_bits() == y.to_bits()), "s: dk {dk} dv {dv} step {step}");
            }
        }
    }

    #[test]
    fn attend_equals_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        for &(hd, n_kv) in &[(256usize, 2usize), (256, 1), (40, 3), (16, 1)] {
            let stride = hd * n_kv;
            for &n_ctx in &[1usize, 2, 7, 64, 513] {
                let keys = rnd(&mut rng, n_ctx * stride, 2.0);
                let values = rnd(&mut rng, n_ctx * stride, 1.0);
                let q = rnd(&mut rng, hd, 1.0);
                for m in 0..n_kv {
                    let mut a = vec![0.0; hd];
                    let mut b = vec![1.0; hd];
                    r::attend(&mut a, &q, &keys[m * hd..], &values[m * hd..], n_ctx, stride, 0.0625);
                    attend(&mut b, &q, &keys[m * hd..], &values[m * hd..], n_ctx, stride, 0.0625);
                    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "hd {hd} n_kv {n_kv} ctx {n_ctx}");
                }
            }
        }
    }

    /// Bit for bit the reference, at the real head sizes (128 × 128) and at sizes with column
    /// tails (24, 40), for every chunk length around the edges, over several chunks in a row.
    #[test]
    fn gdn_chunk_equals_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for &(dk, dv) in &[(128usize, 128usize), (16, 24), (40, 72), (128, 40)] {
            for &c in &[1usize, 2, 5, 31, 32, 33, 63, 64] {
                let mut q = rnd(&mut rng, c * dk, 1.0);
                let mut k = rnd(&mut rng, c * dk, 1.0);
                r::l2norm_inplace(&mut q, dk, 1e-6);
                r::l2norm_inplace(&mut k, dk, 1e-6);
                let v = rnd(&mut rng, c * dv, 1.0);
                let g: Vec<f32> = (0..c).map(|_| -rng.random::<f32>() * 0.5).collect();
                let beta: Vec<f32> = (0..c).map(|_| rng.random::<f32>()).collect();
                let mut s_ref = rnd(&mut rng, dk * dv, 0.3);
                let mut s_fast = s_ref.clone();
                for round in 0..3 {
                    let mut o_ref = vec![0.0; c * dv];
                    let mut o_fast = vec![1.0; c * dv];
                    r::gdn_chunk(&mut s_ref, &q, &k, &v, &g, &beta, dk, dv, &mut o_ref);
                    gdn_chunk(&mut s_fast, &q, &k, &v, &g, &beta, dk, dv, &mut o_fast);
                    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same(&o_ref, &o_fast), "o differs: dk {dk} dv {dv} c {c} round {round}");
                    assert!(same(&s_ref, &s_fast), "state differs: dk {dk} dv {dv} c {c} round {round}");
                }
            }
        }
    }
}
