"""Where one image's CPU goes, stage by stage, in one process: the server's share (base64 of the data URL, header
check, content key), the worker's (decode, vLLM's hash, resize, patchify into the item's msgpack bytes, base64,
the write into a shared slot) and the server's again (the copy out of the slot, the JSON answer around the
item, in pieces).
Photo-like JPEG and PNG images made in-process, the Qwen2.5-VL fixture's settings, uint8 pixel values (vLLM's
default) unless --normalize. Each stage's best of --repeat runs, in ms: a breakdown, not a load test (the image
render bench measures the server under load, against vLLM's).

usage: python -m bench.image_stages [--resolutions 480p,720p,1080p] [--formats JPEG,PNG] [--repeat 7] [--normalize]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import time
from collections.abc import Callable
from typing import Any

import msgspec
from PIL import Image

from bench.image_render_bench import RESOLUTIONS, VL_FIXTURE, photo_like
from render_service.multimodal.bounds import ImageBounds, decode_rgb, read_header
from render_service.multimodal.families import family_from_bundle
from render_service.multimodal.features import answer_pieces, build_features
from render_service.multimodal.hashing import content_key, image_hash
from render_service.multimodal.pool import ProcessedImage, _item_bytes
from render_service.multimodal.qwen_vl import grid_thw, patches_shape, pixel_values
from render_service.multimodal.shared_slots import AttachedSlot, SharedSlots
from render_service.multimodal.sources import image_ref
from render_service.multimodal.wire import b64encode, item_layout, metadata_item
from render_service.wire.protocol import GenerateRequest


def _best(repeat: int, work: Callable[[], Any]) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        result = work()
        best = min(best, time.perf_counter() - started)
    return best * 1000, result


def stages(data: bytes, repeat: int, normalize: bool) -> dict[str, float]:
    family = family_from_bundle(VL_FIXTURE)
    assert family is not None
    bounds = ImageBounds()
    url = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
    out: dict[str, float] = {}
    out["server: data URL base64"], _ = _best(repeat, lambda: image_ref(url, "img", bounds))
    out["server: header"], header = _best(repeat, lambda: read_header(data, bounds, "img"))
    out["server: content key"], _ = _best(repeat, lambda: content_key(data))
    out["worker: decode"], (image, converted) = _best(repeat, lambda: decode_rgb(data, header, "img"))
    out["worker: vLLM hash"], digest = _best(repeat, lambda: image_hash(data, "m", converted=converted))
    grid = grid_thw(image.height, image.width, family)
    size = (grid[2] * family.patch_size, grid[1] * family.patch_size)
    out["worker: resize"], _ = _best(repeat, lambda: image.resize(size, Image.Resampling.BICUBIC))
    layout = item_layout("float32" if normalize else "uint8", *patches_shape(grid, family), grid)
    item, values = _item_bytes(layout)
    whole, _ = _best(repeat, lambda: pixel_values(image, family, normalize, values))
    out["worker: normalise + patchify" if normalize else "worker: patchify"] = whole - out["worker: resize"]
    out["worker: base64"], text = _best(repeat, lambda: b64encode(item))
    slots = SharedSlots(1)

    async def one_slot() -> tuple[float, float, bytes]:
        slot = await slots.acquire(len(text) + 2)
        assert slot is not None
        with AttachedSlot(slot.ref) as shared:
            written, length = _best(repeat, lambda: shared.write_quoted(text))
        read, quoted = _best(repeat, lambda: slots.read(slot, length))
        slots.release(slot)
        return written, read, quoted

    out["worker: write to slot"], out["server: copy from slot"], quoted = asyncio.run(one_slot())
    slots.close()
    processed = ProcessedImage(digest, grid, 1, quoted, metadata_item(grid))
    encode = msgspec.json.Encoder().encode
    answer = GenerateRequest(token_ids=list(range(1000)), features=build_features([processed], [(10, 100)], True))
    out["server: JSON answer, in pieces"], _ = _best(repeat, lambda: answer_pieces(answer, encode))
    out["item MB"] = len(quoted) / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolutions", default="480p,720p,1080p")
    parser.add_argument("--formats", default="JPEG,PNG")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--normalize", action="store_true", help="float32 normalised values")
    args = parser.parse_args(argv)
    rows: dict[str, dict[str, float]] = {}
    for resolution in args.resolutions.split(","):
        jpeg = photo_like(*RESOLUTIONS[resolution], seed=1)
        for fmt in args.formats.split(","):
            data = jpeg
            if fmt == "PNG":
                buffer = io.BytesIO()
                Image.open(io.BytesIO(jpeg)).save(buffer, format="PNG")
                data = buffer.getvalue()
            rows[f"{resolution} {fmt}"] = stages(data, args.repeat, args.normalize)
    names = list(next(iter(rows.values())))
    print("| stage (ms) | " + " | ".join(rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{row[name]:.2f}" for row in rows.values()) + " |")
    totals = {key: sum(v for k, v in row.items() if k != "item MB") for key, row in rows.items()}
    print("| total | " + " | ".join(f"{total:.1f}" for total in totals.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
