//! Which data plane carries KV pages between prefill and decode workers.
//!
//! ```text
//!  --kv-transport tcp  ─▶ KvTransport::Tcp             (kvplane.rs: frames over a TCP socket)
//!  --kv-transport rdma ─▶ KvTransport::Rdma(RdmaTransport)
//!                           ├─ feature `rdma`:  rdma.rs     device → context → protection domain,
//!                           │                               KV memory registration
//!                           └─ without it:      no_rdma.rs  `open` returns NotCompiledWithRdma
//! ```
//!
//! [`KvTransport::open`] runs once at startup, before the model is loaded: a worker asked for
//! RDMA on a build or a machine that has none refuses to start, with an error that names the way
//! out. Both builds expose the same API (`RdmaTransport`, `MemoryRegion`); only the definitions
//! are `#[cfg]`-gated, never their callers.
//!
//! This increment opens the device and can register KV memory; frames still travel over TCP
//! (posting RDMA writes is the next step).

#[cfg(feature = "rdma")]
mod rdma;

#[cfg(not(feature = "rdma"))]
mod no_rdma;
#[cfg(not(feature = "rdma"))]
use no_rdma as rdma;

pub use rdma::{MemoryRegion, RdmaTransport};

/// The data plane a worker was asked for (parsed from `--kv-transport`, `--rdma-device`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TransportConfig {
    /// KV frames over TCP (the default).
    #[default]
    Tcp,
    /// KV pages over RDMA on `device` (by its verbs name, e.g. `mlx5_0`), or on the first
    /// device listed when `None`.
    Rdma { device: Option<String> },
}

/// An opened data plane.
#[derive(Debug)]
pub enum KvTransport {
    Tcp,
    /// An open RDMA device with its protection domain; dropped (and closed) with the worker.
    Rdma(RdmaTransport),
}

impl KvTransport {
    /// Opens the data plane `config` asks for. TCP needs nothing up front; RDMA opens its
    /// device now, so a worker that cannot use it fails at start, not on the first request.
    pub fn open(config: &TransportConfig) -> Result<KvTransport, TransportError> {
        match config {
            TransportConfig::Tcp => Ok(KvTransport::Tcp),
            TransportConfig::Rdma { device } => {
                RdmaTransport::open(device.as_deref()).map(KvTransport::Rdma)
            }
        }
    }

    /// `tcp` or `rdma`, as the flag spells it.
    pub fn name(&self) -> &'static str {
        match self {
            KvTransport::Tcp => "tcp",
            KvTransport::Rdma(_) => "rdma",
        }
    }
}

/// Where a registered region sits in a transfer, which decides what the device may do with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Prefill's pages: the source of RDMA writes (the device only reads them).
    Source,
    /// Decode's pages: the peer writes into them remotely.
    Target,
}

/// Element types whose memory may be registered for RDMA: plain data with no padding, for which
/// every bit pattern is a valid value — a peer's remote write may leave any bytes in them.
pub trait KvElement: sealed::Sealed + Copy {}

impl KvElement for u8 {}
impl KvElement for half::f16 {}

mod sealed {
    /// Only the types above: the "every bit pattern is valid" promise is checked here, once.
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for half::f16 {}
}

/// Why a data plane could not be opened or set up.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    // The ibverbs errors are part of the message, not a `source`: the message is what a user
    // sees, and a chained cause would print them twice.
    #[error(
        "this build has no RDMA support; rebuild with --features rdma or use --kv-transport tcp"
    )]
    NotCompiledWithRdma,
    #[error("no RDMA device found (ibverbs: {error}); use --kv-transport tcp")]
    NoDevice { error: std::io::Error },
    #[error("no RDMA device found (ibverbs lists none); use --kv-transport tcp")]
    NoDeviceListed,
    #[error(
        "RDMA device {wanted:?} not found (this machine has: {available}); \
         pick one with --rdma-device or use --kv-transport tcp"
    )]
    DeviceNotFound { wanted: String, available: String },
    #[error("cannot open RDMA device {device:?} (ibverbs: {error}); use --kv-transport tcp")]
    Open {
        device: String,
        error: std::io::Error,
    },
    #[error(
        "cannot allocate a protection domain on RDMA device {device:?} (ibverbs: {error}); \
         use --kv-transport tcp"
    )]
    ProtectionDomain {
        device: String,
        error: std::io::Error,
    },
    #[error("an empty KV region cannot be registered for RDMA")]
    EmptyRegion,
    #[error(
        "cannot register {bytes} bytes of KV memory with RDMA device {device:?} \
         (ibverbs: {error}); lower --kv-memory or raise the locked-memory limit (ulimit -l)"
    )]
    Register {
        device: String,
        bytes: usize,
        error: std::io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_opens_without_any_device() {
        let transport = KvTransport::open(&TransportConfig::Tcp).expect("tcp needs nothing");
        assert_eq!(transport.name(), "tcp");
        assert_eq!(TransportConfig::default(), TransportConfig::Tcp);
    }

    #[cfg(not(feature = "rdma"))]
    #[test]
    fn without_the_feature_rdma_refuses_and_says_how_to_get_it() {
        for device in [None, Some("mlx5_0".to_owned())] {
            let err = KvTransport::open(&TransportConfig::Rdma { device })
                .expect_err("this build has no RDMA");
            assert!(
                matches!(err, TransportError::NotCompiledWithRdma),
                "{err:?}"
            );
            let message = err.to_string();
            assert!(
                message.contains("rebuild with --features rdma")
                    && message.contains("--kv-transport tcp"),
                "{message}"
            );
        }
    }

    /// With the feature, on a machine without an RDMA device (CI, developers' machines): a
    /// typed error that names the way out, never a panic. Where a device exists, opening it
    /// and registering a region must work.
    #[cfg(feature = "rdma")]
    #[test]
    fn with_the_feature_open_fails_cleanly_without_a_device() {
        let has_device = std::fs::read_dir("/sys/class/infiniband")
            .map(|mut d| d.next().is_some())
            .unwrap_or(false);
        let result =
            std::panic::catch_unwind(|| KvTransport::open(&TransportConfig::Rdma { device: None }))
                .expect("opening an RDMA transport never panics");
        match result {
            Err(err) => {
                let message = err.to_string();
                assert!(
                    message.contains("RDMA") && message.contains("--kv-transport tcp"),
                    "{message}"
                );
                if !has_device {
                    assert!(
                        matches!(
                            err,
                            TransportError::NoDevice { .. } | TransportError::NoDeviceListed
                        ),
                        "{err:?}"
                    );
                    assert!(message.contains("no RDMA device found"), "{message}");
                }
            }
            Ok(KvTransport::Rdma(rdma)) => {
                assert!(
                    has_device,
                    "an RDMA device opened without /sys/class/infiniband"
                );
                let mut pages = vec![half::f16::ZERO; 4096];
                let bytes = rdma
                    .with_registered(&mut pages, Access::Target, |mr| mr.len_bytes())
                    .expect("registers 8 KiB");
                assert_eq!(bytes, 8192);
            }
            Ok(other) => panic!("asked for RDMA, got {}", other.name()),
        }
    }
}
