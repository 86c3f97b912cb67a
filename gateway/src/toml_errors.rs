//! TOML refusals told by place, never by the values there: the gateway's configuration holds
//! key hashes (and an operator may paste a key where its hash goes), and its refusals reach
//! the log, the admin API's reload answers and `GET /tenants`. The TOML parser's own message
//! quotes the line it stopped at, and serde's quote the value of the wrong type; the names
//! of the configuration's own fields and variants stay.

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
            // The line up to the fault, cut back to a character boundary (the span is in bytes).
            let mut start = span.start.min(text.len());
            while !text.is_char_boundary(start) {
                start -= 1;
            }
            let before = &text[..start];
            let line = before.matches('\n').count() + 1;
            let column = before
                .rsplit('\n')
                .next()
                .unwrap_or_default()
                .chars()
                .count()
                + 1;
            format!("line {line}, column {column}: ")
        });
        TomlError {
            place,
            message: without_values(e.message().trim_end()),
        }
    })
}

/// The words before a backquoted value in serde's messages (`unknown variant \`…\``,
/// `integer \`…\``); other backquoted words are the configuration's own names (`unknown
/// field \`limt\``, `expected one of \`a\`, \`b\``) and stay.
const VALUE_KINDS: [&str; 7] = [
    "variant",
    "integer",
    "boolean",
    "character",
    "point",
    "string",
    "bytes",
];

/// `message` with every value in it replaced by `…`: a double-quoted string (serde writes it
/// as Rust's Debug does, `\"` inside), and a backquoted value after one of [`VALUE_KINDS`].
fn without_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut chars = message.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                out.push_str("\"…\"");
                let mut escaped = false;
                for c in chars.by_ref() {
                    match c {
                        '\\' if !escaped => escaped = true,
                        '"' if !escaped => break,
                        _ => escaped = false,
                    }
                }
            }
            '`' => {
                let value = out
                    .split_whitespace()
                    .next_back()
                    .is_some_and(|word| VALUE_KINDS.contains(&word));
                let quoted: String = chars.by_ref().take_while(|&c| c != '`').collect();
                out.push('`');
                out.push_str(if value { "…" } else { &quoted });
                out.push('`');
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[expect(dead_code, reason = "read by the parser only")]
    struct Doc {
        key_sha256: Vec<String>,
        limit: Option<u32>,
        kind: Option<Kind>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Kind {
        Plain,
        Fancy,
    }

    const SECRET: &str = "5dfd868cb40f4fe0134a5d150646bb7c5635f0347be911d5535e47590453485d";

    #[test]
    fn a_refusal_names_the_place_and_never_a_value_there() {
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
            // A quote inside the value does not end its hiding.
            (
                format!("key_sha256 = 'ab\"{SECRET}'\n"),
                "line 1, column 14: ",
                "invalid type: string \"…\", expected a sequence",
            ),
            // A value serde backquotes: an enum's variant.
            (
                format!("key_sha256 = []\nkind = \"{SECRET}\"\n"),
                "line 2, column 8: ",
                "unknown variant `…`, expected `plain` or `fancy`",
            ),
            // Columns count characters, not bytes.
            (
                format!("key_sha256 = []\n# é\nlimit = \"{SECRET}\"\n"),
                "line 3, column 9: ",
                "invalid type: string \"…\", expected u32",
            ),
            (
                "key_sha256 = []\nlimit = -3\n".to_owned(),
                "line 2, column 9: ",
                "invalid value: integer `…`, expected u32",
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
