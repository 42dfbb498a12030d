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
* ``kimi_k2`` (Kimi-K2 thinking): ``<think>``/``</think>``, switch ``thinking`` (default on); reasoning also ends
  where the model opens a tool-call section (``<|tool_calls_section_begin|>``) inside its think block.
* ``deepseek_v4`` (DeepSeek-V3.2 / V4): the ``deepseek_v3`` switch (``thinking``, also ``enable_thinking``); the
  templates write ``<think>`` (thinking) or ``</think>`` (chat) at the end of the prompt, which the prompt-tail
  rule reads; reasoning also ends at a DSML tool-call block (``<｜DSML｜tool_calls>``, V3.2's
  ``<｜DSML｜function_calls>``) written inside the think block.

* ``minimax_m3``: ``<mm:think>``/``</mm:think>``, on with ``thinking_mode: "enabled"``; in chat mode a block the
  model opens itself is still reasoning (as ``deepseek_v4``).
* ``step5`` (DeepSeek-R1's rules) and ``holo2`` (``deepseek_v3``'s switch, on by default): upstream's names for
  existing parsers.

``mistral`` (Magistral) and ``granite`` have their own state machines: ``reasoning_mistral`` and
``reasoning_granite``.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from render_service.parsers.base import TextPiece
from render_service.parsers.reasoning import (
    AWAIT_START,
    CONTENT,
    REASONING,
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Qwen3ReasoningParser,
    ThinkReasoningParser,
    ThinkState,
)


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
    emits_reasoning = False  # everything is content (usage counts no reasoning tokens)

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


class KimiK2ReasoningParser(ThinkReasoningParser):
    name = "kimi_k2"
    thinking_kwarg = "thinking"
    thinking_default = True
    implicit_end_markers = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")


DSML_TOOL_CALLS = "<\uff5cDSML\uff5ctool_calls>"  # DeepSeek-V4's block opener (fullwidth bars)
DSML_FUNCTION_CALLS = "<\uff5cDSML\uff5cfunction_calls>"  # DeepSeek-V3.2's


class ExplicitThinkState(ThinkState):
    explicit: bool = False  # chat mode: reasoning only if the output opens it


class ExplicitThinkReasoningParser(ThinkReasoningParser):
    """A family whose chat mode still lets the model open reasoning itself: in chat mode (thinking off, or the
    prompt closed reasoning) output is content unless it begins with the start tag, which opens reasoning that
    then ends as in thinking mode (vLLM's engine parsers for DeepSeek-V4 and MiniMax-M3). Which mode a stream is
    in travels in its state (the pipeline feeds every stream through one parser instance)."""

    State = ExplicitThinkState

    def _explicit_only(self) -> bool:
        return not self.config.enable_thinking or self.config.reasoning_open_at_start is False

    def initial_state(self) -> ExplicitThinkState:
        if self._explicit_only():
            return ExplicitThinkState(mode=AWAIT_START, explicit=True)
        return ExplicitThinkState(mode=super().initial_state().mode)

    def _opening(self, state: ThinkState, buf: str, out: list[TextPiece]) -> str:
        if not getattr(state, "explicit", False):
            return super()._opening(state, buf, out)
        stripped = buf.lstrip()
        if stripped.startswith(self.start_tag):
            state.mode = REASONING
            return stripped[len(self.start_tag):]
        if self.start_tag.startswith(stripped):
            state.held = buf
            return ""
        state.mode = CONTENT
        return buf

    def finish(self, state: ThinkState) -> list[TextPiece]:
        if state.mode == AWAIT_START and getattr(state, "explicit", False):
            held, state.held = state.held, ""
            return [TextPiece("content", held)] if held else []
        return super().finish(state)


