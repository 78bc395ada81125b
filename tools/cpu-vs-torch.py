#!/usr/bin/env python3
"""Ava's CPU training step beside PyTorch's on the same model, interleaved in one run.

    pip install torch==2.15.0 transformers      # PyTorch's reference (PyPI)
    cargo build --release -p ava-cli
    python3 tools/cpu-vs-torch.py                 # fp32 and bf16, 3 rounds, 2 threads

Each round runs, one after the other, `ava bench train` and PyTorch's reference on the
same model in each precision (fp32, then bf16), so a slow minute on a shared machine hits
both sides of a round alike. The summary gives each round's tokens/s and the ratio
Ava / PyTorch, and the medians over the rounds. With --profile, each side's op-by-op
profile of the last round is printed as well: Ava's profiler scopes (from `ava bench
train`) and PyTorch's own profiler (torch.profiler, self CPU time per op).

PyTorch's reference is what a user of transformers would write: LlamaForCausalLM with
the config's sizes (SDPA attention, the config's embedding tying, no biases), torch.optim.AdamW with
the config's betas, weight decay and learning rate, gradient clipping by
clip_grad_norm_ at the config's train.grad_clip, random tokens of the config's
micro-batch and sequence length, one optimizer step per micro-batch. Its bf16 recipe is
autocast (f32 weights and optimizer, products in bf16: oneDNN's AVX512-BF16 kernels where
the CPU has them), as Ava's train.precision: bf16 keeps f32 master weights. Both sides
count time the same way: the mean step of the measured steps after the warm-up (Ava's
with its profiler's scopes on, as `ava bench train` measures; PyTorch's profile, when
asked for, runs on two more steps after the timed ones).

Prints a human summary; --json FILE writes every measurement. Needs only the standard
library besides torch and transformers (the worker imports them).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def load_config(path, sets):
    """The config's model, data and train values the reference needs, as Ava resolves
    them: `ava config show --format json` (so --set and the defaults apply)."""
    out = subprocess.run(
        [ava_bin(), "config", "show", "-c", path, "--format", "json", *set_args(sets)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    ).stdout
    return {key: entry["value"] for key, entry in json.loads(out).items()}


def ava_bin():
    return os.environ.get("AVA_BIN", os.path.join(ROOT, "target", "release", "ava"))


def set_args(sets):
    return [a for s in sets for a in ("--set", s)]


def run_ava(args, precision):
    sets = args.set + [f"train.precision={precision}"]
    cmd = [ava_bin(), "bench", "train", "-c", args.config, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--format", "json",
           *set_args(sets + [f"train.threads={args.threads}"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"ava bench train failed ({' '.join(cmd)}):\n{proc.stderr}")
    return json.loads(proc.stdout)


def run_torch(args, precision, profile):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--config", args.config,
           "--precision", precision, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), *set_args(args.set)]
    if profile:
        cmd.append("--profile")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"PyTorch's reference failed ({' '.join(cmd)}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker(args):
    """PyTorch's side: one precision, one process (its own thread pool and allocator)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    c = load_config(args.config, args.set)
    cfg = LlamaConfig(
        vocab_size=c["model.vocab_size"], hidden_size=c["model.hidden_size"],
        num_hidden_layers=c["model.num_layers"], num_attention_heads=c["model.num_heads"],
        num_key_value_heads=c["model.num_kv_heads"], intermediate_size=c["model.intermediate_size"],
        rms_norm_eps=c["model.rms_norm_eps"], rope_theta=c["model.rope_theta"],
        tie_word_embeddings=c["model.tie_embeddings"],
        max_position_embeddings=max(4096, c["data.seq_len"]), attention_bias=False, mlp_bias=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    model.train()
    if c["train.gradient_accumulation_steps"] != 1:
        sys.exit("the reference steps once per micro-batch: give --set train.gradient_accumulation_steps=1")
    if c["plugins.optimizer.name"] != "adamw":
        sys.exit(f"the reference steps with AdamW; the config's optimizer is {c['plugins.optimizer.name']}")
    betas = tuple(c.get("plugins.optimizer.betas") or (0.9, 0.999))
    opt = torch.optim.AdamW(model.parameters(), lr=c["train.lr"], betas=betas, weight_decay=c["train.weight_decay"])
    clip = float(c["train.grad_clip"] or 0.0)
    batch, seq = c["train.micro_batch_size"], c["data.seq_len"]
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen) for _ in range(4)]
    bf16 = args.precision == "bf16"

    def step(s):
        b = batches[s % 4]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=b[:, :-1]).logits.float()  # (B, T, vocab)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab_size), b[:, 1:].reshape(-1))
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return float(loss)

    for s in range(args.warmup):
        step(s)
    t0 = time.perf_counter()
    losses = [step(args.warmup + s) for s in range(args.steps)]
    seconds = time.perf_counter() - t0
    tokens = batch * seq * args.steps
    res = dict(tokens_per_sec=tokens / seconds, step_seconds=seconds / args.steps, loss_last=losses[-1],
               torch=torch.__version__, threads=torch.get_num_threads(),
               cpu_capability=torch.backends.cpu.get_cpu_capability())  # ATen's vector level
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for s in range(2):
                step(s)
        rows = []
        for e in prof.key_averages():
            rows.append(dict(op=e.key, self_ms=e.self_cpu_time_total / 1e3 / 2, calls=e.count // 2))
        rows.sort(key=lambda r: -r["self_ms"])
        res["profile"] = rows[:25]
    print(json.dumps(res), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", default="configs/small.yaml", help="Ava config (default configs/small.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as ava's --set (both sides)")
    p.add_argument("--precision", action="append", choices=["fp32", "bf16"],
                   help="precisions to compare (default: fp32 and bf16)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per run (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    p.add_argument("--profile", action="store_true", help="print both sides' op profile of the last round")
    p.add_argument("--json", metavar="FILE", help="write every measurement here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.precision = args.precision[0]
        return worker(args)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        sys.exit(f"PyTorch's side needs torch and transformers ({e}): pip install torch==2.15.0 transformers")
    if not os.path.exists(ava_bin()):
        sys.exit(f"no ava binary at {ava_bin()}: run `cargo build --release -p ava-cli` (or set AVA_BIN)")
    precisions = args.precision or ["fp32", "bf16"]
    rounds = {pr: [] for pr in precisions}
    for r in range(args.rounds):
        last = r == args.rounds - 1
        for pr in precisions:
            ava = run_ava(args, pr)
            torch = run_torch(args, pr, args.profile and last)
            ratio = ava["tokens_per_sec"] / torch["tokens_per_sec"]
            rounds[pr].append(dict(ava=ava, torch=torch, ratio=ratio))
            print(f"round {r + 1} {pr:<4}  Ava {ava['tokens_per_sec']:8.0f} tok/s   PyTorch "
                  f"{torch['tokens_per_sec']:8.0f} tok/s   Ava/PyTorch {ratio:.2f}x", flush=True)
    print()
    first = rounds[precisions[0]][0]
    print(f"{args.config}, {args.threads} threads, {args.steps} steps after {args.warmup} warm-up, "
          f"PyTorch {first['torch']['torch']} (ATen {first['torch']['cpu_capability']}), {time.strftime('%Y-%m-%d')}")
    if first["ava"].get("matmul_path"):
        print(f"Ava's matrix kernels: {first['ava']['matmul_path']}")
    for pr in precisions:
        rs = rounds[pr]
        ratios = [x["ratio"] for x in rs]
        a = statistics.median(x["ava"]["tokens_per_sec"] for x in rs)
        t = statistics.median(x["torch"]["tokens_per_sec"] for x in rs)
        print(f"{pr:<5} median tokens/s: Ava {a:.0f}, PyTorch {t:.0f}; Ava/PyTorch median "
              f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); Ava peak "
              f"{rs[-1]['ava']['memory']['peak'] / 2**20:.1f} MiB")
    if args.profile:
        for pr in precisions:
            last = rounds[pr][-1]
            print(f"\nAva {pr}, ms per step by profiler scope:")
            for row in last["ava"]["profile"][:16]:
                print(f"  {row['scope']:<40} {1e3 * row['seconds_per_step']:8.1f}")
            print(f"PyTorch {pr}, self CPU ms per step by op:")
            for row in last["torch"].get("profile", [])[:16]:
                print(f"  {row['op']:<40} {row['self_ms']:8.1f}  ({row['calls']} calls)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=args.config, sets=args.set, threads=args.threads, rounds=rounds), f, indent=1)


if __name__ == "__main__":
    main()
