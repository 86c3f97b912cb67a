//! Test builds only (`--features check-switches`): at startup, every `bulkhead` process turns
//! off the isolation checks and injects the faults that [`ENV`] names (see bulkhead-checks),
//! and says so loudly in its log. A build without the feature has no switches: [`install`]
//! does nothing and nothing in the binary reads [`ENV`].

/// The environment variable naming the switches: a comma-separated list of check names
/// (`gateway-limit`, `decode-admission`, `prefill-admission`, `handoff-verification`,
/// `tag-check`, or `all`) and fault names (`incident-placeholder`).
#[cfg(feature = "check-switches")]
pub const ENV: &str = "BULKHEAD_TEST_SWITCHES";

/// Turns off the checks and injects the faults [`ENV`] names.
#[cfg(feature = "check-switches")]
pub fn install() -> anyhow::Result<()> {
    let Ok(list) = std::env::var(ENV) else {
        return Ok(());
    };
    let (checks, faults) = bulkhead_checks::parse(&list)?;
    bulkhead_checks::turn_off(&checks);
    bulkhead_checks::inject(&faults);
    for c in &checks {
        tracing::warn!(
            check = c.name(),
            "TEST BUILD: ISOLATION CHECK TURNED OFF ({ENV})"
        );
    }
    for f in &faults {
        tracing::warn!(fault = f.name(), "TEST BUILD: FAULT INJECTED ({ENV})");
    }
    Ok(())
}

/// Nothing to install: this build has no switches.
#[cfg(not(feature = "check-switches"))]
#[allow(
    clippy::unnecessary_wraps,
    reason = "the same signature as the test build's twin"
)]
pub fn install() -> anyhow::Result<()> {
    Ok(())
}
