//! Behaviour of the public API: argmax, masking, determinism, filters,
//! statistics, penalties, degenerate input and parameter validation.

use std::collections::BTreeSet;

use sampler::{argmax, Sampler, SamplerError, SamplingParams};

/// Qwen3.6 logits row length and first padding id.
const VOCAB: usize = 248_320;
const VOCAB_LIMIT: usize = 248_077;

fn seeded(p: SamplingParams, seed: u64) -> Sampler {
    Sampler::new(SamplingParams {
        seed: Some(seed),
        ..p
    })
    .expect("valid params")
}

/// SplitMix64 (`sampler::splitmix64`), to build test rows without depending on the sampler's
/// ChaCha stream.
struct TestRng(u64);

impl TestRng {
    fn next_u64(&mut self) -> u64 {
        sampler::splitmix64(&mut self.0)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// `n` logits in [-scale, scale).
    fn logits(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (self.unit() * 2.0 - 1.0) * scale).collect()
    }
    /// `n` pairwise distinct logits (a shuffled ramp), so the argmax is unique.
    fn distinct_logits(&mut self, n: usize, step: f32) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n)
            .map(|i| i as f32 * step - n as f32 * step / 2.0)
            .collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    }
}

/// Draws `draws` tokens from a fresh copy of `logits` each time.
fn histogram(s: &mut Sampler, logits: &[f32], vocab_limit: usize, draws: usize) -> Vec<usize> {
    let mut counts = vec![0usize; logits.len()];
    let mut buf = logits.to_vec();
    for _ in 0..draws {
        buf.copy_from_slice(logits);
        let t = s.sample(&mut buf, vocab_limit) as usize;
        counts[t] += 1;
    }
    counts
}

fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
    let m = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let e: Vec<f64> = logits
        .iter()
        .map(|&x| ((x as f64 - m) / temperature).exp())
        .collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

/// Pearson's chi-square statistic of `counts` against `probs`; panics if a
/// token of probability 0 was drawn.
fn chi_square(counts: &[usize], probs: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    let mut stat = 0.0;
    for (i, (&c, &p)) in counts.iter().zip(probs).enumerate() {
        if p == 0.0 {
            assert_eq!(c, 0, "token {i} has probability 0 but was drawn {c} times");
            continue;
        }
        let e = p * n as f64;
        stat += (c as f64 - e).powi(2) / e;
    }
    stat
}

/// Upper 1e-6 quantiles of the chi-square distribution, by degrees of freedom
/// (computed from the regularised incomplete gamma function).
///
/// Why this bound: for a correct sampler the statistic follows chi-square with
/// (categories - 1) degrees of freedom (every expected count here is >= 150,
/// far above the usual >= 5 rule), so it exceeds the bound with probability
/// 1e-6. The seeds are fixed, so each test is deterministic; a wrong sampler
/// (missing temperature, renormalisation over the wrong set, an off-by-one id)
/// gives statistics in the thousands for 20,000 draws, as
/// `temperature_is_applied` checks.
fn chi2_bound(df: usize) -> f64 {
    match df {
        1 => 23.93,
        2 => 27.63,
        3 => 30.66,
        7 => 40.52,
        _ => unreachable!("no bound tabulated for {df} degrees of freedom"),
    }
}

/// Renormalised probabilities over `keep`, zero elsewhere.
fn restricted(probs: &[f64], keep: &[usize]) -> Vec<f64> {
    let z: f64 = keep.iter().map(|&i| probs[i]).sum();
    (0..probs.len())
        .map(|i| if keep.contains(&i) { probs[i] / z } else { 0.0 })
        .collect()
}

fn observed(counts: &[usize]) -> Vec<usize> {
    (0..counts.len()).filter(|&i| counts[i] > 0).collect()
}

/// Eight logits, expected counts >= 150 over 20,000 draws at temperature 1.
const EIGHT: [f32; 8] = [1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 2.0, 0.25];
const DRAWS: usize = 20_000;

/// ln of (0.05, 0.5, 0.15, 0.3) at ids 0..4: a shuffled 0.5 / 0.3 / 0.15 / 0.05.
fn four() -> Vec<f32> {
    [0.05f32, 0.5, 0.15, 0.3].iter().map(|p| p.ln()).collect()
}

// ---------------------------------------------------------------- argmax

