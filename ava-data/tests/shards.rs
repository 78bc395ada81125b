//! Prepared corpora end to end: `prepare` into shards (text, separators, JSONL, gzip and
//! zstd), the manifest, reading them back through [`ShardedDataset`], continuing a killed
//! run, and the errors for bad input and damaged shards. Corpora are generated here, a few
//! hundred KB at most. A full disk is simulated with `prepare`'s test hook
//! ([`prepare::DiskFault`]).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use ava_data::manifest::{self, Manifest};
use ava_data::prepare::{self, Invalid, PrepareError, PrepareOptions, Reading, Silent};
use ava_data::{DataError, Dataset, ShardedDataset, Split};

fn reading() -> Reading {
    Reading { separator: None, field: "text".into(), invalid: Invalid::Error }
}

fn options(inputs: Vec<PathBuf>, out: &Path) -> PrepareOptions {
    PrepareOptions {
        inputs,
        out: out.to_path_buf(),
        tokenizer: None,
        eos: None,
        bos: None,
        reading: reading(),
        val_fraction: 0.2,
        shard_tokens: 4000,
        force: false,
    }
}

/// `n` documents of varied lengths and content, deterministic.
fn documents(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let words = 20 + (i * 37) % 300;
            (0..words).map(|w| format!("w{}", (i * 131 + w * 17) % 997)).collect::<Vec<_>>().join(" ")
        })
        .collect()
}

/// Writes each document to its own file in `dir`, named so sorted order is document order.
fn write_files(dir: &Path, docs: &[String]) {
    fs::create_dir_all(dir).unwrap();
    for (i, d) in docs.iter().enumerate() {
        fs::write(dir.join(format!("doc-{i:04}.txt")), d).unwrap();
    }
}

/// The split streams `prepare` should produce from `docs` with the byte tokenizer.
fn expected_streams(docs: &[String], val_fraction: f64) -> [Vec<u32>; 2] {
    let mut out = [Vec::new(), Vec::new()];
    for (i, d) in docs.iter().enumerate() {
        let s = usize::from(prepare::is_validation(i as u64, val_fraction));
        out[s].extend(d.bytes().map(u32::from));
        out[s].push(256);
    }
    out
}

/// A split's whole stream, read back through the dataset's sequences in order (validation
/// sequences are in order; each shares its first id with the previous one's last).
fn read_stream(ds: &ShardedDataset, split: Split, t: usize) -> Vec<u32> {
    assert_eq!(split, Split::Validation, "only validation is read in order");
    let n = ds.sequences_per_epoch(split, t);
    let mut out = Vec::new();
    for i in 0..n {
        let s = ds.sequence(split, i, t);
        out.extend_from_slice(if i == 0 { &s } else { &s[1..] });
    }
    out
}

fn shard_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("shard-"))
        .map(|e| (e.file_name().to_string_lossy().into_owned(), fs::read(e.path()).unwrap()))
        .collect();
    files.sort();
    files
}

