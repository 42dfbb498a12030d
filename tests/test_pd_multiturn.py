"""Bidirectional multi-turn P/D: decode holds a finished turn's KV, the next turn's prefill pulls it and
computes only the new tokens, but only when the new prompt extends the held tokens exactly."""

import random

import pytest
import torch

from tests.engine_harness import engine_config, finish_request, step_until, write_tiny_qwen3
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions

GREEDY = SamplingOptions(temperature=0.0, max_tokens=6)
PREFILL_ONLY = SamplingOptions(temperature=0.0, max_tokens=1)


def kv_config(engine_id: str, policy: str) -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 60}}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    model = write_tiny_qwen3(tmp_path_factory.mktemp("mt") / "tiny")
    # bidirectional prefill recomputes when the pull from decode fails: reuse is an optimisation only
    p = LLMEngine(engine_config(model, kv_transfer_config=kv_config("mt-prefill", "recompute")))
    d = LLMEngine(engine_config(model, kv_transfer_config=kv_config("mt-decode", "fail")))
    c = LLMEngine(engine_config(model))
    yield p, d, c
    p.shutdown()
    d.shutdown()
    mp.undo()
    torch.set_num_threads(threads)


def hop(engine, others, rid, prompt, options, params):
    tokens, update = finish_request(engine, others, rid, prompt, options, params)
    assert update.error is None, update.error
    return tokens, update


def turn(p, d, rid, prompt, params_for_prefill):
    """One P/D turn; returns decode's output tokens, decode's end-of-turn params and prefill's update."""
    _, pu = hop(p, [d], f"{rid}-p", prompt, PREFILL_ONLY, params_for_prefill)
    tokens, du = hop(d, [p], f"{rid}-d", prompt, GREEDY, pu.kv_transfer_params)
    return tokens, du.kv_transfer_params, pu


def next_turn_params(decode_params: dict) -> dict:
    # what vLLM's multi-turn proxy does with decode's cached params
    return {**decode_params, "do_remote_decode": True, "do_remote_prefill": False}


def test_next_turn_pulls_decode_kv_when_the_prompt_extends_it(engines):
    p, d, c = engines
    rng = random.Random(1)
    prompt1 = [rng.randrange(1000, 150000) for _ in range(18)]
    out1, d_params, _ = turn(p, d, "conv-a1", prompt1, {"do_remote_decode": True})
    assert out1 == c.generate([prompt1], GREEDY)[0]
    assert d_params["remote_num_tokens"] == len(prompt1) + len(out1) - 1  # the last token has no KV yet
    assert "conv-a1-d" in d.scheduler.held_by_connector  # decode holds the turn for the conversation

    prompt2 = prompt1 + out1 + [rng.randrange(1000, 150000) for _ in range(7)]
    reads = p.connector.stats()["kv_transfer_reads"]
    out2, _, pu = turn(p, d, "conv-a2", prompt2, next_turn_params(d_params))
    assert p.connector.stats()["kv_transfer_reads"] == reads + 1  # prefill pulled decode's blocks
    assert pu.num_cached_tokens == d_params["remote_num_tokens"]  # local prefix cache + pulled KV
    assert out2 == c.generate([prompt2], GREEDY)[0]
    step_until([p, d], lambda: "conv-a1-d" not in d.scheduler.held_by_connector)  # freed once prefill read it


def test_next_turn_that_rewrites_history_is_recomputed_not_reused(engines):
    p, d, c = engines
    rng = random.Random(2)
    prompt1 = [rng.randrange(1000, 150000) for _ in range(21)]
    out1, d_params, _ = turn(p, d, "conv-b1", prompt1, {"do_remote_decode": True})
    # a template that drops part of the previous answer from the history (e.g. reasoning) gives a prompt
    # that does not extend what decode holds; reusing it would decode from KV of other tokens
    prompt2 = prompt1 + out1[2:] + [rng.randrange(1000, 150000) for _ in range(5)]
    reads = p.connector.stats()["kv_transfer_reads"]
    out2, _, _ = turn(p, d, "conv-b2", prompt2, next_turn_params(d_params))
    assert p.connector.stats()["kv_transfer_reads"] == reads  # refused the reuse
    assert out2 == c.generate([prompt2], GREEDY)[0]
    # decode's held turn is not read: it ends by its TTL; release it here so the engines end idle
    lease = d.connector.handoff.release_hold("conv-b1-d", d_params["remote_lease_epoch"])
    assert lease is not None


def test_without_the_hash_there_is_no_reuse(engines):
    p, d, c = engines
    prompt1 = list(range(2000, 2015))
    out1, d_params, _ = turn(p, d, "conv-c1", prompt1, {"do_remote_decode": True})
    prompt2 = prompt1 + out1 + [7, 8, 9]
    params = next_turn_params(d_params)
    params.pop("remote_token_hash")  # e.g. params written by a vLLM decode engine
    reads = p.connector.stats()["kv_transfer_reads"]
    out2, _, _ = turn(p, d, "conv-c2", prompt2, params)
    assert p.connector.stats()["kv_transfer_reads"] == reads
    assert out2 == c.generate([prompt2], GREEDY)[0]
    assert d.connector.handoff.release_hold("conv-c1-d", d_params["remote_lease_epoch"]) is not None
