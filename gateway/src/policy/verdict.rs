//! A plugin's `on-request` answer, checked: what a plugin returns is untrusted input. A verdict
//! that breaks a rule is garbage, which fails the request like a trap.

use bulkhead_worker::printable::{acts, printable};
use http::{HeaderName, HeaderValue};

use super::bindings::Verdict;
use super::plugin::Fault;

/// The most tags, and headers, one plugin may add to a request.
const MAX_TAGS: usize = 32;
const MAX_HEADERS: usize = 16;
const MAX_TAG_KEY: usize = 64;
const MAX_TAG_VALUE: usize = 256;
const MAX_MESSAGE: usize = 1024;
const MAX_HEADER_VALUE: usize = 1024;
/// A header's name, as a tag's key: clients and proxies refuse a response whose header lines
/// are longer than a few kilobytes, and the gateway holds what a plugin adds for as long as the
/// request runs.
const MAX_HEADER_NAME: usize = 64;

/// How much of a name a plugin sent the fault that refuses it quotes (a fault is logged).
const QUOTED: usize = 64;

/// Response headers no plugin may add: those that claim a tenant (a client could take them
/// for the gateway's word), those the gateway sets itself (the request id, whether to retry,
/// the tenant's rate limits), and those a reverse proxy
/// in front of the gateway acts on (nginx's `x-accel-redirect` serves an internal location,
/// `x-sendfile` a file; `x-forwarded-*` and `x-real-ip` name the client).
pub(super) fn gateway_owned(name: &HeaderName) -> bool {
    let name = name.as_str();
    matches!(
        name,
        "x-request-id"
            | "x-should-retry"
            | "x-bulkhead-tenant"
            | "x-sendfile"
            | "x-sendfile2"
            | "x-lighttpd-send-file"
            | "x-real-ip"
    ) || name == super::request::CLAMPED_MAX_TOKENS.as_str()
        || crate::auth::TENANT_HEADERS.contains(&name)
        || [
            "x-tenant-",
            "x-accel-",
            "x-forwarded-",
            "x-litespeed-",
            "x-envoy-",
            "x-ratelimit-",
        ]
        .iter()
        .any(|p| name.starts_with(p))
}

/// A verdict that passed every check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Checked {
    Allow {
        tags: Vec<(String, String)>,
        /// At least 1.
        clamp: Option<u32>,
        /// Names start with `x-`.
        headers: Vec<(HeaderName, HeaderValue)>,
    },
    Deny {
        /// A 4xx.
        status: u16,
        message: String,
    },
}

/// The statuses a denial may name but is not sent with; such a denial is sent as 403. 401 and
/// 407 ask the client for credentials, which only the gateway's own authentication does (an
/// OpenAI client takes a 401 for a bad API key); 408 and 421 say the connection, not the
/// request, was at fault (clients resend them on their own); 499 and 444 are the gateway's
/// words for a client that left and for a request shutdown closed unanswered (its metrics and
/// audit records would count the denial as one).
const NOT_SENT: [u16; 6] = [
    401,
    407,
    408,
    421,
    crate::trail::CLIENT_CLOSED,
    crate::trail::CLOSED_UNANSWERED,
];

fn garbage(what: String) -> Fault {
    Fault::Garbage(what)
}

/// The tag key that names the request's tenant, in the audit record and the trace: only the
/// authenticated tenant may stand under it, whichever plugin wrote it.
const TENANT_TAG: &str = "tenant";

