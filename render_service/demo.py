"""``make demo``: start the render server on the built-in default model, render a chat, derender a reply.

Starts ``render-service serve`` as a subprocess on a free loopback port, waits for /health, sends a
chat to /v1/chat/completions/render, then sends a made-up model reply (token IDs, as an engine would
return them) to /v1/chat/completions/derender, prints both, and shuts the server down.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time

import httpx

PARSER_FLAGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the capital of Korea?"},
    ],
    "max_tokens": 64,
}
# What a model might answer; the demo turns it into token IDs, as an engine would produce them.
REPLY = "<think>\nThe user asks for the capital of South Korea. That is Seoul.\n</think>\n\nThe capital of South Korea is Seoul."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(client: httpx.Client, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"render server exited early with status {proc.returncode}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"render server not healthy after {timeout_s:.0f}s")


def show(title: str, value: object) -> None:
    print(f"\n=== {title}")
    print(json.dumps(value, indent=2, ensure_ascii=False))


def run(model_dir: str | None, timeout_s: float) -> None:
    model_args = [model_dir]
    if model_dir is None:
        from render_service.default_bundle import default_bundle_dir

        print("preparing the built-in default model bundle (built once, then cached) ...", flush=True)
        default_bundle_dir()
        model_args = []  # the server then serves the default bundle under its short name
    port = free_port()
    command = [sys.executable, "-m", "render_service.cli", "serve", *model_args, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", *PARSER_FLAGS]
    print("starting:", " ".join(command), flush=True)
    proc = subprocess.Popen(command)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        wait_healthy(client, proc, timeout_s)
        model = client.get("/v1/models").json()["data"][0]["id"]

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
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print("\nrender server stopped.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default=None, help="model bundle (default: the built-in default bundle)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server to start")
    args = parser.parse_args(argv)
    run(args.model_dir, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
