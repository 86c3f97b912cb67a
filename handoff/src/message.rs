use std::fmt;
use std::ops::Range;

use bulkhead_kvpool::{PageRef, Tag};
use xxhash_rust::xxh3::Xxh3;

/// A transfer session's identity: 128 random bits chosen by decode for each reservation, so a
/// frame from any other session (an earlier one on the same pages, another request) can never
/// be mistaken for this one's.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionNonce(pub [u8; 16]);

impl fmt::Debug for SessionNonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionNonce(")?;
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        write!(f, ")")
    }
}

impl fmt::Display for SessionNonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// What decode reserved for a prompt's KV, as it names it to prefill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub nonce: SessionNonce,
    /// The pages the transfer fills, in token order: one for every `page_tokens` of the
    /// prompt after `cached_tokens`.
    pub pages: Vec<PageRef>,
    /// Tokens of the prompt; the transfer must deliver exactly those after `cached_tokens`.
    pub prompt_tokens: u32,
    /// Tokens at the prompt's start whose KV decode already holds (in its tenant's prefix
    /// cache): whole pages, fewer than `prompt_tokens`. Nothing of them is sent.
    pub cached_tokens: u32,
    pub page_tokens: u32,
    /// Bytes of KV per token (all layers, K and V); a frame of `n` tokens has `n * token_bytes`.
    pub token_bytes: u32,
}

impl Reservation {
    /// The absolute token positions page `index` of the transfer holds:
    /// `[cached_tokens + index * page_tokens, …)` up to the prompt's end, or `None` when the
    /// page lies past it.
    pub fn page_range(&self, index: u32) -> Option<Range<u32>> {
        let start = index
            .checked_mul(self.page_tokens)?
            .checked_add(self.cached_tokens)?;
        let end = start
            .saturating_add(self.page_tokens)
            .min(self.prompt_tokens);
        (start < self.prompt_tokens).then_some(start..end)
    }

    /// Pages the transfer fills: the prompt's tokens after `cached_tokens`, a page per
    /// `page_tokens` (`None` for a page size of zero or more cached tokens than the prompt).
    pub fn pages_needed(&self) -> Option<usize> {
        let sent = self.prompt_tokens.checked_sub(self.cached_tokens)?;
        (self.page_tokens > 0).then(|| sent.div_ceil(self.page_tokens) as usize)
    }

    /// Tokens whose KV the transfer carries.
    pub fn sent_tokens(&self) -> u32 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
}

/// Everything a frame says about its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameHeader {
    pub nonce: SessionNonce,
    /// Index of the page in the reservation's page list.
    pub index: u32,
    /// The tag of that page the sender was given.
    pub tag: Tag,
    /// Absolute token positions the bytes hold.
    pub tokens: Range<u32>,
    /// [`frame_checksum`] of the header fields above and the bytes.
    pub checksum: u64,
}

/// One page's KV for a token range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub header: FrameHeader,
    pub bytes: Vec<u8>,
}

impl Frame {
    /// A frame whose checksum covers its header fields and `bytes`.
    pub fn new(
        nonce: SessionNonce,
        index: u32,
        tag: Tag,
        tokens: Range<u32>,
        bytes: Vec<u8>,
    ) -> Frame {
        let checksum = frame_checksum(&nonce, index, tag, &tokens, &bytes);
        Frame {
            header: FrameHeader {
                nonce,
                index,
                tag,
                tokens,
                checksum,
            },
            bytes,
        }
    }
}

impl Frame {
    /// Computes the frame's checksum over its header fields and bytes and records the verdict.
    /// Decode runs this on the task that receives the bytes (while they are hot in cache and
    /// off the engine thread); [`crate::Inbound::accept`] only takes checked frames.
    pub fn check(self) -> CheckedFrame {
        let h = &self.header;
        let intact = frame_checksum(&h.nonce, h.index, h.tag, &h.tokens, &self.bytes) == h.checksum;
        CheckedFrame {
            frame: self,
            intact,
        }
    }
}

/// A frame whose checksum has been computed ([`Frame::check`]). The verdict can be set no
/// other way, so a frame cannot reach [`crate::Inbound::accept`] unchecked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedFrame {
    frame: Frame,
    /// Whether the checksum in the header matches the header fields and the bytes.
    intact: bool,
}

impl CheckedFrame {
    pub fn header(&self) -> &FrameHeader {
        &self.frame.header
    }