class DeepSeekV4ReasoningParser(ExplicitThinkReasoningParser):
    name = "deepseek_v4"
    thinking_kwarg = "thinking"
    implicit_end_markers: ClassVar[tuple[str, ...]] = (DSML_TOOL_CALLS, DSML_FUNCTION_CALLS)

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        # vLLM's V4 renderer reads ``thinking`` or ``enable_thinking``. Off only when the request says so: the
        # prompt's tail (``<think>`` for thinking, ``</think>`` for chat) decides everything else.
        kwargs = chat_template_kwargs or {}
        if kwargs.get("reasoning_effort") == "none":
            return False  # vLLM 0.33: reasoning_effort "none" is chat mode
        for key in ("thinking", "enable_thinking"):
            if key in kwargs and not kwargs[key]:
                return False
        return True


class MiniMaxM3ReasoningParser(ExplicitThinkReasoningParser):
    """MiniMax-M3: ``<mm:think>``/``</mm:think>``; reasoning from the first token only with
    ``chat_template_kwargs.thinking_mode == "enabled"`` (the template then opens the block in the prompt)."""

    name = "minimax_m3"
    thinking_kwarg = "thinking_mode"
    start_tag = "<mm:think>"
    end_tag = "</mm:think>"

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return (chat_template_kwargs or {}).get("thinking_mode") == "enabled"


class Step5ReasoningParser(DeepSeekR1ReasoningParser):
    name = "step5"  # vLLM registers DeepSeek-R1's parser under this name


class Holo2ReasoningParser(DeepSeekV3ReasoningParser):
    """holo2: deepseek_v3's switch, thinking on unless the request turns it off (vLLM's
    DeepSeekV3ReasoningWithThinkingParser)."""

    name = "holo2"

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        kwargs = chat_template_kwargs or {}
        if "thinking" not in kwargs and "enable_thinking" not in kwargs:
            return True
        return bool(kwargs.get("thinking", kwargs.get("enable_thinking")))


FAMILY_REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    cls.name: cls for cls in (Glm45ReasoningParser, Glm47ReasoningParser, MiniMaxM2ReasoningParser,
                              MiniMaxM2AppendThinkReasoningParser, SeedOssReasoningParser,
                              KimiK2ReasoningParser, DeepSeekV4ReasoningParser, MiniMaxM3ReasoningParser,
                              Step5ReasoningParser, Holo2ReasoningParser)
}


class AnswerTagsState(ThinkState):
    tag_held: str = ""  # content that may be the beginning of an answer tag


class AnswerTagsReasoningParser(ThinkReasoningParser):
    """A family that wraps its answer in tags after the think block (ERNIE-4.5's ``<response>``, Hunyuan's
    ``<answer>``): the tags are markup and leave the content. Upstream's batch keeps only the text between the
    tags; text the model writes outside them (the blank lines around them included) stays content here
    (nothing generated is lost), and streaming equals batch."""

    State = AnswerTagsState
    ANSWER_TAGS: tuple[str, str] = ("<response>", "</response>")

    def initial_state(self) -> AnswerTagsState:
        return AnswerTagsState(mode=super().initial_state().mode)

    def feed(self, state: ThinkState, text: str) -> list[TextPiece]:
        return self._untag(state, super().feed(state, text), final=False)

    def finish(self, state: ThinkState) -> list[TextPiece]:
        return self._untag(state, super().finish(state), final=True)

    def _untag(self, state: ThinkState, pieces: list[TextPiece], final: bool) -> list[TextPiece]:
        if not final and not state.tag_held:  # type: ignore[attr-defined]  # State is AnswerTagsState
            if not pieces:
                return pieces
            if len(pieces) == 1:  # the per-token common case: one piece, no tag can start in it
                p = pieces[0]
                if p.channel != "content" or "<" not in p.text:
                    return pieces
        state = cast(AnswerTagsState, state)
        out: list[TextPiece] = []
        for p in pieces:
            if p.channel != "content":
                out.append(p)
                continue
            buf, state.tag_held = state.tag_held + p.text, ""
            text = self._strip(state, buf)
            if text:
                out.append(TextPiece("content", text))
        if final and state.tag_held:
            out.append(TextPiece("content", state.tag_held))  # a partial tag at the end is the model's text
            state.tag_held = ""
        return out

    def _strip(self, state: AnswerTagsState, buf: str) -> str:
        """``buf`` without the answer tags; a possible partial tag at its end is held in the state."""
        kept: list[str] = []
        pos = 0
        while True:
            found = [(i, t) for t in self.ANSWER_TAGS if (i := buf.find(t, pos)) >= 0]
            if not found:
                break
            at, tag = min(found)
            kept.append(buf[pos:at])
            pos = at + len(tag)
        rest = buf[pos:]
        keep = max((k for t in self.ANSWER_TAGS for k in range(1, len(t)) if rest.endswith(t[:k])), default=0)
        kept.append(rest[:len(rest) - keep])
        state.tag_held = rest[len(rest) - keep:]
        return "".join(kept)


