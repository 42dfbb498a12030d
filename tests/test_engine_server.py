"""The tokens-only engine over real HTTP: vLLM's /inference/v1/generate contract on a tiny random Qwen3."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from tests.engine_harness import (
    FIXTURES,
    ServerThread,
    engine_config,
    greedy_reference,
    idle_client,
    single_threaded_server,
    wait_for_idle_blocks,
    write_tiny_qwen3,
)

MODEL_NAME = "qwen3-0.6b"  # what the recorded render output names
MAX_MODEL_LEN = 48  # short: every default max_tokens runs to the end of the window


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))
    config = engine_config(model_dir, served_model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN)
    with single_threaded_server(config) as srv:
        yield srv


@pytest.fixture
def client(server):
    yield from idle_client(server)  # every test leaves the pool as it found it


def generate(client, body: dict, **kw):
    return client.post("/inference/v1/generate", json=body, **kw)


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: ")
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


PROMPT = [9707, 11, 1246, 525, 498, 30, 358, 1079, 264, 1273, 13]


# ---- compatibility with the render tier --------------------------------------------------------------
def test_render_output_is_accepted_unchanged(server, client):
    recorded = json.loads((FIXTURES / "vllm-0.32-render/noparsers/01_chat_render_basic.response.json").read_text())
    body = recorded["body"]
    r = generate(client, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] == f"generate-tokens-{body['request_id']}"
    assert out["model"] == MODEL_NAME
    (choice,) = out["choices"]
    # render asked for 40932 tokens (its 40960 window); the engine clamps to its own window, as vLLM does
    assert len(choice["token_ids"]) == MAX_MODEL_LEN - len(body["token_ids"]) or choice["finish_reason"] == "stop"
    assert out["usage"] == {"prompt_tokens": len(body["token_ids"]), "completion_tokens": len(choice["token_ids"]),
                            "total_tokens": len(body["token_ids"]) + len(choice["token_ids"]),
                            "prompt_tokens_details": None}


def test_render_output_with_stop_strings_is_refused_like_vllm_tokens_only(client):
    recorded = json.loads((FIXTURES / "vllm-0.32-render/noparsers/05_chat_render_sampling_params.response.json")
                          .read_text())
    r = generate(client, recorded["body"])
    assert r.status_code == 400
    assert "stop_token_ids" in r.json()["error"]["message"]


# ---- correctness -------------------------------------------------------------------------------------
def test_greedy_output_equals_a_plain_greedy_loop_over_the_model(server, client):
    r = generate(client, {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 12,
                                                                    "ignore_eos": True}})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["token_ids"]
    assert got == greedy_reference(server.llm.model, PROMPT, 12)
    assert len(set(got)) > 1  # the model is not a degenerate echo


def test_stream_sends_one_choice_per_event_then_usage_then_done(client):
    body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True},
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/inference/v1/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 6
    token_chunks = events[:-2]
    assert all(len(e["choices"]) == 1 for e in token_chunks)
    assert [e["choices"][0]["finish_reason"] for e in token_chunks][-1] == "length"
    streamed = [t for e in token_chunks for t in e["choices"][0]["token_ids"]]
    batch = generate(client, {**body, "stream": False}).json()["choices"][0]["token_ids"]
    assert streamed == batch


def test_stream_without_stream_options_has_no_usage_chunk(client):
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "ignore_eos": True}, "stream": True}
    with client.stream("POST", "/inference/v1/generate", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])


def test_n_greater_than_one_returns_n_choices_and_interleaves_when_streaming(client):
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 4, "n": 3, "ignore_eos": True}
    out = generate(client, {"token_ids": PROMPT, "sampling_params": params}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 4 for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 12
    with client.stream("POST", "/inference/v1/generate",
                       json={"token_ids": PROMPT, "sampling_params": params, "stream": True}) as r:
        events = sse_events(r)[:-1]
    per_index: dict[int, list[int]] = {}
    for e in events:
        (choice,) = e["choices"]
        per_index.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert per_index == {c["index"]: c["token_ids"] for c in out["choices"]}


def test_seeded_sampling_is_reproducible_and_seed_dependent(client):
    def run(seed):
        params = {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": seed, "max_tokens": 8, "ignore_eos": True}
        return generate(client, {"token_ids": PROMPT, "sampling_params": params}).json()["choices"][0]["token_ids"]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_x_request_id_header_names_the_request(client):
    r = generate(client, {"token_ids": PROMPT, "request_id": "body-id", "sampling_params": {"max_tokens": 1}},
                 headers={"X-Request-Id": "hdr-id"})
    assert r.json()["request_id"] == "generate-tokens-hdr-id"
    r = generate(client, {"token_ids": PROMPT, "request_id": "body-id", "sampling_params": {"max_tokens": 1}})
    assert r.json()["request_id"] == "generate-tokens-body-id"


def test_max_tokens_defaults_to_the_rest_of_the_context_window(client):
    out = generate(client, {"token_ids": PROMPT, "sampling_params": {"ignore_eos": True}}).json()
    assert len(out["choices"][0]["token_ids"]) == MAX_MODEL_LEN - len(PROMPT)
    assert out["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_end_the_choice_with_stop(server, client):
    expected = greedy_reference(server.llm.model, PROMPT, 5)
    params = {"temperature": 0, "max_tokens": 20, "stop_token_ids": [expected[2]]}
    choice = generate(client, {"token_ids": PROMPT, "sampling_params": params}).json()["choices"][0]
    first = expected.index(expected[2])
    assert choice["token_ids"] == expected[:first + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == expected[2]


# ---- logprobs ----------------------------------------------------------------------------------------
def test_logprobs_carry_integer_token_ids(client):
    params = {"temperature": 0, "max_tokens": 3, "logprobs": 2, "ignore_eos": True}
    choice = generate(client, {"token_ids": PROMPT, "sampling_params": params}).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    for e in content:
        assert e["rank"] == 1  # greedy picks the best token
        assert [t["rank"] for t in e["top_logprobs"]] == [1, 2]
        assert e["top_logprobs"][0]["token_id"] == e["token_id"]
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"])
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]


def test_return_token_logprobs_gives_the_sampled_logprobs_as_a_flat_list(client):
    body = {"token_ids": PROMPT, "return_token_logprobs": True,
            "sampling_params": {"temperature": 0, "max_tokens": 3, "ignore_eos": True}}
    choice = generate(client, body).json()["choices"][0]
    assert choice["logprobs"]["content"] is None
    sampled = choice["logprobs"]["sampled"]
    assert len(sampled) == 3 and all(lp <= 0 for lp in sampled)
    with_top = generate(client, {**body, "sampling_params": {**body["sampling_params"], "logprobs": 1}}).json()
    content = with_top["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx(sampled)


def test_streamed_return_token_logprobs_carry_each_chunks_tokens_and_add_up_to_the_whole_answer(client):
    body = {"token_ids": PROMPT, "return_token_logprobs": True,
            "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}}
    whole = generate(client, body).json()["choices"][0]
    with client.stream("POST", "/inference/v1/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [e["choices"][0] for e in sse_events(r)[:-1] if e["choices"]]
    assert len([c for c in chunks if c["token_ids"]]) > 1  # the answer really came in pieces
    for c in chunks:
        assert c["logprobs"]["content"] is None
        assert len(c["logprobs"]["sampled"]) == len(c["token_ids"])
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert [lp for c in chunks for lp in c["logprobs"]["sampled"]] == whole["logprobs"]["sampled"]


def test_bad_words_without_a_tokenizer_in_the_model_directory_are_a_400_that_says_so(client):
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "bad_words": ["blue"]}}
    for stream in (False, True):
        r = generate(client, {**body, "stream": stream})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "sampling_params.bad_words" and "no tokenizer.json" in error["message"]


def test_legacy_logprobs_shape_uses_token_id_strings(client):
    params = {"temperature": 0, "max_tokens": 2, "logprobs": 1, "ignore_eos": True}
    choice = generate(client, {"token_ids": PROMPT, "sampling_params": params,
                               "logprobs_format": "token_id_strings"}).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert content[0]["top_logprobs"][0]["token"] == f"token_id:{choice['token_ids'][0]}"


def test_prompt_logprobs_cover_every_prompt_token_but_the_first(client):
    params = {"max_tokens": 1, "prompt_logprobs": 1}
    out = generate(client, {"token_ids": PROMPT, "sampling_params": params}).json()
    plp = out["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    for token, entry in zip(PROMPT[1:], plp[1:]):
        assert str(token) in entry
        assert entry[str(token)]["logprob"] <= 0.0


# ---- prefix caching ----------------------------------------------------------------------------------
def test_prefix_cache_hit_gives_the_same_output_and_counts_a_hit(server, client):
    prompt = list(range(2000, 2030))  # 7 full blocks of 4
    body = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 5, "ignore_eos": True}}
    first = generate(client, body).json()
    hits_before = server.llm.block_manager.prefix_hits
    second = generate(client, body).json()
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert server.llm.block_manager.prefix_hits - hits_before == 28  # all full blocks but the last token's
    metrics = client.get("/metrics").text
    assert "vllm:prefix_cache_hits_total" in metrics
    salted = generate(client, {**body, "cache_salt": "tenant-b"}).json()
    assert salted["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert server.llm.block_manager.prefix_hits - hits_before == 28  # a different salt never hits


# ---- abort and disconnect ----------------------------------------------------------------------------
@pytest.mark.parametrize("abort_id", ["generate-tokens-to-abort", "to-abort", ["to-abort"]])
def test_abort_endpoint_ends_a_running_stream_with_abort(server, client, abort_id):
    body = {"token_ids": PROMPT, "sampling_params": {"ignore_eos": True}, "stream": True}
    with client.stream("POST", "/inference/v1/generate", json=body, headers={"X-Request-Id": "to-abort"}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        assert client.post("/inference/v1/abort_requests",
                           json={"request_ids": abort_id}).status_code == 200  # 0.34: one id or a list
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    finals = [json.loads(line[6:]) for line in rest[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "abort"
    total = 1 + sum(len(f["choices"][0]["token_ids"]) for f in finals)
    assert total < MAX_MODEL_LEN - len(PROMPT)


def test_legacy_abort_path_and_bad_abort_bodies(client):
    assert client.post("/abort_requests", json={"request_ids": ["generate-tokens-nothing"]}).status_code == 200
    r = client.post("/inference/v1/abort_requests", json={"ids": []})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert client.post("/abort_requests", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    r = client.post("/inference/v1/abort_requests", json={"request_ids": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.request_ids"  # vLLM 0.34's validation 400
    # vLLM 0.34 still takes an abort without a Content-Type
    assert client.post("/inference/v1/abort_requests", content=b'{"request_ids": "x"}').status_code == 200


def _raw_request(port: int, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def _running_under(llm, request_id: str) -> list:
    """The engine's requests answered as ``request_id`` (the engine runs each under id + "-" + 8 hex)."""
    return [state for rid, state in list(llm.requests.items())
            if rid.rsplit("-", 1)[0] == request_id and len(rid.rsplit("-", 1)[1]) == 8]


