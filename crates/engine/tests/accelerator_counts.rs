//! Expert-load telemetry from an accelerator: the counts it keeps on the device reach the
//! observer once per generation (`Accelerator::take_expert_counts` →
//! `Observer::expert_counts`), on success and when a step fails, and not when the observer does
//! not ask for experts.

use std::sync::{Arc, Mutex};

use engine::{Accelerator, Engine, EngineError, GenerateParams, Observer, PrefixCache};
use sampler::SamplingParams;

/// A device double: fixed tokens, and per generation counts `[layer][expert] = layer + generation`
/// for expert `layer` (a pattern no real routing makes, so nothing else can produce it).
struct FakeDevice {
    layers: usize,
    experts: usize,
    generation: u64,
    steps: usize,
    fail_at_step: Option<usize>,
    taken: Arc<Mutex<usize>>,
}

impl Accelerator for FakeDevice {
    fn describe(&self) -> String {
        "fake".into()
    }
    fn check_sampling(&self, _params: &SamplingParams) -> Result<(), EngineError> {
        Ok(())
    }
    fn reusable(&self, _prompt: &[u32]) -> usize {
        0
    }
    fn start(&mut self, _prompt: &[u32], _params: &SamplingParams, _keep: usize) -> Result<(u32, usize), EngineError> {
        self.generation += 1;
        self.steps = 0;
        Ok((1000, 0))
    }
    fn finish(&mut self, _keep: usize) {}
    fn step(&mut self) -> Result<u32, EngineError> {
        self.steps += 1;
        if self.fail_at_step == Some(self.steps) {
            return Err(EngineError::Accelerator("injected device error".into()));
        }
        Ok(1000 + self.steps as u32)
    }
    fn take_expert_counts(&mut self) -> Option<Vec<Vec<u64>>> {
        *self.taken.lock().unwrap() += 1;
        let mut c = vec![vec![0u64; self.experts]; self.layers];
        for (l, row) in c.iter_mut().enumerate() {
            row[l % self.experts] = l as u64 + self.generation;
        }
        Some(c)
    }
}

/// Sums what `expert_counts` reports; `want` says whether it asks for experts at all.
struct Counts {
    want: bool,
    rows: Vec<Vec<u64>>,
    calls: usize,
}

impl Observer for Counts {
    fn wants_experts(&self) -> bool {
        self.want
    }
    fn expert_counts(&mut self, layer: usize, counts: &[u64]) {
        self.calls += 1;
        if self.rows.len() <= layer {
            self.rows.resize(layer + 1, Vec::new());
        }
        let row = &mut self.rows[layer];
        row.resize(counts.len(), 0);
        for (a, b) in row.iter_mut().zip(counts) {
            *a += b;
        }
    }
}

fn engine_with(fail_at_step: Option<usize>) -> (tempfile::TempDir, Engine, Arc<Mutex<usize>>) {
    let dir = tempfile::tempdir().unwrap();
    model::synth::write_checkpoint(dir.path(), &model::synth::default_model_config(), 7, true, usize::MAX).unwrap();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/tokenizer");
    for f in ["tokenizer.json", "chat_template.jinja"] {
        std::fs::copy(format!("{root}/{f}"), dir.path().join(f)).unwrap();
    }
    let mut eng = Engine::open(dir.path(), 256).unwrap();
    let taken = Arc::new(Mutex::new(0));
    let (layers, experts) = (eng.model.cfg.layer_types.len(), eng.model.cfg.num_experts);
    eng.set_accelerator(Box::new(FakeDevice { layers, experts, generation: 0, steps: 0, fail_at_step, taken: taken.clone() }));
    (dir, eng, taken)
}

fn params() -> GenerateParams {
    GenerateParams { sampling: SamplingParams { temperature: 0.0, ..SamplingParams::default() }, max_tokens: 5, stop_on_eos: false }
}

#[test]
fn device_expert_counts_reach_the_observer_once_per_generation() {
    let (_d, eng, taken) = engine_with(None);
    let (layers, experts) = (eng.model.cfg.layer_types.len(), eng.model.cfg.num_experts);
    let mut cache = PrefixCache::new(0);
    let mut obs = Counts { want: true, rows: Vec::new(), calls: 0 };
    for _ in 0..2 {
        let r = eng.generate_cached(&mut cache, &[10, 11, 12], &params(), &mut obs, |_| true).unwrap();
        assert_eq!(r.stats.generated_tokens, 5);
    }
    assert_eq!(*taken.lock().unwrap(), 2, "one take per generation");
    assert_eq!(obs.calls, 2 * layers, "one report per layer and generation");
    for (l, row) in obs.rows.iter().enumerate() {
        assert_eq!(row.len(), experts);
        // generations 1 and 2: (l + 1) + (l + 2)
        assert_eq!(row[l % experts], 2 * l as u64 + 3, "layer {l}");
        assert_eq!(row.iter().sum::<u64>(), 2 * l as u64 + 3, "layer {l}: nothing else counted");
    }
}

#[test]
fn counts_are_reported_when_a_step_fails_and_not_taken_when_unwanted() {
    let (_d, eng, taken) = engine_with(Some(2));
    let mut cache = PrefixCache::new(0);
    let mut obs = Counts { want: true, rows: Vec::new(), calls: 0 };
    let err = eng.generate_cached(&mut cache, &[10, 11, 12], &params(), &mut obs, |_| true).unwrap_err();
    assert!(matches!(err, EngineError::Accelerator(_)), "{err}");
    assert_eq!(*taken.lock().unwrap(), 1, "the failed generation's counts are still taken");
    assert_eq!(obs.rows.first().map(|r| r[0]), Some(1));

    let (_d2, eng2, taken2) = engine_with(None);
    let mut quiet = Counts { want: false, rows: Vec::new(), calls: 0 };
    eng2.generate_cached(&mut cache, &[10, 11, 12], &params(), &mut quiet, |_| true).unwrap();
    assert_eq!(*taken2.lock().unwrap(), 0, "not taken for an observer that wants no experts");
    assert_eq!(quiet.calls, 0);
}
