"""The render caches' one owner: the byte-bounded LRU they share, the budget that splits --render-cache-bytes, and
their counters on /metrics of a real server."""

from __future__ import annotations

import re

import msgspec
import pytest

from bench.agent_trace import AgentTraceSpec, agent_trace, chat_body, round_ends
from render_service.caches.budget import CacheShares
from render_service.caches.byte_lru import ByteLRU
from render_service.render.render_config import build_render_config
from tests.render_harness import PARSER_FLAGS, RenderServer, qwen3_bundle


def test_the_lru_stays_within_its_bytes_and_drops_the_least_recently_used():
    dropped: list[str] = []
    lru: ByteLRU[str, str] = ByteLRU(1000, on_evict=dropped.append)
    for i in range(10):
        assert lru.put(f"k{i}", f"v{i}", 100)
    assert lru.get("k0") == "v0"  # now the most recently used
    assert lru.put("k10", "v10", 100)
    assert lru.bytes == 1000 and dropped == ["v1"] and lru.get("k1") is None
    assert not lru.put("huge", "x", 126)  # past an eighth of the bound: not kept, nothing dropped
    assert not lru.put("k2", "other", 100) and lru.get("k2") == "v2"  # the first value stays
    assert lru.put("k2", "newer", 100, replace=True) and lru.get("k2") == "newer" and dropped[-1] == "v2"
    stats = lru.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries) == (3, 1, 1, 10)


def test_the_budget_splits_the_bytes_and_zero_turns_every_cache_off():
    shares = CacheShares.of(256 * 2**20, 8 * 2**20)
    assert shares.tojson + shares.memo + shares.body_store + shares.prompt_encoder == shares.total
    assert shares.tojson == 8 * 2**20 and shares.memo == shares.body_store == 31 * 2**20
    # beside the split: each template's loop records and the extend's masks, each capped
    assert (shares.template_loops, shares.masks) == (32 * 2**20, 16 * 2**20)
    assert (CacheShares.of(2**33, 8 * 2**20).template_loops, CacheShares.of(2**33, 8 * 2**20).masks) == \
        (64 * 2**20, 64 * 2**20)
    # and a Harmony model's message texts: an eighth, at most 256 MiB
    assert (shares.harmony_texts, CacheShares.of(2**33, 8 * 2**20).harmony_texts) == (32 * 2**20, 256 * 2**20)
    # and its renders' turn records: an eighth, at most 64 MiB
    assert (shares.harmony_turns, CacheShares.of(2**33, 8 * 2**20).harmony_turns) == (32 * 2**20, 64 * 2**20)
    assert CacheShares.of(0, 8 * 2**20) == CacheShares(0, 0, 0, 0, 0)
    with pytest.raises(ValueError):
        CacheShares.of(-1, 0)


def _series(text: str, name: str, cache: str, result: str | None = None) -> float:
    labels = f'cache="{cache}"' + (f',result="{result}"' if result else "")
    found = re.search(rf'^{name}{{{labels}}} (\S+)$', text, re.M)
    assert found, (name, cache, result)
    return float(found.group(1))


def test_every_cache_shows_its_hits_misses_and_bytes_on_metrics():
    # built here, not shared: the tojson texts are one per process and bounded by the config built last
    config = build_render_config(qwen3_bundle(), served_model_names=["qwen3-0.6b"], **PARSER_FLAGS)
    messages, tools = agent_trace(AgentTraceSpec(rounds=4, result_chars=(4000, 8000), seed=3))  # bodies past 32 KB: filed
    with RenderServer(config) as server:
        for end in round_ends(messages):
            body = msgspec.json.encode(chat_body("qwen3-0.6b", messages[:end], tools))
            assert server.client.post("/v1/chat/completions/render", content=body,
                                      headers={"content-type": "application/json"}).status_code == 200
        text = server.client.get("/metrics").text
    for cache in ("piece", "prompt_store", "memo", "body_store", "tojson"):
        assert _series(text, "splitserve_render_cache_lookups_total", cache, "hit") > 0, cache
        assert _series(text, "splitserve_render_cache_lookups_total", cache, "miss") > 0, cache
        assert 0 < _series(text, "splitserve_render_cache_bytes", cache) \
            <= _series(text, "splitserve_render_cache_max_bytes", cache), cache
