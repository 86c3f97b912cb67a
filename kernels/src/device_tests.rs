//! Every kernel, tested once per device: `on_cpu` at every SIMD level always, `on_cuda` under
//! the `cuda` feature (a loud skip without a GPU, see `testing`). The CPU's portable kernels
//! are the oracle; the tolerances below are what separates the CUDA kernels' float
//! reduction order from the CPU's.

use std::num::NonZeroU32;

use bulkhead_kvpool::{PagePool, PageRef, PoolConfig, RequestId, Scrub, Tag};
use half::f16;

use crate::attention::{
    CANARY, IntegrityError, KvLayout, PagedKv, PagedSeq, TagCheck, TagView, attend, write_kv,
};
use crate::cuda::{DeviceError, DeviceKv, StepSeq};
use crate::device::Device;
use crate::device_test;
use crate::ops::{Rope, add_assign, rms_norm, silu_mul};
use crate::quant::quantize_row;
use crate::test_values::uniform;
use crate::{Activations, DType, PackedMatrix, QMatrix, Simd, matmul};

/// Largest difference between two equally long vectors, relative to `b`'s largest magnitude
/// (at least 1).
fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let w = worst(got, want);
    assert!(w <= tol, "{what}: differs by {w} (relative) > {tol}");
}

fn rms_norm_case(dev: &Device) -> Result<(), DeviceError> {
    let (rows, dim) = (3, 96);
    let x = uniform(rows * dim, 1, 3.0);
    let w = uniform(dim, 2, 1.0);
    let mut want = vec![0.0; x.len()];
    rms_norm(&x, &w, 1e-5, &mut want);
    let got = match dev {
        Device::Cpu(_) => want.clone(),
        Device::Cuda(c) => {
            let mut out = c.zeros(x.len())?;
            c.rms_norm(&c.upload(&x)?, &c.upload(&w)?, 1e-5, rows, &mut out)?;
            c.download(&out, x.len())?
        }
    };
    assert_close("rms_norm", &got, &want, 1e-5);
    Ok(())
}
device_test!(rms_norm_case);

fn rope_case(dev: &Device) -> Result<(), DeviceError> {
    let (hd, heads) = (64, 3);
    let rope = Rope::new(hd, 100_000.0);
    let positions = [0usize, 1, 7, 300, 8191];
    let x = uniform(positions.len() * heads * hd, 3, 1.0);
    let mut want = x.clone();
    let mut angles = vec![(0.0, 0.0); hd / 2];
    for (row, &p) in want.chunks_exact_mut(heads * hd).zip(&positions) {
        rope.angles(p, &mut angles);
        Rope::apply(&angles, row);
    }
    let got = match dev {
        Device::Cpu(_) => want.clone(),
        Device::Cuda(c) => {
            let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
            let mut b = c.upload(&x)?;
            let (pb, fb) = (c.upload(&pos)?, c.upload(rope.inv_freq())?);
            c.rope(&mut b, positions.len(), heads * hd, &pb, &fb)?;
            c.download(&b, x.len())?
        }
    };
    assert_close("rope", &got, &want, 1e-5);
    Ok(())
}
device_test!(rope_case);

fn elementwise_case(dev: &Device) -> Result<(), DeviceError> {
    let (a, b) = (uniform(200, 4, 6.0), uniform(200, 5, 2.0));
    let (mut silu, mut sum) = (a.clone(), a.clone());
    silu_mul(&mut silu, &b);
    add_assign(&mut sum, &b);
    let (got_silu, got_sum) = match dev {
        Device::Cpu(_) => (silu.clone(), sum.clone()),
        Device::Cuda(c) => {
            let bb = c.upload(&b)?;
            let (mut s, mut t) = (c.upload(&a)?, c.upload(&a)?);
            c.silu_mul(&mut s, &bb, a.len())?;
            c.add_assign(&mut t, &bb, a.len())?;
            (c.download(&s, a.len())?, c.download(&t, a.len())?)
        }
    };
    assert_close("silu_mul", &got_silu, &silu, 1e-6);
    assert_close("add_assign", &got_sum, &sum, 0.0);
    Ok(())
}
device_test!(elementwise_case);

