//! MLX affine group-wise quantization, bit-exact, with reference and SIMD matrix-vector kernels.
//!
//! This crate reads and writes the layout that `mlx.core.quantize(w, group_size, bits,
//! mode="affine")` produces and that `mlx-lm` stores in checkpoints such as
//! `mlx-community/Qwen3.6-35B-A3B-4bit`. `README.md` beside this crate lists every fact with the
//! file and function it was read from; the summary:
//!
//! * **Matrix** `W` is `[rows, cols]` = `[out_features, in_features]` (PyTorch `nn.Linear`
//!   orientation, `y = W·x`). Groups run along `cols`: group `g` of row `r` is
//!   `W[r, g*group_size .. (g+1)*group_size]`.
//! * **`*.weight`**: dtype `U32`, shape `[rows, cols * bits / 32]`. Word `j` of a row holds the
//!   codes of columns `j*(32/bits) ..`, **element 0 in the lowest bits**: code of column
//!   `j*(32/bits) + k` is `(word >> (k*bits)) & (2^bits - 1)`. Equivalently the row is a
//!   little-endian bit stream; for 8 bits, byte `c` of the row is the code of column `c`.
//! * **`*.scales`, `*.biases`**: dtype of the original weights (BF16 for this model), shape
//!   `[rows, cols / group_size]`.
//! * **Dequantization**: `w = scale * q + bias`, `q` the unsigned code in `0 ..= 2^bits - 1`.
//!   Scales may be **negative** (MLX anchors the bias at whichever group extreme has the larger
//!   magnitude); nothing here assumes `scale > 0`.
//! * **Stacked experts** (`mlp.switch_mlp.{gate_proj,up_proj,down_proj}`) carry a leading expert
//!   dim on all three tensors: `[n_experts, rows, cols*bits/32]`, `[n_experts, rows, cols/gs]`.
//!   [`QMatRef::expert`] slices one expert out of such a tensor.
//!
//! The quantize rule ([`quantize`]) is MLX's CPU kernel (`mlx/backend/cpu/quantized.cpp`,
//! `quantize<T, U>`), reproduced bit for bit; `testdata/mlx_affine_v1.bin` holds vectors produced
//! by the PyPI `mlx` 0.32.4 CPU wheel and the tests compare against them. The Metal kernel, which
//! is what `mlx_lm.convert` runs on a Mac, differs in two details; [`QuantRule::MlxMetal`]
//! transcribes it (unverified bitwise: no Apple GPU here).
//!
//! Kernels: [`reference`](mod@reference) (plain loops, the definition) and [`fast`] (SIMD with runtime CPU
//! detection, rayon over output rows).

#![warn(missing_docs)]
// `usize::is_multiple_of` needs Rust 1.87; the workspace's rust-version is 1.85.
#![allow(clippy::manual_is_multiple_of)]

pub mod config;
pub mod fast;
pub mod reference;

use half::bf16;

/// Errors for malformed specs, shapes and inputs.
///
/// Every message names the offending tensor part or parameter, so a loader can pass it up
/// unchanged when it refuses a corrupt checkpoint folder.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    /// `bits` other than 4 or 8.
    #[error("unsupported quantization bits {0}: this crate supports 4 and 8")]
    UnsupportedBits(u32),
    /// `group_size` other than 32, 64 or 128 (the sizes MLX's affine mode accepts).
    #[error("unsupported quantization group_size {0}: MLX affine supports 32, 64 and 128")]
    UnsupportedGroupSize(usize),
    /// `cols` is not a positive multiple of `group_size`.
    #[error("cols {cols} is not a positive multiple of group_size {group_size}")]
    ColsNotMultipleOfGroup {
        /// Columns (input features) of the matrix.
        cols: usize,
        /// The group size asked for.
        group_size: usize,
    },
    /// A buffer or a stored tensor has the wrong length or shape.
    #[error("{what}: expected {expected}, found {found}")]
    Mismatch {
        /// Which part: `packed`, `scales`, `biases`, `input`, `weight shape`, ...
        what: String,
        /// What the spec and the other tensors imply.
        expected: String,
        /// What was given.
        found: String,
    },
    /// A required tensor is absent (for example `*.scales` next to a `U32` `*.weight`).
    #[error("missing {0}")]
    Missing(String),
    /// The input to [`quantize`] holds a NaN or an infinity.
    #[error("non-finite input value {value} at row {row}, col {col}")]
    NonFinite {
        /// Row of the first bad value.
        row: usize,
        /// Column of the first bad value.
        col: usize,
        /// The value.
        value: f32,
    },
}