class Ernie45ReasoningParser(AnswerTagsReasoningParser, DeepSeekR1ReasoningParser):
    """ernie45 (ERNIE-4.5 thinking): DeepSeek-R1's rules (reasoning until ``</think>``, with or without
    ``<think>``), the answer wrapped in ``<response>`` tags."""

    name = "ernie45"


class HunyuanA13BReasoningParser(AnswerTagsReasoningParser, DeepSeekR1ReasoningParser):
    """hunyuan_a13b: ``<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>``; reasoning until ``</think>``
    (upstream's regex also reads an answer with no think block), the answer tags are markup."""

    name = "hunyuan_a13b"
    ANSWER_TAGS = ("<answer>", "</answer>")


class PoolsideV1ReasoningParser(DeepSeekV3ReasoningParser):
    """poolside_v1: ``deepseek_v3``'s switch; the prompt-tail rule already stops at the turn boundary, which is
    what upstream's subclass adds."""

    name = "poolside_v1"


class Step3ReasoningParser(DeepSeekR1ReasoningParser):
    """step3: everything before ``</think>`` is reasoning (DeepSeek-R1's rules)."""

    name = "step3"


class HyV3ReasoningParser(ThinkReasoningParser):
    """hy_v3 (Hunyuan v3): ``<think>``/``</think>``; ``reasoning_effort: "no_think"`` (request or
    chat_template_kwargs) means no reasoning parser at all."""

    name = "hy_v3"
    thinking_kwarg = "reasoning_effort"

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return (chat_template_kwargs or {}).get("reasoning_effort") != "no_think"


class HyV4ReasoningParser(HyV3ReasoningParser):
    name = "hy_v4"  # Hunyuan v4: hy_v3's rules (reasoning from the start, off with reasoning_effort no_think)


class Ling3ReasoningParser(Glm47ReasoningParser):
    """ling3 (Ling 3): GLM-4.7's reasoning, thinking on unless ``thinking`` / ``enable_thinking`` says off."""

    name = "ling3"

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        kwargs = chat_template_kwargs or {}
        if "thinking" not in kwargs and "enable_thinking" not in kwargs:
            return True
        return bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))


class MiMoReasoningParser(Qwen3ReasoningParser):
    name = "mimo"  # Qwen3's rules (upstream configures Qwen3's engine for it)


class ZayaReasoningParser(Qwen3ReasoningParser):
    """zaya (Zyphra ZAYA1): Qwen3's rules with ZAYA1's call block, so ``<zyphra_tool_call>`` followed by
    ``<function=`` ends an unclosed think block (upstream's engine is Qwen3's with the block tags swapped)."""

    name = "zaya"
    tool_call_tag = "<zyphra_tool_call>"


class NemotronV3ReasoningParser(Qwen3ReasoningParser):
    """nemotron_v3 (Nemotron 3): Qwen3's rules. Upstream also hands the reasoning back as content when the
    answer came out empty and the request set ``force_nonempty_content``; not done here (a stream has already
    sent it as reasoning)."""

    name = "nemotron_v3"


class Olmo3ReasoningParser(DeepSeekR1ReasoningParser):
    """olmo3 (OLMo 3): ``<think>`` (optional, the template may write it) ... ``</think>`` spelled with ordinary
    tokens; DeepSeek-R1's rules (an output without ``</think>`` is reasoning; upstream's batch regex returns it
    as content)."""

    name = "olmo3"


