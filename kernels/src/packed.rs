//! Weight matrices laid out once, at load, for the matmul kernels.
//!
//! GGUF stores a quantized matrix row by row, each row a run of blocks. The kernels instead
//! compute [`GROUP`] output rows at once, one per SIMD lane, so the packed layout interleaves
//! each group's rows block by block:
//!
//! ```text
//! group ─┬─ block 0 ─┬─ d: [f16; 16]            scale of each row's block
//!        │           ├─ m: [f16; 16]            Q4_1 only: offset of each row's block
//!        │           └─ quants: chunks of 64 bytes; in chunk j, bytes 4r..4r+4 are row r's
//!        │              stored bytes 4j..4j+4
//!        └─ block 1 …
//! ```
//!
//! For the 4-bit formats the stored bytes keep their nibbles (value `i` low, `i + 16` high),
//! so chunk j holds values `4j..4j+4` in its low nibbles and `16+4j..16+4j+4` in its high
//! ones: 4 chunks per block. Q8_0 has 8 chunks per block and stores `q + 128` as an unsigned
//! byte (the VNNI instructions multiply unsigned by signed bytes). Rows past the matrix's end
//! in the last group are zero blocks.
//!
//! Float matrices (F32, F16) keep GGUF's row-major layout.

use crate::matmul::{QMatrix, ShapeError};
use crate::quant::{BLOCK, DType, read_f16};
use crate::tile::Format;

/// Output rows computed together: one per 32-bit lane of a 512-bit register.
pub const GROUP: usize = 16;
/// Bytes of one chunk of quants: 4 bytes for each row of a group.
pub(crate) const CHUNK: usize = 4 * GROUP;

/// An owned weight matrix in the layout its kernels read.
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    dtype: DType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

/// Where the parts of one packed block start, relative to the block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockLayout {
    /// Offset of the 16 offsets `m` (Q4_1), if the format has them.
    pub mins: Option<usize>,
    /// Offset of the first chunk of quants.
    pub quants: usize,
    /// Bytes per packed block (all 16 rows).
    pub stride: usize,
}

impl BlockLayout {
    /// The packed layout of `dtype`, if it is a quantized format.
    pub(crate) const fn of(dtype: DType) -> Option<BlockLayout> {
        let scales = 2 * GROUP;
        match dtype {
            DType::F32 | DType::F16 => None,
            DType::Q4_0 => Some(BlockLayout {
                mins: None,
                quants: scales,
                stride: scales + 4 * CHUNK,
            }),
            DType::Q4_1 => Some(BlockLayout {
                mins: Some(scales),
                quants: 2 * scales,
                stride: 2 * scales + 4 * CHUNK,
            }),
            DType::Q8_0 => Some(BlockLayout {
                mins: None,
                quants: scales,
                stride: scales + 8 * CHUNK,
            }),
        }
    }
}

impl PackedMatrix {
    /// Packs `m` for the kernels (a copy; `m`'s bytes are no longer needed afterwards).
    pub fn pack(m: &QMatrix<'_>) -> PackedMatrix {
        let (dtype, rows, cols) = (m.dtype(), m.rows(), m.cols());
        let Some(bl) = BlockLayout::of(dtype) else {
            return PackedMatrix {
                dtype,
                rows,
                cols,
                data: m.bytes().to_vec(),
            };
        };
        let blocks = cols / BLOCK;
        let groups = rows.div_ceil(GROUP);
        let bb = dtype.block_bytes();
        let mut data = vec![0u8; groups * blocks * bl.stride];
        for r in 0..rows {
            let (g, lane) = (r / GROUP, r % GROUP);
            let row = m.row(r);
            for (b, src) in row.chunks_exact(bb).enumerate() {
                let at = (g * blocks + b) * bl.stride;
                let dst = &mut data[at..at + bl.stride];
                dst[2 * lane..2 * lane + 2].copy_from_slice(&src[..2]);
                let qs = match bl.mins {
                    Some(mins) => {
                        dst[mins + 2 * lane..mins + 2 * lane + 2].copy_from_slice(&src[2..4]);
                        &src[4..]
                    }
                    None => &src[2..],
                };
                for (j, four) in qs.chunks_exact(4).enumerate() {
                    let to = bl.quants + j * CHUNK + 4 * lane;
                    let out = &mut dst[to..to + 4];
                    out.copy_from_slice(four);
                    if dtype == DType::Q8_0 {
                        out.iter_mut().for_each(|q| *q ^= 0x80);
                    }
                }
            }
        }
        PackedMatrix {
            dtype,
            rows,
            cols,
            data,
        }
    }

