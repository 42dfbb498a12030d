"""Which message each token of a rendered prompt came from, and whether the model generated it (loss masks).

Boundaries come from the template itself: message ``i`` starts where the render of the messages before it stops
agreeing with the whole render, and an assistant message's own text starts after the header the template writes
as its generation prompt. A template with ``{% generation %}`` blocks marks assistant tokens itself (vLLM's
``return_assistant_tokens_mask``, ``templates.assistant_token_mask``); others are marked from those boundaries.
Tokens after the last message (the generation prompt) belong to index ``len(messages)``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from render_service.extend.bridge import common_prefix
from render_service.templates import assistant_token_mask


@dataclass
class TextTurns:
    """Character boundaries of a render: ``starts[i]`` where message i starts, ``own[i]`` where an assistant
    message's own text starts (after its header; None for other roles), ``end`` where the generation prompt
    starts; ``spans``: the template's ``{% generation %}`` spans, when it has them."""

    starts: list[int]
    own: list[int | None]
    end: int
    spans: list[tuple[int, int]] | None = None

    def attribute(self, offsets: Sequence[tuple[int, int]], base: int = 0) -> tuple[list[int], list[int]]:
        """(message index, assistant flag) per token, given each token's character offsets (plus ``base``)."""
        starts = self.starts
        indices: list[int] = []
        flags: list[int] = []
        count = len(starts)
        for start, _ in offsets:
            at = start + base
            if at >= self.end:
                indices.append(count)
                flags.append(0)
                continue
            i = max(0, bisect.bisect_right(starts, at) - 1)
            indices.append(i)
            own = self.own[i]
            flags.append(1 if own is not None and at >= own else 0)
        if self.spans is not None:
            flags = assistant_token_mask([(s + base, e + base) for s, e in offsets], self.spans)
        return indices, flags


def text_turns(render: Callable[..., str], messages: list[dict[str, Any]], arguments: dict[str, Any],
               full: str, spans: list[tuple[int, int]] | None = None) -> TextTurns:
    """The boundaries of ``full`` (the render of ``messages`` with ``arguments``): one render per message."""
    closed = dict(arguments, add_generation_prompt=False)
    opened = dict(arguments, add_generation_prompt=True)

    def agreeing(head: list[dict[str, Any]], args: dict[str, Any]) -> int | None:
        if not head:
            return None
        try:
            return common_prefix(full, render(head, **args))
        except Exception:  # a template that refuses a partial conversation (say, one ending on a tool call)
            return None

    starts = [0]
    own: list[int | None] = []
    for i in range(1, len(messages)):
        at = agreeing(messages[:i], closed)
        starts.append(max(starts[-1], at if at is not None else starts[-1]))
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            own.append(None)
            continue
        at = agreeing(messages[:i], opened) if i else None
        own.append(max(starts[i], at) if at is not None else starts[i])
    end = len(full)
    if arguments.get("add_generation_prompt"):
        at = agreeing(messages, closed)
        end = max(starts[-1], at) if at is not None else end
    return TextTurns(starts, own, end, spans or None)
