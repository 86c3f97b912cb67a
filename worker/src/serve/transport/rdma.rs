//! The RDMA transport (feature `rdma`): an open verbs device, its protection domain, and the
//! registration of KV memory with it.
//!
//! ```text
//!  ibv_get_device_list ─▶ pick by name (or the first) ─▶ ibv_open_device ─▶ ibv_alloc_pd
//!        (list freed once the device is open)               Context             ProtectionDomain
//!                                                                                    │
//!   RdmaTransport::with_registered(&mut [T], Access, f) ─▶ ibv_reg_mr ─▶ MemoryRegion<'t, 'r>
//!                                        drop: ibv_dereg_mr ◀─┘ (before the region is usable again)
//! ```
//!
//! Calls go straight to `ibverbs-sys`, the FFI layer of the `ibverbs` crate: `ibverbs` 0.9 only
//! registers memory it allocates itself and exposes neither its context nor its protection
//! domain, while the KV pool's pages are allocated by the pool. Every raw handle lives in one
//! owning type whose `Drop` releases it. Registration is safe in its scoped form
//! (`with_registered`); the handle-returning `register` is `unsafe` because leaking a handle
//! (safe in Rust) would end the borrow of memory the device can still write.

use std::ffi::CStr;
use std::io;
use std::marker::PhantomData;
use std::ptr::NonNull;

use ibverbs_sys as ffi;

use super::{Access, KvElement, TransportError};

/// An open RDMA device and a protection domain on it.
#[derive(Debug)]
pub struct RdmaTransport {
    // Field order is drop order: the protection domain is freed before its device is closed.
    pd: ProtectionDomain,
    #[expect(
        dead_code,
        reason = "held so the device stays open while the transport lives; queue pairs (the \
                  data path, next) are created on it"
    )]
    context: Context,
    /// The device's verbs name (e.g. `mlx5_0`).
    device: String,
}

impl RdmaTransport {
    /// Opens `device` (by its verbs name), or the first device listed when `None`, and
    /// allocates a protection domain on it.
    pub fn open(device: Option<&str>) -> Result<RdmaTransport, TransportError> {
        let list = DeviceList::get().map_err(|error| TransportError::NoDevice { error })?;
        let names = list.names();
        let index = select_device(&names, device)?;
        let name = names[index].clone();
        let context = list.open(index).map_err(|error| TransportError::Open {
            device: name.clone(),
            error,
        })?;
        // The list may be freed now: the opened device stays valid (ibv_free_device_list(3)).
        drop(list);
        let pd = context
            .alloc_pd()
            .map_err(|error| TransportError::ProtectionDomain {
                device: name.clone(),
                error,
            })?;
        tracing::info!(device = %name, "RDMA device open");
        Ok(RdmaTransport {
            pd,
            context,
            device: name,
        })
    }

    /// The device's verbs name.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Runs `f` with `region` registered with the device; deregisters it before returning
    /// (or unwinding), so the memory is never reachable by the device once this returns.
    pub fn with_registered<T: KvElement, R>(
        &self,
        region: &mut [T],
        access: Access,
        f: impl FnOnce(&MemoryRegion<'_, '_>) -> R,
    ) -> Result<R, TransportError> {
        // SAFETY: the handle stays in this frame and `f` only gets a shared borrow of it, so it
        // cannot be leaked; it is dropped (deregistered) when this function returns or unwinds,
        // before the borrow of `region` ends.
        let mr = unsafe { self.register(region, access) }?;
        Ok(f(&mr))
    }

