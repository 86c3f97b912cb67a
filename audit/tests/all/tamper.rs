//! Tamper tests: each edit is reported at the exact file and line.

use std::path::{Path, PathBuf};

use bulkhead_audit::{AuditError, AuditLog, Problem, Reason, Seq, TenantId, verify};

use crate::common::*;

/// A tenant `a` with 12 records over at least three segments; also a clean tenant `b`.
fn setup(dir: &Path) -> (TenantId, Vec<PathBuf>) {
    let (a, b) = (tenant("a"), tenant("b"));
    let log = open(dir, 3000);
    for i in 0..12 {
        log.append(&a, &record(&a, i)).expect("append");
        log.append(&b, &record(&b, i)).expect("append");
    }
    drop(log);
    assert!(verify(dir, None, None).passed());
    let segs = segments(dir, &a);
    assert!(segs.len() >= 3 && lines(&segs[0]).len() >= 3, "{segs:?}");
    (a, segs)
}

/// The only problem: tenant `a`'s, with `b` still clean.
fn problem(dir: &Path) -> Problem {
    problem_after(dir).0
}

/// The only problem, tenant `a`'s, and the records that passed before it.
fn problem_after(dir: &Path) -> (Problem, u64) {
    let report = verify(dir, None, None);
    assert!(!report.passed());
    assert!(report.dir_problem.is_none(), "{report}");
    assert_eq!(report.tenants[1].problem, None, "tenant b is untouched");
    let a = &report.tenants[0];
    (
        a.problem.clone().expect("tenant a has a problem"),
        a.records,
    )
}

fn assert_at(p: &Problem, path: &Path, line: Option<u64>) {
    assert_eq!((p.path.as_path(), p.line), (path, line), "{p}");
}