#[test]
fn text_files_become_shards_whose_streams_are_the_documents_with_eos() {
    let tmp = tempfile::tempdir().unwrap();
    let docs = documents(60);
    write_files(&tmp.path().join("in"), &docs);
    let out = tmp.path().join("corpus");
    let summary = prepare::prepare(&options(vec![tmp.path().join("in")], &out), &mut Silent).unwrap();
    let m = &summary.manifest;
    assert!(m.complete && !summary.already_complete);
    assert_eq!((m.documents, m.vocab_size, m.id_bytes, m.eos_id), (60, 257, 2, 256));
    assert!(m.shards.len() > 3, "{} shards of ≥ 4000 ids", m.shards.len());
    let [train, val] = expected_streams(&docs, 0.2);
    assert_eq!((m.train.tokens, m.validation.tokens), (train.len() as u64, val.len() as u64));
    assert!(m.validation.documents > 3 && m.validation.documents < 25, "{} held out", m.validation.documents);
    assert_eq!(m.text_bytes, docs.iter().map(|d| d.len() as u64).sum::<u64>());
    // Each shard but the last holds at least shard_tokens ids; first_document adds up.
    let mut first = 0;
    for (i, s) in m.shards.iter().enumerate() {
        assert_eq!(s.first_document, first);
        first += s.train.documents + s.validation.documents;
        assert!(i + 1 == m.shards.len() || s.train.tokens + s.validation.tokens >= 4000);
    }

    let t = 64;
    let ds = ShardedDataset::open(&out, None, t, 5).unwrap();
    assert_eq!(ds.vocab_size(), 257);
    let read = read_stream(&ds, Split::Validation, t);
    assert!(read.len() + t >= val.len(), "{} of {} validation ids in whole sequences", read.len(), val.len());
    assert_eq!(read, val[..read.len()]);
    // One training epoch visits every window of the train stream once, in a shuffled order.
    let n = ds.sequences_per_epoch(Split::Train, t);
    assert_eq!(n, (train.len() as u64 - 1) / t as u64);
    let mut starts: Vec<u64> = (0..n).map(|i| ds.sequence_start(Split::Train, i, t)).collect();
    assert_ne!(starts, (0..n).map(|j| j * t as u64).collect::<Vec<_>>(), "not shuffled");
    for i in 0..n {
        let at = starts[i as usize] as usize;
        assert_eq!(ds.sequence(Split::Train, i, t), train[at..at + t + 1], "sequence {i}");
    }
    starts.sort_unstable();
    assert_eq!(starts, (0..n).map(|j| j * t as u64).collect::<Vec<_>>());
    // The next epoch is another order; a reopened corpus gives the same sequences.
    let epoch2: Vec<u64> = (n..2 * n).map(|i| ds.sequence_start(Split::Train, i, t)).collect();
    assert_ne!(epoch2, (0..n).map(|i| ds.sequence_start(Split::Train, i, t)).collect::<Vec<_>>());
    let again = ShardedDataset::open(&out, None, t, 5).unwrap();
    assert_eq!(again.sequence(Split::Train, 17, t), ds.sequence(Split::Train, 17, t));
    // Preparing the same inputs again does nothing.
    let second = prepare::prepare(&options(vec![tmp.path().join("in")], &out), &mut Silent).unwrap();
    assert!(second.already_complete);
}

#[test]
fn a_killed_run_continues_from_its_last_complete_shard_and_ends_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let docs = documents(50);
    write_files(&tmp.path().join("in"), &docs);
    let inputs = vec![tmp.path().join("in")];
    let whole = tmp.path().join("whole");
    prepare::prepare(&options(inputs.clone(), &whole), &mut Silent).unwrap();

    // A run killed after its third shard: the manifest lists three, a fourth was being
    // written (a .tmp file), and nothing says complete.
    let killed = tmp.path().join("killed");
    prepare::prepare(&options(inputs.clone(), &killed), &mut Silent).unwrap();
    let full = Manifest::load(&killed).unwrap();
    for s in &full.shards[3..] {
        fs::remove_file(killed.join(&s.file)).unwrap();
    }
    fs::write(killed.join("shard-00003.bin.tmp"), b"half a shard").unwrap();
    // The manifest as it was saved after the third shard.
    let mut m = Manifest {
        shards: Vec::new(),
        documents: 0,
        text_bytes: 0,
        train: Default::default(),
        validation: Default::default(),
        complete: false,
        ..full.clone()
    };
    for s in &full.shards[..3] {
        m.push(s.clone(), 0);
    }
    m.save(&killed).unwrap();
    assert!(matches!(ShardedDataset::open(&killed, None, 8, 1), Err(DataError::Unfinished { shards: 3, .. })));

    let summary = prepare::prepare(&options(inputs, &killed), &mut Silent).unwrap();
    assert_eq!(summary.resumed, Some((3, m.documents)));
    assert_eq!(shard_files(&killed), shard_files(&whole));
    let (a, b) = (Manifest::load(&killed).unwrap(), Manifest::load(&whole).unwrap());
    assert_eq!((a.shards, a.documents, a.train, a.validation), (b.shards, b.documents, b.train, b.validation));
}

/// The files in a corpus directory, sorted; the lock a prepare holds on it is not one.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != prepare::LOCK_FILE)
        .collect();
    names.sort();
    names
}

