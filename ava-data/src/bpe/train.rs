//! Training a byte-level BPE tokenizer (GPT-2's scheme: bytes mapped to printable
//! characters, merges learned from the text, `<|endoftext|>` as the one special token) with
//! the `tokenizers` crate, and saving it as a Hugging Face `tokenizer.json` that `ava data
//! prepare --tokenizer` and `data.tokenizer` read.

use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, DecoderWrapper, TokenizerBuilder};

use crate::prepare::PrepareError;
use crate::prepare::input::{self, Reading};
use crate::tokenizer_check::MAX_VOCAB;

/// The end-of-text token the trained tokenizer has (id 0).
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// What [`train`] made.
#[derive(Debug, Clone)]
pub struct Trained {
    /// The vocabulary's size (special token, 256 bytes, merges).
    pub vocab_size: usize,
    /// Documents it learned from.
    pub documents: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Whether the inputs went on past `max_bytes` (what came after was not read).
    pub truncated: bool,
}

/// Learns a byte-level BPE of `vocab_size` ids from the documents of `inputs` (read as
/// `prepare` reads them, in order, until `max_bytes` of text are held in memory, the last
/// document cut there: a large corpus or an endless stream of documents trains on its
/// beginning; each document is read whole first, as `prepare` bounds it) and writes it to
/// `out`.
pub fn train(
    inputs: &[PathBuf],
    reading: &Reading,
    vocab_size: usize,
    max_bytes: u64,
    out: &Path,
) -> Result<Trained, PrepareError> {
    if vocab_size < 257 + 1 || vocab_size as u64 > MAX_VOCAB {
        return Err(PrepareError::Option {
            option: "--vocab-size",
            value: vocab_size.to_string(),
            reason: format!(
                "must be above 257 (256 bytes and the end-of-text token come first; merges add the rest) and at most \
                 {MAX_VOCAB} (the most ids a tokenizer may have: Ava refuses to load one with more)"
            ),
        });
    }
    let files = input::list(inputs)?;
    // Every document's text in one buffer, and where each ends: a stream of short documents
    // costs 8 bytes each beside its text, not a String's 24 and an allocation.
    let (mut text_all, mut ends) = (String::new(), Vec::<usize>::new());
    let mut truncated = false;
    let read = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    for file in &files {
        let outcome = input::documents(&file.path, reading, read.clone(), &mut |doc| {
            if let Some(text) = input::utf8(&doc.bytes, reading.invalid, &doc.path, doc.offset, doc.line)?
                && !text.is_empty()
            {
                let room = (max_bytes - text_all.len() as u64).min(usize::MAX as u64) as usize;
                if text.len() > room {
                    // The part that fits, cut where a character starts; then no more.
                    let end = (0..=room).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
                    if end > 0 {
                        text_all.push_str(&text[..end]);
                        ends.push(text_all.len());
                    }
                    truncated = true;
                    return Err(PrepareError::Stopped);
                }
                text_all.push_str(&text);
                ends.push(text_all.len());
            }
            Ok(())
        });
        match outcome {
            Err(PrepareError::Stopped) => break,
            other => other?,
        }
    }
    if ends.is_empty() {
        return Err(PrepareError::EmptyInput { inputs: inputs.to_vec(), what: "document" });
    }
    let bytes = text_all.len() as u64;
    let failed = |message: String| PrepareError::Tokenizer(format!("training the tokenizer failed: {message}"));
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tokenizer =
        TokenizerBuilder::<BPE, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper>::new()
            .with_model(BPE::default())
            .with_normalizer(None)
            .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
            .with_post_processor(Some(ByteLevel::new(false, true, true).into()))
            .with_decoder(Some(ByteLevel::new(false, true, true).into()))
            .build()
            .map_err(|e| failed(e.to_string()))?;
    let count = ends.len() as u64;
    let documents = ends.iter().scan(0, |start, &end| Some(&text_all[std::mem::replace(start, end)..end]));
    tokenizer.train(&mut trainer, documents).map_err(|e| failed(e.to_string()))?;
    tokenizer.save(out, true).map_err(|e| PrepareError::Tokenizer(format!("cannot write {}: {e}", out.display())))?;
    Ok(Trained { vocab_size: tokenizer.get_vocab_size(true), documents: count, bytes, truncated })
}
