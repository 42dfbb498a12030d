"""Image placeholders, pixel values, bounds, sources and hashes of the render tier's image path, against real
components: transformers' Qwen2-VL image processor built from configuration, Pillow-made PNG/JPEG/WebP files,
and (where the peer is installed) vLLM's own loader and hasher."""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.peers import vllm033_venv
from render_service.multimodal.bounds import ImageBounds, ImageError, check_request_pixels, decode_rgb, read_header
from render_service.multimodal.families import family_from_bundle, family_from_configs
from render_service.multimodal.hashing import image_hash
from render_service.multimodal.qwen_vl import image_token_count, pixel_values
from render_service.multimodal.sources import FetchPolicy, fetch, image_ref
from tests.multimodal_images import data_url, declared_png, encode, noise_image

transformers_qwen = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

VL_FIXTURE = Path(__file__).parent / "fixtures" / "qwen2_5_vl"
QWEN25 = family_from_bundle(VL_FIXTURE)
# Qwen3-VL's published image processor settings (patch 16, mean/std 0.5, pixel bounds as size edges)
QWEN3_PRE = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
QWEN3 = family_from_configs({"model_type": "qwen3_vl"}, QWEN3_PRE)
SIZES = [(640, 480), (1280, 720), (1920, 1080), (28, 28), (5, 9), (1000, 7), (6, 1100), (3001, 17), (333, 4321)]


def _reference(preprocessor: dict, image: Image.Image) -> tuple[np.ndarray, list[int]]:
    kwargs = {k: v for k, v in preprocessor.items() if k not in ("image_processor_type", "processor_class")}
    processor = transformers_qwen.Qwen2VLImageProcessorPil(**kwargs)
    out = processor(images=[image], return_tensors="np")
    return out["pixel_values"], [int(x) for x in out["image_grid_thw"][0]]


