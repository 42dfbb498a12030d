"""Responses' ``top_logprobs`` with ``include: ["message.output_text.logprobs"]``: render asks the engine for them,
and each ``output_text`` carries exactly its own tokens' logprobs (reasoning, calls, Harmony markup and the blank
line after reasoning carry none), in the batch and streaming derender endpoints and the gateway's responder alike,
for every chunking. Real tokenizers (Qwen3, gpt-oss); engine logprobs in vLLM's generate shape (token ids)."""

from __future__ import annotations

import msgspec
import pytest

from render_service.apis.responses import render_responses
from render_service.apis.responses_output import ResponsesShape
from render_service.apis.responses_protocol import ResponsesRequest
from render_service.gateway.api_responders import ResponsesResponder
from render_service.http.errors import ApiError
from render_service.wire.protocol import GenerateLogprobs, GenerateStreamChoice
from tests.harmony_fixtures import gpt_oss_config
from tests.test_apis_derender import RID, batch, clean, openai_fold, stream
from tests.test_apis_families import chunkings, qwen3_config, sse_events

INCLUDE = ["message.output_text.logprobs"]
TOOL = [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]


def engine_logprobs(ids: list[int], top: int) -> list[dict]:
    """One entry per token, each logprob unique to its position (-(position + 1) / 1000)."""
    return [{"token_id": t, "logprob": -(i + 1) / 1000, "top_logprobs": [
        {"token_id": t, "logprob": -(i + 1) / 1000}, *({"token_id": 15 + k, "logprob": -5.0 - k} for k in range(top - 1))]}
        for i, t in enumerate(ids)]


def positions(entries: list[dict]) -> list[int]:
    return [round(-e["logprob"] * 1000) - 1 for e in entries]


def text_part(resp: dict) -> dict:
    (message,) = [i for i in resp["output"] if i["type"] == "message"]
    return message["content"][0]


def check_everywhere(cfg, rreq: ResponsesRequest, ids: list[int], top: int) -> dict:
    """Batch derender; every chunking of streaming derender and of the gateway's responder says the same."""
    entries = engine_logprobs(ids, top)
    gen, chat = render_responses(rreq, cfg, request_id=RID)
    resp = _batch(cfg, rreq, ids, entries, gen.token_ids)
    for chunks in chunkings(ids, "logprobs"):
        at, events = 0, []
        chunk_entries = []
        for c in chunks:
            chunk_entries.append(msgspec.convert({"content": entries[at:at + len(c)]}, GenerateLogprobs))
            at += len(c)
        revents, _, _ = stream(cfg, chunks, rreq, None, prompt_ids=gen.token_ids, logprobs=chunk_entries)
        folded = openai_fold(revents)
        assert clean(text_part(folded)) == clean(text_part(resp))
        deltas = [e for e in revents if e["type"] == "response.output_text.delta"]
        assert [x for d in deltas for x in d["logprobs"]] == text_part(resp)["logprobs"]
        responder = ResponsesResponder(cfg, gen, chat, ResponsesShape(RID, "q", rreq, len(gen.token_ids)))
        for i, (c, e) in enumerate(zip(chunks, chunk_entries)):
            events += sse_events(responder.stream_events(0, GenerateStreamChoice(
                token_ids=c, logprobs=e, finish_reason="stop" if i == len(chunks) - 1 else None)))
        events += sse_events(responder.final_bytes(None))
        assert text_part(events[-1]["response"]) == text_part(resp)
    return resp


def _batch(cfg, rreq, ids, entries, prompt_ids):
    from render_service.apis.derender import derender_responses
    from render_service.apis.responses_protocol import DerenderResponsesRequest
    from render_service.wire.protocol import GenerateResponse, GenerateResponseChoice

    gen = GenerateResponse(request_id=RID, choices=[GenerateResponseChoice(
        token_ids=ids, logprobs=msgspec.convert({"content": entries}, GenerateLogprobs))])
    return msgspec.to_builtins(derender_responses(DerenderResponsesRequest(
        generate_response=gen, responses_request=rreq, prompt_token_ids=prompt_ids), cfg))


def test_render_asks_the_engine_only_when_included():
    cfg = qwen3_config(None, None)
    gen, _ = render_responses(ResponsesRequest(input="Hi", top_logprobs=3, include=INCLUDE), cfg)
    assert gen.sampling_params.logprobs == 3
    gen, _ = render_responses(ResponsesRequest(input="Hi", include=INCLUDE), cfg)
    assert gen.sampling_params.logprobs == 0  # the sampled token's own logprob
    gen, _ = render_responses(ResponsesRequest(input="Hi", top_logprobs=3), cfg)
    assert gen.sampling_params.logprobs is None  # OpenAI: top_logprobs alone returns none
    for bad in (-1, 21):
        with pytest.raises(ApiError) as err:
            render_responses(ResponsesRequest(input="Hi", top_logprobs=bad, include=INCLUDE), cfg)
        assert err.value.status == 400 and err.value.param == "top_logprobs"


def test_text_logprobs_are_the_texts_own_tokens():
    cfg = qwen3_config("hermes", "qwen3")
    text = "<think>\nPlan it.\n</think>\n\nIt is 5 o'clock, über früh.\n<tool_call>\n{\"name\": \"get_time\", " \
           "\"arguments\": {}}\n</tool_call>"
    ids = cfg.tokenizer.encode(text)
    rreq = ResponsesRequest(input="x", tools=TOOL, top_logprobs=2, include=INCLUDE)
    resp = check_everywhere(cfg, rreq, ids, top=2)
    part = text_part(resp)
    assert part["text"] == "It is 5 o'clock, über früh.\n"
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"]
    first = ids.index(cfg.tokenizer.encode("It")[0])
    assert positions(part["logprobs"]) == list(range(first, first + len(part["logprobs"])))
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in part["logprobs"])
    assert [i["type"] for i in resp["output"]] == ["reasoning", "message", "function_call"]


def test_harmony_final_answer_logprobs_leave_the_markup_out():
    cfg = gpt_oss_config()
    text = ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny today."
            "<|return|>")
    ids = cfg.tokenizer.encode(text)
    resp = check_everywhere(cfg, ResponsesRequest(input="x", include=INCLUDE), ids, top=1)
    part = text_part(resp)
    assert "".join(e["token"] for e in part["logprobs"]) == "Sunny today."
    answer = cfg.tokenizer.encode("Sunny today.")
    start = len(ids) - 1 - len(answer)
    assert positions(part["logprobs"]) == list(range(start, start + len(answer)))


def test_without_include_there_are_none():
    cfg = qwen3_config(None, None)
    ids = cfg.tokenizer.encode("Hello there.")
    resp = _batch(cfg, ResponsesRequest(input="x", top_logprobs=2), ids, engine_logprobs(ids, 2), None)
    assert text_part(resp)["logprobs"] == []
    resp, _ = batch(cfg, ids, ResponsesRequest(input="x", include=INCLUDE), None)  # asked, but the engine sent none
    assert text_part(resp)["logprobs"] == [] and text_part(resp)["text"] == "Hello there."
