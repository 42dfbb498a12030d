"""Render: an OpenAI request in, the token IDs and sampling params the engine needs out.

``render_chat`` and ``render_completion`` are plain functions over a ``RenderConfig``; the HTTP
endpoints and the gateway both call them. They raise ``ApiError`` (a 4xx) for anything the client
got wrong. How vLLM 0.32 derives each field was read off the recorded pairs in
fixtures/vllm-0.32-render/; deliberate differences are listed in docs/compatibility.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from render_service.errors import ApiError, bad_request, model_not_found
from splitserve_common.limits import chat_limit_violation, kv_transfer_params_violation, prompts_limit_violation
from render_service.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingParams,
    StreamOptions,
)
from render_service.templates import (
    ChatTemplate, TemplateError, convert_developer_role, prepare_messages, prepare_tools,
)

# vLLM's RequestOutputKind: DELTA for streaming requests, else FINAL_ONLY (the generate server overwrites it).
OUTPUT_KIND_DELTA = 1
OUTPUT_KIND_FINAL_ONLY = 2
# vLLM's VLLM_MAX_N_SEQUENCES default.
MAX_N = 16384
# Defaults vLLM applies when neither the request nor generation_config.json sets a value.
SAMPLING_FALLBACKS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# generation_config.json keys vLLM takes as sampling defaults (max_new_tokens becomes max_tokens).
GENERATION_CONFIG_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# --reasoning-field: the key(s) chat responses carry reasoning under (vLLM renamed it in 0.11).
REASONING_FIELDS = ("reasoning", "reasoning_content", "both")


def reasoning_keys(field: str) -> tuple[str, ...]:
    """The response key(s) reasoning text goes under for a --reasoning-field value."""
    return ("reasoning", "reasoning_content") if field == "both" else (field,)


@dataclass
class RenderConfig:
    """Everything render and derender need, built once per process."""

    bundle: Any  # render_service.bundle.ModelBundle
    served_model_names: list[str]
    template: ChatTemplate | None
    fingerprint: str
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    trust_request_chat_template: bool = False
    max_model_len: int = 0
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    template_special_tokens: dict[str, str] = field(default_factory=dict)
    reasoning_parser_cls: Any = None
    # Output shape only (not in the fingerprint): the chat reasoning key(s), and vLLM's "token_id:N" logprobs.
    reasoning_field: str = "reasoning"
    return_tokens_as_token_ids: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.bundle.tokenizer

    @property
    def has_parsers(self) -> bool:
        return bool(self.reasoning_parser or self.tool_call_parser)


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults vLLM reads from generation_config.json (``max_new_tokens`` -> ``max_tokens``)."""
    out = {}
    for key in GENERATION_CONFIG_KEYS:
        value = generation_config.get(key)
        if value is not None:
            out["max_tokens" if key == "max_new_tokens" else key] = value
    return out


def template_special_tokens(bundle: Any) -> dict[str, str]:
    """The named special tokens a template may read (``eos_token`` ...), from tokenizer_config.json."""
    known = getattr(bundle, "template_special_tokens", None)
    if known is not None:
        return dict(known)
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = bundle.tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def new_request_id(prefix: str, given: str | None = None) -> str:
    """vLLM's rule: the X-Request-Id header, else the body's request_id, else random_uuid().

    vLLM 0.32's random_uuid() is 16 lowercase hex digits (see the recorded fixtures).
    """
    return f"{prefix}-{given if given else os.urandom(8).hex()}"


# ------------------------------------------------------------------------------------------- checks


def check_model(model: str | None, config: RenderConfig) -> str:
    """The served name to answer with; 404 when the request names a model we do not serve."""
    if model is None or model == "":
        return config.model_name
    if model not in config.served_model_names:
        raise model_not_found(model)
    return model


