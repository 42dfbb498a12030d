"""Every parser family the registry knows, through Responses and Messages: the derender endpoints (batch, and
streaming under several chunkings with stream_state round trips) and the gateway's responders (engine events
one token at a time, coalesced, and folded for a non-streamed request), each checked against chat derender of the
same tokens, the `openai` and `anthropic` packages' own stream accumulators, and an exact reasoning-token count.

The families come from ``render_service/parsers/registry.py``: a tool parser family is written by its
``tests/tool_parser_invariants.FAMILIES`` writer (a family without one fails here, naming what to add), a
reasoning parser by its own start and end tags. gpt-oss (``openai`` / ``openai_gptoss``) runs on the gpt-oss test
bundle with Harmony outputs. Tokens are real: the Qwen3 tokenizer, the family test bundles (GLM, MiniMax-M2,
Seed-OSS) for their reasoning tags, gpt-oss's o200k_harmony.
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

import msgspec
import pytest

from render_service.apis.messages import render_messages
from render_service.apis.messages_protocol import MessagesRequest
from render_service.apis.responses import render_responses
from render_service.apis.responses_output import ResponsesShape
from render_service.apis.responses_protocol import ReasoningItem, ResponsesRequest
from render_service.bundle.model_bundle import load_bundle
from render_service.derender.batch import derender_chat
from render_service.gateway.api_responders import MessagesResponder, ResponsesResponder
from render_service.parsers.registry import REASONING_PARSERS, get_reasoning_parser, tool_parser_names
from render_service.render.render_config import build_render_config
from render_service.wire.protocol import (
    ChatCompletionRequest,
    DerenderChatRequest,
    GenerateResponse,
    GenerateResponseChoice,
    GenerateStreamChoice,
)
from tests import family_bundles
from tests.harmony_fixtures import gpt_oss_config
from tests.render_harness import qwen3_bundle
from tests.test_apis_derender import anthropic_fold, batch, comparable_message, comparable_response, openai_fold, stream
from tests.tool_parser_invariants import FAMILIES

pytestmark = pytest.mark.slow  # ~25 s on the shared 2-core box, most of it loading five family test bundles and gpt-oss

HARMONY = {"openai", "openai_gptoss"}  # gpt-oss's tool and reasoning parser names: one Harmony stage
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [("get_weather", WEATHER), ("get_time", {"type": "object", "properties": {}})]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
REASONING = "Let me think: the user wants the weather."
ANSWER = "It is sunny."


def api_requests(thinking: bool, tools: bool = True) -> tuple[ResponsesRequest, MessagesRequest]:
    return (ResponsesRequest(input="Weather in Paris?", tools=[
                {"type": "function", "name": n, "parameters": p} for n, p in TOOLS] if tools else None),
            MessagesRequest(max_tokens=512, messages=[{"role": "user", "content": "Weather in Paris?"}],
                            tools=[{"name": n, "input_schema": p} for n, p in TOOLS] if tools else None,
                            thinking={"type": "adaptive"} if thinking else None))


@functools.cache
def qwen3_config(tool: str | None, reasoning: str | None):
    return build_render_config(qwen3_bundle(), served_model_names=["q"], tool_call_parser=tool,
                               reasoning_parser=reasoning, enable_auto_tool_choice=tool is not None)


# reasoning parser -> its family's test bundle, where the name differs
BUNDLE_OF = {"mistral": "magistral", "beam": "hf", "muse": "muse_glimmer", "musespark": "muse_glimmer"}
# tool parsers that read the bundle's response_template: their test bundle carries one
TEMPLATE_BUNDLE = {"hf": "hf", "beam": "hf"}


@functools.cache
def template_config(tool: str, root: str):
    from pathlib import Path

    bundle = load_bundle(str(family_bundles.write_family_bundle(TEMPLATE_BUNDLE[tool], Path(root))))
    return build_render_config(bundle, served_model_names=["q"], tool_call_parser=tool, enable_auto_tool_choice=True)


@functools.cache
def family_config(reasoning: str, root: str):
    """A reasoning family on its test bundle when there is one (its tags are tokens there), else on Qwen3's."""
    family = BUNDLE_OF.get(reasoning, reasoning)
    if family not in family_bundles.FAMILIES and family not in family_bundles.RANKS_FAMILIES:
        return qwen3_config(None, reasoning)
    from pathlib import Path

    bundle = load_bundle(str(family_bundles.write_family_bundle(family, Path(root))))
    return build_render_config(bundle, served_model_names=["q"], reasoning_parser=reasoning)


