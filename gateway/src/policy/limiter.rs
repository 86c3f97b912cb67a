//! Per-call resource limits: the call's linear memories together (a component may hold
//! several, and wasmtime's [`StoreLimits`] bounds each alone), table growth by
//! [`StoreLimits`], remembering when it refused so a breach is reported as such rather than
//! as an anonymous trap.

use wasmtime::{ResourceLimiter, StoreLimits, StoreLimitsBuilder};

/// The limiter of one store.
#[derive(Debug)]
pub(super) struct Limiter {
    limits: StoreLimits,
    /// The most bytes all the call's linear memories may hold together.
    memory_bytes: usize,
    /// What they hold (each memory's growth from 0 at its creation, added up).
    memory_used: usize,
    /// Set once a growth was refused.
    pub(super) refused: bool,
}

impl Limiter {
    /// At most `memory_bytes` in all the call's linear memories together; a refused growth
    /// traps.
    pub(super) fn new(memory_bytes: usize) -> Limiter {
        Limiter {
            limits: StoreLimitsBuilder::new()
                .memory_size(memory_bytes)
                .trap_on_grow_failure(true)
                .build(),
            memory_bytes,
            memory_used: 0,
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
        let used = self
            .memory_used
            .saturating_add(desired.saturating_sub(current));
        if used > self.memory_bytes {
            self.refused = true;
            wasmtime::bail!(
                "the call's linear memories would hold {used} bytes, over its {} byte limit",
                self.memory_bytes
            );
        }
        let r = self.limits.memory_growing(current, desired, maximum);
        match r {
            Ok(true) => self.memory_used = used,
            _ => self.refused = true,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn the_limit_holds_for_the_calls_memories_together_not_each() {
        let mut l = Limiter::new(16 * MIB);
        assert!(matches!(l.memory_growing(0, 12 * MIB, None), Ok(true)));
        // A second memory of the same component: alone within the limit, together over it.
        assert!(l.memory_growing(0, 12 * MIB, None).is_err());
        assert!(l.refused);
        let mut l = Limiter::new(16 * MIB);
        assert!(matches!(l.memory_growing(0, 8 * MIB, None), Ok(true)));
        assert!(matches!(
            l.memory_growing(8 * MIB, 12 * MIB, None),
            Ok(true)
        ));
        assert!(matches!(l.memory_growing(0, 4 * MIB, None), Ok(true)));
        assert!(l.memory_growing(0, 1, None).is_err(), "16 MiB used");
    }
}