fn mismatch(what: impl Into<String>, expected: impl ToString, found: impl ToString) -> QuantError {
    QuantError::Mismatch {
        what: what.into(),
        expected: expected.to_string(),
        found: found.to_string(),
    }
}

/// Bits per quantized value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bits {
    /// 4 bits: 8 codes per `u32`, codes `0..=15`.
    B4,
    /// 8 bits: 4 codes per `u32`, codes `0..=255`.
    B8,
}

impl Bits {
    /// Parses the `bits` field of an MLX `quantization` config.
    ///
    /// # Errors
    /// [`QuantError::UnsupportedBits`] for anything but 4 and 8 (MLX also has 2, 3, 5, 6; this
    /// model's checkpoints do not use them).
    pub fn from_u32(bits: u32) -> Result<Bits, QuantError> {
        match bits {
            4 => Ok(Bits::B4),
            8 => Ok(Bits::B8),
            b => Err(QuantError::UnsupportedBits(b)),
        }
    }
    /// Number of bits, 4 or 8.
    pub const fn bits(self) -> u32 {
        match self {
            Bits::B4 => 4,
            Bits::B8 => 8,
        }
    }
    /// Codes per packed `u32` word: 8 or 4.
    pub const fn per_word(self) -> usize {
        (32 / self.bits()) as usize
    }
    /// Largest code, `2^bits - 1` (MLX's `n_bins`).
    pub const fn max_code(self) -> u32 {
        (1 << self.bits()) - 1
    }
}

/// Bits and group size of one quantized matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    /// Bits per value.
    pub bits: Bits,
    /// Consecutive columns that share one scale and one bias: 32, 64 or 128.
    pub group_size: usize,
}

impl QuantSpec {
    /// Builds and checks a spec from the raw `bits` / `group_size` numbers of a config.
    ///
    /// # Errors
    /// [`QuantError::UnsupportedBits`], [`QuantError::UnsupportedGroupSize`].
    pub fn new(bits: u32, group_size: usize) -> Result<QuantSpec, QuantError> {
        let s = QuantSpec {
            bits: Bits::from_u32(bits)?,
            group_size,
        };
        s.check()?;
        Ok(s)
    }

    /// Checks the group size (the fields are public, so a spec can be built unchecked).
    ///
    /// # Errors
    /// [`QuantError::UnsupportedGroupSize`] unless `group_size` is 32, 64 or 128.
    pub fn check(&self) -> Result<(), QuantError> {
        match self.group_size {
            32 | 64 | 128 => Ok(()),
            g => Err(QuantError::UnsupportedGroupSize(g)),
        }
    }

    /// Checks that `cols` is a positive multiple of the group size.
    ///
    /// # Errors
    /// [`QuantError::UnsupportedGroupSize`], [`QuantError::ColsNotMultipleOfGroup`].
    pub fn check_cols(&self, cols: usize) -> Result<(), QuantError> {
        self.check()?;
        if cols == 0 || cols % self.group_size != 0 {
            return Err(QuantError::ColsNotMultipleOfGroup {
                cols,
                group_size: self.group_size,
            });
        }
        Ok(())
    }

