//! Decode's side of a transfer: which frames may be written, and whether the whole transfer
//! may be committed.

use std::ops::Range;

use bulkhead_checks::Check;
use bulkhead_kvpool::{PageId, Tag};

use crate::message::{CheckedFrame, Manifest, Reservation};

/// Where an accepted frame's bytes go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    pub page: PageId,
    /// The tag the reservation holds the page under: whose the written slots are.
    pub tag: Tag,
    /// Absolute token positions; slots `tokens.start % page_tokens ..` of the page.
    pub tokens: Range<u32>,
}

/// Why a frame was not written. Every dropped frame is counted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DropReason {
    #[error("frame of another session")]
    WrongSession,
    #[error("page index {index} is outside the reservation of {pages} pages")]
    IndexOutOfRange { index: u32, pages: usize },
    #[error("page index {index} carries tag {frame:?}, the reservation holds {reserved:?}")]
    TagNotReserved {
        index: u32,
        frame: Tag,
        reserved: Tag,
    },
    #[error("page index {index} no longer belongs to the session (pool tag {current:?})")]
    PageLeftSession { index: u32, current: Option<Tag> },
    #[error("page index {index} carries tokens {got:?}, expected {want:?}")]
    WrongTokens {
        index: u32,
        got: Range<u32>,
        want: Option<Range<u32>>,
    },
    #[error("page index {index} carries {got} bytes, expected {want}")]
    WrongLength { index: u32, got: usize, want: usize },
    #[error("page index {index} arrived twice")]
    Duplicate { index: u32 },
    #[error("page index {index} fails its checksum")]
    Corrupt { index: u32 },
    #[error("frame after the manifest")]
    AfterManifest,
}

impl DropReason {
    /// Every [`DropReason::label`], in declaration order.
    pub const LABELS: [&'static str; 9] = [
        "wrong_session",
        "index_out_of_range",
        "tag_not_reserved",
        "page_left_session",
        "wrong_tokens",
        "wrong_length",
        "duplicate",
        "corrupt",
        "after_manifest",
    ];

    /// A short name of the reason, for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            DropReason::WrongSession => "wrong_session",
            DropReason::IndexOutOfRange { .. } => "index_out_of_range",
            DropReason::TagNotReserved { .. } => "tag_not_reserved",
            DropReason::PageLeftSession { .. } => "page_left_session",
            DropReason::WrongTokens { .. } => "wrong_tokens",
            DropReason::WrongLength { .. } => "wrong_length",
            DropReason::Duplicate { .. } => "duplicate",
            DropReason::Corrupt { .. } => "corrupt",
            DropReason::AfterManifest => "after_manifest",
        }
    }
}

/// Why a transfer may not be committed. The request fails with `kv_integrity_error` and its
/// pages are quarantined.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntegrityFailure {
    #[error("manifest of another session")]
    WrongSession,
    #[error("transferred {sent} tokens, reserved {reserved}")]
    TokenCount { sent: u32, reserved: u32 },
    #[error("manifest claims {sent} pages, reserved {reserved}")]
    PageCount { sent: u32, reserved: usize },
    /// The reservation's pages do not hold the prompt's tokens (none the engine makes: a
    /// commit would start decoding on less KV than the prompt has).
    #[error("the reservation's {reserved} pages do not hold the prompt's tokens")]
    ReservationShort { reserved: usize },
    #[error("page index {index} was never written")]
    PageMissing { index: usize },
    #[error("page index {index} arrived more than once")]
    PageDuplicated { index: usize },
    #[error("page index {index} failed its checksum")]
    ChecksumMismatch { index: usize },
    #[error("the manifest's digest does not match the pages received")]
    DigestMismatch,
    #[error("page index {index} changed tag before commit (pool tag {current:?})")]
    TagChanged { index: usize, current: Option<Tag> },
    #[error("{dropped} frames of this session were dropped")]
    FramesDropped { dropped: u32 },
    /// A frame passed every check and could not be copied into its page (the memory or the
    /// device refused the write): the page holds something else than the frame says.
    #[error("page index {index} was accepted but could not be written")]
    PageNotWritten { index: u32 },
    /// The peer said it sent everything and never sent the manifest that says what: pages
    /// are missing or unverified, as in the incident.
    #[error("the peer closed the transfer as complete without its manifest")]
    CompleteWithoutManifest,
    /// Not a page's fault: the peer's first token cannot be a token of the served model.
    #[error("the manifest's first token {token} is outside the vocabulary of {vocab}")]
    FirstTokenOutOfRange { token: u32, vocab: usize },
}

