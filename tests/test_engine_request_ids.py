"""vLLM's request-id contract on a real engine server: one id on concurrent requests runs them all (as vLLM's
internal suffix does) and an abort by that id ends all of them; plus /ping, /load and weight_versions."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.engine_harness import engine_config, idle_client, single_threaded_server, write_tiny_qwen3

PROMPT = [9707, 11, 1246, 525, 498, 30, 358, 1079, 264, 1273, 13]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def server(model_dir):
    with single_threaded_server(engine_config(model_dir, max_model_len=MAX_MODEL_LEN,
                                              num_gpu_blocks_override=256)) as srv:
        yield srv


@pytest.fixture
def client(server):
    yield from idle_client(server)


class Stream(threading.Thread):
    """One streaming /generate call on its own connection; records its events."""

    def __init__(self, url: str, body: dict, headers: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.events: list[dict] = []
        self.first = threading.Event()
        self.status: int | None = None

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            with c.stream("POST", "/inference/v1/generate", json=self.body, headers=self.headers) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.events.append(json.loads(line[6:]))
                        self.first.set()
        self.first.set()

    def tokens(self) -> list[int]:
        return [t for e in self.events for c in e["choices"] for t in c["token_ids"]]

    def finish_reason(self) -> str | None:
        return next((c["finish_reason"] for e in reversed(self.events) for c in e["choices"] if c["finish_reason"]),
                    None)


def _running(llm) -> int:
    return len(llm.requests)


def test_one_id_on_concurrent_streams_runs_both_and_one_abort_ends_both(server, client):
    body = {"token_ids": PROMPT, "stream": True, "sampling_params": {"ignore_eos": True}}
    streams = [Stream(server.url, body, {"X-Request-Id": "rl-sample"}) for _ in range(2)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(60)
    assert [s.status for s in streams] == [200, 200]
    assert client.get("/load").json() == {"server_load": 2}
    # each runs under its own engine id, the caller's id plus 8 hex digits
    assert len({rid for rid in list(server.llm.requests)}) == 2
    assert all(rid.startswith("generate-tokens-rl-sample-") for rid in list(server.llm.requests))
    assert client.post("/inference/v1/abort_requests", json={"request_ids": ["rl-sample"]}).status_code == 200
    for s in streams:
        s.join(60)
        assert not s.is_alive()
        assert s.finish_reason() == "abort"
        assert {e["request_id"] for e in s.events} == {"generate-tokens-rl-sample"}
        assert len(s.tokens()) < MAX_MODEL_LEN - len(PROMPT)
    assert client.get("/load").json() == {"server_load": 0}


def test_one_id_on_concurrent_batch_requests_answers_both(server, client):
    body = {"token_ids": PROMPT, "request_id": "retry-me", "sampling_params": {"max_tokens": 12, "ignore_eos": True,
                                                                              "temperature": 0}}
    results: list[httpx.Response] = []

    def call() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            results.append(c.post("/inference/v1/generate", json=body))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200, 200, 200], [r.text for r in results]
    outs = [r.json() for r in results]
    assert {o["request_id"] for o in outs} == {"generate-tokens-retry-me"}
    assert len({tuple(o["choices"][0]["token_ids"]) for o in outs}) == 1  # greedy: the same tokens


def test_aborting_an_unknown_or_finished_id_is_harmless(server, client):
    r = client.post("/inference/v1/generate", json={"token_ids": PROMPT, "request_id": "done-1",
                                                    "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 200
    for rid in ("done-1", "generate-tokens-done-1", "never-seen"):
        assert client.post("/inference/v1/abort_requests", json={"request_ids": [rid]}).status_code == 200
    assert _running(server.llm) == 0


def test_ping_answers_get_and_post_like_health(client):
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200
    assert client.get("/load").json() == {"server_load": 0}


def test_choices_carry_weight_versions_batch_and_stream(client):
    out = client.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 5, "ignore_eos": True, "n": 2}}).json()
    for choice in out["choices"]:
        assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    with client.stream("POST", "/inference/v1/generate", json={"token_ids": PROMPT, "stream": True,
                                                               "sampling_params": {"max_tokens": 4,
                                                                                   "ignore_eos": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    assert choices[-1]["weight_versions"] == [{"version": "default", "start": 0, "end": 4}]
    assert all("weight_versions" not in c for c in choices[:-1])  # the last event of a choice only, as vLLM
