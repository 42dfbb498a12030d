"""The extend render: the next turn's ids start with the ids the model sampled, on every family we ship.

Rollouts (tests/rollouts.py) hold what a model could really sample but a template re-renders differently:
Python-style booleans and odd JSON in tool-call arguments, reasoning the template drops once a new user message
comes, outputs cut short by ``length``. GLM, MiniMax, Seed, Kimi, Magistral, Llama 4 and Granite use test
tokenizers with the family's real template (tests/family_bundles.py)."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.extend import chat as extend_chat
from render_service.extend.bridge import ExtendImpossible, loop_bridge, template_bridge
from render_service.extend.turns import TextTurns
from render_service.http.errors import ApiError
from render_service.render.chat_prompt import chat_template_inputs
from render_service.render.render import render_chat
from render_service.render.render_config import build_render_config
from render_service.templates.chat_template import ChatTemplate
from render_service.wire.protocol import ChatCompletionRequest, GenerateRequest
from tests import rollouts
from tests.harmony_fixtures import encode as harmony_encode
from tests.harmony_fixtures import gpt_oss_config
from tests.render_harness import QWEN3_DIR, RenderServer, qwen3_config

SYSTEM = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "find cats"}]


class _Configs(dict):
    """Family render configurations, each loaded on first use."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, family: str):
        config = self[family] = rollouts.family_config(family, self.root)
        return config


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return _Configs(tmp_path_factory.mktemp("extend-families"))


def render(config, **fields: Any) -> GenerateRequest:
    fields.setdefault("tool_choice", "none")
    return render_chat(msgspec.convert(fields, ChatCompletionRequest), config)


def extend(config, messages, prompt, completion, check: str = "full", **fields: Any) -> GenerateRequest:
    """The extend of ``prompt`` + ``completion``; ``check: "full"`` compares the whole answer with a full render."""
    turn = {"prompt_token_ids": list(prompt), "completion_token_ids": list(completion), "check": check}
    return render(config, messages=messages, tools=rollouts.TOOLS, previous_turn=turn, **fields)


@pytest.mark.slow  # (building the families' test bundles takes a while the first time)
@pytest.mark.parametrize("truncated", [False, True], ids=["stopped", "length"])
@pytest.mark.parametrize("family", list(rollouts.FAMILIES))
def test_rollout_keeps_the_sampled_ids(configs, family, truncated):
    config = configs[family]
    spec = rollouts.FAMILIES[family]
    prompt = list(render(config, messages=SYSTEM, tools=rollouts.TOOLS).token_ids)
    text, assistant = rollouts.tool_turn(spec, 0, truncated=truncated)
    completion = config.tokenizer.encode(text)
    messages = [*SYSTEM, assistant, rollouts.tool_result("call_1", "3 cats\n")]
    out = extend(config, messages, prompt, completion, return_message_indices=True,
                 return_assistant_tokens_mask=True)
    ids, info = list(out.token_ids), out.extend
    assert info.extended, info.reason
    assert ids[:len(prompt) + len(completion)] == prompt + completion
    assert info.kept_tokens == len(prompt) + len(completion)
    assert len(ids) == info.kept_tokens + info.closing_tokens + info.new_tokens
    # The appended ids are the template's own: the whole render ends with them.
    assert info.suffix_matches_full_render
    whole_render = list(render(config, messages=messages, tools=rollouts.TOOLS).token_ids)
    assert whole_render[len(whole_render) - (len(ids) - info.kept_tokens):] == ids[info.kept_tokens:]
    assert info.matches_full_render is (info.differing_span is None)
    tail = config.tokenizer.decode(ids[info.kept_tokens:], skip_special_tokens=False)
    assert "3 cats" in tail
    if truncated:
        assert info.closing_tokens >= 1 or family in ("glm45", "glm47")  # GLM's turn ends with the next header
    # Masks: the sampled ids are the model's, the tool result is message 3, the generation prompt is message 4.
    mask, indices = out.assistant_tokens_mask, out.message_indices
    assert len(mask) == len(indices) == len(ids)
    assert mask[len(prompt):len(prompt) + len(completion)] == [1] * len(completion)
    assert set(mask[info.kept_tokens:]) == {0}
    assert indices[len(prompt):len(prompt) + len(completion)] == [2] * len(completion)
    assert indices == sorted(indices[:len(prompt)]) + indices[len(prompt):]
    assert indices[-1] >= 3 and 3 in indices[info.kept_tokens:]  # (DeepSeek writes its header with the result)

    # The next turn: an answer with reasoning, then a new user message (templates drop that reasoning later).
    answer, message = rollouts.answer_turn(spec, "There are 3 cats.", reasoning="Counted them.")
    sampled = config.tokenizer.encode(answer)
    more = [*messages, message, {"role": "user", "content": "thanks"}]
    nxt = extend(config, more, ids, sampled, check="suffix")
    assert nxt.extend.extended, nxt.extend.reason
    assert list(nxt.token_ids)[:len(ids) + len(sampled)] == ids + sampled
    # The default check compares the appended ids with a full render's tail cut near the seam, and the whole
    # answer only where they differ: it says what the whole comparison says of the suffix.
    assert nxt.extend.suffix_matches_full_render and nxt.extend.matches_full_render is None
    whole = extend(config, more, ids, sampled)
    assert list(whole.token_ids) == list(nxt.token_ids)
    assert whole.extend.suffix_matches_full_render and whole.extend.matches_full_render is not None
    assert "thanks" in config.tokenizer.decode(list(nxt.token_ids)[len(ids) + len(sampled):],
                                               skip_special_tokens=False)