#[test]
fn argmax_picks_first_on_ties() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(argmax(&[5.0, 5.0]), 0);
    assert_eq!(argmax(&[0.0, f32::INFINITY, f32::INFINITY]), 1);
    // Ties across the 8-lane chunks and the remainder.
    let mut v = vec![0.0f32; 37];
    v[20] = 4.0;
    v[5] = 4.0;
    v[36] = 4.0;
    assert_eq!(argmax(&v), 5);
    let mut v = vec![0.0f32; 37];
    v[36] = 1.0;
    assert_eq!(argmax(&v), 36);
}

#[test]
fn argmax_ignores_nan() {
    let nan = f32::NAN;
    assert_eq!(argmax(&[nan, 1.0, nan, 2.0, nan]), 3);
    assert_eq!(argmax(&[nan, f32::NEG_INFINITY]), 1);
    assert_eq!(argmax(&[nan; 20]), 0);
    let mut v = vec![nan; 40];
    v[33] = -7.0;
    assert_eq!(argmax(&v), 33);
}

#[test]
fn argmax_of_empty_or_all_neg_inf_is_0() {
    assert_eq!(argmax(&[]), 0);
    assert_eq!(argmax(&[f32::NEG_INFINITY; 9]), 0);
}

// ---------------------------------------------------------------- masking

#[test]
fn masking_respects_vocab_limit_greedy() {
    let mut logits = vec![0.0, 1.0, 0.5, 9.0, 8.0];
    let mut s = seeded(SamplingParams::greedy(), 0);
    assert_eq!(s.sample(&mut logits, 3), 1);
    assert_eq!(&logits[..3], &[0.0, 1.0, 0.5]);
    assert!(logits[3..].iter().all(|&x| x == f32::NEG_INFINITY));
}

#[test]
fn masking_respects_vocab_limit_on_a_qwen_row() {
    let mut rng = TestRng(11);
    let mut logits = rng.logits(VOCAB, 8.0);
    // Padding rows look far more likely than any real token.
    for x in &mut logits[VOCAB_LIMIT..] {
        *x = 100.0;
    }
    let variants = [
        SamplingParams::greedy(),
        SamplingParams::default(),
        SamplingParams {
            temperature: 5.0,
            ..Default::default()
        },
        SamplingParams {
            top_k: 20,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.95,
            ..Default::default()
        },
        SamplingParams {
            top_k: 50,
            top_p: 0.9,
            min_p: 0.05,
            temperature: 0.7,
            ..Default::default()
        },
        SamplingParams {
            min_p: 0.5,
            ..Default::default()
        },
    ];
    for (v, p) in variants.into_iter().enumerate() {
        let mut s = seeded(p, v as u64);
        let mut buf = logits.clone();
        for _ in 0..20 {
            buf.copy_from_slice(&logits);
            let t = s.sample(&mut buf, VOCAB_LIMIT);
            assert!(
                (t as usize) < VOCAB_LIMIT,
                "variant {v} drew padding id {t}"
            );
        }
        assert!(buf[VOCAB_LIMIT..].iter().all(|&x| x == f32::NEG_INFINITY));
    }
}

#[test]
fn masked_tokens_are_never_sampled_even_when_flat() {
    let logits = [0.0f32; 10];
    let mut s = seeded(SamplingParams::default(), 3);
    let counts = histogram(&mut s, &logits, 4, 2000);
    assert_eq!(observed(&counts), vec![0, 1, 2, 3]);
}

#[test]
fn vocab_limit_above_row_length_is_clamped() {
    let mut logits = vec![0.0, 3.0, 1.0];
    assert_eq!(
        seeded(SamplingParams::greedy(), 0).sample(&mut logits, 1000),
        1
    );
    let t = seeded(SamplingParams::default(), 0).sample(&mut logits, usize::MAX);
    assert!(t < 3);
}

// ---------------------------------------------------------------- determinism

fn sequence(seed: u64, p: SamplingParams, steps: usize) -> Vec<u32> {
    let mut s = seeded(p, seed);
    let mut rows = TestRng(99);
    (0..steps)
        .map(|_| {
            let mut logits = rows.logits(500, 2.0);
            s.sample(&mut logits, 500)
        })
        .collect()
}

#[test]
fn same_seed_gives_same_sequence() {
    for p in [
        SamplingParams::default(),
        SamplingParams {
            top_k: 40,
            top_p: 0.9,
            temperature: 0.8,
            ..Default::default()
        },
        SamplingParams {
            min_p: 0.05,
            temperature: 1.3,
            ..Default::default()
        },
    ] {
        let a = sequence(42, p.clone(), 100);
        let b = sequence(42, p, 100);
        assert_eq!(a, b);
        let distinct: BTreeSet<u32> = a.iter().copied().collect();
        assert!(
            distinct.len() > 10,
            "sequence too uniform to test anything: {a:?}"
        );
    }
}

