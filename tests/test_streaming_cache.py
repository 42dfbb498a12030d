"""Streaming cache: vLLM's history-carrying stream_state continues in O(chunk) on a hit and by replay on a
miss, with identical output either way (hits, misses, evictions, expiry, two server processes)."""

from __future__ import annotations

import glob
import json
import re
from functools import lru_cache

import msgspec
import pytest

from render_service.derender.stream import derender_chat_stream
from render_service.render.render_config import load_render_config
from render_service.streaming_cache.cache import ENTRY_OVERHEAD_BYTES, StreamingCache, history_key
from render_service.streaming_cache.session import STATE_KEY, StreamRuntime
from render_service.wire.protocol import DerenderChatStreamRequest
from tests.render_harness import RenderServer
from tests.shared_paths import SHARED as SHARED_DIR
from tests.test_derender_stream import PARSER_FLAGS, render_server

SHARED = SHARED_DIR

QWEN = str(SHARED / "fixtures/qwen3-0.6b")
STREAM = str(SHARED / "fixtures/vllm-0.32-render/parsers/12_chat_derender_stream")
VLLM_EMPTY = {"prev_tokens": [], "prefix_offset": 0, "read_offset": 0, "role_sent": False,
              "logprob_context_token_ids": [], "logprob_text_offset": 0, "output_token_ids": [],
              "output_chunk_lens": [], "tools_streamed": False, "last_tool_call_ids": []}


# ---- the cache itself --------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_take_checks_an_entry_out():
    cache = StreamingCache(max_entries=4)
    cache.put(("k",), b"state")
    assert cache.take(("k",)) == b"state"
    assert cache.take(("k",)) is None  # a concurrent or retried use misses instead of sharing the state
    assert (cache.hits, cache.misses) == (1, 1)


def test_lru_evicts_the_oldest_beyond_max_entries():
    cache = StreamingCache(max_entries=2)
    for k in "abc":
        cache.put((k,), k.encode())
    assert len(cache) == 2 and cache.evictions == 1
    assert cache.take(("a",)) is None and cache.take(("c",)) == b"c"


def test_lru_evicts_the_oldest_beyond_max_bytes_and_keeps_nothing_that_cannot_fit():
    entry = 1000 + ENTRY_OVERHEAD_BYTES
    cache = StreamingCache(max_entries=100, max_bytes=3 * entry)
    for k in "abcd":
        cache.put((k,), k.encode() * 1000)
    assert len(cache) == 3 and cache.bytes == 3 * entry and cache.evictions == 1
    assert cache.take(("a",)) is None and cache.take(("b",)) == b"b" * 1000
    assert cache.bytes == 2 * entry  # a checked-out entry no longer counts
    cache.put(("big",), b"x" * (3 * entry))  # heavier than the whole cache: not kept, nothing evicted for it
    assert cache.take(("big",)) is None and len(cache) == 2
    cache.put(("c",), b"new")  # replacing an entry replaces its weight
    assert cache.bytes == entry + 3 + ENTRY_OVERHEAD_BYTES


def test_ttl_expires_entries():
    clock = FakeClock()
    cache = StreamingCache(max_entries=10, ttl_s=5, clock=clock)
    cache.put(("a",), b"1")
    clock.now = 6
    assert cache.take(("a",)) is None
    cache.put(("b",), b"2")
    clock.now = 20
    cache.put(("c",), b"3")  # expiry sweeps the stale entry
    assert len(cache) == 1 and cache.bytes == 1 + ENTRY_OVERHEAD_BYTES


def test_history_key_depends_on_every_token_and_the_binding():
    k = history_key("r", 0, b"b", [1, 2, 3])
    assert k == history_key("r", 0, b"b", [1, 2, 3])
    assert len({k, history_key("r", 0, b"b", [1, 2, 4]), history_key("r", 1, b"b", [1, 2, 3]),
                history_key("r", 0, b"c", [1, 2, 3]), history_key("r", 0, b"b", [1, 2])}) == 5


# ---- through the streaming derender -------------------------------------------------------------------