@pytest.mark.slow  # (building the families' test bundles takes a while the first time)
def test_the_loop_bridge_is_the_probes_on_every_family_whose_loop_is_tracked(configs):
    """The bridge found from the full render's own iterations (one render, what the new turn costs) is the text
    and close the probe's two whole renders find, on every family whose message loop the render tracks, at the
    first sampled turn and at a later one; the others take the probe."""
    tracked = []
    for family, spec in rollouts.FAMILIES.items():
        config = configs[family]
        text, assistant = rollouts.tool_turn(spec, 0)
        answer, message = rollouts.answer_turn(spec, "There are 3 cats.", reasoning="Counted them.")
        first = [*SYSTEM, assistant, rollouts.tool_result("call_1", "3 cats\n")]
        for messages, k in ((first, 2), ([*first, message, {"role": "user", "content": "thanks"}], 4)):
            req = msgspec.convert({"messages": messages, "tools": rollouts.TOOLS, "tool_choice": "none"},
                                  ChatCompletionRequest)
            template, prepared, arguments, _ = chat_template_inputs(req, config, {})
            text_render = extend_chat._render_fn(template)
            by_loop = loop_bridge(template, prepared, arguments, k, template.content_format, 64)
            if by_loop is None:
                continue
            tracked.append((family, k))
            by_probe = template_bridge(text_render, prepared, arguments, k, template.content_format,
                                       extend_chat._end_markers(config))
            assert by_loop.method == "loop" and by_probe.method == "probe", family
            assert (by_loop.text, by_loop.closing_chars) == (by_probe.text, by_probe.closing_chars), (family, k)
            assert by_loop.full_text() == by_probe.full_text() and by_loop.full_chars == len(by_probe.full_text())
            assert by_probe.full_text().endswith(by_loop.window)
    assert ("qwen3", 2) in tracked and ("qwen3", 4) in tracked
    assert len({family for family, _ in tracked}) >= len(rollouts.FAMILIES) // 2, tracked
    # ... and it is the one an extend takes, its answer checked against the whole render.
    config = configs["qwen3"]
    prompt = list(render(config, messages=SYSTEM, tools=rollouts.TOOLS).token_ids)
    text, assistant = rollouts.tool_turn(rollouts.FAMILIES["qwen3"], 1)
    out = extend(config, [*SYSTEM, assistant, rollouts.tool_result("call_1", "3 cats\n")], prompt,
                 config.tokenizer.encode(text))
    assert out.extend.method == "loop" and out.extend.suffix_matches_full_render


def test_an_rl_loop_with_masks_resumes_each_turn_from_the_one_before():
    """Bodies decoded as the render server decodes them (the message memo), the prompt by reference, masks asked on
    every other turn: each extend resumes the template's message loop from the previous turn's render (a masked
    one included: an unmasked turn runs that one render alone) and takes the loop bridge; the answers are those a
    render without any cache gives for the prompt sent as ids."""
    from render_service.render.render_config import load_render_config
    from render_service.wire.message_memo import decode_chat_request

    def decode(body: bytes, kind: type) -> Any:
        return msgspec.json.decode(body, type=kind)

    cached = load_render_config(str(QWEN3_DIR), served_model_names=["m"])
    bare = load_render_config(str(QWEN3_DIR), served_model_names=["m"], render_cache_bytes=0)
    records = cached.template.loop_records
    assert records is not None
    spec = rollouts.FAMILIES["qwen3"]
    masks = {"tools": rollouts.TOOLS, "tool_choice": "none", "return_assistant_tokens_mask": True,
             "return_message_indices": True}
    messages = list(SYSTEM)
    body = msgspec.json.encode({"messages": messages, **masks, "return_prompt_ref": True})
    out = render_chat(decode_chat_request(body, cached.message_memo, decode), cached)
    ids, ref = list(out.token_ids), out.prompt_ref
    for turn in range(1, 5):
        text, assistant = rollouts.tool_turn(spec, turn, call_id=f"call_{turn}")
        completion = cached.tokenizer.encode(text)
        messages += [assistant, rollouts.tool_result(f"call_{turn}", f"{turn} cats\n")]
        asked = masks if turn % 2 == 0 else {"tools": rollouts.TOOLS, "tool_choice": "none"}
        resumed = records.resumed
        body = msgspec.json.encode({"messages": messages, **asked, "return_prompt_ref": True, "previous_turn": {
            "prompt_ref": ref, "completion_token_ids": completion}})
        out = render_chat(decode_chat_request(body, cached.message_memo, decode), cached)
        assert out.extend.extended and out.extend.method == "loop", turn
        assert records.resumed == resumed + 1 if asked is not masks else records.resumed > resumed, turn
        plain = extend(bare, messages, ids, completion, **{k: v for k, v in asked.items() if k.startswith("return")})
        assert list(out.token_ids) == list(plain.token_ids)
        if asked is masks:
            assert list(out.message_indices) == list(plain.message_indices)
            assert list(out.assistant_tokens_mask) == list(plain.assistant_tokens_mask)
        ids, ref = list(out.token_ids), out.prompt_ref


