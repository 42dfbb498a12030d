"""output_mode "text" on /inference/v1/generate: a real engine over a scripted tiny Qwen3 with the real Qwen3
tokenizer, batch and streamed, against the tokenizer's own decode of the same token ids (vLLM's shapes)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from tests.engine_harness import engine_config, idle_client, single_threaded_server, write_tiny_qwen3
from tests.gateway_harness import (
    CHAINS,
    IM_END,
    PLAIN_PROMPT_END,
    PLAIN_SCRIPT,
    PLAIN_TEXT,
    QWEN3_TOKENIZER,
    THINKING_PROMPT_END,
    TOOL_SCRIPT,
    write_scripted_qwen3,
)
from token_engine.text.detokenizer import check_stop_strings

PLAIN_PROMPT = [151644, 77091, PLAIN_PROMPT_END]
TOOL_PROMPT = [151644, 77091, THINKING_PROMPT_END]
GO = 728  # " go": the prompt end the emoji chain starts from
# " Party 🎉 time 你好 wörld!": the emoji is three byte tokens, none of which decodes to a whole character alone
EMOJI_SCRIPT = [8554, 11162, 236, 231, 882, 220, 108386, 289, 9416, 507, 0, IM_END]
EMOJI_TEXT = " Party 🎉 time 你好 wörld!"
EMOJI_BYTES = (11162, 236, 231)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(QWEN3_TOKENIZER / "tokenizer.json"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_scripted_qwen3(tmp_path_factory.mktemp("scripted-qwen3"), [*CHAINS, [GO, *EMOJI_SCRIPT]])
    with single_threaded_server(engine_config(model_dir, max_model_len=64)) as srv:
        yield srv


@pytest.fixture
def client(server):
    yield from idle_client(server)


def body(prompt: list[int] = PLAIN_PROMPT, mode: str | None = "text", **sampling) -> dict:
    params: dict = {"temperature": 0, "max_tokens": 30, **sampling}
    request: dict = {"token_ids": prompt, "sampling_params": params}
    if mode is not None:
        request["output_mode"] = mode
    return request


def generate(client, request: dict) -> dict:
    r = client.post("/inference/v1/generate", json=request)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, request: dict) -> list[dict]:
    events = []
    with client.stream("POST", "/inference/v1/generate", json={**request, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
    return events


def streamed_choices(events: list[dict]) -> list[dict]:
    return [c for e in events for c in e["choices"]]


def test_text_is_the_tokenizers_decode_of_the_token_ids_without_the_eos(client, tokenizer):
    out = generate(client, body())
    assert out["output_mode"] == "text"
    choice = out["choices"][0]
    assert choice["token_ids"] == PLAIN_SCRIPT
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == IM_END
    assert choice["text"] == PLAIN_TEXT == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["logprobs"] is None


def test_a_tokens_answer_has_no_text_and_says_tokens(client):
    out = generate(client, body(mode=None))
    assert out["output_mode"] == "tokens" and "text" not in out["choices"][0]
    assert generate(client, body(mode="tokens"))["choices"][0]["token_ids"] == PLAIN_SCRIPT


def test_streamed_deltas_concatenate_to_the_batch_text(client):
    for prompt in (PLAIN_PROMPT, TOOL_PROMPT, [GO]):
        batch = generate(client, body(prompt))["choices"][0]
        events = stream(client, body(prompt))
        assert all(e["output_mode"] == "text" for e in events)
        choices = streamed_choices(events)
        assert "".join(c["text"] for c in choices) == batch["text"]
        assert [t for c in choices for t in c["token_ids"]] == batch["token_ids"]
        assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == IM_END


def test_a_character_split_across_tokens_comes_out_whole_in_the_step_that_completes_it(client, tokenizer):
    batch = generate(client, body([GO]))["choices"][0]
    assert batch["token_ids"] == EMOJI_SCRIPT
    assert batch["text"] == EMOJI_TEXT == tokenizer.decode(EMOJI_SCRIPT, skip_special_tokens=True)
    choices = streamed_choices(stream(client, body([GO])))
    assert all("\ufffd" not in c["text"] for c in choices)
    by_token = {c["token_ids"][0]: c["text"] for c in choices if c["token_ids"]}
    assert [by_token[t] for t in EMOJI_BYTES] == ["", "", " 🎉"]


def test_special_tokens_stay_in_the_text_when_not_skipped_but_a_stop_token_never_does(client, tokenizer):
    choice = generate(client, body(TOOL_PROMPT, skip_special_tokens=False))["choices"][0]
    assert choice["token_ids"] == TOOL_SCRIPT
    assert choice["text"] == tokenizer.decode(TOOL_SCRIPT[:-1], skip_special_tokens=False)
    # <|im_end|> not as the stop token (ignore_eos): kept unless skipped
    request = body(TOOL_PROMPT, ignore_eos=True, max_tokens=len(TOOL_SCRIPT))
    kept = generate(client, {**request, "sampling_params": {**request["sampling_params"],
                                                            "skip_special_tokens": False}})["choices"][0]
    assert kept["finish_reason"] == "length" and kept["text"].endswith("</tool_call><|im_end|>")
    assert kept["text"] == tokenizer.decode(TOOL_SCRIPT, skip_special_tokens=False)
    skipped = generate(client, request)["choices"][0]["text"]
    assert skipped == tokenizer.decode(TOOL_SCRIPT, skip_special_tokens=True) == kept["text"][:-len("<|im_end|>")]


def test_logprobs_carry_decoded_tokens_and_their_bytes_with_a_split_character_on_its_last_token(client):
    choice = generate(client, body([GO], logprobs=2))["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(EMOJI_SCRIPT)
    assert content[0]["token"] == " Party" and content[0]["bytes"] == list(b" Party")
    assert [e["token"] for e in content[1:4]] == ["", "", " 🎉"]
    assert content[3]["bytes"] == list(" 🎉".encode())
    assert content[0]["logprob"] <= 0 and len(content[0]["top_logprobs"]) == 2
    assert content[0]["top_logprobs"][0]["token"] == " Party"
    assert set(content[0]["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    streamed = [e for c in streamed_choices(stream(client, body([GO], logprobs=2))) for e in c["logprobs"]["content"]]
    assert streamed == content


def test_a_stop_string_ends_the_text_before_it_and_keeps_the_token_that_completed_it(client, tokenizer):
    out = generate(client, body(stop=["blue", "sky"]))
    choice = out["choices"][0]
    assert choice["text"] == "Hello world, the "
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "sky"
    assert choice["token_ids"] == PLAIN_SCRIPT[:PLAIN_SCRIPT.index(12884) + 1]  # " sky"
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"])
    kept = generate(client, body(stop="sky", include_stop_str_in_output=True))["choices"][0]
    assert kept["text"] == "Hello world, the sky" and kept["stop_reason"] == "sky"


def test_a_streamed_stop_string_never_shows_and_the_deltas_still_add_up(client):
    request = body(stop=["sky is", "zzz"])
    batch = generate(client, request)["choices"][0]
    assert batch["text"] == "Hello world, the "
    choices = streamed_choices(stream(client, request))
    assert all("sky" not in c["text"] for c in choices)
    assert "".join(c["text"] for c in choices) == batch["text"]
    assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == "sky is"
    assert [t for c in choices for t in c["token_ids"]] == batch["token_ids"]


def generated_tokens(server) -> float:
    return server.llm.metrics.generation_tokens_l._value.get()


def test_each_of_n_choices_stops_on_its_own_stop_string_and_the_engine_stops_generating(client, server):
    # the loop chain never ends by itself: only the stop string ends these choices, long before max_tokens
    request = body([7141], stop=" delta", max_tokens=40, n=3)
    before = generated_tokens(server)
    out = generate(client, request)
    assert [c["text"] for c in out["choices"]] == [" beta gamma"] * 3
    assert all(c["stop_reason"] == " delta" and len(c["token_ids"]) == 3 for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 9
    events = stream(client, request)
    finals = [c for c in streamed_choices(events) if c["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1, 2]
    # a step or two may run before the engine hears of the stop; without it each would run all 40 tokens
    assert generated_tokens(server) - before < 2 * 3 * 10


def test_min_tokens_keeps_a_stop_string_from_matching_early(client):
    choice = generate(client, body(stop="world", min_tokens=3))["choices"][0]
    assert choice["text"].startswith("Hello world, the") and choice["finish_reason"] == "stop"


def test_check_stop_strings_prefers_the_earliest_completed_match():
    assert check_stop_strings("abcdef", 3, ["ef", "de"], False) == ("de", 3)
    assert check_stop_strings("abcdef", 3, ["cd"], True) == ("cd", 4)
    assert check_stop_strings("abcdef", 2, ["ef"], True) == ("ef", -1)
    assert check_stop_strings("abcdef", 2, ["bc"], False) is None  # before the new text


@pytest.mark.parametrize(("request_body", "param", "message"), [
    (body(detokenize=False), "sampling_params.detokenize",
     "output_mode='text' requires sampling_params.detokenize to be true"),
    (body(mode="words"), "output_mode", "output_mode must be one of 'tokens', 'text', 'derender'"),
    (body(mode="tokens", stop=["sky"]), "sampling_params.stop", "stop strings need output_mode 'text'"),
    ({**body(), "return_token_logprobs": True}, "return_token_logprobs", "return_token_logprobs is for"),
])
def test_bad_text_requests_are_a_400_in_the_engines_error_shape(client, request_body, param, message):
    r = client.post("/inference/v1/generate", json=request_body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"] and error["code"] == 400


def test_a_tokens_request_never_loads_the_tokenizer(tmp_path_factory):
    model_dir = write_scripted_qwen3(tmp_path_factory.mktemp("scripted-qwen3-lazy"))
    with single_threaded_server(engine_config(model_dir, max_model_len=64)) as srv, srv.client() as c:
        assert generate(c, body(mode="tokens"))["choices"][0]["token_ids"] == PLAIN_SCRIPT
        assert not srv.llm.tokenizer.loaded
        assert generate(c, body())["choices"][0]["text"] == PLAIN_TEXT
        assert srv.llm.tokenizer.loaded


def test_text_needs_a_tokenizer_and_tokens_only_refuses_it(tmp_path_factory):
    bare = write_tiny_qwen3(tmp_path_factory.mktemp("no-tokenizer"), vocab_size=2048)
    assert not (bare / "tokenizer.json").exists()
    for model_dir, app_kw in ((bare, {}), (write_scripted_qwen3(tmp_path_factory.mktemp("tokens-only")),
                                           {"tokens_only": True})):
        with single_threaded_server(engine_config(model_dir, max_model_len=64), **app_kw) as srv, srv.client() as c:
            r = c.post("/inference/v1/generate", json=body([1, 2, 3]))
            assert r.status_code == 400, r.text
            assert "output_mode='text' requires a tokenizer" in r.json()["error"]["message"]
            assert generate(c, body([1, 2, 3], mode="tokens", max_tokens=2))["choices"][0]["token_ids"]
