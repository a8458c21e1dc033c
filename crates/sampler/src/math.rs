//! Small numeric kernels whose results are bit-identical on every IEEE-754 platform.
//!
//! Only `+ - * /`, comparisons, float/int casts and bit operations are used: Rust
//! never contracts them into fused multiply-adds, so the results do not depend on
//! the platform's libm (whose `expf` differs between systems in the last bit).

/// Index of the largest value: the first index on ties; NaN never wins.
///
/// `+inf` beats every finite value, and `-inf` is a value like any other, so an
/// all `-inf` slice gives 0. An empty or all-NaN slice gives 0 as well.
///
/// Two passes, both vectorised: the maximum, then a block-wise search for its
/// first occurrence (stopping at the block that holds it).
pub fn argmax(logits: &[f32]) -> u32 {
    argmax_inline(logits)
}

/// [`argmax`], inlined into each compiled variant of the sampler.
#[inline(always)]
pub(crate) fn argmax_inline(logits: &[f32]) -> u32 {
    const BLOCK: usize = 64;
    let m = max_non_nan(logits);
    // With no non-NaN value `m` is -inf and nothing compares equal: index 0.
    for (b, block) in logits.chunks(BLOCK).enumerate() {
        if block.iter().fold(false, |hit, &v| hit | (v == m)) {
            let j = block.iter().position(|&v| v == m).unwrap_or(0);
            return (b * BLOCK + j) as u32;
        }
    }
    0
}

/// Largest non-NaN value; `-inf` when there is none.
#[inline(always)]
pub(crate) fn max_non_nan(xs: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            // `v > a` is false for NaN, so NaN is skipped.
            *a = if v > *a { v } else { *a };
        }
    }
    acc.iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// The value the sampling path works with: NaN counts as `-inf` (never chosen)
/// and `+inf` as `f32::MAX`, so that differences with the maximum stay finite or `-inf`.
#[inline(always)]
pub(crate) fn clean(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x.min(f32::MAX)
    }
}

/// Below this argument [`exp_neg`] returns 0 (`e^-87` is about `1.6e-38`, near
/// the smallest normal `f32`). A token that far below the best one has no
/// measurable probability.
pub(crate) const EXP_CUTOFF: f32 = -87.0;

