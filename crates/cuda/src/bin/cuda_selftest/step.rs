//! Decode-step bookkeeping (`kernels/step.cu`): `embed_gather`, `argmax_step`, `advance_pos`.
//!
//! * `embed_gather` (4 and 8 bits, a 5,003-row random MLX embedding): the row `ids[pos]` for
//!   several positions, bit-exact against `quant::dequantize` (the CPU embedding of
//!   `model::Model`), guard words around `x`; a position outside `ids` and an id outside the
//!   embedding give a row of NaN; then a captured graph `[embed_gather, advance_pos]` replayed
//!   5 times walks the history (x checked after every replay).
//! * `argmax_step` over `VOCAB` logits against a CPU twin of `sampler::argmax` (max over the
//!   non-NaN values, lowest id equal to it, 0 when there is none): random logits; the maximum at
//!   three ids in different blocks (lowest wins); NaN sprinkled everywhere, at 0 and next to the
//!   maximum; all NaN (-> 0); NaN then -inf (-> the first -inf); the largest value beyond
//!   `vocab_limit = VOCAB_REAL` (ignored). Then the token history: a 5-token prompt in a
//!   12-slot history (guard words after it), one captured `argmax_step` graph replayed 14
//!   times with fresh logits uploaded before each replay: prompt ids untouched, `ids[q]` for
//!   q >= 5 the argmax of replay q-1, nothing written past the history, `pos` = 14 (which also
//!   shows the finished-block ticket is reset on every replay).
//! * `advance_pos`: 3 calls captured, replayed twice, from 7 -> 13.
//!
//! Everything is exact (integers, or f32 bit patterns), so every check is equality.
//! Timing: graph replay of 64 calls each.

use cuda::cudarc::driver::{sys, CudaGraph, CudaSlice, CudaStream};
use cuda::CudaContext;
use half::bf16;
use quant::{QMatRef, QuantSpec};
use spec::production as p;

use crate::common::{guarded, rand_f32s, rand_u32s, Cmp, Suite, GUARD, SENTINEL};

const SEC: &str = "step";
/// i32 guard words around integer outputs.
const ISENT: i32 = -0x5A5A_5A5B;

fn exact(ok: bool, msg: String) -> Cmp {
    Cmp { rel: if ok { 0.0 } else { f64::NAN }, max_over_rms: if ok { 0.0 } else { f64::NAN }, ok, msg }
}

/// CPU twin of `sampler::argmax`: the largest non-NaN value (-inf when there is none), the lowest
/// id holding it, 0 when no value equals it.
fn cpu_argmax(l: &[f32]) -> i32 {
    let m = l.iter().fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a });
    l.iter().position(|&v| v == m).unwrap_or(0) as i32
}

