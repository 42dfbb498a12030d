"""Chat templates we ship for model types whose repositories carry a Python prompt encoder instead of a Jinja
template (DeepSeek-V3.2 / V4): our own templates follow the encoders' rules and are tested against them; a bundle
of such a model type without a template of its own renders with ours."""

from __future__ import annotations

from importlib import resources

BUILTIN_TEMPLATES = {"deepseek_v4": "deepseek_v4_template.jinja", "deepseek_v32": "deepseek_v32_template.jinja"}


def builtin_template_source(model_type: str | None) -> str | None:
    name = BUILTIN_TEMPLATES.get(model_type or "")
    if name is None:
        return None
    return resources.files("render_service.bundle").joinpath(name).read_text(encoding="utf-8")