#[test]
fn different_seeds_give_different_sequences() {
    let p = SamplingParams::default();
    assert_ne!(sequence(1, p.clone(), 100), sequence(2, p.clone(), 100));
    assert_ne!(sequence(0, p.clone(), 100), sequence(u64::MAX, p, 100));
}

#[test]
fn reset_restarts_a_seeded_stream() {
    let logits = EIGHT;
    let mut s = seeded(SamplingParams::default(), 5);
    let first = histogram_sequence(&mut s, &logits, 30);
    s.reset();
    assert_eq!(histogram_sequence(&mut s, &logits, 30), first);
}

fn histogram_sequence(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<u32> {
    (0..n)
        .map(|_| s.sample(&mut logits.to_vec(), logits.len()))
        .collect()
}

/// Pinned output: guards the "same seed, same tokens on every platform" promise
/// (SplitMix64 key expansion, ChaCha20, portable exp, inverse CDF in id order).
/// A change here changes every seeded user's output.
#[test]
fn golden_sequence_is_stable() {
    let logits: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
    let mut s = seeded(SamplingParams::default(), 2024);
    let plain = histogram_sequence(&mut s, &logits, 24);
    let mut s = seeded(
        SamplingParams {
            top_k: 6,
            top_p: 0.9,
            temperature: 0.7,
            ..Default::default()
        },
        7,
    );
    let filtered = histogram_sequence(&mut s, &logits, 24);
    assert_eq!(plain, GOLDEN_PLAIN, "plain: {plain:?}");
    assert_eq!(filtered, GOLDEN_FILTERED, "filtered: {filtered:?}");
}
const GOLDEN_PLAIN: [u32; 24] = [
    6, 4, 6, 2, 4, 5, 3, 10, 5, 3, 15, 2, 2, 4, 8, 2, 4, 1, 1, 2, 2, 4, 1, 8,
];
const GOLDEN_FILTERED: [u32; 24] = [
    2, 4, 4, 3, 4, 3, 2, 3, 2, 4, 4, 6, 5, 2, 5, 3, 5, 5, 3, 3, 4, 3, 5, 6,
];

#[test]
fn unseeded_sampler_reports_a_reproducible_seed() {
    let a = Sampler::new(SamplingParams::default()).unwrap();
    let b = Sampler::new(SamplingParams::default()).unwrap();
    assert_ne!(a.seed(), b.seed(), "two OS-entropy seeds collided");
    let logits: Vec<f32> = (0..64).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut a = a;
    let mut again = seeded(SamplingParams::default(), a.seed());
    assert_eq!(
        histogram_sequence(&mut a, &logits, 50),
        histogram_sequence(&mut again, &logits, 50)
    );
}

// ---------------------------------------------------------------- greedy equivalences

fn assert_matches_greedy(p: SamplingParams, what: &str) {
    let mut rows = TestRng(5);
    for step in 0..40u64 {
        let logits = rows.distinct_logits(3000, 0.01);
        let want = argmax(&logits);
        for t in [0.3f32, 1.0, 2.5] {
            let mut s = seeded(
                SamplingParams {
                    temperature: t,
                    ..p.clone()
                },
                step,
            );
            for _ in 0..5 {
                let got = s.sample(&mut logits.clone(), logits.len());
                assert_eq!(got, want, "{what}: step {step} temperature {t}");
            }
        }
    }
}

#[test]
fn top_k_1_equals_greedy() {
    assert_matches_greedy(
        SamplingParams {
            top_k: 1,
            ..Default::default()
        },
        "top_k=1",
    );
}

#[test]
fn tiny_top_p_equals_greedy() {
    assert_matches_greedy(
        SamplingParams {
            top_p: 1e-7,
            ..Default::default()
        },
        "top_p=1e-7",
    );
    // With a tie at the top, the nucleus is the first id, like argmax.
    let logits = [1.0, 5.0, 5.0, 2.0];
    let mut s = seeded(
        SamplingParams {
            top_p: 1e-7,
            ..Default::default()
        },
        1,
    );
    assert_eq!(observed(&histogram(&mut s, &logits, 4, 500)), vec![1]);
}

#[test]
fn min_p_1_equals_greedy() {
    assert_matches_greedy(
        SamplingParams {
            min_p: 1.0,
            ..Default::default()
        },
        "min_p=1",
    );
}

#[test]
fn tiny_temperature_is_effectively_greedy() {
    let mut rows = TestRng(6);
    for step in 0..20u64 {
        let logits = rows.distinct_logits(3000, 0.01);
        let mut s = seeded(
            SamplingParams {
                temperature: 1e-30,
                ..Default::default()
            },
            step,
        );
        assert_eq!(
            s.sample(&mut logits.clone(), logits.len()),
            argmax(&logits),
            "step {step}"
        );
    }
    let logits = rows_of_ties();
    let mut s = seeded(
        SamplingParams {
            temperature: 1e-45,
            ..Default::default()
        },
        3,
    );
    let counts = histogram(&mut s, &logits, logits.len(), 1000);
    assert_eq!(observed(&counts), vec![2, 4], "only the tied maxima");
}

fn rows_of_ties() -> Vec<f32> {
    vec![0.0, 1.0, 3.0, 2.0, 3.0]
}

// ---------------------------------------------------------------- statistics

#[test]
fn frequencies_match_softmax_at_temperature_1() {
    let mut s = seeded(SamplingParams::default(), 123);
    let counts = histogram(&mut s, &EIGHT, 8, DRAWS);
    let stat = chi_square(&counts, &softmax(&EIGHT, 1.0));
    assert!(
        stat < chi2_bound(7),
        "chi-square {stat:.1} over 7 dof; counts {counts:?}"
    );
}

#[test]
fn temperature_is_applied() {
    let mut s = seeded(
        SamplingParams {
            temperature: 0.5,
            ..Default::default()
        },
        321,
    );
    let counts = histogram(&mut s, &EIGHT, 8, DRAWS);
    let stat = chi_square(&counts, &softmax(&EIGHT, 0.5));
    assert!(
        stat < chi2_bound(7),
        "chi-square {stat:.1} over 7 dof; counts {counts:?}"
    );
    // The same draws are far from the temperature-1 distribution: the test has power.
    let wrong = chi_square(&counts, &softmax(&EIGHT, 1.0));
    assert!(
        wrong > 1000.0,
        "temperature 0.5 indistinguishable from 1 ({wrong:.1})"
    );
}

#[test]
fn top_k_3_keeps_the_top_3_renormalised() {
    let mut s = seeded(
        SamplingParams {
            top_k: 3,
            ..Default::default()
        },
        9,
    );
    let counts = histogram(&mut s, &EIGHT, 8, DRAWS);
    // EIGHT's three largest logits are at ids 6 (2.0), 0 (1.0) and 1 (0.5).
    assert_eq!(observed(&counts), vec![0, 1, 6]);
    let want = restricted(&softmax(&EIGHT, 1.0), &[0, 1, 6]);
    let stat = chi_square(&counts, &want);
    assert!(
        stat < chi2_bound(2),
        "chi-square {stat:.1} over 2 dof; counts {counts:?}"
    );
}

#[test]
fn top_p_keeps_exactly_the_nucleus() {
    // Probabilities 0.05, 0.5, 0.15, 0.3 at ids 0..4; top_p 0.8 keeps the 0.5
    // and 0.3 tokens: their mass is exactly 0.8 (>= top_p). transformers'
    // rule, "drop while the ascending cumulative mass <= 1 - top_p", is the
    // same set in exact arithmetic.
    let logits = four();
    let mut s = seeded(
        SamplingParams {
            top_p: 0.8,
            ..Default::default()
        },
        17,
    );
    let counts = histogram(&mut s, &logits, 4, DRAWS);
    assert_eq!(observed(&counts), vec![1, 3]);
    let stat = chi_square(&counts, &restricted(&softmax(&logits, 1.0), &[1, 3]));
    assert!(
        stat < chi2_bound(1),
        "chi-square {stat:.1} over 1 dof; counts {counts:?}"
    );
}

#[test]
fn top_p_boundaries() {
    // 3000 draws: a kept token has renormalised probability >= 0.05, so missing
    // it has probability <= 0.95^3000 (1e-67); a dropped one never appears.
    let logits = four();
    for (top_p, want) in [
        (0.3f32, vec![1]),
        (0.5, vec![1]),
        (0.5001, vec![1, 3]),
        (0.79, vec![1, 3]),
        (0.8, vec![1, 3]),
        (0.8001, vec![1, 2, 3]),
        (0.95, vec![1, 2, 3]),
        (0.9501, vec![0, 1, 2, 3]),
        (1.0, vec![0, 1, 2, 3]),
    ] {
        let mut s = seeded(
            SamplingParams {
                top_p,
                ..Default::default()
            },
            4,
        );
        assert_eq!(
            observed(&histogram(&mut s, &logits, 4, 3000)),
            want,
            "top_p {top_p}"
        );
    }
}

#[test]
fn top_p_is_measured_after_top_k() {
    // Within the top 2 (0.5, 0.3 → 0.625, 0.375) the best token alone reaches 0.6.
    let logits = four();
    let mut s = seeded(
        SamplingParams {
            top_k: 2,
            top_p: 0.6,
            ..Default::default()
        },
        8,
    );
    assert_eq!(observed(&histogram(&mut s, &logits, 4, 2000)), vec![1]);
}

#[test]
fn min_p_keeps_tokens_above_a_fraction_of_the_top() {
    let logits = four();
    // Threshold 0.29 * 0.5 = 0.145: keeps 0.5, 0.3, 0.15.
    let mut s = seeded(
        SamplingParams {
            min_p: 0.29,
            ..Default::default()
        },
        31,
    );
    let counts = histogram(&mut s, &logits, 4, DRAWS);
    assert_eq!(observed(&counts), vec![1, 2, 3]);
    let stat = chi_square(&counts, &restricted(&softmax(&logits, 1.0), &[1, 2, 3]));
    assert!(
        stat < chi2_bound(2),
        "chi-square {stat:.1} over 2 dof; counts {counts:?}"
    );
    // Threshold 0.31 * 0.5 = 0.155: drops 0.15 too.
    let mut s = seeded(
        SamplingParams {
            min_p: 0.31,
            ..Default::default()
        },
        31,
    );
    assert_eq!(observed(&histogram(&mut s, &logits, 4, 3000)), vec![1, 3]);
}

#[test]
fn min_p_comes_after_top_p() {
    // Probabilities 0.4, 0.3, 0.2, 0.1; top_p 0.75 on the full distribution
    // keeps three (0.4 + 0.3 < 0.75), then min_p 0.3 (threshold 0.12) keeps
    // them. vLLM's order (min-p first, then top-p over 0.44, 0.33, 0.22) would
    // keep only two.
    let logits: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.ln()).collect();
    let mut s = seeded(
        SamplingParams {
            top_p: 0.75,
            min_p: 0.3,
            ..Default::default()
        },
        2,
    );
    assert_eq!(
        observed(&histogram(&mut s, &logits, 4, 3000)),
        vec![0, 1, 2]
    );
}

