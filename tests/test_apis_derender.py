"""/v1/responses/derender and /v1/messages/derender: batch equals the fold of the stream for every chunking,
across every tool parser family's vectors (parser-semantics.md §6.2, real Qwen3 tokens); the folded stream is
what the `openai` and `anthropic` packages' own stream accumulators build; outputs agree with chat derender;
the stream_state is signed, constant-size and refused when tampered with; bad input is a 400 in each API's
shape, over a real server."""

from __future__ import annotations

import functools
import json

import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.responses._responses import ResponseStreamState

from render_service.apis.derender import (
    derender_messages,
    derender_messages_stream,
    derender_responses,
    derender_responses_stream,
)
from render_service.apis.messages_protocol import (
    DerenderMessagesRequest,
    DerenderMessagesStreamRequest,
    MessagesRequest,
)
from render_service.apis.responses_protocol import (
    DerenderResponsesRequest,
    DerenderResponsesStreamRequest,
    ResponsesRequest,
)
from render_service.derender.batch import derender_chat
from render_service.http.errors import ApiError
from render_service.render.render_config import build_render_config
from render_service.streaming_cache.session import StreamRuntime
from render_service.wire.protocol import (
    ChatCompletionRequest,
    DerenderChatRequest,
    GenerateResponse,
    GenerateResponseChoice,
    GenerateStreamChoice,
    GenerateStreamResponse,
)
from tests.render_harness import RenderServer, qwen3_bundle
from tests.test_pipeline_tool_vectors import TOOLS, VECTORS

RESPONSES_TOOLS = [{"type": "function", "name": t.name, "parameters": t.parameters} for t in TOOLS]
MESSAGES_TOOLS = [{"name": t.name, "input_schema": t.parameters} for t in TOOLS]
CHAT_TOOLS = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in TOOLS]
RUNTIME = StreamRuntime(secret="test-secret")
RID = "req-v"


@functools.cache
def config(tool: str | None, reasoning: str | None):
    return build_render_config(qwen3_bundle(), served_model_names=["q"], tool_call_parser=tool,
                               reasoning_parser=reasoning, enable_auto_tool_choice=tool is not None)


def requests(reasoning: str | None):
    thinking = {"type": "adaptive"} if reasoning else None
    return (ResponsesRequest(input="x", tools=RESPONSES_TOOLS),
            MessagesRequest(max_tokens=100, messages=[{"role": "user", "content": "x"}], tools=MESSAGES_TOOLS,
                            thinking=thinking))


def batch(cfg, ids, rreq, mreq, finish="stop", prompt_ids=None, request_id=RID):
    gen = GenerateResponse(request_id=request_id, choices=[GenerateResponseChoice(token_ids=ids,
                                                                                  finish_reason=finish)])
    resp = derender_responses(DerenderResponsesRequest(generate_response=gen, responses_request=rreq,
                                                       prompt_token_ids=prompt_ids), cfg)
    msg = derender_messages(DerenderMessagesRequest(generate_response=gen, messages_request=mreq,
                                                    prompt_token_ids=prompt_ids), cfg)
    return msgspec.to_builtins(resp), msgspec.to_builtins(msg)


def stream(cfg, chunks, rreq, mreq, finish="stop", prompt_ids=None, request_id=RID, logprobs=None):
    """Every chunk through both streaming derenders (state round-tripped as JSON; Messages skipped when ``mreq`` is
    None); their events. ``logprobs``: each chunk's engine logprobs."""
    revents, mevents, rstate, mstate, sizes = [], [], None, None, []
    for i, ids in enumerate(chunks):
        chunk = GenerateStreamResponse(request_id=request_id, choices=[GenerateStreamChoice(
            token_ids=ids, finish_reason=finish if i == len(chunks) - 1 else None,
            logprobs=logprobs[i] if logprobs else None)])
        r = derender_responses_stream(DerenderResponsesStreamRequest(
            stream=True, generate_chunk=chunk, responses_request=rreq, stream_state=rstate,
            prompt_token_ids=prompt_ids), cfg, RUNTIME)
        rstate = r.stream_state
        revents += msgspec.to_builtins(r.events)
        if mreq is None:
            continue
        m = derender_messages_stream(DerenderMessagesStreamRequest(
            stream=True, generate_chunk=chunk, messages_request=mreq, stream_state=mstate,
            prompt_token_ids=prompt_ids), cfg, RUNTIME)
        mstate = m.stream_state
        sizes.append((len(rstate), len(mstate)))
        mevents += msgspec.to_builtins(m.events)
    return revents, mevents, sizes


