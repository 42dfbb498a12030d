"""Real image files for the multimodal tests, made with Pillow: noise, so resizing has work to do and a wrong
patch order shows, in PNG, JPEG and WebP; plus a PNG that only declares a huge size, and a truncated file."""

from __future__ import annotations

import base64
import io
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
