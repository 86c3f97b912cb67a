//! The writer: per-tenant hash chains, segment rotation, group commit, crash recovery.
//!
//! ```text
//!  append ──► encode + hash + seq ──► pending (memory) ──► flush: write, fsync, head ──► durable
//!             (state lock, short)                          (io lock: one flusher at a time)
//! ```
//!
//! Group commit: whoever holds the io lock writes every tenant's pending lines and fsyncs once
//! per touched file. With [`Durability::Immediate`], `append` waits for that (and finds its
//! record already durable when another caller's flush took it along); with
//! [`Durability::Batched`], a background thread flushes every `flush_interval`, and
//! [`AuditLog::flush`] forces one. A failed write or fsync poisons the log: the page cache's
//! state is unknown after a failed fsync, so nothing more is accepted until it is reopened.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::chain::{Chain, ChainKey};
use crate::error::{AuditError, io_err};
use crate::hash::Sha256Digest;
use crate::layout::{self, HEAD, HEAD_TMP, Head, HeadFile, LOCK, SegmentNo};
use crate::line::{self, Seq};
use crate::log_id;
use crate::read::{self, Stored};
use crate::record::AuditRecord;
use crate::roster;
use crate::tenant::TenantId;

/// Whether `append` returns before or after its record is on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// `append` returns after the record is fsynced.
    Immediate,
    /// `append` returns at once; a background flush (or [`AuditLog::flush`]) makes it durable.
    Batched,
}

/// The writer's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// The data directory.
    pub dir: PathBuf,
    /// A segment is closed once the next line would take it past this many bytes (a line
    /// longer than this gets a segment of its own).
    pub segment_bytes: u64,
    /// Whether `append` waits for fsync.
    pub durability: Durability,
    /// How often the background thread flushes; `None`: no thread, only explicit flushes
    /// (and the implicit ones of [`Durability::Immediate`]).
    pub flush_interval: Option<Duration>,
    /// The most segment files kept open at once (at least 1): past it, the least recently
    /// written is closed — it was fsynced after its last write — and opened again when its
    /// tenant's next record comes. One descriptor per tenant ever served would run a gateway
    /// with many tenants, or tenants added and removed, out of descriptors (and a failed open
    /// stops the log).
    pub max_open_files: usize,
    /// The key of a keyed log (see [`ChainKey`]), `None` for an unkeyed one. A log is
    /// opened only with what it was written with: a key for a keyed log, none for an unkeyed
    /// one, and the same key.
    pub key: Option<ChainKey>,
}

impl Config {
    /// Defaults: 64 MiB segments, immediate durability, a 5 ms background flush, 256 open
    /// segment files, unkeyed.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            segment_bytes: 64 << 20,
            durability: Durability::Immediate,
            flush_interval: Some(Duration::from_millis(5)),
            max_open_files: 256,
            key: None,
        }
    }
}

/// A line taken into the pending buffer.
struct Enqueued {
    seq: Seq,
    /// The link to it.
    digest: Sha256Digest,
    /// Keyed, the line (without its newline), whose SHA-256 the link is not.
    keyed_line: Option<Vec<u8>>,
    /// How far the flushes are behind.
    behind: Duration,
}

/// What `append` hands back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    /// The tenant.
    pub tenant: TenantId,
    /// The record's place in the tenant's chain.
    pub seq: Seq,
    /// The link to the record's line (SHA-256, or HMAC-SHA256 when keyed): the next record's
    /// `prev`.
    pub digest: Sha256Digest,
    /// The SHA-256 of the record's line, as [`crate::read`] gives it (the link itself when
    /// unkeyed): kept elsewhere with `seq`, an [`crate::Anchor`] that shows a rollback.
    pub line_sha256: Sha256Digest,
    /// Whether the record was durable when `append` returned.
    pub durable: bool,
    /// How long the oldest record not yet durable had waited when this one was appended (zero
    /// when it is the only one): how far the flushes are behind, which in
    /// [`Durability::Batched`] is what a crash would lose.
    pub behind: Duration,
}

/// Something `open` repaired or noticed; the caller should log each one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// A partially written last line (a crash mid-write) was cut off. It was never
    /// acknowledged as durable: the head never named it.
    TruncatedTornLine {
        /// The segment.
        path: PathBuf,
        /// Bytes removed.
        bytes: u64,
    },
    /// A tenant directory that a crash left empty between making it and listing it in the
    /// roster was listed.
    ListedEmptyTenant {
        /// The tenant.
        tenant: TenantId,
    },
    /// Keyed: past the head, a line of NUL bytes (a block a power loss left unwritten) was
    /// followed by lines the gateway wrote after it, which carry the log's MAC but cannot chain
    /// on: all of them were cut off the segment and kept whole in `kept`, which `verify`
    /// reports until an operator removes it. None was acknowledged as durable.
    SetAside {
        /// The segment.
        path: PathBuf,
        /// The 1-based line number of the first line cut.
        line: u64,
        /// Bytes moved.
        bytes: u64,
        /// Where they are.
        kept: PathBuf,
    },
    /// An empty segment at the end of a tenant's log (but its first) was removed: a flush
    /// that failed, or a crash, after beginning it, or a planted file.
    RemovedEmptySegment {
        /// The segment.
        path: PathBuf,
    },
    /// Complete lines after the head that do not chain on from it (unreadable, or not the next
    /// record: what a power loss can leave in blocks written after the last fsync; in a keyed
    /// log also a line whose `prev` is not the key's MAC of the line before: forged) were cut
    /// off, from the first of them. None was acknowledged as durable.
    CutUnchained {
        /// The segment.
        path: PathBuf,
        /// The 1-based line number of the first line cut.
        line: u64,
        /// Bytes removed.
        bytes: u64,
    },
}

