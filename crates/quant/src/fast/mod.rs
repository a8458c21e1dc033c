//! Fast kernels: SIMD with runtime CPU-feature detection, rayon over output rows.
//!
//! Same signatures and results (up to f32 reassociation) as [`crate::reference`].
//!
//! ## gemv (decode, batch 1): memory-bandwidth bound
//!
//! Each packed word is read once and unpacked in registers with shifts and masks. Per group:
//! `Σ_c (s·q_c + b)·x_c = s·Σ_c q_c·x_c + b·Σ_c x_c`; the `Σ x` per group is computed once per
//! call (shared by all rows), so the inner loop is one convert and one FMA per value.
//!
//! * 4-bit, AVX2: each word is broadcast to 8 lanes and shifted by `4·lane` (`vpsrlvd`),
//!   masked, converted: column order, one word per 8 values.
//! * 4-bit, AVX-512: a 32-byte row segment is read as sixteen 16-bit lanes; `(v >> 4k) & 0xF`
//!   puts one code per lane, and `vcvtph2ps` turns the lane into the f32 `q·2⁻²⁴` (a code below
//!   1024 read as an IEEE half is a subnormal, converted exactly), so unpacking needs no
//!   widening shuffles; the group scale carries the `2²⁴`. The lanes come out in the order
//!   `4i + k`, so `x` is permuted once per call to match.
//! * 8-bit on x86: `vpmovzxbd` + `vcvtdq2ps`, natural order.
//! * NEON: bytes are split into low/high nibbles, re-interleaved with `zip`, widened.
//! * Portable: per group, pass `k` extracts code `k` of every word (one shift amount per
//!   pass, so it vectorizes on any SIMD ISA); `x` is permuted to match.
//!
//! ## gemm (prefill): weight reuse across tokens
//!
//! * AVX2 (and AVX-512 below [`GEMM_SCRATCH_MIN_TOKENS`] tokens): tiles of 2 rows × 4 tokens;
//!   each 8-column unit of a row is unpacked and scaled once per tile and FMA'd into 4 tokens,
//!   each loaded `x` vector serves 2 rows.
//! * Otherwise: a block of 16 rows is dequantized once into an f32 scratch (`s·q + b`, in the
//!   same column order as `x`), then a 2 rows × 4 tokens micro-kernel runs over it for every
//!   token of the call.
//!
//! ## Choosing the level
//!
//! [`Level::best`] picks the widest available instruction set; the environment variable
//! `CALLA_QUANT_LEVEL=portable|avx2|avx512|neon` overrides it (ignored if unavailable). The
//! `*_with` functions take an explicit level (tests run every available level).
//!
//! Threads: matrices of at least [`PAR_MIN_ELEMS`] elements split their rows over the rayon
//! pool; smaller ones run on the calling thread.

use crate::{validate, Bits, QMatRef};
use rayon::prelude::*;
use std::sync::OnceLock;

/// Calls `$tile!(R, 0, .., T-1)` for the register tile of `rb` rows (1 or 2) and `tb` tokens
/// (1 to 4) the caller's blocked loops reached: the one shape table of the quantized GEMM tiles
/// (`$tile` expands to the const-generic tile kernel with the token indices it needs).
macro_rules! tile_shapes {
    ($rb:expr, $tb:expr, $tile:ident) => {
        match ($rb, $tb) {
            (2, 4) => $tile!(2, 0, 1, 2, 3),
            (2, 3) => $tile!(2, 0, 1, 2),
            (2, 2) => $tile!(2, 0, 1),
            (2, _) => $tile!(2, 0),
            (_, 4) => $tile!(1, 0, 1, 2, 3),
            (_, 3) => $tile!(1, 0, 1, 2),
            (_, 2) => $tile!(1, 0, 1),
            _ => $tile!(1, 0),
        }
    };
}

#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Matrices with at least this many elements (`rows * cols`) are split over rayon threads.
pub const PAR_MIN_ELEMS: usize = 1 << 18;

/// An instruction-set level for the fast kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// Plain Rust, any CPU (auto-vectorized by the compiler for the build target).
    Portable,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// x86_64 AVX-512F (+ AVX2, FMA, F16C). 4-bit with group size 32 runs the AVX2 kernel.
    Avx512,
    /// aarch64 NEON (Advanced SIMD, always present on aarch64).
    Neon,
}

impl Level {
    /// Every level, best last.
    pub const ALL: [Level; 4] = [Level::Portable, Level::Neon, Level::Avx2, Level::Avx512];

