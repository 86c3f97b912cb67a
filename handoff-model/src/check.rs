//! Running the exhaustive check and summarizing what it found.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use stateright::{Checker, HasDiscoveries, Model};

use crate::config::Config;
use crate::model::{Action, HandoffModel};
use crate::properties;
use crate::state::State;

/// What one exhaustive (breadth-first) check found.
#[derive(Debug)]
pub struct Report {
    /// Distinct states visited: all reachable states, since every check runs to completion.
    pub unique_states: usize,
    /// States generated, counting repeats.
    pub generated_states: usize,
    /// Length of the longest shortest path to a state.
    pub max_depth: usize,
    /// Whether every reachable state was visited. False only when every safety property was
    /// already violated (the checker then stops early).
    pub complete: bool,
    /// Wall time of the check.
    pub elapsed: Duration,
    /// Property name → the shortest path to a state that violates it (an `always`) or
    /// satisfies it (a `sometimes`).
    pub discoveries: BTreeMap<&'static str, Trace>,
}

/// A path found by the checker: the actions from the initial state, and the last state.
#[derive(Debug)]
pub struct Trace {
    /// The actions, in order.
    pub actions: Vec<Action>,
    /// The state they lead to.
    pub last: State,
}

impl Trace {
    /// The actions as numbered lines, for test output and docs.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (i, action) in self.actions.iter().enumerate() {
            out.push_str(&format!("  {:>2}. {action}\n", i + 1));
        }
        out
    }
}

/// Explores every reachable state of `config`'s model breadth-first, on one thread.
///
/// The trace kept for each discovery is one path the checker found, not necessarily the
/// shortest; [`counterexample`] gives a short one.
#[must_use]
pub fn check(config: Config) -> Report {
    run(config, HasDiscoveries::AllFailures)
}

/// Explores `config`'s model breadth-first until it finds a state that violates (or, for a
/// `sometimes` property, satisfies) `property`, and returns the path to it. Breadth-first
/// order makes the path as short as any, give or take one step (the checker looks at states
/// in batches). `None` when no reachable state does.
#[must_use]
pub fn counterexample(config: Config, property: &'static str) -> Option<Trace> {
    let wanted = BTreeSet::from([property]);
    run(config, HasDiscoveries::AnyOf(wanted))
        .discoveries
        .remove(property)
}

fn run(config: Config, finish_when: HasDiscoveries) -> Report {
    let start = Instant::now();
    let checker = HandoffModel::new(config)
        .checker()
        .finish_when(finish_when.clone())
        .spawn_bfs()
        .join();
    let elapsed = start.elapsed();
    let discoveries = checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| {
            let last = path.last_state().clone();
            let actions = path.into_actions();
            (name, Trace { actions, last })
        })
        .collect::<BTreeMap<_, _>>();
    let complete = !finish_when.matches(&discoveries.keys().copied().collect(), &properties::all());
    Report {
        complete,
        unique_states: checker.unique_state_count(),
        generated_states: checker.state_count(),
        max_depth: checker.max_depth(),
        elapsed,
        discoveries,
    }
}
