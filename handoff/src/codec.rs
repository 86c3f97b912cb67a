//! The data plane's wire format. Every message starts with the same 24 bytes:
//!
//! ```text
//! magic "BHKV" (4) │ version u8 │ kind u8 │ reserved u16 = 0 │ nonce (16)
//! kind 1, frame:    index u32 │ tag u64 │ token start u32 │ token end u32 │ checksum u64 │ len u32 │ bytes
//! kind 2, manifest: tokens u32 │ pages u32 │ digest u64 │ first token u32
//! kind 3, closed:   reason u8 (0 complete, 1 aborted, 2 failed)
//! ```
//!
//! Integers are little endian. [`decode`] reads one message from the front of a buffer and
//! never panics: short input asks for more, anything malformed is a [`CodecError`] (the
//! connection is then torn down, which counts as a drain for every session on it).

use bulkhead_kvpool::Tag;

use crate::message::{CloseReason, Frame, FrameHeader, Manifest, Message, SessionNonce};

const MAGIC: [u8; 4] = *b"BHKV";
/// 2: a reservation may start after decode's cached prefix (`Reservation::cached_tokens`), so
/// frame positions depend on a field a version-1 peer does not know.
/// 3: the manifest's digest covers its own fields (the first token above all), so a
/// version-2 peer's digest fails every commit.
pub const VERSION: u8 = 3;
/// Bytes every message starts with.
pub const HEADER: usize = 24;
const FRAME_FIELDS: usize = 32;
const MANIFEST_FIELDS: usize = 20;

/// Why bytes are not a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("bad magic {0:02x?}: not a Bulkhead KV stream")]
    Magic([u8; 4]),
    #[error("protocol version {0} is not supported (this build speaks {VERSION})")]
    Version(u8),
    #[error("unknown message kind {0}")]
    Kind(u8),
    #[error("reserved header bits are set")]
    Reserved,
    #[error("frame of {len} bytes exceeds the limit of {limit}")]
    TooLarge { len: u32, limit: u32 },
    #[error("frame token range {start}..{end} is empty or reversed")]
    Tokens { start: u32, end: u32 },
    #[error("unknown close reason {0}")]
    CloseReason(u8),
}

/// Appends the encoding of `m` to `out`.
pub fn encode(m: &Message, out: &mut Vec<u8>) {
    match m {
        Message::Frame(f) => encode_frame(f, out),
        Message::Manifest(x) => {
            header(2, &x.nonce, out);
            out.extend_from_slice(&x.tokens.to_le_bytes());
            out.extend_from_slice(&x.pages.to_le_bytes());
            out.extend_from_slice(&x.digest.to_le_bytes());
            out.extend_from_slice(&x.first_token.to_le_bytes());
        }
        Message::Closed { nonce, reason } => {
            header(3, nonce, out);
            out.push(match reason {
                CloseReason::Complete => 0,
                CloseReason::Aborted => 1,
                CloseReason::Failed => 2,
            });
        }
    }
}

/// Appends the encoding of a frame (as [`encode`] of `Message::Frame`, without moving it).
pub fn encode_frame(f: &Frame, out: &mut Vec<u8>) {
    out.extend_from_slice(&frame_head(&f.header, f.bytes.len() as u32));
    out.extend_from_slice(&f.bytes);
}

fn header(kind: u8, nonce: &SessionNonce, out: &mut Vec<u8>) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[VERSION, kind, 0, 0]);
    out.extend_from_slice(&nonce.0);
}

/// The front of a message: a frame's header (its bytes follow on the wire), or a whole
/// message of another kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// A frame whose `len` bytes follow the header.
    Frame { header: FrameHeader, len: u32 },
    /// A manifest or `Closed`: nothing follows.
    Whole(Message),
}

/// Bytes of a frame's head on the wire (before its bytes); the most [`decode_head`] ever needs.
pub const FRAME_HEAD: usize = HEADER + FRAME_FIELDS;

/// The length of the head of a message whose first [`HEADER`] bytes are `prefix`: what
/// [`decode_head`] needs to decide. `None` for an unknown kind (which `decode_head` refuses).
pub fn head_len(prefix: &[u8; HEADER]) -> Option<usize> {
    match prefix[5] {
        1 => Some(FRAME_HEAD),
        2 => Some(HEADER + MANIFEST_FIELDS),
        3 => Some(HEADER + 1),
        _ => None,
    }
}