    /// Lower-case name (`portable`, `avx2`, `avx512`, `neon`), as accepted by
    /// `CALLA_QUANT_LEVEL`.
    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Neon => "neon",
        }
    }

    /// Whether this CPU (and this build) can run the level.
    pub fn is_available(self) -> bool {
        match self {
            Level::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => {
                std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(all(target_arch = "x86_64", quant_avx512))]
            Level::Avx512 => Level::Avx2.is_available() && std::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "aarch64")]
            Level::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// All levels available here, in [`Level::ALL`] order.
    pub fn available() -> Vec<Level> {
        Level::ALL
            .into_iter()
            .filter(|l| l.is_available())
            .collect()
    }

    /// The level the plain [`gemv`] / [`gemm`] use: `CALLA_QUANT_LEVEL` if set and available,
    /// else the best available. Decided once per process.
    pub fn best() -> Level {
        static BEST: OnceLock<Level> = OnceLock::new();
        *BEST.get_or_init(|| {
            if let Ok(name) = std::env::var("CALLA_QUANT_LEVEL") {
                if let Some(l) = Level::ALL.into_iter().find(|l| l.name() == name.trim()) {
                    if l.is_available() {
                        return l;
                    }
                }
            }
            *Level::available().last().unwrap_or(&Level::Portable)
        })
    }
}

/// The kernel family actually run for a level and matrix (AVX-512 hands 4-bit/group-32 to
/// AVX2, whose 32-value unit is one such group).
fn effective(level: Level, bits: Bits, group_size: usize) -> Level {
    assert!(
        level.is_available(),
        "fast: level {} is not available on this CPU/build",
        level.name()
    );
    match (level, bits) {
        (Level::Avx512, Bits::B4) if group_size < 64 => Level::Avx2,
        _ => level,
    }
}

/// Lanes per converted vector of the 4-bit x86 kernels; the permuted position of column
/// `4i + k` inside a unit of `4L` columns is `L·k + i`.
fn q4_lanes(eff: Level) -> Option<usize> {
    match eff {
        Level::Avx512 => Some(16),
        _ => None,
    }
}

/// Writes `x` (one token, `cols` values) in the order the kernels of `eff` produce weights.
///
/// * Portable: per group, code `k` of every word first: position `k·wpg + j` holds column
///   `per·j + k` (`per` codes per word, `wpg` words per group), so unpacking uses one shift
///   amount per pass and vectorizes on any SIMD ISA.
/// * AVX-512 4-bit: see [`q4_lanes`]. Everything else: column order.
fn permute_x(eff: Level, bits: Bits, group_size: usize, x: &[f32], out: &mut [f32]) {
    match (eff, bits, q4_lanes(eff)) {
        (Level::Portable, _, _) => {
            let per = bits.per_word();
            let wpg = group_size / per;
            for (xs, os) in x
                .chunks_exact(group_size)
                .zip(out.chunks_exact_mut(group_size))
            {
                for k in 0..per {
                    for j in 0..wpg {
                        os[k * wpg + j] = xs[per * j + k];
                    }
                }
            }
        }
        (_, Bits::B4, Some(l)) => {
            let unit = 4 * l;
            for (xs, os) in x.chunks_exact(unit).zip(out.chunks_exact_mut(unit)) {
                for k in 0..4 {
                    for i in 0..l {
                        os[l * k + i] = xs[4 * i + k];
                    }
                }
            }
        }
        _ => out.copy_from_slice(x),
    }
}

/// Activation prepared for one gemv: permuted copy and per-group sums.
struct PreparedX {
    xp: Vec<f32>,
    xsum: Vec<f32>,
}

fn prepare_x(eff: Level, m: &QMatRef<'_>, x: &[f32]) -> PreparedX {
    let mut xp = vec![0f32; x.len()];
    permute_x(eff, m.spec.bits, m.spec.group_size, x, &mut xp);
    let xsum = x
        .chunks_exact(m.spec.group_size)
        .map(|g| g.iter().sum())
        .collect();
    PreparedX { xp, xsum }
}

/// Rows per parallel task: enough tasks to balance, each big enough to amortize scheduling.
fn chunk_rows(rows: usize, cols: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_balance = rows.div_ceil(threads * 8);
    let by_size = (1usize << 15).div_ceil(cols);
    by_balance.max(by_size).max(1)
}

/// Computes `out[i] = row (r0 + i) · x` for the rows of one task.
fn gemv_rows(eff: Level, m: &QMatRef<'_>, r0: usize, out: &mut [f32], px: &PreparedX) {
    match eff {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::gemv_rows_avx2(m, r0, out, &px.xp, &px.xsum) },
        #[cfg(all(target_arch = "x86_64", quant_avx512))]
        Level::Avx512 => unsafe { x86::gemv_rows_avx512(m, r0, out, &px.xp, &px.xsum) },
        #[cfg(target_arch = "aarch64")]
        Level::Neon => unsafe { neon::gemv_rows(m, r0, out, &px.xp, &px.xsum) },
        _ => portable::gemv_rows(m, r0, out, &px.xp, &px.xsum),
    }
}

