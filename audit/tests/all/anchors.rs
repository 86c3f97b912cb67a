//! Anchors: a record's place and its line's SHA-256, kept apart from the log (the collector's
//! copy of the exported record, or a digest `/v1/audit` returned). A log rolled back to an older
//! copy of itself passes `verify`, keyed or not — the copy's seals were made with the key — and
//! fails it with an anchor taken after the copy.

use std::path::Path;

use bulkhead_audit::{
    Anchor, AuditLog, ChainKey, Reason, Receipt, Seq, Sha256Digest, read, verify, verify_anchored,
};

use crate::common::*;

fn open_with(dir: &Path, key: Option<&ChainKey>) -> AuditLog {
    let (log, _) = AuditLog::open(bulkhead_audit::Config {
        key: key.cloned(),
        ..config(dir, 1 << 20)
    })
    .expect("opens");
    log
}

fn anchor(receipt: &Receipt) -> Anchor {
    Anchor {
        tenant: receipt.tenant.clone(),
        seq: receipt.seq,
        sha256: receipt.line_sha256,
    }
}

#[test]
fn a_log_rolled_back_to_an_older_copy_passes_alone_and_fails_with_a_later_anchor() {
    let key = ChainKey::new(vec![7; 32]).expect("32 bytes");
    for key in [None, Some(&key)] {
        let (dir, older) = (Scratch::new(), Scratch::new());
        let a = tenant("a");
        let log = open_with(dir.path(), key);
        for i in 0..3 {
            log.append(&a, &record(&a, i)).expect("appends");
        }
        drop(log);
        copy_tree(dir.path(), older.path());
        let log = open_with(dir.path(), key);
        let receipts: Vec<Receipt> = (3..6)
            .map(|i| log.append(&a, &record(&a, i)).expect("appends"))
            .collect();
        drop(log);
        // What a receipt anchors is what a reader of the log is given.
        let stored = read(dir.path(), &a, Seq(0), 10).expect("reads");
        for r in &receipts {
            let s = &stored[r.seq.0 as usize];
            assert_eq!((s.seq, s.digest), (r.seq, r.line_sha256));
        }
        let last = anchor(&receipts[2]);
        assert!(verify_anchored(dir.path(), None, key, std::slice::from_ref(&last)).passed());

        std::fs::remove_dir_all(dir.path()).expect("removes the log");
        copy_tree(older.path(), dir.path());
        assert!(
            verify(dir.path(), None, key).passed(),
            "the older copy verifies on its own (keyed: {})",
            key.is_some()
        );
        let report = verify_anchored(dir.path(), None, key, &[anchor(&receipts[0]), last]);
        let problem = report.first_problem().expect("the rollback is named");
        assert_eq!(
            problem.reason,
            Reason::RolledBack {
                anchored: Seq(5),
                from: Seq(3)
            },
            "{report}"
        );
        assert_eq!(problem.line, Some(4), "where record 3 should be: {report}");

        // An anchor at a record that is there, from another line: a rewrite.
        let other = Anchor {
            tenant: a.clone(),
            seq: Seq(1),
            sha256: Sha256Digest::of(b"another line"),
        };
        let report = verify_anchored(dir.path(), None, key, &[other]);
        let problem = report.first_problem().expect("the rewrite is named");
        assert_eq!(problem.reason, Reason::AnchorDiffers { seq: Seq(1) });
        assert_eq!(problem.line, Some(2));
    }
}

#[test]
fn an_anchored_tenant_whose_log_is_gone_with_its_roster_line_is_rolled_back() {
    let dir = Scratch::new();
    let a = tenant("a");
    let log = open(dir.path(), 1 << 20);
    let receipt = log.append(&a, &record(&a, 0)).expect("appends");
    drop(log);
    // The whole directory as it was before tenant `a` began: no roster line, no directory.
    std::fs::remove_dir_all(dir.path().join("a")).expect("removes a's log");
    std::fs::write(dir.path().join("TENANTS"), "").expect("empties the roster");
    assert!(
        verify(dir.path(), None, None).passed(),
        "nothing to see alone"
    );
    let report = verify_anchored(dir.path(), None, None, &[anchor(&receipt)]);
    assert_eq!(
        report.first_problem().map(|p| &p.reason),
        Some(&Reason::RolledBack {
            anchored: Seq(0),
            from: Seq(0)
        }),
        "{report}"
    );
}

#[test]
fn an_anchor_is_written_tenant_seq_and_sha256() {
    let digest = Sha256Digest::of(b"a line");
    let parsed: Anchor = format!("tenant-a:42:{digest}").parse().expect("parses");
    assert_eq!(
        parsed,
        Anchor {
            tenant: tenant("tenant-a"),
            seq: Seq(42),
            sha256: digest
        }
    );
    for bad in [
        "tenant-a:42".to_owned(),
        format!("tenant-a:42:{digest}:x"),
        format!("Tenant-A:42:{digest}"),
        format!("tenant-a:-1:{digest}"),
        format!("tenant-a:+1:{digest}"),
        "tenant-a:42:abc".to_owned(),
    ] {
        let e = bad.parse::<Anchor>().expect_err(&bad);
        assert!(e.contains("TENANT:SEQ:SHA256"), "{e}");
    }
}