def _wait_until_running(llm, request_id: str, count: int = 1) -> None:
    for _ in range(400):  # bounded
        states = _running_under(llm, request_id)
        if len(states) >= count and all(any(s.num_output_tokens for s in st.seqs) for st in states):
            return
        time.sleep(0.025)
    raise AssertionError(f"{request_id} never started")


def _aborted_count(llm) -> float:
    labels = {"model_name": llm.config.model_name, "finished_reason": "abort"}
    return llm.metrics.registry.get_sample_value("vllm:request_success_total", labels) or 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server, client, stream):
    rid = f"disconnect-{stream}"
    body = {"token_ids": PROMPT, "request_id": rid, "stream": stream,
            "sampling_params": {"ignore_eos": True}}
    aborted_before = _aborted_count(server.llm)
    sock = _raw_request(server.port, body)
    _wait_until_running(server.llm, f"generate-tokens-{rid}")
    assert server.llm.num_free_blocks() < server.llm.num_blocks
    sock.close()
    assert wait_for_idle_blocks(server.llm) == server.llm.num_blocks
    assert _aborted_count(server.llm) == aborted_before + 1  # it ended as an abort, not by filling the window


# ---- bad input ---------------------------------------------------------------------------------------
BAD_REQUESTS = {
    "token id past the vocabulary": {"token_ids": [1, 151936], "sampling_params": {}},
    "negative token id": {"token_ids": [-1], "sampling_params": {}},
    "empty prompt": {"token_ids": [], "sampling_params": {}},
    "prompt fills the context window": {"token_ids": [1] * MAX_MODEL_LEN, "sampling_params": {}},
    "negative temperature": {"token_ids": [1], "sampling_params": {"temperature": -0.5}},
    "top_p zero": {"token_ids": [1], "sampling_params": {"top_p": 0.0}},
    "top_p above one": {"token_ids": [1], "sampling_params": {"top_p": 1.5}},
    "top_k below -1": {"token_ids": [1], "sampling_params": {"top_k": -5}},
    "min_p above one": {"token_ids": [1], "sampling_params": {"min_p": 2}},
    "n above max_num_seqs": {"token_ids": [1], "sampling_params": {"n": 17}},
    "n zero": {"token_ids": [1], "sampling_params": {"n": 0}},
    "max_tokens zero": {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
    "max_tokens beyond 64 bits": {"token_ids": [1], "sampling_params": {"max_tokens": 10**30}},
    "min_tokens above max_tokens": {"token_ids": [1], "sampling_params": {"max_tokens": 2, "min_tokens": 5}},
    "too many logprobs": {"token_ids": [1], "sampling_params": {"logprobs": 1000}},
    "presence penalty out of range": {"token_ids": [1], "sampling_params": {"presence_penalty": 9}},
    "repetition penalty zero": {"token_ids": [1], "sampling_params": {"repetition_penalty": 0}},
    "stop strings": {"token_ids": [1], "sampling_params": {"stop": ["\n"]}},
    "stop string": {"token_ids": [1], "sampling_params": {"stop": "x"}},
    "stop_token_ids past the vocabulary": {"token_ids": [1], "sampling_params": {"stop_token_ids": [10**9]}},
    "temperature of the wrong type": {"token_ids": [1], "sampling_params": {"temperature": "hot"}},
    "token_ids missing": {"sampling_params": {}},
    "sampling_params missing": {"token_ids": [1]},
    "text output mode on an engine without tokenizer.json": {"token_ids": [1], "sampling_params": {},
                                                             "output_mode": "text"},
    "unknown output mode": {"token_ids": [1], "sampling_params": {}, "output_mode": "words"},
    "null output mode": {"token_ids": [1], "sampling_params": {}, "output_mode": None},
    "multimodal features": {"token_ids": [1], "sampling_params": {}, "features": {"mm_hashes": {}}},
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_a_400_with_an_openai_error_body(client, case):
    r = generate(client, BAD_REQUESTS[case])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_json_and_wrong_content_type_get_400(client):
    r = client.post("/inference/v1/generate", content=b'{"token_ids": [1', headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = client.post("/inference/v1/generate", content=b'{"token_ids": [1], "sampling_params": {}}',
                    headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]


def test_oversized_body_gets_413_before_it_is_read(server, client):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1099511627776\r\n\r\n{}")
        sock.settimeout(30)
        head = sock.recv(65536).split(b"\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 413")


def test_logit_bias_keys_are_token_ids_and_checked(client):
    ok = generate(client, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0,
                                                                    "logit_bias": {"42": 100}}})
    assert ok.json()["choices"][0]["token_ids"] == [42, 42]
    bad = generate(client, {"token_ids": PROMPT, "sampling_params": {"logit_bias": {"999999": 1}}})
    assert bad.status_code == 400
    bad = generate(client, {"token_ids": PROMPT, "sampling_params": {"logit_bias": {"x": 1}}})
    assert bad.status_code == 400


def test_kv_transfer_params_without_a_connector_are_not_echoed(client):
    out = generate(client, {"token_ids": PROMPT, "kv_transfer_params": {"do_remote_decode": True},
                            "sampling_params": {"max_tokens": 1}}).json()
    assert out["kv_transfer_params"] is None


def test_prompt_token_ids_are_returned_only_when_asked(client):
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}}
    assert "prompt_token_ids" not in generate(client, body).json()
    assert generate(client, {**body, "return_token_ids": True}).json()["prompt_token_ids"] == PROMPT


