"""Responses bodies through the message memo and the body store: an agent resending its whole input every turn
renders the ids a memo-less server renders, each turn takes the chat messages of the items the turn before shared
(up to the last item after which no assistant turn was open) as that render made them, and every refusal is the
plain path's, word for word."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.render_harness import memo_and_plain_servers, post_both

PATH = "/v1/responses/render"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
TASK = "Plan a trip to three cities. " + "Keep notes on every stop. " * 1400  # every body past the store's 32 KiB


def call(call_id: str, city: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather",
            "arguments": json.dumps({"city": city})}


def output(call_id: str, text: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def said(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def thought(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def asked(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


# What each turn adds. A turn ending on an assistant message leaves that assistant turn open: the next turn's
# function call folds into it, so its items convert anew from the last item the turn before closed.
ADDED: list[list[dict[str, Any]]] = [
    [asked(TASK)],
    [thought("look up the first city"), said("Checking Oslo."), call("c1", "Oslo"), output("c1", "sunny")],
    [thought("two more"), call("c2", "Rome"), call("c3", "Lima"), output("c2", "rain"), output("c3", "fog")],
    [said("All three are checked.")],
    [call("c4", "Oslo"), output("c4", "snow")],
    [asked("Which one first?")],
    [thought("weigh them"), said("Rome first.")],
    [asked("Why?")],
]
# per turn: how many items of the turn before its chat messages are taken from (the last item it closed)
SHARED_ITEMS = [0, 1, 5, 10, 10, 13, 14, 14]


def turns() -> list[list[dict[str, Any]]]:
    out, items = [], []
    for added in ADDED:
        items = [*items, *copy.deepcopy(added)]
        out.append(items)
    return out


def body(items: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": None, "instructions": "You plan trips.", "tools": TOOLS, "input": items, **extra}


@pytest.fixture(scope="module")
def servers():
    with memo_and_plain_servers() as both_servers:
        yield both_servers


def test_a_growing_conversation_takes_the_chat_messages_of_the_items_it_shares(servers):
    """Each turn's body as the server filed it: the first only filed (a conversation seen once takes the plain
    way), the second converted whole, and from the third on the chat messages of the items shared with the turn
    before, up to the last item that closed its chat messages, are that turn's very objects."""
    memo_server, plain_server, config = servers
    bodies = config.message_memo.bodies
    before = None
    for t, items in enumerate(turns()):
        data = json.dumps(body(items), separators=(",", ":")).encode()
        assert len(data) > bodies.base
        got, want = (server.client.post(PATH, content=data, headers={"content-type": "application/json"})
                     for server in (memo_server, plain_server))
        assert got.status_code == want.status_code == 200, (got.text, want.text)
        assert got.json()["token_ids"] == want.json()["token_ids"], t
        filed, common = bodies.find(data, "responses")
        assert common == len(items)  # (this very body, filed)
        conversion = filed.converted.get("chat")
        if t == 0:
            assert conversion is None
            continue
        # this turn's last item left an assistant turn open (its end unknown), or closed every chat message
        assert conversion.ends[-1] == (-1 if t in (3, 6) else len(conversion.chat.entries))
        assert conversion.known == {f"c{i}" for i in range(1, 5) if any(item.get("call_id") == f"c{i}"
                                                                        for item in items)}
        if before is not None:
            taken = before.ends[SHARED_ITEMS[t] - 1]
            assert taken > 1 and conversion.ends[:SHARED_ITEMS[t]] == before.ends[:SHARED_ITEMS[t]]
            assert all(a is b for a, b in zip(conversion.chat.entries[:taken], before.chat.entries[:taken]))
            if taken < len(before.chat.entries):  # the turn left open before: its message converted again
                assert conversion.chat.entries[taken] is not before.chat.entries[taken]
        before = conversion


@pytest.mark.parametrize("change", ["unknown output id", "a call's id rewritten", "another instructions",
                                    "no instructions", "unknown item type", "not an object", "text input"])
def test_a_body_the_memo_cannot_take_whole_answers_as_the_plain_path(servers, change):
    """Bodies sharing all or part of a filed and converted one's items, each sent twice (the second finds the first
    filed): a call id known only to the items a branch left out is the plain path's 400, as are the other
    refusals."""
    items = turns()[-1]
    items[0] = asked(f"({change}) {TASK}")  # a conversation of its own: no other case's bodies are found for it
    for _ in range(2):  # filed, then converted: the bodies below find the conversion
        first, _ = post_both(servers, PATH, body(items))
        assert first.status_code == 200
    extra: dict[str, Any] = {}
    if change == "unknown output id":
        items = [*items, output("c9", "?")]
    elif change == "a call's id rewritten":  # c4's call, in a branch; its output, later on, names the old id
        items = copy.deepcopy(items)
        at = next(i for i, item in enumerate(items) if item.get("call_id") == "c4")
        items[at]["call_id"] = "c4b"
    elif change == "another instructions":
        extra["instructions"] = "You plan short trips."
    elif change == "no instructions":
        extra["instructions"] = None
    elif change == "unknown item type":
        items = [*items, {"type": "web_search_call", "id": "ws_1"}]
    elif change == "not an object":
        items = [*items, "hello"]
    else:
        items = TASK  # type: ignore[assignment]
    for _ in range(2):
        got, want = post_both(servers, PATH, body(items, **extra))
        assert got.status_code == want.status_code, (got.text, want.text)
        if got.status_code == 200:
            assert got.json()["token_ids"] == want.json()["token_ids"]
            assert change not in ("unknown output id", "a call's id rewritten", "unknown item type", "not an object")
        else:
            assert got.json() == want.json()
