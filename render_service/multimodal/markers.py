"""A cheap byte test that keeps text-only chat bodies off the image path (no image dependency imported)."""

from __future__ import annotations

# The part types that carry an image in OpenAI chat, Responses and Anthropic Messages bodies.
_MARKERS = (b'"image_url"', b'"input_image"', b'"image"')


def may_carry_images(body: bytes) -> bool:
    return any(marker in body for marker in _MARKERS)
