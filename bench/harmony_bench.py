"""gpt-oss (Harmony) next to Qwen3 (chat template + qwen3/hermes parsers), in one run, in-process.

Render: CPU per request of ``render_chat`` for the same conversations on both bundles (one turn; a tools
conversation with a call and its result; a ~2k-token user message); for gpt-oss also with the system/developer
cache cold, and openai-harmony's own Python path (pydantic messages -> ``render_conversation_for_completion``,
what vLLM runs).

Streaming derender: CPU per token of one-token chunks through the pipeline (reasoning, then content, then
one tool call), and per chunk of the streaming derender handler echoing ``stream_state`` as a client does;
for gpt-oss also openai-harmony's StreamableParser per token. Times are process CPU (time.process_time),
the median of ``--rounds`` rounds.

    .venv/bin/python -m bench.harmony_bench [--rounds 5] [--tokens 1000]

Results: bench/results/harmony_bench.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import msgspec

from bench.portable import write_result
from bench.shared_fixtures import QWEN3_DIR
from render_service.bundle.model_bundle import load_bundle
from render_service.derender.batch import pipeline_config
from render_service.derender.stream import StreamRuntime, derender_chat_stream
from render_service.harmony.bundle import gpt_oss_bundle_dir
from render_service.harmony.encoding import CALL, START, harmony_encoding
from render_service.harmony.render import renderer_for
from render_service.parsers.pipeline import Pipeline
from render_service.render.render import render_chat
from render_service.render.render_config import build_render_config
from render_service.wire.protocol import ChatCompletionRequest, DerenderChatStreamRequest

ROOT = Path(__file__).resolve().parent.parent
QWEN = QWEN3_DIR
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
CALL_1 = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
         "whiskey", "xray", "yankee", "zulu"]


def _text(words: int) -> str:
    return " ".join(WORDS[(i * 7) % len(WORDS)] + str(i % 13) for i in range(words))


CONVERSATIONS = {
    "one_turn": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    "tools_turns": {"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL_1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        {"role": "user", "content": "And in London?"}], "tools": [WEATHER]},
    "long_user": {"messages": [{"role": "user", "content": _text(900)}]},
}


def _cpu(fn, repeat: int, rounds: int) -> float:
    """Median over rounds of CPU seconds per call."""
    samples = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(repeat):
            fn()
        samples.append((time.process_time() - start) / repeat)
    return statistics.median(samples)


def openai_harmony_render(body: dict, encoding) -> list[int]:
    """vLLM's path: pydantic Harmony messages, then openai-harmony's renderer (dates pinned)."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = SystemContent.new().with_conversation_start_date("2026-12-01")
    messages = [Message.from_role_and_content(Role.SYSTEM, system)]
    chat = list(body["messages"])
    dev = DeveloperContent.new()
    if chat[0]["role"] == "system":
        dev = dev.with_instructions(chat.pop(0)["content"])
    if body.get("tools"):
        dev = dev.with_function_tools([ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                                           t["function"]["parameters"]) for t in body["tools"]])
    if dev.instructions or dev.tools:
        messages.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    for m in chat:
        if m["role"] == "tool":
            messages.append(Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"),
                                                            m["content"]).with_channel("commentary")
                            .with_recipient("assistant"))
        elif m["role"] == "assistant" and m.get("tool_calls"):
            messages.append(Message.from_role_and_content(Role.ASSISTANT, m["tool_calls"][0]["function"]["arguments"])
                            .with_channel("commentary").with_recipient("functions.get_weather")
                            .with_content_type("json"))
        elif m["role"] == "assistant":
            messages.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("final"))
        else:
            messages.append(Message.from_role_and_content(Role.USER, m["content"]))
    return encoding.render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)


def outputs(tokens: int, qwen_tok, oss_tok) -> dict[str, list[int]]:
    """~``tokens``-token replies of the same shape: reasoning, content, one tool call, the stop token."""
    third = max(1, tokens // 3)
    reasoning, content = _text(third), _text(third)
    qwen = qwen_tok.encode(f"<think>\n{reasoning}\n</think>\n\n{content}\n<tool_call>\n"
                           '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') + [151645]
    oss = oss_tok.encode(f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>"
                         f"commentary<|message|>{content}<|end|><|start|>assistant<|channel|>commentary "
                         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}') + [CALL]
    return {"qwen3": qwen, "gpt-oss": oss}


def pipeline_per_token(config, ids: list[int], prompt: list[int], rounds: int) -> float:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[WEATHER])
    pipeline = Pipeline(config.tokenizer, pipeline_config(config, req, request_id="b", choice_index=0))

    def run():
        state = pipeline.initial_state(prompt)
        for t in ids:
            pipeline.feed(state, [t])
        pipeline.finish(state)

    return _cpu(run, 1, rounds) / len(ids)


