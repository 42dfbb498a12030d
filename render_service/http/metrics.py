"""Prometheus metrics of the render server.

With several worker processes each one counts into its own files under PROMETHEUS_MULTIPROC_DIR
(set by the CLI before workers start) and /metrics sums them, so a scrape that lands on any worker
sees the whole server.
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE_LATEST  # re-exported for the server
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Render of a 9k-token prompt takes a few ms; derender of long outputs tens of ms.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

REQUESTS = Counter(
    "splitserve_render_requests_total", "HTTP requests answered by the render server.", ["endpoint", "status"]
)
RENDER_LATENCY = Histogram(
    "splitserve_render_latency_seconds", "Time to answer a render request (chat or completions).",
    ["endpoint"], buckets=LATENCY_BUCKETS,
)
DERENDER_LATENCY = Histogram(
    "splitserve_derender_latency_seconds", "Time to answer a derender request (chat or completions).",
    ["endpoint"], buckets=LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("splitserve_render_prompt_tokens_total", "Prompt tokens produced by render.")
COMPLETION_TOKENS = Counter("splitserve_derender_completion_tokens_total", "Output tokens turned into text.")

# Saturation (render_queue.py): what waits, what runs, how long each render's own work takes.
RENDER_QUEUE_DEPTH = Gauge("splitserve_render_queue_depth", "Render requests waiting for a render thread.",
                           multiprocess_mode="livesum")
RENDER_IN_FLIGHT = Gauge("splitserve_render_in_flight", "Render requests being rendered now.",
                         multiprocess_mode="livesum")
RENDER_QUEUE_WAIT = Histogram("splitserve_render_queue_wait_seconds",
                              "Time a render request waited for a render thread.", buckets=LATENCY_BUCKETS)
RENDER_WORK = Histogram("splitserve_render_work_seconds",
                        "Time of one request's render work (decode, template, tokenize, encode), queueing excluded.",
                        ["endpoint"], buckets=LATENCY_BUCKETS)
RENDER_REJECTED = Counter("splitserve_render_rejected_total", "Render requests refused with 429.", ["reason"])
# The prompt caches (tokenize/incremental_tokenizer.py, tokenize/prompt_prefix_store.py), in tokens: hit / (hit + miss)
# is the share not tokenized.
PROMPT_CACHE_TOKENS = Counter("splitserve_render_prompt_cache_tokens_total",
                              "Prompt tokens served from the render cache (a piece or a stored prompt's head: hit) or "
                              "tokenized (miss).", ["result"])

# vLLM 0.34's name beside ours, so dashboards and routers written for vLLM's render server read us unchanged.
# vLLM's request_type: "chat" (Messages and Responses render through chat) or "completion".
VLLM_RENDER_DURATION = Histogram(
    "vllm:request_render_duration_seconds",
    "Time spent rendering a request, including chat templating and tokenization.",
    ["model_name", "request_type"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
VLLM_REQUEST_TYPES = {"chat_render": "chat", "chat_completions": "chat", "messages_render": "chat",
                      "responses_render": "chat", "completion_render": "completion", "completions": "completion"}
_model_name = ""


def set_model_name(name: str) -> None:
    """The served model name vLLM's metrics carry as ``model_name``."""
    global _model_name
    _model_name = name
    _vllm_children.clear()


_request_children: dict[tuple[str, int], Counter] = {}
_vllm_children: dict[str, Histogram] = {}
_work_children: dict[str, Histogram] = {}


def observe_render_work(endpoint: str, seconds: float) -> None:
    child = _work_children.get(endpoint)
    if child is None:
        child = _work_children[endpoint] = RENDER_WORK.labels(endpoint=endpoint)
    child.observe(seconds)
    vllm_child = _vllm_children.get(endpoint)
    if vllm_child is None:
        request_type = VLLM_REQUEST_TYPES.get(endpoint)
        if request_type is None:
            return
        vllm_child = _vllm_children[endpoint] = VLLM_RENDER_DURATION.labels(_model_name, request_type)
    vllm_child.observe(seconds)


_PROMPT_CACHE_HIT = PROMPT_CACHE_TOKENS.labels(result="hit")
_PROMPT_CACHE_MISS = PROMPT_CACHE_TOKENS.labels(result="miss")


def observe_prompt_cache(hit_tokens: int, miss_tokens: int) -> None:
    if hit_tokens:
        _PROMPT_CACHE_HIT.inc(hit_tokens)
    if miss_tokens:
        _PROMPT_CACHE_MISS.inc(miss_tokens)


def observe_request(endpoint: str, status: int, seconds: float) -> None:
    key = (endpoint, status)
    child = _request_children.get(key)
    if child is None:
        child = _request_children[key] = REQUESTS.labels(endpoint=endpoint, status=str(status))
    child.inc()
    if status == 200:
        if "derender" in endpoint:
            DERENDER_LATENCY.labels(endpoint=endpoint).observe(seconds)
        elif "render" in endpoint:
            RENDER_LATENCY.labels(endpoint=endpoint).observe(seconds)


def render_metrics() -> bytes:
    """Prometheus text exposition, aggregated over worker processes when there are several."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest()
