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
}

/// Learns a byte-level BPE of `vocab_size` ids from the documents of `inputs` (read as
/// `prepare` reads them, all held in memory: train on a sample of a large corpus) and
/// writes it to `out`.
pub fn train(inputs: &[PathBuf], reading: &Reading, vocab_size: usize, out: &Path) -> Result<Trained, PrepareError> {
    if vocab_size < 257 + 1 {
        return Err(PrepareError::Option {
            option: "--vocab-size",
            value: vocab_size.to_string(),
            reason: "must be above 257 (256 bytes and the end-of-text token come first; merges add the rest)".into(),
        });
    }
    let files = input::list(inputs)?;
    let mut documents = Vec::new();
    let read = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    for file in &files {
        input::documents(&file.path, reading, read.clone(), &mut |doc| {
            if let Some(text) = input::utf8(&doc.bytes, reading.invalid, &doc.path, doc.offset, doc.line)?
                && !text.is_empty()
            {
                documents.push(text.into_owned());
            }
            Ok(())
        })?;
    }
    if documents.is_empty() {
        return Err(PrepareError::EmptyInput { inputs: inputs.to_vec(), what: "document" });
    }
    let bytes = documents.iter().map(|d| d.len() as u64).sum();
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
    let count = documents.len() as u64;
    tokenizer.train(&mut trainer, documents.into_iter()).map_err(|e| failed(e.to_string()))?;
    tokenizer.save(out, true).map_err(|e| PrepareError::Tokenizer(format!("cannot write {}: {e}", out.display())))?;
    Ok(Trained { vocab_size: tokenizer.get_vocab_size(true), documents: count, bytes })
}
