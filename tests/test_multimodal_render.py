"""Chat render with images over HTTP, on a Qwen2.5-VL-shaped bundle (the real Qwen3 tokenizer, Qwen2.5-VL's
chat template and processor settings): token ids equal to transformers' Qwen2.5-VL processor, vLLM's features
shape, images processed once, and bad images, uncovered models and a full pool answered in the API's shape."""

from __future__ import annotations

import base64
import io
import json
import subprocess
from pathlib import Path

import msgspec
import numpy as np
import pytest
from PIL import Image

from bench.peers import vllm033_venv
from render_service.multimodal.bounds import ImageBounds, decode_rgb, read_header
from render_service.multimodal.hashing import image_hash
from render_service.multimodal.sources import FetchPolicy
from tests.multimodal_images import VL_FIXTURE, data_url, declared_png, encode, noise_image, write_qwen2_5_vl_bundle
from tests.render_harness import RenderServer, image_render_server, qwen3_config
from token_engine.http.protocol import GenerateRequest as EngineRequest
from token_engine.http.validation import EngineLimits, RequestError, validate_generate_request

transformers = pytest.importorskip("transformers")
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
IMAGE_PAD = 151655


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_5_vl_bundle(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def vl(bundle_dir: Path):
    with image_render_server(bundle_dir, "vl", MODEL, workers=2) as started:
        yield started


class _ImagesOnlyProcessor(Qwen2_5_VLProcessor):
    """transformers' Qwen2.5-VL processor without its video processor (which needs torchvision): the text and
    image paths are the processor's own."""

    def __init__(self, image_processor, tokenizer, chat_template):  # noqa: ANN001
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.image_processor, self.tokenizer, self.video_processor = image_processor, tokenizer, None
        self.chat_template = chat_template


@pytest.fixture(scope="module")
def reference(bundle_dir: Path) -> _ImagesOnlyProcessor:
    settings = msgspec.json.decode((VL_FIXTURE / "preprocessor_config.json").read_bytes())
    image_processor = Qwen2VLImageProcessorPil(**{k: v for k, v in settings.items() if not k.endswith("_type")
                                                  and k != "processor_class"})
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(bundle_dir / "tokenizer.json"))
    return _ImagesOnlyProcessor(image_processor, tokenizer, (VL_FIXTURE / "chat_template.jinja").read_text())


def _render(server: RenderServer, messages: list, **extra: object):
    return server.client.post("/v1/chat/completions/render", json={"model": "vl", "messages": messages, **extra})


def _interleaved() -> tuple[list, list, list[bytes]]:
    """(our request's messages, the same for transformers, the images' bytes in prompt order)."""
    files = [encode(noise_image(640, 480, seed=1), "PNG"), encode(noise_image(1280, 720, seed=2), "JPEG"),
             encode(noise_image(150, 2000, seed=3), "WEBP")]
    ours = [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": data_url(files[0])}},
            {"type": "text", "text": " with "},
            {"type": "image_url", "image_url": {"url": data_url(files[1], "image/jpeg")}},
        ]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(files[2], "image/webp")}},
            {"type": "text", "text": "And this tall one?"},
        ]},
    ]
    theirs = [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                     {"type": "text", "text": " with "}, {"type": "image"}]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this tall one?"}]},
    ]
    return ours, theirs, files


