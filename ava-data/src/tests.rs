//! Tests of the data pipeline: the RNG, the synthetic source's entropy floor, text splits and
//! windows, the tokenizer, error messages, the loader's determinism, backpressure and
//! shutdown, and the full disk that `prepare`'s test hook simulates.

use std::fs;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::*;

// ---------- rng ----------

#[test]
fn xoshiro_and_splitmix_match_reference_outputs() {
    // Reference xoshiro256** outputs for the state {1, 2, 3, 4}.
    let mut rng = Rng::from_state([1, 2, 3, 4]);
    let got: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
    assert_eq!(got, [11520, 0, 1509978240, 1215971899390074240]);
    // Reference SplitMix64 first output for seed 0.
    assert_eq!(splitmix64(&mut 0), 0xE220_A839_7B1D_CDAF);
}

#[test]
fn rng_state_round_trips_and_ranges_hold() {
    let mut a = Rng::new(42);
    a.next_u64();
    let mut b = Rng::from_state(a.state());
    assert_eq!((0..10).map(|_| a.next_u64()).collect::<Vec<_>>(), (0..10).map(|_| b.next_u64()).collect::<Vec<_>>());
    assert_ne!(Rng::from_state([0; 4]).next_u64(), 0, "the all-zero state must not get stuck");

    let mut rng = Rng::new(1);
    let mut counts = [0usize; 7];
    for _ in 0..70_000 {
        let x = rng.next_f64();
        assert!((0.0..1.0).contains(&x));
        counts[rng.below(7) as usize] += 1;
    }
    // Each bucket expects 10000; 5 sigma is about 450.
    assert!(counts.iter().all(|&c| c.abs_diff(10_000) < 450), "{counts:?}");
    assert_eq!(rng.below(1), 0);
}

#[test]
fn streams_are_distinct() {
    let first = |seed, stream, index| Rng::stream(seed, stream, index).next_u64();
    assert_eq!(first(1, 2, 3), first(1, 2, 3));
    assert_ne!(first(1, 2, 3), first(1, 2, 4));
    assert_ne!(first(1, 2, 3), first(1, 3, 3));
    assert_ne!(first(1, 2, 3), first(2, 2, 3));
    assert_ne!(hash64(1, 2), hash64(2, 1));
}

// ---------- synthetic ----------

fn markov(alphabet: usize, order: usize, branching: usize, seed: u64, sample_seed: u64) -> SyntheticDataset {
    SyntheticDataset::new(&MarkovSpec { alphabet, order, branching, seed }, sample_seed).unwrap()
}

#[test]
fn entropy_floor_matches_an_independent_computation() {
    // Geometric weights 8:4:2:1 over 15: H = ln 15 - (8 ln 8 + 4 ln 4 + 2 ln 2) / 15 = ln 15 - 34/15 ln 2.
    let expected = 15f64.ln() - 34.0 / 15.0 * 2f64.ln();
    let data = markov(16, 2, 4, 0, 0);
    assert!((data.entropy_floor_nats() - expected).abs() < 1e-12, "{} vs {expected}", data.entropy_floor_nats());
    assert_eq!(Dataset::entropy_floor_nats(&data), Some(data.entropy_floor_nats()));
    // One branch: deterministic, zero entropy; two branches: weights 2:1.
    assert_eq!(markov(5, 1, 1, 0, 0).entropy_floor_nats(), 0.0);
    let p2: [f64; 2] = [2.0 / 3.0, 1.0 / 3.0];
    let h2: f64 = -p2.iter().map(|p| p * p.ln()).sum::<f64>();
    assert!((markov(3, 3, 2, 9, 0).entropy_floor_nats() - h2).abs() < 1e-12);
}

#[test]
fn every_context_is_a_permutation_of_p_over_distinct_symbols() {
    let data = markov(6, 2, 3, 5, 0);
    let p = data.probabilities().to_vec();
    let symbols = data.symbols().to_vec();
    for a in &symbols {
        for b in &symbols {
            let prefix = [u32::from(START), u32::from(*a), u32::from(*b)];
            let dist = data.next_token_probabilities(&prefix).unwrap();
            let mut probs: Vec<f64> = dist.iter().map(|d| d.1).collect();
            probs.sort_by(|x, y| y.total_cmp(x));
            assert_eq!(probs, p);
            let mut next: Vec<u32> = dist.iter().map(|d| d.0).collect();
            next.sort();
            next.dedup();
            assert_eq!(next.len(), 3, "branches must be distinct symbols");
        }
    }
}