def test_unknown_paths_and_methods_get_the_error_envelope(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = client.get("/inference/v1/generate")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_unknown_model_gets_404(client):
    r = generate(client, {"token_ids": [1], "model": "other", "sampling_params": {}})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_unknown_keys_are_ignored(client):
    r = generate(client, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "output_kind": 2,
                                                                   "skip_clone": True, "whatever": [1]},
                          "reasoning_ended": False, "something_new": {"a": 1}})
    assert r.status_code == 200, r.text


# ---- operations --------------------------------------------------------------------------------------
def test_health_models_version_and_metrics(server, client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL_NAME and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/version").json()["version"]
    generate(client, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "ignore_eos": True}})
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in text, name
    # a step's phases: this request ran a prefill step and a decode step, each observed once per phase
    for phase in ("schedule", "model", "bookkeeping"):
        count = re.search(rf'splitserve:engine_step_phase_seconds_count{{[^}}]*phase="{phase}"[^}}]*}} (\S+)', text)
        assert count and float(count.group(1)) >= 2, phase
    debug = client.get("/debug/kv_cache").json()
    assert debug["num_blocks"] == server.llm.num_blocks


def test_cached_tokens_are_reported_with_prompt_tokens_details(tmp_path):
    model_dir = write_tiny_qwen3(tmp_path / "m", vocab_size=512)
    with ServerThread(engine_config(model_dir), enable_prompt_tokens_details=True) as srv, srv.client() as c:
        body = {"token_ids": list(range(100, 118)), "sampling_params": {"max_tokens": 1}}
        first = c.post("/inference/v1/generate", json=body).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        second = c.post("/inference/v1/generate", json=body).json()
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}  # 4 full blocks of 4


