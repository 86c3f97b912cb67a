//! Bulkhead's worker: loads a GGUF model, holds the paged KV pool, runs the forward pass.

pub mod chat;
pub mod engine;
pub mod error_chain;
pub mod gguf;
pub mod kv;
pub mod loader;
pub mod model;
pub mod printable;
pub mod regular_file;
pub mod sampling;
pub mod serve;
mod text_cache;
pub mod tiny_model;
pub mod tokenizer;
mod words;