/// A complete line after the head's record, as recovery found it.
struct Unacknowledged {
    path: PathBuf,
    /// 1-based.
    line: u64,
    /// Where it starts in its segment.
    offset: u64,
    /// Its `seq`, `prev` and the link to it, or why it does not decode or (keyed) does not
    /// vouch for itself.
    parsed: Result<Linked, String>,
    /// It holds a NUL byte: no writer's line (records are JSON), what a power loss leaves of
    /// a block that never reached the disk.
    debris: bool,
}

/// The line of the record a head names, as found by recovery.
struct Named {
    seq: Seq,
    prev: Sha256Digest,
    /// The link to it, or (keyed) why it does not vouch for itself.
    link: Result<Sha256Digest, String>,
    path: PathBuf,
    /// 1-based.
    line: u64,
}

/// A line that decodes (and, keyed, whose MAC verifies).
#[derive(Debug, Clone, Copy)]
struct Linked {
    seq: Seq,
    prev: Sha256Digest,
    /// The link to it: the next line's `prev`.
    link: Sha256Digest,
}

/// Unwritten lines grouped by segment, each group newline-terminated lines.
type Chunks = Vec<(SegmentNo, Vec<u8>)>;

/// A tenant's chain position and unflushed lines.
#[derive(Debug)]
struct TenantState {
    next_seq: u64,
    last_digest: Sha256Digest,
    segment: SegmentNo,
    segment_len: u64,
    /// Lines not yet written, grouped by segment (newline-terminated).
    pending: Chunks,
    /// Records `< durable` are fsynced.
    durable: u64,
}

#[derive(Debug, Default)]
struct State {
    tenants: HashMap<TenantId, TenantState>,
    poisoned: Option<String>,
    /// Records `append` accepted that a failed flush then dropped.
    dropped: u64,
    /// When the oldest record still pending (not taken by a flush) was appended.
    pending_since: Option<Instant>,
    /// When the oldest record of the flush under way was appended.
    flushing_since: Option<Instant>,
}

impl State {
    /// How long the oldest record not yet durable has waited, as of `now`.
    fn behind(&self, now: Instant) -> Duration {
        self.flushing_since
            .or(self.pending_since)
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }
}

/// The open segment file of the tenants written last, at most [`Config::max_open_files`];
/// owned by whoever flushes.
#[derive(Debug, Default)]
struct Files {
    open: HashMap<TenantId, OpenSegment>,
    /// Counts writes: an open file's `written` is the count at its last one.
    writes: u64,
}

#[derive(Debug)]
struct OpenSegment {
    segment: SegmentNo,
    file: File,
    written: u64,
}

impl Files {
    /// Whether `tenant`'s open file is `segment`'s; if so, marked as written now.
    fn reuse(&mut self, tenant: &TenantId, segment: SegmentNo) -> bool {
        self.writes += 1;
        let writes = self.writes;
        match self.open.get_mut(tenant).filter(|o| o.segment == segment) {
            Some(o) => {
                o.written = writes;
                true
            }
            None => false,
        }
    }

    /// Keeps `file` open as `tenant`'s `segment`, first closing the least recently written
    /// files past `max` (each was fsynced after its last write).
    fn keep(&mut self, tenant: &TenantId, segment: SegmentNo, file: File, max: usize) {
        while self.open.len() >= max.max(1) {
            let Some(oldest) = self
                .open
                .iter()
                .min_by_key(|(_, o)| o.written)
                .map(|(t, _)| t.clone())
            else {
                break;
            };
            self.open.remove(&oldest);
        }
        let written = self.writes;
        self.open.insert(
            tenant.clone(),
            OpenSegment {
                segment,
                file,
                written,
            },
        );
    }
}

#[derive(Debug)]
struct Inner {
    config: Config,
    state: Mutex<State>,
    files: Mutex<Files>,
    /// Held (flock) for the writer's lifetime.
    _lock: File,
}

#[derive(Debug)]
struct Flusher {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

/// A data directory of per-tenant audit logs, open for appending.
#[derive(Debug)]
pub struct AuditLog {
    inner: Arc<Inner>,
    flusher: Option<Flusher>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves consistent data (every update is a
    // single assignment or push), so a poisoned mutex is still usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Takes the lock of the log in `dir` (created if needed) for as long as the file is open, or
/// says that another process holds it.
fn lock_dir(dir: &Path) -> Result<File, AuditError> {
    fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let lock_path = dir.join(LOCK);
    let lock_file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io_err("open", &lock_path))?;
    // `bulkhead audit verify` takes the lock shared for a moment to see whether a writer
    // holds it: a writer starting then waits that moment out rather than call it taken.
    for _ in 0..LOCK_TRIES {
        match lock_file.try_lock() {
            Ok(()) => return Ok(lock_file),
            Err(fs::TryLockError::WouldBlock) => std::thread::sleep(LOCK_RETRY),
            Err(fs::TryLockError::Error(e)) => return Err(io_err("lock", &lock_path)(e)),
        }
    }
    Err(AuditError::Locked { path: lock_path })
}

/// How often, and how far apart, a writer tries the lock before it says another holds it.
const LOCK_TRIES: u32 = 20;
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(10);

impl AuditLog {
    /// Whether the log in `dir` could be opened now as far as its lock goes: an error when
    /// another process holds it. (A check for a process that would open it later, after work
    /// it would rather not waste; the lock is let go again at once.)
    pub fn check_unlocked(dir: &Path) -> Result<(), AuditError> {
        lock_dir(dir).map(drop)
    }

