"""Reasoning parsers of the GLM, MiniMax-M2 and Seed-OSS families (names as vLLM's ``--reasoning-parser``).

All but one are the ``<think>`` state machine of ``reasoning.py`` with their own tags and switches:

* ``glm45`` (GLM-4.5/4.6) and ``glm47`` (GLM-4.7): ``<think>``/``</think>``, switch ``enable_thinking``. GLM-4.5
  writes ``<think>`` itself; GLM-4.7's template puts it in the prompt; thinking off writes ``<think></think>`` /
  ``</think>`` into the prompt, which the prompt-tail rule reads (only back to the last ``<|assistant|>``).
* ``minimax_m2``: ``<think>``/``</think>``; the template ends the prompt with ``<think>\\n``, so output starts in
  reasoning (vLLM's streaming sends it as content, vllm#36632; we give its batch answer in both modes).
* ``seed_oss``: ``<seed:think>``/``</seed:think>``; ``<seed:cot_budget_reflect>`` blocks stay reasoning text.
* ``minimax_m2_append_think``: no split: everything is content, with ``<think>`` put back in front of the
  first text (the prompt's ``<think>`` that the model did not write), so clients see the raw block inline.
"""

from __future__ import annotations

from typing import Any

from render_service.parsers.base import TextPiece
from render_service.parsers.reasoning import AWAIT_START, CONTENT, ThinkReasoningParser, ThinkState


class Glm45ReasoningParser(ThinkReasoningParser):
    name = "glm45"


class Glm47ReasoningParser(ThinkReasoningParser):
    name = "glm47"


class MiniMaxM2ReasoningParser(ThinkReasoningParser):
    name = "minimax_m2"

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True  # MiniMax-M2 always thinks; its template has no switch


class MiniMaxM2AppendThinkReasoningParser(ThinkReasoningParser):
    name = "minimax_m2_append_think"

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True

    def initial_state(self) -> ThinkState:
        return ThinkState(mode=AWAIT_START)  # AWAIT_START: "<think>" not yet put in front

    def feed(self, state: ThinkState, text: str) -> list[TextPiece]:
        if not text:
            return []
        if state.mode == AWAIT_START:
            state.mode = CONTENT
            text = self.start_tag + text
        return [TextPiece("content", text)]

    def finish(self, state: ThinkState) -> list[TextPiece]:
        if state.mode != AWAIT_START:
            return []
        state.mode = CONTENT
        return [TextPiece("content", self.start_tag)]  # vLLM's batch answer for an empty output


class SeedOssReasoningParser(ThinkReasoningParser):
    name = "seed_oss"
    start_tag = "<seed:think>"
    end_tag = "</seed:think>"


FAMILY_REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    cls.name: cls for cls in (Glm45ReasoningParser, Glm47ReasoningParser, MiniMaxM2ReasoningParser,
                              MiniMaxM2AppendThinkReasoningParser, SeedOssReasoningParser)
}
