"""gpt-oss (Harmony) through Responses and Messages, in process on the gpt-oss test bundle: render gives the chat
render's token ids for the equivalent chat request; the gateway's thinking budget ends the analysis message and
opens the final answer (``<|end|><|start|>assistant<|channel|>final<|message|>``), or drops an unfinished header;
thinking off hides the analysis; bad effort values are 400s in each API's shape. Derender of every Harmony shape
through both APIs is in test_apis_families.py; the processes end to end in test_harmony_gateway.py."""

from __future__ import annotations

import json

import msgspec
import pytest

from render_service.apis.messages import render_messages
from render_service.apis.messages_protocol import MessagesRequest
from render_service.apis.responses import render_responses
from render_service.apis.responses_protocol import ResponsesRequest
from render_service.gateway.api_responders import MessagesResponder, ThinkingBudget
from render_service.http.errors import ApiError
from render_service.render.render import render_chat
from render_service.wire.protocol import ChatCompletionRequest, GenerateStreamChoice
from tests.harmony_fixtures import encode, gpt_oss_config

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def cfg():
    return gpt_oss_config()


def test_responses_render_as_the_equivalent_chat_request(cfg):
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "message", "role": "user", "content": "Tomorrow?"}]
    gen, _ = render_responses(ResponsesRequest(input=items, instructions="Be brief.", reasoning={"effort": "high"},
                                               tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}]),
                              cfg)
    chat = render_chat(ChatCompletionRequest(reasoning_effort="high", tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER}}], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "reasoning": "Use the tool.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "Tomorrow?"}]), cfg)
    assert gen.token_ids == chat.token_ids
    text = cfg.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
    assert "Reasoning: high" in text and text.endswith("<|start|>assistant")


def test_messages_render_as_the_equivalent_chat_request(cfg):
    gen, _ = render_messages(MessagesRequest(max_tokens=64, system="Be brief.", messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
        tools=[{"name": "get_weather", "input_schema": WEATHER}], thinking={"type": "enabled", "budget_tokens": 16}),
        cfg)
    chat = render_chat(ChatCompletionRequest(max_tokens=64, tool_choice="auto", tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER}}], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK},
        {"role": "assistant", "reasoning": "Use the tool.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
                {"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"}]), cfg)
    assert gen.token_ids == chat.token_ids
    assert gen.sampling_params.thinking_token_budget == 16


def test_effort_gpt_oss_cannot_honour_is_a_400(cfg):
    for effort in ("none", "minimal", "xhigh", ["low"], {"level": "low"}):
        with pytest.raises(ApiError) as err:
            render_responses(ResponsesRequest(input="x", reasoning={"effort": effort}), cfg)
        assert err.value.status == 400 and err.value.param == "reasoning.effort"
    with pytest.raises(ApiError) as err:
        render_messages(MessagesRequest(max_tokens=9, messages=[{"role": "user", "content": "x"}],
                                        output_config={"effort": "max"}), cfg)
    assert err.value.status == 400


def budgeted(cfg, budget: int, max_tokens: int = 64, thinking: bool = True):
    req = MessagesRequest(max_tokens=max_tokens, messages=[{"role": "user", "content": ASK}],
                          thinking={"type": "enabled", "budget_tokens": budget} if thinking else None)
    gen, chat = render_messages(req, cfg, request_id="msg_budget")
    gen = msgspec.structs.replace(gen, sampling_params=msgspec.structs.replace(gen.sampling_params,
                                                                               thinking_token_budget=None))
    plan = ThinkingBudget(cfg, gen, budget)
    return gen, plan, MessagesResponder(cfg, gen, chat, "gpt-oss-tiny", plan)


def run_phase(responder, ids: list[int], finish: str) -> None:
    for i, t in enumerate(ids):
        responder.accumulate(0, GenerateStreamChoice(token_ids=[t], finish_reason=finish if i == len(ids) - 1 else None))


def test_budget_spent_in_the_analysis_ends_it_and_opens_the_final_answer(cfg):
    first = encode("<|channel|>analysis<|message|>Let me think about the")
    gen, plan, responder = budgeted(cfg, len(first))
    assert plan.first.sampling_params.max_tokens == len(first)
    run_phase(responder, first, "length")
    closing = encode("<|end|><|start|>assistant<|channel|>final<|message|>")
    nxt = plan.take_next()
    assert nxt.token_ids == gen.token_ids + first + closing  # the continuation's context: a finished analysis
    assert nxt.sampling_params.max_tokens == 64 - len(first) - len(closing)
    answer = encode("It is sunny.<|return|>")
    run_phase(responder, answer, "stop")
    message = msgspec.to_builtins(responder.response())
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in message["content"]] == [
        ("thinking", "Let me think about the"), ("text", "It is sunny.")]
    assert message["stop_reason"] == "end_turn"
    assert message["usage"]["output_tokens"] == len(first) + len(closing) + len(answer)
    thinking = message["usage"]["output_tokens_details"]["thinking_tokens"]
    assert thinking == len(first) + 1  # the analysis, its header and the <|end|> that closed it


@pytest.mark.parametrize("generated", ["<|channel|>analysis", "<|channel|>analysis<|message|>Hm.<|end|><|start|>"
                                                               "assistant<|channel|>analy"])
def test_budget_spent_in_a_header_drops_it(cfg, generated):
    first = encode(generated)
    gen, plan, responder = budgeted(cfg, len(first))
    run_phase(responder, first, "length")
    nxt = plan.take_next()
    kept = encode(generated.rsplit("<|end|>", 1)[0] + "<|end|>") if "<|end|>" in generated else []
    opening = "<|start|>assistant<|channel|>final<|message|>" if kept else "<|channel|>final<|message|>"
    assert nxt.token_ids == gen.token_ids + kept + encode(opening)  # the prompt ends with <|start|>assistant
    run_phase(responder, encode("Sunny.<|return|>"), "stop")
    message = msgspec.to_builtins(responder.response())
    assert message["content"][-1] == {"type": "text", "text": "Sunny."}
    assert [b["type"] for b in message["content"]] == (["thinking", "text"] if kept else ["text"])


def test_budget_not_reached_or_reasoning_over_changes_nothing(cfg):
    reply = encode("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.")
    gen, plan, responder = budgeted(cfg, len(reply))
    run_phase(responder, reply, "length")  # the budget ran out in the final answer: nothing to close
    nxt = plan.take_next()
    assert nxt.token_ids == gen.token_ids + reply
    run_phase(responder, encode("<|return|>"), "stop")
    assert msgspec.to_builtins(responder.response())["content"][-1] == {"type": "text", "text": "Sunny."}


def test_thinking_off_hides_the_analysis_but_counts_it(cfg):
    gen, chat = render_messages(MessagesRequest(max_tokens=64, messages=[{"role": "user", "content": ASK}]), cfg)
    responder = MessagesResponder(cfg, gen, chat, "gpt-oss-tiny")
    ids = encode("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>")
    run_phase(responder, ids, "stop")
    message = msgspec.to_builtins(responder.response())
    assert message["content"] == [{"type": "text", "text": "Sunny."}]
    assert message["usage"]["output_tokens_details"]["thinking_tokens"] == len(encode("Hm.")) + 4
