"""Exact multi-turn tokens: breaks over synthetic RL rollouts, full re-render against extend, and CPU per turn.

breaks  --rollouts agent rollouts on Qwen3 (hermes tool calls) and gpt-oss (Harmony), each a few turns whose
        sampled text a model could really write but a template re-renders differently: Python-style booleans,
        odd spacing and key order in tool-call JSON, reasoning the template drops once a user message follows,
        outputs cut by ``length``. A break: the next turn's prompt does not start with the previous prompt and
        the sampled completion, byte for byte. Counted for the full re-render (the next prompt rendered from the
        messages alone) and for the extend render (``previous_turn``); an extend that fell back counts as a
        break too.
cpu     one agent conversation (bench/agent_trace.py) grown to about --sizes tokens; the last turn rendered
        both ways in this process from its request body (decoded through the message memo, as the render
        server decodes it), thread CPU per render (median of --reps, each after the previous turn's request,
        with the piece cache as an agent loop leaves it, the answer written to JSON as the server writes it):
        the full render (also with loss masks), the extend render of the same turn with the previous prompt sent as ids
        (``extend``) and named by the reference its render answered (``extend_by_ref``), each also with loss
        masks after a previous turn that asked for them too (as an RL loop asks), by reference answering
        the appended ids alone (``extend_by_ref_appended``), and that sending only the messages from the
        sampled turn on (``extend_by_ref_new_messages``: ``previous_turn.messages: "new"``); each also with the
        chat template's loop records off (``*_without_loop_records``).

agents  (--agents 1,8) growing agent conversations (bench/agent_trace.py), one or several interleaved, each body
        sent to our render server (full render, then the same turn as an extend of ours' previous answer) and to
        vllm-rs (``vllm-rs render``, the Rust render server in vLLM 0.34's wheel); server CPU per render from the
        process trees' schedstat (bench/agent_render_bench.py's TreeCpu), turns whose prompt is in (size/2, size].

rollouts (--rollout-sizes 8192,32768,131072) the last --rollout-turns turns of a conversation of each size as an RL
        loop sends them, each by the previous turn's reference, answering the appended ids: the whole conversation
        sent, or only the messages from the sampled turn on; whole rollouts over every size and way in one
        rotation; thread CPU per turn in this process (median over --rollout-rounds rollouts each).

answers (--answers 32768,131072) the last turn of one conversation extended by reference through our render
        server, answering the whole prompt's ids (``previous_turn.answer: "full"``) or the appended ones alone
        ("appended"), and the appended ones for a request holding only the messages from the sampled turn on
        ("new_messages": ``previous_turn.messages: "new"``), in rotating order; server CPU per render (process
        tree schedstat) and latency, median of 9 each.

usage: python -m bench.extend_bench [--rollouts 300] [--sizes 8192,32768,131072] [--reps 7] [--out FILE]
                                    [--agents 1,8 --agent-sizes 32768,131072] [--answers 32768,131072]
                                    [--rollout-sizes 8192,32768,131072 --rollout-turns 8 --rollout-rounds 8]
Results: bench/results/extend_bench.json (or --out). Figures are ratios inside one run: the box is shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bench.agent_trace import AgentTraceSpec, agent_trace
from bench.portable import write_result
from bench.shared_fixtures import QWEN3_DIR
from render_service.bundle.model_bundle import load_bundle
from render_service.http.request_io import encode_json
from render_service.render.render import render_chat
from render_service.render.render_config import RenderConfig, build_render_config
from render_service.wire.protocol import ChatCompletionRequest

RESULTS = Path(__file__).resolve().parent / "results"
FIXTURE = QWEN3_DIR

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the files.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "exact": {"type": "boolean"},
                                                    "limit": {"type": "integer"}}, "required": ["q"]}}}]
# (as the model wrote the arguments, as the client parsed them)
ARGUMENTS = [('{"exact": False,  "q": "cats"}', {"q": "cats", "exact": False}),
             ('{ "q":"cats","limit" :3 }', {"q": "cats", "limit": 3}),
             ('{"q": "cats", "exact": true}', {"q": "cats", "exact": True}),
             ('{"limit": 10, "q": "cats dogs"}', {"q": "cats dogs", "limit": 10}),
             ('{"q": "cats"}', {"q": "cats"})]


def _render(config: RenderConfig, **fields: Any) -> list[int]:
    fields.setdefault("tool_choice", "none")
    gen = render_chat(msgspec.convert(fields, ChatCompletionRequest), config)
    return list(gen.token_ids)


def _extend(config: RenderConfig, messages: list[dict[str, Any]], prompt: list[int], completion: list[int]
            ) -> tuple[list[int], bool]:
    fields = {"messages": messages, "tools": TOOLS, "tool_choice": "none",
              "previous_turn": {"prompt_token_ids": prompt, "completion_token_ids": completion}}
    gen = render_chat(msgspec.convert(fields, ChatCompletionRequest), config)
    return list(gen.token_ids), bool(gen.extend and gen.extend.extended)


def _qwen_turn(rng: random.Random, turn: int, last: bool) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """(sampled text, parsed assistant message, the messages that follow it) for one Qwen3 turn."""
    reasoning = rng.choice(["Let me look.", "I should search first.", None])
    think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else "<think>\n\n</think>\n\n"
    if last:
        answer = rng.choice(["There are 3 cats.", "Done: 2 files match.", "Nothing found."])
        text = think + answer + "<|im_end|>"
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        follow = [{"role": "user", "content": rng.choice(["thanks", "and dogs?", "ok"])}]
    else:
        raw, parsed = rng.choice(ARGUMENTS)
        truncated = rng.random() < 0.15
        call = f'<tool_call>\n{{"name": "search", "arguments": {raw}}}\n</tool_call>'
        text = think + call + ("" if truncated else "<|im_end|>")
        if truncated:
            text = text[:-9]  # cut inside the call by max_tokens
        call_id = f"call_{turn}"
        message = {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "search", "arguments": json.dumps(parsed)}}]}
        follow = [{"role": "tool", "tool_call_id": call_id, "content": rng.choice(["3 cats", "[]", "a.txt\nb.txt"])}]
    if reasoning:
        message["reasoning_content"] = reasoning
    return text, message, follow


def _harmony_turn(rng: random.Random, turn: int, last: bool) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    reasoning = rng.choice(["Need to search.", "Check files."])
    analysis = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant"
    if last:
        answer = rng.choice(["There are 3 cats.", "Nothing found."])
        text = analysis + f"<|channel|>final<|message|>{answer}<|return|>"
        message: dict[str, Any] = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
        return text, message, [{"role": "user", "content": "thanks"}]
    raw, parsed = rng.choice(ARGUMENTS)
    text = analysis + f" to=functions.search<|channel|>commentary <|constrain|>json<|message|>{raw}<|call|>"
    call_id = f"call_{turn}"
    message = {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "search", "arguments": json.dumps(parsed)}}]}
    return text, message, [{"role": "tool", "tool_call_id": call_id, "content": rng.choice(["3 cats", "[]"])}]


def breaks(configs: dict[str, RenderConfig], rollouts: int, turns: int = 3) -> dict[str, Any]:
    """Per family: rollouts, turn seams, breaks with the full re-render and with extend, extend fallbacks."""
    out: dict[str, Any] = {}
    for family, config in configs.items():
        make = _harmony_turn if config.harmony else _qwen_turn
        rng = random.Random(f"extend-bench/{family}")
        seams = full_breaks = extend_breaks = fallbacks = broken_rollouts = 0
        count = rollouts // len(configs)
        for _ in range(count):
            messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."},
                                              {"role": "user", "content": "find cats"}]
            prompt = _render(config, messages=messages, tools=TOOLS)
            broke = False
            for turn in range(turns):
                text, message, follow = make(rng, turn, turn == turns - 1)
                completion = config.tokenizer.encode(text)
                messages = [*messages, message, *follow]
                kept = prompt + completion
                full = _render(config, messages=messages, tools=TOOLS)
                extended, ok = _extend(config, messages, prompt, completion)
                seams += 1
                if full[:len(kept)] != kept:
                    full_breaks += 1
                    broke = True
                if not ok:
                    fallbacks += 1
                if extended[:len(kept)] != kept:
                    extend_breaks += 1
                prompt = extended
            broken_rollouts += broke
        out[family] = {"rollouts": count, "seams": seams, "full_rerender_breaks": full_breaks,
                       "full_rerender_broken_rollouts": broken_rollouts, "extend_breaks": extend_breaks,
                       "extend_fallbacks": fallbacks}
    return out


def _conversation(size: int, config: RenderConfig) -> list[dict[str, Any]]:
    """Agent-trace messages whose render is about ``size`` tokens, ending with a round's tool results."""
    messages, _ = agent_trace(dataclasses.replace(AgentTraceSpec(), rounds=1500, reasoning=False,
                                                       result_chars=(300, 2400)))
    end = 3
    chars = 0
    for i in range(len(messages)):
        chars += len(json.dumps(messages[i]))
        if i >= 3 and messages[i]["role"] == "tool" and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool"):
            if chars // 4 > size:
                break
            end = i + 1
    return messages[:end]


