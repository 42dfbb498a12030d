"""output_mode "derender" on the engine: a chat request with tools rendered by a real render server, its ids and
parse_context sent to a real engine process (--reasoning-parser qwen3 --tool-call-parser hermes) whose scripted
model answers with reasoning and a hermes tool call; the engine's message must be the render tier's
/v1/chat/completions/derender message for the same ids, batch and streamed.

The engine finds the render tier's parsers only through the ``splitserve.output_parsers`` entry point: the test
installs that entry point the way a wheel does (a dist-info directory on the engine's path)."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from render_service.render.render_config import load_render_config
from splitserve_common.output_parsers import ENTRY_POINT_GROUP, ParserFlags
from tests.engine_harness import engine_config, single_threaded_server
from tests.gateway_harness import PLAIN_TEXT, Process, free_port, write_scripted_qwen3
from tests.render_harness import PARSER_FLAGS, RenderServer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS, "temperature": 0, "max_tokens": 40}
PLAIN_PROMPT = [151644, 77091, 271]  # "<|im_start|>assistant\n\n": the scripted model's plain sentence


def install_entry_point(site) -> None:
    """A dist-info with the render tier's entry point, as installing the package writes it."""
    dist = site / "splitserve_render_parsers-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: splitserve-render-parsers\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nrender = render_service.derender.engine_parsers:output_parsers\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_scripted_qwen3(tmp_path_factory.mktemp("scripted-qwen3"))


@pytest.fixture(scope="module")
def render(model_dir):
    config = load_render_config(str(model_dir), served_model_names=["tiny"], **PARSER_FLAGS)
    with RenderServer(config) as server:
        yield server


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    install_entry_point(site)
    port = free_port()
    argv = [sys.executable, "-m", "token_engine.cli", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--block-size", "4",
            "--num-gpu-blocks-override", "128", "--max-num-seqs", "8", "--log-level", "warning",
            "--served-model-name", "tiny", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
            "--enable-auto-tool-choice"]
    proc = Process(argv, port, {"PYTHONPATH": str(site)})
    yield proc
    proc.stop()


def rendered(render, **chat) -> dict:
    r = render.client.post("/v1/chat/completions/render", json={**CHAT, **chat})
    assert r.status_code == 200, r.text
    return r.json()


def generate(engine, body: dict) -> httpx.Response:
    return httpx.post(engine.url + "/inference/v1/generate", json=body, timeout=120)


