//! Writer and reader: round trips, rotation, reopen, recovery, durability modes, pagination.

use std::time::{Duration, Instant};

use bulkhead_audit::{
    AuditError, AuditLog, AuditRecord, Durability, Limit, Recovery, Seq, Sha256Digest, Stored,
    TenantId, TenantIdError, verify,
};

use crate::common::*;

/// Each record's place and the record, without its digest.
fn pairs(read: Vec<Stored>) -> Vec<(Seq, AuditRecord)> {
    read.into_iter().map(|s| (s.seq, s.record)).collect()
}

#[test]
fn round_trip_across_tenants() {
    let dir = Scratch::new();
    let (a, b) = (tenant("a"), tenant("b"));
    let log = open(dir.path(), 1 << 20);
    let mut receipts = Vec::new();
    for i in 0..3 {
        let r = log.append(&a, &record(&a, i)).unwrap();
        assert_eq!((r.seq, r.durable), (Seq(i), true));
        receipts.push(r);
    }
    log.append(&b, &record(&b, 7)).unwrap();
    let got = log.read(&a, Seq(0), 100).unwrap();
    let want: Vec<_> = (0..3).map(|i| (Seq(i), record(&a, i))).collect();
    assert_eq!(pairs(got.clone()), want);
    let digests: Vec<_> = got.iter().map(|s| s.digest).collect();
    let appended: Vec<_> = receipts.iter().map(|r| r.digest).collect();
    assert_eq!(
        digests, appended,
        "a reader sees the digests the writer chained"
    );
    assert_eq!(
        pairs(log.read(&b, Seq(0), 100).unwrap()),
        vec![(Seq(0), record(&b, 7))]
    );
    let report = verify(dir.path(), None, None);
    assert!(report.passed(), "{report}");
    assert_eq!(report.tenants.len(), 2);
}

#[test]
fn a_record_of_another_tenant_is_refused() {
    let dir = Scratch::new();
    let log = open(dir.path(), 1 << 20);
    let err = log
        .append(&tenant("a"), &record(&tenant("b"), 0))
        .unwrap_err();
    assert!(matches!(err, AuditError::TenantMismatch { .. }), "{err}");
}

/// A line of another tenant's log pasted into a tenant's is never read out as that tenant's:
/// the read fails as corrupt, naming the line (it was returned, another tenant's record under
/// this one's key).
#[test]
fn a_line_of_another_tenants_log_is_never_read_as_this_tenants() {
    let dir = Scratch::new();
    let (a, b) = (tenant("a"), tenant("b"));
    let log = open(dir.path(), 1 << 20);
    for i in 0..3 {
        log.append(&a, &record(&a, i)).unwrap();
    }
    log.append(&b, &record(&b, 7)).unwrap();
    let theirs = std::fs::read(&segments(dir.path(), &b)[0]).unwrap();
    let ours = &segments(dir.path(), &a)[0];
    let mut planted = std::fs::read(ours).unwrap();
    planted.extend_from_slice(&theirs);
    std::fs::write(ours, &planted).unwrap();
    let err = log.read(&a, Seq(0), 100).unwrap_err();
    assert!(matches!(&err, AuditError::Corrupt { line: 4, .. }), "{err}");
    assert_eq!(log.read(&b, Seq(0), 100).unwrap().len(), 1);
}

#[test]
fn first_prev_is_zero_and_json_uses_otel_names() {
    let dir = Scratch::new();
    let a = tenant("a");
    open(dir.path(), 1 << 20)
        .append(&a, &record(&a, 0))
        .unwrap();
    let line = &lines(&segments(dir.path(), &a)[0])[0];
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["seq"], 0);
    assert_eq!(v["prev"], "0".repeat(64));
    assert_eq!(v["gen_ai.request.model"], "smollm2-135m");
    assert_eq!(v["gen_ai.usage.input_tokens"], 10);
    assert_eq!(v["gen_ai.usage.output_tokens"], 0);
    assert!(
        v.get("bulkhead.prompt.content").is_none(),
        "content is off by default"
    );
}

#[test]
fn chain_continues_across_rotation() {
    let dir = Scratch::new();
    let a = tenant("a");
    let log = open(dir.path(), 2000);
    for i in 0..12 {
        log.append(&a, &record(&a, i)).unwrap();
    }
    let segs = segments(dir.path(), &a);
    assert!(segs.len() >= 3 && lines(&segs[0]).len() == 2, "{segs:?}");
    for pair in segs.windows(2) {
        let last = lines(&pair[0]).pop().unwrap();
        let first: serde_json::Value = serde_json::from_str(&lines(&pair[1])[0]).unwrap();
        assert_eq!(first["prev"], Sha256Digest::of(last.as_bytes()).to_hex());
    }
    for s in &segs {
        let len = std::fs::metadata(s).unwrap().len();
        assert!(len <= 2000 || lines(s).len() == 1, "{s:?} is {len} bytes");
    }
    let report = verify(dir.path(), Some(&a), None);
    assert!(report.passed(), "{report}");
    assert_eq!(report.tenants[0].records, 12);
}