#[test]
fn empirical_nll_of_targets_matches_the_floor() {
    for (alphabet, order, branching) in [(16, 2, 4), (8, 3, 5), (4, 0, 3)] {
        let data = markov(alphabet, order, branching, 11, 3);
        let symbols: Vec<u32> = data.symbols().iter().map(|&b| u32::from(b)).collect();
        let (mut nll, mut count) = (0.0, 0usize);
        for index in 0..400 {
            let seq = data.sequence(Split::Train, index, 256);
            assert_eq!(seq.len(), 257);
            assert_eq!(seq[0], u32::from(START));
            for t in 1..seq.len() {
                assert!(symbols.contains(&seq[t]), "target {} is not an alphabet symbol", seq[t]);
                let dist = data.next_token_probabilities(&seq[..t]).unwrap();
                let p = dist.iter().find(|d| d.0 == seq[t]).map_or(0.0, |d| d.1);
                assert!(p > 0.0, "target {} has probability 0 after {:?}", seq[t], &seq[..t]);
                nll -= p.ln();
                count += 1;
            }
        }
        let mean = nll / count as f64;
        let floor = data.entropy_floor_nats();
        assert!((mean - floor).abs() < 0.01 * floor, "({alphabet},{order},{branching}): {mean} vs floor {floor}");
    }
}

#[test]
fn first_targets_alone_also_have_the_floor_entropy() {
    // The first target is drawn from the start context like any other target.
    let data = markov(16, 2, 4, 2, 8);
    let n = 20_000;
    let mut nll = 0.0;
    for index in 0..n {
        let seq = data.sequence(Split::Validation, index, 1);
        let dist = data.next_token_probabilities(&seq[..1]).unwrap();
        nll -= dist.iter().find(|d| d.0 == seq[1]).unwrap().1.ln();
    }
    let mean = nll / n as f64;
    assert!((mean - data.entropy_floor_nats()).abs() < 0.02 * data.entropy_floor_nats(), "{mean}");
}

#[test]
fn synthetic_sequences_are_deterministic_per_seed() {
    let a = markov(16, 2, 4, 1, 1);
    let clone = a.clone();
    assert_eq!(a.sequence(Split::Train, 5, 64), markov(16, 2, 4, 1, 1).sequence(Split::Train, 5, 64));
    assert_eq!(a.sequence(Split::Train, 5, 64), clone.sequence(Split::Train, 5, 64));
    assert_ne!(a.sequence(Split::Train, 5, 64), a.sequence(Split::Train, 6, 64));
    assert_ne!(a.sequence(Split::Train, 5, 64), a.sequence(Split::Validation, 5, 64));
    assert_ne!(a.sequence(Split::Train, 5, 64), markov(16, 2, 4, 1, 2).sequence(Split::Train, 5, 64), "sample seed");
    assert_ne!(a.sequence(Split::Train, 5, 64), markov(16, 2, 4, 2, 1).sequence(Split::Train, 5, 64), "table seed");
    // A shorter sequence is a prefix of a longer one.
    assert_eq!(a.sequence(Split::Train, 5, 10)[..], a.sequence(Split::Train, 5, 64)[..11]);
}

#[test]
fn synthetic_spec_errors_name_the_key() {
    let err = |alphabet, order, branching| {
        SyntheticDataset::new(&MarkovSpec { alphabet, order, branching, seed: 0 }, 0).unwrap_err().to_string()
    };
    assert_eq!(
        err(256, 1, 2),
        "data.synthetic.alphabet = 256: must be between 1 and 255 (the symbols and the start byte share the 256 \
         byte tokens)"
    );
    assert_eq!(err(4, 1, 5), "data.synthetic.branching = 5: must be between 1 and data.synthetic.alphabet (4)");
    assert_eq!(err(4, 1, 0), "data.synthetic.branching = 0: must be between 1 and data.synthetic.alphabet (4)");
    assert!(err(2, 21, 2).starts_with("data.synthetic.order = 21: alphabet^order contexts must be at most 1048576"));
    assert!(err(200, 99, 2).starts_with("data.synthetic.order = 99:"));
    assert!(markov(2, 20, 2, 0, 0).sequence(Split::Train, 0, 5).len() == 6, "2^20 contexts are allowed");
}