class Gemma4ReasoningParser(ExplicitThinkReasoningParser):
    """gemma4 (Gemma 4): reasoning is a ``<|channel>thought\\n`` ... ``<channel|>`` block the model opens itself
    (upstream starts every reply in content). The ``thought\\n`` label is markup; a reply that starts with the
    bare label (the template opened the channel in the prompt) is reasoning when thinking is on, and with thinking
    off the label alone is dropped. Reasoning also ends where a call begins (``<|tool_call>``)."""

    name = "gemma4"
    start_tag = "<|channel>"
    end_tag = "<channel|>"
    implicit_end_markers: ClassVar[tuple[str, ...]] = ("<|tool_call>",)
    thinking_default = False
    starts_in_content = True  # until the model (or the prompt's bare label) opens the channel
    LABEL = "thought\n"

    def _explicit_only(self) -> bool:
        return True

    def _opening(self, state: ThinkState, buf: str, out: list[TextPiece]) -> str:
        stripped = buf.lstrip()
        tag, label = self.start_tag, self.LABEL
        openers = (tag + label, tag, label) if self.config.enable_thinking else (tag + label, tag)
        for opener in openers:
            if stripped.startswith(opener):
                rest = stripped[len(opener):]
                if opener == tag and label.startswith(rest) and rest != label:
                    state.held = buf  # the label may still follow the tag
                    return ""
                state.mode = REASONING
                return rest
        if any(o.startswith(stripped) for o in (*openers, label)):
            state.held = buf
            return ""
        state.mode = CONTENT
        if not self.config.enable_thinking and stripped.startswith(label):
            return stripped[len(label):]  # the label without a block: dropped
        return buf


class FramedState(ExplicitThinkState):
    frame: int = 0  # where the block's framing newlines stand (RippleReasoningParser's FRAME_* values)


FRAME_BEFORE, FRAME_OPENED, FRAME_HELD, FRAME_INSIDE, FRAME_AFTER, FRAME_DONE = range(6)


class RippleReasoningParser(ExplicitThinkReasoningParser):
    """ripple (Ricursive Ripple): a ``<think>`` block the model opens itself (the prompt never does; there is
    no thinking switch), written ``<think>\n`` .. ``\n</think>\n``: those newlines are the markers' (upstream's
    terminals include them), so one newline after the opener, before the closer and after it is dropped.
    Reasoning also ends where a call block begins (``<tool_call>``, its leading newline the tool marker's)."""

    name = "ripple"
    State = FramedState
    implicit_end_markers: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    starts_in_content = True

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True  # upstream ignores chat_template_kwargs: the model decides per turn

    def _explicit_only(self) -> bool:
        return True

    def initial_state(self) -> FramedState:
        return FramedState(mode=AWAIT_START, explicit=True)

    def feed(self, state: ThinkState, text: str) -> list[TextPiece]:
        pieces = super().feed(state, text)
        frame = cast(FramedState, state).frame
        return pieces if frame == FRAME_DONE or not pieces else self._unframe(cast(FramedState, state), pieces)

    def finish(self, state: ThinkState) -> list[TextPiece]:
        st = cast(FramedState, state)
        pieces = self._unframe(st, super().finish(state))
        if st.frame == FRAME_HELD:  # cut inside reasoning: its last newline is the model's
            pieces.append(TextPiece("reasoning", "\n"))
        st.frame = FRAME_DONE
        return pieces

    @staticmethod
    def _unframe(st: FramedState, pieces: list[TextPiece]) -> list[TextPiece]:
        out: list[TextPiece] = []
        for p in pieces:
            text = p.text
            if p.channel == "reasoning":
                if st.frame in (FRAME_BEFORE, FRAME_OPENED):
                    st.frame = FRAME_OPENED
                    if not text:
                        continue
                    text = text.removeprefix("\n")
                    st.frame = FRAME_INSIDE
                elif st.frame == FRAME_HELD:
                    text = "\n" + text
                if text.endswith("\n"):
                    text, st.frame = text[:-1], FRAME_HELD
                else:
                    st.frame = FRAME_INSIDE
                if text:
                    out.append(TextPiece("reasoning", text))
                continue
            if st.frame == FRAME_BEFORE:
                st.frame = FRAME_DONE  # content first: no block follows
            elif st.frame in (FRAME_OPENED, FRAME_HELD, FRAME_INSIDE):
                st.frame = FRAME_AFTER  # reasoning ended: its held newline was the closer's
            if st.frame == FRAME_AFTER and text:
                text = text.removeprefix("\n")
                st.frame = FRAME_DONE
            if text:
                out.append(TextPiece("content", text))
        return out


