"""Prometheus metrics of one engine, under vLLM's names where vLLM has the metric.

Each engine owns its registry (several engines can live in one test process)."""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Sequences in the running batch.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", labels, registry=r)
        self.free_blocks = Gauge("splitserve:kv_cache_free_blocks", "Free (or evictable) KV blocks.", labels,
                                 registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                   registry=r)
        self.external_queries = Counter("vllm:external_prefix_cache_queries",
                                        "Prompt tokens looked up past the device cache (host tier, P/D peer).",
                                        labels, registry=r)
        self.external_hits = Counter("vllm:external_prefix_cache_hits",
                                     "Prompt tokens found past the device cache (host tier, P/D peer).", labels,
                                     registry=r)
        self.cached_tokens = Counter("vllm:prompt_tokens_cached", "Prompt tokens served from any cache tier.",
                                     labels, registry=r)
        self.cached_by_source = Counter("vllm:prompt_tokens_cached_by_source",
                                        "Prompt tokens served at admission, by the tier that held them "
                                        "(device, host, p2p, disk, external_unspecified).", labels + ["source"],
                                        registry=r)
        # The host offload tier (vLLM's OffloadingConnector metrics).
        self.offload_usage = Gauge("vllm:kv_offload_cpu_cache_usage_perc", "Host KV tier usage (1 = full).", labels,
                                   registry=r)
        self.offload_load_bytes = Counter("vllm:kv_offload_load_bytes", "Bytes loaded from the host tier.", labels,
                                          registry=r)
        self.offload_load_time = Counter("vllm:kv_offload_load_time", "Seconds spent loading from the host tier.",
                                         labels, registry=r)
        self.offload_store_bytes = Counter("vllm:kv_offload_store_bytes", "Bytes stored to the host tier.", labels,
                                           registry=r)
        self.offload_store_time = Counter("vllm:kv_offload_store_time", "Seconds spent storing to the host tier.",
                                          labels, registry=r)
        self.kv_events_published = Counter("splitserve:kv_events_published",
                                           "KV events (block stored/removed, all cleared) sent to routers.", labels,
                                           registry=r)
        self.kv_event_batches_dropped = Counter("splitserve:kv_event_batches_dropped",
                                                "KV event batches dropped on a full publisher queue.", labels,
                                                registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted (recomputed later).", labels,
                                   registry=r)
        # Where a step's time goes: `model` runs from the forward's launch to the sampled tokens on the host
        # (GPU time included); `schedule` and `bookkeeping` are host work; `idle` is loop time between steps.
        self.step_phase = Histogram("splitserve:engine_step_phase_seconds", "Time of one engine step, by phase.",
                                    labels + ["phase"], buckets=_STEP_BUCKETS, registry=r)
        self.model_name = model_name
        # Children for the per-token hot path (labels() takes a lock and a dict lookup per call).
        self.ttft_l = self.label(self.ttft)
        self.itl_l = self.label(self.itl)
        self.e2e_l = self.label(self.e2e)
        self.generation_tokens_l = self.label(self.generation_tokens)

    def label(self, metric: M, **extra: str) -> M:
        """The metric's child for this model (and `extra` labels)."""
        return metric.labels(model_name=self.model_name, **extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)
