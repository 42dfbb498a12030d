"""Anthropic Messages bodies through the message memo: every turn of an agent conversation renders the ids it
renders without the memo, each distinct message is converted once, the template's loop resumes as on chat
bodies, and every refusal is the plain path's, word for word."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.render_harness import memo_and_plain_servers, post_both

PATH = "/v1/messages/render"
TOOLS = [
    {"name": "get_weather", "description": "Weather of a city", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "read_file", "input_schema": {"properties": {"path": {"type": "string"}}}},
]


def agent_turns(rounds: int) -> list[list[dict[str, Any]]]:
    """The messages of each turn of an agent loop: text, thinking, parallel tool calls, tool results with text
    after them, a result given as text blocks."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Plan a trip to three cities."}]
    turns = [copy.deepcopy(messages)]
    for r in range(rounds):
        calls = [{"type": "tool_use", "id": f"toolu_{r}_{c}", "name": "get_weather", "input": {"city": f"C{r}{c}"}}
                 for c in range(1 + r % 2)]
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"round {r}: look it up", "signature": "s"},
            {"type": "text", "text": f"Checking round {r}."}, *calls]})
        results: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": call["id"],
             "content": f"sunny {r}" if c % 2 == 0 else [{"type": "text", "text": f"rain {r}"}]}
            for c, call in enumerate(calls)]
        if r % 3 == 2:
            results.append({"type": "text", "text": "Also check the files."})
        messages.append({"role": "user", "content": results})
        turns.append(copy.deepcopy(messages))
    return turns


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": None, "max_tokens": 16, "system": [{"type": "text", "text": "You plan trips."}],
            "tools": TOOLS, "messages": messages, **extra}  # (``extra`` may replace the tools)


def chat_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The same conversation as a chat request (its ids differ: a Messages request without ``thinking`` turns the
    template's thinking off), for where its loop resumes."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "You plan trips."}]
    for m in messages:
        if isinstance(m["content"], str):
            out.append(m)
        elif m["role"] == "assistant":
            blocks = m["content"]
            out.append({"role": "assistant", "content": "".join(b["text"] for b in blocks if b["type"] == "text"),
                        "reasoning": "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
                        "tool_calls": [{"id": b["id"], "type": "function", "function": {
                            "name": b["name"], "arguments": json.dumps(b["input"])}}
                            for b in blocks if b["type"] == "tool_use"]})
        else:
            for b in m["content"]:
                if b["type"] == "tool_result":
                    text = b["content"] if isinstance(b["content"], str) else "\n".join(
                        part["text"] for part in b["content"])
                    out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
                else:
                    out.append({"role": "user", "content": b["text"]})
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description"),
                                               "parameters": {"type": "object", **t["input_schema"]}}}
             for t in TOOLS]
    return {"model": None, "messages": out, "tools": tools}


@pytest.fixture(scope="module")
def servers():
    with memo_and_plain_servers() as both_servers:
        yield both_servers


def both(servers, payload: dict[str, Any]) -> tuple[Any, Any]:
    return post_both(servers, PATH, payload)


def test_an_agent_conversation_renders_as_without_the_memo_and_converts_each_message_once(servers):
    config = servers[2]
    memo, records = config.message_memo, config.template.loop_records
    assert records is not None
    resumed = []
    for t, messages in enumerate(agent_turns(8)):
        misses, before = memo.misses, records.resumed
        got, want = both(servers, body(messages))
        assert got.status_code == want.status_code == 200, (got.text, want.text)
        assert got.json()["token_ids"] == want.json()["token_ids"], t
        resumed.append(records.resumed - before)
        if t:  # the messages the turn before sent are hits: only this turn's two are decoded
            assert memo.misses - misses == 2, t
    # the template's loop resumes on the same turns as on the same conversation sent as chat bodies (not on the
    # first turn after a new user text: Qwen3 compares each message's index with the last user query's)
    memo_server = servers[0]
    as_chat = []
    for messages in agent_turns(8):
        before = records.resumed
        reply = memo_server.client.post("/v1/chat/completions/render", json=chat_body(messages))
        assert reply.status_code == 200, reply.text
        as_chat.append(records.resumed - before)
    assert resumed == as_chat and sum(resumed) >= 6, (resumed, as_chat)


