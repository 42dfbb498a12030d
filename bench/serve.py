"""``splitserve-bench serve``: an online serving benchmark that speaks ``vllm bench serve``'s language.

Requests go to an OpenAI endpoint (/v1/completions or /v1/chat/completions) with ``stream: true`` and
``stream_options.include_usage``; arrivals follow a gamma process at ``--request-rate`` (burstiness 1 is
Poisson; ``inf`` sends everything at once), bounded by ``--max-concurrency``. The result JSON carries the
same keys as vLLM's, so their tooling reads ours and the reverse.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

from bench.datasets import SampleRequest
from bench.metrics import RequestOutput, calculate_metrics, format_summary, ttft_by_turn
from bench.portable import write_result

COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclasses.dataclass
class ServeRun:
    """Everything one benchmark run needs; one run is one request rate."""

    base_url: str
    model: str
    requests: list[SampleRequest]
    endpoint: str = COMPLETIONS_ENDPOINT
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    seed: int = 0
    multi_turn: int = 1
    percentiles: list[float] = dataclasses.field(default_factory=lambda: [99.0])
    selected_metrics: list[str] = dataclasses.field(default_factory=lambda: ["ttft", "tpot", "itl"])
    goodput: dict[str, float] = dataclasses.field(default_factory=dict)
    label: str | None = None
    tokenizer_id: str | None = None
    extra_body: dict = dataclasses.field(default_factory=dict)
    show_progress: bool = True
    timeout_s: float = 600.0

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate."""
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = np.random.RandomState(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request starts the clock
    return [float(g) for g in gaps]


def request_body(run: ServeRun, prompt_or_messages, max_tokens: int) -> dict:
    body = {"model": run.model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens}
    if run.chat:
        body["messages"] = prompt_or_messages
    else:
        body["prompt"] = prompt_or_messages
    if run.ignore_eos:
        body["ignore_eos"] = True
    body.update(run.extra_body)
    return body


async def stream_one(client: httpx.AsyncClient, run: ServeRun, payload: dict, prompt_len: int,
                     turn: int = 1) -> RequestOutput:
    """Sends one streaming request and times its chunks the way vLLM's client does: the first chunk
    with choices is the first token, each later one adds an inter-token gap."""
    out = RequestOutput(prompt_len=prompt_len, turn=turn)
    text: list[str] = []
    usage = None
    start = time.perf_counter()
    out.start_time = start
    last = start
    try:
        async with client.stream("POST", run.endpoint, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {body[:500]}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])[:500]
                    return out
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                if out.ttft == 0.0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                first = choices[0]
                if run.chat:
                    delta = first.get("delta") or {}
                    text.append(delta.get("content") or "")
                else:
                    text.append(first.get("text") or "")
        out.latency = time.perf_counter() - start
        out.generated_text = "".join(text)
        if usage:
            out.output_tokens = int(usage.get("completion_tokens") or 0)
            # the server's count includes the chat template, which the dataset's count cannot know
            out.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
        else:
            out.output_tokens = len(out.itl) + 1 if out.ttft else 0
        out.success = out.ttft > 0.0
        if not out.success:
            out.error = "stream ended without a token"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:500]
        out.latency = time.perf_counter() - start
    return out


async def run_conversation(client: httpx.AsyncClient, run: ServeRun, req: SampleRequest,
                           progress) -> list[RequestOutput]:
    """One request, or in multi-turn mode a conversation whose turns go one after another, each carrying
    the previous answers (so turn k>1 can hit the engine's prefix cache)."""
    if not run.chat:
        out = await stream_one(client, run, request_body(run, req.prompt, req.expected_output_len), req.prompt_len)
        progress.update(1)
        return [out]
    messages: list[dict] = []
    outputs = []
    for turn, user_text in enumerate((req.turns or [req.prompt])[: max(run.multi_turn, 1)], start=1):
        messages.append({"role": "user", "content": user_text})
        out = await stream_one(client, run, request_body(run, list(messages), req.expected_output_len),
                               req.prompt_len, turn)
        outputs.append(out)
        progress.update(1)
        if not out.success:
            progress.update(max(run.multi_turn, 1) - turn)
            break
        messages.append({"role": "assistant", "content": out.generated_text})
    return outputs


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit="req")


async def benchmark(run: ServeRun) -> dict:
    """Runs the requests and returns vLLM's result dictionary (plus ``ttft_by_turn`` in multi-turn mode)."""
    turns = max(run.multi_turn, 1) if run.chat else 1
    limits = httpx.Limits(max_connections=run.max_concurrency or len(run.requests) or 1, max_keepalive_connections=64)
    gate = asyncio.Semaphore(run.max_concurrency) if run.max_concurrency else None
    delays = arrival_delays(len(run.requests), run.request_rate, run.burstiness, run.seed)
    progress = _progress(len(run.requests) * turns, run.show_progress, f"rate {run.request_rate}")

    async def one(client: httpx.AsyncClient, req: SampleRequest) -> list[RequestOutput]:
        if gate is None:
            return await run_conversation(client, run, req, progress)
        async with gate:
            return await run_conversation(client, run, req, progress)

    async with httpx.AsyncClient(base_url=run.base_url, timeout=httpx.Timeout(run.timeout_s), limits=limits) as client:
        tasks = []
        started = time.perf_counter()
        for req, gap in zip(run.requests, delays):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, req)))
        nested = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    progress.close()
    outputs = [o for group in nested for o in group]
    metrics = calculate_metrics(outputs, duration, run.percentiles, run.selected_metrics, run.goodput)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if run.chat else "openai",
        "backend": "openai-chat" if run.chat else "openai",
        "label": run.label,
        "model_id": run.model,
        "tokenizer_id": run.tokenizer_id,
        "num_prompts": len(run.requests),
        "request_rate": run.request_rate if not math.isinf(run.request_rate) else "inf",
        "burstiness": run.burstiness,
        "max_concurrency": run.max_concurrency,
        **metrics,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time - started for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    if turns > 1:
        result["multi_turn"] = turns
        result["turns"] = [o.turn for o in outputs]
        result["ttft_by_turn"] = ttft_by_turn(outputs, run.percentiles)
    if run.goodput:
        result["goodput_config"] = run.goodput
    return result


def run_benchmark(run: ServeRun) -> dict:
    return asyncio.run(benchmark(run))


def default_result_filename(result: dict) -> str:
    """vLLM's pattern: {backend}-{rate}qps-concurrency{N}-{model}-{date}.json"""
    model = str(result["model_id"]).split("/")[-1]
    concurrency = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] is not None else ""
    label = result["label"] or result["backend"]
    return f"{label}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"


def save_result(result: dict, result_dir: str | Path, filename: str | None) -> Path:
    path = Path(result_dir or ".") / (filename or default_result_filename(result))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, result)
    return path


def summary(result: dict, run: ServeRun) -> str:
    return format_summary(result, run.selected_metrics, run.percentiles)
