"""Tool-call id styles per parser (mistral: 9 alphanumerics a Mistral template accepts on the next turn) and
forced tool_choice ("required", named) derendered on a server without a tool parser; over HTTP."""

from __future__ import annotations

import json

from tests.derender_http import (
    EOS,
    WEATHER_TOOL,
    batch_as_fold,
    batch_chat,
    chat_request,
    encode,
    fold_chat_chunks,
    one_token_chunks,
    post_ok,
    server,
    stream_chat,
)

# The tool-call id rule of Mistral's chat templates (mistral_common validates the same on its side).
MISTRAL_STYLE_TEMPLATE = """
{%- for message in messages %}
{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][
{%- for tool_call in message.tool_calls %}
{%- if tool_call.id is not string or tool_call.id|length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}
{{- {"name": tool_call.function.name, "arguments": tool_call.function.arguments, "id": tool_call.id}|tojson }}
{%- if not loop.last %}, {% endif %}
{%- endfor %}]</s>
{%- elif message.role == 'tool' %}
{%- if message.tool_call_id is not string or message.tool_call_id|length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}[TOOL_RESULTS]{"content": {{ message.content|tojson }}, "call_id": {{ message.tool_call_id|tojson }}}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' %}{{ message.content }}</s>
{%- endif %}
{%- endfor %}
"""
MISTRAL = {"tool_call_parser": "mistral", "enable_auto_tool_choice": True, "chat_template": MISTRAL_STYLE_TEMPLATE}
MISTRAL_OUTPUT = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                  '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')


def next_turn(call_ids: list[str]) -> dict:
    calls = [{"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
             for cid in call_ids]
    return {"model": "qwen3-0.6b", "tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": cid, "content": "sunny"} for cid in call_ids),
    ]}


def test_mistral_call_ids_are_9_alphanumerics_stable_across_batch_and_stream_and_pass_the_template():
    ids = encode(MISTRAL_OUTPUT) + [EOS]
    req = chat_request(tools=[WEATHER_TOOL])
    with server(**MISTRAL) as client:
        batch = batch_chat(client, ids, req, request_id="gen-m1", n_choices=2)["choices"]
        streamed = fold_chat_chunks(stream_chat(client, one_token_chunks(ids), req, request_id="gen-m1"))
        call_ids = [c["id"] for c in batch[0]["message"]["tool_calls"]]
        assert len(call_ids) == 2
        assert all(len(cid) == 9 and cid.isascii() and cid.isalnum() for cid in call_ids)
        # deterministic per (request id, choice, call): batch == stream, choices and calls differ
        assert streamed == batch_as_fold(batch[0])
        assert len(set(call_ids) | {c["id"] for c in batch[1]["message"]["tool_calls"]}) == 4
        again = batch_chat(client, ids, req, request_id="gen-m1")["choices"][0]["message"]["tool_calls"]
        assert [c["id"] for c in again] == call_ids
        rendered = post_ok(client, "/v1/chat/completions/render", next_turn(call_ids))
        assert rendered["token_ids"]
        # the check is real: the ids other parsers get are refused by the same template
        refused = client.post("/v1/chat/completions/render", json=next_turn(["chatcmpl-tool-" + "0" * 32]))
        assert refused.status_code == 400 and "length 9" in refused.json()["error"]["message"]


def test_other_parsers_keep_chatcmpl_tool_ids():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    with server(tool_call_parser="hermes", enable_auto_tool_choice=True) as client:
        call = batch_chat(client, encode(text) + [EOS], chat_request(tools=[WEATHER_TOOL]))["choices"][0]
    assert call["message"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")


# --------------------------------------------------------------------------------- forced tool choice

NAMED = {"type": "function", "function": {"name": "get_weather"}}
REQUIRED_OUTPUT = '[{"name": "get_weather", "parameters": {"city": "Paris 😀"}}]'
NAMED_OUTPUT = '{"city": "Paris 😀"}'


def test_named_tool_choice_parses_without_a_tool_parser():
    ids = encode(NAMED_OUTPUT) + [EOS]
    req = chat_request(tools=[WEATHER_TOOL], tool_choice=NAMED)
    with server() as client:
        choice = batch_chat(client, ids, req)["choices"][0]
        streamed = fold_chat_chunks(stream_chat(client, [ids[:3], ids[3:5], ids[5:]], req))
    msg = choice["message"]
    assert msg["content"] == ""
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris 😀"}
    assert choice["finish_reason"] == "stop"  # OpenAI: a forced call is not the model's choice
    assert streamed == batch_as_fold(choice)


def test_required_tool_choice_parses_without_a_tool_parser():
    ids = encode(REQUIRED_OUTPUT) + [EOS]
    req = chat_request(tools=[WEATHER_TOOL], tool_choice="required")
    with server() as client:
        choice = batch_chat(client, ids, req)["choices"][0]
        streamed = fold_chat_chunks(stream_chat(client, one_token_chunks(ids), req))
    msg = choice["message"]
    assert msg["content"] == "" and msg["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris 😀"}
    assert choice["finish_reason"] == "tool_calls"
    assert streamed == batch_as_fold(choice)


def test_auto_and_none_without_a_tool_parser_stay_plain_content():
    ids = encode(REQUIRED_OUTPUT) + [EOS]
    with server() as client:
        for choice in ("auto", "none", None):
            req = chat_request(tools=[WEATHER_TOOL], **({} if choice is None else {"tool_choice": choice}))
            out = batch_chat(client, ids, req)["choices"][0]
            assert out["message"]["content"] == REQUIRED_OUTPUT and "tool_calls" not in out["message"]
            assert out["finish_reason"] == "stop"