const DTYPES: [DType; 5] = [
    DType::F32,
    DType::F16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q8_0,
];

fn matrix(dtype: DType, rows: usize, cols: usize, seed: u32) -> Vec<u8> {
    uniform(rows * cols, seed, 1.0)
        .chunks(cols)
        .flat_map(|r| quantize_row(dtype, r))
        .collect()
}

/// `w · x` on `dev` for `n` activation rows.
fn matmul_on(dev: &Device, w: &QMatrix<'_>, x: &[f32], n: usize) -> Result<Vec<f32>, DeviceError> {
    match dev {
        Device::Cpu(simd) => {
            let mut acts = Activations::default();
            acts.load(x, n, w.cols());
            let mut out = vec![0.0; n * w.rows()];
            // The CPU reads the weights packed (as the model loads them); CUDA, the file's
            // GGUF blocks.
            matmul(*simd, &PackedMatrix::pack(w), &acts, &mut out);
            Ok(out)
        }
        Device::Cuda(c) => {
            let dw = c.upload_matrix(w)?;
            let mut acts = c.acts(n, w.cols())?;
            c.write(x, acts.values_mut())?;
            c.quantize(&mut acts)?;
            let mut out = c.zeros(n * w.rows())?;
            c.matmul(&dw, &acts, &mut out)?;
            c.download(&out, n * w.rows())
        }
    }
}

fn matmul_case(dev: &Device) -> Result<(), DeviceError> {
    let (rows, cols) = (40, 96);
    for dtype in DTYPES {
        let data = matrix(dtype, rows, cols, 11);
        let w = QMatrix::new(dtype, rows, cols, &data).expect("shape");
        // 9 rows: a whole tile of 8 and a remainder on CUDA, 2 tiles of 4 and one on the CPU.
        let n = 9;
        let x = uniform(n * cols, 12, 2.0);
        let want = matmul_on(&Device::Cpu(Simd::PORTABLE), &w, &x, n)?;
        let got = matmul_on(dev, &w, &x, n)?;
        assert_close(&format!("matmul {dtype:?}"), &got, &want, 1e-5);
        // Batch invariance: each row alone gives exactly its row of the batch.
        for t in [0, 8] {
            let alone = matmul_on(dev, &w, &x[t * cols..(t + 1) * cols], 1)?;
            assert_eq!(alone, got[t * rows..(t + 1) * rows], "{dtype:?} row {t}");
        }
    }
    Ok(())
}
device_test!(matmul_case);

/// Activations quantized to Q8 round halves to even on every device (as the CPU always did;
/// CUDA's `roundf` rounded them away from zero): with a block scale of exactly 1, 2.5 is 2,
/// -2.5 is -2, 0.5 is 0 and 1.5 is 2, read back through one-hot weight rows.
fn q8_ties_round_to_even_case(dev: &Device) -> Result<(), DeviceError> {
    let (rows, cols) = (8, 64);
    let mut one_hot = vec![0.0f32; rows * cols];
    for r in 0..rows {
        one_hot[r * cols + r] = 1.0;
    }
    let data: Vec<u8> = one_hot
        .chunks(cols)
        .flat_map(|r| quantize_row(DType::Q8_0, r))
        .collect();
    let w = QMatrix::new(DType::Q8_0, rows, cols, &data).expect("shape");
    let mut x = vec![0.0f32; cols];
    x[..5].copy_from_slice(&[127.0, 2.5, -2.5, 0.5, 1.5]);
    let rounded = [127.0, 2.0, -2.0, 0.0, 2.0, 0.0, 0.0, 0.0];
    let mut row = vec![0.0f32; cols];
    let want: Vec<f32> = (0..rows)
        .map(|r| {
            w.dequantize_row(r, &mut row);
            row[r] * rounded[r]
        })
        .collect();
    let got = matmul_on(dev, &w, &x, 1)?;
    assert_close("q8 ties", &got, &want, 1e-5);
    Ok(())
}
device_test!(q8_ties_round_to_even_case);