#[test]
fn positive_infinity_takes_all_the_mass() {
    let logits = [0.0, f32::INFINITY, 5.0, f32::INFINITY];
    let mut s = seeded(SamplingParams::default(), 6);
    let counts = histogram(&mut s, &logits, 4, 4000);
    assert_eq!(observed(&counts), vec![1, 3]);
    let stat = chi_square(&counts, &[0.0, 0.5, 0.0, 0.5]);
    assert!(
        stat < chi2_bound(1),
        "chi-square {stat:.1}; counts {counts:?}"
    );
}

#[test]
fn nan_is_never_sampled() {
    let nan = f32::NAN;
    let logits = [nan, 0.0, nan, 0.0, nan];
    for p in [
        SamplingParams::default(),
        SamplingParams {
            top_k: 2,
            top_p: 0.9,
            ..Default::default()
        },
    ] {
        let mut s = seeded(p, 1);
        assert_eq!(observed(&histogram(&mut s, &logits, 5, 2000)), vec![1, 3]);
    }
}

// ---------------------------------------------------------------- penalties

/// Applies the penalties through a greedy call and returns the penalised row.
fn penalised(p: SamplingParams, accepted: &[u32], logits: &[f32]) -> Vec<f32> {
    let mut s = seeded(
        SamplingParams {
            temperature: 0.0,
            ..p
        },
        0,
    );
    for &t in accepted {
        s.accept(t);
    }
    let mut buf = logits.to_vec();
    s.sample(&mut buf, logits.len());
    buf
}

