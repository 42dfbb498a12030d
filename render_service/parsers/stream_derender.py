"""Streaming derender: one generate SSE event in, ``{chunk, stream_state}`` out (vLLM's request shape).

The pipeline state travels in ``stream_state`` as our compact token (``streaming_cache.codec``): O(chunk)
work and constant bytes per call, on any replica. Callers that send vLLM's own history-carrying state
(``output_token_ids``, ``output_chunk_lens`` / ``prev_tokens`` ...) keep working: their pipeline is found
in the streaming cache (O(chunk)) or rebuilt once by replaying the history, and their history fields are
kept up to date in the answer, so a vLLM-written client echoes it back unchanged.

Our answer's ``stream_state`` is a dict: ``{"splitserve_state": <token>, "role_sent": bool}`` plus vLLM's
fields only when the caller sent vLLM-shaped state.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

import msgspec

from render_service.derender import (
    PARSER_NEEDS_CHAT_REQUEST,
    check_fingerprint,
    delta_message,
    fingerprint_sent,
    pipeline_config,
    resolve_chat_logprobs,
    resolve_completion_logprobs,
    returns_token_ids,
    tokens_as_token_ids,
)
from render_service.errors import bad_request
from render_service.parsers.detokenizer import _bytes_to_unicode, byte_level_token_bytes
from render_service.parsers.openai_stream import merge_deltas as _merge
from render_service.parsers.pipeline import ChoiceDelta, Pipeline, PipelineConfig, PipelineState
from render_service.protocol import (
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
from render_service.render import RenderConfig, check_model
from render_service.streaming_cache.cache import StreamingCache, history_key
from render_service.streaming_cache.codec import (
    StreamStateError,
    binding_for,
    decode_state,
    encode_state,
    secret_from_env,
)

STATE_KEY = "splitserve_state"
# Sampled ids carried for logprob U+FFFD repair across chunks (vLLM: 4).
LOGPROB_CONTEXT = 4
# vLLM's bound on its detokenizer window in stream_state.
MAX_PREV_TOKENS = 1024
MAX_PREV_TOKEN_CHARS = 256
_BYTE_TO_CHAR = _bytes_to_unicode()


class VllmStreamState(msgspec.Struct):
    """vLLM's DerenderStreamState, read strictly (types and bounds) before any use."""

    prev_tokens: list[str] = []
    prefix_offset: int = 0
    read_offset: int = 0
    role_sent: bool = False
    output_token_ids: list[int] = []
    output_chunk_lens: list[int] = []
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = []


VLLM_FIELDS_ENV = "SPLITSERVE_STREAM_STATE_VLLM_FIELDS"


# vLLM's DerenderStreamState with its defaults: every key a vLLM client expects in an answer.
VLLM_DEFAULTS: dict[str, Any] = {
    "prev_tokens": [], "prefix_offset": 0, "read_offset": 0, "role_sent": False,
    "logprob_context_token_ids": [], "logprob_text_offset": 0, "output_token_ids": [], "output_chunk_lens": [],
    "tools_streamed": False, "last_tool_call_ids": [],
}


class StreamRuntime:
    """Per-process streaming derender settings: the state secret and the cache of live pipelines.

    ``always_vllm_fields`` (env SPLITSERVE_STREAM_STATE_VLLM_FIELDS=1): answer every stream, from its first
    chunk, with vLLM's history fields as well, for clients that re-validate stream_state into vLLM's model and
    drop unknown keys (they then continue through the cache or by replay, at vLLM's O(history) bytes).
    """

    def __init__(self, secret: str | bytes | None = None, cache: StreamingCache | None = None,
                 always_vllm_fields: bool | None = None) -> None:
        self.secret = secret_from_env(secret)
        self.cache = cache if cache is not None else StreamingCache()
        if always_vllm_fields is None:
            always_vllm_fields = os.environ.get(VLLM_FIELDS_ENV, "").lower() in ("1", "true", "yes")
        self.always_vllm_fields = always_vllm_fields


# --------------------------------------------------------------------------------- state handling


def _binding(cfg: PipelineConfig, tokenizer: Any) -> bytes:
    return binding_for(msgspec.msgpack.encode(cfg), tokenizer.vocab_size)


_PIPELINES: "OrderedDict[bytes, tuple[Pipeline, bytes]]" = OrderedDict()
_PIPELINES_MAX = 1024


def _pipeline_for(cfg: PipelineConfig, tokenizer: Any) -> tuple[Pipeline, bytes]:
    """Pipelines hold only configuration (states travel separately), so one per stream is reused."""
    key = msgspec.msgpack.encode(cfg) + id(tokenizer).to_bytes(8, "little")
    hit = _PIPELINES.get(key)
    if hit is not None and hit[0].tokenizer is tokenizer:
        _PIPELINES.move_to_end(key)
        return hit
    made = (Pipeline(tokenizer, cfg), _binding(cfg, tokenizer))
    _PIPELINES[key] = made
    if len(_PIPELINES) > _PIPELINES_MAX:
        _PIPELINES.popitem(last=False)
    return made