def _check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    violation = kv_transfer_params_violation(req.kv_transfer_params)
    if violation:
        raise bad_request(*violation)
    if req.stream_options is not None and not req.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if req.use_beam_search:
        raise bad_request("Beam search is not supported by the render endpoint", "use_beam_search")
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}.", "n")
    if req.temperature is not None and req.temperature < 0:
        raise bad_request(f"temperature must be non-negative, got {req.temperature}.", "temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}.", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be -1 (disable), or at least 1, got {req.top_k}.", "top_k")
    if req.min_p is not None and not 0 <= req.min_p <= 1:
        raise bad_request(f"min_p must be in [0, 1], got {req.min_p}.", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2 <= value <= 2:
            raise bad_request(f"{name} must be in [-2, 2], got {value}.", name)
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise bad_request(f"repetition_penalty must be greater than zero, got {req.repetition_penalty}.",
                          "repetition_penalty")
    if req.min_tokens < 0:
        raise bad_request(f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.", "min_tokens")
    if not -(2**63) <= req.priority < 2**63:
        raise bad_request("priority must fit in a signed 64-bit integer", "priority")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad_request("seed must fit in a signed 64-bit integer", "seed")


def _check_prompt_length(prompt_len: int, config: RenderConfig, max_tokens: int | None) -> None:
    """vLLM 0.32's wording. A prompt that fills the whole window is refused too: no room to generate."""
    if prompt_len == 0:
        raise bad_request("No token_ids rendered")
    if prompt_len >= config.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens. However, your prompt "
            f"contains {prompt_len} input tokens, which exceeds this limit even without any output tokens. "
            f"Please reduce the length of the input prompt.",
            "input_tokens",
        )
    if max_tokens is not None and max_tokens > config.max_model_len:
        raise bad_request(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={config.max_model_len}. "
            f"Please request fewer output tokens.",
            "max_tokens",
        )


def _check_token_ids(ids: list[int], config: RenderConfig, param: str) -> None:
    vocab = config.tokenizer.vocab_size
    if ids and (min(ids) < 0 or max(ids) >= vocab):  # C-speed scan; find the culprit only on failure
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise bad_request(f"Token id {bad} is out of vocabulary", param)


# ---------------------------------------------------------------------------------- sampling params


def resolve_max_tokens(requested: int | None, prompt_len: int, config: RenderConfig) -> int:
    """vLLM's ``get_max_tokens``: the request's value (max_completion_tokens, else max_tokens), else the
    generation_config.json default (max_new_tokens), capped by what the context window leaves."""
    fallback = requested if requested is not None else config.generation_defaults.get("max_tokens")
    room = config.max_model_len - prompt_len
    return room if fallback is None else min(room, fallback)


def _structured_outputs(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    if req.structured_outputs is not None:
        return req.structured_outputs
    fmt = req.response_format
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format")
        return {"json": schema}
    if kind in (None, "text"):
        return None
    raise bad_request(f"Unsupported response_format type {kind!r}", "response_format")


def build_sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    config: RenderConfig,
    *,
    max_tokens: int,
    logprobs: int | None,
    skip_special_tokens: bool,
    structured_outputs: dict[str, Any] | None,
) -> SamplingParams:
    defaults = config.generation_defaults

    def pick(name: str) -> Any:
        value = getattr(req, name)
        if value is not None:
            return value
        return defaults.get(name, SAMPLING_FALLBACKS[name])

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    # Deliberate difference from vLLM (which leaves this empty and relies on the engine knowing EOS):
    # a tokens-only engine may not know the model's EOS ids, so render writes them.
    stop_token_ids = list(req.stop_token_ids or [])
    _check_token_ids(stop_token_ids, config, "stop_token_ids")
    if not req.ignore_eos:
        stop_token_ids += [t for t in config.bundle.eos_token_ids if t not in stop_token_ids]
    buffer = max((len(s) for s in stop), default=0) - 1 if stop and not req.include_stop_str_in_output else 0
    logit_bias = None
    if req.logit_bias:
        logit_bias = {}
        for key, bias in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
            if not 0 <= token < config.tokenizer.vocab_size:
                raise bad_request(f"token_id(s) {[token]} in logit_bias contain out-of-vocab token ids.", "logit_bias")
            logit_bias[str(token)] = max(-100.0, min(100.0, bias))
    if req.allowed_token_ids:
        _check_token_ids(req.allowed_token_ids, config, "allowed_token_ids")
    return SamplingParams(
        n=req.n or 1,
        presence_penalty=req.presence_penalty if req.presence_penalty is not None else 0.0,
        frequency_penalty=req.frequency_penalty if req.frequency_penalty is not None else 0.0,
        repetition_penalty=float(pick("repetition_penalty")),
        temperature=float(pick("temperature")),
        top_p=float(pick("top_p")),
        top_k=int(pick("top_k")),
        min_p=float(pick("min_p")),
        seed=req.seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=OUTPUT_KIND_DELTA if req.stream else OUTPUT_KIND_FINAL_ONLY,
        skip_clone=True,
        output_text_buffer_length=buffer,
        structured_outputs=structured_outputs,
        logit_bias=logit_bias,
        allowed_token_ids=req.allowed_token_ids or None,
        # vLLM hands kv_transfer_params to the KV connector through extra_args.
        extra_args={"kv_transfer_params": req.kv_transfer_params} if req.kv_transfer_params else None,
        bad_words=list(req.bad_words or []),
        skip_reading_prefix_cache=False,
    )


# ---------------------------------------------------------------------------------------------- chat


def resolve_chat_template_kwargs(req: ChatCompletionRequest, config: RenderConfig) -> dict[str, Any]:
    """Server defaults (--default-chat-template-kwargs) under the request's own chat_template_kwargs."""
    kwargs = dict(config.default_chat_template_kwargs)
    if req.chat_template_kwargs:
        kwargs.update(req.chat_template_kwargs)
    for forbidden in ("chat_template", "tokenize", "messages", "conversation"):
        if forbidden in kwargs:
            raise bad_request(f"chat_template_kwargs may not set {forbidden!r}", "chat_template_kwargs")
    return kwargs


def _check_tool_choice(req: ChatCompletionRequest, config: RenderConfig) -> str:
    """The effective tool_choice; 400 where vLLM refuses it."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(f"Invalid tool_choice {choice!r}", "tool_choice")
        if choice == "auto" and req.tools and not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        if choice == "required" and not req.tools:
            raise bad_request('When using `tool_choice` "required", `tools` must be set.', "tool_choice")
        return choice
    name = ((choice or {}).get("function") or {}).get("name")
    if not isinstance(name, str):
        raise bad_request("tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}",
                          "tool_choice")
    if not any(((t or {}).get("function") or {}).get("name") == name for t in req.tools or []):
        raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    return "named"


def _tool_choice_structured_outputs(req: ChatCompletionRequest, choice: str) -> dict[str, Any] | None:
    """Named and "required" tool choice constrain the output to the tool's JSON, as vLLM does."""
    if choice == "named":
        name = req.tool_choice["function"]["name"]
        tool = next(t for t in req.tools if (t.get("function") or {}).get("name") == name)
        return {"json": tool["function"].get("parameters") or {"type": "object", "properties": {}}}
    if choice == "required":
        variants = []
        for tool in req.tools or []:
            fn = tool.get("function") or {}
            variants.append({
                "properties": {
                    "name": {"type": "string", "enum": [fn.get("name")]},
                    "parameters": fn.get("parameters") or {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            })
        return {"json": {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}}
    return None


def chat_template_for(req: ChatCompletionRequest, config: RenderConfig) -> ChatTemplate:
    if req.chat_template is not None:
        if not config.trust_request_chat_template:
            raise bad_request(
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template.",
                "chat_template",
            )
        try:
            return ChatTemplate(req.chat_template, config.template_special_tokens)
        except TemplateError as exc:
            raise bad_request(str(exc), "chat_template") from None
    if config.template is None:
        raise bad_request(
            "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
            "template if the tokenizer does not define one.",
            "chat_template",
        )
    return config.template


def render_chat_prompt(req: ChatCompletionRequest, config: RenderConfig) -> tuple[list[int], dict[str, Any]]:
    """Apply the chat template and tokenize; returns (token_ids, resolved chat_template_kwargs)."""
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    violation = chat_limit_violation(len(req.messages), len(req.tools or ()))
    if violation:
        raise bad_request(*violation)
    kwargs = resolve_chat_template_kwargs(req, config)
    template = chat_template_for(req, config)
    try:
        # As vLLM: content shaped for the template, developer role folded into system where the
        # template lacks it, tools in vLLM's model_dump shape.
        messages = convert_developer_role(prepare_messages(req.messages, template.content_format), template)
        arguments = {
            "tools": prepare_tools(req.tools) if req.tools else None,
            "documents": req.documents,
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
        }
        # As in vLLM, chat_template_kwargs override the request's own template arguments.
        arguments.update(kwargs)
        text = template.render(messages, **arguments)
    except TemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
        # The template ran on client data and choked on it (say, a number where it expects text).
        raise bad_request(f"The chat template failed on this request: {type(exc).__name__}: {exc}", "messages") from None
    ids = config.tokenizer.encode(text)
    return ids, kwargs


def render_chat(req: ChatCompletionRequest, config: RenderConfig, *, request_id: str | None = None) -> GenerateRequest:
    """``request_id``: the caller's X-Request-Id header, if any."""
    model = check_model(req.model, config)
    _check_common(req)
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", "max_tokens")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise bad_request("max_completion_tokens must be at least 1", "max_completion_tokens")
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise bad_request("top_logprobs must be non-negative", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    tool_choice = _check_tool_choice(req, config)
    token_ids, kwargs = render_chat_prompt(req, config)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _check_prompt_length(len(token_ids), config, requested)
    max_tokens = resolve_max_tokens(requested, len(token_ids), config)

    # vLLM's parser adjust_request: the engine must keep special tokens so that markers (<think>,
    # <tool_call>, ...) reach the parsers. A reasoning parser always asks for it (qwen3 in 0.32);
    # a tool parser when tools may be called.
    keep_special = config.reasoning_parser is not None or (
        config.tool_call_parser is not None and bool(req.tools) and tool_choice != "none"
    )
    skip_special = req.skip_special_tokens and not keep_special
    structured = _structured_outputs(req) or _tool_choice_structured_outputs(req, tool_choice)
    params = build_sampling_params(
        req, config, max_tokens=max_tokens, logprobs=req.top_logprobs if req.logprobs else None,
        skip_special_tokens=skip_special, structured_outputs=structured,
    )
    reasoning_ended = None
    reasoning_kwargs = None
    if config.reasoning_parser:
        reasoning_ended = prompt_ends_reasoning(token_ids, config)
        reasoning_kwargs = {"chat_template_kwargs": {
            **kwargs,
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
        }}
    return _generate_request(
        req, config,
        request_id=new_request_id("chatcmpl", request_id or req.request_id),
        token_ids=token_ids,
        sampling_params=params,
        model=model,
        reasoning_ended=reasoning_ended,
        reasoning_parser_kwargs=reasoning_kwargs,
    )


def prompt_ends_reasoning(token_ids: list[int], config: RenderConfig) -> bool:
    """vLLM's ``is_reasoning_end(prompt)``: did the template already close the think block?"""
    from render_service.parsers.reasoning import reasoning_open_at_prompt_end

    return reasoning_open_at_prompt_end(token_ids, config.tokenizer, config.reasoning_parser_cls) is False


def _stream_options(req: ChatCompletionRequest | CompletionRequest) -> StreamOptions | None:
    # vLLM forwards stream_options only for streaming requests.
    if req.stream and req.stream_options is not None:
        return req.stream_options
    return None


def _generate_request(
    req: ChatCompletionRequest | CompletionRequest, config: RenderConfig, **per_prompt: Any
) -> GenerateRequest:
    """The engine request for one rendered prompt: ``per_prompt`` fields plus those every request carries over."""
    return GenerateRequest(
        **per_prompt,
        return_token_ids=req.return_token_ids,
        stream=req.stream,
        stream_options=_stream_options(req),
        cache_salt=req.cache_salt,
        priority=req.priority,
        render_fingerprint=config.fingerprint,
    )


# --------------------------------------------------------------------------------------- completions


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """vLLM's accepted prompt shapes: str, [str, ...], [int, ...], [[int, ...], ...]."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(type(p) is int for p in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
            return list(prompt)
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token IDs or a list of lists of token IDs "
        "(non-empty)",
        "prompt",
    )


def render_completion(
    req: CompletionRequest, config: RenderConfig, *, request_id: str | None = None
) -> list[GenerateRequest]:
    model = check_model(req.model, config)
    _check_common(req)
    if req.suffix is not None:
        raise bad_request("suffix is not currently supported", "suffix")
    if req.prompt_embeds is not None:
        raise bad_request("prompt_embeds is not supported by this render server", "prompt_embeds")
    if req.prompt is None:
        raise bad_request("prompt is required", "prompt")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", "max_tokens")
    if req.logprobs is not None and req.logprobs < 0:
        raise bad_request("logprobs must be non-negative", "logprobs")
    prompts = _completion_prompts(req.prompt)
    violation = prompts_limit_violation(len(prompts))
    if violation:
        raise bad_request(*violation)
    structured = _structured_outputs(req)
    base_id = new_request_id("cmpl", request_id or req.request_id)
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = config.tokenizer.encode(prompt)
            if req.add_special_tokens:
                ids = add_special_tokens(ids, config)
        else:
            _check_token_ids(prompt, config, "prompt")
            ids = list(prompt)
        _check_prompt_length(len(ids), config, req.max_tokens)
        params = build_sampling_params(
            req, config, max_tokens=resolve_max_tokens(req.max_tokens, len(ids), config),
            logprobs=req.logprobs, skip_special_tokens=req.skip_special_tokens, structured_outputs=structured,
        )
        out.append(_generate_request(
            req, config,
            # vLLM numbers the prompts of a batch: cmpl-<hex>-0, cmpl-<hex>-1, ...
            request_id=base_id if len(prompts) == 1 else f"{base_id}-{i}",
            token_ids=ids,
            sampling_params=params,
            model=model,
        ))
    return out


def add_special_tokens(ids: list[int], config: RenderConfig) -> list[int]:
    """BOS the way the tokenizer's post-processor adds it (Qwen adds none; Llama adds <s>/<|begin_of_text|>)."""
    tokenizer_config = config.bundle.tokenizer_config
    if not tokenizer_config.get("add_bos_token"):
        return ids
    bos = tokenizer_config.get("bos_token")
    if isinstance(bos, dict):
        bos = bos.get("content")
    bos_id = config.tokenizer.token_to_id(bos) if isinstance(bos, str) else None
    if bos_id is None or (ids and ids[0] == bos_id):
        return ids
    return [bos_id, *ids]


__all__ = [
    "ApiError", "RenderConfig", "render_chat", "render_completion", "resolve_max_tokens", "check_model",
    "generation_defaults", "template_special_tokens", "new_request_id", "load_render_config", "build_render_config",
]


# ------------------------------------------------------------------------------------ configuration


def load_render_config(model_dir: str, *, max_model_len: int | None = None, **settings: Any) -> RenderConfig:
    """Load the bundle in ``model_dir`` and build the per-process configuration (ValueError on bad settings)."""
    from render_service.bundle import load_bundle

    if max_model_len is not None and max_model_len < 1:
        raise ValueError("--max-model-len must be positive")
    settings.setdefault("served_model_names", None)
    return build_render_config(load_bundle(model_dir, max_model_len=max_model_len), **settings)


def build_render_config(
    bundle: Any,
    *,
    served_model_names: list[str] | None = None,
    chat_template: str | None = None,
    default_chat_template_kwargs: dict[str, Any] | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    trust_request_chat_template: bool = False,
    reasoning_field: str = "reasoning",
    return_tokens_as_token_ids: bool = False,
) -> RenderConfig:
    """The configuration for an already loaded bundle (tests and the gateway share one bundle)."""
    from pathlib import Path

    from render_service.fingerprint import config_fingerprint, file_sha256

    source = bundle.chat_template
    if chat_template is not None:
        # vLLM's --chat-template: a file path, else the template text itself.
        path = Path(chat_template)
        source = path.read_text(encoding="utf-8") if len(chat_template) < 4096 and path.is_file() else chat_template
    special = template_special_tokens(bundle)
    template = ChatTemplate(source, special) if source else None
    reasoning_cls = None
    if reasoning_parser:
        from render_service.parsers.registry import get_reasoning_parser

        reasoning_cls = get_reasoning_parser(reasoning_parser)
    if tool_call_parser:
        from render_service.parsers.registry import get_tool_parser

        get_tool_parser(tool_call_parser)  # unknown name -> error at startup, not per request
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if reasoning_field not in REASONING_FIELDS:
        raise ValueError(f"--reasoning-field must be one of {', '.join(REASONING_FIELDS)}")
    tokenizer_sha = getattr(bundle, "tokenizer_sha256", None) or _tokenizer_sha256(Path(bundle.path) / "tokenizer.json")
    kwargs = dict(default_chat_template_kwargs or {})
    fingerprint = config_fingerprint(
        tokenizer_sha256=tokenizer_sha,
        chat_template=source,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        default_chat_template_kwargs=kwargs,
    )
    names = list(served_model_names or []) or [str(bundle.path)]
    return RenderConfig(
        bundle=bundle,
        served_model_names=names,
        template=template,
        fingerprint=fingerprint,
        default_chat_template_kwargs=kwargs,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        trust_request_chat_template=trust_request_chat_template,
        max_model_len=int(bundle.max_model_len),
        generation_defaults=generation_defaults(bundle.generation_config),
        template_special_tokens=special,
        reasoning_parser_cls=reasoning_cls,
        reasoning_field=reasoning_field,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
    )


def _tokenizer_sha256(path: Any) -> str:
    from render_service.fingerprint import file_sha256

    return file_sha256(path)