class LeadingNewlinesState(ThinkState):
    content_started: bool = False


class GraniteThinkingReasoningParser(Qwen3ReasoningParser):
    """granite_thinking_parser (Granite 4.2): Qwen3's rules; the content's leading newlines are layout (the
    template writes ``\\n</think>\\n``). Upstream also hands the reasoning back as content when the request
    sets ``force_nonempty_content`` and the answer is empty; not done here (as ``nemotron_v3``)."""

    name = "granite_thinking_parser"
    State = LeadingNewlinesState

    def initial_state(self) -> LeadingNewlinesState:
        return LeadingNewlinesState(mode=super().initial_state().mode)

    def feed(self, state: ThinkState, text: str) -> list[TextPiece]:
        pieces = super().feed(state, text)
        return pieces if getattr(state, "content_started", True) else self._strip_leading(state, pieces)

    def _strip_leading(self, state: ThinkState, pieces: list[TextPiece]) -> list[TextPiece]:
        st = cast(LeadingNewlinesState, state)
        out: list[TextPiece] = []
        for p in pieces:
            if p.channel == "content" and not st.content_started:
                text = p.text.lstrip("\n")
                if not text:
                    continue
                st.content_started = True
                p = TextPiece("content", text)
            out.append(p)
        return out

    def finish(self, state: ThinkState) -> list[TextPiece]:
        return self._strip_leading(state, super().finish(state))


class Step3p5ReasoningParser(Qwen3ReasoningParser):
    """step3p5 (Step-3.5 / 3.7): Qwen3's rules; the template always opens ``<think>`` and has no switch."""

    name = "step3p5"

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return True


DSML_V41_CALLS = "<\uff5cDSML\uff5c calls>"  # DeepSeek-V4.1's spaced DSML block opener
DSML_V41_TOOL_CALLS = "<\uff5cDSML\uff5c tool_calls>"


class DeepSeekV41ReasoningParser(DeepSeekV4ReasoningParser):
    """deepseek_v41: V4's rules; reasoning also ends at V4.1's spaced DSML block (``<｜DSML｜ calls>``)."""

    name = "deepseek_v41"
    implicit_end_markers: ClassVar[tuple[str, ...]] = (DSML_V41_CALLS, DSML_V41_TOOL_CALLS, DSML_TOOL_CALLS)


class KimiK3ReasoningParser(ThinkReasoningParser):
    """kimi_k3 (Kimi K3): the XTML think channel, ``<|open|>think<|sep|>`` ... ``<|close|>think<|sep|>`` (each
    marker three special tokens); thinking on unless ``thinking`` (else ``enable_thinking``) says off."""

    name = "kimi_k3"
    thinking_kwarg = "thinking"
    start_tag = "<|open|>think<|sep|>"
    end_tag = "<|close|>think<|sep|>"

    @classmethod
    def enable_thinking_from(cls, chat_template_kwargs: dict[str, Any] | None) -> bool:
        kwargs = chat_template_kwargs or {}
        thinking = kwargs.get("thinking")
        return bool(kwargs.get("enable_thinking", True) if thinking is None else thinking)


class K2HorizonReasoningParser(DeepSeekR1ReasoningParser):
    """k2_horizon (K2 Horizon): DeepSeek-R1's rules over ``<ifm|think>`` / ``</ifm|think>`` (reasoning_effort
    "high", the template's default); reasoning also ends where a tool-call block begins. The "medium" and "low"
    efforts' ``<ifm|think_fast>`` / ``<ifm|think_faster>`` tags are not read."""

    name = "k2_horizon"
    start_tag = "<ifm|think>"
    end_tag = "</ifm|think>"
    implicit_end_markers = ("<ifm|tool_calls>",)


