//! Per-call resource limits: the call's linear memories and tables together, in bytes (a
//! component may hold several of each, and wasmtime's [`StoreLimits`] bounds each memory alone
//! and no table), remembering when it refused so a breach is reported as such rather than as
//! an anonymous trap.

use wasmtime::{ResourceLimiter, StoreLimits, StoreLimitsBuilder};

/// The limiter of one store.
#[derive(Debug)]
pub(super) struct Limiter {
    limits: StoreLimits,
    /// The most bytes all the call's linear memories may hold together.
    memory_bytes: usize,
    /// What they hold, with the tables' elements (each one's growth from 0 at its creation,
    /// added up).
    memory_used: usize,
    /// Set once a growth was refused.
    pub(super) refused: bool,
}

/// The bytes a table element costs the host (a reference: a pointer), charged to the call's
/// memory as its tables grow.
const TABLE_ELEMENT_BYTES: usize = 8;

impl Limiter {
    /// At most `memory_bytes` in all the call's linear memories and tables together; a
    /// refused growth traps.
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

    /// What the call would hold with `bytes` more; refused (and remembered) past its limit.
    fn charge(&mut self, bytes: usize) -> wasmtime::Result<usize> {
        let used = self.memory_used.saturating_add(bytes);
        if used > self.memory_bytes {
            self.refused = true;
            wasmtime::bail!(
                "the call's linear memories and tables would hold {used} bytes, over its {} \
                 byte limit",
                self.memory_bytes
            );
        }
        Ok(used)
    }
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let used = self.charge(desired.saturating_sub(current))?;
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
        let grown = desired.saturating_sub(current);
        let used = self.charge(grown.saturating_mul(TABLE_ELEMENT_BYTES))?;
        let r = self.limits.table_growing(current, desired, maximum);
        match r {
            Ok(true) => self.memory_used = used,
            _ => self.refused = true,
        }
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

    /// A table's elements count against the same limit: a plugin's tables held several times
    /// its memory limit beside it.
    #[test]
    fn tables_count_against_the_limit_with_the_memories() {
        let mut l = Limiter::new(MIB);
        let elements = MIB / TABLE_ELEMENT_BYTES;
        assert!(l.table_growing(0, elements + 1, None).is_err());
        assert!(l.refused);
        let mut l = Limiter::new(MIB);
        assert!(matches!(l.memory_growing(0, MIB / 2, None), Ok(true)));
        assert!(matches!(l.table_growing(0, elements / 4, None), Ok(true)));
        assert!(
            l.table_growing(elements / 4, elements / 2 + 1, None)
                .is_err()
        );
        assert!(l.memory_growing(0, MIB / 4 + 1, None).is_err(), "3/4 used");
    }
}
