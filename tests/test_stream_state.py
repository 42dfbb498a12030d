"""stream_state codec: compact, versioned, size-capped, validated, signed; bad state is a 400."""

from __future__ import annotations

import base64
from functools import lru_cache

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.derender.stream import derender_chat_stream
from render_service.http.errors import ApiError
from render_service.parsers.detokenizer import DetokenizerState
from render_service.parsers.pipeline import PipelineState
from render_service.render.render_config import load_render_config
from render_service.streaming_cache.codec import (
    MAX_STATE_CHARS,
    Envelope,
    StreamStateError,
    binding_for,
    decode_state,
    encode_state,
    secret_from_env,
)
from render_service.streaming_cache.session import STATE_KEY, StreamRuntime
from render_service.wire.protocol import DerenderChatStreamRequest
from tests.shared_paths import SHARED as SHARED_DIR

SHARED = SHARED_DIR

QWEN = str(SHARED / "fixtures/qwen3-0.6b")
BIND = binding_for("req", 0, "cfg")


def sample_state() -> PipelineState:
    return PipelineState(detok=DetokenizerState(pending=b"\xf0\x9f"), reasoning={"mode": 1, "held": "</th"},
                         role_sent=True, tokens=7)


def test_round_trip_unsigned_and_signed():
    state = sample_state()
    for secret in (None, b"k1"):
        token = encode_state(state, BIND, secret)
        assert token.startswith("ss1.")
        assert msgspec.convert(decode_state(token, BIND, secret), PipelineState) == state
    assert len(encode_state(state, BIND, b"k1")) < 300