    /// `u32` words per row: `cols * bits / 32`. Assumes [`check_cols`](Self::check_cols) passed.
    pub const fn words_per_row(&self, cols: usize) -> usize {
        cols / self.bits.per_word()
    }

    /// Groups (scales, biases) per row: `cols / group_size`.
    pub const fn groups_per_row(&self, cols: usize) -> usize {
        cols / self.group_size
    }

    /// Bytes one `[rows, cols]` matrix occupies: packed words plus bf16 scales and biases.
    pub const fn stored_bytes(&self, rows: usize, cols: usize) -> usize {
        rows * (self.words_per_row(cols) * 4 + self.groups_per_row(cols) * 4)
    }
}

/// A borrowed quantized matrix `[rows, cols]` in MLX layout.
///
/// * `packed`: `[rows, cols * bits / 32]` `u32`, row-major (see the crate docs for the order
///   of codes inside a word).
/// * `scales`, `biases`: `[rows, cols / group_size]` bf16, row-major.
///
/// The fields are public so a loader can build one straight from memory-mapped tensors; the
/// kernels call [`validate`] and panic on a malformed one. Use [`QMatRef::new`] to get a
/// `Result` instead.
#[derive(Debug, Clone, Copy)]
pub struct QMatRef<'a> {
    /// Output features.
    pub rows: usize,
    /// Input features (unpacked columns).
    pub cols: usize,
    /// Bits and group size.
    pub spec: QuantSpec,
    /// Packed codes, `rows * cols * bits / 32` words.
    pub packed: &'a [u32],
    /// One scale per group, `rows * cols / group_size`.
    pub scales: &'a [bf16],
    /// One bias per group, `rows * cols / group_size`.
    pub biases: &'a [bf16],
}

impl<'a> QMatRef<'a> {
    /// Builds a view and checks every length against `rows`, `cols` and `spec`.
    ///
    /// # Errors
    /// As [`validate`].
    pub fn new(
        rows: usize,
        cols: usize,
        spec: QuantSpec,
        packed: &'a [u32],
        scales: &'a [bf16],
        biases: &'a [bf16],
    ) -> Result<Self, QuantError> {
        let m = QMatRef {
            rows,
            cols,
            spec,
            packed,
            scales,
            biases,
        };
        validate(&m)?;
        Ok(m)
    }

    /// Expert `e` of a stacked `[n_experts, rows, ...]` tensor triple (MLX `switch_mlp`).
    ///
    /// `packed`, `scales` and `biases` are the whole stacked tensors; `rows`/`cols` are the
    /// per-expert matrix dims (for example `[512, 2048]` for `switch_mlp.gate_proj`).
    ///
    /// # Errors
    /// [`QuantError::Mismatch`] if the stacked lengths are not `n_experts` whole matrices or
    /// `e >= n_experts`; otherwise as [`validate`].
    #[allow(clippy::too_many_arguments)]
    pub fn expert(
        n_experts: usize,
        e: usize,
        rows: usize,
        cols: usize,
        spec: QuantSpec,
        packed: &'a [u32],
        scales: &'a [bf16],
        biases: &'a [bf16],
    ) -> Result<Self, QuantError> {
        spec.check_cols(cols)?;
        if e >= n_experts {
            return Err(mismatch("expert index", format!("< {n_experts}"), e));
        }
        let pw = rows * spec.words_per_row(cols);
        let pg = rows * spec.groups_per_row(cols);
        for (what, len, per) in [
            ("packed", packed.len(), pw),
            ("scales", scales.len(), pg),
            ("biases", biases.len(), pg),
        ] {
            if len != n_experts * per {
                return Err(mismatch(
                    format!("stacked {what} length"),
                    format!("{n_experts} experts x {per} = {}", n_experts * per),
                    len,
                ));
            }
        }
        QMatRef::new(
            rows,
            cols,
            spec,
            &packed[e * pw..(e + 1) * pw],
            &scales[e * pg..(e + 1) * pg],
            &biases[e * pg..(e + 1) * pg],
        )
    }

