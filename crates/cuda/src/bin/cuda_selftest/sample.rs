//! On-device sampling (`kernels/sample.cu`, `CudaContext::sample_step`) against the CPU sampler
//! `sampler::Sampler`, token for token, at the production size (`VOCAB` rows, `vocab_limit =
//! VOCAB_REAL`).
//!
//! * Sequences: for each parameter set (greedy; temperature 0.6 / 1.0 / 1.5 / 1e-40; top-k 1, 20,
//!   50, 200, 1024; top-p 0.8, 0.95; min-p; the Qwen defaults; penalties with a history), 64
//!   consecutive calls with the same seed on both sides, the CPU sampler told about the tokens it
//!   picked and the GPU counting its own. The rows cycle through 12 kinds: random logits with a
//!   few likely tokens that repeat (so the penalties see a history), 30 ids tied at the 16th
//!   level (top-k / top-p boundary), a tier of 200 equal logits on top (the top-p boundary
//!   inside a tie), NaN every 7th id, two +inf, all -inf, all NaN, NaN then -inf, all equal, the
//!   largest values beyond `vocab_limit` with a wide spread, and signed zeros at the top-k
//!   boundary. Each call: the token (`ids[q]`) equals the CPU's and the penalised logits the
//!   kernels leave in the row equal the CPU's bit for bit; at the end the RNG position equals
//!   the number of non-greedy calls, the device counts equal the histogram of the tokens, `pos`
//!   advanced once per call, the prompt and the guard words are untouched. The steps replay from
//!   a captured graph (alternately with programmatic dependent launch), one set launches
//!   directly. With penalties the greedy pick is also checked against `argmax_step` on the
//!   penalised row.
//! * `vocab_limit` 1,000 and 0 (rows of `VOCAB`), a prompt (steps at prompt positions write
//!   nothing and use no random number), the end of the history, and `sample_reset` (the same
//!   seed replays the same tokens; a new seed follows a new CPU sampler).
//!
//! Every comparison is equality; mismatches are counted and the first few printed.
//! Timing: median µs per call for a few parameter sets (graph replay of 16 calls).

use cuda::cudarc::driver::CudaSlice;
use cuda::graph::StepGraph;
use cuda::sample::testing::{param_sets, test_row};
use cuda::sample::SampleState;
use cuda::CudaContext;
use sampler::{Sampler, SamplingParams};
use spec::production as p;

use crate::common::{Cmp, Suite, GUARD};

const SEC: &str = "sample";
/// i32 guard words around the token history.
const ISENT: i32 = -0x5A5A_5A5B;
/// Calls per parameter set.
const CALLS: usize = 64;

fn exact(ok: bool, msg: String) -> Cmp {
    Cmp { rel: if ok { 0.0 } else { f64::NAN }, max_over_rms: if ok { 0.0 } else { f64::NAN }, ok, msg }
}

/// How the steps are launched.
#[derive(Clone, Copy, PartialEq)]
enum Launch {
    Direct,
    Graph { pdl: bool },
}

/// Device buffers of one sequence: logits, a guarded history, n_fixed, pos.
struct Seq {
    logits: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    n_fixed: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    max_ctx: usize,
}

impl Seq {
    /// A history of `max_ctx` slots holding `prompt`, `pos = pos0`.
    fn new(cx: &CudaContext, rows: usize, prompt: &[i32], max_ctx: usize, pos0: i32) -> Seq {
        let mut hist = vec![ISENT; max_ctx + 2 * GUARD];
        hist[GUARD..GUARD + prompt.len()].copy_from_slice(prompt);
        let st = cx.stream();
        Seq {
            logits: st.alloc_zeros::<f32>(rows).expect("alloc logits"),
            ids: st.clone_htod(&hist).expect("upload ids"),
            n_fixed: st.clone_htod(&[prompt.len() as i32]).expect("upload n_fixed"),
            pos: st.clone_htod(&[pos0]).expect("upload pos"),
            max_ctx,
        }
    }