# ---------------------------------------------------------------------------------------------- the checks


def chat_view(cfg, ids: list[int], request_id: str, prompt_ids: list[int], thinking: bool, tools: bool
              ) -> dict[str, Any]:
    """What chat derender makes of the same tokens (the Responses / Messages outputs must say the same)."""
    cls = cfg.reasoning_parser_cls
    kwargs = {cls.thinking_kwarg: thinking} if cls is not None and not cfg.harmony else None
    chat = derender_chat(DerenderChatRequest(
        generate_response=GenerateResponse(request_id=request_id, choices=[GenerateResponseChoice(token_ids=ids)]),
        prompt_token_ids=prompt_ids,
        chat_request=ChatCompletionRequest(messages=[], tools=[{"type": "function", "function": {
            "name": n, "parameters": p}} for n, p in TOOLS] if tools else None,
            chat_template_kwargs=kwargs)), cfg).choices[0]
    return msgspec.to_builtins(chat.message)


def agrees_with_chat(resp: dict, msg: dict, chat: dict) -> None:
    reasoning = "".join(i["content"][0]["text"] for i in resp["output"] if i["type"] == "reasoning")
    text = "".join(i["content"][0]["text"] for i in resp["output"] if i["type"] == "message")
    calls = [(i["call_id"], i["name"], json.loads(i["arguments"])) for i in resp["output"] if i["type"] == "function_call"]
    chat_reasoning = chat.get("reasoning") or chat.get("reasoning_content") or ""
    assert reasoning == chat_reasoning
    # whitespace between blocks opens none, text after reasoning starts at its first non-whitespace (docs/apis.md)
    assert text.strip() == (chat.get("content") or "").strip()
    assert calls == [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in chat.get("tool_calls") or []]
    assert [b.get("thinking") for b in msg["content"] if b["type"] == "thinking"] == \
        [i["content"][0]["text"] for i in resp["output"] if i["type"] == "reasoning"]
    assert [(b["name"], b["input"]) for b in msg["content"] if b["type"] == "tool_use"] == [c[1:] for c in calls]


def sse_events(data: bytes) -> list[dict]:
    out = []
    for frame in data.split(b"\n\n"):
        for line in frame.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(json.loads(line[6:]))
    return out


def chunkings(ids: list[int], seed: str) -> list[list[list[int]]]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, 7)))
    return [[[t] for t in ids], [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])], [ids]]


def through_gateway(cfg, rreq: ResponsesRequest, mreq: MessagesRequest, ids: list[int], seed: str):
    """The gateway's responders fed engine events: per token and coalesced (streamed), and folded (not)."""
    rgen, rchat = render_responses(rreq, cfg, request_id="resp_fam")
    mgen, mchat = render_messages(mreq, cfg, request_id="msg_fam")
    streamed = []
    for chunks in chunkings(ids, seed)[:2]:
        shape = ResponsesShape(rgen.request_id or "", "q", rreq, len(rgen.token_ids))
        r = ResponsesResponder(cfg, rgen, rchat, shape)
        m = MessagesResponder(cfg, mgen, mchat, "q")
        events = [(0, GenerateStreamChoice(token_ids=c, finish_reason="stop" if i == len(chunks) - 1 else None))
                  for i, c in enumerate(chunks)]
        rbytes = r.stream_batch(events[:3]) + b"".join(r.stream_events(p, c) for p, c in events[3:])
        mbytes = b"".join(m.stream_events(p, c) for p, c in events)
        streamed.append((sse_events(rbytes + r.final_bytes(None)), sse_events(mbytes)))
    shape = ResponsesShape(rgen.request_id or "", "q", rreq, len(rgen.token_ids))
    r, m = ResponsesResponder(cfg, rgen, rchat, shape), MessagesResponder(cfg, mgen, mchat, "q")
    for i, t in enumerate(ids):
        choice = GenerateStreamChoice(token_ids=[t], finish_reason="stop" if i == len(ids) - 1 else None)
        r.accumulate(0, choice)
        m.accumulate(0, choice)
    return rgen, mgen, streamed, msgspec.to_builtins(r.response()), msgspec.to_builtins(m.response())


