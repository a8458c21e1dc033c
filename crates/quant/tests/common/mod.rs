//! Shared test helpers: a seeded RNG, random quantized matrices, error bounds.
#![allow(dead_code)]

use half::bf16;
use quant::{Bits, QMat, QuantSpec};

/// SplitMix64 (`sampler::splitmix64`): small, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        sampler::splitmix64(&mut self.0)
    }
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    pub fn normal_vec(&mut self, n: usize, sd: f64) -> Vec<f32> {
        (0..n).map(|_| (self.normal() * sd) as f32).collect()
    }
}

/// Rounds each value to bf16 and back (the precision of a bf16 checkpoint).
pub fn to_bf16_precision(v: &mut [f32]) {
    for x in v {
        *x = bf16::from_f32(*x).to_f32();
    }
}

/// A random quantized matrix with MLX-like statistics: uniform codes, scales of either sign
/// with magnitude in [1e-3, 2e-2], biases ≈ -scale · U(0, n_bins) (the extreme of the group).
pub fn random_qmat(rng: &mut Rng, rows: usize, cols: usize, spec: QuantSpec) -> QMat {
    let words = rows * spec.words_per_row(cols);
    let groups = rows * spec.groups_per_row(cols);
    let packed: Vec<u32> = (0..words).map(|_| rng.next_u32()).collect();
    let n = spec.bits.max_code() as f64;
    let mut scales = Vec::with_capacity(groups);
    let mut biases = Vec::with_capacity(groups);
    for _ in 0..groups {
        let mag = rng.range(1e-3, 2e-2);
        let s = if rng.below(2) == 0 { mag } else { -mag };
        scales.push(bf16::from_f64(s));
        biases.push(bf16::from_f64(-s * rng.range(0.0, n)));
    }
    QMat {
        rows,
        cols,
        spec,
        packed,
        scales,
        biases,
    }
}

/// A quantized matrix and activations on which every kernel's f32 arithmetic is exact:
/// scales ±2⁻³, biases multiples of 2⁻³ in [-2, 2], x integers in [-8, 8]. Every product,
/// dequantized weight and partial sum is a multiple of 2⁻³ below 2²⁰ (the code·x sums of the
/// fast kernels are integers, possibly times 2⁻²⁴), so every f32 operation is exact, any
/// summation order gives the same result, and fast must equal reference bit for bit.
pub fn exact_case(rng: &mut Rng, rows: usize, cols: usize, spec: QuantSpec) -> (QMat, Vec<f32>) {
    let mut m = random_qmat(rng, rows, cols, spec);
    for s in m.scales.iter_mut() {
        *s = bf16::from_f32(if rng.below(2) == 0 { 0.125 } else { -0.125 });
    }
    for b in m.biases.iter_mut() {
        *b = bf16::from_f32((rng.below(33) as f32 - 16.0) * 0.125);
    }
    let x = (0..cols).map(|_| rng.below(17) as f32 - 8.0).collect();
    (m, x)
}

/// γ_k = k·u / (1 − k·u), u = 2⁻²⁴: Higham's bound factor for k roundings in f32.
pub fn gamma(k: usize) -> f64 {
    let ku = k as f64 * 2f64.powi(-24);
    ku / (1.0 - ku)
}

/// Per-row magnitude M_r = Σ_c (|s·q| + |b|)·|x_c| in f64 (no cancellation).
pub fn magnitudes(m: &QMat, x: &[f32]) -> Vec<f64> {
    let mr = m.as_ref();
    (0..m.rows)
        .map(|r| {
            (0..m.cols)
                .map(|c| {
                    let (s, b) = mr.scale_bias(r, c);
                    ((s as f64 * mr.code(r, c) as f64).abs() + (b as f64).abs())
                        * (x[c] as f64).abs()
                })
                .sum()
        })
        .collect()
}

/// Asserts `|a_r − b_r| ≤ 2·γ_{cols+4}·M_r` for every row: each of two f32 evaluations of the
/// same exact sum (dequantize-then-dot, or the scale/bias split, in any summation order) is
/// within γ_{cols+4}·M_r of it (Higham, Accuracy and Stability of Numerical Algorithms, §3.1;
/// the +4 covers the product, the dequantization multiply/add and the final scale).
pub fn assert_close(what: &str, a: &[f32], b: &[f32], mags: &[f64], cols: usize) {
    assert_eq!(a.len(), b.len());
    let g = 2.0 * gamma(cols + 4);
    let mut worst = 0f64;
    for (r, ((&x, &y), &mg)) in a.iter().zip(b).zip(mags).enumerate() {
        assert!(
            x.is_finite() && y.is_finite(),
            "{what}: row {r}: non-finite {x} vs {y}"
        );
        let tol = g * mg + f64::from(f32::MIN_POSITIVE);
        let err = (x as f64 - y as f64).abs();
        worst = worst.max(err / tol);
        assert!(
            err <= tol,
            "{what}: row {r}: {x} vs {y}, |diff| {err:e} > tol {tol:e} (M = {mg:e})"
        );
    }
    let _ = worst;
}

pub fn spec(bits: Bits, group_size: usize) -> QuantSpec {
    QuantSpec { bits, group_size }
}