/// Checks `verdict`, a plugin's answer on `tenant`'s request, against the rules the WIT states.
pub(super) fn check(verdict: Verdict, tenant: &str) -> Result<Checked, Fault> {
    match verdict {
        Verdict::Deny(d) => {
            if !(400..=499).contains(&d.status) {
                return Err(garbage(format!("deny status {} is not a 4xx", d.status)));
            }
            if d.message.len() > MAX_MESSAGE {
                return Err(garbage(format!(
                    "a deny message of {} bytes (at most {MAX_MESSAGE})",
                    d.message.len()
                )));
            }
            // The client prints it: no line of its own, no escape sequence, no reversed text.
            if d.message.chars().any(acts) {
                return Err(garbage(format!(
                    "a deny message with control characters: {}",
                    printable(&d.message, QUOTED)
                )));
            }
            Ok(Checked::Deny {
                status: if NOT_SENT.contains(&d.status) {
                    403
                } else {
                    d.status
                },
                message: d.message,
            })
        }
        Verdict::Allow(m) => {
            if m.clamp_max_tokens == Some(0) {
                return Err(garbage("clamp-max-tokens of 0".into()));
            }
            if m.tags.len() > MAX_TAGS || m.add_headers.len() > MAX_HEADERS {
                return Err(garbage(format!(
                    "{} tags and {} headers (at most {MAX_TAGS} and {MAX_HEADERS})",
                    m.tags.len(),
                    m.add_headers.len()
                )));
            }
            let mut tags = Vec::with_capacity(m.tags.len());
            for t in m.tags {
                let key_ok = !t.key.is_empty()
                    && t.key.len() <= MAX_TAG_KEY
                    && t.key.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b)
                    });
                let value_ok = t.value.len() <= MAX_TAG_VALUE && !t.value.chars().any(acts);
                if !key_ok || !value_ok {
                    return Err(garbage(format!(
                        "an invalid tag `{}`",
                        printable(&t.key, QUOTED)
                    )));
                }
                // A plugin that copies a client's header into its tags could otherwise file the
                // request under another tenant's name.
                if t.key == TENANT_TAG && t.value != tenant {
                    return Err(garbage(format!(
                        "a `{TENANT_TAG}` tag that names another tenant: {}",
                        printable(&t.value, QUOTED)
                    )));
                }
                tags.push((t.key, t.value));
            }
            let mut headers = Vec::with_capacity(m.add_headers.len());
            for h in m.add_headers {
                let name = Some(&h.name)
                    .filter(|n| n.len() <= MAX_HEADER_NAME)
                    .and_then(|n| HeaderName::from_bytes(n.as_bytes()).ok())
                    .filter(|n| {
                        n.as_str().len() > 2 && n.as_str().starts_with("x-") && !gateway_owned(n)
                    });
                // Visible ASCII (and spaces, tabs): how clients decode other bytes varies.
                let value = Some(&h.value)
                    .filter(|v| v.len() <= MAX_HEADER_VALUE)
                    .filter(|v| v.bytes().all(|b| b == b'\t' || (0x20..0x7f).contains(&b)))
                    .and_then(|v| HeaderValue::from_str(v).ok());
                match (name, value) {
                    (Some(n), Some(v)) => headers.push((n, v)),
                    _ => {
                        return Err(garbage(format!(
                            "a header `{}` that is not a valid x- header (a name of at most \
                             {MAX_HEADER_NAME} bytes, a value of at most {MAX_HEADER_VALUE}) \
                             the gateway does not set itself",
                            printable(&h.name, QUOTED)
                        )));
                    }
                }
            }
            Ok(Checked::Allow {
                tags,
                clamp: m.clamp_max_tokens,
                headers,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::bindings::{Denial, Header, Mutations, Tag};
    use super::*;

    /// Checks an answer on `tenant-a`'s request.
    fn check_on(verdict: Verdict) -> Result<Checked, Fault> {
        check(verdict, "tenant-a")
    }

    fn allow(m: impl FnOnce(&mut Mutations)) -> Verdict {
        let mut mutations = Mutations {
            tags: Vec::new(),
            clamp_max_tokens: None,
            add_headers: Vec::new(),
        };
        m(&mut mutations);
        Verdict::Allow(mutations)
    }

    #[test]
    fn a_denial_must_be_a_4xx_with_a_bounded_message() {
        let deny = |status, message: &str| {
            check_on(Verdict::Deny(Denial {
                status,
                message: message.into(),
            }))
        };
        assert!(matches!(
            deny(403, "no"),
            Ok(Checked::Deny { status: 403, .. })
        ));
        // A challenge for credentials is the gateway's to make, a connection's fault or a
        // client that left are not a refusal: sent as 403.
        for status in [401, 407, 408, 421, 444, 499] {
            assert!(
                matches!(deny(status, "no"), Ok(Checked::Deny { status: 403, .. })),
                "{status}"
            );
        }
        assert!(matches!(
            deny(451, "no"),
            Ok(Checked::Deny { status: 451, .. })
        ));
        for status in [0, 200, 302, 500, 999] {
            assert!(
                matches!(deny(status, "no"), Err(Fault::Garbage(_))),
                "{status}"
            );
        }
        assert!(matches!(
            deny(400, &"x".repeat(2000)),
            Err(Fault::Garbage(_))
        ));
        for message in [
            "two\nlines",
            "\u{1b}[2J",
            "\u{202e}reversed",
            "ok\u{2028}forged",
            "\u{61c}x",
        ] {
            assert!(
                matches!(deny(403, message), Err(Fault::Garbage(_))),
                "{message:?}"
            );
        }
        assert!(deny(403, "tenant-a may not use this model — ask an admin").is_ok());
    }

    #[test]
    fn mutations_that_break_the_rules_are_garbage() {
        assert!(matches!(
            check_on(allow(|m| m.clamp_max_tokens = Some(0))),
            Err(Fault::Garbage(_))
        ));
        let header = |name: &str, value: &str| {
            check_on(allow(|m| {
                m.add_headers.push(Header {
                    name: name.into(),
                    value: value.into(),
                })
            }))
        };
        assert!(header("x-tier", "gold").is_ok());
        assert!(header("x-bulkhead-tier", &"a".repeat(MAX_HEADER_VALUE)).is_ok());
        let long = "a".repeat(MAX_HEADER_VALUE + 1);
        for (n, v) in [
            ("set-cookie", "a=b"),
            ("x-a\r\nset-cookie", "a"),
            ("x-ok", "a\r\nb"),
            ("", "a"),
            ("x-long", long.as_str()),
            ("x-", "a"),
            ("x-accented", "café"),
            // A tenant claimed to the client, or the gateway's own request id.
            ("x-tenant-id", "tenant-b"),
            ("x-accel-redirect", "/internal/keys"),
            ("x-sendfile", "/etc/passwd"),
            ("x-forwarded-for", "10.0.0.1"),
            ("x-tenant-name", "tenant-b"),
            ("x-org-id", "b"),
            ("x-bulkhead-tenant", "tenant-b"),
            ("x-request-id", "req-1"),
            // Would tell an OpenAI client to send a failed request again.
            ("x-should-retry", "true"),
            ("x-ratelimit-remaining-requests", "1000"),
        ] {
            assert!(matches!(header(n, v), Err(Fault::Garbage(_))), "{n:?}");
        }
        let tag_of = |key: &str, value: &str| {
            check_on(allow(|m| {
                m.tags.push(Tag {
                    key: key.into(),
                    value: value.into(),
                })
            }))
        };
        let tag = |key: &str| tag_of(key, "v");
        assert!(tag("cost_center").is_ok());
        // The tenant's own name under `tenant` (tenant-tag's), never another's (a client's
        // header copied into a tag).
        assert!(tag_of("tenant", "tenant-a").is_ok());
        assert!(matches!(
            tag_of("tenant", "tenant-b"),
            Err(Fault::Garbage(_))
        ));
        assert!(matches!(tag("Bad Key"), Err(Fault::Garbage(_))));
        assert!(matches!(tag(""), Err(Fault::Garbage(_))));
        // A megabyte of control characters as a tag key or a header name: the fault (which is
        // logged) quotes a bounded, escaped piece of it.
        let huge = "\u{1}".repeat(1 << 20);
        for fault in [tag(&huge), header(&huge, "v")] {
            let Err(Fault::Garbage(what)) = fault else {
                panic!("refused");
            };
            assert!(what.len() < 1024, "{} bytes", what.len());
            assert!(!what.contains('\u{1}'), "{what}");
        }
    }

    /// Each bound takes exactly its limit and refuses one more, on its own.
    #[test]
    fn every_bound_takes_its_limit_and_refuses_one_more() {
        let deny = |len| {
            check_on(Verdict::Deny(Denial {
                status: 403,
                message: "x".repeat(len),
            }))
        };
        assert!(deny(MAX_MESSAGE).is_ok());
        assert!(matches!(deny(MAX_MESSAGE + 1), Err(Fault::Garbage(_))));

        let mutations = |tags: usize, headers: usize| {
            check_on(allow(|m| {
                m.tags = (0..tags)
                    .map(|i| Tag {
                        key: format!("k{i}"),
                        value: "v".into(),
                    })
                    .collect();
                m.add_headers = (0..headers)
                    .map(|i| Header {
                        name: format!("x-h{i}"),
                        value: "v".into(),
                    })
                    .collect();
            }))
        };
        assert!(mutations(MAX_TAGS, MAX_HEADERS).is_ok());
        for (tags, headers) in [(MAX_TAGS + 1, 0), (0, MAX_HEADERS + 1)] {
            assert!(
                matches!(mutations(tags, headers), Err(Fault::Garbage(_))),
                "{tags} tags, {headers} headers"
            );
        }

        let named = |name: String| {
            check_on(allow(|m| {
                m.add_headers.push(Header {
                    name,
                    value: "v".into(),
                })
            }))
        };
        assert!(named(format!("x-{}", "a".repeat(MAX_HEADER_NAME - 2))).is_ok());
        let long = named(format!("x-{}", "a".repeat(MAX_HEADER_NAME - 1)));
        assert!(matches!(long, Err(Fault::Garbage(_))), "{long:?}");

        let valued = |value: &str| {
            check_on(allow(|m| {
                m.tags.push(Tag {
                    key: "k".into(),
                    value: value.into(),
                })
            }))
        };
        assert!(valued(&"v".repeat(MAX_TAG_VALUE)).is_ok());
        for bad in [
            "v".repeat(MAX_TAG_VALUE + 1),
            "a\nb".into(),
            "\u{1b}[31m".into(),
            "txt.\u{202e}exe".into(),
            "a\u{2028}b".into(),
        ] {
            assert!(matches!(valued(&bad), Err(Fault::Garbage(_))), "{bad:?}");
        }
    }
}
