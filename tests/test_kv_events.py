"""KV events for routers: a real engine on a tiny random model publishes vLLM's msgpack batches over ZMQ, and a
real subscriber on a local socket decodes them; block hashes are vLLM's for the sequence's token ids."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time

import msgspec
import pytest
import zmq

from bench import peers
from splitserve_common.block_hashes import BlockHashConfig, block_hashes, external_hash
from tests.engine_harness import engine_config, tiny_loaded_model
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions
from token_engine.kv_events.config import parse_kv_events_config
from token_engine.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch

BLOCK = 4
GREEDY = SamplingOptions(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    yield from tiny_loaded_model(tmp_path_factory)


class Subscriber:
    """A router's side: SUB on the engine's PUB socket, DEALER on its replay socket."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.raw: list[bytes] = []  # every payload received, as sent

    def recv(self, timeout_ms: int = 2000) -> tuple[int, KVEventBatch] | None:
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        self.raw.append(payload)
        return int.from_bytes(seq, "big"), decode_batch(payload)

    def drain(self, quiet_ms: int = 300) -> list[tuple[int, KVEventBatch]]:
        out = []
        while (got := self.recv(quiet_ms)) is not None:
            out.append(got)
        return out

    def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            assert topic == self.topic
            out.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        dealer.close(linger=0)
        return out

    def close(self) -> None:
        self.sub.close(linger=0)


def start(model, tmp_path, topic: str = "kv", **kw) -> tuple[LLMEngine, Subscriber]:
    model_dir, loaded = model
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/pub",
              "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": topic}
    engine = LLMEngine(engine_config(model_dir, block_size=BLOCK, **kw, kv_events_config=events), model=loaded)
    assert engine.kv_events is not None
    sub = Subscriber(engine.kv_events.publisher.endpoint, engine.kv_events.publisher.replay_endpoint, topic)
    # PUB drops what it sends before a subscription arrives: publish AllBlocksCleared until one is heard.
    deadline = time.monotonic() + 10
    while True:
        engine.reset_prefix_cache()
        if (got := sub.recv(50)) is not None:
            break
        assert time.monotonic() < deadline, "subscriber never connected"
    assert got[1].events == [AllBlocksCleared()]
    sub.drain(100)  # probes still in flight
    return engine, sub


def stored_blocks(batches) -> list[tuple[int, int | None, list[int], tuple | None]]:
    """(hash, parent, token ids, extra keys) of every stored block, in order."""
    out = []
    for _, batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK and ev.medium == "GPU" and ev.lora_id is None and ev.group_idx == 0
                assert len(ev.token_ids) == BLOCK * len(ev.block_hashes)
                assert ev.extra_keys is not None and len(ev.extra_keys) == len(ev.block_hashes)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    out.append((h, parent, ev.token_ids[i * BLOCK:(i + 1) * BLOCK], ev.extra_keys[i]))
                    parent = h
    return out


def removed(batches) -> list[int]:
    return [h for _, b in batches for ev in b.events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


def vllm_hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    return [external_hash(d) for d in block_hashes(tokens, BlockHashConfig(block_size=BLOCK), cache_salt=salt)]


def test_stored_blocks_carry_vllms_hashes_chained_from_the_prompt(model, tmp_path):
    engine, sub = start(model, tmp_path)
    try:
        prompt = list(range(100, 118))  # 4 full blocks and 2 tokens
        [out] = engine.generate([prompt], GREEDY)
        batches = sub.drain()
        seqs = [s for s, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one sequence number per batch, no gaps
        assert all(b.data_parallel_rank == 0 and b.ts > 0 for _, b in batches)
        blocks = stored_blocks(batches)
        computed = (prompt + out)[:-1]  # the last sampled token has no KV yet
        expected = vllm_hashes(computed)
        assert len(expected) == len(computed) // BLOCK == 5
        assert [h for h, *_ in blocks] == expected
        assert [p for _, p, *_ in blocks] == [None, *expected[:-1]]
        assert [t for _, _, t, _ in blocks] == [computed[i * BLOCK:(i + 1) * BLOCK] for i in range(5)]
        assert all(k is None for *_, k in blocks)
        assert removed(batches) == []

        # The same prompt again hits the cache: no new store for the prompt's blocks (vLLM's incremental mode).
        engine.generate([prompt], GREEDY)
        assert [h for h, *_ in stored_blocks(sub.drain())] == []
        assert engine.num_free_blocks() == engine.num_blocks
    finally:
        sub.close()
        engine.shutdown()


def test_salted_prompt_hashes_differ_and_carry_the_salt_as_extra_key(model, tmp_path):
    engine, sub = start(model, tmp_path)
    try:
        prompt = list(range(200, 209))
        done: list[int] = []
        engine.add_request("salted", prompt, SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True),
                           cache_salt="tenant-a", on_update=lambda u: done.extend(t for d in u.deltas
                                                                                   for t in d.token_ids))
        while engine.has_work():
            engine.step()
        blocks = stored_blocks(sub.drain())
        assert [h for h, *_ in blocks] == vllm_hashes(prompt, salt="tenant-a") != vllm_hashes(prompt)
        assert [k for *_, k in blocks] == [("tenant-a",), None]
    finally:
        sub.close()
        engine.shutdown()


def test_cbor_hash_algo_is_used_when_configured(model, tmp_path):
    engine, sub = start(model, tmp_path, prefix_caching_hash_algo="sha256_cbor")
    try:
        prompt = list(range(700, 709))
        engine.generate([prompt], SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True))
        cbor = BlockHashConfig(block_size=BLOCK, hash_algo="sha256_cbor")
        assert [h for h, *_ in stored_blocks(sub.drain())] == [external_hash(d) for d in block_hashes(prompt, cbor)]
        assert [external_hash(d) for d in block_hashes(prompt, cbor)] != vllm_hashes(prompt)
    finally:
        sub.close()
        engine.shutdown()


