//! The matmul's inner kernel: one packed group of [`GROUP`] weight rows against `T`
//! activation rows, per SIMD level.
//!
//! Every level computes, for each (weight row, activation row) pair, the exact integer sum of
//! each block, then the same float operations in the same order as the portable kernel, with
//! no fused multiply-add: results are bit-identical across levels, tile widths and batches.
//! Per block, with `i` the block's integer sum, `x` the activation block and `d`, `m` the
//! weight block's scale and offset:
//!
//! | format | term added to the row's sum |
//! |---|---|
//! | Q4_0 | `d * (x.d * i - 8 * x.s)` |
//! | Q4_1 | `d * x.d * i + m * x.s` |
//! | Q8_0 | `d * x.d * i` |

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;

use crate::act::BlockQ8;
use crate::packed::{BlockLayout, GROUP};
use crate::quant::DType;
use crate::simd::{Level, Simd};

/// A quantized format's packed kernels: which format, and where its block parts lie.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Format {
    pub dtype: DType,
    pub layout: BlockLayout,
}

/// `out[t][r]` = row `r` of `group` · `xs[t]`. The caller guarantees that `group` holds
/// `xs[t].len()` packed blocks of `format` for every `t`.
pub(crate) fn tile<const T: usize>(
    simd: Simd,
    format: Format,
    group: &[u8],
    xs: [&[BlockQ8]; T],
) -> [[f32; GROUP]; T] {
    debug_assert!(
        xs.iter()
            .all(|x| x.len() * format.layout.stride == group.len())
    );
    match simd.level() {
        Level::Portable => portable::tile(format, group, xs),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Simd` of `Level::Avx2` is only obtained after run-time detection of its features
        // (see `simd.rs`); the sizes are guaranteed by the caller, as asserted above.
        Level::Avx2 => unsafe { avx2::tile(format, group, xs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for `Level::Avx512`.
        Level::Avx512 => unsafe { avx512::tile(format, group, xs) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::QMatrix;
    use crate::packed::PackedMatrix;
    use crate::quant::{BLOCK, quantize_row};

    fn q8(values: &[f32]) -> Vec<BlockQ8> {
        values.chunks_exact(BLOCK).map(BlockQ8::quantize).collect()
    }

    /// The plain dot product of the stored row with the activation blocks, term by term as
    /// the table in the module doc says.
    fn reference(dtype: DType, row: &[u8], x: &[BlockQ8]) -> f32 {
        let bb = dtype.block_bytes();
        let mut acc = 0.0f32;
        for (b, x) in row.chunks_exact(bb).zip(x) {
            let d = crate::quant::read_f16(b, 0);
            let (m, qs) = match dtype {
                DType::Q4_1 => (crate::quant::read_f16(b, 2), &b[4..]),
                _ => (0.0, &b[2..]),
            };
            let i: i32 = if dtype == DType::Q8_0 {
                qs.iter()
                    .zip(&x.qs)
                    .map(|(&q, &y)| i32::from(q as i8) * i32::from(y))
                    .sum()
            } else {
                (0..BLOCK / 2)
                    .map(|j| {
                        i32::from(qs[j] & 15) * i32::from(x.qs[j])
                            + i32::from(qs[j] >> 4) * i32::from(x.qs[j + 16])
                    })
                    .sum()
            };
            acc += match dtype {
                DType::Q4_0 => d * (x.d * i as f32 - 8.0 * x.s),
                DType::Q4_1 => d * x.d * i as f32 + m * x.s,
                _ => d * x.d * i as f32,
            };
        }
        acc
    }

    #[test]
    fn every_level_is_bit_identical_to_the_reference_in_every_lane() {
        let (rows, cols) = (GROUP, 6 * BLOCK);
        let xs: Vec<Vec<BlockQ8>> = (0..4)
            .map(|s| q8(&crate::test_values::uniform(cols, 20 + s, 2.5)))
            .collect();
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let values = crate::test_values::uniform(rows * cols, 3, 1.5);
            let data: Vec<u8> = values
                .chunks(cols)
                .flat_map(|r| quantize_row(dtype, r))
                .collect();
            let q = QMatrix::new(dtype, rows, cols, &data).unwrap();
            let p = PackedMatrix::pack(&q);
            let format = p.format().unwrap();
            let want: Vec<Vec<u32>> = xs
                .iter()
                .map(|x| {
                    (0..rows)
                        .map(|r| reference(dtype, q.row(r), x).to_bits())
                        .collect()
                })
                .collect();
            for simd in Simd::available() {
                let four: [[f32; GROUP]; 4] = tile(
                    simd,
                    format,
                    p.group(0),
                    std::array::from_fn(|t| &xs[t][..]),
                );
                for t in 0..4 {
                    assert_eq!(
                        four[t].map(f32::to_bits).to_vec(),
                        want[t],
                        "{dtype:?} {simd:?} x{t}"
                    );
                    let [one] = tile(simd, format, p.group(0), [&xs[t][..]]);
                    assert_eq!(
                        one.map(f32::to_bits).to_vec(),
                        want[t],
                        "{dtype:?} {simd:?} alone"
                    );
                }
            }
        }
    }
}