    /// Registers `region` with the device for as long as the returned handle lives.
    ///
    /// The handle borrows `region` mutably: while the device may write into it (a `Target`
    /// region is written by the peer without this process's involvement), no Rust code can
    /// read or write it, and it cannot be freed or moved. Dropping the handle deregisters the
    /// memory before the borrow ends.
    ///
    /// # Safety
    ///
    /// The returned handle must be dropped, never leaked (`mem::forget`, an `Rc` cycle, a
    /// leaked `Box`): leaking it ends the borrow of `region` while the device may still write
    /// into that memory. [`RdmaTransport::with_registered`] is the safe form.
    pub unsafe fn register<'r, T: KvElement>(
        &self,
        region: &'r mut [T],
        access: Access,
    ) -> Result<MemoryRegion<'_, 'r>, TransportError> {
        let bytes = std::mem::size_of_val(region);
        if bytes == 0 {
            return Err(TransportError::EmptyRegion);
        }
        let flags = match access {
            // Local read access is always granted; the device only reads a write's source.
            Access::Source => ffi::ibv_access_flags(0),
            // Remote write requires local write as well (ibv_reg_mr(3)).
            Access::Target => {
                ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                    | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            }
        };
        let access = i32::try_from(flags.0).map_err(|_| TransportError::Register {
            device: self.device.clone(),
            bytes,
            error: io::Error::new(io::ErrorKind::InvalidInput, "access flags out of range"),
        })?;
        // SAFETY: `self.pd.0` is a live protection domain (owned by `self`, which the returned
        // handle borrows, so it outlives the registration). `region` is a live allocation of
        // exactly `bytes` bytes, borrowed mutably for 'r by the returned handle, so nothing else
        // touches it and it is not freed while registered; `Drop for MemoryRegion` deregisters
        // it before that borrow ends, and the caller promises the handle is dropped, not leaked
        // (this function's contract). `T: KvElement` is plain data for which every bit pattern
        // is valid, so whatever the device writes into it leaves valid values behind.
        let mr = unsafe {
            ffi::ibv_reg_mr(
                self.pd.0.as_ptr(),
                region.as_mut_ptr().cast(),
                bytes,
                access,
            )
        };
        let mr = NonNull::new(mr).ok_or_else(|| TransportError::Register {
            device: self.device.clone(),
            bytes,
            error: last_error("ibv_reg_mr failed"),
        })?;
        Ok(MemoryRegion {
            mr,
            _transport: PhantomData,
            _region: PhantomData,
        })
    }
}

/// KV memory registered with an RDMA device; deregistered on drop.
///
/// `'t` borrows the transport (its protection domain must outlive the registration), `'r` the
/// registered memory (nothing else may use it while the device can).
#[derive(Debug)]
pub struct MemoryRegion<'t, 'r> {
    /// Non-null, returned by `ibv_reg_mr` and not yet deregistered.
    mr: NonNull<ffi::ibv_mr>,
    _transport: PhantomData<&'t RdmaTransport>,
    _region: PhantomData<&'r mut [u8]>,
}

impl MemoryRegion<'_, '_> {
    fn raw(&self) -> &ffi::ibv_mr {
        // SAFETY: `self.mr` came from a successful `ibv_reg_mr` and is only freed in `Drop`, so
        // it points at a live `ibv_mr`, which the library does not change after registration.
        unsafe { self.mr.as_ref() }
    }

    /// The local key, for posting work requests on this region.
    pub fn lkey(&self) -> u32 {
        self.raw().lkey
    }

    /// The remote key a peer needs to write into this region.
    pub fn rkey(&self) -> u32 {
        self.raw().rkey
    }

    /// The region's start address, as the peer addresses it.
    pub fn addr(&self) -> u64 {
        self.raw().addr as u64
    }

    /// The region's length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.raw().length
    }
}

impl Drop for MemoryRegion<'_, '_> {
    fn drop(&mut self) {
        // SAFETY: `self.mr` is a live registration (see the field) and is not used after this.
        let errno = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if errno != 0 {
            // Still registered, the device may write into memory whose borrow ends here, and
            // borrowed memory cannot be leaked instead: stopping is the only sound answer.
            tracing::error!(
                error = %io::Error::from_raw_os_error(errno),
                "ibv_dereg_mr failed: stopping, the device could still write the memory"
            );
            std::process::abort();
        }
    }
}

// SAFETY (for the four impls below): libibverbs is thread-safe — its verbs may be called on the
// same context, protection domain and memory region from any thread (rdma-core,
// libibverbs/man/ibv_*). The handles are plain pointers with no thread-local state, and each
// owning type frees its handle exactly once, in `Drop`.
unsafe impl Send for RdmaTransport {}
unsafe impl Sync for RdmaTransport {}
unsafe impl Send for MemoryRegion<'_, '_> {}
unsafe impl Sync for MemoryRegion<'_, '_> {}

/// Which listed device to open: the one named `wanted`, or the first.
fn select_device(names: &[String], wanted: Option<&str>) -> Result<usize, TransportError> {
    match wanted {
        None if names.is_empty() => Err(TransportError::NoDeviceListed),
        None => Ok(0),
        Some(w) => names
            .iter()
            .position(|n| n == w)
            .ok_or_else(|| match names.len() {
                0 => TransportError::NoDeviceListed,
                _ => TransportError::DeviceNotFound {
                    wanted: w.to_owned(),
                    available: names.join(", "),
                },
            }),
    }
}

/// The errno of the call that just failed, or `fallback` when it left none.
fn last_error(fallback: &str) -> io::Error {
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(0) | None => io::Error::other(fallback.to_owned()),
        Some(_) => e,
    }
}

