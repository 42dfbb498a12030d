"""Render: an OpenAI request in, the token IDs and sampling params the engine needs out.

``render_chat`` and ``render_completion`` are plain functions over a ``RenderConfig``; the HTTP
endpoints and the gateway both call them. They raise ``ApiError`` (a 4xx) for anything the client
got wrong. How vLLM 0.32 derives each field was read off the recorded pairs in
fixtures/vllm-0.32-render/; deliberate differences are listed in docs/compatibility.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal, cast, overload

from render_service.extend.chat import TurnRender, turn_render
from render_service.extend.history import kept_history, with_history
from render_service.extend.prompt_refs import StoredPrompt, id_run
from render_service.harmony.render import (
    harmony_structured_outputs,
    prerendered_harmony_ids,
    render_harmony_chat,
    render_harmony_request,
)
from render_service.http.errors import bad_request
from render_service.render.chat_prompt import chat_template_inputs, encode_prompt, template_errors_answered
from render_service.render.prerendered import engine_kv_params, prerendered_prompt_ids
from render_service.render.render_config import MAX_N, RenderConfig, check_model, resolve_chat_template_kwargs
from render_service.render.response_format import requested_structured_outputs
from render_service.render.tool_choice import (
    PARSERS_LEAVING_SPECIAL_TOKENS,
    check_render_tool_choice,
    tool_call_constraint,
)
from render_service.templates.chat_messages import prepare_tools
from render_service.templates.sandbox import TemplateError
from render_service.tokenize.incremental_tokenizer import PromptIds
from render_service.tokenize.tokenizer import TextTokenizer
from render_service.wire.message_memo import history_tool_calls
from render_service.wire.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingParams,
    StreamOptions,
)
from splitserve_common.block_hashes import block_hashes, external_hash
from splitserve_common.limits import chat_limit_violation, kv_transfer_params_violation, prompts_limit_violation
from splitserve_common.request_ids import body_id_violation, header_safe

# vLLM's RequestOutputKind: DELTA for streaming requests, else FINAL_ONLY (the generate server overwrites it).
OUTPUT_KIND_DELTA = 1
OUTPUT_KIND_FINAL_ONLY = 2
# Defaults vLLM applies when neither the request nor generation_config.json sets a value.
SAMPLING_FALLBACKS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# vLLM's _SAMPLING_EPS: below it the request is greedy, and top_p/top_k/min_p are reset (so not serialized).
SAMPLING_EPS = 1e-5


def requested_id(header: str | None, body: str | None) -> str | None:
    """The id a client asked for: vLLM's rule, the X-Request-Id header, else the body's request_id.

    A header id that could not travel in a header as it is counts as absent (the access log ignores it too);
    a body id that is too long or holds control characters is a 400 (``splitserve_common.request_ids``)."""
    if header and header_safe(header):
        return header
    if body:
        violation = body_id_violation(body)
        if violation:
            raise bad_request(violation, "request_id")
        return body
    return None


def new_request_id(prefix: str, header: str | None = None, body: str | None = None) -> str:
    """``prefix-`` and the id the client asked for (``requested_id``), else vLLM's random_uuid(): 16
    lowercase hex digits in vLLM 0.32 (see the recorded fixtures)."""
    return f"{prefix}-{requested_id(header, body) or os.urandom(8).hex()}"


# ------------------------------------------------------------------------------------------- checks


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
    if req.prompt_logprobs is not None:
        if req.prompt_logprobs < -1:
            raise bad_request("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
        if req.stream and req.prompt_logprobs != 0:
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")


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


def build_sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    config: RenderConfig,
    *,
    max_tokens: int,
    logprobs: int | None,
    skip_special_tokens: bool,
    structured_outputs: dict[str, Any] | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """``prompt_logprobs``: the request's, or (completions with ``echo``) its ``logprobs``; vLLM then skips
    reading the prefix cache, whose cached positions have no logits."""
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
    temperature = float(pick("temperature"))
    greedy = temperature < SAMPLING_EPS  # vLLM resets the truncation knobs: the engine takes the argmax
    return SamplingParams(
        n=req.n or 1,
        presence_penalty=req.presence_penalty if req.presence_penalty is not None else 0.0,
        frequency_penalty=req.frequency_penalty if req.frequency_penalty is not None else 0.0,
        repetition_penalty=float(pick("repetition_penalty")),
        temperature=temperature,
        top_p=None if greedy else float(pick("top_p")),
        top_k=None if greedy else int(pick("top_k")),
        min_p=None if greedy else float(pick("min_p")),
        seed=req.seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=OUTPUT_KIND_DELTA if req.stream else OUTPUT_KIND_FINAL_ONLY,
        skip_clone=True,
        output_text_buffer_length=buffer,
        structured_outputs=structured_outputs,
        logit_bias=logit_bias,
        allowed_token_ids=req.allowed_token_ids or None,
        bad_words=list(req.bad_words or []),
        skip_reading_prefix_cache=prompt_logprobs is not None,
    )


# ---------------------------------------------------------------------------------------------- chat


def render_chat_prompt(req: ChatCompletionRequest, config: RenderConfig) -> tuple[list[int], dict[str, Any]]:
    """Apply the chat template and tokenize; returns (token_ids, resolved chat_template_kwargs)."""
    token_ids, kwargs, _ = _render_chat_prompt(req, config)
    return token_ids, kwargs


@overload
def _render_chat_prompt(req: ChatCompletionRequest, config: RenderConfig, *, ids_view: Literal[False] = False
                        ) -> tuple[list[int], dict[str, Any], list[dict[str, Any]] | None]: ...


@overload
def _render_chat_prompt(req: ChatCompletionRequest, config: RenderConfig, *, ids_view: bool
                        ) -> tuple[Sequence[int], dict[str, Any], list[dict[str, Any]] | None]: ...


def _render_chat_prompt(req: ChatCompletionRequest, config: RenderConfig, *, ids_view: bool = False
                        ) -> tuple[Sequence[int], dict[str, Any], list[dict[str, Any]] | None]:
    """``render_chat_prompt``, plus the tools as the template got them (vLLM's shape, ``prepare_tools``; the
    template renders a copy), which the response's ``parse_context`` carries too: prepared once."""
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    violation = chat_limit_violation(len(req.messages), len(req.tools or ()))
    if violation:
        raise bad_request(*violation)
    kwargs = resolve_chat_template_kwargs(req, config)
    if config.harmony:  # gpt-oss (/tokenize; render_chat takes its own Harmony branch)
        choice = "none" if not req.tools or req.tool_choice == "none" else "auto"
        # a gpt-oss bundle's tokenizer is always our TextTokenizer (o200k ranks and Harmony's markers)
        return render_harmony_chat(req, cast(TextTokenizer, config.tokenizer), kwargs, choice), kwargs, None
    template, messages, arguments, tools = chat_template_inputs(req, config, kwargs)
    with template_errors_answered():
        text = template.render(messages, **arguments)
    return encode_prompt(text, config, view=ids_view), kwargs, tools


