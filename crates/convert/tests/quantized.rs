//! Quantized checkpoints end to end: convert the transformers fixtures into MLX's layout, load
//! them, and hold the logits to stated budgets; synth → convert → load round trips; corrupt
//! quantized folders are refused with clear errors.
//!
//! Two checks per fixture and bit width:
//! 1. Exactness of the quantized path: the quantized model equals the reference forward pass on
//!    its own dequantized weights (`convert::dequantize_to_hf`) to f32 round-off (≤ 1e-4), with
//!    identical argmax at every position. The reference is itself checked against transformers.
//! 2. Drift against the bf16 original, held to budgets. The fixtures are random-weight models
//!    whose greedy top-2 margins go down to 1.3e-3 and whose logits move by 0.061 when only the
//!    activations are rounded to bf16 (fixture README); storing the zero-centred norms as
//!    bf16(1 + w), as MLX's layout does, alone moves tiny-a's logits by 0.045 (measured). So
//!    weight quantization noise flips some greedy choices on these fixtures by construction.
//!    Measured on tiny-a (logits span ±1.15): 8-bit g32 max |Δ| 0.13, top-1 agreement 86%;
//!    4-bit g32 max |Δ| 1.07, agreement 13% — at 4 bits these random models are pure noise,
//!    as large as the effect of a layout bug, so check 1 carries the 4-bit correctness and the
//!    4-bit drift budget here (2.0 / 5%) only catches blow-ups (NaN, wrong scale). The 8-bit
//!    budget (0.25 / 80%, about 2× measured) still fails on layout bugs, which move logits by
//!    ≥ 0.6 (sensitivity table).

use std::path::{Path, PathBuf};

use model::{Logits, Model};
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures").join(name)
}

fn no_progress(_: u64, _: u64) {}

fn refs(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("references.safetensors")).unwrap()
}

fn ids(st: &SafeTensors<'_>, name: &str) -> Vec<u32> {
    st.tensor(name).unwrap().data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    st.tensor(name).unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn argmax(x: &[f32]) -> usize {
    let mut b = 0;
    for i in 0..x.len() {
        if x[i] > x[b] {
            b = i;
        }
    }
    b
}

/// A private copy of the built-in demo model (assets/demo), the 8-bit MLX-layout weights.
fn demo_copy() -> tempfile::TempDir {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let demo = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json", "calla_vocab.json", "model.safetensors"] {
        std::fs::copy(root.join("assets/demo").join(f), demo.path().join(f)).unwrap();
    }
    demo
}

/// The 7 golden sequences of the demo model (prompt + transformers' continuation), model rows.
fn golden_sequences() -> Vec<Vec<u32>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let refs: serde_json::Value = serde_json::from_slice(&std::fs::read(root.join("testdata/demo/reference_ids_8bit.json")).unwrap()).unwrap();
    refs["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["prompt_compact_ids"].as_array().unwrap().iter().chain(p["gen_compact_ids"].as_array().unwrap()).map(|x| x.as_u64().unwrap() as u32).collect())
        .collect()
}

/// (top-1 agreement, max |Δlogit| over finite logits, positions) of `b` against `a`, one full
/// pass per sequence.
fn agreement(a: &Model, b: &Model, seqs: &[Vec<u32>]) -> (f64, f32, usize) {
    let v = a.cfg.vocab_size;
    let (mut worst, mut agree, mut total) = (0.0f32, 0usize, 0usize);
    for seq in seqs {
        let la = a.forward(&mut a.new_state(1024), seq, Logits::All).unwrap();
        let lb = b.forward(&mut b.new_state(1024), seq, Logits::All).unwrap();
        for (x, y) in la.chunks(v).zip(lb.chunks(v)) {
            worst = x.iter().zip(y).filter(|(p, _)| p.is_finite()).map(|(p, q)| (p - q).abs()).fold(worst, f32::max);
            agree += (argmax(x) == argmax(y)) as usize;
            total += 1;
        }
    }
    (agree as f64 / total as f64, worst, total)
}

