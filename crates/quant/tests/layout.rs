//! Packing order, quantize/dequantize round trip and its error budget, expert slicing, config.

mod common;

use common::*;
use half::bf16;
use quant::config::{ModuleQuant, QuantConfig};
use quant::{
    dequantize, dequantize_mlx_bf16, pack_codes, quantize, quantize_with, unpack_codes, Bits,
    QMatRef, QuantError, QuantRule, QuantSpec,
};

#[test]
fn packing_order_element_zero_in_low_bits() {
    // 4-bit: codes 0..7 → nibble k holds element k
    assert_eq!(
        pack_codes(&[0, 1, 2, 3, 4, 5, 6, 7], Bits::B4),
        vec![0x7654_3210]
    );
    assert_eq!(
        pack_codes(&[15, 0, 0, 0, 0, 0, 0, 0], Bits::B4),
        vec![0x0000_000F]
    );
    assert_eq!(
        pack_codes(&[0, 0, 0, 0, 0, 0, 0, 15], Bits::B4),
        vec![0xF000_0000]
    );
    // 8-bit: byte k holds element k, i.e. a little-endian byte stream
    assert_eq!(
        pack_codes(&[0x01, 0x02, 0x03, 0xFF], Bits::B8),
        vec![0xFF03_0201]
    );
    let words = pack_codes(&(0u8..32).collect::<Vec<_>>(), Bits::B8);
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    assert_eq!(bytes, (0u8..32).collect::<Vec<_>>());
}

#[test]
fn pack_unpack_round_trip() {
    let mut rng = Rng::new(11);
    for bits in [Bits::B4, Bits::B8] {
        let codes: Vec<u8> = (0..4096)
            .map(|_| rng.below(bits.max_code() as u64 + 1) as u8)
            .collect();
        let words = pack_codes(&codes, bits);
        assert_eq!(words.len(), 4096 / bits.per_word());
        let mut back = vec![0u8; codes.len()];
        unpack_codes(&words, bits, &mut back);
        assert_eq!(back, codes);
        // and the other way: arbitrary words survive unpack → pack
        let words: Vec<u32> = (0..512).map(|_| rng.next_u32()).collect();
        let mut codes = vec![0u8; 512 * bits.per_word()];
        unpack_codes(&words, bits, &mut codes);
        assert_eq!(pack_codes(&codes, bits), words);
    }
}

#[test]
fn code_accessor_matches_unpack() {
    let mut rng = Rng::new(12);
    let m = random_qmat(&mut rng, 3, 128, spec(Bits::B4, 32));
    let mut codes = vec![0u8; 128];
    unpack_codes(&m.packed[16..32], Bits::B4, &mut codes);
    for (c, &q) in codes.iter().enumerate() {
        assert_eq!(m.as_ref().code(1, c), u32::from(q));
    }
}

/// Error budget of quantize → dequantize, per element (derivation in README.md):
/// * code strictly inside `(0, n)`: `|w − ŵ| ≤ |s|/2` plus the bf16 rounding of the stored scale
///   (`≤ n·|s|·2⁻⁸`, as `|s_f32| ≤ |s_bf16|·(1 + 2⁻⁸)`) and of the bias (`|b|·2⁻⁸`, zero for
///   bf16 inputs);
/// * code at the clamped far end: `≤ |s|` instead of `|s|/2` (MLX moves the scale so the
///   larger-magnitude extreme is exact; the other end can then land up to one step past `n`).
fn check_round_trip(w: &[f32], rows: usize, cols: usize, sp: QuantSpec, what: &str) -> (f64, f64) {
    let m = quantize(w, rows, cols, sp).unwrap();
    let mut d = vec![0f32; rows * cols];
    dequantize(m.as_ref(), &mut d);
    let n = sp.bits.max_code() as f64;
    let u8_ = 2f64.powi(-8);
    let mut worst_inner = 0f64;
    let mut worst_any = 0f64;
    for r in 0..rows {
        for c in 0..cols {
            let (s, b) = m.as_ref().scale_bias(r, c);
            let (s, b) = (s.abs() as f64, b.abs() as f64);
            let q = m.as_ref().code(r, c) as f64;
            let err = (w[r * cols + c] as f64 - d[r * cols + c] as f64).abs();
            let rounding = n * s * u8_ * 1.01 + b * u8_ + 1e-6 * s + 1e-12;
            let inner = q > 0.0 && q < n;
            let budget = if inner {
                0.5 * s * (1.0 + u8_) + rounding
            } else {
                s * (1.0 + u8_) + rounding
            };
            assert!(
                err <= budget,
                "{what}: [{r},{c}] w={} deq={} q={q} s={s:e} b={b:e}: err {err:e} > budget {budget:e}",
                w[r * cols + c],
                d[r * cols + c]
            );
            if s > 1e-6 {
                worst_any = worst_any.max(err / s);
                if inner {
                    worst_inner = worst_inner.max(err / s);
                }
            }
        }
    }
    (worst_inner, worst_any)
}

