"""Gateway latency as the client sees it, measured at the ASGI boundary (the ops middleware's timing hook).

The gateway answers a stream only once the engine's first token is in (so earlier failures keep their
HTTP status): the time to the response start of a streaming request is its time to first token, and the
end of the body is the end of the request. Created on first use, after the CLI has chosen the
multiprocess directory, so pre-forked workers' observations are summed on /metrics.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

# Paths of the gateway's two generation routes -> the endpoint label.
GATEWAY_ENDPOINTS = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions"}
_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0)


@lru_cache(maxsize=1)
def gateway_histograms() -> tuple[Any, Any]:
    from prometheus_client import Histogram

    ttft = Histogram("splitserve_gateway_time_to_first_token_seconds",
                     "Gateway: request arrival to the first streamed event (streaming requests).",
                     ["endpoint"], buckets=_BUCKETS)
    e2e = Histogram("splitserve_gateway_e2e_request_latency_seconds",
                    "Gateway: request arrival to the last byte of a successful response.", ["endpoint"],
                    buckets=_BUCKETS)
    return ttft, e2e


class GatewayLatency:
    """splitserve_common.lifecycle.RequestTiming for the gateway's generation routes."""

    def endpoint(self, path: str) -> str | None:
        return GATEWAY_ENDPOINTS.get(path)

    def stream_started(self, endpoint: str, seconds: float) -> None:
        gateway_histograms()[0].labels(endpoint).observe(seconds)

    def finished(self, endpoint: str, seconds: float) -> None:
        gateway_histograms()[1].labels(endpoint).observe(seconds)
