//! Bulkhead's CPU compute kernels.
//!
//! The model code calls these through a small interface — [`matmul`] on a [`PackedMatrix`] with
//! [`Activations`], the ops of [`ops`], and [`attention`] over the paged KV pool — so that
//! faster implementations (more SIMD levels, another device) drop in behind it. Each SIMD
//! level is chosen at run time ([`Simd::best`]) and tested against the portable one.

pub mod act;
pub mod attention;
mod dot;
mod matmul;
pub mod ops;
mod packed;
pub mod pool;
pub mod quant;
mod simd;
mod tile;

pub use act::{Activations, BlockQ8};
pub use matmul::{QMatrix, ShapeError, matmul};
pub use packed::{GROUP, PackedMatrix};
pub use quant::DType;
pub use simd::Simd;

#[cfg(test)]
mod test_values;
