"""Streaming derender over HTTP, end to end: batch equals the fold of the streamed chunks for random chunkings
(tags and emoji spelled byte by byte across chunks) on fifteen parser combinations; role chunk first, one finish
chunk, usage (per chunk and final), n>1 choice indexes and token id echo."""

from __future__ import annotations

import random

import pytest

from render_service.tokenize.byte_level import BYTE_TO_CHAR
from tests.derender_http import (
    CHAT,
    EOS,
    MODEL,
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
from tests.render_harness import qwen3_bundle

COMBINATIONS = {
    "qwen3+hermes": (
        {"reasoning_parser": "qwen3", "tool_call_parser": "hermes"},
        '<think>\nNeed weather 😀.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Seoul 🌧"}}\n</tool_call>'),
    "qwen3+qwen3_coder": (
        {"reasoning_parser": "qwen3", "tool_call_parser": "qwen3_coder"},
        '<think>\nplan 😀\n</think>\n\nSure.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis 🌧\n'
        '</parameter>\n</function>\n</tool_call>'),
    "deepseek_r1+llama3_json": (
        {"reasoning_parser": "deepseek_r1", "tool_call_parser": "llama3_json"},
        'plan 😀</think>{"name": "get_weather", "parameters": {"city": "Paris 🌧"}}'),
    "mistral": (
        {"tool_call_parser": "mistral"},
        'Sure 😀. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    "qwen3+pythonic": (
        {"reasoning_parser": "qwen3", "tool_call_parser": "pythonic"},
        '<think>x 😀</think>[get_weather(city="Paris 🌧")]'),
    # the XML families over Qwen3's tokenizer: their tags are spelled with ordinary sub-tokens here
    "qwen3+qwen3_xml": (
        {"reasoning_parser": "qwen3", "tool_call_parser": "qwen3_xml"},
        '<think>\nplan 😀\n</think>\n\nSure.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis 🌧\n'
        '</parameter>\n</function>\n</tool_call>\nDone.'),
    "glm45": (
        {"reasoning_parser": "glm45", "tool_call_parser": "glm45"},
        '<think>plan 😀</think>\nSure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris 🌧'
        '</arg_value>\n</tool_call>'),
    "minimax_m2": (
        {"reasoning_parser": "minimax_m2", "tool_call_parser": "minimax_m2"},
        'plan 😀\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris 🌧'
        '</parameter>\n</invoke>\n</minimax:tool_call>'),
    "seed_oss": (
        {"reasoning_parser": "seed_oss", "tool_call_parser": "seed_oss"},
        '<seed:think>plan 😀</seed:think>Sure.<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris 🌧'
        '</parameter>\n</function>\n</seed:tool_call>'),
    # the newer parser families, also over Qwen3's tokens
    "kimi_k2": (
        {"reasoning_parser": "kimi_k2", "tool_call_parser": "kimi_k2"},
        '<think>plan 😀<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
        '<|tool_call_argument_begin|>{"city": "Paris 🌧"}<|tool_call_end|><|tool_calls_section_end|>'),
    "deepseek_v4": (
        {"reasoning_parser": "deepseek_v4", "tool_call_parser": "deepseek_v4"},
        'plan 😀</think>Sure.\n\n<\uff5cDSML\uff5ctool_calls>\n<\uff5cDSML\uff5cinvoke name="get_weather">\n'
        '<\uff5cDSML\uff5cparameter name="city" string="true">Paris 🌧</\uff5cDSML\uff5cparameter>\n'
        '</\uff5cDSML\uff5cinvoke>\n</\uff5cDSML\uff5ctool_calls>'),
    "deepseek_v4+deepseek_v32": (
        {"reasoning_parser": "deepseek_v4", "tool_call_parser": "deepseek_v32"},
        'plan 😀<\uff5cDSML\uff5cfunction_calls>\n<\uff5cDSML\uff5cinvoke name="get_weather">\n'
        '<\uff5cDSML\uff5cparameter name="city" string="true">Paris 🌧</\uff5cDSML\uff5cparameter>\n'
        '</\uff5cDSML\uff5cinvoke>\n</\uff5cDSML\uff5cfunction_calls>'),
    "granite+granite4": (
        {"reasoning_parser": "granite", "tool_call_parser": "granite4"},
        'Here is my thought process:\nplan 😀\nHere is my response:\nSure.\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris 🌧"}}\n</tool_call>\nDone.'),
    "llama4_pythonic": (
        {"tool_call_parser": "llama4_pythonic"},
        '<|python_start|>[get_weather(city="Paris 🌧")]<|python_end|>'),
    "mistral+mistral": (
        {"reasoning_parser": "mistral", "tool_call_parser": "mistral"},
        '[THINK]plan 😀[/THINK]Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris 🌧"}'),
}


def spelled(text: str, rng: random.Random) -> list[int]:
    """Token ids for ``text``: random pieces, each tokenized normally or spelled with single-byte tokens."""
    tok = qwen3_bundle().tokenizer
    table = BYTE_TO_CHAR
    ids, i = [], 0
    while i < len(text):
        j = rng.randint(i + 1, min(len(text), i + 10))
        piece = text[i:j]
        ids += [tok.token_to_id(table[b]) for b in piece.encode()] if rng.random() < 0.5 else encode(piece)
        i = j
    return ids


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(1, min(12, len(ids) - 1))))
    return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_batch_equals_the_fold_of_streamed_chunks_for_random_chunkings(name):
    flags, text = COMBINATIONS[name]
    rng = random.Random(name)  # fixed seed per combination: failures reproduce
    req = chat_request(tools=[WEATHER_TOOL])
    with server(**flags, enable_auto_tool_choice=True) as client:
        spellings = [encode(text)] + [spelled(text, rng) for _ in range(3)]
        for ids in spellings:
            ids = ids + [EOS]
            choice = batch_chat(client, ids, req, request_id="gen-p")["choices"][0]
            want = batch_as_fold(choice)
            assert want["tool_calls"] and want["tool_calls"][0]["name"] == "get_weather", want
            assert want["finish_reason"] == "tool_calls"
            if flags.get("reasoning_parser"):
                assert want["reasoning"] and "think>" not in want["reasoning"]
            for chunks in (one_token_chunks(ids), random_chunks(ids, rng), random_chunks(ids, rng)):
                assert fold_chat_chunks(stream_chat(client, chunks, req, request_id="gen-p")) == want, chunks


