//! Byte-level BPE, GPT-2's scheme: [`train`] learns one with the `tokenizers` crate and saves
//! it as a Hugging Face `tokenizer.json`; [`ByteLevelBpe`] is our own encoder for such files,
//! giving the `tokenizers` crate's ids faster, and says which files it cannot reproduce so
//! that the caller uses the crate for those.
//!
//! Files: `train` (learning a tokenizer), `encode` (the encoder), `load` (which tokenizer.json
//! files it reproduces exactly, and reading them), `added` (finding added tokens such as
//! `<|endoftext|>` in text), `pretokenize` (GPT-2's split into pre-tokens, and the Unicode
//! classes it uses), `merge` (a pre-token's merges), `cache` (the per-thread pre-token cache).

mod added;
mod cache;
mod encode;
mod load;
mod merge;
mod pretokenize;
mod train;

pub use encode::ByteLevelBpe;
pub use load::Unsupported;
pub(crate) use load::byte_chars;
pub use train::{END_OF_TEXT, Trained, train};
