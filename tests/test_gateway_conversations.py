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

from render_service.errors import ApiError
from render_service.gateway.conversations import (
    MAX_CONVERSATION_ID_CHARS, ConversationCache, conversation_key, next_turn_prefill_params, preferred_replica,
)
from render_service.gateway.pools import ReplicaPool
from tests.engine_harness import ServerThread, engine_config
from tests.gateway_harness import QWEN3_TOKENIZER, gateway_process
from token_engine.random_model import write_random_model

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
