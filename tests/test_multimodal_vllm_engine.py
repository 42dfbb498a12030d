"""A real vLLM engine takes our image renders: vLLM 0.32's CPU engine serving a tiny random-weight Qwen2.5-VL
generates from our render answer for an image chat request (token ids and ``features``, sent as they come to its
``/inference/v1/generate``) the same greedy tokens as from vLLM's own render answer for that request.

Slow and opt-in (SPLITSERVE_PEER_TESTS=1, the vLLM 0.32 peer and its torchvision folder, bench/peers.py). vLLM's
render answer comes from the engine process's own render endpoint (``serve --enable-scale-out`` registers the
same render routes as ``vllm launch render``); ``--tokens-only`` cannot serve this model (docs/images.md)."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from bench import peers
from tests.multimodal_images import data_url, encode, noise_image, write_tiny_qwen2_5_vl
from tests.vllm_peers import VLLM032, Peer, _started, needs_vllm032, peer_skip_reason

pytestmark = [pytest.mark.slow, needs_vllm032]

MODEL = "tiny"
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2_5_vl") / "model")


@pytest.fixture(scope="module")
def vllm_vl(model_dir: Path) -> Iterator[Peer]:
    """vLLM 0.32 serving the tiny model on CPU: generate, and vLLM's own render."""
    reason = peer_skip_reason("0.32")
    if reason is not None:
        pytest.skip(reason)
    pythonpath = peers.vllm032_vl_pythonpath()
    if pythonpath is None:
        pytest.skip(f"no torchvision for vLLM 0.32's Qwen-VL models in {peers.VLLM032_TORCHVISION} (set "
                    "SPLITSERVE_VLLM_TORCHVISION; pip install --no-deps --target DIR torchvision==0.28.0)")
    port = peers.free_port()
    log = model_dir.parent / "vllm.log"
    # --enforce-eager: no compile warm-up; images capped so the encoder's profiling run stays small on a CPU
    proc = peers.start_vllm_engine(
        model_dir, port, VLLM032, log=log, max_model_len=2048, tokens_only=False,
        extra=["--enforce-eager", "--max-num-batched-tokens", "2048",
               "--limit-mm-per-prompt", '{"image": 2, "video": 0}'],
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath})
    peer = _started(f"http://127.0.0.1:{port}", proc.pid, log, timeout_s=900, model=model_dir)
    yield peer
    peers.stop_tree(proc.pid)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Iterator[str]:
    from tests.gateway_harness import Process, free_port

    port = free_port()
    proc = Process([sys.executable, "-m", "render_service.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                    "--port", str(port), "--served-model-name", MODEL, "--workers", "1", "--image-workers", "1",
                    "--log-level", "warning"], port)
    yield proc.url
    proc.stop()


def _request(images: list[tuple[bytes, str]]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare "}]
    for n, (data, mime) in enumerate(images):
        parts += [{"type": "image_url", "image_url": {"url": data_url(data, mime)}},
                  {"type": "text", "text": " with " if n + 1 < len(images) else ", please."}]
    return {"model": MODEL, "messages": [{"role": "system", "content": "You compare pictures."},
                                         {"role": "user", "content": parts}]}


def _render(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/chat/completions/render", json=body, timeout=300)
    assert r.status_code == 200, r.text[:2000]
    answer: dict[str, Any] = r.json()
    return answer


def _generate(engine: Peer, rendered: dict[str, Any]) -> list[int]:
    """The render answer as the generate request, with greedy sampling; the engine's output token ids."""
    r = engine.post("/inference/v1/generate", {**rendered, "sampling_params": GREEDY})
    assert r.status_code == 200, f"{r.text[:2000]}\n{engine.log_tail()}"
    (choice,) = r.json()["choices"]
    tokens: list[int] = choice["token_ids"]
    assert len(tokens) == GREEDY["max_tokens"]
    return tokens


def _pixels(item: str) -> np.ndarray:
    """An item's pixel values as vLLM's decoder reads them (each item carries its own rows; vLLM's render
    declares the request's batch slices beside them, ours the item's alone)."""
    decoded = msgspec.msgpack.decode(base64.b64decode(item), ext_hook=lambda code, data: bytes(data))
    dtype, shape, raw = decoded["pixel_values"]["data"]
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


# Sides that are multiples of 28 px inside the pixel budget: no resize, so both renders' pixels are equal
SAME_PIXELS = [(encode(noise_image(280, 196, seed=1), "PNG"), "image/png"),
               (encode(noise_image(224, 112, seed=2), "JPEG"), "image/jpeg")]


def test_our_render_generates_vllms_greedy_tokens(vllm_vl: Peer, ours: str) -> None:
    body = _request(SAME_PIXELS)
    theirs, mine = _render(vllm_vl.url, body), _render(ours, body)
    assert mine["token_ids"] == theirs["token_ids"]
    for key in ("mm_hashes", "mm_placeholders", "mm_metadata"):
        assert mine["features"][key] == theirs["features"][key], key
    assert len(mine["features"]["mm_placeholders"]["image"]) == 2
    for a, b in zip(mine["features"]["kwargs_data"]["image"], theirs["features"]["kwargs_data"]["image"],
                    strict=True):
        np.testing.assert_array_equal(_pixels(a), _pixels(b))
    assert _generate(vllm_vl, mine) == _generate(vllm_vl, theirs)


def test_the_greedy_tokens_follow_the_image(vllm_vl: Peer, ours: str) -> None:
    """The check above can fail: the engine decodes our pixel values, and another picture (same size, same
    prompt tokens) changes what this model generates."""
    first = _render(ours, _request(SAME_PIXELS))
    other = _render(ours, _request([(encode(noise_image(280, 196, seed=7), "PNG"), "image/png"), SAME_PIXELS[1]]))
    assert other["token_ids"] == first["token_ids"]
    assert _generate(vllm_vl, other) != _generate(vllm_vl, first)


def test_resized_images_generate_vllms_greedy_tokens(vllm_vl: Peer, ours: str) -> None:
    """Images that must be resized to the patch grid: the same token ids and placeholders; the greedy tokens as
    measured (the resize filters differ, docs/images.md)."""
    body = _request([(encode(noise_image(300, 200, seed=3), "PNG"), "image/png"),
                     (encode(noise_image(640, 480, seed=4), "JPEG"), "image/jpeg")])
    theirs, mine = _render(vllm_vl.url, body), _render(ours, body)
    assert mine["token_ids"] == theirs["token_ids"]
    assert mine["features"]["mm_placeholders"] == theirs["features"]["mm_placeholders"]
    assert _generate(vllm_vl, mine) == _generate(vllm_vl, theirs)