def _agent_conversation(spec: Any, rounds: int) -> list[dict[str, Any]]:
    """A system prompt, a question, then rounds of a tool call and its result, an answer with reasoning and a new
    user message."""
    messages = list(SYSTEM)
    for turn in range(rounds):
        _, assistant = rollouts.tool_turn(spec, turn, call_id=f"call_{turn}")
        _, answer_message = rollouts.answer_turn(spec, f"Found {turn} cats.", reasoning=f"Counted {turn}.")
        messages += [assistant, rollouts.tool_result(f"call_{turn}", f"{turn} cats\n"), answer_message,
                     {"role": "user", "content": f"and {turn + 1}?"}]
    return messages


@pytest.mark.slow  # (building the families' test bundles takes a while the first time)
def test_a_masked_full_render_probes_many_messages_at_once_as_one_at_a_time(configs):
    """A full render with masks finds most messages' own text from a few renders that probe every other message
    (turns.strided_probes): the ids, message indices and assistant mask are those of a render without caches,
    which probes one message at a time, on every family."""
    from render_service.extend.turns import strided_probes

    strided = []
    for family, spec in rollouts.FAMILIES.items():
        config = configs[family]
        bare = build_render_config(config.bundle, served_model_names=["m"], render_cache_bytes=0)
        messages = _agent_conversation(spec, 3)
        answers = [render(c, messages=messages, tools=rollouts.TOOLS, return_assistant_tokens_mask=True,
                          return_message_indices=True) for c in (config, bare)]
        got, want = answers
        assert list(got.token_ids) == list(want.token_ids), family
        assert list(got.message_indices) == list(want.message_indices), family
        assert list(got.assistant_tokens_mask) == list(want.assistant_tokens_mask), family
        req = msgspec.convert({"messages": messages, "tools": rollouts.TOOLS, "tool_choice": "none"},
                              ChatCompletionRequest)
        template, prepared, arguments, _ = chat_template_inputs(req, config, {})
        output = template.render_output(prepared, **arguments)
        if output is not None and not template.marks_generation:
            known = strided_probes(template.render_output, prepared, arguments, output)
            if len(known) >= len(messages) // 2:
                strided.append(family)
    assert "qwen3" in strided and len(strided) >= len(rollouts.FAMILIES) // 3, strided


def test_python_booleans_differ_from_a_full_render_and_the_span_says_where():
    config = qwen3_config()
    prompt = list(render(config, messages=SYSTEM, tools=rollouts.TOOLS).token_ids)
    text, assistant = rollouts.tool_turn(rollouts.FAMILIES["qwen3"], 0)
    completion = config.tokenizer.encode(text)
    out = extend(config, [*SYSTEM, assistant, rollouts.tool_result("call_1", "3")], prompt, completion)
    span = out.extend.differing_span
    assert out.extend.matches_full_render is False
    assert "False" in span.extended_text and "false" in span.full_text
    assert span.start >= len(prompt)


def test_a_turn_the_template_would_write_itself_extends_to_the_full_render():
    """Never silently different: where the sampled turn is what the template writes, extend equals full; where
    the template rewrites it (Qwen3 with thinking off writes an empty think block only in the prompt), the
    answer shows the span."""
    config = qwen3_config()
    prompt = list(render(config, messages=SYSTEM, tools=rollouts.TOOLS).token_ids)
    completion = config.tokenizer.encode('<think>\nhm\n</think>\n\n<tool_call>\n{"name": "search", "arguments": '
                                         '{"q": "cats"}}\n</tool_call><|im_end|>')
    assistant = {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "search", "arguments": '{"q": "cats"}'}}]}
    messages = [*SYSTEM, assistant, rollouts.tool_result("c", "3")]
    out = extend(config, messages, prompt, completion)
    full = render(config, messages=messages, tools=rollouts.TOOLS)
    assert out.extend.matches_full_render and out.extend.differing_span is None
    assert list(out.token_ids) == list(full.token_ids)

    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    prompt = list(render(config, messages=SYSTEM, tools=rollouts.TOOLS, **kwargs).token_ids)
    completion = config.tokenizer.encode("Three.<|im_end|>")
    messages = [*SYSTEM, {"role": "assistant", "content": "Three."}, {"role": "user", "content": "ok"}]
    out = extend(config, messages, prompt, completion, **kwargs)
    assert out.extend.extended and not out.extend.matches_full_render
    assert out.extend.differing_span.extended_text == "<think>\n\n</think>\n\n"
    assert out.extend.differing_span.full_text == ""


