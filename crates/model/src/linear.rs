//! Weight matrices as views into the memory-mapped checkpoint: dense float tensors, or MLX
//! affine group-wise quantized triples (`weight` U32 packed, `scales`, `biases`).

use std::cell::RefCell;

use half::bf16;
use quant::fast::{QAct, Q8Job};
use quant::{QMatRef, QuantSpec};
use rayon::prelude::*;
use weights::{DType, LoadError, Tensor};

use crate::reference::dot;

/// Which implementation runs the matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// Plain loops: the definition (`reference::dot`, `quant::reference`).
    Reference,
    /// SIMD kernels with runtime CPU detection and threads (`quant::fast`); dense float
    /// weights use the reference loops, which are already threaded.
    #[default]
    Fast,
    /// [`Backend::Fast`], except that products with quantized weights quantize the
    /// activations to int8 per group and use integer dot products (`quant::fast::gemm_q8act`,
    /// as llama.cpp does), for prefill and decode alike; an input read by several matrices
    /// ([`forward_batch`]) is quantized once. Faster at the cost of activation rounding
    /// (≤ max|x_g|/254 per element; bound in `quant::reference::gemm_q8act`).
    FastQ8,
}

/// A matrix `W` [rows, cols] (PyTorch `nn.Linear` orientation: y = x·Wᵀ), viewing `rows`
/// consecutive rows starting at row `row0` of a stored tensor (so one expert of a stacked or
/// fused expert tensor is a view too).
#[derive(Clone, Debug)]
pub enum Linear {
    /// A float tensor (BF16, F16 or F32), upcast exactly to f32.
    Dense {
        /// The stored tensor.
        tensor: Tensor,
        /// First row of the view.
        row0: usize,
        /// Output features.
        rows: usize,
        /// Input features.
        cols: usize,
    },
    /// MLX affine quantization: `w = scale·q + bias` per group of `spec.group_size` columns.
    Quant {
        /// `[.., rows, cols·bits/32]` U32.
        packed: Tensor,
        /// `[.., rows, cols/group_size]` BF16.
        scales: Tensor,
        /// `[.., rows, cols/group_size]` BF16.
        biases: Tensor,
        /// Bits and group size.
        spec: QuantSpec,
        /// First row of the view.
        row0: usize,
        /// Output features.
        rows: usize,
        /// Input features.
        cols: usize,
    },
}

fn as_u32(t: &Tensor) -> Result<&[u32], LoadError> {
    bytemuck::try_cast_slice(t.bytes()).map_err(|_| LoadError::DTypeMismatch {
        tensor: t.name().to_string(),
        file: t.file().to_path_buf(),
        expected: "U32 data aligned to 4 bytes".into(),
        found: "misaligned U32 data".into(),
    })
}

fn as_bf16(t: &Tensor) -> Result<&[bf16], LoadError> {
    bytemuck::try_cast_slice(t.bytes()).map_err(|_| LoadError::DTypeMismatch {
        tensor: t.name().to_string(),
        file: t.file().to_path_buf(),
        expected: "BF16 data aligned to 2 bytes".into(),
        found: "misaligned BF16 data".into(),
    })
}

impl Linear {
    /// A whole 2-D float tensor, checked against the expected `[rows, cols]`.
    ///
    /// # Errors
    /// Shape or dtype mismatch, naming the tensor and file.
    pub fn new(t: &Tensor, rows: usize, cols: usize) -> Result<Self, LoadError> {
        t.expect_shape(&[rows, cols])?;
        t.expect_float()?;
        Ok(Linear::Dense { tensor: t.clone(), row0: 0, rows, cols })
    }

    /// Rows `[row0, row0 + rows)` of a float tensor whose trailing dimension is `cols` (the
    /// caller has checked the full shape).
    ///
    /// # Errors
    /// Dtype mismatch, naming the tensor and file.
    pub fn slice(t: &Tensor, row0: usize, rows: usize, cols: usize) -> Result<Self, LoadError> {
        t.expect_float()?;
        assert!((row0 + rows) * cols <= t.numel(), "slice outside tensor {}", t.name());
        Ok(Linear::Dense { tensor: t.clone(), row0, rows, cols })
    }

