"""The shared half of Responses and Messages output: the parser pipeline's output as ordered blocks.

Chat merges a chunk's reasoning, content and tool-call fragments into one delta; Responses output items and
Messages content blocks are ordered, so they need the order the model wrote them in. ``SegmentPipeline`` is the
chat ``Pipeline`` (same stages, same state) that also reports each chunk's pieces in output order; the
``BlockSequencer`` groups consecutive pieces of one kind into blocks (reasoning, text, one per tool call) and
emits open / delta / close steps that each API renders as its own events. Batch derender runs the same
sequencer over the whole output, so batch is the fold of the stream by construction.

Whitespace-only text between blocks (a newline between two tool calls) opens no block: it is held (bounded) until
non-whitespace text follows, and dropped if another kind of block comes first or the output ends; a text block
right after a reasoning block starts at its first non-whitespace character (Qwen3 writes a blank line after
``</think>``). Which text ends up in a block is therefore independent of how the output was chunked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from render_service.apis.responses_protocol import OutputTextLogprob
from render_service.parsers.base import Piece, TextPiece
from render_service.parsers.pipeline import ChoiceDelta, Pipeline, PipelineState

if TYPE_CHECKING:  # text_logprobs routes steps, so it imports this module
    from render_service.apis.text_logprobs import TextLogprobs

BlockKind = Literal["reasoning", "text", "call"]
# Whitespace held back before a text block opens; past this it opens one (bounded state).
MAX_HELD_WHITESPACE = 256


class Segment(msgspec.Struct, array_like=True, frozen=True):
    """One run of output of one kind, in output order. ``call``: ``index`` is the call's, ``name`` and ``call_id``
    are set on its first segment."""

    kind: BlockKind
    text: str
    index: int = 0
    name: str | None = None
    call_id: str | None = None


class OrderedDelta(ChoiceDelta):
    """A ChoiceDelta that also carries its pieces in output order."""

    segments: list[Segment] = []


class SegmentPipeline(Pipeline):
    """The chat pipeline, reporting ordered segments; ``segments`` of any delta it returns gives them."""

    def _delta(self, state: PipelineState, pieces: Sequence[Piece]) -> ChoiceDelta:
        delta = super()._delta(state, pieces)  # assigns call ids (state) exactly as chat does
        cfg = self.config
        ids = {c["index"]: c.get("id") for c in delta.tool_calls}
        segs: list[Segment] = []
        for p in pieces:
            if isinstance(p, TextPiece):
                if p.text and (p.channel == "content" or cfg.include_reasoning):
                    segs.append(Segment("text" if p.channel == "content" else "reasoning", p.text))
                continue
            if not cfg.parallel_tool_calls and p.index > 0:
                continue
            if p.name is not None:
                segs.append(Segment("call", p.arguments or "", p.index, p.name, ids.get(p.index)))
            elif p.arguments:
                segs.append(Segment("call", p.arguments, p.index))
        return OrderedDelta(content=delta.content, reasoning=delta.reasoning, tool_calls=delta.tool_calls,
                            segments=segs)


def segments(delta: ChoiceDelta) -> list[Segment]:
    """A delta's segments in output order (the pipeline's one-channel fast path returns a plain delta)."""
    if isinstance(delta, OrderedDelta):
        return delta.segments
    if delta.reasoning:
        return [Segment("reasoning", delta.reasoning)]
    if delta.content:
        return [Segment("text", delta.content)]
    return []


class BlockInfo(msgspec.Struct, array_like=True):
    """What an API needs to know of a block after it opened: its kind and, for a call, the call's identity."""

    kind: BlockKind
    call_index: int = -1
    name: str = ""
    call_id: str = ""


class BlockState(msgspec.Struct, omit_defaults=True):
    """The sequencer's plain-data state (rides in stream_state next to the pipeline's)."""

    blocks: list[BlockInfo] = []
    open: int = -1  # index of the open block, -1 if none
    held: str = ""  # whitespace text waiting for a text block


class Step(msgspec.Struct, array_like=True, frozen=True):
    """``open`` (a block starts), ``delta`` (text for it), ``close`` (it is complete). ``logprobs``: a text
    delta's tokens' logprobs, when Responses asked for them (``text_logprobs.py``)."""

    op: Literal["open", "delta", "close"]
    block: int
    text: str = ""
    logprobs: list[OutputTextLogprob] | None = None