    /// Packs `rows × cols` values stored as `dtype` in `data` (checked like [`QMatrix::new`]).
    pub fn from_bytes(
        dtype: DType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<PackedMatrix, ShapeError> {
        Ok(PackedMatrix::pack(&QMatrix::new(dtype, rows, cols, data)?))
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

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.data.len()
    }

    /// The packed block layout, for the quantized formats.
    pub(crate) fn block_layout(&self) -> Option<BlockLayout> {
        BlockLayout::of(self.dtype)
    }

    /// The kernels' view of the format, for the quantized formats.
    pub(crate) fn format(&self) -> Option<Format> {
        Some(Format {
            dtype: self.dtype,
            layout: self.block_layout()?,
        })
    }

    /// Row `r` of a float matrix, in GGUF's layout.
    pub(crate) fn float_row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    fn row_bytes(&self) -> usize {
        self.dtype.block_bytes() * (self.cols / self.dtype.block_len())
    }

    /// The packed bytes of group `g` (all its blocks), for the quantized formats.
    pub(crate) fn group(&self, g: usize) -> &[u8] {
        let bl = self.block_layout().expect("quantized");
        let len = (self.cols / BLOCK) * bl.stride;
        &self.data[g * len..(g + 1) * len]
    }

    /// Output row groups (quantized formats).
    pub(crate) fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Dequantizes row `r` into `out` (`cols` values), e.g. an embedding lookup.
    ///
    /// # Panics
    /// When `r >= rows` or `out.len() != cols`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        assert_eq!(out.len(), self.cols, "row length");
        let Some(bl) = self.block_layout() else {
            crate::quant::dequantize_row(self.dtype, self.float_row(r), out);
            return;
        };
        let (g, lane) = (r / GROUP, r % GROUP);
        let group = self.group(g);
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
            let blk = &group[b * bl.stride..(b + 1) * bl.stride];
            let d = read_f16(blk, 2 * lane);
            let byte = |i: usize| blk[bl.quants + (i / 4) * CHUNK + 4 * lane + i % 4];
            match self.dtype {
                DType::Q8_0 => {
                    for (i, v) in o.iter_mut().enumerate() {
                        *v = d * f32::from((byte(i) ^ 0x80) as i8);
                    }
                }
                _ => {
                    let m = match bl.mins {
                        Some(mins) => read_f16(blk, mins + 2 * lane),
                        None => -8.0 * d,
                    };
                    for i in 0..BLOCK / 2 {
                        o[i] = d * f32::from(byte(i) & 0x0f) + m;
                        o[i + BLOCK / 2] = d * f32::from(byte(i) >> 4) + m;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    #[test]
    fn packed_rows_dequantize_like_the_stored_rows() {
        let (rows, cols) = (21, 3 * BLOCK);
        let values = crate::test_values::uniform(rows * cols, 9, 3.0);
        for dtype in [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
            DType::F16,
            DType::F32,
        ] {
            let data: Vec<u8> = values
                .chunks(cols)
                .flat_map(|r| quantize_row(dtype, r))
                .collect();
            let q = QMatrix::new(dtype, rows, cols, &data).unwrap();
            let p = PackedMatrix::pack(&q);
            for r in 0..rows {
                let (mut want, mut got) = (vec![0.0; cols], vec![0.0; cols]);
                q.dequantize_row(r, &mut want);
                p.dequantize_row(r, &mut got);
                assert_eq!(want, got, "{dtype:?} row {r}");
            }
        }
    }
}
