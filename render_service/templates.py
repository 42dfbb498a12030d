"""Chat templates rendered the way Hugging Face's apply_chat_template does (first minimal version)."""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template failed to render this conversation (a client error: 400)."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: __import__("json").dumps(x, ensure_ascii=False, **kw)
        self._template = env.from_string(source)
        self._special = special_tokens or {}

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        try:
            return self._template.render(
                messages=messages, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **self._special, **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(str(exc)) from exc