#[test]
fn a_full_disk_stops_with_what_to_do_keeps_the_complete_shards_and_the_next_run_continues() {
    let tmp = tempfile::tempdir().unwrap();
    write_files(&tmp.path().join("in"), &documents(50));
    let inputs = vec![tmp.path().join("in")];
    let whole = tmp.path().join("whole");
    let w = prepare::prepare(&options(inputs.clone(), &whole), &mut Silent).unwrap().manifest;
    assert!(w.shards.len() > 4, "{} shards", w.shards.len());

    // The disk fills up halfway through the third shard.
    let out = tmp.path().join("full");
    let fault = prepare::DiskFault::Shard { index: 2, after: w.shards[2].bytes / 2 };
    let err = prepare::prepare_with_fault(&options(inputs.clone(), &out), &mut Silent, fault).unwrap_err();
    let PrepareError::DiskFull { dir, shards: 2, source } = &err else { panic!("not a full disk: {err:?}") };
    assert_eq!((dir, source.kind()), (&out, std::io::ErrorKind::StorageFull));
    assert_eq!(
        err.to_string(),
        format!(
            "the disk holding {} is full ({source}) after 2 complete shards; they stay usable: free some space and \
             run the same command again to continue from shard 2",
            out.display()
        )
    );
    // The partial shard's temporary file is gone (its space given back); the manifest lists
    // the two complete shards, which verify, and does not say complete.
    assert_eq!(names(&out), ["manifest.json", "shard-00000.bin", "shard-00001.bin"]);
    let m = Manifest::load(&out).unwrap();
    assert!(!m.complete);
    assert_eq!(m.shards, w.shards[..2]);
    assert_eq!(m.documents, w.shards[2].first_document);
    let checks = ava_data::corpus::verify_all(&out, &m, &|_| {});
    assert!(checks.iter().all(|c| c.problem.is_none()) && checks.len() == 2);
    // Training refuses the unfinished corpus, saying what to run.
    let e = ShardedDataset::open(&out, None, 8, 1).unwrap_err();
    assert!(matches!(&e, DataError::Unfinished { dir, shards: 2 } if *dir == out), "{e:?}");
    assert!(e.to_string().contains("is not finished (2 shards so far): run the same `ava data prepare` again"), "{e}");

    // The same command again continues from shard 2 and ends byte-identical to the run the
    // disk did not interrupt, manifest included.
    let summary = prepare::prepare(&options(inputs, &out), &mut Silent).unwrap();
    assert_eq!(summary.resumed, Some((2, m.documents)));
    assert_eq!(shard_files(&out), shard_files(&whole));
    assert_eq!(fs::read(out.join(manifest::FILE)).unwrap(), fs::read(whole.join(manifest::FILE)).unwrap());
    ShardedDataset::open(&out, None, 8, 1).unwrap();
}

#[test]
fn a_disk_full_while_saving_the_manifest_keeps_the_one_before_and_the_next_run_continues() {
    let tmp = tempfile::tempdir().unwrap();
    write_files(&tmp.path().join("in"), &documents(50));
    let inputs = vec![tmp.path().join("in")];
    let whole = tmp.path().join("whole");
    let w = prepare::prepare(&options(inputs.clone(), &whole), &mut Silent).unwrap().manifest;
    let n = w.shards.len();

    // Save 1 would list the second shard; the last save (after the last shard's) would mark
    // the corpus complete.
    for (save, listed) in [(1, 1), (n, n)] {
        let out = tmp.path().join(format!("save-{save}"));
        let fault = prepare::DiskFault::Manifest { save, after: 100 };
        let err = prepare::prepare_with_fault(&options(inputs.clone(), &out), &mut Silent, fault).unwrap_err();
        assert!(matches!(&err, PrepareError::DiskFull { shards, .. } if *shards == listed), "{err:?}");
        assert!(err.to_string().contains(&format!("after {listed} complete shards")), "{err}");
        assert!(!out.join(format!("{}.tmp", manifest::FILE)).exists(), "the partial manifest is removed");
        let m = Manifest::load(&out).unwrap();
        assert_eq!((m.complete, &m.shards[..]), (false, &w.shards[..listed]));

        let summary = prepare::prepare(&options(inputs.clone(), &out), &mut Silent).unwrap();
        assert_eq!(summary.resumed, Some((listed, m.documents)));
        assert_eq!(shard_files(&out), shard_files(&whole));
        assert_eq!(fs::read(out.join(manifest::FILE)).unwrap(), fs::read(whole.join(manifest::FILE)).unwrap());
    }
}

