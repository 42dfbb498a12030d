"""Prometheus counters of the gateway (the render server's /metrics exposes them, summed over workers)."""

from __future__ import annotations

from prometheus_client import Counter

RETRIES = Counter("splitserve_gateway_engine_retries_total",
                  "Engine calls retried on another replica before the first token.")
ENGINE_FAILURES = Counter("splitserve_gateway_engine_failures_total",
                          "Engine calls that failed (refused, dropped, broke mid-stream), by pool.", ["pool"])
ABORTS = Counter("splitserve_gateway_engine_aborts_total",
                 "Engine requests aborted by the gateway (stop string matched or client gone).")
STREAM_ERRORS = Counter("splitserve_gateway_stream_errors_total",
                        "Responses that failed after their first event (error event or 502).")
SLOW_CLIENT_WAITS = Counter("splitserve_gateway_slow_client_waits_total",
                            "Times a streaming client fell behind: its engine stream was paused until it caught up.")
RENDER_ENGINE_MISMATCHES = Counter(
    "splitserve_gateway_render_engine_mismatch_total",
    "Engine responses whose prompt token count differs from the ids render produced for the request "
    "(something between render and the engine changed the prompt; prefix-cache routing then misses).")
PD_DECISIONS = Counter("splitserve:gateway_pd_decisions_total",
                       "Disaggregated requests by the path taken: pull (prefill, then decode), push (both legs "
                       "at once) or decode_only (few uncached prompt tokens: conditional disaggregation).", ["path"])
