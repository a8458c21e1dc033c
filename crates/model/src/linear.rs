//! Weight matrices as views into the memory-mapped checkpoint.

use rayon::prelude::*;
use weights::{LoadError, Tensor};

use crate::reference::dot;

/// A dense matrix `W` [rows, cols] (PyTorch `nn.Linear` orientation: y = x·Wᵀ), viewing
/// `rows` consecutive rows of a stored float tensor starting at row `row0`. The fused 3-D expert
/// tensors are viewed this way, one expert (and one of gate/up) at a time.
#[derive(Clone, Debug)]
pub struct Linear {
    tensor: Tensor,
    row0: usize,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
}

impl Linear {
    /// A whole 2-D float tensor, checked against the expected `[rows, cols]`.
    ///
    /// # Errors
    /// Shape or dtype mismatch, naming the tensor and file.
    pub fn new(t: &Tensor, rows: usize, cols: usize) -> Result<Self, LoadError> {
        t.expect_shape(&[rows, cols])?;
        t.expect_float()?;
        Ok(Linear { tensor: t.clone(), row0: 0, rows, cols })
    }

    /// Rows `[row0, row0 + rows)` of a float tensor whose trailing dimension is `cols` (the
    /// caller has checked the full shape).
    ///
    /// # Errors
    /// Dtype mismatch, naming the tensor and file.
    pub fn slice(t: &Tensor, row0: usize, rows: usize, cols: usize) -> Result<Self, LoadError> {
        t.expect_float()?;
        assert!((row0 + rows) * cols <= t.numel(), "slice outside tensor {}", t.name());
        Ok(Linear { tensor: t.clone(), row0, rows, cols })
    }

    /// The stored tensor this view reads.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Row `r` as f32 into `out` ([cols]).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.tensor.read_f32((self.row0 + r) * self.cols, out);
    }

    /// Rows `[r0, r0 + n)` as f32 into `out` ([n, cols]).
    pub fn rows_f32(&self, r0: usize, out: &mut [f32]) {
        self.tensor.read_f32((self.row0 + r0) * self.cols, out);
    }

    /// `out[t, rows] = x[t, cols] · Wᵀ` in f32 (weights upcast exactly). Rows are processed in
    /// parallel; each output element is one [`dot`], so the result does not depend on threads.
    pub fn forward(&self, out: &mut [f32], x: &[f32], t: usize) {
        assert_eq!(x.len(), t * self.cols);
        assert_eq!(out.len(), t * self.rows);
        const BLOCK: usize = 16;
        let cols = self.cols;
        // Column-major partial results [rows, t], transposed at the end.
        let mut out_t = vec![0.0f32; self.rows * t];
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
        for r in 0..self.rows {
            for tt in 0..t {
                out[tt * self.rows + r] = out_t[r * t + tt];
            }
        }
    }
}
