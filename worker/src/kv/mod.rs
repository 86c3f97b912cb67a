//! The KV pool's memory: the physical pages that the pool's logic (`bulkhead_kvpool`) hands
//! out. Pages are contiguous (see `bulkhead_kernels::attention` for the layout), so scrubbing
//! or checksumming a page touches one slice.

use std::ops::Range;

use bulkhead_kernels::attention::{CANARY, KvLayout};
use bulkhead_kvpool::{PageId, Scrub};
use half::f16;

// The data plane sends KV as little-endian f16, which is how these pages lie in memory here.
#[cfg(not(target_endian = "little"))]
compile_error!("the KV memory layout assumes a little-endian target");

/// A slot range that does not fit a page, or bytes that do not fit the slots.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    #[error("page {page} does not exist")]
    NoSuchPage { page: PageId },
    #[error("slots {slots:?} do not fit a page of {page_tokens}")]
    Slots {
        slots: Range<usize>,
        page_tokens: usize,
    },
    #[error("{got} bytes for slots that hold {want}")]
    Length { got: usize, want: usize },
}

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

    /// The bytes of one page (little-endian f16), as a page's frame carries them.
    pub fn page_bytes(&self, page: PageId) -> &[u8] {
        bytemuck::cast_slice(self.page(page))
    }

    /// The runs of `slots` inside `page`, one per (layer, K/V, head), as value ranges.
    fn slot_runs(
        &self,
        page: PageId,
        slots: &Range<usize>,
    ) -> Result<impl Iterator<Item = Range<usize>> + use<>, SlotError> {
        let l = self.layout;
        if page.index() >= self.values.len() / l.page_values() {
            return Err(SlotError::NoSuchPage { page });
        }
        if slots.start >= slots.end || slots.end > l.page_tokens {
            return Err(SlotError::Slots {
                slots: slots.clone(),
                page_tokens: l.page_tokens,
            });
        }
        let row = l.page_tokens * l.head_dim;
        let base = page.index() * l.page_values();
        let (a, b) = (slots.start * l.head_dim, slots.end * l.head_dim);
        Ok((0..l.layers * 2 * l.kv_heads).map(move |r| base + r * row + a..base + r * row + b))
    }

    /// The KV of `slots` of `page` — every layer, K and V, every head — as little-endian f16
    /// bytes: `slots.len() * layout.token_bytes()` of them.
    pub fn read_slots(&self, page: PageId, slots: Range<usize>) -> Result<Vec<u8>, SlotError> {
        let mut out = Vec::with_capacity(slots.len() * self.layout.token_bytes());
        for run in self.slot_runs(page, &slots)? {
            out.extend_from_slice(bytemuck::cast_slice(&self.values[run]));
        }
        Ok(out)
    }

    /// Writes bytes produced by [`KvMemory::read_slots`] into `slots` of `page`.
    pub fn write_slots(
        &mut self,
        page: PageId,
        slots: Range<usize>,
        bytes: &[u8],
    ) -> Result<(), SlotError> {
        let want = slots.len() * self.layout.token_bytes();
        if bytes.len() != want {
            return Err(SlotError::Length {
                got: bytes.len(),
                want,
            });
        }
        let mut at = 0;
        for run in self.slot_runs(page, &slots)? {
            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut self.values[run]);
            dst.copy_from_slice(&bytes[at..at + dst.len()]);
            at += dst.len();
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: KvLayout = KvLayout {
        layers: 2,
        kv_heads: 3,
        head_dim: 4,
        page_tokens: 8,
    };

    #[test]
    fn slots_move_between_pools_exactly() {
        let mut a = KvMemory::new(LAYOUT, 3);
        a.values_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = f16::from_f32(i as f32));
        let bytes = a.read_slots(PageId::new(1), 2..5).unwrap();
        assert_eq!(bytes.len(), 3 * LAYOUT.token_bytes());
        let mut b = KvMemory::new(LAYOUT, 2);
        b.write_slots(PageId::new(0), 2..5, &bytes).unwrap();
        assert_eq!(b.read_slots(PageId::new(0), 2..5).unwrap(), bytes);
        // Slots outside the range stay untouched.
        assert!(
            b.read_slots(PageId::new(0), 0..2)
                .unwrap()
                .iter()
                .all(|&x| x == 0)
        );
        assert!(
            b.read_slots(PageId::new(0), 5..8)
                .unwrap()
                .iter()
                .all(|&x| x == 0)
        );
    }

    #[test]
    fn bad_slot_requests_are_errors() {
        let mut m = KvMemory::new(LAYOUT, 1);
        assert!(matches!(
            m.read_slots(PageId::new(1), 0..1),
            Err(SlotError::NoSuchPage { .. })
        ));
        assert!(matches!(
            m.read_slots(PageId::new(0), 4..9),
            Err(SlotError::Slots { .. })
        ));
        assert!(matches!(
            m.read_slots(PageId::new(0), 3..3),
            Err(SlotError::Slots { .. })
        ));
        assert!(matches!(
            m.write_slots(PageId::new(0), 0..1, &[0; 3]),
            Err(SlotError::Length { .. })
        ));
    }
}
