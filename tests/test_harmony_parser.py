"""gpt-oss derender: the Harmony stage against openai-harmony's own parser, batch == fold of the stream for
every chunking, stream_state round trips (signed), and the request switches (tool choice, forced calls)."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from openai_harmony import Role, StreamableParser

from render_service.derender.batch import pipeline_config
from render_service.derender.stream import StreamRuntime, derender_chat_stream
from render_service.harmony.encoding import CALL, RETURN, harmony_encoding
from render_service.http.errors import ApiError
from render_service.parsers.harmony import MAX_HEADER, HarmonyParser, HarmonyState
from render_service.parsers.pipeline import MessageAccumulator, Pipeline, derender_all
from render_service.render.render import render_chat
from render_service.wire.protocol import ChatCompletionRequest, DerenderChatStreamRequest
from tests.harmony_fixtures import DATE, MODEL, encode, gpt_oss_bundle, gpt_oss_config

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
PROMPT = encode("<|start|>user<|message|>hi<|end|><|start|>assistant")

# (model output in Harmony text, the engine's stop token or None when truncated)
OUTPUTS = {
    "final": ("<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>"
              "Hello! How can I help?", RETURN),
    "call": ("<|channel|>analysis<|message|>Need weather; a<b holds.<|end|><|start|>assistant<|channel|>commentary"
             ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "c"}', CALL),
    "preamble_call": ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>"
                      "Checking the weather now.<|end|><|start|>assistant to=functions.search<|channel|>commentary "
                      'json<|message|>{"q": "x"}', CALL),
    "two_calls": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "A"}<|call|>'
                  '<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": 1}',
                  CALL),
    "truncated_reasoning": ("<|channel|>analysis<|message|>Still thinking about <|en", None),
    "truncated_header": ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|chan", None),
    "unicode": ("<|channel|>final<|message|>Ünïcödé 日本語 🤖 <tag> <| not a marker", RETURN),
    "builtin_tool": ("<|channel|>analysis<|message|>search<|end|><|start|>assistant<|channel|>analysis to=browser."
                     'search code<|message|>{"query": "x"}<|call|><|start|>assistant<|channel|>final<|message|>ok',
                     RETURN),
}


def _ids(name: str) -> list[int]:
    text, stop = OUTPUTS[name]
    return encode(text) + ([stop] if stop else [])


def _pipeline(**request) -> Pipeline:
    req = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], **request)
    return Pipeline(gpt_oss_config().tokenizer, pipeline_config(gpt_oss_config(), req, request_id="gen-1",
                                                                choice_index=0))


def _stream(pipeline: Pipeline, ids: list[int], cuts: list[int], prompt=PROMPT, roundtrip: bool = False):
    state = pipeline.initial_state(prompt)
    acc = MessageAccumulator()
    for a, b in zip([0, *cuts], [*cuts, len(ids)]):
        if roundtrip:  # what another replica restores from stream_state
            state = pipeline.restore_state(msgspec.msgpack.decode(msgspec.msgpack.encode(state)))
        acc.add(pipeline.feed(state, ids[a:b]))
    acc.add(pipeline.finish(state))
    return acc.message(pipeline.config.tool_choice in ("named", "required")), state


def reference(ids: list[int]) -> dict:
    """openai-harmony's StreamableParser over the same tokens, read the way vLLM's chat streaming reads it."""
    parser = StreamableParser(harmony_encoding(gpt_oss_bundle().tokenizer), role=Role.ASSISTANT)
    content, reasoning, calls = [], [], []
    for t in ids:
        parser.process(t)
        delta, channel, recipient = parser.last_content_delta, parser.current_channel, parser.current_recipient
        if not delta:
            continue
        if recipient and recipient.startswith("functions."):
            name = recipient[len("functions."):]
            if not calls or calls[-1][2] != parser.messages.__len__():
                calls.append([name, "", len(parser.messages)])
            calls[-1][1] += delta
        elif recipient:
            continue
        elif channel == "analysis":
            reasoning.append(delta)
        else:
            content.append(delta)
    return {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None,
            "calls": [(n, a) for n, a, _ in calls]}


@pytest.mark.parametrize("name", [n for n in OUTPUTS if not n.startswith("truncated")])
def test_agrees_with_openai_harmony(name):
    ids = _ids(name)
    message, _ = derender_all(_pipeline(tools=TOOLS), ids, PROMPT)
    ref = reference(ids)
    assert (message["content"], message["reasoning"]) == (ref["content"], ref["reasoning"])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == ref["calls"]


def test_expected_messages_and_finish_reasons():
    p = _pipeline(tools=TOOLS)
    msg, state = derender_all(p, _ids("call"), PROMPT)
    assert msg["reasoning"] == "Need weather; a<b holds." and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert p.finish_reason(state, "stop") == "tool_calls"  # the engine stopped on <|call|>
    assert p.finish_reason(state, "length") == "length"
    msg, state = derender_all(p, _ids("final"), PROMPT)
    assert (msg["reasoning"], msg["content"], msg["tool_calls"]) == ("User says hi.", "Hello! How can I help?", [])
    assert p.finish_reason(state, "stop") == "stop"  # <|return|>
    msg, _ = derender_all(p, _ids("preamble_call"), PROMPT)
    assert msg["content"] == "Checking the weather now." and msg["tool_calls"][0]["function"]["name"] == "search"
    msg, _ = derender_all(p, _ids("two_calls"), PROMPT)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "search"]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    msg, _ = derender_all(p, _ids("truncated_reasoning"), PROMPT)
    assert msg["reasoning"] == "Still thinking about <|en"  # a marker that never completed is text
    msg, _ = derender_all(p, _ids("truncated_header"), PROMPT)
    assert (msg["reasoning"], msg["content"]) == ("Done.", None)  # an unfinished header opened nothing
    msg, _ = derender_all(p, _ids("builtin_tool"), PROMPT)
    assert (msg["reasoning"], msg["content"], msg["tool_calls"]) == ("search", "ok", [])


def _chunkings(n: int, rng: random.Random):
    yield []  # one chunk
    yield list(range(1, n))  # token by token
    for _ in range(6):
        yield sorted(rng.sample(range(1, n), rng.randint(1, min(n - 1, 8))))


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_batch_is_the_fold_of_every_stream(name):
    ids = _ids(name)
    p = _pipeline(tools=TOOLS)
    batch, batch_state = derender_all(p, ids, PROMPT)
    rng = random.Random(name)
    for i, cuts in enumerate(_chunkings(len(ids), rng)):
        streamed, state = _stream(p, ids, cuts, roundtrip=i % 2 == 1)
        assert streamed == batch, cuts
        assert p.finish_reason(state, "stop") == p.finish_reason(batch_state, "stop")


def test_state_is_small_plain_data_and_validated():
    p = _pipeline(tools=TOOLS)
    state = p.initial_state(PROMPT)
    ids = _ids("call")
    p.feed(state, ids[:-5])
    packed = msgspec.msgpack.encode(state)
    assert len(packed) < 120
    for bad in ({"mode": 7}, {"target": -1}, {"header": "x" * (MAX_HEADER + 1)}, {"calls": -2},
                {"calls": 10**12}, {"calls": 0}, {"mode": 0, "held": "<|"}):
        raw = msgspec.to_builtins(state)
        raw["reasoning"] = {**raw["reasoning"], **bad}
        with pytest.raises(msgspec.ValidationError):
            p.restore_state(raw)


def test_without_tools_a_call_stays_visible_as_content():
    msg, state = derender_all(_pipeline(), _ids("call"), PROMPT)
    assert msg["tool_calls"] == [] and msg["content"] == '{"city": "Paris", "unit": "c"}'


def test_a_runaway_header_is_content():
    ids = encode("no harmony here " * 60)
    msg, _ = derender_all(_pipeline(), ids, PROMPT)
    assert msg["content"] == "no harmony here " * 60 and msg["reasoning"] is None


FORCED_CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'


def test_forced_call_and_structured_answer_in_vllms_shape_derender():
    # the prompt ends with <|start|>assistant (as vLLM's); the structural tag has the model reason, then call or
    # answer in any spelling of the header (recipient first or channel first, with or without <|constrain|>)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    req = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "w?"}], tools=TOOLS,
                                tool_choice=forced, chat_template_kwargs={"conversation_start_date": DATE})
    prompt = render_chat(req, gpt_oss_config()).token_ids
    assert prompt[-2:] == encode("<|start|>assistant")
    p = Pipeline(gpt_oss_config().tokenizer, pipeline_config(gpt_oss_config(), req, request_id="g", choice_index=0))
    for call in (FORCED_CALL, ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'):
        out = encode("<|channel|>analysis<|message|>Oslo.<|end|><|start|>assistant" + call) + [CALL]
        msg, state = derender_all(p, out, prompt)
        assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
        assert msg["reasoning"] == "Oslo." and not msg["content"]
        assert p.finish_reason(state, "stop") == "stop"  # named tool choice answers "stop", as vLLM
        assert _stream(p, out, list(range(1, len(out))), prompt=prompt)[0] == msg
    req = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "json"}],
                                response_format={"type": "json_object"})
    prompt = render_chat(req, gpt_oss_config()).token_ids
    p = Pipeline(gpt_oss_config().tokenizer, pipeline_config(gpt_oss_config(), req, request_id="g", choice_index=0))
    msg, _ = derender_all(p, encode('<|channel|>final <|constrain|>json<|message|>{"a": 1}') + [RETURN], prompt)
    assert (msg["content"], msg["reasoning"]) == ('{"a": 1}', None)


def _forced_request() -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "w?"}], tools=TOOLS,
                                 tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                 chat_template_kwargs={"conversation_start_date": DATE})


def _call_openings() -> list[str]:
    """Every header vLLM's Harmony tag lets a forced call open with, read from our render's tag (which
    tests/test_tool_constraint_parity.py holds equal to vLLM's)."""
    structured = render_chat(_forced_request(), gpt_oss_config()).sampling_params.structured_outputs
    calls = json.loads(structured["structural_tag"])["format"]["elements"][-1]
    return [t["begin"] for t in calls["elements"]]


@pytest.mark.parametrize("end", ["<|call|>", "<|end|>"])  # the stop token, or the message's end
def test_every_call_opening_vllms_tag_admits_derenders_as_the_call(end):
    openings = _call_openings()
    assert len(openings) == 12  # recipient before or after the channel, three channels, two JSON spellings
    req = _forced_request()
    prompt = render_chat(req, gpt_oss_config()).token_ids
    p = Pipeline(gpt_oss_config().tokenizer, pipeline_config(gpt_oss_config(), req, request_id="g", choice_index=0))
    for opening in openings:
        out = encode(opening + '{"city": "Oslo"}' + end)
        msg, _ = derender_all(p, out, prompt)
        assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
        assert not msg["content"] and not msg["reasoning"], opening
        assert _stream(p, out, list(range(1, len(out))), prompt=prompt)[0] == msg


def test_a_message_an_earlier_render_opened_in_the_prompt_still_derenders():
    # our render opened the forced call (or the structured final answer) at the prompt's end before it followed
    # vLLM's structural tags; such a request's output is the message body alone
    forced = {"type": "function", "function": {"name": "get_weather"}}
    req = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "w?"}], tools=TOOLS,
                                tool_choice=forced, chat_template_kwargs={"conversation_start_date": DATE})
    prompt = render_chat(req, gpt_oss_config()).token_ids + encode(
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")
    p = Pipeline(gpt_oss_config().tokenizer, pipeline_config(gpt_oss_config(), req, request_id="g", choice_index=0))
    args = encode('{"city": "Oslo"}') + [CALL]
    msg, _ = derender_all(p, args, prompt)
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert _stream(p, args, list(range(1, len(args))), prompt=prompt)[0] == msg
    req = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "json"}],
                                response_format={"type": "json_object"})
    prompt = render_chat(req, gpt_oss_config()).token_ids + encode("<|channel|>final<|message|>")
    p = Pipeline(gpt_oss_config().tokenizer, pipeline_config(gpt_oss_config(), req, request_id="g", choice_index=0))
    msg, _ = derender_all(p, encode('{"a": 1}') + [RETURN], prompt)
    assert (msg["content"], msg["reasoning"]) == ('{"a": 1}', None)


