//! Bulkhead's compute kernels: the CPU reference and, under the `cuda` feature, CUDA.
//!
//! The model code calls these through a small interface — [`matmul`] on a [`PackedMatrix`] with
//! [`Activations`], the ops of [`ops`], and [`attention`] over the paged KV pool — so that
//! faster implementations (more SIMD levels, another device) drop in behind it. Each SIMD
//! level is chosen at run time ([`Simd::best`]) and tested against the portable one; the CUDA
//! kernels ([`cuda`]) are tested against the CPU ([`device_test!`]).

pub mod act;
pub mod attention;
pub mod cuda;
pub mod device;
mod dot;
mod matmul;
pub mod ops;
mod packed;
pub mod pool;
pub mod quant;
mod simd;
pub mod testing;
mod tile;

pub use act::{Activations, BlockQ8};
pub use cuda::DeviceError;
pub use device::{Device, DeviceSpec};
pub use matmul::{QMatrix, ShapeError, matmul};
pub use packed::{GROUP, PackedMatrix};
pub use quant::DType;
pub use simd::Simd;

#[cfg(test)]
mod device_tests;
#[cfg(test)]
mod test_values;
