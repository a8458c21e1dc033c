//! Host emulation of `kernels/sample.cu` (tests only): the same phases, decompositions and
//! arithmetic as the four launches, with the sums the kernels compute in parallel (integer
//! significand sums, unordered lists) done here in another order than the CPU sampler's, and
//! the exactness claims of the kernel's header asserted against f64 sums in the CPU's order. The
//! tests compare it with `sampler::Sampler`, token for token, which checks the kernels' design
//! against the CPU semantics; the self-test (`cuda_selftest --only sample`) checks the kernels.

// Index loops mirror the kernels' loops; `!(a <= b)` is the CPU's NaN-aware test, kept as is.
#![allow(clippy::needless_range_loop, clippy::neg_cmp_op_on_partial_ord)]

use sampler::SamplingParams;

use super::{chacha_key, chacha_u64};

const NEG_INF: f32 = f32::NEG_INFINITY;
const NONE: usize = usize::MAX;
const KEY_SHIFT: u32 = 20;
const KEY_BINS: usize = 1 << (32 - KEY_SHIFT);
const TOP_SHIFT: u32 = 22;
const TOP_BINS: usize = 512;
const LOW_BITS: u32 = 11;
const LOW_BINS: usize = 1 << LOW_BITS;
const DRAW_BLOCK: usize = 1024;
const NUCLEUS_SORT_LEN: usize = 64;
const TOP_P_SLACK: f64 = 1e-6;

fn clean(x: f32) -> f32 {
    if x.is_nan() {
        NEG_INF
    } else {
        x.min(f32::MAX)
    }
}

fn okey(x: f32) -> u32 {
    let b = x.to_bits();
    b ^ if b & 0x8000_0000 != 0 { 0xffff_ffff } else { 0x8000_0000 }
}

fn okey_inv(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 { k ^ 0x8000_0000 } else { !k })
}

/// `exp_neg` of kernels/sample.cu (and of sampler::math), from the constants' bit patterns.
fn exp_neg(z: f32) -> f32 {
    let c = f32::from_bits;
    let (log2e, ln2_hi, ln2_lo) = (c(0x3fb8aa3b), c(0x3f318000), c(0xb95e8083));
    let p = [c(0x39506967), c(0x3ab743ce), c(0x3c088908), c(0x3d2aa9c1), c(0x3e2aaaaa), c(0x3f000000)];
    let round = c(0x4b400000);
    let zc = if z > -87.0 { z } else { -87.0 };
    let zc = if zc < 0.0 { zc } else { 0.0 };
    let t = zc * log2e + round;
    let nf = t - round;
    let n = (t.to_bits() as i32).wrapping_sub(round.to_bits() as i32);
    let r = zc - nf * ln2_hi - nf * ln2_lo;
    let mut poly = p[0] * r + p[1];
    for &q in &p[2..] {
        poly = poly * r + q;
    }
    let y = poly * (r * r) + r + 1.0;
    let e = y * f32::from_bits((n.wrapping_add(127) as u32) << 23);
    if z > -87.0 {
        e
    } else {
        0.0
    }
}

fn scale_apply(t: f32, d: f32) -> f32 {
    let inv = 1.0 / t;
    if inv.is_finite() {
        d * inv
    } else {
        d / t
    }
}

fn sig_of(bits: u32) -> u64 {
    let (e, m) = (bits >> 23, bits & 0x7f_ffff);
    u64::from(if e != 0 { m | 0x80_0000 } else { m })
}

fn exp_of(bits: u32) -> i32 {
    let e = (bits >> 23) as i32;
    (if e != 0 { e } else { 1 }) - 150
}

fn lowbit_exp(w: f32) -> i32 {
    exp_of(w.to_bits()) + sig_of(w.to_bits()).trailing_zeros() as i32
}

fn units_of(w: f32, emin: i32) -> u64 {
    let sh = exp_of(w.to_bits()) - emin;
    let s = sig_of(w.to_bits());
    if sh >= 0 {
        s << sh
    } else {
        s >> (-sh)
    }
}

