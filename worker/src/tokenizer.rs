//! The tokenizer, built from the GGUF file's own vocabulary and merges.
//!
//! Encoding: control tokens (`<|im_start|>` …) are recognised in the text only when the caller
//! asks for it (rendered chat templates), so text from a user cannot smuggle them in through a
//! raw completion prompt. Everything between them goes through byte-level BPE with the
//! pre-tokenizer the file names. Decoding maps each token back to its exact bytes, so
//! streaming can emit text only at UTF-8 boundaries ([`Detokenizer`]).

use std::collections::HashMap;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{Model, SplitDelimiterBehavior};

use crate::gguf::{Gguf, GgufError};
use crate::printable::printable;
use crate::text_cache::{Held, TextCache};
use crate::words;

/// A token id of the served model's vocabulary.
pub type TokenId = u32;

/// Why the tokenizer could not be built or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tokenizer model {0:?} is not supported (supported: \"gpt2\" byte-level BPE)")]
    UnsupportedModel(String),
    #[error("pre-tokenizer {0:?} is not supported (supported: {PRE_TOKENIZERS})")]
    UnsupportedPreTokenizer(String),
    #[error("merge {index} ({merge:?}) is not two tokens separated by a space")]
    BadMerge { index: usize, merge: String },
    #[error(
        "merge {index} ({merge:?}) is not of two tokens of the vocabulary whose joining is one too"
    )]
    MergeOutsideVocabulary { index: usize, merge: String },
    #[error("token {second} ({token:?}) repeats token {first}: one of them could never be encoded")]
    RepeatedToken {
        first: TokenId,
        second: TokenId,
        token: String,
    },
    #[error(
        "the vocabulary has {tokens} tokens and {types} token types: a token past the types would be taken as text, a control token among them too"
    )]
    TypesMismatch { tokens: usize, types: usize },
    #[error("cannot build the BPE model: {0}")]
    Build(String),
    #[error("cannot encode the text: {0}")]
    Encode(String),
}

/// `tokenizer.ggml.add_bos_token`: false when absent.
pub(crate) fn add_bos(g: &Gguf) -> Result<bool, GgufError> {
    let key = "tokenizer.ggml.add_bos_token";
    match g.get(key) {
        Err(GgufError::MissingKey { .. }) => Ok(false),
        Err(e) => Err(e),
        Ok(crate::gguf::Value::Bool(b)) => Ok(*b),
        Ok(_) => Err(GgufError::BadValue {
            key: key.into(),
            reason: "not a boolean".into(),
        }),
    }
}

/// The longest part of a token or merge an error quotes.
const QUOTED: usize = 64;

/// GGUF `tokenizer.ggml.token_type` values.
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// The served model's tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    bpe: tokenizers::Tokenizer,
    /// GPT-2's words are cut by [`words::split`] and go straight to the BPE model; the other
    /// pre-tokenizers run `bpe`'s regex pipeline.
    pre: PreTokenizer,
    /// Exact bytes of every token id (control tokens: their text).
    bytes: Vec<Vec<u8>>,
    /// The most bytes of text one token decodes to ([`Tokenizer::longest_token_text`]).
    longest_text: usize,
    /// Control and user-defined tokens, matched in text when asked (`None`: there are none).
    specials: Option<Specials>,
    /// Ids of control tokens, which decoding skips.
    control: Vec<bool>,
    /// The bytes no token of the vocabulary starts from, by byte (`None`: every byte has its
    /// token, as in every real byte-level vocabulary).
    unencodable: Option<Box<[bool; 256]>>,
    bos: Option<TokenId>,
    eos: TokenId,
    /// A raw text prompt starts with `bos` ([`Tokenizer::encode_prompt`]).
    add_bos: bool,
    /// Tokens that end generation: EOS plus `<|endoftext|>`/`<|eot_id|>`-style control tokens.
    stop: Vec<TokenId>,
    /// The texts a chat template renders around the messages, split for encoding (see
    /// [`Tokenizer::template_piece`]).
    template_pieces: TextCache<Arc<TemplatePiece>>,
}

/// A chat template's piece — the text it renders between two contents (a role header, its
/// default system prompt, the generation prompt) — split for encoding beside them: from its
/// first control token to its last, encoded once; the text before and after, left as text to
/// be encoded with the contents beside it. The reference tokenizes the whole rendering, so a
/// word may run across a seam: the newline after a role header and the newlines a content
/// starts with are one word there.
#[derive(Debug, PartialEq, Eq)]
pub struct TemplatePiece {
    /// The text before the first control token: the whole piece when it has none.
    pub head: String,
    /// From the first control token to the last, encoded, and the text after the last; `None`
    /// when the piece has no control token.
    pub controlled: Option<(Vec<TokenId>, String)>,
}

/// Control tokens that end generation beside the file's EOS, as llama.cpp's end-of-generation
/// set has them: a turn's end (ChatML, Llama 3, Phi-3, Gemma), the end of a text, the end of a
/// message that calls a tool (Llama 3.1). A Llama 3 Instruct file's EOS is `<|eot_id|>`; one that
/// emitted `<|end_of_text|>` decoded nothing and ran on to `max_tokens`.
const END_OF_GENERATION: [&str; 7] = [
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
];

