//! Faults a test build injects into prefill's outgoing KV frames (bulkhead-checks' switches:
//! `corrupt-frame`, `drop-frame`, `duplicate-frame`, `forged-nonce`, `stale-tag`), so that
//! the isolation suite can show, across real processes, what decode does with each. Every
//! definition has a production twin that sends the frames as they are.

use std::borrow::Cow;

use bulkhead_handoff::Frame;

/// The frames to send for a transfer: `frames` themselves, or (test builds with a frame fault
/// injected) a tampered copy — the fault hits the second frame, so a transfer needs at least
/// two pages to be touched.
#[cfg(feature = "check-switches")]
pub(super) fn frames(frames: &[Frame]) -> Cow<'_, [Frame]> {
    use bulkhead_checks::{Fault, injected};
    use bulkhead_handoff::SessionNonce;
    use bulkhead_kvpool::Tag;

    let faults: Vec<Fault> = Fault::ALL
        .into_iter()
        .filter(|&f| f != Fault::IncidentPlaceholder && injected(f))
        .collect();
    if faults.is_empty() || frames.len() < 2 {
        return Cow::Borrowed(frames);
    }
    let mut out = frames.to_vec();
    for fault in faults {
        tracing::warn!(
            fault = fault.name(),
            "FAULT INJECTED into a KV transfer's second frame"
        );
        let f = out[1].clone();
        let h = &f.header;
        match fault {
            Fault::CorruptFrame => {
                if let Some(b) = out[1].bytes.first_mut() {
                    *b ^= 0x5a;
                }
            }
            Fault::DropFrame => {
                out.remove(1);
            }
            Fault::DuplicateFrame => out.insert(2, f),
            Fault::ForgedNonce => {
                let nonce = SessionNonce(rand::random());
                out[1] = Frame::new(nonce, h.index, h.tag, h.tokens.clone(), f.bytes.clone());
            }
            Fault::StaleTag => {
                let stale = Tag::new(h.tag.get().saturating_sub(1));
                out[1] = Frame::new(h.nonce, h.index, stale, h.tokens.clone(), f.bytes.clone());
            }
            Fault::IncidentPlaceholder => {}
        }
    }
    Cow::Owned(out)
}

/// The frames to send for a transfer: as they are.
#[cfg(not(feature = "check-switches"))]
pub(super) fn frames(frames: &[Frame]) -> Cow<'_, [Frame]> {
    Cow::Borrowed(frames)
}
