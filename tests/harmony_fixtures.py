"""The gpt-oss test bundle (built from packages once per cache: render_service/harmony/bundle.py) and
render configurations over it, shared by the Harmony tests."""

from __future__ import annotations

import functools

from render_service.bundle.model_bundle import load_bundle
from render_service.harmony.bundle import gpt_oss_bundle_dir
from render_service.render.render_config import RenderConfig, build_render_config

MODEL = "gpt-oss-tiny"
DATE = "2026-12-01"


@functools.cache
def gpt_oss_dir() -> str:
    return str(gpt_oss_bundle_dir())


@functools.cache
def gpt_oss_bundle():
    return load_bundle(gpt_oss_dir())


@functools.cache
def gpt_oss_config(tools: bool = True) -> RenderConfig:
    flags = {"tool_call_parser": "openai", "enable_auto_tool_choice": True} if tools else {}
    return build_render_config(gpt_oss_bundle(), served_model_names=[MODEL], reasoning_parser="openai_gptoss",
                               **flags)


def encode(text: str) -> list[int]:
    """Harmony text (markers included) as the model's token IDs."""
    return gpt_oss_bundle().tokenizer.encode(text)