fn exp2i(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

fn rank_key(xk: u32, idx: u32) -> u64 {
    (u64::from(!xk) << 32) | u64::from(idx)
}

/// `crossing` of the kernel over integer sums `h` scaled by `scale`.
fn crossing(h: &[u64], target: f64, above: f64, scale: impl Fn(usize) -> f64) -> Option<(usize, f64)> {
    let mut acc = above;
    let mut last = None;
    for b in (0..h.len()).rev() {
        if h[b] == 0 {
            continue;
        }
        let m = h[b] as f64 * scale(b);
        if acc + m >= target {
            return Some((b, acc));
        }
        last = Some((b, acc));
        acc += m;
    }
    last
}

/// The device sampler's state and step, on the host.
pub(super) struct Emu {
    p: SamplingParams,
    key: [u32; 8],
    pub(super) calls: u64,
    pub(super) counts: Vec<u32>,
}

impl Emu {
    pub(super) fn new(p: SamplingParams, rows: usize) -> Emu {
        let key = chacha_key(p.seed.expect("tests give a seed"));
        Emu { p, key, calls: 0, counts: vec![0; rows] }
    }

    /// One `sample_step` past the prompt: the token, after which the counts are updated.
    pub(super) fn step(&mut self, logits: &mut [f32], n: usize) -> u32 {
        let t = self.pick(logits, n);
        let c = &mut self.counts[t as usize];
        *c = c.saturating_add(1);
        t
    }

    fn pick(&mut self, logits: &mut [f32], n: usize) -> u32 {
        let p = self.p.clone();
        // ---- sample_prep
        let greedy = p.temperature == 0.0;
        let k = u32::try_from(p.top_k).unwrap_or(u32::MAX) as usize;
        let sparse = !greedy && n > 0 && k > 0 && k < n;
        let pen = p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        let (mut bv, mut bi) = (NEG_INF, NONE);
        for i in 0..logits.len() {
            if i >= n {
                logits[i] = NEG_INF;
                continue;
            }
            let mut x = logits[i];
            let c = self.counts[i];
            if pen && c != 0 {
                if p.repetition_penalty != 1.0 {
                    x = if x > 0.0 { x / p.repetition_penalty } else { x * p.repetition_penalty };
                }
                if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
                    x -= c as f32 * p.frequency_penalty + p.presence_penalty;
                }
                logits[i] = x;
            }
            if x > bv || (x == bv && bi == NONE) {
                bv = x;
                bi = i;
            }
        }
        let tok = if bi == NONE { 0 } else { bi as u32 };
        if n == 0 {
            return 0;
        }
        if greedy {
            return tok;
        }
        let u = unit_f64(chacha_u64(&self.key, self.calls));
        self.calls += 1;
        let maxc = bv.min(f32::MAX);
        if maxc == NEG_INF {
            return tok;
        }
        // ---- sample_weights: the weights
        let w: Vec<f32> = logits[..n]
            .iter()
            .map(|&x| exp_neg(scale_apply(p.temperature, clean(x) - maxc)))
            .collect();
        let drawn = if sparse {
            sparse_pick(&p, &logits[..n], &w, k, u)
        } else {
            dense_pick(&p, &logits[..n], w, u)
        };
        drawn.unwrap_or(tok)
    }
}

