//! The allocator of guests built for `wasm32-unknown-unknown`: a bump allocator over the linear
//! memory past the data segment (`__heap_base`), growing the memory only when a call needs
//! more than the initial pages hold.
//!
//! The gateway runs every call in a fresh instance and drops it after, so memory freed during a
//! call is never needed again: only the most recent block is given back or resized in place
//! (a `Vec` or a `String` growing). What this saves is the host's work per call: Rust's default
//! allocator on this target grows the memory for its first block, and every growth costs the
//! host a `mprotect` and more pages to reset when the instance goes.

use core::alloc::Layout;
use core::cell::Cell;

/// A WebAssembly page.
pub const PAGE: usize = 65536;

/// What the allocator needs of the memory it hands out.
pub trait Memory {
    /// The first byte it may hand out.
    fn base(&self) -> usize;
    /// The memory's size, in bytes.
    fn size(&self) -> usize;
    /// Grows the memory by `pages`; false if it cannot.
    fn grow(&self, pages: usize) -> bool;
}

/// No block: before the first allocation, or after the most recent one was freed.
const NONE: usize = 0;

/// Hands out blocks of `M` upwards from its base.
pub struct Bump<M> {
    memory: M,
    /// The first free byte; `NONE` before the first allocation.
    next: Cell<usize>,
    /// Where the most recent live block starts; `NONE` when it was freed.
    last: Cell<usize>,
}

impl<M: Memory> Bump<M> {
    pub const fn new(memory: M) -> Bump<M> {
        Bump {
            memory,
            next: Cell::new(NONE),
            last: Cell::new(NONE),
        }
    }

    /// Makes the memory reach `end`, growing it if it must.
    fn reach(&self, end: usize) -> bool {
        let have = self.memory.size();
        end <= have || self.memory.grow((end - have).div_ceil(PAGE))
    }

    /// Makes `[start, start + size)` the most recent block, if the memory can hold it.
    fn claim(&self, start: usize, size: usize) -> Option<usize> {
        let end = start.checked_add(size)?;
        if !self.reach(end) {
            return None;
        }
        self.last.set(start);
        self.next.set(end);
        Some(start)
    }

    /// A block of `layout`, or `None` when the memory cannot grow to hold it.
    pub fn alloc(&self, layout: Layout) -> Option<usize> {
        let next = match self.next.get() {
            NONE => self.memory.base(),
            n => n,
        };
        self.claim(
            next.checked_next_multiple_of(layout.align())?,
            layout.size(),
        )
    }

    /// Gives `block` back: reused only when it is the most recent block.
    pub fn free(&self, block: usize) {
        if block == self.last.get() {
            self.next.set(block);
            self.last.set(NONE);
        }
    }

    /// `block` (of `layout`) resized to `new_size`: in place when it is the most recent block,
    /// else a new block (the caller copies the contents over; the old one stays as it is).
    pub fn resize(&self, block: usize, layout: Layout, new_size: usize) -> Option<usize> {
        if block == self.last.get() {
            return self.claim(block, new_size);
        }
        self.alloc(Layout::from_size_align(new_size, layout.align()).ok()?)
    }
}

#[cfg(all(target_family = "wasm", target_os = "unknown"))]
mod linear {
    use core::alloc::{GlobalAlloc, Layout};
    use core::arch::wasm32;
    use core::ptr;

    use super::{Bump, Memory, PAGE};

    unsafe extern "C" {
        /// Set by the linker past the stack and the data segment: the first free byte.
        static __heap_base: u8;
    }

    /// Memory 0 of the instance.
    pub struct Linear;

    impl Memory for Linear {
        fn base(&self) -> usize {
            ptr::addr_of!(__heap_base) as usize
        }

        fn size(&self) -> usize {
            wasm32::memory_size(0) * PAGE
        }

        fn grow(&self, pages: usize) -> bool {
            wasm32::memory_grow(0, pages) != usize::MAX
        }
    }

    // SAFETY: `wasm32-unknown-unknown` without the atomics feature runs one thread.
    unsafe impl Sync for Bump<Linear> {}

    fn pointer(block: Option<usize>) -> *mut u8 {
        block.map_or(ptr::null_mut(), |b| b as *mut u8)
    }

    // SAFETY: every block lies past the data segment, inside the memory (grown to hold it),
    // aligned as asked, and apart from every other live block (`Bump` moves its free mark
    // back only over the most recent block, when that block is freed or resized).
    unsafe impl GlobalAlloc for Bump<Linear> {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            pointer(Bump::alloc(self, layout))
        }

