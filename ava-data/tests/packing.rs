//! `data.packing: document`: a batch from a prepared corpus says where its documents start
//! (segment ids and positions per input token), checked against the end-of-text ids the
//! corpus puts after every document, across shard boundaries, shuffled epochs, validation,
//! mixtures and loader workers; and sources without documents refuse it.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ava_data::prepare::{self, Invalid, PrepareOptions, Reading, Silent};
use ava_data::{Batch, DataOptions, Dataset, Loader, MarkovSpec, Packing, Source, Split, open};

/// The byte tokenizer's end-of-text id.
const EOS: u32 = 256;

/// Prepares `n` documents of varied lengths (a few to a few hundred bytes, so a sequence
/// holds several and some span sequences) into small shards; returns the corpus directory.
fn corpus(root: &Path, name: &str, n: usize, salt: usize) -> PathBuf {
    let input = root.join(format!("{name}-in"));
    fs::create_dir_all(&input).unwrap();
    for i in 0..n {
        let len = 3 + (i * 53 + salt * 7) % 240;
        let text: String = (0..len).map(|j| char::from(b'a' + ((i + j * 7 + salt) % 26) as u8)).collect();
        fs::write(input.join(format!("doc-{i:04}.txt")), text).unwrap();
    }
    let out = root.join(name);
    let options = PrepareOptions {
        inputs: vec![input],
        out: out.clone(),
        tokenizer: None,
        eos: None,
        bos: None,
        reading: Reading { separator: None, field: "text".into(), invalid: Invalid::Error },
        val_fraction: 0.2,
        shard_tokens: 3000,
        force: false,
    };
    let summary = prepare::prepare(&options, &mut Silent).unwrap();
    assert!(summary.manifest.shards.len() >= 4, "several shards, so sequences cross shard ends");
    out
}

fn options(source: Source, seq_len: usize, packing: Packing) -> DataOptions {
    DataOptions { source, seq_len, val_fraction: 0.1, seed: 11, packing }
}

/// The segment ids a row must have: a new document after every end-of-text input token.
fn expected_segments(row: &[u32], seq_len: usize) -> Vec<u32> {
    let mut id = 0;
    (0..seq_len)
        .map(|t| {
            if t > 0 && row[t - 1] == EOS {
                id += 1;
            }
            id
        })
        .collect()
}

/// Every row of `batch`: its segments follow its end-of-text ids, and its positions count
/// up from 0 at each document start (and at the row's first token).
fn check_batch(batch: &Batch) -> usize {
    let t = batch.seq_len;
    let segments = batch.segments.as_ref().expect("packed batches carry segment ids");
    let positions = batch.positions().expect("and positions");
    assert_eq!((segments.len(), positions.len()), (batch.batch_size * t, batch.batch_size * t));
    let mut boundaries = 0;
    for b in 0..batch.batch_size {
        let row = batch.row(b);
        let want = expected_segments(row, t);
        assert_eq!(&segments[b * t..][..t], &want[..], "batch {} row {b}: {row:?}", batch.index);
        for i in 0..t {
            let p = positions[b * t + i];
            let expected = if i == 0 || want[i] != want[i - 1] { 0 } else { positions[b * t + i - 1] + 1 };
            assert_eq!(p, expected, "batch {} row {b} position {i}", batch.index);
        }
        boundaries += *want.last().unwrap() as usize;
    }
    boundaries
}

#[test]
fn packed_batches_mark_every_document_start() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = corpus(tmp.path(), "c", 120, 0);
    let t = 96;
    let packed = open(&options(Source::Shards { dir: dir.clone(), tokenizer: None }, t, Packing::Document)).unwrap();
    let plain = open(&options(Source::Shards { dir, tokenizer: None }, t, Packing::Concat)).unwrap();
    assert!(packed.packs_documents() && !plain.packs_documents());
    let mut boundaries = 0;
    // Shuffled training batches across more than one epoch, and validation in order.
    for (split, batches) in [(Split::Train, 40), (Split::Validation, 6)] {
        for k in 0..batches {
            let batch = Batch::build(&*packed, split, k, 4, t);
            // The same tokens as without packing: packing only adds where documents start.
            let same = Batch::build(&*plain, split, k, 4, t);
            assert_eq!(batch.tokens, same.tokens);
            assert!(same.segments.is_none() && same.positions().is_none());
            boundaries += check_batch(&batch);
        }
    }
    assert!(boundaries > 100, "the rows hold many documents ({boundaries} starts)");
}

#[test]
fn a_mixture_packs_documents_of_every_corpus() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (corpus(tmp.path(), "a", 80, 1), corpus(tmp.path(), "b", 80, 5));
    let source = Source::Mix { corpora: vec![(a, 0.7), (b, 0.3)], tokenizer: None };
    let mixture = open(&options(source, 64, Packing::Document)).unwrap();
    assert!(mixture.packs_documents());
    for k in 0..30 {
        check_batch(&Batch::build(&*mixture, Split::Train, k, 3, 64));
    }
}

/// Workers build the same packed batches as the consumer would, and a loader started at
/// batch k (a resume) continues with the same batches.
#[test]
fn packed_batches_do_not_depend_on_workers_or_the_start() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = corpus(tmp.path(), "c", 100, 2);
    let dataset: Arc<dyn Dataset> =
        open(&options(Source::Shards { dir, tokenizer: None }, 48, Packing::Document)).unwrap();
    let take = |workers, start, n| {
        let mut loader = Loader::new(dataset.clone(), Split::Train, 3, 48, start, workers, 2).unwrap();
        (0..n).map(|_| loader.next().unwrap()).collect::<Vec<_>>()
    };
    let synchronous = take(0, 0, 12);
    assert_eq!(take(2, 0, 12), synchronous);
    assert_eq!(take(3, 5, 7), synchronous[5..]);
    let loader = Loader::new(dataset.clone(), Split::Train, 3, 48, 0, 2, 2).unwrap();
    assert_eq!(loader.capacity_bytes(), 2 * 2 * 3 * (48 + 1 + 48) * 4, "segment ids are counted");
    assert_eq!(synchronous[0].size_bytes(), 3 * (49 + 48) * 4);
}

#[test]
fn sources_without_documents_refuse_packing() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("t.txt");
    fs::write(&text, "some text ".repeat(100)).unwrap();
    for (source, name) in [
        (Source::Synthetic(MarkovSpec::default()), "synthetic"),
        (Source::Text { path: text, tokenizer: None }, "text"),
    ] {
        let err = open(&options(source, 16, Packing::Document)).err().expect("refused").to_string();
        assert_eq!(
            err,
            format!(
                "data.packing = document: needs document boundaries, and data.source: {name} has none; prepare the \
                 corpus with `ava data prepare` and train on it with data.source: shards (or data.mix), or set \
                 data.packing: concat"
            )
        );
    }
}
