//! Activations quantized to 8 bits per 32-value block, as llama.cpp does before every
//! quantized matmul: the integer dot products are exact and fast, and the results match the
//! reference engine's numerics closely.

use half::f16;

use crate::quant::BLOCK;

/// 32 activations as `d * qs[i]`, with `s = d * Σ qs` kept for the formats with an offset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ8 {
    /// Scale; rounded through f16 like the reference engine stores it.
    pub d: f32,
    /// `d * Σ qs`, rounded through f16.
    pub s: f32,
    /// Quantized values, each in -127..=127.
    pub qs: [i8; BLOCK],
    /// `Σ qs`, exact (kernels that bias weights to unsigned bytes subtract `128 · sum`).
    pub sum: i32,
}

impl BlockQ8 {
    pub const ZERO: BlockQ8 = BlockQ8 {
        d: 0.0,
        s: 0.0,
        qs: [0; BLOCK],
        sum: 0,
    };

    /// Quantizes one block of exactly [`BLOCK`] values.
    pub fn quantize(values: &[f32]) -> BlockQ8 {
        let amax = amax(values);
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let mut qs = [0i8; BLOCK];
        let mut sum = 0i32;
        for (q, v) in qs.iter_mut().zip(values) {
            *q = round_ties_even(v * id) as i8;
            sum += i32::from(*q);
        }
        let round = |x: f32| f16::from_f32(x).to_f32();
        BlockQ8 {
            d: round(d),
            s: round(d * sum as f32),
            qs,
            sum,
        }
    }
}

/// The largest `|v|` (0 for none), over eight independent lanes so that it vectorizes (a
/// single running `f32::max` is one long dependency chain). The maximum does not depend on
/// the order it is taken in.
fn amax(values: &[f32]) -> f32 {
    let larger = |m: f32, a: f32| if a > m { a } else { m };
    let mut lanes = [0.0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, v) in lanes.iter_mut().zip(c) {
            *m = larger(*m, v.abs());
        }
    }
    let lanes = lanes.into_iter().fold(0.0, larger);
    rest.iter().fold(lanes, |m, v| larger(m, v.abs()))
}

/// `v` rounded to the nearest integer, ties to even, for `|v| < 2^22` (activations scaled to
/// ±127): adding and removing 1.5·2^23 leaves no fraction bits. Plain arithmetic, so the
/// quantize loop vectorizes, where `f32::round` is a library call per value.
fn round_ties_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// A batch of activation rows, kept both as f32 (for float weights) and quantized (for
/// quantized weights). Rows have `cols` values, a whole number of blocks.
#[derive(Debug, Default)]
pub struct Activations {
    rows: usize,
    cols: usize,
    f32: Vec<f32>,
    q8: Vec<BlockQ8>,
}

impl Activations {
    /// Replaces the contents with `rows` rows of `cols` values taken from `values`, reusing the
    /// buffers (no allocation once they are large enough).
    ///
    /// # Panics
    /// When `cols` is not a multiple of [`BLOCK`] or `values.len() != rows * cols`.
    pub fn load(&mut self, values: &[f32], rows: usize, cols: usize) {
        assert_eq!(
            cols % BLOCK,
            0,
            "activation width {cols} is not whole blocks"
        );
        assert_eq!(values.len(), rows * cols, "activation shape");
        self.rows = rows;
        self.cols = cols;
        self.f32.clear();
        self.f32.extend_from_slice(values);
        self.q8.clear();
        self.q8
            .extend(values.chunks_exact(BLOCK).map(BlockQ8::quantize));
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `r` as f32 values.
    pub fn row_f32(&self, r: usize) -> &[f32] {
        &self.f32[r * self.cols..(r + 1) * self.cols]
    }

    /// Row `r` as quantized blocks.
    pub fn row_q8(&self, r: usize) -> &[BlockQ8] {
        let per_row = self.cols / BLOCK;
        &self.q8[r * per_row..(r + 1) * per_row]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_block_reconstructs_its_values() {
        let values: Vec<f32> = (0..BLOCK).map(|i| (i as f32 - 13.0) * 0.37).collect();
        let b = BlockQ8::quantize(&values);
        for (q, v) in b.qs.iter().zip(&values) {
            assert!((b.d * f32::from(*q) - v).abs() <= b.d * 0.51 + 1e-3);
        }
        let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
        assert_eq!(b.sum, sum);
        assert!((b.s - b.d * sum as f32).abs() < 1e-2);
    }

    #[test]
    fn rounding_is_to_nearest_ties_to_even() {
        for v in [-127.0, -2.5, -1.5, -0.5, 0.49, 0.5, 1.5, 2.5, 126.6, 127.0] {
            assert_eq!(round_ties_even(v), v.round_ties_even(), "{v}");
        }
    }

    #[test]
    fn the_lane_wise_maximum_is_the_plain_one() {
        for n in [0, 3, 8, 32, 37] {
            let values: Vec<f32> = (0..n).map(|i| ((i * 7919) % 61) as f32 - 30.5).collect();
            let plain = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(amax(&values).to_bits(), plain.to_bits(), "{n} values");
        }
    }

    #[test]
    fn a_zero_block_has_zero_scale() {
        assert_eq!(BlockQ8::quantize(&[0.0; BLOCK]), BlockQ8::ZERO);
    }
}