#[test]
fn an_edited_field_is_reported_at_its_line() {
    let dir = Scratch::new();
    let (_, segs) = setup(dir.path());
    let mut l = lines(&segs[0]);
    assert!(l[1].contains(r#""http.response.status_code":200"#));
    l[1] = l[1].replace(
        r#""http.response.status_code":200"#,
        r#""http.response.status_code":500"#,
    );
    write_lines(&segs[0], &l);
    let (p, good) = problem_after(dir.path());
    assert_at(&p, &segs[0], Some(2));
    assert_eq!(
        p.reason,
        Reason::Modified {
            recorded_in: segs[0].clone(),
            recorded_line: Some(3)
        }
    );
    assert_eq!(good, 1, "only the first record is good");
}

#[test]
fn an_edited_last_record_is_caught_by_the_head() {
    let dir = Scratch::new();
    let (a, segs) = setup(dir.path());
    let last = segs.last().unwrap();
    let mut l = lines(last);
    let n = l.len();
    l[n - 1] = l[n - 1].replace(r#""req-11""#, r#""req-99""#);
    write_lines(last, &l);
    let (p, good) = problem_after(dir.path());
    assert_at(&p, last, Some(n as u64));
    assert_eq!(good, 11, "every record but the last is good");
    assert_eq!(
        p.reason,
        Reason::Modified {
            recorded_in: dir.path().join(a.as_str()).join("head"),
            recorded_line: None
        }
    );
}

#[test]
fn a_deleted_line_is_reported_where_it_was() {
    let dir = Scratch::new();
    let (_, segs) = setup(dir.path());
    let mut l = lines(&segs[0]);
    l.remove(1);
    write_lines(&segs[0], &l);
    let p = problem(dir.path());
    assert_at(&p, &segs[0], Some(2));
    assert_eq!(
        p.reason,
        Reason::SeqMismatch {
            expected: Seq(1),
            found: Seq(2)
        }
    );
}

#[test]
fn reordered_lines_are_reported_at_the_first() {
    let dir = Scratch::new();
    let (_, segs) = setup(dir.path());
    let mut l = lines(&segs[0]);
    l.swap(1, 2);
    write_lines(&segs[0], &l);
    let p = problem(dir.path());
    assert_at(&p, &segs[0], Some(2));
    assert_eq!(
        p.reason,
        Reason::SeqMismatch {
            expected: Seq(1),
            found: Seq(2)
        }
    );
}

#[test]
fn a_middle_segment_cut_at_a_line_boundary_is_reported_at_its_end() {
    let dir = Scratch::new();
    let (_, segs) = setup(dir.path());
    let mut l = lines(&segs[1]);
    let first_seq: u64 = serde_json::from_str::<serde_json::Value>(&l[0]).unwrap()["seq"]
        .as_u64()
        .unwrap();
    let kept = l.len() - 1;
    l.truncate(kept);
    write_lines(&segs[1], &l);
    let p = problem(dir.path());
    assert_at(&p, &segs[1], Some(kept as u64 + 1));
    let missing = Seq(first_seq + kept as u64);
    assert_eq!(
        p.reason,
        Reason::MissingRecords {
            from: missing,
            next: Seq(missing.0 + 1)
        }
    );
}

#[test]
fn a_segment_cut_mid_line_is_a_torn_line() {
    let dir = Scratch::new();
    let (_, segs) = setup(dir.path());
    let bytes = std::fs::read(&segs[0]).unwrap();
    std::fs::write(&segs[0], &bytes[..bytes.len() - 10]).unwrap();
    let p = problem(dir.path());
    assert_at(&p, &segs[0], Some(lines(&segs[0]).len() as u64));
    assert_eq!(p.reason, Reason::TornLine);
}

#[test]
fn a_cut_tail_is_caught_by_the_head() {
    let dir = Scratch::new();
    let (_, segs) = setup(dir.path());
    let last = segs.last().unwrap();
    let mut l = lines(last);
    l.pop();
    write_lines(last, &l);
    let p = problem(dir.path());
    assert_at(&p, last, Some(l.len() as u64 + 1));
    assert_eq!(
        p.reason,
        Reason::MissingTail {
            from: Seq(11),
            head: Seq(11)
        }
    );
}

#[test]
fn a_removed_segment_is_named() {
    let dir = Scratch::new();
    let (_, segs) = setup(dir.path());
    std::fs::remove_file(&segs[1]).unwrap();
    let p = problem(dir.path());
    assert_at(&p, &segs[1], None);
    assert_eq!(p.reason, Reason::SegmentMissing);
}

#[test]
fn a_removed_first_segment_is_named() {
    let dir = Scratch::new();
    let (_, segs) = setup(dir.path());
    std::fs::remove_file(&segs[0]).unwrap();
    let p = problem(dir.path());
    assert_at(&p, &segs[0], None);
    assert_eq!(p.reason, Reason::SegmentMissing);
}

#[test]
fn a_removed_last_segment_is_caught_by_the_head() {
    let dir = Scratch::new();
    let (_, segs) = setup(dir.path());
    std::fs::remove_file(segs.last().unwrap()).unwrap();
    let p = problem(dir.path());
    let before_last = &segs[segs.len() - 2];
    assert_at(&p, before_last, Some(lines(before_last).len() as u64 + 1));
    assert!(
        matches!(p.reason, Reason::MissingTail { head: Seq(11), .. }),
        "{p}"
    );
}

#[test]
fn a_removed_head_is_reported() {
    let dir = Scratch::new();
    let (a, _) = setup(dir.path());
    let head = dir.path().join(a.as_str()).join("head");
    std::fs::remove_file(&head).unwrap();
    let p = problem(dir.path());
    assert_at(&p, &head, None);
    assert_eq!(p.reason, Reason::HeadMissing);
}

#[test]
fn a_record_moved_into_another_tenants_log_is_reported() {
    let dir = Scratch::new();
    let (a, segs) = setup(dir.path());
    // Rewrite tenant b's whole log as a copy of a's: a valid chain, the wrong tenant.
    let b_dir = dir.path().join("b");
    std::fs::remove_dir_all(&b_dir).unwrap();
    std::fs::create_dir(&b_dir).unwrap();
    for s in &segs {
        std::fs::copy(s, b_dir.join(s.file_name().unwrap())).unwrap();
    }
    std::fs::copy(dir.path().join(a.as_str()).join("head"), b_dir.join("head")).unwrap();
    let report = verify(dir.path(), Some(&tenant("b")), None);
    let p = report.first_problem().unwrap();
    assert_eq!(
        (p.path.clone(), p.line),
        (b_dir.join(segs[0].file_name().unwrap()), Some(1))
    );
    assert_eq!(p.reason, Reason::WrongTenant(a));
}

#[test]
fn stray_entries_are_reported() {
    let dir = Scratch::new();
    setup(dir.path());
    std::fs::create_dir(dir.path().join("Not-A-Tenant")).unwrap();
    let report = verify(dir.path(), None, None);
    let p = report.dir_problem.clone().unwrap();
    assert_eq!(p.path, dir.path().join("Not-A-Tenant"));
    assert_eq!(p.reason, Reason::UnexpectedEntry);
}

#[test]
fn a_directory_without_an_audit_log_fails_and_a_log_with_no_record_passes() {
    let dir = Scratch::new();
    std::fs::create_dir_all(dir.path()).expect("an empty directory");
    let report = verify(dir.path(), None, None);
    assert!(!report.passed(), "an empty directory passed: {report}");
    assert_eq!(
        report.dir_problem.map(|p| p.reason),
        Some(Reason::NoAuditLog)
    );
    // A writer opened it and wrote nothing yet.
    drop(open(dir.path(), 3000));
    let report = verify(dir.path(), None, None);
    assert!(report.passed(), "{report}");
    // The whole log deleted, its lock with it.
    setup(dir.path());
    for entry in std::fs::read_dir(dir.path()).expect("lists") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            std::fs::remove_dir_all(path).expect("removes");
        } else {
            std::fs::remove_file(path).expect("removes");
        }
    }
    assert!(!verify(dir.path(), None, None).passed());
}

#[test]
fn an_unknown_tenant_fails() {
    let dir = Scratch::new();
    setup(dir.path());
    let report = verify(dir.path(), Some(&tenant("nobody")), None);
    assert_eq!(report.first_problem().unwrap().reason, Reason::NoSuchTenant);
}

/// Why the writer refuses to open `dir`.
fn refusal(dir: &Path) -> AuditError {
    AuditLog::open(config(dir, 3000)).expect_err("refused")
}

/// The roster's tenants' reports, by id: each tenant's first problem's reason.
fn reasons(dir: &Path) -> Vec<(String, Option<Reason>)> {
    verify(dir, None, None)
        .tenants
        .into_iter()
        .map(|t| (t.tenant.to_string(), t.problem.map(|p| p.reason)))
        .collect()
}

#[test]
fn a_tenants_log_deleted_whole_is_reported_and_refused() {
    let dir = Scratch::new();
    setup(dir.path());
    std::fs::remove_dir_all(dir.path().join("b")).unwrap();
    assert_eq!(
        reasons(dir.path()),
        [
            ("a".to_owned(), None),
            ("b".to_owned(), Some(Reason::LogDeleted))
        ]
    );
    let err = refusal(dir.path());
    assert!(
        matches!(err, AuditError::TenantLogMissing { ref tenant } if tenant.as_str() == "b"),
        "{err}"
    );
    // Without the roster as well: the directory no longer says which tenants it held.
    std::fs::remove_file(dir.path().join("TENANTS")).unwrap();
    let report = verify(dir.path(), None, None);
    assert_eq!(
        report.dir_problem.map(|p| p.reason),
        Some(Reason::RosterMissing),
    );
    let err = refusal(dir.path());
    assert!(matches!(err, AuditError::RosterMissing { .. }), "{err}");
}

#[test]
fn a_listed_tenants_log_emptied_is_reported_and_refused() {
    // Emptied outright, down to an empty first segment (no key needed to make one), or to one
    // holding only the start of a line: a listed tenant got its head before it was listed, so
    // no crash leaves it headless, and none of these is a log that simply has not begun.
    let leftovers: [&[u8]; 3] = [b"", b"", b"{\"seq\":0"];
    for (i, leftover) in leftovers.into_iter().enumerate() {
        let dir = Scratch::new();
        setup(dir.path());
        let b = dir.path().join("b");
        for entry in std::fs::read_dir(&b).unwrap() {
            std::fs::remove_file(entry.unwrap().path()).unwrap();
        }
        if i > 0 {
            std::fs::write(b.join(format!("{:020}.jsonl", 0)), leftover).unwrap();
        }
        assert_eq!(
            reasons(dir.path())[1],
            ("b".to_owned(), Some(Reason::LogDeleted)),
            "leftover {i}"
        );
        let err = refusal(dir.path());
        assert!(
            matches!(err, AuditError::TenantLogMissing { ref tenant } if tenant.as_str() == "b"),
            "leftover {i}: {err}"
        );
    }
}

#[test]
fn a_log_the_roster_does_not_list_is_reported_and_refused() {
    let dir = Scratch::new();
    setup(dir.path());
    // A valid chain of its own, placed beside the others.
    let c = tenant("c");
    let planted = Scratch::new();
    let log = open(planted.path(), 3000);
    log.append(&c, &record(&c, 0)).unwrap();
    drop(log);
    std::fs::rename(planted.path().join("c"), dir.path().join("c")).unwrap();
    assert_eq!(
        reasons(dir.path())[2],
        ("c".to_owned(), Some(Reason::Unlisted))
    );
    let err = refusal(dir.path());
    assert!(matches!(err, AuditError::TenantUnlisted { .. }), "{err}");
}

#[test]
fn a_crash_between_making_and_listing_a_tenants_directory_is_listed_at_open() {
    let dir = Scratch::new();
    setup(dir.path());
    // The directory made with its genesis head, its line cut short: no record in it yet.
    std::fs::create_dir(dir.path().join("c")).unwrap();
    std::fs::write(dir.path().join("c").join("head"), "genesis\n").unwrap();
    let roster = dir.path().join("TENANTS");
    let mut text = std::fs::read_to_string(&roster).unwrap();
    text.push('c');
    std::fs::write(&roster, &text).unwrap();
    let report = verify(dir.path(), None, None);
    let torn = report.dir_problem.clone().expect("the torn line is shown");
    assert_eq!((torn.path, torn.reason), (roster.clone(), Reason::TornLine));
    let (log, recoveries) = AuditLog::open(config(dir.path(), 3000)).unwrap();
    assert_eq!(
        recoveries,
        [
            bulkhead_audit::Recovery::TruncatedTornLine {
                path: roster.clone(),
                bytes: 1
            },
            bulkhead_audit::Recovery::ListedEmptyTenant {
                tenant: tenant("c")
            }
        ]
    );
    let c = tenant("c");
    log.append(&c, &record(&c, 0)).unwrap();
    drop(log);
    let report = verify(dir.path(), None, None);
    assert!(report.passed(), "{report}");
    assert_eq!(std::fs::read_to_string(&roster).unwrap(), "a\nb\nc\n");
}

/// A crash while the tenant's first head was being written — before its rename, or with the
/// rename lost to a power cut — leaves its directory unlisted with the head's unfinished copy,
/// or with nothing: nothing was recorded, so it is listed (with its head) at open, verifies,
/// and opens again. It was refused as a log someone placed there.
#[test]
fn a_crash_while_a_new_tenants_first_head_is_written_is_listed_at_open() {
    for left in [Some(""), Some("gen"), Some("genesis\n"), None] {
        let dir = Scratch::new();
        setup(dir.path());
        let c = tenant("c");
        let tdir = dir.path().join("c");
        std::fs::create_dir(&tdir).unwrap();
        if let Some(text) = left {
            std::fs::write(tdir.join("head.tmp"), text).unwrap();
        }
        assert!(verify(dir.path(), None, None).passed(), "{left:?}");
        let (log, recoveries) = AuditLog::open(config(dir.path(), 3000)).unwrap();
        assert_eq!(
            recoveries,
            [bulkhead_audit::Recovery::ListedEmptyTenant { tenant: c.clone() }]
        );
        drop(log);
        let report = verify(dir.path(), None, None);
        assert!(report.passed(), "{left:?}: {report}");
        let (log, recoveries) = AuditLog::open(config(dir.path(), 3000)).expect("opens again");
        assert_eq!(recoveries, [], "{left:?}");
        log.append(&c, &record(&c, 0)).unwrap();
        drop(log);
        let report = verify(dir.path(), None, None);
        assert!(report.passed(), "{left:?}: {report}");
    }
}
