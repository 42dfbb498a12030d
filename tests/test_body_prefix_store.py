"""Recent chat bodies (render_service/wire/body_prefix_store.py): a body whose head a stored one shares is decoded with
the stored messages cut out, and decodes to exactly what the whole body decodes to, or is left to the usual decode
(and its usual error) where the cut does not apply."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from render_service.http.server import decode
from render_service.wire.body_prefix_store import BodyStore, StoredBody, element_offsets
from render_service.wire.message_memo import MessageMemo, decode_chat_request
from render_service.wire.protocol import ChatCompletionRequest
from tests.test_message_memo import MODEL, TOOLS, answer, config, growing_bodies

PLAIN = msgspec.json.Decoder(ChatCompletionRequest)
LONG = "a long line of tool output " * 60  # bodies past the store's 1 KiB base


def memo() -> MessageMemo:
    """A memo with recent bodies filed from 1 KiB on (the server's files them from 32 KiB)."""
    m = MessageMemo(1 << 24, 1 << 24)
    m.bodies = BodyStore(1 << 24, base=1024)
    return m


def same_as_plain(memo_: MessageMemo, body: bytes) -> ChatCompletionRequest | None:
    """The body through the memo; when it decodes, it must re-encode to what the plain decode re-encodes to."""
    got = memo_.decode_chat(body)
    if got is not None:
        assert msgspec.json.encode(got) == msgspec.json.encode(PLAIN.decode(body))
    return got


def body_of(messages: list[dict], separators: tuple[str, str] = (", ", ": "), **fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": messages, **fields}, separators=separators).encode()


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"step {i}: {LONG}"}, {"role": "assistant", "content": f"done {i}"}]
    return messages


def test_element_offsets_place_each_element_or_refuse():
    body = b'{"m": [ {"a": 1} ,\n\t{"b": [2, 3]},{"c": "x, y"} ]}'
    items = [b'{"a": 1}', b'{"b": [2, 3]}', b'{"c": "x, y"}']
    first = body.index(b'{"a"')
    starts, ends = element_offsets(body, first, items)
    assert [body[s:e] for s, e in zip(starts, ends)] == items
    assert element_offsets(body, first + 1, items) is None  # not where it says
    assert element_offsets(body.replace(b"},{", b"} {"), first, items) is None  # no comma between
    assert element_offsets(body, first, [items[0], b'{"b": [2, 4]}']) is None  # other bytes


def test_element_offsets_of_compact_elements_are_proved_by_one_comparison():
    """Elements separated by a bare comma are placed from their lengths once the body is checked to hold them
    joined; a body that differs anywhere in them is placed (or refused) by the walk."""
    items = [b'{"a":1}', b'"x,y"', b'[2,3]', b'{"b":"]"}']
    body = b'{"m":[' + b",".join(items) + b"]}"
    starts, ends = element_offsets(body, 6, items)
    assert [body[s:e] for s, e in zip(starts, ends)] == items
    assert element_offsets(body, 6, [*items[:2], b'[2,4]', items[3]]) is None
    assert element_offsets(body, 6, []) == ([], [])
    spaced = body.replace(b"],{", b"], {")
    starts, ends = element_offsets(spaced, 6, items)
    assert [spaced[s:e] for s, e in zip(starts, ends)] == items and starts[3] == ends[2] + 2


@pytest.mark.parametrize("seed", range(6))
def test_growing_conversations_decode_as_the_whole_body_does(seed):
    m = memo()
    for body in growing_bodies(100 + seed, 14, max_tokens=50):
        assert same_as_plain(m, body) is not None
    assert m.bodies is not None and m.bodies.reused > 5


def test_each_turn_reuses_the_previous_one_and_replaces_it():
    m = memo()
    messages = conversation(3)
    for turn in range(3, 9):
        messages += [{"role": "user", "content": f"more {turn} {LONG}"}]
        assert same_as_plain(m, body_of(messages, tools=TOOLS)) is not None
    assert m.bodies is not None and m.bodies.reused == 5 and len(m.bodies) == 1


