"""granite: IBM Granite's plain-text reasoning phrases (``--reasoning-parser granite``).

Granite writes no tags: a thinking reply is ``Here is my thought process:`` ... ``Here is my response:`` ...
(``Here's`` in either phrase too, as vLLM accepts). vLLM's rules, which we keep:

* the reply must open with the thought-process phrase; anything else makes the whole reply content;
* reasoning runs to the first response phrase; the rest is content. The whitespace after each colon stays
  with the text that follows it;
* a reply cut off before the response phrase is reasoning (vLLM's stream; its batch path, which needs both
  phrases, returns the whole text as content there: we give the stream's answer in both modes).

The phrases are ordinary tokens, so any suffix that could still become one is held back until it resolves.
Leading whitespace before the opening phrase is allowed (and kept out of the reasoning).
"""

from __future__ import annotations

from typing import Any

from render_service.parsers.base import TextPiece
from render_service.parsers.reasoning import (
    CONTENT,
    REASONING,
    ThinkReasoningParser,
    ThinkState,
    _partial_suffix_len,
)

THINK_PHRASES = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_PHRASES = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(ThinkReasoningParser):
    name = "granite"
    thinking_kwarg = "thinking"
    starts_in_content = True
    start_tag = THINK_PHRASES[0]
    end_tag = RESPONSE_PHRASES[0]

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True  # the reply's opening says whether Granite thought (vLLM's parser reads no switch)

    def _opening(self, state: ThinkState, buf: str, out: list[TextPiece]) -> str:
        stripped = buf.lstrip()
        opened = next((p for p in THINK_PHRASES if stripped.startswith(p)), None)
        if opened is not None:
            state.mode = REASONING
            return stripped[len(opened):]
        if any(p.startswith(stripped) for p in THINK_PHRASES):
            state.held = buf  # whitespace and part of the opening phrase so far
            return ""
        state.mode = CONTENT  # not a thinking reply: all of it is content
        return buf

    def _reasoning(self, state: ThinkState, buf: str, out: list[TextPiece]) -> str:
        """Reasoning up to the first response phrase (either spelling); the rest is content."""
        found = [(at, p) for p in RESPONSE_PHRASES if (at := buf.find(p)) >= 0]
        if found:
            at, phrase = min(found)
            if at:
                out.append(TextPiece("reasoning", buf[:at]))
            state.mode = CONTENT
            return buf[at + len(phrase):]
        keep = _partial_suffix_len(buf, RESPONSE_PHRASES)
        if len(buf) > keep:
            out.append(TextPiece("reasoning", buf[:len(buf) - keep]))
        state.held = buf[len(buf) - keep:]
        return ""
