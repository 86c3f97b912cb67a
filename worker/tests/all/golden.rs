//! Bulkhead against llama.cpp on the real model: tokens, logits and greedy outputs recorded
//! once by `scripts/golden/make_golden.py` (see `scripts/golden/README.md`).
//!
//! Stated tolerances:
//! - logits of the prompt's last position, for llama.cpp's top 40 tokens: within
//!   [`LOGIT_TOLERANCE`] (llama.cpp itself moves by up to 0.66 between batched and one-by-one
//!   prefill of the same prompt);
//! - greedy tokens: equal up to the first step where llama.cpp's top-1 margin is below
//!   [`ROBUST_MARGIN`], where the two engines' rounding may legitimately pick the other token.

use bulkhead_kvpool::Scrub;
use bulkhead_worker::chat::Message;
use serde::Deserialize;

use crate::common::{Session, fixtures_dir, real_model};

const LOGIT_TOLERANCE: f32 = 0.75;
const ROBUST_MARGIN: f32 = 1.0;

#[derive(Debug, Deserialize)]
struct Golden {
    cases: Vec<Case>,
    tokenizer_cases: Vec<TokenizerCase>,
}

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    prompt: String,
    chat: bool,
    rendered: Option<String>,
    tokens: Vec<u32>,
    prompt_logits: PromptLogits,
    greedy: Greedy,
}

#[derive(Debug, Deserialize)]
struct PromptLogits {
    top: Vec<(u32, f32)>,
}

#[derive(Debug, Deserialize)]
struct Greedy {
    tokens: Vec<u32>,
    margin: Vec<f32>,
}

#[derive(Debug, Deserialize)]
struct TokenizerCase {
    text: String,
    tokens: Vec<u32>,
    tokens_no_special: Option<Vec<u32>>,
}

fn golden() -> Golden {
    let text =
        std::fs::read_to_string(fixtures_dir().join("golden.json")).expect("read golden.json");
    serde_json::from_str(&text).expect("parse golden.json")
}

#[test]
fn the_tokenizer_matches_llama_cpp() {
    let loaded = real_model();
    for case in golden().tokenizer_cases {
        let ours = loaded.tokenizer.encode(&case.text, true).expect("encode");
        assert_eq!(ours, case.tokens, "{:?}", case.text);
        let plain = loaded.tokenizer.encode(&case.text, false).expect("encode");
        assert_eq!(
            plain,
            case.tokens_no_special.unwrap_or(case.tokens),
            "{:?} without special tokens",
            case.text
        );
        assert_eq!(
            loaded.tokenizer.decode(&plain),
            case.text,
            "decode of {:?}",
            case.text
        );
    }
}

#[test]
fn prompts_render_and_tokenize_like_llama_cpp() {
    let loaded = real_model();
    let chat = loaded.chat.as_ref().expect("the model has a chat template");
    for case in golden().cases {
        let text = if case.chat {
            let rendered = chat
                .render(&[Message::new("user", &case.prompt)], true)
                .expect("render");
            assert_eq!(Some(&rendered), case.rendered.as_ref(), "{}", case.name);
            // Contents kept apart from the template's control tokens (what serving does)
            // change nothing for honest messages.
            let apart = chat
                .encode(
                    &loaded.tokenizer,
                    &[Message::new("user", &case.prompt)],
                    true,
                )
                .expect("encode");
            assert_eq!(apart, case.tokens, "{}: contents kept apart", case.name);
            rendered
        } else {
            case.prompt.clone()
        };
        assert_eq!(
            loaded.tokenizer.encode(&text, case.chat).expect("encode"),
            case.tokens,
            "{}",
            case.name
        );
    }
}

/// A chat is tokenized as its whole rendering is (what llama.cpp and HF tokenize), also where
/// a word runs across the seam between the template and a content: contents tokenized apart
/// from the template (as they were) split the newline after a role header from the newlines a content
/// starts with, and a content's trailing spaces from the text after it.
#[test]
fn chats_tokenize_as_their_whole_rendering_across_the_seams() {
    let loaded = real_model();
    let chat = loaded.chat.as_ref().expect("the model has a chat template");
    let turns: [&[(&str, &str)]; 5] = [
        &[("user", "\n\nWhat is 2+2?")],
        &[("user", "hi   ")],
        &[("user", " leading, and trailing\n")],
        &[("system", "\tBe brief.\n\n"), ("user", "\n1234")],
        &[
            ("user", "Hi"),
            ("assistant", "\n\nHello!  \n"),
            ("user", "  again"),
        ],
    ];
    for turns in turns {
        let messages: Vec<Message> = turns.iter().map(|(r, c)| Message::new(r, c)).collect();
        let rendered = chat.render(&messages, true).expect("render");
        let whole = loaded.tokenizer.encode(&rendered, true).expect("encode");
        let served = chat
            .encode(&loaded.tokenizer, &messages, true)
            .expect("encode");
        assert_eq!(served, whole, "{turns:?}");
    }
}

#[test]
fn logits_and_greedy_tokens_match_llama_cpp() {
    let loaded = real_model();
    let mut worst = 0.0f32;
    for case in golden().cases {
        let total = case.tokens.len() + case.greedy.tokens.len();
        let mut s = Session::new(&loaded.model, (total as u32).div_ceil(16), Scrub::None);
        let alloc = s.allocate(1, total);
        let mut logits = s.run(alloc.pages(), 0, &case.tokens).expect("prefill");
        for &(id, want) in &case.prompt_logits.top {
            let diff = (logits[id as usize] - want).abs();
            worst = worst.max(diff);
            assert!(
                diff <= LOGIT_TOLERANCE,
                "{}: logit of token {id}: ours {} llama.cpp {want}",
                case.name,
                logits[id as usize]
            );
        }
        for (step, (&want, &margin)) in case
            .greedy
            .tokens
            .iter()
            .zip(&case.greedy.margin)
            .enumerate()
        {
            if margin < ROBUST_MARGIN {
                break;
            }
            let got = bulkhead_worker::sampling::argmax(&logits);
            assert_eq!(
                got, want,
                "{}: greedy step {step} (llama.cpp margin {margin})",
                case.name
            );
            logits = s
                .run(alloc.pages(), case.tokens.len() + step, &[got])
                .expect("decode");
        }
    }
    eprintln!("largest logit difference from llama.cpp: {worst}");
}