    /// Opens (creating it if needed) a data directory and resumes every tenant's chain from
    /// its last line that chains on from the head, cutting off what a crash left after it (see
    /// [`Recovery`]); refuses a tenant whose head is missing or names a record the log does not
    /// hold as recorded.
    pub fn open(mut config: Config) -> Result<(Self, Vec<Recovery>), AuditError> {
        let dir = config.dir.clone();
        let lock_file = lock_dir(&dir)?;
        let mut recoveries = Vec::new();
        let mut state = State::default();
        let (tenants, _) = layout::list_tenants(&dir).map_err(io_err("list", &dir))?;
        if let Some(key) = &config.key {
            config.key = Some(directory_key(&dir, key, &tenants)?);
        }
        let chain = Chain::new(config.key.as_ref());
        let roster = hold_to_roster(&dir, chain, &tenants, &mut recoveries)?;
        for tenant in tenants {
            let listed = roster.lists(&tenant);
            if let Some(t) = recover_tenant(&dir, chain, &tenant, listed, &mut recoveries)? {
                state.tenants.insert(tenant, t);
            }
        }
        let inner = Arc::new(Inner {
            config,
            state: Mutex::new(state),
            files: Mutex::new(Files::default()),
            _lock: lock_file,
        });
        let flusher = inner.config.flush_interval.map(|every| {
            let (stop, stopped) = mpsc::channel::<()>();
            let weak = Arc::downgrade(&inner);
            let thread = std::thread::spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    let Some(inner) = weak.upgrade() else { return };
                    // A failure poisons the log; the next append reports it.
                    let _ = inner.flush();
                }
            });
            Flusher { stop, thread }
        });
        Ok((Self { inner, flusher }, recoveries))
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.inner.config.dir
    }

    /// Appends `record` to `tenant`'s chain. With [`Durability::Immediate`] it returns once
    /// the record is fsynced.
    pub fn append(&self, tenant: &TenantId, record: &AuditRecord) -> Result<Receipt, AuditError> {
        if record.tenant != *tenant {
            return Err(AuditError::TenantMismatch {
                log: tenant.clone(),
                record: record.tenant.clone(),
            });
        }
        let Enqueued {
            seq,
            digest,
            keyed_line,
            behind,
        } = self.inner.enqueue(tenant, record)?;
        // Hashed here, out of the log's lock: a line with captured content can be large.
        let line_sha256 = keyed_line.map_or(digest, |line| Sha256Digest::of(&line));
        let durable = match self.inner.config.durability {
            Durability::Batched => false,
            Durability::Immediate => {
                self.inner.sync(tenant, seq)?;
                true
            }
        };
        Ok(Receipt {
            tenant: tenant.clone(),
            seq,
            digest,
            line_sha256,
            durable,
            behind,
        })
    }

    /// Records `append` accepted and a failed write or fsync then dropped: never durable, and,
    /// unless their appender waited for durability, lost without an error to anyone.
    pub fn dropped(&self) -> u64 {
        lock(&self.inner.state).dropped
    }

    /// Why the log accepts no more records (a failed write or fsync), or `None` while it is
    /// healthy.
    pub fn failure(&self) -> Option<String> {
        lock(&self.inner.state).poisoned.clone()
    }

    /// Makes every record appended so far durable.
    pub fn flush(&self) -> Result<(), AuditError> {
        self.inner.flush()
    }

    /// Whether `tenant`'s record `seq` is durable: a flush made it so, whatever became of the
    /// flush's other tenants (a flush that fails on one tenant has made those before it durable).
    pub fn is_durable(&self, tenant: &TenantId, seq: Seq) -> bool {
        lock(&self.inner.state)
            .tenants
            .get(tenant)
            .is_some_and(|t| seq.0 < t.durable)
    }

    /// Whether the log holds a chain for `tenant` (found at open or appended to since).
    pub fn holds(&self, tenant: &TenantId) -> bool {
        lock(&self.inner.state).tenants.contains_key(tenant)
    }

    /// Up to `limit` durable records of `tenant` with `seq >= since`, in order: never one
    /// that a crash could still lose (written but not yet fsynced).
    pub fn read(
        &self,
        tenant: &TenantId,
        since: Seq,
        limit: usize,
    ) -> Result<Vec<Stored>, AuditError> {
        self.read_page(tenant, since, read::Limit::records(limit))
            .map(|page| page.records)
    }

    /// [`AuditLog::read`] within `limit`'s records and bytes, and whether more follow.
    pub fn read_page(
        &self,
        tenant: &TenantId,
        since: Seq,
        limit: read::Limit,
    ) -> Result<read::Page, AuditError> {
        let durable = lock(&self.inner.state)
            .tenants
            .get(tenant)
            .map_or(0, |t| t.durable);
        read::read_below(self.dir(), tenant, since, limit, Some(Seq(durable)))
    }
}

impl Drop for AuditLog {
    fn drop(&mut self) {
        if let Some(f) = self.flusher.take() {
            let _ = f.stop.send(());
            let _ = f.thread.join();
        }
        // Best effort: a failure here has no one to report to, and the records were never
        // acknowledged as durable.
        let _ = self.inner.flush();
    }
}