def _chat_conversation(size: int, seed: int | None = None, system: str = "You answer questions about serving.",
                       reasoning: bool = False) -> list[dict[str, Any]]:
    """A chat (a system prompt, then user and assistant turns of a few hundred words each) whose render is about
    ``size`` tokens, ending with a user turn: every turn moves the template's last user turn. ``seed``: another
    conversation of that size; ``reasoning``: each answer carries a few dozen words of it (counted in the size)."""
    rng = random.Random(size if seed is None else seed)
    words = ("the render keeps ids for each turn so that a trainer sees what was sampled and the template writes "
             "around it while the engine decodes in batches on another pool").split()

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    chars = 0
    while chars // 4 < size or messages[-1]["role"] != "user":
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": text(60, 320)})
        elif reasoning:
            messages.append({"role": "assistant", "content": text(60, 320), "reasoning": text(10, 60)})
        else:
            messages.append({"role": "assistant", "content": text(60, 320)})
        chars += len(messages[-1]["content"]) + len(messages[-1].get("reasoning", ""))
    return messages


def _thread_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.thread_time()
        fn()
        times.append((time.thread_time() - start) * 1000)
    return statistics.median(times)


def _turn_ms(from_body: Any, records: Any, before: bytes, body: bytes) -> float:
    """Thread CPU ms of ``body``'s render, sent as an agent sends it: after its previous turn's request (which
    leaves the template's loop records as that turn leaves them)."""
    if records is not None:
        records.clear()
        from_body(before)
    start = time.thread_time()
    from_body(body)
    return (time.thread_time() - start) * 1000


