"""mistral: Magistral's ``[THINK]`` ... ``[/THINK]`` reasoning (``--reasoning-parser mistral``).

Unlike the ``<think>`` family, a Magistral reply starts as content: reasoning is only what the model wraps in
``[THINK]`` ... ``[/THINK]`` (vLLM's rule: "if [THINK] is not generated, this parser only returns content").

* content before ``[THINK]`` stays content; a stray ``[/THINK]`` there is dropped (vLLM drops the first in batch
  and every one that arrives as its own token in streaming; we drop every one, in both modes);
* after ``[THINK]``, text is reasoning up to the first ``[/THINK]``, then content (no more tag processing);
* a reply cut off inside ``[THINK]`` is reasoning.

Tags are matched on text with the usual hold-back, so a tag split across chunks behaves like the single
control token mistral_common decodes it from.
"""

from __future__ import annotations

from typing import Any

from render_service.parsers.base import TextPiece
from render_service.parsers.reasoning import (
    AWAIT_START,
    CONTENT,
    REASONING,
    ThinkReasoningParser,
    ThinkState,
    _partial_suffix_len,
)

BEGIN_THINK = "[THINK]"
END_THINK = "[/THINK]"
_BEFORE_THINK = (BEGIN_THINK, END_THINK)


class MistralReasoningParser(ThinkReasoningParser):
    """AWAIT_START here means "content until the model opens [THINK]"."""

    name = "mistral"
    start_tag = BEGIN_THINK
    end_tag = END_THINK

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True  # Magistral thinks when its system prompt asks it to; the output's tags say whether it did

    def initial_state(self) -> ThinkState:
        cfg = self.config
        if not cfg.enable_thinking or not cfg.reasoning_open_at_start:
            return ThinkState(mode=CONTENT)
        return ThinkState(mode=AWAIT_START)

    def feed(self, state: ThinkState, text: str) -> list[TextPiece]:
        if state.mode == CONTENT and not state.held:
            return [TextPiece("content", text)] if text else []
        buf = state.held + text if state.held else text
        state.held = ""
        out: list[TextPiece] = []
        if state.mode == AWAIT_START:
            buf = self._before_think(state, buf, out)
            if state.mode == AWAIT_START:
                return out
        if state.mode == REASONING:
            buf = self._reasoning(state, buf, out)
        if state.mode == CONTENT and buf:
            out.append(TextPiece("content", buf))
        return out

    def finish(self, state: ThinkState) -> list[TextPiece]:
        held, state.held = state.held, ""
        if not held:
            return []
        return [TextPiece("reasoning" if state.mode == REASONING else "content", held)]

    def _before_think(self, state: ThinkState, buf: str, out: list[TextPiece]) -> str:
        """Content up to [THINK] (stray [/THINK] dropped); returns the text after [THINK] once it opened."""
        content: list[str] = []
        pos = 0
        while True:
            start = buf.find(BEGIN_THINK, pos)
            stray = buf.find(END_THINK, pos)
            if stray >= 0 and (start < 0 or stray < start):
                content.append(buf[pos:stray])
                pos = stray + len(END_THINK)
                continue
            if start >= 0:
                content.append(buf[pos:start])
                state.mode = REASONING
                rest = buf[start + len(BEGIN_THINK):]
                break
            keep = _partial_suffix_len(buf[pos:], _BEFORE_THINK)
            content.append(buf[pos:len(buf) - keep])
            state.held = buf[len(buf) - keep:]
            rest = ""
            break
        text = "".join(content)
        if text:
            out.append(TextPiece("content", text))
        return rest
