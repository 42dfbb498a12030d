"""Gemma 4's images through the render tier, against transformers' real Gemma 4 processor built offline from
the test bundle (Gemma 4's real chat template, the Gemma 4 test tokenizer with its media tokens at their ids,
Gemma 4's image processor settings): soft-token counts and pixel values for each budget and many sizes, token
ids, placeholder ranges, hashes and wire items over HTTP, and the sizes and bundles that are refused."""

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
from render_service.bundle.model_bundle import load_bundle
from render_service.multimodal import gemma4
from render_service.multimodal.bounds import ImageError
from render_service.multimodal.families import SUPPORTED, BudgetFamily, family_from_bundle, family_from_configs
from render_service.multimodal.hashing import image_hash
from render_service.multimodal.setup import multimodal_render_for
from render_service.render.render_config import build_render_config
from tests.multimodal_images import GEMMA4_IMAGE_PROCESSOR, data_url, encode, noise_image, write_gemma4_vision_bundle
from tests.render_harness import RenderServer, image_render_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil  # noqa: E402
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor  # noqa: E402

MODEL = "google/gemma-4-31B-it"
BOI, IMAGE, EOI = 255999, 258880, 258882
SIZES = [(640, 480), (1280, 720), (1920, 1080), (48, 48), (5, 9), (1000, 7), (7, 1000), (3001, 17), (333, 4321),
         (896, 896), (1, 1), (700, 1000)]


def _family(budget: int, dtype: str | None = None) -> BudgetFamily:
    """Gemma 4 at ``budget`` from configs; ``dtype``: the pixel values' (float32: transformers' own values)."""
    family = family_from_configs({"model_type": "gemma4", "vision_config": {"patch_size": 16}},
                                 {**GEMMA4_IMAGE_PROCESSOR, "max_soft_tokens": budget})
    assert isinstance(family, BudgetFamily)
    return msgspec.structs.replace(family, pixel_dtype=dtype) if dtype else family


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """torch's own float32 -> bfloat16 rounding, as the bits our items carry."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("budget", [70, 280, 1120])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_soft_tokens_and_pixel_values_equal_transformers(budget: int, size: tuple[int, int]) -> None:
    image = noise_image(*size, seed=size[0] * 3 + size[1] + budget)
    expected = Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=[image], return_tensors="np")
    family = _family(budget, "float32")
    assert gemma4.soft_token_count(size[1], size[0], family) == expected["num_soft_tokens_per_image"][0]
    values = gemma4.pixel_values(image, family).view(np.float32)
    np.testing.assert_array_equal(values, expected["pixel_values"][0])
    bf16 = gemma4.pixel_values(image, _family(budget, "bfloat16"))
    np.testing.assert_array_equal(bf16, _bf16_bits(expected["pixel_values"][0]))


def test_a_size_where_vllm_and_transformers_disagree_is_refused() -> None:
    """At 70 soft tokens a 1190 x 17 image is 70 tokens to transformers' processor and 69 to vLLM 0.33's prompt
    (the same rule rounded another way): vLLM's model would refuse the prompt, so the render tier says why."""
    family = _family(70)
    expected = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[noise_image(1190, 17)], return_tensors="np")
    assert expected["num_soft_tokens_per_image"][0] == 70 and gemma4.target_size(17, 1190, family) == (48, 3360)
    with pytest.raises(ImageError, match="1190x17 pixels gets 70 soft tokens .* but 69 from vLLM"):
        gemma4.soft_token_count(17, 1190, family)


def test_family_detection_and_refusals(tmp_path: Path) -> None:
    assert family_from_configs({"model_type": "gemma4"}, {}) is None  # a text-only Gemma 4 bundle
    assert family_from_configs({"model_type": "gemma3", "vision_config": {}}, {}) is None
    assert family_from_configs({"model_type": "gemma3n", "vision_config": {}}, {}) is None
    assert "Gemma 4" in SUPPORTED and "not Gemma 3" in SUPPORTED
    with pytest.raises(ValueError, match="must agree"):
        family_from_configs({"model_type": "gemma4", "vision_config": {"default_output_length": 280}},
                            {"max_soft_tokens": 560})
    with pytest.raises(ValueError, match="one of"):
        family_from_configs({"model_type": "gemma4", "vision_config": {"x": 1}}, {"max_soft_tokens": 300})
    with pytest.raises(ValueError, match="patch_size differs"):
        family_from_configs({"model_type": "gemma4", "vision_config": {"patch_size": 14}}, {"patch_size": 16})
    nested = family_from_bundle(write_gemma4_vision_bundle(tmp_path / "nested", budget=560, nested=True))
    assert isinstance(nested, BudgetFamily) and (nested.max_soft_tokens, nested.pixel_dtype) == (560, "bfloat16")
    float32 = family_from_configs({"model_type": "gemma4", "dtype": "float32", "vision_config": {"x": 1}}, {})
    assert isinstance(float32, BudgetFamily) and float32.pixel_dtype == "bfloat16"  # vLLM's "auto" for float32


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma4_vision_bundle(tmp_path_factory.mktemp("gemma4_vision"))


