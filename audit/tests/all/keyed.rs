//! Keyed logs: what an attacker who can write the directory, and lacks the key, can do to an
//! unkeyed log unseen, and what the key catches. Each attack runs twice: unkeyed, `verify`
//! passes (the limitation the key exists for); keyed, it is reported.

use std::path::{Path, PathBuf};

use bulkhead_audit::{
    AuditError, AuditLog, ChainKey, KeyError, LineProblem, Reason, Recovery, Report, SealProblem,
    Seq, Sha256Digest, read, verify,
};

use crate::common::*;

fn key(byte: u8) -> ChainKey {
    ChainKey::new(vec![byte; 32]).expect("32 bytes")
}

fn open_keyed(dir: &Path, key: Option<&ChainKey>) -> Result<(AuditLog, Vec<Recovery>), AuditError> {
    AuditLog::open(bulkhead_audit::Config {
        key: key.cloned(),
        ..config(dir, 1 << 20)
    })
}

/// Tenants `a` and `b`, 6 records each, in one segment apiece; returns `a`'s segment.
fn setup(dir: &Path, key: Option<&ChainKey>) -> PathBuf {
    let (a, b) = (tenant("a"), tenant("b"));
    let (log, recoveries) = open_keyed(dir, key).expect("opens");
    assert_eq!(recoveries, vec![]);
    for i in 0..6 {
        log.append(&a, &record(&a, i)).expect("append");
        log.append(&b, &record(&b, i)).expect("append");
    }
    drop(log);
    assert!(verify(dir, None, key).passed());
    let segs = segments(dir, &a);
    assert_eq!(segs.len(), 1);
    segs[0].clone()
}

/// What someone without the key can compute: today's link, SHA-256 of the line.
fn sha(line: &str) -> Sha256Digest {
    Sha256Digest::of(line.as_bytes())
}

