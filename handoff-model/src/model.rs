//! The transition relation: which actions are enabled in a state, and what each one does.

use std::fmt;

use stateright::{Model, Property};

use crate::config::Config;
use crate::ids::{Nonce, PageIdx, ReqIdx, Tag};
use crate::net::{Msg, Network, Slot};
use crate::properties;
use crate::state::{
    Contents, Hold, Holder, Outcome, Page, PfSession, Phase, ReqStatus, Request, Session, State,
};

/// One step of the model.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum Action {
    /// Decode admission of a waiting request: reject, fail fast, or reserve and send `Prefill`.
    Admit(ReqIdx),
    /// The client goes away.
    ClientAbort(ReqIdx),
    /// A running request finishes generating; its pages go back.
    Finish(ReqIdx),
    /// The client retries a request whose attempt failed or was aborted.
    Retry(ReqIdx),
    /// Decode's prefix cache evicts an unpinned page: back to the free list (zeroed).
    Evict(PageIdx),
    /// Decode gives up waiting for a drain ack: the session's pages go to quarantine.
    DrainTimeout(Nonce),
    /// A quarantined session's pages go back (zeroed): nothing of the session is in flight
    /// and prefill will send no more (its transport closed, or it acknowledged the drain).
    Reclaim(Nonce),
    /// Prefill sends the session's next frame, or its manifest once every frame is out.
    PrefillSend(Nonce),
    /// The transport between decode and prefill is torn down (once, for good).
    Teardown,
    /// The network delivers one copy of a message.
    Deliver(Msg),
    /// The network loses one copy of a message.
    Lose(Msg),
    /// The network duplicates a message.
    Duplicate(Msg),
    /// The network corrupts a frame's bytes (its checksum no longer matches).
    Corrupt(Msg),
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Admit(r) => write!(f, "decode admits {r}"),
            Self::ClientAbort(r) => write!(f, "client aborts {r}"),
            Self::Finish(r) => write!(f, "{r} finishes"),
            Self::Retry(r) => write!(f, "client retries {r}"),
            Self::Evict(p) => write!(f, "the prefix cache evicts {p}"),
            Self::DrainTimeout(n) => write!(f, "drain timeout for {n}"),
            Self::Reclaim(n) => write!(f, "reclaim the quarantine of {n}"),
            Self::PrefillSend(n) => write!(f, "prefill sends next message of {n}"),
            Self::Teardown => write!(f, "transport teardown"),
            Self::Deliver(m) => write!(f, "deliver {m}"),
            Self::Lose(m) => write!(f, "lose {m}"),
            Self::Duplicate(m) => write!(f, "duplicate {m}"),
            Self::Corrupt(m) => write!(f, "corrupt {m}"),
        }
    }
}

/// The handoff protocol under one [`Config`].
#[derive(Clone, Debug)]
pub struct HandoffModel {
    /// Variant and bound.
    pub config: Config,
}

impl HandoffModel {
    /// The model of `config`.
    ///
    /// # Panics
    /// If `config.tenants` does not name the tenant of every request.
    #[must_use]
    pub fn new(config: Config) -> Self {
        assert_eq!(
            config.tenants.len(),
            config.requests.len(),
            "one tenant per request"
        );
        Self { config }
    }

    fn prompt_pages(&self, req: ReqIdx) -> u8 {
        self.config.requests.get(req.index()).copied().unwrap_or(0)
    }

    fn tenant(&self, req: ReqIdx) -> u8 {
        self.config.tenants.get(req.index()).copied().unwrap_or(0)
    }

    /// The cached page `req` would read as its prompt's first page: only with the cache on,
    /// only for a prompt longer than that page (the prompt's last page is always computed),
    /// and — unless the variant drops the scope — only its own tenant's.
    fn cached_prefix(&self, s: &State, req: ReqIdx) -> Option<PageIdx> {
        if !self.config.prefix_cache || self.prompt_pages(req) < 2 {
            return None;
        }
        let tenant = self.tenant(req);
        let scoped = self.config.variant.scopes_cache_lookup();
        let at = s.pages.iter().position(
            |p| matches!(p.holder, Holder::Cached { tenant: t, .. } if t == tenant || !scoped),
        )?;
        u8::try_from(at).ok().map(PageIdx)
    }