#[test]
fn separators_jsonl_and_compressed_inputs_give_the_same_documents() {
    let tmp = tempfile::tempdir().unwrap();
    // Enough text that separators fall across the reader's 1 MiB blocks.
    let docs: Vec<String> = documents(400).into_iter().map(|d| d.repeat(8)).collect();
    let joined = docs.join("\n===\n");
    assert!(joined.len() > 2 << 20, "{} bytes", joined.len());
    let text = tmp.path().join("all.txt");
    fs::write(&text, &joined).unwrap();
    let jsonl: String = docs.iter().map(|d| format!("{}\n", serde_json::json!({"id": 1, "body": d}))).collect();
    let gz = tmp.path().join("all.jsonl.gz");
    let mut enc = flate2::write::GzEncoder::new(fs::File::create(&gz).unwrap(), flate2::Compression::fast());
    enc.write_all(jsonl.as_bytes()).unwrap();
    enc.finish().unwrap();
    // Two frames, as `cat a.zst b.zst` or pzstd writes, with a skippable frame between.
    let zst = tmp.path().join("all.jsonl.zst");
    let half = jsonl[..jsonl.len() / 2].rfind('\n').unwrap() + 1;
    let fastest = ruzstd::encoding::CompressionLevel::Fastest;
    let mut compressed = ruzstd::encoding::compress_to_vec(&jsonl.as_bytes()[..half], fastest);
    compressed.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 1, 2, 3]); // skippable, 3 bytes
    compressed.extend(ruzstd::encoding::compress_to_vec(&jsonl.as_bytes()[half..], fastest));
    fs::write(&zst, compressed).unwrap();

    let run = |input: &Path, separator: Option<&str>, field: &str, out: &str| {
        let mut o = options(vec![input.to_path_buf()], &tmp.path().join(out));
        o.reading = Reading { separator: separator.map(str::to_string), field: field.into(), invalid: Invalid::Error };
        o.shard_tokens = 1 << 20;
        prepare::prepare(&o, &mut Silent).unwrap().manifest
    };
    let from_text = run(&text, Some("\n===\n"), "text", "a");
    let from_gz = run(&gz, None, "body", "b");
    let from_zst = run(&zst, None, "body", "c");
    assert_eq!(from_text.documents, 400);
    let [train, _] = expected_streams(&docs, 0.2);
    for m in [&from_text, &from_gz, &from_zst] {
        assert_eq!((m.documents, m.train.tokens), (400, train.len() as u64));
    }
    let shards = |d: &str| shard_files(&tmp.path().join(d));
    assert_eq!(shards("a"), shards("b"));
    assert_eq!(shards("a"), shards("c"));
}

#[test]
fn bad_input_is_named_with_where_and_how_to_fix_it() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    let err = |inputs: Vec<PathBuf>, edit: &dyn Fn(&mut PrepareOptions)| {
        let mut o = options(inputs, &p.join(format!("out-{}", rand_name())));
        edit(&mut o);
        prepare::prepare(&o, &mut Silent).unwrap_err().to_string()
    };
    // Invalid UTF-8: file and byte offset; replace and skip go on.
    let bad = p.join("bad.txt");
    fs::write(&bad, b"good text \xff\xfe more").unwrap();
    let good = p.join("good.txt");
    fs::write(&good, "fine").unwrap();
    let e = err(vec![bad.clone()], &|_| {});
    assert!(e.contains("bad.txt: invalid UTF-8 at byte offset 10") && e.contains("--invalid replace"), "{e}");
    let mut o = options(vec![bad.clone(), good.clone()], &p.join("replaced"));
    o.reading.invalid = Invalid::Replace;
    let m = prepare::prepare(&o, &mut Silent).unwrap().manifest;
    assert_eq!(m.documents, 2);
    o.out = p.join("skipped");
    o.reading.invalid = Invalid::Skip;
    let s = prepare::prepare(&o, &mut Silent).unwrap();
    assert_eq!((s.manifest.documents, s.skipped_documents), (1, 1));

    // JSONL: not JSON, and a missing field, with file:line.
    let jsonl = p.join("x.jsonl");
    fs::write(&jsonl, "{\"text\": \"a\"}\n\n{\"txt\": \"b\"}\n").unwrap();
    let e = err(vec![jsonl.clone()], &|_| {});
    assert!(e.contains("x.jsonl:3: no field \"text\" (it has: txt); name the text field with --field"), "{e}");
    fs::write(&jsonl, "{\"text\": \"a\"}\nnot json\n").unwrap();
    assert!(err(vec![jsonl.clone()], &|_| {}).contains("x.jsonl:2: not JSON"));
    fs::write(&jsonl, "{\"text\": 5}\n").unwrap();
    assert!(err(vec![jsonl], &|_| {}).contains("x.jsonl:1: field \"text\" is not a string but 5"));

    // Empty inputs, Parquet, options.
    let empty = p.join("empty");
    fs::create_dir(&empty).unwrap();
    assert!(err(vec![empty.clone()], &|_| {}).contains("the inputs hold no file"));
    fs::write(empty.join("blank.txt"), "").unwrap();
    assert!(err(vec![empty], &|_| {}).contains("the inputs hold no document"));
    assert!(err(vec![good.clone()], &|o| o.val_fraction = 1.0).contains("--val-fraction 1: must be at least 0"));
    let e = err(vec![good.clone()], &|o| o.reading.separator = Some(String::new()));
    assert!(e.contains("--separator \"\": is empty"), "{e}");
    let e = err(vec![good.clone()], &|o| o.eos = Some("</s>".into()));
    assert!(e.contains("byte tokenizer's end of text is id 256"), "{e}");

    // --out holding something else.
    let busy = p.join("busy");
    fs::create_dir(&busy).unwrap();
    fs::write(busy.join("notes.md"), "mine").unwrap();
    let mut o = options(vec![good.clone()], &busy);
    let e = prepare::prepare(&o, &mut Silent).unwrap_err().to_string();
    assert!(e.contains("is not empty and not a corpus (it holds notes.md)") && e.contains("--force"), "{e}");
    o.force = true;
    prepare::prepare(&o, &mut Silent).unwrap();
    assert!(busy.join("notes.md").exists(), "--force leaves other files");
    // Another corpus in --out: refused, then replaced with --force.
    let mut other = options(vec![bad], &busy);
    other.reading.invalid = Invalid::Replace;
    let e = prepare::prepare(&other, &mut Silent).unwrap_err().to_string();
    assert!(e.contains("holds a complete corpus prepared from other inputs or options"), "{e}");
}

