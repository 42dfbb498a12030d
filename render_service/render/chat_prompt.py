"""A chat request's template inputs and its prompt's ids: what the full render (render.py) and the extend render
(extend/) both render and encode."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, overload

from render_service.http.errors import bad_request
from render_service.render.render_config import RenderConfig
from render_service.templates.chat_messages import convert_developer_role, prepare_messages, prepare_tools
from render_service.templates.chat_template import ChatTemplate
from render_service.templates.sandbox import TemplateError
from render_service.wire.protocol import ChatCompletionRequest


def chat_template_for(req: ChatCompletionRequest, config: RenderConfig) -> ChatTemplate:
    if req.chat_template is not None:
        if not config.trust_request_chat_template:
            raise bad_request(
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template.",
                "chat_template",
            )
        try:
            return ChatTemplate(req.chat_template, config.template_special_tokens,
                                time_limit_s=config.chat_template_timeout_s, from_request=True)
        except TemplateError as exc:
            raise bad_request(str(exc), "chat_template") from None
    if req.tools and config.tool_template is not None:
        return config.tool_template
    if config.template is None:
        raise bad_request(
            "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
            "template if the tokenizer does not define one.",
            "chat_template",
        )
    return config.template


def template_failure(exc: Exception) -> Exception:
    """The template ran on client data and choked on it (say, a number where it expects text): a 400."""
    return bad_request(f"The chat template failed on this request: {type(exc).__name__}: {exc}", "messages")


@contextmanager
def template_errors_answered() -> Iterator[None]:
    """A chat template's failures (its render, or the preparation of its inputs) answered as the client's: a
    refusal (``TemplateError``) a 400 with its message, naming ``messages``; a choke on the request's data
    ``template_failure``."""
    try:
        yield
    except TemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
        raise template_failure(exc) from None  # (a template bug on this input, not a server fault)


def chat_template_inputs(req: ChatCompletionRequest, config: RenderConfig, kwargs: dict[str, Any]
                         ) -> tuple[ChatTemplate, list[dict[str, Any]], dict[str, Any], list[dict[str, Any]] | None]:
    """(template, messages, keyword arguments, tools) of a chat request's template render (kwargs: resolved
    chat_template_kwargs); the extend render (render_service/extend/) renders the same inputs."""
    template = chat_template_for(req, config)
    with template_errors_answered():
        # As vLLM: content shaped for the template, developer role folded into system where the
        # template lacks it, tools in vLLM's model_dump shape.
        messages = convert_developer_role(prepare_messages(req.messages, template.content_format), template)
        tools = prepare_tools(req.tools) if req.tools else None
    arguments: dict[str, Any] = {
        "tools": tools,
        "documents": req.documents,
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
    }
    if req.reasoning_effort is not None:
        # vLLM 0.33 hands the request's reasoning_effort to the template too (DeepSeek-V4's reads it)
        arguments["reasoning_effort"] = req.reasoning_effort
    # As in vLLM, chat_template_kwargs override the request's own template arguments.
    arguments.update(kwargs)
    return template, messages, arguments, tools


def check_prompt_bound(text: str, config: RenderConfig, before: int = 0) -> None:
    """Refuses a prompt whose length alone proves that it cannot fit the context (``before``: ids it follows),
    before any tokenizing (a multi-megabyte prompt would cost seconds of CPU)."""
    at_least = before + config.tokenizer.min_tokens(text)
    if at_least >= config.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens. However, your prompt "
            f"({len(text)} characters) contains at least {at_least} input tokens, which exceeds this limit even "
            f"without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
        )


@overload
def encode_prompt(text: str, config: RenderConfig, *, view: Literal[False] = False) -> list[int]: ...


@overload
def encode_prompt(text: str, config: RenderConfig, *, view: bool) -> Sequence[int]: ...


def encode_prompt(text: str, config: RenderConfig, *, view: bool = False) -> Sequence[int]:
    """The prompt's ids, through the piece cache; a prompt whose length alone proves that it cannot fit the
    context is refused before any tokenizing (a multi-megabyte prompt would cost seconds of CPU). ``view``:
    the cache's ``PromptIds`` view where it has one (a ``Sequence[int]`` whose ids are never copied into one
    list), for a caller that writes the ids to JSON at once (incremental_tokenizer.PromptIds)."""
    check_prompt_bound(text, config)
    encoder = config.prompt_encoder
    if encoder is None:
        return config.tokenizer.encode(text)
    return encoder.encode_ids(text) if view else encoder.encode(text)