#[test]
fn chain_continues_across_reopen() {
    let dir = Scratch::new();
    let a = tenant("a");
    {
        let log = open(dir.path(), 2000);
        for i in 0..5 {
            log.append(&a, &record(&a, i)).unwrap();
        }
    }
    let log = open(dir.path(), 2000);
    let r = log.append(&a, &record(&a, 5)).unwrap();
    assert_eq!(r.seq, Seq(5));
    drop(log);
    let report = verify(dir.path(), None, None);
    assert!(report.passed(), "{report}");
    assert_eq!(report.tenants[0].records, 6);
}

#[test]
fn a_second_writer_is_refused() {
    let dir = Scratch::new();
    let _log = open(dir.path(), 1 << 20);
    let err = AuditLog::open(config(dir.path(), 1 << 20)).unwrap_err();
    assert!(matches!(err, AuditError::Locked { .. }), "{err}");
}

/// Adds the start of a fourth record to `segment`: (its bytes before, after).
fn tear_last_line(segment: &std::path::Path) -> (Vec<u8>, Vec<u8>) {
    let before = std::fs::read(segment).expect("the segment");
    let mut torn = before.clone();
    torn.extend_from_slice(br#"{"seq":3,"prev":"ab"#);
    std::fs::write(segment, &torn).expect("written");
    (before, torn)
}

/// A line cut short past the head while the writer still holds the log is one being written
/// as `verify` reads it, not a torn write: `verify` beside a running gateway raised false
/// alarms. Once the writer is gone, the same bytes are a torn line.
#[test]
fn a_line_being_written_past_the_head_passes_while_the_writer_holds_the_log() {
    let dir = Scratch::new();
    let a = tenant("a");
    let log = open(dir.path(), 1 << 20);
    for i in 0..3 {
        log.append(&a, &record(&a, i)).unwrap();
    }
    tear_last_line(&segments(dir.path(), &a)[0]);
    let report = verify(dir.path(), None, None);
    assert!(report.passed(), "{:?}", report.first_problem());
    drop(log);
    let report = verify(dir.path(), None, None);
    let p = report.first_problem().expect("torn, with no writer");
    assert_eq!(p.reason, bulkhead_audit::Reason::TornLine);
}

#[test]
fn torn_last_line_is_cut_off_and_reported() {
    let dir = Scratch::new();
    let a = tenant("a");
    {
        let log = open(dir.path(), 1 << 20);
        for i in 0..3 {
            log.append(&a, &record(&a, i)).unwrap();
        }
    }
    let seg = &segments(dir.path(), &a)[0];
    let (before, torn) = tear_last_line(seg);
    let report = verify(dir.path(), None, None);
    let p = report.first_problem().unwrap();
    assert_eq!((p.path.as_path(), p.line), (seg.as_path(), Some(4)));
    assert_eq!(p.reason, bulkhead_audit::Reason::TornLine);

    let (log, recoveries) = AuditLog::open(config(dir.path(), 1 << 20)).unwrap();
    assert_eq!(
        recoveries,
        vec![Recovery::TruncatedTornLine {
            path: seg.clone(),
            bytes: (torn.len() - before.len()) as u64
        }]
    );
    assert_eq!(
        std::fs::read(seg).unwrap(),
        before,
        "every complete line is kept"
    );
    assert_eq!(log.append(&a, &record(&a, 3)).unwrap().seq, Seq(3));
    drop(log);
    assert!(verify(dir.path(), None, None).passed());
}

#[test]
fn a_lost_acknowledged_tail_refuses_to_open() {
    let dir = Scratch::new();
    let a = tenant("a");
    {
        let log = open(dir.path(), 1 << 20);
        for i in 0..3 {
            log.append(&a, &record(&a, i)).unwrap();
        }
    }
    let seg = &segments(dir.path(), &a)[0];
    let mut l = lines(seg);
    l.pop();
    write_lines(seg, &l);
    let err = AuditLog::open(config(dir.path(), 1 << 20)).unwrap_err();
    assert!(
        matches!(err, AuditError::HeadAhead { head: Seq(2), .. }),
        "{err}"
    );
}

/// A log refused at open is left as it was found: the torn half of the record the head names
/// is not cut off first (which would destroy what `verify` and an investigator need).
#[test]
fn a_refused_log_is_left_as_it_was_found() {
    let dir = Scratch::new();
    let a = three_records(&dir);
    let seg = &segments(dir.path(), &a)[0];
    let whole = std::fs::read(seg).unwrap();
    let torn = &whole[..whole.len() - 40];
    std::fs::write(seg, torn).unwrap();
    let err = AuditLog::open(config(dir.path(), 1 << 20)).unwrap_err();
    assert!(
        matches!(err, AuditError::HeadAhead { head: Seq(2), .. }),
        "{err}"
    );
    assert_eq!(
        std::fs::read(seg).unwrap(),
        torn,
        "the refused log is untouched"
    );
}

/// Three records of tenant `a`, written and closed.
fn three_records(dir: &Scratch) -> TenantId {
    let a = tenant("a");
    let log = open(dir.path(), 1 << 20);
    for i in 0..3 {
        log.append(&a, &record(&a, i)).expect("appended");
    }
    a
}

#[test]
fn an_edited_record_named_by_the_head_refuses_to_open() {
    // Resuming would chain the next record to the edited one and move the head past it, and
    // `verify` would then pass on a log it refuses now.
    let dir = Scratch::new();
    let a = three_records(&dir);
    let seg = &segments(dir.path(), &a)[0];
    let mut l = lines(seg);
    l[2] = l[2].replace(r#""req-2""#, r#""req-9""#);
    assert_ne!(l[2], lines(seg)[2], "the edit changed nothing");
    write_lines(seg, &l);
    assert!(!verify(dir.path(), None, None).passed());
    let err = AuditLog::open(config(dir.path(), 1 << 20)).unwrap_err();
    assert!(
        matches!(err, AuditError::HeadMismatch { head: Seq(2), .. }),
        "{err}"
    );
    assert!(
        !verify(dir.path(), None, None).passed(),
        "the evidence is still there"
    );
}

#[test]
fn a_removed_head_refuses_to_open_even_after_a_cut_tail() {
    // Cutting the last record and deleting the head left a chain `verify` refuses
    // (`HeadMissing`); a head rebuilt at the cut tip would hide the cut.
    let dir = Scratch::new();
    let a = three_records(&dir);
    let seg = &segments(dir.path(), &a)[0];
    let mut l = lines(seg);
    l.pop();
    write_lines(seg, &l);
    std::fs::remove_file(dir.path().join(a.as_str()).join("head")).unwrap();
    let err = AuditLog::open(config(dir.path(), 1 << 20)).unwrap_err();
    assert!(matches!(err, AuditError::HeadMissing { .. }), "{err}");
    assert!(
        !verify(dir.path(), None, None).passed(),
        "the evidence is still there"
    );
}

#[test]
fn records_after_the_head_are_resumed() {
    // A crash after a batch's lines were written and before its head: the head names an
    // earlier record, unchanged, and the chain goes on from the last line.
    let dir = Scratch::new();
    let a = three_records(&dir);
    let second = &lines(&segments(dir.path(), &a)[0])[1];
    let head = format!("1 {}\n", Sha256Digest::of(second.as_bytes()).to_hex());
    let head_path = dir.path().join(a.as_str()).join("head");
    std::fs::write(&head_path, head).unwrap();
    let log = open(dir.path(), 1 << 20);
    // Made durable at open (a crash may have left them in the page cache only), the head names
    // the last of them: a power loss cannot take them from under the records chained to them.
    assert!(
        std::fs::read_to_string(&head_path)
            .unwrap()
            .starts_with("2 "),
        "the head moved to the last record resumed"
    );
    assert_eq!(log.append(&a, &record(&a, 3)).unwrap().seq, Seq(3));
    drop(log);
    assert!(verify(dir.path(), None, None).passed());
}

#[test]
fn a_crash_before_a_new_tenants_first_head_resumes_from_the_genesis_head() {
    // A tenant's directory gets the genesis head before its first line, and its first record
    // goes down alone with a head naming it: a crash before that head leaves the genesis
    // head, the one record after it, and a log that starts again.
    let dir = Scratch::new();
    let a = three_records(&dir);
    let seg = &segments(dir.path(), &a)[0];
    write_lines(seg, &lines(seg)[..1]);
    let head = dir.path().join(a.as_str()).join("head");
    std::fs::write(&head, "genesis\n").unwrap();
    assert!(
        verify(dir.path(), None, None).passed(),
        "nothing acknowledged is missing"
    );
    let (log, recoveries) = AuditLog::open(config(dir.path(), 1 << 20)).unwrap();
    assert_eq!(recoveries, vec![]);
    // The head names that record now: a second crash, after more records, cannot leave the
    // genesis head behind more than one.
    assert!(
        std::fs::read_to_string(&head).unwrap().starts_with("0 "),
        "the head moved on at open"
    );
    assert_eq!(log.append(&a, &record(&a, 1)).unwrap().seq, Seq(1));
    drop(log);
    assert!(verify(dir.path(), None, None).passed());
    assert_ne!(
        std::fs::read(&head).unwrap(),
        b"genesis\n",
        "the head moved on"
    );
}

#[test]
fn a_genesis_head_before_more_than_one_record_refuses_to_open() {
    // More than a crash can leave behind a genesis head: the head was rewritten, here to
    // hide a cut tail. Refused, the log left as found; `verify` names it.
    let dir = Scratch::new();
    let a = three_records(&dir);
    let seg = &segments(dir.path(), &a)[0];
    write_lines(seg, &lines(seg)[..2]);
    let head = dir.path().join(a.as_str()).join("head");
    std::fs::write(&head, "genesis\n").unwrap();
    // With a torn tail too, which a log that is resumed has cut.
    let mut torn = std::fs::read(seg).unwrap();
    torn.extend_from_slice(b"{\"seq\":2");
    std::fs::write(seg, &torn).unwrap();
    let before = std::fs::read(seg).unwrap();
    let err = AuditLog::open(config(dir.path(), 1 << 20)).unwrap_err();
    assert!(
        matches!(err, AuditError::GenesisBehind { records: 2, .. }),
        "{err}"
    );
    assert_eq!(std::fs::read(seg).unwrap(), before, "left as found");
    // `verify` names the torn line first; without it, the rewritten head.
    write_lines(seg, &lines(seg)[..2]);
    let report = verify(dir.path(), None, None);
    assert!(!report.passed(), "{report}");
    assert!(
        report.to_string().contains("the head was rewritten"),
        "{report}"
    );
}

#[test]
fn a_new_tenants_first_record_is_durable_with_its_head_before_the_rest_of_its_batch() {
    // One batch of three, a segment each; the second cannot be opened (a directory stands
    // there), so the flush fails after the first record: its head names it already.
    let dir = Scratch::new();
    let a = tenant("a");
    let tdir = dir.path().join(a.as_str());
    let blocked = listed_with_blocked_segment(dir.path(), &a, 1);
    let mut cfg = config(dir.path(), 1);
    cfg.durability = Durability::Batched;
    let (log, _) = AuditLog::open(cfg).unwrap();
    for i in 0..3 {
        log.append(&a, &record(&a, i)).unwrap();
    }
    assert!(log.flush().is_err(), "the second segment cannot be opened");
    drop(log);
    let head = std::fs::read_to_string(tdir.join("head")).unwrap();
    assert!(head.starts_with("0 "), "{head:?}");
    std::fs::remove_dir(&blocked).unwrap();
    let log = open(dir.path(), 1);
    assert_eq!(log.append(&a, &record(&a, 1)).unwrap().seq, Seq(1));
    drop(log);
    assert!(verify(dir.path(), None, None).passed());
}

#[test]
fn a_first_flush_that_fails_at_its_segment_leaves_a_log_that_resumes() {
    // The first flush fails at the segment (a directory stands where it goes): the head stays
    // the genesis head (none names a record that was not written), the tenant stays listed
    // once, and the log resumes.
    let dir = Scratch::new();
    let a = tenant("a");
    let tdir = dir.path().join(a.as_str());
    let segment = listed_with_blocked_segment(dir.path(), &a, 0);
    let log = open(dir.path(), 1 << 20);
    assert!(
        log.append(&a, &record(&a, 0)).is_err(),
        "the segment cannot be opened"
    );
    drop(log);
    assert_eq!(std::fs::read(tdir.join("head")).unwrap(), b"genesis\n");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("TENANTS")).unwrap(),
        "a\n"
    );
    std::fs::remove_dir(&segment).unwrap();
    let log = open(dir.path(), 1 << 20);
    assert_eq!(log.append(&a, &record(&a, 0)).unwrap().seq, Seq(0));
    drop(log);
    assert!(verify(dir.path(), None, None).passed());
}