    pub fn bytes(&self) -> &[u8] {
        &self.frame.bytes
    }

    /// Whether the checksum matched.
    pub fn intact(&self) -> bool {
        self.intact
    }

    /// The frame's bytes, to reuse their buffer.
    pub fn into_bytes(self) -> Vec<u8> {
        self.frame.bytes
    }
}

/// XXH3-64 over the frame's identifying fields and its bytes: a flipped bit anywhere in the
/// frame, header included, fails the check.
pub fn frame_checksum(
    nonce: &SessionNonce,
    index: u32,
    tag: Tag,
    tokens: &Range<u32>,
    bytes: &[u8],
) -> u64 {
    let mut h = Xxh3::new();
    h.update(&nonce.0);
    h.update(&index.to_le_bytes());
    h.update(&tag.get().to_le_bytes());
    h.update(&tokens.start.to_le_bytes());
    h.update(&tokens.end.to_le_bytes());
    h.update(bytes);
    h.digest()
}

/// The end of a transfer: what prefill claims it sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub nonce: SessionNonce,
    pub tokens: u32,
    pub pages: u32,
    /// [`digest`] of the frames' checksums in page order.
    pub digest: u64,
    /// The token prefill sampled after the prompt.
    pub first_token: u32,
}

impl Manifest {
    /// The manifest of a transfer of `tokens` whose frames carry `checksums`, in page order.
    pub fn new(
        nonce: SessionNonce,
        tokens: u32,
        first_token: u32,
        checksums: impl IntoIterator<Item = u64>,
    ) -> Manifest {
        let (pages, digest) = digest(&nonce, tokens, first_token, checksums);
        Manifest {
            nonce,
            tokens,
            pages,
            digest,
            first_token,
        }
    }

    /// Whether this manifest's digest was taken over its own fields and `checksums`: a
    /// flipped bit in any of them — the first token too, which nothing else checks — fails it.
    pub fn covers(&self, checksums: impl IntoIterator<Item = u64>) -> bool {
        digest(&self.nonce, self.tokens, self.first_token, checksums) == (self.pages, self.digest)
    }
}

/// The count of `checksums` and the digest of a transfer: XXH3-64 of the frames' checksums in
/// page order, then of the manifest's fields.
fn digest(
    nonce: &SessionNonce,
    tokens: u32,
    first_token: u32,
    checksums: impl IntoIterator<Item = u64>,
) -> (u32, u64) {
    let mut h = Xxh3::new();
    let mut pages = 0u32;
    for c in checksums {
        h.update(&c.to_le_bytes());
        pages = pages.saturating_add(1);
    }
    h.update(&nonce.0);
    h.update(&tokens.to_le_bytes());
    h.update(&pages.to_le_bytes());
    h.update(&first_token.to_le_bytes());
    (pages, h.digest())
}

/// Why prefill closed a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// Frames and manifest were sent.
    Complete,
    /// Decode aborted it; no further frame of the session follows.
    Aborted,
    /// Prefill failed after admission (its own error); no further frame follows.
    Failed,
}

/// A message on the data plane, prefill → decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Frame(Frame),
    Manifest(Manifest),
    /// The last message of a session on this connection.
    Closed {
        nonce: SessionNonce,
        reason: CloseReason,
    },
}

impl Message {
    pub fn nonce(&self) -> SessionNonce {
        match self {
            Message::Frame(f) => f.header.nonce,
            Message::Manifest(m) => m.nonce,
            Message::Closed { nonce, .. } => *nonce,
        }
    }
}

/// A data-plane message as decode's engine takes it: a frame arrives checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    Frame(CheckedFrame),
    Manifest(Manifest),
    Closed {
        nonce: SessionNonce,
        reason: CloseReason,
    },
}

impl Received {
    pub fn nonce(&self) -> SessionNonce {
        match self {
            Received::Frame(f) => f.header().nonce,
            Received::Manifest(m) => m.nonce,
            Received::Closed { nonce, .. } => *nonce,
        }
    }
}