def check_family(cfg, rreq, mreq, ids: list[int], *, thinking: bool, seed: str) -> tuple[dict, dict]:
    """Derender endpoints and gateway responders agree with chat, with each other and with every stream."""
    rgen, mgen, streamed, gw_resp, gw_msg = through_gateway(cfg, rreq, mreq, ids, seed)
    # the endpoints, answering the same generate response as the gateway's engine call
    resp, msg = batch(cfg, ids, rreq, mreq, prompt_ids=rgen.token_ids, request_id=rgen.request_id)
    _, msg = batch(cfg, ids, rreq, mreq, prompt_ids=mgen.token_ids, request_id=mgen.request_id)
    agrees_with_chat(resp, msg, chat_view(cfg, ids, rgen.request_id, rgen.token_ids, thinking, bool(rreq.tools)))
    assert comparable_response(gw_resp) == comparable_response(resp)
    assert comparable_message(gw_msg) == comparable_message(msg)
    for revents, mevents in streamed:
        assert comparable_response(openai_fold(revents)) == comparable_response(resp)
        assert comparable_message(anthropic_fold(mevents)) == comparable_message(msg)
        assert mevents[-2]["usage"] == {k: v for k, v in msg["usage"].items() if k != "input_tokens" and v is not None}
    for chunks in chunkings(ids, seed):
        revents, _, _ = stream(cfg, chunks, rreq, mreq, prompt_ids=rgen.token_ids, request_id=rgen.request_id)
        _, mevents, _ = stream(cfg, chunks, rreq, mreq, prompt_ids=mgen.token_ids, request_id=mgen.request_id)
        assert comparable_response(openai_fold(revents)) == comparable_response(resp)
        assert comparable_message(anthropic_fold(mevents)) == comparable_message(msg)
    return resp, msg


def marker_count(ids: list[int], start: int | None, end: int | None, open_at_start: bool) -> int:
    """The oracle for single-token tags: tokens strictly inside the reasoning span (vLLM's count, seeded with
    whether the prompt opened reasoning)."""
    depth, count = int(open_at_start), 0
    for t in ids:
        if t == start:
            depth += 1
        elif t == end:
            depth = 0  # our parsers end reasoning at the first end tag
            break
        elif depth:
            count += 1
    return count


