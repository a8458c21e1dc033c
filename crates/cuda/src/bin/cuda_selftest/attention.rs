//! Gated full-attention decode step (`CudaContext::attn_decode_step`, `kernels/attention.cu`).
//!
//! Correctness: random realistic inputs at the real dimensions (a fresh `proj` every step;
//! q_norm/k_norm deltas make the per-dimension scales 0.7-2.5, so the scores have an rms of
//! about 3 and the softmax is neither flat nor one-hot). The CPU twin is the T = 1 attention
//! path of `model::Model::attention` (crates/model/src/lib.rs), built from
//! `model::reference::{zrms_norm, rope_inplace, attend, sigmoid}` in the same order, on a
//! reference cache holding the same bf16-rounded K/V as the GPU cache: each step's k/v rows are
//! checked against the reference's own rounding, then the GPU's rows are copied into the
//! reference cache (so a 1-ulp difference of k cannot move later steps' comparisons).
//! * `max_ctx` = 32 808: 70 consecutive steps (positions 0..69: lengths cross the 16-key tiles
//!   and the splits), then single steps at positions 4095, 32 767 and max_ctx − 1 after filling
//!   the earlier rows of both caches with random bf16; then the out-of-range positions max_ctx,
//!   max_ctx + 1000 (must write nothing, attend over the max_ctx cached rows) and −1 (output 0).
//! * `max_ctx` = 70 (5 splits): 70 consecutive steps, filling the cache to its last row.
//!
//! Every step checks `out` (64 NaN guard words each side), the cache rows written (row `pos` of
//! K and V against the reference's bf16 bits) and that the next row and the guard words around
//! both caches still hold the NaN sentinel (unwritten rows also hold it, so reading one would
//! make the output NaN).
//!
//! Tolerances:
//! * `out`: relative L2 error < 2e-5 and max error < 2e-4·rms. q and p enter the tensor-core
//!   products as bf16 hi + lo pairs (x − hi − lo ≈ 2^-18 relative per element); K/V are the
//!   same bf16 values on both sides and everything else is f32 in a different order. A float64
//!   model of exactly these splits at these input scales (scores of rms ≈ 3) gives relative
//!   errors of 3-5e-6 and max errors of 1.1-1.6e-5·rms (16 and 4096 keys); the bounds leave 4x
//!   (f32 rounding adds ~1e-7 per op).
//! * V rows: bit-exact (one rounding of the same f32). K rows: at most 1 bf16 ulp apart, in at
//!   most 0.1% of the elements: k is normed and rotated in f32 on both sides with different
//!   summation order and FMA contraction, and a 1-ulp f32 difference flips the bf16 rounding
//!   about once in 2^15 elements.
//!
//! Timing (graph replay of 40 steps, CUDA events): contexts 1, 128, 4096, 32 768 (pos =
//! context − 1), cycling over 4 layers' caches (268 MB, beyond the L2): the whole step, and each
//! of its two kernels alone; also both kernels at pos = −1 (nothing to do: launch and exit).
//! GB/s counts the K/V rows read: context × 2 (K, V) × N_KV_HEADS × HEAD_DIM × 2 B.

use cuda::attention::{AttnScratch, ATTN_PROJ};
use cuda::cudarc::driver::CudaSlice;
use half::bf16;
use model::reference as r;
use rayon::prelude::*;
use spec::production as p;

use crate::common::{check_guarded, guarded, rand_f32s, Cmp, Suite, Tol, GUARD};

const SEC: &str = "attn";
const TOL: Tol = Tol {
    rel: 2e-5,
    max_over_rms: 2e-4,
};
/// bf16 NaN pattern in every unwritten cache element and the cache guard words.
const SENT16: u16 = 0x7FA5;
const HD: usize = p::HEAD_DIM;
const ROW: usize = p::N_KV_HEADS * p::HEAD_DIM;
const OUT: usize = p::N_Q_HEADS * p::HEAD_DIM;

/// Layer constants: norm weights (zero-centred) and RoPE inverse frequencies.
struct Consts {
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    inv_freq: Vec<f32>,
}

fn consts(seed: u64) -> Consts {
    Consts {
        // 1 + w in [0.7, 2.5] and [0.7, 1.9]
        q_norm: rand_f32s(HD, seed ^ 1, 0.9)
            .into_iter()
            .map(|x| x + 0.6)
            .collect(),
        k_norm: rand_f32s(HD, seed ^ 2, 0.6)
            .into_iter()
            .map(|x| x + 0.3)
            .collect(),
        inv_freq: r::rope_inv_freq(p::ROPE_THETA, p::ROTARY_DIM),
    }
}