class _Session:
    """One call's pipeline, its state and where the state came from."""

    def __init__(self, pipeline: Pipeline, state: PipelineState, vllm: VllmStreamState | None, incoming: dict | None):
        self.pipeline = pipeline
        self.state = state
        self.vllm = vllm  # set when the caller sent vLLM-shaped state: keep its history fields current
        self.incoming = incoming


def _read_vllm_state(raw: dict, tokenizer: Any, max_model_len: int) -> VllmStreamState:
    try:
        st = msgspec.convert(raw, VllmStreamState)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid stream_state: {exc}", "stream_state") from None
    if len(st.prev_tokens) > MAX_PREV_TOKENS or any(len(t) > MAX_PREV_TOKEN_CHARS for t in st.prev_tokens):
        raise bad_request(f"stream_state.prev_tokens exceeds {MAX_PREV_TOKENS} entries", "stream_state")
    if not 0 <= st.prefix_offset <= st.read_offset <= len(st.prev_tokens):
        raise bad_request("stream_state offsets are out of range", "stream_state")
    if len(st.output_token_ids) > max_model_len:
        raise bad_request(f"stream_state.output_token_ids exceeds max_model_len ({max_model_len})", "stream_state")
    if any(n <= 0 for n in st.output_chunk_lens) or sum(st.output_chunk_lens) != len(st.output_token_ids):
        raise bad_request("stream_state.output_chunk_lens must be positive and sum to len(output_token_ids)",
                          "stream_state")
    vocab = tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in st.output_token_ids):
        raise bad_request("stream_state.output_token_ids holds an id outside the vocabulary", "stream_state")
    if len(st.last_tool_call_ids) > 4096:
        raise bad_request("stream_state.last_tool_call_ids is too long", "stream_state")
    return st


def _state_from_token(pipeline: Pipeline, token: Any, binding: bytes, runtime: StreamRuntime) -> PipelineState:
    try:
        raw = decode_state(token, binding, runtime.secret)
        state = pipeline.restore_state(raw)
    except (StreamStateError, msgspec.ValidationError) as exc:
        raise bad_request(f"invalid stream_state: {exc}", "stream_state") from None
    _check_bounds(state)
    return state


def _check_bounds(state: PipelineState) -> None:
    d = state.detok
    ok = (
        len(d.pending) <= 4096
        and len(d.window) <= 64
        and 0 <= d.prefix_offset <= d.read_offset <= len(d.window)
        and state.tokens >= 0
        and 0 <= state.tool_calls <= 4096
        and len(state.model_call_ids) <= 4096
        and len(state.logprob_context) <= LOGPROB_CONTEXT
        and state.logprob_text_offset >= 0
    )
    if not ok:
        raise bad_request("invalid stream_state: values out of range", "stream_state")


def _replay(pipeline: Pipeline, st: VllmStreamState, prompt_ids: list[int] | None) -> PipelineState:
    """Rebuild the pipeline from vLLM's history, one producer chunk at a time (a cache miss)."""
    state = pipeline.initial_state(prompt_ids)
    ids = st.output_token_ids
    pos = 0
    for n in st.output_chunk_lens:
        pipeline.feed(state, ids[pos:pos + n])
        pos += n
    state.role_sent = st.role_sent
    return state


def _adopt_vllm_plain(pipeline: Pipeline, st: VllmStreamState, prompt_ids: list[int] | None) -> PipelineState:
    """vLLM's plain-path window as our detokenizer state (no history needed)."""
    state = pipeline.initial_state(prompt_ids if not st.prev_tokens and not st.role_sent else None)
    if st.prev_tokens or st.role_sent:
        if pipeline.detok.is_byte_level:
            state.detok.pending = b"".join(byte_level_token_bytes(t) for t in st.prev_tokens[st.read_offset:])
        else:
            state.detok.window = list(st.prev_tokens)
            state.detok.prefix_offset = st.prefix_offset
            state.detok.read_offset = st.read_offset
    state.role_sent = st.role_sent
    return state


