"""gpt-oss's token vocabulary (o200k_harmony) and OpenAI's Harmony encoding, offline.

``openai-harmony`` (the reference renderer and the one we run) loads ``o200k_base.tiktoken`` at first use:
from ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`` when that variable is set (and then checks the file's
sha256), else by downloading it, which cannot happen here. No package ships that file, but the bundle's own
tokenizer.json holds the same 199,998 ranks: we write them out in tiktoken's format (``base64(token) rank``
per line), check the sha256 openai-harmony expects, and point the variable at the directory. The test
bundle's tokenizer.json in turn is built from the o200k ranks the ``quicktok-v1`` package ships
(``render_service.harmony.bundle``).

The special tokens and their ids are openai-harmony's (``src/tiktoken_ext/public_encodings.rs``, v0.0.8).
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitserve_common.cache_dir import cache_root

if TYPE_CHECKING:
    from render_service.tokenize.tokenizer import RenderTokenizer

# o200k_base has 199,998 ordinary tokens; the specials start right after.
O200K_BASE_TOKENS = 199998
# sha256 of o200k_base.tiktoken, as openai-harmony (and tiktoken) check it.
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
TIKTOKEN_FILE = "o200k_base.tiktoken"
ENCODINGS_BASE_VAR = "TIKTOKEN_ENCODINGS_BASE"

STARTOFTEXT = 199998
ENDOFTEXT = 199999
RETURN = 200002
CONSTRAIN = 200003
CHANNEL = 200005
START = 200006
END = 200007
MESSAGE = 200008
CALL = 200012
# gpt-oss's vocabulary (config.json vocab_size; the tokenizer's last id is 201087).
VOCAB_SIZE = 201088

# The named specials below 200014 (the rest are <|reserved_N|>); 200018 is o200k's <|endofprompt|>, which
# gpt-oss's tokenizer.json keeps and Harmony calls reserved.
NAMED_SPECIALS = {
    STARTOFTEXT: "<|startoftext|>", ENDOFTEXT: "<|endoftext|>", RETURN: "<|return|>",
    CONSTRAIN: "<|constrain|>", CHANNEL: "<|channel|>", START: "<|start|>", END: "<|end|>",
    MESSAGE: "<|message|>", CALL: "<|call|>", 200018: "<|endofprompt|>",
}

# The ids a bundle must spell this way to be taken for Harmony.
MARKER_IDS = (START, END, MESSAGE, CHANNEL)


class HarmonyUnavailable(RuntimeError):
    """openai-harmony is missing, or its vocabulary cannot be built from this bundle."""


def special_token_text(token_id: int) -> str:
    return NAMED_SPECIALS.get(token_id) or f"<|reserved_{token_id}|>"


def is_harmony_tokenizer(tokenizer: RenderTokenizer) -> bool:
    """The tokenizer spells Harmony's markers at Harmony's ids (gpt-oss's tokenizer.json does)."""
    try:
        return all(tokenizer.token_to_id(NAMED_SPECIALS[i]) == i for i in MARKER_IDS)
    except Exception:  # a tokenizer without token_to_id is not ours to judge
        return False


def harmony_renderer_id() -> str:
    """What stands for the chat template in the configuration fingerprint of a Harmony bundle: tiers that
    render with different openai-harmony versions may differ, so they must not pass for one another."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"harmony/openai-harmony {version('openai-harmony')}"
    except PackageNotFoundError:
        return "harmony/openai-harmony missing"


def tiktoken_file_bytes(ranks: dict[bytes, int]) -> bytes:
    """o200k_base.tiktoken's exact bytes from the o200k ranks (checked against openai-harmony's hash)."""
    ordered = sorted((rank, token) for token, rank in ranks.items() if rank < O200K_BASE_TOKENS)
    if len(ordered) != O200K_BASE_TOKENS or ordered[-1][0] != O200K_BASE_TOKENS - 1:
        raise HarmonyUnavailable(f"the vocabulary has {len(ordered)} ranks below {O200K_BASE_TOKENS}, "
                                 f"not o200k_base's {O200K_BASE_TOKENS}")
    data = b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in ordered)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise HarmonyUnavailable(f"the vocabulary is not o200k_base (sha256 {digest}, not {O200K_BASE_SHA256})")
    return data


def ranks_from_tokenizer(tokenizer: RenderTokenizer) -> dict[bytes, int]:
    from render_service.tokenize.byte_level import byte_level_ranks

    ranks = byte_level_ranks(tokenizer.hf.get_vocab(with_added_tokens=False))
    if ranks is None:
        raise HarmonyUnavailable("the tokenizer is not byte-level BPE, so it cannot be o200k")
    return ranks


def _cache_dir() -> Path:
    return cache_root() / "tiktoken"


def ensure_tiktoken_dir(tokenizer: RenderTokenizer) -> Path:
    """A directory holding o200k_base.tiktoken for openai-harmony (written once from the tokenizer)."""
    given = os.environ.get(ENCODINGS_BASE_VAR)
    if given and (Path(given) / TIKTOKEN_FILE).is_file():
        return Path(given)
    directory = _cache_dir()
    target = directory / TIKTOKEN_FILE
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_BASE_SHA256:
        return directory
    data = tiktoken_file_bytes(ranks_from_tokenizer(tokenizer))
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".o200k.", dir=directory)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, target)  # atomic: concurrent writers write the same bytes
    return directory


_LOCK = threading.Lock()
_ENCODING: Any = None


def harmony_encoding(tokenizer: RenderTokenizer) -> Any:
    """openai-harmony's HARMONY_GPT_OSS encoding, loaded once per process from local files only."""
    global _ENCODING
    with _LOCK:
        if _ENCODING is not None:
            return _ENCODING
        try:
            import openai_harmony
        except ImportError as exc:
            raise HarmonyUnavailable("gpt-oss bundles need the openai-harmony package") from exc
        directory = ensure_tiktoken_dir(tokenizer)
        # openai-harmony reads the variable when it loads the vocabulary (once, here).
        os.environ[ENCODINGS_BASE_VAR] = str(directory)
        try:
            _ENCODING = openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as exc:  # openai_harmony.HarmonyError and friends
            raise HarmonyUnavailable(f"openai-harmony could not load o200k_harmony from {directory}: {exc}") from exc
        return _ENCODING


def harmony_parser_flags(reasoning_parser: str | None, tool_call_parser: str | None) -> tuple[str, str | None]:
    """A gpt-oss bundle's parsers: Harmony's own (vLLM's names), whatever the flags left unset."""
    if reasoning_parser not in (None, "openai_gptoss"):
        raise ValueError(f"this is a gpt-oss (Harmony) bundle: --reasoning-parser must be openai_gptoss, "
                         f"not {reasoning_parser}")
    if tool_call_parser not in (None, "openai"):
        raise ValueError(f"this is a gpt-oss (Harmony) bundle: --tool-call-parser must be openai, "
                         f"not {tool_call_parser}")
    return "openai_gptoss", tool_call_parser