impl Inner {
    fn chain(&self) -> Chain<'_> {
        Chain::new(self.config.key.as_ref())
    }

    fn enqueue(&self, tenant: &TenantId, record: &AuditRecord) -> Result<Enqueued, AuditError> {
        let fields = line::Fields::of(record)?;
        let mut state = lock(&self.state);
        if let Some(reason) = &state.poisoned {
            return Err(AuditError::Poisoned {
                reason: reason.clone(),
            });
        }
        let t = state
            .tenants
            .entry(tenant.clone())
            .or_insert_with(|| TenantState {
                next_seq: 0,
                last_digest: self.chain().genesis(tenant),
                segment: SegmentNo(0),
                segment_len: 0,
                pending: Vec::new(),
                durable: 0,
            });
        let seq = Seq(t.next_seq);
        let (mut bytes, digest) = self
            .chain()
            .write(line::encode(seq, t.last_digest, &fields));
        // Keyed, the link is a MAC: the line itself, for its SHA-256.
        let keyed_line = self.chain().is_keyed().then(|| bytes.clone());
        bytes.push(b'\n');
        let len = bytes.len() as u64;
        if t.segment_len > 0 && t.segment_len.saturating_add(len) > self.config.segment_bytes {
            // Recovery refuses a segment numbered past where any could be begun.
            t.segment = SegmentNo(t.segment.0.saturating_add(1));
            t.segment_len = 0;
        }
        t.segment_len += len;
        match t.pending.last_mut() {
            Some((seg, buf)) if *seg == t.segment => buf.extend_from_slice(&bytes),
            _ => t.pending.push((t.segment, bytes)),
        }
        t.next_seq += 1;
        t.last_digest = digest;
        let now = Instant::now();
        state.pending_since.get_or_insert(now);
        Ok(Enqueued {
            seq,
            digest,
            keyed_line,
            behind: state.behind(now),
        })
    }

    fn sync(&self, tenant: &TenantId, seq: Seq) -> Result<(), AuditError> {
        let mut files = lock(&self.files);
        {
            let state = lock(&self.state);
            if state.tenants.get(tenant).is_some_and(|t| t.durable > seq.0) {
                return Ok(());
            }
        }
        self.flush_locked(&mut files)
    }

    fn flush(&self) -> Result<(), AuditError> {
        let mut files = lock(&self.files);
        self.flush_locked(&mut files)
    }

    fn flush_locked(&self, files: &mut Files) -> Result<(), AuditError> {
        let batch: Vec<(TenantId, Chunks, Head, bool)> = {
            let mut state = lock(&self.state);
            if let Some(reason) = &state.poisoned {
                return Err(AuditError::Poisoned {
                    reason: reason.clone(),
                });
            }
            state.flushing_since = state.pending_since.take();
            state
                .tenants
                .iter_mut()
                .filter(|(_, t)| !t.pending.is_empty())
                .map(|(id, t)| {
                    let head = Head {
                        seq: Seq(t.next_seq - 1),
                        digest: t.last_digest,
                    };
                    let first = t.durable == 0;
                    (id.clone(), std::mem::take(&mut t.pending), head, first)
                })
                .collect()
        };
        let mut written = 0;
        // A tenant whose first record went down alone with its head before the rest failed.
        let mut first_alone = None;
        let failed = batch.iter().find_map(|(tenant, chunks, head, first)| {
            let result = if *first {
                self.write_first(files, tenant, chunks, *head)
                    .map_err(|(alone, e)| {
                        first_alone = alone.then(|| tenant.clone());
                        e
                    })
            } else {
                self.write_tenant(files, tenant, chunks, *head)
            };
            written += usize::from(result.is_ok());
            result.err()
        });
        let mut state = lock(&self.state);
        state.flushing_since = None;
        let durable = batch[..written]
            .iter()
            .map(|(tenant, _, head, _)| (tenant, head.seq.0 + 1))
            .chain(first_alone.as_ref().map(|tenant| (tenant, 1)));
        for (tenant, next) in durable {
            if let Some(t) = state.tenants.get_mut(tenant) {
                t.durable = t.durable.max(next);
            }
        }
        if let Some(e) = failed {
            state.poisoned.get_or_insert_with(|| e.to_string());
            // Nothing is written any more (`enqueue` checks the poison under this lock): every
            // record not durable now is dropped — this batch's from the failed tenant on, and
            // those appended while it was being written.
            let mut dropped = 0;
            for t in state.tenants.values_mut() {
                dropped += t.next_seq.saturating_sub(t.durable);
                t.pending.clear();
            }
            state.dropped += dropped;
            drop(state);
            files.open.clear();
            return Err(e);
        }
        Ok(())
    }

    /// Writes a tenant's first lines: the first record alone, with a head naming it, before
    /// any other. A genesis head then stands beside one record at most (a crash came before
    /// that head), so one with more behind it was rewritten to hide a cut, and is refused.
    /// A failure says whether the first record went down before it (durable, its head naming
    /// it: not lost, whatever came after).
    fn write_first(
        &self,
        files: &mut Files,
        tenant: &TenantId,
        chunks: &[(SegmentNo, Vec<u8>)],
        head: Head,
    ) -> Result<(), (bool, AuditError)> {
        let Some(((segment, bytes), later)) = chunks.split_first() else {
            return Ok(());
        };
        let end = bytes
            .iter()
            .position(|&b| b == b'\n')
            .map_or(bytes.len(), |i| i + 1);
        let (line, rest) = bytes.split_at(end);
        let first = Head {
            seq: Seq(0),
            digest: self
                .chain()
                .link(line.strip_suffix(b"\n").unwrap_or(line))
                .map_err(|problem| {
                    let e = AuditError::Corrupt {
                        path: layout::segment_path(
                            &layout::tenant_dir(&self.config.dir, tenant),
                            *segment,
                        ),
                        line: 1,
                        reason: problem.to_string(),
                    };
                    (false, e)
                })?,
        };
        self.write_tenant(files, tenant, &[(*segment, line.to_vec())], first)
            .map_err(|e| (false, e))?;
        let rest: Chunks = (!rest.is_empty())
            .then(|| (*segment, rest.to_vec()))
            .into_iter()
            .chain(later.iter().cloned())
            .collect();
        if rest.is_empty() {
            return Ok(());
        }
        self.write_tenant(files, tenant, &rest, head)
            .map_err(|e| (true, e))
    }

    /// Writes a tenant's lines and then its head naming the last. A flush that fails after
    /// lines landed cuts them off again (durably), so that records it reports lost — never
    /// durable, their clients told so — do not come back at the next open, adopted as the
    /// chain's continuation past the head; and removes the segments it began, last first (cut
    /// to nothing and left, two begun by one flush left an empty segment before the one the
    /// next open resumes in, which `verify` refuses).
    fn write_tenant(
        &self,
        files: &mut Files,
        tenant: &TenantId,
        chunks: &[(SegmentNo, Vec<u8>)],
        head: Head,
    ) -> Result<(), AuditError> {
        let mut landed = Vec::new();
        let written = self.write_lines_and_head(files, tenant, chunks, head, &mut landed);
        if written.is_err() {
            // The file handles may be the failure's: cut through fresh ones. Unless the head
            // made it into place before the failure (its directory's fsync failed): then it
            // names these lines, and cutting them would leave a head past the log's end.
            files.open.remove(tenant);
            let tdir = layout::tenant_dir(&self.config.dir, tenant);
            let named =
                matches!(layout::read_head(&tdir), Ok(Some((h, _))) if h == HeadFile::At(head));
            if !named {
                undo_landed(&tdir, &landed)?;
            }
        }
        written
    }

    /// [`Inner::write_tenant`]'s writing; `landed` gets each segment written to and its length
    /// before.
    fn write_lines_and_head(
        &self,
        files: &mut Files,
        tenant: &TenantId,
        chunks: &[(SegmentNo, Vec<u8>)],
        head: Head,
        landed: &mut Vec<(PathBuf, u64)>,
    ) -> Result<(), AuditError> {
        let tdir = layout::tenant_dir(&self.config.dir, tenant);
        for (segment, bytes) in chunks {
            if !files.reuse(tenant, *segment) {
                if let Some(old) = files.open.remove(tenant) {
                    old.file.sync_all().map_err(io_err("fsync", &tdir))?;
                }
                let file = open_segment(&self.config.dir, self.chain(), tenant, &tdir, *segment)?;
                files.keep(tenant, *segment, file, self.config.max_open_files);
            }
            let path = layout::segment_path(&tdir, *segment);
            let Some(open) = files.open.get_mut(tenant) else {
                return Err(io_err("open", &path)(std::io::ErrorKind::NotFound.into()));
            };
            let before = open.file.metadata().map_err(io_err("stat", &path))?.len();
            landed.push((path.clone(), before));
            open.file.write_all(bytes).map_err(io_err("write", &path))?;
        }
        if let Some(open) = files.open.get(tenant) {
            open.file
                .sync_all()
                .map_err(io_err("fsync", layout::segment_path(&tdir, open.segment)))?;
        }
        write_head(&tdir, self.chain(), tenant, HeadFile::At(head))
    }
}

