"""Real image files for the multimodal tests, made with Pillow: noise, so resizing has work to do and a wrong
patch order shows, in PNG, JPEG and WebP; plus a PNG that only declares a huge size, and a truncated file. Also the
Qwen2.5-VL-shaped bundle, and a tiny random-weight Qwen2.5-VL on it for a real engine."""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from tests.shared_paths import QWEN3_FIXTURE_DIR

VL_FIXTURE = Path(__file__).parent / "fixtures" / "qwen2_5_vl"


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels if channels > 1 else pixels[:, :, 0], mode=mode)


def encode(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def declared_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height over a few bytes of pixel data: a decompression bomb's
    shape (decoding it would allocate width * height * 3 bytes)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + _chunk(b"IEND", b""))


def write_qwen2_5_vl_bundle(root: Path) -> Path:
    """A Qwen2.5-VL-shaped bundle without weights: the real Qwen3 tokenizer (which has Qwen2.5-VL's vision
    tokens), Qwen2.5-VL's chat template, config.json and preprocessor settings."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_FIXTURE_DIR / name, root / name)
    for name in ("chat_template.jinja", "config.json", "preprocessor_config.json"):
        shutil.copy(VL_FIXTURE / name, root / name)
    return root


def write_tiny_qwen2_5_vl(root: Path, max_pixels: int = 256 * 28 * 28) -> Path:
    """A tiny random-weight Qwen2.5-VL (float32, head_dim 32 as vLLM's CPU attention needs) beside the bundle's
    tokenizer, chat template and processor settings; ``max_pixels`` caps each image (and vLLM's encoder profiling
    run) at 256 placeholder tokens. The weights are drawn wide (std 0.5) so greedy tokens follow the image: with
    the usual 0.02 every prompt decodes to the same token."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    root.mkdir(parents=True, exist_ok=True)
    text = {"vocab_size": 151936, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096,
            "initializer_range": 0.5,
            # M-RoPE splits head_dim / 2 = 16 rotary pairs over (time, height, width)
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 64,
              "fullatt_block_indexes": [1], "initializer_range": 0.5}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                              image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                              vision_end_token_id=151653)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).save_pretrained(root)
    model_config = (root / "config.json").read_bytes()
    write_qwen2_5_vl_bundle(root)
    (root / "config.json").write_bytes(model_config)  # the bundle's config.json describes the 7B model
    settings = json.loads((root / "preprocessor_config.json").read_text())
    (root / "preprocessor_config.json").write_text(json.dumps({**settings, "max_pixels": max_pixels}, indent=2))
    return root


# Gemma 4's vision settings: config.json's vision_config and the image processor's (transformers' Gemma4Config,
# Gemma4VisionConfig and Gemma4ImageProcessor defaults; default_output_length is the budget vLLM reads)
GEMMA4_IMAGE_PROCESSOR = {
    "image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_resize": True, "resample": 3,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False, "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0], "patch_size": 16, "max_soft_tokens": 280, "pooling_kernel_size": 3,
}


def write_gemma4_vision_bundle(root: Path, budget: int = 280, dtype: str = "bfloat16",
                               nested: bool = False) -> Path:
    """A Gemma 4 bundle without weights: the Gemma 4 test tokenizer with Gemma 4's media tokens at their ids,
    Gemma 4's real chat template (tests/family_bundles.py), config.json with its vision_config, and the image
    processor's settings with ``budget`` soft tokens, in preprocessor_config.json or (``nested``) in
    processor_config.json's ``image_processor``, as transformers 5 writes a processor."""
    from tests.family_bundles import write_family_bundle

    write_family_bundle("gemma4_vision", root)
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "dtype": dtype, "boi_token_id": 255999, "eoi_token_id": 258882,
              "image_token_id": 258880,
              "text_config": {"model_type": "gemma4_text", "max_position_embeddings": 131072},
              "vision_config": {"model_type": "gemma4_vision", "patch_size": 16, "pooling_kernel_size": 3,
                                "default_output_length": budget}}
    (root / "config.json").write_text(json.dumps(config, indent=2))
    settings = {**GEMMA4_IMAGE_PROCESSOR, "max_soft_tokens": budget}
    if nested:
        (root / "processor_config.json").write_text(json.dumps(
            {"image_processor": settings, "image_seq_length": budget, "processor_class": "Gemma4Processor"}, indent=2))
    else:
        (root / "preprocessor_config.json").write_text(json.dumps(settings, indent=2))
    return root
