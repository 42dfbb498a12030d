"""KV cache tiers on a tiny random model: per-tier prefix-cache metrics, and the host-memory offload tier."""

from __future__ import annotations

import re

import pytest
import torch

from tests.engine_harness import engine_config, write_tiny_qwen3
from token_engine.engine import LLMEngine
from token_engine.sequence import SamplingOptions

GREEDY = SamplingOptions(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from token_engine.models import load_model

    model_dir = write_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), vocab_size=2048)
    yield model_dir, load_model(model_dir, dtype="float32")
    torch.set_num_threads(threads)


def make_engine(model, **kw) -> LLMEngine:
    model_dir, loaded = model
    return LLMEngine(engine_config(model_dir, **kw), model=loaded)


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
