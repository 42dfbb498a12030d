"""Blocks -> Responses output: output items for a whole response, and the stream's event sequence.

A reasoning block is a ``reasoning`` item (its text as one ``reasoning_text`` content part), a text block a
``message`` item with one ``output_text`` part, a call block a ``function_call`` item whose ``call_id`` is the
pipeline's tool-call id (the same in batch and stream). Item ids are derived from the response id and the item's
position, so a replayed or re-derendered response keeps them.

The stream: ``response.created``, ``response.in_progress``; per item ``response.output_item.added`` (and
``response.content_part.added`` for messages and reasoning), its deltas, then its closing events
(``*.done``, ``response.content_part.done``, ``response.output_item.done``); finally ``response.completed``, or
``response.incomplete`` when the output hit ``max_output_tokens`` (or ``response.failed`` from the gateway when
the engine failed mid-stream). Closing events repeat the item's whole text, as the API defines them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from render_service.apis.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputItemEvent,
    OutputText,
    OutputTextLogprob,
    OutputTokensDetails,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from render_service.apis.segments import BlockInfo, BlockState, BlockTexts, Step

ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


def item_id(response_id: str, block: int, kind: str) -> str:
    digest = hashlib.blake2b(f"{response_id}\x00{block}".encode(), digest_size=16).hexdigest()
    return f"{ITEM_PREFIX[kind]}_{digest}"


def status_of(finish_reason: str | None) -> tuple[str, IncompleteDetails | None]:
    if finish_reason == "length":
        return "incomplete", IncompleteDetails("max_output_tokens")
    return "completed", None


class ResponsesShape:
    """One response's fixed facts (ids, the request's echoed settings) and how its items and events look."""

    def __init__(self, response_id: str, model: str, req: ResponsesRequest | None, prompt_tokens: int,
                 created_at: int | None = None, previous_response_id: str | None = None) -> None:
        self.response_id = response_id
        self.model = model
        self.req = req if req is not None else ResponsesRequest()
        self.prompt_tokens = prompt_tokens
        self.created_at = created_at if created_at is not None else int(time.time())
        self.previous_response_id = previous_response_id if previous_response_id is not None \
            else self.req.previous_response_id

    # items ------------------------------------------------------------------------------------------

    def item(self, block: int, info: BlockInfo, text: str, status: str,
             logprobs: list[OutputTextLogprob] | None = None) -> OutputItem:
        iid = item_id(self.response_id, block, info.kind)
        if info.kind == "reasoning":
            return ReasoningItem(id=iid, content=[ReasoningText(text)] if text or status != "in_progress" else [],
                                 status=status)
        if info.kind == "text":
            return MessageItem(id=iid, status=status, content=[OutputText(text, logprobs=logprobs or [])]
                               if status != "in_progress" else [])
        return FunctionCallItem(id=iid, call_id=info.call_id, name=info.name, arguments=text, status=status)

    def items(self, blocks: BlockState, texts: BlockTexts, status: str,
              whole_arguments: Callable[[str], str] | None = None) -> list[OutputItem]:
        """Every block as a finished item; the last carries ``status`` (incomplete when output was cut short).
        ``whole_arguments``: a non-streamed answer's calls get their arguments through it (re-serialized as
        vLLM's parsers and our chat answers give them); a stream's final items keep the text it streamed."""
        last = len(blocks.blocks) - 1
        items = []
        for i, info in enumerate(blocks.blocks):
            text = texts.text(i)
            if whole_arguments is not None and info.kind not in ("text", "reasoning"):
                text = whole_arguments(text)
            items.append(self.item(i, info, text, status if i == last else "completed", texts.logprobs_of(i)))
        return items

    def response(self, status: str, output: list[OutputItem], usage: ResponseUsage | None,
                 incomplete: IncompleteDetails | None = None, error: ResponseError | None = None) -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            error=error, incomplete_details=incomplete, instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, model=self.model, output=output,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=self.previous_response_id, reasoning=req.reasoning,
            store=req.store is not False, temperature=req.temperature,
            text=req.text or {"format": {"type": "text"}},
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            tools=list(req.tools or ()), top_p=req.top_p, truncation=req.truncation or "disabled",
            usage=usage, user=req.user, metadata=dict(req.metadata or {}),
        )

    def usage(self, output_tokens: int, reasoning_tokens: int = 0) -> ResponseUsage:
        return ResponseUsage(input_tokens=self.prompt_tokens, output_tokens=output_tokens,
                             total_tokens=self.prompt_tokens + output_tokens,
                             output_tokens_details=OutputTokensDetails(reasoning_tokens))

    # events -----------------------------------------------------------------------------------------

    def start_events(self, seq: int) -> list[Any]:
        created = self.response("in_progress", [], None)
        return [ResponseLifecycleEvent(type="response.created", sequence_number=seq, response=created),
                ResponseLifecycleEvent(type="response.in_progress", sequence_number=seq + 1, response=created)]

    def step_events(self, steps: Sequence[Step], blocks: BlockState, texts: BlockTexts, seq: int,
                    closing_status: str = "completed") -> list[Any]:
        """The events of a chunk's steps, numbered from ``seq``. ``texts`` must already hold the steps' text."""
        out: list[Any] = []
        for step in steps:
            info = blocks.blocks[step.block]
            iid = item_id(self.response_id, step.block, info.kind)
            if step.op == "delta":
                out.append(self._delta(info.kind, iid, step, seq + len(out)))
                continue
            if step.op == "open":
                added = self.item(step.block, info, "", "in_progress")
                out.append(OutputItemEvent(type="response.output_item.added", sequence_number=seq + len(out),
                                           output_index=step.block, item=added))
                part = _empty_part(info.kind)
                if part is not None:
                    out.append(ContentPartEvent(type="response.content_part.added", sequence_number=seq + len(out),
                                                item_id=iid, output_index=step.block, content_index=0, part=part))
                continue
            text = texts.text(step.block)
            status = closing_status if step.block == len(blocks.blocks) - 1 else "completed"
            out.extend(self._closing(info, iid, step.block, text, status, seq + len(out),
                                     texts.logprobs_of(step.block)))
        return out

    @staticmethod
    def _delta(kind: str, iid: str, step: Step, seq: int) -> Any:
        if kind == "text":
            if step.logprobs:
                return TextDeltaEvent(sequence_number=seq, item_id=iid, output_index=step.block, delta=step.text,
                                      logprobs=step.logprobs)
            return TextDeltaEvent(sequence_number=seq, item_id=iid, output_index=step.block, delta=step.text)
        if kind == "reasoning":
            return ReasoningDeltaEvent(sequence_number=seq, item_id=iid, output_index=step.block, delta=step.text)
        return ArgumentsDeltaEvent(sequence_number=seq, item_id=iid, output_index=step.block, delta=step.text)

    def _closing(self, info: BlockInfo, iid: str, block: int, text: str, status: str, seq: int,
                 logprobs: list[OutputTextLogprob]) -> list[Any]:
        out: list[Any] = []
        if info.kind == "text":
            out.append(TextDoneEvent(sequence_number=seq, item_id=iid, output_index=block, text=text,
                                     logprobs=logprobs))
            out.append(ContentPartEvent(type="response.content_part.done", sequence_number=seq + 1, item_id=iid,
                                        output_index=block, content_index=0,
                                        part=OutputText(text, logprobs=logprobs)))
        elif info.kind == "reasoning":
            out.append(ReasoningDoneEvent(sequence_number=seq, item_id=iid, output_index=block, text=text))
            out.append(ContentPartEvent(type="response.content_part.done", sequence_number=seq + 1, item_id=iid,
                                        output_index=block, content_index=0, part=ReasoningText(text)))
        else:
            out.append(ArgumentsDoneEvent(sequence_number=seq, item_id=iid, output_index=block, name=info.name,
                                          arguments=text))
        out.append(OutputItemEvent(type="response.output_item.done", sequence_number=seq + len(out),
                                   output_index=block, item=self.item(block, info, text, status, logprobs)))
        return out

    def end_event(self, finish_reason: str | None, blocks: BlockState, texts: BlockTexts, usage: ResponseUsage,
                  seq: int) -> ResponseLifecycleEvent:
        status, incomplete = status_of(finish_reason)
        response = self.response(status, self.items(blocks, texts, status), usage, incomplete)
        return ResponseLifecycleEvent(type=f"response.{status}", sequence_number=seq, response=response)

    def failed_event(self, message: str, blocks: BlockState, texts: BlockTexts, usage: ResponseUsage,
                     seq: int) -> ResponseLifecycleEvent:
        response = self.response("failed", self.items(blocks, texts, "incomplete"), usage,
                                 error=ResponseError("server_error", message))
        return ResponseLifecycleEvent(type="response.failed", sequence_number=seq, response=response)


def _empty_part(kind: str) -> OutputText | ReasoningText | None:
    if kind == "text":
        return OutputText("")
    if kind == "reasoning":
        return ReasoningText("")
    return None