def body_renderer(config: RenderConfig) -> Callable[[bytes], bytes]:
    """A chat render from the request body to the answer's JSON, as the render server runs it: the body decoded
    through the message memo (a turn's earlier messages are the memo's objects, so the template's loop records
    apply), the answer written as the server writes it."""
    from render_service.wire.message_memo import decode_chat_request

    def decode(body: bytes, kind: type) -> Any:
        return msgspec.json.decode(body, type=kind)

    def from_body(body: bytes) -> bytes:
        return encode_json(render_chat(decode_chat_request(body, config.message_memo, decode), config,
                                       ids_view=True))

    return from_body


def api_body_renderer(config: RenderConfig, api: str, memo: bool = True) -> Callable[[bytes], bytes]:
    """An Anthropic Messages (``api`` "messages") or Responses ("responses") render from the request body to the
    answer's JSON, as the render server runs it: through the message memo and the body store (a Messages message
    converted to chat messages once; a growing body's shared items converted once); without ``memo``, decoded and
    converted whole, the baseline the memo is measured against."""
    from render_service.apis.message_memo_anthropic import decode_messages_request
    from render_service.apis.message_memo_responses import decode_responses_request
    from render_service.apis.messages import render_messages
    from render_service.apis.messages_protocol import MessagesRequest
    from render_service.apis.responses import render_responses
    from render_service.apis.responses_protocol import ResponsesRequest

    kind, through_memo, render = {"messages": (MessagesRequest, decode_messages_request, render_messages),
                                  "responses": (ResponsesRequest, decode_responses_request, render_responses)}[api]

    def from_body(body: bytes) -> bytes:
        req = (through_memo(body, config.message_memo) if memo else None) or msgspec.json.decode(body, type=kind)
        generate, _ = render(req, config, ids_view=True)
        return encode_json(generate)

    return from_body


def _as_responses_api(body: dict[str, Any]) -> dict[str, Any]:
    """A chat render body (text messages only) as a Responses one: the system prompt as its instructions, the other
    messages as message items, written first as clients write them (Codex: instructions, then input; OpenAI's SDK
    puts input before the other fields), the per-turn fields after them."""
    out: dict[str, Any] = {}
    messages = body["messages"]
    if messages and messages[0]["role"] == "system":
        out["instructions"], messages = messages[0]["content"], messages[1:]
    out["input"] = [{"type": "message", "role": m["role"], "content": m["content"]} for m in messages]
    return {**out, **{key: value for key, value in body.items() if key not in ("tools", "tool_choice", "messages")}}