def render_chat(req: ChatCompletionRequest, config: RenderConfig, *, request_id: str | None = None,
                render_fingerprint: str | None = None, ids_view: bool = False,
                expand_prompt: Callable[[list[int]], list[int]] | None = None, client: str = "") -> GenerateRequest:
    """``request_id``: the caller's X-Request-Id header, if any; ``render_fingerprint``: its
    x-render-fingerprint header (for ids it rendered already, prerendered.py); ``ids_view``: the result's
    ``token_ids`` may be the piece cache's ``PromptIds`` view, for a caller that only writes it to JSON
    (request_io.encode_json); ``expand_prompt``: rewrites the rendered ids before the length checks
    (the image path puts each image's placeholder run in, multimodal.endpoint); ``client``: who asks, for the
    prompt references it files and names (extend/prompt_refs.py)."""
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
    previous = None
    if req.previous_turn is not None and req.previous_turn.messages == "new":
        req, previous = with_history(req, config, client)
    tool_choice, named = check_render_tool_choice(req, config.enable_auto_tool_choice and bool(config.tool_call_parser))
    given = prerendered_prompt_ids(req.kv_transfer_params, config, render_fingerprint)
    if config.harmony:
        return _render_harmony_chat(req, config, tool_choice, named, request_id, given, client=client,
                                    ids_view=ids_view, previous=previous)
    turns = None
    if given is None and (req.previous_turn is not None or req.return_assistant_tokens_mask
                          or req.return_message_indices):
        turns = _turn_render(req, config, client, previous)
        token_ids, kwargs, tools = turns.token_ids, resolve_chat_template_kwargs(req, config), turns.tools
    elif given is None:
        token_ids, kwargs, tools = _render_chat_prompt(req, config, ids_view=ids_view)
    else:  # messages and tools still shape the parsers and the response: checked as if rendered
        if not req.messages:
            raise bad_request("messages must contain at least one message", "messages")
        violation = chat_limit_violation(len(req.messages), len(req.tools or ()))
        if violation:
            raise bad_request(*violation)
        token_ids, kwargs, tools = given, resolve_chat_template_kwargs(req, config), None
    if expand_prompt is not None:
        token_ids = expand_prompt(list(token_ids))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _check_prompt_length(len(token_ids), config, requested)
    max_tokens = resolve_max_tokens(requested, len(token_ids), config)
    prompt_ref = _file_prompt(req, config, client, token_ids, turns, expanded=expand_prompt is not None)
    if not ids_view and isinstance(token_ids, PromptIds):
        token_ids = token_ids.tolist()

    # vLLM's parser adjust_request: the engine must keep special tokens so that markers (<think>,
    # <tool_call>, ...) reach the parsers. A reasoning parser always asks for it (qwen3 in 0.32);
    # most tool parsers when tools may be called.
    keep_special = config.reasoning_parser is not None or (
        config.tool_call_parser is not None and config.tool_call_parser not in PARSERS_LEAVING_SPECIAL_TOKENS
        and bool(req.tools) and tool_choice != "none"
    )
    skip_special = req.skip_special_tokens and not keep_special
    structured = tool_call_constraint(
        config.tool_call_parser, req.tools, tool_choice, named, req.parallel_tool_calls,
        requested_structured_outputs(req), config.tool_strict_level,
        requested_explicitly=req.structured_outputs is not None)
    params = build_sampling_params(
        req, config, max_tokens=max_tokens, logprobs=req.top_logprobs if req.logprobs else None,
        skip_special_tokens=skip_special, structured_outputs=structured, prompt_logprobs=req.prompt_logprobs,
    )
    reasoning_ended = None
    reasoning_kwargs = None
    template_kwargs = {
        **kwargs,
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
    }
    if config.reasoning_parser:
        reasoning_ended = prompt_ends_reasoning(token_ids, config)
        reasoning_kwargs = {"chat_template_kwargs": template_kwargs}
    answer_ids, turn_fields = _turn_answer(req, token_ids, turns, prompt_ref)
    return _generate_request(
        req, config,
        request_id=new_request_id("chatcmpl", request_id, req.request_id),
        token_ids=answer_ids,
        sampling_params=params,
        model=model,
        reasoning_ended=reasoning_ended,
        reasoning_parser_kwargs=reasoning_kwargs,
        # (ids given: the tools are prepared only here, so their errors still come after the sampling checks)
        parse_context=parse_context(req, tools if given is None else _parse_context_tools(req), template_kwargs),
        prompt_ids=token_ids,
        **turn_fields,
    )


