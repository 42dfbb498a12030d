"""/v1/responses/render and /v1/messages/render: the same token IDs as the chat render of the equivalent chat
request (real Qwen3 tokenizer and template, qwen3 + hermes parsers), the API's semantics where they differ from
upstream (Messages prefill, thinking switch and budget), and bad input as 400 in each API's own error shape,
over a real server on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from render_service.apis.messages import count_tokens, render_messages
from render_service.apis.messages_protocol import CountTokensRequest, MessagesRequest
from render_service.apis.responses import render_responses
from render_service.apis.responses_protocol import ResponsesRequest
from render_service.http.errors import ApiError
from render_service.render.render import render_chat
from render_service.wire.protocol import ChatCompletionRequest
from tests.render_harness import RenderServer, qwen3_config

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                 "parameters": WEATHER_SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
                    "parameters": WEATHER_SCHEMA}]
MESSAGES_TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}]
ARGS = {"city": "Paris"}


@pytest.fixture(scope="module")
def config():
    return qwen3_config(parsers=True)


@pytest.fixture(scope="module")
def server(config):
    with RenderServer(config) as s:
        yield s


def chat_ids(config, **fields):
    return render_chat(ChatCompletionRequest(**fields), config)


# ------------------------------------------------------------------------------------------ Responses


def test_responses_string_input_and_instructions_render_as_chat(config):
    gen, _ = render_responses(ResponsesRequest(input="Hi there", instructions="Be brief.", max_output_tokens=40,
                                               temperature=0.3, top_p=0.9), config)
    chat = chat_ids(config, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
                    max_completion_tokens=40, temperature=0.3, top_p=0.9)
    assert gen.token_ids == chat.token_ids
    assert gen.sampling_params.max_tokens == 40 == chat.sampling_params.max_tokens
    assert (gen.sampling_params.temperature, gen.sampling_params.top_p) == (0.3, 0.9)
    assert gen.request_id.startswith("resp_")


def test_responses_items_render_as_the_equivalent_chat_conversation(config):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(ARGS)},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"type": "message", "role": "user", "content": "And tomorrow?"},
    ]
    gen, _ = render_responses(ResponsesRequest(input=items, tools=RESPONSES_TOOLS, tool_choice="auto"), config)
    chat = chat_ids(config, tools=CHAT_TOOLS, tool_choice="auto", messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning": "Use the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ])
    assert gen.token_ids == chat.token_ids


def test_responses_named_tool_choice_and_json_schema_become_structured_outputs(config):
    gen, _ = render_responses(ResponsesRequest(input="x", tools=RESPONSES_TOOLS,
                                               tool_choice={"type": "function", "name": "get_weather"}), config)
    chat = chat_ids(config, messages=[{"role": "user", "content": "x"}], tools=CHAT_TOOLS,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert gen.token_ids == chat.token_ids
    # the server's hermes parser: vLLM's structural tag for the one named call (tests/test_tool_constraint_parity.py)
    assert gen.sampling_params.structured_outputs == chat.sampling_params.structured_outputs
    tag = json.loads(gen.sampling_params.structured_outputs["structural_tag"])["format"]
    assert [t["begin"] for t in tag["tags"]] == ['<tool_call>\n{"name": "get_weather", "arguments": ',
                                                 '<tool_call>{"name": "get_weather", "arguments": ']
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": WEATHER_SCHEMA}}
    gen, _ = render_responses(ResponsesRequest(input="x", text=fmt), config)
    assert gen.sampling_params.structured_outputs == {"json": WEATHER_SCHEMA}


def test_responses_reasoning_effort_none_turns_thinking_off(config):
    gen, _ = render_responses(ResponsesRequest(input="x", reasoning={"effort": "none"}), config)
    chat = chat_ids(config, messages=[{"role": "user", "content": "x"}], chat_template_kwargs={"enable_thinking": False})
    assert gen.token_ids == chat.token_ids


# ------------------------------------------------------------------------------------------- Messages


def test_messages_blocks_render_as_the_equivalent_chat_conversation(config):
    req = MessagesRequest(max_tokens=50, system=[{"type": "text", "text": "Be brief."}], tools=MESSAGES_TOOLS,
                          thinking={"type": "enabled", "budget_tokens": 20}, stop_sequences=["END"], top_k=5,
                          messages=[
                              {"role": "user", "content": "Weather in Paris?"},
                              {"role": "assistant", "content": [
                                  {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                                  {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGS}]},
                              {"role": "user", "content": [
                                  {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                  {"type": "text", "text": "Thanks!"}]},
                          ])
    gen, _ = render_messages(req, config)
    chat = chat_ids(config, tools=CHAT_TOOLS, tool_choice="auto", max_tokens=50, stop=["END"], top_k=5,
                    chat_template_kwargs={"enable_thinking": True}, messages=[
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "reasoning": "Use the tool.", "tool_calls": [
                            {"id": "toolu_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
                        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                        {"role": "user", "content": "Thanks!"},
                    ])
    assert gen.token_ids == chat.token_ids
    assert gen.sampling_params.max_tokens == 50
    assert gen.sampling_params.stop == ["END"] and gen.sampling_params.top_k == 5
    assert gen.sampling_params.thinking_token_budget == 20  # the gateway enforces it
    assert gen.request_id.startswith("msg_")


def test_messages_thinking_is_opt_in(config):
    off, _ = render_messages(MessagesRequest(max_tokens=9, messages=[{"role": "user", "content": "x"}]), config)
    on, _ = render_messages(MessagesRequest(max_tokens=9, messages=[{"role": "user", "content": "x"}],
                                            thinking={"type": "adaptive"}), config)
    user = [{"role": "user", "content": "x"}]
    assert off.token_ids == chat_ids(config, messages=user, chat_template_kwargs={"enable_thinking": False}).token_ids
    assert on.token_ids == chat_ids(config, messages=user).token_ids
    tok = config.tokenizer
    assert tok.decode(off.token_ids, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    assert off.reasoning_ended is True and on.reasoning_ended is False


def test_messages_assistant_last_is_a_prefill_the_model_continues(config):
    req = MessagesRequest(max_tokens=9, messages=[{"role": "user", "content": "Count to three."},
                                                  {"role": "assistant", "content": "One, two,"}])
    gen, _ = render_messages(req, config)
    text = config.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
    assert text.endswith("One, two,")  # no end of turn, no new assistant turn: the model goes on from here
    chat = chat_ids(config, messages=[{"role": "user", "content": "Count to three."},
                                      {"role": "assistant", "content": "One, two,"}],
                    add_generation_prompt=False, continue_final_message=True,
                    chat_template_kwargs={"enable_thinking": False})
    assert gen.token_ids == chat.token_ids


def test_count_tokens_is_the_rendered_prompt_length(config):
    req = CountTokensRequest(messages=[{"role": "user", "content": "Hello"}], system="Be brief.", tools=MESSAGES_TOOLS)
    gen, _ = render_messages(MessagesRequest(max_tokens=5, messages=[{"role": "user", "content": "Hello"}],
                                             system="Be brief.", tools=MESSAGES_TOOLS), config)
    assert count_tokens(req, config) == len(gen.token_ids)


# -------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0]"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, "input[0].content"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": 5}, "input"),
    # a json_schema text format is checked as the OpenAI type vLLM validates it with: a string name, an object schema
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": 3, "schema": {}}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w", "schema": True}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w", "schema": {}, "strict": "no"}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w", "schema": {}, "description": {}}}},
     "text"),
])
def test_responses_bad_input_is_a_400_in_openai_shape(server, body, param):
    r = server.client.post("/v1/responses/render", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert err["code"] is None or isinstance(err["code"], str)


@pytest.mark.parametrize("body,fragment", [
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}]}, "without a matching tool_use"),
    ({"max_tokens": 10, "thinking": {"type": "enabled", "budget_tokens": 10},
      "messages": [{"role": "user", "content": "x"}]}, "budget_tokens"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "video"),
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y "}]},
     "trailing whitespace"),
    ({"max_tokens": 10, "messages": "x"}, "messages"),
])
def test_messages_bad_input_is_a_400_in_anthropic_shape(server, body, fragment):
    r = server.client.post("/v1/messages/render", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and fragment in r.json()["error"]["message"]


def test_render_endpoints_answer_a_generate_request(server):
    r = server.client.post("/v1/responses/render", json={"input": "Hi", "max_output_tokens": 7})
    assert r.status_code == 200 and r.json()["sampling_params"]["max_tokens"] == 7 and r.json()["token_ids"]
    assert r.headers["x-render-fingerprint"]
    r = server.client.post("/v1/messages/render", json={"max_tokens": 7, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["request_id"].startswith("msg_")
    r = server.client.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 3
    r = server.client.post("/v1/messages/render", json={"model": "other", "max_tokens": 7,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_api_errors_never_raise_past_the_handler(config):
    with pytest.raises(ApiError):
        render_messages(MessagesRequest(max_tokens=5, messages=[]), config)
