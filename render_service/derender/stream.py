"""Streaming derender: one generate SSE event in, ``{chunk, stream_state}`` out (vLLM's request shape).

The per-chunk work of ``/v1/chat/completions/derender`` and ``/v1/completions/derender`` with stream=true:
check the chunk, find the pipeline, step it, and wrap the delta as an OpenAI stream chunk. Which
``stream_state`` shapes are accepted, and what the answer's looks like, is ``streaming_cache.session``'s job.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

from render_service.derender.batch import (
    PARSER_NEEDS_CHAT_REQUEST,
    asks_weight_versions,
    check_fingerprint,
    fingerprint_sent,
    pipeline_config,
    returns_token_ids,
    with_stops,
)
from render_service.derender.choice_shapes import completion_pipeline_config, delta_message
from render_service.derender.logprobs import resolve_chat_logprobs, resolve_completion_logprobs, tokens_as_token_ids
from render_service.http.errors import bad_request
from render_service.parsers.pipeline import ChoiceDelta, merge_deltas
from render_service.render.render_config import RenderConfig, check_model
from render_service.streaming_cache.pipelines import PipelineCache
from render_service.streaming_cache.session import (
    LOGPROB_CONTEXT,
    Session,
    StreamRuntime,
    answer_state,
    open_session,
)
from render_service.wire.protocol import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DerenderChatStreamRequest,
    DerenderChatStreamResponse,
    DerenderCompletionStreamRequest,
    DerenderCompletionStreamResponse,
    GenerateStreamResponse,
    UsageInfo,
)

__all__ = ["StreamRuntime", "derender_chat_stream", "derender_completion_stream"]

# Pipelines hold only configuration (states travel separately), so one per stream is reused between chunks.
_PIPELINES = PipelineCache()
_pipeline_for = _PIPELINES.get
_Chunk = TypeVar("_Chunk", ChatCompletionStreamResponse, CompletionStreamResponse)


def _checked(req: DerenderChatStreamRequest | DerenderCompletionStreamRequest, config: RenderConfig,
             headers: Any) -> tuple[str, GenerateStreamResponse, list[int]]:
    """What every streaming derender call checks first: (the model to answer as, the engine chunk, its ids)."""
    model = check_model(req.model, config)
    check_fingerprint(fingerprint_sent(req.render_fingerprint, headers), config)
    return model, req.generate_chunk, _check_chunk(req.generate_chunk, config)


def _check_chunk(chunk: GenerateStreamResponse, config: RenderConfig) -> list[int]:
    if len(chunk.choices) > 1:
        raise bad_request("streaming derender expects at most one choice per chunk; send one call per choice",
                          "generate_chunk")
    if not chunk.choices:
        return []
    ids = chunk.choices[0].token_ids or []
    if len(ids) > config.max_model_len:
        raise bad_request(f"generate_chunk token_ids exceed max_model_len ({config.max_model_len})", "generate_chunk")
    vocab = config.output_vocab_size
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise bad_request(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})", "generate_chunk")
    return ids


def _usage(chunk: GenerateStreamResponse, prompt_tokens: int | None) -> UsageInfo | None:
    u = chunk.usage
    if u is None:
        return None
    prompt = prompt_tokens if prompt_tokens is not None else u.prompt_tokens
    completion = u.completion_tokens or 0
    return UsageInfo.counted(prompt, completion)


def _envelope(cls: type[_Chunk], chunk: GenerateStreamResponse, model: str, prompt_tokens: int | None) -> _Chunk:
    """The answer's chunk before its choice: the engine chunk's id, usage, metrics and kv_transfer_params (vLLM
    0.33's key; decode's end of turn)."""
    return cls(id=chunk.request_id or "", created=int(time.time()), model=model, choices=[],
               usage=_usage(chunk, prompt_tokens), metrics=chunk.metrics, kv_transfer_params=chunk.kv_transfer_params)


def _step(session: Session, ids: list[int], finish_reason: str | None) -> ChoiceDelta:
    pipeline, state = session.pipeline, session.state
    try:
        delta = pipeline.feed(state, ids) if ids else ChoiceDelta()
        if finish_reason is not None:
            delta = merge_deltas(delta, pipeline.finish(state))
    except (ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        # Only a client-crafted state can drive a stage into an impossible corner: refuse it, never a 500.
        raise bad_request(f"stream_state is inconsistent with this stream: {type(exc).__name__}",
                          "stream_state") from None
    return delta


# ------------------------------------------------------------------------------------------- chat


def derender_chat_stream(
    req: DerenderChatStreamRequest, config: RenderConfig, runtime: StreamRuntime, headers: Any = None
) -> DerenderChatStreamResponse:
    model, chunk, ids = _checked(req, config, headers)
    if config.has_parsers and req.chat_request is None:
        raise bad_request(PARSER_NEEDS_CHAT_REQUEST, "chat_request")
    if req.prompt_token_ids is not None and len(req.prompt_token_ids) > config.max_model_len:
        raise bad_request(f"prompt_token_ids length exceeds max_model_len ({config.max_model_len})", "prompt_token_ids")
    request_id = chunk.request_id or ""
    out_chunk = _envelope(ChatCompletionStreamResponse, chunk, model, req.prompt_tokens)
    if not chunk.choices:
        # A usage-only event: nothing to parse, the state goes back unchanged.
        return DerenderChatStreamResponse(chunk=out_chunk, stream_state=req.stream_state)
    choice = chunk.choices[0]
    pcfg = with_stops(pipeline_config(config, req.chat_request, request_id=request_id, choice_index=choice.index),
                      req.chat_request)
    pipeline, state_binding = _pipeline_for(pcfg, config.tokenizer)
    # forced tool choice parses even without a configured parser
    parser_path = pcfg.reasoning_parser is not None or pcfg.tool_parser is not None or pipeline.tools is not None
    prompt_ids = req.prompt_token_ids if req.prompt_token_ids is not None else chunk.prompt_token_ids
    session = open_session(pipeline, req.stream_state, prompt_ids, state_binding, runtime, config.max_model_len,
                           parser_path, vocab_size=config.output_vocab_size)
    delta = _step(session, ids, choice.finish_reason)
    state = session.state
    message = delta_message(delta, config.reasoning_field)
    if not state.role_sent:
        message.role = "assistant"
        state.role_sent = True
    logprobs = None
    if choice.logprobs is not None and pcfg.include_reasoning:
        context = list(state.logprob_context)
        logprobs = resolve_chat_logprobs(choice.logprobs, config.tokenizer, context,
                                         tokens_as_token_ids(req.chat_request, config))
        state.logprob_context = context[-LOGPROB_CONTEXT:]
    finish = pipeline.finish_reason(state, choice.finish_reason) if choice.finish_reason is not None else None
    out_chunk.choices = [ChatCompletionStreamChoice(
        index=choice.index, delta=message, logprobs=logprobs, finish_reason=finish,
        stop_reason=pipeline.stop_reason(state, choice.stop_reason) if choice.finish_reason is not None else None,
        token_ids=ids if returns_token_ids(req.chat_request, pcfg) else None,
        weight_versions=choice.weight_versions if asks_weight_versions(req.chat_request) else None,
    )]
    return DerenderChatStreamResponse(
        chunk=out_chunk, stream_state=answer_state(session, state_binding, runtime, ids, parser_path)
    )


# ------------------------------------------------------------------------------------ completions


def derender_completion_stream(
    req: DerenderCompletionStreamRequest, config: RenderConfig, runtime: StreamRuntime, headers: Any = None
) -> DerenderCompletionStreamResponse:
    model, chunk, ids = _checked(req, config, headers)
    request_id = chunk.request_id or ""
    out_chunk = _envelope(CompletionStreamResponse, chunk, model, req.prompt_tokens)
    if not chunk.choices:
        return DerenderCompletionStreamResponse(chunk=out_chunk, stream_state=req.stream_state)
    choice = chunk.choices[0]
    creq = req.completion_request
    pcfg = with_stops(completion_pipeline_config(config, creq, request_id=request_id, choice_index=choice.index),
                      creq)
    pipeline, state_binding = _pipeline_for(pcfg, config.tokenizer)
    prompt_ids = req.prompt_token_ids if req.prompt_token_ids is not None else chunk.prompt_token_ids
    session = open_session(pipeline, req.stream_state, prompt_ids, state_binding, runtime, config.max_model_len, False,
                           vocab_size=config.output_vocab_size)
    delta = _step(session, ids, choice.finish_reason)
    session.state.role_sent = True
    logprobs = None
    if choice.logprobs is not None:
        state = session.state
        context = list(state.logprob_context)
        logprobs = resolve_completion_logprobs(choice.logprobs, config.tokenizer, context, state.logprob_text_offset,
                                               tokens_as_token_ids(creq, config))
        state.logprob_context = context[-LOGPROB_CONTEXT:]
        if logprobs is not None:
            state.logprob_text_offset += sum(len(t) for t in logprobs["tokens"])
    out_chunk.choices = [CompletionStreamChoice(
        index=choice.index, text=delta.content or "",
        logprobs=logprobs,
        finish_reason=session.pipeline.finish_reason(session.state, choice.finish_reason),
        stop_reason=(session.pipeline.stop_reason(session.state, choice.stop_reason)
                     if choice.finish_reason is not None else None),
        weight_versions=choice.weight_versions if asks_weight_versions(creq) else None,
    )]
    return DerenderCompletionStreamResponse(
        chunk=out_chunk, stream_state=answer_state(session, state_binding, runtime, ids, False)
    )