# A template that renders a tool result from the turn before it, and the history from the conversation's length.
ENTANGLED = ("{{ messages|length }}\n{% for m in messages %}{{ m.role }}: {{ m.content }}"
             "{% if m.role == 'tool' %}({{ messages[loop.index0 - 1].tool_calls|length }}){% endif %}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}")


def test_a_template_that_rewrites_earlier_turns_cannot_be_extended():
    template = ChatTemplate(ENTANGLED)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [{}]},
                {"role": "tool", "content": "r"}]
    with pytest.raises(ExtendImpossible):
        template_bridge(template.render, messages, {"add_generation_prompt": True}, 1, "string", ["\n"])


def test_fallback_says_why_and_extend_only_refuses():
    config = build_render_config(load_bundle(str(QWEN3_DIR)), served_model_names=["m"],
                                 trust_request_chat_template=True)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x",
                                                    "tool_calls": [{"id": "a", "type": "function",
                                                                    "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "a", "content": "r"}]
    prompt = config.tokenizer.encode("1\nuser: hi\nassistant:")
    completion = config.tokenizer.encode("x<|im_end|>")
    out = extend(config, messages, prompt, completion, chat_template=ENTANGLED)
    assert out.extend.extended is False and out.extend.reason
    assert list(out.token_ids) == list(render(config, messages=messages, chat_template=ENTANGLED).token_ids)
    with pytest.raises(ApiError) as err:
        turn = {"prompt_token_ids": prompt, "completion_token_ids": completion, "mode": "extend_only"}
        render(config, messages=messages, chat_template=ENTANGLED, previous_turn=turn)
    assert err.value.status == 400 and "Cannot extend" in err.value.message


@pytest.mark.parametrize("bad", [-1, "vocab", 2**32, 2**40])
@pytest.mark.parametrize("field", ["prompt_token_ids", "completion_token_ids"])
def test_an_id_outside_the_vocabulary_is_a_400_naming_it(field, bad):
    config = qwen3_config()
    prompt = list(render(config, messages=SYSTEM, tools=rollouts.TOOLS).token_ids)
    completion = config.tokenizer.encode("Three.<|im_end|>")
    bad_id = config.tokenizer.vocab_size if bad == "vocab" else bad
    turn = {"prompt_token_ids": prompt, "completion_token_ids": completion}
    turn[field] = [*turn[field][:3], bad_id, *turn[field][3:]]
    messages = [*SYSTEM, {"role": "assistant", "content": "Three."}, {"role": "user", "content": "ok"}]
    with pytest.raises(ApiError) as err:
        render(config, messages=messages, tools=rollouts.TOOLS, previous_turn=turn)
    assert err.value.status == 400
    assert f"previous_turn.{field}: token id {bad_id} is out of vocabulary" in err.value.message
    turn[field] = [t for t in turn[field] if t != bad_id]  # the same turn without it extends
    assert render(config, messages=messages, tools=rollouts.TOOLS, previous_turn=turn).extend.extended


def test_the_appended_ids_are_attributed_as_a_full_render_attributes_them():
    """The extend probes only the messages from the sampled turn on: the appended ids' message indices and mask
    are the full render's for the same ids, on a conversation of many turns."""
    config = qwen3_config()
    spec = rollouts.FAMILIES["qwen3"]
    messages = list(SYSTEM)
    for turn in range(6):
        _, assistant = rollouts.tool_turn(spec, turn)
        messages += [assistant, rollouts.tool_result(f"call_{turn}", f"{turn} cats\n")]
    prompt = list(render(config, messages=messages, tools=rollouts.TOOLS).token_ids)
    text, assistant = rollouts.tool_turn(spec, 6)
    completion = config.tokenizer.encode(text)
    messages += [assistant, rollouts.tool_result("call_6", "6 cats\n")]
    masks = {"return_message_indices": True, "return_assistant_tokens_mask": True}
    out = extend(config, messages, prompt, completion, **masks)
    full = render(config, messages=messages, tools=rollouts.TOOLS, **masks)
    assert out.extend.extended and out.extend.suffix_matches_full_render
    appended = len(out.token_ids) - out.extend.kept_tokens
    assert list(out.token_ids)[-appended:] == list(full.token_ids)[-appended:]
    assert out.message_indices[-appended:] == full.message_indices[-appended:]
    assert set(out.message_indices[-appended:]) == {len(messages) - 1, len(messages)}  # the result, the prompt
    assert out.assistant_tokens_mask[-appended:] == [0] * appended


def test_a_rollout_with_masks_keeps_every_turns_attribution_even_where_the_template_rewrites_the_sample():
    """Turn two's extend takes turn one's answer as its previous prompt. That prompt holds a sampled call the
    template writes differently (Python-style booleans), so re-rendering cannot attribute it; the answer's own
    attribution, kept for the next turn, can."""
    config = build_render_config(load_bundle(str(QWEN3_DIR)), served_model_names=["m"])
    masks = {"return_message_indices": True, "return_assistant_tokens_mask": True}
    prompt = list(render(config, messages=SYSTEM, tools=rollouts.TOOLS, **masks).token_ids)
    text, assistant = rollouts.tool_turn(rollouts.FAMILIES["qwen3"], 0)  # arguments with True, sampled as such
    completion = config.tokenizer.encode(text)
    messages = [*SYSTEM, assistant, rollouts.tool_result("call_1", "3")]
    first = extend(config, messages, prompt, completion, **masks)
    assert first.extend.extended and not first.extend.matches_full_render  # the template writes `true`
    ids = list(first.token_ids)
    answer, message = rollouts.answer_turn(rollouts.FAMILIES["qwen3"], "There are 3 cats.")
    sampled = config.tokenizer.encode(answer)
    more = [*messages, message, {"role": "user", "content": "thanks"}]
    second = extend(config, more, ids, sampled, **masks)
    assert second.extend.extended
    assert second.message_indices[:len(ids)] == first.message_indices
    assert second.assistant_tokens_mask[:len(ids)] == first.assistant_tokens_mask
    assert -1 not in second.message_indices
    assert second.assistant_tokens_mask[len(ids):len(ids) + len(sampled)] == [1] * len(sampled)

    # The same prompt over other messages is not that answer: re-rendered (and unknown where it cannot be).
    other = [{"role": "system", "content": "You are terse."}, *more[1:]]
    third = extend(config, other, ids, sampled, **masks)
    assert third.message_indices[:len(ids)] == [-1] * len(ids)


def test_full_render_masks_follow_the_messages():
    config = qwen3_config()
    messages = [*SYSTEM, {"role": "assistant", "content": "There are 3 cats."}, {"role": "user", "content": "ok"}]
    out = render(config, messages=messages, return_assistant_tokens_mask=True, return_message_indices=True)
    ids, mask, indices = list(out.token_ids), out.assistant_tokens_mask, out.message_indices
    assert len(ids) == len(mask) == len(indices) and indices == sorted(indices)
    decode = config.tokenizer.decode
    marked = decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert "There are 3 cats." in marked and "find cats" not in marked and "<|im_start|>assistant" not in marked
    for i, needle in enumerate(["You are helpful.", "find cats", "There are 3 cats.", "ok"]):
        assert needle in decode([t for t, j in zip(ids, indices, strict=True) if j == i], skip_special_tokens=False)
    assert decode([t for t, j in zip(ids, indices, strict=True) if j == 4], skip_special_tokens=False) \
        .startswith("<|im_start|>assistant")


@pytest.mark.parametrize("truncated", [False, True], ids=["stopped", "length"])
def test_harmony_rollout_keeps_the_sampled_ids(truncated):
    config = gpt_oss_config()
    prompt = list(render(config, messages=SYSTEM, tools=rollouts.TOOLS).token_ids)
    sampled = ("<|channel|>analysis<|message|>Need search.<|end|><|start|>assistant to=functions.search"
               '<|channel|>commentary <|constrain|>json<|message|>{"q":"cats", "exact": false}')
    completion = harmony_encode(sampled if truncated else sampled + "<|call|>")
    assistant = {"role": "assistant", "content": "", "reasoning_content": "Need search.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "cats"}'}}]}
    messages = [*SYSTEM, assistant, {"role": "tool", "tool_call_id": "c1", "content": "3 cats"}]
    out = extend(config, messages, prompt, completion, return_message_indices=True)
    ids = list(out.token_ids)
    assert out.extend.extended and out.extend.method == "harmony"
    assert ids[:len(prompt) + len(completion)] == prompt + completion
    assert out.extend.suffix_matches_full_render
    assert out.extend.closing_tokens == (1 if truncated else 0)
    tail = config.tokenizer.decode(ids[out.extend.kept_tokens:], skip_special_tokens=False)
    assert tail.endswith("3 cats<|end|><|start|>assistant") and tail.count("<|call|>") == int(truncated)
    assert out.message_indices[-1] == 4 and len(out.message_indices) == len(ids)


def test_extend_over_http_chat_and_messages():
    config = qwen3_config()
    prompt = list(render(config, messages=SYSTEM).token_ids)
    completion = config.tokenizer.encode("<think>\nhm\n</think>\n\nThree.<|im_end|>")
    turn = {"prompt_token_ids": prompt, "completion_token_ids": completion}
    with RenderServer(config) as server:
        body = {"messages": [*SYSTEM, {"role": "assistant", "content": "Three."}, {"role": "user", "content": "ok"}],
                "previous_turn": turn, "return_message_indices": True}
        reply = server.client.post("/v1/chat/completions/render", json=body)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        assert data["token_ids"][:len(prompt) + len(completion)] == prompt + completion
        assert data["extend"]["extended"] is True and len(data["message_indices"]) == len(data["token_ids"])
        messages = {"model": None, "max_tokens": 8, "system": "You are helpful.", "previous_turn": turn,
                    "messages": [{"role": "user", "content": "find cats"}, {"role": "assistant", "content": "Three."},
                                 {"role": "user", "content": "ok"}]}
        reply = server.client.post("/v1/messages/render", json=messages)
        assert reply.status_code == 200, reply.text
        assert reply.json()["token_ids"][:len(prompt) + len(completion)] == prompt + completion
        for bad in ({**turn, "completion_token_ids": [10**9]}, {**turn, "prompt_token_ids": []},
                    {**turn, "surprise": 1}, {**turn, "message_index": 0}):
            reply = server.client.post("/v1/chat/completions/render", json={**body, "previous_turn": bad})
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["message"]


def test_common_prefix_and_suffix_agree_with_the_plain_definition():
    import random

    from render_service.extend.bridge import common_prefix, common_suffix

    def plain_prefix(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(7)
    for _ in range(300):
        base = [rng.randrange(3) for _ in range(rng.randrange(0, 9000))]
        other = list(base)
        for _ in range(rng.randrange(0, 3)):
            if other:
                other[rng.randrange(len(other))] = 9
        other = other[:rng.randrange(len(other) + 1)] if rng.random() < 0.3 else other
        assert common_prefix(base, other) == plain_prefix(base, other)
        assert common_suffix(base, other) == plain_prefix(base[::-1], other[::-1])
        text_a, text_b = "".join(map(str, base)), "".join(map(str, other))
        assert common_prefix(text_a, text_b) == plain_prefix(text_a, text_b)


def test_block_texts_read_as_their_joined_text():
    """Two renders as blocks (shared where a resumed render keeps the record's, split anywhere else): where they
    part and meet again, and a marker's place, are what the joined texts give."""
    import random

    from render_service.extend.bridge import PROBE
    from render_service.extend.turns import BlockText, prefix_and_suffix
    from render_service.templates.loop_resume import LoopOutput

    def blocks_of(text: str, rng: random.Random) -> list[str]:
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 12)))) if text else []
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    def block_text(blocks: list[str]) -> BlockText:
        return BlockText(LoopOutput(blocks, [0], 0, sum(map(len, blocks))))

    rng = random.Random(11)
    for _ in range(400):
        words = [rng.choice(["<|im_end|>", "\n", "ab", "a", "<|im_start|>user", "x" * rng.randrange(1, 5)])
                 for _ in range(rng.randrange(1, 30))]
        i = rng.randrange(len(words))
        full_words = list(words)
        alt_words = [*words[:i], PROBE, *words[i + rng.randrange(0, 2):]]
        shared = blocks_of("".join(words[:i]), rng)  # a resumed render's kept blocks: the same objects
        full = block_text(shared + blocks_of("".join(full_words[i:]), rng))
        alt = block_text(shared + blocks_of("".join(alt_words[i:]), rng))
        full_text, alt_text = "".join(full_words), "".join(alt_words)
        assert full.text() == full_text and len(full) == len(full_text)
        assert prefix_and_suffix(full, alt) == prefix_and_suffix(full_text, alt_text)
        head, tail = prefix_and_suffix(full_text, alt_text)
        assert full_text[:head] == alt_text[:head] and full_text[len(full_text) - tail:] == alt_text[len(alt_text) - tail:]
        start = rng.randrange(len(full_text) + 1)
        stop = rng.randrange(start, len(full_text) + 1)
        assert full.find("<|im_end|>", start, stop) == full_text.find("<|im_end|>", start, stop)


