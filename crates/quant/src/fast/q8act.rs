//! int8-activation products: [`crate::reference::gemm_q8act`] bit for bit, at every level.
//!
//! The activations are quantized once ([`QAct`]: int8 codes per group of `group_size`, the
//! group's scale `sx` and its exact-order f32 sum `Σx`) and can then be reused by every matrix
//! that reads the same input (q|k|v|z|b|a, router, all experts' gate/up, ...).
//! [`gemm_q8act_batch`] runs several products in **one** parallel loop over row blocks of all
//! of them, so small matrices (one expert is 512 × 2048) still keep every thread busy.
//!
//! Kernels (AVX2, also used at the AVX-512 level):
//!
//! * **Decode, one token, 4-bit with groups of 64 or 128, or 8-bit** (`x86::qact_gemv_avx2`): per row, per
//!   group of 64 columns one 32-byte load; `v & 0xF` are the codes of the even columns and
//!   `(v >> 4) & 0xF` those of the odd columns, so with the int8 activations stored per 64
//!   columns as `[32 even | 32 odd]` the product is two `vpmaddubsw` (u8 × i8 → i16 pairs, at
//!   most `2·15·127 = 3810` per lane, no saturation), one `vpaddw`, one `vpmaddwd` by 1 (→ i32).
//!   Eight groups' i32 vectors are reduced together with a `vphaddd` tree into one vector
//!   `[I_g … I_g+7]`, and the f32 group terms `(s·sx)·I + b·Σx` are computed eight at a time
//!   (lanes = groups, scales and biases read contiguously), then added to the row's sum in
//!   ascending group order, as the reference does. 8-bit: codes widened to i16 per 16
//!   columns (`vpmovzxbw`), `vpmaddwd` with the i16 activations, then the same reduction.
//! * **Everything else** (several tokens; one token at 4 bits with groups of 32): tiles of 2 rows × 4 tokens
//!   (`x86::q4act_tile_avx2`, `x86::q8act_tile_avx2`). 4-bit: each 32-column unit (16 bytes)
//!   becomes one vector of 32 `u8` codes (low nibbles = even columns, high nibbles = odd
//!   columns; with groups of ≥ 64 the unit is 64 columns, one 32-byte load giving two vectors),
//!   `vpmaddubsw` with the int8 activations into i16 (≤ 4 units per group: no saturation), one
//!   `vpmaddwd` by 1 per group into i32. 8-bit: `u8 × i8` pairs can reach `2·255·127 > 2¹⁵`,
//!   so `vpmaddubsw` would saturate; codes are widened to i16 (`vpmovzxbw`), the activations
//!   are stored as i16, and `vpmaddwd` multiplies and pairs them into i32 directly. Per group
//!   the i32 lanes of 4 tokens are reduced with a `vphaddd` tree (exact), converted, and
//!   combined in the reference's f32 order over 4 tokens at once.
//!
//! Other levels run a plain loop with the reference's arithmetic on the [`QAct`] codes.

use super::{effective, Level, OutPtr, GEMM_ROW_BLOCK, PAR_MIN_ELEMS};
#[cfg(target_arch = "x86_64")]
use super::x86;
use crate::{validate, Bits, QMatRef, QuantSpec};
use rayon::prelude::*;

/// Tokens per int8 tile of the 2-row kernels (the `vphaddd` reduction handles exactly 4).
const Q8_TOK_BLOCK: usize = 4;

/// Tokens per call of the one-row 4-bit kernel (`x86::q4act_row8_avx2`); the per-group token
/// vectors are padded to a multiple of this.
const Q8_ROW_TOKENS: usize = 8;

/// Rows per parallel task of a one-token product (≈ 36 KiB of 4-bit weights at 2048 columns):
/// rayon splits ranges of these adaptively, so the count only bounds the granularity.
const GEMV_ROW_BLOCK: usize = 32;

/// Activations of at least this many values are quantized by several threads.
const PAR_QUANT_MIN: usize = 1 << 15;