/// (max |Δlogit| vs transformers over seq_logits, top-1 agreement fraction, greedy ids equal).
fn evaluate(fixture_dir: &Path, model_dir: &Path) -> (f32, f64, bool) {
    let m = Model::open(model_dir).unwrap();
    let bytes = refs(fixture_dir);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let v = m.cfg.vocab_size;
    let (mut worst, mut agree, mut total, mut ids_equal) = (0.0f32, 0usize, 0usize, true);
    for i in 0.. {
        if st.tensor(&format!("p{i}.seq_ids")).is_err() {
            break;
        }
        let seq = ids(&st, &format!("p{i}.seq_ids"));
        let want = f32s(&st, &format!("p{i}.seq_logits"));
        let mut s = m.new_state(4096);
        let got = m.forward(&mut s, &seq, Logits::All).unwrap();
        for (g, w) in got.chunks(v).zip(want.chunks(v)) {
            worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
            agree += (argmax(g) == argmax(w)) as usize;
            total += 1;
        }
        // Greedy decode with the cache.
        let prompt = ids(&st, &format!("p{i}.prompt_ids"));
        let gen = ids(&st, &format!("p{i}.gen_ids"));
        let mut s = m.new_state(4096);
        let mut l = m.forward(&mut s, &prompt, Logits::Last).unwrap();
        for want_id in &gen {
            let next = argmax(&l) as u32;
            if next != *want_id {
                ids_equal = false;
                break;
            }
            l = m.forward(&mut s, &[next], Logits::Last).unwrap();
        }
    }
    (worst, agree as f64 / total as f64, ids_equal)
}

#[test]
fn converted_fixtures_within_budget() {
    for name in ["tiny-a", "tiny-b"] {
        let src = fixture(name);
        for bits in [8u32, 4] {
            let out = tempfile::tempdir().unwrap();
            convert::convert_dir(&src, out.path(), bits, 32, 1 << 20, &no_progress).unwrap();
            let (err, agree, ids_equal) = evaluate(&src, out.path());
            eprintln!("{name} {bits}-bit g32: max |Δlogit| {err:.4}, top-1 agreement {:.1}%, greedy ids equal: {ids_equal}", agree * 100.0);
            let (max_err, min_agree) = if bits == 8 { (0.25, 0.80) } else { (2.0, 0.05) };
            assert!(err <= max_err, "{name} {bits}-bit: max |Δlogit| {err} > {max_err}");
            assert!(agree >= min_agree, "{name} {bits}-bit: top-1 agreement {agree} < {min_agree}");
            let _ = ids_equal;
            // The quantized model computes exactly the reference forward pass on its
            // dequantized weights: same logits to f32 round-off, same greedy ids.
            let q = Model::open(out.path()).unwrap();
            let deq = tempfile::tempdir().unwrap();
            let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap()).unwrap();
            convert::dequantize_to_hf(&q, &config, deq.path()).unwrap();
            let mut r = Model::open(deq.path()).unwrap();
            r.backend = model::Backend::Reference;
            let bytes = refs(&src);
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for i in 0..6 {
                let Ok(t) = st.tensor(&format!("p{i}.seq_ids")) else { break };
                let seq: Vec<u32> = t.data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32).collect();
                let a = q.forward(&mut q.new_state(4096), &seq, Logits::All).unwrap();
                let b = r.forward(&mut r.new_state(4096), &seq, Logits::All).unwrap();
                let e = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
                assert!(e <= 1e-4, "{name} {bits}-bit p{i}: quantized vs dequantized-reference max |Δ| {e}");
                let v = q.cfg.vocab_size;
                let ga: Vec<usize> = a.chunks(v).map(argmax).collect();
                let gb: Vec<usize> = b.chunks(v).map(argmax).collect();
                assert_eq!(ga, gb, "{name} {bits}-bit p{i}: argmax differs from the dequantized reference");
            }
        }
    }
}

