//! Reference CPU ops: plain loops in f32, the definition every fast path is tested against.
//!
//! Source of the math: transformers `models/qwen3_5_moe/modeling_qwen3_5_moe.py`
//! (`Qwen3_5MoeRMSNorm`, `Qwen3_5MoeRMSNormGated`, `l2norm`, `apply_rotary_pos_emb`,
//! `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`) and docs/MODEL.md §3.
//! Layouts are row-major, outermost dimension first; shapes are given as `// [a, b]`.

/// Dot product with eight independent partial sums (fixed association, so results are
/// deterministic and the compiler can vectorise).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        let (x, y) = (&a[i * 8..i * 8 + 8], &b[i * 8..i * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU: x·σ(x).
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Softplus with PyTorch's threshold: ln(1 + eˣ), or x once x > 20.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Zero-centred RMSNorm over each row: `out = x / sqrt(mean(x²) + eps) * (1 + w)`.
/// `x`, `out`: [rows, d]; `w`: [d] (stored as a delta from 1).
pub fn zrms_norm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (o, xr) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for i in 0..d {
            o[i] = xr[i] * r * (1.0 + w[i]);
        }
    }
}

/// In-place [`zrms_norm`].
pub fn zrms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for i in 0..d {
            xr[i] = xr[i] * r * (1.0 + w[i]);
        }
    }
}

/// Gated RMSNorm of the Gated DeltaNet output, per value head: `o / rms(o) * w * silu(z)`,
/// with `w` used as stored (no +1). `o`, `z`: [rows, d_v] (o updated in place); `w`: [d_v].
pub fn gated_rms_norm(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (or, zr) in o.chunks_exact_mut(d).zip(z.chunks_exact(d)) {
        let ms = or.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for i in 0..d {
            or[i] = w[i] * (or[i] * r) * silu(zr[i]);
        }
    }
}

/// L2 normalisation with the epsilon inside the sum: `x / sqrt(Σx² + eps)`, per row of `d`.
pub fn l2norm_inplace(x: &mut [f32], d: usize, eps: f32) {
    for r in x.chunks_exact_mut(d) {
        let s = r.iter().map(|v| v * v).sum::<f32>();
        let inv = 1.0 / (s + eps).sqrt();
        r.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Softmax in place over the whole slice (max-subtracted, f32).
pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// RoPE inverse frequencies for rotate-half partial rotary: `theta^(-2i/rot)`, i < rot/2,
/// rounded to f32 as transformers' `default` rope init does.
pub fn rope_inv_freq(theta: f64, rot: usize) -> Vec<f32> {
    (0..rot / 2).map(|i| (1.0 / theta.powf((2 * i) as f64 / rot as f64)) as f32).collect()
}

/// Applies rotate-half RoPE at position `pos` to the first `2 * inv_freq.len()` dims of each
/// head in `x` ([n_heads, head_dim]); the rest pass through. Angles are `pos · inv_freq` in f32.
pub fn rope_inplace(x: &mut [f32], head_dim: usize, inv_freq: &[f32], pos: usize) {
    let half = inv_freq.len();
    for h in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let ang = pos as f32 * inv_freq[i];
            let (s, c) = ang.sin_cos();
            let (a, b) = (h[i], h[i + half]);
            h[i] = a * c - b * s;
            h[i + half] = b * c + a * s;
        }
    }
}

/// Causal depthwise conv1d + SiLU over new inputs, continuing from cached inputs.
///
/// `window`: [k - 1 + t, channels], the cached k-1 pre-conv rows (oldest first) followed by the
/// t new rows; `w`: [channels, k] (tap k-1 multiplies the current token); `out`: [t, channels].
pub fn causal_conv_silu(out: &mut [f32], window: &[f32], w: &[f32], channels: usize, k: usize) {
    let t = out.len() / channels;
    for tt in 0..t {
        for c in 0..channels {
            let mut acc = 0.0f32;
            for j in 0..k {
                acc += w[c * k + j] * window[(tt + j) * channels + c];
            }
            out[tt * channels + c] = silu(acc);
        }
    }
}

