"""Limits on an image checked before its pixels are decoded: encoded bytes, the dimensions its header declares,
and the pixels of all images of one request. A decompression bomb or a malformed file is a 400, never an
out-of-memory: only the header is read until every limit has passed."""

from __future__ import annotations

import io
import warnings

import msgspec
from PIL import Image

from render_service.http.errors import ApiError

# Formats an image part may carry; anything else Pillow could open (PSD, EPS...) is refused.
ALLOWED_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})


class ImageBounds(msgspec.Struct, frozen=True):
    max_image_bytes: int = 20 * 1024 * 1024  # encoded, per image
    max_image_pixels: int = 6144 * 6144  # declared width x height, per image
    max_request_pixels: int = 8 * 4096 * 4096  # declared pixels of all images of one request
    max_images: int = 32  # per request


class ImageError(ApiError):
    """An image the render tier will not take: a 400 naming the offending content part."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message, 400, param)


class ImageHeader(msgspec.Struct, frozen=True):
    format: str
    width: int
    height: int
    mode: str


def check_encoded_size(size: int, bounds: ImageBounds, where: str) -> None:
    if size > bounds.max_image_bytes:
        raise ImageError(f"{where}: the image is {size} bytes, over the limit of {bounds.max_image_bytes} bytes")


def read_header(data: bytes, bounds: ImageBounds, where: str) -> ImageHeader:
    """The format and declared size of ``data``, from its header alone; a 400 when it is not an image of an
    allowed format or declares more pixels than one image may have."""
    check_encoded_size(len(data), bounds, where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=sorted(ALLOWED_FORMATS)) as image:
                header = ImageHeader(str(image.format), image.width, image.height, image.mode)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        # Pillow's own bomb check fires while opening, before our per-image limit sees the size
        raise ImageError(f"{where}: the image declares more pixels than the decompression-bomb limit "
                         f"({Image.MAX_IMAGE_PIXELS} pixels)") from None
    except (OSError, SyntaxError, ValueError, RuntimeError) as exc:
        raise ImageError(f"{where}: not a readable image ({', '.join(sorted(ALLOWED_FORMATS))}): "
                         f"{type(exc).__name__}") from None
    if header.width <= 0 or header.height <= 0:
        raise ImageError(f"{where}: the image declares an empty size {header.width}x{header.height}")
    if header.width * header.height > bounds.max_image_pixels:
        raise ImageError(f"{where}: the image declares {header.width}x{header.height} pixels, over the limit of "
                         f"{bounds.max_image_pixels} pixels per image")
    return header


def check_request_pixels(headers: list[ImageHeader], bounds: ImageBounds) -> None:
    total = sum(h.width * h.height for h in headers)
    if total > bounds.max_request_pixels:
        raise ImageError(f"the request's images declare {total} pixels in all, over the limit of "
                         f"{bounds.max_request_pixels} pixels per request")


EXIF_ORIENTATION = 0x0112


def decode_rgb(data: bytes, header: ImageHeader, where: str) -> tuple[Image.Image, bool]:
    """The pixels of an image whose header passed ``read_header``, as vLLM's image loader gives them: EXIF
    orientation applied, transparency composited onto white, RGB (the first frame of an animation); and
    whether its mode had to be converted (vLLM's hash then covers the conversion)."""
    from PIL import ImageOps

    try:
        # Not a with-block: closing an image destroys its pixels, and an image that needs no turn is kept as it
        # is (exif_transpose copies even an image it leaves unchanged). Its file is in memory: nothing to release.
        opened = Image.open(io.BytesIO(data), formats=[header.format])
        if (opened.width, opened.height) != (header.width, header.height):
            raise ImageError(f"{where}: the image changed size between its header and its pixels")
        opened.load()
        image = ImageOps.exif_transpose(opened) if opened.getexif().get(EXIF_ORIENTATION, 1) != 1 else opened
    except ImageError:
        raise
    except (OSError, SyntaxError, ValueError, RuntimeError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{where}: the image could not be decoded: {type(exc).__name__}") from None
    rgb = to_rgb(image)
    return rgb, rgb is not image


def has_transparency(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA") or "transparency" in getattr(image, "info", {})


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as vLLM converts (white behind transparency); the same object when it already is RGB."""
    if has_transparency(image):
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.split()[3])
        return flat
    return image if image.mode == "RGB" else image.convert("RGB")
