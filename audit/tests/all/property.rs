//! Property: random appends across tenants always verify, and any single-byte change anywhere
//! in the log (segments and heads, and a keyed log's roster) makes verification fail, unkeyed
//! or keyed.

use std::path::{Path, PathBuf};

use bulkhead_audit::{AuditLog, ChainKey, verify};
use proptest::prelude::*;

use crate::common::*;

const TENANTS: [&str; 3] = ["t0", "t-1", "t_2"];

/// The log's files; with the roster when `keyed` (an unkeyed roster is not sealed: a flip can
/// turn one listed id into another that is also valid).
fn log_files(dir: &Path, keyed: bool) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if keyed {
        out.push(dir.join("TENANTS"));
    }
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
        keyed in any::<bool>(),
    ) {
        let dir = Scratch::new();
        let key = keyed.then(|| ChainKey::new([7; 32]).unwrap());
        let open = || {
            let config = bulkhead_audit::Config { key: key.clone(), ..config(dir.path(), segment_bytes) };
            let (log, recoveries) = AuditLog::open(config).unwrap();
            assert_eq!(recoveries, vec![]);
            log
        };
        let mut log = Some(open());
        for (k, (t, i)) in appends.iter().enumerate() {
            if k == reopen_at {
                drop(log.take());
                log = Some(open());
            }
            let id = tenant(TENANTS[*t]);
            log.as_ref().unwrap().append(&id, &record(&id, *i)).unwrap();
        }
        drop(log);
        let report = verify(dir.path(), None, key.as_ref());
        prop_assert!(report.passed(), "{}", report);

        let files = log_files(dir.path(), keyed);
        let file = flip.0.get(&files);
        let mut bytes = std::fs::read(file).unwrap();
        let at = flip.1.index(bytes.len());
        bytes[at] ^= flip.2;
        std::fs::write(file, &bytes).unwrap();
        let report = verify(dir.path(), None, key.as_ref());
        prop_assert!(!report.passed(), "flipping byte {} of {:?} went unnoticed", at, file);
    }
}