/// A verified transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    pub first_token: u32,
}

/// Per page of the reservation: what arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arrival {
    Missing,
    Written { checksum: u64 },
    Corrupt,
}

/// The decode side of one transfer session.
#[derive(Debug)]
pub struct Inbound {
    reservation: Reservation,
    arrivals: Vec<Arrival>,
    /// The first page sent twice: one is enough to fail the transfer, and a peer that sends
    /// duplicates without end grows nothing.
    duplicate: Option<usize>,
    /// Frames of this session that were not written, whatever the reason (saturating: a peer
    /// sending malformed frames without end neither wraps it to 0 nor panics on it).
    dropped: u32,
    manifest_seen: bool,
}

impl Inbound {
    pub fn new(reservation: Reservation) -> Inbound {
        let arrivals = vec![Arrival::Missing; reservation.pages.len()];
        Inbound {
            reservation,
            arrivals,
            duplicate: None,
            dropped: 0,
            manifest_seen: false,
        }
    }

    pub fn reservation(&self) -> &Reservation {
        &self.reservation
    }

    /// Frames dropped so far.
    pub fn dropped(&self) -> u32 {
        self.dropped
    }

    /// What arrived damaged so far — a page sent twice, a page that failed its checksum, a
    /// frame dropped — whatever comes next: a session that ends without its manifest after
    /// one of them failed its verification, not merely ended.
    pub fn damage(&self) -> Option<IntegrityFailure> {
        if let Some(index) = self.duplicate {
            return Some(IntegrityFailure::PageDuplicated { index });
        }
        if let Some(index) = self.arrivals.iter().position(|a| *a == Arrival::Corrupt) {
            return Some(IntegrityFailure::ChecksumMismatch { index });
        }
        (self.dropped > 0).then_some(IntegrityFailure::FramesDropped {
            dropped: self.dropped,
        })
    }

    /// Decides whether `frame` may be written. `current_tag` is the pool's tag of the page the
    /// frame names right now: a page that left the session (released, reallocated) never
    /// receives the bytes.
    pub fn accept(
        &mut self,
        frame: &CheckedFrame,
        current_tag: impl FnOnce(PageId) -> Option<Tag>,
    ) -> Result<Write, DropReason> {
        let verdict = self.judge(frame, current_tag);
        match &verdict {
            Ok(_) => {}
            Err(DropReason::Corrupt { index }) => {
                self.arrivals[*index as usize] = Arrival::Corrupt;
            }
            Err(DropReason::Duplicate { index }) => {
                self.duplicate.get_or_insert(*index as usize);
            }
            Err(_) => {}
        }
        if verdict.is_err() {
            self.dropped = self.dropped.saturating_add(1);
        }
        verdict
    }

