//! Dot products of one float weight row (GGUF layout) with one f32 activation row. Only small
//! test models store float matrices, so these stay portable; the quantized formats go through
//! the packed kernels of [`crate::tile`].

use crate::quant::DType;

/// `w · x` with `w` stored as `dtype` (F32 or F16) and as long as `x`.
pub(crate) fn dot_float(dtype: DType, w: &[u8], x: &[f32]) -> f32 {
    match dtype {
        DType::F32 => w
            .chunks_exact(4)
            .zip(x)
            .map(|(b, x)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x)
            .sum(),
        DType::F16 => w
            .chunks_exact(2)
            .zip(x)
            .map(|(b, x)| half::f16::from_le_bytes([b[0], b[1]]).to_f32() * x)
            .sum(),
        DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => unreachable!("quantized rows are packed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{BLOCK, quantize_row};

    #[test]
    fn float_rows_dot_like_their_values() {
        let x = crate::test_values::uniform(2 * BLOCK, 1, 2.0);
        let w = crate::test_values::uniform(2 * BLOCK, 2, 2.0);
        let exact: f32 = x.iter().zip(&w).map(|(a, b)| a * b).sum();
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F16, 1e-2)] {
            let got = dot_float(dtype, &quantize_row(dtype, &w), &x);
            assert!((got - exact).abs() < tol, "{dtype:?}: {got} vs {exact}");
        }
    }
}
