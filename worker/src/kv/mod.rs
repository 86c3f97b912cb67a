//! The KV pool's memory: the physical pages that the pool's logic (`bulkhead_kvpool`) hands
//! out, in host memory or in device memory. Pages are contiguous (see
//! `bulkhead_kernels::attention` for the layout), so scrubbing or checksumming a page touches
//! one range.
//!
//! ```text
//!  KvMemory ─┬─ Host(Vec<f16>)    the CPU forward pass reads and writes it directly
//!            └─ Cuda(DeviceKv)    plain device memory; scrubs run on the device, slot reads
//!                                 and writes for transfers are staged through pinned memory
//! ```

use std::ops::Range;

use bulkhead_kernels::attention::{CANARY, KvLayout};
use bulkhead_kernels::cuda::DeviceKv;
use bulkhead_kernels::{Device, DeviceError};
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
    #[error("KV memory on the device: {0}")]
    Device(#[from] DeviceError),
}

/// Where the pages are.
#[derive(Debug)]
enum Store {
    Host(Vec<f16>),
    Cuda(DeviceKv),
}

/// Memory for `pages` pages of `layout`.
#[derive(Debug)]
pub struct KvMemory {
    layout: KvLayout,
    pages: usize,
    store: Store,
}

/// The runs of some slots inside one page: `runs` runs of `width` values, `stride` apart,
/// starting at value `start` of the pool (one run per layer, K/V and head).
struct Runs {
    start: usize,
    runs: usize,
    stride: usize,
    width: usize,
}

impl Runs {
    fn ranges(&self) -> impl Iterator<Item = Range<usize>> + use<> {
        let Runs {
            start,
            runs,
            stride,
            width,
        } = *self;
        (0..runs).map(move |r| start + r * stride..start + r * stride + width)
    }
}

impl KvMemory {
    /// Zeroed host memory.
    pub fn new(layout: KvLayout, pages: usize) -> KvMemory {
        KvMemory {
            layout,
            pages,
            store: Store::Host(vec![f16::ZERO; layout.page_values() * pages]),
        }
    }

