"""Reading tokenizer.json fast: everything but the merges (which only the one-time merge proof needs) as
one typed decode, and the merges on their own."""

from __future__ import annotations

from typing import Any

import msgspec


class _ModelJson(msgspec.Struct):
    type: str = ""
    vocab: dict[str, int] = {}
    dropout: Any = None
    byte_fallback: bool = False
    continuing_subword_prefix: str | None = None
    end_of_word_suffix: str | None = None


class _TokenizerJson(msgspec.Struct):
    model: _ModelJson = msgspec.field(default_factory=_ModelJson)
    normalizer: dict[str, Any] | None = None
    pre_tokenizer: dict[str, Any] | None = None
    decoder: dict[str, Any] | None = None
    added_tokens: list[dict[str, Any]] = []


class _MergesModelJson(msgspec.Struct):
    merges: list[Any] = []


class _MergesJson(msgspec.Struct):
    model: _MergesModelJson = msgspec.field(default_factory=_MergesModelJson)


def read_tokenizer_spec(data: bytes) -> dict[str, Any]:
    """tokenizer.json as a dict without ``model.merges`` (parsing them would double the load time)."""
    parsed = msgspec.json.decode(data, type=_TokenizerJson)
    spec = msgspec.structs.asdict(parsed)
    spec["model"] = msgspec.structs.asdict(parsed.model)
    return spec


def read_merges(data: bytes) -> list[Any]:
    return msgspec.json.decode(data, type=_MergesJson).model.merges