#[test]
fn quantize_dequantize_error_budget() {
    let mut rng = Rng::new(13);
    let (rows, cols) = (16, 512);
    for bits in [Bits::B4, Bits::B8] {
        for gs in [32, 64, 128] {
            let sp = spec(bits, gs);
            let mut normal = rng.normal_vec(rows * cols, 0.02);
            to_bf16_precision(&mut normal);
            let mut uniform: Vec<f32> = (0..rows * cols)
                .map(|_| rng.range(-1.0, 1.0) as f32)
                .collect();
            to_bf16_precision(&mut uniform);
            let raw_f32 = rng.normal_vec(rows * cols, 0.05);
            let mut skewed: Vec<f32> = (0..rows * cols)
                .map(|_| rng.range(0.5, 3.0) as f32)
                .collect();
            to_bf16_precision(&mut skewed);
            for (name, w) in [
                ("normal", &normal),
                ("uniform", &uniform),
                ("f32", &raw_f32),
                ("positive", &skewed),
            ] {
                let (inner, any) =
                    check_round_trip(w, rows, cols, sp, &format!("{name} {bits:?} g{gs}"));
                eprintln!(
                    "{name:8} {bits:?} g{gs:3}: max |err|/|s| inner {inner:.4}, any {any:.4}"
                );
            }
        }
    }
}

#[test]
fn quantize_pins_the_larger_extreme_and_zero() {
    // bf16 inputs: the bias is exactly the larger-magnitude extreme (code 0), scale sign follows
    let mut rng = Rng::new(14);
    let mut w = rng.normal_vec(64 * 64, 0.02);
    to_bf16_precision(&mut w);
    let m = quantize(&w, 64, 64, spec(Bits::B4, 64)).unwrap();
    let mut d = vec![0f32; w.len()];
    dequantize(m.as_ref(), &mut d);
    for r in 0..64 {
        let g = &w[r * 64..(r + 1) * 64];
        let (mn, mx) = g
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let edge = if mn.abs() > mx.abs() { mn } else { mx };
        assert_eq!(m.biases[r].to_f32(), edge, "row {r}");
        assert_eq!(
            m.scales[r].to_f32() < 0.0,
            mn.abs() <= mx.abs(),
            "row {r} scale sign"
        );
        let i = g.iter().position(|&v| v == edge).unwrap();
        assert_eq!(d[r * 64 + i], edge, "extreme reproduced exactly");
    }
}

#[test]
fn quantize_edge_cases() {
    // constant group: all codes 0, bias = the value, |scale| ≈ 1e-7
    let w = vec![0.5f32; 64];
    let m = quantize(&w, 1, 64, spec(Bits::B4, 64)).unwrap();
    assert!(m.packed.iter().all(|&p| p == 0));
    assert_eq!(m.biases[0].to_f32(), 0.5);
    assert!(
        (m.scales[0].to_f32().abs() - 1e-7).abs() < 1e-9,
        "scale {}",
        m.scales[0]
    );
    // all zeros: scale = bf16(-1e-7), bias 0, codes 0
    let m = quantize(&[0.0; 32], 1, 32, spec(Bits::B8, 32)).unwrap();
    assert!(m.packed.iter().all(|&p| p == 0));
    assert_eq!(m.biases[0].to_f32(), 0.0);
    assert_eq!(m.scales[0], bf16::from_f32(-1e-7));
    // ties round to even on the CPU rule, away from zero on the Metal rule:
    // group {-1, 0.875, -1 + 2.5·0.125}: scale 0.125, bias -1, third value sits on code 2.5
    let mut g = vec![-1.0f32; 32];
    g[1] = 0.875;
    g[2] = -1.0 + 2.5 * 0.125;
    let cpu = quantize(&g, 1, 32, spec(Bits::B4, 32)).unwrap();
    let metal = quantize_with(&g, 1, 32, spec(Bits::B4, 32), QuantRule::MlxMetal).unwrap();
    assert_eq!(cpu.scales[0].to_f32(), 0.125);
    assert_eq!(cpu.as_ref().code(0, 2), 2);
    assert_eq!(metal.as_ref().code(0, 2), 3);
    // Metal's max starts at 0: an all-negative group gets range [min, 0]
    let neg: Vec<f32> = (0..32).map(|i| -1.0 + i as f32 / 64.0).collect();
    let cpu = quantize(&neg, 1, 32, spec(Bits::B4, 32)).unwrap();
    let metal = quantize_with(&neg, 1, 32, spec(Bits::B4, 32), QuantRule::MlxMetal).unwrap();
    assert!(metal.scales[0].to_f32() > cpu.scales[0].to_f32());
}