/// `proj` of one token: q and k uniform ±2 (scale is normed away), gate ±4, v ±1.
fn proj(seed: u64) -> Vec<f32> {
    let mut v = rand_f32s(ATTN_PROJ, seed, 2.0);
    for h in 0..p::N_Q_HEADS {
        for x in &mut v[h * 2 * HD + HD..(h + 1) * 2 * HD] {
            *x *= 2.0;
        }
    }
    for x in &mut v[p::N_Q_HEADS * 2 * HD + ROW..] {
        *x *= 0.5;
    }
    v
}

fn to_bf16(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}
fn from_bf16(b: u16) -> f32 {
    bf16::from_bits(b).to_f32()
}

/// Host twin of the caches: bf16 bits, `[max_ctx, N_KV, HEAD_DIM]`, and the same as f32.
struct RefCache {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// The reference's q (normed, roped), gate and this token's k/v rows as bf16 bits
/// (`Model::attention` with t = 1, up to the cache write).
struct RefQkv {
    q: Vec<f32>,
    gate: Vec<f32>,
    kb: Vec<u16>,
    vb: Vec<u16>,
}

fn ref_qkv(c: &Consts, proj: &[f32], pos: usize) -> RefQkv {
    let nq = p::N_Q_HEADS;
    let mut q = vec![0f32; nq * HD];
    let mut gate = vec![0f32; nq * HD];
    for h in 0..nq {
        q[h * HD..(h + 1) * HD].copy_from_slice(&proj[h * 2 * HD..h * 2 * HD + HD]);
        gate[h * HD..(h + 1) * HD].copy_from_slice(&proj[h * 2 * HD + HD..(h + 1) * 2 * HD]);
    }
    let k_in = &proj[nq * 2 * HD..nq * 2 * HD + ROW];
    let v_in = &proj[nq * 2 * HD + ROW..];
    let mut qn = vec![0f32; nq * HD];
    r::zrms_norm(&mut qn, &q, &c.q_norm, p::RMS_EPS);
    let mut kn = vec![0f32; ROW];
    r::zrms_norm(&mut kn, k_in, &c.k_norm, p::RMS_EPS);
    r::rope_inplace(&mut qn, HD, &c.inv_freq, pos);
    r::rope_inplace(&mut kn, HD, &c.inv_freq, pos);
    RefQkv {
        q: qn,
        gate,
        kb: kn.iter().map(|&x| to_bf16(x)).collect(),
        vb: v_in.iter().map(|&x| to_bf16(x)).collect(),
    }
}

/// Reference attention over rows `0..n_ctx` of the reference cache, times sigmoid(gate).
fn ref_attend(x: &RefQkv, cache: &RefCache, n_ctx: usize) -> Vec<f64> {
    let group = p::N_Q_HEADS / p::N_KV_HEADS;
    let scale = 1.0 / (HD as f32).sqrt();
    let mut att = vec![0f32; OUT];
    let (kc, vc) = (&cache.k, &cache.v);
    att.par_chunks_mut(HD).enumerate().for_each(|(h, o)| {
        let m = h / group;
        r::attend(
            o,
            &x.q[h * HD..(h + 1) * HD],
            &kc[m * HD..],
            &vc[m * HD..],
            n_ctx,
            ROW,
            scale,
        );
    });
    att.iter()
        .zip(&x.gate)
        .map(|(a, g)| f64::from(a * r::sigmoid(*g)))
        .collect()
}

/// Tallies of the cache-row checks of one configuration.
#[derive(Default)]
struct RowTally {
    k_elems: usize,
    k_ulp1: usize,
    bad: usize,
    msgs: Vec<String>,
}

/// Device state of one configuration.
struct Dev {
    max_ctx: usize,
    kc: CudaSlice<u16>, // GUARD + max_ctx*ROW + GUARD
    vc: CudaSlice<u16>,
    out: CudaSlice<f32>,
    pos: CudaSlice<i32>,
    proj: CudaSlice<f32>,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    inv_freq: CudaSlice<f32>,
    scratch: AttnScratch,
}

impl Dev {
    fn new(s: &Suite, c: &Consts, max_ctx: usize) -> Dev {
        let cx = s.cx;
        let st = cx.stream();
        let n = max_ctx * ROW + 2 * GUARD;
        Dev {
            max_ctx,
            kc: st.clone_htod(&vec![SENT16; n]).unwrap(),
            vc: st.clone_htod(&vec![SENT16; n]).unwrap(),
            out: guarded(cx, OUT),
            pos: st.alloc_zeros::<i32>(1).unwrap(),
            proj: st.alloc_zeros::<f32>(ATTN_PROJ).unwrap(),
            q_norm: cx.upload_f32(&c.q_norm).unwrap(),
            k_norm: cx.upload_f32(&c.k_norm).unwrap(),
            inv_freq: cx.upload_f32(&c.inv_freq).unwrap(),
            scratch: cx.attn_scratch(max_ctx).unwrap(),
        }
    }

