"""Push-mode KV transfer (NixlPushConnector) through the engine's connector seam: two LLMEngines in this
process (two NIXL agents, real UCX WRITEs over loopback), stepped by one loop. Decode reserves and registers
its blocks, prefill WRITEs each finished chunk and notifies; the trust checks (token hash, producer identity)
and the failure paths must leave both engines' blocks idle. Process-level runs: test_pd_modes.py."""

import threading
import time

import pytest
import torch

from tests.engine_harness import EngineProcess, engine_config, finish_request, step_until, write_tiny_qwen3
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions
from token_engine.kv_connector.handoff_consumer import LoadPhase
from token_engine.kv_connector.leases import format_notification
from token_engine.kv_connector.nixl_transport import NixlTransport
from token_engine.kv_connector.side_channel import validate_publication

GREEDY = SamplingOptions(temperature=0.0, max_tokens=6)
PREFILL_ONLY = SamplingOptions(temperature=0.0, max_tokens=1)
PROMPT = [1500 + 37 * i for i in range(61)]


def push_config(engine_id: str, policy: str = "fail") -> dict:
    return {"kv_connector": "NixlPushConnector", "engine_id": engine_id, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"kv_lease_duration": 5, "kv_load_timeout": 5}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("push") / "tiny")


@pytest.fixture(scope="module")
def engines(model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    # 16-token chunks: a 61-token prompt prefills in 4 steps, each finished chunk is pushed as it completes
    p = LLMEngine(engine_config(model, kv_transfer_config=push_config("push-prefill"), max_num_batched_tokens=16,
                                max_num_seqs=4))
    d = LLMEngine(engine_config(model, kv_transfer_config=push_config("push-decode")))
    r = LLMEngine(engine_config(model, kv_transfer_config=push_config("push-decode-re", "recompute")))
    c = LLMEngine(engine_config(model))
    yield p, d, r, c
    for e in (p, d, r):
        e.shutdown()
    mp.undo()
    torch.set_num_threads(threads)


def push_params(p: LLMEngine, prefill_rid: str) -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": "push-prefill", "remote_host": "127.0.0.1",
            "remote_port": p.connector.handoff.side_channel.port, "remote_request_id": prefill_rid}


def start(engine, rid, prompt, options, params, out):
    def on_update(u):
        out.setdefault("tokens", []).extend(t for delta in u.deltas for t in delta.token_ids)
        if u.finished:
            out["done"] = u
    engine.add_request(rid, prompt, options, kv_transfer_params=params, on_update=on_update)


def idle(*engines) -> None:
    step_until(engines, lambda: all(e.num_free_blocks() == e.num_blocks and not e.requests
                                    and not e.scheduler.held_by_connector for e in engines))


def test_push_per_chunk_equals_collocated_and_both_sides_go_idle(engines):
    p, d, _, c = engines
    expected, _ = finish_request(c, [], "c-1", PROMPT, GREEDY, None)
    writes = p.connector.handoff.stats.totals.get("push_writes_prefill", 0)
    dec, pre = {}, {}
    start(d, "d-1", PROMPT, GREEDY, push_params(p, "p-1"), dec)  # decode first: both legs at once
    # the reservation reaches prefill before its first chunk (else the chunks done by then go in one WRITE)
    step_until([d, p], lambda: "p-1" in p.connector.handoff.producer.push._targets)
    start(p, "p-1", PROMPT, PREFILL_ONLY, {"do_remote_decode": True}, pre)
    step_until([p, d], lambda: "done" in dec)
    assert dec["done"].error is None, dec["done"].error
    assert dec["tokens"] == expected
    # the first chunk is written while the next ones compute, the rest with the notification at the latest:
    # chunks that finish while a WRITE is in flight go together in the next (4 on an idle machine, 2 under load)
    assert p.connector.handoff.stats.totals["push_writes_prefill"] - writes >= 2
    assert d.connector.handoff.stats.totals["pushes_decode"] >= 1
    idle(p, d)


def test_decode_registering_after_prefill_finished_is_still_pushed(engines):
    p, d, _, c = engines
    expected, _ = finish_request(c, [], "c-2", PROMPT[:23], GREEDY, None)
    _, pu = finish_request(p, [], "p-2", PROMPT[:23], PREFILL_ONLY, {"do_remote_decode": True})
    assert pu.error is None and len(p.scheduler.held_by_connector) == 1  # held under a lease for the push
    tokens, du = finish_request(d, [p], "d-2", PROMPT[:23], GREEDY, push_params(p, "p-2"))
    assert du.error is None and tokens == expected
    idle(p, d)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_reservation_for_other_tokens_is_never_written(engines, policy):
    """Decode's prompt differs from what prefill computed: prefill refuses to WRITE (token hash), tells decode,
    and decode fails or recomputes by its policy."""
    p, d, r, c = engines
    decode = d if policy == "fail" else r
    other = PROMPT[:30] + [7] + PROMPT[31:40]
    writes = p.connector.handoff.stats.totals.get("push_writes_prefill", 0)
    dec, pre = {}, {}
    start(decode, f"d-x-{policy}", other, GREEDY, push_params(p, f"p-x-{policy}"), dec)
    start(p, f"p-x-{policy}", PROMPT[:40], PREFILL_ONLY, {"do_remote_decode": True}, pre)
    step_until([p, decode], lambda: "done" in dec)
    assert p.connector.handoff.stats.totals.get("push_writes_prefill", 0) == writes  # nothing written
    if policy == "fail":
        assert dec["done"].error.startswith("KV handoff failed: push_failed"), dec["done"].error
    else:
        expected, _ = finish_request(c, [], "c-x", other, GREEDY, None)
        assert dec["done"].error is None and dec["tokens"] == expected
    idle(p, decode)