# ------------------------------------------------------------------ role, finish, usage, n > 1

TOOL_TEXT = COMBINATIONS["qwen3+hermes"][1]


def counts(usage: dict) -> dict:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_n2_stream_role_first_one_finish_usage_per_chunk_and_final_usage_chunk():
    ids = encode(TOOL_TEXT) + [EOS]
    req = chat_request(tools=[WEATHER_TOOL], n=2, return_token_ids=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks_by_choice: dict[int, list[dict]] = {0: [], 1: []}
    states: dict[int, object] = {0: None, 1: None}
    steps = [ids[i:i + 4] for i in range(0, len(ids), 4)]
    with server(reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True) as client:
        for k, step in enumerate(steps):
            for index in (1, 0):  # interleaved, choice 1 first: indexes come from the engine, not the order
                done = (k + 1) * 4 if k < len(steps) - 1 else len(ids)
                body = {"stream": True, "model": MODEL, "chat_request": req, "prompt_tokens": 11,
                        "stream_state": states[index], "generate_chunk": {
                            "request_id": "gen-n2", "usage": {"prompt_tokens": 5, "completion_tokens": done,
                                                              "total_tokens": 5 + done},
                            "choices": [{"index": index, "token_ids": step,
                                         "finish_reason": "stop" if k == len(steps) - 1 else None}]}}
                answer = post_ok(client, CHAT, body)
                states[index] = answer["stream_state"]
                chunk = answer["chunk"]
                assert [c["index"] for c in chunk["choices"]] == [index]
                # continuous usage: the render tier's prompt_tokens, the engine's completion count
                assert counts(chunk["usage"]) == {"prompt_tokens": 11, "completion_tokens": done,
                                                  "total_tokens": 11 + done}
                assert chunk["choices"][0]["token_ids"] == step
                chunks_by_choice[index].append(chunk)
        final = post_ok(client, CHAT, {
            "stream": True, "model": MODEL, "chat_request": req, "prompt_tokens": 11, "stream_state": None,
            "generate_chunk": {"request_id": "gen-n2", "choices": [],
                               "usage": {"prompt_tokens": 5, "completion_tokens": 2 * len(ids),
                                         "total_tokens": 5 + 2 * len(ids)}}})["chunk"]
        batch = batch_chat(client, ids, req, request_id="gen-n2", n_choices=2)["choices"]
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 11 + 2 * len(ids)
    call_ids = set()
    for index, chunks in chunks_by_choice.items():
        roles = [c["choices"][0]["delta"].get("role") for c in chunks]
        assert roles[0] == "assistant" and not any(roles[1:])
        finishes = [c["choices"][0]["finish_reason"] for c in chunks]
        assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
        fold = fold_chat_chunks(chunks)
        assert fold == batch_as_fold(batch[index])
        assert batch[index]["token_ids"] == ids
        call_ids |= {c["id"] for c in fold["tool_calls"]}
    assert len(call_ids) == 2  # each choice mints its own id


def test_usage_appears_only_where_the_engine_sent_it():
    """include_usage without continuous stats: token chunks carry no usage, the final usage-only chunk does."""
    ids = encode("Hello there") + [EOS]
    with server() as client:
        chunks = stream_chat(client, one_token_chunks(ids), None)
        final = post_ok(client, CHAT, {"stream": True, "model": MODEL, "prompt_tokens": 4, "generate_chunk": {
            "request_id": "gen-1", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": len(ids),
                                                           "total_tokens": 4 + len(ids)}}})["chunk"]
    assert all(c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert fold_chat_chunks(chunks)["content"] == "Hello there"
    assert final["choices"] == [] and counts(final["usage"]) == {"prompt_tokens": 4, "completion_tokens": len(ids),
                                                                 "total_tokens": 4 + len(ids)}
