"""/metrics (scraped and parsed with prometheus_client's parser) and structured JSON logs with request ids,
on a real disaggregated stack: a prefill and a decode engine over NIXL, a gateway with two workers."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve_common.logs import JsonFormatter, TextFormatter, request_id_var
from tests.gateway_harness import LOOP_START, write_scripted_qwen3
from tests.ops_harness import start_engine, start_gateway, wait_idle

STREAMS = 3
BATCHES = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("ops-observability")
    model = write_scripted_qwen3(root / "tiny")
    servers = []
    try:
        prefill = start_engine(model, root, "prefill", kv_engine_id="obs-prefill")
        servers.append(prefill)
        decode = start_engine(model, root, "decode", kv_engine_id="obs-decode")
        servers.append(decode)
        prefill.wait_healthy()
        decode.wait_healthy()
        gateway = start_gateway(model, root, "gateway", ["--prefill", prefill.url, "--decode", decode.url],
                                "--workers", "2")
        servers.append(gateway)
        gateway.wait_healthy()
        with httpx.Client(base_url=gateway.url, timeout=120) as http:
            body = {"model": "tiny", "prompt": [LOOP_START], "max_tokens": 6, "temperature": 0}
            for i in range(STREAMS):
                with http.stream("POST", "/v1/completions", json={**body, "stream": True},
                                 headers={"x-request-id": f"trace-stream-{i}"}) as r:
                    assert r.status_code == 200
                    assert r.read().endswith(b"data: [DONE]\n\n")
            for i in range(BATCHES):
                r = http.post("/v1/completions", json=body, headers={"x-request-id": f"trace-batch-{i}"})
                assert r.status_code == 200, r.text
            assert http.post("/v1/completions", json={"model": "tiny", "prompt": 5}).status_code == 400
            assert http.post("/v1/completions/render", json={"model": "tiny", "prompt": "hi"}).status_code == 200
            derender = {"model": "tiny", "token_ids": [9707, 1879], "chat_request": {"messages": []}}
            http.post("/v1/chat/completions/derender", json=derender)
        wait_idle(decode.url)
        wait_idle(prefill.url)
        yield {"prefill": prefill, "decode": decode, "gateway": gateway}
    finally:
        for s in reversed(servers):
            s.stop()


def scrape(url: str) -> dict[str, list]:
    """{sample name: [(labels, value)]} of one /metrics scrape, through prometheus_client's parser."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(samples: dict[str, list], name: str, **labels: str) -> float:
    assert name in samples, f"{name} missing from /metrics"
    return sum(v for lab, v in samples[name] if all(lab.get(k) == want for k, want in labels.items()))


def test_decode_engine_exports_vllm_latency_request_and_kv_transfer_metrics(stack):
    m = scrape(stack["decode"].url)
    requests = STREAMS + BATCHES
    assert total(m, "vllm:time_to_first_token_seconds_count") == requests
    assert total(m, "vllm:e2e_request_latency_seconds_count") == requests
    assert total(m, "vllm:inter_token_latency_seconds_count") > 0
    assert total(m, "vllm:request_success_total") == requests
    assert total(m, "vllm:generation_tokens_total") == requests * 6
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert 0 <= total(m, gauge) <= (1 if gauge.endswith("perc") else 16)
    # Every decode pulled its prompt's KV over NIXL: one timed READ per request, with bytes.
    assert total(m, "vllm:nixl_xfer_time_seconds_count") == requests
    assert total(m, "vllm:nixl_bytes_transferred_sum") > 0
    failures = "vllm:nixl_num_failed_transfers_total"  # labelled by reason: absent until one happens
    assert failures not in m or total(m, failures) == 0


def test_prefill_engine_counts_its_one_token_requests(stack):
    m = scrape(stack["prefill"].url)
    assert total(m, "vllm:request_success_total") == STREAMS + BATCHES
    assert total(m, "vllm:prompt_tokens_total") == STREAMS + BATCHES  # one-token prompts


def test_gateway_metrics_sum_both_workers_by_endpoint_and_status(stack):
    m = scrape(stack["gateway"].url)
    name = "splitserve_render_requests_total"
    assert total(m, name, endpoint="completions", status="200") == STREAMS + BATCHES
    assert total(m, name, endpoint="completions", status="400") == 1
    assert total(m, name, endpoint="completion_render", status="200") == 1
    assert total(m, "splitserve_render_latency_seconds_count", endpoint="completion_render") == 1
    assert "splitserve_derender_latency_seconds_count" in m or total(m, name, endpoint="chat_derender") == 1
    assert total(m, "splitserve_gateway_time_to_first_token_seconds_count", endpoint="completions") == STREAMS
    assert total(m, "splitserve_gateway_e2e_request_latency_seconds_count", endpoint="completions") == \
        STREAMS + BATCHES


def test_every_log_line_is_one_json_object_with_the_standard_keys(stack):
    for server in stack.values():
        records = server.log_records()
        assert records
        for rec in records:
            assert {"ts", "level", "logger", "msg", "request_id"} <= set(rec)
            assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", rec["ts"])


def test_client_request_id_is_echoed_and_carried_to_the_engines(stack):
    gateway_access = [r for r in stack["gateway"].log_records() if r["logger"] == "splitserve.access"]
    line = next(r for r in gateway_access if r["request_id"] == "trace-batch-0")
    assert line["path"] == "/v1/completions" and line["status"] == 200 and line["duration_ms"] > 0
    for engine in ("prefill", "decode"):
        ids = {r["request_id"] for r in stack[engine].log_records() if r["logger"] == "splitserve.access"}
        assert any(rid and "trace-batch-0" in rid for rid in ids), ids
    r = httpx.get(stack["gateway"].url + "/v1/models", headers={"x-request-id": "trace-models"}, timeout=30)
    assert r.headers["x-request-id"] == "trace-models"


def test_missing_or_unsafe_request_id_is_replaced_by_a_fresh_one(stack):
    for headers in ({}, {"x-request-id": "x" * 500}, {"x-request-id": "a b\tc"}):
        r = httpx.get(stack["decode"].url + "/v1/models", headers=headers, timeout=30)
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


def test_json_formatter_carries_extra_fields_exceptions_and_the_context_request_id():
    record = logging.LogRecord("splitserve.test", logging.WARNING, __file__, 1, "%d tokens", (7,), None)
    record.replica = "http://decode:8000"
    token = request_id_var.set("req-9")
    try:
        entry = json.loads(JsonFormatter().format(record))
        assert TextFormatter().format(record).endswith("[request_id=req-9]")
    finally:
        request_id_var.reset(token)
    assert entry["msg"] == "7 tokens" and entry["level"] == "warning" and entry["request_id"] == "req-9"
    assert entry["replica"] == "http://decode:8000"
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        failing = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "ValueError: boom" in json.loads(JsonFormatter().format(failing))["exc_info"]


def test_every_server_publishes_its_openapi_document(stack):
    gateway = httpx.get(stack["gateway"].url + "/openapi.json", timeout=30).json()
    assert {"/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"} <= set(gateway["paths"])
    engine = httpx.get(stack["decode"].url + "/openapi.json", timeout=30).json()
    assert "/inference/v1/generate" in engine["paths"] and engine["openapi"].startswith("3.1")
