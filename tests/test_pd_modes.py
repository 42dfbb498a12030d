"""P/D modes through the gateway's dispatch, with real engine processes and real NIXL between them: pull
(prefill, then decode READs), push (NixlPushConnector: both legs at once, prefill WRITEs into the blocks decode
reserved) and conditional disaggregation (decode alone when little of the prompt is uncached there). Greedy
output must equal collocated, single- and multi-turn (with bidirectional reuse); a decode outage releases
prefill's lease at once and the error names decode; a prefill killed mid-push leaves decode idle.

The gateway runs in this process (render_service.gateway.flow.Gateway over its real HTTP engine client); the
two engines are `token-engine serve` processes."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client import REGISTRY

from render_service.gateway.flow import EngineCall, Gateway, GatewaySettings, NoReplica
from render_service.wire.protocol import GenerateRequest, SamplingParams
from tests.engine_harness import EngineProcess, free_port, write_tiny_qwen3

MAX_TOKENS = 6
PROMPT = [1500 + 37 * i for i in range(29)]


def push_config(engine_id: str) -> dict:
    return {"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 5,
                                          "kv_load_timeout": 5}}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = write_tiny_qwen3(tmp_path_factory.mktemp("modes") / "tiny")
    side_port = free_port()
    prefill = EngineProcess(model, push_config("modes-prefill"), side_port, blocks=96)
    decode = EngineProcess(model, push_config("modes-decode"), blocks=96)
    state = {"model": model, "prefill": prefill, "decode": decode, "side_port": side_port}
    yield state
    for e in (state["prefill"], state["decode"]):
        e.kill()


def url(engine: EngineProcess) -> str:
    return f"http://127.0.0.1:{engine.port}"


def collocated(engine: EngineProcess, prompt: list[int]) -> list[int]:
    r = engine.client.post("/inference/v1/generate", json={
        "token_ids": prompt, "sampling_params": {"temperature": 0.0, "max_tokens": MAX_TOKENS}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def gen_request(prompt: list[int], rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, token_ids=prompt,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


async def run(gw: Gateway, prompt: list[int], rid: str, conversation: bytes | None = None) -> list[int]:
    """One request through the gateway's P/D flow; the output token ids."""
    call = EngineCall(conversation=conversation)
    live = await gw.open(gen_request(prompt, rid), call)
    tokens: list[int] = []
    done = asyncio.get_running_loop().create_future()

    def on_batch(batch):
        for chunk in batch:
            for choice in chunk.choices:
                tokens.extend(choice.token_ids or [])

    on_batch(live.first)
    live.push(on_batch, lambda error: done.set_result(error))
    assert await asyncio.wait_for(done, 60) is None
    return tokens


def decisions(path: str) -> float:
    return REGISTRY.get_sample_value("splitserve:gateway_pd_decisions_total", {"path": path}) or 0.0


def state(engine: EngineProcess) -> dict:
    return engine.client.get("/debug/kv_cache").json()


