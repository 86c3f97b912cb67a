//! Property: random appends across tenants always verify, and any single-byte change anywhere
//! in the log (segments and heads) makes verification fail.

use std::path::{Path, PathBuf};

use bulkhead_audit::verify;
use proptest::prelude::*;

use crate::common::*;

const TENANTS: [&str; 3] = ["t0", "t-1", "t_2"];

fn log_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for t in TENANTS {
        let Ok(entries) = std::fs::read_dir(dir.join(t)) else {
            continue;
        };
        out.extend(entries.map(|e| e.expect("read a directory entry").path()));
    }
    out.sort();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn appends_verify_and_any_byte_flip_is_detected(
        appends in prop::collection::vec((0..TENANTS.len(), 0u64..1000), 1..40),
        segment_bytes in 300u64..3000,
        reopen_at in 0usize..40,
        flip in (any::<prop::sample::Index>(), any::<prop::sample::Index>(), 1u8..=255),
    ) {
        let dir = Scratch::new();
        let mut log = Some(open(dir.path(), segment_bytes));
        for (k, (t, i)) in appends.iter().enumerate() {
            if k == reopen_at {
                drop(log.take());
                log = Some(open(dir.path(), segment_bytes));
            }
            let id = tenant(TENANTS[*t]);
            log.as_ref().unwrap().append(&id, &record(&id, *i)).unwrap();
        }
        drop(log);
        let report = verify(dir.path(), None, None);
        prop_assert!(report.passed(), "{}", report);

        let files = log_files(dir.path());
        let file = flip.0.get(&files);
        let mut bytes = std::fs::read(file).unwrap();
        let at = flip.1.index(bytes.len());
        bytes[at] ^= flip.2;
        std::fs::write(file, &bytes).unwrap();
        let report = verify(dir.path(), None, None);
        prop_assert!(!report.passed(), "flipping byte {} of {:?} went unnoticed", at, file);
    }
}