/// One Gated DeltaNet step for one value head (MODEL.md §3.5 Step 6, the decode form):
/// S ← αS; δ = β(v − Sᵀk); S ← S + k δᵀ; o = Sᵀq.
///
/// `s`: [d_k, d_v] (row = key dim), `q`/`k`: [d_k] (already L2-normed, q scaled), `v`: [d_v],
/// `o`: [d_v].
pub fn gdn_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], alpha: f32, beta: f32, o: &mut [f32]) {
    let dv = v.len();
    s.iter_mut().for_each(|x| *x *= alpha);
    // r[j] = Σ_i S[i, j] k[i]
    let mut delta = vec![0.0f32; dv];
    for (i, &ki) in k.iter().enumerate() {
        let row = &s[i * dv..(i + 1) * dv];
        for j in 0..dv {
            delta[j] += row[j] * ki;
        }
    }
    for j in 0..dv {
        delta[j] = beta * (v[j] - delta[j]);
    }
    for (i, &ki) in k.iter().enumerate() {
        let row = &mut s[i * dv..(i + 1) * dv];
        for j in 0..dv {
            row[j] += ki * delta[j];
        }
    }
    o.iter_mut().for_each(|x| *x = 0.0);
    for (i, &qi) in q.iter().enumerate() {
        let row = &s[i * dv..(i + 1) * dv];
        for j in 0..dv {
            o[j] += row[j] * qi;
        }
    }
}

/// Chunked Gated DeltaNet for one value head over one chunk of `c` tokens (MODEL.md §3.5
/// Step 7; transformers `torch_chunk_gated_delta_rule`). Mathematically equal to `c`
/// applications of [`gdn_step`].
///
/// `s`: [d_k, d_v] state entering the chunk, updated to the state leaving it;
/// `q`, `k`: [c, d_k] (normed, q scaled); `v`: [c, d_v]; `g`: [c] log-decays; `beta`: [c];
/// `o`: [c, d_v].
#[allow(clippy::too_many_arguments)]
pub fn gdn_chunk(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dk: usize,
    dv: usize,
    o: &mut [f32],
) {
    let c = g.len();
    // γ_r: cumulative log-decay within the chunk.
    let mut gam = vec![0.0f32; c];
    let mut acc = 0.0f32;
    for r in 0..c {
        acc += g[r];
        gam[r] = acc;
    }
    // A[r, s] = -β_r (k_r·k_s) exp(γ_r − γ_s) for s < r; then T = (I - A_strict)^-1 by forward
    // substitution, following the reference's row recurrence.
    let mut t = vec![0.0f32; c * c];
    for r in 0..c {
        for sx in 0..r {
            t[r * c + sx] = -(beta[r] * dot(&k[r * dk..(r + 1) * dk], &k[sx * dk..(sx + 1) * dk]))
                * (gam[r] - gam[sx]).exp();
        }
    }
    for i in 1..c {
        // row_i[j] += Σ_m row_i[m] · T[m, j] for j < i (T rows m < i already final).
        let row: Vec<f32> = t[i * c..i * c + i].to_vec();
        for j in 0..i {
            let mut add = 0.0f32;
            for m in 0..i {
                add += row[m] * t[m * c + j];
            }
            t[i * c + j] = row[j] + add;
        }
    }
    for i in 0..c {
        t[i * c + i] = 1.0;
    }
    // U = T · diag(β) V  [c, dv];  W = T · diag(β e^γ) K  [c, dk]
    let mut u = vec![0.0f32; c * dv];
    let mut w = vec![0.0f32; c * dk];
    for r in 0..c {
        for m in 0..=r {
            let tb = t[r * c + m] * beta[m];
            let tbg = tb * gam[m].exp();
            for j in 0..dv {
                u[r * dv + j] += tb * v[m * dv + j];
            }
            for j in 0..dk {
                w[r * dk + j] += tbg * k[m * dk + j];
            }
        }
    }
    // V' = U − W S
    let mut vp = u;
    for r in 0..c {
        for i in 0..dk {
            let wi = w[r * dk + i];
            let srow = &s[i * dv..(i + 1) * dv];
            for j in 0..dv {
                vp[r * dv + j] -= wi * srow[j];
            }
        }
    }
    // O = diag(e^γ) Q S + ((Q Kᵀ) ⊙ D) V'
    for r in 0..c {
        let orow = &mut o[r * dv..(r + 1) * dv];
        orow.iter_mut().for_each(|x| *x = 0.0);
        let eg = gam[r].exp();
        for i in 0..dk {
            let qi = q[r * dk + i] * eg;
            let srow = &s[i * dv..(i + 1) * dv];
            for j in 0..dv {
                orow[j] += qi * srow[j];
            }
        }
        for m in 0..=r {
            let a = dot(&q[r * dk..(r + 1) * dk], &k[m * dk..(m + 1) * dk]) * (gam[r] - gam[m]).exp();
            for j in 0..dv {
                orow[j] += a * vp[m * dv + j];
            }
        }
    }
    // S_out = e^{γ_C} S + (diag(e^{γ_C − γ}) K)ᵀ V'
    let gl = gam[c - 1];
    let egl = gl.exp();
    s.iter_mut().for_each(|x| *x *= egl);
    for m in 0..c {
        let f = (gl - gam[m]).exp();
        for i in 0..dk {
            let kf = k[m * dk + i] * f;
            let srow = &mut s[i * dv..(i + 1) * dv];
            for j in 0..dv {
                srow[j] += kf * vp[m * dv + j];
            }
        }
    }
}