/// The key a keyed data directory's logs are sealed with, from the operator's `key` (see
/// `log_id.rs`): a new directory (no roster, no tenant) is given its id first.
fn directory_key(dir: &Path, key: &ChainKey, tenants: &[TenantId]) -> Result<ChainKey, AuditError> {
    let new = tenants.is_empty() && !roster::path(dir).exists();
    log_id::key_of(dir, key, new).map_err(|e| {
        let path = dir.join(log_id::LOG_ID);
        match e {
            log_id::LogIdError::Io(e) => io_err("read or create", &path)(e),
            e @ log_id::LogIdError::Malformed => AuditError::BadLogId {
                path,
                reason: e.to_string(),
            },
        }
    })
}

/// Holds the tenant directories to the roster: a listed tenant's directory must be there
/// (that it still has its head, [`recover_tenant`] checks as it reads it), and a directory no
/// line lists must hold at most a genesis head (a crash between making and listing it: listed
/// now). A keyed log's roster must be sealed with the key, an unkeyed one's not at all. A new
/// data directory gets an empty roster. Returns the roster as found.
fn hold_to_roster(
    dir: &Path,
    chain: Chain<'_>,
    tenants: &[TenantId],
    recoveries: &mut Vec<Recovery>,
) -> Result<roster::Roster, AuditError> {
    let path = roster::path(dir);
    let roster = match roster::read(dir).map_err(io_err("read", &path))? {
        None if tenants.is_empty() => {
            roster::create(dir, chain).map_err(io_err("create", &path))?;
            return Ok(roster::Roster::default());
        }
        None => return Err(AuditError::RosterMissing { path }),
        Some(Err(reason)) => return Err(AuditError::BadRoster { path, reason }),
        Some(Ok(roster)) => roster,
    };
    roster
        .check(chain)
        .map_err(|problem| AuditError::seal(&path, problem))?;
    if let Some(gone) = roster.listed.iter().find(|t| !tenants.contains(t)) {
        return Err(AuditError::TenantLogMissing {
            tenant: gone.clone(),
        });
    }
    for tenant in tenants.iter().filter(|t| !roster.lists(t)) {
        let tdir = layout::tenant_dir(dir, tenant);
        if !roster::is_unbegun(chain, tenant, &tdir).map_err(io_err("list", &tdir))? {
            return Err(AuditError::TenantUnlisted {
                tenant: tenant.clone(),
            });
        }
    }
    if roster.torn > 0 {
        roster::cut_torn(dir, &roster).map_err(io_err("truncate", &path))?;
        recoveries.push(Recovery::TruncatedTornLine {
            path: path.clone(),
            bytes: roster.torn,
        });
    }
    for tenant in tenants.iter().filter(|t| !roster.lists(t)) {
        // Listed with its head, as a tenant's first record lists it: the crash may have come
        // before the head was written (or its rename made durable), and a listed tenant
        // without one would be taken for emptied at the next open.
        let tdir = layout::tenant_dir(dir, tenant);
        let head = tdir.join(HEAD);
        if !head.try_exists().map_err(io_err("stat", &head))? {
            write_head(&tdir, chain, tenant, HeadFile::Genesis)?;
        }
        roster::append(dir, chain, tenant).map_err(io_err("append to", &path))?;
        recoveries.push(Recovery::ListedEmptyTenant {
            tenant: tenant.clone(),
        });
    }
    Ok(roster)
}