def openai_fold(events):
    """What the openai package's Responses stream helper builds from the events (it validates their order)."""
    from openai import omit
    from openai._models import construct_type
    from openai.types.responses import ResponseStreamEvent

    state = ResponseStreamState(input_tools=omit, text_format=omit)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    return state._completed_response.to_dict()


def anthropic_fold(events):
    snapshot, bufs = None, {}
    for e in events:
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot.to_dict()


def clean(value):
    """Without null values and the SDKs' client-side parse results (``parsed``, ``parsed_arguments``...)."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items() if v is not None and not k.startswith("parsed")}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value


def comparable_response(resp):
    """A response's fields a stream folds to; a call's arguments as the JSON value they hold (a stream carries
    the model's text, a whole answer the re-serialized JSON)."""
    out = clean({k: resp[k] for k in ("id", "status", "output", "usage", "incomplete_details")})
    for item in out["output"]:
        if item.get("type") == "function_call":
            item["arguments"] = json.loads(item["arguments"])
    return out


def comparable_message(msg):
    return clean({k: msg[k] for k in ("id", "content", "stop_reason", "stop_sequence", "usage")})


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_every_family_batch_agrees_with_chat_and_folds_from_any_stream(name):
    tool, reasoning, text, content, calls, expected_reasoning = VECTORS[name]
    cfg = config(tool, reasoning)
    ids = cfg.tokenizer.encode(text)
    rreq, mreq = requests(reasoning)
    resp, msg = batch(cfg, ids, rreq, mreq)

    chat = derender_chat(DerenderChatRequest(
        generate_response=GenerateResponse(request_id=RID, choices=[GenerateResponseChoice(token_ids=ids)]),
        chat_request=ChatCompletionRequest(messages=[], tools=CHAT_TOOLS,
                                           chat_template_kwargs={"enable_thinking": True} if reasoning else None)),
        cfg).choices[0]
    kinds = [i["type"] for i in resp["output"]]
    assert kinds == [b["type"].replace("thinking", "reasoning").replace("text", "message")
                     .replace("tool_use", "function_call") for b in msg["content"]]
    texts = [i["content"][0]["text"] for i in resp["output"] if i["type"] == "message"]
    # whitespace-only text between blocks drops; text after reasoning starts at its first non-whitespace
    expected_text = (content or "") if (content or "").strip() else ""
    assert "".join(texts) == (expected_text.lstrip() if expected_reasoning else expected_text)
    reasonings = [i["content"][0]["text"] for i in resp["output"] if i["type"] == "reasoning"]
    assert "".join(reasonings) == (expected_reasoning or "")
    got_calls = [(i["call_id"], i["name"], json.loads(i["arguments"])) for i in resp["output"]
                 if i["type"] == "function_call"]
    assert got_calls == [(c.id, c.function.name, json.loads(c.function.arguments)) for c in chat.message.tool_calls or []]
    # a whole answer's arguments are the same string as chat's (re-serialized as vLLM's parsers give them)
    assert [i["arguments"] for i in resp["output"] if i["type"] == "function_call"] == \
        [c.function.arguments for c in chat.message.tool_calls or []]
    assert [(c, n, a) for c, n, a in got_calls] == [(b["id"], b["name"], b["input"]) for b in msg["content"]
                                                    if b["type"] == "tool_use"]
    assert [(n, a) for _, n, a in got_calls] == calls
    assert msg["stop_reason"] == ("tool_use" if calls else "end_turn")
    assert resp["status"] == "completed"

    @settings(max_examples=6, deadline=None)
    @given(st.sets(st.integers(1, max(len(ids) - 1, 1)), max_size=12))
    def check(cuts):
        points = sorted(c for c in cuts if c < len(ids))
        chunks = [ids[a:b] for a, b in zip([0, *points], [*points, len(ids)])]
        revents, mevents, _ = stream(cfg, chunks, rreq, mreq)
        assert comparable_response(openai_fold(revents)) == comparable_response(resp)
        assert comparable_response(revents[-1]["response"]) == comparable_response(resp)
        assert comparable_message(anthropic_fold(mevents)) == comparable_message(msg)

    check()
    revents, mevents, _ = stream(cfg, [[t] for t in ids], rreq, mreq)  # one token per chunk
    assert comparable_response(openai_fold(revents)) == comparable_response(resp)
    assert comparable_message(anthropic_fold(mevents)) == comparable_message(msg)


def test_event_sequences_are_the_apis_own():
    cfg = config("hermes", "qwen3")
    ids = cfg.tokenizer.encode("<think>Plan.</think>" + VECTORS["V-T12"][2].split("</think>")[1])
    rreq, mreq = requests("qwen3")
    revents, mevents, _ = stream(cfg, [[t] for t in ids], rreq, mreq)
    types = [e["type"] for e in revents]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-1] == "response.completed"
    for closing in ("response.reasoning_text.done", "response.content_part.done",
                    "response.function_call_arguments.done", "response.output_item.done"):
        assert closing in types
    mtypes = [e["type"] for e in mevents]
    assert mtypes[:3] == ["message_start", "ping", "content_block_start"]
    assert mtypes[-2:] == ["message_delta", "message_stop"]
    sig = [e for e in mevents if e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta"]
    assert len(sig) == 1 and mevents[mevents.index(sig[0]) + 1]["type"] == "content_block_stop"


def test_max_tokens_gives_incomplete_and_max_tokens():
    cfg = config("hermes", "qwen3")
    ids = cfg.tokenizer.encode("Hello there, this is cut")
    rreq, mreq = requests(None)
    resp, msg = batch(cfg, ids, rreq, mreq, finish="length")
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"][-1]["status"] == "incomplete"
    assert msg["stop_reason"] == "max_tokens"
    revents, mevents, _ = stream(cfg, [[t] for t in ids], rreq, mreq, finish="length")
    assert revents[-1]["type"] == "response.incomplete"
    assert comparable_response(revents[-1]["response"]) == comparable_response(resp)
    assert comparable_message(anthropic_fold(mevents)) == comparable_message(msg)


def test_stop_sequences_cut_the_text_in_batch_and_stream():
    """Messages' stop_sequences and Responses' stop: the text cut at the stop string, as chat derender cuts it;
    Messages says stop_sequence and names it."""
    cfg = config(None, None)
    ids = cfg.tokenizer.encode("Hello world. STOP here more text") + [151645]
    rreq = ResponsesRequest(input="x", stop=["STOP"])
    mreq = MessagesRequest(max_tokens=100, messages=[{"role": "user", "content": "x"}], stop_sequences=["STOP"])
    resp, msg = batch(cfg, ids, rreq, mreq)
    assert msg["content"] == [{"type": "text", "text": "Hello world. "}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "STOP")
    assert resp["output"][0]["content"][0]["text"] == "Hello world. " and resp["status"] == "completed"
    for size in (1, 3):
        revents, mevents, _ = stream(cfg, [ids[i:i + size] for i in range(0, len(ids), size)], rreq, mreq)
        assert comparable_message(anthropic_fold(mevents)) == comparable_message(msg)
        assert comparable_response(openai_fold(revents)) == comparable_response(resp)


def test_stream_state_is_constant_size():
    cfg = config("hermes", "qwen3")
    ids = cfg.tokenizer.encode("<think>" + "thinking more " * 150 + "</think>" + "words and words " * 150)
    rreq, mreq = requests("qwen3")
    _, _, sizes = stream(cfg, [[t] for t in ids], rreq, mreq)
    assert len(ids) > 500
    assert max(s[0] for s in sizes[5:]) - min(s[0] for s in sizes[5:]) < 40  # no growth with the output
    assert max(s[1] for s in sizes[5:]) - min(s[1] for s in sizes[5:]) < 40
    assert max(max(s) for s in sizes) < 700


def test_hostile_stream_state_is_refused():
    cfg = config("hermes", "qwen3")
    rreq, mreq = requests("qwen3")
    ids = cfg.tokenizer.encode("Hello world")
    chunk = GenerateStreamResponse(request_id=RID, choices=[GenerateStreamChoice(token_ids=ids[:1])])
    first = derender_messages_stream(DerenderMessagesStreamRequest(stream=True, generate_chunk=chunk,
                                                                   messages_request=mreq), cfg, RUNTIME)
    token = first.stream_state
    for bad in (token[:-2] + "xx", "ss1.AAAA", 42, token.replace("ss1", "ss9"), {"x": 1}):
        with pytest.raises(ApiError) as err:
            derender_messages_stream(DerenderMessagesStreamRequest(stream=True, generate_chunk=chunk,
                                                                   messages_request=mreq, stream_state=bad), cfg, RUNTIME)
        assert err.value.status == 400 and err.value.param == "stream_state"
    # a Messages state does not continue a Responses stream
    with pytest.raises(ApiError):
        derender_responses_stream(DerenderResponsesStreamRequest(stream=True, generate_chunk=chunk,
                                                                 responses_request=rreq, stream_state=token), cfg, RUNTIME)
    # a Responses stream whose texts this replica does not hold is refused with a reason, not answered wrongly
    r = derender_responses_stream(DerenderResponsesStreamRequest(stream=True, generate_chunk=chunk,
                                                                 responses_request=rreq), cfg, RUNTIME)
    derender_responses_stream(DerenderResponsesStreamRequest(stream=True, generate_chunk=chunk, responses_request=rreq,
                                                             stream_state=r.stream_state), cfg, RUNTIME)
    with pytest.raises(ApiError) as err:  # the same chunk again: the replica's texts moved on
        derender_responses_stream(DerenderResponsesStreamRequest(stream=True, generate_chunk=chunk,
                                                                 responses_request=rreq, stream_state=r.stream_state),
                                  cfg, RUNTIME)
    assert "one replica" in err.value.message


def test_http_endpoints_batch_stream_and_errors():
    cfg = config("hermes", "qwen3")
    ids = cfg.tokenizer.encode(VECTORS["V-T12"][2])
    with RenderServer(cfg) as server:
        gen = {"request_id": RID, "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop"}]}
        r = server.client.post("/v1/responses/derender", json={
            "generate_response": gen, "responses_request": {"input": "x", "tools": RESPONSES_TOOLS}})
        assert r.status_code == 200 and [i["type"] for i in r.json()["output"]] == ["reasoning", "function_call"]
        r = server.client.post("/v1/messages/derender", json={
            "generate_response": gen, "messages_request": {"max_tokens": 50, "tools": MESSAGES_TOOLS,
                                                           "thinking": {"type": "adaptive"},
                                                           "messages": [{"role": "user", "content": "x"}]}})
        assert r.status_code == 200 and r.json()["stop_reason"] == "tool_use"
        chunk = {"request_id": RID, "choices": [{"index": 0, "token_ids": ids[:3]}]}
        r = server.client.post("/v1/messages/derender", json={
            "stream": True, "generate_chunk": chunk, "messages_request": {"max_tokens": 5, "messages": []}})
        assert r.status_code == 200 and r.json()["events"][0]["type"] == "message_start"
        # parsers configured: the API request is needed; its absence is a 400 in each API's shape
        r = server.client.post("/v1/responses/derender", json={"generate_response": gen})
        assert r.status_code == 400 and r.json()["error"]["param"] == "responses_request"
        r = server.client.post("/v1/messages/derender", json={"generate_response": gen})
        assert r.status_code == 400 and r.json()["type"] == "error"
        bad = {"request_id": RID, "choices": [{"index": 0, "token_ids": [10**9], "finish_reason": "stop"}]}
        r = server.client.post("/v1/messages/derender", json={"generate_response": bad, "messages_request": {
            "max_tokens": 5, "messages": []}})
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