/// Causal attention for one query head against cached keys/values of its KV head.
///
/// `q`: [head_dim]; `keys`, `values`: [n_ctx, head_dim] strided by `stride` floats per
/// position; only positions `0..n_ctx` are read (the caller passes n_ctx = position + 1).
/// `out`: [head_dim]. Scores are scaled by `scale` and softmaxed in f32.
pub fn attend(out: &mut [f32], q: &[f32], keys: &[f32], values: &[f32], n_ctx: usize, stride: usize, scale: f32) {
    let hd = q.len();
    let mut scores: Vec<f32> = (0..n_ctx).map(|p| dot(q, &keys[p * stride..p * stride + hd]) * scale).collect();
    softmax_inplace(&mut scores);
    out.iter_mut().for_each(|x| *x = 0.0);
    for (p, &w) in scores.iter().enumerate() {
        let vr = &values[p * stride..p * stride + hd];
        for j in 0..hd {
            out[j] += w * vr[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rnd(rng: &mut rand_chacha::ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect()
    }

    /// The chunked form equals token-by-token steps, for chunk lengths around the edges.
    #[test]
    fn chunk_equals_steps() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (dk, dv) = (16, 24);
        for &c in &[1usize, 2, 5, 63, 64] {
            let mut q = rnd(&mut rng, c * dk, 1.0);
            let mut k = rnd(&mut rng, c * dk, 1.0);
            l2norm_inplace(&mut q, dk, 1e-6);
            l2norm_inplace(&mut k, dk, 1e-6);
            let v = rnd(&mut rng, c * dv, 1.0);
            let g: Vec<f32> = (0..c).map(|_| -rng.random::<f32>() * 0.5).collect();
            let beta: Vec<f32> = (0..c).map(|_| rng.random::<f32>()).collect();
            let s0 = rnd(&mut rng, dk * dv, 0.3);
            let mut s_step = s0.clone();
            let mut o_step = vec![0.0; c * dv];
            for t in 0..c {
                gdn_step(
                    &mut s_step,
                    &q[t * dk..(t + 1) * dk],
                    &k[t * dk..(t + 1) * dk],
                    &v[t * dv..(t + 1) * dv],
                    g[t].exp(),
                    beta[t],
                    &mut o_step[t * dv..(t + 1) * dv],
                );
            }
            let mut s_chunk = s0.clone();
            let mut o_chunk = vec![0.0; c * dv];
            gdn_chunk(&mut s_chunk, &q, &k, &v, &g, &beta, dk, dv, &mut o_chunk);
            let e_o = o_step.iter().zip(&o_chunk).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            let e_s = s_step.iter().zip(&s_chunk).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(e_o < 1e-4 && e_s < 1e-4, "c={c}: output err {e_o}, state err {e_s}");
        }
    }

    #[test]
    fn rope_rotates_pairs_half_apart() {
        let inv = rope_inv_freq(1e7, 4);
        let mut x = vec![1.0, 0.0, 0.0, 0.0, 5.0, 6.0];
        rope_inplace(&mut x, 6, &inv, 1);
        // Pair (0, 2) rotates by angle inv[0] = 1 rad; dims 4, 5 pass through.
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
        assert_eq!(&x[4..], &[5.0, 6.0]);
    }
}
