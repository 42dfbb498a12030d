"""gpt-oss end to end: the gateway process (Harmony render -> engine -> Harmony derender) and a real engine
process, driven with the ``openai`` client over loopback.

The engine runs a tiny Qwen3 body with gpt-oss's vocabulary and tokenizer whose weights follow one scripted
Harmony reply (tests/gateway_harness.py explains the trick): after the prompt's ``<|start|>assistant`` it
writes ``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>``.
"""

from __future__ import annotations

import json
import shutil
import sys

import anthropic
import openai
import pytest
from safetensors.torch import load_file

from render_service.harmony.bundle import GPT_OSS_GENERATION_CONFIG
from render_service.harmony.encoding import CALL
from tests.gateway_harness import Process, free_port, save_scripted
from tests.harmony_fixtures import encode, gpt_oss_dir
from token_engine.models.random_model import write_random_model

pytestmark = pytest.mark.slow  # two server processes and a 201k-token grammar vocabulary: ~90 s on 2 cores

REPLY = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def write_scripted_gpt_oss(out_dir):
    chain = [encode("assistant")[0], *encode(REPLY), CALL]
    assert len(set(chain)) == len(chain), "a bigram chain cannot repeat a token"
    out = write_random_model(out_dir, arch="qwen3", preset="tiny", dtype="float32", tokenizer_dir=gpt_oss_dir(),
                             overrides={"tie_word_embeddings": False, "vocab_size": 201088, "bos_token_id": 199998,
                                        "eos_token_id": 200002})
    tensors = load_file(str(out / "model.safetensors"))
    for name, t in tensors.items():  # every layer the identity on the residual stream
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            t.zero_()
        if name.endswith("norm.weight"):
            t.fill_(1.0)
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    assert embed.shape[0] == 201088
    head.zero_()
    axis = {t: i for i, t in enumerate(sorted(set(chain)))}
    for t, i in axis.items():
        embed[t].zero_()
        embed[t][i] = 1.0
    for a, b in zip(chain, chain[1:]):
        head[b][axis[a]] = 4.0
    (out / "generation_config.json").write_text(json.dumps(GPT_OSS_GENERATION_CONFIG))
    return save_scripted(out, tensors)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = write_scripted_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "model")
    engine_port = free_port()
    engine = Process([sys.executable, "-m", "token_engine.cli", "serve", str(model), "--host", "127.0.0.1",
                      "--port", str(engine_port), "--dtype", "float32", "--max-model-len", "1024",
                      "--block-size", "16", "--num-gpu-blocks-override", "128", "--max-num-seqs", "8",
                      "--log-level", "warning"], engine_port)
    gateway = None
    try:
        port = free_port()
        gateway = Process([sys.executable, "-m", "render_service.cli", "serve", str(model), "--host", "127.0.0.1",
                           "--port", str(port), "--served-model-name", "gpt-oss-tiny", "--reasoning-parser",
                           "openai_gptoss", "--tool-call-parser", "openai", "--enable-auto-tool-choice",
                           "--log-level", "warning", "--engine-block-size", "16", "--engine", engine.url], port)
        yield openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()
        shutil.rmtree(model, ignore_errors=True)


def test_tool_call_end_to_end(client):
    resp = client.chat.completions.create(model="gpt-oss-tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=64,
                                          temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None
    # the engine stopped at <|call|>: every generated token is the scripted reply's
    assert resp.usage.completion_tokens == len(encode(REPLY)) + 1


def test_streaming_equals_batch(client):
    batch = client.chat.completions.create(model="gpt-oss-tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=64,
                                           temperature=0)
    stream = client.chat.completions.create(model="gpt-oss-tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=64,
                                            temperature=0, stream=True)
    name, arguments, ids, finish = None, "", set(), None
    for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                ids.add(tc.id) if tc.id else None
                name = tc.function.name or name
                arguments += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    expected = batch.choices[0].message.tool_calls[0]
    assert (name, arguments, finish) == (expected.function.name, expected.function.arguments, "tool_calls")
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-tool-")  # one call, announced once


def test_named_tool_choice_gives_a_harmony_call(client):
    resp = client.chat.completions.create(
        model="gpt-oss-tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=32, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = resp.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.finish_reason == "stop"  # named tool choice, as vLLM


def test_required_tool_choice_with_one_tool_gives_a_harmony_call(client):
    resp = client.chat.completions.create(model="gpt-oss-tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=32,
                                          temperature=0, tool_choice="required")
    choice = resp.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""  # forced: "" beside the call


def test_a_strict_tool_next_to_a_response_format_is_either_shape(client):
    # vLLM's constraint for "auto" with a strict tool and a JSON response format: the call or the JSON final answer
    # (tests/test_tool_constraint_parity.py holds it to vLLM's bytes; the final-answer branch is exercised there
    # and in tests/test_harmony_parser.py). This model always calls: the engine compiled the composed tag and the
    # call passes it
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    resp = client.chat.completions.create(model="gpt-oss-tiny", messages=MESSAGES, tools=[strict], max_tokens=32,
                                          temperature=0, response_format={"type": "json_object"})
    choice = resp.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.finish_reason == "tool_calls"


def test_completions_render_and_derender(client):
    resp = client.completions.create(model="gpt-oss-tiny", prompt="<|start|>user<|message|>hi<|end|><|start|>assistant",
                                     max_tokens=40, temperature=0)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text.endswith('{"city": "Paris"}')  # markers skipped, as skip_special_tokens asks


# ------------------------------------------------------------------------------- Responses and Messages


def claude(client) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(client.base_url).rstrip("/").removesuffix("/v1"), api_key="none",
                               max_retries=0, timeout=120)


RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}
MESSAGES_WEATHER = {"name": "get_weather", "description": "Weather of a city",
                    "input_schema": WEATHER["function"]["parameters"]}


def test_responses_call_streamed_and_not(client):
    kwargs = dict(model="gpt-oss-tiny", input="Weather in Paris?", tools=[RESPONSES_WEATHER], temperature=0,
                  max_output_tokens=64, store=False)
    r = client.responses.create(**kwargs)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.status == "completed"
    assert r.usage.output_tokens == len(encode(REPLY)) + 1 and r.usage.output_tokens_details.reasoning_tokens == 0
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [(o.type, o.name, o.arguments) for o in r.output]


def test_messages_call_and_a_budget_spent_in_the_header(client):
    c = claude(client)
    kwargs = dict(model="gpt-oss-tiny", max_tokens=40, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=[MESSAGES_WEATHER], extra_body={"temperature": 0})
    m = c.messages.create(**kwargs, thinking={"type": "enabled", "budget_tokens": 30})
    (tool,) = m.content
    assert tool.type == "tool_use" and tool.input == {"city": "Paris"} and m.stop_reason == "tool_use"
    # budget 2: the engine stops inside the call's header ("<|channel|>commentary"); the gateway drops it and
    # opens the final answer, where the scripted model goes on from <|message|> with its JSON
    budgeted = dict(kwargs, thinking={"type": "enabled", "budget_tokens": 2})
    m = c.messages.create(**budgeted)
    assert [(b.type, b.text) for b in m.content] == [("text", '{"city": "Paris"}')] and m.stop_reason == "end_turn"
    with c.messages.stream(**budgeted) as stream:
        assert stream.get_final_text() == '{"city": "Paris"}'