def test_stream_endpoint_round_trips_signed_state():
    runtime = StreamRuntime(secret="k")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    ids = _ids("preamble_call")
    state, deltas = None, []
    for k in range(0, len(ids), 3):
        last = k + 3 >= len(ids)
        body = {"stream": True, "generate_chunk": {"request_id": "gen-1", "choices": [
            {"index": 0, "token_ids": ids[k:k + 3], "finish_reason": "stop" if last else None}]},
            "stream_state": state, "chat_request": chat, "prompt_token_ids": PROMPT}
        out = msgspec.to_builtins(derender_chat_stream(msgspec.convert(body, DerenderChatStreamRequest),
                                                       gpt_oss_config(), runtime))
        state = out["stream_state"]
        deltas.extend(out["chunk"]["choices"])
    content = "".join(c["delta"].get("content") or "" for c in deltas)
    reasoning = "".join(c["delta"].get("reasoning") or "" for c in deltas)
    args = "".join(tc["function"].get("arguments") or "" for c in deltas for tc in c["delta"].get("tool_calls") or [])
    assert (content, reasoning, args) == ("Checking the weather now.", "Plan.", '{"q": "x"}')
    assert deltas[-1]["finish_reason"] == "tool_calls"
    with pytest.raises(ApiError):  # signed: another secret refuses it
        body["stream_state"] = state
        derender_chat_stream(msgspec.convert(body, DerenderChatStreamRequest), gpt_oss_config(),
                             StreamRuntime(secret="other"))


def test_parser_state_type():
    assert HarmonyParser.State is HarmonyState


def test_required_derenders_the_call_with_or_without_the_prompt():
    one = [TOOLS[0]]
    req = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "w?"}], tools=one,
                                tool_choice="required")
    rendered = render_chat(req, gpt_oss_config())
    tag = json.loads(rendered.sampling_params.structured_outputs["structural_tag"])["format"]
    assert tag["type"] == "sequence" and tag["elements"][-1]["type"] == "or"  # vLLM's (tests/test_tool_constraint_parity)
    p = Pipeline(gpt_oss_config().tokenizer, pipeline_config(gpt_oss_config(), req, request_id="g", choice_index=0))
    out = encode(FORCED_CALL) + [CALL]
    for prompt in (rendered.token_ids, None):  # the prompt ends with <|start|>assistant: nothing opened either way
        msg, state = derender_all(p, out, prompt)
        assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
        assert p.finish_reason(state, "stop") == "tool_calls"
