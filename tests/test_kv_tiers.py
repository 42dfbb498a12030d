"""KV cache tiers on a tiny random model: per-tier prefix-cache metrics, and the host-memory offload tier."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.engine_harness import HeldLoads, engine_config, make_engine, tiny_loaded_model, write_tiny_qwen3
from token_engine.core.engine import LLMEngine
from token_engine.core.model_runner import kv_block_bytes
from token_engine.core.sequence import SamplingOptions, Sequence, SequenceStatus
from token_engine.kv_offload.host_tier import HostKVTier

GREEDY = SamplingOptions(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    yield from tiny_loaded_model(tmp_path_factory)



def metric(engine: LLMEngine, name: str, **labels) -> float:
    engine._update_gauges()
    text = engine.metrics.render().decode()
    want = {"model_name": engine.metrics.model_name, **labels}
    total = 0.0
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == want:
            total += float(m.group(2))
    return total


def test_device_hits_are_counted_by_source(model):
    engine = make_engine(model)
    prompt = list(range(10, 41))  # 31 tokens: 7 full blocks of 4
    engine.generate([prompt], GREEDY)
    assert metric(engine, "vllm:prompt_tokens_cached_total") == 0
    engine.generate([prompt], GREEDY)
    assert engine.block_manager.cached_by_source == {"device": 28}
    assert metric(engine, "vllm:prompt_tokens_cached_by_source_total", source="device") == 28
    assert metric(engine, "vllm:prompt_tokens_cached_total") == 28
    assert metric(engine, "vllm:prefix_cache_hits_total") == 28
    # no tier past the device one: nothing looked up there
    assert metric(engine, "vllm:external_prefix_cache_queries_total") == 0


def block_bytes(engine: LLMEngine) -> int:
    return kv_block_bytes(engine.arch, engine.config.block_size)


def offload_config(num_blocks: int, model) -> dict:
    """OffloadingConnector as vLLM configures it, sized to hold num_blocks blocks of the tiny model."""
    size = num_blocks * kv_block_bytes(model[1].arch, 4)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": size, "block_size": 4}}


def run_one(engine: LLMEngine, rid: str, prompt: list[int], options=GREEDY) -> tuple[list[int], int]:
    """Greedy tokens and the request's cached_tokens (what usage reports)."""
    tokens: list[int] = []
    cached: list[int] = []

    def on_update(u):
        tokens.extend(t for d in u.deltas for t in d.token_ids)
        cached.append(u.num_cached_tokens)

    engine.add_request(rid, prompt, options, on_update=on_update)
    while engine.has_work():
        engine.step()
    return tokens, cached[-1]


# 12 device blocks of 4 tokens: the 44-token prompt takes 11, evicting everything the first prompt left cached.
SMALL_POOL = dict(num_gpu_blocks_override=12, max_model_len=48)
PROMPT = list(range(10, 34))  # 24 tokens: 5 blocks can hit (the last token is always computed)
EVICTOR = list(range(600, 644))


def test_evicted_blocks_reload_from_host_and_give_the_recomputed_tokens(model):
    plain = make_engine(model, **SMALL_POOL)
    recomputed = [run_one(plain, "a", PROMPT)[0], run_one(plain, "b", EVICTOR)[0]]
    again, cached = run_one(plain, "c", PROMPT)
    assert again == recomputed[0] and cached == 0  # evicted, no tier: recomputed from scratch

    engine = make_engine(model, **SMALL_POOL, kv_transfer_config=offload_config(32, model))
    tier = engine.host_tier
    assert tier is not None and engine.block_manager.host is tier and tier.capacity_blocks == 32
    assert run_one(engine, "a", PROMPT)[0] == recomputed[0]
    assert tier.num_blocks == 0  # nothing evicted yet
    assert run_one(engine, "b", EVICTOR)[0] == recomputed[1]
    assert tier.num_blocks >= 5 and tier.stored_blocks == tier.num_blocks
    tokens, cached = run_one(engine, "c", PROMPT)
    assert tokens == recomputed[0]
    assert cached == 20 and tier.loaded_blocks == 5
    assert engine.block_manager.cached_by_source == {"host": 20}
    assert metric(engine, "vllm:prompt_tokens_cached_by_source_total", source="host") == 20
    assert metric(engine, "vllm:external_prefix_cache_hits_total") == 20
    assert metric(engine, "vllm:kv_offload_load_bytes_total") == 5 * block_bytes(engine)
    # Block and byte accounting is back to idle: the device pool is all free, the tier holds whole blocks only.
    assert engine.num_free_blocks() == engine.num_blocks
    assert tier.used_bytes == tier.num_blocks * block_bytes(engine) <= tier.capacity_bytes
    assert 0 < metric(engine, "vllm:kv_offload_cpu_cache_usage_perc") <= 1