def _open_session(
    pipeline: Pipeline, incoming: Any, prompt_ids: list[int] | None, binding: bytes,
    runtime: StreamRuntime, config: RenderConfig, parser_path: bool,
) -> _Session:
    if incoming is None:
        state = pipeline.initial_state(prompt_ids)
        if runtime.always_vllm_fields:
            return _Session(pipeline, state, VllmStreamState(), {})
        return _Session(pipeline, state, None, None)
    if isinstance(incoming, str):
        return _Session(pipeline, _state_from_token(pipeline, incoming, binding, runtime), None, None)
    if not isinstance(incoming, dict):
        raise bad_request("stream_state must be an object (echo back the stream_state of the previous answer)",
                          "stream_state")
    vllm_shaped = any(k in incoming for k in ("output_token_ids", "output_chunk_lens", "prev_tokens"))
    vllm = _read_vllm_state(incoming, config.tokenizer, config.max_model_len) if vllm_shaped else None
    if STATE_KEY in incoming:
        state = _state_from_token(pipeline, incoming[STATE_KEY], binding, runtime)
        return _Session(pipeline, state, vllm, incoming)
    if vllm is None:
        raise bad_request(f"stream_state has neither {STATE_KEY!r} nor vLLM's history fields: it was lost on the way "
                          f"back; echo stream_state unchanged, or run the server with {VLLM_FIELDS_ENV}=1",
                          "stream_state")
    cfg = pipeline.config
    if parser_path and vllm.role_sent and not vllm.output_token_ids:
        # vLLM itself never answers like this after a chunk with tokens: our key was dropped on the way back.
        raise bad_request(
            f"stream_state lost its {STATE_KEY!r} key (role already sent, no history): echo stream_state back "
            f"unchanged, or run the server with {VLLM_FIELDS_ENV}=1 to carry vLLM's history fields",
            "stream_state")
    if not parser_path:
        return _Session(pipeline, _adopt_vllm_plain(pipeline, vllm, prompt_ids), vllm, incoming)
    if not vllm.output_token_ids:
        state = pipeline.initial_state(prompt_ids)
        state.role_sent = vllm.role_sent
        return _Session(pipeline, state, vllm, incoming)
    key = history_key(cfg.request_id, cfg.choice_index, binding, vllm.output_token_ids)
    cached = runtime.cache.take(key)
    if cached is not None:
        state = pipeline.restore_state(msgspec.msgpack.decode(cached))
    else:
        state = _replay(pipeline, vllm, prompt_ids)
    return _Session(pipeline, state, vllm, incoming)


def _answer_state(session: _Session, binding: bytes, runtime: StreamRuntime, new_ids: list[int],
                  parser_path: bool) -> dict[str, Any]:
    state = session.state
    out: dict[str, Any] = {}
    vllm = session.vllm
    if vllm is not None:
        out.update(VLLM_DEFAULTS)
        out.update(session.incoming or {})
        if parser_path:
            history = vllm.output_token_ids + new_ids if new_ids else vllm.output_token_ids
            lens = vllm.output_chunk_lens + [len(new_ids)] if new_ids else vllm.output_chunk_lens
            out["output_token_ids"] = history
            out["output_chunk_lens"] = lens
            out["tools_streamed"] = state.tool_calls > 0
            out["last_tool_call_ids"] = [
                session.pipeline.call_id_for(state, i) for i in range(state.tool_calls)
            ]
            cfg = session.pipeline.config
            if not state.finished and STATE_KEY not in (session.incoming or {}):
                # A caller that drops our key needs the cache. Keep a copy for the next chunk: the caller
                # may retry this one, so the stored bytes stay untouched.
                runtime.cache.put(history_key(cfg.request_id, cfg.choice_index, binding, history),
                                  msgspec.msgpack.encode(state))
        else:
            out.update(_vllm_window(session))
    out[STATE_KEY] = encode_state(state, binding, runtime.secret)
    out["role_sent"] = state.role_sent
    return out


def _vllm_window(session: _Session) -> dict[str, Any]:
    d = session.state.detok
    if session.pipeline.detok.is_byte_level:
        pending = "".join(_BYTE_TO_CHAR[b] for b in d.pending)
        return {"prev_tokens": [pending] if pending else [], "prefix_offset": 0, "read_offset": 0}
    return {"prev_tokens": list(d.window), "prefix_offset": d.prefix_offset, "read_offset": d.read_offset}


# ----------------------------------------------------------------------------------------- shared


def _check_chunk(chunk: GenerateStreamResponse, config: RenderConfig) -> list[int]:
    if len(chunk.choices) > 1:
        raise bad_request("streaming derender expects at most one choice per chunk; send one call per choice",
                          "generate_chunk")
    if not chunk.choices:
        return []
    ids = chunk.choices[0].token_ids or []
    if len(ids) > config.max_model_len:
        raise bad_request(f"generate_chunk token_ids exceed max_model_len ({config.max_model_len})", "generate_chunk")
    vocab = config.tokenizer.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise bad_request(f"token id {t} is out of vocabulary", "generate_chunk")
    return ids


