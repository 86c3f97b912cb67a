//! What each page's slots hold, as far as this worker wrote them: for the holder of which tag,
//! and how many slots from the first. Before each step, with the page-tag check
//! (`Check::TagCheck`), the engine checks that every slot a sequence reads was written for it
//! in its current allocation (I2): by a transfer's frame, or by its own forward pass.
//!
//! The tag check sees a page that left the sequence (released, reallocated); this sees a page
//! the sequence holds that was never written for it — a frame prefill never sent, let through
//! by a handoff verification that failed to see it — which would otherwise be read as the
//! sequence's KV: zeros after a scrub, or, with `--scrub none`, what its previous holder, any
//! tenant, left there. A page's tag changes only when it is reserved, so a stamp under an
//! older tag is never taken for the new holder's, and pages kept in a prefix cache keep
//! theirs.

use std::ops::Range;

use bulkhead_kernels::attention::IntegrityError;
use bulkhead_kvpool::{PageId, PageRef, Tag};

/// One page's stamp: slots `0..slots` were written for the holder of `holder`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Stamp {
    holder: Option<Tag>,
    slots: usize,
}

/// Every page's stamp.
#[derive(Debug)]
pub struct Written {
    stamps: Vec<Stamp>,
    page_tokens: usize,
}

impl Written {
    /// A pool of `pages` pages of `page_tokens` slots, none written.
    pub fn new(pages: usize, page_tokens: usize) -> Written {
        Written {
            stamps: vec![Stamp::default(); pages],
            page_tokens,
        }
    }

    /// Slots `slots` of `page` were written for the holder of `tag`. Runs grow from the first
    /// slot: a write that starts past the end of the holder's run leaves the run as it was,
    /// so a slot after a gap is never read as written.
    pub(super) fn record(&mut self, page: PageId, tag: Tag, slots: Range<usize>) {
        let Some(s) = self.stamps.get_mut(page.index()) else {
            return;
        };
        if s.holder == Some(tag) && slots.start <= s.slots {
            s.slots = s.slots.max(slots.end);
        } else if slots.start == 0 {
            *s = Stamp {
                holder: Some(tag),
                slots: slots.end,
            };
        }
    }

    /// Positions `from..from + count` of the sequence of `table` were written for it.
    pub(super) fn record_run(&mut self, table: &[PageRef], from: usize, count: usize) {
        let pt = self.page_tokens;
        let end = from + count;
        let mut p = from;
        while p < end {
            let (index, slot) = (p / pt, p % pt);
            let run_end = ((index + 1) * pt).min(end);
            if let Some(r) = table.get(index) {
                self.record(r.page, r.tag, slot..slot + (run_end - p));
            }
            p = run_end;
        }
    }

    /// Whether positions `0..cached` of the sequence of `table` (the ones its next step reads
    /// before its own) were all written for it.
    pub(super) fn check(&self, table: &[PageRef], cached: usize) -> Result<(), IntegrityError> {
        let pt = self.page_tokens;
        for (index, r) in table.iter().enumerate().take(cached.div_ceil(pt)) {
            let needed = (cached - index * pt).min(pt);
            let s = self.stamps.get(r.page.index()).copied().unwrap_or_default();
            let written = if s.holder == Some(r.tag) { s.slots } else { 0 };
            if written < needed {
                return Err(IntegrityError::Unwritten {
                    index,
                    position: index * pt + written,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(page: u32, tag: u64) -> PageRef {
        PageRef {
            page: PageId::new(page),
            tag: Tag::new(tag),
        }
    }

    #[test]
    fn a_sequence_reads_only_slots_written_for_it() {
        let mut w = Written::new(4, 4);
        let table = [at(2, 20), at(0, 21), at(3, 22)];
        assert_eq!(w.check(&table, 0), Ok(()), "nothing read yet");
        // Its forward pass wrote positions 0..6: page 2 whole, two slots of page 0.
        w.record_run(&table, 0, 6);
        assert_eq!(w.check(&table, 6), Ok(()));
        assert_eq!(
            w.check(&table, 7),
            Err(IntegrityError::Unwritten {
                index: 1,
                position: 6
            })
        );
        w.record_run(&table, 6, 1);
        assert_eq!(w.check(&table, 7), Ok(()));
        // Page 3 written for its last holder (tag 9), never for this sequence: as a frame
        // prefill never sent leaves it.
        w.record(PageId::new(3), Tag::new(9), 0..4);
        w.record(PageId::new(0), Tag::new(21), 3..4);
        assert_eq!(
            w.check(&table, 10),
            Err(IntegrityError::Unwritten {
                index: 2,
                position: 8
            })
        );
        // A transfer's frame of that page, for this holder.
        w.record(PageId::new(3), Tag::new(22), 0..2);
        assert_eq!(w.check(&table, 10), Ok(()));
    }

    #[test]
    fn a_slot_after_a_gap_is_never_read_as_written() {
        let mut w = Written::new(1, 8);
        let table = [at(0, 5)];
        w.record(PageId::new(0), Tag::new(5), 0..2);
        w.record(PageId::new(0), Tag::new(5), 4..8);
        assert!(w.check(&table, 3).is_err(), "slots 2 and 3 were skipped");
        w.record(PageId::new(0), Tag::new(5), 2..4);
        assert_eq!(w.check(&table, 4), Ok(()));
        assert!(
            w.check(&table, 5).is_err(),
            "4.. came before its gap closed"
        );
        // A write for another holder that does not start the page changes nothing.
        w.record(PageId::new(0), Tag::new(6), 1..8);
        assert_eq!(w.check(&table, 4), Ok(()));
    }
}
