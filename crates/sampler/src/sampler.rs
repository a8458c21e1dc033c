//! [`Sampler`]: penalties, warpers and the seeded draw.

use std::cmp::Ordering;
use std::collections::HashMap;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::math::{argmax_inline, clean, exp_neg, expand_seed, max_non_nan, unit_f64};
use crate::params::{SamplerError, SamplingParams};

/// Slack on the top-p mass test: a prefix whose mass falls short of `top_p` by
/// less than this counts as reaching it. It absorbs float rounding (the weights
/// carry ~1e-7 relative error), so that a set whose exact mass equals `top_p`
/// is kept as it is, with no extra token; see [`Sampler::sample`].
pub(crate) const TOP_P_SLACK: f64 = 1e-6;

/// Candidate windows at most this long are sorted outright by [`nucleus_len`].
const NUCLEUS_SORT_LEN: usize = 64;

/// Block length of the dense inverse-CDF draw: one partial sum per block, then
/// a walk inside a single block.
const DRAW_BLOCK: usize = 1024;

/// A token that survived the filters so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Cand {
    /// Token id.
    pub(crate) idx: u32,
    /// Logit after masking and penalties (NaN as -inf, +inf as `f32::MAX`).
    pub(crate) x: f32,
    /// `exp((x - max) / temperature)`: the probability relative to the most
    /// likely token (which has weight exactly 1).
    pub(crate) w: f32,
}

/// Total order "more likely first": higher logit first, lower id first on ties.
/// The weight is monotone in the logit, so this also orders by probability.
#[inline]
pub(crate) fn rank(a: &Cand, b: &Cand) -> Ordering {
    b.x.total_cmp(&a.x).then(a.idx.cmp(&b.idx))
}

/// Where the survivors of steps 5–8 are, for the draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Plan {
    /// No token has positive probability: fall back to argmax.
    Degenerate,
    /// Survivors are `Sampler::cands` (top-k path).
    Sparse,
    /// Survivors are the ids whose `Sampler::weights` entry is `> 0` and
    /// `>= w_min` (path without top-k).
    Dense { w_min: f32 },
}

/// `d / temperature`, as a multiplication by `1 / temperature` when that is
/// finite (a division when the temperature is so small that it overflows).
#[derive(Debug, Clone, Copy)]
struct Scale {
    t: f32,
    inv: f32,
}

impl Scale {
    fn new(t: f32) -> Self {
        Scale { t, inv: 1.0 / t }
    }
    #[inline(always)]
    fn apply(self, d: f32) -> f32 {
        if self.inv.is_finite() {
            d * self.inv
        } else {
            d / self.t
        }
    }
}

/// Seeded sampler for one generation stream.
///
/// Holds the [`SamplingParams`], the ChaCha20 random stream, the counts of the
/// generated tokens (for the penalties) and scratch buffers reused by every
/// call, so [`Sampler::sample`] does not allocate once the buffers have grown
/// to the vocabulary size.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    /// Effective seed (drawn from OS entropy when `params.seed` is `None`).
    seed: u64,
    rng: ChaCha20Rng,
    /// How many times each generated token was accepted. Sparse: one entry per
    /// distinct generated token, never per vocabulary entry.
    counts: HashMap<u32, u32>,
    /// Scratch: logits of the top-k pre-filter, for `select_nth_unstable`.
    vals: Vec<f32>,
    /// Scratch: one weight per id (path without top-k).
    weights: Vec<f32>,
    /// Scratch: per-block weight sums of the dense draw.
    blocks: Vec<f64>,
    /// Scratch: surviving candidates of the top-k path, in ascending id order.
    cands: Vec<Cand>,
    /// Scratch: candidates being selected (top-k pre-filter, top-p).
    sel: Vec<Cand>,
}

fn rng_from(seed: u64) -> ChaCha20Rng {
    ChaCha20Rng::from_seed(expand_seed(seed))
}

impl Sampler {
    /// A sampler for `params`, seeded from `params.seed` (or OS entropy).
    ///
    /// # Errors
    /// [`SamplerError::InvalidParam`] when [`SamplingParams::validate`] fails.
    pub fn new(params: SamplingParams) -> Result<Self, SamplerError> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(rand::random::<u64>);
        Ok(Sampler {
            params,
            seed,
            rng: rng_from(seed),
            counts: HashMap::new(),
            vals: Vec::new(),
            weights: Vec::new(),
            blocks: Vec::new(),
            cands: Vec::new(),
            sel: Vec::new(),
        })
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed in use: `params.seed`, or the one drawn from OS entropy. A
    /// sampler built with `seed: Some(self.seed())` reproduces this stream.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Records a generated token, for the presence, frequency and repetition
    /// penalties of later calls. Tokens of the prompt must not be given here:
    /// penalties count generated tokens only.
    pub fn accept(&mut self, token: u32) {
        let c = self.counts.entry(token).or_insert(0);
        *c = c.saturating_add(1);
    }

    /// Forgets the accepted tokens and restarts the random stream: from the
    /// same seed when `params.seed` is set (so the same logits give the same
    /// tokens again), from a fresh OS-entropy seed otherwise. Scratch buffers
    /// keep their capacity.
    pub fn reset(&mut self) {
        self.counts.clear();
        if self.params.seed.is_none() {
            self.seed = rand::random::<u64>();
        }
        self.rng = rng_from(self.seed);
    }