def stream_events(engine, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", engine.url + "/inference/v1/generate", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
    return events


def render_derender(render, tokens_answer: dict, body: dict, **chat) -> dict:
    r = render.client.post("/v1/chat/completions/derender", json={
        "model": "tiny", "generate_response": tokens_answer, "chat_request": {**CHAT, **chat},
        "prompt_token_ids": body["token_ids"]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def folded(deltas: list[dict]) -> dict:
    """Stream deltas folded into one message: text fields concatenated, tool calls merged by index."""
    out: dict = {"role": None, "content": None, "reasoning": None, "tool_calls": {}}
    for d in deltas:
        out["role"] = out["role"] or d.get("role")
        for key in ("content", "reasoning"):
            if key in d:
                out[key] = (out[key] or "") + d[key]
        for call in d.get("tool_calls", ()):
            merged = out["tool_calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            merged["id"] = call.get("id") or merged["id"]
            fn = call.get("function", {})
            merged["name"] = fn.get("name") or merged["name"]
            merged["arguments"] += fn.get("arguments") or ""
    return out


def test_the_engines_message_is_the_render_tiers_derender_of_the_same_ids(render, engine):
    body = {**rendered(render), "output_mode": "derender"}
    assert body["parse_context"]["tools"] and body["token_ids"][-1] == 198
    r = generate(engine, body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["output_mode"] == "derender"
    choice = answer["choices"][0]
    tokens_answer = generate(engine, {**body, "output_mode": "tokens"}).json()
    assert choice["token_ids"] == tokens_answer["choices"][0]["token_ids"]
    expected = render_derender(render, tokens_answer, body)
    assert choice["message"] == expected["message"]
    assert choice["finish_reason"] == expected["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning"] == "Need weather"
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert "text" not in choice


def test_streamed_deltas_fold_into_the_same_message_with_one_parser_per_choice(render, engine):
    body = {**rendered(render), "output_mode": "derender"}
    batch = generate(engine, body).json()["choices"][0]
    events = stream_events(engine, body)
    assert all(e["output_mode"] == "derender" for e in events)
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in choices[1:])
    assert all(None not in c["delta"].values() for c in choices)  # vLLM dumps deltas without nulls
    message = folded([c["delta"] for c in choices])
    expected = batch["message"]
    assert message["reasoning"] == expected["reasoning"]
    assert (message["content"] or None) == (expected["content"] or None)
    [call] = message["tool_calls"].values()
    [whole] = expected["tool_calls"]
    assert call["id"] == whole["id"] and call["name"] == whole["function"]["name"]
    assert json.loads(call["arguments"]) == json.loads(whole["function"]["arguments"])
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert [t for c in choices for t in c["token_ids"]] == batch["token_ids"]


def test_n_choices_each_get_their_own_parser(render, engine):
    body = {**rendered(render), "output_mode": "derender"}
    body["sampling_params"] = {**body["sampling_params"], "n": 2}
    batch = generate(engine, body).json()
    first, second = (c["message"] for c in batch["choices"])
    assert first["tool_calls"][0]["id"] != second["tool_calls"][0]["id"]  # call ids are per choice
    for message in (first, second):
        message["tool_calls"][0].pop("id")
    assert first == second and first["reasoning"] == "Need weather"
    choices = [c for e in stream_events(engine, body) for c in e["choices"]]
    for index in (0, 1):
        message = folded([c["delta"] for c in choices if c["index"] == index])
        assert message["reasoning"] == "Need weather" and len(message["tool_calls"]) == 1


def test_hidden_reasoning_hides_logprobs_and_token_ids_too(render, engine):
    body = {**rendered(render, include_reasoning=False), "output_mode": "derender"}
    body["sampling_params"] = {**body["sampling_params"], "logprobs": 1}
    choice = generate(engine, body).json()["choices"][0]
    assert "reasoning" not in choice["message"] or choice["message"]["reasoning"] is None
    assert choice["logprobs"] is None and choice["token_ids"] is None
    assert all(c["token_ids"] is None and c["logprobs"] is None
               for e in stream_events(engine, body) for c in e["choices"])


@pytest.mark.parametrize(("change", "param", "message"), [
    ({"parse_context": None}, "parse_context", "requires parse_context on a server with a tool or reasoning parser"),
    ({"parse_context": {"tools": None, "from_the_future": 1}}, "parse_context", "Unknown parse_context fields"),
    ({"parse_context": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}},
     "parse_context", "does not match any of the specified `tools`"),
    ({"parse_context": {"tools": "not a list"}}, "parse_context", "Invalid parse_context"),
])
def test_a_parse_context_the_parsers_cannot_use_is_a_400(render, engine, change, param, message):
    for stream in (False, True):
        r = generate(engine, {**rendered(render), "output_mode": "derender", "stream": stream, **change})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"]


def test_unknown_parse_context_fields_are_ignored_by_the_other_modes(render, engine):
    body = {**rendered(render), "output_mode": "text", "parse_context": {"from_the_future": 1}}
    assert generate(engine, body).status_code == 200


# ---- an engine without parser flags (in-process): vLLM's server without a parser --------------------------


@pytest.fixture(scope="module")
def plain_server(model_dir):
    with single_threaded_server(engine_config(model_dir, max_model_len=64)) as srv:
        yield srv


def test_without_parser_flags_the_message_is_the_text_as_vllm_gives_it(plain_server):
    with plain_server.client() as c:
        request = {"token_ids": PLAIN_PROMPT, "output_mode": "derender",
                   "sampling_params": {"temperature": 0, "max_tokens": 30, "stop": "sky"}}
        choice = c.post("/inference/v1/generate", json=request).json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "Hello world, the ", "refusal": None,
                                     "audio": None, "function_call": None, "reasoning": None}
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "sky"
        full = c.post("/inference/v1/generate", json={**request, "sampling_params": {"temperature": 0}}).json()
        assert full["choices"][0]["message"]["content"] == PLAIN_TEXT
        with c.stream("POST", "/inference/v1/generate", json={**request, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [ch["delta"] for e in events for ch in e["choices"]]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("content", "") for d in deltas) == "Hello world, the "


def test_parser_flags_without_an_installed_implementation_refuse_derender_not_parse_it_wrong(model_dir, monkeypatch):
    import token_engine.http.derender_output as derender_output

    monkeypatch.setattr(derender_output, "find_output_parsers", lambda: None)  # an engine installed alone
    flags = ParserFlags("qwen3", "hermes", True)
    with single_threaded_server(engine_config(model_dir, max_model_len=64), parser_flags=flags) as srv:
        with srv.client() as c:
            request = {"token_ids": PLAIN_PROMPT, "output_mode": "derender", "parse_context": {},
                       "sampling_params": {"temperature": 0, "max_tokens": 4}}
            r = c.post("/inference/v1/generate", json=request)
            assert r.status_code == 400
            assert "--reasoning-parser qwen3 --tool-call-parser hermes" in r.json()["error"]["message"]
            text = c.post("/inference/v1/generate", json={**request, "output_mode": "text"})
            assert text.status_code == 200 and text.json()["choices"][0]["text"]


def test_plain_derender_carries_decoded_logprobs_and_ends_with_a_derender_usage_event(plain_server):
    with plain_server.client() as c:
        request = {"token_ids": PLAIN_PROMPT, "output_mode": "derender", "stream_options": {"include_usage": True},
                   "sampling_params": {"temperature": 0, "max_tokens": 3, "logprobs": 1}}
        choice = c.post("/inference/v1/generate", json=request).json()["choices"][0]
        assert [e["token"] for e in choice["logprobs"]["content"]] == ["Hello", " world", ","]
        assert choice["message"]["content"] == "Hello world," and choice["finish_reason"] == "length"
        with c.stream("POST", "/inference/v1/generate", json={**request, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        streamed = [e for ev in events for ch in ev["choices"] for e in ch["logprobs"]["content"]]
        assert streamed == choice["logprobs"]["content"]
        assert events[-1]["choices"] == [] and events[-1]["output_mode"] == "derender"
        assert events[-1]["usage"]["completion_tokens"] == 3


def test_stop_strings_cut_the_parsed_message_where_the_engine_stops(render, engine):
    """A stop string with parser flags: the engine stops the sequence at it (its text stage) and the parsers cut
    the text there before parsing, as vLLM's derender does; batch and stream agree."""
    body = {**rendered(render), "output_mode": "derender"}
    body["sampling_params"] = {**body["sampling_params"], "stop": ["weather"]}
    whole = generate(engine, body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "weather"
    message = choice["message"]
    assert message["reasoning"].startswith("Need") and "weather" not in message["reasoning"]
    assert not message.get("tool_calls") and not message.get("content")
    unstopped = generate(engine, {**body, "sampling_params": {**body["sampling_params"], "stop": None}}).json()
    assert len(choice["token_ids"]) < len(unstopped["choices"][0]["token_ids"])  # the engine stopped there

    events = stream_events(engine, body)
    deltas = [c["delta"] for e in events for c in e["choices"] if "delta" in c]
    stream = folded(deltas)
    assert stream["reasoning"] == message["reasoning"] and not stream["tool_calls"] and not stream["content"]
    last = [c for e in events for c in e["choices"] if c.get("finish_reason")][-1]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == "weather"

    kept = generate(engine, {**body, "sampling_params": {**body["sampling_params"],
                                                         "include_stop_str_in_output": True}}).json()
    assert kept["choices"][0]["message"]["reasoning"] == message["reasoning"] + "weather"
