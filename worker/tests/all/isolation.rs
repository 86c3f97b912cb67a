//! Invariant I2 (no stale reads) at the kernel boundary: a page table that outlived its
//! allocation must never attend over the pages' new owner. Every test runs on every device
//! (`device_test!`): the tag check and the canary live in each device's attention kernel.

use bulkhead_kernels::attention::{IntegrityError, TagCheck};
use bulkhead_kernels::{Device, DeviceError, device_test};
use bulkhead_kvpool::{PageRef, Scrub};
use bulkhead_worker::model::SeqFailure;
use bulkhead_worker::tiny_model::TinySpec;

use crate::common::{Session, tiny_model_on};

/// What A's stale step produced, and what A's step computes over its own KV alone.
type StaleRead = (Result<Vec<f32>, SeqFailure>, Vec<f32>);

/// Tenant A prefills, its pages are released and handed to tenant B, and then A's stale page
/// table is used for one more decode step.
fn stale_read(dev: &Device, check: TagCheck) -> Result<StaleRead, DeviceError> {
    stale_read_with(dev, check, Scrub::None, true)
}

/// As [`stale_read`], with a scrub policy, and B's prefill optional (A's pages released, not
/// yet reused).
fn stale_read_with(
    dev: &Device,
    check: TagCheck,
    scrub: Scrub,
    reuse: bool,
) -> Result<StaleRead, DeviceError> {
    let loaded = tiny_model_on(TinySpec::default(), dev)?;
    let prompt_a: Vec<u32> = (3..35).collect();
    let prompt_b: Vec<u32> = (100..132).collect();
    // Two pages: exactly one 32-token sequence, so B must reuse A's pages.
    let mut s = Session::new(&loaded.model, 2, scrub);
    s.check = check;

    let a = s.allocate(1, 32);
    s.run(a.pages(), 0, &prompt_a[..31]).expect("A prefills");
    let stale: Vec<PageRef> = a.pages().to_vec();
    drop(a);
    if reuse {
        let b = s.allocate(2, 32);
        assert_eq!(
            b.pages().iter().map(|p| p.page).collect::<Vec<_>>(),
            stale.iter().map(|p| p.page).collect::<Vec<_>>(),
            "B got A's physical pages"
        );
        s.run(b.pages(), 0, &prompt_b[..31]).expect("B prefills");
    }
    let through_stale_table = s.run(&stale, 31, &prompt_a[31..]);

    // What A's last step computes over its own KV, on a fresh pool, in the same two steps.
    let mut fresh = Session::new(&loaded.model, 2, Scrub::None);
    let own = fresh.allocate(1, 32);
    fresh
        .run(own.pages(), 0, &prompt_a[..31])
        .expect("A alone prefills");
    let honest = fresh
        .run(own.pages(), 31, &prompt_a[31..])
        .expect("A alone");
    Ok((through_stale_table, honest))
}

fn without_the_tag_check_a_stale_table_reads_another_tenants_kv(
    dev: &Device,
) -> Result<(), DeviceError> {
    let (stale, honest) = stale_read(dev, TagCheck::Off)?;
    let leaked = stale.expect("nothing stops the read when the check is off");
    assert_ne!(
        leaked, honest,
        "the stale read attended over B's KV, not A's"
    );
    // The control: the same stale table with A's pages not handed on reads A's own KV, and
    // computes exactly what A alone does (so the difference above is B's KV, nothing else).
    let (unreused, honest) = stale_read_with(dev, TagCheck::Off, Scrub::None, false)?;
    assert_eq!(unreused.expect("read"), honest);
    Ok(())
}
device_test!(without_the_tag_check_a_stale_table_reads_another_tenants_kv);

fn the_tag_check_stops_a_stale_table(dev: &Device) -> Result<(), DeviceError> {
    let (stale, _) = stale_read(dev, TagCheck::On)?;
    match stale {
        Err(SeqFailure::Integrity(IntegrityError::TagMismatch { index: 0, .. })) => {}
        other => panic!("expected a tag mismatch on the first page, got {other:?}"),
    }
    Ok(())
}
device_test!(the_tag_check_stops_a_stale_table);

fn zeroed_pages_are_zero_after_release(dev: &Device) -> Result<(), DeviceError> {
    let loaded = tiny_model_on(TinySpec::default(), dev)?;
    let mut s = Session::new(&loaded.model, 2, Scrub::Zero);
    let a = s.allocate(1, 32);
    s.run(a.pages(), 0, &[5, 6, 7]).expect("prefill");
    let page = a.pages()[0].page;
    assert!(
        s.kv.page(page)
            .expect("page")
            .iter()
            .any(|v| v.to_f32() != 0.0),
        "prefill wrote the page"
    );
    drop(a);
    let kv = &mut s.kv;
    s.pool
        .scrub_pending(|p| kv.scrub(p, Scrub::Zero).expect("scrub"));
    assert!(
        s.kv.page(page)
            .expect("page")
            .iter()
            .all(|v| v.to_bits() == 0),
        "released page is zeroed"
    );
    Ok(())
}
device_test!(zeroed_pages_are_zero_after_release);

fn the_canary_catches_a_read_of_a_released_page_even_without_the_tag_check(
    dev: &Device,
) -> Result<(), DeviceError> {
    let (stale, _) = stale_read_with(dev, TagCheck::Off, Scrub::Canary, false)?;
    match stale {
        Err(SeqFailure::Integrity(IntegrityError::CanaryRead { position: 0 })) => {}
        other => panic!("expected a canary read at position 0, got {other:?}"),
    }
    Ok(())
}
device_test!(the_canary_catches_a_read_of_a_released_page_even_without_the_tag_check);
