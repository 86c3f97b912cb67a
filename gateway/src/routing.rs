//! Routing: among the workers a request may go to, the one with the fewest outstanding tokens
//! (prompt + max tokens of the requests it is serving for this gateway); ties go to the first in
//! configuration order, so the choice is deterministic.

/// One routable worker: its position and its outstanding tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub index: usize,
    pub outstanding_tokens: u64,
}

/// The index of the worker to route to; `None` when there is no candidate.
pub fn least_outstanding(candidates: impl IntoIterator<Item = Candidate>) -> Option<usize> {
    candidates
        .into_iter()
        .min_by_key(|c| (c.outstanding_tokens, c.index))
        .map(|c| c.index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(index: usize, outstanding_tokens: u64) -> Candidate {
        Candidate {
            index,
            outstanding_tokens,
        }
    }

    #[test]
    fn the_least_loaded_worker_wins() {
        assert_eq!(least_outstanding([c(0, 500), c(1, 20), c(2, 300)]), Some(1));
    }

    #[test]
    fn ties_go_to_the_first_worker() {
        assert_eq!(least_outstanding([c(2, 7), c(0, 7), c(1, 9)]), Some(0));
    }

    #[test]
    fn no_candidate_no_route() {
        assert_eq!(least_outstanding([]), None);
    }
}