    /// Picks the next token from `logits` (one row, one entry per vocabulary id).
    ///
    /// Ids `>= vocab_limit` are never chosen (for Qwen3.6 pass 248,077: the
    /// rows above it are padding). A `vocab_limit` above `logits.len()` is
    /// clamped to it.
    ///
    /// # Order of processing
    /// 1. **Mask**: `logits[vocab_limit..]` is set to `-inf`.
    /// 2. **Repetition penalty** (CTRL §4.1; transformers'
    ///    `RepetitionPenaltyLogitsProcessor`): for each distinct accepted token,
    ///    a logit `> 0` is divided by `repetition_penalty`, any other multiplied.
    /// 3. **Presence and frequency penalties** (OpenAI's definition,
    ///    `mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`).
    ///    Steps 2–3 follow vLLM's `apply_penalties` order and touch only
    ///    tokens given to [`Sampler::accept`], never the prompt.
    /// 4. **Greedy**: if `temperature == 0`, return [`argmax`](crate::argmax) (first id on ties).
    /// 5. **Temperature**: probabilities `∝ exp((x - max) / temperature)`.
    /// 6. **Top-k**: keep logits `>=` the k-th largest (ties with it are kept,
    ///    as in transformers' `TopKLogitsWarper` and vLLM), found with
    ///    `select_nth_unstable` on a pre-filtered copy (no full sort).
    /// 7. **Top-p**: over the top-k survivors, renormalised, keep the
    ///    smallest set of most likely tokens whose mass is `>= top_p` (at least
    ///    one). Equivalently, a token is kept iff the mass of the tokens ranked
    ///    strictly above it is `< top_p`: this is transformers'
    ///    `TopPLogitsWarper` (which drops the tokens whose ascending cumulative
    ///    probability is `<= 1 - top_p`) and vLLM's rule. Ranks are by logit,
    ///    then lower id first. To make the boundary well defined under
    ///    rounding, a mass within `1e-6` below `top_p` counts as reaching it:
    ///    probabilities `0.5, 0.3, 0.15, 0.05` with `top_p = 0.8` keep exactly
    ///    two tokens (transformers in `f32` can keep the third there, as
    ///    `0.5 + 0.3` may round either side of `0.8`). No full sort: with
    ///    top-k the few survivors are ordered by a mass-guided quickselect;
    ///    without it a radix selection on the weights' bits (a histogram of
    ///    the whole row, then two refinements of the crossing bucket) finds
    ///    the boundary, and only the tokens tied at the boundary weight are
    ///    ordered.
    /// 8. **Min-p**: keep tokens whose probability is `>= min_p` times the
    ///    largest one (transformers' `MinPLogitsWarper`; the ratio does not
    ///    depend on the earlier renormalisations).
    /// 9. **Draw** one token from the survivors, renormalised, by inverse CDF
    ///    over ascending ids with one uniform `f64` from ChaCha20.
    ///
    /// Steps 5–8 are transformers' warper order (temperature, top-k, top-p,
    /// min-p). vLLM (v1) differs in one respect: it applies min-p *before*
    /// top-k/top-p, so its nucleus is measured on the min-p-filtered
    /// distribution. transformers and vLLM apply the repetition penalty to the
    /// prompt tokens too; here it covers generated tokens only. vLLM treats a
    /// temperature below `1e-5` as greedy; here only exactly 0 is greedy (a
    /// tiny positive temperature still works and is effectively greedy).
    /// Tokens more than 87 temperature-scaled nats below the best one have
    /// probability `< 1.7e-38` and are dropped.
    ///
    /// # Determinism
    /// Every non-greedy call consumes exactly one 64-bit output of the RNG;
    /// greedy calls consume none. The exponentials are computed without libm,
    /// no operation is fused, every sum has a fixed order and the survivors
    /// are drawn in id order, so the same seed and the same logits give the
    /// same tokens on every platform (and in the AVX2 and portable builds).
    ///
    /// # Degenerate input (never panics)
    /// NaN logits are never chosen (treated as `-inf`); `+inf` logits take all
    /// the mass (shared equally when several). When no id below `vocab_limit`
    /// has a logit above `-inf` (all `-inf`/NaN), the result is
    /// [`argmax`](crate::argmax)`(&logits[..vocab_limit])`, which is 0 for all `-inf` or all
    /// NaN. An empty row or `vocab_limit == 0` returns 0.
    ///
    /// # Side effect on `logits`
    /// On return `logits[..vocab_limit]` holds the penalised logits (steps
    /// 1–3; NaN and `inf` left as they were) and `logits[vocab_limit..]` is
    /// `-inf`. Temperature and the filters do not write to `logits`.
    ///
    /// # Cost
    /// No allocation once the scratch buffers have grown to the row length.
    /// Penalties touch only the generated tokens. Greedy: a max pass and a
    /// block-wise search for its first occurrence. With top-k: a max pass
    /// over k segments (the smallest segment max bounds the k-th largest from
    /// below), a block-wise pass collecting the tokens above that bound, and
    /// `select_nth_unstable` on those only. Without top-k: a max pass, a
    /// weight pass (one exponential per id), with top-p a histogram pass and
    /// a block-wise boundary pass, and a block-sum pass for the draw. The
    /// passes are branch-free and vectorise; on x86-64 CPUs with AVX2 the call
    /// runs an AVX2 build of the same code.
    pub fn sample(&mut self, logits: &mut [f32], vocab_limit: usize) -> u32 {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2, checked just above.
                return unsafe { self.sample_avx2(logits, vocab_limit) };
            }
        }
        self.sample_portable(logits, vocab_limit)
    }

    /// [`Sampler::sample_portable`] compiled for AVX2. The results are
    /// bit-identical: the same IEEE operations in the same order, never fused.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn sample_avx2(&mut self, logits: &mut [f32], vocab_limit: usize) -> u32 {
        self.sample_portable(logits, vocab_limit)
    }

    /// The body of [`Sampler::sample`], inlined into each compiled variant.
    #[inline(always)]
    pub(crate) fn sample_portable(&mut self, logits: &mut [f32], vocab_limit: usize) -> u32 {
        let n = vocab_limit.min(logits.len());
        for x in &mut logits[n..] {
            *x = f32::NEG_INFINITY;
        }
        if n == 0 {
            return 0;
        }
        let logits = &mut logits[..n];
        self.apply_penalties(logits);
        if self.params.is_greedy() {
            return argmax_inline(logits);
        }
        let u = unit_f64(self.rng.next_u64());
        let drawn = match self.plan(logits) {
            Plan::Degenerate => None,
            Plan::Sparse => draw_sparse(&self.cands, u),
            Plan::Dense { w_min } => draw_dense(&self.weights, w_min, &mut self.blocks, u),
        };
        drawn.unwrap_or_else(|| argmax_inline(logits))
    }

    /// Steps 2–3 of [`Sampler::sample`], on the generated tokens only.
    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        let (rep, pres, freq) = (
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        );
        if rep == 1.0 && pres == 0.0 && freq == 0.0 {
            return;
        }
        // Each entry changes only its own logit, so the map's order is irrelevant.
        for (&tok, &count) in &self.counts {
            let Some(x) = logits.get_mut(tok as usize) else {
                continue;
            };
            if rep != 1.0 {
                *x = if *x > 0.0 { *x / rep } else { *x * rep };
            }
            if pres != 0.0 || freq != 0.0 {
                *x -= count as f32 * freq + pres;
            }
        }
    }

    /// Steps 5–8: computes the survivors and says where they are.
    #[inline(always)]
    pub(crate) fn plan(&mut self, logits: &[f32]) -> Plan {
        let k = self.params.top_k;
        if k > 0 && k < logits.len() {
            self.plan_top_k(logits, k)
        } else {
            self.plan_dense(logits)
        }
    }

    /// Top-k path: survivors in `self.cands`, in id order.
    #[inline(always)]
    fn plan_top_k(&mut self, logits: &[f32], k: usize) -> Plan {
        let n = logits.len();
        // k disjoint segments: each holds a token whose (clean) logit is its
        // segment's max, so the smallest segment max is <= the k-th largest.
        let seg = n / k; // >= 1, and n / seg >= k segments
        let chunks = logits.chunks_exact(seg);
        let tail = max_non_nan(chunks.remainder()).min(f32::MAX);
        let (mut lower, mut max) = (f32::INFINITY, tail);
        for c in chunks {
            let m = max_non_nan(c).min(f32::MAX);
            lower = lower.min(m);
            max = max.max(m);
        }
        if max == f32::NEG_INFINITY {
            return Plan::Degenerate;
        }
        self.vals.clear();
        self.sel.clear();
        let (vals, sel) = (&mut self.vals, &mut self.sel);
        for_each_hit(
            logits,
            |x| clean(x) >= lower,
            |i, x| {
                vals.push(clean(x));
                sel.push(Cand {
                    idx: i as u32,
                    x: clean(x),
                    w: 0.0,
                });
            },
        );
        let thr = match self.vals.len() {
            len if len >= k => {
                *self
                    .vals
                    .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a))
                    .1
            }
            _ => lower, // unreachable: the k segment maxima pass the filter
        };
        let scale = Scale::new(self.params.temperature);
        self.cands.clear();
        for c in &self.sel {
            if c.x >= thr {
                let w = exp_neg(scale.apply(c.x - max));
                if w > 0.0 {
                    self.cands.push(Cand { w, ..*c });
                }
            }
        }
        let top_p = self.params.top_p;
        if top_p < 1.0 && self.cands.len() > 1 {
            self.sparse_top_p(top_p);
        }
        let min_p = self.params.min_p;
        if min_p > 0.0 {
            // The best token has weight exactly 1 (exp_neg(0) == 1), so the
            // threshold `min_p * p_max` is `min_p` in weight units.
            self.cands.retain(|c| c.w >= min_p);
        }
        if self.cands.is_empty() {
            Plan::Degenerate
        } else {
            Plan::Sparse
        }
    }

    /// Step 7 on `self.cands`, keeping them in id order.
    #[inline(always)]
    fn sparse_top_p(&mut self, top_p: f32) {
        let total: f64 = self.cands.iter().map(|c| c.w as f64).sum();
        let target = (top_p as f64 - TOP_P_SLACK) * total;
        self.sel.clear();
        self.sel.extend_from_slice(&self.cands);
        let len = nucleus_len(&mut self.sel, target);
        if len >= self.sel.len() {
            return;
        }
        // The nucleus is exactly the `len` best-ranked tokens; its worst member
        // is the cut. Filtering `cands` by rank keeps id order, so the draw does
        // not depend on how the selection permuted `sel`.
        if let Some(cut) = self.sel[..len].iter().copied().max_by(rank) {
            self.cands.retain(|c| rank(c, &cut) != Ordering::Greater);
        }
    }

    /// Path without top-k: one weight per id in `self.weights`.
    #[inline(always)]
    fn plan_dense(&mut self, logits: &[f32]) -> Plan {
        let max = max_non_nan(logits).min(f32::MAX);
        if max == f32::NEG_INFINITY {
            return Plan::Degenerate;
        }
        fill_weights(
            &mut self.weights,
            logits,
            max,
            Scale::new(self.params.temperature),
        );
        let mut w_min = 0.0f32;
        let top_p = self.params.top_p;
        if top_p < 1.0 {
            w_min = self.dense_top_p(logits, top_p);
        }
        let min_p = self.params.min_p;
        if min_p > 0.0 {
            w_min = w_min.max(min_p);
        }
        Plan::Dense { w_min }
    }

    /// Step 7 on `self.weights`: returns the weight `w*` below which every
    /// token is out, and zeroes the weights of the tokens of weight exactly
    /// `w*` that fall outside the nucleus.
    ///
    /// Radix selection by mass over the bits of the (positive) weights, whose
    /// order is the order of the values: a histogram of the top 9 bits over
    /// the whole row finds the bucket where the cumulative mass (heaviest
    /// first) crosses the target; that bucket's tokens are refined on the next
    /// 11 bits, then the last 11, which leaves the tokens of weight exactly
    /// `w*`, ordered by [`rank`] for the final cut.
    #[inline(always)]
    fn dense_top_p(&mut self, logits: &[f32], top_p: f32) -> f32 {
        const TOP_SHIFT: u32 = 22;
        const TOP_BUCKETS: usize = 1 << (31 - TOP_SHIFT);
        const LOW_BITS: u32 = 11;
        const LOW_BUCKETS: usize = 1 << LOW_BITS;
        let top = |w: f32| (w.to_bits() >> TOP_SHIFT) as usize & (TOP_BUCKETS - 1);
        // Four interleaved histograms break the store-to-load dependency
        // between neighbouring tokens.
        let mut hist = [[0.0f64; TOP_BUCKETS]; 4];
        let chunks = self.weights.chunks_exact(4);
        let rest = chunks.remainder();
        for c in chunks {
            for (h, &w) in hist.iter_mut().zip(c) {
                h[top(w)] += w as f64;
            }
        }
        for &w in rest {
            hist[0][top(w)] += w as f64;
        }
        let mut level = [0.0f64; TOP_BUCKETS];
        for (b, m) in level.iter_mut().enumerate() {
            *m = ((hist[0][b] + hist[1][b]) + hist[2][b]) + hist[3][b];
        }
        let total: f64 = level.iter().rev().sum();
        let target = (top_p as f64 - TOP_P_SLACK) * total;
        let Some((b1, mut above)) = crossing(&level, target, 0.0) else {
            return 0.0;
        };
        self.sel.clear();
        let sel = &mut self.sel;
        for_each_hit(
            &self.weights,
            |w| w > 0.0 && top(w) == b1,
            |i, w| {
                let x = logits.get(i).map_or(f32::NEG_INFINITY, |&x| clean(x));
                sel.push(Cand {
                    idx: i as u32,
                    x,
                    w,
                });
            },
        );
        for shift in [LOW_BITS, 0] {
            let low = |w: f32| (w.to_bits() >> shift) as usize & (LOW_BUCKETS - 1);
            let mut h = [0.0f64; LOW_BUCKETS];
            for c in &self.sel {
                h[low(c.w)] += c.w as f64;
            }
            let Some((b, a)) = crossing(&h, target, above) else {
                break;
            };
            above = a;
            self.sel.retain(|c| low(c.w) == b);
        }
        // `sel`: the tokens of weight exactly w*, in id order.
        let Some(w_star) = self.sel.first().map(|c| c.w) else {
            return 0.0;
        };
        let len = nucleus_len(&mut self.sel, target - above);
        for c in &self.sel[len.min(self.sel.len())..] {
            if let Some(w) = self.weights.get_mut(c.idx as usize) {
                *w = 0.0;
            }
        }
        w_star
    }
}