/// Reads the head of one message from the front of `buf`: `Ok(Some((head, bytes used)))`,
/// `Ok(None)` when `buf` holds only part of it, or an error. A frame's bytes are not read:
/// the caller reads them straight into their buffer. Frames longer than `max_frame_bytes`
/// are refused before their bytes are awaited.
pub fn decode_head(buf: &[u8], max_frame_bytes: u32) -> Result<Option<(Head, usize)>, CodecError> {
    let Some(head) = buf.get(..HEADER) else {
        return Ok(None);
    };
    let magic: [u8; 4] = [head[0], head[1], head[2], head[3]];
    if magic != MAGIC {
        return Err(CodecError::Magic(magic));
    }
    if head[4] != VERSION {
        return Err(CodecError::Version(head[4]));
    }
    if head[6] != 0 || head[7] != 0 {
        return Err(CodecError::Reserved);
    }
    let mut nonce = [0u8; 16];
    nonce.copy_from_slice(&head[8..24]);
    let nonce = SessionNonce(nonce);
    let body = &buf[HEADER..];
    match head[5] {
        1 => {
            let Some(f) = body.get(..FRAME_FIELDS) else {
                return Ok(None);
            };
            let (start, end) = (u32_at(f, 12), u32_at(f, 16));
            if start >= end {
                return Err(CodecError::Tokens { start, end });
            }
            let len = u32_at(f, 28);
            if len > max_frame_bytes {
                return Err(CodecError::TooLarge {
                    len,
                    limit: max_frame_bytes,
                });
            }
            let header = FrameHeader {
                nonce,
                index: u32_at(f, 0),
                tag: Tag::new(u64_at(f, 4)),
                tokens: start..end,
                checksum: u64_at(f, 20),
            };
            Ok(Some((Head::Frame { header, len }, FRAME_HEAD)))
        }
        2 => {
            let Some(f) = body.get(..MANIFEST_FIELDS) else {
                return Ok(None);
            };
            let m = Manifest {
                nonce,
                tokens: u32_at(f, 0),
                pages: u32_at(f, 4),
                digest: u64_at(f, 8),
                first_token: u32_at(f, 16),
            };
            Ok(Some((
                Head::Whole(Message::Manifest(m)),
                HEADER + MANIFEST_FIELDS,
            )))
        }
        3 => {
            let Some(&r) = body.first() else {
                return Ok(None);
            };
            let reason = match r {
                0 => CloseReason::Complete,
                1 => CloseReason::Aborted,
                2 => CloseReason::Failed,
                other => return Err(CodecError::CloseReason(other)),
            };
            Ok(Some((
                Head::Whole(Message::Closed { nonce, reason }),
                HEADER + 1,
            )))
        }
        other => Err(CodecError::Kind(other)),
    }
}

/// Reads one message from the front of `buf`: `Ok(Some((message, bytes used)))`, `Ok(None)`
/// when `buf` holds only part of one, or an error. Frames longer than `max_frame_bytes` are
/// refused before their bytes are awaited.
pub fn decode(buf: &[u8], max_frame_bytes: u32) -> Result<Option<(Message, usize)>, CodecError> {
    match decode_head(buf, max_frame_bytes)? {
        None => Ok(None),
        Some((Head::Whole(m), used)) => Ok(Some((m, used))),
        Some((Head::Frame { header, len }, used)) => {
            let Some(bytes) = buf.get(used..used + len as usize) else {
                return Ok(None);
            };
            let frame = Frame {
                header,
                bytes: bytes.to_vec(),
            };
            Ok(Some((Message::Frame(frame), used + len as usize)))
        }
    }
}

