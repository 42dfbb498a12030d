"""mistral: Magistral's ``[THINK]`` ... ``[/THINK]`` reasoning (``--reasoning-parser mistral``).

Unlike the ``<think>`` family, a Magistral reply starts as content: reasoning is only what the model wraps in
``[THINK]`` ... ``[/THINK]`` (vLLM's rule: "if [THINK] is not generated, this parser only returns content").

* content before ``[THINK]`` stays content; a stray ``[/THINK]`` there is dropped (vLLM drops the first in batch
  and every one that arrives as its own token in streaming; we drop every one, in both modes);
* after ``[THINK]``, text is reasoning up to the first ``[/THINK]``, then content (no more tag processing);
* a reply cut off inside ``[THINK]`` is reasoning;
* a prompt that already opened ``[THINK]`` is not read as "reasoning open" (Magistral's templates never end
  the prompt that way; the reply would be content until a ``[THINK]``).

Tags are matched on text with the usual hold-back, so a tag split across chunks behaves like the single
control token mistral_common decodes it from.
"""

from __future__ import annotations

from typing import Any

from render_service.parsers.base import TextPiece
from render_service.parsers.reasoning import REASONING, ThinkReasoningParser, ThinkState, _partial_suffix_len

BEGIN_THINK = "[THINK]"
END_THINK = "[/THINK]"
_BEFORE_THINK = (BEGIN_THINK, END_THINK)


class MistralReasoningParser(ThinkReasoningParser):
    """AWAIT_START here means "content until the model opens [THINK]"."""

    name = "mistral"
    start_tag = BEGIN_THINK
    end_tag = END_THINK

    starts_in_content = True

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True  # Magistral thinks when its system prompt asks it to; the output's tags say whether it did

    def _opening(self, state: ThinkState, buf: str, out: list[TextPiece]) -> str:
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