def test_the_tier_is_bounded_and_evicts_least_recently_used(model):
    engine = make_engine(model, **SMALL_POOL, kv_transfer_config=offload_config(6, model))
    tier = engine.host_tier
    assert tier is not None
    run_one(engine, "a", PROMPT)
    run_one(engine, "b", EVICTOR)
    run_one(engine, "c", list(range(900, 944)))  # evicts the evictor's blocks: the tier drops the oldest
    assert tier.num_blocks == 6 and tier.dropped_blocks > 0
    assert tier.used_bytes == 6 * block_bytes(engine)
    _, cached = run_one(engine, "d", PROMPT)
    assert cached == 0  # PROMPT's blocks were the least recently used: gone
    assert engine.num_free_blocks() == engine.num_blocks


def test_a_tier_survives_an_engine_restart_but_not_a_weight_or_layout_change(model, tmp_path):
    config = offload_config(32, model)
    first = make_engine(model, **SMALL_POOL, kv_transfer_config=config)
    tier = first.host_tier
    assert tier is not None
    expected = run_one(first, "a", PROMPT)[0]
    run_one(first, "b", EVICTOR)
    held = tier.num_blocks
    first.shutdown()

    same = LLMEngine(engine_config(model[0], **SMALL_POOL, kv_transfer_config=config), model=model[1], host_tier=tier)
    assert tier.num_blocks == held and tier.invalidations == 0
    tokens, cached = run_one(same, "a", PROMPT)  # a fresh device pool: the prefix comes from the host tier
    assert tokens == expected and cached == 20
    same.shutdown()

    other_dir = write_tiny_qwen3(tmp_path / "other", vocab_size=2048)  # other weights
    LLMEngine(engine_config(other_dir, **SMALL_POOL, kv_transfer_config=config), host_tier=tier).shutdown()
    assert tier.num_blocks == 0 and tier.invalidations == 1

    back = LLMEngine(engine_config(model[0], **SMALL_POOL, kv_transfer_config=config), model=model[1], host_tier=tier)
    run_one(back, "a", PROMPT)
    run_one(back, "b", EVICTOR)
    assert tier.num_blocks >= 5 and tier.invalidations == 2  # bound back to the first weights: a change again
    back.shutdown()
    LLMEngine(engine_config(model[0], **SMALL_POOL, block_size=8, kv_offloading_size=0.01), model=model[1],
              host_tier=tier).shutdown()  # the same weights, another block layout
    assert tier.num_blocks == 0 and tier.invalidations == 3


@pytest.mark.parametrize("kw, error", [
    ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, "native"),
    ({"kv_offloading_size": -1.0}, "positive"),
    ({"kv_offloading_size": 1e-12}, "no block"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}}},
     "cpu_bytes_to_use"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, "block_size": 64}}},
     "block_size 64"),
    ({"kv_offloading_size": 1.0, "kv_transfer_config": {
        "kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}}, "once"),
])
def test_bad_offload_settings_are_named_errors(model, kw, error):
    with pytest.raises(ValueError, match=error):
        make_engine(model, **kw)


def test_vllms_size_flag_sizes_the_tier(model):
    engine = make_engine(model, kv_offloading_size=0.5, kv_offloading_backend="native")
    assert engine.host_tier is not None and engine.host_tier.capacity_bytes == 1 << 29
    assert engine.host_tier.capacity_blocks == (1 << 29) // block_bytes(engine)


def test_vllms_flags_reach_the_engine_config_and_bad_ones_fail_early():
    from token_engine.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "/m", "--kv-offloading-size", "2", "--kv-offloading-backend", "native",
                                      "--kv-events-config", '{"enable_kv_cache_events": true}',
                                      "--prefix-caching-hash-algo", "sha256_cbor"])
    cfg = engine_config_from_args(args)
    assert (cfg.kv_offloading_size, cfg.kv_offloading_backend, cfg.prefix_caching_hash_algo) == \
        (2.0, "native", "sha256_cbor")
    assert cfg.kv_events_config == {"enable_kv_cache_events": True}
    for bad in (["--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"],
                ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}']):
        with pytest.raises(ValueError):
            engine_config_from_args(build_parser().parse_args(["serve", "/m", *bad]))