def test_tokens_are_attributed_to_the_message_they_start_in_all_at_once():
    """``TextTurns.attribute`` (every token at once) against the rule a token at a time: the last message starting
    at or before the token, the assistant flag inside that message's own text, the generation prompt after ``end``;
    messages of no text (equal starts) and tokens before the first start included."""
    rng = random.Random(3)
    for _ in range(200):
        count = rng.randint(1, 8)
        starts = sorted(rng.randint(0, 60) for _ in range(count))
        own = [None if rng.random() < 0.4 else s + rng.randint(0, 5) for s in starts]
        own_ends = [(o if o is not None else s) + rng.randint(0, 9) for s, o in zip(starts, own, strict=True)]
        turns = TextTurns(starts, own, rng.randint(40, 80), own_ends)
        base = rng.randint(0, 5)
        token_starts = sorted(rng.randint(0, 90) for _ in range(rng.randint(0, 30)))
        offsets = np.array([(s, s + 1) for s in token_starts], dtype=np.int64).reshape(-1, 2)
        expected_indices, expected_flags = [], []
        for s in token_starts:
            at = s + base
            if at >= turns.end:
                expected_indices.append(count)
                expected_flags.append(0)
                continue
            i = max(0, max((k for k, b in enumerate(starts) if b <= at), default=0))
            expected_indices.append(i)
            expected_flags.append(1 if own[i] is not None and own[i] <= at < own_ends[i] else 0)
        assert turns.attribute(offsets, base) == (expected_indices, expected_flags)