/// `out[r] = Σ_c W[r, c] · x[c]` at the best level ([`Level::best`]).
///
/// # Panics
/// If `m` fails [`validate`], `x.len() != cols` or `out.len() != rows`.
pub fn gemv(out: &mut [f32], m: QMatRef<'_>, x: &[f32]) {
    gemv_with(Level::best(), out, m, x)
}

/// [`gemv`] at an explicit level.
///
/// # Panics
/// As [`gemv`]; also if `level` is not available.
pub fn gemv_with(level: Level, out: &mut [f32], m: QMatRef<'_>, x: &[f32]) {
    validate(&m).unwrap_or_else(|e| panic!("fast::gemv: {e}"));
    assert_eq!(x.len(), m.cols, "fast::gemv: x length");
    assert_eq!(out.len(), m.rows, "fast::gemv: out length");
    let eff = effective(level, m.spec.bits, m.spec.group_size);
    let px = prepare_x(eff, &m, x);
    if m.rows * m.cols >= PAR_MIN_ELEMS && rayon::current_num_threads() > 1 {
        let cr = chunk_rows(m.rows, m.cols);
        out.par_chunks_mut(cr)
            .enumerate()
            .for_each(|(i, o)| gemv_rows(eff, &m, i * cr, o, &px));
    } else {
        gemv_rows(eff, &m, 0, out, &px);
    }
}

/// `out[t, r] = Σ_c W[r, c] · x[t, c]` at the best level; `x` is `[t, cols]`, `out` is
/// `[t, rows]`, row-major.
///
/// # Panics
/// If `m` fails [`validate`], `x.len() != t * cols` or `out.len() != t * rows`.
pub fn gemm(out: &mut [f32], m: QMatRef<'_>, x: &[f32], t: usize) {
    gemm_with(Level::best(), out, m, x, t)
}

/// Raw output pointer shared by gemm tasks that write disjoint `(token, row)` cells.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Rows dequantized together into the gemm scratch.
const GEMM_ROW_BLOCK: usize = 16;
/// Tokens per micro-kernel call.
const GEMM_TOK_BLOCK: usize = 4;
/// From this many tokens on, AVX-512 gemm uses the dequantize-to-scratch path.
pub const GEMM_SCRATCH_MIN_TOKENS: usize = 16;

/// [`gemm`] at an explicit level.
///
/// # Panics
/// As [`gemm`]; also if `level` is not available.
pub fn gemm_with(level: Level, out: &mut [f32], m: QMatRef<'_>, x: &[f32], t: usize) {
    validate(&m).unwrap_or_else(|e| panic!("fast::gemm: {e}"));
    assert_eq!(x.len(), t * m.cols, "fast::gemm: x length");
    assert_eq!(out.len(), t * m.rows, "fast::gemm: out length");
    if t == 0 || m.rows == 0 {
        return;
    }
    if t == 1 {
        return gemv_with(level, out, m, x);
    }
    // NEON has a gemv kernel only; its gemm is the portable one (order and all).
    let eff = match effective(level, m.spec.bits, m.spec.group_size) {
        Level::Neon => Level::Portable,
        e => e,
    };
    let cols = m.cols;
    let rows = m.rows;
    // AVX2 unpacks in registers per token tile; AVX-512 (≥ GEMM_SCRATCH_MIN_TOKENS tokens)
    // dequantizes a row block to f32 once and runs a 2×4 zmm micro-kernel, which won above
    // that size on a Sapphire Rapids host and lost below it.
    #[cfg(target_arch = "x86_64")]
    if eff == Level::Avx2 || (eff == Level::Avx512 && t < GEMM_SCRATCH_MIN_TOKENS) {
        return gemm_fused_avx2(out, &m, x, t);
    }
    let mut xp = vec![0f32; x.len()];
    for (xs, os) in x.chunks_exact(cols).zip(xp.chunks_exact_mut(cols)) {
        permute_x(eff, m.spec.bits, m.spec.group_size, xs, os);
    }
    let n_blocks = rows.div_ceil(GEMM_ROW_BLOCK);
    let optr = OutPtr(out.as_mut_ptr());
    let xp = &xp;
    let run_block = move |blk: usize| {
        let optr = optr;
        let r0 = blk * GEMM_ROW_BLOCK;
        let r1 = (r0 + GEMM_ROW_BLOCK).min(rows);
        let mut scratch = vec![0f32; (r1 - r0) * cols];
        for (i, dst) in scratch.chunks_exact_mut(cols).enumerate() {
            dequant_row(eff, &m, r0 + i, dst);
        }
        let mut t0 = 0;
        while t0 < t {
            let tb = (t - t0).min(GEMM_TOK_BLOCK);
            let mut r = r0;
            while r < r1 {
                let rb = (r1 - r).min(2);
                let mut res = [[0f32; GEMM_TOK_BLOCK]; 2];
                let ws: [&[f32]; 2] = [
                    &scratch[(r - r0) * cols..(r - r0 + 1) * cols],
                    &scratch[(r - r0 + rb - 1) * cols..(r - r0 + rb) * cols],
                ];
                let xs: [&[f32]; GEMM_TOK_BLOCK] = std::array::from_fn(|j| {
                    &xp[(t0 + j.min(tb - 1)) * cols..(t0 + j.min(tb - 1) + 1) * cols]
                });
                dots(eff, rb, tb, &ws, &xs, &mut res);
                for (ri, rr) in res.iter().enumerate().take(rb) {
                    for (j, v) in rr.iter().enumerate().take(tb) {
                        // SAFETY: (t0 + j, r + ri) is in bounds and owned by this block only.
                        unsafe { *optr.0.add((t0 + j) * rows + r + ri) = *v };
                    }
                }
                r += rb;
            }
            t0 += tb;
        }
    };
    if rows * cols >= PAR_MIN_ELEMS / 4 && rayon::current_num_threads() > 1 {
        (0..n_blocks).into_par_iter().for_each(run_block);
    } else {
        (0..n_blocks).for_each(run_block);
    }
}