const ROW: [f32; 6] = [1.0, 2.0, 3.0, 4.0, 5.0, -1.0];

#[test]
fn presence_penalty_once_per_distinct_token() {
    let p = SamplingParams {
        presence_penalty: 0.5,
        ..SamplingParams::greedy()
    };
    let got = penalised(p, &[1, 1, 1, 3, 5], &ROW);
    assert_eq!(got, vec![1.0, 1.5, 3.0, 3.5, 5.0, -1.5]);
}

#[test]
fn frequency_penalty_scales_with_count() {
    let p = SamplingParams {
        frequency_penalty: 0.25,
        ..SamplingParams::greedy()
    };
    let got = penalised(p, &[1, 1, 1, 3, 5, 5], &ROW);
    assert_eq!(got, vec![1.0, 1.25, 3.0, 3.75, 5.0, -1.5]);
}

#[test]
fn presence_and_frequency_add_up() {
    let p = SamplingParams {
        presence_penalty: 1.0,
        frequency_penalty: 0.5,
        ..SamplingParams::greedy()
    };
    let got = penalised(p, &[4, 4, 4, 4], &ROW);
    assert_eq!(got, vec![1.0, 2.0, 3.0, 4.0, 5.0 - 1.0 - 2.0, -1.0]);
}

#[test]
fn negative_penalties_encourage() {
    let p = SamplingParams {
        presence_penalty: -2.0,
        ..SamplingParams::greedy()
    };
    let got = penalised(p, &[0], &ROW);
    assert_eq!(got[0], 3.0);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let p = SamplingParams {
        repetition_penalty: 1.5,
        ..SamplingParams::greedy()
    };
    let row = [3.0, -2.0, 0.0, 5.0, -4.0];
    // Token 0 accepted three times: still divided once.
    let got = penalised(p, &[0, 0, 0, 1, 2], &row);
    assert_eq!(got, vec![2.0, -3.0, 0.0, 5.0, -4.0]);
}