/// Opens a segment for appending, creating it (and the tenant directory, listed in the
/// roster) durably if needed.
fn open_segment(
    dir: &Path,
    chain: Chain<'_>,
    tenant: &TenantId,
    tdir: &Path,
    segment: SegmentNo,
) -> Result<File, AuditError> {
    let new = !tdir.is_dir();
    if new {
        fs::create_dir(tdir).map_err(io_err("create", tdir))?;
        sync_dir(dir)?;
    }
    // Before the tenant's first line: a crash between its first records and its first head
    // then leaves the genesis head, which recovery resumes from, never no head at all (which
    // only a deletion leaves, and which is refused). Recovery refused a headless tenant that
    // has records, so one reaching here has none.
    let head = tdir.join(HEAD);
    if !head.try_exists().map_err(io_err("stat", &head))? {
        write_head(tdir, chain, tenant, HeadFile::Genesis)?;
    }
    // Listed with its head and before any record: a crash can leave it unlisted holding that
    // head alone, never records the roster does not name, and a listed tenant always has a
    // head (one without is emptied).
    if new {
        let path = roster::path(dir);
        roster::append(dir, chain, tenant).map_err(io_err("append to", &path))?;
    }
    let path = layout::segment_path(tdir, segment);
    let existed = path.exists();
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io_err("open", &path))?;
    if !existed {
        sync_dir(tdir)?;
    }
    Ok(file)
}

fn sync_dir(dir: &Path) -> Result<(), AuditError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync", dir))
}

fn write_head(
    tdir: &Path,
    chain: Chain<'_>,
    tenant: &TenantId,
    head: HeadFile,
) -> Result<(), AuditError> {
    let tmp = tdir.join(HEAD_TMP);
    let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
    f.write_all(head.encode(chain, tenant).as_bytes())
        .map_err(io_err("write", &tmp))?;
    f.sync_all().map_err(io_err("fsync", &tmp))?;
    let path = tdir.join(HEAD);
    fs::rename(&tmp, &path).map_err(io_err("rename", &path))?;
    // The rename itself must survive a power loss, or the tenant comes back without its head.
    sync_dir(tdir)
}

/// How many of the lines after the head (`after`, last first) chain on from it: `next` and
/// `digest` are the `seq` and `prev` the first must have.
fn chained_count(after: &[Unacknowledged], mut next: Option<u64>, mut digest: Sha256Digest) -> u64 {
    let mut chained = 0;
    for line in after.iter().rev() {
        match line.parsed {
            Ok(l) if Some(l.seq.0) == next && l.prev == digest => {
                chained += 1;
                next = next.and_then(|n| n.checked_add(1));
                digest = l.link;
            }
            _ => break,
        }
    }
    chained
}

/// Writes `bytes` durably to a file at `path`: one a recovery cut short before its cut left
/// (a crash between the two) is written again whole; the same name holding other lines (a
/// second break at the same place) is refused, for an operator to look at.
fn keep_aside(path: &Path, bytes: &[u8]) -> Result<(), AuditError> {
    match fs::read(path) {
        Ok(kept) if kept == bytes => return Ok(()),
        Ok(kept) if !bytes.starts_with(&kept) => {
            return Err(io_err("create", path)(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "other lines were set aside here before: compare them, then move the file away",
            )));
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("read", path)(e)),
    }
    let mut f = File::create(path).map_err(io_err("create", path))?;
    f.write_all(bytes).map_err(io_err("write", path))?;
    f.sync_all().map_err(io_err("fsync", path))
}

/// Takes back what a failed flush wrote to a tenant's segments, `landed` (each segment in the
/// order written, with its length before): the segments it began (empty before), last first,
/// are removed, then the rest cut back, all durably.
fn undo_landed(tdir: &Path, landed: &[(PathBuf, u64)]) -> Result<(), AuditError> {
    let begun = landed.iter().rev().take_while(|(_, len)| *len == 0).count();
    let (kept, begun) = landed.split_at(landed.len() - begun);
    for (path, _) in begun.iter().rev() {
        match fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                // Not removed: at least nothing of it is left to adopt.
                cut(path, 0)?;
            }
            _ => {}
        }
    }
    if !begun.is_empty() {
        sync_dir(tdir)?;
    }
    for (path, len) in kept.iter().rev() {
        cut(path, *len)?;
    }
    Ok(())
}

/// Cuts the file at `path` to its first `len` bytes, durably.
fn cut(path: &Path, len: u64) -> Result<(), AuditError> {
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err("open", path))?;
    f.set_len(len).map_err(io_err("truncate", path))?;
    f.sync_all().map_err(io_err("fsync", path))
}

/// Takes the empty segments at the end of a tenant's log, but for its first, out of
/// `segments`, and returns them: what a flush that failed after beginning them left before
/// they were removed on failure (or a crash between beginning one and writing to it), and
/// what anyone can plant. They hold nothing; left, the next segment resumed in was one past an
/// empty one, which `verify` refuses. They are removed ([`remove_segments`]) once the log is
/// known to be resumed: a log that is refused is left as it was found.
fn empty_last_segments(
    segments: &mut Vec<(SegmentNo, PathBuf)>,
) -> Result<Vec<PathBuf>, AuditError> {
    let mut empty = Vec::new();
    while segments.len() > 1 {
        let Some((_, path)) = segments.last() else {
            break;
        };
        if fs::metadata(path).map_err(io_err("stat", path))?.len() > 0 {
            break;
        }
        empty.push(path.clone());
        segments.pop();
    }
    Ok(empty)
}

/// Removes the segments `paths`, durably, each a recovery.
fn remove_segments(
    tdir: &Path,
    paths: &[PathBuf],
    recoveries: &mut Vec<Recovery>,
) -> Result<(), AuditError> {
    for path in paths {
        fs::remove_file(path).map_err(io_err("remove", path))?;
        recoveries.push(Recovery::RemovedEmptySegment { path: path.clone() });
    }
    if !paths.is_empty() {
        sync_dir(tdir)?;
    }
    Ok(())
}

