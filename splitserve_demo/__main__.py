"""``make demo``: start the whole stack on the built-in default model and show what it is for.

1. Builds (once, then cached) the render tier's default bundle (Qwen3's real tokenizer, our chat template, a
   tiny Qwen3-architecture config) and a copy whose weights are constructed so that greedy decoding answers the
   demo's prompt with a scripted reply: reasoning, a sentence, a tool call (splitserve_demo/scripted_model.py).
2. Starts a tokens-only engine (``token-engine serve``) and the render tier with the gateway attached
   (``render-service serve --engine URL``), each a subprocess on a free loopback port.
3. Shows the split calls one by one: /render (chat -> token IDs), the engine's /inference/v1/generate (token
   IDs -> token IDs), /derender (token IDs -> a message with reasoning, content and a parsed tool call); then
   the same chat through the gateway in one call, batch and streamed.
The weights are constructed, not trained: the answer is scripted; the token IDs, the engine's forward passes,
the parsing and the wire are real. ``--model-dir`` points it at a real model directory or Hugging Face id.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SERVED_NAME = "qwen3-tiny"
PARSER_FLAGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather and today's forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather like in Paris today?"},
    ],
    "tools": [WEATHER_TOOL],
    "max_tokens": 64,
    "temperature": 0,
}
REAL_MODEL_HINT = """\
The default model's weights are constructed, not trained (splitserve_demo/scripted_model.py): it answers this
one prompt with a scripted reply and anything else with noise. To run the same demo on a real model:
  .venv/bin/python -m splitserve_demo --model-dir /path/to/Qwen3-0.6B     # a model directory
  .venv/bin/python -m splitserve_demo --model-dir Qwen/Qwen3-0.6B         # a Hugging Face id (from the HF cache,
                                                                            or downloaded where the hub is reachable)
The README's "Running the whole stack" starts the servers by hand."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(name: str, client: httpx.Client, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited early with status {proc.returncode}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{name} not healthy after {timeout_s:.0f}s")


def show(title: str, value: object) -> None:
    print(f"\n=== {title}")
    print(json.dumps(value, indent=2, ensure_ascii=False) if not isinstance(value, str) else value)


def start(name: str, command: list[str]) -> subprocess.Popen:
    print(f"starting {name}:", " ".join(command), flush=True)
    return subprocess.Popen(command)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def show_split_calls(client: httpx.Client, engine: httpx.Client | None, model: str) -> None:
    rendered = client.post("/v1/chat/completions/render", json={"model": model, **CHAT})
    rendered.raise_for_status()
    generate_request = rendered.json()
    prompt_ids = generate_request["token_ids"]
    prompt_text = client.post("/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    show("1. render: chat + tools -> GenerateRequest (what the engine receives)", {
        "request_id": generate_request["request_id"],
        "token_ids": f"{len(prompt_ids)} ids: {prompt_ids[:8]} ... {prompt_ids[-4:]}",
        "prompt_text (detokenized, the end)": "..." + prompt_text[-160:],
        "sampling_params": generate_request["sampling_params"],
    })
    if engine is None:
        return
    generated = engine.post("/inference/v1/generate", json=generate_request)
    generated.raise_for_status()
    generate_response = generated.json()
    choice = generate_response["choices"][0]
    show("2. generate: token ids -> token ids (the engine never sees text)", {
        "request_id": generate_response["request_id"],
        "choices": [{"token_ids": f"{len(choice['token_ids'])} ids: {choice['token_ids']}",
                     "finish_reason": choice["finish_reason"]}],
    })
    derendered = client.post("/v1/chat/completions/derender", json={
        "model": model,
        "generate_response": generate_response,
        "prompt_tokens": len(prompt_ids),
        "prompt_token_ids": prompt_ids,
        "chat_request": {"model": model, **CHAT},
        "render_fingerprint": generate_request["render_fingerprint"],
    })
    derendered.raise_for_status()
    show("3. derender: token ids -> chat message (reasoning split out, tool call parsed)",
         derendered.json()["choices"][0])


