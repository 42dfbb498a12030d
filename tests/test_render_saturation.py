"""The render tier under load: huge prompts tokenize off the event loop, a full queue answers 429 with
Retry-After, saturation is visible in /metrics, and a prompt too long by its length alone is refused before
tokenizing. A real ``render-service serve`` process on loopback (its event loop is what is checked)."""

from __future__ import annotations

import asyncio
import re
import sys
import threading

import httpx
import pytest

from tests.gateway_harness import free_port
from tests.ops_harness import Server
from tests.render_harness import QWEN3_DIR, RenderServer, qwen3_config

MAX_QUEUED = 2
# Tokenizing this takes seconds (millions of tokens), and the prompt then exceeds the context: a 400 with a small
# body once tokenized; min_tokens' bound (13 MB / 128 bytes per token) stays under the context, so it tokenizes.
HUGE_WORDS = 1_500_000
CONTEXT = 1_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    argv = [sys.executable, "-m", "render_service.cli", "serve", str(QWEN3_DIR), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "qwen3-0.6b", "--max-model-len", str(CONTEXT),
            "--max-queued-requests", str(MAX_QUEUED), "--log-level", "warning"]
    srv = Server(argv, port, tmp_path_factory.mktemp("saturation") / "render.log").wait_healthy()
    yield srv
    srv.stop()


def chat(content: str) -> dict:
    return {"model": "qwen3-0.6b", "messages": [{"role": "user", "content": content}]}


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


def test_health_small_renders_and_a_bounded_queue_while_a_huge_prompt_tokenizes(server):
    huge = chat("".join(f"w{i} " for i in range(HUGE_WORDS)))
    # Large enough for the bulk lane (256 KiB and up), where they wait behind the huge prompt.
    large = [httpx.Request("POST", server.url + "/v1/chat/completions/render",
                           json=chat(" ".join(f"b{k}y{i}" for i in range(40_000)))) for k in range(MAX_QUEUED + 2)]
    outcome: dict = {}

    def send_huge() -> None:
        outcome["huge"] = httpx.post(server.url + "/v1/chat/completions/render", json=huge, timeout=600)

    async def send_large() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*(client.send(r) for r in large))

    sender = threading.Thread(target=send_huge)
    sender.start()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        # Wait until the huge prompt is being rendered (hang guard: the sender's own end).
        while sender.is_alive() and metric(client.get("/metrics").text, "splitserve_render_in_flight") != 1:
            pass
        assert sender.is_alive(), "the huge render finished before it was seen in flight"
        assert client.get("/health").status_code == 200
        small = client.post("/v1/chat/completions/render", json=chat("hello there"))
        assert small.status_code == 200 and len(small.json()["token_ids"]) > 3
        assert sender.is_alive(), "small requests should have been answered while the huge prompt tokenized"
        # Behind it, MAX_QUEUED large renders may wait; the others are refused at once.
        waiter = threading.Thread(target=lambda: outcome.setdefault("large", asyncio.run(send_large())))
        waiter.start()
        while sender.is_alive() and metric(client.get("/metrics").text,
                                           'splitserve_render_rejected_total{reason="queue_full"}') != 2:
            pass
        assert sender.is_alive(), "the queue should have filled while the huge prompt tokenized"
    sender.join()
    waiter.join()
    refused = outcome["huge"]
    assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]
    statuses = sorted(r.status_code for r in outcome["large"])
    assert statuses == [200] * MAX_QUEUED + [429] * 2
    for r in outcome["large"]:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert error["code"] == 429 and "queue is full" in error["message"]


def test_metrics_show_queue_depth_in_flight_and_render_time(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(2):  # the second render of the same prompt is served from the piece cache
            assert client.post("/v1/chat/completions/render", json=chat("the same words twice")).status_code == 200
        text = client.get("/metrics").text
    assert metric(text, "splitserve_render_queue_depth") == 0
    assert metric(text, "splitserve_render_in_flight") == 0
    assert metric(text, 'splitserve_render_work_seconds_count{endpoint="chat_render"}') >= 2
    assert metric(text, "splitserve_render_queue_wait_seconds_count") >= 2
    assert metric(text, 'splitserve_render_prompt_cache_tokens_total{result="hit"}') > 0
    assert metric(text, 'splitserve_render_prompt_cache_tokens_total{result="miss"}') > 0


def test_a_prompt_too_long_by_its_length_alone_is_refused_before_tokenizing():
    with RenderServer(qwen3_config()) as srv:  # the fixture's own 40960-token context
        r = srv.client.post("/v1/chat/completions/render", json=chat("x" * 6_000_000), timeout=120)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "input_tokens"
        assert "at least 46875 input tokens" in error["message"]  # 6e6 characters / 128 bytes per token


def test_the_bulk_lane_is_started_and_has_encoded_before_the_first_large_body():
    """A serving process warms the bulk lane at start (cli._uvicorn_server): its thread exists and has run the
    tokenizer's first encode on itself, so the first large render does not pay the encoder's per-thread set-up."""
    from render_service.http.server import WARM_TEXT, create_app, warm_render_lanes

    config = qwen3_config()
    app = create_app(config)
    queue = app.state.server.render_queue
    try:
        assert not queue._bulk._threads  # (the executor starts its thread on the first job)
        done = warm_render_lanes(app)
        assert done.result(timeout=30) == config.tokenizer.encode(WARM_TEXT)
        (started,) = queue._bulk._threads
        lane = asyncio.run(queue.run("chat_render", queue.bulk_bytes, threading.get_ident))
        assert lane == started.ident != threading.get_ident()
    finally:
        queue.shutdown()
