//! Paged attention over the KV pool, with the page-tag check.
//!
//! The KV cache lives in fixed-size pages. A sequence reaches its tokens through a page table
//! of [`PageRef`]s: the page and the generation tag it had when the sequence got it. Before
//! reading or writing any page, the kernel compares the pool's current tag of that page with
//! the expected one; a mismatch means the page left the sequence (released, reallocated to
//! someone else) and the call fails instead of attending over another request's data.
//!
//! Memory layout of the pool, one page after another, each page contiguous (so a page can be
//! zeroed, checksummed or sent as one slice):
//!
//! ```text
//! page ─┬─ layer 0 ─┬─ K ─┬─ kv head 0: [slot 0: head_dim values] … [slot page_tokens-1]
//!       │           │     └─ kv head 1 …
//!       │           └─ V ── (same shape)
//!       └─ layer 1 …
//! ```

use bulkhead_kvpool::{PageRef, Tag};
use half::f16;
use std::cell::RefCell;
use std::sync::Mutex;

use crate::ops::softmax;
use crate::simd::{Level, Simd};

/// Shape of the KV pool's pages. Values are f16, as in the reference engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub page_tokens: usize,
}

impl KvLayout {
    /// f16 values in one page.
    pub fn page_values(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.page_tokens * self.head_dim
    }

    /// Bytes in one page.
    pub fn page_bytes(&self) -> usize {
        self.page_values() * 2
    }

    /// Bytes of KV per token (all layers, K and V).
    pub fn token_bytes(&self) -> usize {
        self.page_bytes() / self.page_tokens
    }

    /// Index of the first value of (`page`, `layer`, K or V, `head`, `slot`).
    fn offset(&self, page: usize, layer: usize, v: bool, head: usize, slot: usize) -> usize {
        ((((page * self.layers + layer) * 2 + usize::from(v)) * self.kv_heads + head)
            * self.page_tokens
            + slot)
            * self.head_dim
    }
}

/// Whether the kernel compares page tags before touching pages. Only tests turn it off, to
/// show the stale read it prevents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagCheck {
    On,
    Off,
}

/// A page the kernel refused to touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IntegrityError {
    #[error("page {index} of the page table expected tag {expected:?}, the pool has {found:?}")]
    TagMismatch {
        index: usize,
        expected: Tag,
        found: Option<Tag>,
    },
    #[error(
        "position {position} of the sequence holds the release canary: a read of a released page"
    )]
    CanaryRead { position: usize },
    #[error(
        "position {position} of the sequence was never written for it (page {index} of its page \
         table): a transfer's frame that never came, or what the page's last holder left"
    )]
    Unwritten { index: usize, position: usize },
    #[error("the page table holds {pages} pages, {needed} are needed for {tokens} tokens")]
    TableTooShort {
        pages: usize,
        needed: usize,
        tokens: usize,
    },
    /// A device kernel named a page past the table it was given: the step's plan and the
    /// kernel disagree, and nothing it computed for the sequence is trusted.
    #[error("the kernel reported page {index} of a table of {pages} pages")]
    StatusOutOfTable { index: usize, pages: usize },
}

impl IntegrityError {
    /// The first page of the sequence's page table whose contents the failure puts in doubt,
    /// at `page_tokens` tokens a page: the page it names; none when the table was too short or
    /// a kernel's report fell outside it (the step's plan and the kernel disagree: that says
    /// nothing of what any page holds).
    #[must_use]
    pub fn suspect_page(&self, page_tokens: usize) -> Option<usize> {
        match *self {
            Self::TagMismatch { index, .. } | Self::Unwritten { index, .. } => Some(index),
            Self::CanaryRead { position } => Some(position / page_tokens.max(1)),
            Self::StatusOutOfTable { .. } | Self::TableTooShort { .. } => None,
        }
    }
}

/// The value released pages are filled with under the canary scrub policy: an f16 NaN with a
/// payload no computation produces, so a read of a released slot is recognisable.
pub const CANARY: f16 = f16::from_bits(0x7e5a);

/// The pool's current page tags and whether to compare them, and whether to look for the
/// canary in every key slot read.
#[derive(Debug, Clone, Copy)]
pub struct TagView<'a> {
    /// Current tag of every page, indexed by page.
    pub tags: &'a [Tag],
    pub check: TagCheck,
    /// Released pages hold [`CANARY`]; reading one fails the call.
    pub canary: bool,
}

