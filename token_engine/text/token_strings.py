"""Logprob token strings: one token's text, as vLLM's logprobs processor decodes it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Preceding sampled ids used to repair a token that decodes to a partial UTF-8 character (vLLM: 4).
CONTEXT_TOKENS = 4
REPLACEMENT = "\ufffd"


def token_text(tokenizer: Tokenizer, token_id: int, context: Sequence[int]) -> str:
    """``token_id`` decoded alone (special tokens kept), with vLLM's byte-fallback repair: a token that decodes
    to a partial character is decoded again after up to 4 preceding sampled ids (``context``); if that completes
    the character the token carries all of it, else its text is ""."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if not text.endswith(REPLACEMENT):
        return text
    for size in range(1, min(len(context), CONTEXT_TOKENS) + 1):
        window = list(context[-size:])
        full = tokenizer.decode([*window, token_id], skip_special_tokens=False)
        if full.endswith(REPLACEMENT):
            continue
        clean_end = len(window)
        while clean_end and tokenizer.decode([window[clean_end - 1]], skip_special_tokens=False).endswith(REPLACEMENT):
            clean_end -= 1
        prefix = tokenizer.decode(window[:clean_end], skip_special_tokens=False) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0  # normalization changed the prefix: cut at the longest common one, as vLLM
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""