def _turn_render(req: ChatCompletionRequest, config: RenderConfig, client: str,
                 previous: StoredPrompt | None = None) -> TurnRender:
    """The extend render and loss masks (render_service/extend/): a request with ``previous_turn`` or a mask
    (``previous``: the previous prompt, where it was looked up already)."""
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    violation = chat_limit_violation(len(req.messages), len(req.tools or ()))
    if violation:
        raise bad_request(*violation)
    return turn_render(req, config, resolve_chat_template_kwargs(req, config), client, previous)


def _file_prompt(req: ChatCompletionRequest, config: RenderConfig, client: str, token_ids: Sequence[int],
                 turns: TurnRender | None, *, expanded: bool) -> str | None:
    """The answer's ``prompt_ref`` where it was asked for: ``token_ids`` kept for the next turn's extend (with
    their masks, as the turn render made them, unless image placeholders were put in since)."""
    if not req.return_prompt_ref:
        return None
    refs = config.prompt_refs
    if refs is None:
        raise bad_request("This render server keeps no prompt references (--render-cache-bytes 0)",
                          "return_prompt_ref")
    stored = turns.stored if turns is not None and not expanded else None
    stored = stored if stored is not None else StoredPrompt(id_run(token_ids))
    if not expanded:  # the request's messages too: the next turn may send only those from its sampled turn on
        stored = replace(stored, history=kept_history(req.messages))
    ref = refs.file(client, stored)
    if ref is None:
        raise bad_request("The prompt is larger than the prompt references this server keeps for one client",
                          "return_prompt_ref")
    return ref