    /// Rows `r0..r1` as a matrix of their own (the same storage, no copy).
    ///
    /// # Panics
    /// If `r0 > r1` or `r1 > rows`.
    pub fn slice_rows(&self, r0: usize, r1: usize) -> QMatRef<'a> {
        assert!(
            r0 <= r1 && r1 <= self.rows,
            "slice_rows {r0}..{r1} of {} rows",
            self.rows
        );
        let w = self.spec.words_per_row(self.cols);
        let g = self.spec.groups_per_row(self.cols);
        QMatRef {
            rows: r1 - r0,
            cols: self.cols,
            spec: self.spec,
            packed: &self.packed[r0 * w..r1 * w],
            scales: &self.scales[r0 * g..r1 * g],
            biases: &self.biases[r0 * g..r1 * g],
        }
    }

    /// The code (`0 ..= 2^bits-1`) at `[r, c]`.
    ///
    /// # Panics
    /// If out of range.
    pub fn code(&self, r: usize, c: usize) -> u32 {
        assert!(r < self.rows && c < self.cols);
        let per = self.spec.bits.per_word();
        let word = self.packed[r * self.spec.words_per_row(self.cols) + c / per];
        (word >> ((c % per) as u32 * self.spec.bits.bits())) & self.spec.bits.max_code()
    }

    /// Scale and bias (as f32) of the group holding `[r, c]`.
    pub fn scale_bias(&self, r: usize, c: usize) -> (f32, f32) {
        let i = r * self.spec.groups_per_row(self.cols) + c / self.spec.group_size;
        (self.scales[i].to_f32(), self.biases[i].to_f32())
    }

    /// Bytes of packed words, scales and biases.
    pub fn stored_bytes(&self) -> usize {
        self.spec.stored_bytes(self.rows, self.cols)
    }
}

/// An owned quantized matrix; see [`QMatRef`] for the layout.
#[derive(Debug, Clone, PartialEq)]
pub struct QMat {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Bits and group size.
    pub spec: QuantSpec,
    /// `[rows, cols * bits / 32]`.
    pub packed: Vec<u32>,
    /// `[rows, cols / group_size]`.
    pub scales: Vec<bf16>,
    /// `[rows, cols / group_size]`.
    pub biases: Vec<bf16>,
}

impl QMat {
    /// Borrowed view.
    pub fn as_ref(&self) -> QMatRef<'_> {
        QMatRef {
            rows: self.rows,
            cols: self.cols,
            spec: self.spec,
            packed: &self.packed,
            scales: &self.scales,
            biases: &self.biases,
        }
    }
}

/// Checks the buffer lengths of `m` against its `rows`, `cols` and `spec`.
///
/// # Errors
/// * [`QuantError::UnsupportedGroupSize`] / [`QuantError::ColsNotMultipleOfGroup`];
/// * [`QuantError::Missing`] for an empty `scales` or `biases` when the matrix is not empty;
/// * [`QuantError::Mismatch`] naming `packed`, `scales` or `biases` and both lengths; a
///   scales length that matches a *different* group size says so, because that is what a
///   config with the wrong `group_size` looks like.
pub fn validate(m: &QMatRef<'_>) -> Result<(), QuantError> {
    m.spec.check_cols(m.cols)?;
    let words = m.rows * m.spec.words_per_row(m.cols);
    let groups = m.rows * m.spec.groups_per_row(m.cols);
    if m.packed.len() != words {
        return Err(mismatch(
            "packed length",
            format!(
                "{words} u32 words ([{}, {}] at {} bits)",
                m.rows,
                m.cols,
                m.spec.bits.bits()
            ),
            m.packed.len(),
        ));
    }
    for (what, len) in [("scales", m.scales.len()), ("biases", m.biases.len())] {
        if len == groups {
            continue;
        }
        if len == 0 && groups > 0 {
            return Err(QuantError::Missing(format!(
                "{what} (expected {groups} values)"
            )));
        }
        let mut found = len.to_string();
        if m.rows > 0 && len % m.rows == 0 && len > 0 && m.cols % (len / m.rows) == 0 {
            let implied = m.cols / (len / m.rows);
            found = format!(
                "{len} (that is group_size {implied}, not {})",
                m.spec.group_size
            );
        }
        return Err(mismatch(
            format!("{what} length"),
            format!(
                "{groups} ([{}, {}] with group_size {})",
                m.rows, m.cols, m.spec.group_size
            ),
            found,
        ));
    }
    Ok(())
}

