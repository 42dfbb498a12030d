"""Request checks of the tokens-only engine, without a server: defaults, clamps and refusals."""

import msgspec
import pytest

from token_engine.http.protocol import GenerateRequest
from token_engine.http.request_error import RequestError
from token_engine.http.validation import EngineLimits, validate_generate_request

LIMITS = EngineLimits(vocab_size=1000, max_model_len=100, max_num_seqs=8, max_logprobs=20)


def check(body: dict, limits: EngineLimits = LIMITS):
    return validate_generate_request(msgspec.convert(body, GenerateRequest, strict=False), limits)


def test_max_tokens_defaults_to_the_room_left_and_an_explicit_value_is_clamped_to_it():
    opts, n = check({"token_ids": [1] * 30, "sampling_params": {}})
    assert opts.max_tokens == 70 and n == 1
    assert check({"token_ids": [1] * 30, "sampling_params": {"max_tokens": 16}})[0].max_tokens == 16
    assert check({"token_ids": [1] * 30, "sampling_params": {"max_tokens": 10**12}})[0].max_tokens == 70


def test_min_tokens_never_exceeds_the_room_left():
    opts, _ = check({"token_ids": [1] * 95, "sampling_params": {"min_tokens": 50}})
    assert (opts.max_tokens, opts.min_tokens) == (5, 5)


def test_top_k_minus_one_and_empty_stop_mean_off():
    opts, _ = check({"token_ids": [1], "sampling_params": {"top_k": -1, "stop": [], "stop_token_ids": [5]}})
    assert opts.top_k == 0 and opts.stop_token_ids == frozenset({5})
    assert check({"token_ids": [1], "sampling_params": {"stop": ""}})[0].top_k == 0


def test_whole_vocabulary_logprobs_need_an_unlimited_server():
    with pytest.raises(RequestError, match="max_logprobs"):
        check({"token_ids": [1], "sampling_params": {"logprobs": -1}})
    unlimited = EngineLimits(1000, 100, 8, max_logprobs=-1)
    assert check({"token_ids": [1], "sampling_params": {"logprobs": -1}}, unlimited)[0].logprobs == 1000


def test_logit_bias_is_clamped_to_plus_minus_100():
    opts, _ = check({"token_ids": [1], "sampling_params": {"logit_bias": {"3": 500, "4": -1e9}}})
    assert dict(opts.logit_bias) == {3: 100.0, 4: -100.0}


@pytest.mark.parametrize("sampling, param", [
    ({"temperature": float("nan")}, "sampling_params.temperature"),
    ({"seed": 2**70}, "sampling_params.seed"),
    ({"allowed_token_ids": []}, "sampling_params.allowed_token_ids"),
    ({"allowed_token_ids": [1000]}, "sampling_params.allowed_token_ids"),
    ({"bad_words": ["x", ""]}, "sampling_params.bad_words"),
    ({"bad_words": ["x"], "trace_decode_token_ids": [1]}, "sampling_params.trace_decode_token_ids"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "sampling_params.structured_outputs"),  # two kinds
    ({"prompt_logprobs": 21}, "sampling_params.prompt_logprobs"),
    ({"frequency_penalty": -3}, "sampling_params.frequency_penalty"),
])
def test_refusals_name_the_offending_parameter(sampling, param):
    with pytest.raises(RequestError) as exc:
        check({"token_ids": [1], "sampling_params": sampling})
    assert exc.value.param == param and exc.value.status == 400


def test_priority_must_fit_in_64_bits():
    with pytest.raises(RequestError, match="priority"):
        check({"token_ids": [1], "sampling_params": {}, "priority": 2**64})
    assert check({"token_ids": [1], "sampling_params": {}, "priority": -5})[1] == 1