/// The most template pieces kept.
const TEMPLATE_PIECES: usize = 256;

/// The most bytes the kept template pieces hold, their texts and ids.
const TEMPLATE_PIECE_BYTES: usize = 4 << 20;

impl Held for Arc<TemplatePiece> {
    fn held_bytes(&self) -> usize {
        let (ids, tail) = self.controlled.as_ref().map_or((0, 0), |(ids, tail)| {
            (std::mem::size_of_val::<[TokenId]>(ids), tail.len())
        });
        self.head.len() + ids + tail
    }
}

/// A tokenizer's data, as a GGUF file holds it and a worker's Info hands it to the gateway.
#[derive(Debug, Clone, Copy)]
pub struct TokenizerParts<'a, S> {
    /// `tokenizer.ggml.model`; only "gpt2" (byte-level BPE) is supported.
    pub model: &'a str,
    /// `tokenizer.ggml.pre`; `None` is GPT-2's default.
    pub pre: Option<&'a str>,
    /// The vocabulary, by token id.
    pub tokens: &'a [S],
    /// BPE merges, "a b" each, highest priority first.
    pub merges: &'a [S],
    /// `tokenizer.ggml.token_type` by token id; missing entries are normal tokens.
    pub token_types: &'a [i32],
    /// Ignored when outside the vocabulary.
    pub bos: Option<TokenId>,
    /// Must be inside the vocabulary.
    pub eos: TokenId,
    /// `tokenizer.ggml.add_bos_token`: a raw text prompt starts with `bos`.
    pub add_bos: bool,
}

/// The special tokens' texts, found in one pass over a text: at each place the earliest,
/// and of those starting there the longest (one search per token, again after every match,
/// took a template piece's length times its matches times the tokens).
#[derive(Debug)]
struct Specials {
    matcher: AhoCorasick,
    /// Each text's id, by its pattern index.
    ids: Vec<TokenId>,
}