    /// Pages `req`'s reservation needs now: its prompt less what the cache holds.
    fn pages_to_reserve(&self, s: &State, req: ReqIdx) -> u8 {
        let cached = u8::from(self.cached_prefix(s, req).is_some());
        self.prompt_pages(req) - cached
    }

    fn request_ids(&self) -> impl Iterator<Item = ReqIdx> {
        (0..self.config.requests.len()).filter_map(|i| u8::try_from(i).ok().map(ReqIdx))
    }

    fn init_state(&self) -> State {
        let page = Page {
            holder: Holder::Free,
            tag: None,
            contents: Contents::Zero,
            allocations: 0,
        };
        let request = Request {
            status: ReqStatus::Waiting,
            attempts: 0,
        };
        State {
            pages: vec![page; usize::from(self.config.decode_pages)],
            next_tag: Tag(1),
            next_nonce: Nonce(0),
            requests: vec![request; self.config.requests.len()],
            sessions: Vec::new(),
            prefill: Vec::new(),
            transport_up: true,
            net: Network::default(),
            duplicates_left: self.config.duplicates,
            corruptions_left: self.config.corruptions,
            late_write: None,
            reclaimed: false,
            tenant_of: Vec::new(),
            prefix_read: false,
            evicted: false,
        }
    }

    fn admit(&self, s: &mut State, r: ReqIdx) {
        let need = self.prompt_pages(r);
        if need > self.config.decode_pages {
            s.requests[r.index()].status = ReqStatus::Done(Outcome::RejectedByDecode);
            return;
        }
        if !s.transport_up {
            s.requests[r.index()].status = ReqStatus::Done(Outcome::PeerLost);
            return;
        }
        let prefix = self.cached_prefix(s, r);
        if let Some(page) = prefix
            && self.config.variant.pins_cached_prefix()
            && let Holder::Cached { pins, .. } = &mut s.pages[page.index()].holder
        {
            *pins += 1;
        }
        // `actions` enables admission only when enough pages are free; lowest index first.
        let reserve = self.pages_to_reserve(s, r);
        let pages: Vec<PageIdx> = s.free_pages().take(usize::from(reserve)).collect();
        let nonce = s.next_nonce;
        s.next_nonce = Nonce(nonce.0 + 1);
        if self.config.prefix_cache {
            s.tenant_of.push(self.tenant(r));
        }
        let request = &mut s.requests[r.index()];
        request.status = ReqStatus::InFlight(nonce);
        request.attempts += 1;
        let mut table = Vec::with_capacity(pages.len());
        for page in pages {
            let tag = s.next_tag;
            s.next_tag = Tag(tag.0 + 1);
            let p = &mut s.pages[page.index()];
            p.holder = Holder::Held(nonce, Hold::Reserved);
            p.tag = Some(tag);
            p.allocations = (p.allocations + 1).min(2);
            table.push(Slot { page, tag });
        }
        s.sessions.push(Session {
            nonce,
            req: r,
            prefix,
            written: vec![0; table.len()],
            table: table.clone(),
            phase: Phase::Transfer,
        });
        s.net.send(Msg::Prefill {
            nonce,
            req: r,
            table,
        });
    }

    /// Every page `nonce` holds goes to `to`; free pages are zeroed if the variant zeroes.
    fn move_pages(&self, s: &mut State, nonce: Nonce, to: Holder) {
        let zero = to == Holder::Free && self.config.variant.zeroes_on_release();
        for p in &mut s.pages {
            if matches!(p.holder, Holder::Held(n, _) if n == nonce) {
                p.holder = to;
                if zero {
                    p.contents = Contents::Zero;
                }
            }
        }
    }