def wait_idle(engine: EngineProcess, limit_s: float = 20) -> dict:
    deadline = time.monotonic() + limit_s
    while True:
        s = state(engine)
        if (s["num_free_blocks"] == s["num_blocks"] and s["num_held_by_connector"] == 0
                and s["num_running"] == 0 and s["num_waiting"] == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def gateway(engines, mode: str, min_uncached: int = 0, decode_url: str | None = None) -> Gateway:
    return Gateway(prefill=[url(engines["prefill"])], decode=[decode_url or url(engines["decode"])],
                   settings=GatewaySettings(block_size=4, pd_transfer_mode=mode, pd_min_uncached_tokens=min_uncached,
                                            retries=0))


async def _single_turn(engines, mode: str, min_uncached: int = 0) -> dict:
    gw = gateway(engines, mode, min_uncached)
    out = {}
    for n in (29, 13, 64):
        out[n] = await run(gw, PROMPT[:n] if n <= 29 else [900 + 11 * i for i in range(n)], f"{mode}-{n}-{min_uncached}")
    await gw.client.aclose()
    return out


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_single_turn_greedy_equals_collocated(engines, mode):
    before = {p: decisions(p) for p in ("pull", "push", "decode_only")}
    got = asyncio.run(_single_turn(engines, mode))
    for n, tokens in got.items():
        prompt = PROMPT[:n] if n <= 29 else [900 + 11 * i for i in range(n)]
        assert tokens == collocated(engines["decode"], prompt), n
    if mode == "push":  # the first request learns prefill's side channel (pull), the others push
        assert decisions("push") - before["push"] == 2 and decisions("pull") - before["pull"] == 1
    else:
        assert decisions("pull") - before["pull"] == 3 and decisions("push") == before["push"]
    for e in (engines["prefill"], engines["decode"]):
        s = wait_idle(e)  # decode's held turns (bidirectional) end after decoder_kv_blocks_ttl
        assert s["num_free_blocks"] == s["num_blocks"] and s["num_held_by_connector"] == 0, s


def test_push_reports_mode_bytes_and_time_in_metrics(engines):
    asyncio.run(_single_turn(engines, "push"))
    prefill = engines["prefill"].client.get("/metrics").text
    decode = engines["decode"].client.get("/metrics").text
    assert 'splitserve:kv_handoffs_total{mode="push",side="prefill"}' in prefill
    assert 'splitserve:kv_handoff_bytes_total{mode="push",side="decode"}' in decode
    pushed = [line for line in decode.splitlines()
              if line.startswith('splitserve:kv_handoff_bytes_total{mode="push",side="decode"}')]
    assert float(pushed[0].split()[-1]) > 0


async def _multi_turn(engines, mode: str, min_uncached: int) -> list[tuple[list[int], list[int]]]:
    gw = gateway(engines, mode, min_uncached)
    prompt = [700 + 13 * i for i in range(21)]
    turns = []
    for t in range(3):
        tokens = await run(gw, prompt, f"mt-{mode}-{min_uncached}-{t}", conversation=b"conversation-1")
        turns.append((list(prompt), tokens))
        prompt = prompt + tokens + [3000 + 17 * t + i for i in range(7)]
    await gw.client.aclose()
    return turns


@pytest.mark.parametrize("mode,min_uncached", [("pull", 0), ("push", 0), ("push", 16)])
def test_multi_turn_with_reuse_equals_collocated(engines, mode, min_uncached):
    """Bidirectional: each next turn's prefill pulls decode's held turn; with a threshold above the new
    tokens of a turn (6 + 7, plus the partial block before them), later turns go to decode alone, which holds the conversation's prefix."""
    before = decisions("decode_only")
    for prompt, tokens in asyncio.run(_multi_turn(engines, mode, min_uncached)):
        assert tokens == collocated(engines["decode"], prompt)
    taken = decisions("decode_only") - before
    assert taken == (0 if min_uncached == 0 else 2)
    for e in (engines["prefill"], engines["decode"]):
        wait_idle(e, limit_s=2)  # held turns stay (decoder_kv_blocks_ttl); only no running work is checked
        assert state(e)["num_running"] == 0


def test_decode_outage_releases_prefill_lease_and_the_error_names_decode(engines):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: decode fails before its first event

    async def attempt(mode):
        gw = gateway(engines, mode, decode_url=dead)
        if mode == "push":  # the side channel is known, as after a first request: both legs at once
            gw.kv_identities[url(engines["prefill"])] = ("modes-prefill", "127.0.0.1", engines["side_port"])
        with pytest.raises(NoReplica) as info:
            await gw.open(gen_request(PROMPT, f"outage-{mode}"), EngineCall())
        for _ in range(100):  # the aborts to prefill are fire-and-forget: let them go out
            await asyncio.sleep(0.05)
            if not gw._background:
                break
        await gw.client.aclose()
        return str(info.value)

    for mode in ("pull", "push"):
        message = asyncio.run(attempt(mode))
        assert "decode" in message and "prefill engine" not in message, message
        s = wait_idle(engines["prefill"], limit_s=5)  # far below the 30 s lease
        assert s["num_held_by_connector"] == 0 and s["num_free_blocks"] == s["num_blocks"], s


def test_prefill_killed_mid_push_leaves_decode_idle(engines):
    """Decode reserved blocks and waits for the push; the prefill process dies: decode fails the load
    (policy fail) within its load timeout and every block returns."""
    prefill = engines["prefill"]
    prefill.kill()
    params = {"do_remote_prefill": True, "remote_engine_id": "modes-prefill", "remote_host": "127.0.0.1",
              "remote_port": engines["side_port"], "remote_request_id": "generate-tokens-never"}
    try:
        with httpx.Client(base_url=url(engines["decode"]), timeout=30) as c:
            r = c.post("/inference/v1/generate", json={
                "token_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_tokens": 4},
                "kv_transfer_params": params})
    finally:  # the module's other tests (in any order) find a prefill engine again
        engines["prefill"] = EngineProcess(engines["model"], push_config("modes-prefill"), engines["side_port"],
                                           blocks=96)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"].startswith("KV handoff failed")
    s = wait_idle(engines["decode"], limit_s=5)
    assert s["num_running"] == 0 and s["num_waiting"] == 0
