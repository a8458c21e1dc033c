//! int8-activation gemm: fast against reference (bit for bit, every level), reference against
//! the exact product (within the activation-rounding bound computed per output from the data).

mod common;

use common::*;
use quant::fast::{self, Level};
use quant::{quantize_act_q8, reference, Bits, QMat};

const U: f64 = 1.0 / 16_777_216.0; // 2⁻²⁴

fn check_fast_bitwise(m: &QMat, x: &[f32], t: usize, what: &str) {
    let mut want = vec![f32::NAN; t * m.rows];
    reference::gemm_q8act(&mut want, m.as_ref(), x, t);
    for level in Level::available() {
        let mut got = vec![f32::NAN; t * m.rows];
        fast::gemm_q8act_with(level, &mut got, m.as_ref(), x, t);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                a.to_bits() == b.to_bits(),
                "{what} t={t} {}: token {} row {}: fast {a:e} != reference {b:e}",
                level.name(),
                i / m.rows,
                i % m.rows
            );
        }
    }
    let mut got = vec![f32::NAN; t * m.rows];
    fast::gemm_q8act(&mut got, m.as_ref(), x, t);
    assert!(got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Activations with a spread of group maxima (some groups tiny, some large, an all-zero one).
fn activations(rng: &mut Rng, t: usize, cols: usize, gs: usize) -> Vec<f32> {
    let mut x = rng.normal_vec(t * cols, 1.0);
    for (i, g) in x.chunks_exact_mut(gs).enumerate() {
        let f = match i % 5 {
            0 => 1.0,
            1 => 30.0,
            2 => 1e-3,
            3 if i % 10 == 3 => 0.0,
            _ => 0.5,
        };
        for v in g {
            *v *= f;
        }
    }
    x
}

#[test]
fn fast_equals_reference_real_dims() {
    let mut rng = Rng::new(11);
    for (bits, gs) in [(Bits::B4, 64), (Bits::B8, 64)] {
        for (rows, cols) in [(512, 2048), (2048, 512), (8192, 2048), (2048, 2048)] {
            let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
            for t in [1, 7, 64] {
                let x = activations(&mut rng, t, cols, gs);
                check_fast_bitwise(&m, &x, t, &format!("{rows}x{cols} {bits:?} g{gs}"));
            }
        }
    }
}

#[test]
fn fast_equals_reference_edge_sizes() {
    let mut rng = Rng::new(12);
    for bits in [Bits::B4, Bits::B8] {
        for gs in [32, 64, 128] {
            for rows in [1, 2, 3, 17, 33] {
                for cols in [gs, 2 * gs, 3 * gs, 5 * gs] {
                    let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
                    for t in [1, 2, 3, 4, 5, 9] {
                        let x = activations(&mut rng, t, cols, gs);
                        check_fast_bitwise(&m, &x, t, &format!("{rows}x{cols} {bits:?} g{gs}"));
                    }
                }
            }
        }
    }
}

#[test]
#[allow(clippy::needless_range_loop)]
fn extreme_codes_do_not_saturate() {
    // All codes at the maximum and activations at ±max: the largest i16/i32 partial sums.
    let mut rng = Rng::new(13);
    for bits in [Bits::B4, Bits::B8] {
        for gs in [32, 64, 128] {
            let (rows, cols, t) = (5, 4 * gs, 6);
            let mut m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
            m.packed.iter_mut().for_each(|w| *w = u32::MAX);
            for sign in [1.0f32, -1.0] {
                let x = vec![sign * 3.0; t * cols];
                check_fast_bitwise(&m, &x, t, &format!("saturation {bits:?} g{gs} sign {sign}"));
                // and it is the exact integer sum: q = n, xi = ±127 everywhere
                let mut got = vec![0f32; t * rows];
                fast::gemm_q8act(&mut got, m.as_ref(), &x, t);
                let n = bits_max(bits) as f64;
                for r in 0..rows {
                    let want: f64 = (0..cols / gs)
                        .map(|g| {
                            let (s, b) = m.as_ref().scale_bias(r, g * gs);
                            let sx = (3.0f32 / 127.0) as f64;
                            s as f64 * sx * (sign as f64 * 127.0 * n * gs as f64)
                                + b as f64 * sign as f64 * 3.0 * gs as f64
                        })
                        .sum();
                    let tol = 1e-5 * want.abs().max(1.0);
                    assert!(
                        ((got[r] as f64) - want).abs() <= tol,
                        "{bits:?} g{gs}: {} vs {want}",
                        got[r]
                    );
                }
            }
        }
    }
}

fn bits_max(b: Bits) -> u32 {
    b.max_code()
}

#[test]
fn quantize_act_rules() {
    let (xi, sx, xs) = quantize_act_q8(&[0.0; 64], 32);
    assert!(xi.iter().all(|&v| v == 0) && sx == [0.0, 0.0] && xs == [0.0, 0.0]);
    // half-even: 127 * 0.5/127 ... construct values at exactly k + 0.5 code units
    let mut x = vec![0f32; 32];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = 3.5;
    x[3] = -2.5;
    x[4] = -127.0;
    let (xi, sx, xs) = quantize_act_q8(&x, 32);
    assert_eq!(sx, [1.0]);
    assert_eq!(&xi[..5], &[127, 2, 4, -2, -127]);
    assert_eq!(xs, [2.5 + 3.5 - 2.5]);
    // reconstruction bound
    let mut rng = Rng::new(14);
    let x = rng.normal_vec(64 * 100, 2.0);
    let (xi, sx, _) = quantize_act_q8(&x, 64);
    for (g, xg) in x.chunks_exact(64).enumerate() {
        let eps = sx[g] as f64 * (0.5 + 127.0 * U);
        for (k, &v) in xg.iter().enumerate() {
            let e = (v as f64 - sx[g] as f64 * xi[g * 64 + k] as f64).abs();
            assert!(e <= eps, "group {g} k {k}: {e:e} > {eps:e}");
        }
    }
}

/// Reference q8act against the exact product (f64 from the f32 data), and against the f32
/// reference gemm, with the bound of `reference::gemm_q8act`'s docs computed per output.
#[test]
fn reference_within_activation_rounding_bound() {
    let mut rng = Rng::new(15);
    for (bits, gs) in [
        (Bits::B4, 64),
        (Bits::B8, 64),
        (Bits::B4, 32),
        (Bits::B8, 128),
    ] {
        for (rows, cols) in [(64, 2048), (128, 512)] {
            let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
            let mr = m.as_ref();
            let t = 7;
            let x = activations(&mut rng, t, cols, gs);
            let mut q8 = vec![0f32; t * rows];
            reference::gemm_q8act(&mut q8, mr, &x, t);
            let mut f32g = vec![0f32; t * rows];
            reference::gemm(&mut f32g, mr, &x, t);
            let (xi, sx, _) = quantize_act_q8(&x, gs);
            let gpr = cols / gs;
            let (mut worst_rel, mut mean_ratio, mut n) = (0f64, 0f64, 0usize);
            for tt in 0..t {
                let xt = &x[tt * cols..(tt + 1) * cols];
                let mags = magnitudes(&m, xt);
                for r in 0..rows {
                    let mut exact = 0f64;
                    let mut act = 0f64; // Σ_g |s|·ε_g·Σq
                    let mut mq = 0f64; // Σ_g |s|·sx·Σ q|xi| + |b|·Σ|x|
                    for g in 0..gpr {
                        let (s, b) = mr.scale_bias(r, g * gs);
                        let (s, b) = (s as f64, b as f64);
                        let sxg = sx[tt * gpr + g] as f64;
                        let (mut sq, mut sqxi, mut sax) = (0f64, 0f64, 0f64);
                        for k in g * gs..(g + 1) * gs {
                            let q = mr.code(r, k) as f64;
                            let xv = xt[k] as f64;
                            exact += (s * q + b) * xv;
                            sq += q;
                            sqxi += q * (xi[tt * cols + k] as f64).abs();
                            sax += xv.abs();
                        }
                        act += s.abs() * sxg * (0.5 + 127.0 * U) * sq;
                        mq += s.abs() * sxg * sqxi + b.abs() * sax;
                    }
                    let round = gamma(gpr + gs + 3) * mq;
                    let tol = act + round + f64::from(f32::MIN_POSITIVE);
                    let got = q8[tt * rows + r] as f64;
                    let err = (got - exact).abs();
                    assert!(
                        err <= tol,
                        "{bits:?} g{gs} {rows}x{cols} tok {tt} row {r}: q8 {got:e} vs exact {exact:e}: {err:e} > {tol:e}"
                    );
                    // and against the f32 reference gemm (its own Higham bound added)
                    let tol2 = tol + gamma(cols + 4) * mags[r];
                    let err2 = (got - f32g[tt * rows + r] as f64).abs();
                    assert!(err2 <= tol2, "vs f32 gemm: {err2:e} > {tol2:e}");
                    worst_rel = worst_rel.max(err / tol);
                    mean_ratio += err / tol;
                    n += 1;
                }
            }
            eprintln!(
                "{bits:?} g{gs} {rows}x{cols}: |q8 − exact| / bound: max {worst_rel:.3}, mean {:.4}",
                mean_ratio / n as f64
            );
        }
    }
}

#[test]
fn zero_tokens_and_rows() {
    let mut rng = Rng::new(16);
    let m = random_qmat(&mut rng, 4, 64, spec(Bits::B4, 64));
    for level in Level::available() {
        fast::gemm_q8act_with(level, &mut [], m.as_ref(), &[], 0);
    }
    let m0 = random_qmat(&mut rng, 0, 64, spec(Bits::B8, 64));
    let x = vec![1.0; 64 * 3];
    for level in Level::available() {
        fast::gemm_q8act_with(level, &mut [], m0.as_ref(), &x, 3);
    }
}

/// The fast kernel's own activation quantizer must match `quantize_act_q8` exactly; checked
/// through the kernel on data with ties (x = k + 0.5 code units) and tiny / huge groups.
#[test]
fn fast_quantizer_matches_on_ties() {
    let mut rng = Rng::new(17);
    for bits in [Bits::B4, Bits::B8] {
        for gs in [32, 64, 128] {
            let cols = 4 * gs;
            let t = 5;
            let mut x = vec![0f32; t * cols];
            for (i, v) in x.iter_mut().enumerate() {
                // group max 127 → sx = 1, values at exact half codes
                *v = if i % gs == 0 {
                    127.0
                } else {
                    (rng.below(255) as f32 - 127.0) + 0.5
                };
                if i / gs % 4 == 1 {
                    *v *= 1e-30;
                }
                if i / gs % 4 == 2 {
                    *v *= 1e30;
                }
            }
            let m = random_qmat(&mut rng, 9, cols, spec(bits, gs));
            check_fast_bitwise(&m, &x, t, &format!("ties {bits:?} g{gs}"));
        }
    }
}

/// One token (the decode kernel for 4-bit with groups of 64 / 128, the tile kernel otherwise):
/// the model's shapes, the LM head (248 320 rows), odd row counts, and group counts that are
/// not multiples of 8 (the kernel's 8-group step plus every tail length).
#[test]
fn one_token_equals_reference() {
    let mut rng = Rng::new(18);
    for (bits, gs) in [(Bits::B4, 64), (Bits::B4, 128), (Bits::B8, 64), (Bits::B4, 32)] {
        let shapes = [
            (512, 2048),
            (2048, 512),
            (8192, 2048),
            (4096, 2048),
            (2048, 4096),
            (256, 2048),
            (32, 2048),
            (1, 2048),
            (1001, 2048),
        ];
        for (rows, cols) in shapes {
            let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
            let x = activations(&mut rng, 1, cols, gs);
            check_fast_bitwise(&m, &x, 1, &format!("{rows}x{cols} {bits:?} g{gs}"));
        }
        for groups in 1..=19 {
            for rows in [1, 2, 3, 5, 33, 65] {
                let cols = groups * gs;
                let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
                let x = activations(&mut rng, 1, cols, gs);
                check_fast_bitwise(&m, &x, 1, &format!("{rows}x{cols} {bits:?} g{gs}"));
            }
        }
    }
}

/// The LM head at its real size, one token.
#[test]
fn one_token_lm_head_equals_reference() {
    let mut rng = Rng::new(19);
    let m = random_qmat(&mut rng, 248_320, 2048, spec(Bits::B4, 64));
    let x = activations(&mut rng, 1, 2048, 64);
    check_fast_bitwise(&m, &x, 1, "lm_head 248320x2048 B4 g64");
}

/// A batch (shared activations, different token counts, empty jobs) equals the reference
/// product by product, bit for bit, and a `QAct` is reusable across quantizations.
#[test]
fn batch_and_prepared_equal_reference() {
    let mut rng = Rng::new(20);
    for (bits, gs) in [(Bits::B4, 64), (Bits::B8, 64), (Bits::B4, 128), (Bits::B4, 32)] {
        let sp = spec(bits, gs);
        for level in Level::available() {
            let mats: Vec<QMat> = [(512, 2048), (512, 2048), (3, 2048), (2048, 512), (0, 2048)]
                .iter()
                .map(|&(r, c)| random_qmat(&mut rng, r, c, sp))
                .collect();
            let mut qa_wide = fast::QAct::new();
            let mut qa_narrow = fast::QAct::new();
            // Quantize twice into the same buffers: the second (different size) must win.
            for &(t_w, t_n) in &[(5usize, 2usize), (1, 1)] {
                let xw = activations(&mut rng, t_w, 2048, gs);
                let xn = activations(&mut rng, t_n, 512, gs);
                qa_wide.quantize_with(level, &xw, t_w, 2048, sp);
                qa_narrow.quantize_with(level, &xn, t_n, 512, sp);
                let inputs: Vec<(&QMat, &fast::QAct, &[f32], usize)> = vec![
                    (&mats[0], &qa_wide, &xw, t_w),
                    (&mats[1], &qa_wide, &xw, t_w),
                    (&mats[2], &qa_wide, &xw, t_w),
                    (&mats[3], &qa_narrow, &xn, t_n),
                    (&mats[4], &qa_wide, &xw, t_w),
                ];
                let mut outs: Vec<Vec<f32>> =
                    inputs.iter().map(|(m, _, _, t)| vec![f32::NAN; t * m.rows]).collect();
                let mut jobs: Vec<fast::Q8Job<'_>> = inputs
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|((m, qa, _, _), o)| fast::Q8Job { m: m.as_ref(), x: qa, out: o })
                    .collect();
                fast::gemm_q8act_batch(&mut jobs);
                for (i, ((m, _, x, t), got)) in inputs.iter().zip(&outs).enumerate() {
                    let mut want = vec![0f32; t * m.rows];
                    reference::gemm_q8act(&mut want, m.as_ref(), x, *t);
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{bits:?} g{gs} {} job {i} t={t}",
                        level.name()
                    );
                    let mut one = vec![f32::NAN; t * m.rows];
                    fast::gemm_q8act_prepared(&mut one, m.as_ref(), inputs[i].1);
                    assert!(one.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
                }
            }
        }
    }
}