    /// Rows `[row0, row0 + rows)` of a quantized triple whose logical trailing dimension is
    /// `cols`; shapes and dtypes have been checked by the caller with
    /// [`quant::check_tensor_shapes`]; alignment is checked here.
    ///
    /// # Errors
    /// Misaligned data, naming the tensor and file.
    pub fn quant(packed: &Tensor, scales: &Tensor, biases: &Tensor, spec: QuantSpec, row0: usize, rows: usize, cols: usize) -> Result<Self, LoadError> {
        as_u32(packed)?;
        as_bf16(scales)?;
        as_bf16(biases)?;
        // The view must lie inside the stored tensors (the caller checked their shapes).
        let (words, groups) = (spec.words_per_row(cols), spec.groups_per_row(cols));
        assert!((row0 + rows) * words * 4 <= packed.bytes().len(), "quant view outside {}", packed.name());
        for t in [scales, biases] {
            assert!((row0 + rows) * groups * 2 <= t.bytes().len(), "quant view outside {}", t.name());
        }
        Ok(Linear::Quant { packed: packed.clone(), scales: scales.clone(), biases: biases.clone(), spec, row0, rows, cols })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            Linear::Dense { rows, .. } | Linear::Quant { rows, .. } => *rows,
        }
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            Linear::Dense { cols, .. } | Linear::Quant { cols, .. } => *cols,
        }
    }

    /// Bytes of weight data one full product reads (packed codes, scales and biases included).
    pub fn stored_bytes(&self) -> usize {
        match self {
            Linear::Dense { tensor, rows, cols, .. } => rows * cols * tensor.dtype().map(DType::size_bytes).unwrap_or(4),
            Linear::Quant { spec, rows, cols, .. } => spec.stored_bytes(*rows, *cols),
        }
    }

    /// The quantized view, for `Quant`.
    pub fn qref(&self) -> Option<QMatRef<'_>> {
        match self {
            Linear::Dense { .. } => None,
            Linear::Quant { packed, scales, biases, spec, row0, rows, cols } => {
                let (w, g) = (spec.words_per_row(*cols), spec.groups_per_row(*cols));
                let p = as_u32(packed).expect("checked at load");
                let s = as_bf16(scales).expect("checked at load");
                let b = as_bf16(biases).expect("checked at load");
                Some(QMatRef {
                    rows: *rows,
                    cols: *cols,
                    spec: *spec,
                    packed: &p[row0 * w..(row0 + rows) * w],
                    scales: &s[row0 * g..(row0 + rows) * g],
                    biases: &b[row0 * g..(row0 + rows) * g],
                })
            }
        }
    }

    /// Rows `[r0, r0 + n)` as f32 into `out` ([n, cols]); quantized rows are dequantized.
    pub fn rows_f32(&self, r0: usize, out: &mut [f32]) {
        match self {
            Linear::Dense { tensor, row0, cols, .. } => tensor.read_f32((row0 + r0) * cols, out),
            Linear::Quant { .. } => {
                let q = self.qref().expect("quant");
                let n = out.len() / q.cols;
                quant::dequantize(q.slice_rows(r0, r0 + n), out);
            }
        }
    }

    /// Row `r` as f32 into `out` ([cols]).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.rows_f32(r, out);
    }

    /// `out[t, rows] = x[t, cols] · Wᵀ` in f32.
    ///
    /// Dense: rows in parallel, each output one [`dot`] (thread-count independent).
    /// Quantized: `quant::reference::gemm` or `quant::fast::gemm` by `backend`.
    pub fn forward(&self, out: &mut [f32], x: &[f32], t: usize, backend: Backend) {
        let (rows, cols) = (self.rows(), self.cols());
        assert_eq!(x.len(), t * cols);
        assert_eq!(out.len(), t * rows);
        if let Some(q) = self.qref() {
            match (backend, t) {
                (Backend::Reference, _) => quant::reference::gemm(out, q, x, t),
                (Backend::Fast, 1) => quant::fast::gemv(out, q, x),
                (Backend::Fast, _) => quant::fast::gemm(out, q, x, t),
                (Backend::FastQ8, _) => quant::fast::gemm_q8act(out, q, x, t),
            }
            return;
        }
        const BLOCK: usize = 16;
        // Column-major partial results [rows, t], transposed at the end.
        let mut out_t = vec![0.0f32; rows * t];
        out_t.par_chunks_mut(BLOCK * t).enumerate().for_each(|(bi, chunk)| {
            let r0 = bi * BLOCK;
            let n = chunk.len() / t;
            let mut w = vec![0.0f32; n * cols];
            self.rows_f32(r0, &mut w);
            for r in 0..n {
                let wr = &w[r * cols..(r + 1) * cols];
                for tt in 0..t {
                    chunk[r * t + tt] = dot(wr, &x[tt * cols..(tt + 1) * cols]);
                }
            }
        });
        for r in 0..rows {
            for tt in 0..t {
                out[tt * rows + r] = out_t[r * t + tt];
            }
        }
    }
}