def test_the_stored_body_sharing_the_most_messages_is_found_and_a_whole_one_wins_a_tie():
    m = memo()
    assert m.bodies is not None
    messages = conversation(3)  # 7 messages
    branch = [*messages[:5], {"role": "user", "content": f"another road {LONG}"}, *messages[6:],
              {"role": "assistant", "content": "and on"}]
    for body in (body_of(branch), body_of(messages[:5]), body_of(messages[:3])):  # 8, 5 and 3 messages
        m.decode_chat(body)
    assert len(m.bodies) == 3
    grown = body_of([*messages, {"role": "user", "content": "next"}])
    found = m.bodies.find(grown)
    # the branch (8 messages) shares 5 with it, as the first five (held whole) do: the whole one is taken
    assert found is not None and found[1] == 5 and len(found[0].ends) == 5
    same_as_plain(m, grown)
    assert len(m.bodies) == 3  # it replaced the five it holds whole
    longer = body_of([*messages, {"role": "user", "content": "next"}, {"role": "assistant", "content": "ok"}])
    found = m.bodies.find(longer)
    assert found is not None and found[1] == 8 and found[0].body == grown  # held whole, not the branch


@pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])
def test_what_follows_the_common_messages_is_decoded_from_the_new_body(separators):
    m = memo()
    messages = conversation(4)
    same_as_plain(m, body_of(messages, separators, max_tokens=5))
    cases = [
        body_of(messages, separators, max_tokens=9, temperature=0.5),  # other fields after the messages
        body_of(messages[:3], separators, max_tokens=5),  # fewer messages: the array closes after the common ones
        body_of(messages[:3] + [{"role": "user", "content": "new"}], separators),  # a new third message
        body_of([*messages[:5], {**messages[5], "content": "edited"}, *messages[6:]], separators),  # an edit inside
        body_of(messages + [{"role": "tool", "tool_call_id": "c", "content": LONG}], separators, tools=TOOLS),
        body_of([{"role": "system", "content": "Other."}] + messages[1:], separators),  # differs in the first
    ]
    for body in cases:
        assert same_as_plain(m, body) is not None


def test_bodies_the_cut_would_hide_a_fault_in_get_the_usual_error():
    m = memo()
    messages = conversation(4)
    good = body_of(messages)
    same_as_plain(m, good)
    head, _ = good.rsplit(b"]", 1)
    bad = [
        head + b", ]}",  # a trailing comma
        head + b",]}",
        head + b", 5]}",  # an element that is not a message
        head + b" {}]}",  # no comma
        head + b", {\"role\": \"user\", \"content\": \"x\"}",  # never closed
        head + b"]",  # the object never closed
        head + b"], \"messages\": 3}",  # a second messages key of the wrong type
    ]
    for body in bad:
        assert m.decode_chat(body) is None
        with pytest.raises(Exception) as usual:
            PLAIN.decode(body)
        with pytest.raises(type(usual.value)):
            decode_chat_request(body, m, lambda b, k: PLAIN.decode(b))
        assert m.decode_chat(good) is not None  # and the stored turn still serves


def test_a_second_messages_key_is_read_as_the_whole_body_reads_it():
    m = memo()
    messages = conversation(3)
    first = body_of(messages)
    same_as_plain(m, first)
    twice = first[:-1] + b', "messages": ' + json.dumps(messages[:2]).encode() + b"}"
    same_as_plain(m, twice)
    same_as_plain(m, twice[:-1] + b"}")


def test_the_store_is_bounded_and_drops_the_least_recently_used():
    store = BodyStore(64 * 1024, base=1024)
    kept = []
    for i in range(40):
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"{i} {LONG}"}]}).encode()
        stored = StoredBody(body, (body.index(b'{"role'),), (len(body) - 2,), (None,))
        store.add(stored)
        kept.append(stored)
        assert store.bytes <= store.max_bytes
    assert 0 < len(store) < 40
    assert store.find(kept[-1].body) is not None and store.find(kept[0].body) is None
    huge = b"x" * (64 * 1024)
    store.add(StoredBody(huge, (0,), (1,), (None,)))  # over a quarter of the bound: not kept
    assert store.find(huge) is None


def test_random_edits_of_a_stored_body_decode_as_the_whole_body_does():
    rng = random.Random(7)
    m = memo()
    messages = conversation(5)
    base = body_of(messages, tools=TOOLS, max_tokens=20)
    same_as_plain(m, base)
    for _ in range(300):
        body = bytearray(base)
        for _ in range(rng.randint(1, 3)):  # flip, drop or insert a byte somewhere after the head
            at = rng.randrange(200, len(body))
            choice = rng.random()
            if choice < 0.4:
                body[at] = rng.choice(b' ,]}{"\\:0a\n')
            elif choice < 0.7:
                del body[at]
            else:
                body.insert(at, rng.choice(b' ,]}{"\\:0a\n'))
        raw = bytes(body)
        try:
            want = msgspec.json.encode(PLAIN.decode(raw))
        except (msgspec.DecodeError, RecursionError):
            assert m.decode_chat(raw) is None
            continue
        got = m.decode_chat(raw)
        if got is not None:
            assert msgspec.json.encode(got) == want
        else:  # (the usual decode answers: the server's own decode path)
            assert msgspec.json.encode(decode(raw, ChatCompletionRequest)) == want


