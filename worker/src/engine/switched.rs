//! Where the engine's admission meets bulkhead-checks' switches. Every definition here has a
//! production twin (`cfg(not(feature = "check-switches"))`) that does what the engine always
//! did, so a production build cannot contain a way around admission.

use bulkhead_kvpool::{Admissible, PagePool, Rejected, RequestId};

use super::SubmitError;
use super::request::Request;

/// The pool's admission of `tokens` for `id`; with the admission's check turned off (test
/// builds), an admission that skips the capacity check.
#[cfg(feature = "check-switches")]
pub(super) fn pool_admit(
    pool: &PagePool,
    id: RequestId,
    tokens: u64,
    checked: bool,
) -> Result<Admissible, Rejected> {
    if checked {
        pool.admit(id, tokens)
    } else {
        Ok(pool.admit_unchecked(id, tokens))
    }
}

/// The pool's admission of `tokens` for `id`.
#[cfg(not(feature = "check-switches"))]
pub(super) fn pool_admit(
    pool: &PagePool,
    id: RequestId,
    tokens: u64,
    checked: bool,
) -> Result<Admissible, Rejected> {
    debug_assert!(checked, "checks cannot be turned off in this build");
    pool.admit(id, tokens)
}

/// A prefill request its admission refused. With the incident's fault injected (test builds)
/// and a refusal for length, the incident's prefill: the prompt becomes a one-token
/// placeholder, admitted into one page, and the refusal is never sent. Otherwise (and always in
/// a production build) the refusal stands.
#[cfg(feature = "check-switches")]
#[allow(
    clippy::result_large_err,
    reason = "a refused request goes back whole, as from the engine's own admission"
)]
pub(super) fn prefill_refused(
    pool: &PagePool,
    error: SubmitError,
    mut request: Request,
) -> Result<(Request, Admissible), (SubmitError, Request)> {
    use bulkhead_checks::{Fault, injected};
    if !(injected(Fault::IncidentPlaceholder)
        && matches!(error, SubmitError::ContextLengthExceeded { .. }))
    {
        return Err((error, request));
    }
    tracing::warn!(
        request = %request.id,
        %error,
        "FAULT INJECTED (incident-placeholder): a prompt prefill refused is replaced by a one-token placeholder"
    );
    request.prompt.truncate(1);
    match pool.admit(request.id, 1) {
        Ok(admissible) => Ok((request, admissible)),
        Err(_) => Err((error, request)),
    }
}

/// A prefill request its admission refused: the refusal stands.
#[cfg(not(feature = "check-switches"))]
#[allow(
    clippy::result_large_err,
    reason = "a refused request goes back whole, as from the engine's own admission"
)]
pub(super) fn prefill_refused(
    _pool: &PagePool,
    error: SubmitError,
    request: Request,
) -> Result<(Request, Admissible), (SubmitError, Request)> {
    Err((error, request))
}