    fn step(&mut self, cx: &CudaContext, state: &mut SampleState) {
        cx.sample_step(
            &mut self.logits.slice_mut(..),
            &mut self.ids.slice_mut(GUARD..GUARD + self.max_ctx),
            &self.n_fixed.slice(..),
            &mut self.pos.slice_mut(..),
            state,
        )
        .expect("sample_step");
    }

    fn ids(&self, cx: &CudaContext) -> Vec<i32> {
        cx.stream().clone_dtoh(&self.ids).expect("download ids")
    }

    fn pos(&self, cx: &CudaContext) -> i32 {
        cx.stream().clone_dtoh(&self.pos).expect("download pos")[0]
    }
}

/// Runs `calls` steps past a 3-token prompt for `params` over rows of `rows` logits with
/// `vocab_limit`, against `Sampler`, and records the result. `seed` varies the rows.
fn sequence(s: &mut Suite, label: &str, params: &SamplingParams, (rows, vocab_limit): (usize, usize), calls: usize, launch: Launch, seed: u64) {
    let cx = s.cx;
    let prompt = [11, 22, 33];
    let max_ctx = prompt.len() + calls + 1;
    let mut seq = Seq::new(cx, rows, &prompt, max_ctx, prompt.len() as i32 - 1);
    let mut state = cx.sample_state(rows, vocab_limit, params).expect("sample_state");
    let mut cpu = Sampler::new(params.clone()).expect("cpu sampler");
    let stream = cx.stream().clone();
    let graph = match launch {
        Launch::Direct => None,
        Launch::Graph { pdl } => Some(
            StepGraph::capture(&stream, pdl, || {
                seq.step(cx, &mut state);
                Ok(())
            })
            .expect("capture"),
        ),
    };
    let check_argmax = params.temperature == 0.0 && params.repetition_penalty != 1.0;
    let (mut bad_tokens, mut bad_logits, mut bad_argmax) = (0usize, 0usize, 0usize);
    let mut msgs = Vec::new();
    let mut cpu_tokens = Vec::new();
    for call in 0..calls {
        let row = test_row(call % 12 + 12 * (call / 48), rows, vocab_limit, call, seed);
        stream.memcpy_htod(&row, &mut seq.logits).expect("upload logits");
        match &graph {
            Some(g) => g.launch().expect("replay"),
            None => seq.step(cx, &mut state),
        }
        let mut want_row = row;
        let want = cpu.sample(&mut want_row, vocab_limit);
        cpu.accept(want);
        cpu_tokens.push(want);
        let got_row = cx.download_f32(&seq.logits).expect("download logits");
        let got = seq.ids(cx)[GUARD + prompt.len() + call];
        if got != want as i32 {
            bad_tokens += 1;
            if msgs.len() < 4 {
                msgs.push(format!("call {call} (row kind {}): gpu {got} cpu {want}", call % 12));
            }
        }
        let diff = got_row.iter().zip(&want_row).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        if diff > 0 {
            bad_logits += 1;
            if msgs.len() < 4 {
                msgs.push(format!("call {call}: {diff} penalised logits differ"));
            }
        }
        if check_argmax {
            // greedy with penalties = argmax_step over the penalised row the step left
            let mut h = Seq::new(cx, 1, &[0], 4, 0);
            cx.argmax_step(&seq.logits.slice(..), vocab_limit, &mut h.ids.slice_mut(GUARD..GUARD + 4), &h.n_fixed.slice(..), &mut h.pos.slice_mut(..))
                .expect("argmax_step");
            let a = h.ids(cx)[GUARD + 1];
            if a != got {
                bad_argmax += 1;
                if msgs.len() < 4 {
                    msgs.push(format!("call {call}: argmax_step {a}, sample_step {got}"));
                }
            }
        }
    }
    drop(graph);
    // end state: RNG position, counts, pos, prompt and guards
    let rng = cx.sample_rng_position(&state).expect("rng position");
    let want_rng = if params.temperature == 0.0 || vocab_limit == 0 { 0 } else { calls as u64 };
    let counts: Vec<u32> = cx.stream().clone_dtoh(state.counts()).expect("download counts");
    let mut want_counts = vec![0u32; rows];
    for &t in &cpu_tokens {
        want_counts[t as usize] += 1;
    }
    let bad_counts = counts.iter().zip(&want_counts).filter(|(a, b)| a != b).count();
    let ids = seq.ids(cx);
    let guards_ok = ids[..GUARD].iter().chain(&ids[GUARD + max_ctx..]).all(|&g| g == ISENT)
        && ids[GUARD..GUARD + prompt.len()] == prompt
        && ids[GUARD + prompt.len() + calls..GUARD + max_ctx].iter().all(|&g| g == ISENT);
    let pos = seq.pos(cx);
    let want_pos = (prompt.len() - 1 + calls) as i32;
    let ok = bad_tokens == 0 && bad_logits == 0 && bad_argmax == 0 && rng == want_rng && bad_counts == 0 && guards_ok && pos == want_pos;
    if rng != want_rng {
        msgs.push(format!("rng position {rng}, want {want_rng}"));
    }
    if bad_counts > 0 {
        msgs.push(format!("{bad_counts} token counts differ"));
    }
    if !guards_ok {
        msgs.push("prompt or guard words overwritten".into());
    }
    if pos != want_pos {
        msgs.push(format!("pos {pos}, want {want_pos}"));
    }
    let how = match launch {
        Launch::Direct => "direct",
        Launch::Graph { pdl: false } => "graph",
        Launch::Graph { pdl: true } => "graph+pdl",
    };
    let mut summary = format!("{bad_tokens}/{calls} tokens differ, {bad_logits} rows of penalised logits differ");
    if check_argmax {
        summary.push_str(&format!(", {bad_argmax} argmax_step differ"));
    }
    if !msgs.is_empty() {
        summary.push_str("; ");
        summary.push_str(&msgs.join("; "));
    }
    s.record(
        SEC,
        &format!("{label} x{calls} ({how}, vocab_limit {vocab_limit})"),
        &exact(ok, summary),
        &format!("\"mismatched_tokens\":{bad_tokens},\"calls\":{calls}"),
    );
}

