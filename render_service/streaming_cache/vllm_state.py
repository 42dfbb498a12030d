"""vLLM's own ``stream_state`` shape (``DerenderStreamState``): read strictly, adopted, and kept current.

Callers written against vLLM send its history-carrying state (``output_token_ids``, ``output_chunk_lens``,
``prev_tokens`` ...). This module is the one definition of that shape: it validates what arrives (types and
bounds, before any use), turns vLLM's plain-path window into our detokenizer state, rebuilds a pipeline
from vLLM's history on a cache miss, and writes vLLM's window fields back into an answer.

vLLM 0.34 renamed the window ``prev_tokens`` (token strings) to ``prev_token_ids`` (ids) without an alias: each
version ignores the other's field. We read either and write both, so a 0.33 and a 0.34 caller each find theirs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from render_service.http.errors import bad_request
from render_service.parsers.detokenizer import pending_bytes_from_token_strings
from render_service.parsers.pipeline import Pipeline, PipelineState
from render_service.tokenize.byte_level import BYTE_TO_CHAR

# vLLM's bound on its detokenizer window in stream_state.
MAX_PREV_TOKENS = 1024
MAX_PREV_TOKEN_CHARS = 256
MAX_TOOL_CALL_IDS = 4096


class VllmStreamState(msgspec.Struct):
    """vLLM's DerenderStreamState: its fields in vLLM's order, with vLLM's defaults."""

    prev_tokens: list[str] = []
    prev_token_ids: list[int] = []
    prefix_offset: int = 0
    read_offset: int = 0
    role_sent: bool = False
    # vLLM's logprob repair fields: carried back to a vLLM client unchanged, never read here (ours travel
    # in our own state), so any value passes.
    logprob_context_token_ids: Any = []
    logprob_text_offset: Any = 0
    output_token_ids: list[int] = []
    output_chunk_lens: list[int] = []
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = []


# Every key a vLLM client expects in an answer, with its default, in vLLM's order.
VLLM_DEFAULTS: dict[str, Any] = msgspec.structs.asdict(VllmStreamState())

# Any one of these keys marks an incoming state as vLLM-shaped.
VLLM_HISTORY_KEYS = ("output_token_ids", "output_chunk_lens", "prev_tokens", "prev_token_ids")


def is_vllm_shaped(incoming: dict[str, Any]) -> bool:
    return any(k in incoming for k in VLLM_HISTORY_KEYS)


def read_vllm_state(raw: dict[str, Any], vocab_size: int, max_model_len: int) -> VllmStreamState:
    """The client's vLLM-shaped state, or a 400 naming what is wrong with it."""
    try:
        st = msgspec.convert(raw, VllmStreamState)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid stream_state: {exc}", "stream_state") from None
    if len(st.prev_tokens) > MAX_PREV_TOKENS or any(len(t) > MAX_PREV_TOKEN_CHARS for t in st.prev_tokens):
        raise bad_request(f"stream_state.prev_tokens exceeds {MAX_PREV_TOKENS} entries", "stream_state")
    if len(st.prev_token_ids) > MAX_PREV_TOKENS:
        raise bad_request(f"stream_state.prev_token_ids exceeds {MAX_PREV_TOKENS} entries", "stream_state")
    if any(not 0 <= t < vocab_size for t in st.prev_token_ids):
        raise bad_request("stream_state.prev_token_ids holds an id outside the vocabulary", "stream_state")
    # Our answers carry both windows (they agree); 0.34's ids win when both arrive.
    window_len = len(st.prev_token_ids) if st.prev_token_ids else len(st.prev_tokens)
    if not 0 <= st.prefix_offset <= st.read_offset <= window_len:
        raise bad_request("stream_state offsets are out of range", "stream_state")
    if len(st.output_token_ids) > max_model_len:
        raise bad_request(f"stream_state.output_token_ids exceeds max_model_len ({max_model_len})", "stream_state")
    if any(n <= 0 for n in st.output_chunk_lens) or sum(st.output_chunk_lens) != len(st.output_token_ids):
        raise bad_request("stream_state.output_chunk_lens must be positive and sum to len(output_token_ids)",
                          "stream_state")
    if any(not 0 <= t < vocab_size for t in st.output_token_ids):
        raise bad_request("stream_state.output_token_ids holds an id outside the vocabulary", "stream_state")
    if len(st.last_tool_call_ids) > MAX_TOOL_CALL_IDS:
        raise bad_request("stream_state.last_tool_call_ids is too long", "stream_state")
    return st