/// A flush whose lines were written and made durable but whose head could not be (the disk
/// full at `head.tmp`): its records are reported lost — the gateway told their clients so —
/// and must not come back at the next open as if they had been kept.
#[test]
fn records_a_failed_flush_reported_lost_do_not_come_back_at_the_next_open() {
    let dir = Scratch::new();
    let a = tenant("a");
    let log = open(dir.path(), 1 << 20);
    log.append(&a, &record(&a, 0)).expect("durable");
    let blocked = dir.path().join(a.as_str()).join("head.tmp");
    std::fs::create_dir(&blocked).expect("a directory where the head's file goes");
    assert!(log.append(&a, &record(&a, 1)).is_err(), "its head failed");
    drop(log);
    std::fs::remove_dir(&blocked).expect("unblocked");
    let (log, recoveries) = AuditLog::open(config(dir.path(), 1 << 20)).expect("opens");
    assert_eq!(recoveries, vec![]);
    assert_eq!(
        log.read(&a, Seq(0), 10).expect("reads").len(),
        1,
        "the failed flush's record is gone"
    );
    assert_eq!(log.append(&a, &record(&a, 1)).expect("appends").seq, Seq(1));
    drop(log);
    assert!(verify(dir.path(), None, None).passed());
}

/// A flush that began two segments and failed (its head could not be written) removes both:
/// cut to nothing and left, the first stood empty before the second, which the next open
/// resumed in, and `verify` refused the log for good.
#[test]
fn a_failed_flush_across_two_new_segments_leaves_a_log_that_verifies() {
    let dir = Scratch::new();
    let a = tenant("a");
    let mut cfg = config(dir.path(), 1);
    cfg.durability = Durability::Batched;
    let (log, _) = AuditLog::open(cfg.clone()).expect("opens");
    log.append(&a, &record(&a, 0)).expect("appends");
    log.flush().expect("flushed");
    let blocked = dir.path().join(a.as_str()).join("head.tmp");
    std::fs::create_dir(&blocked).expect("a directory where the head's file goes");
    log.append(&a, &record(&a, 1)).expect("appends");
    log.append(&a, &record(&a, 2)).expect("appends");
    assert!(log.flush().is_err(), "its head failed");
    drop(log);
    std::fs::remove_dir(&blocked).expect("unblocked");
    assert_eq!(
        segments(dir.path(), &a).len(),
        1,
        "the begun segments are gone"
    );
    let (log, _) = AuditLog::open(cfg).expect("opens");
    assert_eq!(log.append(&a, &record(&a, 1)).expect("appends").seq, Seq(1));
    log.flush().expect("flushed");
    drop(log);
    let report = verify(dir.path(), None, None);
    assert!(report.passed(), "{report:?}");
}

