"""Byte-level BPE facts: GPT-2's reversible byte <-> printable-character map (the spelling of every byte-level
vocabulary: GPT-2, Qwen, Llama 3), and BPE ranks <-> merges. Used by the tokenizer, the detokenizer and the
default bundle's builder."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any


def _gpt2_byte_to_char() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR: dict[int, str] = _gpt2_byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}


def bytes_to_token_string(raw: bytes) -> str:
    """How a byte-level vocabulary spells ``raw`` (``b' the'`` -> ``'Ġthe'``)."""
    return "".join(BYTE_TO_CHAR[b] for b in raw)


# str.translate table: GPT-2 characters -> the code point of their byte; other low code points -> 0x100 so
# that the latin-1 encode below rejects them (a C loop, ~10x faster than a Python per-character lookup).
_TO_LATIN1 = {ord(c): b for c, b in CHAR_TO_BYTE.items()}
_TO_LATIN1.update({cp: 0x100 for cp in range(256) if cp not in _TO_LATIN1})


def byte_level_token_bytes(token: str) -> bytes:
    """What the ByteLevel decoder turns one token string into (unmapped characters pass as UTF-8)."""
    out = bytearray()
    for ch in token:
        b = CHAR_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def token_string_to_bytes(token: str) -> bytes | None:
    """The bytes a byte-level vocabulary entry stands for; None if it is not a byte-level spelling."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return None


def byte_level_ranks(vocab: dict[str, int]) -> dict[bytes, int] | None:
    """The vocabulary as tiktoken ranks (bytes -> id); None unless every entry is a byte-level spelling."""
    spellings = list(vocab)
    # One translate over the whole vocabulary, then cut: each spelled character is exactly one byte.
    blob = token_string_to_bytes("".join(spellings))
    if blob is None:
        return None
    ends = list(itertools.accumulate(map(len, spellings)))
    starts = [0, *ends[:-1]]
    return dict(zip([blob[a:b] for a, b in zip(starts, ends)], vocab.values()))


def lower_rank_split(token: bytes, rank: int, ranks: dict[bytes, int]) -> list[bytes]:
    """Byte-pair-encode ``token`` with only the ranks below its own (lowest rank first, leftmost on ties).

    For a token BPE can reach, two parts remain: the one merge that builds it. The same rule tiktoken
    applies, so a vocabulary whose merges are exactly these pairs tokenizes identically in both libraries.
    """
    if len(token) == 2:
        return [token[:1], token[1:]]
    parts = [token[i:i + 1] for i in range(len(token))]
    get = ranks.get
    # A pair that is not a token, or not below ``rank``, gets ``rank`` (never merged).
    pair_ranks = [min(get(parts[i] + parts[i + 1], rank), rank) for i in range(len(parts) - 1)]
    while len(parts) > 2:
        best = min(pair_ranks)
        if best >= rank:
            break
        i = pair_ranks.index(best)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = min(get(parts[i - 1] + parts[i], rank), rank)
        if i < len(parts) - 1:
            pair_ranks[i] = min(get(parts[i] + parts[i + 1], rank), rank)
    return parts


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list equivalent to tiktoken-style ranks: one per multi-byte token, in rank order."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = lower_rank_split(token, rank, ranks)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) cannot be reached by merging lower ranks")
        merges.append((parts[0], parts[1]))
    return merges


def byte_level_bpe_spec(ranks: dict[bytes, int], split_regex: str, added_tokens: Sequence[dict[str, Any]] = (),
                       normalizer: dict[str, Any] | None = None) -> dict[str, Any]:
    """A tokenizer.json (as a dict, in ``tokenizers``' key order) for tiktoken-style ranks.

    The inverse of the fast path: vocab through the byte map, one merge per multi-byte token.
    """
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": list(added_tokens),
        "normalizer": normalizer,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split_regex}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {bytes_to_token_string(token): rank for token, rank in ordered},
            "merges": [[bytes_to_token_string(a), bytes_to_token_string(b)] for a, b in merges_from_ranks(ranks)],
        },
    }