def test_signed_state_refuses_tampering_other_secret_and_unsigned():
    token = encode_state(sample_state(), BIND, b"k1")
    head, payload, sig = token.split(".")
    raw = bytearray(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    raw[-1] ^= 1
    forged = f"{head}.{base64.urlsafe_b64encode(bytes(raw)).rstrip(b'=').decode()}.{sig}"
    with pytest.raises(StreamStateError, match="signature"):
        decode_state(forged, BIND, b"k1")
    with pytest.raises(StreamStateError, match="signature"):
        decode_state(token, BIND, b"k2")
    with pytest.raises(StreamStateError, match="not signed"):
        decode_state(encode_state(sample_state(), BIND, None), BIND, b"k1")


def test_tokens_read_back_from_the_issued_store_are_checked_like_any_other(monkeypatch):
    """A token this process signed is read back without a second MAC; the store must not let anything through
    that the full check would refuse, nor grow without bound."""
    from render_service.streaming_cache import codec

    state = sample_state()
    token = encode_state(state, BIND, b"k1")
    assert token.split(".")[2] in codec._ISSUED
    assert msgspec.convert(decode_state(token, BIND, b"k1"), PipelineState) == state
    assert token.split(".")[2] not in codec._ISSUED  # read once: a retry of the chunk takes the full check
    assert msgspec.convert(decode_state(token, BIND, b"k1"), PipelineState) == state

    with pytest.raises(StreamStateError, match="signature"):  # fresh in the store, but another secret reads it
        decode_state(encode_state(state, BIND, b"k1"), BIND, b"k2")
    head, payload, sig = encode_state(state, BIND, b"k1").split(".")
    other = encode_state(PipelineState(detok=DetokenizerState(), tokens=8), BIND, b"k1").split(".")[1]
    with pytest.raises(StreamStateError, match="signature"):  # a stored tag over another (valid) payload
        decode_state(f"{head}.{other}.{sig}", BIND, b"k1")
    with pytest.raises(StreamStateError, match="another request"):  # the binding is still checked
        decode_state(encode_state(state, BIND, b"k1"), binding_for("req", 1, "cfg"), b"k1")

    monkeypatch.setattr(codec, "_ISSUED", {})
    monkeypatch.setattr(codec, "MAX_ISSUED", 8)
    for i in range(50):
        encode_state(PipelineState(detok=DetokenizerState(), tokens=i), BIND, b"k1")
    assert len(codec._ISSUED) <= 8
    big = PipelineState(detok=DetokenizerState(), model_call_ids=["x" * 3000])
    token = encode_state(big, BIND, b"k1")
    assert token.split(".")[2] not in codec._ISSUED  # large states are not kept, and still read back
    assert msgspec.convert(decode_state(token, BIND, b"k1"), PipelineState) == big


@pytest.mark.parametrize(
    "token, message",
    [
        (None, "string"),
        (123, "string"),
        ("", "format"),
        ("ss2.AAAA", "format"),
        ("ss1", "malformed"),
        ("ss1.a.b.c", "malformed"),
        ("ss1.!!!!", "corrupt"),
        ("ss1." + "A" * (MAX_STATE_CHARS + 1), "too large"),
    ],
)
def test_malformed_tokens_are_refused(token, message):
    with pytest.raises(StreamStateError, match=message):
        decode_state(token, BIND, None)


def test_truncated_token_is_refused():
    token = encode_state(sample_state(), BIND, None)
    for cut in range(5, len(token) - 1, 7):
        with pytest.raises(StreamStateError):
            decode_state(token[:cut], BIND, None)


def test_foreign_binding_and_version_are_refused():
    token = encode_state(sample_state(), BIND, None)
    with pytest.raises(StreamStateError, match="another request"):
        decode_state(token, binding_for("req", 1, "cfg"), None)
    old = "ss1." + base64.urlsafe_b64encode(msgspec.msgpack.encode(Envelope(99, BIND, {}))).rstrip(b"=").decode()
    with pytest.raises(StreamStateError, match="version 99"):
        decode_state(old, BIND, None)


def test_secret_from_env(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_STREAM_STATE_SECRET", "s3")
    assert secret_from_env() == b"s3"
    assert secret_from_env("x") == b"x"
    monkeypatch.delenv("SPLITSERVE_STREAM_STATE_SECRET")
    assert secret_from_env() is None


# ---- through the endpoint function: every bad state is an ApiError 400, never a crash -----------------


@lru_cache(maxsize=1)
def config():
    return load_render_config(QWEN, served_model_names=["qwen3-0.6b"], reasoning_parser="qwen3",
                              tool_call_parser="hermes", enable_auto_tool_choice=True)


CHAT = {"model": "qwen3-0.6b", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}


def call(state, ids=(9707,), runtime=None, request_id="gen-1", finish=None):
    body = {"stream": True, "generate_chunk": {"request_id": request_id, "choices": [
        {"index": 0, "token_ids": list(ids), "finish_reason": finish}]},
        "stream_state": state, "chat_request": CHAT, "prompt_token_ids": [151644, 77091, 198]}
    req = msgspec.convert(body, DerenderChatStreamRequest)
    return msgspec.to_builtins(derender_chat_stream(req, config(), runtime or StreamRuntime()))


def test_endpoint_round_trips_its_own_state_and_refuses_foreign_state():
    rt = StreamRuntime(secret="k")
    first = call(None, runtime=rt)
    second = call(first["stream_state"], runtime=rt)
    assert second["chunk"]["choices"][0]["delta"]["role"] is None
    with pytest.raises(ApiError) as err:
        call(first["stream_state"], runtime=rt, request_id="gen-2")  # another stream's state
    assert err.value.status == 400 and err.value.param == "stream_state"
    with pytest.raises(ApiError) as err:
        call(first["stream_state"], runtime=StreamRuntime(secret="other"))
    assert err.value.status == 400


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_mutation_of_the_state_token_is_a_400_or_a_valid_continuation(data):
    """Unsigned state: random byte flips must never crash (400 or a normal answer)."""
    first = call(None)
    token = first["stream_state"][STATE_KEY]
    raw = bytearray(token.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.sampled_from(b"ABCDEFabcdef0123456789-_.xyz"))
    try:
        out = call({STATE_KEY: raw.decode()})
    except ApiError as exc:
        assert exc.status == 400
    else:
        assert out["chunk"]["choices"][0]["index"] == 0


@pytest.mark.parametrize("state", [
    "not-a-dict-token",
    [1, 2, 3],
    {"something": "else"},
    {STATE_KEY: 5},
    {"output_token_ids": [1, 2], "output_chunk_lens": [1]},
    {"output_token_ids": [-5], "output_chunk_lens": [1]},
    {"output_token_ids": [1], "output_chunk_lens": [0, 1]},
    {"prev_tokens": ["a"] * 2000},
    {"prev_tokens": ["a"], "prefix_offset": 3, "read_offset": 1},
    {"output_token_ids": "nope"},
])
def test_bad_states_are_400(state):
    with pytest.raises(ApiError) as err:
        call(state)
    assert err.value.status == 400


def test_hostile_values_inside_a_well_formed_signed_state_are_refused():
    from render_service.derender.batch import pipeline_config
    from render_service.streaming_cache.codec import encode_state as enc
    from render_service.streaming_cache.session import binding as _binding
    from render_service.wire.protocol import ChatCompletionRequest

    pcfg = pipeline_config(config(), msgspec.convert(CHAT, ChatCompletionRequest), request_id="gen-1", choice_index=0)
    bind = _binding(pcfg, config().tokenizer)
    bad = {"detok": {"pending": b"", "window": ["x"] * 100, "prefix_offset": 0, "read_offset": 0},
           "reasoning": {"mode": 1, "held": ""}, "tools": {}, "tokens": 1}
    keyed = StreamRuntime(secret="k")  # signed with the tier's secret: validated all the same
    with pytest.raises(ApiError, match="out of range"):
        call({STATE_KEY: enc(bad, bind, b"k")}, runtime=keyed)
    wrong_type = dict(bad, detok={"pending": "str", "window": [], "prefix_offset": 0, "read_offset": 0})
    with pytest.raises(ApiError, match="invalid stream_state"):
        call({STATE_KEY: enc(wrong_type, bind, b"k")}, runtime=keyed)
    with pytest.raises(ApiError, match="not signed"):  # no secret configured: signed all the same
        call({STATE_KEY: enc(bad, bind, None)})