def test_completion_from_another_agent_is_ignored(engines):
    """Only the producer the reservation was registered with can complete it: a third NIXL agent that knows
    decode's metadata and the reservation's epoch sends `pushed` and decode keeps waiting."""
    p, d, _, c = engines
    expected, _ = finish_request(c, [], "c-3", PROMPT[:33], GREEDY, None)
    dec, pre = {}, {}
    start(d, "d-3", PROMPT[:33], GREEDY, push_params(p, "p-3"), dec)
    step_until([d], lambda: bool(d.connector.handoff.consumer._push_loads)
               and next(iter(d.connector.handoff.consumer._push_loads.values())).state == LoadPhase.READING)
    (rid, epoch), = d.connector.handoff.consumer._push_loads
    pool = torch.zeros(4, *d.runner.kv_pool.shape[1:], dtype=d.runner.kv_pool.dtype)
    rogue = NixlTransport("rogue-agent", pool)
    try:
        pub = d.connector.handoff.consumer._publication
        rogue.add_peer(pub, validate_publication(pub))
        rogue.send_notif(pub.agent_name, format_notification("pushed", rid, epoch))
        for _ in range(200):
            rogue.poll()
            d.step()
        assert "done" not in dec and d.scheduler.waiting_for_remote  # still waiting for the real producer
    finally:
        rogue.close()
    start(p, "p-3", PROMPT[:33], PREFILL_ONLY, {"do_remote_decode": True}, pre)
    step_until([p, d], lambda: "done" in dec)
    assert dec["done"].error is None and dec["tokens"] == expected
    idle(p, d)


def test_decode_aborted_while_waiting_withdraws_its_reservation(engines):
    p, d, _, _ = engines
    dec = {}
    start(d, "d-4", PROMPT[:40], GREEDY, push_params(p, "p-4"), dec)
    step_until([d, p], lambda: len(p.connector.handoff.producer.push._targets) == 1)
    d.abort_request("d-4")
    idle(d)  # the producer answered "gone": the reserved blocks are free at once, not at the load deadline
    assert not p.connector.handoff.producer.push._targets
    # a prefill for that id now computes and holds its lease as usual (nothing to push); aborting it frees it
    _, pu = finish_request(p, [], "p-4", PROMPT[:40], PREFILL_ONLY, {"do_remote_decode": True})
    p.abort_request("p-4")
    idle(p)


def test_prefill_aborted_mid_push_fails_the_decode_load(engines):
    p, d, _, _ = engines
    prompt = [900 + 11 * i for i in range(61)]  # not in prefill's prefix cache: four chunks to compute
    dec, pre = {}, {}
    start(d, "d-5", prompt, GREEDY, push_params(p, "p-5"), dec)
    start(p, "p-5", prompt, PREFILL_ONLY, {"do_remote_decode": True}, pre)
    targets = p.connector.handoff.producer.push._targets
    step_until([d, p], lambda: any(t.writes for t in list(targets.values())) and "p-5" in p.requests)  # mid-prefill
    p.abort_request("p-5")
    step_until([p, d], lambda: "done" in dec)
    assert dec["done"].error.startswith("KV handoff failed: push_failed"), dec["done"].error
    idle(p, d)


def test_decode_process_killed_after_registering_leaves_prefill_idle(engines, model):
    """A decode engine process registers its reservation and dies: prefill's WRITE fails (or the window
    passes), and the blocks it held for the push return."""
    p = engines[0]
    decode = EngineProcess(model, push_config("push-decode-proc"))
    params = {**push_params(p, "p-6"), "remote_host": "127.0.0.1"}
    body = {"token_ids": PROMPT[:37], "sampling_params": {"temperature": 0.0, "max_tokens": 4},
            "kv_transfer_params": params}
    caller = threading.Thread(target=lambda: _post_quietly(decode, body), daemon=True)
    caller.start()
    targets = p.connector.handoff.producer.push._targets
    step_until([p], lambda: "p-6" in targets)
    decode.kill()
    _, pu = finish_request(p, [], "p-6", PROMPT[:37], PREFILL_ONLY, {"do_remote_decode": True})
    assert pu.error is None
    deadline = time.monotonic() + 20
    while (p.scheduler.held_by_connector or p.num_free_blocks() != p.num_blocks) and time.monotonic() < deadline:
        p.step()
        time.sleep(0.005)
    assert not p.scheduler.held_by_connector and p.num_free_blocks() == p.num_blocks and not targets
    caller.join(10)


def _post_quietly(engine: EngineProcess, body: dict) -> None:
    try:
        engine.client.post("/inference/v1/generate", json=body)
    except Exception:  # noqa: BLE001 - the engine is killed under this call
        pass