def _harmony_cases() -> list[tuple[str, list[dict[str, Any]], list[int]]]:
    """gpt-oss turns as sampled, each with the messages a client sends after it: (name, messages, sampled ids)."""
    call = {"role": "assistant", "content": "", "reasoning_content": "Need search.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "cats"}'}}]}
    called = harmony_encode("<|channel|>analysis<|message|>Need search.<|end|><|start|>assistant to=functions.search"
                            '<|channel|>commentary <|constrain|>json<|message|>{"q":"cats", "exact": false}<|call|>')
    answer = {"role": "assistant", "content": "Three.", "reasoning_content": "Counted."}
    answered = harmony_encode("<|channel|>analysis<|message|>Counted.<|end|><|start|>assistant<|channel|>final"
                              "<|message|>Three.<|return|>")
    cut = harmony_encode("<|channel|>final<|message|>Thr")
    again = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "search", "arguments": '{"q": "dogs"}'}}]}
    dogs = harmony_encode('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q":"dogs"}<|call|>')
    return [
        ("call cut short", [*SYSTEM, again, {"role": "tool", "tool_call_id": "c2", "content": "0"}], dogs[:-1]),
        ("call, its result", [*SYSTEM, call, {"role": "tool", "tool_call_id": "c1", "content": "3 cats"}], called),
        ("answer with analysis, a user turn", [*SYSTEM, answer, {"role": "user", "content": "and dogs?"}], answered),
        ("answer cut short", [*SYSTEM, {"role": "assistant", "content": "Thr"}, {"role": "user", "content": "?"}],
         cut),
        # a result for the turn before's call: the function's name is the whole conversation's to find
        ("a result for an earlier call", [*SYSTEM, call, {"role": "tool", "tool_call_id": "c1", "content": "3"},
                                          again, {"role": "tool", "tool_call_id": "c1", "content": "late"}], dogs),
    ]


