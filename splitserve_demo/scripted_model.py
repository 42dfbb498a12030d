"""The demo's model: the built-in tiny Qwen3 with weights constructed (not trained) so that greedy decoding
after the demo's prompt emits one scripted answer, with reasoning, a sentence and a hermes tool call.

How: every layer adds nothing to the residual stream (attention and MLP output projections zero, norms one),
so the logits depend on the last token alone: lm_head @ norm(embedding). Each token of the script gets its
own axis of the hidden space (a one-hot embedding) and the head row of its successor points at that axis, so
the model is a bigram chain through the script. That needs the script's tokens to be distinct (checked) and
no more of them than hidden dimensions. Everything else about the model (architecture, tokenizer, chat
template, the engine's kernels) is what a real model runs through.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# After the prompt's last token ("\n" of "<|im_start|>assistant\n", thinking on) the model says this:
SCRIPT = ("<think>The user wants Paris weather; only a live lookup knows that, so I call the tool.</think>"
          "Checking its forecast now:"
          '<tool_call>{"name": "get_weather","arguments":{"city":"Paris"}}</tool_call><|im_end|>')
PROMPT_END = "\n"
CHAIN_WEIGHT = 4.0  # after the final RMSNorm the axis is sqrt(hidden): a logit of 32 against 0 for the rest


def cache_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve")) / "demo"


def write_scripted_model(bundle_dir: Path, out_dir: Path | None = None) -> Path:
    """A model directory (the bundle's tokenizer and template, constructed float32 weights) that answers SCRIPT;
    built once per bundle and script, then reused."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    from token_engine.models.random_model import write_random_model

    tokenizer = Tokenizer.from_file(str(bundle_dir / "tokenizer.json"))
    start = tokenizer.encode(PROMPT_END, add_special_tokens=False).ids
    chain = start[-1:] + tokenizer.encode(SCRIPT, add_special_tokens=False).ids
    if len(set(chain)) != len(chain):
        raise ValueError("a bigram chain needs distinct tokens: the script repeats one")
    key = hashlib.sha256(json.dumps([str(bundle_dir.resolve()), chain]).encode()).hexdigest()[:16]
    out = out_dir or cache_dir() / f"scripted-qwen3-tiny-{key}"
    if (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    write_random_model(tmp, arch="qwen3", preset="tiny", overrides={"tie_word_embeddings": False},
                       tokenizer_dir=bundle_dir, dtype="float32")
    tensors = load_file(str(tmp / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            t.zero_()
        if name.endswith("norm.weight"):
            t.fill_(1.0)
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    if len(chain) > embed.shape[1]:
        raise ValueError(f"{len(chain)} chain tokens need as many hidden dimensions ({embed.shape[1]})")
    head.zero_()  # only a chain successor can win
    for axis, token in enumerate(chain):
        embed[token].zero_()
        embed[token][axis] = 1.0
    for axis, successor in enumerate(chain[1:]):
        head[successor][axis] = CHAIN_WEIGHT
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)  # whole or not at all: a second demo never sees half a model
    return out