fn rand_name() -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    N.fetch_add(1, Ordering::Relaxed).to_string()
}

#[test]
fn damaged_shards_and_newer_manifests_are_caught_before_training_reads_them() {
    let tmp = tempfile::tempdir().unwrap();
    write_files(&tmp.path().join("in"), &documents(30));
    let out = tmp.path().join("corpus");
    let m = prepare::prepare(&options(vec![tmp.path().join("in")], &out), &mut Silent).unwrap().manifest;
    let second = out.join(&m.shards[1].file);
    let original = fs::read(&second).unwrap();

    // One flipped byte in the ids: only the checksum sees it.
    let mut flipped = original.clone();
    flipped[100] ^= 1;
    fs::write(&second, &flipped).unwrap();
    let e = ShardedDataset::open(&out, None, 16, 1).unwrap_err().to_string();
    assert!(e.contains("shard-00001.bin: its checksum is") && e.contains("prepare the corpus again"), "{e}");
    let checks = ava_data::corpus::verify_all(&out, &m, &|_| {});
    let bad: Vec<&str> = checks.iter().filter(|c| c.problem.is_some()).map(|c| c.entry.file.as_str()).collect();
    assert_eq!(bad, ["shard-00001.bin"]);

    // Truncated.
    fs::write(&second, &original[..original.len() - 8]).unwrap();
    let e = ShardedDataset::open(&out, None, 16, 1).unwrap_err().to_string();
    assert!(e.contains("shard-00001.bin: it is") && e.contains("truncated"), "{e}");
    fs::write(&second, &original).unwrap();
    ShardedDataset::open(&out, None, 16, 1).unwrap();

    // A newer manifest, and a directory that is not a corpus.
    let text = fs::read_to_string(out.join(manifest::FILE)).unwrap();
    fs::write(out.join(manifest::FILE), text.replace("\"version\": 1", "\"version\": 9")).unwrap();
    let e = ShardedDataset::open(&out, None, 16, 1).unwrap_err().to_string();
    assert!(e.contains("written by a newer Ava (manifest version 9; this build reads up to 1)"), "{e}");
    let e = ShardedDataset::open(tmp.path(), None, 16, 1).unwrap_err().to_string();
    assert!(e.contains("is not a prepared corpus (no manifest.json)") && e.contains("ava data prepare"), "{e}");
    fs::write(out.join(manifest::FILE), text).unwrap();

    // Sequences longer than a split, and another tokenizer than the corpus's.
    let e = ShardedDataset::open(&out, None, 1 << 20, 1).unwrap_err().to_string();
    assert!(e.contains("split of the corpus in") && e.contains("smaller data.seq_len"), "{e}");
    let tok = tmp.path().join("tokenizer.json");
    fs::write(&tok, "{}").unwrap();
    let e = ShardedDataset::open(&out, Some(&tok), 16, 1).unwrap_err().to_string();
    assert!(e.contains("was prepared with the byte tokenizer, but data.tokenizer is tokenizer"), "{e}");
    assert!(matches!(prepare::prepare(&options(vec![], &out), &mut Silent), Err(PrepareError::NoInputs)));
}