impl From<Message> for Received {
    /// Checks a frame's checksum on the calling thread.
    fn from(m: Message) -> Received {
        match m {
            Message::Frame(f) => Received::Frame(f.check()),
            Message::Manifest(m) => Received::Manifest(m),
            Message::Closed { nonce, reason } => Received::Closed { nonce, reason },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reservation(prompt_tokens: u32, cached_tokens: u32) -> Reservation {
        Reservation {
            nonce: SessionNonce([0; 16]),
            pages: Vec::new(),
            prompt_tokens,
            cached_tokens,
            page_tokens: 16,
            token_bytes: 4,
        }
    }

    #[test]
    fn pages_cover_the_prompt_exactly() {
        let r = reservation(40, 0);
        assert_eq!(r.page_range(0), Some(0..16));
        assert_eq!(r.page_range(2), Some(32..40));
        assert_eq!(r.page_range(3), None);
        assert_eq!(r.pages_needed(), Some(3));
        assert_eq!(
            reservation(32, 0).page_range(2),
            None,
            "a page starting at the end"
        );
        assert_eq!(r.page_range(u32::MAX), None);
    }

    #[test]
    fn pages_after_a_cached_prefix_cover_only_the_rest() {
        let r = reservation(40, 32);
        assert_eq!(r.page_range(0), Some(32..40));
        assert_eq!(r.page_range(1), None);
        assert_eq!(r.pages_needed(), Some(1));
        assert_eq!(r.sent_tokens(), 8);
        let r = reservation(40, u32::MAX - 3);
        assert_eq!(r.page_range(1), None, "no overflow past the cached tokens");
        assert_eq!(r.pages_needed(), None, "more cached than the prompt");
        let mut zero = reservation(40, 0);
        zero.page_tokens = 0;
        assert_eq!(zero.pages_needed(), None);
    }

    /// The digest covers every checksum in page order and every field of the manifest: the
    /// first token above all, which no other check reads (a flipped bit in it had decode
    /// generate from another token than prefill sampled).
    #[test]
    fn the_digest_covers_every_checksum_in_page_order_and_the_manifests_fields() {
        let nonce = SessionNonce([3; 16]);
        let m = Manifest::new(nonce, 40, 11, [1, 2]);
        assert_eq!(m.pages, 2);
        assert!(m.covers([1, 2]));
        for other in [vec![2, 1], vec![1], vec![1, 3], vec![1, 2, 0]] {
            assert!(!m.covers(other.iter().copied()), "{other:?}");
        }
        let flipped = [
            Manifest {
                first_token: 11 ^ 1,
                ..m.clone()
            },
            Manifest {
                tokens: 41,
                ..m.clone()
            },
            Manifest {
                pages: 3,
                ..m.clone()
            },
            Manifest {
                nonce: SessionNonce([4; 16]),
                ..m.clone()
            },
        ];
        for f in flipped {
            assert!(!f.covers([1, 2]), "{f:?}");
        }
    }

    #[test]
    fn a_checked_frame_keeps_its_header_bytes_and_verdict() {
        let frame = Frame::new(SessionNonce([1; 16]), 0, Tag::new(2), 0..1, vec![7, 8]);
        let checked = frame.clone().check();
        assert!(checked.intact());
        assert_eq!(checked.header(), &frame.header);
        assert_eq!(checked.into_bytes(), [7, 8]);
        let mut corrupt = frame;
        corrupt.header.checksum ^= 1;
        assert!(!corrupt.check().intact());
    }

    #[test]
    fn a_nonce_shows_as_hex() {
        let mut bytes = [0; 16];
        bytes[0] = 0xab;
        bytes[15] = 0x01;
        let nonce = SessionNonce(bytes);
        let hex = "ab000000000000000000000000000001";
        assert_eq!(nonce.to_string(), hex);
        assert_eq!(format!("{nonce:?}"), format!("SessionNonce({hex})"));
    }

    #[test]
    fn the_checksum_covers_header_and_bytes() {
        let n = SessionNonce([7; 16]);
        let base = frame_checksum(&n, 1, Tag::new(5), &(16..32), b"kv");
        assert_ne!(
            base,
            frame_checksum(&SessionNonce([8; 16]), 1, Tag::new(5), &(16..32), b"kv")
        );
        assert_ne!(base, frame_checksum(&n, 2, Tag::new(5), &(16..32), b"kv"));
        assert_ne!(base, frame_checksum(&n, 1, Tag::new(6), &(16..32), b"kv"));
        assert_ne!(base, frame_checksum(&n, 1, Tag::new(5), &(16..31), b"kv"));
        assert_ne!(base, frame_checksum(&n, 1, Tag::new(5), &(16..32), b"kV"));
    }
}
