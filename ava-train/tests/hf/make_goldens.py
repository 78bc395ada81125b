#!/usr/bin/env python3
"""Golden Hugging Face folders for ava-train/tests/hf_golden.rs.

Each case is a tiny model built and saved by transformers itself (config.json +
model.safetensors), plus expected.safetensors: the input ids and the logits transformers
computes for them (f32, eager attention). Folders marked "4.x form" have their RoPE fields
rewritten from transformers 5's `rope_parameters` into transformers 4's top-level
`rope_theta` + `rope_scaling`; the script checks transformers 5 gives the same logits from
both forms before writing.

Made with (2026-11-24): transformers 5.24.0, torch 2.15.0 (CPU), Python 3.11:

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors
    /tmp/hf/bin/python ava-train/tests/hf/make_goldens.py            # rewrites the folders

Checking folders with another transformers (e.g. 4.57, or folders Ava wrote):

    /tmp/hf/bin/python ava-train/tests/hf/make_goldens.py --check DIR [DIR ...]

Each DIR holds config.json, *.safetensors and expected.safetensors; the script loads it with
AutoModelForCausalLM and prints the largest logit difference (exit 1 above 1e-4).
"""

import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))

# hidden 32 with 2 heads of 16: eight rotary frequencies, so every band of llama3 and the
# whole yarn ramp are exercised.
BASE = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=48,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)

# name, config class, fields over BASE, form of the RoPE fields ("5" or "4"), sequence length
CASES = [
    ("llama-theta-v5", "LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), "5", 16),
    ("llama-linear-v4", "LlamaConfig", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}), "4", 16),
    (
        "llama-dynamic-v5",
        "LlamaConfig",
        dict(max_position_embeddings=8, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        "5",
        16,
    ),
    (
        "llama3-v4",
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
        "4",
        16,
    ),
    (
        "llama-yarn-v5",
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "truncate": False,
            }
        ),
        "5",
        16,
    ),
    (
        "llama-yarn-mscale-v4",
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 8,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
            }
        ),
        "4",
        16,
    ),
    (
        "llama-bias-headdim-tied-v5",
        "LlamaConfig",
        dict(attention_bias=True, mlp_bias=True, head_dim=24, tie_word_embeddings=True),
        "5",
        12,
    ),
    ("mistral-window-v5", "MistralConfig", dict(sliding_window=6, num_key_value_heads=1), "5", 16),
    (
        "mixtral-v5",
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, num_key_value_heads=1),
        "5",
        12,
    ),
    ("qwen2-v4", "Qwen2Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True), "4", 12),
]


def build(cls_name, fields, seed):
    config = getattr(transformers, cls_name)(**{**BASE, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    # Weights far from transformers' small init, so attention is sharp and a wrong rotation,
    # window or bias moves the logits well past the tests' tolerance.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn_like(p) * 1.5 / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p))
    return model


def to_v4_form(config):
    """transformers 4's fields: rope_theta at the top, the scaling (if any) in rope_scaling."""
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    if rope.get("rope_type") == "linear":
        rope["type"] = rope.pop("rope_type")  # the oldest spelling
    return config


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def make():
    for i, (name, cls_name, fields, form, seq) in enumerate(CASES):
        out = os.path.join(HERE, name)
        model = build(cls_name, fields, seed=100 + i)
        torch.manual_seed(200 + i)
        ids = torch.randint(0, BASE["vocab_size"], (2, seq))
        logits = logits_of(model, ids)
        model.save_pretrained(out, safe_serialization=True)
        path = os.path.join(out, "config.json")
        with open(path) as f:
            config = json.load(f)
        if form == "4":
            config = to_v4_form(config)
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        for extra in os.listdir(out):
            if extra not in ("config.json", "model.safetensors"):
                os.remove(os.path.join(out, extra))  # generation_config.json: not needed
        # transformers 5 reads the folder back to the same logits, in either form.
        back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
        diff = (logits_of(back, ids) - logits).abs().max().item()
        assert diff == 0.0, f"{name}: the saved folder gives other logits ({diff})"
        save_file(
            {"input_ids": ids.contiguous(), "logits": logits.contiguous()},
            os.path.join(out, "expected.safetensors"),
            metadata={"transformers": transformers.__version__, "torch": torch.__version__, "case": name},
        )
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        print(f"{name:28} {cls_name:14} form {form}  T {seq:2}  {size / 1024:6.1f} KiB  |logits| max {logits.abs().max():.2f}")


def check(dirs):
    worst = 0.0
    for d in dirs:
        expected = load_file(os.path.join(d, "expected.safetensors"))
        model = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float().eval()
        diff = (logits_of(model, expected["input_ids"]) - expected["logits"]).abs().max().item()
        worst = max(worst, diff)
        print(f"transformers {transformers.__version__}: {d}: max |logit difference| {diff:.3g}")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", nargs="+", metavar="DIR", help="compare folders against their expected.safetensors")
    args = ap.parse_args()
    sys.exit(check(args.check) if args.check else make())
