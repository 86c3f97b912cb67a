//! Test support shared by this crate's and the worker's tests: the CUDA device for the CUDA
//! half of a device test, or a loud skip.
//!
//! A test written once runs on the CPU always and, under the `cuda` feature, on CUDA device 0
//! when there is one. Where there is none, the CUDA half prints `SKIPPED the CUDA half of …`
//! with the reason (CI shows it: see .config/nextest.toml); with `BULKHEAD_REQUIRE_CUDA=1`
//! (scripts/gpu-check sets it) a missing device fails the test instead. Kernels come from
//! the PTX file `BULKHEAD_CUDA_PTX` when set, else from NVRTC.

use std::sync::OnceLock;

use crate::cuda::{CudaDevice, DeviceError, KernelSource};

/// Env: a PTX file made by `bulkhead cuda-ptx`, for machines without NVRTC.
pub const PTX_ENV: &str = "BULKHEAD_CUDA_PTX";
/// Env: `1` turns a skipped CUDA half into a failure.
pub const REQUIRE_ENV: &str = "BULKHEAD_REQUIRE_CUDA";

/// CUDA device 0 for the CUDA half of `test`, or `None` after saying loudly why it is skipped.
///
/// # Panics
/// When `BULKHEAD_REQUIRE_CUDA=1` and no device can be opened.
pub fn cuda_or_skip(test: &str) -> Option<CudaDevice> {
    static DEVICE: OnceLock<Result<CudaDevice, DeviceError>> = OnceLock::new();
    let opened = DEVICE.get_or_init(|| {
        let source = std::env::var_os(PTX_ENV)
            .map(|p| KernelSource::Ptx(p.into()))
            .unwrap_or_default();
        CudaDevice::open(0, &source)
    });
    match opened {
        Ok(dev) => Some(dev.clone()),
        Err(e) => {
            let required = std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1");
            assert!(!required, "{test}: {REQUIRE_ENV}=1 but no CUDA device: {e}");
            eprintln!("SKIPPED the CUDA half of {test}: {e}");
            None
        }
    }
}

/// Defines `$name::on_cpu` (every SIMD level) and, under the `cuda` feature, `$name::on_cuda`
/// from one `fn $name(dev: &Device) -> Result<(), DeviceError>` in scope.
/// `device_test!($name, cpu = best)` runs the CPU half at the best SIMD level only (for tests
/// too slow to repeat per level; the levels are compared elsewhere).
#[macro_export]
macro_rules! device_test {
    ($name:ident) => {
        $crate::device_test!(@define $name, $crate::Simd::available());
    };
    ($name:ident, cpu = best) => {
        $crate::device_test!(@define $name, [$crate::Simd::best()]);
    };
    (@define $name:ident, $levels:expr) => {
        mod $name {
            #[test]
            fn on_cpu() {
                for simd in $levels {
                    if let Err(e) = super::$name(&$crate::device::Device::Cpu(simd)) {
                        panic!("{simd:?}: {e}");
                    }
                }
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn on_cuda() {
                let test = concat!(module_path!(), "::on_cuda");
                if let Some(dev) = $crate::testing::cuda_or_skip(test) {
                    if let Err(e) = super::$name(&$crate::device::Device::Cuda(dev)) {
                        panic!("{e}");
                    }
                }
            }
        }
    };
}
