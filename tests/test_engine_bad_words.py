"""sampling_params.bad_words on the tokens-only engine: tokenized with the model directory's real Qwen3 tokenizer
as vLLM's SamplingParams.update_from_tokenizer does, banned in the sampler, over real HTTP (batch and stream)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tests.engine_harness import engine_config, idle_client, single_threaded_server
from tests.gateway_harness import PLAIN_PROMPT_END, PLAIN_SCRIPT, QWEN3_TOKENIZER, write_scripted_qwen3
from token_engine.core.bad_words import (
    MAX_BAD_WORDS,
    BadWordsError,
    BadWordsTokenizer,
    banned_next_tokens,
)

# The scripted model walks PLAIN_SCRIPT from "\n\n": "Hello world, the sky is blue today and birds sing."
PROMPT = [151644, 77091, PLAIN_PROMPT_END]
HELLO, THE, SKY, IS, BLUE = 9707, 279, 12884, 374, 6303
VOCAB = 151936


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_scripted_qwen3(tmp_path_factory.mktemp("scripted-qwen3"))
    with single_threaded_server(engine_config(model_dir, max_model_len=64)) as srv:
        yield srv


@pytest.fixture
def client(server):
    yield from idle_client(server)


def body(bad_words: list[str] | None = None, prompt: list[int] = PROMPT, **extra) -> dict:
    params: dict = {"temperature": 0, "max_tokens": len(PLAIN_SCRIPT) - 1, "ignore_eos": True}
    if bad_words is not None:
        params["bad_words"] = bad_words
    return {"token_ids": prompt, "sampling_params": params, **extra}


def generated(client, request: dict) -> list[int]:
    r = client.post("/inference/v1/generate", json=request)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def streamed(client, request: dict) -> list[int]:
    tokens: list[int] = []
    with client.stream("POST", "/inference/v1/generate", json={**request, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: "):])["choices"]:
                    tokens.extend(choice["token_ids"])
    return tokens


# ---- tokenizing, as vLLM -----------------------------------------------------------------------------
def test_each_word_is_banned_as_written_and_after_a_space_with_the_real_tokenizer():
    hf = AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER))
    ids = BadWordsTokenizer(QWEN3_TOKENIZER, VOCAB).token_ids(["blue", "sky is", "blue"])
    assert ids == (tuple(hf.encode("blue", add_special_tokens=False)), (BLUE,),
                   tuple(hf.encode("sky is", add_special_tokens=False)), (SKY, IS))


def test_a_spaced_form_that_only_adds_a_space_token_is_not_banned():
    # " 123" is a space token then "123"'s own tokens: banning it would ban nothing new (vLLM keeps only "123")
    hf = AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER))
    assert len(hf.encode(" 123", add_special_tokens=False)) != len(hf.encode("123", add_special_tokens=False))
    assert BadWordsTokenizer(QWEN3_TOKENIZER, VOCAB).token_ids(["  123"]) == (
        tuple(hf.encode("123", add_special_tokens=False)),)


def test_tokenizing_refuses_blank_words_too_many_words_and_a_missing_tokenizer(tmp_path):
    words = BadWordsTokenizer(QWEN3_TOKENIZER, VOCAB)
    with pytest.raises(BadWordsError, match="at least one token"):
        words.token_ids(["   "])
    with pytest.raises(BadWordsError, match="Too many bad words"):
        words.token_ids([f"w{i}" for i in range(MAX_BAD_WORDS // 2 + 1)])  # each has a spaced form too
    with pytest.raises(BadWordsError, match="no tokenizer.json"):
        BadWordsTokenizer(tmp_path, VOCAB).token_ids(["blue"])
    (tmp_path / "tokenizer.json").write_text("{not json")
    broken = BadWordsTokenizer(tmp_path, VOCAB)
    with pytest.raises(BadWordsError, match="could not be loaded"):
        broken.token_ids(["blue"])
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(BadWordsError, match="could not be loaded"):  # remembered, not read again per request
        broken.token_ids(["blue"])


def test_the_ban_needs_the_words_other_tokens_at_the_end_of_the_output_not_the_prompt():
    words = ((BLUE,), (SKY, IS))
    prompt = [1, SKY]
    assert banned_next_tokens(words, prompt, prompt_len=2) == (BLUE,)  # " sky" is the prompt's
    assert banned_next_tokens(words, [*prompt, SKY], prompt_len=2) == (BLUE, IS)
    assert banned_next_tokens(words, [*prompt, SKY, THE], prompt_len=2) == (BLUE,)


# ---- over HTTP -----------------------------------------------------------------------------------------
def test_a_greedy_answer_loses_a_banned_word_batch_and_streamed(client):
    plain = generated(client, body())
    assert plain == PLAIN_SCRIPT[:len(plain)] and BLUE in plain
    for fetch in (generated, streamed):
        banned = fetch(client, body(["blue"]))
        cut = plain.index(BLUE)
        assert banned[:cut] == plain[:cut]  # the same answer up to the word
        assert BLUE not in banned and 12203 not in banned and len(banned) == len(plain)


def test_a_multi_token_word_bans_its_last_token_only_right_after_the_others(client):
    plain = generated(client, body())
    for fetch in (generated, streamed):
        banned = fetch(client, body(["sky is"]))
        cut = plain.index(IS)
        assert banned[:cut] == plain[:cut] and banned[cut - 1] == SKY and banned[cut] != IS
        # " the blue": " blue" comes after " is", not after " the", so nothing is banned
        assert fetch(client, body(["the blue"])) == plain


def test_the_prompt_is_not_part_of_a_bad_word(client):
    after_sky = [*PROMPT, HELLO, 1879, 11, THE, SKY]
    assert generated(client, body(["sky is"], prompt=after_sky))[0] == IS
    assert generated(client, body(["is"], prompt=after_sky))[0] != IS


@pytest.mark.parametrize("sampling, param, message", [
    ({"bad_words": [""]}, "sampling_params.bad_words", "empty string"),
    ({"bad_words": ["  "]}, "sampling_params.bad_words", "at least one token"),
    ({"bad_words": [f"w{i}" for i in range(MAX_BAD_WORDS + 1)]}, "sampling_params.bad_words", "Too many"),
    ({"bad_words": ["x" * 70000]}, "sampling_params.bad_words", "characters"),
    ({"bad_words": [1]}, None, ""),
    ({"bad_words": ["blue"], "trace_decode_token_ids": [HELLO]}, "sampling_params.trace_decode_token_ids", "bad_words"),
])
def test_bad_input_is_a_400_in_the_engines_error_shape(client, sampling, param, message):
    request = body()
    request["sampling_params"].update(sampling)
    for stream in (False, True):
        r = client.post("/inference/v1/generate", json={**request, "stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError" and message in error["message"]
        if param is not None:
            assert error["param"] == param