def test_tokens_features_and_tensors_equal_transformers(vl, reference) -> None:
    server, _ = vl
    ours, theirs, files = _interleaved()
    text = reference.apply_chat_template(theirs, tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in files]
    expected = reference(text=[text], images=images, return_tensors="np")
    r = _render(server, ours)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_ids"] == [int(t) for t in expected["input_ids"][0]]

    features = body["features"]
    counts = [int(np.prod(g)) // 4 for g in expected["image_grid_thw"]]
    ids = body["token_ids"]
    ranges = features["mm_placeholders"]["image"]
    assert [p["length"] for p in ranges] == counts
    for p in ranges:  # each range is exactly one run of image tokens
        assert set(ids[p["offset"]: p["offset"] + p["length"]]) == {IMAGE_PAD}
        assert ids[p["offset"] - 1] != IMAGE_PAD and ids[p["offset"] + p["length"]] != IMAGE_PAD
    assert sum(p["length"] for p in ranges) == ids.count(IMAGE_PAD)
    hashes = [image_hash(data, MODEL, converted=decode_rgb(data, read_header(data, ImageBounds(), "i"), "i")[1])
              for data in files]
    assert features["mm_hashes"]["image"] == hashes
    assert features["mm_grid_thw"]["image"] == expected["image_grid_thw"].tolist()
    items = [_wire_item(item) for item in features["kwargs_data"]["image"]]
    assert [list(item["image_grid_thw"]) for item in items] == expected["image_grid_thw"].tolist()
    raw = np.concatenate([item["pixel_values"] for item in items])
    assert raw.dtype == np.uint8  # vLLM's default: the engine normalises on its device
    np.testing.assert_allclose(_device_normalized(raw), expected["pixel_values"], atol=2e-5, rtol=0)
    metadata = [_wire_item(item) for item in features["mm_metadata"]["image"]]
    assert [set(m) for m in metadata] == [{"image_grid_thw"}] * 3
    assert [list(m["image_grid_thw"]) for m in metadata] == expected["image_grid_thw"].tolist()

    # A router's request: the same ids, hashes and ranges, no tensors
    light = _render(server, ours, mm_payload="none").json()
    assert light["token_ids"] == ids and light["features"]["kwargs_data"] is None
    assert light["features"]["mm_metadata"] is None
    alias = _render(server, ours, return_mm_kwargs=False).json()  # vLLM's deprecated spelling of the same
    assert alias["features"] == light["features"]
    assert light["features"]["mm_hashes"] == features["mm_hashes"]
    assert light["features"]["mm_placeholders"] == features["mm_placeholders"]

    # Our engine serves text models and says so for this very output
    with pytest.raises(RequestError, match="serves text models") as refused:
        validate_generate_request(msgspec.convert(body, EngineRequest, strict=False), EngineLimits(
            max_model_len=128000, vocab_size=151936, max_num_seqs=8))
    assert refused.value.param == "features"
    with pytest.raises(RequestError, match="serves text models"):  # a router's answer is no engine input either
        validate_generate_request(msgspec.convert(light, EngineRequest, strict=False), EngineLimits(
            max_model_len=128000, vocab_size=151936, max_num_seqs=8))


def _wire_item(text: str) -> dict[str, np.ndarray]:
    """A kwargs_data / mm_metadata item read as vLLM's MsgpackDecoder reads it: each field's data is
    [dtype, shape, ext 3 (raw bytes)]; flat fields slice the first dimension, batched ones carry one item."""
    item = msgspec.msgpack.decode(base64.b64decode(text), ext_hook=lambda code, data: (code, bytes(data)))
    out = {}
    for key, elem in item.items():
        dtype, shape, (code, raw) = elem["data"]
        assert code == 3 and elem["field"][0] in ("flat", "batched")
        out[key] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return out


def _device_normalized(raw: np.ndarray) -> np.ndarray:
    """What vLLM's fused input norm computes from raw uint8 patches (channel-major rows: 3 x 2 x 14 x 14)."""
    settings = msgspec.json.decode((VL_FIXTURE / "preprocessor_config.json").read_bytes())
    mean = np.repeat(np.asarray(settings["image_mean"], np.float32), 2 * 14 * 14)
    std = np.repeat(np.asarray(settings["image_std"], np.float32), 2 * 14 * 14)
    return (raw.astype(np.float32) * np.float32(1 / 255) - mean) / std


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_messages_render_interleaves_base64_images_as_transformers(vl, reference) -> None:
    server, _ = vl
    ours, theirs, files = _interleaved()
    text = reference.apply_chat_template(theirs, tokenize=False, add_generation_prompt=True)
    expected = reference(text=[text], images=[Image.open(io.BytesIO(d)).convert("RGB") for d in files],
                         return_tensors="np")

    def image(data: bytes, mime: str) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": _b64(data)}}

    r = server.client.post("/v1/messages/render", json={"model": "vl", "max_tokens": 16,
                                                         "system": "You describe pictures.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, image(files[0], "image/png"),
                                     {"type": "text", "text": " with "}, image(files[1], "image/jpeg")]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [image(files[2], "image/webp"), {"type": "text", "text": "And this tall one?"}]},
    ]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_ids"] == [int(t) for t in expected["input_ids"][0]]
    assert body["request_id"].startswith("msg_")
    chat = _render(server, ours).json()
    assert body["features"] == chat["features"]