/// Walks `mass` from the last (heaviest) bucket down, starting from `above`,
/// to the first non-empty bucket where the running mass reaches `target`.
/// Returns that bucket and the mass strictly above it. When rounding keeps
/// the target out of reach, returns the lightest non-empty bucket; `None`
/// only when every bucket is empty.
#[inline(always)]
fn crossing(mass: &[f64], target: f64, above: f64) -> Option<(usize, f64)> {
    let mut acc = above;
    let mut last = None;
    for (b, &m) in mass.iter().enumerate().rev() {
        // Skipping empty buckets keeps the best token when target <= 0.
        if m > 0.0 {
            if acc + m >= target {
                return Some((b, acc));
            }
            last = Some((b, acc));
            acc += m;
        }
    }
    last
}

/// Fills `out` with `exp_neg(scale(clean(x) - max))` for every logit: the
/// heaviest pass of sampling without top-k.
#[inline(always)]
fn fill_weights(out: &mut Vec<f32>, logits: &[f32], max: f32, scale: Scale) {
    // `resize` writes only new elements: no fill once the buffer has grown.
    out.resize(logits.len(), 0.0);
    // Plain loops (no iterator adaptor left out of line), each branch-free so
    // that it vectorises with the caller's target features.
    if scale.inv.is_finite() {
        let inv = scale.inv;
        for (o, &x) in out.iter_mut().zip(logits) {
            *o = exp_neg((clean(x) - max) * inv);
        }
    } else {
        let t = scale.t;
        for (o, &x) in out.iter_mut().zip(logits) {
            *o = exp_neg((clean(x) - max) / t);
        }
    }
}

