"""`sampling_params.bad_words`: the request's words as banned token sequences, and the ban at each step.

As vLLM's ``SamplingParams.update_from_tokenizer``: each word (leading spaces stripped) is tokenized as is
and with one leading space, the spaced form kept only when it starts with another token and has as many
tokens; a sequence's last token is banned at a step whose most recent output tokens are the rest of it
(prompt tokens never count, as vLLM's logits processor). Bad words are the one text an engine request
carries: they are tokenized with the model directory's tokenizer.json, loaded by the first request that has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from token_engine.core.model_tokenizer import ModelTokenizer, TokenizerUnavailable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MAX_BAD_WORDS = 128  # token sequences after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS)
MAX_BAD_WORDS_TOTAL_TOKENS = 1024  # summed over those sequences (VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)
MAX_BAD_WORDS_CHARS = 64 * 1024  # ours: bounds the tokenizer's work before it starts

BadWordsIds = tuple[tuple[int, ...], ...]


class BadWordsError(ValueError):
    """A request's bad_words cannot be applied (a 400 naming sampling_params.bad_words)."""


class BadWordsTokenizer:
    """Bad words to token ids with the model's tokenizer (ModelTokenizer: loaded once, on first use)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, tokenizer: ModelTokenizer | None = None):
        self.tokenizer = tokenizer if tokenizer is not None else ModelTokenizer(model_dir)
        self.vocab_size = vocab_size

    def token_ids(self, words: Sequence[str]) -> BadWordsIds:
        """The banned sequences for ``words`` (already checked by bad_words_violation); BadWordsError."""
        tokenizer = self._load()
        out: list[tuple[int, ...]] = []
        for word in dict.fromkeys(words):  # vLLM drops repeated words first
            plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False).ids)
            if not plain:
                raise BadWordsError("bad_words entries must tokenize to at least one token.")
            out.append(plain)
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids)
            # the spaced form only when it is a word of its own, not a space token before the plain one
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
            if len(out) > MAX_BAD_WORDS:
                raise BadWordsError(f"Too many bad words after tokenization: {len(out)}. "
                                    f"The max number is {MAX_BAD_WORDS}.")
        total = sum(map(len, out))
        if total > MAX_BAD_WORDS_TOTAL_TOKENS:
            raise BadWordsError(f"Too many total bad word tokens: {total}. The max is {MAX_BAD_WORDS_TOTAL_TOKENS}.")
        outside = sorted({t for seq in out for t in seq if not 0 <= t < self.vocab_size})
        if outside:
            raise BadWordsError(f"The model vocabulary size is {self.vocab_size}, but the following tokens were "
                                f"specified as bad: {outside}. All token id values should be integers satisfying: "
                                f"0 <= token_id < {self.vocab_size}.")
        return tuple(out)

    def _load(self) -> Tokenizer:
        try:
            return self.tokenizer.get()
        except TokenizerUnavailable as exc:
            if exc.missing:
                raise BadWordsError("bad_words need the model's tokenizer to find their token ids, and this "
                                    "engine's model directory has no tokenizer.json; ban token ids with logit_bias "
                                    "instead.") from None
            raise BadWordsError(f"bad_words: {exc}.") from None


def bad_words_violation(words: Sequence[str]) -> str | None:
    """What is wrong with a request's bad_words before any tokenizing (bounded work), or None."""
    if any(not word for word in words):
        return "bad_words cannot contain an empty string."
    unique = len(set(words))
    if unique > MAX_BAD_WORDS:  # each word gives at least one sequence
        return f"Too many bad words after tokenization: at least {unique}. The max number is {MAX_BAD_WORDS}."
    chars = sum(map(len, words))
    if chars > MAX_BAD_WORDS_CHARS:
        return f"bad_words may hold at most {MAX_BAD_WORDS_CHARS} characters in all, got {chars}."
    return None


def banned_next_tokens(bad_words: BadWordsIds, token_ids: list[int], prompt_len: int) -> tuple[int, ...]:
    """The tokens a sequence may not sample next: O(bad word tokens), whatever the output's length."""
    num_output = len(token_ids) - prompt_len
    banned = []
    for word in bad_words:
        before = len(word) - 1
        if before == 0 or (before <= num_output and tuple(token_ids[-before:]) == word[:-1]):
            banned.append(word[-1])
    return tuple(banned)
