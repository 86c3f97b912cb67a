//! Block-quantized tensor formats as GGUF stores them, and their dequantization.
//!
//! Every quantized format packs 32 consecutive values of a row into one block; a row is a
//! whole number of blocks. Layouts (little endian, as ggml writes them):
//!
//! | type | block bytes | layout | value |
//! |---|---|---|---|
//! | `Q4_0` | 18 | `d: f16, qs: [u8; 16]` | `d * (q - 8)` |
//! | `Q4_1` | 20 | `d: f16, m: f16, qs: [u8; 16]` | `d * q + m` |
//! | `Q8_0` | 34 | `d: f16, qs: [i8; 32]` | `d * q` |
//!
//! In the 4-bit formats, byte `j` holds value `j` in its low nibble and value `j + 16` in its
//! high nibble.

use half::f16;

/// Values per quantization block.
pub const BLOCK: usize = 32;

/// A tensor element type this engine can compute with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl DType {
    /// Values per block (1 for the float types).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => BLOCK,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q8_0 => 34,
        }
    }

    /// Bytes taken by `len` values, or `None` when `len` is not a whole number of blocks.
    pub const fn bytes_for(self, len: usize) -> Option<usize> {
        if !len.is_multiple_of(self.block_len()) {
            return None;
        }
        (len / self.block_len()).checked_mul(self.block_bytes())
    }
}

pub(crate) fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Dequantizes one row of `out.len()` values stored as `dtype` in `row`.
///
/// # Panics
/// When `row` is not exactly `dtype.bytes_for(out.len())` bytes long; callers hold a
/// [`crate::QMatrix`], whose constructor checked the sizes.
pub fn dequantize_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    assert_eq!(
        Some(row.len()),
        dtype.bytes_for(out.len()),
        "row size for {dtype:?}"
    );
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            let bb = dtype.block_bytes();
            for (o, b) in out.chunks_exact_mut(BLOCK).zip(row.chunks_exact(bb)) {
                let d = read_f16(b, 0);
                let (m, qs) = if dtype == DType::Q4_1 {
                    (read_f16(b, 2), &b[4..])
                } else {
                    (-8.0 * d, &b[2..])
                };
                for j in 0..BLOCK / 2 {
                    o[j] = d * f32::from(qs[j] & 0x0f) + m;
                    o[j + BLOCK / 2] = d * f32::from(qs[j] >> 4) + m;
                }
            }
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(BLOCK).zip(row.chunks_exact(34)) {
                let d = read_f16(b, 0);
                for (v, &q) in o.iter_mut().zip(&b[2..]) {
                    *v = d * f32::from(q as i8);
                }
            }
        }
    }
}

/// Quantizes `values` (a whole number of blocks) into `dtype`, the way ggml's reference
/// quantizers do. Used to write test models and to check the kernels.
///
/// # Panics
/// When `values.len()` is not a whole number of blocks.
pub fn quantize_row(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(dtype.bytes_for(values.len()).expect("whole blocks"));
    match dtype {
        DType::F32 => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::F16 => values
            .iter()
            .for_each(|v| out.extend(f16::from_f32(*v).to_le_bytes())),
        DType::Q4_0 => {
            for block in values.chunks_exact(BLOCK) {
                let max = block
                    .iter()
                    .copied()
                    .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend(f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                for j in 0..BLOCK / 2 {
                    out.push(q(block[j]) | (q(block[j + BLOCK / 2]) << 4));
                }
            }
        }
        DType::Q4_1 => {
            for block in values.chunks_exact(BLOCK) {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                for j in 0..BLOCK / 2 {
                    out.push(q(block[j]) | (q(block[j + BLOCK / 2]) << 4));
                }
            }
        }
        DType::Q8_0 => {
            for block in values.chunks_exact(BLOCK) {
                let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect()
    }

    #[test]
    fn every_format_round_trips_within_its_step() {
        let values = ramp(4 * BLOCK);
        for (dtype, tol) in [
            (DType::F32, 0.0),
            (DType::F16, 2e-3),
            (DType::Q8_0, 0.02),
            (DType::Q4_1, 0.14),
            (DType::Q4_0, 0.3),
        ] {
            let packed = quantize_row(dtype, &values);
            assert_eq!(Some(packed.len()), dtype.bytes_for(values.len()));
            let mut back = vec![0.0; values.len()];
            dequantize_row(dtype, &packed, &mut back);
            let err = values
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err <= tol, "{dtype:?}: max error {err} > {tol}");
        }
    }

    #[test]
    fn partial_blocks_have_no_size() {
        assert_eq!(DType::Q4_1.bytes_for(33), None);
        assert_eq!(DType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(DType::F16.bytes_for(3), Some(6));
    }
}