/// Logical shape of a quantized tensor triple as found in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QShape {
    /// Leading expert count for stacked `switch_mlp` tensors, `None` for plain matrices.
    pub experts: Option<usize>,
    /// Output features.
    pub rows: usize,
    /// Input features (unpacked).
    pub cols: usize,
}

/// Checks the stored shapes of a `*.weight` (U32) / `*.scales` / `*.biases` triple and returns
/// the logical shape.
///
/// `weight` is `[rows, words]` or `[experts, rows, words]`; `cols = words * 32 / bits`. Scales
/// and biases must have the same leading dims and `cols / group_size` last. Dtypes are the
/// loader's business: `weight` must be `U32`, scales and biases the model dtype (BF16 here).
///
/// # Errors
/// [`QuantError::Missing`] when scales or biases are `None`; [`QuantError::Mismatch`] naming the
/// tensor and both shapes otherwise, including the group size the scales imply when it differs
/// from `spec.group_size`.
pub fn check_tensor_shapes(
    spec: QuantSpec,
    weight: &[usize],
    scales: Option<&[usize]>,
    biases: Option<&[usize]>,
) -> Result<QShape, QuantError> {
    spec.check()?;
    let (experts, rows, words) = match *weight {
        [r, w] => (None, r, w),
        [e, r, w] => (Some(e), r, w),
        _ => {
            return Err(mismatch(
                "weight rank",
                "2 ([rows, words]) or 3 ([experts, rows, words])",
                format!("{weight:?}"),
            ))
        }
    };
    let cols = words * spec.bits.per_word();
    spec.check_cols(cols)?;
    let mut expected: Vec<usize> = weight.to_vec();
    *expected.last_mut().unwrap() = cols / spec.group_size;
    for (what, shape) in [("scales", scales), ("biases", biases)] {
        let shape = shape.ok_or_else(|| {
            QuantError::Missing(format!("{what} tensor (expected shape {expected:?})"))
        })?;
        if shape != expected.as_slice() {
            let mut found = format!("{shape:?}");
            if shape.len() == expected.len()
                && shape[..shape.len() - 1] == expected[..expected.len() - 1]
                && shape[shape.len() - 1] > 0
                && cols % shape[shape.len() - 1] == 0
            {
                found += &format!(
                    " (implies group_size {}, config says {})",
                    cols / shape[shape.len() - 1],
                    spec.group_size
                );
            }
            return Err(mismatch(
                format!("{what} shape"),
                format!("{expected:?}"),
                found,
            ));
        }
    }
    Ok(QShape {
        experts,
        rows,
        cols,
    })
}

/// Packs codes (one per element, each `< 2^bits`) into MLX words, element 0 in the low bits.
///
/// # Panics
/// If `codes.len()` is not a multiple of `32 / bits` or a code does not fit.
pub fn pack_codes(codes: &[u8], bits: Bits) -> Vec<u32> {
    let per = bits.per_word();
    assert!(
        codes.len() % per == 0,
        "{} codes is not a multiple of {per}",
        codes.len()
    );
    codes
        .chunks_exact(per)
        .map(|c| {
            c.iter().enumerate().fold(0u32, |w, (k, &q)| {
                assert!(
                    u32::from(q) <= bits.max_code(),
                    "code {q} does not fit in {} bits",
                    bits.bits()
                );
                w | (u32::from(q) << (k as u32 * bits.bits()))
            })
        })
        .collect()
}