#[test]
fn large_alphabets_skip_the_start_byte() {
    let data = markov(255, 1, 255, 0, 0);
    let mut symbols = data.symbols().to_vec();
    assert_eq!(symbols[..3], *b"abc");
    assert!(!symbols.contains(&START));
    symbols.sort();
    symbols.dedup();
    assert_eq!(symbols.len(), 255);
}

// ---------- text ----------

fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.path().join(name);
    fs::write(&path, bytes).unwrap();
    path
}

fn text_options(path: &Path, tokenizer: Option<&Path>, seq_len: usize, val_fraction: f64) -> DataOptions {
    DataOptions {
        source: Source::Text { path: path.to_path_buf(), tokenizer: tokenizer.map(Path::to_path_buf) },
        seq_len,
        val_fraction,
        seed: 3,
        packing: Packing::Concat,
    }
}

#[test]
fn byte_windows_come_from_their_split_and_cover_it() {
    let dir = tempfile::tempdir().unwrap();
    // Byte k is k, so every token names its own offset.
    let bytes: Vec<u8> = (0..200u8).collect();
    let path = write(&dir, "bytes.bin", &bytes);
    let data = TextDataset::open(&path, None, 8, 0.1, 3).unwrap();
    assert_eq!((data.vocab_size(), data.len()), (256, 200));
    assert_eq!((data.split_range(Split::Train), data.split_range(Split::Validation)), (0..180, 180..200));
    for (split, lo, hi) in [(Split::Train, 0u32, 171u32), (Split::Validation, 180, 191)] {
        let (mut min, mut max) = (u32::MAX, 0);
        for index in 0..3000 {
            let seq = data.sequence(split, index, 8);
            assert_eq!(seq.len(), 9);
            let start = seq[0];
            assert!(seq.iter().enumerate().all(|(j, &t)| t == start + j as u32), "not a window: {seq:?}");
            assert!((lo..=hi).contains(&start), "{split} window at {start} is outside [{lo}, {hi}]");
            assert_eq!(start as usize, data.window_start(split, index, 8));
            (min, max) = (min.min(start), max.max(start));
        }
        assert_eq!((min, max), (lo, hi), "{split} windows must reach both ends of the split");
    }
    assert_eq!(data.sequence(Split::Train, 7, 8), data.sequence(Split::Train, 7, 8));
    assert_eq!(data.max_seq_len(Split::Validation), Some(19));
    assert!(data.describe().contains("200 tokens, byte-level (vocab 256); 180 train / 20 validation tokens"));
}

#[test]
fn validation_and_training_windows_never_overlap() {
    let dir = tempfile::tempdir().unwrap();
    let text: Vec<u8> = b"abcdefghijklmnopqrstuvwxyz".iter().cycle().take(1000).copied().collect();
    let path = write(&dir, "abc.txt", &text);
    let data = TextDataset::open(&path, None, 16, 0.25, 0).unwrap();
    let val = data.split_range(Split::Validation);
    for index in 0..500 {
        let t = data.window_start(Split::Train, index, 16);
        assert!(t + 17 <= val.start);
        let v = data.window_start(Split::Validation, index, 16);
        assert!(v >= val.start && v + 17 <= val.end);
        assert_eq!(
            data.sequence(Split::Validation, index, 16),
            text[v..v + 17].iter().map(|&b| u32::from(b)).collect::<Vec<_>>()
        );
    }
}

const WORD_LEVEL: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 6, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5}, "unk_token": "[UNK]"}
}"#;

