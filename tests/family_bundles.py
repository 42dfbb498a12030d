"""Test bundles for model families whose tokenizer no package ships (GLM, MiniMax-M2, Seed-OSS).

These are TEST tokenizers, not the models' own: Qwen3's byte-level BPE (the real file from shared/fixtures)
with the family's special tokens added at the family's ids. Chat templates are the models' real ones
(tests/fixtures/templates, sources in its README). Qwen3 XML uses Qwen3's real tokenizer unchanged.

Special-token ids:
* GLM-4.5/4.6/4.7 (zai-org tokenizer_config): <|endoftext|> 151329, [gMASK] 151331, <sop> 151333,
  <|system|> 151335, <|user|> 151336, <|assistant|> 151337, <|observation|> 151338, <think> 151350,
  </think> 151351 (corroborated in public code); <tool_call> .. </arg_value> 151352..151359 and /nothink
  151360 follow in the same block (from the model's tokenizer_config as we remember it; not corroborated).
  Qwen's BPE ids from 151329 up are dropped so the specials do not collide.
* MiniMax-M2: ]!p~[ 200000, ]~b] 200019, [e~[ 200020, ]!d~[ 200021, ]~!b[ 200034, <think> 200050,
  </think> 200051, <minimax:tool_call> 200052, </minimax:tool_call> 200053 (corroborated in public code).
* Seed-OSS: <seed:bos> 0 (corroborated); <seed:pad> 1, <seed:eos> 2 and the think / budget / tool-call tags
  3..8 are ASSUMED (the searchable sources do not list them). Qwen's BPE ids are shifted up by 9.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

from render_service.tiktoken_fast_path import remember_merge_proof
from tests.shared_paths import QWEN3_FIXTURE_DIR

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"

GLM_SPECIALS = [
    (151329, "<|endoftext|>", True), (151330, "[MASK]", True), (151331, "[gMASK]", True),
    (151332, "[sMASK]", True), (151333, "<sop>", True), (151334, "<eop>", True), (151335, "<|system|>", True),
    (151336, "<|user|>", True), (151337, "<|assistant|>", True), (151338, "<|observation|>", True),
    (151350, "<think>", False), (151351, "</think>", False), (151352, "<tool_call>", False),
    (151353, "</tool_call>", False), (151354, "<tool_response>", False), (151355, "</tool_response>", False),
    (151356, "<arg_key>", False), (151357, "</arg_key>", False), (151358, "<arg_value>", False),
    (151359, "</arg_value>", False), (151360, "/nothink", False),
]
MINIMAX_SPECIALS = [
    (200000, "]!p~[", True), (200019, "]~b]", True), (200020, "[e~[", True), (200021, "]!d~[", True),
    (200034, "]~!b[", True), (200050, "<think>", False), (200051, "</think>", False),
    (200052, "<minimax:tool_call>", False), (200053, "</minimax:tool_call>", False),
]
SEED_SPECIALS = [
    (0, "<seed:bos>", True), (1, "<seed:pad>", True), (2, "<seed:eos>", True), (3, "<seed:think>", False),
    (4, "</seed:think>", False), (5, "<seed:cot_budget_reflect>", False),
    (6, "</seed:cot_budget_reflect>", False), (7, "<seed:tool_call>", False), (8, "</seed:tool_call>", False),
]

# family -> (template file, specials, BPE ids kept below, BPE id shift, tokenizer_config extras)
FAMILIES = {
    "glm45": ("glm-4.6.jinja", GLM_SPECIALS, 151329, 0,
              {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, [151329, 151336, 151338]),
    "glm47": ("glm-4.7-flash.jinja", GLM_SPECIALS, 151329, 0,
              {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, [151329, 151336, 151338]),
    "minimax_m2": ("minimax-m2.jinja", MINIMAX_SPECIALS, None, 0,
                   {"bos_token": "]~!b[", "eos_token": "[e~[", "pad_token": "]!p~["}, [200020]),
    "seed_oss": ("seed-oss.jinja", SEED_SPECIALS, None, 9,
                 {"bos_token": "<seed:bos>", "eos_token": "<seed:eos>", "pad_token": "<seed:pad>"}, [2]),
}


@functools.lru_cache(maxsize=1)
def _qwen3_tokenizer_json() -> dict:
    return json.loads((QWEN3_FIXTURE_DIR / "tokenizer.json").read_text(encoding="utf-8"))


def _tokenizer_json(specials, keep_below: int | None, shift: int) -> dict:
    spec = json.loads(json.dumps(_qwen3_tokenizer_json()))
    model = spec["model"]
    vocab = {tok: i + shift for tok, i in model["vocab"].items() if keep_below is None or i < keep_below}
    model["vocab"] = vocab
    model["merges"] = [m for m in model["merges"] if (m[0] + m[1] if isinstance(m, list) else m.replace(" ", "", 1))
                       in vocab]
    spec["added_tokens"] = [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": s} for i, c, s in specials
    ]
    return spec


def _cached_tokenizer_bytes(family: str) -> bytes:
    """Building the file takes seconds: it is kept under $SPLITSERVE_CACHE/test-tokenizers by content key."""
    _, specials, keep_below, shift, _, _ = FAMILIES[family]
    key = hashlib.sha256(json.dumps([specials, keep_below, shift]).encode()
                         + (QWEN3_FIXTURE_DIR / "tokenizer.json").read_bytes()[:4096]).hexdigest()[:16]
    cache = Path(os.environ.get("SPLITSERVE_CACHE") or Path.home() / ".cache" / "splitserve") / "test-tokenizers"
    path = cache / f"{family}-{key}.json"
    try:
        return path.read_bytes()
    except OSError:
        pass
    data = json.dumps(_tokenizer_json(specials, keep_below, shift), ensure_ascii=False).encode("utf-8")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
    return data


def write_family_bundle(family: str, root: Path) -> Path:
    """A bundle directory for ``family`` (a key of FAMILIES, or "qwen3_xml") under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    if family == "qwen3_xml":
        for name in ("tokenizer.json", "config.json", "generation_config.json"):
            (root / name).write_bytes((QWEN3_FIXTURE_DIR / name).read_bytes())
        config = json.loads((QWEN3_FIXTURE_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["chat_template"] = (TEMPLATES / "qwen3-coder.jinja").read_text(encoding="utf-8")
        (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        return root
    template, specials, keep_below, shift, extras, eos_ids = FAMILIES[family]
    tokenizer_bytes = _cached_tokenizer_bytes(family)
    (root / "tokenizer.json").write_bytes(tokenizer_bytes)
    # A subset of Qwen3's proven merges (ids shifted by a constant): still every token's lower-rank split.
    remember_merge_proof(hashlib.sha256(tokenizer_bytes).hexdigest())
    config = {
        "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": s} for i, c, s in specials},
        "chat_template": (TEMPLATES / template).read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        **extras,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}), encoding="utf-8")
    (root / "config.json").write_text(json.dumps({"model_type": family, "max_position_embeddings": 131072}),
                                      encoding="utf-8")
    return root