/// Unpacks MLX words into one code per element; the inverse of [`pack_codes`].
///
/// # Panics
/// If `out.len() != words.len() * 32 / bits`.
pub fn unpack_codes(words: &[u32], bits: Bits, out: &mut [u8]) {
    let per = bits.per_word();
    assert_eq!(out.len(), words.len() * per, "output length");
    for (w, o) in words.iter().zip(out.chunks_exact_mut(per)) {
        for (k, q) in o.iter_mut().enumerate() {
            *q = ((w >> (k as u32 * bits.bits())) & bits.max_code()) as u8;
        }
    }
}

/// Which MLX kernel's arithmetic [`quantize_with`] reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantRule {
    /// `mlx/backend/cpu/quantized.cpp`, `quantize<T, U>` (MLX's CPU backend, also what the
    /// PyPI Linux wheel runs). Verified bit for bit against mlx 0.32.4; the default.
    #[default]
    MlxCpu,
    /// `mlx/backend/metal/kernels/quantized.h`, `affine_quantize` (Apple GPU, what
    /// `mlx_lm.convert` uses on a Mac). Differs from the CPU rule in two places: the group max
    /// starts at 0 (so it is `max(0, max(w))`), and rounding is half away from zero (Metal
    /// `round`) instead of half to even (`std::rint`). Transcribed, not verified bitwise.
    MlxMetal,
}

/// Quantizes a row-major f32 matrix `[rows, cols]` with MLX's affine rule ([`QuantRule::MlxCpu`]).
///
/// For inputs that are bf16 values (a bf16 checkpoint widened to f32) the result equals
/// `mx.quantize(w_bf16, group_size, bits)` bit for bit: same codes, same bf16 scales and biases.
/// For other f32 inputs it equals `mx.quantize(w_f32)` with scales and biases then cast to bf16
/// (round to nearest even).
///
/// Per group of `group_size` values, all arithmetic in f32:
/// 1. `min`, `max` of the group; `n = 2^bits - 1`.
/// 2. `scale = max((max - min) / n, 1e-7)`.
/// 3. If `|min| > |max|`: `edge = min`, else `edge = max` and `scale = -scale`.
/// 4. `q0 = rint(edge / scale)` (ties to even). If `q0 != 0`: `scale = edge / q0`,
///    `bias = edge`; else `bias = 0` and `scale` stays. So the larger-magnitude extreme is
///    exactly representable (it is the bias, code 0) and so is 0 (at code `-q0`, when
///    `-q0 <= n`).
/// 5. `q = clamp(rint((w - bias) / scale), 0, n)`; the f32 `scale` is used here, the stored
///    scale is `bf16(scale)`, the stored bias `bf16(bias)` (exact for bf16 inputs).
///
/// Edge cases: `max == min == c` gives `scale ≈ ±1e-7` and `bias = c` (all codes 0); an
/// all-zero group gives `scale = bf16(-1e-7)`, `bias = 0`. Clamping matters only at the far
/// extreme, which step 4 can push up to one step past `n`.
///
/// # Errors
/// [`QuantError::UnsupportedGroupSize`], [`QuantError::ColsNotMultipleOfGroup`],
/// [`QuantError::Mismatch`] if `w.len() != rows * cols`, [`QuantError::NonFinite`].
pub fn quantize(w: &[f32], rows: usize, cols: usize, spec: QuantSpec) -> Result<QMat, QuantError> {
    quantize_with(w, rows, cols, spec, QuantRule::MlxCpu)
}

