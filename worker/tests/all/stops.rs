//! Stop strings end an answer where they match and change nothing else: text held back while
//! it could begin a stop string is the answer's when the model ends it (end of sequence, or
//! the length limit) without a match.

use std::sync::mpsc;

use bulkhead_worker::chat::Message;
use bulkhead_worker::engine::{EngineConfig, FinishReason};

use crate::common::{Outcome, collect, engine, real_model_owned, request};

/// The greedy answer to "What is 2+2?" with `stop`, at most `max_new` tokens.
fn answer(stop: &[String], max_new: usize) -> Outcome {
    let loaded = real_model_owned();
    let chat = loaded.chat.as_ref().expect("the model has a chat template");
    let prompt = chat
        .encode(
            &loaded.tokenizer,
            &[Message::new("user", "What is 2+2?")],
            true,
        )
        .expect("encode");
    let mut e = engine(loaded, EngineConfig::default());
    let (tx, rx) = mpsc::channel();
    let mut r = request(1, &prompt, max_new, tx);
    r.stop = stop.to_vec();
    e.submit(r).map_err(|(e, _)| e).expect("admitted");
    while e.has_work() {
        e.step();
    }
    collect(rx)
}

#[test]
fn a_stop_string_that_never_matches_changes_no_answer() {
    let plain = answer(&[], 256);
    assert!(
        plain.tokens.len() < 256 && plain.finish == Some(Ok(FinishReason::Stop)),
        "the model ends its answer itself: {plain:?}"
    );
    let last = plain.text.chars().last().expect("an answer");
    // Its last character begins the stop string, which never comes: held back, then the
    // answer's at the end of sequence (before, it was dropped).
    let stopped = answer(&[format!("{last}\u{1}")], 256);
    assert_eq!(stopped.text, plain.text, "{stopped:?}");
    assert_eq!(stopped.finish, plain.finish);
    // The same at the length limit.
    let cut = plain.tokens.len() - 1;
    let shorter = answer(&[], cut);
    let last = shorter.text.chars().last().expect("an answer");
    let stopped = answer(&[format!("{last}\u{1}")], cut);
    assert_eq!(stopped.text, shorter.text, "{stopped:?}");
    assert_eq!(stopped.finish, Some(Ok(FinishReason::Length)));
}