def test_eviction_sends_removed_for_each_stored_hash_and_reset_sends_cleared(model, tmp_path):
    # 12 blocks of 4: a second 47-token prompt needs all of them, so the first prompt's cached blocks are evicted
    engine, sub = start(model, tmp_path, num_gpu_blocks_override=12, max_model_len=48)
    try:
        short = SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True)
        first = list(range(300, 316))
        engine.generate([first], short)
        stored_first = [h for h, *_ in stored_blocks(sub.drain())]
        assert stored_first == vllm_hashes(first)
        engine.generate([list(range(500, 547))], short)
        batches = sub.drain()
        assert sorted(removed(batches)) == sorted(stored_first)
        assert all(ev.medium == "GPU" for _, b in batches for ev in b.events if isinstance(ev, BlockRemoved))
        assert [h for h, *_ in stored_blocks(batches)] == vllm_hashes(list(range(500, 547)))

        assert engine.reset_prefix_cache() == 11
        [(seq, batch)] = sub.drain()
        assert batch.events == [AllBlocksCleared()]
        # the same prompt after a reset is stored again: the router relearns it
        engine.generate([first], short)
        assert [h for h, *_ in stored_blocks(sub.drain())] == stored_first

        # Replay: a router that missed batches asks from a sequence number and gets them in order, then the end mark.
        replayed = sub.replay(seq)
        assert replayed[0] == (seq, batch)
        assert [s for s, _ in replayed] == list(range(seq, seq + len(replayed)))
    finally:
        sub.close()
        engine.shutdown()


def test_after_new_weights_blocks_are_published_under_renders_hashes_again(model, tmp_path):
    """A weight update salts the engine's own prefix index with the new epoch, but routers hash render's ids: the
    blocks computed under the new weights carry the same hashes as before, and blocks a sequence begun under the
    old weights writes after the update are never offered."""
    engine, sub = start(model, tmp_path)
    try:
        short = SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True)
        prompt = list(range(600, 612))
        engine.generate([prompt], short)
        before = [h for h, *_ in stored_blocks(sub.drain())]
        assert before == vllm_hashes(prompt)

        old: list[int] = []
        engine.add_request("old-weights", list(range(700, 705)),
                           SamplingOptions(temperature=0.0, max_tokens=12, ignore_eos=True),
                           on_update=lambda u: old.extend(t for d in u.deltas for t in d.token_ids))
        engine.step()
        engine.step()
        sub.drain()  # (its prompt block, stored under the old weights)
        engine.new_weight_epoch()
        while engine.has_work():  # its later blocks are hashed after the update
            engine.step()
        batches = sub.drain()
        assert [ev for _, b in batches for ev in b.events] == [AllBlocksCleared()] and len(old) == 12

        engine.generate([prompt], short)
        assert [h for h, *_ in stored_blocks(sub.drain())] == before
    finally:
        sub.close()
        engine.shutdown()


def test_the_wire_bytes_are_vllms_layout():
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
                    medium="GPU", lora_name=None, extra_keys=[None], group_idx=0),
        BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0), AllBlocksCleared()], data_parallel_rank=0)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    # a batch is an array [ts, events, dp_rank]; an event is a map tagged by its class name, defaults omitted
    assert raw == [1.5, [
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None],
         "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"}], 0]


@pytest.mark.parametrize("raw, error", [
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
    ({"enable_kv_cache_events": True, "endpoint": "localhost:5557"}, "endpoint"),
    ({"enable_kv_cache_events": True, "hwm": 0}, "hwm"),
    ({"enable_kv_cache_events": True, "bogus": 1}, "bogus"),
])
def test_bad_config_is_a_named_error(raw, error):
    with pytest.raises(ValueError, match=error):
        parse_kv_events_config(raw)


def test_events_off_unless_enabled_with_a_zmq_publisher():
    assert parse_kv_events_config(None) is None
    assert parse_kv_events_config({"endpoint": "tcp://*:5557"}) is None
    assert parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}) is None
    assert parse_kv_events_config({"enable_kv_cache_events": True}) is not None