@pytest.mark.parametrize("change", [
    "result before its call", "unknown result id", "result in an assistant message", "bad block", "not an object",
    "system message in the list", "prefill", "prefill ending in whitespace", "empty list", "server tool",
    "tool without a schema", "no tools",
])
def test_a_request_the_memo_cannot_take_answers_as_the_plain_path(servers, change):
    messages = agent_turns(3)[-1]
    # the same messages once through the memo first, so that the request below finds them converted
    first, _ = both(servers, body(messages))
    assert first.status_code == 200
    if change == "result before its call":  # a converted message moved before the one with its tool_use
        messages = [messages[0], messages[2], messages[1], *messages[3:]]
    elif change == "unknown result id":
        messages = [*messages, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_none"}]}]
    elif change == "result in an assistant message":
        messages = [*messages, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "toolu_0_0"}]}]
    elif change == "bad block":
        messages = [*messages, {"role": "assistant", "content": [{"type": "video"}]}]
    elif change == "not an object":
        messages = [*messages, "hello"]
    elif change == "system message in the list":
        messages = [*messages, {"role": "system", "content": "Answer in French."},
                    {"role": "user", "content": "And now?"}]
    elif change == "prefill":
        messages = [*messages, {"role": "assistant", "content": "The plan is"}]
    elif change == "prefill ending in whitespace":
        messages = [*messages, {"role": "assistant", "content": "The plan is "}]
    elif change == "empty list":
        messages = []
    tools: Any = TOOLS
    if change == "server tool":
        tools = [*TOOLS, {"type": "web_search_20250305", "name": "web_search"}]
    elif change == "tool without a schema":
        tools = [{"name": "get_weather"}]
    elif change == "no tools":
        tools = []
    for _ in range(2):  # the second time finds whatever the first kept
        got, want = both(servers, body(messages, tools=tools))
        assert got.status_code == want.status_code, (got.text, want.text)
        assert got.json() == want.json() if got.status_code != 200 else \
            got.json()["token_ids"] == want.json()["token_ids"]


def test_the_same_message_at_another_place_is_one_entry(servers):
    config = servers[2]
    memo = config.message_memo
    question = {"role": "user", "content": "Which city first?"}
    answer = {"role": "assistant", "content": "Oslo."}
    first, _ = both(servers, body([question]))
    misses = memo.misses
    got, want = both(servers, body([question, answer, question]))
    assert got.json()["token_ids"] == want.json()["token_ids"]
    assert memo.misses - misses == 1  # only the answer was new


# ------------------------------------------------------------------ bodies over the body store's floor (32 KiB)

def long_turns(rounds: int) -> list[list[dict[str, Any]]]:
    """``agent_turns`` with a first user message long enough that every body is filed in the body store."""
    turns = agent_turns(rounds)
    task = "Plan a trip to three cities. " + "Keep notes on every stop. " * 1400
    for messages in turns:
        messages[0] = {"role": "user", "content": task}
    return turns


def chat_of(config, payload: dict[str, Any]) -> Any:
    """The chat messages a Messages body converts to through the memo, as the server's render takes them."""
    from render_service.apis.message_memo_anthropic import decode_messages_request
    from render_service.apis.messages import chat_messages

    req = decode_messages_request(json.dumps(payload).encode(), config.message_memo)
    assert req is not None
    return chat_messages(req)


