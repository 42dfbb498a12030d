"""``make demo``: start the whole stack on the built-in default model and send it requests.

1. Builds (once, then cached) the render tier's default bundle (Qwen3's real tokenizer, our chat template,
   a tiny Qwen3-architecture config), then asks the engine's CLI for a copy with random weights.
2. Starts a tokens-only engine (``token-engine serve``) and the render tier with the gateway attached
   (``render-service serve --engine URL``), each a subprocess on a free loopback port.
3. Shows each hop on its own: /render (chat -> token IDs), /derender (a reply's token IDs -> a chat message
   with reasoning split out), then one chat completion through the gateway, batch and streamed.
The model's weights are random, so its words are noise; the token IDs, the parsing and the wire are real.
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
CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the capital of Korea?"},
    ],
    "max_tokens": 64,
}
# What a trained model might answer; the demo tokenizes it, as an engine would produce it, and derenders it.
REPLY = ("<think>\nThe user asks for the capital of South Korea. That is Seoul.\n</think>\n\n"
         "The capital of South Korea is Seoul.")


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


def show_render_and_derender(client: httpx.Client, model: str) -> None:
    rendered = client.post("/v1/chat/completions/render", json={"model": model, **CHAT})
    rendered.raise_for_status()
    generate_request = rendered.json()
    prompt_ids = generate_request["token_ids"]
    prompt_text = client.post("/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    show("render: chat -> GenerateRequest (what the engine receives)", {
        "request_id": generate_request["request_id"],
        "token_ids": f"{len(prompt_ids)} ids: {prompt_ids[:8]} ... {prompt_ids[-4:]}",
        "prompt_text": prompt_text,
        "sampling_params": generate_request["sampling_params"],
        "render_fingerprint": generate_request["render_fingerprint"],
    })

    reply_ids = client.post("/tokenize", json={"prompt": REPLY}).json()["tokens"]
    eos = generate_request["sampling_params"]["stop_token_ids"][:1]
    derendered = client.post("/v1/chat/completions/derender", json={
        "model": model,
        "generate_response": {
            "request_id": f"generate-tokens-{generate_request['request_id']}",
            "choices": [{"index": 0, "token_ids": reply_ids + eos, "finish_reason": "stop"}],
        },
        "prompt_tokens": len(prompt_ids),
        "prompt_token_ids": prompt_ids,
        "chat_request": {"model": model, **CHAT},
        "render_fingerprint": generate_request["render_fingerprint"],
    })
    derendered.raise_for_status()
    show(f"derender: {len(reply_ids) + len(eos)} output token ids -> chat completion", derendered.json())


def show_gateway(client: httpx.Client, model: str) -> None:
    body = {"model": model, **CHAT, "max_tokens": 16, "temperature": 0}
    completion = client.post("/v1/chat/completions", json=body)
    completion.raise_for_status()
    show("gateway: POST /v1/chat/completions (render -> engine -> derender in one call)", completion.json())

    pieces: list[str] = []
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        stream.raise_for_status()
        for line in stream.iter_lines():
            if line.startswith("data: "):
                pieces.append(line)
    show(f"gateway: the same request streamed ({len(pieces)} SSE events; first two and last two)",
         "\n".join(pieces[:2] + ["..."] + pieces[-2:]))


def run(model_dir: str | None, timeout_s: float) -> None:
    if model_dir is None:
        print("preparing the built-in default model (built once, then cached) ...", flush=True)
        bundle = subprocess.run([sys.executable, "-m", "render_service.default_bundle", "--print-path"],
                                check=True, capture_output=True, text=True).stdout.strip()
        model_dir = subprocess.run([sys.executable, "-m", "token_engine.cli", "with-random-weights", bundle],
                                   check=True, capture_output=True, text=True).stdout.strip()
    has_weights = any(Path(model_dir).glob("*.safetensors"))
    engine_port, gateway_port = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    gateway_flags: list[str] = []
    try:
        if has_weights:
            engine = start("engine", [sys.executable, "-m", "token_engine.cli", "serve", model_dir, "--device", "cpu",
                                      "--host", "127.0.0.1", "--port", str(engine_port), "--log-level", "warning",
                                      "--served-model-name", SERVED_NAME])
            procs.append(engine)
            with httpx.Client(base_url=f"http://127.0.0.1:{engine_port}", timeout=60) as engine_client:
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
            show_render_and_derender(client, model)
            if has_weights:
                show_gateway(client, model)
    finally:
        for proc in reversed(procs):
            stop(proc)
    print("\nall servers stopped.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None,
                        help="model bundle (default: the built-in one); without weights only the render tier starts")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each server to start")
    args = parser.parse_args(argv)
    run(args.model_dir, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
