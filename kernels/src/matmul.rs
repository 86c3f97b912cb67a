//! Matrix × activations for stored (possibly quantized) weight matrices.
//!
//! Threads split the weight rows, never the reduction: every output value is computed by the
//! same single dot product whatever the batch size or thread count, so results are
//! batch-invariant bit for bit (a request's output never depends on who it was batched with).

use crate::act::Activations;
use crate::packed::{GROUP, PackedMatrix};
use crate::pool::SharedOut;
use crate::quant::{DType, dequantize_row};
use crate::simd::Simd;
use crate::tile::tile;

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

    pub(crate) fn row(&self, r: usize) -> &'a [u8] {
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

/// The most activation rows computed together against one packed group of weight rows: a
/// decode batch of 8 reads each weight block once.
const TILE: usize = 8;

/// `out[t][r] = w.row(r) · x.row(t)` for every activation row `t`; `out` is `x.rows() × w.rows()`.
///
/// # Panics
/// When `x.cols() != w.cols()` or `out.len() != x.rows() * w.rows()`.
pub fn matmul(simd: Simd, w: &PackedMatrix, x: &Activations, out: &mut [f32]) {
    assert_eq!(x.cols(), w.cols(), "matmul inner dimension");
    assert_eq!(out.len(), x.rows() * w.rows(), "matmul output shape");
    let (n, m) = (x.rows(), w.rows());
    let out = SharedOut::new(out);
    let Some(format) = w.format() else {
        crate::pool::global().for_each(m, &|r| {
            for t in 0..n {
                let v = crate::dot::dot_float(w.dtype(), w.float_row(r), x.row_f32(t));
                // SAFETY: `t < n` and `r < m`, so the index is inside `out`; tasks own disjoint
                // rows, so no two threads write the same element, and `out` outlives the
                // parallel loop, which joins before `matmul` returns.
                unsafe { out.write(t * m + r, v) };
            }
        });
        return;
    };
    crate::pool::global().for_each(w.groups(), &|g| {
        let group = w.group(g);
        let rows = g * GROUP..((g + 1) * GROUP).min(m);
        // Tiles of 8, 4, 2 or 1 activation rows share each weight block's decoding; each value
        // is the same whatever the width (see `tile`).
        let mut t = 0;
        while t < n {
            let mut values = [[0.0; GROUP]; TILE];
            let rest = n - t;
            let xs = |j: usize| x.row_q8(t + j);
            let width = if rest >= 8 {
                values = tile::<8>(simd, format, group, std::array::from_fn(xs));
                8
            } else if rest >= 4 {
                let v = tile::<4>(simd, format, group, std::array::from_fn(xs));
                values[..4].copy_from_slice(&v);
                4
            } else if rest >= 2 {
                let v = tile::<2>(simd, format, group, std::array::from_fn(xs));
                values[..2].copy_from_slice(&v);
                2
            } else {
                [values[0]] = tile(simd, format, group, [xs(0)]);
                1
            };
            for (j, lanes) in values[..width].iter().enumerate() {
                for (r, &v) in rows.clone().zip(lanes) {
                    // SAFETY: `t + j < n` and `r < m`, so the index is inside `out`; tasks own
                    // disjoint groups of rows, so no two threads write the same element, and
                    // `out` outlives the parallel loop, which joins before `matmul` returns.
                    unsafe { out.write((t + j) * m + r, v) };
                }
            }
            t += width;
        }
    });
}

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
    fn results_do_not_depend_on_the_batch_or_the_level() {
        // 40 rows: two full groups and a partial one; 15 activation rows: tiles of 8, 4, 2, 1.
        const BATCH: usize = 15;
        let (rows, cols) = (40, 64);
        let wv = crate::test_values::uniform(rows * cols, 4, 1.0);
        let xs = crate::test_values::uniform(BATCH * cols, 8, 1.0);
        let mut batch = Activations::default();
        batch.load(&xs, BATCH, cols);
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::F16] {
            let data: Vec<u8> = wv
                .chunks(cols)
                .flat_map(|r| quantize_row(dtype, r))
                .collect();
            let w = PackedMatrix::from_bytes(dtype, rows, cols, &data).unwrap();
            let mut want = vec![0.0; BATCH * rows];
            matmul(Simd::PORTABLE, &w, &batch, &mut want);
            for simd in Simd::available() {
                let mut all = vec![0.0; BATCH * rows];
                matmul(simd, &w, &batch, &mut all);
                assert_eq!(all, want, "{dtype:?} {simd:?}");
                for t in 0..BATCH {
                    let mut one = Activations::default();
                    one.load(&xs[t * cols..(t + 1) * cols], 1, cols);
                    let mut alone = vec![0.0; rows];
                    matmul(simd, &w, &one, &mut alone);
                    assert_eq!(
                        alone,
                        all[t * rows..(t + 1) * rows],
                        "{dtype:?} {simd:?} row {t}"
                    );
                }
            }
        }
    }
}