/// SPARSE: prep's key histogram, weights' exact `thr`, select's candidates and finisher.
fn sparse_pick(p: &SamplingParams, logits: &[f32], w: &[f32], k: usize, u: f64) -> Option<u32> {
    let n = logits.len();
    let mut hist = vec![0u32; KEY_BINS];
    for &x in logits {
        hist[(okey(clean(x)) >> KEY_SHIFT) as usize] += 1;
    }
    let (mut b1, mut need, mut acc) = (usize::MAX, 0u32, 0u32);
    for b in (0..KEY_BINS).rev() {
        if acc + hist[b] >= k as u32 {
            b1 = b;
            need = k as u32 - acc;
            break;
        }
        acc += hist[b];
    }
    assert!(b1 != usize::MAX);
    // the bucket's keys, in an order unrelated to ids; the need-th largest
    let mut keys: Vec<u32> = (0..n)
        .rev()
        .map(|i| okey(clean(logits[i])))
        .filter(|&key| (key >> KEY_SHIFT) as usize == b1)
        .collect();
    keys.sort_unstable_by(|a, b| b.cmp(a));
    let kthr = keys[need as usize - 1];
    let thr = okey_inv(kthr);
    // candidates in id order
    let cands: Vec<u32> = (0..n as u32).filter(|&i| clean(logits[i as usize]) >= thr && w[i as usize] > 0.0).collect();
    let c = cands.len();
    assert!(c > 0);
    let xk = |j: usize| okey(clean(logits[cands[j] as usize]));
    let wj = |j: usize| w[cands[j] as usize];
    let mut key_a = Vec::new();
    let (mut n_t, mut n_b, mut wt, mut emin) = (0usize, 0usize, 0.0f32, i32::MAX);
    for j in (0..c).rev() {
        emin = emin.min(lowbit_exp(wj(j)));
        if xk(j) > kthr {
            key_a.push(rank_key(xk(j), cands[j]));
        } else {
            if xk(j) == kthr {
                n_t += 1;
            } else {
                n_b += 1;
            }
            wt = wj(j);
        }
    }
    assert!(key_a.len() < k, "at most k - 1 candidates above thr");
    let n_a = key_a.len();
    let n_tb = n_t + n_b;
    let exact = (usize::BITS - c.leading_zeros()) as i32 - emin <= 53;
    let g = if exact { exp2i(emin) } else { 0.0 };
    key_a.sort_unstable();
    let w_a: Vec<f32> = key_a.iter().map(|&kk| w[kk as u32 as usize]).collect();
    let wr = |p: usize| if p < n_a { w_a[p] } else { wt };
    if exact {
        // the claim: every sum is exact, so these agree with the CPU's id-order f64 sum
        let seq = (0..c).fold(0.0f64, |a, j| a + wj(j) as f64);
        let par = (0..c).rev().map(|j| units_of(wj(j), emin)).sum::<u64>() as f64 * g;
        assert_eq!(seq.to_bits(), par.to_bits(), "exact candidate sums");
    }
    // the m-th (0-based, id order) candidate whose key passes `pred`
    let find_mth = |m: usize, pred: &dyn Fn(u32) -> bool| -> u32 {
        cands[(0..c).filter(|&j| pred(xk(j))).nth(m).expect("m-th exists")]
    };
    let mut cut = None;
    if p.top_p < 1.0 && c > 1 {
        let total = if exact {
            (0..c).rev().map(|j| units_of(wj(j), emin)).sum::<u64>() as f64 * g
        } else {
            (0..c).fold(0.0f64, |a, j| a + wj(j) as f64)
        };
        let target = (p.top_p as f64 - TOP_P_SLACK) * total;
        let mut l = c;
        if c <= NUCLEUS_SORT_LEN {
            let mut acc = 0.0f64;
            for q in 0..c {
                acc += wr(q) as f64;
                if acc >= target {
                    l = q + 1;
                    break;
                }
            }
        } else if exact {
            let mut pre = 0u64;
            let mut found = false;
            for q in 0..n_a {
                pre += units_of(w_a[q], emin);
                if pre as f64 * g >= target {
                    l = q + 1;
                    found = true;
                    break;
                }
            }
            if !found && n_tb > 0 {
                let ut = units_of(wt, emin) as u128;
                let ok = |m: u128| (pre as u128 + m * ut) as f64 * g >= target;
                let est = (target / g - pre as f64) / ut as f64;
                let mut m: u128 = if est >= 1.0 {
                    if est > n_tb as f64 {
                        n_tb as u128
                    } else {
                        est.ceil() as u128
                    }
                } else {
                    1
                };
                while m > 1 && ok(m - 1) {
                    m -= 1;
                }
                while m <= n_tb as u128 && !ok(m) {
                    m += 1;
                }
                if m <= n_tb as u128 {
                    l = n_a + m as usize;
                }
            }
        } else {
            let (mut lo, mut hi, mut acc) = (0usize, c, 0.0f64);
            while hi - lo > NUCLEUS_SORT_LEN {
                let mid = lo + (hi - lo) / 2;
                let upper = (lo..mid).fold(0.0f64, |a, q| a + wr(q) as f64);
                if acc + upper >= target {
                    hi = mid;
                } else {
                    acc += upper;
                    lo = mid;
                }
            }
            l = hi;
            for q in lo..hi {
                acc += wr(q) as f64;
                if acc >= target {
                    l = q + 1;
                    break;
                }
            }
        }
        if l < c {
            let q = l - 1;
            cut = Some(if q < n_a {
                key_a[q]
            } else if q - n_a < n_t {
                rank_key(kthr, find_mth(q - n_a, &|x| x == kthr))
            } else {
                let id = find_mth(q - n_a - n_t, &|x| x < kthr);
                rank_key(okey(clean(logits[id as usize])), id)
            });
        }
    }
    let kept = |j: usize| {
        cut.is_none_or(|cut| rank_key(xk(j), cands[j]) <= cut) && (!(p.min_p > 0.0) || wj(j) >= p.min_p)
    };
    if exact {
        let total_u: u64 = (0..c).rev().filter(|&j| kept(j)).map(|j| units_of(wj(j), emin)).sum();
        if total_u == 0 {
            return None;
        }
        let r = u * (total_u as f64 * g);
        let mut run = 0u64;
        let mut last = None;
        for j in 0..c {
            if kept(j) {
                run += units_of(wj(j), emin);
                last = Some(j);
                if r < run as f64 * g {
                    return Some(cands[j]);
                }
            }
        }
        last.map(|j| cands[j])
    } else {
        let total = (0..c).filter(|&j| kept(j)).fold(0.0f64, |a, j| a + wj(j) as f64);
        let r = u * total;
        let mut acc = 0.0f64;
        let mut tok = None;
        for j in (0..c).filter(|&j| kept(j)) {
            acc += wj(j) as f64;
            tok = Some(cands[j]);
            if r < acc {
                break;
            }
        }
        tok
    }
}