#[test]
fn repetition_penalty_below_1_rewards() {
    let p = SamplingParams {
        repetition_penalty: 0.5,
        ..SamplingParams::greedy()
    };
    let got = penalised(p, &[0, 1], &[3.0, -2.0]);
    assert_eq!(got, vec![6.0, -1.0]);
}

#[test]
fn repetition_penalty_comes_before_presence() {
    // (2 / 2) - 0.5 = 0.5; the other order would give (2 - 0.5) / 2 = 0.75.
    let p = SamplingParams {
        repetition_penalty: 2.0,
        presence_penalty: 0.5,
        ..SamplingParams::greedy()
    };
    assert_eq!(penalised(p, &[0], &[2.0, 0.0]), vec![0.5, 0.0]);
}

#[test]
fn penalties_change_the_choice() {
    let row = [3.0, 2.9, 0.0];
    let p = SamplingParams {
        presence_penalty: 0.5,
        ..SamplingParams::greedy()
    };
    let mut s = seeded(p, 0);
    assert_eq!(s.sample(&mut row.to_vec(), 3), 0);
    s.accept(0);
    assert_eq!(s.sample(&mut row.to_vec(), 3), 1);
    s.accept(1);
    assert_eq!(s.sample(&mut row.to_vec(), 3), 0);
}

#[test]
fn penalties_apply_when_sampling_too() {
    let p = SamplingParams {
        frequency_penalty: 2.0,
        presence_penalty: 2.0,
        ..Default::default()
    };
    let mut s = seeded(p, 0);
    s.accept(0);
    s.accept(0);
    let mut buf = vec![10.0, 0.0, 0.0];
    s.sample(&mut buf, 3);
    assert_eq!(buf, vec![10.0 - 4.0 - 2.0, 0.0, 0.0]);
}

#[test]
fn penalties_ignore_ids_outside_the_row_and_keep_masked_ids_masked() {
    let p = SamplingParams {
        presence_penalty: -2.0,
        frequency_penalty: -2.0,
        repetition_penalty: 0.5,
        ..SamplingParams::greedy()
    };
    let row = [1.0, 2.0, 3.0, 4.0];
    let mut s = seeded(p, 0);
    for t in [3, 10, 1_000_000, u32::MAX] {
        s.accept(t);
    }
    let mut buf = row.to_vec();
    // Id 3 is accepted but masked: it must stay -inf and never win.
    assert_eq!(s.sample(&mut buf, 3), 2);
    assert_eq!(buf, vec![1.0, 2.0, 3.0, f32::NEG_INFINITY]);
}

#[test]
fn reset_clears_penalties() {
    let p = SamplingParams {
        presence_penalty: 1.0,
        frequency_penalty: 1.0,
        repetition_penalty: 2.0,
        ..SamplingParams::greedy()
    };
    let mut s = seeded(p, 0);
    for t in [0, 1, 2, 2] {
        s.accept(t);
    }
    s.reset();
    let mut buf = ROW.to_vec();
    s.sample(&mut buf, ROW.len());
    assert_eq!(buf, ROW.to_vec());
}