    /// Zeroed memory on `device` (host memory for the CPU).
    pub fn on(device: &Device, layout: KvLayout, pages: usize) -> Result<KvMemory, DeviceError> {
        let store = match device {
            Device::Cpu(_) => return Ok(KvMemory::new(layout, pages)),
            Device::Cuda(dev) => Store::Cuda(dev.kv_pool(layout, pages)?),
        };
        Ok(KvMemory {
            layout,
            pages,
            store,
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// How many pages it holds.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// The values, when the pages are in host memory.
    pub fn host(&self) -> Option<&[f16]> {
        match &self.store {
            Store::Host(v) => Some(v),
            Store::Cuda(_) => None,
        }
    }

    /// The values, when the pages are in host memory.
    pub fn host_mut(&mut self) -> Option<&mut [f16]> {
        match &mut self.store {
            Store::Host(v) => Some(v),
            Store::Cuda(_) => None,
        }
    }

    /// The pages, when they are in device memory.
    pub fn device_mut(&mut self) -> Option<&mut DeviceKv> {
        match &mut self.store {
            Store::Host(_) => None,
            Store::Cuda(kv) => Some(kv),
        }
    }

    /// The bytes of one page (little-endian f16), as a page's frame carries them, when the
    /// pages are in host memory (and the page exists).
    pub fn page_bytes(&self, page: PageId) -> Option<&[u8]> {
        let n = self.layout.page_values();
        let values = self.host()?.get(page.index() * n..(page.index() + 1) * n)?;
        Some(bytemuck::cast_slice(values))
    }

    fn check_page(&self, page: PageId) -> Result<(), SlotError> {
        if page.index() >= self.pages {
            return Err(SlotError::NoSuchPage { page });
        }
        Ok(())
    }

    /// A copy of one page's values.
    pub fn page(&self, page: PageId) -> Result<Vec<f16>, SlotError> {
        self.check_page(page)?;
        let n = self.layout.page_values();
        let runs = Runs {
            start: page.index() * n,
            runs: 1,
            stride: n,
            width: n,
        };
        self.read_runs(&runs)
    }

    /// Where `slots` of `page` lie: one run per (layer, K/V, head).
    fn slot_runs(&self, page: PageId, slots: &Range<usize>) -> Result<Runs, SlotError> {
        let l = self.layout;
        self.check_page(page)?;
        if slots.start >= slots.end || slots.end > l.page_tokens {
            return Err(SlotError::Slots {
                slots: slots.clone(),
                page_tokens: l.page_tokens,
            });
        }
        Ok(Runs {
            start: page.index() * l.page_values() + slots.start * l.head_dim,
            runs: l.layers * 2 * l.kv_heads,
            stride: l.page_tokens * l.head_dim,
            width: slots.len() * l.head_dim,
        })
    }

    fn read_runs(&self, runs: &Runs) -> Result<Vec<f16>, SlotError> {
        Ok(match &self.store {
            Store::Host(v) => {
                let mut out = Vec::with_capacity(runs.runs * runs.width);
                for r in runs.ranges() {
                    out.extend_from_slice(&v[r]);
                }
                out
            }
            Store::Cuda(kv) => kv
                .read_runs(runs.start, runs.runs, runs.stride, runs.width)?
                .into_iter()
                .map(f16::from_bits)
                .collect(),
        })
    }

    /// The KV of `slots` of `page` — every layer, K and V, every head — as little-endian f16
    /// bytes: `slots.len() * layout.token_bytes()` of them.
    pub fn read_slots(&self, page: PageId, slots: Range<usize>) -> Result<Vec<u8>, SlotError> {
        let runs = self.slot_runs(page, &slots)?;
        Ok(match &self.store {
            // Host memory: straight into the frame's bytes, one copy.
            Store::Host(v) => {
                let mut bytes = Vec::with_capacity(runs.runs * runs.width * 2);
                for r in runs.ranges() {
                    bytes.extend_from_slice(bytemuck::cast_slice(&v[r]));
                }
                bytes
            }
            Store::Cuda(_) => bytemuck::cast_slice(&self.read_runs(&runs)?).to_vec(),
        })
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
        let runs = self.slot_runs(page, &slots)?;
        match &mut self.store {
            Store::Host(v) => {
                for (run, src) in runs.ranges().zip(bytes.chunks_exact(runs.width * 2)) {
                    let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut v[run]);
                    dst.copy_from_slice(src);
                }
            }
            Store::Cuda(kv) => {
                let values: Vec<u16> = bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                kv.write_runs(runs.start, runs.stride, runs.width, &values)?;
            }
        }
        Ok(())
    }

    /// Overwrites a released page as `scrub` says (on the device for device memory).
    pub fn scrub(&mut self, page: PageId, scrub: Scrub) -> Result<(), SlotError> {
        self.check_page(page)?;
        let n = self.layout.page_values();
        let fill = match scrub {
            Scrub::None => return Ok(()),
            Scrub::Zero => f16::ZERO,
            Scrub::Canary => CANARY,
        };
        match &mut self.store {
            Store::Host(v) => v[page.index() * n..(page.index() + 1) * n].fill(fill),
            Store::Cuda(kv) => kv.fill(page.index() * n, n, fill.to_bits())?,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use bulkhead_kernels::device_test;

    use super::*;

    const LAYOUT: KvLayout = KvLayout {
        layers: 2,
        kv_heads: 3,
        head_dim: 32,
        page_tokens: 8,
    };

    /// Distinct bytes for `slots` of a page, from `seed`.
    fn pattern(slots: usize, seed: usize) -> Vec<u8> {
        (0..slots * LAYOUT.token_bytes() / 2)
            .flat_map(|i| f16::from_f32(((i * 7 + seed) % 1000) as f32).to_le_bytes())
            .collect()
    }

    fn slots_move_between_pools_exactly(dev: &Device) -> Result<(), DeviceError> {
        let mut a = KvMemory::on(dev, LAYOUT, 3)?;
        for p in 0..3 {
            a.write_slots(PageId::new(p), 0..8, &pattern(8, p as usize))
                .unwrap();
        }
        let bytes = a.read_slots(PageId::new(1), 2..5).unwrap();
        assert_eq!(bytes.len(), 3 * LAYOUT.token_bytes());
        let mut b = KvMemory::on(dev, LAYOUT, 2)?;
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
        // Host and device memory agree on the layout: a page read whole holds the slots'
        // runs where the kernels put them.
        let page = a.page(PageId::new(1)).unwrap();
        let run = LAYOUT.page_tokens * LAYOUT.head_dim;
        let first: Vec<u8> = bytemuck::cast_slice(&page[2 * 32..5 * 32]).to_vec();
        assert_eq!(first, bytes[..3 * 32 * 2]);
        assert_eq!(page.len(), 2 * 2 * 3 * run);
        Ok(())
    }
    device_test!(slots_move_between_pools_exactly);

    fn scrub_zeroes_or_plants_the_canary_in_exactly_one_page(
        dev: &Device,
    ) -> Result<(), DeviceError> {
        let mut m = KvMemory::on(dev, LAYOUT, 3)?;
        for p in 0..3 {
            m.write_slots(PageId::new(p), 0..8, &pattern(8, 1)).unwrap();
        }
        m.scrub(PageId::new(1), Scrub::Canary).unwrap();
        m.scrub(PageId::new(2), Scrub::Zero).unwrap();
        m.scrub(PageId::new(0), Scrub::None).unwrap();
        let bits = |p| -> Vec<u16> {
            m.page(PageId::new(p))
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert!(bits(1).iter().all(|&b| b == CANARY.to_bits()));
        assert!(bits(2).iter().all(|&b| b == 0));
        assert_eq!(m.read_slots(PageId::new(0), 0..8).unwrap(), pattern(8, 1));
        assert!(matches!(
            m.scrub(PageId::new(3), Scrub::Zero),
            Err(SlotError::NoSuchPage { .. })
        ));
        Ok(())
    }
    device_test!(scrub_zeroes_or_plants_the_canary_in_exactly_one_page);

    fn bad_slot_requests_are_errors(dev: &Device) -> Result<(), DeviceError> {
        let mut m = KvMemory::on(dev, LAYOUT, 1)?;
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
        Ok(())
    }
    device_test!(bad_slot_requests_are_errors);
}
