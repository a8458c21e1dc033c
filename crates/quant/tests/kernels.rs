//! Fast kernels against the reference, at every available SIMD level.

mod common;

use common::*;
use quant::fast::{self, Level};
use quant::{dequantize, reference, Bits, QMat};

const SPECS: [(Bits, usize); 6] = [
    (Bits::B4, 32),
    (Bits::B4, 64),
    (Bits::B4, 128),
    (Bits::B8, 32),
    (Bits::B8, 64),
    (Bits::B8, 128),
];

/// (rows, cols) of every quantized matmul of the model at batch 1, plus the LM head.
const REAL: [(usize, usize); 5] = [
    (2048, 512),
    (512, 2048),
    (4096, 2048),
    (2048, 4096),
    (8192, 2048),
];
const LM_HEAD: (usize, usize) = (248_320, 2048);

fn levels() -> Vec<Level> {
    let l = Level::available();
    eprintln!(
        "levels under test: {:?}",
        l.iter().map(|l| l.name()).collect::<Vec<_>>()
    );
    l
}

fn check_gemv_all_levels(m: &QMat, x: &[f32], what: &str) {
    let mut want = vec![0f32; m.rows];
    reference::gemv(&mut want, m.as_ref(), x);
    let mags = magnitudes(m, x);
    for level in levels() {
        let mut got = vec![f32::NAN; m.rows];
        fast::gemv_with(level, &mut got, m.as_ref(), x);
        assert_close(
            &format!("{what} gemv {}", level.name()),
            &got,
            &want,
            &mags,
            m.cols,
        );
    }
}

#[test]
fn levels_are_consistent() {
    assert!(Level::Portable.is_available());
    assert!(Level::available().contains(&Level::best()));
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
    {
        assert!(
            Level::Avx2.is_available(),
            "AVX2 detected but the level is unavailable"
        );
    }
}

#[test]
fn gemv_real_shapes() {
    let mut rng = Rng::new(1);
    for (bits, gs) in [
        (Bits::B4, 64),
        (Bits::B8, 64),
        (Bits::B4, 32),
        (Bits::B8, 128),
    ] {
        for (rows, cols) in REAL {
            let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
            let x = rng.normal_vec(cols, 1.0);
            check_gemv_all_levels(&m, &x, &format!("{rows}x{cols} {bits:?} g{gs}"));
        }
    }
}

#[test]
fn gemv_lm_head() {
    let mut rng = Rng::new(2);
    for bits in [Bits::B4, Bits::B8] {
        let (rows, cols) = LM_HEAD;
        let m = random_qmat(&mut rng, rows, cols, spec(bits, 64));
        let x = rng.normal_vec(cols, 1.0);
        check_gemv_all_levels(&m, &x, &format!("lm_head {bits:?}"));
    }
}

#[test]
fn gemv_edge_sizes() {
    let mut rng = Rng::new(3);
    for (bits, gs) in SPECS {
        for rows in [1, 2, 3, 17] {
            for cols in [gs, 2 * gs, 3 * gs, 128] {
                if cols % gs != 0 {
                    continue;
                }
                let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
                let x = rng.normal_vec(cols, 1.0);
                check_gemv_all_levels(&m, &x, &format!("{rows}x{cols} {bits:?} g{gs}"));
            }
        }
    }
}

/// Integer-exact data: every level must match the reference bit for bit (catches a single
/// misplaced code, which the rounding bound could not see).
#[test]
fn gemv_and_gemm_exact_on_exact_data() {
    let mut rng = Rng::new(4);
    for (bits, gs) in SPECS {
        for (rows, cols) in [(1, gs), (3, 2 * gs), (17, 512), (64, 2048)] {
            let (m, x) = exact_case(&mut rng, rows, cols, spec(bits, gs));
            let mut want = vec![0f32; rows];
            reference::gemv(&mut want, m.as_ref(), &x);
            for level in levels() {
                let mut got = vec![f32::NAN; rows];
                fast::gemv_with(level, &mut got, m.as_ref(), &x);
                assert_eq!(
                    got,
                    want,
                    "gemv {} {rows}x{cols} {bits:?} g{gs}",
                    level.name()
                );
            }
            for t in [5, fast::GEMM_SCRATCH_MIN_TOKENS + 1] {
                let xt: Vec<f32> = (0..t * cols).map(|_| rng.below(17) as f32 - 8.0).collect();
                let mut want_t = vec![0f32; t * rows];
                reference::gemm(&mut want_t, m.as_ref(), &xt, t);
                for level in levels() {
                    let mut got_t = vec![f32::NAN; t * rows];
                    fast::gemm_with(level, &mut got_t, m.as_ref(), &xt, t);
                    assert_eq!(
                        got_t,
                        want_t,
                        "gemm {} t={t} {rows}x{cols} {bits:?} g{gs}",
                        level.name()
                    );
                }
            }
        }
    }
}