impl Specials {
    fn new(specials: Vec<(String, TokenId)>) -> Result<Specials, TokenizerError> {
        let (texts, ids): (Vec<String>, Vec<TokenId>) = specials.into_iter().unzip();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&texts)
            .map_err(|e| TokenizerError::Build(format!("the special tokens: {e}")))?;
        Ok(Specials { matcher, ids })
    }
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.into()));
        }
        let tokens = g.get_strings("tokenizer.ggml.tokens")?;
        // Absent: every token normal. Present, it must say: read as all normal, control tokens
        // would be neither parsed in templates nor stops, and would stream as text.
        let types_key = "tokenizer.ggml.token_type";
        let token_types: Vec<i32> = match g.get(types_key) {
            Ok(v) => v
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|t| t.as_u64().and_then(|t| i32::try_from(t).ok()))
                        .collect::<Option<_>>()
                })
                .ok_or_else(|| GgufError::BadValue {
                    key: types_key.into(),
                    reason: "not an array of token types".into(),
                })?,
            Err(GgufError::MissingKey { .. }) => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        let merges = g.get_strings("tokenizer.ggml.merges")?;
        let pre = match g.get_str("tokenizer.ggml.pre") {
            Err(GgufError::MissingKey { .. }) => None,
            other => Some(other?),
        };
        // A token the file names, when it names one: refused outside the vocabulary (a BOS
        // read as absent would leave every prompt without the BOS the file asks for).
        let id = |key: &str| match g.get_u64(key) {
            Err(GgufError::MissingKey { .. }) => Ok(None),
            Err(e) => Err(e),
            Ok(v) => TokenId::try_from(v)
                .ok()
                .filter(|&v| (v as usize) < tokens.len())
                .map(Some)
                .ok_or_else(|| GgufError::BadValue {
                    key: key.into(),
                    reason: format!("token {v} is not in the vocabulary of {}", tokens.len()),
                }),
        };
        let eos_key = "tokenizer.ggml.eos_token_id";
        let eos = id(eos_key)?.ok_or_else(|| GgufError::MissingKey {
            key: eos_key.into(),
        })?;
        let add_bos = add_bos(g)?;
        let bos = match id("tokenizer.ggml.bos_token_id") {
            Ok(bos) => bos,
            // A stale id in a file that never puts a BOS before a prompt: loaded (as llama.cpp
            // loads it), said; refused only where prompts would lose it.
            Err(e) if !add_bos => {
                tracing::warn!(error = %e, "ignoring the model file's BOS token id");
                None
            }
            Err(e) => return Err(e.into()),
        };
        Tokenizer::from_parts(TokenizerParts {
            model,
            pre,
            tokens: &tokens,
            merges: &merges,
            token_types: &token_types,
            bos,
            eos,
            add_bos,
        })
    }

    /// Builds the tokenizer from its data (a GGUF file's, or a worker's Info).
    pub fn from_parts<S: AsRef<str>>(
        parts: TokenizerParts<'_, S>,
    ) -> Result<Tokenizer, TokenizerError> {
        let TokenizerParts {
            model,
            pre,
            tokens,
            merges,
            token_types: types,
            bos,
            eos,
            add_bos,
        } = parts;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.into()));
        }
        // No types: every token normal. Some: one per token.
        if !types.is_empty() && types.len() != tokens.len() {
            return Err(TokenizerError::TypesMismatch {
                tokens: tokens.len(),
                types: types.len(),
            });
        }
        let type_of = |i: usize| types.get(i).copied().unwrap_or(1);
        let mut vocab = Vocab::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            let t = t.as_ref();
            if let Some(first) = vocab.insert(t.to_owned(), i as TokenId) {
                return Err(TokenizerError::RepeatedToken {
                    first,
                    second: i as TokenId,
                    token: printable(t, QUOTED),
                });
            }
        }
        // Every merge joins two tokens into a third: the BPE builder indexes a buffer as long
        // as the longest token with the joining before it looks the third up (a panic).
        let merges = merges
            .iter()
            .enumerate()
            .map(|(index, m)| {
                let m = m.as_ref();
                let (a, b) = m.split_once(' ').ok_or_else(|| TokenizerError::BadMerge {
                    index,
                    merge: printable(m, QUOTED),
                })?;
                let known = |t: &str| vocab.contains_key(t);
                if !(known(a) && known(b) && known(&format!("{a}{b}"))) {
                    return Err(TokenizerError::MergeOutsideVocabulary {
                        index,
                        merge: printable(m, QUOTED),
                    });
                }
                Ok((a.to_owned(), b.to_owned()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let unencodable = unencodable_bytes(&vocab);
        let pre = PreTokenizer::named(pre.unwrap_or("default"))?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            // Llama 3's tokenizer takes a word that is a token of its own as that token, not
            // through the merges (llama.cpp's `ignore_merges`, HF's tokenizer.json).
            .ignore_merges(pre == PreTokenizer::Llama3)
            .build()
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_pre_tokenizer(Some(pre.pipeline()?));

        let unicode_to_byte = byte_level_inverse();
        let mut specials = Vec::new();
        let mut control = vec![false; tokens.len()];
        let bytes: Vec<Vec<u8>> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let t = t.as_ref();
                if matches!(type_of(i), TYPE_CONTROL | TYPE_USER_DEFINED) {
                    // An empty one would match everywhere and consume nothing: never parsed.
                    if !t.is_empty() {
                        specials.push((t.to_owned(), i as TokenId));
                    }
                    control[i] = type_of(i) == TYPE_CONTROL;
                    return t.as_bytes().to_vec();
                }
                t.chars()
                    .map(|c| unicode_to_byte.get(&c).copied().unwrap_or(b'?'))
                    .collect()
            })
            .collect();
        // A byte that is no character on its own decodes to U+FFFD: three bytes.
        let longest_text = bytes.iter().map(Vec::len).max().unwrap_or(0) * 3;

        if eos as usize >= tokens.len() {
            return Err(TokenizerError::Build(format!(
                "the end-of-sequence token {eos} is outside the vocabulary of {}",
                tokens.len()
            )));
        }
        let mut stop = vec![eos];
        for name in END_OF_GENERATION {
            if let Some(&(_, t)) = specials.iter().find(|(s, _)| s == name)
                && !stop.contains(&t)
            {
                stop.push(t);
            }
        }
        let specials = match specials.is_empty() {
            true => None,
            false => Some(Specials::new(specials)?),
        };
        Ok(Tokenizer {
            bpe: tk,
            pre,
            bytes,
            longest_text,
            specials,
            control,
            unencodable,
            bos: bos.filter(|&b| (b as usize) < tokens.len()),
            eos,
            add_bos,
            stop,
            template_pieces: TextCache::new(TEMPLATE_PIECES, TEMPLATE_PIECE_BYTES),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    pub fn bos(&self) -> Option<TokenId> {
        self.bos
    }

    pub fn eos(&self) -> TokenId {
        self.eos
    }

    /// Whether generating `token` ends the sequence.
    pub fn is_stop(&self, token: TokenId) -> bool {
        self.stop.contains(&token)
    }

    /// A raw text prompt's ids: `text` as plain text, after the BOS token when the model's
    /// file asks for one (`tokenizer.ggml.add_bos_token`: Llama 3's does, SmolLM2's does not).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<TokenId>, TokenizerError> {
        let mut ids = Vec::from_iter(self.prompt_bos());
        self.encode_plain(text, &mut ids)?;
        Ok(ids)
    }

    /// The token a prompt starts with, when the model's file asks for one.
    pub fn prompt_bos(&self) -> Option<TokenId> {
        self.bos.filter(|_| self.add_bos)
    }

    /// Encodes `text`. With `parse_special`, control-token text becomes the control token.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<TokenId>, TokenizerError> {
        let mut out = Vec::new();
        let mut plain_from = 0;
        if let Some(specials) = self.specials.as_ref().filter(|_| parse_special) {
            for hit in specials.matcher.find_iter(text) {
                self.encode_plain(&text[plain_from..hit.start()], &mut out)?;
                out.push(specials.ids[hit.pattern().as_usize()]);
                plain_from = hit.end();
            }
        }
        self.encode_plain(&text[plain_from..], &mut out)?;
        Ok(out)
    }

    /// Appends the ids of `text` (no special tokens in it) to `out`.
    fn encode_plain(&self, text: &str, out: &mut Vec<TokenId>) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        // BPE starts from each byte's own token and skips one it does not find: the text
        // would lose it without a word.
        if let Some(unencodable) = &self.unencodable
            && let Some((at, c)) = text.char_indices().find(|(_, c)| {
                let mut utf8 = [0; 4];
                c.encode_utf8(&mut utf8)
                    .bytes()
                    .any(|b| unencodable[usize::from(b)])
            })
        {
            return Err(TokenizerError::Encode(format!(
                "the vocabulary has no token for a byte of {c:?} (at byte {at} of the text)"
            )));
        }
        let encode_error = |e: tokenizers::Error| TokenizerError::Encode(e.to_string());
        let PreTokenizer::Gpt2 { digits_apart } = self.pre else {
            let enc = self.bpe.encode_fast(text, false).map_err(encode_error)?;
            out.extend_from_slice(enc.get_ids());
            return Ok(());
        };
        let model = self.bpe.get_model();
        let mut word = String::new();
        let mut failed = None;
        words::split(text, digits_apart, |piece| {
            if failed.is_some() {
                return;
            }
            word.clear();
            word.extend(piece.bytes().map(byte_level_char));
            match model.tokenize(&word) {
                Ok(tokens) => out.extend(tokens.iter().map(|t| t.id)),
                Err(e) => failed = Some(e),
            }
        });
        failed.map_or(Ok(()), |e| Err(encode_error(e)))
    }

    /// `text`, a piece a chat template rendered around the messages' contents, split at its
    /// control tokens ([`TemplatePiece`]): the same few pieces on every request, so they come
    /// from a bounded cache after the first time.
    pub fn template_piece(&self, text: &str) -> Result<Arc<TemplatePiece>, TokenizerError> {
        self.template_pieces.get_or_make(text, || {
            let hits = self.specials.as_ref().map(|s| {
                let mut hits = s.matcher.find_iter(text);
                let first = hits.next();
                (first, hits.last().or(first))
            });
            let Some((Some(first), Some(last))) = hits else {
                return Ok(Arc::new(TemplatePiece {
                    head: text.to_owned(),
                    controlled: None,
                }));
            };
            Ok(Arc::new(TemplatePiece {
                head: text[..first.start()].to_owned(),
                controlled: Some((
                    self.encode(&text[first.start()..last.end()], true)?,
                    text[last.end()..].to_owned(),
                )),
            }))
        })
    }

    /// The most bytes of text any one token decodes to, alone or after others (a byte that is
    /// no character on its own counted as the three of U+FFFD, control tokens by their text):
    /// `n` tokens of text are at most `n` times this long.
    pub fn longest_token_text(&self) -> usize {
        self.longest_text
    }

    /// The exact bytes of `token` (empty for control tokens and ids outside the vocabulary).
    pub fn token_bytes(&self, token: TokenId) -> &[u8] {
        let i = token as usize;
        if self.control.get(i).copied().unwrap_or(true) {
            return &[];
        }
        &self.bytes[i]
    }

    /// Decodes a whole sequence (control tokens skipped; invalid UTF-8 replaced).
    pub fn decode(&self, tokens: &[TokenId]) -> String {
        let bytes: Vec<u8> = tokens
            .iter()
            .flat_map(|&t| self.token_bytes(t).iter().copied())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The pre-tokenizers this tokenizer knows, by their GGUF `tokenizer.ggml.pre` name.
const PRE_TOKENIZERS: &str = "default, gpt2, smollm, starcoder, llama-bpe, llama3, qwen2";

/// GPT-2's word-splitting expression.
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Llama 3's, which Qwen2 shares except that it takes digits one at a time.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer a GGUF file names: how text is cut into words before byte-level BPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PreTokenizer {
    /// GPT-2's expression ([`GPT2_SPLIT`]); SmolLM and StarCoder cut every digit apart first.
    Gpt2 { digits_apart: bool },
    /// Llama 3's expression.
    Llama3,
    /// Llama 3's expression, taking digits one at a time.
    Qwen2,
}

impl PreTokenizer {
    fn named(name: &str) -> Result<PreTokenizer, TokenizerError> {
        Ok(match name {
            "default" | "gpt2" => PreTokenizer::Gpt2 {
                digits_apart: false,
            },
            "smollm" | "starcoder" => PreTokenizer::Gpt2 { digits_apart: true },
            "llama-bpe" | "llama3" => PreTokenizer::Llama3,
            "qwen2" => PreTokenizer::Qwen2,
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.into())),
        })
    }

    /// Its `tokenizers` pipeline, byte-level mapping included.
    pub(crate) fn pipeline(self) -> Result<Sequence, TokenizerError> {
        let split = |pattern: &str| {
            Split::new(
                SplitPattern::Regex(pattern.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::Build(e.to_string()))
        };
        let bytes = ByteLevel::new(false, false, false).into();
        Ok(Sequence::new(match self {
            PreTokenizer::Gpt2 { digits_apart } => {
                let mut steps = vec![split(GPT2_SPLIT)?.into(), bytes];
                if digits_apart {
                    steps.insert(0, Digits::new(true).into());
                }
                steps
            }
            PreTokenizer::Llama3 => vec![split(LLAMA3_SPLIT)?.into(), bytes],
            PreTokenizer::Qwen2 => vec![
                split(&LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"))?.into(),
                bytes,
            ],
        }))
    }
}

/// GPT-2's byte-level alphabet: the printable character that stands for byte `b` in a
/// vocabulary (printable Latin-1 bytes stand for themselves, the rest map to U+0100 onward).
pub fn byte_level_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap_or('?')
}

