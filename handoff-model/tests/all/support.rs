//! Running a check and printing what it found.

use bulkhead_handoff_model::{Config, Report, Trace, check, counterexample};

/// Checks `config` exhaustively and prints the bound, the counts, the time and the
/// properties with discoveries (run with `--nocapture` to see them).
pub fn run(label: &str, config: &Config) -> Report {
    let report = check(config.clone());
    let complete = if report.complete {
        "all reachable states"
    } else {
        "stopped early: every safety property already violated"
    };
    println!(
        "{label}: {} unique states ({} generated, depth {}, {complete}) in {:.2?}\n  \
         bound: {config:?}\n  discoveries: {:?}",
        report.unique_states,
        report.generated_states,
        report.max_depth,
        report.elapsed,
        report.discoveries.keys().collect::<Vec<_>>(),
    );
    report
}

/// A short path to a violation of `property` under `config`, printed; panics if none exists.
pub fn shortest(label: &str, config: &Config, property: &'static str) -> Trace {
    let trace = counterexample(config.clone(), property)
        .unwrap_or_else(|| panic!("{label}: no counterexample to `{property}`"));
    println!(
        "{label}: counterexample to `{property}` in {} steps:\n{}",
        trace.actions.len(),
        trace.render()
    );
    trace
}