        unsafe fn dealloc(&self, block: *mut u8, _layout: Layout) {
            self.free(block as usize);
        }

        unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            let new = pointer(self.resize(block as usize, layout, new_size));
            if !new.is_null() && new != block {
                // SAFETY: two live blocks, apart, each at least this long.
                unsafe { ptr::copy_nonoverlapping(block, new, layout.size().min(new_size)) };
            }
            new
        }
    }
}

#[cfg(all(target_family = "wasm", target_os = "unknown"))]
pub use linear::Linear;

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// A memory of `pages` pages (at most `max`), handing out bytes from `base`.
    struct Fake {
        base: usize,
        pages: Cell<usize>,
        max: usize,
    }

    impl Memory for Fake {
        fn base(&self) -> usize {
            self.base
        }
        fn size(&self) -> usize {
            self.pages.get() * PAGE
        }
        fn grow(&self, pages: usize) -> bool {
            let total = self.pages.get() + pages;
            total <= self.max && {
                self.pages.set(total);
                true
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc { size: usize, align_log2: u32 },
        Free(usize),
        Resize(usize, usize),
    }

    /// Sizes from 1: `GlobalAlloc` is never asked for zero bytes (its contract), and blocks of
    /// zero bytes may share an address, which is no overlap.
    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..40_000, 0u32..7).prop_map(|(size, align_log2)| Op::Alloc { size, align_log2 }),
            any::<usize>().prop_map(Op::Free),
            (any::<usize>(), 1usize..40_000).prop_map(|(i, s)| Op::Resize(i, s)),
        ]
    }

    proptest! {
        /// Live blocks are aligned, inside the memory, past its base and never overlap, and a
        /// block moved by a resize is a new one; growth happens only when a block needs it.
        #[test]
        fn blocks_stay_apart(ops in prop::collection::vec(op(), 1..200)) {
            let bump = Bump::new(Fake { base: 77_000, pages: Cell::new(2), max: 8 });
            // Live blocks: start → (size, align).
            let mut live: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
            for op in ops {
                let pages_before = bump.memory.pages.get();
                let asked = match op {
                    Op::Alloc { size, align_log2 } => {
                        let layout = Layout::from_size_align(size, 1 << align_log2).unwrap();
                        if let Some(b) = bump.alloc(layout) {
                            live.insert(b, (size, layout.align()));
                        }
                        size
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let b = *live.keys().nth(i % live.len()).unwrap();
                        live.remove(&b);
                        bump.free(b);
                        0
                    }
                    Op::Resize(i, new_size) if !live.is_empty() => {
                        let b = *live.keys().nth(i % live.len()).unwrap();
                        let (size, align) = live[&b];
                        let layout = Layout::from_size_align(size, align).unwrap();
                        if let Some(n) = bump.resize(b, layout, new_size) {
                            live.remove(&b);
                            prop_assert!(!live.contains_key(&n), "resize handed out a live block");
                            live.insert(n, (new_size, align));
                        }
                        new_size
                    }
                    _ => 0,
                };
                let end = bump.memory.size();
                let mut prev_end = bump.memory.base;
                for (&start, &(size, align)) in &live {
                    prop_assert_eq!(start % align, 0);
                    prop_assert!(start >= prev_end, "blocks overlap at {}", start);
                    prev_end = start + size;
                    prop_assert!(prev_end <= end, "a block runs past the memory");
                }
                let grown = bump.memory.pages.get() - pages_before;
                prop_assert!(grown <= asked.div_ceil(PAGE) + 1, "grew {} pages for {} bytes", grown, asked);
            }
        }
    }

    #[test]
    fn the_most_recent_block_is_reused_and_resized_in_place() {
        let bump = Bump::new(Fake {
            base: 1000,
            pages: Cell::new(1),
            max: 1,
        });
        let layout = Layout::from_size_align(100, 8).unwrap();
        let a = bump.alloc(layout).unwrap();
        assert_eq!(a, 1000);
        let b = bump.alloc(layout).unwrap();
        assert_eq!(b, 1104);
        assert_eq!(bump.resize(b, layout, 300), Some(b));
        assert_eq!(
            bump.resize(a, layout, 200),
            Some(1408),
            "an older block moves"
        );
        bump.free(1408);
        assert_eq!(
            bump.alloc(layout),
            Some(1408),
            "the freed top block is handed out again"
        );
        assert_eq!(
            bump.alloc(Layout::from_size_align(PAGE, 1).unwrap()),
            None,
            "no room to grow"
        );
    }
}
