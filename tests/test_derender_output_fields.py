"""--reasoning-field and logprob token forms over HTTP: batch and streaming derender, chat and completions,
and the gateway (one shared setting on RenderConfig, one code path: choice_shapes.put_reasoning and
logprobs.tokens_as_token_ids)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.derender_http import (
    COMPLETIONS,
    EOS,
    MODEL,
    WEATHER_TOOL,
    batch_chat,
    chat_request,
    encode,
    fold_chat_chunks,
    one_token_chunks,
    post_ok,
    server,
    stream_chat,
)

PARSERS = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
REASONING_TEXT = "<think>\nCheck the weather.\n</think>\n\nIt is sunny."


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "both"])
def test_reasoning_field_names_the_key_in_batch_and_stream(field):
    ids = encode(REASONING_TEXT) + [EOS]
    req = chat_request(tools=[WEATHER_TOOL])
    want_keys = {"reasoning": {"reasoning"}, "reasoning_content": {"reasoning_content"},
                 "both": {"reasoning", "reasoning_content"}}[field]
    with server(**PARSERS, reasoning_field=field) as client:
        msg = batch_chat(client, ids, req)["choices"][0]["message"]
        chunks = stream_chat(client, one_token_chunks(ids), req)
    assert {"reasoning", "reasoning_content"} & set(msg) == want_keys
    for key in want_keys:
        assert msg[key] == "\nCheck the weather.\n"
    assert msg["content"] == "\n\nIt is sunny."
    for chunk in chunks:
        assert {"reasoning", "reasoning_content"} & set(chunk["choices"][0]["delta"]) == want_keys
    for key in want_keys:
        assert fold_chat_chunks(chunks, key)["reasoning"] == msg[key]


def test_default_reasoning_field_is_vllms_reasoning_and_a_bad_flag_is_refused():
    with server(**PARSERS) as client:
        msg = batch_chat(client, encode(REASONING_TEXT), chat_request())["choices"][0]["message"]
    assert msg["reasoning"] == "\nCheck the weather.\n" and "reasoning_content" not in msg
    from render_service.render.render_config import build_render_config
    from tests.render_harness import qwen3_bundle

    with pytest.raises(ValueError, match="reasoning-field"):
        build_render_config(qwen3_bundle(), reasoning_field="thoughts")


# ------------------------------------------------------------------------------------------- logprobs

TEXT_IDS = encode("Hi 😀 there")


def generate_logprobs(ids: list[int]) -> dict:
    """Engine logprobs in vLLM 0.32's integer form: the sampled id and one alternative each."""
    return {"content": [{"token_id": t, "logprob": -0.25, "rank": 1,
                         "top_logprobs": [{"token_id": t, "logprob": -0.25, "rank": 1},
                                          {"token_id": 13, "logprob": -2.0, "rank": 2}]} for t in ids]}


def chat_logprob_entries(answer_choices: list[dict]) -> list[dict]:
    return [e for c in answer_choices for e in (c["logprobs"] or {"content": []})["content"]]


def check_chat_entries(entries: list[dict], as_ids: bool) -> None:
    assert len(entries) == len(TEXT_IDS)
    for entry, tid in zip(entries, TEXT_IDS):
        if as_ids:
            assert entry["token"] == f"token_id:{tid}" and "token_id" not in entry
            assert entry["bytes"] == list(f"token_id:{tid}".encode())
            assert [a["token"] for a in entry["top_logprobs"]] == [f"token_id:{tid}", "token_id:13"]
        else:
            assert entry["token_id"] == tid and not entry["token"].startswith("token_id:")
            assert [a["token_id"] for a in entry["top_logprobs"]] == [tid, 13]
            assert entry["bytes"] == list(entry["token"].encode())
    if not as_ids:
        assert "".join(e["token"] for e in entries) == "Hi 😀 there"


def chat_both_ways(client, req: dict) -> tuple[list[dict], list[dict]]:
    batch = batch_chat(client, TEXT_IDS, req, logprobs=generate_logprobs(TEXT_IDS))["choices"]
    chunks = stream_chat(client, one_token_chunks(TEXT_IDS), req, logprobs_for=generate_logprobs)
    return chat_logprob_entries(batch), chat_logprob_entries([c["choices"][0] for c in chunks])


