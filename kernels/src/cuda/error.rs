//! Why a device could not be opened or a device operation failed.

use std::path::PathBuf;

/// Errors of the device layer. Messages name the way out; driver and compiler errors are part
/// of the message (not a `source`), since the message is what an operator reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "this build has no CUDA support; rebuild with --features cuda (e.g. \
         `cargo build --release --features cuda`) or use --device cpu"
    )]
    NotCompiledWithCuda,
    #[error(
        "no CUDA driver on this machine (libcuda.so could not be loaded); install the NVIDIA \
         driver or use --device cpu"
    )]
    NoDriver,
    #[error(
        "NVRTC (libnvrtc.so) could not be loaded to compile the CUDA kernels; pass a PTX file \
         made by `bulkhead cuda-ptx` with --cuda-ptx, or put libnvrtc on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    #[error("CUDA device {ordinal} does not exist: this machine has {count}; use --device cuda:N")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("CUDA driver error while trying to {action}: {error}")]
    Driver { action: &'static str, error: String },
    #[error("NVRTC could not compile the CUDA kernels: {log}")]
    Compile { log: String },
    #[error("cannot read the PTX file {path}: {error}")]
    PtxFile { path: PathBuf, error: String },
    #[error(
        "the PTX file {path} was made from other kernels (its first line is {found:?}, this \
         build wants {want:?}); make it again with `bulkhead cuda-ptx`"
    )]
    StalePtx {
        path: PathBuf,
        found: String,
        want: String,
    },
    #[error("unsupported shape for the CUDA kernels: {what}")]
    Shape { what: String },
}
