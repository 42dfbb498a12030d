"""``/v1/responses/derender`` and ``/v1/messages/derender``: batch and streaming, over the chat pipeline.

Batch folds all tokens through ``SegmentPipeline`` and the block sequencer; streaming does the same per engine
chunk, so batch is the fold of the stream. Streaming answers ``{events, stream_state}``: the API's own events for
the chunk (the first chunk's start with ``response.created`` / ``message_start``, the last ends with
``response.completed`` / ``message_stop``) and a signed compact state (``streaming_cache.codec``) holding the
pipeline's state, the open blocks and the event counter: constant size, O(chunk) work.

Responses' closing events repeat each item's whole text. That text is not in the state (it would grow with the
output); it accumulates in this replica's ``OUTPUT_TEXTS`` cache under a key the state carries, O(chunk) per
chunk. A stream must therefore stay on one render replica (a router relaying one stream does); a chunk that
finds no text for its stream is refused with a 400 that says so. Messages' events repeat nothing: any replica.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from render_service.apis import messages as messages_api
from render_service.apis import responses as responses_api
from render_service.apis.messages_output import MessagesShape
from render_service.apis.messages_protocol import (
    DerenderMessagesRequest,
    DerenderMessagesStreamRequest,
    DerenderMessagesStreamResponse,
    MessageObject,
    MessagesRequest,
)
from render_service.apis.responses_output import ResponsesShape, status_of
from render_service.apis.responses_protocol import (
    DerenderResponsesRequest,
    DerenderResponsesStreamRequest,
    DerenderResponsesStreamResponse,
    ResponseObject,
    ResponsesRequest,
)
from render_service.apis.segments import (
    BlockState,
    BlockTexts,
    SegmentPipeline,
    check_block_state,
    finish,
    fold,
    segments,
    sequence,
)
from render_service.apis.text_logprobs import TextLogprobs, fold_with_logprobs, wants_logprobs
from render_service.derender.batch import (
    _check_bounds,
    check_fingerprint,
    fingerprint_sent,
    pipeline_config,
    with_stops,
)
from render_service.derender.choice_shapes import whole_arguments
from render_service.derender.logprobs import check_logprobs_bounds, tokens_as_token_ids
from render_service.derender.stream import _check_chunk
from render_service.http.errors import bad_request
from render_service.parsers.pipeline import PipelineState
from render_service.render.render_config import RenderConfig, check_model
from render_service.streaming_cache.cache import StreamingCache
from render_service.streaming_cache.codec import StreamStateError, binding_for, decode_state, encode_state
from render_service.streaming_cache.session import StreamRuntime, binding
from render_service.streaming_cache.session import _check_bounds as check_pipeline_bounds
from render_service.wire.protocol import ChatCompletionRequest, GenerateResponse, GenerateResponseChoice


def _held_weight(held: tuple[int, BlockTexts]) -> int:
    """A stream's held texts: a byte per character (latin-1 text is held at that; other text at 2 or 4), and
    512 per logprob entry (a token, its bytes and its alternatives)."""
    texts = held[1]
    entries = sum(map(len, texts.logprobs.blocks.values())) if texts.logprobs is not None else 0
    return texts.chars + 512 * entries


# Responses streams' accumulated item texts, per replica (see the module docstring), bounded in entries and
# in weight.
OUTPUT_TEXTS: StreamingCache[tuple[int, BlockTexts]] = StreamingCache(
    max_entries=4096, ttl_s=600.0, max_bytes=256 << 20, weigh=_held_weight)


class ApiStreamState(msgspec.Struct, omit_defaults=True):
    """What a Responses or Messages stream_state token carries."""

    pipeline: Any
    blocks: BlockState = msgspec.field(default_factory=BlockState)
    seq: int = 0  # Responses: the next event's sequence_number
    started: bool = False
    key: str = ""  # Responses: this stream's texts in OUTPUT_TEXTS


# ---------------------------------------------------------------------------------- request mapping


def responses_pipeline_request(req: ResponsesRequest | None, config: RenderConfig) -> ChatCompletionRequest | None:
    """What of a Responses request configures the pipeline (tools, tool choice, thinking switch)."""
    if req is None:
        return None
    kwargs = dict(req.chat_template_kwargs or {})
    if (req.reasoning or {}).get("effort") == "none" and config.reasoning_parser_cls is not None and not config.harmony:
        kwargs.setdefault(config.reasoning_parser_cls.thinking_kwarg, False)
    return ChatCompletionRequest(messages=[], tools=responses_api.chat_tools(req.tools),
                                 tool_choice=responses_api.chat_tool_choice(req.tool_choice),
                                 parallel_tool_calls=req.parallel_tool_calls is not False,
                                 chat_template_kwargs=kwargs or None, stop=req.stop,
                                 include_stop_str_in_output=req.include_stop_str_in_output)


def messages_pipeline_request(req: MessagesRequest | None, config: RenderConfig) -> ChatCompletionRequest | None:
    if req is None:
        return None
    thinking, _ = messages_api.thinking_switch(req)
    choice, parallel = messages_api.chat_tool_choice(req.tool_choice, req.tools)
    kwargs = dict(req.chat_template_kwargs or {})
    if config.reasoning_parser_cls is not None and not config.harmony:
        kwargs.setdefault(config.reasoning_parser_cls.thinking_kwarg, thinking)
    return ChatCompletionRequest(messages=[], tools=messages_api.chat_tools(req.tools), tool_choice=choice,
                                 parallel_tool_calls=parallel, chat_template_kwargs=kwargs or None,
                                 include_reasoning=messages_api.shows_thinking(thinking, config),
                                 stop=list(req.stop_sequences) if req.stop_sequences else None)


def _pipeline(config: RenderConfig, chat: ChatCompletionRequest | None, request_id: str, index: int,
              param: str, whole: GenerateResponseChoice | None = None) -> SegmentPipeline:
    """``whole``: a batch's choice (stop strings then apply as in chat batch derender); None for a stream."""
    if chat is None and config.has_parsers:
        raise bad_request(f"{param} is required when a tool or reasoning parser is configured (plain detokenization "
                          f"would leak parser markup into the output)", param)
    pcfg = pipeline_config(config, chat, request_id=request_id, choice_index=index)
    if whole is not None:
        pcfg = with_stops(pcfg, chat, whole=True, finish_reason=whole.finish_reason, stop_reason=whole.stop_reason)
    else:
        pcfg = with_stops(pcfg, chat)
    return SegmentPipeline(config.tokenizer, pcfg)