def _turn_fields(turns: TurnRender | None, prompt_ref: str | None = None) -> dict[str, Any]:
    """The answer's extend, mask and prompt reference fields, where they were asked for."""
    fields: dict[str, Any] = {"prompt_ref": prompt_ref}
    if turns is not None:
        fields.update(extend=turns.extend, message_indices=turns.message_indices,
                      assistant_tokens_mask=turns.assistant_tokens_mask)
    return {name: value for name, value in fields.items() if value is not None}


def _turn_answer(req: ChatCompletionRequest, token_ids: Sequence[int], turns: TurnRender | None,
                 prompt_ref: str | None) -> tuple[Sequence[int], dict[str, Any]]:
    """The answer's ids and turn fields: all of them, or with ``previous_turn.answer: "appended"`` and a turn that
    was extended, only what follows the kept ids (the masks likewise), so that the answer costs what the new turn
    costs. Everything else (length checks, max_tokens, the prompt reference, block hashes) counts the whole
    prompt."""
    fields = _turn_fields(turns, prompt_ref)
    turn = req.previous_turn
    if turn is None or turn.answer != "appended" or turns is None or turns.extend is None \
            or not turns.extend.extended:
        return token_ids, fields
    kept = turns.extend.kept_tokens
    for name in ("message_indices", "assistant_tokens_mask"):
        if name in fields:
            fields[name] = _after(fields[name], kept)
    return _after(token_ids, kept), fields


def _after(ids: Sequence[int], kept: int) -> Sequence[int]:
    """``ids`` after the first ``kept``, as a list (a ``PromptIds`` gives its tail from its last pieces alone)."""
    appended = len(ids) - kept
    return list(ids[-appended:]) if appended > 0 else []


def _render_harmony_chat(req: ChatCompletionRequest, config: RenderConfig, tool_choice: str, named: str | None,
                         request_id: str | None, given: list[int] | None, *, client: str = "",
                         ids_view: bool = False, previous: StoredPrompt | None = None) -> GenerateRequest:
    """gpt-oss: the Harmony renderer instead of a chat template (render_service/harmony/); ``given``: ids
    rendered already (prerendered.py)."""
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    violation = chat_limit_violation(len(req.messages), len(req.tools or ()))
    if violation:
        raise bad_request(*violation)
    token_ids: Sequence[int]
    turns = None
    if given is not None:
        token_ids, structured = prerendered_harmony_ids(req, config, tool_choice, named, given)
    elif req.previous_turn is not None or req.return_assistant_tokens_mask or req.return_message_indices:
        # (the turn render renders what it needs: an extend only the new messages)
        structured = harmony_structured_outputs(req, config, tool_choice, named)
        turns = _turn_render(req, config, client, previous)
        token_ids = turns.token_ids
    else:
        token_ids, structured = render_harmony_request(req, config, tool_choice, named)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _check_prompt_length(len(token_ids), config, requested)
    prompt_ref = _file_prompt(req, config, client, token_ids, turns, expanded=False)
    if not ids_view and isinstance(token_ids, PromptIds):
        token_ids = token_ids.tolist()
    params = build_sampling_params(
        req, config, max_tokens=resolve_max_tokens(requested, len(token_ids), config),
        logprobs=req.top_logprobs if req.logprobs else None,
        # as vLLM (its Harmony parsers read token ids; ours decodes with markers whatever this says)
        skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured, prompt_logprobs=req.prompt_logprobs,
    )
    answer_ids, turn_fields = _turn_answer(req, token_ids, turns, prompt_ref)
    return _generate_request(req, config, request_id=new_request_id("chatcmpl", request_id, req.request_id),
                             token_ids=answer_ids, sampling_params=params, model=check_model(req.model, config),
                             parse_context=parse_context(req, _parse_context_tools(req), {}), prompt_ids=token_ids,
                             **turn_fields)