#[test]
fn a_trained_bpe_prepares_a_corpus_that_training_checks_against_data_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let docs = documents(40);
    write_files(&tmp.path().join("in"), &docs);
    let inputs = vec![tmp.path().join("in")];
    let tok = tmp.path().join("bpe.json");
    let trained = ava_data::bpe::train(&inputs, &reading(), 400, u64::MAX, &tok).unwrap();
    assert_eq!((trained.vocab_size, trained.documents), (400, 40));

    let out = tmp.path().join("corpus");
    let mut o = options(inputs, &out);
    o.tokenizer = Some(tok.clone());
    let m = prepare::prepare(&o, &mut Silent).unwrap().manifest;
    let reference = tokenizers::Tokenizer::from_file(&tok).unwrap();
    assert_eq!((m.vocab_size, m.id_bytes), (400, 2));
    assert_eq!(Some(m.eos_id), reference.token_to_id(ava_data::bpe::END_OF_TEXT));
    assert!(matches!(&m.tokenizer, manifest::TokenizerId::Huggingface { sha256, .. } if sha256.len() == 64));
    // The validation stream is the held-out documents, each encoded by the tokenizer itself
    // and followed by the end-of-text id; merges make it much shorter than the bytes.
    let mut want = Vec::new();
    for (_, d) in docs.iter().enumerate().filter(|(i, _)| prepare::is_validation(*i as u64, 0.2)) {
        want.extend_from_slice(reference.encode(d.as_str(), false).unwrap().get_ids());
        want.push(m.eos_id);
    }
    let ds = ShardedDataset::open(&out, Some(&tok), 16, 3).unwrap();
    let got = read_stream(&ds, Split::Validation, 16);
    assert_eq!(got, want[..got.len()]);
    let bytes: usize = docs.iter().map(String::len).sum();
    let ids = m.train.tokens + m.validation.tokens;
    assert!(ids * 3 < bytes as u64 * 2, "{ids} ids for {bytes} bytes");

    // Another tokenizer than the corpus's is refused naming both.
    let other = tmp.path().join("other.json");
    ava_data::bpe::train(&[tmp.path().join("in")], &reading(), 300, u64::MAX, &other).unwrap();
    let e = ShardedDataset::open(&out, Some(&other), 16, 3).unwrap_err().to_string();
    assert!(e.contains("was prepared with tokenizer") && e.contains("bpe.json") && e.contains("other.json"), "{e}");
    let e = ava_data::bpe::train(&[tmp.path().join("in")], &reading(), 200, u64::MAX, &other).unwrap_err().to_string();
    assert!(e.contains("--vocab-size 200: must be above 257"), "{e}");
    let e = ava_data::bpe::train(&[tmp.path().join("in")], &reading(), 4294967296, u64::MAX, &other)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--vocab-size 4294967296") && e.contains("at most 2097152"), "{e}");

    // At most `max_bytes` of text is learned from: the inputs' beginning, cut where a
    // character starts; the inputs going further is said.
    let all = ava_data::bpe::train(&[tmp.path().join("in")], &reading(), 300, u64::MAX, &other).unwrap();
    assert!(!all.truncated);
    let cap = all.bytes / 3;
    let part = ava_data::bpe::train(&[tmp.path().join("in")], &reading(), 300, cap, &other).unwrap();
    assert!(part.truncated && part.bytes <= cap && part.bytes + 4 > cap, "{} bytes of {cap}", part.bytes);
    assert!(part.documents < all.documents);
    let exact = ava_data::bpe::train(&[tmp.path().join("in")], &reading(), 300, all.bytes, &other).unwrap();
    assert!(!exact.truncated && exact.bytes == all.bytes);
}