def test_responses_render_interleaves_input_images_as_transformers(vl, reference) -> None:
    server, _ = vl
    ours, theirs, files = _interleaved()
    text = reference.apply_chat_template(theirs, tokenize=False, add_generation_prompt=True)
    expected = reference(text=[text], images=[Image.open(io.BytesIO(d)).convert("RGB") for d in files],
                         return_tensors="np")
    r = server.client.post("/v1/responses/render", json={"model": "vl", "instructions": "You describe pictures.",
                                                          "mm_payload": "none", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Compare "},
                                     {"type": "input_image", "image_url": data_url(files[0]), "detail": "auto"},
                                     {"type": "input_text", "text": " with "},
                                     {"type": "input_image", "image_url": data_url(files[1], "image/jpeg")}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "They differ."}]},
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(files[2], "image/webp")},
                                     {"type": "input_text", "text": "And this tall one?"}]},
    ]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_ids"] == [int(t) for t in expected["input_ids"][0]]
    assert body["request_id"].startswith("resp_") and body["features"]["kwargs_data"] is None
    assert body["features"]["mm_placeholders"] == _render(server, ours).json()["features"]["mm_placeholders"]


def test_messages_and_responses_refuse_images_in_their_own_error_shapes(vl) -> None:
    server, mm = vl
    url = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/cat.png"}}
    r = server.client.post("/v1/messages/render", json={"model": "vl", "max_tokens": 4, "messages": [
        {"role": "user", "content": [url, {"type": "text", "text": "?"}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "not allowed" in r.json()["error"]["message"]
    png = data_url(encode(noise_image(8, 8, seed=6), "PNG"))
    r = server.client.post("/v1/messages/render", json={"model": "vl", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                         "data": png.split(",", 1)[1]}}]}]})
    assert r.status_code == 400 and "only supported in user messages" in r.json()["error"]["message"]
    saved = mm.pool.max_pending
    mm.pool.max_pending = 0
    try:
        r = server.client.post("/v1/responses/render", json={"model": "vl", "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": png}]}]})
    finally:
        mm.pool.max_pending = saved
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_anthropic_and_responses_image_shapes_render_alike(vl) -> None:
    server, _ = vl
    png = encode(noise_image(64, 96, seed=9), "PNG")
    shapes = [{"type": "image_url", "image_url": {"url": data_url(png)}},
              {"type": "input_image", "image_url": data_url(png)},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(png).decode()}}]
    answers = [_render(server, [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}],
                       mm_payload="none").json() for part in shapes]
    assert answers[0]["token_ids"] == answers[1]["token_ids"] == answers[2]["token_ids"]
    assert answers[0]["features"]["mm_hashes"] == answers[2]["features"]["mm_hashes"]


def test_identical_images_are_processed_once(vl) -> None:
    server, mm = vl
    url = data_url(encode(noise_image(320, 200, seed=42), "PNG"))
    other = data_url(encode(noise_image(200, 320, seed=43), "PNG"))
    part = {"type": "image_url", "image_url": {"url": url}}
    before = mm.pool.processed
    r = _render(server, [{"role": "user", "content": [part, part, {"type": "image_url", "image_url": {"url": other}},
                                                      part]}])
    assert r.status_code == 200, r.text
    assert mm.pool.processed - before == 2
    hashes = r.json()["features"]["mm_hashes"]["image"]
    assert hashes[0] == hashes[1] == hashes[3] != hashes[2]
    again = _render(server, [{"role": "user", "content": [part]}])
    assert again.status_code == 200 and mm.pool.processed - before == 2  # the cache served it


def _assert_api_400(r, *words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    for word in words:
        assert word in error["message"]


def test_bad_images_are_400s_and_the_server_stays_up(vl) -> None:
    server, _ = vl
    png = encode(noise_image(64, 64), "PNG")
    cases = {
        "declares": data_url(declared_png(30000, 30000)),
        "could not be decoded": data_url(png[: len(png) // 2]),
        "not a readable image": data_url(b"GIF89a but not really"),
        "not valid base64": "data:image/png;base64,!!!",
    }
    for words, url in cases.items():
        _assert_api_400(_render(server, [{"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}]), words)
    _assert_api_400(_render(server, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/a.png"}}]}]), "not allowed")
    _assert_api_400(_render(server, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png)}}]}], mm_payload="all"), "mm_payload")
    assert server.client.get("/health").status_code == 200


def test_a_text_model_names_the_covered_families() -> None:
    with RenderServer(qwen3_config()) as server:
        r = server.client.post("/v1/chat/completions/render", json={"model": "qwen3-0.6b", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(b"x")}}]}]})
        _assert_api_400(r, "Qwen2.5-VL", "Qwen3-VL")
        r = server.client.post("/v1/responses/render", json={"model": "qwen3-0.6b", "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": data_url(b"x")}]}]})
        assert r.status_code == 400 and "Qwen2.5-VL" in r.json()["error"]["message"]
        r = server.client.post("/v1/messages/render", json={"model": "qwen3-0.6b", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "eA=="}}]}]})
        assert r.status_code == 400 and "Qwen3-VL" in r.json()["error"]["message"]
        plain = server.client.post("/v1/chat/completions/render", json={"model": "qwen3-0.6b", "messages": [
            {"role": "user", "content": "an image of a cat"}]})
        assert plain.status_code == 200