    /// Closes decode's session `nonce` (if open) and unpins the cached prefix page it read.
    fn close_session(&self, s: &mut State, nonce: Nonce) {
        self.unpin(s, nonce);
        s.remove_session(nonce);
    }

    /// Session `nonce` stops reading its cached prefix page (if it has one still).
    fn unpin(&self, s: &mut State, nonce: Nonce) {
        let Some(page) = s.session_mut(nonce).and_then(|x| x.prefix.take()) else {
            return;
        };
        if self.config.variant.pins_cached_prefix()
            && let Holder::Cached { pins, .. } = &mut s.pages[page.index()].holder
        {
            *pins = pins.saturating_sub(1);
        }
    }

    /// Ends a request's current attempt if it is still the one using `nonce`.
    fn end_attempt(s: &mut State, nonce: Nonce, outcome: Outcome) {
        for r in &mut s.requests {
            if matches!(r.status, ReqStatus::InFlight(n) | ReqStatus::Running(n) if n == nonce) {
                r.status = ReqStatus::Done(outcome);
            }
        }
    }

    /// Verification failed: quarantine, close the session, tell prefill to stop.
    fn fail_integrity(&self, s: &mut State, nonce: Nonce) {
        self.move_pages(s, nonce, Holder::Quarantined(nonce));
        self.close_session(s, nonce);
        Self::end_attempt(s, nonce, Outcome::IntegrityFailure);
        s.net.send(Msg::Abort { nonce });
    }

    fn client_abort(&self, s: &mut State, r: ReqIdx) {
        match s.requests[r.index()].status {
            ReqStatus::Waiting => {
                s.requests[r.index()].status = ReqStatus::Done(Outcome::Aborted);
            }
            ReqStatus::InFlight(nonce) => {
                s.requests[r.index()].status = ReqStatus::Done(Outcome::Aborted);
                s.net.send(Msg::Abort { nonce });
                // Nothing reads the cached prefix any more: its pin goes now (as decode drops
                // the transfer's `Prefix` when it starts draining), not at the drain's end.
                self.unpin(s, nonce);
                if self.config.variant.releases_eagerly() {
                    // Seeded bug: the allocator gets the pages back now, while the transfer
                    // engine's session stays open until the drain ack.
                    self.move_pages(s, nonce, Holder::Free);
                } else {
                    for p in &mut s.pages {
                        if matches!(p.holder, Holder::Held(n, _) if n == nonce) {
                            p.holder = Holder::Held(nonce, Hold::Releasing);
                        }
                    }
                    if let Some(session) = s.session_mut(nonce) {
                        session.phase = Phase::Draining;
                    }
                }
            }
            ReqStatus::Running(_) | ReqStatus::Done(_) => {}
        }
    }

    fn finish(&self, s: &mut State, r: ReqIdx) {
        if let ReqStatus::Running(nonce) = s.requests[r.index()].status {
            self.cache_prefix(s, r, nonce);
            // Committed: the manifest closed the transfer, nothing can still write.
            self.move_pages(s, nonce, Holder::Free);
            self.close_session(s, nonce);
            s.requests[r.index()].status = ReqStatus::Done(Outcome::Finished);
        }
    }

    /// With the cache on, a finished request's first prompt page stays cached for its tenant
    /// if it computed that page itself and the tenant has no cached copy yet.
    fn cache_prefix(&self, s: &mut State, r: ReqIdx, nonce: Nonce) {
        let tenant = self.tenant(r);
        let Some(session) = s.session(nonce) else {
            return;
        };
        let computed_first = session.prefix.is_none() && self.prompt_pages(r) >= 2;
        let first = session.table.first().map(|e| e.page);
        let already = s
            .pages
            .iter()
            .any(|p| matches!(p.holder, Holder::Cached { tenant: t, .. } if t == tenant));
        if let Some(page) = first
            && self.config.prefix_cache
            && computed_first
            && !already
        {
            s.pages[page.index()].holder = Holder::Cached { tenant, pins: 0 };
        }
    }

