//! The RDMA transport in a build without the `rdma` feature: the same API as `rdma.rs`, whose
//! constructor always refuses. Both types are uninhabited, so no code path can hold one.

use std::marker::PhantomData;

use super::{Access, KvElement, TransportError};

/// Stands in for an open RDMA device; never constructed in this build.
#[derive(Debug)]
pub enum RdmaTransport {}

impl RdmaTransport {
    /// Always [`TransportError::NotCompiledWithRdma`].
    pub fn open(_device: Option<&str>) -> Result<RdmaTransport, TransportError> {
        Err(TransportError::NotCompiledWithRdma)
    }

    /// The device's verbs name.
    pub fn device(&self) -> &str {
        match *self {}
    }

    /// Runs `f` with `region` registered with the device.
    pub fn with_registered<T: KvElement, R>(
        &self,
        _region: &mut [T],
        _access: Access,
        _f: impl FnOnce(&MemoryRegion<'_, '_>) -> R,
    ) -> Result<R, TransportError> {
        match *self {}
    }

    /// Registers `region` with the device for the lifetime of the returned handle.
    ///
    /// # Safety
    ///
    /// The returned handle must be dropped, never leaked (see the `rdma` build).
    pub unsafe fn register<'r, T: KvElement>(
        &self,
        _region: &'r mut [T],
        _access: Access,
    ) -> Result<MemoryRegion<'_, 'r>, TransportError> {
        match *self {}
    }
}

/// Stands in for a registered KV region; never constructed in this build.
#[derive(Debug)]
pub struct MemoryRegion<'t, 'r> {
    never: std::convert::Infallible,
    _borrows: PhantomData<(&'t RdmaTransport, &'r mut [u8])>,
}

impl MemoryRegion<'_, '_> {
    /// The local key, for posting work requests on this region.
    pub fn lkey(&self) -> u32 {
        match self.never {}
    }

    /// The remote key a peer needs to write into this region.
    pub fn rkey(&self) -> u32 {
        match self.never {}
    }

    /// The region's start address, as the peer addresses it.
    pub fn addr(&self) -> u64 {
        match self.never {}
    }

    /// The region's length in bytes.
    pub fn len_bytes(&self) -> usize {
        match self.never {}
    }
}
