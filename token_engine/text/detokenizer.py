"""One choice's output text, built as its tokens arrive: vLLM's engine-side detokenizer for fast tokenizers.

Decoding is the tokenizers library's ``DecodeStream`` (the prefix/read-offset method in Rust, as vLLM's
``FastIncrementalDetokenizer``), primed with the prompt so the first output token keeps its leading space:
a character split across tokens comes out whole, in the step of the token that completes it. Stop strings
are checked on the text as vLLM's ``BaseIncrementalDetokenizer`` does: after ``min_tokens``, earliest
match first, the text cut before the match (or after it with ``include_stop_str_in_output``), and a stream
holding back ``len(longest stop) - 1`` characters until it knows they are not the start of one.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# tokenizers' error when its stream meets non-monotonic UTF-8 (vLLM resets the stream on it)
INVALID_PREFIX = "Invalid prefix encountered"


@dataclass(frozen=True)
class TextOptions:
    """The request's sampling_params that shape text, with vLLM's defaults."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0


def added_tokens(tokenizer: Tokenizer) -> dict[int, str]:
    """The added tokens' text by id, cached on the tokenizer as vLLM does (read once per tokenizer)."""
    table = getattr(tokenizer, "_splitserve_added_tokens", None)
    if table is None:
        table = {tid: tok.content for tid, tok in tokenizer.get_added_tokens_decoder().items()}
        try:
            tokenizer._splitserve_added_tokens = table  # type: ignore[attr-defined]
        except AttributeError:  # a native object that takes no attributes: recomputed next time
            pass
    return table


class IncrementalText:
    """``update`` with each step's new tokens (returns a matched stop string), ``next_text`` for the text."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], options: TextOptions):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._options = options
        self._stream = DecodeStream(ids=list(prompt_token_ids), skip_special_tokens=options.skip_special_tokens)
        # vLLM: only skip_special_tokens=False with spaces_between_special_tokens=False changes anything
        self._added: dict[int, str] = {}
        if not (options.skip_special_tokens or options.spaces_between_special_tokens):
            self._added = added_tokens(tokenizer)
        self._last_special = False
        self._hold = (max(map(len, options.stop)) - 1
                      if options.stop and not options.include_stop_str_in_output else 0)
        self._sent = 0  # characters of output_text already returned as deltas
        self.token_ids: list[int] = []
        self.output_text = ""

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Decode ``new_token_ids``; a stop string they complete (tokens after it are dropped), or None.

        ``stop_terminated``: the last token ended the sequence as a stop token (EOS or stop_token_ids); its
        text is left out unless include_stop_str_in_output, as vLLM does."""
        if not new_token_ids:
            return None
        opts = self._options
        decode = list(new_token_ids)
        skipped = decode.pop() if stop_terminated and not opts.include_stop_str_in_output else None
        num_prev = len(self.token_ids)
        offsets = [len(self.output_text)] if opts.stop else None  # text length after each new token
        for token_id in decode:
            self.token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
            if offsets is not None:
                offsets.append(len(self.output_text))
        if skipped is not None:
            self.token_ids.append(skipped)
            if offsets is not None:
                offsets.append(len(self.output_text))
        if offsets is None or len(self.token_ids) <= opts.min_tokens:
            return None
        check_from = offsets[max(opts.min_tokens - num_prev, 0)]
        found = check_stop_strings(self.output_text, len(self.output_text) - check_from, opts.stop,
                                   opts.include_stop_str_in_output)
        if found is None:
            return None
        stop, truncate_to = found
        stop_end = len(self.output_text) if truncate_to == -1 else truncate_to
        if not opts.include_stop_str_in_output:
            stop_end += len(stop)
        del self.token_ids[num_prev + bisect_left(offsets, stop_end, lo=1):]
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop

    def next_text(self, finished: bool) -> str:
        """The text since the previous call, less what may still turn out to start a stop string."""
        length = len(self.output_text) - (0 if finished else self._hold)
        if self._sent >= length:
            return ""
        text, self._sent = self.output_text[self._sent:length], length
        return text

    def _decode_next(self, token_id: int) -> str:
        token = self._step(token_id)
        if self._added:
            special = self._added.get(token_id)
            if special is not None and self._last_special:
                token = special  # no space between two special tokens
            self._last_special = special is not None
        return token or ""

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except (OverflowError, TypeError):
            return None  # an id the tokenizer cannot take: no text, as vLLM
        except Exception as exc:
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._options.skip_special_tokens)
            return self._stream.step(self._tokenizer, token_id)


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """(stop string, length to cut the text to or -1) for the stop string completed earliest in the last
    ``new_char_count`` characters, ties in list order; None when none is (vLLM's check_stop_strings)."""
    if not new_char_count or not stop:
        return None
    best: str | None = None
    best_index = 0
    best_end = sys.maxsize
    for s in stop:
        index = output_text.find(s, 1 - new_char_count - len(s))
        if index != -1 and index + len(s) < best_end:
            best, best_index, best_end = s, index, index + len(s)
    if best is None:
        return None
    if include_in_output:
        return (best, -1) if best_end >= len(output_text) else (best, best_end)
    return best, best_index
