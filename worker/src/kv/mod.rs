//! The KV pool's memory: the physical pages that the pool's logic (`bulkhead_kvpool`) hands
//! out. Pages are contiguous (see `bulkhead_kernels::attention` for the layout), so scrubbing
//! or checksumming a page touches one slice.

use bulkhead_kernels::attention::{CANARY, KvLayout};
use bulkhead_kvpool::{PageId, Scrub};
use half::f16;

/// Host memory for `pages` pages of `layout`.
#[derive(Debug)]
pub struct KvMemory {
    layout: KvLayout,
    values: Vec<f16>,
}

impl KvMemory {
    pub fn new(layout: KvLayout, pages: usize) -> KvMemory {
        KvMemory {
            layout,
            values: vec![f16::ZERO; layout.page_values() * pages],
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn values(&self) -> &[f16] {
        &self.values
    }

    pub fn values_mut(&mut self) -> &mut [f16] {
        &mut self.values
    }

    /// The values of one page.
    pub fn page(&self, page: PageId) -> &[f16] {
        let n = self.layout.page_values();
        &self.values[page.index() * n..(page.index() + 1) * n]
    }

    /// Overwrites a released page as `scrub` says.
    pub fn scrub(&mut self, page: PageId, scrub: Scrub) {
        let n = self.layout.page_values();
        let fill = match scrub {
            Scrub::None => return,
            Scrub::Zero => f16::ZERO,
            Scrub::Canary => CANARY,
        };
        self.values[page.index() * n..(page.index() + 1) * n].fill(fill);
    }
}