@pytest.fixture(scope="module")
def server(bundle_dir: Path):
    with image_render_server(bundle_dir, "g4", MODEL, workers=2) as (started, mm):
        assert mm.wrap_ids == ((BOI,), (EOI,))
        yield started


class _ImagesOnlyProcessor(Gemma4Processor):
    """transformers' Gemma 4 processor without its audio feature extractor and video processor (the video one
    needs torchvision): the text and image paths are the processor's own."""

    def __init__(self, image_processor, tokenizer, chat_template):  # noqa: ANN001
        self.image_seq_length = image_processor.max_soft_tokens
        self.image_token, self.boi_token, self.eoi_token = tokenizer.image_token, tokenizer.boi_token, tokenizer.eoi_token
        self.image_token_id = tokenizer.image_token_id
        self.video_token, self.video_token_id = "<|video|>", tokenizer.convert_tokens_to_ids("<|video|>")
        self.audio_token, self.boa_token, self.eoa_token = "<|audio|>", "<|audio>", "<audio|>"
        self.audio_token_id = tokenizer.convert_tokens_to_ids("<|audio|>")
        self.image_processor, self.tokenizer, self.video_processor, self.feature_extractor = (
            image_processor, tokenizer, None, None)
        self.chat_template = chat_template


@pytest.fixture(scope="module")
def reference(bundle_dir: Path) -> _ImagesOnlyProcessor:
    config = json.loads((bundle_dir / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(bundle_dir / "tokenizer.json"), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={key: config[key] for key in ("image_token", "boi_token", "eoi_token")})
    settings = json.loads((bundle_dir / "preprocessor_config.json").read_text())
    image_processor = Gemma4ImageProcessorPil(**{k: v for k, v in settings.items() if k != "image_processor_type"})
    return _ImagesOnlyProcessor(image_processor, tokenizer, config["chat_template"])


def _interleaved() -> tuple[list, list, list[bytes]]:
    """(our request's messages, the same for transformers, the images' bytes in prompt order)."""
    # (864 x 720 is its own target size at 280 soft tokens: no resize)
    files = [encode(noise_image(864, 720, seed=1), "PNG"), encode(noise_image(1280, 720, seed=2), "JPEG"),
             encode(noise_image(150, 2000, seed=3), "WEBP"), encode(noise_image(90, 60, seed=4, mode="RGBA"), "PNG")]
    mimes = ["image/png", "image/jpeg", "image/webp", "image/png"]
    part = [{"type": "image_url", "image_url": {"url": data_url(data, mime)}} for data, mime in zip(files, mimes)]
    ours = [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, part[0], {"type": "text", "text": " with "},
                                     part[1]]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [part[2], {"type": "text", "text": "And this tall one, and"}, part[3]]},
    ]
    theirs = [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                     {"type": "text", "text": " with "}, {"type": "image"}]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this tall one, and"},
                                     {"type": "image"}]},
    ]
    return ours, theirs, files


def _wire_item(text: str) -> dict[str, tuple[str, np.ndarray]]:
    """An item as vLLM's MsgpackDecoder reads it: each field's [dtype, shape, ext 3 (raw bytes)] and its factory."""
    item = msgspec.msgpack.decode(base64.b64decode(text), ext_hook=lambda code, data: (code, bytes(data)))
    out = {}
    for key, elem in item.items():
        dtype, shape, (code, raw) = elem["data"]
        assert code == 3 and elem["field"] == ["batched", {"keep_on_cpu": False}]
        out[key] = (dtype, np.frombuffer(raw, dtype=np.uint16 if dtype == "bfloat16" else dtype).reshape(shape))
    return out


