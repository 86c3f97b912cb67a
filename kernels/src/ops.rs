//! Element-wise and row-wise operations of the Llama block: RMSNorm, RoPE, SwiGLU, softmax.

/// `out = x / rms(x) * weight`, row by row (`weight.len()` values per row).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (row, o) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let scale = 1.0 / (mean_sq + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// Rotary position embedding in the interleaved-pair layout that GGUF Llama checkpoints use
/// (their Q/K weights are permuted for it): pair `(x[2i], x[2i+1])` of every head turns by
/// `pos * base^(-2i/head_dim)`.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, base: f32) -> Rope {
        let half = head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| base.powf(-2.0 * i as f32 / head_dim as f32))
            .collect();
        Rope { inv_freq }
    }

    /// `base^(-2i/head_dim)` for every pair `i` (what a device computes angles from).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    pub fn head_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// The (cos, sin) of every pair at position `pos`, written into `out` (`head_dim / 2`).
    pub fn angles(&self, pos: usize, out: &mut [(f32, f32)]) {
        for (o, f) in out.iter_mut().zip(&self.inv_freq) {
            let (s, c) = (pos as f32 * f).sin_cos();
            *o = (c, s);
        }
    }

    /// Rotates every head of `x` (a whole number of heads) by precomputed `angles`.
    pub fn apply(angles: &[(f32, f32)], x: &mut [f32]) {
        for head in x.chunks_exact_mut(angles.len() * 2) {
            for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(angles) {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * c - b * s;
                pair[1] = a * s + b * c;
            }
        }
    }
}

/// SwiGLU: `gate = silu(gate) * up`, in place.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// In-place softmax of one row.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `a += b`, element-wise (residual connections).
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    for (a, b) in a.iter_mut().zip(b) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_gives_unit_rms() {
        let x = [3.0, -4.0, 0.0, 5.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &[1.0; 4], 0.0, &mut out);
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_keeps_norms_and_relative_angles() {
        let rope = Rope::new(8, 10000.0);
        let mut a3 = [0.0; 4].map(|_| (0.0, 0.0));
        let mut a5 = a3;
        rope.angles(3, &mut a3);
        rope.angles(5, &mut a5);
        let q = [0.3, -1.0, 0.5, 0.25, 2.0, 0.1, -0.7, 0.9];
        let k = [1.0, 0.2, -0.4, 0.8, 0.0, 1.5, 0.3, -0.2];
        let (mut q3, mut k5) = (q, k);
        Rope::apply(&a3, &mut q3);
        Rope::apply(&a5, &mut k5);
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
        assert!((norm(&q3) - norm(&q)).abs() < 1e-5);
        // The score depends only on the distance: positions (3, 5) score like (0, 2).
        let mut a0 = a3;
        let mut a2 = a3;
        rope.angles(0, &mut a0);
        rope.angles(2, &mut a2);
        let (mut q0, mut k2) = (q, k);
        Rope::apply(&a0, &mut q0);
        Rope::apply(&a2, &mut k2);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        assert!((dot(&q3, &k5) - dot(&q0, &k2)).abs() < 1e-4);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0, 2.0, 3.0, -100.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0]);
    }
}
