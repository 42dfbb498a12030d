"""The image renderer for a loaded bundle: its family from config.json / preprocessor_config.json, the image
token's id (and Gemma 4's begin/end of image ids) from its tokenizer, a worker pool, the bounds and the fetch
policy from the server's flags."""

from __future__ import annotations

from typing import TYPE_CHECKING

from render_service.multimodal.bounds import ImageBounds
from render_service.multimodal.chat import MultimodalRender
from render_service.multimodal.families import BudgetFamily, family_from_bundle
from render_service.multimodal.pool import ImagePool
from render_service.multimodal.sources import FetchPolicy

if TYPE_CHECKING:
    from render_service.render.render_config import RenderConfig


def multimodal_render_for(config: RenderConfig, *, model_id: str | None = None, workers: int | None = None,
                          allowed_domains: tuple[str, ...] = (), fetch_timeout_s: float = 10.0,
                          bounds: ImageBounds | None = None, max_pending: int = 256,
                          device_normalize: bool = True) -> MultimodalRender | None:
    """None when the bundle is not a covered vision-language model (images are then a 400 naming those)."""
    family = family_from_bundle(config.bundle.path)
    if family is None:
        return None
    token_id, *wrap = (_token_id(config, token, family.name) for token in (
        family.image_token, *((family.boi_token, family.eoi_token) if isinstance(family, BudgetFamily) else ())))
    # vLLM hashes with the model it was started with (its --model, as given: a hub id or a path)
    name = model_id or str(config.bundle.path)
    return MultimodalRender(family, token_id, name, ImagePool(workers, max_pending=max_pending),
                            bounds or ImageBounds(), FetchPolicy(allowed_domains, fetch_timeout_s),
                            normalize=not device_normalize, wrap_ids=(tuple(wrap[:1]), tuple(wrap[1:])))


def _token_id(config: RenderConfig, token: str, family: str) -> int:
    token_id = config.tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token} token, which {family} needs")
    return token_id