    /// Uploads `proj` and `pos`, runs one step (out keeps its guards), waits.
    fn step(&mut self, s: &Suite, proj: &[f32], pos: i32) -> Vec<f32> {
        let cx = s.cx;
        let st = cx.stream();
        st.memcpy_htod(proj, &mut self.proj).unwrap();
        st.memcpy_htod(&[pos], &mut self.pos).unwrap();
        let len = self.max_ctx * ROW;
        {
            let mut kv = self.kc.slice_mut(GUARD..GUARD + len);
            let mut vv = self.vc.slice_mut(GUARD..GUARD + len);
            let mut ov = self.out.slice_mut(GUARD..GUARD + OUT);
            cx.attn_decode_step(
                &self.proj.slice(..),
                &self.q_norm.slice(..),
                &self.k_norm.slice(..),
                &self.inv_freq.slice(..),
                &self.pos.slice(..),
                &mut kv,
                &mut vv,
                &mut self.scratch,
                &mut ov,
            )
            .expect("attn_decode_step");
        }
        cx.download_f32(&self.out).unwrap()
    }

    /// Elements `[a, b)` of the guarded K and V buffers (guard included in the indexing).
    fn cache_range(&self, s: &Suite, a: usize, b: usize) -> (Vec<u16>, Vec<u16>) {
        let st = s.cx.stream();
        (
            st.clone_dtoh(&self.kc.slice(a..b)).unwrap(),
            st.clone_dtoh(&self.vc.slice(a..b)).unwrap(),
        )
    }

    /// Checks cache row `pos` against the reference bits, the row after it (or the trailing
    /// guard) and the leading guard still hold the sentinel.
    /// The GPU's rows then go into the reference cache (the 1-ulp differences of k must not
    /// propagate into later steps' comparisons).
    fn check_rows(
        &self,
        s: &Suite,
        pos: usize,
        x: &RefQkv,
        cache: &mut RefCache,
        t: &mut RowTally,
    ) {
        let (kb, vb) = (&x.kb, &x.vb);
        let a = GUARD + pos * ROW;
        let b = (a + 2 * ROW).min(self.max_ctx * ROW + 2 * GUARD);
        let (k, v) = self.cache_range(s, a, b);
        for i in 0..ROW {
            cache.k[pos * ROW + i] = from_bf16(k[i]);
            cache.v[pos * ROW + i] = from_bf16(v[i]);
        }
        for i in 0..ROW {
            t.k_elems += 1;
            let (g, e) = (k[i], kb[i]);
            if g != e {
                let same_sign = (g ^ e) & 0x8000 == 0;
                if same_sign && (g as i32 - e as i32).abs() == 1 {
                    t.k_ulp1 += 1;
                } else {
                    t.bad += 1;
                    t.msgs
                        .push(format!("pos {pos}: k[{i}] {g:#06x} vs {e:#06x}"));
                }
            }
            if v[i] != vb[i] {
                t.bad += 1;
                t.msgs
                    .push(format!("pos {pos}: v[{i}] {:#06x} vs {:#06x}", v[i], vb[i]));
            }
        }
        if k[ROW..].iter().chain(&v[ROW..]).any(|&x| x != SENT16) {
            t.bad += 1;
            t.msgs.push(format!(
                "pos {pos}: the row (or guard) after the written one changed"
            ));
        }
        self.check_guards(s, t, &format!("pos {pos}"));
    }

