//! Prefix reuse gives the same logits and the same tokens as a fresh prefill.

use engine::prefix::NoObserver;
use engine::{Engine, GenerateParams, PrefixCache};
use model::Logits;
use sampler::SamplingParams;

fn tiny_engine() -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    model::synth::write_checkpoint(dir.path(), &model::synth::default_model_config(), 7, true, usize::MAX).unwrap();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/tokenizer");
    for f in ["tokenizer.json", "chat_template.jinja"] {
        std::fs::copy(format!("{root}/{f}"), dir.path().join(f)).unwrap();
    }
    let eng = Engine::open(dir.path(), 4096).unwrap();
    (dir, eng)
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        sampling: SamplingParams { temperature: 0.0, ..SamplingParams::default() },
        max_tokens,
        stop_on_eos: false,
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn cached_prefill_matches_fresh_prefill() {
    let (_d, eng) = tiny_engine();
    let prompt: Vec<u32> = (0..70u32).map(|i| 1000 + i * 37).collect();
    let mut cache = PrefixCache::new(2);
    // Request 1: the prompt, 6 greedy tokens.
    let mut out = Vec::new();
    let r1 = eng
        .generate_cached(&mut cache, &prompt, &greedy(6), &mut NoObserver, |id| {
            out.push(id);
            true
        })
        .unwrap();
    assert_eq!(r1.cached_tokens, 0);
    assert_eq!(out.len(), 6);
    // Request 2: the conversation continues (prompt + the 5 fed outputs + new user tokens).
    let mut p2 = prompt.clone();
    p2.extend_from_slice(&out[..5]);
    p2.extend_from_slice(&[2000, 2001, 2002, 2003]);
    let (_, cached_logits, cached) = eng.prefill_cached(&mut cache, &p2, &mut NoObserver).unwrap();
    assert_eq!(cached, prompt.len() + 5);
    let mut fresh = eng.new_state();
    let fresh_logits = eng.model.forward(&mut fresh, &p2, Logits::Last).unwrap();
    let d = max_abs_diff(&cached_logits, &fresh_logits);
    assert!(d < 1e-4, "cached vs fresh logits differ by {d}");
    // Same prompt again: reused entirely, logits identical to the stored ones.
    let (_, again, cached) = eng.prefill_cached(&mut cache, &p2, &mut NoObserver).unwrap();
    assert_eq!(cached, p2.len());
    assert_eq!(again, cached_logits);
    assert!(cache.hits >= 2);
}

#[test]
fn cached_generation_matches_uncached() {
    let (_d, eng) = tiny_engine();
    let prompt: Vec<u32> = (0..20u32).map(|i| 500 + i * 11).collect();
    let mut plain = Vec::new();
    eng.generate(&prompt, &greedy(8), |id| {
        plain.push(id);
        true
    })
    .unwrap();
    let mut cache = PrefixCache::new(2);
    for round in 0..3 {
        let mut got = Vec::new();
        let r = eng
            .generate_cached(&mut cache, &prompt, &greedy(8), &mut NoObserver, |id| {
                got.push(id);
                true
            })
            .unwrap();
        assert_eq!(got, plain, "round {round}");
        assert_eq!(r.cached_tokens, if round == 0 { 0 } else { prompt.len() });
    }
    // A disabled cache never reuses.
    let mut off = PrefixCache::new(0);
    for _ in 0..2 {
        let r = eng.generate_cached(&mut off, &prompt, &greedy(2), &mut NoObserver, |_| true).unwrap();
        assert_eq!(r.cached_tokens, 0);
    }
}
