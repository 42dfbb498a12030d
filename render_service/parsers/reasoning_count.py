"""Reasoning tokens, counted on the token ids as they pass the pipeline (exact, independent of chunking).

The reasoning stages split *text*; usage counts *tokens*. A chunk of several tokens can hold the end of
reasoning, so counting per chunk from the text stage's state would be approximate. These counters follow the
marker tokens instead, seeded with where the text stage starts (the prompt may have opened reasoning already)
and kept in step with it:

* think-tag families (``<think>`` ... ``</think>``): every token while reasoning is open counts, except the
  start and end marker tokens, which are the block's delimiters. That is vLLM's ``count_reasoning_tokens``
  (tokens between the markers) when the model writes both markers, and also right when the template opened
  ``<think>`` in the prompt (vLLM counts nothing then). Reasoning that ends without the end marker token
  (qwen3's implicit end at ``<tool_call><function=``, an end tag spelled with ordinary sub-tokens) is found
  from the text stage: the tokens from the implicit marker on are not reasoning; for a spelled-out end tag
  the chunk's last token closed it, and the pipeline feeds such families a token at a time while counting, so
  the count does not depend on the chunking either.
* Harmony (gpt-oss): the body tokens of ``analysis`` messages without a recipient (the text stage's
  reasoning); their header and end marker tokens are delimiters. (vLLM also counts tool-call arguments on
  ``commentary`` and the header's channel name.)

``reasoning`` is what OpenAI's ``output_tokens_details.reasoning_tokens`` reports; ``reasoning +
delimiters`` is Anthropic's ``output_tokens_details.thinking_tokens`` ("including the thinking-block delimiter
tokens"). ``markup`` counts the header and end tokens of Harmony's other messages (what no output text comes
from). The state is a few integers and, for Harmony, the open header's ids (bounded), so it rides in
``stream_state``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from render_service.parsers.harmony import BODY, MAX_HEADER, HarmonyState, parse_header
from render_service.parsers.harmony import REASONING as HARMONY_REASONING
from render_service.parsers.reasoning import AWAIT_START, CONTENT, REASONING, ThinkReasoningParser, ThinkState

# A header longer than this many tokens is not one (the text stage gives up at MAX_HEADER characters).
MAX_HEADER_TOKENS = MAX_HEADER // 2
_Count = Annotated[int, msgspec.Meta(ge=0)]


class ReasoningCount(msgspec.Struct, array_like=True):
    """The counter's state: plain data, in PipelineState (so in stream_state)."""

    tracking: bool = False  # the counter still needs to see tokens (think: reasoning open; Harmony: always)
    open: bool = False  # inside reasoning (Harmony: inside an analysis body)
    body: bool = False  # Harmony: inside a message body (else in a header)
    header: Annotated[list[int], msgspec.Meta(max_length=MAX_HEADER_TOKENS)] = []  # Harmony: the open header
    since_marker: Annotated[int, msgspec.Meta(ge=-1)] = -1  # think: tokens counted from the last implicit marker
    reasoning: _Count = 0
    delimiters: _Count = 0
    markup: _Count = 0  # Harmony: header and end tokens of the other messages (no output text of their own)


class ThinkTokenCounter:
    """Think-tag families; the markers' ids come from the tokenizer (None when a tag is not one token)."""

    def __init__(self, parser_cls: type[ThinkReasoningParser], tokenizer: Any) -> None:
        self.start = tokenizer.token_to_id(parser_cls.start_tag)
        self.end = tokenizer.token_to_id(parser_cls.end_tag)
        # the text stage's implicit end (qwen3: "<tool_call>" followed by "<function=") as a token, if it is one
        implicit = parser_cls.implicit_end_at_tool_call
        self.implicit = tokenizer.token_to_id(parser_cls.tool_call_tag) if implicit else None
        self.emits_reasoning = getattr(parser_cls, "emits_reasoning", True)
        self.starts_in_content = parser_cls.starts_in_content
        # a tag the text stage finds in text only: the pipeline feeds the stages a token at a time while counting
        self.spelled_tags = self.end is None or (self.starts_in_content and self.start is None)
        # the ids ``feed`` treats apart; any other token inside reasoning just counts (the pipeline's per-token path)
        self.markers = frozenset(i for i in (self.start, self.end, self.implicit) if i is not None)

    def initial(self, text_state: Any) -> ReasoningCount:
        if not self.emits_reasoning or not isinstance(text_state, ThinkState) or text_state.mode == CONTENT:
            return ReasoningCount()
        if text_state.mode == AWAIT_START and self.starts_in_content:
            return ReasoningCount(tracking=True)  # content until the model opens reasoning (mistral, granite)
        return ReasoningCount(tracking=True, open=True)

    def feed(self, count: ReasoningCount, ids: list[int]) -> None:
        """Before the text stage sees the chunk's text (``sync`` follows it)."""
        if not count.open:  # waiting for the opening tag
            if self.start is None or self.start not in ids:
                return
            k = ids.index(self.start)
            count.open = True
            count.delimiters += 1
            ids = ids[k + 1:]
            if not ids:
                return
        end = self.end
        if len(ids) == 1:  # the per-token case
            t = ids[0]
            if t == end:
                count.delimiters += 1
                count.open = count.tracking = False
            elif t == self.start:
                count.delimiters += 1
            else:
                count.reasoning += 1
                if t == self.implicit:
                    count.since_marker = 1
                elif count.since_marker >= 0:
                    count.since_marker += 1
            return
        if end is not None and end in ids:
            k = ids.index(end)
            starts = ids[:k].count(self.start) if self.start is not None else 0
            count.reasoning += k - starts
            count.delimiters += starts + 1
            count.open = count.tracking = False
            return
        starts = ids.count(self.start) if self.start is not None else 0
        count.reasoning += len(ids) - starts
        count.delimiters += starts
        implicit = self.implicit
        if implicit is not None and implicit in ids:
            last = len(ids) - 1 - ids[::-1].index(implicit)
            count.since_marker = len(ids) - last
        elif count.since_marker >= 0:
            count.since_marker += len(ids)

    @staticmethod
    def needs_sync(count: ReasoningCount, mode: int) -> bool:
        """Whether the text stage's mode says what the tokens did not: reasoning opened or ended by text.
        (Pipeline.feed asks the open case inline, ``mode == CONTENT``: the per-token path.)"""
        return mode == CONTENT if count.open else mode != AWAIT_START

    def sync(self, count: ReasoningCount, text_state: Any) -> None:
        """After the text stage: reasoning it opened or ended without the marker token."""
        if not isinstance(text_state, ThinkState):
            return
        if not count.open:
            if text_state.mode == CONTENT:  # the reply did not open reasoning (granite): nothing to count
                count.tracking = False
            elif text_state.mode == REASONING:  # an opening of ordinary sub-tokens: the last token completed it
                count.open = True
                count.delimiters += 1
            return
        if text_state.mode != CONTENT:
            return
        if count.since_marker >= 0:  # ended at the implicit marker: it and what followed are content
            count.reasoning -= min(count.since_marker, count.reasoning)
        elif count.reasoning:  # an end tag of ordinary sub-tokens: the last token completed it
            count.reasoning -= 1
            count.delimiters += 1
        count.open = count.tracking = False
        count.since_marker = -1