def _usage(chunk: GenerateStreamResponse, prompt_tokens: int | None) -> UsageInfo | None:
    u = chunk.usage
    if u is None:
        return None
    prompt = prompt_tokens if prompt_tokens is not None else u.prompt_tokens
    completion = u.completion_tokens or 0
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _step(session: _Session, ids: list[int], finish_reason: str | None) -> ChoiceDelta:
    pipeline, state = session.pipeline, session.state
    try:
        delta = pipeline.feed(state, ids) if ids else ChoiceDelta()
        if finish_reason is not None:
            delta = _merge(delta, pipeline.finish(state))
    except (ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        # Only a client-crafted state can drive a stage into an impossible corner: refuse it, never a 500.
        raise bad_request(f"stream_state is inconsistent with this stream: {type(exc).__name__}", "stream_state") from None
    return delta


# ------------------------------------------------------------------------------------------- chat


def derender_chat_stream(
    req: DerenderChatStreamRequest, config: RenderConfig, runtime: StreamRuntime, headers: Any = None
) -> DerenderChatStreamResponse:
    model = check_model(req.model, config)
    check_fingerprint(fingerprint_sent(req.render_fingerprint, headers), config)
    chunk = req.generate_chunk
    ids = _check_chunk(chunk, config)
    if config.has_parsers and req.chat_request is None:
        raise bad_request(PARSER_NEEDS_CHAT_REQUEST, "chat_request")
    if req.prompt_token_ids is not None and len(req.prompt_token_ids) > config.max_model_len:
        raise bad_request(f"prompt_token_ids length exceeds max_model_len ({config.max_model_len})", "prompt_token_ids")
    request_id = chunk.request_id or ""
    out_chunk = ChatCompletionStreamResponse(
        id=request_id, created=int(time.time()), model=model, choices=[],
        usage=_usage(chunk, req.prompt_tokens), metrics=chunk.metrics,
    )
    if not chunk.choices:
        # A usage-only event: nothing to parse, the state goes back unchanged.
        return DerenderChatStreamResponse(chunk=out_chunk, stream_state=req.stream_state)
    choice = chunk.choices[0]
    pcfg = pipeline_config(config, req.chat_request, request_id=request_id, choice_index=choice.index)
    pipeline, binding = _pipeline_for(pcfg, config.tokenizer)
    # forced tool choice parses even without a configured parser
    parser_path = pcfg.reasoning_parser is not None or pcfg.tool_parser is not None or pipeline.tools is not None
    prompt_ids = req.prompt_token_ids if req.prompt_token_ids is not None else chunk.prompt_token_ids
    session = _open_session(pipeline, req.stream_state, prompt_ids, binding, runtime, config, parser_path)
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
        stop_reason=choice.stop_reason if choice.finish_reason is not None else None,
        token_ids=ids if returns_token_ids(req.chat_request, pcfg) else None,
    )]
    return DerenderChatStreamResponse(
        chunk=out_chunk, stream_state=_answer_state(session, binding, runtime, ids, parser_path)
    )


# ------------------------------------------------------------------------------------ completions


def derender_completion_stream(
    req: DerenderCompletionStreamRequest, config: RenderConfig, runtime: StreamRuntime, headers: Any = None
) -> DerenderCompletionStreamResponse:
    model = check_model(req.model, config)
    check_fingerprint(fingerprint_sent(req.render_fingerprint, headers), config)
    chunk = req.generate_chunk
    ids = _check_chunk(chunk, config)
    request_id = chunk.request_id or ""
    out_chunk = CompletionStreamResponse(
        id=request_id, created=int(time.time()), model=model, choices=[],
        usage=_usage(chunk, req.prompt_tokens), metrics=chunk.metrics,
    )
    if not chunk.choices:
        return DerenderCompletionStreamResponse(chunk=out_chunk, stream_state=req.stream_state)
    choice = chunk.choices[0]
    creq = req.completion_request
    pcfg = PipelineConfig(
        request_id=request_id, choice_index=choice.index,
        skip_special_tokens=creq.skip_special_tokens if creq is not None else True,
        spaces_between_special_tokens=creq.spaces_between_special_tokens if creq is not None else True,
        hidden_token_ids=frozenset(config.bundle.eos_token_ids),
    )
    pipeline, binding = _pipeline_for(pcfg, config.tokenizer)
    prompt_ids = req.prompt_token_ids if req.prompt_token_ids is not None else chunk.prompt_token_ids
    session = _open_session(pipeline, req.stream_state, prompt_ids, binding, runtime, config, False)
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
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason if choice.finish_reason is not None else None,
    )]
    return DerenderCompletionStreamResponse(
        chunk=out_chunk, stream_state=_answer_state(session, binding, runtime, ids, False)
    )