fn capture(stream: &std::sync::Arc<CudaStream>, f: impl FnOnce()) -> CudaGraph {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    f();
    stream
        .end_capture(sys::CUgraphInstantiate_flags_enum::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .expect("end capture")
        .expect("graph")
}

fn upload_i32(cx: &CudaContext, v: &[i32]) -> CudaSlice<i32> {
    cx.stream().clone_htod(v).expect("upload i32")
}

fn download_i32(cx: &CudaContext, v: &CudaSlice<i32>) -> Vec<i32> {
    cx.stream().clone_dtoh(v).expect("download i32")
}

/// `got` (guarded) equals `want` bit for bit; guards intact.
fn same_bits(got: &[f32], want: &[f32]) -> (bool, String) {
    let n = want.len();
    let guards = got[..GUARD].iter().chain(&got[GUARD + n..]).all(|g| g.to_bits() == SENTINEL);
    let diff = got[GUARD..GUARD + n]
        .iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    (guards && diff == 0, format!("{diff} of {n} differ{}", if guards { "" } else { "; guards overwritten" }))
}

fn embed_tests(s: &mut Suite) {
    let cx = s.cx;
    let stream = cx.stream().clone();
    let d = p::D_MODEL;
    let rows = 5003;
    for bits in [4u32, 8] {
        let spec = QuantSpec::new(bits, cuda::QUANT_GROUP).unwrap();
        let seed = 0xE3B0 + u64::from(bits);
        let packed = rand_u32s(rows * spec.words_per_row(d), seed);
        let gpr = spec.groups_per_row(d);
        let scales: Vec<bf16> = rand_f32s(rows * gpr, seed ^ 1, 0.02).into_iter().map(bf16::from_f32).collect();
        let biases: Vec<bf16> = rand_f32s(rows * gpr, seed ^ 2, 0.1).into_iter().map(bf16::from_f32).collect();
        let m = QMatRef::new(rows, d, spec, &packed, &scales, &biases).unwrap();
        let dm = cx.upload_qmat(m).expect("upload embed");
        let row = |id: usize| {
            let mut v = vec![0f32; d];
            quant::dequantize(m.slice_rows(id, id + 1), &mut v);
            v
        };
        // history: random ids, plus the last and first rows, and one id past the embedding
        let mut ids: Vec<i32> = rand_u32s(16, seed ^ 3).into_iter().map(|u| (u % rows as u32) as i32).collect();
        ids[3] = rows as i32 - 1;
        ids[4] = 0;
        ids[9] = rows as i32;
        let idd = upload_i32(cx, &ids);
        let mut x = guarded(cx, d);
        let nan_row = vec![f32::from_bits(0x7fc0_0000); d];
        let mut ok_all = true;
        let mut msgs = Vec::new();
        for pos in [0usize, 3, 4, 7, 15, 9, 16] {
            let posd = upload_i32(cx, &[pos as i32]);
            cx.embed_gather(&mut x.slice_mut(GUARD..GUARD + d), &dm, &idd.slice(..), &posd.slice(..))
                .expect("embed_gather");
            let got = cx.download_f32(&x).unwrap();
            // pos 9 holds an id past the embedding, pos 16 is past the history: NaN rows
            let want = if pos < ids.len() && ids[pos] < rows as i32 { row(ids[pos] as usize) } else { nan_row.clone() };
            let (ok, msg) = same_bits(&got, &want);
            if !ok {
                msgs.push(format!("pos {pos}: {msg}"));
            }
            ok_all &= ok;
        }
        s.record(SEC, &format!("embed_gather q{bits} [{rows}x{d}] 7 positions, bad id/pos -> NaN"), &exact(ok_all, msgs.join("; ")), "");

        // graph [embed_gather, advance_pos] replayed: x follows the history
        let mut posd = upload_i32(cx, &[1]);
        let graph = capture(&stream, || {
            cx.embed_gather(&mut x.slice_mut(GUARD..GUARD + d), &dm, &idd.slice(..), &posd.slice(..))
                .expect("embed_gather");
            cx.advance_pos(&mut posd.slice_mut(..)).expect("advance_pos");
        });
        let mut ok_all = true;
        let mut msgs = Vec::new();
        for k in 0..5usize {
            graph.launch().expect("replay");
            let got = cx.download_f32(&x).unwrap();
            let (ok, msg) = same_bits(&got, &row(ids[1 + k] as usize));
            if !ok {
                msgs.push(format!("replay {k}: {msg}"));
            }
            ok_all &= ok;
        }
        let pos_after = download_i32(cx, &posd)[0];
        ok_all &= pos_after == 6;
        if pos_after != 6 {
            msgs.push(format!("pos {pos_after} after 5 replays from 1"));
        }
        s.record(SEC, &format!("embed_gather q{bits} graph [embed, advance_pos] x5"), &exact(ok_all, msgs.join("; ")), "");
        drop(graph);

        let posd = upload_i32(cx, &[2]);
        let t = s.time_graph(5, || {
            for _ in 0..64 {
                cx.embed_gather(&mut x.slice_mut(GUARD..GUARD + d), &dm, &idd.slice(..), &posd.slice(..))
                    .expect("embed_gather");
            }
        }) / 64.0;
        println!("{SEC:<10} embed_gather q{bits}: {:.2} us per call (graph replay of 64)", t * 1e6);
        s.json.push((SEC.into(), format!("{{\"op\":\"embed_gather_q{bits}\",\"us_graph\":{:.3}}}", t * 1e6)));
    }
}

/// One `argmax_step` on `logits` with `pos = 0`, `n_fixed = 0` into a 4-slot history: the
/// picked id (`ids[1]`) and the new pos.
fn argmax_once(cx: &CudaContext, logits: &[f32], vocab_limit: usize) -> (i32, i32) {
    let ld = cx.upload_f32(logits).unwrap();
    let mut idd = upload_i32(cx, &[ISENT; 4]);
    let nfd = upload_i32(cx, &[0]);
    let mut posd = upload_i32(cx, &[0]);
    cx.argmax_step(&ld.slice(..), vocab_limit, &mut idd.slice_mut(..), &nfd.slice(..), &mut posd.slice_mut(..))
        .expect("argmax_step");
    (download_i32(cx, &idd)[1], download_i32(cx, &posd)[0])
}

fn argmax_tests(s: &mut Suite) {
    let cx = s.cx;
    let stream = cx.stream().clone();
    let v = p::VOCAB;
    let nan = f32::NAN;
    let base = rand_f32s(v, 0xA11, 20.0);
    let mut cases: Vec<(&str, Vec<f32>, usize)> = Vec::new();
    cases.push(("random", base.clone(), v));
    let mut ties = base.clone();
    for &i in &[200_000usize, 77_777, 150_001] {
        ties[i] = 25.0;
    }
    cases.push(("max at 3 ids (200000, 77777, 150001) -> 77777", ties.clone(), v));
    let mut nans = ties.clone();
    for (i, r) in rand_u32s(v, 0xBAD).into_iter().enumerate() {
        if r % 7 == 0 {
            nans[i] = nan;
        }
    }
    nans[0] = nan;
    nans[77_776] = nan;
    nans[77_778] = nan;
    nans[77_777] = 25.0;
    cases.push(("NaN every ~7th, at 0 and around the max", nans, v));
    cases.push(("all NaN -> 0", vec![nan; v], v));
    let mut ninf = vec![f32::NEG_INFINITY; v];
    ninf[..5].iter_mut().for_each(|x| *x = nan);
    cases.push(("NaN x5 then -inf -> 5", ninf, v));
    let mut beyond = base.clone();
    beyond[v - 1] = 1e30;
    beyond[p::VOCAB_REAL] = 1e30;
    cases.push(("largest beyond vocab_limit = VOCAB_REAL", beyond, p::VOCAB_REAL));
    let mut low = base.clone();
    low[3] = 30.0;
    cases.push(("max at id 3, vocab_limit 1000", low, 1000));
    for (label, logits, limit) in &cases {
        let want = cpu_argmax(&logits[..*limit]);
        let (got, pos) = argmax_once(cx, logits, *limit);
        let ok = got == want && pos == 1;
        s.record(SEC, &format!("argmax_step {label}"), &exact(ok, format!("got {got} want {want}, pos {pos}")), "");
    }

    // token history in a replayed graph
    let max_ctx = 12usize;
    let n_fixed = 5usize;
    let replays = 14usize;
    let prompt: Vec<i32> = vec![11, 22, 33, 44, 55];
    let mut hist = vec![ISENT; max_ctx + 2 * GUARD];
    hist[GUARD..GUARD + n_fixed].copy_from_slice(&prompt);
    let mut idd = upload_i32(cx, &hist);
    let nfd = upload_i32(cx, &[n_fixed as i32]);
    let mut posd = upload_i32(cx, &[0]);
    let mut ld = cx.upload_f32(&base).unwrap();
    let graph = capture(&stream, || {
        cx.argmax_step(
            &ld.slice(..),
            p::VOCAB_REAL,
            &mut idd.slice_mut(GUARD..GUARD + max_ctx),
            &nfd.slice(..),
            &mut posd.slice_mut(..),
        )
        .expect("argmax_step");
    });
    let mut want = hist.clone();
    for k in 0..replays {
        let logits = rand_f32s(v, 0xC0DE + k as u64, 10.0);
        stream.memcpy_htod(&logits, &mut ld).expect("upload logits");
        graph.launch().expect("replay");
        let q = k + 1;
        if q >= n_fixed && q < max_ctx {
            want[GUARD + q] = cpu_argmax(&logits[..p::VOCAB_REAL]);
        }
    }
    let got = download_i32(cx, &idd);
    let pos = download_i32(cx, &posd)[0];
    let ok = got == want && pos == replays as i32;
    let msg = if ok {
        String::new()
    } else {
        format!("history {:?} want {:?}, pos {pos}", &got[GUARD - 1..GUARD + max_ctx + 1], &want[GUARD - 1..GUARD + max_ctx + 1])
    };
    s.record(
        SEC,
        &format!("argmax_step graph x{replays}: prompt {n_fixed}, history {max_ctx}"),
        &exact(ok, msg),
        "",
    );
    drop(graph);

    let ld = cx.upload_f32(&base).unwrap();
    let t = s.time_graph(5, || {
        for _ in 0..64 {
            cx.argmax_step(
                &ld.slice(..),
                p::VOCAB_REAL,
                &mut idd.slice_mut(GUARD..GUARD + max_ctx),
                &nfd.slice(..),
                &mut posd.slice_mut(..),
            )
            .expect("argmax_step");
        }
    }) / 64.0;
    let gbs = (p::VOCAB_REAL * 4) as f64 / t / 1e9;
    println!("{SEC:<10} argmax_step over {} logits: {:.2} us per call ({gbs:.0} GB/s, graph replay of 64)", p::VOCAB_REAL, t * 1e6);
    s.json.push((SEC.into(), format!("{{\"op\":\"argmax_step\",\"us_graph\":{:.3},\"gbps\":{gbs:.1}}}", t * 1e6)));
}

fn advance_tests(s: &mut Suite) {
    let cx = s.cx;
    let stream = cx.stream().clone();
    let mut posd = upload_i32(cx, &[7]);
    let graph = capture(&stream, || {
        for _ in 0..3 {
            cx.advance_pos(&mut posd.slice_mut(..)).expect("advance_pos");
        }
    });
    graph.launch().expect("replay");
    graph.launch().expect("replay");
    let pos = download_i32(cx, &posd)[0];
    s.record(SEC, "advance_pos x3, graph replayed twice: 7 -> 13", &exact(pos == 13, format!("pos {pos}")), "");
    drop(graph);
    let t = s.time_graph(5, || {
        for _ in 0..64 {
            cx.advance_pos(&mut posd.slice_mut(..)).expect("advance_pos");
        }
    }) / 64.0;
    println!("{SEC:<10} advance_pos: {:.2} us per call (graph replay of 64)", t * 1e6);
    s.json.push((SEC.into(), format!("{{\"op\":\"advance_pos\",\"us_graph\":{:.3}}}", t * 1e6)));
}

/// Runs the step-bookkeeping checks and timings.
pub fn run(s: &mut Suite) {
    embed_tests(s);
    argmax_tests(s);
    advance_tests(s);
}