class MiniCPMVReasoningParser(ExplicitThinkReasoningParser):
    """minicpmv (MiniCPM-V): Qwen3's ``<think>`` reasoning, thinking off unless ``enable_thinking``; with it off a
    block the model opens itself is still reasoning (upstream drops that text). Upstream also turns the
    tokenizer's written ``\\n`` back into newlines outside code and LaTeX; not done here."""

    name = "minicpmv"
    thinking_kwarg = "enable_thinking"
    thinking_default = False


class CohereCommand3ReasoningParser(ExplicitThinkReasoningParser):
    """cohere_command3 / cohere_command4 (Command A): ``<|START_THINKING|>`` .. ``<|END_THINKING|>``, a block the
    model opens itself (a reply without it is content); reasoning also ends where an action or a response
    begins. The reasoning keeps its leading space and any citation markup (upstream's filter trims and strips)."""

    name = "cohere_command3"
    start_tag = "<|START_THINKING|>"
    end_tag = "<|END_THINKING|>"
    implicit_end_markers = ("<|START_ACTION|>", "<|START_RESPONSE|>")

    def _explicit_only(self) -> bool:
        return True


class CohereCommand4ReasoningParser(CohereCommand3ReasoningParser):
    name = "cohere_command4"


INKLING_MESSAGE_MODEL = "<|message_model|>"


class InklingReasoningParser(ExplicitThinkReasoningParser):
    """inkling (Inkling): a ``<|content_thinking|>`` block (after the ``<|message_model|>`` role marker, which the
    prompt usually ends with) up to ``<|end_message|>``; reasoning also ends where a call block begins. Only a
    thinking block that opens the reply is reasoning (upstream's engine takes later ones too)."""

    name = "inkling"
    start_tag = "<|content_thinking|>"
    end_tag = "<|end_message|>"
    implicit_end_markers = ("<|content_invoke_tool_json|>",)

    def _explicit_only(self) -> bool:
        return True

    def _opening(self, state: ThinkState, buf: str, out: list[TextPiece]) -> str:
        stripped = buf.lstrip()
        if stripped.startswith(INKLING_MESSAGE_MODEL):
            rest = stripped[len(INKLING_MESSAGE_MODEL):].lstrip()
            if rest.startswith(self.start_tag):
                state.mode = REASONING
                return rest[len(self.start_tag):]
            if self.start_tag.startswith(rest):
                state.held = buf
                return ""
        elif stripped and INKLING_MESSAGE_MODEL.startswith(stripped):
            state.held = buf
            return ""
        return super()._opening(state, buf, out)


class Plamo3ReasoningParser(ThinkReasoningParser):
    """plamo3 (PLaMo 3): ``<|plamo:begin_think:plamo|>`` / ``<|plamo:end_think:plamo|>`` (each spelled with
    several tokens); output starts in reasoning, which also ends where a tool-request block begins."""

    name = "plamo3"
    start_tag = "<|plamo:begin_think:plamo|>"
    end_tag = "<|plamo:end_think:plamo|>"
    implicit_end_markers = ("<|plamo:begin_tool_requests:plamo|>",)


MORE_REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    cls.name: cls for cls in (Ernie45ReasoningParser, HunyuanA13BReasoningParser, PoolsideV1ReasoningParser,
                              Step3ReasoningParser, HyV3ReasoningParser, Ling3ReasoningParser, MiMoReasoningParser,
                              NemotronV3ReasoningParser, Olmo3ReasoningParser, Step3p5ReasoningParser,
                              DeepSeekV41ReasoningParser, Plamo3ReasoningParser, Gemma4ReasoningParser,
                              GraniteThinkingReasoningParser, KimiK3ReasoningParser, HyV4ReasoningParser,
                              K2HorizonReasoningParser, MiniCPMVReasoningParser, CohereCommand3ReasoningParser,
                              CohereCommand4ReasoningParser, InklingReasoningParser, ZayaReasoningParser,
                              RippleReasoningParser)
}