#[test]
fn no_penalties_without_accepted_tokens() {
    let p = SamplingParams {
        presence_penalty: 2.0,
        frequency_penalty: 2.0,
        repetition_penalty: 3.0,
        ..SamplingParams::greedy()
    };
    assert_eq!(penalised(p, &[], &ROW), ROW.to_vec());
}

// ---------------------------------------------------------------- degenerate input

fn all_variants() -> Vec<SamplingParams> {
    vec![
        SamplingParams::greedy(),
        SamplingParams::default(),
        SamplingParams {
            top_k: 2,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.5,
            ..Default::default()
        },
        SamplingParams {
            min_p: 0.5,
            ..Default::default()
        },
        SamplingParams {
            top_k: 3,
            top_p: 0.9,
            min_p: 0.1,
            temperature: 0.6,
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: 0.5,
            presence_penalty: -2.0,
            ..Default::default()
        },
    ]
}

#[test]
fn empty_row_and_zero_vocab_limit_return_0() {
    for p in all_variants() {
        let mut s = seeded(p, 0);
        assert_eq!(s.sample(&mut [], 10), 0);
        assert_eq!(s.sample(&mut [], 0), 0);
        let mut buf = vec![1.0, 2.0];
        assert_eq!(s.sample(&mut buf, 0), 0);
        assert_eq!(buf, vec![f32::NEG_INFINITY; 2]);
    }
}

#[test]
fn all_neg_inf_or_nan_returns_0() {
    for p in all_variants() {
        let mut s = seeded(p, 0);
        s.accept(1);
        assert_eq!(s.sample(&mut [f32::NEG_INFINITY; 5], 5), 0);
        assert_eq!(s.sample(&mut [f32::NAN; 5], 5), 0);
        assert_eq!(s.sample(&mut [f32::NAN, f32::NEG_INFINITY, f32::NAN], 3), 1);
        assert_eq!(s.sample(&mut [1.0, 2.0, 3.0, 4.0], 0), 0);
    }
}

#[test]
fn extreme_values_do_not_panic() {
    let rows: Vec<Vec<f32>> = vec![
        vec![f32::MAX, -f32::MAX, 0.0],
        vec![f32::MAX, f32::MAX, f32::INFINITY],
        vec![-f32::MAX, -f32::MAX],
        vec![f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 0.0, -0.0],
        vec![f32::INFINITY, f32::NEG_INFINITY, f32::NAN],
        vec![3e38, 2e38, -3e38],
        vec![1e-40, 0.0, -1e-40],
    ];
    let temps = [1e-45f32, 1e-30, 0.01, 1.0, 100.0, 1e30, f32::MAX];
    for row in &rows {
        for &temperature in &temps {
            for base in all_variants() {
                let p = SamplingParams {
                    temperature: if base.is_greedy() { 0.0 } else { temperature },
                    ..base
                };
                let mut s = seeded(p, 1);
                s.accept(0);
                s.accept(1);
                for _ in 0..3 {
                    let t = s.sample(&mut row.clone(), row.len());
                    assert!((t as usize) < row.len());
                    assert!(!row[t as usize].is_nan(), "sampled a NaN logit in {row:?}");
                }
            }
        }
    }
}

#[test]
fn huge_temperature_is_nearly_uniform() {
    let mut s = seeded(
        SamplingParams {
            temperature: 1e6,
            ..Default::default()
        },
        77,
    );
    let counts = histogram(&mut s, &EIGHT, 8, DRAWS);
    // At temperature 1e6 the softmax differs from uniform by < 1e-5.
    let stat = chi_square(&counts, &[0.125; 8]);
    assert!(
        stat < chi2_bound(7),
        "chi-square {stat:.1}; counts {counts:?}"
    );
}

// ---------------------------------------------------------------- parameters

#[test]
fn default_is_plain_sampling() {
    let d = SamplingParams::default();
    assert_eq!(
        d,
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
        }
    );
    assert!(!d.is_greedy());
    assert!(d.validate().is_ok());
    let g = SamplingParams::greedy();
    assert!(g.is_greedy());
    assert_eq!(
        g,
        SamplingParams {
            temperature: 0.0,
            ..d
        }
    );
}