@pytest.mark.parametrize("case", range(5), ids=[name for name, _, _ in _harmony_cases()])
def test_harmony_extend_renders_only_the_turns_messages_and_they_end_the_full_render(case):
    """The extend that renders only the sampled turn's close and the messages after it answers what the extend
    that renders the whole conversation answers, and its appended ids end the full render."""
    config = gpt_oss_config()
    _, messages, sampled = _harmony_cases()[case]
    k = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    fields = {"model": "gpt-oss-tiny", "tool_choice": "auto"}
    prompt = list(render(config, messages=messages[:k], tools=rollouts.TOOLS, **fields).token_ids)
    quick = extend(config, messages, prompt, sampled, check="suffix", **fields)
    whole = extend(config, messages, prompt, sampled, check="full", **fields)
    assert quick.extend.extended and quick.extend.method == "harmony"
    assert list(quick.token_ids) == list(whole.token_ids)
    assert list(quick.token_ids)[:len(prompt) + len(sampled)] == prompt + sampled
    appended = list(quick.token_ids)[quick.extend.kept_tokens:]
    full = list(render(config, messages=messages, tools=rollouts.TOOLS, **fields).token_ids)
    assert full[len(full) - len(appended):] == appended and quick.extend.suffix_matches_full_render
    # only the whole conversation's render compares the whole answer; the quick one is taken but for the late result
    assert (quick.extend.matches_full_render is None) == (case != 4)
    if case <= 1:  # a call cut short is closed as the full render closes a call
        assert quick.extend.closing_tokens == 1 - case
    assert whole.extend.matches_full_render is not None