def _as_messages_api(body: dict[str, Any]) -> dict[str, Any]:
    """A chat render body (text messages only) as a Messages one: the system prompt apart, ``max_tokens`` set."""
    out = {key: value for key, value in body.items() if key not in ("tools", "tool_choice")}
    messages = body["messages"]
    if messages and messages[0]["role"] == "system":
        out["system"], messages = messages[0]["content"], messages[1:]
    return {**out, "messages": messages, "max_tokens": 8}


def cpu(config: RenderConfig, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Each request body decoded as the render server decodes it (through the message memo, so a turn's earlier
    messages are the memo's objects and the template's loop records apply), and timed from the body on, after
    the previous turn sent the same way (an RL loop's steady state): the full render (with masks too) after the
    previous turn's full render (likewise), an extend by ids after that turn's extend by ids with masks (whose
    attribution the masked one takes), an extend by reference after that turn's extend by reference (with masks
    where the timed turn has them). The same turn is also timed with the template's loop records off
    (``*_without_loop_records``)."""
    from_body = body_renderer(config)

    def answer(body: bytes) -> Any:
        return msgspec.json.decode(from_body(body))

    template = config.template
    records = template.loop_records
    encode = msgspec.json.encode
    masks = {"return_assistant_tokens_mask": True, "return_message_indices": True}
    rows = []
    for size in sizes:
        messages = _conversation(size, config)
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        k, k_before = assistants[-1], assistants[-2]
        completion = config.tokenizer.encode(_sampled_text(messages[k]))
        completion_before = config.tokenizer.encode(_sampled_text(messages[k_before]))
        plain = {"tools": TOOLS, "tool_choice": "none"}
        # the turn before the previous one, as an RL loop renders it: masks asked for, its prompt kept by reference
        first = answer(encode({"messages": messages[:k_before], **plain, **masks, "return_prompt_ref": True}))
        previous_turn = {"prompt_ref": first["prompt_ref"], "completion_token_ids": completion_before}
        previous_ids = {"prompt_token_ids": first["token_ids"], "completion_token_ids": completion_before}
        # the previous turn, each way it may be sent (the reference answered here is the timed turns')
        before = {
            "full": encode({"messages": messages[:k], **plain}),
            "full_masks": encode({"messages": messages[:k], **plain, **masks}),
            "by_ids_masks": encode({"messages": messages[:k], **plain, **masks, "previous_turn": previous_ids}),
            "by_ref": encode({"messages": messages[:k], **plain, "previous_turn": previous_turn}),
            "by_ref_masks": encode({"messages": messages[:k], **plain, **masks, "previous_turn": previous_turn}),
            "by_ref_new": encode({"messages": messages[k_before:k], **plain,
                                  "previous_turn": {**previous_turn, "messages": "new"}}),
        }
        head = answer(encode({**msgspec.json.decode(before["by_ref_masks"]), "return_prompt_ref": True}))
        prompt, ref = head["token_ids"], head["prompt_ref"]
        assert head["extend"]["extended"], head["extend"]
        full_body = {"messages": messages, **plain}
        ext_body = {**full_body, "previous_turn": {"prompt_token_ids": prompt, "completion_token_ids": completion}}
        ref_body = {**full_body, "return_prompt_ref": True,
                    "previous_turn": {"prompt_ref": ref, "completion_token_ids": completion}}
        appended = {**ref_body, "previous_turn": {**ref_body["previous_turn"], "answer": "appended"}}
        new_only = {**appended, "messages": messages[k:],
                    "previous_turn": {**appended["previous_turn"], "messages": "new"}}
        # (each timed body, and the previous turn's body it is sent after)
        bodies = {"full_render": (encode(full_body), before["full"]),
                  "full_render_with_masks": (encode({**full_body, **masks}), before["full_masks"]),
                  "extend": (encode(ext_body), before["by_ids_masks"]),
                  "extend_with_masks": (encode({**ext_body, **masks}), before["by_ids_masks"]),
                  "extend_by_ref": (encode(ref_body), before["by_ref"]),
                  "extend_by_ref_with_masks": (encode({**ref_body, **masks}), before["by_ref_masks"]),
                  "extend_by_ref_appended": (encode(appended), before["by_ref"]),
                  "extend_by_ref_new_messages": (encode(new_only), before["by_ref_new"])}
        ids = answer(bodies["full_render"][0])["token_ids"]  # warm: the piece cache as an agent loop leaves it
        assert answer(before["by_ids_masks"])["token_ids"] == prompt  # (its attribution, as that answer filed it)
        ext = answer(bodies["extend"][0])
        assert ext["extend"]["extended"], ext["extend"]
        masked = answer(bodies["extend_with_masks"][0])
        assert -1 not in masked["message_indices"]  # the kept attribution
        for name in ("extend_by_ref", "extend_by_ref_with_masks"):  # the same answer as the ids give
            by_ref = answer(bodies[name][0])
            assert by_ref["token_ids"] == ext["token_ids"], name
            assert "masks" not in name or by_ref["message_indices"] == masked["message_indices"], name
        short = answer(bodies["extend_by_ref_appended"][0])  # the same answer's tail: the ids after the kept ones
        assert short["token_ids"] == ext["token_ids"][short["extend"]["kept_tokens"]:]
        assert answer(bodies["extend_by_ref_new_messages"][0])["token_ids"] == short["token_ids"]
        row: dict[str, Any] = {"size": size, "prompt_tokens": len(ids), "messages": len(messages),
                               "body_bytes": len(bodies["extend"][0]),
                               "body_bytes_by_ref": len(bodies["extend_by_ref"][0]),
                               "body_bytes_new_messages": len(bodies["extend_by_ref_new_messages"][0]),
                               "new_tokens": ext["extend"]["new_tokens"] + ext["extend"]["closing_tokens"],
                               "extend_method": ext["extend"]["method"]}

        for name, (body, previous) in bodies.items():
            for label, kept in (("", records), ("_without_loop_records", None)):
                template.loop_records = kept
                row[f"{name}_ms{label}"] = statistics.median(_turn_ms(from_body, records, previous, body)
                                                             for _ in range(reps))
            template.loop_records = records
        row["extend_over_full"] = row["extend_ms"] / row["full_render_ms"]
        row["extend_by_ref_over_full"] = row["extend_by_ref_ms"] / row["full_render_ms"]
        row["extend_by_ref_appended_over_full"] = row["extend_by_ref_appended_ms"] / row["full_render_ms"]
        row["extend_by_ref_new_messages_over_full"] = row["extend_by_ref_new_messages_ms"] / row["full_render_ms"]
        rows.append(row)
    return rows


def rollout_cpu(config: RenderConfig, sizes: list[int], turns: int, rounds: int, shape: str = "agent",
                api: str = "chat", api_memo: bool = True) -> list[dict[str, Any]]:
    """The last ``turns`` turns of a conversation of about each size, as an RL loop sends them: each turn by the
    reference the turn before answered, answering the appended ids alone, sending the whole conversation
    (``whole``) or only the messages from the sampled turn on (``new_messages``). Whole rollouts, each from a
    fresh full render, take turns in one rotation over the sizes and the two ways (``rounds`` of each pair, the
    order shifted every round), so that figures compare across sizes as well as ways; thread CPU per turn from
    the body to the answer's JSON (each rollout's first extend, which follows the full render, left out: every
    figure is a turn after a turn sent the same way). ``shape``: ``agent`` (tool calls and results: a turn adds
    the sampled call and its results) or ``chat`` (a turn adds the sampled answer and the next user message).
    ``api``: ``chat`` (Chat Completions bodies), ``messages`` (Anthropic Messages bodies) or ``responses``
    (Responses bodies); the last two, the chat shape only, and without ``api_memo`` decoded and converted whole
    (their memo's baseline)."""
    if (api != "chat" or config.harmony) and shape != "chat":
        raise ValueError("Messages, Responses and Harmony rollouts take the chat shape (text turns)")
    from_body = body_renderer(config) if api == "chat" else api_body_renderer(config, api, api_memo)
    # (what the model samples for an assistant message: Harmony's final answer, else Qwen3's turn)
    sampled_text = _harmony_final_text if config.harmony else _sampled_text
    as_api = {"chat": dict, "messages": _as_messages_api, "responses": _as_responses_api}[api]

    def encode(body: dict[str, Any]) -> bytes:
        return msgspec.json.encode(as_api(body))

    plain = {"tools": TOOLS, "tool_choice": "none"}
    modes = ("whole", "new_messages")
    conversations = {}
    for size in sizes:
        messages = _conversation(size, config) if shape == "agent" else _chat_conversation(size)
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        sampled = [assistants[i] for i in range(max(0, len(assistants) - turns - 1), len(assistants))]
        conversations[size] = (messages, sampled,
                               {k: config.tokenizer.encode(sampled_text(messages[k])) for k in sampled})
    pairs = [(size, mode) for size in sizes for mode in modes]
    timed: dict[tuple[int, str], list[float]] = {pair: [] for pair in pairs}
    answers: dict[tuple[int, str], list[Any]] = {}
    rollout = 0
    for round_ in range(rounds):
        for size, mode in pairs[round_ % len(pairs):] + pairs[:round_ % len(pairs)]:
            messages, sampled, completions = conversations[size]
            rollout += 1
            # each rollout its own conversation, as a trainer's are: the system prompt tells them apart (the
            # messages after it are the memo's shared objects, as in GRPO groups)
            messages[0] = {**messages[0], "content": f"{messages[0]['content']} ({rollout})"}
            ref = msgspec.json.decode(from_body(encode({"messages": messages[:sampled[0]], **plain,
                                                        "return_prompt_ref": True})))["prompt_ref"]
            answers[size, mode] = []
            for at, k in enumerate(sampled):
                end = sampled[at + 1] if at + 1 < len(sampled) else len(messages)
                turn = {"prompt_ref": ref, "completion_token_ids": completions[k], "answer": "appended"}
                body = {"messages": messages[:end], **plain, "return_prompt_ref": True, "previous_turn": turn}
                if mode == "new_messages":
                    body["messages"], turn["messages"] = messages[k:end], "new"
                data = encode(body)
                start = time.thread_time()
                out = from_body(data)
                if at:
                    timed[size, mode].append((time.thread_time() - start) * 1000)
                answer = msgspec.json.decode(out)
                ref = answer["prompt_ref"]
                answers[size, mode].append(answer["token_ids"])
    rows = []
    for size in sizes:
        # (the appended ids: the system prompts differ, what is appended does not)
        assert answers[size, "whole"] == answers[size, "new_messages"]
        row: dict[str, Any] = {"size": size, "shape": shape, "api": api, "harmony": config.harmony,
                               "messages": len(conversations[size][0]),
                               "turns": len(conversations[size][1]) - 1}
        for mode in modes:
            row[f"{mode}_ms_median"] = statistics.median(timed[size, mode])
            row[f"{mode}_ms_mean"] = statistics.mean(timed[size, mode])
        row["new_messages_over_whole"] = row["new_messages_ms_median"] / row["whole_ms_median"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=300)
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", default=str(FIXTURE))
    ap.add_argument("--no-harmony", action="store_true")
    ap.add_argument("--agents", default="", help="also agent loops against vllm-rs: agent counts (e.g. 1,8)")
    ap.add_argument("--agent-sizes", default="32768,131072")
    ap.add_argument("--answers", default="", help="also the two answer modes through the render server: sizes")
    ap.add_argument("--rollout-sizes", default="", help="also rollouts sent whole or as new messages: sizes")
    ap.add_argument("--rollout-turns", type=int, default=8)
    ap.add_argument("--rollout-rounds", type=int, default=8)
    ap.add_argument("--rollout-shape", choices=["agent", "chat"], default="agent",
                    help="agent: turns add tool calls and results; chat: turns add an answer and a user message")
    ap.add_argument("--rollout-api", choices=["chat", "messages", "responses"], default="chat",
                    help="the rollouts' request bodies: Chat Completions, Anthropic Messages or Responses (the last "
                         "two, chat shape only)")
    ap.add_argument("--rollout-plain-decode", action="store_true",
                    help="Messages and Responses bodies decoded and converted whole, without the message memo (the "
                         "baseline it is measured against)")
    ap.add_argument("--rollout-model", choices=["qwen3", "gpt-oss"], default="qwen3",
                    help="the rollouts' model: Qwen3 (the chat template) or gpt-oss (Harmony; chat shape only)")
    ap.add_argument("--out", default=str(RESULTS / "extend_bench.json"))
    args = ap.parse_args(argv)
    bundle = load_bundle(args.model)
    bundle = dataclasses.replace(bundle, max_model_len=max(bundle.max_model_len, 262144))
    qwen = build_render_config(bundle, served_model_names=["m"])
    configs = {"qwen3": qwen}
    if not args.no_harmony:
        from render_service.harmony.bundle import gpt_oss_bundle_dir

        configs["gpt-oss"] = build_render_config(load_bundle(str(gpt_oss_bundle_dir())), served_model_names=["m"])
    result: dict[str, Any] = {}
    if args.rollouts:
        result["breaks"] = breaks(configs, args.rollouts)
        print(json.dumps(result["breaks"]), flush=True)
    if args.sizes:
        result["cpu"] = cpu(qwen, [int(s) for s in args.sizes.split(",")], args.reps)
        print(json.dumps(result["cpu"]), flush=True)
    if args.answers:
        result["answers"] = answer_modes(qwen, [int(s) for s in args.answers.split(",")])
        print(json.dumps(result["answers"]), flush=True)
    if args.rollout_sizes:
        rolled = qwen
        if args.rollout_model == "gpt-oss":
            from render_service.harmony.bundle import gpt_oss_bundle_dir

            oss = load_bundle(str(gpt_oss_bundle_dir()))
            rolled = build_render_config(dataclasses.replace(oss, max_model_len=262144), served_model_names=["m"])
        result["rollouts"] = rollout_cpu(rolled, [int(s) for s in args.rollout_sizes.split(",")], args.rollout_turns,
                                         args.rollout_rounds, args.rollout_shape, args.rollout_api,
                                         not args.rollout_plain_decode)
    if args.agents:
        result["agent_loops"] = agent_loops([int(s) for s in args.agent_sizes.split(",")],
                                            [int(a) for a in args.agents.split(",")], _vllm_rs())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(args.out), result)
    print(json.dumps(result, indent=2))
    return 0



