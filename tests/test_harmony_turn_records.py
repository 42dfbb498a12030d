"""gpt-oss turns rendered from the turn before's record (harmony/turn_records.py): every turn of a growing
conversation decoded through the message memo renders openai-harmony's ids (the reference of
tests/test_harmony_render.py), rendering only its new messages where the record applies and whole where it does not."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import msgspec
import pytest

from render_service.harmony.render import HarmonyRenderer, renderer_for
from render_service.harmony.turn_records import Part, turn_records
from render_service.http.errors import ApiError
from render_service.render.render import render_chat
from render_service.tokenize.incremental_tokenizer import PromptIds
from render_service.wire.message_memo import decode_chat_request
from render_service.wire.protocol import ChatCompletionRequest
from tests.harmony_fixtures import DATE, MODEL, gpt_oss_config
from tests.render_harness import RenderServer
from tests.test_harmony_render import SEARCH, WEATHER, reference_ids


def _call(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def agent_turns(tag: str) -> list[list[dict[str, Any]]]:
    """The messages each turn of an agent loop adds (``tag`` tells loops apart): calls with reasoning and a
    preamble, parallel calls and their results, answers with reasoning (which drop the analysis before them), user
    turns, an answer without reasoning, a call without reasoning."""
    turns: list[list[dict[str, Any]]] = [[
        {"role": "system", "content": f"You plan trips ({tag}) and check the weather before any plan."},
        {"role": "user", "content": "Plan a weekend in Lisbon, and find the museums open on Sunday."}]]
    for n in range(3):
        turns.append([
            {"role": "assistant", "content": "Checking the forecast and the museums." if n == 1 else None,
             "reasoning": f"Round {n}: the weather decides indoor or outdoor, so look both up at once.",
             "tool_calls": [_call(f"w{n}", "get_weather", city="Lisbon"), _call(f"s{n}", "search", query="museums")]},
            {"role": "tool", "tool_call_id": f"w{n}", "content": f"Forecast {n}: sunny, 24 degrees, a light wind."}])
        turns.append([{"role": "tool", "tool_call_id": f"s{n}",
                       "content": f"Museums {n}: Gulbenkian and MAAT open on Sundays from ten to six."}])
        turns.append([{"role": "assistant", "reasoning": f"One more: the tram times for round {n}.",
                       "tool_calls": [_call(f"t{n}", "search", query="tram 28")]},
                      {"role": "tool", "tool_call_id": f"t{n}", "content": "Every twelve minutes."}])
        turns.append([{"role": "assistant", "content": f"Plan {n}: the old town by tram 28, then the Gulbenkian.",
                       "reasoning": "Sunny with museums open: mix both." if n != 1 else None},
                      {"role": "user", "content": "Now a rainy version." if n < 2 else "Thanks!"}])
    return turns


def _body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"messages": copy.deepcopy(messages), "tools": [WEATHER, SEARCH], **extra}


def _through_memo(config, body: dict[str, Any]) -> ChatCompletionRequest:
    """The body decoded as the render server decodes it (its messages the memo's shared objects)."""
    kwargs = {**(body.get("chat_template_kwargs") or {}), "conversation_start_date": DATE}
    raw = msgspec.json.encode({"model": MODEL, **body, "chat_template_kwargs": kwargs})
    return decode_chat_request(raw, config.message_memo, lambda data, kind: msgspec.json.decode(data, type=kind))


def _render(config, body: dict[str, Any]):
    return render_chat(_through_memo(config, body), config, ids_view=True).token_ids


def test_an_agent_loop_renders_only_each_turns_new_messages():
    config = gpt_oss_config()
    records = turn_records(config.tokenizer)
    assert records is not None and renderer_for(config.tokenizer).turns_proved
    messages: list[dict[str, Any]] = []
    for turn, added in enumerate(agent_turns("only new")):
        messages += added
        body = _body(messages)
        before = records.extended
        ids = _render(config, body)
        assert ids == reference_ids(body), turn
        if turn:  # (the first render is the plain one: a list)
            assert isinstance(ids, PromptIds)
            assert json.loads(bytes(ids.json_array())) == ids.tolist()
        # the first turn renders whole; every later one extends the record of the turn before
        assert records.extended - before == (1 if turn else 0), turn


def test_the_same_body_twice_extends_its_own_record():
    config = gpt_oss_config()
    records = turn_records(config.tokenizer)
    assert records is not None
    body = _body([m for added in agent_turns("twice")[:3] for m in added])
    first = _render(config, body)
    before = records.extended
    assert _render(config, body) == first == reference_ids(body)
    assert records.extended - before == 1


def test_conversations_that_end_in_the_same_message_each_extend_their_own_record():
    """Rollouts of one task that a harness follows up with the same message: each conversation's record is kept
    beside the others' (one length, one last message object) and each next turn extends its own."""
    config = gpt_oss_config()
    records = turn_records(config.tokenizer)
    assert records is not None
    task = [{"role": "system", "content": "Solve it step by step."}, {"role": "user", "content": "What is 17 * 23?"}]
    more = {"role": "user", "content": "Continue."}
    rollouts = [[*task, {"role": "assistant", "content": f"Attempt {n}: 17 * 20 = 340.",
                         "reasoning": f"Split it, way {n}."}, more] for n in range(3)]
    for messages in rollouts:
        assert _render(config, _body(messages)) == reference_ids(_body(messages))
    for n, messages in enumerate(rollouts):
        messages += [{"role": "assistant", "content": f"Attempt {n}: 340 + 51 = 391."}, more]
        before = records.extended
        assert _render(config, _body(messages)) == reference_ids(_body(messages))
        assert records.extended - before == 1, n


@pytest.mark.parametrize("change", ["call id of another function", "earlier message edited", "reasoning effort",
                                    "no records"])
def test_turns_the_record_cannot_serve_render_whole(change):
    config = gpt_oss_config()
    records = turn_records(config.tokenizer)
    assert records is not None
    turns = agent_turns(change)
    messages = [m for added in turns[:5] for m in added]
    extra: dict[str, Any] = {}
    _render(config, _body(messages))
    if change == "call id of another function":
        # w0 named get_weather; a new call w0 to search renames the earlier result (the later call wins)
        messages += [{"role": "assistant", "tool_calls": [_call("w0", "search", query="rain")]},
                     {"role": "tool", "tool_call_id": "w0", "content": "Showers."}]
    elif change == "earlier message edited":
        messages[1] = {**messages[1], "content": "Plan a weekend in Porto instead."}
        messages += turns[5]
    elif change == "reasoning effort":
        extra = {"reasoning_effort": "high"}
        messages += turns[5]
    before = records.extended
    renderer = renderer_for(config.tokenizer)
    renderer.keeps_turns = change != "no records"
    try:
        body = _body(messages, **extra)
        assert list(_render(config, body)) == reference_ids(body)
    finally:
        renderer.keeps_turns = True
    assert records.extended == before


def test_a_later_instructions_message_in_a_loop_with_tools_extends():
    config = gpt_oss_config()
    records = turn_records(config.tokenizer)
    assert records is not None
    turns = agent_turns("later instructions")
    messages = [m for added in turns[:3] for m in added]
    _render(config, _body(messages))
    messages += [{"role": "system", "content": "From now on, metric units only."}, *turns[3]]
    before = records.extended
    body = _body(messages)
    assert _render(config, body) == reference_ids(body)
    assert records.extended - before == 1


def test_instructions_opening_a_conversation_without_tools_extend():
    """No tools and no instructions first: the system message alone is the preamble, so the instructions message
    after it opens the conversation (the plain render renders the two as its head; a record keeps it as a part)."""
    config = gpt_oss_config()
    records = turn_records(config.tokenizer)
    assert records is not None
    turns = agent_turns("instructions without tools")
    messages: list[dict[str, Any]] = [{"role": "system", "content": ""},
                                      {"role": "system", "content": "Answer in Portuguese."}]
    for turn, added in enumerate([turns[0][1:], [{"role": "assistant", "content": "Claro."},
                                                 {"role": "user", "content": "Obrigado."}]]):
        messages += added
        body = {"messages": copy.deepcopy(messages)}
        before = records.extended
        assert _render(config, body) == reference_ids(body), turn
        assert records.extended - before == turn


def test_a_bad_new_message_gets_the_plain_renders_error():
    config = gpt_oss_config()
    turns = agent_turns("bad message")
    messages = [m for added in turns[:4] for m in added]
    _render(config, _body(messages))
    for bad in ({"role": "narrator", "content": "meanwhile"},
                {"role": "assistant", "tool_calls": [{"id": "x", "type": "function", "function": "oops"}]},
                {"role": "assistant", "tool_calls": [{"id": {"not": "a string"}, "type": "function",
                                                      "function": {"name": "search", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": ["x"], "content": "a result"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}):
        errors = []
        for keeps in (True, False):
            renderer_for(config.tokenizer).keeps_turns = keeps
            try:
                with pytest.raises(ApiError) as err:
                    _render(config, _body([*messages, bad]))
            finally:
                renderer_for(config.tokenizer).keeps_turns = True
            errors.append((err.value.status, err.value.message, err.value.param))
        assert errors[0] == errors[1] and errors[0][0] == 400, bad


class _DroppingEndMarkers(HarmonyRenderer):
    """A renderer whose turn path differs from its plain path: its parts lose their end markers."""

    def parts(self, messages: list[dict[str, Any]]) -> list[Part]:
        return [Part(part.ids[:-1], part.json.rsplit(b",", 1)[0], part.analysis, part.final)
                for part in super().parts(messages)]


def test_the_load_proof_turns_the_records_off_where_turns_would_differ():
    config = gpt_oss_config()
    assert renderer_for(config.tokenizer).turns_proved
    broken = _DroppingEndMarkers(config.tokenizer)
    assert not broken.turns_proved
    # and a renderer not proved renders whole, filing nothing
    records = turn_records(config.tokenizer)
    assert records is not None
    filed = len(records.lru)
    body = _body(agent_turns("unproved")[0])
    ids = broken.render_turn(_through_memo(config, body), {"conversation_start_date": DATE}, True)
    assert type(ids) is list and ids == reference_ids(body)
    assert len(records.lru) == filed


def _series(text: str, cache: str, result: str) -> float:
    found = re.search(rf'^splitserve_render_cache_lookups_total{{cache="{cache}",result="{result}"}} (\S+)$', text,
                      re.M)
    return float(found.group(1)) if found else 0.0


def test_over_http_each_turn_renders_the_reference_and_metrics_count_the_records():
    config = gpt_oss_config()
    messages: list[dict[str, Any]] = []
    with RenderServer(config) as server:
        hits = _series(server.client.get("/metrics").text, "harmony_turns", "hit")
        turns = agent_turns("over http")
        for added in turns:
            messages += added
            body = _body(messages)
            resp = server.client.post("/v1/chat/completions/render", json={
                "model": MODEL, **body, "chat_template_kwargs": {"conversation_start_date": DATE}})
            assert resp.status_code == 200, resp.text
            assert resp.json()["token_ids"] == reference_ids(body)
        after = _series(server.client.get("/metrics").text, "harmony_turns", "hit")
    assert after - hits >= len(turns) - 1


def test_an_anthropic_messages_conversation_extends_its_records():
    """A Messages body of 32 KiB and more is filed with the chat messages its messages converted to (the body
    store), so a growing Messages conversation hands the Harmony renderer the same message objects every turn."""
    import dataclasses

    from render_service.apis.message_memo_anthropic import decode_messages_request
    from render_service.apis.messages import render_messages
    from render_service.apis.messages_protocol import MessagesRequest
    from render_service.render.render_config import build_render_config
    from tests.harmony_fixtures import gpt_oss_bundle

    config = build_render_config(dataclasses.replace(gpt_oss_bundle(), max_model_len=65536),
                                 served_model_names=[MODEL], reasoning_parser="openai_gptoss")
    records = turn_records(config.tokenizer)
    renderer = renderer_for(config.tokenizer)
    assert records is not None
    words = "the tower stands by the river and the tram climbs the hill past the old museum".split()
    messages: list[dict[str, Any]] = []
    extended = []
    for turn in range(4):
        if messages:
            messages.append({"role": "assistant", "content": " ".join(words[(turn + i) % 16] for i in range(300))})
        messages.append({"role": "user", "content": " ".join(words[(turn * i) % 16] for i in range(3000))})
        raw = msgspec.json.encode({"model": MODEL, "max_tokens": 16, "system": "Be brief.", "messages": messages,
                                   "metadata": {"user_id": "a"}})
        before = records.extended
        ids = render_messages(decode_messages_request(raw, config.message_memo), config, ids_view=True)[0].token_ids
        extended.append(records.extended - before)
        renderer.keeps_turns = False
        try:
            plain = render_messages(msgspec.json.decode(raw, type=MessagesRequest), config)[0]
        finally:
            renderer.keeps_turns = True
        assert list(ids) == plain.token_ids, turn
    assert extended == [0, 1, 1, 1]


def test_records_under_one_key_stay_within_the_largest_entry():
    """Records that share a key are kept together only while together they fit the cache's largest entry: the
    oldest go first, and a record too large to keep at all leaves the others in place."""
    from array import array

    from render_service.harmony.turn_records import TurnRecords, first_record

    records = TurnRecords(80_000)  # (its largest entry: an eighth, 10,000 bytes)
    last = {"role": "user", "content": "Continue."}

    def record(tag: str, ids: int):
        messages = ({"role": "user", "content": tag}, last)
        flags = [(False, False)] * 2
        return messages, first_record(messages, (1, 2), {}, array("I", range(ids)), [ids // 2, ids], flags)

    small, other, huge = record("a", 400), record("b", 400), record("c", 5000)
    assert 10_000 // 2 < small[1].nbytes() <= 10_000 < huge[1].nbytes()
    records.put(small[1], None)
    records.put(other[1], None)  # the two do not fit together: the older one goes
    assert records.find(other[0], None) is other[1] and records.find(small[0], None) is None
    records.put(huge[1], None)
    assert records.find(other[0], None) is other[1] and records.find(huge[0], None) is None