@lru_cache(maxsize=1)
def config():
    return load_render_config(QWEN, served_model_names=["qwen3-0.6b"], reasoning_parser="qwen3",
                              tool_call_parser="hermes", enable_auto_tool_choice=True)


@lru_cache(maxsize=1)
def steps() -> list[dict]:
    return [json.load(open(f))["body"] for f in sorted(glob.glob(f"{STREAM}/step_*.request.json"))]


def call(body: dict, state, runtime: StreamRuntime) -> dict:
    req = msgspec.convert(dict(body, stream_state=state), DerenderChatStreamRequest)
    return msgspec.to_builtins(derender_chat_stream(req, config(), runtime))


def compact_run() -> list[dict]:
    rt, state, out = StreamRuntime(), None, []
    for body in steps():
        ans = call(body, state, rt)
        state = ans["stream_state"]
        out.append(ans["chunk"]["choices"][0])
    return out


def vllm_client_run(runtime_for_step) -> tuple[list[dict], dict]:
    """A client that keeps only vLLM's fields (drops our key) and echoes them back."""
    state, out = dict(VLLM_EMPTY), []
    for i, body in enumerate(steps()):
        ans = call(body, state, runtime_for_step(i))
        state = {k: v for k, v in ans["stream_state"].items() if k != STATE_KEY}
        out.append(ans["chunk"]["choices"][0])
    return out, state


def test_hits_give_the_compact_paths_output():
    rt = StreamRuntime()
    out, state = vllm_client_run(lambda i: rt)
    assert out == compact_run()
    n = len(steps())
    assert rt.cache.hits == n - 1 and rt.cache.misses == 0
    assert state["output_chunk_lens"] == [1] * n and len(state["output_token_ids"]) == n
    assert state["tools_streamed"] is True and state["last_tool_call_ids"][0].startswith("chatcmpl-tool-")


def test_misses_replay_and_give_the_same_output():
    runtimes = []

    def fresh(i):
        runtimes.append(StreamRuntime())
        return runtimes[-1]

    out, _ = vllm_client_run(fresh)
    assert out == compact_run()
    assert sum(r.cache.hits for r in runtimes) == 0


def test_evictions_fall_back_to_replay():
    rt = StreamRuntime(cache=StreamingCache(max_entries=1))
    other = dict(VLLM_EMPTY)
    out, state = [], dict(VLLM_EMPTY)
    for body in steps():
        # a second stream interleaved with the first evicts its entry every time
        other_ans = call(dict(body, generate_chunk=dict(body["generate_chunk"], request_id="other")), other, rt)
        other = {k: v for k, v in other_ans["stream_state"].items() if k != STATE_KEY}
        ans = call(body, state, rt)
        state = {k: v for k, v in ans["stream_state"].items() if k != STATE_KEY}
        out.append(ans["chunk"]["choices"][0])
    assert rt.cache.evictions > 0 and rt.cache.hits <= 1  # only the last step (the other stream finished)
    assert out == compact_run()


def test_state_written_by_vllm_is_continued_correctly():
    """Take vLLM's own recorded stream_state mid-stream and continue: same deltas as vLLM recorded."""
    files = sorted(glob.glob(f"{STREAM}/step_*.response.json"))
    k = 20
    vllm_state = json.load(open(files[k]))["body"]["stream_state"]
    rt = StreamRuntime()
    state = vllm_state
    ours_args = theirs_args = ""
    for i in range(k + 1, len(files)):
        ans = call(steps()[i], state, rt)
        want = json.load(open(files[i]))["body"]["chunk"]["choices"][0]
        got = ans["chunk"]["choices"][0]
        strip = lambda d: {kk: vv for kk, vv in d.items() if vv is not None and kk != "tool_calls"}
        assert strip(got["delta"]) == strip(want["delta"])
        # arguments may lag vLLM's by the member head the guard holds (docs/tool_parsers.md), never lead
        ours_args += "".join(tc["function"].get("arguments") or "" for tc in got["delta"].get("tool_calls") or [])
        theirs_args += "".join(tc["function"].get("arguments") or "" for tc in want["delta"].get("tool_calls") or [])
        assert theirs_args.startswith(ours_args) and len(theirs_args) - len(ours_args) <= len(', "city": ')
        assert got["finish_reason"] == want["finish_reason"]
        # vLLM's fields stay current, so a vLLM client can echo the answer unchanged (even to vLLM)
        assert ans["stream_state"]["output_token_ids"][-1] == steps()[i]["generate_chunk"]["choices"][0]["token_ids"][-1]
        state = ans["stream_state"]
    assert ours_args == theirs_args
    # one replay for vLLM's state; after that our compact key (kept alongside) continues without the cache
    assert (rt.cache.misses, rt.cache.hits) == (1, 0)