# ------------------------------------------------------------------ the answer's two modes, through the server


def answer_modes(config: RenderConfig, sizes: list[int], reps: int = 9) -> list[dict[str, Any]]:
    """The last turn of a conversation of about ``size`` tokens, extended by the reference of its previous turn
    (made just before, each time), answered whole or as the appended ids alone, and the latter with only the
    messages from the sampled turn on, in rotating order."""
    import httpx

    from bench import agent_render_bench as arb
    from bench import peers

    max_len = max(sizes) * 2
    model = arb.long_context_model(max_len)
    port = peers.free_port()
    pid = arb.start_ours(model, port, Path(os.environ.get("TMPDIR", "/tmp")) / "extend-answers.log", None, max_len)
    rows = []
    try:
        url = f"http://127.0.0.1:{port}"
        peers.wait_healthy(url, pid)
        client, cpu = httpx.Client(base_url=url, timeout=600), arb.TreeCpu(pid)
        encode = msgspec.json.encode
        for size in sizes:
            messages = _conversation(size, config)
            k = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            before = encode({"model": arb.MODEL, "messages": messages[:k], "tools": TOOLS, "tool_choice": "none",
                             "return_prompt_ref": True})
            completion = config.tokenizer.encode(_sampled_text(messages[k]))
            modes = ["full", "appended", "new_messages"]
            timed: dict[str, list[tuple[float, float, int]]] = {mode: [] for mode in modes}
            for rep in range(reps):
                for mode in modes[rep % 3:] + modes[:rep % 3]:
                    ref = client.post(arb.RENDER_PATH, content=before,
                                      headers={"content-type": "application/json"}).json()["prompt_ref"]
                    turn = {"prompt_ref": ref, "completion_token_ids": completion,
                            "answer": "full" if mode == "full" else "appended"}
                    sent = messages
                    if mode == "new_messages":
                        turn["messages"], sent = "new", messages[k:]
                    body = encode({"model": arb.MODEL, "messages": sent, "tools": TOOLS, "tool_choice": "none",
                                   "previous_turn": turn})
                    timed[mode].append(arb.measure(client, cpu, body))
            row: dict[str, Any] = {"size": size, "messages": len(messages)}
            for mode, values in timed.items():
                row[f"{mode}_cpu_ms_median"] = statistics.median(v[0] for v in values)
                row[f"{mode}_latency_ms_median"] = statistics.median(v[1] for v in values)
                row[f"{mode}_answer_ids"] = values[0][2]
            row["appended_over_full_cpu"] = row["appended_cpu_ms_median"] / row["full_cpu_ms_median"]
            row["new_messages_over_full_cpu"] = row["new_messages_cpu_ms_median"] / row["full_cpu_ms_median"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        peers.stop_tree(pid)
    return rows


# ------------------------------------------------------------------ agent loops: ours against vllm-rs, one run



def _sampled_text(message: dict[str, Any]) -> str:
    """What a Qwen3 model samples for an agent-trace assistant message (hermes tool calls, its end marker)."""
    calls = "".join(f'\n<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}'
                    "\n</tool_call>" for c in message.get("tool_calls") or [])
    return (message.get("content") or "") + calls + "<|im_end|>"


def _harmony_final_text(message: dict[str, Any]) -> str:
    """What gpt-oss samples for a chat turn's text answer (its final channel, then ``<|return|>``)."""
    return f"<|channel|>final<|message|>{message.get('content') or ''}<|return|>"


def _vllm_rs() -> Path:
    """vLLM 0.34's Rust render server, as bench/peers.py finds it ($SPLITSERVE_VLLM_RS, else bench/.peers/)."""
    from bench import peers

    binary = peers.vllm_rs_binary()
    if binary is None:
        raise SystemExit("--agents needs vllm-rs: set $SPLITSERVE_VLLM_RS to the binary in vLLM 0.34's wheel")
    return binary


def agent_loops(sizes: list[int], agents: list[int], vllm_rs: Path, seed: int = 0) -> list[dict[str, Any]]:
    """Server CPU per render of growing agent conversations (turns whose prompt is in (size/2, size]) sent in
    turn to ours (full render), ours (extend: previous_turn from ours' previous answer) and vllm-rs."""
    import httpx

    from bench import agent_render_bench as arb
    from bench import peers
    from bench.agent_trace import chat_body

    max_len = max(sizes) * 2
    model = arb.long_context_model(max_len)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    ours_port, rs_port = peers.free_port(), peers.free_port()
    pids = {"ours": arb.start_ours(model, ours_port, logs / "extend-ours.log", None, max_len)}
    with open(logs / "extend-vllm-rs.log", "wb") as handle:
        import subprocess

        pids["vllm-rs"] = subprocess.Popen(
            [str(vllm_rs), "render", str(model), "--port", str(rs_port), "--host", "127.0.0.1",
             "--served-model-name", arb.MODEL, "--max-model-len", str(max_len), "--reasoning-parser", "qwen3",
             "--tool-call-parser", "hermes"],  # (vllm-rs takes no --enable-auto-tool-choice)
            stdout=handle, stderr=subprocess.STDOUT).pid
    rows = []
    try:
        urls = {"ours": f"http://127.0.0.1:{ours_port}", "vllm-rs": f"http://127.0.0.1:{rs_port}"}
        for name, url in urls.items():
            peers.wait_healthy(url, pids[name])
        clients = {name: httpx.Client(base_url=url, timeout=600) for name, url in urls.items()}
        cpus = {name: arb.TreeCpu(pid) for name, pid in pids.items()}
        tokenizer = load_bundle(str(model)).tokenizer
        for size in sizes:
            for count in agents:
                traces = []
                for a in range(count):
                    spec = AgentTraceSpec(seed=seed + a)
                    messages, tools, ends = arb.trace_to(
                        size, seed + a, spec, lambda m, t: sum(len(json.dumps(x)) for x in m) // 4)
                    traces.append((messages, tools, ends))
                timed: dict[str, list[float]] = {"ours": [], "ours_extend": [], "vllm-rs": []}
                previous: list[list[int] | None] = [None] * count
                turns = max(len(t[2]) for t in traces)
                for turn in range(turns):
                    for a, (messages, tools, ends) in enumerate(traces):
                        if turn >= len(ends):
                            continue
                        end = ends[turn]
                        body = chat_body(arb.MODEL, messages[:end], tools)
                        raw = json.dumps(body).encode()
                        try:
                            full_ms, _, n = arb.measure(clients["ours"], cpus["ours"], raw)
                        except httpx.HTTPStatusError:  # past the context window: the agent's trace ends here
                            continue
                        rs_ms, _, _ = arb.measure(clients["vllm-rs"], cpus["vllm-rs"], raw)
                        ext_ms = None
                        if previous[a] is not None and turn > 0:
                            k = max(i for i in range(end) if messages[i]["role"] == "assistant")
                            completion = tokenizer.encode(_sampled_text(messages[k]))
                            ext = dict(body, previous_turn={"prompt_token_ids": previous[a],
                                                            "completion_token_ids": completion})
                            ext_ms, _, _ = arb.measure(clients["ours"], cpus["ours"], json.dumps(ext).encode())
                        answer = clients["ours"].post(arb.RENDER_PATH, content=raw,
                                                      headers={"content-type": "application/json"}).json()
                        previous[a] = answer["token_ids"]
                        if size // 2 < n <= size:
                            timed["ours"].append(full_ms)
                            timed["vllm-rs"].append(rs_ms)
                            if ext_ms is not None:
                                timed["ours_extend"].append(ext_ms)
                row: dict[str, Any] = {"size": size, "agents": count}
                for name, values in timed.items():
                    row[f"{name}_ms_median"] = statistics.median(values) if values else None
                    row[f"{name}_renders"] = len(values)
                if row["vllm-rs_ms_median"] and row["ours_ms_median"]:
                    row["ours_over_vllm_rs"] = row["ours_ms_median"] / row["vllm-rs_ms_median"]
                    if row["ours_extend_ms_median"]:
                        row["extend_over_vllm_rs"] = row["ours_extend_ms_median"] / row["vllm-rs_ms_median"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for pid in pids.values():
            peers.stop_tree(pid)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
