//! An error and its causes told once each: many errors name their cause in their own message
//! and also give it as their source ("cannot read f.toml: No such file" over "No such file";
//! tonic's "transport error" over hyper's "transport error"), and a chain printed link by link
//! would say it twice.

use std::error::Error;

/// The links of a chain, outermost first, without each link that the one before it already
/// says (its text is in the one before).
pub fn unsaid(links: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut kept: Vec<String> = Vec::new();
    let mut before: Option<String> = None;
    for link in links {
        if !before.as_ref().is_some_and(|b| b.contains(link.as_str())) {
            kept.push(link.clone());
        }
        before = Some(link);
    }
    kept
}

/// `what`, then the causes in `cause`'s chain that are not said already, joined by `: `.
pub fn with_causes(what: String, cause: Option<&(dyn Error + 'static)>) -> String {
    let causes = std::iter::successors(cause, |&c| c.source()).map(ToString::to_string);
    unsaid(std::iter::once(what).chain(causes)).join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_the_one_before_says_is_dropped() {
        let links = |l: &[&str]| unsaid(l.iter().map(|s| (*s).to_owned()));
        assert_eq!(
            links(&[
                "invalid configuration f.toml",
                "cannot read f.toml: gone",
                "gone"
            ]),
            ["invalid configuration f.toml", "cannot read f.toml: gone"]
        );
        // Judged against the link before, said or not: a cause repeated twice is said once.
        assert_eq!(
            links(&[
                "Unknown: transport error",
                "transport error",
                "transport error",
                "refused"
            ]),
            ["Unknown: transport error", "refused"]
        );
    }

    #[test]
    fn a_cause_chain_is_joined_after_what_failed() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(
            with_causes("Unavailable: transport error".into(), Some(&refused)),
            "Unavailable: transport error: refused"
        );
        assert_eq!(with_causes("no answer".into(), None), "no answer");
    }
}