def completions_both_ways(client, creq: dict | None) -> tuple[dict, list[dict]]:
    body = {"model": MODEL, "generate_responses": [{"request_id": "c1", "choices": [
        {"index": 0, "token_ids": TEXT_IDS, "finish_reason": "length", "logprobs": generate_logprobs(TEXT_IDS)}]}]}
    if creq is not None:
        body["completion_request"] = creq
    batch = post_ok(client, COMPLETIONS, body)["choices"][0]["logprobs"]
    state, streamed = None, []
    for t in TEXT_IDS:
        sbody = {"stream": True, "model": MODEL, "stream_state": state, "generate_chunk": {"request_id": "c1", "choices": [
            {"index": 0, "token_ids": [t], "finish_reason": None, "logprobs": generate_logprobs([t])}]}}
        if creq is not None:
            sbody["completion_request"] = creq
        answer = post_ok(client, COMPLETIONS, sbody)
        state = answer["stream_state"]
        streamed.append(answer["chunk"]["choices"][0]["logprobs"])
    return batch, streamed


def check_completion_logprobs(batch: dict, streamed: list[dict], as_ids: bool) -> None:
    tokens = [t for s in streamed for t in s["tokens"]]
    assert tokens == batch["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == batch["text_offset"]
    if as_ids:
        assert batch["tokens"] == [f"token_id:{t}" for t in TEXT_IDS]
        assert "token_ids" not in batch and all("token_ids" not in s for s in streamed)
        assert all(set(top) == {f"token_id:{t}", "token_id:13"} for top, t in zip(batch["top_logprobs"], TEXT_IDS))
    else:
        assert "".join(batch["tokens"]) == "Hi 😀 there"
        assert batch["token_ids"] == [t for s in streamed for t in s["token_ids"]] == TEXT_IDS


@pytest.mark.parametrize("server_flag, request_field, as_ids", [
    (False, None, False),  # default: decoded text with integer ids
    (False, True, True),   # asked by the request
    (True, None, True),    # asked by the server flag
    (True, False, False),  # the request overrides the server flag (vLLM's rule)
])
def test_logprobs_carry_integer_ids_unless_token_id_strings_are_asked(server_flag, request_field, as_ids):
    extra = {} if request_field is None else {"return_tokens_as_token_ids": request_field}
    with server(return_tokens_as_token_ids=server_flag) as client:
        batch, streamed = chat_both_ways(client, chat_request(logprobs=True, top_logprobs=2, **extra))
        check_chat_entries(batch, as_ids)
        check_chat_entries(streamed, as_ids)
        cbatch, cstreamed = completions_both_ways(client, {"model": MODEL, "prompt": "x", "logprobs": 2, **extra})
        check_completion_logprobs(cbatch, cstreamed, as_ids)
        if request_field is None:  # no request object at all: the server flag decides
            cbatch, cstreamed = completions_both_ways(client, None)
            check_completion_logprobs(cbatch, cstreamed, as_ids)


# ------------------------------------------------------------------------------------------- gateway


@pytest.fixture(scope="module")
def gateway_stack(tmp_path_factory):
    """One collocated engine and a gateway run with --reasoning-field both --return-tokens-as-token-ids."""
    from tests.gateway_harness import engine_process, gateway_process, write_scripted_qwen3

    model = write_scripted_qwen3(tmp_path_factory.mktemp("fields") / "tiny")
    procs = []
    try:
        engine = engine_process(model)
        procs.append(engine)
        gateway = gateway_process(model, ["--engine", engine.url], "--reasoning-field", "both",
                                  "--return-tokens-as-token-ids")
        procs.append(gateway)
        yield openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        for p in reversed(procs):
            p.stop()


def test_gateway_honours_the_same_reasoning_field_and_token_id_settings(gateway_stack):
    client = gateway_stack
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
                  max_tokens=40, temperature=0, logprobs=True, top_logprobs=1)
    batch = client.chat.completions.create(**kwargs).model_dump()
    msg = batch["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "Need weather"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(e["token"].startswith("token_id:") for e in batch["choices"][0]["logprobs"]["content"])
    chunks = [c.model_dump() for c in client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert all({"reasoning", "reasoning_content"} <= set(d) for d in deltas)
    assert "".join(d.get("reasoning") or "" for d in deltas) == "Need weather"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Need weather"
    # a request flag overrides the server's token_id strings: integer ids next to decoded text
    plain = client.chat.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": False}).model_dump()
    entries = plain["choices"][0]["logprobs"]["content"]
    assert all(isinstance(e["token_id"], int) and not e["token"].startswith("token_id:") for e in entries)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == batch["usage"]["completion_tokens"]