def test_a_full_pool_is_a_429_with_retry_after(vl) -> None:
    server, mm = vl
    saved = mm.pool.max_pending
    mm.pool.max_pending = 0
    try:
        r = _render(server, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(encode(noise_image(8, 8, seed=5), "PNG"))}}]}])
    finally:
        mm.pool.max_pending = saved
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == 429


def test_a_full_pool_still_serves_cached_images(vl) -> None:
    server, mm = vl
    part = {"type": "image_url", "image_url": {"url": data_url(encode(noise_image(12, 12, seed=11), "PNG"))}}
    assert _render(server, [{"role": "user", "content": [part]}]).status_code == 200
    saved = mm.pool.max_pending
    mm.pool.max_pending = 0
    try:
        r = _render(server, [{"role": "user", "content": [part, part]}])
    finally:
        mm.pool.max_pending = saved
    assert r.status_code == 200, r.text


def test_allowed_loopback_names_are_still_refused_over_http(vl) -> None:
    """An operator who allows localhost by mistake still gets no fetch from loopback: the server refuses
    before connecting, and a real image server listening there sees no request."""
    import http.server
    import threading

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            hits.append(self.path)
            self.send_error(500)

        def log_message(self, *args: object) -> None:
            pass

    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    server, mm = vl
    saved = mm.fetch_policy
    mm.fetch_policy = FetchPolicy(("localhost", "127.0.0.1"), 2.0)
    try:
        for host in ("localhost", "127.0.0.1"):
            url = f"http://{host}:{images.server_address[1]}/cat.png"
            _assert_api_400(_render(server, [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}]), "loopback")
    finally:
        mm.fetch_policy = saved
        images.shutdown()
        images.server_close()
    assert hits == []


_VLLM_DECODE = """
import json, sys
import numpy as np
from vllm.entrypoints.scale_out.token_in_token_out.mm_features import mm_kwargs_from_features
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
req = GenerateRequest.model_validate_json(open(sys.argv[1]).read())
items = mm_kwargs_from_features(req.features)["image"]
batch = {key: items[0][key].field.reduce_data([item[key] for item in items]) for key in items[0]}
np.save(sys.argv[2], batch["pixel_values"].numpy())
print(json.dumps({"grids": batch["image_grid_thw"].tolist(), "keys": sorted(items[0]),
                  "cpu": [items[0][k].field.keep_on_cpu for k in ("pixel_values", "image_grid_thw")]}))
"""


@pytest.mark.slow
def test_vllm_reads_our_features_as_its_own(vl, reference, tmp_path: Path) -> None:
    """vLLM 0.33's generate request model validates our render answer, and its decoder and batcher turn our
    kwargs_data into the pixel values and grids transformers' processor gives."""
    venv = vllm033_venv()
    if venv is None:
        pytest.skip("vLLM 0.33 peer not installed")
    server, _ = vl
    ours, theirs, files = _interleaved()
    r = _render(server, ours)
    assert r.status_code == 200, r.text
    (tmp_path / "render.json").write_bytes(r.content)
    done = subprocess.run([str(venv / "bin" / "python"), "-c", _VLLM_DECODE, str(tmp_path / "render.json"),
                           str(tmp_path / "pixels.npy")], capture_output=True, text=True, timeout=300,
                          env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    decoded = json.loads(done.stdout.strip().splitlines()[-1])
    text = reference.apply_chat_template(theirs, tokenize=False, add_generation_prompt=True)
    expected = reference(text=[text], images=[Image.open(io.BytesIO(d)).convert("RGB") for d in files],
                         return_tensors="np")
    assert decoded == {"grids": expected["image_grid_thw"].tolist(), "keys": ["image_grid_thw", "pixel_values"],
                       "cpu": [False, True]}
    np.testing.assert_allclose(_device_normalized(np.load(tmp_path / "pixels.npy")), expected["pixel_values"],
                               atol=2e-5, rtol=0)


def test_an_engine_normalising_on_the_host_gets_float32_values(vl, reference) -> None:
    """--no-mm-device-do-normalize: pixel values as transformers' processor gives them, float32 normalised."""
    server, mm = vl
    png = encode(noise_image(200, 150, seed=21), "PNG")
    mm.normalize = True
    try:
        r = _render(server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}}]}])
    finally:
        mm.normalize = False
    assert r.status_code == 200, r.text
    (item,) = [_wire_item(text) for text in r.json()["features"]["kwargs_data"]["image"]]
    expected = reference.image_processor(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="np")
    assert item["pixel_values"].dtype == np.float32
    np.testing.assert_allclose(item["pixel_values"], expected["pixel_values"], atol=2e-5, rtol=0)