/// Holds a tenant's segments to what its writer leaves: numbered from 0 without a gap, none
/// empty but the last. A log with a segment missing or emptied before its last was resumed,
/// its next records appended after what `verify` refuses, and a segment planted past a gap
/// (numbered `u64::MAX`: no number left to rotate to) was resumed in.
fn check_segments(tdir: &Path, segments: &[(SegmentNo, PathBuf)]) -> Result<(), AuditError> {
    let corrupt = |path: &Path, reason: String| AuditError::Corrupt {
        path: path.to_owned(),
        line: 1,
        reason,
    };
    for (i, (number, path)) in segments.iter().enumerate() {
        let expected = SegmentNo(i as u64);
        if *number != expected {
            return Err(corrupt(
                &layout::segment_path(tdir, expected),
                format!("segment missing: the next segment is numbered {}", number.0),
            ));
        }
        if i + 1 < segments.len() && fs::metadata(path).map_err(io_err("stat", path))?.len() == 0 {
            return Err(corrupt(
                path,
                "an empty segment before the last (a failed flush of an earlier version left it: \
                 remove it and number each later segment one less)"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// Resumes one tenant's chain: its last line that chains on from the head gives the next
/// `seq` and `prev`. The head must name a record the log still holds, unchanged, so that a
/// restart never resumes a chain that `verify` would refuse (appending after an edited or cut
/// tail would hide it), sealed with the log's key when it is keyed, and follow the record
/// before it (a copy of it appended would otherwise be taken for it); in a keyed log, a line
/// chains on only when it carries its own MAC under the key, so a line someone without the key
/// appended is cut off, never resumed from. A tenant the roster `listed` got its head before it
/// was listed: one without a head was emptied.
fn recover_tenant(
    dir: &Path,
    chain: Chain<'_>,
    tenant: &TenantId,
    listed: bool,
    recoveries: &mut Vec<Recovery>,
) -> Result<Option<TenantState>, AuditError> {
    let tdir = layout::tenant_dir(dir, tenant);
    let mut listing = layout::list_tenant(&tdir).map_err(io_err("list", &tdir))?;
    let empty_last = empty_last_segments(&mut listing.segments)?;
    let head = layout::read_head(&tdir).map_err(|reason| AuditError::BadHead {
        tenant: tenant.clone(),
        reason,
    })?;
    let head = match head {
        Some((head, seal)) => {
            head.check(chain, tenant, seal.as_ref())
                .map_err(|problem| AuditError::seal(tdir.join(HEAD), problem))?;
            Some(head)
        }
        None => None,
    };
    if listed && head.is_none() && listing.segments.is_empty() {
        return Err(AuditError::TenantLogMissing {
            tenant: tenant.clone(),
        });
    }
    check_segments(&tdir, &listing.segments)?;
    let Some((last_segment, last_path)) = listing.segments.last().cloned() else {
        return match head {
            Some(HeadFile::At(h)) => Err(AuditError::HeadAhead {
                tenant: tenant.clone(),
                head: h.seq,
            }),
            Some(HeadFile::Genesis) | None => Ok(None),
        };
    };
    // A torn tail of the last segment is cut off, but only once the head is known to be
    // held: a log that is refused is left as it was found, for `verify` and for whoever looks.
    let bytes = fs::read(&last_path).map_err(io_err("read", &last_path))?;
    let (_, tail) = line::split(&bytes);
    let torn = tail.len() as u64;
    let mut segment_len = bytes.len() as u64 - torn;
    let cut_torn = |recoveries: &mut Vec<Recovery>| {
        remove_segments(&tdir, &empty_last, recoveries)?;
        if torn > 0 {
            cut(&last_path, segment_len)?;
            recoveries.push(Recovery::TruncatedTornLine {
                path: last_path.clone(),
                bytes: torn,
            });
        }
        Ok::<_, AuditError>(())
    };
    let Some(head) = head else {
        // Earlier segments are never empty (rotation follows a write), so any records show
        // here; a tenant's directory gets its genesis head before its first line, and before
        // it is listed: a listed tenant without one was emptied, whatever segment files were
        // left (an empty one takes no key to make).
        return if segment_len > 0 || listing.segments.len() > 1 {
            Err(AuditError::HeadMissing {
                tenant: tenant.clone(),
            })
        } else if listed {
            Err(AuditError::TenantLogMissing {
                tenant: tenant.clone(),
            })
        } else {
            cut_torn(recoveries)?;
            Ok(None)
        };
    };
    // The record the head names, if any, and where the chain goes on from it: the next `seq`
    // and `prev`.
    let (named, mut next, mut digest) = match head {
        HeadFile::Genesis => (None, Some(0), chain.genesis(tenant)),
        // The link to the named record is read from the log below, where the head's is checked.
        HeadFile::At(h) => (Some(h), h.seq.0.checked_add(1), Sha256Digest::ZERO),
    };
    // Back from the last complete line to the record the head names, and the one before it;
    // the lines after it are at most one batch, never acknowledged as durable.
    let mut after = Vec::new();
    let mut found: Option<Named> = None;
    // The line before the named record: its `seq` and link, once read.
    let mut before = None;
    'segments: for (_, path) in listing.segments.iter().rev() {
        let bytes = if *path == last_path {
            bytes[..segment_len as usize].to_vec()
        } else {
            fs::read(path).map_err(io_err("read", path))?
        };
        let (lines, _) = line::split(&bytes);
        for (i, l) in lines.iter().enumerate().rev() {
            let link = chain.link(l).map_err(|problem| problem.to_string());
            let parsed = line::decode(l);
            if found.is_some() {
                before = parsed.ok().map(|p| (p.seq, link.ok()));
                break 'segments;
            }
            if let (Some(h), Ok(p)) = (named, &parsed)
                && p.seq <= h.seq
            {
                found = Some(Named {
                    seq: p.seq,
                    prev: p.prev,
                    link,
                    path: path.clone(),
                    line: i as u64 + 1,
                });
                continue;
            }
            after.push(Unacknowledged {
                path: path.clone(),
                line: i as u64 + 1,
                offset: (l.as_ptr() as usize - bytes.as_ptr() as usize) as u64,
                debris: l.contains(&0),
                parsed: parsed.and_then(|p| {
                    Ok(Linked {
                        seq: p.seq,
                        prev: p.prev,
                        link: link?,
                    })
                }),
            });
        }
    }
    if let Some(h) = named {
        match found {
            Some(f) if (f.seq, &f.link) == (h.seq, &Ok(h.digest)) => {
                // It follows the record before it (or starts the chain): not a copy of the
                // head's record appended later, which the head would name as well.
                let follows = match h.seq.0.checked_sub(1) {
                    None => before.is_none() && f.prev == chain.genesis(tenant),
                    Some(prior) => before == Some((Seq(prior), Some(f.prev))),
                };
                if !follows {
                    return Err(AuditError::Corrupt {
                        path: f.path,
                        line: f.line,
                        reason: "the record the head names does not follow the one before it"
                            .to_owned(),
                    });
                }
                digest = h.digest;
            }
            // The head's record, and (keyed) it does not vouch for itself.
            Some(Named {
                seq,
                link: Err(reason),
                path,
                line,
                ..
            }) if seq == h.seq => {
                return Err(AuditError::Corrupt { path, line, reason });
            }
            // The log ends before the head's record: acknowledged records are gone.
            Some(Named { seq, .. }) if seq < h.seq => {
                return Err(AuditError::HeadAhead {
                    tenant: tenant.clone(),
                    head: h.seq,
                });
            }
            None => {
                return Err(AuditError::HeadAhead {
                    tenant: tenant.clone(),
                    head: h.seq,
                });
            }
            // Not the head's record as written (or, keyed, a line that no longer vouches for
            // itself).
            Some(_) => {
                return Err(AuditError::HeadMismatch {
                    tenant: tenant.clone(),
                    head: h.seq,
                });
            }
        }
    }
    // Forward from the head: the lines that chain on are resumed; from the first that does not
    // (unreadable, or not the next record — what a crash can leave past the head) the segment
    // is cut, where it is the last one. Every refusal comes before anything is cut.
    let chained = chained_count(&after, next, digest);
    // A genesis head stands beside one record at most (a tenant's first goes down alone with a
    // head naming it): more that chain on is a rewritten head.
    if named.is_none() && chained > 1 {
        return Err(AuditError::GenesisBehind {
            tenant: tenant.clone(),
            records: chained,
        });
    }
    let mut lines = after.into_iter().rev();
    for line in lines.by_ref().take(chained as usize) {
        next = next.and_then(|n| n.checked_add(1));
        if let Ok(l) = line.parsed {
            digest = l.link;
        }
    }
    let unchained = lines.next();
    // Keyed, lines that carry the log's MAC past one that does not chain were written by the
    // gateway after it. A readable line there is an edit (or a head put back from an older
    // copy), not a crash's leftovers (a failed write stops the log), and cutting would destroy
    // the records that prove it — and let `verify` pass on what is left: refused. A line of
    // NULs in the last segment is what a power loss leaves of a block written before the ones
    // after it: those lines are set aside whole, where `verify` reports them, and the log
    // goes on (refusing left the gateway unable to start after a power cut).
    let mut set_aside = false;
    if let (Some(broken), true) = (&unchained, chain.is_keyed())
        && let Some(vouched) = lines.find(|l| l.parsed.is_ok())
    {
        if !(broken.debris && broken.path == last_path) {
            return Err(AuditError::VouchedPastBreak {
                tenant: tenant.clone(),
                path: broken.path.clone(),
                line: broken.line,
                vouched: vouched.line,
            });
        }
        set_aside = true;
    }
    if let Some(line) = unchained.as_ref().filter(|l| l.path != last_path) {
        return Err(AuditError::Corrupt {
            path: line.path.clone(),
            line: line.line,
            reason: match &line.parsed {
                Err(reason) => reason.clone(),
                Ok(_) => "the record does not follow the one before it".to_owned(),
            },
        });
    }
    cut_torn(recoveries)?;
    if let Some(line) = unchained {
        let moved = segment_len - line.offset;
        if set_aside {
            let kept = layout::set_aside_path(&tdir, last_segment, line.offset);
            keep_aside(&kept, &bytes[line.offset as usize..segment_len as usize])?;
            sync_dir(&tdir)?;
            cut(&last_path, line.offset)?;
            recoveries.push(Recovery::SetAside {
                path: last_path.clone(),
                line: line.line,
                bytes: moved,
                kept,
            });
        } else {
            cut(&last_path, line.offset)?;
            recoveries.push(Recovery::CutUnchained {
                path: last_path.clone(),
                line: line.line,
                bytes: moved,
            });
        }
        segment_len = line.offset;
    }
    // Lines resumed past the head were written, but a crash between their write and its fsync
    // leaves them in the page cache only: they are made durable now, and the head moved to the
    // last of them, before they are read as durable or anything is written after them (a power
    // loss could otherwise take them from under the records that follow, chained to them; and
    // a tenant's first record from under the head naming it). The head naming the last also
    // means that a second crash, after more records, cannot leave a genesis head behind more
    // than one.
    if let Some(last) = next.filter(|_| chained > 0).and_then(|n| n.checked_sub(1)) {
        File::open(&last_path)
            .and_then(|f| f.sync_all())
            .map_err(io_err("fsync", &last_path))?;
        write_head(
            &tdir,
            chain,
            tenant,
            HeadFile::At(Head {
                seq: Seq(last),
                digest,
            }),
        )?;
    }
    let Some(next_seq) = next else {
        return Err(AuditError::Corrupt {
            path: last_path,
            line: 0,
            reason: "the sequence number space is exhausted".to_owned(),
        });
    };
    Ok(Some(TenantState {
        next_seq,
        last_digest: digest,
        segment: last_segment,
        segment_len,
        pending: Vec::new(),
        durable: next_seq,
    }))
}
