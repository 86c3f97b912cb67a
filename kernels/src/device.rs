//! Where the kernels run: the CPU (the reference, at a SIMD level) or a CUDA device.
//!
//! `--device cpu|cuda|cuda:N` parses into a [`DeviceSpec`]; [`Device::open`] turns it into a
//! [`Device`] at startup, so a build or machine without CUDA fails before any work with an
//! error that says why and what to do instead.

use std::fmt;
use std::str::FromStr;

use crate::cuda::{CudaDevice, DeviceError, KernelSource};
use crate::simd::Simd;

/// The device a process was asked to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The CPU, at the best SIMD level it supports.
    #[default]
    Cpu,
    /// CUDA device `ordinal` (`cuda` is `cuda:0`).
    Cuda { ordinal: usize },
}

/// `--device` was not `cpu`, `cuda` or `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown device {0:?}: use cpu, cuda or cuda:N")]
pub struct DeviceSpecError(String);

impl FromStr for DeviceSpec {
    type Err = DeviceSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda { ordinal: 0 }),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|ordinal| DeviceSpec::Cuda { ordinal })
                .ok_or_else(|| DeviceSpecError(s.to_owned())),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// An opened device.
#[derive(Debug, Clone)]
pub enum Device {
    Cpu(Simd),
    Cuda(CudaDevice),
}

impl Device {
    /// Opens the device `spec` names; CUDA kernels come from `source`.
    pub fn open(spec: DeviceSpec, source: &KernelSource) -> Result<Device, DeviceError> {
        match spec {
            DeviceSpec::Cpu => Ok(Device::Cpu(Simd::best())),
            DeviceSpec::Cuda { ordinal } => CudaDevice::open(ordinal, source).map(Device::Cuda),
        }
    }

    /// For logs and reports: `cpu (avx2)` or the GPU's name.
    pub fn describe(&self) -> String {
        match self {
            Device::Cpu(simd) => format!("cpu ({})", simd.name()),
            Device::Cuda(dev) => format!("cuda ({})", dev.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_print_back() {
        for (text, spec) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda { ordinal: 0 }),
            ("cuda:3", DeviceSpec::Cuda { ordinal: 3 }),
        ] {
            assert_eq!(text.parse::<DeviceSpec>(), Ok(spec));
        }
        assert_eq!(DeviceSpec::Cuda { ordinal: 3 }.to_string(), "cuda:3");
        for bad in ["gpu", "cuda:", "cuda:x", "CUDA", ""] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_cpu_always_opens() {
        let dev = Device::open(DeviceSpec::Cpu, &KernelSource::Nvrtc).unwrap();
        assert!(dev.describe().starts_with("cpu"));
    }

    /// The twin: without the feature, asking for CUDA is a clear error at open, not later.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_cuda_refuses_and_says_how_to_get_it() {
        for ordinal in [0, 1] {
            let err = Device::open(DeviceSpec::Cuda { ordinal }, &KernelSource::Nvrtc).unwrap_err();
            assert_eq!(err, DeviceError::NotCompiledWithCuda);
            assert!(err.to_string().contains("--features cuda"), "{err}");
            assert!(err.to_string().contains("--device cpu"), "{err}");
        }
        assert_eq!(
            crate::cuda::compile_ptx(),
            Err(DeviceError::NotCompiledWithCuda)
        );
    }

    /// With the feature on a machine without the driver: an error naming the driver, no panic.
    #[cfg(feature = "cuda")]
    #[test]
    fn with_the_feature_a_machine_without_cuda_gets_an_error_not_a_panic() {
        // SAFETY: a dlopen probe, as in `CudaDevice::open`.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            eprintln!("this machine has a CUDA driver; the no-driver path is not exercised here");
            return;
        }
        let err = Device::open(DeviceSpec::Cuda { ordinal: 0 }, &KernelSource::Nvrtc).unwrap_err();
        assert_eq!(err, DeviceError::NoDriver);
        assert!(err.to_string().contains("no CUDA driver"), "{err}");
    }
}
