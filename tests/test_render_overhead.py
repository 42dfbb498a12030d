"""What render_chat does besides the template and tokenizing, made cheaper without changing an answer:
tool-call arguments parsed by msgspec where that gives json.loads' own value (json.loads for everything else),
and the tools prepared once for the template and the response's parse_context."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.http.errors import ApiError
from render_service.render.render import render_chat
from render_service.render.render_config import load_render_config
from render_service.templates.chat_messages import _arguments_mapping, prepare_messages, prepare_tools
from render_service.wire.protocol import ChatCompletionRequest
from tests.shared_paths import QWEN3_FIXTURE_DIR


def reference_arguments(arguments: Any) -> dict[str, Any]:
    """The rule as it was written before msgspec: json.loads, {} for what is not a non-empty JSON object."""
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) and arguments else {}


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (1, 1.0 and True apart; NaN equal to NaN; -0.0 apart)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def outcome(fn: Any, text: str) -> tuple[str, Any]:
    try:
        return "value", fn(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is handled inside; others must match in kind
        return type(exc).__name__, None


def assert_same_outcome(text: str) -> None:
    got, want = outcome(_arguments_mapping, text), outcome(reference_arguments, text)
    assert got[0] == want[0], (text[:200], got, want)
    assert same(got[1], want[1]), (text[:200], got, want)


# JSON texts json.loads and msgspec might read apart: numbers at and past every range, non-finite literals,
# surrogate escapes (paired, lone, in keys), raw control characters, duplicate keys, whitespace, bad syntax.
EDGE_TEXTS = [
    '{"a": NaN}', '{"a": Infinity, "b": -Infinity}', '{"a": 1e400}', '{"a": -1e400}', '{"a": 1e-400}',
    '{"a": 123456789012345678901234567890}', '{"a": 18446744073709551616}', '{"a": -9223372036854775809}',
    '{"a": 9223372036854775807}', '{"a": -0}', '{"a": -0.0}', '{"a": 1.5e-320}', '{"a": 0.1}', '{"a": 1E5}',
    '{"a": 2.2250738585072011e-308}', '{"a": 1.7976931348623157e308}', '{"a": 1.7976931348623159e308}',
    '{"a": ' + "9" * 4300 + "}", '{"a": ' + "9" * 4301 + "}", '{"a": 1' + "0" * 400 + ".5}",
    '{"a": "\\ud800"}', '{"\\udfff": 1}', '{"a": "\\ud83d\\ude00"}', '{"a": "x\ud800y"}', '{"a": "\\u0000"}',
    '{"a": "x\ty"}', '{"a": "\x1f"}', '{"a": "\x7f"}', '{"a": 1, "a": 2}', ' \t\n{"a": 1}\r\n ', '\ufeff{"a": 1}',
    '{"a": 01}', '{"a": [1,]}', '{"a": 1,}', '{"a": tru}', '{"a": true} x', '{"a": .5}', '{"a": 5.}', "[1, 2]",
    "{}", '"text"', "3", "null", "{", "", "   ", '{"a": {"b": [1, {"c": null}]}}',
    '{"a": "' + "\U0001F600" * 50 + '"}', '[' * 200 + ']' * 200, '{"a": ' + '[' * 300 + ']' * 300 + '}',
    '{"a": ' + '[' * 3000 + ']' * 3000 + '}',
]


@pytest.mark.parametrize("text", EDGE_TEXTS, ids=range(len(EDGE_TEXTS)))
def test_tool_call_arguments_parse_as_json_loads_on_edge_texts(text):
    assert_same_outcome(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values, ascii_only=st.booleans(), spaced=st.booleans())
def test_tool_call_arguments_parse_as_json_loads_on_generated_json(value, ascii_only, spaced):
    text = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True, indent=1 if spaced else None)
    assert_same_outcome(text)
    assert_same_outcome(json.dumps({"arguments": value, "again": value}, ensure_ascii=ascii_only, allow_nan=True))
    assert_same_outcome(text[: len(text) // 2])  # cut short: JSON or not, the same answer


@pytest.fixture(scope="module")
def config():
    return load_render_config(str(QWEN3_FIXTURE_DIR), served_model_names=["m"], reasoning_parser="qwen3",
                              tool_call_parser="hermes", enable_auto_tool_choice=True)


TOOLS = [{"type": "function", "function": {"name": "read", "description": "read a file", "strict": True,
                                           "parameters": {"type": "object", "properties": {"p": {"type": "string"}}}},
          "x-extra": 1},
         {"type": "function", "function": {"name": "run"}, "defer_loading": False}]


def conversation(arguments: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]


@pytest.mark.parametrize("arguments", ['{"p": "a.py", "n": 3}', '{"n": NaN, "m": Infinity}', '{"n": 1e400}',
                                       '{"s": "\\ud83d\\ude00"}', '{"p": 1, "p": "last"}', "[1]", "not json"])
def test_rendered_prompt_has_the_arguments_json_loads_reads(config, arguments):
    messages = conversation(arguments)
    gen = render_chat(ChatCompletionRequest(messages=messages, tools=TOOLS), config)
    expected_messages = prepare_messages(messages)
    expected_messages[1]["tool_calls"][0]["function"]["arguments"] = reference_arguments(arguments)
    text = config.template.render(expected_messages, tools=prepare_tools(TOOLS), add_generation_prompt=True)
    assert list(gen.token_ids) == config.tokenizer.encode(text)
    if arguments.startswith('{"n": NaN'):
        assert '"n": NaN' in text and '"m": Infinity' in text  # json.loads' reading, kept: msgspec refuses these


def test_parse_context_carries_the_prepared_tools_rendered_or_prerendered(config):
    messages = conversation('{"p": "a.py"}')
    rendered = render_chat(ChatCompletionRequest(messages=messages, tools=TOOLS), config)
    assert rendered.parse_context is not None
    assert rendered.parse_context["tools"] == prepare_tools(TOOLS)
    assert rendered.parse_context["tools"][0]["function"]["strict"] is True
    assert "x-extra" not in rendered.parse_context["tools"][0]
    given = render_chat(ChatCompletionRequest(
        messages=messages, tools=TOOLS,
        kv_transfer_params={"prompt_token_ids": list(rendered.token_ids),
                            "render_fingerprint": config.fingerprint}), config)
    assert given.parse_context == rendered.parse_context
    no_tools = render_chat(ChatCompletionRequest(messages=messages), config)
    assert no_tools.parse_context is not None and no_tools.parse_context["tools"] is None


def test_malformed_tools_answer_as_before_rendered_or_prerendered(config):
    bad = [{"type": "function", "function": {"name": "read", "strict": "yes"}}]
    messages = conversation("{}")
    with pytest.raises(ApiError) as rendered:
        render_chat(ChatCompletionRequest(messages=messages, tools=bad), config)
    assert rendered.value.status == 400 and rendered.value.param == "messages"
    with pytest.raises(ApiError) as given:
        render_chat(ChatCompletionRequest(messages=messages, tools=bad,
                                          kv_transfer_params={"prompt_token_ids": [1, 2, 3]}), config)
    assert given.value.status == 400 and given.value.param == "tools"
    assert "strict must be a boolean" in str(given.value)
    # ids given: a bad stop_token_ids is still reported before the tools (the order the checks always ran in)
    with pytest.raises(ApiError) as first:
        render_chat(ChatCompletionRequest(messages=messages, tools=bad, stop_token_ids=[10**9],
                                          kv_transfer_params={"prompt_token_ids": [1, 2, 3]}), config)
    assert first.value.param == "stop_token_ids"
