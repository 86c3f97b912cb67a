//! AVX2: a 256-bit register holds a value for 8 of the group's rows, so each group is two
//! halves. `vpmaddubsw` multiplies unsigned weight bytes by signed activation bytes into i16
//! pairs, which stay far from saturation for 4-bit weights; Q8_0 weights are signed, so their
//! sign moves onto the activations first (|q| ≤ 128 keeps the pairs in range).

use std::arch::x86_64::*;

use super::Format;
use crate::act::BlockQ8;
use crate::packed::{CHUNK, GROUP};
use crate::quant::DType;

const HALF: usize = GROUP / 2;

/// # Safety
/// The CPU must support AVX2 and F16C; `group` holds `xs[t].len()` packed blocks of `format`
/// for every `t`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn tile<const T: usize>(
    format: Format,
    group: &[u8],
    xs: [&[BlockQ8]; T],
) -> [[f32; GROUP]; T] {
    let mut out = [[0.0f32; GROUP]; T];
    for h in 0..2 {
        // SAFETY: forwarded from the caller.
        let half = unsafe { half_tile(format, group, xs, h) };
        for t in 0..T {
            out[t][h * HALF..(h + 1) * HALF].copy_from_slice(&half[t]);
        }
    }
    out
}

/// Rows `8h..8h+8` of the group.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn half_tile<const T: usize>(
    format: Format,
    group: &[u8],
    xs: [&[BlockQ8]; T],
    h: usize,
) -> [[f32; HALF]; T] {
    let bl = format.layout;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    // Closures do not inherit `target_feature`, so the loops below are plain loops: the
    // intrinsics must inline into this function.
    //
    // SAFETY (for every load below): `blk` is one packed block: 16 f16 scales at 0, 16 f16
    // offsets at `mins` for Q4_1, then 4 (Q4) or 8 (Q8_0) chunks of 64 bytes from `quants`;
    // rows `8h..8h+8` are the 16 (scales) or 32 (quants) bytes at `h` times that; all loads are
    // unaligned.
    for b in 0..xs[0].len() {
        let blk = &group[b * bl.stride..(b + 1) * bl.stride];
        let at = |offset: usize| blk[offset..].as_ptr();
        let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(at(h * 16).cast())) };
        let mut ints = [_mm256_setzero_si256(); T];
        match format.dtype {
            DType::Q8_0 => {
                let (mut w, mut w_abs) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
                for j in 0..8 {
                    let raw =
                        unsafe { _mm256_loadu_si256(at(bl.quants + j * CHUNK + h * 32).cast()) };
                    w[j] = _mm256_xor_si256(raw, _mm256_set1_epi8(-128));
                    w_abs[j] = _mm256_sign_epi8(w[j], w[j]);
                }
                for t in 0..T {
                    let mut sum = _mm256_setzero_si256();
                    for j in 0..8 {
                        let y = _mm256_sign_epi8(broadcast(&xs[t][b], j), w[j]);
                        let pairs = _mm256_maddubs_epi16(w_abs[j], y);
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
                    }
                    ints[t] = sum;
                }
            }
            DType::Q4_0 | DType::Q4_1 => {
                let mask = _mm256_set1_epi8(0x0f);
                let (mut lo, mut hi) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
                for j in 0..4 {
                    let raw =
                        unsafe { _mm256_loadu_si256(at(bl.quants + j * CHUNK + h * 32).cast()) };
                    lo[j] = _mm256_and_si256(raw, mask);
                    hi[j] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                }
                for t in 0..T {
                    let x = &xs[t][b];
                    // Each i16 pair sum is at most 2·15·127; eight of them fit in an i16.
                    let mut pairs = _mm256_setzero_si256();
                    for j in 0..4 {
                        pairs =
                            _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo[j], broadcast(x, j)));
                        pairs = _mm256_add_epi16(
                            pairs,
                            _mm256_maddubs_epi16(hi[j], broadcast(x, j + 4)),
                        );
                    }
                    ints[t] = _mm256_madd_epi16(pairs, ones);
                }
            }
            DType::F32 | DType::F16 => unreachable!("float formats are not packed"),
        }
        let min = if let Some(m) = bl.mins {
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(at(m + h * 16).cast())) }
        } else {
            _mm256_setzero_ps()
        };
        for t in 0..T {
            let x = &xs[t][b];
            let i = _mm256_cvtepi32_ps(ints[t]);
            let term = match format.dtype {
                DType::Q4_1 => _mm256_add_ps(
                    _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d)), i),
                    _mm256_mul_ps(min, _mm256_set1_ps(x.s)),
                ),
                DType::Q4_0 => _mm256_mul_ps(
                    d,
                    _mm256_sub_ps(
                        _mm256_mul_ps(_mm256_set1_ps(x.d), i),
                        _mm256_set1_ps(8.0 * x.s),
                    ),
                ),
                _ => _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d)), i),
            };
            acc[t] = _mm256_add_ps(acc[t], term);
        }
    }
    let mut out = [[0.0f32; HALF]; T];
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: `o` holds 8 f32.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), a) };
    }
    out
}

/// Activation bytes `4j..4j+4` of `x`, in every lane.
#[inline]
#[target_feature(enable = "avx2")]
fn broadcast(x: &BlockQ8, j: usize) -> __m256i {
    let four = [
        x.qs[4 * j],
        x.qs[4 * j + 1],
        x.qs[4 * j + 2],
        x.qs[4 * j + 3],
    ];
    _mm256_set1_epi32(i32::from_le_bytes(four.map(|b| b as u8)))
}