/// [`quantize`] with a choice of MLX kernel; see [`QuantRule`].
///
/// # Errors
/// As [`quantize`].
pub fn quantize_with(
    w: &[f32],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
    rule: QuantRule,
) -> Result<QMat, QuantError> {
    spec.check_cols(cols)?;
    if w.len() != rows * cols {
        return Err(mismatch(
            "input length",
            format!("{rows} x {cols} = {}", rows * cols),
            w.len(),
        ));
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NonFinite {
            row: i / cols,
            col: i % cols,
            value: w[i],
        });
    }
    let gs = spec.group_size;
    let bits = spec.bits.bits();
    let per = spec.bits.per_word();
    let n_bins = spec.bits.max_code() as f32;
    let eps = 1e-7f32;
    let n_groups = rows * cols / gs;
    let mut packed = Vec::with_capacity(rows * spec.words_per_row(cols));
    let mut scales = Vec::with_capacity(n_groups);
    let mut biases = Vec::with_capacity(n_groups);
    let round = |v: f32| match rule {
        QuantRule::MlxCpu => v.round_ties_even(),
        QuantRule::MlxMetal => v.round(),
    };
    for group in w.chunks_exact(gs) {
        let (mut w_min, mut w_max) = match rule {
            QuantRule::MlxCpu => (f32::INFINITY, f32::NEG_INFINITY),
            // Metal seeds min with the dtype's max and max with 0.
            QuantRule::MlxMetal => (f32::MAX, 0.0),
        };
        for &v in group {
            w_max = w_max.max(v);
            w_min = w_min.min(v);
        }
        let mask = w_min.abs() > w_max.abs();
        let mut scale = ((w_max - w_min) / n_bins).max(eps);
        if !mask {
            scale = -scale;
        }
        let edge = if mask { w_min } else { w_max };
        let q0 = round(edge / scale);
        let mut bias = 0.0f32;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        for chunk in group.chunks_exact(per) {
            let mut word = 0u32;
            for (k, &v) in chunk.iter().enumerate() {
                // std::min(std::max(q, 0.0f), n_bins); `as u32` also maps -0.0 to 0.
                let q = round((v - bias) / scale).max(0.0).min(n_bins);
                word |= (q as u32) << (k as u32 * bits);
            }
            packed.push(word);
        }
        scales.push(bf16::from_f32(scale));
        biases.push(bf16::from_f32(bias));
    }
    Ok(QMat {
        rows,
        cols,
        spec,
        packed,
        scales,
        biases,
    })
}

/// Dequantizes to f32: `out[r*cols + c] = scale * q + bias`, computed in f32 (a multiply
/// rounded to f32, then an add rounded to f32; no fused multiply-add), scale and bias widened
/// exactly from bf16.
///
/// This is more precise than `mx.dequantize`, which rounds to bf16 after each operation (see
/// [`dequantize_mlx_bf16`]).
///
/// # Panics
/// If `m` fails [`validate`] or `out.len() != rows * cols`.
pub fn dequantize(m: QMatRef<'_>, out: &mut [f32]) {
    validate(&m).unwrap_or_else(|e| panic!("dequantize: {e}"));
    assert_eq!(out.len(), m.rows * m.cols, "dequantize: output length");
    let gs = m.spec.group_size;
    let mut codes = vec![0u8; m.cols];
    let wpr = m.spec.words_per_row(m.cols);
    for r in 0..m.rows {
        unpack_codes(&m.packed[r * wpr..(r + 1) * wpr], m.spec.bits, &mut codes);
        let g0 = r * m.spec.groups_per_row(m.cols);
        for (c, o) in out[r * m.cols..(r + 1) * m.cols].iter_mut().enumerate() {
            let s = m.scales[g0 + c / gs].to_f32();
            let b = m.biases[g0 + c / gs].to_f32();
            *o = s * f32::from(codes[c]) + b;
        }
    }
}