/// One product of a [`forward_batch`]: `out[t, rows] = x[t, cols] · Wᵀ`.
pub struct LinJob<'a> {
    /// The matrix.
    pub w: &'a Linear,
    /// `[t, cols]`, row-major.
    pub x: &'a [f32],
    /// Tokens in `x`.
    pub t: usize,
    /// `[t, rows]`, row-major.
    pub out: &'a mut [f32],
}

thread_local! {
    /// Quantized-activation buffers reused by [`forward_batch`] (no allocation once warm).
    static QACTS: RefCell<Vec<QAct>> = const { RefCell::new(Vec::new()) };
}

/// Runs every job as [`Linear::forward`] would, with the same results bit for bit.
///
/// With [`Backend::FastQ8`], the quantized products run together: each distinct input (same
/// slice, same quantization spec) is quantized to int8 once, and the row blocks of all
/// products share one parallel loop (`quant::fast::gemm_q8act_batch`), so several small
/// matrices (the experts of one token) keep every thread busy. Other jobs run one by one.
///
/// # Panics
/// As [`Linear::forward`], for any job.
pub fn forward_batch(jobs: &mut [LinJob<'_>], backend: Backend) {
    if backend != Backend::FastQ8 {
        for j in jobs.iter_mut() {
            j.w.forward(j.out, j.x, j.t, backend);
        }
        return;
    }
    // Distinct (input, spec) pairs; job i reads key[i] (None: dense, run alone).
    let mut inputs: Vec<(*const f32, usize, usize, QuantSpec)> = Vec::new();
    let mut key: Vec<Option<usize>> = Vec::with_capacity(jobs.len());
    for j in jobs.iter_mut() {
        let (rows, cols) = (j.w.rows(), j.w.cols());
        assert_eq!(j.x.len(), j.t * cols);
        assert_eq!(j.out.len(), j.t * rows);
        match j.w.qref() {
            Some(q) => {
                let id = (j.x.as_ptr(), j.x.len(), j.t, q.spec);
                let k = inputs.iter().position(|v| *v == id).unwrap_or_else(|| {
                    inputs.push(id);
                    inputs.len() - 1
                });
                key.push(Some(k));
            }
            None => {
                j.w.forward(j.out, j.x, j.t, backend);
                key.push(None);
            }
        }
    }
    if inputs.is_empty() {
        return;
    }
    // Taken out of the thread-local for the duration (a nested call, e.g. from a rayon task
    // this thread runs while it waits, finds the pool empty and allocates).
    let mut pool = QACTS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    while pool.len() < inputs.len() {
        pool.push(QAct::new());
    }
    {
        // Several inputs (the experts' gathered tokens) are quantized in parallel.
        let first: Vec<(&[f32], usize, QMatRef<'_>)> = (0..inputs.len())
            .map(|k| {
                let j = key.iter().position(|&v| v == Some(k)).expect("input has a job");
                (jobs[j].x, jobs[j].t, jobs[j].w.qref().expect("quantized"))
            })
            .collect();
        let quantize = |(qa, &(x, t, q)): (&mut QAct, &(&[f32], usize, QMatRef<'_>))| qa.quantize(x, t, q.cols, q.spec);
        if first.len() > 1 {
            pool[..first.len()].par_iter_mut().zip(&first).for_each(quantize);
        } else {
            pool.iter_mut().zip(&first).for_each(quantize);
        }
    }
    {
        let mut q8: Vec<Q8Job<'_>> = jobs
            .iter_mut()
            .zip(&key)
            .filter_map(|(j, k)| k.map(|k| Q8Job { m: j.w.qref().expect("quantized"), x: &pool[k], out: &mut *j.out }))
            .collect();
        quant::fast::gemm_q8act_batch(&mut q8);
    }
    QACTS.with(|p| {
        let mut p = p.borrow_mut();
        if p.len() < pool.len() {
            *p = pool;
        }
    });
}