#[test]
fn a_mixture_needs_one_tokenizer_and_shares_it_can_keep() {
    let tmp = tempfile::tempdir().unwrap();
    write_files(&tmp.path().join("in"), &documents(30));
    let inputs = vec![tmp.path().join("in")];
    let bytes = tmp.path().join("bytes");
    prepare::prepare(&options(inputs.clone(), &bytes), &mut Silent).unwrap();
    let tok = tmp.path().join("bpe.json");
    ava_data::bpe::train(&inputs, &reading(), 300, u64::MAX, &tok).unwrap();
    let bpe = tmp.path().join("bpe");
    let mut o = options(inputs, &bpe);
    o.tokenizer = Some(tok);
    prepare::prepare(&o, &mut Silent).unwrap();

    let e = ava_data::Mixture::open(&[(bytes.clone(), 0.5), (bpe, 0.5)], None, 16, 1).unwrap_err().to_string();
    assert!(
        e.contains("data.mix") && e.contains("must share one tokenizer") && e.contains("the byte tokenizer"),
        "{e}"
    );
    let e = ava_data::Mixture::open(&[(bytes.clone(), 0.9999), (bytes.clone(), 0.0001)], None, 16, 1).unwrap_err();
    assert!(e.to_string().contains("is below 1/1024, the finest share a mixture keeps"), "{e}");
    let m = ava_data::Mixture::open(&[(bytes.clone(), 0.75), (bytes, 0.25)], None, 16, 1).unwrap();
    let seen = m.sources_seen(4096);
    assert_eq!(seen.iter().map(|s| s.1).collect::<Vec<_>>(), [3072, 1024]);
}

/// Writes `docs` as a Parquet file (snappy, row groups of 10) with an INT64 `id` column and an
/// optional UTF-8 `text` column, with a null row after the third document.
fn write_parquet(path: &Path, docs: &[String]) {
    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use std::sync::Arc;
    let schema = "message doc { REQUIRED INT64 id; OPTIONAL BYTE_ARRAY text (UTF8); }";
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let mut writer = SerializedFileWriter::new(fs::File::create(path).unwrap(), schema, props).unwrap();
    let mut rows: Vec<Option<&String>> = docs.iter().map(Some).collect();
    rows.insert(3, None);
    for (g, group) in rows.chunks(10).enumerate() {
        let mut rg = writer.next_row_group().unwrap();
        let ids: Vec<i64> = (0..group.len() as i64).map(|i| g as i64 * 10 + i).collect();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<Int64Type>().write_batch(&ids, None, None).unwrap();
        col.close().unwrap();
        let values: Vec<ByteArray> = group.iter().flatten().map(|d| ByteArray::from(d.as_str())).collect();
        let defs: Vec<i16> = group.iter().map(|d| i16::from(d.is_some())).collect();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>().write_batch(&values, Some(&defs), None).unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    writer.close().unwrap();
}

#[test]
fn a_parquet_string_column_gives_the_same_corpus_as_the_same_documents_in_files() {
    let tmp = tempfile::tempdir().unwrap();
    let docs = documents(25);
    write_files(&tmp.path().join("in"), &docs);
    let pq = tmp.path().join("docs.parquet");
    write_parquet(&pq, &docs);
    prepare::prepare(&options(vec![tmp.path().join("in")], &tmp.path().join("from-files")), &mut Silent).unwrap();
    let s = prepare::prepare(&options(vec![pq.clone()], &tmp.path().join("from-parquet")), &mut Silent).unwrap();
    assert_eq!((s.manifest.documents, s.skipped_documents), (25, 1), "the null row is left out");
    assert_eq!(shard_files(&tmp.path().join("from-files")), shard_files(&tmp.path().join("from-parquet")));

    let err = |field: &str| {
        let mut o = options(vec![pq.clone()], &tmp.path().join(format!("bad-{field}")));
        o.reading.field = field.into();
        prepare::prepare(&o, &mut Silent).unwrap_err().to_string()
    };
    let e = err("id");
    assert!(
        e.contains("docs.parquet: column \"id\" holds INT64, not strings; name a string column with --field"),
        "{e}"
    );
    let e = err("body");
    assert!(e.contains("docs.parquet: no column \"body\" (it has: id, text)"), "{e}");
    let junk = tmp.path().join("junk.parquet");
    fs::write(&junk, b"not parquet at all").unwrap();
    let e = prepare::prepare(&options(vec![junk], &tmp.path().join("junk")), &mut Silent).unwrap_err().to_string();
    assert!(e.contains("junk.parquet: not a readable Parquet file"), "{e}");
}
