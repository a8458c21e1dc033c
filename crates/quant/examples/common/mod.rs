//! Helpers the quant examples share (not an example itself: Cargo builds only `examples/*.rs`
//! and `examples/*/main.rs`).

use half::bf16;
use quant::{QMat, QuantSpec};
use std::time::Instant;

/// A random `[rows, cols]` MLX-quantized matrix: uniform codes, scales in ±0.005, biases in
/// [-0.05, 0]; `seed` advances (SplitMix64, `sampler::splitmix64`).
pub fn random_qmat(seed: &mut u64, rows: usize, cols: usize, spec: QuantSpec) -> QMat {
    let mut next = || sampler::splitmix64(seed);
    let words = rows * spec.words_per_row(cols);
    let groups = rows * spec.groups_per_row(cols);
    let packed = (0..words).map(|_| next() as u32).collect();
    let scales = (0..groups)
        .map(|_| bf16::from_f32(0.01 * ((next() % 100) as f32 / 100.0 - 0.5)))
        .collect();
    let biases = (0..groups)
        .map(|_| bf16::from_f32(-0.05 * ((next() % 100) as f32 / 100.0)))
        .collect();
    QMat { rows, cols, spec, packed, scales, biases }
}

/// Seconds per call: the best of several batches (the minimum is the least disturbed by other
/// processes sharing the CPU), each batch ~2 ms or at least one call, for at least `min_secs`
/// in total.
pub fn time_it(mut f: impl FnMut(), min_secs: f64) -> f64 {
    f();
    let start = Instant::now();
    let mut best = f64::INFINITY;
    while start.elapsed().as_secs_f64() < min_secs || best == f64::INFINITY {
        let b = Instant::now();
        let mut n = 0u32;
        while n < 1 || b.elapsed().as_secs_f64() < 0.002 {
            f();
            n += 1;
        }
        best = best.min(b.elapsed().as_secs_f64() / f64::from(n));
    }
    best
}