def _one_choice(gen: GenerateResponse, config: RenderConfig) -> Any:
    _check_bounds([gen], config)
    if len(gen.choices) != 1:
        raise bad_request("Responses and Messages have one output: the generate response must have one choice",
                          "generate_response")
    return gen.choices[0]


def _prompt_tokens(given: int | None, ids: list[int] | None) -> int:
    return given if given is not None else len(ids or ())


# ------------------------------------------------------------------------------------------------ batch


def derender_responses(req: DerenderResponsesRequest, config: RenderConfig, headers: Any = None) -> ResponseObject:
    model = check_model(req.model or (req.responses_request.model if req.responses_request else None), config)
    gen = req.generate_response
    check_fingerprint(fingerprint_sent(req.render_fingerprint, headers, gen), config)
    choice = _one_choice(gen, config)
    prompt_ids = req.prompt_token_ids if req.prompt_token_ids is not None else gen.prompt_token_ids
    pipeline = _pipeline(config, responses_pipeline_request(req.responses_request, config), gen.request_id,
                         choice.index, "responses_request", whole=choice)
    router = _text_logprobs(req.responses_request, config)
    if router is not None:
        check_logprobs_bounds(choice.logprobs, choice.index, config)
        blocks, texts, pstate = fold_with_logprobs(pipeline, choice.token_ids, prompt_ids, choice.logprobs, router)
    else:
        blocks, texts, pstate = fold(pipeline, choice.token_ids, prompt_ids)
    finish_reason = pipeline.finish_reason(pstate, choice.finish_reason)
    shape = ResponsesShape(_response_id(req.response_id, req.responses_request, gen.request_id), model,
                           req.responses_request, _prompt_tokens(req.prompt_tokens, prompt_ids))
    status, incomplete = status_of(finish_reason)
    usage = shape.usage(len(choice.token_ids), pipeline.reasoning_tokens(pstate))
    items = shape.items(blocks, texts, status, whole_arguments(pipeline.config.tool_parser))
    return shape.response(status, items, usage, incomplete)


