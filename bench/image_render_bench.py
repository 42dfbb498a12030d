"""Image render benchmark: images per second and server CPU per image through /v1/chat/completions/render on a
Qwen2.5-VL-shaped bundle (the Qwen3 tokenizer with Qwen2.5-VL's chat template and processor settings).

Requests carry ~1k tokens of text and 1, 4 or 8 JPEG images of 480p, 720p or 1080p; every image of every request
has bytes of its own (a JPEG comment with a counter), so the content-hash cache never answers and each image is
decoded, resized, normalised, patchified and encoded. C concurrent keep-alive clients send for --duration seconds.
Per cell: images/s, server CPU ms per image (utime+stime of the server's process tree, pool workers included,
from /proc before/after), p50 latency.

Baselines in the same run: vLLM 0.33's own render server (``vllm launch render`` on the same bundle and the same
requests, where the peer is installed: bench/peers.py), and ours with --image-workers 1 (one process doing all
image work: the shape of vLLM's render server, which preprocesses on one thread per API server). Each cell gives
ours against each baseline: images/s and CPU per image as ratios. The client shares the machine's cores with
the server; CPU per image counts the server's processes only.

usage: python -m bench.image_render_bench [--duration 5] [--images 1,4,8] [--resolutions 480p,720p,1080p]
       [--concurrency 1,8] [--image-workers 4] [--mm-payload tensors|none] [--no-vllm]
Results: bench/results/image_render_bench_<UTC time>.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from bench import peers
from bench.portable import write_result
from bench.render_bench import DEFAULT_MODEL_DIR, RESULTS, _post, nonrepetitive_text

VL_FIXTURE = peers.REPO / "tests" / "fixtures" / "qwen2_5_vl"
RENDER_PATH = "/v1/chat/completions/render"
RESOLUTIONS = {"480p": (854, 480), "720p": (1280, 720), "1080p": (1920, 1080)}
_MARK = "@@IMG{}@@"
VLLM_LABEL = "vllm-0.33"
VLLM_MODEL = "qwen3-0.6b"  # the name bench.peers.start_vllm033 serves


def bundle(root: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, root / name)
    for name in ("chat_template.jinja", "config.json", "preprocessor_config.json"):
        shutil.copy(VL_FIXTURE / name, root / name)
    return root


def photo_like(width: int, height: int, seed: int) -> bytes:
    """A JPEG with gradients and mild noise (compresses like a photo, unlike pure noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, size=base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=85)
    return out.getvalue()


def tagged_prefix(tag: int) -> bytes:
    """SOI and a 9-byte JPEG comment holding ``tag``: 15 bytes, so its base64 is a 20-character prefix that
    leaves the rest of the file's base64 unchanged."""
    return b"\xff\xd8\xff\xfe" + (11).to_bytes(2, "big") + tag.to_bytes(9, "big")


class Workload:
    """One request shape; ``payload(tag)`` gives a body whose images are all distinct from any other tag's."""

    def __init__(self, images: int, resolution: str, text: str, mm_payload: str | None, model: str = "vl") -> None:
        self.images = images
        width, height = RESOLUTIONS[resolution]
        rests = [base64.b64encode(photo_like(width, height, seed=i)[2:]).decode() for i in range(images)]
        content: list[dict] = [{"type": "text", "text": text}]
        for i, rest in enumerate(rests):
            content.append({"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + _MARK.format(i)
                                                                + rest}})
        fields = {"model": model, "messages": [{"role": "user", "content": content}]}
        if mm_payload is not None:  # ours only (vLLM's render always sends the tensors)
            fields["mm_payload"] = mm_payload
        body = json.dumps(fields).encode()
        self.chunks: list[bytes] = []
        for i in range(images):
            before, _, body = body.partition(_MARK.format(i).encode())
            self.chunks.append(before)
        self.chunks.append(body)

    def payload(self, tag: int) -> bytes:
        out = [self.chunks[0]]
        for i in range(self.images):
            out.append(base64.b64encode(tagged_prefix(tag * 16 + i)))
            out.append(self.chunks[i + 1])
        return b"".join(out)