/// Activations `[t, cols]` quantized to int8 per group ([`crate::quantize_act_q8`]), in the
/// layouts the kernels read; reusable by every matrix with the same `cols` and [`QuantSpec`].
///
/// * `xi`: the codes in column order, `[t, cols]` (portable kernels);
/// * 4-bit at x86 levels: per unit of 64 columns (32 when the group size is 32) the codes of
///   the even columns, then those of the odd columns (`xa`);
/// * 8-bit at x86 levels: the codes widened to i16, column order (`xw`);
/// * `sx`, `xs`: `[t, groups]` scale and `Σx` per group, and the same transposed to
///   `[groups, tp]` (`tp` = `t` rounded up to 4, zero padded) for the 4-token tiles.
///
/// Buffers are kept between [`QAct::quantize`] calls (no allocation once they are large
/// enough).
#[derive(Debug, Clone)]
pub struct QAct {
    t: usize,
    cols: usize,
    spec: Option<QuantSpec>,
    eff: Level,
    xi: Vec<i8>,
    xa: Vec<i8>,
    xw: Vec<i16>,
    sx: Vec<f32>,
    xs: Vec<f32>,
    sxt: Vec<f32>,
    xst: Vec<f32>,
    tp: usize,
}

impl Default for QAct {
    fn default() -> Self {
        QAct::new()
    }
}

impl QAct {
    /// An empty activation (no tokens); fill it with [`QAct::quantize`].
    pub fn new() -> QAct {
        QAct {
            t: 0,
            cols: 0,
            spec: None,
            eff: Level::Portable,
            xi: Vec::new(),
            xa: Vec::new(),
            xw: Vec::new(),
            sx: Vec::new(),
            xs: Vec::new(),
            sxt: Vec::new(),
            xst: Vec::new(),
            tp: 0,
        }
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.t
    }

    /// Values per token.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The spec of the matrices this activation was laid out for (`None` before the first
    /// [`QAct::quantize`]).
    pub fn spec(&self) -> Option<QuantSpec> {
        self.spec
    }

    /// Quantizes `x` (`[t, cols]`, row-major) for matrices of `spec`, at the best level.
    ///
    /// # Panics
    /// If `x.len() != t * cols`, `cols` is not a positive multiple of `spec.group_size`, or `x`
    /// holds a non-finite value.
    pub fn quantize(&mut self, x: &[f32], t: usize, cols: usize, spec: QuantSpec) {
        self.quantize_with(Level::best(), x, t, cols, spec)
    }

    /// [`QAct::quantize`] for the kernels of `level`.
    ///
    /// # Panics
    /// As [`QAct::quantize`]; also if `level` is not available.
    pub fn quantize_with(&mut self, level: Level, x: &[f32], t: usize, cols: usize, spec: QuantSpec) {
        spec.check_cols(cols)
            .unwrap_or_else(|e| panic!("QAct::quantize: {e}"));
        assert_eq!(x.len(), t * cols, "QAct::quantize: x length");
        let gs = spec.group_size;
        let gpr = cols / gs;
        let n_groups = t * gpr;
        self.t = t;
        self.cols = cols;
        self.spec = Some(spec);
        self.eff = effective(level, spec.bits, gs);
        resize(&mut self.xi, x.len());
        resize(&mut self.sx, n_groups);
        resize(&mut self.xs, n_groups);
        let eff = self.eff;
        // Tokens are independent: large activations are quantized in parallel, a block of
        // tokens per task.
        let quant = |x: &[f32], xi: &mut [i8], sx: &mut [f32], xs: &mut [f32]| match eff {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 is present (the level was checked); gs is 32, 64 or 128.
            Level::Avx2 | Level::Avx512 => unsafe { x86::quantize_act_q8_avx2(x, gs, xi, sx, xs) },
            _ => {
                let (a, b, c) = crate::quantize_act_q8(x, gs);
                xi.copy_from_slice(&a);
                sx.copy_from_slice(&b);
                xs.copy_from_slice(&c);
            }
        };
        if x.len() >= PAR_QUANT_MIN && rayon::current_num_threads() > 1 {
            let tok = PAR_QUANT_MIN.div_ceil(cols);
            x.par_chunks(tok * cols)
                .zip(self.xi.par_chunks_mut(tok * cols))
                .zip(self.sx.par_chunks_mut(tok * gpr))
                .zip(self.xs.par_chunks_mut(tok * gpr))
                .for_each(|(((x, xi), sx), xs)| quant(x, xi, sx, xs));
        } else {
            quant(x, &mut self.xi, &mut self.sx, &mut self.xs);
        }
        // Per-group token vectors: [g][tp], padded with zeros to whole tiles of 8 tokens.
        self.tp = t.div_ceil(Q8_ROW_TOKENS) * Q8_ROW_TOKENS;
        resize(&mut self.sxt, gpr * self.tp);
        resize(&mut self.xst, gpr * self.tp);
        self.sxt.fill(0.0);
        self.xst.fill(0.0);
        for tt in 0..t {
            for g in 0..gpr {
                self.sxt[g * self.tp + tt] = self.sx[tt * gpr + g];
                self.xst[g * self.tp + tt] = self.xs[tt * gpr + g];
            }
        }
        if !matches!(self.eff, Level::Avx2 | Level::Avx512) {
            return;
        }
        match spec.bits {
            Bits::B4 => {
                // The kernels' unit: 64 columns (one 32-byte load) when groups hold whole
                // units, else 32 (16 bytes); per unit the even columns, then the odd ones.
                let unit = if gs >= 64 { 64 } else { 32 };
                resize(&mut self.xa, x.len());
                for (src, dst) in self.xi.chunks_exact(unit).zip(self.xa.chunks_exact_mut(unit)) {
                    for j in 0..unit / 2 {
                        dst[j] = src[2 * j];
                        dst[unit / 2 + j] = src[2 * j + 1];
                    }
                }
            }
            Bits::B8 => {
                resize(&mut self.xw, x.len());
                for (d, &v) in self.xw.iter_mut().zip(&self.xi) {
                    *d = i16::from(v);
                }
            }
        }
    }

