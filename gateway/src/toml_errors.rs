//! TOML refusals told by place, never by the text there: the gateway's configuration holds
//! key hashes (and an operator may paste a key where its hash goes), and its refusals reach
//! the log, the admin API's reload answers and `GET /tenants`. The TOML parser's own message
//! quotes the line it stopped at, and serde's quote the value of the wrong type.

use serde::de::DeserializeOwned;

/// Why a TOML text is refused: where, and what, with no value from the text.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{place}{message}")]
pub struct TomlError {
    /// `line L, column C: ` (1-based), or nothing when the parser names no place.
    place: String,
    message: String,
}

/// Parses `text` as a `T`.
pub fn parse<T: DeserializeOwned>(text: &str) -> Result<T, TomlError> {
    toml::from_str(text).map_err(|e| {
        let place = e.span().map_or_else(String::new, |span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("line {line}, column {column}: ")
        });
        TomlError {
            place,
            message: without_quoted(e.message().trim_end()),
        }
    })
}

/// `message` with every double-quoted part replaced by `"…"` (serde quotes the values it
/// refuses: `invalid type: string "…", expected a sequence`).
fn without_quoted(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut parts = message.split('"');
    out.push_str(parts.next().unwrap_or_default());
    let mut quoted = true;
    for part in parts {
        out.push('"');
        out.push_str(if quoted { "…" } else { part });
        quoted = !quoted;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)] // read by the parser only
    struct Doc {
        key_sha256: Vec<String>,
        limit: Option<u32>,
    }

    const SECRET: &str = "5dfd868cb40f4fe0134a5d150646bb7c5635f0347be911d5535e47590453485d";

    #[test]
    fn a_refusal_names_the_place_and_never_quotes_the_text() {
        for (text, place, what) in [
            // A syntax error: the parser's message would quote the whole line.
            (
                format!("limit = 1\nkey_sha256 = [\"{SECRET}\" \"x\"]\n"),
                "line 2, column ",
                "",
            ),
            // A value of the wrong type: serde's message would quote it.
            (
                format!("key_sha256 = \"{SECRET}\"\n"),
                "line 1, column 14: ",
                "invalid type: string \"…\", expected a sequence",
            ),
            (
                format!("key_sha256 = [\"{SECRET}\"]\nlimt = 3\n"),
                "line 2, column 1: ",
                "unknown field `limt`",
            ),
        ] {
            let e = parse::<Doc>(&text).expect_err("refused").to_string();
            assert!(!e.contains(SECRET), "{e}");
            assert!(!e.contains('\n'), "one line: {e}");
            assert!(e.starts_with(place), "{e}");
            assert!(e.contains(what), "{e}");
        }
    }
}