/// Fast gemv equals an f32 gemv over `dequantize`'s output (within reassociation error).
#[test]
fn gemv_matches_dense_on_dequantized() {
    let mut rng = Rng::new(5);
    for (bits, gs) in SPECS {
        for (rows, cols) in [(512, 2048), (2048, 512), (17, 96 * gs / 32)] {
            let cols = cols / gs * gs;
            let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
            let x = rng.normal_vec(cols, 1.0);
            let mut w = vec![0f32; rows * cols];
            dequantize(m.as_ref(), &mut w);
            let dense: Vec<f32> = w
                .chunks_exact(cols)
                .map(|row| row.iter().zip(&x).map(|(a, b)| a * b).sum())
                .collect();
            let mags = magnitudes(&m, &x);
            for level in levels() {
                let mut got = vec![0f32; rows];
                fast::gemv_with(level, &mut got, m.as_ref(), &x);
                assert_close(
                    &format!("dense {rows}x{cols} {bits:?} g{gs} {}", level.name()),
                    &got,
                    &dense,
                    &mags,
                    cols,
                );
            }
        }
    }
}

fn check_gemm(m: &QMat, t: usize, rng: &mut Rng, what: &str) {
    let x = rng.normal_vec(t * m.cols, 1.0);
    let mut want = vec![0f32; t * m.rows];
    reference::gemm(&mut want, m.as_ref(), &x, t);
    let mags: Vec<Vec<f64>> = x.chunks_exact(m.cols).map(|xt| magnitudes(m, xt)).collect();
    for level in levels() {
        let mut got = vec![f32::NAN; t * m.rows];
        fast::gemm_with(level, &mut got, m.as_ref(), &x, t);
        for (tt, mags_t) in mags.iter().enumerate() {
            let r = tt * m.rows..(tt + 1) * m.rows;
            assert_close(
                &format!("{what} gemm t={t} tok {tt} {}", level.name()),
                &got[r.clone()],
                &want[r],
                mags_t,
                m.cols,
            );
        }
    }
}

#[test]
fn gemm_edge_sizes() {
    let mut rng = Rng::new(6);
    for (bits, gs) in SPECS {
        for rows in [1, 3, 17, 33] {
            for cols in [gs, 2 * gs] {
                let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
                for t in [1, 2, 3, 4, 5, 9, 17] {
                    check_gemm(&m, t, &mut rng, &format!("{rows}x{cols} {bits:?} g{gs}"));
                }
            }
        }
    }
}

#[test]
fn gemm_real_shapes() {
    let mut rng = Rng::new(7);
    for (bits, gs) in [(Bits::B4, 64), (Bits::B8, 64)] {
        for (rows, cols) in [(2048, 512), (512, 2048), (2048, 4096)] {
            let m = random_qmat(&mut rng, rows, cols, spec(bits, gs));
            for t in [7, fast::GEMM_SCRATCH_MIN_TOKENS + 3] {
                check_gemm(&m, t, &mut rng, &format!("{rows}x{cols} {bits:?} g{gs}"));
            }
        }
    }
}

#[test]
fn gemm_zero_tokens_is_a_no_op() {
    let mut rng = Rng::new(8);
    let m = random_qmat(&mut rng, 4, 64, spec(Bits::B4, 64));
    for level in Level::available() {
        let mut out: Vec<f32> = vec![];
        fast::gemm_with(level, &mut out, m.as_ref(), &[], 0);
    }
}

#[test]
#[should_panic(expected = "x length")]
fn gemv_rejects_wrong_x_length() {
    let mut rng = Rng::new(9);
    let m = random_qmat(&mut rng, 4, 64, spec(Bits::B4, 64));
    let mut out = vec![0f32; 4];
    fast::gemv(&mut out, m.as_ref(), &[0.0; 63]);
}