def test_a_dead_engine_fails_health_and_requests_instead_of_hanging(tmp_path):
    model_dir = write_tiny_qwen3(tmp_path / "m", vocab_size=512)
    with ServerThread(engine_config(model_dir)) as srv, srv.client() as c:
        limits, srv.llm.limits = srv.llm.limits, None  # a bug in a handler: still the error envelope
        r = c.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        srv.llm.limits = limits

        def broken_step():
            raise SystemExit("simulated engine crash")  # BaseException: not caught as a step failure

        srv.llm.step = broken_step
        r = c.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503
        r = c.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 503


def test_kv_transfer_params_reach_the_connector_and_come_back(tmp_path):
    from token_engine.kv_connector.base import NoOpKVConnector

    class EchoConnector(NoOpKVConnector):
        """A real connector behind the seam: records what it was handed, answers with it."""

        def __init__(self):
            self.seen = []

        def bind_kv_pool(self, kv_pool, block_size):
            self.pool_shape = tuple(kv_pool.shape)

        def request_finished(self, seq, block_ids):
            self.seen.append((seq.kv_transfer_params, list(block_ids)))
            return False, {"echo": seq.kv_transfer_params, "num_blocks": len(block_ids)}

        def render_metrics(self):
            return b"# TYPE echo_connector_requests counter\necho_connector_requests_total 1.0\n"

    connector = EchoConnector()
    model_dir = write_tiny_qwen3(tmp_path / "m", vocab_size=512)
    with ServerThread(engine_config(model_dir), connector=connector) as srv, srv.client() as c:
        params = {"do_remote_decode": True, "remote_engine_id": None}
        out = c.post("/inference/v1/generate", json={"token_ids": [1, 2, 3, 4, 5], "kv_transfer_params": params,
                                                     "sampling_params": {"max_tokens": 1}}).json()
        assert out["kv_transfer_params"] == {"echo": params, "num_blocks": 2}
        assert connector.seen[0][0] == params
        assert connector.pool_shape[0] == srv.llm.num_blocks
        plain = c.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}})
        assert plain.json()["kv_transfer_params"] == {"echo": None, "num_blocks": 1}
        metrics = c.get("/metrics").text
        assert "echo_connector_requests_total" in metrics and "vllm:num_requests_running" in metrics