#[test]
fn tokenizer_json_encodes_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = write(&dir, "tokenizer.json", WORD_LEVEL.as_bytes());
    let line = "the cat sat on the mat <|end|>\nthe dog sat\n";
    let path = write(&dir, "words.txt", line.repeat(10).as_bytes());
    let data = open(&text_options(&path, Some(&tokenizer), 4, 0.2)).unwrap();
    assert_eq!(data.vocab_size(), 7, "6 words plus the added <|end|>");
    let expected: Vec<u32> = [1, 2, 3, 4, 1, 5, 6, 1, 0, 3].repeat(10);
    // 100 tokens: 80 train, 20 validation; every window is a slice of the expected stream.
    let text = TextDataset::open(&path, Some(&tokenizer), 4, 0.2, 3).unwrap();
    assert_eq!((text.len(), text.split_range(Split::Validation)), (100, 80..100));
    for index in 0..50 {
        let start = text.window_start(Split::Validation, index, 4);
        assert_eq!(text.sequence(Split::Validation, index, 4), expected[start..start + 5]);
        assert_eq!(data.sequence(Split::Validation, index, 4), expected[start..start + 5]);
    }
    assert!(data.describe().contains("tokenizer.json (vocab 7)"), "{}", data.describe());
    assert_eq!(data.entropy_floor_nats(), None);
}

/// Error text with the temp dir replaced by `<dir>`.
fn error_text(options: &DataOptions, dir: &Path) -> String {
    open(options).err().expect("must fail").to_string().replace(&dir.display().to_string(), "<dir>")
}

#[test]
fn text_errors_say_what_where_and_how_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.txt");
    assert_eq!(
        error_text(&text_options(&missing, None, 8, 0.1), dir.path()),
        "data file <dir>/nope.txt does not exist; set data.path to an existing file"
    );
    let short = write(&dir, "short.txt", &[b'x'; 50]);
    assert_eq!(
        error_text(&text_options(&short, None, 8, 0.1), dir.path()),
        "data file <dir>/short.txt has 50 tokens; its validation split (the last 10%) has 5, but a sequence needs \
         data.seq_len + 1 = 9: use a longer file, a smaller data.seq_len, or another data.val_fraction"
    );
    assert_eq!(
        error_text(&text_options(&short, None, 30, 0.5), dir.path()),
        "data file <dir>/short.txt has 50 tokens; its train split (the first 50%) has 25, but a sequence needs \
         data.seq_len + 1 = 31: use a longer file, a smaller data.seq_len, or another data.val_fraction"
    );
    assert_eq!(
        error_text(&text_options(&short, None, 8, 1.0), dir.path()),
        "data.val_fraction = 1: must be strictly between 0 and 1 (the share of the file held out for validation)"
    );
    let bad = write(&dir, "tokenizer.json", b"{\"model\": 3}");
    let text = error_text(&text_options(&short, Some(&bad), 8, 0.1), dir.path());
    assert!(text.starts_with("cannot load tokenizer <dir>/tokenizer.json: "), "{text}");
    assert!(text.ends_with("; data.tokenizer must be a Hugging Face tokenizer.json (as written by `Tokenizer::save` / `save_pretrained`)"), "{text}");
    assert!(text.len() > 150, "the tokenizers error text must be included: {text}");
    assert_eq!(
        error_text(&text_options(&short, Some(&dir.path().join("tok.json")), 8, 0.1), dir.path()),
        "tokenizer file <dir>/tok.json does not exist; set data.tokenizer to a Hugging Face tokenizer.json, or \
         unset it to train on raw bytes"
    );
    let good = write(&dir, "good.json", WORD_LEVEL.as_bytes());
    let binary = write(&dir, "binary.bin", &[b'a', b'b', 0xFF, b'c']);
    assert_eq!(
        error_text(&text_options(&binary, Some(&good), 1, 0.5), dir.path()),
        "data file <dir>/binary.bin is not UTF-8 text (invalid byte at offset 2); a tokenizer needs text: convert \
         the file, or unset data.tokenizer to train on its raw bytes"
    );
    assert_eq!(
        error_text(&DataOptions { seq_len: 0, ..text_options(&short, None, 8, 0.1) }, dir.path()),
        "data.seq_len = 0: must be at least 1"
    );
}

