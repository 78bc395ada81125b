#!/usr/bin/env python3
"""Golden greedy generation for `ava generate`: tiny-llama/ and expected.json.

tiny-llama/ is a tiny Llama saved by transformers itself (config.json, model.safetensors,
generation_config.json) with a byte-level BPE tokenizer.json trained here by the `tokenizers`
library on the fixed text below (ByteLevel pre-tokenizer without prefix space, ByteLevel
decoder, no post-processor: encoding adds no BOS). Its one special token, <|endoftext|>, is
the last id and is both bos_token_id and eos_token_id.

expected.json holds, for each prompt, the prompt ids and the new ids transformers'
`generate(do_sample=False, use_cache=True)` gives (f32, eager attention). The ids are checked
against a plain greedy loop in float64 without a KV cache, and the seed of the weights is the
first one for which every step's top-1 logit beats the top-2 by at least MIN_MARGIN (in
float64) and no case produces <|endoftext|>. So a correct implementation must give exactly
these ids, whether or not it stops at the end-of-text token: generate ran with the folder's
generation_config (eos_token_id 319, which never fired), and again with eos_token_id=None
(which in transformers 5.24 does turn stopping off; min_new_tokens would instead mask the EOS
logit and change the ids). generated_text is tokenizers' decode of the new ids: the ByteLevel
decoder joins the tokens' bytes and decodes them lossily (U+FFFD for bytes that are not UTF-8),
so a random model's text has replacement characters and control characters in it.

Made with (2026-11-25): transformers 5.24.0, torch 2.15.0+cu132 (the plain PyPI wheel, run on
CPU), tokenizers 0.23.3, safetensors 0.8.0, Python 3.11.7:

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors tokenizers
    /tmp/hf/bin/python ava-cli/tests/generate/make_golden.py           # rewrites tiny-llama/ and expected.json

Checking that a folder (e.g. one Ava exported) loads and generates in transformers:

    /tmp/hf/bin/python ava-cli/tests/generate/make_golden.py --check DIR [--prompt "The"] [--max-new-tokens 24]

DIR holds config.json, *.safetensors and tokenizer.json; the script prints the prompt ids, the
new ids and their text as JSON (greedy, with DIR's generation_config, so it stops at EOS).
"""

import argparse
import json
import os
import shutil
import sys

import safetensors
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tiny-llama")

EOT = "<|endoftext|>"
VOCAB = 320  # 256 bytes + 63 merges + <|endoftext|>
MAX_NEW = 24
MIN_MARGIN = 1e-3
PROMPTS = ["The quick brown", "A stitch in time", "The"]  # "The" is a single token

TEXT = """\
The early bird catches the worm, but the second mouse gets the cheese.
A stitch in time saves nine. A penny saved is a penny earned.
The quick brown fox jumps over the lazy dog, and the lazy dog does not mind.
All that glitters is not gold. Actions speak louder than words.
The pen is mightier than the sword. The proof of the pudding is in the eating.
Where there is a will, there is a way. When in Rome, do as the Romans do.

Do not count your chickens before they hatch. Do not put all your eggs in one basket.
The best things in life are free. The grass is always greener on the other side of the fence.
A rolling stone gathers no moss. A watched pot never boils. A friend in need is a friend indeed.
Better late than never. Better safe than sorry. Birds of a feather flock together.
The squeaky wheel gets the grease. The apple does not fall far from the tree.

Fortune favors the bold. Haste makes waste. Honesty is the best policy.
If it is not broken, do not fix it. It is no use crying over spilt milk.
Rome was not built in a day. The road to hell is paved with good intentions.
There is no place like home. Too many cooks spoil the broth. Two heads are better than one.
You can lead a horse to water, but you cannot make it drink. Time and tide wait for no man.
"""

MODEL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def versions():
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }


def train_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 1,  # the special token is added after, as the last id
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT.splitlines(), trainer=trainer)
    tok.add_special_tokens([EOT])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    assert tok.token_to_id(EOT) == VOCAB - 1
    return tok


