"""Serving metrics with ``vllm bench serve``'s definitions and result keys.

TTFT: request sent -> first streamed token. ITL: gap between consecutive streamed chunks that carry tokens.
TPOT: (latency - TTFT) / (output tokens - 1), per request. E2EL: request sent -> stream closed. Goodput counts
the requests that meet every SLO given (``--goodput ttft:MS tpot:MS e2el:MS``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
METRIC_HEADERS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclasses.dataclass
class RequestOutput:
    """What one streamed request measured (seconds)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""
    turn: int = 1


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); raises ValueError."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput wants ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        ms = float(value)
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput {name} must be a positive number of milliseconds, got {value!r}")
        slos[name] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles wants numbers in (0, 100], got {text!r}")
    return values


def percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats(values: list[float], percentiles: list[float]) -> dict:
    """mean/median/std and percentiles in milliseconds; an empty list counts as 0 (as vLLM does)."""
    data = values or [0.0]
    out = {"mean": float(np.mean(data)) * 1e3, "median": float(np.median(data)) * 1e3,
           "std": float(np.std(data)) * 1e3}
    for p in percentiles:
        out[f"p{percentile_key(p)}"] = float(np.percentile(data, p)) * 1e3
    return out


def request_tpot(out: RequestOutput) -> float:
    return (out.latency - out.ttft) / (out.output_tokens - 1) if out.output_tokens > 1 else 0.0


def calculate_metrics(outputs: list[RequestOutput], duration_s: float, percentiles: list[float],
                      selected: list[str], goodput: dict[str, float]) -> dict:
    """The aggregate part of vLLM's result JSON (the per-request lists are added by the caller)."""
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(output_lens)
    good = 0
    for o in ok:
        measured = {"ttft": o.ttft, "tpot": request_tpot(o), "e2el": o.latency}
        if all(measured[name] <= ms / 1e3 for name, ms in goodput.items()):
            good += 1
    peak_tokens_per_s, peak_concurrency = _peaks(ok)
    result = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "request_goodput": (good / duration_s if duration_s > 0 else 0.0) if goodput else None,
        "output_throughput": total_output / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration_s if duration_s > 0 else 0.0,
        "max_output_tokens_per_s": peak_tokens_per_s,
        "max_concurrent_requests": peak_concurrency,
    }
    series = {
        "ttft": [o.ttft for o in ok],
        "tpot": [request_tpot(o) for o in ok if o.output_tokens > 1],
        "itl": [gap for o in ok for gap in o.itl],
        "e2el": [o.latency for o in ok],
    }
    for name in ("ttft", "tpot", "itl", "e2el"):
        if name not in selected:
            continue
        stats = _stats(series[name], percentiles)
        result[f"mean_{name}_ms"] = stats["mean"]
        result[f"median_{name}_ms"] = stats["median"]
        result[f"std_{name}_ms"] = stats["std"]
        for p in percentiles:
            key = f"p{percentile_key(p)}"
            result[f"{key}_{name}_ms"] = stats[key]
    return result


def _peaks(ok: list[RequestOutput]) -> tuple[float, int]:
    """Most tokens finished in one wall-clock second, and most requests in flight in one second."""
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    seconds = int(math.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1
    tokens = np.zeros(seconds)
    active = np.zeros(seconds)
    for o in ok:
        t = o.start_time + o.ttft
        stamps = [t]
        for gap in o.itl:
            t += gap
            stamps.append(t)
        for s in stamps:
            tokens[min(int(s - t0), seconds - 1)] += 1
        active[int(o.start_time - t0): int(o.start_time + o.latency - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


def ttft_by_turn(outputs: list[RequestOutput], percentiles: list[float]) -> dict:
    """Multi-turn mode: TTFT statistics for each turn number (ms)."""
    turns = sorted({o.turn for o in outputs})
    table = {}
    for turn in turns:
        ok = [o for o in outputs if o.turn == turn and o.success]
        stats = _stats([o.ttft for o in ok], percentiles)
        table[str(turn)] = {"completed": len(ok), "mean_ttft_ms": stats["mean"], "median_ttft_ms": stats["median"],
                            **{f"p{percentile_key(p)}_ttft_ms": stats[f"p{percentile_key(p)}"] for p in percentiles}}
    return table


def format_summary(result: dict, selected: list[str], percentiles: list[float]) -> str:
    """The end-of-run table, laid out like vllm bench serve's."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value, fmt: str = "{:<10.2f}") -> None:
        lines.append(f"{label:<40} " + (fmt.format(value) if value is not None else "n/a"))

    row("Successful requests:", result["completed"], "{:<10}")
    row("Failed requests:", result["failed"], "{:<10}")
    row("Request rate configured (RPS):", result.get("request_rate"), "{:<10}")
    row("Maximum request concurrency:", result.get("max_concurrency"), "{:<10}")
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", result["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"], "{:<10}")
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        if name not in selected:
            continue
        lines.append("{s:{c}^{n}}".format(s=METRIC_HEADERS[name], n=50, c="-"))
        row(f"Mean {METRIC_NAMES[name]} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {METRIC_NAMES[name]} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            key = percentile_key(p)
            row(f"P{key} {METRIC_NAMES[name]} (ms):", result[f"p{key}_{name}_ms"])
    if result.get("ttft_by_turn"):
        lines.append("{s:{c}^{n}}".format(s="TTFT by turn", n=50, c="-"))
        for turn, stats in result["ttft_by_turn"].items():
            row(f"Turn {turn} median / mean TTFT (ms):", f"{stats['median_ttft_ms']:.2f} / {stats['mean_ttft_ms']:.2f}",
                "{:<10}")
    lines.append("=" * 50)
    return "\n".join(lines)