/// `e^z` for `z <= 0` (including `-inf`), in `f32`, bit-identical everywhere.
///
/// Cody–Waite range reduction `z = n ln2 + r`, `|r| <= ln2 / 2`, and the
/// degree-7 polynomial of Cephes' `expf` (S. Moshier), then a scaling by `2^n`
/// through the exponent bits. Relative error is about one ulp. Arguments below
/// [`EXP_CUTOFF`] give exactly 0; `exp_neg(0) == 1` exactly. Branch-free, so a
/// loop over it vectorises.
#[inline(always)]
pub(crate) fn exp_neg(z: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that `n * LN2_HI` is exact for |n| < 2^15 (Cephes' C1, C2).
    const LN2_HI: f32 = 355.0 / 512.0; // 0.693359375
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Cephes expf coefficients 1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
    // 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1, written as the
    // shortest decimals of the same f32 values.
    const P0: f32 = 1.987_569_1e-4;
    const P1: f32 = 1.398_199_9e-3;
    const P2: f32 = 8.333_452e-3;
    const P3: f32 = 4.166_579_6e-2;
    const P4: f32 = 1.666_666_6e-1;
    const P5: f32 = 0.5;
    // Adding 1.5 * 2^23 rounds a float of magnitude < 2^22 to an integer
    // (nearest, ties to even) held in the low mantissa bits: no float-to-int
    // cast, so the function stays branch-free and vectorises.
    const ROUND: f32 = 12_582_912.0;
    // Clamp (this also maps -inf and NaN into range); the result is zeroed below.
    let zc = if z > EXP_CUTOFF { z } else { EXP_CUTOFF };
    let zc = if zc < 0.0 { zc } else { 0.0 };
    let t = zc * LOG2E + ROUND;
    let nf = t - ROUND; // round(zc / ln 2), in [-126, 0]
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = zc - nf * LN2_HI - nf * LN2_LO;
    let poly = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5;
    let y = poly * (r * r) + r + 1.0;
    let scale = f32::from_bits((n.wrapping_add(127) as u32) << 23); // 2^n, normal since n >= -126
    let e = y * scale;
    if z > EXP_CUTOFF {
        e
    } else {
        0.0
    }
}

/// A uniform `f64` in `[0, 1)` from the top 53 bits of a `u64` (exact, portable).
#[inline]
pub(crate) fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// One step of SplitMix64 (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number
/// generators"): advances `state` by the golden gamma `0x9E3779B97F4A7C15` and returns the
/// mixed 64 bits. The workspace's one copy: [`expand_seed`] and the seeded test data of the
/// other crates use it.
#[inline]
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64 ([`splitmix64`]): expands a `u64` seed into a 32-byte
/// ChaCha key, so that nearby seeds give unrelated keys. Fixed here rather than
/// taken from `rand_core::SeedableRng::seed_from_u64`, so the token stream of a
/// seed cannot change with a dependency update. Public so that other implementations of the
/// same stream (the CUDA sampler) derive the same key.
pub fn expand_seed(seed: u64) -> [u8; 32] {
    let mut state = seed;
    let mut out = [0u8; 32];
    for chunk in out.chunks_exact_mut(8) {
        chunk.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_neg_matches_f64_exp() {
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-0.0), 1.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(f32::NAN), 0.0);
        assert_eq!(exp_neg(-87.0), 0.0);
        assert_eq!(exp_neg(-1000.0), 0.0);
        let mut worst = 0.0f64;
        let steps = 200_000;
        for i in 0..=steps {
            let z = -86.999 * (i as f32 / steps as f32);
            let got = exp_neg(z) as f64;
            let want = (z as f64).exp();
            worst = worst.max(((got - want) / want).abs());
        }
        // Two f32 ulps (2^-23 = 1.19e-7 each): the Cephes polynomial is ~1 ulp.
        assert!(worst < 2.4e-7, "worst relative error {worst:e}");
    }

    #[test]
    fn exp_neg_is_monotone() {
        let mut prev = 0.0f32;
        let mut z = -86.99f32;
        while z <= 0.0 {
            let e = exp_neg(z);
            assert!(e >= prev, "exp_neg not monotone at {z}");
            prev = e;
            z += 0.001;
        }
    }

    #[test]
    fn max_non_nan_skips_nan() {
        assert_eq!(max_non_nan(&[]), f32::NEG_INFINITY);
        assert_eq!(max_non_nan(&[f32::NAN; 20]), f32::NEG_INFINITY);
        let mut v = vec![f32::NAN; 37];
        v[3] = 1.0;
        v[35] = 2.0;
        assert_eq!(max_non_nan(&v), 2.0);
    }

    fn naive_argmax(xs: &[f32]) -> u32 {
        let mut best: Option<(usize, f32)> = None;
        for (i, &v) in xs.iter().enumerate() {
            if v.is_nan() {
                continue;
            }
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
        best.map_or(0, |(i, _)| i as u32)
    }

    #[test]
    fn argmax_matches_naive_scan() {
        let mut state = 0x1234_5678_9abc_def0u64;
        let vals = [
            f32::NAN,
            f32::NEG_INFINITY,
            f32::INFINITY,
            -1.0,
            0.0,
            -0.0,
            1.0,
            2.0,
        ];
        for len in 0..70 {
            for _ in 0..200 {
                let xs: Vec<f32> = (0..len)
                    .map(|_| {
                        state = state
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        vals[(state >> 61) as usize]
                    })
                    .collect();
                assert_eq!(argmax(&xs), naive_argmax(&xs), "{xs:?}");
            }
        }
    }

    #[test]
    fn unit_f64_range() {
        assert_eq!(unit_f64(0), 0.0);
        assert!(unit_f64(u64::MAX) < 1.0);
    }
}
