//! GPT-2's word split, by hand: the pieces a text is cut into before byte-level BPE, for the
//! pre-tokenizers `default`/`gpt2` and, with every numeric character cut apart first,
//! `smollm`/`starcoder`. The same pieces as the `tokenizers` pipeline that runs the expression
//!
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`
//!
//! over each part, keeping every match and every gap between matches as a piece (checked
//! against it by a property test), in one pass and without a backtracking regex engine, which
//! its lookahead needs: that engine was the largest cost of encoding a short message.

use unicode_general_category::{GeneralCategory, get_general_category};

/// What the expression tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// `\p{L}`
    Letter,
    /// `\p{N}`
    Number,
    /// `\s` (White_Space)
    Space,
    /// Anything else.
    Other,
}

fn class(c: char) -> Class {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '0'..='9' => Class::Number,
            '\t' | '\n' | '\x0b' | '\x0c' | '\r' | ' ' => Class::Space,
            _ => Class::Other,
        };
    }
    if c.is_whitespace() {
        return Class::Space;
    }
    use GeneralCategory as G;
    match get_general_category(c) {
        G::UppercaseLetter
        | G::LowercaseLetter
        | G::TitlecaseLetter
        | G::ModifierLetter
        | G::OtherLetter => Class::Letter,
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => Class::Number,
        _ => Class::Other,
    }
}

/// The contractions the expression matches first, after an apostrophe.
const CONTRACTIONS: [&str; 7] = ["s", "t", "re", "ve", "m", "ll", "d"];

/// Calls `piece` with each piece of `text`, in order; with `digits_apart`, every numeric
/// character is a piece of its own and the expression runs on the text between them.
pub(crate) fn split(text: &str, digits_apart: bool, mut piece: impl FnMut(&str)) {
    if !digits_apart {
        return split_part(text, &mut piece);
    }
    let mut start = 0;
    for (at, c) in text.char_indices().filter(|&(_, c)| c.is_numeric()) {
        split_part(&text[start..at], &mut piece);
        let end = at + c.len_utf8();
        piece(&text[at..end]);
        start = end;
    }
    split_part(&text[start..], &mut piece);
}

/// One part: every match of the expression, and every gap between them, as a piece.
fn split_part(part: &str, piece: &mut impl FnMut(&str)) {
    let mut gap: Option<usize> = None;
    let mut at = 0;
    while let Some(c) = part[at..].chars().next() {
        match match_end(part, at, c) {
            Some(end) => {
                if let Some(g) = gap.take() {
                    piece(&part[g..at]);
                }
                piece(&part[at..end]);
                at = end;
            }
            None => {
                gap.get_or_insert(at);
                at += c.len_utf8();
            }
        }
    }
    if let Some(g) = gap {
        piece(&part[g..]);
    }
}

/// Where the expression's match starting at `at` (whose character is `c`) ends, trying its
/// alternatives in order; `None` when none matches there.
fn match_end(part: &str, at: usize, c: char) -> Option<usize> {
    let rest = &part[at..];
    if c == '\'' {
        let after = &rest[1..];
        if let Some(s) = CONTRACTIONS.iter().find(|s| after.starts_with(**s)) {
            return Some(at + 1 + s.len());
        }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run of one class.
    let lead = if c == ' ' { 1 } else { 0 };
    if let Some(first) = rest[lead..].chars().next()
        && class(first) != Class::Space
    {
        let kind = class(first);
        let run = rest[lead..]
            .char_indices()
            .find(|&(_, x)| class(x) != kind)
            .map_or(rest.len(), |(i, _)| lead + i);
        return Some(at + run);
    }
    if class(c) != Class::Space {
        return None;
    }
    // `\s+(?!\S)`: a run of white space up to the end of the part, or else all of the run but
    // its last character (which the lookahead needs before the next word); nothing when that
    // leaves none.
    let mut last = 0;
    for (i, x) in rest.char_indices() {
        if class(x) != Class::Space {
            return (last > 0).then_some(at + last);
        }
        last = i;
    }
    Some(part.len())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _};

    use super::*;
    use crate::tokenizer::{PreTokenizer, byte_level_char};

    /// The pieces the `tokenizers` pipeline cuts `text` into (byte-level mapped, as it leaves
    /// them).
    fn reference(text: &str, digits_apart: bool) -> Vec<String> {
        let mut pre = PreTokenizedString::from(text);
        PreTokenizer::Gpt2 { digits_apart }
            .pipeline()
            .expect("pipeline")
            .pre_tokenize(&mut pre)
            .expect("pre-tokenize");
        pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s.to_owned())
            .collect()
    }

    fn pieces(text: &str, digits_apart: bool) -> Vec<String> {
        let mut out = Vec::new();
        split(text, digits_apart, |p| out.push(p.to_owned()));
        out
    }

    fn byte_level(pieces: Vec<String>) -> Vec<String> {
        pieces
            .iter()
            .map(|p| p.bytes().map(byte_level_char).collect())
            .collect()
    }

    /// Characters from every class, and the ones the expression names: spaces of several
    /// kinds, apostrophes and contraction letters, digits of several scripts, marks, symbols.
    fn text() -> impl Strategy<Value = String> {
        let pick = prop_oneof![
            prop::sample::select(vec![
                ' ', ' ', '\n', '\t', '\r', '\u{a0}', '\u{3000}', '\u{2028}', '\u{85}', '\'', '\'',
                's', 't', 'r', 'e', 'v', 'm', 'l', 'd', 'S', 'a', 'Z', '0', '7', '²', '٣', 'Ⅻ',
                '½', '!', '.', '-', '_', '\u{301}', '\u{1c}', 'é', 'ß', 'Ж', '中', 'ー', '🙂',
                '\u{200d}', '$', '\0',
            ]),
            any::<char>(),
        ];
        prop::collection::vec(pick, 0..40).prop_map(|v| v.into_iter().collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        #[test]
        fn the_pieces_are_those_of_the_regex_pipeline(text in text(), digits_apart: bool) {
            prop_assert_eq!(byte_level(pieces(&text, digits_apart)), reference(&text, digits_apart));
        }
    }

    #[test]
    fn known_cuts() {
        assert_eq!(
            pieces("Hello world, it's 2024!\n\n  ok ", true),
            [
                "Hello", " world", ",", " it", "'s", " ", "2", "0", "2", "4", "!", "\n\n ", " ok",
                " "
            ]
        );
        assert_eq!(
            pieces("a  b\t\nc", false),
            ["a", " ", " b", "\t", "\n", "c"]
        );
        assert_eq!(pieces("", true), Vec::<String>::new());
    }
}