def test_harmony_extend_still_refuses_a_bad_earlier_message():
    """The quick extend renders nothing before the sampled turn, but what the request sent there is still converted:
    a part gpt-oss cannot take is the 400 a full render gives."""
    config = gpt_oss_config()
    _, messages, sampled = _harmony_cases()[1]
    fields = {"model": "gpt-oss-tiny", "tool_choice": "auto"}
    prompt = list(render(config, messages=messages[:2], tools=rollouts.TOOLS, **fields).token_ids)
    bad = [messages[0], {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, *messages[2:]]
    with pytest.raises(ApiError) as refused:
        extend(config, bad, prompt, sampled, check="suffix", **fields)
    assert refused.value.status == 400 and "messages[1]" in refused.value.message


def _harmony_prefix_attribution(config, messages: list[dict[str, Any]], ids: list[int]) -> list[int]:
    """Each message's ids as what rendering the messages up to it adds to rendering those before it."""
    indices: list[int] = []
    for i in range(len(messages)):
        head = list(render(config, model="gpt-oss-tiny", messages=messages[:i + 1], tools=rollouts.TOOLS).token_ids)
        assert head[:-2][:len(indices)] == ids[:len(indices)]  # (each head is the start of the whole render)
        indices += [i] * (len(head) - 2 - len(indices))
    return indices + [len(messages)] * (len(ids) - len(indices))


def test_harmony_masks_attribute_each_message_as_rendering_the_conversation_up_to_it_does():
    """The masks of a full Harmony render come from one pass over the conversation's Harmony messages. Where every
    head of the conversation renders as the start of the whole (no turn's analysis dropped by a later answer), they
    equal the attribution by renders of every head; where a later answer drops an earlier turn's analysis, each
    message's ids still decode to its own text, in order."""
    config = gpt_oss_config()
    decode = config.tokenizer.decode
    call = {"role": "assistant", "content": "Looking.", "reasoning_content": "Need search.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "cats"}'}}]}
    heads_are_prefixes = [
        [*SYSTEM, {"role": "assistant", "content": "Three.", "reasoning_content": "Counted."},
         {"role": "user", "content": "and dogs?"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}],
    ]
    dropped = [*SYSTEM, call, {"role": "tool", "tool_call_id": "c1", "content": "3 cats"},
               {"role": "assistant", "content": "Three.", "reasoning_content": "Read it."},
               {"role": "user", "content": "ok"}, {"role": "system", "content": "Be brief."},
               {"role": "user", "content": "dogs?"}]
    for messages in [*heads_are_prefixes, dropped]:
        out = render(config, model="gpt-oss-tiny", messages=messages, tools=rollouts.TOOLS,
                     return_message_indices=True, return_assistant_tokens_mask=True)
        ids, indices = list(out.token_ids), out.message_indices
        assistant = {i for i, m in enumerate(messages) if m["role"] == "assistant"}
        assert out.assistant_tokens_mask == [1 if i in assistant else 0 for i in indices]
        assert indices == sorted(indices) and indices[-1] == len(messages)
        if messages is not dropped:
            assert indices == _harmony_prefix_attribution(config, messages, ids)
            continue
        texts = {i: decode([t for t, at in zip(ids, indices, strict=True) if at == i], skip_special_tokens=False)
                 for i in range(len(messages))}
        whole = decode(ids, skip_special_tokens=False)
        assert "Need search." not in whole and "Read it." not in whole  # (analysis before the last answer: dropped)
        for i, message in enumerate(messages):
            assert message["content"] in texts[i], i
        assert '{"q": "cats"}' in texts[2] and "Be brief." in texts[6]


def test_a_harmony_rollout_sent_whole_checks_each_earlier_message_once():
    """A gpt-oss rollout that sends the whole conversation every turn (through the message memo, as the server
    decodes it) has its earlier messages converted once, by the first turn that sends them (their memo entries say
    so), and answers every turn as the same rollout sending only its new messages; an earlier message edited into
    one gpt-oss cannot take is a new message, refused with the 400 a full render gives."""
    from render_service.harmony.render import CONVERTS
    from render_service.wire.message_memo import decode_chat_request

    config = gpt_oss_config()

    def from_body(body: dict[str, Any]) -> tuple[ChatCompletionRequest, GenerateRequest]:
        req = decode_chat_request(msgspec.json.encode(body), config.message_memo,
                                  lambda data, kind: msgspec.json.decode(data, type=kind))
        return req, render_chat(req, config)

    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Question 0?"}]
    for n in range(1, 5):
        messages += [{"role": "assistant", "content": f"Answer {n}.", "reasoning_content": f"Thought {n}."},
                     {"role": "user", "content": f"Question {n}?"}]
    fields = {"model": "gpt-oss-tiny", "tools": rollouts.TOOLS, "tool_choice": "none", "return_prompt_ref": True}
    answers = {}
    for mode in ("all", "new"):
        ref = from_body({"messages": messages[:2], **fields})[1].prompt_ref
        answers[mode] = []
        for k in range(2, len(messages), 2):
            sampled = harmony_encode(f"<|channel|>final<|message|>{messages[k]['content']}<|return|>")
            turn = {"prompt_ref": ref, "completion_token_ids": sampled, "answer": "appended", "messages": mode}
            sent = messages[:k + 2] if mode == "all" else messages[k:k + 2]
            req, out = from_body({"messages": sent, **fields, "previous_turn": turn})
            assert out.extend is not None and out.extend.extended
            answers[mode].append(list(out.token_ids))
            ref = out.prompt_ref
            if mode == "all":  # every message before the sampled turn was checked, by this turn or an earlier one
                assert all(CONVERTS in entry.checks for entry in req.messages.entries[1:k])
    assert answers["all"] == answers["new"]

    bad = [*messages[:3], {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
           *messages[4:6]]
    prompt = list(render(config, messages=messages[:4], tools=rollouts.TOOLS, tool_choice="none").token_ids)
    sampled = harmony_encode("<|channel|>final<|message|>Answer 2.<|return|>")
    turn = {"prompt_token_ids": prompt, "completion_token_ids": sampled, "answer": "appended"}
    with pytest.raises(ApiError) as refused:
        from_body({"messages": bad, **fields, "previous_turn": turn})
    assert refused.value.status == 400 and "messages[3]" in refused.value.message
