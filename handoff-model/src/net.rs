//! Messages and the network: an in-flight multiset. Any message in flight may be delivered
//! next (reordering), dropped, or — within a budget — duplicated or corrupted.

use std::collections::BTreeMap;
use std::fmt;

use crate::ids::{Nonce, PageIdx, ReqIdx, Tag};

/// One entry of a reservation's page table, as sent to prefill and echoed in frames.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Slot {
    /// The decode page.
    pub page: PageIdx,
    /// The tag the page got when this reservation allocated it.
    pub tag: Tag,
}

/// A message between decode (D) and prefill (Pf).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum Msg {
    /// D → Pf: compute `req`'s prompt and write it into `table`.
    Prefill {
        /// The transfer session.
        nonce: Nonce,
        /// The request (its prompt length is in the config).
        req: ReqIdx,
        /// The reservation's pages, in prompt order.
        table: Vec<Slot>,
    },
    /// D → Pf: stop sending for this session and acknowledge.
    Abort {
        /// The transfer session.
        nonce: Nonce,
    },
    /// Pf → D: the prompt does not fit prefill; nothing was or will be sent.
    Reject {
        /// The transfer session.
        nonce: Nonce,
    },
    /// Pf → D: the KV of one page.
    Frame {
        /// The transfer session.
        nonce: Nonce,
        /// Where the bytes go, with the tag the reservation gave that page.
        slot: Slot,
        /// Whether the bytes still match their checksum.
        checksum_ok: bool,
        /// Whose bytes these are (always the sender session's; kept explicit for the
        /// properties).
        bytes: Nonce,
    },
    /// Pf → D: the transfer is complete.
    Manifest {
        /// The transfer session.
        nonce: Nonce,
        /// Frames (pages) sent.
        pages_written: u8,
        /// Digest of the per-page checksums, modelled as the slots the frames carried.
        digest: Vec<Slot>,
    },
    /// Pf → D: after an `Abort`: nothing more will be sent for this session.
    DrainAck {
        /// The transfer session.
        nonce: Nonce,
    },
}

impl Msg {
    /// The session the message belongs to.
    #[must_use]
    pub fn nonce(&self) -> Nonce {
        match self {
            Self::Prefill { nonce, .. }
            | Self::Abort { nonce }
            | Self::Reject { nonce }
            | Self::Frame { nonce, .. }
            | Self::Manifest { nonce, .. }
            | Self::DrainAck { nonce } => *nonce,
        }
    }

    /// Whether the message travels from prefill to decode.
    #[must_use]
    pub fn to_decode(&self) -> bool {
        !matches!(self, Self::Prefill { .. } | Self::Abort { .. })
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.page, self.tag)
    }
}

impl fmt::Display for Msg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Prefill { nonce, req, table } => {
                write!(f, "Prefill({req}, {nonce}, [")?;
                for (i, slot) in table.iter().enumerate() {
                    let sep = if i == 0 { "" } else { " " };
                    write!(f, "{sep}{slot}")?;
                }
                write!(f, "])")
            }
            Self::Abort { nonce } => write!(f, "Abort({nonce})"),
            Self::Reject { nonce } => write!(f, "Reject({nonce})"),
            Self::Frame {
                nonce,
                slot,
                checksum_ok,
                bytes,
            } => {
                let sum = if *checksum_ok { "ok" } else { "CORRUPT" };
                write!(f, "Frame({nonce}, {slot}, {sum}, bytes of {bytes})")
            }
            Self::Manifest {
                nonce,
                pages_written,
                ..
            } => write!(f, "Manifest({nonce}, {pages_written} pages)"),
            Self::DrainAck { nonce } => write!(f, "DrainAck({nonce})"),
        }
    }
}

/// Messages in flight, with multiplicity. Ordered, so that states hash and compare
/// canonically and actions are listed deterministically.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct Network {
    in_flight: BTreeMap<Msg, u8>,
}

impl Network {
    /// Puts one copy of `msg` in flight.
    pub fn send(&mut self, msg: Msg) {
        *self.in_flight.entry(msg).or_insert(0) += 1;
    }

    /// Takes one copy of `msg` out of flight; false if none was in flight.
    pub fn take(&mut self, msg: &Msg) -> bool {
        match self.in_flight.get_mut(msg) {
            Some(n) if *n > 1 => {
                *n -= 1;
                true
            }
            Some(_) => {
                self.in_flight.remove(msg);
                true
            }
            None => false,
        }
    }

    /// The distinct messages in flight.
    pub fn distinct(&self) -> impl Iterator<Item = &Msg> {
        self.in_flight.keys()
    }

    /// Drops every message in flight (the transport was torn down).
    pub fn clear(&mut self) {
        self.in_flight.clear();
    }

    /// Whether any message of session `nonce` is in flight.
    #[must_use]
    pub fn carries(&self, nonce: Nonce) -> bool {
        self.in_flight.keys().any(|m| m.nonce() == nonce)
    }

    /// Whether nothing is in flight.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_network_is_a_multiset() {
        let abort = Msg::Abort { nonce: Nonce(0) };
        let mut net = Network::default();
        net.send(abort.clone());
        net.send(abort.clone());
        assert_eq!(net.distinct().count(), 1);
        assert!(net.take(&abort));
        assert!(net.take(&abort));
        assert!(!net.take(&abort));
        assert!(net.is_empty());
    }
}
