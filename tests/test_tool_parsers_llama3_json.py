"""llama3_json tool parser: parser-semantics.md V-T21, V-T23, V-T24, ``;``-separated calls, splits; and what a
whole answer and a stream carry, through the derender over a Llama 3.1 test tokenizer's ids (vLLM 0.34's
parser engine is the reference: bench/llama_json_parity.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.bundle.model_bundle import load_bundle
from render_service.derender.batch import derender_chat
from render_service.derender.stream import derender_chat_stream
from render_service.render.render_config import RenderConfig, build_render_config
from render_service.streaming_cache.session import StreamRuntime
from render_service.wire.protocol import (
    ChatCompletionRequest,
    DerenderChatRequest,
    DerenderChatStreamRequest,
    GenerateResponse,
    GenerateResponseChoice,
    GenerateStreamChoice,
    GenerateStreamResponse,
)
from tests.family_bundles import write_family_bundle
from tests.test_tool_parsers_common import ARG_TEXT, args_of, assert_split_invariant, names_of, parse, parse_chunks

EOT = 128009  # Llama 3.1's <|eot_id|>
PYTHON_TAG_ID = 128010


def test_v_t21_single_call_no_content():
    r = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "San Francisco"}}')
    assert r.content is None
    assert r.calls == [{"name": "get_weather", "arguments": '{"city": "San Francisco"}', "id": None}]


def test_v_t23_text_before_json_is_content_as_vllm_034_reads_it():
    # vLLM 0.33's batch found the call anywhere (and lost the prefix); 0.34 reads content in both modes, as we do
    text = 'Sure! {"name": "get_weather", "parameters": {"city": "SF"}}'
    r = parse("llama3_json", text)
    assert r.content == text and r.calls == []


def test_v_t24_non_ascii_arguments_stay_literal_and_json_equal():
    r = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "東京"}}')
    assert r.calls[0]["arguments"] == '{"city": "東京"}'
    assert args_of(r) == [{"city": "\u6771\u4eac"}]


def test_python_tag_and_semicolon_separated_calls():
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "arguments": {"city": "Oslo"}}'
    r = parse("llama3_json", text)
    assert r.content is None
    assert names_of(r) == ["get_time", "get_weather"] and args_of(r) == [{}, {"city": "Oslo"}]


def test_leading_whitespace_before_the_object_is_allowed():
    assert names_of(parse("llama3_json", '\n {"name": "get_time", "parameters": {}}')) == ["get_time"]


def test_json_answer_without_name_is_content():
    text = '{"answer": 42, "note": "not a call"}'
    assert parse("llama3_json", text).content == text


def test_text_after_the_calls_is_content():
    # the whitespace right after a call is layout, the prose is the model's
    r = parse("llama3_json", '{"name": "get_time", "parameters": {}} and then some prose')
    assert r.content == "and then some prose" and names_of(r) == ["get_time"]


def test_malformed_arguments_close_and_the_rest_is_content():
    # the stream used to end with arguments that do not parse
    text = '{"name": "get_weather", "parameters": {"city": "Paris", oops}} more'
    r = parse("llama3_json", text)
    assert args_of(r) == [{"city": "Paris"}] and r.content == "oops}} more"
    assert parse_chunks("llama3_json", list(text)) == r
    r = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par')
    assert args_of(r) == [{"city": "Par"}]


def test_an_object_with_a_name_and_no_arguments_key_is_content():
    # prose JSON (a person, a record) is no call: vLLM 0.34's batch rule, held in the stream too (its stream
    # announced a call "John" and lost the rest)
    for text in ('{"name": "John", "age": 30}', '{"name": "get_time"}', '{"name": "get_weather", "param'):
        r = parse("llama3_json", text)
        assert r.content == text and r.calls == []
        assert parse_chunks("llama3_json", list(text)) == r


def test_the_call_is_announced_at_its_arguments_key_wherever_the_name_is():
    r = parse_chunks("llama3_json", list('{"parameters": {"x": 1}, "name": "f"}'))
    assert names_of(r) == ["f"] and args_of(r) == [{"x": 1}] and r.content is None


def test_truncated_before_the_name_is_content():
    text = '{"name": "get_we'
    assert parse("llama3_json", text).content == text


def test_deeply_nested_arguments_parse():
    # vLLM's batch regex allows one nesting level only; the scanner has no such limit
    args = {"a": {"b": {"c": {"d": [1, {"e": "}"}]}}}}
    text = json.dumps({"name": "f", "parameters": args})
    assert args_of(parse("llama3_json", text)) == [args]


def test_one_character_per_feed_equals_one_feed():
    text = '<|python_tag|>{"name": "a", "parameters": {"q": "x; {y}"}}; {"name": "b", "parameters": {}}'
    assert parse_chunks("llama3_json", list(text)) == parse("llama3_json", text)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(ARG_TEXT, st.integers(), st.none()), max_size=3), min_size=1, max_size=3),
    st.booleans(),
    st.lists(st.integers(0, 300), max_size=25),
)
def test_property_random_splits_give_the_same_calls_as_one_feed(calls, python_tag, cuts):
    text = ("<|python_tag|>" if python_tag else "") + "; ".join(
        json.dumps({"name": f"f{i}", "parameters": a}, ensure_ascii=i % 2 == 0) for i, a in enumerate(calls)
    )
    whole = assert_split_invariant("llama3_json", text, cuts)
    assert args_of(whole) == calls and whole.content is None


def test_python_tag_after_text_opens_the_calls():
    # Llama's own marker: what follows it is calls even after text (vLLM 0.34 reads it so, batch and stream)
    text = 'Let me check. <|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}}; {"name": "b", "parameters": {}}'
    r = parse("llama3_json", text)
    assert r.content == "Let me check. " and names_of(r) == ["get_weather", "b"]
    assert parse_chunks("llama3_json", list(text)) == r


def test_python_tag_in_text_without_a_call_stays_content():
    for text in ("use <|python_tag|> to call", "x <|python_tag|>\n {\"answer\": 1}", "ends in <|python_ta"):
        r = parse("llama3_json", text)
        assert r.content == text and r.calls == []
        assert parse_chunks("llama3_json", list(text)) == r


def test_readers_inside_other_families_tags_ignore_the_python_tag():
    text = '<|action_start|><|plugin|>hi <|python_tag|>{"name": "get_weather", "parameters": {}}<|action_end|>'
    assert parse("internlm", text).calls == []


# --- through the derender over a Llama 3.1 tokenizer's ids ----------------------------------------------------


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> RenderConfig:
    bundle = write_family_bundle("llama3", Path(tmp_path_factory.mktemp("llama3")))
    return build_render_config(load_bundle(str(bundle)), served_model_names=["m"], tool_call_parser="llama3_json",
                               enable_auto_tool_choice=True)


REQUEST = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto", "tools": [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
    ChatCompletionRequest)


def ids_of(cfg: RenderConfig, text: str) -> list[int]:
    return list(cfg.tokenizer.encode(text)) + [EOT]


def whole(cfg: RenderConfig, ids: list[int]) -> dict[str, Any]:
    choice = derender_chat(DerenderChatRequest(generate_response=GenerateResponse(request_id="r", choices=[
        GenerateResponseChoice(token_ids=ids, finish_reason="stop")]), chat_request=REQUEST), cfg).choices[0]
    return {"content": choice.message.content, "finish_reason": choice.finish_reason,
            "calls": [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]}


def streamed(cfg: RenderConfig, ids: list[int]) -> dict[str, Any]:
    """One token a chunk, the state through JSON between chunks; the chunks folded."""
    runtime, state, content, calls, finish = StreamRuntime(secret="t"), None, "", {}, None
    for i, token in enumerate(ids):
        out = derender_chat_stream(DerenderChatStreamRequest(stream=True, generate_chunk=GenerateStreamResponse(
            request_id="r", choices=[GenerateStreamChoice(token_ids=[token], finish_reason=(
                "stop" if i == len(ids) - 1 else None))]), stream_state=state, chat_request=REQUEST), cfg, runtime)
        state = json.loads(msgspec.json.encode(out.stream_state))
        choice = out.chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            name, args = calls.get(tc.index, (None, ""))
            calls[tc.index] = (tc.function.name or name, args + (tc.function.arguments or ""))
        finish = choice.finish_reason or finish
    return {"content": content or None, "finish_reason": finish, "calls": [calls[i] for i in sorted(calls)]}


def test_python_tag_after_text_through_the_derender(llama3: RenderConfig):
    ids = ids_of(llama3, 'Let me check. <|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}}')
    assert PYTHON_TAG_ID in ids  # one special token in Llama 3.1's vocabulary
    expected = {"content": "Let me check. ", "finish_reason": "tool_calls",
                "calls": [("get_weather", '{"city": "SF"}')]}
    assert whole(llama3, ids) == expected
    assert streamed(llama3, ids) == expected


def test_a_named_object_without_arguments_through_the_derender(llama3: RenderConfig):
    ids = ids_of(llama3, '{"name": "John", "age": 30}')
    expected = {"content": '{"name": "John", "age": 30}', "finish_reason": "stop", "calls": []}
    assert whole(llama3, ids) == expected
    assert streamed(llama3, ids) == expected


def test_whole_answer_keeps_the_models_argument_bytes(llama3: RenderConfig):
    # vLLM 0.34 gives the model's own text in both modes (0.33 re-serialized a whole answer's arguments)
    for args in ('{"city":"Oslo","days":2}', '{"city": "東京 😀"}', '{"city": "\\u6771\\u4eac"}'):
        ids = ids_of(llama3, '{"name": "get_weather", "parameters": ' + args + "}")
        assert whole(llama3, ids)["calls"] == [("get_weather", args)]
        assert streamed(llama3, ids) == whole(llama3, ids)