def test_a_load_that_fills_a_full_tier_keeps_its_own_blocks_intact(model):
    # 5 slots, all holding the prompt's blocks: the device blocks allocated for the load evict other cached blocks,
    # whose offload must not take the slots being loaded from.
    expected = run_one(make_engine(model, **SMALL_POOL), "ref", PROMPT)[0]
    engine = make_engine(model, **SMALL_POOL, kv_transfer_config=offload_config(5, model))
    tier = engine.host_tier
    assert tier is not None
    run_one(engine, "a", PROMPT)
    run_one(engine, "b", EVICTOR)
    tokens, cached = run_one(engine, "c", PROMPT)
    assert cached == 20 and tokens == expected
    assert tier.num_blocks == 5 and engine.num_free_blocks() == engine.num_blocks


def test_the_api_reports_host_tier_tokens_as_cached_and_metrics_show_the_tier(model, tmp_path):
    from tests.engine_harness import ServerThread, wait_for_idle_blocks

    config = engine_config(model[0], **SMALL_POOL, kv_transfer_config=offload_config(32, model))
    with ServerThread(config, enable_prompt_tokens_details=True) as srv, srv.client() as c:
        def generate(ids):
            body = {"token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}}
            r = c.post("/inference/v1/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        first = generate(PROMPT)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        generate(EVICTOR)  # evicts PROMPT's blocks from the device pool into the host tier
        again = generate(PROMPT)
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        text = c.get("/metrics").text
        assert re.search(r'vllm:prompt_tokens_cached_by_source_total\{[^}]*source="host"[^}]*\} 20\.0', text)
        assert re.search(r"vllm:kv_offload_load_bytes_total\{[^}]*\} [1-9]", text)
        assert wait_for_idle_blocks(srv.llm) == srv.llm.num_blocks


def test_multiconnector_splits_into_the_pd_connector_and_the_host_tier():
    from token_engine.cli import build_parser, engine_config_from_args
    from token_engine.kv_offload.config import split_connectors

    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "engine_id": "e1",
             "kv_connector_extra_config": {"connectors": [
                 {"kv_connector": "NixlConnector"},
                 {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}]}}
    args = build_parser().parse_args(["serve", "/m", "--kv-transfer-config", json.dumps(multi),
                                      "--kv-side-channel-secret", "a-secret-of-24-characters"])
    cfg = engine_config_from_args(args)
    pd, offload = split_connectors(cfg.kv_transfer_config)
    assert pd is not None and offload is not None
    assert (pd["kv_connector"], pd["kv_role"], pd["engine_id"]) == ("NixlConnector", "kv_both", "e1")
    assert pd["kv_connector_extra_config"]["kv_side_channel_secret"] == "a-secret-of-24-characters"  # the flag reaches the sub-config
    assert offload["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1 << 30}
    for bad in ({**multi, "kv_connector_extra_config": {}},
                {**multi, "kv_connector_extra_config": {"connectors": [{"kv_connector": "OffloadingConnector"}] * 2}}):
        with pytest.raises(ValueError, match="MultiConnector"):
            split_connectors(bad)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=gpu)])
def device_model(request, model) -> tuple:
    """(the tiny model on the device, the device): on CUDA loads run on the tier's load stream, timed by events."""
    if request.param == "cpu":
        return model, "cpu"
    from token_engine.models import load_model

    return (model[0], load_model(model[0], dtype="float32", device="cuda")), "cuda"


def held_tier_engine(model, device: str = "cpu", num_blocks: int = 32) -> tuple[LLMEngine, HeldLoads]:
    """An engine over a HeldLoads tier, with PROMPT's 5 full blocks evicted into it."""
    tier = HeldLoads(num_blocks * kv_block_bytes(model[1].arch, 4))
    engine = LLMEngine(engine_config(model[0], **SMALL_POOL, device=device,
                                     kv_transfer_config=offload_config(num_blocks, model)),
                       model=model[1], host_tier=tier)
    assert engine.host_tier is tier
    run_one(engine, "a", PROMPT)
    run_one(engine, "b", EVICTOR)
    assert len(engine.block_manager.find_offloaded_prefix(Sequence("probe", "probe", 0, PROMPT, GREEDY), 0)) == 5
    return engine, tier


def collect(engine: LLMEngine, rid: str, prompt: list[int], options=GREEDY, **kw) -> dict:
    """Output tokens ("tokens"; per choice index: "by_index") and updates of a request, as they come."""
    got: dict = {"tokens": [], "by_index": {}, "updates": []}

    def on_update(u):
        for d in u.deltas:
            got["tokens"].extend(d.token_ids)
            got["by_index"].setdefault(d.index, []).extend(d.token_ids)
        got["updates"].append(u)

    engine.add_request(rid, prompt, options, on_update=on_update, **kw)
    return got