/// Calls `f(i, xs[i])` for every `i` whose value passes `keep`, in ascending
/// order. Blocks of 64 are first tested with a branch-free (vectorised) pass,
/// so a scan for rare hits costs about one vector compare per element.
#[inline(always)]
fn for_each_hit<T: Copy>(xs: &[T], keep: impl Fn(T) -> bool, mut f: impl FnMut(usize, T)) {
    const BLOCK: usize = 64;
    for (b, block) in xs.chunks(BLOCK).enumerate() {
        if block.iter().fold(false, |hit, &v| hit | keep(v)) {
            for (j, &v) in block.iter().enumerate() {
                if keep(v) {
                    f(b * BLOCK + j, v);
                }
            }
        }
    }
}

/// Length of the nucleus: the smallest `L >= 1` such that the `L` best-ranked
/// candidates (by [`rank`]) have total weight `>= target`, or `c.len()` when
/// rounding leaves the target unreached. On return `c[..L]` holds those
/// candidates (in no particular order).
///
/// Mass-guided quickselect: partition the open window at its middle rank with
/// `select_nth_unstable_by`, sum the better half, and recurse into the half
/// that holds the boundary; windows of at most [`NUCLEUS_SORT_LEN`] are sorted.
/// Expected O(n) for n candidates.
pub(crate) fn nucleus_len(c: &mut [Cand], target: f64) -> usize {
    // Invariant: c[..lo] are the `lo` best candidates, of mass `acc < target`;
    // the answer lies in (lo, hi].
    let (mut lo, mut hi, mut acc) = (0usize, c.len(), 0.0f64);
    while hi - lo > NUCLEUS_SORT_LEN {
        let mid = lo + (hi - lo) / 2;
        c[lo..hi].select_nth_unstable_by(mid - lo, rank);
        let upper: f64 = c[lo..mid].iter().map(|e| e.w as f64).sum();
        if acc + upper >= target {
            hi = mid;
        } else {
            acc += upper;
            lo = mid;
        }
    }
    c[lo..hi].sort_unstable_by(rank);
    for (i, e) in c.iter().enumerate().take(hi).skip(lo) {
        acc += e.w as f64;
        if acc >= target {
            return i + 1;
        }
    }
    hi
}

