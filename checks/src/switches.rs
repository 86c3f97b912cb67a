//! The switches (test builds only): one process-wide set of checks turned off and faults
//! injected, set once at startup and read on every check.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::{Check, Fault};

/// Bits of the checks turned off.
static OFF: AtomicU8 = AtomicU8::new(0);
/// Bits of the faults injected.
static INJECTED: AtomicU8 = AtomicU8::new(0);

/// Whether `check` is enforced: yes, unless [`turn_off`] named it.
#[must_use]
pub fn enabled(check: Check) -> bool {
    OFF.load(Ordering::Relaxed) & check.bit() == 0
}

/// Whether [`inject`] named `fault`.
#[must_use]
pub fn injected(fault: Fault) -> bool {
    INJECTED.load(Ordering::Relaxed) & fault.bit() != 0
}

/// Turns `checks` off for the rest of the process.
pub fn turn_off(checks: &[Check]) {
    for c in checks {
        OFF.fetch_or(c.bit(), Ordering::Relaxed);
    }
}

/// Injects `faults` for the rest of the process.
pub fn inject(faults: &[Fault]) {
    for f in faults {
        INJECTED.fetch_or(f.bit(), Ordering::Relaxed);
    }
}

/// A switch list names something that is neither a check nor a fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(pub String);

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let checks: Vec<&str> = Check::ALL.iter().map(|c| c.name()).collect();
        let faults: Vec<&str> = Fault::ALL.iter().map(|c| c.name()).collect();
        write!(
            f,
            "unknown switch {:?}: the checks are {}, the faults {}, and `all` turns every check off",
            self.0,
            checks.join(", "),
            faults.join(", ")
        )
    }
}

impl std::error::Error for ParseError {}

/// A comma-separated switch list: check names (or `all`, every check) and fault names.
///
/// # Errors
///
/// [`ParseError`] naming the first item that is neither.
pub fn parse(list: &str) -> Result<(Vec<Check>, Vec<Fault>), ParseError> {
    let (mut checks, mut faults) = (Vec::new(), Vec::new());
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if item == "all" {
            checks.extend(Check::ALL);
        } else if let Some(c) = Check::ALL.into_iter().find(|c| c.name() == item) {
            checks.push(c);
        } else if let Some(f) = Fault::ALL.into_iter().find(|f| f.name() == item) {
            faults.push(f);
        } else {
            return Err(ParseError(item.to_owned()));
        }
    }
    Ok((checks, faults))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_into_checks_and_faults_and_unknown_names_are_refused() {
        assert_eq!(
            parse("tag-check, incident-placeholder,gateway-limit"),
            Ok((
                vec![Check::TagCheck, Check::GatewayLimit],
                vec![Fault::IncidentPlaceholder]
            ))
        );
        assert_eq!(parse("all").map(|p| p.0), Ok(Check::ALL.to_vec()));
        assert_eq!(parse(""), Ok((vec![], vec![])));
        let err = parse("gateway-limit,no-such-check").expect_err("unknown");
        assert!(err.to_string().contains("no-such-check"), "{err}");
        assert!(err.to_string().contains("handoff-verification"), "{err}");
    }

    #[test]
    fn a_check_turned_off_stays_off_and_the_others_stay_on() {
        // The switches are process-wide: this is the only test of this crate that sets any.
        assert!(Check::ALL.iter().all(|&c| enabled(c)));
        turn_off(&[Check::HandoffVerification]);
        inject(&[Fault::IncidentPlaceholder]);
        for c in Check::ALL {
            assert_eq!(enabled(c), c != Check::HandoffVerification, "{c:?}");
        }
        assert!(injected(Fault::IncidentPlaceholder));
    }
}