    fn prefill_send(s: &mut State, nonce: Nonce) {
        let Some(PfSession::Sending { table, sent }) = s.prefill_session(nonce).cloned() else {
            return;
        };
        match table.get(usize::from(sent)) {
            Some(&slot) => {
                s.net.send(Msg::Frame {
                    nonce,
                    slot,
                    checksum_ok: true,
                    bytes: nonce,
                });
                s.set_prefill_session(
                    nonce,
                    PfSession::Sending {
                        table,
                        sent: sent + 1,
                    },
                );
            }
            None => {
                s.net.send(Msg::Manifest {
                    nonce,
                    pages_written: sent,
                    digest: table,
                });
                s.set_prefill_session(nonce, PfSession::Complete);
            }
        }
    }

    fn teardown(&self, s: &mut State) {
        s.transport_up = false;
        s.net.clear();
        s.prefill.clear();
        let closed: Vec<(Nonce, Phase)> = s.sessions.iter().map(|x| (x.nonce, x.phase)).collect();
        for (nonce, phase) in closed {
            if phase == Phase::Running {
                continue;
            }
            // No transfer can write any more: the pages may go back to the free list.
            self.move_pages(s, nonce, Holder::Free);
            self.close_session(s, nonce);
            Self::end_attempt(s, nonce, Outcome::PeerLost);
        }
    }

    /// Writes `bytes` into `page`, recording a late write (I4) if the page is not held by the
    /// session those bytes belong to.
    fn land(s: &mut State, page: PageIdx, bytes: Nonce) {
        let p = &mut s.pages[page.index()];
        if !matches!(p.holder, Holder::Held(n, _) if n == bytes) && s.late_write.is_none() {
            s.late_write = Some((bytes, page));
        }
        p.contents = Contents::Bytes(bytes);
    }

    fn deliver(&self, s: &mut State, msg: Msg) {
        match msg {
            Msg::Prefill { nonce, req, table } => {
                if s.prefill_session(nonce).is_some() {
                    return; // A duplicate, or the abort overtook it.
                }
                let fits = self.prompt_pages(req) <= self.config.prefill_pages;
                let next = if fits {
                    PfSession::Sending { table, sent: 0 }
                } else if self.config.variant.rejects_by_placeholder() {
                    // Seeded bug: a one-page placeholder instead of a rejection.
                    PfSession::Sending {
                        table: table.into_iter().take(1).collect(),
                        sent: 0,
                    }
                } else {
                    s.net.send(Msg::Reject { nonce });
                    PfSession::Rejected
                };
                s.set_prefill_session(nonce, next);
            }
            Msg::Abort { nonce } => {
                if s.prefill_session(nonce) != Some(&PfSession::Drained) {
                    s.set_prefill_session(nonce, PfSession::Drained);
                    s.net.send(Msg::DrainAck { nonce });
                }
            }
            Msg::Reject { nonce } => {
                if s.session(nonce).is_some_and(|x| x.phase != Phase::Running) {
                    // Prefill sent nothing and never will: release at once.
                    self.move_pages(s, nonce, Holder::Free);
                    self.close_session(s, nonce);
                    Self::end_attempt(s, nonce, Outcome::RejectedByPrefill);
                }
            }
            Msg::Frame {
                nonce,
                slot,
                checksum_ok,
                bytes,
            } => self.deliver_frame(s, nonce, slot, checksum_ok, bytes),
            Msg::Manifest {
                nonce,
                pages_written,
                digest,
            } => self.deliver_manifest(s, nonce, pages_written, &digest),
            Msg::DrainAck { nonce } => {
                let Some(session) = s.session(nonce) else {
                    return;
                };
                let attempt_over = !s.requests.iter().any(
                    |r| matches!(r.status, ReqStatus::InFlight(n) | ReqStatus::Running(n) if n == nonce),
                );
                if session.phase == Phase::Draining
                    || (session.phase == Phase::Transfer && attempt_over)
                {
                    // Nothing more can land: Releasing → free.
                    self.move_pages(s, nonce, Holder::Free);
                    self.close_session(s, nonce);
                }
            }
        }
    }

