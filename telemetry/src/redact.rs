//! Addresses as they may be shown — in logs, errors and API answers — without what a URL can
//! carry in secret: its userinfo (`user:password@`) and its query (`?api_key=…`).

/// `address` with its userinfo and its query replaced by `…`; any other text as it is, up to a
/// query. Everything before the last `@` is taken for userinfo: a password may hold `/` or `?`
/// (hiding a path's `@` too is the safe mistake).
pub fn redacted_url(address: &str) -> String {
    let (scheme, rest) = match address.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), address),
    };
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((_, host)) => ("…@", host),
        None => ("", rest),
    };
    let (rest, query) = match rest.split_once('?') {
        Some((before, _)) => (before, "?…"),
        None => (rest, ""),
    };
    format!("{scheme}{userinfo}{rest}{query}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_and_query_are_hidden_and_the_rest_kept() {
        assert_eq!(
            redacted_url("http://user:secret@127.0.0.1:50052/x?tok=abc"),
            "http://…@127.0.0.1:50052/x?…"
        );
        assert_eq!(
            redacted_url("http://127.0.0.1:50051"),
            "http://127.0.0.1:50051"
        );
        assert_eq!(redacted_url("127.0.0.1:50051"), "127.0.0.1:50051");
        // No scheme, or not a URL at all: still no userinfo and no query.
        assert_eq!(redacted_url("u:p@h:1/ x?k=v"), "…@h:1/ x?…");
        // A password holding a `/` or a `?`.
        assert_eq!(
            redacted_url("http://u:pa/ss@collector:4318"),
            "http://…@collector:4318"
        );
        assert_eq!(redacted_url("http://u:p?x@host/v1"), "http://…@host/v1");
    }
}