/// `line` with its `prev` replaced.
fn with_prev(line: &str, prev: Sha256Digest) -> String {
    let at = line.find(r#""prev":""#).expect("a prev") + r#""prev":""#.len();
    format!("{}{prev}{}", &line[..at], &line[at + 64..])
}

/// Rewrites the head as the unkeyed format has it: the last line's seq and SHA-256.
fn forge_head(dir: &Path, lines: &[String]) {
    let last = lines.last().expect("a line");
    let head = format!("{} {}\n", lines.len() - 1, sha(last));
    std::fs::write(dir.join("a").join("head"), head).expect("writes the head");
}

/// Runs `attack` on an unkeyed log, which passes `verify`, then on a keyed one; returns the
/// keyed log's directory, tenant `a`'s segment and its report.
fn unkeyed_passes_keyed_fails(attack: impl Fn(&Path, &Path)) -> (Scratch, PathBuf, Report) {
    let dir = Scratch::new();
    let seg = setup(dir.path(), None);
    attack(dir.path(), &seg);
    let report = verify(dir.path(), None, None);
    assert!(report.passed(), "unkeyed, the attack is not seen: {report}");

    let dir = Scratch::new();
    let k = key(1);
    let seg = setup(dir.path(), Some(&k));
    attack(dir.path(), &seg);
    let report = verify(dir.path(), None, Some(&k));
    assert!(!report.passed(), "keyed, the attack is caught");
    (dir, seg, report)
}

fn edit_and_rechain(dir: &Path, seg: &Path) {
    let mut l = lines(seg);
    l[1] = l[1].replace(
        r#""http.response.status_code":200"#,
        r#""http.response.status_code":500"#,
    );
    for i in 2..l.len() {
        l[i] = with_prev(&l[i], sha(&l[i - 1]));
    }
    write_lines(seg, &l);
    forge_head(dir, &l);
}

#[test]
fn an_edit_with_every_later_link_and_the_head_recomputed_needs_the_key() {
    let (_dir, seg, report) = unkeyed_passes_keyed_fails(edit_and_rechain);
    let p = report.tenants[0].problem.clone().expect("tenant a's");
    assert_eq!((p.path.as_path(), p.line), (seg.as_path(), Some(2)), "{p}");
    assert_eq!(p.reason, Reason::LineMac(LineProblem::BadMac), "{p}");
    assert_eq!(report.tenants[1].problem, None, "tenant b is untouched");
}

/// A line after the last, chained on with the `prev` the head states for the last line (its
/// link; keyed, the MAC the last line carries too) — keyed, it has no MAC of its own that
/// verifies.
fn append_forged(dir: &Path, seg: &Path) {
    let mut l = lines(seg);
    let last = l.last().expect("a line").clone();
    let head = std::fs::read_to_string(dir.join("a").join("head")).expect("the head");
    let stated = head
        .split_whitespace()
        .nth(1)
        .and_then(Sha256Digest::from_hex);
    let forged = with_prev(&last, stated.expect("the head names the last line"))
        .replace(r#""seq":5,"#, r#""seq":6,"#)
        .replace(r#""req-5""#, r#""req-forged""#);
    assert!(forged.contains("req-forged") && forged.contains(r#""seq":6,"#));
    l.push(forged);
    write_lines(seg, &l);
}

#[test]
fn a_forged_line_appended_is_caught_and_never_adopted_by_a_keyed_log() {
    let (_, _, report) = unkeyed_passes_keyed_fails(append_forged);
    let p = report.tenants[0].problem.clone().expect("tenant a's");
    assert_eq!(p.line, Some(7), "the forged line: {p}");
    assert_eq!(p.reason, Reason::LineMac(LineProblem::BadMac), "{p}");

    let a = tenant("a");
    // Unkeyed, reopening adopts the forged line as the tenant's seventh record.
    let dir = Scratch::new();
    let seg = setup(dir.path(), None);
    append_forged(dir.path(), &seg);
    let (log, recoveries) = open_keyed(dir.path(), None).expect("opens");
    assert_eq!(recoveries, vec![]);
    let adopted = log.read(&a, Seq(6), 10).expect("reads");
    assert_eq!(adopted[0].record.request_id, "req-forged");
    drop(log);

    // Keyed, reopening cuts it off and says so; the chain goes on from the last true record.
    let dir = Scratch::new();
    let k = key(1);
    let seg = setup(dir.path(), Some(&k));
    append_forged(dir.path(), &seg);
    let (log, recoveries) = open_keyed(dir.path(), Some(&k)).expect("opens");
    assert!(
        matches!(
            recoveries.as_slice(),
            [Recovery::CutUnchained { path, line: 7, .. }] if *path == seg
        ),
        "{recoveries:?}"
    );
    assert_eq!(log.read(&a, Seq(6), 10).expect("reads"), vec![]);
    let receipt = log.append(&a, &record(&a, 6)).expect("appends");
    assert_eq!(receipt.seq, Seq(6));
    drop(log);
    assert!(verify(dir.path(), None, Some(&k)).passed());
    let stored = read(dir.path(), &a, Seq(6), 10).expect("reads");
    assert_eq!(stored[0].record.request_id, "req-6");
}

fn cut_tail(dir: &Path, seg: &Path) {
    let mut l = lines(seg);
    l.truncate(3);
    write_lines(seg, &l);
    forge_head(dir, &l);
}

#[test]
fn a_cut_tail_under_a_rewritten_head_needs_the_key() {
    let (_, _, report) = unkeyed_passes_keyed_fails(cut_tail);
    let p = report.tenants[0].problem.clone().expect("tenant a's");
    assert!(p.path.ends_with("a/head"), "{p}");
    assert_eq!(p.reason, Reason::Seal(SealProblem::Unkeyed), "{p}");
    assert_eq!(report.tenants[0].records, 3, "the records left are good");
}

#[test]
fn a_log_deleted_with_its_roster_line_needs_the_key() {
    let (_, _, report) = unkeyed_passes_keyed_fails(|dir, _| {
        std::fs::remove_dir_all(dir.join("b")).expect("deletes b's log");
        let roster = std::fs::read_to_string(dir.join("TENANTS")).expect("reads the roster");
        let struck: String = roster
            .lines()
            .filter(|l| *l != "b")
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(dir.join("TENANTS"), struck).expect("strikes b off");
    });
    let p = report.dir_problem.clone().expect("the roster's");
    assert!(p.path.ends_with("TENANTS"), "{p}");
    assert_eq!(p.reason, Reason::Seal(SealProblem::Broken), "{p}");
}

#[test]
fn a_keyed_log_says_so_in_its_roster_and_heads_and_links_by_hmac() {
    let dir = Scratch::new();
    let k = key(1);
    let seg = setup(dir.path(), Some(&k));
    let roster = std::fs::read_to_string(dir.path().join("TENANTS")).expect("reads");
    let roster: Vec<&str> = roster.lines().collect();
    assert_eq!(roster[..2], ["a", "b"]);
    assert!(
        roster[2].starts_with(&format!("hmac-sha256 {} ", k.id())),
        "{roster:?}"
    );
    let head = std::fs::read_to_string(dir.path().join("a/head")).expect("reads");
    assert!(
        head.starts_with("5 ") && head.contains(" hmac-sha256 "),
        "{head}"
    );
    let l = lines(&seg);
    assert_ne!(
        with_prev(&l[1], sha(&l[0])),
        l[1],
        "prev is not the SHA-256"
    );
    // Each line starts with its own MAC, which the next line's `prev` repeats.
    for pair in l.windows(2) {
        let mac = pair[0]
            .strip_prefix(r#"{"mac":""#)
            .map(|rest| &rest[..64])
            .expect("a line starts with its MAC");
        let mac = Sha256Digest::from_hex(mac).expect("hex");
        assert_eq!(with_prev(&pair[1], mac), pair[1]);
    }
    // It goes on across a reopen.
    let a = tenant("a");
    let (log, recoveries) = open_keyed(dir.path(), Some(&k)).expect("reopens");
    assert_eq!(recoveries, vec![]);
    log.append(&a, &record(&a, 6)).expect("appends");
    drop(log);
    assert!(verify(dir.path(), None, Some(&k)).passed());
}

/// Tenant `a`'s keyed log of 5 records whose head names the third: what a crash between a
/// segment's fsync and its head's rename leaves, or a head put back from an older copy.
fn past_a_stale_head(dir: &Path, k: &ChainKey) {
    let a = tenant("a");
    let (log, _) = open_keyed(dir, Some(k)).expect("opens");
    for i in 0..3 {
        log.append(&a, &record(&a, i)).expect("append");
    }
    let stale = std::fs::read(dir.join("a/head")).expect("reads the head");
    for i in 3..5 {
        log.append(&a, &record(&a, i)).expect("append");
    }
    drop(log);
    std::fs::write(dir.join("a/head"), stale).expect("puts the older head back");
}

#[test]
fn a_keyed_log_resumes_true_lines_past_a_stale_head() {
    let dir = Scratch::new();
    let k = key(1);
    let a = tenant("a");
    past_a_stale_head(dir.path(), &k);
    let (log, recoveries) = open_keyed(dir.path(), Some(&k)).expect("opens");
    assert_eq!(
        recoveries,
        vec![],
        "lines that chain under the key are kept"
    );
    assert_eq!(log.append(&a, &record(&a, 5)).expect("appends").seq, Seq(5));
}

/// [`past_a_stale_head`], then record `i`'s request id replaced with `id` in its line (its MAC
/// left as it was); returns the segment.
fn edited_past_a_stale_head(dir: &Path, k: &ChainKey, i: usize, id: &str) -> PathBuf {
    past_a_stale_head(dir, k);
    let seg = segments(dir, &tenant("a"))[0].clone();
    let mut l = lines(&seg);
    let edited = l[i].replace(&format!(r#""req-{i}""#), &format!(r#""{id}""#));
    assert_ne!(edited, l[i]);
    l[i] = edited;
    write_lines(&seg, &l);
    seg
}

/// The records past a stale head (what a crash leaves until the tenant's next flush, or what
/// follows a head put back from an older copy) are each vouched for by their own MAC: the last
/// one replaced with content of the attacker's choosing (its `prev` kept, which the line
/// before links to) is named by `verify` and cut at reopen, where a link kept only in the
/// next line would vouch for nothing past the last.
#[test]
fn a_keyed_log_s_last_line_past_its_head_cannot_be_replaced() {
    let dir = Scratch::new();
    let k = key(1);
    let a = tenant("a");
    let seg = edited_past_a_stale_head(dir.path(), &k, 4, "req-forged");

    let report = verify(dir.path(), None, Some(&k));
    let p = report.tenants[0].problem.clone().expect("tenant a's");
    assert_eq!((p.path.as_path(), p.line), (seg.as_path(), Some(5)), "{p}");
    assert_eq!(p.reason, Reason::LineMac(LineProblem::BadMac), "{p}");
    let (log, recoveries) = open_keyed(dir.path(), Some(&k)).expect("opens");
    assert!(
        matches!(
            recoveries.as_slice(),
            [Recovery::CutUnchained { path, line: 5, .. }] if *path == seg
        ),
        "{recoveries:?}"
    );
    assert_eq!(log.read(&a, Seq(4), 10).expect("reads"), vec![]);
}

/// A head put back from an older copy and the next record edited: the records after it still
/// carry the log's MAC, so the break is an edit, not a crash's leftovers. Reopening refuses and
/// cuts nothing — cutting from the edit on destroyed every later record, after which `verify`
/// passed on what was left.
#[test]
fn a_keyed_log_edited_past_a_stale_head_is_refused_not_cut() {
    let dir = Scratch::new();
    let k = key(1);
    let seg = edited_past_a_stale_head(dir.path(), &k, 3, "req-x");
    let before = std::fs::read(&seg).expect("reads");
    assert!(!verify(dir.path(), None, Some(&k)).passed());

    let e = open_keyed(dir.path(), Some(&k)).expect_err("an edit, not a crash");
    assert!(
        matches!(
            &e,
            AuditError::VouchedPastBreak { path, line: 4, vouched: 5, .. } if *path == seg
        ),
        "{e}"
    );
    assert_eq!(std::fs::read(&seg).expect("reads"), before, "nothing cut");
    assert!(!verify(dir.path(), None, Some(&k)).passed());
}

/// What a power loss can leave past a keyed log's head: a block that never reached the disk
/// (NULs), then lines the gateway wrote after it, each carrying the log's MAC. Refused as an
/// edit, it left the gateway unable to start; now they are set aside whole — kept in a file
/// `verify` reports until an operator removes it — and the log goes on from the head.
#[test]
fn a_keyed_log_with_a_power_losss_nul_block_past_its_head_sets_the_rest_aside_and_goes_on() {
    let dir = Scratch::new();
    let k = key(1);
    let a = tenant("a");
    past_a_stale_head(dir.path(), &k);
    let seg = segments(dir.path(), &a)[0].clone();
    let mut l = lines(&seg);
    let after = format!("{}\n{}\n", "\0".repeat(l[3].len()), l[4]);
    l[3] = "\0".repeat(l[3].len());
    write_lines(&seg, &l);
    let kept_before = std::fs::read(&seg).expect("reads").len() - after.len();
    let damaged = std::fs::read(&seg).expect("reads");

    let (log, recoveries) = open_keyed(dir.path(), Some(&k)).expect("opens");
    let [
        Recovery::SetAside {
            path,
            line,
            bytes,
            kept,
        },
    ] = recoveries.as_slice()
    else {
        panic!("{recoveries:?}");
    };
    assert_eq!((path, *line, *bytes), (&seg, 4, after.len() as u64));
    assert_eq!(
        std::fs::read(kept).expect("kept"),
        after.as_bytes(),
        "kept whole"
    );
    assert_eq!(
        std::fs::read(&seg).expect("reads").len(),
        kept_before,
        "cut at the break"
    );
    // A crash between setting the lines aside and cutting them: the next open does it again.
    drop(log);
    std::fs::write(&seg, &damaged).expect("the segment as before the cut");
    let (log, again) = open_keyed(dir.path(), Some(&k)).expect("opens again");
    assert_eq!(again, recoveries);
    assert_eq!(log.append(&a, &record(&a, 3)).expect("appends").seq, Seq(3));
    drop(log);

    let report = verify(dir.path(), None, Some(&k));
    let p = report.tenants[0]
        .problem
        .clone()
        .expect("the set-aside lines are reported");
    assert_eq!(
        (p.path.as_path(), &p.reason),
        (kept.as_path(), &Reason::SetAside),
        "{p}"
    );
    std::fs::remove_file(kept).expect("accounted for");
    assert!(verify(dir.path(), None, Some(&k)).passed());
}

/// Two data directories written with one key (gateway replicas on a shared volume, each in
/// its own): a tenant's log copied from one over the other's is refused at open and named by
/// `verify` — sealed with one key, every MAC of it held there and the copy passed. An edited
/// `LOG-ID` is named too.
#[test]
fn a_tenants_log_copied_from_another_directory_with_the_same_key_does_not_verify() {
    let k = key(1);
    let a = tenant("a");
    let (ours, theirs) = (Scratch::new(), Scratch::new());
    for (dir, n) in [(&ours, 5), (&theirs, 2)] {
        let (log, _) = open_keyed(dir.path(), Some(&k)).expect("opens");
        for i in 0..n {
            log.append(&a, &record(&a, i)).expect("appends");
        }
    }
    assert!(verify(ours.path(), None, Some(&k)).passed());
    std::fs::remove_dir_all(ours.path().join("a")).expect("removes ours");
    copy_tree(&theirs.path().join("a"), &ours.path().join("a"));

    let report = verify(ours.path(), None, Some(&k));
    assert!(!report.passed(), "{report}");
    let p = report.tenants[0].problem.clone().expect("tenant a's");
    assert!(p.path.starts_with(ours.path().join("a")), "{p}");
    let e = open_keyed(ours.path(), Some(&k)).expect_err("another directory's log");
    assert!(matches!(e, AuditError::SealBroken { .. }), "{e}");

    let id = theirs.path().join("LOG-ID");
    std::fs::write(&id, "not an id\n").expect("edits it");
    let e = open_keyed(theirs.path(), Some(&k)).expect_err("an edited id");
    assert!(matches!(e, AuditError::BadLogId { .. }), "{e}");
    assert!(!verify(theirs.path(), None, Some(&k)).passed());
}

/// `line` without the MAC a keyed line starts with.
fn without_mac(line: &str) -> String {
    format!("{{{}", &line[r#"{"mac":""#.len() + 64 + 2..])
}

/// A line without a MAC in a keyed log (one added by hand, or a log written by the keyed
/// format before lines carried their own) is named as such, never passed; a log whose lines
/// all lack one does not open, and says why at the head's line.
#[test]
fn a_keyed_log_s_line_without_its_mac_is_named() {
    let dir = Scratch::new();
    let k = key(1);
    let seg = setup(dir.path(), Some(&k));
    let mut l = lines(&seg);
    l[2] = without_mac(&l[2]);
    assert!(l[2].starts_with(r#"{"seq":2,"#), "{}", l[2]);
    write_lines(&seg, &l);
    let report = verify(dir.path(), None, Some(&k));
    let p = report.tenants[0].problem.clone().expect("tenant a's");
    assert_eq!(p.line, Some(3), "{p}");
    assert_eq!(p.reason, Reason::LineMac(LineProblem::NoMac), "{p}");
    assert!(p.to_string().contains("carries no MAC"), "{p}");

    let bare: Vec<String> = lines(&seg).iter().map(|l| without_mac(l)).collect();
    write_lines(&seg, &bare);
    let e = open_keyed(dir.path(), Some(&k)).expect_err("refused");
    assert!(
        matches!(&e, AuditError::Corrupt { path, line: 6, reason }
            if *path == seg && reason.contains("carries no MAC")),
        "{e}"
    );
    assert_eq!(lines(&seg), bare, "nothing cut");
}

/// A byte-exact copy of the record the head names, appended (its MAC is genuine, so keyed or
/// not it matches the head), is not taken for that record: the log does not open (resuming
/// after the copy would chain on from a line `verify` refuses), and nothing is cut.
#[test]
fn a_copy_of_the_heads_record_appended_is_refused_at_open() {
    for k in [None, Some(key(1))] {
        let dir = Scratch::new();
        let seg = setup(dir.path(), k.as_ref());
        let mut l = lines(&seg);
        l.push(l.last().expect("a line").clone());
        write_lines(&seg, &l);
        let e = open_keyed(dir.path(), k.as_ref()).expect_err("refused");
        assert!(
            matches!(&e, AuditError::Corrupt { path, line: 7, reason }
                if *path == seg && reason.contains("does not follow")),
            "{e}"
        );
        assert_eq!(lines(&seg), l, "nothing cut");
        assert!(!verify(dir.path(), None, k.as_ref()).passed());
    }
}

#[test]
fn a_keyed_log_opens_only_with_its_key() {
    let dir = Scratch::new();
    setup(dir.path(), Some(&key(1)));
    let e = open_keyed(dir.path(), Some(&key(2))).expect_err("another key");
    assert!(
        matches!(&e, AuditError::WrongKey { path } if path.ends_with("TENANTS")),
        "{e}"
    );
    assert!(e.to_string().contains("does not match"), "{e}");
    let e = open_keyed(dir.path(), None).expect_err("no key");
    assert!(matches!(e, AuditError::KeyedLog { .. }), "{e}");
    assert!(e.to_string().contains("key_file"), "{e}");
    // A head sealed with another key is named too, even under a roster sealed with this one.
    let other = Scratch::new();
    setup(other.path(), Some(&key(2)));
    std::fs::copy(other.path().join("a/head"), dir.path().join("a/head")).expect("copies");
    let e = open_keyed(dir.path(), Some(&key(1))).expect_err("a head of another key");
    assert!(
        matches!(&e, AuditError::WrongKey { path } if path.ends_with("a/head")),
        "{e}"
    );
}

#[test]
fn an_unkeyed_log_is_not_extended_with_a_key() {
    let dir = Scratch::new();
    setup(dir.path(), None);
    let e = open_keyed(dir.path(), Some(&key(1))).expect_err("unkeyed");
    assert!(matches!(e, AuditError::UnkeyedLog { .. }), "{e}");
    assert!(e.to_string().contains("new data directory"), "{e}");
    assert!(verify(dir.path(), None, None).passed(), "left as it was");
}

#[test]
fn verify_names_a_missing_or_wrong_key() {
    let dir = Scratch::new();
    setup(dir.path(), Some(&key(1)));
    let report = verify(dir.path(), None, None);
    assert!(!report.passed());
    let p = report.dir_problem.clone().expect("the roster's");
    assert_eq!(p.reason, Reason::Seal(SealProblem::Keyed));
    assert!(p.to_string().contains("keyed: pass --key-file"), "{p}");
    for t in &report.tenants {
        let p = t.problem.clone().expect("each tenant's");
        assert!(p.path.ends_with("head"), "{p}");
        assert_eq!(p.reason, Reason::Seal(SealProblem::Keyed));
    }
    let one = verify(dir.path(), Some(&tenant("b")), None);
    assert!(!one.passed(), "{one}");

    let report = verify(dir.path(), None, Some(&key(2)));
    let p = report.first_problem().expect("a problem");
    assert_eq!(p.reason, Reason::Seal(SealProblem::WrongKey), "{p}");
    assert!(p.to_string().contains("does not match"), "{p}");

    let unkeyed = Scratch::new();
    setup(unkeyed.path(), None);
    let report = verify(unkeyed.path(), None, Some(&key(1)));
    let p = report.first_problem().expect("a problem");
    assert_eq!(p.reason, Reason::Seal(SealProblem::Unkeyed), "{p}");

    // Everything but the writer's lock deleted: unkeyed, that is a log with no record yet;
    // keyed, the sealed roster is missing.
    for name in ["a", "b"] {
        std::fs::remove_dir_all(dir.path().join(name)).expect("deletes a log");
    }
    std::fs::remove_file(dir.path().join("TENANTS")).expect("deletes the roster");
    let p = verify(dir.path(), None, Some(&key(1)))
        .dir_problem
        .expect("the roster's");
    assert_eq!(p.reason, Reason::RosterMissing, "{p}");
}

#[test]
fn a_key_file_gives_its_first_line_trimmed_and_at_least_32_bytes() {
    let dir = Scratch::new();
    std::fs::create_dir_all(dir.path()).expect("makes the directory");
    let file = dir.path().join("key");
    let secret = "0123456789abcdef0123456789abcdef";
    std::fs::write(&file, format!("  {secret} \nnot the key\n")).expect("writes");
    let k = ChainKey::read(&file).expect("a valid key");
    assert_eq!(k.id(), ChainKey::new(secret).expect("valid").id());
    let shown = format!(
        "{k:?} {:?}",
        bulkhead_audit::Config {
            key: Some(k.clone()),
            ..config(dir.path(), 1)
        }
    );
    assert!(!shown.contains(secret), "{shown}");
    std::fs::write(&file, "short\n").expect("writes");
    assert!(matches!(
        ChainKey::read(&file),
        Err(KeyError::TooShort { len: 5 })
    ));
    std::fs::write(&file, "\n").expect("writes");
    assert!(matches!(ChainKey::read(&file), Err(KeyError::Empty)));
    assert!(matches!(
        ChainKey::read(&dir.path().join("missing")),
        Err(KeyError::Unreadable(_))
    ));
}

#[test]
fn a_keyed_roster_edited_while_the_writer_runs_is_not_sealed_anew() {
    let dir = Scratch::new();
    let k = key(1);
    let (a, b) = (tenant("a"), tenant("b"));
    let (log, _) = open_keyed(dir.path(), Some(&k)).expect("opens");
    log.append(&a, &record(&a, 0)).expect("appends");
    let roster = dir.path().join("TENANTS");
    let text = std::fs::read_to_string(&roster).expect("reads the roster");
    std::fs::write(&roster, text.replacen("a\n", "", 1)).expect("strikes a off");
    let e = log
        .append(&b, &record(&b, 0))
        .expect_err("the roster's seal is checked");
    assert!(e.to_string().contains("TENANTS"), "{e}");
    drop(log);
    let report = verify(dir.path(), None, Some(&k));
    let p = report.dir_problem.clone().expect("the roster's");
    assert_eq!(p.reason, Reason::Seal(SealProblem::Broken), "{p}");
}

/// A tenant directory planted beside a keyed log with an unsealed genesis head (what a crash
/// leaves, unkeyed) is not listed and sealed into the roster: the log does not open, and
/// `verify` names it as unlisted; the roster stays as the key sealed it.
#[test]
fn a_planted_tenant_directory_is_never_sealed_into_a_keyed_roster() {
    let dir = Scratch::new();
    let k = key(1);
    setup(dir.path(), Some(&k));
    let roster = std::fs::read(dir.path().join("TENANTS")).expect("the roster");
    let planted = dir.path().join("zzz");
    std::fs::create_dir(&planted).expect("plants a tenant");
    std::fs::write(planted.join("head"), "genesis\n").expect("with a genesis head");
    let refused = open_keyed(dir.path(), Some(&k)).map(|_| ());
    assert!(
        matches!(&refused, Err(AuditError::TenantUnlisted { tenant }) if tenant.as_str() == "zzz"),
        "{refused:?}"
    );
    assert_eq!(
        std::fs::read(dir.path().join("TENANTS")).expect("the roster"),
        roster,
        "not sealed anew"
    );
    let report = verify(dir.path(), None, Some(&k));
    assert!(
        report.tenants.iter().any(|t| t.tenant.as_str() == "zzz"
            && matches!(
                t.problem.as_ref().map(|p| &p.reason),
                Some(Reason::Unlisted)
            )),
        "{report}"
    );
}