/// Synth at 16 bits then convert equals synth at 4 bits with the same seed, byte for byte, and
/// both load and run.
#[test]
fn synth_convert_load_round_trip() {
    let cfg = model::synth::default_model_config();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let c = tempfile::tempdir().unwrap();
    convert::synth(a.path(), &cfg, 16, 5, 1 << 22, &no_progress).unwrap();
    convert::convert_dir(a.path(), b.path(), 4, 64, 1 << 22, &no_progress).unwrap();
    convert::synth(c.path(), &cfg, 4, 5, 1 << 22, &no_progress).unwrap();
    let files = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    assert_eq!(files(b.path()), files(c.path()));
    for f in files(b.path()) {
        assert_eq!(std::fs::read(b.path().join(&f)).unwrap(), std::fs::read(c.path().join(&f)).unwrap(), "{f} differs");
    }
    // Converting twice gives identical bytes.
    let d = tempfile::tempdir().unwrap();
    convert::convert_dir(a.path(), d.path(), 4, 64, 1 << 22, &no_progress).unwrap();
    for f in files(b.path()) {
        assert_eq!(std::fs::read(b.path().join(&f)).unwrap(), std::fs::read(d.path().join(&f)).unwrap(), "{f} not reproducible");
    }
    let dense = Model::open(a.path()).unwrap();
    let q = Model::open(b.path()).unwrap();
    assert!(q.weights.layout.mlx_sanitized);
    let prompt = [1u32, 2, 3, 1000, 248045];
    let l16 = dense.forward(&mut dense.new_state(64), &prompt, Logits::Last).unwrap();
    let l4 = q.forward(&mut q.new_state(64), &prompt, Logits::Last).unwrap();
    let err = l16.iter().zip(&l4).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    let scale = l16.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    eprintln!("default-config synth: 4-bit vs bf16 last logits max |Δ| {err:.4} (max |logit| {scale:.3})");
    assert!(err <= 0.5 * scale.max(0.1), "4-bit logits drift {err} vs scale {scale}");
    // The fast and reference kernels agree on the quantized model.
    let mut qr = Model::open(b.path()).unwrap();
    qr.backend = model::Backend::Reference;
    let lr = qr.forward(&mut qr.new_state(64), &prompt, Logits::Last).unwrap();
    let e = l4.iter().zip(&lr).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(e <= 1e-4, "fast vs reference {e}");
}

fn damaged(f: impl FnOnce(&Path)) -> String {
    let src = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    convert::synth(src.path(), &model::synth::default_model_config(), 4, 9, 1 << 30, &no_progress).unwrap();
    let _ = out;
    f(src.path());
    match Model::open(src.path()) {
        Ok(_) => panic!("damaged folder loaded"),
        Err(e) => e.to_string(),
    }
}

fn edit_tensors(dir: &Path, f: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    f(&mut ts);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        ts.iter().map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &p).unwrap();
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn corrupt_quantized_folders_are_refused() {
    let t = "language_model.model.layers.0.linear_attn.in_proj_z";
    // Missing scales.
    let e = damaged(|d| edit_tensors(d, |ts| ts.retain(|x| x.0 != format!("{t}.scales"))));
    assert!(e.contains(&format!("{t}.scales")) && e.contains("missing"), "{e}");
    // Wrong group size: config says 32 where the tensors were made with 64.
    let e = damaged(|d| edit_config(d, |v| v["quantization"]["group_size"] = 32.into()));
    assert!(e.contains("group_size") || e.contains("group size"), "{e}");
    // The quantization section disagrees with the tensors: 8 bits said, 4 stored.
    let e = damaged(|d| edit_config(d, |v| v["quantization"]["bits"] = 8.into()));
    assert!(e.contains("quantization") && e.contains(t.split('.').next().unwrap()), "{e}");
    // Mismatched shapes: scales of another matrix.
    let e = damaged(|d| {
        edit_tensors(d, |ts| {
            let other = ts.iter().find(|x| x.0 == "language_model.model.layers.0.linear_attn.in_proj_b.scales").unwrap().clone();
            let s = ts.iter_mut().find(|x| x.0 == format!("{t}.scales")).unwrap();
            s.2 = other.2;
            s.3 = other.3;
        })
    });
    assert!(e.contains("scales"), "{e}");
    // Quantized tensors but no quantization section at all.
    let e = damaged(|d| {
        edit_config(d, |v| {
            v.as_object_mut().unwrap().remove("quantization");
            v.as_object_mut().unwrap().remove("quantization_config");
        })
    });
    assert!(e.contains("no `quantization` section"), "{e}");
    // Unsupported bits in the section.
    let e = damaged(|d| edit_config(d, |v| v["quantization"]["bits"] = 3.into()));
    assert!(e.contains("quantization.bits"), "{e}");
}