/// Prompt positions, the end of the history, and `sample_reset`.
fn contract(s: &mut Suite) {
    let cx = s.cx;
    let (rows, n) = (p::VOCAB, p::VOCAB_REAL);
    let params = SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.8, seed: Some(5), ..Default::default() };
    // prompt of 5, pos from 0: steps 0..3 are prompt positions (q = 1..4), then 5 samples into a
    // 10-slot history, then one step past its end
    let prompt = [1, 2, 3, 4, 5];
    let max_ctx = 10;
    let mut seq = Seq::new(cx, rows, &prompt, max_ctx, 0);
    let mut state = cx.sample_state(rows, n, &params).expect("sample_state");
    let mut cpu = Sampler::new(params.clone()).unwrap();
    let mut want = vec![ISENT; max_ctx + 2 * GUARD];
    want[GUARD..GUARD + prompt.len()].copy_from_slice(&prompt);
    let mut msgs = Vec::new();
    for step in 0..10usize {
        let row = test_row(step, rows, n, step, 0xC0DE);
        cx.stream().memcpy_htod(&row, &mut seq.logits).unwrap();
        seq.step(cx, &mut state);
        let q = step + 1;
        if q >= prompt.len() && q < max_ctx {
            let mut r = row;
            let t = cpu.sample(&mut r, n);
            cpu.accept(t);
            want[GUARD + q] = t as i32;
        }
        let rng = cx.sample_rng_position(&state).unwrap();
        let want_rng = (q + 1).saturating_sub(prompt.len()).min(max_ctx - prompt.len()) as u64;
        if rng != want_rng {
            msgs.push(format!("step {step}: rng position {rng}, want {want_rng}"));
        }
    }
    let got = seq.ids(cx);
    let pos = seq.pos(cx);
    if got != want {
        msgs.push(format!("history {:?} want {:?}", &got[GUARD..GUARD + max_ctx], &want[GUARD..GUARD + max_ctx]));
    }
    if pos != 10 {
        msgs.push(format!("pos {pos}, want 10"));
    }
    s.record(SEC, "prompt 5, history 10, 10 steps: prompt/end untouched, no RNG there", &exact(msgs.is_empty(), msgs.join("; ")), "");

    // reset: the same seed replays the same tokens; a new seed follows a new CPU sampler
    let mut msgs = Vec::new();
    for (what, p2) in [("same seed", params.clone()), ("seed 6, t 1.2", SamplingParams { seed: Some(6), temperature: 1.2, ..params.clone() })] {
        cx.sample_reset(&mut state, &p2).expect("reset");
        let mut seq = Seq::new(cx, rows, &[7], 40, 0);
        let mut cpu = Sampler::new(p2.clone()).unwrap();
        for call in 0..32usize {
            let row = test_row(call, rows, n, call, 0xBEEF);
            cx.stream().memcpy_htod(&row, &mut seq.logits).unwrap();
            seq.step(cx, &mut state);
            let mut r = row;
            let t = cpu.sample(&mut r, n);
            cpu.accept(t);
            let g = seq.ids(cx)[GUARD + 1 + call];
            if g != t as i32 && msgs.len() < 4 {
                msgs.push(format!("{what} call {call}: gpu {g} cpu {t}"));
            }
        }
    }
    s.record(SEC, "sample_reset: same seed replays, new seed and params follow the CPU", &exact(msgs.is_empty(), msgs.join("; ")), "");
}

