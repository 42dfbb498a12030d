"""Gateway pieces without engines: stop-string matching, replica choice, DNS expansion, SSE parsing,
and the engine request shapes of each hop."""

from __future__ import annotations

import asyncio
import socket

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.gateway.engine_client import SseEvents
from render_service.gateway.flow import decode_request, engine_request, prefill_request
from render_service.gateway.pools import ReplicaPool, prefix_key
from render_service.gateway.stop_strings import StopMatcher
from render_service.wire.protocol import GenerateRequest, SamplingParams

# ------------------------------------------------------------------------------------ stop strings


def _run(matcher: StopMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = []
    for piece in pieces:
        released, match = matcher.feed(piece)
        out.append(released)
        if match is not None:
            out.append(match.text)
            return "".join(out), match.stop
    out.append(matcher.flush())
    return "".join(out), None


def _expected(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    hits = [(text.find(s), s) for s in stops if s and text.find(s) >= 0]
    if not hits:
        return text, None
    # the earliest end wins when streaming: a stop completes as soon as its last character arrives
    at, stop = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
    return (text[: at + len(stop)] if include else text[:at]), stop


def test_stop_string_split_across_pieces_is_cut_before_it():
    assert _run(StopMatcher(["sky is"]), ["Hello the s", "ky", " is blue"]) == ("Hello the ", "sky is")


def test_include_stop_str_in_output_keeps_the_stop_string():
    assert _run(StopMatcher(["sky is"], True), ["the sky", " is blue"]) == ("the sky is", "sky is")


def test_text_that_only_looks_like_a_stop_prefix_is_released_at_the_end():
    assert _run(StopMatcher(["skyline"]), ["the sky", "lin"]) == ("the skylin", None)


def test_text_that_cannot_start_a_stop_string_is_not_held_back():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello world") == ("hello world", None)
    assert matcher.feed("ST") == ("", None)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=40), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                  min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8), include=st.booleans())
def test_streamed_stop_matching_equals_matching_the_whole_text(text, stops, cuts, include):
    points = sorted({c for c in cuts if c <= len(text)})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    got = _run(StopMatcher(stops, include), pieces)
    if got[1] is None:
        assert got == (text, None) and _expected(text, stops, include)[1] is None
    else:
        # the match ends at the first position where any stop string is complete
        end = min(text.find(s) + len(s) for s in stops if text.find(s) >= 0)
        prefix = text[:end]
        assert got[1] in stops and prefix.endswith(got[1])
        assert got[0] == (prefix if include else prefix[: len(prefix) - len(got[1])])


# ---------------------------------------------------------------------------------- replica choice