def test_a_long_conversation_takes_its_earlier_messages_from_the_filed_body(servers):
    """Each turn's body starts with the one before: its earlier messages are taken from that body as converted,
    checked and prepared there (only the turn's own are walked), and every answer is the memo-less server's."""
    config = servers[2]
    memo = config.message_memo
    assert memo is not None and memo.bodies is not None
    system = [{"type": "text", "text": "You plan long trips."}]
    before = None
    for t, messages in enumerate(long_turns(7)):
        payload = body(messages, system=system)
        assert len(json.dumps(payload)) > memo.bodies.base
        got, want = both(servers, payload)
        assert got.status_code == want.status_code == 200, (got.text, want.text)
        assert got.json()["token_ids"] == want.json()["token_ids"], t
        chat = chat_of(config, payload)
        assert chat.filed is not None and chat.filed.tool_calls == sum(len(m.get("tool_calls") or ())
                                                                        for m in chat)
        if before is not None:  # the turn before's chat messages, all of them, as the same objects
            assert chat.shared_with is not None and chat.shared_with[1] == len(before)
            assert all(a is b for a, b in zip(chat.entries, before.entries))
        before = chat


@pytest.mark.parametrize("edit", ["a call taken out", "an answer rewritten", "another system prompt",
                                  "no system prompt"])
def test_a_body_sharing_part_of_a_filed_one_answers_as_the_plain_path(servers, edit):
    """Turns that share only a head of a filed body (an earlier message edited), or all its messages under another
    system prompt (written after the messages, so the bodies' heads are equal): the ids known before the edit
    are those of the shared messages only, and a result whose call was taken out is the plain path's 400."""
    turns = long_turns(6)
    messages = turns[-1]
    system: Any = [{"type": "text", "text": "You plan long trips."}]

    def sent(messages: list[dict[str, Any]], system: Any) -> dict[str, Any]:
        payload = {key: value for key, value in body(messages).items() if key not in ("messages", "system")}
        payload["messages"] = messages
        if system is not None:
            payload["system"] = system  # after the messages: a body's head does not tell the prompts apart
        return payload

    first, _ = both(servers, sent(turns[-2], system))
    assert first.status_code == 200
    edited = copy.deepcopy(messages)
    if edit == "a call taken out":  # its result, later on, now names an id no message before it has
        edited[3]["content"] = [block for block in edited[3]["content"] if block["type"] != "tool_use"]
    elif edit == "an answer rewritten":
        edited[5]["content"][1]["text"] = "Checking again."
    elif edit == "another system prompt":
        system = "You plan short trips."
    else:
        system = None
    for _ in range(2):  # the second time finds the edited body filed
        got, want = both(servers, sent(edited, system))
        assert got.status_code == want.status_code, (got.text, want.text)
        if got.status_code == 200:
            assert got.json()["token_ids"] == want.json()["token_ids"]
        else:
            assert got.json() == want.json() and edit == "a call taken out"


def test_a_chat_body_is_not_taken_for_a_messages_one(servers):
    """A body both APIs read alike (text messages only) filed by a chat render: the next Messages turn, its head
    the same bytes, does not take the chat body's messages (their entries are another API's)."""
    memo_server, _, config = servers
    assert config.message_memo is not None and config.message_memo.bodies is not None
    messages = [{"role": "user", "content": "Summarise: " + "a long report line. " * 2000},
                {"role": "assistant", "content": "It is long."}]
    chat = {"model": None, "max_tokens": 16, "messages": messages}
    assert memo_server.client.post("/v1/chat/completions/render", json=chat).status_code == 200
    reused = config.message_memo.bodies.reused
    grown = {**chat, "messages": [*messages, {"role": "user", "content": "Shorter?"}]}
    got, want = both(servers, grown)
    assert got.status_code == want.status_code == 200, (got.text, want.text)
    assert got.json()["token_ids"] == want.json()["token_ids"]
    assert config.message_memo.bodies.reused == reused  # nothing filed was taken for it
    again = {**grown, "messages": [*grown["messages"], {"role": "assistant", "content": "Yes."},
                                   {"role": "user", "content": "Thanks."}]}
    got, want = both(servers, again)
    assert got.json()["token_ids"] == want.json()["token_ids"]
    assert config.message_memo.bodies.reused == reused + 1  # the Messages body filed just before