    fn judge(
        &mut self,
        frame: &CheckedFrame,
        current_tag: impl FnOnce(PageId) -> Option<Tag>,
    ) -> Result<Write, DropReason> {
        if !bulkhead_checks::enabled(Check::HandoffVerification) {
            return self.unverified(frame);
        }
        let h = frame.header();
        let r = &self.reservation;
        if h.nonce != r.nonce {
            return Err(DropReason::WrongSession);
        }
        if self.manifest_seen {
            return Err(DropReason::AfterManifest);
        }
        let index = h.index;
        let slot = r
            .pages
            .get(index as usize)
            .ok_or(DropReason::IndexOutOfRange {
                index,
                pages: r.pages.len(),
            })?;
        if h.tag != slot.tag {
            return Err(DropReason::TagNotReserved {
                index,
                frame: h.tag,
                reserved: slot.tag,
            });
        }
        let want = r.page_range(index);
        if want.as_ref() != Some(&h.tokens) {
            return Err(DropReason::WrongTokens {
                index,
                got: h.tokens.clone(),
                want,
            });
        }
        let want_len = (h.tokens.end - h.tokens.start) as usize * r.token_bytes as usize;
        if frame.bytes().len() != want_len {
            return Err(DropReason::WrongLength {
                index,
                got: frame.bytes().len(),
                want: want_len,
            });
        }
        if self.arrivals[index as usize] != Arrival::Missing {
            return Err(DropReason::Duplicate { index });
        }
        if !frame.intact() {
            return Err(DropReason::Corrupt { index });
        }
        let current = current_tag(slot.page);
        if current != Some(slot.tag) {
            return Err(DropReason::PageLeftSession { index, current });
        }
        self.arrivals[index as usize] = Arrival::Written {
            checksum: h.checksum,
        };
        Ok(Write {
            page: slot.page,
            tag: slot.tag,
            tokens: h.tokens.clone(),
        })
    }

    /// With verification turned off (test builds only): a frame goes wherever its index
    /// points in the reservation — the one thing without which there is no page to write.
    fn unverified(&mut self, frame: &CheckedFrame) -> Result<Write, DropReason> {
        let h = frame.header();
        let r = &self.reservation;
        let slot = r
            .pages
            .get(h.index as usize)
            .ok_or(DropReason::IndexOutOfRange {
                index: h.index,
                pages: r.pages.len(),
            })?;
        self.arrivals[h.index as usize] = Arrival::Written {
            checksum: h.checksum,
        };
        Ok(Write {
            page: slot.page,
            tag: slot.tag,
            tokens: h.tokens.clone(),
        })
    }

    /// Checks the finished transfer against the manifest and the pool's tags right now. Only
    /// `Ok` lets decode commit the pages to the request.
    pub fn finish(
        &mut self,
        manifest: &Manifest,
        current_tag: impl Fn(PageId) -> Option<Tag>,
    ) -> Result<Committed, IntegrityFailure> {
        self.manifest_seen = true;
        if !bulkhead_checks::enabled(Check::HandoffVerification) {
            return Ok(Committed {
                first_token: manifest.first_token,
            });
        }
        let r = &self.reservation;
        if manifest.nonce != r.nonce {
            return Err(IntegrityFailure::WrongSession);
        }
        if manifest.tokens != r.prompt_tokens {
            return Err(IntegrityFailure::TokenCount {
                sent: manifest.tokens,
                reserved: r.prompt_tokens,
            });
        }
        if manifest.pages as usize != r.pages.len() {
            return Err(IntegrityFailure::PageCount {
                sent: manifest.pages,
                reserved: r.pages.len(),
            });
        }
        if r.pages_needed() != Some(r.pages.len()) {
            return Err(IntegrityFailure::ReservationShort {
                reserved: r.pages.len(),
            });
        }
        if let Some(index) = self.duplicate {
            return Err(IntegrityFailure::PageDuplicated { index });
        }
        let mut checksums = Vec::with_capacity(self.arrivals.len());
        for (index, a) in self.arrivals.iter().enumerate() {
            match *a {
                Arrival::Missing => return Err(IntegrityFailure::PageMissing { index }),
                Arrival::Corrupt => return Err(IntegrityFailure::ChecksumMismatch { index }),
                Arrival::Written { checksum } => checksums.push(checksum),
            }
        }
        if self.dropped > 0 {
            return Err(IntegrityFailure::FramesDropped {
                dropped: self.dropped,
            });
        }
        if !manifest.covers(checksums) {
            return Err(IntegrityFailure::DigestMismatch);
        }
        for (index, p) in r.pages.iter().enumerate() {
            let current = current_tag(p.page);
            if current != Some(p.tag) {
                return Err(IntegrityFailure::TagChanged { index, current });
            }
        }
        Ok(Committed {
            first_token: manifest.first_token,
        })
    }
}

#[cfg(test)]
mod tests {
    use bulkhead_kvpool::PageRef;

    use super::*;
    use crate::message::{Frame, Message, SessionNonce};