@pytest.mark.parametrize("family_name", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_tokens_and_pixel_values_equal_transformers(family_name: str, size: tuple[int, int]) -> None:
    family, preprocessor = ((QWEN25, json.loads((VL_FIXTURE / "preprocessor_config.json").read_text()))
                            if family_name == "qwen2_5_vl" else (QWEN3, QWEN3_PRE))
    assert family is not None
    image = noise_image(*size, seed=size[0] * 7 + size[1])
    expected_values, expected_grid = _reference(preprocessor, image)
    values, grid = pixel_values(image, family)
    assert list(grid) == expected_grid
    assert image_token_count(size[1], size[0], family) == expected_grid[1] * expected_grid[2] // 4
    assert values.shape == expected_values.shape
    np.testing.assert_allclose(values, expected_values, atol=2e-5, rtol=0)



@pytest.mark.parametrize("family_name", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_raw_pixel_values_equal_transformers_exactly(family_name: str, size: tuple[int, int]) -> None:
    """The uint8 pixels sent to an engine normalising on its device: transformers' resized, patchified values
    without rescale and normalisation, every one equal; also when written into a given buffer at an odd offset."""
    family, preprocessor = ((QWEN25, json.loads((VL_FIXTURE / "preprocessor_config.json").read_text()))
                            if family_name == "qwen2_5_vl" else (QWEN3, QWEN3_PRE))
    assert family is not None
    image = noise_image(*size, seed=size[0] * 5 + size[1])
    expected_values, expected_grid = _reference({**preprocessor, "do_rescale": False, "do_normalize": False}, image)
    values, grid = pixel_values(image, family, normalize=False)
    assert values.dtype == np.uint8 and list(grid) == expected_grid
    np.testing.assert_array_equal(values.astype(np.float32), expected_values)
    buffer = bytearray(values.nbytes + 1)
    written, _ = pixel_values(image, family, normalize=False, out=memoryview(buffer)[1:])
    assert bytes(buffer[1:]) == values.tobytes() and written.tobytes() == values.tobytes()

def _count_sizes() -> list[tuple[int, int]]:
    """Image sizes for the placeholder-count check: seeded random sizes over 1..8000 px with aspect ratios up
    to and past the processor's 200:1 limit, plus the edges of each rounding rule (multiples of the patch grid
    and one pixel either side, the min/max pixel budgets' square roots, single-pixel strips)."""
    rng = np.random.default_rng(20261205)
    sizes = [(int(w), int(h)) for w, h in rng.integers(1, 8001, size=(300, 2))]
    sizes += [(int(w), int(h)) for w, h in np.exp(rng.uniform(0, np.log(4000), size=(100, 2))).astype(int) + 1]
    for side in (27, 28, 29, 31, 32, 33, 55, 56, 57, 63, 64, 65, 447, 448, 449, 3583, 3584, 3585, 4096):
        sizes += [(side, side), (side, side + 1), (side - 1, side * 3)]
    sizes += [(1, 1), (1, 200), (200, 1), (1, 201), (3, 600), (601, 3), (2, 7000), (8000, 40)]
    return sizes


COUNT_CONFIGS = {
    "qwen2_5_vl": json.loads((VL_FIXTURE / "preprocessor_config.json").read_text()),
    "qwen3_vl": QWEN3_PRE,
    # a deployment's tighter budget (min/max_pixels given as mm_processor_kwargs)
    "qwen2_5_vl_budget": {**json.loads((VL_FIXTURE / "preprocessor_config.json").read_text()),
                          "min_pixels": 256 * 28 * 28, "max_pixels": 1280 * 28 * 28},
}


@pytest.mark.parametrize("name", sorted(COUNT_CONFIGS))
def test_placeholder_counts_equal_transformers_for_many_sizes(name: str) -> None:
    """The processor's own count (get_number_of_image_patches, what vLLM asks it for) against ours, or both
    refusing, for some 470 sizes per configuration."""
    preprocessor = COUNT_CONFIGS[name]
    kwargs = {k: v for k, v in preprocessor.items() if k not in ("image_processor_type", "processor_class")}
    processor = transformers_qwen.Qwen2VLImageProcessorPil(**kwargs)
    family = family_from_configs({"model_type": "qwen3_vl" if name == "qwen3_vl" else "qwen2_5_vl"}, preprocessor)
    assert family is not None
    refused = 0
    for width, height in _count_sizes():
        try:
            expected: int | None = processor.get_number_of_image_patches(height, width, {}) // 4
        except ValueError:
            expected = None
        try:
            ours: int | None = image_token_count(height, width, family)
        except ImageError:
            ours = None
        assert ours == expected, (width, height)
        refused += ours is None
    assert 0 < refused < 20  # the aspect-ratio refusals are exercised, and only they


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_decoded_formats_reach_the_same_pixels_as_pillow(fmt: str) -> None:
    data = encode(noise_image(97, 61, seed=3), fmt)
    header = read_header(data, ImageBounds(), "img")
    assert (header.format, header.width, header.height) == (fmt, 97, 61)
    decoded, converted = decode_rgb(data, header, "img")
    assert not converted
    with Image.open(__import__("io").BytesIO(data)) as reference:
        assert np.array_equal(np.asarray(decoded), np.asarray(reference.convert("RGB")))


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_orientation_is_applied_as_vllms_loader_does(orientation: int) -> None:
    """vLLM's loader turns an image by its EXIF orientation (Pillow's exif_transpose); an image without a turn
    keeps its pixels."""
    import io

    from PIL import ImageOps

    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    noise_image(40, 24, seed=5).save(buffer, format="JPEG", exif=exif)
    data = buffer.getvalue()
    decoded, converted = decode_rgb(data, read_header(data, ImageBounds(), "img"), "img")
    with Image.open(io.BytesIO(data)) as opened:
        reference = ImageOps.exif_transpose(opened).convert("RGB")
    assert not converted and decoded.size == ((24, 40) if orientation in (6, 8) else (40, 24))
    assert np.array_equal(np.asarray(decoded), np.asarray(reference))


def test_transparency_is_composited_on_white_as_vllm_does() -> None:
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    data = encode(rgba, "PNG")
    decoded, converted = decode_rgb(data, read_header(data, ImageBounds(), "img"), "img")
    assert converted and decoded.getpixel((0, 0)) == (255, 255, 255)


def test_a_declared_bomb_is_refused_from_its_header() -> None:
    bounds = ImageBounds()
    for width, height in ((7000, 7000), (40000, 40000)):  # over our bound; over Pillow's own bomb bound too
        with pytest.raises(ImageError) as raised:
            read_header(declared_png(width, height), bounds, "messages[0].content[1]")
        assert raised.value.status == 400 and "messages[0].content[1]" in raised.value.message


def test_malformed_and_oversized_files_are_400s() -> None:
    bounds = ImageBounds(max_image_bytes=10_000)
    for bad in (b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40):
        with pytest.raises(ImageError):
            read_header(bad, bounds, "img")
    png = encode(noise_image(64, 64), "PNG")
    truncated = png[: len(png) // 2]
    header = read_header(truncated, bounds, "img")  # the header is intact; the pixels are not
    with pytest.raises(ImageError, match="could not be decoded"):
        decode_rgb(truncated, header, "img")
    with pytest.raises(ImageError, match="over the limit"):
        read_header(encode(noise_image(200, 200), "PNG"), bounds, "img")
    # a PSD or EPS is not among the formats an image part may carry
    with pytest.raises(ImageError, match="not a readable image"):
        read_header(encode(noise_image(8, 8), "TIFF"), bounds, "img")


def test_request_pixels_are_bounded_across_images() -> None:
    bounds = ImageBounds(max_request_pixels=1000)
    headers = [read_header(encode(noise_image(20, 20), "PNG"), bounds, "img") for _ in range(3)]
    check_request_pixels(headers[:2], bounds)
    with pytest.raises(ImageError, match="per request"):
        check_request_pixels(headers, bounds)


def test_the_three_apis_image_shapes() -> None:
    bounds = ImageBounds()
    png = encode(noise_image(8, 8), "PNG")
    url = data_url(png)
    shapes = [
        {"type": "image_url", "image_url": {"url": url}},  # OpenAI chat
        {"type": "image_url", "image_url": url},
        {"type": "input_image", "image_url": url},  # Responses
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",  # Anthropic Messages
                                     "data": url.split(",", 1)[1]}},
    ]
    for part in shapes:
        ref = image_ref(part, "p", bounds)
        assert ref is not None and ref.data == png
    remote = image_ref({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}, "p", bounds)
    assert remote is not None and remote.url == "https://example.com/a.png" and remote.data is None
    assert image_ref({"type": "text", "text": "hi"}, "p", bounds) is None
    for bad in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
                {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
                {"type": "image_url", "image_url": {"url": "data:image/png,raw"}},
                {"type": "input_image", "file_id": "file-1"},
                {"type": "image", "source": {"type": "file", "file_id": "x"}}):
        with pytest.raises(ImageError):
            image_ref(bad, "p", bounds)
    with pytest.raises(ImageError, match="over the limit"):  # refused before base64-decoding it
        image_ref({"type": "image_url", "image_url": {"url": url}}, "p", ImageBounds(max_image_bytes=10))


def test_urls_only_from_allowed_public_hosts() -> None:
    bounds = ImageBounds()
    ref = image_ref({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}, "p", bounds)
    assert ref is not None
    with pytest.raises(ImageError, match="not allowed"):
        asyncio.run(fetch(ref, FetchPolicy(), bounds))
    with pytest.raises(ImageError, match="not allowed"):
        asyncio.run(fetch(ref, FetchPolicy(("example.com",)), bounds))
    with pytest.raises(ImageError, match="loopback, private or link-local"):  # allowed by name, refused by address
        asyncio.run(fetch(ref, FetchPolicy(("127.0.0.1",)), bounds))


class _CountingImageServer:
    """A real HTTP server on loopback that serves a PNG to anyone who asks, and counts who asked."""

    def __init__(self) -> None:
        png = encode(noise_image(16, 16), "PNG")
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def image_server():
    server = _CountingImageServer()
    yield server
    server.close()


def test_a_loopback_image_server_is_never_fetched_from(image_server: _CountingImageServer) -> None:
    bounds = ImageBounds()
    with urllib.request.urlopen(f"http://127.0.0.1:{image_server.port}/probe.png", timeout=5) as probe:
        assert probe.status == 200  # the server is up and would answer anyone
    image_server.hits.clear()
    for host in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]"):
        ref = image_ref({"type": "image_url", "image_url": {"url": f"http://{host}:{image_server.port}/a.png"}},
                        "p", bounds)
        assert ref is not None
        allowed = host.strip("[]")
        with pytest.raises(ImageError) as refused:
            asyncio.run(fetch(ref, FetchPolicy((allowed,)), bounds))
        assert refused.value.status == 400 and ("loopback" in refused.value.message
                                                or "does not resolve" in refused.value.message)
    assert image_server.hits == []