async def load_run(port: int, workload: Workload, concurrency: int, duration: float,
                   cpu_seconds: Callable[[], float | None], tags: list[int], host: str = "127.0.0.1") -> dict:
    """``cpu_seconds``: the server's CPU so far (None where it cannot be read); ``tags``: a shared counter."""
    def head(size: int) -> bytes:
        return (f"POST {RENDER_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {size}\r\n\r\n").encode()

    def next_payload() -> bytes:
        tags[0] += 1
        return workload.payload(tags[0])

    connections = [await asyncio.open_connection(host, port) for _ in range(concurrency)]

    async def warm(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        payload = next_payload()
        assert await _post(reader, writer, head(len(payload)), payload) == 200

    # all at once: a connection warmed first would sit idle past the server's keep-alive while the others warm
    await asyncio.gather(*(warm(r, w) for r, w in connections))
    done = errors = 0
    latencies: list[float] = []
    stop_at = time.perf_counter() + duration

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            payload = next_payload()
            started = time.perf_counter()
            try:
                status = await _post(reader, writer, head(len(payload)), payload)
            except (IndexError, ConnectionError, asyncio.IncompleteReadError):
                # the server closed a keep-alive connection this client was slow to reuse (reading a response of
                # tens of MB can outlast the server's 5 s keep-alive): reconnect and send again
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                started = time.perf_counter()
                status = await _post(reader, writer, head(len(payload)), payload)
            latencies.append(time.perf_counter() - started)
            done += status == 200
            errors += status != 200

    cpu_before, started = cpu_seconds(), time.perf_counter()
    await asyncio.gather(*(client(r, w) for r, w in connections))
    elapsed, cpu_after = time.perf_counter() - started, cpu_seconds()
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    for _, writer in connections:
        writer.close()  # (a reconnected client's own writer is closed with its task's end by the loop)
    images = done * workload.images
    return {"requests": done, "errors": errors, "seconds": round(elapsed, 3),
            "images_per_s": round(images / elapsed, 2),
            "cpu_ms_per_image": round(cpu * 1000 / images, 2) if images and cpu is not None else None,
            "p50_ms": round(statistics.median(latencies) * 1000, 1) if latencies else None}


def start_server(model_dir: Path, port: int, image_workers: int, log: Path):
    import subprocess

    cmd = [sys.executable, "-m", "render_service.cli", "serve", str(model_dir), "--served-model-name", "vl",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--image-workers", str(image_workers),
           "--log-level", "warning", "--disable-uvicorn-access-log"]
    with open(log, "wb") as handle:
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=peers.REPO)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--images", default="1,4,8")
    parser.add_argument("--resolutions", default="480p,720p,1080p")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--image-workers", type=int, default=4, help="the measured server's pool (baseline: 1)")
    parser.add_argument("--mm-payload", choices=["tensors", "none"], default="tensors")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM 0.33's render server")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.images.split(",")]
    resolutions = args.resolutions.split(",")
    concurrency = [int(x) for x in args.concurrency.split(",")]
    text = nonrepetitive_text(random.Random(20261205), 330)  # ~1k tokens
    ours_label = f"image_workers={args.image_workers}"
    venv = None if args.no_vllm or args.mm_payload == "none" else peers.vllm033_venv()
    servers = ([VLLM_LABEL] if venv is not None else []) + ["image_workers=1", ours_label]
    results: dict = {"mm_payload": args.mm_payload, "duration_s": args.duration, "servers": servers, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bundle(Path(tmp))
        for label in servers:
            port = peers.free_port()
            log = Path(tmp) / f"server-{len(results['runs'])}-{label}.log"
            if label == VLLM_LABEL:
                assert venv is not None
                server = peers.start_vllm033(model_dir, port, venv, parsers=False, log=log)
                model, mm_payload = VLLM_MODEL, None
            else:
                server = start_server(model_dir, port, int(label.split("=")[1]), log)
                model, mm_payload = "vl", args.mm_payload
            workloads = {(n, res): Workload(n, res, text, mm_payload, model) for n in counts for res in resolutions}
            try:
                peers.wait_healthy(f"http://127.0.0.1:{port}", server.pid, timeout_s=600)
                tags = [(servers.index(label) + 1) * 10**9]
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as check:
                    r = check.post(RENDER_PATH, content=workloads[(counts[0], resolutions[0])].payload(1),
                                   headers={"content-type": "application/json"})
                    r.raise_for_status()
                    assert r.json()["features"]["mm_hashes"]["image"], "no image features in the answer"
                for (n, res), workload in workloads.items():
                    for c in concurrency:
                        cell = f"{n}x{res} c={c}"
                        run = asyncio.run(load_run(port, workload, c, args.duration,
                                                   partial(peers.tree_cpu_seconds, server.pid), tags))
                        results["runs"].setdefault(cell, {})[label] = run
                        print(f"{label:16s} {cell:16s} {run}", flush=True)
            finally:
                peers.stop_tree(server.pid)
    for runs in results["runs"].values():
        ours = runs.get(ours_label)
        for base_label, key in (("image_workers=1", "vs_one_worker"), (VLLM_LABEL, "vs_vllm")):
            base = runs.get(base_label)
            if not (base and ours and base["images_per_s"]):
                continue
            runs[key] = {"throughput_ratio": round(ours["images_per_s"] / base["images_per_s"], 2)}
            if base["cpu_ms_per_image"] and ours["cpu_ms_per_image"]:
                runs[key]["cpu_per_image_ratio"] = round(ours["cpu_ms_per_image"] / base["cpu_ms_per_image"], 2)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"image_render_bench_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    write_result(out, results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