def test_render_equals_transformers_processor(server: RenderServer, reference: _ImagesOnlyProcessor,
                                               bundle_dir: Path) -> None:
    ours, theirs, files = _interleaved()
    text = reference.apply_chat_template(theirs, tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(data)).convert("RGBA") for data in files]
    images = [image.convert("RGB") if i < 3 else _on_white(image) for i, image in enumerate(images)]
    expected = reference(text=[text], images=images, return_tensors="np")
    r = server.client.post("/v1/chat/completions/render", json={"model": "g4", "messages": ours})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["token_ids"]
    assert ids == [int(t) for t in expected["input_ids"][0]]

    features = body["features"]
    # (the processor drops its per-image counts from its output: its real patches, 9 per soft token, give them)
    counts = [int((positions[:, 0] >= 0).sum()) // 9 for positions in expected["image_position_ids"]]
    starts = [i for i, token in enumerate(ids) if token == BOI]
    assert features["mm_placeholders"] == {"image": [{"offset": s, "length": n + 2} for s, n in zip(starts, counts)]}
    for s, n in zip(starts, counts):
        assert ids[s:s + n + 2] == [BOI] + [IMAGE] * n + [EOI]
    assert features["mm_hashes"] == {"image": [image_hash(data, MODEL, converted=i == 3)
                                               for i, data in enumerate(files)]}
    assert features["mm_metadata"] is None and "mm_grid_thw" not in features  # (vLLM has no CPU-side fields)
    for text_item, values, positions in zip(features["kwargs_data"]["image"], expected["pixel_values"],
                                            expected["image_position_ids"]):
        item = _wire_item(text_item)
        assert list(item) == ["pixel_values", "pixel_position_ids"]
        assert item["pixel_values"][0] == "bfloat16" and item["pixel_values"][1].shape == (2520, 768)
        np.testing.assert_array_equal(item["pixel_values"][1], _bf16_bits(values))
        assert item["pixel_position_ids"][0] == "int64"
        np.testing.assert_array_equal(item["pixel_position_ids"][1], positions)

    none = server.client.post("/v1/chat/completions/render", json={"model": "g4", "messages": ours,
                                                                   "mm_payload": "none"})
    assert none.status_code == 200, none.text
    assert none.json()["token_ids"] == ids
    light = none.json()["features"]
    assert light["kwargs_data"] is None and light["mm_metadata"] is None
    assert (light["mm_hashes"], light["mm_placeholders"]) == (features["mm_hashes"], features["mm_placeholders"])


def test_per_request_processor_settings_are_refused(server: RenderServer) -> None:
    """vLLM would apply a request's max_soft_tokens; the render tier renders with the bundle's budget only, so it
    says so (an empty mapping changes nothing and passes)."""
    ours, _, _ = _interleaved()
    for kwargs, status in (({"max_soft_tokens": 560}, 400), ({}, 200)):
        r = server.client.post("/v1/chat/completions/render", json={"model": "g4", "messages": ours,
                                                                    "mm_payload": "none", "mm_processor_kwargs": kwargs})
        assert r.status_code == status, r.text
    r = server.client.post("/v1/chat/completions/render", json={"model": "g4", "messages": ours,
                                                                "mm_processor_kwargs": {"max_soft_tokens": 560}})
    assert r.json()["error"]["param"] == "mm_processor_kwargs"


def _on_white(image: Image.Image) -> Image.Image:
    """An RGBA image as vLLM's loader (and ours) flattens it: onto white."""
    flat = Image.new("RGB", image.size, (255, 255, 255))
    flat.paste(image, mask=image.split()[3])
    return flat


def test_a_refused_size_is_a_400(tmp_path: Path) -> None:
    """A bundle at 70 soft tokens answers the size where vLLM and transformers disagree with a 400 naming it."""
    root = write_gemma4_vision_bundle(tmp_path / "budget70", budget=70)
    with image_render_server(root, "g4", MODEL, workers=1) as (started, _):
        ok, bad = ({"model": "g4", "mm_payload": "none", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(encode(noise_image(*size), "PNG"))}}]}]}
            for size in ((1190, 18), (1190, 17)))
        assert started.client.post("/v1/chat/completions/render", json=ok).status_code == 200
        r = started.client.post("/v1/chat/completions/render", json=bad)
    assert r.status_code == 400, r.text
    assert "1190x17" in r.json()["error"]["message"]


def test_a_text_only_gemma4_bundle_refuses_images(tmp_path: Path) -> None:
    from tests.family_bundles import write_family_bundle

    config = build_render_config(load_bundle(str(write_family_bundle("gemma4", tmp_path / "text"))),
                                 served_model_names=["g4"])
    assert multimodal_render_for(config) is None
    with RenderServer(config) as started:
        r = started.client.post("/v1/chat/completions/render", json={"model": "g4", "messages": [{"role": "user",
                                "content": [{"type": "image_url", "image_url": {"url": data_url(
                                    encode(noise_image(8, 8), "PNG"))}}]}]})
    assert r.status_code == 400 and "Gemma 4" in r.json()["error"]["message"], r.text


