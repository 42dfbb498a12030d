"""Checks a decoded GenerateRequest against the engine's limits and builds its SamplingOptions.

Everything here is client-supplied and untrusted: every failure is a RequestError (a 400 with the
offending parameter named), never an exception deeper in the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from msgspec import UNSET

from splitserve_common.limits import kv_transfer_params_violation
from token_engine.core.bad_words import bad_words_violation
from token_engine.core.sequence import SamplingOptions
from token_engine.http.protocol import GenerateRequest
from token_engine.http.request_error import RequestError
from token_engine.kv_connector.base import foreign_prefill_params
from token_engine.rl.logprob_controls import apply_logprob_controls
from token_engine.structured import GrammarError, parse_structured_outputs

INT64_MAX = 2**63 - 1
MAX_LOGIT_BIAS_ENTRIES = 4096


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int = 20


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value}.", f"sampling_params.{name}")
    return value


def _int_range(name: str, value: int, lo: int, hi: int, what: str | None = None) -> int:
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be {what or f'between {lo} and {hi}'}, got {value}.",
                           f"sampling_params.{name}")
    return value


def _check_token_ids(name: str, ids: list[int], vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"{name} contains token id {t}, outside the vocabulary [0, {vocab_size}).", param)


OUTPUT_MODES = ("tokens", "text", "derender")


def output_mode(req: GenerateRequest) -> str:
    """The request's output_mode (absent: "tokens"), or RequestError as vLLM's validators."""
    mode = req.output_mode
    if mode is UNSET:
        return "tokens"
    if not isinstance(mode, str) or mode not in OUTPUT_MODES:
        raise RequestError(f"output_mode must be one of 'tokens', 'text', 'derender', got "
                           f"{'null' if mode is None else repr(mode)}.", "output_mode")
    if mode != "tokens" and not req.sampling_params.detokenize:
        raise RequestError(f"output_mode={mode!r} requires sampling_params.detokenize to be true",
                           "sampling_params.detokenize")
    return mode


def validate_generate_request(req: GenerateRequest, limits: EngineLimits) -> tuple[SamplingOptions, int]:
    """(SamplingOptions, n) for req, or RequestError."""
    prompt_len = len(req.token_ids)
    if req.kv_transfer_params is None and req.sampling_params.extra_args is not None:
        # vLLM 0.32's render shape: a chat request's kv_transfer_params in sampling_params.extra_args
        carried = req.sampling_params.extra_args.get("kv_transfer_params")
        if carried is not None and not isinstance(carried, dict):
            raise RequestError("sampling_params.extra_args.kv_transfer_params must be an object.",
                               "sampling_params.extra_args")
        req.kv_transfer_params = carried
    violation = kv_transfer_params_violation(req.kv_transfer_params)
    if violation:
        raise RequestError(*violation)
    foreign = foreign_prefill_params(req.kv_transfer_params)
    if foreign is not None:
        raise RequestError(foreign, "kv_transfer_params")
    if prompt_len == 0:
        raise RequestError("token_ids must contain at least one token.", "token_ids")
    _check_token_ids("token_ids", req.token_ids, limits.vocab_size, "token_ids")
    if prompt_len >= limits.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens, which leaves no room for output. Please reduce the length of the input.",
            "token_ids")
    mode = output_mode(req)
    if req.features is not None or req.content_parts:
        raise RequestError("This engine serves text models: multimodal inputs (features, content_parts) are not "
                           "supported; send image requests to an engine with the model's vision encoder.",
                           "features" if req.features is not None else "content_parts")
    if not -INT64_MAX - 1 <= req.priority <= INT64_MAX:
        raise RequestError("priority must fit in a signed 64-bit integer.", "priority")
    if req.logprobs_format not in (None, "ids", "token_id_strings"):
        raise RequestError("logprobs_format must be 'ids' or 'token_id_strings'.", "logprobs_format")

    sp = req.sampling_params
    stop = sp.stop
    if stop and mode == "tokens":  # "" and [] are "no stop strings"; text modes check them on the text
        raise RequestError("stop strings need output_mode 'text' or 'derender' (the engine checks them on the "
                           "detokenized text); with output_mode 'tokens' use stop_token_ids.",
                           "sampling_params.stop")
    if mode != "tokens" and req.return_token_logprobs:
        raise RequestError("return_token_logprobs is for output_mode 'tokens'; text modes return logprobs with "
                           "decoded tokens (sampling_params.logprobs).", "return_token_logprobs")
    if sp.bad_words:  # tokenized by the server (core/bad_words.py): only the bounded checks here
        wrong = bad_words_violation(sp.bad_words)
        if wrong:
            raise RequestError(wrong, "sampling_params.bad_words")
        if sp.trace_decode_token_ids is not None:
            raise RequestError("trace_decode_token_ids is not supported with bad_words.",
                               "sampling_params.trace_decode_token_ids")
    structured = None
    if sp.structured_outputs is not None:
        try:
            structured = parse_structured_outputs(sp.structured_outputs)
        except GrammarError as exc:
            raise RequestError(exc.message, exc.param) from None

    _int_range("n", sp.n, 1, limits.max_num_seqs, f"between 1 and max_num_seqs ({limits.max_num_seqs})")
    temperature = _finite("temperature", sp.temperature)
    if temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {temperature}.", "sampling_params.temperature")
    top_p = _finite("top_p", sp.top_p)
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.", "sampling_params.top_p")
    top_k = sp.top_k
    if top_k < -1 or top_k > INT64_MAX:
        raise RequestError(f"top_k must be 0 or -1 (disable), or at least 1, got {top_k}.", "sampling_params.top_k")
    min_p = _finite("min_p", sp.min_p)
    if not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}.", "sampling_params.min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _finite(name, getattr(sp, name))
        if not -2.0 <= value <= 2.0:
            raise RequestError(f"{name} must be in [-2, 2], got {value}.", f"sampling_params.{name}")
    repetition_penalty = _finite("repetition_penalty", sp.repetition_penalty)
    if repetition_penalty <= 0:
        raise RequestError(f"repetition_penalty must be greater than zero, got {repetition_penalty}.",
                           "sampling_params.repetition_penalty")
    if sp.seed is not None:
        _int_range("seed", sp.seed, -INT64_MAX - 1, INT64_MAX, "a signed 64-bit integer")

    room = limits.max_model_len - prompt_len
    if sp.max_tokens is None:
        max_tokens = room
    else:
        _int_range("max_tokens", sp.max_tokens, 1, INT64_MAX, "at least 1 (and fit in 64 bits)")
        # As vLLM's get_max_tokens: clamp to the context window rather than refuse.
        max_tokens = min(sp.max_tokens, room)
    _int_range("min_tokens", sp.min_tokens, 0, INT64_MAX, "at least 0")
    if sp.max_tokens is not None and sp.min_tokens > sp.max_tokens:
        raise RequestError(f"min_tokens must be less than or equal to max_tokens={sp.max_tokens}, got {sp.min_tokens}.",
                           "sampling_params.min_tokens")
    min_tokens = min(sp.min_tokens, max_tokens)

    max_logprobs = limits.vocab_size if limits.max_logprobs < 0 else limits.max_logprobs  # -1: no cap (vLLM)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sp, name)
        if value is None:
            continue
        if value == -1:  # the whole vocabulary
            value = limits.vocab_size
        if value < 0 or value > max_logprobs:
            raise RequestError(f"{name} must be between 0 and {max_logprobs} (the server's max_logprobs), "
                               f"got {getattr(sp, name)}.", f"sampling_params.{name}")

    stop_token_ids = sp.stop_token_ids or []
    _check_token_ids("stop_token_ids", stop_token_ids, limits.vocab_size, "sampling_params.stop_token_ids")
    logit_bias: tuple[tuple[int, float], ...] = ()
    if sp.logit_bias:
        if len(sp.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise RequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries.",
                               "sampling_params.logit_bias")
        _check_token_ids("logit_bias", list(sp.logit_bias), limits.vocab_size, "sampling_params.logit_bias")
        for v in sp.logit_bias.values():
            _finite("logit_bias", v)
        logit_bias = tuple((int(k), max(-100.0, min(100.0, float(v)))) for k, v in sp.logit_bias.items())
    allowed = None
    if sp.allowed_token_ids is not None:
        if not sp.allowed_token_ids:
            raise RequestError("allowed_token_ids must not be empty.", "sampling_params.allowed_token_ids")
        _check_token_ids("allowed_token_ids", sp.allowed_token_ids, limits.vocab_size,
                         "sampling_params.allowed_token_ids")
        allowed = tuple(sp.allowed_token_ids)

    options = SamplingOptions(
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k == -1 else top_k,
        min_p=min_p,
        seed=sp.seed,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=repetition_penalty,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=frozenset(stop_token_ids),
        ignore_eos=sp.ignore_eos,
        # return_token_logprobs needs the sampled token's logprob even when no top-k was asked for.
        logprobs=(0 if req.return_token_logprobs else None) if sp.logprobs is None else (
            limits.vocab_size if sp.logprobs == -1 else sp.logprobs),
        prompt_logprobs=None if sp.prompt_logprobs is None else (
            limits.vocab_size if sp.prompt_logprobs == -1 else sp.prompt_logprobs),
        logit_bias=logit_bias,
        allowed_token_ids=allowed,
        skip_prefix_cache=bool(sp.skip_reading_prefix_cache),
        structured=structured,
        structured_after_reasoning=structured is not None and req.reasoning_ended is False,
    )
    options = apply_logprob_controls(sp, options, limits.vocab_size, limits.max_model_len, prompt_len)
    return options, sp.n