/// Inverse-CDF draw over `cands` (in their order) with `u` in `[0, 1)`.
#[inline(always)]
fn draw_sparse(cands: &[Cand], u: f64) -> Option<u32> {
    let total: f64 = cands.iter().map(|c| c.w as f64).sum();
    let r = u * total;
    let mut acc = 0.0f64;
    for c in cands {
        acc += c.w as f64;
        if r < acc {
            return Some(c.idx);
        }
    }
    // Only reachable through rounding (r == total): the last token.
    cands.last().map(|c| c.idx)
}

/// Effective weight of the dense path: 0 below the `w_min` cut.
#[inline(always)]
fn eff(w: f32, w_min: f32) -> f32 {
    if w >= w_min {
        w
    } else {
        0.0
    }
}

/// Sum of the effective weights of one block, in a fixed order (eight `f64`
/// lanes, then the remainder), so it vectorises and stays reproducible.
#[inline(always)]
fn block_sum(ws: &[f32], w_min: f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = ws.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &w) in acc.iter_mut().zip(c) {
            *a += eff(w, w_min) as f64;
        }
    }
    let mut s = 0.0f64;
    for a in acc {
        s += a;
    }
    for &w in rest {
        s += eff(w, w_min) as f64;
    }
    s
}

/// Inverse-CDF draw over ids in ascending order, weights `eff(w, w_min)`:
/// block sums locate the block, then a walk inside it locates the token.
#[inline(always)]
fn draw_dense(weights: &[f32], w_min: f32, blocks: &mut Vec<f64>, u: f64) -> Option<u32> {
    blocks.clear();
    let mut total = 0.0f64;
    for c in weights.chunks(DRAW_BLOCK) {
        let s = block_sum(c, w_min);
        blocks.push(s);
        total += s;
    }
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let r = u * total;
    let mut acc = 0.0f64;
    for (b, &s) in blocks.iter().enumerate() {
        if s > 0.0 && r < acc + s {
            let start = b * DRAW_BLOCK;
            let block = &weights[start..(start + DRAW_BLOCK).min(weights.len())];
            let mut last = None;
            for (j, &w) in block.iter().enumerate() {
                let w = eff(w, w_min);
                if w > 0.0 {
                    acc += w as f64;
                    last = Some(j);
                    if r < acc {
                        break;
                    }
                }
            }
            // Without a break (rounding inside the block): its last token.
            return last.map(|j| (start + j) as u32);
        }
        acc += s;
    }
    // r >= total through rounding: the last token with weight.
    weights
        .iter()
        .rposition(|&w| eff(w, w_min) > 0.0)
        .map(|i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(SamplingParams { seed: Some(7), ..p }).unwrap()
    }

    /// Ids that survive steps 5–8, in ascending order.
    fn kept(logits: &[f32], p: SamplingParams) -> Vec<u32> {
        let mut s = sampler(p);
        match s.plan(logits) {
            Plan::Degenerate => vec![],
            Plan::Sparse => s.cands.iter().map(|c| c.idx).collect(),
            Plan::Dense { w_min } => (0..logits.len() as u32)
                .filter(|&i| eff(s.weights[i as usize], w_min) > 0.0)
                .collect(),
        }
    }

    /// `kept` through both paths: dense (top_k off), and sparse (a `-inf` id
    /// appended so that `top_k = len` is a real, inactive top-k). They must agree.
    fn kept_both(logits: &[f32], p: SamplingParams) -> Vec<u32> {
        assert_eq!(p.top_k, 0);
        let dense = kept(logits, p.clone());
        let mut padded = logits.to_vec();
        padded.push(f32::NEG_INFINITY);
        let sparse = kept(
            &padded,
            SamplingParams {
                top_k: logits.len(),
                ..p
            },
        );
        assert_eq!(dense, sparse, "dense and top-k paths disagree");
        dense
    }

    fn ln(p: &[f32]) -> Vec<f32> {
        p.iter().map(|x| x.ln()).collect()
    }

    fn test_rng(seed: u64) -> ChaCha20Rng {
        rng_from(seed)
    }

    fn brute_nucleus(logits: &[f32], temperature: f64, top_p: f64) -> Vec<u32> {
        let m = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
        let w: Vec<f64> = logits
            .iter()
            .map(|&x| ((x as f64 - m) / temperature).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let mut acc = 0.0;
        let mut want = Vec::new();
        for &i in &order {
            want.push(i as u32);
            acc += w[i];
            if acc >= top_p * total {
                break;
            }
        }
        want.sort_unstable();
        want
    }

    #[test]
    fn nucleus_len_matches_sorted_prefix() {
        let mut rng = test_rng(1);
        for case in 0..300 {
            let n = 1 + (rng.next_u32() % 700) as usize;
            let mut c: Vec<Cand> = (0..n)
                .map(|i| {
                    // Few distinct logits, so ties in logit (broken by id) are common.
                    let x = (rng.next_u32() % 40) as f32 * 0.25 - 5.0;
                    Cand {
                        idx: i as u32,
                        x,
                        w: exp_neg(x - 5.0),
                    }
                })
                .collect();
            let total: f64 = c.iter().map(|e| e.w as f64).sum();
            let frac = unit_f64(rng.next_u64());
            let target = frac * total;
            let mut sorted = c.clone();
            sorted.sort_by(rank);
            let mut acc = 0.0;
            let mut want = n;
            for (i, e) in sorted.iter().enumerate() {
                acc += e.w as f64;
                if acc >= target {
                    want = i + 1;
                    break;
                }
            }
            let got = nucleus_len(&mut c, target);
            assert_eq!(got, want, "case {case}: n={n} frac={frac}");
            let mut kept: Vec<u32> = c[..got].iter().map(|e| e.idx).collect();
            let mut want_ids: Vec<u32> = sorted[..want].iter().map(|e| e.idx).collect();
            kept.sort_unstable();
            want_ids.sort_unstable();
            assert_eq!(kept, want_ids, "case {case}");
        }
    }

    #[test]
    fn nucleus_len_keeps_at_least_one() {
        let mut c: Vec<Cand> = (0..500)
            .map(|i| Cand {
                idx: i,
                x: 1.0,
                w: 1.0,
            })
            .collect();
        assert_eq!(nucleus_len(&mut c, 0.0), 1);
        assert_eq!(nucleus_len(&mut c, -5.0), 1);
        assert_eq!(c[0].idx, 0, "ties go to the lowest id");
    }

    #[test]
    fn top_p_boundary_is_inclusive_of_exact_mass() {
        let logits = ln(&[0.05, 0.5, 0.15, 0.3]);
        let tp = |top_p: f32| {
            kept_both(
                &logits,
                SamplingParams {
                    top_p,
                    ..Default::default()
                },
            )
        };
        assert_eq!(tp(0.8), vec![1, 3], "mass 0.5 + 0.3 reaches 0.8 exactly");
        assert_eq!(tp(0.79), vec![1, 3]);
        assert_eq!(tp(0.81), vec![1, 2, 3]);
        assert_eq!(tp(0.5), vec![1], "mass 0.5 reaches 0.5 exactly");
        assert_eq!(tp(0.501), vec![1, 3]);
        assert_eq!(tp(0.95), vec![1, 2, 3]);
        assert_eq!(tp(0.951), vec![0, 1, 2, 3]);
        assert_eq!(tp(1e-9), vec![1]);
    }

    #[test]
    fn top_p_matches_brute_force_on_large_rows() {
        // Rows of various shapes, both paths, several temperatures and top_p:
        // exercises the histogram boundary, the quickselect loop and ties.
        let mut rng = test_rng(3);
        for case in 0..60 {
            let n = 200 + (rng.next_u32() % 6000) as usize;
            let spread = [0.05f32, 1.0, 10.0, 40.0][case % 4];
            let levels = 1 + rng.next_u32() % 2000;
            let logits: Vec<f32> = (0..n)
                .map(|_| (rng.next_u32() % levels) as f32 / levels as f32 * spread)
                .collect();
            let top_p = [0.1f32, 0.5, 0.9, 0.95, 0.999][case % 5];
            let t = [0.5f32, 1.0, 1.7][case % 3];
            let got = kept_both(
                &logits,
                SamplingParams {
                    top_p,
                    temperature: t,
                    ..Default::default()
                },
            );
            let want = brute_nucleus(&logits, t as f64, top_p as f64);
            // The 1e-6 slack may stop one token early when the kept mass falls
            // short of top_p by less than 1e-6; allow exactly that difference.
            if got != want {
                assert_eq!(got.len() + 1, want.len(), "case {case}");
                assert!(got.iter().all(|i| want.contains(i)), "case {case}");
                let m = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
                let w: Vec<f64> = logits
                    .iter()
                    .map(|&x| ((x as f64 - m) / t as f64).exp())
                    .collect();
                let total: f64 = w.iter().sum();
                let kept_mass: f64 = got.iter().map(|&i| w[i as usize]).sum::<f64>() / total;
                let deficit = top_p as f64 - kept_mass;
                assert!(
                    deficit > 0.0 && deficit < TOP_P_SLACK + 1e-9,
                    "case {case}: deficit {deficit:e}"
                );
            }
        }
    }

    #[test]
    fn top_p_on_equal_logits_keeps_the_lowest_ids() {
        let logits = vec![0.25f32; 5000];
        let got = kept_both(
            &logits,
            SamplingParams {
                top_p: 0.5,
                ..Default::default()
            },
        );
        assert_eq!(got, (0..2500).collect::<Vec<u32>>());
        // Two tiers: 1000 tokens 1 nat above 4000 others.
        let mut logits = vec![0.0f32; 5000];
        for x in logits.iter_mut().skip(7).step_by(5) {
            *x = 1.0;
        }
        let got = kept_both(
            &logits,
            SamplingParams {
                top_p: 0.9,
                ..Default::default()
            },
        );
        assert_eq!(got, brute_nucleus(&logits, 1.0, 0.9f32 as f64));
    }

    #[test]
    fn dispatched_and_portable_samples_are_identical() {
        // On a CPU with AVX2, `sample` runs the AVX2 build: it must give the
        // same tokens as the portable build, draw for draw.
        let mut rng = test_rng(9);
        let variants = [
            SamplingParams::default(),
            SamplingParams {
                temperature: 0.3,
                top_p: 0.9,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1e-40,
                ..Default::default()
            },
            SamplingParams {
                top_k: 40,
                top_p: 0.95,
                min_p: 0.01,
                ..Default::default()
            },
            SamplingParams {
                min_p: 0.2,
                temperature: 2.0,
                ..Default::default()
            },
        ];
        for (v, p) in variants.into_iter().enumerate() {
            let mut a = sampler(p.clone());
            let mut b = sampler(p);
            for step in 0..30 {
                let mut logits: Vec<f32> = (0..5_003)
                    .map(|_| (unit_f64(rng.next_u64()) as f32 - 0.5) * 30.0)
                    .collect();
                logits[3] = f32::NAN;
                logits[4] = f32::NEG_INFINITY;
                let mut other = logits.clone();
                let ta = a.sample(&mut logits, 5_000);
                let tb = b.sample_portable(&mut other, 5_000);
                assert_eq!(ta, tb, "variant {v} step {step}");
                assert_eq!(
                    a.weights.iter().map(|w| w.to_bits()).collect::<Vec<_>>(),
                    b.weights.iter().map(|w| w.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    #[test]
    fn top_k_keeps_ties_with_kth() {
        let logits = [1.0, 3.0, 2.0, 2.0, 0.0, 2.0];
        let k = |top_k| {
            kept(
                &logits,
                SamplingParams {
                    top_k,
                    ..Default::default()
                },
            )
        };
        assert_eq!(k(2), vec![1, 2, 3, 5]);
        assert_eq!(k(1), vec![1]);
        assert_eq!(k(4), vec![1, 2, 3, 5]);
        assert_eq!(k(5), vec![0, 1, 2, 3, 5]);
        assert_eq!(k(6), vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn top_k_matches_brute_force() {
        let mut rng = test_rng(4);
        for case in 0..200 {
            let n = 1 + (rng.next_u32() % 3000) as usize;
            let levels = 1 + rng.next_u32() % 500;
            let mut logits: Vec<f32> = (0..n)
                .map(|_| (rng.next_u32() % levels) as f32 * 0.01)
                .collect();
            if case % 3 == 0 {
                logits.sort_by(f32::total_cmp); // ascending: the pre-filter's worst case
            }
            if case % 5 == 0 {
                for x in logits.iter_mut().step_by(7) {
                    *x = f32::NAN;
                }
            }
            let k = 1 + (rng.next_u32() as usize % n);
            let got = kept(
                &logits,
                SamplingParams {
                    top_k: k,
                    temperature: 100.0,
                    ..Default::default()
                },
            );
            let mut sorted: Vec<f32> = logits.iter().map(|&x| clean(x)).collect();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let thr = sorted[k.min(n) - 1];
            let want: Vec<u32> = (0..n as u32)
                .filter(|&i| {
                    let x = clean(logits[i as usize]);
                    x > f32::NEG_INFINITY && (k >= n || x >= thr)
                })
                .collect();
            assert_eq!(got, want, "case {case}: n={n} k={k}");
        }
    }

    #[test]
    fn top_k_then_top_p_is_renormalised() {
        // Within the top 2 (0.5, 0.3) the best has 0.625 >= 0.6 of the mass.
        let logits = ln(&[0.5, 0.3, 0.15, 0.05]);
        let got = kept(
            &logits,
            SamplingParams {
                top_k: 2,
                top_p: 0.6,
                ..Default::default()
            },
        );
        assert_eq!(got, vec![0]);
        let got = kept_both(
            &logits,
            SamplingParams {
                top_p: 0.6,
                ..Default::default()
            },
        );
        assert_eq!(got, vec![0, 1]);
    }

    #[test]
    fn min_p_relative_to_top() {
        let logits = ln(&[0.15, 0.5, 0.05, 0.3]);
        let mp = |min_p: f32| {
            kept_both(
                &logits,
                SamplingParams {
                    min_p,
                    ..Default::default()
                },
            )
        };
        assert_eq!(mp(0.29), vec![0, 1, 3]);
        assert_eq!(mp(0.31), vec![1, 3]);
        assert_eq!(mp(0.61), vec![1]);
        assert_eq!(mp(1.0), vec![1]);
        assert_eq!(mp(0.09), vec![0, 1, 2, 3]);
    }

    #[test]
    fn min_p_is_applied_after_top_p() {
        // transformers order: top-p on the full distribution keeps {0, 1, 2}
        // (0.4 + 0.3 < 0.75); vLLM's order (min-p first) would keep {0, 1}.
        let logits = ln(&[0.4, 0.3, 0.2, 0.1]);
        let got = kept_both(
            &logits,
            SamplingParams {
                top_p: 0.75,
                min_p: 0.3,
                ..Default::default()
            },
        );
        assert_eq!(got, vec![0, 1, 2]);
    }

    #[test]
    fn temperature_scales_weights() {
        let logits = [0.0, -1.0];
        let mut s = sampler(SamplingParams {
            temperature: 0.5,
            ..Default::default()
        });
        assert_eq!(s.plan(&logits), Plan::Dense { w_min: 0.0 });
        assert_eq!(s.weights[0], 1.0);
        assert!((s.weights[1] as f64 - (-2.0f64).exp()).abs() < 1e-7);
    }

    #[test]
    fn far_tokens_are_dropped_not_weighted() {
        let logits = [0.0, -200.0, f32::NEG_INFINITY, f32::NAN];
        assert_eq!(kept_both(&logits, SamplingParams::default()), vec![0]);
    }

    #[test]
    fn degenerate_rows_plan_nothing() {
        for row in [vec![f32::NEG_INFINITY; 3], vec![f32::NAN; 3]] {
            for top_k in [0, 2] {
                let mut s = sampler(SamplingParams {
                    top_k,
                    ..Default::default()
                });
                assert_eq!(s.plan(&row), Plan::Degenerate);
            }
        }
    }

    #[test]
    fn dense_draw_handles_every_u() {
        let weights = vec![0.0f32, 0.5, 0.0, 1.0, 0.25];
        let mut blocks = Vec::new();
        assert_eq!(draw_dense(&weights, 0.0, &mut blocks, 0.0), Some(1));
        assert_eq!(draw_dense(&weights, 0.0, &mut blocks, 0.99999), Some(4));
        assert_eq!(
            draw_dense(&weights, 0.0, &mut blocks, 1.0 - f64::EPSILON / 2.0),
            Some(4)
        );
        assert_eq!(draw_dense(&weights, 0.6, &mut blocks, 0.0), Some(3));
        assert_eq!(draw_dense(&weights, 0.6, &mut blocks, 0.99999), Some(3));
        assert_eq!(draw_dense(&[0.0; 3], 0.0, &mut blocks, 0.5), None);
        assert_eq!(draw_dense(&[], 0.0, &mut blocks, 0.5), None);
        // Across blocks.
        let mut big = vec![0.0f32; 5000];
        big[10] = 1.0;
        big[4000] = 1.0;
        assert_eq!(draw_dense(&big, 0.0, &mut blocks, 0.25), Some(10));
        assert_eq!(draw_dense(&big, 0.0, &mut blocks, 0.75), Some(4000));
    }

    #[test]
    fn scratch_buffers_are_reused() {
        for p in [
            SamplingParams {
                top_p: 0.9,
                ..Default::default()
            },
            SamplingParams {
                top_k: 50,
                top_p: 0.9,
                ..Default::default()
            },
        ] {
            let mut s = sampler(p);
            let logits: Vec<f32> = (0..10_000).map(|i| (i % 97) as f32 * 0.01).collect();
            s.sample(&mut logits.clone(), 10_000);
            let caps = |s: &Sampler| {
                [
                    s.vals.capacity(),
                    s.weights.capacity(),
                    s.blocks.capacity(),
                    s.cands.capacity(),
                    s.sel.capacity(),
                ]
            };
            let before = caps(&s);
            for _ in 0..5 {
                s.sample(&mut logits.clone(), 10_000);
            }
            assert_eq!(before, caps(&s));
        }
    }
}