def show_gateway(client: httpx.Client, model: str) -> None:
    body = {"model": model, **CHAT}
    completion = client.post("/v1/chat/completions", json=body)
    completion.raise_for_status()
    show("gateway: POST /v1/chat/completions (render -> engine -> derender in one call)", completion.json())

    events: list[dict] = []
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        stream.raise_for_status()
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    deltas = [e["choices"][0] for e in events if e.get("choices")]
    reasoning = "".join(d["delta"].get("reasoning") or "" for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    tool_deltas = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    show(f"gateway: the same request streamed ({len(events)} SSE events, then data: [DONE]); the deltas joined", {
        "reasoning": reasoning,
        "content": content,
        "tool_calls (deltas)": tool_deltas,
        "finish_reason": next((d["finish_reason"] for d in reversed(deltas) if d.get("finish_reason")), None),
        "usage": next((e["usage"] for e in reversed(events) if e.get("usage")), None),
    })


def prepare_model(model_dir: str | None) -> tuple[str, bool]:
    """The model directory to serve, and whether its weights are the demo's constructed ones."""
    if model_dir is not None:
        from splitserve_common.hf_cache import resolve_model

        return resolve_model(model_dir).directory, False
    from splitserve_demo.scripted_model import write_scripted_model

    print("preparing the built-in default model (built once, then cached) ...", flush=True)
    bundle = subprocess.run([sys.executable, "-m", "render_service.bundle.default_bundle", "--print-path"],
                            check=True, capture_output=True, text=True).stdout.strip()
    return str(write_scripted_model(Path(bundle))), True


def run(model_dir: str | None, timeout_s: float) -> None:
    model_dir, constructed = prepare_model(model_dir)
    if constructed:
        print("this model's weights are CONSTRUCTED, not trained: its answer to the demo's prompt is scripted",
              flush=True)
    has_weights = any(Path(model_dir).glob("*.safetensors"))
    engine_port, gateway_port = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    gateway_flags: list[str] = []
    engine_client: httpx.Client | None = None
    try:
        if has_weights:
            engine = start("engine", [sys.executable, "-m", "token_engine.cli", "serve", model_dir, "--device", "cpu",
                                      "--host", "127.0.0.1", "--port", str(engine_port), "--log-level", "warning",
                                      "--served-model-name", SERVED_NAME])
            procs.append(engine)
            engine_client = httpx.Client(base_url=f"http://127.0.0.1:{engine_port}", timeout=120)
            wait_healthy("engine", engine_client, engine, timeout_s)
            gateway_flags = ["--engine", f"http://127.0.0.1:{engine_port}"]
        else:
            print(f"{model_dir} has no weights: starting the render tier alone", flush=True)
        render = start("render tier", [sys.executable, "-m", "render_service.cli", "serve", model_dir,
                                       "--host", "127.0.0.1", "--port", str(gateway_port), "--log-level", "warning",
                                       "--served-model-name", SERVED_NAME, *PARSER_FLAGS, *gateway_flags])
        procs.append(render)
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway_port}", timeout=120) as client:
            wait_healthy("render tier", client, render, timeout_s)
            model = client.get("/v1/models").json()["data"][0]["id"]
            show_split_calls(client, engine_client, model)
            if has_weights:
                show_gateway(client, model)
    finally:
        if engine_client is not None:
            engine_client.close()
        for proc in reversed(procs):
            stop(proc)
    if constructed:
        print("\n" + REAL_MODEL_HINT)
    print("\nall servers stopped.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None,
                        help="a model directory or Hugging Face id (default: the built-in one, weights constructed "
                             "to answer the demo's prompt); without weights only the render tier starts")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each server to start")
    args = parser.parse_args(argv)
    run(args.model_dir, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