DECODER = list(range(300, 304))  # one block; 12 tokens more fit next to PROMPT's 6 blocks in the 12-block pool
LONG = SamplingOptions(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_a_sequence_loading_from_the_host_tier_is_not_scheduled_while_others_decode(device_model):
    model, device = device_model
    plain = make_engine(model, **SMALL_POOL, device=device)
    expected, decoder_expected = run_one(plain, "c", PROMPT)[0], run_one(plain, "d", DECODER, LONG)[0]
    engine, tier = held_tier_engine(model, device)
    d = collect(engine, "d", DECODER, LONG)
    engine.step()  # d's prompt
    tier.held = True
    c = collect(engine, "c", PROMPT)
    seq = engine.requests["c"].seqs[0]
    for _ in range(4):
        before = len(d["tokens"])
        engine.step()
        assert len(d["tokens"]) == before + 1  # d decodes every step...
        # ... while c waits for its copies: in no step, nothing counted computed, nothing published
        assert seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
        assert engine.scheduler.running == engine.requests["d"].seqs
        assert seq.num_computed_tokens == 0 and len(seq.block_table) == 5 and not c["tokens"]
        assert all(engine.block_manager.block_hash[b] is None for b in seq.block_table)
        assert tier.loads_in_flight == 1 and tier.busy_slots == 5
    if device == "cuda":
        torch.cuda.synchronize()  # the copy is done on the GPU: only its report was held back
    tier.held = False
    engine.step()  # the load reports finished: c computes its last 4 tokens in this very step
    assert len(c["tokens"]) == 1 and seq.num_computed_tokens == len(PROMPT)
    while engine.has_work():
        engine.step()
    assert c["tokens"] == expected and d["tokens"] == decoder_expected
    assert c["updates"][-1].num_cached_tokens == 20 and tier.loaded_blocks == 5
    assert tier.load_copies == 1  # the 5 slots, filled in one eviction run, went to 5 adjacent blocks: one copy
    assert tier.load_time > 0  # CUDA: the copy's GPU time, from its events
    assert engine.num_free_blocks() == engine.num_blocks
    assert tier.busy_slots == 0 and tier.loads_in_flight == 0


def test_abort_during_a_host_load_frees_blocks_and_slots_once_the_copies_finished(device_model):
    model, device = device_model
    engine, tier = held_tier_engine(model, device)
    tier.held = True
    c = collect(engine, "c", PROMPT)
    engine.step()
    assert tier.loads_in_flight == 1
    engine.abort_request("c")
    assert c["updates"][-1].finished and c["updates"][-1].deltas[0].finish_reason == "abort"
    engine.step()
    # the copies may still write these blocks and read these slots: nothing is reused yet
    assert engine.num_free_blocks() == engine.num_blocks - 5 and tier.busy_slots == 5 and engine.has_work()
    if device == "cuda":
        torch.cuda.synchronize()  # the copy is done on the GPU: only its report was held back
    tier.held = False
    engine.step()
    assert engine.num_free_blocks() == engine.num_blocks and not engine.has_work()
    assert tier.busy_slots == 0 and tier.loads_in_flight == 0
    assert tier.num_blocks + tier.num_free_slots == tier.capacity_blocks
    assert not engine.block_manager.find_cached_prefix(Sequence("p", "p", 0, PROMPT, GREEDY))  # never published
    # the tier still holds the prompt: the next request loads it
    tokens, cached = run_one(engine, "again", PROMPT)
    assert cached == 20 and tokens == run_one(make_engine(model, **SMALL_POOL, device=device), "ref", PROMPT)[0]


def test_an_id_whose_aborted_load_is_still_under_way_is_refused_until_the_load_finished(model):
    """A second request under the id of an aborted one still loading would take its sequence's place in the
    scheduler, and the first one's blocks and slots would never be freed."""
    engine, tier = held_tier_engine(model)
    tier.held = True
    collect(engine, "c", PROMPT)
    engine.step()
    engine.abort_request("c")
    engine.step()
    with pytest.raises(ValueError, match="still finishing"):
        collect(engine, "c", PROMPT)
    collect(engine, "c-other", DECODER, LONG)  # only that id (and its n > 1 children's) is held back
    tier.held = False
    while engine.has_work():
        engine.step()
    tokens, cached = run_one(engine, "c", PROMPT)  # the load reported: the id is free again, the tier still serves
    assert cached == 20 and tokens
    assert engine.num_free_blocks() == engine.num_blocks
    assert tier.busy_slots == 0 and tier.loads_in_flight == 0


def test_a_tier_cleared_during_a_load_frees_the_slots_it_reads_only_after_the_load(model):
    engine, tier = held_tier_engine(model)
    tier.held = True
    c = collect(engine, "c", PROMPT)
    engine.step()
    engine.reset_prefix_cache()
    assert tier.num_blocks == 0 and tier.num_free_slots == tier.capacity_blocks - 5  # the read slots stay taken
    tier.held = False
    while engine.has_work():
        engine.step()
    assert c["tokens"] == run_one(make_engine(model, **SMALL_POOL), "ref", PROMPT)[0]
    assert tier.num_free_slots == tier.capacity_blocks and tier.busy_slots == 0


def test_siblings_share_one_host_load(model):
    engine, tier = held_tier_engine(model)
    tier.held = True  # a load that takes a few steps, as a long one on a GPU
    got = collect(engine, "n2", PROMPT, n=2)
    for _ in range(3):
        engine.step()
    assert tier.loads_in_flight == 1
    tier.held = False
    while engine.has_work():
        engine.step()
    expected = run_one(make_engine(model, **SMALL_POOL), "ref", PROMPT)[0]
    assert got["by_index"] == {0: expected, 1: expected}
    assert tier.loaded_blocks == 5  # the second child waited for the first's load and hit the device blocks
    assert engine.block_manager.cached_by_source == {"host": 20, "device": 20}
    assert engine.num_free_blocks() == engine.num_blocks


@gpu
def test_a_cuda_load_waits_for_the_evictions_it_depends_on_and_lands_the_bytes():
    """Blocks 0-3 are offloaded (copy stream) and at once overwritten by a load of other entries (load stream):
    the load must follow the eviction copies that read those blocks, and land in one copy."""
    pool = torch.randn(16, 2, 2, 4, 2, 8, device="cuda")
    tier = HostKVTier(8 * pool[0].numel() * pool.element_size())
    tier.bind(pool, "print")
    assert tier.staged_evictions  # the staged path proved itself on this pool
    for i in range(4):  # entries A: the content of blocks 4-7
        tier.offload(b"A%d" % i, 4 + i, None)
    tier.fence(host=True)
    a, b = pool[4:8].clone(), pool[0:4].clone()
    for i in range(4):  # entries B: blocks 0-3, copies still in flight
        tier.offload(b"B%d" % i, i, None)
    load = tier.load("s", tier.take([b"A%d" % i for i in range(4)]), [0, 1, 2, 3])
    assert load.num_copies == 1 and tier.busy_slots == 4
    assert load.end is not None
    load.end.synchronize()
    assert [x.owner for x in tier.finished_loads()] == ["s"]
    torch.testing.assert_close(pool[0:4], a)
    # B's slots hold blocks 0-3 as they were before the load
    back = tier.load("t", tier.take([b"B%d" % i for i in range(4)]), [8, 9, 10, 11])
    assert back.end is not None
    back.end.synchronize()
    tier.finished_loads()
    torch.testing.assert_close(pool[8:12], b)
    assert tier.loads_in_flight == 0 and tier.busy_slots == 0 and tier.load_time > 0 and tier.loaded_blocks == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_block_evicted_and_loaded_back_in_the_same_step_arrives_whole():
    """A step may evict a block and, scheduling another request, load it back from the slot it was just given. The
    eviction's copy to the host is left for after the forward is queued (``drain``); the load must still read the
    block's bytes, not what the slot held before."""
    pool = torch.randn((16, 2, 16, 2, 8), device="cuda")
    tier = HostKVTier(32 * pool[0].numel() * pool.element_size())
    tier.bind(pool, "print")
    assert tier.staged_evictions
    for scattered in (False, True):  # a run of blocks (plain copies) and scattered blocks (the indexed gather)
        blocks = [1, 3, 5, 7, 9, 11] if scattered else [2, 3, 4]
        expected = pool[blocks].clone()
        keys = [f"{scattered}-{b}".encode() for b in blocks]
        for key, block in zip(keys, blocks):
            tier.offload(key, block, None)
        targets = [12, 13, 14] if not scattered else [12, 13, 14, 15, 0, 10]
        load = tier.load("again", tier.take(keys), targets)  # before the step's drain
        pool[blocks] = 0  # the step's forward overwrites the evicted blocks (after the tier's fence)
        tier.drain()
        torch.cuda.synchronize()
        assert torch.equal(pool[targets], expected)
        assert load in tier.finished_loads()