# vLLM 0.33's own Gemma 4 processor on the bundle: the prompt's token ids (as vLLM's Gemma 4 tokenizes a chat
# prompt: no added specials) and the images loaded by vLLM's loader, then the features vLLM's render sends.
_VLLM_RENDER = """
import json, sys
from vllm.config import ModelConfig
from vllm.entrypoints.scale_out.token_in_token_out.mm_features import extract_mm_features
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.media.image import ImageMediaIO
bundle, text, *paths = sys.argv[1:]
config = ModelConfig(model=bundle, tokenizer=bundle, max_model_len=16384)
processor = MULTIMODAL_REGISTRY.create_processor(config)
ids = processor.info.get_tokenizer().encode(text, add_special_tokens=False)
images = [ImageMediaIO().load_bytes(open(path, "rb").read()) for path in paths]
out = processor(ids, processor.info.parse_mm_data({"image": images}))
print(json.dumps({"token_ids": out["prompt_token_ids"], "features": extract_mm_features(out).model_dump()}))
"""


@pytest.mark.slow
def test_vllm_renders_the_same_features(bundle_dir: Path, reference: _ImagesOnlyProcessor, tmp_path: Path) -> None:
    """vLLM 0.33's Gemma 4 processor on the same bundle, prompt and image bytes: the same token ids, hashes,
    placeholder ranges, no metadata items, and items of the same fields, dtypes and shapes, with the same
    positions. Pixel values: equal for the image that needs no resize; resized ones differ by at most 4 levels
    (vLLM resizes with torchvision's bicubic where a torchvision is installed, transformers' PIL processor, our
    reference, with Pillow's: docs/images.md)."""
    venv = vllm033_venv()
    if venv is None:
        pytest.skip("vLLM 0.33 peer not installed")
    ours, theirs, files = _interleaved()
    paths = []
    for i, data in enumerate(files):
        paths.append(tmp_path / f"image{i}")
        paths[-1].write_bytes(data)
    text = reference.apply_chat_template(theirs, tokenize=False, add_generation_prompt=True)
    done = subprocess.run([str(venv / "bin" / "python"), "-c", _VLLM_RENDER, str(bundle_dir), text,
                           *map(str, paths)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    theirs_answer = json.loads(done.stdout.strip().splitlines()[-1])

    # (vLLM hashes with its --model)
    with image_render_server(bundle_dir, "g4", str(bundle_dir), workers=1) as (started, _):
        r = started.client.post("/v1/chat/completions/render", json={"model": "g4", "messages": ours})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["token_ids"] == theirs_answer["token_ids"]
    vllm_features = theirs_answer["features"]
    for key in ("mm_hashes", "mm_placeholders", "mm_metadata"):
        assert answer["features"][key] == vllm_features[key], key
    differences = []
    for ours_item, vllm_item in zip(answer["features"]["kwargs_data"]["image"], vllm_features["kwargs_data"]["image"],
                                    strict=True):
        mine, vllms = _wire_item(ours_item), _wire_item(vllm_item)
        assert sorted(mine) == sorted(vllms)
        for key, (dtype, values) in mine.items():
            assert dtype == vllms[key][0] and values.shape == vllms[key][1].shape, key
        np.testing.assert_array_equal(mine["pixel_position_ids"][1], vllms["pixel_position_ids"][1])
        differences.append(np.abs(_bf16_values(mine["pixel_values"][1]) - _bf16_values(vllms["pixel_values"][1])))
    assert differences[0].max() == 0  # the image without a resize
    assert all(0 < difference.max() <= 4 / 255 for difference in differences[1:])


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_messages_render_and_count_tokens(server: RenderServer, reference: _ImagesOnlyProcessor) -> None:
    """The Messages API's base64 image blocks take the same path: the token ids of the chat render, the same
    features, and count_tokens counting each image's wrap and soft tokens."""
    ours, theirs, files = _interleaved()

    def block(data: bytes, mime: str) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": mime,
                                            "data": base64.b64encode(data).decode()}}

    body = {"model": "g4", "max_tokens": 16, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, block(files[0], "image/png"),
                                     {"type": "text", "text": " with "}, block(files[1], "image/jpeg")]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [block(files[2], "image/webp"), {"type": "text", "text": "And this tall one, and"},
                                     block(files[3], "image/png")]},
    ]}
    r = server.client.post("/v1/messages/render", json=body)
    assert r.status_code == 200, r.text
    chat = server.client.post("/v1/chat/completions/render", json={"model": "g4", "messages": ours}).json()
    assert r.json()["token_ids"] == chat["token_ids"] and r.json()["features"] == chat["features"]
    count = server.client.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"})
    assert count.status_code == 200, count.text
    assert count.json()["input_tokens"] == len(chat["token_ids"])
