"""Prefill/decode disaggregation through the engine's connector seam: two LLMEngines with NixlConnectors in
this process (two NIXL agents, real UCX transfers over loopback), stepped by one loop so the tests stay fast.
Process-level failures (a killed or restarted prefill engine) are in test_pd_processes.py."""

import random

import pytest
import torch

from tests.engine_harness import engine_config, finish_request, step_until, write_tiny_qwen3
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions
from token_engine.models.random_model import write_random_model

GREEDY = SamplingOptions(temperature=0.0, max_tokens=8)
PREFILL_ONLY = SamplingOptions(temperature=0.0, max_tokens=1)


def kv_config(engine_id: str, **extra):
    policy = extra.pop("policy", "fail")
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}


@pytest.fixture(scope="module", autouse=True)
def _ephemeral_side_channel_ports_and_one_torch_thread():
    # Two engines, UCX and pytest share 2 CI cores: torch's default thread pool oversubscribes them (4-5x
    # slower steps measured on this box), so one intra-op thread for this module.
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("pd") / "tiny")


@pytest.fixture(scope="module")
def engines(model_dir):
    p = LLMEngine(engine_config(model_dir, kv_transfer_config=kv_config("prefill-a", kv_lease_duration=30)))
    d = LLMEngine(engine_config(model_dir, kv_transfer_config=kv_config("decode-a")))
    r = LLMEngine(engine_config(model_dir, kv_transfer_config=kv_config("decode-r", policy="recompute")))
    c = LLMEngine(engine_config(model_dir))
    yield p, d, r, c
    for e in (p, d, r):
        e.shutdown()


@pytest.fixture(scope="module")
def short_lease_prefill(model_dir):
    """For refused loads: nobody reads these leases, so they end by expiry."""
    p = LLMEngine(engine_config(model_dir, kv_transfer_config=kv_config("prefill-short", kv_lease_duration=0.5)))
    yield p
    p.shutdown()


def prefill(p: LLMEngine, rid: str, prompt: list[int], params=None):
    done = {}
    p.add_request(rid, prompt, PREFILL_ONLY, kv_transfer_params=params or {"do_remote_decode": True},
                  on_update=lambda u: done.__setitem__("u", u) if u.finished else None)
    step_until([p], until=lambda: "u" in done)
    return done["u"]


def decode(d: LLMEngine, others, rid: str, prompt: list[int], params, options=GREEDY):
    return finish_request(d, others, rid, prompt, options, params)


def idle(*es):
    return all(e.num_free_blocks() == e.num_blocks and not e.requests and not e.scheduler.held_by_connector
               for e in es)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 150000) for _ in range(n)]


