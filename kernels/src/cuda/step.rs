//! The host side of one forward step's KV kernels: the flattened arrays the kernels read
//! (which sequence each token belongs to, its position, every sequence's page table with the
//! tags it expects, the pool's current tags) and the mapping of the kernels' status words
//! back to [`IntegrityError`]s. Pure logic, tested without a GPU.

use bulkhead_kvpool::{PageRef, Tag};

use super::DeviceError;
use crate::attention::{IntegrityError, KvLayout, PagedSeq};

/// One sequence of a forward step, as the KV kernels see it.
#[derive(Debug, Clone, Copy)]
pub struct StepSeq<'a> {
    /// The sequence's page table, in token order.
    pub table: &'a [PageRef],
    /// Tokens already in its pages.
    pub cached: usize,
    /// Tokens this step appends.
    pub new: usize,
    /// False for a sequence that already failed this step (its tokens are skipped).
    pub active: bool,
}

/// Status word value meaning "nothing recorded" (the kernels keep the lowest index seen).
pub(crate) const NONE: i32 = i32::MAX;

/// The arrays one step uploads, in the kernels' order (see `KV_PARAMS` in kernels.cu).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct StepPlan {
    /// Per token: its sequence, or -1 when the sequence is inactive.
    pub tok_seq: Vec<i32>,
    /// Per token: its position (also the RoPE position, active or not).
    pub tok_pos: Vec<i32>,
    /// Per sequence: where its pages start in `table_pages` / `table_tags`.
    pub seq_table: Vec<i32>,
    pub table_pages: Vec<u32>,
    pub table_tags: Vec<u64>,
    /// The pool's current tag of every page.
    pub pool_tags: Vec<u64>,
    /// Per sequence: a failure found before any kernel ran (a table too short).
    pub early: Vec<Option<IntegrityError>>,
    /// The tables the kernels got (the needed pages), to name pages in errors.
    pub tables: Vec<Vec<PageRef>>,
}

fn int(v: usize, what: &str) -> Result<i32, DeviceError> {
    i32::try_from(v).map_err(|_| DeviceError::Shape {
        what: format!("{what} {v} does not fit the kernels' 32-bit indices"),
    })
}

impl StepPlan {
    pub fn new(layout: &KvLayout, tags: &[Tag], seqs: &[StepSeq<'_>]) -> Result<Self, DeviceError> {
        let mut plan = StepPlan {
            pool_tags: tags.iter().map(|t| t.get()).collect(),
            ..StepPlan::default()
        };
        for (si, s) in seqs.iter().enumerate() {
            let paged = PagedSeq {
                table: s.table,
                cached: s.cached,
                new: s.new,
            };
            let needed = if s.active {
                paged.needed_pages(layout).map_err(Some)
            } else {
                Err(None)
            };
            plan.seq_table
                .push(int(plan.table_pages.len(), "page table offset")?);
            let seq = match &needed {
                Ok(_) => int(si, "sequence index")?,
                Err(_) => -1,
            };
            for t in 0..s.new {
                plan.tok_seq.push(seq);
                plan.tok_pos.push(int(s.cached + t, "position")?);
            }
            let table = match needed {
                Ok(n) => {
                    plan.early.push(None);
                    &s.table[..n]
                }
                Err(e) => {
                    plan.early.push(e);
                    &[][..]
                }
            };
            plan.table_pages.extend(table.iter().map(|r| r.page.get()));
            plan.table_tags.extend(table.iter().map(|r| r.tag.get()));
            plan.tables.push(table.to_vec());
        }
        Ok(plan)
    }

    /// Per sequence, what failed: the early failures, then the kernels' status words
    /// (`[lowest mismatched table index, lowest canary position]` per sequence). A tag
    /// mismatch wins over a canary read, as on the CPU, which checks tags first.
    pub fn failures(&self, status: &[i32], tags: &[Tag]) -> Vec<Option<IntegrityError>> {
        self.early
            .iter()
            .enumerate()
            .map(|(si, early)| {
                if early.is_some() {
                    return *early;
                }
                let (index, position) = (status[2 * si], status[2 * si + 1]);
                if index != NONE {
                    let index = index as usize;
                    let table = &self.tables[si];
                    let Some(r) = table.get(index) else {
                        return Some(IntegrityError::StatusOutOfTable {
                            index,
                            pages: table.len(),
                        });
                    };
                    return Some(IntegrityError::TagMismatch {
                        index,
                        expected: r.tag,
                        found: tags.get(r.page.index()).copied(),
                    });
                }
                (position != NONE).then_some(IntegrityError::CanaryRead {
                    position: position as usize,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use bulkhead_kvpool::PageId;

    use super::*;

    const LAYOUT: KvLayout = KvLayout {
        layers: 1,
        kv_heads: 1,
        head_dim: 32,
        page_tokens: 4,
    };

    fn r(page: u32, tag: u64) -> PageRef {
        PageRef {
            page: PageId::new(page),
            tag: Tag::new(tag),
        }
    }

    #[test]
    fn the_plan_flattens_tables_and_skips_failed_sequences() {
        let tags = [Tag::new(1), Tag::new(2), Tag::new(3)];
        let a = [r(2, 3), r(0, 1), r(1, 2)];
        let short = [r(1, 2)];
        let seqs = [
            StepSeq {
                table: &a,
                cached: 5,
                new: 1,
                active: true,
            },
            StepSeq {
                table: &short,
                cached: 3,
                new: 2,
                active: true,
            },
            StepSeq {
                table: &a,
                cached: 0,
                new: 1,
                active: false,
            },
        ];
        let plan = StepPlan::new(&LAYOUT, &tags, &seqs).unwrap();
        assert_eq!(plan.tok_seq, [0, -1, -1, -1]);
        assert_eq!(plan.tok_pos, [5, 3, 4, 0]);
        // Sequence 0 needs 2 pages (6 tokens); the others get none.
        assert_eq!(plan.table_pages, [2, 0]);
        assert_eq!(plan.table_tags, [3, 1]);
        assert_eq!(plan.seq_table, [0, 2, 2]);
        assert_eq!(plan.pool_tags, [1, 2, 3]);
        assert!(matches!(
            plan.early[1],
            Some(IntegrityError::TableTooShort {
                pages: 1,
                needed: 2,
                tokens: 5
            })
        ));
        assert_eq!(plan.early[2], None);
    }

    #[test]
    fn status_words_become_the_cpu_errors() {
        let tags = [Tag::new(1), Tag::new(7)];
        let a = [r(0, 1), r(1, 2)];
        let seqs = [
            StepSeq {
                table: &a,
                cached: 7,
                new: 1,
                active: true,
            },
            StepSeq {
                table: &a,
                cached: 7,
                new: 1,
                active: true,
            },
            StepSeq {
                table: &a,
                cached: 7,
                new: 1,
                active: true,
            },
        ];
        let plan = StepPlan::new(&LAYOUT, &tags, &seqs).unwrap();
        let status = [1, 3, NONE, 6, NONE, NONE];
        let f = plan.failures(&status, &tags);
        assert_eq!(
            f[0],
            Some(IntegrityError::TagMismatch {
                index: 1,
                expected: Tag::new(2),
                found: Some(Tag::new(7))
            })
        );
        assert_eq!(f[1], Some(IntegrityError::CanaryRead { position: 6 }));
        assert_eq!(f[2], None);
        // A page the kernel names past the table: a failure, never none.
        let f = plan.failures(&[5, NONE, NONE, NONE, NONE, NONE], &tags);
        assert_eq!(
            f[0],
            Some(IntegrityError::StatusOutOfTable { index: 5, pages: 2 })
        );
    }
}
