"""vLLM's two plain-path windows (0.33's ``prev_tokens`` strings, 0.34's ``prev_token_ids``) are read and written,
and our compact answer carries a guard that a vLLM render tier refuses instead of continuing it wrongly."""

from __future__ import annotations

import json
import os
import subprocess
from functools import lru_cache
from pathlib import Path

import msgspec
import pytest

from render_service.derender.stream import derender_chat_stream
from render_service.http.errors import ApiError
from render_service.render.render_config import load_render_config
from render_service.streaming_cache.session import STATE_KEY, StreamRuntime
from render_service.streaming_cache.vllm_state import FOREIGN_TIER_GUARD
from render_service.wire.protocol import DerenderChatStreamRequest
from tests.shared_paths import SHARED

QWEN = str(SHARED / "fixtures/qwen3-0.6b")
# Multi-byte characters that byte-level BPE cuts between tokens, so a window must carry pending bytes.
TEXT = "naïve café, 世界 🎉🎉 ok\n"
V033_FIELDS = ("prev_tokens", "prefix_offset", "read_offset", "role_sent", "logprob_context_token_ids",
               "logprob_text_offset", "output_token_ids", "output_chunk_lens", "tools_streamed",
               "last_tool_call_ids")
V034_FIELDS = tuple("prev_token_ids" if f == "prev_tokens" else f for f in V033_FIELDS)


@lru_cache(maxsize=1)
def plain_config():
    return load_render_config(QWEN, served_model_names=["qwen3-0.6b"])


def text_ids() -> list[int]:
    return plain_config().tokenizer.encode(TEXT)


def call(ids: list[int], state, runtime: StreamRuntime, finish=None) -> dict:
    body = {"stream": True, "generate_chunk": {"request_id": "gen-1", "choices": [
        {"index": 0, "token_ids": ids, "finish_reason": finish}]},
        "stream_state": state, "prompt_token_ids": [151644, 77091, 198]}
    req = msgspec.convert(body, DerenderChatStreamRequest)
    return msgspec.to_builtins(derender_chat_stream(req, plain_config(), runtime))


def stream_one_token_at_a_time(keep: tuple[str, ...] | None) -> str:
    """Each answer's state cut down to the ``keep`` fields (a vLLM client of that version), or echoed whole."""
    rt = StreamRuntime()
    state: dict | None = {f: [] if f.endswith(("ids", "tokens", "lens")) else 0 for f in keep} if keep else None
    if state is not None:
        state.update(role_sent=False, tools_streamed=False)
    text = []
    for tid in text_ids():
        ans = call([tid], state, rt)
        text.append(ans["chunk"]["choices"][0]["delta"].get("content") or "")
        state = ans["stream_state"] if keep is None else {k: ans["stream_state"][k] for k in keep}
    return "".join(text)


def test_ids_cut_characters_between_tokens():
    tok = plain_config().tokenizer
    pieces = [tok.hf.id_to_token(t) for t in text_ids()]
    assert len(pieces) > len(TEXT.split())  # the emoji and CJK come out in more than one token each
    assert tok.decode(text_ids()) == TEXT


@pytest.mark.parametrize("keep", [None, V033_FIELDS, V034_FIELDS], ids=["ours", "vllm-0.33", "vllm-0.34"])
def test_each_window_shape_continues_the_text_exactly(keep):
    assert stream_one_token_at_a_time(keep) == TEXT


def test_answers_write_both_windows_and_they_agree():
    tok = plain_config().tokenizer
    rt = StreamRuntime()
    state: dict = {f: [] if f.endswith(("ids", "tokens", "lens")) else 0 for f in V034_FIELDS}
    state.update(role_sent=False, tools_streamed=False)
    saw_pending = False
    for tid in text_ids():
        st = call([tid], state, rt)["stream_state"]
        as_strings = "".join(st["prev_tokens"][st["read_offset"]:])
        from_ids = "".join(tok.hf.id_to_token(t) for t in st["prev_token_ids"][st["read_offset"]:])
        assert as_strings == from_ids
        saw_pending |= bool(st["prev_token_ids"])
        state = {k: st[k] for k in V034_FIELDS}
    assert saw_pending  # some answer was taken between the bytes of one character


def test_a_window_of_ids_outside_the_vocabulary_is_a_400():
    bad = {"prev_token_ids": [10**9], "prefix_offset": 0, "read_offset": 0}
    with pytest.raises(ApiError) as err:
        call([9707], bad, StreamRuntime())
    assert err.value.status == 400 and "prev_token_ids" in err.value.message
    with pytest.raises(ApiError):
        call([9707], {"prev_token_ids": [1] * 2000}, StreamRuntime())


def test_our_compact_answer_carries_the_guard_and_we_read_past_it():
    rt = StreamRuntime()
    first = call(text_ids()[:3], None, rt)["stream_state"]
    assert {k: first[k] for k in FOREIGN_TIER_GUARD} == FOREIGN_TIER_GUARD and STATE_KEY in first
    second = call(text_ids()[3:6], first, rt)
    assert second["chunk"]["choices"][0]["delta"]["content"]


def test_the_guard_alone_reads_as_a_lost_key():
    rt = StreamRuntime()
    first = call(text_ids()[:3], None, rt)["stream_state"]
    with pytest.raises(ApiError) as err:
        call(text_ids()[3:6], {k: v for k, v in first.items() if k != STATE_KEY}, rt)
    assert err.value.status == 400


def vllm_venv() -> Path | None:
    """vLLM 0.34's venv: $SPLITSERVE_VLLM034, else bench/.peers/vllm034 (shared/peers/vllm-render/install034.sh)."""
    candidates = [Path(os.environ["SPLITSERVE_VLLM034"])] if os.environ.get("SPLITSERVE_VLLM034") else []
    for venv in candidates + [Path(__file__).resolve().parents[1] / "bench/.peers/vllm034"]:
        if any(venv.glob("lib/python3*/site-packages/vllm/entrypoints/scale_out/token_in_token_out/protocol.py")):
            return venv
    return None


# vLLM's own model of the state, validated in its own venv: our compact answer must fail loudly there, and the
# answer with vLLM's fields must be accepted with our window intact.
VLLM_CHECK = r"""
import json, sys
from vllm.entrypoints.scale_out.token_in_token_out.protocol import DerenderStreamState
for line in sys.stdin:
    try:
        st = DerenderStreamState.model_validate(json.loads(line))
        print(json.dumps({"ok": True, "prev_token_ids": st.prev_token_ids}))
    except Exception as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
"""


def test_vllm_034_refuses_our_compact_state_and_accepts_our_vllm_fields():
    venv = vllm_venv()
    if venv is None:
        pytest.skip("vLLM 0.34 is not installed as a peer")
    compact = call(text_ids()[:5], None, StreamRuntime())["stream_state"]
    with_fields = call(text_ids()[:5], None, StreamRuntime(always_vllm_fields=True))["stream_state"]
    lines = "\n".join(json.dumps(s) for s in (compact, with_fields)) + "\n"
    out = subprocess.run([str(venv / "bin/python"), "-c", VLLM_CHECK], input=lines, capture_output=True,
                         text=True, timeout=300, env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    refused, accepted = (json.loads(line) for line in out.stdout.splitlines()[-2:])
    assert not refused["ok"] and "read_offset" in refused["error"]
    assert accepted["ok"] and accepted["prev_token_ids"] == with_fields["prev_token_ids"]