fn timing(s: &mut Suite) {
    let cx = s.cx;
    let (rows, n) = (p::VOCAB, p::VOCAB_REAL);
    let d = SamplingParams::default;
    let sets = [
        ("greedy", SamplingParams::greedy()),
        ("t 1.0", d()),
        ("top_p 0.95", SamplingParams { top_p: 0.95, ..d() }),
        ("qwen t0.6 k20 p0.95", SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..d() }),
        ("min_p 0.05", SamplingParams { min_p: 0.05, ..d() }),
    ];
    let row = test_row(0, rows, n, 0, 0x71AE);
    let reps = if s.quick { 3 } else { 7 };
    for (label, p) in sets {
        let p = SamplingParams { seed: Some(1), ..p };
        let mut seq = Seq::new(cx, rows, &[0], 1 << 20, 0);
        cx.stream().memcpy_htod(&row, &mut seq.logits).unwrap();
        let mut state = cx.sample_state(rows, n, &p).expect("sample_state");
        let t = s.time_graph(reps, || {
            for _ in 0..16 {
                seq.step(cx, &mut state);
            }
        }) / 16.0;
        println!("{SEC:<10} sample_step {label}: {:.2} us per call (graph replay of 16)", t * 1e6);
        s.json.push((SEC.into(), format!("{{\"op\":\"sample_step\",\"params\":{label:?},\"us_graph\":{:.3}}}", t * 1e6)));
    }
}

/// Runs the sampling checks and timings.
pub fn run(s: &mut Suite) {
    let (rows, n) = (p::VOCAB, p::VOCAB_REAL);
    for (i, (label, params)) in param_sets().into_iter().enumerate() {
        let params = SamplingParams { seed: Some(1000 + i as u64), ..params };
        let launch = match i % 3 {
            0 => Launch::Graph { pdl: true },
            1 => Launch::Graph { pdl: false },
            _ if i == 2 => Launch::Direct,
            _ => Launch::Graph { pdl: true },
        };
        sequence(s, label, &params, (rows, n), CALLS, launch, i as u64);
    }
    let d = SamplingParams::default;
    for (label, params) in [
        ("vocab_limit 1000: qwen t0.7 k20 p0.8", SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.8, seed: Some(9), ..d() }),
        ("vocab_limit 1000: t 1.0 p0.95 min_p 0.02", SamplingParams { top_p: 0.95, min_p: 0.02, seed: Some(10), ..d() }),
    ] {
        sequence(s, label, &params, (rows, 1000), CALLS, Launch::Graph { pdl: true }, 77);
    }
    sequence(s, "vocab_limit 0: t 1.0", &SamplingParams { seed: Some(11), ..d() }, (rows, 0), 8, Launch::Direct, 78);
    contract(s);
    timing(s);
}
