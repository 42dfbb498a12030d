"""output_mode "text": each choice's engine deltas turned into text, stop strings and decoded logprobs.

One IncrementalText per choice for the whole request (batch and stream alike); a stop string found in a
choice's text ends that choice here and asks the engine to stop its sequence, and whatever the engine
still sends for it is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from token_engine.core.engine import SequenceDelta
from token_engine.core.sequence import TokenLogprob
from token_engine.http import protocol as p
from token_engine.text.detokenizer import IncrementalText, TextOptions
from token_engine.text.token_strings import CONTEXT_TOKENS, token_text

if TYPE_CHECKING:
    from tokenizers import Tokenizer

LOGPROB_FLOOR = -9999.0


def _clamp(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def text_options(sp: p.SamplingParams) -> TextOptions:
    stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    return TextOptions(skip_special_tokens=sp.skip_special_tokens,
                       spaces_between_special_tokens=sp.spaces_between_special_tokens,
                       stop=tuple(s for s in stop if s), include_stop_str_in_output=sp.include_stop_str_in_output,
                       min_tokens=sp.min_tokens)


@dataclass
class TextStep:
    """What one engine delta adds to a choice in text mode."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprob]
    logprob_context: list[int]  # the sampled ids before token_ids (byte-fallback repair of token strings)
    stopped_early: bool  # a stop string ended the choice while the engine still runs it


class TextChoices:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], options: TextOptions, n: int):
        self.tokenizer = tokenizer
        self.choices = [IncrementalText(tokenizer, prompt_token_ids, options) for _ in range(n)]
        self.finished = [False] * n

    def step(self, d: SequenceDelta) -> TextStep | None:
        """None: the choice already ended on a stop string (the engine's late tokens are dropped)."""
        if self.finished[d.index]:
            return None
        choice = self.choices[d.index]
        before = len(choice.token_ids)
        # vLLM leaves out the text of a stop token (EOS or stop_token_ids); a grammar end has none
        stop_terminated = d.finish_reason == "stop" and d.stop_reason is not None
        stop = choice.update(d.token_ids, stop_terminated)
        kept = choice.token_ids[before:]
        finish_reason: str | None = d.finish_reason
        stop_reason: int | str | None = d.stop_reason
        if stop is not None:
            finish_reason, stop_reason = "stop", stop
        self.finished[d.index] = finish_reason is not None
        return TextStep(kept, choice.next_text(finish_reason is not None), finish_reason, stop_reason,
                        d.logprobs[:len(kept)], choice.token_ids[max(before - CONTEXT_TOKENS, 0):before],
                        stop is not None and d.finish_reason is None)

    def text(self, index: int) -> str:
        return self.choices[index].output_text

    def logprobs(self, entries: list[TokenLogprob], context: list[int]) -> p.ChatCompletionLogProbs:
        """vLLM's ChatCompletionLogProbs: decoded token strings with their UTF-8 bytes; each token is read
        after the sampled tokens before it, as vLLM's logprobs processor does."""
        context = list(context)
        content = []
        for e in entries:
            token = token_text(self.tokenizer, e.token_id, context)
            top = []
            for t, lp in e.top:
                alt = token_text(self.tokenizer, t, context)
                top.append(p.LegacyTopLogprob(alt, _clamp(lp), list(alt.encode("utf-8", errors="replace"))))
            content.append(p.LegacyTokenLogprobEntry(token, _clamp(e.logprob), top,
                                                     list(token.encode("utf-8", errors="replace"))))
            context.append(e.token_id)
        return p.ChatCompletionLogProbs(content=content)