fn embedding_case(dev: &Device) -> Result<(), DeviceError> {
    let (rows, cols) = (10, 64);
    for dtype in DTYPES {
        let data = matrix(dtype, rows, cols, 13);
        let w = QMatrix::new(dtype, rows, cols, &data).expect("shape");
        let ids = [3u32, 0, 9, 3];
        let mut want = vec![0.0; ids.len() * cols];
        for (o, &id) in want.chunks_exact_mut(cols).zip(&ids) {
            w.dequantize_row(id as usize, o);
        }
        let got = match dev {
            Device::Cpu(_) => want.clone(),
            Device::Cuda(c) => {
                let mut out = c.zeros(want.len())?;
                c.get_rows(&c.upload_matrix(&w)?, &c.upload(&ids)?, ids.len(), &mut out)?;
                c.download(&out, want.len())?
            }
        };
        assert_eq!(got, want, "{dtype:?}");
    }
    Ok(())
}
device_test!(embedding_case);

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    kv_heads: 2,
    head_dim: 32,
    page_tokens: 4,
};
const HEADS: usize = 4;

/// A KV pool on a device.
enum Pool {
    Host(Vec<f16>),
    Cuda(DeviceKv),
}

impl Pool {
    fn new(dev: &Device, pages: usize) -> Result<Pool, DeviceError> {
        Ok(match dev {
            Device::Cpu(_) => Pool::Host(vec![f16::ZERO; LAYOUT.page_values() * pages]),
            Device::Cuda(c) => Pool::Cuda(c.kv_pool(LAYOUT, pages)?),
        })
    }

    fn fill_page(&mut self, page: usize, bits: u16) -> Result<(), DeviceError> {
        let n = LAYOUT.page_values();
        match self {
            Pool::Host(v) => v[page * n..(page + 1) * n].fill(f16::from_bits(bits)),
            Pool::Cuda(kv) => kv.fill(page * n, n, bits)?,
        }
        Ok(())
    }

    /// Writes the new tokens' K/V into `layer` and attends over them: the attention output,
    /// or the integrity error the kernels found.
    fn step(
        &mut self,
        dev: &Device,
        tags: TagView<'_>,
        seq: PagedSeq<'_>,
        layer: usize,
        kv: (&[f32], &[f32]),
        q: &[f32],
    ) -> Result<Result<Vec<f32>, IntegrityError>, DeviceError> {
        let mut out = vec![0.0; q.len()];
        match (self, dev) {
            (Pool::Host(mem), Device::Cpu(simd)) => {
                let r = write_kv(&LAYOUT, mem, tags, seq, layer, kv).and_then(|()| {
                    let paged = PagedKv {
                        layout: &LAYOUT,
                        values: mem,
                        tags,
                    };
                    attend(*simd, paged, seq, layer, q, &mut out)
                });
                Ok(r.map(|()| out))
            }
            (Pool::Cuda(pool), Device::Cuda(c)) => {
                let s = StepSeq {
                    table: seq.table,
                    cached: seq.cached,
                    new: seq.new,
                    active: true,
                };
                let mut step = c.kv_step(&LAYOUT, tags.tags, tags.check, tags.canary, &[s])?;
                let (k, v) = (c.upload(kv.0)?, c.upload(kv.1)?);
                c.write_kv(pool, &mut step, layer, &k, &v)?;
                let mut o = c.zeros(q.len())?;
                c.attend(pool, &mut step, layer, &c.upload(q)?, HEADS, &mut o)?;
                let failures = c.step_failures(&step)?;
                Ok(match failures.into_iter().next().flatten() {
                    Some(e) => Err(e),
                    None => Ok(c.download(&o, q.len())?),
                })
            }
            _ => unreachable!("pools are made for their device"),
        }
    }
}

fn pool_config(pages: u32) -> PoolConfig {
    PoolConfig {
        pages: NonZeroU32::new(pages).expect("pages"),
        page_tokens: NonZeroU32::new(LAYOUT.page_tokens as u32).expect("page tokens"),
        scrub: Scrub::None,
    }
}