/// The devices libibverbs found; freed on drop.
struct DeviceList {
    /// Non-null array of `len` valid device pointers, from `ibv_get_device_list`.
    devices: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> io::Result<DeviceList> {
        let mut n: std::os::raw::c_int = 0;
        // SAFETY: `n` is a valid out-pointer for the duration of the call.
        let devices = unsafe { ffi::ibv_get_device_list(&mut n) };
        let devices =
            NonNull::new(devices).ok_or_else(|| last_error("ibv_get_device_list failed"))?;
        Ok(DeviceList {
            devices,
            // A non-null list has a non-negative count.
            len: usize::try_from(n).unwrap_or(0),
        })
    }

    fn as_slice(&self) -> &[*mut ffi::ibv_device] {
        // SAFETY: `ibv_get_device_list` returned an array of `len` device pointers, owned by
        // `self` until `Drop` frees it; nothing writes to it meanwhile.
        unsafe { std::slice::from_raw_parts(self.devices.as_ptr(), self.len) }
    }

    /// The devices' verbs names, in list order (an unnamed device gets its index).
    fn names(&self) -> Vec<String> {
        self.as_slice()
            .iter()
            .enumerate()
            .map(|(i, &device)| {
                // SAFETY: `device` is a valid entry of the live list.
                let name = unsafe { ffi::ibv_get_device_name(device) };
                if name.is_null() {
                    format!("#{i}")
                } else {
                    // SAFETY: a non-null name is a NUL-terminated string owned by the device,
                    // valid while the list is; it is copied out here.
                    unsafe { CStr::from_ptr(name) }
                        .to_string_lossy()
                        .into_owned()
                }
            })
            .collect()
    }

    /// Opens the device at `index` (in bounds: from `names`' positions).
    fn open(&self, index: usize) -> io::Result<Context> {
        let device = *self
            .as_slice()
            .get(index)
            .ok_or_else(|| io::Error::other("device index out of range"))?;
        // SAFETY: `device` is a valid entry of the live list.
        let context = unsafe { ffi::ibv_open_device(device) };
        NonNull::new(context)
            .map(Context)
            .ok_or_else(|| last_error("ibv_open_device failed"))
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from `ibv_get_device_list` and is freed only here; devices
        // opened from it stay valid after (ibv_free_device_list(3)).
        unsafe { ffi::ibv_free_device_list(self.devices.as_ptr()) };
    }
}

/// An open device context (non-null, from `ibv_open_device`); closed on drop.
#[derive(Debug)]
struct Context(NonNull<ffi::ibv_context>);

impl Context {
    fn alloc_pd(&self) -> io::Result<ProtectionDomain> {
        // SAFETY: `self.0` is a live context.
        let pd = unsafe { ffi::ibv_alloc_pd(self.0.as_ptr()) };
        NonNull::new(pd)
            .map(ProtectionDomain)
            .ok_or_else(|| last_error("ibv_alloc_pd failed"))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `self.0` is live and closed only here; every protection domain allocated on
        // it is owned by the same `RdmaTransport` and dropped first (field order).
        let errno = unsafe { ffi::ibv_close_device(self.0.as_ptr()) };
        if errno != 0 {
            tracing::error!(error = %io::Error::from_raw_os_error(errno), "ibv_close_device failed");
        }
    }
}

/// A protection domain (non-null, from `ibv_alloc_pd`); freed on drop.
#[derive(Debug)]
struct ProtectionDomain(NonNull<ffi::ibv_pd>);

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: `self.0` is live and freed only here; every memory region registered in it
        // borrows the owning `RdmaTransport`, so all were deregistered before this runs.
        let errno = unsafe { ffi::ibv_dealloc_pd(self.0.as_ptr()) };
        if errno != 0 {
            tracing::error!(error = %io::Error::from_raw_os_error(errno), "ibv_dealloc_pd failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_first_device_is_picked_unless_one_is_named() {
        let list = names(&["mlx5_0", "mlx5_1"]);
        assert_eq!(select_device(&list, None).ok(), Some(0));
        assert_eq!(select_device(&list, Some("mlx5_1")).ok(), Some(1));
    }

    #[test]
    fn a_missing_device_names_the_ones_there_are() {
        let err =
            select_device(&names(&["mlx5_0", "rxe0"]), Some("mlx5_9")).expect_err("no such device");
        let message = err.to_string();
        assert!(
            message.contains("mlx5_9") && message.contains("mlx5_0, rxe0"),
            "{message}"
        );
        assert!(matches!(
            select_device(&[], None),
            Err(TransportError::NoDeviceListed)
        ));
        assert!(matches!(
            select_device(&[], Some("mlx5_0")),
            Err(TransportError::NoDeviceListed)
        ));
    }
}
