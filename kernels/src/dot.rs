//! Dot products of one stored weight row with one activation row, per format and per SIMD
//! level. Every SIMD path computes exactly the integer sums of the portable one; only the
//! float accumulation order may differ, and each path is tested against the portable one.

use crate::act::BlockQ8;
use crate::quant::{BLOCK, DType, read_f16};
use crate::simd::Simd;

/// One activation row, as f32 and as Q8 blocks.
pub(crate) type ActRow<'a> = (&'a [f32], &'a [BlockQ8]);

/// `w_row · x` for each of `N` activation rows, with `w_row` stored as `dtype`. The caller
/// guarantees matching lengths (see [`crate::QMatrix`]).
///
/// Each lane's result is bit-identical to `dot_rows::<1>` of that row alone: the SIMD paths
/// share the weight decoding across lanes but run every lane's arithmetic in the same order,
/// which keeps matmuls batch-invariant.
pub(crate) fn dot_rows<const N: usize>(
    simd: Simd,
    dtype: DType,
    w_row: &[u8],
    xs: [ActRow<'_>; N],
) -> [f32; N] {
    match (dtype, simd) {
        (DType::F32, _) => xs.map(|(x, _)| portable::dot_f32(w_row, x)),
        (DType::F16, _) => xs.map(|(x, _)| portable::dot_f16(w_row, x)),
        (DType::Q4_0, Simd::Portable) => xs.map(|(_, x)| portable::dot_q4_0(w_row, x)),
        (DType::Q4_1, Simd::Portable) => xs.map(|(_, x)| portable::dot_q4_1(w_row, x)),
        (DType::Q8_0, Simd::Portable) => xs.map(|(_, x)| portable::dot_q8_0(w_row, x)),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Simd::Avx2` is only constructed after run-time detection of AVX2 and FMA
        // (see `simd.rs`).
        (DType::Q4_0, Simd::Avx2) => unsafe { avx2::dot_q4(w_row, xs.map(|(_, x)| x), false) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (DType::Q4_1, Simd::Avx2) => unsafe { avx2::dot_q4(w_row, xs.map(|(_, x)| x), true) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (DType::Q8_0, Simd::Avx2) => unsafe { avx2::dot_q8_0(w_row, xs.map(|(_, x)| x)) },
    }
}

mod portable {
    use super::*;

    pub fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
        w.chunks_exact(4)
            .zip(x)
            .map(|(b, x)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x)
            .sum()
    }

    pub fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
        w.chunks_exact(2)
            .zip(x)
            .map(|(b, x)| half::f16::from_le_bytes([b[0], b[1]]).to_f32() * x)
            .sum()
    }

    /// Σ q·y over one 4-bit block, q unsigned 0..=15.
    fn nibble_dot(qs: &[u8], y: &[i8; BLOCK]) -> i32 {
        let mut acc = 0i32;
        for j in 0..BLOCK / 2 {
            acc += i32::from(qs[j] & 0x0f) * i32::from(y[j]);
            acc += i32::from(qs[j] >> 4) * i32::from(y[j + BLOCK / 2]);
        }
        acc
    }

    pub fn dot_q4_0(w: &[u8], x: &[BlockQ8]) -> f32 {
        w.chunks_exact(18)
            .zip(x)
            .map(|(b, x)| read_f16(b, 0) * (x.d * nibble_dot(&b[2..], &x.qs) as f32 - 8.0 * x.s))
            .sum()
    }

    pub fn dot_q4_1(w: &[u8], x: &[BlockQ8]) -> f32 {
        w.chunks_exact(20)
            .zip(x)
            .map(|(b, x)| {
                read_f16(b, 0) * x.d * nibble_dot(&b[4..], &x.qs) as f32 + read_f16(b, 2) * x.s
            })
            .sum()
    }

    pub fn dot_q8_0(w: &[u8], x: &[BlockQ8]) -> f32 {
        w.chunks_exact(34)
            .zip(x)
            .map(|(b, x)| {
                let acc: i32 = b[2..]
                    .iter()
                    .zip(&x.qs)
                    .map(|(&q, &y)| i32::from(q as i8) * i32::from(y))
                    .sum();
                read_f16(b, 0) * x.d * acc as f32
            })
            .sum()
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::*;

    /// Horizontal sum of eight f32 lanes.
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Σ q·y of 32 unsigned bytes with 32 signed bytes, as eight i32 lanes converted to f32.
    #[target_feature(enable = "avx2,fma")]
    fn udot(q: __m256i, y: __m256i) -> __m256 {
        let pairs = _mm256_maddubs_epi16(q, y);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    /// 4-bit rows: Q4_1 (`with_min`) or Q4_0, against `N` activation rows.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q4<const N: usize>(
        w: &[u8],
        xs: [&[BlockQ8]; N],
        with_min: bool,
    ) -> [f32; N] {
        let (bb, qoff) = if with_min { (20, 4) } else { (18, 2) };
        let mask = _mm256_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut offset_sum = [0.0f32; N];
        for (blk, b) in w.chunks_exact(bb).enumerate() {
            let qs = &b[qoff..qoff + 16];
            // SAFETY: `qs` is 16 bytes long; unaligned load.
            let raw = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
            let q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(raw), raw), mask);
            let d = read_f16(b, 0);
            let m = if with_min { read_f16(b, 2) } else { -8.0 * d };
            for j in 0..N {
                let x = &xs[j][blk];
                // SAFETY: `x.qs` is 32 bytes long; unaligned load.
                let y = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), udot(q, y), acc[j]);
                offset_sum[j] += m * x.s;
            }
        }
        std::array::from_fn(|j| hsum(acc[j]) + offset_sum[j])
    }

    /// Q8_0 rows against `N` activation rows.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q8_0<const N: usize>(w: &[u8], xs: [&[BlockQ8]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        for (blk, b) in w.chunks_exact(34).enumerate() {
            // SAFETY: `b[2..]` is 32 bytes long; unaligned load.
            let q = unsafe { _mm256_loadu_si256(b[2..].as_ptr().cast()) };
            // maddubs wants an unsigned left side: move q's sign onto y.
            let q_abs = _mm256_sign_epi8(q, q);
            let d = read_f16(b, 0);
            for j in 0..N {
                let x = &xs[j][blk];
                // SAFETY: `x.qs` is 32 bytes long; unaligned load.
                let y = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
                let prod = udot(q_abs, _mm256_sign_epi8(y, q));
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), prod, acc[j]);
            }
        }
        std::array::from_fn(|j| hsum(acc[j]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        crate::test_values::uniform(n, seed, 2.0)
    }

    #[test]
    fn every_simd_path_matches_the_portable_one() {
        let n = 8 * BLOCK;
        let x = values(n, 1);
        let xq: Vec<BlockQ8> = x.chunks_exact(BLOCK).map(BlockQ8::quantize).collect();
        let x2 = values(n, 11);
        let xq2: Vec<BlockQ8> = x2.chunks_exact(BLOCK).map(BlockQ8::quantize).collect();
        for dtype in [
            DType::F32,
            DType::F16,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
        ] {
            let w = quantize_row(dtype, &values(n, 7));
            let [want] = dot_rows(Simd::Portable, dtype, &w, [(&x, &xq)]);
            for simd in Simd::available() {
                let [got] = dot_rows(simd, dtype, &w, [(&x, &xq)]);
                assert!(
                    (got - want).abs() <= 1e-3 * want.abs().max(1.0),
                    "{dtype:?} {simd:?}: {got} vs {want}"
                );
                // Each lane of a multi-row call equals the single-row call bit for bit.
                let [one] = dot_rows(simd, dtype, &w, [(&x2, &xq2)]);
                let lanes = dot_rows(simd, dtype, &w, [(&x2, &xq2), (&x, &xq), (&x2, &xq2)]);
                assert_eq!(
                    lanes.map(f32::to_bits),
                    [one, got, one].map(f32::to_bits),
                    "{dtype:?} {simd:?}"
                );
            }
        }
    }

    #[test]
    fn quantized_dot_is_close_to_the_float_dot_of_the_stored_weights() {
        let n = 16 * BLOCK;
        let x = values(n, 3);
        let xq: Vec<BlockQ8> = x.chunks_exact(BLOCK).map(BlockQ8::quantize).collect();
        for dtype in [DType::Q8_0, DType::Q4_1, DType::Q4_0] {
            let w = quantize_row(dtype, &values(n, 5));
            let mut stored = vec![0.0; n];
            crate::quant::dequantize_row(dtype, &w, &mut stored);
            let exact: f32 = x.iter().zip(&stored).map(|(a, b)| a * b).sum();
            // Only the activations' 8-bit rounding separates the two.
            let [got] = dot_rows(Simd::Portable, dtype, &w, [(&x, &xq)]);
            assert!((got - exact).abs() < 0.3, "{dtype:?}: {got} vs {exact}");
        }
    }
}