/// Dequantizes exactly as `mx.dequantize` does on MLX's CPU backend for bf16 scales:
/// `bf16(bf16(q * scale) + bias)`, each operation computed in f32 and rounded to bf16
/// (verified against mlx 0.32.4, also with `dtype=mx.float32`, which only widens that result).
///
/// # Panics
/// If `m` fails [`validate`] or `out.len() != rows * cols`.
pub fn dequantize_mlx_bf16(m: QMatRef<'_>, out: &mut [bf16]) {
    validate(&m).unwrap_or_else(|e| panic!("dequantize_mlx_bf16: {e}"));
    assert_eq!(
        out.len(),
        m.rows * m.cols,
        "dequantize_mlx_bf16: output length"
    );
    let gs = m.spec.group_size;
    for r in 0..m.rows {
        for c in 0..m.cols {
            let q = m.code(r, c) as f32;
            let g = r * m.spec.groups_per_row(m.cols) + c / gs;
            let prod = bf16::from_f32(q * m.scales[g].to_f32());
            out[r * m.cols + c] = bf16::from_f32(prod.to_f32() + m.biases[g].to_f32());
        }
    }
}

/// Quantizes activations to int8, symmetric, per group of `group_size` consecutive values
/// (the input of [`reference::gemm_q8act`] / [`fast::gemm_q8act`]).
///
/// `x` is any number of whole groups (for a `[t, cols]` activation with `cols` a multiple of
/// `group_size`, group `tt * cols / group_size + g` is group `g` of token `tt`). Per group, in f32:
///
/// * `amax = max_k |x_k|`, `sx = amax / 127` (one rounding);
/// * `sx == 0` (all zeros, or `amax` below `127 ×` the smallest subnormal): every code is 0;
/// * else `xi_k = clamp(round_half_even(x_k / sx), -127, 127)`. The clamp never binds for
///   normal `sx` (`|x_k / sx| ≤ 127·(1 + 2⁻²³)` rounds to at most 127); it is there for
///   subnormal `sx`.
///
/// Returns `(xi, sx per group, Σx per group)`; `Σx` is the f32 sum of the **original** values,
/// left to right, exactly as [`fast::gemm`] computes it (the bias term uses it unrounded).
///
/// Reconstruction error: `|x_k − sx·xi_k| ≤ sx·(1/2 + 127·2⁻²⁴)` for normal `sx` (the `x/sx`
/// division adds at most `127·u` code units to the half-unit rounding), i.e. at most
/// `max|x_group| / 254 · (1 + 2⁻¹⁶)`.
///
/// # Panics
/// If `group_size == 0`, `x.len()` is not a multiple of `group_size`, or a value is not finite.
pub fn quantize_act_q8(x: &[f32], group_size: usize) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
    assert!(
        group_size > 0 && x.len() % group_size == 0,
        "quantize_act_q8: length {} is not a multiple of group_size {group_size}",
        x.len()
    );
    let n_groups = x.len() / group_size;
    let mut xi = vec![0i8; x.len()];
    let mut sx = Vec::with_capacity(n_groups);
    let mut xs = Vec::with_capacity(n_groups);
    for (g, (xg, qg)) in x
        .chunks_exact(group_size)
        .zip(xi.chunks_exact_mut(group_size))
        .enumerate()
    {
        let mut amax = 0f32;
        let mut sum = 0f32;
        for (k, &v) in xg.iter().enumerate() {
            assert!(
                v.is_finite(),
                "quantize_act_q8: non-finite value {v} at index {}",
                g * group_size + k
            );
            amax = amax.max(v.abs());
            sum += v;
        }
        let s = amax / 127.0;
        if s != 0.0 {
            for (q, &v) in qg.iter_mut().zip(xg) {
                *q = (v / s).round_ties_even().clamp(-127.0, 127.0) as i8;
            }
        }
        sx.push(s);
        xs.push(sum);
    }
    (xi, sx, xs)
}

/// Widens a bf16 to f32 exactly (the kernels' inner conversion).
#[inline(always)]
pub(crate) fn bf16_f32(v: bf16) -> f32 {
    f32::from_bits(u32::from(v.to_bits()) << 16)
}
