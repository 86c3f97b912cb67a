//! Text another party wrote — a policy plugin (a log line, the reason it refused its
//! configuration, a trap's message), a peer worker (the reason it refused a call) — made fit
//! for a log or a terminal: bounded, and with every control and bidirectional-formatting
//! character escaped, so the writer cannot end the line and forge the next one, send a
//! terminal escape, or make a line read backwards.

/// `text`, cut to at most `max_bytes` (at a character boundary) and then escaped: `\n`,
/// `\u{1b}`, `\u{202e}` for what would otherwise act rather than show.
pub fn printable(text: &str, max_bytes: usize) -> String {
    let mut end = text.len().min(max_bytes);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let kept = &text[..end];
    if !kept.chars().any(acts) {
        return kept.to_owned();
    }
    let mut out = String::with_capacity(kept.len() + 16);
    for c in kept.chars() {
        if acts(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether `c` acts on a terminal or on how a line reads instead of showing as itself: a
/// control character, a line or paragraph separator (U+2028, U+2029: a line break to whatever
/// reads Unicode lines), or a bidirectional mark, embedding, override or isolate (the Arabic
/// letter mark among them).
pub fn acts(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_breaks_escapes_and_bidi_overrides_show_as_escapes() {
        assert_eq!(printable("plain text", 64), "plain text");
        assert_eq!(
            printable("ok\r\n2026-12-05 WARN forged\x1b[2J\x07", 64),
            "ok\\r\\n2026-12-05 WARN forged\\u{1b}[2J\\u{7}"
        );
        assert_eq!(printable("a\u{202e}fdp.exe", 64), "a\\u{202e}fdp.exe");
        assert_eq!(
            printable("ok\u{2028}forged\u{2029}\u{61c}x", 64),
            "ok\\u{2028}forged\\u{2029}\\u{61c}x"
        );
        assert_eq!(printable("tab\there", 64), "tab\\there");
        // Non-ASCII text that does not act stays.
        assert_eq!(printable("café ✓", 64), "café ✓");
    }

    #[test]
    fn text_is_cut_at_a_character_boundary_before_escaping() {
        assert_eq!(printable("ééé", 3), "é");
        assert_eq!(printable("\n\n\n\n", 2), "\\n\\n");
    }
}