def test_the_server_configuration_renders_long_growing_conversations_as_without_the_memo():
    on, off = config(), config(0)  # the server's split of --render-cache-bytes: bodies from 32 KiB on
    messages = conversation(2)
    for turn in range(20):
        messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": f"c{turn}", "type": "function",
                      "function": {"name": "get_weather", "arguments": json.dumps({"city": f"city {turn}"})}}]},
                     {"role": "tool", "tool_call_id": f"c{turn}", "content": f"{turn}: {LONG}"}]
        body = body_of(messages, tools=TOOLS)
        assert answer(on, body) == answer(off, body)
    assert on.message_memo is not None and on.message_memo.bodies is not None
    assert len(body) > 32 * 1024 and on.message_memo.bodies.reused >= 3


def test_a_filed_body_carries_its_tool_call_count_through_growth_and_branches():
    """The parse context's ``history_tool_call_cnt``: a turn holding a whole filed body adds its own messages' calls
    to the body's count; a turn that shares only part of one counts afresh. Each equals the count over the
    messages as the plain decode gives them."""
    from render_service.wire.message_memo import history_tool_calls, tool_call_count

    rng = random.Random(3)
    m = memo()
    messages = conversation(1)
    carried = 0
    for turn in range(24):
        calls = [{"id": f"c{turn}.{i}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                 for i in range(rng.randint(0, 3))]
        messages += [{"role": "assistant", "content": None, "tool_calls": calls} if calls else
                     {"role": "assistant", "content": f"said {turn}"},
                     {"role": "tool" if calls else "user", "content": f"{turn}: {LONG}"}]
        if turn % 5 == 4:  # a branch: an earlier assistant turn rewritten with one call more
            at = rng.randrange(3, len(messages) - 2, 2)
            assert messages[at]["role"] == "assistant"
            more = [*(messages[at].get("tool_calls") or []), {"id": f"x{turn}", "type": "function",
                                                              "function": {"name": "get_weather", "arguments": "{}"}}]
            messages[at] = {"role": "assistant", "content": None, "tool_calls": more}
        body = body_of(messages, tools=TOOLS)
        got = same_as_plain(m, body)
        assert got is not None
        want = sum(tool_call_count(message) for message in PLAIN.decode(body).messages)
        assert history_tool_calls(got.messages) == want
        filed = got.messages.filed
        assert filed is not None and filed.tool_calls == want
        carried += got.messages.shared_with is not None and got.messages.shared_with[1] == len(
            got.messages.shared_with[0].entries)
    assert carried > 10


def test_a_filed_body_counts_its_image_messages_through_growth_and_branches():
    """Whether a request holds an image part is answered from the filed body's count on a growing turn (the server
    asks it of every chat render); a branch that rewrites an earlier message counts afresh. Each answer equals
    the one over the messages as the plain decode gives them."""
    from render_service.wire.message_memo import carries_image_parts, has_image_parts

    rng = random.Random(5)
    m = memo()
    messages = conversation(1)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    carried = 0
    seen = set()
    for turn in range(24):
        content: list[dict] | str = f"{turn}: {LONG}"
        if turn in (9, 17):  # a user message with an image part, then later ones without
            content = [{"type": "text", "text": f"{turn}: {LONG}"}, image]
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": f"said {turn}"}]
        if turn % 6 == 5:  # a branch: an earlier user message rewritten, with or without an image part
            at = rng.randrange(1, len(messages) - 2, 2)
            assert messages[at]["role"] == "user"
            text = f"rewritten {turn}: {LONG}"
            messages[at] = {"role": "user", "content": [{"type": "text", "text": text}, image]
                            if has_image_parts(messages[at]) == (turn % 12 == 5) else text}
        body = body_of(messages)
        got = same_as_plain(m, body)
        assert got is not None
        plain = PLAIN.decode(body).messages
        want = sum(map(has_image_parts, plain))
        assert carries_image_parts(got.messages) == carries_image_parts(plain) == (want > 0)
        filed = got.messages.filed
        assert filed is not None and filed.image_messages == want
        seen.add(want > 0)
        carried += got.messages.shared_with is not None and got.messages.shared_with[1] == len(
            got.messages.shared_with[0].entries)
    assert seen == {False, True} and carried > 10
