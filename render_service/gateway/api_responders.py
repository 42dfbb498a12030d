"""Engine token events -> Responses and Messages output, in-process: the gateway's side of render_service/apis/.

The same pieces as the /derender endpoints (``SegmentPipeline`` -> block sequencer -> each API's shape), fed each
engine event directly (no stream_state round trip, the item texts in memory). They plug into the chat gateway's
relay (``sse_relay.SseRelay``) and fold (``routes.fold``) like the chat responder: ``stream_events`` per engine
event, ``accumulate`` + ``response`` for a non-streamed request, ``final_bytes`` for the stream's end.
Stop strings (Messages' ``stop_sequences``) are matched on text blocks as they leave the pipeline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from render_service.apis.derender import thinking_tokens
from render_service.apis.messages_output import MessagesShape
from render_service.apis.messages_protocol import MessageObject
from render_service.apis.responses_output import ResponsesShape, status_of
from render_service.apis.responses_protocol import ResponseObject
from render_service.apis.segments import (
    BlockState,
    BlockTexts,
    Segment,
    SegmentPipeline,
    Step,
    finish,
    segments,
    sequence,
)
from render_service.apis.text_logprobs import TextLogprobs
from render_service.derender.batch import pipeline_config
from render_service.derender.choice_shapes import whole_arguments
from render_service.derender.logprobs import tokens_as_token_ids
from render_service.gateway.responses import coalesce
from render_service.gateway.stop_strings import StopMatcher
from render_service.http.errors import ApiError
from render_service.parsers.harmony import BODY as HARMONY_BODY
from render_service.parsers.harmony import REASONING as HARMONY_REASONING
from render_service.parsers.harmony import HarmonyState
from render_service.parsers.reasoning import CONTENT, ThinkState
from render_service.render.render_config import RenderConfig
from render_service.wire.protocol import ChatCompletionRequest, GenerateLogprobs, GenerateRequest, GenerateStreamChoice

_encode = msgspec.json.Encoder().encode
_Final = TypeVar("_Final")  # a finished response object (Responses' or Messages'), handed back as it came
# gpt-oss: what ends an analysis message and opens the final answer (a budget spent in reasoning)
HARMONY_FINAL_HEADER = "<|start|>assistant<|channel|>final<|message|>"
HARMONY_ANALYSIS_TO_FINAL = "<|end|>" + HARMONY_FINAL_HEADER
HARMONY_BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
# How long a stored response's last stream event waits for the store (then it goes out anyway, logged).
STORE_WAIT_S = 30.0


def sse_event(event: Any, name: str) -> bytes:
    """An SSE event with its ``event:`` line, as OpenAI's Responses and Anthropic's Messages streams frame them."""
    return b"event: " + name.encode() + b"\ndata: " + _encode(event) + b"\n\n"


class ApiChoice:
    """The one output of a Responses or Messages request: pipeline state, blocks, their texts, stops, finish."""

    def __init__(self, config: RenderConfig, chat: ChatCompletionRequest, gen: GenerateRequest) -> None:
        pcfg = pipeline_config(config, chat, request_id=gen.request_id or "", choice_index=0)
        self.pipeline = SegmentPipeline(config.tokenizer, pcfg)
        self.state = self.pipeline.initial_state(gen.token_ids)
        self.blocks = BlockState()
        # Responses' message.output_text.logprobs (the request asked the engine for logprobs)
        self.text_logprobs = TextLogprobs(config.tokenizer, tokens_as_token_ids(None, config)) \
            if chat.logprobs else None
        self.texts = BlockTexts(self.text_logprobs)
        stops = [s for s in chat.stop or () if s] if isinstance(chat.stop, list) else []
        self.matcher = StopMatcher(stops) if stops else None
        self.tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.done = False

    def step(self, ids: list[int], engine_finish: str | None, engine_stop: int | str | None = None,
             logprobs: GenerateLogprobs | None = None) -> list[Step]:
        pipeline, state = self.pipeline, self.state
        self.tokens += len(ids)
        routed: list[Step] = []
        if self.text_logprobs is not None:  # token by token, each logprob to the text it made
            routed = self.text_logprobs.feed(pipeline, state, self.blocks, ids, logprobs) if ids else []
            segs = []
        else:
            segs = segments(pipeline.feed(state, ids)) if ids else []
        if engine_finish is not None:
            segs = segs + segments(pipeline.finish(state))
        finish_reason, stop = engine_finish, engine_stop
        if self.matcher is not None:
            segs, matched = self._stops(segs, engine_finish is not None)
            if matched is not None:
                finish_reason, stop = "stop", matched
        steps = sequence(self.blocks, segs)
        if finish_reason is not None:
            steps += finish(self.blocks)
            self.done = True
            self.finish_reason = pipeline.finish_reason(state, finish_reason)
            self.stop_reason = stop
        if self.text_logprobs is not None:
            steps = routed + self.text_logprobs.end(steps, self.blocks)
        self.texts.add(steps)
        return steps

    def reasoning_tokens(self) -> int:
        return self.pipeline.reasoning_tokens(self.state)

    def forget_header(self) -> None:
        """gpt-oss: an unfinished message header the continuation drops (it produced no output)."""
        if isinstance(self.state.reasoning, HarmonyState):
            self.state.reasoning.header = ""
        if self.state.reasoning_count is not None:
            self.state.reasoning_count.header = []

    def thinking_tokens(self) -> int | None:
        return thinking_tokens(self.pipeline, self.state)

    def _stops(self, segs: list[Segment], ending: bool) -> tuple[list[Segment], str | None]:
        assert self.matcher is not None
        out: list[Segment] = []
        for seg in segs:
            if seg.kind != "text":
                out.append(seg)
                continue
            released, match = self.matcher.feed(seg.text)
            if match is not None:
                if match.text:
                    out.append(Segment("text", match.text))
                return out, match.stop  # everything after the stop string is dropped
            if released:
                out.append(Segment("text", released))
        if ending:
            tail = self.matcher.flush()
            if tail:
                out.append(Segment("text", tail))
        return out, None


class ThinkingBudget:
    """Anthropic's ``thinking.budget_tokens``, enforced by the gateway (no engine flag needed): the engine call
    asks for at most ``budget`` tokens; when it stops there (``length``) short of the request's ``max_tokens``, the
    gateway ends the phase itself. If the model is still thinking, the tokens that end reasoning are appended as
    output, exactly as if the model had written them: the reasoning parser's end tag and a blank line
    (``</think>\\n\\n``), or for gpt-oss the end of the analysis message and the start of the final answer
    (``<|end|><|start|>assistant<|channel|>final<|message|>``; a budget that ran out inside a message header
    drops that unfinished header, which the client never sees, and opens the final answer in its place). Then a
    continuation call (prompt + everything generated so far) produces the rest, with the remaining
    ``max_tokens``. One message, one stream, to the client."""

    def __init__(self, config: RenderConfig, gen: GenerateRequest, budget: int) -> None:
        self.config = config
        self.max_tokens = gen.sampling_params.max_tokens or 0
        self.budget = budget
        self.generated: list[int] = []
        self.next_gen: GenerateRequest | None = None
        self.first: GenerateRequest | None = msgspec.structs.replace(gen, sampling_params=msgspec.structs.replace(
            gen.sampling_params, max_tokens=min(budget, self.max_tokens), thinking_token_budget=None))
        self.base = gen

    def phase_over(self, out: ApiChoice, ids: list[int], engine_finish: str | None) -> bool:
        self.generated.extend(ids)
        return (engine_finish == "length" and self.next_gen is None and self.first is not None
                and out.tokens + len(ids) < self.max_tokens)

    def plan_next(self, out: ApiChoice) -> list[int]:
        """The tokens that close reasoning (if still open), and the continuation request (``next_gen``)."""
        closing = self._harmony_closing(out) if self.config.harmony else self._think_closing(out)
        self.generated.extend(closing)
        remaining = self.max_tokens - out.tokens - len(closing)
        params = msgspec.structs.replace(self.base.sampling_params, max_tokens=max(remaining, 1),
                                         thinking_token_budget=None)
        self.next_gen = msgspec.structs.replace(self.base, token_ids=[*self.base.token_ids, *self.generated],
                                                sampling_params=params, reasoning_ended=True,
                                                request_id=f"{self.base.request_id}-c")
        return closing

    def _think_closing(self, out: ApiChoice) -> list[int]:
        state = out.state.reasoning
        cls = self.config.reasoning_parser_cls
        if isinstance(state, ThinkState) and state.mode != CONTENT and cls is not None:
            return list(self.config.tokenizer.encode(cls.end_tag + "\n\n"))
        return []

    def _harmony_closing(self, out: ApiChoice) -> list[int]:
        state = out.state.reasoning
        encode = self.config.tokenizer.encode
        if not isinstance(state, HarmonyState):
            return []
        if state.mode == HARMONY_BODY:
            return list(encode(HARMONY_ANALYSIS_TO_FINAL)) if state.target == HARMONY_REASONING else []
        # in a header: the unfinished header goes (engine context and parser alike), the final answer opens
        ends = self.harmony_body_ends()
        kept = max((i + 1 for i, t in enumerate(self.generated) if t in ends), default=0)
        del self.generated[kept:]
        out.forget_header()
        return list(encode(HARMONY_FINAL_HEADER if kept else HARMONY_FINAL_HEADER[len("<|start|>assistant"):]))

    def harmony_body_ends(self) -> set[int]:
        tokenizer = self.config.tokenizer
        return {t for t in map(tokenizer.token_to_id, HARMONY_BODY_ENDS) if t is not None}

    def take_next(self) -> GenerateRequest | None:
        """The continuation to run once the current engine stream has ended (None: the message is complete)."""
        gen, self.next_gen = self.next_gen, None
        if gen is not None:
            self.first = None  # one continuation: the budget is spent
        return gen


class _ApiResponder:
    """What both APIs' responders share: one choice, the relay's interface, coalescing."""

    stops: list[str]

    def __init__(self, config: RenderConfig, gen: GenerateRequest, chat: ChatCompletionRequest,
                 on_done: Callable[[Any], Awaitable[None] | None] | None) -> None:
        self.config = config
        self.gen = gen
        self.response_id = gen.request_id or ""
        self.prompt_tokens = len(gen.token_ids)
        self.out = ApiChoice(config, chat, gen)
        self.stops = [s for s in chat.stop or () if s] if isinstance(chat.stop, list) else []
        self.all_done = False
        self.started = False
        self.on_done = on_done  # the finished object (the gateway stores Responses)
        self.final: Any = None
        self.storing: Awaitable[None] | None = None  # what on_done started (the store's write)

    def span_done(self, prompt_index: int, first: int, count: int) -> bool:
        return self.out.done

    def finished(self) -> bool:
        return self.out.done

    def usage_chunk(self) -> None:
        return None

    def accumulate(self, prompt_index: int, choice: GenerateStreamChoice) -> None:
        if not self.out.done:
            self.out.step(choice.token_ids or [], choice.finish_reason, choice.stop_reason, choice.logprobs)

    def stream_batch(self, items: list[tuple[int, GenerateStreamChoice]]) -> bytes:
        if len(items) > 1 and not self.stops:
            items = coalesce(items)
        return b"".join([self.stream_events(p, c) for p, c in items])

    def stream_events(self, prompt_index: int, choice: GenerateStreamChoice) -> bytes:
        raise NotImplementedError

    def _finished(self, obj: _Final) -> _Final:
        self.final = obj
        if self.on_done is not None:
            self.storing = self.on_done(obj)
        return obj

    def before_last_write(self) -> Awaitable[None] | None:
        """What the stream's last event waits for: a stored response is in the store before the client sees
        ``response.completed``, so a follow-up sent anywhere right after finds it (bounded by STORE_WAIT_S)."""
        if self.storing is None:
            return None
        return asyncio.wait_for(asyncio.shield(self.storing), STORE_WAIT_S)


class ResponsesResponder(_ApiResponder):
    def __init__(self, config: RenderConfig, gen: GenerateRequest, chat: ChatCompletionRequest, shape: ResponsesShape,
                 on_done: Callable[[Any], Awaitable[None] | None] | None = None) -> None:
        super().__init__(config, gen, chat, on_done)
        self.shape = shape
        self.response_id = shape.response_id
        self.seq = 0

    def _emit(self, events: list[Any]) -> bytes:
        self.seq += len(events)
        return b"".join([sse_event(e, e.type) for e in events])

    def stream_events(self, prompt_index: int, choice: GenerateStreamChoice) -> bytes:
        out = self.out
        if out.done:
            return b""
        head = b""
        if not self.started:
            self.started = True
            head = self._emit(self.shape.start_events(self.seq))
        steps = out.step(choice.token_ids or [], choice.finish_reason, choice.stop_reason, choice.logprobs)
        closing = status_of(out.finish_reason)[0] if out.done else "completed"
        body = self._emit(self.shape.step_events(steps, out.blocks, out.texts, self.seq, closing))
        if out.done:
            self.all_done = True
        return head + body if head else body

    def final_bytes(self, error: ApiError | None) -> bytes:
        out = self.out
        usage = self.shape.usage(out.tokens, out.reasoning_tokens())
        if error is not None:
            event = self.shape.failed_event(error.message, out.blocks, out.texts, usage, self.seq)
        else:
            event = self.shape.end_event(out.finish_reason, out.blocks, out.texts, usage, self.seq)
        self._finished(event.response)
        return self._emit([event])

    def response(self) -> ResponseObject:
        out = self.out
        status, incomplete = status_of(out.finish_reason)
        usage = self.shape.usage(out.tokens, out.reasoning_tokens())
        items = self.shape.items(out.blocks, out.texts, status, whole_arguments(out.pipeline.config.tool_parser))
        return self._finished(self.shape.response(status, items, usage, incomplete))


class MessagesResponder(_ApiResponder):
    def __init__(self, config: RenderConfig, gen: GenerateRequest, chat: ChatCompletionRequest, model: str,
                 budget: ThinkingBudget | None = None) -> None:
        super().__init__(config, gen, chat, None)
        self.shape = MessagesShape(self.response_id, model, self.prompt_tokens)
        self.budget = budget

    def _step(self, choice: GenerateStreamChoice) -> list[Step]:
        """One engine event; a phase the thinking budget cut short does not end the message (see ThinkingBudget)."""
        ids = choice.token_ids or []
        budget = self.budget
        if budget is not None and budget.phase_over(self.out, ids, choice.finish_reason):
            steps = self.out.step(ids, None)
            return steps + self.out.step(budget.plan_next(self.out), None)
        return self.out.step(ids, choice.finish_reason, choice.stop_reason)

    def accumulate(self, prompt_index: int, choice: GenerateStreamChoice) -> None:
        if not self.out.done:
            self._step(choice)

    def stream_events(self, prompt_index: int, choice: GenerateStreamChoice) -> bytes:
        out = self.out
        if out.done:
            return b""
        events: list[Any] = []
        if not self.started:
            self.started = True
            events += self.shape.start_events()
        steps = self._step(choice)
        events += self.shape.step_events(steps, out.blocks)
        if out.done:
            self.all_done = True
            events += self.shape.end_events(out.finish_reason, out.stop_reason, out.tokens, out.thinking_tokens())
        return b"".join([sse_event(e, type(e).__struct_config__.tag) for e in events])

    def final_bytes(self, error: ApiError | None) -> bytes:
        if error is None:
            return b""
        from render_service.apis.errors import anthropic_error_body

        return b"event: error\ndata: " + anthropic_error_body(error) + b"\n\n"

    def response(self) -> MessageObject:
        out = self.out
        return self._finished(self.shape.message(out.blocks, out.texts, out.finish_reason, out.stop_reason, out.tokens,
                                                 out.thinking_tokens()))