    /// Panics unless this activation fits `m` (same spec and columns, a kernel level).
    fn check(&self, m: &QMatRef<'_>, what: &str) {
        assert_eq!(self.spec, Some(m.spec), "{what}: activation quantized for another spec");
        assert_eq!(self.cols, m.cols, "{what}: activation has {} columns, matrix {}", self.cols, m.cols);
    }
}

fn resize<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
    v.clear();
    v.resize(n, T::default());
}

/// [`crate::reference::gemm_q8act`] (int8 activations, integer dot products per group) at the
/// best level; the result equals the reference **bit for bit** at every level.
///
/// # Panics
/// If `m` fails [`validate`], `x.len() != t * cols` or `out.len() != t * rows`; also if `x`
/// holds a non-finite value.
pub fn gemm_q8act(out: &mut [f32], m: QMatRef<'_>, x: &[f32], t: usize) {
    gemm_q8act_with(Level::best(), out, m, x, t)
}

/// [`gemm_q8act`] at an explicit level.
///
/// # Panics
/// As [`gemm_q8act`]; also if `level` is not available.
pub fn gemm_q8act_with(level: Level, out: &mut [f32], m: QMatRef<'_>, x: &[f32], t: usize) {
    validate(&m).unwrap_or_else(|e| panic!("fast::gemm_q8act: {e}"));
    assert_eq!(x.len(), t * m.cols, "fast::gemm_q8act: x length");
    assert_eq!(out.len(), t * m.rows, "fast::gemm_q8act: out length");
    if t == 0 || m.rows == 0 {
        return;
    }
    let mut qa = QAct::new();
    qa.quantize_with(level, x, t, m.cols, m.spec);
    gemm_q8act_prepared(out, m, &qa);
}

/// [`gemm_q8act`] on activations quantized beforehand (`out` is `[qa.tokens(), rows]`).
///
/// # Panics
/// If `m` fails [`validate`], `qa` was quantized for another spec or column count, or
/// `out.len() != tokens * rows`.
pub fn gemm_q8act_prepared(out: &mut [f32], m: QMatRef<'_>, qa: &QAct) {
    gemm_q8act_batch(&mut [Q8Job { m, x: qa, out }]);
}

/// One product of a [`gemm_q8act_batch`]: `out[t, rows] = x[t, cols] · mᵀ`.
pub struct Q8Job<'a> {
    /// The matrix `[rows, cols]`.
    pub m: QMatRef<'a>,
    /// The activations `[t, cols]`, quantized for `m.spec`.
    pub x: &'a QAct,
    /// `[t, rows]`, row-major.
    pub out: &'a mut [f32],
}

