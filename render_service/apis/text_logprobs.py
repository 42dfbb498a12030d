"""Responses' ``message.output_text.logprobs``: each text block's tokens' logprobs, as OpenAI shapes them.

Chat puts every token's logprob on its chunk; a Responses ``output_text`` carries the logprobs of *its* tokens
only (a reasoning item or a function call has none). So when logprobs are asked for, the engine tokens go
through the pipeline one at a time (whatever the chunking, the output is the same: batch is the fold of the
stream), and each token's logprob is routed by what that token did:

* a reasoning token (text or delimiter, by the pipeline's reasoning count) or a Harmony header or end token of
  any message has none in the output;
* a token that made text of a text block goes with that text's delta (``response.output_text.delta``), together
  with the tokens before it that made no output yet (a tag prefix held back, the first bytes of a character);
* a token that made a call's arguments, or held text that was then dropped (whitespace between blocks, the blank
  line after reasoning), goes nowhere.

The closing events and the finished response carry each text block's whole list. Token strings, bytes and
alternatives are resolved as for chat (``render_service.derender.logprobs``: the tokenizer's text, UTF-8 repair from the
preceding tokens, ``token_id:N`` strings when asked). Entry shape: ``{token, bytes, logprob, top_logprobs:
[{token, bytes, logprob}]}``.
"""

from __future__ import annotations

import msgspec

from render_service.apis.responses_protocol import OutputTextLogprob, OutputTextTopLogprob
from render_service.apis.segments import BlockState, BlockTexts, SegmentPipeline, Step, finish, segments, sequence
from render_service.derender.logprobs import LOGPROB_CONTEXT_TOKENS, resolve_chat_entry
from render_service.parsers.pipeline import PipelineState
from render_service.tokenize.tokenizer import RenderTokenizer
from render_service.wire.protocol import ChatLogprob, GenerateLogprobs

INCLUDE = "message.output_text.logprobs"
MAX_PENDING = 1024  # tokens held back by the parsers that long lose their logprobs (bounded memory)


def wants_logprobs(include: list[str] | None) -> bool:
    return bool(include) and INCLUDE in (include or ())


def _entry(resolved: ChatLogprob) -> OutputTextLogprob:
    return OutputTextLogprob(resolved["token"], resolved["bytes"], resolved["logprob"],
                             [OutputTextTopLogprob(t["token"], t["bytes"], t["logprob"])
                              for t in resolved.get("top_logprobs") or ()])


def _claimed(state: PipelineState) -> int:
    """Tokens so far that make no output text: reasoning, its delimiters, Harmony's message markup."""
    count = state.reasoning_count
    return count.reasoning + count.delimiters + count.markup if count is not None else 0


class TextLogprobs:
    """One response's routing state: each text block's entries, and the tokens waiting for output."""

    __slots__ = ("tokenizer", "as_token_ids", "blocks", "pending", "context")

    def __init__(self, tokenizer: RenderTokenizer, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids
        self.blocks: dict[int, list[OutputTextLogprob]] = {}
        self.pending: list[OutputTextLogprob] = []
        self.context: list[int] = []  # the last sampled ids, for UTF-8 repair of token strings

    def of(self, block: int) -> list[OutputTextLogprob]:
        return self.blocks.get(block, [])

    def feed(self, pipeline: SegmentPipeline, state: PipelineState, blocks: BlockState, ids: list[int],
             logprobs: GenerateLogprobs | None) -> list[Step]:
        """The steps of ``ids`` (fed one at a time), text deltas carrying their tokens' logprobs."""
        entries = (logprobs.content if logprobs is not None else None) or []
        out: list[Step] = []
        for i, token in enumerate(ids):
            before = _claimed(state)
            steps = sequence(blocks, segments(pipeline.feed(state, [token])))
            claimed = _claimed(state) - before
            if claimed > 1:  # a Harmony header ended: the tokens before this one were its markup, not text
                del self.pending[max(len(self.pending) - (claimed - 1), 0):]
            entry = None
            if claimed <= 0 and i < len(entries):
                entry = _entry(resolve_chat_entry(entries[i], self.tokenizer, self.context, self.as_token_ids))
            del self.context[:-LOGPROB_CONTEXT_TOKENS]
            out += self.route(steps, blocks, entry)
        return out

    def route(self, steps: list[Step], blocks: BlockState, entry: OutputTextLogprob | None) -> list[Step]:
        """One token's steps: its entry (and the pending ones) on its first text delta, or pending, or dropped."""
        if entry is not None:
            self.pending.append(entry)
            del self.pending[:-MAX_PENDING]
        out = []
        for step in steps:
            kind = blocks.blocks[step.block].kind
            if step.op == "open" and kind != "text":
                self.pending.clear()  # held whitespace before a reasoning block or a call was dropped
            elif step.op == "open" and step.block and blocks.blocks[step.block - 1].kind == "reasoning":
                while self.pending and not self.pending[0].token.strip():
                    self.pending.pop(0)  # the blank line after reasoning is not the answer's
            elif step.op == "delta" and kind == "call":
                self.pending.clear()
            elif step.op == "delta" and kind == "text" and self.pending:
                given, self.pending = self.pending, []
                self.blocks.setdefault(step.block, []).extend(given)
                step = msgspec.structs.replace(step, logprobs=given)
            out.append(step)
        return out

    def end(self, steps: list[Step], blocks: BlockState) -> list[Step]:
        """Steps made by no token (the end of output flushing held text): they take what is pending."""
        return self.route(steps, blocks, None)


def fold_with_logprobs(pipeline: SegmentPipeline, token_ids: list[int], prompt_ids: list[int] | None,
                       logprobs: GenerateLogprobs | None,
                       router: TextLogprobs) -> tuple[BlockState, BlockTexts, PipelineState]:
    """``segments.fold`` with text logprobs routed (batch derender of a request that asked for them)."""
    pstate = pipeline.initial_state(prompt_ids)
    bstate = BlockState()
    texts = BlockTexts(router)
    texts.add(router.feed(pipeline, pstate, bstate, token_ids, logprobs))
    texts.add(router.end(sequence(bstate, segments(pipeline.finish(pstate))) + finish(bstate), bstate))
    return bstate, texts, pstate