@pytest.mark.parametrize("length", [1, 4, 37, 64])
def test_pd_greedy_output_equals_collocated(engines, length):
    p, d, _, c = engines
    prompt = prompt_of(length, length)
    expected = c.generate([prompt], GREEDY)[0]
    pu = prefill(p, f"p-{length}", prompt)
    params = pu.kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == length
    assert len(params["remote_block_ids"]) == -(-length // 4)
    assert {"remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"} <= params.keys()
    tokens, du = decode(d, [p], f"d-{length}", prompt, params)
    assert du.error is None
    assert tokens == expected
    assert du.num_cached_tokens == length  # the whole prompt came from the peer
    assert du.kv_transfer_params is None  # consumed params are not echoed back
    step_until([p, d], until=lambda: idle(p, d))


def test_decode_really_uses_the_pulled_kv(model_dir, engines):
    """Prefill's held blocks overwritten before decode reads them: decode's output must change with them."""
    _, d, _, c = engines
    p2 = LLMEngine(engine_config(model_dir, kv_transfer_config=kv_config("prefill-scribbled")))
    try:
        prompt = prompt_of(30, 99)
        params = prefill(p2, "x", prompt).kv_transfer_params
        p2.runner.kv_pool[params["remote_block_ids"]] = 3.0  # not the KV of this prompt any more
        tokens, du = decode(d, [p2], "x", prompt, params)
        assert du.error is None and tokens != c.generate([prompt], GREEDY)[0]
    finally:
        p2.shutdown()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_kv_from_an_engine_with_other_weights_is_refused(tmp_path, engines, policy):
    """Same geometry, other weights: the fingerprints differ, so the load fails and the policy applies."""
    _, d, r, c = engines
    other = write_random_model(tmp_path / "other", arch="qwen3", preset="tiny",
                               overrides={"tie_word_embeddings": False}, dtype="float32", seed=7)
    p2 = LLMEngine(engine_config(other, kv_transfer_config=kv_config("prefill-other")))
    try:
        prompt = prompt_of(30, 98)
        params = prefill(p2, "x", prompt).kv_transfer_params
        tokens, du = decode(d if policy == "fail" else r, [p2], f"other-{policy}", prompt, params)
        if policy == "fail":
            assert du.error and du.error.startswith("KV handoff failed: model_mismatch") and tokens == []
        else:
            assert du.error is None and tokens == c.generate([prompt], GREEDY)[0]
    finally:
        p2.shutdown()


def test_same_weights_give_the_same_fingerprint_and_other_weights_another(model_dir, tmp_path):
    from token_engine.kv_connector.fingerprint import model_fingerprint

    other = write_random_model(tmp_path / "other", arch="qwen3", preset="tiny",
                               overrides={"tie_word_embeddings": False}, dtype="float32", seed=7)
    base = model_fingerprint(model_dir, "float32", 4)
    assert base == model_fingerprint(model_dir, "float32", 4)
    assert base != model_fingerprint(other, "float32", 4)
    assert base != model_fingerprint(model_dir, "bfloat16", 4)
    assert base != model_fingerprint(model_dir, "float32", 16)


def test_prompt_token_ids_in_params_must_match_the_prompt(engines):
    p, d, _, c = engines  # the long lease: the good load must not depend on how fast this machine is
    prompt = prompt_of(20, 3)
    params = dict(prefill(p, "tok", prompt).kv_transfer_params, prompt_token_ids=prompt)
    tokens, du = decode(d, [p], "tok-ok", prompt, params)
    assert du.error is None and tokens == c.generate([prompt], GREEDY)[0]
    params = dict(prefill(p, "tok2", prompt).kv_transfer_params, prompt_token_ids=prompt[:-1] + [5])
    _, du = decode(d, [p], "tok-bad", prompt, params)
    assert du.error  # policy fail: the caller hears about it
    # the refused lease is not read and does not expire during the test: the caller aborts it
    assert "tok2" in p.scheduler.held_by_connector
    p.abort_request("tok2")
    step_until([p, d], until=lambda: idle(p, d))


@pytest.mark.parametrize("mutate", [
    lambda q: q.update(remote_lease_epoch=q["remote_lease_epoch"] + 1),   # forged epoch: blocks unproven
    lambda q: q.update(remote_block_ids=q["remote_block_ids"][:-1]),      # block count does not fit the tokens
    lambda q: q.update(remote_block_ids=[10 ** 9] * len(q["remote_block_ids"])),  # outside the peer's pool
    lambda q: q.update(remote_port="80"),                                 # wrong type
    lambda q: q.pop("remote_lease_epoch"),                                # missing
    lambda q: q.update(remote_num_tokens=10 ** 6),                        # longer than the prompt
], ids=["forged-epoch", "short-blocks", "foreign-blocks", "port-type", "no-epoch", "too-many-tokens"])
def test_bad_transfer_params_fail_clearly_or_recompute_exactly(engines, short_lease_prefill, mutate):
    _, d, r, c = engines
    p = short_lease_prefill
    prompt = prompt_of(22, 5)
    expected = c.generate([prompt], GREEDY)[0]
    rid = f"bad-{random.getrandbits(40):x}"
    params = dict(prefill(p, rid + "-f", prompt).kv_transfer_params)
    mutate(params)
    tokens, du = decode(d, [p], rid + "-f", prompt, params)
    assert du.error and "KV" in du.error and tokens == []
    params = dict(prefill(p, rid + "-r", prompt).kv_transfer_params)
    mutate(params)
    tokens, du = decode(r, [p], rid + "-r", prompt, params)
    assert du.error is None and tokens == expected
    # the prefill leases of refused loads are not read: they end by expiry (not waited for here) or abort
    for e in (d, r):
        step_until([e, p], until=lambda e=e: e.num_free_blocks() == e.num_blocks and not e.requests)


def test_same_request_id_is_not_held_twice(engines):
    p, _, _, _ = engines
    first = prefill(p, "dup", prompt_of(9, 1)).kv_transfer_params
    second = prefill(p, "dup", prompt_of(9, 2)).kv_transfer_params
    assert first["do_remote_prefill"] and not (second or {}).get("do_remote_prefill")
    assert [lease.block_ids for lease in p.connector.handoff.leases.find("dup")] == [first["remote_block_ids"]]
    p.abort_request("dup")  # its caller gives it up: the lease ends and the module's engines are idle again
    step_until([p], until=lambda: idle(p))


def test_lease_expiry_frees_prefill_blocks(short_lease_prefill):
    p = short_lease_prefill
    prefill(p, "never-read", prompt_of(17, 1))
    assert p.num_free_blocks() < p.num_blocks and "never-read" in p.scheduler.held_by_connector
    step_until([p], until=lambda: idle(p))
    assert p.connector.stats()["kv_leases"] == 0


def test_200_requests_with_random_aborts_leak_no_blocks(model_dir):
    """Bounded soak: 200 requests, prefill and decode in waves of 8; some aborted on the prefill side, a
    random third aborted at a random moment on the decode side (queued, loading or decoding). Afterwards
    both engines are back to every block free and no lease is held (none left to expire)."""
    p = LLMEngine(engine_config(model_dir, num_gpu_blocks_override=128,
                                kv_transfer_config=kv_config("prefill-soak")))
    d = LLMEngine(engine_config(model_dir, num_gpu_blocks_override=128, kv_transfer_config=kv_config("decode-soak")))
    try:
        _soak(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def _soak(p, d):
    rng = random.Random(11)
    for wave in range(25):
        prompts = {f"s{wave}-{i}": prompt_of(rng.randint(1, 24), wave * 100 + i) for i in range(8)}
        params = {}
        for rid, prompt in prompts.items():
            p.add_request(rid, prompt, PREFILL_ONLY, kv_transfer_params={"do_remote_decode": True},
                          on_update=lambda u, rid=rid, params=params: params.__setitem__(rid, u) if u.finished else None)
            if rng.random() < 0.1:
                p.abort_request(rid)
        step_until([p], until=lambda params=params, prompts=prompts: len(params) == len(prompts))
        finished = set()
        for rid, u in params.items():
            if u.kv_transfer_params is None or not u.kv_transfer_params.get("do_remote_prefill"):
                continue  # aborted on the prefill side
            d.add_request(rid, prompts[rid], SamplingOptions(temperature=0.0, max_tokens=rng.randint(1, 4)),
                          kv_transfer_params=u.kv_transfer_params,
                          on_update=lambda u, rid=rid, finished=finished: finished.add(rid) if u.finished else None)
        for _ in range(rng.randint(0, 3)):
            p.step()
            d.step()
        for rid in list(d.requests):
            if rng.random() < 0.3:
                d.abort_request(rid)
        step_until([p, d], until=lambda: not d.requests)
    step_until([p, d], until=lambda: idle(p, d) and p.connector.stats()["kv_leases"] == 0)


def test_decode_queued_for_blocks_heartbeats_the_lease_and_still_loads_remote_kv(model_dir, engines):
    """Decode has no free blocks at first (they are held for a peer): the request waits longer than prefill's
    lease. Heartbeats keep the lease alive, and when blocks free up the scheduler asks the connector again
    (it once remembered the first, failed admission and computed the prompt locally, bypassing policy fail)."""
    _, _, _, c = engines
    p = LLMEngine(engine_config(model_dir, kv_transfer_config=kv_config("prefill-hb", kv_lease_duration=1.5)))
    d = LLMEngine(engine_config(model_dir, num_gpu_blocks_override=12, max_model_len=48,
                                kv_transfer_config=kv_config("decode-hb", kv_lease_duration=2.4)))
    try:
        prefill(d, "blocker", prompt_of(36, 5))  # d now holds ~10 of its 12 blocks for 2.4 s (no reader)
        assert d.num_free_blocks() < 6
        prompt = prompt_of(20, 6)
        params = prefill(p, "queued", prompt).kv_transfer_params
        tokens, du = decode(d, [p], "queued", prompt, params)
        assert du.error is None, du.error
        assert du.num_cached_tokens == len(prompt)  # loaded from the peer, not recomputed
        assert tokens == c.generate([prompt], GREEDY)[0]
        assert d.connector.heartbeats_sent >= 1
        step_until([p, d], until=lambda: idle(p, d))
    finally:
        p.shutdown()
        d.shutdown()


def test_multiconnector_decode_loads_from_its_host_tier_and_pulls_only_the_rest(model_dir, engines):
    """vLLM's MultiConnector (NIXL + OffloadingConnector) on decode: a prompt whose blocks decode evicted to its
    host tier loads them back and pulls only the blocks after them from prefill."""
    from token_engine.core.model_runner import kv_block_bytes

    p, _, _, c = engines
    probe = LLMEngine(engine_config(model_dir))
    tier_bytes = 64 * kv_block_bytes(probe.arch, 4)
    probe.shutdown()
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "engine_id": "decode-multi",
             "kv_connector_extra_config": {"connectors": [
                 {"kv_connector": "NixlConnector", "kv_load_failure_policy": "fail"},
                 {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": tier_bytes}},
             ]}}
    d = LLMEngine(engine_config(model_dir, num_gpu_blocks_override=16, max_model_len=64, kv_transfer_config=multi))
    try:
        assert d.host_tier is not None and type(d.connector).__name__ == "NixlConnector"
        prompt = prompt_of(37, 7)  # 9 full blocks and 1 token
        expected = c.generate([prompt], GREEDY)[0]
        first, du = decode(d, [p], "m1", prompt, prefill(p, "m1", prompt).kv_transfer_params)
        assert first == expected and du.num_cached_tokens == 37  # all from the peer
        d.generate([prompt_of(60, 8)], PREFILL_ONLY)  # evicts most of the prompt's blocks into the host tier
        assert d.host_tier.num_blocks >= 8
        before = dict(d.block_manager.cached_by_source)
        again, du = decode(d, [p], "m2", prompt, prefill(p, "m2", prompt).kv_transfer_params)
        assert again == expected and du.num_cached_tokens == 37
        got = {k: v - before.get(k, 0) for k, v in d.block_manager.cached_by_source.items()}
        # device hits, then host blocks, then the peer for the rest (the partial last block at least)
        assert got.get("host", 0) >= 32 and 1 <= got["p2p"] <= 5
        assert got.get("device", 0) + got["host"] + got["p2p"] == 37
        # (p may still hold other tests' leases until they expire: only this test's are waited for)
        step_until([p, d], until=lambda: idle(d) and not {"m1", "m2"} & set(p.scheduler.held_by_connector))
    finally:
        d.shutdown()


def test_multiconnector_decode_runs_only_once_its_host_load_and_its_pull_both_finished(model_dir, engines):
    """The host tier's load and the NIXL pull of the rest run side by side; the sequence waits for both (here the
    pull lands first and the host load is held back)."""
    from tests.engine_harness import HeldLoads
    from token_engine.core.model_runner import kv_block_bytes
    from token_engine.core.sequence import SequenceStatus

    p, _, _, c = engines
    probe = LLMEngine(engine_config(model_dir))
    tier = HeldLoads(64 * kv_block_bytes(probe.arch, 4))
    probe.shutdown()
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "engine_id": "decode-held",
             "kv_connector_extra_config": {"connectors": [
                 {"kv_connector": "NixlConnector", "kv_load_failure_policy": "fail"},
                 {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}},
             ]}}
    d = LLMEngine(engine_config(model_dir, num_gpu_blocks_override=16, max_model_len=64, kv_transfer_config=multi),
                  host_tier=tier)
    try:
        prompt = prompt_of(37, 17)
        expected = c.generate([prompt], GREEDY)[0]
        decode(d, [p], "h1", prompt, prefill(p, "h1", prompt).kv_transfer_params)
        d.generate([prompt_of(60, 18)], PREFILL_ONLY)  # evicts most of the prompt's blocks into the host tier
        tier.held = True
        params = prefill(p, "h2", prompt).kv_transfer_params
        tokens: list[int] = []
        done = {}

        def on_update(u):
            tokens.extend(t for delta in u.deltas for t in delta.token_ids)
            if u.finished:
                done["u"] = u

        d.add_request("h2", prompt, GREEDY, kv_transfer_params=params, on_update=on_update)
        seq = d.requests["h2"].seqs[0]

        def pulled() -> bool:
            load = d.scheduler.loading.get("h2")
            return bool(seq.block_table) and (load is None or not load.remote)

        step_until([p, d], until=pulled)
        for _ in range(3):  # the pull has landed; the host load has not: still no step for it
            d.step()
            assert seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS and not tokens
            assert d.scheduler.loading["h2"].host is not None and tier.loads_in_flight == 1
        tier.held = False
        step_until([p, d], until=lambda: "u" in done)
        assert tokens == expected and done["u"].num_cached_tokens == 37
        assert d.block_manager.cached_by_source.get("host", 0) >= 32
        step_until([p, d], until=lambda: idle(d) and not {"h1", "h2"} & set(p.scheduler.held_by_connector))
        assert tier.busy_slots == 0 and tier.loads_in_flight == 0
    finally:
        d.shutdown()