/// The head of a frame as [`encode_frame`] writes it, for a sender that writes the bytes
/// from where they lie (a vectored write) instead of copying them behind the head.
pub fn frame_head(h: &FrameHeader, len: u32) -> [u8; FRAME_HEAD] {
    let mut out = [0u8; FRAME_HEAD];
    out[..4].copy_from_slice(&MAGIC);
    out[4] = VERSION;
    out[5] = 1;
    out[8..24].copy_from_slice(&h.nonce.0);
    let f = &mut out[HEADER..];
    f[0..4].copy_from_slice(&h.index.to_le_bytes());
    f[4..12].copy_from_slice(&h.tag.get().to_le_bytes());
    f[12..16].copy_from_slice(&h.tokens.start.to_le_bytes());
    f[16..20].copy_from_slice(&h.tokens.end.to_le_bytes());
    f[20..28].copy_from_slice(&h.checksum.to_le_bytes());
    f[28..32].copy_from_slice(&len.to_le_bytes());
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn message() -> impl Strategy<Value = Message> {
        let nonce = any::<[u8; 16]>().prop_map(SessionNonce);
        prop_oneof![
            (
                nonce.clone(),
                any::<u32>(),
                any::<u64>(),
                0u32..1000,
                1u32..64,
                proptest::collection::vec(any::<u8>(), 0..300)
            )
                .prop_map(|(n, index, tag, start, len, bytes)| {
                    Message::Frame(Frame::new(
                        n,
                        index,
                        Tag::new(tag),
                        start..start + len,
                        bytes,
                    ))
                }),
            (
                nonce.clone(),
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
                any::<u32>()
            )
                .prop_map(|(nonce, tokens, pages, digest, first_token)| {
                    Message::Manifest(Manifest {
                        nonce,
                        tokens,
                        pages,
                        digest,
                        first_token,
                    })
                }),
            (nonce, 0u8..3).prop_map(|(nonce, r)| Message::Closed {
                nonce,
                reason: [
                    CloseReason::Complete,
                    CloseReason::Aborted,
                    CloseReason::Failed
                ][r as usize],
            }),
        ]
    }

    proptest! {
        #[test]
        fn every_message_round_trips(m in message()) {
            let mut buf = Vec::new();
            encode(&m, &mut buf);
            buf.extend_from_slice(b"next");
            let (back, used) = decode(&buf, 1 << 20).unwrap().unwrap();
            prop_assert_eq!(&back, &m);
            prop_assert_eq!(used, buf.len() - 4);
            // `head_len` names exactly the bytes `decode_head` reads: all of a whole message,
            // a frame's head without its bytes.
            let prefix: [u8; HEADER] = buf[..HEADER].try_into().unwrap();
            let head = head_len(&prefix).unwrap();
            let (_, head_used) = decode_head(&buf[..head], 1 << 20).unwrap().unwrap();
            prop_assert_eq!(head_used, head);
            prop_assert_eq!(decode_head(&buf[..head - 1], 1 << 20), Ok(None));
            let whole = if matches!(m, Message::Frame(_)) { FRAME_HEAD } else { used };
            prop_assert_eq!(head, whole);
            for cut in 0..used {
                prop_assert_eq!(decode(&buf[..cut], 1 << 20), Ok(None));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes, 64);
        }

        #[test]
        fn a_flipped_bit_never_passes_as_the_same_valid_frame(m in message(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
            let mut buf = Vec::new();
            encode(&m, &mut buf);
            let at = at.index(buf.len());
            buf[at] ^= 1 << bit;
            if let Ok(Some((Message::Frame(f), _))) = decode(&buf, 1 << 20) {
                let h = &f.header;
                let ok = crate::frame_checksum(&h.nonce, h.index, h.tag, &h.tokens, &f.bytes) == h.checksum;
                prop_assert!(!ok, "a corrupted frame passed its checksum");
            }
        }
    }

    /// A valid closed message with byte `at` set to `value`.
    fn closed_with(at: usize, value: u8) -> Vec<u8> {
        let mut buf = Vec::new();
        let nonce = SessionNonce([0; 16]);
        let reason = CloseReason::Complete;
        encode(&Message::Closed { nonce, reason }, &mut buf);
        buf[at] = value;
        buf
    }

    #[test]
    fn malformed_heads_are_refused_with_their_reason() {
        let refused = |buf: &[u8]| decode(buf, 64).expect_err("malformed");
        assert_eq!(refused(&closed_with(0, b'X')), CodecError::Magic(*b"XHKV"));
        for other in [1, 2, 4] {
            assert_eq!(refused(&closed_with(4, other)), CodecError::Version(other));
        }
        assert_eq!(refused(&closed_with(5, 9)), CodecError::Kind(9));
        assert_eq!(refused(&closed_with(6, 1)), CodecError::Reserved);
        assert_eq!(refused(&closed_with(7, 1)), CodecError::Reserved);
        assert_eq!(refused(&closed_with(HEADER, 3)), CodecError::CloseReason(3));
        let prefix: [u8; HEADER] = closed_with(5, 9)[..HEADER].try_into().unwrap();
        assert_eq!(
            head_len(&prefix),
            None,
            "an unknown kind has no head length"
        );

        let mut frame = Vec::new();
        let f = Frame::new(SessionNonce([0; 16]), 0, Tag::new(1), 5..6, vec![0; 4]);
        encode_frame(&f, &mut frame);
        frame[HEADER + 16..HEADER + 20].copy_from_slice(&5u32.to_le_bytes());
        assert_eq!(refused(&frame), CodecError::Tokens { start: 5, end: 5 });
    }

    #[test]
    fn a_frame_of_exactly_the_limit_is_accepted() {
        let f = Frame::new(SessionNonce([0; 16]), 0, Tag::new(1), 0..1, vec![3; 64]);
        let mut buf = Vec::new();
        encode_frame(&f, &mut buf);
        assert_eq!(decode(&buf, 64), Ok(Some((Message::Frame(f), buf.len()))));
    }

    #[test]
    fn oversized_frames_are_refused_before_their_bytes_arrive() {
        let mut buf = Vec::new();
        encode(
            &Message::Frame(Frame::new(
                SessionNonce([0; 16]),
                0,
                Tag::new(1),
                0..1,
                vec![0; 100],
            )),
            &mut buf,
        );
        assert_eq!(
            decode(&buf[..HEADER + FRAME_FIELDS], 64),
            Err(CodecError::TooLarge {
                len: 100,
                limit: 64
            })
        );
    }
}