/// The bytes whose byte-level character is no token of `vocab`, if any.
fn unencodable_bytes(vocab: &Vocab) -> Option<Box<[bool; 256]>> {
    let mut missing = Box::new([false; 256]);
    let mut any = false;
    for b in 0..=255u8 {
        let absent = !vocab.contains_key(byte_level_char(b).encode_utf8(&mut [0; 4]) as &str);
        missing[usize::from(b)] = absent;
        any |= absent;
    }
    any.then_some(missing)
}

/// The inverse of [`byte_level_char`].
fn byte_level_inverse() -> HashMap<char, u8> {
    (0..=255u8).map(|b| (byte_level_char(b), b)).collect()
}

/// Turns a stream of tokens into a stream of text that never splits a UTF-8 character.
#[derive(Debug, Default)]
pub struct Detokenizer {
    pending: Vec<u8>,
}

impl Detokenizer {
    /// Adds `token` and returns the text that became complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, token: TokenId) -> String {
        self.pending.extend_from_slice(tokenizer.token_bytes(token));
        let mut text = String::new();
        loop {
            let (valid, invalid) = match std::str::from_utf8(&self.pending) {
                Ok(_) => (self.pending.len(), 0),
                // An invalid sequence is replaced now; an incomplete character at the end
                // waits for the next token.
                Err(e) => (e.valid_up_to(), e.error_len().unwrap_or(0)),
            };
            text.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
            if invalid == 0 {
                self.pending.drain(..valid);
                return text;
            }
            text.push(char::REPLACEMENT_CHARACTER);
            self.pending.drain(..valid + invalid);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::gguf::{Gguf, Value};
    use crate::tiny_model::TinySpec;

    use super::*;

    fn tokenizer(pre: &'static str) -> Result<Tokenizer, TokenizerError> {
        let path =
            std::env::temp_dir().join(format!("bulkhead-tok-{}-{pre}.gguf", std::process::id()));
        TinySpec {
            pre_tokenizer: pre,
            ..TinySpec::default()
        }
        .write(&path)
        .expect("write");
        let g = Gguf::open(&path).expect("open");
        let _ = std::fs::remove_file(&path);
        Tokenizer::from_gguf(&g)
    }

    #[test]
    fn the_pre_tokenizer_follows_the_file() {
        for pre in ["default", "gpt2", "smollm", "llama-bpe", "qwen2"] {
            let t = tokenizer(pre).expect(pre);
            let text = "It's 2024, naïve  café!\n";
            assert_eq!(
                t.decode(&t.encode(text, false).expect("encode")),
                text,
                "{pre}"
            );
        }
    }

    /// The hand-cut words give the ids the `tokenizers` pipeline gives.
    #[test]
    fn gpt2_words_encode_as_the_regex_pipeline() {
        for pre in ["gpt2", "smollm"] {
            let t = tokenizer(pre).expect(pre);
            assert!(matches!(t.pre, PreTokenizer::Gpt2 { .. }), "{pre}");
            proptest::test_runner::TestRunner::default()
                .run(&"[ a-z0-9'\n\t!é中²]{0,24}", |text| {
                    let want = t.bpe.encode_fast(text.as_str(), false).expect("pipeline");
                    let got = t.encode(&text, false).expect("encode");
                    proptest::prop_assert_eq!(got.as_slice(), want.get_ids());
                    Ok(())
                })
                .expect(pre);
        }
    }

    /// No run of tokens decodes to more than `longest_token_text` bytes a token: the bound an
    /// OpenAI-compatible upstream's text is held to (`max_tokens` of them).
    #[test]
    fn no_token_decodes_longer_than_the_longest_token_text() {
        let t = tokenizer("smollm").expect("smollm");
        let longest = t.longest_token_text();
        assert!(longest >= 3, "{longest}");
        let ids: Vec<TokenId> = (0..t.vocab_size() as TokenId).collect();
        for id in &ids {
            assert!(t.decode(&[*id]).len() <= longest, "token {id}");
        }
        // Lone bytes of multi-byte characters, each replaced by three bytes.
        let lone: Vec<TokenId> = ids
            .iter()
            .copied()
            .filter(|&id| t.token_bytes(id).iter().all(|&b| b >= 0x80))
            .filter(|&id| !t.token_bytes(id).is_empty())
            .collect();
        assert!(t.decode(&lone).len() <= lone.len() * longest);
    }

    /// An end-of-sequence id outside the vocabulary is said to be that, not missing.
    #[test]
    fn an_eos_id_outside_the_vocabulary_is_refused_as_such() {
        let path =
            std::env::temp_dir().join(format!("bulkhead-tok-eos-{}.gguf", std::process::id()));
        // Far outside; and one that a cast to 32 bits made token 2.
        for id in [Value::U32(1_000_000_000), Value::U64((1 << 32) + 2)] {
            let mut w = TinySpec::default().to_gguf();
            w.meta("tokenizer.ggml.eos_token_id", id);
            w.write(&path).expect("write");
            let g = Gguf::open(&path).expect("open");
            let _ = std::fs::remove_file(&path);
            let err = Tokenizer::from_gguf(&g).expect_err("refused").to_string();
            assert!(err.contains("is not in the vocabulary"), "{err}");
        }
    }

    /// A BOS id outside the vocabulary in a file that asks for a BOS before prompts, or token
    /// types that are not an array of them, are refused: read as absent, prompts lost the BOS
    /// the file asks for, and control tokens streamed as text. A file that puts no BOS before
    /// prompts loads with a stale id, as llama.cpp loads it.
    #[test]
    fn a_bos_id_outside_the_vocabulary_or_unreadable_token_types_are_refused() {
        let path =
            std::env::temp_dir().join(format!("bulkhead-tok-bos-id-{}.gguf", std::process::id()));
        let mut w = TinySpec::default().to_gguf();
        w.meta("tokenizer.ggml.bos_token_id", Value::U32(1_000_000));
        w.write(&path).expect("write");
        let g = Gguf::open(&path).expect("open");
        let t = Tokenizer::from_gguf(&g).expect("no BOS asked for: loads");
        assert_eq!(t.bos(), None);
        for (key, value, said) in [
            (
                "tokenizer.ggml.bos_token_id",
                Value::U32(1_000_000),
                "is not in the vocabulary",
            ),
            (
                "tokenizer.ggml.bos_token_id",
                Value::String("1".into()),
                "bos_token_id",
            ),
            (
                "tokenizer.ggml.token_type",
                Value::String("x".into()),
                "not an array of token types",
            ),
            (
                "tokenizer.ggml.token_type",
                Value::Array(vec![Value::String("x".into())]),
                "not an array of token types",
            ),
        ] {
            let mut w = TinySpec::default().to_gguf();
            w.meta(key, value)
                .meta("tokenizer.ggml.add_bos_token", Value::Bool(true));
            w.write(&path).expect("write");
            let g = Gguf::open(&path).expect("open");
            let _ = std::fs::remove_file(&path);
            let err = Tokenizer::from_gguf(&g).expect_err(key).to_string();
            assert!(err.contains(said), "{key}: {err}");
        }
    }

    /// Token types, when the file has them, are one per token: fewer left the last tokens
    /// (Llama 3's control tokens) read as text.
    #[test]
    fn token_types_of_another_count_than_the_tokens_are_refused() {
        let mut w = TinySpec::default().to_gguf();
        w.meta(
            "tokenizer.ggml.token_type",
            Value::Array(vec![Value::I32(3)]),
        );
        let g = w.opened().expect("opens");
        let e = Tokenizer::from_gguf(&g).expect_err("refused");
        assert!(
            matches!(e, TokenizerError::TypesMismatch { types: 1, .. }),
            "{e}"
        );
    }

    /// A raw text prompt starts with the BOS token when the file says so
    /// (`tokenizer.ggml.add_bos_token`, Llama 3's), and not when it says not or says nothing
    /// (SmolLM2's says false); a value that is not a boolean is refused.
    #[test]
    fn a_prompt_starts_with_bos_when_the_file_asks() {
        let with = |value: Option<Value>| {
            let path = std::env::temp_dir().join(format!(
                "bulkhead-tok-bos-{}-{}.gguf",
                std::process::id(),
                rand::random::<u32>()
            ));
            let mut w = TinySpec::default().to_gguf();
            if let Some(v) = value {
                w.meta("tokenizer.ggml.add_bos_token", v);
            }
            w.write(&path).expect("write");
            let g = Gguf::open(&path).expect("open");
            let _ = std::fs::remove_file(&path);
            Tokenizer::from_gguf(&g)
        };
        let plain = with(None).expect("builds");
        let text = plain.encode("ab", false).expect("encode");
        assert_eq!(plain.encode_prompt("ab").expect("encode"), text);
        let no = with(Some(Value::Bool(false))).expect("builds");
        assert_eq!(no.encode_prompt("ab").expect("encode"), text);
        let yes = with(Some(Value::Bool(true))).expect("builds");
        let bos = yes.bos().expect("the tiny model has a BOS");
        assert_eq!(
            yes.encode_prompt("ab").expect("encode"),
            [&[bos][..], &text].concat()
        );
        let e = with(Some(Value::U32(1))).expect_err("refused");
        assert!(e.to_string().contains("add_bos_token"), "{e}");
    }

    #[test]
    fn an_unknown_pre_tokenizer_is_refused_by_name() {
        let err = tokenizer("mystery").expect_err("unknown");
        assert!(err.to_string().contains("\"mystery\""), "{err}");
    }

    /// A vocabulary from a file or a peer: a token per letter `a`..`z` (ids 0..26), then
    /// `controls` as control tokens, the first of them the end of sequence.
    fn letters_and(controls: &[&str]) -> Result<Tokenizer, TokenizerError> {
        let mut tokens: Vec<String> = ('a'..='z').map(String::from).collect();
        tokens.extend(controls.iter().map(|c| (*c).to_owned()));
        let mut token_types = vec![1; 26];
        token_types.extend(controls.iter().map(|_| 3));
        Tokenizer::from_parts(TokenizerParts {
            model: "gpt2",
            pre: None,
            tokens: &tokens,
            merges: &[] as &[String],
            token_types: &token_types,
            bos: None,
            eos: 26,
            add_bos: false,
        })
    }

    /// Llama 3's pre-tokenizer takes a word that is a token as that token, whatever the
    /// merges would make of it; the others build it through the merges.
    #[test]
    fn llama3_takes_a_word_that_is_a_token_whole() {
        let build = |pre| {
            let mut tokens: Vec<String> = (0..=255u8)
                .map(|b| byte_level_char(b).to_string())
                .collect();
            tokens.push("abc".into());
            tokens.push("<eos>".into());
            let mut token_types = vec![1; 257];
            token_types.push(3);
            Tokenizer::from_parts(TokenizerParts {
                model: "gpt2",
                pre: Some(pre),
                tokens: &tokens,
                merges: &[] as &[String],
                token_types: &token_types,
                bos: None,
                eos: 257,
                add_bos: false,
            })
            .expect("builds")
        };
        let letters: Vec<TokenId> = b"abc".iter().map(|&b| TokenId::from(b)).collect();
        let byte_ids = |t: &Tokenizer| t.encode("abc", false).expect("encodes");
        assert_eq!(byte_ids(&build("llama-bpe")), [256]);
        assert_eq!(byte_ids(&build("qwen2")), letters);
    }

    /// Generation ends at the file's EOS and at the end-of-generation control tokens beside it
    /// (Llama 3's `<|end_of_text|>` after an EOS of `<|eot_id|>`), never at a control token
    /// that opens something, nor at the same text as an ordinary token.
    #[test]
    fn generation_stops_at_every_end_of_generation_control_token() {
        let t = letters_and(&[
            "<|eot_id|>",
            "<|end_of_text|>",
            "<|eom_id|>",
            "<end_of_turn>",
            "<|start_header_id|>",
        ])
        .expect("builds");
        let stops: Vec<bool> = (26..31).map(|id| t.is_stop(id)).collect();
        assert_eq!(stops, [true, true, true, true, false]);
        assert!(!t.is_stop(0));
    }

    /// A vocabulary without a byte's token (a corrupt file's, or an Info's) drops that byte
    /// from the text it encodes: refused, naming the character, instead of a prompt that
    /// silently lost it.
    #[test]
    fn text_with_a_byte_the_vocabulary_lacks_is_refused_not_dropped() {
        let t = letters_and(&["<eos>"]).expect("builds");
        assert_eq!(t.encode("ab", false).expect("letters encode"), [0, 1]);
        let e = t.encode("a b", false).expect_err("no token for the space");
        assert!(e.to_string().contains("' '"), "{e}");
        let e = t.encode("x<eos>é", true).expect_err("nor for é");
        assert!(e.to_string().contains("'é'"), "{e}");
        // A vocabulary with é's first byte and not its second: the character is named, the
        // text never cut inside it.
        let mut letters: Vec<String> = ('a'..='z').map(String::from).collect();
        letters.push(byte_level_char(0xc3).to_string());
        letters.push("<eos>".into());
        let mut types = vec![1; 27];
        types.push(3);
        let half = Tokenizer::from_parts(TokenizerParts {
            model: "gpt2",
            pre: None,
            tokens: &letters,
            merges: &[] as &[String],
            token_types: &types,
            bos: None,
            eos: 27,
            add_bos: false,
        })
        .expect("builds");
        let e = half
            .encode("aé", false)
            .expect_err("no token for é's second byte");
        assert!(e.to_string().contains("'é' (at byte 1"), "{e}");
        // A real vocabulary has every byte: nothing to refuse.
        let smol = tokenizer("smollm").expect("smollm");
        assert!(smol.unencodable.is_none());
    }

    #[test]
    fn an_empty_special_token_is_never_parsed() {
        // An empty control token after the letters.
        let t =
            letters_and(&["<eos>", ""]).expect("a vocabulary with an empty control token builds");
        // Before, the empty token matched at offset 0 forever: encoding never returned.
        assert_eq!(t.encode("ab<eos>c", true).expect("encode"), [0, 1, 26, 2]);
    }

    /// A vocabulary from a file or a peer whose merges or tokens the BPE model cannot take
    /// is refused with its reason (a merge joining into more than the longest token panicked
    /// the builder; a repeated token left the first of its ids never encoded).
    #[test]
    fn merges_outside_the_vocabulary_and_repeated_tokens_are_refused() {
        let build = |tokens: &[&str], merges: &[&str]| {
            Tokenizer::from_parts(TokenizerParts {
                model: "gpt2",
                pre: None,
                tokens,
                merges,
                token_types: &[],
                bos: None,
                eos: 0,
                add_bos: false,
            })
        };
        build(&["a", "b", "ab"], &["a b"]).expect("a merge into a token");
        for merges in [&["ab ab"][..], &["a c"], &["b a"]] {
            let e = build(&["a", "b", "ab"], merges).expect_err("refused");
            assert!(
                matches!(&e, TokenizerError::MergeOutsideVocabulary { index: 0, .. }),
                "{merges:?}: {e}"
            );
        }
        let e = build(&["a", "b", "a"], &[]).expect_err("refused");
        assert!(
            matches!(
                &e,
                TokenizerError::RepeatedToken {
                    first: 0,
                    second: 2,
                    ..
                }
            ),
            "{e}"
        );
    }

    /// Special tokens are found where they begin earliest, the longest of those beginning
    /// there, and plain text between them is encoded as text.
    #[test]
    fn the_earliest_longest_special_token_is_taken_at_each_place() {
        let t = letters_and(&["<s>", "<s><s>", "s><"]).expect("builds");
        // "s><" lies inside "<s><s>", which begins earlier; "<s><s>" is longer than "<s>".
        assert_eq!(
            t.encode("x<s><s>y<s>", true).expect("encode"),
            [23, 27, 24, 26]
        );
        assert_eq!(t.encode("<s>", true).expect("encode"), [26]);
        assert_eq!(t.encode("ab", true).expect("encode"), [0, 1]);
    }

    #[test]
    fn an_invalid_byte_spoils_no_character_after_it() {
        // Byte-level tokens: 0xFF then the first byte of "é" in one token, its second in the next.
        let tokens: Vec<String> = [&[0xFF, 0xC3][..], &[0xA9]]
            .iter()
            .map(|bytes| bytes.iter().map(|&b| byte_level_char(b)).collect())
            .chain(["<eos>".to_owned()])
            .collect();
        let t = Tokenizer::from_parts(TokenizerParts {
            model: "gpt2",
            pre: None,
            tokens: &tokens,
            merges: &[] as &[String],
            token_types: &[1, 1, 3],
            bos: None,
            eos: 2,
            add_bos: false,
        })
        .expect("builds");
        let mut d = Detokenizer::default();
        // Before, the invalid byte flushed the incomplete "é" with it: two replacements, then a
        // third for its lone second byte.
        assert_eq!(d.push(&t, 0), "\u{FFFD}");
        assert_eq!(d.push(&t, 1), "é");
    }

    #[test]
    fn control_tokens_are_parsed_only_when_asked() {
        let t = tokenizer("smollm").expect("smollm");
        assert_eq!(
            t.encode("<|im_start|>x", true).expect("encode"),
            [1, 3 + u32::from(b'x')]
        );
        assert_eq!(
            t.encode("<|im_start|>x", false).expect("encode").len(),
            "<|im_start|>x".len()
        );
    }

    #[test]
    fn the_detokenizer_never_splits_a_character() {
        let t = tokenizer("smollm").expect("smollm");
        let ids = t.encode("é🙂", false).expect("encode");
        assert_eq!(ids.len(), 6, "one token per byte");
        let mut d = Detokenizer::default();
        let pieces: Vec<String> = ids.iter().map(|&i| d.push(&t, i)).collect();
        assert_eq!(pieces, ["", "é", "", "", "", "🙂"]);
    }

    #[test]
    fn template_pieces_split_at_their_control_tokens_and_the_cache_stays_bounded() {
        let t = tokenizer("smollm").expect("smollm");
        let piece = "\n<|im_start|>system\nx<|im_end|>\n<|im_start|>user\n";
        let want = TemplatePiece {
            head: "\n".into(),
            controlled: Some((
                t.encode("<|im_start|>system\nx<|im_end|>\n<|im_start|>", true)
                    .expect("encode"),
                "user\n".into(),
            )),
        };
        assert_eq!(*t.template_piece(piece).expect("first"), want);
        assert_eq!(*t.template_piece(piece).expect("cached"), want);
        assert_eq!(t.template_pieces.len(), 1);
        let plain = t.template_piece("no control token").expect("split");
        assert_eq!(
            (plain.head.as_str(), &plain.controlled),
            ("no control token", &None)
        );
        for i in 0..TEMPLATE_PIECES + 10 {
            let text = format!("<|im_start|>piece {i}");
            let split = t.template_piece(&text).expect("split");
            assert_eq!(split.head, "");
            assert_eq!(split.controlled, Some((vec![1], format!("piece {i}"))));
            assert!(t.template_pieces.len() <= TEMPLATE_PIECES);
        }
    }
}