RECORDED = VL_FIXTURE / "vllm033_render_images.json"


def test_the_recorded_vllm_answer_is_ours(bundle_dir: Path) -> None:
    """vLLM 0.33's render answer for three images interleaved with text (recorded): the same token ids, hashes,
    placeholder ranges and metadata items, and pixel values of the same dtype and shape (the resize filters
    differ: docs/images.md)."""
    recorded = msgspec.json.decode(RECORDED.read_bytes())
    with image_render_server(bundle_dir, "vl", recorded["model_id"], workers=1) as (server, _):
        r = server.client.post("/v1/chat/completions/render", json=recorded["request"])
    assert r.status_code == 200, r.text
    ours, theirs = r.json(), recorded["answer"]
    assert ours["token_ids"] == theirs["token_ids"]
    for key in ("mm_hashes", "mm_placeholders", "mm_metadata"):
        assert ours["features"][key] == theirs["features"][key], key
    shapes = [(item["pixel_values"].dtype, item["pixel_values"].shape) for item in
              (_wire_item(text) for text in ours["features"]["kwargs_data"]["image"])]
    assert shapes == [(np.dtype(dtype), tuple(shape)) for dtype, shape in theirs["kwargs_shapes"]]


def test_forked_server_processes_each_get_their_own_image_pool(bundle_dir: Path) -> None:
    """--workers 2 builds the app once and forks: concurrent image requests spread over both processes all come
    back, each with its own images' hashes (a pool shared across the fork would cross its pipes)."""
    import concurrent.futures
    import sys

    from tests.gateway_harness import Process, free_port

    port = free_port()
    proc = Process([sys.executable, "-m", "render_service.cli", "serve", str(bundle_dir), "--host", "127.0.0.1",
                    "--port", str(port), "--served-model-name", "vl", "--workers", "2", "--image-workers", "1",
                    "--log-level", "warning"], port)
    images = [encode(noise_image(40 + i, 30, seed=100 + i), "PNG") for i in range(12)]

    def render(data: bytes) -> tuple[int, list[str]]:
        import httpx

        r = httpx.post(f"{proc.url}/v1/chat/completions/render", timeout=120, json={"model": "vl", "mm_payload": "none",
                       "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                  "image_url": {"url": data_url(data)}}]}]})
        return r.status_code, r.json()["features"]["mm_hashes"]["image"] if r.status_code == 200 else []

    try:
        with concurrent.futures.ThreadPoolExecutor(6) as threads:
            answers = list(threads.map(render, images))
    finally:
        proc.stop()
    expected = [[image_hash(data, str(bundle_dir), converted=False)] for data in images]
    assert answers == [(200, hashes) for hashes in expected]


def test_a_turn_over_earlier_images_must_send_the_whole_conversation(vl) -> None:
    """A prompt reference made with images keeps no messages: the next turn's render must process those images
    again for the engine, so a turn that sends only its new messages is refused, naming the field and the way out."""
    server, _ = vl
    ours, _, _ = _interleaved()
    made = _render(server, ours, return_prompt_ref=True)
    assert made.status_code == 200, made.text
    reply = _render(server, [{"role": "assistant", "content": "Tall."}, {"role": "user", "content": "Thanks."}],
                    previous_turn={"prompt_ref": made.json()["prompt_ref"], "completion_token_ids": [1, 2],
                                   "messages": "new"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "previous_turn.messages" and "whole conversation" in error["message"]