def replay(pipeline: Pipeline, st: VllmStreamState, prompt_ids: list[int] | None) -> PipelineState:
    """Rebuild the pipeline from vLLM's history, one producer chunk at a time (a cache miss)."""
    state = pipeline.initial_state(prompt_ids)
    ids = st.output_token_ids
    pos = 0
    for n in st.output_chunk_lens:
        pipeline.feed(state, ids[pos:pos + n])
        pos += n
    state.role_sent = st.role_sent
    return state


def window_strings(pipeline: Pipeline, st: VllmStreamState) -> list[str]:
    """The caller's window as token strings, whichever of vLLM's two window fields it sent."""
    if st.prev_token_ids:
        return [pipeline.detok.tables.token_string(t) for t in st.prev_token_ids]
    return st.prev_tokens


def adopt_plain(pipeline: Pipeline, st: VllmStreamState, prompt_ids: list[int] | None) -> PipelineState:
    """vLLM's plain-path window as our detokenizer state (no history needed)."""
    window = window_strings(pipeline, st)
    state = pipeline.initial_state(prompt_ids if not window and not st.role_sent else None)
    if window or st.role_sent:
        if pipeline.detok.is_byte_level:
            state.detok.pending = pending_bytes_from_token_strings(window[st.read_offset:])
        else:
            state.detok.window = list(window)
            state.detok.prefix_offset = st.prefix_offset
            state.detok.read_offset = st.read_offset
    state.role_sent = st.role_sent
    return state


def plain_window(pipeline: Pipeline, state: PipelineState) -> dict[str, Any]:
    """Our detokenizer state as vLLM's plain-path window fields, in 0.33's strings and 0.34's ids.

    Byte-level pending bytes (a character cut between tokens) travel as one pseudo-token string for 0.33 and as
    the vocabulary's single-byte tokens for 0.34: either way vLLM decodes them in front of the next token."""
    d = state.detok
    hf = pipeline.detok.tables.hf
    if pipeline.detok.is_byte_level:
        pending = "".join(BYTE_TO_CHAR[b] for b in d.pending)
        byte_ids = [hf.token_to_id(BYTE_TO_CHAR[b]) for b in d.pending]
        return {"prev_tokens": [pending] if pending else [], "prev_token_ids": _all_or_none(byte_ids),
                "prefix_offset": 0, "read_offset": 0}
    return {"prev_tokens": list(d.window), "prev_token_ids": _all_or_none([hf.token_to_id(t) for t in d.window]),
            "prefix_offset": d.prefix_offset, "read_offset": d.read_offset}


def _all_or_none(ids: list[int | None]) -> list[int]:
    """The ids when every string had one; else no window (vLLM then starts its window afresh)."""
    return [t for t in ids if t is not None] if None not in ids else []


# Our compact answer, sent to a vLLM render tier, would be read as an empty history and continue the stream
# silently wrong (the rest of a tool call lands in reasoning). This value makes vLLM (0.32-0.34: an int field)
# refuse it with a 400 that names the field; our own reader never looks at it.
FOREIGN_TIER_GUARD = {"read_offset": "splitserve-state: continue on a splitserve tier, or run it with "
                                     "SPLITSERVE_STREAM_STATE_VLLM_FIELDS=1"}
