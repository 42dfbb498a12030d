"""Multi-turn KV reuse by conversation_id through the gateway (render_service/gateway/conversations.py).

Unit tests of the cache (single use, TTL, LRU, untrusted ids), then real components: two CPU engines in
this process with the NIXL connector and bidirectional_kv_xfer, and a real gateway process in front of
them. The model has random weights (attention matters), so KV pulled for the wrong positions would change
the greedy output."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from render_service.gateway.conversations import (
    MAX_CONVERSATION_ID_CHARS,
    ConversationCache,
    conversation_key,
    next_turn_prefill_params,
    preferred_replica,
)
from render_service.gateway.pools import ReplicaPool
from render_service.http.errors import ApiError
from tests.engine_harness import ServerThread, engine_config
from tests.gateway_harness import QWEN3_TOKENIZER, gateway_process
from token_engine.models.random_model import write_random_model

HELD = {"do_remote_prefill": False, "do_remote_decode": False, "remote_block_ids": [3, 4], "remote_engine_id": "d",
        "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
        "remote_num_tokens": 7, "remote_lease_epoch": 1, "remote_token_hash": "ab"}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def key(name: str) -> bytes:
    return conversation_key(name, {})


# ------------------------------------------------------------------------------------------ the cache


def test_a_held_turn_is_taken_once():
    cache = ConversationCache()
    assert cache.put(key("a"), HELD, "http://d1")
    held = cache.take(key("a"))
    assert held.kv_transfer_params == HELD and held.decode_url == "http://d1"
    assert cache.take(key("a")) is None  # single use: a lease is pulled by one prefill
    assert len(cache) == 0


def test_a_held_turn_expires_after_the_ttl():
    clock = Clock()
    cache = ConversationCache(ttl_s=450, clock=clock)
    cache.put(key("a"), HELD, "http://d1")
    clock.now += 449.9
    assert cache.take(key("a")) is not None
    cache.put(key("a"), HELD, "http://d1")
    clock.now += 450
    assert cache.take(key("a")) is None


def test_expired_entries_are_dropped_when_others_are_stored():
    clock = Clock()
    cache = ConversationCache(ttl_s=10, clock=clock)
    cache.put(key("old"), HELD, "http://d1")
    clock.now += 11
    cache.put(key("new"), HELD, "http://d1")
    assert len(cache) == 1


def test_the_least_recently_stored_conversation_is_evicted_first():
    cache = ConversationCache(capacity=2)
    cache.put(key("a"), HELD, "http://d1")
    cache.put(key("b"), HELD, "http://d1")
    cache.put(key("a"), {**HELD, "remote_request_id": "a2"}, "http://d1")  # a's next turn: now the newest
    cache.put(key("c"), HELD, "http://d1")
    assert len(cache) == 2
    assert cache.take(key("b")) is None
    assert cache.take(key("a")).kv_transfer_params["remote_request_id"] == "a2"
    assert cache.take(key("c")) is not None


def test_zero_capacity_or_ttl_keeps_nothing():
    for cache in (ConversationCache(capacity=0), ConversationCache(ttl_s=0)):
        assert not cache.put(key("a"), HELD, "http://d1")
        assert cache.take(key("a")) is None
    with pytest.raises(ValueError):
        ConversationCache(capacity=-1)
    with pytest.raises(ValueError):
        ConversationCache(ttl_s=float("nan"))


@pytest.mark.parametrize("params", [None, [], "x", {}, {"remote_block_ids": []},
                                    {**HELD, "remote_block_ids": [[1, 2], "x"]},
                                    {**HELD, **{f"k{i}": i for i in range(100)}},
                                    {**HELD, "remote_host": {"nested": "object"}}])
def test_malformed_decode_params_are_not_kept(params):
    cache = ConversationCache()
    assert not cache.put(key("a"), params, "http://d1")
    assert cache.take(key("a")) is None


def test_next_turn_params_ask_prefill_to_pull_then_hold_for_decode():
    cache = ConversationCache()
    cache.put(key("a"), HELD, "http://d1")
    params = next_turn_prefill_params(cache.take(key("a")))
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert {k: v for k, v in params.items() if not k.startswith("do_")} == \
        {k: v for k, v in HELD.items() if not k.startswith("do_")}


# ------------------------------------------------------------------------------------ untrusted ids


def test_ids_are_kept_as_fixed_size_hashes_whatever_their_characters():
    odd = ["\u0000", "a" * MAX_CONVERSATION_ID_CHARS, "\ud800", "会話 🌐", " ", "../../etc/passwd"]
    keys = [conversation_key(i, {}) for i in odd]
    assert all(len(k) == 16 for k in keys)
    assert len(set(keys)) == len(odd)
    assert conversation_key("x", {}) == conversation_key("x", {})


def test_an_overlong_id_is_a_400_naming_the_field():
    with pytest.raises(ApiError) as err:
        conversation_key("a" * (MAX_CONVERSATION_ID_CHARS + 1), {})
    assert err.value.status == 400 and err.value.param == "conversation_id"


def test_the_id_comes_from_the_body_or_the_header_and_they_must_agree():
    assert conversation_key(None, {"x-conversation-id": "c1"}) == conversation_key("c1", {})
    assert conversation_key("c1", {"x-conversation-id": "c1"}) == conversation_key("c1", {})
    assert conversation_key(None, {}) is None and conversation_key("", {}) is None
    with pytest.raises(ApiError) as err:
        conversation_key("c1", {"x-conversation-id": "c2"})
    assert err.value.status == 400


def test_the_last_decode_replica_is_preferred_only_while_healthy_untried_and_not_overloaded():
    pool = ReplicaPool("decode", ["http://127.0.0.1:1", "http://127.0.0.1:2"], load_factor=1.25)
    first, second = pool.replicas
    assert preferred_replica(pool, first.url, set()) is first
    assert preferred_replica(pool, "http://127.0.0.1:9", set()) is None  # left the pool
    assert preferred_replica(pool, first.url, {first.url}) is None
    first.outstanding = 3  # cap ceil(1.25 * 4 / 2) = 3: one more would exceed it
    assert preferred_replica(pool, first.url, set()) is None
    first.outstanding = 0
    pool.mark_failed(first)
    assert preferred_replica(pool, first.url, set()) is None
    assert preferred_replica(pool, second.url, set()) is second


# ------------------------------------------------------------------------- real engines and gateway


def kv_config(engine_id: str) -> dict:
    # prefill keeps the default policy "fail": a reuse that fails must still not fail the turn (gateway fallback)
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 120}}


class ComputedTokens:
    """Counts the prompt and output tokens an engine runs through its model (a spy around the real runner)."""

    def __init__(self, llm):
        self.total = 0
        execute = llm.runner.execute

        def counting(scheduled, *args, **kwargs):
            self.total += sum(s.num_new_tokens for s in scheduled)
            return execute(scheduled, *args, **kwargs)

        llm.runner.execute = counting


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    model = write_random_model(tmp_path_factory.mktemp("conv") / "tiny", arch="qwen3", preset="tiny",
                               overrides={"tie_word_embeddings": False}, tokenizer_dir=QWEN3_TOKENIZER,
                               dtype="float32")
    sizes = dict(max_model_len=256, num_gpu_blocks_override=192)
    reference = ServerThread(engine_config(model, **sizes))  # no connector: every prompt computed in full
    prefill = ServerThread(engine_config(model, kv_transfer_config=kv_config("conv-prefill"), **sizes))
    decode = ServerThread(engine_config(model, kv_transfer_config=kv_config("conv-decode"), **sizes))
    gateway = None
    try:
        for server in (reference, prefill, decode):
            server.__enter__()
        gateway = gateway_process(model, ["--prefill", prefill.url, "--decode", decode.url])
        yield {"reference": reference, "prefill": prefill, "decode": decode, "gateway": gateway,
               "computed": ComputedTokens(prefill.llm)}
    finally:
        if gateway is not None:
            gateway.stop()
        for server in (decode, prefill, reference):
            if server.thread.is_alive():
                server.__exit__(None, None, None)
        mp.undo()
        torch.set_num_threads(threads)


GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def reference_output(pd, prompt: list[int]) -> list[int]:
    r = httpx.post(pd["reference"].url + "/inference/v1/generate", timeout=120,
                   json={"token_ids": prompt, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def complete(pd, prompt: list[int], conversation: str | None = None, stream: bool = False) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "return_token_ids": True, "stream": stream, **GREEDY}
    if conversation is not None:
        body["conversation_id"] = conversation
    url = pd["gateway"].url + "/v1/completions"
    if not stream:
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    tokens = []
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
    return tokens


def reads(server) -> int:
    return server.llm.connector.stats()["kv_transfer_reads"]


def metric_total(url: str, name: str) -> float:
    """Sum of the samples on a server's /metrics whose line starts with ``name``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_streamed_decode_ends_with_the_params_of_the_kv_it_holds(pd):
    prefill, decode = pd["prefill"], pd["decode"]
    prompt = [1000 + 37 * i for i in range(13)]
    r = httpx.post(prefill.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 1},
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    events = []
    with httpx.stream("POST", decode.url + "/inference/v1/generate", timeout=120, json={
            "token_ids": prompt, "sampling_params": GREEDY, "stream": True,
            "kv_transfer_params": r.json()["kv_transfer_params"]}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    output = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert [e for e in events[:-1] if "kv_transfer_params" in e] == []  # vLLM's bytes until the end
    held = events[-1]["kv_transfer_params"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert held["remote_num_tokens"] == len(prompt) + len(output) - 1  # the last token has no KV yet
    assert held["remote_token_hash"] and held["remote_engine_id"] == "conv-decode"
    # the next turn's prefill pulls them (which also frees decode's hold)
    before = reads(prefill)
    r = httpx.post(prefill.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": prompt + output + [5, 6, 7], "sampling_params": {"temperature": 0, "max_tokens": 1},
        "kv_transfer_params": {**held, "do_remote_decode": True, "do_remote_prefill": False}})
    assert r.status_code == 200, r.text
    assert reads(prefill) == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_the_next_turn_pulls_the_held_kv_and_prefill_computes_only_the_new_tokens(pd, stream):
    prefill, decode, computed = pd["prefill"], pd["decode"], pd["computed"]
    conversation = f"extends-{stream}"
    prompt1 = [2000 + 41 * i + stream for i in range(21)]
    out1 = complete(pd, prompt1, conversation, stream)
    assert out1 == reference_output(pd, prompt1)

    prompt2 = prompt1 + out1 + [3000 + 7 * i for i in range(9)]
    before_reads, before_computed = reads(prefill), computed.total
    decode_hits = decode.llm.scheduler.bm.prefix_hits
    out2 = complete(pd, prompt2, conversation, stream)
    assert reads(prefill) == before_reads + 1  # pulled decode's blocks for the conversation
    held = len(prompt1) + len(out1) - 1
    assert computed.total - before_computed == len(prompt2) - held  # only what decode did not hold
    assert out2 == reference_output(pd, prompt2)
    # decode (the same replica) still has the conversation's whole blocks: it pulls only the rest from prefill
    assert decode.llm.scheduler.bm.prefix_hits - decode_hits == held // 4 * 4


def test_a_next_turn_without_conversation_id_is_recomputed(pd):
    prefill, computed = pd["prefill"], pd["computed"]
    prompt1 = [4000 + 13 * i for i in range(17)]
    out1 = complete(pd, prompt1)
    prompt2 = prompt1 + out1 + [11, 12, 13, 14, 15]
    before_reads, before_computed = reads(prefill), computed.total
    assert complete(pd, prompt2) == reference_output(pd, prompt2)
    assert reads(prefill) == before_reads
    # prefill's own prefix cache has turn 1's prompt (whole blocks); the rest is computed
    assert computed.total - before_computed == len(prompt2) - len(prompt1) // 4 * 4


def test_a_turn_whose_history_differs_is_recomputed_and_correct(pd):
    prefill = pd["prefill"]
    prompt1 = [5000 + 17 * i for i in range(19)]
    out1 = complete(pd, prompt1, "rewritten")
    # as a template that drops the reasoning of earlier answers: turn 1's output is not all in the history
    prompt2 = prompt1 + out1[2:] + [21, 22, 23]
    before = reads(prefill)
    assert complete(pd, prompt2, "rewritten") == reference_output(pd, prompt2)
    assert reads(prefill) == before  # the hash guard refused the held KV


def test_a_chat_turn_whose_template_drops_the_think_block_is_recomputed_and_correct(pd):
    url = pd["gateway"].url + "/v1/chat/completions"
    first = {"role": "user", "content": "Name a colour."}
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(url, json={**body, "messages": [first], "conversation_id": "chat"}, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"] or ""
    # Qwen3's template renders earlier answers without the empty think block the turn-1 prompt ended in
    messages = [first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Another?"}]
    before = reads(pd["prefill"])
    r = httpx.post(url, json={**body, "messages": messages}, timeout=120,
                   headers={"X-Conversation-Id": "chat"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert reads(pd["prefill"]) == before
    assert choice["token_ids"] == reference_output(pd, r.json()["prompt_token_ids"])


def test_a_held_lease_gone_from_decode_falls_back_to_a_recompute(pd):
    decode = pd["decode"]
    prompt1 = [6000 + 29 * i for i in range(15)]
    held_before = set(decode.llm.scheduler.held_by_connector)
    out1 = complete(pd, prompt1, "gone")
    (seq_id,) = set(decode.llm.scheduler.held_by_connector) - held_before
    # decode drops the turn's blocks before the next one comes (as when its TTL ran out, or it restarted)
    assert decode.llm.connector.handoff.release_hold(seq_id, decode.llm.connector._lease_epochs[seq_id])
    fallbacks = metric_total(pd["gateway"].url, 'splitserve_gateway_conversation_turns_total{outcome="fallback"}')
    prompt2 = prompt1 + out1 + [31, 32, 33]
    assert complete(pd, prompt2, "gone") == reference_output(pd, prompt2)
    assert metric_total(pd["gateway"].url, 'splitserve_gateway_conversation_turns_total{outcome="fallback"}') == fallbacks + 1


def test_an_overlong_conversation_id_is_a_400_with_the_error_envelope(pd):
    r = httpx.post(pd["gateway"].url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "conversation_id": "x" * 1000})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "conversation_id"


# ------------------------------------------------ non-streaming requests: 499 only for a client that left


def _collect_case(receive, batches):
    """Runs the gateway's non-streaming fold (routes.collect) for one rendered chat request against a
    scripted ASGI receive channel and a scripted engine event sequence; returns (response or ApiError, aborts)."""
    import asyncio

    from render_service.gateway.flow import EngineCall, Gateway
    from render_service.gateway.responses import ChatResponder
    from render_service.gateway.routes import collect
    from render_service.http.server import RawRequest
    from render_service.render.render import render_chat
    from render_service.wire.protocol import ChatCompletionRequest, GenerateStreamChoice
    from tests.render_harness import qwen3_config

    config = qwen3_config()
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    gen = render_chat(req, config)
    responder = ChatResponder(gen, req, config)

    async def run():
        gateway = Gateway(engines=["http://127.0.0.1:9"])  # nothing listens: aborts fail quietly
        call = EngineCall(live={gen.request_id: "http://127.0.0.1:9"})

        async def choices():
            for batch in batches:
                await asyncio.sleep(0.01)
                if batch is asyncio.CancelledError:
                    raise asyncio.CancelledError()
                yield [(0, GenerateStreamChoice(index=0, token_ids=ids, finish_reason=fin)) for ids, fin in batch]

        async def folding():
            async for batch in choices():
                for prompt_index, choice in batch:
                    responder.accumulate(prompt_index, choice)

        try:
            result = await collect(RawRequest({"type": "http", "method": "POST", "headers": []}, receive), gateway, call,
                                    folding(), responder)
        except ApiError as exc:
            result = exc
        await asyncio.sleep(0)
        return result, gateway.stats.aborts

    return asyncio.run(run())


FINISHED = [[([9707], None)], [([11], "length")]]


async def _client_waits():
    import asyncio

    await asyncio.Event().wait()  # a client that stays: no message until the response


def test_a_client_that_stays_gets_its_answer():
    response, aborts = _collect_case(_client_waits, FINISHED)
    assert response.status_code == 200 and aborts == 0
    assert json.loads(response.body)["choices"][0]["finish_reason"] == "length"


def test_a_client_that_leaves_gets_a_499_and_the_engine_request_is_aborted():
    async def leaves():
        return {"type": "http.disconnect"}

    response, aborts = _collect_case(leaves, FINISHED * 20)
    assert response.status_code == 499 and aborts == 1


def test_messages_other_than_a_disconnect_are_not_a_disconnect():
    import asyncio

    messages = [{"type": "http.request", "body": b"", "more_body": False}] * 3

    async def chatty():
        if messages:
            return messages.pop()
        await asyncio.Event().wait()

    response, aborts = _collect_case(chatty, FINISHED)
    assert response.status_code == 200 and aborts == 0


def test_a_broken_disconnect_watcher_is_not_taken_for_a_client_that_left():
    async def broken():
        raise RuntimeError("receive channel failed")

    response, aborts = _collect_case(broken, FINISHED)
    assert response.status_code == 200 and aborts == 0


def test_engine_calls_cancelled_under_a_waiting_client_are_a_502_not_a_499():
    import asyncio

    error, _ = _collect_case(_client_waits, [FINISHED[0], asyncio.CancelledError])
    assert isinstance(error, ApiError) and error.status == 502


def test_a_non_streaming_client_that_disconnects_aborts_the_engine_requests(pd):
    import socket
    import time

    decode = pd["decode"].llm
    body = json.dumps({"model": "tiny", "prompt": [7000, 7001, 7002], "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True}).encode()
    generated = metric_total(pd["decode"].url, "vllm:generation_tokens_total")
    with socket.create_connection(("127.0.0.1", pd["gateway"].port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)
        for _ in range(400):  # bounded: until decode runs it
            if decode.requests:
                break
            time.sleep(0.025)
        assert decode.requests, "the request never reached decode"
    for _ in range(400):  # bounded: until the abort lands
        if not decode.requests:
            break
        time.sleep(0.025)
    assert not decode.requests
    assert metric_total(pd["decode"].url, "vllm:generation_tokens_total") - generated < 200  # stopped well before the end


def test_concurrent_non_streaming_requests_all_get_their_answer(pd):
    import asyncio

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i):
                r = await client.post(pd["gateway"].url + "/v1/completions", json={
                    "model": "tiny", "prompt": [8000 + i, 8001 + i, 8002 + i], "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True})
                return r.status_code

            return await asyncio.gather(*(one(i) for i in range(48)))

    assert asyncio.run(run()) == [200] * 48


# ------------------------------------- decode out of blocks: unread turn holds give way (engine side)


def test_decode_out_of_blocks_gives_up_unread_turn_holds_instead_of_queueing_behind_them(tmp_path, monkeypatch):
    from tests.engine_harness import finish_request, write_tiny_qwen3
    from token_engine.core.engine import LLMEngine
    from token_engine.core.sequence import SamplingOptions

    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    greedy, prefill_only = SamplingOptions(temperature=0.0, max_tokens=6), SamplingOptions(temperature=0.0, max_tokens=1)
    model = write_tiny_qwen3(tmp_path / "tiny")
    p = LLMEngine(engine_config(model, kv_transfer_config=kv_config("oob-prefill")))
    # 24 blocks of 4 tokens: room for four held turns of 14 + 6 tokens (5 blocks each), not for a fifth
    d = LLMEngine(engine_config(model, num_gpu_blocks_override=24, max_model_len=64,
                                kv_transfer_config=kv_config("oob-decode")))
    c = LLMEngine(engine_config(model))
    try:
        for i in range(8):  # no conversation continues: every turn's hold stays unread
            prompt = [1000 + 50 * i + j for j in range(14)]
            _, pu = finish_request(p, [d], f"oob{i}-p", prompt, prefill_only, {"do_remote_decode": True})
            out, du = finish_request(d, [p], f"oob{i}-d", prompt, greedy, pu.kv_transfer_params)
            assert du.error is None and out == c.generate([prompt], greedy)[0]
        assert 0 < len(d.scheduler.held_by_connector) < 8  # the oldest holds were given up, the newest kept
        # the newest turn is still there for its conversation's next prefill
        held = du.kv_transfer_params
        reads_before = p.connector.stats()["kv_transfer_reads"]
        _, pu = finish_request(p, [d], "oob7-next", prompt + out + [5, 6, 7], prefill_only,
                               {**held, "do_remote_decode": True, "do_remote_prefill": False})
        assert pu.error is None and p.connector.stats()["kv_transfer_reads"] == reads_before + 1
    finally:
        p.shutdown()
        d.shutdown()
        torch.set_num_threads(threads)