def _history_lookups(metrics_text: str, result: str) -> float:
    found = re.search(rf'^splitserve_render_cache_lookups_total{{cache="stream_history",result="{result}"}} (\S+)$',
                      metrics_text, re.M)
    return float(found.group(1)) if found else 0.0


def test_history_cache_lookups_show_on_metrics():
    """A vLLM-fields client through a real server: its continuations are hits of ``stream_history`` on /metrics
    (the counters are per process: compared before and after)."""
    with RenderServer(config()) as server:
        before = server.client.get("/metrics").text
        state = dict(VLLM_EMPTY)
        for body in steps():
            answer = server.client.post("/v1/chat/completions/derender", json=dict(body, stream_state=state))
            assert answer.status_code == 200
            state = {k: v for k, v in answer.json()["stream_state"].items() if k != STATE_KEY}
        after = server.client.get("/metrics").text
    assert _history_lookups(after, "hit") - _history_lookups(before, "hit") == len(steps()) - 1
    assert re.search(r'^splitserve_render_cache_max_bytes{cache="output_texts"} [1-9]', after, re.M)


@pytest.mark.slow
def test_stream_alternating_between_two_server_processes():
    shared = {"SPLITSERVE_STREAM_STATE_SECRET": "replicas-share-this"}  # replicas sign with one secret
    with render_server(*PARSER_FLAGS, env=shared) as a, render_server(*PARSER_FLAGS, env=shared) as b:
        for keep_ours in (False, True):
            state, out = dict(VLLM_EMPTY), []
            for i, body in enumerate(steps()):
                client = (a, b)[i % 2]
                r = client.post("/v1/chat/completions/derender", json=dict(body, stream_state=state))
                assert r.status_code == 200, r.text
                ans = r.json()
                state = ans["stream_state"] if keep_ours else {
                    k: v for k, v in ans["stream_state"].items() if k != STATE_KEY}
                out.append(ans["chunk"]["choices"][0])
            expected = compact_run()
            for got, want in zip(out, expected):
                got, want = dict(got), dict(want)
                assert got == want


def typed_vllm_client_run(runtime: StreamRuntime) -> list[dict]:
    """A client that re-validates every answer into vLLM's model: unknown keys (ours) are dropped."""
    state, out = None, []
    for body in steps():
        ans = call(body, state, runtime)
        state = {**VLLM_EMPTY, **{k: v for k, v in ans["stream_state"].items() if k in VLLM_EMPTY}}
        out.append(ans["chunk"]["choices"][0])
    return out


def test_a_client_that_drops_our_key_gets_a_clear_400_not_wrong_output():
    with pytest.raises(Exception) as err:
        typed_vllm_client_run(StreamRuntime(always_vllm_fields=False))
    assert getattr(err.value, "status", None) == 400 and "lost" in err.value.message


def test_always_vllm_fields_mode_serves_clients_that_drop_unknown_keys():
    rt = StreamRuntime(always_vllm_fields=True)
    assert typed_vllm_client_run(rt) == compact_run()
    assert rt.cache.hits == len(steps()) - 1


def test_always_vllm_fields_env_switch(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_STREAM_STATE_VLLM_FIELDS", "1")
    assert StreamRuntime().always_vllm_fields is True
    monkeypatch.delenv("SPLITSERVE_STREAM_STATE_VLLM_FIELDS")
    assert StreamRuntime().always_vllm_fields is False