/// One token with every code at the maximum and activations at ±max: the largest i16 lanes of
/// the decode kernel (two units per group at group size 128).
#[test]
fn one_token_extreme_codes_do_not_saturate() {
    let mut rng = Rng::new(21);
    for (bits, gs) in [(Bits::B4, 64), (Bits::B4, 128), (Bits::B8, 64)] {
        let mut m = random_qmat(&mut rng, 7, 16 * gs, spec(bits, gs));
        m.packed.iter_mut().for_each(|w| *w = u32::MAX);
        for sign in [1.0f32, -1.0] {
            let x = vec![sign * 3.0; 16 * gs];
            check_fast_bitwise(&m, &x, 1, &format!("one-token saturation {bits:?} g{gs}"));
        }
    }
}

/// Every token count of the one-row 8-token kernel (and the 2×4 tiles) up to 17, tails of rows
/// and groups included.
#[test]
fn every_token_count_equals_reference() {
    let mut rng = Rng::new(22);
    for (bits, gs) in [(Bits::B4, 64), (Bits::B4, 128), (Bits::B8, 64), (Bits::B4, 32)] {
        for (rows, groups) in [(17, 9), (5, 32), (2, 3)] {
            let cols = groups * gs;
            let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
            for t in 1..=17 {
                let x = activations(&mut rng, t, cols, gs);
                check_fast_bitwise(&m, &x, t, &format!("{rows}x{cols} {bits:?} g{gs}"));
            }
        }
    }
}
