//! The reference kernel: plain Rust over the packed layout.

use super::Format;
use crate::act::BlockQ8;
use crate::packed::{CHUNK, GROUP};
use crate::quant::{BLOCK, DType, read_f16};

pub(super) fn tile<const T: usize>(
    format: Format,
    group: &[u8],
    xs: [&[BlockQ8]; T],
) -> [[f32; GROUP]; T] {
    let bl = format.layout;
    let mut out = [[0.0f32; GROUP]; T];
    for (t, x) in xs.iter().enumerate() {
        for (lane, acc) in out[t].iter_mut().enumerate() {
            for (b, x) in x.iter().enumerate() {
                let blk = &group[b * bl.stride..(b + 1) * bl.stride];
                let byte = |i: usize| blk[bl.quants + (i / 4) * CHUNK + 4 * lane + i % 4];
                let d = read_f16(blk, 2 * lane);
                *acc += match format.dtype {
                    DType::Q8_0 => {
                        let i: i32 = (0..BLOCK)
                            .map(|i| i32::from((byte(i) ^ 0x80) as i8) * i32::from(x.qs[i]))
                            .sum();
                        d * x.d * i as f32
                    }
                    dtype => {
                        let i: i32 = (0..BLOCK / 2)
                            .map(|i| {
                                i32::from(byte(i) & 0x0f) * i32::from(x.qs[i])
                                    + i32::from(byte(i) >> 4) * i32::from(x.qs[i + BLOCK / 2])
                            })
                            .sum();
                        match bl.mins {
                            Some(mins) if dtype == DType::Q4_1 => {
                                d * x.d * i as f32 + read_f16(blk, mins + 2 * lane) * x.s
                            }
                            _ => d * (x.d * i as f32 - 8.0 * x.s),
                        }
                    }
                };
            }
        }
    }
    out
}