    fn deliver_frame(
        &self,
        s: &mut State,
        nonce: Nonce,
        slot: Slot,
        checksum_ok: bool,
        bytes: Nonce,
    ) {
        let entry = s.session(nonce).and_then(|x| {
            let at = x.table.iter().position(|e| e.page == slot.page)?;
            (x.phase == Phase::Transfer).then_some((at, x.table[at].tag))
        });
        if self.config.variant.checks_frames() {
            let current = s.pages.get(slot.page.index()).and_then(|p| p.tag);
            let Some((at, reserved)) = entry else {
                return; // Unknown or closed session, or a page not in its reservation.
            };
            if reserved != slot.tag || current != Some(slot.tag) {
                return; // Stale tag.
            }
            if !checksum_ok {
                self.fail_integrity(s, nonce);
                return;
            }
            Self::land(s, slot.page, bytes);
            if let Some(x) = s.session_mut(nonce) {
                x.written[at] = (x.written[at] + 1).min(2);
            }
        } else {
            // Seeded bug: the bytes go to the physical page the frame names, unchecked.
            if !checksum_ok {
                if entry.is_some() {
                    self.fail_integrity(s, nonce);
                }
                return;
            }
            if slot.page.index() < s.pages.len() {
                Self::land(s, slot.page, bytes);
            }
            if let Some((at, _)) = entry
                && let Some(x) = s.session_mut(nonce)
            {
                x.written[at] = (x.written[at] + 1).min(2);
            }
        }
    }

    fn deliver_manifest(&self, s: &mut State, nonce: Nonce, pages_written: u8, digest: &[Slot]) {
        let Some(session) = s.session(nonce) else {
            return;
        };
        if session.phase != Phase::Transfer {
            return;
        }
        let req = session.req;
        if s.requests[req.index()].status != ReqStatus::InFlight(nonce) {
            // The attempt is over (eager release): the transfer engine closes the session.
            self.close_session(s, nonce);
            return;
        }
        let verified = !self.config.variant.verifies_manifest()
            || (usize::from(pages_written) == session.table.len()
                && digest == session.table.as_slice()
                && session.written.iter().all(|&w| w == 1)
                && session.table.iter().all(|e| {
                    let p = &s.pages[e.page.index()];
                    p.tag == Some(e.tag) && p.holder == Holder::Held(nonce, Hold::Reserved)
                }));
        if !verified {
            self.fail_integrity(s, nonce);
            return;
        }
        for p in &mut s.pages {
            if p.holder == Holder::Held(nonce, Hold::Reserved) {
                p.holder = Holder::Held(nonce, Hold::Running);
            }
        }
        if let Some(x) = s.session_mut(nonce) {
            x.phase = Phase::Running;
            s.prefix_read |= x.prefix.is_some();
        }
        s.requests[req.index()].status = ReqStatus::Running(nonce);
    }
}