#[test]
fn a_directory_is_unreadable() {
    let dir = tempfile::tempdir().unwrap();
    let text = error_text(&text_options(dir.path(), None, 8, 0.1), dir.path());
    assert!(text.starts_with("cannot read data file <dir>: "), "{text}");
    assert!(text.ends_with("; check that data.path names a readable file"), "{text}");
}

// ---------- loader ----------

fn synthetic() -> Arc<dyn Dataset> {
    open(&DataOptions {
        source: Source::Synthetic(MarkovSpec::default()),
        seq_len: 16,
        val_fraction: 0.1,
        seed: 4,
        packing: Packing::Concat,
    })
    .unwrap()
}

fn batches(loader: &mut Loader, n: usize) -> Vec<Batch> {
    (0..n).map(|_| loader.next().unwrap()).collect()
}

#[test]
fn batches_are_identical_for_any_worker_count() {
    let data = synthetic();
    let reference = batches(&mut Loader::new(data.clone(), Split::Train, 3, 16, 0, 0, 0).unwrap(), 40);
    for (i, b) in reference.iter().enumerate() {
        assert_eq!((b.index, b.batch_size, b.seq_len, b.tokens.len()), (i as u64, 3, 16, 3 * 17));
        assert_eq!(b.row(1), &data.sequence(Split::Train, 3 * i as u64 + 1, 16)[..]);
    }
    assert_ne!(reference[0], reference[1]);
    for (workers, prefetch) in [(1, 1), (1, 4), (3, 1), (3, 2), (4, 3)] {
        let mut loader = Loader::new(data.clone(), Split::Train, 3, 16, 0, workers, prefetch).unwrap();
        assert_eq!(batches(&mut loader, 40), reference, "{workers} workers, prefetch {prefetch}");
        assert_eq!(loader.position(), 40);
    }
    let val = batches(&mut Loader::new(data, Split::Validation, 3, 16, 0, 2, 2).unwrap(), 2);
    assert_ne!(val[0].tokens, reference[0].tokens);
}

#[test]
fn starting_at_batch_k_gives_the_tail() {
    let data = synthetic();
    let all = batches(&mut Loader::new(data.clone(), Split::Train, 2, 16, 0, 0, 0).unwrap(), 30);
    for workers in [0, 1, 3] {
        let mut loader = Loader::new(data.clone(), Split::Train, 2, 16, 7, workers, 2).unwrap();
        assert_eq!(loader.position(), 7);
        assert_eq!(batches(&mut loader, 23), all[7..], "{workers} workers");
        assert_eq!(loader.position(), 30);
    }
}

#[test]
fn inputs_and_targets_are_shifted_rows() {
    let batch = Batch { index: 0, batch_size: 2, seq_len: 3, tokens: vec![1, 2, 3, 4, 5, 6, 7, 8], segments: None };
    assert_eq!(batch.inputs(), [1, 2, 3, 5, 6, 7]);
    assert_eq!(batch.targets(), [2, 3, 4, 6, 7, 8]);
    assert_eq!((batch.row(1), batch.size_bytes()), (&[5, 6, 7, 8][..], 32));
}

/// Waits until `cond` holds (or fails after 10 s).
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn queue_is_bounded_by_capacity_and_empties_on_drop() {
    let data = synthetic();
    let mut loader = Loader::new(data.clone(), Split::Train, 4, 16, 0, 3, 2).unwrap();
    let batch_bytes = 4 * 17 * 4;
    assert_eq!(loader.capacity_bytes(), 3 * 2 * batch_bytes);
    assert_eq!(Loader::new(data, Split::Train, 4, 16, 0, 0, 5).unwrap().capacity_bytes(), 0);
    let handle = loader.queued_bytes_handle();
    for _ in 0..20 {
        eventually("a full queue", || loader.queued_bytes() >= loader.capacity_bytes());
        // Full means full: the workers wait instead of building more.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(loader.queued_bytes(), loader.capacity_bytes());
        let before = loader.queued_bytes();
        loader.next().unwrap();
        assert!(loader.queued_bytes() <= loader.capacity_bytes());
        assert!(loader.queued_bytes() >= before - batch_bytes);
    }
    drop(loader);
    assert_eq!(handle.load(Ordering::SeqCst), 0, "a dropped loader holds no batches");
}