#[test]
fn quantize_rejects_bad_input() {
    let e = quantize(&[0.0; 48], 1, 48, spec(Bits::B4, 32)).unwrap_err();
    assert_eq!(
        e,
        QuantError::ColsNotMultipleOfGroup {
            cols: 48,
            group_size: 32
        }
    );
    assert!(e.to_string().contains("48") && e.to_string().contains("32"));
    let e = quantize(&[0.0; 64], 2, 64, spec(Bits::B4, 64)).unwrap_err();
    assert!(e.to_string().contains("input length"), "{e}");
    let mut w = vec![0.0f32; 64];
    w[37] = f32::NAN;
    assert!(matches!(
        quantize(&w, 1, 64, spec(Bits::B4, 64)),
        Err(QuantError::NonFinite {
            row: 0,
            col: 37,
            ..
        })
    ));
    assert!(matches!(
        quantize(&[0.0; 48], 1, 48, spec(Bits::B4, 48)),
        Err(QuantError::UnsupportedGroupSize(48))
    ));
}

#[test]
fn mlx_dequantize_twin_is_close_to_f32_dequantize() {
    let mut rng = Rng::new(15);
    let m = random_qmat(&mut rng, 8, 256, spec(Bits::B4, 64));
    let mut a = vec![0f32; 8 * 256];
    let mut b = vec![bf16::ZERO; 8 * 256];
    dequantize(m.as_ref(), &mut a);
    dequantize_mlx_bf16(m.as_ref(), &mut b);
    for (x, y) in a.iter().zip(&b) {
        // two bf16 roundings of values below 2·max|s·q| + |b|
        assert!((x - y.to_f32()).abs() <= 2f32.powi(-7) * 0.7, "{x} vs {y}");
    }
}

#[test]
fn expert_slicing() {
    let mut rng = Rng::new(16);
    let sp = spec(Bits::B4, 64);
    let (e, rows, cols) = (5, 8, 128);
    let ms: Vec<_> = (0..e)
        .map(|_| random_qmat(&mut rng, rows, cols, sp))
        .collect();
    let packed: Vec<u32> = ms.iter().flat_map(|m| m.packed.clone()).collect();
    let scales: Vec<bf16> = ms.iter().flat_map(|m| m.scales.clone()).collect();
    let biases: Vec<bf16> = ms.iter().flat_map(|m| m.biases.clone()).collect();
    for (i, m) in ms.iter().enumerate() {
        let v = QMatRef::expert(e, i, rows, cols, sp, &packed, &scales, &biases).unwrap();
        assert_eq!(v.packed, &m.packed[..]);
        assert_eq!(v.scales, &m.scales[..]);
        assert_eq!(v.biases, &m.biases[..]);
    }
    let err = QMatRef::expert(e, 5, rows, cols, sp, &packed, &scales, &biases).unwrap_err();
    assert!(err.to_string().contains("expert index"), "{err}");
    let err = QMatRef::expert(e, 0, rows, cols, sp, &packed, &scales[1..], &biases).unwrap_err();
    assert!(err.to_string().contains("stacked scales length"), "{err}");
    let sub = ms[0].as_ref().slice_rows(2, 5);
    assert_eq!(sub.rows, 3);
    assert_eq!(sub.code(0, 7), ms[0].as_ref().code(2, 7));
}

#[test]
fn config_section() {
    let cfg: serde_json::Value = serde_json::from_str(
        r#"{"model_type":"qwen3_5_moe","quantization":{"group_size":64,"bits":4,"mode":"affine",
            "language_model.model.layers.0.mlp.gate":{"group_size":64,"bits":8},
            "language_model.model.layers.0.mlp.shared_expert_gate":{"group_size":64,"bits":8},
            "language_model.model.layers.0.linear_attn.in_proj_a":false}}"#,
    )
    .unwrap();
    let q = QuantConfig::from_model_config(&cfg).unwrap().unwrap();
    assert_eq!(q.default, QuantSpec::new(4, 64).unwrap());
    let eight = ModuleQuant::Quantized(QuantSpec::new(8, 64).unwrap());
    assert_eq!(
        q.module("language_model.model.layers.0.mlp.gate", true),
        eight
    );
    assert_eq!(
        q.module("language_model.model.layers.0.mlp.shared_expert_gate", true),
        eight
    );
    assert_eq!(
        q.module("language_model.model.layers.0.linear_attn.in_proj_a", true),
        ModuleQuant::Unquantized
    );
    assert_eq!(
        q.module("language_model.lm_head", true),
        ModuleQuant::Quantized(q.default)
    );
    assert_eq!(
        q.module("language_model.model.norm", false),
        ModuleQuant::Unquantized
    );
    // no section: unquantized checkpoint
    assert_eq!(
        QuantConfig::from_model_config(&serde_json::json!({"model_type": "x"})).unwrap(),
        None
    );
    // bad values are named
    let bad = serde_json::json!({"quantization": {"group_size": 48, "bits": 4}});
    assert!(matches!(
        QuantConfig::from_model_config(&bad),
        Err(QuantError::UnsupportedGroupSize(48))
    ));
    let bad = serde_json::json!({"quantization": {"group_size": 64, "bits": 4, "mode": "mxfp4"}});
    assert!(QuantConfig::from_model_config(&bad)
        .unwrap_err()
        .to_string()
        .contains("mode"));
    let bad = serde_json::json!({"quantization": {"group_size": 64}});
    assert!(QuantConfig::from_model_config(&bad)
        .unwrap_err()
        .to_string()
        .contains("bits"));
}