/// Rows per parallel task for a product over `t` tokens.
fn row_block(t: usize) -> usize {
    if t == 1 {
        GEMV_ROW_BLOCK
    } else {
        GEMM_ROW_BLOCK
    }
}

/// Runs every job as [`gemm_q8act_prepared`] would, with the row blocks of all jobs in one
/// parallel loop (one fork-join for the whole set). Each result equals the reference bit for
/// bit.
///
/// # Panics
/// As [`gemm_q8act_prepared`], for any job.
pub fn gemm_q8act_batch(jobs: &mut [Q8Job<'_>]) {
    let mut total = 0usize;
    let mut work = 0usize;
    // Prefix sums of row blocks: job j owns blocks starting[j] .. starting[j + 1].
    let mut starts = Vec::with_capacity(jobs.len() + 1);
    for j in jobs.iter() {
        validate(&j.m).unwrap_or_else(|e| panic!("fast::gemm_q8act: {e}"));
        j.x.check(&j.m, "fast::gemm_q8act");
        assert_eq!(j.out.len(), j.x.t * j.m.rows, "fast::gemm_q8act: out length");
        starts.push(total);
        if j.x.t > 0 {
            total += j.m.rows.div_ceil(row_block(j.x.t));
            work += j.m.rows * j.m.cols * j.x.t;
        }
    }
    starts.push(total);
    let tasks: Vec<(QMatRef<'_>, &QAct, OutPtr)> = jobs
        .iter_mut()
        .map(|j| (j.m, j.x, OutPtr(j.out.as_mut_ptr())))
        .collect();
    let run = |blk: usize| {
        // The job owning block `blk`: the last start ≤ blk (empty jobs own no block).
        let j = starts.partition_point(|&s| s <= blk) - 1;
        let (m, qa, optr) = &tasks[j];
        let rb = row_block(qa.t);
        let r0 = (blk - starts[j]) * rb;
        let r1 = (r0 + rb).min(m.rows);
        // SAFETY: block `blk` writes rows [r0, r1) of job j's output only; `qa` fits `m`.
        unsafe { q8act_rows(m, qa, r0, r1, *optr) };
    };
    if work >= PAR_MIN_ELEMS / 4 && total > 1 && rayon::current_num_threads() > 1 {
        (0..total).into_par_iter().for_each(run);
    } else {
        (0..total).for_each(run);
    }
}

/// `out[tt·rows + r] = Σ_c W[r, c]·x[tt, c]` (the reference's int8 arithmetic) for rows
/// `r0 .. r1` and every token of `qa`.
///
/// # Safety
/// `optr` points at a `[t, rows]` buffer whose rows `r0..r1` nobody else touches meanwhile;
/// `qa` fits `m` ([`QAct::check`]).
unsafe fn q8act_rows(m: &QMatRef<'_>, qa: &QAct, r0: usize, r1: usize, optr: OutPtr) {
    match qa.eff {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => q8act_rows_avx2(m, qa, r0, r1, optr),
        _ => q8act_rows_portable(m, qa, r0, r1, optr),
    }
}

/// Plain loops, the reference's arithmetic and order on the codes of `qa`.
unsafe fn q8act_rows_portable(m: &QMatRef<'_>, qa: &QAct, r0: usize, r1: usize, optr: OutPtr) {
    let (rows, cols) = (m.rows, m.cols);
    let gs = m.spec.group_size;
    let gpr = cols / gs;
    let wpr = m.spec.words_per_row(cols);
    let mut codes = vec![0u8; cols];
    for r in r0..r1 {
        crate::unpack_codes(&m.packed[r * wpr..(r + 1) * wpr], m.spec.bits, &mut codes);
        let (scales, biases) = (&m.scales[r * gpr..(r + 1) * gpr], &m.biases[r * gpr..(r + 1) * gpr]);
        for tt in 0..qa.t {
            let g = tt * gpr..(tt + 1) * gpr;
            let xi = &qa.xi[tt * cols..(tt + 1) * cols];
            *optr.0.add(tt * rows + r) = crate::reference::q8act_row(&codes, scales, biases, xi, &qa.sx[g.clone()], &qa.xs[g], gs);
        }
    }
}

#[cfg(target_arch = "x86_64")]
unsafe fn q8act_rows_avx2(m: &QMatRef<'_>, qa: &QAct, r0: usize, r1: usize, optr: OutPtr) {
    let (rows, cols, gs) = (m.rows, m.cols, m.spec.group_size);
    let t = qa.t;
    let four = m.spec.bits == Bits::B4;
    if t == 1 && (gs >= 64 || !four) {
        let out = optr.0.add(r0);
        let (sx, xs) = (qa.sx.as_ptr(), qa.xs.as_ptr());
        let (x4, x8) = (qa.xa.as_ptr() as *const u8, qa.xw.as_ptr() as *const u8);
        return match (four, gs) {
            (true, 64) => x86::qact_gemv_avx2::<false, 1>(m, r0, r1, x4, sx, xs, out),
            (true, _) => x86::qact_gemv_avx2::<false, 2>(m, r0, r1, x4, sx, xs, out),
            (false, 32) => x86::qact_gemv_avx2::<true, 2>(m, r0, r1, x8, sx, xs, out),
            (false, 64) => x86::qact_gemv_avx2::<true, 4>(m, r0, r1, x8, sx, xs, out),
            (false, _) => x86::qact_gemv_avx2::<true, 8>(m, r0, r1, x8, sx, xs, out),
        };
    }
    let tp = qa.tp;
    if four && gs >= 64 {
        let mut t0 = 0;
        while t0 < t {
            let tb = (t - t0).min(Q8_ROW_TOKENS);
            let o = |j: usize| optr.0.add((t0 + j) * rows);
            let x = qa.xa[t0 * cols..].as_ptr();
            let st = qa.sxt[t0..].as_ptr();
            let bt = qa.xst[t0..].as_ptr();
            for r in r0..r1 {
                macro_rules! row {
                    ($($j:literal),+) => {
                        if gs == 64 {
                            x86::q4act_row8_avx2::<1, { [$($j),+].len() }>(m, r, x, st, bt, tp, [$(o($j)),+])
                        } else {
                            x86::q4act_row8_avx2::<2, { [$($j),+].len() }>(m, r, x, st, bt, tp, [$(o($j)),+])
                        }
                    };
                }
                match tb {
                    8 => row!(0, 1, 2, 3, 4, 5, 6, 7),
                    7 => row!(0, 1, 2, 3, 4, 5, 6),
                    6 => row!(0, 1, 2, 3, 4, 5),
                    5 => row!(0, 1, 2, 3, 4),
                    4 => row!(0, 1, 2, 3),
                    3 => row!(0, 1, 2),
                    2 => row!(0, 1),
                    _ => row!(0),
                }
            }
            t0 += tb;
        }
        return;
    }
    let mut t0 = 0;
    while t0 < t {
        let tb = (t - t0).min(Q8_TOK_BLOCK);
        let o = |j: usize| optr.0.add((t0 + j) * rows);
        let x4 = |j: usize| {
            if four {
                qa.xa[(t0 + j) * cols..].as_ptr() as *const u8
            } else {
                std::ptr::null()
            }
        };
        let x8 = |j: usize| {
            if four {
                std::ptr::null()
            } else {
                qa.xw[(t0 + j) * cols..].as_ptr()
            }
        };
        let st = qa.sxt[t0..].as_ptr();
        let bt = qa.xst[t0..].as_ptr();
        let mut r = r0;
        while r < r1 {
            let rb = (r1 - r).min(2);
            macro_rules! tile {
                ($r:literal, $($j:literal),+) => {
                    if four {
                        x86::q4act_tile_avx2::<$r, { [$($j),+].len() }>(m, r, [$(x4($j)),+], st, bt, tp, [$(o($j)),+])
                    } else {
                        x86::q8act_tile_avx2::<$r, { [$($j),+].len() }>(m, r, [$(x8($j)),+], st, bt, tp, [$(o($j)),+])
                    }
                };
            }
            tile_shapes!(rb, tb, tile);
            r += rb;
        }
        t0 += tb;
    }
}