def derender_messages(req: DerenderMessagesRequest, config: RenderConfig, headers: Any = None) -> MessageObject:
    model = check_model(req.model or (req.messages_request.model if req.messages_request else None), config)
    gen = req.generate_response
    check_fingerprint(fingerprint_sent(req.render_fingerprint, headers, gen), config)
    choice = _one_choice(gen, config)
    prompt_ids = req.prompt_token_ids if req.prompt_token_ids is not None else gen.prompt_token_ids
    pipeline = _pipeline(config, messages_pipeline_request(req.messages_request, config), gen.request_id,
                         choice.index, "messages_request", whole=choice)
    blocks, texts, pstate = fold(pipeline, choice.token_ids, prompt_ids)
    shape = MessagesShape(gen.request_id, model, _prompt_tokens(req.prompt_tokens, prompt_ids))
    return shape.message(blocks, texts, pipeline.finish_reason(pstate, choice.finish_reason),
                         pipeline.stop_reason(pstate, choice.stop_reason),
                         len(choice.token_ids), thinking_tokens(pipeline, pstate))


def thinking_tokens(pipeline: SegmentPipeline, state: PipelineState) -> int | None:
    """Anthropic's thinking tokens when a reasoning parser counts them (else the field is left out)."""
    return pipeline.thinking_tokens(state) if state.reasoning_count is not None else None


def _text_logprobs(req: ResponsesRequest | None, config: RenderConfig) -> TextLogprobs | None:
    """The router of message.output_text.logprobs, when the Responses request asked for them."""
    if req is None or not wants_logprobs(req.include):
        return None
    return TextLogprobs(config.tokenizer, tokens_as_token_ids(None, config))


def _response_id(given: str | None, req: ResponsesRequest | None, fallback: str) -> str:
    return given or (req.request_id if req is not None and req.request_id else None) or fallback


# -------------------------------------------------------------------------------------------- streaming


def _restore(token: Any, pipeline: SegmentPipeline, bind: bytes, runtime: StreamRuntime,
             prompt_ids: list[int] | None) -> tuple[ApiStreamState, PipelineState]:
    if token is None:
        pstate = pipeline.initial_state(prompt_ids)
        return ApiStreamState(pipeline=None), pstate
    try:
        raw = decode_state(token, bind, runtime.secret)
        state = msgspec.convert(raw, ApiStreamState)
        pstate = pipeline.restore_state(state.pipeline)
    except (StreamStateError, msgspec.ValidationError) as exc:
        raise bad_request(f"invalid stream_state: {exc}", "stream_state") from None
    check_pipeline_bounds(pstate)
    if not check_block_state(state.blocks) or state.seq < 0 or len(state.key) > 64:
        raise bad_request("invalid stream_state: values out of range", "stream_state")
    return state, pstate


