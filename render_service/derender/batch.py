"""Batch derender: a generate response (token IDs) in, an OpenAI response out.

Each choice goes through one ``render_service.parsers.pipeline.Pipeline`` (incremental detokenizer ->
reasoning parser -> tool parser): batch feeds all of a choice's tokens at once and finishes, which
is exactly what streaming derender does chunk by chunk, so the two agree by construction.
``pipeline_config`` is the one seam where a request becomes a pipeline configuration.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from render_service.derender.choice_shapes import chat_message, completion_pipeline_config
from render_service.derender.logprobs import (
    check_logprobs_bounds,
    resolve_chat_logprobs,
    resolve_completion_logprobs,
    tokens_as_token_ids,
)
from render_service.http.errors import ApiError, bad_request
from render_service.parsers.base import ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.parsers.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS, stop_list
from render_service.render.fingerprint import FINGERPRINT_HEADER
from render_service.render.render_config import MAX_N, RenderConfig, check_model, resolve_chat_template_kwargs
from render_service.render.tool_choice import forces_a_call, parse_tool_choice
from render_service.wire.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DerenderChatRequest,
    DerenderCompletionRequest,
    GenerateResponse,
    UsageInfo,
)

PARSER_NEEDS_CHAT_REQUEST = (
    "chat_request is required when a tool or reasoning parser is configured because plain detokenization "
    "would leak raw parser markup into content."
)


# ------------------------------------------------------------------------------------------- checks


def check_fingerprint(sent: str | None, config: RenderConfig) -> None:
    """A fingerprint the caller passed back must be ours: otherwise the tiers disagree on the model."""
    if sent is not None and sent != config.fingerprint:
        raise ApiError(
            f"render fingerprint mismatch: this request was rendered by a server with configuration "
            f"{sent!r}, but this server's configuration is {config.fingerprint!r} (tokenizer, chat template, "
            f"parser flags or default chat template kwargs differ). Send derender requests to a render tier "
            f"configured like the one that rendered the prompt.",
            400,
            "render_fingerprint",
        )


def fingerprint_sent(body_value: str | None, headers: Any, response: GenerateResponse | None = None) -> str | None:
    """The fingerprint from the body, else the X-Render-Fingerprint header, else an echo in the generate response."""
    if body_value is not None:
        return body_value
    if headers is not None:
        value: str | None = headers.get(FINGERPRINT_HEADER)
        if value:
            return value
    if response is not None:
        return response.render_fingerprint
    return None


def _check_bounds(responses: list[GenerateResponse], config: RenderConfig) -> None:
    """Resource bounds, checked before any decoding (client-supplied sizes are untrusted)."""
    if len(responses) > MAX_N:
        raise bad_request(f"generate_responses count ({len(responses)}) exceeds server maximum ({MAX_N}).")
    vocab = config.output_vocab_size
    for gen in responses:
        if gen.output_mode not in (None, "tokens"):
            raise bad_request(
                f"derender takes tokens-mode generate responses; got output_mode={gen.output_mode!r}",
                "output_mode",
            )
        if len(gen.choices) > MAX_N:
            raise bad_request(f"choices count ({len(gen.choices)}) in response '{gen.request_id}' exceeds "
                              f"server maximum ({MAX_N}).")
        for choice in gen.choices:
            ids = choice.token_ids
            if not ids:
                raise bad_request(f"choice {choice.index} has empty or null token_ids")
            if len(ids) > config.max_model_len:
                raise bad_request(f"token_ids length ({len(ids)}) in choice {choice.index} exceeds max_model_len "
                                  f"({config.max_model_len}).")
            if min(ids) < 0 or max(ids) >= vocab:  # C-speed scan; find the culprit only on failure
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise bad_request(f"token id {bad} in choice {choice.index} is outside the model's vocabulary "
                                  f"(0..{vocab - 1})", "token_ids")
            check_logprobs_bounds(choice.logprobs, choice.index, config)
        if gen.prompt_logprobs is not None and len(gen.prompt_logprobs) > config.max_model_len:
            raise bad_request(f"prompt_logprobs length ({len(gen.prompt_logprobs)}) in response '{gen.request_id}' "
                              f"exceeds max_model_len ({config.max_model_len}).")


def _check_prompt_ids(ids: list[int] | None, config: RenderConfig) -> None:
    if ids is not None and len(ids) > config.max_model_len:
        raise bad_request(f"prompt_token_ids length ({len(ids)}) exceeds max_model_len ({config.max_model_len}).",
                          "prompt_token_ids")


# ------------------------------------------------------------------------------------ pipeline seam


def _tool_specs(tools: list[dict[str, Any]] | None) -> list[ToolSpec]:
    specs = []
    for tool in tools or []:
        fn = (tool or {}).get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            specs.append(ToolSpec(name=fn["name"], parameters=params if isinstance(params, dict) else None))
    return specs


def pipeline_config(
    config: RenderConfig,
    chat_request: ChatCompletionRequest | None,
    *,
    request_id: str,
    choice_index: int,
) -> PipelineConfig:
    """The seam: a derender request (and this server's parser flags) as one pipeline configuration."""
    eos = frozenset(config.bundle.eos_token_ids)
    # "required"/named tool choice needs no --tool-call-parser: render constrained the output to the tools' JSON.
    forced = chat_request is not None and bool(chat_request.tools) and forces_a_call(chat_request)
    if chat_request is None or not (config.has_parsers or forced):
        # Plain detokenization honours the request's skip_special_tokens (default true). The stop
        # token itself never becomes text (vLLM's engine does not detokenize it either).
        req = chat_request
        return PipelineConfig(
            request_id=request_id,
            choice_index=choice_index,
            skip_special_tokens=req.skip_special_tokens if req is not None else True,
            spaces_between_special_tokens=req.spaces_between_special_tokens if req is not None else True,
            hidden_token_ids=eos,
        )
    kwargs = resolve_chat_template_kwargs(chat_request, config)
    tool_choice, named = parse_tool_choice(chat_request)
    if tool_choice == "auto" and not config.enable_auto_tool_choice:
        tool_choice = "none"
    return PipelineConfig(
        request_id=request_id,
        choice_index=choice_index,
        reasoning_parser=config.reasoning_parser,
        tool_parser=config.tool_call_parser,
        tools=_tool_specs(chat_request.tools),
        tool_choice=tool_choice,
        named_function=named,
        # each reasoning parser reads its own switch (qwen3: enable_thinking; deepseek_v3: thinking)
        enable_thinking=(config.reasoning_parser_cls.enable_thinking_from(kwargs)
                         if config.reasoning_parser_cls is not None else bool(kwargs.get("enable_thinking", True))),
        include_reasoning=chat_request.include_reasoning,
        parallel_tool_calls=chat_request.parallel_tool_calls is not False,
        # Parsers see special tokens: markers such as <think> or <tool_call> may be special. Forced JSON alone
        # has no markers, so it keeps the request's choice.
        skip_special_tokens=False if config.has_parsers else chat_request.skip_special_tokens,
        hidden_token_ids=eos,
    )


def with_stops(pcfg: PipelineConfig, request: ChatCompletionRequest | CompletionRequest | None, *,
               whole: bool = False, finish_reason: str | None = None,
               stop_reason: int | str | None = None) -> PipelineConfig:
    """The request's stop strings on the pipeline (vLLM 0.34's derender cuts the decoded text at them).

    ``whole``: a batch choice, whose finish is known: vLLM applies stop strings only when the engine reported
    ``stop`` without a stop token id, and then only the reported string if it reported one. A stream applies
    the request's strings from its first chunk, since the finish comes last."""
    if request is None or not request.stop:
        return pcfg
    stops = stop_list(request.stop)
    if len(stops) > MAX_STOP_STRINGS or sum(len(s) for s in stops) > MAX_STOP_CHARS:
        raise bad_request(f"stop allows at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all "
                          f"at derender", "stop")
    if whole:
        if finish_reason != "stop" or isinstance(stop_reason, int):
            return pcfg
        if isinstance(stop_reason, str):
            stops = (stop_reason,) if stop_reason and len(stop_reason) <= MAX_STOP_CHARS else ()
    if not stops:
        return pcfg
    return msgspec.structs.replace(pcfg, stops=stops, include_stop_str_in_output=request.include_stop_str_in_output,
                                   min_tokens=max(0, request.min_tokens))


# ---------------------------------------------------------------------------------------------- chat


def asks_weight_versions(request: ChatCompletionRequest | CompletionRequest | None) -> bool:
    """vLLM 0.33's ``return_weight_versions``: the engine's per-choice spans are passed on only when asked
    (vLLM's own derender leaves the key null either way; its ``vllm serve`` passes them on when asked)."""
    return bool(request is not None and request.return_weight_versions)


def returns_token_ids(chat_request: ChatCompletionRequest | None, pcfg: PipelineConfig) -> bool:
    """vLLM: ``return_token_ids`` echoes a choice's ids, except while parsed reasoning is hidden."""
    return bool(chat_request is not None and chat_request.return_token_ids and (
        pcfg.include_reasoning or (pcfg.reasoning_parser is None and pcfg.tool_parser is None)))


def derender_chat(req: DerenderChatRequest, config: RenderConfig, headers: Any = None) -> ChatCompletionResponse:
    model = check_model(req.model, config)
    gen = req.generate_response
    check_fingerprint(fingerprint_sent(req.render_fingerprint, headers, gen), config)
    _check_bounds([gen], config)
    _check_prompt_ids(req.prompt_token_ids, config)
    if config.has_parsers and req.chat_request is None:
        raise bad_request(PARSER_NEEDS_CHAT_REQUEST, "chat_request")
    prompt_ids = req.prompt_token_ids if req.prompt_token_ids is not None else gen.prompt_token_ids
    choices = []
    for choice in gen.choices:
        pcfg = with_stops(
            pipeline_config(config, req.chat_request, request_id=gen.request_id, choice_index=choice.index),
            req.chat_request, whole=True, finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
        pipeline = Pipeline(config.tokenizer, pcfg)
        fields, state = derender_all(pipeline, choice.token_ids or [], prompt_ids,  # non-empty: _check_bounds
                                    engine_finish=choice.finish_reason)
        message = chat_message(fields, pcfg, config.reasoning_field)
        choices.append(ChatCompletionChoice(
            index=choice.index,
            message=message,
            logprobs=resolve_chat_logprobs(choice.logprobs, config.tokenizer,
                                           as_token_ids=tokens_as_token_ids(req.chat_request, config)),
            finish_reason=pipeline.finish_reason(state, choice.finish_reason),
            stop_reason=pipeline.stop_reason(state, choice.stop_reason),
            token_ids=choice.token_ids if returns_token_ids(req.chat_request, pcfg) else None,
            weight_versions=choice.weight_versions if asks_weight_versions(req.chat_request) else None,
        ))
    prompt_tokens = req.prompt_tokens if req.prompt_tokens is not None else 0
    completion_tokens = sum(len(c.token_ids or ()) for c in gen.choices)
    return ChatCompletionResponse(
        id=gen.request_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=UsageInfo.counted(prompt_tokens, completion_tokens),
        prompt_logprobs=gen.prompt_logprobs,
        kv_transfer_params=gen.kv_transfer_params,
        metrics=gen.metrics,
    )


# --------------------------------------------------------------------------------------- completions


def derender_completion(
    req: DerenderCompletionRequest, config: RenderConfig, headers: Any = None
) -> CompletionResponse:
    model = check_model(req.model, config)
    responses = req.generate_responses
    if not responses:
        raise bad_request("generate_responses must not be empty", "generate_responses")
    check_fingerprint(fingerprint_sent(req.render_fingerprint, headers, responses[0]), config)
    _check_bounds(responses, config)
    if req.prompt_tokens is not None and len(req.prompt_tokens) != len(responses):
        raise bad_request(
            f"prompt_tokens has {len(req.prompt_tokens)} entries but generate_responses has {len(responses)}; "
            f"give one per response.",
            "prompt_tokens",
        )
    if req.prompt_token_ids is not None:
        if len(req.prompt_token_ids) != len(responses):
            raise bad_request("prompt_token_ids must have one entry (or null) per generate response",
                              "prompt_token_ids")
        for ids in req.prompt_token_ids:
            _check_prompt_ids(ids, config)
    creq: CompletionRequest | None = req.completion_request
    choices: list[CompletionChoice] = []
    completion_tokens = 0
    for r, gen in enumerate(responses):
        prompt_ids = req.prompt_token_ids[r] if req.prompt_token_ids is not None else gen.prompt_token_ids
        for choice in gen.choices:
            pcfg = with_stops(
                completion_pipeline_config(config, creq, request_id=gen.request_id, choice_index=choice.index),
                creq, whole=True, finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
            ids = choice.token_ids or []  # non-empty: _check_bounds
            pipeline = Pipeline(config.tokenizer, pcfg)
            fields, state = derender_all(pipeline, ids, prompt_ids)
            completion_tokens += len(ids)
            choices.append(CompletionChoice(
                # vLLM numbers completion choices with one running index across all responses.
                index=len(choices),
                text=fields["content"] or "",
                logprobs=resolve_completion_logprobs(choice.logprobs, config.tokenizer,
                                                     as_token_ids=tokens_as_token_ids(creq, config)),
                finish_reason=choice.finish_reason,
                stop_reason=pipeline.stop_reason(state, choice.stop_reason),
                weight_versions=choice.weight_versions if asks_weight_versions(creq) else None,
            ))
    prompt_tokens = sum(req.prompt_tokens or ())
    first = responses[0]
    kv = first.kv_transfer_params
    if any(r.kv_transfer_params != kv for r in responses[1:]):
        kv = None
    return CompletionResponse(
        id=first.request_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=UsageInfo.counted(prompt_tokens, completion_tokens),
        kv_transfer_params=kv,
        metrics=first.metrics if len(responses) == 1 else None,
    )