    /// A frame as the receive path hands it over: checked.
    fn c(f: &Frame) -> CheckedFrame {
        f.clone().check()
    }

    const NONCE: SessionNonce = SessionNonce([3; 16]);

    /// A 40-token prompt over pages 7, 2, 9 with tags 70, 20, 90; 4 bytes per token.
    fn reservation() -> Reservation {
        let pages = [(7, 70), (2, 20), (9, 90)].map(|(p, t)| PageRef {
            page: PageId::new(p),
            tag: Tag::new(t),
        });
        Reservation {
            nonce: NONCE,
            pages: pages.to_vec(),
            prompt_tokens: 40,
            cached_tokens: 0,
            page_tokens: 16,
            token_bytes: 4,
        }
    }

    fn frames(r: &Reservation) -> Vec<Frame> {
        (0..r.pages.len() as u32)
            .map(|i| {
                let tokens = r.page_range(i).unwrap();
                let bytes = vec![i as u8; (tokens.len()) * 4];
                Frame::new(r.nonce, i, r.pages[i as usize].tag, tokens, bytes)
            })
            .collect()
    }

    fn manifest(frames: &[Frame]) -> Manifest {
        Manifest::new(NONCE, 40, 11, frames.iter().map(|f| f.header.checksum))
    }

    /// A reservation that cannot hold its prompt never commits, however whole what arrived
    /// for it (the engine makes none: a cut table, a page size of zero).
    #[test]
    fn a_reservation_short_of_its_prompt_never_commits() {
        let mut r = reservation();
        r.pages.truncate(2);
        let fs = frames(&r);
        let mut s = Inbound::new(r);
        for f in &fs {
            s.accept(&c(f), live).expect("written");
        }
        assert_eq!(
            s.finish(&manifest(&fs), live),
            Err(IntegrityFailure::ReservationShort { reserved: 2 })
        );
    }

    /// A session of [`reservation`] that took every one of its frames, and the frames.
    fn every_frame_in() -> (Inbound, Vec<Frame>) {
        let r = reservation();
        let fs = frames(&r);
        let mut s = Inbound::new(r);
        for f in &fs {
            s.accept(&c(f), live).expect("written");
        }
        (s, fs)
    }

    /// Tags as the pool has them while the session holds its pages.
    fn live(p: PageId) -> Option<Tag> {
        Some(Tag::new(u64::from(p.get()) * 10))
    }

    #[test]
    fn a_complete_transfer_commits() {
        let r = reservation();
        let fs = frames(&r);
        let mut s = Inbound::new(r);
        let writes: Vec<Write> = fs.iter().map(|f| s.accept(&c(f), live).unwrap()).collect();
        assert_eq!(
            writes[2],
            Write {
                page: PageId::new(9),
                tag: Tag::new(90),
                tokens: 32..40
            }
        );
        assert_eq!(
            s.finish(&manifest(&fs), live),
            Ok(Committed { first_token: 11 })
        );
    }

    #[test]
    fn after_a_cached_prefix_only_the_rest_is_sent_at_its_own_positions() {
        // Decode holds the first 32 tokens: the transfer fills one page with tokens 32..40.
        let r = Reservation {
            pages: reservation().pages[..1].to_vec(),
            cached_tokens: 32,
            ..reservation()
        };
        let fs = frames(&r);
        assert_eq!(fs[0].header.tokens, 32..40);
        let mut s = Inbound::new(r.clone());
        assert_eq!(
            s.accept(&c(&fs[0]), live),
            Ok(Write {
                page: PageId::new(7),
                tag: Tag::new(70),
                tokens: 32..40
            })
        );
        assert_eq!(
            s.finish(&manifest(&fs), live),
            Ok(Committed { first_token: 11 })
        );
        // A sender that ignored the cached tokens writes the prompt's start into that page.
        let from_zero = Frame::new(NONCE, 0, Tag::new(70), 0..16, vec![0; 16 * 4]);
        let mut s = Inbound::new(r);
        assert_eq!(
            s.accept(&c(&from_zero), live),
            Err(DropReason::WrongTokens {
                index: 0,
                got: 0..16,
                want: Some(32..40)
            })
        );
        assert_eq!(
            s.finish(&manifest(&[from_zero]), live),
            Err(IntegrityFailure::PageMissing { index: 0 })
        );
    }