def _feed(pipeline: SegmentPipeline, pstate: PipelineState, ids: list[int], finish_reason: str | None,
          blocks: BlockState) -> list[Any]:
    try:
        steps = sequence(blocks, segments(pipeline.feed(pstate, ids))) if ids else []
        if finish_reason is not None:
            steps += sequence(blocks, segments(pipeline.finish(pstate)))
            steps += finish(blocks)
    except (ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        raise bad_request(f"stream_state is inconsistent with this stream: {type(exc).__name__}",
                          "stream_state") from None
    return steps


class _StreamCall:
    """One streaming derender call's checked inputs, pipeline and restored state."""

    def __init__(self, req: DerenderResponsesStreamRequest | DerenderMessagesStreamRequest,
                 api_req: ResponsesRequest | MessagesRequest | None, chat: ChatCompletionRequest | None,
                 api: bytes, config: RenderConfig, runtime: StreamRuntime, headers: Any) -> None:
        self.config = config
        self.model = check_model(req.model or (api_req.model if api_req is not None else None), config)
        check_fingerprint(fingerprint_sent(req.render_fingerprint, headers), config)
        if req.stream_state is not None and not isinstance(req.stream_state, str):
            raise bad_request("stream_state must be the string the previous answer carried (or null on the first "
                              "chunk)", "stream_state")
        chunk = req.generate_chunk
        self.ids = _check_chunk(chunk, config)
        self.choice = chunk.choices[0] if chunk.choices else None
        self.request_id = chunk.request_id or ""
        self.prompt_ids = req.prompt_token_ids if req.prompt_token_ids is not None else chunk.prompt_token_ids
        self.prompt_tokens = _prompt_tokens(req.prompt_tokens, self.prompt_ids)
        if self.choice is None:
            return
        param = "responses_request" if api == b"responses" else "messages_request"
        self.pipeline = _pipeline(config, chat, self.request_id, self.choice.index, param)
        self.bind = binding_for(api, binding(self.pipeline.config, config.tokenizer))
        self.state, self.pstate = _restore(req.stream_state, self.pipeline, self.bind, runtime, self.prompt_ids)

    def feed(self, router: TextLogprobs | None = None) -> list[Any]:
        assert self.choice is not None
        if router is None:
            return _feed(self.pipeline, self.pstate, self.ids, self.choice.finish_reason, self.state.blocks)
        check_logprobs_bounds(self.choice.logprobs, self.choice.index, self.config)
        blocks = self.state.blocks
        try:
            steps = router.feed(self.pipeline, self.pstate, blocks, self.ids, self.choice.logprobs)
        except (ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
            raise bad_request(f"stream_state is inconsistent with this stream: {type(exc).__name__}",
                              "stream_state") from None
        return steps + router.end(_feed(self.pipeline, self.pstate, [], self.choice.finish_reason, blocks), blocks)

    def finish_reason(self) -> str | None:
        assert self.choice is not None
        reason = self.choice.finish_reason
        return self.pipeline.finish_reason(self.pstate, reason) if reason is not None else None

    def answer_state(self, runtime: StreamRuntime) -> str:
        self.state.pipeline = self.pstate
        return encode_state(self.state, self.bind, runtime.secret)


def derender_responses_stream(req: DerenderResponsesStreamRequest, config: RenderConfig, runtime: StreamRuntime,
                              headers: Any = None) -> DerenderResponsesStreamResponse:
    api_req = req.responses_request
    call = _StreamCall(req, api_req, responses_pipeline_request(api_req, config), b"responses", config, runtime,
                       headers)
    if call.choice is None:  # a usage-only event: nothing to derender, the state goes back unchanged
        return DerenderResponsesStreamResponse(events=[], stream_state=req.stream_state)
    state = call.state
    texts = _texts_for(state, _text_logprobs(api_req, config))
    shape = ResponsesShape(_response_id(req.response_id, api_req, call.request_id), call.model, api_req,
                           call.prompt_tokens)
    events: list[Any] = []
    if not state.started:
        state.started = True
        events += shape.start_events(state.seq)
        state.seq += len(events)
    steps = call.feed(texts.logprobs)
    texts.add(steps)
    finish_reason = call.finish_reason()
    closing = status_of(finish_reason)[0] if finish_reason else "completed"
    events += shape.step_events(steps, state.blocks, texts, state.seq, closing)
    state.seq = _next_seq(events, state.seq)
    if finish_reason is not None:
        usage = shape.usage(call.pstate.tokens, call.pipeline.reasoning_tokens(call.pstate))
        events.append(shape.end_event(finish_reason, state.blocks, texts, usage, state.seq))
        state.seq += 1
        OUTPUT_TEXTS.discard((state.key,))
    else:
        OUTPUT_TEXTS.put((state.key,), (state.seq, texts))
    return DerenderResponsesStreamResponse(events=events, stream_state=call.answer_state(runtime))


def _next_seq(events: list[Any], seq: int) -> int:
    return max(seq, events[-1].sequence_number + 1) if events else seq


def _texts_for(state: ApiStreamState, router: TextLogprobs | None) -> BlockTexts:
    """The stream's accumulated texts (and text logprobs): new on its first chunk, else from this replica's
    cache."""
    if not state.key:
        state.key = os.urandom(12).hex()
        return BlockTexts(router)
    held = OUTPUT_TEXTS.take((state.key,))
    if held is None or held[0] != state.seq:
        raise bad_request(
            "this render replica does not hold the stream's output text (Responses' closing events repeat it, and it "
            "is kept per replica, not in stream_state): send every chunk of a Responses stream to one replica, "
            "within 10 minutes, and each chunk once", "stream_state")
    texts: BlockTexts = held[1]
    return texts


def derender_messages_stream(req: DerenderMessagesStreamRequest, config: RenderConfig, runtime: StreamRuntime,
                             headers: Any = None) -> DerenderMessagesStreamResponse:
    api_req = req.messages_request
    call = _StreamCall(req, api_req, messages_pipeline_request(api_req, config), b"messages", config, runtime, headers)
    if call.choice is None:
        return DerenderMessagesStreamResponse(events=[], stream_state=req.stream_state)
    state = call.state
    shape = MessagesShape(call.request_id, call.model, call.prompt_tokens)
    events: list[Any] = []
    if not state.started:
        state.started = True
        events += shape.start_events()
    events += shape.step_events(call.feed(), state.blocks)
    finish_reason = call.finish_reason()
    if finish_reason is not None:
        events += shape.end_events(finish_reason, call.pipeline.stop_reason(call.pstate, call.choice.stop_reason),
                                   call.pstate.tokens,
                                   thinking_tokens(call.pipeline, call.pstate))
    return DerenderMessagesStreamResponse(events=events, stream_state=call.answer_state(runtime))