fn paged_attention_case(dev: &Device) -> Result<(), DeviceError> {
    let pool = PagePool::new(pool_config(8));
    // Take and drop an allocation first so the sequence's pages are not 0, 1, 2, ….
    drop(
        pool.reserve(pool.admit(RequestId::new(9), 8).expect("fits"))
            .expect("free"),
    );
    let alloc = pool
        .reserve(pool.admit(RequestId::new(1), 11).expect("fits"))
        .expect("free")
        .commit();
    let kvd = LAYOUT.kv_heads * LAYOUT.head_dim;
    let (k, v) = (uniform(11 * kvd, 1, 1.0), uniform(11 * kvd, 2, 1.0));
    let q = uniform(11 * HEADS * LAYOUT.head_dim, 3, 1.0);
    let mut on_dev = Pool::new(dev, 8)?;
    let oracle_dev = Device::Cpu(Simd::PORTABLE);
    let mut oracle = Pool::new(&oracle_dev, 8)?;
    let qd = HEADS * LAYOUT.head_dim;
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
            let kv = (&k[rows.clone()], &v[rows]);
            let qrows = &q[cached * qd..(cached + new) * qd];
            let want = oracle.step(&oracle_dev, view, seq, 1, kv, qrows)?;
            let got = on_dev.step(dev, view, seq, 1, kv, qrows)?;
            let (want, got) = (want.expect("oracle"), got.expect("device"));
            assert_close(&format!("attention at {cached}+{new}"), &got, &want, 1e-5);
        }
        Ok(())
    })
}
device_test!(paged_attention_case);

/// A stale page table (a page whose tag changed) and a read of a canary-filled page fail the
/// call with the same error on every device, and nothing is written into the stale page.
fn integrity_case(dev: &Device) -> Result<(), DeviceError> {
    let pool = PagePool::new(pool_config(4));
    let alloc = pool
        .reserve(pool.admit(RequestId::new(1), 8).expect("fits"))
        .expect("free")
        .commit();
    let kvd = LAYOUT.kv_heads * LAYOUT.head_dim;
    let qd = HEADS * LAYOUT.head_dim;
    let (k, v, q) = (
        uniform(6 * kvd, 4, 1.0),
        uniform(6 * kvd, 5, 1.0),
        uniform(6 * qd, 6, 1.0),
    );
    let mut mem = Pool::new(dev, 4)?;
    let mut stale: Vec<PageRef> = alloc.pages().to_vec();
    stale[1].tag = Tag::new(stale[1].tag.get() + 1000);
    pool.with_tags(|tags| {
        let view = TagView {
            tags,
            check: TagCheck::On,
            canary: true,
        };
        let table = alloc.pages();
        let seq = |table, cached, new| PagedSeq { table, cached, new };
        // Five good tokens, then one through the stale table.
        mem.step(
            dev,
            view,
            seq(table, 0, 5),
            0,
            (&k[..5 * kvd], &v[..5 * kvd]),
            &q[..5 * qd],
        )?
        .expect("a valid table");
        let got = mem.step(
            dev,
            view,
            seq(&stale, 5, 1),
            0,
            (&k[5 * kvd..], &v[5 * kvd..]),
            &q[5 * qd..],
        )?;
        assert_eq!(
            got,
            Err(IntegrityError::TagMismatch {
                index: 1,
                expected: stale[1].tag,
                found: Some(table[1].tag),
            })
        );
        // The second page holds the canary (as a released page would): the next read fails
        // at its first position.
        mem.fill_page(table[1].page.index(), CANARY.to_bits())?;
        let got = mem.step(
            dev,
            view,
            seq(table, 5, 1),
            0,
            (&k[5 * kvd..], &v[5 * kvd..]),
            &q[5 * qd..],
        )?;
        assert_eq!(got, Err(IntegrityError::CanaryRead { position: 4 }));
        // Too short a table is refused before any kernel runs.
        let got = mem.step(
            dev,
            view,
            seq(&table[..1], 4, 1),
            0,
            (&k[..kvd], &v[..kvd]),
            &q[..qd],
        )?;
        assert_eq!(
            got,
            Err(IntegrityError::TableTooShort {
                pages: 1,
                needed: 2,
                tokens: 5
            })
        );
        Ok(())
    })
}
device_test!(integrity_case);