def test_the_connect_step_checks_the_address_again(image_server: _CountingImageServer) -> None:
    """The address check runs where the connection is made, so a name that resolved to a public address a
    moment ago and to loopback now (DNS rebinding) is still refused."""
    from render_service.multimodal.sources import _PublicOnly

    with pytest.raises(ImageError, match="loopback"):
        asyncio.run(_PublicOnly("p").connect_tcp("localhost", image_server.port))
    assert image_server.hits == []


def test_uncovered_families_are_named() -> None:
    assert family_from_configs({"model_type": "gemma3"}, {}) is None
    assert family_from_configs({"model_type": "qwen3"}, {}) is None
    assert QWEN25 is not None and (QWEN25.patch_size, QWEN25.min_pixels, QWEN25.max_pixels) == (14, 3136, 12845056)
    assert QWEN3 is not None and (QWEN3.patch_size, QWEN3.min_pixels) == (16, 65536)


_VLLM_HASH = """
import json, sys
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media.image import ImageMediaIO
out = []
for path in sys.argv[2:]:
    item = ImageMediaIO().load_bytes(open(path, "rb").read())
    out.append(MultiModalHasher.hash_kwargs("blake3", model_id=sys.argv[1], image=item))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_hashes_equal_vllms(tmp_path: Path) -> None:
    venv = vllm033_venv()
    if venv is None:
        pytest.skip("vLLM 0.33 peer not installed")
    images = {"rgb.png": encode(noise_image(31, 17, seed=1), "PNG"), "rgb.jpg": encode(noise_image(40, 30), "JPEG"),
              "rgba.png": encode(noise_image(9, 9, seed=2, mode="RGBA"), "PNG"),
              "gray.webp": encode(noise_image(12, 5, seed=4, mode="L"), "WEBP")}
    paths = []
    for name, data in images.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    model = "Qwen/Qwen2.5-VL-3B-Instruct"
    done = subprocess.run([str(venv / "bin" / "python"), "-c", _VLLM_HASH, model, *paths], capture_output=True,
                          text=True, timeout=300, env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    expected = json.loads(done.stdout.strip().splitlines()[-1])
    ours = []
    for data in images.values():
        _, converted = decode_rgb(data, read_header(data, ImageBounds(), "img"), "img")
        ours.append(image_hash(data, model, converted=converted))
    assert ours == expected


def test_image_flags_set_the_bounds() -> None:
    from render_service.cli import build_parser, image_bounds

    args = build_parser().parse_args(["serve", "m", "--limit-mm-per-prompt", '{"image": 4}', "--max-image-bytes",
                                      "1000", "--max-image-pixels", "640000", "--max-request-image-pixels", "9"])
    assert image_bounds(args) == ImageBounds(max_image_bytes=1000, max_image_pixels=640000, max_request_pixels=9,
                                             max_images=4)
    assert image_bounds(build_parser().parse_args(["serve", "m"])) == ImageBounds()
    assert args.mm_device_do_normalize  # vLLM's default: raw uint8 pixels, normalised by the engine
    assert not build_parser().parse_args(["serve", "m", "--no-mm-device-do-normalize"]).mm_device_do_normalize
    for bad in (["--limit-mm-per-prompt", "[4]"], ["--max-image-bytes", "0"]):
        with pytest.raises(SystemExit):
            image_bounds(build_parser().parse_args(["serve", "m", *bad]))


def test_a_dead_worker_is_a_503_and_the_next_image_gets_a_fresh_pool() -> None:
    import os
    import signal

    from render_service.http.errors import ApiError
    from render_service.multimodal.pool import ImagePool

    assert QWEN25 is not None
    # a kill that lands while the worker sends its answer leaves the executor waiting: the timeout ends that wait
    pool = ImagePool(1, work_timeout_s=15)
    try:
        pool.warm_up()
        data = encode(noise_image(5000, 3400, seed=8), "JPEG")  # a second or more of work: time to kill its worker
        header = read_header(data, ImageBounds(), "img")
        small = encode(noise_image(32, 32, seed=9), "PNG")

        async def kill_mid_work() -> None:
            task = asyncio.ensure_future(pool.process("big", data, header, QWEN25, "m", True))
            await asyncio.sleep(0.3)
            for pid in list(pool._executor._processes):  # the worker busy with it
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(ApiError) as died:
                await task
            assert died.value.status == 503 and died.value.headers == {"Retry-After": "1"}
            again = await pool.process("small", small, read_header(small, ImageBounds(), "img"), QWEN25, "m", False)
            assert again.num_tokens == 4  # 32x32 is raised to min_pixels: 56x56, 4x4 patches, 2x2 merged

        asyncio.run(kill_mid_work())
        assert pool.pending == 0
    finally:
        pool.shutdown()