def build(seed, eot):
    config = transformers.LlamaConfig(vocab_size=VOCAB, bos_token_id=eot, eos_token_id=eot, **MODEL)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.config._attn_implementation = "eager"
    # Weights far from transformers' small init (std 0.02), so the logits are far from flat and
    # greedy decoding has clear winners.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn_like(p) * 1.5 / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p))
    return model


def greedy_f64(model, ids, n):
    """Plain greedy loop, whole sequence recomputed each step; returns new ids and the least top-1/top-2 gap."""
    seq = ids.clone()
    least = float("inf")
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=seq, use_cache=False).logits[0, -1]
            top = torch.topk(logits, 2).values
            least = min(least, (top[0] - top[1]).item())
            seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
    return seq[0, ids.shape[1] :].tolist(), least


def hf_generate(model, ids, n, **kw):
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            use_cache=True,
            **kw,
        )
    return out[0, ids.shape[1] :].tolist()


def make():
    tok = train_tokenizer()
    assert train_tokenizer().to_str() == tok.to_str(), "tokenizer training is not deterministic"
    eot = tok.token_to_id(EOT)
    prompt_ids = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    assert len(prompt_ids[-1]) == 1, prompt_ids[-1]

    seed = 0
    while True:
        model = build(seed, eot)
        double = build(seed, eot).double().eval()
        cases, ok = [], True
        for text, ids in zip(PROMPTS, prompt_ids):
            x = torch.tensor([ids])
            new = hf_generate(model, x, MAX_NEW)
            ref, margin = greedy_f64(double, x, MAX_NEW)
            assert new == ref[: len(new)] or margin < MIN_MARGIN, f"seed {seed}, {text!r}: f32 generate {new} != f64 greedy {ref}"
            ok &= margin >= MIN_MARGIN and len(new) == MAX_NEW and eot not in new
            cases.append(
                {
                    "prompt": text,
                    "prompt_ids": ids,
                    "max_new_tokens": MAX_NEW,
                    "generated_ids": new,
                    "generated_text": tok.decode(new),
                    "min_margin": round(margin, 6),
                }
            )
        why = "" if ok else "  (rejected: a margin under MIN_MARGIN, or <|endoftext|> generated)"
        print(f"seed {seed}: min margins {[c['min_margin'] for c in cases]}{why}")
        if ok:
            break
        seed += 1

    # Turning end-of-text off changes nothing, as it never fires.
    for c in cases:
        x = torch.tensor([c["prompt_ids"]])
        assert hf_generate(model, x, MAX_NEW, eos_token_id=None, pad_token_id=eot) == c["generated_ids"]

    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    model.save_pretrained(OUT, safe_serialization=True)
    for extra in os.listdir(OUT):
        if extra not in ("config.json", "model.safetensors", "generation_config.json"):
            os.remove(os.path.join(OUT, extra))
    tok.save(os.path.join(OUT, "tokenizer.json"))

    # The saved folder, read back through transformers' own loaders, gives the same ids.
    for c in cases:
        assert run_check(OUT, c["prompt"], MAX_NEW)["generated_ids"] == c["generated_ids"]

    expected = {"made_with": versions(), "seed": seed, "cases": cases}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=2, ensure_ascii=False)
        f.write("\n")
    for name in sorted(os.listdir(OUT)):
        print(f"tiny-llama/{name:24} {os.path.getsize(os.path.join(OUT, name)) / 1024:7.1f} KiB")
    return 0


def load_tokenizer(d):
    try:
        tok = transformers.AutoTokenizer.from_pretrained(d)
    except Exception:  # no tokenizer_config.json: build it from tokenizer.json alone
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"))
    return tok


def run_check(d, prompt, n):
    tok = load_tokenizer(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float().eval()
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    new = hf_generate(model, ids, n)
    return {
        "transformers": transformers.__version__,
        "tokenizer": type(tok).__name__,
        "prompt": prompt,
        "prompt_ids": ids[0].tolist(),
        "generated_ids": new,
        "generated_text": tok.decode(new),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", metavar="DIR", help="greedy-generate from a Hugging Face folder and print JSON")
    ap.add_argument("--prompt", default="The")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW)
    args = ap.parse_args()
    if args.check:
        print(json.dumps(run_check(args.check, args.prompt, args.max_new_tokens), ensure_ascii=False))
        sys.exit(0)
    sys.exit(make())
