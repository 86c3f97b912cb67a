//! Matrix × activations for stored (possibly quantized) weight matrices.
//!
//! Threads split the weight rows, never the reduction: every output value is computed by the
//! same single dot product whatever the batch size or thread count, so results are
//! batch-invariant bit for bit (a request's output never depends on who it was batched with).

use rayon::prelude::*;

use crate::act::Activations;
use crate::dot::dot_rows;
use crate::quant::{DType, dequantize_row};
use crate::simd::Simd;

/// A borrowed `rows × cols` weight matrix stored row-major as `dtype`. The constructor checks
/// that the bytes are exactly the matrix, so kernels index it without further checks.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    dtype: DType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: &'a [u8],
}

/// Why bytes cannot be viewed as a matrix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShapeError {
    #[error("a row of {cols} values is not a whole number of {dtype:?} blocks")]
    PartialBlock { dtype: DType, cols: usize },
    #[error("{rows}×{cols} {dtype:?} needs {expected} bytes, got {actual}")]
    Size {
        dtype: DType,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
}

impl<'a> QMatrix<'a> {
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, ShapeError> {
        let row_bytes = dtype
            .bytes_for(cols)
            .ok_or(ShapeError::PartialBlock { dtype, cols })?;
        let expected = row_bytes.checked_mul(rows);
        if expected != Some(data.len()) {
            return Err(ShapeError::Size {
                dtype,
                rows,
                cols,
                expected: expected.unwrap_or(usize::MAX),
                actual: data.len(),
            });
        }
        Ok(QMatrix {
            dtype,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes of one stored row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }
    /// The stored rows, one after another (`rows × row_bytes` bytes).
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }

    fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Dequantizes row `r` into `out` (`cols` values), e.g. an embedding lookup.
    ///
    /// # Panics
    /// When `r >= rows` or `out.len() != cols`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.dtype, self.row(r), out);
    }
}

/// Rows of the weight matrix handled by one parallel task.
const ROWS_PER_TASK: usize = 16;
/// Activation rows computed together against one weight row.
const TILE: usize = 4;

/// `out[t][r] = w.row(r) · x.row(t)` for every activation row `t`; `out` is `x.rows() × w.rows()`.
///
/// # Panics
/// When `x.cols() != w.cols()` or `out.len() != x.rows() * w.rows()`.
pub fn matmul(simd: Simd, w: &QMatrix<'_>, x: &Activations, out: &mut [f32]) {
    assert_eq!(x.cols(), w.cols(), "matmul inner dimension");
    assert_eq!(out.len(), x.rows() * w.rows(), "matmul output shape");
    let n = x.rows();
    let m = w.rows();
    let out = SharedOut(out.as_mut_ptr());
    let act = |t: usize| (x.row_f32(t), x.row_q8(t));
    (0..m.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .for_each(|task| {
            let rows = task * ROWS_PER_TASK..((task + 1) * ROWS_PER_TASK).min(m);
            // Tiles of TILE activation rows share each weight block's decoding; the remainder goes
            // one row at a time. Either way each value is the same (see `dot_rows`).
            let mut t = 0;
            while t < n {
                let width = if n - t >= TILE { TILE } else { 1 };
                for r in rows.clone() {
                    let mut values = [0.0; TILE];
                    if width == TILE {
                        values =
                            dot_rows(simd, w.dtype, w.row(r), std::array::from_fn(|j| act(t + j)));
                    } else {
                        [values[0]] = dot_rows(simd, w.dtype, w.row(r), [act(t)]);
                    }
                    for (j, &v) in values[..width].iter().enumerate() {
                        // SAFETY: `t + j < n` and `r < m`, so the index is inside `out`; tasks own
                        // disjoint row ranges, so no two threads write the same element, and `out`
                        // outlives the parallel loop, which joins before `matmul` returns.
                        unsafe { out.write((t + j) * m + r, v) };
                    }
                }
                t += width;
            }
        });
}

/// The output pointer shared by the matmul tasks, each writing its own elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

impl SharedOut {
    /// # Safety
    /// `at` is in bounds of the output slice, which is alive, and no other thread accesses
    /// element `at` concurrently.
    unsafe fn write(self, at: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { self.0.add(at).write(v) }
    }
}
// SAFETY: tasks write disjoint elements (see `matmul`).
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    #[test]
    fn a_short_buffer_is_a_shape_error_not_a_panic() {
        let err = QMatrix::new(DType::Q4_1, 2, 64, &[0; 79]).unwrap_err();
        assert_eq!(
            err,
            ShapeError::Size {
                dtype: DType::Q4_1,
                rows: 2,
                cols: 64,
                expected: 80,
                actual: 79
            }
        );
        assert!(QMatrix::new(DType::Q8_0, 2, 48, &[]).is_err());
    }

    #[test]
    fn results_do_not_depend_on_the_batch() {
        let cols = 64;
        let rows = 40;
        let wv: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 113) as f32 / 50.0 - 1.0)
            .collect();
        let data: Vec<u8> = wv
            .chunks(cols)
            .flat_map(|r| quantize_row(DType::Q4_1, r))
            .collect();
        let w = QMatrix::new(DType::Q4_1, rows, cols, &data).unwrap();
        let xs: Vec<f32> = (0..5 * cols)
            .map(|i| ((i * 31) % 17) as f32 / 8.0 - 1.0)
            .collect();
        let mut batch = Activations::default();
        batch.load(&xs, 5, cols);
        let mut all = vec![0.0; 5 * rows];
        matmul(Simd::best(), &w, &batch, &mut all);
        for t in 0..5 {
            let mut one = Activations::default();
            one.load(&xs[t * cols..(t + 1) * cols], 1, cols);
            let mut alone = vec![0.0; rows];
            matmul(Simd::best(), &w, &one, &mut alone);
            assert_eq!(alone, all[t * rows..(t + 1) * rows], "row {t}");
        }
    }
}