/// Empty segments at a log's end (left by a flush that failed before this writer removed
/// them, or planted) are removed at open; a segment missing or empty before the last refuses
/// the log, where it was resumed (one planted past a gap as `u64::MAX` left no number to
/// rotate to).
#[test]
fn a_logs_segments_are_held_to_their_numbering_at_open() {
    let dir = Scratch::new();
    let a = three_records(&dir);
    let tdir = dir.path().join(a.as_str());
    let planted = [
        tdir.join("00000000000000000001.jsonl"),
        tdir.join("00000000000000000002.jsonl"),
    ];
    for p in &planted {
        std::fs::write(p, b"").expect("planted");
    }
    let (log, recoveries) = AuditLog::open(config(dir.path(), 1 << 20)).expect("opens");
    assert_eq!(
        recoveries,
        planted
            .iter()
            .rev()
            .map(|p| Recovery::RemovedEmptySegment { path: p.clone() })
            .collect::<Vec<_>>()
    );
    log.append(&a, &record(&a, 3)).expect("appends");
    drop(log);
    assert!(verify(dir.path(), None, None).passed());

    // Past a gap, not empty: refused, and left as found.
    let past = tdir.join(format!("{:020}.jsonl", u64::MAX));
    std::fs::copy(&segments(dir.path(), &a)[0], &past).expect("planted");
    let e = AuditLog::open(config(dir.path(), 1 << 20)).expect_err("refused");
    assert!(
        matches!(&e, AuditError::Corrupt { reason, .. } if reason.contains("segment missing")),
        "{e}"
    );
    assert!(past.exists());
    std::fs::remove_file(&past).expect("removed");

    // An empty segment before the last: refused.
    std::fs::rename(
        &segments(dir.path(), &a)[0],
        tdir.join("00000000000000000001.jsonl"),
    )
    .expect("moved");
    std::fs::write(tdir.join("00000000000000000000.jsonl"), b"").expect("emptied");
    let e = AuditLog::open(config(dir.path(), 1 << 20)).expect_err("refused");
    assert!(
        matches!(&e, AuditError::Corrupt { reason, .. } if reason.contains("empty segment")),
        "{e}"
    );
}

