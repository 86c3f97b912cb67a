//! Deterministic test inputs shared by the kernels' unit tests.

/// `n` values spread over `[-amplitude, amplitude)` by a linear congruential generator: the
/// same `seed` always gives the same values, on every machine.
pub fn uniform(n: usize, seed: u32, amplitude: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            ((s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * amplitude
        })
        .collect()
}