    /// Both guard regions of both caches hold the sentinel.
    fn check_guards(&self, s: &Suite, t: &mut RowTally, what: &str) {
        let n = self.max_ctx * ROW + 2 * GUARD;
        for (a, b) in [(0, GUARD), (n - GUARD, n)] {
            let (k, v) = self.cache_range(s, a, b);
            if k.iter().chain(&v).any(|&x| x != SENT16) {
                t.bad += 1;
                t.msgs
                    .push(format!("{what}: cache guard words overwritten"));
            }
        }
    }

    /// Fills rows `0..rows` of both caches (device and reference) with random bf16 K (scaled
    /// like normed keys) and V.
    fn fill(&mut self, s: &Suite, c: &Consts, cache: &mut RefCache, rows: usize, seed: u64) {
        let n = rows * ROW;
        let kb: Vec<u16> = rand_f32s(n, seed, 1.7)
            .into_iter()
            .enumerate()
            .map(|(i, x)| to_bf16(x * (1.0 + c.k_norm[i % HD])))
            .collect();
        let vb: Vec<u16> = rand_f32s(n, seed ^ 0xF00D, 1.0)
            .into_iter()
            .map(to_bf16)
            .collect();
        cache.k[..n]
            .par_iter_mut()
            .zip(&kb)
            .for_each(|(d, &b)| *d = from_bf16(b));
        cache.v[..n]
            .par_iter_mut()
            .zip(&vb)
            .for_each(|(d, &b)| *d = from_bf16(b));
        let st = s.cx.stream();
        st.memcpy_htod(&kb, &mut self.kc.slice_mut(GUARD..GUARD + n))
            .unwrap();
        st.memcpy_htod(&vb, &mut self.vc.slice_mut(GUARD..GUARD + n))
            .unwrap();
    }
}

/// Prints the row checks so far; `fin` also records them (every mismatch other than a 1-ulp
/// k difference fails, and 1-ulp k differences must stay under 0.1% of the k elements).
fn record_rows(s: &mut Suite, label: &str, t: &RowTally, fin: bool) {
    let frac = t.k_ulp1 as f64 / t.k_elems.max(1) as f64;
    let ok = t.bad == 0 && (!fin || frac <= 1e-3);
    println!(
        "{SEC:<10} {label:<60} k 1-ulp {}/{} ({frac:.1e}), other mismatches {} {}",
        t.k_ulp1,
        t.k_elems,
        t.bad,
        if ok { "ok" } else { "FAIL" }
    );
    for m in t.msgs.iter().take(8) {
        println!("    {m}");
    }
    s.all_ok &= ok;
    if fin {
        s.json.push((
            SEC.into(),
            format!(
                "{{\"label\":{label:?},\"k_ulp1\":{},\"k_elems\":{},\"other_mismatches\":{},\"ok\":{ok}}}",
                t.k_ulp1, t.k_elems, t.bad
            ),
        ));
    }
}

/// One step at `pos` checked: out against the reference, the cache rows written (then taken
/// into the reference cache), guards.
fn checked_step(
    s: &mut Suite,
    c: &Consts,
    d: &mut Dev,
    cache: &mut RefCache,
    pj: &[f32],
    pos: usize,
    t: &mut RowTally,
) -> Cmp {
    let got = d.step(s, pj, pos as i32);
    let x = ref_qkv(c, pj, pos);
    if pos < d.max_ctx {
        d.check_rows(s, pos, &x, cache, t);
    } else {
        d.check_guards(s, t, &format!("pos {pos}"));
    }
    let reference = ref_attend(&x, cache, (pos + 1).min(d.max_ctx));
    check_guarded(&got, &reference, TOL)
}

/// Consecutive steps at positions `0..steps`, each checked.
fn run_steps(
    s: &mut Suite,
    c: &Consts,
    d: &mut Dev,
    cache: &mut RefCache,
    steps: usize,
    seed: u64,
    t: &mut RowTally,
) {
    let mut worst = (0f64, 0f64);
    let mut fails = 0;
    for pos in 0..steps {
        let pj = proj(seed + pos as u64);
        let cmp = checked_step(s, c, d, cache, &pj, pos, t);
        worst.0 = worst.0.max(cmp.rel);
        worst.1 = worst.1.max(cmp.max_over_rms);
        if !cmp.ok {
            fails += 1;
            if fails <= 8 {
                s.record(
                    SEC,
                    &format!("max_ctx {} step pos {pos}", d.max_ctx),
                    &cmp,
                    "",
                );
            }
        }
    }
    let c_all = Cmp {
        rel: worst.0,
        max_over_rms: worst.1,
        ok: fails == 0,
        msg: format!("(worst of {steps}, {fails} failed)"),
    };
    s.record(
        SEC,
        &format!("max_ctx {}: out, steps pos 0..{}", d.max_ctx, steps - 1),
        &c_all,
        "",
    );
    record_rows(
        s,
        &format!("max_ctx {}: cache rows so far", d.max_ctx),
        t,
        false,
    );
}

/// Graph-replay time of `per_graph` steps at context `ctx`, cycling over the layer caches;
/// `split` / `combine` select the launches (both: the whole step). Returns µs per step.
#[allow(clippy::too_many_arguments)]
fn time_steps(
    s: &Suite,
    d: &mut Dev,
    kcs: &mut [CudaSlice<u16>],
    vcs: &mut [CudaSlice<u16>],
    ctx: usize,
    split: bool,
    combine: bool,
) -> f64 {
    let cx = s.cx;
    let st = cx.stream();
    let per_graph = 40;
    let reps = if s.quick { 5 } else { 15 };
    let len = d.max_ctx * ROW;
    st.memcpy_htod(&[ctx as i32 - 1], &mut d.pos).unwrap();
    let mut out = st.alloc_zeros::<f32>(OUT).unwrap();
    let (proj_d, qn, kn, fr, pos_d) = (&d.proj, &d.q_norm, &d.k_norm, &d.inv_freq, &d.pos);
    let scratch = &mut d.scratch;
    let layers = kcs.len();
    let secs = s.time_graph(reps, || {
        for i in 0..per_graph {
            let l = i % layers;
            let mut kv = kcs[l].slice_mut(GUARD..GUARD + len);
            let mut vv = vcs[l].slice_mut(GUARD..GUARD + len);
            let mut ov = out.slice_mut(..);
            cx.attn_decode_kernels(
                &proj_d.slice(..),
                &qn.slice(..),
                &kn.slice(..),
                &fr.slice(..),
                &pos_d.slice(..),
                &mut kv,
                &mut vv,
                scratch,
                &mut ov,
                split,
                combine,
            )
            .expect("attn_decode_kernels");
        }
    });
    secs / per_graph as f64 * 1e6
}

/// Runs the attention checks and timings.
pub fn run(s: &mut Suite) {
    let cx = s.cx;
    let c = consts(0xA77);
    let f = cx.func("attn_decode_split").expect("loaded");
    println!(
        "attn_decode_split: {} registers/thread, {} B local",
        f.num_regs().unwrap_or(-1),
        f.local_size_bytes().unwrap_or(-1)
    );
    let mut t = RowTally::default();

    // --- small cache: 5 splits, filled to its last row
    {
        let max_ctx = 70;
        let mut d = Dev::new(s, &c, max_ctx);
        println!(
            "max_ctx {max_ctx}: {} splits per KV head",
            d.scratch.n_splits()
        );
        let mut cache = RefCache {
            k: vec![0.0; max_ctx * ROW],
            v: vec![0.0; max_ctx * ROW],
        };
        run_steps(s, &c, &mut d, &mut cache, max_ctx, 0x1000, &mut t);
    }

    // --- large cache
    let max_ctx = 32_768 + 40;
    let mut d = Dev::new(s, &c, max_ctx);
    println!(
        "max_ctx {max_ctx}: {} splits per KV head",
        d.scratch.n_splits()
    );
    let mut cache = RefCache {
        k: vec![0.0; max_ctx * ROW],
        v: vec![0.0; max_ctx * ROW],
    };
    run_steps(s, &c, &mut d, &mut cache, 70, 0x2000, &mut t);

    // jumps: fill the earlier rows, one step
    for (i, pos) in [4095usize, 32_767, max_ctx - 1].into_iter().enumerate() {
        d.fill(s, &c, &mut cache, pos, 0x3000 + i as u64);
        let cmp = checked_step(
            s,
            &c,
            &mut d,
            &mut cache,
            &proj(0x4000 + i as u64),
            pos,
            &mut t,
        );
        s.record(
            SEC,
            &format!("max_ctx {max_ctx}: out, single step at pos {pos}"),
            &cmp,
            "",
        );
    }

    // out-of-range positions: nothing written, attention over the max_ctx cached rows
    let (k_before, v_before) = d.cache_range(s, 0, max_ctx * ROW + 2 * GUARD);
    for (i, pos) in [max_ctx, max_ctx + 1000].into_iter().enumerate() {
        let cmp = checked_step(
            s,
            &c,
            &mut d,
            &mut cache,
            &proj(0x5000 + i as u64),
            pos,
            &mut t,
        );
        s.record(
            SEC,
            &format!("max_ctx {max_ctx}: out at pos {pos} (>= max_ctx, no write)"),
            &cmp,
            "",
        );
    }
    {
        let got = d.step(s, &proj(0x5100), -1);
        let guards = check_guarded(&got, &vec![1.0; OUT], TOL).msg;
        let zero = got[GUARD..GUARD + OUT].iter().all(|&x| x == 0.0);
        let ok = zero && !guards.contains("guard");
        let msg = if ok {
            String::new()
        } else {
            format!("not all zero or guards changed {guards}")
        };
        s.record(
            SEC,
            &format!("max_ctx {max_ctx}: out at pos -1 (all zero)"),
            &Cmp {
                rel: 0.0,
                max_over_rms: 0.0,
                ok,
                msg,
            },
            "",
        );
    }
    let (k_after, v_after) = d.cache_range(s, 0, max_ctx * ROW + 2 * GUARD);
    let unchanged = k_before == k_after && v_before == v_after;
    let cmp = Cmp {
        rel: 0.0,
        max_over_rms: 0.0,
        ok: unchanged,
        msg: if unchanged {
            String::new()
        } else {
            "caches or guards changed".into()
        },
    };
    s.record(
        SEC,
        "caches untouched by pos max_ctx, max_ctx + 1000, -1",
        &cmp,
        "",
    );
    record_rows(s, "cache rows: all steps of both caches", &t, true);
    drop((k_before, v_before, k_after, v_after, cache));

    // --- timing: 4 layers' caches (copies of the filled test cache), 40 steps per graph
    let layers = 4;
    let st = cx.stream().clone();
    let mut kcs: Vec<CudaSlice<u16>> = Vec::new();
    let mut vcs: Vec<CudaSlice<u16>> = Vec::new();
    for _ in 0..layers {
        let mut k = st.alloc_zeros::<u16>(d.kc.len()).unwrap();
        let mut v = st.alloc_zeros::<u16>(d.vc.len()).unwrap();
        st.memcpy_dtod(&d.kc, &mut k).unwrap();
        st.memcpy_dtod(&d.vc, &mut v).unwrap();
        kcs.push(k);
        vcs.push(v);
    }
    st.memcpy_htod(&proj(0x6000), &mut d.proj).unwrap();
    // launch + exit cost of each kernel: pos = -1 (no keys), the split blocks all return early
    let us_split_empty = time_steps(s, &mut d, &mut kcs, &mut vcs, 0, true, false);
    let us_comb_empty = time_steps(s, &mut d, &mut kcs, &mut vcs, 0, false, true);
    println!(
        "{SEC:<10} pos -1 (no keys): split alone {us_split_empty:.2} us, combine alone {us_comb_empty:.2} us"
    );
    s.json.push((
        SEC.into(),
        format!("{{\"label\":\"time pos -1\",\"us_split\":{us_split_empty:.3},\"us_combine\":{us_comb_empty:.3}}}"),
    ));
    for ctx in [1usize, 128, 4096, 32_768] {
        let us = time_steps(s, &mut d, &mut kcs, &mut vcs, ctx, true, true);
        let us_split = time_steps(s, &mut d, &mut kcs, &mut vcs, ctx, true, false);
        let us_comb = time_steps(s, &mut d, &mut kcs, &mut vcs, ctx, false, true);
        let bytes = (ctx * 2 * ROW * 2) as f64;
        let gbps = bytes / (us * 1e-6) / 1e9;
        let gbps_split = bytes / (us_split * 1e-6) / 1e9;
        println!(
            "{SEC:<10} context {ctx:>6}: {us:>8.2} us/step (graph)  K/V {:>6.2} MB  {gbps:>5.0} GB/s ({:.1}% of copy) | split alone {us_split:.2} us ({gbps_split:.0} GB/s), combine alone {us_comb:.2} us",
            bytes / 1e6,
            gbps * 1e9 / s.copy_bw * 100.0
        );
        s.json.push((
            SEC.into(),
            format!("{{\"label\":\"time context {ctx}\",\"us\":{us:.3},\"us_split\":{us_split:.3},\"us_combine\":{us_comb:.3},\"kv_bytes\":{bytes},\"gbps\":{gbps:.1}}}"),
        ));
    }
}
