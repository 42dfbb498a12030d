"""The ``stream_state`` shapes a streaming derender call accepts, and the one it answers with.

Our own state travels as a compact token (``codec``): O(chunk) work and constant bytes per call, on any
replica. Callers that send vLLM's history-carrying state (``vllm_state``) keep working: their pipeline is
found in the streaming cache (O(chunk)) or rebuilt once by replaying the history, and their history fields
are kept up to date in the answer, so a vLLM-written client echoes it back unchanged.

An answer's ``stream_state`` is a dict: ``{"splitserve_state": <token>, "role_sent": bool}`` plus vLLM's
fields only when the caller sent vLLM-shaped state (or the server runs with SPLITSERVE_STREAM_STATE_VLLM_FIELDS=1);
without them it carries ``vllm_state.FOREIGN_TIER_GUARD``, so a vLLM render tier refuses it instead of continuing
the stream from an empty history.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import msgspec

from render_service.http.errors import bad_request
from render_service.parsers.pipeline import Pipeline, PipelineConfig, PipelineState, config_bytes
from render_service.streaming_cache.cache import StreamingCache, history_key
from render_service.streaming_cache.codec import (
    PROCESS_SECRET,
    StreamStateError,
    binding_for,
    decode_state,
    encode_state,
    secret_from_env,
)
from render_service.streaming_cache.vllm_state import (
    FOREIGN_TIER_GUARD,
    VLLM_DEFAULTS,
    VllmStreamState,
    adopt_plain,
    is_vllm_shaped,
    plain_window,
    read_vllm_state,
    replay,
)

if TYPE_CHECKING:
    from render_service.tokenize.tokenizer import RenderTokenizer

STATE_KEY = "splitserve_state"
# Sampled ids carried for logprob U+FFFD repair across chunks (vLLM: 4).
LOGPROB_CONTEXT = 4
VLLM_FIELDS_ENV = "SPLITSERVE_STREAM_STATE_VLLM_FIELDS"


class StreamRuntime:
    """Per-process streaming derender settings: the state secret and the cache of live pipelines.

    ``secret``: the configured one (the argument, else SPLITSERVE_STREAM_STATE_SECRET), else this process's
    own (``codec.PROCESS_SECRET``; ``shared_secret`` is then False): states are signed either way.

    ``always_vllm_fields`` (env SPLITSERVE_STREAM_STATE_VLLM_FIELDS=1): answer every stream, from its first
    chunk, with vLLM's history fields as well, for clients that re-validate stream_state into vLLM's model and
    drop unknown keys (they then continue through the cache or by replay, at vLLM's O(history) bytes).
    """

    def __init__(self, secret: str | bytes | None = None, cache: StreamingCache[bytes] | None = None,
                 always_vllm_fields: bool | None = None) -> None:
        configured = secret_from_env(secret)
        self.shared_secret = configured is not None
        self.secret = configured if configured is not None else PROCESS_SECRET
        self.cache: StreamingCache[bytes] = cache if cache is not None else StreamingCache()
        if always_vllm_fields is None:
            always_vllm_fields = os.environ.get(VLLM_FIELDS_ENV, "").lower() in ("1", "true", "yes")
        self.always_vllm_fields = always_vllm_fields


def binding(cfg: PipelineConfig, tokenizer: RenderTokenizer) -> bytes:
    """What a state token is bound to: the pipeline configuration and the vocabulary size."""
    return binding_for(config_bytes(cfg), tokenizer.vocab_size)


class Session:
    """One call's pipeline, its state and where the state came from."""

    def __init__(self, pipeline: Pipeline, state: PipelineState, vllm: VllmStreamState | None,
                 incoming: dict[str, Any] | None) -> None:
        self.pipeline = pipeline
        self.state = state
        self.vllm = vllm  # set when the caller sent vLLM-shaped state: keep its history fields current
        self.incoming = incoming


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


def open_session(
    pipeline: Pipeline, incoming: Any, prompt_ids: list[int] | None, binding: bytes,
    runtime: StreamRuntime, max_model_len: int, parser_path: bool, vocab_size: int | None = None,
) -> Session:
    """The pipeline state the caller's ``stream_state`` stands for (any accepted shape), or a 400.

    ``vocab_size``: the ids an engine may have sampled (the model's, when larger than the tokenizer's)."""
    if incoming is None:
        state = pipeline.initial_state(prompt_ids)
        if runtime.always_vllm_fields:
            return Session(pipeline, state, VllmStreamState(), {})
        return Session(pipeline, state, None, None)
    if isinstance(incoming, str):
        return Session(pipeline, _state_from_token(pipeline, incoming, binding, runtime), None, None)
    if not isinstance(incoming, dict):
        raise bad_request("stream_state must be an object (echo back the stream_state of the previous answer)",
                          "stream_state")
    guard_key, guard = next(iter(FOREIGN_TIER_GUARD.items()))
    if incoming.get(guard_key) == guard:
        incoming = {k: v for k, v in incoming.items() if k != guard_key}
    vllm = (read_vllm_state(incoming, vocab_size or pipeline.tokenizer.vocab_size, max_model_len)
            if is_vllm_shaped(incoming) else None)
    if STATE_KEY in incoming:
        state = _state_from_token(pipeline, incoming[STATE_KEY], binding, runtime)
        return Session(pipeline, state, vllm, incoming)
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
        if pipeline.stop is not None and (vllm.role_sent or vllm.prev_tokens or vllm.prev_token_ids):
            # vLLM's window has no room for the text held back for a stop string: without our key it is lost
            raise bad_request(f"stream_state lost its {STATE_KEY!r} key, which holds the text kept back for the "
                              f"request's stop strings: echo stream_state back unchanged", "stream_state")
        # vLLM's plain window is unsigned: adopted only within the bounds a signed state must keep
        adopted = adopt_plain(pipeline, vllm, prompt_ids)
        _check_bounds(adopted)
        return Session(pipeline, adopted, vllm, incoming)
    if not vllm.output_token_ids:
        state = pipeline.initial_state(prompt_ids)
        state.role_sent = vllm.role_sent
        return Session(pipeline, state, vllm, incoming)
    key = history_key(cfg.request_id, cfg.choice_index, binding, vllm.output_token_ids)
    cached = runtime.cache.take(key)
    if cached is not None:
        state = pipeline.restore_state(msgspec.msgpack.decode(cached))
    else:
        state = replay(pipeline, vllm, prompt_ids)
    return Session(pipeline, state, vllm, incoming)


def answer_state(session: Session, binding: bytes, runtime: StreamRuntime, new_ids: list[int],
                 parser_path: bool) -> dict[str, Any]:
    """The ``stream_state`` of the answer: our token, plus vLLM's fields kept current for a vLLM caller."""
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
            out.update(plain_window(session.pipeline, state))
    else:
        out.update(FOREIGN_TIER_GUARD)
    out[STATE_KEY] = encode_state(state, binding, runtime.secret)
    out["role_sent"] = state.role_sent
    return out