/// A dataset whose sequences take a while, to keep workers busy or blocked.
struct Slow {
    built: AtomicUsize,
    panic_at: Option<u64>,
}

impl Dataset for Slow {
    fn vocab_size(&self) -> usize {
        256
    }
    fn sequence(&self, _split: Split, index: u64, seq_len: usize) -> Vec<u32> {
        if self.panic_at == Some(index) {
            panic!("sequence {index} is broken");
        }
        std::thread::sleep(Duration::from_millis(5));
        self.built.fetch_add(1, Ordering::SeqCst);
        vec![index as u32; seq_len + 1]
    }
    fn entropy_floor_nats(&self) -> Option<f64> {
        None
    }
    fn describe(&self) -> String {
        "slow".into()
    }
}

#[test]
fn dropping_a_loader_with_a_full_queue_returns_promptly() {
    let slow = Arc::new(Slow { built: AtomicUsize::new(0), panic_at: None });
    let loader = Loader::new(slow.clone(), Split::Train, 2, 4, 0, 4, 2).unwrap();
    eventually("a full queue", || loader.queued_bytes() >= loader.capacity_bytes());
    let built = slow.built.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(slow.built.load(Ordering::SeqCst), built, "workers must block on a full queue");
    let start = Instant::now();
    drop(loader);
    assert!(start.elapsed() < Duration::from_secs(1), "drop took {:?}", start.elapsed());
    // Also while workers are mid-batch.
    let loader = Loader::new(slow, Split::Train, 8, 4, 0, 3, 4).unwrap();
    std::thread::sleep(Duration::from_millis(10));
    let start = Instant::now();
    drop(loader);
    assert!(start.elapsed() < Duration::from_secs(1), "drop took {:?}", start.elapsed());
}

#[test]
fn a_worker_panic_is_an_error_not_a_hang() {
    for workers in [0, 1, 3] {
        // Sequence 9 is row 1 of batch 4.
        let slow = Arc::new(Slow { built: AtomicUsize::new(0), panic_at: Some(9) });
        let mut loader = Loader::new(slow, Split::Train, 2, 4, 0, workers, 2).unwrap();
        for i in 0..4 {
            assert_eq!(loader.next().unwrap().index, i, "{workers} workers");
        }
        let err = loader.next().unwrap_err().to_string();
        let who =
            if workers == 0 { "(running without workers)".to_string() } else { format!("worker {}", 4 % workers) };
        assert_eq!(err, format!("the data loader {who} panicked while building batch 4: sequence 9 is broken"));
        assert_eq!(loader.position(), 4);
        assert!(loader.next().is_err(), "the error repeats");
    }
}

#[test]
fn loader_options_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "t.txt", &[b'y'; 100]);
    let text = open(&text_options(&path, None, 8, 0.1)).unwrap();
    let err = |batch, seq, workers, prefetch| {
        Loader::new(text.clone(), Split::Validation, batch, seq, 0, workers, prefetch).unwrap_err().to_string()
    };
    assert_eq!(err(0, 8, 0, 0), "train.batch_size = 0: must be at least 1");
    assert_eq!(err(2, 0, 0, 0), "data.seq_len = 0: must be at least 1");
    assert_eq!(
        err(2, 8, 2, 0),
        "data.prefetch_factor = 0: must be at least 1 when data.num_workers > 0 (batches queued per worker)"
    );
    let long = err(2, 10, 0, 0).replace(&dir.path().display().to_string(), "<dir>");
    assert!(long.starts_with("data.seq_len = 10: the validation split of text file <dir>/t.txt"), "{long}");
    assert!(long.ends_with("supports at most 9"), "{long}");
    assert!(Loader::new(text, Split::Validation, 2, 9, 0, 1, 1).is_ok());
}

// ---------- a full disk (prepare's test hook) ----------