/// Read access to the pool for attention: its layout, its values and its tags.
#[derive(Debug, Clone, Copy)]
pub struct PagedKv<'a> {
    pub layout: &'a KvLayout,
    pub values: &'a [f16],
    pub tags: TagView<'a>,
}

/// One attention call's view of a sequence and the pool.
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    /// The sequence's page table, in token order.
    pub table: &'a [PageRef],
    /// Tokens of the sequence already in the cache before this call's tokens.
    pub cached: usize,
    /// Tokens this call appends (and computes attention for).
    pub new: usize,
}

impl PagedSeq<'_> {
    /// Pages of the table the call touches, or `TableTooShort` when the table cannot hold the
    /// sequence's tokens.
    pub fn needed_pages(&self, layout: &KvLayout) -> Result<usize, IntegrityError> {
        let tokens = self.cached + self.new;
        let needed = tokens.div_ceil(layout.page_tokens);
        if self.table.len() < needed {
            return Err(IntegrityError::TableTooShort {
                pages: self.table.len(),
                needed,
                tokens,
            });
        }
        Ok(needed)
    }

    fn check(&self, layout: &KvLayout, tags: TagView<'_>) -> Result<(), IntegrityError> {
        let needed = self.needed_pages(layout)?;
        if tags.check == TagCheck::On {
            for (index, r) in self.table[..needed].iter().enumerate() {
                let found = tags.tags.get(r.page.index()).copied();
                if found != Some(r.tag) {
                    return Err(IntegrityError::TagMismatch {
                        index,
                        expected: r.tag,
                        found,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Writes the K and V rows of the sequence's new tokens (`seq.new × kv_heads × head_dim` each)
/// into their slots of `layer`, after checking the page table.
pub fn write_kv(
    layout: &KvLayout,
    pool: &mut [f16],
    tags: TagView<'_>,
    seq: PagedSeq<'_>,
    layer: usize,
    kv: (&[f32], &[f32]),
) -> Result<(), IntegrityError> {
    seq.check(layout, tags)?;
    let (k, v) = kv;
    let hd = layout.head_dim;
    for t in 0..seq.new {
        let pos = seq.cached + t;
        let page = seq.table[pos / layout.page_tokens].page.index();
        let slot = pos % layout.page_tokens;
        for h in 0..layout.kv_heads {
            let row = (t * layout.kv_heads + h) * hd;
            for (is_v, src) in [(false, k), (true, v)] {
                let at = layout.offset(page, layer, is_v, h, slot);
                for (d, s) in pool[at..at + hd].iter_mut().zip(&src[row..row + hd]) {
                    *d = f16::from_f32(*s);
                }
            }
        }
    }
    Ok(())
}

/// A sequence of a batched attention call. Its rows of `q` and `out` follow the previous
/// sequence's, `seq.new` of them.
#[derive(Debug, Clone, Copy)]
pub struct BatchSeq<'a> {
    pub seq: PagedSeq<'a>,
    /// `false`: the caller has already failed this sequence; its rows are left as they are.
    pub live: bool,
}

/// Causal attention of the sequence's new tokens over all its cached tokens in `layer`.
/// `q` and `out` are `seq.new × heads × head_dim`; query token `t` sits at position
/// `seq.cached + t` and attends over positions `0..=seq.cached + t`.
pub fn attend(
    simd: Simd,
    kv: PagedKv<'_>,
    seq: PagedSeq<'_>,
    layer: usize,
    q: &[f32],
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    // One result per sequence: exactly one here.
    attend_batch(simd, kv, &[BatchSeq { seq, live: true }], layer, q, out).swap_remove(0)
}

/// [`attend`] for every live sequence of a batch in one parallel loop, one result per
/// sequence. `q` and `out` hold every sequence's rows, in order. A loop item is one query row
/// and one KV head: the group of query heads sharing that KV head reads each key and value
/// once. Each output value is computed by the same operations in the same order whatever the
/// batch, so results are batch-invariant bit for bit.
pub fn attend_batch(
    simd: Simd,
    kv: PagedKv<'_>,
    seqs: &[BatchSeq<'_>],
    layer: usize,
    q: &[f32],
    out: &mut [f32],
) -> Vec<Result<(), IntegrityError>> {
    let PagedKv {
        layout,
        values: pool,
        tags,
    } = kv;
    let checked: Vec<Result<(), IntegrityError>> = seqs
        .iter()
        .map(|s| match s.live {
            true => s.seq.check(layout, tags),
            false => Ok(()),
        })
        .collect();
    // Canary reads found during the loop: (sequence, position).
    let canaries = Mutex::new(Vec::new());
    let rows: usize = seqs.iter().map(|s| s.seq.new).sum();
    let hd = layout.head_dim;
    let heads = q.len() / (rows * hd).max(1);
    assert!(
        q.len() == rows * heads * hd && out.len() == q.len(),
        "attention shapes: {rows} rows, q {} values, out {}",
        q.len(),
        out.len()
    );
    let group = heads / layout.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    crate::pool::global().for_each_chunk_mut(out, group * hd, &|i, o| {
        let (row, kvh) = (i / layout.kv_heads, i % layout.kv_heads);
        // The sequence holding `row`, and the row's token within it.
        let (mut s, mut t) = (0, row);
        while t >= seqs[s].seq.new {
            t -= seqs[s].seq.new;
            s += 1;
        }
        if !seqs[s].live || checked[s].is_err() {
            return;
        }
        let seq = seqs[s].seq;
        let len = seq.cached + t + 1;
        let qs = &q[(row * heads + kvh * group) * hd..][..group * hd];
        let pt = layout.page_tokens;
        // The sequence's pages under positions `0..len`, with the first position of each:
        // within a page, one KV head's slots of one layer lie one after another.
        let pages = seq.table[..len.div_ceil(pt)]
            .iter()
            .enumerate()
            .map(|(p, r)| (p * pt, (len - p * pt).min(pt), r.page.index()));
        SCRATCH.with_borrow_mut(|(scores, rows)| {
            scores.clear();
            scores.resize(group * len, 0.0);
            rows.resize(pt * hd, 0.0);
            for (first, n, page) in pages.clone() {
                let at = layout.offset(page, layer, false, kvh, 0);
                let keys = &pool[at..at + n * hd];
                if tags.canary
                    && let Some(slot) = keys
                        .chunks_exact(hd)
                        .position(|k| k[0].to_bits() == CANARY.to_bits())
                {
                    let mut found = canaries.lock().unwrap_or_else(|p| p.into_inner());
                    found.push((s, first + slot));
                    return;
                }
                widen(simd, keys, &mut rows[..n * hd]);
                for (j, qh) in qs.chunks_exact(hd).enumerate() {
                    dots(
                        simd,
                        qh,
                        &rows[..n * hd],
                        &mut scores[j * len + first..][..n],
                    );
                }
            }
            for head in scores.chunks_exact_mut(len) {
                for x in head.iter_mut() {
                    *x *= scale;
                }
                softmax(head);
            }
            o.fill(0.0);
            for (first, n, page) in pages {
                let at = layout.offset(page, layer, true, kvh, 0);
                widen(simd, &pool[at..at + n * hd], &mut rows[..n * hd]);
                for (j, oh) in o.chunks_exact_mut(hd).enumerate() {
                    axpys(simd, oh, &scores[j * len + first..][..n], &rows[..n * hd]);
                }
            }
        });
    });
    let mut results = checked;
    let mut found = canaries.into_inner().unwrap_or_else(|p| p.into_inner());
    // Per sequence the lowest position, whichever thread found it first.
    found.sort_unstable();
    for (s, position) in found {
        if results[s].is_ok() {
            results[s] = Err(IntegrityError::CanaryRead { position });
        }
    }
    results
}

thread_local! {
    /// One loop item's attention scores (a row per query head) and one page of keys or
    /// values in f32; kept per thread so a decode step allocates nothing.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `out = x` in f32 (exact: every f16 is an f32).
fn widen(simd: Simd, x: &[f16], out: &mut [f32]) {
    match simd.level() {
        Level::Portable => portable::widen(x, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Simd` of these levels is only obtained after detecting AVX2,
        // FMA and F16C.
        Level::Avx2 | Level::Avx512 => unsafe { avx2::widen(x, out) },
    }
}

/// `out[i] = dot(q, rows[i])` for each `q.len()`-value row of `rows`.
fn dots(simd: Simd, q: &[f32], rows: &[f32], out: &mut [f32]) {
    // What the vector level reads without a check: a row for every output.
    assert!(rows.len() >= out.len() * q.len(), "a row for every output");
    match simd.level() {
        Level::Portable => portable::dots(q, rows, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `widen`.
        Level::Avx2 | Level::Avx512 => unsafe { avx2::dots(q, rows, out) },
    }
}

/// `out += w[i] * rows[i]` for each `out.len()`-value row of `rows`, in order.
fn axpys(simd: Simd, out: &mut [f32], w: &[f32], rows: &[f32]) {
    match simd.level() {
        Level::Portable => portable::axpys(out, w, rows),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `widen`.
        Level::Avx2 | Level::Avx512 => unsafe { avx2::axpys(out, w, rows) },
    }
}

/// The reference kernels, in plain Rust. They compute the SIMD kernels' float operations in
/// the same order (`LANES` fused multiply-add accumulators over whole groups of values,
/// summed in lane order, then the rest with plain multiplies and adds), so every level is
/// bit-identical, as the matmul tiles are. Any other order is as correct but not identical,
/// and over 30 layers a last-bit difference that moves an activation to the next 8-bit step
/// grows: a plain sequential sum here put the real model's logits up to 1.34 away from the
/// SIMD levels' on the golden prompts.
mod portable {
    use half::f16;

    /// f32 lanes of one 256-bit register, the SIMD kernels' accumulator width.
    const LANES: usize = 8;

    pub(super) fn widen(x: &[f16], out: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(x) {
            *o = x.to_f32();
        }
    }

    pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let whole = n - n % LANES;
        let mut lanes = [0.0f32; LANES];
        for (a, b) in a[..whole]
            .chunks_exact(LANES)
            .zip(b[..whole].chunks_exact(LANES))
        {
            for ((acc, x), y) in lanes.iter_mut().zip(a).zip(b) {
                *acc = x.mul_add(*y, *acc);
            }
        }
        lanes.iter().sum::<f32>()
            + a[whole..n]
                .iter()
                .zip(&b[whole..n])
                .map(|(x, y)| x * y)
                .sum::<f32>()
    }

    pub(super) fn dots(q: &[f32], rows: &[f32], out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(rows.chunks_exact(q.len())) {
            *o = dot(q, row);
        }
    }

    pub(super) fn axpys(out: &mut [f32], w: &[f32], rows: &[f32]) {
        let n = out.len();
        for (&a, row) in w.iter().zip(rows.chunks_exact(n)) {
            axpy(out, a, row);
        }
    }

    pub(super) fn axpy(out: &mut [f32], a: f32, x: &[f32]) {
        let n = out.len().min(x.len());
        let whole = n - n % LANES;
        for (o, x) in out[..whole].iter_mut().zip(&x[..whole]) {
            *o = a.mul_add(*x, *o);
        }
        for (o, x) in out[whole..n].iter_mut().zip(&x[whole..n]) {
            *o += a * x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn widen(x: &[f16], out: &mut [f32]) {
        let n = out.len().min(x.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` and both slices hold at least `n` values; f16 is 2 bytes.
            unsafe {
                let y = _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(i).cast()));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), y);
            }
            i += 8;
        }
        for (o, x) in out[i..n].iter_mut().zip(&x[i..n]) {
            *o = x.to_f32();
        }
    }

    /// `out[i]` = the dot product of `q` with row `i` of `rows`, bit-identical to
    /// `portable::dot`: per row one 8-lane accumulator over whole chunks of 8, its lanes summed
    /// in order, then the rest. Eight rows run at once, as independent chains.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots(q: &[f32], rows: &[f32], out: &mut [f32]) {
        const ROWS: usize = 8;
        let hd = q.len();
        let whole = hd - hd % 8;
        let mut r = 0;
        while r < out.len() {
            let m = (out.len() - r).min(ROWS);
            let mut acc = [_mm256_setzero_ps(); ROWS];
            let mut i = 0;
            while i < whole {
                // SAFETY: `i + 8 <= hd`; `q` holds `hd` values.
                let x = unsafe { _mm256_loadu_ps(q.as_ptr().add(i)) };
                for (j, acc) in acc[..m].iter_mut().enumerate() {
                    // SAFETY: row `r + j` is inside `rows` (`out` has a value per row).
                    let y = unsafe { _mm256_loadu_ps(rows.as_ptr().add((r + j) * hd + i)) };
                    *acc = _mm256_fmadd_ps(x, y, *acc);
                }
                i += 8;
            }
            let mut lanes = [[0.0f32; 8]; ROWS];
            for (l, a) in lanes[..m].iter_mut().zip(&acc) {
                // SAFETY: `l` holds 8 f32.
                unsafe { _mm256_storeu_ps(l.as_mut_ptr(), *a) };
            }
            for (j, l) in lanes[..m].iter().enumerate() {
                let row = &rows[(r + j) * hd..(r + j + 1) * hd];
                out[r + j] = l.iter().sum::<f32>()
                    + q[whole..]
                        .iter()
                        .zip(&row[whole..])
                        .map(|(x, y)| x * y)
                        .sum::<f32>();
            }
            r += m;
        }
    }

    /// `out += w[i] * row i of rows` for each row in order, bit-identical to
    /// `portable::axpy` row after row.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpys(out: &mut [f32], w: &[f32], rows: &[f32]) {
        let n = out.len();
        let whole = n - n % 8;
        for (&a, row) in w.iter().zip(rows.chunks_exact(n)) {
            let va = _mm256_set1_ps(a);
            let mut i = 0;
            while i < whole {
                // SAFETY: `i + 8 <= n`; `out` and `row` hold `n` values.
                unsafe {
                    let p = out.as_mut_ptr().add(i);
                    let y = _mm256_loadu_ps(row.as_ptr().add(i));
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(va, y, _mm256_loadu_ps(p)));
                }
                i += 8;
            }
            for (o, x) in out[whole..].iter_mut().zip(&row[whole..]) {
                *o += a * x;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use bulkhead_kvpool::{PagePool, PoolConfig, RequestId, Scrub};

    use super::*;

    const LAYOUT: KvLayout = KvLayout {
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        page_tokens: 4,
    };
    const HEADS: usize = 4;

    fn config(pages: u32) -> PoolConfig {
        let nz = |v| NonZeroU32::new(v).unwrap();
        PoolConfig {
            pages: nz(pages),
            page_tokens: nz(LAYOUT.page_tokens as u32),
            scrub: Scrub::None,
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        crate::test_values::uniform(n, seed, 1.0)
    }

    /// Plain causal GQA attention over dense K/V (`len × kv_heads × head_dim`), the oracle.
    fn reference(q: &[f32], k: &[f32], v: &[f32], cached: usize, new: usize) -> Vec<f32> {
        let (hd, kvh) = (LAYOUT.head_dim, LAYOUT.kv_heads);
        let mut out = vec![0.0; new * HEADS * hd];
        for t in 0..new {
            for h in 0..HEADS {
                let g = h / (HEADS / kvh);
                let qr = &q[(t * HEADS + h) * hd..][..hd];
                let mut s: Vec<f32> = (0..=cached + t)
                    .map(|p| {
                        let kr = &k[(p * kvh + g) * hd..][..hd];
                        // Keys went through f16 in the pool.
                        qr.iter()
                            .zip(kr)
                            .map(|(a, b)| a * f16::from_f32(*b).to_f32())
                            .sum::<f32>()
                            / (hd as f32).sqrt()
                    })
                    .collect();
                softmax(&mut s);
                for (p, w) in s.iter().enumerate() {
                    for d in 0..hd {
                        out[(t * HEADS + h) * hd + d] +=
                            w * f16::from_f32(v[(p * kvh + g) * hd + d]).to_f32();
                    }
                }
            }
        }
        out
    }

    /// A failure names the page of the table it put in doubt: the one it read, the canary's
    /// page by its position; none for a short table or a kernel's report outside it.
    #[test]
    fn a_failure_names_the_first_page_it_puts_in_doubt() {
        let tag = |found| IntegrityError::TagMismatch {
            index: 3,
            expected: Tag::new(1),
            found,
        };
        assert_eq!(tag(None).suspect_page(16), Some(3));
        let canary = IntegrityError::CanaryRead { position: 40 };
        assert_eq!(canary.suspect_page(16), Some(2));
        let unwritten = IntegrityError::Unwritten {
            index: 1,
            position: 20,
        };
        assert_eq!(unwritten.suspect_page(16), Some(1));
        let outside = IntegrityError::StatusOutOfTable { index: 9, pages: 2 };
        assert_eq!(outside.suspect_page(16), None);
        let short = IntegrityError::TableTooShort {
            pages: 1,
            needed: 2,
            tokens: 20,
        };
        assert_eq!(short.suspect_page(16), None);
    }

    #[test]
    fn paged_attention_matches_the_dense_reference_on_every_path() {
        let pool = PagePool::new(config(8));
        // Take and drop an allocation first so the sequence's pages are not 0, 1, 2, ….
        drop(
            pool.reserve(pool.admit(RequestId::new(9), 8).unwrap())
                .unwrap(),
        );
        let alloc = pool
            .reserve(pool.admit(RequestId::new(1), 11).unwrap())
            .unwrap()
            .commit();
        let mut mem = vec![f16::ZERO; LAYOUT.page_values() * 8];
        let kvd = LAYOUT.kv_heads * LAYOUT.head_dim;
        let (k, v) = (values(11 * kvd, 1), values(11 * kvd, 2));
        let q = values(11 * HEADS * LAYOUT.head_dim, 3);
        pool.with_tags(|tags| {
            let view = TagView {
                tags,
                check: TagCheck::On,
                canary: true,
            };
            // Prefill 7 tokens in one call, then 4 one at a time.
            let mut spans = vec![(0, 7)];
            spans.extend((7..11).map(|p| (p, 1)));
            for (cached, new) in spans {
                let seq = PagedSeq {
                    table: alloc.pages(),
                    cached,
                    new,
                };
                let rows = cached * kvd..(cached + new) * kvd;
                write_kv(
                    &LAYOUT,
                    &mut mem,
                    view,
                    seq,
                    1,
                    (&k[rows.clone()], &v[rows]),
                )
                .unwrap();
                let qrows = &q[cached * HEADS * 16..(cached + new) * HEADS * 16];
                let want = reference(qrows, &k, &v, cached, new);
                for simd in Simd::available() {
                    let mut out = vec![0.0; want.len()];
                    let kv = PagedKv {
                        layout: &LAYOUT,
                        values: &mem,
                        tags: view,
                    };
                    attend(simd, kv, seq, 1, qrows, &mut out).unwrap();
                    for (a, b) in out.iter().zip(&want) {
                        assert!(
                            (a - b).abs() < 1e-4,
                            "{simd:?} at {cached}+{new}: {a} vs {b}"
                        );
                    }
                }
            }
        });
    }

    /// Every row length (whole groups of lanes, a rest, and both) and every number of rows
    /// (the SIMD dots take eight at a time): each level matches the portable kernels row by
    /// row, bit for bit.
    #[test]
    fn every_level_widens_dots_and_accumulates_bit_identically_to_the_portable_one() {
        for n in [1, 7, 8, 21, 64] {
            for rows in [1, 5, 8, 13] {
                let q = values(n, 5);
                let halves: Vec<f16> = values(n * rows, 6).into_iter().map(f16::from_f32).collect();
                let mut wide = vec![0.0; n * rows];
                widen(Simd::PORTABLE, &halves, &mut wide);
                assert!(wide.iter().zip(&halves).all(|(x, h)| *x == h.to_f32()));
                let want_dots: Vec<u32> = wide
                    .chunks_exact(n)
                    .map(|row| portable::dot(&q, row).to_bits())
                    .collect();
                let w = values(rows, 8);
                let mut want_out = values(n, 7);
                for (&a, row) in w.iter().zip(wide.chunks_exact(n)) {
                    portable::axpy(&mut want_out, a, row);
                }
                for simd in Simd::available() {
                    let mut got = vec![0.0; n * rows];
                    widen(simd, &halves, &mut got);
                    assert_eq!(got, wide, "{simd:?} widen, {n} values");
                    let mut d = vec![0.0; rows];
                    dots(simd, &q, &wide, &mut d);
                    assert_eq!(
                        d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want_dots,
                        "{simd:?} dots, {rows} rows of {n}"
                    );
                    let mut out = values(n, 7);
                    axpys(simd, &mut out, &w, &wide);
                    assert_eq!(
                        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want_out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{simd:?} axpys, {rows} rows of {n}"
                    );
                }
            }
        }
    }

    /// One batched call gives every sequence exactly what it gets alone; a sequence the caller
    /// already failed is left alone, and one whose page moved on fails without touching the
    /// others.
    #[test]
    fn a_batched_call_is_bit_identical_to_each_sequence_alone_and_fails_only_the_stale_one() {
        let pool = PagePool::new(config(12));
        let kvd = LAYOUT.kv_heads * LAYOUT.head_dim;
        let row = HEADS * LAYOUT.head_dim;
        let mut mem = vec![f16::ZERO; LAYOUT.page_values() * 12];
        // Cached tokens and new tokens of four sequences: prefill, decode, decode, prefill.
        let shapes: [(usize, usize); 4] = [(0, 5), (6, 1), (9, 1), (2, 3)];
        let allocs: Vec<_> = shapes
            .iter()
            .enumerate()
            .map(|(i, (cached, new))| {
                let admissible = pool
                    .admit(RequestId::new(i as u64 + 1), (cached + new) as u64)
                    .unwrap();
                pool.reserve(admissible).unwrap().commit()
            })
            .collect();
        let q = values(shapes.iter().map(|(_, n)| n).sum::<usize>() * row, 11);
        pool.with_tags(|tags| {
            let view = TagView {
                tags,
                check: TagCheck::On,
                canary: true,
            };
            for (i, ((cached, new), alloc)) in shapes.iter().zip(&allocs).enumerate() {
                let tokens = cached + new;
                let (k, v) = (
                    values(tokens * kvd, 20 + i as u32),
                    values(tokens * kvd, 40 + i as u32),
                );
                let seq = PagedSeq {
                    table: alloc.pages(),
                    cached: 0,
                    new: tokens,
                };
                write_kv(&LAYOUT, &mut mem, view, seq, 0, (&k, &v)).unwrap();
            }
        });
        let seq = |i: usize| PagedSeq {
            table: allocs[i].pages(),
            cached: shapes[i].0,
            new: shapes[i].1,
        };
        let rows = |i: usize| {
            let start: usize = shapes[..i].iter().map(|(_, n)| n).sum();
            start * row..(start + shapes[i].1) * row
        };
        // The third sequence's table names its first page with a tag the page never had.
        let mut table2 = allocs[2].pages().to_vec();
        table2[0] = PageRef {
            page: table2[0].page,
            tag: Tag::new(u64::MAX),
        };
        let tags = pool.with_tags(|tags| tags.to_vec());
        for simd in Simd::available() {
            let view = TagView {
                tags: &tags,
                check: TagCheck::On,
                canary: true,
            };
            let kv = PagedKv {
                layout: &LAYOUT,
                values: &mem,
                tags: view,
            };
            let mut batch = vec![7.0; q.len()];
            let mut seqs: Vec<BatchSeq<'_>> = (0..4)
                .map(|i| BatchSeq {
                    seq: seq(i),
                    live: true,
                })
                .collect();
            seqs[1].live = false;
            seqs[2].seq.table = &table2;
            let results = attend_batch(simd, kv, &seqs, 0, &q, &mut batch);
            assert_eq!(results[0], Ok(()));
            assert_eq!(
                results[1],
                Ok(()),
                "{simd:?}: a sequence not live is not checked"
            );
            assert!(
                matches!(
                    results[2],
                    Err(IntegrityError::TagMismatch { index: 0, .. })
                ),
                "{simd:?}: {:?}",
                results[2]
            );
            assert_eq!(results[3], Ok(()));
            assert!(
                batch[rows(1)].iter().all(|&x| x == 7.0),
                "{simd:?}: not live, untouched"
            );
            for i in [0, 3] {
                let mut alone = vec![0.0; rows(i).len()];
                attend(simd, kv, seq(i), 0, &q[rows(i)], &mut alone).unwrap();
                assert_eq!(
                    batch[rows(i)]
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                    alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{simd:?} sequence {i}"
                );
            }
        }
    }

    #[test]
    fn a_table_too_short_for_the_tokens_is_refused() {
        let pool = PagePool::new(config(2));
        let alloc = pool
            .reserve(pool.admit(RequestId::new(1), 4).unwrap())
            .unwrap()
            .commit();
        let mut mem = vec![f16::ZERO; LAYOUT.page_values() * 2];
        let kvd = LAYOUT.kv_heads * LAYOUT.head_dim;
        pool.with_tags(|tags| {
            let view = TagView {
                tags,
                check: TagCheck::On,
                canary: true,
            };
            let seq = PagedSeq {
                table: alloc.pages(),
                cached: 4,
                new: 1,
            };
            let err = write_kv(
                &LAYOUT,
                &mut mem,
                view,
                seq,
                0,
                (&[0.0; 32][..kvd], &[0.0; 32][..kvd]),
            );
            assert_eq!(
                err,
                Err(IntegrityError::TableTooShort {
                    pages: 1,
                    needed: 2,
                    tokens: 5
                })
            );
        });
    }
}