def test_least_outstanding_picks_the_idle_replica():
    pool = ReplicaPool("engine", ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    busy = pool.replicas[0]
    pool.acquire(busy)
    assert pool.choose().url == "http://10.0.0.2:8000"


def test_same_prefix_goes_to_the_same_replica_while_load_allows():
    pool = ReplicaPool("engine", [f"http://10.0.0.{i}:8000" for i in range(1, 5)])
    prompt = list(range(100, 200))
    key = prefix_key(prompt, 16, 4)
    assert key == prefix_key(prompt[:64] + [1, 2, 3], 16, 4)  # only the first 4 blocks count
    first = pool.choose(key)
    assert all(pool.choose(key) is first for _ in range(10))
    keys = {pool.choose(prefix_key([i] * 64, 16, 4)).url for i in range(64)}
    assert len(keys) == 4  # different prefixes spread over the ring


def test_prefix_affinity_yields_to_the_load_bound():
    pool = ReplicaPool("engine", ["http://10.0.0.1:8000", "http://10.0.0.2:8000"], load_factor=1.25)
    key = prefix_key(list(range(64)), 16, 4)
    chosen = []
    for _ in range(8):
        r = pool.choose(key)
        pool.acquire(r)
        chosen.append(r.url)
    counts = sorted(chosen.count(u) for u in set(chosen))
    assert counts == [4, 4] or counts == [3, 5]  # never more than 1.25x the mean (+1 for rounding)


def test_prompt_shorter_than_a_block_has_no_affinity_key():
    assert prefix_key([1, 2, 3], 16, 4) is None


def test_failed_replica_is_passed_over_and_excluded_ones_never_chosen():
    pool = ReplicaPool("engine", ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    pool.mark_failed(pool.replicas[0])
    assert {pool.choose().url for _ in range(4)} == {"http://10.0.0.2:8000"}
    assert pool.choose(exclude=frozenset(["http://10.0.0.2:8000"])).url == "http://10.0.0.1:8000"  # all down: try
    assert pool.choose(exclude=frozenset(r.url for r in pool.replicas)) is None


def test_a_name_with_several_addresses_becomes_one_replica_per_address():
    addresses = {info[4][0] for info in socket.getaddrinfo("localhost", 8000, type=socket.SOCK_STREAM)}
    pool = ReplicaPool("engine", ["http://localhost:8000"])
    pool.acquire(pool.replicas[0])
    asyncio.run(pool.refresh())
    if len(addresses) == 1:
        assert [r.url for r in pool.replicas] == ["http://localhost:8000"]
        assert pool.replicas[0].outstanding == 1  # a replica that stays keeps its count
    else:
        assert len(pool.replicas) == len(addresses)
        assert all("localhost" not in r.url and r.url.endswith(":8000") for r in pool.replicas)


# ------------------------------------------------------------------------------------------- wire


def test_sse_parser_joins_events_split_anywhere():
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'

    events = SseEvents()
    data = [d for i in range(0, len(stream), 5) for d in events.feed(stream[i:i + 5])]
    assert data + events.flush() == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]


def _gen() -> GenerateRequest:
    return GenerateRequest(request_id="chatcmpl-1", token_ids=[1, 2, 3], model="served-name",
                           sampling_params=SamplingParams(n=2, max_tokens=50, min_tokens=5, stop=["x"],
                                                          extra_args={"kv_transfer_params": {"remote_host": "evil"}}))


def test_engine_request_strips_stop_strings_and_client_kv_params_and_streams():
    body = msgspec.json.decode(msgspec.json.encode(engine_request(_gen())))
    sp = body["sampling_params"]
    assert "stop" not in sp and "extra_args" not in sp
    assert body["stream"] is True and body["model"] is None and body["kv_transfer_params"] is None
    assert (sp["n"], sp["max_tokens"], sp["min_tokens"]) == (2, 50, 5)


def test_prefill_asks_for_one_token_and_remote_decode_then_decode_carries_the_answer():
    body = msgspec.json.decode(msgspec.json.encode(prefill_request(_gen())))
    sp = body["sampling_params"]
    assert (sp["max_tokens"], sp.get("min_tokens", 0), sp.get("n", 1), body["stream"]) == (1, 0, 1, False)
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    kv = {"do_remote_prefill": True, "remote_block_ids": [0], "remote_engine_id": "p"}
    decode = msgspec.json.decode(msgspec.json.encode(decode_request(_gen(), kv)))
    assert decode["kv_transfer_params"] == {**kv, "prompt_token_ids": [1, 2, 3]}
    assert decode["stream"] is True and decode["sampling_params"]["max_tokens"] == 50


def test_pd_fans_n_out_into_single_sequence_calls_with_distinct_seeds():
    from render_service.gateway.flow import plan_streams

    gen = msgspec.structs.replace(_gen(), sampling_params=msgspec.structs.replace(_gen().sampling_params, n=3,
                                                                                  seed=7))
    collocated = plan_streams([gen], disaggregated=False)
    assert [(s.prompt_index, s.first, s.count) for s in collocated] == [(0, 0, 3)]
    split = plan_streams([gen, msgspec.structs.replace(_gen(), request_id="chatcmpl-2")], disaggregated=True)
    assert [(s.prompt_index, s.first, s.count) for s in split] == [(0, 0, 1), (0, 1, 1), (0, 2, 1), (1, 0, 1), (1, 1, 1)]
    assert [s.gen.sampling_params.seed for s in split[:3]] == [7, 8, 9]
    assert len({s.gen.request_id for s in split}) == 5  # one engine request id per call


# ---- conditional disaggregation: the per-decode-replica prefix record (gateway/pd.py)


def test_prefix_record_counts_leading_blocks_it_routed_there_before():
    from render_service.gateway.pd import PrefixRecord

    record = PrefixRecord(block_size=4)
    first = list(range(100, 110))  # two full blocks and a partial one
    record.record("http://d1", record.chain(first))
    follow_up = first[:8] + [7, 7, 7, 7, 7]
    assert record.cached_tokens("http://d1", record.chain(follow_up)) == 8
    assert record.cached_tokens("http://d2", record.chain(follow_up)) == 0  # another replica saw nothing
    # a block is keyed with everything before it: the same tokens after another prefix are not cached
    assert record.cached_tokens("http://d1", record.chain([1, 2, 3, 4] + first[4:8])) == 0
    record.forget("http://d1")
    assert record.cached_tokens("http://d1", record.chain(first)) == 0


def test_prefix_record_is_bounded_per_replica_least_recently_used_out():
    from render_service.gateway.pd import PrefixRecord

    record = PrefixRecord(block_size=2, capacity=3)
    old, new = [1, 2, 3, 4], [9, 8, 7, 6, 5, 4]
    record.record("r", record.chain(old))
    record.record("r", record.chain(new))
    assert record.cached_tokens("r", record.chain(new)) == 6
    assert record.cached_tokens("r", record.chain(old)) == 0


def test_push_dispatch_settings_are_checked_and_reach_the_gateway():
    import pytest

    from render_service.cli import build_gateway, build_parser
    from render_service.gateway.flow import Gateway, GatewaySettings

    args = build_parser().parse_args(["serve", "--prefill", "http://p:1", "--decode", "http://d:1",
                                      "--pd-transfer-mode", "push", "--pd-min-uncached-tokens", "256"])
    gw = build_gateway(args)
    assert (gw.settings.pd_transfer_mode, gw.settings.pd_min_uncached_tokens) == ("push", 256)
    with pytest.raises(ValueError, match="pd-transfer-mode"):
        Gateway(prefill=["http://p:1"], decode=["http://d:1"], settings=GatewaySettings(pd_transfer_mode="both"))
    with pytest.raises(ValueError, match="pd-min-uncached-tokens"):
        Gateway(prefill=["http://p:1"], decode=["http://d:1"], settings=GatewaySettings(pd_min_uncached_tokens=-1))