#[test]
fn validate_names_the_field() {
    let d = SamplingParams::default;
    let nan = f32::NAN;
    let cases: Vec<(&str, SamplingParams)> = vec![
        (
            "temperature",
            SamplingParams {
                temperature: -0.1,
                ..d()
            },
        ),
        (
            "temperature",
            SamplingParams {
                temperature: nan,
                ..d()
            },
        ),
        (
            "temperature",
            SamplingParams {
                temperature: f32::INFINITY,
                ..d()
            },
        ),
        ("top_p", SamplingParams { top_p: 0.0, ..d() }),
        ("top_p", SamplingParams { top_p: -0.5, ..d() }),
        ("top_p", SamplingParams { top_p: 1.01, ..d() }),
        ("top_p", SamplingParams { top_p: nan, ..d() }),
        (
            "min_p",
            SamplingParams {
                min_p: -0.01,
                ..d()
            },
        ),
        ("min_p", SamplingParams { min_p: 1.5, ..d() }),
        ("min_p", SamplingParams { min_p: nan, ..d() }),
        (
            "presence_penalty",
            SamplingParams {
                presence_penalty: 2.5,
                ..d()
            },
        ),
        (
            "presence_penalty",
            SamplingParams {
                presence_penalty: -2.01,
                ..d()
            },
        ),
        (
            "presence_penalty",
            SamplingParams {
                presence_penalty: nan,
                ..d()
            },
        ),
        (
            "frequency_penalty",
            SamplingParams {
                frequency_penalty: 3.0,
                ..d()
            },
        ),
        (
            "frequency_penalty",
            SamplingParams {
                frequency_penalty: -2.5,
                ..d()
            },
        ),
        (
            "frequency_penalty",
            SamplingParams {
                frequency_penalty: nan,
                ..d()
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: 0.0,
                ..d()
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: -1.0,
                ..d()
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: nan,
                ..d()
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: f32::INFINITY,
                ..d()
            },
        ),
    ];
    for (field, p) in cases {
        let err = p.validate().expect_err(field);
        assert_eq!(err.field(), field, "{p:?}");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("`{field}`")),
            "message {msg:?} does not name {field}"
        );
        let SamplerError::InvalidParam { field: f, .. } = &err;
        assert_eq!(*f, field);
        assert_eq!(Sampler::new(p).expect_err(field), err);
    }
}

#[test]
fn validate_accepts_the_edges() {
    let d = SamplingParams::default;
    for p in [
        SamplingParams {
            temperature: 0.0,
            ..d()
        },
        SamplingParams {
            temperature: 1e-45,
            ..d()
        },
        SamplingParams {
            temperature: 1e30,
            ..d()
        },
        SamplingParams { top_p: 1.0, ..d() },
        SamplingParams { top_p: 1e-9, ..d() },
        SamplingParams { min_p: 0.0, ..d() },
        SamplingParams { min_p: 1.0, ..d() },
        SamplingParams {
            presence_penalty: 2.0,
            frequency_penalty: -2.0,
            ..d()
        },
        SamplingParams {
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            ..d()
        },
        SamplingParams {
            repetition_penalty: 1e-3,
            ..d()
        },
        SamplingParams {
            repetition_penalty: 100.0,
            ..d()
        },
        SamplingParams {
            top_k: usize::MAX,
            seed: Some(u64::MAX),
            ..d()
        },
    ] {
        assert!(p.validate().is_ok(), "{p:?}");
        assert!(Sampler::new(p).is_ok());
    }
}

#[test]
fn serde_round_trip_and_defaults() {
    let p = SamplingParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.95,
        min_p: 0.05,
        presence_penalty: 1.5,
        frequency_penalty: 0.25,
        repetition_penalty: 1.1,
        seed: Some(12345),
    };
    let json = serde_json::to_string(&p).unwrap();
    assert_eq!(serde_json::from_str::<SamplingParams>(&json).unwrap(), p);
    let partial: SamplingParams =
        serde_json::from_str(r#"{"temperature": 0.6, "top_k": 20, "seed": null}"#).unwrap();
    assert_eq!(
        partial,
        SamplingParams {
            temperature: 0.6,
            top_k: 20,
            ..Default::default()
        }
    );
}

#[test]
fn params_accessor_returns_what_was_given() {
    let p = SamplingParams {
        top_k: 7,
        seed: Some(3),
        ..Default::default()
    };
    let s = Sampler::new(p.clone()).unwrap();
    assert_eq!(s.params(), &p);
    assert_eq!(s.seed(), 3);
}