impl Model for HandoffModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.init_state()]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let free = s.free_pages().count();
        for r in self.request_ids() {
            let request = s.requests[r.index()];
            match request.status {
                ReqStatus::Waiting => {
                    let need = self.prompt_pages(r);
                    if need > self.config.decode_pages
                        || !s.transport_up
                        || usize::from(self.pages_to_reserve(s, r)) <= free
                    {
                        actions.push(Action::Admit(r));
                    }
                    actions.push(Action::ClientAbort(r));
                }
                ReqStatus::InFlight(_) => actions.push(Action::ClientAbort(r)),
                ReqStatus::Running(_) => actions.push(Action::Finish(r)),
                ReqStatus::Done(outcome) => {
                    if outcome.retryable() && request.attempts < self.config.max_attempts {
                        actions.push(Action::Retry(r));
                    }
                }
            }
        }
        for session in &s.sessions {
            if session.phase == Phase::Draining {
                actions.push(Action::DrainTimeout(session.nonce));
            }
        }
        for (nonce, pf) in &s.prefill {
            if matches!(pf, PfSession::Sending { .. }) {
                actions.push(Action::PrefillSend(*nonce));
            }
        }
        let mut quarantines: Vec<Nonce> = s
            .pages
            .iter()
            .filter_map(|p| match p.holder {
                Holder::Quarantined(n) => Some(n),
                Holder::Free | Holder::Held(..) | Holder::Cached { .. } => None,
            })
            .collect();
        quarantines.sort_unstable();
        quarantines.dedup();
        for nonce in quarantines {
            let quiet = !s.net.carries(nonce)
                && !matches!(s.prefill_session(nonce), Some(PfSession::Sending { .. }));
            if quiet {
                actions.push(Action::Reclaim(nonce));
            }
        }
        for (i, page) in s.pages.iter().enumerate() {
            if matches!(page.holder, Holder::Cached { pins: 0, .. })
                && let Ok(i) = u8::try_from(i)
            {
                actions.push(Action::Evict(PageIdx(i)));
            }
        }
        if self.config.teardown && s.transport_up {
            actions.push(Action::Teardown);
        }
        for msg in s.net.distinct() {
            actions.push(Action::Deliver(msg.clone()));
            actions.push(Action::Lose(msg.clone()));
            if s.duplicates_left > 0 {
                actions.push(Action::Duplicate(msg.clone()));
            }
            if s.corruptions_left > 0
                && matches!(
                    msg,
                    Msg::Frame {
                        checksum_ok: true,
                        ..
                    }
                )
            {
                actions.push(Action::Corrupt(msg.clone()));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Admit(r) => self.admit(&mut s, r),
            Action::ClientAbort(r) => self.client_abort(&mut s, r),
            Action::Finish(r) => self.finish(&mut s, r),
            Action::Retry(r) => s.requests[r.index()].status = ReqStatus::Waiting,
            Action::Evict(page) => {
                let zero = self.config.variant.zeroes_on_release();
                let p = &mut s.pages[page.index()];
                p.holder = Holder::Free;
                if zero {
                    p.contents = Contents::Zero;
                }
                s.evicted = true;
            }
            Action::DrainTimeout(nonce) => {
                self.move_pages(&mut s, nonce, Holder::Quarantined(nonce));
                self.close_session(&mut s, nonce);
            }
            Action::Reclaim(nonce) => {
                let zero = self.config.variant.zeroes_on_release();
                for p in &mut s.pages {
                    if p.holder == Holder::Quarantined(nonce) {
                        p.holder = Holder::Free;
                        if zero {
                            p.contents = Contents::Zero;
                        }
                    }
                }
                s.reclaimed = true;
            }
            Action::PrefillSend(nonce) => Self::prefill_send(&mut s, nonce),
            Action::Teardown => self.teardown(&mut s),
            Action::Deliver(msg) => {
                if !s.net.take(&msg) {
                    return None;
                }
                self.deliver(&mut s, msg);
            }
            Action::Lose(msg) => {
                if !s.net.take(&msg) {
                    return None;
                }
            }
            Action::Duplicate(msg) => {
                s.duplicates_left = s.duplicates_left.checked_sub(1)?;
                s.net.send(msg);
            }
            Action::Corrupt(msg) => {
                let Msg::Frame {
                    nonce, slot, bytes, ..
                } = msg.clone()
                else {
                    return None;
                };
                s.corruptions_left = s.corruptions_left.checked_sub(1)?;
                if !s.net.take(&msg) {
                    return None;
                }
                s.net.send(Msg::Frame {
                    nonce,
                    slot,
                    checksum_ok: false,
                    bytes,
                });
            }
        }
        Some(s)
    }

    fn format_action(&self, action: &Action) -> String {
        action.to_string()
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all()
    }
}