class HarmonyTokenCounter:
    """gpt-oss: analysis bodies, by the Harmony marker tokens; headers decoded and read as the text stage does."""

    def __init__(self, tokenizer: Any) -> None:
        ids = {name: tokenizer.token_to_id(name) for name in ("<|start|>", "<|message|>", "<|end|>", "<|call|>",
                                                             "<|return|>")}
        self.tokenizer = tokenizer
        self.start = ids["<|start|>"]
        self.message = ids["<|message|>"]
        self.body_ends = frozenset(i for k, i in ids.items() if k != "<|message|>" and i is not None)
        self.body_marks = self.body_ends  # ids a body's per-token path must look at
        self.headers_in_body = False  # Muse: a <|message|> in a body opens the next message

    def initial(self, text_state: Any) -> ReasoningCount:
        if isinstance(text_state, HarmonyState) and text_state.mode == BODY:
            return ReasoningCount(tracking=True, body=True, open=text_state.target == HARMONY_REASONING)
        return ReasoningCount(tracking=True)

    def opens_reasoning(self, header: list[int]) -> bool:
        channel, recipient = parse_header(self.tokenizer.decode(header, skip_special_tokens=False))
        return channel == "analysis" and recipient in (None, "assistant", "all")

    def feed(self, count: ReasoningCount, ids: list[int]) -> None:
        if count.body and self.body_marks.isdisjoint(ids):  # the per-token case: body text
            if count.open:
                count.reasoning += len(ids)
            return
        for t in ids:
            if count.body and t == self.message and self.headers_in_body:
                # Muse: a header written without ending the message first
                if count.open:
                    count.delimiters += 1
                else:
                    count.markup += 1
                count.open = False  # (its recipient was read as text; the case seen is reasoning -> a call)
            elif count.body:
                if t in self.body_ends:
                    if count.open:
                        count.delimiters += 1
                    else:
                        count.markup += 1
                    count.body = count.open = False
                    count.header = [t] if t == self.start else []
                elif count.open:
                    count.reasoning += 1
            elif t == self.message:
                count.open = self.opens_reasoning(count.header)
                if count.open:
                    count.delimiters += len(count.header) + 1
                else:
                    count.markup += len(count.header) + 1
                count.body, count.header = True, []
            elif len(count.header) < MAX_HEADER_TOKENS:
                count.header.append(t)
            else:  # no header is this long: the text stage reads it as content
                count.body, count.open, count.header = True, False, []


class MuseTokenCounter(HarmonyTokenCounter):
    """Muse: the body tokens of reasoning messages (the recipients the text stage reads as reasoning); headers and
    ``<|eom|>`` / ``<|eot|>`` / ``<|start|>`` are delimiters around them, markup around the other messages."""

    def __init__(self, tokenizer: Any, reasoning_recipients: tuple[str | None, ...]) -> None:
        from render_service.parsers.muse_channels import recipient_of

        ids = {name: tokenizer.token_to_id(name) for name in ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>")}
        self.tokenizer = tokenizer
        self.start = ids["<|start|>"]
        self.message = ids["<|message|>"]
        self.body_ends = frozenset(i for k, i in ids.items() if k != "<|message|>" and i is not None)
        self.body_marks = frozenset(i for i in (*self.body_ends, self.message) if i is not None)
        self.headers_in_body = True
        self.reasoning_recipients = reasoning_recipients
        self._recipient = recipient_of

    def opens_reasoning(self, header: list[int]) -> bool:
        is_header, recipient = self._recipient(self.tokenizer.decode(header, skip_special_tokens=False))
        return is_header and recipient in self.reasoning_recipients


TokenCounter = ThinkTokenCounter | HarmonyTokenCounter