/// DENSE: weights' top-p level, select's refinement and tie cut, draw's block sums and walk.
fn dense_pick(p: &SamplingParams, logits: &[f32], mut w: Vec<f32>, u: f64) -> Option<u32> {
    let n = logits.len();
    let mut w_min = 0.0f32;
    if p.top_p < 1.0 {
        let mut h = vec![0u64; TOP_BINS];
        for i in (0..n).rev() {
            if w[i] > 0.0 {
                h[(w[i].to_bits() >> TOP_SHIFT) as usize] += sig_of(w[i].to_bits());
            }
        }
        let bscale = |b: usize| {
            let e = (b >> 1) as i32;
            exp2i(if e != 0 { e } else { 1 } - 150)
        };
        // the claim: integer bucket sums equal the CPU's four interleaved f64 histograms
        let mut hist = vec![[0.0f64; TOP_BINS]; 4];
        let chunks = w.chunks_exact(4);
        let rest = chunks.remainder();
        for ch in chunks {
            for (hh, &x) in hist.iter_mut().zip(ch) {
                hh[(x.to_bits() >> TOP_SHIFT) as usize & (TOP_BINS - 1)] += x as f64;
            }
        }
        for &x in rest {
            hist[0][(x.to_bits() >> TOP_SHIFT) as usize & (TOP_BINS - 1)] += x as f64;
        }
        for b in 0..TOP_BINS {
            let cpu = ((hist[0][b] + hist[1][b]) + hist[2][b]) + hist[3][b];
            assert_eq!(cpu.to_bits(), (h[b] as f64 * bscale(b)).to_bits(), "bucket {b}");
        }
        let total = (0..TOP_BINS).rev().filter(|&b| h[b] != 0).fold(0.0f64, |a, b| a + h[b] as f64 * bscale(b));
        let target = (p.top_p as f64 - TOP_P_SLACK) * total;
        if let Some((b1, mut above)) = crossing(&h, target, 0.0, bscale) {
            let list: Vec<usize> = (0..n).rev().filter(|&i| w[i] > 0.0 && (w[i].to_bits() >> TOP_SHIFT) as usize == b1).collect();
            let s = bscale(b1);
            let (mut prefix, mut mask) = (0u32, 0u32);
            for shift in [LOW_BITS, 0] {
                let mut hl = vec![0u64; LOW_BINS];
                for &i in &list {
                    let bits = w[i].to_bits();
                    if bits & mask == prefix {
                        hl[((bits >> shift) as usize) & (LOW_BINS - 1)] += sig_of(bits);
                    }
                }
                let (b, a) = crossing(&hl, target, above, |_| s).expect("bucket not empty");
                prefix |= (b as u32) << shift;
                mask |= ((LOW_BINS - 1) as u32) << shift;
                above = a;
            }
            let wbits = ((b1 as u32) << TOP_SHIFT) | prefix;
            let wstar = f32::from_bits(wbits);
            let ties: Vec<usize> = list.iter().copied().filter(|&i| w[i].to_bits() == wbits).collect();
            let c = ties.len() as u64;
            let t2 = target - above;
            let wd = wstar as f64;
            let prod = |j: u64| j as f64 * wd;
            let mut j = 1u64;
            if !(t2 <= wd) {
                let est = t2 / wd;
                j = if est >= c as f64 { c } else { est.ceil() as u64 }.max(1);
            }
            while j > 1 && prod(j - 1) >= t2 {
                j -= 1;
            }
            while j < c && prod(j) < t2 {
                j += 1;
            }
            let l = j as usize;
            if l < ties.len() {
                let xk = |i: usize| okey(clean(logits[i]));
                let mut ks: Vec<u32> = ties.iter().map(|&i| xk(i)).collect();
                ks.sort_unstable_by(|a, b| b.cmp(a));
                let kx = ks[l - 1];
                let na = ties.iter().filter(|&&i| xk(i) > kx).count();
                let mut ids: Vec<usize> = ties.iter().copied().filter(|&i| xk(i) == kx).collect();
                ids.sort_unstable();
                let id_cut = ids[l - na - 1];
                for &i in &ties {
                    if xk(i) < kx || (xk(i) == kx && i > id_cut) {
                        w[i] = 0.0;
                    }
                }
            }
            w_min = wstar;
        }
    }
    if p.min_p > 0.0 {
        w_min = w_min.max(p.min_p);
    }
    // sample_draw
    let eff = |x: f32| if x >= w_min { x } else { 0.0 };
    let ndb = n.div_ceil(DRAW_BLOCK);
    let bsum: Vec<f64> = (0..ndb)
        .map(|db| {
            let start = db * DRAW_BLOCK;
            let len = DRAW_BLOCK.min(n - start);
            let nfull = len / 8;
            let mut s = 0.0f64;
            for lane in 0..8 {
                let mut acc = 0.0f64;
                for c in 0..nfull {
                    acc += eff(w[start + 8 * c + lane]) as f64;
                }
                s += acc;
            }
            for t in start + 8 * nfull..start + len {
                s += eff(w[t]) as f64;
            }
            s
        })
        .collect();
    // the kernel: one sequential total keeping each running sum, then the crossing block found
    // from the stored running sums (asserted against the CPU's second walk)
    let mut pre = Vec::with_capacity(ndb);
    let mut total = 0.0f64;
    for &s in &bsum {
        total += s;
        pre.push(total);
    }
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let r = u * total;
    let found = (0..ndb).find(|&b| bsum[b] > 0.0 && r < pre[b]);
    let mut walk = 0.0f64;
    let cpu = bsum.iter().position(|&s| {
        let hit = s > 0.0 && r < walk + s;
        if !hit {
            walk += s;
        }
        hit
    });
    assert_eq!(found, cpu, "crossing block from the running sums");
    if let Some(b) = found {
        let mut acc = if b > 0 { pre[b - 1] } else { 0.0 };
        assert_eq!(acc.to_bits(), walk.to_bits(), "sum before the crossing block");
        let st = b * DRAW_BLOCK;
        let mut last = None;
        for j in 0..DRAW_BLOCK.min(n - st) {
            let x = eff(w[st + j]);
            if x > 0.0 {
                acc += x as f64;
                last = Some(j);
                if r < acc {
                    break;
                }
            }
        }
        return last.map(|j| (st + j) as u32);
    }
    (0..n).rev().find(|&i| eff(w[i]) > 0.0).map(|i| i as u32)
}
