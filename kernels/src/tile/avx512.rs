//! AVX-512 with VNNI: one 512-bit register holds a value for each of the group's 16 rows.
//! `vpdpbusd` multiplies 4 unsigned weight bytes by 4 signed activation bytes per lane and
//! adds them to the lane's i32, so each chunk of a block costs one instruction per activation
//! row, its 4 activation bytes broadcast to every lane.

use std::arch::x86_64::*;

use super::Format;
use crate::act::BlockQ8;
use crate::packed::{CHUNK, GROUP};
use crate::quant::DType;

/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `group` holds `xs[t].len()` packed blocks of
/// `format` for every `t`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile<const T: usize>(
    format: Format,
    group: &[u8],
    xs: [&[BlockQ8]; T],
) -> [[f32; GROUP]; T] {
    let bl = format.layout;
    let blocks = xs[0].len();
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..blocks {
        let blk = &group[b * bl.stride..(b + 1) * bl.stride];
        // SAFETY: `blk` is one packed block: 16 f16 scales at 0, 16 f16 offsets at `mins` for
        // Q4_1, then 4 (Q4) or 8 (Q8_0) chunks of 64 bytes from
        // `quants`; all loads are unaligned.
        let d = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(blk.as_ptr().cast())) };
        // Closures do not inherit `target_feature`, so the loops below are plain loops: the
        // intrinsics must inline into this function.
        let mut ints = [_mm512_setzero_si512(); T];
        match format.dtype {
            DType::Q8_0 => {
                let mut w = [_mm512_setzero_si512(); 8];
                for (j, w) in w.iter_mut().enumerate() {
                    // SAFETY: as above.
                    *w =
                        unsafe { _mm512_loadu_si512(blk[bl.quants + j * CHUNK..].as_ptr().cast()) };
                }
                for t in 0..T {
                    let x = &xs[t][b];
                    // Σ (q + 128)·y = Σ q·y + 128·Σ y.
                    let (mut even, mut odd) =
                        (_mm512_set1_epi32(-128 * x.sum), _mm512_setzero_si512());
                    for j in (0..8).step_by(2) {
                        even = _mm512_dpbusd_epi32(even, w[j], broadcast(x, j));
                        odd = _mm512_dpbusd_epi32(odd, w[j + 1], broadcast(x, j + 1));
                    }
                    ints[t] = _mm512_add_epi32(even, odd);
                }
            }
            DType::Q4_0 | DType::Q4_1 => {
                let mask = _mm512_set1_epi8(0x0f);
                let (mut lo, mut hi) = ([_mm512_setzero_si512(); 4], [_mm512_setzero_si512(); 4]);
                for j in 0..4 {
                    // SAFETY: as above.
                    let raw =
                        unsafe { _mm512_loadu_si512(blk[bl.quants + j * CHUNK..].as_ptr().cast()) };
                    lo[j] = _mm512_and_si512(raw, mask);
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                }
                for t in 0..T {
                    let x = &xs[t][b];
                    let (mut l, mut h) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    for j in 0..4 {
                        l = _mm512_dpbusd_epi32(l, lo[j], broadcast(x, j));
                        h = _mm512_dpbusd_epi32(h, hi[j], broadcast(x, j + 4));
                    }
                    ints[t] = _mm512_add_epi32(l, h);
                }
            }
            DType::F32 | DType::F16 => unreachable!("float formats are not packed"),
        }
        let min = if let Some(at) = bl.mins {
            // SAFETY: as above.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(blk[at..].as_ptr().cast())) }
        } else {
            _mm512_setzero_ps()
        };
        for t in 0..T {
            let x = &xs[t][b];
            let i = _mm512_cvtepi32_ps(ints[t]);
            let term = match format.dtype {
                DType::Q4_1 => _mm512_add_ps(
                    _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.d)), i),
                    _mm512_mul_ps(min, _mm512_set1_ps(x.s)),
                ),
                DType::Q4_0 => _mm512_mul_ps(
                    d,
                    _mm512_sub_ps(
                        _mm512_mul_ps(_mm512_set1_ps(x.d), i),
                        _mm512_set1_ps(8.0 * x.s),
                    ),
                ),
                _ => _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.d)), i),
            };
            acc[t] = _mm512_add_ps(acc[t], term);
        }
    }
    let mut out = [[0.0f32; GROUP]; T];
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: `o` holds 16 f32.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
    }
    out
}

/// Activation bytes `4j..4j+4` of `x`, in every lane.
#[inline]
#[target_feature(enable = "avx512f")]
fn broadcast(x: &BlockQ8, j: usize) -> __m512i {
    let four = [
        x.qs[4 * j],
        x.qs[4 * j + 1],
        x.qs[4 * j + 2],
        x.qs[4 * j + 3],
    ];
    _mm512_set1_epi32(i32::from_le_bytes(four.map(|b| b as u8)))
}