/// AVX2 gemm: row blocks in parallel; inside, tokens in tiles of 4 and rows in pairs, each
/// 8-column unit of a row unpacked once per tile ([`x86::gemm_tile_avx2`]). Column order is
/// natural for AVX2.
#[cfg(target_arch = "x86_64")]
fn gemm_fused_avx2(out: &mut [f32], m: &QMatRef<'_>, x: &[f32], t: usize) {
    let (rows, cols, gs) = (m.rows, m.cols, m.spec.group_size);
    let xsum: Vec<f32> = x.chunks_exact(gs).map(|g| g.iter().sum()).collect();
    let gpr = cols / gs;
    let optr = OutPtr(out.as_mut_ptr());
    let block = GEMM_ROW_BLOCK;
    let run = move |blk: usize| {
        let optr = optr;
        let r0 = blk * block;
        let r1 = (r0 + block).min(rows);
        let mut t0 = 0;
        while t0 < t {
            let tb = (t - t0).min(GEMM_TOK_BLOCK);
            let xs = |j: usize| x[(t0 + j) * cols..].as_ptr();
            let xm = |j: usize| xsum[(t0 + j) * gpr..].as_ptr();
            // SAFETY: rows [r0, r1) of tokens t0.. are written by this task only.
            let o = |j: usize| unsafe { optr.0.add((t0 + j) * rows) };
            let mut r = r0;
            while r < r1 {
                let rb = (r1 - r).min(2);
                macro_rules! tile {
                    ($r:literal, $($j:literal),+) => {
                        unsafe { x86::gemm_tile_avx2::<$r, { [$($j),+].len() }>(m, r, [$(xs($j)),+], [$(xm($j)),+], [$(o($j)),+]) }
                    };
                }
                tile_shapes!(rb, tb, tile);
                r += rb;
            }
            t0 += tb;
        }
    };
    let n_blocks = rows.div_ceil(block);
    if rows * cols >= PAR_MIN_ELEMS / 4 && rayon::current_num_threads() > 1 {
        (0..n_blocks).into_par_iter().for_each(run);
    } else {
        (0..n_blocks).for_each(run);
    }
}

/// Dequantizes row `r` of `m` into `dst` (`cols` f32) in `eff`'s column order.
fn dequant_row(eff: Level, m: &QMatRef<'_>, r: usize, dst: &mut [f32]) {
    match eff {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::dequant_row_avx2(m, r, dst) },
        #[cfg(all(target_arch = "x86_64", quant_avx512))]
        Level::Avx512 => unsafe { x86::dequant_row_avx512(m, r, dst) },
        _ => portable::dequant_row(m, r, dst),
    }
}

/// `res[i][j] = ws[i] · xs[j]` for `i < rb`, `j < tb` (f32 dot products of equal length).
fn dots(
    eff: Level,
    rb: usize,
    tb: usize,
    ws: &[&[f32]; 2],
    xs: &[&[f32]; GEMM_TOK_BLOCK],
    res: &mut [[f32; GEMM_TOK_BLOCK]; 2],
) {
    match eff {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::dots_avx2(rb, tb, ws, xs, res) },
        #[cfg(all(target_arch = "x86_64", quant_avx512))]
        Level::Avx512 => unsafe { x86::dots_avx512(rb, tb, ws, xs, res) },
        _ => portable::dots(rb, tb, ws, xs, res),
    }
}

// ---------------------------------------------------------------------------------------------
// int8-activation gemm: see q8act.rs

mod q8act;
pub use q8act::{gemm_q8act, gemm_q8act_batch, gemm_q8act_prepared, gemm_q8act_with, QAct, Q8Job};