/// A tenant's first flush whose first record went down with its head before the rest failed
/// (its next segment could not be opened): that record is durable — said so, and read — not
/// counted among the lost, whose clients are told their request was not recorded.
#[test]
fn a_first_record_that_went_down_before_its_flush_failed_is_durable_not_lost() {
    let dir = Scratch::new();
    let a = tenant("a");
    listed_with_blocked_segment(dir.path(), &a, 1);
    let mut cfg = config(dir.path(), 1);
    cfg.durability = Durability::Batched;
    let (log, _) = AuditLog::open(cfg).expect("opens");
    log.append(&a, &record(&a, 0)).expect("appends");
    log.append(&a, &record(&a, 1)).expect("appends");
    assert!(log.flush().is_err(), "segment 1 cannot be opened");
    assert!(
        log.is_durable(&a, Seq(0)),
        "record 0 went down with its head"
    );
    assert!(!log.is_durable(&a, Seq(1)));
    assert_eq!(log.dropped(), 1, "record 1 alone was lost");
}

#[test]
fn lines_after_the_head_that_do_not_chain_are_cut_from_the_first() {
    // What a power loss can leave past the last fsync: blocks of zeros, then whatever was
    // written after them. Before, the first unreadable line refused the whole log.
    let dir = Scratch::new();
    let a = three_records(&dir);
    let seg = segments(dir.path(), &a)[0].clone();
    let kept = std::fs::read(&seg).unwrap();
    let mut damaged = kept.clone();
    damaged.extend_from_slice(b"\0\0\0\0\n");
    // A readable record after them, numbered as the next but chained to another.
    let stray = lines(&seg)[1].replacen(r#""seq":1"#, r#""seq":3"#, 1);
    assert!(stray.contains(r#""seq":3"#), "{stray}");
    damaged.extend_from_slice(stray.as_bytes());
    damaged.push(b'\n');
    std::fs::write(&seg, &damaged).unwrap();
    let (log, recoveries) = AuditLog::open(config(dir.path(), 1 << 20)).unwrap();
    assert_eq!(
        recoveries,
        vec![Recovery::CutUnchained {
            path: seg.clone(),
            line: 4,
            bytes: (damaged.len() - kept.len()) as u64,
        }]
    );
    assert_eq!(
        std::fs::read(&seg).unwrap(),
        kept,
        "the chain itself is kept whole"
    );
    assert_eq!(log.append(&a, &record(&a, 3)).unwrap().seq, Seq(3));
    drop(log);
    assert!(verify(dir.path(), None, None).passed());
}

#[test]
fn batched_appends_become_durable_on_flush() {
    let dir = Scratch::new();
    let a = tenant("a");
    let mut cfg = config(dir.path(), 1 << 20);
    cfg.durability = Durability::Batched;
    let (log, _) = AuditLog::open(cfg).unwrap();
    let r = log.append(&a, &record(&a, 0)).unwrap();
    assert!(!r.durable);
    assert_eq!(
        log.read(&a, Seq(0), 10).unwrap(),
        vec![],
        "nothing written before the flush"
    );
    log.append(&a, &record(&a, 1)).unwrap();
    log.flush().unwrap();
    assert_eq!(log.read(&a, Seq(0), 10).unwrap().len(), 2);
}

#[test]
fn the_background_thread_flushes_batched_appends() {
    let dir = Scratch::new();
    let a = tenant("a");
    let mut cfg = config(dir.path(), 1 << 20);
    cfg.durability = Durability::Batched;
    cfg.flush_interval = Some(Duration::from_millis(2));
    let (log, _) = AuditLog::open(cfg).unwrap();
    log.append(&a, &record(&a, 0)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while log.read(&a, Seq(0), 10).unwrap().is_empty() {
        assert!(Instant::now() < deadline, "never flushed");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn concurrent_immediate_appends_all_land_in_one_chain() {
    let dir = Scratch::new();
    let log = open(dir.path(), 4000);
    std::thread::scope(|s| {
        for t in 0..4 {
            let log = &log;
            s.spawn(move || {
                let id = tenant(if t % 2 == 0 { "even" } else { "odd" });
                for i in 0..25 {
                    assert!(log.append(&id, &record(&id, i)).unwrap().durable);
                }
            });
        }
    });
    drop(log);
    let report = verify(dir.path(), None, None);
    assert!(report.passed(), "{report}");
    assert_eq!(
        report.tenants.iter().map(|t| t.records).collect::<Vec<_>>(),
        vec![50, 50]
    );
}

#[test]
fn pagination_walks_the_chain_across_segments() {
    let dir = Scratch::new();
    let (a, b) = (tenant("a"), tenant("b"));
    let log = open(dir.path(), 2000);
    for i in 0..25 {
        log.append(&a, &record(&a, i)).unwrap();
        log.append(&b, &record(&b, 100 + i)).unwrap();
    }
    let mut since = Seq(0);
    let mut seen = Vec::new();
    loop {
        let page = log.read(&a, since, 10).unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 10);
        since = Seq(page.last().unwrap().seq.0 + 1);
        seen.extend(pairs(page));
    }
    let want: Vec<_> = (0..25).map(|i| (Seq(i), record(&a, i))).collect();
    assert_eq!(seen, want, "only tenant a's records, each once, in order");
    assert_eq!(
        log.read(&a, Seq(20), 3)
            .unwrap()
            .iter()
            .map(|r| r.seq)
            .collect::<Vec<_>>(),
        [Seq(20), Seq(21), Seq(22)]
    );
    // From every record on, whichever segment holds it.
    for since in 0..25 {
        let first = log.read(&a, Seq(since), 1).unwrap();
        assert_eq!(pairs(first), [(Seq(since), record(&a, since))]);
    }
    assert_eq!(log.read(&a, Seq(25), 10).unwrap(), vec![]);
    assert_eq!(log.read(&tenant("nobody"), Seq(0), 10).unwrap(), vec![]);
    assert_eq!(log.read(&a, Seq(0), 0).unwrap(), vec![]);
}

/// A page holds at most its records and its bytes (the first record whatever its size), and
/// says whether more follow: a page of captured contents is not a gigabyte.
#[test]
fn a_page_is_bounded_in_bytes_and_says_when_more_follow() {
    let dir = Scratch::new();
    let a = tenant("a");
    let log = open(dir.path(), 1 << 20);
    for i in 0..5 {
        log.append(&a, &record(&a, i)).unwrap();
    }
    // The lines as the log holds them (one segment).
    let text = std::fs::read_to_string(&segments(dir.path(), &a)[0]).unwrap();
    let lines: Vec<usize> = text.lines().map(str::len).collect();
    // Room for the first two lines and not the third.
    let bytes = lines[0] + lines[1] + lines[2] - 1;
    let two = log
        .read_page(&a, Seq(0), Limit { records: 10, bytes })
        .unwrap();
    assert_eq!((two.records.len(), two.more), (2, true), "{lines:?}");
    // The first record whatever the bytes: a page always moves on.
    let first = log
        .read_page(
            &a,
            Seq(0),
            Limit {
                records: 10,
                bytes: 1,
            },
        )
        .unwrap();
    assert_eq!((first.records.len(), first.more), (1, true));
    // The last page says there is no more.
    let rest = log.read_page(&a, Seq(3), Limit::records(10)).unwrap();
    assert_eq!((rest.records.len(), rest.more), (2, false));
    let counted = log.read_page(&a, Seq(0), Limit::records(5)).unwrap();
    assert_eq!((counted.records.len(), counted.more), (5, false));
    let short = log.read_page(&a, Seq(0), Limit::records(4)).unwrap();
    assert_eq!((short.records.len(), short.more), (4, true));
}

#[test]
fn tenant_ids_with_path_tricks_are_refused() {
    for bad in ["../x", "a/b", "", ".", "..", "/etc", "A"] {
        assert!(TenantId::new(bad).is_err(), "{bad:?}");
    }
    assert_eq!(TenantId::new(""), Err(TenantIdError::Empty));
}

/// Segment files of `dir` this process holds open (Linux: read from `/proc/self/fd`).
fn open_segment_paths(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir("/proc/self/fd")
        .expect("this process's descriptors")
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| {
            target.starts_with(dir) && target.extension().is_some_and(|e| e == "jsonl")
        })
        .collect()
}

fn open_segments(dir: &std::path::Path) -> usize {
    open_segment_paths(dir).len()
}

/// The tenants whose segment file of `dir` is open, sorted.
fn open_tenants(dir: &std::path::Path) -> Vec<String> {
    let mut tenants: Vec<String> = open_segment_paths(dir)
        .iter()
        .filter_map(|p| Some(p.parent()?.file_name()?.to_string_lossy().into_owned()))
        .collect();
    tenants.sort();
    tenants
}

/// A log keeps at most `max_open_files` segment files open, the least recently written
/// closed first, and a tenant whose file was closed goes on in it, chained: one descriptor
/// per tenant ever served ran a gateway whose tenants come and go out of descriptors.
#[test]
fn open_segment_files_are_bounded_and_a_closed_one_is_reopened_in_place() {
    let dir = Scratch::new();
    let log = AuditLog::open(bulkhead_audit::Config {
        max_open_files: 3,
        ..config(dir.path(), 1 << 20)
    })
    .expect("opens")
    .0;
    let tenants: Vec<TenantId> = (0..8).map(|i| tenant(&format!("t{i}"))).collect();
    for (i, t) in tenants.iter().enumerate() {
        log.append(t, &record(t, i as u64)).expect("appends");
        assert!(open_segments(dir.path()) <= 3, "after {} tenants", i + 1);
    }
    assert_eq!(open_segments(dir.path()), 3);
    // The least recently written goes first: t5, t6, t7 are open; t5 written again keeps it,
    // so t0's reopening closes t6.
    log.append(&tenants[5], &record(&tenants[5], 50))
        .expect("appends");
    assert_eq!(open_tenants(dir.path()), ["t5", "t6", "t7"]);
    // The first tenant's file was closed long ago: its next record goes on in it.
    let first = &tenants[0];
    log.append(first, &record(first, 100)).expect("appends");
    assert_eq!(
        pairs(log.read(first, Seq(0), 10).expect("reads")),
        vec![(Seq(0), record(first, 0)), (Seq(1), record(first, 100))]
    );
    assert_eq!(open_tenants(dir.path()), ["t0", "t5", "t7"]);
    let report = verify(dir.path(), None, None);
    assert!(report.passed(), "{report}");
    assert_eq!(
        segments(dir.path(), first).len(),
        1,
        "no new segment for it"
    );
}

/// A page from `since` steps over the lines before it without decoding them: each page of a
/// large segment cost the whole segment before it (and a hostile tenant's `since` far past
/// its end, the whole segment at every read), and one unreadable line before `since` failed
/// every later page. Pages still start at `since`, in one segment or across several.
#[test]
fn a_page_from_since_steps_over_the_lines_before_it() {
    let dir = Scratch::new();
    let a = tenant("a");
    // Segments of a few records each, and one of every record.
    for segment_bytes in [1000, 1 << 20] {
        let dir = Scratch::new();
        let log = open(dir.path(), segment_bytes);
        for i in 0..20 {
            log.append(&a, &record(&a, i)).unwrap();
        }
        drop(log);
        if segment_bytes == 1000 {
            assert!(segments(dir.path(), &a).len() > 3, "several segments");
        }
        for since in 0..22 {
            let got = bulkhead_audit::read(dir.path(), &a, Seq(since), 3).unwrap();
            let want: Vec<_> = (since..20.min(since + 3))
                .map(|i| (Seq(i), record(&a, i)))
                .collect();
            assert_eq!(
                pairs(got),
                want,
                "since {since}, {segment_bytes}-byte segments"
            );
        }
    }
    let log = open(dir.path(), 1 << 20);
    for i in 0..10 {
        log.append(&a, &record(&a, i)).unwrap();
    }
    drop(log);
    let seg = segments(dir.path(), &a)[0].clone();
    let mut l = lines(&seg);
    l[2] = "not a record".to_owned();
    std::fs::write(&seg, l.join("\n") + "\n").unwrap();
    let got = bulkhead_audit::read(dir.path(), &a, Seq(5), 10).unwrap();
    assert_eq!(got.first().map(|s| s.seq), Some(Seq(5)));
    assert_eq!(got.len(), 5);
    let e = bulkhead_audit::read(dir.path(), &a, Seq(0), 10).expect_err("a page with it");
    assert!(matches!(e, AuditError::Corrupt { line: 3, .. }), "{e}");
}

/// A line is the record's fields after `seq` and `prev`, byte for byte what serde writes for
/// them flattened (the fields are serialized out of the log's lock, then spliced in).
#[test]
fn a_line_is_the_record_flattened_after_seq_and_prev() {
    #[derive(serde::Serialize)]
    struct Flattened<'a> {
        seq: Seq,
        prev: Sha256Digest,
        #[serde(flatten)]
        record: &'a AuditRecord,
    }
    let dir = Scratch::new();
    let a = tenant("a");
    let log = open(dir.path(), 1 << 20);
    let mut records = vec![record(&a, 0), record(&a, 1)];
    records[1].input_tokens = None;
    records[1].workers = None;
    records[1].prompt = Some("a \"quoted\"\nprompt".to_owned());
    for r in &records {
        log.append(&a, r).unwrap();
    }
    drop(log);
    let stored = lines(&segments(dir.path(), &a)[0]);
    let mut prev = Sha256Digest::ZERO;
    for (i, (line, r)) in stored.iter().zip(&records).enumerate() {
        let want = serde_json::to_string(&Flattened {
            seq: Seq(i as u64),
            prev,
            record: r,
        })
        .unwrap();
        assert_eq!(line, &want);
        prev = Sha256Digest::of(line.as_bytes());
    }
}
