//! `ava data prepare | info | verify` and `ava train` on a prepared corpus, each a fresh
//! process: the summary lines, a damaged shard named by `verify` and by `train`, a model
//! vocabulary smaller than the corpus's refused naming both, and exact resume on shards
//! across a change of data.num_workers.

use std::fs;
use std::path::Path;

mod common;

use common::{ava, checkpoint, json_of, losses, ok, train_small, usage_error};

/// A few hundred KB of text in 40 files.
fn write_corpus_text(dir: &Path) {
    fs::create_dir_all(dir).unwrap();
    for i in 0..40 {
        let text: String = (0..800).map(|w| format!("word{} ", (i * 7919 + w * 104_729) % 613)).collect();
        fs::write(dir.join(format!("part-{i:02}.txt")), text).unwrap();
    }
}

fn prepared(dir: &Path) -> String {
    write_corpus_text(&dir.join("text"));
    let out = ok(ava(
        dir,
        &["data", "prepare", "text", "--out", "corpus", "--val-fraction", "0.1", "--shard-tokens", "40000"],
    ));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

const SHARDS: &[&str] = &["--set", "data.source=shards", "--set", "data.path=corpus", "--set", "model.vocab_size=257"];

#[test]
fn prepare_info_and_verify_report_the_corpus_and_name_a_damaged_shard() {
    let dir = tempfile::tempdir().unwrap();
    let text = prepared(dir.path());
    assert!(text.contains("prepared 40 documents (") && text.contains("in 6 shards into corpus"), "{text}");
    assert!(
        text.contains(
            "train on it with: ava train --set data.source=shards --set data.path=corpus --set model.vocab_size=257 \
             --set train.out_dir=runs/corpus"
        ),
        "{text}"
    );

    let info = json_of(&ok(ava(dir.path(), &["--format", "json", "data", "info", "corpus"])));
    assert_eq!(info["manifest"]["documents"], 40);
    assert_eq!(info["manifest"]["vocab_size"], 257);
    assert_eq!(info["manifest"]["shards"].as_array().unwrap().len(), 6);
    let out = ok(ava(dir.path(), &["data", "verify", "corpus"]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("corpus: all 6 shards match their checksums"));

    // Again: nothing to do.
    let out = ok(ava(
        dir.path(),
        &["data", "prepare", "text", "--out", "corpus", "--val-fraction", "0.1", "--shard-tokens", "40000"],
    ));
    assert!(String::from_utf8_lossy(&out.stdout).contains("already holds this corpus"));

    let shard = dir.path().join("corpus/shard-00002.bin");
    let mut bytes = fs::read(&shard).unwrap();
    bytes[200] ^= 0x10;
    fs::write(&shard, &bytes).unwrap();
    let out = ava(dir.path(), &["data", "verify", "corpus"]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("1 of 6 shards are damaged") && stdout.contains("shard-00002.bin: its checksum is"),
        "{stdout}"
    );
    let out = train_small(dir.path(), "run", &[SHARDS, &["--max-steps", "1"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("shard-00002.bin: its checksum is"), "{err}");
}

#[test]
fn bad_prepare_input_and_a_too_small_vocabulary_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("bad.txt"), b"caf\xe9").unwrap();
    let err = usage_error(ava(dir.path(), &["data", "prepare", "bad.txt", "--out", "c"]));
    assert!(err.contains("bad.txt: invalid UTF-8 at byte offset 3; pass --invalid replace"), "{err}");
    prepared(dir.path());
    let err = usage_error(train_small(
        dir.path(),
        "run",
        &["--set", "data.source=shards", "--set", "data.path=corpus", "--set", "model.vocab_size=256"],
    ));
    assert!(
        err.contains("the corpus in corpus was prepared with a vocabulary of 257 but model.vocab_size is 256"),
        "{err}"
    );
    let err = usage_error(train_small(dir.path(), "run", &["--set", "data.source=shards"]));
    assert!(err.contains("data.source is shards but data.path is not set"), "{err}");
}

#[test]
fn training_on_shards_resumes_bit_exactly_with_another_worker_count() {
    let dir = tempfile::tempdir().unwrap();
    prepared(dir.path());
    let run = |out: &str, extra: &[&str]| ok(train_small(dir.path(), out, &[SHARDS, extra].concat()));
    run("straight", &["--max-steps", "6", "--set", "data.num_workers=0"]);
    run("split", &["--max-steps", "6", "--steps", "3", "--set", "data.num_workers=2"]);
    let out = run("split", &["--max-steps", "6", "--resume", "latest", "--set", "data.num_workers=1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("continuing at step 4") && err.contains("token shards corpus"), "{err}");
    assert_same_runs(&dir.path().join("straight"), &dir.path().join("split"));
}

/// The straight and the resumed run end at step 6 with the same bytes and losses.
fn assert_same_runs(a: &Path, b: &Path) {
    for file in ["model.safetensors", "optimizer.safetensors", "trainer.json"] {
        let x = fs::read(checkpoint(a, 6).join(file)).unwrap();
        let y = fs::read(checkpoint(b, 6).join(file)).unwrap();
        assert!(x == y, "{file} differs between the straight and the resumed run");
    }
    assert_eq!(losses(a), losses(b));
    assert_eq!(losses(a).len(), 6);
}

/// A second corpus with other text, prepared beside the first.
fn prepared_second(dir: &Path) {
    let text = dir.join("text2");
    fs::create_dir_all(&text).unwrap();
    for i in 0..20 {
        let body: String = (0..900).map(|w| format!("other{} ", (i * 31 + w * 17) % 211)).collect();
        fs::write(text.join(format!("b-{i:02}.txt")), body).unwrap();
    }
    ok(ava(dir, &["data", "prepare", "text2", "--out", "corpus2", "--val-fraction", "0.1"]));
}

#[test]
fn a_mixture_reports_tokens_by_source_and_resumes_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    prepared(dir.path());
    prepared_second(dir.path());
    let mix: &[&str] = &[
        "--set",
        "data.source=shards",
        "--set",
        "data.mix=[corpus: 75%, corpus2: 25%]",
        "--set",
        "model.vocab_size=257",
    ];
    let run = |out: &str, extra: &[&str]| ok(train_small(dir.path(), out, &[mix, extra].concat()));
    let out = run("straight", &["--max-steps", "6", "--format", "json"]);
    let summary = json_of(&out);
    let by_source = summary["tokens_by_source"].as_array().unwrap();
    let tokens: Vec<u64> = by_source.iter().map(|s| s["tokens"].as_u64().unwrap()).collect();
    // 6 steps of 2 micro-batches of 4 sequences of 32 targets.
    assert_eq!(tokens.iter().sum::<u64>(), 6 * 2 * 4 * 32, "{summary}");
    assert_eq!(by_source[0]["source"], "corpus");
    assert!(tokens[0] > tokens[1] && tokens[1] > 0, "{tokens:?}");
    run("split", &["--max-steps", "6", "--steps", "3", "--set", "data.num_workers=2"]);
    run("split", &["--max-steps", "6", "--resume", "latest", "--set", "data.num_workers=0"]);
    assert_same_runs(&dir.path().join("straight"), &dir.path().join("split"));

    // Shares that do not add up, and a path beside a mix.
    let err = usage_error(train_small(
        dir.path(),
        "bad",
        &[
            "--set",
            "data.source=shards",
            "--set",
            "data.mix=[corpus: 70%, corpus2: 20%]",
            "--set",
            "model.vocab_size=257",
        ],
    ));
    assert!(err.contains("data.mix") && err.contains("the shares add up to 90%, not 100%"), "{err}");
    let err = usage_error(train_small(dir.path(), "bad", &[mix, &["--set", "data.path=corpus"]].concat()));
    assert!(err.contains("data.path (corpus) and data.mix are both set"), "{err}");
}

/// `n` short documents (3 to 40 words, so a 32-token sequence holds several) in one file,
/// cut at "%" lines, prepared into `dir/name`.
fn prepared_short(dir: &Path, name: &str, salt: usize, n: usize) {
    let text: Vec<String> = (0..n)
        .map(|i| {
            (0..3 + (i * 13 + salt) % 38)
                .map(|w| format!("s{}", (i * 7 + w * 3 + salt) % 97))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    fs::write(dir.join(format!("{name}.txt")), text.join("\n%\n")).unwrap();
    let input = format!("{name}.txt");
    ok(ava(dir, &["data", "prepare", &input, "--separator", "\n%\n", "--out", name, "--val-fraction", "0.1"]));
}

#[test]
fn packed_documents_resume_bit_exactly_and_kernels_without_them_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    prepared_short(dir.path(), "short", 0, 1500);
    prepared_short(dir.path(), "short2", 5, 1000);
    let packed: &[&str] = &[
        "--set",
        "data.source=shards",
        "--set",
        "data.mix=[short: 60%, short2: 40%]",
        "--set",
        "data.packing=document",
        "--set",
        "model.vocab_size=257",
    ];
    let run = |out: &str, extra: &[&str]| ok(train_small(dir.path(), out, &[packed, extra].concat()));
    run("straight", &["--max-steps", "6", "--set", "data.num_workers=0"]);
    run("split", &["--max-steps", "6", "--steps", "3", "--set", "data.num_workers=2"]);
    run("split", &["--max-steps", "6", "--resume", "latest", "--set", "data.num_workers=1"]);
    assert_same_runs(&dir.path().join("straight"), &dir.path().join("split"));
    // Packing is on: the same sequences without it train to other losses.
    run("concat", &["--max-steps", "6", "--set", "data.packing=concat"]);
    assert_ne!(losses(&dir.path().join("straight")), losses(&dir.path().join("concat")));
    // Resuming a packed run without packing would train on something else: refused.
    let resumed = ["--max-steps", "8", "--resume", "latest", "--set", "data.packing=concat"];
    let err = usage_error(train_small(dir.path(), "split", &[packed, &resumed].concat()));
    assert!(err.contains("refusing to resume") && err.contains("data.packing"), "{err}");

    ava_tests::workspace_plugins_dir();
    let err =
        usage_error(train_small(dir.path(), "bad", &[packed, &["--set", "plugins.attention=block-sparse"]].concat()));
    assert!(
        err.contains(
            "attention kernel 'block-sparse' does not support data.packing: document (attention kept inside each \
             document); pick a kernel that does (built in: standard; plugins: flash, sliding-window) or set \
             data.packing: concat"
        ),
        "{err}"
    );
    ok(train_small(dir.path(), "flash", &[packed, &["--max-steps", "1", "--set", "plugins.attention=flash"]].concat()));
    let err = usage_error(train_small(dir.path(), "bad", &["--set", "data.packing=document"]));
    assert!(
        err.contains("data.packing = document: needs document boundaries, and data.source: synthetic has none"),
        "{err}"
    );
    let err = usage_error(train_small(dir.path(), "bad", &["--set", "data.packing=documents"]));
    assert!(err.contains("data.packing") && err.contains("concat") && err.contains("document"), "{err}");
}

/// `ava data train-tokenizer` on an endless stream learns from its first `--max-bytes` and
/// stops reading, in bounded memory, saying that the input went on.
#[test]
fn a_tokenizer_learns_from_the_beginning_of_an_endless_stream() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let mut child = common::ava_command(
        dir.path(),
        &[
            "--format",
            "json",
            "data",
            "train-tokenizer",
            "/dev/stdin",
            "--separator",
            "\n",
            "--max-bytes",
            "1MiB",
            "--vocab-size",
            "300",
            "--out",
            "tok.json",
        ],
    )
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // Writes until ava closes the pipe (the write then fails: SIGPIPE is ignored here).
    let writer = std::thread::spawn(move || {
        let line = b"the endless stream goes on and on\n".repeat(1000);
        let mut written = 0u64;
        while stdin.write_all(&line).is_ok() {
            written += line.len() as u64;
        }
        written
    });
    let out = child.wait_with_output().unwrap();
    let written = writer.join().unwrap();
    let out = ok(out);
    let v = json_of(&out);
    assert_eq!(v["truncated"], true, "{v}");
    let bytes = v["bytes"].as_u64().unwrap();
    assert!(bytes <= 1 << 20 && bytes > (1 << 20) - 64, "{bytes} bytes learned from");
    assert!(written > bytes, "{written} bytes written");
    assert!(dir.path().join("tok.json").is_file());
}

/// A run trained on a corpus prepared with the byte tokenizer evaluates on that corpus: its
/// exported model reads text with the byte tokenizer written as a tokenizer.json, which is
/// the same tokenizer. A corpus prepared with another tokenizer is still refused.
#[test]
fn a_run_trained_on_bytes_evaluates_on_its_own_corpus() {
    let dir = tempfile::tempdir().unwrap();
    prepared(dir.path());
    let trained = ok(train_small(dir.path(), "run", &[SHARDS, &["--max-steps", "2"]].concat()));
    let eval = json_of(&ok(ava(dir.path(), &["--format", "json", "eval", "run", "--data", "corpus"])));
    // Training says before its first step that its validation loss reads a part of the split.
    let header = String::from_utf8_lossy(&trained.stderr).into_owned();
    let said = format!(
        "validation loss: the first 4 of the validation split's {} sequences (train.eval_batches × \
         train.eval_batch_size); `ava eval run` reads each once",
        eval["sequences"]
    );
    assert!(header.contains(&said), "{header}");
    assert!(eval["loss"].as_f64().unwrap().is_finite(), "{eval}");
    // The whole split is more than the run's evaluation reads, and eval says the two differ.
    let text = String::from_utf8_lossy(&ok(ava(dir.path(), &["eval", "run"])).stdout).into_owned();
    assert!(eval["sequences"].as_u64().unwrap() > 4, "{eval}");
    assert!(text.contains("the run's validation loss reads 4 sequences of 32 tokens"), "{text}");
    ok(ava(dir.path(), &["data", "train-tokenizer", "text", "--vocab-size", "300", "--out", "bpe.json"]));
    ok(ava(dir.path(), &["data", "prepare", "text", "--tokenizer", "bpe.json", "--out", "bpe-corpus"]));
    let err = usage_error(ava(dir.path(), &["eval", "run", "--data", "bpe-corpus"]));
    assert!(err.contains("but the model reads text with tokenizer"), "{err}");
}

/// A tokenizer the `tokenizers` crate panics on (a character map whose trie points outside
/// itself) is blamed, not the text it was run on, and the panic is an error, not a crash
/// report on the terminal.
#[test]
fn a_tokenizer_the_crate_panics_on_is_blamed_quietly() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("text.txt"), "abc def\n").unwrap();
    ok(ava(dir.path(), &["data", "train-tokenizer", "text.txt", "--vocab-size", "260", "--out", "tok.json"]));
    let mut json: serde_json::Value = serde_json::from_slice(&fs::read(dir.path().join("tok.json")).unwrap()).unwrap();
    json["normalizer"] = serde_json::json!({"type": "Precompiled", "precompiled_charsmap": "BAAAAP////9hAA=="});
    fs::write(dir.path().join("bad.json"), json.to_string()).unwrap();
    let out = ava(dir.path(), &["data", "prepare", "text.txt", "--tokenizer", "bad.json", "--out", "c"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("tokenizer bad.json failed on a document of text.txt"), "{err}");
    assert!(err.contains("the tokenizer file is damaged") && err.contains("the text is not at fault"), "{err}");
    assert!(!err.contains("panicked at"), "the crate's panic was printed as a crash:\n{err}");
}
