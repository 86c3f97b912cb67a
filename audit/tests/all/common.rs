//! Shared helpers: scratch directories and sample records.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bulkhead_audit::{
    Admission, AdmissionOutcome, AuditLog, AuditRecord, Config, Durability, Integrity, Layer,
    PolicyDecision, Sha256Digest, TenantId, Verdict, WorkerPair,
};

/// A directory removed when dropped.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "bulkhead-audit-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn tenant(id: &str) -> TenantId {
    TenantId::new(id).expect("a valid tenant id")
}

/// A record of `tenant`, made distinct by `i`.
pub fn record(tenant: &TenantId, i: u64) -> AuditRecord {
    AuditRecord {
        time_unix_ms: 1_780_000_000_000 + i,
        request_id: format!("req-{i}"),
        tenant: tenant.clone(),
        key_id: "key-1".to_owned(),
        model: "smollm2-135m".to_owned(),
        route: "/v1/chat/completions".to_owned(),
        input_tokens: Some(10 + i),
        output_tokens: Some(i),
        policy: vec![PolicyDecision {
            plugin: "abort-guard".to_owned(),
            digest: Sha256Digest::of(b"plugin"),
            verdict: Verdict::Allow,
            tags: Vec::new(),
        }],
        admission: Some(Admission {
            outcome: AdmissionOutcome::Admitted,
            layer: Layer::Prefill,
        }),
        workers: Some(WorkerPair {
            prefill: Some("w0".to_owned()),
            decode: "w1".to_owned(),
        }),
        integrity: Integrity::Passed,
        status: 200,
        error_type: None,
        ttft_ms: Some(12),
        total_ms: 40 + i,
        disconnect: None,
        hold: None,
        prompt_sha256: Some(Sha256Digest::of(format!("prompt {i}").as_bytes())),
        completion_sha256: Some(Sha256Digest::of(b"completion")),
        prompt: None,
        completion: None,
        folded: None,
    }
}

/// Immediate durability, no background thread, `segment_bytes` per segment.
pub fn config(dir: &Path, segment_bytes: u64) -> Config {
    Config {
        dir: dir.to_owned(),
        segment_bytes,
        durability: Durability::Immediate,
        flush_interval: None,
        max_open_files: 256,
        key: None,
    }
}

/// A listed tenant's directory as a crash after its listing leaves it (its genesis head, no
/// record), with a directory standing where its segment `n` goes, so that segment cannot be
/// opened; returns that directory.
pub fn listed_with_blocked_segment(dir: &Path, tenant: &TenantId, n: u64) -> PathBuf {
    let tdir = dir.join(tenant.as_str());
    let blocked = tdir.join(format!("{n:020}.jsonl"));
    std::fs::create_dir_all(&blocked).expect("blocks the segment");
    std::fs::write(tdir.join("head"), "genesis\n").expect("writes the head");
    std::fs::write(dir.join("TENANTS"), format!("{tenant}\n")).expect("writes the roster");
    blocked
}

pub fn open(dir: &Path, segment_bytes: u64) -> AuditLog {
    let (log, recoveries) = AuditLog::open(config(dir, segment_bytes)).expect("open the audit log");
    assert_eq!(recoveries, vec![]);
    log
}

/// The tenant's segment files, sorted.
pub fn segments(dir: &Path, tenant: &TenantId) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir.join(tenant.as_str()))
        .expect("list the tenant directory")
        .map(|e| e.expect("read a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    out.sort();
    out
}

pub fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .expect("read a segment")
        .lines()
        .map(str::to_owned)
        .collect()
}

pub fn write_lines(path: &Path, lines: &[String]) {
    let mut text = lines.join("\n");
    if !lines.is_empty() {
        text.push('\n');
    }
    std::fs::write(path, text).expect("write a segment");
}

/// Copies the directory tree `from` to `to`, file by file.
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("makes the copy's directory");
    for entry in std::fs::read_dir(from).expect("lists") {
        let entry = entry.expect("an entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("a type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copies");
        }
    }
}
