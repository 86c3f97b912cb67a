//! The CUDA backend: the kernels of this crate on an NVIDIA GPU, through cudarc.
//!
//! ```text
//!  Device::open(DeviceSpec::Cuda { ordinal }, KernelSource)
//!    ├─ feature `cuda`: real.rs  libcuda (loaded at run time) → context → kernels.cu,
//!    │                           compiled by NVRTC or loaded as PTX built ahead of time
//!    └─ without it:     twin.rs  `CudaDevice::open` returns NotCompiledWithCuda
//! ```
//!
//! Both builds expose the same API (`CudaDevice`, `CudaBuf`, `DeviceMatrix`, `DeviceActs`,
//! `KvStep`); only the definitions are `#[cfg]`-gated. The twin's types are uninhabited, so its
//! methods cannot be reached and callers (the worker's CUDA forward pass) compile unchanged.
//!
//! No cuBLAS: the quantized matmuls are fused kernels that compute the CPU's integer block
//! dot products (so the CPU stays a close oracle), and the GPU machine then needs only the
//! driver — plus NVRTC, or a PTX file made here by `bulkhead cuda-ptx`.

mod error;
#[cfg_attr(
    not(feature = "cuda"),
    allow(
        dead_code,
        reason = "only the real backend plans steps; the twin never runs one"
    )
)]
mod step;

#[cfg(feature = "cuda")]
mod real;
#[cfg(not(feature = "cuda"))]
mod twin;
#[cfg(not(feature = "cuda"))]
use twin as real;

use std::path::PathBuf;

pub use error::DeviceError;
pub use real::{CudaBuf, CudaDevice, DeviceActs, DeviceKv, DeviceMatrix, KvStep, compile_ptx};
pub use step::StepSeq;

/// Every kernel the host loads from [`SOURCE`].
#[cfg(test)]
const KERNELS: [&str; 13] = [
    "rms_norm",
    "rope",
    "silu_mul",
    "add_assign",
    "quantize_q8",
    "matmul",
    "get_rows",
    "write_kv",
    "attend",
    "fill_u16",
    "gather_runs",
    "scatter_runs",
    "gather_rows",
];

/// The kernels' CUDA C source (self-contained: NVRTC needs no CUDA headers).
pub const SOURCE: &str = include_str!("kernels.cu");

/// NVRTC options; the PTX runs on compute capability 8.0 and later (the H200 is 9.0). FMA
/// contraction is off so float expressions round like the CPU's portable kernels.
pub const NVRTC_ARCH: &str = "compute_80";

/// The first line of a PTX file made by [`ptx_file_contents`]: names the source it came from,
/// so a PTX file from another version of the kernels is refused instead of run.
pub fn ptx_header() -> String {
    format!(
        "// bulkhead-kernels source fnv1a64 {:016x}",
        source_digest()
    )
}

/// FNV-1a (64 bits) of [`SOURCE`]: identifies the kernel version in PTX files.
pub fn source_digest() -> u64 {
    SOURCE.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A PTX file for these kernels: the header line, then the PTX NVRTC made.
pub fn ptx_file_contents(ptx: &str) -> String {
    format!("{}\n{ptx}", ptx_header())
}

/// Checks a PTX file's header against this build's kernels (and that it is text the driver
/// can take: no NUL byte).
pub fn check_ptx_file(path: &std::path::Path, text: &str) -> Result<(), DeviceError> {
    let first = text.lines().next().unwrap_or_default();
    if first != ptx_header() || text.contains('\0') {
        return Err(DeviceError::StalePtx {
            path: path.to_owned(),
            found: first.chars().take(80).collect(),
            want: ptx_header(),
        });
    }
    Ok(())
}

/// Where the CUDA kernels come from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum KernelSource {
    /// Compile [`SOURCE`] with NVRTC at startup (needs libnvrtc on the machine).
    #[default]
    Nvrtc,
    /// A PTX file made by `bulkhead cuda-ptx` from this same source (checked).
    Ptx(PathBuf),
}

/// Values that live in device buffers: plain data, every bit pattern valid, zero is zero.
pub trait DeviceValue: sealed::Sealed + Copy + Default + 'static {}

impl DeviceValue for f32 {}
impl DeviceValue for u8 {}
impl DeviceValue for i8 {}
impl DeviceValue for u16 {}
impl DeviceValue for i32 {}
impl DeviceValue for u32 {}
impl DeviceValue for u64 {}

mod sealed {
    /// The types above, and with the `cuda` feature what cudarc needs to move them.
    #[cfg(feature = "cuda")]
    pub trait Sealed: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
    #[cfg(not(feature = "cuda"))]
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u8 {}
    impl Sealed for i8 {}
    impl Sealed for u16 {}
    impl Sealed for i32 {}
    impl Sealed for u32 {}
    impl Sealed for u64 {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ptx_file_from_other_kernels_is_refused() {
        let path = std::path::Path::new("k.ptx");
        let good = ptx_file_contents(".version 9.0\n");
        assert_eq!(check_ptx_file(path, &good), Ok(()));
        let stale = ".version 9.0\n// bulkhead-kernels source fnv1a64 0000000000000000\n";
        assert!(matches!(
            check_ptx_file(path, stale),
            Err(DeviceError::StalePtx { .. })
        ));
        assert!(check_ptx_file(path, "").is_err());
        let with_nul = format!("{good}\0");
        assert!(check_ptx_file(path, &with_nul).is_err());
    }

    /// NVRTC accepts the source and emits every kernel (where libnvrtc is present; CI
    /// without it skips loudly, scripts/gpu-bundle runs the same compile).
    #[cfg(feature = "cuda")]
    #[test]
    fn nvrtc_compiles_every_kernel() {
        match compile_ptx() {
            Ok(ptx) => {
                for name in KERNELS {
                    assert!(
                        ptx.contains(&format!(".entry {name}(")),
                        "no {name} in the PTX"
                    );
                }
            }
            Err(DeviceError::NoNvrtc) => {
                eprintln!(
                    "SKIPPED nvrtc_compiles_every_kernel: {}",
                    DeviceError::NoNvrtc
                );
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn the_source_declares_every_kernel_the_host_loads() {
        for name in KERNELS {
            assert!(
                SOURCE.contains(&format!("__global__ void {name}(")),
                "kernels.cu has no kernel {name}"
            );
        }
    }
}