def _open(state: BlockState, info: BlockInfo, out: list[Step]) -> int:
    _close(state, out)
    state.blocks.append(info)
    index = len(state.blocks) - 1
    state.open = index
    out.append(Step("open", index))
    return index


def _close(state: BlockState, out: list[Step]) -> None:
    if state.open >= 0:
        out.append(Step("close", state.open))
        state.open = -1


def sequence(state: BlockState, segs: Sequence[Segment]) -> list[Step]:
    """The steps one chunk's segments make (mutates ``state``)."""
    out: list[Step] = []
    blocks = state.blocks
    for seg in segs:
        current = blocks[state.open] if state.open >= 0 else None
        if seg.kind == "text":
            if current is not None and current.kind == "text":
                out.append(Step("delta", state.open, seg.text))
            elif not seg.text.strip() and len(state.held) + len(seg.text) <= MAX_HELD_WHITESPACE:
                state.held += seg.text
            else:
                text = state.held + seg.text
                if blocks and blocks[-1].kind == "reasoning":
                    text = text.lstrip()  # the blank line a template puts after </think> is not the answer's
                index = _open(state, BlockInfo("text"), out)
                out.append(Step("delta", index, text))
                state.held = ""
        elif seg.kind == "reasoning":
            state.held = ""
            index = state.open if current is not None and current.kind == "reasoning" else \
                _open(state, BlockInfo("reasoning"), out)
            out.append(Step("delta", index, seg.text))
        else:
            state.held = ""
            if seg.name is not None:
                index = _open(state, BlockInfo("call", seg.index, seg.name, seg.call_id or ""), out)
            else:
                index = next((i for i in range(len(blocks) - 1, -1, -1)
                              if blocks[i].kind == "call" and blocks[i].call_index == seg.index), -1)
                if index < 0:
                    continue  # arguments of a call whose name never went out (the pipeline never does this)
            if seg.text:
                out.append(Step("delta", index, seg.text))
    return out


def finish(state: BlockState) -> list[Step]:
    """End of output: the open block closes, held whitespace is dropped."""
    out: list[Step] = []
    _close(state, out)
    state.held = ""
    return out


def check_block_state(state: BlockState, max_blocks: int = 4096) -> bool:
    """Bounds of a client-supplied state (stream_state is untrusted)."""
    return (len(state.blocks) <= max_blocks and -1 <= state.open < len(state.blocks)
            and len(state.held) <= MAX_HELD_WHITESPACE and not state.held.strip())


class BlockTexts:
    """Each block's text, accumulated from the steps (for batch output, the gateway, and closing events), and
    when Responses asked for them, the text blocks' logprobs (a ``text_logprobs.TextLogprobs``)."""

    __slots__ = ("chars", "parts", "logprobs")

    def __init__(self, logprobs: TextLogprobs | None = None) -> None:
        self.parts: list[list[str]] = []
        self.logprobs = logprobs
        self.chars = 0  # what the texts hold, for a cache that bounds its size

    def add(self, steps: Sequence[Step]) -> None:
        for step in steps:
            if step.op == "open":
                while len(self.parts) <= step.block:
                    self.parts.append([])
            elif step.op == "delta":
                self.parts[step.block].append(step.text)
                self.chars += len(step.text)

    def logprobs_of(self, block: int) -> list[OutputTextLogprob]:
        return self.logprobs.of(block) if self.logprobs is not None else []

    def text(self, block: int) -> str:
        parts = self.parts[block] if block < len(self.parts) else []
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""


def fold(pipeline: SegmentPipeline, token_ids: list[int], prompt_ids: list[int] | None
         ) -> tuple[BlockState, BlockTexts, PipelineState]:
    """Batch derender of one choice: every token through the pipeline, then finish; the blocks and their texts."""
    pstate = pipeline.initial_state(prompt_ids)
    bstate = BlockState()
    texts = BlockTexts()
    texts.add(sequence(bstate, segments(pipeline.feed(pstate, token_ids))))
    texts.add(sequence(bstate, segments(pipeline.finish(pstate))))
    texts.add(finish(bstate))
    return bstate, texts, pstate


def parse_arguments(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as an object ({} when they are not one: cut short by max_tokens, say)."""
    try:
        value = msgspec.json.decode(arguments) if arguments else {}
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}