# vLLM's own event classes and block hasher, in the vLLM 0.33 peer's venv: decodes our payloads and hashes the
# token ids of every stored block's sequence the way vLLM's engine does.
VLLM_DECODER = r"""
import base64, json, sys
import msgspec
from vllm import SamplingParams
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.request import Request
case = json.loads(sys.stdin.read())
decoder = msgspec.msgpack.Decoder(KVEventBatch)
batches = [decoder.decode(base64.b64decode(p)) for p in case["payloads"]]
fn = get_hash_fn_by_name("sha256")
ku.init_none_hash(fn)
hashes = {}
for name, (ids, salt) in case["prompts"].items():
    req = Request(request_id=name, prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None, cache_salt=salt, block_hasher=ku.get_request_block_hasher(case["block_size"], fn))
    hashes[name] = [ku.maybe_convert_block_hash(h) for h in req.block_hashes]
out = {"batches": [[b.ts, b.data_parallel_rank, [[type(e).__name__, msgspec.to_builtins(e)] for e in b.events]]
                   for b in batches], "hashes": hashes}
print(json.dumps(out))
"""


def test_vllms_own_classes_decode_our_events_and_agree_on_the_hashes(model, tmp_path):
    venv = peers.vllm033_venv()
    if venv is None or not peers.vllm_present(venv):
        pytest.skip("no vLLM 0.33 peer venv (set $SPLITSERVE_VLLM033)")
    engine, sub = start(model, tmp_path, num_gpu_blocks_override=12, max_model_len=48)
    prompts = {"plain": (list(range(100, 113)), None), "salted": (list(range(100, 113)), "tenant-a"),
               "big": (list(range(500, 547)), None)}
    one = SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:
        for name, (ids, salt) in prompts.items():  # the big prompt evicts the first two
            engine.add_request(name, ids, one, cache_salt=salt)
            while engine.has_work():
                engine.step()
        engine.reset_prefix_cache()
        ours = sub.drain()
    finally:
        sub.close()
        engine.shutdown()
    case = {"payloads": [base64.b64encode(p).decode() for p in sub.raw[-len(ours):]], "block_size": BLOCK,
            "prompts": prompts}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "VLLM_TARGET_DEVICE": "cpu"}
    run = subprocess.run([str(venv / "bin/python"), "-c", VLLM_DECODER], input=json.dumps(case), env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = json.loads(run.stdout.splitlines()[-1])
    # vLLM's decode of every batch equals ours, field by field
    mine = [[b.ts, b.data_parallel_rank, [[type(e).__name__, msgspec.to_builtins(e)] for e in b.events]]
            for _, b in ours]
    assert json.loads(json.dumps(mine)) == theirs["batches"]
    vllm = theirs["hashes"]
    assert [h for h, *_ in stored_blocks(ours)] == vllm["plain"] + vllm["salted"] + vllm["big"]
    assert sorted(removed(ours)) == sorted(vllm["plain"] + vllm["salted"])
    assert theirs["batches"][-1][2] == [["AllBlocksCleared", {"type": "AllBlocksCleared"}]]


def test_tier_moves_are_events_and_a_router_view_matches_both_tiers(model, tmp_path):
    from token_engine.core.model_runner import kv_block_bytes

    tier_bytes = 6 * kv_block_bytes(model[1].arch, BLOCK)
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": tier_bytes}}
    engine, sub = start(model, tmp_path, num_gpu_blocks_override=12, max_model_len=48, kv_transfer_config=offload)
    one = SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = list(range(10, 34))
    view: dict[str, set[int]] = {"GPU": set(), "CPU": set()}  # what a router believes each tier holds
    seen: list[tuple[str, str, list[int]]] = []
    try:
        for ids in [prompt, list(range(600, 644)), prompt, list(range(900, 944)), prompt]:
            engine.generate([ids], one)
            for _, batch in sub.drain():
                for ev in batch.events:
                    assert isinstance(ev, BlockStored | BlockRemoved)
                    assert ev.medium is not None
                    seen.append((type(ev).__name__, ev.medium, list(ev.block_hashes)))
                    if isinstance(ev, BlockStored):
                        assert not view[ev.medium] & set(ev.block_hashes)  # never announced twice
                        view[ev.medium] |= set(ev.block_hashes)
                        if ev.medium == "CPU":  # vLLM's placeholder store: the hash alone
                            assert (ev.token_ids, ev.block_size, ev.parent_block_hash) == ([], 0, None)
                    else:
                        assert set(ev.block_hashes) <= view[ev.medium]
                        view[ev.medium] -= set(ev.block_hashes)
            tier = engine.host_tier
            assert tier is not None
            assert view["CPU"] == tier.event_hashes() and len(view["CPU"]) == tier.num_blocks
            assert engine.kv_events is not None
            recorder = engine.kv_events.recorder
            assert view["GPU"] == {external_hash(recorder.digest[b]) for b in engine.block_manager.cached.values()}
    finally:
        sub.close()
        engine.shutdown()
    prompt_hashes = set(vllm_hashes(prompt))
    # the prompt went GPU -> CPU (evicted, offloaded), back to GPU (reloaded), and the tier later dropped it
    assert any(kind == "BlockStored" and medium == "CPU" and set(h) <= prompt_hashes for kind, medium, h in seen)
    assert any(kind == "BlockRemoved" and medium == "CPU" and set(h) & prompt_hashes for kind, medium, h in seen)
    assert tier.loaded_blocks > 0