/// 4-bit and 8-bit on a trained model (the built-in demo model): the f32 path is the
/// reference forward pass on the demo's weights dequantized to f32; the quantized paths
/// requantize exactly those weights with group 64 (MLX's default) and run the fast kernels.
/// Evaluated on the 7 golden sequences (prompt + transformers' continuation, code and chat,
/// 305 positions).
///
/// Budgets, set from the measurement (printed) with the kernels' exactness proven separately
/// (`converted_fixtures_within_budget`, check 1), so these bound quantization noise only:
/// - 8-bit: top-1 agreement ≥ 95%, max |Δlogit| ≤ 4.0. Measured 97.0% and 2.8. For scale: the
///   shipped 8-bit demo against its bf16 original moves the logits of one chat sequence by at
///   most 0.67 (agreement 98%); requantizing the dequantized 8-bit weights adds a second,
///   independent rounding on a misaligned grid, and the worst of 305 positions is a
///   low-margin one. Logits span −17…+25.
/// - 4-bit: top-1 agreement ≥ 80%, max |Δlogit| ≤ 7.0. Measured 83.6% and 5.0: the step is
///   16× coarser (range/15) and this model is tiny (width 320, so each output sums only 320
///   products and errors average out less than at width 2048); its logits span ~±20 on
///   peaked positions, and the flips happen where the top-2 margin is small. A layout bug
///   scrambles the distribution (agreement near 1/16384), far outside either budget.
#[test]
fn quantized_on_the_trained_demo_model() {
    let demo = demo_copy();
    let m8 = Model::open(demo.path()).unwrap();
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(demo.path().join("config.json")).unwrap()).unwrap();
    let f32dir = tempfile::tempdir().unwrap();
    convert::dequantize_to_hf(&m8, &config, f32dir.path()).unwrap();
    std::fs::copy(demo.path().join("calla_vocab.json"), f32dir.path().join("calla_vocab.json")).unwrap();
    let f = Model::open(f32dir.path()).unwrap();
    let seqs = golden_sequences();
    for (bits, min_agree, max_err) in [(8u32, 0.95, 4.0f32), (4, 0.80, 7.0)] {
        let qdir = tempfile::tempdir().unwrap();
        convert::convert_dir(f32dir.path(), qdir.path(), bits, 64, 1 << 30, &no_progress).unwrap();
        let q = Model::open(qdir.path()).unwrap();
        let (frac, worst, total) = agreement(&f, &q, &seqs);
        eprintln!("demo model {bits}-bit g64 vs f32: top-1 agreement {:.1}% over {total} positions, max |Δlogit| {worst:.3}", frac * 100.0);
        assert!(frac >= min_agree, "{bits}-bit top-1 agreement {frac} < {min_agree}");
        assert!(worst <= max_err, "{bits}-bit max |Δlogit| {worst} > {max_err}");
    }
}

/// `Backend::FastQ8` (int8 activations for prefill) against `Backend::Fast` on the built-in
/// demo model (8-bit weights), over the 7 golden sequences, one full-sequence pass each (every
/// product has t > 1, so every matrix goes through `gemm_q8act`).
///
/// Budget: top-1 agreement ≥ 93% and max |Δlogit| ≤ 3.0; measured 95.7% and 2.0. Each
/// activation moves by at most max|x_g|/254 of its 64-wide group, so an outlier channel makes
/// the rounding coarse for its whole group (why llama.cpp uses blocks of 32); the effect is of
/// the same order as requantizing this model's weights at 8 bits (97.0% / 2.8, see
/// `quantized_on_the_trained_demo_model`). The kernel itself equals its reference bit for bit
/// (quant/tests/q8act.rs); this bounds the approximation, and a wrong scale or layout would
/// scramble the logits far outside it.
#[test]
fn int8_activations_on_the_demo_model() {
    let demo = demo_copy();
    let fast = Model::open(demo.path()).unwrap();
    let mut q8 = Model::open(demo.path()).unwrap();
    q8.backend = model::Backend::FastQ8;
    let (frac, worst, total) = agreement(&fast, &q8, &golden_sequences());
    eprintln!("demo model int8 activations vs f32 activations: top-1 agreement {:.1}% over {total} positions, max |Δlogit| {worst:.3}", frac * 100.0);
    assert!(frac >= 0.93, "top-1 agreement {frac}");
    assert!(worst <= 3.0, "max |Δlogit| {worst}");
}