    #[test]
    fn the_incident_one_page_for_a_whole_prompt_never_commits() {
        // Prefill "rejected" the prompt by computing one placeholder page and reporting success.
        let r = reservation();
        let fs = frames(&r);
        let mut s = Inbound::new(r);
        s.accept(&c(&fs[0]), live).unwrap();
        let claimed = Manifest {
            tokens: 1,
            pages: 1,
            ..manifest(&fs[..1])
        };
        assert_eq!(
            s.finish(&claimed, live),
            Err(IntegrityFailure::TokenCount {
                sent: 1,
                reserved: 40
            })
        );
        // Even a manifest that lies about the count is caught by coverage.
        let mut s = Inbound::new(reservation());
        s.accept(&c(&fs[0]), live).unwrap();
        assert_eq!(
            s.finish(&manifest(&fs), live),
            Err(IntegrityFailure::PageMissing { index: 1 })
        );
    }

    #[test]
    fn a_corrupt_frame_is_not_written_and_fails_the_transfer() {
        let r = reservation();
        let mut fs = frames(&r);
        fs[1].bytes[0] ^= 1;
        let mut s = Inbound::new(r);
        assert!(s.accept(&c(&fs[0]), live).is_ok());
        assert_eq!(
            s.accept(&c(&fs[1]), live),
            Err(DropReason::Corrupt { index: 1 })
        );
        assert_eq!(s.dropped(), 1);
        assert!(s.accept(&c(&fs[2]), live).is_ok());
        assert_eq!(
            s.finish(&manifest(&fs), live),
            Err(IntegrityFailure::ChecksumMismatch { index: 1 })
        );
    }

    #[test]
    fn frames_for_pages_that_left_the_session_are_dropped() {
        let r = reservation();
        let fs = frames(&r);
        let mut s = Inbound::new(r);
        let reused = |p: PageId| {
            if p.get() == 2 {
                Some(Tag::new(999))
            } else {
                live(p)
            }
        };
        assert_eq!(
            s.accept(&c(&fs[1]), reused),
            Err(DropReason::PageLeftSession {
                index: 1,
                current: Some(Tag::new(999))
            })
        );
        assert_eq!(s.dropped(), 1);
    }

    #[test]
    fn foreign_duplicated_and_misaddressed_frames_are_dropped_and_counted() {
        let r = reservation();
        let fs = frames(&r);
        let mut s = Inbound::new(r.clone());
        let other = Frame::new(SessionNonce([4; 16]), 0, Tag::new(70), 0..16, vec![0; 64]);
        assert_eq!(s.accept(&c(&other), live), Err(DropReason::WrongSession));
        let stale_tag = Frame::new(NONCE, 0, Tag::new(69), 0..16, vec![0; 64]);
        assert!(matches!(
            s.accept(&c(&stale_tag), live),
            Err(DropReason::TagNotReserved { index: 0, .. })
        ));
        let past_end = Frame::new(NONCE, 3, Tag::new(70), 48..64, vec![0; 64]);
        assert!(matches!(
            s.accept(&c(&past_end), live),
            Err(DropReason::IndexOutOfRange { index: 3, .. })
        ));
        let short = Frame::new(NONCE, 2, Tag::new(90), 32..40, vec![0; 31]);
        assert!(matches!(
            s.accept(&c(&short), live),
            Err(DropReason::WrongLength { index: 2, .. })
        ));
        let shifted = Frame::new(NONCE, 2, Tag::new(90), 33..41, vec![0; 32]);
        assert!(matches!(
            s.accept(&c(&shifted), live),
            Err(DropReason::WrongTokens { index: 2, .. })
        ));
        assert!(s.accept(&c(&fs[0]), live).is_ok());
        assert_eq!(
            s.accept(&c(&fs[0]), live),
            Err(DropReason::Duplicate { index: 0 })
        );
        assert_eq!(s.dropped(), 6);
        s.accept(&c(&fs[1]), live).unwrap();
        s.accept(&c(&fs[2]), live).unwrap();
        assert_eq!(
            s.finish(&manifest(&fs), live),
            Err(IntegrityFailure::PageDuplicated { index: 0 })
        );
        assert_eq!(s.accept(&c(&fs[2]), live), Err(DropReason::AfterManifest));
    }