def handler_per_chunk(config, ids: list[int], prompt: list[int], rounds: int, chunks: int = 200) -> float:
    runtime = StreamRuntime(secret="bench")
    chat = {"model": config.model_name, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    ids = ids[:chunks]

    def run():
        state = None
        for i, t in enumerate(ids):
            body = {"stream": True, "generate_chunk": {"request_id": "b", "choices": [
                {"index": 0, "token_ids": [t], "finish_reason": "stop" if i == len(ids) - 1 else None}]},
                "stream_state": state, "chat_request": chat, "prompt_token_ids": prompt}
            out = derender_chat_stream(msgspec.convert(body, DerenderChatStreamRequest), config, runtime)
            state = out.stream_state

    return _cpu(run, 1, rounds) / len(ids)


GROWING_WAYS = (("texts_encoded_each_turn", False, False), ("texts_kept", True, False),
                ("turn_records", True, True))


def growing_turns(config, sizes: list[int], last: int = 16) -> list[dict]:
    """Thread CPU ms per turn of a growing chat conversation of about each size (each turn adds an answer and a
    user message; the body through the message memo, as the server decodes it, and the answer's JSON written), its
    last ``last`` turns, three ways: every text encoded each turn (the renderer's ``keeps_texts`` and
    ``keeps_turns`` off), the message texts' ids kept (harmony/kept_texts.py), and each turn extending the turn
    before's record (harmony/turn_records.py, as shipped). Each way is a conversation of its own (its system prompt
    tells them apart) in one process, and every turn's ids equal the first way's."""
    from bench.extend_bench import _chat_conversation, body_renderer

    renderer = renderer_for(config.tokenizer)
    from_body = body_renderer(config)
    rows = []
    for size in sizes:
        messages = _chat_conversation(size)
        ends = [i for i in range(2, len(messages) + 1) if messages[i - 1]["role"] == "user"][-last - 1:]
        row: dict = {"size": size, "messages": len(messages)}
        answers: dict[str, list[int]] = {}
        for way, keeps_texts, keeps_turns in GROWING_WAYS:
            renderer.keeps_texts, renderer.keeps_turns = keeps_texts, keeps_turns
            conversation = [{**messages[0], "content": f"{messages[0]['content']} ({way})"}, *messages[1:]]
            spent = []
            for k, end in enumerate(ends):
                body = msgspec.json.encode({"model": "gpt-oss", "messages": conversation[:end]})
                started = time.thread_time()
                answer = from_body(body)
                if k:  # (the first turn of each way: nothing of it seen before)
                    spent.append((time.thread_time() - started) * 1e3)
                ids = msgspec.json.decode(answer)["token_ids"]
                # (the ways' instructions differ: their ids are compared from the first user message on, the
                # third message after the system and developer ones)
                third = [i for i, token in enumerate(ids) if token == START][2]
                answers.setdefault(way, []).append(hash(tuple(ids[third:])))  # (ids kept would slow the renders)
                del ids
            row[f"{way}_ms_median"] = round(statistics.median(spent), 3)
        renderer.keeps_texts = renderer.keeps_turns = True
        assert len({json.dumps(tails) for tails in answers.values()}) == 1, "the ways rendered different ids"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=50, help="renders per round")
    ap.add_argument("--tokens", type=int, default=1000, help="reply length for the derender runs")
    ap.add_argument("--growing", default="", help="only the turns of growing chat conversations of these sizes "
                                                  "(tokens, e.g. 32768,131072), texts' ids kept and not")
    ap.add_argument("--out", default=str(ROOT / "bench/results/harmony_bench.json"))
    args = ap.parse_args(argv)

    qwen = build_render_config(load_bundle(QWEN), served_model_names=["qwen3"], reasoning_parser="qwen3",
                               tool_call_parser="hermes", enable_auto_tool_choice=True)
    oss = build_render_config(load_bundle(gpt_oss_bundle_dir()), served_model_names=["gpt-oss"],
                              tool_call_parser="openai", enable_auto_tool_choice=True)
    if args.growing:
        long = build_render_config(dataclasses.replace(load_bundle(gpt_oss_bundle_dir()), max_model_len=262144),
                                   served_model_names=["gpt-oss"], tool_call_parser="openai",
                                   enable_auto_tool_choice=True)
        rows = growing_turns(long, [int(size) for size in args.growing.split(",")])
        write_result(Path(args.out), {"command": "python -m bench.harmony_bench " + " ".join(
            argv if argv is not None else sys.argv[1:]), "growing_turns": rows})
        return 0
    encoding = harmony_encoding(oss.tokenizer)
    result: dict = {"machine": platform.machine(), "python": platform.python_version(),
                    "command": "python -m bench.harmony_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "conditions": "shared 2-core box (other sessions running); CPU times in one process, both "
                                  "models in the same run, so read the ratios",
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
                    "render_us": {}, "prompt_tokens": {}, "derender": {}}
    for name, body in CONVERSATIONS.items():
        kwargs = {"chat_template_kwargs": {"conversation_start_date": "2026-12-01"}}
        reqs = {"qwen3": ChatCompletionRequest(model="qwen3", **body),
                "gpt-oss": ChatCompletionRequest(model="gpt-oss", **body, **kwargs)}
        row = {}
        for model, config in (("qwen3", qwen), ("gpt-oss", oss)):
            req = reqs[model]
            result["prompt_tokens"].setdefault(name, {})[model] = len(render_chat(req, config).token_ids)
            row[model] = _cpu(lambda req=req, config=config: render_chat(req, config), args.repeat, args.rounds) * 1e6
        cache = renderer_for(oss.tokenizer)._cached

        def cold(cache=cache, req=reqs["gpt-oss"]):
            cache.cache_clear()  # a system/developer message not seen before
            render_chat(req, oss)

        row["gpt-oss (preamble cache cold)"] = _cpu(cold, args.repeat, args.rounds) * 1e6
        row["openai-harmony (vLLM's path)"] = _cpu(lambda body=body: openai_harmony_render(body, encoding),
                                                   args.repeat, args.rounds) * 1e6
        row["gpt-oss / qwen3"] = row["gpt-oss"] / row["qwen3"]
        row["openai-harmony / ours"] = row["openai-harmony (vLLM's path)"] / row["gpt-oss"]
        result["render_us"][name] = row
    replies = outputs(args.tokens, qwen.tokenizer, oss.tokenizer)
    one = CONVERSATIONS["one_turn"]
    prompts = {"qwen3": render_chat(ChatCompletionRequest(model="qwen3", **one), qwen).token_ids,
               "gpt-oss": render_chat(ChatCompletionRequest(model="gpt-oss", **one), oss).token_ids}
    from openai_harmony import Role, StreamableParser

    def harmony_parser_run():
        parser = StreamableParser(encoding, role=Role.ASSISTANT)
        for t in replies["gpt-oss"]:
            parser.process(t)

    for model, config in (("qwen3", qwen), ("gpt-oss", oss)):
        ids = replies[model]
        result["derender"][model] = {
            "reply_tokens": len(ids),
            "pipeline_us_per_token": pipeline_per_token(config, ids, prompts[model], args.rounds) * 1e6,
            "stream_handler_us_per_chunk": handler_per_chunk(config, ids, prompts[model], args.rounds) * 1e6,
        }
    result["derender"]["openai-harmony StreamableParser_us_per_token"] = (
        _cpu(harmony_parser_run, 1, args.rounds) / len(replies["gpt-oss"]) * 1e6)
    d = result["derender"]
    d["gpt-oss / qwen3 pipeline"] = d["gpt-oss"]["pipeline_us_per_token"] / d["qwen3"]["pipeline_us_per_token"]
    d["gpt-oss / qwen3 handler"] = (d["gpt-oss"]["stream_handler_us_per_chunk"]
                                    / d["qwen3"]["stream_handler_us_per_chunk"])
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result(Path(args.out), result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
