"""Each token's character span in the text it encodes, from the tokens' bytes instead of a second encode.

Loss masks attribute every token of a prompt to a message by where it starts in the rendered text. ``tokenizers``
gives those offsets only from its own encode, which on a 50k-token prompt costs more than the rest of the render
together. A byte-level BPE token stands for a fixed byte string (``TextTokenizer.token_bytes``), so the ids of a
text spell its UTF-8 bytes one after another: the byte offsets are a running sum of the tokens' byte lengths, and
a byte offset maps to a character offset by counting the characters' first bytes before it. A token that starts
or ends inside a character (a byte-level split of a multi-byte character) gets the character it starts in and
the character it ends in, whole, as ``tokenizers`` reports it.

``char_span_array`` answers None where that does not hold: a tokenizer that is not byte-level, or ids whose bytes are
not the text's own (a normalizer changed it); the caller then asks ``tokenizers``.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

_LENGTHS: weakref.WeakKeyDictionary[Any, np.ndarray | None] = weakref.WeakKeyDictionary()
# per tokenizer: every id's bytes one after another, and where each id's start
_FLAT: weakref.WeakKeyDictionary[Any, tuple[np.ndarray, np.ndarray]] = weakref.WeakKeyDictionary()


def _byte_lengths(tokenizer: Any) -> np.ndarray | None:
    """The byte length of every id's bytes (-1 for an id with none), built once per tokenizer; None for a
    tokenizer that is not byte-level."""
    try:
        return _LENGTHS[tokenizer]
    except KeyError:
        pass
    try:
        lengths: np.ndarray | None = np.asarray(tokenizer.byte_lengths(), dtype=np.int64)
    except (TypeError, AttributeError):  # not byte-level: no fixed bytes per id
        lengths = None
    _LENGTHS[tokenizer] = lengths
    return lengths


def _flat_bytes(tokenizer: Any, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every id's bytes in one array (none for an id without bytes), and where each id's bytes start in it; built
    once per tokenizer (a few MB)."""
    try:
        return _FLAT[tokenizer]
    except KeyError:
        pass
    raw = b"".join(tokenizer.token_bytes(i) if size >= 0 else b"" for i, size in enumerate(lengths.tolist()))
    starts = np.concatenate([[0], np.cumsum(np.maximum(lengths, 0))[:-1]]).astype(np.int64)
    _FLAT[tokenizer] = flat = (np.frombuffer(raw, dtype=np.uint8), starts)
    return flat


def _same_bytes(tokenizer: Any, lengths: np.ndarray, tokens: np.ndarray, sizes: np.ndarray, starts: np.ndarray,
                data: np.ndarray) -> bool:
    """Whether the tokens' bytes, one after another, are ``data`` (whose length is their total): each byte of the
    text against the byte of the token it falls in, gathered from the tokenizer's flat table."""
    flat, begins = _flat_bytes(tokenizer, lengths)
    # byte p of the text is byte (p - starts[j]) of token j, found at begins[tokens[j]] + p - starts[j]
    source = np.repeat(begins[tokens] - starts, sizes) + np.arange(len(data), dtype=np.int64)
    return bool(np.array_equal(flat[source], data))


def char_span_array(tokenizer: Any, text: str, ids: list[int]) -> np.ndarray | None:
    """(start, end) in characters of each of ``ids`` (the encoding of ``text``), an ``(n, 2)`` int64 array (no
    Python object per token); None where the ids' bytes are not ``text``'s (or the tokenizer has no bytes per
    id)."""
    lengths = _byte_lengths(tokenizer)
    if lengths is None:
        return None
    if not ids:
        return np.zeros((0, 2), dtype=np.int64) if not text else None
    tokens = np.asarray(ids, dtype=np.int64)
    if int(tokens.min()) < 0 or int(tokens.max()) >= len(lengths):
        return None
    sizes = lengths[tokens]
    if int(sizes.min()) < 0:
        return None
    raw = text.encode("utf-8")
    ends = np.cumsum(sizes)
    if int(ends[-1]) != len(raw):
        return None
    starts = ends - sizes
    data = np.frombuffer(raw, dtype=np.uint8)
    # The same bytes, not only as many: a normalizer may have changed the text.
    if not _same_bytes(tokenizer, lengths, tokens, sizes, starts, data):
        return None
    first = (data & 0xC0) != 0x80  # a character's first byte
    # char_at[b]: the character byte b belongs to; one more entry for the end of the text
    char_at = np.empty(len(raw) + 1, dtype=np.int64)
    char_at[:-1] = np.cumsum(first) - 1
    char_at[-1] = len(text)
    # a span ends after the character holding its last byte
    last = char_at[np.maximum(ends - 1, 0)] + 1
    char_ends = np.where(sizes > 0, last, char_at[starts])
    return np.stack([char_at[starts], char_ends], axis=1)