#[test]
fn a_full_disk_leaves_a_partial_temporary_shard_and_the_old_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let shard = || {
        let mut b = shard::ShardBuilder::new(2, 256);
        for i in 0..20u32 {
            b.push(if i % 5 == 0 { Split::Validation } else { Split::Train }, &[i; 30]);
        }
        b
    };
    let size = shard().finish(dir.path(), "whole.bin", 0).unwrap().bytes;

    // Room for half the file: the write that fills the disk writes what fits, the next one
    // fails as ENOSPC, and the name is never taken by a partial shard.
    let err = shard().finish_within(dir.path(), "s.bin", 0, size / 2).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::StorageFull);
    assert_eq!(fs::metadata(dir.path().join("s.bin.tmp")).unwrap().len(), size / 2);
    assert!(!dir.path().join("s.bin").exists());
    // Exactly enough room is enough, and gives the same file.
    let entry = shard().finish_within(dir.path(), "s.bin", 0, size).unwrap();
    assert_eq!(fs::read(dir.path().join("s.bin")).unwrap(), fs::read(dir.path().join("whole.bin")).unwrap());
    assert!(!dir.path().join("s.bin.tmp").exists());

    // A manifest save that fills the disk leaves the manifest before it, and no temporary file.
    let mut m = manifest::Manifest {
        format: manifest::FORMAT.into(),
        version: manifest::VERSION,
        complete: false,
        tokenizer: manifest::TokenizerId::Byte,
        vocab_size: 257,
        id_bytes: 2,
        eos_id: 256,
        bos_id: None,
        val_fraction: 0.2,
        shard_tokens: 100,
        reading: "text".into(),
        inputs: Vec::new(),
        documents: 0,
        text_bytes: 0,
        train: Default::default(),
        validation: Default::default(),
        shards: Vec::new(),
    };
    m.save(dir.path()).unwrap();
    let before = fs::read(dir.path().join(manifest::FILE)).unwrap();
    m.push(entry, 600);
    let err = m.save_within(dir.path(), 40).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::StorageFull);
    assert_eq!(fs::read(dir.path().join(manifest::FILE)).unwrap(), before);
    assert!(!dir.path().join(format!("{}.tmp", manifest::FILE)).exists());
}

/// The byte tokenizer written as a tokenizer.json encodes text to exactly its UTF-8 bytes
/// and decodes them back, through the `tokenizers` crate (what transformers loads too), with
/// `<|endoftext|>` at its id.
#[test]
fn the_byte_tokenizer_json_encodes_text_to_its_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, crate::byte_tokenizer_json(Some(256))).unwrap();
    let t = crate::TextTokenizer::from_file(&path).unwrap();
    assert_eq!(t.vocab_size(), 257);
    assert_eq!(t.token_id("<|endoftext|>"), Some(256));
    let text = "Hello, wörld!\n\ttabs  and 日本 <|endoftext|>x";
    let ids = t.encode_piece(text).unwrap();
    let (head, tail) = text.split_once("<|endoftext|>").unwrap();
    let want: Vec<u32> = head.bytes().map(u32::from).chain([256]).chain(tail.bytes().map(u32::from)).collect();
    assert_eq!(ids, want);
    assert_eq!(t.decode(&ids).unwrap(), text);
    let bytes = crate::Tokenizer::Bytes;
    assert_eq!(bytes.encode(head).unwrap(), head.bytes().map(u32::from).collect::<Vec<_>>());
    assert_eq!(bytes.decode(&ids).unwrap(), text);

    // It reads as the byte tokenizer does (the corpus a run trained on bytes evaluates on);
    // asked for its end of text elsewhere, or with a vocabulary that merges bytes, it does not.
    let file = crate::Tokenizer::File(Box::new(t));
    assert!(file.reads_as_bytes(256) && bytes.reads_as_bytes(256));
    assert!(!file.reads_as_bytes(257));
    let merged = dir.path().join("merged.json");
    let mut json: serde_json::Value = serde_json::from_str(&crate::byte_tokenizer_json(Some(256))).unwrap();
    json["model"]["vocab"]["th"] = 257.into();
    json["model"]["merges"] = serde_json::json!(["t h"]);
    std::fs::write(&merged, json.to_string()).unwrap();
    let merged = crate::Tokenizer::File(Box::new(crate::TextTokenizer::from_file(&merged).unwrap()));
    assert!(!merged.reads_as_bytes(256), "a merge of 't' and 'h' is not the byte tokenizer");
}
