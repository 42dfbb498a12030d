"""/v1/responses/render and /v1/messages/render next to vLLM 0.33's render server, on the same requests: the
GenerateRequest's token ids, sampling params and fields agree, except where docs/apis.md says we depart (each
departure is checked to be exactly what it says), and except what both APIs inherit from chat render (the
same fields differ between our chat render and vLLM's for the equivalent chat request: docs/compatibility.md).

Needs vLLM 0.33 where ``bench.peers.vllm033_venv()`` finds it (``$SPLITSERVE_VLLM033``, else
bench/.peers/vllm033; the peer recipe's install033.sh installs it); skips without it (CI
installs no peers). Qwen3 fixture, qwen3 + hermes parsers.
"""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from bench import peers
from tests.render_harness import RenderServer, qwen3_config
from tests.shared_paths import QWEN3_FIXTURE_DIR

# vLLM's render server takes ~30-90 s to start on a shared 2-core machine
pytestmark = [pytest.mark.vllm_peer("0.33"), pytest.mark.slow]

MODEL = "qwen3-0.6b"
W = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": W}]
MESSAGES_TOOLS = [{"name": "get_weather", "input_schema": W}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": None, "parameters": W}}]
HI = [{"role": "user", "content": "Hi"}]
# vLLM 0.33's Responses render, unlike its chat render: reasoning_ended unset, no parse_context, and
# sampling_params.extra_args {} where chat's is null (docs/apis.md)
RESPONSES_FIELDS = {"reasoning_ended", "parse_context", "extra_args"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    venv = peers.vllm033_venv()
    if venv is None:
        pytest.skip(f"vLLM 0.33 peer not installed in any of {', '.join(map(str, peers.VLLM033_VENVS))} (set "
                    "SPLITSERVE_VLLM033; shared/peers/vllm-render/install033.sh)")
    port = peers.free_port()
    log = tmp_path_factory.mktemp("vllm033") / "render.log"
    cmd = [str(venv / "bin" / "vllm"), "launch", "render", str(QWEN3_FIXTURE_DIR), "--served-model-name", MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
           "--tool-call-parser", "hermes", "--disable-uvicorn-access-log"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    try:
        peers.wait_healthy(f"http://127.0.0.1:{port}", proc.pid, 600)
        with RenderServer(qwen3_config(parsers=True)) as ours:
            yield Pair(f"http://127.0.0.1:{port}", ours.url)
    finally:
        peers.stop_tree(proc.pid)
        proc.wait(30)


class Pair:
    def __init__(self, vllm: str, ours: str) -> None:
        self.vllm, self.ours = vllm, ours

    def post(self, path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
        return (httpx.post(self.vllm + path, json=body, timeout=120),
                httpx.post(self.ours + path, json=body, timeout=120))

    def render(self, path: str, body: dict) -> tuple[dict, dict]:
        v, o = self.post(path, body)
        assert v.status_code == 200 and o.status_code == 200, (v.text[:500], o.text[:500])
        return v.json(), o.json()


def differing(a: dict, b: dict) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def agree(pair: Pair, path: str, body: dict, chat: dict, may_differ: set[str] = frozenset()) -> tuple[dict, dict]:
    """vLLM's and our render of ``body`` agree on token ids; every other difference (sampling params, fields) is
    one our chat render of the equivalent ``chat`` request has too, or a listed departure (docs/apis.md)."""
    v, o = pair.render(path, body)
    vc, oc = pair.render("/v1/chat/completions/render", {"model": MODEL, **chat})
    assert o["token_ids"] == oc["token_ids"]  # ours: the API's render is the chat render (the rule)
    assert v["token_ids"] == o["token_ids"], path
    inherited = differing(vc["sampling_params"], oc["sampling_params"])
    assert differing(v["sampling_params"], o["sampling_params"]) <= inherited | may_differ, body
    inherited = differing(vc, oc) - {"token_ids", "sampling_params"}
    fields = differing(v, o) - {"token_ids", "sampling_params", "request_id"}
    assert fields <= inherited | may_differ, body
    return v, o


# ------------------------------------------------------------------------------------ where we agree


def test_responses_render_agrees(servers):
    cases = [
        ({"input": "Hi there", "instructions": "Be brief.", "max_output_tokens": 40, "temperature": 0.3, "top_p": 0.9},
         {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
          "max_completion_tokens": 40, "temperature": 0.3, "top_p": 0.9}),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
          "tools": RESPONSES_TOOLS},
         {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": CHAT_TOOLS}),
        ({"input": [{"role": "user", "content": "Q"},
                    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
                    {"role": "user", "content": "Q2"}]},
         {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning": "think"},
                       {"role": "user", "content": "Q2"}]}),
        ({"input": "Hi", "tools": RESPONSES_TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
         {"messages": HI, "tools": CHAT_TOOLS, "tool_choice": "required", "parallel_tool_calls": False}),
        ({"input": "Hi", "tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}},
         {"messages": HI, "tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
         {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                     "schema": {"type": "object"}}}}),
        ({"input": "Hi", "text": {"format": {"type": "json_object"}}},
         {"messages": HI, "response_format": {"type": "json_object"}}),
        ({"input": "Hi", "top_logprobs": 3, "include": ["message.output_text.logprobs"], "top_k": 3, "seed": 5},
         {"messages": HI, "logprobs": True, "top_logprobs": 3, "top_k": 3, "seed": 5}),
    ]
    for body, chat in cases:
        agree(servers, "/v1/responses/render", {"model": MODEL, **body}, chat, RESPONSES_FIELDS)


def test_responses_effort_none_turns_thinking_off_as_vllm_does(servers):
    v, o = agree(servers, "/v1/responses/render", {"model": MODEL, "input": "Hi", "reasoning": {"effort": "none"}},
                 {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}},
                 {*RESPONSES_FIELDS, "reasoning_parser_kwargs"})
    # vLLM also passes reasoning_effort "none" to the template (Qwen3's ignores it)
    assert v["reasoning_parser_kwargs"]["chat_template_kwargs"]["enable_thinking"] is False
    assert o["reasoning_parser_kwargs"]["chat_template_kwargs"]["enable_thinking"] is False


def test_messages_render_agrees(servers):
    on = {"type": "adaptive"}  # thinking on: what vLLM's template default renders (see the departure below)
    cases = [
        ({"system": "Be brief.", "messages": HI, "thinking": on, "stop_sequences": ["END"], "temperature": 0.2,
          "top_p": 0.8, "top_k": 4},
         {"messages": [{"role": "system", "content": "Be brief."}, *HI], "stop": ["END"], "temperature": 0.2,
          "top_p": 0.8, "top_k": 4}),
        ({"messages": [{"role": "user", "content": "weather?"},
                       {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                          "input": {"city": "Paris"}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
          "tools": MESSAGES_TOOLS, "thinking": on},
         {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [
             {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "t1", "content": "sunny"}], "tools": CHAT_TOOLS}),
        ({"system": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}], "thinking": on, "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                              {"type": "text", "text": "A"}]},
            {"role": "user", "content": [{"type": "text", "text": "Q2"}]}]},
         {"messages": [{"role": "system", "content": "S1S2"}, {"role": "user", "content": "Q"},
                       {"role": "assistant", "content": "A", "reasoning": "hmm"}, {"role": "user", "content": "Q2"}]}),
        ({"messages": HI, "tools": MESSAGES_TOOLS, "tool_choice": {"type": "any"}, "thinking": on},
         {"messages": HI, "tools": CHAT_TOOLS, "tool_choice": "required"}),
        ({"messages": HI, "tools": MESSAGES_TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": on},
         {"messages": HI, "tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ({"messages": HI, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
          "thinking": on},
         {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "output",
                                                                                     "schema": {"type": "object"}}}}),
        ({"messages": HI, "thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 4096},
         {"messages": HI, "max_tokens": 4096, "thinking_token_budget": 2048}),
    ]
    for body, chat in cases:
        # parse_context: vLLM records the template kwargs it rendered with; ours (thinking on) names the switch
        agree(servers, "/v1/messages/render", {"model": MODEL, "max_tokens": 64, **body}, {"max_tokens": 64, **chat},
              {"reasoning_parser_kwargs", "parse_context"})


# --------------------------------------------------------------------- where we depart (docs/apis.md)


def test_messages_thinking_is_opt_in(servers):
    """Without ``thinking`` vLLM renders the template's default (Qwen3: thinking on); ours is off unless enabled, as
    Anthropic's API: the prompt closes the think block. ``disabled`` both turn off (vLLM 0.33: reasoning_effort
    "none", which clears enable_thinking)."""
    body = {"model": MODEL, "max_tokens": 64, "messages": HI}
    v, o = servers.render("/v1/messages/render", body)
    on_v, on_o = servers.render("/v1/messages/render", {**body, "thinking": {"type": "adaptive"}})
    off_v, off_o = servers.render("/v1/messages/render", {**body, "thinking": {"type": "disabled"}})
    assert v["token_ids"] == on_v["token_ids"] == on_o["token_ids"]
    assert o["token_ids"] == off_o["token_ids"] == off_v["token_ids"] != v["token_ids"]
    assert o["reasoning_ended"] is True and v["reasoning_ended"] is False


def test_messages_assistant_last_is_a_prefill(servers):
    """vLLM closes the assistant turn and opens another; ours continues it (continue_final_message)."""
    messages = [*HI, {"role": "assistant", "content": "Hello"}]
    v, o = servers.render("/v1/messages/render", {"model": MODEL, "max_tokens": 64, "messages": messages,
                                                  "thinking": {"type": "adaptive"}})
    closed, continued = servers.render("/v1/chat/completions/render", {"model": MODEL, "messages": messages})
    _, continued = servers.render("/v1/chat/completions/render", {
        "model": MODEL, "messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert v["token_ids"] == closed["token_ids"] and o["token_ids"] == continued["token_ids"]


def test_budgets_and_orphans(servers):
    """A budget under Anthropic's 1024 minimum: vLLM refuses it, ours takes it (small models, tests) and the
    gateway enforces it. A tool result without its call: vLLM renders it, ours is a 400 as both APIs answer."""
    v, o = servers.post("/v1/messages/render", {"model": MODEL, "max_tokens": 64, "messages": HI,
                                                "thinking": {"type": "enabled", "budget_tokens": 32}})
    assert v.status_code == 400 and o.status_code == 200
    assert o.json()["sampling_params"]["thinking_token_budget"] == 32
    v, o = servers.post("/v1/messages/render", {"model": MODEL, "max_tokens": 64, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]})
    assert v.status_code == 200 and o.status_code == 400 and o.json()["type"] == "error"
    v, o = servers.post("/v1/responses/render", {"model": MODEL, "input": [
        {"type": "function_call_output", "call_id": "nope", "output": "x"}]})
    assert v.status_code == 200 and o.status_code == 400 and o.json()["error"]["param"] == "input[0]"


def test_errors_are_each_apis_own_shape(servers):
    """Both refuse these; ours answers in each API's shape (vLLM's envelope has an integer code)."""
    v, o = servers.post("/v1/messages/render", {"model": MODEL, "messages": HI})  # no max_tokens
    assert v.status_code == o.status_code == 400
    assert o.json()["type"] == "error" and o.json()["error"]["type"] == "invalid_request_error"
    assert isinstance(v.json()["error"]["code"], int)
    v, o = servers.post("/v1/responses/render", {"model": MODEL, "input": "Hi", "previous_response_id": "resp_x"})
    assert v.status_code == o.status_code == 400 and o.json()["error"]["code"] == "unsupported_parameter"
    assert v.json()["error"]["param"] == o.json()["error"]["param"] == "previous_response_id"
    v, o = servers.post("/v1/responses/render", {"model": MODEL, "input": [{"type": "computer_call", "id": "x"}]})
    assert v.status_code == o.status_code == 400


def test_request_ids(servers):
    """vLLM: resp_ + 16 hex (Responses), chatcmpl- ids for Messages renders; ours resp_ + 32 hex and msg_ + 24."""
    v, o = servers.render("/v1/responses/render", {"model": MODEL, "input": "Hi"})
    assert v["request_id"].startswith("resp_") and o["request_id"].startswith("resp_")
    v, o = servers.render("/v1/messages/render", {"model": MODEL, "max_tokens": 8, "messages": HI})
    assert v["request_id"].startswith("chatcmpl-") and o["request_id"].startswith("msg_")
