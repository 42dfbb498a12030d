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

from render_service.extend.bridge import PROBE, common_prefix, common_suffix, like_messages
from render_service.templates.chat_template import assistant_token_mask


@dataclass
class TextTurns:
    """Character boundaries of a render: ``starts[i]`` where message i starts, ``own[i]`` where an assistant
    message's own text starts (after its header; None for other roles) and ``own_ends[i]`` where it ends, ``end``
    where the generation prompt starts; ``spans``: the template's ``{% generation %}`` spans, when it has them."""

    starts: list[int]
    own: list[int | None]
    end: int
    own_ends: list[int]
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
            flags.append(1 if own is not None and own <= at < self.own_ends[i] else 0)
        if self.spans is not None:
            flags = assistant_token_mask([(s + base, e + base) for s, e in offsets], self.spans)
        return indices, flags


def text_turns(render: Callable[..., str], messages: list[dict[str, Any]], arguments: dict[str, Any],
               full: str, spans: list[tuple[int, int]] | None = None, end_markers: Sequence[str] = (),
               first: int = 0) -> TextTurns:
    """The boundaries of ``full`` (the render of ``messages`` with ``arguments``), one render per message: message
    i replaced by a probe of its role (``bridge.PROBE`` as its only content) agrees with ``full`` up to where
    message i's own text starts and again from where it ends. Between two messages' own texts, the close up to
    the first end-of-turn marker (``end_markers``: the bundle's EOS tokens, which the model samples) belongs to
    the earlier message (and is in an assistant's mask), the rest (the next header) to the later one.

    ``first``: only messages from that index on are probed (the caller attributes only text after the end of
    message ``first - 1``); the boundaries of the others are left at 0."""
    begins: list[int | None] = []
    ends: list[int] = []
    at = 0
    for i, message in enumerate(messages):
        if i < first:
            begins.append(None)
            ends.append(0)
            continue
        probe = {key: value for key, value in message.items() if key in ("role", "name", "tool_call_id")}
        probe["content"] = PROBE if isinstance(message.get("content"), (str, type(None))) \
            else [{"type": "text", "text": PROBE}]
        try:
            alt = render(like_messages(messages, [*messages[:i], probe, *messages[i + 1:]]), **arguments)
        except Exception:  # a template that refuses the probe here: the previous boundary stands
            alt = None
        if alt is None or PROBE not in alt:
            begins.append(None)
            ends.append(at)
            continue
        begin = max(at, common_prefix(full, alt))
        at = max(begin, len(full) - common_suffix(full, alt))
        begins.append(begin)
        ends.append(at)
    if arguments.get("add_generation_prompt"):
        try:
            end = max(at, common_prefix(full, render(messages, **dict(arguments, add_generation_prompt=False))))
        except Exception:
            end = at
    else:
        end = len(full)
    # where the next message's own text begins, for each message (the generation prompt after the last)
    next_begin = [end] * len(messages)
    for i in range(len(messages) - 2, -1, -1):
        following = begins[i + 1]
        next_begin[i] = following if following is not None else next_begin[i + 1]
    starts = [0]
    own_ends = list(ends)
    for i in range(len(messages)):
        # (a message not probed keeps 0: nothing before the first probed one is attributed)
        close = close_end(full, ends[i], next_begin[i], end_markers) if i >= first else 0
        own_ends[i] = close
        if i + 1 < len(messages):
            starts.append(close)
    own = [b if m.get("role") == "assistant" else None for b, m in zip(begins, messages, strict=True)]
    return TextTurns(starts, own, end, own_ends, spans or None)


def close_end(full: str, start: int, stop: int, end_markers: Sequence[str]) -> int:
    """Where a message's close ends: after the first end-of-turn marker between its text and the next one's."""
    found = [at + len(marker) for marker in end_markers if marker
             for at in [full.find(marker, start, stop)] if at >= 0]
    return min(found) if found else start
