//! What each policy decided about a request: the small public record the audit log carries.

use super::digest::Digest;

/// One plugin's decision on one request.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Decision {
    /// The plugin's name in the policy set.
    pub plugin: String,
    /// The SHA-256 of the component that decided.
    pub sha256: Digest,
    pub verdict: DecisionVerdict,
}

/// What the plugin said.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum DecisionVerdict {
    /// Allowed; `clamped_to` when it lowered max tokens, with the tags it attached and the
    /// names of the response headers it added.
    Allow {
        clamped_to: Option<u32>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tags: Vec<(String, String)>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        headers: Vec<String>,
    },
    /// Refused with this status.
    Deny { status: u16 },
    /// The plugin failed (`fault` is its kind); `fail_open` when the request went on anyway.
    Fault {
        fault: &'static str,
        fail_open: bool,
    },
}

impl Decision {
    /// The tags the plugin attached (none unless it allowed).
    pub fn tags(&self) -> impl Iterator<Item = &(String, String)> {
        let tags = match &self.verdict {
            DecisionVerdict::Allow { tags, .. } => tags.as_slice(),
            DecisionVerdict::Deny { .. } | DecisionVerdict::Fault { .. } => &[],
        };
        tags.iter()
    }
}

impl DecisionVerdict {
    /// The verdict as the audit record names it: allowed unchanged, allowed with a change
    /// (tags, headers, a clamp), denied, or failed (open or closed).
    fn audited(&self) -> bulkhead_audit::Verdict {
        use bulkhead_audit::Verdict;
        match self {
            DecisionVerdict::Allow {
                clamped_to: None,
                tags,
                headers,
            } if tags.is_empty() && headers.is_empty() => Verdict::Allow,
            DecisionVerdict::Allow { .. } => Verdict::Mutate,
            DecisionVerdict::Deny { status } => Verdict::Deny { status: *status },
            DecisionVerdict::Fault { fault, fail_open } => Verdict::Error {
                fault: (*fault).to_owned(),
                fail_open: *fail_open,
            },
        }
    }

    /// The metrics' label: the audit record's word for the verdict, so the two join; a fault
    /// the request went on past is `error_open` (the policy was not applied), one that
    /// refused it `error`.
    pub fn label(&self) -> &'static str {
        use bulkhead_audit::Verdict;
        match self.audited() {
            Verdict::Allow => "allow",
            Verdict::Mutate => "mutate",
            Verdict::Deny { .. } => "deny",
            Verdict::Error {
                fail_open: false, ..
            } => "error",
            Verdict::Error {
                fail_open: true, ..
            } => "error_open",
        }
    }
}

impl From<&Decision> for bulkhead_audit::PolicyDecision {
    fn from(d: &Decision) -> bulkhead_audit::PolicyDecision {
        bulkhead_audit::PolicyDecision {
            plugin: d.plugin.clone(),
            digest: bulkhead_audit::Sha256Digest(d.sha256.to_bytes()),
            verdict: d.verdict.audited(),
            tags: d
                .tags()
                .map(|(key, value)| bulkhead_audit::Label {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
        }
    }
}
