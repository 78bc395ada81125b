//! `ava data train-tokenizer`: a byte-level BPE tokenizer.json learned from text
//! (`ava_data::bpe`).

use std::time::Instant;

use ava_data::bpe;
use serde_json::json;

use crate::cli::TrainTokenizerArgs;
use crate::output::Printer;
use crate::{CmdResult, Failure};

pub fn run(p: &Printer, args: &TrainTokenizerArgs) -> CmdResult {
    ava_train::memory::stop_counting(); // as in `ava data prepare`
    if args.out.exists() && !args.force {
        return Err(Failure::Usage(anyhow::anyhow!(
            "{} exists; choose another --out, or pass --force to replace it",
            args.out.display()
        )));
    }
    let reading = args.reading.reading();
    p.note(&format!("learning {} ids of byte-level BPE ...", args.vocab_size));
    let start = Instant::now();
    let trained = bpe::train(&args.inputs, &reading, args.vocab_size, args.max_bytes, &args.out)
        .map_err(|e| Failure::Usage(anyhow::anyhow!(e)))?;
    let seconds = start.elapsed().as_secs_f64();
    p.result(
        || {
            format!(
                "wrote {}: byte-level BPE of {} ids (end of text: {}), learned from {} documents ({:.1} MB{}) in \
                 {:.1} s\nprepare a corpus with it: ava data prepare INPUT... --tokenizer {} --out DIR",
                args.out.display(),
                trained.vocab_size,
                bpe::END_OF_TEXT,
                trained.documents,
                trained.bytes as f64 / 1e6,
                if trained.truncated { ", the first --max-bytes of the inputs, which go on" } else { "" },
                seconds,
                args.out.display()
            )
        },
        || {
            json!({"out": args.out, "vocab_size": trained.vocab_size, "documents": trained.documents,
                   "bytes": trained.bytes, "truncated": trained.truncated, "seconds": seconds})
        },
    );
    Ok(())
}