# ----------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", tool_parser_names())
def test_every_tool_parser_family(name, tmp_path_factory):
    if name in HARMONY:
        return  # test_harmony_families
    family = FAMILIES.get(name)
    assert family is not None, (f"tool parser {name!r} has no ToolFamily in tests/tool_parser_invariants.py: add "
                                f"one (how its model writes calls) and this test covers it through both APIs")
    cfg = template_config(name, str(tmp_path_factory.getbasetemp() / "templates")) if name in TEMPLATE_BUNDLE \
        else qwen3_config(name, None)
    prose = "" if family.calls_first else "Checking the weather.\n"
    ids = cfg.tokenizer.encode(prose + family.write(CALLS))
    rreq, mreq = api_requests(False)
    resp, msg = check_family(cfg, rreq, mreq, ids, thinking=False, seed=name)
    got = [(i["name"], json.loads(i["arguments"])) for i in resp["output"] if i["type"] == "function_call"]
    assert got == CALLS, name
    assert msg["stop_reason"] == "tool_use" and resp["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_every_reasoning_parser_family(name, tmp_path_factory):
    cfg = family_config(name, str(tmp_path_factory.getbasetemp() / "families"))
    cls = cfg.reasoning_parser_cls  # the registry's class, made for the bundle where it reads its metadata
    assert cls is not None and cls.name == get_reasoning_parser(name).name
    ids = cfg.tokenizer.encode(f"{cls.start_tag}{REASONING}{cls.end_tag}{ANSWER}")
    rreq, mreq = api_requests(True, tools=False)
    # Responses has no thinking switch of its own (reasoning.effort "none" turns it off): the template's, on
    rreq = msgspec.structs.replace(rreq, chat_template_kwargs={cls.thinking_kwarg: True})
    resp, msg = check_family(cfg, rreq, mreq, ids, thinking=True, seed=name)
    reasoning_tokens = resp["usage"]["output_tokens_details"]["reasoning_tokens"]
    thinking_tokens = msg["usage"]["output_tokens_details"]["thinking_tokens"]
    if not getattr(cls, "emits_reasoning", True):
        assert reasoning_tokens == thinking_tokens == 0
        return
    assert [i["type"] for i in resp["output"]] == ["reasoning", "message"], name
    start, end = cfg.tokenizer.token_to_id(cls.start_tag), cfg.tokenizer.token_to_id(cls.end_tag)
    if start is not None and end is not None:  # the tags are tokens: the count is exact
        assert reasoning_tokens == marker_count(ids, start, end, False) == len(cfg.tokenizer.encode(REASONING))
        assert thinking_tokens == reasoning_tokens + 2  # with the two delimiters, as Anthropic counts
        # the template opened reasoning in the prompt: the same span without its start tag counts the same
        rest = ids[ids.index(start) + 1:]
        open_cfg_ids = render_responses(rreq, cfg)[0].token_ids + [start]
        gen = GenerateResponse(request_id="r", choices=[GenerateResponseChoice(token_ids=rest)])
        from render_service.apis.derender import derender_responses
        from render_service.apis.responses_protocol import DerenderResponsesRequest

        opened = derender_responses(DerenderResponsesRequest(generate_response=gen, responses_request=rreq,
                                                             prompt_token_ids=open_cfg_ids), cfg)
        # (a family whose text stage reads content until the model itself opens reasoning counts none here)
        thinks = bool(opened.output) and isinstance(opened.output[0], ReasoningItem)
        assert opened.usage.output_tokens_details.reasoning_tokens == (
            marker_count(rest, start, end, True) if thinks else 0)
    else:  # tags spelled with ordinary tokens: exact when events are single tokens, as engines stream
        assert 0 < reasoning_tokens < len(ids) and thinking_tokens > reasoning_tokens


HARMONY_OUTPUTS = {
    "analysis_then_final": (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final"
                            f"<|message|>{ANSWER}<|return|>", ["reasoning", "message"]),
    "analysis_then_call": (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>commentary "
                           f'to=functions.get_weather <|constrain|>json<|message|>{{"city": "Paris", "days": 3}}<|call|>',
                           ["reasoning", "function_call"]),
    "two_analyses_preamble_call": (
        "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second."
        "<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions."
        "get_time<|channel|>commentary <|constrain|>json<|message|>{}<|call|>",
        ["reasoning", "message", "function_call"]),
}


@pytest.mark.parametrize("case", sorted(HARMONY_OUTPUTS))
def test_harmony_families(case):
    """gpt-oss (tool parser ``openai``, reasoning parser ``openai_gptoss``): Harmony output through both APIs."""
    cfg = gpt_oss_config()
    text, kinds = HARMONY_OUTPUTS[case]
    ids = cfg.tokenizer.encode(text)
    rreq, mreq = api_requests(True)
    resp, msg = check_family(cfg, rreq, mreq, ids, thinking=True, seed=case)
    assert [i["type"] for i in resp["output"]] == kinds
    bodies = [part.split("<|message|>", 1)[1] for part in text.split("<|end|>") if "<|channel|>analysis" in part]
    expected = sum(len(cfg.tokenizer.encode(b)) for b in bodies)
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == expected
    assert msg["usage"]["output_tokens_details"]["thinking_tokens"] > expected
    # Anthropic's thinking off: gpt-oss still reasons (Harmony has no switch), the blocks are not shown
    _, quiet = api_requests(False)
    _, hidden = batch(cfg, ids, rreq, quiet)
    assert "thinking" not in [b["type"] for b in hidden["content"]]
    assert hidden["usage"]["output_tokens_details"] == msg["usage"]["output_tokens_details"]