def prompt_ends_reasoning(token_ids: Sequence[int], config: RenderConfig) -> bool:
    """vLLM's ``is_reasoning_end(prompt)``: did the template already close the think block?"""
    from render_service.parsers.reasoning import reasoning_open_at_prompt_end

    return reasoning_open_at_prompt_end(token_ids, config.tokenizer, config.reasoning_parser_cls) is False


def _stream_options(req: ChatCompletionRequest | CompletionRequest) -> StreamOptions | None:
    # vLLM forwards stream_options only for streaming requests.
    if req.stream and req.stream_options is not None:
        return req.stream_options
    return None


def _generate_request(
    req: ChatCompletionRequest | CompletionRequest, config: RenderConfig, prompt_ids: Sequence[int] | None = None,
    **per_prompt: Any
) -> GenerateRequest:
    """The engine request for one rendered prompt: ``per_prompt`` fields plus those every request carries over;
    ``prompt_ids``: the whole prompt where the answer's ``token_ids`` hold only its appended part."""
    if req.return_block_hashes:
        whole = per_prompt["token_ids"] if prompt_ids is None else prompt_ids
        hashes = block_hashes(list(whole), config.block_hash_config, cache_salt=req.cache_salt)
        per_prompt["block_hashes"] = [external_hash(h) for h in hashes]
    return GenerateRequest(
        **per_prompt,
        return_token_ids=req.return_token_ids,
        stream=req.stream,
        stream_options=_stream_options(req),
        cache_salt=req.cache_salt,
        priority=req.priority,
        # vLLM 0.33: top level (0.32 put a chat request's in sampling_params.extra_args; its engine copies the
        # top-level value there, so 0.32 engines read this shape too)
        kv_transfer_params=engine_kv_params(req.kv_transfer_params),
        render_fingerprint=config.fingerprint,
    )


def _parse_context_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    try:
        return prepare_tools(req.tools) if req.tools else None
    except TemplateError as exc:
        raise bad_request(str(exc), "tools") from None


def parse_context(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.33's ``parse_context``: what a generate server needs to parse the output of a chat request."""
    return {
        "tools": tools,
        "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
        "parallel_tool_calls": req.parallel_tool_calls,
        "include_reasoning": req.include_reasoning,
        "chat_template_kwargs": template_kwargs,
        "history_tool_call_cnt": history_tool_calls(req.messages),
    }


# --------------------------------------------------------------------------------------- completions


def completion_prompts(prompt: Any) -> list[str | list[int]]:
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
    # lm-eval-harness's loglikelihood requests: echo, logprobs and max_tokens 0, the prompt's logprobs only.
    # vLLM generates one token (SamplingParams needs max_tokens >= 1) that the response leaves out.
    echo_only = bool(req.echo) and req.max_tokens == 0
    if req.max_tokens is not None and req.max_tokens < 1 and not echo_only:
        raise bad_request(f"max_tokens must be at least 1, got {req.max_tokens}.", "max_tokens")
    if req.logprobs is not None and req.logprobs < 0:
        raise bad_request("logprobs must be non-negative", "logprobs")
    prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None else (req.logprobs if req.echo else None)
    requested = 1 if echo_only else req.max_tokens
    prompts = completion_prompts(req.prompt)
    violation = prompts_limit_violation(len(prompts))
    if violation:
        raise bad_request(*violation)
    structured = requested_structured_outputs(req)
    base_id = new_request_id("cmpl", request_id, req.request_id)
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = encode_prompt(prompt, config)
            if req.add_special_tokens:
                ids = add_special_tokens(ids, config)
        else:
            _check_token_ids(prompt, config, "prompt")
            ids = list(prompt)
        _check_prompt_length(len(ids), config, requested)
        params = build_sampling_params(
            req, config, max_tokens=resolve_max_tokens(requested, len(ids), config),
            logprobs=req.logprobs, skip_special_tokens=req.skip_special_tokens, structured_outputs=structured,
            prompt_logprobs=prompt_logprobs,
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
