//! Per-call resource limits: wasmtime's [`StoreLimits`] (memory and table growth), remembering
//! when it refused so a breach is reported as such rather than as an anonymous trap.

use wasmtime::{ResourceLimiter, StoreLimits, StoreLimitsBuilder};

/// The limiter of one store.
#[derive(Debug)]
pub(super) struct Limiter {
    limits: StoreLimits,
    /// Set once a growth was refused.
    pub(super) refused: bool,
}

impl Limiter {
    /// At most `memory_bytes` per linear memory; a refused growth traps.
    pub(super) fn new(memory_bytes: usize) -> Limiter {
        Limiter {
            limits: StoreLimitsBuilder::new()
                .memory_size(memory_bytes)
                .trap_on_grow_failure(true)
                .build(),
            refused: false,
        }
    }
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let r = self.limits.memory_growing(current, desired, maximum);
        self.refused |= !matches!(r, Ok(true));
        r
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.refused = true;
        self.limits.memory_grow_failed(error)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let r = self.limits.table_growing(current, desired, maximum);
        self.refused |= !matches!(r, Ok(true));
        r
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.refused = true;
        self.limits.table_grow_failed(error)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}