    #[test]
    fn a_dropped_frame_fails_a_transfer_that_is_otherwise_complete() {
        let r = reservation();
        let fs = frames(&r);
        let mut s = Inbound::new(r);
        let stale = Frame::new(NONCE, 0, Tag::new(69), 0..16, vec![0; 64]);
        assert!(s.accept(&c(&stale), live).is_err());
        fs.iter().for_each(|f| {
            s.accept(&c(f), live).unwrap();
        });
        assert_eq!(
            s.finish(&manifest(&fs), live),
            Err(IntegrityFailure::FramesDropped { dropped: 1 })
        );
    }

    #[test]
    fn every_drop_reason_has_its_own_label_in_declaration_order() {
        let (index, tag, tokens) = (0, Tag::new(1), 0..1);
        let reasons = [
            DropReason::WrongSession,
            DropReason::IndexOutOfRange { index, pages: 1 },
            DropReason::TagNotReserved {
                index,
                frame: tag,
                reserved: tag,
            },
            DropReason::PageLeftSession {
                index,
                current: None,
            },
            DropReason::WrongTokens {
                index,
                got: tokens,
                want: None,
            },
            DropReason::WrongLength {
                index,
                got: 0,
                want: 1,
            },
            DropReason::Duplicate { index },
            DropReason::Corrupt { index },
            DropReason::AfterManifest,
        ];
        assert_eq!(reasons.map(|r| r.label()), DropReason::LABELS);
    }

    #[test]
    fn a_tag_change_before_commit_fails_the_transfer() {
        let (mut s, fs) = every_frame_in();
        let moved = |p: PageId| if p.get() == 9 { None } else { live(p) };
        assert_eq!(
            s.finish(&manifest(&fs), moved),
            Err(IntegrityFailure::TagChanged {
                index: 2,
                current: None
            })
        );
    }

    #[test]
    fn a_wrong_digest_fails_the_transfer() {
        let (mut s, fs) = every_frame_in();
        let bad = Manifest {
            digest: 0,
            ..manifest(&fs)
        };
        assert_eq!(s.finish(&bad, live), Err(IntegrityFailure::DigestMismatch));
        // A bit flipped on the wire in the first token, which no other check reads: decode
        // generated from another token than prefill sampled.
        let mut wire = Vec::new();
        crate::codec::encode(&Message::Manifest(manifest(&fs)), &mut wire);
        wire[crate::codec::HEADER + 16] ^= 1;
        let Ok(Some((Message::Manifest(flipped), _))) = crate::codec::decode(&wire, u32::MAX)
        else {
            panic!("the flipped manifest still parses");
        };
        assert_eq!(flipped.first_token, 11 ^ 1);
        assert_eq!(
            s.finish(&flipped, live),
            Err(IntegrityFailure::DigestMismatch)
        );
    }

    /// A manifest for the right number of tokens is still checked for its session and its
    /// page count: every frame written, but the manifest of another session, or one that
    /// counts another number of pages, does not commit.
    #[test]
    fn a_manifest_of_another_session_or_page_count_fails_the_transfer() {
        let (mut s, fs) = every_frame_in();
        let foreign = Manifest {
            nonce: SessionNonce([4; 16]),
            ..manifest(&fs)
        };
        assert_eq!(
            s.finish(&foreign, live),
            Err(IntegrityFailure::WrongSession)
        );
        let counted = Manifest {
            pages: 2,
            ..manifest(&fs)
        };
        assert_eq!(
            s.finish(&counted, live),
            Err(IntegrityFailure::PageCount {
                sent: 2,
                reserved: 3
            })
        );
        assert_eq!(
            s.finish(&manifest(&fs), live),
            Ok(Committed { first_token: 11 })
        );
    }
}
